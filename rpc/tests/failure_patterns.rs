//! The failure-pattern suite of the recovery policies (issue 14): one
//! test per pattern a fleet sees — rolling restarts, resets with many calls
//! in flight, oversized messages, expired requests, a restart that must
//! not move a destination to TCP, dials that outlive their caller's
//! deadline — each of which failed before its fix. The sans-IO policies'
//! own patterns are unit tests next to them (`rpc/src/policy/`, named
//! `failure_pattern_*`); method ids are in `method_ids.rs`, the gRPC
//! endpoint's limits in `ps-server/tests/grpc_endpoint.rs`. The cases
//! taking a transport run over TCP and over RDMA with the soft provider.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use tessera_rpc::{CallOptions, Channel, ChannelConfig, Code, RpcError, ServerConfig};
use tessera_rpc::{Transport, TransportConfig};
use tessera_test_support::wait::eventually;

#[macro_use]
mod common;
use common::*;

/// Failure pattern 2, server side: a response over the server's message
/// limit was only logged, and the caller waited for its whole deadline;
/// now it hears `ResourceExhausted` at once, and the connection stays
/// usable.
async fn failure_pattern_an_oversized_response_is_answered_resource_exhausted(t: TransportConfig) {
    let server = start(ServerConfig {
        transport: TransportConfig {
            max_message_size: 1 << 20,
            ..t.clone()
        },
        ..ServerConfig::default()
    })
    .await;
    let echo = EchoClient::new(
        Channel::connect(&server.addr, channel_config(&t))
            .await
            .unwrap(),
    );
    let started = std::time::Instant::now();
    let err = echo
        .echo_with_options(
            EchoRequest {
                payload: Bytes::from(vec![7u8; 600 << 10]),
                delay_ms: 0,
                repeat: 2,
            },
            &CallOptions::with_timeout(Duration::from_secs(20)),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "answered, not left to the deadline: {:?}",
        started.elapsed()
    );
    let fine = echo
        .echo(EchoRequest {
            payload: Bytes::from_static(b"ok"),
            delay_ms: 0,
            repeat: 2,
        })
        .await
        .unwrap();
    assert_eq!(&fine.payload[..], b"okok");
    server.shutdown().await;
}

/// Failure pattern 10 (deadlines): a call with nothing left of its
/// deadline was sent anyway (as 1 µs), and the server ran a handler whose
/// deadline had passed before it checked it, so a non-idempotent call was
/// applied although its caller was told it failed. Neither happens now.
async fn failure_pattern_expired_requests_are_never_applied(t: TransportConfig) {
    let server = start(server_config(&t)).await;
    let channel = Channel::connect(&server.addr, channel_config(&t))
        .await
        .unwrap();
    let counter = CounterClient::new(channel.clone());
    let err = counter
        .increment_with_options(
            IncrementRequest {},
            &CallOptions::with_timeout(Duration::ZERO),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    let body = tessera_transport::Message::from(Bytes::from(prost::Message::encode_to_vec(
        &IncrementRequest {},
    )));
    for _ in 0..20 {
        let deadline = std::time::Instant::now() + Duration::from_micros(1);
        let err = channel
            .call_raw(
                COUNTER_DESCRIPTOR.methods[0].id,
                body.clone(),
                deadline,
                Duration::from_micros(1),
            )
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    }
    let value = counter.increment(IncrementRequest {}).await.unwrap().value;
    assert_eq!(value, 1, "no expired increment was applied");
    server.shutdown().await;
}

/// Failure pattern 1 (rolling restart): on stop the server stopped reading
/// while its handlers kept the connection open, so every call sent then
/// hung until its deadline. Now a call in flight is answered, and new
/// calls hear at once that the server is going away (`Unavailable`, never
/// applied) or find it gone.
async fn failure_pattern_a_stopping_server_answers_at_once(t: TransportConfig) {
    let mut server = start(server_config(&t)).await;
    let channel = Channel::connect(&server.addr, channel_config(&t))
        .await
        .unwrap();
    let echo = EchoClient::new(channel.clone());
    let slow = tokio::spawn({
        let echo = echo.clone();
        async move {
            echo.echo(EchoRequest {
                payload: Bytes::from_static(b"slow"),
                delay_ms: 400,
                repeat: 0,
            })
            .await
        }
    });
    // The slow call is in its handler when the stop comes.
    server.wait_echo_started(1).await;
    let _ = server.stop.take().unwrap().send(());
    for _ in 0..5 {
        let started = std::time::Instant::now();
        let outcome = echo
            .echo_with_options(
                EchoRequest {
                    payload: Bytes::from_static(b"new"),
                    delay_ms: 0,
                    repeat: 0,
                },
                &CallOptions::with_timeout(Duration::from_secs(3)),
            )
            .await;
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(1),
            "a call to a stopping server took {took:?}: {outcome:?}"
        );
        if let Err(err) = outcome {
            assert_eq!(err.code(), Code::Unavailable, "{err:?}");
        }
    }
    assert_eq!(&slow.await.unwrap().unwrap().payload[..], b"slow");
    server.task.await.unwrap();
}

