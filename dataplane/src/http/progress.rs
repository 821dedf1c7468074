//! llama-server's prompt progress (`return_progress`): the events a stream
//! sends while its prompt is read, before its first token, each saying how
//! much of the prompt the server has read. The ledger needs them where a
//! stream ends before its usage chunk (its client went away after the
//! first token, say): it is then counted for the prompt the server read,
//! not for an estimate from the body's size. A client that did not ask for
//! them does not see them.

use bytes::Bytes;
use inferyes_proto::usage::{PromptProgress, is_progress_event, parse_prompt_progress};

/// Held at most while a progress event is incomplete: a server that never
/// ends one is passed on as it is.
const MAX_HELD: usize = 64 * 1024;

/// What the data plane does with a stream's progress events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ProgressEvents {
    /// None are looked for: the path's answers carry none.
    Ignored,
    /// Read, and passed on: the client asked for them.
    Read,
    /// Read, and taken out: the data plane asked for them.
    Taken,
}

/// A stream's first bytes, read event by event until the first one that is
/// not a progress event; from there on, frames pass untouched.
pub(crate) struct Progress {
    take: bool,
    /// A partial event, waiting for the rest: searched already, with no
    /// end in it.
    pending: Vec<u8>,
}

/// What goes on of a frame.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Passed {
    /// Nothing yet.
    Held,
    /// These bytes; progress events may still follow.
    On(Bytes),
    /// These bytes, and the rest of the stream as it comes: the progress
    /// events are over.
    Last(Bytes),
}

impl Progress {
    pub(crate) fn new(events: ProgressEvents) -> Option<Progress> {
        (events != ProgressEvents::Ignored)
            .then(|| Progress { take: events == ProgressEvents::Taken, pending: Vec::new() })
    }

    /// What of `data` goes on; `seen` is told of each progress event in
    /// it and of the first event after them, where that is no token (chat's
    /// opening role chunk).
    pub(crate) fn push(&mut self, data: Bytes, mut seen: impl FnMut(Noticed)) -> Passed {
        // The first token's frame, most often whole events: passed on
        // uncopied.
        if self.pending.is_empty()
            && super::sse::ends_an_event(&data)
            && !is_progress_event(&data)
            && !is_comment(&data)
        {
            opening(&data, &mut seen);
            return Passed::Last(data);
        }
        let from = super::sse::resume_at(self.pending.len(), 0);
        self.pending.extend_from_slice(&data);
        let mut kept = Vec::new();
        let mut start = 0;
        let mut moved_on = false;
        for end in super::sse::event_ends(&self.pending, from) {
            let event = &self.pending[start..end];
            if is_comment(event) {
                kept.extend_from_slice(event);
            } else if is_progress_event(event) {
                seen(Noticed::Progress(parse_prompt_progress(event)));
                if !self.take {
                    kept.extend_from_slice(event);
                }
            } else {
                opening(event, &mut seen);
                moved_on = true;
                break;
            }
            start = end;
        }
        if moved_on {
            // The stream has moved on: this event and all after it pass.
            kept.extend_from_slice(&self.pending[start..]);
            self.pending.clear();
            return Passed::Last(Bytes::from(kept));
        }
        self.pending.drain(..start);
        if self.pending.len() > MAX_HELD {
            kept.append(&mut self.pending);
            return Passed::Last(Bytes::from(kept));
        }
        if kept.is_empty() { Passed::Held } else { Passed::On(Bytes::from(kept)) }
    }

    /// The partial event left when the stream ends, as it is; none where it
    /// is one of the progress events the gateway asked for.
    pub(crate) fn take_rest(&mut self) -> Option<Bytes> {
        let rest = std::mem::take(&mut self.pending);
        let ours = self.take && is_progress_event(&rest);
        (!rest.is_empty() && !ours).then(|| Bytes::from(rest))
    }
}

/// What the reader saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Noticed {
    /// A progress event, and what it says where it can be read.
    Progress(Option<PromptProgress>),
    /// The first event after them carries no output: chat's opening role
    /// chunk, no token.
    NoToken,
}

/// Tells `seen` whether the first event of `events` carries no output.
fn opening(events: &[u8], seen: &mut impl FnMut(Noticed)) {
    let first = super::sse::event_end(events).map_or(events, |end| &events[..end]);
    if !super::sse::carries_output(first) {
        seen(Noticed::NoToken);
    }
}

