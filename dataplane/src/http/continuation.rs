//! Mid-stream continuation: when a chat stream breaks in the middle of the
//! answer, it is resumed on another node and the rest spliced into the
//! same client stream ([`super::answer`] does the splicing; the attempts
//! are [`Attempts::run`]'s, as every request's). The next node
//! gets the conversation plus the partial reply as a trailing assistant
//! message, which llama-server continues; the client sees one answer, with
//! an SSE comment where the splice is.
//!
//! Opt-in (fleet policy), and never for requests whose output is
//! constrained (tools, response formats, grammars): a continuation could
//! not keep those guarantees.

use std::sync::Arc;

use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue};
use serde_json::{Value, json};

use super::attempt::{Answer, Attempts, Hops, OpenStream, Outbound};
use super::classify::Purpose;
use super::client::Forwarder;
use crate::routing::Weighed;

/// What a stream needs to go on at another node: the request as its nodes
/// were sent it, owned, for an answer body that outlives its handler.
pub(crate) struct Continuation {
    pub forwarder: Forwarder,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub path_and_query: PathAndQuery,
    /// The client's headers as made for nodes (`upstream_headers`).
    pub headers: HeaderMap,
    pub body: Bytes,
    pub request_id: HeaderValue,
    /// The snapshot the request was routed on.
    pub version: u64,
    /// The request's session turn, recorded where it goes on.
    pub turn: Option<super::attempt::SessionTurn>,
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

/// Asks `hops` in turn to continue the answer, said `partial` in
/// `generated` chunks so far: the stream of the first that takes it, and
/// the hops left after it. None where none can: a refusal of the
/// continuation itself (its context full, say) ends the search, since any
/// node would say the same.
pub(crate) async fn continue_on(
    continuation: Arc<Continuation>,
    mut hops: Hops,
    partial: String,
    generated: u64,
) -> (Option<OpenStream>, Hops) {
    let Some(body) = continuation_body(&continuation.body, &partial, generated) else { return (None, hops) };
    let mut out = Outbound {
        path_and_query: continuation.path_and_query.clone(),
        headers: continuation.headers.clone(),
        body,
        stream: true,
        // Its usage is estimated: what it says of its prompt is not the
        // request's.
        asks_progress: false,
        // Its node now holds the conversation, with as much of the reply
        // as came before the break.
        turn: continuation.turn.clone(),
    };
    let attempts = Attempts {
        forwarder: &continuation.forwarder,
        metrics: &continuation.metrics,
        request_id: &continuation.request_id,
        version: continuation.version,
        meter: None,
        share: None,
        weighed: &Weighed::default(),
    };
    match attempts.run(&mut out, &mut hops, Purpose::Continue).await {
        Ok(Answer::Stream(open)) => (Some(open), hops),
        Ok(Answer::Whole(_)) | Err(_) => (None, hops),
    }
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
