use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// A plain HTTP client for tests, with a deadline on every exchange.
#[derive(Clone)]
pub struct HttpClient {
    client: Client<HttpConnector, Full<Bytes>>,
}

pub struct TestResponse {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl TestResponse {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Asserts the OpenAI error envelope and returns the error object.
    pub fn openai_error(&self) -> Value {
        let body = self.json();
        let error = body.get("error").unwrap_or_else(|| panic!("no `error` in {body}")).clone();
        assert!(error.get("message").and_then(Value::as_str).is_some_and(|m| !m.is_empty()), "message: {error}");
        assert!(error.get("type").and_then(Value::as_str).is_some(), "type: {error}");
        assert!(error.get("param").is_some(), "param key: {error}");
        assert!(error.get("code").is_some(), "code key: {error}");
        assert_eq!(self.header("content-type"), Some("application/json"));
        error
    }
}

const DEADLINE: Duration = Duration::from_secs(30);

impl Default for HttpClient {
    fn default() -> HttpClient {
        HttpClient { client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()) }
    }
}

impl HttpClient {
    pub async fn get(&self, url: &str) -> TestResponse {
        self.send(Method::GET, url, Bytes::new(), &[]).await
    }

    pub async fn post_json(&self, url: &str, body: &Value) -> TestResponse {
        self.send(Method::POST, url, Bytes::from(body.to_string()), &[]).await
    }

    pub async fn send(&self, method: Method, url: &str, body: Bytes, headers: &[(&str, &str)]) -> TestResponse {
        let response = self.start(method, url, body, headers).await;
        let (parts, body) = response.into_parts();
        let body = tokio::time::timeout(DEADLINE, body.collect())
            .await
            .expect("response body within the deadline")
            .expect("readable response body")
            .to_bytes();
        TestResponse { status: parts.status, headers: parts.headers, body }
    }

    /// Sends a request and returns as soon as the response headers are in,
    /// so the body can be read frame by frame.
    pub async fn start(
        &self,
        method: Method,
        url: &str,
        body: Bytes,
        headers: &[(&str, &str)],
    ) -> http::Response<Incoming> {
        self.start_within(method, url, body, headers, DEADLINE)
            .await
            .expect("response headers within the deadline")
            .expect("request sent")
    }

    /// As [`HttpClient::start`], for a load generator: headers within
    /// `deadline` or `Err`, a request that could not be sent `Ok(Err)`.
    pub async fn start_within(
        &self,
        method: Method,
        url: &str,
        body: Bytes,
        headers: &[(&str, &str)],
        deadline: Duration,
    ) -> Result<Result<http::Response<Incoming>, hyper_util::client::legacy::Error>, tokio::time::error::Elapsed> {
        let mut builder = Request::builder().method(method).uri(url);
        if !headers.iter().any(|(name, _)| name.eq_ignore_ascii_case("content-type")) {
            builder = builder.header("content-type", "application/json");
        }
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        let request = builder.body(Full::new(body)).expect("valid request");
        tokio::time::timeout(deadline, self.client.request(request)).await
    }
}

/// The next data frame of a body, or `None` at its end.
pub async fn next_chunk(body: &mut Incoming) -> Option<Bytes> {
    loop {
        let frame = tokio::time::timeout(DEADLINE, body.frame()).await.expect("next frame within the deadline")?;
        match frame.expect("readable frame").into_data() {
            Ok(data) => return Some(data),
            Err(_) => continue,
        }
    }
}
