use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, StatusCode};
use inferyes_sim::SimConfig;
use inferyes_tests::client::next_chunk;
use inferyes_tests::fleet::LEASE_TTL;
use serde_json::{Value, json};

use crate::support::{Fleet, chat_body, chat_sim, embedding_model};

#[tokio::test]
async fn a_chat_request_is_answered_through_the_data_plane() {
    let fleet = Fleet::start(vec![chat_sim("chat"), chat_sim("chat")]).await;
    let response = fleet.http.post_json(&fleet.url("/v1/chat/completions"), &chat_body("chat", "hello there")).await;
    assert_eq!(response.status, StatusCode::OK, "{}", String::from_utf8_lossy(&response.body));
    let body = response.json();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "chat");
    assert!(body["choices"][0]["message"]["content"].as_str().is_some_and(|c| !c.is_empty()));
    assert_eq!(body["usage"]["completion_tokens"], 8);
    assert!(response.header("x-request-id").is_some_and(|id| id.starts_with("req_")));
    let node = response.header("x-inferyes-node").expect("node header");
    assert!(["node-a", "node-b"].contains(&node), "{node}");
    assert!(response.header("x-inferyes-route").is_some());

    // A client's own request id is kept.
    let response = fleet
        .http
        .send(
            Method::POST,
            &fleet.url("/v1/chat/completions"),
            Bytes::from(chat_body("chat", "hi").to_string()),
            &[("x-request-id", "client-42")],
        )
        .await;
    assert_eq!(response.header("x-request-id"), Some("client-42"));
}

#[tokio::test]
async fn answers_and_streams_reach_agents_over_http1_and_http2() {
    use inferyes_dataplane::config::AgentProtocol;
    for protocol in [AgentProtocol::Http1, AgentProtocol::Http2] {
        let fleet = Fleet::start_with(vec![chat_sim("chat")], |config| config.agent_protocol = protocol).await;
        let response = fleet.http.post_json(&fleet.url("/v1/chat/completions"), &chat_body("chat", "hello")).await;
        assert_eq!(response.status, StatusCode::OK, "{protocol:?}: {}", String::from_utf8_lossy(&response.body));
        assert_eq!(response.json()["usage"]["completion_tokens"], 8, "{protocol:?}");
        let mut body = chat_body("chat", "hello again");
        body["stream"] = json!(true);
        let response = fleet.http.post_json(&fleet.url("/v1/chat/completions"), &body).await;
        let text = String::from_utf8_lossy(&response.body);
        assert_eq!(response.status, StatusCode::OK, "{protocol:?}: {text}");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{protocol:?}: {text}");
        assert_eq!(text.matches("\"delta\":{\"content\":\"").count(), 8, "{protocol:?}: a token per event: {text}");
    }
}

#[tokio::test]
async fn completions_and_embeddings_reach_the_models_that_serve_them() {
    let fleet = Fleet::start(vec![chat_sim("chat"), embedding_model("embed")]).await;
    let completion = fleet
        .http
        .post_json(&fleet.url("/v1/completions"), &json!({"model": "chat", "prompt": "once upon", "max_tokens": 4}))
        .await;
    assert_eq!(completion.status, StatusCode::OK);
    assert_eq!(completion.json()["object"], "text_completion");
    assert_eq!(completion.header("x-inferyes-node"), Some("node-a"));

    let embedding =
        fleet.http.post_json(&fleet.url("/v1/embeddings"), &json!({"model": "embed", "input": ["a", "b"]})).await;
    assert_eq!(embedding.status, StatusCode::OK);
    let body = embedding.json();
    assert_eq!(body["data"].as_array().map(Vec::len), Some(2));
    assert_eq!(embedding.header("x-inferyes-node"), Some("node-b"));
    // A batch longer than the model's window, each of its inputs a prompt
    // well inside it.
    let config = fleet.sims[1].sim.config();
    let window = (config.context / config.slots) as usize;
    let batch: Vec<String> = (0..16).map(|i| format!("{i} {}", "word ".repeat(window / 4))).collect();
    let batch = fleet.http.post_json(&fleet.url("/v1/embeddings"), &json!({"model": "embed", "input": batch})).await;
    assert_eq!(batch.status, StatusCode::OK, "{}", String::from_utf8_lossy(&batch.body));
    assert_eq!(batch.json()["data"].as_array().map(Vec::len), Some(16));
    // A conversation's turns come back to its cache; an embedding's input,
    // named or not, is no conversation.
    assert_eq!(completion.header("x-inferyes-route"), Some("placed"));
    let named = fleet
        .http
        .send(
            Method::POST,
            &fleet.url("/v1/embeddings"),
            json!({"model": "embed", "input": "c"}).to_string().into(),
            &[("x-session-id", "not-a-conversation")],
        )
        .await;
    for embedding in [&embedding, &named] {
        assert_eq!(embedding.header("x-inferyes-route"), Some("warm"));
    }
}

