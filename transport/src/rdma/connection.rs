//! RDMA connections: the out-of-band handshake and the thread that drives
//! one engine.
//!
//! **Handshake.** The dialer connects over TCP to the listener's address;
//! each side creates its queue pair and posts its receives. The dialer sends
//! a [`Hello`] (protocol version, QP number, LID/GID, PSN, receive depth,
//! message limit); the listener connects its QP to it and answers with its
//! own; the dialer connects and confirms with one byte, after which both
//! may send. A different version is refused with a clear error. The TCP connection stays open as the liveness channel:
//! when either side goes away, the other sees it close (the keepalive
//! issue adds periodic sequence numbers on the QP itself).
//!
//! **Driver.** In this step each connection has its own driver thread that
//! feeds the engine with messages to send and completions, posts what it
//! emits, and hands received messages to the async side through a channel;
//! when idle it spins briefly, then parks with a growing timeout (up to
//! 1 ms). Shared I/O threads with one CQ each, event mode and QP
//! multiplexing are the next issue's.

use std::collections::VecDeque;
use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::engine::{Engine, EngineConfig, EngineEvent};
use crate::pool::Pool;
use crate::verbs::{CompletionQueue, Device, QpCaps, QpEndpoint, QueuePair, WorkCompletion};
use crate::{Message, TransportConfig, TransportError};

/// Version of the RDMA connection protocol (handshake and control header).
pub const PROTOCOL_VERSION: u16 = 2;
/// First bytes of every hello (how an `auto` listener tells RDMA from TCP).
pub const HELLO_MAGIC: &[u8; 4] = b"TSRD";
/// Bytes of a hello.
pub const HELLO_LEN: usize = 64;
/// The dialer's last handshake byte: its QP is connected too.
const READY: u8 = 0x52;

/// What each side tells the other at connection setup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version.
    pub version: u16,
    /// The sender's queue pair.
    pub endpoint: QpEndpoint,
    /// Receives the sender has posted (the peer's initial credits).
    pub recv_depth: u32,
    /// Largest message the sender accepts.
    pub max_message: u64,
}

impl Hello {
    fn encode(&self) -> [u8; HELLO_LEN] {
        let mut out = [0u8; HELLO_LEN];
        out[0..4].copy_from_slice(HELLO_MAGIC);
        out[4..6].copy_from_slice(&self.version.to_le_bytes());
        out[8..12].copy_from_slice(&self.endpoint.qpn.to_le_bytes());
        out[12..14].copy_from_slice(&self.endpoint.lid.to_le_bytes());
        out[16..32].copy_from_slice(&self.endpoint.gid);
        out[32..36].copy_from_slice(&self.endpoint.psn.to_le_bytes());
        out[36..40].copy_from_slice(&self.recv_depth.to_le_bytes());
        out[40..48].copy_from_slice(&self.endpoint.node.to_le_bytes());
        out[48..56].copy_from_slice(&self.max_message.to_le_bytes());
        out
    }

    /// Decodes a hello; anything but the Tessera RDMA handshake is refused.
    pub fn decode(raw: &[u8; HELLO_LEN]) -> Result<Self, TransportError> {
        if &raw[0..4] != HELLO_MAGIC {
            return Err(TransportError::Rdma(
                "peer does not speak the Tessera RDMA handshake".into(),
            ));
        }
        let u32_at = |i: usize| u32::from_le_bytes([raw[i], raw[i + 1], raw[i + 2], raw[i + 3]]);
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&raw[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&raw[16..32]);
        Ok(Self {
            version: u16::from_le_bytes([raw[4], raw[5]]),
            endpoint: QpEndpoint {
                qpn: u32_at(8),
                lid: u16::from_le_bytes([raw[12], raw[13]]),
                gid,
                psn: u32_at(32),
                node: u64_at(40),
            },
            recv_depth: u32_at(36),
            max_message: u64_at(48),
        })
    }
}

/// What the async side keeps of an RDMA connection.
pub(crate) struct RdmaChannels {
    pub(crate) sender: mpsc::Sender<Message>,
    pub(crate) receiver: mpsc::Receiver<Result<Bytes, TransportError>>,
    pub(crate) driver: std::thread::Thread,
}