/// Failure pattern 13 (issue 33: a graceful rolling restart under a
/// ranker failed 3-12 requests in 6,300): a burst of calls refused by a
/// stopping server, or whose dial found its listener gone, each needed a
/// retry token (ten at most) and a retry coin, and the calls beyond them
/// failed. Now an attempt that did no work goes to a replica not tried yet
/// at once, outside coin, budget and attempt count: here a policy that
/// never retries and an empty budget lose no call of 32 concurrent callers
/// (non-idempotent ones) while a replica stops, stays away and comes back.
async fn failure_pattern_a_work_free_failure_costs_no_call_whatever_the_budget(t: TransportConfig) {
    use tessera_rpc::{ReplicaEndpoint, ReplicaSet, ReplicaSetConfig};
    let mut a = start(server_config(&t)).await;
    let b = start(server_config(&t)).await;
    let a_addr = a.addr.clone();
    let set = ReplicaSet::new(
        ReplicaSetConfig {
            replicas: [&a.addr, &b.addr]
                .into_iter()
                .map(|addr| ReplicaEndpoint {
                    addr: addr.clone(),
                    domain: String::new(),
                })
                .collect(),
            channel: ChannelConfig {
                request_timeout_ms: 2000,
                ..channel_config(&t)
            },
            seed: Some(13),
            ..never_retrying()
        },
        Transport::new(t.clone()).unwrap(),
    );
    let method = COUNTER_DESCRIPTOR.methods[0].id;
    let body = tessera_transport::Message::from(Bytes::from(prost::Message::encode_to_vec(
        &IncrementRequest {},
    )));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let calls = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut loops = Vec::new();
    for _ in 0..32 {
        let (set, body, stop, calls) = (
            set.clone(),
            body.clone(),
            Arc::clone(&stop),
            Arc::clone(&calls),
        );
        loops.push(tokio::spawn(async move {
            let (mut ok, mut failed) = (0u32, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                match set
                    .call_raw(method, body.clone(), false, Duration::from_secs(4))
                    .await
                {
                    Ok(_) => ok += 1,
                    Err(err) => failed.push(err.to_string()),
                }
                calls.fetch_add(1, Ordering::Relaxed);
            }
            (ok, failed)
        }));
    }
    // Each phase lasts until the callers made 200 more calls (a signal,
    // not a guess of how long that takes on a loaded host).
    let after_more_calls = |n: u64| {
        let calls = Arc::clone(&calls);
        async move {
            let target = calls.load(Ordering::Relaxed) + n;
            while calls.load(Ordering::Relaxed) < target {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    after_more_calls(200).await;
    let _ = a.stop.take().unwrap().send(());
    a.task.await.unwrap();
    after_more_calls(200).await;
    let a = start_at(server_config(&t), &a_addr).await;
    after_more_calls(200).await;
    stop.store(true, Ordering::Relaxed);
    let (mut ok, mut failed) = (0, Vec::new());
    for l in loops {
        let (o, f) = l.await.unwrap();
        ok += o;
        failed.extend(f);
    }
    assert!(ok >= 600, "{ok} calls");
    assert!(
        failed.is_empty(),
        "{} of {} failed: {:?}",
        failed.len(),
        ok as usize + failed.len(),
        failed.first()
    );
    a.shutdown().await;
    b.shutdown().await;
}

over_both_transports!(
    failure_pattern_an_oversized_response_is_answered_resource_exhausted,
    failure_pattern_expired_requests_are_never_applied,
    failure_pattern_a_stopping_server_answers_at_once,
    failure_pattern_a_work_free_failure_costs_no_call_whatever_the_budget,
    failure_pattern_a_drained_connection_ends_with_a_notice_after_its_answers,
    failure_pattern_a_call_waiting_on_a_drained_connection_goes_elsewhere,
);

/// Failure pattern 7: refused dials while a server restarts counted as
/// RDMA failures, so a rolling restart moved a healthy destination to TCP
/// for at least a probe interval. Now a refused connection (or a clean
/// close) says nothing against the RDMA path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_pattern_a_restarting_server_does_not_move_its_destination_to_tcp() {
    let t = tessera_test_support::rdma::transport();
    let server = start(server_config(&t)).await;
    let addr = server.addr.clone();
    let channel = Channel::connect(&addr, channel_config(&t)).await.unwrap();
    let echo = EchoClient::new(channel.clone());
    let call = || {
        echo.echo(EchoRequest {
            payload: Bytes::from_static(b"x"),
            delay_ms: 0,
            repeat: 0,
        })
    };
    call().await.unwrap();
    assert_eq!(
        channel.current_transport(),
        Some(tessera_rpc::TransportKind::Rdma)
    );
    server.shutdown().await;
    // The server is down (restarting): its connection closed cleanly, and
    // every dial now is refused.
    for _ in 0..6 {
        let err = call().await.unwrap_err();
        assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    }
    assert!(
        !channel.fallen_back(),
        "a restarting server moved the destination to TCP"
    );
}

/// Failure pattern 10 (the connect lock): a call waiting for another's
/// dial waited for that dial's whole connection timeout, past its own
/// deadline. Over rdma-soft: the peer accepts the TCP control connection
/// and never answers the handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_pattern_waiting_for_a_dial_ends_at_the_callers_deadline() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (dialled_tx, mut dialled) = tokio::sync::mpsc::unbounded_channel();
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
            let _ = dialled_tx.send(());
        }
    });
    let t = tessera_test_support::rdma::transport();
    let channel = Channel::lazy(
        addr,
        ChannelConfig {
            connect_timeout_ms: 3000,
            request_timeout_ms: 5000,
            transport: t,
            ..ChannelConfig::default()
        },
    )
    .unwrap();
    let echo = EchoClient::new(channel.clone());
    let first = tokio::spawn({
        let echo = echo.clone();
        async move {
            echo.echo_with_options(
                EchoRequest {
                    payload: Bytes::new(),
                    delay_ms: 0,
                    repeat: 0,
                },
                &CallOptions::with_timeout(Duration::from_secs(4)),
            )
            .await
        }
    });
    // The first call holds the dial (the peer has its connection).
    dialled.recv().await.unwrap();
    let started = std::time::Instant::now();
    let err = echo
        .echo_with_options(
            EchoRequest {
                payload: Bytes::new(),
                delay_ms: 0,
                repeat: 0,
            },
            &CallOptions::with_timeout(Duration::from_millis(200)),
        )
        .await
        .unwrap_err();
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_millis(1500),
        "waited {waited:?} for another call's dial ({err:?})"
    );
    assert!(first.await.unwrap().is_err());
    hold.abort();
}

