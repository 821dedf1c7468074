//! The usage ledger: what data planes record reaches the roll-ups exactly
//! once, equals what the backends counted, survives several data planes
//! and controllers writing at once, and drives daily token budgets.

use std::time::Duration;

use http::{Method, StatusCode};
use inferyes_dataplane::auth::AuthMode;
use inferyes_dataplane::config::AgentProtocol;
use inferyes_proto::v1::{CreateKeyRequest, UsageBatch, UsageQuery, UsageRecord, UsageRollup};
use inferyes_tests::{ControllerHandle, DataplaneHandle, HttpClient, TestResponse, eventually};
use serde_json::json;

use crate::support::{Fleet, chat_sim, create_key};

/// The fleet's usage totals over the last day, for `key_id` (empty: all).
pub async fn usage_total(controller: &ControllerHandle, key_id: &str) -> UsageRollup {
    let report = controller
        .fleet()
        .await
        .get_usage(UsageQuery { key_id: key_id.into(), ..Default::default() })
        .await
        .expect("usage query")
        .into_inner();
    let mut total = UsageRollup::default();
    for row in report.rows {
        inferyes_controller::ledger::merge(&mut total, &row.usage.unwrap_or_default());
    }
    total
}

/// Waits until the roll-up shows `requests` requests.
pub async fn rolled_up(controller: &ControllerHandle, key_id: &str, requests: u64) -> UsageRollup {
    eventually(&format!("{requests} requests rolled up"), Duration::from_secs(20), || async {
        usage_total(controller, key_id).await.requests >= requests
    })
    .await;
    usage_total(controller, key_id).await
}

async fn ask(http: &HttpClient, url: &str, key: Option<&str>, stream: bool, text: &str) -> TestResponse {
    let body = json!({"model": "chat", "stream": stream, "max_tokens": 6,
                      "messages": [{"role": "user", "content": text}]});
    let bearer = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = bearer.iter().map(|b| ("authorization", b.as_str())).collect();
    let response =
        http.send(Method::POST, &format!("{url}/v1/chat/completions"), body.to_string().into(), &headers).await;
    assert_eq!(response.status, StatusCode::OK, "{}", String::from_utf8_lossy(&response.body));
    response
}

#[tokio::test]
async fn embeddings_are_billed_what_the_server_counted_though_it_says_so_before_the_vectors() {
    let fleet = Fleet::start_with(vec![crate::support::embedding_model("embed")], |c| {
        c.auth = AuthMode::Keys;
    })
    .await;
    let (key_id, secret) = create_key(&fleet, CreateKeyRequest { name: "embedder".into(), ..Default::default() }).await;
    // Vectors long enough that the answer's last kilobytes hold no usage.
    let inputs: Vec<String> = (0..3).map(|i| format!("{i} {}", "word ".repeat(80))).collect();
    let body = json!({"model": "embed", "input": inputs});
    let bearer = format!("Bearer {secret}");
    let url = format!("{}/v1/embeddings", fleet.dataplane.url);
    let answer = fleet.http.send(Method::POST, &url, body.to_string().into(), &[("authorization", &bearer)]).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", String::from_utf8_lossy(&answer.body));
    let tail = &answer.body[answer.body.len().saturating_sub(inferyes_proto::usage::TAIL_BYTES)..];
    assert!(!String::from_utf8_lossy(tail).contains("usage"), "the usage is not at the answer's end");
    let total = rolled_up(fleet.controller(), &key_id, 1).await;
    let counted = fleet.sims[0].sim.stats().prompt_tokens;
    assert_eq!((total.prompt_tokens, total.estimated_requests), (counted, 0), "{total:?}");
}

