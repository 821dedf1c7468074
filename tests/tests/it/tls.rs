//! TLS between the components, mutual: controller gRPC, agent proxy, and
//! a data plane reaching both, with certificates from a test CA.

use std::path::{Path, PathBuf};
use std::time::Duration;

use http::StatusCode;
use inferyes_agent::config::GpuSourceConfig;
use inferyes_proto::tls::Tls;
use inferyes_proto::v1::SubscribeRequest;
use inferyes_tests::fleet::llama_server;
use inferyes_tests::{AgentHandle, ControllerHandle, DataplaneHandle, Etcd, HttpClient, SimHandle};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};

use crate::support::{chat_body, chat_sim};

/// A CA and one certificate it signed, for `localhost` and 127.0.0.1,
/// good for serving and for client authentication.
pub(crate) struct Pki {
    dir: PathBuf,
}

impl Pki {
    pub(crate) fn create() -> Pki {
        let dir = std::env::temp_dir().join(format!("inferyes-pki-{}-{}", std::process::id(), fastrand::u32(..)));
        std::fs::create_dir_all(&dir).expect("pki dir");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, "Inferyes test CA");
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("ca key")).expect("ca");
        let key = KeyPair::generate().expect("key");
        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).expect("params");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &ca).expect("cert");
        std::fs::write(dir.join("ca.pem"), ca.pem()).expect("write");
        std::fs::write(dir.join("cert.pem"), cert.pem()).expect("write");
        std::fs::write(dir.join("key.pem"), key.serialize_pem()).expect("write");
        Pki { dir }
    }

    pub(crate) fn file(&self, name: &str) -> Option<PathBuf> {
        Some(self.dir.join(name))
    }

    /// Identity plus trust, mutual.
    fn full(&self) -> Tls {
        Tls {
            cert_file: self.file("cert.pem"),
            key_file: self.file("key.pem"),
            ca_file: self.file("ca.pem"),
            client_ca_file: self.file("ca.pem"),
        }
    }

    fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test]
async fn the_fleet_runs_over_mutual_tls_and_refuses_clients_without_a_certificate() {
    let pki = Pki::create();
    let etcd = Etcd::start().await;
    let tls = pki.full();
    let server_tls = tls.clone();
    let controller =
        ControllerHandle::start_with(&etcd.endpoint(), "controller-1", None, move |c| c.tls = server_tls).await;
    let sim = SimHandle::start(chat_sim("chat")).await;
    let backend = llama_server(&sim.url, &["chat"]);
    let agent_tls = tls.clone();
    let _agent = AgentHandle::start_tweaked(
        "node-a",
        &[controller.https_url()],
        GpuSourceConfig::Simulated,
        vec![backend],
        move |c| c.tls = agent_tls,
    )
    .await;
    let client_tls = Tls { client_ca_file: None, ..tls.clone() };
    let dataplane = DataplaneHandle::start_with(&[controller.https_url()], move |c| c.tls = client_tls).await;
    dataplane.wait_for_nodes(&["node-a"]).await;
    let snapshot = dataplane.store.current().expect("a snapshot over TLS");
    assert!(snapshot.nodes()[0].endpoint.proxy_url.as_str().starts_with("https://"), "the agent's proxy serves TLS");

    // The data plane reaches the agent over TLS, presenting its certificate.
    let response = HttpClient::default()
        .post_json(&format!("{}/v1/chat/completions", dataplane.url), &chat_body("chat", "over tls"))
        .await;
    assert_eq!(response.status, StatusCode::OK, "{}", String::from_utf8_lossy(&response.body));
    assert_eq!(response.header("x-inferyes-node"), Some("node-a"));

    // And over HTTP/2 (h2 by ALPN), which the agent says its proxy takes.
    assert!(snapshot.nodes()[0].endpoint.proxy_http2);
    let h2_tls = Tls { client_ca_file: None, ..tls.clone() };
    let h2_dataplane = DataplaneHandle::start_with(&[controller.https_url()], move |c| {
        c.tls = h2_tls;
        c.agent_protocol = inferyes_dataplane::config::AgentProtocol::Http2;
    })
    .await;
    h2_dataplane.wait_for_nodes(&["node-a"]).await;
    let mut stream = chat_body("chat", "over h2");
    stream["stream"] = serde_json::json!(true);
    let response = HttpClient::default().post_json(&format!("{}/v1/chat/completions", h2_dataplane.url), &stream).await;
    let text = String::from_utf8_lossy(&response.body);
    assert_eq!(response.status, StatusCode::OK, "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");

    // Without a client certificate the controller refuses the connection.
    let anonymous = Tls { ca_file: pki.file("ca.pem"), ..Tls::default() };
    let endpoint = inferyes_proto::tls::grpc_endpoint(&controller.https_url(), &anonymous).expect("endpoint");
    let refused = match tokio::time::timeout(Duration::from_secs(10), endpoint.connect()).await.expect("in time") {
        Err(_) => true,
        // The join token, so that only the missing certificate is wrong.
        Ok(channel) => inferyes_tests::fleet::routing_client(channel, Some(inferyes_tests::fleet::DATAPLANE_TOKEN))
            .subscribe(SubscribeRequest { dataplane_id: "anonymous".into() })
            .await
            .is_err(),
    };
    assert!(refused, "a client without a certificate got through");
    // And plain HTTP to the agent's proxy gets nowhere.
    let proxy = snapshot.nodes()[0].endpoint.proxy_url.as_str().replace("https://", "http://");
    let plain = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::spawn(async move { HttpClient::default().get(&format!("{proxy}/healthz")).await }),
    )
    .await
    .expect("in time");
    assert!(plain.is_err() || plain.as_ref().is_ok_and(|r| r.status != StatusCode::OK), "plain HTTP was served");
    assert!(pki.path().exists());
}

#[tokio::test]
async fn a_tls_connection_that_sends_nothing_after_its_handshake_is_closed() {
    use inferyes_net::serve::{DEFAULT_HTTP2_STREAMS, Options, serve};
    let pki = Pki::create();
    let tls = Tls { client_ca_file: None, ..pki.full() };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("bound");
    let ok = |_| {
        hyper::service::service_fn(|_: http::Request<hyper::body::Incoming>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                bytes::Bytes::from_static(b"ok"),
            )))
        })
    };
    let options = Options {
        name: "tls-quiet",
        tls: inferyes_net::tls::http_server(&tls).expect("server config"),
        http2_streams: DEFAULT_HTTP2_STREAMS,
        shutdown_grace: Duration::from_secs(10),
        past_grace: tokio_util::sync::CancellationToken::new(),
        header_read_timeout: Duration::from_millis(300),
        limit: inferyes_net::serve::ConnectionLimit::default(),
        max_requests_per_connection: 0,
        proxy_protocol: None,
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let served = tokio::spawn(serve(listener, vec![ok], options, shutdown.clone()));

    let client =
        inferyes_net::tls::http_client(&Tls { ca_file: pki.file("ca.pem"), ..Tls::default() }).expect("client config");
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(client));
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
    let mut quiet = connector.connect(name, tcp).await.expect("the handshake");
    // Handshaken, it sends nothing: hyper would wait on its first bytes for
    // ever; the header timeout closes it.
    let mut byte = [0u8; 1];
    let read =
        tokio::time::timeout(Duration::from_secs(10), tokio::io::AsyncReadExt::read(&mut quiet, &mut byte)).await;
    assert!(matches!(read, Ok(Ok(0) | Err(_))), "the quiet TLS connection is closed: {read:?}");
    shutdown.cancel();
    served.await.expect("joined").expect("served");
}
