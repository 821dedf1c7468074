//! Generation, shared by every API that asks for it (chat, completions,
//! the Messages API, the Responses API): a request read into a prompt and
//! its limits, a slot waited for and the prompt read, then the answer,
//! whole or streamed token by token, in its API's shape
//! ([`super::reply`]).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::debug;

use super::call::{self, Call, Part};
use super::reply::{Reply, Shape, Written};
use super::{BadRequest, Kind, admit_error, json_response, shutting_down};
use crate::Inner;
use crate::engine::{AdmitError, Engine, Lease};
use crate::swap::InFlight;
use crate::tokens::{ChatMessage, Generator, render_chatml, tokenize};

/// A generation as a request asks for it.
#[derive(Debug)]
pub(super) struct Request {
    prompt: Vec<u32>,
    n_predict: Option<usize>,
    /// The client set the limit (a Messages answer that reaches it stops
    /// for `max_tokens`, one that does not for `end_turn`).
    limited: bool,
    stream: bool,
    include_usage: bool,
    /// A stream that asked for the prompt's progress (`return_progress`),
    /// in an API whose chunks carry it.
    progress: bool,
    id_slot: Option<usize>,
    shape: Shape,
    model: String,
    /// The tool call the request requires.
    call: Option<Call>,
    /// The client's stop sequences (`stop`, or the Messages API's
    /// `stop_sequences`): one that the call's closing tag ends with ends
    /// it there. They are not looked for in text, which is written to its
    /// limit: the simulated model's words rarely make one.
    stop: Vec<String>,
}

/// Tokens of a prompt read at a time: llama-server's default
/// `--batch-size`, after each of which it tells a stream's progress.
const N_BATCH: usize = 2048;

/// The request's fields that limit its answer, in the order llama-server
/// reads them.
fn limits(kind: Kind) -> &'static [&'static str] {
    match kind {
        Kind::Messages => &["max_tokens"],
        Kind::Responses => &["max_output_tokens"],
        _ => &["max_tokens", "max_completion_tokens", "n_predict"],
    }
}

pub(super) fn parse_request(s: &Inner, engine: &Engine, kind: Kind, req: &Value) -> Result<Request, BadRequest> {
    let text = prompt_of(kind, req)?;
    let mut n_predict = Some(s.config.default_max_tokens as usize);
    let mut limited = false;
    for key in limits(kind) {
        match req.get(*key) {
            None | Some(Value::Null) => continue,
            Some(v) => {
                let n = v.as_i64().ok_or_else(|| BadRequest::new(format!("\"{key}\" must be an integer")))?;
                // Negative means no limit: the reply runs until the slot is full.
                n_predict = usize::try_from(n).ok();
                limited = n_predict.is_some();
                break;
            }
        }
    }
    let stream = match req.get("stream") {
        None | Some(Value::Null) => false,
        Some(v) => v.as_bool().ok_or_else(|| BadRequest::new("\"stream\" must be a boolean"))?,
    };
    let include_usage = req.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);
    let id_slot = match req.get("id_slot") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let n = v.as_i64().ok_or_else(|| BadRequest::new("\"id_slot\" must be an integer"))?;
            usize::try_from(n).ok()
        }
    };
    let shape = match kind {
        Kind::Chat => Shape::Chat,
        Kind::Messages => Shape::Messages,
        Kind::Responses => Shape::Responses,
        _ => Shape::Completion,
    };
    let model = req.get("model").and_then(Value::as_str).map_or_else(|| engine.model().id.clone(), str::to_owned);
    let progress = stream
        && matches!(shape, Shape::Chat | Shape::Completion)
        && req.get("return_progress").and_then(Value::as_bool).unwrap_or(false);
    let prompt = tokenize(&text);
    let call = Call::required(kind, req, Generator::new(&prompt));
    let stop = match req.get(if kind == Kind::Messages { "stop_sequences" } else { "stop" }) {
        Some(Value::String(stop)) => vec![stop.clone()],
        Some(Value::Array(stops)) => stops.iter().filter_map(Value::as_str).map(str::to_owned).collect(),
        _ => Vec::new(),
    };
    Ok(Request { prompt, n_predict, limited, stream, include_usage, progress, id_slot, shape, model, call, stop })
}

