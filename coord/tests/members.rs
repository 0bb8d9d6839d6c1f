//! The coordinator client over a three-member local etcd: calls go on when
//! a member dies, its leader included (they went to the dead member about
//! half the time before: `etcd-client`'s balanced channel does not skip a
//! member it cannot reach), and the local etcd's member controls work.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use tessera_coord::{CoordinatorConfig, CoordinatorKind, EtcdCoordinator, LocalEtcd, etcd_bin};

fn three() -> (LocalEtcd, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let etcd = LocalEtcd::start_members(&etcd_bin(None), dir.path(), 3, Duration::from_secs(30))
        .unwrap_or_else(|err| panic!("{err}"));
    (etcd, dir)
}

fn config(etcd: &LocalEtcd) -> CoordinatorConfig {
    CoordinatorConfig {
        kind: CoordinatorKind::Etcd,
        endpoints: etcd.endpoints().to_vec(),
        cluster: "members-test".into(),
        ..CoordinatorConfig::default()
    }
}

/// The leader, waiting up to 10 s for one.
fn leader(etcd: &LocalEtcd) -> usize {
    tessera_test_support::wait::eventually_blocking(
        Duration::from_secs(10),
        "an etcd leader",
        || etcd.leader().ok_or("no leader"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_is_answered_while_a_member_or_the_leader_is_down() {
    let (mut etcd, _dir) = tokio::task::block_in_place(three);
    assert_eq!(etcd.endpoints().len(), 3);
    let coord = EtcdCoordinator::connect(&config(&etcd)).await.unwrap();
    let (lease, _) = coord.grant_lease(5).await.unwrap();
    // The member the client used first (the first one) goes, then the
    // leader; each time, once the others have a leader (an election may
    // fail calls for its length, which the servers ride out while their
    // leases hold), twenty calls all succeed.
    assert!(etcd.kill_member(0));
    tokio::task::block_in_place(|| leader(&etcd));
    for call in 0..20 {
        coord
            .primaries()
            .await
            .unwrap_or_else(|err| panic!("call {call} with member 0 down: {err}"));
    }
    etcd.restart_member(0).unwrap();
    let old = tokio::task::block_in_place(|| leader(&etcd));
    assert!(etcd.kill_member(old));
    let new = tokio::task::block_in_place(|| leader(&etcd));
    assert_ne!(new, old, "another member leads");
    for call in 0..20 {
        coord
            .campaign(call % 4, "127.0.0.1:1", 0, lease, 0)
            .await
            .unwrap_or_else(|err| panic!("call {call} with the leader ({old}) down: {err}"));
    }
    assert!(
        coord.lease_alive(lease).await.unwrap(),
        "the lease lived on"
    );
    etcd.restart_member(old).unwrap();
    assert!(!etcd.kill_member(7), "no member 7");
}

#[test]
fn member_counts_raft_cannot_use_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for members in [0, 2, 9] {
        let err =
            LocalEtcd::start_members(&etcd_bin(None), dir.path(), members, Duration::from_secs(1))
                .unwrap_err();
        assert!(
            matches!(err, tessera_coord::LocalEtcdError::Members(m) if m == members),
            "{err:?}"
        );
    }
}

/// The shard map is written only by the one who read its current
/// revision: of two participants stepping the same resize, one wins; the
/// record survives the client that wrote it (a new client reads it back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_map_step_is_written_only_over_the_revision_it_was_computed_from() {
    use tessera_coord::ShardMap;
    let dir = tempfile::tempdir().unwrap();
    let etcd = tokio::task::block_in_place(|| {
        LocalEtcd::start_members(&etcd_bin(None), dir.path(), 1, Duration::from_secs(30))
    })
    .unwrap_or_else(|err| panic!("{err}"));
    let mut config = config(&etcd);
    config.cluster = "shard-map-test".into();
    let coord = EtcdCoordinator::connect(&config).await.unwrap();
    assert!(coord.shard_map().await.unwrap().is_none());
    let first = ShardMap::new(2);
    assert!(coord.write_shard_map(&first, 0).await.unwrap());
    // A second creator loses.
    assert!(!coord.write_shard_map(&ShardMap::new(5), 0).await.unwrap());
    let (read, revision) = coord.shard_map().await.unwrap().unwrap();
    assert_eq!(read, first);
    // Two operators plan from the same state: one plan is written.
    let to_3 = read.plan(3).unwrap();
    let to_4 = read.plan(4).unwrap();
    assert!(coord.write_shard_map(&to_3, revision).await.unwrap());
    assert!(!coord.write_shard_map(&to_4, revision).await.unwrap());
    // The one who started it goes; another client carries on from etcd.
    drop(coord);
    let other = EtcdCoordinator::connect(&config).await.unwrap();
    let (read, revision) = other.shard_map().await.unwrap().unwrap();
    assert_eq!(read, to_3);
    let copying = read.start_copying().unwrap();
    assert!(other.write_shard_map(&copying, revision).await.unwrap());
    let (read, _) = other.shard_map().await.unwrap().unwrap();
    assert_eq!(read.active().unwrap().to, 3);

    // Two receiving shards report ready at once through the read-modify-
    // write helper: the loser reads the winner's map and writes over it,
    // so both reports stand.
    let (read, revision) = other.shard_map().await.unwrap().unwrap();
    let to_5 = read
        .cancel()
        .and_then(|m| m.plan(5))
        .and_then(|m| m.start_copying())
        .unwrap();
    assert!(other.write_shard_map(&to_5, revision).await.unwrap());
    let a = EtcdCoordinator::connect(&config).await.unwrap();
    let (first, second) = tokio::join!(
        a.update_shard_map(|m| m.handle_ready(3, true)),
        other.update_shard_map(|m| m.handle_ready(4, true)),
    );
    first.unwrap();
    second.unwrap();
    let (read, _) = other.shard_map().await.unwrap().unwrap();
    assert_eq!(read.active().unwrap().ready, vec![3, 4]);
    assert_eq!(read.version, to_5.version + 2);
    // A refused step is the resize's own error, the map unchanged.
    match a.update_shard_map(|m| m.plan(7)).await {
        Err(tessera_coord::CoordError::Resize(tessera_coord::ResizeError::InProgress {
            to: 5,
            ..
        })) => {}
        other => panic!("unexpected: {other:?}"),
    }
}

/// The first server writes the cluster's shard map; servers configured
/// with the same count join it; one with another count is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_join_the_shard_map_and_another_count_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = tokio::task::block_in_place(|| {
        LocalEtcd::start_members(&etcd_bin(None), dir.path(), 1, Duration::from_secs(30))
    })
    .unwrap_or_else(|err| panic!("{err}"));
    let mut config = config(&etcd);
    config.cluster = "join-test".into();
    let coord = EtcdCoordinator::connect(&config).await.unwrap();
    let map = coord.join_shard_map(4, &[]).await.unwrap();
    assert_eq!((map.num_shards, map.version), (4, 1));
    assert_eq!(coord.join_shard_map(4, &[]).await.unwrap(), map);
    match coord.join_shard_map(3, &[]).await {
        Err(tessera_coord::CoordError::ShardCount {
            map: 4,
            configured: 3,
            ..
        }) => {}
        other => panic!("unexpected: {other:?}"),
    }
    // During a resize to 6, a server of the target count joins too.
    let (map, revision) = coord.shard_map().await.unwrap().unwrap();
    assert!(
        coord
            .write_shard_map(&map.plan(6).unwrap(), revision)
            .await
            .unwrap()
    );
    assert_eq!(coord.join_shard_map(6, &[]).await.unwrap().num_shards, 4);
    // Once it cut over, a server of the old count (a giving shard's)
    // joins too, and still after it is done; another count does not.
    let (map, revision) = coord.shard_map().await.unwrap().unwrap();
    let mut cut = map.start_copying().unwrap();
    for shard in 4..6 {
        cut = cut.handle_ready(shard, true).unwrap();
    }
    let cut = cut.cut_over().unwrap();
    assert!(coord.write_shard_map(&cut, revision).await.unwrap());
    assert_eq!(coord.join_shard_map(4, &[]).await.unwrap().num_shards, 6);
    let (map, revision) = coord.shard_map().await.unwrap().unwrap();
    assert!(
        coord
            .write_shard_map(
                &map.handle_opened(4, 1)
                    .and_then(|m| m.handle_opened(5, 1))
                    .and_then(|m| m.finish())
                    .unwrap(),
                revision
            )
            .await
            .unwrap()
    );
    assert_eq!(coord.join_shard_map(4, &[]).await.unwrap().num_shards, 6);
    assert!(coord.join_shard_map(6, &[]).await.is_ok());
    assert!(matches!(
        coord.join_shard_map(5, &[]).await,
        Err(tessera_coord::CoordError::ShardCount { map: 6, .. })
    ));
}
