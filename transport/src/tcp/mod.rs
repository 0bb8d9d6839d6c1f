//! The TCP transport: length-prefixed frames over tokio `TcpStream`s.
//!
//! Sending (`send.rs`): a caller writes its message itself when the socket
//! is free; under contention messages queue and the connection's writer
//! task writes as many as fit in `write_batch_bytes` with one vectored
//! write. Either way headers and payload parts go to `writev` as they are,
//! so a payload is never copied into a frame buffer. Reads go into a
//! growing receive buffer and whole frames are split off it without a copy.

mod frame;
mod send;

use std::net::SocketAddr;

use std::collections::VecDeque;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};

use crate::inbound::{InboundLimits, InboundPermit};
use crate::pool::{Pool, PoolBuf};

pub use frame::{FRAME_HEADER_LEN, FrameDecoder, body_len, encode_frame_header};
pub(crate) use send::TcpSender;

use crate::{TransportConfig, TransportError};

/// Most bytes of a large message read by one `read` call.
const LARGE_READ_STEP: usize = 256 << 10;

/// A task reading a large message yields to the runtime this often.
const YIELD_BYTES: usize = 256 << 10;

/// Most `iovec`s handed to one `writev` (Linux's `IOV_MAX` is 1024).
pub(super) const MAX_IOVECS: usize = 512;

/// What a TCP connection's frames travel on.
pub(crate) enum Wire {
    /// The socket itself.
    Plain(TcpStream),
    /// TLS over it (or any other byte stream).
    Secured(crate::tls::BoxStream),
}

/// The reading half of a connection's byte stream.
type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;
/// The writing half of a connection's byte stream.
pub(super) type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

