//! Mid-stream continuation: when a chat stream breaks in the middle of the
//! answer, it is resumed on another node and the rest spliced into the
//! same client stream ([`super::answer`] does the splicing). The next node
//! gets the conversation plus the partial reply as a trailing assistant
//! message, which llama-server continues; the client sees one answer, with
//! an SSE comment where the splice is.
//!
//! Opt-in (fleet policy), and never for requests whose output is
//! constrained (tools, response formats, grammars): a continuation could
//! not keep those guarantees.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue};
use serde_json::{Value, json};

use super::classify::{Attempt, Verdict, classify};
use super::client::{Answer, Forwarder, Outbound};
use crate::routing::Route;
use crate::snapshot::{LocalCounters, RoutingSnapshot};

/// Another node the stream may continue on.
pub struct Hop {
    pub node: Arc<str>,
    pub proxy_url: inferyes_net::base_url::BaseUrl,
    pub proxy_http2: bool,
    /// The backend's id, as a header value.
    pub backend: Option<HeaderValue>,
    /// What the node's agent takes (the snapshot's).
    pub authorization: Option<HeaderValue>,
    pub local: Arc<LocalCounters>,
}

impl Hop {
    fn destination(&self) -> super::client::Destination<'_> {
        super::client::Destination {
            proxy_url: &self.proxy_url,
            proxy_http2: self.proxy_http2,
            backend: self.backend.as_ref(),
            authorization: self.authorization.as_ref(),
        }
    }
}

/// The nodes after the `index`th of `route`, where a broken stream may go
/// on.
pub fn hops(snapshot: &RoutingSnapshot, route: &Route, index: usize) -> VecDeque<Hop> {
    route.targets[index + 1..]
        .iter()
        .filter_map(|target| {
            let node = snapshot.node(target.node)?;
            let backend = node.backends.get(target.backend)?;
            Some(Hop {
                node: Arc::clone(&node.id),
                proxy_url: node.proxy_url.clone(),
                authorization: snapshot.agent_authorization().cloned(),
                proxy_http2: node.proxy_http2,
                backend: backend.id_header.clone(),
                local: Arc::clone(&node.local),
            })
        })
        .collect()
}

/// The request a continuation is made of: the client's, owned, for an
/// answer body that outlives its handler.
pub struct Request {
    pub forwarder: Forwarder,
    pub path_and_query: PathAndQuery,
    /// The client's, as the attempts made them for a node (what stays
    /// behind taken out, ours put in).
    pub headers: HeaderMap,
    pub body: Bytes,
    pub model: String,
    pub session: Option<String>,
    pub request_id: HeaderValue,
    /// The snapshot routed on, for an ejection.
    pub version: u64,
}

/// What one event of a chat stream says.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    /// A chunk of the answer, with its text if any; `preamble` for the
    /// role-only chunk a stream starts with.
    Chunk {
        content: Option<String>,
        preamble: bool,
    },
    Other,
}

pub fn read(event: &[u8]) -> Event {
    let text = String::from_utf8_lossy(event);
    let Some(data) = text.trim().strip_prefix("data: ") else { return Event::Other };
    let Ok(value) = serde_json::from_str::<Value>(data) else { return Event::Other };
    if value.get("error").is_some() {
        return Event::Other;
    }
    let delta = &value["choices"][0]["delta"];
    let content = delta["content"].as_str().map(str::to_string);
    let preamble = content.is_none() && delta.get("role").is_some() && value["choices"][0]["finish_reason"].is_null();
    Event::Chunk { content, preamble }
}

/// The body that asks for the rest of an answer: the conversation with
/// `partial` as the assistant's last message, its limits less the
/// `generated` chunks.
pub fn continuation_body(body: &[u8], partial: &str, generated: u64) -> Option<Bytes> {
    let mut request: Value = serde_json::from_slice(body).ok()?;
    request["messages"].as_array_mut()?.push(json!({"role": "assistant", "content": partial}));
    for limit in ["max_tokens", "max_completion_tokens"] {
        if let Some(max) = request[limit].as_u64() {
            request[limit] = json!(max.saturating_sub(generated).max(1));
        }
    }
    Some(Bytes::from(request.to_string()))
}