/// The prompt a request of `kind` makes, as the chat template renders it
/// for those that hold a conversation.
pub(super) fn prompt_of(kind: Kind, req: &Value) -> Result<String, BadRequest> {
    Ok(match kind {
        Kind::Chat => render_chatml(&chat_messages(req)?),
        Kind::Messages | Kind::CountTokens => render_chatml(&anthropic_messages(req)?),
        Kind::Responses => render_chatml(&responses_input(req)?),
        _ => parse_prompt(req)?,
    })
}

fn chat_messages(req: &Value) -> Result<Vec<ChatMessage>, BadRequest> {
    let messages = req
        .get("messages")
        .ok_or_else(|| BadRequest::new("'messages' is required"))?
        .as_array()
        .ok_or_else(|| BadRequest::new("Expected 'messages' to be an array"))?;
    if messages.is_empty() {
        return Err(BadRequest::new("'messages' must not be empty"));
    }
    messages
        .iter()
        .map(|m| {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| BadRequest::new("each message needs a string 'role'"))?;
            let content = match m.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut out = String::new();
                    for p in parts {
                        match p.get("type").and_then(Value::as_str) {
                            Some("text") => out.push_str(
                                p.get("text")
                                    .and_then(Value::as_str)
                                    .ok_or_else(|| BadRequest::new("a text content part needs a string 'text'"))?,
                            ),
                            _ => {
                                return Err(BadRequest::new("only text content parts are supported by this model"));
                            }
                        }
                    }
                    out
                }
                Some(_) => {
                    return Err(BadRequest::new("'content' must be a string or an array of content parts"));
                }
            };
            let calls = m.get("tool_calls").and_then(Value::as_array).into_iter().flatten();
            let calls = calls.filter_map(|c| {
                Some(call::render(c.pointer("/function/name")?.as_str()?, c.pointer("/function/arguments")?.as_str()?))
            });
            Ok(ChatMessage { role: role.to_owned(), content: content + &calls.collect::<String>() })
        })
        .collect()
}

/// The text of an Anthropic content: a string, or its text blocks, tool
/// calls as the model wrote them and tool results' text (other blocks,
/// which a text model cannot read, are left out, as llama-server leaves
/// them).
fn anthropic_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .filter_map(|b| match b.get("type").and_then(Value::as_str)? {
                "text" => Some(b.get("text")?.as_str()?.to_owned()),
                "tool_use" => Some(call::render(b.get("name")?.as_str()?, &b.get("input")?.to_string())),
                "tool_result" => Some(anthropic_text(b.get("content"))),
                _ => None,
            })
            .collect(),
        _ => String::new(),
    }
}

/// A Messages request's conversation, its `system` first. llama-server
/// answers one without `messages` with a server error.
fn anthropic_messages(req: &Value) -> Result<Vec<ChatMessage>, BadRequest> {
    let messages = req
        .get("messages")
        .ok_or_else(|| BadRequest::server_error("'messages' is required"))?
        .as_array()
        .ok_or_else(|| BadRequest::new("Expected 'messages' to be an array"))?;
    let system =
        req.get("system").map(|system| ChatMessage { role: "system".into(), content: anthropic_text(Some(system)) });
    let conversation = messages.iter().map(|m| ChatMessage {
        role: m.get("role").and_then(Value::as_str).unwrap_or("user").to_owned(),
        content: anthropic_text(m.get("content")),
    });
    Ok(system.into_iter().chain(conversation).collect())
}

