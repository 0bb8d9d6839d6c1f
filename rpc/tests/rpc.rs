//! End-to-end tests of the RPC layer, using services generated from
//! `tests/proto/echo.proto` (set up in `common/`): every case runs over TCP
//! on loopback and over RDMA with the soft provider (`tcp::` and
//! `rdma_soft::` in test names). The recovery policies' failure patterns
//! have a suite of their own, `failure_patterns.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use tessera_rpc::{
    CallOptions, Channel, ChannelConfig, Code, RpcError, Server, ServerConfig, ServerError,
    method_id,
};
use tessera_rpc::{Transport, TransportConfig};
use tessera_transport::pool::lookup;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;

#[macro_use]
mod common;
use common::*;

#[test]
fn generated_method_ids_are_the_runtime_hash_of_the_path() {
    for descriptor in [&ECHO_DESCRIPTOR, &COUNTER_DESCRIPTOR] {
        for method in descriptor.methods {
            assert_eq!(method.id, method_id(method.path), "{}", method.path);
            assert_eq!(method.path, format!("/{}/{}", descriptor.name, method.name));
        }
    }
    assert_eq!(ECHO_DESCRIPTOR.name, "tessera.test.v1.Echo");
    assert_eq!(COUNTER_DESCRIPTOR.methods.len(), 1);
}

async fn two_generated_services_are_served_and_called_end_to_end(t: TransportConfig) {
    let server = start(server_config(&t)).await;
    let channel = Channel::connect(&server.addr, channel_config(&t))
        .await
        .unwrap();
    let echo = EchoClient::new(channel.clone());
    let counter = CounterClient::new(channel);
    let response = echo
        .echo(EchoRequest {
            payload: Bytes::from_static(b"hello"),
            delay_ms: 0,
            repeat: 0,
        })
        .await
        .unwrap();
    assert_eq!(&response.payload[..], b"hello");
    assert_eq!(
        counter.increment(IncrementRequest {}).await.unwrap().value,
        1
    );
    assert_eq!(
        counter.increment(IncrementRequest {}).await.unwrap().value,
        2
    );
    server.shutdown().await;
}

async fn handler_status_reaches_the_caller(t: TransportConfig) {
    let server = start(server_config(&t)).await;
    let echo = EchoClient::new(Channel::lazy(&server.addr, channel_config(&t)).unwrap());
    let err = echo
        .fail(FailRequest {
            code: Code::NotFound.as_u16().into(),
            message: "no such table".into(),
        })
        .await
        .unwrap_err();
    match err {
        RpcError::Status(status) => {
            assert_eq!(status.code(), Code::NotFound);
            assert_eq!(status.message(), "no such table");
        }
        other => panic!("expected a status, got {other:?}"),
    }
    server.shutdown().await;
}

async fn concurrent_calls_on_one_connection_are_matched_by_request_id(t: TransportConfig) {
    let server = start(server_config(&t)).await;
    let echo = EchoClient::new(
        Channel::connect(&server.addr, channel_config(&t))
            .await
            .unwrap(),
    );
    // Later calls have shorter delays, so responses come back out of order.
    let calls = (0..64u32).map(|i| {
        let echo = echo.clone();
        async move {
            let payload = Bytes::from(format!("call-{i}"));
            let response = echo
                .echo(EchoRequest {
                    payload: payload.clone(),
                    delay_ms: (64 - i) % 8 * 5,
                    repeat: 0,
                })
                .await
                .unwrap();
            assert_eq!(response.payload, payload);
            response.request_id
        }
    });
    let mut ids = futures::future::join_all(calls).await;
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 64, "every call had its own request id");
    server.shutdown().await;
}

async fn deadline_exceeded_is_reported_and_the_channel_stays_usable(t: TransportConfig) {
    let server = start(server_config(&t)).await;
    let echo = EchoClient::new(
        Channel::connect(&server.addr, channel_config(&t))
            .await
            .unwrap(),
    );
    let started = std::time::Instant::now();
    let err = echo
        .echo_with_options(
            EchoRequest {
                payload: Bytes::new(),
                delay_ms: 2_000,
                repeat: 0,
            },
            &CallOptions::with_timeout(Duration::from_millis(50)),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, RpcError::DeadlineExceeded(d) if d == Duration::from_millis(50)),
        "{err:?}"
    );
    assert_eq!(err.code(), Code::DeadlineExceeded);
    // In the deadline plus scheduling slack (generous: a loaded 2-core
    // host), not the handler's 2 s.
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(50) && took < Duration::from_millis(550),
        "{took:?}"
    );
    // The paper's default Tr (40 ms) when the call gives no deadline.
    let paper = EchoClient::new(
        Channel::connect(
            &server.addr,
            ChannelConfig {
                connect_timeout_ms: 2000,
                transport: t.clone(),
                ..ChannelConfig::default()
            },
        )
        .await
        .unwrap(),
    );
    let started = std::time::Instant::now();
    let err = paper
        .echo(EchoRequest {
            payload: Bytes::new(),
            delay_ms: 2_000,
            repeat: 0,
        })
        .await
        .unwrap_err();
    assert!(
        matches!(err, RpcError::DeadlineExceeded(d) if d == Duration::from_millis(40)),
        "{err:?}"
    );
    assert!(
        started.elapsed() < Duration::from_millis(540),
        "{:?}",
        started.elapsed()
    );
    let ok = echo
        .echo(EchoRequest {
            payload: Bytes::from_static(b"after"),
            delay_ms: 0,
            repeat: 0,
        })
        .await
        .unwrap();
    assert_eq!(&ok.payload[..], b"after");
    server.shutdown().await;
}

