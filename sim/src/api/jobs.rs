//! The inference paths, whichever server serves them: each request's
//! engine found as its server finds it (its one model, the router's, or
//! llama-swap's), work its model cannot do refused as llama-server refuses
//! it, and the rest done: generation ([`super::generate`]), embeddings,
//! token counts, and llama-swap's media jobs.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use serde_json::{Value, json};

use super::generate::{Request, parse_request, prompt_of};
use super::{BadRequest, Kind, Shared, admit_error, bad_request, json_response, llama_error, shutting_down, unix_now};
use crate::engine::{AdmitError, Engine};
use crate::swap::InFlight;
use crate::tokens::{embed, tokenize};
use crate::{Backend, Inner, SimMode};

/// The route of an inference path: its requests dispatched as `kind`.
pub(super) fn job(kind: Kind) -> axum::routing::MethodRouter<Shared> {
    axum::routing::post(move |State(s): State<Shared>, uri: http::Uri, headers: HeaderMap, body: Bytes| async move {
        dispatch(s, &uri, &headers, &body, kind).await
    })
}

fn parse_body(body: &[u8]) -> Result<Value, BadRequest> {
    match serde_json::from_slice::<Value>(body) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(BadRequest::new("request body must be a JSON object")),
        Err(e) => Err(BadRequest::new(e.to_string())),
    }
}

async fn dispatch(s: Shared, uri: &http::Uri, headers: &HeaderMap, body: &[u8], kind: Kind) -> Response {
    let (engine, req, in_flight) = match &s.backend {
        Backend::Server(engine) => {
            // llama-server refuses the wrong kind of work before reading the body.
            if let Some(resp) = unsupported(engine, kind) {
                return resp;
            }
            match parse_body(body) {
                Ok(req) => (Arc::clone(engine), req, None),
                Err(e) => return e.into_response(),
            }
        }
        // The router reads the model from any body, and answers in
        // llama-server's words.
        Backend::Swap(swap) if s.config.mode == SimMode::LlamaServerRouter => {
            let req = match parse_body(body) {
                Ok(req) => req,
                Err(e) => return e.into_response(),
            };
            match super::router::request_engine(&s, swap, uri, &req).await {
                Ok(engine) => (engine, req, None),
                Err(resp) => return resp,
            }
        }
        Backend::Swap(swap) => match super::llama_swap::request_engine(&s, swap, (uri, headers, body), kind).await {
            Ok((engine, req, in_flight)) => match req {
                Some(req @ Value::Object(_)) => (engine, req, Some(in_flight)),
                None if kind.is_form() => (engine, Value::Null, Some(in_flight)),
                _ => return bad_request("request body must be a JSON object"),
            },
            Err(resp) => return resp,
        },
    };
    if let Some(resp) = unsupported(&engine, kind) {
        return resp;
    }
    infer(s, engine, kind, req, body, in_flight).await
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
        _ if kind.generates() && model.embedding => {
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
        // A count reads the prompt as a generation would, and stops there.
        Kind::CountTokens => match prompt_of(kind, &req) {
            Ok(text) => json_response(StatusCode::OK, json!({"input_tokens": tokenize(&text).len()})),
            Err(e) => e.into_response(),
        },
        Kind::Chat | Kind::Completion | Kind::Messages | Kind::Responses => {
            let request: Request = match parse_request(&s, &engine, kind, &req) {
                Ok(request) => request,
                Err(e) => return e.into_response(),
            };
            super::generate::generate(s, engine, request, in_flight).await
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
    let usage = json!({"prompt_tokens": total, "total_tokens": total});
    let answer = Embeddings { model, object: "list", usage, data };
    (StatusCode::OK, axum::Json(answer)).into_response()
}

/// llama-server's embeddings answer, its members in its order (it writes
/// insertion-ordered JSON): the usage before the vectors, however long.
#[derive(serde::Serialize)]
struct Embeddings<'a> {
    model: &'a str,
    object: &'static str,
    usage: Value,
    data: Vec<Value>,
}
