//! A node failing in the middle of an answer: the client gets a whole
//! answer from another node, or an explicit error, never a cut body.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::{MethodRouter, get, post};
use bytes::Bytes;
use http::{Method, StatusCode};
use inferyes_agent::config::GpuSourceConfig;
use inferyes_tests::client::next_chunk;
use inferyes_tests::fleet::llama_server;
use inferyes_tests::{AgentHandle, ControllerHandle, DataplaneHandle, Etcd, HttpClient, SimHandle};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::support::{chat_body, chat_sim};

/// A llama-server look-alike serving the model `chat`, whose chat answers
/// are `chat`'s; its URL.
async fn look_alike(chat: MethodRouter, shutdown: CancellationToken) -> String {
    let app = Router::new()
        .route("/health", get(|| async { axum::Json(json!({"status": "ok"})) }))
        .route("/v1/models", get(|| async { axum::Json(json!({"object": "list", "data": [{"id": "chat"}]})) }))
        .route("/v1/chat/completions", chat);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("bound"));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await;
    });
    url
}

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
    let chat = post(move |body: Bytes| async move {
        let request: Value = serde_json::from_slice(&body).unwrap_or_default();
        let content_type = if request["stream"] == true { "text/event-stream" } else { "application/json" };
        ([(http::header::CONTENT_TYPE, content_type)], broken())
    });
    look_alike(chat, shutdown).await
}

