//! How a controller reaches etcd where etcd guards itself: signed in as a
//! user where authentication is on, over mutual TLS where it serves it.

use std::time::Duration;

use inferyes_proto::tls::Tls;
use inferyes_proto::v1::CreateKeyRequest;
use inferyes_tests::etcd::EtcdTls;
use inferyes_tests::{ControllerHandle, Etcd};

use crate::tls::Pki;

const PASSWORD: &str = "an etcd password, spaces and all";

#[tokio::test]
async fn a_controller_signs_in_to_an_etcd_with_authentication_on() {
    let mut etcd = Etcd::start().await;
    etcd.enable_auth(PASSWORD).await;
    let dir = std::env::temp_dir().join(format!("inferyes-etcd-user-{}-{}", std::process::id(), fastrand::u32(..)));
    std::fs::create_dir_all(&dir).expect("a dir");
    let (right, wrong) = (dir.join("password"), dir.join("wrong"));
    std::fs::write(&right, format!("{PASSWORD}\n")).expect("written");
    std::fs::write(&wrong, "not the password\n").expect("written");

    // A wrong password is no reason to wait: the controller stops, saying so.
    let refused = inferyes_controller::Config {
        etcd_endpoints: vec![etcd.endpoint()],
        etcd_user: "root".into(),
        etcd_password_file: Some(wrong),
        admin_token: Some(inferyes_tests::fleet::ADMIN_TOKEN.into()),
        join_token: Some(inferyes_tests::fleet::JOIN_TOKEN.into()),
        grpc_listen: "127.0.0.1:0".parse().expect("an address"),
        http_listen: "127.0.0.1:0".parse().expect("an address"),
        ..Default::default()
    };
    refused.validate().expect("valid");
    let listeners = inferyes_controller::Listeners::bind(&refused).await.expect("bound");
    let shutdown = tokio_util::sync::CancellationToken::new();
    let run = inferyes_controller::run(refused.clone(), listeners, shutdown.clone());
    let error = tokio::time::timeout(Duration::from_secs(10), run).await.expect("stops at once").unwrap_err();
    assert!(format!("{error:#}").contains("authentication failed"), "{error:#}");

    // The right one, to an etcd not up yet: waited for, then the fleet is
    // read and written.
    etcd.stop();
    // Its port answers the controller's first try with nothing, then etcd
    // comes up there.
    let port: std::net::SocketAddr = etcd.endpoint().trim_start_matches("http://").parse().expect("an address");
    let stand_in = tokio::net::TcpListener::bind(port).await.expect("etcd's port free");
    let endpoint = etcd.endpoint();
    let starting = tokio::spawn(async move {
        ControllerHandle::start_with(&endpoint, "controller-1", None, |c| {
            c.etcd_user = "root".into();
            c.etcd_password_file = Some(right);
        })
        .await
    });
    let tried = tokio::time::timeout(Duration::from_secs(10), stand_in.accept()).await;
    drop((tried.expect("the controller tried etcd").expect("a connection"), stand_in));
    etcd.restart().await;
    let controller = starting.await.expect("the controller started");
    let mut fleet = controller.fleet().await;
    let request = CreateKeyRequest { name: "before".into(), ..Default::default() };
    fleet.create_key(request).await.expect("a key written");
    // Through etcd's restart, signed in again where etcd asks.
    etcd.stop();
    etcd.restart().await;
    inferyes_tests::eventually("a key written after etcd restarted", Duration::from_secs(20), || {
        let mut fleet = fleet.clone();
        async move { fleet.create_key(CreateKeyRequest { name: "after".into(), ..Default::default() }).await.is_ok() }
    })
    .await;
    controller.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_controller_reaches_an_etcd_over_mutual_tls() {
    let pki = Pki::create();
    let files = |name: &str| pki.file(name).expect("a file");
    let etcd = Etcd::start_tls(&EtcdTls { ca: files("ca.pem"), cert: files("cert.pem"), key: files("key.pem") }).await;
    assert!(etcd.endpoint().starts_with("https://"));
    let controller = ControllerHandle::start_with(&etcd.endpoint(), "controller-1", None, |c| {
        c.etcd_tls = Tls {
            ca_file: pki.file("ca.pem"),
            cert_file: pki.file("cert.pem"),
            key_file: pki.file("key.pem"),
            client_ca_file: None,
        };
    })
    .await;
    let mut fleet = controller.fleet().await;
    fleet.create_key(CreateKeyRequest { name: "over tls".into(), ..Default::default() }).await.expect("a key written");
    controller.stop().await;
}
