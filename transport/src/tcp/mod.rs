//! The TCP transport: length-prefixed frames over tokio `TcpStream`s.
//!
//! Each connection has a writer task that drains the connection's send queue
//! and writes as many queued messages as fit in `write_batch_bytes` with one
//! vectored write: headers and payload parts go to `writev` as they are, so a
//! payload is never copied into a frame buffer. Reads go into a growing
//! receive buffer and whole frames are split off it without a copy.

mod frame;

use std::io::IoSlice;
use std::net::SocketAddr;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

pub use frame::{FRAME_HEADER_LEN, FrameDecoder, encode_frame_header};

use crate::{Message, TransportConfig, TransportError};

/// Most `iovec`s handed to one `writev` (Linux's `IOV_MAX` is 1024).
const MAX_IOVECS: usize = 512;

/// Dials `addr` over TCP.
pub(crate) async fn connect(
    config: &TransportConfig,
    addr: &str,
) -> Result<(mpsc::Sender<Message>, TcpReceiver, SocketAddr), TransportError> {
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|source| TransportError::Connect {
            addr: addr.to_owned(),
            source,
        })?;
    setup(config, stream)
}

/// Wraps an established stream: sets `TCP_NODELAY` (RPCs are latency bound and
/// the writer batches on its own) and starts the writer task.
pub(crate) fn setup(
    config: &TransportConfig,
    stream: TcpStream,
) -> Result<(mpsc::Sender<Message>, TcpReceiver, SocketAddr), TransportError> {
    stream.set_nodelay(true)?;
    let peer = stream.peer_addr()?;
    let (read, write) = stream.into_split();
    let (tx, rx) = mpsc::channel(config.send_queue_depth);
    tokio::spawn(writer_loop(
        write,
        rx,
        config.write_batch_bytes,
        config.max_message_size,
        peer,
    ));
    let receiver = TcpReceiver {
        read,
        buf: BytesMut::with_capacity(config.read_buffer_bytes),
        decoder: FrameDecoder::new(config.max_message_size),
        read_buffer_bytes: config.read_buffer_bytes,
        failed: false,
    };
    Ok((tx, receiver, peer))
}

/// Binds a TCP listener.
pub(crate) async fn bind(addr: &str) -> Result<TcpListener, TransportError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| TransportError::Listen {
            addr: addr.to_owned(),
            source,
        })
}

async fn writer_loop(
    mut write: OwnedWriteHalf,
    mut queue: mpsc::Receiver<Message>,
    batch_bytes: usize,
    max_message_size: u64,
    peer: SocketAddr,
) {
    let mut batch: Vec<Message> = Vec::new();
    let mut headers: Vec<[u8; FRAME_HEADER_LEN]> = Vec::new();
    while let Some(first) = queue.recv().await {
        let mut bytes = first.len();
        let mut iovecs = 1 + first.parts().len();
        batch.push(first);
        while bytes < batch_bytes && iovecs < MAX_IOVECS {
            match queue.try_recv() {
                Ok(next) => {
                    bytes += next.len();
                    iovecs += 1 + next.parts().len();
                    batch.push(next);
                }
                Err(_) => break,
            }
        }
        headers.clear();
        for message in &batch {
            match encode_frame_header(message.len(), max_message_size) {
                Ok(header) => headers.push(header),
                Err(err) => {
                    // `MessageSender::send` checks sizes, so this is a bug;
                    // sending a wrong frame would desynchronise the peer.
                    tracing::error!(%peer, %err, "refusing to write an oversized frame; closing");
                    return;
                }
            }
        }
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(iovecs);
        for (message, header) in batch.iter().zip(&headers) {
            slices.push(IoSlice::new(header));
            slices.extend(message.parts().iter().map(|part| IoSlice::new(part)));
        }
        if let Err(err) = write_all_vectored(&mut write, &mut slices).await {
            tracing::debug!(%peer, %err, "TCP write failed; closing the connection");
            return;
        }
        metrics::counter!("tessera_transport_messages_sent_total", "transport" => "tcp")
            .increment(batch.len() as u64);
        metrics::counter!("tessera_transport_bytes_sent_total", "transport" => "tcp")
            .increment(bytes as u64);
        drop(slices);
        batch.clear();
    }
    // Every sender is gone: finish the stream so the peer sees a clean EOF.
    let _ = write.shutdown().await;
}

async fn write_all_vectored(
    write: &mut OwnedWriteHalf,
    mut slices: &mut [IoSlice<'_>],
) -> std::io::Result<()> {
    while !slices.is_empty() {
        let written = write.write_vectored(slices).await?;
        if written == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut slices, written);
    }
    Ok(())
}

/// The receiving half of a TCP connection.
#[derive(Debug)]
pub(crate) struct TcpReceiver {
    read: OwnedReadHalf,
    buf: BytesMut,
    decoder: FrameDecoder,
    read_buffer_bytes: usize,
    failed: bool,
}

impl TcpReceiver {
    pub(crate) async fn recv(&mut self) -> Result<Option<Bytes>, TransportError> {
        if self.failed {
            return Err(TransportError::Closed);
        }
        let result = self.recv_inner().await;
        if result.is_err() {
            self.failed = true;
        }
        result
    }

    async fn recv_inner(&mut self) -> Result<Option<Bytes>, TransportError> {
        loop {
            if let Some(frame) = self.decoder.decode(&mut self.buf)? {
                metrics::counter!("tessera_transport_messages_received_total", "transport" => "tcp")
                    .increment(1);
                metrics::counter!("tessera_transport_bytes_received_total", "transport" => "tcp")
                    .increment(frame.len() as u64);
                return Ok(Some(frame));
            }
            if self.buf.capacity() - self.buf.len() < self.read_buffer_bytes / 4 {
                self.buf.reserve(self.read_buffer_bytes);
            }
            if self.read.read_buf(&mut self.buf).await? == 0 {
                return match self.decoder.end_of_stream(&self.buf) {
                    None => Ok(None),
                    Some(err) => Err(err),
                };
            }
        }
    }
}