/// Wraps an established connection to `peer` (`TCP_NODELAY` already set:
/// see [`crate::tls::prepare`]) and starts its writer task. Incoming
/// messages are read into buffers of `recv_pool`; an accepted connection's
/// reads obey `limits` (budget, timeouts: see [`crate::inbound`]).
pub(crate) fn setup(
    config: &TransportConfig,
    recv_pool: Pool,
    wire: Wire,
    peer: SocketAddr,
    limits: Option<InboundLimits>,
) -> (TcpSender, TcpReceiver) {
    let (read, plain, secured): (ReadHalf, _, Option<WriteHalf>) = match wire {
        Wire::Plain(stream) => {
            let (read, write) = stream.into_split();
            (Box::new(read), Some(write), None)
        }
        Wire::Secured(stream) => {
            let (read, write) = tokio::io::split(stream);
            (Box::new(read), None, Some(Box::new(write)))
        }
    };
    let tx = TcpSender::start(
        plain,
        secured,
        config.send_queue_depth,
        config.write_batch_bytes,
        config.max_message_size,
        peer,
    );
    let receiver = TcpReceiver {
        read,
        pool: recv_pool,
        chunk: None,
        start: 0,
        end: 0,
        ready: VecDeque::new(),
        max_message_size: config.max_message_size,
        chunk_size: config.read_buffer_bytes,
        failed: false,
        limits: limits.map(Box::new),
        received_messages: metrics::counter!("tessera_transport_messages_received_total", "transport" => "tcp"),
        received_bytes: metrics::counter!("tessera_transport_bytes_received_total", "transport" => "tcp"),
    };
    (tx, receiver)
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

/// Runs `step` within `deadline` (none: for as long as it takes). A
/// deadline already past fails before `step` is polled: `timeout_at` polls
/// its future first, so without this check a connection whose task runs
/// late would still be admitted or read from while its peer keeps bytes
/// coming, long after its bound.
async fn within<F: std::future::Future>(
    deadline: Option<(tokio::time::Instant, crate::Stall)>,
    step: F,
) -> Result<F::Output, TransportError> {
    match deadline {
        None => Ok(step.await),
        Some((at, stall)) => {
            if tokio::time::Instant::now() >= at {
                return Err(TransportError::Stalled(stall));
            }
            tokio::time::timeout_at(at, step)
                .await
                .map_err(|_| TransportError::Stalled(stall))
        }
    }
}

/// The receiving half of a TCP connection.
///
/// Reads go into pool buffers of `chunk_size` bytes. When a read completes
/// one or more frames, the buffer is frozen and each frame is handed out as
/// a slice of it (no copy); the start of a following, incomplete frame moves
/// to the next buffer (at most one read's worth of bytes). A frame larger
/// than half a buffer gets a pool buffer of its own size, and its body is
/// read straight into it.
pub(crate) struct TcpReceiver {
    read: ReadHalf,
    pool: Pool,
    /// The buffer being filled; bytes `start..end` are received and unparsed.
    chunk: Option<PoolBuf>,
    start: usize,
    end: usize,
    /// Whole frames already split off, in order.
    ready: VecDeque<Bytes>,
    max_message_size: u64,
    chunk_size: usize,
    failed: bool,
    /// An accepted connection's budget and deadlines; `None` for a dialed
    /// one.
    limits: Option<Box<InboundLimits>>,
    /// `tessera_transport_{messages,bytes}_received_total`, resolved once
    /// per connection rather than looked up per message.
    received_messages: metrics::Counter,
    received_bytes: metrics::Counter,
}

impl std::fmt::Debug for TcpReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpReceiver")
            .field("start", &self.start)
            .field("end", &self.end)
            .field("ready", &self.ready.len())
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl TcpReceiver {
    /// Whether whole frames are split off and waiting to be returned.
    pub(crate) fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    pub(crate) async fn recv(&mut self) -> Result<Option<Bytes>, TransportError> {
        if self.failed {
            return Err(TransportError::Closed);
        }
        let result = self.recv_inner().await;
        match &result {
            Ok(Some(frame)) => {
                self.received_messages.increment(1);
                self.received_bytes.increment(frame.len() as u64);
            }
            Ok(None) => {}
            Err(err) => {
                if let TransportError::Stalled(stall) = err {
                    metrics::counter!(crate::inbound::CLOSED_BY_LIMIT, "reason" => stall.label())
                        .increment(1);
                }
                self.failed = true;
            }
        }
        result
    }

    /// Reads from the socket into `buf`, within the deadline that applies
    /// now (an accepted connection's; none for a dialed one).
    async fn read_some(
        read: &mut ReadHalf,
        limits: &Option<Box<InboundLimits>>,
        buf: &mut [u8],
    ) -> Result<usize, TransportError> {
        let deadline = limits.as_ref().and_then(|l| l.deadlines.next());
        Ok(within(deadline, read.read(buf)).await??)
    }

    /// Records that bytes arrived (`partial`: a message is still
    /// incomplete).
    fn progressed(&mut self, bytes: bool, partial: bool) {
        if let Some(limits) = &mut self.limits {
            let now = tokio::time::Instant::now();
            match bytes {
                true => limits.deadlines.on_bytes(now, partial),
                false => limits.deadlines.on_progress(now, partial),
            }
        }
    }

    /// Budget for a large message of `len` bytes, the peer address's share
    /// first and then the server's, waited for within the message's
    /// deadline (`None` on a dialed connection).
    async fn admit(&mut self, len: usize) -> Result<Option<[InboundPermit; 2]>, TransportError> {
        let Some(limits) = &self.limits else {
            return Ok(None);
        };
        let wait = async {
            let address = limits.address.budget.acquire(len).await?;
            let server = limits.budget.acquire(len).await?;
            Some([address, server])
        };
        let deadline = limits.deadlines.next();
        let permits = within(deadline, wait).await?;
        // Budget that came after the message's deadline (its task was
        // polled late: many connections' timers fire at once when they
        // began together) goes back at once, before a buffer is allocated
        // for a message that is already too late.
        if let Some((at, stall)) = deadline
            && tokio::time::Instant::now() >= at
        {
            return Err(TransportError::Stalled(stall));
        }
        match permits {
            Some(permits) => Ok(Some(permits)),
            // Validation keeps both budgets above max_message_size.
            None => Err(TransportError::MessageTooLarge {
                len: len as u64,
                max: limits.address.budget.capacity() as u64,
            }),
        }
    }

    fn alloc(&self, len: usize) -> Result<PoolBuf, TransportError> {
        let mut buf = self.pool.alloc(len).map_err(TransportError::Memory)?;
        buf.set_len(len);
        Ok(buf)
    }

    async fn recv_inner(&mut self) -> Result<Option<Bytes>, TransportError> {
        loop {
            if let Some(frame) = self.ready.pop_front() {
                return Ok(Some(frame));
            }
            if let Some(chunk) = &self.chunk
                && let Some(len) = body_len(&chunk[self.start..self.end], self.max_message_size)?
            {
                let have = self.end - self.start;
                if have >= FRAME_HEADER_LEN + len {
                    self.split_frames()?;
                    continue;
                }
                if len > self.chunk_size / 2 {
                    return self.read_large(len).await.map(Some);
                }
                if self.start + FRAME_HEADER_LEN + len > self.chunk_size {
                    self.compact();
                }
            }
            let chunk = match &mut self.chunk {
                Some(chunk) => chunk,
                None => self.chunk.insert(self.alloc(self.chunk_size)?),
            };
            if self.end == chunk.len() {
                // A full buffer always holds a whole frame, a frame that goes
                // the large path, or a partial one not at the front.
                if self.start == 0 {
                    return Err(TransportError::Io(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "receive buffer full without a whole frame",
                    )));
                }
                self.compact();
                continue;
            }
            let Some(chunk) = self.chunk.as_mut() else {
                continue;
            };
            let read =
                Self::read_some(&mut self.read, &self.limits, &mut chunk[self.end..]).await?;
            if read == 0 {
                let have = self.end - self.start;
                if have == 0 {
                    return Ok(None);
                }
                let expected = self
                    .chunk
                    .as_ref()
                    .and_then(|c| body_len(&c[self.start..self.end], u64::MAX).ok().flatten())
                    .map_or(FRAME_HEADER_LEN as u64, |len| len as u64);
                return Err(TransportError::Truncated {
                    expected,
                    received: have.saturating_sub(FRAME_HEADER_LEN) as u64,
                });
            }
            self.end += read;
            if self.limits.is_some() {
                let partial = !self.holds_whole_frame();
                self.progressed(true, partial);
            }
        }
    }

    /// Whether the unparsed bytes are empty or begin with a whole frame
    /// (else a message is in progress).
    fn holds_whole_frame(&self) -> bool {
        let Some(chunk) = &self.chunk else {
            return true;
        };
        let unparsed = &chunk[self.start..self.end];
        if unparsed.is_empty() {
            return true;
        }
        match body_len(unparsed, u64::MAX) {
            Ok(Some(len)) => unparsed.len() >= FRAME_HEADER_LEN + len,
            _ => false,
        }
    }

    /// Moves the unparsed bytes to the front of the current buffer.
    fn compact(&mut self) {
        if let Some(chunk) = &mut self.chunk {
            chunk.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }

    /// Freezes the current buffer, queues every whole frame in it as a
    /// slice, and moves the incomplete rest (if any) to a fresh buffer.
    fn split_frames(&mut self) -> Result<(), TransportError> {
        let Some(chunk) = self.chunk.take() else {
            return Ok(());
        };
        let shared = chunk.freeze();
        let mut pos = self.start;
        while let Some(len) = body_len(&shared[pos..self.end], self.max_message_size)? {
            if self.end - pos < FRAME_HEADER_LEN + len {
                break;
            }
            self.ready
                .push_back(shared.slice(pos + FRAME_HEADER_LEN..pos + FRAME_HEADER_LEN + len));
            pos += FRAME_HEADER_LEN + len;
        }
        let rest = self.end - pos;
        self.start = 0;
        self.end = rest;
        if rest > 0 {
            let mut fresh = self.alloc(self.chunk_size)?;
            fresh[..rest].copy_from_slice(&shared[pos..pos + rest]);
            self.chunk = Some(fresh);
        }
        // Whatever follows the whole frames began in the last read; its
        // deadline runs from there.
        self.progressed(false, rest > 0);
        Ok(())
    }

    /// Reads a frame of `len` body bytes into a buffer of its own, once
    /// the inbound budget holds it (accepted connections): until then
    /// nothing is allocated and the socket is not read.
    async fn read_large(&mut self, len: usize) -> Result<Bytes, TransportError> {
        let permit = self.admit(len).await?;
        let mut body = self.alloc(len)?;
        let mut got = 0;
        if let Some(chunk) = &self.chunk {
            let have = self.end - self.start - FRAME_HEADER_LEN;
            let from = self.start + FRAME_HEADER_LEN;
            body[..have].copy_from_slice(&chunk[from..from + have]);
            got = have;
        }
        self.start = 0;
        self.end = 0;
        let mut since_yield = 0;
        while got < len {
            // At most a step per read: a large message is copied out of the
            // socket in slices, and every `YIELD_BYTES` the task lets the
            // runtime's other tasks run (small requests of other
            // connections are not held up behind a 64 MiB copy).
            let end = len.min(got + LARGE_READ_STEP);
            let read = Self::read_some(&mut self.read, &self.limits, &mut body[got..end]).await?;
            if read == 0 {
                return Err(TransportError::Truncated {
                    expected: len as u64,
                    received: got as u64,
                });
            }
            got += read;
            self.progressed(true, got < len);
            since_yield += read;
            if since_yield >= YIELD_BYTES && got < len {
                since_yield = 0;
                tokio::task::yield_now().await;
            }
        }
        // The budget stays held for as long as the message's bytes live
        // (the layers above decode fields as slices of it, and a handler
        // may hold them): it bounds what peers make this process hold, not
        // only what is still arriving.
        Ok(crate::inbound::budgeted(
            body,
            match permit {
                Some([address, server]) => [Some(address), Some(server)],
                None => [None, None],
            },
        ))
    }
}
