//! `tessera-bench store`: the row store of one (table, shard), the new
//! slab store beside the previous one ([`baseline`], measured in the same
//! run), as a shard grows.
//!
//! Each (store, table) runs in a child process of its own (`tessera-bench
//! store-child`), so that its memory is the process's resident size
//! (`VmRSS`) and no run inherits another's heap. Tables: SGD dim 16, Adagrad
//! dim 64 and Adam dim 64, each stored as `f32` and `f16` (the old store
//! has `f32` only). At each level of rows (10^5, 10^6, 10^7 by default):
//!
//! - **bytes per row**: resident bytes above the empty store, per row,
//!   against the payload (values, optimizer state, key: `4 * (dim + state)
//!   + 8`), and the store's own count where it keeps one;
//! - **Fetch**: a read of 1,000 random rows into a little-endian `f32`
//!   buffer (the server's Fetch path below the RPC), p50 and p99;
//! - **Push**: rows updated per second, 1,000 random rows at a time with
//!   the table's optimizer;
//! - **growth**: while the rows grow to the level (1,000 new keys per
//!   Push, on one thread), another thread Fetches 1,000 random rows of
//!   those already there, without pause: the p99 and the largest of those
//!   Fetches against the steady p99 at the level reached (a stall shows
//!   as a maximum far above it), and how many took over 3x it; **churn**:
//!   the same with the writer updating rows already there, no growth, for
//!   as long: the tail a writer beside the Fetches makes without growing.
//!   Each Fetch's time is split by its thread's CPU clock and scheduler
//!   statistics into running, waiting for a CPU, and asleep (blocked on a
//!   stripe's lock or woken late). A third thread sleeps 1 ms at a time
//!   and notes when it wakes 4 ms or more late: the whole machine paused
//!   (this VM's hypervisor stops every vCPU for up to about 100 ms now and
//!   then); the largest Fetch no such pause overlapped is reported beside
//!   the raw one.
//!
//! At the largest level of SGD `f32`, **snapshots under Pushes**: one
//! thread Pushes 1,000 random rows at a time under the shard's lock (a
//! `Mutex`, as the server's write lock is held by each Push), first
//! quietly, then while a checkpoint (cut under the lock, every row encoded
//! as the row file has it and written to a file) and while a replica copy
//! (the cut's rows encoded in 1 MiB pieces and handed to another thread)
//! run: Push p50/p99 during each against quiet. Two controls run between
//! quiet and the snapshots, with no cut open: a spinner on the other core
//! (work without memory traffic) and a reader streaming through 256 MiB
//! over and over (memory traffic without saves), so that the report shows
//! what a busy second core alone costs a Push on this machine, apart from
//! what the snapshot's saves add.
//!
//! Keys are `i * 0x9E3779B97F4A7C15`, distinct; random draws use a fixed
//! seed.

pub mod baseline;

use std::io::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tessera_transport::sync::LockExt;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tessera_store::config::{Initializer, OptimizerConfig};
use tessera_store::table::{EvictionPolicy, RowLayout, ShardRows, Storage};

use crate::report::quantile;
use crate::transport::BoxError;

/// Rows per Fetch and per Push.
const BATCH: usize = 1000;

/// The `i`th key (distinct for every `i`).
fn key(i: u64) -> u64 {
    i.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// A table the benchmark stores.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TableKind {
    /// `sgd`, `adagrad` or `adam`.
    pub optimizer: &'static str,
    /// Values per row.
    pub dim: usize,
    /// How values are stored.
    pub storage: Storage,
}

impl TableKind {
    fn optimizer(&self) -> OptimizerConfig {
        match self.optimizer {
            "adagrad" => OptimizerConfig::adagrad(0.01),
            "adam" => OptimizerConfig::adam(0.001),
            _ => OptimizerConfig::sgd(0.01),
        }
    }

    /// Bytes of a row's payload: values and state as `f32`, and the key.
    fn payload(&self) -> usize {
        4 * self.dim * (1 + self.optimizer().slots()) + 8
    }

    fn name(&self) -> String {
        format!(
            "{} dim {} {}",
            self.optimizer,
            self.dim,
            self.storage.name()
        )
    }
}

/// The tables of a run.
pub const TABLES: &[TableKind] = &[
    TableKind {
        optimizer: "sgd",
        dim: 16,
        storage: Storage::F32,
    },
    TableKind {
        optimizer: "sgd",
        dim: 16,
        storage: Storage::F16,
    },
    TableKind {
        optimizer: "adagrad",
        dim: 64,
        storage: Storage::F32,
    },
    TableKind {
        optimizer: "adagrad",
        dim: 64,
        storage: Storage::F16,
    },
    TableKind {
        optimizer: "adam",
        dim: 64,
        storage: Storage::F32,
    },
    TableKind {
        optimizer: "adam",
        dim: 64,
        storage: Storage::F16,
    },
];

/// What a run measures.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Rows per level.
    pub rows: Vec<u64>,
    /// Seconds of each Fetch and Push measurement.
    pub level_secs: f64,
    /// Seconds of quiet Pushes before the snapshots.
    pub quiet_secs: f64,
}

