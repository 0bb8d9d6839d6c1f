//! The RPC layer's errors: what a call returns ([`RpcError`], with why no
//! replica was left, [`NoReplica`], and why a link closed, [`LinkClosed`]),
//! and what binding a server returns ([`ServerError`]).

use std::sync::Arc;
use std::time::Duration;

use tessera_config::ConfigError;
use tessera_transport::TransportError;

use crate::{Code, Status};

/// Why a call failed, as seen by the client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// The server answered with an error status.
    #[error("server returned {0}")]
    Status(#[from] Status),
    /// No connection could be established within the connection timeout.
    #[error("connecting to {addr} timed out after {timeout:?}")]
    ConnectTimeout {
        /// The server's address.
        addr: String,
        /// The timeout that expired (Tc, or less if the deadline was nearer).
        timeout: Duration,
        /// The dial this call waited for (see [`RpcError::event`]).
        event: u64,
    },
    /// Establishing the connection failed.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The server's address.
        addr: String,
        /// The transport's reason.
        source: TransportError,
        /// The dial this call waited for (see [`RpcError::event`]).
        event: u64,
    },
    /// The call's deadline passed before a response arrived.
    #[error("deadline of {0:?} exceeded")]
    DeadlineExceeded(Duration),
    /// The connection broke while the call was outstanding.
    #[error("connection to {addr} lost: {reason}")]
    ConnectionLost {
        /// The server's address.
        addr: String,
        /// What ended the connection (shared by every call that was
        /// outstanding on it).
        reason: Arc<LinkClosed>,
        /// The connection that broke (see [`RpcError::event`]).
        event: u64,
    },
    /// The request could not be handed to the transport.
    #[error("request to {addr} not sent: {source}")]
    Send {
        /// The server's address.
        addr: String,
        /// The transport's reason.
        source: TransportError,
    },
    /// No send-pool memory for the request.
    #[error("no buffer memory for the request: {0}")]
    Memory(#[source] tessera_transport::pool::PoolError),
    /// The channel's configuration is invalid (boxed: it is rare, and a
    /// small error keeps every call's `Result` small).
    #[error(transparent)]
    Config(Box<ConfigError>),
    /// The response body is not a valid message of the expected type.
    #[error("response does not decode: {0}")]
    Decode(#[from] prost::DecodeError),
    /// A replica set had no replica left to try.
    #[error("no replica available: {0}")]
    NoReplica(NoReplica),
    /// The request is larger than the transport's `max_message_size`: it
    /// was not sent, and no replica would take it (final, not retried, no
    /// replica's fault).
    #[error("request of {len} bytes exceeds max_message_size ({max})")]
    MessageTooLarge {
        /// Its size in bytes.
        len: u64,
        /// The limit.
        max: u64,
    },
}

/// Why a call had no server to go to ([`RpcError::NoReplica`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NoReplica {
    /// The replica set has no replica.
    #[error("the replica set is empty")]
    EmptySet,
    /// No server is known for the shard (no primary yet).
    #[error("no server of shard {0}")]
    Shard(u32),
    /// The server a redirect or the coordinator named is not in the
    /// caller's configuration.
    #[error("{0} is not configured")]
    NotConfigured(String),
}

/// Why a client connection ended, as the calls outstanding on it learn
/// ([`RpcError::ConnectionLost`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LinkClosed {
    /// The server closed it (stopping or restarting) without saying it
    /// had answered every request it read: an unanswered call may have
    /// been applied.
    #[error("closed by the server")]
    ByServer,
    /// A stopping server closed it after answering every request it read
    /// ([`crate::wire::FLAG_DRAINED`]): an unanswered call was never read
    /// and did no work.
    #[error("closed by a stopping server before it read the request")]
    Drained,
    /// The server sent a request where only answers may come.
    #[error("the server sent a request on a client connection")]
    RequestFromServer,
    /// An answer's RPC header did not decode.
    #[error("malformed response: {0}")]
    Malformed(#[source] crate::wire::WireError),
    /// The transport failed (reset, framing, an RDMA error).
    #[error(transparent)]
    Transport(TransportError),
    /// Calls timed out for this long with nothing heard from the server:
    /// the link is presumed dead.
    #[error("calls timed out for {0:?} with nothing heard: the link went silent")]
    Silent(Duration),
    /// The task reading the connection's answers stopped without saying
    /// why.
    #[error("connection reader stopped")]
    ReaderStopped,
}

impl From<ConfigError> for RpcError {
    fn from(err: ConfigError) -> Self {
        RpcError::Config(Box::new(err))
    }
}

impl RpcError {
    /// The status code that best describes the failure.
    pub fn code(&self) -> Code {
        match self {
            RpcError::Status(status) => status.code(),
            RpcError::DeadlineExceeded(_) => Code::DeadlineExceeded,
            RpcError::ConnectTimeout { .. }
            | RpcError::Connect { .. }
            | RpcError::ConnectionLost { .. }
            | RpcError::Send { .. }
            | RpcError::NoReplica(_) => Code::Unavailable,
            RpcError::Decode(_) => Code::Internal,
            RpcError::Memory(_) | RpcError::MessageTooLarge { .. } => Code::ResourceExhausted,
            RpcError::Config(_) => Code::InvalidArgument,
        }
    }

    /// The dial or connection whose failure this is, numbered per channel:
    /// every call that failed with one broken connection (or waited for one
    /// failed dial) carries the same number, so that recovery policies
    /// count the failure once, not once per call. `None` for other errors.
    pub fn event(&self) -> Option<u64> {
        match self {
            RpcError::ConnectTimeout { event, .. }
            | RpcError::Connect { event, .. }
            | RpcError::ConnectionLost { event, .. } => Some(*event),
            _ => None,
        }
    }

    /// Whether the request may not have reached the server at all (a
    /// connection-level failure), as opposed to a failure reported by it.
    pub fn is_connection_failure(&self) -> bool {
        matches!(
            self,
            RpcError::ConnectTimeout { .. }
                | RpcError::Connect { .. }
                | RpcError::Send { .. }
                | RpcError::NoReplica(_)
        )
    }
}

/// Why a server could not be built or run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// Two registered methods share a wire id.
    #[error("method {new} collides with {existing} (both have id {id:#010x})")]
    DuplicateMethod {
        /// The method already registered.
        existing: &'static str,
        /// The method being added.
        new: &'static str,
        /// Their common id.
        id: u32,
    },
    /// The listener could not be bound.
    #[error(transparent)]
    Bind(TransportError),
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A service requires a role, but the transport does not authenticate
    /// peers (no `[transport.tls]`), so no caller could ever show one.
    #[error("service {service} requires the role `{role}`, which needs TLS ([transport.tls])")]
    RoleWithoutTls {
        /// The service.
        service: String,
        /// The role.
        role: String,
    },
    /// `require_role` named a service that was not added.
    #[error("require_role: no service named {0} was added")]
    UnknownService(String),
}