/// A stream gone on at `hop`: its answer, and the hops still left after it.
pub struct Continued {
    pub hop: Hop,
    pub answer: Answer,
    pub left: VecDeque<Hop>,
}

/// Asks the hops in turn to continue the answer, holding out of routing
/// each that fails as [`classify`] says; the first that takes it, with its
/// stream. None where none can: a refusal of the continuation itself (its
/// context full, say) ends the search, since any node would say the same.
pub async fn continue_on(
    request: Arc<Request>,
    mut hops: VecDeque<Hop>,
    partial: String,
    generated: u64,
) -> Option<Continued> {
    let body = continuation_body(&request.body, &partial, generated)?;
    while let Some(hop) = hops.pop_front() {
        let out = Outbound {
            path_and_query: &request.path_and_query,
            headers: HeaderMap::new(),
            body: Bytes::new(),
            model: &request.model,
            session: request.session.as_deref(),
            request_id: &request.request_id,
            stream: true,
            form: false,
            meter: None,
        };
        let headers = request.headers.clone();
        let sent = request.forwarder.send(hop.destination(), &out, headers, body.clone());
        let attempt = match sent.await {
            Err(attempt) => attempt,
            Ok(response) if response.status().is_success() && super::sse::is_event_stream(response.headers()) => {
                return Some(Continued { hop, answer: response.into_body(), left: hops });
            }
            Ok(response) if response.status().is_success() => Attempt::BodyBroke,
            Ok(response) => super::attempt::refusal(response).await,
        };
        // A request's timeout ends its wait for an answer to start; a
        // stream's client has had bytes all along, and the next hop may
        // answer at once.
        let attempt = match attempt {
            Attempt::TimedOut(_) => Attempt::Unreachable(None),
            attempt => attempt,
        };
        let (eject, go_on) = match classify(attempt, hops.is_empty()) {
            Verdict::Pass => (false, true),
            Verdict::Failover { eject, .. } => (eject, true),
            Verdict::Fail { eject, .. } => (eject, false),
        };
        if eject {
            hop.local.eject(inferyes_proto::unix_ms(), request.version);
        }
        if !go_on {
            return None;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_whole_and_read() {
        let mut events = crate::http::sse::Events::default();
        assert!(events.push(b"data: {\"choices\":[{\"delta\":{\"con").is_empty());
        let whole = events.push(b"tent\":\"Hi\"},\"finish_reason\":null}]}\n\ndata: [DONE]\n\n");
        assert_eq!(whole.len(), 2);
        assert_eq!(read(&whole[0]), Event::Chunk { content: Some("Hi".into()), preamble: false });
        assert_eq!(read(&whole[1]), Event::Other);
        let role = br#"data: {"choices":[{"delta":{"role":"assistant","content":null},"finish_reason":null}]}"#;
        assert_eq!(read(role), Event::Chunk { content: None, preamble: true });
        assert_eq!(read(br#"data: {"error":{"message":"x"}}"#), Event::Other);
    }

    #[test]
    fn a_continuation_asks_for_the_rest_of_the_answer() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"count"}],"max_tokens":10,"stream":true}"#;
        let next: Value = serde_json::from_slice(&continuation_body(body, "one two", 4).unwrap()).unwrap();
        assert_eq!(next["messages"][1], json!({"role": "assistant", "content": "one two"}));
        assert_eq!(next["max_tokens"], 6);
        let spent = continuation_body(br#"{"messages":[],"max_completion_tokens":3}"#, "x", 9).unwrap();
        assert_eq!(serde_json::from_slice::<Value>(&spent).unwrap()["max_completion_tokens"], 1, "at least one");
        assert!(continuation_body(b"{}", "x", 1).is_none(), "no conversation to continue");
    }
}
