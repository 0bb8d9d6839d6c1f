//! Primaries decided through etcd, in-process: the preferred server leads
//! a fresh shard, a replica takes over when the primary dies (losing no
//! acknowledged Push with `ack = "replicas"`), the old primary comes back
//! as a replica of the new one, and a graceful stop hands over at once.
//! (The drills in `deploy/tests/drills.rs` do the same to real processes.)
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    missing_docs
)]

use std::time::{Duration, Instant};

use tessera_proto::v1::{DigestRequest, HealthResponse, PushRequest, ShardRole};
use tessera_ps_server::PsServerConfig;
use tessera_test_support::wait::eventually;
use tessera_test_support::{
    Etcd, InProcess, etcd_coordination, free_addr, pair_config, pair_push, wait_for_health,
    wait_replicas_in_step, wait_serving,
};

fn config(listen: &str, group: u32, peer: &str, etcd: &Etcd, cluster: &str) -> PsServerConfig {
    PsServerConfig {
        coordinator: etcd_coordination(etcd, cluster, 2000),
        ..pair_config(listen, group, peer)
    }
}

fn push_request(step: u64) -> PushRequest {
    pair_push(step, 32, 9)
}

fn role(health: &HealthResponse) -> ShardRole {
    ShardRole::try_from(health.shard_health[0].role).unwrap_or(ShardRole::Unspecified)
}

async fn wait_role(addr: &str, want: ShardRole, timeout: Duration) -> HealthResponse {
    wait_for_health(addr, &format!("{want:?}"), timeout, |h| {
        !h.shard_health.is_empty() && role(h) == want
    })
    .await
}

async fn converged(a: &InProcess, b: &InProcess) {
    eventually(
        Duration::from_secs(20),
        "the two servers' digests agree",
        || async {
            let (x, y) = (
                a.admin.digest(DigestRequest {}).await.unwrap(),
                b.admin.digest(DigestRequest {}).await.unwrap(),
            );
            if x == y { Ok(()) } else { Err((x, y)) }
        },
    )
    .await;
}

/// Two servers of shard 0 in `cluster`: `first` (group 0, the preferred
/// primary) at `a` leading it, `second` (group 1) at `b` serving.
struct Pair {
    a: String,
    b: String,
    first: InProcess,
    second: InProcess,
    // Last: dropped after the servers.
    etcd: Etcd,
}

async fn led_pair(cluster: &str) -> Pair {
    let etcd = Etcd::start();
    let (a, b) = (free_addr(), free_addr());
    let first = InProcess::start(&config(&a, 0, &b, &etcd, cluster)).await;
    let second = InProcess::start(&config(&b, 1, &a, &etcd, cluster)).await;
    wait_role(&a, ShardRole::Primary, Duration::from_secs(20)).await;
    wait_serving(&b).await;
    Pair {
        a,
        b,
        first,
        second,
        etcd,
    }
}

