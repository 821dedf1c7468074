//! Shares of a data plane: what one key, and one tenant, may hold at once
//! (requests in flight, bytes of bodies), so that no caller takes what the
//! others need.

use std::time::Duration;

use http::{Method, StatusCode};
use inferyes_dataplane::auth::AuthMode;
use inferyes_proto::v1::CreateKeyRequest;
use inferyes_tests::TestResponse;
use serde_json::json;
use tokio::io::AsyncWriteExt;

use crate::support::{Fleet, chat_body, chat_sim, create_key, long_story, slow_sim};

async fn key(fleet: &Fleet, name: &str, tenant: &str, max_concurrent: u32) -> String {
    let request = CreateKeyRequest { name: name.into(), tenant: tenant.into(), max_concurrent, ..Default::default() };
    format!("Bearer {}", create_key(fleet, request).await.1)
}

/// A stream of many tokens, open (its head read) until dropped.
async fn open_stream(fleet: &Fleet, bearer: &str) -> http::Response<hyper::body::Incoming> {
    let url = format!("{}/v1/chat/completions", fleet.dataplane.url);
    let response = fleet.http.start(Method::POST, &url, long_story(), &[("authorization", bearer)]).await;
    assert_eq!(response.status(), StatusCode::OK);
    response
}

async fn chat(fleet: &Fleet, bearer: &str) -> TestResponse {
    let url = format!("{}/v1/chat/completions", fleet.dataplane.url);
    let body = chat_body("chat", "hello").to_string();
    fleet.http.send(Method::POST, &url, body.into(), &[("authorization", bearer)]).await
}

fn assert_past_share(response: &TestResponse, whose: &str) {
    assert_eq!(response.status, StatusCode::TOO_MANY_REQUESTS, "{}", String::from_utf8_lossy(&response.body));
    assert_eq!(response.header("retry-after"), Some("1"));
    let error = response.openai_error();
    assert_eq!(error["code"], "rate_limit_exceeded");
    let message = error["message"].as_str().expect("a message");
    assert!(message.contains(&format!("this {whose} holds")), "{message}");
}

#[tokio::test]
async fn a_key_past_its_requests_in_flight_is_refused_and_no_other_key_is() {
    let fleet = Fleet::start_with(vec![slow_sim()], |c| c.auth = AuthMode::Keys).await;
    let (greedy, other) = (key(&fleet, "greedy", "", 2).await, key(&fleet, "other", "", 0).await);
    let mut streams = vec![open_stream(&fleet, &greedy).await, open_stream(&fleet, &greedy).await];

    let refused = chat(&fleet, &greedy).await;
    assert_past_share(&refused, "key");
    assert!(refused.openai_error()["message"].as_str().unwrap().contains("(2 at once)"));
    // In the caller's shape on the Anthropic API.
    let url = format!("{}/v1/messages", fleet.dataplane.url);
    let body = json!({"model": "chat", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
    let messages = fleet.http.send(Method::POST, &url, body.to_string().into(), &[("authorization", &greedy)]).await;
    assert_eq!(messages.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(messages.json()["error"]["type"], "rate_limit_error");
    assert_eq!(chat(&fleet, &other).await.status, StatusCode::OK, "another key is served");

    // A stream given up gives its request back, once the data plane finds
    // its client gone.
    drop(streams.pop());
    inferyes_tests::eventually("the dropped stream's request given back", Duration::from_secs(10), || async {
        let again = chat(&fleet, &greedy).await;
        if again.status != StatusCode::OK {
            assert_past_share(&again, "key");
        }
        again.status == StatusCode::OK
    })
    .await;
}

#[tokio::test]
async fn the_keys_of_a_tenant_share_its_share() {
    // A tenant may have 3 requests in flight: a quarter of 12 connections.
    let fleet = Fleet::start_with(vec![slow_sim()], |c| {
        c.auth = AuthMode::Keys;
        c.max_connections = 12;
        c.tenant_share_percent = 25;
    })
    .await;
    let (a, b) = (key(&fleet, "a", "acme", 5).await, key(&fleet, "b", "acme", 5).await);
    let outside = key(&fleet, "outside", "", 5).await;
    let _streams = [open_stream(&fleet, &a).await, open_stream(&fleet, &a).await, open_stream(&fleet, &b).await];
    assert_past_share(&chat(&fleet, &b).await, "tenant");
    assert_past_share(&chat(&fleet, &a).await, "tenant");
    assert_eq!(chat(&fleet, &outside).await.status, StatusCode::OK, "a key of no tenant is served");
}

#[tokio::test]
async fn a_key_past_its_share_of_buffered_bytes_is_refused_and_no_other_key_is() {
    // A key may hold a quarter of 256 KiB of bodies: one body of 64 KiB.
    // The window is wide enough for the bodies' bytes, counted as a prompt.
    let sim = inferyes_sim::SimConfig { context: 1 << 16, ..chat_sim("chat") };
    let fleet = Fleet::start_with(vec![sim], |c| {
        c.auth = AuthMode::Keys;
        c.max_buffered_bytes = 256 << 10;
        c.max_body_bytes = 64 << 10;
    })
    .await;
    let (greedy, other) = (key(&fleet, "greedy", "", 0).await, key(&fleet, "other", "", 0).await);
    // 40 KiB of a 60 KiB body sent, the rest held back: the data plane
    // holds what came.
    let mut trickle =
        tokio::net::TcpStream::connect(fleet.dataplane.url.trim_start_matches("http://")).await.expect("connected");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\nauthorization: {greedy}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        60 << 10
    );
    trickle.write_all(head.as_bytes()).await.expect("head sent");
    trickle.write_all(&vec![b' '; 40 << 10]).await.expect("body sent");
    trickle.flush().await.expect("flushed");

    // The trickling body is read as it arrives: what was sent of it is
    // held before the next request is sent.
    let metrics = format!("{}/metrics", fleet.dataplane.admin_url);
    inferyes_tests::eventually("the trickling body held", Duration::from_secs(10), || async {
        buffered_bytes(&fleet.http.get(&metrics).await) >= 40 << 10
    })
    .await;
    // Padded with JSON's whitespace: a large body, a short prompt.
    let large = format!("{}{}", chat_body("chat", "hello"), " ".repeat(30 << 10));
    let url = format!("{}/v1/chat/completions", fleet.dataplane.url);
    let refused = fleet.http.send(Method::POST, &url, large.clone().into(), &[("authorization", &greedy)]).await;
    assert_past_share(&refused, "key");
    let served = fleet.http.send(Method::POST, &url, large.into(), &[("authorization", &other)]).await;
    assert_eq!(served.status, StatusCode::OK, "another key is served: {}", String::from_utf8_lossy(&served.body));
    drop(trickle);
}

fn buffered_bytes(metrics: &TestResponse) -> u64 {
    let text = String::from_utf8_lossy(&metrics.body);
    let line = text.lines().find(|line| line.starts_with("inferyes_dataplane_buffered_bytes ")).expect("the gauge");
    line.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("a number")
}
