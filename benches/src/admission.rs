//! Feature admission (issue 37): a table's rows and memory over a long id
//! stream shaped like a recommendation model's, with and without
//! admission, beside a row limit, and what each costs in Fetches that find
//! a trained row.
//!
//! **The stream.** Pushes of `keys_per_push` ids (distinct within a Push,
//! as a worker sends them) drawn from a Zipf distribution of exponent
//! `zipf_s` over `ranks` ranks: a few ids carry most Pushes, and a long
//! tail is seen once or twice. The distribution *drifts*: rank `r` at
//! Push `t` is id `hash(r + drift * t)`, so the popular set moves by
//! `drift` ranks per Push, and ids that were popular go cold for good.
//!
//! **Configurations**, each run on the same stream from an empty store
//! (one shard, SGD, dim 8, in this process): every id gets a row
//! (`unlimited`), a row limit with LRU eviction (`max_rows` the
//! unlimited table's rows at the end divided by 3), admission at the
//! 2nd and 3rd Push (count kind, the default sketch).
//!
//! **Figures.** Rows and memory at ten points of the run and at its end,
//! memory being the store's own count (records, key index, free records,
//! bookkeeping) plus the admission sketch; their ratios to the unlimited
//! table's; and a quality proxy, the *hit share*: of Fetches drawn from
//! the stream's distribution at that moment, the share that find a row
//! (a trained one: a row exists only once an id was pushed). The unlimited
//! table's hit share is the most any configuration can have.
//!
//! Not yet measured here: expiry (issue 37 builds it next), which is what
//! keeps memory flat as the popular set moves.

use std::time::Instant;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tessera_proto::sharding::splitmix64;
use tessera_ps_server::config::{OptimizerConfig, PsServerConfig, TableConfig};
use tessera_ps_server::table::AdmissionConfig;
use tessera_ps_server::{PushId, Store};

use crate::transport::BoxError;

/// The stream and the run's size.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Pushes.
    pub pushes: u64,
    /// Ids per Push (before removing repeats).
    pub keys_per_push: usize,
    /// Ranks of the Zipf distribution.
    pub ranks: usize,
    /// Its exponent.
    pub zipf_s: f64,
    /// Ranks the popular set moves per Push.
    pub drift: f64,
    /// Fetch keys drawn at each measuring point for the hit share.
    pub probe_keys: usize,
}

impl Plan {
    /// The default run, or a short one.
    pub fn new(quick: bool) -> Self {
        match quick {
            false => Self {
                pushes: 4000,
                keys_per_push: 1000,
                ranks: 2_000_000,
                zipf_s: 1.05,
                drift: 20.0,
                probe_keys: 20_000,
            },
            true => Self {
                pushes: 200,
                keys_per_push: 500,
                ranks: 100_000,
                zipf_s: 1.05,
                drift: 20.0,
                probe_keys: 2_000,
            },
        }
    }
}

