//! The data plane's Prometheus metrics, scraped after real traffic.

use std::collections::HashMap;

use bytes::Bytes;
use http::{Method, StatusCode};
use serde_json::json;

use crate::support::{Fleet, chat_body, chat_sim};

/// `name{labels}` → value, for every sample; panics on a malformed line.
fn parse(text: &str) -> HashMap<String, f64> {
    let mut samples = HashMap::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if line.starts_with('#') {
            assert!(line.starts_with("# HELP ") || line.starts_with("# TYPE ") || line == "# EOF", "{line}");
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value: {line}"));
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("bad value: {line}"));
        let name = series.split('{').next().unwrap_or_default();
        assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'), "bad name: {line}");
        assert!(!series.contains('{') || series.ends_with('}'), "bad labels: {line}");
        samples.insert(series.to_string(), value);
    }
    samples
}

fn sum(samples: &HashMap<String, f64>, prefix: &str, contains: &[&str]) -> f64 {
    samples
        .iter()
        .filter(|(k, _)| k.starts_with(prefix) && contains.iter().all(|c| k.contains(c)))
        .map(|(_, v)| v)
        .sum()
}

#[tokio::test]
async fn the_data_plane_counts_requests_latency_and_its_view_of_the_fleet() {
    let fleet = Fleet::start(vec![chat_sim("chat"), chat_sim("chat")]).await;
    let url = fleet.url("/v1/chat/completions");
    for i in 0..5 {
        assert_eq!(fleet.http.post_json(&url, &chat_body("chat", &format!("q{i}"))).await.status, StatusCode::OK);
    }
    for i in 0..3 {
        let body = json!({"model": "chat", "stream": true, "max_tokens": 4,
                          "messages": [{"role": "user", "content": format!("s{i}")}]});
        let response = fleet.http.send(Method::POST, &url, Bytes::from(body.to_string()), &[]).await;
        assert_eq!(response.status, StatusCode::OK);
    }
    for garbage in ["no-such-model-1", "no-such-model-2"] {
        assert_eq!(fleet.http.post_json(&url, &chat_body(garbage, "x")).await.status, StatusCode::NOT_FOUND);
    }

    // Not on the public port: what the metrics tell is the operator's.
    let public = fleet.http.get(&fleet.url("/metrics")).await;
    assert_eq!(public.status, StatusCode::NOT_FOUND);
    let scraped = fleet.http.get(&format!("{}/metrics", fleet.dataplane.admin_url)).await;
    assert_eq!(scraped.status, StatusCode::OK);
    assert!(scraped.header("content-type").unwrap().starts_with("text/plain"));
    let text = String::from_utf8(scraped.body.to_vec()).unwrap();
    assert!(text.contains("# TYPE inferyes_dataplane_requests counter"), "{text}");
    let samples = parse(&text);

    let ok = sum(&samples, "inferyes_dataplane_requests_total{", &["model=\"chat\"", "status=\"200\""]);
    assert_eq!(ok, 8.0, "{text}");
    // Client-chosen names do not become labels.
    let unknown = sum(&samples, "inferyes_dataplane_requests_total{", &["model=\"_unknown\"", "status=\"404\""]);
    assert_eq!(unknown, 2.0, "{text}");
    assert!(!text.contains("no-such-model"));
    assert_eq!(sum(&samples, "inferyes_dataplane_request_seconds_count{", &["model=\"chat\""]), 5.0);
    assert_eq!(sum(&samples, "inferyes_dataplane_first_token_seconds_count{", &["model=\"chat\""]), 3.0);
    assert_eq!(sum(&samples, "inferyes_dataplane_stream_seconds_count{", &["model=\"chat\""]), 3.0);
    let (first, whole) = (
        sum(&samples, "inferyes_dataplane_first_token_seconds_sum{", &["model=\"chat\""]),
        sum(&samples, "inferyes_dataplane_stream_seconds_sum{", &["model=\"chat\""]),
    );
    assert!(whole >= first && whole > 0.0, "a stream ends after its first token: {first} s, {whole} s");
    // Snapshots keep coming (agents report): the scraped one is the one
    // held then, no newer than the one held now.
    let version = samples["inferyes_dataplane_snapshot_version"];
    assert!(version > 0.0 && version <= fleet.dataplane.store.version().unwrap() as f64);
    for node in ["node-a", "node-b"] {
        assert_eq!(samples[&format!("inferyes_dataplane_node_in_flight{{node=\"{node}\"}}")], 0.0);
        assert_eq!(samples[&format!("inferyes_dataplane_node_ejected{{node=\"{node}\"}}")], 0.0);
    }
}

#[tokio::test]
async fn agents_and_controllers_expose_what_they_see() {
    let fleet = Fleet::start(vec![chat_sim("chat"), chat_sim("chat")]).await;
    let url = fleet.url("/v1/chat/completions");
    for turn in 0..3 {
        let body = Bytes::from(chat_body("chat", "same conversation").to_string());
        let response = fleet.http.send(Method::POST, &url, body, &[("x-session-id", "metered")]).await;
        assert_eq!(response.status, StatusCode::OK, "turn {turn}");
    }
    let home = fleet
        .http
        .send(Method::POST, &url, Bytes::from(chat_body("chat", "x").to_string()), &[("x-session-id", "metered")])
        .await
        .header("x-inferyes-node")
        .unwrap()
        .to_string();
    let agent = fleet.agents.iter().find(|a| a.node_id == home).unwrap();

    let on_proxy = fleet.http.get(&format!("http://{}/metrics", agent.proxy_addr)).await;
    assert_eq!(on_proxy.status, StatusCode::UNAUTHORIZED, "the proxy's port is the data planes'");
    let scraped = fleet.http.get(&format!("http://{}/metrics", agent.admin_addr)).await;
    assert_eq!(scraped.status, StatusCode::OK);
    let text = String::from_utf8(scraped.body.to_vec()).unwrap();
    let samples = parse(&text);
    assert_eq!(samples["inferyes_agent_backend_up{backend=\"main\"}"], 1.0, "{text}");
    assert_eq!(samples["inferyes_agent_slots_total{backend=\"main\"}"], 4.0);
    assert!(samples["inferyes_agent_resident_sessions{backend=\"main\"}"] >= 1.0);
    assert!(samples["inferyes_agent_residency_hits{backend=\"main\"}"] >= 2.0, "turns 2-4 found their prefix: {text}");
    assert!(sum(&samples, "inferyes_agent_gpu_memory_total_bytes{", &[]) > 0.0);
    assert!(samples["inferyes_agent_first_byte_seconds_count{backend=\"main\"}"] >= 4.0, "{text}");

    let scraped = fleet.http.get(&format!("http://{}/metrics", fleet.controller().http_addr)).await;
    let text = String::from_utf8(scraped.body.to_vec()).unwrap();
    let samples = parse(&text);
    assert_eq!(samples["inferyes_controller_nodes{state=\"active\"}"], 2.0, "{text}");
    assert_eq!(samples["inferyes_controller_agent_streams"], 2.0);
    assert!(samples["inferyes_controller_node_writes_total"] >= 2.0);
    assert!(samples["inferyes_controller_snapshot_build_seconds_count"] >= 1.0);
    // Read when the controller starts: what to alert on before etcd's quota.
    assert!(samples["inferyes_controller_etcd_db_size_bytes"] > 0.0, "{text}");
    assert!(samples["inferyes_controller_etcd_db_size_in_use_bytes"] > 0.0);
    assert_eq!(samples["inferyes_controller_etcd_quota_bytes"], 2_147_483_648.0);
    assert_eq!(samples["inferyes_controller_max_nodes"], 4096.0);
}
