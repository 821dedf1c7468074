//! llama-server with one model: what it says of itself (`/health`,
//! `/v1/models`, `/props`, `/slots`, `/metrics`), in its own shapes.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde_json::{Value, json};

use super::{BUILD_INFO, Shared, json_response, server_not_found};
use crate::engine::Engine;
use crate::tokens::CHATML_TEMPLATE;
use crate::{Backend, Inner};

pub(super) async fn health() -> Response {
    json_response(StatusCode::OK, json!({"status": "ok"}))
}

pub(super) fn server_engine(s: &Inner) -> Option<&Arc<Engine>> {
    match &s.backend {
        Backend::Server(e) => Some(e),
        Backend::Swap(_) => None,
    }
}

pub(super) async fn server_models(State(s): State<Shared>) -> Response {
    let Some(engine) = server_engine(&s) else {
        return server_not_found().await;
    };
    let m = engine.model();
    let meta = json!({
        "vocab_type": 1,
        "n_vocab": 32000,
        "n_ctx_train": s.config.context,
        "n_embd": m.embedding_dim,
        // Roughly two bytes per parameter, as for f16 weights.
        "n_params": m.size_bytes / 2,
        "size": m.size_bytes,
    });
    json_response(
        StatusCode::OK,
        json!({
            "models": [{
                "name": m.id, "model": m.id, "modified_at": "", "size": "", "digest": "",
                "type": "model", "description": "", "tags": [""], "capabilities": ["completion"],
                "parameters": "",
                "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                            "parameter_size": "", "quantization_level": ""},
            }],
            "object": "list",
            "data": [{
                "id": m.id, "object": "model", "created": s.created, "owned_by": "llamacpp",
                "meta": meta,
            }],
        }),
    )
}

pub(super) fn props_body(s: &Inner, engine: &Engine) -> Value {
    let p = engine.params();
    json!({
        "default_generation_settings": {
            "id": 0,
            "id_task": -1,
            "n_ctx": p.n_ctx_slot,
            "is_processing": false,
            "params": {
                "n_predict": -1,
                "seed": 4_294_967_295u64,
                "temperature": 0.8,
                "top_k": 40,
                "top_p": 0.95,
                "min_p": 0.05,
                "stream": false,
                "cache_prompt": true,
            },
        },
        "total_slots": p.slots,
        "model_alias": engine.model().id,
        "model_path": format!("/models/{}.gguf", engine.model().id),
        "chat_template": CHATML_TEMPLATE,
        "modalities": {"vision": false, "audio": false},
        "is_sleeping": false,
        "build_info": BUILD_INFO,
        "embedding": engine.model().embedding,
        "n_ctx_train": s.config.context,
    })
}

pub(super) async fn props(State(s): State<Shared>) -> Response {
    match server_engine(&s) {
        Some(e) => json_response(StatusCode::OK, props_body(&s, e)),
        None => server_not_found().await,
    }
}

pub(super) fn slots_body(engine: &Engine) -> Value {
    let views = engine.slot_views();
    Value::Array(
        views
            .into_iter()
            .map(|v| {
                json!({
                    "id": v.id,
                    "n_ctx": v.n_ctx,
                    "speculative": false,
                    "is_processing": v.is_processing,
                    "id_task": v.id_task.map_or(-1, |t| t as i64),
                    "n_prompt_tokens": v.n_prompt_tokens,
                    "n_prompt_tokens_processed": v.n_prompt_tokens_processed,
                    "n_prompt_tokens_cache": v.n_prompt_tokens_cache,
                    "params": {"n_predict": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95},
                    "next_token": [{
                        "has_next_token": v.is_processing,
                        "has_new_line": false,
                        "n_remain": v.n_remain,
                        "n_decoded": v.n_decoded,
                    }],
                })
            })
            .collect(),
    )
}

pub(super) async fn slots(State(s): State<Shared>) -> Response {
    match server_engine(&s) {
        Some(e) => json_response(StatusCode::OK, slots_body(e)),
        None => server_not_found().await,
    }
}

pub(super) fn metrics_text(engine: &Engine) -> String {
    let m = engine.metrics();
    let ratio = |num: f64, den: f64| if den > 0.0 { num / den } else { 0.0 };
    let series: [(&str, &str, &str, f64); 12] = [
        ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", m.prompt_tokens_total as f64),
        (
            "prompt_tokens_cached_total",
            "counter",
            "Number of prompt tokens reused from cache.",
            m.prompt_tokens_cached_total as f64,
        ),
        ("prompt_seconds_total", "counter", "Prompt process time", m.prompt_seconds_total),
        (
            "tokens_predicted_total",
            "counter",
            "Number of generation tokens processed.",
            m.tokens_predicted_total as f64,
        ),
        ("tokens_predicted_seconds_total", "counter", "Predict process time", m.tokens_predicted_seconds_total),
        ("n_decode_total", "counter", "Total number of llama_decode() calls", m.n_decode_total as f64),
        ("n_tokens_max", "counter", "Largest observed n_tokens.", m.n_tokens_max as f64),
        (
            "n_busy_slots_per_decode",
            "gauge",
            "Average number of busy slots per llama_decode() call",
            ratio(m.n_busy_slots_total as f64, m.n_decode_total as f64),
        ),
        (
            "prompt_tokens_seconds",
            "gauge",
            "Average prompt throughput in tokens/s.",
            ratio(m.prompt_tokens_total as f64, m.prompt_seconds_total),
        ),
        (
            "predicted_tokens_seconds",
            "gauge",
            "Average generation throughput in tokens/s.",
            ratio(m.tokens_predicted_total as f64, m.tokens_predicted_seconds_total),
        ),
        ("requests_processing", "gauge", "Number of requests processing.", m.requests_processing as f64),
        ("requests_deferred", "gauge", "Number of requests deferred.", m.requests_deferred as f64),
    ];
    let mut out = String::new();
    for (name, kind, help, value) in series {
        // Writing to a String cannot fail.
        let _ = write!(out, "# HELP llamacpp:{name} {help}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {value}\n");
    }
    out
}

pub(super) fn prometheus(text: String) -> Response {
    ([(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"))], text).into_response()
}

pub(super) async fn metrics(State(s): State<Shared>) -> Response {
    match server_engine(&s) {
        Some(e) => prometheus(metrics_text(e)),
        None => server_not_found().await,
    }
}
