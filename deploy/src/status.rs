//! `tessera status`: one line per server of a cluster (its health, shards,
//! primaries and epochs, transport, replication lag), from the servers
//! themselves (their `Health` call), as a table or as JSON.
//!
//! The servers are named by address, or by a run directory of `tessera
//! up` (its `worker.toml` lists them). A server that does not answer is a
//! row too, with the error: a status tool is used when things are wrong.

use std::path::Path;
use std::time::Duration;

use serde::Serialize;
use tessera_proto::v1::{
    HealthRequest, ParameterServerClient, ServerState, ShardHealth, ShardRole,
};

/// How long one server may take to answer.
const TIMEOUT: Duration = Duration::from_secs(3);

/// One hosted shard as its server reports it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ShardStatus {
    /// The shard.
    pub shard: u32,
    /// `primary`, `replica`, `recovering`, ...
    pub role: String,
    /// The primary's epoch (the one it is, or follows).
    pub epoch: u64,
    /// The primary's address, as this server knows it (empty: none).
    pub primary: String,
    /// Replica: in step with its primary's stream.
    pub in_step: bool,
    /// Replica: copying the shard.
    pub syncing: bool,
    /// Replica: milliseconds since the primary's stream was heard.
    pub stream_age_ms: u64,
    /// Primary: the largest queue of Pushes of one of its replicas.
    pub max_replica_lag_pushes: u64,
    /// Primary: its replicas in step.
    pub replicas_in_step: usize,
    /// Primary: its replicas.
    pub replicas: usize,
    /// Primary: its lease is not confirmed, so it refuses Pushes.
    pub fenced: bool,
}

/// One server's row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServerStatus {
    /// Where it was asked.
    pub address: String,
    /// Whether it answered.
    pub reachable: bool,
    /// Why not, when it did not.
    pub error: Option<String>,
    /// `SERVING`, `CATCHING_UP`, `RECOVERING`, ...
    pub state: String,
    /// Every hosted shard is served.
    pub serving: bool,
    /// Its replica group (failure domain); `None` when it did not answer.
    pub replica_group: Option<u32>,
    /// The shards it hosts.
    pub shards: Vec<u32>,
    /// The shards it is the primary of.
    pub primary_of: Vec<u32>,
    /// Its configured transport (`tcp`, `rdma`, `auto`); `None` when it
    /// did not answer (or is older than the field).
    pub transport: Option<String>,
    /// `static` or `etcd`; `None` when it did not answer.
    pub coordinator: Option<String>,
    /// Every hosted shard.
    pub shard_health: Vec<ShardStatus>,
    /// Rows it holds, all tables and shards together.
    pub rows: u64,
    /// Bytes those rows take in its memory (0 from a server older than
    /// the field).
    pub store_bytes: u64,
    /// Feature admission, all tables together: rows admitted and Pushes
    /// of ids without a row counted since it started, and the bytes of
    /// its sketches (zeros without admission).
    pub rows_admitted: u64,
    /// See `rows_admitted`.
    pub admission_candidates: u64,
    /// See `rows_admitted`.
    pub admission_bytes: u64,
    /// Rows removed by expiry since it started, all tables together.
    pub rows_expired: u64,
    /// Its checkpoints; `None` without a checkpoint directory (or when it
    /// did not answer).
    pub checkpoint: Option<CheckpointStatus>,
    /// A serving server: how fresh its rows are (`None` otherwise).
    pub feed: Option<FeedStatus>,
    /// A training server with `[delta]`: its streams, one per shard it
    /// leads.
    pub delta: Vec<DeltaStatus>,
    /// The cluster's shard map as the server last read it (etcd mode).
    pub shard_map: Option<tessera_coord::ShardMap>,
}

