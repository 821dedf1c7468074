//! What an attempt at a node came to, and what follows: the one place the
//! forwarding path decides to pass an answer on, to try the next node
//! (and whether to hold this one out of routing), or to fail, before the
//! answer's head and at a stream's end alike. Pure, so every outcome is
//! tested without a socket.

use std::time::Duration;

use http::StatusCode;
use inferyes_proto::ErrorKind;

use crate::error::{ApiError, ErrorCode};

/// Why an attempt failed, as the client is told.
#[derive(Debug, Clone)]
pub enum UpstreamError {
    /// No connection, or it broke before the answer's head.
    Unreachable,
    /// No answer's head within the response-header timeout.
    Timeout(Duration),
    /// A whole answer broke off in the middle.
    Broken,
    /// A stream broke off in the middle, and no node continued it.
    StreamBroken,
    /// The node closed a stream without its end (`data: [DONE]`).
    StreamCut,
    /// The node's agent does not take this data plane's join token.
    AuthMisconfigured,
    /// A whole answer over what the data plane holds in memory.
    AnswerTooLarge,
    /// The data plane shut down before the answer was complete.
    Shutdown,
    /// The data plane, or the caller's share, holds all the answers' bytes
    /// it may.
    OverBudget(super::body::Full),
    /// The node's own error, passed on.
    NodeError(ApiError),
}

/// Why a connection failed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Non-streamed answers are read whole before they are passed on, up to
/// this.
pub const MAX_BUFFERED_BODY: usize = 256 << 20;

impl UpstreamError {
    /// The error the client gets, from `node`.
    pub fn into_api(self, node: &str) -> ApiError {
        let (kind, message, code) = match self {
            UpstreamError::NodeError(error) => return error,
            UpstreamError::Unreachable => {
                (ErrorKind::Upstream, format!("node `{node}` is unreachable"), ErrorCode::UpstreamUnreachable)
            }
            UpstreamError::Timeout(after) => (
                ErrorKind::Timeout,
                format!("node `{node}` did not answer within {after:?}"),
                ErrorCode::UpstreamTimeout,
            ),
            UpstreamError::Broken => (
                ErrorKind::Upstream,
                format!("node `{node}` failed in the middle of its answer"),
                ErrorCode::UpstreamBroken,
            ),
            UpstreamError::StreamBroken => (
                ErrorKind::Upstream,
                format!("node `{node}` failed in the middle of the stream"),
                ErrorCode::UpstreamBroken,
            ),
            UpstreamError::StreamCut => (
                ErrorKind::Upstream,
                format!("node `{node}` ended the stream before the answer was complete"),
                ErrorCode::UpstreamBroken,
            ),
            UpstreamError::AuthMisconfigured => (
                ErrorKind::Upstream,
                format!("node `{node}` does not take this gateway's join token"),
                ErrorCode::UpstreamAuthMisconfigured,
            ),
            UpstreamError::AnswerTooLarge => (
                ErrorKind::Upstream,
                format!("the answer from node `{node}` is over {} MiB; ask for it streamed", MAX_BUFFERED_BODY >> 20),
                ErrorCode::UpstreamAnswerTooLarge,
            ),
            UpstreamError::Shutdown => (
                ErrorKind::Unavailable,
                "the gateway shut down before the answer was complete".to_string(),
                ErrorCode::GatewayShutdown,
            ),
            UpstreamError::OverBudget(super::body::Full::DataPlane) => return ApiError::overloaded("answers"),
            UpstreamError::OverBudget(super::body::Full::Share(whose)) => {
                return ApiError::past_share(whose, "all the bytes of request bodies and answers");
            }
        };
        ApiError::new(kind, message, code)
    }
}

/// What one attempt came to, up to its answer's head (and, for an answer
/// read whole, its body).
#[derive(Debug)]
pub enum Attempted {
    /// No head within the response-header timeout.
    TimedOut(Duration),
    /// No connection, or it broke before the head; why, where known.
    Unreachable(Option<BoxError>),
    /// An error status, with the node's error read.
    NodeError(ApiError),
    /// The node's agent refused the credential this data plane sent.
    CredentialRefused,
    /// The node's agent holds all the connections it takes (its error):
    /// the node is well, only full for now.
    ConnectionsFull(ApiError),
    /// Any other status, head read (and body, for a whole answer);
    /// `success` where the status is 2xx, `event_stream` where the answer
    /// is one.
    Answered { success: bool, event_stream: bool },
    /// A whole answer's body broke off.
    BodyBroke,
    /// A whole answer's body was longer than [`MAX_BUFFERED_BODY`].
    BodyTooLarge,
    /// A whole answer's body would pass what the data plane, or the
    /// caller's share, may hold.
    OverBudget(super::body::Full),
}

