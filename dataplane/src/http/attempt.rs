//! A request's attempts at its route's targets, in order: the only code
//! that sends a request to a node. The first answer, a cold load's (whose
//! attempts run inside its stream's body), and the continuation of a
//! broken stream all go through [`Attempts::run`]: each target is resolved
//! once ([`Hops`]), counted against its node while its attempt runs, sent,
//! judged by [`classify`], and what it came to is observed by the node's
//! state ([`Endpoint::observe`]) and, for the answer, by the request's
//! record ([`Meter::served`]).

use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderName, HeaderValue, header};
use inferyes_proto::ErrorKind;

use super::classify::{Attempted, MAX_BUFFERED_BODY, Purpose, UpstreamError, Verdict, classify};
use super::client::{Forwarder, NodeBody, is_decimal};
use crate::error::{ApiError, ErrorCode};
use crate::routing::{MAX_TARGETS, Route, Weighed};
use crate::snapshot::{RoutingSnapshot, Target};
use crate::targets::{ColdLoad, Endpoint, InFlight, Observed, Witness};
use crate::turns::{Seen, Sent, SentTurns};
use crate::usage::{Meter, Outcome, Served};

pub const NODE_HEADER: HeaderName = HeaderName::from_static("x-inferyes-node");
pub const ROUTE_HEADER: HeaderName = HeaderName::from_static("x-inferyes-route");
/// The route of an answer from a node other than the first choice.
pub const FAILOVER: &str = "failover";

/// Error bodies are small; a backend sending a huge one is cut off.
const MAX_ERROR_BODY: usize = 64 << 10;

/// A request as every attempt sends it: the client's path, headers made
/// for a node (what is not forwarded taken out, ours put in: see
/// [`super::client::upstream_headers`]) and body.
pub(crate) struct Outbound {
    pub path_and_query: PathAndQuery,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The client asked for a stream: an answer's head passes on its own,
    /// its body to come; else the body is read whole first.
    pub stream: bool,
    /// Hops to llama-server are asked for the prompt's progress
    /// (`return_progress`, spliced in as the attempt is sent).
    pub asks_progress: bool,
    /// A session's turn: where it is answered is recorded as its home.
    pub turn: Option<SessionTurn>,
}

/// A turn of a session, to record where it is answered: its next turn
/// goes there before the node's agent reports the session
/// ([`crate::turns`]).
#[derive(Clone)]
pub(crate) struct SessionTurn {
    pub turns: Arc<SentTurns>,
    /// The session key's hash.
    pub session: u64,
    /// The prompt's tokens, as estimated.
    pub tokens: u32,
    /// Where the reports had the session as the turn was sent.
    pub reported: Option<Seen>,
}

impl SessionTurn {
    fn answered(&self, hop: &Hop) {
        let sent = Sent {
            node: hop.node_key,
            backend: Arc::clone(&hop.backend_id),
            tokens: self.tokens,
            sent_unix_ms: inferyes_proto::unix_ms(),
            reported: self.reported,
        };
        self.turns.sent(self.session, sent);
    }
}

/// A target made ready to send to: its node's endpoint, its backend, and
/// the cold load an attempt there waits on, if any.
pub(crate) struct Hop {
    pub endpoint: Arc<Endpoint>,
    /// Its node's key and its backend's id: where a session's turn
    /// answered here is.
    pub node_key: u64,
    pub backend_id: Arc<str>,
    /// The backend's id, as a header value.
    pub backend: Option<HeaderValue>,
    /// The backend tells a stream's prompt progress when asked.
    pub progress: bool,
    pub load: Option<ColdLoad>,
    /// Why the route chose it: its reason for the first target, a
    /// failover for the rest.
    pub reason: &'static str,
    /// The request's count at the node, taken with its slot
    /// (`queue::take_slot`): the attempt's own.
    pub reserved: Option<InFlight>,
    /// What the backend reads and generates at.
    pub rates: crate::snapshot::Rates,
}

/// A route's targets, resolved once and tried in order; what is left once
/// one has answered is where a broken stream may go on.
#[derive(Default)]
pub(crate) struct Hops {
    items: [Option<Hop>; MAX_TARGETS],
    next: usize,
}

