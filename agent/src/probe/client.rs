use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// A small HTTP client for polling backends: bounded time, bounded body.
#[derive(Clone)]
pub struct ProbeClient {
    client: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
}

const MAX_PROBE_BODY: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("invalid url {0}")]
    Url(String),
    #[error("request failed: {0}")]
    Request(String),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("body unreadable: {0}")]
    Body(String),
}

impl ProbeClient {
    pub fn new(timeout: Duration) -> ProbeClient {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout));
        let client = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(2).build(connector);
        ProbeClient { client, timeout }
    }

    /// GET `base` + `path`, with an optional bearer credential.
    pub async fn get(&self, base: &str, path: &str, api_key: &str) -> Result<(StatusCode, Bytes), ProbeError> {
        self.request(Method::GET, base, path, api_key, Bytes::new()).await
    }

    /// POST with no body to `base` + `path`, with an optional bearer
    /// credential.
    pub async fn post(&self, base: &str, path: &str, api_key: &str) -> Result<(StatusCode, Bytes), ProbeError> {
        self.request(Method::POST, base, path, api_key, Bytes::new()).await
    }

    /// POST `body` as JSON to `base` + `path`, with an optional bearer
    /// credential.
    pub async fn post_json(
        &self,
        base: &str,
        path: &str,
        api_key: &str,
        body: &serde_json::Value,
    ) -> Result<(StatusCode, Bytes), ProbeError> {
        self.request(Method::POST, base, path, api_key, Bytes::from(body.to_string())).await
    }

    async fn request(
        &self,
        method: Method,
        base: &str,
        path: &str,
        api_key: &str,
        body: Bytes,
    ) -> Result<(StatusCode, Bytes), ProbeError> {
        let url = format!("{}{path}", base.trim_end_matches('/'));
        let mut builder = Request::builder().method(method).uri(&url);
        if let Some(authorization) = crate::bearer(api_key) {
            builder = builder.header(header::AUTHORIZATION, authorization);
        }
        if !body.is_empty() {
            builder = builder.header(header::CONTENT_TYPE, "application/json");
        }
        let request = builder.body(Full::new(body)).map_err(|_| ProbeError::Url(url.clone()))?;
        let exchange = async {
            let response = self.client.request(request).await.map_err(|e| ProbeError::Request(e.to_string()))?;
            let status = response.status();
            let body = Limited::new(response.into_body(), MAX_PROBE_BODY)
                .collect()
                .await
                .map_err(|e| ProbeError::Body(e.to_string()))?
                .to_bytes();
            Ok((status, body))
        };
        tokio::time::timeout(self.timeout, exchange).await.map_err(|_| ProbeError::Timeout(self.timeout))?
    }
}
