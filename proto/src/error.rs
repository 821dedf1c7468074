/// What went wrong, as a client should understand it. Every error enum in
/// the workspace has `fn kind(&self) -> ErrorKind`; this type alone decides
/// the HTTP status, the gRPC code and the OpenAI error `type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    BadRequest,
    Unauthenticated,
    PermissionDenied,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    Overloaded,
    Unavailable,
    Timeout,
    Upstream,
    NotImplemented,
    Internal,
}

impl ErrorKind {
    pub fn http_status(self) -> u16 {
        match self {
            ErrorKind::BadRequest => 400,
            ErrorKind::Unauthenticated => 401,
            ErrorKind::PermissionDenied => 403,
            ErrorKind::NotFound => 404,
            ErrorKind::PayloadTooLarge => 413,
            ErrorKind::RateLimited => 429,
            ErrorKind::Internal => 500,
            ErrorKind::NotImplemented => 501,
            ErrorKind::Upstream => 502,
            ErrorKind::Overloaded | ErrorKind::Unavailable => 503,
            ErrorKind::Timeout => 504,
        }
    }

    pub fn grpc_code(self) -> tonic::Code {
        match self {
            ErrorKind::BadRequest | ErrorKind::PayloadTooLarge => tonic::Code::InvalidArgument,
            ErrorKind::Unauthenticated => tonic::Code::Unauthenticated,
            ErrorKind::PermissionDenied => tonic::Code::PermissionDenied,
            ErrorKind::NotFound => tonic::Code::NotFound,
            ErrorKind::RateLimited | ErrorKind::Overloaded => tonic::Code::ResourceExhausted,
            ErrorKind::Unavailable | ErrorKind::Upstream => tonic::Code::Unavailable,
            ErrorKind::Timeout => tonic::Code::DeadlineExceeded,
            ErrorKind::NotImplemented => tonic::Code::Unimplemented,
            ErrorKind::Internal => tonic::Code::Internal,
        }
    }

    /// The OpenAI error `type` field.
    pub fn openai_type(self) -> &'static str {
        match self {
            ErrorKind::BadRequest | ErrorKind::NotFound | ErrorKind::PayloadTooLarge | ErrorKind::NotImplemented => {
                "invalid_request_error"
            }
            ErrorKind::Unauthenticated => "authentication_error",
            ErrorKind::PermissionDenied => "permission_error",
            ErrorKind::RateLimited => "rate_limit_error",
            ErrorKind::Overloaded | ErrorKind::Unavailable | ErrorKind::Timeout => "service_unavailable_error",
            ErrorKind::Upstream | ErrorKind::Internal => "server_error",
        }
    }

    /// The Anthropic error `type` field.
    pub fn anthropic_type(self) -> &'static str {
        match self {
            ErrorKind::BadRequest | ErrorKind::NotImplemented => "invalid_request_error",
            ErrorKind::Unauthenticated => "authentication_error",
            ErrorKind::PermissionDenied => "permission_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::PayloadTooLarge => "request_too_large",
            ErrorKind::RateLimited => "rate_limit_error",
            ErrorKind::Overloaded | ErrorKind::Unavailable => "overloaded_error",
            ErrorKind::Timeout => "timeout_error",
            ErrorKind::Upstream | ErrorKind::Internal => "api_error",
        }
    }

    /// The inverse of [`ErrorKind::http_status`] for statuses a backend
    /// returns, so upstream errors keep their meaning.
    pub fn from_http_status(status: u16) -> ErrorKind {
        match status {
            401 => ErrorKind::Unauthenticated,
            403 => ErrorKind::PermissionDenied,
            404 => ErrorKind::NotFound,
            413 => ErrorKind::PayloadTooLarge,
            429 => ErrorKind::RateLimited,
            501 => ErrorKind::NotImplemented,
            503 => ErrorKind::Unavailable,
            504 => ErrorKind::Timeout,
            400..=499 => ErrorKind::BadRequest,
            500 => ErrorKind::Internal,
            _ => ErrorKind::Upstream,
        }
    }
}

/// The OpenAI error envelope, `{"error":{"message","type","param","code"}}`,
/// the one shape every client-facing error takes.
pub fn openai_error_body(kind: ErrorKind, message: &str, code: Option<&str>, param: Option<&str>) -> String {
    serde_json::json!({
        "error": {
            "message": message,
            "type": kind.openai_type(),
            "param": param,
            "code": code,
        }
    })
    .to_string()
}

/// The Anthropic error envelope, `{"type":"error","error":{"type","message"}}`,
/// the shape every error on the Messages API takes.
pub fn anthropic_error_body(kind: ErrorKind, message: &str) -> String {
    serde_json::json!({
        "type": "error",
        "error": {
            "type": kind.anthropic_type(),
            "message": message,
        }
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::ErrorKind;

    #[test]
    fn backend_statuses_round_trip() {
        for kind in [
            ErrorKind::Unauthenticated,
            ErrorKind::PermissionDenied,
            ErrorKind::NotFound,
            ErrorKind::PayloadTooLarge,
            ErrorKind::RateLimited,
            ErrorKind::NotImplemented,
            ErrorKind::Timeout,
            ErrorKind::Internal,
            ErrorKind::Upstream,
        ] {
            assert_eq!(ErrorKind::from_http_status(kind.http_status()), kind);
        }
    }
}
