//! TLS between the components (rustls), off unless configured. One
//! `[tls]` section per component, PEM files:
//!
//! * `cert_file` + `key_file`: this component's identity, presented as a
//!   server (the controller's gRPC port, an agent's proxy) and as a client
//!   (mutual TLS) where the other side asks for one;
//! * `ca_file`: the CA that signs the servers this component connects to
//!   (else the system's roots);
//! * `client_ca_file`: as a server, require client certificates signed by
//!   it (mutual TLS).
//!
//! Addresses say whether TLS is used: `https://` controllers and agents
//! are reached over TLS, `http://` ones in the clear.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Tls {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_ca_file: Option<PathBuf>,
}

impl Tls {
    /// The section is consistent: a certificate comes with its key.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.cert_file.is_some() == self.key_file.is_some(),
            "tls.cert_file and tls.key_file go together: set both or neither"
        );
        anyhow::ensure!(
            self.client_ca_file.is_none() || self.cert_file.is_some(),
            "tls.client_ca_file (mutual TLS) needs this side's own tls.cert_file and tls.key_file"
        );
        Ok(())
    }

    /// Whether this side serves TLS.
    pub fn serves(&self) -> bool {
        self.cert_file.is_some()
    }

    fn identity_pem(&self) -> anyhow::Result<Option<(Vec<u8>, Vec<u8>)>> {
        match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => Ok(Some((read(cert, "tls.cert_file")?, read(key, "tls.key_file")?))),
            _ => Ok(None),
        }
    }

    /// The gRPC server's TLS, when this side serves it.
    pub fn grpc_server(&self) -> anyhow::Result<Option<tonic::transport::ServerTlsConfig>> {
        let Some((cert, key)) = self.identity_pem()? else { return Ok(None) };
        let mut config =
            tonic::transport::ServerTlsConfig::new().identity(tonic::transport::Identity::from_pem(cert, key));
        if let Some(ca) = &self.client_ca_file {
            config = config.client_ca_root(tonic::transport::Certificate::from_pem(read(ca, "tls.client_ca_file")?));
        }
        Ok(Some(config))
    }

    /// TLS for connecting to a gRPC server at `https://` addresses.
    pub fn grpc_client(&self) -> anyhow::Result<tonic::transport::ClientTlsConfig> {
        let mut config = tonic::transport::ClientTlsConfig::new();
        config = match &self.ca_file {
            Some(ca) => config.ca_certificate(tonic::transport::Certificate::from_pem(read(ca, "tls.ca_file")?)),
            None => config.with_native_roots(),
        };
        if let Some((cert, key)) = self.identity_pem()? {
            config = config.identity(tonic::transport::Identity::from_pem(cert, key));
        }
        Ok(config)
    }

    /// rustls server settings for an HTTP server (an agent's proxy).
    pub fn http_server(&self) -> anyhow::Result<Option<Arc<rustls::ServerConfig>>> {
        let (Some(cert), Some(key)) = (&self.cert_file, &self.key_file) else { return Ok(None) };
        let chain = certificates(cert, "tls.cert_file")?;
        let key = PrivateKeyDer::from_pem_file(key).with_context(|| format!("tls.key_file {}", key.display()))?;
        let builder = rustls::ServerConfig::builder();
        let builder = match &self.client_ca_file {
            Some(ca) => {
                let roots = Arc::new(roots(ca, "tls.client_ca_file")?);
                let verifier = rustls::server::WebPkiClientVerifier::builder(roots)
                    .build()
                    .context("tls.client_ca_file holds no usable CA")?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_single_cert(chain, key).context("tls.cert_file and tls.key_file do not match")?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Some(Arc::new(config)))
    }

    /// rustls client settings for HTTPS to agents.
    pub fn http_client(&self) -> anyhow::Result<rustls::ClientConfig> {
        let roots = match &self.ca_file {
            Some(ca) => roots(ca, "tls.ca_file")?,
            None => {
                let mut store = rustls::RootCertStore::empty();
                // Unreadable system certificates are skipped, as browsers do.
                for cert in rustls_native_certs::load_native_certs().certs {
                    let _ = store.add(cert);
                }
                store
            }
        };
        let builder = rustls::ClientConfig::builder().with_root_certificates(roots);
        let config = match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => {
                let chain = certificates(cert, "tls.cert_file")?;
                let key =
                    PrivateKeyDer::from_pem_file(key).with_context(|| format!("tls.key_file {}", key.display()))?;
                builder.with_client_auth_cert(chain, key).context("tls.cert_file and tls.key_file do not match")?
            }
            _ => builder.with_no_client_auth(),
        };
        Ok(config)
    }
}

fn read(path: &Path, what: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read {what} {}", path.display()))
}

fn certificates(path: &Path, what: &str) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .with_context(|| format!("cannot read {what} {}", path.display()))?
        .collect::<Result<_, _>>()
        .with_context(|| format!("{what} {} is not PEM", path.display()))?;
    anyhow::ensure!(!certs.is_empty(), "{what} {} holds no certificate", path.display());
    Ok(certs)
}

fn roots(path: &Path, what: &str) -> anyhow::Result<rustls::RootCertStore> {
    let mut store = rustls::RootCertStore::empty();
    for cert in certificates(path, what)? {
        store.add(cert).with_context(|| format!("{what} {}: not a usable CA certificate", path.display()))?;
    }
    Ok(store)
}

/// The endpoint of a long-lived stream to a controller (an agent's join, a
/// data plane's subscription, a peer's follow): quick to give up on a
/// connect, and pinged, so that a peer gone silent is noticed within
/// seconds and the caller moves on.
pub fn grpc_stream_endpoint(address: &str, tls: &Tls) -> anyhow::Result<tonic::transport::Endpoint> {
    Ok(grpc_endpoint(address, tls)?
        .connect_timeout(std::time::Duration::from_secs(2))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(std::time::Duration::from_secs(2))
        .keep_alive_timeout(std::time::Duration::from_secs(4))
        .keep_alive_while_idle(true))
}

/// A gRPC endpoint for `address`, over TLS when it is `https://`.
pub fn grpc_endpoint(address: &str, tls: &Tls) -> anyhow::Result<tonic::transport::Endpoint> {
    let endpoint = tonic::transport::Endpoint::from_shared(address.to_string())
        .with_context(|| format!("`{address}` is not a valid address (e.g. http://127.0.0.1:7070)"))?;
    if address.starts_with("https://") {
        return endpoint.tls_config(tls.grpc_client()?).with_context(|| format!("TLS settings for {address}"));
    }
    Ok(endpoint)
}
