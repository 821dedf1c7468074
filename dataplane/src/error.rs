//! Every error a client can get from the data plane, rendered in exactly
//! one place, in the envelope its path's clients read (OpenAI's, or
//! Anthropic's on the Messages API), with a `code` from one list.

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use inferyes_proto::kinds::ErrorShape;
use inferyes_proto::{ErrorKind, anthropic_error_body, openai_error_body};

/// Declares [`ErrorCode`] from one list: each variant with its text.
macro_rules! error_codes {
    ($($(#[$meta:meta])* $name:ident => $text:literal,)*) => {
        /// The `code` of every error the data plane writes itself.
        /// `docs/api.md` lists each (a test holds the two to each other).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum ErrorCode {
            $($(#[$meta])* $name,)*
        }

        impl ErrorCode {
            pub const ALL: &[ErrorCode] = &[$(ErrorCode::$name,)*];

            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$name => $text,)*
                }
            }
        }
    };
}

error_codes! {
    InvalidApiKey => "invalid_api_key",
    RateLimitExceeded => "rate_limit_exceeded",
    ModelNotFound => "model_not_found",
    InvalidJson => "invalid_json",
    InvalidType => "invalid_type",
    MissingRequiredParameter => "missing_required_parameter",
    InvalidBody => "invalid_body",
    InvalidPath => "invalid_path",
    ContextLengthExceeded => "context_length_exceeded",
    UnsupportedEndpoint => "unsupported_endpoint",
    UnsupportedParameter => "unsupported_parameter",
    UnknownUrl => "unknown_url",
    MethodNotAllowed => "method_not_allowed",
    RequestTimeout => "request_timeout",
    RequestTooLarge => "request_too_large",
    InternalError => "internal_error",
    NoCapacity => "no_capacity",
    NotReady => "not_ready",
    GatewayShutdown => "gateway_shutdown",
    Overloaded => "overloaded",
    UpstreamUnreachable => "upstream_unreachable",
    UpstreamTimeout => "upstream_timeout",
    UpstreamBroken => "upstream_broken",
    UpstreamAuthMisconfigured => "upstream_auth_misconfigured",
    UpstreamAnswerTooLarge => "upstream_answer_too_large",
    // llama-server's error classes, in the words OpenAI clients read.
    ModelLoading => "model_loading",
    BackendAuthenticationFailed => "backend_authentication_failed",
    NotFound => "not_found",
    InvalidRequest => "invalid_request",
    BackendError => "backend_error",
}

/// An error's `code`: one of ours, or what a backend wrote in its own
/// (llama-swap's `concurrency_limit`, say), passed on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Code {
    Gateway(ErrorCode),
    Backend(Box<str>),
}

impl Code {
    pub fn as_str(&self) -> &str {
        match self {
            Code::Gateway(code) => code.as_str(),
            Code::Backend(code) => code,
        }
    }
}

