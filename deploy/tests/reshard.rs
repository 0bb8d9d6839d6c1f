//! `tessera reshard` as an operator runs it against a cluster's etcd: a
//! plan, a refusal while one is in progress, a cancel, the map in words
//! and in JSON, and a clear error for a cluster that never started.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    missing_docs
)]

use std::process::Command;

use tessera_coord::{CoordinatorConfig, CoordinatorKind, EtcdCoordinator, ResizeState, ShardMap};
use tessera_test_support::etcd::Etcd;

fn reshard(etcd: &Etcd, cluster: &str, args: &[&str]) -> (bool, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args([
            "reshard",
            "--endpoints",
            &etcd.endpoint,
            "--cluster",
            cluster,
        ])
        .args(args)
        .output()
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_plans_refuses_a_second_and_cancels_a_resize() {
    let etcd = tokio::task::block_in_place(Etcd::start);
    let cluster = "reshard-cli";
    // A cluster that never started has no map to change.
    let (ok, _, err) = tokio::task::block_in_place(|| reshard(&etcd, cluster, &["--to", "3"]));
    assert!(!ok);
    assert!(err.contains("has no shard map"), "{err}");

    // Its first server writes the map (as a ps-server in etcd mode does).
    let coord = EtcdCoordinator::connect(&CoordinatorConfig {
        kind: CoordinatorKind::Etcd,
        endpoints: vec![etcd.endpoint.clone()],
        cluster: cluster.into(),
        ..CoordinatorConfig::default()
    })
    .await
    .unwrap();
    coord.join_shard_map(2, &[0]).await.unwrap();
    let (ok, out, err) = tokio::task::block_in_place(|| reshard(&etcd, cluster, &[]));
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "shard map version 1: keys routed to 2 shards");

    let (ok, out, err) = tokio::task::block_in_place(|| reshard(&etcd, cluster, &["--to", "3"]));
    assert!(ok, "{err}");
    assert!(
        out.contains("resize 2 -> 3 shards (planned at version 2): planned")
            && out.contains("receiving shards 2; in step: none yet"),
        "{out}"
    );
    let (map, _) = coord.shard_map().await.unwrap().unwrap();
    assert_eq!(map.num_shards, 2, "routing changes only at the cut-over");
    assert_eq!(
        map.active().map(|r| (r.to, r.state)),
        Some((3, ResizeState::Planned))
    );

    // One resize at a time; nonsense targets are refused by name.
    let (ok, _, err) = tokio::task::block_in_place(|| reshard(&etcd, cluster, &["--to", "4"]));
    assert!(!ok);
    assert!(
        err.contains("a resize from 2 to 3 shards is in progress"),
        "{err}"
    );

    let (ok, out, err) =
        tokio::task::block_in_place(|| reshard(&etcd, cluster, &["--cancel", "--json"]));
    assert!(ok, "{err}");
    let map: ShardMap = serde_json::from_str(&out).unwrap();
    assert_eq!(map.num_shards, 2);
    assert_eq!(
        map.resize.as_ref().map(|r| r.state),
        Some(ResizeState::Cancelled)
    );
    let (ok, _, err) = tokio::task::block_in_place(|| reshard(&etcd, cluster, &["--cancel"]));
    assert!(!ok);
    assert!(err.contains("no resize is in progress"), "{err}");
    let (ok, _, err) = tokio::task::block_in_place(|| reshard(&etcd, cluster, &["--to", "2"]));
    assert!(!ok);
    assert!(err.contains("cannot resize 2 shards to 2"), "{err}");
    // After a cancel, a new plan may go ahead.
    let (ok, out, err) = tokio::task::block_in_place(|| reshard(&etcd, cluster, &["--to", "4"]));
    assert!(ok, "{err}");
    assert!(out.contains("resize 2 -> 4 shards"), "{out}");

    // A shrink: the remaining shard receives; a server of the count it
    // goes to may not join until it is done, one of the old count may.
    tokio::task::block_in_place(|| reshard(&etcd, cluster, &["--cancel"]));
    let (ok, out, err) = tokio::task::block_in_place(|| reshard(&etcd, cluster, &["--to", "1"]));
    assert!(ok, "{err}");
    assert!(
        out.contains("resize 2 -> 1 shards") && out.contains("receiving shards 0"),
        "{out}"
    );
    let err = coord.join_shard_map(1, &[0]).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("a shrink from 2 to 1 shards is in progress"),
        "{err}"
    );
    coord.join_shard_map(2, &[0]).await.unwrap();
    // A growth: an old shard's server keeps the old count until it is
    // done; a new shard's may start with the new one.
    tokio::task::block_in_place(|| reshard(&etcd, cluster, &["--cancel"]));
    let (ok, _, err) = tokio::task::block_in_place(|| reshard(&etcd, cluster, &["--to", "3"]));
    assert!(ok, "{err}");
    let err = coord.join_shard_map(3, &[1]).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("shard 1 gives keys in it: its servers keep num_shards = 2"),
        "{err}"
    );
    coord.join_shard_map(3, &[2]).await.unwrap();
    coord.join_shard_map(2, &[1]).await.unwrap();
}
