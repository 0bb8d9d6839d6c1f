//! The RDMA transport's engine layer (the paper's ByteExpress engine,
//! §5.3–§5.4), over the verbs provider trait in [`crate::verbs`].
//!
//! The sans-IO engine ([`engine`]) and its parts: the control header
//! ([`control`]), the work-request ring ([`ring`]), receive credits
//! ([`credits`]) and the send window ([`window`]); the I/O threads that
//! drive engines and the handshake and connection table
//! ([`connection`]).

pub mod connection;
pub mod control;
pub mod credits;
pub mod engine;
pub(crate) mod io;
pub mod ring;
pub mod window;

pub use credits::ReceiveCredits;
pub use engine::{
    Engine, EngineConfig, EngineError, EngineEvent, EngineStats, KeepaliveConfig, PeerInfo, Role,
    SocketId,
};
pub use ring::WorkRequestRing;
pub use window::{SendWindow, WindowConfig};

#[cfg(test)]
mod tests;
