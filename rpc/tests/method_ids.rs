//! Method ids on the wire (failure pattern 12 of the recovery suite):
//! ids are 32-bit hashes of method paths, so two services may share one;
//! the request's service tag keeps a call from running as another
//! service's method. And the generator's split of large `bytes` fields on
//! a proto2 service, whose `optional bytes` carry presence. Each case runs
//! over TCP and over RDMA with the soft provider.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tessera_rpc::{
    Channel, ChannelConfig, Code, RequestContext, Server, ServerConfig, Status, TransportConfig,
    method_id, service_tag,
};

#[allow(clippy::all, missing_docs, dead_code)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/tessera.test.v1.rs"));
}
#[allow(clippy::all, missing_docs, dead_code)]
mod legacy {
    include!(concat!(env!("OUT_DIR"), "/tessera.test.legacy.rs"));
}
use generated::*;

fn transports() -> [(&'static str, TransportConfig); 2] {
    [
        ("tcp", TransportConfig::default()),
        ("rdma", tessera_test_support::rdma::transport()),
    ]
}

fn channel_config(transport: &TransportConfig) -> ChannelConfig {
    ChannelConfig {
        connect_timeout_ms: 2000,
        request_timeout_ms: 5000,
        transport: transport.clone(),
        ..ChannelConfig::default()
    }
}

/// Beta's handler, counting the calls it ran.
#[derive(Clone, Default)]
struct BetaImpl {
    calls: Arc<AtomicU64>,
}

impl Beta for BetaImpl {
    async fn call84580(&self, _context: RequestContext, request: Note) -> Result<Note, Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(Note {
            text: format!("beta saw {}", request.text),
        })
    }
}

#[test]
fn the_test_services_method_ids_collide_and_their_tags_differ() {
    let (alpha, beta) = (&ALPHA_DESCRIPTOR.methods[0], &BETA_DESCRIPTOR.methods[0]);
    assert_eq!(alpha.id, beta.id, "the test needs a collision");
    assert_eq!(alpha.id, method_id(alpha.path));
    assert_eq!(alpha.service, service_tag(ALPHA_DESCRIPTOR.name));
    assert_eq!(beta.service, service_tag(BETA_DESCRIPTOR.name));
    assert_ne!(alpha.service, beta.service);
    assert_ne!(service_tag(""), 0, "0 means no tag");
}

/// Before: the server routed by method id alone and ran Beta's handler for
/// Alpha's call, answering Ok with Beta's response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_pattern_12_a_method_id_of_another_service_is_refused_not_misrouted() {
    for (label, transport) in transports() {
        let beta = BetaImpl::default();
        let server = Server::builder(ServerConfig {
            transport: transport.clone(),
            ..ServerConfig::default()
        })
        .add_service(BetaServer::new(beta.clone()))
        .unwrap()
        .bind("127.0.0.1:0")
        .await
        .unwrap();
        let addr = server.local_addr().to_string();
        let serving = tokio::spawn(server.serve_with_shutdown(std::future::pending::<()>()));
        let channel = Channel::connect(&addr, channel_config(&transport))
            .await
            .unwrap();
        let err = AlphaClient::new(channel.clone())
            .call145654(Note { text: "a".into() })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Unimplemented, "[{label}] {err:?}");
        assert_eq!(beta.calls.load(Ordering::SeqCst), 0, "[{label}]");
        // Beta's own method, same id, is served.
        let answer = BetaClient::new(channel.clone())
            .call84580(Note { text: "b".into() })
            .await
            .unwrap();
        assert_eq!(answer.text, "beta saw b", "[{label}]");
        // A raw call says no service (as builds before the tag did): routed
        // by id, as before.
        let body = prost::Message::encode_to_vec(&Note { text: "c".into() });
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let raw = channel
            .call_raw(
                ALPHA_DESCRIPTOR.methods[0].id,
                tessera_transport::Message::from(Bytes::from(body)),
                deadline,
                Duration::from_secs(5),
            )
            .await
            .unwrap();
        let raw: Note = prost::Message::decode(raw).unwrap();
        assert_eq!(raw.text, "beta saw c", "[{label}]");
        assert_eq!(beta.calls.load(Ordering::SeqCst), 2, "[{label}]");
        serving.abort();
    }
}

struct StoreImpl;

impl legacy::Store for StoreImpl {
    async fn put(
        &self,
        _context: RequestContext,
        request: legacy::Blob,
    ) -> Result<legacy::Blob, Status> {
        Ok(request)
    }
}

/// Before: the generated client and dispatcher did not compile for a proto2
/// message with an `optional bytes` field (the split took the field as
/// `Bytes`, prost makes it `Option<Bytes>`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proto2_optional_bytes_keep_their_presence_through_the_large_field_split() {
    let large = Bytes::from(vec![7u8; 1 << 20]);
    let cases = [
        (None, None, Bytes::new()),
        (Some(Bytes::new()), None, Bytes::from_static(b"x")),
        (Some(large.clone()), Some(Bytes::new()), large.clone()),
        (
            Some(Bytes::from_static(b"small")),
            Some(large.clone()),
            Bytes::new(),
        ),
    ];
    for (label, transport) in transports() {
        let server = Server::builder(ServerConfig {
            transport: transport.clone(),
            ..ServerConfig::default()
        })
        .add_service(legacy::StoreServer::new(StoreImpl))
        .unwrap()
        .bind("127.0.0.1:0")
        .await
        .unwrap();
        let addr = server.local_addr().to_string();
        let serving = tokio::spawn(server.serve_with_shutdown(std::future::pending::<()>()));
        let client = legacy::StoreClient::new(
            Channel::connect(&addr, channel_config(&transport))
                .await
                .unwrap(),
        );
        for (data, note, body) in cases.clone() {
            let blob = legacy::Blob {
                name: "n".into(),
                data,
                note,
                body,
            };
            let back = client.put(blob.clone()).await.unwrap();
            assert_eq!(back, blob, "[{label}]");
        }
        serving.abort();
    }
}
