//! A generated answer in the shape of the API that asked for it, whole or
//! as a stream of events, as llama-server b11434 writes each: OpenAI's chat
//! and completions (chunks, `data: [DONE]`), the Anthropic Messages API
//! (`message_start` … `message_stop`) and OpenAI's Responses API
//! (`response.created` … `response.completed`); with the tool call a
//! request required ([`super::call`]) after the text.

use bytes::Bytes;
use serde_json::{Value, json};

use super::{BUILD_INFO, unix_now};
use crate::engine::Timings;

/// The API an answer is written for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Shape {
    Chat,
    Completion,
    Messages,
    Responses,
}

/// One answer's identity, shared by all its events.
pub(super) struct Reply {
    shape: Shape,
    id: String,
    /// The Responses API's one output item.
    item_id: String,
    created: u64,
    model: String,
    /// Its length was the client's limit: a Messages answer that reaches it
    /// stops for `max_tokens`.
    limited: bool,
    /// The tool call the request required: its tool's name, and the call's
    /// id.
    call: Option<(String, String)>,
}

/// What the model wrote: its text, the arguments of the call it began
/// (where it began one), whether it finished the call and stopped by
/// itself rather than at its limit, and the client's stop sequence its
/// call ended with.
#[derive(Default)]
pub(super) struct Written {
    pub(super) text: String,
    pub(super) arguments: Option<String>,
    pub(super) finished: bool,
    pub(super) stop_sequence: Option<String>,
}

fn random_id(prefix: &str) -> String {
    let suffix: String = std::iter::repeat_with(fastrand::alphanumeric).take(32).collect();
    format!("{prefix}{suffix}")
}

impl Reply {
    pub(super) fn new(shape: Shape, model: String, limited: bool, call: Option<&str>) -> Reply {
        // llama-server's Messages answers keep its chat completions' ids.
        let id = match shape {
            Shape::Chat | Shape::Messages => random_id("chatcmpl-"),
            Shape::Completion => random_id("cmpl-"),
            Shape::Responses => random_id("resp_"),
        };
        let item_id = if shape == Shape::Responses { random_id("msg_") } else { String::new() };
        let call = call.map(|name| (name.to_owned(), random_id("")));
        Reply { shape, id, item_id, created: unix_now(), model, limited, call }
    }

    /// The answer read whole.
    pub(super) fn whole(&self, written: &Written, t: &Timings) -> Value {
        let text = written.text.as_str();
        let call = self.call.as_ref().zip(written.arguments.as_deref());
        match self.shape {
            Shape::Chat | Shape::Completion => {
                let finish = self.finish_reason(written);
                let choice = if self.shape == Shape::Chat {
                    let mut message = json!({"role": "assistant", "content": text});
                    if let Some(((name, id), arguments)) = call {
                        message["tool_calls"] = json!([{"type": "function", "id": id,
                            "function": {"name": name, "arguments": arguments}}]);
                    }
                    json!([{"finish_reason": finish, "index": 0, "message": message}])
                } else {
                    json!([{"text": text, "index": 0, "logprobs": null, "finish_reason": finish}])
                };
                let mut body = self.envelope(false, choice);
                body["usage"] = usage(t);
                body["timings"] = timings(t);
                body
            }
            Shape::Messages => json!({
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "content": messages_content(text, call),
                "model": self.model,
                "stop_reason": self.stop_reason(written),
                "stop_sequence": written.stop_sequence,
                "usage": {"cache_read_input_tokens": t.cache_n, "input_tokens": t.prompt_n, "output_tokens": t.predicted_n},
            }),
            Shape::Responses => json!({
                "completed_at": unix_now(),
                "created_at": self.created,
                "id": self.id,
                "model": self.model,
                "object": "response",
                "output": self.output(written),
                "status": "completed",
                "usage": responses_usage(t),
            }),
        }
    }

