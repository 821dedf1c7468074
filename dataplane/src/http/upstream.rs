//! Backend errors, whatever their shape (llama-server's, llama-swap's old
//! and new, Anthropic's, plain text), rewritten as the data plane's own,
//! written in the envelope of the request's path.

use http::StatusCode;
use inferyes_proto::ErrorKind;
use serde_json::Value;

use crate::error::{ApiError, Code, ErrorCode};

const MAX_MESSAGE: usize = 1000;

pub fn normalize(status: StatusCode, body: &[u8]) -> ApiError {
    let kind = ErrorKind::from_http_status(status.as_u16());
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let error = parsed.as_ref().and_then(|v| v.get("error"));
    let (message, code, param) = match error {
        Some(Value::String(message)) => (message.clone(), None, None),
        Some(Value::Object(fields)) => {
            let message = fields.get("message").and_then(Value::as_str).unwrap_or("backend error").to_string();
            let backend_type = fields.get("type").and_then(Value::as_str).unwrap_or_default();
            let code = match fields.get("code") {
                Some(Value::String(code)) => Some(Code::Backend(code.as_str().into())),
                _ => llama_server_code(backend_type).map(Code::Gateway),
            };
            let param = fields.get("param").and_then(Value::as_str).map(str::to_string);
            (message, code, param)
        }
        _ => {
            let text = String::from_utf8_lossy(body);
            let text = text.trim();
            let message =
                if text.is_empty() { format!("backend answered HTTP {}", status.as_u16()) } else { text.to_string() };
            (message, None, None)
        }
    };
    let mut message = message;
    if message.len() > MAX_MESSAGE {
        let cut = (0..=MAX_MESSAGE).rev().find(|i| message.is_char_boundary(*i)).unwrap_or(0);
        message.truncate(cut);
    }
    let mut api = ApiError {
        kind,
        message,
        code,
        param: None,
        retry_after: None,
        status: Some(status),
        headers: Vec::new(),
        shape: Default::default(),
    };
    // `param` is static in our own errors; the backend's is only kept when
    // it names the one field a client can fix here.
    if param.as_deref() == Some("model") {
        api.param = Some("model");
    }
    api
}

/// llama-server puts its own error class in `type` and an HTTP status in
/// `code`; OpenAI clients look for a string `code`.
fn llama_server_code(backend_type: &str) -> Option<ErrorCode> {
    Some(match backend_type {
        "exceed_context_size_error" => ErrorCode::ContextLengthExceeded,
        "not_supported_error" => ErrorCode::UnsupportedEndpoint,
        "unavailable_error" => ErrorCode::ModelLoading,
        "authentication_error" => ErrorCode::BackendAuthenticationFailed,
        "not_found_error" => ErrorCode::NotFound,
        "invalid_request_error" => ErrorCode::InvalidRequest,
        "server_error" => ErrorCode::BackendError,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_server_errors_become_openai_errors() {
        let body = br#"{"error":{"code":400,"message":"request (5000 tokens) exceeds the available context size (2048 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":5000,"n_ctx":2048}}"#;
        let error = normalize(StatusCode::BAD_REQUEST, body);
        assert_eq!(error.kind, ErrorKind::BadRequest);
        assert_eq!(error.code_str(), Some("context_length_exceeded"));
        assert!(error.message.contains("exceeds the available context size"));
        assert_eq!(error.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn llama_swap_errors_old_and_new_are_understood() {
        let new = br#"{"src":"llama-swap","error":{"message":"too many requests","type":"rate_limit_error","param":null,"code":"concurrency_limit"}}"#;
        let error = normalize(StatusCode::TOO_MANY_REQUESTS, new);
        assert_eq!((error.kind, error.code_str()), (ErrorKind::RateLimited, Some("concurrency_limit")));
        let old = br#"{"error":"could not find suitable inference handler for x"}"#;
        let error = normalize(StatusCode::NOT_FOUND, old);
        assert_eq!(error.kind, ErrorKind::NotFound);
        assert!(error.message.starts_with("could not find"));
        let text = normalize(StatusCode::BAD_GATEWAY, b"upstream exploded");
        assert_eq!((error_kind(&text), text.message.as_str()), (ErrorKind::Upstream, "upstream exploded"));
    }

    fn error_kind(e: &ApiError) -> ErrorKind {
        e.kind
    }
}
