//! Tessera's transport layer (the paper's ByteExpress, §4–§6).
//!
//! The transport moves *whole messages* between two endpoints. It knows
//! nothing about RPCs, methods or replicas: the RPC layer above it frames a
//! header and a protobuf body into a [`Message`] and hands it to a
//! [`MessageSender`]; the peer's [`MessageReceiver`] yields the same bytes as
//! one contiguous [`bytes::Bytes`].
//!
//! Two implementations sit behind the same API, chosen by [`TransportKind`]
//! in the configuration, so the RPC layer is written once: TCP ([`tcp`]) and
//! RDMA ([`rdma`]: engines on RC queue pairs, driven by I/O threads, over
//! the verbs providers in [`verbs`]).
//!
//! One message each way over TCP (`kind = "rdma"` with the `soft`
//! provider runs the same code over the RDMA engine):
//!
//! ```
//! use tessera_transport::{Message, Transport, TransportConfig};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let transport = Transport::new(TransportConfig::default())?;
//! let listener = transport.listen("127.0.0.1:0").await?;
//! let addr = listener.local_addr()?.to_string();
//! let echo = tokio::spawn(async move {
//!     let mut conn = listener.accept().await?;
//!     while let Some(bytes) = conn.receiver.recv().await? {
//!         conn.sender.send(Message::from(bytes)).await?;
//!     }
//!     Ok::<_, tessera_transport::TransportError>(())
//! });
//! let mut conn = transport.connect(&addr).await?;
//! conn.sender.send(Message::from(b"ping".to_vec())).await?;
//! let answer = conn.receiver.recv().await?;
//! assert_eq!(answer.as_deref(), Some(&b"ping"[..]));
//! drop(conn);
//! echo.await??;
//! # Ok(())
//! # }
//! ```

mod config;
mod connection;
pub mod doctor;
mod error;
pub mod inbound;
mod message;
// The allocator is one of the two places allowed `unsafe` (with the verbs
// providers): mapping memory and handing out raw object addresses.
#[allow(unsafe_code)]
pub mod pool;
pub mod rdma;
pub use tessera_sync as sync;
pub mod tcp;
pub mod tls;
// The verbs providers are the other place allowed `unsafe`: a software
// RNIC writes into registered memory the way a NIC's DMA would.
#[allow(unsafe_code)]
pub mod verbs;
pub mod warn_limit;

pub use config::{
    AllDevices, Devices, Polling, RdmaConfig, RdmaProvider, SoftRail, TransportConfig,
    TransportKind,
};
pub use connection::{Connection, Listener, MessageReceiver, MessageSender, Transport};
pub use error::{HandshakeError, RdmaError, TransportError};
pub use inbound::{ConnectionGate, GateTicket, InboundConfig, Stall};
pub use message::Message;
pub use tessera_config::ConfigError;
pub use tls::{PeerIdentity, TlsConfig, TlsError};
