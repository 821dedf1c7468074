//! Sending a routed request to a node's agent proxy and streaming the
//! answer back frame by frame.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, header};
use http_body::{Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use inferyes_proto::ErrorKind;
use inferyes_proto::base_url::BaseUrl;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use super::ApiError;
use super::continuation::{self, Hop, Resume};
use super::upstream;
use crate::routing::{Route, RouteReason};
use crate::snapshot::{LocalCounters, RoutingSnapshot};
use crate::usage::{Meter, Outcome};

pub const NODE_HEADER: HeaderName = HeaderName::from_static("x-inferyes-node");
pub const ROUTE_HEADER: HeaderName = HeaderName::from_static("x-inferyes-route");
/// The route of an answer from a node other than the first choice.
const FAILOVER: &str = "failover";

/// What routing expected the first token to cost, in ms, where it was
/// weighed: on the node chosen, and at the home a moved session left.
/// Travels in the answer's extensions to the decision report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpectedTtft {
    pub ms: u32,
    pub home_ms: u32,
}
use inferyes_proto::headers::{BACKEND as BACKEND_HEADER, MODEL as MODEL_HEADER, SESSION as SESSION_HEADER};

/// Error bodies are small; a backend sending a huge one is cut off.
const MAX_ERROR_BODY: usize = 64 << 10;
/// Non-streamed answers are read whole before they are passed on.
const MAX_BUFFERED_BODY: usize = 256 << 20;

type Http2Client = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// An agent's answer, as it comes.
pub(crate) type Answer = inferyes_proto::pool::Incoming<Full<Bytes>>;

#[derive(Clone)]
pub struct Forwarder {
    /// To agents at `http://` and, with TLS, `https://` proxy URLs, over
    /// HTTP/1.1: this worker's pool of connections.
    http1: inferyes_proto::pool::Pool<Full<Bytes>>,
    /// The same over HTTP/2, for agents that take it (unless configured
    /// off): one connection per agent carries every request.
    http2: Option<Http2Client>,
    header_timeout: Duration,
    /// The fleet's join token, which agents ask of every request.
    agent_authorization: Option<HeaderValue>,
    /// Cancelled when a shutdown's grace period is over: streams still
    /// running end with an error event.
    hard_stop: CancellationToken,
    pub(crate) metrics: Arc<crate::metrics::Metrics>,
}

/// What the forwarder needs to know about one request.
pub struct Outbound<'a> {
    pub path_and_query: &'a PathAndQuery,
    /// The client's: each attempt makes its own from them
    /// ([`upstream_headers`]), the last one in place.
    pub headers: HeaderMap,
    pub body: Bytes,
    pub model: &'a str,
    pub session: Option<&'a str>,
    pub request_id: &'a HeaderValue,
    /// The client asked for a stream.
    pub stream: bool,
    /// A stream of this kind ends with `data: [DONE]`.
    pub expects_done: bool,
    /// Resume this stream on another node if it breaks (see continuation).
    pub continuation: bool,
    /// Records the request's usage once, when its answer ends.
    pub meter: Option<Meter>,
    /// The body asks for usage the client did not ask for: take its chunk
    /// out of the stream.
    pub strip_usage: bool,
}