impl Plan {
    /// The full run, or a smoke run.
    pub fn new(quick: bool) -> Self {
        if quick {
            Self {
                rows: vec![10_000, 50_000],
                level_secs: 0.2,
                quiet_secs: 0.3,
            }
        } else {
            Self {
                rows: vec![100_000, 1_000_000, 10_000_000],
                level_secs: 2.0,
                quiet_secs: 3.0,
            }
        }
    }
}

/// The two stores behind one interface.
enum Store {
    Slab(ShardRows),
    Old(baseline::ShardRows),
}

/// One table's rows in either store, and how to make and update a row.
struct Bench {
    store: Store,
    kind: TableKind,
    optimizer: OptimizerConfig,
    initializer: Initializer,
}

impl Bench {
    fn new(kind: TableKind, old: bool) -> Self {
        let optimizer = kind.optimizer();
        let layout = RowLayout::new(
            kind.dim,
            optimizer.slots() * kind.dim,
            kind.storage,
            optimizer.uses_steps(),
        );
        Self {
            store: if old {
                Store::Old(baseline::ShardRows::default())
            } else {
                Store::Slab(ShardRows::new(layout, None, EvictionPolicy::Lru))
            },
            kind,
            optimizer,
            initializer: Initializer::Uniform { scale: 0.05 },
        }
    }

    /// Applies `grad` to the row of `key` (created first if missing).
    fn push(&self, key: u64, grad: &[f32]) {
        let (optimizer, initializer, dim) = (self.optimizer, self.initializer, self.kind.dim);
        match &self.store {
            Store::Slab(rows) => {
                let stored = rows.upsert_evicting(
                    key,
                    key ^ grad.len() as u64,
                    |values, state| {
                        initializer.fill(7, key, values);
                        optimizer.fill_initial_state(state);
                    },
                    |values, state, steps| optimizer.apply(values, state, steps, grad),
                );
                debug_assert!(stored.is_ok());
            }
            Store::Old(rows) => {
                rows.upsert(
                    key,
                    || {
                        baseline::Row::new(
                            initializer.row(7, key, dim),
                            optimizer.initial_state(dim),
                        )
                    },
                    |row| {
                        let data = row.data_mut();
                        optimizer.apply(&mut data.values, &mut data.state, &mut data.steps, grad);
                    },
                );
            }
        }
    }

    /// Applies `grad` to the rows of `keys` as the server applies a Push
    /// (the slab store: every stripe write-locked once for its rows; the
    /// old one: row by row).
    fn push_many(&self, keys: &[u64], grad: &[f32]) {
        let (optimizer, initializer) = (self.optimizer, self.initializer);
        match &self.store {
            Store::Slab(rows) => {
                let refused = rows.upsert_many(
                    keys,
                    grad.len() as u64,
                    |i, values, state| {
                        initializer.fill(7, keys[i], values);
                        optimizer.fill_initial_state(state);
                    },
                    |_, values, state, steps| optimizer.apply(values, state, steps, grad),
                );
                debug_assert_eq!(refused, 0);
            }
            Store::Old(_) => {
                for &key in keys {
                    self.push(key, grad);
                }
            }
        }
    }

    /// Writes the rows of `keys` as little-endian `f32` into `out`, in
    /// order, as the server's Fetch does (the slab store: every stripe
    /// locked once, lookups overlapped; the old one: key by key); how many
    /// were present.
    fn fetch(&self, keys: &[u64], out: &mut [u8]) -> usize {
        let row = self.kind.dim * 4;
        match &self.store {
            Store::Slab(rows) => {
                let mut missing = Vec::new();
                rows.read_many(
                    keys,
                    |i, r| r.write_values_le(&mut out[i * row..(i + 1) * row]),
                    &mut missing,
                );
                keys.len() - missing.len()
            }
            Store::Old(rows) => {
                let mut present = 0;
                for (&key, out) in keys.iter().zip(out.chunks_exact_mut(row)) {
                    let found = rows.read(key, |r| {
                        for (o, v) in out.chunks_exact_mut(4).zip(r.data().values.iter()) {
                            o.copy_from_slice(&v.to_le_bytes());
                        }
                    });
                    present += usize::from(found.is_some());
                }
                present
            }
        }
    }

    fn store_bytes(&self) -> Option<u64> {
        match &self.store {
            Store::Slab(rows) => Some(rows.bytes().total()),
            Store::Old(_) => None,
        }
    }

    /// Takes a cut of every row (under the caller's shard lock) and
    /// returns a function that encodes it, in row-file form, piece by
    /// piece into `sink` (after the lock is released).
    fn cut(&self) -> Cut {
        match &self.store {
            Store::Slab(rows) => Cut::Slab(rows.snapshot()),
            Store::Old(rows) => Cut::Old(rows.snapshot()),
        }
    }
}

/// A snapshot of either store.
enum Cut {
    Slab(tessera_store::table::RowsSnapshot),
    Old(Vec<(u64, Arc<baseline::RowData>)>),
}