#[tokio::test]
async fn usage_of_plain_and_streamed_answers_is_what_the_backends_counted() {
    // Slow enough to generate that each answer's time shows in whole
    // milliseconds: 6 tokens at 200 a second.
    let sim = inferyes_sim::SimConfig { decode_tokens_per_second: 200.0, ..chat_sim("chat") };
    let fleet = Fleet::start_with(vec![sim.clone(), sim], |c| {
        c.auth = AuthMode::Keys;
        c.usage_records = true;
    })
    .await;
    let (key_id, secret) = create_key(&fleet, CreateKeyRequest { name: "metered".into(), ..Default::default() }).await;
    for i in 0..4 {
        ask(&fleet.http, &fleet.dataplane.url, Some(&secret), false, &format!("plain {i}")).await;
        ask(&fleet.http, &fleet.dataplane.url, Some(&secret), true, &format!("streamed {i}")).await;
    }
    let total = rolled_up(fleet.controller(), &key_id, 8).await;
    let backends = fleet
        .sims
        .iter()
        .map(|s| s.sim.stats())
        .fold((0, 0, 0), |acc, s| (acc.0 + s.requests, acc.1 + s.prompt_tokens, acc.2 + s.completion_tokens));
    assert_eq!(total.requests, 8);
    assert_eq!(backends.0, 8);
    assert_eq!((total.prompt_tokens, total.completion_tokens), (backends.1, backends.2), "{total:?}");
    assert_eq!(total.completion_tokens, 8 * 6);
    assert_eq!((total.errors, total.estimated_requests), (0, 0));

    // Today's tokens reach the data plane with the snapshot.
    let expected = total.prompt_tokens + total.completion_tokens;
    let id = key_id.clone();
    fleet.dataplane.wait_for("today's tokens", Duration::from_secs(10), move |s| s.tokens_today(&id) == expected).await;

    // The raw records export, one per request.
    let mut export = fleet
        .controller()
        .fleet()
        .await
        .export_usage(UsageQuery { key_id: key_id.clone(), ..Default::default() })
        .await
        .expect("export")
        .into_inner();
    let mut records: Vec<UsageRecord> = Vec::new();
    while let Some(record) = export.message().await.expect("record") {
        records.push(record);
    }
    assert_eq!(records.len(), 8);
    assert_eq!(records.iter().filter(|r| r.stream).count(), 4);
    assert!(records.iter().all(|r| r.outcome == "ok" && r.node_id.starts_with("node-") && r.status == 200));
    assert!(records.iter().filter(|r| r.stream).all(|r| r.ttft_ms <= r.latency_ms));
    // The backends' time on each, as their timings said, and summed.
    assert!(records.iter().all(|r| (25..=60).contains(&r.generation_ms)), "{records:?}");
    let (prompt_ms, generation_ms) = records.iter().fold((0, 0), |(p, g), r| (p + r.prompt_ms, g + r.generation_ms));
    assert_eq!((total.prompt_ms, total.generation_ms), (prompt_ms, generation_ms));
}

#[tokio::test]
async fn each_tenant_s_gpu_time_is_rolled_up_and_charted_on_the_dashboard() {
    // 6 tokens at 200 a second: 30 ms of generation an answer.
    let sim = inferyes_sim::SimConfig { decode_tokens_per_second: 200.0, ..chat_sim("chat") };
    let fleet = Fleet::start_with(vec![sim], |c| c.auth = AuthMode::Keys).await;
    let key =
        |name: &str, tenant: &str| CreateKeyRequest { name: name.into(), tenant: tenant.into(), ..Default::default() };
    let (a1, a1_secret) = create_key(&fleet, key("a1", "team-a")).await;
    let (a2, a2_secret) = create_key(&fleet, key("a2", "team-a")).await;
    let (solo, solo_secret) = create_key(&fleet, key("solo", "")).await;
    for (secret, times) in [(&a1_secret, 2), (&a2_secret, 1), (&solo_secret, 1)] {
        for i in 0..times {
            ask(&fleet.http, &fleet.dataplane.url, Some(secret), i % 2 == 1, &format!("hello {i}")).await;
        }
    }
    let gpu_ms = |u: &UsageRollup| u.prompt_ms + u.generation_ms;
    let team_a =
        gpu_ms(&rolled_up(fleet.controller(), &a1, 2).await) + gpu_ms(&rolled_up(fleet.controller(), &a2, 1).await);
    let alone = gpu_ms(&rolled_up(fleet.controller(), &solo, 1).await);
    assert!(team_a >= 3 * 25 && alone >= 25, "{team_a} ms, {alone} ms");

    // The ledger's rows name each key's tenant.
    let report = fleet.controller().fleet().await.get_usage(UsageQuery::default()).await.expect("usage").into_inner();
    let tenants: std::collections::BTreeSet<(String, String)> =
        report.rows.iter().map(|row| (row.key_id.clone(), row.tenant.clone())).collect();
    assert_eq!(tenants, [(a1, "team-a".into()), (a2, "team-a".into()), (solo.clone(), String::new())].into());

    // The dashboard charts the same, a key without a tenant as its own.
    let charted = |view: &serde_json::Value, tenant: &str| {
        view["usage"]["tenants"]
            .as_array()
            .and_then(|tenants| tenants.iter().find(|t| t["tenant"] == tenant).and_then(|t| t["gpu_ms_total"].as_u64()))
    };
    eventually("both tenants charted", Duration::from_secs(20), || async {
        let view = crate::dashboard::fleet_view(&fleet).await;
        charted(&view, "team-a") == Some(team_a) && charted(&view, &format!("key:{solo}")) == Some(alone)
    })
    .await;
    let view = crate::dashboard::fleet_view(&fleet).await;
    let hours = view["usage"]["hours"].as_array().expect("hours").len();
    let team = view["usage"]["tenants"].as_array().unwrap().iter().find(|t| t["tenant"] == "team-a").unwrap().clone();
    assert_eq!(team["gpu_ms"].as_array().unwrap().len(), hours);
    assert_eq!(team["requests"], 3);
}

