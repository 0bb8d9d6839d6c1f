//! `tessera-bench scale`: how a ps-server's cost grows with the work it
//! is given, one dimension at a time.
//!
//! Each sweep runs a real `PsServer` in a child process (`tessera-bench
//! rpc-ps-server`, one shard, table `emb`) and calls it from this process
//! with Tessera's generated client, so the server's memory is its own
//! process's (`VmRSS`, and `VmHWM` reset through `/proc/<pid>/clear_refs`
//! before each measurement for the peak):
//!
//! - **keys**: Fetch latency (one call outstanding) and the server's peak
//!   memory above its resting size, as the keys of one Fetch grow from 10
//!   to 100,000 (dim 64: 2.5 KiB to 24.4 MiB of rows back), tcp and
//!   rdma-soft interleaved level by level. Ratios: to the fewest keys of
//!   the same transport, and rdma-soft to tcp.
//! - **rows**: the server's resident bytes per row as a shard grows from
//!   10^3 to 10^7 rows (dim 16): the growth per row added since the level
//!   before, against the payload (`dim x 4 + 8`: the values and the key),
//!   and the average since the empty server; and the latency of a Fetch of 1,000 keys spread
//!   over all of them; over tcp (the store does not depend on the
//!   transport). Ratios: to the payload, and to the fewest rows.
//! - **connections**: 1 to 1,000 client connections (one transport shared
//!   by the client, a channel each). Idle: the latency of a Fetch of 100
//!   keys on one of them while the others are open; active: every
//!   connection with a Fetch outstanding at all times (calls per second,
//!   p50, p99); the server's resident memory per connection (a fresh
//!   server per level). Ratios: to one connection of the same transport,
//!   and rdma-soft to tcp. A channel that is not on its transport (an
//!   RDMA channel fallen back to TCP) fails the run.
//!
//! Rows are created by the Fetches themselves (a training table creates a
//! missing row on first read), before any measurement.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tessera_proto::v1 as ps;
use tessera_rpc::{Channel, TransportKind};

use crate::report::{Meta, quantile};
use crate::rpc::{ServerChild, channel_config, fetch, start_server_of};
use crate::transport::BoxError;

/// Dim of the keys and connections sweeps (as the rpc benchmark's).
const DIM: u32 = 64;
/// Dim of the rows sweep: small rows, so that 10^7 fit in a few GiB.
const ROWS_DIM: u32 = 16;
/// Keys of a Fetch in the rows sweep.
const ROWS_FETCH_KEYS: usize = 1000;
/// Keys of a Fetch in the connections sweep.
const CONNECTION_FETCH_KEYS: usize = 100;
/// Keys per Fetch that creates the rows sweep's rows (640 KiB back): few
/// calls for 10^7 rows, retained buffers small next to the rows.
const ROWS_CREATE_BATCH: u64 = 10_000;

/// What a run measures.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Keys per Fetch of the keys sweep.
    pub keys: Vec<usize>,
    /// Rows per shard of the rows sweep.
    pub rows: Vec<u64>,
    /// Client connections of the connections sweep.
    pub connections: Vec<usize>,
    /// Most measured calls per latency level.
    pub iterations: usize,
    /// Most seconds per latency level (at least 5 calls are measured).
    pub level_secs: f64,
    /// Seconds every connection is busy, per connections level.
    pub active_secs: f64,
}

impl Plan {
    /// The full run, or a smoke run.
    pub fn new(quick: bool) -> Self {
        match quick {
            false => Self {
                keys: vec![10, 100, 1000, 10_000, 100_000],
                rows: vec![1_000, 10_000, 100_000, 1_000_000, 10_000_000],
                connections: vec![1, 10, 100, 1000],
                iterations: 2000,
                level_secs: 3.0,
                active_secs: 3.0,
            },
            true => Self {
                keys: vec![10, 1000, 10_000],
                rows: vec![1_000, 10_000, 100_000],
                connections: vec![1, 10, 100],
                iterations: 100,
                level_secs: 0.3,
                active_secs: 0.3,
            },
        }
    }
}

