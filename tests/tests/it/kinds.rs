//! Every kind of job as a row of one table, against the simulator: uploads
//! routed by their form's model and forwarded byte for byte, images and
//! speech behind llama-swap, llama-server's router mode read and routed
//! cold, and the Messages API's keys and errors in Anthropic's shape.

use std::time::Duration;

use http::{Method, StatusCode};
use inferyes_dataplane::auth::AuthMode;
use inferyes_proto::v1::{CreateKeyRequest, ModelState};
use inferyes_sim::{SimConfig, SimJob, SimMode, SimModel};
use serde_json::json;

use crate::support::{Fleet, chat_body, chat_sim, create_key, state_of};

/// A llama-swap fronting a chat model, whisper, a speech server and a
/// stable-diffusion server, all loaded.
fn media_swap() -> SimConfig {
    let models = vec![
        SimModel::chat("alpha"),
        SimModel::doing("whisper", SimJob::Transcription),
        SimModel::doing("voice", SimJob::Speech),
        SimModel::doing("sd", SimJob::Images),
    ];
    let preload = models.iter().map(|m| m.id.clone()).collect();
    SimConfig { models, preload, max_loaded_models: 4, ..SimConfig::llama_swap(["alpha"]) }
}

/// A multipart form, the file part before the model as some clients send
/// it.
fn upload(model: Option<&str>, file: &[u8]) -> Vec<u8> {
    let mut body = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n".to_vec();
    body.extend_from_slice(b"Content-Type: audio/wav\r\n\r\n");
    body.extend_from_slice(file);
    if let Some(model) = model {
        body.extend_from_slice(
            format!("\r\n--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}").as_bytes(),
        );
    }
    body.extend_from_slice(b"\r\n--XyZ--\r\n");
    body
}

const FORM: (&str, &str) = ("content-type", "multipart/form-data; boundary=XyZ");

