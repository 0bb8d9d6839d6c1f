//! Load generators modelled on the paper's evaluation (§8):
//!
//! - `ranker` (inference, §8.1): user requests, `concurrency` of them
//!   outstanding, each needing `models` models; every model is one Fetch of
//!   its own features (a key range of its own), all of a request's Fetches
//!   concurrent and each split over the shards, so one request fans out to
//!   many servers. Response sizes are log-uniform between
//!   `response_bytes_min` and `response_bytes_max` (KiB to MiB). Reported:
//!   request latency (mean, p50, p99, p999), requests per second, and CPU
//!   time per request (user + system of this process, from `getrusage`).
//! - `trainer` (training, §8.2): steps of Fetch, a gradient computed from
//!   the rows (plus `compute_us` of sleep), Push; message sizes log-normal
//!   with mean `message_bytes_mean` and p99 `message_bytes_p99` (20 and 50
//!   KiB by default). Reported: Fetch and Push p50/p99, steps per second.
//!
//! Latencies go into `hdrhistogram` histograms (the standard, well-kept
//! choice for recording latency percentiles without storing every sample)
//! at microsecond resolution with 3 significant digits.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::client::{FetchSpec, PsClient};
use crate::config::WorkloadConfig;

/// Which loop to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkloadKind {
    /// Inference: user requests of `models` concurrent Fetches.
    Ranker,
    /// Training: Fetch, compute a gradient, Push.
    Trainer,
}

impl WorkloadKind {
    fn name(self) -> &'static str {
        match self {
            WorkloadKind::Ranker => "ranker",
            WorkloadKind::Trainer => "trainer",
        }
    }
}

/// Latency percentiles of one operation, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LatencySummary {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean_us: f64,
    /// Median.
    pub p50_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// 99.9th percentile.
    pub p999_us: u64,
    /// Maximum.
    pub max_us: u64,
}

impl LatencySummary {
    fn of(histogram: &Histogram<u64>) -> Self {
        Self {
            count: histogram.len(),
            mean_us: histogram.mean(),
            p50_us: histogram.value_at_quantile(0.50),
            p99_us: histogram.value_at_quantile(0.99),
            p999_us: histogram.value_at_quantile(0.999),
            max_us: histogram.max(),
        }
    }
}

/// What a workload run measured.
#[derive(Debug, Clone, Serialize)]
pub struct WorkloadReport {
    /// Ranker or trainer.
    pub kind: WorkloadKind,
    /// Wall time of the run.
    #[serde(serialize_with = "as_secs")]
    pub elapsed: Duration,
    /// Completed iterations (a ranker user request, or a trainer step).
    pub iterations: u64,
    /// Failed iterations.
    pub errors: u64,
    /// Rows fetched (after the caller's order is restored, so duplicates count).
    pub rows_fetched: u64,
    /// Bytes of rows fetched.
    pub bytes_fetched: u64,
    /// Fetch latency: of a whole user request (ranker), of a step's Fetch
    /// (trainer).
    pub fetch: LatencySummary,
    /// Push latency (trainer only).
    pub push: Option<LatencySummary>,
    /// CPU time of this process (user + system) per completed iteration,
    /// in microseconds.
    pub cpu_us_per_iteration: f64,
    /// Of which user time.
    pub cpu_user_us_per_iteration: f64,
    /// Of which system time.
    pub cpu_system_us_per_iteration: f64,
    /// Context switches of this process's threads (voluntary and not) per
    /// completed iteration: how often the work crossed threads or waited.
    pub context_switches_per_iteration: f64,
    /// Iterations started per second asked for (`rate_per_sec`); `None`
    /// for a closed loop.
    pub offered_rate: Option<f64>,
    /// The first error seen, if any.
    pub first_error: Option<String>,
    /// Each second of the run, by when its iterations were due (started,
    /// in a closed loop): how many completed and failed, and their
    /// latency. What a failure in the
    /// middle of a run cost, and when it stopped costing, shows here.
    pub timeline: Vec<SecondSummary>,
}

