//! Every listener shares its connections: one address holding many, silent
//! or trickling a request's head, takes only its own share, and the others
//! (clients, data planes, agents, operators) are served meanwhile. The
//! attacker's connections come from 127.0.0.2, everyone else's from
//! 127.0.0.1.

use std::net::SocketAddr;
use std::time::Duration;

use http::StatusCode;
use inferyes_tests::etcd::Etcd;
use inferyes_tests::fleet::{AgentHandle, ControllerHandle, DataplaneHandle, SimHandle, sim_backends};
use inferyes_tests::{HttpClient, eventually};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::{Fleet, chat_body, chat_sim, scraped};

const ATTACKER: &str = "127.0.0.2";

/// `count` connections to `address` from `source`, each sending `first`
/// (nothing if empty) and then nothing more.
async fn hold(source: &str, address: SocketAddr, count: usize, first: &[u8]) -> Vec<TcpStream> {
    let mut held = Vec::with_capacity(count);
    for _ in 0..count {
        let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
        socket.bind(SocketAddr::new(source.parse().expect("an address"), 0)).expect("a loopback address");
        let mut stream = socket.connect(address).await.expect("connected");
        if !first.is_empty() {
            stream.write_all(first).await.expect("sent");
        }
        held.push(stream);
    }
    held
}

/// Which of `held` the server closes within `within`, all together: a
/// refused connection is closed within a second (after its refusal, where
/// it sent something); one taken stays open. Gives back the open ones.
async fn closed_within(held: Vec<TcpStream>, within: Duration) -> (usize, Vec<TcpStream>) {
    let mut reads = tokio::task::JoinSet::new();
    for mut stream in held {
        reads.spawn(async move {
            let mut sink = [0u8; 1024];
            let read = async {
                loop {
                    match stream.read(&mut sink).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                }
            };
            let closed = tokio::time::timeout(within, read).await.is_ok();
            (!closed).then_some(stream)
        });
    }
    let outcomes = reads.join_all().await;
    let closed = outcomes.iter().filter(|open| open.is_none()).count();
    (closed, outcomes.into_iter().flatten().collect())
}

fn socket_address(url: &str) -> SocketAddr {
    url.trim_start_matches("http://").parse().expect("host:port")
}

#[tokio::test]
async fn one_address_trickling_heads_takes_its_share_of_a_data_plane_and_others_are_served() {
    let fleet = Fleet::start_with(vec![chat_sim("chat")], |config| {
        config.max_connections = 40;
        config.max_connections_per_client = 10;
    })
    .await;
    let dataplane = &fleet.dataplane;
    // More than the whole data plane holds, each with half a head.
    let attacker = hold(ATTACKER, socket_address(&dataplane.url), 60, b"POST /v1/chat/completions HTTP/1.1\r\n").await;
    let url = format!("{}/v1/chat/completions", dataplane.url);
    let served =
        tokio::time::timeout(Duration::from_secs(2), fleet.http.post_json(&url, &chat_body("chat", "hi"))).await;
    assert_eq!(served.expect("another address is served within 2 s").status, StatusCode::OK);
    let (closed, _held) = closed_within(attacker, Duration::from_secs(3)).await;
    assert_eq!(closed, 50, "only its share of 10 is held");
    let metrics = format!("{}/metrics", dataplane.admin_url);
    let refused =
        scraped(&fleet.http, &metrics, "inferyes_dataplane_connections_refused_total", "reason=\"peer\"").await;
    assert_eq!(refused, 50.0);
}

/// etcd, a controller and node-a's agent over a simulated llama-server,
/// its configuration tweaked.
async fn agent_of(tweak: impl FnOnce(&mut inferyes_agent::Config)) -> (Etcd, ControllerHandle, SimHandle, AgentHandle) {
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let sim = SimHandle::start(chat_sim("chat")).await;
    let agent = AgentHandle::start_tweaked(
        "node-a",
        &[controller.url()],
        inferyes_agent::config::GpuSourceConfig::Simulated,
        sim_backends(&[("main", &sim)]),
        tweak,
    )
    .await;
    (etcd, controller, sim, agent)
}