#[tokio::test]
async fn uploads_are_routed_by_their_form_s_model_and_forwarded_byte_for_byte() {
    let fleet = Fleet::start(vec![chat_sim("elsewhere"), media_swap()]).await;
    let file: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let body = upload(Some("whisper"), &file);
    let url = fleet.url("/v1/audio/transcriptions");
    let answer = fleet.http.send(Method::POST, &url, body.clone().into(), &[FORM]).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", String::from_utf8_lossy(&answer.body));
    assert_eq!(answer.header("x-inferyes-node"), Some("node-b"));
    // The whisper server saw every byte the client sent.
    let text = answer.json()["text"].as_str().unwrap().to_string();
    assert!(text.ends_with(&format!("of {} bytes", body.len())), "{text}");

    let edit = upload(Some("sd"), b"\x89PNG");
    let edited = fleet.http.send(Method::POST, &fleet.url("/v1/images/edits"), edit.into(), &[FORM]).await;
    assert_eq!(edited.status, StatusCode::OK);
    assert!(edited.json()["data"][0]["b64_json"].is_string());

    let drawn =
        fleet.http.post_json(&fleet.url("/v1/images/generations"), &json!({"model": "sd", "prompt": "a cat"})).await;
    assert_eq!(drawn.status, StatusCode::OK);
    let spoken = fleet.http.post_json(&fleet.url("/v1/audio/speech"), &json!({"model": "voice", "input": "hi"})).await;
    assert_eq!((spoken.status, spoken.header("content-type")), (StatusCode::OK, Some("audio/wav")));
    assert!(spoken.body.starts_with(b"RIFF"));

    // Refused before any node sees them, in OpenAI's shape.
    let no_model = fleet.http.send(Method::POST, &url, upload(None, b"x").into(), &[FORM]).await;
    assert_eq!(no_model.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        (no_model.openai_error()["code"].as_str(), no_model.openai_error()["param"].as_str()),
        (Some("missing_required_parameter"), Some("model"))
    );
    let unknown = fleet.http.send(Method::POST, &url, upload(Some("nope"), b"x").into(), &[FORM]).await;
    assert_eq!(
        (unknown.status, unknown.openai_error()["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("model_not_found"))
    );
    let not_a_form = fleet.http.send(Method::POST, &url, body.into(), &[("content-type", "application/json")]).await;
    assert_eq!(
        (not_a_form.status, not_a_form.openai_error()["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_body"))
    );
    // The query is not for the form's server to read a second model from.
    let queried = fleet.url("/v1/audio/transcriptions?model=voice");
    let queried = fleet.http.send(Method::POST, &queried, upload(Some("whisper"), b"x").into(), &[FORM]).await;
    assert_eq!(
        (queried.status, queried.openai_error()["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_path"))
    );
    let cut = upload(Some("whisper"), b"x");
    let cut = fleet.http.send(Method::POST, &url, cut[..cut.len() - 12].to_vec().into(), &[FORM]).await;
    assert_eq!(cut.status, StatusCode::BAD_REQUEST);
    // A backend that lists no kinds is tried with any: a llama-server has
    // no such path, and says so.
    let chat = fleet.http.send(Method::POST, &url, upload(Some("elsewhere"), b"x").into(), &[FORM]).await;
    assert_eq!((chat.status, chat.openai_error()["code"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")));
}

#[tokio::test]
async fn a_router_s_unloaded_models_are_cold_and_a_request_for_one_loads_it() {
    let router = SimConfig {
        mode: SimMode::LlamaServerRouter,
        models: vec![SimModel::chat("alpha"), SimModel::chat("beta")],
        preload: vec!["alpha".into()],
        max_loaded_models: 1,
        load_delay_ms: 300,
        ..chat_sim("alpha")
    };
    let fleet = Fleet::start(vec![router]).await;
    fleet
        .dataplane
        .wait_for("alpha warm, beta cold", Duration::from_secs(5), |_| {
            state_of(&fleet, "alpha") == Some(ModelState::Loaded)
                && state_of(&fleet, "beta") == Some(ModelState::Unloaded)
        })
        .await;
    let models = fleet.http.get(&fleet.url("/v1/models/beta")).await.json();
    assert_eq!(models["inferyes"]["state"], "cold");

    let response = fleet.http.post_json(&fleet.url("/v1/chat/completions"), &chat_body("beta", "hi")).await;
    assert_eq!(response.status, StatusCode::OK, "{}", String::from_utf8_lossy(&response.body));
    assert_eq!(response.header("x-inferyes-route"), Some("cold"));
    // One model at a time: beta's load unloaded alpha.
    fleet
        .dataplane
        .wait_for("beta warm, alpha cold", Duration::from_secs(5), |_| {
            state_of(&fleet, "beta") == Some(ModelState::Loaded)
                && state_of(&fleet, "alpha") == Some(ModelState::Unloaded)
        })
        .await;
    // Streamed, a request for alpha is told its load unloads another model.
    let streaming = json!({"model": "alpha", "stream": true, "max_tokens": 2,
                           "messages": [{"role": "user", "content": "hi"}]});
    let started =
        fleet.http.start(Method::POST, &fleet.url("/v1/chat/completions"), streaming.to_string().into(), &[]).await;
    assert_eq!(started.headers()["x-inferyes-route"], "cold");
    let mut body = started.into_body();
    let first = inferyes_tests::client::next_chunk(&mut body).await.expect("a note");
    let note = String::from_utf8_lossy(&first);
    assert!(
        note.starts_with(": loading model alpha on node node-a, unloading the model it used least lately"),
        "{note}"
    );
    while inferyes_tests::client::next_chunk(&mut body).await.is_some() {}
    let node = fleet
        .controller()
        .fleet()
        .await
        .get_node(inferyes_proto::v1::GetNodeRequest { node_id: "node-a".into() })
        .await
        .unwrap()
        .into_inner();
    let backend = &node.status.unwrap().backends[0];
    assert_eq!((backend.kind(), backend.models_max), (inferyes_proto::v1::BackendKind::LlamaServerRouter, 1));
    // Infill: the router's models have no FIM tokens, which its agent asked
    // of the loaded one.
    let infill = json!({"model": "beta", "input_prefix": "def f(", "input_suffix": ")"});
    fleet
        .dataplane
        .wait_for("beta known not to infill", Duration::from_secs(5), |s| {
            s.placements("beta").is_some_and(|p| p[0].unsupported.contains(&inferyes_proto::v1::EndpointKind::Infill))
        })
        .await;
    let refused = fleet.http.post_json(&fleet.url("/infill"), &infill).await;
    assert_eq!(
        (refused.status, refused.openai_error()["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("unsupported_endpoint"))
    );
}

#[tokio::test]
async fn the_messages_api_takes_the_key_as_anthropic_s_clients_send_it_and_answers_in_their_shape() {
    let fleet = Fleet::start_with(vec![chat_sim("chat")], |config| config.auth = AuthMode::Keys).await;
    let (_, secret) = create_key(&fleet, CreateKeyRequest { name: "claude".into(), ..Default::default() }).await;
    let message =
        json!({"model": "chat", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let url = fleet.url("/v1/messages");

    let missing = fleet.http.send(Method::POST, &url, message.clone().into(), &[]).await;
    assert_eq!(missing.status, StatusCode::UNAUTHORIZED);
    let body = missing.json();
    assert_eq!(
        (body["type"].as_str(), body["error"]["type"].as_str()),
        (Some("error"), Some("authentication_error")),
        "{body}"
    );
    assert!(body["error"].get("code").is_none(), "Anthropic's errors have no code: {body}");

    // The key in x-api-key is the fleet's.
    let keyed = fleet.http.send(Method::POST, &url, message.clone().into(), &[("x-api-key", &secret)]).await;
    let body = keyed.json();
    assert_eq!((keyed.status, body["type"].as_str()), (StatusCode::OK, Some("message")), "{body}");
    // A node's own error reaches the client in Anthropic's shape too.
    let bad = json!({"model": "chat", "max_tokens": "four", "messages": [{"role": "user", "content": "hi"}]});
    let refused = fleet.http.send(Method::POST, &url, bad.to_string().into(), &[("x-api-key", &secret)]).await;
    let body = refused.json();
    assert_eq!(
        (refused.status, body["type"].as_str(), body["error"]["type"].as_str()),
        (StatusCode::BAD_REQUEST, Some("error"), Some("invalid_request_error")),
        "{body}"
    );
    let wrong_method = fleet.http.send(Method::GET, &url, bytes::Bytes::new(), &[("x-api-key", &secret)]).await;
    assert_eq!(
        (wrong_method.status, wrong_method.json()["type"].as_str()),
        (StatusCode::METHOD_NOT_ALLOWED, Some("error"))
    );

    // The OpenAI paths take x-api-key too, and keep their own shape.
    let chat = fleet
        .http
        .send(
            Method::POST,
            &fleet.url("/v1/chat/completions"),
            chat_body("chat", "hi").to_string().into(),
            &[("x-api-key", &secret)],
        )
        .await;
    assert_eq!(chat.status, StatusCode::OK);
    let unknown =
        fleet.http.send(Method::POST, &fleet.url("/v1/nope"), bytes::Bytes::new(), &[("x-api-key", &secret)]).await;
    assert_eq!((unknown.status, unknown.openai_error()["code"].as_str()), (StatusCode::NOT_FOUND, Some("unknown_url")));
}
