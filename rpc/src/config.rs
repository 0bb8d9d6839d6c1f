use std::time::Duration;

use serde::{Deserialize, Serialize};
use tessera_config::{ConfigError, Validate, invalid};
use tessera_transport::TransportConfig;

/// Settings of a client [`crate::Channel`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ChannelConfig {
    /// Connection timeout Tc, in milliseconds: how long establishing a
    /// connection may take (it is also bounded by the call's deadline).
    /// Default 100 ms. The paper uses 10 ms in a fleet with retries on
    /// other replicas; until retries land, a connection that cannot be made
    /// is an error returned to the application, so the default leaves room
    /// for a loaded host's scheduling delays.
    pub connect_timeout_ms: u64,
    /// Request timeout Tr, in milliseconds: the default deadline of a call,
    /// counted from the moment it is issued. Default 1000 ms, for the same
    /// reason (the paper's 40 ms assumes retries).
    pub request_timeout_ms: u64,
    /// The transport under the channel.
    pub transport: TransportConfig,
}

impl Default for ChannelConfig {
    fn default() -> Self {
        Self {
            connect_timeout_ms: 100,
            request_timeout_ms: 1000,
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
    /// The transport the server listens on.
    pub transport: TransportConfig,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            shutdown_grace_ms: 5000,
            transport: TransportConfig::default(),
        }
    }
}

impl Validate for ServerConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.transport.validate()
    }
}
