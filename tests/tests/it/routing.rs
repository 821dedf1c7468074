//! Routing by state across a fleet of simulated nodes and two data planes.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use inferyes_sim::{SimConfig, SimModel};
use inferyes_tests::{DataplaneHandle, HttpClient, TestResponse};
use serde_json::{Value, json};

use crate::support::{Fleet, chat_body, chat_sim};

async fn chat(http: &HttpClient, dataplane: &str, body: &Value, session: Option<&str>) -> TestResponse {
    let headers: Vec<(&str, &str)> = session.map(|s| vec![("x-session-id", s)]).unwrap_or_default();
    let url = format!("{dataplane}/v1/chat/completions");
    let response = http.send(Method::POST, &url, Bytes::from(body.to_string()), &headers).await;
    assert_eq!(response.status, StatusCode::OK, "{}", String::from_utf8_lossy(&response.body));
    response
}

fn node(response: &TestResponse) -> String {
    response.header("x-inferyes-node").expect("x-inferyes-node").to_string()
}

async fn set_used_fraction(http: &HttpClient, sim_url: &str, fraction: f64) {
    let gpu = http.get(&format!("{sim_url}/sim/gpu")).await.json();
    let total = gpu["memory_total_bytes"].as_f64().expect("total memory");
    let extra = gpu["extra_used_bytes"].as_u64().unwrap_or(0) as f64;
    let base = gpu["memory_used_bytes"].as_f64().expect("used memory") - extra;
    let wanted = (fraction * total - base).max(0.0) as u64;
    let response = http.post_json(&format!("{sim_url}/sim/gpu"), &json!({"extra_used_bytes": wanted})).await;
    assert!(response.status.is_success(), "{}", String::from_utf8_lossy(&response.body));
}

