//! Replication in static mode: Pushes go to a shard's primary, which
//! forwards them in order to the replica; the replica converges bit for
//! bit (Adam, which would show any reordering or double application),
//! catches up after a restart, and copies the shard again after the
//! primary cut it off for lagging too far. A restarted primary recovers
//! the replica's newer copy instead of rolling the shard back; with `ack =
//! "replicas"` an acknowledged Push is on the replica already.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use prost::Message as _;
use tessera_proto::v1::{
    DigestRequest, FetchRequest, NotPrimary, PushRequest, StatsRequest, SyncRequest,
};
use tessera_ps_server::config::{AckMode, ReplicationConfig};
use tessera_ps_server::{PsServerConfig, Version};
use tessera_rpc::{Code, RpcError};
use tessera_test_support::wait::eventually;
use tessera_test_support::{
    FaultProxy, InProcess, PsProcess, free_addr, pair_config, pair_push, wait_replicas_in_step,
    wait_serving, wire,
};

fn config(listen: &str, group: u32, peer: &str, advertise: &str, max_lag: usize) -> PsServerConfig {
    PsServerConfig {
        advertise: Some(advertise.to_owned()),
        replication: ReplicationConfig {
            max_lag_pushes: max_lag,
            ..ReplicationConfig::default()
        },
        ..pair_config(listen, group, peer)
    }
}

/// Pushes of a step's gradients (every row changes).
fn push_request(step: u64) -> PushRequest {
    pair_push(step, 64, 5)
}

async fn push(server: &InProcess, step: u64) -> Result<(), RpcError> {
    server.data.push(push_request(step)).await.map(|_| ())
}

async fn rows(server: &InProcess) -> Result<Bytes, RpcError> {
    server
        .data
        .fetch(FetchRequest {
            table: "emb".into(),
            shard: 0,
            keys: (0..64).collect(),
        })
        .await
        .map(|r| r.values)
}

async fn pushes(server: &InProcess) -> u64 {
    let stats = server.admin.stats(StatsRequest {}).await.unwrap();
    stats.shards.iter().map(|s| s.pushes).sum()
}

/// Every (table, shard)'s (version, digest) on `server`.
async fn digests(server: &InProcess) -> Vec<(Option<tessera_proto::v1::ShardVersion>, u64)> {
    let answer = server.admin.digest(DigestRequest {}).await.unwrap();
    answer
        .shards
        .into_iter()
        .map(|d| (d.version, d.digest))
        .collect()
}

