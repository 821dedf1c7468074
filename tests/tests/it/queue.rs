//! The data plane's queue: requests no node can start now wait in the data
//! plane, by fair shares per tenant and by class, and leave for the node
//! that frees a slot first; past their bounds they are refused, 429.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use inferyes_dataplane::auth::AuthMode;
use inferyes_proto::v1::{CreateKeyRequest, Priority};
use inferyes_tests::TestResponse;
use inferyes_tests::client::next_chunk;
use serde_json::json;
use tokio::task::JoinHandle;

use crate::support::{Fleet, chat_sim, create_key};

/// One node with `slots` slots, 40 tokens a second in each.
fn slow_node(slots: u32) -> inferyes_sim::SimConfig {
    inferyes_sim::SimConfig { slots, decode_tokens_per_second: 40.0, ..chat_sim("chat") }
}

async fn keyed_fleet(slots: u32, tweak: impl FnOnce(&mut inferyes_dataplane::Config)) -> Fleet {
    Fleet::start_with(vec![slow_node(slots)], |c| {
        c.auth = AuthMode::Keys;
        tweak(c);
    })
    .await
}

async fn key(fleet: &Fleet, tenant: &str, priority: Priority) -> String {
    let request = CreateKeyRequest {
        name: tenant.into(),
        tenant: tenant.into(),
        priority: priority as i32,
        ..Default::default()
    };
    format!("Bearer {}", create_key(fleet, request).await.1)
}

fn body(text: &str, max_tokens: u32) -> Bytes {
    json!({"model": "chat", "max_tokens": max_tokens, "messages": [{"role": "user", "content": text}]})
        .to_string()
        .into()
}

/// A chat of `max_tokens` (40 a second), sent in a task of its own.
fn ask(fleet: &Fleet, bearer: &str, text: &str, max_tokens: u32) -> JoinHandle<TestResponse> {
    let (http, url, bearer) = (fleet.http.clone(), fleet.url("/v1/chat/completions"), bearer.to_string());
    let body = body(text, max_tokens);
    tokio::spawn(async move { http.send(Method::POST, &url, body, &[("authorization", &bearer)]).await })
}

/// The sum of a metric's series.
async fn metric(fleet: &Fleet, name: &str) -> f64 {
    crate::support::scraped(&fleet.http, &format!("{}/metrics", fleet.dataplane.admin_url), name, "").await
}

/// Until `count` requests are in flight at the node or waiting here.
async fn wait_until_in(fleet: &Fleet, count: f64) {
    inferyes_tests::eventually("the requests in", Duration::from_secs(10), || async {
        metric(fleet, "inferyes_dataplane_node_in_flight").await
            + metric(fleet, "inferyes_dataplane_queue_waiting").await
            >= count
    })
    .await;
}

/// How many of a tenant's 10 requests (2 slots, half a second each) were
/// answered by the time another tenant's one short request was.
async fn answered_before_the_light_tenant(queue: bool) -> usize {
    let fleet = keyed_fleet(2, |c| c.queue = queue).await;
    let (heavy, light) =
        (key(&fleet, "heavy", Priority::Interactive).await, key(&fleet, "light", Priority::Interactive).await);
    let flood: Vec<_> = (0..10).map(|i| ask(&fleet, &heavy, &format!("flood {i}"), 20)).collect();
    wait_until_in(&fleet, 10.0).await;
    let answer = ask(&fleet, &light, "just one thing", 2).await.expect("answered");
    assert_eq!(answer.status, StatusCode::OK, "{}", String::from_utf8_lossy(&answer.body));
    let before = flood.iter().filter(|a| a.is_finished()).count();
    for request in flood {
        assert_eq!(request.await.expect("answered").status, StatusCode::OK);
    }
    before
}

#[tokio::test]
async fn a_tenant_s_backlog_does_not_make_another_wait_behind_it() {
    let queued = answered_before_the_light_tenant(true).await;
    assert!(queued <= 4, "the light tenant waited for {queued} of the heavy one's 10 requests");
    // Sent on at once, it waits behind every one in the server's queue.
    let sent_on = answered_before_the_light_tenant(false).await;
    assert!(sent_on >= 8, "with the queue off, it waited for {sent_on} of them");
}