async fn server_drops_work_whose_deadline_has_passed(t: TransportConfig) {
    let server = start(server_config(&t)).await;
    let echo = EchoClient::new(
        Channel::connect(&server.addr, channel_config(&t))
            .await
            .unwrap(),
    );
    let err = echo
        .echo_with_options(
            EchoRequest {
                payload: Bytes::new(),
                delay_ms: SLOW_MARKER_MS,
                repeat: 0,
            },
            &CallOptions::with_timeout(Duration::from_millis(100)),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded);
    // The server dropped the handler at the deadline, before its own
    // delay ran out: it never completes.
    tessera_test_support::wait::eventually(
        Duration::from_secs(5),
        "the server dropped the expired handler",
        || async {
            match server.echo_abandoned.load(Ordering::SeqCst) {
                0 => Err("still running"),
                _ => Ok(()),
            }
        },
    )
    .await;
    assert_eq!(
        SLOW_MARKER_COMPLETED.load(Ordering::SeqCst),
        0,
        "the server abandoned the handler"
    );
    server.shutdown().await;
}

async fn large_payloads_round_trip(t: TransportConfig) {
    let server = start(server_config(&t)).await;
    let echo = EchoClient::new(
        Channel::connect(&server.addr, channel_config(&t))
            .await
            .unwrap(),
    );
    let payload = Bytes::from((0..8 << 20).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let response = echo
        .echo(EchoRequest {
            payload: payload.clone(),
            delay_ms: 0,
            repeat: 0,
        })
        .await
        .unwrap();
    assert_eq!(response.payload, payload);
    server.shutdown().await;
}

async fn server_gone_fails_outstanding_and_new_calls(t: TransportConfig) {
    let server = start(ServerConfig {
        shutdown_grace_ms: 50,
        ..server_config(&t)
    })
    .await;
    let addr = server.addr.clone();
    let echo = EchoClient::new(Channel::connect(&addr, channel_config(&t)).await.unwrap());
    let slow = {
        let echo = echo.clone();
        tokio::spawn(async move {
            echo.echo_with_options(
                EchoRequest {
                    payload: Bytes::new(),
                    delay_ms: 10_000,
                    repeat: 0,
                },
                &CallOptions::with_timeout(Duration::from_secs(30)),
            )
            .await
        })
    };
    // The call is in its handler (not merely sent) before the server stops.
    server.wait_echo_started(1).await;
    server.shutdown().await;
    let err = slow.await.unwrap().unwrap_err();
    assert!(matches!(err, RpcError::ConnectionLost { .. }), "{err:?}");
    assert_eq!(err.code(), Code::Unavailable);
    let err = echo
        .echo(EchoRequest {
            payload: Bytes::new(),
            delay_ms: 0,
            repeat: 0,
        })
        .await
        .unwrap_err();
    assert!(err.is_connection_failure(), "{err:?}");
}

async fn graceful_shutdown_answers_in_flight_requests(t: TransportConfig) {
    let server = start(server_config(&t)).await;
    let echo = EchoClient::new(
        Channel::connect(&server.addr, channel_config(&t))
            .await
            .unwrap(),
    );
    let in_flight = {
        let echo = echo.clone();
        tokio::spawn(async move {
            echo.echo(EchoRequest {
                payload: Bytes::from_static(b"finish me"),
                delay_ms: 200,
                repeat: 0,
            })
            .await
        })
    };
    // The call is in its handler (not merely sent) before the server stops.
    server.wait_echo_started(1).await;
    server.shutdown().await;
    assert_eq!(&in_flight.await.unwrap().unwrap().payload[..], b"finish me");
}

async fn nothing_listening_is_a_connection_failure(t: TransportConfig) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    drop(listener);
    let err = Channel::connect(&addr, channel_config(&t))
        .await
        .unwrap_err();
    assert!(err.is_connection_failure(), "{err:?}");
}

async fn unknown_method_gets_unimplemented(t: TransportConfig) {
    let server = start(server_config(&t)).await;
    let channel = Channel::connect(&server.addr, channel_config(&t))
        .await
        .unwrap();
    let err = channel
        .call_raw(
            method_id("/no.Such/Method"),
            tessera_transport::Message::new(),
            std::time::Instant::now() + Duration::from_secs(5),
            Duration::from_secs(5),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented, "{err:?}");
    server.shutdown().await;
}

async fn undecodable_request_body_gets_invalid_argument(t: TransportConfig) {
    let server = start(server_config(&t)).await;
    let channel = Channel::connect(&server.addr, channel_config(&t))
        .await
        .unwrap();
    let err = channel
        .call_raw(
            ECHO_DESCRIPTOR.methods[0].id,
            tessera_transport::Message::from(Bytes::from_static(&[0xff, 0xff, 0xff])),
            std::time::Instant::now() + Duration::from_secs(5),
            Duration::from_secs(5),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    server.shutdown().await;
}

async fn garbage_frame_closes_only_that_connection(t: TransportConfig) {
    let server = start(server_config(&t)).await;
    let mut raw = tokio::net::TcpStream::connect(&server.addr).await.unwrap();
    let garbage = b"definitely not a tessera header";
    raw.write_all(&(garbage.len() as u32).to_le_bytes())
        .await
        .unwrap();
    raw.write_all(garbage).await.unwrap();
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(5), raw.read(&mut buf))
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(read, 0, "server closed the connection");
    // Other clients are unaffected.
    let counter = CounterClient::new(
        Channel::connect(&server.addr, channel_config(&t))
            .await
            .unwrap(),
    );
    assert_eq!(
        counter.increment(IncrementRequest {}).await.unwrap().value,
        1
    );
    server.shutdown().await;
}

#[tokio::test]
async fn registering_a_service_twice_is_refused() {
    let err = Server::builder(ServerConfig::default())
        .add_service(CounterServer::new(CounterImpl::default()))
        .unwrap()
        .add_service(CounterServer::from_arc(Arc::new(CounterImpl::default())))
        .unwrap_err();
    assert!(matches!(err, ServerError::DuplicateMethod { .. }), "{err}");
}

