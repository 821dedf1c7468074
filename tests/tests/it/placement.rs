//! Placement: a model declared to want warm replicas is loaded by the
//! fleet itself, without a client asking, on simulated llama-swap and
//! router-mode llama-server nodes; a drained node's copy is replaced
//! elsewhere within a load time, the model warm somewhere all along; and
//! of two controllers only the elected one acts.

use std::time::{Duration, Instant};

use inferyes_dataplane::snapshot::RoutingSnapshot;
use inferyes_proto::v1::{DrainRequest, ModelState};
use inferyes_sim::{SimConfig, SimMode, SimModel};
use inferyes_tests::{AgentHandle, ControllerHandle, DataplaneHandle, Etcd, HttpClient, SimHandle, eventually};

const LOAD: Duration = Duration::from_millis(600);
/// What placement may add to a load: the drain reaching the leader, its
/// order reaching the agent, the agent's next look at the backend (under
/// 0.1 s here when the machine is idle).
const BOUND: Duration = Duration::from_secs(3);

fn backend(mode: SimMode) -> SimConfig {
    SimConfig {
        mode,
        models: vec![SimModel::chat("m"), SimModel::chat("other")],
        max_loaded_models: 2,
        load_delay_ms: u64::try_from(LOAD.as_millis()).expect("short"),
        prefill_tokens_per_second: 1e6,
        decode_tokens_per_second: 1e5,
        ..SimConfig::llama_swap(["m"])
    }
}

/// Nodes not draining with `model` loaded, as a data plane sees them.
fn warm_on(snapshot: &RoutingSnapshot, model: &str) -> Vec<String> {
    let mut nodes: Vec<String> = snapshot
        .placements(model)
        .unwrap_or_default()
        .iter()
        .filter(|p| p.state == ModelState::Loaded)
        .filter_map(|p| snapshot.node(p.target.node))
        .filter(|n| !n.draining)
        .map(|n| n.id.to_string())
        .collect();
    nodes.dedup();
    nodes
}

fn draining(snapshot: &RoutingSnapshot) -> bool {
    (0..).map_while(|i| snapshot.node(i)).any(|n| n.draining)
}

/// Declares `model`'s replicas as an operator does, with `inferyesctl`.
async fn declare(controller: &ControllerHandle, model: &str, min: u32) {
    ctl(controller, &["policy", "set", "--replicas", &format!("{model}={min}")]).await;
}

async fn ctl(controller: &ControllerHandle, args: &[&str]) -> String {
    use clap::Parser;
    let url = controller.url();
    let mut argv = vec!["inferyesctl", "--controller", &url, "--admin-token", inferyes_tests::fleet::ADMIN_TOKEN];
    argv.extend_from_slice(args);
    inferyes_ctl::run(inferyes_ctl::Cli::try_parse_from(argv).expect("valid arguments")).await.expect("inferyesctl")
}

/// The sum of one metric's series on a controller's `/metrics`, those
/// whose labels contain `labels`.
async fn metric(http: &HttpClient, controller: &ControllerHandle, name: &str, labels: &str) -> f64 {
    crate::support::scraped(http, &format!("http://{}/metrics", controller.http_addr), name, labels).await
}