#[tokio::test]
async fn a_streamed_reply_reaches_the_client_before_the_backend_has_finished() {
    // 20 tokens at 10 tokens/s: two seconds of generation.
    let slow = SimConfig { decode_tokens_per_second: 10.0, ..chat_sim("chat") };
    let fleet = Fleet::start(vec![slow]).await;
    let request = json!({
        "model": "chat",
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": 20,
        "messages": [{"role": "user", "content": "tell me a story"}],
    });
    let response =
        fleet.http.start(Method::POST, &fleet.url("/v1/chat/completions"), Bytes::from(request.to_string()), &[]).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let mut body = response.into_body();

    let first = next_chunk(&mut body).await.expect("a first chunk");
    assert!(first.starts_with(b"data: "), "{first:?}");
    // The backend is still generating: the chunk was passed on, not buffered.
    let slots = fleet.http.get(&format!("{}/slots", fleet.sims[0].url)).await.json();
    let busy = slots.as_array().unwrap().iter().filter(|s| s["is_processing"] == true).count();
    assert_eq!(busy, 1, "the backend finished before the client saw its first chunk: {slots}");

    let mut text = String::from_utf8(first.to_vec()).unwrap();
    while let Some(chunk) = next_chunk(&mut body).await {
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"));
    let usage: Value = serde_json::from_str(events[events.len() - 2].trim_start_matches("data: ")).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 20);
}