#[tokio::test]
async fn a_priced_node_s_gpu_time_is_billed_at_its_price() {
    let etcd = inferyes_tests::etcd::Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let sim = inferyes_tests::fleet::SimHandle::start(inferyes_sim::SimConfig {
        decode_tokens_per_second: 200.0,
        ..chat_sim("chat")
    })
    .await;
    // 3.6 an hour: a millionth a millisecond.
    let _agent = inferyes_tests::fleet::AgentHandle::start_tweaked(
        "node-a",
        &[controller.url()],
        inferyes_agent::config::GpuSourceConfig::Simulated,
        inferyes_tests::fleet::sim_backends(&[("main", &sim)]),
        |config| config.gpu_hour_price = 3.6,
    )
    .await;
    let dataplane = DataplaneHandle::start_with(&[controller.url()], |c| c.usage_records = true).await;
    dataplane.wait_for_nodes(&["node-a"]).await;
    let http = HttpClient::default();
    for (i, stream) in [false, true].into_iter().enumerate() {
        ask(&http, &dataplane.url, None, stream, &format!("priced {i}")).await;
    }
    let total = rolled_up(&controller, "", 2).await;
    assert!(total.generation_ms >= 2 * 25, "{total:?}");
    assert_eq!(total.cost_micros, total.prompt_ms + total.generation_ms, "{total:?}");
}

#[tokio::test]
async fn a_resent_batch_is_counted_once() {
    let fleet = Fleet::start(vec![chat_sim("chat")]).await;
    let batch = UsageBatch {
        batch_id: "2026112900.test.0000000000000001.0".into(),
        dataplane_id: "test".into(),
        records: vec![UsageRecord {
            request_id: "r1".into(),
            unix_ms: inferyes_proto::unix_ms(),
            model: "chat".into(),
            outcome: "ok".into(),
            prompt_tokens: 7,
            ..Default::default()
        }],
        // Records only: the controller sums them itself.
        deltas: Vec::new(),
    };
    let mut client = fleet.controller().routing(Some(inferyes_tests::fleet::DATAPLANE_TOKEN)).await;
    client.record_usage(batch.clone()).await.expect("accepted");
    // Resent while pending, and again once rolled up: acknowledged, not counted.
    client.record_usage(batch.clone()).await.expect("accepted again");
    let total = rolled_up(fleet.controller(), "", 1).await;
    client.record_usage(batch).await.expect("accepted once more");
    let report = fleet.controller().fleet().await.get_usage(UsageQuery::default()).await.expect("usage").into_inner();
    assert_eq!(report.pending_batches, 0, "the resend was not stored again");
    assert_eq!((total.requests, total.prompt_tokens), (1, 7));
    assert_eq!(usage_total(fleet.controller(), "").await.requests, 1);
    // A batch for an hour ahead would stay in etcd for good: refused.
    let ahead = UsageBatch { batch_id: "9999123123.test.0000000000000001.1".into(), ..Default::default() };
    assert_eq!(client.record_usage(ahead).await.unwrap_err().code(), tonic::Code::InvalidArgument);
}

