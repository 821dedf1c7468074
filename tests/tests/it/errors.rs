use bytes::Bytes;
use http::{Method, StatusCode};
use serde_json::json;

use crate::support::{Fleet, chat_body, chat_sim};

#[tokio::test]
async fn every_error_is_openai_shaped_with_the_right_status() {
    let fleet = Fleet::start_with(vec![chat_sim("chat")], |config| config.max_body_bytes = 4096).await;
    let chat_url = fleet.url("/v1/chat/completions");
    let post = |body: &'static [u8]| {
        let http = fleet.http.clone();
        let url = chat_url.clone();
        async move { http.send(Method::POST, &url, Bytes::from_static(body), &[]).await }
    };

    let unknown = fleet.http.post_json(&chat_url, &chat_body("no-such-model", "hi")).await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    let error = unknown.openai_error();
    assert_eq!(error["code"], "model_not_found");
    assert_eq!(error["param"], "model");
    assert!(error["message"].as_str().unwrap().contains("available models: chat"), "{error}");

    let malformed = post(b"{\"model\": \"chat\", \"messages\": [").await;
    assert_eq!(malformed.status, StatusCode::BAD_REQUEST);
    assert_eq!(malformed.openai_error()["type"], "invalid_request_error");

    let not_object = post(b"[1, 2, 3]").await;
    assert_eq!(not_object.status, StatusCode::BAD_REQUEST);
    not_object.openai_error();

    let no_model = post(b"{\"messages\": []}").await;
    assert_eq!(no_model.status, StatusCode::BAD_REQUEST);
    assert_eq!(no_model.openai_error()["param"], "model");

    let big = json!({"model": "chat", "messages": [{"role": "user", "content": "x".repeat(8000)}]});
    let too_large = fleet.http.post_json(&chat_url, &big).await;
    assert_eq!(too_large.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(too_large.openai_error()["code"], "request_too_large");

    let unknown_path = fleet.http.get(&fleet.url("/v1/nope")).await;
    assert_eq!(unknown_path.status, StatusCode::NOT_FOUND);
    unknown_path.openai_error();

    let wrong_method = fleet.http.get(&chat_url).await;
    assert_eq!(wrong_method.status, StatusCode::METHOD_NOT_ALLOWED);
    wrong_method.openai_error();

    // A percent-escape that is no UTF-8.
    let bad_id = fleet.http.get(&fleet.url("/v1/models/%FF")).await;
    assert_eq!(bad_id.status, StatusCode::BAD_REQUEST);
    assert_eq!(bad_id.openai_error()["code"], "invalid_path");

    // Every error response still names the request: a client's own id
    // when it sent one, on the inference path and the others alike.
    for response in [&unknown, &malformed, &too_large, &unknown_path] {
        assert!(response.header("x-request-id").is_some());
    }
    for (method, path) in [(Method::POST, "/v1/chat/completions"), (Method::GET, "/v1/nope")] {
        let url = fleet.url(path);
        let response = fleet.http.send(method, &url, Bytes::from_static(b"{}"), &[("x-request-id", "client-7")]).await;
        assert_eq!(response.header("x-request-id"), Some("client-7"), "{path}");
    }
    // Nothing above reached the backend.
    assert_eq!(fleet.sims[0].sim.stats().requests, 0);
}

#[tokio::test]
async fn backend_errors_are_rewritten_into_the_openai_shape() {
    let small = inferyes_sim::SimConfig { context: 256, slots: 1, ..chat_sim("chat") };
    let fleet = Fleet::start(vec![small]).await;
    // Small enough for the gateway's estimate, too long for the server: the
    // server's own error, reshaped.
    let long = "a ".repeat(300);
    let overflow = fleet.http.post_json(&fleet.url("/v1/chat/completions"), &chat_body("chat", &long)).await;
    assert_eq!(overflow.status, StatusCode::BAD_REQUEST);
    let error = overflow.openai_error();
    assert_eq!(error["code"], "context_length_exceeded");
    // llama-server's wording, not the gateway's.
    assert!(error["message"].as_str().unwrap().contains("exceeds the available context size"), "{error}");

    // Far too long by the gateway's estimate too: still the server's count
    // decides, as the estimate may be high for the model's tokenizer.
    let huge = "word ".repeat(2000);
    let refused = fleet.http.post_json(&fleet.url("/v1/chat/completions"), &chat_body("chat", &huge)).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    let error = refused.openai_error();
    assert_eq!(error["code"], "context_length_exceeded");
    assert!(error["message"].as_str().unwrap().contains("exceeds the available context size"), "{error}");

    // Past the window even at 128 bytes a token, no tokenizer can fit it:
    // refused without a node tokenizing it.
    let past_any = "word ".repeat(256 * 128 / 5 + 1_000);
    let refused = fleet.http.post_json(&fleet.url("/v1/chat/completions"), &chat_body("chat", &past_any)).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    let error = refused.openai_error();
    assert_eq!((error["code"].as_str(), error["param"].as_str()), (Some("context_length_exceeded"), Some("messages")));
    assert!(error["message"].as_str().unwrap().contains("for any tokenizer"), "{error}");

    // A chat model asked for embeddings: llama-server's 501, reshaped.
    let embeddings = fleet.http.post_json(&fleet.url("/v1/embeddings"), &json!({"model": "chat", "input": "x"})).await;
    assert_eq!(embeddings.status, StatusCode::NOT_IMPLEMENTED, "{}", String::from_utf8_lossy(&embeddings.body));
    assert_eq!(embeddings.openai_error()["code"], "unsupported_endpoint");
}