/// A dial cut short by its caller's deadline says nothing about the peer:
/// the calls that waited for it dial again on their own time. Before, the
/// cut-short dial was recorded as the connection's failure and every call
/// waiting for it failed with it at once, however much time it had left
/// (in the Soft-RoCE VM a loaded ranker failed a third of its requests with
/// another call's "timed out after 0ns": a call that got the connect lock
/// at the end of its deadline). The peer here accepts the TCP control
/// connection and never answers the handshake, so every dial hangs: the
/// first call's to its connection timeout (a real failure, shared), the
/// second's to its own deadline, and the third call, queued behind both,
/// must not inherit the second's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_pattern_a_dial_cut_short_by_its_callers_deadline_is_not_shared() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (dialled_tx, mut dialled) = tokio::sync::mpsc::unbounded_channel();
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
            let _ = dialled_tx.send(());
        }
    });
    let connect_timeout = Duration::from_millis(400);
    let channel = Channel::lazy(
        addr,
        ChannelConfig {
            connect_timeout_ms: connect_timeout.as_millis() as u64,
            request_timeout_ms: 5000,
            transport: tessera_test_support::rdma::transport(),
            ..ChannelConfig::default()
        },
    )
    .unwrap();
    let echo = EchoClient::new(channel.clone());
    let call = |timeout: Duration| {
        let echo = echo.clone();
        async move {
            let started = std::time::Instant::now();
            let outcome = echo
                .echo_with_options(
                    EchoRequest {
                        payload: Bytes::new(),
                        delay_ms: 0,
                        repeat: 0,
                    },
                    &CallOptions::with_timeout(timeout),
                )
                .await;
            (outcome, started.elapsed())
        }
    };
    // The first call dials (the peer has its connection) until its
    // connection timeout.
    let first = tokio::spawn(call(Duration::from_secs(4)));
    dialled.recv().await.unwrap();
    // The second queues for the lock and gets it 100 ms before its
    // deadline: its dial is cut short.
    let second = tokio::spawn(call(connect_timeout + Duration::from_millis(100)));
    // The third queues behind it (the lock is fair). Were the order the
    // other way round, the third would dial before the second and pass
    // without showing anything: it starts once the second is queued.
    eventually(
        Duration::from_secs(5),
        "the second call is queued behind the first's dial",
        || async {
            match channel.dial_waiters() {
                1 => Ok(()),
                n => Err(n),
            }
        },
    )
    .await;
    let third = tokio::spawn(call(Duration::from_millis(1500)));
    assert!(first.await.unwrap().0.is_err());
    assert!(second.await.unwrap().0.is_err());
    let (outcome, waited) = third.await.unwrap();
    let err = outcome.unwrap_err();
    // It dialled on its own time (then, its RDMA dial timed out, the
    // fallback ladder took it to TCP, where the silent peer let its
    // deadline pass), instead of failing with the second call's dial.
    assert!(
        !matches!(err, RpcError::Connect { .. }) && waited >= connect_timeout,
        "{err:?} after {waited:?}"
    );
    hold.abort();
}