impl Cut {
    /// Encodes every row as a row file has it, handing `sink` pieces of
    /// about `piece` bytes; returns the bytes encoded.
    fn encode(&self, piece: usize, mut sink: impl FnMut(&[u8])) -> u64 {
        let mut buf = Vec::with_capacity(piece + 4096);
        let mut total = 0u64;
        let mut flush = |buf: &mut Vec<u8>, total: &mut u64| {
            *total += buf.len() as u64;
            sink(buf);
            buf.clear();
        };
        match self {
            Cut::Slab(snapshot) => {
                snapshot.for_each_from(0, |row| {
                    row.encode(&mut buf);
                    if buf.len() >= piece {
                        flush(&mut buf, &mut total);
                    }
                    true
                });
            }
            Cut::Old(rows) => {
                for (key, row) in rows {
                    buf.extend_from_slice(&key.to_le_bytes());
                    buf.extend_from_slice(&row.steps.to_le_bytes());
                    for v in row.values.iter().chain(row.state.iter()) {
                        buf.extend_from_slice(&v.to_le_bytes());
                    }
                    if buf.len() >= piece {
                        flush(&mut buf, &mut total);
                    }
                }
            }
        }
        flush(&mut buf, &mut total);
        total
    }
}

/// Pauses of the whole machine, seen by a thread that sleeps 1 ms at a
/// time and wakes late (jHiccup's idea): on this VM the hypervisor stops
/// every vCPU now and then, up to about 100 ms, whatever the store does.
/// A Fetch a pause overlapped measures the machine, not the store.
struct Pauses {
    handle: std::thread::JoinHandle<Vec<(Instant, Instant)>>,
}

/// The pauses seen: each window, and the longest.
struct Seen {
    windows: Vec<(Instant, Instant)>,
    longest_ms: f64,
}

/// A sleep of 1 ms that took this long or more counts as a pause.
const PAUSE: Duration = Duration::from_millis(4);

impl Pauses {
    fn watch(stop: Arc<AtomicBool>) -> Self {
        Self {
            handle: std::thread::spawn(move || {
                let mut windows = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let before = Instant::now();
                    std::thread::sleep(Duration::from_millis(1));
                    let after = Instant::now();
                    if after - before >= PAUSE {
                        windows.push((before, after));
                    }
                }
                windows
            }),
        }
    }

    fn finish(self) -> Result<Seen, BoxError> {
        let windows = self
            .handle
            .join()
            .map_err(|_| "the pause watcher panicked")?;
        let longest_ms = windows
            .iter()
            .map(|(a, b)| (*b - *a).as_secs_f64() * 1e3)
            .fold(0.0, f64::max);
        Ok(Seen {
            windows,
            longest_ms,
        })
    }
}

/// This thread's time on a CPU (its CPU clock) and runnable but waiting
/// for one (`/proc/thread-self/schedstat`, second field), nanoseconds. On this 2-core VM the thread measured shares the CPUs
/// with the thread growing the store or encoding a snapshot: a Fetch or
/// Push preempted for a scheduler slice (several milliseconds) measures
/// the machine's cores, not the store. A Fetch's time splits three ways:
/// running, waiting for a CPU, and asleep (blocked on a stripe's lock,
/// which a writer holds, perhaps preempted itself).
struct Sched(Option<std::fs::File>);

/// One reading of [`Sched`], nanoseconds.
#[derive(Debug, Clone, Copy)]
struct Reading {
    ran: u64,
    waited: u64,
}

impl Sched {
    /// For the calling thread; `None` readings where the kernel has no
    /// scheduler statistics.
    fn of_this_thread() -> Self {
        Self(std::fs::File::open("/proc/thread-self/schedstat").ok())
    }

    fn read(&self) -> Option<Reading> {
        use std::os::unix::fs::FileExt as _;
        let file = self.0.as_ref()?;
        let mut buf = [0u8; 96];
        let n = file.read_at(&mut buf, 0).ok()?;
        let text = std::str::from_utf8(&buf[..n]).ok()?;
        let waited = text.split_whitespace().nth(1)?.parse().ok()?;
        // The CPU clock brings the thread's run time up to date when read;
        // schedstat's first field moves only at a tick or a switch.
        let ran = nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).ok()?;
        let ran = u64::try_from(ran.tv_sec()).ok()? * 1_000_000_000
            + u64::try_from(ran.tv_nsec()).ok()?;
        Some(Reading { ran, waited })
    }

    /// Microseconds (ran, waited for a CPU) since `before`; zeros without
    /// readings.
    fn since(&self, before: Option<Reading>) -> (f64, f64) {
        match (before, self.read()) {
            (Some(a), Some(b)) => (
                b.ran.saturating_sub(a.ran) as f64 / 1e3,
                b.waited.saturating_sub(a.waited) as f64 / 1e3,
            ),
            _ => (0.0, 0.0),
        }
    }
}

/// One Fetch beside a writer: when, and how its time was spent.
#[derive(Debug, Clone, Copy)]
struct Sample {
    from: Instant,
    to: Instant,
    /// µs its thread ran on a CPU.
    ran: f64,
    /// µs its thread waited for a CPU.
    waited: f64,
}

impl Sample {
    fn us(&self) -> f64 {
        micros(self.to - self.from)
    }

    /// µs neither running nor waiting for a CPU: blocked on a lock.
    fn asleep(&self) -> f64 {
        (self.us() - self.ran - self.waited).max(0.0)
    }
}