impl Hops {
    /// Each target of `route` made ready to send to: its node's endpoint,
    /// its backend, and the cold load of `model` it would start. The first
    /// carries the route's reason, the rest `failover`.
    pub fn of(snapshot: &RoutingSnapshot, route: &Route, model: &str) -> Hops {
        route
            .targets
            .iter()
            .enumerate()
            .filter_map(|(index, target)| {
                let node = snapshot.node(target.node)?;
                let backend = node.backends.get(target.backend)?;
                Some(Hop {
                    endpoint: Arc::clone(&node.endpoint),
                    node_key: node.key,
                    backend_id: Arc::clone(&backend.id),
                    backend: backend.id_header.clone(),
                    progress: backend.reports_progress,
                    load: route.loads_at(index).then(|| cold_load(snapshot, model, *target)).flatten(),
                    reason: if index == 0 { route.reason.as_str() } else { FAILOVER },
                    reserved: None,
                    rates: backend.rates,
                })
            })
            .collect()
    }

    /// These hops, the first counting the request with `reserved`.
    pub fn reserved(mut self, reserved: Option<InFlight>) -> Hops {
        if let Some(first) = self.items.iter_mut().flatten().next() {
            first.reserved = reserved;
        }
        self
    }

    fn pop(&mut self) -> Option<Hop> {
        while self.next < MAX_TARGETS {
            self.next += 1;
            if let Some(hop) = self.items[self.next - 1].take() {
                return Some(hop);
            }
        }
        None
    }

    fn is_empty(&self) -> bool {
        self.items[self.next.min(MAX_TARGETS)..].iter().all(Option::is_none)
    }

    /// The first target left, if any.
    pub fn peek(&self) -> Option<&Hop> {
        self.items[self.next.min(MAX_TARGETS)..].iter().flatten().next()
    }
}

impl FromIterator<Hop> for Hops {
    /// The first [`MAX_TARGETS`] of `hops`, in order.
    fn from_iter<I: IntoIterator<Item = Hop>>(hops: I) -> Hops {
        let mut all = Hops::default();
        for (slot, hop) in all.items.iter_mut().zip(hops) {
            *slot = Some(hop);
        }
        all
    }
}

/// The answer that passed.
pub(crate) enum Answer {
    /// Read whole: the answer to a request that is not a stream.
    Whole(Response),
    /// A stream's head, its body still to come.
    Stream(OpenStream),
}

/// A stream whose head passed, and what its body is passed on with.
pub(crate) struct OpenStream {
    pub parts: http::response::Parts,
    pub body: NodeBody,
    /// Counts the stream against its node until its body ends.
    pub guard: InFlight,
    pub endpoint: Arc<Endpoint>,
}

/// What the attempts of one request share.
#[derive(Clone, Copy)]
pub(crate) struct Attempts<'a> {
    pub forwarder: &'a Forwarder,
    pub metrics: &'a crate::metrics::Metrics,
    pub request_id: &'a HeaderValue,
    /// The snapshot the request was routed on.
    pub version: u64,
    /// The request's record, told which node answered.
    pub meter: Option<&'a Meter>,
    /// The caller's share, which holds a whole answer's bytes too.
    pub share: Option<&'a Arc<crate::shares::Share>>,
    /// What routing weighed: its targets' costs, for the request's record.
    pub weighed: &'a Weighed,
}

