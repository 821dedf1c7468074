//! The tail of a backend's answer, as the data plane reads it for usage
//! and for how the stream ended, and its head, for how it opened: nothing
//! a backend sends makes it panic, and what it counts stays within what
//! was sent.

#![no_main]

use libfuzzer_sys::fuzz_target;

use inferyes_dataplane::http::fuzzing::{
    carries_output, count_data_events, ended_well, ended_with_event, is_usage_only_event, opens_with,
};

fuzz_target!(|tail: &[u8]| {
    if let Some(usage) = inferyes_proto::usage::parse_usage(tail) {
        let _ = usage;
    }
    let events = count_data_events(tail);
    assert!(events <= tail.len() / "data:".len(), "{events} events in {} bytes", tail.len());
    let _ = (ended_well(tail), ended_with_event(tail, "message_stop"), is_usage_only_event(tail), carries_output(tail));
    // Once the first event is whole, more bytes do not change how it opened.
    if let Some(opens) = opens_with(tail, "message_start") {
        let longer = [tail, b"event: message_start\n\n"].concat();
        assert_eq!(opens_with(&longer, "message_start"), Some(opens));
    }
});
