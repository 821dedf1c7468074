//! The simulator's HTTP surface, one module per server it plays:
//! llama-server with one model ([`server`]), its router mode ([`router`])
//! and llama-swap ([`llama_swap`]); the inference paths they share
//! ([`jobs`]), generation ([`generate`]), the tool call a request requires
//! ([`call`]) and its answers in each API's shape ([`reply`]); and the
//! simulator's own GPU endpoint ([`gpu`]).
//! Errors are in llama-server's envelope unless llama-swap answers itself.

mod call;
mod generate;
mod gpu;
mod jobs;
mod llama_swap;
mod reply;
mod router;
mod server;

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::StatusCode;
use serde_json::{Value, json};

use self::jobs::job;
use super::engine::AdmitError;
use super::{Inner, SimJob, SimMode};

type Shared = Arc<Inner>;

const BUILD_INFO: &str = "b11434-unknown";

/// The inference paths llama-server serves, one model or a router's.
fn server_jobs() -> Router<Shared> {
    Router::new()
        .route("/chat/completions", job(Kind::Chat))
        .route("/v1/chat/completions", job(Kind::Chat))
        .route("/completions", job(Kind::Completion))
        .route("/v1/completions", job(Kind::Completion))
        .route("/v1/messages", job(Kind::Messages))
        .route("/v1/messages/count_tokens", job(Kind::CountTokens))
        .route("/responses", job(Kind::Responses))
        .route("/v1/responses", job(Kind::Responses))
        .route("/embeddings", job(Kind::Embedding))
        .route("/v1/embeddings", job(Kind::Embedding))
        .route("/infill", job(Kind::Infill))
}

pub(super) fn router(inner: Shared) -> Router {
    let sim_routes = Router::new().route("/sim/gpu", get(gpu::gpu_get).post(gpu::gpu_post));
    let routes = match inner.config.mode {
        SimMode::LlamaServer => Router::new()
            .route("/health", get(server::health))
            .route("/v1/health", get(server::health))
            .route("/models", get(server::server_models))
            .route("/v1/models", get(server::server_models))
            .route("/props", get(server::props))
            .route("/slots", get(server::slots))
            .route("/metrics", get(server::metrics))
            .merge(server_jobs())
            .merge(sim_routes)
            .fallback(server_not_found)
            .layer(middleware::from_fn_with_state(Arc::clone(&inner), loading_gate)),
        SimMode::LlamaServerRouter => Router::new()
            .route("/health", get(router::router_health))
            .route("/v1/health", get(router::router_health))
            .route("/models", get(router::router_models))
            .route("/v1/models", get(router::router_models))
            .route("/models/load", post(router::router_load))
            .route("/models/unload", post(router::router_unload))
            .route("/props", get(router::router_props))
            .route("/slots", get(router::router_slots))
            .merge(server_jobs())
            .merge(sim_routes)
            .fallback(server_not_found),
        SimMode::LlamaSwap => Router::new()
            .route("/health", get(llama_swap::swap_health))
            .route("/v1/models", get(llama_swap::swap_models))
            .route("/running", get(llama_swap::swap_running))
            .route("/upstream/{model}/{*rest}", get(llama_swap::swap_upstream))
            .route("/api/models/unload/{*model}", post(llama_swap::swap_unload))
            .route("/v1/chat/completions", job(Kind::Chat))
            .route("/v1/completions", job(Kind::Completion))
            .route("/v1/messages", job(Kind::Messages))
            .route("/v1/messages/count_tokens", job(Kind::CountTokens))
            .route("/v1/responses", job(Kind::Responses))
            .route("/v1/embeddings", job(Kind::Embedding))
            .route("/infill", job(Kind::Infill))
            .route("/v1/audio/transcriptions", job(Kind::Transcription))
            .route("/v1/audio/speech", job(Kind::Speech))
            .route("/v1/images/generations", job(Kind::Images))
            .route("/v1/images/edits", job(Kind::ImageEdit))
            .merge(sim_routes)
            .fallback(llama_swap::swap_not_found),
    };
    routes.with_state(inner)
}

/// What a request asks a server to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
    /// The Anthropic Messages API.
    Messages,
    /// The Messages API's token count, no generation.
    CountTokens,
    /// OpenAI's Responses API.
    Responses,
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
            Kind::Chat
            | Kind::Completion
            | Kind::Messages
            | Kind::CountTokens
            | Kind::Responses
            | Kind::Embedding
            | Kind::Infill => SimJob::Text,
            Kind::Transcription => SimJob::Transcription,
            Kind::Speech => SimJob::Speech,
            Kind::Images | Kind::ImageEdit => SimJob::Images,
        }
    }

    /// Its body is a multipart form, whose `model` field llama-swap reads.
    fn is_form(self) -> bool {
        matches!(self, Kind::Transcription | Kind::ImageEdit)
    }

    /// It asks the model to generate.
    fn generates(self) -> bool {
        matches!(self, Kind::Chat | Kind::Completion | Kind::Messages | Kind::CountTokens | Kind::Responses)
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

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

/// A request llama-server refuses as it reads it: most often as invalid
/// (400), a few as its own error (500); rendered only at the handler.
#[derive(Debug)]
struct BadRequest {
    server_error: bool,
    message: String,
}

impl BadRequest {
    fn new(message: impl Into<String>) -> BadRequest {
        BadRequest { server_error: false, message: message.into() }
    }

    /// What llama-server answers with a 500, though the request is at fault.
    fn server_error(message: impl Into<String>) -> BadRequest {
        BadRequest { server_error: true, message: message.into() }
    }
}

impl IntoResponse for BadRequest {
    fn into_response(self) -> Response {
        if self.server_error {
            return llama_error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", self.message);
        }
        bad_request(self.message)
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

async fn server_not_found() -> Response {
    llama_error(StatusCode::NOT_FOUND, "not_found_error", "File Not Found")
}

/// While llama-server loads its model it answers every request with 503.
async fn loading_gate(State(s): State<Shared>, req: Request, next: Next) -> Response {
    if s.is_loading() && !req.uri().path().starts_with("/sim/") {
        return llama_error(StatusCode::SERVICE_UNAVAILABLE, "unavailable_error", "Loading model");
    }
    next.run(req).await
}