impl Forwarder {
    /// A forwarder as `config` says, with `tls` made of its settings.
    pub fn new(
        config: &crate::Config,
        tls: rustls::ClientConfig,
        agent_authorization: Option<HeaderValue>,
        hard_stop: CancellationToken,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> Forwarder {
        let (connect_timeout, header_timeout) = (config.connect_timeout(), config.response_header_timeout());
        let (read_timeout, protocol) = (config.read_timeout(), config.agent_protocol);
        let http1 = inferyes_proto::pool::Pool::new(inferyes_proto::pool::Settings {
            connect_timeout,
            idle_timeout: inferyes_proto::serve::CLIENT_IDLE_TIMEOUT,
            tls: Some(Arc::new(tls.clone())),
            read_timeout,
        });
        let mut tcp = HttpConnector::new();
        tcp.set_nodelay(true);
        tcp.set_connect_timeout(Some(connect_timeout));
        // The TCP connector passes `https://` on to rustls.
        tcp.enforce_http(false);
        let http2 = (protocol == crate::config::AgentProtocol::Http2).then(|| {
            // One connection carries every request to an agent, so a dead
            // one must be noticed without waiting for a request's header
            // timeout: pings, answered within a few seconds.
            Client::builder(TokioExecutor::new())
                .http2_only(true)
                .timer(hyper_util::rt::TokioTimer::new())
                .http2_keep_alive_interval(Duration::from_secs(10))
                .http2_keep_alive_timeout(Duration::from_secs(5))
                .http2_keep_alive_while_idle(true)
                // Credit for what clients have not read yet: a stream holds
                // at most 1 MiB, and a few clients that stop reading must not
                // use up the whole connection's (every request to the node).
                .http2_initial_stream_window_size(1 << 20)
                .http2_initial_connection_window_size(64 << 20)
                .pool_idle_timeout(Duration::from_secs(90))
                .build(
                    hyper_rustls::HttpsConnectorBuilder::new()
                        .with_tls_config(tls)
                        .https_or_http()
                        .enable_http2()
                        .wrap_connector(tcp),
                )
        });
        Forwarder { http1, http2, header_timeout, agent_authorization, hard_stop, metrics }
    }

    /// One request to a node's proxy, up to its answer's head: over HTTP/2
    /// where the node takes it, else on a pooled HTTP/1.1 connection.
    async fn request(
        &self,
        proxy_url: &BaseUrl,
        proxy_http2: bool,
        backend: Option<&HeaderValue>,
        out: &Outbound<'_>,
        mut headers: HeaderMap,
        body: Bytes,
    ) -> Result<Result<http::Response<Answer>, BoxError>, ApiError> {
        // The client's own stayed behind ([`upstream_headers`]).
        if let Some(value) = &self.agent_authorization {
            headers.insert(header::AUTHORIZATION, value.clone());
        }
        let internal = || ApiError::new(ErrorKind::Internal, "cannot build the upstream request", "internal_error");
        let body = Full::new(body);
        if let Some(http2) = self.http2.as_ref().filter(|_| proxy_http2) {
            let (uri, host) = proxy_url.uri(out.path_and_query).ok_or_else(internal)?;
            let request = upstream_request(uri, host, backend, headers, body);
            return Ok(match http2.request(request).await {
                Ok(response) => Ok(response.map(|body| self.http1.unpooled(body))),
                Err(error) => Err(error.into()),
            });
        }
        let (uri, host, origin) = proxy_url.origin_form(out.path_and_query).ok_or_else(internal)?;
        let request = upstream_request(uri, host, backend, headers, body);
        Ok(self.http1.send(origin, request).await.map_err(BoxError::from))
    }

    /// Tries the route's targets in order. A target that cannot be reached,
    /// or answers 502/503 before anything reached the client, is skipped
    /// for the next; once a response is passed on there is no retry.
    pub async fn forward(
        &self,
        snapshot: &RoutingSnapshot,
        route: &Route,
        mut out: Outbound<'_>,
    ) -> Result<Response, ApiError> {
        let mut last_error: Option<ApiError> = None;
        // The client's headers made into a node's once, in place: every
        // attempt sends the same.
        out.headers = upstream_headers(std::mem::take(&mut out.headers), &out);
        for (attempt, target) in route.targets.iter().enumerate() {
            let Some(node) = snapshot.node(target.node) else { continue };
            let Some(backend) = node.backends.get(target.backend) else { continue };
            if attempt > 0 {
                self.metrics.retries.inc();
            }
            if let Some(meter) = &out.meter {
                meter.node(&node.id);
            }
            // A cold load holds the model's size against the node until it
            // answers: the first target's, or one a failover goes on to.
            let reserve = if route.loads_at(attempt) { cold_load_bytes(snapshot, out.model, *target) } else { 0 };
            let guard = if reserve > 0 {
                InFlight::loading(Arc::clone(&node.local), target.backend, out.model, reserve)
            } else {
                InFlight::enter(Arc::clone(&node.local))
            };
            let is_last = attempt + 1 == route.targets.len();
            // The last attempt takes the headers and the body; one before it,
            // copies (a failover needs them again; the body's first copy
            // allocates).
            let (headers, body) = if is_last {
                (std::mem::take(&mut out.headers), std::mem::take(&mut out.body))
            } else {
                (out.headers.clone(), out.body.clone())
            };
            let backend = backend.id_header.as_ref();
            let request = self.request(&node.proxy_url, node.proxy_http2, backend, &out, headers, body);
            let reason = if attempt == 0 { route.reason.as_str() } else { FAILOVER };
            // An error from this node says which node it was, as an answer would.
            let from_node = |mut error: ApiError| {
                if let Some(value) = &node.id_header {
                    error.headers.push((NODE_HEADER, value.clone()));
                }
                error.headers.push((ROUTE_HEADER, HeaderValue::from_static(reason)));
                error
            };
            let Ok(sent) = tokio::time::timeout(self.header_timeout, request).await else {
                // The timeout is the request's whole wait for an answer to
                // start (a non-streamed generation can take minutes): no
                // time is left to try another node. This one is held out of
                // routing for a while, as an unreachable one is.
                let ejected_ms = node.local.eject(inferyes_proto::unix_ms(), snapshot.version());
                tracing::warn!(request_id = super::id_text(out.request_id), node = %node.id, ejected_ms, "node did not answer in time");
                return Err(from_node(ApiError::new(
                    ErrorKind::Timeout,
                    format!("node `{}` did not answer within {:?}", node.id, self.header_timeout),
                    "upstream_timeout",
                )));
            };
            let response = match sent? {
                Err(error) => {
                    let ejected_ms = node.local.eject(inferyes_proto::unix_ms(), snapshot.version());
                    tracing::warn!(request_id = super::id_text(out.request_id), node = %node.id, %error, ejected_ms, "node unreachable; trying the next candidate");
                    last_error = Some(ApiError::new(
                        ErrorKind::Upstream,
                        format!("node `{}` is unreachable", node.id),
                        "upstream_unreachable",
                    ));
                    continue;
                }
                Ok(response) => response,
            };
            let status = response.status();
            if status.is_client_error() || status.is_server_error() {
                let mut error = read_error(response).await;
                // An agent that does not take this data plane's join token:
                // the fleet's setup at fault, not the client's key (an SDK
                // reads a 401 as that). Another node may take it.
                let misconfigured = status == http::StatusCode::UNAUTHORIZED
                    && error.code.as_deref() == Some(inferyes_proto::bearer::FLEET_TOKEN_REQUIRED);
                if misconfigured {
                    tracing::error!(node = %node.id, "the node's agent refused this data plane's join token: give both the same (join_token_file)");
                    error = ApiError::new(
                        ErrorKind::Upstream,
                        format!("node `{}` does not take this gateway's join token", node.id),
                        "upstream_auth_misconfigured",
                    );
                }
                let refused = misconfigured
                    || status == http::StatusCode::BAD_GATEWAY
                    || status == http::StatusCode::SERVICE_UNAVAILABLE;
                // llama-swap's per-model limit is a refusal too, passed on
                // where no other node is left; other 429s (a client's own
                // limit) are the client's to see.
                let busy =
                    status == http::StatusCode::TOO_MANY_REQUESTS && error.code.as_deref() == Some("concurrency_limit");
                if refused {
                    let ejected_ms = node.local.eject(inferyes_proto::unix_ms(), snapshot.version());
                    tracing::warn!(request_id = super::id_text(out.request_id), node = %node.id, %status, ejected_ms, "node refused before the first byte");
                }
                if (refused || busy) && !is_last {
                    last_error = Some(error);
                    continue;
                }
                if status == http::StatusCode::SERVICE_UNAVAILABLE && error.retry_after.is_none() {
                    error.retry_after = Some(1);
                }
                return Err(from_node(error));
            }
            if status.is_success() {
                node.local.succeeded();
            }
            let (mut parts, body) = response.into_parts();
            inferyes_proto::headers::remove_hop_by_hop(&mut parts.headers);
            if let Some(value) = &node.id_header {
                parts.headers.insert(NODE_HEADER, value.clone());
            }
            parts.headers.insert(ROUTE_HEADER, HeaderValue::from_static(reason));
            if attempt == 0 {
                // For the decision's report only: a client is not told how
                // loaded the fleet is.
                parts
                    .extensions
                    .insert(ExpectedTtft { ms: route.expected_ttft_ms, home_ms: route.home_expected_ttft_ms });
            }
            if !out.stream {
                // A whole answer or none: read it before the client sees a
                // byte, so a node failing mid-answer is a clean 502 (or the
                // next candidate), never a truncated body.
                match super::body::read_whole(body, MAX_BUFFERED_BODY).await {
                    Ok(bytes) => {
                        drop(guard);
                        if let Some(meter) = &out.meter {
                            let tail = &bytes[bytes.len().saturating_sub(inferyes_proto::usage::TAIL_BYTES)..];
                            let outcome = if status.is_success() { Outcome::Ok } else { Outcome::Error };
                            meter.finish(status.as_u16(), outcome, inferyes_proto::usage::parse_usage(tail));
                        }
                        // The node's length stands where it is the body's (the
                        // usual case: its header is passed on, not written
                        // anew); hyper writes the body's own otherwise.
                        let announced = parts.headers.get(header::CONTENT_LENGTH).map(HeaderValue::as_bytes);
                        if announced.is_none_or(|length| !is_decimal(length, bytes.len())) {
                            parts.headers.remove(header::CONTENT_LENGTH);
                        }
                        return Ok(Response::from_parts(parts, Body::from(bytes)));
                    }
                    Err(super::body::ReadError::TooLarge) => {
                        // The node is well; the answer is too big to hold.
                        // Another node would give as big a one.
                        return Err(from_node(ApiError::new(
                            ErrorKind::Upstream,
                            format!(
                                "the answer from node `{}` is over {} MiB; ask for it streamed",
                                node.id,
                                MAX_BUFFERED_BODY >> 20
                            ),
                            "upstream_answer_too_large",
                        )));
                    }
                    Err(error) => {
                        let ejected_ms = node.local.eject(inferyes_proto::unix_ms(), snapshot.version());
                        tracing::warn!(request_id = super::id_text(out.request_id), node = %node.id, %error, ejected_ms, "node failed mid-answer; trying the next candidate");
                        last_error = Some(ApiError::new(
                            ErrorKind::Upstream,
                            format!("node `{}` failed in the middle of its answer", node.id),
                            "upstream_broken",
                        ));
                        continue;
                    }
                }
            }
            // A streamed answer is passed on frame by frame and may change on
            // the way (usage taken out, an error event added): its length is
            // not the node's. Without one, the client's connection also
            // reads to the end, where the answer is metered and checked.
            parts.headers.remove(header::CONTENT_LENGTH);
            let event_stream = parts
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("text/event-stream"));
            // The nodes a broken stream may go on at: listed only for a
            // stream that may be continued (each costs a few counts shared
            // between the workers).
            let hops: std::collections::VecDeque<Hop> = if out.continuation && event_stream {
                route.targets[attempt + 1..]
                    .iter()
                    .filter_map(|t| {
                        let node = snapshot.node(t.node)?;
                        let backend = node.backends.get(t.backend)?;
                        Some(Hop {
                            node: Arc::clone(&node.id),
                            proxy_url: node.proxy_url.clone(),
                            proxy_http2: node.proxy_http2,
                            backend: backend.id_header.clone(),
                            local: Arc::clone(&node.local),
                        })
                    })
                    .collect()
            } else {
                std::collections::VecDeque::new()
            };
            if !hops.is_empty() {
                let resume = Resume {
                    forwarder: self.clone(),
                    path_and_query: out.path_and_query.clone(),
                    headers: std::mem::take(&mut out.headers),
                    body: std::mem::take(&mut out.body),
                    model: out.model.to_string(),
                    session: out.session.map(str::to_string),
                    request_id: out.request_id.clone(),
                    hops,
                    version: snapshot.version(),
                    hard_stop: self.hard_stop.clone(),
                    meter: out.meter.clone(),
                    strip_usage: out.strip_usage,
                };
                let body = continuation::spawn(body, guard, Arc::clone(&node.id), resume);
                return Ok(Response::from_parts(parts, body));
            }
            let body = Guarded {
                inner: body,
                guard,
                event_stream,
                node: Arc::clone(&node.id),
                ended: false,
                hard_stop: Box::pin(self.hard_stop.clone().cancelled_owned()),
                version: snapshot.version(),
                expects_done: out.expects_done,
                tail: Vec::new(),
                _span: tracing::Span::current(),
                request_id: out.request_id.clone(),
                meter: out.meter.clone(),
                status: status.as_u16(),
                strip_usage: out.strip_usage,
                events: super::sse::Events::default(),
            };
            return Ok(Response::from_parts(parts, Body::new(body)));
        }
        Err(last_error.unwrap_or_else(|| {
            ApiError::new(ErrorKind::Unavailable, "no node could take the request", "no_capacity").retry_after(1)
        }))
    }
}