/// Fetches of `BATCH` random rows of the first `there`, one after another
/// until `stop`, on a thread of their own.
fn fetch_beside(
    bench: &Arc<Bench>,
    stop: &Arc<AtomicBool>,
    there: &Arc<AtomicU64>,
    seed: u64,
) -> std::thread::JoinHandle<Vec<Sample>> {
    let (bench, stop, there) = (Arc::clone(bench), Arc::clone(stop), Arc::clone(there));
    std::thread::spawn(move || {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut out = vec![0u8; bench.kind.dim * 4 * BATCH];
        let mut samples = Vec::new();
        let sched = Sched::of_this_thread();
        while !stop.load(Ordering::Relaxed) {
            let rows = there.load(Ordering::Relaxed);
            let keys: Vec<u64> = (0..BATCH).map(|_| key(rng.random_range(0..rows))).collect();
            let before = sched.read();
            let from = Instant::now();
            bench.fetch(&keys, &mut out);
            let to = Instant::now();
            let (ran, waited) = sched.since(before);
            samples.push(Sample {
                from,
                to,
                ran,
                waited,
            });
        }
        samples
    })
}

/// A writer's batches beside the Fetches: (from, to, µs it waited for a
/// CPU).
type Batches = Vec<(Instant, Instant, f64)>;