/// A Responses request's conversation: its `instructions` first, then its
/// `input`, one user message or a list of messages.
fn responses_input(req: &Value) -> Result<Vec<ChatMessage>, BadRequest> {
    let instructions = req
        .get("instructions")
        .and_then(Value::as_str)
        .map(|text| ChatMessage { role: "system".into(), content: text.to_owned() });
    let input = match req.get("input") {
        None | Some(Value::Null) => return Err(BadRequest::new("'input' is required")),
        Some(Value::String(text)) => vec![ChatMessage { role: "user".into(), content: text.clone() }],
        Some(Value::Array(items)) if items.iter().all(Value::is_object) => {
            let mut messages: Vec<ChatMessage> = Vec::with_capacity(items.len());
            for item in items {
                let text = |key: &str| item.get(key).and_then(Value::as_str).unwrap_or_default().to_owned();
                let kind = item.get("type").and_then(Value::as_str);
                let (role, content) = match kind {
                    Some("function_call") => ("assistant", call::render(&text("name"), &text("arguments"))),
                    Some("function_call_output") => ("tool", text("output")),
                    _ => {
                        let content = match item.get("content") {
                            Some(Value::String(text)) => text.clone(),
                            Some(Value::Array(parts)) => {
                                parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect()
                            }
                            _ => String::new(),
                        };
                        (item.get("role").and_then(Value::as_str).unwrap_or("user"), content)
                    }
                };
                // A call is part of the turn the model wrote it in: after
                // its text, as the model wrote them.
                match messages.last_mut() {
                    Some(last) if kind == Some("function_call") && last.role == "assistant" => {
                        last.content.push_str(&content);
                    }
                    _ => messages.push(ChatMessage { role: role.to_owned(), content }),
                }
            }
            messages
        }
        Some(_) => return Err(BadRequest::new("'input' must be a string or array of objects")),
    };
    Ok(instructions.into_iter().chain(input).collect())
}

fn parse_prompt(req: &Value) -> Result<String, BadRequest> {
    match req.get("prompt") {
        Some(Value::String(p)) => Ok(p.clone()),
        Some(Value::Array(items)) => match items.first() {
            Some(Value::String(p)) => Ok(p.clone()),
            _ => Err(BadRequest::new("\"prompt\" must be a string or an array of strings")),
        },
        None => Err(BadRequest::new("\"prompt\" is required")),
        Some(_) => Err(BadRequest::new("\"prompt\" must be a string or an array of strings")),
    }
}

/// Generates `request`'s answer on `engine`; `in_flight` is held until it
/// is complete, streamed or not.
pub(super) async fn generate(
    s: Arc<Inner>,
    engine: Arc<Engine>,
    request: Request,
    in_flight: Option<InFlight>,
) -> Response {
    let Request { prompt, n_predict, limited, stream, include_usage, progress, id_slot, shape, model, call, stop } =
        request;
    let shutdown = s.shutdown.clone();
    // Waiting for a slot and the prompt evaluation happen before any byte is
    // sent, as llama-server waits for the first result before its headers;
    // a stream that asked for progress is answered as its prompt is read.
    let started = async {
        let mut lease = engine.acquire(prompt, id_slot, n_predict).await?;
        if !progress {
            lease.prefill().await;
        }
        Ok::<Lease, AdmitError>(lease)
    };
    let lease = tokio::select! {
        r = started => r,
        () = shutdown.cancelled() => return shutting_down(),
    };
    let mut lease = match lease {
        Ok(l) => l,
        Err(e) => return admit_error(&e),
    };
    debug!(
        slot = lease.admission().slot,
        prompt_tokens = lease.prompt_tokens(),
        cached_tokens = lease.cached(),
        "sim request admitted"
    );
    let reply = Reply::new(shape, model, limited, call.as_ref().map(|call| call.name.as_str()));

    if stream {
        let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(16);
        tokio::spawn(async move {
            // Held until the stream ends so llama-swap's limit counts it.
            let _in_flight = in_flight;
            tokio::select! {
                () = stream_reply(&mut lease, &reply, Writing::new(call.as_ref(), &stop), (include_usage, progress), &tx) => {}
                // Ending the stream lets graceful shutdown complete.
                () = shutdown.cancelled() => {}
            }
        });
        let mut resp = Response::new(Body::from_stream(ReceiverStream::new(rx)));
        resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return resp;
    }

    let mut writing = Writing::new(call.as_ref(), &stop);
    let decoded = async { while writing.next(&mut lease).await.is_some() {} };
    tokio::select! {
        () = decoded => {}
        () = shutdown.cancelled() => return shutting_down(),
    }
    let timings = lease.timings();
    drop(lease);
    drop(in_flight);
    json_response(StatusCode::OK, reply.whole(&writing.written, &timings))
}

