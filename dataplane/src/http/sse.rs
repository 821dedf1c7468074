//! Server-sent events as they pass through: whole events out of frames
//! that may split them, and the few facts the data plane reads from them.

use std::sync::LazyLock;

use bytes::Bytes;
use memchr::memmem::Finder;

/// The fixed strings looked for in every frame of a stream; searchers built
/// once.
static NO_CHOICES: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"choices\":[]"));
static USAGE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"usage\":"));
/// Fields that carry generated output, as string values: chat (`content`,
/// `reasoning_content`, a tool call's `name` and `arguments`), completions
/// and Anthropic's text deltas (`text`), Anthropic's `thinking` and tool
/// input (`partial_json`), the Responses API's deltas (`delta`).
static OUTPUT: LazyLock<[Finder<'static>; 8]> = LazyLock::new(|| {
    [
        Finder::new(b"\"content\":"),
        Finder::new(b"\"text\":"),
        Finder::new(b"\"reasoning_content\":"),
        Finder::new(b"\"arguments\":"),
        Finder::new(b"\"name\":"),
        Finder::new(b"\"delta\":"),
        Finder::new(b"\"thinking\":"),
        Finder::new(b"\"partial_json\":"),
    ]
});

/// Held at most while an event is incomplete: a server that never ends one
/// is passed on as it is, not held (and searched again) without end. No
/// llama-server event comes near it; a usage-only chunk longer than this
/// would reach a client that did not ask for it, in pieces.
const MAX_PENDING: usize = 64 * 1024;

/// Frames in, whole events (each ending in its blank line) out; a partial
/// event waits for the rest.
pub struct Events {
    /// A partial event: searched already, with no end in it.
    pending: Vec<u8>,
    /// The most of one event held: past it, it goes on as it is.
    limit: usize,
}

impl Default for Events {
    fn default() -> Events {
        Events::with_limit(MAX_PENDING)
    }
}

impl Events {
    /// Events held whole up to `limit` bytes each.
    pub fn with_limit(limit: usize) -> Events {
        Events { pending: Vec::new(), limit }
    }

    pub fn push(&mut self, data: &[u8]) -> Vec<Bytes> {
        let whole = self.fill(data);
        let mut events = Vec::new();
        let mut rest = &self.pending[..whole];
        while !rest.is_empty() {
            let end = event_end(rest).unwrap_or(rest.len());
            events.push(Bytes::copy_from_slice(&rest[..end]));
            rest = &rest[end..];
        }
        self.pending.drain(..whole);
        events
    }

    /// What of `data` goes on to a client that did not ask for usage: the
    /// whole events in it (a partial one waits for the rest), without the
    /// usage-only chunk. `None`: nothing to pass on yet.
    pub fn without_usage(&mut self, data: Bytes) -> Option<Bytes> {
        // Most frames are whole events, none of them the usage chunk: they
        // go on as they are, not copied.
        if self.pending.is_empty() && whole_events(&data) && NO_CHOICES.find(&data).is_none() {
            return Some(data);
        }
        let whole = self.fill(&data);
        let mut kept = Vec::with_capacity(whole);
        let mut rest = &self.pending[..whole];
        while !rest.is_empty() {
            let end = event_end(rest).unwrap_or(rest.len());
            if !is_usage_only_event(&rest[..end]) {
                kept.extend_from_slice(&rest[..end]);
            }
            rest = &rest[end..];
        }
        self.pending.drain(..whole);
        (!kept.is_empty()).then(|| Bytes::from(kept))
    }

    /// Adds `data` to what waits and says how many of the bytes waiting now
    /// make whole events, which the caller takes out; the rest waits. Past
    /// [`MAX_PENDING`] of one incomplete event, all of it goes.
    fn fill(&mut self, data: &[u8]) -> usize {
        let from = resume_at(self.pending.len(), 0);
        self.pending.extend_from_slice(data);
        let mut whole = event_ends(&self.pending, from).last().unwrap_or(0);
        if self.pending.len() - whole > self.limit {
            whole = self.pending.len();
        }
        whole
    }

