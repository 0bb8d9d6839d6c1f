//! Mutual TLS on the transport: over TCP and on the RDMA handshake's
//! control connection (soft provider), each side sees the other's verified
//! certificate and its roles; a client without a certificate, with one of
//! another CA, or without TLS at all is refused, and a server of another
//! CA is refused by its clients.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;

use futures::FutureExt;
use tessera_test_support::{TestPki, sockets};
use tessera_transport::{Listener, Message, TlsConfig, Transport, TransportConfig, TransportError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn tcp(tls: Option<TlsConfig>) -> TransportConfig {
    TransportConfig {
        tls,
        ..TransportConfig::default()
    }
}

fn soft(tls: Option<TlsConfig>) -> TransportConfig {
    TransportConfig {
        tls,
        ..TransportConfig::soft_rdma()
    }
}

/// A listener of `config` on a free loopback port, and its address.
async fn listen(config: TransportConfig) -> (Listener, String) {
    let server = Transport::new(config).unwrap();
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    (listener, addr)
}

/// One round trip between a client of `client` and the server of
/// `server`; returns the roles each side saw of the other.
async fn round_trip(
    server: TransportConfig,
    client: TransportConfig,
) -> (Vec<String>, Vec<String>) {
    let (listener, addr) = listen(server).await;
    let served = tokio::spawn(async move {
        let mut conn = listener.accept().await.unwrap();
        let roles = conn.peer_identity().unwrap().roles().to_vec();
        let message = conn.receiver.recv().await.unwrap().unwrap();
        conn.sender.send(Message::from(message)).await.unwrap();
        // Held until the client has its answer.
        let _ = conn.receiver.recv().await;
        roles
    });
    let client = Transport::new(client).unwrap();
    let mut conn = client.connect(&addr).await.unwrap();
    let server_roles = conn.peer_identity().unwrap().roles().to_vec();
    let payload = vec![7u8; 300_000];
    conn.sender
        .send(Message::from(payload.clone()))
        .await
        .unwrap();
    let answer = conn.receiver.recv().await.unwrap().unwrap();
    assert_eq!(&answer[..], &payload[..], "the message came back intact");
    drop(conn);
    (served.await.unwrap(), server_roles)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_peers_authenticate_each_other_and_see_each_others_roles() {
    let pki = TestPki::new();
    let (client_roles, server_roles) = round_trip(
        tcp(Some(pki.identity("ps-0", &["replication"]))),
        tcp(Some(pki.identity("trainer-1", &["worker"]))),
    )
    .await;
    assert_eq!(client_roles, ["worker"]);
    assert_eq!(server_roles, ["replication"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_peers_authenticate_the_handshake_and_their_sockets_carry_the_roles() {
    let pki = TestPki::new();
    let (client_roles, server_roles) = round_trip(
        soft(Some(pki.identity("ps-0", &["replication"]))),
        soft(Some(pki.identity("admin-tool", &["admin"]))),
    )
    .await;
    assert_eq!(client_roles, ["admin"]);
    assert_eq!(server_roles, ["replication"]);
    // A TCP client (fallen back from RDMA) of the same RDMA listener is
    // authenticated too.
    let (client_roles, _) = round_trip(
        soft(Some(pki.identity("ps-1", &["replication"]))),
        tcp(Some(pki.identity("trainer-2", &["worker"]))),
    )
    .await;
    assert_eq!(client_roles, ["worker"]);
}

/// The client's connection is refused: whatever it sends, it reads an
/// error or the end (nobody serves this listener, so an answer could
/// only be a bug: what the timeout below waits for is the server's close),
/// and the listener never yields it.
async fn assert_refused(listener: &Listener, mut conn: tessera_transport::Connection) {
    let _ = conn.sender.send(Message::from(vec![1u8; 64])).await;
    let outcome = tokio::time::timeout(std::time::Duration::from_secs(10), conn.receiver.recv())
        .await
        .expect("the server closes the connection");
    assert!(
        !matches!(outcome, Ok(Some(_))),
        "a refused client got an answer: {outcome:?}"
    );
    assert!(
        listener.accept().now_or_never().is_none(),
        "the listener handed out a refused connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_of_another_ca_or_without_tls_are_refused() {
    let pki = TestPki::new();
    for with in [tcp, soft] {
        let server = with(Some(pki.identity("ps-0", &[])));
        let kind = server.kind;
        let (listener, addr) = listen(server).await;
        // A certificate of another CA. TLS 1.3 clients finish their side
        // of the handshake before the server has checked their
        // certificate, so the refusal comes as the connection's end.
        let stranger = Transport::new(with(Some(pki.stranger("intruder", &["admin"])))).unwrap();
        // The stranger trusts only its own CA, so it refuses the server
        // first where it verifies it.
        match stranger.connect(&addr).await {
            Err(TransportError::Tls(_)) => {}
            Err(other) => panic!("{kind}: expected a TLS error, got {other}"),
            Ok(_) => panic!("{kind}: a client of another CA connected"),
        }
        // One that trusts our CA but shows its stranger's certificate.
        let mut mixed = pki.stranger("intruder-2", &["admin"]);
        mixed.ca = pki.ca_path().display().to_string();
        let mixed = Transport::new(with(Some(mixed))).unwrap();
        match mixed.connect(&addr).await {
            Ok(conn) => assert_refused(&listener, conn).await,
            Err(err) => assert!(
                matches!(
                    err,
                    TransportError::Tls(_) | TransportError::Io(_) | TransportError::Rdma(_)
                ),
                "{kind}: {err}"
            ),
        }
        // No TLS at all: a plain TCP client's frame is not a handshake.
        let plain = Transport::new(tcp(None)).unwrap();
        let conn = plain.connect(&addr).await.unwrap();
        assert_refused(&listener, conn).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_a_certificate_is_refused() {
    let pki = TestPki::new();
    let (listener, addr) = listen(tcp(Some(pki.identity("ps-0", &[])))).await;
    // rustls as a client that trusts the CA but has no certificate.
    let mut roots = rustls::RootCertStore::empty();
    let ca = std::fs::read(pki.ca_path()).unwrap();
    for cert in rustls_pki_types_certs(&ca) {
        roots.add(cert).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let outcome = async {
        let mut tls = connector.connect(name, stream).await?;
        // A frame header and a body, as a Tessera client would send.
        tls.write_all(&[0, 0, 0, 4, 1, 2, 3, 4]).await?;
        let mut byte = [0u8; 1];
        tls.read(&mut byte).await
    };
    let outcome = tokio::time::timeout(std::time::Duration::from_secs(10), outcome)
        .await
        .expect("the server closes the connection");
    assert!(
        matches!(outcome, Err(_) | Ok(0)),
        "a client without a certificate read {outcome:?}"
    );
    assert!(listener.accept().now_or_never().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_whose_certificate_does_not_name_the_host_is_refused() {
    let pki = TestPki::new();
    let (_listener, addr) = listen(tcp(Some(pki.identity("ps-0", &[])))).await;
    let mut client = pki.identity("trainer", &[]);
    client.server_name = Some("ps-7.example".into());
    let client = Transport::new(tcp(Some(client))).unwrap();
    match client.connect(&addr).await {
        Err(TransportError::Tls(err)) => {
            assert!(
                matches!(*err, tessera_transport::TlsError::Handshake { .. }),
                "{err:?}"
            );
        }
        other => panic!("expected a TLS error, got {other:?}"),
    }
}

fn rustls_pki_types_certs(pem: &[u8]) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .unwrap()
}

/// A message far larger than the sockets' buffers crosses TLS whole to a
/// reader that starts late, so the writer meets a full socket: what TLS
/// took into its own buffer is flushed with the batch. Before, the
/// message's tail could wait there for the next message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_message_crosses_tls_to_a_late_reader() {
    let pki = TestPki::new();
    let (listener, addr) = listen(tcp(Some(pki.identity("ps-0", &[])))).await;
    let (go, start) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(async move {
        let mut conn = listener.accept().await.unwrap();
        let _ = start.await;
        let message = conn.receiver.recv().await.unwrap().unwrap();
        (message, conn)
    });
    let client = Transport::new(tcp(Some(pki.identity("trainer", &[])))).unwrap();
    let conn = client.connect(&addr).await.unwrap();
    let len = 48 << 20;
    let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    conn.sender.send(Message::from(payload)).await.unwrap();
    // The writer fills the socket while nobody reads; once the kernel
    // says the peer's window is closed (the writer probes it), the reader
    // starts. With that order, the writer without a flush lost the tail
    // (checked against that code).
    sockets::writer_blocked_by(addr.parse().unwrap(), std::time::Duration::from_secs(10)).await;
    let _ = go.send(());
    let (message, _server_conn) = tokio::time::timeout(std::time::Duration::from_secs(20), served)
        .await
        .expect("the whole message arrives")
        .unwrap();
    assert_eq!(message.len(), len);
    assert!(
        message
            .iter()
            .enumerate()
            .all(|(i, &b)| b == (i % 251) as u8)
    );
    drop(conn);
}

/// A client that opens a connection and stalls in its TLS handshake holds
/// up nobody (handshakes run in tasks of their own) and is closed at the
/// handshake bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_tls_handshake_holds_up_no_one_and_is_closed() {
    let pki = TestPki::new();
    let mut config = tcp(Some(pki.identity("ps-0", &[])));
    config.inbound.handshake_timeout_ms = 300;
    let (listener, addr) = listen(config).await;
    // Half a ClientHello (a TLS record header promising more), then
    // silence.
    let mut stalled = tokio::net::TcpStream::connect(&addr).await.unwrap();
    stalled
        .write_all(&[0x16, 0x03, 0x01, 0x02, 0x00])
        .await
        .unwrap();
    let served = tokio::spawn(async move {
        let mut conn = listener.accept().await.unwrap();
        let message = conn.receiver.recv().await.unwrap().unwrap();
        conn.sender.send(Message::from(message)).await.unwrap();
        let _ = conn.receiver.recv().await;
    });
    let client = Transport::new(tcp(Some(pki.identity("trainer", &[])))).unwrap();
    let mut conn = client.connect(&addr).await.unwrap();
    conn.sender
        .send(Message::from(vec![3u8; 100]))
        .await
        .unwrap();
    let answer = conn.receiver.recv().await.unwrap().unwrap();
    assert_eq!(&answer[..], &[3u8; 100][..]);
    // The stalled one is closed at its bound (well within 10 s).
    let mut byte = [0u8; 1];
    let closed = tokio::time::timeout(std::time::Duration::from_secs(10), stalled.read(&mut byte))
        .await
        .expect("closed at the handshake bound");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
    drop(conn);
    served.await.unwrap();
}
