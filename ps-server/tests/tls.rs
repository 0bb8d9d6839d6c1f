//! Who may call (issue 16, item 7): with `[tls]`, every connection to a
//! ps-server is mutual TLS, and the Admin and Replication services take
//! calls only from certificates with their roles — on the Tessera
//! endpoint (TCP and rdma-soft) and on the gRPC endpoint. Workers Fetch
//! and Push; a worker's certificate calling Admin is refused; replication
//! between servers works because the servers' certificates carry the
//! replication role; a client without a certificate or of another CA gets
//! nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use bytes::Bytes;
use tessera_proto::v1::{
    AdminClient, CheckpointRequest, FetchRequest, HealthRequest, HealthResponse,
    ParameterServerClient, PushRequest, ReplicationClient, ShardStatusRequest, StatsRequest,
    StatsResponse,
};
use tessera_ps_server::config::{AckMode, ReplicationConfig};
use tessera_ps_server::{PsServerConfig, TableConfig};
use tessera_rpc::{Channel, Code, RpcError, TlsConfig, TransportKind};
use tessera_test_support::{
    InProcess, TestPki, free_addr, wait_replicas_in_step_as, wait_serving_as, wire,
};
use tonic::codegen::http::uri::PathAndQuery;

/// A server of shard 0 in `group` of two, with `tls`, knowing the other.
fn config(
    listen: &str,
    group: u32,
    peer: &str,
    tls: TlsConfig,
    transport: TransportKind,
) -> PsServerConfig {
    PsServerConfig {
        transport,
        rdma: tessera_test_support::rdma::config_rdma(),
        // Acknowledged Pushes are on the replica: replication went through.
        replication: ReplicationConfig {
            ack: AckMode::Replicas,
            ..ReplicationConfig::default()
        },
        tables: vec![TableConfig::new("emb", 4)],
        tls: Some(tls),
        ..tessera_test_support::pair_config(listen, group, peer)
    }
}

/// A channel to `addr` presenting `tls` (none: plain TCP).
fn channel(addr: &str, transport: TransportKind, tls: Option<TlsConfig>) -> Channel {
    let mut config = tessera_test_support::health::patient();
    config.transport.kind = transport;
    config.transport.rdma = tessera_test_support::rdma::config_rdma();
    config.transport.tls = tls;
    config.connect_timeout_ms = 2000;
    // Over RDMA it must be RDMA: no falling back to TCP, which would pass
    // every assertion if the RDMA handshake over TLS broke.
    if transport == TransportKind::Rdma {
        config.fallback.enabled = false;
    }
    Channel::lazy(addr, config).unwrap()
}

fn code(outcome: Result<impl std::fmt::Debug, RpcError>) -> Code {
    match outcome {
        Ok(answer) => panic!("expected a refusal, got {answer:?}"),
        Err(err) => err.code(),
    }
}