impl Forwarder {
    /// One request to one node's agent, up to its response headers.
    pub(crate) async fn send(
        &self,
        proxy_url: &BaseUrl,
        proxy_http2: bool,
        backend: Option<&HeaderValue>,
        mut out: Outbound<'_>,
    ) -> Result<http::Response<Answer>, ApiError> {
        let unreachable = || ApiError::new(ErrorKind::Upstream, "the node is unreachable", "upstream_unreachable");
        let headers = upstream_headers(std::mem::take(&mut out.headers), &out);
        let body = std::mem::take(&mut out.body);
        let request = self.request(proxy_url, proxy_http2, backend, &out, headers, body);
        match tokio::time::timeout(self.header_timeout, request).await {
            Ok(result) => result?.map_err(|_| unreachable()),
            Err(_) => Err(unreachable()),
        }
    }
}

/// The memory `model` will take on `target`, where no load of it has
/// started (0 where one has, which the node's report counts already, or
/// where its size is not known).
fn cold_load_bytes(snapshot: &RoutingSnapshot, model: &str, target: crate::snapshot::Target) -> u64 {
    snapshot
        .placements(model)
        .and_then(|ps| ps.iter().find(|p| p.target == target))
        .filter(|p| p.state == inferyes_proto::v1::ModelState::Unloaded)
        .map_or(0, |p| p.size_bytes)
}