mod replica_set {
    use super::*;
    use tessera_rpc::policy::QuarantineConfig;
    use tessera_rpc::{ReplicaEndpoint, ReplicaSet, ReplicaSetConfig};

    /// Failure pattern 2, client side: a request over the message limit
    /// was classified as a connection failure, tried on every replica and
    /// put each in backoff (and towards quarantine); now it fails at once,
    /// as the request's fault.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn failure_pattern_an_oversized_request_is_final_and_nobodys_fault() {
        let a = start(ServerConfig::default()).await;
        let b = start(ServerConfig::default()).await;
        let set = ReplicaSet::new(
            replica_config(vec![
                ReplicaEndpoint {
                    addr: a.addr.clone(),
                    domain: "zone-a".into(),
                },
                ReplicaEndpoint {
                    addr: b.addr.clone(),
                    domain: "zone-a".into(),
                },
            ]),
            Transport::new(TransportConfig {
                max_message_size: 64 << 10,
                ..TransportConfig::default()
            })
            .unwrap(),
        );
        let method = ECHO_DESCRIPTOR.methods[0].id;
        let big = EchoRequest {
            payload: Bytes::from(vec![1u8; 100 << 10]),
            delay_ms: 0,
            repeat: 0,
        };
        let body =
            tessera_transport::Message::from(Bytes::from(prost::Message::encode_to_vec(&big)));
        for _ in 0..5 {
            let err = set
                .call_raw(method, body.clone(), true, Duration::from_secs(2))
                .await
                .unwrap_err();
            assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
            assert!(matches!(err, RpcError::MessageTooLarge { .. }), "{err:?}");
        }
        assert!(set.quarantined().is_empty(), "{:?}", set.quarantined());
        assert_eq!(set.outstanding(), vec![0, 0]);
        // Both replicas still serve at once: neither is backing off (a
        // call with a deadline shorter than the first backoff succeeds on
        // either).
        for _ in 0..10 {
            set.call_raw(method, echo_body(0), true, Duration::from_millis(200))
                .await
                .unwrap();
        }
        a.shutdown().await;
        b.shutdown().await;
    }

    /// Failure pattern 1 through a replica set: a non-idempotent call
    /// (Counter.Increment) keeps succeeding while one of two replicas
    /// stops gracefully under load — refused calls go to the other.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn failure_pattern_no_call_fails_while_a_replica_restarts() {
        let mut a = start(ServerConfig::default()).await;
        let b = start(ServerConfig::default()).await;
        let set = ReplicaSet::new(
            ReplicaSetConfig {
                channel: ChannelConfig {
                    connect_timeout_ms: 1000,
                    request_timeout_ms: 2000,
                    ..ChannelConfig::default()
                },
                ..replica_config(vec![
                    ReplicaEndpoint {
                        addr: a.addr.clone(),
                        domain: "zone-a".into(),
                    },
                    ReplicaEndpoint {
                        addr: b.addr.clone(),
                        domain: "zone-a".into(),
                    },
                ])
            },
            Transport::new(TransportConfig::default()).unwrap(),
        );
        let method = COUNTER_DESCRIPTOR.methods[0].id;
        let body = tessera_transport::Message::from(Bytes::from(prost::Message::encode_to_vec(
            &IncrementRequest {},
        )));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let succeeded = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut loops = Vec::new();
        for _ in 0..4 {
            let (set, body, stop, succeeded) = (
                set.clone(),
                body.clone(),
                Arc::clone(&stop),
                Arc::clone(&succeeded),
            );
            loops.push(tokio::spawn(async move {
                let (mut ok, mut failed, mut slowest) = (0u32, Vec::new(), Duration::ZERO);
                while !stop.load(Ordering::Relaxed) {
                    let started = std::time::Instant::now();
                    match set
                        .call_raw(method, body.clone(), false, Duration::from_secs(4))
                        .await
                    {
                        Ok(_) => {
                            ok += 1;
                            succeeded.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(err) => failed.push(err.to_string()),
                    }
                    slowest = slowest.max(started.elapsed());
                }
                (ok, failed, slowest)
            }));
        }
        // Each phase lasts until the callers succeeded 200 more times (a
        // signal, not a guess of how long that takes on a loaded host).
        let after_more_calls = |n: u64| {
            let succeeded = Arc::clone(&succeeded);
            async move {
                let target = succeeded.load(Ordering::Relaxed) + n;
                eventually(
                    Duration::from_secs(30),
                    &format!("{n} more successful calls"),
                    || async {
                        let now = succeeded.load(Ordering::Relaxed);
                        if now >= target { Ok(()) } else { Err(now) }
                    },
                )
                .await;
            }
        };
        // Load flows through both replicas before a stops...
        after_more_calls(200).await;
        let _ = a.stop.take().unwrap().send(());
        a.task.await.unwrap();
        // ...and goes on, all on b, after it stopped.
        after_more_calls(200).await;
        stop.store(true, Ordering::Relaxed);
        let (mut ok, mut failed, mut slowest) = (0, Vec::new(), Duration::ZERO);
        for l in loops {
            let (o, f, s) = l.await.unwrap();
            ok += o;
            failed.extend(f);
            slowest = slowest.max(s);
        }
        assert!(ok > 100, "{ok} calls");
        assert!(
            failed.is_empty(),
            "{} failed: {:?}",
            failed.len(),
            failed.first()
        );
        assert!(
            slowest < Duration::from_secs(1),
            "the slowest call took {slowest:?}"
        );
        b.shutdown().await;
    }

    /// Failure pattern 3: one connection reset with many calls in flight
    /// counted one failure per call (51 in flight ejected a healthy node);
    /// now the calls that failed with the same broken connection count
    /// once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn failure_pattern_one_reset_is_one_failure_however_many_calls_were_in_flight() {
        let a = start(ServerConfig {
            shutdown_grace_ms: 50,
            ..ServerConfig::default()
        })
        .await;
        let b = start(ServerConfig::default()).await;
        let set = ReplicaSet::new(
            ReplicaSetConfig {
                quarantine: QuarantineConfig {
                    max_request_failures: 3,
                    max_connect_failures: 3,
                    ..QuarantineConfig::default()
                },
                channel: ChannelConfig {
                    connect_timeout_ms: 1000,
                    request_timeout_ms: 20_000,
                    ..ChannelConfig::default()
                },
                ..replica_config(vec![
                    // All calls go to a (the caller's domain).
                    ReplicaEndpoint {
                        addr: a.addr.clone(),
                        domain: "zone-a".into(),
                    },
                    ReplicaEndpoint {
                        addr: b.addr.clone(),
                        domain: "zone-b".into(),
                    },
                ])
            },
            Transport::new(TransportConfig::default()).unwrap(),
        );
        let method = ECHO_DESCRIPTOR.methods[0].id;
        // Connected first, then 20 slow calls in flight on that connection.
        set.call_raw(method, echo_body(0), false, Duration::from_secs(2))
            .await
            .unwrap();
        let calls: Vec<_> = (0..20)
            .map(|_| {
                let set = set.clone();
                tokio::spawn(async move {
                    set.call_raw(method, echo_body(10_000), false, Duration::from_secs(20))
                        .await
                })
            })
            .collect();
        // Until a's handler has all 20 (counted at the client, an attempt
        // may not be on the wire yet: one the connection's end then finds
        // unsent is rightly retried on b, and succeeds).
        eventually(
            Duration::from_secs(10),
            "a's handler running all 20 slow calls (and the first)",
            || async {
                if a.echo_started.load(Ordering::SeqCst) >= 21 {
                    Ok(())
                } else {
                    Err(set.outstanding())
                }
            },
        )
        .await;
        // a goes away with the calls in flight: its connection breaks.
        a.shutdown().await;
        for call in calls {
            let err = call.await.unwrap().unwrap_err();
            assert!(matches!(err, RpcError::ConnectionLost { .. }), "{err:?}");
        }
        assert!(
            set.quarantined().is_empty(),
            "one broken connection ejected the node: {:?}",
            set.quarantined()
        );
        assert_eq!(set.outstanding(), vec![0, 0]);
        b.shutdown().await;
    }

    /// Failure pattern 6: a call dropped by its caller (a sibling shard's
    /// call failed and `try_join_all` dropped the rest) left its attempt
    /// counted as outstanding for good, skewing every later choice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn failure_pattern_dropped_calls_do_not_leak_outstanding_counts() {
        let server = start(ServerConfig::default()).await;
        let set = ReplicaSet::new(
            replica_config(vec![ReplicaEndpoint {
                addr: server.addr.clone(),
                domain: "zone-a".into(),
            }]),
            Transport::new(TransportConfig::default()).unwrap(),
        );
        let method = ECHO_DESCRIPTOR.methods[0].id;
        for _ in 0..5 {
            // The server takes 100 ms; the caller gives up after 10.
            let dropped = tokio::time::timeout(
                Duration::from_millis(10),
                set.call_raw(method, echo_body(100), true, Duration::from_secs(2)),
            )
            .await;
            assert!(dropped.is_err(), "the caller gave up first");
        }
        assert_eq!(set.outstanding(), vec![0]);
        server.shutdown().await;
    }
}