#[tokio::test]
async fn silent_strangers_cost_an_agent_a_bounded_share_and_its_data_planes_are_served() {
    let (_etcd, controller, _sim, agent) = agent_of(|config| {
        config.max_stranger_connections = 12;
        config.max_stranger_connections_per_address = 4;
    })
    .await;
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-a"]).await;
    let http = HttpClient::default();
    let url = format!("{}/v1/chat/completions", dataplane.url);
    // The data plane's first request proves the fleet's credential.
    assert_eq!(http.post_json(&url, &chat_body("chat", "hi")).await.status, StatusCode::OK);

    // Strangers, from four addresses: each past its share, and all past
    // what strangers may hold together: the newest take the places of the
    // oldest.
    let mut by_source = Vec::new();
    for source in ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"] {
        let (closed, open) = closed_within(hold(source, agent.proxy_addr, 6, b"").await, Duration::from_secs(3)).await;
        assert_eq!((closed, open.len()), (2, 4), "{source}: its share of 4");
        by_source.push(open);
    }
    let (closed, _) = closed_within(by_source.remove(0), Duration::from_secs(3)).await;
    assert_eq!(closed, 4, "the oldest made room for the newest");
    let (closed, held) = closed_within(by_source.into_iter().flatten().collect(), Duration::from_secs(1)).await;
    assert_eq!((closed, held.len()), (0, 12), "12 strangers in all");

    // The data plane is served meanwhile, on new connections too.
    let mut chats = tokio::task::JoinSet::new();
    for n in 0..16 {
        let (http, url) = (http.clone(), url.clone());
        chats.spawn(async move { http.post_json(&url, &chat_body("chat", &format!("hello {n}"))).await.status });
    }
    assert!(chats.join_all().await.iter().all(|status| *status == StatusCode::OK));
    let refused = |reason: &'static str| {
        let (http, url) = (http.clone(), format!("http://{}/metrics", agent.admin_addr));
        async move {
            scraped(&http, &url, "inferyes_agent_connections_refused_total", &format!("reason=\"{reason}\"")).await
        }
    };
    assert_eq!((refused("peer").await, refused("strangers").await), (8.0, 4.0));
    drop(held);
    agent.stop().await;
}

#[tokio::test]
async fn an_agent_s_configured_prober_is_answered_while_strangers_fill_their_places() {
    let (_etcd, _controller, _sim, agent) = agent_of(|config| {
        config.max_stranger_connections = 8;
        config.max_stranger_connections_per_address = 4;
        config.trusted_probers = vec!["127.0.0.9/32".parse().expect("a block")];
    })
    .await;
    let strangers =
        [hold("127.0.0.2", agent.proxy_addr, 4, b"").await, hold("127.0.0.3", agent.proxy_addr, 4, b"").await];
    // More probes at once than a stranger's address may hold, each
    // answered, none taking a stranger's place.
    let mut probes = tokio::task::JoinSet::new();
    for _ in 0..6 {
        let address = agent.proxy_addr;
        probes.spawn(async move {
            exchange("127.0.0.9", address, b"GET /healthz HTTP/1.1\r\nhost: agent\r\nconnection: close\r\n\r\n").await
        });
    }
    for answer in probes.join_all().await {
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    let (closed, _held) = closed_within(strangers.into_iter().flatten().collect(), Duration::from_secs(1)).await;
    assert_eq!(closed, 0, "no stranger made room for a probe");
    let metrics = format!("http://{}/metrics", agent.admin_addr);
    let refused = scraped(&HttpClient::default(), &metrics, "inferyes_agent_connections_refused_total", "").await;
    assert_eq!(refused, 0.0);
    agent.stop().await;
}

/// An HTTP/2 connection to `address` from `source`, its preface sent,
/// and the concurrent streams the server offers it: its first SETTINGS
/// frame's `MAX_CONCURRENT_STREAMS` (`None`: no limit said).
async fn http2(source: &str, address: SocketAddr) -> (TcpStream, Option<u32>) {
    let [mut stream] = <[TcpStream; 1]>::try_from(hold(source, address, 1, b"").await).expect("one connection");
    // The client's preface, and its (empty) SETTINGS frame.
    stream.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0").await.expect("sent");
    let (kind, settings) = frame(&mut stream).await.expect("a frame");
    assert_eq!(kind, 0x4, "the server's first frame is its SETTINGS");
    let offered = settings
        .chunks_exact(6)
        .find(|setting| setting[..2] == [0, 3])
        .map(|setting| u32::from_be_bytes([setting[2], setting[3], setting[4], setting[5]]));
    (stream, offered)
}

/// The next HTTP/2 frame's type and payload; `None` once the connection
/// is closed.
async fn frame(stream: &mut TcpStream) -> Option<(u8, Vec<u8>)> {
    let mut head = [0u8; 9];
    tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut head)).await.expect("in time").ok()?;
    let mut payload = vec![0u8; usize::from(head[2]) | usize::from(head[1]) << 8 | usize::from(head[0]) << 16];
    stream.read_exact(&mut payload).await.ok()?;
    Some((head[3], payload))
}

