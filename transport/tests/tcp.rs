//! End-to-end tests of the TCP transport over loopback.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use tessera_transport::{Message, TransportConfig, TransportError, connect, listen};
use tokio::io::AsyncWriteExt;

#[tokio::test]
async fn messages_arrive_whole_and_in_order() {
    let config = TransportConfig::default();
    let listener = listen(&config, "127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = tokio::spawn(async move {
        let mut conn = listener.accept().await.unwrap();
        let mut got = Vec::new();
        while let Some(message) = conn.receiver.recv().await.unwrap() {
            got.push(message);
        }
        got
    });
    let conn = connect(&config, &addr).await.unwrap();
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
    let listener = listen(&config, "127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = tokio::spawn(async move {
        let mut conn = listener.accept().await.unwrap();
        conn.receiver.recv().await.unwrap()
    });
    let conn = connect(&config, &addr).await.unwrap();
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
    let listener = listen(&config, "127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
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
    let listener = listen(&config, "127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
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
