use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use inferyes_proto::ErrorKind;
use inferyes_proto::v1::{EndpointKind, RoutingDecision};
use serde_json::json;

use super::forward::{Forwarder, Outbound, OwnedOutbound};
use super::view::{estimated_prompt_tokens, with_model};
use super::{ApiError, parse_view, session_key};
use crate::auth::Caller;
use crate::routing::{self, RouteRequest};
use crate::snapshot::{CatalogEntry, RoutingSnapshot, SnapshotStore};

/// The OpenAI endpoints the data plane routes, one row per kind of job. A
/// new kind is a row here (and a variant of `EndpointKind`), not a new
/// code path.
#[derive(Clone, Copy, Debug)]
pub struct Endpoint {
    pub path: &'static str,
    pub kind: EndpointKind,
}

pub const ENDPOINTS: &[Endpoint] = &[
    Endpoint { path: "/v1/chat/completions", kind: EndpointKind::Chat },
    Endpoint { path: "/v1/completions", kind: EndpointKind::Completion },
    Endpoint { path: "/v1/embeddings", kind: EndpointKind::Embedding },
    Endpoint { path: "/v1/responses", kind: EndpointKind::Responses },
    Endpoint { path: "/v1/rerank", kind: EndpointKind::Rerank },
];

#[derive(Clone)]
pub struct AppState {
    pub snapshots: Arc<SnapshotStore>,
    pub forwarder: Forwarder,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub registry: Arc<prometheus_client::registry::Registry>,
    pub max_body_bytes: usize,
    pub request_body_timeout: std::time::Duration,
    pub mode: routing::Mode,
    /// Request counter for rotating strategies.
    pub tickets: Arc<std::sync::atomic::AtomicU64>,
    /// Where answered requests are told, for the dashboard's tail.
    pub decisions: Arc<crate::report::DecisionLog>,
    pub auth: Arc<crate::auth::Auth>,
    pub ledger: Arc<crate::usage::Ledger>,
}

impl AppState {
    /// The caller of a request from `peer`, or the error that refuses it
    /// (counted).
    async fn authenticate(
        &self,
        headers: &HeaderMap,
        peer: IpAddr,
        snapshot: &RoutingSnapshot,
    ) -> Result<Caller, ApiError> {
        self.auth.authenticate(headers, peer, snapshot).await.map_err(|(refusal, error)| self.refused(refusal, error))
    }

    fn refused(&self, refusal: crate::auth::Refusal, error: ApiError) -> ApiError {
        self.metrics.auth_refusals.get_or_create(&crate::metrics::ReasonLabels { reason: refusal.as_str() }).inc();
        error
    }
}

/// A model the caller may not use is, to the caller, a model that does not
/// exist: the answer OpenAI gives, and no catalog leaks to a narrow key.
fn no_such_model(id: &str) -> ApiError {
    ApiError::new(
        ErrorKind::NotFound,
        format!("The model `{id}` does not exist or you do not have access to it."),
        "model_not_found",
    )
    .param("model")
}

/// The data plane's HTTP service for one client connection. Inference
/// requests go straight to their handler; everything else (models, health,
/// metrics, and any request the fast path does not take) goes through the
/// axum [`router`], which routes every path, inference included. Both are
/// wrapped by [`Edge`].
///
/// Why a fast path: axum's routing, middleware and boxed services cost
/// several allocations and about a tenth of the data plane's instructions
/// per request, for a choice among five fixed paths.
#[derive(Clone)]
pub struct Gateway {
    state: Arc<AppState>,
    router: Router,
    peer: SocketAddr,
}

impl Gateway {
    pub fn new(state: AppState) -> Gateway {
        let state = Arc::new(state);
        Gateway { router: router(Arc::clone(&state)), state, peer: SocketAddr::from(([0, 0, 0, 0], 0)) }
    }

    /// The service of one connection from `peer`.
    pub fn connection(&self, peer: SocketAddr) -> Gateway {
        Gateway { peer, ..self.clone() }
    }
}

impl hyper::service::Service<http::Request<hyper::body::Incoming>> for Gateway {
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<Box<dyn Future<Output = Result<Response, Self::Error>> + Send>>;