/// One second of a run ([`WorkloadReport::timeline`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SecondSummary {
    /// Seconds since the start of the run.
    pub second: u64,
    /// Iterations due in it that completed.
    pub iterations: u64,
    /// Iterations due in it that failed.
    pub errors: u64,
    /// 99th percentile latency of its completed iterations, µs.
    pub p99_us: u64,
    /// Its slowest completed iteration, µs.
    pub max_us: u64,
}

/// The iterations of one second, as one task saw them.
#[derive(Debug)]
struct Second {
    iterations: u64,
    errors: u64,
    latency: Histogram<u64>,
}

impl Second {
    #[allow(clippy::expect_used)]
    fn new() -> Self {
        Self {
            iterations: 0,
            errors: 0,
            // Two significant digits, growing only as far as the second's
            // slowest iteration: a second of millisecond requests holds
            // about 1 KiB (a run keeps one per task per second). The
            // precision is a constant `new` accepts.
            latency: Histogram::new(2).expect("constant histogram precision is valid"),
        }
    }
}

/// Merges the tasks' seconds into the run's timeline.
fn timeline(tasks: &[Vec<Second>]) -> Vec<SecondSummary> {
    let len = tasks.iter().map(Vec::len).max().unwrap_or(0);
    (0..len)
        .map(|i| {
            let mut merged = Second::new();
            for second in tasks.iter().filter_map(|t| t.get(i)) {
                merged.iterations += second.iterations;
                merged.errors += second.errors;
                let _ = merged.latency.add(&second.latency);
            }
            SecondSummary {
                second: i as u64,
                iterations: merged.iterations,
                errors: merged.errors,
                p99_us: merged.latency.value_at_quantile(0.99),
                max_us: merged.latency.max(),
            }
        })
        .collect()
}

fn as_secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

impl WorkloadReport {
    /// Iterations per second.
    pub fn throughput(&self) -> f64 {
        self.iterations as f64 / self.elapsed.as_secs_f64().max(f64::EPSILON)
    }

    /// The report as table rows: `(workload, op, ops/s, mean, p50, p99,
    /// p999, CPU µs per iteration, errors)`.
    pub fn table_rows(&self) -> Vec<[String; 9]> {
        let secs = self.elapsed.as_secs_f64().max(f64::EPSILON);
        let mut rows = vec![self.row("fetch", &self.fetch, secs)];
        if let Some(push) = &self.push {
            rows.push(self.row("push", push, secs));
        }
        rows
    }

    fn row(&self, op: &str, s: &LatencySummary, secs: f64) -> [String; 9] {
        [
            self.kind.name().to_owned(),
            op.to_owned(),
            format!("{:.0}", s.count as f64 / secs),
            format!("{:.2}", s.mean_us / 1000.0),
            format!("{:.2}", s.p50_us as f64 / 1000.0),
            format!("{:.2}", s.p99_us as f64 / 1000.0),
            format!("{:.2}", s.p999_us as f64 / 1000.0),
            format!("{:.0}", self.cpu_us_per_iteration),
            self.errors.to_string(),
        ]
    }
}

/// Columns of the report tables.
const COLUMNS: [&str; 9] = [
    "workload",
    "op",
    "ops/s",
    "mean ms",
    "p50 ms",
    "p99 ms",
    "p999 ms",
    "cpu us/it",
    "errors",
];

/// Formats reports as one aligned table.
pub fn format_table(reports: &[WorkloadReport]) -> String {
    let rows: Vec<Vec<String>> = reports
        .iter()
        .flat_map(WorkloadReport::table_rows)
        .map(Vec::from)
        .collect();
    render_table(&COLUMNS, &rows, 2)
}

