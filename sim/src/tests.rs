//! End-to-end tests of the simulator over real sockets.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::*;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

struct Running {
    sim: Simulator,
    base: String,
    client: HttpClient,
    shutdown: CancellationToken,
    server: JoinHandle<std::io::Result<()>>,
}

/// Rates this high make every simulated duration round down to zero.
fn fast(mut c: SimConfig) -> SimConfig {
    c.prefill_tokens_per_second = 1e15;
    c.decode_tokens_per_second = 1e15;
    c
}

async fn start(config: SimConfig) -> Running {
    let sim = Simulator::new(config).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(sim.clone().serve(listener, shutdown.clone()));
    let client = Client::builder(TokioExecutor::new()).build_http();
    Running { sim, base, client, shutdown, server }
}

impl Running {
    async fn send(
        &self,
        method: Method,
        path: &str,
        content_type: Option<&str>,
        body: impl Into<Bytes>,
    ) -> http::Response<hyper::body::Incoming> {
        let mut req = Request::builder().method(method).uri(format!("{}{path}", self.base));
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        let req = req.body(Full::new(body.into())).unwrap();
        self.client.request(req).await.unwrap()
    }

    async fn raw(
        &self,
        method: Method,
        path: &str,
        content_type: Option<&str>,
        body: impl Into<Bytes>,
    ) -> (StatusCode, http::HeaderMap, Bytes) {
        let resp = self.send(method, path, content_type, body).await;
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, headers, body)
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        let (status, _, body) = self.raw(Method::GET, path, None, Bytes::new()).await;
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        let (status, _, bytes) = self.raw(Method::POST, path, Some("application/json"), body.to_string()).await;
        let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        (status, v)
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), self.server)
            .await
            .expect("serve returns promptly on shutdown")
            .unwrap()
            .unwrap();
    }
}

/// Reads SSE `data:` payloads until the body ends.
async fn sse_events(resp: http::Response<hyper::body::Incoming>) -> Vec<String> {
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8(body.to_vec()).unwrap();
    text.split("\n\n").filter(|f| !f.is_empty()).map(|f| f.strip_prefix("data: ").unwrap().to_owned()).collect()
}

fn user(content: &str) -> Value {
    json!({"role": "user", "content": content})
}

#[tokio::test]
async fn chat_shape_and_cache_reuse_across_turns() {
    let mut cfg = fast(SimConfig::llama_server("qwen"));
    cfg.cache_ram_tokens = 0;
    let r = start(cfg).await;
    let (status, v) = r
        .post("/v1/chat/completions", json!({"model": "anything", "messages": [user("hello there")], "max_tokens": 12}))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "anything");
    assert_eq!(v["system_fingerprint"], "b11434-unknown");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let reply = v["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
    let p1 = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 12);
    assert_eq!(v["usage"]["total_tokens"], p1 + 12);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(v["timings"]["cache_n"], 0);
    assert_eq!(v["timings"]["prompt_n"], p1);
    assert_eq!(v["timings"]["predicted_n"], 12);

    // Parts arrays are joined like plain strings.
    let (_, v2) = r
        .post(
            "/chat/completions",
            json!({"messages": [
                {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": reply},
                user("more please"),
            ]}),
        )
        .await;
    let cached = v2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert_eq!(cached, p1 + 12 - 1);
    assert_eq!(v2["timings"]["cache_n"], cached);
    assert_eq!(v2["usage"]["completion_tokens"], 16, "default_max_tokens");
    assert_eq!(v2["model"], "qwen");
    let stats = r.sim.stats();
    assert_eq!(stats.requests, 2);
    assert_eq!(stats.cached_tokens, cached);
    assert_eq!(stats.completion_tokens, 28);
    r.stop().await;
}

