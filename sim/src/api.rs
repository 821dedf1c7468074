//! HTTP handlers and response bodies, in llama-server's and llama-swap's
//! shapes.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::debug;

use super::engine::{AdmitError, Engine, Lease, Timings};
use super::swap::{InFlight, Swap, SwapError};
use super::tokens::{CHATML_TEMPLATE, ChatMessage, embed, render_chatml, tokenize};
use super::{Backend, Inner, SimJob, SimMode};

type Shared = Arc<Inner>;

const BUILD_INFO: &str = "b11434-unknown";

/// The inference paths llama-server serves, one model or a router's.
fn server_jobs() -> Router<Shared> {
    Router::new()
        .route("/chat/completions", job(Kind::Chat))
        .route("/v1/chat/completions", job(Kind::Chat))
        .route("/completions", job(Kind::Completion))
        .route("/v1/completions", job(Kind::Completion))
        .route("/embeddings", job(Kind::Embedding))
        .route("/v1/embeddings", job(Kind::Embedding))
        .route("/infill", job(Kind::Infill))
}

pub(super) fn router(inner: Shared) -> Router {
    let sim_routes = Router::new().route("/sim/gpu", get(gpu_get).post(gpu_post));
    let routes = match inner.config.mode {
        SimMode::LlamaServer => Router::new()
            .route("/health", get(health))
            .route("/v1/health", get(health))
            .route("/models", get(server_models))
            .route("/v1/models", get(server_models))
            .route("/props", get(props))
            .route("/slots", get(slots))
            .route("/metrics", get(metrics))
            .merge(server_jobs())
            .merge(sim_routes)
            .fallback(server_not_found)
            .layer(middleware::from_fn_with_state(Arc::clone(&inner), loading_gate)),
        SimMode::LlamaServerRouter => Router::new()
            .route("/health", get(router_health))
            .route("/v1/health", get(router_health))
            .route("/models", get(router_models))
            .route("/v1/models", get(router_models))
            .route("/models/load", post(router_load))
            .route("/models/unload", post(router_unload))
            .route("/props", get(router_props))
            .route("/slots", get(router_slots))
            .merge(server_jobs())
            .merge(sim_routes)
            .fallback(server_not_found),
        SimMode::LlamaSwap => Router::new()
            .route("/health", get(swap_health))
            .route("/v1/models", get(swap_models))
            .route("/running", get(swap_running))
            .route("/upstream/{model}/{*rest}", get(swap_upstream))
            .route("/api/models/unload/{*model}", post(swap_unload))
            .route("/v1/chat/completions", job(Kind::Chat))
            .route("/v1/completions", job(Kind::Completion))
            .route("/v1/embeddings", job(Kind::Embedding))
            .route("/infill", job(Kind::Infill))
            .route("/v1/audio/transcriptions", job(Kind::Transcription))
            .route("/v1/audio/speech", job(Kind::Speech))
            .route("/v1/images/generations", job(Kind::Images))
            .route("/v1/images/edits", job(Kind::ImageEdit))
            .merge(sim_routes)
            .fallback(swap_not_found),
    };
    routes.with_state(inner)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
    Embedding,
    Infill,
    Transcription,
    Speech,
    Images,
    /// An image edit: an upload, as transcriptions are.
    ImageEdit,
}

impl Kind {
    /// The server a request of the kind needs.
    fn job(self) -> SimJob {
        match self {
            Kind::Chat | Kind::Completion | Kind::Embedding | Kind::Infill => SimJob::Text,
            Kind::Transcription => SimJob::Transcription,
            Kind::Speech => SimJob::Speech,
            Kind::Images | Kind::ImageEdit => SimJob::Images,
        }
    }

    /// Its body is a multipart form, whose `model` field llama-swap reads.
    fn is_form(self) -> bool {
        matches!(self, Kind::Transcription | Kind::ImageEdit)
    }
}

// ---- errors ----

fn json_response(status: StatusCode, body: Value) -> Response {
    (status, axum::Json(body)).into_response()
}

/// llama-server's error envelope.
fn llama_error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    json_response(status, json!({"error": {"code": status.as_u16(), "message": message.into(), "type": kind}}))
}

