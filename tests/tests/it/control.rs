use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use inferyes_proto::v1::{DrainRequest, FollowLiveRequest, ListNodesRequest, UndrainRequest};
use inferyes_tests::{AgentHandle, ControllerHandle, DataplaneHandle, Etcd, HttpClient, SimHandle, eventually};

use crate::support::{Fleet, chat_body, chat_sim, scraped};

async fn chat(fleet: &Fleet, session: &str) -> inferyes_tests::TestResponse {
    fleet
        .http
        .send(
            Method::POST,
            &fleet.url("/v1/chat/completions"),
            Bytes::from(chat_body("chat", "hi").to_string()),
            &[("x-session-id", session)],
        )
        .await
}

#[tokio::test]
async fn the_data_plane_keeps_serving_without_controllers_and_catches_up_after() {
    let mut fleet = Fleet::start(vec![chat_sim("chat"), chat_sim("chat")]).await;
    let version_before = fleet.dataplane.store.version().expect("a snapshot");
    let grpc_addr = fleet.controller().grpc_addr;
    let etcd = fleet.etcd.endpoint();
    fleet.controller.take().expect("running").stop().await;

    // No controller anywhere: requests are still routed on the last snapshot.
    for i in 0..6 {
        let response = chat(&fleet, &format!("offline-{i}")).await;
        assert_eq!(response.status, StatusCode::OK, "{}", String::from_utf8_lossy(&response.body));
    }
    let ready = fleet.http.get(&fleet.url("/readyz")).await;
    assert_eq!(ready.status, StatusCode::OK);
    assert_eq!(fleet.dataplane.store.version(), Some(version_before));

    // Long enough for the nodes' leases to run out: etcd forgets them.
    eventually("the nodes' leases expired", Duration::from_secs(10), || {
        let etcd = etcd.clone();
        async move {
            let mut client = etcd_client::Client::connect([etcd], None).await.unwrap();
            let options = etcd_client::GetOptions::new().with_prefix().with_keys_only();
            client.get("/inferyes/v1/nodes/", Some(options)).await.unwrap().kvs().is_empty()
        }
    })
    .await;

    // Watch every snapshot the data plane installs from now on.
    let watch = fleet.dataplane.watch_snapshots();

    // A controller comes back at the same address. It waits for the agents
    // to re-register before it serves data planes, so the data plane never
    // sees a fleet without them; then a change made now reaches it.
    fleet.controller =
        Some(ControllerHandle::start_with(&etcd, "controller-2", Some(grpc_addr), |c| c.startup_grace_ms = 3000).await);
    fleet
        .dataplane
        .wait_for("a newer snapshot with both nodes", Duration::from_secs(15), |s| {
            s.version() > version_before && s.nodes().len() == 2
        })
        .await;
    assert_eq!(watch.fewest_nodes().await, 2, "the data plane saw the fleet without its nodes");
    let mut admin = fleet.controller().fleet().await;
    admin.drain(DrainRequest { node_id: "node-a".into(), reason: "test".into(), force: false }).await.unwrap();
    fleet
        .dataplane
        .wait_for("node-a draining", Duration::from_secs(10), |s| {
            s.nodes().iter().any(|n| n.id.as_ref() == "node-a" && n.draining)
        })
        .await;
    for i in 0..4 {
        let response = chat(&fleet, &format!("after-{i}")).await;
        assert_eq!(response.header("x-inferyes-node"), Some("node-b"));
    }
}

/// Two controllers, node-a's agent on the first and node-b's on the
/// second, and a data plane following each.
struct Split {
    _etcd: Etcd,
    one: ControllerHandle,
    two: ControllerHandle,
    _sims: [SimHandle; 2],
    _agents: [AgentHandle; 2],
    dp_one: DataplaneHandle,
    dp_two: DataplaneHandle,
}

impl Split {
    async fn start() -> Split {
        let etcd = Etcd::start().await;
        let one = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
        let two = ControllerHandle::start(&etcd.endpoint(), "controller-2").await;
        let sims = [SimHandle::start(chat_sim("chat")).await, SimHandle::start(chat_sim("chat")).await];
        let agents = [
            AgentHandle::start("node-a", &[one.url()], &[("main", &sims[0])]).await,
            AgentHandle::start("node-b", &[two.url()], &[("main", &sims[1])]).await,
        ];
        let dp_one = DataplaneHandle::start(&[one.url()]).await;
        let dp_two = DataplaneHandle::start(&[two.url()]).await;
        for dp in [&dp_one, &dp_two] {
            dp.wait_for_nodes(&["node-a", "node-b"]).await;
            // Each node's load reaches the other controller's data plane
            // through the peers' stream, after its record: until then it
            // is unknown, and takes no new sessions.
            dp.wait_for("every node's load known", Duration::from_secs(10), |s| {
                s.nodes().iter().all(|n| n.backends.iter().all(|b| !b.load_unknown))
            })
            .await;
        }
        Split { _etcd: etcd, one, two, _sims: sims, _agents: agents, dp_one, dp_two }
    }
}

/// A controller's live state (every tenant's session keys) goes to its
/// peers only: the data plane token, which takes every other
/// RoutingService call, does not follow it, whatever peer it names.
#[tokio::test]
async fn only_a_controller_follows_another_s_live_state() {
    let etcd = Etcd::start().await;
    let one = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let _two = ControllerHandle::start(&etcd.endpoint(), "controller-2").await;
    let follow = |credential: Option<String>| {
        let one = &one;
        async move {
            let mut routing = one.routing(Some(inferyes_tests::fleet::DATAPLANE_TOKEN)).await;
            let mut request = tonic::Request::new(FollowLiveRequest { controller_id: "controller-2".into() });
            if let Some(credential) = credential {
                let value = credential.parse().expect("ascii");
                request.metadata_mut().insert(inferyes_proto::bearer::PEER_CREDENTIAL, value);
            }
            routing.follow_live(request).await.map(|_| ())
        }
    };
    let peer = inferyes_proto::bearer::peer_credential(inferyes_tests::JOIN_TOKEN);
    // Once controller-1 knows controller-2 from etcd, a peer is let in.
    eventually("controller-2 followed", Duration::from_secs(10), || {
        let followed = follow(Some(peer.clone()));
        async move { followed.await.is_ok() }
    })
    .await;
    for credential in [None, Some(inferyes_proto::bearer::peer_credential("not-the-join-token-0123"))] {
        let refused = follow(credential).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
        assert!(refused.message().contains("controller's credential"), "{refused:?}");
    }
}