#[tokio::test]
async fn two_data_planes_and_two_controllers_writing_at_once_lose_nothing() {
    let fleet = Fleet::start(vec![chat_sim("chat"), chat_sim("chat")]).await;
    let second = ControllerHandle::start(&fleet.etcd.endpoint(), "controller-2").await;
    // Each data plane reports to its own controller.
    let other = DataplaneHandle::start_with(&[second.url()], |c| c.dataplane_id = "dataplane-2".into()).await;
    other.wait_for_nodes(&["node-a", "node-b"]).await;
    let per_plane = 20;
    let mut tasks = Vec::new();
    for url in [fleet.dataplane.url.clone(), other.url.clone()] {
        for worker in 0..2 {
            let url = url.clone();
            tasks.push(tokio::spawn(async move {
                let http = HttpClient::default();
                for i in 0..per_plane / 2 {
                    ask(&http, &url, None, i % 2 == 0, &format!("w{worker} q{i}")).await;
                }
            }));
        }
    }
    for task in tasks {
        task.await.expect("client");
    }
    let total = rolled_up(fleet.controller(), "", 2 * per_plane).await;
    let prompt: u64 = fleet.sims.iter().map(|s| s.sim.stats().prompt_tokens).sum();
    let completion: u64 = fleet.sims.iter().map(|s| s.sim.stats().completion_tokens).sum();
    assert_eq!(total.requests, 2 * per_plane);
    assert_eq!((total.prompt_tokens, total.completion_tokens), (prompt, completion));
    // Both controllers answer the same from etcd.
    assert_eq!(usage_total(&second, "").await, total);
    other.stop().await;
    second.stop().await;
}

#[tokio::test]
async fn a_graceful_shutdown_flushes_every_record() {
    let fleet = Fleet::start(vec![chat_sim("chat")]).await;
    let http = HttpClient::default();
    for i in 0..5 {
        ask(&http, &fleet.dataplane.url, None, false, &format!("last words {i}")).await;
    }
    // Stopped right away: its records are still queued, and go out on the
    // way down.
    let Fleet { dataplane, controller, etcd, sims, agents, .. } = fleet;
    dataplane.stop().await;
    let controller = controller.expect("running");
    assert_eq!(rolled_up(&controller, "", 5).await.requests, 5);
    drop((etcd, sims, agents));
}

#[tokio::test]
async fn a_key_over_its_daily_tokens_is_refused_until_tomorrow() {
    let fleet = Fleet::start_with(vec![chat_sim("chat")], |c| c.auth = AuthMode::Keys).await;
    let (_, secret) =
        create_key(&fleet, CreateKeyRequest { name: "budget".into(), tokens_per_day: 20, ..Default::default() }).await;
    // One answer uses more than 20 tokens (prompt and 6 completion tokens).
    ask(&fleet.http, &fleet.dataplane.url, Some(&secret), false, "a question long enough to matter").await;
    let body = json!({"model": "chat", "max_tokens": 6, "messages": [{"role": "user", "content": "more"}]});
    let auth = format!("Bearer {secret}");
    let refused = fleet
        .http
        .send(
            Method::POST,
            &format!("{}/v1/chat/completions", fleet.dataplane.url),
            body.to_string().into(),
            &[("authorization", &auth)],
        )
        .await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{}", String::from_utf8_lossy(&refused.body));
    assert_eq!(refused.openai_error()["code"], "rate_limit_exceeded");
    assert!(refused.openai_error()["message"].as_str().expect("message").contains("per day"));
    let retry: u64 = refused.header("retry-after").expect("retry-after").parse().expect("seconds");
    assert!((1..=86_400).contains(&retry));
}