impl Attempts<'_> {
    /// Tries `hops` in order until an answer passes; those left stay in
    /// `hops`. Once one has passed (its head, for a stream) there is no
    /// other attempt. The last attempt takes `out`'s headers and body; one
    /// before it, copies (a failover needs them again).
    pub async fn run(&self, out: &mut Outbound, hops: &mut Hops, purpose: Purpose) -> Result<Answer, ApiError> {
        let witness = Witness { request_id: self.request_id, version: self.version };
        let mut last_error = None;
        let mut first = true;
        while let Some(mut hop) = hops.pop() {
            if purpose == Purpose::First && !first {
                self.metrics.retries.inc();
            }
            let last = hops.is_empty();
            let (headers, mut body) = if last {
                (std::mem::take(&mut out.headers), std::mem::take(&mut out.body))
            } else {
                (out.headers.clone(), out.body.clone())
            };
            // Spliced for this hop only: a failover's node may be of
            // another kind, which would refuse the member.
            if out.asks_progress
                && hop.progress
                && let Some(spliced) = super::view::with_progress_requested(&body)
            {
                body = spliced;
            }
            let guard = match hop.reserved.take() {
                Some(reserved) if hop.load.is_none() && reserved.counts_at(&hop.endpoint) => reserved,
                _ => hop.endpoint.enter(hop.load.clone()),
            };
            if let Some(meter) = self.meter {
                meter.sent(hop.rates);
            }
            let (attempt, answer) = self.send(&hop, &out.path_and_query, headers, body, out.stream).await;
            let what = attempt.what();
            let verdict = classify(attempt, last, purpose);
            let observed = match &verdict {
                Verdict::Pass => match &answer {
                    Some((parts, _)) if parts.status.is_success() => Observed::Answered,
                    _ => Observed::Unjudged,
                },
                Verdict::Failover { eject, .. } | Verdict::Fail { eject, .. } => {
                    if *eject {
                        Observed::Failed { what, eject: true }
                    } else {
                        Observed::Unjudged
                    }
                }
            };
            hop.endpoint.observe(observed, witness);
            // What routing expected holds only for the first target tried.
            let answered_first = first;
            first = false;
            let served = || Served {
                node: Arc::clone(&hop.endpoint.id),
                route: hop.reason,
                weighed: if answered_first { self.weighed.clone() } else { self.weighed.failed_over() },
            };
            let (error, told_by_node) = match verdict {
                Verdict::Pass => {
                    let Some((parts, read)) = answer else { unreachable!("only an answer passes") };
                    if let Some(turn) = out.turn.as_ref().filter(|_| parts.status.is_success()) {
                        turn.answered(&hop);
                    }
                    if purpose == Purpose::First
                        && let Some(meter) = self.meter
                    {
                        meter.served(served());
                    }
                    return Ok(self.passed(hop, parts, read, guard));
                }
                Verdict::Failover { error, .. } => (error, false),
                Verdict::Fail { error, .. } => (error, true),
            };
            drop(guard);
            if matches!(error, UpstreamError::AuthMisconfigured) {
                inferyes_net::error_every!(
                    node = %hop.endpoint.id,
                    "the node's agent refused what this data plane sent it (the snapshot's credential): its join token is not the controller's"
                );
            }
            let mut error = error.into_api(&hop.endpoint.id);
            if !told_by_node {
                last_error = Some(error);
                continue;
            }
            if purpose == Purpose::First
                && let Some(meter) = self.meter
            {
                meter.served(served());
            }
            // An error from this node says which node it was, as an answer would.
            if let Some(value) = &hop.endpoint.id_header {
                error.headers.push((NODE_HEADER, value.clone()));
            }
            error.headers.push((ROUTE_HEADER, HeaderValue::from_static(hop.reason)));
            return Err(error);
        }
        Err(last_error.unwrap_or_else(|| {
            ApiError::new(ErrorKind::Unavailable, "no node could take the request", ErrorCode::NoCapacity)
                .retry_after(1)
        }))
    }

    /// One attempt: the request sent to `hop`, and its answer's head read
    /// (and, for an answer read whole, its body).
    async fn send(
        &self,
        hop: &Hop,
        path_and_query: &PathAndQuery,
        headers: HeaderMap,
        body: Bytes,
        stream: bool,
    ) -> (Attempted, Option<(http::response::Parts, Read)>) {
        let to = (&*hop.endpoint, hop.backend.as_ref());
        let response = match self.forwarder.send(to, path_and_query, headers, body).await {
            Err(attempt) => {
                if let Attempted::Unreachable(Some(cause)) = &attempt {
                    tracing::debug!(node = %hop.endpoint.id, %cause, "no answer from the node");
                }
                return (attempt, None);
            }
            Ok(response) => response,
        };
        if response.status().is_client_error() || response.status().is_server_error() {
            return (error_answer(response).await, None);
        }
        let (parts, body) = response.into_parts();
        // Only a stream's purpose asks whether it is an event stream.
        let answered = Attempted::Answered {
            success: parts.status.is_success(),
            event_stream: stream && super::sse::is_event_stream(&parts.headers),
        };
        if stream {
            return (answered, Some((parts, Read::Head(body))));
        }
        // A whole answer or none: read before the client sees a byte, so a
        // node failing mid-answer is a clean 502 (or the next candidate),
        // never a truncated body.
        let mut held = super::body::Budget::reservation(self.forwarder.budget(), self.share);
        match super::body::read_whole_within(body, MAX_BUFFERED_BODY, Some(&mut held)).await {
            Ok(bytes) => (answered, Some((parts, Read::Whole(bytes, held)))),
            Err(super::body::ReadError::TooLarge) => (Attempted::BodyTooLarge, None),
            Err(super::body::ReadError::OverBudget(full)) => (Attempted::OverBudget(full), None),
            Err(super::body::ReadError::Body(cause)) => {
                tracing::debug!(node = %hop.endpoint.id, %cause, "the answer broke off");
                (Attempted::BodyBroke, None)
            }
        }
    }

    /// The answer that passed, as the client gets it: its node and route
    /// named in its headers.
    fn passed(&self, hop: Hop, mut parts: http::response::Parts, read: Read, guard: InFlight) -> Answer {
        super::client::answer_headers(&mut parts.headers);
        if let Some(value) = &hop.endpoint.id_header {
            parts.headers.insert(NODE_HEADER, value.clone());
        }
        parts.headers.insert(ROUTE_HEADER, HeaderValue::from_static(hop.reason));
        match read {
            Read::Whole(bytes, held) => {
                drop(guard);
                Answer::Whole(whole_answer(parts, bytes, held, self.meter))
            }
            Read::Head(body) => {
                // A streamed answer is passed on frame by frame and may
                // change on the way (usage taken out, an error event
                // added): its length is not the node's. Without one, the
                // client's connection also reads to the end, where the
                // answer is metered and checked.
                parts.headers.remove(header::CONTENT_LENGTH);
                Answer::Stream(OpenStream { parts, body, guard, endpoint: hop.endpoint })
            }
        }
    }
}