/// Failure pattern 14 (the drills `drill_rdma_kill_the_primary_...` and
/// `drill_rdma_ack_primary_failover_...`, about one run in twenty): a
/// Fetch's attempt on a killed primary lost its connection, its retry on
/// the replica failed (timed out under load), and the third attempt went
/// back to the dead primary, whose backoff had run out, was refused, and
/// counted: the Fetch gave up with its attempts used up while the replica
/// served. A refused attempt now moves on for free to a replica that has
/// not turned the call away, tried or not. Here: two attempts at most, the
/// dead replica preferred (the caller's domain), the live one losing its
/// first answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_pattern_a_refusal_after_every_replica_was_tried_is_not_an_attempt() {
    use tessera_rpc::policy::RetryPolicyConfig;
    use tessera_rpc::{ReplicaEndpoint, ReplicaSet, ReplicaSetConfig};
    let t = TransportConfig::default();
    let live = start(server_config(&t)).await;
    let proxy = tessera_test_support::FaultProxy::start(live.addr.clone()).await;
    // A port nobody listens on: every dial is refused.
    let dead = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().to_string()
    };
    proxy.lose_responses(1);
    let set = ReplicaSet::new(
        ReplicaSetConfig {
            replicas: vec![
                ReplicaEndpoint {
                    addr: dead.clone(),
                    domain: "near".into(),
                },
                ReplicaEndpoint {
                    addr: proxy.addr.clone(),
                    domain: "far".into(),
                },
            ],
            local_domain: "near".into(),
            channel: ChannelConfig {
                request_timeout_ms: 2000,
                ..channel_config(&t)
            },
            retry: RetryPolicyConfig {
                probability: 1.0,
                connection_failure_probability: 1.0,
                max_attempts: 2,
                ..RetryPolicyConfig::default()
            },
            seed: Some(14),
            ..ReplicaSetConfig::default()
        },
        Transport::new(t.clone()).unwrap(),
    );
    let method = ECHO_DESCRIPTOR.methods[0].id;
    // The dead replica refuses (free), the live one loses its answer (the
    // first counted attempt), the dead one refuses again (free now too),
    // and the live one answers (the second).
    let answer = set
        .call_raw(method, echo_body(0), true, Duration::from_secs(5))
        .await
        .expect("the live replica answers the call's second attempt");
    let reply: EchoResponse = prost::Message::decode(answer).unwrap();
    assert_eq!(&reply.payload[..], b"hello");
    assert_eq!(proxy.lost(), 1, "the live replica's first answer was lost");
    live.shutdown().await;
}