#[tokio::test]
async fn a_multi_turn_chat_stays_on_one_node_whichever_data_plane_serves_it() {
    let fleet = Fleet::start(vec![chat_sim("chat"), chat_sim("chat"), chat_sim("chat"), chat_sim("chat")]).await;
    let second = DataplaneHandle::start(&[fleet.controller().url()]).await;
    second.wait_for_nodes(&["node-a", "node-b", "node-c", "node-d"]).await;
    let dataplanes = [fleet.dataplane.url.clone(), second.url.clone()];

    for conversation in 0..3 {
        // No session header: the conversation's root keeps it together.
        let mut messages = vec![
            json!({"role": "system", "content": format!("you are assistant number {conversation}")}),
            json!({"role": "user", "content": "hello"}),
        ];
        let mut served = Vec::new();
        for turn in 0..6 {
            let body = json!({"model": "chat", "messages": messages, "max_tokens": 6});
            let response = chat(&fleet.http, &dataplanes[turn % 2], &body, None).await;
            let reply = response.json();
            served.push((node(&response), reply["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()));
            messages.push(reply["choices"][0]["message"].clone());
            messages.push(json!({"role": "user", "content": format!("and then {turn}?")}));
        }
        let home = &served[0].0;
        assert!(served.iter().all(|(n, _)| n == home), "conversation {conversation} moved: {served:?}");
        assert!(served[1..].iter().all(|(_, cached)| *cached > 0), "every later turn reuses the cache: {served:?}");
    }
}

#[tokio::test]
async fn a_node_over_the_admission_threshold_takes_no_new_sessions_but_keeps_its_own() {
    let fleet = Fleet::start(vec![chat_sim("chat"), chat_sim("chat"), chat_sim("chat"), chat_sim("chat")]).await;
    let home = node(&chat(&fleet.http, &fleet.dataplane.url, &chat_body("chat", "hi"), Some("resident")).await);
    let index = fleet.agents.iter().position(|a| a.node_id == home).unwrap();
    fleet
        .dataplane
        .wait_for("the session resident", Duration::from_secs(5), |s| s.resident("resident").is_some())
        .await;

    set_used_fraction(&fleet.http, &fleet.sims[index].url, 0.95).await;
    fleet
        .dataplane
        .wait_for("the node over 92%", Duration::from_secs(5), |s| {
            s.nodes().iter().any(|n| *n.id == *home && n.vram_fraction >= 0.92)
        })
        .await;

    for i in 0..24 {
        let response =
            chat(&fleet.http, &fleet.dataplane.url, &chat_body("chat", "hi"), Some(&format!("new-{i}"))).await;
        assert_ne!(node(&response), home, "new session {i} sent to a node over the threshold");
    }
    let again = chat(&fleet.http, &fleet.dataplane.url, &chat_body("chat", "more"), Some("resident")).await;
    assert_eq!((node(&again).as_str(), again.header("x-inferyes-route")), (home.as_str(), Some("resident")));

    // Past the hard limit (98%) not even the resident session stays.
    set_used_fraction(&fleet.http, &fleet.sims[index].url, 0.99).await;
    fleet
        .dataplane
        .wait_for("the node over 98%", Duration::from_secs(5), |s| {
            s.nodes().iter().any(|n| *n.id == *home && n.vram_fraction >= 0.98)
        })
        .await;
    let moved = chat(&fleet.http, &fleet.dataplane.url, &chat_body("chat", "more"), Some("resident")).await;
    assert_ne!(node(&moved), home);
}

#[tokio::test]
async fn a_model_loaded_on_one_node_only_goes_there() {
    let fleet = Fleet::start(vec![chat_sim("chat"), chat_sim("chat"), chat_sim("chat"), chat_sim("special")]).await;
    for i in 0..12 {
        let session = format!("s-{i}");
        let response = chat(&fleet.http, &fleet.dataplane.url, &chat_body("special", "hi"), Some(&session)).await;
        assert_eq!(node(&response), "node-d");
    }
}

#[tokio::test]
async fn a_cold_load_goes_to_the_node_with_the_most_free_memory() {
    let swap = || SimConfig {
        models: vec![SimModel::chat("alpha"), SimModel::chat("beta")],
        preload: vec!["alpha".into()],
        max_loaded_models: 2,
        load_delay_ms: 100,
        ..chat_sim("alpha")
    };
    let swap = || SimConfig { mode: inferyes_sim::SimMode::LlamaSwap, ..swap() };
    let fleet = Fleet::start(vec![swap(), swap(), swap(), swap()]).await;
    for (sim, fraction) in fleet.sims.iter().zip([0.6, 0.3, 0.5, 0.7]) {
        set_used_fraction(&fleet.http, &sim.url, fraction).await;
    }
    fleet
        .dataplane
        .wait_for("memory readings in", Duration::from_secs(5), |s| s.nodes().iter().all(|n| n.vram_fraction > 0.25))
        .await;
    let response = chat(&fleet.http, &fleet.dataplane.url, &chat_body("beta", "hi"), Some("cold")).await;
    assert_eq!(response.header("x-inferyes-route"), Some("cold"));
    assert_eq!(node(&response), "node-b");
}

#[tokio::test]
async fn a_node_whose_gpu_cannot_be_read_starts_no_load_and_serves_what_it_holds() {
    let swap = SimConfig {
        mode: inferyes_sim::SimMode::LlamaSwap,
        models: vec![SimModel::chat("alpha"), SimModel::chat("beta")],
        preload: vec!["alpha".into()],
        max_loaded_models: 2,
        load_delay_ms: 100,
        ..chat_sim("alpha")
    };
    let fleet = Fleet::start(vec![swap]).await;
    let sim_gpu = format!("{}/sim/gpu", fleet.sims[0].url);
    let stale = |s: &inferyes_dataplane::snapshot::RoutingSnapshot| {
        s.placements("beta").is_some_and(|ps| ps.iter().all(|p| p.vram_stale))
    };
    fleet.http.post_json(&sim_gpu, &json!({"lost": true})).await;
    fleet.dataplane.wait_for("the GPU reported stale", Duration::from_secs(10), stale).await;
    let refused = fleet.http.post_json(&fleet.url("/v1/chat/completions"), &chat_body("beta", "hi")).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&refused.body));
    assert_eq!(refused.openai_error()["code"], "no_capacity");
    let served = fleet.http.post_json(&fleet.url("/v1/chat/completions"), &chat_body("alpha", "hi")).await;
    assert_eq!(served.status, StatusCode::OK, "the loaded model goes on");
    let view = crate::dashboard::fleet_view(&fleet).await;
    assert_eq!(view["gpus"][0]["gpu"]["stale"], true, "{view}");
    let badges = view["gpus"][0]["badges"].to_string();
    assert!(badges.contains("GPU not read lately"), "the dashboard says so: {badges}");

    fleet.http.post_json(&sim_gpu, &json!({"lost": false})).await;
    fleet.dataplane.wait_for("the GPU read again", Duration::from_secs(10), |s| !stale(s)).await;
    let loaded = fleet.http.post_json(&fleet.url("/v1/chat/completions"), &chat_body("beta", "hi")).await;
    assert_eq!(loaded.status, StatusCode::OK);
    assert_eq!(loaded.header("x-inferyes-route"), Some("cold"));
}

#[tokio::test]
async fn aliases_name_models_and_are_resolved_before_routing() {
    let swap = SimConfig {
        mode: inferyes_sim::SimMode::LlamaSwap,
        models: vec![SimModel::chat("alpha"), SimModel::chat("beta")],
        preload: vec!["alpha".into(), "beta".into()],
        max_loaded_models: 2,
        ..chat_sim("alpha")
    };
    let fleet = Fleet::start(vec![swap]).await;
    let mut admin = fleet.controller().fleet().await;
    use inferyes_proto::v1::{Alias, DeleteAliasRequest};
    let set = admin.set_alias(Alias { alias: "gpt-4o".into(), model: "beta".into() }).await.unwrap().into_inner();
    let hidden = admin.set_alias(Alias { alias: "alpha".into(), model: "beta".into() }).await;
    assert_eq!(hidden.unwrap_err().code(), tonic::Code::InvalidArgument, "an alias cannot hide a model");
    fleet.dataplane.wait_for("the alias", Duration::from_secs(5), |s| s.version() >= set.revision).await;

    let models = fleet.http.get(&fleet.url("/v1/models")).await.json();
    let alias = models["data"].as_array().unwrap().iter().find(|m| m["id"] == "gpt-4o").expect("listed").clone();
    assert_eq!(alias["inferyes"]["alias_of"], "beta");
    // llama-swap only knows "beta": the body reached it rewritten.
    let response = chat(&fleet.http, &fleet.dataplane.url, &chat_body("gpt-4o", "hi"), None).await;
    assert_eq!(response.json()["model"], "beta");

    let removed = admin.delete_alias(DeleteAliasRequest { alias: "gpt-4o".into() }).await.unwrap().into_inner();
    fleet.dataplane.wait_for("alias gone", Duration::from_secs(5), |s| s.version() >= removed.revision).await;
    let gone = fleet.http.post_json(&fleet.url("/v1/chat/completions"), &chat_body("gpt-4o", "hi")).await;
    assert_eq!(gone.status, StatusCode::NOT_FOUND);
}

/// Streams a long generation straight to a node's agent, as a client of
/// another data plane would load it; returns once its head arrived or it
/// was queued (a queued request's head comes only when it gets a slot).
fn load_node(
    fleet: &crate::support::Fleet,
    node: usize,
    authorization: String,
    i: usize,
) -> tokio::task::JoinHandle<()> {
    let http = fleet.http.clone();
    let url = format!("http://{}/v1/chat/completions", fleet.agents[node].proxy_addr);
    tokio::spawn(async move {
        let mut body = chat_body("chat", &format!("a long answer, please, number {i}"));
        body["max_tokens"] = json!(2_000);
        body["stream"] = json!(true);
        let headers = [("x-inferyes-backend", "main"), ("x-inferyes-model", "chat"), ("authorization", &authorization)];
        let response = http.start(Method::POST, &url, Bytes::from(body.to_string()), &headers).await;
        let mut stream = response.into_body();
        while inferyes_tests::client::next_chunk(&mut stream).await.is_some() {}
    })
}

#[tokio::test]
async fn a_session_whose_home_is_queued_past_a_recompute_moves_and_the_dashboard_says_why() {
    // One slot a node, prompts read at 200 tokens a second: the session's
    // ~200-token prompt costs a second to read again elsewhere.
    let slow = || SimConfig {
        slots: 1,
        prefill_tokens_per_second: 200.0,
        decode_tokens_per_second: 50.0,
        ..SimConfig::llama_server("chat")
    };
    let fleet = crate::support::Fleet::start(vec![slow(), slow()]).await;
    let mut body = chat_body("chat", &"hello ".repeat(100));
    body["max_tokens"] = json!(2);
    let first = chat(&fleet.http, &fleet.dataplane.url, &body, Some("conv")).await;
    let home = node(&first);
    let index = fleet.agents.iter().position(|a| a.node_id == home).unwrap();
    fleet.dataplane.wait_for("the session resident", Duration::from_secs(5), |s| s.resident("conv").is_some()).await;

    // Queue the home: one generation in its slot, three waiting, each of
    // 40 s. Staying would cost several recomputes of the prompt.
    let authorization = inferyes_tests::fleet::agent_authorization(&fleet.etcd, &home).await;
    let load: Vec<_> = (0..4).map(|i| load_node(&fleet, index, authorization.clone(), i)).collect();
    fleet
        .dataplane
        .wait_for("the home's queue", Duration::from_secs(10), |s| {
            s.nodes()
                .iter()
                .any(|n| *n.id == *home && n.backends[0].slots_busy == 1 && n.backends[0].requests_deferred == 3)
        })
        .await;
    body["messages"].as_array_mut().unwrap().push(first.json()["choices"][0]["message"].clone());
    body["messages"].as_array_mut().unwrap().push(json!({"role": "user", "content": "and then?"}));
    let moved = chat(&fleet.http, &fleet.dataplane.url, &body, Some("conv")).await;
    assert_eq!(moved.header("x-inferyes-route"), Some("moved"));
    assert_ne!(node(&moved), home);

    let request_id = moved.header("x-request-id").expect("a request id").to_string();
    inferyes_tests::eventually("the move on the dashboard with its costs", Duration::from_secs(10), || async {
        let view = crate::dashboard::fleet_view(&fleet).await;
        view["decisions"].as_array().unwrap().iter().any(|d| {
            let (here, at_home) =
                (d["expected_ttft_ms"].as_u64().unwrap(), d["home_expected_ttft_ms"].as_u64().unwrap());
            d["request_id"] == request_id.as_str() && d["route"] == "moved" && 0 < here && here < at_home
        })
    })
    .await;
    // The decision, read back by its request id: every node weighed, term
    // by term, and why the winner won.
    let url = fleet.controller().url();
    let explained = crate::ctl::ctl(&url, &["explain", &request_id, "-o", "json"]).await.unwrap();
    let explained: Value = serde_json::from_str(&explained).unwrap();
    let (to, left) = (&explained["candidates"][0], &explained["candidates"][1]);
    assert_eq!(
        (&explained["route"], &to["node_id"], &left["node_id"]),
        (&json!("moved"), &json!(node(&moved)), &json!(home))
    );
    assert_eq!(
        (&to["standing"], &to["cache"], &to["move_ms"]),
        (&json!("warm"), &json!("none"), &json!(1_000)),
        "{explained}"
    );
    assert_eq!((&left["standing"], &left["cache"]), (&json!("resident"), &json!("resident")), "{explained}");
    assert!(left["cached_tokens"].as_u64().unwrap() > 0 && left["queue_ahead"].as_u64().unwrap() >= 1, "{explained}");
    assert!(to["cost_ms"].as_u64().unwrap() < left["cost_ms"].as_u64().unwrap(), "the cheaper won: {explained}");
    let table = crate::ctl::ctl(&url, &["explain", &request_id]).await.unwrap();
    let why = table.lines().find(|line| line.starts_with("why: ")).unwrap_or_else(|| panic!("{table}"));
    assert!(why.contains("below the") && why.contains(&home), "{table}");
    let unknown = crate::ctl::ctl(&url, &["explain", "no-such-request"]).await.unwrap_err();
    assert!(unknown.to_string().contains("no request `no-such-request`"), "{unknown}");
    load.iter().for_each(tokio::task::JoinHandle::abort);
}

#[tokio::test]
async fn the_agent_reports_the_prompt_rate_and_service_time_its_server_shows() {
    let sim = SimConfig { prefill_tokens_per_second: 20_000.0, decode_tokens_per_second: 1_000.0, ..chat_sim("chat") };
    let fleet = crate::support::Fleet::start(vec![sim]).await;
    for i in 0..3 {
        chat(&fleet.http, &fleet.dataplane.url, &chat_body("chat", &format!("hello {i} ").repeat(50)), None).await;
    }
    // 20,000 is the server's, not a default (1,000 where none is known).
    fleet
        .dataplane
        .wait_for("the prompt rate in the snapshot", Duration::from_secs(10), |s| {
            s.placements("chat").is_some_and(|p| p[0].prefill_tokens_per_second == 20_000.0)
        })
        .await;
    inferyes_tests::eventually("the service time on the dashboard", Duration::from_secs(10), || async {
        let view = crate::dashboard::fleet_view(&fleet).await;
        view["gpus"][0]["backends"][0]["service_ms"].as_u64().is_some_and(|ms| ms > 0)
    })
    .await;
}
