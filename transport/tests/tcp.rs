//! End-to-end tests of the TCP transport over loopback.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use tessera_test_support::sockets;
use tessera_transport::pool::lookup;
use tessera_transport::{Message, Transport, TransportConfig, TransportError};
use tokio::io::AsyncWriteExt;

/// A transport with `config` and a listener of it on a loopback port.
async fn listening(config: &TransportConfig) -> (Transport, tessera_transport::Listener, String) {
    let transport = Transport::new(config.clone()).unwrap();
    let listener = transport.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    (transport, listener, addr)
}

#[tokio::test]
async fn messages_arrive_whole_and_in_order() {
    let config = TransportConfig::default();
    let (transport, listener, addr) = listening(&config).await;
    let server = tokio::spawn(async move {
        let mut conn = listener.accept().await.unwrap();
        let mut got = Vec::new();
        while let Some(message) = conn.receiver.recv().await.unwrap() {
            got.push(message);
        }
        got
    });
    let conn = transport.connect(&addr).await.unwrap();
    let big = Bytes::from(vec![7u8; 3 << 20]);
    for i in 0..100u32 {
        let message = Message::from_parts([
            Bytes::copy_from_slice(&i.to_le_bytes()),
            if i == 50 {
                big.clone()
            } else {
                Bytes::from_static(b"payload")
            },
        ]);
        conn.sender.send(message).await.unwrap();
    }
    drop(conn);
    let got = server.await.unwrap();
    assert_eq!(got.len(), 100);
    for message in &got {
        let region = lookup(&message[..]).expect("received into pool memory");
        assert_eq!(
            region.pool_id,
            transport.recv_pool().id(),
            "no copy out of the receive pool"
        );
    }
    for (i, message) in got.iter().enumerate() {
        assert_eq!(&message[..4], &(i as u32).to_le_bytes());
        if i == 50 {
            assert_eq!(message.len(), 4 + big.len());
        } else {
            assert_eq!(&message[4..], b"payload");
        }
    }
}

#[tokio::test]
async fn oversized_send_is_refused_and_connection_stays_usable() {
    let config = TransportConfig {
        max_message_size: 1024,
        ..TransportConfig::default()
    };
    let (transport, listener, addr) = listening(&config).await;
    let server = tokio::spawn(async move {
        let mut conn = listener.accept().await.unwrap();
        conn.receiver.recv().await.unwrap()
    });
    let conn = transport.connect(&addr).await.unwrap();
    let err = conn
        .sender
        .send(Message::from(vec![0u8; 1025]))
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        TransportError::MessageTooLarge {
            len: 1025,
            max: 1024
        }
    ));
    conn.sender
        .send(Message::from(vec![1u8; 10]))
        .await
        .unwrap();
    assert_eq!(server.await.unwrap().unwrap().len(), 10);
}

#[tokio::test]
async fn hostile_length_prefix_closes_the_connection_with_an_error() {
    let config = TransportConfig {
        max_message_size: 1024,
        ..TransportConfig::default()
    };
    let (_transport, listener, addr) = listening(&config).await;
    let mut raw = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut conn = listener.accept().await.unwrap();
    raw.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
    let err = conn.receiver.recv().await.unwrap_err();
    assert!(
        matches!(err, TransportError::MessageTooLarge { .. }),
        "{err}"
    );
    assert!(matches!(
        conn.receiver.recv().await,
        Err(TransportError::Closed)
    ));
}

#[tokio::test]
async fn peer_closing_mid_frame_is_reported_as_truncation() {
    let config = TransportConfig::default();
    let (_transport, listener, addr) = listening(&config).await;
    let mut raw = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut conn = listener.accept().await.unwrap();
    raw.write_all(&100u32.to_le_bytes()).await.unwrap();
    raw.write_all(b"only a part").await.unwrap();
    drop(raw);
    let err = conn.receiver.recv().await.unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::Truncated {
                expected: 100,
                received: 11
            }
        ),
        "{err}"
    );
}

