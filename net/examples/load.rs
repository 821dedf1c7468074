//! A fixed load: `REQUESTS` POSTs of one body to one URL over
//! `CONNECTIONS` kept-alive connections, each answer read whole. Fails on
//! the first answer that is not a success, on a stream (an answer of
//! `text/event-stream`) that does not end with `data: [DONE]`, and on a
//! whole answer to a body asking for a stream (`"stream":true`). The
//! profile-optimised build's training (`scripts/pgo.sh`) runs it: a count,
//! not a duration, so that the profile does not depend on the machine's
//! speed, and a failure, not a quiet profile of error paths.
//!
//! ```sh
//! cargo run --release -p inferyes-net --example load -- \
//!   http://127.0.0.1:8080/v1/chat/completions 1000 32 body.json 'authorization: Bearer sk-...'
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, header};
use http_body_util::{BodyExt, Full};
use inferyes_net::base_url::BaseUrl;
use inferyes_net::pool::{self, Origin, Pool};

struct Load {
    pool: Pool<Full<Bytes>>,
    origin: Origin,
    uri: http::Uri,
    host: HeaderValue,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Bytes,
    /// The body asks for a stream: a whole answer is a failure.
    streams: bool,
    left: AtomicU64,
}

impl Load {
    /// Sends requests until none is left; the first failure ends it.
    async fn run(self: Arc<Self>) -> Result<(), String> {
        while self.left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok() {
            let mut request = Request::post(self.uri.clone())
                .header(header::HOST, self.host.clone())
                .header(header::CONTENT_TYPE, "application/json")
                .body(Full::new(self.body.clone()))
                .map_err(|e| e.to_string())?;
            request.headers_mut().extend(self.headers.iter().cloned());
            let response = self.pool.send(&self.origin, request).await.map_err(|e| format!("send: {e}"))?;
            let (parts, body) = response.into_parts();
            let body = body.collect().await.map_err(|e| format!("body: {e}"))?.to_bytes();
            if !parts.status.is_success() {
                return Err(format!("HTTP {}: {}", parts.status, String::from_utf8_lossy(&body)));
            }
            let stream =
                parts.headers.get(header::CONTENT_TYPE).is_some_and(|t| t.as_bytes().starts_with(b"text/event-stream"));
            if self.streams && !stream {
                return Err(format!("a stream asked for, a whole answer given: {}", String::from_utf8_lossy(&body)));
            }
            if stream && !body.trim_ascii_end().ends_with(b"data: [DONE]") {
                return Err(format!("a stream without its end: {}", String::from_utf8_lossy(&body)));
            }
        }
        Ok(())
    }
}

fn usage() -> ! {
    eprintln!("usage: load URL REQUESTS CONNECTIONS BODY_FILE ['NAME: VALUE'...]");
    std::process::exit(2);
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, requests, connections, body_file, headers @ ..] = args.as_slice() else { usage() };
    let (Ok(requests), Ok(connections)) = (requests.parse::<u64>(), connections.parse::<usize>()) else { usage() };
    let target = url.parse::<http::Uri>().ok().and_then(|uri| {
        let base = BaseUrl::new(&format!("{}://{}", uri.scheme_str()?, uri.authority()?));
        let (uri, host, origin) = base.origin_form(uri.path_and_query()?)?;
        Some((uri, host, origin.clone()))
    });
    let Some((uri, host, origin)) = target else {
        eprintln!("load: {url} is not an http URL with a path");
        std::process::exit(2);
    };
    let body = match std::fs::read(body_file) {
        Ok(body) => Bytes::from(body),
        Err(error) => {
            eprintln!("load: cannot read {body_file}: {error}");
            std::process::exit(2);
        }
    };
    let headers = headers
        .iter()
        .map(|h| {
            let (name, value) = h.split_once(':').unwrap_or_else(|| usage());
            match (HeaderName::try_from(name.trim()), HeaderValue::try_from(value.trim())) {
                (Ok(name), Ok(value)) => (name, value),
                _ => usage(),
            }
        })
        .collect();
    let settings = pool::Settings {
        connect_timeout: std::time::Duration::from_secs(5),
        idle_timeout: std::time::Duration::from_secs(60),
        tls: None,
        read_timeout: std::time::Duration::from_secs(60),
        idle_limits: pool::IdleLimits::default(),
    };
    let streams = std::str::from_utf8(&body).is_ok_and(|text| text.contains("\"stream\":true"));
    let left = AtomicU64::new(requests);
    let load = Arc::new(Load { pool: Pool::new(settings), origin, uri, host, headers, body, streams, left });
    let started = std::time::Instant::now();
    let tasks: Vec<_> = (0..connections.max(1)).map(|_| tokio::spawn(Arc::clone(&load).run())).collect();
    for task in tasks {
        match task.await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                eprintln!("load: {url}: {error}");
                std::process::exit(1);
            }
            Err(error) => {
                eprintln!("load: {error}");
                std::process::exit(1);
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    println!("{url}: {requests} requests, {connections} connections, {:.0} req/s", requests as f64 / seconds);
}