/// A coordinator client of `cluster` on `etcd`.
async fn coordinator(etcd: &Etcd, cluster: &str) -> tessera_coord::EtcdCoordinator {
    tessera_coord::EtcdCoordinator::connect(&etcd_coordination(etcd, cluster, 2000))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_takes_over_a_dead_primary_and_the_old_one_rejoins_as_replica() {
    let etcd = Etcd::start();
    let (a, b) = (free_addr(), free_addr());
    let a_config = config(&a, 0, &b, &etcd, "takeover");
    let first = InProcess::start(&a_config).await;
    let second = InProcess::start(&config(&b, 1, &a, &etcd, "takeover")).await;
    // Group 0 is the shard's preferred server: it leads a fresh shard.
    let led = wait_role(&a, ShardRole::Primary, Duration::from_secs(20)).await;
    let old_epoch = led.shard_health[0].epoch;
    wait_serving(&b).await;
    wait_replicas_in_step(&a).await;
    for step in 1..=20 {
        let answer = first.data.push(push_request(step)).await.unwrap();
        assert_eq!(answer.epoch, old_epoch);
    }
    // ack = "replicas": every acknowledged Push is on the replica already.
    assert_eq!(second.store.version(0).unwrap().position, 20);

    let killed = Instant::now();
    first.crash();
    let took_over = wait_role(&b, ShardRole::Primary, Duration::from_secs(20)).await;
    let failover = killed.elapsed();
    let new_epoch = took_over.shard_health[0].epoch;
    eprintln!(
        "failover took {failover:?} (failover_timeout_ms 2000: a 1 s lease); epoch {old_epoch} -> {new_epoch}"
    );
    assert!(new_epoch > old_epoch);
    assert!(failover < Duration::from_secs(6), "{failover:?}");
    assert_eq!(
        second.store.version(0).unwrap().position,
        20,
        "nothing lost"
    );
    // A retry of an acknowledged Push is recognised at the new primary.
    assert!(second.data.push(push_request(20)).await.unwrap().duplicate);
    for step in 21..=30 {
        let answer = second.data.push(push_request(step)).await.unwrap();
        assert_eq!(answer.epoch, new_epoch);
    }

    // The old primary comes back (empty, no checkpoint): a replica of the
    // new one, never a second primary.
    let first = InProcess::start(&a_config).await;
    let back = wait_role(&a, ShardRole::Replica, Duration::from_secs(20)).await;
    assert_eq!(back.shard_health[0].primary, b);
    wait_serving(&a).await;
    converged(&first, &second).await;
    first.stop().await;
    second.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_hands_the_shard_over_without_waiting_for_the_lease() {
    let Pair {
        a,
        b,
        first,
        second,
        etcd: _etcd,
    } = led_pair("handover").await;
    wait_replicas_in_step(&a).await;
    for step in 1..=10 {
        first.data.push(push_request(step)).await.unwrap();
    }
    let stopping = Instant::now();
    first.stop().await;
    wait_role(&b, ShardRole::Primary, Duration::from_secs(20)).await;
    let took = stopping.elapsed();
    eprintln!("handover took {took:?}");
    assert!(
        took < Duration::from_millis(1500),
        "waited for the lease: {took:?}"
    );
    assert_eq!(second.store.version(0).unwrap().position, 10);
    second.stop().await;
}

/// A graceful stop gives up the shard's primary key and the server's
/// member record in one etcd revision (it revokes its lease). When it
/// resigned the key first and revoked the lease after, a replica could win
/// the shard in between, read the member list with the stopping server
/// still on it, and wait out its whole failover timeout in recovery for
/// that server's answer (a handover of 2.2 s instead of about 1 s, seen on
/// a loaded machine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_gives_up_the_key_and_the_membership_at_once() {
    use etcd_client::{EventType, GetOptions, WatchOptions};
    use tessera_coord::keys::Keys;
    let Pair {
        a,
        b,
        first,
        second,
        etcd,
    } = led_pair("giveup").await;
    let mut client = etcd_client::Client::connect([etcd.endpoint.as_str()], None)
        .await
        .unwrap();
    let before = client
        .get("/giveup/", Some(GetOptions::new().with_prefix()))
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    first.stop().await;
    let keys = Keys::new("giveup");
    let (primary, member) = (keys.primary(0), keys.member(&a));
    let mut events = client
        .watch(
            "/giveup/",
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(before + 1),
            ),
        )
        .await
        .unwrap();
    let (mut primary_gone, mut member_gone) = (None, None);
    while primary_gone.is_none() || member_gone.is_none() {
        let answer = tokio::time::timeout(Duration::from_secs(10), events.message())
            .await
            .expect("the stopped server's keys were not deleted")
            .unwrap()
            .expect("the watch ended");
        for event in answer.events() {
            let Some(kv) = event.kv() else { continue };
            if event.event_type() != EventType::Delete {
                continue;
            }
            let key = kv.key_str().unwrap();
            if key == primary && primary_gone.is_none() {
                primary_gone = Some(kv.mod_revision());
            } else if key == member && member_gone.is_none() {
                member_gone = Some(kv.mod_revision());
            }
        }
    }
    assert_eq!(
        primary_gone, member_gone,
        "the primary key and the member record went in different revisions"
    );
    wait_role(&b, ShardRole::Primary, Duration::from_secs(20)).await;
    second.stop().await;
}