/// A serving server's freshness, over the training shards feeding it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FeedStatus {
    /// The training fleet's shard count (0: no delta heard yet).
    pub source_shards: u32,
    /// Training shards followed (in step with their stream).
    pub following: usize,
    /// Training shards being copied (out of their stream).
    pub copying: usize,
    /// The largest time since a training shard's last delta was applied.
    pub max_applied_age_ms: u64,
    /// The largest delay of a last delta's oldest change (training Push to
    /// serving visibility).
    pub max_delay_ms: u64,
    /// Within `serving.max_delay_ms` (always without a bound).
    pub fresh: bool,
    /// The bound (0: none).
    pub bound_ms: u64,
}

/// One shard's delta stream at a training primary.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeltaStatus {
    /// The shard.
    pub shard: u32,
    /// The last delta's number, and the position it reached.
    pub seq: u64,
    /// See `seq`.
    pub position: u64,
    /// Rows sent since it started.
    pub rows_sent: u64,
    /// Deltas that failed to reach, or were dropped for, a serving server.
    pub failed: u64,
    /// See `failed`.
    pub dropped: u64,
    /// Cuts that waited for a serving server keeping up with a full queue.
    pub waited: u64,
}

impl FeedStatus {
    fn of(feed: &tessera_proto::v1::ServingHealth) -> Self {
        Self {
            source_shards: feed.source_shards,
            following: feed
                .sources
                .iter()
                .filter(|s| !s.copying && s.seq > 0)
                .count(),
            copying: feed.sources.iter().filter(|s| s.copying).count(),
            max_applied_age_ms: feed
                .sources
                .iter()
                .map(|s| s.applied_age_ms)
                .max()
                .unwrap_or(0),
            max_delay_ms: feed.sources.iter().map(|s| s.delay_ms).max().unwrap_or(0),
            fresh: feed.fresh,
            bound_ms: feed.max_delay_ms,
        }
    }

    /// The table's cell.
    fn cell(&self) -> String {
        let mut cell = format!(
            "fed by {}/{} training shards, delay {} ms, applied {} ms ago",
            self.following, self.source_shards, self.max_delay_ms, self.max_applied_age_ms
        );
        if self.copying > 0 {
            cell.push_str(&format!(", copying {}", self.copying));
        }
        if !self.fresh {
            cell.push_str(&format!(", STALE (bound {} ms)", self.bound_ms));
        }
        cell
    }
}

/// How a server's checkpoints are going.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CheckpointStatus {
    /// The checkpoint directory.
    pub dir: String,
    /// How long ago the last save succeeded; `None`: none since it started.
    pub last_success_age_ms: Option<u64>,
    /// Why the last save failed (path and cause), until one succeeds.
    pub last_error: Option<String>,
    /// Saves failed in a row.
    pub consecutive_failures: u32,
    /// A save is running.
    pub saving: bool,
}

impl CheckpointStatus {
    fn of(health: &tessera_proto::v1::CheckpointHealth) -> Self {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Self {
            dir: health.dir.clone(),
            last_success_age_ms: (health.last_success_unix_ms > 0)
                .then(|| now.saturating_sub(health.last_success_unix_ms)),
            last_error: (!health.last_error.is_empty()).then(|| health.last_error.clone()),
            consecutive_failures: health.consecutive_failures,
            saving: health.saving,
        }
    }

    /// The table's cell: `FAILING` first, so that it stands out.
    fn cell(&self) -> String {
        let last = self
            .last_success_age_ms
            .map_or("none yet".to_owned(), |ms| format!("{} s ago", ms / 1000));
        match &self.last_error {
            Some(error) => format!(
                "FAILING x{} (last ok: {last}): {}",
                self.consecutive_failures,
                error.replace('|', "/")
            ),
            None if self.saving => format!("saving (last ok: {last})"),
            None => format!("ok: {last}"),
        }
    }
}

