//! llama-server's router mode: every model of a directory, loaded and
//! unloaded on demand or when asked (`/models/load`, `/models/unload`),
//! each model's `/props` and `/slots` asked by `?model=`.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::response::Response;
use http::StatusCode;
use serde_json::{Value, json};

use super::server::{props_body, slots_body};
use super::{BUILD_INFO, Shared, bad_request, json_response, llama_error, server_not_found, shutting_down};
use crate::engine::Engine;
use crate::swap::Swap;
use crate::{Backend, Inner};

pub(super) async fn router_health() -> Response {
    json_response(StatusCode::OK, json!({"status": "ok"}))
}

/// Every model the router can load, in the state `status.value` says, with
/// the arguments its child server is started with.
pub(super) async fn router_models(State(s): State<Shared>) -> Response {
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
pub(super) async fn router_load(State(s): State<Shared>, body: axum::body::Bytes) -> Response {
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

pub(super) async fn router_unload(State(s): State<Shared>, body: axum::body::Bytes) -> Response {
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
        Some(st) if st != crate::swap::ModelStatus::Loaded && !autoload => {
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

pub(super) async fn router_props(
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

pub(super) async fn router_slots(
    State(s): State<Shared>,
    Query(query): Query<std::collections::HashMap<String, String>>,
) -> Response {
    match router_query(&s, &query).await {
        Ok(engine) => json_response(StatusCode::OK, slots_body(&engine)),
        Err(resp) => resp,
    }
}

/// The engine of a request for the router's `model`, which it loads
/// unless the query says `autoload=false`; in llama-server's words where
/// it cannot.
pub(super) async fn request_engine(
    s: &Inner,
    swap: &Arc<Swap>,
    uri: &http::Uri,
    req: &Value,
) -> Result<Arc<Engine>, Response> {
    let Some(model) = req.get("model").and_then(Value::as_str) else {
        return Err(bad_request("model name is missing from the request"));
    };
    let autoload = !uri.query().unwrap_or_default().split('&').any(|pair| pair == "autoload=false");
    router_engine(s, swap, model, autoload).await
}
