//! A llama-swap backend (the simulator's faithful fake of its HTTP API)
//! behind an agent: models loaded on demand, their state in the catalog,
//! its errors reshaped.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use inferyes_proto::v1::ModelState;
use inferyes_sim::{SimConfig, SimModel};
use inferyes_tests::client::next_chunk;
use serde_json::json;

use crate::support::{Fleet, chat_body, state_of};

/// A llama-swap serving `alpha` (loaded) and `beta`, one at a time.
pub fn swap(legacy: bool) -> SimConfig {
    SimConfig {
        models: vec![SimModel::chat("alpha"), SimModel::chat("beta")],
        preload: vec!["alpha".into()],
        max_loaded_models: 1,
        load_delay_ms: 300,
        prefill_tokens_per_second: 1e6,
        decode_tokens_per_second: 1e5,
        llama_swap_legacy: legacy,
        ..SimConfig::llama_swap(["alpha", "beta"])
    }
}

#[tokio::test]
async fn a_cold_model_is_loaded_on_demand_and_the_catalog_follows() {
    for legacy in [false, true] {
        let fleet = Fleet::start(vec![swap(legacy)]).await;
        // Modern builds say so in /v1/models; older ones through /running.
        fleet
            .dataplane
            .wait_for("alpha loaded, beta not", Duration::from_secs(5), |_| {
                state_of(&fleet, "alpha") == Some(ModelState::Loaded)
                    && state_of(&fleet, "beta") == Some(ModelState::Unloaded)
            })
            .await;

        let response = fleet.http.post_json(&fleet.url("/v1/chat/completions"), &chat_body("beta", "hi")).await;
        assert_eq!(response.status, StatusCode::OK, "{}", String::from_utf8_lossy(&response.body));
        assert_eq!(response.header("x-inferyes-route"), Some("cold"));
        assert_eq!(response.json()["model"], "beta");
        fleet
            .dataplane
            .wait_for("beta loaded, alpha swapped out", Duration::from_secs(5), |_| {
                state_of(&fleet, "beta") == Some(ModelState::Loaded)
                    && state_of(&fleet, "alpha") == Some(ModelState::Unloaded)
            })
            .await;
        let warm = fleet.http.post_json(&fleet.url("/v1/chat/completions"), &chat_body("beta", "again")).await;
        // A new conversation, placed on the node now warm.
        assert_eq!(warm.header("x-inferyes-route"), Some("placed"));
    }
}

#[tokio::test]
async fn the_concurrency_limit_reaches_the_client_as_an_openai_429() {
    let limited = SimConfig { concurrency_limit: 1, decode_tokens_per_second: 20.0, ..swap(false) };
    let fleet = Fleet::start(vec![limited]).await;
    let streaming = json!({"model": "alpha", "stream": true, "max_tokens": 40,
                           "messages": [{"role": "user", "content": "a long story"}]});
    let first = fleet
        .http
        .start(Method::POST, &fleet.url("/v1/chat/completions"), Bytes::from(streaming.to_string()), &[])
        .await;
    assert_eq!(first.status(), StatusCode::OK);
    let mut body = first.into_body();
    next_chunk(&mut body).await.expect("the first request is generating");

    let second = fleet.http.post_json(&fleet.url("/v1/chat/completions"), &chat_body("alpha", "me too")).await;
    assert_eq!(second.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(second.header("retry-after"), Some("1"));
    let error = second.openai_error();
    assert_eq!(error["code"], "concurrency_limit");
    assert_eq!(error["type"], "rate_limit_error");
    drop(body);
}

#[tokio::test]
async fn a_stream_that_starts_a_cold_load_hears_about_it_at_once() {
    let slow_load = SimConfig { load_delay_ms: 2500, ..swap(false) };
    let fleet = Fleet::start(vec![slow_load]).await;
    let request = json!({"model": "beta", "stream": true, "max_tokens": 4,
                         "messages": [{"role": "user", "content": "hi"}]});
    let response =
        fleet.http.start(Method::POST, &fleet.url("/v1/chat/completions"), Bytes::from(request.to_string()), &[]).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-inferyes-route"], "cold");
    assert_eq!(response.headers()["x-inferyes-node"], "node-a");
    let mut body = response.into_body();
    let first = next_chunk(&mut body).await.expect("a first event");
    assert!(first.starts_with(b": loading model beta on node node-a"), "{first:?}");
    // The head and the first note came before the model took the request.
    assert_eq!(fleet.sims[0].sim.stats().requests, 0, "the model answered before the client heard of its load");

    let mut text = String::from_utf8(first.to_vec()).unwrap();
    while let Some(chunk) = next_chunk(&mut body).await {
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    assert!(text.matches(": loading model beta").count() >= 2, "a note each second: {text}");
    assert!(text.contains("\"chat.completion.chunk\""), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    // Its time to the first token is the load's and more, not its headers'.
    let metrics = fleet.http.get(&format!("{}/metrics", fleet.dataplane.admin_url)).await;
    let metrics = String::from_utf8_lossy(&metrics.body);
    let first_token = metrics
        .lines()
        .find_map(|l| l.strip_prefix("inferyes_dataplane_first_token_seconds_sum{model=\"beta\"} "))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no first-token time for beta: {metrics}"));
    assert!(first_token >= 2.5, "{first_token} s to the first token of a 2.5 s load");
}

#[tokio::test]
async fn a_cold_load_holds_the_model_s_size_against_its_node_until_it_answers() {
    let slow_load = SimConfig { load_delay_ms: 1500, ..swap(false) };
    let size = slow_load.models.iter().find(|m| m.id == "beta").expect("beta").size_bytes;
    let fleet = Fleet::start(vec![slow_load]).await;
    let reserved = |fleet: &Fleet| {
        let snapshot = fleet.dataplane.store.current().expect("a snapshot");
        snapshot.nodes()[0].endpoint.reserved_vram_bytes()
    };
    fleet
        .dataplane
        .wait_for("beta's size known", Duration::from_secs(5), |s| {
            s.placements("beta").is_some_and(|ps| ps.iter().all(|p| p.size_bytes == size))
        })
        .await;
    let request = json!({"model": "beta", "stream": true, "max_tokens": 4,
                         "messages": [{"role": "user", "content": "hi"}]});
    let response =
        fleet.http.start(Method::POST, &fleet.url("/v1/chat/completions"), Bytes::from(request.to_string()), &[]).await;
    assert_eq!(response.headers()["x-inferyes-route"], "cold");
    let mut body = response.into_body();
    // The first note may go out as the request does: the hold is awaited.
    inferyes_tests::eventually("the model's size held while it loads", Duration::from_secs(5), || async {
        reserved(&fleet) == size
    })
    .await;
    while next_chunk(&mut body).await.is_some() {}
    assert_eq!(reserved(&fleet), 0, "given back once the node answered");
}

/// A node's proxy that answers every request `503`, as an agent whose
/// backends all failed would; its URL. Serves until `stop`.
async fn refusing_proxy(stop: tokio_util::sync::CancellationToken) -> String {
    let refuse = || async {
        let error = json!({"error": {"message": "no backend", "type": "unavailable_error", "code": 503}});
        (StatusCode::SERVICE_UNAVAILABLE, axum::Json(error))
    };
    let app = axum::Router::new().fallback(refuse);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("bound"));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned()).await;
    });
    url
}