impl ServerStatus {
    fn unreachable(address: &str, error: String) -> Self {
        Self {
            address: address.to_owned(),
            reachable: false,
            error: Some(error),
            state: "UNREACHABLE".into(),
            serving: false,
            replica_group: None,
            shards: Vec::new(),
            primary_of: Vec::new(),
            transport: None,
            coordinator: None,
            shard_health: Vec::new(),
            rows: 0,
            store_bytes: 0,
            rows_admitted: 0,
            admission_candidates: 0,
            admission_bytes: 0,
            rows_expired: 0,
            checkpoint: None,
            feed: None,
            delta: Vec::new(),
            shard_map: None,
        }
    }

    /// The table's cell: rows, memory per row, and what admission and
    /// expiry did.
    fn rows_cell(&self) -> String {
        let rows = match (self.rows, self.store_bytes) {
            (0, _) => "0".to_owned(),
            (rows, 0) => rows.to_string(),
            (rows, bytes) => format!("{rows} ({:.1} B/row)", bytes as f64 / rows as f64),
        };
        let rows = match self.admission_candidates {
            0 => rows,
            candidates => format!(
                "{rows}; admitted {} of {candidates} candidate pushes, sketch {} KiB",
                self.rows_admitted,
                self.admission_bytes / 1024
            ),
        };
        match self.rows_expired {
            0 => rows,
            expired => format!("{rows}; {expired} expired"),
        }
    }
}

fn shard_status(s: &ShardHealth) -> ShardStatus {
    let role = ShardRole::try_from(s.role).map_or_else(
        |_| "unknown".to_owned(),
        |r| {
            r.as_str_name()
                .trim_start_matches("SHARD_ROLE_")
                .to_ascii_lowercase()
        },
    );
    ShardStatus {
        shard: s.shard,
        role,
        epoch: s.epoch,
        primary: s.primary.clone(),
        in_step: s.in_step,
        syncing: s.syncing,
        stream_age_ms: s.stream_age_ms,
        max_replica_lag_pushes: s.replicas.iter().map(|r| r.lag_pushes).max().unwrap_or(0),
        replicas_in_step: s.replicas.iter().filter(|r| r.in_step).count(),
        replicas: s.replicas.len(),
        fenced: s.fenced,
    }
}

/// A channel for an operator's tool to `addr`: TCP, mutual TLS with `tls`
/// where the servers run it, the given timeouts (`tessera status` and
/// `tessera admin` share it).
pub async fn tool_channel(
    addr: &str,
    tls: Option<&tessera_rpc::TlsConfig>,
    connect_timeout: Duration,
    request_timeout: Duration,
) -> Result<tessera_rpc::Channel, tessera_rpc::RpcError> {
    let mut config = tessera_rpc::ChannelConfig {
        connect_timeout_ms: u64::try_from(connect_timeout.as_millis()).unwrap_or(u64::MAX),
        request_timeout_ms: u64::try_from(request_timeout.as_millis()).unwrap_or(u64::MAX),
        ..tessera_rpc::ChannelConfig::default()
    };
    config.transport.tls = tls.cloned();
    tessera_rpc::Channel::connect(addr, config).await
}

