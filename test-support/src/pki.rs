//! A throw-away PKI for TLS tests: a CA, certificates of it with roles
//! (`urn:tessera:role:<name>` URI SANs), and strangers' certificates of a
//! CA nobody here trusts. Files live in a temporary directory that goes
//! with the value.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use tessera_transport::TlsConfig;

/// A CA and the certificates it issued, as PEM files.
pub struct TestPki {
    dir: tempfile::TempDir,
    ca: CertifiedIssuer<'static, KeyPair>,
    ca_path: PathBuf,
}

impl std::fmt::Debug for TestPki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestPki")
            .field("dir", &self.dir.path())
            .finish()
    }
}

fn new_ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

impl TestPki {
    /// A fresh CA.
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ca = new_ca("Tessera test CA");
        let ca_path = dir.path().join("ca.pem");
        std::fs::write(&ca_path, ca.pem()).unwrap();
        Self { dir, ca, ca_path }
    }

    /// The CA certificate's file.
    pub fn ca_path(&self) -> &Path {
        &self.ca_path
    }

    /// A certificate of this CA with common name `name`, valid for
    /// `localhost` and `127.0.0.1`, giving `roles`; the settings that
    /// present it and trust this CA.
    pub fn identity(&self, name: &str, roles: &[&str]) -> TlsConfig {
        self.issue(name, roles, &self.ca, &self.ca_path)
    }

    /// A certificate of another CA (made for it, trusted by nobody else),
    /// the settings that present it and trust only that CA: a stranger to
    /// this PKI's peers, and they to it.
    pub fn stranger(&self, name: &str, roles: &[&str]) -> TlsConfig {
        let ca = new_ca("Some other CA");
        let ca_path = self.dir.path().join(format!("{name}-other-ca.pem"));
        std::fs::write(&ca_path, ca.pem()).unwrap();
        self.issue(name, roles, &ca, &ca_path)
    }

    fn issue(
        &self,
        name: &str,
        roles: &[&str],
        ca: &CertifiedIssuer<'static, KeyPair>,
        ca_path: &Path,
    ) -> TlsConfig {
        let mut params =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        for role in roles {
            params.subject_alt_names.push(SanType::URI(
                format!("urn:tessera:role:{role}").try_into().unwrap(),
            ));
        }
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, ca).unwrap();
        let cert_path = self.dir.path().join(format!("{name}.pem"));
        let key_path = self.dir.path().join(format!("{name}.key"));
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        TlsConfig {
            cert: cert_path.display().to_string(),
            key: key_path.display().to_string(),
            ca: ca_path.display().to_string(),
            server_name: None,
        }
    }
}

impl Default for TestPki {
    fn default() -> Self {
        Self::new()
    }
}