    /// The events a stream opens with, once its prompt was read (`t`).
    pub(super) fn opening(&self, t: &Timings) -> Vec<Bytes> {
        match self.shape {
            Shape::Chat => {
                let role = json!([{"finish_reason": null, "index": 0,
                                   "delta": {"role": "assistant", "content": null}}]);
                vec![data(&self.envelope(true, role))]
            }
            Shape::Completion => Vec::new(),
            Shape::Messages => vec![
                event(
                    "message_start",
                    &json!({"type": "message_start", "message": {
                        "id": self.id, "type": "message", "role": "assistant", "content": [],
                        "model": self.model, "stop_reason": null, "stop_sequence": null,
                        "usage": {"cache_read_input_tokens": t.cache_n, "input_tokens": t.prompt_n, "output_tokens": 0},
                    }}),
                ),
                event(
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                ),
            ],
            Shape::Responses => {
                let response = json!({"id": self.id, "object": "response", "status": "in_progress"});
                vec![
                    event("response.created", &json!({"type": "response.created", "response": response})),
                    event("response.in_progress", &json!({"type": "response.in_progress", "response": response})),
                    event(
                        "response.output_item.added",
                        &json!({"type": "response.output_item.added", "item": {
                            "content": [], "id": self.item_id, "role": "assistant",
                            "status": "in_progress", "type": "message",
                        }}),
                    ),
                    event(
                        "response.content_part.added",
                        &json!({"type": "response.content_part.added", "item_id": self.item_id,
                                "part": {"type": "output_text", "text": ""}}),
                    ),
                ]
            }
        }
    }

    /// A chat or completions stream's progress event (`return_progress`):
    /// of the prompt's `total` tokens, `cache` found cached and `processed`
    /// read so far, `time_ms` after reading began.
    pub(super) fn progress(&self, total: usize, cache: usize, processed: usize, time_ms: u64) -> Bytes {
        let choices = match self.shape {
            Shape::Chat => json!([{"finish_reason": null, "index": 0,
                                   "delta": {"role": "assistant", "content": null}}]),
            _ => self.delta_choice(None, None),
        };
        let mut chunk = self.envelope(true, choices);
        chunk["prompt_progress"] = json!({"total": total, "cache": cache, "processed": processed, "time_ms": time_ms});
        data(&chunk)
    }