/// Whether `text` is `n`, in decimal digits only.
fn is_decimal(text: &[u8], n: usize) -> bool {
    !text.is_empty()
        && text.iter().try_fold(0usize, |value, &digit| {
            digit.is_ascii_digit().then_some(())?;
            value.checked_mul(10)?.checked_add(usize::from(digit - b'0'))
        }) == Some(n)
}

/// Why a node's proxy gave no answer.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The client's headers made into those a node is sent, in place: what
/// stays behind taken out, ours put in. A client sends a dozen headers or
/// more (the OpenAI SDKs, 17) and few of them stay behind: taking those out
/// is much cheaper than copying all the others into a new map, and a copy
/// (for an attempt a failover may follow) is cheapest as a clone, whose
/// names are not hashed again. `Host`, the length and the backend are the
/// attempt's own ([`upstream_request`]).
fn upstream_headers(mut headers: HeaderMap, out: &Outbound<'_>) -> HeaderMap {
    inferyes_proto::headers::remove_hop_by_hop_and(&mut headers, stays_behind);
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(super::server::REQUEST_ID, out.request_id.clone());
    if let Ok(v) = HeaderValue::from_str(out.model) {
        headers.insert(MODEL_HEADER, v);
    }
    if let Some(v) = out.session.and_then(|s| HeaderValue::from_str(s).ok()) {
        headers.insert(SESSION_HEADER, v);
    }
    inferyes_proto::telemetry::inject(&tracing::Span::current(), &mut headers);
    headers
}