#[tokio::test]
async fn an_agent_stops_within_its_grace_with_a_generation_still_running() {
    use inferyes_agent::config::GpuSourceConfig;
    use inferyes_tests::{AgentHandle, ControllerHandle, Etcd, SimHandle};
    // A token a second: this answer would take a quarter of an hour.
    let sim = SimHandle::start(SimConfig { decode_tokens_per_second: 1.0, ..chat_sim("chat") }).await;
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let backend = inferyes_tests::fleet::llama_server(&sim.url, &["chat"]);
    let grace = Duration::from_millis(300);
    let agent =
        AgentHandle::start_tweaked("node-a", &[controller.url()], GpuSourceConfig::Simulated, vec![backend], |c| {
            c.shutdown_grace_ms = u64::try_from(grace.as_millis()).unwrap();
        })
        .await;
    let request =
        json!({"model": "chat", "stream": true, "max_tokens": 900, "messages": [{"role": "user", "content": "go"}]});
    let http = inferyes_tests::HttpClient::default();
    let authorization = inferyes_tests::fleet::agent_authorization(&etcd, &agent.node_id).await;
    let response = http
        .start(
            Method::POST,
            &format!("http://{}/v1/chat/completions", agent.proxy_addr),
            Bytes::from(request.to_string()),
            &[("authorization", &authorization)],
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    next_chunk(&mut body).await.expect("the generation has started");
    let stopping = Instant::now();
    assert!(agent.stop_within(grace + Duration::from_secs(5)).await, "the agent waited on the generation");
    assert!(stopping.elapsed() >= grace, "the generation was cut before its grace: {:?}", stopping.elapsed());
}

#[tokio::test]
async fn models_are_the_union_of_the_fleet() {
    let swap = SimConfig {
        models: vec![inferyes_sim::SimModel::chat("alpha"), inferyes_sim::SimModel::chat("beta")],
        preload: vec!["alpha".into()],
        ..SimConfig::llama_swap(["alpha", "beta"])
    };
    let fleet = Fleet::start(vec![chat_sim("alpha"), swap]).await;
    let models = fleet.http.get(&fleet.url("/v1/models")).await;
    assert_eq!(models.status, StatusCode::OK);
    let body = models.json();
    assert_eq!(body["object"], "list");
    let ids: Vec<&str> = body["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["alpha", "beta"]);
    assert_eq!(body["data"][0]["inferyes"]["warm_nodes"], 2);
    assert_eq!(body["data"][1]["inferyes"]["state"], "cold");

    let beta = fleet.http.get(&fleet.url("/v1/models/beta")).await;
    assert_eq!(beta.status, StatusCode::OK);
    assert_eq!(beta.json()["id"], "beta");
    let missing = fleet.http.get(&fleet.url("/v1/models/gamma")).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert_eq!(missing.openai_error()["code"], "model_not_found");
}

#[tokio::test]
async fn a_session_stays_on_its_node() {
    let fleet = Fleet::start(vec![chat_sim("chat"), chat_sim("chat"), chat_sim("chat")]).await;
    for session in ["s-1", "s-2", "s-3", "s-4"] {
        let mut nodes = Vec::new();
        for turn in 0..4 {
            let response = fleet
                .http
                .send(
                    Method::POST,
                    &fleet.url("/v1/chat/completions"),
                    Bytes::from(chat_body("chat", &format!("turn {turn}")).to_string()),
                    &[("x-session-id", session)],
                )
                .await;
            assert_eq!(response.status, StatusCode::OK);
            nodes.push(response.header("x-inferyes-node").unwrap().to_string());
        }
        assert!(nodes.windows(2).all(|w| w[0] == w[1]), "session {session} moved: {nodes:?}");
    }
}

#[tokio::test]
async fn a_killed_agent_leaves_the_fleet_within_the_lease_ttl_and_traffic_moves() {
    let mut fleet = Fleet::start(vec![chat_sim("chat"), chat_sim("chat")]).await;
    let send = |fleet: &Fleet| {
        let url = fleet.url("/v1/chat/completions");
        let http = fleet.http.clone();
        async move {
            http.send(
                Method::POST,
                &url,
                Bytes::from(chat_body("chat", "hi").to_string()),
                &[("x-session-id", "sticky")],
            )
            .await
        }
    };
    let before = send(&fleet).await;
    assert_eq!(before.status, StatusCode::OK);
    let home = before.header("x-inferyes-node").unwrap().to_string();
    let other = if home == "node-a" { "node-b" } else { "node-a" };

    let index = fleet.agents.iter().position(|a| a.node_id == home).unwrap();
    let killed_at = Instant::now();
    fleet.agents.remove(index).kill();
    fleet.dataplane.wait_for_nodes(&[other]).await;
    let gone_after = killed_at.elapsed();
    assert!(gone_after <= LEASE_TTL + Duration::from_secs(1), "node left after {gone_after:?}");

    let after = send(&fleet).await;
    assert_eq!(after.status, StatusCode::OK, "{}", String::from_utf8_lossy(&after.body));
    assert_eq!(after.header("x-inferyes-node"), Some(other));
}

#[tokio::test]
async fn a_loading_server_is_seen_as_loading_and_gets_no_traffic_until_ready() {
    use inferyes_proto::v1::Health;
    use inferyes_tests::{AgentHandle, ControllerHandle, DataplaneHandle, Etcd, HttpClient, SimHandle};

    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    // llama-server answers 503 "Loading model" until its model is in memory.
    let loading = SimHandle::start(SimConfig { load_delay_ms: 1500, ..chat_sim("chat") }).await;
    let _agent = AgentHandle::start("node-a", &[controller.url()], &[("main", &loading)]).await;
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    let health = |s: &inferyes_dataplane::snapshot::RoutingSnapshot| s.nodes().first().map(|n| n.backends[0].health);
    dataplane.wait_for("the node, loading", Duration::from_secs(5), |s| health(s) == Some(Health::Loading)).await;

    let http = HttpClient::default();
    let url = format!("{}/v1/chat/completions", dataplane.url);
    let refused = http.post_json(&url, &chat_body("chat", "hi")).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.openai_error()["code"], "no_capacity");
    assert_eq!(loading.sim.stats().requests, 0, "nothing was sent to a loading server");

    dataplane.wait_for("the node, ready", Duration::from_secs(5), |s| health(s) == Some(Health::Ready)).await;
    assert_eq!(http.post_json(&url, &chat_body("chat", "hi")).await.status, StatusCode::OK);
}

const CHAT_COMPLETION: &str = r#"{"object":"chat.completion","model":"chat","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;

/// An HTTP/1.1-only proxy (as agents were before they took HTTP/2) that
/// answers every request with a chat completion and notes each request's
/// HTTP version.
async fn http1_only_proxy() -> (String, Arc<Mutex<Vec<http::Version>>>) {
    fixed_proxy("application/json", CHAT_COMPLETION).await
}

/// An HTTP/1.1-only proxy answering every request with `body` (sent with
/// its `content-length`), noting each request's HTTP version.
async fn fixed_proxy(content_type: &'static str, body: &'static str) -> (String, Arc<Mutex<Vec<http::Version>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("bound"));
    let seen: Arc<Mutex<Vec<http::Version>>> = Arc::default();
    let versions = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let versions = Arc::clone(&versions);
            let service = hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                versions.lock().expect("lock").push(request.version());
                let response = http::Response::builder()
                    .header("content-type", content_type)
                    .body(http_body_util::Full::new(Bytes::from_static(body.as_bytes())))
                    .expect("a response");
                async move { Ok::<_, std::convert::Infallible>(response) }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(io, service));
        }
    });
    (url, seen)
}