#[tokio::test]
async fn two_controllers_serve_the_same_snapshot_version() {
    let split = Split::start().await;
    let (one, two, dp_one, dp_two) = (&split.one, &split.two, &split.dp_one, &split.dp_two);

    let mut fleet_one = one.fleet().await;
    let mut fleet_two = two.fleet().await;
    // Drain through one controller; both must serve it at one version.
    let drained = fleet_one
        .drain(DrainRequest { node_id: "node-b".into(), reason: String::new(), force: false })
        .await
        .unwrap()
        .into_inner();
    for dp in [&dp_one, &dp_two] {
        dp.wait_for("drain revision", Duration::from_secs(10), |s| s.version() >= drained.revision).await;
    }
    eventually("both controllers at one version", Duration::from_secs(10), || {
        let (mut f1, mut f2) = (fleet_one.clone(), fleet_two.clone());
        async move {
            let v1 = f1.list_nodes(ListNodesRequest {}).await.unwrap().into_inner();
            let v2 = f2.list_nodes(ListNodesRequest {}).await.unwrap().into_inner();
            v1.version == v2.version && v1.nodes == v2.nodes && v1.nodes.iter().any(|n| n.draining)
        }
    })
    .await;
    let listed = fleet_two.list_nodes(ListNodesRequest {}).await.unwrap().into_inner();
    assert!(listed.version >= drained.revision);
    assert_eq!(dp_one.store.version(), dp_two.store.version());

    fleet_two.undrain(UndrainRequest { node_id: "node-b".into() }).await.unwrap();
    dp_one.wait_for("node-b undrained", Duration::from_secs(10), |s| s.nodes().iter().all(|n| !n.draining)).await;
}

#[tokio::test]
async fn draining_stops_new_sessions_and_is_persisted() {
    let fleet = Fleet::start(vec![chat_sim("chat"), chat_sim("chat")]).await;
    let mut admin = fleet.controller().fleet().await;
    let unknown = admin.drain(DrainRequest { node_id: "node-z".into(), reason: String::new(), force: false }).await;
    assert_eq!(unknown.unwrap_err().code(), tonic::Code::NotFound);

    admin.drain(DrainRequest { node_id: "node-a".into(), reason: "maintenance".into(), force: false }).await.unwrap();
    fleet
        .dataplane
        .wait_for("node-a draining", Duration::from_secs(10), |s| {
            s.nodes().iter().any(|n| n.id.as_ref() == "node-a" && n.draining)
        })
        .await;
    for i in 0..6 {
        assert_eq!(chat(&fleet, &format!("new-{i}")).await.header("x-inferyes-node"), Some("node-b"));
    }
    let nodes = admin.list_nodes(ListNodesRequest {}).await.unwrap().into_inner();
    let a = nodes.nodes.iter().find(|n| n.status.as_ref().unwrap().node_id == "node-a").unwrap();
    assert!(a.draining);

    // Everything drained: no capacity, said at once with Retry-After.
    admin.drain(DrainRequest { node_id: "node-b".into(), reason: String::new(), force: false }).await.unwrap();
    fleet.dataplane.wait_for("all drained", Duration::from_secs(10), |s| s.nodes().iter().all(|n| n.draining)).await;
    let refused = chat(&fleet, "refused").await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(refused.openai_error()["code"], "no_capacity");
}