/// Whether an event is only a comment (a keep-alive, a note), after any
/// blank lines that an event ahead of it left over (`\n\n\n`).
fn is_comment(event: &[u8]) -> bool {
    event.trim_ascii_start().starts_with(b":")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(processed: u32) -> String {
        format!(
            "data: {{\"choices\":[{{\"finish_reason\":null,\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":null}}}}],\"object\":\"chat.completion.chunk\",\"prompt_progress\":{{\"total\":818,\"cache\":0,\"processed\":{processed},\"time_ms\":5}}}}\n\n"
        )
    }

    const TOKEN: &str = "data: {\"choices\":[{\"delta\":{\"content\":\" out\"}}]}\n\n";
    const ROLE: &str = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":null}}]}\n\n";

    /// Everything passed on, and every progress read, feeding `frames` in.
    fn run(events: ProgressEvents, frames: &[&[u8]]) -> (String, Vec<Noticed>, bool) {
        let mut progress = Progress::new(events).expect("looked for");
        let (mut out, mut read, mut over) = (String::new(), Vec::new(), false);
        for frame in frames {
            if over {
                out.push_str(std::str::from_utf8(frame).unwrap());
                continue;
            }
            match progress.push(Bytes::copy_from_slice(frame), |p| read.push(p)) {
                Passed::Held => {}
                Passed::On(bytes) => out.push_str(std::str::from_utf8(&bytes).unwrap()),
                Passed::Last(bytes) => {
                    out.push_str(std::str::from_utf8(&bytes).unwrap());
                    over = true;
                }
            }
        }
        (out, read, over)
    }

    #[test]
    fn progress_events_are_read_and_taken_out_whatever_the_frames() {
        let at = |processed| Noticed::Progress(Some(PromptProgress { total: 818, cache: 0, processed }));
        // Lines ended by `\n` and by `\r\n`: an event's end may be cut
        // anywhere between frames.
        for ends in [|s: String| s, |s: String| s.replace('\n', "\r\n")] {
            let (token, role) = (ends(TOKEN.to_string()), ends(ROLE.to_string()));
            let whole = ends([event(0), event(512), event(818), TOKEN.to_string(), TOKEN.to_string()].concat());
            for size in [1, 2, 3, 7, 100, whole.len()] {
                let frames: Vec<&[u8]> = whole.as_bytes().chunks(size).collect();
                let (out, read, over) = run(ProgressEvents::Taken, &frames);
                assert_eq!(out, [token.as_str(), &token].concat(), "frames of {size}");
                assert_eq!(read, vec![at(0), at(512), at(818)], "frames of {size}: the first token is one");
                assert!(over);
                let (out, read, _) = run(ProgressEvents::Read, &frames);
                assert_eq!(out, whole, "a client that asked sees them, frames of {size}");
                assert_eq!(read.len(), 3);
                // Chat's role chunk opens the answer: no token.
                let with_role = ends([event(0), ROLE.to_string(), TOKEN.to_string()].concat());
                let frames: Vec<&[u8]> = with_role.as_bytes().chunks(size).collect();
                let (out, read, _) = run(ProgressEvents::Taken, &frames);
                assert_eq!(out, [role.as_str(), &token].concat());
                assert_eq!(read, vec![at(0), Noticed::NoToken], "frames of {size}");
            }
        }
    }

    #[test]
    fn a_stream_without_progress_passes_untouched() {
        let mut progress = Progress::new(ProgressEvents::Taken).unwrap();
        let frame = Bytes::from_static(TOKEN.as_bytes());
        let Passed::Last(passed) = progress.push(frame.clone(), |seen| panic!("{seen:?}")) else { panic!() };
        assert_eq!(passed.as_ptr(), frame.as_ptr(), "not copied");
        assert!(Progress::new(ProgressEvents::Ignored).is_none());
    }

    #[test]
    fn an_event_that_never_ends_is_not_held_for_ever() {
        let mut progress = Progress::new(ProgressEvents::Taken).unwrap();
        let start = Bytes::from_static(b"data: {\"prompt_progress\":{\"total\":1,");
        let started = start.len();
        assert_eq!(progress.push(start, |_| {}), Passed::Held);
        let endless = Bytes::from(vec![b'x'; MAX_HELD]);
        let Passed::Last(passed) = progress.push(endless, |_| {}) else { panic!("given up on") };
        assert_eq!(passed.len(), started + MAX_HELD);
        assert_eq!(progress.take_rest(), None);
        let mut cut = Progress::new(ProgressEvents::Taken).unwrap();
        assert_eq!(cut.push(Bytes::from_static(b"data: {\"prompt_progress\":"), |_| {}), Passed::Held);
        assert_eq!(cut.take_rest(), None, "the gateway's own, cut short, is not the client's");
        let mut asked = Progress::new(ProgressEvents::Read).unwrap();
        assert_eq!(asked.push(Bytes::from_static(b"data: {\"prompt_progress\":"), |_| {}), Passed::Held);
        assert_eq!(asked.take_rest().as_deref(), Some(&b"data: {\"prompt_progress\":"[..]), "the client's own");
    }

    #[test]
    fn a_comment_among_the_progress_events_does_not_end_them() {
        let stream = [event(0), ": keep-alive\n\n".to_string(), event(818), TOKEN.to_string()].concat();
        let (out, read, over) = run(ProgressEvents::Taken, &[stream.as_bytes()]);
        assert_eq!(out, [": keep-alive\n\n", TOKEN].concat());
        assert_eq!(read.len(), 2);
        assert!(over);
        let (out, read, _) = run(ProgressEvents::Taken, &[b": note\n\n", event(9).as_bytes(), TOKEN.as_bytes()]);
        assert_eq!((out.as_str(), read.len()), ([": note\n\n", TOKEN].concat().as_str(), 1));
        // A blank line too many ahead of the comment: still a comment.
        let stream = [event(0), "\n: keep-alive\n\n".to_string(), event(818), TOKEN.to_string()].concat();
        let (out, read, _) = run(ProgressEvents::Taken, &[stream.as_bytes()]);
        assert_eq!((out, read.len()), (["\n: keep-alive\n\n", TOKEN].concat(), 2));
    }
}