/// Joins a node the way an agent does, with `proxy_url` and whether it
/// says its proxy takes HTTP/2; it stays while the returned stream lives.
async fn join_node(
    controller: &str,
    node_id: &str,
    proxy_url: &str,
    proxy_http2: bool,
) -> (
    tokio::sync::mpsc::Sender<inferyes_proto::v1::AgentMessage>,
    tonic::Streaming<inferyes_proto::v1::ControllerMessage>,
) {
    use inferyes_proto::v1::agent_service_client::AgentServiceClient;
    use inferyes_proto::v1::{AgentMessage, Backend, BackendKind, Health, Model, ModelState, NodeStatus, Register};
    let status = NodeStatus {
        node_id: node_id.into(),
        proxy_url: proxy_url.into(),
        proxy_http2,
        backends: vec![Backend {
            id: "main".into(),
            kind: BackendKind::LlamaServer as i32,
            health: Health::Ready as i32,
            models: vec![Model {
                id: "chat".into(),
                state: ModelState::Loaded as i32,
                context_window: 8192,
                ..Default::default()
            }],
            weight: 1,
            slots_total: 4,
            ..Default::default()
        }],
        ..Default::default()
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let register =
        Register { status: Some(status), join_token: inferyes_tests::fleet::JOIN_TOKEN.into(), ..Default::default() };
    tx.send(AgentMessage { msg: Some(inferyes_proto::v1::agent_message::Msg::Register(register)) })
        .await
        .expect("queued");
    let mut agents = AgentServiceClient::connect(controller.to_string()).await.expect("the controller");
    let inbound = agents.join(tokio_stream::wrappers::ReceiverStream::new(rx)).await.expect("joined").into_inner();
    (tx, inbound)
}

#[tokio::test]
async fn an_agent_that_does_not_take_http2_is_reached_over_http1() {
    use inferyes_tests::{ControllerHandle, DataplaneHandle, Etcd};
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let dataplane = DataplaneHandle::start_with(&[controller.url()], |config| {
        config.agent_protocol = inferyes_dataplane::config::AgentProtocol::Http2;
    })
    .await;
    let http = inferyes_tests::HttpClient::default();
    let (url, seen) = http1_only_proxy().await;

    // Said so: HTTP/1.1, though this data plane prefers HTTP/2.
    let old = join_node(&controller.url(), "old", &url, false).await;
    dataplane.wait_for_nodes(&["old"]).await;
    let response = http.post_json(&format!("{}/v1/chat/completions", dataplane.url), &chat_body("chat", "hi")).await;
    assert_eq!(response.status, StatusCode::OK, "{}", String::from_utf8_lossy(&response.body));
    assert_eq!(response.json()["choices"][0]["message"]["content"], "hi");
    let length = response.header("content-length").map(|n| n.to_string());
    assert_eq!(length, Some(response.body.len().to_string()), "a whole answer is sent with its length");
    assert_eq!(*seen.lock().unwrap(), vec![http::Version::HTTP_11]);
    drop(old);

    // Had it claimed HTTP/2, the data plane would have spoken it, and this
    // proxy would not have understood: the claim is what decides.
    let _wrong = join_node(&controller.url(), "claims-http2", &url, true).await;
    dataplane.wait_for_nodes(&["claims-http2"]).await;
    let response = http.post_json(&format!("{}/v1/chat/completions", dataplane.url), &chat_body("chat", "hi")).await;
    assert!(response.status.is_server_error(), "{}", response.status);
    assert_eq!(seen.lock().unwrap().len(), 1, "no request reached it over HTTP/1.1");
}

#[tokio::test]
async fn a_stream_sent_with_a_length_reaches_the_client_whole_and_changed_without_it() {
    use inferyes_tests::{ControllerHandle, DataplaneHandle, Etcd};
    // A node that sends its event stream with a content-length, the usage
    // chunk included, though the client did not ask for it: the data plane
    // takes that chunk out, so the node's length is not the answer's.
    const STREAM: &str = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4}}\n\n",
        "data: [DONE]\n\n",
    );
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    let (url, seen) = fixed_proxy("text/event-stream", STREAM).await;
    let _node = join_node(&controller.url(), "lengthy", &url, false).await;
    dataplane.wait_for_nodes(&["lengthy"]).await;
    let mut body = chat_body("chat", "hi");
    body["stream"] = json!(true);
    let http = inferyes_tests::HttpClient::default();
    let response = http.post_json(&format!("{}/v1/chat/completions", dataplane.url), &body).await;
    let text = String::from_utf8_lossy(&response.body);
    assert_eq!(response.status, StatusCode::OK, "{text}");
    assert!(text.contains("\"content\":\"hi\"") && text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(!text.contains("\"usage\""), "the usage chunk the client did not ask for is taken out: {text}");
    assert!(response.header("content-length").is_none_or(|n| n == text.len().to_string()), "{text}");
    assert_eq!(seen.lock().unwrap().len(), 1);
}

