//! The fields of the Responses API's stream events that llama-server leaves
//! out and OpenAI's clients build the answer with: each event's
//! `sequence_number`; the `output_index` of the output item an event is
//! about, the `content_index` of its content part and the item's
//! `item_id`; the `logprobs` of a text event; the response's `output` list
//! as it opens. Without them the OpenAI SDK's `responses.stream()` fails
//! with a `TypeError` on the first content event.
//!
//! A field the server sent is kept, and counting goes on from it; the
//! missing ones are written ahead of the server's, whose bytes go on as
//! they came (an event that lacks nothing passes through unchanged).
//! Events are read whole, one at a time, and go on as soon as they are
//! whole; the last ones carry the whole answer's text, so an event may be
//! long.

use std::borrow::Cow;
use std::collections::VecDeque;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// The longest event read whole: a Responses stream's last events each
/// carry the whole answer. A longer one goes on as it is.
const MAX_EVENT: usize = 4 << 20;

/// The most output items remembered: a stream opens one a message or call,
/// and one with more is hostile or broken; past it the oldest is forgotten.
const MAX_ITEMS: usize = 64;

/// The longest item id remembered and looked up (llama-server's are 35
/// bytes): a longer one is not, so a hostile backend's items cost at most
/// this much each to keep and to compare.
const MAX_ID_BYTES: usize = 256;

/// Counts a Responses stream's events and output, and fills in what its
/// events leave out.
pub(crate) struct EventFields {
    events: super::sse::Events,
    /// The next event's sequence number.
    sequence: u64,
    /// The output items opened, oldest first. llama-server closes a message
    /// after the function calls opened after it, so an event is matched to
    /// its item by id, not taken to be about the last one opened.
    items: VecDeque<Item>,
    /// Output items opened so far.
    opened: u64,
}

/// An output item of the stream.
struct Item {
    index: u64,
    id: Option<String>,
    /// Its content parts opened so far.
    parts: u64,
}

impl Default for EventFields {
    fn default() -> EventFields {
        EventFields {
            events: super::sse::Events::with_limit(MAX_EVENT),
            sequence: 0,
            items: VecDeque::new(),
            opened: 0,
        }
    }
}

impl EventFields {
    /// The whole events `data` completes, with their fields filled in;
    /// `None` while none is whole.
    pub(crate) fn push(&mut self, data: &[u8]) -> Option<Bytes> {
        let mut out = Vec::with_capacity(data.len() + 64);
        for event in self.events.push(data) {
            self.fill(&event, &mut out);
        }
        (!out.is_empty()).then(|| Bytes::from(out))
    }

    /// A partial event left when the stream ends, as it is.
    pub(crate) fn take_rest(&mut self) -> Option<Bytes> {
        (!self.events.is_empty()).then(|| self.events.take_rest())
    }

