//! Mid-stream continuation: when a chat stream breaks in the middle of the
//! answer, resume it on another node and splice the rest into the same
//! client stream. The next node gets the conversation plus the partial
//! reply as a trailing assistant message, which llama-server continues; the
//! client sees one answer, with an SSE comment where the splice is.
//!
//! Opt-in (fleet policy), and never for requests whose output is
//! constrained (tools, response formats, grammars): a continuation could not
//! keep those guarantees.

use std::collections::VecDeque;
use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use http_body_util::BodyExt;
use inferyes_proto::ErrorKind;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::ApiError;
use super::forward::{Answer, Forwarder, InFlight, Outbound, error_event};
use crate::snapshot::LocalCounters;

/// Another node the stream may continue on.
pub struct Hop {
    pub node: Arc<str>,
    pub proxy_url: inferyes_proto::base_url::BaseUrl,
    pub proxy_http2: bool,
    /// The backend's id, as a header value.
    pub backend: Option<http::HeaderValue>,
    pub local: Arc<LocalCounters>,
}

/// What a continuation request is made of.
pub struct Resume {
    pub forwarder: Forwarder,
    pub path_and_query: http::uri::PathAndQuery,
    /// The client's.
    pub headers: http::HeaderMap,
    pub body: Bytes,
    pub model: String,
    pub session: Option<String>,
    pub request_id: http::HeaderValue,
    pub hops: VecDeque<Hop>,
    pub version: u64,
    pub hard_stop: tokio_util::sync::CancellationToken,
    pub meter: Option<crate::usage::Meter>,
    /// Take the usage-only chunk out (the data plane asked for it).
    pub strip_usage: bool,
}

/// What one event says.
enum Event {
    Done,
    Error,
    /// A chunk of the answer, with its text if any.
    Chunk {
        content: Option<String>,
        preamble: bool,
    },
    Other,
}

fn read(event: &[u8]) -> Event {
    let text = String::from_utf8_lossy(event);
    let Some(data) = text.trim().strip_prefix("data: ") else { return Event::Other };
    if data == "[DONE]" {
        return Event::Done;
    }
    let Ok(value) = serde_json::from_str::<Value>(data) else { return Event::Other };
    if value.get("error").is_some() {
        return Event::Error;
    }
    let delta = &value["choices"][0]["delta"];
    let content = delta["content"].as_str().map(str::to_string);
    let preamble = content.is_none() && delta.get("role").is_some() && value["choices"][0]["finish_reason"].is_null();
    Event::Chunk { content, preamble }
}

/// The first node's stream, continued on `resume.hops` if it breaks.
pub fn spawn(first: Answer, guard: InFlight, node: Arc<str>, resume: Resume) -> Body {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    // The request's span lives as long as the stream, resumed hops included.
    tokio::spawn(tracing::Instrument::in_current_span(pipe(first, guard, node, resume, tx)));
    Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
}

