//! Server-sent events as they pass through: whole events out of frames
//! that may split them, and the few facts the data plane reads from them.

use bytes::Bytes;

/// Frames in, whole events (each ending in its blank line) out; a partial
/// event waits for the rest.
#[derive(Default)]
pub struct Events {
    pending: Vec<u8>,
}

impl Events {
    pub fn push(&mut self, data: &[u8]) -> Vec<Bytes> {
        self.pending.extend_from_slice(data);
        let mut events = Vec::new();
        while let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..end + 2).collect();
            events.push(Bytes::from(event));
        }
        events
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

/// Whether an event is the usage-only chunk `include_usage` adds
/// (`"choices":[]` with `usage`), which a client that did not ask for it
/// must not see.
pub fn is_usage_only_event(event: &[u8]) -> bool {
    let event = event.trim_ascii_start();
    event.starts_with(b"data: {") && contains(event, b"\"choices\":[]") && contains(event, b"\"usage\":")
}

/// The data events (`data: ...` at a line start) that begin in `bytes`.
pub fn count_data_events(bytes: &[u8]) -> usize {
    bytes.windows(6).enumerate().filter(|(i, w)| *w == b"data: " && (*i == 0 || bytes[i - 1] == b'\n')).count()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn the_usage_chunk_is_recognised_and_data_events_counted() {
        assert!(is_usage_only_event(br#"data: {"choices":[],"usage":{"prompt_tokens":3}}"#));
        assert!(is_usage_only_event(b"\ndata: {\"choices\":[],\"usage\":{}}\n\n"));
        assert!(!is_usage_only_event(br#"data: {"choices":[{"delta":{"content":"usage"}}],"usage":null}"#));
        assert!(!is_usage_only_event(b"data: [DONE]"));
        assert_eq!(count_data_events(b"data: {}\n\ndata: [DONE]\n\n: comment data: x\n\n"), 2);
    }
}