    /// Writes `event` to `out`, the fields its JSON data lacks written
    /// ahead of its own; an event without one (a comment) or whose data is
    /// not a JSON object goes as it is.
    fn fill(&mut self, event: &[u8], out: &mut Vec<u8>) {
        let Some((start, end)) = data_line(event) else {
            out.extend_from_slice(event);
            return;
        };
        let json = &event[start..end];
        let Some(open) = json.iter().position(|b| !b.is_ascii_whitespace()).filter(|at| json[*at] == b'{') else {
            out.extend_from_slice(event);
            return;
        };
        let Ok(head) = serde_json::from_slice::<Head<'_>>(json) else {
            out.extend_from_slice(event);
            return;
        };
        let missing = self.missing(&head);
        if missing.response_output
            && json.len() <= MAX_OPENING
            && let Ok(mut fields) = serde_json::from_slice::<Map<String, Value>>(json)
            && let Some(Value::Object(response)) = fields.get_mut("response")
        {
            // The opening response, small: written anew with its list.
            response.insert("output".into(), Value::Array(Vec::new()));
            for (key, value) in missing.fields {
                fields.insert(key.into(), value);
            }
            out.extend_from_slice(&event[..start]);
            // A map of values serializes infallibly.
            let _ = serde_json::to_writer(&mut *out, &fields);
            out.extend_from_slice(&event[end..]);
            return;
        }
        out.extend_from_slice(&event[..start + open + 1]);
        let empty = json[open + 1..].iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
        for (i, (key, value)) in missing.fields.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            let _ = serde_json::to_writer(&mut *out, key);
            out.push(b':');
            let _ = serde_json::to_writer(&mut *out, value);
        }
        if !missing.fields.is_empty() && !empty {
            out.push(b',');
        }
        out.extend_from_slice(&event[start + open + 1..]);
    }

    /// What `head`, the next event's, lacks; the counts moved on past it.
    fn missing(&mut self, head: &Head<'_>) -> Missing {
        let mut missing = Missing::default();
        let kind = text(head.kind).unwrap_or_default();
        let kind = kind.as_ref();
        match number(head.sequence_number) {
            Some(given) => self.sequence = given.saturating_add(1),
            None => {
                missing.fields.push(("sequence_number", Value::from(self.sequence)));
                self.sequence = self.sequence.saturating_add(1);
            }
        }
        match kind {
            "response.created" | "response.in_progress" | "response.queued" => {
                missing.response_output = head
                    .response
                    .and_then(|response| serde_json::from_str::<ResponseHead<'_>>(response.get()).ok())
                    .is_some_and(|response| response.output.is_none());
                return missing;
            }
            "response.output_item.added" => {
                let index = number(head.output_index).unwrap_or(self.opened);
                let id = item_id(head.item).map(Cow::into_owned);
                self.opened = index.saturating_add(1);
                if self.items.len() == MAX_ITEMS {
                    self.items.pop_front();
                }
                self.items.push_back(Item { index, id, parts: 0 });
            }
            _ => {}
        }
        if matches!(kind, "response.output_text.delta" | "response.output_text.done") && head.logprobs.is_none() {
            missing.fields.push(("logprobs", Value::Array(Vec::new())));
        }
        // Events about the response as a whole carry no item.
        if !is_about_an_item(kind) {
            return missing;
        }
        // An event about an item not opened (or forgotten) is taken to be
        // about the last one opened, as one without an id is.
        let named = text(head.item_id).or_else(|| item_id(head.item));
        let at = named
            .and_then(|named| self.items.iter().rposition(|item| item.id.as_deref() == Some(named.as_ref())))
            .or(self.items.len().checked_sub(1));
        let Some(item) = at.and_then(|at| self.items.get_mut(at)) else { return missing };
        if head.output_index.is_none() {
            missing.fields.push(("output_index", Value::from(item.index)));
        }
        if !kind.starts_with("response.output_item.")
            && head.item_id.is_none()
            && let Some(id) = &item.id
        {
            missing.fields.push(("item_id", Value::from(id.as_str())));
        }
        if is_about_a_part(kind) {
            let part = if kind == "response.content_part.added" {
                let part = number(head.content_index).unwrap_or(item.parts);
                item.parts = part.saturating_add(1);
                part
            } else {
                item.parts.saturating_sub(1)
            };
            if head.content_index.is_none() {
                missing.fields.push(("content_index", Value::from(part)));
            }
        }
        missing
    }
}

/// The longest opening event (`response.created`, `response.in_progress`,
/// `response.queued`) written anew with its `output` list; a longer one
/// goes on without it.
const MAX_OPENING: usize = 64 << 10;

/// The fields of an event that filling it reads, as the backend wrote them.
/// The rest is skipped as it is read, never built: an event may be
/// megabytes, and a backend is not trusted with this process's memory.
#[derive(Deserialize)]
struct Head<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<&'a RawValue>,
    #[serde(borrow, default)]
    sequence_number: Option<&'a RawValue>,
    #[serde(borrow, default)]
    output_index: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content_index: Option<&'a RawValue>,
    #[serde(borrow, default)]
    item_id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    logprobs: Option<&'a RawValue>,
    #[serde(borrow, default)]
    item: Option<&'a RawValue>,
    #[serde(borrow, default)]
    response: Option<&'a RawValue>,
}