impl Plan {
    /// Sorts each sweep's levels (each level's figures are relative to the
    /// one before) and refuses empty sweeps, zeros and repeats.
    pub fn validated(mut self) -> Result<Self, BoxError> {
        fn check<T: Ord + Copy + Default + std::fmt::Debug>(
            name: &str,
            levels: &mut [T],
        ) -> Result<(), BoxError> {
            levels.sort_unstable();
            if levels.is_empty() || levels[0] == T::default() {
                return Err(format!("--{name} {levels:?}: give levels of at least 1").into());
            }
            if levels.windows(2).any(|w| w[0] == w[1]) {
                return Err(format!("--{name} {levels:?}: a level is repeated").into());
            }
            Ok(())
        }
        check("keys", &mut self.keys)?;
        check("rows", &mut self.rows)?;
        check("connections", &mut self.connections)?;
        Ok(self)
    }
}

const TRANSPORTS: [(&str, TransportKind); 2] = [
    ("tcp", TransportKind::Tcp),
    ("rdma-soft", TransportKind::Rdma),
];

/// The `i`th key of the benchmark's key space (distinct for every `i`).
fn key(i: u64) -> u64 {
    i.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// A field of `/proc/<pid>/status` in bytes (`VmRSS`, `VmHWM`).
fn status_bytes(pid: u32, field: &str) -> Result<u64, BoxError> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .ok_or_else(|| format!("no {field} in /proc/{pid}/status").into())
}