/// Zipf ranks by inverse CDF (a table of the cumulative weights).
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(ranks: usize, s: f64) -> Self {
        let mut cdf = Vec::with_capacity(ranks);
        let mut total = 0.0;
        for r in 1..=ranks {
            total += (r as f64).powf(-s);
            cdf.push(total);
        }
        for c in &mut cdf {
            *c /= total;
        }
        Self { cdf }
    }

    /// A rank, 0-based.
    fn draw(&self, rng: &mut SmallRng) -> usize {
        let u: f64 = rng.random();
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

/// The id at `rank` at Push `t`.
fn id(rank: usize, t: u64, drift: f64) -> u64 {
    splitmix64(rank as u64 + (t as f64 * drift) as u64)
}

/// One configuration.
struct Case {
    name: &'static str,
    max_rows: Option<u64>,
    admission: Option<AdmissionConfig>,
}

/// What one configuration measured.
struct Measured {
    rows: Vec<u64>,
    bytes: Vec<u64>,
    hits: Vec<f64>,
    dropped: u64,
    secs: f64,
}

fn run_case(plan: &Plan, zipf: &Zipf, case: &Case) -> Result<Measured, BoxError> {
    let table = TableConfig {
        optimizer: OptimizerConfig::sgd(0.01),
        max_rows: case.max_rows,
        admission: case.admission,
        ..TableConfig::new("t", 8)
    };
    let config = PsServerConfig {
        num_shards: 1,
        shards: vec![0],
        tables: vec![table],
        ..PsServerConfig::default()
    };
    let store = Store::new(&config);
    // The same stream for every configuration.
    let mut rng = SmallRng::seed_from_u64(37);
    let mut probe_rng = SmallRng::seed_from_u64(73);
    let every = (plan.pushes / 10).max(1);
    let (mut rows, mut bytes, mut hits) = (Vec::new(), Vec::new(), Vec::new());
    let mut dropped = 0u64;
    let grads: Vec<u8> = std::iter::repeat_n(0.01f32.to_le_bytes(), plan.keys_per_push * 8)
        .flatten()
        .collect();
    let started = Instant::now();
    let mut keys: Vec<u64> = Vec::with_capacity(plan.keys_per_push);
    for t in 0..plan.pushes {
        keys.clear();
        for _ in 0..plan.keys_per_push {
            let key = id(zipf.draw(&mut rng), t, plan.drift);
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
        let outcome = store.push(
            "t",
            0,
            &keys,
            &grads[..keys.len() * 8 * 4],
            PushId {
                worker: 1,
                sequence: t + 1,
            },
        )?;
        dropped += outcome.not_admitted.len() as u64;
        if (t + 1) % every == 0 {
            let table = store.table("t").ok_or("no table")?;
            let b = table.bytes();
            let sketch: u64 = table.shards().map(|(_, s)| s.admission_counts().2).sum();
            rows.push(b.rows);
            bytes.push(
                b.row_bytes
                    + b.index_bytes
                    + b.free_bytes
                    + b.overhead_bytes
                    + b.cut_bytes
                    + sketch,
            );
            let state = table.shard(0).ok_or("no shard")?;
            let found = (0..plan.probe_keys)
                .filter(|_| {
                    state
                        .rows
                        .contains(id(zipf.draw(&mut probe_rng), t, plan.drift))
                })
                .count();
            hits.push(found as f64 / plan.probe_keys as f64);
        }
    }
    Ok(Measured {
        rows,
        bytes,
        hits,
        dropped,
        secs: started.elapsed().as_secs_f64(),
    })
}

/// Runs every configuration; rows of the report and its table.
pub fn run(plan: &Plan) -> Result<(Vec<Value>, String), BoxError> {
    let zipf = Zipf::new(plan.ranks, plan.zipf_s);
    let unlimited = run_case(
        plan,
        &zipf,
        &Case {
            name: "unlimited",
            max_rows: None,
            admission: None,
        },
    )?;
    let final_rows = *unlimited.rows.last().unwrap_or(&0);
    let count = |n| {
        Some(AdmissionConfig::Count {
            min_pushes: n,
            sketch_width: 1 << 20,
        })
    };
    let cases = [
        Case {
            name: "max_rows = unlimited / 3 (lru)",
            max_rows: Some((final_rows / 3).max(1)),
            admission: None,
        },
        Case {
            name: "admission N=2",
            max_rows: None,
            admission: count(2),
        },
        Case {
            name: "admission N=3",
            max_rows: None,
            admission: count(3),
        },
    ];
    let mut measured = vec![("unlimited", unlimited)];
    for case in &cases {
        measured.push((case.name, run_case(plan, &zipf, case)?));
    }
    let base_rows = final_rows.max(1) as f64;
    let base_bytes = *measured[0].1.bytes.last().unwrap_or(&1) as f64;
    let rows: Vec<Value> = measured
        .iter()
        .map(|(name, m)| {
            let last = |v: &[u64]| *v.last().unwrap_or(&0);
            let mean_hits = m.hits.iter().sum::<f64>() / m.hits.len().max(1) as f64;
            json!({
                "bench": "admission",
                "test": "admission",
                "config": name,
                "rows": last(&m.rows),
                "mbytes": last(&m.bytes) as f64 / 1e6,
                "rows_vs_unlimited": last(&m.rows) as f64 / base_rows,
                "bytes_vs_unlimited": last(&m.bytes) as f64 / base_bytes,
                "rows_over_time": m.rows.iter().map(|r| format!("{:.0}k", *r as f64 / 1e3)).collect::<Vec<_>>().join(" "),
                "hit_share_end": m.hits.last().copied().unwrap_or(0.0),
                "hit_share_mean": mean_hits,
                "pushes_dropped": m.dropped,
                "secs": m.secs,
            })
        })
        .collect();
    let about = format!(
        "admission: {} Pushes of {} Zipf ids (s = {}, {} ranks, the popular set moving {} ranks per Push), one shard, SGD dim 8, in one process; memory = the store's own count plus the admission sketch; hit share = of {} Fetch ids drawn at that moment, those with a row",
        plan.pushes, plan.keys_per_push, plan.zipf_s, plan.ranks, plan.drift, plan.probe_keys
    );
    let table = crate::engine::markdown(
        &about,
        &rows,
        &[
            "config",
            "rows",
            "mbytes",
            "rows_vs_unlimited",
            "bytes_vs_unlimited",
            "hit_share_end",
            "hit_share_mean",
            "pushes_dropped",
            "rows_over_time",
        ],
    );
    Ok((rows, table))
}