/// A campaign whose transaction committed but whose answer was lost is
/// won when tried again on the same lease (before, the key sat on this
/// server's live lease and nobody led the shard); another lease loses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_campaign_tried_again_on_the_same_lease_is_won() {
    let etcd = Etcd::start();
    let coord = coordinator(&etcd, "campaign").await;
    let (mine, _) = coord.grant_lease(5).await.unwrap();
    let (theirs, _) = coord.grant_lease(5).await.unwrap();
    let won = coord.campaign(3, "a:1", 0, mine, 0).await.unwrap();
    assert_eq!(won, Some(1));
    assert_eq!(coord.campaign(3, "a:1", 0, mine, 0).await.unwrap(), Some(1));
    assert_eq!(coord.campaign(3, "b:1", 1, theirs, 7).await.unwrap(), None);
    // Resigned, the next campaign issues an epoch above the floor.
    coord.resign(3, mine).await.unwrap();
    assert_eq!(
        coord.campaign(3, "b:1", 1, theirs, 7).await.unwrap(),
        Some(8)
    );
}

/// Revoking a lease that is already gone succeeds (its keys are gone too),
/// so a revocation whose answer was lost can be tried again; the lease's
/// keys went with the first revocation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_a_lease_twice_succeeds() {
    use tessera_coord::MemberRecord;
    let etcd = Etcd::start();
    let coord = coordinator(&etcd, "revoke").await;
    let (lease, _) = coord.grant_lease(5).await.unwrap();
    let member = MemberRecord {
        address: "a:1".into(),
        replica_group: 0,
        shards: vec![0],
    };
    coord.register(&member, lease).await.unwrap();
    assert_eq!(coord.members().await.unwrap().len(), 1);
    coord.revoke_lease(lease).await.unwrap();
    coord.revoke_lease(lease).await.unwrap();
    assert!(coord.members().await.unwrap().is_empty());
    assert!(!coord.lease_alive(lease).await.unwrap());
}

/// A Push of `step` (worker `worker`) to pair-table `keys`, with
/// gradients that vary by step and position.
fn push_of(keys: Vec<u64>, step: u64, worker: u64) -> PushRequest {
    let dim = tessera_test_support::pair::PAIR_DIM as usize;
    let grads: Vec<f32> = (0..keys.len() * dim)
        .map(|i| ((i as u64 * 13 + step * 7) % 17) as f32 - 8.0)
        .collect();
    PushRequest {
        num_shards: 0,
        table: tessera_test_support::pair::PAIR_TABLE.into(),
        shard: 0,
        keys,
        gradients: bytes::Bytes::from(tessera_test_support::wire(&grads)),
        worker_id: worker,
        sequence: step,
    }
}

/// A Push of `step` to pair-table keys drawn from `0..span` (repeats
/// across Pushes, and within one), for admission to sort.
fn drawn_push(step: u64, span: u64) -> PushRequest {
    let keys: Vec<u64> = (0..24)
        .map(|i| tessera_proto::sharding::splitmix64(step * 1000 + i) % span)
        .collect();
    push_of(keys, step, 11)
}

/// A Push of 24 ids moving on by 12 a step: each id is pushed at two
/// consecutive steps and never again.
fn drifting_push(step: u64) -> PushRequest {
    push_of((0..24).map(|i| step * 12 + i).collect(), step, 12)
}