/// One attempt's request: `headers` from [`upstream_headers`], with this
/// node's `Host` and backend, and the body's length.
fn upstream_request(
    uri: http::Uri,
    host: HeaderValue,
    backend: Option<&HeaderValue>,
    mut headers: HeaderMap,
    body: Full<Bytes>,
) -> Request<Full<Bytes>> {
    headers.insert(header::HOST, host);
    // A client's own `x-inferyes-*` stayed behind: only the route's backend.
    if let Some(v) = backend {
        headers.insert(BACKEND_HEADER, v.clone());
    }
    // The client's length stands where it is the body's, alone (the usual
    // case; an alias or a usage request rewritten in the body changes it,
    // and an HTTP/2 client may repeat it, which a proxy must not pass on).
    let length = http_body::Body::size_hint(&body).exact().and_then(|n| usize::try_from(n).ok()).unwrap_or(0);
    let mut lengths = headers.get_all(header::CONTENT_LENGTH).iter();
    let single = lengths.next().filter(|_| lengths.next().is_none());
    if !single.is_some_and(|v| is_decimal(v.as_bytes(), length)) {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    }
    let mut request = Request::new(body);
    *request.method_mut() = Method::POST;
    *request.uri_mut() = uri;
    *request.headers_mut() = headers;
    request
}

/// The route label of an answer: the reason its [`ROUTE_HEADER`] gives, one
/// of a fixed set; `none` for an answer no node gave (an error of ours).
pub(crate) fn route_label(headers: &HeaderMap) -> &'static str {
    let Some(route) = headers.get(ROUTE_HEADER) else { return "none" };
    RouteReason::ALL
        .map(RouteReason::as_str)
        .into_iter()
        .chain([FAILOVER])
        .find(|reason| reason.as_bytes() == route.as_bytes())
        .unwrap_or("none")
}

/// Client headers that do not travel on, besides the hop-by-hop ones: the
/// client's credential (the agent adds the backend's own), and our routing
/// headers. `Host` and `Content-Length` are written anew for each attempt.
fn stays_behind(name: &HeaderName) -> bool {
    matches!(*name, header::PROXY_AUTHORIZATION | header::AUTHORIZATION) || name.as_str().starts_with("x-inferyes-")
}

/// The error a non-success response carries, in the OpenAI shape, with its
/// `Retry-After` kept; whatever the body type.
async fn read_error<B>(response: http::Response<B>) -> ApiError
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let status = response.status();
    let retry_after =
        response.headers().get(header::RETRY_AFTER).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u32>().ok());
    let body = super::body::read_whole(response.into_body(), MAX_ERROR_BODY).await.unwrap_or_default();
    let mut error = upstream::normalize(status, &body);
    error.retry_after = retry_after;
    error
}

/// Counts a request (and the memory of a cold load it waits on) against
/// its node until the response body is finished or dropped.
pub(crate) struct InFlight {
    pub(crate) local: Arc<LocalCounters>,
    /// The backend and model whose load it waits on.
    loading: Option<(usize, Box<str>)>,
}

impl InFlight {
    pub(crate) fn enter(local: Arc<LocalCounters>) -> InFlight {
        local.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight { local, loading: None }
    }

    /// A request that waits on `model` loading on `backend`, of `bytes`.
    pub(crate) fn loading(local: Arc<LocalCounters>, backend: usize, model: &str, bytes: u64) -> InFlight {
        local.hold_load(backend, model, bytes);
        let mut guard = InFlight::enter(local);
        guard.loading = Some((backend, model.into()));
        guard
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.local.in_flight.fetch_sub(1, Ordering::Relaxed);
        if let Some((backend, model)) = &self.loading {
            self.local.release_load(*backend, model);
        }
    }
}