/// Asks `address` for its health (over TCP, with `tls` where the servers
/// run it).
pub async fn server_status(address: &str, tls: Option<&tessera_rpc::TlsConfig>) -> ServerStatus {
    let channel = match tool_channel(address, tls, TIMEOUT, TIMEOUT).await {
        Ok(channel) => channel,
        Err(err) => return ServerStatus::unreachable(address, err.to_string()),
    };
    let health = match ParameterServerClient::new(channel)
        .health(HealthRequest {})
        .await
    {
        Ok(health) => health,
        Err(err) => return ServerStatus::unreachable(address, err.to_string()),
    };
    ServerStatus {
        address: address.to_owned(),
        reachable: true,
        error: None,
        state: ServerState::try_from(health.state)
            .map_or("UNKNOWN", |s| s.as_str_name())
            .trim_start_matches("SERVER_STATE_")
            .to_owned(),
        serving: health.serving,
        replica_group: Some(health.replica_group),
        shards: health.shards.clone(),
        primary_of: health.primary_shards.clone(),
        transport: (!health.transport.is_empty()).then(|| health.transport.clone()),
        coordinator: (!health.coordinator.is_empty()).then(|| health.coordinator.clone()),
        shard_health: health.shard_health.iter().map(shard_status).collect(),
        rows: health.tables.iter().map(|t| t.rows).sum(),
        store_bytes: health.tables.iter().map(|t| t.store_bytes).sum(),
        rows_admitted: health.tables.iter().map(|t| t.rows_admitted).sum(),
        admission_candidates: health.tables.iter().map(|t| t.admission_candidates).sum(),
        admission_bytes: health.tables.iter().map(|t| t.admission_bytes).sum(),
        rows_expired: health.tables.iter().map(|t| t.rows_expired).sum(),
        checkpoint: health.checkpoint.as_ref().map(CheckpointStatus::of),
        feed: health.serving_feed.as_ref().map(FeedStatus::of),
        delta: health
            .delta_streams
            .iter()
            .map(|d| DeltaStatus {
                shard: d.shard,
                seq: d.seq,
                position: d.position,
                rows_sent: d.rows_sent,
                failed: d.failed,
                dropped: d.dropped,
                waited: d.waited,
            })
            .collect(),
        shard_map: health.shard_map.as_ref().map(shard_map_of),
    }
}

/// A server's report of the shard map, as the coordinator's record.
fn shard_map_of(h: &tessera_proto::v1::ShardMapHealth) -> tessera_coord::ShardMap {
    use tessera_coord::ResizeState as S;
    use tessera_proto::v1::ResizeState as P;
    let state = match P::try_from(h.resize_state) {
        Ok(P::Planned) => Some(S::Planned),
        Ok(P::Copying) => Some(S::Copying),
        Ok(P::CutOver) => Some(S::CutOver),
        Ok(P::Done) => Some(S::Done),
        Ok(P::Cancelled) => Some(S::Cancelled),
        Ok(P::None) | Err(_) => None,
    };
    tessera_coord::ShardMap {
        version: h.version,
        num_shards: h.num_shards,
        resize: state.map(|state| tessera_coord::Resize {
            id: h.resize_id,
            from: h.resize_from,
            to: h.resize_to,
            state,
            ready: h.ready.clone(),
            hold: h.hold,
            // Health names the shards only (their positions are the
            // servers' business).
            opened: h.opened.iter().map(|&s| (s, 0)).collect(),
            opening: Default::default(),
        }),
    }
}

/// Every server's status, asked at once, in the order given.
pub async fn cluster_status(
    addresses: &[String],
    tls: Option<&tessera_rpc::TlsConfig>,
) -> Vec<ServerStatus> {
    futures::future::join_all(addresses.iter().map(|a| server_status(a, tls))).await
}

/// The servers a run directory's `worker.toml` lists, and its
/// `ranker.toml` (the serving fleet) where there is one.
pub fn addresses_of_run_dir(dir: &Path) -> Result<Vec<String>, tessera_config::ConfigError> {
    let config = tessera_worker::WorkerConfig::load(&dir.join("worker.toml"))?;
    let mut out: Vec<String> = config.servers.into_iter().map(|s| s.address).collect();
    let ranker = dir.join("ranker.toml");
    if ranker.is_file() {
        let serving = tessera_worker::WorkerConfig::load(&ranker)?;
        out.extend(serving.servers.into_iter().map(|s| s.address));
    }
    Ok(out)
}