/// Two servers of shard 0 after a failover: `first` (group 0) led and
/// took `steps[0]` Pushes, crashed; `second` took over and took
/// `steps[1]` more; `first` came back as its replica and `steps[2]` more
/// followed; both configured by `configure`. Returns them converged.
async fn across_a_failover(
    cluster: &str,
    configure: impl Fn(PsServerConfig) -> PsServerConfig,
    push: impl Fn(u64) -> PushRequest,
    steps: [u64; 3],
) -> Pair {
    let etcd = Etcd::start();
    let (a, b) = (free_addr(), free_addr());
    let a_config = configure(config(&a, 0, &b, &etcd, cluster));
    let first = InProcess::start(&a_config).await;
    let second = InProcess::start(&configure(config(&b, 1, &a, &etcd, cluster))).await;
    wait_role(&a, ShardRole::Primary, Duration::from_secs(20)).await;
    wait_serving(&b).await;
    wait_replicas_in_step(&a).await;
    let mut step = 0;
    for _ in 0..steps[0] {
        step += 1;
        first.data.push(push(step)).await.unwrap();
    }
    converged(&first, &second).await;
    first.crash();
    wait_role(&b, ShardRole::Primary, Duration::from_secs(20)).await;
    for _ in 0..steps[1] {
        step += 1;
        second.data.push(push(step)).await.unwrap();
    }
    let first = InProcess::start(&a_config).await;
    wait_role(&a, ShardRole::Replica, Duration::from_secs(20)).await;
    wait_serving(&a).await;
    for _ in 0..steps[2] {
        step += 1;
        second.data.push(push(step)).await.unwrap();
    }
    converged(&first, &second).await;
    Pair {
        a,
        b,
        first,
        second,
        etcd,
    }
}

/// Admission across a failover (issue 37): the primary admits ids at
/// their second Push, the replica follows its decisions, the primary dies
/// mid-run, the replica takes over and goes on admitting, the old primary
/// rejoins as a replica: every copy holds exactly the same rows (digests
/// of rows, optimizer state and deduplication windows), and admission
/// left ids seen once without a row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_decisions_survive_a_failover_and_every_copy_holds_the_same_rows() {
    let span = 3000;
    let pair = across_a_failover(
        "admission",
        |mut config| {
            config.tables[0].admission = Some(tessera_ps_server::table::AdmissionConfig::Count {
                min_pushes: 2,
                sketch_width: 1 << 12,
            });
            config
        },
        |step| drawn_push(step, span),
        [40, 40, 20],
    )
    .await;
    let stats = pair
        .second
        .admin
        .stats(tessera_proto::v1::StatsRequest {})
        .await
        .unwrap();
    let shard = &stats.shards[0];
    let distinct: std::collections::HashSet<u64> =
        (1..=100).flat_map(|s| drawn_push(s, span).keys).collect();
    eprintln!(
        "admission across a failover: {} rows of {} distinct ids pushed; {} candidates counted and {} rows admitted on the new primary since its start",
        shard.rows,
        distinct.len(),
        shard.admission_candidates,
        shard.rows_admitted
    );
    assert!(shard.rows > 0 && (shard.rows as usize) < distinct.len());
    assert!(shard.admission_candidates > 0 && shard.admission_bytes == 4 << 12);
    pair.first.stop().await;
    pair.second.stop().await;
}

/// Expiry with admission across a failover (issue 37): ids admitted at
/// their second Push expire once 20 more Pushes of the table came, swept
/// by the primary in the background while Pushes go on; the primary dies
/// mid-run, the replica takes over and goes on sweeping, the old primary
/// rejoins (copying the shard, stamps and all): every copy holds exactly
/// the same rows, and only the ids pushed lately.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_decisions_survive_a_failover_and_every_copy_holds_the_same_rows() {
    let pair = across_a_failover(
        "expiry",
        |mut config| {
            config.tables[0].admission = Some(tessera_ps_server::table::AdmissionConfig::Count {
                min_pushes: 2,
                sketch_width: 1 << 12,
            });
            config.tables[0].expiry =
                Some(tessera_ps_server::table::ExpiryConfig::after_pushes(20));
            config
        },
        drifting_push,
        [60, 60, 40],
    )
    .await;
    let (first, second) = (&pair.first, &pair.second);
    // The sweep goes on after the last Push until nothing is left to
    // expire: wait for it to leave only the ids pushed lately, then
    // compare copies.
    let stats = |server: &InProcess| {
        let admin = server.admin.clone();
        async move {
            admin
                .stats(tessera_proto::v1::StatsRequest {})
                .await
                .unwrap()
                .shards[0]
                .clone()
        }
    };
    eventually(
        Duration::from_secs(30),
        "the sweep leaves only the ids pushed lately",
        || async {
            let now = stats(second).await;
            if now.rows == 21 * 12 {
                Ok(())
            } else {
                Err(now)
            }
        },
    )
    .await;
    converged(first, second).await;
    let (shard, replica) = (stats(second).await, stats(first).await);
    eprintln!(
        "expiry across a failover: {} rows held of {} ids admitted; {} expired on the new primary, {} on the rejoined replica since its start",
        shard.rows,
        160 * 12,
        shard.rows_expired,
        replica.rows_expired
    );
    // Ids are admitted at their second Push and kept while at most 20
    // more Pushes of the table come: the ids pushed last at steps 140 to
    // 160 (12 a step, the last step's second half seen once only), where
    // keeping every admitted id would be 1,920 rows.
    assert_eq!(shard.rows, 21 * 12);
    assert_eq!(replica.rows, shard.rows);
    assert!(shard.rows_expired > 0);
    pair.first.stop().await;
    pair.second.stop().await;
}

