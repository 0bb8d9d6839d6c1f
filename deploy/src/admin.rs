//! `tessera admin ...`: one running server's `Health` and `Admin` calls
//! (stats, checkpoint), or a worker's `WorkerAdmin` (quarantine).

use clap::Subcommand;

type BoxError = Box<dyn std::error::Error>;

#[derive(Debug, Subcommand)]
pub(crate) enum AdminAction {
    /// A server's health: state, shards, primaries, tables.
    Health {
        /// The ps-server (`host:port`).
        server: String,
    },
    /// Per-shard rows, bytes, fetches, pushes and evictions of a server.
    Stats {
        /// The ps-server (`host:port`).
        server: String,
    },
    /// Save a checkpoint on a server now.
    Checkpoint {
        /// The ps-server (`host:port`).
        server: String,
    },
    /// List (and with `--clear` readmit) the servers a worker quarantined.
    Quarantine {
        /// The worker's `admin_listen` address.
        worker: String,
        /// Readmit them all after listing.
        #[arg(long)]
        clear: bool,
    },
}

/// A channel for an admin call: generous timeouts (a checkpoint of a big
/// server takes a while), TCP, mutual TLS with `tls` where given.
async fn admin_channel(
    addr: &str,
    tls: Option<&tessera_rpc::TlsConfig>,
) -> Result<tessera_rpc::Channel, BoxError> {
    Ok(tessera_deploy::status::tool_channel(
        addr,
        tls,
        std::time::Duration::from_secs(2),
        std::time::Duration::from_secs(600),
    )
    .await?)
}

#[allow(clippy::print_stdout)]
pub(crate) async fn admin(
    action: AdminAction,
    tls: Option<&tessera_rpc::TlsConfig>,
) -> Result<(), BoxError> {
    use tessera_proto::v1::{
        AdminClient, CheckpointRequest, HealthRequest, ParameterServerClient, QuarantineRequest,
        ServerState, StatsRequest, WorkerAdminClient,
    };
    match action {
        AdminAction::Health { server } => {
            let health = ParameterServerClient::new(admin_channel(&server, tls).await?)
                .health(HealthRequest {})
                .await?;
            let state = ServerState::try_from(health.state).map_or("unknown", |s| s.as_str_name());
            println!(
                "{server}: {state}, replica group {}, shards {:?} of {}, primary of {:?}, coordinator {}",
                health.replica_group,
                health.shards,
                health.num_shards,
                health.primary_shards,
                if health.coordinator.is_empty() {
                    "static"
                } else {
                    &health.coordinator
                }
            );
            print!("{}", format_shard_health(&health.shard_health));
            for table in &health.tables {
                println!(
                    "  table {}: dim {}, {} rows",
                    table.name, table.dim, table.rows
                );
            }
        }
        AdminAction::Stats { server } => {
            let stats = AdminClient::new(admin_channel(&server, tls).await?)
                .stats(StatsRequest {})
                .await?;
            println!(
                "| table | shard | storage | rows | payload bytes | memory bytes | bytes/row | records | index | free | overhead | snapshots | fetches | pushes | evictions | candidates | admitted | admission bytes | expired |"
            );
            println!(
                "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
            );
            for s in &stats.shards {
                let memory = s.record_bytes
                    + s.index_bytes
                    + s.free_bytes
                    + s.overhead_bytes
                    + s.snapshot_bytes;
                let per_row = if s.rows > 0 {
                    format!("{:.1}", memory as f64 / s.rows as f64)
                } else {
                    "-".to_owned()
                };
                println!(
                    "| {} | {} | {} | {} | {} | {memory} | {per_row} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    s.table,
                    s.shard,
                    s.storage,
                    s.rows,
                    s.bytes,
                    s.record_bytes,
                    s.index_bytes,
                    s.free_bytes,
                    s.overhead_bytes,
                    s.snapshot_bytes,
                    s.fetches,
                    s.pushes,
                    s.evictions,
                    s.admission_candidates,
                    s.rows_admitted,
                    s.admission_bytes,
                    s.rows_expired
                );
            }
        }
        AdminAction::Checkpoint { server } => {
            let saved = AdminClient::new(admin_channel(&server, tls).await?)
                .checkpoint(CheckpointRequest {})
                .await?;
            println!(
                "{server}: checkpoint {} ({} rows, {} bytes)",
                saved.path, saved.rows, saved.bytes
            );
        }
        AdminAction::Quarantine { worker, clear } => {
            let listed = WorkerAdminClient::new(admin_channel(&worker, tls).await?)
                .quarantine(QuarantineRequest { clear })
                .await?;
            if listed.servers.is_empty() {
                println!("{worker}: no server quarantined");
            }
            for s in &listed.servers {
                println!(
                    "shard {} server {}: excluded for {:.0} s more ({} ejections in a row){}",
                    s.shard,
                    s.address,
                    s.seconds_left,
                    s.ejections,
                    if clear { ", readmitted" } else { "" }
                );
            }
        }
    }
    Ok(())
}

/// Each shard's replication as a table: role, epoch, version, primary,
/// and a replica's stream or a primary's replicas.
fn format_shard_health(shards: &[tessera_proto::v1::ShardHealth]) -> String {
    use std::fmt::Write as _;
    use tessera_proto::v1::ShardRole;
    let mut out = String::from(
        "| shard | role | epoch | version | primary | stream | replicas (lag in pushes) |\n|---:|---|---:|---|---|---|---|\n",
    );
    for s in shards {
        let role = ShardRole::try_from(s.role).map_or("unknown", |r| {
            r.as_str_name().trim_start_matches("SHARD_ROLE_")
        });
        let version = s
            .version
            .map_or_else(|| "-".to_owned(), |v| format!("{}:{}", v.epoch, v.position));
        let stream = if s.role == ShardRole::Replica as i32 {
            format!(
                "{}{}, heard {} ms ago{}",
                if s.in_step { "in step" } else { "out of step" },
                if s.syncing { ", copying" } else { "" },
                s.stream_age_ms,
                if s.receiving { "" } else { ", NOT RECEIVING" }
            )
        } else if s.fenced {
            "FENCED (lease not confirmed)".to_owned()
        } else {
            "-".to_owned()
        };
        let replicas = s
            .replicas
            .iter()
            .map(|r| {
                format!(
                    "{} {} {}",
                    r.address,
                    if r.in_step {
                        "in step"
                    } else if r.attached {
                        "attaching"
                    } else {
                        "detached"
                    },
                    r.lag_pushes
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        let _ = writeln!(
            out,
            "| {} | {role} | {} | {version} | {} | {stream} | {} |",
            s.shard,
            s.epoch,
            if s.primary.is_empty() {
                "none"
            } else {
                &s.primary
            },
            if replicas.is_empty() { "-" } else { &replicas }
        );
    }
    out
}
