//! The Push API's guarantees: specs of one table in one call are all
//! applied, a partly failed Push says which parts failed and is completed
//! exactly once by a retry under its id, and a worker that lists only
//! some replica groups still reaches every shard's primary.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use tessera_ps_server::config::{Initializer, OptimizerConfig};
use tessera_ps_server::{PsServerConfig, TableConfig};
use tessera_test_support::wait::eventually;
use tessera_test_support::{FaultProxy, InProcessCluster, keys_of_shard};
use tessera_worker::{PsClient, PushSpec, ServerEndpoint, WorkerConfig, WorkerError};

/// `num_shards x groups` servers with table `emb` (dim 1, zeros, SGD lr
/// 1: a row is minus the sum of the gradients applied to it).
async fn cluster(num_shards: u32, groups: u32) -> InProcessCluster {
    let base = PsServerConfig {
        tables: vec![TableConfig {
            optimizer: OptimizerConfig::sgd(1.0),
            initializer: Initializer::Zeros,
            ..TableConfig::new("emb", 1)
        }],
        ..PsServerConfig::default()
    };
    InProcessCluster::start(num_shards, groups, &base).await
}

fn worker_config(cluster: &InProcessCluster, groups: &[u32]) -> WorkerConfig {
    let servers = cluster
        .layout
        .servers
        .iter()
        .filter(|(group, _, _)| groups.contains(group))
        .map(|(group, shard, address)| ServerEndpoint {
            address: address.clone(),
            shards: vec![*shard],
            replica_group: *group,
        })
        .collect();
    WorkerConfig {
        num_shards: cluster.layout.num_shards,
        replica_groups: Some(cluster.layout.groups),
        servers,
        connect_timeout_ms: 2000,
        request_timeout_ms: 5000,
        call_timeout_ms: 10_000,
        ..WorkerConfig::default()
    }
}

/// The rows of `keys` as the shards' primaries hold them.
async fn rows(client: &PsClient, keys: &[u64]) -> Vec<f32> {
    client.fetch("emb", keys).await.unwrap().values().to_vec()
}

#[tokio::test]
async fn two_specs_of_one_table_in_one_push_are_both_applied() {
    let cluster = cluster(2, 1).await;
    let client = PsClient::new(&worker_config(&cluster, &[0])).unwrap();
    // History and candidates of one table, both spread over both shards,
    // one key in both.
    let history: Vec<u64> = (0..100).collect();
    let candidates: Vec<u64> = (99..200).collect();
    client
        .push_many(&[
            PushSpec {
                table: "emb",
                keys: &history,
                gradients: &vec![1.0; history.len()],
                dim: 1,
            },
            PushSpec {
                table: "emb",
                keys: &candidates,
                gradients: &vec![2.0; candidates.len()],
                dim: 1,
            },
        ])
        .await
        .unwrap();
    let all: Vec<u64> = (0..200).collect();
    let got = rows(&client, &all).await;
    for (&key, &value) in all.iter().zip(&got) {
        let expected = match key {
            0..99 => -1.0,
            99 => -3.0,
            _ => -2.0,
        };
        assert_eq!(value, expected, "key {key}");
    }
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partly_failed_push_names_its_failed_shard_and_a_retry_applies_each_shard_once() {
    let cluster = cluster(2, 1).await;
    let mut config = worker_config(&cluster, &[0]);
    // Shard 1 is reached through a proxy that can cut it off.
    let proxy = FaultProxy::start(config.servers[1].address.clone()).await;
    config.servers[1].address = proxy.addr.clone();
    config.push_timeout_ms = 600;
    config.request_timeout_ms = 200;
    let client = PsClient::new(&config).unwrap();
    let keys: Vec<u64> = keys_of_shard(0, 2, 5)
        .into_iter()
        .chain(keys_of_shard(1, 2, 5))
        .collect();
    let gradients = vec![1.0; keys.len()];
    // Connections up, then the cut.
    rows(&client, &keys).await;
    proxy.partition(true);
    let id = client.next_push_id();
    let failure = match client.push_as(id, "emb", &keys, &gradients, 1).await {
        Err(WorkerError::Push(failure)) => failure,
        other => panic!("expected a partly failed push, got {other:?}"),
    };
    assert_eq!(failure.id, id);
    assert_eq!(failure.acknowledged, vec![("emb".to_owned(), 0)]);
    assert_eq!(failure.failed.len(), 1, "{failure}");
    assert_eq!(failure.failed[0].shard, 1);
    assert_eq!(failure.failed[0].addr, proxy.addr);
    assert!(failure.retriable(), "{failure}");
    // Healed, the same Push again under its id: shard 0 acknowledges it
    // without applying it twice; shard 1 applies it (or acknowledges the
    // copy that got through before the cut) once.
    proxy.partition(false);
    client
        .push_as(id, "emb", &keys, &gradients, 1)
        .await
        .unwrap();
    assert_eq!(rows(&client, &keys).await, vec![-1.0; keys.len()]);
    cluster.stop().await;
}

/// A worker that lists only replica group 0 of a two-group cluster: the
/// odd shards' primaries (group 1) are not in its configuration; their
/// replicas in group 0 redirect its Pushes there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_listing_one_group_pushes_to_primaries_it_does_not_list() {
    let cluster = cluster(2, 2).await;
    let config = worker_config(&cluster, &[0]);
    let client = PsClient::new(&config).unwrap();
    let keys: Vec<u64> = keys_of_shard(0, 2, 5)
        .into_iter()
        .chain(keys_of_shard(1, 2, 5))
        .collect();
    tokio::time::timeout(
        Duration::from_secs(5),
        client.push("emb", &keys, &vec![1.0; keys.len()], 1),
    )
    .await
    .expect("the push finishes well within its timeout")
    .unwrap();
    assert_eq!(
        client.primary(1).map(|(addr, _)| addr).as_deref(),
        Some(cluster.layout.addr(1, 1))
    );
    // Group 0's copies follow their primaries.
    eventually(
        Duration::from_secs(10),
        "group 0's copies holding the Push",
        || async {
            let got = rows(&client, &keys).await;
            if got == vec![-1.0; keys.len()] {
                Ok(())
            } else {
                Err(got)
            }
        },
    )
    .await;
    cluster.stop().await;
}