#[tokio::test]
async fn requests_at_once_spend_a_daily_budget_once() {
    // Slow enough that all of them are in flight together.
    let slow = inferyes_sim::SimConfig { decode_tokens_per_second: 40.0, ..chat_sim("chat") };
    let fleet = Fleet::start_with(vec![slow], |c| c.auth = AuthMode::Keys).await;
    let request = CreateKeyRequest { name: "budget".into(), tokens_per_day: 1_000, ..Default::default() };
    let (key_id, secret) = create_key(&fleet, request).await;
    let auth = format!("Bearer {secret}");
    let url = format!("{}/v1/chat/completions", fleet.dataplane.url);
    let asks: Vec<_> = (0..48)
        .map(|i| {
            let body = json!({"model": "chat", "max_tokens": 16, "messages": [{"role": "user",
                              "content": format!("question {i}: {}", "tell me more about it ".repeat(5))}]});
            let (http, url, auth) = (fleet.http.clone(), url.clone(), auth.clone());
            tokio::spawn(async move {
                http.send(Method::POST, &url, body.to_string().into(), &[("authorization", &auth)]).await
            })
        })
        .collect();
    let (mut answered, mut refused, mut largest) = (0, 0, 0);
    for ask in asks {
        let response = ask.await.expect("asked");
        match response.status {
            StatusCode::OK => {
                answered += 1;
                largest = largest.max(response.json()["usage"]["total_tokens"].as_u64().expect("usage"));
            }
            StatusCode::TOO_MANY_REQUESTS => {
                refused += 1;
                assert_eq!(response.openai_error()["code"], "rate_limit_exceeded");
            }
            other => panic!("{other}: {}", String::from_utf8_lossy(&response.body)),
        }
    }
    assert!(refused > 0 && answered > 0, "{answered} answered, {refused} refused");
    let total = rolled_up(fleet.controller(), &key_id, answered).await;
    let spent = total.prompt_tokens + total.completion_tokens;
    // Over the budget by at most one request's worth, and a tenth.
    assert!(spent <= 1_100 + largest, "{spent} tokens of a 1,000 budget ({answered} answered, each up to {largest})");
}

#[tokio::test]
async fn streams_are_asked_for_usage_and_clients_that_did_not_ask_do_not_see_it() {
    // Over HTTP/2 an answer says it is over with its last data frame; the
    // usage must be recorded all the same.
    for protocol in [AgentProtocol::Http1, AgentProtocol::Http2] {
        streams_are_asked_for_usage(protocol).await;
    }
}

async fn streams_are_asked_for_usage(protocol: AgentProtocol) {
    let fleet = Fleet::start_with(vec![chat_sim("chat")], |config| config.agent_protocol = protocol).await;
    let url = format!("{}/v1/chat/completions", fleet.dataplane.url);
    let plain =
        json!({"model": "chat", "stream": true, "max_tokens": 5, "messages": [{"role": "user", "content": "a"}]});
    let asked = json!({"model": "chat", "stream": true, "max_tokens": 5, "stream_options": {"include_usage": true},
                       "messages": [{"role": "user", "content": "b"}]});
    let plain = fleet.http.send(Method::POST, &url, plain.to_string().into(), &[]).await;
    let asked = fleet.http.send(Method::POST, &url, asked.to_string().into(), &[]).await;
    let (plain, asked) = (String::from_utf8_lossy(&plain.body), String::from_utf8_lossy(&asked.body));
    assert!(plain.trim_end().ends_with("data: [DONE]"), "{plain}");
    assert!(!plain.contains("\"usage\":{"), "the client did not ask for usage: {plain}");
    assert!(asked.contains("\"choices\":[]") && asked.contains("\"usage\":{"), "the client asked: {asked}");
    let total = rolled_up(fleet.controller(), "", 2).await;
    assert_eq!(
        (total.completion_tokens, total.estimated_requests, total.errors),
        (10, 0, 0),
        "{protocol:?}: {total:?}"
    );
    assert_eq!(total.prompt_tokens, fleet.sims[0].sim.stats().prompt_tokens);
}