/// Failure pattern 15 (the VM suite over rxe: pattern 13 lost 8 of 692
/// calls, "connection lost: closed by the server"): a stopping server
/// closes a connection once nothing is in flight and no request came for
/// 100 ms. On the emulated RNIC a request took longer than that on its
/// way, arrived after the server stopped reading, and its caller saw the
/// connection close with no way to tell it from a crash, after which an
/// unanswered request may have been applied: counted as a lost attempt,
/// it failed a call that never retries. Now the server's last message on
/// a drained connection says it answered every request it read there
/// (`FLAG_DRAINED`), and a call still waiting goes elsewhere for free.
///
/// Here the server's side: the notice comes after the answers and before
/// the end.
async fn failure_pattern_a_drained_connection_ends_with_a_notice_after_its_answers(
    t: TransportConfig,
) {
    use tessera_rpc::wire::{Kind, RpcHeader};
    let server = start(server_config(&t)).await;
    let transport = Transport::new(t.clone()).unwrap();
    let mut connection = transport.connect(&server.addr).await.unwrap();
    let method = ECHO_DESCRIPTOR.methods[0].id;
    let body = prost::Message::encode_to_vec(&EchoRequest {
        payload: Bytes::from_static(b"before the stop"),
        ..EchoRequest::default()
    });
    let header = RpcHeader::request(method, 0, 7, Some(Duration::from_secs(5)));
    let request = [&header.encode()[..], &body[..]].concat();
    connection
        .sender
        .send(tessera_transport::Message::from(Bytes::from(request)))
        .await
        .unwrap();
    let answer = connection.receiver.recv().await.unwrap().unwrap();
    let (answer, _) = RpcHeader::decode(&answer).unwrap();
    assert_eq!((answer.kind, answer.request_id), (Kind::Response, 7));
    assert!(!answer.is_drained());
    let stopped = tokio::spawn(server.shutdown());
    let last = connection
        .receiver
        .recv()
        .await
        .unwrap()
        .expect("a message before the end");
    let (last, body) = RpcHeader::decode(&last).unwrap();
    assert!(last.is_drained(), "{last:?}");
    assert_eq!((last.request_id, body.len()), (0, 0));
    assert!(
        !matches!(connection.receiver.recv().await, Ok(Some(_))),
        "nothing after the notice"
    );
    stopped.await.unwrap();
}

