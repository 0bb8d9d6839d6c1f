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
//!
//! A service's server and a call to it. `tessera-rpc-build` writes the
//! descriptor, the dispatcher and a typed client from a `.proto` file (the
//! guide "Defining your own service" walks through it); here they are
//! written by hand, with raw bytes for messages:
//!
//! ```
//! use std::time::{Duration, Instant};
//! use tessera_rpc::codegen::{BoxFuture, Bytes, Message};
//! use tessera_rpc::{
//!     Channel, ChannelConfig, MethodDescriptor, RequestContext, Server, ServerConfig, Service,
//!     ServiceDescriptor, Status, method_id, service_tag,
//! };
//!
//! static ECHO: ServiceDescriptor = ServiceDescriptor {
//!     name: "demo.Echo",
//!     methods: &[MethodDescriptor {
//!         name: "Echo",
//!         path: "/demo.Echo/Echo",
//!         id: method_id("/demo.Echo/Echo"),
//!         service: service_tag("demo.Echo"),
//!         idempotent: true,
//!     }],
//! };
//!
//! struct Echo;
//!
//! impl Service for Echo {
//!     fn descriptor(&self) -> &'static ServiceDescriptor {
//!         &ECHO
//!     }
//!     fn call(&self, _: u32, _: RequestContext, body: Bytes) -> BoxFuture<'static, Result<Message, Status>> {
//!         Box::pin(async move { Ok(Message::from(body)) })
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let server = Server::builder(ServerConfig::default())
//!     .add_service(Echo)?
//!     .bind("127.0.0.1:0")
//!     .await?;
//! let addr = server.local_addr().to_string();
//! let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
//! let serving = tokio::spawn(server.serve_with_shutdown(async move { let _ = stopped.await; }));
//!
//! let channel = Channel::connect(addr, ChannelConfig::default()).await?;
//! let timeout = Duration::from_secs(5);
//! let answer = channel
//!     .call_raw(ECHO.methods[0].id, Message::from(b"hello".to_vec()), Instant::now() + timeout, timeout)
//!     .await?;
//! assert_eq!(&answer[..], b"hello");
//!
//! let _ = stop.send(());
//! serving.await?;
//! # Ok(())
//! # }
//! ```

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