#[tokio::test]
async fn a_body_that_does_not_arrive_in_time_gets_an_openai_shaped_408() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fleet = Fleet::start_with(vec![chat_sim("chat")], |config| config.request_body_timeout_ms = 300).await;
    let address = fleet.dataplane.url.trim_start_matches("http://").to_string();
    let mut client = tokio::net::TcpStream::connect(address).await.expect("the data plane");
    // Its head, and ten bytes of the hundred it announces.
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: dp\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n";
    client.write_all(format!("{head}{{\"model\":\"").as_bytes()).await.expect("sent");
    let mut answer = Vec::new();
    let read = tokio::time::timeout(std::time::Duration::from_secs(10), client.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the data plane answered and closed");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"code\":\"request_timeout\""), "{answer}");
    assert_eq!(fleet.sims[0].sim.stats().requests, 0);
}

/// Bodies read whole are held against one budget, all requests together:
/// one that would pass it gets an OpenAI-shaped 503, and the budget comes
/// back when the holder is done. Both sides: a request body a client is
/// still sending, and a whole answer read from a node.
#[tokio::test]
async fn bodies_past_the_data_plane_s_buffer_budget_get_503_and_the_budget_comes_back() {
    use tokio::io::AsyncWriteExt;
    let fleet = Fleet::start_with(vec![chat_sim("chat")], |config| {
        config.max_body_bytes = 3000;
        config.max_buffered_bytes = 3000;
    })
    .await;
    let url = format!("{}/v1/chat/completions", fleet.dataplane.url);
    let padded = |bytes: usize| {
        let mut body = chat_body("chat", "hi");
        body["pad"] = json!("x".repeat(bytes));
        body
    };
    // A client sending 2,400 bytes of a body, slowly: they are held.
    let address = fleet.dataplane.url.trim_start_matches("http://").to_string();
    let mut slow = tokio::net::TcpStream::connect(address).await.expect("the data plane");
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: dp\r\ncontent-type: application/json\r\ncontent-length: 2600\r\n\r\n";
    slow.write_all(format!("{head}{{\"model\":\"chat\",\"pad\":\"{}", "x".repeat(2400)).as_bytes()).await.unwrap();
    // Once the data plane holds them (its metrics say so)...
    let metrics = format!("{}/metrics", fleet.dataplane.admin_url);
    inferyes_tests::eventually("the slow body held", std::time::Duration::from_secs(10), || async {
        let text = String::from_utf8_lossy(&fleet.http.get(&metrics).await.body).into_owned();
        let held =
            text.lines().find_map(|l| l.strip_prefix("inferyes_dataplane_buffered_bytes ")?.trim().parse::<u64>().ok());
        held.is_some_and(|bytes| bytes >= 2400)
    })
    .await;
    // ...another request of 1,000 bytes would pass the 3,000 it may hold.
    let response = fleet.http.post_json(&url, &padded(1000)).await;
    assert_eq!(response.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.openai_error()["code"], "overloaded");
    assert_eq!(response.header("retry-after"), Some("1"));
    drop(slow);
    let served = inferyes_tests::eventually("the budget back", std::time::Duration::from_secs(10), || async {
        fleet.http.post_json(&url, &padded(1000)).await.status == StatusCode::OK
    });
    served.await;
    // A whole answer longer than the budget (this one, about 3,500 bytes)
    // is refused too, not held.
    let long = json!({"model": "chat", "max_tokens": 2000, "messages": [{"role": "user", "content": "go on"}]});
    let response = fleet.http.post_json(&url, &long).await;
    assert_eq!(response.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&response.body));
    assert_eq!(response.openai_error()["code"], "overloaded");
}

