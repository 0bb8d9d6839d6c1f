//! The allocator benchmark (the paper's Figure 4).
//!
//! Each thread keeps a working set of live buffers; every operation
//! allocates a buffer of a pre-drawn size, writes its first byte, and puts
//! it in a random slot of the working set, freeing the buffer it replaces.
//! About 10% of new buffers are instead handed to another thread, which
//! frees them (with one thread, a helper thread does). Operations per second
//! count allocations and frees. Sizes:
//!
//! - `large`: 64 KiB + an exponential with mean 192 KiB, redrawn above 1 MiB;
//! - `small`: uniform over 16 B ..= 16 KiB.
//!
//! Every system runs in its own process (the parent re-executes itself, or
//! the `alloc-mimalloc` / `alloc-rpmalloc` binaries whose global allocator is
//! that allocator), so that each one's peak resident memory is its own: the
//! reported `peak_bytes` is the child's peak RSS (`VmHWM`) minus its RSS
//! before the workload started.

use std::ops::DerefMut;
use std::sync::{Arc, Barrier, mpsc};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tessera_transport::pool::{Access, CountingHook, Pool, PoolConfig};

use crate::transport::BoxError;

/// The allocation pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// 64 KiB – 1 MiB, exponentially distributed.
    Large,
    /// 16 B – 16 KiB, uniformly distributed.
    Small,
}

impl Workload {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Workload::Large => "large",
            Workload::Small => "small",
        }
    }

    /// Live buffers per thread: about 16 MiB of large or 8 MiB of small ones.
    fn working_set(self) -> usize {
        match self {
            Workload::Large => 64,
            Workload::Small => 1024,
        }
    }

    fn draw(self, rng: &mut XorShift) -> usize {
        match self {
            Workload::Small => 16 + (rng.next() % (16_384 - 16 + 1)) as usize,
            Workload::Large => loop {
                let unit = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
                let size = 65_536.0 + -(1.0 - unit).ln() * 196_608.0;
                if size <= 1_048_576.0 {
                    break size as usize;
                }
            },
        }
    }
}

/// One measured row of the result table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// `tessera-pool`, `system`, `mimalloc` or `rpmalloc`.
    pub system: String,
    /// `large` or `small`.
    pub workload: Workload,
    /// Threads allocating.
    pub threads: usize,
    /// Allocations plus frees per second, all threads together.
    pub ops_per_sec: f64,
    /// Peak resident memory of the workload, bytes.
    pub peak_bytes: u64,
}

/// xorshift64*: deterministic, seeded per thread.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Something that hands out writable buffers.
pub trait Allocator: Send + Sync + 'static {
    /// The buffer type; dropping it frees it.
    type Buf: DerefMut<Target = [u8]> + Send + 'static;
    /// Allocates `len` bytes (`len >= 1`).
    fn alloc(&self, len: usize) -> Self::Buf;
}

/// The process's global allocator, through `Vec<u8>`.
#[derive(Debug, Default)]
pub struct GlobalAllocator;

impl Allocator for GlobalAllocator {
    type Buf = Vec<u8>;

    fn alloc(&self, len: usize) -> Vec<u8> {
        let mut buf = Vec::with_capacity(len);
        buf.push(0);
        buf
    }
}

/// Tessera's registered-memory pool, with a counting registration hook.
#[derive(Debug)]
pub struct PoolAllocator(Pool);

impl PoolAllocator {
    /// A pool with default settings and no ceiling worth hitting.
    pub fn new() -> Result<Self, tessera_transport::ConfigError> {
        Ok(Self(Pool::new(
            PoolConfig::named("bench"),
            Access::LocalOnly,
            Arc::new(CountingHook::new()),
        )?))
    }
}

impl Allocator for PoolAllocator {
    type Buf = tessera_transport::pool::PoolBuf;

    #[allow(clippy::expect_used)]
    fn alloc(&self, len: usize) -> Self::Buf {
        // The benchmark sizes its working set far below the default ceiling:
        // failing here is a benchmark bug, not an input error.
        self.0.alloc(len).expect("pool allocation in the benchmark")
    }
}

