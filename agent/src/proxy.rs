//! The thin local proxy in front of the backends. Data planes send every
//! request here; the proxy picks the backend the data plane chose, adds the
//! backend's credential, and on the way sees what llama-server cannot tell
//! anyone: which conversation runs where, how many requests are in flight,
//! and the time to first token.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderName, Request, StatusCode, header};
use http_body::{Frame, SizeHint};
use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::Incoming;
use inferyes_net::admit::Admission;
use inferyes_net::pool::{self, Pool};
use inferyes_proto::{ErrorKind, openai_error_body};

use crate::slots::judge::{self, Unchecked};
use crate::state::{AgentState, BackendHandle};

use inferyes_proto::headers::REQUEST_ID as REQUEST_ID_HEADER;
/// Headers the data plane sets for the agent; never forwarded to backends.
pub use inferyes_proto::headers::{BACKEND as BACKEND_HEADER, MODEL as MODEL_HEADER, SESSION as SESSION_HEADER};

/// How long a connection to a backend may sit idle in the pool: well below
/// llama-server's keep-alive timeout (5 s, counted from when it wrote its
/// answer's end), so that the backend never closes one as a request goes
/// out. The pool counts from when the answer's end was read, which on a
/// busy host or behind a slow client comes later: at 4 s a request now
/// and then met the server's close and failed.
const BACKEND_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a backend's answer may go without a byte before the agent
/// breaks it off. A data plane has its own, configurable (`read_timeout_ms`,
/// ten minutes by default); this one is only there so that a backend that
/// hangs mid-answer holds none of the agent's requests and counts for ever.
const BACKEND_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15 * 60);

/// The largest request body the proxy keeps a copy of, to send it again
/// when a backend drops the connection it went out on (see
/// [`Pool::send_replayable`]). A chat of a hundred thousand tokens is
/// about half of it; a larger body streams through and is not sent again.
const KEPT_BODY_LIMIT: u64 = 1 << 20;
/// The most the proxy keeps of requests' bodies at once, all together:
/// past it a body streams through, as a large one does.
const KEPT_BYTES: usize = 256 << 20;
/// How long rendering and tokenizing a restored conversation's turn may
/// take the backend.
const JUDGE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// A request's body on its way to a backend: kept whole, or streamed.
type Upload = Either<Full<Bytes>, Incoming>;

#[derive(Clone)]
struct Proxy {
    state: Arc<AgentState>,
    /// This worker's connections to the backends.
    client: Pool<Upload>,
    scrape: Arc<Scrape>,
    /// Bytes of bodies kept to be sent again, all workers together.
    kept: Arc<std::sync::atomic::AtomicUsize>,
}

/// The agent's metrics and the registry they are encoded from.
pub struct Scrape {
    pub registry: prometheus_client::registry::Registry,
    pub metrics: crate::metrics::Metrics,
}

/// The admin port's routes: metrics for scrapers, health for probes.
pub fn admin_router(state: Arc<AgentState>, scrape: Arc<Scrape>) -> Router {
    Router::new().route(HEALTH, get(|| async { "ok\n" })).route("/metrics", get(metrics)).with_state((state, scrape))
}