#[tokio::test]
async fn a_crash_loses_only_what_no_controller_acknowledged() {
    let mut fleet = Fleet::start(vec![chat_sim("chat")]).await;
    let http = HttpClient::default();
    for i in 0..5 {
        ask(&http, &fleet.dataplane.url, None, false, &format!("kept {i}")).await;
    }
    assert_eq!(rolled_up(fleet.controller(), "", 5).await.requests, 5);
    // With no controller to take them, records wait in the data plane's
    // memory; served all the same, from its last snapshot.
    fleet.controller.take().expect("running").stop().await;
    for i in 0..3 {
        ask(&http, &fleet.dataplane.url, None, false, &format!("lost {i}")).await;
    }
    let Fleet { dataplane, etcd, sims, agents, .. } = fleet;
    dataplane.kill();
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-2").await;
    let report = controller.fleet().await.get_usage(UsageQuery::default()).await.expect("usage").into_inner();
    assert_eq!(report.pending_batches, 0);
    assert_eq!(usage_total(&controller, "").await.requests, 5, "the acknowledged five, not the three after");
    assert_eq!(sims[0].sim.stats().requests, 8, "all eight were served");
    drop((agents, sims));
}

#[tokio::test]
async fn without_raw_records_only_sums_travel_and_nothing_is_exported() {
    let fleet = Fleet::start(vec![chat_sim("chat")]).await;
    for i in 0..3 {
        ask(&fleet.http, &fleet.dataplane.url, None, i % 2 == 0, &format!("summed {i}")).await;
    }
    let total = rolled_up(fleet.controller(), "", 3).await;
    assert_eq!(total.prompt_tokens, fleet.sims[0].sim.stats().prompt_tokens);
    // Usage without keys leaves today's tokens per key as they were, so
    // nothing is written in the fleet's watch: no new snapshot goes to
    // every data plane for it.
    let mut etcd = etcd_client::Client::connect([fleet.etcd.endpoint()], None).await.expect("etcd");
    let today = etcd.get("/inferyes/v1/usage/today", None).await.expect("read");
    assert!(today.kvs().is_empty(), "today's tokens were written for usage without keys");
    let mut export =
        fleet.controller().fleet().await.export_usage(UsageQuery::default()).await.expect("export").into_inner();
    assert!(export.message().await.expect("stream").is_none(), "no raw records were kept");
}

#[tokio::test]
async fn requests_for_models_the_fleet_lacks_are_refused_and_not_metered() {
    // Else any name a client sends would be a row of the ledger, held in
    // memory while no controller takes it.
    let fleet = Fleet::start(vec![chat_sim("chat")]).await;
    for i in 0..3 {
        let body = json!({"model": format!("no-such-model-{i}"), "messages": [{"role": "user", "content": "hi"}]});
        let url = format!("{}/v1/chat/completions", fleet.dataplane.url);
        let response = fleet.http.send(Method::POST, &url, body.to_string().into(), &[]).await;
        assert_eq!(response.status, StatusCode::NOT_FOUND);
        let error: serde_json::Value = serde_json::from_slice(&response.body).expect("JSON error");
        assert_eq!(error["error"]["code"], "model_not_found", "{error}");
        assert!(error["error"]["message"].as_str().unwrap_or_default().contains("available models: chat"), "{error}");
    }
    ask(&fleet.http, &fleet.dataplane.url, None, false, "known").await;
    let total = rolled_up(fleet.controller(), "", 1).await;
    assert_eq!((total.requests, total.errors), (1, 0), "{total:?}");
}

#[tokio::test]
async fn a_cold_stream_that_fails_is_counted_as_an_error_without_tokens() {
    use inferyes_tests::client::next_chunk;
    // One request at a time per model: a second stream for the model
    // being loaded is refused (429) once its 200 and first note are out.
    // The load lasts long enough for the second to reach the server while
    // it does, on a machine busy with other tests too.
    let swap = inferyes_sim::SimConfig { load_delay_ms: 4_000, concurrency_limit: 1, ..crate::swap::swap(false) };
    let fleet = Fleet::start(vec![swap]).await;
    let url = fleet.url("/v1/chat/completions");
    let stream = |text: &str| {
        let body = json!({"model": "beta", "stream": true, "max_tokens": 4,
                          "messages": [{"role": "user", "content": text}]});
        fleet.http.start(Method::POST, &url, body.to_string().into(), &[])
    };
    let loading = stream("load beta").await;
    assert_eq!(loading.headers()["x-inferyes-route"], "cold");
    let mut loading = loading.into_body();
    next_chunk(&mut loading).await.expect("the load has started");

    let refused = stream("me too").await;
    assert_eq!(refused.status(), StatusCode::OK, "a cold stream answers at once");
    let mut refused = refused.into_body();
    let mut text = String::new();
    while let Some(chunk) = next_chunk(&mut refused).await {
        text.push_str(std::str::from_utf8(&chunk).expect("text"));
    }
    assert!(text.contains("\"concurrency_limit\""), "{text}");
    while next_chunk(&mut loading).await.is_some() {}

    let total = rolled_up(fleet.controller(), "", 2).await;
    assert_eq!(total.requests, 2);
    assert_eq!(total.errors, 1, "{total:?}");
    assert_eq!(total.estimated_requests, 0, "the refused stream was counted as cancelled: {total:?}");
    assert_eq!(total.prompt_tokens, fleet.sims[0].sim.stats().prompt_tokens, "{total:?}");
}

