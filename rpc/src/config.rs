//! The RPC layer's configuration: a client channel's ([`ChannelConfig`]:
//! timeouts, connections, transport) and a server's ([`ServerConfig`]),
//! each with documented defaults and a check that names the key.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tessera_config::{ConfigError, Validate, invalid};
use tessera_transport::TransportConfig;

/// Most connections one channel may keep ([`ChannelConfig::connections`]):
/// more buys nothing on a host with fewer cores, and each one holds a
/// reader task and buffers at both ends.
pub const MAX_CONNECTIONS: usize = 64;

/// Settings of a client [`crate::Channel`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ChannelConfig {
    /// Connection timeout Tc, in milliseconds: how long establishing a
    /// connection may take (it is also bounded by the call's deadline).
    /// Default 10 ms, the paper's: inside a data centre a connection that
    /// takes longer is to a node in trouble, and a [`crate::ReplicaSet`]
    /// has other replicas to try.
    pub connect_timeout_ms: u64,
    /// Request timeout Tr, in milliseconds: the deadline of one call on a
    /// channel (of one attempt, in a replica set), counted from the moment
    /// it is issued. Default 40 ms, the paper's: a PS Fetch or Push is
    /// answered in well under a millisecond when healthy, so 40 ms means
    /// the server or the path is in trouble and another replica should be
    /// tried.
    pub request_timeout_ms: u64,
    /// Connections the channel keeps to its server, its calls spread over
    /// them in turn. Default 1: a worker multiplexes every call to a
    /// server over one connection, and each connection costs the server a
    /// reader and buffers. Raise it for large answers under many
    /// concurrent calls over TCP: one TCP connection is serialized in the
    /// kernel (one socket lock, its receive work on one core); in the rpc
    /// benchmark, Fetches of 256 KiB with 32 callers went from 0.44x of
    /// the bare-TCP floor's rate on one connection to 0.48-0.57x on 8 and
    /// 0.68-0.73x on 16 (2 cores). Over
    /// RDMA the connections are sockets multiplexed on the peer's queue
    /// pairs (see `rdma.multiplex`).
    pub connections: usize,
    /// RDMA-to-TCP fallback for this destination (`[fallback]`); used
    /// when the transport is `rdma`.
    pub fallback: crate::policy::FallbackConfig,
    /// The transport under the channel.
    pub transport: TransportConfig,
}

impl Default for ChannelConfig {
    fn default() -> Self {
        Self {
            connect_timeout_ms: 10,
            request_timeout_ms: 40,
            connections: 1,
            fallback: crate::policy::FallbackConfig::default(),
            transport: TransportConfig::default(),
        }
    }
}

impl ChannelConfig {
    /// The connection timeout Tc.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    /// The request timeout Tr.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }
}

impl Validate for ChannelConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.connect_timeout_ms == 0 {
            return Err(invalid("connect_timeout_ms", "must be at least 1"));
        }
        if self.request_timeout_ms == 0 {
            return Err(invalid("request_timeout_ms", "must be at least 1"));
        }
        if !(1..=MAX_CONNECTIONS).contains(&self.connections) {
            return Err(invalid(
                "connections",
                format!("{} is outside 1..={MAX_CONNECTIONS}", self.connections),
            ));
        }
        self.fallback.validate()?;
        self.transport.validate()
    }
}

/// Settings of an RPC [`crate::Server`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// On shutdown, how long in-flight requests may take to finish before
    /// their connections are dropped, in milliseconds. Default 5000 ms:
    /// longer than any sane request deadline, short enough for a rolling
    /// restart.
    pub shutdown_grace_ms: u64,
    /// Requests one connection may have in flight; one more is answered
    /// `ResourceExhausted` at once, unrun. Default 1024: a worker
    /// multiplexes all its calls to a server over one connection and keeps
    /// tens in flight; a thousand is a client gone wrong or hostile, and
    /// bounds the tasks and request buffers one connection can hold.
    pub max_requests_per_connection: usize,
    /// The transport the server listens on.
    pub transport: TransportConfig,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            shutdown_grace_ms: 5000,
            max_requests_per_connection: 1024,
            transport: TransportConfig::default(),
        }
    }
}

impl Validate for ServerConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.max_requests_per_connection == 0 {
            return Err(invalid("max_requests_per_connection", "must be at least 1"));
        }
        self.transport.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_outside_their_range_are_refused_by_name() {
        for connections in [0, MAX_CONNECTIONS + 1] {
            let config = ChannelConfig {
                connections,
                ..ChannelConfig::default()
            };
            let err = config.validate().unwrap_err();
            assert!(
                matches!(&err, ConfigError::Invalid { key, .. } if key == "connections"),
                "{err:?}"
            );
        }
        for connections in [1, MAX_CONNECTIONS] {
            let config = ChannelConfig {
                connections,
                ..ChannelConfig::default()
            };
            assert!(config.validate().is_ok());
        }
    }
}
