//! The in-step record (`ps-server/src/replication/in_step.rs`) on real
//! processes with etcd: a copy that misses acknowledged Pushes never
//! leads while the copy that holds them is only paused.
//!
//! The fault soak found it (seed 6799024984280834607, 1,081 acknowledged
//! Pushes lost): a primary acknowledged Pushes alone while its replica
//! restarted, was paused past its lease as the replica came back, and the
//! replica won the campaign, heard no one, and led from its stale copy.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    missing_docs
)]

use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tessera_proto::v1::{ParameterServerClient, PushRequest, ShardRole};
use tessera_ps_server::PsServerConfig;
use tessera_rpc::{CallOptions, Channel};
use tessera_test_support::health::patient;
use tessera_test_support::wait::eventually;
use tessera_test_support::{
    Etcd, PsProcess, etcd_coordination, free_addr, health, pair_config, pair_push, wait_for_health,
    wait_replicas_in_step, wait_serving,
};

const FAILOVER_MS: u64 = 2000;

fn config(listen: &str, group: u32, peer: &str, etcd: &Etcd) -> PsServerConfig {
    PsServerConfig {
        coordinator: etcd_coordination(etcd, "in-step", FAILOVER_MS),
        ..pair_config(listen, group, peer)
    }
}

fn push_request(step: u64) -> PushRequest {
    pair_push(step, 16, 3)
}

fn shard_role(h: &tessera_proto::v1::HealthResponse) -> (ShardRole, u64) {
    h.shard_health
        .first()
        .map_or((ShardRole::Unspecified, 0), |s| {
            (
                ShardRole::try_from(s.role).unwrap_or(ShardRole::Unspecified),
                s.version.map_or(0, |v| v.position),
            )
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_back_from_a_restart_does_not_lead_from_its_stale_copy_while_the_primary_is_paused()
 {
    let etcd = Etcd::start();
    let dir = tempfile::tempdir().unwrap();
    let bin = Path::new(env!("CARGO_BIN_EXE_ps-server"));
    let (a, b) = (free_addr(), free_addr());
    let first = PsProcess::spawn(bin, &config(&a, 0, &b, &etcd), dir.path(), "a");
    let mut second = PsProcess::spawn(bin, &config(&b, 1, &a, &etcd), dir.path(), "b");
    wait_for_health(&a, "primary", Duration::from_secs(30), |h| {
        shard_role(h).0 == ShardRole::Primary
    })
    .await;
    wait_serving(&b).await;
    wait_replicas_in_step(&a).await;
    let data = ParameterServerClient::new(Channel::lazy(&a, patient()).unwrap());
    let options = CallOptions::with_timeout(Duration::from_secs(10));
    for step in 1..=5 {
        data.push_with_options(push_request(step), &options)
            .await
            .unwrap();
    }
    // The replica dies; the primary cuts it off (replica_timeout_ms) and
    // acknowledges alone.
    second.kill();
    for step in 6..=25 {
        data.push_with_options(push_request(step), &options)
            .await
            .unwrap();
    }
    let acked = 25;
    // The primary pauses (past its lease) as the replica comes back with
    // nothing: the replica cannot copy the shard from it.
    first.signal(Signal::SIGSTOP);
    second.start();
    let watched = Instant::now();
    let mut seen = Vec::new();
    while watched.elapsed() < Duration::from_millis(4 * FAILOVER_MS) {
        if let Ok(h) = health(&b).await {
            let (role, position) = shard_role(&h);
            if seen.last() != Some(&(role, position)) {
                seen.push((role, position));
            }
            assert!(
                role != ShardRole::Primary,
                "the restarted replica leads from a copy at position {position} while {acked} Pushes were acknowledged (roles seen: {seen:?})"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("while the primary was paused, the restarted replica was: {seen:?}");
    // Back: one of them leads with every acknowledged Push.
    first.signal(Signal::SIGCONT);
    let started = Instant::now();
    let (leader, position) = eventually(
        Duration::from_secs(30),
        "a primary (not fenced) after the pause's end",
        || async {
            let mut found = None;
            for addr in [&a, &b] {
                if let Ok(h) = health(addr).await
                    && let (ShardRole::Primary, position) = shard_role(&h)
                    && !h.shard_health[0].fenced
                {
                    found = Some((addr.clone(), position));
                }
            }
            found.ok_or("neither server leads unfenced")
        },
    )
    .await;
    eprintln!(
        "after the pause: {leader} leads at position {position} ({:?} after SIGCONT)",
        started.elapsed()
    );
    assert!(
        position >= acked,
        "the leader's copy is at {position}, {acked} Pushes were acknowledged"
    );
    drop(first);
    drop(second);
}