impl Attempted {
    /// The outcome as a log line's phrase, after "node" (`node is
    /// unreachable`).
    pub fn what(&self) -> &'static str {
        match self {
            Attempted::TimedOut(_) => "did not answer in time",
            Attempted::Unreachable(_) => "is unreachable",
            Attempted::NodeError(_) => "answered with an error before the first byte",
            Attempted::CredentialRefused => "refused the fleet's credential",
            Attempted::ConnectionsFull(_) => "holds all the connections it takes",
            Attempted::Answered { .. } => "answered",
            Attempted::BodyBroke => "failed mid-answer",
            Attempted::BodyTooLarge => "answered more than can be held",
            Attempted::OverBudget(_) => "answered while the data plane's buffers were full",
        }
    }
}

/// What follows an attempt.
#[derive(Debug)]
pub enum Verdict {
    /// The answer goes to the client.
    Pass,
    /// Try the next target; where none is left, the request fails with
    /// `error`, told as no node's (none answered). `eject` holds this node
    /// out of routing for a while.
    Failover { eject: bool, error: UpstreamError },
    /// The request ends with `error`, told as this node's.
    Fail { eject: bool, error: UpstreamError },
}

/// What a request's attempts are for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// The request's answer.
    First,
    /// The rest of a stream that broke, from another node: its client has
    /// had bytes all along, so only an event stream will do, and a timeout
    /// spent on one node leaves time for the next.
    Continue,
}

/// llama-swap's per-model limit: a refusal for load, which another node
/// may not share.
const CONCURRENCY_LIMIT: &str = "concurrency_limit";

/// The verdict on `attempt`, made for `purpose`; `last` where no target
/// follows it.
pub fn classify(attempt: Attempted, last: bool, purpose: Purpose) -> Verdict {
    match (attempt, purpose) {
        (Attempted::Answered { success, event_stream }, Purpose::Continue) if !(success && event_stream) => {
            Verdict::Failover { eject: true, error: UpstreamError::Broken }
        }
        (Attempted::TimedOut(_), Purpose::Continue) => {
            Verdict::Failover { eject: true, error: UpstreamError::Unreachable }
        }
        (attempted, _) => classify_first(attempted, last),
    }
}

fn classify_first(attempt: Attempted, last: bool) -> Verdict {
    match attempt {
        Attempted::Answered { .. } => Verdict::Pass,
        // The timeout is the request's whole wait for an answer to start (a
        // non-streamed generation can take minutes): no time is left to
        // try another node.
        Attempted::TimedOut(after) => Verdict::Fail { eject: true, error: UpstreamError::Timeout(after) },
        Attempted::Unreachable(_) => Verdict::Failover { eject: true, error: UpstreamError::Unreachable },
        // Nothing reached the client: the next node answers instead.
        Attempted::BodyBroke => Verdict::Failover { eject: true, error: UpstreamError::Broken },
        // The node is well; the answer is too big to hold, and another
        // node would give as big a one.
        Attempted::BodyTooLarge => Verdict::Fail { eject: false, error: UpstreamError::AnswerTooLarge },
        // The data plane's own limit, or the caller's: no node is to blame,
        // none would do better now.
        Attempted::OverBudget(full) => Verdict::Fail { eject: false, error: UpstreamError::OverBudget(full) },
        // An agent that does not take the credential: the fleet's setup at
        // fault, not the client's key (an SDK reads a 401 as that).
        // Another node may take it.
        Attempted::CredentialRefused if last => Verdict::Fail { eject: true, error: UpstreamError::AuthMisconfigured },
        Attempted::CredentialRefused => Verdict::Failover { eject: true, error: UpstreamError::AuthMisconfigured },
        // Another node may take it; this one is not to blame.
        Attempted::ConnectionsFull(error) if last => {
            Verdict::Fail { eject: false, error: UpstreamError::NodeError(error) }
        }
        Attempted::ConnectionsFull(error) => Verdict::Failover { eject: false, error: UpstreamError::NodeError(error) },
        Attempted::NodeError(mut error) => {
            let status = error.status();
            let refused = status == StatusCode::BAD_GATEWAY || status == StatusCode::SERVICE_UNAVAILABLE;
            // llama-swap's per-model limit is a refusal too, passed on
            // where no other node is left; other 429s (a client's own
            // limit) are the client's to see.
            let busy = status == StatusCode::TOO_MANY_REQUESTS && error.code_str() == Some(CONCURRENCY_LIMIT);
            if status == StatusCode::SERVICE_UNAVAILABLE && error.retry_after.is_none() {
                error.retry_after = Some(1);
            }
            let error = UpstreamError::NodeError(error);
            if (refused || busy) && !last {
                Verdict::Failover { eject: refused, error }
            } else {
                Verdict::Fail { eject: refused, error }
            }
        }
    }
}