/// A streamed answer on its way to the client. When the node fails in the
/// middle of an event stream, the client gets a final error event and a
/// clean end instead of a cut connection.
struct Guarded {
    inner: Answer,
    guard: InFlight,
    event_stream: bool,
    node: Arc<str>,
    ended: bool,
    hard_stop: Pin<Box<WaitForCancellationFutureOwned>>,
    /// The snapshot the request was routed on, for an ejection.
    version: u64,
    /// Chat and completion streams end with `data: [DONE]` (or an error
    /// event); the last bytes tell whether this one did.
    expects_done: bool,
    tail: Vec<u8>,
    /// The request's span ends with the stream, not with its headers.
    _span: tracing::Span,
    request_id: HeaderValue,
    meter: Option<Meter>,
    status: u16,
    /// The data plane asked for usage the client did not: its chunk is
    /// taken out, which needs whole events (`events` keeps a partial one).
    strip_usage: bool,
    events: super::sse::Events,
}

/// Enough of a stream's end to see its last events, usage included.
const TAIL_BYTES: usize = inferyes_proto::usage::TAIL_BYTES;

impl Guarded {
    fn finish(&self, outcome: Outcome) {
        if let Some(meter) = &self.meter {
            meter.finish(self.status, outcome, inferyes_proto::usage::parse_usage(&self.tail));
        }
    }
}

impl http_body::Body for Guarded {
    type Data = Bytes;
    type Error = inferyes_proto::pool::BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        if this.hard_stop.as_mut().poll(cx).is_ready() {
            this.ended = true;
            this.finish(Outcome::Broken);
            if !this.event_stream {
                return Poll::Ready(None);
            }
            let error = ApiError::new(
                ErrorKind::Unavailable,
                "the gateway shut down before the answer was complete",
                "gateway_shutdown",
            );
            return Poll::Ready(Some(Ok(Frame::data(error_event(&error)))));
        }
        loop {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        if let Some(meter) = &this.meter {
                            if this.event_stream {
                                meter.frame(|| super::sse::carries_output(data));
                            }
                            // One event, one token: an estimate for streams
                            // that say nothing of their usage.
                            meter.data_events(super::sse::count_data_events(data));
                        }
                        this.tail.extend_from_slice(data);
                        if this.tail.len() > 2 * TAIL_BYTES {
                            this.tail.drain(..this.tail.len() - TAIL_BYTES);
                        }
                        if this.strip_usage && this.event_stream {
                            // Whole events only, without the usage chunk the
                            // client did not ask for.
                            match this.events.without_usage(data.clone()) {
                                Some(kept) => return Poll::Ready(Some(Ok(Frame::data(kept)))),
                                None => continue,
                            }
                        }
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(None) if !this.events.is_empty() => {
                    // A last event without its blank line: passed on as it is.
                    return Poll::Ready(Some(Ok(Frame::data(this.events.take_rest()))));
                }
                Poll::Ready(None)
                    if !(this.event_stream && this.expects_done) || super::sse::ended_well(&this.tail) =>
                {
                    this.ended = true;
                    this.finish(Outcome::Ok);
                    return Poll::Ready(None);
                }
                Poll::Ready(None) => {
                    // The node closed the stream in the middle of the answer
                    // (it shut down, say): say so rather than end as if done.
                    this.ended = true;
                    this.finish(Outcome::Broken);
                    tracing::warn!(request_id = super::id_text(&this.request_id), node = %this.node, "stream ended without [DONE]; ending it with an error event");
                    let error = ApiError::new(
                        ErrorKind::Upstream,
                        format!("node `{}` ended the stream before the answer was complete", this.node),
                        "upstream_broken",
                    );
                    return Poll::Ready(Some(Ok(Frame::data(error_event(&error)))));
                }
                Poll::Ready(Some(Err(error))) if this.event_stream => {
                    let ejected_ms = this.guard.local.eject(inferyes_proto::unix_ms(), this.version);
                    tracing::warn!(request_id = super::id_text(&this.request_id), node = %this.node, %error, ejected_ms, "node failed mid-stream; ending the stream with an error event");
                    this.ended = true;
                    this.finish(Outcome::Broken);
                    let error = ApiError::new(
                        ErrorKind::Upstream,
                        format!("node `{}` failed in the middle of the stream", this.node),
                        "upstream_broken",
                    );
                    return Poll::Ready(Some(Ok(Frame::data(error_event(&error)))));
                }
                other => return other,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        // Only once `poll_frame` has seen the end: an HTTP/2 answer says it
        // ends with its last data frame, and a body taken as ended is not
        // polled again, so its usage would never be recorded nor a missing
        // `[DONE]` noticed.
        self.ended
    }

    fn size_hint(&self) -> SizeHint {
        // Not the node's: frames may be taken out or added.
        SizeHint::default()
    }
}

/// An [`Outbound`] that owns its parts, for work that outlives the handler.
pub struct OwnedOutbound {
    pub path_and_query: PathAndQuery,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub model: String,
    pub session: Option<String>,
    pub request_id: HeaderValue,
    pub expects_done: bool,
    pub meter: Option<Meter>,
    pub strip_usage: bool,
}