/// The same table for runs of the same workloads over different transports
/// (or any other label), one block of rows per run.
pub fn format_comparison(runs: &[(String, Vec<WorkloadReport>)]) -> String {
    let mut header = vec!["transport"];
    header.extend(COLUMNS);
    let rows: Vec<Vec<String>> = runs
        .iter()
        .flat_map(|(label, reports)| {
            reports
                .iter()
                .flat_map(WorkloadReport::table_rows)
                .map(|row| {
                    let mut cells = vec![label.clone()];
                    cells.extend(row);
                    cells
                })
        })
        .collect();
    render_table(&header, &rows, 3)
}

/// A markdown table; the first `left` columns are left-aligned, the rest
/// (numbers) right-aligned.
fn render_table(header: &[&str], rows: &[Vec<String>], left: usize) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let mut out = String::new();
    let line = |cells: &[&str], out: &mut String| {
        let parts: Vec<String> = cells
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, w))| {
                if i < left {
                    format!("{c:<w$}")
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect();
        out.push_str(&format!("| {} |\n", parts.join(" | ")));
    };
    line(header, &mut out);
    let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
    out.push_str(&format!("|-{}-|\n", rule.join("-|-")));
    for row in rows {
        let cells: Vec<&str> = row.iter().map(String::as_str).collect();
        line(&cells, &mut out);
    }
    out
}

impl fmt::Display for WorkloadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_table(std::slice::from_ref(self)))
    }
}

#[allow(clippy::expect_used)]
fn histogram() -> Histogram<u64> {
    // 1 µs .. 60 s at 3 significant digits: constant bounds that
    // `new_with_bounds` accepts (low >= 1, high >= 2 * low, sigfig <= 5).
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("constant histogram bounds are valid")
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros())
        .unwrap_or(u64::MAX)
        .clamp(1, 60_000_000)
}

/// CPU time (user, system) this process has used so far, in microseconds,
/// and its threads' context switches.
fn process_usage() -> (u64, u64, u64) {
    use nix::sys::resource::{UsageWho, getrusage};
    getrusage(UsageWho::RUSAGE_SELF).map_or((0, 0, 0), |usage| {
        let us = |t: nix::sys::time::TimeVal| t.tv_sec() as u64 * 1_000_000 + t.tv_usec() as u64;
        let switches = usage.voluntary_context_switches() + usage.involuntary_context_switches();
        (
            us(usage.user_time()),
            us(usage.system_time()),
            u64::try_from(switches).unwrap_or(0),
        )
    })
}

/// Message sizes: log-uniform (ranker) or log-normal with a mean and p99
/// (trainer), in bytes.
#[derive(Debug, Clone, Copy)]
enum SizeDistribution {
    LogUniform { min: f64, max: f64 },
    LogNormal { mu: f64, sigma: f64 },
}

impl SizeDistribution {
    fn ranker(options: &WorkloadConfig) -> Self {
        SizeDistribution::LogUniform {
            min: options.response_bytes_min as f64,
            max: options.response_bytes_max as f64,
        }
    }

