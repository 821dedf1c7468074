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

use anyhow::Context;
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
        // A client that stalls its handshake holds nothing for long.
        let mut config = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(cert, key))
            .timeout(std::time::Duration::from_secs(10));
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
}

fn read(path: &Path, what: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read {what} {}", path.display()))
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