/// A passed answer's body, as far as its attempt read it.
enum Read {
    Whole(Bytes, super::body::Reservation),
    Head(NodeBody),
}

/// A whole answer as the client gets it, its usage recorded.
fn whole_answer(
    mut parts: http::response::Parts,
    bytes: Bytes,
    held: super::body::Reservation,
    meter: Option<&Meter>,
) -> Response {
    if let Some(meter) = meter {
        let tail = &bytes[bytes.len().saturating_sub(inferyes_proto::usage::TAIL_BYTES)..];
        let head = &bytes[..bytes.len().min(inferyes_proto::usage::HEAD_BYTES)];
        let outcome = if parts.status.is_success() { Outcome::Ok } else { Outcome::Error };
        // A whole answer says its usage once: at its end, or, where what
        // it answers is long (llama-server's embeddings and reranks), at
        // its start.
        let usage = meter.usage(&[], tail).or_else(|| meter.usage(&[], head));
        meter.timed(tail);
        meter.finish(parts.status.as_u16(), outcome, usage);
    }
    // The node's length stands where it is the body's (the usual case: its
    // header is passed on, not written anew); hyper writes the body's own
    // otherwise.
    let announced = parts.headers.get(header::CONTENT_LENGTH).map(HeaderValue::as_bytes);
    if announced.is_none_or(|length| !is_decimal(length, bytes.len())) {
        parts.headers.remove(header::CONTENT_LENGTH);
    }
    Response::from_parts(parts, Body::new(super::body::Held::new(bytes, held)))
}

/// What an error status came to: a 401 with `AGENT_REFUSED`, which only
/// an agent sends, is its refusal of this data plane's credential, and a
/// 503 with it its refusal of a connection past its caps; any other is the
/// node's own error, read from its body.
async fn error_answer(response: http::Response<NodeBody>) -> Attempted {
    let by_agent = response.headers().contains_key(inferyes_proto::bearer::AGENT_REFUSED);
    match response.status() {
        http::StatusCode::UNAUTHORIZED if by_agent => Attempted::CredentialRefused,
        http::StatusCode::SERVICE_UNAVAILABLE if by_agent => Attempted::ConnectionsFull(read_error(response).await),
        _ => Attempted::NodeError(read_error(response).await),
    }
}

/// The cold load of `model` on `target`, where no load of it has started
/// there (none where one has, which the node's report counts already, or
/// where its size is not known).
fn cold_load(snapshot: &RoutingSnapshot, model: &str, target: Target) -> Option<ColdLoad> {
    snapshot
        .placements(model)
        .and_then(|ps| ps.iter().find(|p| p.target == target))
        .filter(|p| p.state == inferyes_proto::v1::ModelState::Unloaded && p.size_bytes > 0)
        .map(|p| ColdLoad { backend: target.backend, model: model.into(), bytes: p.size_bytes })
}

