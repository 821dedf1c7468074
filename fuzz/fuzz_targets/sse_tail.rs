//! The tail of a backend's answer, as the data plane reads it for usage
//! and for how the stream ended: nothing a backend sends makes it panic,
//! and what it counts stays within what was sent.

#![no_main]

use libfuzzer_sys::fuzz_target;

use inferyes_dataplane::http::fuzzing::{
    carries_output, count_data_events, ended_well, ended_with_event, is_usage_only_event,
};

fuzz_target!(|tail: &[u8]| {
    if let Some(usage) = inferyes_proto::usage::parse_usage(tail) {
        let _ = usage;
    }
    let events = count_data_events(tail);
    assert!(events <= tail.len() / "data:".len(), "{events} events in {} bytes", tail.len());
    let _ = (ended_well(tail), ended_with_event(tail, "message_stop"), is_usage_only_event(tail), carries_output(tail));
});