/// The model's answer as it is decoded: without a call, text until its
/// limit; with one, what the call's script holds.
struct Writing<'a> {
    call: Option<&'a Call>,
    stop: &'a [String],
    /// The script's next piece.
    at: usize,
    /// The script written so far, whole.
    script: String,
    written: Written,
}

impl<'a> Writing<'a> {
    fn new(call: Option<&'a Call>, stop: &'a [String]) -> Writing<'a> {
        Writing { call, stop, at: 0, script: String::new(), written: Written::default() }
    }

    /// Decodes the next piece: it and what it is part of, `None` once the
    /// model stopped or reached its limit.
    async fn next(&mut self, lease: &mut Lease) -> Option<(&'a str, Part)> {
        let Some(call) = self.call else {
            let piece = lease.next_piece().await?;
            self.written.text.push_str(piece);
            return Some((piece, Part::Text));
        };
        let Some((piece, part)) = call.script.get(self.at).filter(|_| self.written.stop_sequence.is_none()) else {
            self.written.finished = true;
            return None;
        };
        if !lease.decode(piece).await {
            return None;
        }
        self.at += 1;
        match part {
            Part::Text => self.written.text.push_str(piece),
            Part::Arguments => self.written.arguments.get_or_insert_default().push_str(piece),
            Part::Frame => {}
        }
        self.script.push_str(piece);
        // Looked for where the call closes only: there a stop hides nothing
        // the client was sent (llama-server would hold back and cut a stop
        // met in text).
        if *part == Part::Frame && self.written.arguments.is_some() {
            let stop = self.stop.iter().filter(|stop| !stop.is_empty());
            self.written.stop_sequence = stop.into_iter().find(|stop| self.script.ends_with(stop.as_str())).cloned();
        }
        Some((piece, *part))
    }
}

/// Emits the answer token by token. Returns early when the client went
/// away; dropping the lease then frees the slot.
async fn stream_reply(
    lease: &mut Lease,
    reply: &Reply,
    mut writing: Writing<'_>,
    (include_usage, progress): (bool, bool),
    tx: &mpsc::Sender<Result<Bytes, Infallible>>,
) {
    if progress {
        // As llama-server: what was found cached first, then each batch.
        let (total, cache, started) = (lease.prompt_tokens(), lease.cached(), std::time::Instant::now());
        let mut read = Some(cache);
        while let Some(processed) = read {
            let time_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
            if tx.send(Ok(reply.progress(total, cache, processed, time_ms))).await.is_err() {
                return;
            }
            read = lease.prefill_batch(N_BATCH).await;
        }
    }
    for event in reply.opening(&lease.timings()) {
        if tx.send(Ok(event)).await.is_err() {
            return;
        }
    }
    let mut opened = false;
    while let Some((piece, part)) = writing.next(lease).await {
        let events = match part {
            Part::Text => vec![reply.piece(piece)],
            Part::Frame => continue,
            Part::Arguments => reply.arguments(piece, !std::mem::replace(&mut opened, true)),
        };
        for event in events {
            if tx.send(Ok(event)).await.is_err() {
                debug!(generated = lease.generated(), "sim client went away mid-stream");
                return;
            }
        }
    }
    for event in reply.closing(&writing.written, &lease.timings(), include_usage) {
        if tx.send(Ok(event)).await.is_err() {
            return;
        }
    }
}