async fn decoded_bytes_fields_point_into_the_receive_pool(t: TransportConfig) {
    let server_transport = Transport::new(t.clone()).unwrap();
    let server = Server::builder(server_config(&t))
        .transport(server_transport.clone())
        .add_service(EchoServer::new(EchoImpl::default()))
        .unwrap()
        .bind("127.0.0.1:0")
        .await
        .unwrap();
    let addr = server.local_addr().to_string();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(server.serve_with_shutdown(async {
        let _ = stopped.await;
    }));
    let client_transport = Transport::new(t.clone()).unwrap();
    let echo = EchoClient::new(Channel::with_transport(
        addr,
        channel_config(&t),
        client_transport.clone(),
    ));
    for size in [100usize, 200_000] {
        let payload = Bytes::from(vec![3u8; size]);
        let response = echo
            .echo(EchoRequest {
                payload: payload.clone(),
                delay_ms: 0,
                repeat: 0,
            })
            .await
            .unwrap();
        assert_eq!(response.payload, payload);
        assert_eq!(
            LAST_REQUEST_PAYLOAD_POOL.load(Ordering::SeqCst),
            server_transport.recv_pool().id(),
            "the handler saw the payload in the server's receive pool: decoded without a copy"
        );
        let region = lookup(&response.payload[..]).expect("response payload in pool memory");
        assert_eq!(
            region.pool_id,
            client_transport.recv_pool().id(),
            "{size}-byte response copied"
        );
    }
    let _ = stop.send(());
    task.await.unwrap();
}

async fn services_concurrent_calls_and_large_payloads(t: TransportConfig) {
    let server = start(server_config(&t)).await;
    let config = channel_config(&t);
    let channel = Channel::connect(&server.addr, config).await.unwrap();
    let echo = EchoClient::new(channel.clone());
    let counter = CounterClient::new(channel);
    assert_eq!(
        counter.increment(IncrementRequest {}).await.unwrap().value,
        1
    );
    let calls = (0..64u32).map(|i| {
        let echo = echo.clone();
        async move {
            // Sizes on both sides of the small-message limit.
            let payload = Bytes::from(vec![
                (i % 251) as u8;
                [10, 5000, 9000, 300_000][i as usize % 4]
            ]);
            let response = echo
                .echo(EchoRequest {
                    payload: payload.clone(),
                    delay_ms: (64 - i) % 4,
                    repeat: 0,
                })
                .await
                .unwrap();
            assert_eq!(response.payload, payload);
        }
    });
    futures::future::join_all(calls).await;
    let big = Bytes::from(vec![5u8; 8 << 20]);
    let response = echo
        .echo(EchoRequest {
            payload: big.clone(),
            delay_ms: 0,
            repeat: 0,
        })
        .await
        .unwrap();
    assert_eq!(response.payload, big);
    server.shutdown().await;
}

