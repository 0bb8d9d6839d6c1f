//! Shrinking a cluster's shard count (issue 39), in-process with etcd:
//! 3 shards (shard 0 on two servers, two replica groups; shards 1 and 2
//! on one each) shrink to 2, under Pushes.
//!
//! Planned with the cut-over held, the remaining shards copy and follow
//! shard 2's rows while they serve their own keys (Pushes and Fetches
//! go on); the keys they receive are refused there (`UNAVAILABLE`), and
//! so are Pushes split by the new count. A cancel drops the rows they
//! took. Planned again and released: shard 2 is fenced whole at the
//! cut-over, the remaining shards open and route by 2 (a Push split by
//! 3 is answered `KeysMoved`, to be split anew), and the resize is done;
//! shard 2 drops its rows. Pushes first sent split by 3 and retried
//! split by 2 across the cut-over are applied once to every key, whether
//! their old shard applied them or refused them after the fence, at the
//! remaining primary and, after it stops, at its replica, which copied
//! it. At the end every key's update count is the number of Pushes
//! acknowledged for it.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    missing_docs
)]

use std::collections::HashMap;
use std::time::Duration;

use tessera_coord::{EtcdCoordinator, ResizeState, ShardMap};
use tessera_proto::sharding::shard_for_key;
use tessera_proto::v1::{FetchRequest, HealthRequest, PushRequest};
use tessera_ps_server::TableConfig;
use tessera_ps_server::config::OptimizerConfig;
use tessera_rpc::{Code, RpcError};
use tessera_test_support::wait::{Waiting, eventually};
use tessera_test_support::{
    Etcd, InProcess, etcd_coordination, keys_moved, resize_pair, resize_server, shard_map_now,
    split_push, wait_serving,
};

const DIM: usize = 4;
const FROM: u32 = 3;
const TO: u32 = 2;

/// A Push of `step` to `keys` of `shard`, split by `split_by`.
fn push(step: u64, shard: u32, keys: &[u64], split_by: u32) -> PushRequest {
    split_push(DIM, step, shard, keys, split_by)
}

fn table() -> TableConfig {
    TableConfig {
        optimizer: OptimizerConfig::adam(0.01),
        ..TableConfig::new("emb", DIM as u32)
    }
}