/// The statuses as a table (Markdown), a row per server.
pub fn format_table(statuses: &[ServerStatus]) -> String {
    use std::fmt::Write as _;
    let mut out = String::from(
        "| server | state | group | shards | primary of | epochs | transport | rows | replication | checkpoint |\n|---|---|---:|---|---|---|---|---:|---|---|\n",
    );
    for s in statuses {
        if !s.reachable {
            let _ = writeln!(
                out,
                "| {} | UNREACHABLE | - | - | - | - | - | - | {} | - |",
                s.address,
                s.error.as_deref().unwrap_or("")
            );
            continue;
        }
        let list = |v: &[u32]| {
            if v.is_empty() {
                "-".to_owned()
            } else {
                v.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
            }
        };
        let epochs = s
            .shard_health
            .iter()
            .map(|h| format!("{}:{}", h.shard, h.epoch))
            .collect::<Vec<_>>()
            .join(" ");
        let replication = s
            .shard_health
            .iter()
            .map(|h| {
                if h.role == "primary" {
                    format!(
                        "{}: {}/{} replicas in step, lag {}{}",
                        h.shard,
                        h.replicas_in_step,
                        h.replicas,
                        h.max_replica_lag_pushes,
                        if h.fenced { ", FENCED" } else { "" }
                    )
                } else if h.role == "replica" {
                    format!(
                        "{}: {}{}, heard {} ms ago",
                        h.shard,
                        if h.in_step { "in step" } else { "out of step" },
                        if h.syncing { ", copying" } else { "" },
                        h.stream_age_ms
                    )
                } else {
                    format!("{}: {}", h.shard, h.role)
                }
            })
            .chain(s.feed.as_ref().map(FeedStatus::cell))
            .chain(s.delta.iter().map(|d| {
                format!(
                    "{}: delta {} at {}, {} rows sent{}{}",
                    d.shard,
                    d.seq,
                    d.position,
                    d.rows_sent,
                    if d.failed + d.dropped > 0 {
                        format!(", {} failed, {} dropped", d.failed, d.dropped)
                    } else {
                        String::new()
                    },
                    if d.waited > 0 {
                        format!(", {} cuts waited", d.waited)
                    } else {
                        String::new()
                    }
                )
            }))
            .collect::<Vec<_>>()
            .join("; ");
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            s.address,
            s.state,
            s.replica_group.map_or("-".to_owned(), |g| g.to_string()),
            list(&s.shards),
            list(&s.primary_of),
            if epochs.is_empty() { "-" } else { &epochs },
            s.transport.as_deref().unwrap_or("?"),
            s.rows_cell(),
            if replication.is_empty() {
                "-"
            } else {
                &replication
            },
            s.checkpoint
                .as_ref()
                .map_or("-".to_owned(), CheckpointStatus::cell),
        );
    }
    // The shard map (etcd mode): the newest any server holds, and whether
    // some are behind it (a watch catching up, or cut off from etcd).
    let maps: Vec<&tessera_coord::ShardMap> = statuses
        .iter()
        .filter_map(|s| s.shard_map.as_ref())
        .collect();
    if let Some(newest) = maps.iter().max_by_key(|m| m.version) {
        out.push('\n');
        out.push_str(&crate::reshard::describe(newest));
        let behind = maps.iter().filter(|m| m.version < newest.version).count();
        if behind > 0 {
            let _ = write!(
                out,
                "\n  {behind} of {} servers still hold an older version",
                maps.len()
            );
        }
        out.push('\n');
    }
    out
}