/// How often a client waiting on a cold load hears about it.
const LOADING_NOTE_EVERY: Duration = Duration::from_secs(1);

impl Forwarder {
    /// A streaming request that starts a cold load: the client gets its
    /// headers at once (`x-inferyes-route: cold`) and an SSE comment each
    /// second while the model loads, instead of minutes of silence; then
    /// the backend's stream, or a final error event.
    pub fn forward_cold_stream(
        &self,
        snapshot: Arc<RoutingSnapshot>,
        route: Route,
        mut out: OwnedOutbound,
    ) -> Response {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
        let node_id =
            route.targets.first().and_then(|t| snapshot.node(t.node)).map(|n| n.id.to_string()).unwrap_or_default();
        let forwarder = self.clone();
        let note_node = node_id.clone();
        let span = tracing::Span::current();
        tokio::spawn(tracing::Instrument::instrument(
            async move {
                let outbound = Outbound {
                    headers: std::mem::take(&mut out.headers),
                    path_and_query: &out.path_and_query,
                    body: std::mem::take(&mut out.body),
                    model: &out.model,
                    session: out.session.as_deref(),
                    request_id: &out.request_id,
                    stream: true,
                    expects_done: out.expects_done,
                    continuation: false,
                    meter: out.meter.clone(),
                    strip_usage: out.strip_usage,
                };
                let started = tokio::time::Instant::now();
                let work = forwarder.forward(&snapshot, &route, outbound);
                tokio::pin!(work);
                let mut ticker = tokio::time::interval(LOADING_NOTE_EVERY);
                let result = loop {
                    tokio::select! {
                        result = &mut work => break result,
                        _ = ticker.tick() => {
                            let note = format!(
                                ": loading model {} on node {} ({}s)\n\n",
                                out.model,
                                note_node,
                                started.elapsed().as_secs()
                            );
                            if tx.send(Ok(Bytes::from(note))).await.is_err() {
                                return;
                            }
                        }
                    }
                };
                match result {
                    Ok(response) if response.status().is_success() => {
                        let mut body = response.into_body();
                        while let Some(frame) = body.frame().await {
                            match frame {
                                Ok(frame) => {
                                    if let Ok(data) = frame.into_data()
                                        && tx.send(Ok(data)).await.is_err()
                                    {
                                        return;
                                    }
                                }
                                Err(error) => {
                                    let error = ApiError::new(
                                        ErrorKind::Upstream,
                                        format!("the stream from node `{note_node}` broke: {error}"),
                                        "upstream_stream_broken",
                                    );
                                    let _ = tx.send(Ok(error_event(&error))).await;
                                    return;
                                }
                            }
                        }
                    }
                    // The client's status was 200 long ago: the meter is
                    // told of the failure here, or its drop would count a
                    // cancelled request and estimate its tokens.
                    Ok(response) => {
                        let error = read_error(response).await;
                        if let Some(meter) = &out.meter {
                            meter.finish(error.status().as_u16(), Outcome::Error, None);
                        }
                        let _ = tx.send(Ok(error_event(&error))).await;
                    }
                    Err(error) => {
                        if let Some(meter) = &out.meter {
                            meter.finish(error.status().as_u16(), Outcome::Error, None);
                        }
                        let _ = tx.send(Ok(error_event(&error))).await;
                    }
                }
            },
            span,
        ));
        let mut response = Response::new(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)));
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        if let Ok(value) = HeaderValue::from_str(&node_id) {
            headers.insert(NODE_HEADER, value);
        }
        headers.insert(ROUTE_HEADER, HeaderValue::from_static("cold"));
        response
    }
}