#[tokio::test]
async fn a_client_gone_during_a_cold_load_is_recorded_as_cancelled() {
    use inferyes_tests::client::next_chunk;
    let swap = inferyes_sim::SimConfig { load_delay_ms: 30_000, ..crate::swap::swap(false) };
    let fleet = Fleet::start(vec![swap]).await;
    let body = json!({"model": "beta", "stream": true, "max_tokens": 4,
                      "messages": [{"role": "user", "content": "load beta"}]});
    let loading =
        fleet.http.start(Method::POST, &fleet.url("/v1/chat/completions"), body.to_string().into(), &[]).await;
    assert_eq!(loading.headers()["x-inferyes-route"], "cold");
    let request_id = loading.headers()["x-request-id"].to_str().expect("text").to_string();
    let mut loading = loading.into_body();
    next_chunk(&mut loading).await.expect("the load has started");
    // The client goes long before the model would be loaded.
    drop(loading);

    // Billed as a stream its client left: its prompt, estimated.
    let total = rolled_up(fleet.controller(), "", 1).await;
    assert_eq!((total.requests, total.estimated_requests), (1, 1), "{total:?}");
    inferyes_tests::eventually("its decision on the dashboard", Duration::from_secs(10), || async {
        let view = crate::dashboard::fleet_view(&fleet).await;
        view["decisions"].as_array().expect("decisions").iter().any(|d| d["request_id"] == request_id.as_str())
    })
    .await;
}