/// Waits until the replica holds the primary's version and digest: every
/// Push forwarded and applied, bit for bit (rows, optimizer state and
/// deduplication windows).
async fn converged(primary: &InProcess, replica: &InProcess) {
    eventually(
        Duration::from_secs(20),
        "the replica converges (the primary's versions and digests)",
        || async {
            let (a, b) = (digests(primary).await, digests(replica).await);
            if a == b { Ok(()) } else { Err((a, b)) }
        },
    )
    .await;
    assert_eq!(rows(primary).await.unwrap(), rows(replica).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_to_the_primary_reach_the_replica_in_order_and_a_restarted_replica_catches_up() {
    let (a, b) = (free_addr(), free_addr());
    let primary = InProcess::start(&config(&a, 0, &b, &a, 10_000)).await;
    let replica_config = config(&b, 1, &a, &b, 10_000);
    let replica = InProcess::start(&replica_config).await;
    // The replica must be attached before the Pushes, or it would take
    // them in its first copy instead of replaying them (this test failed
    // 1 in ~20 runs under a loaded suite when it pushed at once).
    wait_serving(&a).await;
    wait_serving(&b).await;

    // Concurrent Pushes (distinct sequences): the primary serialises them
    // per shard, the replica replays its order.
    let steps = (1..=40u64).map(|step| push(&primary, step));
    for result in futures::future::join_all(steps).await {
        result.unwrap();
    }
    converged(&primary, &replica).await;
    // Replayed one by one, not copied.
    assert_eq!(
        pushes(&replica).await,
        40,
        "copies {}, cut-offs at the primary {}",
        replica.replication.syncs(),
        primary.replication.cutoffs()
    );
    assert_eq!(pushes(&primary).await, 40);
    assert_eq!(replica.replication.syncs(), 0, "in step from the start");

    // The replica refuses Pushes and names the primary in the details.
    let err = push(&replica, 1000).await.unwrap_err();
    let RpcError::Status(status) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(status.code(), Code::FailedPrecondition, "{err:?}");
    let hint = NotPrimary::decode(status.details().clone()).unwrap();
    assert_eq!((hint.shard, hint.primary.as_str()), (0, a.as_str()));
    assert!(hint.epoch >= 1);

    // Replica away; the primary goes on; a new replica process (empty
    // store) copies the shard and follows the stream again.
    replica.stop().await;
    for step in 41..=60u64 {
        push(&primary, step).await.unwrap();
    }
    let replica = InProcess::start(&replica_config).await;
    let health = wait_serving(&b).await;
    assert!(health.primary_shards.is_empty());
    for step in 61..=70u64 {
        push(&primary, step).await.unwrap();
    }
    converged(&primary, &replica).await;
    assert_eq!(replica.replication.syncs(), 1, "one copy, then the stream");
    replica.stop().await;
    primary.stop().await;
}

/// The primary reaches the replica through a proxy that stalls: the queue
/// passes `max_lag_pushes`, the primary cuts the replica off with a gap
/// marker, and once the path recovers the replica copies the shard again
/// and converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_cut_off_for_lagging_copies_the_shard_again() {
    let (a, b) = (free_addr(), free_addr());
    let to_replica = FaultProxy::start(b.clone()).await;
    // Acknowledged by the primary alone, so that the queue fills while the
    // path stalls.
    let mut primary_config = config(&a, 0, &to_replica.addr, &a, 5);
    primary_config.replication.ack = AckMode::Primary;
    let primary = InProcess::start(&primary_config).await;
    // The replica is known to the primary by the proxy's address.
    let replica = InProcess::start(&config(&b, 1, &a, &to_replica.addr, 5)).await;
    wait_serving(&a).await;
    wait_serving(&b).await;
    push(&primary, 1).await.unwrap();
    converged(&primary, &replica).await;

    to_replica.delay(Duration::from_millis(400));
    for step in 2..=30u64 {
        push(&primary, step).await.unwrap();
    }
    assert!(
        primary.replication.cutoffs() >= 1,
        "the replica was cut off"
    );
    to_replica.delay(Duration::ZERO);
    to_replica.reset_all();
    converged(&primary, &replica).await;
    assert!(
        replica.replication.syncs() >= 1,
        "copied again after the cut-off"
    );
    replica.stop().await;
    primary.stop().await;
}

/// `ack = "replicas"`: when a Push is acknowledged, the replica has
/// applied it. A replica that dies costs one `replica_timeout_ms`, then
/// Pushes go on without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_ack_replicas_an_acknowledged_push_is_on_the_replica() {
    let (a, b) = (free_addr(), free_addr());
    let mut primary_config = config(&a, 0, &b, &a, 10_000);
    primary_config.replication.ack = AckMode::Replicas;
    primary_config.replication.replica_timeout_ms = 300;
    let primary = InProcess::start(&primary_config).await;
    let replica = InProcess::start(&config(&b, 1, &a, &b, 10_000)).await;
    wait_serving(&a).await;
    wait_serving(&b).await;
    // The replica confirms its attachment with its first answer; from then
    // on every acknowledgement waits for it.
    wait_replicas_in_step(&a).await;
    for step in 1..=30u64 {
        push(&primary, step).await.unwrap();
        assert_eq!(
            replica.store.version(0).unwrap().position,
            step,
            "acknowledged before the replica applied it"
        );
    }
    replica.stop().await;
    let stalled = Instant::now();
    push(&primary, 31).await.unwrap();
    let took = stalled.elapsed();
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(5),
        "the first Push after the replica died waited {took:?}"
    );
    let next = Instant::now();
    push(&primary, 32).await.unwrap();
    assert!(
        next.elapsed() < Duration::from_millis(250),
        "cut off, not waited for again"
    );
    assert!(primary.replication.cutoffs() >= 1);
    primary.stop().await;
}

