//! The floor of the proxy benchmark (`scripts/bench-proxy.sh`): a reverse
//! proxy with nothing but the HTTP stack the data plane and the agent are
//! built on (hyper, `inferyes_net::pool` and `inferyes_net::serve`),
//! forwarding every request to one upstream. What the data plane costs
//! above this row is its own work: parsing, routing, keys, metering.
//!
//! ```sh
//! cargo run --release -p inferyes-net --example bare_proxy -- 127.0.0.1:8081 http://127.0.0.1:9000
//! ```

use std::convert::Infallible;
use std::pin::Pin;

use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode, header};
use hyper::body::Incoming;
use inferyes_net::base_url::BaseUrl;
use inferyes_net::pool::{self, Pool};

// The binaries' allocator, so that this floor is their HTTP stack as they
// run it.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Clone)]
struct Forward {
    pool: Pool<Incoming>,
    upstream: BaseUrl,
}

type Body = http_body_util::Either<pool::Incoming<Incoming>, String>;

impl hyper::service::Service<Request<Incoming>> for Forward {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn call(&self, mut request: Request<Incoming>) -> Self::Future {
        let Forward { pool, upstream } = self.clone();
        Box::pin(async move {
            let path = request.uri().path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
            let Some((uri, host, origin)) = upstream.origin_form(&path) else {
                return Ok(error(StatusCode::BAD_REQUEST));
            };
            *request.uri_mut() = uri;
            request.headers_mut().insert(header::HOST, host);
            Ok(match pool.send(origin, request).await {
                Ok(response) => response.map(http_body_util::Either::Left),
                Err(_) => error(StatusCode::BAD_GATEWAY),
            })
        })
    }
}

fn error(status: StatusCode) -> Response<Body> {
    let mut response = Response::new(http_body_util::Either::Right(String::new()));
    *response.status_mut() = status;
    response
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(upstream)) = (args.next(), args.next()) else {
        eprintln!("usage: bare_proxy LISTEN_ADDR UPSTREAM_URL");
        std::process::exit(2);
    };
    let upstream = BaseUrl::new(&upstream);
    if upstream.origin().is_none() {
        eprintln!("bare_proxy: {} is not an http URL", upstream.as_str());
        std::process::exit(2);
    }
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    let services = (0..inferyes_net::serve::default_workers())
        .map(|_| {
            let settings = pool::Settings {
                connect_timeout: std::time::Duration::from_secs(2),
                idle_timeout: inferyes_net::serve::CLIENT_IDLE_TIMEOUT,
                tls: None,
                read_timeout: std::time::Duration::from_secs(600),
                idle_limits: pool::IdleLimits::default(),
            };
            let forward = Forward { pool: Pool::new(settings), upstream: upstream.clone() };
            move |_| forward.clone()
        })
        .collect();
    let shutdown = inferyes_net::process::shutdown_on_signal();
    let options = inferyes_net::serve::Options {
        name: "bare-proxy",
        tls: None,
        http2_streams: inferyes_net::serve::DEFAULT_HTTP2_STREAMS,
        shutdown_grace: std::time::Duration::from_secs(10),
        past_grace: tokio_util::sync::CancellationToken::new(),
        header_read_timeout: inferyes_net::serve::HEADER_READ_TIMEOUT,
        limit: inferyes_net::serve::ConnectionLimit::default(),
        max_requests_per_connection: 0,
        proxy_protocol: None,
    };
    inferyes_net::serve::serve(listener, services, options, shutdown).await
}