/// A whole answer that takes longer than the data plane waits: the node
/// read the prompt and generated until the timeout, so the request is
/// counted (estimated, and as an error), not dropped from the key's usage.
#[tokio::test]
async fn a_request_that_times_out_while_its_node_generates_is_counted_estimated() {
    let slow = inferyes_sim::SimConfig { decode_tokens_per_second: 10.0, ..chat_sim("chat") };
    let fleet = Fleet::start_with(vec![slow], |c| {
        c.auth = AuthMode::Keys;
        c.response_header_timeout_ms = 500;
    })
    .await;
    let (key_id, secret) = create_key(&fleet, CreateKeyRequest { name: "slow".into(), ..Default::default() }).await;
    let body = json!({"model": "chat", "max_tokens": 40,
                      "messages": [{"role": "user", "content": "a question that takes its time to answer"}]});
    let bearer = format!("Bearer {secret}");
    let url = format!("{}/v1/chat/completions", fleet.dataplane.url);
    let response = fleet.http.send(Method::POST, &url, body.to_string().into(), &[("authorization", &bearer)]).await;
    assert_eq!(response.status, StatusCode::GATEWAY_TIMEOUT, "{}", String::from_utf8_lossy(&response.body));
    assert_eq!(response.openai_error()["code"], "upstream_timeout");
    let total = rolled_up(fleet.controller(), &key_id, 1).await;
    assert_eq!((total.requests, total.errors, total.estimated_requests), (1, 1, 1), "{total:?}");
    assert!(total.prompt_tokens > 0, "the prompt the node read is counted: {total:?}");
    assert!((1..=40).contains(&total.completion_tokens), "and what it may have generated: {total:?}");
    // A body that names an image does not make the estimate nothing. (The
    // simulated server is text-only and refuses image parts, so the image
    // rides in a field it ignores; the gateway sees media all the same.)
    let image = json!({"model": "chat", "max_tokens": 40,
                       "messages": [{"role": "user", "content": "what is in it?"}],
                       "attachment": {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", "iVBORw0KGgo".repeat(100))}}});
    let response = fleet.http.send(Method::POST, &url, image.to_string().into(), &[("authorization", &bearer)]).await;
    assert_eq!(response.status, StatusCode::GATEWAY_TIMEOUT, "{}", String::from_utf8_lossy(&response.body));
    let both = rolled_up(fleet.controller(), &key_id, 2).await;
    assert_eq!(both.estimated_requests, 2, "{both:?}");
    assert!(both.prompt_tokens - total.prompt_tokens >= 200, "the image's request is billed by its size: {both:?}");
}

/// A whole answer whose client leaves before it ends: the node generated
/// until then, and the request is billed for what it may have, not for
/// its prompt alone (a client leaving just before each answer would get
/// the fleet's work for nothing).
#[tokio::test]
async fn a_whole_answer_whose_client_leaves_is_billed_what_its_node_may_have_generated() {
    let slow = inferyes_sim::SimConfig { decode_tokens_per_second: 10.0, ..chat_sim("chat") };
    let fleet = Fleet::start_with(vec![slow], |c| c.auth = AuthMode::Keys).await;
    let (key_id, secret) = create_key(&fleet, CreateKeyRequest { name: "leaver".into(), ..Default::default() }).await;
    let body = json!({"model": "chat", "max_tokens": 200,
                      "messages": [{"role": "user", "content": "a question whose answer is long"}]});
    let bearer = format!("Bearer {secret}");
    let url = format!("{}/v1/chat/completions", fleet.dataplane.url);
    let headers = [("authorization", bearer.as_str())];
    let asked = fleet.http.send(Method::POST, &url, body.to_string().into(), &headers);
    // Twenty seconds of output asked for; the client leaves after one.
    assert!(tokio::time::timeout(Duration::from_secs(1), asked).await.is_err(), "no answer yet");
    let total = rolled_up(fleet.controller(), &key_id, 1).await;
    assert_eq!(total.estimated_requests, 1, "{total:?}");
    assert!((1..=200).contains(&total.completion_tokens), "{total:?}");
}

/// A stream whose client hangs up after its first token is counted for the
/// whole prompt its node read, as the node said it while reading, and not
/// for an estimate from the body's size, which dense text makes as low as
/// a fifth of it. The client never sees the progress the gateway asked for.
#[tokio::test]
async fn a_stream_cut_after_its_first_token_is_counted_for_the_prompt_its_node_read() {
    use inferyes_tests::client::next_chunk;
    let slow =
        inferyes_sim::SimConfig { context: 32_768, slots: 1, decode_tokens_per_second: 20.0, ..chat_sim("chat") };
    let fleet = Fleet::start_with(vec![slow], |c| {
        c.auth = AuthMode::Keys;
        c.usage_records = true;
    })
    .await;
    let (key_id, secret) = create_key(&fleet, CreateKeyRequest { name: "cut".into(), ..Default::default() }).await;
    // A token per byte: a letter, a comma.
    let body = json!({"model": "chat", "stream": true, "max_tokens": 400,
                      "messages": [{"role": "user", "content": "a,".repeat(5_000)}]});
    let bearer = format!("Bearer {secret}");
    let url = format!("{}/v1/chat/completions", fleet.dataplane.url);
    let response = fleet.http.start(Method::POST, &url, body.to_string().into(), &[("authorization", &bearer)]).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut stream = response.into_body();
    let mut seen = String::new();
    while !seen.contains("\"content\":\"") {
        let chunk = next_chunk(&mut stream).await.expect("the first token");
        seen.push_str(std::str::from_utf8(&chunk).expect("text"));
    }
    assert!(!seen.contains("prompt_progress"), "the progress the gateway asked for reached the client: {seen}");
    drop(stream);

    let total = rolled_up(fleet.controller(), &key_id, 1).await;
    let read = fleet.sims[0].sim.stats().prompt_tokens;
    assert!(read >= 10_000, "the node read {read} tokens");
    assert_eq!((total.requests, total.errors, total.estimated_requests), (1, 1, 0), "{total:?}");
    assert_eq!(total.prompt_tokens, read, "billed for what the node read: {total:?}");
    assert!(total.completion_tokens < 400, "counted as cut short: {total:?}");
}
