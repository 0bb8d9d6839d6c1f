//! Load generators modelled on the paper's evaluation (§8): a `ranker`
//! (inference: Fetch only) and a `trainer` (Fetch, a gradient step, Push).
//!
//! Latencies go into `hdrhistogram` histograms (the standard, well-kept
//! choice for recording latency percentiles without storing every sample)
//! at microsecond resolution with 3 significant digits.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::client::PsClient;
use crate::config::WorkloadConfig;

/// Which loop to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkloadKind {
    /// Fetch only.
    Ranker,
    /// Fetch, compute a gradient, Push.
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
#[derive(Debug, Clone, Copy, PartialEq)]
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
#[derive(Debug, Clone)]
pub struct WorkloadReport {
    /// Ranker or trainer.
    pub kind: WorkloadKind,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Completed iterations (a ranker request, or a trainer step).
    pub iterations: u64,
    /// Failed iterations.
    pub errors: u64,
    /// Rows fetched (after the caller's order is restored, so duplicates count).
    pub rows_fetched: u64,
    /// Fetch latency.
    pub fetch: LatencySummary,
    /// Push latency (trainer only).
    pub push: Option<LatencySummary>,
    /// The first error seen, if any.
    pub first_error: Option<String>,
}

impl WorkloadReport {
    /// Iterations per second.
    pub fn throughput(&self) -> f64 {
        self.iterations as f64 / self.elapsed.as_secs_f64().max(f64::EPSILON)
    }

    /// The report as table rows: `(operation, ops/s, p50, p99, p999, errors)`.
    pub fn table_rows(&self) -> Vec<[String; 7]> {
        let secs = self.elapsed.as_secs_f64().max(f64::EPSILON);
        let mut rows = vec![Self::row(
            self.kind.name(),
            "fetch",
            &self.fetch,
            secs,
            self.errors,
        )];
        if let Some(push) = &self.push {
            rows.push(Self::row(self.kind.name(), "push", push, secs, self.errors));
        }
        rows
    }

    fn row(kind: &str, op: &str, s: &LatencySummary, secs: f64, errors: u64) -> [String; 7] {
        [
            kind.to_owned(),
            op.to_owned(),
            format!("{:.0}", s.count as f64 / secs),
            format!("{:.2}", s.p50_us as f64 / 1000.0),
            format!("{:.2}", s.p99_us as f64 / 1000.0),
            format!("{:.2}", s.p999_us as f64 / 1000.0),
            errors.to_string(),
        ]
    }
}

/// Formats reports as one aligned table.
pub fn format_table(reports: &[WorkloadReport]) -> String {
    let header = [
        "workload", "op", "ops/s", "p50 ms", "p99 ms", "p999 ms", "errors",
    ];
    let rows: Vec<Vec<String>> = reports
        .iter()
        .flat_map(WorkloadReport::table_rows)
        .map(Vec::from)
        .collect();
    render_table(&header, &rows, 2)
}

/// The same table for runs of the same workloads over different transports
/// (or any other label), one block of rows per run.
pub fn format_comparison(runs: &[(String, Vec<WorkloadReport>)]) -> String {
    let header = [
        "transport",
        "workload",
        "op",
        "ops/s",
        "p50 ms",
        "p99 ms",
        "p999 ms",
        "errors",
    ];
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

struct TaskResult {
    fetch: Histogram<u64>,
    push: Histogram<u64>,
    iterations: u64,
    errors: u64,
    rows: u64,
    first_error: Option<String>,
}

/// Runs `kind` against `client` with `options` until the duration is over.
pub async fn run(
    kind: WorkloadKind,
    client: Arc<PsClient>,
    options: &WorkloadConfig,
) -> WorkloadReport {
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(options.duration_secs);
    let tasks: Vec<_> = (0..options.concurrency)
        .map(|task| {
            let client = Arc::clone(&client);
            let options = options.clone();
            tokio::spawn(async move { run_task(kind, &client, &options, task as u64, until).await })
        })
        .collect();
    let mut fetch = histogram();
    let mut push = histogram();
    let (mut iterations, mut errors, mut rows) = (0, 0, 0);
    let mut first_error = None;
    for task in tasks {
        match task.await {
            Ok(result) => {
                let _ = fetch.add(&result.fetch);
                let _ = push.add(&result.push);
                iterations += result.iterations;
                errors += result.errors;
                rows += result.rows;
                first_error = first_error.or(result.first_error);
            }
            Err(err) => {
                errors += 1;
                first_error = first_error.or_else(|| Some(format!("load task failed: {err}")));
            }
        }
    }
    WorkloadReport {
        kind,
        elapsed: started.elapsed(),
        iterations,
        errors,
        rows_fetched: rows,
        fetch: LatencySummary::of(&fetch),
        push: (kind == WorkloadKind::Trainer).then(|| LatencySummary::of(&push)),
        first_error,
    }
}

async fn run_task(
    kind: WorkloadKind,
    client: &PsClient,
    options: &WorkloadConfig,
    task: u64,
    until: Instant,
) -> TaskResult {
    let mut rng = SmallRng::seed_from_u64(options.seed.wrapping_mul(1_000_003).wrapping_add(task));
    let mut result = TaskResult {
        fetch: histogram(),
        push: histogram(),
        iterations: 0,
        errors: 0,
        rows: 0,
        first_error: None,
    };
    let mut keys = vec![0u64; options.batch_keys];
    while Instant::now() < until {
        for key in &mut keys {
            *key = rng.random_range(0..options.key_space);
        }
        match step(kind, client, options, &keys, &mut result).await {
            Ok(()) => result.iterations += 1,
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

async fn step(
    kind: WorkloadKind,
    client: &PsClient,
    options: &WorkloadConfig,
    keys: &[u64],
    result: &mut TaskResult,
) -> Result<(), String> {
    let started = Instant::now();
    let rows = client
        .fetch(&options.table, keys)
        .await
        .map_err(|e| e.to_string())?;
    let _ = result.fetch.record(micros(started.elapsed()));
    result.rows += rows.len() as u64;
    if kind == WorkloadKind::Trainer {
        // A stand-in gradient: pull every weight towards zero (L2 decay), so
        // repeated training keeps values bounded and observable.
        let gradients: Vec<f32> = rows.values().iter().map(|w| 0.1 * w).collect();
        let started = Instant::now();
        client
            .push(&options.table, keys, &gradients, rows.dim())
            .await
            .map_err(|e| e.to_string())?;
        let _ = result.push.record(micros(started.elapsed()));
    }
    Ok(())
}
