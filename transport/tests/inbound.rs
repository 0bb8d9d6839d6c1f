//! The inbound limits of accepted TCP connections (`transport/src/inbound.rs`):
//! budget with backpressure, slow-sender and handshake timeouts, the
//! connection cap. Hostile peers are raw sockets writing frames by hand.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use tessera_transport::{
    Connection, InboundConfig, Listener, Message, Stall, Transport, TransportConfig, TransportError,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

const MIB: usize = 1 << 20;

fn config(inbound: InboundConfig) -> TransportConfig {
    TransportConfig {
        max_message_size: 4 * MIB as u64,
        inbound,
        ..TransportConfig::default()
    }
}

/// A transport with `inbound` limits listening on loopback: the transport,
/// its address, and its accepted connections as they come.
async fn serve(
    inbound: InboundConfig,
) -> (
    Transport,
    std::net::SocketAddr,
    mpsc::UnboundedReceiver<Connection>,
) {
    let transport = Transport::new(config(inbound)).unwrap();
    let listener = transport.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    (transport, addr, accept_all(listener))
}

/// `n` peers that each announce a 4 MiB frame, send 1 MiB of it and stall,
/// with the server side's first `recv` of each running in a task.
async fn stalled_peers(
    n: usize,
    addr: std::net::SocketAddr,
    accepted: &mut mpsc::UnboundedReceiver<Connection>,
) -> (
    Vec<TcpStream>,
    Vec<tokio::task::JoinHandle<Result<Option<bytes::Bytes>, TransportError>>>,
) {
    let mut peers = Vec::new();
    let mut receivers = Vec::new();
    for _ in 0..n {
        peers.push(stalled_sender(addr, 4 * MIB, MIB).await);
        let mut connection = accepted.recv().await.unwrap();
        receivers.push(tokio::spawn(
            async move { connection.receiver.recv().await },
        ));
    }
    (peers, receivers)
}

/// Accepts for ever, handing each connection to the returned channel.
fn accept_all(listener: Listener) -> mpsc::UnboundedReceiver<Connection> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(connection) = listener.accept().await {
            if tx.send(connection).is_err() {
                break;
            }
        }
    });
    rx
}