async fn offered_streams(source: &str, address: SocketAddr) -> Option<u32> {
    http2(source, address).await.1
}

#[tokio::test]
async fn an_agent_offers_a_stranger_a_few_hundred_streams_and_its_data_planes_more() {
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let sim = SimHandle::start(chat_sim("chat")).await;
    let agent = AgentHandle::start("node-a", &[controller.url()], &[("main", &sim)]).await;
    // Opened before the data plane proves the fleet's credential for its
    // address: a stranger's, and asked to go once the address is proved.
    let (mut early, offered) = http2("127.0.0.1", agent.proxy_addr).await;
    assert!(offered.is_some_and(|streams| streams <= 200), "a stranger is offered {offered:?} streams");
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-a"]).await;
    // The data plane's first request proves the fleet's credential for
    // 127.0.0.1.
    let http = HttpClient::default();
    let url = format!("{}/v1/chat/completions", dataplane.url);
    assert_eq!(http.post_json(&url, &chat_body("chat", "hi")).await.status, StatusCode::OK);

    let offered = offered_streams(ATTACKER, agent.proxy_addr).await;
    assert!(offered.is_some_and(|streams| streams <= 200), "a stranger is offered {offered:?} streams");
    let offered = offered_streams("127.0.0.1", agent.proxy_addr).await;
    assert!(offered.is_some_and(|streams| streams > 1_000), "a data plane's address is offered {offered:?} streams");
    // The early connection is sent a GOAWAY (within seconds: it is looked
    // at every second), and its client opens a member's next.
    let goaway = async {
        loop {
            match frame(&mut early).await {
                Some((0x7, _)) => return true,
                Some(_) => continue,
                None => return false,
            }
        }
    };
    assert!(tokio::time::timeout(Duration::from_secs(10), goaway).await.expect("in time"), "a GOAWAY");
    agent.stop().await;
}