/// Static mode: the primary is replaced by a new, empty process while the
/// replica holds the trained shard. The new primary recovers the
/// replica's copy (it does not roll the shard back to fresh rows), takes
/// the next epoch, and the replica follows it without copying anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_primary_recovers_the_replicas_copy_instead_of_rolling_back() {
    let (a, b) = (free_addr(), free_addr());
    let primary_config = config(&a, 0, &b, &a, 10_000);
    let primary = InProcess::start(&primary_config).await;
    let replica = InProcess::start(&config(&b, 1, &a, &b, 10_000)).await;
    wait_serving(&a).await;
    wait_serving(&b).await;
    for step in 1..=25u64 {
        push(&primary, step).await.unwrap();
    }
    converged(&primary, &replica).await;
    let trained = rows(&replica).await.unwrap();
    let before = replica.store.version(0).unwrap();
    assert_eq!(before.position, 25);
    primary.stop().await;

    let primary = InProcess::start(&primary_config).await;
    let health = wait_serving(&a).await;
    assert_eq!(rows(&primary).await.unwrap(), trained, "rolled back");
    let shard = &health.shard_health[0];
    assert!(shard.epoch > before.epoch, "a new epoch: {shard:?}");
    assert_eq!(
        tessera_ps_server::wire::version_from_wire(shard.version.unwrap()),
        before
    );
    assert_eq!(primary.replication.syncs(), 1, "recovered by one copy");
    // A Push the old primary applied is still a duplicate: the windows came
    // with the copy.
    let again = primary.data.push(push_request(25)).await.unwrap();
    assert!(again.duplicate);
    wait_replicas_in_step(&a).await;
    for step in 26..=30u64 {
        push(&primary, step).await.unwrap();
    }
    converged(&primary, &replica).await;
    assert_eq!(
        replica.replication.syncs(),
        0,
        "the replica was in step with the recovered copy"
    );
    replica.stop().await;
    primary.stop().await;
}

/// A replica never copies from an older copy: a primary asked to attach a
/// replica whose copy is newer than its own refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_refuses_to_overwrite_a_newer_copy() {
    let (a, b) = (free_addr(), free_addr());
    let primary = InProcess::start(&config(&a, 0, &b, &a, 10_000)).await;
    // Its replica is not running: the primary waits for it (static mode)
    // unless it answers; start it so that recovery ends.
    let replica = InProcess::start(&config(&b, 1, &a, &b, 10_000)).await;
    wait_serving(&a).await;
    push(&primary, 1).await.unwrap();
    let err = primary
        .peer
        .sync(SyncRequest {
            shard: 0,
            replica: b.clone(),
            version: Some(tessera_ps_server::wire::version_to_wire(Version::new(
                99, 1000,
            ))),
            attach: true,
        })
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("is newer than this server's"),
        "{err}"
    );
    replica.stop().await;
    primary.stop().await;
}

/// The replica *process* is SIGKILLed while the primary keeps taking
/// Pushes; a new replica process catches up and converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_replica_process_restarts_and_catches_up() {
    let dir = tempfile::tempdir().unwrap();
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_ps-server"));
    let (a, b) = (free_addr(), free_addr());
    let mut primary_config = config(&a, 0, &b, &a, 10_000);
    primary_config.replication.replica_timeout_ms = 300;
    let _primary = PsProcess::spawn(bin, &primary_config, dir.path(), "primary");
    let mut replica = PsProcess::spawn(bin, &config(&b, 1, &a, &b, 10_000), dir.path(), "replica");
    wait_serving(&a).await;
    wait_serving(&b).await;
    let (primary_data, replica_data) = (client(&a), client(&b));
    for step in 1..=20 {
        primary_data.push(push_request(step)).await.unwrap();
    }
    processes_converge(&a, &b).await;

    replica.kill();
    for step in 21..=50 {
        primary_data.push(push_request(step)).await.unwrap();
    }
    replica.start();
    for step in 51..=60 {
        primary_data.push(push_request(step)).await.unwrap();
    }
    processes_converge(&a, &b).await;
    drop(replica_data);
}

fn client(addr: &str) -> tessera_proto::v1::ParameterServerClient {
    tessera_proto::v1::ParameterServerClient::new(
        tessera_rpc::Channel::lazy(addr, tessera_test_support::health::patient()).unwrap(),
    )
}

async fn processes_converge(a: &str, b: &str) {
    let admin = |addr: &str| {
        tessera_proto::v1::AdminClient::new(
            tessera_rpc::Channel::lazy(addr, tessera_test_support::health::patient()).unwrap(),
        )
    };
    let (a, b) = (admin(a), admin(b));
    eventually(
        Duration::from_secs(30),
        "the replica process converges (digests agree)",
        || async {
            match (
                a.digest(DigestRequest {}).await,
                b.digest(DigestRequest {}).await,
            ) {
                (Ok(x), Ok(y)) if x == y => Ok(()),
                (x, y) => Err((x, y)),
            }
        },
    )
    .await;
}