fn resident_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Runs `workload` on `threads` threads for `ops_per_thread` allocations
/// each, and measures it.
pub fn run<A: Allocator>(
    allocator: A,
    system: &str,
    workload: Workload,
    threads: usize,
    ops_per_thread: usize,
) -> Row {
    let threads = threads.max(1);
    // Thread i hands buffers to thread i+1; with one thread, to a helper.
    let parties = threads.max(2);
    // Sizes and slots are drawn before the baseline RSS is taken, so the
    // peak measures the allocator and its working set, not the script.
    let scripts: Vec<(Vec<usize>, Vec<usize>)> = (0..parties)
        .map(|index| {
            let mut rng = XorShift(0x9e37_79b9_7f4a_7c15 ^ ((index as u64 + 1) * 0x1234_5677));
            let ops = if index < threads { ops_per_thread } else { 0 };
            let sizes = (0..ops).map(|_| workload.draw(&mut rng)).collect();
            let slots = (0..ops).map(|_| rng.next() as usize).collect();
            (sizes, slots)
        })
        .collect();
    let rss_before = resident_kib("VmRSS:");
    let allocator = Arc::new(allocator);
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..parties).map(|_| mpsc::channel::<A::Buf>()).unzip();
    let barrier = Arc::new(Barrier::new(parties + 1));
    let mut handles = Vec::new();
    for ((index, receiver), (sizes, slots)) in receivers.into_iter().enumerate().zip(scripts) {
        let allocator = Arc::clone(&allocator);
        let barrier = Arc::clone(&barrier);
        let next = senders[(index + 1) % parties].clone();
        handles.push(std::thread::spawn(move || {
            let mut live: Vec<A::Buf> = Vec::with_capacity(workload.working_set());
            let mut count = 0u64;
            barrier.wait();
            for (i, (&size, &slot)) in sizes.iter().zip(&slots).enumerate() {
                let mut buf = allocator.alloc(size);
                buf[0] = i as u8;
                count += 1;
                if i % 10 == 9 {
                    let _ = next.send(buf);
                } else if live.len() < workload.working_set() {
                    live.push(buf);
                } else {
                    live[slot % workload.working_set()] = buf;
                    count += 1;
                }
                while let Ok(foreign) = receiver.try_recv() {
                    drop(foreign);
                    count += 1;
                }
            }
            count += live.len() as u64;
            drop(live);
            drop(next);
            while let Ok(foreign) = receiver.recv() {
                drop(foreign);
                count += 1;
            }
            count
        }));
    }
    drop(senders);
    barrier.wait();
    let started = Instant::now();
    let operations: u64 = handles.into_iter().map(|h| h.join().unwrap_or(0)).sum();
    let elapsed = started.elapsed().as_secs_f64();
    let peak = resident_kib("VmHWM:").saturating_sub(rss_before) * 1024;
    Row {
        system: system.to_owned(),
        workload,
        threads,
        ops_per_sec: operations as f64 / elapsed.max(f64::EPSILON),
        peak_bytes: peak,
    }
}

/// Parses the arguments a child process gets: `WORKLOAD THREADS OPS`.
pub fn parse_child_args(args: &[String]) -> Result<(Workload, usize, usize), String> {
    let [workload, threads, ops] = args else {
        return Err(format!("expected WORKLOAD THREADS OPS, got {args:?}"));
    };
    let workload = match workload.as_str() {
        "large" => Workload::Large,
        "small" => Workload::Small,
        other => return Err(format!("unknown workload {other}")),
    };
    let threads = threads.parse().map_err(|e| format!("threads: {e}"))?;
    let ops = ops.parse().map_err(|e| format!("ops: {e}"))?;
    Ok((workload, threads, ops))
}

