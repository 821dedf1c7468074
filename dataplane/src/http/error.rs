use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use inferyes_proto::{ErrorKind, openai_error_body};

use crate::routing::RouteError;

/// Every error a client can get from the data plane, rendered in exactly
/// one place, in the OpenAI envelope.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
    pub code: Option<String>,
    pub param: Option<&'static str>,
    /// Seconds, for 503s and 429s.
    pub retry_after: Option<u32>,
    /// Overrides the status [`ErrorKind`] implies (a backend's own status).
    pub status: Option<StatusCode>,
    /// Sent with the error (rate-limit headers).
    pub headers: Vec<(http::HeaderName, HeaderValue)>,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>, code: &str) -> ApiError {
        ApiError {
            kind,
            message: message.into(),
            code: Some(code.to_string()),
            param: None,
            retry_after: None,
            status: None,
            headers: Vec::new(),
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

    pub fn status(&self) -> StatusCode {
        self.status.unwrap_or_else(|| {
            StatusCode::from_u16(self.kind.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
        })
    }
}

impl From<RouteError> for ApiError {
    fn from(error: RouteError) -> ApiError {
        let api = ApiError::new(error.kind(), error.to_string(), error.code());
        match error {
            RouteError::NoCapacity { .. } => api.retry_after(1),
            RouteError::ModelNotFound { .. } | RouteError::NotServed { .. } => api.param("model"),
            RouteError::ContextTooLong { .. } => api.param("messages"),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = openai_error_body(self.kind, &self.message, self.code.as_deref(), self.param);
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