/// An error as the client gets it.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
    pub code: Option<Code>,
    pub param: Option<&'static str>,
    /// Seconds, for 503s and 429s.
    pub retry_after: Option<u32>,
    /// Overrides the status [`ErrorKind`] implies (a backend's own status).
    pub status: Option<StatusCode>,
    /// Sent with the error (rate-limit headers).
    pub headers: Vec<(http::HeaderName, HeaderValue)>,
    /// The envelope it is written in: the path's, set where the request's
    /// path is known.
    pub shape: ErrorShape,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>, code: ErrorCode) -> ApiError {
        ApiError {
            kind,
            message: message.into(),
            code: Some(Code::Gateway(code)),
            param: None,
            retry_after: None,
            status: None,
            headers: Vec::new(),
            shape: ErrorShape::OpenAi,
        }
    }

    pub fn param(mut self, param: &'static str) -> ApiError {
        self.param = Some(param);
        self
    }

    pub fn retry_after(mut self, seconds: u32) -> ApiError {
        self.retry_after = Some(seconds);
        self
    }

    /// The error as the clients of a path with errors of `shape` read it.
    pub fn in_shape(mut self, shape: ErrorShape) -> ApiError {
        self.shape = shape;
        self
    }

    pub fn with_status(mut self, status: StatusCode) -> ApiError {
        self.status = Some(status);
        self
    }

    pub fn status(&self) -> StatusCode {
        self.status.unwrap_or_else(|| {
            StatusCode::from_u16(self.kind.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
        })
    }

    /// A model the caller may not use is, to the caller, a model that does
    /// not exist: the answer OpenAI gives, and no catalog leaks to a
    /// narrow key.
    pub fn no_such_model(id: &str) -> ApiError {
        ApiError::new(
            ErrorKind::NotFound,
            format!("The model `{id}` does not exist or you do not have access to it."),
            ErrorCode::ModelNotFound,
        )
        .param("model")
    }

    pub fn not_ready() -> ApiError {
        ApiError::new(ErrorKind::Unavailable, "the data plane has no routing snapshot yet", ErrorCode::NotReady)
            .retry_after(1)
    }

    /// The data plane holds all the bytes of `what` (request bodies,
    /// answers) it may: a refusal for load, to be tried again.
    pub fn overloaded(what: &str) -> ApiError {
        ApiError::new(
            ErrorKind::Overloaded,
            format!("the gateway holds all the {what} it may at once; try again in a moment"),
            ErrorCode::Overloaded,
        )
        .retry_after(1)
    }

    /// The caller's key or tenant holds all of `what` its share of the
    /// data plane allows: a refusal of that caller alone, to be tried again
    /// once one of its requests has ended.
    pub fn past_share(whose: crate::shares::Whose, what: &str) -> ApiError {
        ApiError::new(
            ErrorKind::RateLimited,
            format!(
                "Rate limit reached: this {} holds {what} its share of the gateway allows. Try again when one of \
                 its requests has ended.",
                whose.as_str()
            ),
            ErrorCode::RateLimitExceeded,
        )
        .retry_after(1)
    }

    /// The error as a whole HTTP/1.1 response that closes its connection,
    /// for a connection refused before any request on it is read.
    pub fn http1_response(&self) -> bytes::Bytes {
        let (status, body) = (self.status(), self.body());
        let mut head = format!(
            "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
            status.as_u16(),
            status.canonical_reason().unwrap_or(""),
            body.len()
        );
        if let Some(seconds) = self.retry_after {
            head.push_str(&format!("retry-after: {seconds}\r\n"));
        }
        bytes::Bytes::from(head + "\r\n" + &body)
    }

    /// A bug: what the client is told of it.
    pub fn internal() -> ApiError {
        ApiError::new(ErrorKind::Internal, "internal error; the request was not completed", ErrorCode::InternalError)
    }

    pub fn code_str(&self) -> Option<&str> {
        self.code.as_ref().map(Code::as_str)
    }

    /// The error's JSON body: `{"error":{...}}`, or Anthropic's
    /// `{"type":"error","error":{...}}` (which has no `code`).
    pub fn body(&self) -> String {
        match self.shape {
            ErrorShape::OpenAi => openai_error_body(self.kind, &self.message, self.code_str(), self.param),
            ErrorShape::Anthropic => anthropic_error_body(self.kind, &self.message),
        }
    }

    /// A final SSE event carrying the error, the way the path's servers end
    /// a stream that failed after it started: OpenAI-compatible ones with a
    /// `data:` event of it, Anthropic's with an `error` event.
    pub fn event(&self) -> bytes::Bytes {
        let event = match self.shape {
            ErrorShape::OpenAi => "",
            ErrorShape::Anthropic => "event: error\n",
        };
        bytes::Bytes::from(format!("{event}data: {}\n\n", self.body()))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body();
        let mut response = (self.status(), [(header::CONTENT_TYPE, "application/json")], body).into_response();
        if let Some(seconds) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        for (name, value) in self.headers {
            response.headers_mut().insert(name, value);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn an_error_on_the_messages_api_is_in_anthropic_s_shape_body_and_event() {
        let error = ApiError::no_such_model("m").in_shape(ErrorShape::Anthropic);
        let body: serde_json::Value = serde_json::from_str(&error.body()).unwrap();
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "not_found_error");
        assert!(body["error"]["message"].as_str().unwrap().contains("`m`"));
        let event = error.event();
        let event = std::str::from_utf8(&event).unwrap();
        assert!(event.starts_with("event: error\ndata: {") && event.ends_with("}\n\n"), "{event}");
        let openai = ApiError::no_such_model("m").event();
        assert!(openai.starts_with(b"data: {\"error\":"), "{openai:?}");
    }

    /// The codes `docs/api.md`'s tables give, from every table with a
    /// `` `code` `` column; a backend's own code ("the backend's, e.g.")
    /// is not ours to list.
    fn documented() -> BTreeSet<String> {
        let doc = include_str!("../../docs/api.md");
        let mut codes = BTreeSet::new();
        let mut column = None;
        for line in doc.lines() {
            let Some(row) = line.trim().strip_prefix('|') else {
                column = None;
                continue;
            };
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            if column.is_none() {
                column = cells.iter().position(|cell| *cell == "`code`");
                continue;
            }
            let Some(cell) = column.and_then(|i| cells.get(i)) else { continue };
            if cell.starts_with("the backend's") || cell.starts_with("---") {
                continue;
            }
            let code = cell.split('`').nth(1).unwrap_or_default();
            assert!(!code.is_empty(), "a row of a `code` table without a code: {line}");
            codes.insert(code.to_string());
        }
        codes
    }

    #[test]
    fn every_code_is_documented_and_every_documented_code_is_one() {
        let ours: BTreeSet<String> = ErrorCode::ALL.iter().map(|c| c.as_str().to_string()).collect();
        let documented = documented();
        let undocumented: Vec<_> = ours.difference(&documented).collect();
        let unknown: Vec<_> = documented.difference(&ours).collect();
        assert!(undocumented.is_empty(), "codes docs/api.md does not list: {undocumented:?}");
        assert!(unknown.is_empty(), "codes docs/api.md lists that the data plane never writes: {unknown:?}");
        assert_eq!(ours.len(), ErrorCode::ALL.len(), "each code once");
    }

    #[test]
    fn the_reader_of_the_tables_reads_them() {
        let documented = documented();
        for code in ["invalid_api_key", "upstream_broken", "no_capacity"] {
            assert!(documented.contains(code), "{code} in {documented:?}");
        }
        assert!(!documented.contains("concurrency_limit"), "a backend's own");
    }
}