async fn roles_on_the_tessera_endpoint(transport: TransportKind) {
    let pki = TestPki::new();
    let (a, b) = (free_addr(), free_addr());
    let server_a = pki.identity("ps-a", &["replication"]);
    let checkpoints = tempfile::tempdir().unwrap();
    let mut primary_config = config(&a, 0, &b, server_a.clone(), transport);
    primary_config.checkpoint.dir = Some(checkpoints.path().to_owned());
    let primary = InProcess::start(&primary_config).await;
    let replica = InProcess::start(&config(
        &b,
        1,
        &a,
        pki.identity("ps-b", &["replication"]),
        transport,
    ))
    .await;
    wait_serving_as(&a, Some(&server_a)).await;
    wait_replicas_in_step_as(&a, Some(&server_a)).await;

    // A worker Fetches and Pushes; every acknowledged Push is on the
    // replica (the servers authenticated each other with their
    // replication role).
    let worker = channel(&a, transport, Some(pki.identity("trainer-1", &["worker"])));
    let data = ParameterServerClient::new(worker.clone());
    for step in 1..=5u64 {
        data.push(PushRequest {
            num_shards: 0,
            table: "emb".into(),
            shard: 0,
            keys: vec![1, 2, 3],
            gradients: Bytes::from(wire(&[0.5f32; 12])),
            worker_id: 9,
            sequence: step,
        })
        .await
        .unwrap();
        assert_eq!(replica.store.version(0).unwrap().position, step);
    }
    let fetched = data
        .fetch(FetchRequest {
            table: "emb".into(),
            shard: 0,
            keys: vec![1, 2, 3],
        })
        .await
        .unwrap();
    assert_eq!(fetched.values.len(), 3 * 4 * 4);

    // The worker's certificate reaches neither Admin nor Replication:
    // refused unrun (no checkpoint is taken).
    assert_eq!(
        code(
            AdminClient::new(worker.clone())
                .checkpoint(CheckpointRequest {})
                .await
        ),
        Code::PermissionDenied
    );
    assert_eq!(
        std::fs::read_dir(checkpoints.path()).unwrap().count(),
        0,
        "a refused Checkpoint wrote nothing"
    );
    assert_eq!(
        code(
            AdminClient::new(worker.clone())
                .stats(StatsRequest {})
                .await
        ),
        Code::PermissionDenied
    );
    assert_eq!(
        code(
            ReplicationClient::new(worker)
                .shard_status(ShardStatusRequest { shard: 0 })
                .await
        ),
        Code::PermissionDenied
    );
    // Nor does a server's own (replication only) reach Admin.
    assert_eq!(
        code(primary.admin.stats(StatsRequest {}).await),
        Code::PermissionDenied
    );
    // An operator's admin certificate does, and only Admin.
    let operator = channel(&a, transport, Some(pki.identity("operator", &["admin"])));
    let stats = AdminClient::new(operator.clone())
        .stats(StatsRequest {})
        .await
        .unwrap();
    assert_eq!(stats.shards.iter().map(|s| s.pushes).sum::<u64>(), 5);
    AdminClient::new(operator.clone())
        .checkpoint(CheckpointRequest {})
        .await
        .unwrap();
    assert!(std::fs::read_dir(checkpoints.path()).unwrap().count() > 0);
    assert_eq!(
        code(
            ReplicationClient::new(operator)
                .shard_status(ShardStatusRequest { shard: 0 })
                .await
        ),
        Code::PermissionDenied
    );

    // No TLS, or a certificate of another CA: not even Health.
    for tls in [
        None,
        Some(pki.stranger("intruder", &["admin", "replication"])),
    ] {
        let refused = ParameterServerClient::new(channel(&a, transport, tls))
            .health(HealthRequest {})
            .await;
        // The handshake fails: the call never reaches a server.
        assert_eq!(code(refused), Code::Unavailable);
    }
    replica.stop().await;
    primary.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tcp_only_certificates_with_the_role_reach_admin_and_replication() {
    roles_on_the_tessera_endpoint(TransportKind::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_rdma_only_certificates_with_the_role_reach_admin_and_replication() {
    roles_on_the_tessera_endpoint(TransportKind::Rdma).await;
}

/// A gRPC client of the endpoint at `addr` presenting `identity` (none:
/// no client certificate), trusting `ca`.
async fn grpc_client(
    addr: std::net::SocketAddr,
    ca: &std::path::Path,
    identity: Option<&TlsConfig>,
) -> Result<tonic::client::Grpc<tonic::transport::Channel>, tonic::transport::Error> {
    let mut tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(
            std::fs::read(ca).unwrap(),
        ))
        .domain_name("localhost");
    if let Some(identity) = identity {
        tls = tls.identity(tonic::transport::Identity::from_pem(
            std::fs::read(&identity.cert).unwrap(),
            std::fs::read(&identity.key).unwrap(),
        ));
    }
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)?
        .connect()
        .await?;
    Ok(tonic::client::Grpc::new(channel))
}

async fn unary<Req, Resp>(
    client: &mut tonic::client::Grpc<tonic::transport::Channel>,
    path: &'static str,
    request: Req,
) -> Result<Resp, tonic::Status>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    client
        .ready()
        .await
        .map_err(|err| tonic::Status::unavailable(err.to_string()))?;
    client
        .unary(
            tonic::Request::new(request),
            PathAndQuery::from_static(path),
            tonic_prost::ProstCodec::<Req, Resp>::default(),
        )
        .await
        .map(tonic::Response::into_inner)
}