/// Runs `batch` on this thread until it returns false, the Fetches of
/// [`fetch_beside`] and a pause watcher running beside it; the Fetches,
/// the pauses and the writer's batches.
fn beside_fetches(
    bench: &Arc<Bench>,
    there: &Arc<AtomicU64>,
    seed: u64,
    mut batch: impl FnMut() -> bool,
) -> Result<(Vec<Sample>, Seen, Batches), BoxError> {
    let stop = Arc::new(AtomicBool::new(false));
    let fetcher = fetch_beside(bench, &stop, there, seed);
    let pauses = Pauses::watch(Arc::clone(&stop));
    let sched = Sched::of_this_thread();
    let mut batches = Vec::new();
    loop {
        let before = sched.read();
        let from = Instant::now();
        let more = batch();
        batches.push((from, Instant::now(), sched.since(before).1));
        if !more {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let fetched = fetcher.join().map_err(|_| "the fetch thread panicked")?;
    Ok((fetched, pauses.finish()?, batches))
}

/// The figures of Fetches beside a writer, keys prefixed `prefix`, ratios
/// to the steady (quiet) p99 `p99`: the largest Fetch, the largest no
/// machine pause overlapped, the longest any ran on a CPU and was asleep,
/// and how long the writer waited for a CPU during the Fetch that slept
/// longest (a writer preempted while it holds a stripe's lock keeps a
/// Fetch waiting for that stripe that long).
fn beside_figures(
    prefix: &str,
    fetched: &[Sample],
    pauses: &Seen,
    batches: &Batches,
    p99: f64,
) -> serde_json::Map<String, Value> {
    let all = sorted(fetched.iter().map(Sample::us).collect());
    let unpaused = sorted(
        fetched
            .iter()
            .filter(|s| !pauses.windows.iter().any(|(p, q)| *p < s.to && *q > s.from))
            .map(Sample::us)
            .collect(),
    );
    let max = |v: &[f64]| v.last().copied().unwrap_or(0.0);
    let x = |v: f64| if p99 > 0.0 { v / p99 } else { 0.0 };
    let ran_max = fetched.iter().map(|s| s.ran).fold(0.0, f64::max);
    let sleepiest = fetched
        .iter()
        .max_by(|a, b| a.asleep().total_cmp(&b.asleep()));
    let writer_waited = sleepiest.map_or(0.0, |s| {
        batches
            .iter()
            .filter(|(a, b, _)| *a < s.to && *b > s.from)
            .map(|(_, _, w)| w)
            .sum::<f64>()
            .max(0.0)
    });
    let mut m = serde_json::Map::new();
    let mut put = |k: &str, v: Value| {
        m.insert(format!("{prefix}_{k}"), v);
    };
    put("fetches", json!(all.len()));
    put("fetch_p99_us", json!(quantile(&all, 0.99)));
    put("fetch_max_us", json!(max(&all)));
    put("max_x_steady_p99", json!(x(max(&all))));
    put("machine_pauses", json!(pauses.windows.len()));
    put("machine_pause_max_ms", json!(pauses.longest_ms));
    put("unpaused_max_us", json!(max(&unpaused)));
    put("unpaused_max_x_steady_p99", json!(x(max(&unpaused))));
    put(
        "over_3x_steady_p99",
        json!(all.iter().filter(|&&us| us > 3.0 * p99).count()),
    );
    put("ran_max_us", json!(ran_max));
    put("ran_max_x_steady_p99", json!(x(ran_max)));
    put(
        "asleep_max_us",
        json!(sleepiest.map_or(0.0, Sample::asleep)),
    );
    put("asleep_writer_waited_us", json!(writer_waited));
    m
}

/// The resident size of this process, bytes.
fn rss() -> u64 {
    proc_kib("/proc/self/status", "VmRSS:") * 1024
}

/// Bytes of this process's anonymous memory on transparent huge pages.
fn huge_pages() -> u64 {
    proc_kib("/proc/self/smaps_rollup", "AnonHugePages:") * 1024
}

/// A `kB` field of a `/proc` file; 0 where it is missing.
fn proc_kib(file: &str, field: &str) -> u64 {
    std::fs::read_to_string(file)
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .unwrap_or(0)
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// Fetches of `BATCH` random rows of the first `rows` for `secs`; their
/// latencies, µs.
fn fetch_for(bench: &Bench, rows: u64, secs: f64, rng: &mut SmallRng) -> Vec<f64> {
    let mut out = vec![0u8; bench.kind.dim * 4 * BATCH];
    let mut lat = Vec::new();
    let started = Instant::now();
    while started.elapsed().as_secs_f64() < secs || lat.len() < 20 {
        let keys: Vec<u64> = (0..BATCH).map(|_| key(rng.random_range(0..rows))).collect();
        let t = Instant::now();
        let present = bench.fetch(&keys, &mut out);
        lat.push(micros(t.elapsed()));
        assert_eq!(present, BATCH, "rows missing");
    }
    lat
}

/// One child's measurement: `kind` in the old store or the new, at each
/// level of `plan`. JSON objects, one per level (and one for snapshots).
pub fn child(
    kind: TableKind,
    old: bool,
    plan: &Plan,
    snapshots: bool,
) -> Result<Vec<Value>, BoxError> {
    let bench = Arc::new(Bench::new(kind, old));
    let empty = rss();
    let mut rng = SmallRng::seed_from_u64(34);
    let grad: Vec<f32> = (0..kind.dim)
        .map(|i| ((i % 7) as f32 - 3.0) * 0.01)
        .collect();
    let mut out = Vec::new();
    let mut held = 0u64;
    for &level in &plan.rows {
        // Growth to the level under a Fetch load of the rows already there.
        if held == 0 {
            bench.push(key(0), &grad);
            held = 1;
        }
        let there = Arc::new(AtomicU64::new(held));
        let grow_started = Instant::now();
        let (grown, grow_pauses, grow_batches) = beside_fetches(&bench, &there, 35, || {
            let end = (held + BATCH as u64).min(level);
            let keys: Vec<u64> = (held..end).map(key).collect();
            bench.push_many(&keys, &grad);
            held = end;
            there.store(held, Ordering::Relaxed);
            held < level
        })?;
        let grow_secs = grow_started.elapsed().as_secs_f64();
        let resident = rss().saturating_sub(empty);
        let huge = huge_pages();
        // Quiet: Fetches, then Pushes of rows already there.
        let fetches = sorted(fetch_for(&bench, level, plan.level_secs, &mut rng));
        let mut pushed = 0u64;
        let started = Instant::now();
        while started.elapsed().as_secs_f64() < plan.level_secs || pushed < 10 * BATCH as u64 {
            let keys: Vec<u64> = (0..BATCH)
                .map(|_| key(rng.random_range(0..level)))
                .collect();
            bench.push_many(&keys, &grad);
            pushed += BATCH as u64;
        }
        let push_rate = pushed as f64 / started.elapsed().as_secs_f64();
        // Churn: the same writer and Fetches, the writer updating rows
        // already there (no growth), for as long as the growth took
        // (within 0.5-5 s): what the Fetches' tail is without growth.
        let churn_secs = grow_secs.clamp(0.5, 5.0);
        let churn_started = Instant::now();
        let mut churn_rng = SmallRng::seed_from_u64(37);
        let (churned, churn_pauses, churn_batches) = beside_fetches(&bench, &there, 38, || {
            let keys: Vec<u64> = (0..BATCH)
                .map(|_| key(churn_rng.random_range(0..level)))
                .collect();
            bench.push_many(&keys, &grad);
            churn_started.elapsed().as_secs_f64() < churn_secs
        })?;
        let p99 = quantile(&fetches, 0.99);
        let mut row = json!({
            "section": "rows",
            "store": if old { "indexmap (before)" } else { "slab" },
            "table": kind.name(),
            "optimizer": kind.optimizer,
            "dim": kind.dim,
            "storage": kind.storage.name(),
            "rows": level,
            "payload_bytes": kind.payload(),
            "bytes_per_row": resident as f64 / level as f64,
            "x_payload": resident as f64 / level as f64 / kind.payload() as f64,
            "huge_page_share": huge as f64 / resident.max(1) as f64,
            "store_bytes_per_row": bench.store_bytes().map(|b| b as f64 / level as f64),
            "fetch_p50_us": quantile(&fetches, 0.5),
            "fetch_p99_us": p99,
            "push_rows_per_s": push_rate,
            "grow_secs": grow_secs,
            "churn_secs": churn_started.elapsed().as_secs_f64(),
        });
        if let Value::Object(m) = &mut row {
            m.extend(beside_figures(
                "growth",
                &grown,
                &grow_pauses,
                &grow_batches,
                p99,
            ));
            m.extend(beside_figures(
                "churn",
                &churned,
                &churn_pauses,
                &churn_batches,
                p99,
            ));
        }
        out.push(row);
    }
    if snapshots {
        out.push(snapshot_run(&bench, held, plan, &grad)?);
    }
    Ok(out)
}

/// Pushes under a shard lock, quiet and during a checkpoint and a copy.
fn snapshot_run(
    bench: &Arc<Bench>,
    rows: u64,
    plan: &Plan,
    grad: &[f32],
) -> Result<Value, BoxError> {
    let lock = Arc::new(Mutex::new(()));
    // Set while the snapshot waits for the lock: the pusher lets it in
    // (a `Mutex` is not fair, and a pusher that takes it again at once
    // kept the snapshot waiting for a second; the server's shard lock
    // wakes its waiters in turn).
    let wanted = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    // (done, µs, µs of it waiting for a CPU)
    let log: Arc<Mutex<Vec<(Instant, f64, f64)>>> = Arc::default();
    let pusher = {
        let (bench, lock, stop, log, wanted) = (
            Arc::clone(bench),
            Arc::clone(&lock),
            Arc::clone(&stop),
            Arc::clone(&log),
            Arc::clone(&wanted),
        );
        let grad = grad.to_vec();
        std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(36);
            let sched = Sched::of_this_thread();
            while !stop.load(Ordering::Relaxed) {
                let keys: Vec<u64> = (0..BATCH).map(|_| key(rng.random_range(0..rows))).collect();
                let before = sched.read();
                let t = Instant::now();
                while wanted.load(Ordering::Acquire) {
                    std::thread::yield_now();
                }
                {
                    let _shard = lock.locked();
                    bench.push_many(&keys, &grad);
                }
                let done = Instant::now();
                let waited = sched.since(before).1;
                log.locked().push((done, micros(done - t), waited));
            }
        })
    };
    let quiet_from = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(plan.quiet_secs));
    let quiet_to = Instant::now();
    // Controls: the other core busy without a snapshot, first with a
    // spinner (no memory traffic), then with a reader streaming through
    // memory as a snapshot's reader does (no cut: no saves).
    let (busy_from, busy_to) = beside(plan.quiet_secs, |stop| {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        while !stop.load(Ordering::Relaxed) {
            for _ in 0..1024 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
            }
            std::hint::black_box(x);
        }
    });
    let stream = vec![1u64; STREAM_BYTES / 8];
    let (stream_from, stream_to) = beside(plan.quiet_secs, |stop| {
        let mut sum = 0u64;
        while !stop.load(Ordering::Relaxed) {
            for piece in stream.chunks(1 << 15) {
                sum = sum.wrapping_add(piece.iter().copied().fold(0, u64::wrapping_add));
            }
            std::hint::black_box(sum);
        }
    });
    drop(stream);
    // A checkpoint: the cut under the lock, then encoded into a file.
    let dir = tempfile::tempdir()?;
    let ckpt_from = Instant::now();
    let (cut, cut_us) = take_cut(bench, &lock, &wanted);
    let mut file = std::fs::File::create(dir.path().join("t0-s0.rows"))?;
    let mut failed = None;
    let ckpt_bytes = cut.encode(1 << 20, |piece| {
        if let Err(e) = file.write_all(piece) {
            failed.get_or_insert(e);
        }
    });
    if let Some(e) = failed {
        return Err(e.into());
    }
    file.sync_all()?;
    drop(cut);
    let ckpt_to = Instant::now();
    // A copy: the cut encoded in 1 MiB pieces handed to another thread.
    let copy_from = Instant::now();
    let (cut, copy_cut_us) = take_cut(bench, &lock, &wanted);
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(4);
    let receiver = std::thread::spawn(move || rx.iter().map(|p| p.len() as u64).sum::<u64>());
    cut.encode(1 << 20, |piece| {
        let _ = tx.send(piece.to_vec());
    });
    drop(tx);
    let copied = receiver.join().map_err(|_| "the copy receiver panicked")?;
    drop(cut);
    let copy_to = Instant::now();
    stop.store(true, Ordering::Relaxed);
    pusher.join().map_err(|_| "the push thread panicked")?;
    let log = std::mem::take(&mut *log.locked());
    // Push latencies from `from` to `to`, and the same less each one's
    // wait for a CPU.
    let during = |from: Instant, to: Instant| {
        let window = || log.iter().filter(|(at, _, _)| *at >= from && *at <= to);
        (
            sorted(window().map(|(_, us, _)| *us).collect()),
            sorted(window().map(|(_, us, w)| (us - w).max(0.0)).collect()),
        )
    };
    let (busy, _) = during(busy_from, busy_to);
    let (streamed, _) = during(stream_from, stream_to);
    let ((quiet, quiet_cpu), (ckpt, ckpt_cpu), (copy, copy_cpu)) = (
        during(quiet_from, quiet_to),
        during(ckpt_from, ckpt_to),
        during(copy_from, copy_to),
    );
    let q99 = quantile(&quiet, 0.99);
    let q99_cpu = quantile(&quiet_cpu, 0.99);
    let ratio = |v: &[f64], base: f64| {
        if base > 0.0 {
            quantile(v, 0.99) / base
        } else {
            0.0
        }
    };
    Ok(json!({
        "section": "snapshots",
        "store": if matches!(bench.store, Store::Old(_)) { "indexmap (before)" } else { "slab" },
        "table": bench.kind.name(),
        "rows": rows,
        "cut_us": cut_us,
        "copy_cut_us": copy_cut_us,
        "checkpoint_secs": (ckpt_to - ckpt_from).as_secs_f64(),
        "checkpoint_bytes": ckpt_bytes,
        "copy_secs": (copy_to - copy_from).as_secs_f64(),
        "copy_bytes": copied,
        "quiet_pushes": quiet.len(),
        "quiet_push_p50_us": quantile(&quiet, 0.5),
        "quiet_push_p99_us": q99,
        "busy_push_p99_us": quantile(&busy, 0.99),
        "busy_p99_x_quiet": ratio(&busy, q99),
        "stream_push_p99_us": quantile(&streamed, 0.99),
        "stream_p99_x_quiet": ratio(&streamed, q99),
        "checkpoint_pushes": ckpt.len(),
        "checkpoint_push_p99_us": quantile(&ckpt, 0.99),
        "checkpoint_push_max_us": ckpt.last().copied().unwrap_or(0.0),
        "checkpoint_p99_x_quiet": ratio(&ckpt, q99),
        "copy_pushes": copy.len(),
        "copy_push_p99_us": quantile(&copy, 0.99),
        "copy_push_max_us": copy.last().copied().unwrap_or(0.0),
        "copy_p99_x_quiet": ratio(&copy, q99),
        "quiet_push_on_cpu_p99_us": q99_cpu,
        "checkpoint_push_on_cpu_p99_us": quantile(&ckpt_cpu, 0.99),
        "checkpoint_on_cpu_p99_x_quiet": ratio(&ckpt_cpu, q99_cpu),
        "copy_push_on_cpu_p99_us": quantile(&copy_cpu, 0.99),
        "copy_on_cpu_p99_x_quiet": ratio(&copy_cpu, q99_cpu),
    }))
}

