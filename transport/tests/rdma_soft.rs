//! The RDMA transport through the same API as TCP, over the provider the
//! suite's RDMA tests run on (`tessera_test_support::rdma`: the soft NIC,
//! or ibverbs under `scripts/dev vm-test` and `hw-test`). Tests of the soft
//! NIC's own fault dice and port switch keep the soft provider on both
//! sides and say so.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    missing_docs
)]

use bytes::Bytes;
use tessera_test_support::wait::{Waiting, eventually};
use tessera_transport::pool::lookup;
use tessera_transport::rdma::EngineError;
use tessera_transport::{
    Message, RdmaError, Transport, TransportConfig, TransportError, TransportKind,
};

fn soft_config() -> TransportConfig {
    tessera_test_support::rdma::transport()
}

/// Listens on `server` and sends every message back on its connection,
/// for as many connections as come; returns the address.
async fn echo_server(server: &Transport) -> String {
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok(mut conn) = listener.accept().await {
            tokio::spawn(async move {
                while let Ok(Some(message)) = conn.receiver.recv().await {
                    if conn.sender.send(Message::from(message)).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// The soft NIC reports rxe's limits and enforces them, as a real device
/// does. Before: the default `cq_depth` (32,768) was above rxe's
/// `max_cqe` (32,767), so `ibv_create_cq` failed and so did
/// `Transport::new`, `auto` included. Now the CQ is clamped to the
/// device's largest, a queue depth the device cannot give is refused
/// naming its setting, and `auto` falls back to TCP instead. Soft NIC
/// only: its limits are rxe's of Linux 5.x (max_qp_wr 0x4000); the rxe of
/// 6.1 in the VM gives a million work requests per queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configuration_beyond_the_devices_limits_names_its_setting_and_auto_falls_back() {
    let defaults = Transport::new(TransportConfig::soft_rdma()).unwrap();
    assert!(defaults.prefers_rdma());
    assert_eq!(defaults.config().rdma.cq_depth, 32_767);
    let mut deep = TransportConfig::soft_rdma();
    deep.rdma.recv_queue_depth = 0x4001;
    match Transport::new(deep.clone()) {
        Err(TransportError::Config(err)) => {
            let text = err.to_string();
            assert!(text.contains("rdma.recv_queue_depth"), "{text}");
            assert!(text.contains("max_qp_wr"), "{text}");
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
    deep.kind = TransportKind::Auto;
    let auto = Transport::new(deep).unwrap();
    assert!(!auto.prefers_rdma(), "auto fell back to TCP");
    // And it works, over TCP.
    let listener = auto.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let accepted = tokio::spawn(async move { listener.accept().await.unwrap() });
    let conn = auto.connect(&addr).await.unwrap();
    assert_eq!(conn.kind(), TransportKind::Tcp);
    drop(accepted.await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_every_size_cross_and_land_in_the_receive_pool() {
    let server = Transport::new(soft_config()).unwrap();
    let client = Transport::new(soft_config()).unwrap();
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let sizes: Vec<usize> = vec![0, 1, 100, 8 << 10, (8 << 10) + 1, 100_000, 1 << 20, 5 << 20];
    let expected = sizes.clone();
    let recv_pool = server.recv_pool().id();
    let echo = tokio::spawn(async move {
        let mut conn = listener.accept().await.unwrap();
        let mut got = Vec::new();
        while got.len() < expected.len() {
            let message = conn.receiver.recv().await.unwrap().expect("message");
            if !message.is_empty() {
                assert_eq!(lookup(&message[..]).map(|r| r.pool_id), Some(recv_pool));
            }
            got.push(message.len());
            conn.sender.send(Message::from(message)).await.unwrap();
        }
        got.sort_unstable();
        got
    });
    let mut conn = client.connect(&addr).await.unwrap();
    for (i, &len) in sizes.iter().enumerate() {
        let mut buf = client.send_pool().alloc(len).unwrap();
        buf.fill((i % 251) as u8);
        conn.sender.send(Message::from(buf.freeze())).await.unwrap();
    }
    let mut back: Vec<Bytes> = Vec::new();
    for _ in 0..sizes.len() {
        back.push(conn.receiver.recv().await.unwrap().expect("echo"));
    }
    let mut got = echo.await.unwrap();
    let mut want = sizes.clone();
    want.sort_unstable();
    got.sort_unstable();
    assert_eq!(got, want);
    for message in &back {
        let i = sizes.iter().position(|&s| s == message.len()).unwrap();
        assert!(
            message.iter().all(|&b| b == (i % 251) as u8),
            "{}-byte echo corrupted",
            message.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_one_side_ends_the_other_cleanly() {
    let server = Transport::new(soft_config()).unwrap();
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let accept = tokio::spawn(async move { listener.accept().await.unwrap() });
    let client = Transport::new(soft_config()).unwrap();
    let conn = client.connect(&addr).await.unwrap();
    let mut server_side = accept.await.unwrap();
    conn.sender
        .send(Message::from(Bytes::from_static(b"last words")))
        .await
        .unwrap();
    let got = server_side.receiver.recv().await.unwrap().unwrap();
    assert_eq!(&got[..], b"last words");
    drop(conn);
    let end = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        server_side.receiver.recv(),
    )
    .await
    .expect("the peer's close is noticed");
    assert!(matches!(end, Ok(None)), "{end:?}");
}

/// A closed connection's queue pair goes at once on both sides, and its
/// memory windows go before it. Before, the engine's windows (the keepalive
/// slot's stays bound for the connection's life) were deallocated after its
/// queue pair was destroyed: rxe's `ibv_destroy_qp` then waits 50 s for the
/// windows' references to the QP, on the thread that drives the queue (in
/// the ibverbs suite every test's close took 50 s, and other connections of
/// that thread stalled behind it); the soft NIC now counts the mistake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_connections_queue_pair_goes_at_once_after_its_windows() {
    use std::time::{Duration, Instant};
    let server = Transport::new(soft_config()).unwrap();
    let addr = echo_server(&server).await;
    // Its own QP, closed with the connection (a multiplexed one stays for
    // the next connect to the address).
    let mut dialer = soft_config();
    dialer.rdma.multiplex = false;
    let client = Transport::new(dialer).unwrap();
    let mut conn = client.connect(&addr).await.unwrap();
    // A large message each way: a grant's window bound and invalidated.
    let payload = vec![7u8; 200_000];
    conn.sender
        .send(Message::from(payload.clone()))
        .await
        .unwrap();
    let back = conn.receiver.recv().await.unwrap().unwrap();
    assert_eq!(back.len(), payload.len());
    drop(conn);
    let closed = Instant::now();
    for (side, transport) in [("client", &client), ("server", &server)] {
        while transport.rdma_stats().unwrap().qps_open > 0 {
            assert!(
                closed.elapsed() < Duration::from_secs(5),
                "the {side}'s queue pair is still open 5 s after the close: {:?}",
                transport.rdma_stats()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    eprintln!(
        "{}: both queue pairs gone {:?} after the close",
        tessera_test_support::rdma::provider_name(),
        closed.elapsed()
    );
    if !tessera_test_support::rdma::is_ibverbs() {
        for device in tessera_transport::verbs::soft::SoftFabric::process().devices() {
            assert_eq!(
                device.stats().qps_destroyed_with_bound_windows,
                0,
                "a queue pair was destroyed with windows bound on it"
            );
        }
    }
}

/// A message the application has is in the transport's counters. Before,
/// a worker brought them up to date every 100 ms of work and not at all
/// once idle, so a snapshot after a burst's last echo missed it until the
/// next keepalive (the ibverbs two-process test read 7 messages sent and 6
/// received after all 7 echoes had arrived); with keepalive off, for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_received_message_is_in_the_counters() {
    let mut config = soft_config();
    config.rdma.keepalive_timeout_ms = 0;
    let server = Transport::new(config.clone()).unwrap();
    let addr = echo_server(&server).await;
    let client = Transport::new(config).unwrap();
    let mut conn = client.connect(&addr).await.unwrap();
    let mut total = 0u64;
    for (i, len) in [1usize, 5000, 100_000, 1 << 20].into_iter().enumerate() {
        conn.sender
            .send(Message::from(vec![3u8; len]))
            .await
            .unwrap();
        assert_eq!(conn.receiver.recv().await.unwrap().unwrap().len(), len);
        total += len as u64;
        let stats = client.rdma_stats().unwrap();
        assert_eq!(stats.messages_received, i as u64 + 1, "{stats:?}");
        assert_eq!(stats.bytes_received, total, "{stats:?}");
    }
}

/// Answers of a request/response connection after the first go to the
/// destination the client offered (`rdma/engine/offers.rs`), with no
/// request to send, over the transport end to end: every echo comes back
/// intact, and the server's counters show the offered sends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_answers_after_the_first_go_to_the_clients_offer() {
    let server = Transport::new(soft_config()).unwrap();
    let addr = echo_server(&server).await;
    let client = Transport::new(soft_config()).unwrap();
    let mut conn = client.connect(&addr).await.unwrap();
    for i in 0..6u8 {
        let len = 200_000 + usize::from(i) * 1000;
        let body: Vec<u8> = (0..len).map(|j| (j % 251) as u8 ^ i).collect();
        conn.sender.send(Message::from(body.clone())).await.unwrap();
        let back = conn.receiver.recv().await.unwrap().unwrap();
        assert!(back[..] == body[..], "echo {i} differs");
    }
    // The server's thread counts its sends after posting them: wait for
    // the count, not for a guessed time.
    let served = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            let stats = server.rdma_stats().unwrap();
            if stats.offered_sends >= 5 {
                return stats;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the server counts its offered sends");
    assert_eq!(served.offered_sends, 5, "{served:?}");
    // The server draws on its inbound budget: it offers nothing, so the
    // client's requests all asked.
    assert_eq!(client.rdma_stats().unwrap().offered_sends, 0);
}

#[tokio::test]
async fn ibverbs_without_a_device_is_a_clear_error() {
    let config = TransportConfig {
        kind: TransportKind::Rdma,
        ..TransportConfig::default()
    };
    match Transport::new(config) {
        Ok(_) => eprintln!("an RDMA device exists here: nothing to check"),
        Err(err) => {
            let text = err.to_string();
            assert!(text.contains("rdma"), "{text}");
            eprintln!("as expected without a device: {text}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_client_does_not_hold_up_other_handshakes() {
    let server = Transport::new(soft_config()).unwrap();
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    // Connects over TCP and never says hello.
    let _silent = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let client = Transport::new(soft_config()).unwrap();
    let dial = tokio::spawn(async move { client.connect(&addr).await.map(|_| ()) });
    let accepted = tokio::time::timeout(std::time::Duration::from_secs(5), listener.accept())
        .await
        .expect("the second client is accepted while the first stays silent");
    assert!(accepted.is_ok());
    dial.await.unwrap().unwrap();
}

fn auto_soft() -> TransportConfig {
    TransportConfig {
        kind: TransportKind::Auto,
        ..soft_config()
    }
}

/// Sends one message from `client` to a server listening with `server` and
/// returns what the server got.
async fn exchange(server: TransportConfig, client: TransportConfig) -> Bytes {
    let server = Transport::new(server).unwrap();
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    // Like a server, keep accepting: an `auto` dialer's failed RDMA attempt
    // shows up here as a first connection that breaks.
    let accept = tokio::spawn(async move {
        loop {
            let mut conn = listener.accept().await.unwrap();
            if let Ok(Some(message)) = conn.receiver.recv().await {
                return message;
            }
        }
    });
    let client = Transport::new(client).unwrap();
    let conn = client.connect(&addr).await.unwrap();
    conn.sender
        .send(Message::from(Bytes::from(vec![42u8; 20_000])))
        .await
        .unwrap();
    let got = tokio::time::timeout(std::time::Duration::from_secs(10), accept)
        .await
        .unwrap()
        .unwrap();
    drop(conn);
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_auto_listener_serves_rdma_and_tcp_peers() {
    for client in [soft_config(), TransportConfig::default(), auto_soft()] {
        let kind = client.kind;
        let got = exchange(auto_soft(), client).await;
        assert_eq!(got.len(), 20_000, "{kind}");
        assert!(got.iter().all(|&b| b == 42), "{kind}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_auto_dialer_falls_back_to_tcp_against_a_tcp_server() {
    let got = exchange(TransportConfig::default(), auto_soft()).await;
    assert_eq!(got.len(), 20_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_without_a_device_is_tcp() {
    // The default provider is ibverbs: on hosts without a device `auto`
    // is plain TCP on both sides (on hosts with one, RDMA).
    let auto = TransportConfig {
        kind: TransportKind::Auto,
        ..TransportConfig::default()
    };
    for (server, client) in [
        (auto.clone(), TransportConfig::default()),
        (TransportConfig::default(), auto.clone()),
    ] {
        assert_eq!(exchange(server, client).await.len(), 20_000);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_injected_qp_error_fails_the_connection_with_a_clear_error() {
    let mut faulty = TransportConfig::soft_rdma();
    faulty.rdma.soft_faults.seed = 11;
    faulty.rdma.soft_faults.qp_error_per_million = 50_000;
    let server = Transport::new(TransportConfig::soft_rdma()).unwrap();
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let accept = tokio::spawn(async move {
        // The QP may fail before the socket's `Open` gets through, and then
        // the listener never hears of it (nothing to notice, nothing held).
        let Ok(Ok(mut conn)) =
            tokio::time::timeout(std::time::Duration::from_secs(2), listener.accept()).await
        else {
            return 0;
        };
        // Read until the connection ends, one way or the other.
        let mut received = 0usize;
        loop {
            match conn.receiver.recv().await {
                Ok(Some(_)) => received += 1,
                Ok(None) | Err(_) => return received,
            }
        }
    });
    let client = Transport::new(faulty).unwrap();
    let mut conn = client.connect(&addr).await.unwrap();
    for _ in 0..500 {
        if conn
            .sender
            .send(Message::from(Bytes::from(vec![1u8; 30_000])))
            .await
            .is_err()
        {
            break;
        }
    }
    let err = tokio::time::timeout(std::time::Duration::from_secs(10), conn.receiver.recv())
        .await
        .expect("the failure is reported, no hang")
        .expect_err("the injected QP error surfaces as an error");
    // Our own failed work request, or the peer's: its sends into a QP in
    // error fail too, and it hangs up first.
    let failed = match &err {
        TransportError::Rdma(rdma) => matches!(
            **rdma,
            RdmaError::Engine(EngineError::Completion { .. } | EngineError::PeerClosed)
        ),
        _ => false,
    };
    assert!(failed, "{err:?}");
    let received = tokio::time::timeout(std::time::Duration::from_secs(10), accept)
        .await
        .expect("the peer notices too")
        .unwrap();
    assert!(received < 500, "{received}");
}

async fn connects_share_qps(multiplex: bool) -> (u64, u64) {
    let mut config = soft_config();
    config.rdma.multiplex = multiplex;
    let server = Transport::new(config.clone()).unwrap();
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let echo = tokio::spawn(async move {
        loop {
            let Ok(mut conn) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                while let Ok(Some(message)) = conn.receiver.recv().await {
                    if conn.sender.send(Message::from(message)).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let client = Transport::new(config).unwrap();
    let mut conns = Vec::new();
    for _ in 0..20 {
        conns.push(client.connect(&addr).await.unwrap());
    }
    // Every socket works, and closing some does not disturb the others.
    for (i, conn) in conns.iter_mut().enumerate() {
        let len = [10usize, 9000, 300_000][i % 3];
        conn.sender
            .send(Message::from(Bytes::from(vec![i as u8; len])))
            .await
            .unwrap();
    }
    for (i, conn) in conns.iter_mut().enumerate() {
        let back = conn.receiver.recv().await.unwrap().unwrap();
        assert_eq!(back.len(), [10usize, 9000, 300_000][i % 3]);
        assert!(back.iter().all(|&b| b == i as u8));
    }
    // The counters are brought up to date every 100 ms.
    let mut stats = client.rdma_stats().unwrap();
    let started = std::time::Instant::now();
    while stats.sockets_open < 20 && started.elapsed() < std::time::Duration::from_secs(2) {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        stats = client.rdma_stats().unwrap();
    }
    let qps = stats.qps_open;
    conns.truncate(10);
    for (i, conn) in conns.iter_mut().enumerate() {
        conn.sender
            .send(Message::from(Bytes::from(vec![i as u8; 100])))
            .await
            .unwrap();
        assert_eq!(conn.receiver.recv().await.unwrap().unwrap().len(), 100);
    }
    echo.abort();
    (qps, stats.sockets_open)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connects_to_one_address_share_one_queue_pair() {
    let (qps, sockets) = connects_share_qps(true).await;
    assert_eq!((qps, sockets), (1, 20));
    let (qps, sockets) = connects_share_qps(false).await;
    assert_eq!(
        (qps, sockets),
        (20, 20),
        "one QP per connection without multiplexing"
    );
}

/// `clients` transports (one engine each) flood one server with `messages`
/// messages each over 2 sockets, while the server's application stalls for
/// `stall` after the first; returns the server's counters once all arrived
/// intact.
async fn incast(
    server_config: TransportConfig,
    clients: usize,
    messages: usize,
    stall: std::time::Duration,
) -> tessera_transport::rdma::RdmaStats {
    let server = Transport::new(server_config).unwrap();
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let expected = clients * messages;
    let sink = tokio::spawn(async move {
        let (count_tx, mut count_rx) = tokio::sync::mpsc::unbounded_channel::<usize>();
        let accept = tokio::spawn(async move {
            loop {
                let Ok(mut conn) = listener.accept().await else {
                    return;
                };
                let count_tx = count_tx.clone();
                tokio::spawn(async move {
                    let mut first_one = true;
                    while let Ok(Some(message)) = conn.receiver.recv().await {
                        let first = message.first().copied().unwrap_or(0);
                        assert!(message.iter().all(|&b| b == first), "corrupted");
                        if count_tx.send(message.len()).is_err() {
                            return;
                        }
                        if std::mem::take(&mut first_one) {
                            // The application falls behind for a moment.
                            tokio::time::sleep(stall).await;
                        }
                    }
                });
            }
        });
        let mut got = 0;
        while got < expected {
            count_rx.recv().await.unwrap();
            got += 1;
        }
        accept.abort();
        got
    });
    let senders: Vec<_> = (0..clients)
        .map(|c| {
            let addr = addr.clone();
            tokio::spawn(async move {
                let client = Transport::new(soft_config()).unwrap();
                let conns = [
                    client.connect(&addr).await.unwrap(),
                    client.connect(&addr).await.unwrap(),
                ];
                for i in 0..messages {
                    let len = [64usize, 1000, 8000, 30_000][i % 4];
                    conns[i % 2]
                        .sender
                        .send(Message::from(Bytes::from(vec![(c * 31 + i) as u8; len])))
                        .await
                        .unwrap();
                }
                // Keep the connections until the server has everything.
                conns
            })
        })
        .collect();
    let mut keep = Vec::new();
    for sender in senders {
        keep.push(sender.await.unwrap());
    }
    let got = tokio::time::timeout(std::time::Duration::from_secs(30), sink)
        .await
        .expect("everything arrives")
        .unwrap();
    assert_eq!(got, expected);
    server.rdma_stats().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedicated_receive_queues_never_see_receiver_not_ready_under_incast() {
    let mut config = soft_config();
    // Few receives per QP, so credits run out again and again, and short
    // delivery queues, so the stalled application holds the receives back.
    config.rdma.recv_queue_depth = 8;
    config.send_queue_depth = 16;
    let stats = incast(config, 4, 400, std::time::Duration::from_millis(100)).await;
    assert_eq!(stats.rnr_events, 0, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_receive_queue_carries_an_incast_and_counts_receiver_not_ready() {
    let mut config = soft_config();
    config.rdma.srq = true;
    // Far fewer shared receives than the senders' rings hold: bursts find
    // the queue empty, and their SENDs are retried.
    config.rdma.srq_depth = 16;
    config.rdma.io_threads = 1;
    // Short delivery queues: the stalled application's messages pile up in
    // the transport, which then stops reposting shared receives.
    config.send_queue_depth = 16;
    let stats = incast(config, 4, 400, std::time::Duration::from_millis(100)).await;
    assert!(stats.rnr_events > 0, "{stats:?}");
}

/// A post that stops part way (as `ibv_post_send` does with `bad_wr`, here
/// injected in 2% of the client's posts) fails its connection promptly,
/// with an error on both halves, instead of stalling it. Before: the error
/// was logged and forgotten, the ring counted the unposted work requests
/// in flight for ever (only the last of a batch is signalled), and every
/// later message on the connection waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_post_fails_the_connection_instead_of_stalling_it() {
    use std::time::Duration;
    let server = Transport::new(TransportConfig::soft_rdma()).unwrap();
    let addr = echo_server(&server).await;
    let mut faulty = TransportConfig::soft_rdma();
    faulty.rdma.soft_faults = tessera_transport::verbs::soft::SoftFaults {
        seed: 7,
        post_error_per_million: 20_000,
        ..Default::default()
    };
    let client = Transport::new(faulty).unwrap();
    let (mut failed, mut completed) = (0, 0);
    for attempt in 0..12 {
        let outcome = tokio::time::timeout(Duration::from_secs(20), async {
            // A failed first post fails the connect itself: as clean.
            let Ok(mut conn) = client.connect(&addr).await else {
                return false;
            };
            for i in 0..400usize {
                let len = if i % 5 == 0 { 100_000 } else { 200 };
                let buf = client.send_pool().alloc_copy(&vec![i as u8; len]).unwrap();
                if conn.sender.send(Message::from(buf.freeze())).await.is_err() {
                    return false;
                }
                match conn.receiver.recv().await {
                    Ok(Some(echo)) => assert_eq!(echo.len(), len),
                    _ => return false,
                }
            }
            true
        })
        .await;
        match outcome {
            Err(_) => panic!("attempt {attempt}: the connection stalled for 20 s"),
            Ok(false) => failed += 1,
            Ok(true) => completed += 1,
        }
    }
    eprintln!("connections failed by a post: {failed}, completed: {completed}");
    assert!(failed > 0, "the injected post failures failed connections");
}

/// A long-lived connection over shared receive queues keeps the receive
/// pool bounded. Before: every control message (request to send, clear to
/// send) and every final write's receive went to the engine's spare list,
/// which only dedicated receive queues drain, so the pool grew by three
/// receive buffers per large round trip for the life of the connection
/// (a ps-server under `worker trainer` grew by about 70 MB/s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_receive_queue_connection_keeps_its_pool_bounded() {
    let mut config = soft_config();
    config.rdma.srq = true;
    config.rdma.srq_depth = 256;
    let server = Transport::new(config.clone()).unwrap();
    let client = Transport::new(config).unwrap();
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let mut conn = listener.accept().await.unwrap();
        while let Ok(Some(message)) = conn.receiver.recv().await {
            if conn.sender.send(Message::from(message)).await.is_err() {
                break;
            }
        }
    });
    let mut conn = client.connect(&addr).await.unwrap();
    let mut round_trip = async |n: usize| {
        for i in 0..n {
            // Above the small-message limit: request to send, clear to
            // send, a write with immediate, both ways.
            let buf = client
                .send_pool()
                .alloc_copy(&vec![i as u8; 16 << 10])
                .unwrap();
            conn.sender.send(Message::from(buf.freeze())).await.unwrap();
            let echo = conn.receiver.recv().await.unwrap().unwrap();
            assert_eq!(echo.len(), 16 << 10);
        }
    };
    round_trip(200).await;
    let in_use = |t: &Transport| t.recv_pool().stats().in_use_bytes;
    let (server_before, client_before) = (in_use(&server), in_use(&client));
    round_trip(2000).await;
    let (server_after, client_after) = (in_use(&server), in_use(&client));
    eprintln!(
        "receive pool in use after 200 / 2200 round trips: server {server_before} / {server_after}, client {client_before} / {client_after}"
    );
    for (side, before, after) in [
        ("server", server_before, server_after),
        ("client", client_before, client_after),
    ] {
        assert!(
            after < before + (4 << 20),
            "the {side}'s receive pool grew from {before} to {after} bytes"
        );
    }
}

/// A receive of a shared receive queue that fails (here: the peer's SEND
/// does not fit, injected) gives its slot back to the queue. Its error
/// completion carries no opcode (the soft NIC leaves it undefined, as real
/// providers do), so it is told by its work request id. Before: it was
/// taken for a send and its slot never reposted, so every such failure
/// left the queue one receive shorter for good; after as many failures as
/// the queue is deep, no SEND from any peer found a receive again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_shared_receive_returns_its_slot_to_the_queue() {
    const DEPTH: u32 = 16;
    let mut config = TransportConfig::soft_rdma();
    config.rdma.srq = true;
    config.rdma.srq_depth = DEPTH;
    config.rdma.io_threads = 1;
    let server = Transport::new(config.clone()).unwrap();
    let addr = echo_server(&server).await;
    let round_trips = async |client: &Transport, n: usize| -> bool {
        let Ok(mut conn) = client.connect(&addr).await else {
            return false;
        };
        for i in 0..n {
            let buf = client.send_pool().alloc_copy(&[i as u8; 100]).unwrap();
            let sent = conn.sender.send(Message::from(buf.freeze())).await;
            if sent.is_err() || !matches!(conn.receiver.recv().await, Ok(Some(_))) {
                return false;
            }
        }
        true
    };
    let mut faulty = config.clone();
    faulty.rdma.soft_faults = tessera_transport::verbs::soft::SoftFaults {
        seed: 11,
        recv_error_per_million: 30_000,
        ..Default::default()
    };
    let client = Transport::new(faulty).unwrap();
    let mut failed = 0;
    for _ in 0..3 * DEPTH {
        if !round_trips(&client, 200).await {
            failed += 1;
        }
    }
    let engines_failed = server.rdma_stats().unwrap().engines_failed;
    eprintln!(
        "{failed} connections failed by a receive error; server engines failed: {engines_failed}"
    );
    assert!(
        failed > DEPTH,
        "more receive failures than the queue is deep"
    );
    // A healthy peer still finds receives posted (bounded: a queue run
    // dry makes its SENDs retry for long).
    let healthy = Transport::new(config).unwrap();
    let fine = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        round_trips(&healthy, 100),
    )
    .await
    .unwrap_or(false);
    assert!(fine, "the shared receive queue ran dry");
}

/// An I/O thread takes a QP only while the completions its QPs can have
/// outstanding fit its CQ: a connection beyond that is refused with an
/// error that says what to raise, and the connections it has keep
/// working. Before: QPs went to threads round robin with no count, and a
/// CQ that overran failed every QP on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_completion_queue_are_refused_not_overrun() {
    let server = Transport::new(soft_config()).unwrap();
    let addr = echo_server(&server).await;
    let mut small = soft_config();
    // 32 send + 64 receive entries a QP: two fit a CQ of 256, not three.
    small.rdma.cq_depth = 256;
    small.rdma.io_threads = 1;
    small.rdma.multiplex = false;
    let client = Transport::new(small).unwrap();
    let mut kept = vec![
        client.connect(&addr).await.unwrap(),
        client.connect(&addr).await.unwrap(),
    ];
    match client.connect(&addr).await {
        Err(TransportError::CompletionQueuesFull { need, cq_depth, .. }) => {
            assert_eq!((need, cq_depth), (96, 256));
        }
        other => panic!("expected the CQ to be full, got {other:?}"),
    }
    for conn in &mut kept {
        let buf = client.send_pool().alloc_copy(b"still here").unwrap();
        conn.sender.send(Message::from(buf.freeze())).await.unwrap();
        let echo = conn.receiver.recv().await.unwrap().unwrap();
        assert_eq!(&echo[..], b"still here");
    }
    // A closed connection's QP (its own: multiplex is off) is torn down,
    // and its room comes back. Before: it lived until its peer went away,
    // so its room never came back.
    drop(kept.pop());
    let mut third = eventually(
        std::time::Duration::from_secs(10),
        "the closed connection's room back (a third connection accepted)",
        || async {
            match client.connect(&addr).await {
                Ok(conn) => Ok(conn),
                // The engine ends on its I/O thread's next round.
                Err(err @ TransportError::CompletionQueuesFull { .. }) => Err(err),
                Err(err) => panic!("{err}"),
            }
        },
    )
    .await;
    let buf = client.send_pool().alloc_copy(b"third").unwrap();
    third
        .sender
        .send(Message::from(buf.freeze()))
        .await
        .unwrap();
    assert_eq!(&third.receiver.recv().await.unwrap().unwrap()[..], b"third");
    assert_eq!(
        client.rdma_stats().unwrap().engines_failed,
        0,
        "a close is no failure"
    );
}

/// A device event fails the engines it concerns at once and is counted:
/// a port going down (raised on the client's soft device, as a drill)
/// ends the client's connection promptly, where before nothing read the
/// device's events and the connection waited for its retries to run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_going_down_fails_its_connections_at_once() {
    use std::time::Duration;
    use tessera_transport::verbs::AsyncEvent;
    use tessera_transport::verbs::soft::SoftFabric;
    let server = Transport::new(TransportConfig::soft_rdma()).unwrap();
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let accepted = tokio::spawn(async move { listener.accept().await.unwrap() });
    let client = Transport::new(TransportConfig::soft_rdma()).unwrap();
    let mut conn = client.connect(&addr).await.unwrap();
    let _server_side = accepted.await.unwrap();
    let name = client.rdma_device().unwrap().to_owned();
    let device = SoftFabric::process()
        .devices()
        .into_iter()
        .find(|d| tessera_transport::verbs::Device::name(d) == name)
        .unwrap();
    device.raise_event(AsyncEvent::PortDown { port: 1 });
    let ended = tokio::time::timeout(Duration::from_secs(5), conn.receiver.recv())
        .await
        .expect("the connection ended at once");
    // The cause comes as a type: the device's event, not a dead peer.
    use tessera_transport::rdma::engine::EngineError;
    use tessera_transport::{RdmaError, TransportError};
    assert!(
        matches!(
            ended.as_ref().map_err(TransportError::rdma),
            Err(Some(RdmaError::Engine(EngineError::Device(
                AsyncEvent::PortDown { port: 1 }
            ))))
        ),
        "{ended:?}"
    );
    let stats = client.rdma_stats().unwrap();
    assert_eq!(stats.async_events, 1);
    assert!(stats.engines_failed >= 1, "{stats:?}");
}

/// A panic in one engine's handling fails that connection only: the I/O
/// thread (one, serving both peers here) catches it, fails the engine and
/// its sockets with an error, and goes on serving the other engine.
/// Before, the panic unwound the I/O thread and took every engine it
/// served down with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_engine_fails_its_connection_and_the_io_thread_serves_the_others() {
    const POISON: usize = 777;
    let mut config = TransportConfig::soft_rdma();
    config.rdma.io_threads = 1;
    config.rdma.soft_faults.panic_on_message_len = POISON as u32;
    let server = Transport::new(config).unwrap();
    let addr = echo_server(&server).await;
    // Two clients, so two engines (queue pairs) on the server's one thread.
    let (a, b) = (
        Transport::new(TransportConfig::soft_rdma()).unwrap(),
        Transport::new(TransportConfig::soft_rdma()).unwrap(),
    );
    let mut to_a = a.connect(&addr).await.unwrap();
    let mut to_b = b.connect(&addr).await.unwrap();
    for conn in [&mut to_a, &mut to_b] {
        conn.sender
            .send(Message::from(vec![1u8; 100]))
            .await
            .unwrap();
        assert_eq!(conn.receiver.recv().await.unwrap().unwrap().len(), 100);
    }
    to_a.sender
        .send(Message::from(vec![2u8; POISON]))
        .await
        .unwrap();
    let failed = tokio::time::timeout(std::time::Duration::from_secs(20), to_a.receiver.recv())
        .await
        .expect("the poisoned connection fails, and says so");
    assert!(
        failed.is_err() || matches!(failed, Ok(None)),
        "the poisoned connection ends: {failed:?}"
    );
    for i in 0..50u8 {
        to_b.sender
            .send(Message::from(vec![i; 200 + usize::from(i)]))
            .await
            .unwrap();
        let echoed = tokio::time::timeout(std::time::Duration::from_secs(10), to_b.receiver.recv())
            .await
            .expect("the other engine is still served")
            .unwrap()
            .unwrap();
        assert_eq!(echoed.len(), 200 + usize::from(i));
    }
    assert!(
        server.rdma_stats().is_some_and(|s| s.engines_failed >= 1),
        "{:?}",
        server.rdma_stats()
    );
}

fn runtime_config() -> TransportConfig {
    let mut config = soft_config();
    config.rdma.polling = tessera_transport::Polling::Runtime;
    config
}

/// Echoes `per_task` messages of assorted sizes from each of `tasks`
/// tasks over one connection each, through a server and a client whose
/// queues the runtime drives; every echo comes back intact.
async fn runtime_echo(tasks: usize, per_task: usize) {
    let server = Transport::new(runtime_config()).unwrap();
    let client = Transport::new(runtime_config()).unwrap();
    let addr = echo_server(&server).await;
    let mut handles = Vec::new();
    for t in 0..tasks {
        let mut conn = client.connect(&addr).await.unwrap();
        let pool = client.send_pool().clone();
        let recv_pool = client.recv_pool().id();
        handles.push(tokio::spawn(async move {
            for i in 0..per_task {
                let len = [0usize, 1, 100, 8 << 10, (8 << 10) + 1, 100_000, 1 << 20][i % 7];
                let fill = (t * 31 + i) as u8;
                let mut buf = pool.alloc(len).unwrap();
                buf.fill(fill);
                conn.sender.send(Message::from(buf.freeze())).await.unwrap();
                let back =
                    tokio::time::timeout(std::time::Duration::from_secs(20), conn.receiver.recv())
                        .await
                        .expect("an echo within 20 s")
                        .unwrap()
                        .expect("echo");
                assert_eq!(back.len(), len);
                assert!(back.iter().all(|&b| b == fill), "{len}-byte echo corrupted");
                if len > 0 {
                    // Over RDMA: the echo landed in the receive pool.
                    assert_eq!(lookup(&back[..]).map(|r| r.pool_id), Some(recv_pool));
                }
            }
        }));
    }
    for handle in handles {
        handle.await.unwrap();
    }
}

/// `polling = "runtime"`: no I/O thread; senders post on their own
/// thread, completions wake a runtime task through the queue's eventfd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_driven_queues_carry_messages_of_every_size() {
    runtime_echo(1, 21).await;
}

/// Many tasks sending at once contend for a queue's worker: those that
/// find it taken queue their message for whoever holds it, and nothing is
/// lost or reordered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_driven_queues_serve_contending_senders() {
    runtime_echo(16, 40).await;
}

/// On a current-thread runtime the driver task and the application share
/// the one thread.
#[tokio::test(flavor = "current_thread")]
async fn runtime_driven_queues_work_on_a_current_thread_runtime() {
    runtime_echo(4, 14).await;
}

/// `runtime` needs a runtime to drive its queues: outside one, the
/// transport says so instead of starting without a driver.
#[test]
fn runtime_polling_outside_a_runtime_is_a_clear_error() {
    let err = Transport::new(runtime_config()).unwrap_err();
    assert!(
        matches!(&err, TransportError::Rdma(rdma) if matches!(**rdma, RdmaError::NoRuntime)),
        "{err:?}"
    );
}

/// Each socket's messages arrive in the order sent, also when its sender
/// sometimes finds the worker taken (and queues) and sometimes free (and
/// posts itself). Before, a message posted directly could overtake one
/// queued a moment earlier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_driven_queues_keep_each_sockets_order_under_contention() {
    let server = Transport::new(runtime_config()).unwrap();
    let client = Transport::new(runtime_config()).unwrap();
    let addr = echo_server(&server).await;
    let mut tasks = Vec::new();
    for t in 0..8u32 {
        let conn = client.connect(&addr).await.unwrap();
        let (sender, mut receiver) = (conn.sender, conn.receiver);
        let count = 300u32;
        let send = tokio::spawn(async move {
            for i in 0..count {
                let len = if i % 5 == 0 { 20_000 } else { 16 };
                let mut body = vec![t as u8; len];
                body[..4].copy_from_slice(&i.to_le_bytes());
                sender.send(Message::from(Bytes::from(body))).await.unwrap();
            }
            sender
        });
        tasks.push(tokio::spawn(async move {
            for i in 0..count {
                let back =
                    tokio::time::timeout(std::time::Duration::from_secs(20), receiver.recv())
                        .await
                        .expect("an echo within 20 s")
                        .unwrap()
                        .expect("echo");
                let seq = u32::from_le_bytes([back[0], back[1], back[2], back[3]]);
                assert_eq!(seq, i, "socket {t}: message {seq} arrived in place of {i}");
            }
            drop(send.await.unwrap());
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

/// An I/O round visits the engines with work, not every engine of its
/// completion queue (returns engine visits per round trip). Before, every round walked all of them: with 64 idle
/// queue pairs beside the busy one, a round trip cost 64 engine visits
/// per round, and the message rate fell as queue pairs were added (the
/// runtime driver's, from 187k msgs/s at 1 QP to 21k at 256).
async fn visits_per_message(polling: tessera_transport::Polling) -> f64 {
    let mut config = soft_config();
    config.rdma.polling = polling;
    config.rdma.io_threads = 1;
    config.rdma.multiplex = false;
    let server = Transport::new(config.clone()).unwrap();
    let client = Transport::new(config).unwrap();
    let addr = echo_server(&server).await;
    let mut conns = Vec::new();
    for _ in 0..64 {
        let mut conn = client.connect(&addr).await.unwrap();
        conn.sender
            .send(Message::from(Bytes::from_static(b"hello")))
            .await
            .unwrap();
        assert_eq!(&conn.receiver.recv().await.unwrap().unwrap()[..], b"hello");
        conns.push(conn);
    }
    // The counters are published every 100 ms: wait until they show every
    // engine and the first messages.
    let settled = |wanted: u64| {
        let client = &client;
        let wait = async move {
            loop {
                let stats = client.rdma_stats().unwrap();
                if stats.qps_open == 64 && stats.messages_received >= wanted {
                    return stats;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        };
        async move {
            tokio::time::timeout(std::time::Duration::from_secs(10), wait)
                .await
                .expect("the counters show every engine and message within 10 s")
        }
    };
    let before = settled(64).await;
    let conn = &mut conns[0];
    for i in 0..500u32 {
        conn.sender
            .send(Message::from(Bytes::from(i.to_le_bytes().to_vec())))
            .await
            .unwrap();
        let back = conn.receiver.recv().await.unwrap().unwrap();
        assert_eq!(&back[..], &i.to_le_bytes());
    }
    let after = settled(64 + 500).await;
    let rounds = after.io_rounds - before.io_rounds;
    let visits = after.engine_visits - before.engine_visits;
    assert!(rounds > 0, "the driver ran rounds");
    eprintln!("{polling:?}: {visits} engine visits in {rounds} rounds for 500 round trips");
    visits as f64 / 500.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_visits_only_the_engines_with_work() {
    for polling in [
        tessera_transport::Polling::Event,
        tessera_transport::Polling::Runtime,
    ] {
        let per_message = visits_per_message(polling).await;
        // One engine carries the traffic, a few rounds per round trip;
        // keepalive timers bring the others now and then. Walking them all
        // in every round would be 64 per round.
        assert!(
            per_message < 32.0,
            "{polling:?}: {per_message:.1} engine visits per round trip with one busy engine of 64"
        );
    }
}

/// An application that stops reading one socket holds its engine at the
/// backlog limit (no receives reposted, so the peer runs out of credits);
/// when it drops that socket's receiver, what it held is thrown away and
/// the engine reposts, so the other sockets of the queue pair go on.
/// Before, the engine left the ready list with its receives unposted, and
/// with keepalive off nothing ever visited it again.
async fn a_dropped_receiver_frees_its_queue_pair(polling: tessera_transport::Polling) {
    let mut config = soft_config();
    config.rdma.polling = polling;
    config.rdma.keepalive_timeout_ms = 0;
    config.rdma.io_threads = 1;
    let server = Transport::new(config.clone()).unwrap();
    let client = Transport::new(config).unwrap();
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let accepts = tokio::spawn(async move {
        let a = listener.accept().await.unwrap();
        let b = listener.accept().await.unwrap();
        (a, b)
    });
    // Both sockets on one queue pair (multiplexing is on by default).
    let stalled = client.connect(&addr).await.unwrap();
    stalled
        .sender
        .send(Message::from(Bytes::from_static(b"a")))
        .await
        .unwrap();
    let mut other = client.connect(&addr).await.unwrap();
    other
        .sender
        .send(Message::from(Bytes::from_static(b"b")))
        .await
        .unwrap();
    let (mut server_a, mut server_b) = accepts.await.unwrap();
    assert_eq!(&server_a.receiver.recv().await.unwrap().unwrap()[..], b"a");
    assert_eq!(&server_b.receiver.recv().await.unwrap().unwrap()[..], b"b");
    assert_eq!(client.rdma_stats().unwrap().qps_open, 1);
    // The server floods the socket nobody reads.
    let flood = tokio::spawn(async move {
        for i in 0..2000u32 {
            if server_a
                .sender
                .send(Message::from(Bytes::from(i.to_le_bytes().to_vec())))
                .await
                .is_err()
            {
                break;
            }
        }
        server_a
    });
    // Its channel and the backlog limit (256) fill, the engine stops
    // reposting receives, the peer uses up the receives still posted and
    // stops: wait until the count of messages received stands still
    // (published every 100 ms) with the flood unfinished.
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        let mut last = (0, std::time::Instant::now());
        loop {
            let received = client.rdma_stats().unwrap().messages_received;
            if received != last.0 {
                last = (received, std::time::Instant::now());
            } else if received >= 32 + 256
                && last.1.elapsed() >= std::time::Duration::from_millis(400)
            {
                assert!(received < 2000, "the flood was held back");
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the client's backlog fills and its receives run out within 10 s");
    // The application gives up on that socket's messages but keeps its
    // sender.
    drop(stalled.receiver);
    server_b
        .sender
        .send(Message::from(Bytes::from_static(b"after")))
        .await
        .unwrap();
    let got = tokio::time::timeout(std::time::Duration::from_secs(10), other.receiver.recv())
        .await
        .unwrap_or_else(|_| {
            panic!("{polling:?}: the other socket stalled behind the dropped receiver")
        })
        .unwrap()
        .unwrap();
    assert_eq!(&got[..], b"after");
    drop(flood.await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_receiver_does_not_stall_the_other_sockets_of_its_queue_pair() {
    a_dropped_receiver_frees_its_queue_pair(tessera_transport::Polling::Event).await;
    a_dropped_receiver_frees_its_queue_pair(tessera_transport::Polling::Runtime).await;
}

/// Two soft rails a transport: both opened, the pools registered on both,
/// and connections taking them in turn (the first on the first rail, the
/// second on the second). Soft NIC on both sides: `soft_rails` is its way
/// of giving a host several NICs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soft_rails_are_opened_and_registered_and_connections_take_them_in_turn() {
    use tessera_transport::SoftRail;
    let mut config = TransportConfig::soft_rdma();
    config.rdma.soft_rails = vec![SoftRail::default(), SoftRail::default()];
    let server = Transport::new(config.clone()).unwrap();
    let client = Transport::new(config).unwrap();
    let rails = client.rails();
    let first = client.rdma_device().unwrap().to_owned();
    assert_eq!(rails, vec![first.clone(), format!("{first}.1")]);
    assert_eq!(
        Transport::new(TransportConfig::soft_rdma())
            .unwrap()
            .rails()
            .len(),
        1
    );
    let buf = client.send_pool().alloc(1 << 20).unwrap();
    assert!(buf.region_on(0).is_some() && buf.region_on(1).is_some());
    assert_eq!(buf.region_on(2), None);
    drop(buf);

    let addr = echo_server(&server).await;
    let mut conn = client.connect(&addr).await.unwrap();
    for len in [100, 1 << 20] {
        let mut buf = client.send_pool().alloc(len).unwrap();
        buf.fill(3);
        conn.sender.send(Message::from(buf.freeze())).await.unwrap();
        let back = conn.receiver.recv().await.unwrap().expect("echo");
        assert_eq!(back.len(), len);
        assert!(back.iter().all(|&b| b == 3));
    }
    let moved = soft_bytes_moved;
    assert!(
        moved(&first) > 1 << 20,
        "the first rail carried the messages"
    );
    let second = format!("{first}.1");
    assert_eq!(moved(&second), 0, "one connection, one rail");
    let mut other = client.connect(&addr).await.unwrap();
    let mut buf = client.send_pool().alloc(1 << 20).unwrap();
    buf.fill(4);
    other
        .sender
        .send(Message::from(buf.freeze()))
        .await
        .unwrap();
    assert_eq!(
        other.receiver.recv().await.unwrap().expect("echo").len(),
        1 << 20
    );
    assert!(
        moved(&second) > 1 << 20,
        "the next connection took the second rail"
    );
}

/// Rails over the suite's provider (two soft devices, or in the VM two
/// Soft-RoCE devices, `rxe0` and `rxe1`): both open, each registers the
/// pools (a real `ibv_reg_mr` per device over ibverbs), and messages of
/// every size cross between two transports with two rails each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_rails_open_register_and_carry_messages_on_the_provider() {
    let rdma = match tessera_test_support::rdma::config_rails(2) {
        Ok(rdma) => rdma,
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
    let config = TransportConfig {
        rdma,
        ..soft_config()
    };
    let server = Transport::new(config.clone()).unwrap();
    let client = Transport::new(config).unwrap();
    assert_eq!(client.rails().len(), 2, "{:?}", client.rails());
    assert_ne!(client.rails()[0], client.rails()[1]);
    for pool in [client.send_pool(), client.recv_pool()] {
        let buf = pool.alloc(100_000).unwrap();
        let (first, second) = (buf.region_on(0).unwrap(), buf.region_on(1).unwrap());
        assert_eq!((first.base, first.len), (second.base, second.len));
    }
    let addr = echo_server(&server).await;
    let mut conn = client.connect(&addr).await.unwrap();
    for (i, len) in [0usize, 100, 8 << 10, 100_000, 1 << 20]
        .into_iter()
        .enumerate()
    {
        let mut buf = client.send_pool().alloc(len).unwrap();
        buf.fill(i as u8 + 1);
        conn.sender.send(Message::from(buf.freeze())).await.unwrap();
        let back = conn.receiver.recv().await.unwrap().expect("echo");
        assert_eq!(back.len(), len);
        assert!(
            back.iter().all(|&b| b == i as u8 + 1),
            "{len} bytes corrupted"
        );
    }
}

/// The bytes soft device `name` has moved so far.
fn soft_bytes_moved(name: &str) -> u64 {
    tessera_transport::verbs::soft::SoftFabric::process()
        .devices()
        .into_iter()
        .find(|d| tessera_transport::verbs::Device::name(d) == name)
        .map(|d| d.stats().bytes_moved)
        .unwrap()
}

/// Waits (polling the transport's counters, at most 5 s) until `rails`
/// of its rails have their port down.
async fn wait_rails_down(transport: &Transport, rails: u64) {
    eventually(
        std::time::Duration::from_secs(5),
        &format!("{rails} rails with their port down"),
        || async {
            let stats = transport.rdma_stats().unwrap();
            if stats.rails_down == rails {
                Ok(())
            } else {
                Err(stats)
            }
        },
    )
    .await;
}

/// One echo of `len` bytes on `conn`.
async fn echo_once(client: &Transport, conn: &mut tessera_transport::Connection, len: usize) {
    let mut buf = client.send_pool().alloc(len).unwrap();
    buf.fill(7);
    conn.sender.send(Message::from(buf.freeze())).await.unwrap();
    let back = conn.receiver.recv().await.unwrap().expect("echo");
    assert_eq!(back.len(), len);
    assert!(back.iter().all(|&b| b == 7));
}

/// Reconnecting over another rail (the paper's "another port" before
/// TCP): with the server's first rail's port down, a new connection goes
/// over the second rail; back up, new connections take the first again;
/// with every rail of the server down, no RDMA connection is made (the
/// RPC layer then uses TCP). The client's own rail down is skipped
/// without a try. Soft NIC on both sides: its port files take one
/// device's port down from outside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rail_whose_port_is_down_is_passed_over_for_the_next() {
    use tessera_transport::SoftRail;
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str| dir.path().join(name);
    let rails = |a: &str, b: &str| {
        let mut config = TransportConfig::soft_rdma();
        config.rdma.soft_rails = vec![
            SoftRail {
                port_file: Some(file(a)),
                ..SoftRail::default()
            },
            SoftRail {
                port_file: Some(file(b)),
                ..SoftRail::default()
            },
        ];
        config
    };
    let server = Transport::new(rails("s0", "s1")).unwrap();
    let client = Transport::new(rails("c0", "c1")).unwrap();
    let (s0, s1) = (server.rails()[0].clone(), server.rails()[1].clone());
    let addr = echo_server(&server).await;

    let mut conn = client.connect(&addr).await.unwrap();
    echo_once(&client, &mut conn, 100_000).await;
    assert!(soft_bytes_moved(&s0) > 0 && soft_bytes_moved(&s1) == 0);

    // The server's first rail goes down: its connection there ends, and
    // the next one is made over the second rail.
    std::fs::write(file("s0"), b"").unwrap();
    wait_rails_down(&server, 1).await;
    let ended = tokio::time::timeout(std::time::Duration::from_secs(5), conn.receiver.recv())
        .await
        .expect("the connection on the rail that went down ended");
    assert!(!matches!(ended, Ok(Some(_))), "{ended:?}");
    let mut conn = client.connect(&addr).await.unwrap();
    echo_once(&client, &mut conn, 100_000).await;
    assert!(
        soft_bytes_moved(&s1) > 100_000,
        "the second rail carried it"
    );

    // Back up: new connections take the first rail again once the
    // client's memory of its refusal (500 ms) has passed.
    std::fs::remove_file(file("s0")).unwrap();
    wait_rails_down(&server, 0).await;
    let before = soft_bytes_moved(&s0);
    let back = std::time::Instant::now();
    let mut kept = Vec::new();
    while soft_bytes_moved(&s0) <= before + 100_000 {
        assert!(
            back.elapsed() < std::time::Duration::from_secs(3),
            "no connection on the first rail 3 s after its port came back"
        );
        let mut again = client.connect(&addr).await.unwrap();
        echo_once(&client, &mut again, 100_000).await;
        kept.push(again);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    eprintln!(
        "the first rail again {:?} after its port came back",
        back.elapsed()
    );

    // The client's own first rail down: passed over without a try.
    std::fs::write(file("c0"), b"").unwrap();
    wait_rails_down(&client, 1).await;
    let before = soft_bytes_moved(&s1);
    let mut other = client.connect(&addr).await.unwrap();
    echo_once(&client, &mut other, 100_000).await;
    assert!(soft_bytes_moved(&s1) > before + 100_000);
    std::fs::remove_file(file("c0")).unwrap();
    wait_rails_down(&client, 0).await;

    // Every rail of the server down: no RDMA connection.
    std::fs::write(file("s0"), b"").unwrap();
    std::fs::write(file("s1"), b"").unwrap();
    wait_rails_down(&server, 2).await;
    let refused = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        // Connections made before may linger on the client until their
        // failure reaches it; a fresh dial finds no rail.
        loop {
            match client.connect(&addr).await {
                Err(err) => return err,
                Ok(conn) => {
                    let mut buf = client.send_pool().alloc(10).unwrap();
                    buf.fill(1);
                    let _ = conn.sender.send(Message::from(buf.freeze())).await;
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            }
        }
    })
    .await
    .expect("a dial with every server rail down fails");
    eprintln!("every rail down: {refused}");
}

/// A rail whose port is down when the transport starts counts as down at
/// once (its port went down before anything watched for the event), and
/// connections go to the next rail. Before, it counted as up, and dialers
/// picked it until its first message failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rail_down_at_start_is_down_from_the_start() {
    use tessera_transport::SoftRail;
    let dir = tempfile::tempdir().unwrap();
    let down = dir.path().join("down");
    std::fs::write(&down, b"").unwrap();
    let mut config = TransportConfig::soft_rdma();
    config.rdma.soft_rails = vec![
        SoftRail {
            port_file: Some(down),
            ..SoftRail::default()
        },
        SoftRail::default(),
    ];
    let client = Transport::new(config).unwrap();
    assert_eq!(client.rdma_stats().unwrap().rails_down, 1);
    let rails = client.rail_stats();
    assert_eq!((rails[0].rails_down, rails[1].rails_down), (1, 0));
    let server = Transport::new(TransportConfig::soft_rdma()).unwrap();
    let addr = echo_server(&server).await;
    let mut conn = client.connect(&addr).await.unwrap();
    echo_once(&client, &mut conn, 100_000).await;
    let rails = client.rail_stats();
    assert_eq!(rails[0].messages_sent, 0, "{rails:?}");
    assert!(rails[1].messages_sent >= 1, "{rails:?}");
}

/// Two soft rails with striping (confinement off): the config the
/// striping tests share; `port_files` give each rail a port file.
fn striped_rails(port_files: [Option<std::path::PathBuf>; 2]) -> TransportConfig {
    use tessera_transport::SoftRail;
    let mut config = TransportConfig::soft_rdma();
    config.rdma.confine_remote_writes = false;
    config.rdma.soft_rails = port_files
        .into_iter()
        .map(|port_file| SoftRail {
            port_file,
            ..SoftRail::default()
        })
        .collect();
    config
}

/// A message of `len` bytes whose content names `seed`.
fn seeded(client: &Transport, len: usize, seed: u8) -> Message {
    let mut buf = client.send_pool().alloc(len).unwrap();
    for (i, b) in buf.iter_mut().enumerate() {
        *b = seed.wrapping_add((i % 251) as u8);
    }
    Message::from(buf.freeze())
}

fn is_seeded(bytes: &[u8], seed: u8) -> bool {
    bytes
        .iter()
        .enumerate()
        .all(|(i, &b)| b == seed.wrapping_add((i % 251) as u8))
}

/// Waits (at most 5 s) until both transports run an engine on each of
/// their two rails: the connection's partner on the other rail is up.
async fn wait_partners(client: &Transport, server: &Transport) {
    let both = |t: &Transport| t.rail_stats().iter().all(|rail| rail.qps_open >= 1);
    eventually(
        std::time::Duration::from_secs(5),
        "an engine on every rail of both transports",
        || async {
            if both(client) && both(server) {
                Ok(())
            } else {
                Err(format!(
                    "client {:?}, server {:?}",
                    client.rail_stats(),
                    server.rail_stats()
                ))
            }
        },
    )
    .await;
}

/// Striping (issue 36): one connection's large messages are written over
/// both rails (the second rail's queue pair writes chunks of them, in both
/// directions: the echo is striped too), every byte lands where it
/// belongs, and small and large messages keep their order on the socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connections_large_messages_are_striped_over_both_rails_intact_and_in_order() {
    let server = Transport::new(striped_rails([None, None])).unwrap();
    let client = Transport::new(striped_rails([None, None])).unwrap();
    let addr = echo_server(&server).await;
    let mut conn = client.connect(&addr).await.unwrap();
    wait_partners(&client, &server).await;
    let second = server.rails()[1].clone();
    let before = soft_bytes_moved(&second);
    // Sizes around the striping bound (256 KiB), a fragment (64 KiB) and
    // a chunk (128 KiB), with small ones between, several in flight.
    let sizes = [
        1 << 20,
        100,
        (256 << 10) - 1,
        256 << 10,
        (256 << 10) + 1,
        8 << 10,
        3 << 20,
        (1 << 20) + 12_345,
        65_537,
        4 << 20,
    ];
    for round in 0..3u8 {
        for (i, &len) in sizes.iter().enumerate() {
            let seed = round.wrapping_mul(31).wrapping_add(i as u8);
            conn.sender.send(seeded(&client, len, seed)).await.unwrap();
        }
        for (i, &len) in sizes.iter().enumerate() {
            let seed = round.wrapping_mul(31).wrapping_add(i as u8);
            let back = conn.receiver.recv().await.unwrap().expect("echo");
            assert_eq!(back.len(), len, "round {round}, message {i}: out of order");
            assert!(
                is_seeded(&back, seed),
                "round {round}, {len} bytes corrupted"
            );
        }
    }
    let (sent, echoed) = (client.rdma_stats().unwrap(), server.rdma_stats().unwrap());
    eprintln!(
        "client: {} chunks handed out, {} bytes written for the other rail; server: {} chunks, {} bytes",
        sent.stripe_chunks, sent.striped_bytes, echoed.stripe_chunks, echoed.striped_bytes
    );
    assert!(
        sent.stripe_chunks > 0 && sent.striped_bytes > 1 << 20,
        "{sent:?}"
    );
    assert!(
        echoed.stripe_chunks > 0 && echoed.striped_bytes > 1 << 20,
        "{echoed:?}"
    );
    assert_eq!((sent.stripe_redone, echoed.stripe_redone), (0, 0));
    assert!(
        soft_bytes_moved(&second) > before + (2 << 20),
        "the second rail carried a share"
    );
}

/// A rail failing under striped messages: the chunks it had (or was about
/// to get) are written again on the message's own rail; no message is
/// lost or torn, and the connection (on the other rail) goes on without
/// an error. Then, with the port back, a new connection brings the rail
/// back into the stripes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rail_failing_under_striped_messages_costs_rewrites_not_messages() {
    let dir = tempfile::tempdir().unwrap();
    let port = dir.path().join("c1");
    let server = Transport::new(striped_rails([None, None])).unwrap();
    let client = Transport::new(striped_rails([None, Some(port.clone())])).unwrap();
    let addr = echo_server(&server).await;
    let mut conn = client.connect(&addr).await.unwrap();
    wait_partners(&client, &server).await;
    // Sends on a task of its own while the main one takes the rail down.
    let sender = conn.sender.clone();
    let count = 60usize;
    let sending = {
        let client = client.clone();
        tokio::spawn(async move {
            for i in 0..count {
                sender
                    .send(seeded(&client, 1 << 20, i as u8))
                    .await
                    .unwrap();
            }
        })
    };
    let mut taken_down = false;
    for i in 0..count {
        if i == 10 {
            std::fs::write(&port, b"").unwrap();
            taken_down = true;
        }
        let back = tokio::time::timeout(std::time::Duration::from_secs(10), conn.receiver.recv())
            .await
            .expect("the echo came")
            .unwrap()
            .expect("the connection stayed up");
        assert_eq!(back.len(), 1 << 20);
        assert!(is_seeded(&back, i as u8), "message {i} torn");
    }
    sending.await.unwrap();
    assert!(taken_down);
    wait_rails_down(&client, 1).await;
    let stats = client.rdma_stats().unwrap();
    eprintln!("after the rail went down: {stats:?}");
    assert!(
        stats.stripe_redone > 0,
        "chunks for the failed rail were written on the message's own: {stats:?}"
    );
    // Back up: a new connection dials the rail again, and messages are
    // striped once more (with one rail alone there is no partner to hand
    // a chunk to).
    std::fs::remove_file(&port).unwrap();
    wait_rails_down(&client, 0).await;
    let before = client.rdma_stats().unwrap().stripe_chunks;
    let mut waiting = Waiting::new(
        std::time::Duration::from_secs(5),
        "the rail carrying stripes again",
    );
    let mut again = client.connect(&addr).await.unwrap();
    let mut k = 0u8;
    while client.rdma_stats().unwrap().stripe_chunks <= before {
        waiting.tick(client.rail_stats()).await;
        again
            .sender
            .send(seeded(&client, 1 << 20, k))
            .await
            .unwrap();
        let back = again.receiver.recv().await.unwrap().expect("echo");
        assert!(is_seeded(&back, k));
        k = k.wrapping_add(1);
    }
}

/// Striping over the suite's provider (two soft devices, or in the VM two
/// Soft-RoCE devices with a real memory registration, and so a different
/// key, per device): one connection's large messages cross intact with
/// chunks written through the second rail's queue pair, in both
/// directions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_are_striped_over_two_rails_on_the_provider() {
    let rdma = match tessera_test_support::rdma::config_rails(2) {
        Ok(rdma) => rdma,
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
    let mut config = TransportConfig {
        rdma,
        ..soft_config()
    };
    config.rdma.confine_remote_writes = false;
    let server = Transport::new(config.clone()).unwrap();
    let client = Transport::new(config).unwrap();
    let addr = echo_server(&server).await;
    let mut conn = client.connect(&addr).await.unwrap();
    wait_partners(&client, &server).await;
    for (i, len) in [1usize << 20, 300_000, 100, 5 << 20, 256 << 10]
        .into_iter()
        .enumerate()
    {
        conn.sender
            .send(seeded(&client, len, i as u8))
            .await
            .unwrap();
        let back = conn.receiver.recv().await.unwrap().expect("echo");
        assert_eq!(back.len(), len);
        assert!(is_seeded(&back, i as u8), "{len} bytes corrupted");
    }
    let (sent, echoed) = (client.rdma_stats().unwrap(), server.rdma_stats().unwrap());
    // The first fill hands each partner two chunks of 128 KiB before the
    // home (at most 256 KiB in flight) takes more: a share at least.
    assert!(sent.striped_bytes >= 256 << 10, "{sent:?}");
    assert!(echoed.striped_bytes >= 256 << 10, "{echoed:?}");
}