/// A replica that stops hearing its primary's stream (here: the path
/// between them stalls) says so in Health, and again once it hears it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_not_receiving_its_primarys_stream_says_so() {
    let (a, b) = (free_addr(), free_addr());
    let to_replica = FaultProxy::start(b.clone()).await;
    let fast = |mut c: PsServerConfig| {
        c.replication.heartbeat_ms = 100;
        c.replication.stale_after_ms = 600;
        c
    };
    let primary = InProcess::start(&fast(config(&a, 0, &to_replica.addr, &a, 10_000))).await;
    let replica = InProcess::start(&fast(config(&b, 1, &a, &to_replica.addr, 10_000))).await;
    wait_serving(&b).await;
    let receiving = |h: &tessera_proto::v1::HealthResponse| h.shard_health[0].receiving;
    tessera_test_support::wait_for_health(&b, "receiving", Duration::from_secs(10), receiving)
        .await;
    to_replica.partition(true);
    let silent =
        tessera_test_support::wait_for_health(&b, "not receiving", Duration::from_secs(10), |h| {
            !receiving(h)
        })
        .await;
    assert!(silent.shard_health[0].stream_age_ms >= 600, "{silent:?}");
    assert!(
        silent.shard_health[0].in_step,
        "still in step: nothing was missed yet"
    );
    to_replica.partition(false);
    tessera_test_support::wait_for_health(
        &b,
        "receiving again",
        Duration::from_secs(10),
        receiving,
    )
    .await;
    replica.stop().await;
    primary.stop().await;
}

/// A replica applies what its primary applied, whatever its own
/// deduplication table would have decided: here the replica remembers at
/// most one worker, and still records and applies the second worker's
/// Pushes (before, it refused them as `Full`, skipped their rows and still
/// claimed the primary's version).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_applies_what_the_primary_applied_whatever_its_own_dedup_says() {
    let (a, b) = (free_addr(), free_addr());
    let primary = InProcess::start(&config(&a, 0, &b, &a, 10_000)).await;
    let mut replica_config = config(&b, 1, &a, &b, 10_000);
    replica_config.dedup_max_workers = 1;
    let replica = InProcess::start(&replica_config).await;
    wait_serving(&a).await;
    wait_serving(&b).await;
    for (worker, step) in [(1, 1), (2, 1), (1, 2), (2, 2)] {
        let mut request = push_request(step);
        request.worker_id = worker;
        primary.data.push(request).await.unwrap();
    }
    converged(&primary, &replica).await;
    replica.stop().await;
    primary.stop().await;
}

/// Sends `replica` one batch as if from the primary at `primary`: shard 0's
/// head at `epoch` and `position` under `attachment`, and `pushes`.
async fn replicate_as(
    replica: &InProcess,
    primary: &str,
    (epoch, position, attachment): (u64, u64, u64),
    pushes: Vec<tessera_proto::v1::ReplicatedPush>,
) -> tessera_proto::v1::ReplicateResponse {
    replica
        .peer
        .replicate(tessera_proto::v1::ReplicateRequest {
            primary: primary.to_owned(),
            heads: vec![tessera_proto::v1::StreamHead {
                shard: 0,
                epoch,
                position,
                attachment,
                ..Default::default()
            }],
            pushes,
        })
        .await
        .unwrap()
}

/// A server that won a shard's epoch and is recovering it refuses the old
/// primary's stream and tells it it was deposed (before, it answered "out
/// of sync", and the old primary acknowledged a Push it had only applied
/// itself). A forwarded Push naming another shard than its entry is out of
/// step, not a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovering_server_deposes_the_old_primary_and_odd_entries_are_refused() {
    use tessera_proto::v1::ReplicatedPush;
    let (a, b) = (free_addr(), free_addr());
    let primary = InProcess::start(&config(&a, 0, &b, &a, 10_000)).await;
    let replica = InProcess::start(&config(&b, 1, &a, &b, 10_000)).await;
    wait_serving(&a).await;
    wait_serving(&b).await;
    let old_epoch = replica.replication.known_epoch(0);
    // A mismatched entry: shard 0's stream carrying a Push of shard 1.
    let mut odd = push_request(1);
    odd.shard = 1;
    let entry = ReplicatedPush {
        shard: 0,
        position: 1,
        push: Some(odd),
        gap: false,
        ..ReplicatedPush::default()
    };
    let answer = replicate_as(&replica, &a, (old_epoch, 1, 1), vec![entry]).await;
    assert_eq!(answer.out_of_sync, vec![0], "{answer:?}");
    // The replica wins a newer epoch and recovers: the old stream is refused.
    replica.replication.begin_recovery(0, old_epoch + 1);
    let answer = replicate_as(&replica, &a, (old_epoch, 0, 1), vec![]).await;
    assert_eq!(answer.deposed.len(), 1, "{answer:?}");
    assert_eq!(
        (answer.deposed[0].primary.as_str(), answer.deposed[0].epoch),
        (b.as_str(), old_epoch + 1)
    );
    replica.stop().await;
    primary.stop().await;
}