async fn statuses_deadlines_and_server_gone(t: TransportConfig) {
    let server = start(server_config(&t)).await;
    let config = channel_config(&t);
    let echo = EchoClient::new(Channel::connect(&server.addr, config).await.unwrap());
    let err = echo
        .fail(FailRequest {
            code: Code::NotFound.as_u16().into(),
            message: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let err = echo
        .echo_with_options(
            EchoRequest {
                payload: Bytes::new(),
                delay_ms: 2_000,
                repeat: 0,
            },
            &CallOptions::with_timeout(Duration::from_millis(50)),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded);
    server.shutdown().await;
    let err = echo
        .echo(EchoRequest {
            payload: Bytes::new(),
            delay_ms: 0,
            repeat: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
}

/// A server whose task is aborted (dropped without a shutdown) answers
/// nothing more, on connections already open too: before, their tasks
/// served on with the dropped server's state, and a peer holding such a
/// connection to an in-process server that "crashed" and was started again
/// on its address talked to the old one.
async fn a_dropped_server_answers_nothing_more_on_open_connections(t: TransportConfig) {
    let server = Server::builder(server_config(&t))
        .transport(Transport::new(t.clone()).unwrap())
        .add_service(EchoServer::new(EchoImpl::default()))
        .unwrap()
        .bind("127.0.0.1:0")
        .await
        .unwrap();
    let addr = server.local_addr().to_string();
    let task = tokio::spawn(server.serve_with_shutdown(std::future::pending::<()>()));
    let echo = EchoClient::new(Channel::connect(&addr, channel_config(&t)).await.unwrap());
    let options = CallOptions::with_timeout(Duration::from_secs(2));
    let request = || EchoRequest {
        payload: Bytes::from_static(b"x"),
        delay_ms: 0,
        repeat: 0,
    };
    echo.echo_with_options(request(), &options).await.unwrap();
    task.abort();
    let _ = task.await;
    let err = echo
        .echo_with_options(request(), &options)
        .await
        .unwrap_err();
    assert!(
        err.is_connection_failure() || matches!(err, RpcError::ConnectionLost { .. }),
        "{err:?}"
    );
}

async fn calls_are_spread_over_the_channels_connections(t: TransportConfig) {
    let server = start(server_config(&t)).await;
    let config = ChannelConfig {
        connections: 3,
        ..channel_config(&t)
    };
    let echo = EchoClient::new(Channel::connect(&server.addr, config).await.unwrap());
    for i in 0..9u32 {
        let payload = Bytes::from(format!("call-{i}"));
        let response = echo
            .echo(EchoRequest {
                payload: payload.clone(),
                delay_ms: 0,
                repeat: 0,
            })
            .await
            .unwrap();
        assert_eq!(response.payload, payload);
    }
    let peers = server.echo_peers.lock().unwrap().len();
    if t.kind == tessera_rpc::TransportKind::Tcp {
        assert_eq!(peers, 3, "one TCP connection per lane");
    } else {
        assert!((1..=3).contains(&peers), "{peers} peers");
    }
    server.shutdown().await;
}

/// Over TCP only: a server restarted at the same address in this process
/// is another RDMA endpoint behind the same address, and the soft
/// provider's dialer reaches the stopped one's engine first (a restarted
/// process's engine fails, and the dial goes to the new one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_lane_dials_again_after_its_server_restarted() {
    let t = TransportConfig::default();
    let server = start(ServerConfig {
        shutdown_grace_ms: 50,
        ..server_config(&t)
    })
    .await;
    let addr = server.addr.clone();
    let channel = Channel::connect(
        &addr,
        ChannelConfig {
            connections: 2,
            ..channel_config(&t)
        },
    )
    .await
    .unwrap();
    let echo = EchoClient::new(channel.clone());
    let call = || {
        let echo = echo.clone();
        async move {
            echo.echo(EchoRequest {
                payload: Bytes::from_static(b"x"),
                delay_ms: 0,
                repeat: 0,
            })
            .await
        }
    };
    for _ in 0..4 {
        call().await.unwrap();
    }
    server.shutdown().await;
    // Both lanes' readers see the close: no usable link is left.
    tessera_test_support::wait::eventually(
        Duration::from_secs(10),
        "no usable link is left once the server closed them",
        || async {
            match channel.current_transport() {
                None => Ok(()),
                Some(kind) => Err(kind),
            }
        },
    )
    .await;
    let server = start_at(server_config(&t), &addr).await;
    for _ in 0..4 {
        call().await.unwrap();
    }
    assert_eq!(
        server.echo_peers.lock().unwrap().len(),
        2,
        "both lanes dialed"
    );
    server.shutdown().await;
}

async fn a_panicking_handler_is_answered_internal_and_the_connection_serves_on(t: TransportConfig) {
    let server = start(server_config(&t)).await;
    let echo = EchoClient::new(
        Channel::connect(&server.addr, channel_config(&t))
            .await
            .unwrap(),
    );
    // At once (a lone request runs on the connection's task) and after
    // waiting (its own task).
    for delay_ms in [0, 5] {
        let err = echo
            .echo(EchoRequest {
                payload: Bytes::from_static(b"panic"),
                delay_ms,
                repeat: 0,
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Internal, "{err:?}");
        let fine = echo
            .echo(EchoRequest {
                payload: Bytes::from_static(b"fine"),
                delay_ms: 0,
                repeat: 0,
            })
            .await
            .unwrap();
        assert_eq!(&fine.payload[..], b"fine");
    }
    server.shutdown().await;
}

over_both_transports!(
    a_panicking_handler_is_answered_internal_and_the_connection_serves_on,
    calls_are_spread_over_the_channels_connections,
    a_dropped_server_answers_nothing_more_on_open_connections,
    two_generated_services_are_served_and_called_end_to_end,
    handler_status_reaches_the_caller,
    concurrent_calls_on_one_connection_are_matched_by_request_id,
    deadline_exceeded_is_reported_and_the_channel_stays_usable,
    server_drops_work_whose_deadline_has_passed,
    large_payloads_round_trip,
    server_gone_fails_outstanding_and_new_calls,
    graceful_shutdown_answers_in_flight_requests,
    nothing_listening_is_a_connection_failure,
    unknown_method_gets_unimplemented,
    undecodable_request_body_gets_invalid_argument,
    garbage_frame_closes_only_that_connection,
    decoded_bytes_fields_point_into_the_receive_pool,
    services_concurrent_calls_and_large_payloads,
    statuses_deadlines_and_server_gone,
);

mod replica_set {
    use super::*;
    use tessera_rpc::policy::RetryBudgetConfig;
    use tessera_rpc::{ReplicaEndpoint, ReplicaSet, ReplicaSetConfig};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_fail_over_from_a_dead_replica_which_is_then_quarantined() {
        let server = start(ServerConfig::default()).await;
        let dead = dead_addr();
        let set = ReplicaSet::new(
            replica_config(vec![
                // The dead one is in the caller's own domain: preferred.
                ReplicaEndpoint {
                    addr: dead.clone(),
                    domain: "zone-a".into(),
                },
                ReplicaEndpoint {
                    addr: server.addr.clone(),
                    domain: "zone-b".into(),
                },
            ]),
            Transport::new(TransportConfig::default()).unwrap(),
        );
        let method = ECHO_DESCRIPTOR.methods[0].id;
        // Every call succeeds; the dead replica is tried again only after
        // its connection backoff (250 ms, then 500 ms), so its third
        // connection failure (> M = 2: quarantined) comes after ~750 ms.
        let started = std::time::Instant::now();
        let mut calls = 0;
        while set.quarantined().is_empty() {
            let body = set
                .call_raw(method, echo_body(0), false, Duration::from_secs(2))
                .await
                .expect("a healthy replica answers");
            let response: EchoResponse = prost::Message::decode(body).unwrap();
            assert_eq!(&response.payload[..], b"hello");
            calls += 1;
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "never quarantined"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            started.elapsed() >= Duration::from_millis(740),
            "backoff skipped: quarantined after {:?} and {calls} calls",
            started.elapsed()
        );
        let quarantined = set.quarantined();
        assert_eq!(quarantined.len(), 1, "{quarantined:?}");
        assert_eq!(quarantined[0].node, dead);
        set.clear_quarantine();
        assert!(set.quarantined().is_empty());
        server.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_attempt_is_retried_only_when_safe_and_the_budget_caps_retries() {
        let slow = start(ServerConfig::default()).await;
        let slow2 = start(ServerConfig::default()).await;
        let set = ReplicaSet::new(
            ReplicaSetConfig {
                budget: RetryBudgetConfig {
                    max_tokens: 2.0,
                    reserve_per_sec: 0.0,
                    ..RetryBudgetConfig::default()
                },
                ..replica_config(vec![
                    ReplicaEndpoint {
                        addr: slow.addr.clone(),
                        domain: "zone-a".into(),
                    },
                    ReplicaEndpoint {
                        addr: slow2.addr.clone(),
                        domain: "zone-b".into(),
                    },
                ])
            },
            Transport::new(TransportConfig::default()).unwrap(),
        );
        let method = ECHO_DESCRIPTOR.methods[0].id;
        // Each attempt times out at 150 ms (the server takes 400).
        let started = std::time::Instant::now();
        let err = set
            .call_raw(method, echo_body(400), false, Duration::from_secs(2))
            .await
            .unwrap_err();
        assert!(matches!(err, RpcError::DeadlineExceeded(_)), "{err:?}");
        assert!(
            started.elapsed() < Duration::from_millis(350),
            "not idempotent: one attempt only ({:?})",
            started.elapsed()
        );
        // Safe to retry: a second attempt on the other replica, within the
        // budget of two tokens.
        let started = std::time::Instant::now();
        let err = set
            .call_raw(method, echo_body(400), true, Duration::from_secs(2))
            .await
            .unwrap_err();
        assert!(matches!(err, RpcError::DeadlineExceeded(_)), "{err:?}");
        assert!(
            started.elapsed() >= Duration::from_millis(290),
            "{:?}",
            started.elapsed()
        );
        // The budget is spent now: the next call gets one attempt.
        let started = std::time::Instant::now();
        set.call_raw(method, echo_body(400), true, Duration::from_secs(2))
            .await
            .unwrap_err();
        assert!(
            started.elapsed() < Duration::from_millis(350),
            "budget exhausted: no retry ({:?})",
            started.elapsed()
        );
        slow.shutdown().await;
        slow2.shutdown().await;
    }
}

mod recovery {
    use std::time::Instant;

    use super::*;
    use tessera_rpc::policy::{FallbackConfig, RetryPolicyConfig};
    use tessera_rpc::{ReplicaEndpoint, ReplicaSet, ReplicaSetConfig, TransportKind};
    use tessera_test_support::proxy::FaultProxy;

    fn echo_request(delay_ms: u32) -> EchoRequest {
        EchoRequest {
            payload: Bytes::from_static(b"hello"),
            delay_ms,
            repeat: 0,
        }
    }

    #[test]
    fn the_idempotent_option_reaches_the_generated_descriptors() {
        let flags: Vec<(&str, bool)> = ECHO_DESCRIPTOR
            .methods
            .iter()
            .chain(COUNTER_DESCRIPTOR.methods)
            .map(|m| (m.name, m.idempotent))
            .collect();
        assert_eq!(
            flags,
            [("Echo", true), ("Fail", false), ("Increment", false)]
        );
    }

    /// Generated clients over a replica set: the idempotent `Echo` is
    /// retried after a timed-out attempt, the non-idempotent `Increment`
    /// only when its connection could not be made (never sent) or the call
    /// says the server deduplicates it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn generated_clients_retry_by_the_methods_idempotence() {
        let a = start(ServerConfig::default()).await;
        let b = start(ServerConfig::default()).await;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dead = listener.local_addr().unwrap().to_string();
        drop(listener);
        let set = |replicas: Vec<&str>| {
            ReplicaSet::new(
                ReplicaSetConfig {
                    replicas: replicas
                        .into_iter()
                        .map(|addr| ReplicaEndpoint {
                            addr: addr.to_owned(),
                            domain: String::new(),
                        })
                        .collect(),
                    call_timeout_ms: 2000,
                    channel: ChannelConfig {
                        connect_timeout_ms: 500,
                        request_timeout_ms: 150,
                        ..ChannelConfig::default()
                    },
                    retry: RetryPolicyConfig {
                        probability: 1.0,
                        ..RetryPolicyConfig::default()
                    },
                    seed: Some(5),
                    ..ReplicaSetConfig::default()
                },
                Transport::new(TransportConfig::default()).unwrap(),
            )
        };
        // Echo takes 400 ms on every replica; attempts time out at 150 ms.
        let echo = EchoClient::new(set(vec![&a.addr, &b.addr]));
        let started = Instant::now();
        let err = echo.echo(echo_request(400)).await.unwrap_err();
        assert!(matches!(err, RpcError::DeadlineExceeded(_)), "{err:?}");
        assert!(
            started.elapsed() >= Duration::from_millis(290),
            "idempotent: a second attempt ({:?})",
            started.elapsed()
        );
        // Increment against a dead replica and a live one: the dead one
        // refuses the connection, so the request was never sent and goes to
        // the live one whatever the method.
        let counter = CounterClient::new(set(vec![&dead, &a.addr]));
        for expected in 1..=6 {
            let value = counter.increment(IncrementRequest {}).await.unwrap().value;
            assert_eq!(value, expected, "applied exactly once per call");
        }
        // A non-idempotent method whose request the server deduplicates
        // (the caller says so): retried after a timeout like an idempotent
        // one; without the flag, one attempt only.
        static ECHO_AS_NOT_IDEMPOTENT: tessera_rpc::MethodDescriptor =
            tessera_rpc::MethodDescriptor {
                name: "Echo",
                path: "/tessera.test.v1.Echo/Echo",
                id: method_id("/tessera.test.v1.Echo/Echo"),
                service: tessera_rpc::service_tag("tessera.test.v1.Echo"),
                idempotent: false,
            };
        let slow_set = set(vec![&a.addr, &b.addr]);
        let body = || {
            tessera_transport::Message::from(Bytes::from(prost::Message::encode_to_vec(
                &echo_request(400),
            )))
        };
        for (options, at_least, below) in [
            (
                CallOptions::default(),
                Duration::ZERO,
                Duration::from_millis(290),
            ),
            (
                CallOptions::default().deduplicated(),
                Duration::from_millis(290),
                Duration::from_secs(2),
            ),
        ] {
            let started = Instant::now();
            let err = slow_set
                .unary_message::<EchoResponse>(&ECHO_AS_NOT_IDEMPOTENT, body(), &options)
                .await
                .unwrap_err();
            assert!(matches!(err, RpcError::DeadlineExceeded(_)), "{err:?}");
            let took = started.elapsed();
            assert!(
                took >= at_least && took < below,
                "deduplicated = {}: {took:?}",
                options.deduplicated
            );
        }
        a.shutdown().await;
        b.shutdown().await;
    }

    /// Runs `ip link set NETDEV STATE` (the Soft-RoCE VM's drill).
    fn set_link(netdev: &str, state: &str) {
        let status = std::process::Command::new("ip")
            .args(["link", "set", netdev, state])
            .status()
            .expect("run ip");
        assert!(status.success(), "ip link set {netdev} {state}: {status}");
    }

    /// The port drill on a real provider (issue 32, item 4): the netdev
    /// under the RDMA device goes down for 3 s under a stream of calls.
    /// The port error arrives as the device's async event, calls move to
    /// TCP within 1 s with none failed (an attempt on the broken path is
    /// retried), and come back to RDMA once the port is back (the next
    /// probe). Runs where the suite runs over ibverbs and names the netdev
    /// it may take down (`TESSERA_TEST_RDMA_NETDEV`, set by `scripts/dev
    /// vm-test` inside the VM: root, and no other traffic on it); the
    /// soft NIC's port drill is `a_port_going_down_fails_its_connections_at_once`
    /// and netns drill 3.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn when_the_rdma_port_goes_down_calls_move_to_tcp_and_back() {
        let Ok(netdev) = std::env::var("TESSERA_TEST_RDMA_NETDEV") else {
            eprintln!(
                "SKIPPED port-down drill: TESSERA_TEST_RDMA_NETDEV names no netdev to take down \
                 (scripts/dev vm-test sets it in the Soft-RoCE VM)"
            );
            return;
        };
        if !tessera_test_support::rdma::is_ibverbs() {
            eprintln!("SKIPPED port-down drill: the suite runs over the soft NIC, not ibverbs");
            return;
        }
        let server = start(server_config(&tessera_test_support::rdma::transport())).await;
        let probe = Duration::from_millis(500);
        let client = Transport::new(tessera_test_support::rdma::transport()).unwrap();
        let set = drill_set(
            &server.addr,
            probe,
            tessera_test_support::rdma::transport(),
            1,
            &client,
        );
        let echo = EchoClient::new(set.clone());
        let kind = || set.transports()[0].1;
        echo.echo(echo_request(0)).await.unwrap();
        assert_eq!(kind(), Some(TransportKind::Rdma));
        let (mut calls, mut failed) = (0u32, Vec::new());
        let mut call = async || {
            calls += 1;
            if let Err(err) = echo.echo(echo_request(0)).await {
                failed.push(err.to_string());
            }
        };
        // Down for 3 s under the calls.
        set_link(&netdev, "down");
        let down = Instant::now();
        let mut on_tcp = None;
        while down.elapsed() < Duration::from_secs(3) {
            call().await;
            if on_tcp.is_none() && kind() == Some(TransportKind::Tcp) {
                on_tcp = Some(down.elapsed());
            }
        }
        set_link(&netdev, "up");
        let up = Instant::now();
        let mut back = None;
        while up.elapsed() < Duration::from_secs(10) {
            call().await;
            if kind() == Some(TransportKind::Rdma) {
                back = Some(up.elapsed());
                break;
            }
        }
        // And stays there.
        for _ in 0..20 {
            call().await;
        }
        let events = client.rdma_stats().map_or(0, |s| s.async_events);
        eprintln!(
            "port-down drill ({netdev}, ibverbs): on TCP {on_tcp:?} after the port went down, \
             back on RDMA {back:?} after it came up (probe {probe:?}); {calls} calls, {} failed; \
             {events} device events",
            failed.len()
        );
        assert!(failed.is_empty(), "{failed:?}");
        let on_tcp = on_tcp.expect("calls moved to TCP while the port was down");
        assert!(
            on_tcp < Duration::from_secs(1),
            "on TCP only {on_tcp:?} after"
        );
        assert!(events >= 1, "the port error came as a device event");
        let back = back.expect("calls came back to RDMA after the port did");
        assert!(back <= probe * 3, "back on RDMA only {back:?} after");
        assert_eq!(kind(), Some(TransportKind::Rdma));
        server.shutdown().await;
    }

    fn rdma_channel(addr: &str, probe_interval_ms: u64) -> Channel {
        Channel::lazy(
            addr,
            ChannelConfig {
                connect_timeout_ms: 500,
                request_timeout_ms: 2000,
                fallback: FallbackConfig {
                    probe_interval_ms,
                    ..FallbackConfig::default()
                },
                transport: tessera_test_support::rdma::transport(),
                connections: 1,
            },
        )
        .unwrap()
    }

    /// The replica set of the port and rails drills: one server, calls
    /// retried on another attempt whatever the failure (probability 1),
    /// short connect and request timeouts, a TCP fallback probe every
    /// `probe`, over `transport` with `connections` links.
    fn drill_set(
        addr: &str,
        probe: Duration,
        transport: TransportConfig,
        connections: usize,
        client: &Transport,
    ) -> ReplicaSet {
        ReplicaSet::new(
            ReplicaSetConfig {
                replicas: vec![ReplicaEndpoint {
                    addr: addr.to_owned(),
                    domain: String::new(),
                }],
                call_timeout_ms: 3000,
                channel: ChannelConfig {
                    connect_timeout_ms: 500,
                    request_timeout_ms: 1000,
                    fallback: FallbackConfig {
                        probe_interval_ms: probe.as_millis() as u64,
                        ..FallbackConfig::default()
                    },
                    transport,
                    connections,
                },
                retry: RetryPolicyConfig {
                    probability: 1.0,
                    ..RetryPolicyConfig::default()
                },
                seed: Some(7),
                ..ReplicaSetConfig::default()
            },
            client.clone(),
        )
    }

    /// How a rails drill takes a rail's port down: the soft NIC's port
    /// files (the server's devices), or the netdevs under the Soft-RoCE
    /// devices (`ip link`, both processes' rails at once).
    enum RailSwitch {
        Files(Vec<std::path::PathBuf>),
        Netdevs(Vec<String>),
    }

    impl RailSwitch {
        fn set(&self, rail: usize, down: bool) {
            match self {
                RailSwitch::Files(files) if down => std::fs::write(&files[rail], b"").unwrap(),
                RailSwitch::Files(files) => {
                    let _ = std::fs::remove_file(&files[rail]);
                }
                RailSwitch::Netdevs(netdevs) => {
                    set_link(&netdevs[rail], if down { "down" } else { "up" });
                }
            }
        }
    }

    impl Drop for RailSwitch {
        /// Every rail back up, whatever became of the drill.
        fn drop(&mut self) {
            for rail in 0..2 {
                self.set(rail, false);
            }
        }
    }

    /// Rails before TCP: client and server have two rails each; the first
    /// rail's port goes down for a second under a stream of calls. No
    /// call fails and none goes over TCP: the lost connection is made
    /// again over the second rail. Then every rail goes down, and calls
    /// move to TCP, still with none failed. On the soft NIC the server's
    /// rails go down (port files); over ibverbs (the Soft-RoCE VM: `rxe0`
    /// and `rxe1` on `d0` and `d1`, named by `TESSERA_TEST_RDMA_RAILS` and
    /// `TESSERA_TEST_RDMA_RAIL_NETDEVS`) the netdevs do, under both.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rail_going_down_moves_rdma_calls_to_the_other_rail_not_to_tcp() {
        use tessera_transport::SoftRail;
        let dir = tempfile::tempdir().unwrap();
        let (server_transport, client_transport, switch) = if tessera_test_support::rdma::is_ibverbs(
        ) {
            let rails = match tessera_test_support::rdma::config_rails(2) {
                Ok(rails) => rails,
                Err(why) => {
                    eprintln!("SKIPPED rails drill: {why}");
                    return;
                }
            };
            let netdevs: Vec<String> = std::env::var("TESSERA_TEST_RDMA_RAIL_NETDEVS")
                .unwrap_or_default()
                .split(',')
                .filter(|n| !n.is_empty())
                .map(str::to_owned)
                .collect();
            if netdevs.len() < 2 {
                eprintln!(
                    "SKIPPED rails drill: TESSERA_TEST_RDMA_RAIL_NETDEVS names no two netdevs to take down \
                         (scripts/dev vm-test sets it in the Soft-RoCE VM)"
                );
                return;
            }
            let config = TransportConfig {
                rdma: rails,
                ..tessera_test_support::rdma::transport()
            };
            (config.clone(), config, RailSwitch::Netdevs(netdevs))
        } else {
            let files = vec![dir.path().join("rail0"), dir.path().join("rail1")];
            let mut server = TransportConfig::soft_rdma();
            server.rdma.soft_rails = files
                .iter()
                .map(|file| SoftRail {
                    port_file: Some(file.clone()),
                    ..SoftRail::default()
                })
                .collect();
            let mut client = TransportConfig::soft_rdma();
            client.rdma.soft_rails = vec![SoftRail::default(), SoftRail::default()];
            (server, client, RailSwitch::Files(files))
        };
        let server = start(server_config(&server_transport)).await;
        let client = Transport::new(client_transport.clone()).unwrap();
        // Two links, one a rail at first; after the return the displaced
        // one dials again onto the first rail.
        let set = drill_set(
            &server.addr,
            Duration::from_millis(500),
            client_transport,
            2,
            &client,
        );
        let echo = EchoClient::new(set.clone());
        let kind = || set.transports()[0].1;
        echo.echo(echo_request(0)).await.unwrap();
        assert_eq!(kind(), Some(TransportKind::Rdma));
        let (mut calls, mut failed, mut on_tcp) = (0u32, Vec::<String>::new(), 0u32);
        let call = || async {
            echo.echo(echo_request(0))
                .await
                .err()
                .map(|e| e.to_string())
        };
        macro_rules! call {
            () => {{
                let over = kind();
                calls += 1;
                failed.extend(call().await);
                on_tcp += u32::from(over == Some(TransportKind::Tcp));
            }};
        }
        // The first rail down for a second.
        switch.set(0, true);
        let down = Instant::now();
        while down.elapsed() < Duration::from_secs(1) {
            call!();
        }
        let rails = client.rail_stats();
        assert!(
            rails[1].messages_sent > 0,
            "the second rail carried the calls: {rails:?}"
        );
        // Back up: the link that moved comes back to the first rail within
        // 2 s (it dials again after 1 s; a rail the peer refused is tried
        // last for 500 ms).
        let first_before = client.rail_stats()[0].messages_sent;
        switch.set(0, false);
        let up = Instant::now();
        while client.rail_stats()[0].messages_sent == first_before {
            assert!(
                up.elapsed() < Duration::from_secs(5),
                "no call on the first rail 5 s after its return: {:?}",
                client.rail_stats()
            );
            call!();
        }
        let back = up.elapsed();
        assert!(failed.is_empty(), "{failed:?}");
        assert_eq!(on_tcp, 0, "{calls} calls, {on_tcp} of them over TCP");
        assert_eq!(kind(), Some(TransportKind::Rdma));
        assert!(
            back < Duration::from_secs(2),
            "the first rail in use again only {back:?} after its return"
        );
        let one_down = calls;
        // Every rail down: TCP, and still nothing failed.
        switch.set(0, true);
        switch.set(1, true);
        let all_down = Instant::now();
        while all_down.elapsed() < Duration::from_secs(2) && kind() != Some(TransportKind::Tcp) {
            call!();
        }
        let on_tcp_after = all_down.elapsed();
        for _ in 0..20 {
            call!();
        }
        switch.set(0, false);
        switch.set(1, false);
        assert_eq!(kind(), Some(TransportKind::Tcp), "every rail down: TCP");
        assert!(failed.is_empty(), "{failed:?}");
        eprintln!(
            "rails drill ({}): one rail down 1 s: {one_down} calls, none failed, none over TCP, \
             the first rail in use again {back:?} after its return; \
             every rail down: on TCP after {on_tcp_after:?}; {calls} calls in all ({on_tcp} over TCP), \
             none failed",
            tessera_test_support::rdma::provider_name()
        );
        server.shutdown().await;
    }

    /// The recovery ladder's transport rungs: an RDMA path to a healthy
    /// server breaks (its control stream is reset and new RDMA handshakes
    /// are turned away, TCP still passes): calls succeed over TCP within
    /// 1 s; once RDMA works again, a probe moves the channel back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_broken_rdma_path_falls_back_to_tcp_and_returns() {
        let server = start(server_config(&tessera_test_support::rdma::transport())).await;
        let proxy = FaultProxy::start(server.addr.clone()).await;
        let probe = Duration::from_millis(300);
        let channel = rdma_channel(&proxy.addr, probe.as_millis() as u64);
        let echo = EchoClient::new(channel.clone());
        let call = |timeout_ms| {
            let echo = echo.clone();
            async move {
                echo.echo_with_options(
                    echo_request(0),
                    &CallOptions::with_timeout(Duration::from_millis(timeout_ms)),
                )
                .await
            }
        };
        call(5000).await.unwrap();
        assert_eq!(channel.current_transport(), Some(TransportKind::Rdma));

        // Break the RDMA path.
        proxy.refuse_rdma(true);
        let broken = Instant::now();
        proxy.reset_all();
        // The reset lands asynchronously: a call made before the channel
        // sees its connection end could still be answered over RDMA.
        while channel.current_transport() == Some(TransportKind::Rdma) {
            assert!(broken.elapsed() < Duration::from_secs(5), "reset not seen");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let mut failed = 0;
        loop {
            match call(300).await {
                Ok(_) => break,
                Err(_) => failed += 1,
            }
            assert!(
                broken.elapsed() < Duration::from_secs(5),
                "no call succeeded after the RDMA path broke"
            );
        }
        let fallback = broken.elapsed();
        assert_eq!(channel.current_transport(), Some(TransportKind::Tcp));
        assert!(proxy.refused() >= 1, "an RDMA reconnect was tried first");
        assert!(
            fallback < Duration::from_secs(1),
            "calls succeed over TCP within 1 s: {fallback:?} ({failed} failed calls)"
        );
        // Stays on TCP while RDMA is broken: probes fail.
        let until = Instant::now() + probe * 2;
        while Instant::now() < until {
            call(2000).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(channel.current_transport(), Some(TransportKind::Tcp));

        // RDMA works again: traffic returns within the probe interval.
        proxy.refuse_rdma(false);
        let repaired = Instant::now();
        while channel.current_transport() != Some(TransportKind::Rdma) {
            call(2000).await.unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
            assert!(
                repaired.elapsed() < probe * 4,
                "no return to RDMA after {:?}",
                repaired.elapsed()
            );
        }
        let returned = repaired.elapsed();
        assert!(
            returned <= probe + Duration::from_millis(500),
            "{returned:?}"
        );
        call(2000).await.unwrap();
        server.shutdown().await;
    }

    /// Delays on the path (the proxy holds every chunk) show as attempt
    /// timeouts, and a replica set moves the call to the other replica.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_path_to_one_replica_is_absorbed_by_another() {
        let a = start(ServerConfig::default()).await;
        let b = start(ServerConfig::default()).await;
        let slow = FaultProxy::start(a.addr.clone()).await;
        let set = ReplicaSet::new(
            ReplicaSetConfig {
                replicas: vec![
                    ReplicaEndpoint {
                        addr: slow.addr.clone(),
                        domain: "near".into(),
                    },
                    ReplicaEndpoint {
                        addr: b.addr.clone(),
                        domain: "far".into(),
                    },
                ],
                local_domain: "near".into(),
                call_timeout_ms: 3000,
                channel: ChannelConfig {
                    connect_timeout_ms: 500,
                    request_timeout_ms: 200,
                    ..ChannelConfig::default()
                },
                retry: RetryPolicyConfig {
                    probability: 1.0,
                    ..RetryPolicyConfig::default()
                },
                seed: Some(3),
                ..ReplicaSetConfig::default()
            },
            Transport::new(TransportConfig::default()).unwrap(),
        );
        let echo = EchoClient::new(set);
        echo.echo(echo_request(0)).await.unwrap();
        slow.delay(Duration::from_millis(500));
        for _ in 0..5 {
            let started = Instant::now();
            echo.echo(echo_request(0)).await.unwrap();
            assert!(started.elapsed() < Duration::from_millis(1500));
        }
        a.shutdown().await;
        b.shutdown().await;
    }
}
