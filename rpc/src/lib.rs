//! Tessera's RPC layer (the paper's Archon, §7).
//!
//! Services are defined in `.proto` files; `tessera-rpc-build` generates for
//! each a typed client over a [`Channel`] and a server trait whose
//! implementation is served by a [`Server`]. Messages travel over
//! `tessera-transport` as one frame each: a fixed [`wire::RpcHeader`]
//! followed by the protobuf body.
//!
//! This layer owns request ids, matching responses to callers, deadlines
//! (connection timeout and request timeout, separately), status codes and
//! graceful shutdown. It never names a transport implementation detail: it
//! sees only whole messages.

mod channel;
pub mod codegen;
mod config;
mod context;
mod descriptor;
mod endpoint;
mod error;
pub mod grpc;
pub mod observe;
pub mod policy;
mod replicas;
mod server;
mod silence;
mod status;
pub mod wire;

pub use channel::{CallOptions, Channel};
pub use config::{ChannelConfig, ServerConfig};
pub use context::RequestContext;
pub use descriptor::{MethodDescriptor, ServiceDescriptor, method_id, service_tag};
pub use endpoint::Endpoint;
pub use error::{LinkClosed, NoReplica, RpcError, ServerError};
pub use replicas::{ReplicaEndpoint, ReplicaSet, ReplicaSetConfig};
pub use server::{Server, ServerBuilder, Service, shutdown_signal};
pub use status::{Code, Status};
pub use tessera_config::{ConfigError, Validate};
/// Host checks for the transport (`tessera doctor`).
pub use tessera_transport::doctor;
pub use tessera_transport::inbound;
pub use tessera_transport::pool::PoolError;
pub use tessera_transport::sync;
pub use tessera_transport::tls;
pub use tessera_transport::warn_limit;
pub use tessera_transport::{
    ConnectionGate, GateTicket, InboundConfig, PeerIdentity, RdmaConfig, RdmaProvider, Stall,
    TlsConfig, Transport, TransportConfig, TransportError, TransportKind,
};