/// A replica in step under an attachment its primary no longer has (the
/// primary detached it without the replica hearing of it) attaches again
/// as soon as a stream head says so, instead of believing itself in step
/// while nothing is forwarded to it (found under load: a replica attached
/// while its primary was taking over, and the takeover undid it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_attachment_is_gone_attaches_again() {
    let (a, b) = (free_addr(), free_addr());
    let primary = InProcess::start(&config(&a, 0, &b, &a, 10_000)).await;
    let replica = InProcess::start(&config(&b, 1, &a, &b, 10_000)).await;
    wait_serving(&a).await;
    wait_replicas_in_step(&a).await;
    let epoch = replica.replication.known_epoch(0);
    // A head of the primary's stream under a newer attachment than this
    // replica's (its own ended): it is not in step any more. (A head under
    // an older one is a late batch, ignored.)
    let answer = replicate_as(&replica, &a, (epoch, 0, u64::MAX), vec![]).await;
    assert_eq!(answer.out_of_sync, vec![0], "{answer:?}");
    // It attaches again, and the stream reaches it.
    wait_replicas_in_step(&a).await;
    for step in 1..=5 {
        push(&primary, step).await.unwrap();
    }
    converged(&primary, &replica).await;
    replica.stop().await;
    primary.stop().await;
}

/// A table with a row limit: the primary chooses every eviction (by its
/// own access clock, which its Fetches advance) and forwards it; the
/// replica, serving Fetches of its own, evicts exactly those rows. Before
/// replicas followed, each chose its own victims and the copies drifted
/// apart for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_of_a_table_with_a_row_limit_evict_what_the_primary_evicts() {
    let (a, b) = (free_addr(), free_addr());
    let limited = |mut config: PsServerConfig| {
        config.tables[0].max_rows = Some(150);
        config
    };
    let primary = InProcess::start(&limited(config(&a, 0, &b, &a, 10_000))).await;
    let replica = InProcess::start(&limited(config(&b, 1, &a, &b, 10_000))).await;
    wait_serving(&a).await;
    wait_serving(&b).await;
    let mut draw = 7u64;
    let mut next = move |n: u64| {
        draw = tessera_proto::sharding::splitmix64(draw);
        draw % n
    };
    for step in 1..=150u64 {
        let keys: Vec<u64> = (0..24).map(|_| next(400)).collect();
        let grads: Vec<f32> = (0..keys.len() * 4).map(|i| (i % 5) as f32 - 2.0).collect();
        primary
            .data
            .push(PushRequest {
                num_shards: 0,
                table: "emb".into(),
                shard: 0,
                keys,
                gradients: Bytes::from(wire(&grads)),
                worker_id: 9,
                sequence: step,
            })
            .await
            .unwrap();
        // Different Fetches on each server: their access clocks differ.
        for (server, hot) in [(&primary, 0u64), (&replica, 200)] {
            let keys: Vec<u64> = (0..16).map(|_| hot + next(200)).collect();
            server
                .data
                .fetch(FetchRequest {
                    table: "emb".into(),
                    shard: 0,
                    keys,
                })
                .await
                .unwrap();
        }
    }
    let stats = primary.admin.stats(StatsRequest {}).await.unwrap();
    assert!(
        stats.shards.iter().map(|s| s.rows).sum::<u64>() <= 150,
        "{stats:?}"
    );
    assert!(
        primary.store.table("emb").unwrap().evictions() > 100,
        "the limit was reached"
    );
    converged(&primary, &replica).await;
    let all: Vec<u64> = (0..400).collect();
    for server in [&primary, &replica] {
        // Fetches of missing rows do not store them on either side.
        server
            .data
            .fetch(FetchRequest {
                table: "emb".into(),
                shard: 0,
                keys: all.clone(),
            })
            .await
            .unwrap();
    }
    converged(&primary, &replica).await;
    primary.stop().await;
    replica.stop().await;
}

