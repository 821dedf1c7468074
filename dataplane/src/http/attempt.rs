//! Trying a route's targets in order, each attempt's outcome judged by
//! [`classify`]: the first answer to pass goes to the client; one that
//! fails over is followed by the next target.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, header};
use inferyes_proto::ErrorKind;

use super::classify::{Attempt, MAX_BUFFERED_BODY, UpstreamError, Verdict, classify};
use super::client::{Answer, Forwarder, Outbound, is_decimal, upstream_headers};
use crate::error::{ApiError, ErrorCode};
use crate::routing::{Route, RouteReason};
use crate::snapshot::{LocalCounters, RoutingSnapshot};
use crate::usage::Outcome;

pub const NODE_HEADER: HeaderName = HeaderName::from_static("x-inferyes-node");
pub const ROUTE_HEADER: HeaderName = HeaderName::from_static("x-inferyes-route");
/// The route of an answer from a node other than the first choice.
const FAILOVER: &str = "failover";

/// Error bodies are small; a backend sending a huge one is cut off.
const MAX_ERROR_BODY: usize = 64 << 10;

/// What routing expected the first token to cost, in ms, where it was
/// weighed: on the node chosen, and at the home a moved session left.
/// Travels in the answer's extensions to the decision report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpectedTtft {
    pub ms: u32,
    pub home_ms: u32,
}

/// The answer that passed.
pub(crate) enum Answered {
    /// Read whole: the answer to a request that is not a stream.
    Whole(Response),
    /// A stream's head, its body still to come.
    Stream(Started),
}

/// A stream whose head passed, and what its body is passed on with.
pub(crate) struct Started {
    pub parts: http::response::Parts,
    pub body: Answer,
    pub guard: InFlight,
    pub node: Arc<str>,
    /// The index in the route of the target that answered.
    pub index: usize,
}

/// Tries `route`'s targets in order until an answer passes. Once one has
/// passed (its head, for a stream) there is no other attempt.
pub(crate) async fn attempt_each(
    forwarder: &Forwarder,
    metrics: &crate::metrics::Metrics,
    snapshot: &RoutingSnapshot,
    route: &Route,
    out: &mut Outbound<'_>,
) -> Result<Answered, ApiError> {
    let mut last_error = None;
    // The client's headers made into a node's once, in place: every
    // attempt sends the same.
    out.headers = upstream_headers(std::mem::take(&mut out.headers), out);
    for (index, target) in route.targets.iter().enumerate() {
        let Some(node) = snapshot.node(target.node) else { continue };
        let Some(backend) = node.backends.get(target.backend) else { continue };
        if index > 0 {
            metrics.retries.inc();
        }
        if let Some(meter) = &out.meter {
            meter.node(&node.id);
        }
        // A cold load holds the model's size against the node until it
        // answers: the first target's, or one a failover goes on to.
        let reserve = if route.loads_at(index) { cold_load_bytes(snapshot, out.model, *target) } else { 0 };
        let guard = if reserve > 0 {
            InFlight::loading(Arc::clone(&node.local), target.backend, out.model, reserve)
        } else {
            InFlight::enter(Arc::clone(&node.local))
        };
        let last = index + 1 == route.targets.len();
        // The last attempt takes the headers and the body; one before it,
        // copies (a failover needs them again; the body's first copy
        // allocates).
        let (headers, body) = if last {
            (std::mem::take(&mut out.headers), std::mem::take(&mut out.body))
        } else {
            (out.headers.clone(), out.body.clone())
        };
        let backend = backend.id_header.as_ref();
        let reason = if index == 0 { route.reason.as_str() } else { FAILOVER };
        let to = super::client::Destination {
            proxy_url: &node.proxy_url,
            proxy_http2: node.proxy_http2,
            backend,
            authorization: snapshot.agent_authorization(),
        };
        let sent = forwarder.send(to, out, headers, body).await;
        let (attempt, answer) = match sent {
            Err(attempt) => (attempt, None),
            Ok(response) if response.status().is_client_error() || response.status().is_server_error() => {
                (refusal(response).await, None)
            }
            Ok(response) => {
                let (parts, body) = response.into_parts();
                if out.stream {
                    (Attempt::Answered, Some((parts, Read::Head(body))))
                } else {
                    // A whole answer or none: read before the client sees a
                    // byte, so a node failing mid-answer is a clean 502 (or
                    // the next candidate), never a truncated body.
                    let mut held = super::body::Budget::reservation(forwarder.budget());
                    match super::body::read_whole_within(body, MAX_BUFFERED_BODY, Some(&mut held)).await {
                        Ok(bytes) => (Attempt::Answered, Some((parts, Read::Whole(bytes, held)))),
                        Err(super::body::ReadError::TooLarge) => (Attempt::BodyTooLarge, None),
                        Err(super::body::ReadError::OverBudget) => (Attempt::OverBudget, None),
                        Err(super::body::ReadError::Body(cause)) => {
                            tracing::debug!(node = %node.id, %cause, "the answer broke off");
                            (Attempt::BodyBroke, None)
                        }
                    }
                }
            }
        };
        if let Attempt::Unreachable(Some(cause)) = &attempt {
            tracing::debug!(node = %node.id, %cause, "no answer from the node");
        }
        let what = attempt_name(&attempt);
        let (eject, error, told_by_node) = match classify(attempt, last) {
            Verdict::Pass => {
                let Some((mut parts, read)) = answer else { unreachable!("only an answer passes") };
                if parts.status.is_success() {
                    node.local.succeeded();
                }
                super::client::answer_headers(&mut parts.headers);
                if let Some(value) = &node.id_header {
                    parts.headers.insert(NODE_HEADER, value.clone());
                }
                parts.headers.insert(ROUTE_HEADER, HeaderValue::from_static(reason));
                if index == 0 {
                    // For the decision's report only: a client is not told
                    // how loaded the fleet is.
                    let expected = ExpectedTtft { ms: route.expected_ttft_ms, home_ms: route.home_expected_ttft_ms };
                    parts.extensions.insert(expected);
                }
                return Ok(match read {
                    Read::Whole(bytes, held) => {
                        drop(guard);
                        Answered::Whole(whole_answer(parts, bytes, held, out.meter.as_ref()))
                    }
                    Read::Head(body) => {
                        // A streamed answer is passed on frame by frame and
                        // may change on the way (usage taken out, an error
                        // event added): its length is not the node's.
                        // Without one, the client's connection also reads to
                        // the end, where the answer is metered and checked.
                        parts.headers.remove(header::CONTENT_LENGTH);
                        Answered::Stream(Started { parts, body, guard, node: Arc::clone(&node.id), index })
                    }
                });
            }
            Verdict::Failover { eject, error } => (eject, error, false),
            Verdict::Fail { eject, error } => (eject, error, true),
        };
        drop(guard);
        if eject {
            let ejected_ms = node.local.eject(inferyes_proto::unix_ms(), snapshot.version());
            inferyes_net::warn_every!(
                gate: node.local.log;
                request_id = super::id_text(out.request_id),
                node = %node.id,
                ejected_ms,
                "node {what}; held out of routing"
            );
        }
        if matches!(error, UpstreamError::AuthMisconfigured) {
            inferyes_net::error_every!(
                node = %node.id,
                "the node's agent refused what this data plane sent it (the snapshot's credential): its join token is not the controller's"
            );
        }
        let mut error = error.into_api(&node.id);
        if !told_by_node {
            last_error = Some(error);
            continue;
        }
        // An error from this node says which node it was, as an answer would.
        if let Some(value) = &node.id_header {
            error.headers.push((NODE_HEADER, value.clone()));
        }
        error.headers.push((ROUTE_HEADER, HeaderValue::from_static(reason)));
        return Err(error);
    }
    Err(last_error.unwrap_or_else(|| {
        ApiError::new(ErrorKind::Unavailable, "no node could take the request", ErrorCode::NoCapacity).retry_after(1)
    }))
}

