//! The event a stream of its kind opens with, put ahead of a stream whose
//! server left it out ([`StreamStart`]). Anthropic's and OpenAI's clients
//! build the answer from that event: without it the Anthropic SDK drops
//! every later event and the OpenAI SDK's Responses stream fails.

use bytes::Bytes;
use inferyes_proto::kinds::StreamStart;
use serde_json::json;

/// Held at most while the first event is awaited; a stream whose first
/// event is longer goes on as it is.
const MAX_HELD: usize = 16 * 1024;

/// A stream's first bytes, held until its first event is whole.
pub(crate) struct Opening {
    start: StreamStart,
    name: &'static str,
    /// The model the node was asked for, as its own opening would say it.
    model: String,
    request_id: String,
    /// What the ledger counts for the prompt when the node says nothing of
    /// it, and so what the client is told.
    input_tokens: u64,
    held: Vec<u8>,
    /// How much of `held` is whole events of comments only, passed over.
    skipped: usize,
}

impl Opening {
    /// For a stream of `start`'s kind; `None` for a kind that opens with
    /// any event.
    pub(crate) fn new(start: StreamStart, model: &str, request_id: &str, input_tokens: u64) -> Option<Opening> {
        let name = start.event()?;
        Some(Opening {
            start,
            name,
            model: model.to_string(),
            request_id: request_id.to_string(),
            input_tokens,
            held: Vec::new(),
            skipped: 0,
        })
    }

    /// What goes on of the stream's first bytes, `data` the latest: `None`
    /// while its first event is not whole; then all of them, behind the
    /// opening event where they do not start with it.
    pub(crate) fn push(&mut self, data: &Bytes) -> Option<Bytes> {
        // Most streams' first frame is their opening event, whole: passed
        // on uncopied.
        if self.held.is_empty() && super::sse::opens_with(data, self.name) == Some(true) {
            return Some(data.clone());
        }
        // Searched from where the last frame's search stopped, so a server
        // sending a byte a frame is not searched again from the start.
        let from = super::sse::resume_at(self.held.len(), self.skipped);
        self.held.extend_from_slice(data);
        let mut first = None;
        for end in super::sse::event_ends(&self.held, from) {
            first = super::sse::event_opens_with(&self.held[self.skipped..end], self.name);
            if first.is_some() {
                break;
            }
            self.skipped = end;
        }
        let opens = match first {
            Some(opens) => opens,
            None if self.held.len() > MAX_HELD => true,
            None => return None,
        };
        self.skipped = 0;
        let held = std::mem::take(&mut self.held);
        if opens {
            return Some(Bytes::from(held));
        }
        let mut out = self.event();
        out.extend_from_slice(&held);
        Some(Bytes::from(out))
    }

    /// The bytes held when the stream ends before its first event is whole.
    pub(crate) fn take_rest(&mut self) -> Option<Bytes> {
        (!self.held.is_empty()).then(|| Bytes::from(std::mem::take(&mut self.held)))
    }

    /// The opening event, as llama-server writes it.
    fn event(&self) -> Vec<u8> {
        let id = self.request_id.strip_prefix("req_").unwrap_or(&self.request_id);
        let events = match self.start {
            StreamStart::Any => Vec::new(),
            StreamStart::MessageStart => vec![(
                "message_start",
                json!({
                    "type": "message_start",
                    "message": {
                        "id": format!("msg_{id}"),
                        "type": "message",
                        "role": "assistant",
                        "content": [],
                        "model": self.model,
                        "stop_reason": null,
                        "stop_sequence": null,
                        "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
                    },
                }),
            )],
            StreamStart::ResponseCreated => {
                // What the SDKs build the response from: its output list
                // grows with the `output_item.added` events that follow.
                let created_at = inferyes_proto::unix_ms() / 1000;
                let response = json!({
                    "id": format!("resp_{id}"),
                    "object": "response",
                    "created_at": created_at,
                    "model": self.model,
                    "status": "in_progress",
                    "output": [],
                });
                ["response.created", "response.in_progress"]
                    .into_iter()
                    .map(|name| (name, json!({"type": name, "response": response})))
                    .collect()
            }
        };
        let mut out = Vec::new();
        for (name, data) in events {
            out.extend_from_slice(format!("event: {name}\ndata: {data}\n\n").as_bytes());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const START: &str = "event: message_start\ndata: {\"type\":\"message_start\"}\n\n";
    const BLOCK: &str = "event: content_block_start\ndata: {\"type\":\"content_block_start\"}\n\n";

    fn for_kind(start: StreamStart) -> Opening {
        Opening::new(start, "m\"x", "req_abc", 12).unwrap()
    }

    fn events(bytes: &[u8]) -> Vec<(String, serde_json::Value)> {
        std::str::from_utf8(bytes)
            .unwrap()
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let (name, data) = e.split_once('\n').unwrap();
                let data = data.strip_prefix("data: ").unwrap_or("null");
                (name.trim_start_matches("event: ").to_string(), serde_json::from_str(data).unwrap())
            })
            .collect()
    }

