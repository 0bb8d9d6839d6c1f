//! The RDMA transport's engine layer (the paper's ByteExpress engine,
//! §5.3–§5.4), over the verbs provider trait in [`crate::verbs`].
//!
//! This step has the sans-IO engine and its parts: the control header
//! ([`control`]), the work-request ring ([`ring`]) and receive credits
//! ([`credits`]). The I/O driver that runs engines on I/O threads, the
//! connection handshake and the `transport = "rdma"` setting come next.

pub mod connection;
pub mod control;
pub mod credits;
pub mod engine;
pub mod ring;

pub use credits::ReceiveCredits;
pub use engine::{Engine, EngineConfig, EngineError, EngineEvent, EngineStats};
pub use ring::WorkRequestRing;

#[cfg(test)]
mod tests;