/// The cluster's shard map in etcd: the first server writes it; a server
/// configured with another shard count does not start (it would look for
/// its keys on the wrong shards), and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_with_another_shard_count_than_the_clusters_map_does_not_start() {
    let etcd = Etcd::start();
    let (a, b) = (free_addr(), free_addr());
    let first = InProcess::start(&config(&a, 0, &b, &etcd, "shard-map")).await;
    let map = coordinator(&etcd, "shard-map")
        .await
        .shard_map()
        .await
        .unwrap()
        .expect("the first server wrote the map")
        .0;
    assert_eq!(map.num_shards, 1);
    let wrong = PsServerConfig {
        num_shards: 2,
        ..config(&b, 1, &a, &etcd, "shard-map")
    };
    let Err(refused) = InProcess::try_start(&wrong).await else {
        panic!("a server with another shard count started");
    };
    let refused = refused.to_string();
    assert!(
        refused.contains("shard map") && refused.contains("num_shards = 2"),
        "{refused}"
    );
    first.stop().await;
}

/// A server follows the cluster's shard map through etcd's watch and
/// reports it in Health: the count keys are routed by, a resize planned
/// (by an operator's tool, not the server) and then cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_reports_the_shard_map_as_it_changes() {
    use tessera_proto::v1::ResizeState;
    let etcd = Etcd::start();
    let (a, b) = (free_addr(), free_addr());
    let server = InProcess::start(&config(&a, 0, &b, &etcd, "map-watch")).await;
    let map_of = |addr: String| async move {
        tessera_test_support::health(&addr)
            .await
            .ok()
            .and_then(|h| h.shard_map)
    };
    let wait_for = |want: u64| {
        let addr = a.clone();
        async move {
            eventually(
                Duration::from_secs(20),
                &format!("the server reports version {want} of the shard map"),
                || async {
                    match map_of(addr.clone()).await {
                        Some(map) if map.version >= want => Ok(map),
                        other => Err(other),
                    }
                },
            )
            .await
        }
    };
    let first = wait_for(1).await;
    assert_eq!((first.version, first.num_shards), (1, 1));
    assert_eq!(first.resize_state, ResizeState::None as i32);

    let coord = coordinator(&etcd, "map-watch").await;
    coord.update_shard_map(|m| m.plan(3)).await.unwrap();
    let planned = wait_for(2).await;
    assert_eq!(
        planned.num_shards, 1,
        "routing changes only at the cut-over"
    );
    assert_eq!(
        (
            planned.resize_state,
            planned.resize_from,
            planned.resize_to,
            planned.resize_id
        ),
        (ResizeState::Planned as i32, 1, 3, 2)
    );
    coord.update_shard_map(|m| m.cancel()).await.unwrap();
    let cancelled = wait_for(3).await;
    assert_eq!(cancelled.resize_state, ResizeState::Cancelled as i32);
    server.stop().await;
}