#[tokio::test]
async fn streaming_chat_and_completions() {
    let r = start(fast(SimConfig::llama_server("qwen"))).await;
    let body = json!({"messages": [user("hi")], "max_tokens": 3, "stream": true,
                      "stream_options": {"include_usage": true}});
    let resp = r.send(Method::POST, "/v1/chat/completions", Some("application/json"), body.to_string()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let events = sse_events(resp).await;
    assert_eq!(events.len(), 1 + 3 + 1 + 1 + 1);
    let chunks: Vec<Value> = events[..6].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks[0]["choices"][0]["delta"]["content"].is_null());
    assert_eq!(chunks[1]["object"], "chat.completion.chunk");
    assert_eq!(chunks[2]["choices"][0]["delta"]["content"], " ");
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[4]["choices"][0]["delta"], json!({}));
    assert!(chunks[4].get("timings").is_none(), "with usage asked for, the timings go with it");
    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 3);
    assert_eq!(chunks[5]["timings"]["predicted_n"], 3);
    assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"]));
    assert_eq!(events[6], "[DONE]");

    // Same prompt, non-streaming: the same greedy reply.
    let (_, v) = r.post("/v1/chat/completions", json!({"messages": [user("hi")], "max_tokens": 3})).await;
    let streamed: String = chunks[1..4].iter().map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap()).collect();
    assert_eq!(v["choices"][0]["message"]["content"], streamed);

    let (status, v) = r.post("/v1/completions", json!({"prompt": ["once upon"], "max_tokens": 4})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(v["choices"][0]["text"].is_string());
    assert_eq!(v["usage"]["prompt_tokens"], 3);

    let resp = r
        .send(
            Method::POST,
            "/completions",
            Some("application/json"),
            json!({"prompt": "once", "n_predict": 2, "stream": true}).to_string(),
        )
        .await;
    let events = sse_events(resp).await;
    assert_eq!(events.len(), 2 + 1 + 1);
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["object"], "text_completion");
    assert!(first["choices"][0]["text"].is_string());
    let last: Value = serde_json::from_str(&events[2]).unwrap();
    assert_eq!(
        (last["usage"]["completion_tokens"].as_u64(), last["timings"]["predicted_n"].as_u64()),
        (Some(2), Some(2))
    );
    r.stop().await;
}

#[tokio::test]
async fn a_stream_that_asks_for_progress_is_told_of_each_batch_of_its_prompt_as_llama_server_does() {
    let r = start(fast(SimConfig { context: 16_384, slots: 1, ..SimConfig::llama_server("qwen") })).await;
    let long = "word ".repeat(2_500);
    let ask = |path: &str, body: Value| {
        let (path, body) = (path.to_string(), body.to_string());
        let r = &r;
        async move { sse_events(r.send(Method::POST, &path, Some("application/json"), body).await).await }
    };
    let progress = |events: &[String]| -> Vec<Value> {
        events
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .filter(|c| c.get("prompt_progress").is_some())
            .collect()
    };
    let chat = json!({"messages": [user(&long)], "max_tokens": 2, "stream": true, "return_progress": true});
    let events = ask("/v1/chat/completions", chat.clone()).await;
    let read = progress(&events);
    let total = read[0]["prompt_progress"]["total"].as_u64().unwrap();
    assert!(total > 5_000, "{total}");
    let processed: Vec<u64> = read.iter().map(|c| c["prompt_progress"]["processed"].as_u64().unwrap()).collect();
    // Nothing cached, then each batch of 2,048, then the rest.
    assert_eq!(processed, vec![0, 2_048, 4_096, total], "{read:?}");
    assert!(read.iter().all(|c| c["choices"][0]["delta"] == json!({"role": "assistant", "content": null})));
    assert!(read.iter().all(|c| c["object"] == "chat.completion.chunk"));
    // Then the stream as without them: the role, two tokens, the end.
    assert_eq!(events.len(), read.len() + 1 + 2 + 1 + 1, "{events:?}");
    assert!(events[..read.len()].iter().all(|e| e.contains("prompt_progress")), "they come first");

    // The next turn finds its prompt cached, and says so first.
    let events = ask("/v1/chat/completions", chat).await;
    let again = progress(&events);
    let cache = again[0]["prompt_progress"]["cache"].as_u64().unwrap();
    assert!(cache > 5_000, "{again:?}");
    assert_eq!(again[0]["prompt_progress"]["processed"], cache);
    assert_eq!(again.last().unwrap()["prompt_progress"]["processed"], total);

    let completion = json!({"prompt": "once upon", "max_tokens": 2, "stream": true, "return_progress": true});
    let events = ask("/v1/completions", completion).await;
    let read = progress(&events);
    assert_eq!(read.len(), 2, "{events:?}");
    assert_eq!(
        (read[0]["choices"][0]["text"].as_str(), read[0]["object"].as_str()),
        (Some(""), Some("text_completion"))
    );
    // Not asked for, or not a stream: none.
    let plain = json!({"messages": [user("hi")], "max_tokens": 2, "stream": true});
    assert!(progress(&ask("/v1/chat/completions", plain).await).is_empty());
    let (status, whole) = r
        .post("/v1/chat/completions", json!({"messages": [user("hi")], "max_tokens": 2, "return_progress": true}))
        .await;
    assert_eq!((status, whole.get("prompt_progress")), (StatusCode::OK, None));
    r.stop().await;
}

