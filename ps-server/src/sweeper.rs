//! The expiry sweep's driver (`table/expiry.rs`): on each shard this
//! server is primary of, steps of at most [`SWEEP_STEP_SLOTS`] record
//! slots per table with expiry, paced to the table's
//! `sweep_rows_per_sec`, each under the shard's write lock with its own
//! stream position (so replicas remove the same rows at the same point
//! of the stream), the lock released between steps.
//!
//! Expired rows are counted (`tessera_ps_expired_rows_total`, and per
//! shard in `tessera admin stats`) and logged as a rate, once a minute
//! per table at most.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::replication::Replication;
use tessera_store::store::Store;
use tessera_store::table::expiry::{SWEEP_STEP_SLOTS, unix_secs};

/// How often the sweeper wakes: its steps are spread over the second.
const TICK: Duration = Duration::from_millis(50);

/// How often a table's expired rows are logged at most.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// What one step did.
enum Step {
    /// Removed this many rows; whether it finished a pass.
    Removed(u64, bool),
    /// This server is not the shard's primary now.
    NotPrimary,
    /// The table is not hosted here.
    NoTable,
}

/// One step of `table`'s sweep on the shard `writing` locks, at most
/// `slots` record slots; an expiry that removed rows takes the next
/// stream position and goes to the replicas.
fn step(
    store: &Store,
    replication: &Replication,
    writing: &mut tessera_store::store::ShardGuard<'_>,
    table: &str,
    slots: usize,
) -> Step {
    let Some(epoch) = replication.leading_epoch(writing.shard(), Instant::now()) else {
        store.advance_clock(writing, table, unix_secs());
        return Step::NotPrimary;
    };
    // A shard receiving keys in a resize holds the giving shards' rows as
    // they sweep them (their removals come in their deltas); its own
    // stream starts at the cut-over (`crate::reshard`).
    if store.taking_rows(writing.shard()) {
        return Step::NotPrimary;
    }
    let Some(expired) = store.expire_step(writing, table, unix_secs(), slots) else {
        return Step::NoTable;
    };
    if !expired.keys.is_empty() {
        let version = writing.version().next(epoch);
        writing.set_version(version);
        replication.record_expiry(writing.shard(), version, &expired);
    }
    Step::Removed(expired.keys.len() as u64, expired.pass_done)
}

/// Runs the sweeps until dropped; returns at once without a table with
/// expiry, or in inference or serving mode (rows there are only read,
/// or removed by the training fleet's stream).
pub(crate) async fn run(store: Arc<Store>, replication: Arc<Replication>) {
    let tables = store.expiring_tables();
    if tables.is_empty() || store.mode().read_only() {
        return;
    }
    let mut ticks = tokio::time::interval(TICK);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Slots each (table, shard) may visit, carried between ticks.
    let mut credit: HashMap<(usize, u32), f64> = HashMap::new();
    // Per table: rows removed since the last log line, and its time.
    let mut logged: Vec<(u64, Instant)> = vec![(0, Instant::now()); tables.len()];
    let mut last = Instant::now();
    loop {
        ticks.tick().await;
        let now = Instant::now();
        let elapsed = now.duration_since(last).as_secs_f64();
        last = now;
        for (t, (table, rate)) in tables.iter().enumerate() {
            for &shard in store.hosted() {
                let left = credit.entry((t, shard)).or_default();
                // At most a second's worth carried (a stalled runtime does
                // not make the next tick sweep for long).
                *left = (*left + *rate as f64 * elapsed).min(*rate as f64);
                while *left >= 1.0 {
                    let slots = (*left as usize).min(SWEEP_STEP_SLOTS);
                    *left -= slots as f64;
                    let swept = {
                        let Some(mut writing) = store.lock_shard_async(shard).await else {
                            break;
                        };
                        step(&store, &replication, &mut writing, table, slots)
                    };
                    match swept {
                        Step::Removed(rows, pass_done) => {
                            logged[t].0 += rows;
                            if pass_done {
                                // At most a pass a tick: a small table is
                                // not walked over and over for its credit.
                                *left = 0.0;
                                break;
                            }
                        }
                        Step::NotPrimary => {
                            // Not this server's to sweep (a replica follows).
                            *left = 0.0;
                            break;
                        }
                        Step::NoTable => break,
                    }
                    tokio::task::yield_now().await;
                }
            }
            let (rows, since) = &mut logged[t];
            if *rows > 0 && since.elapsed() >= LOG_EVERY {
                let secs = since.elapsed().as_secs_f64();
                tracing::info!(table = %table, rows = *rows, per_sec = (*rows as f64 / secs).round(), "rows expired");
                *rows = 0;
                *since = Instant::now();
            }
        }
    }
}