/// Bytes the streaming control reads over and over (more than the last
/// level cache, as a snapshot's reader reads rows it never read before).
const STREAM_BYTES: usize = 256 << 20;

/// Runs `work` on another thread for `secs` (it returns once the flag is
/// set); the window it ran in.
fn beside(secs: f64, work: impl FnOnce(&AtomicBool) + Send) -> (Instant, Instant) {
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| work(&stop));
        let from = Instant::now();
        std::thread::sleep(Duration::from_secs_f64(secs));
        let to = Instant::now();
        stop.store(true, Ordering::Relaxed);
        (from, to)
    })
}

/// A cut under the shard's lock, and how long the lock was held for it
/// (µs): what every Push waits for at most.
fn take_cut(bench: &Bench, lock: &Mutex<()>, wanted: &AtomicBool) -> (Cut, f64) {
    wanted.store(true, Ordering::Release);
    let shard = lock.locked();
    wanted.store(false, Ordering::Release);
    let held = Instant::now();
    let cut = bench.cut();
    let us = micros(held.elapsed());
    drop(shard);
    (cut, us)
}

/// Runs every (store, table) child and returns the rows and the table.
pub fn run(plan: &Plan, tables: &[TableKind]) -> Result<(Vec<Value>, String), BoxError> {
    let exe = std::env::current_exe()?;
    let mut rows = Vec::new();
    for kind in tables {
        for old in [true, false] {
            if old && kind.storage != Storage::F32 {
                continue;
            }
            let snapshots = kind.optimizer == "sgd" && kind.storage == Storage::F32;
            let mut command = std::process::Command::new(&exe);
            command
                .arg("store-child")
                .arg("--optimizer")
                .arg(kind.optimizer)
                .arg("--dim")
                .arg(kind.dim.to_string())
                .arg("--storage")
                .arg(kind.storage.name())
                .arg("--rows")
                .arg(
                    plan.rows
                        .iter()
                        .map(u64::to_string)
                        .collect::<Vec<_>>()
                        .join(","),
                )
                .arg("--level-secs")
                .arg(plan.level_secs.to_string())
                .arg("--quiet-secs")
                .arg(plan.quiet_secs.to_string());
            if old {
                command.arg("--old");
            }
            if snapshots {
                command.arg("--snapshots");
            }
            let output = command.output()?;
            if !output.status.success() {
                return Err(format!(
                    "store-child {} {}: {}",
                    kind.name(),
                    if old { "old" } else { "slab" },
                    String::from_utf8_lossy(&output.stderr)
                )
                .into());
            }
            for line in String::from_utf8_lossy(&output.stdout).lines() {
                rows.push(serde_json::from_str::<Value>(line)?);
            }
        }
    }
    let table = markdown(&rows);
    Ok((rows, table))
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or(0.0)
}