/// A primary that answers the first Push at once, saying it may hold a
/// Push 800 ms for a replica, and the second only after 600 ms (a replica
/// stopped confirming); any later one is a repeat of an applied Push.
struct SlowAckPrimary {
    pushes: std::sync::atomic::AtomicU64,
}

impl tessera_proto::v1::ParameterServer for SlowAckPrimary {
    async fn fetch(
        &self,
        _: tessera_rpc::RequestContext,
        _: tessera_proto::v1::FetchRequest,
    ) -> Result<tessera_proto::v1::FetchResponse, tessera_rpc::Status> {
        Err(tessera_rpc::Status::unimplemented("push only"))
    }

    async fn push(
        &self,
        _: tessera_rpc::RequestContext,
        _: tessera_proto::v1::PushRequest,
    ) -> Result<tessera_proto::v1::PushResponse, tessera_rpc::Status> {
        let n = self
            .pushes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        if n == 2 {
            tokio::time::sleep(Duration::from_millis(600)).await;
        }
        Ok(tessera_proto::v1::PushResponse {
            applied: 1,
            duplicate: n > 2,
            epoch: 1,
            replica_wait_ms: 800,
        })
    }

    async fn health(
        &self,
        _: tessera_rpc::RequestContext,
        _: tessera_proto::v1::HealthRequest,
    ) -> Result<tessera_proto::v1::HealthResponse, tessera_rpc::Status> {
        Err(tessera_rpc::Status::unimplemented("push only"))
    }
}

/// Issue 33: a worker whose request timeout (300 ms here) is below the
/// servers' replica timeout gave up on the first Push after a replica
/// died while the primary was still waiting the replica out, and sent it
/// again (a burned attempt, answered as a duplicate). Now every Push
/// answer says how long the primary may wait (`replica_wait_ms`), and each
/// attempt gets that on top: the slow Push is one attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_held_for_a_replica_is_not_given_up_and_sent_again() {
    use std::sync::Arc;
    use tessera_proto::v1::{ParameterServerClient, ParameterServerServer, PushRequest};
    use tessera_rpc::{Channel, ChannelConfig, Server, ServerConfig};
    use tessera_worker::primary::Primaries;

    let primary = Arc::new(SlowAckPrimary {
        pushes: std::sync::atomic::AtomicU64::new(0),
    });
    let server = Server::builder(ServerConfig::default())
        .add_service(ParameterServerServer::from_arc(Arc::clone(&primary)))
        .unwrap()
        .bind("127.0.0.1:0")
        .await
        .unwrap();
    let addr = server.local_addr().to_string();
    let serving = tokio::spawn(server.serve_with_shutdown(std::future::pending()));
    let client = |addr: &str| {
        ParameterServerClient::new(
            Channel::lazy(
                addr,
                ChannelConfig {
                    connect_timeout_ms: 2000,
                    request_timeout_ms: 10_000,
                    ..ChannelConfig::default()
                },
            )
            .unwrap(),
        )
    };
    let primaries = Primaries::new(
        vec![addr.clone()],
        vec![vec![addr.clone()]],
        [(addr.clone(), client(&addr))].into_iter().collect(),
        Box::new(client),
    );
    let request = PushRequest {
        table: "emb".into(),
        shard: 0,
        worker_id: 7,
        sequence: 1,
        ..PushRequest::default()
    };
    let attempt_timeout = Duration::from_millis(300);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let (_, first) = primaries
        .push(&request, attempt_timeout, deadline)
        .await
        .unwrap();
    assert_eq!(first.replica_wait_ms, 800);
    assert_eq!(primaries.replica_wait(), Duration::from_millis(800));
    let second = PushRequest {
        sequence: 2,
        ..request
    };
    let (_, answer) = primaries
        .push(&second, attempt_timeout, deadline)
        .await
        .unwrap();
    assert!(
        !answer.duplicate,
        "the slow Push was given up on and sent again"
    );
    assert_eq!(
        primary.pushes.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "one attempt per Push"
    );
    serving.abort();
}