#[tokio::test]
async fn the_data_plane_is_not_ready_before_its_first_snapshot() {
    // A controller address nobody listens on.
    let dataplane = DataplaneHandle::start(&["http://127.0.0.1:9".to_string()]).await;
    let http = HttpClient::default();
    let ready = http.get(&format!("{}/readyz", dataplane.url)).await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
    let health = http.get(&format!("{}/healthz", dataplane.url)).await;
    assert_eq!(health.status, StatusCode::OK);
    let chat = http.post_json(&format!("{}/v1/chat/completions", dataplane.url), &chat_body("chat", "hi")).await;
    assert_eq!(chat.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(chat.header("retry-after"), Some("1"));
    assert_eq!(chat.openai_error()["code"], "not_ready");
}

#[tokio::test]
async fn a_silent_agent_is_dropped_after_the_lease_ttl() {
    use inferyes_proto::v1::agent_service_client::AgentServiceClient;
    use inferyes_proto::v1::{AgentMessage, NodeStatus, Register, agent_message};
    use inferyes_tests::fleet::LEASE_TTL;

    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    // An agent whose host hangs: it registers, then the connection stays
    // open but nothing more is ever sent.
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let status = NodeStatus { node_id: "hung".into(), proxy_url: "http://127.0.0.1:9".into(), ..Default::default() };
    let register =
        Register { status: Some(status), join_token: inferyes_tests::fleet::JOIN_TOKEN.into(), ..Default::default() };
    tx.send(AgentMessage { msg: Some(agent_message::Msg::Register(register)) }).await.unwrap();
    let mut agents = AgentServiceClient::connect(controller.url()).await.unwrap();
    let mut inbound = agents.join(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
    assert!(inbound.message().await.unwrap().is_some(), "registration confirmed");
    let last_heard = std::time::Instant::now();

    let admin = controller.fleet().await;
    eventually("the node joined", Duration::from_secs(5), || {
        let mut admin = admin.clone();
        async move { admin.list_nodes(ListNodesRequest {}).await.unwrap().into_inner().nodes.len() == 1 }
    })
    .await;
    eventually("the silent node left", LEASE_TTL * 3, || {
        let mut admin = admin.clone();
        async move { admin.list_nodes(ListNodesRequest {}).await.unwrap().into_inner().nodes.is_empty() }
    })
    .await;
    let gone_after = last_heard.elapsed();
    assert!(gone_after >= LEASE_TTL, "dropped after {gone_after:?}, before the TTL");
    assert!(gone_after <= LEASE_TTL * 4 / 3 + Duration::from_secs(1), "dropped only after {gone_after:?}");
    // The controller ended the stream and told the agent why.
    let ended = loop {
        match inbound.message().await {
            Ok(Some(_)) => continue,
            other => break other,
        }
    };
    assert_eq!(ended.unwrap_err().code(), tonic::Code::DeadlineExceeded);
    drop(tx);
}

/// Joins `status`'s node as an agent of `instance` would, with nothing
/// more to say: its stream lasts while the sender returned lasts.
async fn join_as(
    agents: &inferyes_proto::v1::agent_service_client::AgentServiceClient<tonic::transport::Channel>,
    status: inferyes_proto::v1::NodeStatus,
    instance: &str,
) -> Result<
    (
        tokio::sync::mpsc::Sender<inferyes_proto::v1::AgentMessage>,
        tonic::Response<tonic::Streaming<inferyes_proto::v1::ControllerMessage>>,
    ),
    tonic::Status,
> {
    use inferyes_proto::v1::{AgentMessage, Register, agent_message};
    let register = Register {
        status: Some(status),
        join_token: inferyes_tests::fleet::JOIN_TOKEN.into(),
        instance: instance.into(),
    };
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.try_send(AgentMessage { msg: Some(agent_message::Msg::Register(register)) }).expect("an empty channel");
    let joined = agents.clone().join(tokio_stream::wrappers::ReceiverStream::new(rx)).await?;
    Ok((tx, joined))
}

/// A status of `node_id` at an address nothing answers.
fn bare_status(node_id: &str) -> inferyes_proto::v1::NodeStatus {
    inferyes_proto::v1::NodeStatus {
        node_id: node_id.into(),
        proxy_url: "http://127.0.0.1:9".into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_fleet_takes_no_more_nodes_than_max_nodes() {
    use inferyes_proto::v1::agent_service_client::AgentServiceClient;

    let etcd = Etcd::start().await;
    // Snapshots a second apart: joins at once are seen joining, not in one.
    let controller = ControllerHandle::start_with(&etcd.endpoint(), "controller-1", None, |c| {
        c.max_nodes = 2;
        c.snapshot_debounce_ms = 1_000;
    })
    .await;
    let agents = AgentServiceClient::connect(controller.url()).await.unwrap();
    let join = |node_id: &str| join_as(&agents, bare_status(node_id), "");
    // Three at once, before a snapshot shows one of them.
    let (a, b, c) = tokio::join!(join("node-a"), join("node-b"), join("node-c"));
    let results = [("node-a", a), ("node-b", b), ("node-c", c)];
    let refused: Vec<_> = results.iter().filter_map(|(id, r)| r.as_ref().err().map(|e| (*id, e))).collect();
    assert_eq!(refused.len(), 1, "{refused:?}");
    let (outside, error) = refused[0];
    assert_eq!(error.code(), tonic::Code::ResourceExhausted, "{error:?}");
    assert!(error.message().contains("max_nodes"), "{}", error.message());
    let mut admitted: Vec<_> = results.into_iter().filter_map(|(id, r)| Some((id, r.ok()?))).collect();

    // A node the fleet holds joins again, full as it is.
    let _again = join(admitted[0].0).await.expect("a held node joins again");
    let admin = controller.fleet().await;
    eventually("both nodes listed", Duration::from_secs(5), || {
        let mut admin = admin.clone();
        async move { admin.list_nodes(ListNodesRequest {}).await.unwrap().into_inner().nodes.len() == 2 }
    })
    .await;
    assert!(join(outside).await.is_err(), "still full");
    let (http, metrics) = (HttpClient::default(), format!("http://{}/metrics", controller.http_addr));
    let refused = scraped(&http, &metrics, "inferyes_controller_agents_refused_total", "reason=\"max_nodes\"").await;
    assert_eq!(refused, 2.0);
    assert_eq!(scraped(&http, &metrics, "inferyes_controller_max_nodes", "").await, 2.0);
    // One leaves: the third takes its place.
    drop(admitted.pop());
    eventually("the third node joined", Duration::from_secs(10), || {
        let join = join(outside);
        async move { join.await.map(drop).is_ok() }
    })
    .await;
    drop(admitted);
}

#[tokio::test]
async fn an_agent_the_fleet_has_no_room_for_asks_again_seldom() {
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start_with(&etcd.endpoint(), "controller-1", None, |c| c.max_nodes = 1).await;
    let sims = [SimHandle::start(chat_sim("chat")).await, SimHandle::start(chat_sim("chat")).await];
    let _a = AgentHandle::start("node-a", &[controller.url()], &[("main", &sims[0])]).await;
    let admin = controller.fleet().await;
    eventually("node-a joined", Duration::from_secs(5), || {
        let mut admin = admin.clone();
        async move { admin.list_nodes(ListNodesRequest {}).await.unwrap().into_inner().nodes.len() == 1 }
    })
    .await;
    let (http, metrics) = (HttpClient::default(), format!("http://{}/metrics", controller.http_addr));
    let refused = || scraped(&http, &metrics, "inferyes_controller_agents_refused_total", "reason=\"max_nodes\"");
    let _b = AgentHandle::start("node-b", &[controller.url()], &[("main", &sims[1])]).await;
    eventually("node-b refused", Duration::from_secs(5), || async { refused().await >= 1.0 }).await;
    // What it does next is wait, which nothing shows but time: a reconnecting
    // agent would have asked three times or more in these seconds.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(refused().await, 1.0, "node-b asked again within seconds");
}

#[tokio::test]
async fn an_agent_that_stops_reading_its_stream_is_dropped_after_the_lease_ttl() {
    use inferyes_proto::v1::agent_service_client::AgentServiceClient;
    use inferyes_proto::v1::{
        AgentMessage, ListSessionsRequest, NodeStatus, Register, ResidencyUpdate, ResidentSession, agent_message,
    };
    use inferyes_tests::fleet::LEASE_TTL;

    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    // An agent that reports a session, then writes on and reads nothing:
    // its connection's window, of a few bytes, stays full.
    let status = NodeStatus { node_id: "deaf".into(), proxy_url: "http://127.0.0.1:9".into(), ..Default::default() };
    let register =
        Register { status: Some(status), join_token: inferyes_tests::fleet::JOIN_TOKEN.into(), ..Default::default() };
    let session = ResidentSession { key: "root-deaf".into(), backend_id: "main".into(), ..Default::default() };
    let update = |seq, full| AgentMessage {
        msg: Some(agent_message::Msg::Residency(ResidencyUpdate {
            seq,
            full,
            upserted: vec![session.clone()],
            removed: vec![],
        })),
    };
    let mut messages = vec![AgentMessage { msg: Some(agent_message::Msg::Register(register)) }];
    // Each full table then a gap in the numbering: an answer asking for a
    // full table again, many more than the controller queues.
    for i in 0..32 {
        messages.extend([update(3 * i, true), update(3 * i + 2, false)]);
    }
    let channel = tonic::transport::Endpoint::from_shared(controller.url())
        .unwrap()
        .initial_stream_window_size(64)
        .initial_connection_window_size(64)
        .connect()
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(messages.len());
    for message in messages {
        tx.try_send(message).unwrap();
    }
    let mut agents = AgentServiceClient::new(channel);
    let _unread = agents.join(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap();
    let started = std::time::Instant::now();

    let admin = controller.fleet().await;
    let sessions = || {
        let mut admin = admin.clone();
        async move { admin.list_sessions(ListSessionsRequest::default()).await.unwrap().into_inner().sessions.len() }
    };
    eventually("the session listed", Duration::from_secs(5), || async { sessions().await == 1 }).await;
    // Its messages keep coming while the controller waits for it to read:
    // it is not silent by what it writes, only by what it reads.
    let writing = tokio::spawn(async move {
        loop {
            let heartbeat = AgentMessage { msg: Some(agent_message::Msg::Heartbeat(Default::default())) };
            if tx.send(heartbeat).await.is_err() {
                break;
            }
            tokio::time::sleep(LEASE_TTL / 10).await;
        }
    });
    eventually("the deaf node's session gone", LEASE_TTL * 3, || async { sessions().await == 0 }).await;
    assert!(started.elapsed() >= LEASE_TTL, "dropped after {:?}, before the TTL", started.elapsed());
    writing.abort();
}

/// A node's status whose record is about 256 KiB (a backend, or the
/// agent, naming a thousand long models), its models named for `round`.
fn large_status(node_id: &str, round: usize) -> inferyes_proto::v1::NodeStatus {
    use inferyes_proto::v1::{Backend, Model, NodeStatus};
    NodeStatus {
        node_id: node_id.into(),
        proxy_url: "http://127.0.0.1:9".into(),
        backends: (0..4)
            .map(|b| Backend {
                id: format!("b{b}"),
                models: (0..256)
                    .map(|m| Model { id: format!("{round}-{b}-{m}-{}", "m".repeat(240)), ..Default::default() })
                    .collect(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

#[tokio::test]
async fn nodes_joining_under_new_ids_write_no_faster_than_the_controller_s_budget() {
    use inferyes_proto::v1::agent_service_client::AgentServiceClient;

    const RATE: u64 = 32 << 10;
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start_with(&etcd.endpoint(), "controller-1", None, |c| {
        c.max_node_write_bytes_per_second = RATE;
    })
    .await;
    // Records of about 256 KiB each, under ids of their own: each its
    // node's first write, which no node's own pace holds back.
    let status = |node: usize| large_status(&format!("new-{node}"), 0);
    let record = prost::Message::encoded_len(&status(0)) as f64;
    let agents = AgentServiceClient::connect(controller.url()).await.unwrap();
    let started = std::time::Instant::now();
    let joining: Vec<_> = (0..16)
        .map(|node| {
            let agents = agents.clone();
            tokio::spawn(async move { join_as(&agents, status(node), "").await })
        })
        .collect();
    let (mut joined, mut refused) = (Vec::new(), Vec::new());
    for node in joining {
        match node.await.unwrap() {
            Ok(stream) => joined.push(stream),
            Err(status) => refused.push(status),
        }
    }
    let (http, metrics) = (HttpClient::default(), format!("http://{}/metrics", controller.http_addr));
    let written = scraped(&http, &metrics, "inferyes_controller_node_write_bytes_total", "").await;
    let elapsed = started.elapsed().as_secs_f64();
    // A burst of 64 s of the rate, then the rate; joins past it refused,
    // to ask again later.
    let budget = 64.0 * RATE as f64 + elapsed * RATE as f64;
    assert!(written <= budget, "{written} bytes written in {elapsed:.1} s, over {budget}");
    assert!(written >= 4.0 * record, "the burst's records were written: {written}");
    assert!(!refused.is_empty(), "{} joined", joined.len());
    assert!(refused.iter().all(|status| status.code() == tonic::Code::ResourceExhausted), "{refused:?}");
    let counted = scraped(&http, &metrics, "inferyes_controller_agents_refused_total", "write_budget").await;
    assert_eq!(counted, refused.len() as f64);
    drop(joined);
}

#[tokio::test]
async fn a_join_whose_first_write_etcd_is_slow_to_take_is_refused_another_s_node_id() {
    use inferyes_proto::v1::agent_service_client::AgentServiceClient;

    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let agents = AgentServiceClient::connect(controller.url()).await.unwrap();
    let join = |instance: &'static str| join_as(&agents, bare_status("owned"), instance);
    let _owner = join("theownersinstance").await.expect("joined");
    let admin = controller.fleet().await;
    eventually("the owned node listed", Duration::from_secs(5), || {
        let mut admin = admin.clone();
        async move { admin.list_nodes(ListNodesRequest {}).await.unwrap().into_inner().nodes.len() == 1 }
    })
    .await;
    // etcd stalls: another agent's first write under the id is not
    // answered, and the join goes on without etcd's word on whose it is.
    etcd.pause();
    let refused = join("anotheragentsinstance").await;
    etcd.resume();
    let refused = refused.expect_err("refused");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
}

#[tokio::test]
async fn a_node_whose_large_record_changes_all_the_time_is_written_at_a_bounded_rate() {
    use inferyes_proto::v1::agent_service_client::AgentServiceClient;
    use inferyes_proto::v1::{AgentMessage, Register, agent_message};

    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    // Its first model renamed every 50 ms.
    let status = |round: usize| large_status("chatty", round);
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let register = Register {
        status: Some(status(0)),
        join_token: inferyes_tests::fleet::JOIN_TOKEN.into(),
        ..Default::default()
    };
    tx.send(AgentMessage { msg: Some(agent_message::Msg::Register(register)) }).await.unwrap();
    let mut agents = AgentServiceClient::connect(controller.url()).await.unwrap();
    let mut inbound = agents.join(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
    assert!(inbound.message().await.unwrap().is_some(), "registration confirmed");
    let metrics = format!("http://{}/metrics", controller.http_addr);
    let http = HttpClient::default();
    let writes = || crate::support::scraped(&http, &metrics, "inferyes_controller_node_writes_total", "");
    for round in 1..=20 {
        tx.send(AgentMessage { msg: Some(agent_message::Msg::Status(status(round))) }).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A second of changes, each a record etcd would keep: written once
    // when it joined, and not again within the seconds its size takes.
    assert_eq!(writes().await, 1.0);
    let beating = tokio::spawn(async move {
        let heartbeat = || AgentMessage { msg: Some(agent_message::Msg::Heartbeat(Default::default())) };
        while tx.send(heartbeat()).await.is_ok() {
            tokio::time::sleep(inferyes_tests::fleet::LEASE_TTL / 10).await;
        }
    });
    // The latest is written in time, and only it.
    let admin = controller.fleet().await;
    eventually("the latest record written", Duration::from_secs(10), || {
        let mut admin = admin.clone();
        async move {
            let nodes = admin.list_nodes(ListNodesRequest {}).await.unwrap().into_inner().nodes;
            nodes.iter().flat_map(|n| &n.status.as_ref().unwrap().backends[0].models).any(|m| m.id.starts_with("20-"))
        }
    })
    .await;
    assert_eq!(writes().await, 2.0);
    beating.abort();
    drop(inbound);
    // Nor faster by joining again and again: each join's record waits for
    // the last write's time (some 4 s for its 256 KiB), as the stream's
    // changes did.
    let rejoining = std::time::Instant::now();
    for round in 21..=22 {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let register = Register {
            status: Some(status(round)),
            join_token: inferyes_tests::fleet::JOIN_TOKEN.into(),
            ..Default::default()
        };
        tx.send(AgentMessage { msg: Some(agent_message::Msg::Register(register)) }).await.unwrap();
        let mut inbound = agents.join(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
        assert!(inbound.message().await.unwrap().is_some(), "registration confirmed");
    }
    assert_eq!(writes().await, 4.0);
    assert!(rejoining.elapsed() >= Duration::from_secs(6), "two joins in {:?}", rejoining.elapsed());
}

#[tokio::test]
async fn when_a_controller_dies_everyone_moves_to_another_without_losing_a_node() {
    let etcd = Etcd::start().await;
    let one = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let two = ControllerHandle::start(&etcd.endpoint(), "controller-2").await;
    let both = [one.url(), two.url()];
    let sims = [SimHandle::start(chat_sim("chat")).await, SimHandle::start(chat_sim("chat")).await];
    let _a = AgentHandle::start("node-a", &both, &[("main", &sims[0])]).await;
    let _b = AgentHandle::start("node-b", &both, &[("main", &sims[1])]).await;
    let dataplane = DataplaneHandle::start(&both).await;
    dataplane.wait_for_nodes(&["node-a", "node-b"]).await;

    // The second controller learns the nodes from etcd, not from their
    // agents: wait until it has, or the drain below races its watch.
    let mut admin = two.fleet().await;
    eventually("the second controller sees both nodes", Duration::from_secs(10), || {
        let mut admin = admin.clone();
        async move { admin.list_nodes(ListNodesRequest {}).await.is_ok_and(|r| r.into_inner().nodes.len() == 2) }
    })
    .await;
    // Watch every snapshot the data plane installs from now on.
    let watch = dataplane.watch_snapshots();

    // Everyone starts on the first controller in their list.
    one.stop().await;
    // The fleet goes on through the second: a change made there arrives.
    let drained = admin
        .drain(DrainRequest { node_id: "node-b".into(), reason: String::new(), force: false })
        .await
        .unwrap()
        .into_inner();
    dataplane
        .wait_for("the drain, through the second controller", Duration::from_secs(10), |s| {
            s.version() >= drained.revision && s.nodes().iter().any(|n| n.draining)
        })
        .await;
    let http = HttpClient::default();
    let response = http.post_json(&format!("{}/v1/chat/completions", dataplane.url), &chat_body("chat", "hi")).await;
    assert_eq!((response.status, response.header("x-inferyes-node")), (StatusCode::OK, Some("node-a")));
    let fewest = watch.fewest_nodes().await;
    dataplane.stop().await;
    assert_eq!(fewest, 2, "a node dropped out of the fleet while its agent moved");
}

#[tokio::test]
async fn with_etcd_down_routing_goes_on_writes_fail_clearly_and_everything_converges_after() {
    let mut fleet = Fleet::start(vec![chat_sim("chat"), chat_sim("chat")]).await;
    fleet.etcd.stop();

    // Requests are routed from memory.
    for i in 0..4 {
        let response = chat(&fleet, &format!("outage-{i}")).await;
        assert_eq!(response.status, StatusCode::OK);
    }
    // An admin write says plainly that nothing changed.
    let mut admin = fleet.controller().fleet().await;
    let refused = admin.drain(DrainRequest { node_id: "node-a".into(), reason: String::new(), force: false }).await;
    let status = refused.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert!(status.message().contains("nothing was changed"), "{}", status.message());
    // Something an agent observes meanwhile is held, and arrives later.
    let http = HttpClient::default();
    http.post_json(&format!("{}/sim/gpu", fleet.sims[0].url), &serde_json::json!({"extra_used_bytes": 1u64 << 33}))
        .await;

    fleet.etcd.restart().await;
    fleet
        .dataplane
        .wait_for("the held observation", Duration::from_secs(15), |s| {
            s.nodes().iter().any(|n| n.id.as_ref() == "node-a" && n.vram_used_bytes > 1 << 33) && s.nodes().len() == 2
        })
        .await;
    admin.drain(DrainRequest { node_id: "node-a".into(), reason: String::new(), force: false }).await.unwrap();
    fleet
        .dataplane
        .wait_for("a write after the outage", Duration::from_secs(10), |s| s.nodes().iter().any(|n| n.draining))
        .await;
    assert_eq!(chat(&fleet, "after").await.header("x-inferyes-node"), Some("node-b"));
}

#[tokio::test]
async fn fleet_writes_and_keys_need_the_admin_token_and_agents_and_data_planes_the_join_token() {
    use inferyes_proto::v1::agent_service_client::AgentServiceClient;
    use inferyes_proto::v1::{
        AgentMessage, CreateKeyRequest, DataPlaneReport, DrainRequest, ListKeysRequest, NodeStatus, Register,
        SubscribeRequest, UsageBatch, agent_message,
    };

    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let mut anonymous = controller.fleet_anonymous().await;
    let drain = DrainRequest { node_id: "n".into(), reason: String::new(), force: true };
    let refused = anonymous.drain(drain.clone()).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    assert!(refused.message().contains("admin token"));
    let refused = anonymous.create_key(CreateKeyRequest { name: "x".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    assert_eq!(anonymous.list_keys(ListKeysRequest {}).await.unwrap_err().code(), tonic::Code::Unauthenticated);
    // Reads of the fleet need a token too (a viewer's does).
    assert_eq!(anonymous.list_nodes(ListNodesRequest {}).await.unwrap_err().code(), tonic::Code::Unauthenticated);
    let channel = tonic::transport::Channel::from_shared(controller.url()).unwrap().connect().await.unwrap();
    let mut wrong = inferyes_ctl::admin_client(channel, Some("not-the-admin-token-at-all")).unwrap();
    assert_eq!(wrong.drain(drain.clone()).await.unwrap_err().code(), tonic::Code::PermissionDenied);
    assert!(controller.fleet().await.drain(drain).await.is_ok());

    for token in ["", "not-the-join-token-at-all"] {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let status =
            NodeStatus { node_id: "intruder".into(), proxy_url: "http://127.0.0.1:9".into(), ..Default::default() };
        let register = Register { status: Some(status), join_token: token.into(), ..Default::default() };
        tx.send(AgentMessage { msg: Some(agent_message::Msg::Register(register)) }).await.unwrap();
        let mut agents = AgentServiceClient::connect(controller.url()).await.unwrap();
        let refused = agents.join(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
        assert!(refused.message().contains("join token"));
    }
    let nodes = controller.fleet().await.list_nodes(ListNodesRequest {}).await.unwrap().into_inner().nodes;
    assert!(nodes.is_empty(), "no intruder joined");

    // Snapshots (keys' hashes, sessions) and usage (billed) are the fleet's
    // data planes' only.
    // The agents' join token is not theirs: an agent's host cannot read
    // the fleet's keys and sessions nor bill anyone.
    let refusals = [
        (None, tonic::Code::Unauthenticated),
        (Some("not-the-join-token-at-all"), tonic::Code::PermissionDenied),
        (Some(inferyes_tests::fleet::JOIN_TOKEN), tonic::Code::PermissionDenied),
    ];
    for (token, code) in refusals {
        let mut routing = controller.routing(token).await;
        let subscribe = routing.subscribe(SubscribeRequest { dataplane_id: "intruder".into() }).await;
        assert_eq!(subscribe.err().map(|e| e.code()), Some(code));
        let batch = UsageBatch { batch_id: "forged".into(), ..Default::default() };
        assert_eq!(routing.record_usage(batch).await.unwrap_err().code(), code);
        let report = DataPlaneReport { dataplane_id: "intruder".into(), ..Default::default() };
        assert_eq!(routing.report(report).await.unwrap_err().code(), code);
    }
    let mut member = controller.routing(Some(inferyes_tests::fleet::DATAPLANE_TOKEN)).await;
    assert!(member.subscribe(SubscribeRequest { dataplane_id: "member".into() }).await.is_ok());
}

#[tokio::test]
async fn an_agent_forwards_only_what_the_fleet_s_data_planes_send() {
    let fleet = Fleet::start(vec![chat_sim("chat")]).await;
    let url = format!("http://{}/v1/chat/completions", fleet.agents[0].proxy_addr);
    let body = Bytes::from(chat_body("chat", "hi").to_string());
    // What data planes send is what the controller issued this node, from
    // a fleet key only controllers hold: what the join token derives for
    // this very node (all an agent holding it could make), another node's,
    // the fleet-wide credential of agents before, and the join token
    // itself are all refused.
    let key = |token: &str| inferyes_proto::bearer::proxy_key(token);
    let credential =
        |key: &str, node: &str| format!("Bearer {}", inferyes_proto::bearer::node_proxy_credential(key, node));
    let join_derived = credential(&key(inferyes_tests::JOIN_TOKEN), "node-a");
    let another_node =
        format!("Bearer {}", inferyes_tests::fleet::fleet_key(&fleet.etcd).await.proxy_credential("node-b", ""));
    let fleet_wide = format!("Bearer {}", inferyes_proto::bearer::proxy_credential(inferyes_tests::JOIN_TOKEN));
    let join_token = format!("Bearer {}", inferyes_tests::JOIN_TOKEN);
    for authorization in [
        None,
        Some("Bearer not-the-join-token-at-all"),
        Some(join_derived.as_str()),
        Some(another_node.as_str()),
        Some(fleet_wide.as_str()),
        Some(join_token.as_str()),
    ] {
        let headers: Vec<(&str, &str)> = authorization.iter().map(|a| ("authorization", *a)).collect();
        let refused = fleet.http.send(Method::POST, &url, body.clone(), &headers).await;
        assert_eq!(refused.status, StatusCode::UNAUTHORIZED, "{authorization:?}");
        assert_eq!(refused.openai_error()["code"], "fleet_token_required");
        assert_eq!(refused.header(inferyes_proto::bearer::AGENT_REFUSED), Some("credential"));
    }
    assert_eq!(fleet.sims[0].sim.stats().requests, 0, "nothing reached the backend");
    assert_eq!(fleet.agents[0].node_id, "node-a");
    let authorization = inferyes_tests::fleet::agent_authorization(&fleet.etcd, "node-a").await;
    let authorization = [("authorization", authorization.as_str())];
    let answered = fleet.http.send(Method::POST, &url, body.clone(), &authorization).await;
    assert_eq!(answered.status, StatusCode::OK);
    // Nor, with that credential, anything but the jobs a data plane
    // sends: the servers' own endpoints (slots, llama-swap's way to any
    // of them, settings, model loads) however spelled, nor a job's path
    // by another method.
    let reached = fleet.sims[0].sim.stats().requests;
    for (method, path) in [
        (Method::POST, "/slots/0?action=erase"),
        (Method::POST, "/%73lots/0?action=save"),
        (Method::POST, "//slots/0?action=restore"),
        (Method::GET, "/SLOTS"),
        (Method::POST, "/upstream/chat/slots/0?action=erase"),
        (Method::POST, "/props"),
        (Method::POST, "/lora-adapters"),
        (Method::POST, "/models/load"),
        (Method::GET, "/v1/chat/completions"),
        (Method::POST, "/v1/chat/completions/"),
        (Method::GET, "/metrics"),
    ] {
        let url = format!("http://{}{path}", fleet.agents[0].proxy_addr);
        let refused = fleet.http.send(method.clone(), &url, body.clone(), &authorization).await;
        assert_eq!(refused.status, StatusCode::NOT_FOUND, "{method} {path}");
        assert_eq!(refused.openai_error()["code"], "not_found", "{method} {path}");
    }
    assert_eq!(fleet.sims[0].sim.stats().requests, reached, "nothing more reached the backend");
    // Its own health and metrics stay open.
    let health = fleet.http.get(&format!("http://{}/healthz", fleet.agents[0].proxy_addr)).await;
    assert_eq!(health.status, StatusCode::OK);
}

#[tokio::test]
async fn a_node_whose_agent_awaits_its_credential_is_passed_over_and_never_a_client_s_401() {
    let etcd = Etcd::start().await;
    // A botched rotation: the controller open, so issuing no credential,
    // node-a's agent on a token, taking only an issued one, node-b's open.
    let controller = ControllerHandle::start_with(&etcd.endpoint(), "controller-1", None, |c| {
        c.join_auth = inferyes_controller::config::TokenAuth::None;
    })
    .await;
    let (sim_a, sim_b) = (SimHandle::start(chat_sim("chat")).await, SimHandle::start(chat_sim("chat")).await);
    let a = AgentHandle::start("node-a", &[controller.url()], &[("main", &sim_a)]).await;
    let backend = |sim: &SimHandle| inferyes_tests::fleet::llama_server(&sim.url, &["chat"]);
    let gpu = inferyes_agent::config::GpuSourceConfig::None;
    let b =
        AgentHandle::start_tweaked("node-b", &[controller.url()], gpu, vec![backend(&sim_b)], |c| c.join_token = None)
            .await;
    // The fleet knows node-a, awaiting its credential; data planes send
    // it nothing.
    let fleet = controller.fleet().await;
    eventually("node-a listed, awaiting its credential", Duration::from_secs(15), || {
        let mut fleet = fleet.clone();
        async move {
            let nodes = fleet.list_nodes(ListNodesRequest {}).await.expect("nodes").into_inner().nodes;
            let a = nodes.iter().find_map(|n| n.status.as_ref().filter(|s| s.node_id == "node-a"));
            a.is_some_and(|s| s.awaiting_credential)
        }
    })
    .await;
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-b"]).await;
    let url = format!("{}/v1/chat/completions", dataplane.url);
    let http = HttpClient::default();
    for i in 0..8 {
        let response = http.post_json(&url, &chat_body("chat", &format!("question {i}"))).await;
        assert_eq!(response.status, StatusCode::OK, "{}", String::from_utf8_lossy(&response.body));
        assert_eq!(response.header("x-inferyes-node"), Some("node-b"));
        assert_ne!(response.header("x-inferyes-route"), Some("failover"));
    }
    assert_eq!(sim_a.sim.stats().requests, 0);
    // Alone, node-a is no node to send a request to, never a client's 401.
    b.kill();
    dataplane.wait_for_nodes(&[]).await;
    let response = http.post_json(&url, &chat_body("chat", "x")).await;
    assert_eq!(response.status, StatusCode::NOT_FOUND);
    assert_eq!(response.openai_error()["code"], "model_not_found", "the data plane's fleet serves none");
    drop(a);
}

#[tokio::test]
async fn data_planes_on_either_controller_see_every_node_s_sessions() {
    // Residency is never in etcd: the second data plane learns of
    // node-a's sessions only through the controllers.
    let split = Split::start().await;
    let (dp_one, dp_two) = (&split.dp_one, &split.dp_two);

    let http = HttpClient::default();
    let send = |dataplane: &DataplaneHandle, session: String| {
        let url = format!("{}/v1/chat/completions", dataplane.url);
        let http = http.clone();
        async move {
            let body = Bytes::from(chat_body("chat", "hi").to_string());
            let response = http.send(Method::POST, &url, body, &[("x-session-id", &session)]).await;
            assert_eq!(response.status, StatusCode::OK);
            response
        }
    };
    let mut homes = Vec::new();
    for i in 0..8 {
        let session = format!("conv-{i}");
        let response = send(dp_one, session.clone()).await;
        homes.push((session, response.header("x-inferyes-node").expect("a node").to_string()));
    }
    for node in ["node-a", "node-b"] {
        assert!(homes.iter().any(|(_, n)| n == node), "no session placed on {node}: {homes:?}");
    }
    for dp in [dp_one, dp_two] {
        dp.wait_for("every session resident where it was served", Duration::from_secs(10), |s| {
            homes.iter().all(|(session, home)| {
                s.resident(session).and_then(|r| s.node(r.target.node)).is_some_and(|n| *n.id == **home)
            })
        })
        .await;
    }
    for (session, home) in &homes {
        let again = send(dp_two, session.clone()).await;
        assert_eq!(again.header("x-inferyes-node"), Some(home.as_str()), "{session}");
        assert_eq!(again.header("x-inferyes-route"), Some("resident"), "{session}");
    }
}

/// The bullet: whoever holds the join token registers an existing
/// node id with its own proxy URL, to be sent that node's prompts. While
/// the node's agent is connected (its lease live) that is refused, and the
/// node keeps its address; once the agent has left, the id is free.
#[tokio::test]
async fn a_live_node_s_id_cannot_be_taken_by_another_registration() {
    use inferyes_proto::v1::agent_service_client::AgentServiceClient;
    use inferyes_proto::v1::{AgentMessage, NodeStatus, Register, agent_message};

    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let sim = SimHandle::start(chat_sim("chat")).await;
    let agent = AgentHandle::start("node-a", &[controller.url()], &[("main", &sim)]).await;
    let admin = controller.fleet().await;
    let proxy_url = |admin: &inferyes_proto::v1::fleet_service_client::FleetServiceClient<_>| {
        let mut admin = admin.clone();
        async move {
            let nodes = admin.list_nodes(ListNodesRequest {}).await.unwrap().into_inner().nodes;
            nodes.into_iter().find_map(|n| n.status.filter(|s| s.node_id == "node-a").map(|s| s.proxy_url))
        }
    };
    let real = format!("http://{}", agent.proxy_addr);
    eventually("node-a joined", Duration::from_secs(5), || {
        let (lookup, real) = (proxy_url(&admin), real.clone());
        async move { lookup.await.as_deref() == Some(real.as_str()) }
    })
    .await;

    let register = |instance: &str, proxy_url: &str| {
        let status = NodeStatus { node_id: "node-a".into(), proxy_url: proxy_url.into(), ..Default::default() };
        let register = Register {
            status: Some(status),
            join_token: inferyes_tests::fleet::JOIN_TOKEN.into(),
            instance: instance.into(),
        };
        let url = controller.url();
        async move {
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            tx.send(AgentMessage { msg: Some(agent_message::Msg::Register(register)) }).await.unwrap();
            let mut agents = AgentServiceClient::connect(url).await.unwrap();
            agents.join(tokio_stream::wrappers::ReceiverStream::new(rx)).await.map(|stream| (tx, stream.into_inner()))
        }
    };
    let intrude = || register("intruderinstance0000", "http://127.0.0.1:9");
    // Refused before the stream is answered: never told it registered.
    let refused = intrude().await.expect_err("refused");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("held by another agent"), "{refused:?}");
    assert_eq!(proxy_url(&admin).await.as_deref(), Some(real.as_str()), "the node keeps its agent's address");

    agent.stop().await;
    let _joined = intrude().await.expect("a free id is taken");
    eventually("the free id taken", Duration::from_secs(5), || {
        let lookup = proxy_url(&admin);
        async move { lookup.await.as_deref() == Some("http://127.0.0.1:9") }
    })
    .await;
    // The same instance (an agent moving controllers) takes it over at
    // once; an agent of an earlier version, which sends no instance, may
    // not take it from one that does.
    let _moved = register("intruderinstance0000", "http://127.0.0.1:10").await.expect("the same instance");
    let old = register("", "http://127.0.0.1:11").await.expect_err("refused");
    assert_eq!(old.code(), tonic::Code::PermissionDenied);
}

#[tokio::test]
async fn with_etcd_paused_agent_streams_and_live_state_go_on_and_writes_catch_up() {
    // A lease that outlasts the pause: etcd revokes what expired while it
    // was stopped as soon as it goes on.
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start_with(&etcd.endpoint(), "controller-1", None, |config| {
        config.lease_ttl_ms = 12_000;
    })
    .await;
    let sims = vec![SimHandle::start(chat_sim("chat")).await, SimHandle::start(chat_sim("chat")).await];
    let mut agents = Vec::new();
    for (i, sim) in sims.iter().enumerate() {
        agents.push(AgentHandle::start(&crate::support::node_id(i), &[controller.url()], &[("main", sim)]).await);
    }
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-a", "node-b"]).await;
    let fleet = Fleet { etcd, controller: Some(controller), sims, agents, dataplane, http: HttpClient::default() };

    fleet.etcd.pause();
    // A change for etcd, which waits: node-a's memory a step up.
    let extra = serde_json::json!({"extra_used_bytes": 1u64 << 33});
    fleet.http.post_json(&format!("{}/sim/gpu", fleet.sims[0].url), &extra).await;
    // Meanwhile every new conversation's residency reaches the data plane
    // as fast as ever, on either node, through more than a keep-alive
    // period (4 s) of each node's lease.
    let until = std::time::Instant::now() + Duration::from_secs(5);
    let mut conversations = 0;
    while std::time::Instant::now() < until {
        let session = format!("while-etcd-sleeps-{conversations}");
        assert_eq!(chat(&fleet, &session).await.status, StatusCode::OK);
        fleet
            .dataplane
            .wait_for("the new session resident", Duration::from_secs(1), |s| s.resident(&session).is_some())
            .await;
        conversations += 1;
    }

    fleet.etcd.resume();
    fleet
        .dataplane
        .wait_for("the held write", Duration::from_secs(15), |s| {
            s.nodes().iter().any(|n| n.id.as_ref() == "node-a" && n.vram_used_bytes > 1 << 33) && s.nodes().len() == 2
        })
        .await;
}

#[tokio::test]
async fn a_fleet_stopped_and_started_again_lists_only_its_live_nodes() {
    // Leases that would outlive the restart: a node its agent did not end
    // would still be listed.
    let long_leases = |config: &mut inferyes_controller::Config| config.lease_ttl_ms = 15_000;
    let mut etcd = Etcd::start().await;
    let controller = ControllerHandle::start_with(&etcd.endpoint(), "controller-1", None, long_leases).await;
    let sims = [SimHandle::start(chat_sim("chat")).await, SimHandle::start(chat_sim("chat")).await];
    let mut agents = Vec::new();
    for (i, sim) in sims.iter().enumerate() {
        agents.push(AgentHandle::start(&crate::support::node_id(i), &[controller.url()], &[("main", sim)]).await);
    }
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-a", "node-b"]).await;

    // Stopped as a service manager stops it: each agent's stop ends its
    // node before the agent exits.
    let mut store = etcd_client::Client::connect([etcd.endpoint()], None).await.expect("etcd");
    for agent in agents {
        let node = agent.node_id.clone();
        assert!(agent.stop_within(Duration::from_secs(10)).await, "{node} stopped within its grace");
        let key = format!("/inferyes/v1/nodes/{node}");
        assert_eq!(store.get(key, None).await.expect("read").count(), 0, "{node}'s record gone as its agent exited");
    }
    dataplane.stop().await;
    controller.stop().await;
    etcd.stop();
    etcd.restart().await;

    // Started again with another node: from the first request, only it.
    let controller = ControllerHandle::start_with(&etcd.endpoint(), "controller-1", None, long_leases).await;
    let other = SimHandle::start(chat_sim("other")).await;
    let _agent = AgentHandle::start("node-c", &[controller.url()], &[("main", &other)]).await;
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-c"]).await;
    let snapshot = dataplane.store.current().expect("a snapshot");
    let nodes: Vec<&str> = snapshot.nodes().iter().map(|n| n.id.as_ref()).collect();
    assert_eq!(nodes, ["node-c"]);
    let http = HttpClient::default();
    let models = http.get(&format!("{}/v1/models", dataplane.url)).await.json();
    let ids: Vec<&str> = models["data"].as_array().expect("models").iter().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(ids, ["other"]);
    let gone = http.post_json(&format!("{}/v1/chat/completions", dataplane.url), &chat_body("chat", "hi")).await;
    assert_eq!(gone.status, StatusCode::NOT_FOUND, "no node of the stopped fleet takes a request");
}