/// `main` of a child process whose global allocator is `system`: runs the
/// workload named by the command line through `Vec<u8>` and prints its row
/// as JSON.
#[allow(clippy::print_stdout, clippy::print_stderr)]
pub fn global_allocator_child(system: &str) -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = parse_child_args(&args)
        .map(|(workload, threads, ops)| run(GlobalAllocator, system, workload, threads, ops))
        .and_then(|row| serde_json::to_string(&row).map_err(|e| e.to_string()));
    match result {
        Ok(json) => {
            println!("{json}");
            std::process::ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("alloc-{system}: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}

// The comparison: every system in a process of its own, medians, the table.

const SYSTEMS: [&str; 4] = ["tessera-pool", "system", "mimalloc", "rpmalloc"];

#[allow(clippy::print_stdout)]
/// The `alloc-child` process: one system's measurement, printed as a JSON
/// row.
pub fn child(system: &str, args: &[String]) -> Result<(), BoxError> {
    let (workload, threads, ops) = parse_child_args(args)?;
    let row = match system {
        "tessera-pool" => run(PoolAllocator::new()?, system, workload, threads, ops),
        "system" => run(GlobalAllocator, system, workload, threads, ops),
        other => return Err(format!("unknown system {other}").into()),
    };
    println!("{}", serde_json::to_string(&row)?);
    Ok(())
}

fn measure(system: &str, workload: Workload, threads: usize, ops: usize) -> Result<Row, BoxError> {
    let exe = std::env::current_exe()?;
    let args = [
        workload.name().to_owned(),
        threads.to_string(),
        ops.to_string(),
    ];
    let mut command = match system {
        "mimalloc" => std::process::Command::new(exe.with_file_name("alloc-mimalloc")),
        "rpmalloc" => std::process::Command::new(exe.with_file_name("alloc-rpmalloc")),
        _ => {
            let mut c = std::process::Command::new(&exe);
            c.args(["alloc-child", system]);
            c
        }
    };
    let output = command.args(&args).output()?;
    if !output.status.success() {
        return Err(format!(
            "{system} {workload:?} x{threads} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    Ok(serde_json::from_slice(&output.stdout)?)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

#[allow(clippy::print_stdout)]
/// Every system, workload and thread count, each in a process of its own
/// (`repeat` times, the median kept): the table, and with `out` the result.
pub fn compare(
    quick: bool,
    out: Option<std::path::PathBuf>,
    threads: &[usize],
    repeat: usize,
) -> Result<(), BoxError> {
    let meta = crate::report::Meta::collect("alloc");
    let mut rows: Vec<Row> = Vec::new();
    for workload in [Workload::Large, Workload::Small] {
        let ops = match (workload, quick) {
            (Workload::Large, false) => 200_000,
            (Workload::Small, false) => 2_000_000,
            (Workload::Large, true) => 10_000,
            (Workload::Small, true) => 100_000,
        };
        for &n in threads {
            for system in SYSTEMS {
                let runs = (0..repeat.max(1))
                    .map(|_| measure(system, workload, n, ops))
                    .collect::<Result<Vec<Row>, BoxError>>()?;
                rows.push(Row {
                    system: system.to_owned(),
                    workload,
                    threads: n,
                    ops_per_sec: median(runs.iter().map(|r| r.ops_per_sec).collect()),
                    peak_bytes: median(runs.iter().map(|r| r.peak_bytes as f64).collect()) as u64,
                });
            }
        }
    }
    let table = markdown(&rows, repeat);
    let rows = rows
        .iter()
        .map(serde_json::to_value)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(crate::report::emit(&meta, out.as_deref(), &rows, &table)?)
}

fn markdown(rows: &[Row], repeat: usize) -> String {
    let mut out = format!(
        "alloc: operations (allocations + frees) per second and peak RSS, median of {repeat} run(s) each\n\n"
    );
    out.push_str("| workload | threads | system | ops/s | vs rpmalloc | vs system | peak MiB | peak vs rpmalloc |\n");
    out.push_str("|---|---:|---|---:|---:|---:|---:|---:|\n");
    for row in rows {
        let find = |system: &str| {
            rows.iter().find(|r| {
                r.system == system && r.workload == row.workload && r.threads == row.threads
            })
        };
        let ratio = |other: Option<&Row>, f: fn(&Row) -> f64| {
            other.map_or("-".to_owned(), |o| {
                format!("{:.2}", f(row) / f(o).max(f64::EPSILON))
            })
        };
        out.push_str(&format!(
            "| {} | {} | {} | {:.0} | {} | {} | {:.1} | {} |\n",
            row.workload.name(),
            row.threads,
            row.system,
            row.ops_per_sec,
            ratio(find("rpmalloc"), |r| r.ops_per_sec),
            ratio(find("system"), |r| r.ops_per_sec),
            row.peak_bytes as f64 / (1 << 20) as f64,
            ratio(find("rpmalloc"), |r| r.peak_bytes as f64),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_stay_in_range() {
        let mut rng = XorShift(7);
        for _ in 0..10_000 {
            let large = Workload::Large.draw(&mut rng);
            assert!((65_536..=1_048_576).contains(&large));
            let small = Workload::Small.draw(&mut rng);
            assert!((16..=16_384).contains(&small));
        }
    }

    #[test]
    fn a_tiny_run_counts_every_allocation_and_free() {
        for threads in [1, 2] {
            let row = run(GlobalAllocator, "system", Workload::Small, threads, 5_000);
            assert!(row.ops_per_sec > 0.0);
            let row = run(
                PoolAllocator::new().unwrap(),
                "tessera-pool",
                Workload::Large,
                threads,
                500,
            );
            assert!(row.ops_per_sec > 0.0);
        }
    }
}
