//! Several threads allocate, free and hand buffers to each other for a few
//! seconds; afterwards nothing is in use and everything can be released.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tessera_transport::pool::{Access, CountingHook, Pool, PoolBuf, PoolConfig};

/// xorshift64*: a tiny deterministic generator, seeded per thread.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

#[test]
fn threads_transferring_buffers_leak_nothing() {
    const THREADS: usize = 4;
    let hook = Arc::new(CountingHook::new());
    let pool = Pool::new(
        PoolConfig::named("stress"),
        Access::RemoteWrite,
        hook.clone(),
    )
    .unwrap();
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..THREADS).map(|_| mpsc::channel::<PoolBuf>()).unzip();
    let until = Instant::now() + Duration::from_secs(3);
    let mut handles = Vec::new();
    for (index, receiver) in receivers.into_iter().enumerate() {
        let pool = pool.clone();
        let next = senders[(index + 1) % THREADS].clone();
        handles.push(std::thread::spawn(move || {
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (index as u64 + 1));
            let mut live: Vec<PoolBuf> = Vec::new();
            let mut operations = 0u64;
            while Instant::now() < until {
                let roll = rng.next();
                let len = match roll % 100 {
                    0 => (rng.next() % (4 << 20)) as usize + 1, // dedicated
                    1..=20 => (rng.next() % (1 << 20)) as usize + 1, // large classes
                    _ => (rng.next() % 16_384) as usize + 1,    // small classes
                };
                let mut buf = pool.alloc(len).unwrap();
                let stamp = (roll & 0xff) as u8;
                buf[0] = stamp;
                buf[len - 1] = stamp;
                if roll.is_multiple_of(5) {
                    next.send(buf).unwrap();
                } else if live.len() < 256 {
                    live.push(buf);
                } else {
                    let slot = (rng.next() % live.len() as u64) as usize;
                    let old = std::mem::replace(&mut live[slot], buf);
                    let n = old.len();
                    assert_eq!(old[0], old[n - 1], "buffer corrupted");
                }
                while let Ok(received) = receiver.try_recv() {
                    let n = received.len();
                    assert_eq!(received[0], received[n - 1], "transferred buffer corrupted");
                }
                operations += 1;
            }
            drop(next);
            drop(live);
            // Drain until every sender (the previous thread's) is gone.
            while receiver.recv().is_ok() {}
            operations
        }));
    }
    drop(senders);
    let operations: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(operations > 10_000, "only {operations} operations");
    pool.flush_thread_cache();
    let stats = pool.stats();
    assert_eq!(stats.in_use_bytes, 0, "{stats:?}");
    assert!(stats.peak_in_use_bytes > 0);
    pool.trim();
    assert_eq!(pool.stats().registered_bytes, 0, "{:?}", pool.stats());
    assert_eq!(hook.registrations(), hook.deregistrations());
    eprintln!("{operations} operations; {:?}", pool.stats());
}