/// Past `max_connections` a new connection is told so, OpenAI-shaped, and
/// closed; once one closes, a new one is served again.
#[tokio::test]
async fn connections_past_the_limit_get_503_and_room_comes_back() {
    use tokio::io::AsyncReadExt;
    let fleet = Fleet::start_with(vec![chat_sim("chat")], |config| config.max_connections = 2).await;
    let address = fleet.dataplane.url.trim_start_matches("http://").to_string();
    let connect = || tokio::net::TcpStream::connect(address.clone());
    // Two connections held open, idle: the limit.
    let (first, _second) = (connect().await.unwrap(), connect().await.unwrap());
    // The acceptor takes connections in order: by the third, it counts two.
    use tokio::io::AsyncWriteExt;
    let mut third = connect().await.unwrap();
    third.write_all(b"GET /healthz HTTP/1.1\r\nhost: dp\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(std::time::Duration::from_secs(5), third.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "refused and closed at once");
    let refusal = String::from_utf8_lossy(&answer).into_owned();
    assert!(refusal.starts_with("HTTP/1.1 503 Service Unavailable"), "{refusal}");
    assert!(refusal.contains("retry-after: 1") && refusal.contains("\"code\":\"overloaded\""), "{refusal}");
    drop(first);
    let url = format!("{}/v1/chat/completions", fleet.dataplane.url);
    inferyes_tests::eventually("room again", std::time::Duration::from_secs(10), || async {
        fleet.http.post_json(&url, &chat_body("chat", "hi")).await.status == StatusCode::OK
    })
    .await;
}

#[tokio::test]
async fn members_that_reach_into_the_shared_server_are_refused_before_it_sees_them() {
    let fleet = Fleet::start(vec![chat_sim("chat")]).await;
    let chat_url = fleet.url("/v1/chat/completions");
    let refused = |body: serde_json::Value, param: &'static str| {
        let (http, url) = (fleet.http.clone(), chat_url.clone());
        async move {
            let response = http.post_json(&url, &body).await;
            assert_eq!(response.status, StatusCode::BAD_REQUEST, "{body}");
            let error = response.openai_error();
            assert_eq!((error["code"].as_str(), error["param"].as_str()), (Some("unsupported_parameter"), Some(param)));
            error["message"].as_str().unwrap_or_default().to_string()
        }
    };
    let chat = |extra: serde_json::Value| {
        let mut body = chat_body("chat", "hi");
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    // A slot of the client's choosing would evict whoever's cache is there.
    assert!(refused(chat(json!({"id_slot": 3})), "id_slot").await.contains("evicting"));
    refused(chat(json!({"slot_id": 0})), "slot_id").await;
    refused(chat(json!({"n_probs": 1000})), "n_probs").await;
    refused(chat(json!({"repeat_last_n": 2_000_000_000})), "repeat_last_n").await;
    refused(chat(json!({"max_tokens": -1})), "max_tokens").await;
    refused(chat(json!({"chat_parser": "x"})), "chat_parser").await;
    // More choices take more slots; a huge grammar is compiled and run at
    // every token.
    assert!(refused(chat(json!({"n": 8})), "n").await.contains("slot"));
    refused(chat(json!({"grammar": "root ::= ".to_string() + &"\"a\" ".repeat(20_000)})), "grammar").await;
    refused(chat(json!({"stop": vec!["x"; 17]})), "stop").await;
    refused(chat(json!({"stop": "x".repeat(5_000)})), "stop").await;
    let tool = json!({"type": "function", "function": {"name": "f", "description": "d".repeat(300_000)}});
    refused(chat(json!({"tools": [tool]})), "tools").await;
    // Several prompts are a task of the server's each.
    let prompts = json!({"model": "chat", "prompt": ["once", "twice"], "max_tokens": 4});
    let (http, url) = (fleet.http.clone(), fleet.url("/v1/completions"));
    let several = http.post_json(&url, &prompts).await;
    assert_eq!(several.status, StatusCode::BAD_REQUEST);
    assert_eq!(several.openai_error()["param"].as_str(), Some("prompt"));
    // Media the server would fetch from inside the fleet's network.
    let image = json!({"model": "chat", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}}]}]});
    assert!(refused(image, "messages").await.contains("169.254.169.254"));
    assert_eq!(fleet.sims[0].sim.stats().requests, 0, "none of them reached the server");

    // Within their bounds they go on.
    let fine = fleet
        .http
        .post_json(&chat_url, &chat(json!({"n_probs": 5, "max_tokens": 4, "cache_prompt": false, "n": 1})))
        .await;
    assert_eq!(fine.status, StatusCode::OK, "{}", String::from_utf8_lossy(&fine.body));
}
