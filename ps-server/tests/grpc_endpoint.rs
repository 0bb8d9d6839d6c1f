//! The gRPC endpoint's limits and codes as a stock gRPC client sees them
//! (failure pattern 11): messages up to the server's `max_message_size`
//! (tonic's default was 4 MiB: a Push over it, or a Fetch of more than
//! 524,288 keys of dim 2, failed with OUT_OF_RANGE), and a handler past the
//! request's `grpc-timeout` answers DEADLINE_EXCEEDED.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use bytes::Bytes;
use tessera_proto::v1::{FetchRequest, FetchResponse, PushRequest, PushResponse};
use tessera_ps_server::PsServerConfig;
use tessera_test_support::{InProcess, free_addr, keys_of_shard, wire};
use tonic::codegen::http::uri::PathAndQuery;

async fn grpc_client(addr: std::net::SocketAddr) -> tonic::client::Grpc<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    tonic::client::Grpc::new(channel)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20)
}

async fn unary<Req, Resp>(
    client: &mut tonic::client::Grpc<tonic::transport::Channel>,
    path: &'static str,
    request: tonic::Request<Req>,
) -> Result<Resp, tonic::Status>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    client.ready().await.unwrap();
    client
        .unary(
            request,
            PathAndQuery::from_static(path),
            tonic_prost::ProstCodec::<Req, Resp>::default(),
        )
        .await
        .map(tonic::Response::into_inner)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_pattern_the_grpc_endpoint_takes_the_servers_message_size_and_reports_deadlines() {
    let server = InProcess::start(&PsServerConfig {
        listen: "127.0.0.1:0".into(),
        grpc_listen: Some(free_addr()),
        ..PsServerConfig::default()
    })
    .await;
    let grpc_addr = {
        let health = tessera_test_support::wait_serving(&server.addr).await;
        let _ = health;
        server.grpc_addr.expect("a gRPC endpoint")
    };
    let mut client = grpc_client(grpc_addr).await;
    let dim = server.store.row_bytes("embeddings").unwrap() / 4;
    // A Push of about 8 MiB of gradients.
    let keys = keys_of_shard(0, 1, (8 << 20) / (dim * 4));
    let push = PushRequest {
        num_shards: 0,
        table: "embeddings".into(),
        shard: 0,
        keys: keys.clone(),
        gradients: Bytes::from(wire(&vec![0.001; keys.len() * dim])),
        worker_id: 0,
        sequence: 0,
    };
    let pushed: PushResponse = unary(
        &mut client,
        "/tessera.ps.v1.ParameterServer/Push",
        tonic::Request::new(push.clone()),
    )
    .await
    .unwrap();
    assert_eq!(pushed.applied as usize, keys.len());
    // And its rows back (an 8 MiB response).
    let fetched: FetchResponse = unary(
        &mut client,
        "/tessera.ps.v1.ParameterServer/Fetch",
        tonic::Request::new(FetchRequest {
            table: "embeddings".into(),
            shard: 0,
            keys: keys.clone(),
        }),
    )
    .await
    .unwrap();
    assert_eq!(fetched.values.len(), keys.len() * dim * 4);

    // A Push that waits (the shard's lock is held) past its grpc-timeout.
    let (release, held) = std::sync::mpsc::channel::<()>();
    let (locked, is_locked) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn({
        let store = std::sync::Arc::clone(&server.store);
        move || {
            let guard = store.lock_shard(0).unwrap();
            locked.send(()).unwrap();
            let _ = held.recv_timeout(Duration::from_secs(20));
            drop(guard);
        }
    });
    is_locked.recv().unwrap();
    let mut request = tonic::Request::new(PushRequest {
        keys: keys[..4].to_vec(),
        gradients: Bytes::from(wire(&vec![0.001; 4 * dim])),
        ..push
    });
    request
        .metadata_mut()
        .insert("grpc-timeout", "1S".parse().unwrap());
    let err = unary::<PushRequest, PushResponse>(
        &mut client,
        "/tessera.ps.v1.ParameterServer/Push",
        request,
    )
    .await
    .unwrap_err();
    release.send(()).unwrap();
    holder.join().unwrap();
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
    server.stop().await;
}

/// A Fetch of four rows of the default table, which must succeed.
async fn fetch_four_rows(client: &mut tonic::client::Grpc<tonic::transport::Channel>) {
    let request = FetchRequest {
        table: "embeddings".into(),
        shard: 0,
        keys: keys_of_shard(0, 1, 4),
    };
    let _: FetchResponse = unary(
        client,
        "/tessera.ps.v1.ParameterServer/Fetch",
        tonic::Request::new(request),
    )
    .await
    .unwrap();
}

