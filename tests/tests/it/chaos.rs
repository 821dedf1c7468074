//! Nodes die and come back under load: every request ends with a whole
//! answer or an explicit error, none hangs.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Method;
use inferyes_sim::SimConfig;
use inferyes_tests::client::next_chunk;
use inferyes_tests::{AgentHandle, ControllerHandle, DataplaneHandle, Etcd, HttpClient, SimHandle};
use serde_json::{Value, json};

use crate::support::chat_sim;

#[derive(Default)]
struct Outcomes {
    complete: AtomicU64,
    explicit_errors: AtomicU64,
    broken: AtomicU64,
}

/// One request; how it ended.
async fn request(http: &HttpClient, url: &str, stream: bool, session: &str) -> Result<bool, String> {
    let body = json!({"model": "chat", "stream": stream, "max_tokens": 12,
                      "messages": [{"role": "user", "content": format!("{session}: go on")}]});
    let response = http.start(Method::POST, url, Bytes::from(body.to_string()), &[("x-session-id", session)]).await;
    let status = response.status();
    let mut body = response.into_body();
    let mut text = String::new();
    while let Some(chunk) = next_chunk(&mut body).await {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    if !status.is_success() {
        let error: Value =
            serde_json::from_str(&text).map_err(|_| format!("{status} without an OpenAI error: {text}"))?;
        return if error["error"]["message"].is_string() { Ok(false) } else { Err(format!("{status}: {text}")) };
    }
    if !stream {
        let answer: Value = serde_json::from_str(&text).map_err(|_| format!("a cut JSON answer: {text}"))?;
        return if answer["choices"][0]["message"]["content"].is_string() { Ok(true) } else { Err(text) };
    }
    if text.ends_with("data: [DONE]\n\n") {
        return Ok(true);
    }
    let last = text.trim_end().rsplit("\n\n").next().unwrap_or_default().trim_start_matches("data: ");
    match serde_json::from_str::<Value>(last) {
        Ok(event) if event["error"]["message"].is_string() => Ok(false),
        _ => Err(format!("a stream that ended without [DONE] or an error event: {text}")),
    }
}

#[tokio::test]
async fn under_load_nodes_die_and_return_and_every_request_ends_cleanly() {
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let config = || SimConfig { decode_tokens_per_second: 150.0, ..chat_sim("chat") };
    let mut sims = Vec::new();
    let mut agents = Vec::new();
    for n in 0..3 {
        let sim = SimHandle::start(config()).await;
        agents.push(Some(AgentHandle::start(&format!("node-{n}"), &[controller.url()], &[("main", &sim)]).await));
        sims.push(Some(sim));
    }
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-0", "node-1", "node-2"]).await;
    let url = format!("{}/v1/chat/completions", dataplane.url);

    let outcomes = Arc::new(Outcomes::default());
    let running = Arc::new(AtomicBool::new(true));
    let failures = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let mut clients = Vec::new();
    for client in 0..6 {
        let (url, outcomes, running, failures) =
            (url.clone(), Arc::clone(&outcomes), Arc::clone(&running), Arc::clone(&failures));
        clients.push(tokio::spawn(async move {
            let http = HttpClient::default();
            let mut turn = 0u64;
            while running.load(Ordering::Relaxed) {
                turn += 1;
                let session = format!("client-{client}-conversation-{}", turn / 4);
                let started = Instant::now();
                let deadline = Duration::from_secs(15);
                let ended =
                    tokio::time::timeout(deadline, request(&http, &url, turn.is_multiple_of(2), &session)).await;
                match ended {
                    Ok(Ok(true)) => outcomes.complete.fetch_add(1, Ordering::Relaxed),
                    Ok(Ok(false)) => outcomes.explicit_errors.fetch_add(1, Ordering::Relaxed),
                    Ok(Err(why)) => {
                        failures.lock().unwrap().push(why);
                        outcomes.broken.fetch_add(1, Ordering::Relaxed)
                    }
                    Err(_) => {
                        failures.lock().unwrap().push(format!("hung for {:?}", started.elapsed()));
                        outcomes.broken.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
        }));
    }

    // Chaos: one node after another dies (its agent and its server), and a
    // new one takes its place under the same name.
    for round in 0..4 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let n = round % 3;
        if let Some(agent) = agents[n].take() {
            agent.kill();
        }
        if let Some(sim) = sims[n].take() {
            sim.stop().await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let sim = SimHandle::start(config()).await;
        agents[n] = Some(AgentHandle::start(&format!("node-{n}"), &[controller.url()], &[("main", &sim)]).await);
        sims[n] = Some(sim);
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    running.store(false, Ordering::Relaxed);
    for client in clients {
        client.await.unwrap();
    }

    let (complete, errors, broken) = (
        outcomes.complete.load(Ordering::Relaxed),
        outcomes.explicit_errors.load(Ordering::Relaxed),
        outcomes.broken.load(Ordering::Relaxed),
    );
    let failures = failures.lock().unwrap();
    assert_eq!(broken, 0, "requests that hung or ended without an answer or an error: {failures:#?}");
    assert!(complete > 50, "{complete} whole answers, {errors} explicit errors");
    assert!(
        errors * 5 < complete,
        "{complete} whole answers, {errors} explicit errors: failover should hide most deaths"
    );
}