/// Failure pattern 15, the client's side: a server that says it drained
/// the connection while a call waits there (it read the request: a
/// server that lies, so that the order is certain) sends the call to the
/// other replica with no retry allowed, no budget and a method that is
/// not idempotent; the link's end names the drain.
async fn failure_pattern_a_call_waiting_on_a_drained_connection_goes_elsewhere(t: TransportConfig) {
    use tessera_rpc::{LinkClosed, ReplicaEndpoint, ReplicaSet, ReplicaSetConfig};
    let live = start(server_config(&t)).await;
    let transport = Transport::new(t.clone()).unwrap();
    let (draining, fake) = drained_after_one_request(&transport).await;
    let endpoint = |addr: &str, domain: &str| ReplicaEndpoint {
        addr: addr.to_owned(),
        domain: domain.into(),
    };
    let set = ReplicaSet::new(
        ReplicaSetConfig {
            replicas: vec![endpoint(&draining, "near"), endpoint(&live.addr, "far")],
            local_domain: "near".into(),
            channel: channel_config(&t),
            seed: Some(15),
            ..never_retrying()
        },
        Transport::new(t.clone()).unwrap(),
    );
    let method = ECHO_DESCRIPTOR.methods[0].id;
    let answer = set
        .call_raw(method, echo_body(0), false, Duration::from_secs(5))
        .await
        .expect("the call goes to the live replica");
    let reply: EchoResponse = prost::Message::decode(answer).unwrap();
    assert_eq!(&reply.payload[..], b"hello");
    assert_ne!(fake.await.unwrap(), 0, "the draining server had the call");

    // A channel to such a server names the drain as the link's end.
    let (addr, _fake) = drained_after_one_request(&transport).await;
    let echo = EchoClient::new(Channel::connect(&addr, channel_config(&t)).await.unwrap());
    let err = echo
        .echo(EchoRequest {
            payload: Bytes::from_static(b"drained"),
            ..EchoRequest::default()
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&err, RpcError::ConnectionLost { reason, .. } if matches!(**reason, LinkClosed::Drained)),
        "{err:?}"
    );
    live.shutdown().await;
}