    fn call(&self, request: http::Request<hyper::body::Incoming>) -> Self::Future {
        let id = request_id(request.headers());
        let endpoint = ENDPOINTS.iter().find(|endpoint| endpoint.path == request.uri().path());
        match endpoint {
            // Its body read as hyper's own type: no boxing per request.
            Some(endpoint) if request.method() == Method::POST => {
                let handler = inference(Arc::clone(&self.state), endpoint.kind, request, id.clone(), self.peer.ip());
                Box::pin(Edge::new(id, handler))
            }
            Some(_) => Box::pin(Edge::new(id, method_not_allowed(request.map(Body::new)))),
            None => {
                let mut request = request.map(Body::new);
                request.extensions_mut().insert(Peer(self.peer));
                Box::pin(Edge::new(id, tower::ServiceExt::oneshot(self.router.clone(), request)))
            }
        }
    }
}

/// Every route but the inference endpoints, which a [`Gateway`] serves
/// itself. Requests reach it through a [`Gateway`], which gives them their
/// [`Peer`].
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(get_model))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// The client's address, for requests that go through the router.
#[derive(Clone, Copy, Debug)]
pub struct Peer(pub SocketAddr);

/// Without the connection's address (never, when served), failures share
/// one bucket.
fn peer_of(extensions: &http::Extensions) -> IpAddr {
    extensions.get::<Peer>().map_or(IpAddr::from([0, 0, 0, 0]), |peer| peer.0.ip())
}

pub(crate) use inferyes_proto::headers::REQUEST_ID;

/// The request's id: the client's own when it sent a usable one (text, at
/// most 128 bytes: it goes into log lines and records), else a fresh one.
fn request_id(headers: &HeaderMap) -> HeaderValue {
    headers
        .get(REQUEST_ID)
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.to_str().is_ok())
        .cloned()
        .unwrap_or_else(new_request_id)
}

pin_project_lite::pin_project! {
    /// Around every request:
    /// - the answer carries the request's `x-request-id`;
    /// - a bug does not reach the client as a dropped connection: a
    ///   panicking handler answers 500 in the OpenAI shape, and the panic is
    ///   logged.
    ///
    /// A future of its own, not an `async fn`: an async function keeps its
    /// argument and what it awaits apart, and the handler's future (a few
    /// kilobytes) would be held, and moved, twice.
    struct Edge<F> {
        id: Option<HeaderValue>,
        #[pin]
        handler: F,
    }
}

impl<F> Edge<F> {
    fn new(id: HeaderValue, handler: F) -> Edge<F> {
        Edge { id: Some(id), handler }
    }
}

impl<F, R> Future for Edge<F>
where
    F: Future<Output = R>,
    R: IntoResponse,
{
    type Output = Result<Response, std::convert::Infallible>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let this = self.project();
        let handler = this.handler;
        let mut response = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler.poll(cx))) {
            Ok(std::task::Poll::Pending) => return std::task::Poll::Pending,
            Ok(std::task::Poll::Ready(answer)) => answer.into_response(),
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                let id = this.id.as_ref().map(super::id_text).unwrap_or_default();
                tracing::error!(request_id = id, panic = %what, "request handler panicked");
                ApiError::new(ErrorKind::Internal, "internal error; the request was not completed", "internal_error")
                    .into_response()
            }
        };
        if let Some(id) = this.id.take() {
            response.headers_mut().insert(REQUEST_ID, id);
        }
        std::task::Poll::Ready(Ok(response))
    }
}

/// `req_` and 32 random hex digits, written in place (every request that
/// comes without an id needs one).
fn new_request_id() -> HeaderValue {
    let mut id = *b"req_00000000000000000000000000000000";
    super::write_hex(&mut id[4..], fastrand::u128(..));
    HeaderValue::from_bytes(&id).unwrap_or_else(|_| HeaderValue::from_static("req_unknown"))
}

