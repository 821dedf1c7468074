//! The fields of the Responses API's stream events that llama-server leaves
//! out and OpenAI's clients build the answer with: each event's
//! `sequence_number`; the `output_index` of the output item an event is
//! about, the `content_index` of its content part and the item's
//! `item_id`; the `logprobs` of a text event; the response's `output` list
//! as it opens. Without them the OpenAI SDK's `responses.stream()` fails
//! with a `TypeError` on the first content event.
//!
//! A field the server sent is kept, and counting goes on from it: a server
//! that sends them all passes through unchanged. Events are read whole,
//! one at a time, and go on as soon as they are whole.

use bytes::Bytes;
use serde_json::{Map, Value};

/// Counts a Responses stream's events and output, and fills in what its
/// events leave out.
#[derive(Default)]
pub(crate) struct EventFields {
    events: super::sse::Events,
    /// The next event's sequence number.
    sequence: u64,
    /// The output item open now: its index and id.
    item: Option<(u64, Option<String>)>,
    /// Output items opened so far.
    items: u64,
    /// The open item's content parts opened so far.
    parts: u64,
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

    /// Writes `event` to `out`, its JSON data filled in; an event without
    /// one (a comment) or whose data is not a JSON object goes as it is.
    fn fill(&mut self, event: &[u8], out: &mut Vec<u8>) {
        let Some((start, end)) = data_line(event) else {
            out.extend_from_slice(event);
            return;
        };
        let Ok(Value::Object(mut fields)) = serde_json::from_slice::<Value>(&event[start..end]) else {
            out.extend_from_slice(event);
            return;
        };
        self.fill_fields(&mut fields);
        out.extend_from_slice(&event[..start]);
        // A map of values serializes infallibly.
        let _ = serde_json::to_writer(&mut *out, &fields);
        out.extend_from_slice(&event[end..]);
    }

    fn fill_fields(&mut self, fields: &mut Map<String, Value>) {
        let kind = fields.get("type").and_then(Value::as_str).unwrap_or_default().to_string();
        let sequence = fields.entry("sequence_number").or_insert(Value::from(self.sequence));
        self.sequence = sequence.as_u64().unwrap_or(self.sequence).saturating_add(1);

        match kind.as_str() {
            "response.created" | "response.in_progress" | "response.queued" => {
                if let Some(Value::Object(response)) = fields.get_mut("response") {
                    response.entry("output").or_insert_with(|| Value::Array(Vec::new()));
                }
                return;
            }
            "response.output_item.added" => {
                let index = fields.get("output_index").and_then(Value::as_u64).unwrap_or(self.items);
                let id = fields.get("item").and_then(|item| item.get("id")?.as_str()).map(str::to_string);
                self.items = index.saturating_add(1);
                self.item = Some((index, id));
                self.parts = 0;
            }
            _ => {}
        }
        // Events about the response as a whole carry no item.
        if !is_about_an_item(&kind) {
            return;
        }
        let Some((index, id)) = &self.item else { return };
        fields.entry("output_index").or_insert(Value::from(*index));
        if kind != "response.output_item.added"
            && kind != "response.output_item.done"
            && let Some(id) = id
        {
            fields.entry("item_id").or_insert_with(|| Value::from(id.as_str()));
        }
        if is_about_a_part(&kind) {
            let part = if kind == "response.content_part.added" {
                let part = fields.get("content_index").and_then(Value::as_u64).unwrap_or(self.parts);
                self.parts = part.saturating_add(1);
                part
            } else {
                self.parts.saturating_sub(1)
            };
            fields.entry("content_index").or_insert(Value::from(part));
        }
        if kind.starts_with("response.output_text.") {
            fields.entry("logprobs").or_insert_with(|| Value::Array(Vec::new()));
        }
    }
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
    fn comments_errors_and_what_is_not_json_go_on_as_they_are() {
        let stream = ": waiting for a free slot (1s)\n\nevent: error\ndata: not json\n\ndata: [DONE]\n\n";
        let out = EventFields::default().push(stream.as_bytes()).unwrap();
        assert_eq!(out, stream.as_bytes());
        let mut fields = EventFields::default();
        assert!(fields.push(b"event: response.created\ndata: {\"ty").is_none());
        assert_eq!(fields.take_rest().unwrap(), &b"event: response.created\ndata: {\"ty"[..]);
    }
}