#[tokio::test]
async fn frames_of_every_size_arrive_intact_across_buffer_boundaries() {
    // A small read buffer forces frames to straddle buffers and large ones
    // to take the dedicated path.
    let config = TransportConfig {
        read_buffer_bytes: 256,
        ..TransportConfig::default()
    };
    let (transport, listener, addr) = listening(&config).await;
    let sizes: Vec<usize> = (0..300).map(|i| (i * 37) % 700).collect();
    let expected = sizes.clone();
    let server = tokio::spawn(async move {
        let mut conn = listener.accept().await.unwrap();
        let mut got = Vec::new();
        while let Some(message) = conn.receiver.recv().await.unwrap() {
            got.push(message);
        }
        got
    });
    let conn = transport.connect(&addr).await.unwrap();
    for (i, &size) in sizes.iter().enumerate() {
        conn.sender
            .send(Message::from(vec![(i % 251) as u8; size]))
            .await
            .unwrap();
    }
    drop(conn);
    let got = server.await.unwrap();
    assert_eq!(got.iter().map(|m| m.len()).collect::<Vec<_>>(), expected);
    for (i, message) in got.iter().enumerate() {
        assert!(
            message.iter().all(|&b| b == (i % 251) as u8),
            "message {i} corrupted"
        );
        if !message.is_empty() {
            assert_eq!(
                lookup(&message[..]).map(|r| r.pool_id),
                Some(transport.recv_pool().id())
            );
        }
    }
}

/// Many tasks send at once on one connection to a peer that reads slowly:
/// the socket fills, so messages are written by their callers, cut by a
/// full socket, queued behind a partly written one and batched by the
/// writer task. Every message still arrives whole, each sender's in its
/// order, and the peer sees a clean end after the last sender is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_senders_to_a_slow_reader_keep_every_message_whole_and_in_order() {
    const SENDERS: u32 = 8;
    const EACH: u32 = 200;
    let config = TransportConfig {
        send_queue_depth: 16,
        ..TransportConfig::default()
    };
    let (transport, listener, addr) = listening(&config).await;
    let server = tokio::spawn(async move {
        let mut conn = listener.accept().await.unwrap();
        let mut got = Vec::new();
        while let Some(message) = conn.receiver.recv().await.unwrap() {
            if got.len() % 64 == 0 {
                // A slow reader: the client's socket buffer fills meanwhile.
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            got.push(message);
        }
        got
    });
    let conn = transport.connect(&addr).await.unwrap();
    let mut senders = Vec::new();
    for sender in 0..SENDERS {
        let tx = conn.sender.clone();
        senders.push(tokio::spawn(async move {
            for seq in 0..EACH {
                // Sizes from a few bytes to 300 KiB, so that some messages
                // are larger than what the socket takes at once.
                let len = ((seq * 7919 + sender * 104_729) % 300_000) as usize;
                let fill = (sender * EACH + seq) as u8;
                let message = Message::from_parts([
                    Bytes::copy_from_slice(&sender.to_le_bytes()),
                    Bytes::copy_from_slice(&seq.to_le_bytes()),
                    Bytes::from(vec![fill; len]),
                ]);
                tx.send(message).await.unwrap();
            }
        }));
    }
    for sender in senders {
        sender.await.unwrap();
    }
    drop(conn);
    let got = server.await.unwrap();
    assert_eq!(got.len(), (SENDERS * EACH) as usize);
    let mut next = vec![0u32; SENDERS as usize];
    for message in &got {
        let sender = u32::from_le_bytes(message[..4].try_into().unwrap());
        let seq = u32::from_le_bytes(message[4..8].try_into().unwrap());
        assert_eq!(seq, next[sender as usize], "sender {sender}'s order");
        next[sender as usize] += 1;
        let len = ((seq * 7919 + sender * 104_729) % 300_000) as usize;
        let fill = (sender * EACH + seq) as u8;
        assert_eq!(message.len(), 8 + len);
        assert!(
            message[8..].iter().all(|&b| b == fill),
            "message {sender}/{seq} intact"
        );
    }
}