/// The gRPC endpoint's connection limits: a connection that sends nothing
/// is closed after `handshake_timeout_ms` (hyper waits for the HTTP/2
/// preface for ever, and held its place under the cap), one beyond
/// `max_connections_per_address` is closed at once, and a stock client
/// is served all along.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_endpoint_closes_silent_connections_and_caps_an_address() {
    use tokio::io::AsyncReadExt;
    let server = InProcess::start(&PsServerConfig {
        listen: "127.0.0.1:0".into(),
        grpc_listen: Some(free_addr()),
        inbound: tessera_rpc::InboundConfig {
            handshake_timeout_ms: 300,
            max_connections_per_address: 3,
            ..tessera_rpc::InboundConfig::default()
        },
        ..PsServerConfig::default()
    })
    .await;
    tessera_test_support::wait_serving(&server.addr).await;
    let grpc_addr = server.grpc_addr.expect("a gRPC endpoint");
    let mut client = grpc_client(grpc_addr).await;
    fetch_four_rows(&mut client).await;
    let mut silent = tokio::net::TcpStream::connect(grpc_addr).await.unwrap();
    let mut also_silent = tokio::net::TcpStream::connect(grpc_addr).await.unwrap();
    // The client's connection and two silent ones fill the address's
    // three places: a fourth is closed at once.
    let mut fourth = tokio::net::TcpStream::connect(grpc_addr).await.unwrap();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(5), fourth.read(&mut byte))
        .await
        .expect("closed at once");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    // (The server speaks first: its SETTINGS frame comes, then the close.)
    for conn in [&mut silent, &mut also_silent] {
        let mut sink = [0u8; 256];
        tokio::time::timeout(Duration::from_secs(10), async {
            while matches!(conn.read(&mut sink).await, Ok(n) if n > 0) {}
        })
        .await
        .expect("a silent connection is closed by the handshake bound");
    }
    // Their places are free again, and the client was served throughout.
    fetch_four_rows(&mut client).await;
    let _late = tokio::net::TcpStream::connect(grpc_addr).await.unwrap();
    let mut other = grpc_client(grpc_addr).await;
    fetch_four_rows(&mut other).await;
}

/// A server of shard 0 in `group` of two, knowing the other at `peer`.
fn replicated(listen: &str, group: u32, peer: &str) -> PsServerConfig {
    PsServerConfig {
        listen: listen.to_owned(),
        grpc_listen: Some(free_addr()),
        replica_group: group,
        replica_groups: 2,
        peers: vec![tessera_ps_server::config::PeerConfig {
            address: peer.to_owned(),
            replica_group: 1 - group,
            shards: vec![0],
        }],
        ..PsServerConfig::default()
    }
}

/// The standard gRPC health protocol (what Kubernetes' gRPC probes and
/// `grpc_health_probe` ask): NOT_SERVING while a hosted shard is not
/// served (a replica whose primary is not there to copy from), SERVING
/// once it is, and NOT_SERVING again as the server shuts down, before the
/// endpoint goes away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_health_protocol_serves_once_every_shard_is_served() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

    let primary_addr = free_addr();
    let replica_addr = free_addr();
    let replica = InProcess::start(&replicated(&replica_addr, 1, &primary_addr)).await;
    let grpc_addr = replica.grpc_addr.expect("a gRPC endpoint");
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc_addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let check = |service: &'static str| {
        let mut health = health.clone();
        async move {
            health
                .check(HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .map(|r| r.into_inner().status())
        }
    };
    // Its primary is not there: its shard has no copy to serve.
    assert_eq!(check("").await.unwrap(), ServingStatus::NotServing);
    assert_eq!(
        check("tessera.ps.v1.ParameterServer").await.unwrap(),
        ServingStatus::NotServing
    );
    // An unknown service is NOT_FOUND, as the protocol says.
    assert_eq!(
        check("no.such.Service").await.unwrap_err().code(),
        tonic::Code::NotFound
    );
    // The primary comes: the replica copies the shard and serves.
    let primary = InProcess::start(&replicated(&primary_addr, 0, &replica_addr)).await;
    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let serving = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(status) = watch.message().await.unwrap() {
            if status.status() == ServingStatus::Serving {
                return;
            }
        }
        panic!("the watch ended before SERVING");
    })
    .await;
    assert!(
        serving.is_ok(),
        "SERVING within 20 s of the primary's start"
    );
    // Shutdown: NOT_SERVING comes before the endpoint goes.
    let stopping = tokio::spawn(replica.stop());
    let mut last = ServingStatus::Serving;
    while let Ok(Some(status)) = watch.message().await {
        last = status.status();
        if last == ServingStatus::NotServing {
            break;
        }
    }
    assert_eq!(
        last,
        ServingStatus::NotServing,
        "NOT_SERVING before the endpoint closed"
    );
    // Then the watch ends, and so does the server: an open Watch does not
    // hold up its graceful stop (before, it waited for it forever).
    tokio::time::timeout(Duration::from_secs(20), async {
        while let Ok(Some(_)) = watch.message().await {}
        stopping.await.unwrap();
    })
    .await
    .expect("the watch ends and the server stops within 20 s");
    primary.stop().await;
}
