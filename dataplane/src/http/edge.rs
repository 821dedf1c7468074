//! What every request and answer pass through, whatever the path: the
//! request's id, and a panic caught.
//!
//! Not tower-http's `PropagateRequestId` and `CatchPanic`: those are
//! layers of a tower stack, and the inference endpoints do not go through
//! one (see [`super::Gateway`]).

use std::future::Future;

use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderValue};
pub(crate) use inferyes_proto::headers::REQUEST_ID;
use inferyes_proto::kinds::ErrorShape;

use crate::error::ApiError;

/// The request's id: the client's own when it sent a usable one (text, at
/// most 128 bytes: it goes into log lines and records), else a fresh one.
pub(crate) fn request_id(headers: &HeaderMap) -> HeaderValue {
    headers
        .get(REQUEST_ID)
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.to_str().is_ok())
        .cloned()
        .unwrap_or_else(new_request_id)
}

pin_project_lite::pin_project! {
    /// Around every request:
    /// - the answer carries the request's `x-request-id`;
    /// - a bug does not reach the client as a dropped connection: a
    ///   panicking handler answers 500 in the path's error shape, and the
    ///   panic is logged.
    ///
    /// A future of its own, not an `async fn`: an async function keeps its
    /// argument and what it awaits apart, and the handler's future (a few
    /// kilobytes) would be held, and moved, twice.
    pub(crate) struct Edge<F> {
        id: Option<HeaderValue>,
        errors: ErrorShape,
        #[pin]
        handler: F,
    }
}

impl<F> Edge<F> {
    pub(crate) fn new(id: HeaderValue, handler: F, errors: ErrorShape) -> Edge<F> {
        Edge { id: Some(id), errors, handler }
    }
}

impl<F, R> Future for Edge<F>
where
    F: Future<Output = R>,
    R: IntoResponse,
{
    type Output = Result<Response, std::convert::Infallible>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let this = self.project();
        let handler = this.handler;
        let mut response = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler.poll(cx))) {
            Ok(std::task::Poll::Pending) => return std::task::Poll::Pending,
            Ok(std::task::Poll::Ready(answer)) => answer.into_response(),
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                let id = this.id.as_ref().map(super::id_text).unwrap_or_default();
                tracing::error!(request_id = id, panic = %what, "request handler panicked");
                ApiError::internal().in_shape(*this.errors).into_response()
            }
        };
        if let Some(id) = this.id.take() {
            response.headers_mut().insert(REQUEST_ID, id);
        }
        std::task::Poll::Ready(Ok(response))
    }
}

/// `req_` and 32 random hex digits, written in place (every request that
/// comes without an id needs one).
fn new_request_id() -> HeaderValue {
    let mut id = *b"req_00000000000000000000000000000000";
    inferyes_proto::write_hex(&mut id[4..], fastrand::u128(..));
    HeaderValue::from_bytes(&id).unwrap_or_else(|_| HeaderValue::from_static("req_unknown"))
}

#[cfg(test)]
mod tests {
    use http::StatusCode;
    use http_body_util::BodyExt;

    use super::*;

    #[test]
    fn request_ids_are_req_and_32_hex_digits_and_differ() {
        let (a, b) = (new_request_id(), new_request_id());
        for id in [&a, &b] {
            let id = id.to_str().unwrap();
            assert_eq!(id.len(), 36);
            assert!(
                id.starts_with("req_") && id[4..].bytes().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
            );
        }
        assert_ne!(a, b);
    }

    #[test]
    fn a_client_id_is_kept_only_where_it_is_text_and_short() {
        let id_of = |value: &[u8]| {
            let mut headers = HeaderMap::new();
            headers.insert(REQUEST_ID, HeaderValue::from_bytes(value).unwrap());
            request_id(&headers)
        };
        assert_eq!(id_of(b"client-7"), "client-7");
        assert_eq!(id_of(&[b'x'; 128]).len(), 128);
        for unusable in [&b""[..], &[b'x'; 129], b"caf\xc3\xa9"] {
            let id = id_of(unusable);
            assert!(id.to_str().unwrap().starts_with("req_"), "{unusable:?} gave {id:?}");
        }
        assert!(request_id(&HeaderMap::new()).to_str().unwrap().starts_with("req_"));
    }

    #[tokio::test]
    async fn a_panicking_handler_answers_500_in_the_path_s_shape() {
        let id = HeaderValue::from_static("req_boom");
        let boom = || async {
            if id.len() > 1 {
                panic!("bug");
            }
            "unreachable"
        };
        let response = Edge::new(id.clone(), boom(), ErrorShape::OpenAi).await.unwrap();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(response.headers()["x-request-id"], id);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["error"]["code"], "internal_error");
        let response = Edge::new(id.clone(), boom(), ErrorShape::Anthropic).await.unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!((body["type"].as_str(), body["error"]["type"].as_str()), (Some("error"), Some("api_error")));
    }
}