/// A copy that takes much longer than `max_lag_pushes` Pushes arrive: the
/// replica holds the Pushes forwarded meanwhile and applies them after the
/// copy, so it comes into step under a steady load, with one copy and no
/// cut-off (before, the primary cut it off as each copy finished and it
/// never converged while the load lasted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_copy_under_a_steady_push_load_converges() {
    // More Pushes than this go by during the copy; the load is paced (a
    // Push a millisecond) so that forwarding, one batch of 64 at a time,
    // keeps up: unpaced, a debug build under CI's load pushed 2,800 a
    // second and a forwarder that fell 200 behind cut the replica off,
    // which is max_lag_pushes doing its job, not what this test is about.
    const MAX_LAG: usize = 1000;
    let (a, b) = (free_addr(), free_addr());
    // The replica reaches the primary through a slow proxy: its copy
    // crawls. The primary advertises the proxy's address, so that the
    // replica calls back through it.
    let to_primary = FaultProxy::start(a.clone()).await;
    let primary = InProcess::start(&config(&a, 0, &b, &to_primary.addr, MAX_LAG)).await;
    let replica_config = config(&b, 1, &to_primary.addr, &b, MAX_LAG);
    let first = InProcess::start(&replica_config).await;
    wait_serving(&a).await;
    wait_serving(&b).await;
    // A shard of 60,000 rows (about 3.6 MB as a copy: four chunks).
    for (i, chunk) in (0..60_000u64).collect::<Vec<_>>().chunks(5000).enumerate() {
        let sequence = i as u64 + 1;
        let grads = vec![0.5f32; chunk.len() * 4];
        primary
            .data
            .push(PushRequest {
                num_shards: 0,
                table: "emb".into(),
                shard: 0,
                keys: chunk.to_vec(),
                gradients: Bytes::from(wire(&grads)),
                worker_id: 11,
                sequence,
            })
            .await
            .unwrap();
    }
    // The replica restarts empty: it must copy the whole shard.
    first.stop().await;
    to_primary.delay(Duration::from_millis(30));
    let replica = InProcess::start(&replica_config).await;

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pusher = tokio::spawn({
        let (data, stop) = (primary.data.clone(), stop.clone());
        async move {
            let mut pushed = 0u64;
            let mut pace = tokio::time::interval(Duration::from_millis(1));
            pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                pace.tick().await;
                pushed += 1;
                let keys: Vec<u64> = (0..8).map(|i| (pushed * 8 + i) % 60_000).collect();
                let grads = vec![0.25f32; keys.len() * 4];
                data.push(PushRequest {
                    num_shards: 0,
                    table: "emb".into(),
                    shard: 0,
                    keys,
                    gradients: Bytes::from(wire(&grads)),
                    worker_id: 12,
                    sequence: pushed,
                })
                .await
                .unwrap();
            }
            pushed
        }
    });
    // In step (by the replica's own account, with its copy in) while the
    // Pushes go on.
    let started = Instant::now();
    eventually(
        Duration::from_secs(40),
        "the replica comes into step under load",
        || async {
            let health = tessera_test_support::health(&b).await.unwrap();
            if replica.replication.syncs() >= 1 && health.shard_health.iter().all(|s| s.in_step) {
                Ok(())
            } else {
                Err(format!(
                    "{} copies, {} cut-offs",
                    replica.replication.syncs(),
                    primary.replication.cutoffs()
                ))
            }
        },
    )
    .await;
    let in_step_after = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let pushed = pusher.await.unwrap();
    to_primary.delay(Duration::ZERO);
    converged(&primary, &replica).await;
    eprintln!(
        "replica in step {in_step_after:?} after it started, {pushed} Pushes during the copy and after"
    );
    assert!(
        pushed > MAX_LAG as u64,
        "the load outran max_lag_pushes: {pushed}"
    );
    assert_eq!(primary.replication.cutoffs(), 0, "no cut-off");
    assert_eq!(replica.replication.syncs(), 1, "one copy");
    replica.stop().await;
    primary.stop().await;
}