/// A llama-server look-alike whose every chat answer is the request's
/// `x-client-tag` header (`none` without one).
async fn echoing_backend(shutdown: CancellationToken) -> String {
    let chat = post(|headers: http::HeaderMap| async move {
        let tag = headers.get("x-client-tag").and_then(|v| v.to_str().ok()).unwrap_or("none").to_string();
        axum::Json(json!({
            "object": "chat.completion",
            "model": "chat",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": tag}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }))
    });
    look_alike(chat, shutdown).await
}

/// etcd and a controller, for nodes of look-alikes that stop with `stop`
/// (cancelled when this is dropped).
struct Control {
    _etcd: Etcd,
    controller: ControllerHandle,
    stop: CancellationToken,
    _stop: tokio_util::sync::DropGuard,
}

impl Control {
    async fn start() -> Control {
        let etcd = Etcd::start().await;
        let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
        let stop = CancellationToken::new();
        let _stop = stop.clone().drop_guard();
        Control { _etcd: etcd, controller, stop, _stop }
    }
}

/// A node whose agent serves the llama-server look-alike at `url`.
async fn node_of(id: &str, controller: &ControllerHandle, url: &str) -> AgentHandle {
    AgentHandle::start_with(id, &[controller.url()], GpuSourceConfig::None, vec![llama_server(url, &[])]).await
}

/// A fleet whose `node-a` breaks every answer after its first bytes, and,
/// with `healthy`, a `node-b` that answers well.
struct Breaking {
    _etcd: Etcd,
    controller: ControllerHandle,
    stop: CancellationToken,
    _broken: AgentHandle,
    healthy: Option<(AgentHandle, SimHandle)>,
    dataplane: DataplaneHandle,
}

impl Breaking {
    async fn start(healthy: bool) -> Breaking {
        let etcd = Etcd::start().await;
        let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
        let stop = CancellationToken::new();
        let broken = node_of("node-a", &controller, &breaking_backend(stop.clone()).await).await;
        let healthy = if healthy {
            let sim = SimHandle::start(chat_sim("chat")).await;
            Some((AgentHandle::start("node-b", &[controller.url()], &[("main", &sim)]).await, sim))
        } else {
            None
        };
        let dataplane = DataplaneHandle::start(&[controller.url()]).await;
        let nodes: &[&str] = if healthy.is_some() { &["node-a", "node-b"] } else { &["node-a"] };
        dataplane.wait_for_nodes(nodes).await;
        Breaking { _etcd: etcd, controller, stop, _broken: broken, healthy, dataplane }
    }

    fn url(&self) -> String {
        format!("{}/v1/chat/completions", self.dataplane.url)
    }
}

impl Drop for Breaking {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[tokio::test]
async fn a_stream_cut_by_its_node_ends_with_an_error_event() {
    let fleet = Breaking::start(false).await;

    let request = json!({"model": "chat", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let response = HttpClient::default().start(Method::POST, &fleet.url(), Bytes::from(request.to_string()), &[]).await;
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
}

#[tokio::test]
async fn a_whole_answer_comes_from_another_node_when_one_breaks_mid_answer() {
    let mut fleet = Breaking::start(true).await;
    let http = HttpClient::default();
    let mut failovers = 0;
    for i in 0..12 {
        let response = http.post_json(&fleet.url(), &chat_body("chat", &format!("question {i}"))).await;
        assert_eq!(response.status, StatusCode::OK, "{}", String::from_utf8_lossy(&response.body));
        assert_eq!(response.header("x-inferyes-node"), Some("node-b"));
        assert_eq!(response.json()["object"], "chat.completion");
        if response.header("x-inferyes-route") == Some("failover") {
            failovers += 1;
        }
    }
    assert!(failovers > 0, "some requests were placed on the broken node first");
    // After its first failure the broken node is ejected (1 s, then longer):
    // later requests go straight to the healthy one.
    assert!(failovers <= 2, "{failovers} requests tried the broken node first");
    // Each request is in the usage ledger once, served by node-b, however
    // many nodes it went through.
    let total = crate::usage::rolled_up(&fleet.controller, "", 12).await;
    assert_eq!((total.requests, total.errors), (12, 0), "{total:?}");
    let served = fleet.healthy.as_ref().expect("a healthy node").1.sim.stats();
    assert_eq!((total.prompt_tokens, total.completion_tokens), (served.prompt_tokens, served.completion_tokens));

    // Alone, the broken node gives an explicit 502.
    let (agent, sim) = fleet.healthy.take().expect("a healthy node");
    agent.kill();
    sim.stop().await;
    fleet.dataplane.wait_for_nodes(&["node-a"]).await;
    let response = http.post_json(&fleet.url(), &chat_body("chat", "x")).await;
    assert_eq!(response.status, StatusCode::BAD_GATEWAY);
    assert_eq!(response.openai_error()["code"], "upstream_broken");
}

#[tokio::test]
async fn a_failover_carries_the_client_s_headers_to_the_next_node() {
    let Control { controller, stop, .. } = &Control::start().await;
    let _a = node_of("node-a", controller, &breaking_backend(stop.clone()).await).await;
    let _b = node_of("node-b", controller, &echoing_backend(stop.clone()).await).await;
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-a", "node-b"]).await;
    let url = format!("{}/v1/chat/completions", dataplane.url);
    let http = HttpClient::default();

    // A request placed on the broken node first goes on to the other with
    // the headers its client sent, as one placed there first does.
    let mut failovers = 0;
    for i in 0..12 {
        let tag = format!("tag-{i}");
        let body = Bytes::from(chat_body("chat", &format!("question {i}")).to_string());
        let response = http.send(Method::POST, &url, body, &[("x-client-tag", &tag)]).await;
        assert_eq!(response.status, StatusCode::OK, "{}", String::from_utf8_lossy(&response.body));
        assert_eq!(response.header("x-inferyes-node"), Some("node-b"));
        assert_eq!(response.json()["choices"][0]["message"]["content"], tag.as_str());
        if response.header("x-inferyes-route") == Some("failover") {
            failovers += 1;
        }
    }
    assert!(failovers > 0, "some requests were placed on the broken node first");
}

#[tokio::test]
async fn on_shutdown_the_data_plane_finishes_what_it_started_within_its_grace() {
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    // 20 tokens at 20 tokens/s: a one-second answer.
    let slow = SimHandle::start(inferyes_sim::SimConfig { decode_tokens_per_second: 20.0, ..chat_sim("chat") }).await;
    let _agent = AgentHandle::start("node-a", &[controller.url()], &[("main", &slow)]).await;
    let request = json!({"model": "chat", "stream": true, "max_tokens": 20,
                         "messages": [{"role": "user", "content": "a long answer"}]});
    let http = HttpClient::default();

    for (grace_ms, completes) in [(5_000u64, true), (200, false)] {
        let dataplane = DataplaneHandle::start_with(&[controller.url()], |c| c.shutdown_grace_ms = grace_ms).await;
        dataplane.wait_for_nodes(&["node-a"]).await;
        let url = format!("{}/v1/chat/completions", dataplane.url);
        let response = http.start(Method::POST, &url, Bytes::from(request.to_string()), &[]).await;
        let mut body = response.into_body();
        let mut text = String::from_utf8(next_chunk(&mut body).await.expect("a first chunk").to_vec()).unwrap();

        dataplane.begin_shutdown();
        let reader = tokio::spawn(async move {
            while let Some(Ok(frame)) = http_body_util::BodyExt::frame(&mut body).await {
                if let Ok(data) = frame.into_data() {
                    text.push_str(std::str::from_utf8(&data).unwrap());
                }
            }
            text
        });
        let took = dataplane.exited().await;
        let text = reader.await.unwrap();
        if completes {
            assert!(text.ends_with("data: [DONE]\n\n"), "the stream in flight finished: {text}");
            assert!(took >= Duration::from_millis(500), "it waited for the stream ({took:?})");
        } else {
            assert!(!text.contains("[DONE]"), "cut at the grace: {text}");
            assert!(text.contains("\"code\":\"gateway_shutdown\""), "told why: {text}");
            assert!(took < Duration::from_millis(900), "exited {took:?} after the shutdown began");
        }
        // Nothing new is accepted once it began.
        let refused =
            tokio::net::TcpStream::connect(url.trim_start_matches("http://").split('/').next().unwrap()).await;
        assert!(refused.is_err(), "still accepting after exit");
    }
}

#[tokio::test]
async fn a_client_that_goes_away_frees_the_backend_at_once() {
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    // 100,000 tokens at 10 tokens/s: hours, if nobody stopped it.
    let slow = SimHandle::start(inferyes_sim::SimConfig { decode_tokens_per_second: 10.0, ..chat_sim("chat") }).await;
    let _agent = AgentHandle::start("node-a", &[controller.url()], &[("main", &slow)]).await;
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-a"]).await;
    let http = HttpClient::default();
    let busy = |slots: Value| slots.as_array().map_or(0, |s| s.iter().filter(|s| s["is_processing"] == true).count());
    let slots_url = format!("{}/slots", slow.url);

    for stream in [true, false] {
        let request = json!({"model": "chat", "stream": stream, "max_tokens": 100_000,
                             "messages": [{"role": "user", "content": "go on and on"}]});
        let url = format!("{}/v1/chat/completions", dataplane.url);
        let client = http.clone();
        let pending = tokio::spawn(async move {
            let response = client.start(Method::POST, &url, Bytes::from(request.to_string()), &[]).await;
            let mut body = response.into_body();
            next_chunk(&mut body).await;
        });
        inferyes_tests::eventually("the backend generating", Duration::from_secs(5), || {
            let (http, url) = (http.clone(), slots_url.clone());
            async move { busy(http.get(&url).await.json()) == 1 }
        })
        .await;
        // The client hangs up.
        pending.abort();
        let _ = pending.await;
        inferyes_tests::eventually("the backend freed", Duration::from_secs(10), || {
            let (http, url) = (http.clone(), slots_url.clone());
            async move { busy(http.get(&url).await.json()) == 0 }
        })
        .await;
    }
}

/// Streams a story `i`: the node that answered and the text.
async fn story(url: &str, i: usize) -> (String, String) {
    let request = json!({"model": "chat", "stream": true, "max_tokens": 8,
                         "messages": [{"role": "user", "content": format!("story {i}")}]});
    let response = HttpClient::default().start(Method::POST, url, Bytes::from(request.to_string()), &[]).await;
    let node = response.headers()["x-inferyes-node"].to_str().expect("a node id").to_string();
    let mut body = response.into_body();
    let mut text = String::new();
    while let Some(chunk) = next_chunk(&mut body).await {
        text.push_str(std::str::from_utf8(&chunk).expect("text"));
    }
    (node, text)
}

#[tokio::test]
async fn a_broken_stream_continues_on_another_node_when_the_fleet_says_so() {
    let fleet = Breaking::start(true).await;
    let mut admin = fleet.controller.fleet().await;
    let policy = inferyes_proto::v1::RoutingPolicy { continue_broken_streams: true, ..Default::default() };
    let set = admin.set_policy(policy).await.unwrap().into_inner();
    fleet.dataplane.wait_for("the policy", Duration::from_secs(5), |s| s.version() >= set.revision).await;

    // Find a conversation whose first node is the broken one.
    for i in 0..64 {
        let (first_node, text) = story(&fleet.url(), i).await;
        if first_node != "node-a" {
            continue;
        }
        assert!(text.contains("Hel"), "the broken node's first words reach the client: {text}");
        assert!(text.contains(": continued on node node-b after node node-a broke"), "{text}");
        assert!(!text.contains("\"error\""), "no error: the answer went on: {text}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        let role_chunks = text.matches("\"role\":\"assistant\"").count();
        assert_eq!(role_chunks, 0, "the continuation's preamble is not repeated: {text}");
        return;
    }
    panic!("no request went to the broken node first");
}

#[tokio::test]
async fn a_stream_a_node_ends_with_an_error_of_its_own_is_not_continued_elsewhere() {
    let Control { controller, stop, .. } = &Control::start().await;
    let erring = post(|| async {
        let events = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"},\"index\":0}],\"object\":\"chat.completion.chunk\"}\n\n",
            "data: {\"error\":{\"code\":500,\"message\":\"context full\",\"type\":\"server_error\"}}\n\n",
        );
        ([(http::header::CONTENT_TYPE, "text/event-stream")], events)
    });
    let _a = node_of("node-a", controller, &look_alike(erring, stop.clone()).await).await;
    let sim = SimHandle::start(chat_sim("chat")).await;
    let _b = AgentHandle::start("node-b", &[controller.url()], &[("main", &sim)]).await;
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-a", "node-b"]).await;
    let mut admin = controller.fleet().await;
    let policy = inferyes_proto::v1::RoutingPolicy { continue_broken_streams: true, ..Default::default() };
    let set = admin.set_policy(policy).await.unwrap().into_inner();
    dataplane.wait_for("the policy", Duration::from_secs(5), |s| s.version() >= set.revision).await;

    let url = format!("{}/v1/chat/completions", dataplane.url);
    for i in 0..64 {
        let (node, text) = story(&url, i).await;
        if node != "node-a" {
            continue;
        }
        assert!(text.ends_with("\"message\":\"context full\",\"type\":\"server_error\"}}\n\n"), "{text}");
        assert!(!text.contains(": continued"), "{text}");
        // The node said what went wrong; it did not fail: the conversation
        // stays with it.
        assert_eq!(story(&url, i).await.0, "node-a");
        return;
    }
    panic!("no request went to node-a first");
}

#[tokio::test]
async fn a_node_that_does_not_answer_in_time_is_named_in_the_timeout_and_held_out() {
    let Control { controller, stop, .. } = &Control::start().await;
    let hung = look_alike(post(std::future::pending::<()>), stop.clone()).await;
    let _a = node_of("node-a", controller, &hung).await;
    let _b = node_of("node-b", controller, &echoing_backend(stop.clone()).await).await;
    let dataplane = DataplaneHandle::start_with(&[controller.url()], |c| c.response_header_timeout_ms = 300).await;
    dataplane.wait_for_nodes(&["node-a", "node-b"]).await;
    let url = format!("{}/v1/chat/completions", dataplane.url);
    let http = HttpClient::default();

    // Conversations are spread over both nodes: one placed on the hung node
    // waits out the timeout.
    let mut timed_out = None;
    for i in 0..32 {
        let body = chat_body("chat", &format!("question {i}"));
        let response = http.post_json(&url, &body).await;
        if response.status == StatusCode::GATEWAY_TIMEOUT {
            assert_eq!(response.openai_error()["code"], "upstream_timeout");
            assert_eq!(response.header("x-inferyes-node"), Some("node-a"), "the timeout names its node");
            assert!(response.header("x-inferyes-route").is_some());
            timed_out = Some(body);
            break;
        }
        assert_eq!(response.status, StatusCode::OK, "{}", String::from_utf8_lossy(&response.body));
        assert_eq!(response.header("x-inferyes-node"), Some("node-b"));
    }
    let body = timed_out.expect("a conversation was placed on the hung node");
    // Its next turn goes where an answer comes from.
    let response = http.post_json(&url, &body).await;
    assert_eq!(response.status, StatusCode::OK, "{}", String::from_utf8_lossy(&response.body));
    assert_eq!(response.header("x-inferyes-node"), Some("node-b"));
}

#[tokio::test]
async fn a_node_that_refuses_is_named_counted_and_held_out_with_no_other_to_go_to() {
    let Control { controller, stop, .. } = &Control::start().await;
    let refusing = post(|| async {
        let error = json!({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}});
        (StatusCode::SERVICE_UNAVAILABLE, axum::Json(error))
    });
    let _a = node_of("node-a", controller, &look_alike(refusing, stop.clone()).await).await;
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-a"]).await;
    let http = HttpClient::default();
    for i in 0..2 {
        let response =
            http.post_json(&format!("{}/v1/chat/completions", dataplane.url), &chat_body("chat", &i.to_string())).await;
        assert_eq!(response.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.header("retry-after"), Some("1"));
        assert_eq!(response.header("x-inferyes-node"), Some("node-a"));
        assert_eq!(response.openai_error()["message"], "Loading model");
    }
    let metrics = http.get(&format!("{}/metrics", dataplane.admin_url)).await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(text.contains("inferyes_dataplane_node_ejected{node=\"node-a\"} 1"), "{text}");
    assert!(text.contains("inferyes_dataplane_node_ejections_total{node=\"node-a\"} 2"), "{text}");
    let counted = text
        .lines()
        .find(|l| l.starts_with("inferyes_dataplane_requests_total{") && l.contains("status=\"503\""))
        .unwrap_or_default();
    assert!(counted.contains("node=\"node-a\"") && counted.ends_with(" 2"), "{text}");
}

#[tokio::test]
async fn an_answer_its_node_stops_sending_in_the_middle_of_ends_after_the_read_timeout() {
    let Control { controller, stop, .. } = &Control::start().await;
    // First bytes, then silence on a connection that stays open.
    let stalling = post(|body: Bytes| async move {
        let request: Value = serde_json::from_slice(&body).unwrap_or_default();
        let content_type = if request["stream"] == true { "text/event-stream" } else { "application/json" };
        let first = b"data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"},\"index\":0}],\"object\":\"chat.completion.chunk\"}\n\n";
        let silent = tokio_stream::StreamExt::chain(
            tokio_stream::once(Ok::<_, std::io::Error>(Bytes::from_static(first))),
            tokio_stream::pending(),
        );
        ([(http::header::CONTENT_TYPE, content_type)], Body::from_stream(silent))
    });
    let _a = node_of("node-a", controller, &look_alike(stalling, stop.clone()).await).await;
    let dataplane = DataplaneHandle::start_with(&[controller.url()], |c| c.read_timeout_ms = 300).await;
    dataplane.wait_for_nodes(&["node-a"]).await;
    let url = format!("{}/v1/chat/completions", dataplane.url);

    let (node, text) = story(&url, 0).await;
    assert_eq!(node, "node-a");
    assert!(text.contains("Hel"), "{text}");
    let last = text.trim_end().rsplit("\n\n").next().unwrap_or_default();
    assert!(last.contains("\"upstream_broken\""), "the stream ends with an error event: {text}");

    let response = HttpClient::default().post_json(&url, &chat_body("chat", "hi")).await;
    assert_eq!(response.status, StatusCode::BAD_GATEWAY);
    assert_eq!(response.openai_error()["code"], "upstream_broken");
}
