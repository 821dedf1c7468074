//! A client's upload, a multipart form, as the data plane reads it for
//! routing: the form reader never panics, the model it finds is the bytes
//! where it says it is, and the body with the model renamed reads back
//! with the new name and every other byte where it was.

#![no_main]

use libfuzzer_sys::fuzz_target;

use inferyes_dataplane::http::fuzzing::{parse_request_view, with_model};

fuzz_target!(|body: &[u8]| {
    let row = inferyes_proto::kinds::row("/v1/audio/transcriptions").expect("an upload's row");
    let mut headers = http::HeaderMap::new();
    headers.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("multipart/form-data; boundary=b"));
    let Ok(view) = parse_request_view(row, &headers, body) else { return };
    assert_eq!(body.get(view.model_span.clone()), Some(view.model.as_bytes()), "the model is where the view says");
    let bytes = bytes::Bytes::copy_from_slice(body);
    let renamed = with_model(&bytes, &view, "whisper-large-v3");
    let again = parse_request_view(row, &headers, &renamed).expect("a renamed form is still a form");
    assert_eq!(again.model, "whisper-large-v3");
    assert_eq!(&renamed[..view.model_span.start], &body[..view.model_span.start], "nothing before the name moved");
    assert_eq!(&renamed[again.model_span.end..], &body[view.model_span.end..], "nothing after it changed");
});