    /// The log-normal with `mean` and 99th percentile `p99`: solves
    /// `p99 / mean = exp(2.3263 σ - σ²/2)` for σ by bisection (the ratio
    /// grows with σ up to σ = 2.3263, where it peaks).
    fn trainer(options: &WorkloadConfig) -> Self {
        const Z99: f64 = 2.326_347_874;
        let (mean, p99) = (
            options.message_bytes_mean as f64,
            options.message_bytes_p99 as f64,
        );
        let target = (p99 / mean).max(1.0).ln();
        let (mut lo, mut hi) = (0.0f64, Z99);
        for _ in 0..60 {
            let mid = (lo + hi) / 2.0;
            if Z99 * mid - mid * mid / 2.0 < target {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let sigma = lo;
        SizeDistribution::LogNormal {
            mu: mean.ln() - sigma * sigma / 2.0,
            sigma,
        }
    }

    fn draw(&self, rng: &mut SmallRng) -> f64 {
        match *self {
            SizeDistribution::LogUniform { min, max } => {
                (min.ln() + rng.random::<f64>() * (max.ln() - min.ln())).exp()
            }
            SizeDistribution::LogNormal { mu, sigma } => {
                // Box-Muller; 1 - u keeps the logarithm finite.
                let u1 = 1.0 - rng.random::<f64>();
                let u2 = rng.random::<f64>();
                let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                (mu + sigma * z).exp()
            }
        }
    }

    /// Keys for a message of a drawn size, rows of `row_bytes` each.
    fn keys(&self, rng: &mut SmallRng, row_bytes: usize) -> usize {
        ((self.draw(rng) / row_bytes.max(1) as f64).round() as usize).max(1)
    }
}

#[derive(Default)]
struct TaskResult {
    fetch: Option<Histogram<u64>>,
    push: Option<Histogram<u64>>,
    iterations: u64,
    errors: u64,
    rows: u64,
    bytes: u64,
    first_error: Option<String>,
    /// By second of the run.
    seconds: Vec<Second>,
}

/// Runs `kind` against `client` with `options` until the duration is over.
pub async fn run(
    kind: WorkloadKind,
    client: Arc<PsClient>,
    options: &WorkloadConfig,
) -> WorkloadReport {
    run_with_progress(kind, client, options, Arc::new(AtomicU64::new(0))).await
}

/// [`run`], counting completed iterations in `progress` as it goes (for a
/// progress display).
pub async fn run_with_progress(
    kind: WorkloadKind,
    client: Arc<PsClient>,
    options: &WorkloadConfig,
    progress: Arc<AtomicU64>,
) -> WorkloadReport {
    let started = Instant::now();
    let cpu_before = process_usage();
    // The row size converts message sizes into key counts.
    let row_bytes = match client.fetch(&options.table, &[0]).await {
        Ok(rows) => rows.dim() * tessera_proto::rows::F32_BYTES,
        Err(err) => {
            return WorkloadReport {
                kind,
                elapsed: started.elapsed(),
                iterations: 0,
                errors: 1,
                rows_fetched: 0,
                bytes_fetched: 0,
                fetch: LatencySummary::of(&histogram()),
                push: None,
                cpu_us_per_iteration: 0.0,
                cpu_user_us_per_iteration: 0.0,
                cpu_system_us_per_iteration: 0.0,
                context_switches_per_iteration: 0.0,
                offered_rate: None,
                first_error: Some(format!("probing table `{}`: {err}", options.table)),
                timeline: Vec::new(),
            };
        }
    };
    let until = started + Duration::from_secs_f64(options.duration_secs);
    let tasks: Vec<_> = (0..options.concurrency)
        .map(|task| {
            let client = Arc::clone(&client);
            let options = options.clone();
            let progress = Arc::clone(&progress);
            tokio::spawn(async move {
                run_task(
                    kind,
                    &client,
                    &options,
                    task as u64,
                    (started, until),
                    row_bytes,
                    &progress,
                )
                .await
            })
        })
        .collect();
    let mut fetch = histogram();
    let mut push = histogram();
    let (mut iterations, mut errors, mut rows, mut bytes) = (0, 0, 0, 0);
    let mut first_error = None;
    let mut seconds = Vec::new();
    for task in tasks {
        match task.await {
            Ok(mut result) => {
                seconds.push(std::mem::take(&mut result.seconds));
                if let Some(h) = &result.fetch {
                    let _ = fetch.add(h);
                }
                if let Some(h) = &result.push {
                    let _ = push.add(h);
                }
                iterations += result.iterations;
                errors += result.errors;
                rows += result.rows;
                bytes += result.bytes;
                first_error = first_error.or(result.first_error);
            }
            Err(err) => {
                errors += 1;
                first_error = first_error.or_else(|| Some(format!("load task failed: {err}")));
            }
        }
    }
    let cpu_after = process_usage();
    let (user, system, switches) = (
        cpu_after.0.saturating_sub(cpu_before.0),
        cpu_after.1.saturating_sub(cpu_before.1),
        cpu_after.2.saturating_sub(cpu_before.2),
    );
    let per = |us: u64| us as f64 / iterations.max(1) as f64;
    WorkloadReport {
        kind,
        elapsed: started.elapsed(),
        iterations,
        errors,
        rows_fetched: rows,
        bytes_fetched: bytes,
        fetch: LatencySummary::of(&fetch),
        push: (kind == WorkloadKind::Trainer).then(|| LatencySummary::of(&push)),
        cpu_us_per_iteration: per(user + system),
        cpu_user_us_per_iteration: per(user),
        cpu_system_us_per_iteration: per(system),
        context_switches_per_iteration: per(switches),
        offered_rate: (options.rate_per_sec > 0.0).then_some(options.rate_per_sec),
        first_error,
        timeline: timeline(&seconds),
    }
}

async fn run_task(
    kind: WorkloadKind,
    client: &PsClient,
    options: &WorkloadConfig,
    task: u64,
    (started, until): (Instant, Instant),
    row_bytes: usize,
    progress: &AtomicU64,
) -> TaskResult {
    let mut rng = SmallRng::seed_from_u64(options.seed.wrapping_mul(1_000_003).wrapping_add(task));
    let mut result = TaskResult {
        fetch: Some(histogram()),
        push: Some(histogram()),
        ..TaskResult::default()
    };
    let sizes = match kind {
        WorkloadKind::Ranker => SizeDistribution::ranker(options),
        WorkloadKind::Trainer => SizeDistribution::trainer(options),
    };
    let step = Step {
        client,
        options,
        sizes: &sizes,
        row_bytes,
    };
    // Open loop: this task's iterations are due every `interval`, the
    // tasks' schedules offset from each other by a fraction of it.
    let interval = (options.rate_per_sec > 0.0)
        .then(|| Duration::from_secs_f64(options.concurrency as f64 / options.rate_per_sec));
    let mut due = Instant::now()
        + interval.map_or(Duration::ZERO, |i| {
            i.mul_f64(task as f64 / options.concurrency.max(1) as f64)
        });
    loop {
        if interval.is_none() {
            due = Instant::now();
        }
        // Checked before sleeping: a task whose next iteration falls
        // after the end must not sleep until then (with many tasks at a
        // low rate that is most of an interval past the end).
        if due >= until {
            break;
        }
        if interval.is_some() {
            tokio::time::sleep_until(due.into()).await;
        }
        let outcome = match kind {
            WorkloadKind::Ranker => ranker_request(&step, &mut rng, &mut result, due).await,
            WorkloadKind::Trainer => trainer_step(&step, &mut rng, &mut result, due).await,
        };
        let index = due.saturating_duration_since(started).as_secs() as usize;
        if result.seconds.len() <= index {
            result.seconds.resize_with(index + 1, Second::new);
        }
        let second = &mut result.seconds[index];
        match &outcome {
            Ok(()) => {
                second.iterations += 1;
                let _ = second.latency.record(micros(due.elapsed()));
            }
            Err(_) => second.errors += 1,
        }
        if let Some(interval) = interval {
            due += interval;
        }
        match outcome {
            Ok(()) => {
                result.iterations += 1;
                progress.fetch_add(1, Ordering::Relaxed);
            }
            Err(err) => {
                result.errors += 1;
                result.first_error.get_or_insert(err);
                // A server that is down fails calls at once: do not spin.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    result
}

impl TaskResult {
    /// Counts the rows and bytes of one Fetch's answer.
    fn count(&mut self, rows: &crate::client::Rows) {
        self.rows += rows.len() as u64;
        self.bytes += (rows.values().len() * tessera_proto::rows::F32_BYTES) as u64;
    }
}

fn record(histogram: &mut Option<Histogram<u64>>, since: Instant) {
    if let Some(h) = histogram {
        let _ = h.record(micros(since.elapsed()));
    }
}

/// What every iteration of one load task uses.
#[derive(Clone, Copy)]
struct Step<'a> {
    client: &'a PsClient,
    options: &'a WorkloadConfig,
    sizes: &'a SizeDistribution,
    row_bytes: usize,
}

/// One user request: `models` concurrent Fetches, model i's keys in its
/// own range `[i * key_space, (i + 1) * key_space)`.
async fn ranker_request(
    step: &Step<'_>,
    rng: &mut SmallRng,
    result: &mut TaskResult,
    due: Instant,
) -> Result<(), String> {
    let (client, options) = (step.client, step.options);
    let keys: Vec<Vec<u64>> = (0..options.models as u64)
        .map(|model| {
            let n = step.sizes.keys(rng, step.row_bytes);
            let base = model * options.key_space;
            (0..n)
                .map(|_| base + rng.random_range(0..options.key_space))
                .collect()
        })
        .collect();
    let specs: Vec<FetchSpec<'_>> = keys
        .iter()
        .map(|keys| FetchSpec {
            table: &options.table,
            keys,
        })
        .collect();
    let answers = client.fetch_many(&specs).await.map_err(|e| e.to_string())?;
    record(&mut result.fetch, due);
    for rows in &answers {
        result.count(rows);
    }
    Ok(())
}

/// One training step: Fetch, gradient, (sleep), Push.
async fn trainer_step(
    step: &Step<'_>,
    rng: &mut SmallRng,
    result: &mut TaskResult,
    due: Instant,
) -> Result<(), String> {
    let (client, options) = (step.client, step.options);
    let n = step.sizes.keys(rng, step.row_bytes);
    let keys: Vec<u64> = (0..n)
        .map(|_| rng.random_range(0..options.key_space))
        .collect();
    // Planned once: the Push goes to the rows the Fetch returned.
    let planned = client.plan_fetch(&options.table, &keys);
    let rows = client
        .fetch_planned(&planned)
        .await
        .map_err(|e| e.to_string())?;
    record(&mut result.fetch, due);
    result.count(&rows);
    // The computation: a gradient that pulls every weight towards a
    // per-key target (L2 towards a random point), so values stay bounded
    // and every Push changes them.
    let dim = rows.dim();
    let gradients: Vec<f32> = rows
        .values()
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let target = ((keys[i / dim.max(1)] ^ i as u64) % 7) as f32 * 0.01;
            0.1 * (w - target)
        })
        .collect();
    if options.compute_us > 0 {
        tokio::time::sleep(Duration::from_micros(options.compute_us)).await;
    }
    let started = Instant::now();
    let push = client
        .plan_push_for(&planned, &gradients, dim)
        .map_err(|e| e.to_string())?;
    client
        .push_planned(client.next_push_id(), &push)
        .await
        .map_err(|e| e.to_string())?;
    record(&mut result.push, started);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trainer_sizes_have_the_configured_mean_and_p99() {
        let options = WorkloadConfig::default();
        let sizes = SizeDistribution::trainer(&options);
        let mut rng = SmallRng::seed_from_u64(3);
        let mut draws: Vec<f64> = (0..200_000).map(|_| sizes.draw(&mut rng)).collect();
        draws.sort_by(f64::total_cmp);
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        let p99 = draws[draws.len() * 99 / 100];
        assert!((mean / 20480.0 - 1.0).abs() < 0.02, "mean {mean}");
        assert!((p99 / 51200.0 - 1.0).abs() < 0.04, "p99 {p99}");
    }

    #[test]
    fn ranker_sizes_span_kib_to_mib() {
        let options = WorkloadConfig::default();
        let sizes = SizeDistribution::ranker(&options);
        let mut rng = SmallRng::seed_from_u64(4);
        let draws: Vec<f64> = (0..10_000).map(|_| sizes.draw(&mut rng)).collect();
        assert!(draws.iter().all(|&d| (1024.0..=1_048_576.0).contains(&d)));
        assert!(draws.iter().any(|&d| d < 4096.0));
        assert!(draws.iter().any(|&d| d > 262_144.0));
    }
}