/// A final SSE event carrying an error, the way OpenAI-compatible servers
/// end a stream that failed after it started.
pub(crate) fn error_event(error: &ApiError) -> Bytes {
    let body = inferyes_proto::openai_error_body(error.kind, &error.message, error.code.as_deref(), error.param);
    Bytes::from(format!("data: {body}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_length_is_passed_on_only_where_it_is_the_body_s() {
        assert!(is_decimal(b"240", 240));
        assert!(is_decimal(b"0", 0));
        assert!(!is_decimal(b"241", 240));
        assert!(!is_decimal(b"", 0));
        assert!(!is_decimal(b"+240", 240));
        assert!(!is_decimal(b"24 0", 240));
        assert!(!is_decimal(b"99999999999999999999999", 0), "too long for a length");
    }

    /// The headers a client's request reaches a node with.
    fn sent(client: HeaderMap, backend: Option<&'static str>, body: &'static [u8]) -> HeaderMap {
        let path = PathAndQuery::from_static("/v1/chat/completions");
        let request_id = HeaderValue::from_static("req_1");
        let out = Outbound {
            path_and_query: &path,
            headers: HeaderMap::new(),
            body: Bytes::from_static(body),
            model: "llama",
            session: Some("chat-1"),
            request_id: &request_id,
            stream: false,
            expects_done: false,
            continuation: false,
            meter: None,
            strip_usage: false,
        };
        let headers = upstream_headers(client, &out);
        let backend = backend.map(HeaderValue::from_static);
        let request = upstream_request(
            http::Uri::from_static("/v1/chat/completions"),
            HeaderValue::from_static("node-a:9100"),
            backend.as_ref(),
            headers,
            Full::new(out.body.clone()),
        );
        request.into_parts().0.headers
    }

    #[test]
    fn a_client_s_headers_travel_on_but_its_credential_hop_by_hop_and_routing_headers_stay_behind() {
        let mut client = HeaderMap::new();
        client.insert(header::HOST, HeaderValue::from_static("gateway:8080"));
        client.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer sk-client"));
        client.insert(header::PROXY_AUTHORIZATION, HeaderValue::from_static("Basic cHJveHk="));
        client.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, X-Hop"));
        client.insert(HeaderName::from_static("x-hop"), HeaderValue::from_static("for the gateway only"));
        client.insert(HeaderName::from_static("keep-alive"), HeaderValue::from_static("timeout=5"));
        client.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        client.insert(header::CONTENT_LENGTH, HeaderValue::from_static("61"));
        client.insert(BACKEND_HEADER, HeaderValue::from_static("chosen-by-the-client"));
        client.insert(HeaderName::from_static("x-inferyes-anything"), HeaderValue::from_static("1"));
        client.insert(HeaderName::from_static("x-stainless-lang"), HeaderValue::from_static("python"));
        client.append(HeaderName::from_static("x-trace"), HeaderValue::from_static("a"));
        client.append(HeaderName::from_static("x-trace"), HeaderValue::from_static("b"));
        client.insert(HeaderName::from_static("x-session-id"), HeaderValue::from_static("chat-1"));

        let headers = sent(client, Some("main"), b"{}");
        for gone in ["authorization", "proxy-authorization", "connection", "keep-alive", "x-hop", "x-inferyes-anything"]
        {
            assert!(!headers.contains_key(gone), "{gone} stays behind");
        }
        assert_eq!(headers[header::HOST], "node-a:9100");
        assert_eq!(headers[header::CONTENT_TYPE], "application/json");
        assert_eq!(headers[header::CONTENT_LENGTH], "2", "the body's length, not the client's");
        assert_eq!(headers[BACKEND_HEADER], "main", "the route's backend, not the client's");
        assert_eq!(headers[MODEL_HEADER], "llama");
        assert_eq!(headers[SESSION_HEADER], "chat-1");
        assert_eq!(headers[super::super::server::REQUEST_ID], "req_1");
        assert_eq!(headers["x-stainless-lang"], "python");
        assert_eq!(headers["x-session-id"], "chat-1");
        let trace: Vec<_> = headers.get_all("x-trace").iter().collect();
        assert_eq!(trace, ["a", "b"], "every value of a header, in order");
        assert_eq!(headers.len(), 11);
    }

    #[test]
    fn a_route_without_a_backend_sends_none_and_a_right_length_is_kept() {
        let mut client = HeaderMap::new();
        client.insert(header::CONTENT_LENGTH, HeaderValue::from_static("2"));
        client.insert(BACKEND_HEADER, HeaderValue::from_static("chosen-by-the-client"));
        let headers = sent(client, None, b"{}");
        assert!(!headers.contains_key(BACKEND_HEADER));
        assert_eq!(headers[header::CONTENT_LENGTH], "2");
        let headers = sent(HeaderMap::new(), None, b"{\"a\":1}");
        assert_eq!(headers[header::CONTENT_LENGTH], "7", "written where the client sent none (a chunked upload)");
        let mut client = HeaderMap::new();
        client.append(header::CONTENT_LENGTH, HeaderValue::from_static("2"));
        client.append(header::CONTENT_LENGTH, HeaderValue::from_static("2"));
        let headers = sent(client, None, b"{}");
        let lengths: Vec<_> = headers.get_all(header::CONTENT_LENGTH).iter().collect();
        assert_eq!(lengths, ["2"], "a repeated length goes on once");
    }

    #[test]
    fn route_labels_are_the_reasons_answers_carry_and_nothing_else() {
        for reason in RouteReason::ALL.map(RouteReason::as_str).into_iter().chain([FAILOVER]) {
            let mut headers = HeaderMap::new();
            headers.insert(ROUTE_HEADER, HeaderValue::from_static(reason));
            assert_eq!(route_label(&headers), reason);
        }
        let mut headers = HeaderMap::new();
        assert_eq!(route_label(&headers), "none");
        headers.insert(ROUTE_HEADER, HeaderValue::from_static("made-up"));
        assert_eq!(route_label(&headers), "none", "label values come from a fixed set");
    }
}