/// What keeps `tessera status` from exiting 0, a line per server: one
/// that did not answer or does not serve every shard it hosts, and with
/// `in_step`, one with a copy not in step (a replica behind its
/// primary's stream or still copying, a primary with a replica not in
/// step). Serving is not being in step: a replica serves reads once it
/// holds a copy, before it has every Push its primary acknowledged.
pub fn problems(statuses: &[ServerStatus], in_step: bool) -> Vec<String> {
    let mut out = Vec::new();
    for s in statuses {
        if !s.reachable {
            out.push(format!(
                "{}: unreachable ({})",
                s.address,
                s.error.as_deref().unwrap_or("no answer")
            ));
            continue;
        }
        if !s.serving {
            out.push(format!("{}: {}", s.address, s.state));
            continue;
        }
        if !in_step {
            continue;
        }
        let behind: Vec<String> = s
            .shard_health
            .iter()
            .filter_map(|h| match h.role.as_str() {
                "replica" if !h.in_step || h.syncing => {
                    Some(format!("shard {} replica not in step", h.shard))
                }
                "primary" if h.replicas_in_step < h.replicas => Some(format!(
                    "shard {} primary with {} of {} replicas in step",
                    h.shard, h.replicas_in_step, h.replicas
                )),
                _ => None,
            })
            .collect();
        if !behind.is_empty() {
            out.push(format!("{}: {}", s.address, behind.join(", ")));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(role: &str, in_step: bool, replicas: (usize, usize)) -> ShardStatus {
        ShardStatus {
            shard: 0,
            role: role.into(),
            epoch: 1,
            primary: "10.0.0.1:7000".into(),
            in_step,
            syncing: false,
            stream_age_ms: 0,
            max_replica_lag_pushes: 0,
            replicas_in_step: replicas.0,
            replicas: replicas.1,
            fenced: false,
        }
    }

    #[test]
    fn serving_is_not_in_step_and_in_step_waits_for_every_copy() {
        // A replica that serves reads but is behind its primary's stream,
        // and its primary that counts it out of step.
        let mut replica = serving(None);
        replica.address = "10.0.0.2:7000".into();
        replica.primary_of = Vec::new();
        replica.shard_health = vec![shard("replica", false, (0, 0))];
        let mut primary = serving(None);
        primary.shard_health = vec![shard("primary", false, (0, 1))];
        let fleet = [primary.clone(), replica.clone()];
        assert_eq!(problems(&fleet, false), Vec::<String>::new());
        let why = problems(&fleet, true);
        assert_eq!(why.len(), 2, "{why:?}");
        assert!(why[0].contains("0 of 1 replicas in step"), "{why:?}");
        assert!(why[1].contains("replica not in step"), "{why:?}");
        // Once in step, both ways say 0.
        replica.shard_health = vec![shard("replica", true, (0, 0))];
        primary.shard_health = vec![shard("primary", false, (1, 1))];
        assert!(problems(&[primary, replica], true).is_empty());
        // Not answering or not serving fails either way.
        let mut recovering = serving(None);
        recovering.serving = false;
        recovering.state = "RECOVERING".into();
        let down = ServerStatus::unreachable("10.0.0.3:7000", "refused".into());
        assert_eq!(
            problems(&[recovering.clone(), down.clone()], false).len(),
            2
        );
        assert_eq!(problems(&[recovering, down], true).len(), 2);
    }

    fn serving(checkpoint: Option<CheckpointStatus>) -> ServerStatus {
        ServerStatus {
            address: "10.0.0.1:7000".into(),
            reachable: true,
            error: None,
            state: "SERVING".into(),
            serving: true,
            replica_group: Some(0),
            shards: vec![0],
            primary_of: vec![0],
            transport: Some("tcp".into()),
            coordinator: Some("static".into()),
            shard_health: Vec::new(),
            rows: 1_000_000,
            store_bytes: 84_500_000,
            rows_admitted: 0,
            admission_candidates: 0,
            admission_bytes: 0,
            rows_expired: 0,
            checkpoint,
            feed: None,
            delta: Vec::new(),
            shard_map: None,
        }
    }

    #[test]
    fn a_failing_checkpoint_shows_in_the_table_with_its_cause() {
        let failing = CheckpointStatus {
            dir: "/var/lib/tessera".into(),
            last_success_age_ms: Some(42_000),
            last_error: Some(
                "/var/lib/tessera/LATEST.tmp: No space left on device (os error 28)".into(),
            ),
            consecutive_failures: 3,
            saving: false,
        };
        let table = format_table(&[
            serving(Some(failing)),
            serving(None),
            ServerStatus::unreachable("10.0.0.2:7000", "refused".into()),
        ]);
        let rows: Vec<&str> = table.lines().collect();
        assert!(rows[0].ends_with("| checkpoint |"), "{table}");
        assert!(
            rows[2].ends_with(
                "| FAILING x3 (last ok: 42 s ago): /var/lib/tessera/LATEST.tmp: No space left on device (os error 28) |"
            ),
            "{table}"
        );
        assert!(
            rows[3].ends_with("| - |"),
            "no checkpoint directory: {table}"
        );
        assert!(rows[4].ends_with("| - |"), "{table}");
        assert!(rows[2].contains("| 1000000 (84.5 B/row) |"), "{table}");
        let ok = CheckpointStatus {
            dir: "/d".into(),
            last_success_age_ms: None,
            last_error: None,
            consecutive_failures: 0,
            saving: true,
        };
        assert_eq!(ok.cell(), "saving (last ok: none yet)");
    }

    #[test]
    fn a_serving_servers_freshness_and_a_training_servers_streams_show() {
        let fed = ServerStatus {
            feed: Some(FeedStatus {
                source_shards: 2,
                following: 1,
                copying: 1,
                max_applied_age_ms: 900,
                max_delay_ms: 640,
                fresh: false,
                bound_ms: 500,
            }),
            ..serving(None)
        };
        let training = ServerStatus {
            delta: vec![DeltaStatus {
                shard: 0,
                seq: 12,
                position: 340,
                rows_sent: 5000,
                failed: 1,
                dropped: 0,
                waited: 3,
            }],
            ..serving(None)
        };
        let table = format_table(&[fed, training]);
        assert!(
            table.contains(
                "fed by 1/2 training shards, delay 640 ms, applied 900 ms ago, copying 1, STALE (bound 500 ms)"
            ),
            "{table}"
        );
        assert!(
            table
                .contains("0: delta 12 at 340, 5000 rows sent, 1 failed, 0 dropped, 3 cuts waited"),
            "{table}"
        );
    }

    #[test]
    fn admission_shows_beside_the_rows_where_a_table_has_it() {
        let admitting = ServerStatus {
            rows_admitted: 250,
            admission_candidates: 4_000,
            admission_bytes: 4 << 20,
            ..serving(None)
        };
        assert_eq!(
            admitting.rows_cell(),
            "1000000 (84.5 B/row); admitted 250 of 4000 candidate pushes, sketch 4096 KiB"
        );
        assert_eq!(serving(None).rows_cell(), "1000000 (84.5 B/row)");
        let expiring = ServerStatus {
            rows_expired: 7,
            ..admitting
        };
        assert_eq!(
            expiring.rows_cell(),
            "1000000 (84.5 B/row); admitted 250 of 4000 candidate pushes, sketch 4096 KiB; 7 expired"
        );
    }

    #[test]
    fn the_shard_map_shows_under_the_table_with_servers_behind_it() {
        let old = tessera_coord::ShardMap::new(2);
        let planned = old.plan(3).unwrap();
        let a = ServerStatus {
            shard_map: Some(planned.clone()),
            ..serving(None)
        };
        let b = ServerStatus {
            shard_map: Some(old),
            ..serving(None)
        };
        let table = format_table(&[a.clone(), b]);
        assert!(
            table.contains(&crate::reshard::describe(&planned))
                && table.contains("1 of 2 servers still hold an older version"),
            "{table}"
        );
        // In static mode (no map), nothing is said.
        assert!(!format_table(&[serving(None)]).contains("shard map"));
        // A report survives the proto and back.
        let health = tessera_proto::v1::ShardMapHealth {
            version: planned.version,
            num_shards: 2,
            resize_state: tessera_proto::v1::ResizeState::Planned as i32,
            resize_from: 2,
            resize_to: 3,
            ready: Vec::new(),
            resize_id: 2,
            hold: false,
            opened: Default::default(),
        };
        assert_eq!(shard_map_of(&health), planned);
        assert_eq!(a.shard_map, Some(planned));
    }
}
