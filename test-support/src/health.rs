//! A server's health, and waiting for it.

use std::time::Duration;

use tessera_proto::v1::{HealthRequest, HealthResponse, ParameterServerClient};
use tessera_rpc::{Channel, ChannelConfig, RpcError, TlsConfig};

use crate::wait::eventually;

/// Timeouts for calls of a test to a server on a loaded 2-core host.
pub fn patient() -> ChannelConfig {
    ChannelConfig {
        connect_timeout_ms: 2000,
        request_timeout_ms: 10_000,
        ..ChannelConfig::default()
    }
}

/// The health of the server at `addr` (over TCP).
pub async fn health(addr: &str) -> Result<HealthResponse, RpcError> {
    health_as(addr, None).await
}

/// The health of the server at `addr`, asked over TLS with `tls` where
/// given (a server with `[tls]` refuses everyone else).
pub async fn health_as(addr: &str, tls: Option<&TlsConfig>) -> Result<HealthResponse, RpcError> {
    let mut config = patient();
    config.transport.tls = tls.cloned();
    let channel = Channel::lazy(addr, config)?;
    ParameterServerClient::new(channel)
        .health(HealthRequest {})
        .await
}

/// The stream position of `shard`'s copy as a server's Health reports it
/// (0 when it reports none): what a test compares to know a copy took
/// Pushes.
pub fn shard_position(health: &HealthResponse, shard: u32) -> u64 {
    health
        .shard_health
        .iter()
        .find(|s| s.shard == shard)
        .and_then(|s| s.version)
        .map_or(0, |v| v.position)
}

/// Waits until the server at `addr` answers Health with something `ok`
/// accepts; panics with `what` and the last answer after `timeout`.
pub async fn wait_for_health(
    addr: &str,
    what: &str,
    timeout: Duration,
    ok: impl Fn(&HealthResponse) -> bool,
) -> HealthResponse {
    wait_for_health_as(addr, None, what, timeout, ok).await
}

/// [`wait_for_health`], asking over TLS with `tls` where given.
pub async fn wait_for_health_as(
    addr: &str,
    tls: Option<&TlsConfig>,
    what: &str,
    timeout: Duration,
    ok: impl Fn(&HealthResponse) -> bool,
) -> HealthResponse {
    eventually(timeout, &format!("{addr}: {what}"), || async {
        match health_as(addr, tls).await {
            Ok(h) if ok(&h) => Ok(h),
            Ok(h) => Err(format!("{h:?}")),
            Err(err) => Err(err.to_string()),
        }
    })
    .await
}

/// Waits until the server at `addr` serves every hosted shard and none is
/// recovering or catching up, and every replica shard is in step.
pub async fn wait_serving(addr: &str) -> HealthResponse {
    wait_serving_as(addr, None).await
}

/// [`wait_serving`], asking over TLS with `tls` where given.
pub async fn wait_serving_as(addr: &str, tls: Option<&TlsConfig>) -> HealthResponse {
    wait_for_health_as(addr, tls, "serving", Duration::from_secs(30), |h| {
        h.serving
            && h.state == tessera_proto::v1::ServerState::Serving as i32
            && h.shard_health.iter().all(|s| {
                s.role == tessera_proto::v1::ShardRole::Primary as i32
                    || (s.role == tessera_proto::v1::ShardRole::Replica as i32 && s.in_step)
            })
    })
    .await
}

/// Waits until the primary at `addr` has every replica of every shard it
/// leads attached and in step (confirmed), so that the next Push reaches
/// them through the stream (and, with `ack = "replicas"`, waits for them).
pub async fn wait_replicas_in_step(addr: &str) -> HealthResponse {
    wait_replicas_in_step_as(addr, None).await
}

/// [`wait_replicas_in_step`], asking over TLS with `tls` where given.
pub async fn wait_replicas_in_step_as(addr: &str, tls: Option<&TlsConfig>) -> HealthResponse {
    wait_for_health_as(
        addr,
        tls,
        "with its replicas in step",
        Duration::from_secs(30),
        |h| {
            h.shard_health
                .iter()
                .filter(|s| s.role == tessera_proto::v1::ShardRole::Primary as i32)
                .all(|s| s.replicas.iter().all(|r| r.in_step))
        },
    )
    .await
}