/// A raw peer that announces a `len`-byte frame and sends `part` bytes of
/// it, then stalls (keeps the socket open).
async fn stalled_sender(addr: std::net::SocketAddr, len: usize, part: usize) -> TcpStream {
    let mut raw = TcpStream::connect(addr).await.unwrap();
    raw.write_all(&(len as u32).to_le_bytes()).await.unwrap();
    // The socket buffers may not take the whole part while the server does
    // not read: write what fits without waiting for the server.
    let body = vec![0xAB; part];
    let _ = tokio::time::timeout(Duration::from_millis(200), raw.write_all(&body)).await;
    raw
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_large_frames_get_no_memory_beyond_the_budget_and_are_closed_by_the_frame_timeout()
{
    let (transport, addr, mut accepted) = serve(InboundConfig {
        max_bytes: 8 * MIB as u64,
        max_connection_bytes: 8 * MIB as u64,
        frame_timeout_ms: 800,
        ..InboundConfig::default()
    })
    .await;
    let (peers, receivers) = stalled_peers(10, addr, &mut accepted).await;
    // A legitimate small message is served while the budget is taken:
    // small frames draw none.
    let legit = transport.connect(&addr.to_string()).await.unwrap();
    let mut served = accepted.recv().await.unwrap();
    legit
        .sender
        .send(Message::from(vec![1u8; 512]))
        .await
        .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), served.receiver.recv())
        .await
        .expect("a small message is read while large ones wait for budget")
        .unwrap()
        .unwrap();
    assert_eq!(got.len(), 512);
    for receiver in receivers {
        let outcome = tokio::time::timeout(Duration::from_secs(20), receiver)
            .await
            .expect("closed by the frame timeout")
            .unwrap();
        assert!(
            matches!(outcome, Err(TransportError::Stalled(Stall::Frame))),
            "{outcome:?}"
        );
    }
    // The server closed them: each raw peer reads EOF.
    for mut peer in peers {
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(5), peer.read(&mut byte)).await;
        assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "{read:?}");
    }
    let stats = transport.recv_pool().stats();
    // Two 4 MiB frames fit the budget at a time; before the budget each of
    // the ten got its 4 MiB at once (40 MiB).
    assert!(
        stats.peak_registered_bytes <= 16 * MIB as u64,
        "peak {} bytes registered for ten stalled 4 MiB frames",
        stats.peak_registered_bytes
    );
    assert_eq!(
        transport.inbound_budget().available(),
        transport.inbound_budget().capacity(),
        "every stalled frame gave its budget back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_message_waits_unread_for_budget_and_then_arrives_whole() {
    let (transport, addr, mut accepted) = serve(InboundConfig {
        max_bytes: 8 * MIB as u64,
        max_connection_bytes: 8 * MIB as u64,
        ..InboundConfig::default()
    })
    .await;
    let (stalled, stalled_receivers) = stalled_peers(2, addr, &mut accepted).await;
    // Both stalled frames hold their budget once their first bytes are read.
    let budget = transport.inbound_budget().clone();
    tessera_test_support::wait::eventually(
        Duration::from_secs(5),
        "the stalled frames take the whole budget",
        || async {
            match budget.available() {
                0 => Ok(()),
                left => Err(left),
            }
        },
    )
    .await;
    let legit = transport.connect(&addr.to_string()).await.unwrap();
    let mut served = accepted.recv().await.unwrap();
    let body: Vec<u8> = (0..4 * MIB).map(|i| i as u8).collect();
    let sending = tokio::spawn({
        let body = body.clone();
        async move { legit.sender.send(Message::from(body)).await }
    });
    let waiting = tokio::time::timeout(Duration::from_millis(300), served.receiver.recv()).await;
    assert!(waiting.is_err(), "no budget: the message is not read yet");
    drop(stalled);
    for receiver in stalled_receivers {
        let outcome = receiver.await.unwrap();
        assert!(
            matches!(outcome, Err(TransportError::Truncated { .. })),
            "{outcome:?}"
        );
    }
    let got = tokio::time::timeout(Duration::from_secs(10), served.receiver.recv())
        .await
        .expect("budget freed: the message is read")
        .unwrap()
        .unwrap();
    assert_eq!(&got[..], &body[..]);
    sending.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_is_closed_after_the_handshake_bound_and_an_idle_one_is_kept() {
    let (transport, addr, mut accepted) = serve(InboundConfig {
        handshake_timeout_ms: 300,
        ..InboundConfig::default()
    })
    .await;
    let mut silent = TcpStream::connect(addr).await.unwrap();
    let mut silent_conn = accepted.recv().await.unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(10), silent_conn.receiver.recv())
        .await
        .expect("closed by the handshake bound");
    assert!(
        matches!(outcome, Err(TransportError::Stalled(Stall::Handshake))),
        "{outcome:?}"
    );
    drop(silent_conn);
    let mut byte = [0u8; 1];
    assert_eq!(silent.read(&mut byte).await.unwrap_or(0), 0, "EOF");

    // A connection that has sent a message may then stay idle: workers are
    // long-lived.
    let talker = transport.connect(&addr.to_string()).await.unwrap();
    let mut talker_conn = accepted.recv().await.unwrap();
    talker
        .sender
        .send(Message::from(vec![3u8; 16]))
        .await
        .unwrap();
    assert_eq!(
        talker_conn.receiver.recv().await.unwrap().unwrap().len(),
        16
    );
    let idle = tokio::time::timeout(Duration::from_millis(900), talker_conn.receiver.recv()).await;
    assert!(idle.is_err(), "an idle connection is kept: {idle:?}");
    talker
        .sender
        .send(Message::from(vec![4u8; 16]))
        .await
        .unwrap();
    assert_eq!(
        talker_conn.receiver.recv().await.unwrap().unwrap().len(),
        16
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_are_closed_at_once_and_a_freed_slot_is_reused() {
    let (_transport, addr, mut accepted) = serve(InboundConfig {
        max_connections: 2,
        ..InboundConfig::default()
    })
    .await;
    let _a = TcpStream::connect(addr).await.unwrap();
    let first = accepted.recv().await.unwrap();
    let _b = TcpStream::connect(addr).await.unwrap();
    let _second = accepted.recv().await.unwrap();
    let mut third = TcpStream::connect(addr).await.unwrap();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(5), third.read(&mut byte))
        .await
        .expect("the third connection is closed at once");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    assert!(accepted.try_recv().is_err(), "it never reached accept()");
    drop(first);
    let _c = TcpStream::connect(addr).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), accepted.recv())
        .await
        .expect("a freed slot takes a new connection")
        .unwrap();
}