/// Sets up an RDMA connection over the handshake stream `stream` and starts
/// its driver.
pub(crate) async fn establish(
    device: &Arc<dyn Device>,
    transport: &TransportConfig,
    (send_pool, recv_pool): (Pool, Pool),
    mut stream: TcpStream,
    dialer: bool,
) -> Result<RdmaChannels, TransportError> {
    let config = &transport.rdma;
    let max_message_size = transport.max_message_size;
    let send_queue_depth = transport.send_queue_depth;
    let rdma = |e: crate::verbs::VerbsError| TransportError::Rdma(e.to_string());
    let send_cq = device
        .create_cq(config.send_queue_depth * 2)
        .map_err(rdma)?;
    let recv_cq = device
        .create_cq(config.recv_queue_depth * 2)
        .map_err(rdma)?;
    let caps = QpCaps {
        max_send_wr: config.send_queue_depth,
        max_recv_wr: config.recv_queue_depth,
        max_sge: 4,
    };
    let qp = device
        .create_qp(Arc::clone(&send_cq), Arc::clone(&recv_cq), caps)
        .map_err(rdma)?;
    let engine_config = EngineConfig {
        send_queue_depth: config.send_queue_depth,
        recv_queue_depth: config.recv_queue_depth,
        small_message_limit: config.small_message_limit,
        fragment_size: config.fragment_size,
        max_sge: caps.max_sge,
        max_message_size,
    };
    let mut engine = Engine::new(engine_config, send_pool, recv_pool, 0);
    // Receives go up before the peer can learn of them.
    if let Some(wrs) = engine.poll_recv_post() {
        qp.post_recv(&wrs).map_err(rdma)?;
    }
    let mine = Hello {
        version: PROTOCOL_VERSION,
        endpoint: qp.endpoint(),
        recv_depth: config.recv_queue_depth,
        max_message: max_message_size,
    };
    // Three legs, so that neither side sends before the other's QP is
    // connected (a SEND into a QP that is not ready is lost, and an RC QP
    // retries it until it gives up): the listener connects before it
    // answers, the dialer confirms once it has connected too.
    let mut raw = [0u8; HELLO_LEN];
    let check = |raw: &[u8; HELLO_LEN]| -> Result<Hello, TransportError> {
        let theirs = Hello::decode(raw)?;
        if theirs.version != PROTOCOL_VERSION {
            return Err(TransportError::Rdma(format!(
                "peer speaks RDMA protocol version {}, this build {PROTOCOL_VERSION}",
                theirs.version
            )));
        }
        Ok(theirs)
    };
    let theirs = if dialer {
        stream.write_all(&mine.encode()).await?;
        stream.read_exact(&mut raw).await?;
        let theirs = check(&raw)?;
        qp.connect(&theirs.endpoint).map_err(rdma)?;
        stream.write_all(&[READY]).await?;
        theirs
    } else {
        // A stranger (a TCP-transport client, a port scanner) is turned
        // away at its first bytes rather than at the handshake timeout.
        stream.read_exact(&mut raw[..HELLO_MAGIC.len()]).await?;
        if &raw[..HELLO_MAGIC.len()] != HELLO_MAGIC {
            return Err(TransportError::Rdma(
                "peer does not speak the Tessera RDMA handshake".into(),
            ));
        }
        stream.read_exact(&mut raw[HELLO_MAGIC.len()..]).await?;
        let theirs = check(&raw)?;
        qp.connect(&theirs.endpoint).map_err(rdma)?;
        stream.write_all(&mine.encode()).await?;
        let mut ready = [0u8; 1];
        stream.read_exact(&mut ready).await?;
        if ready[0] != READY {
            return Err(TransportError::Rdma(
                "peer did not confirm the RDMA connection".into(),
            ));
        }
        theirs
    };
    engine.grant_credits(u16::try_from(theirs.recv_depth).unwrap_or(u16::MAX));
    let control = stream.into_std()?;
    control.set_nonblocking(true)?;
    let (command_tx, command_rx) = mpsc::channel(send_queue_depth);
    let (event_tx, event_rx) = mpsc::channel(1024);
    let driver = Driver {
        qp,
        send_cq,
        recv_cq,
        engine,
        commands: command_rx,
        events: event_tx,
        control,
    };
    let handle = std::thread::Builder::new()
        .name("tessera-rdma".into())
        .spawn(move || driver.run())?;
    Ok(RdmaChannels {
        sender: command_tx,
        receiver: event_rx,
        driver: handle.thread().clone(),
    })
}