/// Of an item or a response, the field read.
#[derive(Deserialize)]
struct ItemHead<'a> {
    #[serde(borrow, default)]
    id: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct ResponseHead<'a> {
    #[serde(borrow, default)]
    output: Option<&'a RawValue>,
}

/// A field's whole number, where it is one.
fn number(raw: Option<&RawValue>) -> Option<u64> {
    serde_json::from_str(raw?.get()).ok()
}

/// A field's string, where it is one of at most [`MAX_ID_BYTES`] (an
/// event's type or an item's id; a longer one is not kept or compared).
fn text(raw: Option<&RawValue>) -> Option<Cow<'_, str>> {
    let raw = raw?.get();
    if raw.len() > MAX_ID_BYTES + 2 || !raw.starts_with('"') {
        return None;
    }
    serde_json::from_str(raw).ok()
}

/// The id of an event's `item`, where it is an object with one.
fn item_id(item: Option<&RawValue>) -> Option<Cow<'_, str>> {
    let item = item?.get();
    item.starts_with('{')
        .then(|| serde_json::from_str::<ItemHead<'_>>(item).ok())
        .flatten()
        .and_then(|item| text(item.id))
}

/// The fields an event lacks, in the order they are written.
#[derive(Default)]
struct Missing {
    fields: Vec<(&'static str, Value)>,
    /// An opening response without its `output` list.
    response_output: bool,
}

/// Where the JSON of an event's `data:` line starts and ends.
fn data_line(event: &[u8]) -> Option<(usize, usize)> {
    let mut at = 0;
    for line in event.split_inclusive(|b| *b == b'\n') {
        if let Some(rest) = line.strip_prefix(b"data:") {
            let start = at + 5 + usize::from(rest.first() == Some(&b' '));
            let trimmed = line.iter().rev().take_while(|b| matches!(b, b'\n' | b'\r')).count();
            return Some((start, at + line.len() - trimmed));
        }
        at += line.len();
    }
    None
}

/// Events about one output item: its opening and closing, its content
/// parts, text, refusal, reasoning, and tool calls' arguments.
fn is_about_an_item(kind: &str) -> bool {
    kind.starts_with("response.output_item.")
        || is_about_a_part(kind)
        || kind.starts_with("response.function_call_arguments.")
        || kind.starts_with("response.custom_tool_call_input.")
        || kind.starts_with("response.reasoning_summary")
}

/// Events about a content part of the item.
fn is_about_a_part(kind: &str) -> bool {
    kind.starts_with("response.content_part.")
        || kind.starts_with("response.output_text.")
        || kind.starts_with("response.refusal.")
        || kind.starts_with("response.reasoning_text.")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(name: &str, data: &str) -> String {
        format!("event: {name}\ndata: {data}\n\n")
    }

    fn data_of(out: &[u8]) -> Vec<Value> {
        String::from_utf8_lossy(out)
            .lines()
            .filter_map(|line| line.strip_prefix("data: "))
            .map(|data| serde_json::from_str(data).unwrap())
            .collect()
    }

    /// A llama-server (b11434) Responses stream, as it sends it.
    fn llama_server_stream() -> String {
        let item = r#""item_id":"msg_1""#;
        [
            event("response.created", r#"{"type":"response.created","response":{"id":"resp_1","object":"response","status":"in_progress"}}"#),
            event("response.in_progress", r#"{"type":"response.in_progress","response":{"id":"resp_1","object":"response","status":"in_progress"}}"#),
            event("response.output_item.added", r#"{"type":"response.output_item.added","item":{"content":[],"id":"msg_1","role":"assistant","status":"in_progress","type":"message"}}"#),
            event("response.content_part.added", &format!(r#"{{"type":"response.content_part.added",{item},"part":{{"type":"output_text","text":""}}}}"#)),
            event("response.output_text.delta", &format!(r#"{{"type":"response.output_text.delta",{item},"delta":"Hi"}}"#)),
            event("response.output_text.delta", &format!(r#"{{"type":"response.output_text.delta",{item},"delta":" there"}}"#)),
            event("response.output_text.done", &format!(r#"{{"type":"response.output_text.done",{item},"text":"Hi there"}}"#)),
            event("response.content_part.done", &format!(r#"{{"type":"response.content_part.done",{item},"part":{{"type":"output_text","text":"Hi there"}}}}"#)),
            event("response.output_item.added", r#"{"type":"response.output_item.added","item":{"type":"function_call","id":"fc_2","call_id":"call_2","name":"f","arguments":""}}"#),
            event("response.function_call_arguments.delta", r#"{"type":"response.function_call_arguments.delta","delta":"{}"}"#),
            event("response.output_item.done", r#"{"type":"response.output_item.done","item":{"type":"function_call","id":"fc_2"}}"#),
            event("response.completed", r#"{"type":"response.completed","response":{"id":"resp_1","status":"completed","output":[]}}"#),
        ]
        .concat()
    }

    #[test]
    fn every_event_is_numbered_and_says_which_item_and_part_it_is_about() {
        let mut fields = EventFields::default();
        let out = fields.push(llama_server_stream().as_bytes()).unwrap();
        let events = data_of(&out);
        let numbers: Vec<u64> = events.iter().map(|e| e["sequence_number"].as_u64().unwrap()).collect();
        assert_eq!(numbers, (0..12).collect::<Vec<u64>>());
        assert_eq!(events[0]["response"]["output"], Value::Array(Vec::new()));
        assert_eq!(events[1]["response"]["output"], Value::Array(Vec::new()));
        fn about(e: &Value) -> (Option<u64>, Option<u64>, Option<&str>) {
            (e["output_index"].as_u64(), e["content_index"].as_u64(), e["item_id"].as_str())
        }
        assert_eq!(about(&events[2]), (Some(0), None, None));
        for text_event in &events[3..8] {
            assert_eq!(about(text_event), (Some(0), Some(0), Some("msg_1")), "{text_event}");
        }
        assert_eq!(events[4]["logprobs"], Value::Array(Vec::new()));
        assert_eq!(about(&events[8]), (Some(1), None, None));
        assert_eq!(about(&events[9]), (Some(1), None, Some("fc_2")));
        assert_eq!(about(&events[10]), (Some(1), None, None));
        assert_eq!(about(&events[11]), (None, None, None));
        // Everything else is as the server wrote it.
        assert_eq!(events[5]["delta"], " there");
        assert!(String::from_utf8_lossy(&out).starts_with("event: response.created\ndata: {"));
    }

    #[test]
    fn a_message_closed_after_the_call_opened_after_it_keeps_its_own_index() {
        // llama-server b11434 opens a function call while the message
        // before it is open, and closes the message after the call's
        // arguments.
        let (msg, call) = (r#""item_id":"msg_1""#, r#""item_id":"fc_2""#);
        let stream = [
            event(
                "response.output_item.added",
                r#"{"type":"response.output_item.added","item":{"id":"msg_1","type":"message"}}"#,
            ),
            event("response.content_part.added", &format!(r#"{{"type":"response.content_part.added",{msg}}}"#)),
            event(
                "response.output_text.delta",
                &format!(r#"{{"type":"response.output_text.delta",{msg},"delta":"a"}}"#),
            ),
            event(
                "response.output_item.added",
                r#"{"type":"response.output_item.added","item":{"id":"fc_2","type":"function_call"}}"#,
            ),
            event(
                "response.function_call_arguments.delta",
                &format!(r#"{{"type":"response.function_call_arguments.delta",{call},"delta":"{{}}"}}"#),
            ),
            event("response.output_text.done", &format!(r#"{{"type":"response.output_text.done",{msg},"text":"a"}}"#)),
            event("response.content_part.done", &format!(r#"{{"type":"response.content_part.done",{msg}}}"#)),
            event(
                "response.output_item.done",
                r#"{"type":"response.output_item.done","item":{"id":"msg_1","type":"message"}}"#,
            ),
            event(
                "response.output_item.done",
                r#"{"type":"response.output_item.done","item":{"id":"fc_2","type":"function_call"}}"#,
            ),
        ]
        .concat();
        let events = data_of(&EventFields::default().push(stream.as_bytes()).unwrap());
        let about: Vec<_> = events.iter().map(|e| (e["output_index"].as_u64(), e["content_index"].as_u64())).collect();
        let (message, part, call) = ((Some(0), None), (Some(0), Some(0)), (Some(1), None));
        assert_eq!(about, [message, part, part, call, call, part, part, message, call]);
    }

    #[test]
    fn past_the_items_remembered_the_oldest_are_forgotten_and_long_ids_never_kept() {
        let mut stream = String::new();
        for i in 0..70 {
            let added = format!(r#"{{"type":"response.output_item.added","item":{{"id":"i{i}"}}}}"#);
            stream += &event("response.output_item.added", &added);
        }
        let long = "x".repeat(MAX_ID_BYTES + 1);
        stream += &event(
            "response.output_item.added",
            &format!(r#"{{"type":"response.output_item.added","item":{{"id":"{long}"}}}}"#),
        );
        for named in ["i69", "i0", long.as_str()] {
            let done = format!(r#"{{"type":"response.function_call_arguments.delta","item_id":"{named}"}}"#);
            stream += &event("response.function_call_arguments.delta", &done);
        }
        let mut fields = EventFields::default();
        let events = data_of(&fields.push(stream.as_bytes()).unwrap());
        let indexes: Vec<_> = events[71..].iter().map(|e| e["output_index"].as_u64()).collect();
        // i69 is remembered; i0 was forgotten and the long id never kept:
        // both are taken to be about the last item opened.
        assert_eq!(indexes, [Some(69), Some(70), Some(70)]);
        assert_eq!(fields.items.len(), MAX_ITEMS);
        assert!(fields.items.iter().all(|item| item.id.as_ref().is_none_or(|id| id.len() <= MAX_ID_BYTES)));
    }

    #[test]
    fn what_filling_does_not_read_is_passed_over_not_built() {
        // An item of a million numbers, nested deeper than a whole parse
        // goes (serde_json stops at 128 levels), is skipped as it is read:
        // the event is still numbered and placed.
        let numbers = vec!["0"; 1 << 20].join(",");
        let (deep, up) = ("[".repeat(200), "]".repeat(200));
        let added = format!(
            r#"{{"type":"response.output_item.added","item":{{"id":"m","content":[{numbers}],"deep":{deep}{up}}}}}"#
        );
        let mut fields = EventFields::default();
        let out = fields.push(event("response.output_item.added", &added).as_bytes()).unwrap();
        let filled = "event: response.output_item.added\ndata: {\"sequence_number\":0,\"output_index\":0,\"type\"";
        assert!(String::from_utf8_lossy(&out).starts_with(filled));
        // Data that is not an object goes as it is, and a long opening
        // response goes without its `output` list, its bytes as they came.
        let array = event("response.created", r#"["response.created"]"#);
        assert_eq!(EventFields::default().push(array.as_bytes()).unwrap(), array.as_bytes());
        let long = "x".repeat(MAX_OPENING);
        let opening = format!(r#"{{"type":"response.created","response":{{"id":"{long}"}}}}"#);
        let out = EventFields::default().push(event("response.created", &opening).as_bytes()).unwrap();
        assert_eq!(data_of(&out)[0]["response"].get("output"), None);
        assert!(String::from_utf8_lossy(&out).ends_with(&format!("{}\n\n", &opening[1..])));
    }

    #[test]
    fn frames_that_split_events_anywhere_give_the_same_events() {
        let stream = llama_server_stream();
        let whole = EventFields::default().push(stream.as_bytes()).unwrap();
        for size in [1, 7, 64] {
            let mut fields = EventFields::default();
            let mut out = Vec::new();
            for chunk in stream.as_bytes().chunks(size) {
                if let Some(bytes) = fields.push(chunk) {
                    out.extend_from_slice(&bytes);
                }
            }
            assert!(fields.take_rest().is_none());
            assert_eq!(out, whole, "frames of {size} bytes");
        }
    }

    #[test]
    fn fields_a_server_sends_are_kept_and_counted_on_from() {
        let stream = [
            event("response.created", r#"{"type":"response.created","sequence_number":5,"response":{"output":[1]}}"#),
            event(
                "response.output_item.added",
                r#"{"type":"response.output_item.added","output_index":3,"item":{"id":"m"}}"#,
            ),
            event(
                "response.content_part.added",
                r#"{"type":"response.content_part.added","content_index":2,"item_id":"other"}"#,
            ),
            event("response.output_text.delta", r#"{"type":"response.output_text.delta","delta":"x"}"#),
        ]
        .concat();
        let events = data_of(&EventFields::default().push(stream.as_bytes()).unwrap());
        let numbers: Vec<u64> = events.iter().map(|e| e["sequence_number"].as_u64().unwrap()).collect();
        assert_eq!(numbers, [5, 6, 7, 8]);
        assert_eq!(events[0]["response"]["output"], serde_json::json!([1]));
        assert_eq!((events[1]["output_index"].as_u64(), events[2]["item_id"].as_str()), (Some(3), Some("other")));
        assert_eq!((events[3]["output_index"].as_u64(), events[3]["content_index"].as_u64()), (Some(3), Some(2)));
        assert_eq!(events[3]["item_id"], "m");
    }

    #[test]
    fn the_server_s_bytes_go_on_as_they_came_behind_what_is_added() {
        let server = r#""type":"response.output_text.delta","item_id":"m","delta":"1.50e2 \u00e9"}"#;
        let out = EventFields::default().push(event("response.output_text.delta", &format!("{{{server}")).as_bytes());
        let expected =
            format!("event: response.output_text.delta\ndata: {{\"sequence_number\":0,\"logprobs\":[],{server}\n\n");
        assert_eq!(String::from_utf8_lossy(&out.unwrap()), expected);
        // Nothing missing, nothing changed.
        let whole = event(
            "response.output_text.delta",
            r#"{"sequence_number":0,"type":"response.output_text.delta","logprobs":[]}"#,
        );
        assert_eq!(EventFields::default().push(whole.as_bytes()).unwrap(), whole.as_bytes());
        let empty = event("x", "{}");
        assert_eq!(
            EventFields::default().push(empty.as_bytes()).unwrap(),
            event("x", r#"{"sequence_number":0}"#).as_bytes()
        );
    }

    #[test]
    fn the_last_events_are_filled_however_long_the_answer() {
        let text = "word ".repeat(40_000);
        let stream = [
            event(
                "response.output_item.added",
                r#"{"type":"response.output_item.added","item":{"id":"msg_1","type":"message"}}"#,
            ),
            event("response.content_part.added", r#"{"type":"response.content_part.added","item_id":"msg_1"}"#),
            event(
                "response.output_text.done",
                &format!(r#"{{"type":"response.output_text.done","item_id":"msg_1","text":"{text}"}}"#),
            ),
        ]
        .concat();
        let mut fields = EventFields::default();
        let mut out = Vec::new();
        for chunk in stream.as_bytes().chunks(16 * 1024) {
            if let Some(bytes) = fields.push(chunk) {
                out.extend_from_slice(&bytes);
            }
        }
        let events = data_of(&out);
        assert_eq!(events.len(), 3);
        assert_eq!((events[2]["output_index"].as_u64(), events[2]["content_index"].as_u64()), (Some(0), Some(0)));
        assert_eq!(events[2]["sequence_number"], 2);
        assert_eq!(events[2]["text"].as_str().map(str::len), Some(text.len()));
    }

    #[test]
    fn comments_errors_and_what_is_not_json_go_on_as_they_are() {
        let stream = ": waiting for a free slot (1s)\n\nevent: error\ndata: not json\n\ndata: [DONE]\n\n";
        let out = EventFields::default().push(stream.as_bytes()).unwrap();
        assert_eq!(out, stream.as_bytes());
        let mut fields = EventFields::default();
        assert!(fields.push(b"event: response.created\ndata: {\"ty").is_none());
        assert_eq!(fields.take_rest().unwrap(), &b"event: response.created\ndata: {\"ty"[..]);
    }
}