/// A message whose frame timeout passed while it waited for budget is
/// refused when the budget frees after its deadline, before a buffer is
/// allocated for it. (Its task runs late when hundreds of connections that
/// began together reach their deadlines at once: `timeout_at` polls the
/// wait first, and used to hand the freed budget to a message already past
/// its bound, which then allocated and read.)
#[tokio::test(flavor = "current_thread")]
async fn budget_freed_after_a_messages_deadline_is_not_given_to_it() {
    let (transport, addr, mut accepted) = serve(InboundConfig {
        max_bytes: 4 * MIB as u64,
        max_connection_bytes: 4 * MIB as u64,
        frame_timeout_ms: 200,
        ..InboundConfig::default()
    })
    .await;
    let budget = transport.inbound_budget().clone();
    let held = budget.try_acquire(budget.capacity()).unwrap();
    let peer = stalled_sender(addr, 4 * MIB, 64 << 10).await;
    let mut connection = accepted.recv().await.unwrap();
    let receiver = tokio::spawn(async move { connection.receiver.recv().await });
    tokio::time::timeout(Duration::from_secs(5), async {
        while budget.waiting() == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the message waits for budget");
    let registrations = transport.recv_pool().stats().registrations;
    // The runtime's one thread is held past the message's deadline (no
    // task runs), then the budget frees before the waiting task runs again.
    std::thread::sleep(Duration::from_millis(400));
    drop(held);
    let outcome = receiver.await.unwrap();
    assert!(
        matches!(outcome, Err(TransportError::Stalled(Stall::Frame))),
        "{outcome:?}"
    );
    assert_eq!(
        transport.recv_pool().stats().registrations,
        registrations,
        "no buffer is allocated for a message past its deadline"
    );
    assert_eq!(budget.available(), budget.capacity());
    assert_eq!(budget.waiting(), 0);
    drop(peer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_received_large_message_holds_its_budget_until_it_is_dropped() {
    let (transport, addr, mut accepted) = serve(InboundConfig {
        max_bytes: 8 * MIB as u64,
        max_connection_bytes: 8 * MIB as u64,
        ..InboundConfig::default()
    })
    .await;
    let client = transport.connect(&addr.to_string()).await.unwrap();
    let mut served = accepted.recv().await.unwrap();
    client
        .sender
        .send(Message::from(vec![9u8; 4 * MIB]))
        .await
        .unwrap();
    let got = served.receiver.recv().await.unwrap().unwrap();
    let budget = transport.inbound_budget();
    // A handler holding the request (or a slice of it) holds its budget:
    // before, the budget was given back at the last byte, so requests held
    // by slow handlers were not counted at all.
    let field = got.slice(MIB..2 * MIB);
    drop(got);
    assert_eq!(budget.available(), 4 * MIB);
    drop(field);
    assert_eq!(budget.available(), 8 * MIB);
}

/// A raw peer from source address `from` (loopback has all of 127/8).
async fn connect_from(from: &str, addr: std::net::SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    socket.connect(addr).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_cannot_take_every_connection_or_the_whole_budget() {
    let (_transport, addr, mut accepted) = serve(InboundConfig {
        max_bytes: 12 * MIB as u64,
        max_address_bytes: 8 * MIB as u64,
        max_connection_bytes: 8 * MIB as u64,
        max_connections_per_address: 4,
        ..InboundConfig::default()
    })
    .await;
    // Address A: three stalled 4 MiB frames. It gets 8 MiB of the 12.
    let mut stalled = Vec::new();
    let mut receivers = Vec::new();
    for _ in 0..3 {
        let mut raw = connect_from("127.0.0.1", addr).await;
        raw.write_all(&(4 * MIB as u32).to_le_bytes())
            .await
            .unwrap();
        let _ =
            tokio::time::timeout(Duration::from_millis(100), raw.write_all(&vec![1u8; MIB])).await;
        stalled.push(raw);
        let mut connection = accepted.recv().await.unwrap();
        receivers.push(tokio::spawn(
            async move { connection.receiver.recv().await },
        ));
    }
    // A fourth connection of A is accepted, a fifth is not.
    let _fourth = connect_from("127.0.0.1", addr).await;
    let _held = accepted.recv().await.unwrap();
    let mut fifth = connect_from("127.0.0.1", addr).await;
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(5), fifth.read(&mut byte))
        .await
        .expect("the fifth connection of one address is closed at once");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    // Address B is still accepted, and its large message is read at once:
    // A's share is full, the server's budget is not. Before the share, A's
    // three frames took all 12 MiB and B's waited for them.
    let mut b = connect_from("127.0.0.2", addr).await;
    let mut served = accepted.recv().await.unwrap();
    let body = vec![7u8; 4 * MIB];
    let sending = tokio::spawn(async move {
        b.write_all(&(4 * MIB as u32).to_le_bytes()).await.unwrap();
        b.write_all(&body).await.unwrap();
        b
    });
    let got = tokio::time::timeout(Duration::from_secs(5), served.receiver.recv())
        .await
        .expect("another address's message is not held behind A's")
        .unwrap()
        .unwrap();
    assert_eq!(got.len(), 4 * MIB);
    let _b = sending.await.unwrap();
    drop(stalled);
    for receiver in receivers {
        let _ = receiver.await;
    }
}