    /// The event that carries one piece of the answer.
    pub(super) fn piece(&self, piece: &str) -> Bytes {
        match self.shape {
            Shape::Chat | Shape::Completion => data(&self.envelope(true, self.delta_choice(Some(piece), None))),
            Shape::Messages => event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": piece}}),
            ),
            Shape::Responses => event(
                "response.output_text.delta",
                &json!({"type": "response.output_text.delta", "item_id": self.item_id, "delta": piece}),
            ),
        }
    }

    /// The events that carry a piece of the call's arguments; the first
    /// piece opens the call, with its name and id.
    pub(super) fn arguments(&self, piece: &str, first: bool) -> Vec<Bytes> {
        let Some((name, id)) = &self.call else { return vec![self.piece(piece)] };
        match self.shape {
            Shape::Chat | Shape::Completion => {
                let call = if first {
                    json!({"index": 0, "id": id, "type": "function", "function": {"name": name, "arguments": piece}})
                } else {
                    json!({"index": 0, "function": {"arguments": piece}})
                };
                let delta = json!([{"finish_reason": null, "index": 0, "delta": {"tool_calls": [call]}}]);
                vec![data(&self.envelope(true, delta))]
            }
            Shape::Messages => {
                let start = json!({"type": "content_block_start", "index": 1,
                                   "content_block": {"type": "tool_use", "id": id, "name": name}});
                let delta = json!({"type": "content_block_delta", "index": 1,
                                   "delta": {"type": "input_json_delta", "partial_json": piece}});
                let events =
                    [first.then(|| event("content_block_start", &start)), Some(event("content_block_delta", &delta))];
                events.into_iter().flatten().collect()
            }
            Shape::Responses => {
                let added = json!({"type": "response.output_item.added", "item": self.call_item("", "in_progress")});
                let delta = json!({"type": "response.function_call_arguments.delta", "delta": piece,
                                   "item_id": format!("fc_{id}")});
                let events = [
                    first.then(|| event("response.output_item.added", &added)),
                    Some(event("response.function_call_arguments.delta", &delta)),
                ];
                events.into_iter().flatten().collect()
            }
        }
    }

    /// The events a stream ends with, once it wrote `written`; chat's usage
    /// chunk where the client asked for it.
    pub(super) fn closing(&self, written: &Written, t: &Timings, include_usage: bool) -> Vec<Bytes> {
        let text = written.text.as_str();
        let finish = self.finish_reason(written);
        match self.shape {
            // Chat's last chunk carries the timings, or, where the client
            // asked for usage, a chunk of its own carries both; a
            // completion's last chunk carries both, asked or not.
            Shape::Chat => {
                let mut last = self.envelope(true, self.delta_choice(None, Some(finish)));
                let mut events = Vec::new();
                if include_usage {
                    let mut chunk = self.envelope(true, json!([]));
                    chunk["usage"] = usage(t);
                    chunk["timings"] = timings(t);
                    events.extend([data(&last), data(&chunk)]);
                } else {
                    last["timings"] = timings(t);
                    events.push(data(&last));
                }
                events.push(Bytes::from_static(b"data: [DONE]\n\n"));
                events
            }
            Shape::Completion => {
                let mut last = self.envelope(true, self.delta_choice(None, Some(finish)));
                last["usage"] = usage(t);
                last["timings"] = timings(t);
                vec![data(&last), Bytes::from_static(b"data: [DONE]\n\n")]
            }
            Shape::Messages => {
                let blocks = if written.arguments.is_some() { 2 } else { 1 };
                let mut events: Vec<Bytes> = (0..blocks)
                    .map(|index| event("content_block_stop", &json!({"type": "content_block_stop", "index": index})))
                    .collect();
                events.push(event(
                    "message_delta",
                    &json!({"type": "message_delta",
                            "delta": {"stop_reason": self.stop_reason(written), "stop_sequence": written.stop_sequence},
                            "usage": {"output_tokens": t.predicted_n}}),
                ));
                events.push(event("message_stop", &json!({"type": "message_stop"})));
                events
            }
            Shape::Responses => {
                let part = json!({"type": "output_text", "annotations": [], "logprobs": [], "text": text});
                let output = self.output(written);
                let mut events = vec![
                    event(
                        "response.output_text.done",
                        &json!({"type": "response.output_text.done", "item_id": self.item_id, "text": text}),
                    ),
                    event(
                        "response.content_part.done",
                        &json!({"type": "response.content_part.done", "item_id": self.item_id, "part": part}),
                    ),
                ];
                // The call's item closes after the message before it, as
                // llama-server closes them.
                for item in &output {
                    events.push(event(
                        "response.output_item.done",
                        &json!({"type": "response.output_item.done", "item": item}),
                    ));
                }
                events.push(event(
                    "response.completed",
                    &json!({
                        "type": "response.completed",
                        "response": {
                            "id": self.id, "object": "response", "created_at": self.created,
                            "status": "completed", "model": self.model,
                            "output": output, "usage": responses_usage(t),
                        },
                        "timings": timings(t),
                    }),
                ));
                events
            }
        }
    }

    /// A chat or completions answer's finish reason: a finished call's, a
    /// stop sequence's, or the limit's (the simulated model writes until
    /// it).
    fn finish_reason(&self, written: &Written) -> &'static str {
        match (written.finished, written.arguments.is_some()) {
            (true, true) => "tool_calls",
            (true, false) => "stop",
            (false, _) => "length",
        }
    }

    fn stop_reason(&self, written: &Written) -> &'static str {
        if written.finished {
            return if written.arguments.is_some() { "tool_use" } else { "stop_sequence" };
        }
        if self.limited { "max_tokens" } else { "end_turn" }
    }

    /// The Responses API's output: a message of the answer's text, then the
    /// call where one was begun.
    fn output(&self, written: &Written) -> Vec<Value> {
        let message = json!({
            "type": "message", "status": "completed", "id": self.item_id, "role": "assistant",
            "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": written.text}],
        });
        let call = written.arguments.as_deref().map(|arguments| self.call_item(arguments, "completed"));
        std::iter::once(message).chain(call.flatten()).collect()
    }

    /// The Responses API's item of the call, with `arguments` so far.
    fn call_item(&self, arguments: &str, status: &str) -> Option<Value> {
        let (name, id) = self.call.as_ref()?;
        Some(json!({"id": format!("fc_{id}"), "type": "function_call", "status": status, "arguments": arguments,
                    "call_id": format!("call_{id}"), "name": name}))
    }

    /// A chat or completions body or chunk around `choices`.
    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        let object = match (self.shape, chunk) {
            (Shape::Chat, false) => "chat.completion",
            (Shape::Chat, true) => "chat.completion.chunk",
            _ => "text_completion",
        };
        json!({
            "choices": choices,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": BUILD_INFO,
            "object": object,
            "id": self.id,
        })
    }

    /// A streamed choice carrying `piece` (or nothing) and a finish reason.
    fn delta_choice(&self, piece: Option<&str>, finish: Option<&str>) -> Value {
        if self.shape == Shape::Chat {
            let delta = match piece {
                Some(p) => json!({"content": p}),
                None => json!({}),
            };
            return json!([{"finish_reason": finish, "index": 0, "delta": delta}]);
        }
        json!([{"text": piece.unwrap_or(""), "index": 0, "logprobs": null, "finish_reason": finish}])
    }
}