/// Resets `pid`'s peak resident size to its current one (`clear_refs` 5);
/// false where the kernel refuses.
fn reset_peak(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

fn server_pid(server: &ServerChild) -> u32 {
    server.child.id()
}

/// A client of `server` over `kind`, its own transport.
async fn client(
    server: &ServerChild,
    kind: TransportKind,
) -> Result<ps::ParameterServerClient, BoxError> {
    let channel = Channel::connect(server.tessera.clone(), channel_config(kind)).await?;
    on_transport(&channel, kind)?;
    Ok(ps::ParameterServerClient::new(channel))
}

/// Fails unless `channel` is connected over `kind` (an RDMA channel may
/// fall back to TCP; a figure labelled rdma-soft must not be TCP's).
fn on_transport(channel: &Channel, kind: TransportKind) -> Result<(), BoxError> {
    match channel.current_transport() {
        Some(now) if now == kind => Ok(()),
        now => Err(format!("the channel is on {now:?}, not {kind}").into()),
    }
}

/// Creates rows `from..to` of the key space, `batch` per Fetch.
async fn create_rows(
    client: &ps::ParameterServerClient,
    from: u64,
    to: u64,
    dim: u32,
    batch: u64,
) -> Result<(), BoxError> {
    let mut at = from;
    while at < to {
        let end = (at + batch).min(to);
        let keys: Vec<u64> = (at..end).map(key).collect();
        fetch(client, &keys, dim).await?;
        at = end;
    }
    Ok(())
}

/// Latencies (µs, sorted) of Fetches of `requests` in turn, one
/// outstanding: at most `plan.iterations` or `plan.level_secs`, at least 5,
/// after a few unmeasured.
async fn latencies(
    client: &ps::ParameterServerClient,
    requests: &[Vec<u64>],
    dim: u32,
    plan: &Plan,
) -> Result<Vec<f64>, BoxError> {
    for keys in requests.iter().cycle().take(3) {
        fetch(client, keys, dim).await?;
    }
    let started = Instant::now();
    let mut out = Vec::new();
    for keys in requests.iter().cycle() {
        if out.len() >= plan.iterations
            || (out.len() >= 5 && started.elapsed().as_secs_f64() > plan.level_secs)
        {
            break;
        }
        let at = Instant::now();
        fetch(client, keys, dim).await?;
        out.push(at.elapsed().as_secs_f64() * 1e6);
    }
    out.sort_by(f64::total_cmp);
    Ok(out)
}

fn mean(sorted: &[f64]) -> f64 {
    sorted.iter().sum::<f64>() / sorted.len().max(1) as f64
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Fetch latency and the server's transient memory by keys per Fetch.
///
/// The rows are created by Fetches of the fewest keys measured, so that
/// the buffers the server's allocator keeps afterwards do not hide the
/// memory of the measured Fetches; the levels run from the fewest keys to
/// the most, so each level's peak is what it needs above what every
/// smaller one left.
async fn keys_sweep(plan: &Plan) -> Result<Vec<Value>, BoxError> {
    let most = plan.keys.iter().copied().max().unwrap_or(0) as u64;
    let fewest = plan.keys.iter().copied().min().unwrap_or(1).max(1) as u64;
    let mut sides = Vec::new();
    for (label, kind) in TRANSPORTS {
        let server = start_server_of(kind, DIM)?;
        let client = client(&server, kind).await?;
        create_rows(&client, 0, most, DIM, fewest).await?;
        sides.push((label, server, client));
    }
    let mut rows = Vec::new();
    for &n in &plan.keys {
        let keys: Vec<u64> = (0..n as u64).map(key).collect();
        let requests = [keys];
        for (label, server, client) in &sides {
            let pid = server_pid(server);
            let resting = status_bytes(pid, "VmRSS")?;
            let peak_known = reset_peak(pid);
            let l = latencies(client, &requests, DIM, plan).await?;
            let peak = status_bytes(pid, "VmHWM")?;
            let response_bytes = n * DIM as usize * 4;
            // A reset the kernel accepted but did not do leaves the old
            // peak: no figure then.
            let peak_known =
                peak_known && peak < resting + (64 << 20).max(8 * response_bytes as u64);
            let above = peak.saturating_sub(resting);
            rows.push(json!({
                "bench": "scale",
                "section": "keys",
                "transport": label,
                "keys": n,
                "response_bytes": response_bytes,
                "calls_measured": l.len(),
                "p50_us": quantile(&l, 0.5),
                "p99_us": quantile(&l, 0.99),
                "mean_us": mean(&l),
                "p50_ns_per_key": quantile(&l, 0.5) * 1000.0 / n as f64,
                "server_rss_mib": mib(resting),
                "server_peak_above_rss_mib": peak_known.then(|| mib(above)),
                "server_peak_per_response_byte": peak_known.then(|| above as f64 / response_bytes as f64),
            }));
        }
    }
    // Ratios: to the fewest keys of the same transport, and to tcp.
    let snapshot = rows.clone();
    for row in &mut rows {
        let (first, tcp) = baselines(&snapshot, row, "keys");
        let r = ratio(row, &first, "p50_us");
        let t = ratio(row, &tcp, "p50_us");
        let t99 = ratio(row, &tcp, "p99_us");
        extend(
            row,
            json!({"p50_vs_fewest_keys": r, "p50_vs_tcp": t, "p99_vs_tcp": t99}),
        );
    }
    Ok(rows)
}

/// Resident bytes per row and Fetch latency by rows per shard (tcp).
async fn rows_sweep(plan: &Plan) -> Result<Vec<Value>, BoxError> {
    let server = start_server_of(TransportKind::Tcp, ROWS_DIM)?;
    let pid = server_pid(&server);
    let client = client(&server, TransportKind::Tcp).await?;
    // The resting size once the connection and its first call are done.
    client.health(ps::HealthRequest {}).await?;
    let empty = status_bytes(pid, "VmRSS")?;
    let payload = ROWS_DIM as u64 * 4 + 8;
    let mut random = rand::rngs::StdRng::seed_from_u64(17);
    let mut rows = Vec::new();
    let (mut created, mut before) = (0, empty);
    for &n in &plan.rows {
        create_rows(&client, created, n, ROWS_DIM, ROWS_CREATE_BATCH).await?;
        created = created.max(n);
        let rss = status_bytes(pid, "VmRSS")?;
        let requests: Vec<Vec<u64>> = (0..16)
            .map(|_| {
                (0..ROWS_FETCH_KEYS)
                    .map(|_| key(random.random_range(0..n)))
                    .collect()
            })
            .collect();
        let l = latencies(&client, &requests, ROWS_DIM, plan).await?;
        let per_row = rss.saturating_sub(empty) as f64 / n as f64;
        // The growth since the previous level per row added: free of the
        // one-time costs (first buffers, arenas, empty maps) that dominate
        // the average of a small shard.
        let per_added_row = rss.saturating_sub(before) as f64 / (n - created_before(&rows)) as f64;
        before = rss;
        rows.push(json!({
            "bench": "scale",
            "section": "rows",
            "transport": "tcp",
            "rows": n,
            "dim": ROWS_DIM,
            "payload_bytes_per_row": payload,
            "server_rss_mib": mib(rss),
            "bytes_per_row": per_row,
            "bytes_per_added_row": per_added_row,
            "bytes_per_added_row_vs_payload": per_added_row / payload as f64,
            "calls_measured": l.len(),
            "p50_us": quantile(&l, 0.5),
            "p99_us": quantile(&l, 0.99),
            "mean_us": mean(&l),
        }));
    }
    let first = rows.first().cloned().unwrap_or(Value::Null);
    for row in &mut rows {
        let r = ratio(row, &first, "p50_us");
        extend(row, json!({"p50_vs_fewest_rows": r}));
    }
    Ok(rows)
}

/// Rows of the level before (0 for the first).
fn created_before(rows: &[Value]) -> u64 {
    rows.last().and_then(|r| r["rows"].as_u64()).unwrap_or(0)
}

/// Latency, throughput and server memory by client connections.
async fn connections_sweep(plan: &Plan) -> Result<Vec<Value>, BoxError> {
    let keys: Vec<u64> = (0..CONNECTION_FETCH_KEYS as u64).map(key).collect();
    let mut rows = Vec::new();
    for (label, kind) in TRANSPORTS {
        // A fresh server and client per level: the server's size with `n`
        // connections open is then not inflated by buffers an earlier
        // level's busy phase left.
        for &n in &plan.connections {
            let server = start_server_of(kind, DIM)?;
            let pid = server_pid(&server);
            let config = channel_config(kind);
            let transport = tessera_transport::Transport::new(config.transport.clone())?;
            let mut clients: Vec<ps::ParameterServerClient> = Vec::new();
            while clients.len() < n {
                let channel = Channel::with_transport(
                    server.tessera.clone(),
                    config.clone(),
                    transport.clone(),
                );
                let client = ps::ParameterServerClient::new(channel.clone());
                // Connects, and creates the rows on the first.
                fetch(&client, &keys, DIM).await?;
                on_transport(&channel, kind)?;
                clients.push(client);
            }
            let rss = status_bytes(pid, "VmRSS")?;
            let client_rss = status_bytes(std::process::id(), "VmRSS")?;
            let idle = match clients.first() {
                Some(first) => latencies(first, std::slice::from_ref(&keys), DIM, plan).await?,
                None => Vec::new(),
            };
            let peak_known = reset_peak(pid);
            let (rate, active) = all_busy(&clients, &keys, plan.active_secs).await?;
            let peak = status_bytes(pid, "VmHWM")?;
            rows.push(json!({
                "bench": "scale",
                "section": "connections",
                "transport": label,
                "connections": n,
                "idle_calls_measured": idle.len(),
                "idle_p50_us": quantile(&idle, 0.5),
                "idle_p99_us": quantile(&idle, 0.99),
                "active_calls_measured": active.len(),
                "active_calls_per_s": rate,
                "active_p50_us": quantile(&active, 0.5),
                "active_p99_us": quantile(&active, 0.99),
                "server_rss_mib": mib(rss),
                "server_peak_active_mib": peak_known.then(|| mib(peak)),
                "client_rss_mib": mib(client_rss),
            }));
        }
    }
    // Per connection: the server's memory above one connection's.
    let snapshot = rows.clone();
    for row in &mut rows {
        let (one, tcp) = baselines(&snapshot, row, "connections");
        let n = row["connections"].as_f64().unwrap_or(1.0);
        let first_n = one["connections"].as_f64().unwrap_or(1.0);
        let per_connection = (n > first_n).then(|| {
            let grown = row["server_rss_mib"].as_f64().unwrap_or(0.0)
                - one["server_rss_mib"].as_f64().unwrap_or(0.0);
            grown * 1024.0 * 1024.0 / (n - first_n)
        });
        let ratios = json!({
            "server_bytes_per_connection": per_connection,
            "idle_p50_vs_fewest_connections": ratio(row, &one, "idle_p50_us"),
            "active_p99_vs_fewest_connections": ratio(row, &one, "active_p99_us"),
            "calls_per_s_vs_fewest_connections": ratio(row, &one, "active_calls_per_s"),
            "idle_p50_vs_tcp": ratio(row, &tcp, "idle_p50_us"),
            "active_calls_per_s_vs_tcp": ratio(row, &tcp, "active_calls_per_s"),
        });
        extend(row, ratios);
    }
    Ok(rows)
}

/// Every client with a Fetch outstanding for `secs`: calls per second and
/// the sorted latencies (µs).
async fn all_busy(
    clients: &[ps::ParameterServerClient],
    keys: &[u64],
    secs: f64,
) -> Result<(f64, Vec<f64>), BoxError> {
    let keys = Arc::new(keys.to_vec());
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for client in clients {
        let (client, keys) = (client.clone(), Arc::clone(&keys));
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            while Instant::now() < until {
                let at = Instant::now();
                fetch(&client, &keys, DIM).await?;
                out.push(at.elapsed().as_secs_f64() * 1e6);
            }
            Ok::<_, BoxError>(out)
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.map_err(|e| e.to_string())??);
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort_by(f64::total_cmp);
    Ok((all.len() as f64 / elapsed.max(1e-9), all))
}

/// The baselines of `row` among `rows`: the first (fewest) level of its
/// transport, and tcp's row of the same `level`.
fn baselines(rows: &[Value], row: &Value, level: &str) -> (Value, Value) {
    let find = |pick: &dyn Fn(&Value) -> bool| {
        rows.iter()
            .find(|r| pick(r))
            .cloned()
            .unwrap_or(Value::Null)
    };
    (
        find(&|r| r["transport"] == row["transport"]),
        find(&|r| r["transport"] == "tcp" && r[level] == row[level]),
    )
}

/// `row[key] / base[key]`, or null when either is missing or zero.
fn ratio(row: &Value, base: &Value, key: &str) -> Value {
    match (row[key].as_f64(), base[key].as_f64()) {
        (Some(a), Some(b)) if b > 0.0 => json!(a / b),
        _ => Value::Null,
    }
}

fn extend(row: &mut Value, more: Value) {
    if let (Some(row), Value::Object(more)) = (row.as_object_mut(), more) {
        row.extend(more);
    }
}

/// Runs `plan`: its rows and table.
pub async fn run(plan: &Plan, meta: &Meta) -> Result<(Vec<Value>, String), BoxError> {
    let plan = &plan.clone().validated()?;
    let mut rows = keys_sweep(plan).await?;
    rows.extend(rows_sweep(plan).await?);
    rows.extend(connections_sweep(plan).await?);
    let table = markdown(plan, meta, &rows);
    Ok((rows, table))
}

fn markdown(plan: &Plan, meta: &Meta, rows: &[Value]) -> String {
    let f = |r: &Value, k: &str| r[k].as_f64();
    let num = |v: Option<f64>, digits: usize| v.map_or("-".to_owned(), |v| format!("{v:.digits$}"));
    let of = |section: &'static str| rows.iter().filter(move |r| r["section"] == section);
    let mut out = format!(
        "## scale: a ps-server (one shard, child process) as the work grows\n\n{}\n\nLatency with one call outstanding, at most {} calls or {:.1} s per level; server memory is the child process's resident size (`VmRSS`; peaks from `VmHWM`, reset before each measurement).\n\n",
        meta.machine_line(),
        plan.iterations,
        plan.level_secs,
    );
    out.push_str(&format!(
        "### Keys per Fetch (dim {DIM})\n\n| transport | keys | rows back | p50 µs | p99 µs | ns per key (p50) | p50 vs fewest keys | p50 vs tcp | server peak above resting, MiB | peak per byte of rows back |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    ));
    for r in of("keys") {
        out.push_str(&format!(
            "| {} | {} | {:.0} KiB | {} | {} | {} | {} | {} | {} | {} |\n",
            r["transport"].as_str().unwrap_or(""),
            r["keys"],
            f(r, "response_bytes").unwrap_or(0.0) / 1024.0,
            num(f(r, "p50_us"), 0),
            num(f(r, "p99_us"), 0),
            num(f(r, "p50_ns_per_key"), 0),
            num(f(r, "p50_vs_fewest_keys"), 2),
            num(f(r, "p50_vs_tcp"), 2),
            num(f(r, "server_peak_above_rss_mib"), 1),
            num(f(r, "server_peak_per_response_byte"), 2),
        ));
    }
    out.push_str(&format!(
        "\n### Rows per shard (dim {ROWS_DIM}, payload {} bytes per row: values and key; Fetch of {ROWS_FETCH_KEYS} keys spread over every row; tcp)\n\n| rows | server RSS MiB | RSS growth per row since empty | per row added since the level before | vs payload | p50 µs | p99 µs | p50 vs fewest rows |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        ROWS_DIM * 4 + 8
    ));
    for r in of("rows") {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r["rows"],
            num(f(r, "server_rss_mib"), 1),
            num(f(r, "bytes_per_row"), 0),
            num(f(r, "bytes_per_added_row"), 0),
            num(f(r, "bytes_per_added_row_vs_payload"), 2),
            num(f(r, "p50_us"), 0),
            num(f(r, "p99_us"), 0),
            num(f(r, "p50_vs_fewest_rows"), 2),
        ));
    }
    out.push_str(&format!(
        "\n### Client connections (Fetch of {CONNECTION_FETCH_KEYS} keys x dim {DIM}; idle: one connection calls while the others are open; active: every connection has a call outstanding for {:.1} s)\n\n| transport | connections | idle p50 µs | idle p99 µs | active calls/s | active p50 µs | active p99 µs | server RSS MiB | server bytes per connection | client RSS MiB | idle p50 vs 1 | calls/s vs 1 | idle p50 vs tcp | calls/s vs tcp |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        plan.active_secs
    ));
    for r in of("connections") {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r["transport"].as_str().unwrap_or(""),
            r["connections"],
            num(f(r, "idle_p50_us"), 0),
            num(f(r, "idle_p99_us"), 0),
            num(f(r, "active_calls_per_s"), 0),
            num(f(r, "active_p50_us"), 0),
            num(f(r, "active_p99_us"), 0),
            num(f(r, "server_rss_mib"), 1),
            num(f(r, "server_bytes_per_connection"), 0),
            num(f(r, "client_rss_mib"), 1),
            num(f(r, "idle_p50_vs_fewest_connections"), 2),
            num(f(r, "calls_per_s_vs_fewest_connections"), 2),
            num(f(r, "idle_p50_vs_tcp"), 2),
            num(f(r, "active_calls_per_s_vs_tcp"), 2),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_sorted_and_zeros_or_repeats_refused() {
        let plan = Plan {
            keys: vec![1000, 10],
            ..Plan::new(true)
        };
        assert_eq!(plan.validated().unwrap().keys, vec![10, 1000]);
        for plan in [
            Plan {
                rows: vec![0, 10],
                ..Plan::new(true)
            },
            Plan {
                connections: vec![10, 10],
                ..Plan::new(true)
            },
            Plan {
                keys: vec![],
                ..Plan::new(true)
            },
        ] {
            assert!(plan.validated().is_err());
        }
    }
}