#[tokio::test]
async fn silent_connections_to_a_controller_take_its_share_and_its_fleet_and_operators_are_served() {
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start_with(&etcd.endpoint(), "controller-1", None, |config| {
        config.max_http_connections_per_address = 8;
        config.max_grpc_stranger_connections_per_address = 8;
        config.max_grpc_stranger_connections = 16;
    })
    .await;
    let on_http = hold(ATTACKER, controller.http_addr, 50, b"").await;
    let on_grpc = hold(ATTACKER, controller.grpc_addr, 50, b"").await;
    let (closed, on_http) = closed_within(on_http, Duration::from_secs(3)).await;
    assert_eq!(closed, 42, "HTTP: 8 per address");
    let (closed, on_grpc) = closed_within(on_grpc, Duration::from_secs(3)).await;
    assert_eq!(closed, 42, "gRPC: 8 per stranger address");
    // Another address fills what strangers may hold on the gRPC port.
    let (closed, more_on_grpc) =
        closed_within(hold("127.0.0.3", controller.grpc_addr, 8, b"").await, Duration::from_secs(1)).await;
    assert_eq!(closed, 0);

    // Operators, agents and data planes are served meanwhile: an agent
    // and a data plane, strangers until a call of theirs succeeds, take
    // the places of the oldest strangers' connections.
    let http = HttpClient::default();
    let ready = format!("http://{}/readyz", controller.http_addr);
    assert_eq!(http.get(&ready).await.status, StatusCode::OK);
    let sim = SimHandle::start(chat_sim("chat")).await;
    let agent = AgentHandle::start("node-a", &[controller.url()], &[("main", &sim)]).await;
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-a"]).await;
    let mut fleet = controller.fleet().await;
    let nodes = fleet.list_nodes(inferyes_proto::v1::ListNodesRequest::default()).await.unwrap().into_inner();
    assert_eq!(nodes.nodes.len(), 1);

    // A peer one of whose calls succeeded is a member: its connections
    // are no longer counted against its address's share.
    let members = hold("127.0.0.1", controller.grpc_addr, 12, b"").await;
    let (closed, members) = closed_within(members, Duration::from_secs(1)).await;
    assert_eq!(closed, 0, "a member's connections are taken");
    let metrics = format!("http://{}/metrics", controller.http_addr);
    let refused = |reason| scraped(&http, &metrics, "inferyes_controller_connections_refused_total", reason);
    eventually("the refusals counted", Duration::from_secs(5), || async {
        refused("port=\"grpc\",reason=\"peer\"").await == 42.0
    })
    .await;
    assert!(refused("port=\"grpc\",reason=\"strangers\"").await >= 1.0, "a newcomer made room");
    let (closed, _) = closed_within(on_grpc, Duration::from_secs(1)).await;
    assert!(closed >= 1, "the oldest strangers' connections made room");
    drop((members, on_http, more_on_grpc));
    agent.stop().await;
}

/// What a connection from `source` that sends `bytes` is answered, until
/// the data plane closes it.
async fn exchange(source: &str, address: SocketAddr, bytes: &[u8]) -> String {
    let mut connection = hold(source, address, 1, bytes).await.pop().expect("a connection");
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), connection.read_to_end(&mut answer)).await;
    let _ = read.expect("answered, or closed, in time");
    String::from_utf8_lossy(&answer).into_owned()
}

/// Behind a proxy that speaks the PROXY protocol, each client it relays
/// has a share of the data plane of its own: one client's trickled heads
/// take its share, another client relayed by the same proxy is served, and
/// a connection from the proxy without the header is served nothing.
#[tokio::test]
async fn clients_relayed_by_the_proxy_protocol_each_have_their_own_share() {
    let proxy = ATTACKER;
    let fleet = Fleet::start_with(vec![chat_sim("chat")], |config| {
        config.max_connections = 40;
        config.max_connections_per_client = 10;
        config.trusted_proxies = vec![proxy.parse().expect("an address")];
        config.proxy_protocol = true;
    })
    .await;
    let address = socket_address(&fleet.dataplane.url);
    let header = |client: &str| format!("PROXY TCP4 {client} 127.0.0.1 40000 8080\r\n");
    let trickled = format!("{}POST /v1/chat/completions HTTP/1.1\r\n", header("192.0.2.1"));
    let trickling = hold(proxy, address, 30, trickled.as_bytes()).await;
    let body = chat_body("chat", "hi").to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let relayed = exchange(proxy, address, format!("{}{request}", header("192.0.2.2")).as_bytes()).await;
    assert!(relayed.starts_with("HTTP/1.1 200"), "another relayed client is served: {relayed}");
    let (closed, _held) = closed_within(trickling, Duration::from_secs(3)).await;
    assert_eq!(closed, 20, "the trickling client holds its share of 10");
    let bare = exchange(proxy, address, request.as_bytes()).await;
    assert_eq!(bare, "", "nothing for a connection from the proxy without the header");
    let metrics = format!("{}/metrics", fleet.dataplane.admin_url);
    let refused =
        scraped(&fleet.http, &metrics, "inferyes_dataplane_connections_refused_total", "reason=\"peer\"").await;
    assert_eq!(refused, 20.0);
}