async fn pipe(
    mut body: Answer,
    mut guard: InFlight,
    mut node: Arc<str>,
    mut resume: Resume,
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
) {
    let mut partial = String::new();
    let mut generated: u64 = 0;
    let mut continued = false;
    let mut usage = None;
    // A continued answer's usage is partly the first node's: it is
    // estimated (prompt from the request, one token per event).
    let finish = |outcome: crate::usage::Outcome, usage: Option<inferyes_proto::usage::Usage>, continued: bool| {
        if let Some(meter) = &resume.meter {
            meter.finish(200, outcome, if continued { None } else { usage });
        }
    };
    loop {
        let mut events = super::sse::Events::default();
        let mut finished = false;
        loop {
            let frame = tokio::select! {
                frame = body.frame() => frame,
                () = resume.hard_stop.cancelled() => {
                    let error = ApiError::new(
                        ErrorKind::Unavailable,
                        "the gateway shut down before the answer was complete",
                        "gateway_shutdown",
                    );
                    let _ = tx.send(Ok(error_event(&error))).await;
                    finish(crate::usage::Outcome::Broken, usage, continued);
                    return;
                }
            };
            let Some(Ok(frame)) = frame else { break };
            let Ok(data) = frame.into_data() else { continue };
            for event in events.push(&data) {
                if let Some(meter) = &resume.meter {
                    meter.frame(|| super::sse::carries_output(&event));
                    meter.data_events(super::sse::count_data_events(&event));
                    if let Some(found) = inferyes_proto::usage::parse_usage(&event) {
                        usage = Some(found);
                    }
                }
                if resume.strip_usage && super::sse::is_usage_only_event(&event) {
                    continue;
                }
                match read(&event) {
                    Event::Done => finished = true,
                    Event::Error => {
                        // The backend's own word on why its answer ends (the
                        // request's context is full, say): another node would
                        // say the same. Passed on, as without continuation.
                        let _ = tx.send(Ok(event)).await;
                        finish(crate::usage::Outcome::Error, usage, continued);
                        return;
                    }
                    Event::Chunk { preamble: true, .. } if continued => continue,
                    Event::Chunk { content, .. } => {
                        if let Some(content) = content {
                            partial.push_str(&content);
                            generated += 1;
                        }
                    }
                    Event::Other => {}
                }
                if tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
            if finished {
                break;
            }
        }
        if finished {
            finish(crate::usage::Outcome::Ok, usage, continued);
            drop(tx);
            // What follows `[DONE]` is the answer's end: read, it gives the
            // connection back to the pool instead of closing it.
            let _ = tokio::time::timeout(std::time::Duration::from_secs(1), async {
                while let Some(Ok(_)) = body.frame().await {}
            })
            .await;
            return;
        }
        // Broken. Eject the node, and go on elsewhere if there is a place.
        let ejected_ms = guard.local.eject(inferyes_proto::unix_ms(), resume.version);
        tracing::warn!(
            request_id = super::id_text(&resume.request_id),
            node = %node,
            ejected_ms,
            generated,
            "stream broke mid-answer; continuing elsewhere"
        );
        let mut next = None;
        while let Some(hop) = resume.hops.pop_front() {
            match continue_on(&resume, &hop, &partial, generated).await {
                Some(stream) => {
                    next = Some((hop, stream));
                    break;
                }
                None => {
                    hop.local.eject(inferyes_proto::unix_ms(), resume.version);
                }
            }
        }
        let Some((hop, stream)) = next else {
            let error = ApiError::new(
                ErrorKind::Upstream,
                format!("node `{node}` failed in the middle of the stream and no node could continue it"),
                "upstream_broken",
            );
            let _ = tx.send(Ok(error_event(&error))).await;
            finish(crate::usage::Outcome::Broken, usage, continued);
            return;
        };
        resume.forwarder.metrics.continuations.inc();
        let note = format!(": continued on node {} after node {node} broke ({generated} chunks in)\n\n", hop.node);
        if tx.send(Ok(Bytes::from(note))).await.is_err() {
            return;
        }
        guard = InFlight::enter(Arc::clone(&hop.local));
        node = hop.node;
        body = stream;
        continued = true;
    }
}

/// Asks `hop` to continue the answer; its stream when it accepted.
async fn continue_on(resume: &Resume, hop: &Hop, partial: &str, generated: u64) -> Option<Answer> {
    let mut request: Value = serde_json::from_slice(&resume.body).ok()?;
    request["messages"].as_array_mut()?.push(json!({"role": "assistant", "content": partial}));
    for limit in ["max_tokens", "max_completion_tokens"] {
        if let Some(max) = request[limit].as_u64() {
            request[limit] = json!(max.saturating_sub(generated).max(1));
        }
    }
    let outbound = Outbound {
        path_and_query: &resume.path_and_query,
        headers: resume.headers.clone(),
        body: Bytes::from(request.to_string()),
        model: &resume.model,
        session: resume.session.as_deref(),
        request_id: &resume.request_id,
        stream: true,
        expects_done: true,
        continuation: false,
        meter: None,
        strip_usage: false,
    };
    let response = resume.forwarder.send(&hop.proxy_url, hop.proxy_http2, hop.backend.as_ref(), outbound).await.ok()?;
    let event_stream = response
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    (response.status().is_success() && event_stream).then(|| response.into_body())
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
        assert!(matches!(read(&whole[0]), Event::Chunk { content: Some(ref c), preamble: false } if c == "Hi"));
        assert!(matches!(read(&whole[1]), Event::Done));
        let role = br#"data: {"choices":[{"delta":{"role":"assistant","content":null},"finish_reason":null}]}"#;
        assert!(matches!(read(role), Event::Chunk { content: None, preamble: true }));
        assert!(matches!(read(br#"data: {"error":{"message":"x"}}"#), Event::Error));
    }
}