/// A passed answer's body, as far as its attempt read it.
enum Read {
    Whole(Bytes, super::body::Reservation),
    Head(Answer),
}

/// A whole answer as the client gets it, its usage recorded.
fn whole_answer(
    mut parts: http::response::Parts,
    bytes: Bytes,
    held: super::body::Reservation,
    meter: Option<&crate::usage::Meter>,
) -> Response {
    if let Some(meter) = meter {
        let tail = &bytes[bytes.len().saturating_sub(inferyes_proto::usage::TAIL_BYTES)..];
        let outcome = if parts.status.is_success() { Outcome::Ok } else { Outcome::Error };
        // A whole answer says its usage once, at its end.
        meter.finish(parts.status.as_u16(), outcome, meter.usage(&[], tail));
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

/// An error answer: the agent's refusal of the credential (its header
/// says so; its backends cannot), or the node's error, read.
pub(super) async fn refusal(response: http::Response<Answer>) -> Attempt {
    if response.status() == http::StatusCode::UNAUTHORIZED
        && response.headers().contains_key(inferyes_proto::bearer::AGENT_REFUSED)
    {
        return Attempt::CredentialRefused;
    }
    Attempt::Refused(read_error(response).await)
}

/// What a log line says an attempt's node did.
fn attempt_name(attempt: &Attempt) -> &'static str {
    match attempt {
        Attempt::TimedOut(_) => "did not answer in time",
        Attempt::Unreachable(_) => "is unreachable",
        Attempt::Refused(_) => "refused before the first byte",
        Attempt::CredentialRefused => "refused the fleet's credential",
        Attempt::Answered => "answered",
        Attempt::BodyBroke => "failed mid-answer",
        Attempt::BodyTooLarge => "answered more than can be held",
        Attempt::OverBudget => "answered while the data plane's buffers were full",
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

#[cfg(test)]
mod tests {
    use super::*;

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