// Field order is drop order: the queue pair goes before the engine, so no
// buffer the engine owns is freed while the NIC could still write into it.
struct Driver {
    qp: Arc<dyn QueuePair>,
    send_cq: Arc<dyn CompletionQueue>,
    recv_cq: Arc<dyn CompletionQueue>,
    engine: Engine,
    commands: mpsc::Receiver<Message>,
    events: mpsc::Sender<Result<Bytes, TransportError>>,
    control: std::net::TcpStream,
}

/// Received messages held back while the application's queue is full.
const BACKLOG_LIMIT: usize = 256;

impl Driver {
    fn run(mut self) {
        let mut backlog: VecDeque<Bytes> = VecDeque::new();
        let mut completions: Vec<WorkCompletion> = Vec::with_capacity(64);
        let mut senders_gone = false;
        let mut idle_rounds: u32 = 0;
        let mut failure: Option<String> = None;
        loop {
            let mut progress = false;
            while !senders_gone {
                match self.commands.try_recv() {
                    Ok(message) => {
                        progress = true;
                        if let Err(err) = self.engine.send(message) {
                            failure = Some(err.to_string());
                        }
                    }
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => senders_gone = true,
                }
            }
            if let Some(wrs) = self.engine.poll_recv_post() {
                progress = true;
                if let Err(err) = self.qp.post_recv(&wrs) {
                    failure = Some(err.to_string());
                }
            }
            while let Some(batch) = self.engine.poll_transmit() {
                progress = true;
                if let Err(err) = self.qp.post_send(&batch) {
                    failure = Some(err.to_string());
                    break;
                }
            }
            completions.clear();
            self.send_cq.poll(&mut completions, 64);
            // Stop taking receives while the application is behind: credits
            // then stop flowing back and the peer waits.
            if backlog.len() < BACKLOG_LIMIT {
                self.recv_cq.poll(&mut completions, 64);
            }
            for completion in &completions {
                self.engine.handle_completion(completion);
                progress = true;
            }
            while let Some(event) = self.engine.poll_event() {
                match event {
                    EngineEvent::Message(bytes) => backlog.push_back(bytes),
                    EngineEvent::Failed(err) => failure = Some(err.to_string()),
                }
            }
            while let Some(message) = backlog.pop_front() {
                match self.events.try_send(Ok(message)) {
                    Ok(()) => progress = true,
                    Err(mpsc::error::TrySendError::Full(Ok(message))) => {
                        backlog.push_front(message);
                        break;
                    }
                    Err(_) => {
                        // The application dropped its receiver.
                        backlog.clear();
                        break;
                    }
                }
            }
            if let Some(reason) = failure.take() {
                tracing::debug!(%reason, "rdma connection failed");
                let _ = self.events.try_send(Err(TransportError::Rdma(reason)));
                break;
            }
            let peer_gone = !progress && self.peer_closed();
            if peer_gone && backlog.is_empty() {
                break;
            }
            if senders_gone && self.events.is_closed() && self.engine.is_idle() {
                break;
            }
            if progress {
                idle_rounds = 0;
            } else {
                idle_rounds = idle_rounds.saturating_add(1);
                if idle_rounds < 256 {
                    std::hint::spin_loop();
                } else if idle_rounds < 512 {
                    std::thread::yield_now();
                } else {
                    let micros = u64::from((idle_rounds - 511).min(1000));
                    std::thread::park_timeout(Duration::from_micros(micros));
                }
            }
        }
        let _ = self.control.shutdown(std::net::Shutdown::Both);
    }

    /// Whether the peer closed the handshake connection (its liveness
    /// channel).
    fn peer_closed(&mut self) -> bool {
        let mut byte = [0u8; 1];
        match self.control.read(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => false,
            Err(_) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips_and_refuses_strangers() {
        let hello = Hello {
            version: PROTOCOL_VERSION,
            endpoint: QpEndpoint {
                qpn: 0x1234,
                lid: 7,
                gid: [9; 16],
                psn: 0xabcdef,
                node: 42,
            },
            recv_depth: 64,
            max_message: 64 << 20,
        };
        assert_eq!(Hello::decode(&hello.encode()).unwrap(), hello);
        let mut raw = hello.encode();
        raw[0] = b'X';
        assert!(Hello::decode(&raw).is_err());
    }
}