    /// Whether a partial event is waiting.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// The partial event left when the stream ends, as it is.
    pub fn take_rest(&mut self) -> Bytes {
        Bytes::from(std::mem::take(&mut self.pending))
    }
}

/// Where the first whole event in `bytes` ends, its blank line included.
/// Events end with `\n\n`, or `\r\n\r\n` from a server that ends its
/// lines so (the two are not mixed within a stream).
pub(crate) fn event_end(bytes: &[u8]) -> Option<usize> {
    // From one line end to the next: an event's lines are short, and a
    // two-byte needle's search costs more to set up than it finds.
    memchr::memchr_iter(b'\n', bytes).find_map(|at| {
        if at >= 3 && &bytes[at - 3..at] == b"\r\n\r" {
            Some(at + 1)
        } else if bytes.get(at + 1) == Some(&b'\n') {
            Some(at + 2)
        } else {
            None
        }
    })
}

/// Where a search for an event's end resumes once frames are added to
/// `held` bytes that were searched already, the event in progress starting
/// at `start`: three bytes back, for an end (at most four bytes) that the
/// new bytes complete.
pub(crate) fn resume_at(held: usize, start: usize) -> usize {
    held.saturating_sub(3).max(start)
}

/// The ends of the whole events in `bytes`, as offsets into it, searched
/// from `from`: an event's start, or where [`resume_at`] resumes.
pub(crate) fn event_ends(bytes: &[u8], from: usize) -> impl Iterator<Item = usize> + '_ {
    let mut at = from;
    std::iter::from_fn(move || {
        let end = at + event_end(&bytes[at..])?;
        at = end;
        Some(end)
    })
}