const HEALTH: &str = "/tessera.ps.v1.ParameterServer/Health";
const STATS: &str = "/tessera.ps.v1.Admin/Stats";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_endpoint_is_mutual_tls_and_admin_needs_the_admin_role() {
    let pki = TestPki::new();
    let server_tls = pki.identity("ps-0", &["replication"]);
    let server = InProcess::start(&PsServerConfig {
        listen: "127.0.0.1:0".into(),
        grpc_listen: Some(free_addr()),
        tls: Some(server_tls.clone()),
        ..PsServerConfig::default()
    })
    .await;
    wait_serving_as(&server.addr, Some(&server_tls)).await;
    let grpc = server.grpc_addr.expect("a gRPC endpoint");

    let worker = pki.identity("trainer", &["worker"]);
    let mut client = grpc_client(grpc, pki.ca_path(), Some(&worker))
        .await
        .unwrap();
    let health: HealthResponse = unary(&mut client, HEALTH, HealthRequest {}).await.unwrap();
    assert!(health.serving);
    let refused = unary::<_, StatsResponse>(&mut client, STATS, StatsRequest {})
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");

    let admin = pki.identity("operator", &["admin"]);
    let mut client = grpc_client(grpc, pki.ca_path(), Some(&admin))
        .await
        .unwrap();
    let stats: StatsResponse = unary(&mut client, STATS, StatsRequest {}).await.unwrap();
    assert_eq!(stats.shards.len(), 1);

    // No client certificate, or one of another CA: no call gets through
    // (the handshake or the first call fails).
    let stranger = pki.stranger("intruder", &["admin"]);
    let mut mixed = stranger.clone();
    mixed.ca = pki.ca_path().display().to_string();
    for identity in [None, Some(&mixed)] {
        match grpc_client(grpc, pki.ca_path(), identity).await {
            Err(_) => {}
            Ok(mut client) => {
                let outcome =
                    unary::<_, HealthResponse>(&mut client, HEALTH, HealthRequest {}).await;
                assert!(outcome.is_err(), "{identity:?}: {outcome:?}");
            }
        }
    }
    // A plain-text gRPC client neither.
    let plain = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
        .unwrap()
        .connect()
        .await;
    if let Ok(channel) = plain {
        let mut client = tonic::client::Grpc::new(channel);
        let outcome = unary::<_, HealthResponse>(&mut client, HEALTH, HealthRequest {}).await;
        assert!(outcome.is_err(), "{outcome:?}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configuration_names_a_missing_certificate_file() {
    let pki = TestPki::new();
    let mut tls = pki.identity("ps-0", &[]);
    tls.key = "/nonexistent/ps-0.key".into();
    let err = tessera_ps_server::PsServer::bind(&PsServerConfig {
        listen: "127.0.0.1:0".into(),
        tls: Some(tls),
        ..PsServerConfig::default()
    })
    .await
    .unwrap_err();
    let tls = match &err {
        tessera_ps_server::PsError::Transport(tessera_transport::TransportError::Tls(tls)) => tls,
        other => panic!("expected a TLS error, got {other:?}"),
    };
    assert!(
        matches!(**tls, tessera_transport::TlsError::File { key: "key", .. }),
        "{err:?}"
    );
}
