//! The standard gRPC health protocol (`grpc.health.v1.Health`) on the gRPC
//! endpoint, so that Kubernetes' native gRPC probes, `grpc_health_probe`
//! and service meshes can ask a server whether to send it traffic.
//!
//! The protocol and its server come from `tonic-health` (the tonic
//! project's own implementation, with `Watch` streaming) rather than a
//! hand-written service: the wire contract is the standard one, and a
//! well-kept crate keeps it so. This module only decides the status:
//! `SERVING` when every hosted shard is served (each shard readable: not
//! recovering, not copying its first state), `NOT_SERVING` otherwise and
//! from the moment the server starts shutting down. The overall status
//! (service `""`) and `tessera.ps.v1.ParameterServer` carry the same
//! value; the Tessera RPC `Health` call gives the detail per shard. When
//! the endpoint stops, `Watch` streams end (a stream in flight would
//! otherwise hold up the graceful stop for good).

use std::sync::Arc;
use std::time::Duration;

use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::replication::Replication;

/// The gRPC name of the service whose status is reported besides the
/// overall one.
pub const PS_SERVICE: &str = "tessera.ps.v1.ParameterServer";

/// How often the status is recomputed. A probe period is seconds; a shard
/// that becomes readable shows within this.
const REFRESH: Duration = Duration::from_millis(200);

/// The status a server in `replication`'s state reports.
pub fn status_of(replication: &Replication) -> ServingStatus {
    if replication.caught_up() {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    }
}

/// Sets `status` for the overall health and the parameter-server service.
pub async fn report(reporter: &HealthReporter, status: ServingStatus) {
    reporter.set_service_status("", status).await;
    reporter.set_service_status(PS_SERVICE, status).await;
}

/// Keeps the reported status up to date until aborted.
pub async fn keep_reporting(reporter: HealthReporter, replication: Arc<Replication>) {
    let mut last = None;
    let mut ticks = tokio::time::interval(REFRESH);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let status = status_of(&replication);
        if last != Some(status) {
            tracing::info!(?status, "gRPC health status");
            report(&reporter, status).await;
            last = Some(status);
        }
    }
}

/// Ends every health `Watch` stream (its statuses are cleared: a watcher
/// sees the stream end after the last status sent).
pub async fn end_watches(mut reporter: HealthReporter) {
    reporter.clear_service_status("").await;
    reporter.clear_service_status(PS_SERVICE).await;
}
