//! Mutual TLS on the transport's TCP connections: the TCP transport's
//! frames, and the control connection of the RDMA handshake (the hello
//! that sets up the queue pair travels inside it, and every socket of that
//! queue pair carries the identity it authenticated; the RDMA data path
//! itself is neither encrypted nor authenticated per packet, and relies on
//! the fabric being the fleet's).
//!
//! Off by default: on one host, or inside a network only the PS fleet
//! reaches, anyone who can reach a port is already trusted. A fleet turns
//! it on with a `[transport.tls]` table ([`TlsConfig`]): this process's
//! certificate chain and key, and the CA whose certificates peers must
//! carry. Both sides present a certificate and verify the other's against
//! the CA: a server refuses a client without one (or with one of another
//! CA), and a client refuses a server whose certificate does not name the
//! host it dialed (or [`TlsConfig::server_name`]).
//!
//! **Roles.** What a peer may call is said by its certificate: each URI
//! subject alternative name `urn:tessera:role:<name>` gives it the role
//! `<name>` ([`PeerIdentity`]); the RPC server checks the roles a service
//! requires (the ps-server's Admin and Replication services). URI SANs
//! are how SPIFFE and service meshes carry workload identity, they are
//! covered by the CA's signature, and any CA tooling (openssl, cfssl,
//! step-ca, cert-manager) can put them in.
//!
//! **Why rustls.** A memory-safe, well-kept TLS stack (the one tonic, hyper
//! and quinn use), with `tokio-rustls` for async streams and its WebPKI
//! verifiers for both directions; `ring` is its crypto provider here since
//! it builds with a C compiler alone. TLS 1.3 only: every peer is Tessera,
//! so nothing older needs to be spoken. `x509-parser` reads the roles out
//! of the verified certificate (rustls does not expose SANs).

use std::fmt;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use serde::{Deserialize, Serialize};
use tessera_config::{ConfigError, Validate, invalid};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
pub use tokio_rustls::TlsAcceptor;

/// The prefix of a URI subject alternative name that carries a role.
pub const ROLE_URI_PREFIX: &str = "urn:tessera:role:";

/// Metric: TLS handshakes refused (no certificate, wrong CA, wrong name,
/// not TLS), by `side` (`accept`, `connect`).
pub const TLS_REFUSED: &str = "tessera_transport_tls_handshakes_refused_total";

/// Mutual TLS settings (the `[transport.tls]` table). Present means on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM file: this process's certificate, then any intermediates. It is
    /// presented to every peer, as a server and as a client, so it names
    /// the host (DNS or IP SAN) that peers dial and carries this process's
    /// roles (`urn:tessera:role:<name>` URI SANs).
    pub cert: String,
    /// PEM file: the certificate's private key (PKCS#8, PKCS#1 or SEC1).
    pub key: String,
    /// PEM file: the CA certificate(s) whose certificates peers must carry,
    /// in both directions.
    pub ca: String,
    /// The name a dialed server's certificate must carry, instead of the
    /// host part of the address dialed. Default: none (the dialed host):
    /// set it where servers are dialed by addresses their certificates do
    /// not list (one fleet-wide name, for example).
    pub server_name: Option<String>,
}

impl Validate for TlsConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        for (key, value) in [("cert", &self.cert), ("key", &self.key), ("ca", &self.ca)] {
            if value.is_empty() {
                return Err(invalid(key, "must name a PEM file when [tls] is present"));
            }
        }
        if let Some(name) = &self.server_name
            && ServerName::try_from(name.as_str()).is_err()
        {
            return Err(invalid(
                "server_name",
                format!("`{name}` is neither a DNS name nor an IP address"),
            ));
        }
        Ok(())
    }
}

/// Why TLS could not be set up or a handshake failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("tls.{key} = {path}: {source}")]
    File {
        /// The setting (`cert`, `key`, `ca`).
        key: &'static str,
        /// The file.
        path: String,
        /// Why.
        source: rustls::pki_types::pem::Error,
    },
    /// A PEM file holds no certificate (or no key).
    #[error("tls.{key} = {path}: no {what} in the file")]
    Empty {
        /// The setting.
        key: &'static str,
        /// The file.
        path: String,
        /// What was looked for.
        what: &'static str,
    },
    /// rustls refused the certificates or key (a key that does not match
    /// the certificate, a CA that is not a CA, ...).
    #[error("tls: {0}")]
    Rustls(#[from] rustls::Error),
    /// The CA could not make a client verifier.
    #[error("tls.ca: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    /// The address dialed has no host part a certificate can name.
    #[error("tls: `{0}` has no host to verify the server's certificate by (set tls.server_name)")]
    ServerName(String),
    /// The handshake failed: the peer has no certificate, one of another
    /// CA, one that does not name the host, or does not speak TLS.
    #[error("tls handshake with {peer}: {source}")]
    Handshake {
        /// The peer.
        peer: std::net::SocketAddr,
        /// Why (rustls's error, as an I/O error).
        source: io::Error,
    },
}