#[tokio::test]
async fn errors_have_llama_server_shapes() {
    let mut cfg = fast(SimConfig::llama_server("qwen"));
    cfg.context = 64;
    cfg.slots = 2;
    let r = start(cfg).await;

    let long = "word ".repeat(40);
    let (status, v) = r.post("/v1/chat/completions", json!({"messages": [user(&long)]})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["type"], "exceed_context_size_error");
    assert_eq!(v["error"]["code"], 400);
    assert_eq!(v["error"]["n_ctx"], 32);
    let n = v["error"]["n_prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        v["error"]["message"],
        format!("request ({n} tokens) exceeds the available context size (32 tokens), try increasing it")
    );

    let (status, _, body) = r.raw(Method::POST, "/v1/chat/completions", None, "{not json").await;
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["type"], "invalid_request_error");

    let (status, v) = r.post("/v1/chat/completions", json!({"model": "x"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["type"], "invalid_request_error");

    let (status, v) = r.post("/v1/embeddings", json!({"input": "x"})).await;
    assert_eq!(status, StatusCode::NOT_IMPLEMENTED);
    assert_eq!(v["error"]["type"], "not_supported_error");
    assert_eq!(v["error"]["message"], "This server does not support embeddings. Start it with `--embeddings`");

    let (status, v) = r.get("/nope").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(v, json!({"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}));
    r.stop().await;
}

#[tokio::test]
async fn embeddings_model() {
    let mut cfg = fast(SimConfig::llama_server("bge"));
    cfg.models = vec![SimModel { embedding_dim: 8, ..SimModel::embedding("bge") }];
    let r = start(cfg).await;
    let (status, v) = r.post("/v1/embeddings", json!({"input": ["alpha beta", "gamma"], "model": "bge"})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["object"], "list");
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    assert_eq!(v["data"][1]["index"], 1);
    assert_eq!(v["data"][0]["object"], "embedding");
    let e: Vec<f64> = v["data"][0]["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    assert_eq!(e.len(), 8);
    let norm: f64 = e.iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() < 1e-3);

    let (status, v) = r.post("/v1/chat/completions", json!({"messages": [user("hi")]})).await;
    assert_eq!(status, StatusCode::NOT_IMPLEMENTED);
    assert_eq!(v["error"]["type"], "not_supported_error");
    r.stop().await;
}

#[tokio::test]
async fn informational_endpoints() {
    let mut cfg = fast(SimConfig::llama_server("qwen"));
    cfg.slots = 2;
    cfg.context = 1024;
    let r = start(cfg).await;
    r.post("/v1/chat/completions", json!({"messages": [user("hi")]})).await;

    let (status, v) = r.get("/health").await;
    assert_eq!((status, v), (StatusCode::OK, json!({"status": "ok"})));
    let (_, v) = r.get("/v1/models").await;
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "qwen");
    assert_eq!(v["data"][0]["owned_by"], "llamacpp");
    assert_eq!(v["data"][0]["meta"]["n_ctx_train"], 1024);
    assert_eq!(v["models"][0]["name"], "qwen");
    let (_, v) = r.get("/props").await;
    assert_eq!(v["default_generation_settings"]["n_ctx"], 512);
    assert_eq!(v["total_slots"], 2);
    assert_eq!(v["model_path"], "/models/qwen.gguf");
    assert_eq!(v["build_info"], "b11434-unknown");
    let (_, v) = r.get("/slots").await;
    assert_eq!(v.as_array().unwrap().len(), 2);
    assert_eq!(v[0]["n_ctx"], 512);
    assert_eq!(v[0]["is_processing"], false);
    let used: Vec<&Value> = v.as_array().unwrap().iter().filter(|s| s["id_task"] != -1).collect();
    assert_eq!(used.len(), 1);
    assert!(used[0]["n_prompt_tokens"].as_u64().unwrap() > 0);

    let (status, _, body) = r.raw(Method::GET, "/metrics", None, Bytes::new()).await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8(body.to_vec()).unwrap();
    for name in [
        "prompt_tokens_total",
        "prompt_tokens_cached_total",
        "prompt_seconds_total",
        "tokens_predicted_total",
        "tokens_predicted_seconds_total",
        "n_decode_total",
        "n_tokens_max",
        "prompt_tokens_seconds",
        "predicted_tokens_seconds",
        "requests_processing",
        "requests_deferred",
        "n_busy_slots_per_decode",
    ] {
        assert!(text.contains(&format!("# TYPE llamacpp:{name} ")), "{name}");
    }
    assert!(text.contains("llamacpp:tokens_predicted_total 16\n"));

    let (_, v) = r.get("/sim/gpu").await;
    let per_model = 4u64 * (1 << 30) + 1024 * 131_072;
    assert_eq!(v["memory_used_bytes"], per_model);
    assert_eq!(v["name"], "Simulated GPU 24GB");
    let (status, v) = r.post("/sim/gpu", json!({"extra_used_bytes": 1000})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["memory_used_bytes"], per_model + 1000);
    r.post("/sim/gpu", json!({"lost": true})).await;
    assert_eq!(r.get("/sim/gpu").await.0, StatusCode::INTERNAL_SERVER_ERROR, "a lost GPU cannot be read");
    let (_, v) = r.post("/sim/gpu", json!({"lost": false})).await;
    assert_eq!(v["memory_used_bytes"], per_model + 1000, "the memory figure stays as set");
    assert_eq!(r.get("/sim/gpu").await.0, StatusCode::OK);
    r.stop().await;
}

#[tokio::test]
async fn loading_answers_503_everywhere_but_sim() {
    let mut cfg = fast(SimConfig::llama_server("qwen"));
    cfg.load_delay_ms = 3_600_000;
    let r = start(cfg).await;
    let loading = json!({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}});
    assert_eq!(r.get("/health").await, (StatusCode::SERVICE_UNAVAILABLE, loading.clone()));
    assert_eq!(r.get("/v1/models").await, (StatusCode::SERVICE_UNAVAILABLE, loading.clone()));
    let (status, _) = r.post("/v1/chat/completions", json!({"messages": [user("hi")]})).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.get("/sim/gpu").await.0, StatusCode::OK);
    r.stop().await;
}

#[tokio::test]
async fn shutdown_ends_open_streams_and_disconnect_frees_slot() {
    let mut cfg = SimConfig::llama_server("qwen");
    cfg.slots = 1;
    cfg.decode_tokens_per_second = 50.0;
    let r = start(cfg).await;
    let body = json!({"messages": [user("hi")], "max_tokens": 100000, "stream": true}).to_string();

    // A client that goes away mid-stream frees its slot.
    let resp = r.send(Method::POST, "/v1/chat/completions", Some("application/json"), body.clone()).await;
    let mut incoming = resp.into_body();
    incoming.frame().await.unwrap().unwrap();
    drop(incoming);
    let freed = async {
        loop {
            let (_, v) = r.get("/slots").await;
            if v[0]["is_processing"] == false {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), freed).await.expect("slot freed after disconnect");

    // An open stream does not hold up shutdown, and ends with it.
    let resp = r.send(Method::POST, "/v1/chat/completions", Some("application/json"), body).await;
    let mut incoming = resp.into_body();
    incoming.frame().await.unwrap().unwrap();
    r.stop().await;
    let rest = tokio::time::timeout(Duration::from_secs(5), incoming.collect()).await;
    assert!(rest.is_ok(), "the open stream ended with the server");
}

/// A stream's events as (name, data), in order.
async fn named_events(resp: http::Response<hyper::body::Incoming>) -> Vec<(String, Value)> {
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8(body.to_vec()).unwrap();
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (name, data) = e.split_once('\n').unwrap();
            let name = name.strip_prefix("event: ").unwrap().to_owned();
            (name, serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap())
        })
        .collect()
}