#[tokio::test]
async fn a_cold_stream_that_fails_over_is_recorded_under_the_node_that_answered() {
    use inferyes_tests::{AgentHandle, ControllerHandle, DataplaneHandle, Etcd, HttpClient, SimHandle};
    // Two llama-swap nodes, `beta` loaded on neither: the load goes first
    // to node-a, whose GPU has the more free memory, but its proxy refuses
    // everything; node-b loads it and streams the answer.
    let stop = tokio_util::sync::CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let big_gpu = inferyes_sim::SimGpu { memory_total_bytes: 80 << 30, ..Default::default() };
    let sims =
        vec![SimHandle::start(SimConfig { gpu: big_gpu, ..swap(false) }).await, SimHandle::start(swap(false)).await];
    let refusing = refusing_proxy(stop.clone()).await;
    let agents = vec![
        AgentHandle::start_tweaked(
            "node-a",
            &[controller.url()],
            inferyes_agent::config::GpuSourceConfig::Simulated,
            inferyes_tests::fleet::sim_backends(&[("main", &sims[0])]),
            |config| config.advertise_url = refusing,
        )
        .await,
        AgentHandle::start("node-b", &[controller.url()], &[("main", &sims[1])]).await,
    ];
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-a", "node-b"]).await;
    let fleet = Fleet { etcd, controller: Some(controller), sims, agents, dataplane, http: HttpClient::default() };
    fleet
        .dataplane
        .wait_for("beta's size known on both nodes", Duration::from_secs(5), |s| {
            s.placements("beta").is_some_and(|ps| ps.len() == 2 && ps.iter().all(|p| p.size_bytes > 0))
        })
        .await;

    let request = json!({"model": "beta", "stream": true, "max_tokens": 4,
                         "messages": [{"role": "user", "content": "hi"}]});
    let response =
        fleet.http.start(Method::POST, &fleet.url("/v1/chat/completions"), Bytes::from(request.to_string()), &[]).await;
    let request_id = response.headers()["x-request-id"].to_str().expect("text").to_string();
    // Told at once where the load starts, before any node has answered.
    assert_eq!(response.headers()["x-inferyes-route"], "cold");
    assert_eq!(response.headers()["x-inferyes-node"], "node-a");
    let mut body = response.into_body();
    let mut text = String::new();
    while let Some(chunk) = next_chunk(&mut body).await {
        text.push_str(std::str::from_utf8(&chunk).expect("text"));
    }
    assert!(text.ends_with("data: [DONE]\n\n"), "node-b answered: {text}");
    assert_eq!(fleet.sims[1].sim.stats().requests, 1, "{text}");

    // Recorded under the node that answered, as a failover.
    let metrics = fleet.http.get(&format!("{}/metrics", fleet.dataplane.admin_url)).await;
    let metrics = String::from_utf8_lossy(&metrics.body).into_owned();
    let served =
        "inferyes_dataplane_requests_total{model=\"beta\",node=\"node-b\",status=\"200\",route=\"failover\"} 1";
    assert!(metrics.lines().any(|line| line == served), "{metrics}");
    assert!(!metrics.contains("node=\"node-a\",status=\"200\""), "{metrics}");
    inferyes_tests::eventually("the decision on the dashboard", Duration::from_secs(10), || async {
        let view = crate::dashboard::fleet_view(&fleet).await;
        view["decisions"]
            .as_array()
            .expect("decisions")
            .iter()
            .any(|d| d["request_id"] == request_id.as_str() && d["node"] == "node-b" && d["route"] == "failover")
    })
    .await;
}