/// The report's tables: every level, the new store beside the old; the
/// snapshots.
pub fn markdown(rows: &[Value]) -> String {
    let mut out = String::from(
        "## store: one (table, shard)'s rows, the slab store beside the one before it (indexmap), as it grows\n\n\
         Each (store, table) in a process of its own; bytes per row are its resident size above the empty store; on huge pages: the share of it on transparent huge pages (`AnonHugePages`; the slab store asks for them for large blocks made ahead, `rows::block`). Fetch: 1,000 random rows read into a little-endian f32 buffer, one after another. Push: rows updated per second, 1,000 random rows at a time as the server applies a Push.\n\n\
         | table | store | rows | bytes/row | x payload | f16/f32 | on huge pages | Fetch p50 µs | p99 µs | p50 / smallest level | Push rows/s |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let levels: Vec<&Value> = rows.iter().filter(|r| r["section"] == "rows").collect();
    for r in &levels {
        let smallest = levels
            .iter()
            .filter(|o| o["table"] == r["table"] && o["store"] == r["store"])
            .min_by_key(|o| o["rows"].as_u64().unwrap_or(0))
            .map_or(0.0, |o| f(o, "fetch_p50_us"));
        let f32_twin = levels.iter().find(|o| {
            o["store"] == r["store"]
                && o["optimizer"] == r["optimizer"]
                && o["dim"] == r["dim"]
                && o["rows"] == r["rows"]
                && o["storage"] == "f32"
        });
        let narrow = match f32_twin {
            Some(t) if r["storage"] != "f32" => {
                format!("{:.2}", f(r, "bytes_per_row") / f(t, "bytes_per_row"))
            }
            _ => "".to_owned(),
        };
        out.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.2} | {} | {:.0}% | {:.0} | {:.0} | {:.2} | {:.0} |\n",
            r["table"].as_str().unwrap_or(""),
            r["store"].as_str().unwrap_or(""),
            r["rows"],
            f(r, "bytes_per_row"),
            f(r, "x_payload"),
            narrow,
            f(r, "huge_page_share") * 100.0,
            f(r, "fetch_p50_us"),
            f(r, "fetch_p99_us"),
            if smallest > 0.0 {
                f(r, "fetch_p50_us") / smallest
            } else {
                0.0
            },
            f(r, "push_rows_per_s"),
        ));
    }
    out.push_str(
        "\nFetches beside a writer. Growth: one thread adds the rows up to the level, 1,000 new keys a Push, while another Fetches 1,000 random rows of those already there without pause; churn: the same writer updating rows already there (no growth) for as long (0.5-5 s). Against the steady (quiet) Fetch p99 at the level: the p99 and the largest Fetch, how many took over 3x the steady p99, the largest no machine pause overlapped (a thread sleeping 1 ms at a time woke 4 ms or more late: the whole VM stopped), the longest a Fetch ran on a CPU (its thread's CPU clock), and the longest one slept (neither running nor waiting for a CPU: blocked on a stripe's lock, or woken late) with how long the writer waited for a CPU meanwhile. Three threads share the two cores.\n\n\
         | table | store | rows | beside | Fetches | p99 µs | max µs | x steady p99 | over 3x | machine pauses (longest ms) | max without them µs | ran max µs | x steady p99 | slept max µs | writer waited µs |\n\
         |---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in &levels {
        for beside in ["growth", "churn"] {
            let g = |k: &str| f(r, &format!("{beside}_{k}"));
            out.push_str(&format!(
                "| {} | {} | {} | {beside} | {:.0} | {:.0} | {:.0} | {:.1} | {:.0} | {:.0} ({:.0}) | {:.0} | {:.0} | {:.2} | {:.0} | {:.0} |\n",
                r["table"].as_str().unwrap_or(""),
                r["store"].as_str().unwrap_or(""),
                r["rows"],
                g("fetches"),
                g("fetch_p99_us"),
                g("fetch_max_us"),
                g("max_x_steady_p99"),
                g("over_3x_steady_p99"),
                g("machine_pauses"),
                g("machine_pause_max_ms"),
                g("unpaused_max_us"),
                g("ran_max_us"),
                g("ran_max_x_steady_p99"),
                g("asleep_max_us"),
                g("asleep_writer_waited_us"),
            ));
        }
    }
    let snaps: Vec<&Value> = rows
        .iter()
        .filter(|r| r["section"] == "snapshots")
        .collect();
    if !snaps.is_empty() {
        out.push_str(
            "\nSnapshots under Pushes (1,000 random rows per Push under the shard's lock): quiet; beside two controls that take no snapshot, a spinner on the other core (no memory traffic) and a reader streaming through 256 MiB over and over (memory traffic, no saves); then during a checkpoint (cut, encode, write a file) and a copy (cut, encode in 1 MiB pieces to another thread); the cut's figure is how long it held the shard's lock, which every Push waits for; on CPU: p99 of each Push less the time its thread waited for a CPU.\n\n\
             | table | store | rows | lock held for the cut µs | checkpoint s | Push p99 quiet µs | beside a spinner µs (x quiet) | beside a reader µs (x quiet) | during checkpoint µs | x quiet | max µs | copy s | during copy µs | x quiet | max µs | on CPU: quiet / checkpoint / copy µs |\n\
             |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for r in snaps {
            out.push_str(&format!(
                "| {} | {} | {} | {:.0} | {:.2} | {:.0} | {:.0} ({:.2}) | {:.0} ({:.2}) | {:.0} | {:.2} | {:.0} | {:.2} | {:.0} | {:.2} | {:.0} | {:.0} / {:.0} / {:.0} |\n",
                r["table"].as_str().unwrap_or(""),
                r["store"].as_str().unwrap_or(""),
                r["rows"],
                f(r, "cut_us"),
                f(r, "checkpoint_secs"),
                f(r, "quiet_push_p99_us"),
                f(r, "busy_push_p99_us"),
                f(r, "busy_p99_x_quiet"),
                f(r, "stream_push_p99_us"),
                f(r, "stream_p99_x_quiet"),
                f(r, "checkpoint_push_p99_us"),
                f(r, "checkpoint_p99_x_quiet"),
                f(r, "checkpoint_push_max_us"),
                f(r, "copy_secs"),
                f(r, "copy_push_p99_us"),
                f(r, "copy_p99_x_quiet"),
                f(r, "copy_push_max_us"),
                f(r, "quiet_push_on_cpu_p99_us"),
                f(r, "checkpoint_push_on_cpu_p99_us"),
                f(r, "copy_push_on_cpu_p99_us"),
            ));
        }
    }
    out
}
