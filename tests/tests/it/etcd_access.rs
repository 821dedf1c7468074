//! How a controller reaches etcd where etcd guards itself: signed in as a
//! user where authentication is on, over mutual TLS where it serves it.

use std::time::Duration;

use inferyes_proto::tls::Tls;
use inferyes_proto::v1::CreateKeyRequest;
use inferyes_tests::etcd::{EtcdJwt, EtcdTls, Guard};
use inferyes_tests::fleet::LEASE_TTL;
use inferyes_tests::{AgentHandle, ControllerHandle, DataplaneHandle, Etcd, SimHandle};

use crate::support::chat_sim;
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

/// etcd's JWT tokens run out (`ttl`): the controller signs in again where
/// etcd says its token is no longer good, its writes and new nodes go on,
/// and the leases it keeps alive hold.
#[tokio::test]
async fn a_controller_signs_in_again_when_its_etcd_token_runs_out() {
    let dir = std::env::temp_dir().join(format!("inferyes-etcd-jwt-{}-{}", std::process::id(), fastrand::u32(..)));
    std::fs::create_dir_all(&dir).expect("a dir");
    let key = rcgen::KeyPair::generate().expect("a signing key");
    let jwt =
        EtcdJwt { private_key: dir.join("jwt.key"), public_key: dir.join("jwt.pub"), ttl: Duration::from_secs(2) };
    std::fs::write(&jwt.private_key, key.serialize_pem()).expect("written");
    std::fs::write(&jwt.public_key, key.public_key_pem()).expect("written");
    let password = dir.join("password");
    std::fs::write(&password, PASSWORD).expect("written");
    let mut etcd = Etcd::start_guarded(Guard { jwt: Some(&jwt), ..Guard::default() }).await;
    etcd.enable_auth(PASSWORD).await;

    let controller = ControllerHandle::start_with(&etcd.endpoint(), "controller-1", None, |c| {
        c.etcd_user = "root".into();
        c.etcd_password_file = Some(password);
    })
    .await;
    let sims = [SimHandle::start(chat_sim("chat")).await, SimHandle::start(chat_sim("chat")).await];
    let _a = AgentHandle::start("node-a", &[controller.url()], &[("main", &sims[0])]).await;
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-a"]).await;
    let watch = dataplane.watch_snapshots();

    // Nothing outside etcd tells when a token has run out: the test waits
    // past two of its lives, and a node lease's.
    tokio::time::sleep(jwt.ttl * 2 + LEASE_TTL).await;
    let mut fleet = controller.fleet().await;
    let request = CreateKeyRequest { name: "later".into(), ..Default::default() };
    fleet.create_key(request).await.expect("a key written past the token's life");
    let _b = AgentHandle::start("node-b", &[controller.url()], &[("main", &sims[1])]).await;
    dataplane.wait_for_nodes(&["node-a", "node-b"]).await;
    assert_eq!(watch.fewest_nodes().await, 1, "node-a's lease was kept alive throughout");
    controller.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}