/// A Messages answer's content: its text, then the call where one was
/// begun (arguments cut at the limit are no JSON object: an empty input).
fn messages_content(text: &str, call: Option<(&(String, String), &str)>) -> Value {
    let text = json!({"type": "text", "text": text});
    let Some(((name, id), arguments)) = call else { return json!([text]) };
    let input = serde_json::from_str::<Value>(arguments).ok().filter(Value::is_object);
    json!([text, {"type": "tool_use", "id": id, "name": name, "input": input.unwrap_or_else(|| json!({}))}])
}

/// An event of OpenAI's chat and completions streams.
fn data(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// A named event, as the Messages and Responses streams send them.
fn event(name: &str, value: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {value}\n\n"))
}

fn usage(t: &Timings) -> Value {
    let prompt = t.cache_n + t.prompt_n;
    json!({
        "completion_tokens": t.predicted_n,
        "prompt_tokens": prompt,
        "total_tokens": prompt + t.predicted_n,
        "prompt_tokens_details": {"cached_tokens": t.cache_n},
    })
}

fn responses_usage(t: &Timings) -> Value {
    let input = t.cache_n + t.prompt_n;
    json!({
        "input_tokens": input,
        "output_tokens": t.predicted_n,
        "total_tokens": input + t.predicted_n,
        "input_tokens_details": {"cached_tokens": t.cache_n},
    })
}

fn timings(t: &Timings) -> Value {
    let per_token = |ms: f64, n: usize| if n == 0 { 0.0 } else { ms / n as f64 };
    let per_second = |ms: f64, n: usize| {
        if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 }
    };
    json!({
        "cache_n": t.cache_n,
        "prompt_n": t.prompt_n,
        "prompt_ms": t.prompt_ms,
        "prompt_per_token_ms": per_token(t.prompt_ms, t.prompt_n),
        "prompt_per_second": per_second(t.prompt_ms, t.prompt_n),
        "predicted_n": t.predicted_n,
        "predicted_ms": t.predicted_ms,
        "predicted_per_token_ms": per_token(t.predicted_ms, t.predicted_n),
        "predicted_per_second": per_second(t.predicted_ms, t.predicted_n),
    })
}