/// Who the peer of a connection is, as its verified certificate says.
#[derive(Clone, PartialEq, Eq)]
pub struct PeerIdentity {
    subject: String,
    roles: Vec<String>,
}

impl fmt::Debug for PeerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerIdentity")
            .field("subject", &self.subject)
            .field("roles", &self.roles)
            .finish()
    }
}

impl PeerIdentity {
    /// The identity a verified end-entity certificate gives: its subject
    /// and the roles of its `urn:tessera:role:` URI SANs. A certificate
    /// that does not parse (rustls verified it, so it does) has no roles.
    pub fn of_certificate(der: &[u8]) -> Self {
        use x509_parser::extensions::GeneralName;
        let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
            return Self::unknown();
        };
        let mut roles = Vec::new();
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for name in &san.value.general_names {
                if let GeneralName::URI(uri) = name
                    && let Some(role) = uri.strip_prefix(ROLE_URI_PREFIX)
                    && !role.is_empty()
                {
                    roles.push(role.to_owned());
                }
            }
        }
        Self {
            subject: cert.subject().to_string(),
            roles,
        }
    }

    /// The identity of a verified chain's end-entity certificate (rustls
    /// verified one, so there is one; none gives no roles).
    fn of_chain(chain: Option<&[CertificateDer<'_>]>) -> Self {
        chain
            .and_then(|chain| chain.first())
            .map_or_else(Self::unknown, |cert| Self::of_certificate(cert))
    }

    /// No subject, no roles.
    fn unknown() -> Self {
        Self {
            subject: String::new(),
            roles: Vec::new(),
        }
    }

    /// The certificate's subject (`CN=worker-3, O=...`), for logs.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The roles the certificate gives.
    pub fn roles(&self) -> &[String] {
        &self.roles
    }

    /// Whether the certificate gives `role`.
    pub fn has_role(&self, role: &str) -> bool {
        self.roles.iter().any(|r| r == role)
    }
}

/// A byte stream of a connection: plain TCP, or TLS over it.
pub trait Stream: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Stream for T {}

/// A boxed [`Stream`].
pub type BoxStream = Box<dyn Stream>;

/// Loaded TLS settings: the server and client sides of one identity.
#[derive(Clone)]
pub struct Tls {
    acceptor: tokio_rustls::TlsAcceptor,
    connector: tokio_rustls::TlsConnector,
    server: Arc<ServerConfig>,
    server_name: Option<ServerName<'static>>,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_certs(key: &'static str, path: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let file = |source| TlsError::File {
        key,
        path: path.to_owned(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(file)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(file)?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            key,
            path: path.to_owned(),
            what: "CERTIFICATE block",
        });
    }
    Ok(certs)
}

impl Tls {
    /// Reads the certificates and key `config` names and builds both
    /// sides. Errors name the setting and file.
    pub fn load(config: &TlsConfig) -> Result<Self, TlsError> {
        let chain = read_certs("cert", &config.cert)?;
        let key = PrivateKeyDer::from_pem_file(&config.key).map_err(|source| match source {
            rustls::pki_types::pem::Error::NoItemsFound => TlsError::Empty {
                key: "key",
                path: config.key.clone(),
                what: "PRIVATE KEY block",
            },
            source => TlsError::File {
                key: "key",
                path: config.key.clone(),
                source,
            },
        })?;
        let mut roots = RootCertStore::empty();
        for ca in read_certs("ca", &config.ca)? {
            roots.add(ca)?;
        }
        let roots = Arc::new(roots);
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), provider()).build()?;
        let server = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())?;
        let client = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)?;
        let server_name = match &config.server_name {
            Some(name) => Some(
                ServerName::try_from(name.clone())
                    .map_err(|_| TlsError::ServerName(name.clone()))?,
            ),
            None => None,
        };
        let server = Arc::new(server);
        Ok(Self {
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::clone(&server)),
            connector: tokio_rustls::TlsConnector::from(Arc::new(client)),
            server,
            server_name,
        })
    }

    /// The server side for an HTTP/2 endpoint (the gRPC listener): the
    /// same certificates and client verification, with ALPN `h2`, which
    /// gRPC clients require.
    pub fn h2_acceptor(&self) -> tokio_rustls::TlsAcceptor {
        let mut server = (*self.server).clone();
        server.alpn_protocols = vec![b"h2".to_vec()];
        tokio_rustls::TlsAcceptor::from(Arc::new(server))
    }

    /// Runs the server side of the handshake on an accepted stream:
    /// the client must present a certificate of the CA.
    pub async fn accept<S: Stream>(
        &self,
        stream: S,
        peer: std::net::SocketAddr,
    ) -> Result<(tokio_rustls::server::TlsStream<S>, PeerIdentity), TlsError> {
        accept_with(&self.acceptor, stream, peer).await
    }

    /// Runs the client side of the handshake with the server dialed at
    /// `addr` ("host:port"): its certificate must be of the CA and name
    /// the host (or `server_name`).
    pub async fn connect<S: Stream>(
        &self,
        addr: &str,
        stream: S,
        peer: std::net::SocketAddr,
    ) -> Result<(tokio_rustls::client::TlsStream<S>, PeerIdentity), TlsError> {
        let name = match &self.server_name {
            Some(name) => name.clone(),
            None => host_name(addr)?,
        };
        match self.connector.connect(name, stream).await {
            Ok(stream) => {
                let identity = PeerIdentity::of_chain(stream.get_ref().1.peer_certificates());
                Ok((stream, identity))
            }
            Err(source) => {
                metrics::counter!(TLS_REFUSED, "side" => "connect").increment(1);
                Err(TlsError::Handshake { peer, source })
            }
        }
    }
}