#[tokio::test]
async fn messages_and_responses_are_answered_whole_and_streamed_as_llama_server_does() {
    let mut cfg = fast(SimConfig::llama_server("qwen"));
    cfg.cache_ram_tokens = 0;
    let r = start(cfg).await;
    let asked = json!({"model": "qwen", "max_tokens": 3, "system": "be brief",
                       "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]});
    let (status, counted) = r.post("/v1/messages/count_tokens", asked.clone()).await;
    assert_eq!(status, StatusCode::OK);
    let prompt = counted["input_tokens"].as_u64().unwrap();
    assert!(prompt > 0, "{counted}");

    let (status, whole) = r.post("/v1/messages", asked.clone()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!((whole["type"].as_str(), whole["role"].as_str()), (Some("message"), Some("assistant")));
    assert_eq!(whole["content"][0]["type"], "text");
    assert_eq!(whole["stop_reason"], "max_tokens");
    let usage = &whole["usage"];
    assert_eq!(usage["input_tokens"].as_u64().unwrap() + usage["cache_read_input_tokens"].as_u64().unwrap(), prompt);
    assert_eq!(usage["output_tokens"], 3);

    // The same again, streamed: its prompt now read from the cache.
    let mut streamed = asked.clone();
    streamed["stream"] = json!(true);
    let resp = r.send(Method::POST, "/v1/messages", Some("application/json"), streamed.to_string()).await;
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let events = named_events(resp).await;
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    assert!(events.iter().all(|(name, data)| data["type"] == name.as_str()));
    let opening = &events[0].1["message"]["usage"];
    let cached = opening["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(cached + opening["input_tokens"].as_u64().unwrap(), prompt);
    assert!(cached > 0, "{opening}");
    assert_eq!(events[6].1["usage"]["output_tokens"], 3);
    let text: String = events[2..5].iter().map(|(_, d)| d["delta"]["text"].as_str().unwrap()).collect();
    assert_eq!(whole["content"][0]["text"], text, "the same greedy answer");

    let (status, error) = r.post("/v1/messages", json!({"model": "qwen", "max_tokens": 3})).await;
    assert_eq!((status, error["error"]["type"].as_str()), (StatusCode::INTERNAL_SERVER_ERROR, Some("server_error")));

    let asked = json!({"model": "qwen", "max_output_tokens": 2, "instructions": "be brief", "input": "hi"});
    let (status, whole) = r.post("/v1/responses", asked.clone()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!((whole["object"].as_str(), whole["status"].as_str()), (Some("response"), Some("completed")));
    assert_eq!(whole["output"][0]["content"][0]["type"], "output_text");
    assert_eq!(whole["usage"]["output_tokens"], 2);
    let mut streamed = asked.clone();
    streamed["stream"] = json!(true);
    let resp = r.send(Method::POST, "/v1/responses", Some("application/json"), streamed.to_string()).await;
    let events = named_events(resp).await;
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let completed = &events[9].1;
    assert_eq!(completed["response"]["usage"]["total_tokens"], whole["usage"]["total_tokens"]);
    assert!(completed["response"]["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0);
    assert_eq!(completed["response"]["output"][0]["content"][0]["text"], whole["output"][0]["content"][0]["text"]);
    let (status, error) = r.post("/v1/responses", json!({"model": "qwen", "input": 5})).await;
    assert_eq!((status, error["error"]["type"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_request_error")));
    r.stop().await;

    // llama-swap passes all three on to its model's server.
    let r = start(fast(SimConfig::llama_swap(["a"]))).await;
    for (path, body) in [
        ("/v1/messages", json!({"model": "a", "max_tokens": 2, "messages": [user("hi")]})),
        ("/v1/messages/count_tokens", json!({"model": "a", "messages": [user("hi")]})),
        ("/v1/responses", json!({"model": "a", "max_output_tokens": 2, "input": "hi"})),
    ] {
        let (status, answer) = r.post(path, body).await;
        assert_eq!(status, StatusCode::OK, "{path}: {answer}");
    }
    r.stop().await;
}

#[tokio::test]
async fn a_required_tool_call_is_written_after_a_word_and_streamed_as_llama_server_does() {
    let r = start(fast(SimConfig::llama_server("qwen"))).await;
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]});
    let question = [user("What is the weather in Paris?")];

    // Chat: the word as content, then the call's name with its first
    // piece of arguments, the rest, and the call's finish reason.
    let chat = json!({"model": "qwen", "max_tokens": 64, "messages": question, "tool_choice": "required",
                      "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]});
    let (_, whole) = r.post("/v1/chat/completions", chat.clone()).await;
    let choice = &whole["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{whole}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather");
    let arguments: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(arguments["city"].is_string(), "{arguments}");
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let resp = r.send(Method::POST, "/v1/chat/completions", Some("application/json"), streamed.to_string()).await;
    let chunks: Vec<Value> =
        sse_events(resp).await.iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect();
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    let text: String = deltas.iter().filter_map(|d| d["content"].as_str()).collect();
    assert_eq!(choice["message"]["content"], text.as_str(), "the same greedy answer");
    let calls: Vec<&Value> = deltas.iter().filter_map(|d| d["tool_calls"].get(0)).collect();
    assert_eq!(
        (calls[0]["id"].as_str().map(str::len), &calls[0]["function"]["name"]),
        (Some(32), &json!("get_weather"))
    );
    assert!(calls[1..].iter().all(|c| c.get("id").is_none() && c["function"].get("name").is_none()));
    let streamed_arguments: String = calls.iter().map(|c| c["function"]["arguments"].as_str().unwrap()).collect();
    assert_eq!(streamed_arguments, call["function"]["arguments"].as_str().unwrap());
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");

    // Cut at its limit, the call is the limit's.
    let mut cut = chat.clone();
    cut["max_tokens"] = json!(12);
    let (_, whole) = r.post("/v1/chat/completions", cut).await;
    assert_eq!(whole["choices"][0]["finish_reason"], "length", "{whole}");
    assert_eq!(whole["usage"]["completion_tokens"], 12);

    // Messages: a text block, then the tool's block with its input's JSON.
    let messages = json!({"model": "qwen", "max_tokens": 64, "messages": question, "stream": true,
                          "stop_sequences": ["</tool_call>"],
                          "tools": [{"name": "get_weather", "input_schema": schema}],
                          "tool_choice": {"type": "tool", "name": "get_weather"}});
    let resp = r.send(Method::POST, "/v1/messages", Some("application/json"), messages.to_string()).await;
    let events = named_events(resp).await;
    let tool = events.iter().find(|(name, d)| name == "content_block_start" && d["index"] == 1).unwrap();
    assert_eq!(
        (&tool.1["content_block"]["type"], &tool.1["content_block"]["name"]),
        (&json!("tool_use"), &json!("get_weather"))
    );
    let partial: String = events
        .iter()
        .filter(|(_, d)| d["delta"]["type"] == "input_json_delta")
        .map(|(_, d)| d["delta"]["partial_json"].as_str().unwrap())
        .collect();
    assert_eq!(serde_json::from_str::<Value>(&partial).unwrap(), arguments, "the same call, the same prompt");
    let stops = events.iter().filter(|(name, _)| name == "content_block_stop").count();
    let delta = events.iter().find(|(name, _)| name == "message_delta").unwrap();
    assert_eq!((stops, &delta.1["delta"]["stop_reason"]), (2, &json!("tool_use")));
    assert_eq!(delta.1["delta"]["stop_sequence"], "</tool_call>", "the stop sequence the call ended with");

    // Responses: the message's item, then the call's, closed after it.
    let responses = json!({"model": "qwen", "max_output_tokens": 64, "input": "What is the weather in Paris?",
                           "stream": true, "tool_choice": {"type": "function", "name": "get_weather"},
                           "tools": [{"type": "function", "name": "get_weather", "parameters": schema}]});
    let resp = r.send(Method::POST, "/v1/responses", Some("application/json"), responses.to_string()).await;
    let events = named_events(resp).await;
    let items: Vec<(&str, &str)> = events
        .iter()
        .filter(|(name, _)| name.starts_with("response.output_item."))
        .map(|(name, d)| (name.as_str(), d["item"]["type"].as_str().unwrap()))
        .collect();
    assert_eq!(
        items,
        [
            ("response.output_item.added", "message"),
            ("response.output_item.added", "function_call"),
            ("response.output_item.done", "message"),
            ("response.output_item.done", "function_call"),
        ]
    );
    let output = &events.last().unwrap().1["response"]["output"];
    assert_eq!((&output[1]["name"], &output[1]["status"]), (&json!("get_weather"), &json!("completed")));
    r.stop().await;
}

#[tokio::test]
async fn a_call_sent_back_extends_the_prompt_that_made_it() {
    let r = start(fast(SimConfig::llama_server("qwen"))).await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let mut messages = vec![user("What is the weather in Paris?")];
    let asked =
        json!({"model": "qwen", "max_tokens": 64, "messages": messages, "tools": tools, "tool_choice": "required"});
    let (_, first) = r.post("/v1/chat/completions", asked).await;
    let message = first["choices"][0]["message"].clone();
    let written =
        first["usage"]["prompt_tokens"].as_u64().unwrap() + first["usage"]["completion_tokens"].as_u64().unwrap();
    messages.push(message);
    messages.push(json!({"role": "tool", "tool_call_id": "x", "content": "Sunny."}));
    let (_, next) =
        r.post("/v1/chat/completions", json!({"model": "qwen", "max_tokens": 2, "messages": messages})).await;
    // All the first turn's prompt and answer is cached, but the answer's last
    // token, which never entered the cache.
    assert_eq!(next["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(), written - 1, "{next}");

    // The same of the Responses API, whose output is a message and the call
    // apart: sent back as they came, they are the turn the model wrote.
    let tools = json!([{"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let question = json!({"role": "user", "content": "And in Rome?"});
    let asked = json!({"model": "qwen", "max_output_tokens": 64, "input": [question], "tools": tools,
                       "tool_choice": "required"});
    let (_, first) = r.post("/v1/responses", asked).await;
    let usage = &first["usage"];
    let written = usage["input_tokens"].as_u64().unwrap() + usage["output_tokens"].as_u64().unwrap();
    let output = first["output"].as_array().unwrap();
    let call_id = output[1]["call_id"].clone();
    let mut input = vec![question];
    input.extend(output.iter().cloned());
    input.push(json!({"type": "function_call_output", "call_id": call_id, "output": "Sunny."}));
    let (_, next) = r.post("/v1/responses", json!({"model": "qwen", "max_output_tokens": 2, "input": input})).await;
    assert_eq!(next["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap(), written - 1, "{next}");
    r.stop().await;
}

#[tokio::test]
async fn llama_swap_mode() {
    let mut cfg = fast(SimConfig::llama_swap(["a", "b"]));
    // Slow enough that the held stream below stays in flight.
    cfg.decode_tokens_per_second = 1000.0;
    cfg.preload = vec!["a".into()];
    cfg.concurrency_limit = 1;
    cfg.slots = 1;
    let r = start(cfg).await;

    let (status, _, body) = r.raw(Method::GET, "/health", None, Bytes::new()).await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"OK"[..]));
    let (_, v) = r.get("/v1/models").await;
    assert_eq!(v["data"][0]["id"], "a");
    assert_eq!(v["data"][0]["owned_by"], "llama-swap");
    assert_eq!(v["data"][0]["status"]["value"], "loaded");
    assert_eq!(v["data"][1]["status"]["value"], "unloaded");

    let (status, v) = r.post("/v1/chat/completions", json!({"model": "zzz", "messages": [user("hi")]})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        v,
        json!({"src": "llama-swap", "error": {
            "message": "could not find suitable inference handler for zzz",
            "type": "invalid_request_error", "param": null, "code": "model_not_found"}})
    );
    // Without a JSON content type the model is not read.
    let body = json!({"model": "a", "messages": [user("hi")]}).to_string();
    let (status, _, _) = r.raw(Method::POST, "/v1/chat/completions", Some("text/plain"), body).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // A request for b loads it and unloads a (max_loaded_models = 1).
    let (status, v) = r.post("/v1/chat/completions", json!({"model": "b", "messages": [user("hi")]})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["model"], "b");
    let (_, v) = r.get("/v1/models").await;
    assert_eq!(v["data"][0]["status"]["value"], "unloaded");
    assert_eq!(v["data"][1]["status"]["value"], "loaded");
    let (_, v) = r.get("/running").await;
    assert_eq!(v, json!({"running": [{"model": "b", "state": "ready"}]}));
    let (status, _, body) = r.raw(Method::GET, "/upstream/b/metrics", None, Bytes::new()).await;
    assert_eq!(status, StatusCode::OK);
    assert!(String::from_utf8_lossy(&body).contains("llamacpp:tokens_predicted_total 16"));

    // A second concurrent request to b exceeds its limit of 1.
    let held = r
        .send(
            Method::POST,
            "/v1/chat/completions",
            Some("application/json"),
            json!({"model": "b", "messages": [user("hi")], "max_tokens": 1_000_000, "stream": true}).to_string(),
        )
        .await;
    let (status, headers, body) = r
        .raw(
            Method::POST,
            "/v1/chat/completions",
            Some("application/json"),
            json!({"model": "b", "messages": [user("hi")]}).to_string(),
        )
        .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["retry-after"], "1");
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "concurrency_limit");
    assert_eq!(v["src"], "llama-swap");
    r.stop().await;
    drop(held);
}

#[test]
fn config_parsing_and_validation() {
    let cfg: SimConfig = serde_json::from_value(json!({
        "mode": "llama-swap",
        "models": [{"id": "a"}, {"id": "e", "embedding": true}],
        "gpu": {"name": "H200"},
    }))
    .unwrap();
    assert_eq!(cfg.mode, SimMode::LlamaSwap);
    assert_eq!(cfg.slots, 4);
    assert_eq!(cfg.context, 4096);
    assert_eq!(cfg.cache_ram_tokens, 65536);
    assert_eq!(cfg.gpu.memory_total_bytes, 24 << 30);
    assert_eq!(cfg.gpu.kv_bytes_per_token, 131_072);
    assert_eq!(cfg.models[0].size_bytes, 4 << 30);
    assert_eq!(cfg.models[1].embedding_dim, 384);
    assert!(Simulator::new(cfg).is_ok());

    assert!(serde_json::from_value::<SimConfig>(json!({"models": [], "bogus": 1})).is_err());
    let two = SimConfig { mode: SimMode::LlamaServer, ..SimConfig::llama_swap(["a", "b"]) };
    let err = Simulator::new(two).unwrap_err();
    assert!(matches!(err, SimError::LlamaServerModelCount(2)));
    assert!(err.to_string().contains("llama-swap"));
    let mut bad = SimConfig::llama_server("a");
    bad.decode_tokens_per_second = 0.0;
    assert!(matches!(Simulator::new(bad), Err(SimError::InvalidRate { .. })));
    let mut bad = SimConfig::llama_swap(["a"]);
    bad.preload = vec!["b".into()];
    assert!(matches!(Simulator::new(bad), Err(SimError::UnknownPreload(_))));
    let mut bad = SimConfig::llama_server("a");
    bad.context = 2;
    assert!(matches!(Simulator::new(bad), Err(SimError::ContextTooSmall { .. })));
}

#[tokio::test]
async fn a_router_loads_a_model_asked_for_but_never_one_asked_about_without_autoload() {
    let router = SimConfig {
        mode: SimMode::LlamaServerRouter,
        preload: vec!["a".into()],
        max_loaded_models: 1,
        ..fast(SimConfig::llama_swap(["a", "b"]))
    };
    let r = start(router).await;
    let json_of = |body: &Bytes| serde_json::from_slice::<Value>(body).unwrap();
    let states = || async {
        let (_, _, body) = r.raw(Method::GET, "/v1/models", None, Bytes::new()).await;
        json_of(&body)["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["status"]["value"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    let (status, _, body) = r.raw(Method::GET, "/props", None, Bytes::new()).await;
    assert_eq!(
        (status, json_of(&body)["role"].as_str(), json_of(&body)["max_instances"].as_u64()),
        (StatusCode::OK, Some("router"), Some(1))
    );
    assert_eq!(states().await, ["loaded", "unloaded"]);

    // Asked about without autoload: llama-server's refusal, nothing loaded.
    for path in ["/props?model=b&autoload=false", "/slots?model=b&autoload=false"] {
        let (status, _, body) = r.raw(Method::GET, path, None, Bytes::new()).await;
        assert_eq!(
            (status, json_of(&body)["error"]["message"].as_str()),
            (StatusCode::BAD_REQUEST, Some("model is not loaded"))
        );
    }
    let (status, _, body) = r.raw(Method::POST, "/infill?autoload=false", None, r#"{"model":"b"}"#).await;
    assert_eq!(
        (status, json_of(&body)["error"]["message"].as_str()),
        (StatusCode::BAD_REQUEST, Some("model is not loaded"))
    );
    assert_eq!(states().await, ["loaded", "unloaded"]);
    // A loaded model without FIM tokens: 501.
    let (status, _, _) = r.raw(Method::POST, "/infill?autoload=false", None, r#"{"model":"a"}"#).await;
    assert_eq!(status, StatusCode::NOT_IMPLEMENTED);

    // A request names b: loaded, a unloaded; any content type will do.
    let chat = r#"{"model":"b","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}"#;
    let (status, _, _) = r.raw(Method::POST, "/v1/chat/completions", Some("text/plain"), chat).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(states().await, ["unloaded", "loaded"]);
    let (status, _, body) =
        r.raw(Method::POST, "/v1/chat/completions", None, r#"{"model":"nope","messages":[]}"#).await;
    assert_eq!(
        (status, json_of(&body)["error"]["message"].as_str()),
        (StatusCode::BAD_REQUEST, Some("model 'nope' not found"))
    );
    let (status, _, body) = r.raw(Method::POST, "/v1/chat/completions", None, r#"{"messages":[]}"#).await;
    assert_eq!(
        (status, json_of(&body)["error"]["message"].as_str()),
        (StatusCode::BAD_REQUEST, Some("model name is missing from the request"))
    );
}