/// Prometheus text, read from the agent's current view.
async fn metrics(State((state, scrape)): State<(Arc<AgentState>, Arc<Scrape>)>) -> Response {
    scrape.metrics.observe(&state);
    let mut text = String::new();
    if prometheus_client::encoding::text::encode(&mut text, &scrape.registry).is_err() {
        return (StatusCode::INTERNAL_SERVER_ERROR, "metrics could not be encoded\n").into_response();
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

/// The proxy's HTTP service, one per worker thread (each with its own pool
/// of connections to the backends). Every request is forwarded straight
/// to a backend, with its body as hyper read it; only the agent's health
/// goes through an axum router. Why not a router for all: its routing,
/// boxed services and boxed bodies cost several allocations and thousands
/// of instructions per request, to tell one path from the rest.
#[derive(Clone)]
pub struct Service {
    proxy: Proxy,
    router: Router,
    /// Takes other nodes' slots, on its own path and credential.
    intake: Arc<crate::slots::transfer::Intake>,
    /// Carries this node's conversations' slots where data planes ask.
    carrier: Arc<crate::slots::transfer::Carrier>,
    admission: Arc<Admission>,
    /// The connection's: its peer, and when a request on it last vouched
    /// for it (Unix seconds; 0: never).
    peer: std::net::IpAddr,
    vouched: Arc<AtomicU64>,
}

impl Service {
    pub fn new(
        state: Arc<AgentState>,
        scrape: Arc<Scrape>,
        admission: Arc<Admission>,
        intake: Arc<crate::slots::transfer::Intake>,
        carrier: Arc<crate::slots::transfer::Carrier>,
    ) -> Service {
        let client = Pool::new(pool::Settings {
            connect_timeout: std::time::Duration::from_secs(2),
            idle_timeout: BACKEND_IDLE_TIMEOUT,
            tls: None,
            read_timeout: BACKEND_READ_TIMEOUT,
            idle_limits: pool::IdleLimits::default(),
        });
        let proxy = Proxy { state, client, scrape, kept: Arc::default() };
        let router = Router::new().route(HEALTH, get(|| async { "ok\n" }));
        let (peer, vouched) = (std::net::Ipv4Addr::UNSPECIFIED.into(), Arc::default());
        Service { proxy, router, intake, carrier, admission, peer, vouched }
    }

    /// The service of one connection, from `peer`.
    pub fn connection(&self, peer: std::net::SocketAddr) -> Service {
        Service { peer: peer.ip(), vouched: Arc::default(), ..self.clone() }
    }
}

/// How often a connection's requests vouch for its peer again: well inside
/// [`inferyes_net::admit::VOUCHED_FOR`].
const REVOUCH_EVERY_SECS: u64 = inferyes_net::admit::VOUCHED_FOR.as_secs() / 4;

/// The agent's own path on the proxy's port. Data planes only forward
/// `/v1/*` here, so it never shadows a backend's.
const HEALTH: &str = "/healthz";

impl hyper::service::Service<Request<Incoming>> for Service {
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<Response, Self::Error>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        if request.uri().path() == HEALTH {
            let router = hyper_util::service::TowerToHyperService::new(self.router.clone());
            return Box::pin(hyper::service::Service::call(&router, request));
        }
        if request.uri().path() == crate::slots::transfer::INTAKE_PATH {
            let (intake, peer) = (Arc::clone(&self.intake), self.peer);
            return Box::pin(async move { Ok(intake.receive(request, peer).await) });
        }
        // The backends' GPUs are not open to whoever reaches this port.
        if self.proxy.state.closed
            && !self.proxy.state.admits(request.headers().get(header::AUTHORIZATION).map(|v| v.as_bytes()))
        {
            // Once in a while: a data plane given the wrong token would
            // otherwise log a line per request it sends.
            if self.proxy.state.issued.load().is_none() {
                inferyes_net::warn_every!("refused a request: no controller has issued this node its credential yet");
            } else {
                inferyes_net::warn_every!("refused a request without the credential this node was issued");
            }
            let message = "this node takes requests from the fleet's data planes only";
            let mut refusal = error(ErrorKind::Unauthenticated, message, inferyes_proto::bearer::FLEET_TOKEN_REQUIRED);
            refusal
                .headers_mut()
                .insert(inferyes_proto::bearer::AGENT_REFUSED, http::HeaderValue::from_static("credential"));
            // A stranger's connection is not kept for its next try.
            refusal.headers_mut().insert(header::CONNECTION, http::HeaderValue::from_static("close"));
            return Box::pin(std::future::ready(Ok(refusal)));
        }
        // A fleet member's connections are no longer counted as a
        // stranger's (see `inferyes_net::admit`), as long as it goes on
        // proving itself: vouched for again well before that lapses.
        let now = inferyes_proto::unix_ms() / 1000;
        if now.saturating_sub(self.vouched.load(Ordering::Relaxed)) >= REVOUCH_EVERY_SECS {
            self.vouched.store(now, Ordering::Relaxed);
            self.admission.vouch(self.peer);
        }
        // A data plane's, behind its credential, never a backend's.
        if request.uri().path() == crate::slots::transfer::CARRY_PATH {
            let carrier = Arc::clone(&self.carrier);
            return Box::pin(async move { Ok(carrier.carry(request).await) });
        }
        let proxy = self.proxy.clone();
        Box::pin(async move { Ok(forward(proxy, request).await) })
    }
}

/// What a connection the proxy does not take is sent before it is closed:
/// a whole HTTP/1.1 response, marked as the agent's own (a data plane
/// takes the request to another node without holding it against this
/// one).
pub fn connections_refusal() -> Bytes {
    let body = openai_error_body(
        ErrorKind::Overloaded,
        "this node holds all the connections it takes; try again",
        Some("overloaded"),
        None,
    );
    inferyes_net::serve::overloaded(
        "application/json",
        &body,
        Some((inferyes_proto::bearer::AGENT_REFUSED, "connections")),
    )
}

fn error(kind: ErrorKind, message: &str, code: &str) -> Response {
    let status = StatusCode::from_u16(kind.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = openai_error_body(kind, message, Some(code), None);
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn forward(proxy: Proxy, request: Request<Incoming>) -> Response {
    let span = tracing::info_span!(
        target: inferyes_net::telemetry::SPAN_TARGET,
        "proxy",
        otel.name = request.uri().path(),
        otel.kind = "server",
        backend = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    );
    inferyes_net::telemetry::continue_trace(&span, request.headers());
    tracing::Instrument::instrument(forward_in_span(proxy, request), span).await
}

async fn forward_in_span(proxy: Proxy, request: Request<Incoming>) -> Response {
    let span = tracing::Span::current();
    let (mut parts, body) = request.into_parts();
    let job = match Job::of(&proxy.state, &parts) {
        Ok(job) => job,
        Err(refused) => return refused.answer(),
    };
    let (handle, backend_id) = (job.handle, job.handle.probe.id.as_str());
    let origin = match addressed(handle, &mut parts) {
        Ok(origin) => origin,
        Err(refused) => return refused.answer(),
    };
    span.record("backend", backend_id);
    inferyes_net::telemetry::inject(&span, &mut parts.headers);

    // In flight from here: a turn waiting for its conversation's restore
    // holds its backend as much as one being answered, and the load the
    // node reports says so.
    let mut guard = InFlight::enter(Arc::clone(&proxy.state), job.index);
    let restored = match (&job.session, job.model()) {
        (Some(session), Some(model)) => {
            crate::slots::keeper::bring_back(&proxy.state, job.index, session, model).await;
            proxy.state.turn_begins(session, backend_id, model)
        }
        _ => None,
    };
    // For a log line: the request's span is a trace, not log context.
    let request_id = parts.headers.get(REQUEST_ID_HEADER).cloned();
    let started = Instant::now();
    let (sent, unchecked) = match send(&proxy, &job, (parts, body), origin, restored).await {
        Ok(sent) => sent,
        Err(refused) => return refused.answer(),
    };
    match sent {
        Ok(response) => {
            guard.served = response.status().is_success();
            let (mut parts, body) = response.into_parts();
            span.record("http.response.status_code", parts.status.as_u16());
            strip_answer_headers(&mut parts.headers);
            job.learn_from(&proxy.state, parts.status);
            // A stream's first event says part of its usage; a whole answer
            // says it once, at its end.
            let reads_head = job.row.usage == inferyes_proto::kinds::UsageIn::HeadAndTail
                && parts
                    .headers
                    .get(header::CONTENT_TYPE)
                    .is_some_and(|t| t.as_bytes().starts_with(b"text/event-stream"));
            let tracked = Tracked {
                _span: span.clone(),
                inner: body,
                guard,
                started,
                first_byte: false,
                session: job.session,
                unchecked,
                head: reads_head.then(Vec::new),
                tail: Vec::new(),
                scrape: Arc::clone(&proxy.scrape),
            };
            Response::from_parts(parts, Body::new(tracked))
        }
        Err(err) => {
            let request_id = request_id.as_ref().and_then(|v| v.to_str().ok()).unwrap_or_default();
            inferyes_net::warn_every!(gate: handle.log; request_id, backend = %backend_id, error = %err, "backend request failed");
            error(ErrorKind::Upstream, &format!("backend `{backend_id}` is unreachable"), "backend_unreachable")
        }
    }
}

/// A request this proxy does not send on, and why, as the error it answers.
struct Refused(ErrorKind, String, &'static str);

impl Refused {
    fn answer(self) -> Response {
        error(self.0, &self.1, self.2)
    }
}

/// What a request asks of this node: its job, the backend to do it, the
/// model and the conversation it names.
struct Job<'s> {
    row: &'static inferyes_proto::kinds::Row,
    handle: &'s BackendHandle,
    /// The backend's place in the node's list.
    index: usize,
    /// Shared, not copied.
    model_header: Option<http::HeaderValue>,
    /// Outlives the request: its residency is updated when the answer ends.
    session: Option<String>,
}

impl<'s> Job<'s> {
    /// Only the jobs a data plane sends, as it sends them: never the
    /// servers' own endpoints, which save, restore and erase
    /// conversations' caches (`/slots`, and llama-swap's
    /// `/upstream/<model>/...` to any of them) or change a server for
    /// everyone (`/props`, LoRA scales, model loads).
    fn of(state: &'s AgentState, parts: &http::request::Parts) -> Result<Job<'s>, Refused> {
        let Some(row) = inferyes_proto::kinds::row(parts.uri.path()).filter(|_| parts.method == http::Method::POST)
        else {
            return Err(Refused(ErrorKind::NotFound, "not a job this node serves".into(), "not_found"));
        };
        let model_header = parts.headers.get(MODEL_HEADER).cloned();
        // Data planes send no session key longer than this: a longer one
        // comes from a client that reached the proxy some other way, and is
        // left out so it cannot fill the residency table.
        let session = parts
            .headers
            .get(SESSION_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|v| v.len() <= inferyes_proto::headers::MAX_SESSION_KEY_BYTES)
            .map(str::to_string);
        let handle = match parts.headers.get(BACKEND_HEADER).and_then(|v| v.to_str().ok()) {
            Some(id) => state.backend(id),
            None => state.backend_for_model(model_header.as_ref().and_then(|v| v.to_str().ok())),
        };
        let Some(handle) = handle else {
            return Err(Refused(
                ErrorKind::NotFound,
                "no backend on this node serves the request".into(),
                "backend_not_found",
            ));
        };
        let index = state.backends.iter().position(|b| std::ptr::eq(b, handle)).unwrap_or(0);
        Ok(Job { row, handle, index, model_header, session })
    }

    fn model(&self) -> Option<&str> {
        self.model_header.as_ref().and_then(|v| v.to_str().ok())
    }

    /// llama-server's word for a job the model cannot do (infill without
    /// FIM tokens, embeddings from a chat server): routing is told, and
    /// sends no more of them here.
    fn learn_from(&self, state: &AgentState, status: StatusCode) {
        if status == StatusCode::NOT_IMPLEMENTED
            && let Some(model) = self.model()
            && inferyes_proto::kinds::refused_whole(self.row.kind)
            // An upstream provider's 501 may be about the request.
            && self.handle.probe.kind != crate::config::BackendKind::Openai
            && self.handle.learn_unsupported(model, self.row.kind, Instant::now())
        {
            state.changed.notify_one();
        }
    }
}

/// The request made the backend's: its URL, HTTP/1.1 (whatever a data
/// plane spoke to this proxy), its headers cleaned, the backend's host
/// and credential. The backend's origin, to send it to.
fn addressed<'h>(handle: &'h BackendHandle, parts: &mut http::request::Parts) -> Result<&'h pool::Origin, Refused> {
    let path = parts.uri.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
    let Some((uri, host, origin)) = handle.url.origin_form(&path) else {
        if handle.url.origin().is_none() {
            let message = format!("backend `{}` has a URL this agent cannot reach", handle.probe.id);
            return Err(Refused(ErrorKind::Upstream, message, "backend_unreachable"));
        }
        return Err(Refused(ErrorKind::BadRequest, "request path cannot be forwarded".into(), "invalid_path"));
    };
    parts.uri = uri;
    parts.version = http::Version::HTTP_11;
    strip_headers(&mut parts.headers);
    parts.headers.insert(header::HOST, host);
    if let Some(value) = &handle.authorization {
        parts.headers.insert(header::AUTHORIZATION, value.clone());
    }
    Ok(origin)
}

/// Sends the request to the backend; its body kept, where the backend
/// stops a job whose connection closes, to be sent once more if the
/// connection closed as it was written (an upstream provider may have
/// taken it), and to check a restored conversation's next turn by.
async fn send(
    proxy: &Proxy,
    job: &Job<'_>,
    (parts, body): (http::request::Parts, Incoming),
    origin: &pool::Origin,
    restored: Option<Arc<[i32]>>,
) -> Result<(Result<http::Response<pool::Incoming<Upload>>, pool::Error>, Option<Unchecked>), Refused> {
    let replays = job.handle.probe.kind != crate::config::BackendKind::Openai;
    let keeping = if replays { Keeping::reserve(&proxy.kept, &parts.headers) } else { None };
    let Some(keeping) = keeping else {
        return Ok((proxy.client.send(origin, Request::from_parts(parts, Either::Right(body))).await, None));
    };
    let Ok(kept) = collect(body).await else {
        // Its sender went away, or sent more than it said.
        return Err(Refused(
            ErrorKind::BadRequest,
            "the request's body did not arrive whole".into(),
            "body_incomplete",
        ));
    };
    let unchecked = restored.map(|restored| Unchecked { restored, body: kept.clone(), kind: job.row.kind });
    let again = copy(&parts, kept.clone());
    let request = Request::from_parts(parts, Either::Left(Full::new(kept)));
    let sent = proxy.client.send_replayable(origin, request, again).await;
    drop(keeping);
    Ok((sent, unchecked))
}

/// A body's bytes held in the proxy's count of kept bodies, until dropped.
struct Keeping {
    kept: Arc<std::sync::atomic::AtomicUsize>,
    bytes: usize,
}

impl Keeping {
    /// Room for the body `headers` head, where it says it is small enough
    /// to keep and the proxy keeps less than [`KEPT_BYTES`] now.
    fn reserve(kept: &Arc<std::sync::atomic::AtomicUsize>, headers: &HeaderMap) -> Option<Keeping> {
        let length = headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.parse::<u64>().ok()?;
        let bytes = usize::try_from(length).ok().filter(|_| length <= KEPT_BODY_LIMIT)?;
        let taken = kept.fetch_add(bytes, Ordering::Relaxed);
        if taken.saturating_add(bytes) > KEPT_BYTES {
            kept.fetch_sub(bytes, Ordering::Relaxed);
            return None;
        }
        Some(Keeping { kept: Arc::clone(kept), bytes })
    }
}

impl Drop for Keeping {
    fn drop(&mut self) {
        self.kept.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// A body said to be at most [`KEPT_BODY_LIMIT`] long, whole. hyper holds
/// it to its stated length; the limit makes that plain here.
async fn collect(body: Incoming) -> Result<Bytes, inferyes_net::pool::BodyError> {
    let limit = usize::try_from(KEPT_BODY_LIMIT).unwrap_or(usize::MAX);
    Ok(Limited::new(body, limit).collect().await?.to_bytes())
}

/// A second request, the same as the one `parts` heads, with `body`.
fn copy(parts: &http::request::Parts, body: Bytes) -> Request<Upload> {
    let mut request = Request::new(Either::Left(Full::new(body)));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = parts.uri.clone();
    *request.version_mut() = parts.version;
    *request.headers_mut() = parts.headers.clone();
    request
}

/// Takes out of a backend's answer its hop-by-hop headers, which are its
/// connection's (llama-server's `Connection: close` on every hundredth
/// answer would close the data plane's pooled connection to this proxy
/// too), and `AGENT_REFUSED`, which only the agent may say.
fn strip_answer_headers(headers: &mut HeaderMap) {
    inferyes_proto::headers::remove_hop_by_hop(headers);
    headers.remove(inferyes_proto::bearer::AGENT_REFUSED);
}

/// Takes out of a request, before it goes to a backend, the hop-by-hop
/// headers, the data plane's routing headers and the fleet's credential.
fn strip_headers(headers: &mut HeaderMap) {
    // `Host` is not here: the backend's own replaces it.
    static STRIPPED: [HeaderName; 6] = [
        header::PROXY_AUTHORIZATION,
        header::AUTHORIZATION,
        inferyes_proto::headers::API_KEY,
        BACKEND_HEADER,
        MODEL_HEADER,
        SESSION_HEADER,
    ];
    inferyes_proto::headers::remove_hop_by_hop_and(headers, |name| STRIPPED.contains(name));
}

/// Counts a request in flight until its response body is done or dropped
/// (a client that went away drops it, which also closes the backend
/// connection and so stops the generation).
struct InFlight {
    state: Arc<AgentState>,
    index: usize,
    /// The backend answered with a success: counted as finished.
    served: bool,
}

impl InFlight {
    fn enter(state: Arc<AgentState>, index: usize) -> InFlight {
        if let Some(b) = state.backends.get(index) {
            b.in_flight.fetch_add(1, Ordering::Relaxed);
        }
        InFlight { state, index, served: false }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(b) = self.state.backends.get(self.index) {
            b.in_flight.fetch_sub(1, Ordering::Relaxed);
            if self.served {
                b.finished.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// The backend's response body, passed through frame by frame, noting the
/// time to the first data frame.
struct Tracked {
    inner: pool::Incoming<Upload>,
    /// Also says which backend answers.
    guard: InFlight,
    started: Instant,
    first_byte: bool,
    /// The request's session, whose residency the response's usage updates.
    session: Option<String>,
    /// The request, where it is its session's first turn since a restore.
    unchecked: Option<Unchecked>,
    /// The first bytes of the body, where its path's answers say part of
    /// their usage (Anthropic's `message_start`).
    head: Option<Vec<u8>>,
    /// The last bytes of the body, where usage and timings are.
    tail: Vec<u8>,
    scrape: Arc<Scrape>,
    /// The hop's span ends with the body, not with its headers.
    _span: tracing::Span,
}

impl Tracked {
    fn backend(&self) -> Option<&BackendHandle> {
        self.guard.state.backends.get(self.guard.index)
    }

    fn keep_tail(&mut self, data: &[u8]) {
        if self.session.is_none() {
            return;
        }
        if let Some(head) = self.head.as_mut() {
            let room = inferyes_proto::usage::HEAD_BYTES.saturating_sub(head.len());
            head.extend_from_slice(&data[..data.len().min(room)]);
        }
        self.tail.extend_from_slice(data);
        if self.tail.len() > 2 * inferyes_proto::usage::TAIL_BYTES {
            let cut = self.tail.len() - inferyes_proto::usage::TAIL_BYTES;
            self.tail.drain(..cut);
        }
    }

    fn finished(&mut self) {
        let Some(session) = self.session.take() else { return };
        let usage = match &self.head {
            Some(head) => inferyes_proto::usage::parse_stream_usage(head, &self.tail),
            None => inferyes_proto::usage::parse_usage(&self.tail),
        };
        let Some(usage) = usage else { return };
        let state = Arc::clone(&self.guard.state);
        if let Some(backend) = state.backends.get(self.guard.index) {
            let check = state.residency.lock().record(&session, &backend.probe.id, usage);
            if let Some(check) = check {
                self.restore_checked(backend, &session, check);
            }
            if let Some(tier) = &backend.tier {
                tier.turn_ended(&session);
            }
        }
        state.changed.notify_one();
    }

    /// A restored conversation's first turn here said whether the restore
    /// held: counted; where it read next to nothing, the turn is looked at
    /// again (off the response's path), and a backend that did not hold a
    /// restore the turn carried on from takes no slots for a while. A turn
    /// that sent another history is a new branch, and costs no backend
    /// anything.
    fn restore_checked(&mut self, backend: &BackendHandle, session: &str, check: crate::residency::RestoreCheck) {
        use crate::residency::RestoreCheck;
        let (restored, cached) = match check {
            RestoreCheck::Held { .. } => return self.scrape.metrics.slots.restore_checked(backend, "held"),
            RestoreCheck::ReusedNothing { restored, cached } => (restored, cached),
        };
        let (Some(turn), Ok(runtime)) = (self.unchecked.take(), tokio::runtime::Handle::try_current()) else {
            return self.scrape.metrics.slots.restore_checked(backend, "unjudged");
        };
        let (state, index, scrape) = (Arc::clone(&self.guard.state), self.guard.index, Arc::clone(&self.scrape));
        let session = session.to_string();
        runtime.spawn(async move {
            let Some(backend) = state.backends.get(index) else { return };
            let client = crate::probe::ProbeClient::new(JUDGE_TIMEOUT);
            let outcome = match judge::continues(&client, &backend.probe.url, &backend.probe.api_key, &turn).await {
                Some(true) => {
                    backend.restores_reused_nothing.fetch_add(1, Ordering::Relaxed);
                    backend.restore_failed_unix_ms.store(inferyes_proto::unix_ms(), Ordering::Relaxed);
                    state.changed.notify_one();
                    tracing::warn!(
                        backend = %backend.probe.id,
                        session,
                        restored,
                        cached,
                        "a restored slot's next turn carried on from it and read next to nothing from cache: this \
                         backend takes no slots for 10 minutes"
                    );
                    "reused_nothing"
                }
                Some(false) => "diverged",
                None => "unjudged",
            };
            scrape.metrics.slots.restore_checked(backend, outcome);
        });
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        // Bodies that end with their last data frame are not polled again.
        self.finished();
    }
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = inferyes_net::pool::BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_frame(cx);
        match &poll {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    // llama-server's prompt progress, which a data plane
                    // asks for, comes before the first token.
                    if !this.first_byte && !inferyes_proto::usage::only_progress(data) {
                        this.first_byte = true;
                        let ttft = this.started.elapsed().as_secs_f64();
                        if let Some(backend) = this.backend() {
                            this.scrape.metrics.first_byte_seconds.get_or_create(&backend.labels).observe(ttft);
                            tracing::debug!(backend = %backend.probe.id, ttft_ms = ttft * 1000.0, "first byte from backend");
                        }
                    }
                    this.keep_tail(data);
                }
                if this.inner.is_end_stream() {
                    this.finished();
                }
            }
            Poll::Ready(None) => this.finished(),
            _ => {}
        }
        poll
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn hop_by_hop_routing_and_credential_headers_stay_behind_and_the_rest_go_on() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, x-hop"));
        headers.insert(HeaderName::from_static("x-hop"), HeaderValue::from_static("1"));
        headers.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer sk-client"));
        headers.insert(HeaderName::from_static("x-api-key"), HeaderValue::from_static("ify_client"));
        headers.insert(BACKEND_HEADER, HeaderValue::from_static("main"));
        headers.insert(MODEL_HEADER, HeaderValue::from_static("llama"));
        headers.insert(SESSION_HEADER, HeaderValue::from_static("chat-1"));
        headers.insert(header::USER_AGENT, HeaderValue::from_static("OpenAI/Python"));
        headers.insert(HeaderName::from_static("x-stainless-lang"), HeaderValue::from_static("python"));
        strip_headers(&mut headers);
        let left: std::collections::BTreeSet<&str> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["user-agent", "x-stainless-lang"].into());
    }

    #[test]
    fn a_backend_cannot_say_what_only_the_agent_says() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        headers.insert(inferyes_proto::bearer::AGENT_REFUSED, HeaderValue::from_static("credential"));
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        strip_answer_headers(&mut headers);
        let left: std::collections::BTreeSet<&str> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["content-type"].into());
    }
}