/// Whether an answer with these headers is an event stream.
pub fn is_event_stream(headers: &http::HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// Whether `bytes` are whole events, the last ending where they do. Not
/// merely ending in a blank line: in `data: x\n\n\n` the first event ends
/// before the last `\n`, which begins the next.
fn whole_events(bytes: &[u8]) -> bool {
    event_ends(bytes, 0).last() == Some(bytes.len())
}

/// Whether `bytes` end where an event does.
pub(crate) fn ends_an_event(bytes: &[u8]) -> bool {
    bytes.ends_with(b"\n\n") || bytes.ends_with(b"\r\n\r\n")
}

/// Whether an event is the usage-only chunk `include_usage` adds
/// (`"choices":[]` with `usage`), which a client that did not ask for it
/// must not see.
pub fn is_usage_only_event(event: &[u8]) -> bool {
    let event = event.trim_ascii_start();
    event.starts_with(b"data: {") && NO_CHOICES.find(event).is_some() && USAGE.find(event).is_some()
}

/// The data events (`data: ...` at a line start) that begin in `bytes`.
pub fn count_data_events(bytes: &[u8]) -> usize {
    let line_starts = std::iter::once(0).chain(memchr::memchr_iter(b'\n', bytes).map(|at| at + 1));
    line_starts.filter(|&start| bytes[start..].starts_with(b"data: ")).count()
}

/// Whether `bytes` carry generated output: a non-empty string in one of the
/// fields a token arrives in. A stream's first bytes are often not one:
/// llama-server sends the assistant's role before it reads the prompt, so
/// time to first token is time to the first chunk this says yes to.
pub fn carries_output(bytes: &[u8]) -> bool {
    OUTPUT.iter().any(|field| {
        field.find_iter(bytes).any(|at| {
            // The value, after the space some encoders put after a colon:
            // a string with at least one character.
            let value = bytes[at + field.needle().len()..].trim_ascii_start();
            value.len() > 1 && value[0] == b'"' && value[1] != b'"'
        })
    })
}

/// Whether an event stream ended the way a complete one does: its last
/// event `data: [DONE]`, or an error event the backend sent itself. `tail`
/// is the stream's last bytes; events end with a blank line, `\n\n` or
/// `\r\n\r\n`.
pub fn ended_well(tail: &[u8]) -> bool {
    let last = last_event(tail);
    last == b"data: [DONE]" || last.starts_with(b"data: {\"error\"")
}

/// Whether a stream whose last bytes are `tail` ended with an event of type
/// `name` (`event: name`), or with an error event, Anthropic's
/// (`event: error`) or the OpenAI-compatible kind.
pub fn ended_with_event(tail: &[u8], name: &str) -> bool {
    let last = last_event(tail);
    let typed = |line: &[u8]| {
        line.strip_prefix(b"event:").map(<[u8]>::trim_ascii).is_some_and(|t| t == name.as_bytes() || t == b"error")
    };
    last.split(|b| *b == b'\n').map(<[u8]>::trim_ascii).any(typed) || last.starts_with(b"data: {\"error\"")
}

/// Whether a stream whose first bytes are `head` opens with an event of
/// type `name` (`event: name`) or with an error event, either kind;
/// comments before it are passed over. `None` while its first event is
/// not whole.
pub fn opens_with(head: &[u8], name: &str) -> Option<bool> {
    let mut start = 0;
    event_ends(head, 0).find_map(|end| {
        let event = &head[start..end];
        start = end;
        event_opens_with(event, name)
    })
}

/// Whether a whole `event` is one of type `name` or an error event, as
/// [`opens_with`] reads a stream's first; `None` where it holds comment
/// lines or blank lines only, which are not an event.
pub(crate) fn event_opens_with(event: &[u8], name: &str) -> Option<bool> {
    let mut fields = event.split(|b| *b == b'\n').map(<[u8]>::trim_ascii).filter(|line| !line.is_empty());
    let field = fields.find(|line| !line.starts_with(b":"))?;
    let typed = |line: &[u8]| {
        line.strip_prefix(b"event:").map(<[u8]>::trim_ascii).is_some_and(|t| t == name.as_bytes() || t == b"error")
    };
    // A server that writes no `event:` lines says the type in the data
    // (`{"type":"message_start",...}`), as OpenAI's and Anthropic's
    // events all do.
    let data_typed = |data: &[u8], name: &str| {
        let Some(value) = data.strip_prefix(b"{\"type\":") else { return false };
        let value = value.trim_ascii_start();
        value.len() > name.len() + 1
            && value[0] == b'"'
            && &value[1..=name.len()] == name.as_bytes()
            && value[name.len() + 1] == b'"'
    };
    let error_data = |line: &[u8]| {
        line.strip_prefix(b"data:")
            .map(<[u8]>::trim_ascii)
            .is_some_and(|d| d.starts_with(b"{\"error\"") || data_typed(d, "error") || data_typed(d, name))
    };
    Some(std::iter::once(field).chain(fields).any(|line| typed(line) || error_data(line)))
}

/// A stream's last event, from its last bytes.
fn last_event(tail: &[u8]) -> &[u8] {
    let text = tail.trim_ascii_end();
    // The last event starts after the last blank line: found from the end,
    // so only that event is read, however long the tail.
    let start = memchr::memrchr_iter(b'\n', text)
        .find(|&at| text[..at].ends_with(b"\n") || text[..at].ends_with(b"\n\r"))
        .map_or(0, |at| at + 1);
    text[start..].trim_ascii_start()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_messages_stream_ended_well_with_message_stop_or_an_error_event() {
        let stop = b"event: message_delta\ndata: {}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        assert!(ended_with_event(stop, "message_stop"));
        assert!(ended_with_event(b"event: error\r\ndata: {\"type\":\"error\"}\r\n\r\n", "message_stop"));
        assert!(!ended_with_event(b"event: content_block_delta\ndata: {}\n\n", "message_stop"));
        assert!(
            !ended_with_event(b"event: message_stop\ndata: {}\n\nevent: ping\ndata: {}\n\n", "message_stop"),
            "then more"
        );
        assert!(!ended_with_event(b"data: {\"x\":\"event: message_stop\"}\n\n", "message_stop"), "inside data");
    }

    #[test]
    fn a_stream_opens_with_its_event_once_the_first_event_is_whole() {
        let start = b"event: message_start\ndata: {\"type\":\"message_start\"}\n\n";
        assert_eq!(opens_with(start, "message_start"), Some(true));
        assert_eq!(opens_with(&start[..start.len() - 1], "message_start"), None, "not whole yet");
        assert_eq!(opens_with(b"", "message_start"), None);
        let block = b"event: content_block_start\ndata: {\"type\":\"content_block_start\"}\n\nevent: message_start\n\n";
        assert_eq!(opens_with(block, "message_start"), Some(false), "the first event only");
        assert_eq!(
            opens_with(b": ping\n\n: more\r\n\r\nevent: message_start\r\ndata: {}\r\n\r\n", "message_start"),
            Some(true)
        );
        assert_eq!(opens_with(b": ping\n\n", "message_start"), None, "comments are not an event");
        assert_eq!(opens_with(b"event: error\ndata: {\"type\":\"error\"}\n\n", "message_start"), Some(true));
        assert_eq!(opens_with(b"data: {\"error\":{\"message\":\"x\"}}\n\n", "message_start"), Some(true));
        assert_eq!(opens_with(b"data: {\"x\":\"event: message_start\"}\n\n", "message_start"), Some(false));
        assert_eq!(opens_with(b"data: {\"type\":\"message_start\",\"message\":{}}\n\n", "message_start"), Some(true));
        assert_eq!(opens_with(b"data: {\"type\":\"message_started\"}\n\n", "message_start"), Some(false));
        assert_eq!(opens_with(b"data: {\"type\": \"message_start\"}\n\n", "message_start"), Some(true), "a space");
        assert_eq!(opens_with(b"data: {\"type\": \"error\"}\n\n", "message_start"), Some(true));
        assert_eq!(opens_with(b"event: message_started\n\n", "message_start"), Some(false));
    }

    #[test]
    fn a_stream_ended_well_with_done_or_its_own_error() {
        let done = b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n";
        assert!(ended_well(done));
        assert!(ended_well(b"data: {\"choices\":[]}\r\n\r\ndata: [DONE]\r\n\r\n"));
        assert!(ended_well(b"data: [DONE]"), "a tail that is the last event alone");
        assert!(ended_well(b"ices\":[]}\n\n\ndata: [DONE]\n\n"), "a tail that starts inside an event");
        assert!(ended_well(b"data: {\"choices\":[]}\n\ndata: {\"error\":{\"message\":\"x\"}}\n\n"));
        assert!(!ended_well(b"data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n"));
        assert!(!ended_well(b"data: [DONE]\n\ndata: {\"choices\":[]}\n\n"), "[DONE], then more");
        assert!(!ended_well(b"data: {\"choices\":[]}\ndata: [DONE]\n\n"), "[DONE] inside an event");
        assert!(!ended_well(b"data: [DONE"), "cut in the middle");
        assert!(!ended_well(b""));
        assert!(!ended_well(b"\xff\xfe\n\n"), "not UTF-8, and not an end");
    }

    #[test]
    fn events_come_out_whole() {
        let mut events = Events::default();
        assert!(events.push(b"data: {\"choices\":[{\"delta\":{\"con").is_empty());
        let whole = events.push(b"tent\":\"Hi\"}}]}\n\ndata: [DONE]\n\ndata: par");
        assert_eq!(whole.len(), 2);
        assert!(whole[0].ends_with(b"}]}\n\n") && &whole[1][..] == b"data: [DONE]\n\n");
        assert!(!events.is_empty());
        assert_eq!(&events.take_rest()[..], b"data: par");
        assert!(events.is_empty());
    }

    #[test]
    fn without_usage_passes_whole_events_on_and_takes_the_usage_chunk_out() {
        let mut events = Events::default();
        let plain = Bytes::from_static(b"data: {\"choices\":[{\"delta\":{}}]}\n\n");
        let passed = events.without_usage(plain.clone()).unwrap();
        assert_eq!(passed.as_ptr(), plain.as_ptr(), "a frame of whole events is not copied");
        assert_eq!(events.without_usage(Bytes::from_static(b"data: {\"cho")), None);
        let rest = b"ices\":[{}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\n\ndata: [DONE]\n\n";
        assert_eq!(
            &events.without_usage(Bytes::from_static(rest)).unwrap()[..],
            b"data: {\"choices\":[{}]}\n\ndata: [DONE]\n\n"
        );
        assert!(events.is_empty());
        let usage_only = Bytes::from_static(b"data: {\"choices\":[],\"usage\":{}}\n\n");
        assert_eq!(events.without_usage(usage_only), None);
    }

    #[test]
    fn events_ending_in_crlf_come_out_whole_and_lose_the_usage_chunk() {
        let mut events = Events::default();
        let whole = events.push(b"data: {\"choices\":[{}]}\r\n\r\ndata: [DONE]\r\n\r\ndata: par");
        assert_eq!(whole.len(), 2);
        assert_eq!(&whole[1][..], b"data: [DONE]\r\n\r\n");
        assert_eq!(&events.take_rest()[..], b"data: par");
        let plain = Bytes::from_static(b"data: {\"choices\":[{}]}\r\n\r\n");
        assert_eq!(events.without_usage(plain.clone()).unwrap().as_ptr(), plain.as_ptr(), "passed on uncopied");
        let rest = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\r\n\r\ndata: [DONE]\r\n\r\n";
        assert_eq!(&events.without_usage(Bytes::from_static(rest)).unwrap()[..], b"data: [DONE]\r\n\r\n");
        assert!(events.is_empty());
        // An LF event after a CRLF one in the same frame: each ends where it does.
        assert_eq!(event_end(b"a\r\n\r\nb\n\n"), Some(5));
        assert_eq!(event_end(b"a\n\nb\r\n\r\n"), Some(3));
        assert_eq!(event_end(b"a\r\n"), None);
    }

    proptest::proptest! {
        /// The first event end is where the first `\n\n` or `\r\n\r\n`
        /// ends, whichever ends first.
        #[test]
        fn an_event_ends_where_its_first_blank_line_does(
            bytes in proptest::collection::vec(proptest::sample::select(&b"a\r\n"[..]), 0..40)
        ) {
            let ending = |blank: &[u8]| bytes.windows(blank.len()).position(|w| w == blank).map(|at| at + blank.len());
            let first = [ending(b"\n\n"), ending(b"\r\n\r\n")].into_iter().flatten().min();
            proptest::prop_assert_eq!(event_end(&bytes), first);
        }

        /// However a stream is cut into frames, the same events come out,
        /// and the same bytes go on to a client without usage.
        #[test]
        fn events_do_not_depend_on_where_frames_are_cut(
            pieces in proptest::collection::vec(
                proptest::sample::select(&["data: {\"choices\":[{}]}", "data: {\"choices\":[],\"usage\":{}}", "\n", "\r\n", "x"][..]),
                0..24,
            ),
            cuts in proptest::collection::vec(proptest::prelude::any::<proptest::sample::Index>(), 0..8),
        ) {
            let stream = pieces.concat().into_bytes();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.index(stream.len() + 1)).collect();
            cuts.sort_unstable();
            let frames: Vec<&[u8]> = std::iter::once(0)
                .chain(cuts.iter().copied())
                .zip(cuts.iter().copied().chain(std::iter::once(stream.len())))
                .map(|(a, b)| &stream[a..b])
                .collect();
            let mut whole = Events::default();
            let expected = whole.push(&stream);
            let mut cut = Events::default();
            let events: Vec<Bytes> = frames.iter().flat_map(|frame| cut.push(frame)).collect();
            proptest::prop_assert_eq!(&events, &expected);
            proptest::prop_assert_eq!(cut.take_rest(), whole.take_rest());

            let passed = |frames: &[&[u8]]| {
                let mut events = Events::default();
                let mut out: Vec<u8> = frames
                    .iter()
                    .filter_map(|frame| events.without_usage(Bytes::copy_from_slice(frame)))
                    .flat_map(|kept| kept.to_vec())
                    .collect();
                out.extend_from_slice(&events.take_rest());
                out
            };
            proptest::prop_assert_eq!(passed(&frames), passed(&[&stream[..]]));
        }

        /// Data events are counted where `data: ` starts a line.
        #[test]
        fn data_events_are_counted_at_line_starts(
            pieces in proptest::collection::vec(proptest::sample::select(&["data: ", "data:", "x", "\n", "\r\n"][..]), 0..20)
        ) {
            let bytes = pieces.concat().into_bytes();
            let starts = (0..bytes.len())
                .filter(|&i| (i == 0 || bytes[i - 1] == b'\n') && bytes[i..].starts_with(b"data: "))
                .count();
            proptest::prop_assert_eq!(count_data_events(&bytes), starts);
        }
    }

    #[test]
    fn an_event_never_ended_is_passed_on_not_held() {
        let frame = [b'x'; 1024];
        let (mut events, mut passed, mut pushed) = (Events::default(), 0, 0);
        for _ in 0..200 {
            passed += events.without_usage(Bytes::copy_from_slice(&frame)).map_or(0, |kept| kept.len());
            pushed += frame.len();
            assert!(events.pending.len() <= MAX_PENDING, "held {}", events.pending.len());
        }
        assert_eq!(passed + events.take_rest().len(), pushed, "nothing lost");
        assert!(passed > 0);
        let mut events = Events::default();
        let out: usize = (0..200).flat_map(|_| events.push(&frame)).map(|event| event.len()).sum();
        assert!(events.pending.len() <= MAX_PENDING);
        assert_eq!(out + events.take_rest().len(), 200 * frame.len());
    }

    #[test]
    fn output_is_a_non_empty_string_where_tokens_arrive() {
        // llama-server's first chunk, before it reads the prompt.
        assert!(!carries_output(
            br#"data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}]}"#
        ));
        assert!(!carries_output(br#"data: {"choices":[{"delta":{"role":"assistant","content":""}}]}"#));
        assert!(carries_output(br#"data: {"choices":[{"index":0,"delta":{"content":" the"}}]}"#));
        assert!(carries_output(br#"data: {"choices":[{"text":"x","index":0}],"object":"text_completion"}"#));
        assert!(carries_output(br#"data: {"choices":[{"delta":{"reasoning_content":"Hm"}}]}"#));
        assert!(carries_output(br#"data: {"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"{\"a"}}]}}]}"#));
        assert!(carries_output(br#"data: {"type":"response.output_text.delta","delta":"Hi"}"#));
        assert!(carries_output(br#"data: {"type":"content_block_delta","delta":{"type":"text_delta","text":"Hi"}}"#));
        assert!(carries_output(br#"data: {"choices": [{"delta": {"content": "x"}}]}"#), "spaces after colons");
        assert!(carries_output(
            br#"data: {"choices":[{"delta":{"tool_calls":[{"function":{"name":"f","arguments":""}}]}}]}"#
        ));
        assert!(carries_output(
            br#"data: {"type":"content_block_delta","delta":{"type":"thinking_delta","thinking":"so"}}"#
        ));
        // An object, not a string, says nothing; nor a field cut at the
        // frame's end.
        assert!(!carries_output(br#"data: {"type":"content_block_delta","delta":{"type":"text_delta","#));
        assert!(!carries_output(br#"data: {"choices":[{"delta":{"content":""#));
    }

    #[test]
    fn the_usage_chunk_is_recognised_and_data_events_counted() {
        assert!(is_usage_only_event(br#"data: {"choices":[],"usage":{"prompt_tokens":3}}"#));
        assert!(is_usage_only_event(b"\ndata: {\"choices\":[],\"usage\":{}}\n\n"));
        assert!(!is_usage_only_event(br#"data: {"choices":[{"delta":{"content":"usage"}}],"usage":null}"#));
        assert!(!is_usage_only_event(b"data: [DONE]"));
        assert_eq!(count_data_events(b"data: {}\n\ndata: [DONE]\n\n: comment data: x\n\n"), 2);
    }

    #[test]
    fn a_frame_is_whole_events_only_where_its_last_event_ends_with_it() {
        assert!(whole_events(b"data: x\n\n"));
        assert!(whole_events(b"a\r\n\r\nb\n\n"));
        // Ending in a blank line is not enough: the last `\n` begins an event.
        assert!(!whole_events(b"data: x\n\n\n"));
        assert!(!whole_events(b"\n\r\n\n\n"));
        assert!(!whole_events(b""));
    }
}