#[tokio::test]
async fn a_flow_past_its_share_of_the_queue_is_refused_and_others_still_wait() {
    let fleet = keyed_fleet(1, |c| {
        c.queue_max_requests = 4;
        c.queue_flow_share_percent = 50;
    })
    .await;
    let (heavy, light) =
        (key(&fleet, "heavy", Priority::Interactive).await, key(&fleet, "light", Priority::Interactive).await);
    // One running, two waiting: the flow's share of four.
    // Ten seconds each: still held when the test looks, however slow the
    // machine; let go, not awaited, at its end.
    let held: Vec<_> = (0..3).map(|i| ask(&fleet, &heavy, &format!("long {i}"), 400)).collect();
    wait_until_in(&fleet, 3.0).await;

    let refused = fleet
        .http
        .send(Method::POST, &fleet.url("/v1/chat/completions"), body("one more", 2), &[("authorization", &heavy)])
        .await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{}", String::from_utf8_lossy(&refused.body));
    assert_eq!(refused.openai_error()["code"], "rate_limit_exceeded");
    let retry: u64 = refused.header("retry-after").expect("retry-after").parse().expect("seconds");
    assert!((1..=300).contains(&retry), "within the age bound: {retry}");
    // In Anthropic's shape on its path.
    let messages = json!({"model": "chat", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let refused = fleet
        .http
        .send(Method::POST, &fleet.url("/v1/messages"), messages.to_string().into(), &[("authorization", &heavy)])
        .await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.json()["error"]["type"], "rate_limit_error", "{}", String::from_utf8_lossy(&refused.body));

    let other = ask(&fleet, &light, "my turn", 2).await.expect("answered");
    assert_eq!(other.status, StatusCode::OK, "another tenant waits its turn: {}", String::from_utf8_lossy(&other.body));
    assert!(metric(&fleet, "inferyes_dataplane_queue_refused_total").await >= 2.0);
    held.iter().for_each(JoinHandle::abort);
}

#[tokio::test]
async fn a_request_that_waits_too_long_is_refused_and_a_stream_hears_it_waits() {
    let fleet = keyed_fleet(1, |c| c.queue_max_wait_ms = 500).await;
    let (first, second) =
        (key(&fleet, "first", Priority::Interactive).await, key(&fleet, "second", Priority::Interactive).await);
    // Holds the one slot for 5 s.
    let holding = ask(&fleet, &first, "a long answer", 200);
    wait_until_in(&fleet, 1.0).await;

    let waited = ask(&fleet, &second, "will I wait?", 2).await.expect("answered");
    assert_eq!(waited.status, StatusCode::TOO_MANY_REQUESTS, "{}", String::from_utf8_lossy(&waited.body));
    assert!(waited.openai_error()["message"].as_str().unwrap_or_default().contains("waited"));
    assert!(waited.header("retry-after").is_some());

    // A stream is answered at once, told it waits, and ends with the
    // refusal as its last event.
    let stream = json!({"model": "chat", "stream": true, "max_tokens": 2,
                        "messages": [{"role": "user", "content": "streaming"}]});
    let response = fleet
        .http
        .start(
            Method::POST,
            &fleet.url("/v1/chat/completions"),
            stream.to_string().into(),
            &[("authorization", &second)],
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-inferyes-route"], "queued");
    let mut body = response.into_body();
    let mut text = String::new();
    while let Some(chunk) = next_chunk(&mut body).await {
        text.push_str(std::str::from_utf8(&chunk).expect("text"));
    }
    assert!(text.starts_with(": waiting for a free slot for model chat"), "{text}");
    assert!(text.contains("rate_limit_exceeded"), "{text}");
    assert_eq!(holding.await.expect("answered").status, StatusCode::OK);
}

#[tokio::test]
async fn a_waiting_stream_is_answered_by_the_node_once_its_slot_frees() {
    let fleet = keyed_fleet(1, |_| {}).await;
    let (first, second) =
        (key(&fleet, "first", Priority::Interactive).await, key(&fleet, "second", Priority::Interactive).await);
    let holding = ask(&fleet, &first, "a short while", 80);
    wait_until_in(&fleet, 1.0).await;
    let stream = json!({"model": "chat", "stream": true, "max_tokens": 4,
                        "messages": [{"role": "user", "content": "streaming"}]});
    let response = fleet
        .http
        .start(
            Method::POST,
            &fleet.url("/v1/chat/completions"),
            stream.to_string().into(),
            &[("authorization", &second)],
        )
        .await;
    assert_eq!(response.headers()["x-inferyes-route"], "queued");
    let mut body = response.into_body();
    let mut text = String::new();
    while let Some(chunk) = next_chunk(&mut body).await {
        text.push_str(std::str::from_utf8(&chunk).expect("text"));
    }
    assert!(text.starts_with(": waiting for a free slot"), "{text}");
    // Its headers went before a node was chosen: a note names it.
    let sent = text.find(": sent to node node-a\n").expect("the node named");
    assert!(text[..sent].find("data:").is_none(), "{text}");
    assert!(text.contains("\"content\":") && text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert_eq!(holding.await.expect("answered").status, StatusCode::OK);
    assert_eq!(metric(&fleet, "inferyes_dataplane_queue_dispatched_total").await, 1.0);
}

#[tokio::test]
async fn interactive_requests_leave_the_queue_before_batch_ones() {
    let fleet = keyed_fleet(1, |_| {}).await;
    let holder = key(&fleet, "holder", Priority::Interactive).await;
    let (batch, interactive) =
        (key(&fleet, "jobs", Priority::Batch).await, key(&fleet, "chat", Priority::Interactive).await);
    // A batch key may not ask for more than its class.
    let refused = fleet
        .http
        .send(
            Method::POST,
            &fleet.url("/v1/chat/completions"),
            body("me first", 2),
            &[("authorization", &batch), ("x-inferyes-priority", "interactive")],
        )
        .await;
    assert_eq!(refused.status, StatusCode::FORBIDDEN, "{}", String::from_utf8_lossy(&refused.body));

    let holding = ask(&fleet, &holder, "hold the slot", 20);
    wait_until_in(&fleet, 1.0).await;
    let batch_job = ask(&fleet, &batch, "a batch job", 20);
    wait_until_in(&fleet, 2.0).await;
    let chat = ask(&fleet, &interactive, "a chat", 2);
    wait_until_in(&fleet, 3.0).await;
    let chat = chat.await.expect("answered");
    assert_eq!(chat.status, StatusCode::OK);
    assert!(!batch_job.is_finished(), "the batch job, queued first, went first");
    assert_eq!(batch_job.await.expect("answered").status, StatusCode::OK);
    assert_eq!(holding.await.expect("answered").status, StatusCode::OK);
}

#[tokio::test]
async fn the_dashboard_shows_what_waits_by_flow_and_class() {
    let fleet = keyed_fleet(1, |_| {}).await;
    let (holder, batch) =
        (key(&fleet, "holder", Priority::Interactive).await, key(&fleet, "jobs", Priority::Batch).await);
    let holding = ask(&fleet, &holder, "hold the slot", 80);
    wait_until_in(&fleet, 1.0).await;
    let waiting = ask(&fleet, &batch, "a batch job", 2);
    let shown = |expected: serde_json::Value| {
        let fleet = &fleet;
        async move { crate::dashboard::fleet_view(fleet).await["queue"] == expected }
    };
    inferyes_tests::eventually("the waiting job on the dashboard", Duration::from_secs(10), || async {
        let view = crate::dashboard::fleet_view(&fleet).await;
        let queue = &view["queue"];
        queue.as_array().is_some_and(|q| q.len() == 1)
            && queue[0]["flow"] == "jobs"
            && queue[0]["class"] == "batch"
            && queue[0]["waiting"] == 1
            && queue[0]["dataplane"].as_str().is_some_and(|d| !d.is_empty())
    })
    .await;
    assert_eq!(holding.await.expect("answered").status, StatusCode::OK);
    assert_eq!(waiting.await.expect("answered").status, StatusCode::OK);
    inferyes_tests::eventually("an empty queue on the dashboard", Duration::from_secs(10), || shown(json!([]))).await;
}

#[tokio::test]
async fn a_key_takes_a_bounded_weight_and_a_known_priority() {
    let fleet = keyed_fleet(1, |_| {}).await;
    let mut admin = fleet.controller().fleet().await;
    let create = |weight, priority| CreateKeyRequest { name: "k".into(), weight, priority, ..Default::default() };
    let refused = admin.create_key(create(1_001, 0)).await.expect_err("a weight past 1,000");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    let refused = admin.create_key(create(10, 7)).await.expect_err("an unknown priority");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    let created = admin.create_key(create(10, Priority::Batch as i32)).await.expect("a key").into_inner();
    let key = created.key.expect("the key");
    assert_eq!((key.weight, key.priority()), (10, Priority::Batch));
}

#[tokio::test]
async fn a_request_a_node_can_start_now_is_never_refused_for_what_others_wait_for() {
    let fleet = Fleet::start_with(vec![slow_node(1), chat_sim("other")], |c| {
        c.auth = AuthMode::Keys;
        c.queue_max_requests = 4;
        c.queue_flow_share_percent = 50;
    })
    .await;
    let heavy = key(&fleet, "heavy", Priority::Interactive).await;
    // One running, two waiting: all the flow's share of the queue.
    // Ten seconds each: still held when the test looks, however slow the
    // machine; let go, not awaited, at its end.
    let held: Vec<_> = (0..3).map(|i| ask(&fleet, &heavy, &format!("long {i}"), 400)).collect();
    wait_until_in(&fleet, 3.0).await;
    let url = fleet.url("/v1/chat/completions");
    let past_share = fleet.http.send(Method::POST, &url, body("one more", 2), &[("authorization", &heavy)]).await;
    assert_eq!(past_share.status, StatusCode::TOO_MANY_REQUESTS);

    // The same flow, for a model whose node is idle: served, not refused.
    let idle = json!({"model": "other", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let served = fleet.http.send(Method::POST, &url, idle.to_string().into(), &[("authorization", &heavy)]).await;
    assert_eq!(served.status, StatusCode::OK, "{}", String::from_utf8_lossy(&served.body));
    held.iter().for_each(JoinHandle::abort);
}

/// A tenant whose requests set no limit is charged a typical answer as
/// they wait, and what they generated once they end: its next turns come
/// after another tenant's that cost what they were charged.
#[tokio::test]
async fn a_tenant_whose_requests_generate_past_their_guess_waits_for_what_they_spent() {
    // One slot; a reply with no limit runs to 1,500 tokens, three times
    // the guess.
    let node = inferyes_sim::SimConfig {
        slots: 1,
        decode_tokens_per_second: 1_000.0,
        default_max_tokens: 1_500,
        ..chat_sim("chat")
    };
    let fleet = Fleet::start_with(vec![node], |c| c.auth = AuthMode::Keys).await;
    let [holder, greedy, modest] = [
        key(&fleet, "holder", Priority::Interactive).await,
        key(&fleet, "greedy", Priority::Interactive).await,
        key(&fleet, "modest", Priority::Interactive).await,
    ];
    let unlimited = |text: &str| {
        let (http, url, bearer) = (fleet.http.clone(), fleet.url("/v1/chat/completions"), greedy.clone());
        let body: Bytes = json!({"model": "chat", "messages": [{"role": "user", "content": text}]}).to_string().into();
        tokio::spawn(async move { http.send(Method::POST, &url, body, &[("authorization", &bearer)]).await })
    };
    let holding = ask(&fleet, &holder, "hold the slot", 2_000);
    wait_until_in(&fleet, 1.0).await;
    // Tags as they wait, by arrival: greedy's at 512 a request (plus the
    // prompt), modest's at 530, so greedy's second comes before modest's.
    let mut greedy_asks = Vec::new();
    let mut modest_asks = Vec::new();
    for i in 0..3 {
        greedy_asks.push(unlimited(&format!("greedy {i}")));
        wait_until_in(&fleet, f64::from(2 + 2 * i)).await;
        modest_asks.push(ask(&fleet, &modest, &format!("modest {i}"), 530));
        wait_until_in(&fleet, f64::from(3 + 2 * i)).await;
    }
    assert_eq!(holding.await.expect("answered").status, StatusCode::OK);
    for request in modest_asks {
        assert_eq!(request.await.expect("answered").status, StatusCode::OK);
    }
    // Greedy's first generated 1,500 tokens: its second waited for all
    // of modest's.
    let mut greedy_asks = greedy_asks.into_iter();
    let (first, second, third) =
        (greedy_asks.next().unwrap(), greedy_asks.next().unwrap(), greedy_asks.next().unwrap());
    let first = first.await.expect("answered");
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.json()["usage"]["completion_tokens"], 1_500);
    assert!(!second.is_finished(), "greedy's second turn went before modest's last");
    second.abort();
    third.abort();
}

#[tokio::test]
async fn a_client_that_stops_waiting_leaves_the_queue_and_takes_no_slot() {
    let fleet = keyed_fleet(1, |_| {}).await;
    let (first, second) =
        (key(&fleet, "first", Priority::Interactive).await, key(&fleet, "second", Priority::Interactive).await);
    // Ten seconds: still held when the test looks, however slow the machine.
    let holding = ask(&fleet, &first, "a long while", 400);
    wait_until_in(&fleet, 1.0).await;
    let leaving = ask(&fleet, &second, "not for long", 80);
    inferyes_tests::eventually("the request waits", Duration::from_secs(10), || async {
        metric(&fleet, "inferyes_dataplane_queue_waiting").await == 1.0
    })
    .await;
    leaving.abort();
    inferyes_tests::eventually("the request left", Duration::from_secs(10), || async {
        metric(&fleet, "inferyes_dataplane_queue_waiting").await == 0.0
    })
    .await;
    // (On a loaded machine a report read between the first request's
    // start and its slot's may have let either out before this.)
    let dispatched = metric(&fleet, "inferyes_dataplane_queue_dispatched_total").await;
    assert!(!holding.is_finished(), "the slot was held all along");
    holding.abort();
    inferyes_tests::eventually("the slot free", Duration::from_secs(10), || async {
        metric(&fleet, "inferyes_dataplane_node_in_flight").await == 0.0
    })
    .await;
    // Nothing was let out for it when the slot freed (the next request may
    // itself wait, on a loaded machine, for a report that shows the slot
    // free): the slot goes to the next request.
    assert_eq!(metric(&fleet, "inferyes_dataplane_queue_dispatched_total").await, dispatched);
    let next = ask(&fleet, &second, "now", 2).await.expect("answered");
    assert_eq!(next.status, StatusCode::OK, "{}", String::from_utf8_lossy(&next.body));
    assert_ne!(next.header("x-inferyes-route"), Some("queued"));
}

#[tokio::test]
async fn a_request_still_waiting_when_the_data_plane_stops_is_told_to_send_it_again() {
    let fleet = keyed_fleet(1, |c| c.shutdown_grace_ms = 300).await;
    let (first, second) =
        (key(&fleet, "first", Priority::Interactive).await, key(&fleet, "second", Priority::Interactive).await);
    // Ten seconds: still running when the grace period ends.
    let holding = ask(&fleet, &first, "a long while", 400);
    wait_until_in(&fleet, 1.0).await;
    let waiting = ask(&fleet, &second, "too late", 2);
    wait_until_in(&fleet, 2.0).await;
    fleet.dataplane.begin_shutdown();
    let answer = waiting.await.expect("answered");
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&answer.body));
    assert_eq!(answer.openai_error()["code"], "gateway_shutdown");
    assert_eq!(answer.header("retry-after"), Some("1"));
    holding.abort();
}