/// A llama-server look-alike that closes its connection after every answer,
/// as llama-server does on each connection's hundredth, saying so with
/// `Connection: close` and options of its own.
async fn closing_backend() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("bound"));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let service = hyper::service::service_fn(|_: http::Request<hyper::body::Incoming>| async {
                let response = http::Response::builder()
                    .header("content-type", "application/json")
                    .header("connection", "close, x-hop")
                    .header("x-hop", "1")
                    .header("keep-alive", "timeout=5, max=1")
                    .body(http_body_util::Full::new(Bytes::from_static(CHAT_COMPLETION.as_bytes())))
                    .expect("a response");
                Ok::<_, std::convert::Infallible>(response)
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(io, service));
        }
    });
    url
}

#[tokio::test]
async fn a_backend_closing_its_connection_leaves_the_connection_to_its_agent_open() {
    use http_body_util::BodyExt;
    use inferyes_agent::config::GpuSourceConfig;
    use inferyes_tests::AgentHandle;
    let backend = inferyes_tests::fleet::llama_server(&closing_backend().await, &["chat"]);
    // No controller is needed to reach an open fleet's proxy.
    let agent = AgentHandle::start_tweaked(
        "node-a",
        &["http://127.0.0.1:9".into()],
        GpuSourceConfig::None,
        vec![backend],
        |c| c.join_token = None,
    )
    .await;
    let stream = tokio::net::TcpStream::connect(agent.proxy_addr).await.expect("the agent's proxy");
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.expect("handshake");
    tokio::spawn(connection);
    for turn in 0..3 {
        sender.ready().await.unwrap_or_else(|e| panic!("turn {turn}: the connection to the agent was closed: {e}"));
        let request = http::Request::post("/v1/chat/completions")
            .header("host", "agent")
            .header(inferyes_proto::headers::BACKEND, "main")
            .body(http_body_util::Full::new(Bytes::from(chat_body("chat", "hi").to_string())))
            .expect("a request");
        let response = sender.send_request(request).await.expect("an answer");
        assert_eq!(response.status(), StatusCode::OK);
        for name in ["connection", "keep-alive", "x-hop"] {
            assert!(!response.headers().contains_key(name), "turn {turn}: the backend's `{name}` came through");
        }
        let body = response.into_body().collect().await.expect("the body").to_bytes();
        assert_eq!(body, CHAT_COMPLETION.as_bytes());
    }
    agent.stop().await;
}