#[tokio::test]
async fn a_declared_model_stays_warm_on_two_nodes_through_a_drain() {
    for mode in [SimMode::LlamaSwap, SimMode::LlamaServerRouter] {
        let etcd = Etcd::start().await;
        let controller = ControllerHandle::start_with(&etcd.endpoint(), "controller-1", None, |c| {
            c.placement_order_timeout_secs = 10;
        })
        .await;
        let mut sims = Vec::new();
        for _ in 0..3 {
            sims.push(SimHandle::start(backend(mode)).await);
        }
        let mut agents = Vec::new();
        for (i, sim) in sims.iter().enumerate() {
            agents.push(AgentHandle::start(&format!("node-{i}"), &[controller.url()], &[("main", sim)]).await);
        }
        let dataplane = DataplaneHandle::start(&[controller.url()]).await;
        dataplane.wait_for_nodes(&["node-0", "node-1", "node-2"]).await;
        let current = || dataplane.store.current().expect("a snapshot");
        assert!(warm_on(&current(), "m").is_empty(), "{mode:?}: nothing loaded before the declaration");

        declare(&controller, "m", 2).await;
        dataplane.wait_for("m warm on two nodes", Duration::from_secs(10), |s| warm_on(s, "m").len() == 2).await;
        let models: serde_json::Value =
            serde_json::from_str(&ctl(&controller, &["models", "-o", "json"]).await).expect("JSON");
        let m = models["models"].as_array().and_then(|all| all.iter().find(|m| m["id"] == "m")).expect("m listed");
        assert_eq!((m["desired_replicas"].as_u64(), m["loaded_on"].as_array().map(Vec::len)), (Some(2), Some(2)));
        let http = HttpClient::default();
        let authorization = format!("Bearer {}", inferyes_tests::fleet::VIEWER_TOKEN);
        let dashboard = http
            .send(
                http::Method::GET,
                &format!("http://{}/api/v1/fleet", controller.http_addr),
                bytes::Bytes::new(),
                &[("authorization", &authorization)],
            )
            .await
            .json();
        let shown = dashboard["models"].as_array().and_then(|all| all.iter().find(|m| m["id"] == "m")).expect("shown");
        assert_eq!((shown["desired"].as_u64(), &shown["warning"]), (Some(2), &serde_json::Value::Null), "{shown}");
        let requests: u64 = sims.iter().map(|s| s.sim.stats().requests).sum();
        assert_eq!(requests, 0, "{mode:?}: loaded without any client request");
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(warm_on(&current(), "m").len(), 2, "{mode:?}: and no more than asked for");

        // Drain one of its nodes: it is warm on the other all along, and
        // on a second within a load time and the bound.
        let drained = warm_on(&current(), "m")[0].clone();
        let mut admin = controller.fleet().await;
        let started = Instant::now();
        admin
            .drain(DrainRequest { node_id: drained.clone(), reason: "placement test".into(), force: false })
            .await
            .unwrap();
        let mut fewest = usize::MAX;
        let replaced = loop {
            let snapshot = current();
            let warm = warm_on(&snapshot, "m");
            if draining(&snapshot) {
                fewest = fewest.min(warm.len());
                if warm.len() == 2 {
                    break started.elapsed();
                }
            }
            assert!(started.elapsed() < LOAD + BOUND + Duration::from_secs(5), "{mode:?}: not replaced: {warm:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        assert!(fewest >= 1, "{mode:?}: m was warm nowhere for a moment");
        assert!(replaced <= LOAD + BOUND, "{mode:?}: replaced after {replaced:?}");
        assert!(!warm_on(&current(), "m").contains(&drained));
        eprintln!("{mode:?}: a drained node's copy replaced in {replaced:?} (load {LOAD:?})");
        assert_eq!(
            metric(&http, &controller, "inferyes_controller_placement_orders_total", "outcome=\"issued\"").await,
            3.0
        );

        dataplane.stop().await;
        for agent in agents {
            agent.stop().await;
        }
        controller.stop().await;
        for sim in sims {
            sim.stop().await;
        }
    }
}

#[tokio::test]
async fn room_is_made_on_a_backend_at_its_limit_before_the_load() {
    // One model at a time, `other` loaded and idle: placement unloads it
    // first, then loads `m`, rather than let llama-swap swap it out.
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let sim = SimHandle::start(SimConfig {
        max_loaded_models: 1,
        preload: vec!["other".into()],
        ..backend(SimMode::LlamaSwap)
    })
    .await;
    let agent = AgentHandle::start("node-a", &[controller.url()], &[("main", &sim)]).await;
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-a"]).await;
    dataplane.wait_for("other warm", Duration::from_secs(5), |s| warm_on(s, "other").len() == 1).await;

    declare(&controller, "m", 1).await;
    dataplane
        .wait_for("m warm in other's place", Duration::from_secs(10), |s| {
            warm_on(s, "m").len() == 1 && warm_on(s, "other").is_empty()
        })
        .await;
    // Settled in the leader's next round.
    let http = HttpClient::default();
    let done = |action: &'static str| {
        let (http, controller) = (&http, &controller);
        async move {
            let labels = format!("action=\"{action}\",outcome=\"done\"");
            metric(http, controller, "inferyes_controller_placement_orders_total", &labels).await
        }
    };
    inferyes_tests::eventually("an unload, then the load, both done", Duration::from_secs(5), || async {
        (done("unload").await, done("load").await) == (1.0, 1.0)
    })
    .await;

    dataplane.stop().await;
    agent.stop().await;
    controller.stop().await;
    sim.stop().await;
}

const CANDIDACIES: &str = "/inferyes/v1-usage/leader/";

/// The ledger's candidacies, oldest first, with when each was written.
async fn candidacies(etcd: &Etcd) -> Vec<(Vec<u8>, i64)> {
    let mut client = etcd.client().await.expect("etcd");
    let options = etcd_client::GetOptions::new()
        .with_prefix()
        .with_keys_only()
        .with_sort(etcd_client::SortTarget::Create, etcd_client::SortOrder::Ascend);
    let response = client.get(CANDIDACIES, Some(options)).await.expect("etcd");
    response.kvs().iter().map(|kv| (kv.key().to_vec(), kv.create_revision())).collect()
}

/// Two controllers: the first leading the ledger, the second standing.
async fn a_leader_and_a_candidate(etcd: &Etcd, http: &HttpClient) -> (ControllerHandle, ControllerHandle) {
    let one = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    eventually("the first controller leads", Duration::from_secs(10), || async {
        metric(http, &one, "inferyes_controller_placement_leading", "").await == 1.0
    })
    .await;
    let two = ControllerHandle::start(&etcd.endpoint(), "controller-2").await;
    eventually("the second controller stands", Duration::from_secs(10), || async {
        candidacies(etcd).await.len() == 2
    })
    .await;
    (one, two)
}

/// Waiting to lead outlasts the etcd client's 5 s timeout on a call: a
/// controller that waited in one call wrote a new candidacy (and deleted
/// the last) every time it ran out, for as long as the leader lived.
#[tokio::test]
async fn a_controller_waiting_to_lead_writes_nothing_to_etcd() {
    let etcd = Etcd::start().await;
    let http = HttpClient::default();
    let (one, two) = a_leader_and_a_candidate(&etcd, &http).await;
    let before = candidacies(&etcd).await;
    // No event marks a write that does not happen: this waits past the
    // client's timeout instead.
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert_eq!(candidacies(&etcd).await, before, "the candidacies while the second controller waited");

    // The first's candidacy goes with its stop, not at its lease's end.
    one.stop().await;
    eventually("the second controller leads once the first is gone", Duration::from_secs(5), || async {
        metric(&http, &two, "inferyes_controller_placement_leading", "").await == 1.0
    })
    .await;
    two.stop().await;
}

#[tokio::test]
async fn a_leader_whose_candidacy_is_deleted_steps_down() {
    let etcd = Etcd::start().await;
    let http = HttpClient::default();
    let (one, two) = a_leader_and_a_candidate(&etcd, &http).await;
    let (leading, _) = candidacies(&etcd).await.remove(0);
    etcd.client().await.expect("etcd").delete(leading, None).await.expect("etcd");

    eventually("the first steps down and the second leads", Duration::from_secs(5), || async {
        let first = metric(&http, &one, "inferyes_controller_placement_leading", "").await;
        let second = metric(&http, &two, "inferyes_controller_placement_leading", "").await;
        (first, second) == (0.0, 1.0)
    })
    .await;
    one.stop().await;
    two.stop().await;
}

#[tokio::test]
async fn of_two_controllers_only_the_elected_one_places_models() {
    let etcd = Etcd::start().await;
    let one = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let two = ControllerHandle::start(&etcd.endpoint(), "controller-2").await;
    let a = SimHandle::start(backend(SimMode::LlamaSwap)).await;
    let b = SimHandle::start(backend(SimMode::LlamaSwap)).await;
    // One agent on each: orders reach an agent through whichever holds it.
    let agent_a = AgentHandle::start("node-a", &[one.url()], &[("main", &a)]).await;
    let agent_b = AgentHandle::start("node-b", &[two.url()], &[("main", &b)]).await;
    let dataplane = DataplaneHandle::start(&[one.url()]).await;
    dataplane.wait_for_nodes(&["node-a", "node-b"]).await;

    declare(&two, "m", 2).await;
    dataplane.wait_for("m warm on both nodes", Duration::from_secs(10), |s| warm_on(s, "m").len() == 2).await;
    let http = HttpClient::default();
    let leading = [
        metric(&http, &one, "inferyes_controller_placement_leading", "").await,
        metric(&http, &two, "inferyes_controller_placement_leading", "").await,
    ];
    let issued = [
        metric(&http, &one, "inferyes_controller_placement_orders_total", "outcome=\"issued\"").await,
        metric(&http, &two, "inferyes_controller_placement_orders_total", "outcome=\"issued\"").await,
    ];
    assert_eq!(leading.iter().sum::<f64>(), 1.0, "one leader: {leading:?}");
    let leader = usize::from(leading[1] == 1.0);
    assert_eq!((issued[leader], issued[1 - leader]), (2.0, 0.0), "only the leader issued orders: {issued:?}");

    dataplane.stop().await;
    agent_a.stop().await;
    agent_b.stop().await;
    one.stop().await;
    two.stop().await;
}