/// How a streamed answer came to its end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// The node closed it; `complete` where it ended as a whole answer
    /// does (`data: [DONE]`, or an error event of the backend's own, for
    /// streams that end so).
    Closed { complete: bool },
    /// Its connection failed, or went silent for the read timeout;
    /// `complete` where the answer was whole before that (`data: [DONE]`
    /// seen), so nothing of it is lost.
    Failed { complete: bool },
    /// The data plane is shutting down.
    Shutdown,
}

/// What follows a stream's end.
#[derive(Debug)]
pub enum EndVerdict {
    /// It ended as it should.
    Done,
    /// Go on at the next node that may continue it; `Fail` with
    /// [`UpstreamError::StreamBroken`] where none can.
    Continue,
    /// End the stream with `error` as its last event, or, for a body that
    /// is not an event stream, as it is.
    Fail { eject: bool, error: UpstreamError },
    /// Not an event stream: no event can say what went wrong, so the
    /// connection is cut, as the node's was.
    Cut { eject: bool },
}

/// The verdict on a stream's `end`. `event_stream` where the answer is
/// one; `continuable` where it may be continued elsewhere.
pub fn classify_end(end: Ended, event_stream: bool, continuable: bool) -> EndVerdict {
    match end {
        Ended::Closed { complete: true } | Ended::Failed { complete: true } => EndVerdict::Done,
        Ended::Shutdown => EndVerdict::Fail { eject: false, error: UpstreamError::Shutdown },
        Ended::Closed { complete: false } | Ended::Failed { .. } if continuable && event_stream => EndVerdict::Continue,
        // Closed cleanly without its end (the node shut down, say): ended
        // with an error event, not as if whole; its connection did not
        // fail, so the node is not held out.
        Ended::Closed { complete: false } => EndVerdict::Fail { eject: false, error: UpstreamError::StreamCut },
        Ended::Failed { .. } if event_stream => EndVerdict::Fail { eject: true, error: UpstreamError::StreamBroken },
        Ended::Failed { .. } => EndVerdict::Cut { eject: true },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(status: u16, code: Option<&str>) -> Attempted {
        let mut error = crate::http::upstream::normalize(StatusCode::from_u16(status).unwrap(), b"{}");
        error.code = code.map(|c| crate::error::Code::Backend(c.into()));
        Attempted::NodeError(error)
    }

    fn classify(attempt: Attempted, last: bool) -> Verdict {
        super::classify(attempt, last, Purpose::First)
    }

    fn code(error: UpstreamError) -> String {
        error.into_api("n").code_str().unwrap_or_default().to_string()
    }

    #[test]
    fn a_node_that_cannot_be_reached_is_held_out_and_the_next_one_tried() {
        for last in [false, true] {
            let Verdict::Failover { eject: true, error } = classify(Attempted::Unreachable(None), last) else {
                panic!()
            };
            assert_eq!(code(error), "upstream_unreachable");
            let Verdict::Failover { eject: true, error } = classify(Attempted::BodyBroke, last) else { panic!() };
            assert_eq!(code(error), "upstream_broken");
        }
    }

    #[test]
    fn a_timeout_ends_the_request_and_holds_the_node_out() {
        let verdict = classify(Attempted::TimedOut(Duration::from_secs(3)), false);
        let Verdict::Fail { eject: true, error } = verdict else { panic!("{verdict:?}") };
        let error = error.into_api("a");
        assert_eq!((error.code_str(), error.status().as_u16()), (Some("upstream_timeout"), 504));
        assert!(error.message.contains("node `a`"), "{}", error.message);
    }

    #[test]
    fn refusals_for_load_fail_over_until_the_last_node_which_passes_them_on() {
        for status in [502, 503] {
            assert!(matches!(classify(refused(status, None), false), Verdict::Failover { eject: true, .. }));
            let Verdict::Fail { eject: true, error: UpstreamError::NodeError(error) } =
                classify(refused(status, None), true)
            else {
                panic!()
            };
            assert_eq!(error.status().as_u16(), status);
            assert_eq!(error.retry_after, (status == 503).then_some(1), "a 503 says when to come back");
        }
        let busy = classify(refused(429, Some("concurrency_limit")), false);
        assert!(matches!(busy, Verdict::Failover { eject: false, .. }), "busy, not broken: {busy:?}");
        let busy = classify(refused(429, Some("concurrency_limit")), true);
        assert!(matches!(busy, Verdict::Fail { eject: false, error: UpstreamError::NodeError(_) }));
    }

    #[test]
    fn a_client_s_own_errors_are_passed_on_at_once() {
        for (status, code) in [(400, Some("context_length_exceeded")), (429, Some("rate_limit_exceeded")), (404, None)]
        {
            let verdict = classify(refused(status, code), false);
            let Verdict::Fail { eject: false, error: UpstreamError::NodeError(error) } = verdict else {
                panic!("{status}: {verdict:?}")
            };
            assert_eq!(error.status().as_u16(), status);
        }
    }

    #[test]
    fn an_agent_full_of_connections_is_passed_over_not_ejected() {
        let full = || Attempted::ConnectionsFull(ApiError::overloaded("connections"));
        assert!(matches!(classify(full(), false), Verdict::Failover { eject: false, .. }));
        let Verdict::Fail { eject: false, error } = classify(full(), true) else { panic!("the last node") };
        assert_eq!(error.into_api("n").status().as_u16(), 503);
    }

    #[test]
    fn a_credential_refused_is_the_fleet_s_fault_not_the_client_s() {
        let verdict = classify(Attempted::CredentialRefused, false);
        let Verdict::Failover { eject: true, error } = verdict else { panic!("{verdict:?}") };
        let error = error.into_api("n");
        assert_eq!((error.code_str(), error.status().as_u16()), (Some("upstream_auth_misconfigured"), 502));
        assert!(matches!(classify(Attempted::CredentialRefused, true), Verdict::Fail { eject: true, .. }));
        // A backend's own 401 is passed on, whatever its body says: only
        // the agent's header tells its refusal.
        for code in ["invalid_api_key", inferyes_proto::bearer::FLEET_TOKEN_REQUIRED] {
            let key = classify(refused(401, Some(code)), false);
            assert!(matches!(key, Verdict::Fail { eject: false, .. }), "{code}: {key:?}");
        }
    }

    #[test]
    fn an_answer_too_large_to_hold_fails_without_blame() {
        let Verdict::Fail { eject: false, error } = classify(Attempted::BodyTooLarge, false) else { panic!() };
        assert_eq!(code(error), "upstream_answer_too_large");
        assert!(matches!(classify(Attempted::Answered { success: true, event_stream: false }, false), Verdict::Pass));
    }

    #[test]
    fn a_continuation_takes_only_an_event_stream_and_a_timeout_leaves_time_for_the_next_node() {
        let continuing = |attempt| super::classify(attempt, false, Purpose::Continue);
        assert!(matches!(continuing(Attempted::Answered { success: true, event_stream: true }), Verdict::Pass));
        for (success, event_stream) in [(true, false), (false, true)] {
            let verdict = continuing(Attempted::Answered { success, event_stream });
            let Verdict::Failover { eject: true, error } = verdict else { panic!("{verdict:?}") };
            assert_eq!(code(error), "upstream_broken");
        }
        let timed_out = continuing(Attempted::TimedOut(Duration::from_secs(3)));
        let Verdict::Failover { eject: true, error } = timed_out else { panic!("{timed_out:?}") };
        assert_eq!(code(error), "upstream_unreachable");
        // A refusal of the continuation itself (its context full) any node
        // would repeat: the search ends.
        assert!(matches!(continuing(refused(400, Some("exceed_context_size_error"))), Verdict::Fail { .. }));
    }

    #[test]
    fn a_stream_s_end_is_done_resumed_or_told() {
        let complete = Ended::Closed { complete: true };
        let cut = Ended::Closed { complete: false };
        for continuable in [false, true] {
            assert!(matches!(classify_end(complete, true, continuable), EndVerdict::Done));
            let shutdown = classify_end(Ended::Shutdown, true, continuable);
            let EndVerdict::Fail { eject: false, error } = shutdown else { panic!("{shutdown:?}") };
            assert_eq!(code(error), "gateway_shutdown");
        }
        assert!(matches!(classify_end(cut, true, true), EndVerdict::Continue));
        let failed = Ended::Failed { complete: false };
        assert!(matches!(classify_end(failed, true, true), EndVerdict::Continue));
        for continuable in [false, true] {
            let after_done = classify_end(Ended::Failed { complete: true }, true, continuable);
            assert!(matches!(after_done, EndVerdict::Done), "nothing lost, nothing to resume: {after_done:?}");
        }
        let EndVerdict::Fail { eject: false, error } = classify_end(cut, true, false) else { panic!() };
        assert_eq!(code(error), "upstream_broken");
        let EndVerdict::Fail { eject: true, error } = classify_end(failed, true, false) else { panic!() };
        assert_eq!(code(error), "upstream_broken");
        assert!(matches!(classify_end(failed, false, true), EndVerdict::Cut { eject: true }));
    }
}
