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
