//! A node failing in the middle of an answer: the client gets a whole
//! answer from another node, or an explicit error, never a cut body.

use std::convert::Infallible;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::{get, post};
use bytes::Bytes;
use http::{Method, StatusCode};
use inferyes_agent::config::{BackendConfig, BackendKind, GpuSourceConfig};
use inferyes_tests::client::next_chunk;
use inferyes_tests::{AgentHandle, ControllerHandle, DataplaneHandle, Etcd, HttpClient, SimHandle};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::support::{chat_body, chat_sim};

/// A llama-server look-alike that breaks every answer after its first bytes.
async fn breaking_backend(shutdown: CancellationToken) -> String {
    let broken = || {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(2);
        tokio::spawn(async move {
            let first = b"data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"},\"index\":0}],\"object\":\"chat.completion.chunk\"}\n\n";
            let _ = tx.send(Ok(Bytes::from_static(first))).await;
            // The node dies a moment after its first bytes went out.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let _ = tx.send(Err(std::io::Error::other("the GPU fell off the bus"))).await;
        });
        Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
    };
    let app = Router::new()
        .route("/health", get(|| async { axum::Json(json!({"status": "ok"})) }))
        .route("/v1/models", get(|| async { axum::Json(json!({"object": "list", "data": [{"id": "chat"}]})) }))
        .route(
            "/v1/chat/completions",
            post(move |body: Bytes| async move {
                let request: Value = serde_json::from_slice(&body).unwrap_or_default();
                let content_type = if request["stream"] == true { "text/event-stream" } else { "application/json" };
                ([(http::header::CONTENT_TYPE, content_type)], broken())
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("bound"));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await;
        Ok::<(), Infallible>(())
    });
    url
}

fn backend(url: &str) -> BackendConfig {
    BackendConfig {
        id: "main".into(),
        url: url.into(),
        kind: BackendKind::LlamaServer,
        weight: 1,
        endpoints: Vec::new(),
        models: Vec::new(),
        host_cache_tokens: 0,
        api_key: String::new(),
    }
}

#[tokio::test]
async fn a_stream_cut_by_its_node_ends_with_an_error_event() {
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let stop = CancellationToken::new();
    let url = breaking_backend(stop.clone()).await;
    let _agent =
        AgentHandle::start_with("node-a", &[controller.url()], GpuSourceConfig::None, vec![backend(&url)]).await;
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-a"]).await;

    let request = json!({"model": "chat", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let response = HttpClient::default()
        .start(Method::POST, &format!("{}/v1/chat/completions", dataplane.url), Bytes::from(request.to_string()), &[])
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut text = String::new();
    while let Some(chunk) = next_chunk(&mut body).await {
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert!(events[0].contains("Hel"), "{text}");
    let last: Value = serde_json::from_str(events.last().unwrap().trim_start_matches("data: ")).unwrap();
    assert_eq!(last["error"]["code"], "upstream_broken", "{text}");
    assert!(last["error"]["message"].as_str().unwrap().contains("node-a"));
    stop.cancel();
}

#[tokio::test]
async fn a_whole_answer_comes_from_another_node_when_one_breaks_mid_answer() {
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let stop = CancellationToken::new();
    let url = breaking_backend(stop.clone()).await;
    let healthy = SimHandle::start(chat_sim("chat")).await;
    let _broken =
        AgentHandle::start_with("node-a", &[controller.url()], GpuSourceConfig::None, vec![backend(&url)]).await;
    let healthy_agent = AgentHandle::start("node-b", &[controller.url()], &[("main", &healthy)]).await;
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-a", "node-b"]).await;

    let http = HttpClient::default();
    let mut failovers = 0;
    for i in 0..12 {
        let url = format!("{}/v1/chat/completions", dataplane.url);
        let response = http.post_json(&url, &chat_body("chat", &format!("question {i}"))).await;
        assert_eq!(response.status, StatusCode::OK, "{}", String::from_utf8_lossy(&response.body));
        assert_eq!(response.header("x-inferyes-node"), Some("node-b"));
        assert_eq!(response.json()["object"], "chat.completion");
        if response.header("x-inferyes-route") == Some("failover") {
            failovers += 1;
        }
    }
    assert!(failovers > 0, "some requests were placed on the broken node first");

    // Alone, the broken node gives an explicit 502.
    healthy_agent.kill();
    healthy.stop().await;
    dataplane.wait_for_nodes(&["node-a"]).await;
    let response = http.post_json(&format!("{}/v1/chat/completions", dataplane.url), &chat_body("chat", "x")).await;
    assert_eq!(response.status, StatusCode::BAD_GATEWAY);
    assert_eq!(response.openai_error()["code"], "upstream_broken");
    stop.cancel();
}