fn bad_request(message: impl Into<String>) -> Response {
    llama_error(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}

/// A request llama-server rejects as invalid; kept small so parsing results
/// stay cheap to move, and rendered only at the handler.
#[derive(Debug)]
struct BadRequest(String);

impl BadRequest {
    fn new(message: impl Into<String>) -> BadRequest {
        BadRequest(message.into())
    }
}

impl IntoResponse for BadRequest {
    fn into_response(self) -> Response {
        bad_request(self.0)
    }
}

fn admit_error(err: &AdmitError) -> Response {
    match err {
        AdmitError::ExceedContext { n_prompt, n_ctx } => json_response(
            StatusCode::BAD_REQUEST,
            json!({"error": {
                "code": 400,
                "message": err.to_string(),
                "type": "exceed_context_size_error",
                "n_prompt_tokens": n_prompt,
                "n_ctx": n_ctx,
            }}),
        ),
        AdmitError::InvalidSlot { .. } => bad_request(err.to_string()),
    }
}

fn shutting_down() -> Response {
    llama_error(StatusCode::SERVICE_UNAVAILABLE, "unavailable_error", "server is shutting down")
}

/// llama-swap's own error envelope.
/// llama-swap's own error: the envelope of builds since 2026-05, or the
/// bare string of older ones (`legacy`).
fn swap_error(legacy: bool, status: StatusCode, kind: &str, code: &str, message: impl Into<String>) -> Response {
    if legacy {
        return json_response(status, json!({"error": message.into()}));
    }
    json_response(
        status,
        json!({"src": "llama-swap", "error": {
            "message": message.into(), "type": kind, "param": null, "code": code,
        }}),
    )
}

fn swap_error_response(legacy: bool, err: &SwapError) -> Response {
    match err {
        // Older builds answered an unknown model with 400.
        SwapError::NotFound(_) if legacy => {
            swap_error(legacy, StatusCode::BAD_REQUEST, "invalid_request_error", "model_not_found", err.to_string())
        }
        SwapError::NotFound(_) => {
            swap_error(legacy, StatusCode::NOT_FOUND, "invalid_request_error", "model_not_found", err.to_string())
        }
        SwapError::ConcurrencyLimit(_) => {
            let mut resp = swap_error(
                legacy,
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "concurrency_limit",
                err.to_string(),
            );
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            resp
        }
        SwapError::LoadAborted(_) => {
            swap_error(legacy, StatusCode::SERVICE_UNAVAILABLE, "server_error", "model_unavailable", err.to_string())
        }
    }
}

async fn server_not_found() -> Response {
    llama_error(StatusCode::NOT_FOUND, "not_found_error", "File Not Found")
}

async fn swap_not_found() -> Response {
    (StatusCode::NOT_FOUND, "404 page not found").into_response()
}

/// While llama-server loads its model it answers every request with 503.
async fn loading_gate(State(s): State<Shared>, req: Request, next: Next) -> Response {
    if s.is_loading() && !req.uri().path().starts_with("/sim/") {
        return llama_error(StatusCode::SERVICE_UNAVAILABLE, "unavailable_error", "Loading model");
    }
    next.run(req).await
}

// ---- llama-server informational endpoints ----

async fn health() -> Response {
    json_response(StatusCode::OK, json!({"status": "ok"}))
}

fn server_engine(s: &Inner) -> Option<&Arc<Engine>> {
    match &s.backend {
        Backend::Server(e) => Some(e),
        Backend::Swap(_) => None,
    }
}

async fn server_models(State(s): State<Shared>) -> Response {
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

fn props_body(s: &Inner, engine: &Engine) -> Value {
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

async fn props(State(s): State<Shared>) -> Response {
    match server_engine(&s) {
        Some(e) => json_response(StatusCode::OK, props_body(&s, e)),
        None => server_not_found().await,
    }
}

fn slots_body(engine: &Engine) -> Value {
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

async fn slots(State(s): State<Shared>) -> Response {
    match server_engine(&s) {
        Some(e) => json_response(StatusCode::OK, slots_body(e)),
        None => server_not_found().await,
    }
}

fn metrics_text(engine: &Engine) -> String {
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

fn prometheus(text: String) -> Response {
    ([(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"))], text).into_response()
}

async fn metrics(State(s): State<Shared>) -> Response {
    match server_engine(&s) {
        Some(e) => prometheus(metrics_text(e)),
        None => server_not_found().await,
    }
}

// ---- simulator-only endpoints ----

/// Simulator-only: not a llama.cpp or llama-swap route. Reports the simulated
/// GPU, standing in for what the agent reads from NVML on a real host.
async fn gpu_get(State(s): State<Shared>) -> Response {
    if s.gpu_lost.load(Ordering::Relaxed) {
        return json_response(StatusCode::INTERNAL_SERVER_ERROR, json!({"error": "GPU is lost"}));
    }
    json_response(StatusCode::OK, gpu_body(&s))
}

fn gpu_body(s: &Inner) -> Value {
    let engines = s.loaded_engines();
    let per_model_kv = u64::from(s.config.context) * s.config.gpu.kv_bytes_per_token;
    let (mut busy, mut total) = (0usize, 0usize);
    let mut used = s.extra_used_bytes.load(Ordering::Relaxed);
    for e in &engines {
        used = used.saturating_add(e.model().size_bytes).saturating_add(per_model_kv);
        let (b, t) = e.busy();
        busy += b;
        total += t;
    }
    let utilization = if total == 0 { 0.0 } else { busy as f64 / total as f64 * 100.0 };
    json!({
        "name": s.config.gpu.name,
        "memory_total_bytes": s.config.gpu.memory_total_bytes,
        "memory_used_bytes": used,
        "extra_used_bytes": s.extra_used_bytes.load(Ordering::Relaxed),
        "utilization_percent": utilization,

    })
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct GpuUpdate {
    extra_used_bytes: Option<u64>,
    lost: Option<bool>,
}

/// Simulator-only: not a llama.cpp or llama-swap route. Sets memory used
/// beyond the loaded models, so tests can push a node over a VRAM threshold,
/// or makes the GPU unreadable.
async fn gpu_post(State(s): State<Shared>, body: Bytes) -> Response {
    match serde_json::from_slice::<GpuUpdate>(&body) {
        Ok(u) => {
            if let Some(bytes) = u.extra_used_bytes {
                s.extra_used_bytes.store(bytes, Ordering::Relaxed);
            }
            if let Some(lost) = u.lost {
                s.gpu_lost.store(lost, Ordering::Relaxed);
            }
            json_response(StatusCode::OK, gpu_body(&s))
        }
        Err(e) => bad_request(e.to_string()),
    }
}

// ---- llama-swap informational endpoints ----

async fn swap_health() -> Response {
    (StatusCode::OK, "OK").into_response()
}

async fn swap_models(State(s): State<Shared>) -> Response {
    let Backend::Swap(swap) = &s.backend else {
        return swap_not_found().await;
    };
    let data: Vec<Value> = swap
        .statuses()
        .into_iter()
        .map(|(id, st)| {
            let mut model = json!({"id": id, "object": "model", "created": s.created, "owned_by": "llama-swap"});
            // Builds before 2026-07 list no status; clients read /running.
            // Later ones say `loaded` for any process not stopped, one still
            // starting included: /running tells them apart.
            if !s.config.llama_swap_legacy {
                let value = if st == super::swap::ModelStatus::Unloaded { "unloaded" } else { "loaded" };
                model["status"] = json!({ "value": value });
            }
            model
        })
        .collect();
    json_response(StatusCode::OK, json!({"object": "list", "data": data}))
}

async fn swap_running(State(s): State<Shared>) -> Response {
    let Backend::Swap(swap) = &s.backend else {
        return swap_not_found().await;
    };
    let running: Vec<Value> = swap
        .statuses()
        .into_iter()
        .filter_map(|(id, st)| {
            let state = match st {
                super::swap::ModelStatus::Loaded => "ready",
                super::swap::ModelStatus::Loading => "starting",
                super::swap::ModelStatus::Unloaded => return None,
            };
            Some(json!({"model": id, "state": state}))
        })
        .collect();
    json_response(StatusCode::OK, json!({"running": running}))
}

/// llama-swap's pass-through to one model's llama-server, loading it if
/// needed. Only the informational GET endpoints are simulated.
/// llama-swap's `POST /api/models/unload/{model}`: `OK` once it stopped.
async fn swap_unload(State(s): State<Shared>, Path(model): Path<String>) -> Response {
    let Backend::Swap(swap) = &s.backend else {
        return swap_not_found().await;
    };
    match swap.unload(&model) {
        Ok(()) => (StatusCode::OK, "OK").into_response(),
        Err(e) => swap_error_response(s.config.llama_swap_legacy, &e),
    }
}

async fn swap_upstream(State(s): State<Shared>, Path((model, rest)): Path<(String, String)>) -> Response {
    let Backend::Swap(swap) = &s.backend else {
        return swap_not_found().await;
    };
    let engine = tokio::select! {
        r = swap.engine(&model) => r,
        () = s.shutdown.cancelled() => return shutting_down(),
    };
    let engine = match engine {
        Ok(e) => e,
        Err(e) => return swap_error_response(s.config.llama_swap_legacy, &e),
    };
    match rest.trim_start_matches('/') {
        "health" | "v1/health" => health().await,
        "props" => json_response(StatusCode::OK, props_body(&s, &engine)),
        "slots" => json_response(StatusCode::OK, slots_body(&engine)),
        "metrics" => prometheus(metrics_text(&engine)),
        _ => server_not_found().await,
    }
}

// ---- llama-server's router mode ----

async fn router_health() -> Response {
    json_response(StatusCode::OK, json!({"status": "ok"}))
}

/// Every model the router can load, in the state `status.value` says, with
/// the arguments its child server is started with.
async fn router_models(State(s): State<Shared>) -> Response {
    let Backend::Swap(swap) = &s.backend else {
        return server_not_found().await;
    };
    let n_ctx = s.config.engine_params().n_ctx_slot;
    let data: Vec<Value> = swap
        .statuses()
        .into_iter()
        .map(|(id, st)| {
            let args = json!([
                "llama-server",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--alias",
                id,
                "--ctx-size",
                n_ctx.to_string(),
                "--model",
                format!("{id}.gguf")
            ]);
            json!({
                "id": id, "aliases": [], "tags": [], "object": "model", "owned_by": "llamacpp",
                "created": s.created, "status": {"value": st.as_str(), "args": args},
                "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
                "source": "models_dir", "can_remove": false,
            })
        })
        .collect();
    json_response(StatusCode::OK, json!({"data": data, "object": "list"}))
}

/// The model of a router's `POST /models/load` or `/models/unload` body.
fn router_body_model(body: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(body).ok()?;
    value.get("model").and_then(Value::as_str).map(str::to_string)
}

/// Starts a load and answers at once, as the router does.
async fn router_load(State(s): State<Shared>, body: axum::body::Bytes) -> Response {
    let Backend::Swap(swap) = &s.backend else {
        return server_not_found().await;
    };
    let Some(model) = router_body_model(&body) else {
        return bad_request("\"model\" is required");
    };
    match swap.start_load(&model) {
        Ok(true) => json_response(StatusCode::OK, json!({"success": true})),
        Ok(false) => bad_request("model is already running"),
        Err(_) => llama_error(StatusCode::NOT_FOUND, "not_found_error", "File Not Found"),
    }
}

async fn router_unload(State(s): State<Shared>, body: axum::body::Bytes) -> Response {
    let Backend::Swap(swap) = &s.backend else {
        return server_not_found().await;
    };
    let Some(model) = router_body_model(&body) else {
        return bad_request("\"model\" is required");
    };
    match swap.unload(&model) {
        Ok(()) => json_response(StatusCode::OK, json!({"success": true})),
        Err(_) => llama_error(StatusCode::NOT_FOUND, "not_found_error", "File Not Found"),
    }
}

/// The model a router request names in its query, loaded unless it says
/// `autoload=false`.
async fn router_engine(s: &Inner, swap: &Arc<Swap>, model: &str, autoload: bool) -> Result<Arc<Engine>, Response> {
    let status = swap.statuses().into_iter().find(|(id, _)| id == model).map(|(_, st)| st);
    match status {
        None => return Err(bad_request(format!("model '{model}' not found"))),
        Some(st) if st != super::swap::ModelStatus::Loaded && !autoload => {
            return Err(bad_request("model is not loaded"));
        }
        Some(_) => {}
    }
    let engine = tokio::select! {
        r = swap.engine(model) => r,
        () = s.shutdown.cancelled() => return Err(shutting_down()),
    };
    engine.map_err(|e| llama_error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", e.to_string()))
}

/// A router's per-model GET: its `?model=` (and `autoload`), or the error
/// the router gives.
async fn router_query(s: &Inner, query: &std::collections::HashMap<String, String>) -> Result<Arc<Engine>, Response> {
    let Backend::Swap(swap) = &s.backend else {
        return Err(server_not_found().await);
    };
    let Some(model) = query.get("model") else {
        return Err(bad_request("model name is missing from the request"));
    };
    let autoload = query.get("autoload").is_none_or(|a| a != "false");
    router_engine(s, swap, model, autoload).await
}

async fn router_props(
    State(s): State<Shared>,
    Query(query): Query<std::collections::HashMap<String, String>>,
) -> Response {
    if !query.contains_key("model") {
        return json_response(
            StatusCode::OK,
            json!({
                "role": "router", "max_instances": s.config.max_loaded_models, "models_autoload": true,
                "model_alias": "llama-server", "model_path": "none",
                "default_generation_settings": {"params": null, "n_ctx": 0},
                "ui_settings": {}, "build_info": BUILD_INFO, "cors_proxy_enabled": false,
            }),
        );
    }
    match router_query(&s, &query).await {
        Ok(engine) => json_response(StatusCode::OK, props_body(&s, &engine)),
        Err(resp) => resp,
    }
}

async fn router_slots(
    State(s): State<Shared>,
    Query(query): Query<std::collections::HashMap<String, String>>,
) -> Response {
    match router_query(&s, &query).await {
        Ok(engine) => json_response(StatusCode::OK, slots_body(&engine)),
        Err(resp) => resp,
    }
}

// ---- inference ----

/// The route of an inference path: its requests dispatched as `kind`.
fn job(kind: Kind) -> axum::routing::MethodRouter<Shared> {
    post(move |State(s): State<Shared>, uri: http::Uri, headers: HeaderMap, body: Bytes| async move {
        dispatch(s, &uri, &headers, &body, kind).await
    })
}

/// The value of a multipart form's field `name`, as Go's `FormValue` (which
/// llama-swap calls) finds it: in the query first, then in the form's
/// fields, not its files; `None` where the body is not such a form.
fn form_value(uri: &http::Uri, headers: &HeaderMap, body: &[u8], name: &str) -> Option<Result<String, String>> {
    let query = uri.query().unwrap_or_default().split('&').find_map(|pair| pair.strip_prefix(&format!("{name}=")));
    if let Some(value) = query {
        return Some(Ok(value.to_string()));
    }
    let content_type = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
    let boundary = content_type.split(';').find_map(|p| p.trim().strip_prefix("boundary="))?.trim_matches('"');
    let delimiter = format!("--{boundary}");
    let text = String::from_utf8_lossy(body);
    if !text.contains(&delimiter) {
        return Some(Err("no multipart boundary found".into()));
    }
    let wanted = format!("name=\"{name}\"");
    for part in text.split(&delimiter).skip(1) {
        let Some((head, value)) = part.split_once("\r\n\r\n") else { continue };
        // Go's `FileName` is empty for `filename=""`: a field, then.
        let file = head.contains("filename=") && !head.contains("filename=\"\"");
        if head.contains(&wanted) && !file {
            return Some(Ok(value.strip_suffix("\r\n").unwrap_or(value).to_string()));
        }
    }
    Some(Ok(String::new()))
}

fn parse_body(body: &[u8]) -> Result<Value, BadRequest> {
    match serde_json::from_slice::<Value>(body) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(BadRequest::new("request body must be a JSON object")),
        Err(e) => Err(BadRequest::new(e.to_string())),
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json")))
}

async fn dispatch(s: Shared, uri: &http::Uri, headers: &HeaderMap, body: &[u8], kind: Kind) -> Response {
    match &s.backend {
        Backend::Server(engine) => {
            let engine = Arc::clone(engine);
            // llama-server refuses the wrong kind of work before reading the body.
            if let Some(resp) = unsupported(&engine, kind) {
                return resp;
            }
            match parse_body(body) {
                Ok(req) => infer(s, engine, kind, req, body, None).await,
                Err(e) => e.into_response(),
            }
        }
        Backend::Swap(swap) if s.config.mode == SimMode::LlamaServerRouter => {
            let swap = Arc::clone(swap);
            // The router reads the model from any body, and answers in
            // llama-server's words.
            let req = match parse_body(body) {
                Ok(req) => req,
                Err(e) => return e.into_response(),
            };
            let model = match req.get("model").and_then(Value::as_str) {
                Some(model) => model.to_owned(),
                None => return bad_request("model name is missing from the request"),
            };
            // `?autoload=false`: a model not loaded is refused, not loaded.
            let autoload = !uri.query().unwrap_or_default().split('&').any(|pair| pair == "autoload=false");
            let engine = match router_engine(&s, &swap, &model, autoload).await {
                Ok(engine) => engine,
                Err(resp) => return resp,
            };
            if let Some(resp) = unsupported(&engine, kind) {
                return resp;
            }
            infer(s, engine, kind, req, body, None).await
        }
        Backend::Swap(swap) => {
            let swap = Arc::clone(swap);
            let legacy = s.config.llama_swap_legacy;
            // llama-swap reads the model from the body only for JSON requests,
            // and from the form for uploads.
            let (model, req) = if kind.is_form() {
                match form_value(uri, headers, body, "model") {
                    Some(Ok(model)) if !model.is_empty() => (model, None),
                    Some(Err(e)) => {
                        let message = format!("error parsing multipart form: {e}");
                        return swap_error(
                            legacy,
                            StatusCode::BAD_REQUEST,
                            "invalid_request_error",
                            "invalid_form",
                            message,
                        );
                    }
                    _ => {
                        let message = "missing or invalid 'model' parameter in form data";
                        return swap_error(
                            legacy,
                            StatusCode::BAD_REQUEST,
                            "invalid_request_error",
                            "invalid_form",
                            message,
                        );
                    }
                }
            } else if is_json(headers) {
                match serde_json::from_slice::<Value>(body) {
                    Ok(v) => (v.get("model").and_then(Value::as_str).unwrap_or_default().to_owned(), Some(v)),
                    Err(e) => {
                        return swap_error(
                            legacy,
                            StatusCode::BAD_REQUEST,
                            "invalid_request_error",
                            "invalid_json",
                            format!("invalid JSON: {e}"),
                        );
                    }
                }
            } else {
                (String::new(), None)
            };
            let in_flight = match swap.enter(&model) {
                Ok(g) => g,
                Err(e) => return swap_error_response(legacy, &e),
            };
            let engine = tokio::select! {
                r = swap.engine(&model) => r,
                () = s.shutdown.cancelled() => return shutting_down(),
            };
            let engine = match engine {
                Ok(e) => e,
                Err(e) => return swap_error_response(legacy, &e),
            };
            if let Some(resp) = unsupported(&engine, kind) {
                return resp;
            }
            match req {
                None if kind.is_form() => infer(s, engine, kind, Value::Null, body, Some(in_flight)).await,
                Some(req @ Value::Object(_)) => infer(s, engine, kind, req, body, Some(in_flight)).await,
                _ => bad_request("request body must be a JSON object"),
            }
        }
    }
}

/// What a server answers a request it is not for: llama-server refuses a
/// kind of work its model cannot do (501); a server of another job has no
/// such path (404).
fn unsupported(engine: &Engine, kind: Kind) -> Option<Response> {
    let model = engine.model();
    if model.job != kind.job() {
        return Some(llama_error(StatusCode::NOT_FOUND, "not_found_error", "File Not Found"));
    }
    let message = match kind {
        Kind::Embedding if !model.embedding => "This server does not support embeddings. Start it with `--embeddings`",
        Kind::Chat | Kind::Completion if model.embedding => {
            "This server does not support completions. Start it without `--embeddings`"
        }
        // Simulated models have no FIM tokens.
        Kind::Infill => {
            "Infill is not supported by this model: prefix token is missing. suffix token is missing. middle token is missing. "
        }
        _ => return None,
    };
    Some(llama_error(StatusCode::NOT_IMPLEMENTED, "not_supported_error", message))
}

/// Runs one inference request on `engine`. `in_flight` is held until the
/// response, streamed or not, is complete.
async fn infer(
    s: Shared,
    engine: Arc<Engine>,
    kind: Kind,
    req: Value,
    body: &[u8],
    in_flight: Option<InFlight>,
) -> Response {
    match kind {
        Kind::Embedding => embed_request(&s, &engine, &req).await,
        // Refused by `unsupported` first: simulated models have no FIM
        // tokens. Should one ever get here, it is llama-server's answer.
        Kind::Infill => {
            llama_error(StatusCode::NOT_IMPLEMENTED, "not_supported_error", "Infill is not supported by this model")
        }
        Kind::Transcription => json_response(
            StatusCode::OK,
            json!({"text": format!(" a simulated transcription of {} bytes", body.len())}),
        ),
        Kind::Speech => {
            let mut resp = Response::new(Body::from(Bytes::from_static(b"RIFF\x24\0\0\0WAVEfmt simulated speech")));
            resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("audio/wav"));
            resp
        }
        Kind::Images | Kind::ImageEdit => json_response(
            StatusCode::OK,
            json!({"created": unix_now(), "data": [{"b64_json": "c2ltdWxhdGVkIGltYWdl"}]}),
        ),
        Kind::Chat | Kind::Completion => {
            let parsed = match parse_generation(&s, &engine, kind, &req) {
                Ok(p) => p,
                Err(e) => return e.into_response(),
            };
            generate(s, engine, kind, parsed, in_flight).await
        }
    }
}

#[derive(Debug)]
struct Generation {
    prompt: Vec<u32>,
    n_predict: Option<usize>,
    stream: bool,
    include_usage: bool,
    id_slot: Option<usize>,
    model: String,
}

fn parse_generation(s: &Inner, engine: &Engine, kind: Kind, req: &Value) -> Result<Generation, BadRequest> {
    let text = match kind {
        Kind::Chat => render_chatml(&parse_messages(req)?),
        _ => parse_prompt(req)?,
    };
    let mut n_predict = Some(s.config.default_max_tokens as usize);
    for key in ["max_tokens", "max_completion_tokens", "n_predict"] {
        match req.get(key) {
            None | Some(Value::Null) => continue,
            Some(v) => {
                let n = v.as_i64().ok_or_else(|| BadRequest::new(format!("\"{key}\" must be an integer")))?;
                // Negative means no limit: the reply runs until the slot is full.
                n_predict = usize::try_from(n).ok();
                break;
            }
        }
    }
    let stream = match req.get("stream") {
        None | Some(Value::Null) => false,
        Some(v) => v.as_bool().ok_or_else(|| BadRequest::new("\"stream\" must be a boolean"))?,
    };
    let include_usage = req.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);
    let id_slot = match req.get("id_slot") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let n = v.as_i64().ok_or_else(|| BadRequest::new("\"id_slot\" must be an integer"))?;
            usize::try_from(n).ok()
        }
    };
    let model = req.get("model").and_then(Value::as_str).map_or_else(|| engine.model().id.clone(), str::to_owned);
    Ok(Generation { prompt: tokenize(&text), n_predict, stream, include_usage, id_slot, model })
}

fn parse_messages(req: &Value) -> Result<Vec<ChatMessage>, BadRequest> {
    let messages = req
        .get("messages")
        .ok_or_else(|| BadRequest::new("'messages' is required"))?
        .as_array()
        .ok_or_else(|| BadRequest::new("Expected 'messages' to be an array"))?;
    if messages.is_empty() {
        return Err(BadRequest::new("'messages' must not be empty"));
    }
    messages
        .iter()
        .map(|m| {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| BadRequest::new("each message needs a string 'role'"))?;
            let content = match m.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut out = String::new();
                    for p in parts {
                        match p.get("type").and_then(Value::as_str) {
                            Some("text") => out.push_str(
                                p.get("text")
                                    .and_then(Value::as_str)
                                    .ok_or_else(|| BadRequest::new("a text content part needs a string 'text'"))?,
                            ),
                            _ => {
                                return Err(BadRequest::new("only text content parts are supported by this model"));
                            }
                        }
                    }
                    out
                }
                Some(_) => {
                    return Err(BadRequest::new("'content' must be a string or an array of content parts"));
                }
            };
            Ok(ChatMessage { role: role.to_owned(), content })
        })
        .collect()
}

fn parse_prompt(req: &Value) -> Result<String, BadRequest> {
    match req.get("prompt") {
        Some(Value::String(p)) => Ok(p.clone()),
        Some(Value::Array(items)) => match items.first() {
            Some(Value::String(p)) => Ok(p.clone()),
            _ => Err(BadRequest::new("\"prompt\" must be a string or an array of strings")),
        },
        None => Err(BadRequest::new("\"prompt\" is required")),
        Some(_) => Err(BadRequest::new("\"prompt\" must be a string or an array of strings")),
    }
}

/// The identity of one response, shared by all its stream chunks.
struct ReplyMeta {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
}

impl ReplyMeta {
    fn new(kind: Kind, model: String) -> ReplyMeta {
        let prefix = if kind == Kind::Chat { "chatcmpl-" } else { "cmpl-" };
        let suffix: String = std::iter::repeat_with(fastrand::alphanumeric).take(32).collect();
        ReplyMeta { id: format!("{prefix}{suffix}"), created: unix_now(), model, kind }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            _ => "text_completion",
        }
    }

    /// One response body or chunk around `choices`.
    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "choices": choices,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": BUILD_INFO,
            "object": self.object(chunk),
            "id": self.id,
        })
    }

    /// A streamed choice carrying `piece` (or nothing) and a finish reason.
    fn delta_choice(&self, piece: Option<&str>, finish: Option<&str>) -> Value {
        match self.kind {
            Kind::Chat => {
                let delta = match piece {
                    Some(p) => json!({"content": p}),
                    None => json!({}),
                };
                json!([{"finish_reason": finish, "index": 0, "delta": delta}])
            }
            _ => json!([{
                "text": piece.unwrap_or(""), "index": 0, "logprobs": null, "finish_reason": finish,
            }]),
        }
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn usage_json(t: &Timings) -> Value {
    let prompt = t.cache_n + t.prompt_n;
    json!({
        "completion_tokens": t.predicted_n,
        "prompt_tokens": prompt,
        "total_tokens": prompt + t.predicted_n,
        "prompt_tokens_details": {"cached_tokens": t.cache_n},
    })
}

fn timings_json(t: &Timings) -> Value {
    let per_token = |ms: f64, n: usize| if n == 0 { 0.0 } else { ms / n as f64 };
    let per_second = |ms: f64, n: usize| {
        if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 }
    };
    json!({
        "cache_n": t.cache_n,
        "prompt_n": t.prompt_n,
        "prompt_ms": t.prompt_ms,
        "prompt_per_token_ms": per_token(t.prompt_ms, t.prompt_n),
        "prompt_per_second": per_second(t.prompt_ms, t.prompt_n),
        "predicted_n": t.predicted_n,
        "predicted_ms": t.predicted_ms,
        "predicted_per_token_ms": per_token(t.predicted_ms, t.predicted_n),
        "predicted_per_second": per_second(t.predicted_ms, t.predicted_n),
    })
}

