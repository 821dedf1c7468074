//! llama-swap: its models loaded on demand, one at a time or as many as
//! it may run, what it says of them (`/v1/models`, `/running`), its
//! pass-through to one model's server (`/upstream`), unloads, and its own
//! errors, in the envelope of builds since 2026-05 or the bare string of
//! older ones.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderValue, StatusCode, header};
use serde_json::{Value, json};

use super::server::{health, metrics_text, prometheus, props_body, slots_body};
use super::{Kind, Shared, json_response, server_not_found, shutting_down};
use crate::engine::Engine;
use crate::swap::{InFlight, Swap, SwapError};
use crate::{Backend, Inner};

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

pub(super) fn swap_error_response(legacy: bool, err: &SwapError) -> Response {
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

pub(super) async fn swap_not_found() -> Response {
    (StatusCode::NOT_FOUND, "404 page not found").into_response()
}

pub(super) async fn swap_health() -> Response {
    (StatusCode::OK, "OK").into_response()
}

pub(super) async fn swap_models(State(s): State<Shared>) -> Response {
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
                let value = if st == crate::swap::ModelStatus::Unloaded { "unloaded" } else { "loaded" };
                model["status"] = json!({ "value": value });
            }
            model
        })
        .collect();
    json_response(StatusCode::OK, json!({"object": "list", "data": data}))
}

pub(super) async fn swap_running(State(s): State<Shared>) -> Response {
    let Backend::Swap(swap) = &s.backend else {
        return swap_not_found().await;
    };
    let running: Vec<Value> = swap
        .statuses()
        .into_iter()
        .filter_map(|(id, st)| {
            let state = match st {
                crate::swap::ModelStatus::Loaded => "ready",
                crate::swap::ModelStatus::Loading => "starting",
                crate::swap::ModelStatus::Unloaded => return None,
            };
            Some(json!({"model": id, "state": state}))
        })
        .collect();
    json_response(StatusCode::OK, json!({"running": running}))
}

/// llama-swap's pass-through to one model's llama-server, loading it if
/// needed. Only the informational GET endpoints are simulated.
/// llama-swap's `POST /api/models/unload/{model}`: `OK` once it stopped.
pub(super) async fn swap_unload(State(s): State<Shared>, Path(model): Path<String>) -> Response {
    let Backend::Swap(swap) = &s.backend else {
        return swap_not_found().await;
    };
    match swap.unload(&model) {
        Ok(()) => (StatusCode::OK, "OK").into_response(),
        Err(e) => swap_error_response(s.config.llama_swap_legacy, &e),
    }
}

pub(super) async fn swap_upstream(State(s): State<Shared>, Path((model, rest)): Path<(String, String)>) -> Response {
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

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json")))
}

/// The engine a request to llama-swap is for, as llama-swap finds it: the
/// model named in a JSON body (only one that says it is JSON) or in an
/// upload's form, loaded first where it is not. With it, the body as JSON
/// where it is one, and the request's place in the model's concurrency
/// limit, held until its answer ends.
pub(super) async fn request_engine(
    s: &Inner,
    swap: &Arc<Swap>,
    (uri, headers, body): (&http::Uri, &HeaderMap, &[u8]),
    kind: Kind,
) -> Result<(Arc<Engine>, Option<Value>, InFlight), Response> {
    let legacy = s.config.llama_swap_legacy;
    let invalid = |code: &str, message: String| {
        swap_error(legacy, StatusCode::BAD_REQUEST, "invalid_request_error", code, message)
    };
    let (model, req) = if kind.is_form() {
        match form_value(uri, headers, body, "model") {
            Some(Ok(model)) if !model.is_empty() => (model, None),
            Some(Err(e)) => return Err(invalid("invalid_form", format!("error parsing multipart form: {e}"))),
            _ => return Err(invalid("invalid_form", "missing or invalid 'model' parameter in form data".into())),
        }
    } else if is_json(headers) {
        match serde_json::from_slice::<Value>(body) {
            Ok(v) => (v.get("model").and_then(Value::as_str).unwrap_or_default().to_owned(), Some(v)),
            Err(e) => return Err(invalid("invalid_json", format!("invalid JSON: {e}"))),
        }
    } else {
        (String::new(), None)
    };
    let in_flight = swap.enter(&model).map_err(|e| swap_error_response(legacy, &e))?;
    let engine = tokio::select! {
        r = swap.engine(&model) => r,
        () = s.shutdown.cancelled() => return Err(shutting_down()),
    };
    let engine = engine.map_err(|e| swap_error_response(legacy, &e))?;
    Ok((engine, req, in_flight))
}
