//! The rustls configurations of the HTTP servers and clients (an agent's
//! proxy, a data plane's connections to agents), made of a component's
//! [`Tls`] settings.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use inferyes_proto::tls::Tls;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// rustls server settings for an HTTP server (an agent's proxy).
pub fn http_server(tls: &Tls) -> anyhow::Result<Option<Arc<rustls::ServerConfig>>> {
    let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) else { return Ok(None) };
    let chain = certificates(cert, "tls.cert_file")?;
    let key = PrivateKeyDer::from_pem_file(key).with_context(|| format!("tls.key_file {}", key.display()))?;
    let builder = rustls::ServerConfig::builder();
    let builder = match &tls.client_ca_file {
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
pub fn http_client(tls: &Tls) -> anyhow::Result<rustls::ClientConfig> {
    let roots = match &tls.ca_file {
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
    let config = match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => {
            let chain = certificates(cert, "tls.cert_file")?;
            let key = PrivateKeyDer::from_pem_file(key).with_context(|| format!("tls.key_file {}", key.display()))?;
            builder.with_client_auth_cert(chain, key).context("tls.cert_file and tls.key_file do not match")?
        }
        _ => builder.with_no_client_auth(),
    };
    Ok(config)
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