/// A replica set's settings that never retry a call that may have done
/// work: no retry coin, one attempt, an empty budget. Only work-free
/// failures move a call on.
fn never_retrying() -> tessera_rpc::ReplicaSetConfig {
    use tessera_rpc::policy::{RetryBudgetConfig, RetryPolicyConfig};
    tessera_rpc::ReplicaSetConfig {
        retry: RetryPolicyConfig {
            probability: 0.0,
            connection_failure_probability: 0.0,
            max_attempts: 1,
            ..RetryPolicyConfig::default()
        },
        budget: RetryBudgetConfig {
            max_tokens: 0.0,
            reserve_per_sec: 0.0,
            ..RetryBudgetConfig::default()
        },
        ..tessera_rpc::ReplicaSetConfig::default()
    }
}

/// A server that reads one request, does not answer it and says it
/// drained the connection: its address, and the request's id once said.
async fn drained_after_one_request(
    transport: &Transport,
) -> (String, tokio::task::JoinHandle<u64>) {
    use tessera_rpc::wire::RpcHeader;
    let listener = transport.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let mut connection = listener.accept().await.unwrap();
        let request = connection.receiver.recv().await.unwrap().unwrap();
        let drained = Bytes::copy_from_slice(&RpcHeader::drained().encode());
        connection
            .sender
            .send(tessera_transport::Message::from(drained))
            .await
            .unwrap();
        connection.sender.flushed().await;
        RpcHeader::decode(&request).unwrap().0.request_id
    });
    (addr, task)
}