/// The error a non-success response carries, in the OpenAI shape, with its
/// `Retry-After` kept; whatever the body type.
pub(crate) async fn read_error<B>(response: http::Response<B>) -> ApiError
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let status = response.status();
    let retry_after =
        response.headers().get(header::RETRY_AFTER).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u32>().ok());
    let body = super::body::read_whole(response.into_body(), MAX_ERROR_BODY).await.unwrap_or_default();
    let mut error = super::upstream::normalize(status, &body);
    error.retry_after = retry_after;
    error
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use inferyes_net::base_url::BaseUrl;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::targets::NodeStates;
    use crate::usage::{Counted, Ledger};

    /// A node's proxy that answers every request `status` with `body`; its URL.
    async fn node(status: http::StatusCode, body: &'static str) -> String {
        let app = axum::Router::new().fallback(move || async move { (status, body) });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("bound"));
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    }

    #[tokio::test]
    async fn a_refusing_node_is_held_out_and_the_next_answer_recorded_as_a_failover() {
        let refusing = node(http::StatusCode::SERVICE_UNAVAILABLE, r#"{"error":{"message":"busy","code":503}}"#).await;
        let answering = node(http::StatusCode::OK, r#"{"object":"chat.completion","choices":[]}"#).await;
        let states = NodeStates::default();
        let endpoint =
            |id: &str, url: &str| Arc::new(states.endpoint(&Arc::from(id), BaseUrl::new(url), false, true, 1));
        let (a, b) = (endpoint("a", &refusing), endpoint("b", &answering));
        let turns = Arc::new(SentTurns::default());
        let hop = |endpoint: &Arc<Endpoint>, reason| Hop {
            endpoint: Arc::clone(endpoint),
            node_key: inferyes_proto::hash::stable_hash(endpoint.id.as_bytes()),
            backend_id: Arc::from("b0"),
            backend: None,
            progress: false,
            load: None,
            reason,
            reserved: None,
            rates: Default::default(),
        };
        let mut hops: Hops = [hop(&a, "placed"), hop(&b, FAILOVER)].into_iter().collect();
        let settings = super::super::client::Settings {
            connect_timeout: Duration::from_secs(2),
            header_timeout: Duration::from_secs(5),
            read_timeout: Duration::from_secs(5),
            http2: false,
        };
        let tls = rustls::ClientConfig::builder()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let forwarder =
            Forwarder::new(&settings, tls, CancellationToken::new(), super::super::body::Budget::new(1 << 20));
        let metrics = crate::metrics::Metrics::new(&mut prometheus_client::registry::Registry::default());
        let meter = Meter::new(Ledger::new("test", true), "r", None, "m".into(), false, Counted::at_the_end(1), None);
        let request_id = HeaderValue::from_static("r");
        let mut expected = Weighed::default();
        expected.ttft_ms = 7;
        let attempts = Attempts {
            forwarder: &forwarder,
            metrics: &metrics,
            request_id: &request_id,
            version: 1,
            meter: Some(&meter),
            share: None,
            weighed: &expected,
        };
        let outbound = |session| Outbound {
            path_and_query: PathAndQuery::from_static("/v1/chat/completions"),
            headers: HeaderMap::new(),
            body: Bytes::from_static(b"{}"),
            stream: false,
            asks_progress: false,
            turn: Some(SessionTurn { turns: Arc::clone(&turns), session, tokens: 300, reported: None }),
        };
        let mut out = outbound(7);
        let Ok(Answer::Whole(answer)) = attempts.run(&mut out, &mut hops, Purpose::First).await else {
            panic!("an answer from b")
        };
        assert_eq!(answer.headers()[NODE_HEADER], "b");
        assert_eq!(answer.headers()[ROUTE_HEADER], FAILOVER);
        let now = inferyes_proto::unix_ms();
        assert!(a.ejected(now) && !b.ejected(now), "the refusing node, and only it, held out");
        assert_eq!((a.in_flight(), b.in_flight()), (0, 0), "nothing left counted once read whole");
        assert_eq!(metrics.retries.get(), 1);
        let served = meter.served_by().expect("served");
        assert_eq!((&*served.node, served.route, served.weighed.ttft_ms), ("b", FAILOVER, 0));
        assert!(hops.peek().is_none(), "no node left to try");
        let home = turns.latest(7, inferyes_proto::unix_ms()).expect("the turn's home recorded");
        let b_key = inferyes_proto::hash::stable_hash(b"b");
        assert_eq!((home.node, &*home.backend, home.tokens), (b_key, "b0", 300), "where it was answered");

        // A turn its node refuses is no home there.
        let refused = node(http::StatusCode::BAD_REQUEST, r#"{"error":{"message":"no","code":400}}"#).await;
        let c = endpoint("c", &refused);
        let mut hops: Hops = [hop(&c, "placed")].into_iter().collect();
        let mut out = outbound(8);
        assert!(attempts.run(&mut out, &mut hops, Purpose::First).await.is_err(), "the node's refusal");
        assert_eq!(turns.latest(8, inferyes_proto::unix_ms()), None);
    }
}