/// The server side of a handshake with `acceptor` (the identity is the
/// client's verified certificate's).
pub async fn accept_with<S: Stream>(
    acceptor: &tokio_rustls::TlsAcceptor,
    stream: S,
    peer: std::net::SocketAddr,
) -> Result<(tokio_rustls::server::TlsStream<S>, PeerIdentity), TlsError> {
    match acceptor.accept(stream).await {
        Ok(stream) => {
            let identity = PeerIdentity::of_chain(stream.get_ref().1.peer_certificates());
            Ok((stream, identity))
        }
        Err(source) => {
            metrics::counter!(TLS_REFUSED, "side" => "accept").increment(1);
            Err(TlsError::Handshake { peer, source })
        }
    }
}

/// The host part of "host:port" (brackets of an IPv6 literal removed) as a
/// name to verify a certificate by.
fn host_name(addr: &str) -> Result<ServerName<'static>, TlsError> {
    let host = match addr.rsplit_once(':') {
        Some((host, port)) if port.parse::<u16>().is_ok() => host,
        _ => addr,
    };
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    ServerName::try_from(host.to_owned()).map_err(|_| TlsError::ServerName(addr.to_owned()))
}

/// A stream whose first bytes were already read (to tell an RDMA hello
/// from a TCP frame): they are read again first.
#[derive(Debug)]
pub(crate) struct Prefixed<S> {
    prefix: Vec<u8>,
    taken: usize,
    inner: S,
}

impl<S> Prefixed<S> {
    pub(crate) fn new(prefix: Vec<u8>, inner: S) -> Self {
        Self {
            prefix,
            taken: 0,
            inner,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.taken < self.prefix.len() {
            let rest = &self.prefix[self.taken..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            self.taken += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Sets `TCP_NODELAY` and returns the peer's address: what every
/// connection does before any handshake.
pub(crate) fn prepare(stream: &TcpStream) -> io::Result<std::net::SocketAddr> {
    stream.set_nodelay(true)?;
    stream.peer_addr()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_come_from_the_address_dialed() {
        assert_eq!(
            host_name("127.0.0.1:7000").ok(),
            ServerName::try_from("127.0.0.1").ok()
        );
        assert_eq!(
            host_name("[::1]:7000").ok(),
            ServerName::try_from("::1").ok()
        );
        assert_eq!(
            host_name("ps-0.ps.default.svc:7000").ok(),
            ServerName::try_from("ps-0.ps.default.svc").ok()
        );
        assert!(host_name("bad host:1").is_err());
    }

    #[test]
    fn the_config_names_missing_files_and_bad_server_names() {
        let err = TlsConfig::default().validate().unwrap_err();
        assert_eq!(err.key(), Some("cert"));
        let config = TlsConfig {
            cert: "a".into(),
            key: "b".into(),
            ca: "c".into(),
            server_name: Some("not a name".into()),
        };
        assert_eq!(config.validate().unwrap_err().key(), Some("server_name"));
    }

    #[test]
    fn a_missing_file_names_its_setting() {
        let config = TlsConfig {
            cert: "/nonexistent/cert.pem".into(),
            key: "/nonexistent/key.pem".into(),
            ca: "/nonexistent/ca.pem".into(),
            server_name: None,
        };
        let err = Tls::load(&config).unwrap_err();
        assert!(matches!(err, TlsError::File { key: "cert", .. }), "{err:?}");
    }

    #[test]
    fn roles_come_from_role_uris_only() {
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params.subject_alt_names.push(rcgen::SanType::URI(
            "urn:tessera:role:admin".try_into().unwrap(),
        ));
        params.subject_alt_names.push(rcgen::SanType::URI(
            "spiffe://fleet/worker".try_into().unwrap(),
        ));
        params
            .subject_alt_names
            .push(rcgen::SanType::URI("urn:tessera:role:".try_into().unwrap()));
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let identity = PeerIdentity::of_certificate(cert.der());
        assert_eq!(identity.roles(), ["admin".to_owned()]);
        assert!(identity.has_role("admin"));
        assert!(!identity.has_role("replication"));
        assert!(PeerIdentity::of_certificate(b"garbage").roles().is_empty());
    }
}
