//! A client's request body, as the data plane reads it for routing (as
//! chat's, and as the Messages API's): the scanner never panics, takes
//! nothing serde_json refuses, and the body it rewrites (a model resolved,
//! usage asked for) reads back as meant.

#![no_main]

use libfuzzer_sys::fuzz_target;
use serde::Deserialize;

use inferyes_dataplane::http::fuzzing::{
    estimated_prompt_tokens, metered_prompt_estimate, parse_request_view, with_model, with_usage_requested,
};
use inferyes_dataplane::http::parse_view;

#[derive(Deserialize)]
struct Asked {
    stream_options: StreamOptions,
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: bool,
}

fuzz_target!(|body: &[u8]| {
    // Read as the Messages API's too, its root from its content blocks:
    // the same body, the same verdict and model.
    let messages = inferyes_proto::kinds::row("/v1/messages").expect("the Messages row");
    let as_messages = parse_request_view(messages, &http::HeaderMap::new(), body);
    let Ok(view) = parse_view(body) else {
        assert!(as_messages.is_err(), "a body refused as chat is refused as Messages");
        return;
    };
    assert_eq!(as_messages.map(|m| m.model).ok().as_deref(), Some(view.model.as_str()));
    assert!(
        serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok(),
        "the scanner took a body serde_json refuses"
    );
    let _ = estimated_prompt_tokens(body.len(), &view);
    assert!(metered_prompt_estimate(body.len()) as usize <= body.len());
    let bytes = bytes::Bytes::copy_from_slice(body);
    let renamed = with_model(&bytes, &view, "fuzzed/model\"\\\u{e9}");
    let again = parse_view(&renamed).expect("a renamed body reads");
    assert_eq!(again.model, "fuzzed/model\"\\\u{e9}");
    assert_eq!(again.stream, view.stream);
    // As the pipeline asks: only of a body that sets no stream options. A
    // member the scanner missed would win over the spliced one (the last
    // of a name does, to serde_json), and fail here.
    if !view.has_stream_options
        && let Some(asked) = with_usage_requested(&bytes)
    {
        // Typed, as a server reads it: the rest is skipped, not built (a
        // string with a lone surrogate is no document, but skipped).
        let read: Asked = serde_json::from_slice(&asked).expect("JSON after asking for usage");
        assert!(read.stream_options.include_usage);
        let again = parse_view(&asked).expect("the body asking for usage reads");
        assert_eq!(again.model, view.model);
    }
});