/// A peer that never reads and then resets the connection: its senders,
/// whether writing, queued behind the full socket or waiting for a place in
/// the queue, all fail promptly instead of waiting for room that never
/// comes, and the sender reports the connection closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_by_a_peer_that_never_read_fails_every_waiting_sender() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let config = TransportConfig {
        send_queue_depth: 2,
        ..TransportConfig::default()
    };
    let transport = Transport::new(config).unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let conn = transport.connect(&addr).await.unwrap();
    let (peer, _) = listener.accept().unwrap();
    let message = Message::from(Bytes::from(vec![1u8; 1 << 20]));
    let sent = std::sync::Arc::new(AtomicU64::new(0));
    let mut senders = Vec::new();
    for _ in 0..4 {
        let (tx, message, sent) = (conn.sender.clone(), message.clone(), sent.clone());
        senders.push(tokio::spawn(async move {
            loop {
                if let Err(err) = tx.send(message.clone()).await {
                    return err;
                }
                sent.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    // The senders are under way (the socket fills: nothing is read).
    while sent.load(Ordering::Relaxed) < 4 {
        tokio::task::yield_now().await;
    }
    // Unread data in the receive buffer: closing sends a reset.
    drop(peer);
    for sender in senders {
        let err = tokio::time::timeout(std::time::Duration::from_secs(10), sender)
            .await
            .expect("every sender returns once the connection is reset")
            .unwrap();
        assert!(
            matches!(err, TransportError::Closed | TransportError::Io(_)),
            "{err:?}"
        );
    }
    assert!(conn.sender.is_closed());
}

/// `abort` ends a connection whose peer reads nothing (as one that went
/// silent): a send blocked on the full socket and every later one fail at
/// once, instead of waiting on the peer, and the peer sees the end.
#[tokio::test]
async fn an_aborted_sender_fails_its_sends_and_the_peer_sees_the_end() {
    // A short send queue: it fills after a few MiB.
    let config = TransportConfig {
        send_queue_depth: 4,
        ..TransportConfig::default()
    };
    let (transport, listener, addr) = listening(&config).await;
    let conn = transport.connect(&addr).await.unwrap();
    // The peer accepts and reads nothing until told to.
    let mut accepted = listener.accept().await.unwrap();
    let chunk = Bytes::from(vec![1u8; 1 << 20]);
    // Fill the socket and the send queue: the peer does not read.
    let sender = conn.sender.clone();
    let filler = tokio::spawn(async move {
        loop {
            if let Err(err) = sender.send(Message::from(chunk.clone())).await {
                return err;
            }
        }
    });
    // Wait until the kernel says so: the connection's writer has bytes
    // queued and probes the peer's closed window.
    sockets::writer_blocked_by(addr.parse().unwrap(), std::time::Duration::from_secs(10)).await;
    assert!(
        !filler.is_finished(),
        "the peer's window holds the sends back"
    );
    conn.sender.abort();
    let err = tokio::time::timeout(std::time::Duration::from_secs(5), filler)
        .await
        .expect("a blocked send returns once aborted")
        .unwrap();
    assert!(matches!(err, TransportError::Closed), "{err:?}");
    assert!(conn.sender.is_closed());
    assert!(matches!(
        conn.sender
            .send(Message::from(Bytes::from_static(b"x")))
            .await,
        Err(TransportError::Closed)
    ));
    // The peer reads what arrived, then the end (clean or reset).
    let end = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        loop {
            match accepted.receiver.recv().await {
                Ok(Some(_)) => {}
                other => return other.map(|_| ()),
            }
        }
    })
    .await
    .expect("the peer sees the connection end");
    let _ = end;
}