async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    match state.snapshots.version() {
        Some(version) => (StatusCode::OK, format!("ready, snapshot version {version}\n")).into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "no routing snapshot yet\n").into_response(),
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let snapshot = state.snapshots.current();
    let mut text = String::new();
    let encoded = {
        let _one_at_a_time = state.metrics.scrape.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.metrics.observe(snapshot.as_deref(), state.snapshots.age_seconds());
        prometheus_client::encoding::text::encode(&mut text, &state.registry)
    };
    if encoded.is_err() {
        return (StatusCode::INTERNAL_SERVER_ERROR, "metrics could not be encoded\n").into_response();
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

async fn not_found(request: Request) -> ApiError {
    ApiError::new(ErrorKind::NotFound, format!("unknown path {}", request.uri().path()), "unknown_url")
}

async fn method_not_allowed(request: Request) -> ApiError {
    let mut error = ApiError::new(
        ErrorKind::BadRequest,
        format!("{} is not allowed on {}", request.method(), request.uri().path()),
        "method_not_allowed",
    );
    error.status = Some(StatusCode::METHOD_NOT_ALLOWED);
    error
}

fn not_ready() -> ApiError {
    ApiError::new(ErrorKind::Unavailable, "the data plane has no routing snapshot yet", "not_ready").retry_after(1)
}

fn model_object(entry: &CatalogEntry) -> serde_json::Value {
    let mut object = json!({
        "id": entry.id,
        "object": "model",
        "created": 0,
        "owned_by": "inferyes",
        "inferyes": {
            "state": if entry.warm_nodes > 0 { "warm" } else { "cold" },
            "warm_nodes": entry.warm_nodes,
            "nodes": entry.nodes,
            "context_window": entry.context_window,
        }
    });
    if let Some(model) = &entry.alias_of {
        object["inferyes"]["alias_of"] = json!(model);
    }
    object
}

async fn list_models(State(state): State<Arc<AppState>>, request: Request) -> Result<Response, ApiError> {
    let snapshot = state.snapshots.current().ok_or_else(not_ready)?;
    let caller = state.authenticate(request.headers(), peer_of(request.extensions()), &snapshot).await?;
    let data: Vec<_> = snapshot.catalog().iter().filter(|entry| caller.may_see(entry)).map(model_object).collect();
    Ok(axum::Json(json!({"object": "list", "data": data})).into_response())
}

async fn get_model(
    State(state): State<Arc<AppState>>,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
    request: Request,
) -> Result<Response, ApiError> {
    // axum's own rejection is plain text.
    let Path(id) = id.map_err(|rejection| {
        ApiError::new(
            ErrorKind::BadRequest,
            format!("the model id in the path is not usable: {rejection}"),
            "invalid_path",
        )
    })?;
    let snapshot = state.snapshots.current().ok_or_else(not_ready)?;
    let caller = state.authenticate(request.headers(), peer_of(request.extensions()), &snapshot).await?;
    let entry = snapshot.model(&id).filter(|entry| caller.may_see(entry)).ok_or_else(|| no_such_model(&id))?;
    Ok(axum::Json(model_object(entry)).into_response())
}

/// Serves one inference request and counts it.
async fn inference(
    state: Arc<AppState>,
    kind: EndpointKind,
    request: http::Request<hyper::body::Incoming>,
    request_id: HeaderValue,
    peer: IpAddr,
) -> Response {
    let started = std::time::Instant::now();
    let mut facts = RequestFacts::default();
    let span = tracing::info_span!(
        target: inferyes_proto::telemetry::SPAN_TARGET,
        "request",
        otel.name = request.uri().path(),
        otel.kind = "server",
        request_id = super::id_text(&request_id),
        model = tracing::field::Empty,
        node = tracing::field::Empty,
        route = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    );
    inferyes_proto::telemetry::continue_trace(&span, request.headers());
    let served = serve(&state, kind, request, request_id.clone(), peer, &mut facts);
    let response = match tracing::Instrument::instrument(served, span.clone()).await {
        Ok(response) => response,
        Err(error) => {
            facts.error_code = error.code.clone();
            error.into_response()
        }
    };
    if !response.status().is_success()
        && let Some(meter) = facts.meter.take()
    {
        meter.finish(response.status().as_u16(), crate::usage::Outcome::Error, None);
    }
    span.record("model", facts.model.as_str());
    // Label values are moved in and out of the label sets, not copied: a
    // family is looked up by reference.
    let labels = crate::metrics::RequestLabels {
        model: if facts.model_known { std::mem::take(&mut facts.model) } else { "_unknown".to_string() },
        node: response.headers().get(super::forward::NODE_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("").into(),
        status: response.status().as_u16(),
        route: super::forward::route_label(response.headers()),
    };
    state.metrics.requests.get_or_create(&labels).inc();
    span.record("node", labels.node.as_str());
    span.record("route", labels.route);
    span.record("http.response.status_code", response.status().as_u16());
    let crate::metrics::RequestLabels { model: label, node, route, .. } = labels;
    let elapsed = started.elapsed();
    // A stream's time to its first token is observed by its meter.
    let label = if response.status().is_success() && !facts.stream {
        let labels = crate::metrics::ModelLabels { model: label };
        state.metrics.request_seconds.get_or_create(&labels).observe(elapsed.as_secs_f64());
        labels.model
    } else {
        label
    };
    let latency_ms = u32::try_from(elapsed.as_millis()).unwrap_or(u32::MAX);
    let expected = response.extensions().get::<super::forward::ExpectedTtft>().copied().unwrap_or_default();
    let decision = || RoutingDecision {
        request_id: super::id_text(&request_id).to_string(),
        unix_ms: inferyes_proto::unix_ms(),
        model: if facts.model_known { label } else { facts.model },
        node_id: node,
        route: route.to_string(),
        status: u32::from(response.status().as_u16()),
        error_code: facts.error_code.unwrap_or_default(),
        latency_ms,
        stream: facts.stream,
        session_tag: facts.session.as_deref().map(inferyes_proto::session_tag).unwrap_or_default(),
        key_id: facts.key_id.unwrap_or_default(),
        // A whole answer's first token reaches the client with its end.
        ttft_ms: if response.status().is_success() { latency_ms } else { 0 },
        expected_ttft_ms: expected.ms,
        home_expected_ttft_ms: expected.home_ms,
    };
    match facts.meter.take() {
        Some(meter) if facts.stream && response.status().is_success() => {
            meter.report_at_end(decision(), Arc::clone(&state.decisions));
        }
        _ => state.decisions.record(decision),
    }
    response
}

/// What the metrics and the decision tail need to know of a request once
/// it is answered.
#[derive(Default)]
struct RequestFacts {
    /// The model asked for, resolved where it is an alias.
    model: String,
    /// The fleet knows it (else its metrics label is `_unknown`, so client
    /// chosen names cannot grow the label set).
    model_known: bool,
    stream: bool,
    session: Option<String>,
    error_code: Option<String>,
    key_id: Option<String>,
    /// Once the request is accepted: its usage record.
    meter: Option<crate::usage::Meter>,
}

/// Seconds until the next UTC midnight, when daily token budgets start over.
fn seconds_to_utc_midnight() -> u32 {
    let now_s = inferyes_proto::unix_ms() / 1000;
    u32::try_from(86_400 - now_s % 86_400).unwrap_or(86_400)
}

async fn serve(
    state: &AppState,
    kind: EndpointKind,
    request: http::Request<hyper::body::Incoming>,
    request_id: HeaderValue,
    peer: IpAddr,
    facts: &mut RequestFacts,
) -> Result<Response, ApiError> {
    let (parts, body) = request.into_parts();
    let snapshot = state.snapshots.current().ok_or_else(not_ready)?;
    let caller = state.authenticate(&parts.headers, peer, &snapshot).await?;
    facts.key_id = caller.key_id().map(str::to_string);
    let body = read_body(body, &parts.headers, state.max_body_bytes, state.request_body_timeout).await?;
    let view = parse_view(&body)?;
    let model = snapshot.resolve(&view.model);
    if !caller.may_use(&view.model) && !caller.may_use(model) {
        return Err(no_such_model(&view.model));
    }
    facts.model = model.to_string();
    facts.stream = view.stream;
    if snapshot.placements(model).is_none() {
        // Before the meter, by the test routing makes: the usage ledger
        // holds the fleet's models only, not every name a client sends.
        return Err(routing::model_not_found(&snapshot, model).into());
    }
    facts.model_known = true;
    let rate = state.auth.admit(&caller, std::time::Instant::now()).map_err(|(r, e)| state.refused(r, e))?;
    if let Caller::Key(grant) = &caller
        && grant.tokens_per_day > 0
    {
        let used = snapshot.tokens_today(&grant.key_id) + state.ledger.unacknowledged_tokens(&grant.key_id);
        if used >= grant.tokens_per_day {
            let error = ApiError::new(
                ErrorKind::RateLimited,
                format!(
                    "Rate limit reached for tokens: {} per day for this key, {used} used today (UTC).",
                    grant.tokens_per_day
                ),
                "rate_limit_exceeded",
            )
            .retry_after(seconds_to_utc_midnight());
            return Err(state.refused(crate::auth::Refusal::TokenBudget, error));
        }
    }
    let meter = crate::usage::Meter::new(
        Arc::clone(&state.ledger),
        super::id_text(&request_id),
        caller.key_id().map(str::to_string),
        model.to_string(),
        view.stream,
        u64::from(estimated_prompt_tokens(body.len(), &view)),
        view.stream.then(|| {
            let labels = crate::metrics::ModelLabels { model: model.to_string() };
            crate::usage::StreamTimers {
                first_token: state.metrics.first_token_seconds.get_or_create(&labels).clone(),
                whole: state.metrics.stream_seconds.get_or_create(&labels).clone(),
            }
        }),
    );
    facts.meter = Some(meter.clone());
    let result = route_and_forward(state, kind, parts, body, &view, model, &snapshot, request_id, facts, meter).await;
    let rate = rate.to_vec();
    match result {
        Ok(mut response) => {
            response.headers_mut().extend(rate);
            Ok(response)
        }
        Err(mut error) => {
            error.headers.extend(rate);
            Err(error)
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn route_and_forward(
    state: &AppState,
    kind: EndpointKind,
    parts: http::request::Parts,
    body: Bytes,
    view: &super::RoutingView,
    // The model the view names, an alias resolved.
    model: &str,
    snapshot: &Arc<RoutingSnapshot>,
    request_id: HeaderValue,
    facts: &mut RequestFacts,
    meter: crate::usage::Meter,
) -> Result<Response, ApiError> {
    let body = if model == view.model { body } else { with_model(&body, view, model) };
    // A stream that would end without usage is asked for it; the client,
    // which did not ask, does not see the extra chunk.
    let wants_usage =
        view.stream && matches!(kind, EndpointKind::Chat | EndpointKind::Completion) && !view.has_stream_options;
    let (body, strip_usage) = match wants_usage.then(|| super::view::with_usage_requested(&body)).flatten() {
        Some(spliced) => (spliced, true),
        None => (body, false),
    };
    // Kept in the request's facts (the decision tail shows it, whatever
    // becomes of the request) and read from there.
    facts.session = if keeps_conversations(kind) { session_key(&parts.headers, view) } else { None };
    let session = facts.session.as_deref();
    let ticket = state.tickets.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let route = routing::select(
        snapshot,
        &RouteRequest {
            model,
            kind,
            session,
            prompt_tokens: estimated_prompt_tokens(body.len(), view),
            mode: state.mode,
            ticket,
            now_ms: inferyes_proto::unix_ms(),
        },
    );
    let route = route?;
    let path_and_query = parts.uri.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
    if route.cold() && view.stream {
        tracing::debug!(request_id = super::id_text(&request_id), model, "cold load for a stream: answering at once");
        let outbound = OwnedOutbound {
            path_and_query,
            headers: parts.headers,
            body,
            model: model.to_string(),
            session: session.map(str::to_string),
            request_id,
            expects_done: expects_done(kind),
            meter: Some(meter),
            strip_usage,
        };
        return Ok(state.forwarder.forward_cold_stream(Arc::clone(snapshot), route, outbound));
    }
    let outbound = Outbound {
        path_and_query: &path_and_query,
        headers: parts.headers,
        body,
        model,
        session,
        request_id: &request_id,
        stream: view.stream,
        expects_done: expects_done(kind),
        continuation: view.stream
            && kind == EndpointKind::Chat
            && snapshot.policy().continues(model)
            && !view.constrained,
        meter: Some(meter),
        strip_usage,
    };
    let result = state.forwarder.forward(snapshot, &route, outbound).await;
    let request_id = super::id_text(&request_id);
    match &result {
        Ok(response) => tracing::debug!(
            request_id,
            model,
            route = route.reason.as_str(),
            status = %response.status(),
            "request routed"
        ),
        Err(error) => tracing::debug!(request_id, model, code = ?error.code, "request failed"),
    }
    result
}

/// Whether a kind's requests continue conversations, whose KV cache a node
/// keeps between turns. An embedding or a rerank leaves nothing worth
/// coming back to: a session key for it would only push conversations out
/// of its node's session table.
fn keeps_conversations(kind: EndpointKind) -> bool {
    matches!(kind, EndpointKind::Chat | EndpointKind::Completion | EndpointKind::Responses)
}

/// Chat and completion streams end with `data: [DONE]`; others (the
/// Responses API's typed events) end their own way.
fn expects_done(kind: EndpointKind) -> bool {
    matches!(kind, EndpointKind::Chat | EndpointKind::Completion)
}

/// Reads the whole body, refusing more than `limit` bytes with 413 before
/// reading it when the client announced its length.
async fn read_body(
    body: hyper::body::Incoming,
    headers: &http::HeaderMap,
    limit: usize,
    timeout: std::time::Duration,
) -> Result<Bytes, ApiError> {
    let too_large = || {
        ApiError::new(
            ErrorKind::PayloadTooLarge,
            format!("the request body is larger than the limit of {limit} bytes"),
            "request_too_large",
        )
    };
    let announced =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    // A body that came with its head is read without a timer ever being set.
    let Ok(read) = tokio::time::timeout(timeout, super::body::read_whole(body, limit)).await else {
        let mut error = ApiError::new(
            ErrorKind::BadRequest,
            format!("the request body did not arrive within {} s", timeout.as_secs_f32()),
            "request_timeout",
        );
        error.status = Some(http::StatusCode::REQUEST_TIMEOUT);
        return Err(error);
    };
    read.map_err(|error| match error {
        super::body::ReadError::TooLarge => too_large(),
        super::body::ReadError::Body(_) => {
            ApiError::new(ErrorKind::BadRequest, "the request body could not be read", "invalid_body")
        }
    })
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    #[test]
    fn request_ids_are_req_and_32_hex_digits_and_differ() {
        let (a, b) = (new_request_id(), new_request_id());
        for id in [&a, &b] {
            let id = id.to_str().unwrap();
            assert_eq!(id.len(), 36);
            assert!(
                id.starts_with("req_") && id[4..].bytes().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
            );
        }
        assert_ne!(a, b);
    }

    #[test]
    fn a_client_id_is_kept_only_where_it_is_text_and_short() {
        let id_of = |value: &[u8]| {
            let mut headers = HeaderMap::new();
            headers.insert(REQUEST_ID, HeaderValue::from_bytes(value).unwrap());
            request_id(&headers)
        };
        assert_eq!(id_of(b"client-7"), "client-7");
        assert_eq!(id_of(&[b'x'; 128]).len(), 128);
        for unusable in [&b""[..], &[b'x'; 129], b"caf\xc3\xa9"] {
            let id = id_of(unusable);
            assert!(id.to_str().unwrap().starts_with("req_"), "{unusable:?} gave {id:?}");
        }
        assert!(request_id(&HeaderMap::new()).to_str().unwrap().starts_with("req_"));
    }

    #[tokio::test]
    async fn a_panicking_handler_answers_500_in_the_openai_shape() {
        let id = HeaderValue::from_static("req_boom");
        let boom = async {
            if id.len() > 1 {
                panic!("bug");
            }
            "unreachable"
        };
        let response = Edge::new(id.clone(), boom).await.unwrap();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(response.headers()["x-request-id"], id);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["error"]["code"], "internal_error");
    }
}