fn code(result: Result<impl std::fmt::Debug, RpcError>) -> Code {
    match result {
        Err(RpcError::Status(status)) => status.code(),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// The `KeysMoved` count of a refusal.
fn moved_to(result: Result<impl std::fmt::Debug, RpcError>) -> u32 {
    match result {
        Err(err) => {
            keys_moved(&err)
                .unwrap_or_else(|| panic!("expected KeysMoved, got {err:?}"))
                .num_shards
        }
        Ok(answer) => panic!("expected KeysMoved, got {answer:?}"),
    }
}

async fn fetch(server: &InProcess, shard: u32, keys: &[u64]) -> Result<(), RpcError> {
    server
        .data
        .fetch(FetchRequest {
            table: "emb".into(),
            shard,
            keys: keys.to_vec(),
        })
        .await
        .map(|_| ())
}

async fn map(coord: &EtcdCoordinator) -> ShardMap {
    shard_map_now(coord).await
}

async fn rows_held(server: &InProcess) -> u64 {
    let health = server.data.health(HealthRequest {}).await.unwrap();
    health.tables.iter().map(|t| t.rows).sum()
}

struct Cluster {
    /// Servers by shard of the old count.
    servers: Vec<Vec<InProcess>>,
    coord: EtcdCoordinator,
    /// Every key's acknowledged Pushes.
    counts: HashMap<u64, u32>,
    step: u64,
}

impl Cluster {
    fn primary(&self, shard: u32) -> &InProcess {
        self.servers[shard as usize]
            .iter()
            .find(|s| s.replication.is_primary(shard))
            .unwrap_or_else(|| panic!("shard {shard} has no primary"))
    }

    /// The keys `num_shards` routes to `shard`.
    fn keys(shard: u32, num_shards: u32) -> Vec<u64> {
        (0..900)
            .filter(|&k| shard_for_key(k, num_shards) == shard)
            .collect()
    }

    /// Sends `request` to `shard`'s primary; counts its keys once taken.
    async fn send(&mut self, request: PushRequest) -> Result<(), RpcError> {
        let keys = request.keys.clone();
        let answer = self.primary(request.shard).data.push(request).await?;
        if !answer.duplicate {
            for key in keys {
                *self.counts.entry(key).or_default() += 1;
            }
        }
        Ok(())
    }

    /// One Push of every key, split by the old count.
    async fn push_all(&mut self) {
        self.step += 1;
        for shard in 0..FROM {
            self.send(push(self.step, shard, &Self::keys(shard, FROM), FROM))
                .await
                .unwrap();
        }
    }

    /// Pushes until the resize planned at `id` has both remaining shards
    /// ready.
    async fn push_until_ready(&mut self, id: u64) {
        let mut waiting = Waiting::new(
            Duration::from_secs(30),
            "both remaining shards are reported ready",
        );
        loop {
            self.push_all().await;
            let m = map(&self.coord).await;
            let r = m.resize.clone().unwrap();
            if r.id == id && r.state == ResizeState::Copying && r.ready == [0, 1] {
                return;
            }
            waiting.tick(&m).await;
        }
    }

    async fn wait_for(&self, what: &str, done: impl Fn(&ShardMap) -> bool) {
        eventually(
            Duration::from_secs(30),
            &format!("shard map: {what}"),
            || async {
                let m = map(&self.coord).await;
                if done(&m) { Ok(()) } else { Err(m) }
            },
        )
        .await;
    }

    /// Every key's update count at the primary of its shard of `num_shards`
    /// is its acknowledged Pushes.
    fn audit(&self, num_shards: u32) {
        for shard in 0..num_shards {
            let keys = Self::keys(shard, num_shards);
            let rows = self
                .primary(shard)
                .store
                .read_rows("emb", shard, &keys, true)
                .unwrap();
            assert_eq!(rows.keys, keys, "shard {shard} lacks rows");
            for (key, steps) in rows.keys.iter().zip(&rows.steps) {
                assert_eq!(
                    *steps, self.counts[key],
                    "key {key} (shard {shard} of {num_shards})"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shrink_serves_the_remaining_shards_throughout_and_applies_each_push_once() {
    let etcd = Etcd::start();
    let cluster = "shrink";
    let mut servers = Vec::new();
    let mut pair = Vec::new();
    for config in resize_pair(&etcd, cluster, FROM, 0, &table()) {
        pair.push(InProcess::start(&config).await);
    }
    servers.push(pair);
    for shard in 1..FROM {
        servers.push(vec![
            InProcess::start(&resize_server(&etcd, cluster, FROM, shard, &table())).await,
        ]);
    }
    for s in servers.iter().flatten() {
        wait_serving(&s.addr).await;
    }
    let coord = EtcdCoordinator::connect(&etcd_coordination(&etcd, cluster, 2000))
        .await
        .unwrap();
    let mut c = Cluster {
        servers,
        coord,
        counts: HashMap::new(),
        step: 0,
    };
    // Shard 2's keys that come to shard 0.
    let incoming: Vec<u64> = Cluster::keys(2, FROM)
        .into_iter()
        .filter(|&k| shard_for_key(k, TO) == 0)
        .collect();
    let own0 = Cluster::keys(0, FROM);
    assert!(!incoming.is_empty());
    for _ in 0..3 {
        c.push_all().await;
    }

    // Held: the remaining shards copy and follow shard 2, serving their
    // own keys meanwhile, not the incoming ones.
    let planned = c.coord.update_shard_map(|m| m.plan_held(TO)).await.unwrap();
    c.push_until_ready(planned.version).await;
    let p0 = c.primary(0);
    fetch(p0, 0, &own0).await.unwrap();
    assert_eq!(code(fetch(p0, 0, &incoming[..1]).await), Code::Unavailable);
    assert_eq!(
        code(p0.data.push(push(9_000, 0, &own0, TO)).await),
        Code::Unavailable,
        "a Push split by the new count before the opening"
    );
    assert!(
        rows_held(p0).await > own0.len() as u64,
        "shard 0 holds no copied rows"
    );

    // Cancelled: the copied rows go, the shards serve as before.
    c.coord.update_shard_map(ShardMap::cancel).await.unwrap();
    eventually(
        Duration::from_secs(20),
        "a cancelled shrink's copied rows go",
        || async {
            match rows_held(c.primary(0)).await {
                held if held == own0.len() as u64 => Ok(()),
                held => Err(format!("shard 0 holds {held} rows, {} its own", own0.len())),
            }
        },
    )
    .await;
    c.push_all().await;
    c.audit(FROM);

    // Planned again, held until two Pushes are half-way: `y` applied at
    // every shard, `z` at the remaining ones only (its part to shard 2
    // still on its way).
    let planned = c.coord.update_shard_map(|m| m.plan_held(TO)).await.unwrap();
    c.push_until_ready(planned.version).await;
    c.push_all().await;
    let y = c.step;
    c.step += 1;
    let z = c.step;
    for shard in 0..TO {
        c.send(push(z, shard, &Cluster::keys(shard, FROM), FROM))
            .await
            .unwrap();
    }
    c.coord.update_shard_map(ShardMap::release).await.unwrap();
    c.wait_for("cut over", |m| m.num_shards == TO).await;
    eventually(Duration::from_secs(20), "shard 2 is fenced", || async {
        if c.primary(2).store.moved(2).is_some() {
            Ok(())
        } else {
            Err("not fenced")
        }
    })
    .await;
    // `z` reaches shard 2 after the fence: refused, to be split anew.
    assert_eq!(
        moved_to(
            c.primary(2)
                .data
                .push(push(z, 2, &Cluster::keys(2, FROM), FROM))
                .await
        ),
        TO
    );
    c.wait_for("done", |m| {
        m.resize
            .as_ref()
            .is_some_and(|r| r.state == ResizeState::Done)
    })
    .await;
    // The remaining shards route by 2: a Push split by 3 is split anew.
    assert_eq!(
        moved_to(c.primary(0).data.push(push(9_001, 0, &own0, FROM)).await),
        TO
    );
    // `y` and `z` go again, split by 2: `y` was applied to every key
    // (nothing more), `z` to all but shard 2's (those now).
    for shard in 0..TO {
        let keys = Cluster::keys(shard, TO);
        let from_2: Vec<u64> = keys
            .iter()
            .copied()
            .filter(|&k| shard_for_key(k, FROM) == 2)
            .collect();
        let p = c.primary(shard);
        let again_y = p.data.push(push(y, shard, &keys, TO)).await.unwrap();
        assert_eq!(again_y.applied, 0, "shard {shard}: y applied twice");
        let again_z = p.data.push(push(z, shard, &keys, TO)).await.unwrap();
        assert_eq!(
            again_z.applied as usize,
            from_2.len(),
            "shard {shard}: z applied to other keys than shard 2's"
        );
        for key in from_2 {
            *c.counts.get_mut(&key).unwrap() += 1;
        }
    }
    c.audit(TO);
    // Shard 2 is fenced whole and drops its rows once done.
    eventually(
        Duration::from_secs(20),
        "shard 2 drops its rows",
        || async {
            match rows_held(c.primary(2)).await {
                0 => Ok(()),
                held => Err(format!("{held} rows held")),
            }
        },
    )
    .await;
    assert_eq!(moved_to(fetch(c.primary(2), 2, &incoming[..1]).await), TO);
    // Pushes go on, split by 2.
    for _ in 0..3 {
        c.step += 1;
        for shard in 0..TO {
            c.send(push(c.step, shard, &Cluster::keys(shard, TO), TO))
                .await
                .unwrap();
        }
    }
    c.audit(TO);
    // Shard 0's replica copied its primary (the moved rows included).
    let keys0 = Cluster::keys(0, TO);
    eventually(
        Duration::from_secs(30),
        "shard 0's replica catches up with its primary",
        || async {
            let want = c
                .primary(0)
                .store
                .read_rows("emb", 0, &keys0, true)
                .unwrap();
            let equal = c.servers[0].iter().all(|s| {
                s.store
                    .read_rows("emb", 0, &keys0, true)
                    .is_ok_and(|r| r.values == want.values && r.state == want.state)
            });
            if equal {
                Ok(())
            } else {
                Err("the replica's rows differ from the primary's")
            }
        },
    )
    .await;
    // Its primary stops; the replica leads, and `z` retried once more
    // is a duplicate there.
    let at = c.servers[0]
        .iter()
        .position(|s| s.replication.is_primary(0))
        .unwrap();
    c.servers[0].remove(at).stop().await;
    eventually(
        Duration::from_secs(30),
        "the replica takes over",
        || async {
            if !c.servers[0][0].replication.is_primary(0) {
                return Err("it is not primary".to_owned());
            }
            match fetch(&c.servers[0][0], 0, &keys0).await {
                Ok(()) => Ok(()),
                Err(err) => Err(format!("it refuses a Fetch: {err:?}")),
            }
        },
    )
    .await;
    let answer = c.servers[0][0]
        .data
        .push(push(z, 0, &keys0, TO))
        .await
        .unwrap();
    assert!(answer.duplicate, "applied twice after the failover");
    c.audit(TO);
    for s in c.servers.into_iter().flatten() {
        s.stop().await;
    }
}