async fn generate(s: Shared, engine: Arc<Engine>, kind: Kind, g: Generation, in_flight: Option<InFlight>) -> Response {
    let Generation { prompt, n_predict, stream, include_usage, id_slot, model } = g;
    let shutdown = s.shutdown.clone();
    // Waiting for a slot and the prompt evaluation happen before any byte is
    // sent, as llama-server waits for the first result before its headers.
    let started = async {
        let mut lease = engine.acquire(prompt, id_slot, n_predict).await?;
        lease.prefill().await;
        Ok::<Lease, AdmitError>(lease)
    };
    let lease = tokio::select! {
        r = started => r,
        () = shutdown.cancelled() => return shutting_down(),
    };
    let mut lease = match lease {
        Ok(l) => l,
        Err(e) => return admit_error(&e),
    };
    debug!(
        slot = lease.admission().slot,
        prompt_tokens = lease.prompt_tokens(),
        cached_tokens = lease.cached(),
        "sim request admitted"
    );
    let meta = ReplyMeta::new(kind, model);

    if stream {
        let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(16);
        tokio::spawn(async move {
            // Held until the stream ends so llama-swap's limit counts it.
            let _in_flight = in_flight;
            tokio::select! {
                () = stream_reply(&mut lease, &meta, include_usage, &tx) => {}
                // Ending the stream lets graceful shutdown complete.
                () = shutdown.cancelled() => {}
            }
        });
        let mut resp = Response::new(Body::from_stream(ReceiverStream::new(rx)));
        resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return resp;
    }

    let decoded = async {
        let mut text = String::new();
        while let Some(piece) = lease.next_piece().await {
            text.push_str(piece);
        }
        text
    };
    let text = tokio::select! {
        t = decoded => t,
        () = shutdown.cancelled() => return shutting_down(),
    };
    let t = lease.timings();
    drop(lease);
    drop(in_flight);
    let choice = match kind {
        Kind::Chat => json!([{
            "finish_reason": "length", "index": 0,
            "message": {"role": "assistant", "content": text},
        }]),
        _ => json!([{"text": text, "index": 0, "logprobs": null, "finish_reason": "length"}]),
    };
    let mut body = meta.envelope(false, choice);
    if let Value::Object(map) = &mut body {
        map.insert("usage".into(), usage_json(&t));
        map.insert("timings".into(), timings_json(&t));
    }
    json_response(StatusCode::OK, body)
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// Emits the reply token by token. Returns early when the client went away;
/// dropping the lease then frees the slot.
async fn stream_reply(
    lease: &mut Lease,
    meta: &ReplyMeta,
    include_usage: bool,
    tx: &mpsc::Sender<Result<Bytes, Infallible>>,
) {
    if meta.kind == Kind::Chat {
        let first = meta.envelope(
            true,
            json!([{"finish_reason": null, "index": 0,
                    "delta": {"role": "assistant", "content": null}}]),
        );
        if tx.send(Ok(sse(&first))).await.is_err() {
            return;
        }
    }
    while let Some(piece) = lease.next_piece().await {
        let chunk = meta.envelope(true, meta.delta_choice(Some(piece), None));
        if tx.send(Ok(sse(&chunk))).await.is_err() {
            debug!(generated = lease.generated(), "sim client went away mid-stream");
            return;
        }
    }
    let t = lease.timings();
    let mut last = meta.envelope(true, meta.delta_choice(None, Some("length")));
    if let Value::Object(map) = &mut last {
        map.insert("timings".into(), timings_json(&t));
    }
    let mut frames = vec![sse(&last)];
    if include_usage {
        let mut usage = meta.envelope(true, json!([]));
        if let Value::Object(map) = &mut usage {
            map.insert("usage".into(), usage_json(&t));
        }
        frames.push(sse(&usage));
    }
    frames.push(Bytes::from_static(b"data: [DONE]\n\n"));
    for frame in frames {
        if tx.send(Ok(frame)).await.is_err() {
            return;
        }
    }
}

async fn embed_request(s: &Inner, engine: &Arc<Engine>, req: &Value) -> Response {
    let input = req.get("input").or_else(|| req.get("content"));
    let texts: Vec<&str> = match input {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(items)) if !items.is_empty() => {
            match items.iter().map(Value::as_str).collect::<Option<Vec<_>>>() {
                Some(v) => v,
                None => return bad_request("\"input\" must be a string or an array of strings"),
            }
        }
        Some(_) => return bad_request("\"input\" must be a string or an array of strings"),
        None => return bad_request("\"input\" or \"content\" must be provided"),
    };
    let n_ctx = engine.params().n_ctx_slot;
    let tokenized: Vec<Vec<u32>> = texts.iter().map(|t| tokenize(t)).collect();
    if let Some(too_long) = tokenized.iter().find(|t| t.len() > n_ctx) {
        return admit_error(&AdmitError::ExceedContext { n_prompt: too_long.len(), n_ctx });
    }
    let total: usize = tokenized.iter().map(Vec::len).sum();
    let d = engine.timing().prefill_tokens_per_second;
    let secs = total as f64 / d;
    if let Ok(wait) = std::time::Duration::try_from_secs_f64(secs)
        && !wait.is_zero()
    {
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = s.shutdown.cancelled() => return shutting_down(),
        }
    }
    engine.stats().add_request(total, 0);
    let dim = engine.model().embedding_dim as usize;
    let data: Vec<Value> = tokenized
        .iter()
        .enumerate()
        .map(|(i, toks)| json!({"embedding": embed(toks, dim), "index": i, "object": "embedding"}))
        .collect();
    let model = req.get("model").and_then(Value::as_str).unwrap_or(&engine.model().id);
    json_response(
        StatusCode::OK,
        json!({
            "model": model,
            "object": "list",
            "usage": {"prompt_tokens": total, "total_tokens": total},
            "data": data,
        }),
    )
}