    #[test]
    fn a_stream_that_opens_with_its_event_goes_on_as_it_is() {
        let mut opening = for_kind(StreamStart::MessageStart);
        let first = Bytes::from(format!("{START}{BLOCK}"));
        let passed = opening.push(&first).unwrap();
        assert_eq!(passed.as_ptr(), first.as_ptr(), "not copied");
        let mut split = for_kind(StreamStart::MessageStart);
        assert_eq!(split.push(&Bytes::from_static(&START.as_bytes()[..10])), None, "held");
        assert_eq!(&split.push(&Bytes::from_static(&START.as_bytes()[10..])).unwrap()[..], START.as_bytes());
        assert!(split.take_rest().is_none());
    }

    #[test]
    fn a_messages_stream_without_message_start_gets_one_ahead_of_its_first_event() {
        let mut opening = for_kind(StreamStart::MessageStart);
        assert_eq!(opening.push(&Bytes::from_static(&BLOCK.as_bytes()[..7])), None);
        let out = opening.push(&Bytes::from_static(&BLOCK.as_bytes()[7..])).unwrap();
        let events = events(&out);
        assert_eq!(events.len(), 2);
        let (name, data) = &events[0];
        assert_eq!(name, "message_start");
        assert_eq!(data["type"], "message_start");
        let message = &data["message"];
        assert_eq!((message["id"].as_str(), message["model"].as_str()), (Some("msg_abc"), Some("m\"x")));
        assert_eq!(
            (message["role"].as_str(), message["content"].as_array().map(Vec::len)),
            (Some("assistant"), Some(0))
        );
        assert_eq!(message["usage"], json!({"input_tokens": 12, "output_tokens": 0}));
        assert_eq!(events[1].0, "content_block_start", "then the stream as it came");
    }

    #[test]
    fn a_responses_stream_without_response_created_gets_it_and_in_progress() {
        let mut opening = for_kind(StreamStart::ResponseCreated);
        let delta = Bytes::from_static(b"event: response.output_text.delta\ndata: {\"delta\":\"x\"}\n\n");
        let events = events(&opening.push(&delta).unwrap());
        let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, ["response.created", "response.in_progress", "response.output_text.delta"]);
        assert_eq!(events[0].1["response"]["id"], "resp_abc");
        assert_eq!(events[0].1["response"]["output"], json!([]));
        assert_eq!(events[0].1["response"]["model"], "m\"x");
        assert_eq!(events[1].1["type"], "response.in_progress");
    }

    #[test]
    fn an_error_event_or_an_overlong_first_event_goes_on_as_it_is() {
        let mut opening = for_kind(StreamStart::MessageStart);
        let error = Bytes::from_static(b"event: error\ndata: {\"type\":\"error\"}\n\n");
        assert_eq!(opening.push(&error).unwrap(), error);
        let mut long = for_kind(StreamStart::MessageStart);
        let big = Bytes::from(vec![b'x'; MAX_HELD + 1]);
        assert_eq!(long.push(&big).unwrap(), big, "not held past the bound");
        let mut cut = for_kind(StreamStart::MessageStart);
        assert_eq!(cut.push(&Bytes::from_static(b"event: content")), None);
        assert_eq!(cut.take_rest().as_deref(), Some(&b"event: content"[..]));
    }

    /// What `opening` passes on of `stream` cut into frames of `size`
    /// bytes, and the rest it holds at the end.
    fn in_frames(mut opening: Opening, stream: &[u8], size: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut frames = stream.chunks(size);
        for frame in frames.by_ref() {
            if let Some(passed) = opening.push(&Bytes::copy_from_slice(frame)) {
                out.extend_from_slice(&passed);
                break;
            }
        }
        // Once its first event is through, a stream goes on as it comes.
        frames.for_each(|frame| out.extend_from_slice(frame));
        out.extend_from_slice(&opening.take_rest().unwrap_or_default());
        out
    }

    #[test]
    fn a_first_event_cut_into_any_frames_is_read_as_if_whole() {
        for line_end in ["\n", "\r\n"] {
            let start = START.replace('\n', line_end);
            let block = BLOCK.replace('\n', line_end);
            let comments = format!(": ping{line_end}{line_end}:{line_end}{line_end}");
            for size in [1, 2, 3, 5, 7, 100] {
                // Opening with its event, comments first: passed on as it is.
                let whole = format!("{comments}{start}{block}");
                let passed = in_frames(for_kind(StreamStart::MessageStart), whole.as_bytes(), size);
                assert_eq!(String::from_utf8(passed).unwrap(), whole, "{line_end:?} in frames of {size}");
                // Without it: the opening goes ahead of everything.
                let missing = format!("{comments}{block}{block}");
                let passed = in_frames(for_kind(StreamStart::MessageStart), missing.as_bytes(), size);
                let opening = for_kind(StreamStart::MessageStart).event();
                assert_eq!(passed, [&opening[..], missing.as_bytes()].concat(), "{line_end:?} in frames of {size}");
            }
        }
    }

    #[test]
    fn comments_and_no_event_are_held_only_to_the_bound() {
        let mut opening = for_kind(StreamStart::MessageStart);
        let ping = Bytes::from_static(b": ping\n\n");
        let mut sent = 0;
        let passed = loop {
            sent += ping.len();
            if let Some(passed) = opening.push(&ping) {
                break passed;
            }
        };
        assert!(sent > MAX_HELD && sent <= MAX_HELD + ping.len(), "held {sent} bytes");
        assert_eq!(passed.len(), sent, "passed on as it came");
    }

    #[test]
    fn only_kinds_with_an_opening_event_get_one() {
        assert!(Opening::new(StreamStart::Any, "m", "r", 0).is_none());
    }
}
