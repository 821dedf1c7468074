//! The connection to agents: one request to a node's proxy, made of the
//! client's, up to its answer's head. Which node, and what follows its
//! answer, is decided by the attempts ([`super::attempt`]), the only
//! caller.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, header};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use inferyes_proto::headers::{
    BACKEND as BACKEND_HEADER, MODEL as MODEL_HEADER, REQUEST_ID, SESSION as SESSION_HEADER,
};
use tokio_util::sync::CancellationToken;

use super::classify::Attempted;

type Http2Client = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// The body of a node's answer, as it comes.
pub(crate) type NodeBody = inferyes_net::pool::Incoming<Full<Bytes>>;

/// The settings of a [`Forwarder`], from the data plane's configuration.
pub struct Settings {
    pub connect_timeout: Duration,
    pub header_timeout: Duration,
    pub read_timeout: Duration,
    pub http2: bool,
}

#[derive(Clone)]
pub struct Forwarder {
    /// To agents at `http://` and, with TLS, `https://` proxy URLs, over
    /// HTTP/1.1: this worker's pool of connections.
    http1: inferyes_net::pool::Pool<Full<Bytes>>,
    /// The same over HTTP/2, for agents that take it (unless configured
    /// off): one connection per agent carries every request.
    http2: Option<Http2Client>,
    header_timeout: Duration,
    /// Cancelled when a shutdown's grace period is over: streams still
    /// running end with an error event.
    hard_stop: CancellationToken,
    /// What every worker's requests may hold of bodies read whole.
    budget: Arc<super::body::Budget>,
}

/// What a node is told of a request beside the client's headers.
pub(crate) struct Facts<'a> {
    pub model: &'a str,
    pub session: Option<&'a str>,
    pub request_id: &'a HeaderValue,
    /// The body is a form (an upload), sent with the client's content type
    /// and its boundary; any other is JSON, and said to be (llama-swap
    /// routes only what says so).
    pub form: bool,
}

impl Forwarder {
    /// A forwarder as `config` says, with `tls` made of its settings.
    pub fn new(
        settings: &Settings,
        tls: rustls::ClientConfig,
        hard_stop: CancellationToken,
        budget: Arc<super::body::Budget>,
    ) -> Forwarder {
        let Settings { connect_timeout, header_timeout, read_timeout, http2 } = *settings;
        let http1 = inferyes_net::pool::Pool::new(inferyes_net::pool::Settings {
            connect_timeout,
            idle_timeout: inferyes_net::serve::CLIENT_IDLE_TIMEOUT,
            tls: Some(Arc::new(tls.clone())),
            read_timeout,
            idle_limits: inferyes_net::pool::IdleLimits::default(),
        });
        let mut tcp = HttpConnector::new();
        tcp.set_nodelay(true);
        tcp.set_connect_timeout(Some(connect_timeout));
        // The TCP connector passes `https://` on to rustls.
        tcp.enforce_http(false);
        let http2 = http2.then(|| {
            // One connection carries every request to an agent, so a dead
            // one must be noticed without waiting for a request's header
            // timeout: pings, answered within a few seconds.
            Client::builder(TokioExecutor::new())
                .http2_only(true)
                .timer(hyper_util::rt::TokioTimer::new())
                .http2_keep_alive_interval(Duration::from_secs(10))
                .http2_keep_alive_timeout(Duration::from_secs(5))
                .http2_keep_alive_while_idle(true)
                // Credit for what clients have not read yet: a stream holds
                // at most 1 MiB, and a few clients that stop reading must not
                // use up the whole connection's (every request to the node).
                .http2_initial_stream_window_size(1 << 20)
                .http2_initial_connection_window_size(64 << 20)
                .pool_idle_timeout(Duration::from_secs(90))
                .build(
                    hyper_rustls::HttpsConnectorBuilder::new()
                        .with_tls_config(tls)
                        .https_or_http()
                        .enable_http2()
                        .wrap_connector(tcp),
                )
        });
        Forwarder { http1, http2, header_timeout, hard_stop, budget }
    }

    /// One request to a node's proxy, for one of its backends, up to its
    /// answer's head (or the response-header timeout): over HTTP/2 where the node takes it, else
    /// on a pooled HTTP/1.1 connection.
    pub(crate) async fn send(
        &self,
        (endpoint, backend): (&crate::targets::Endpoint, Option<&HeaderValue>),
        path_and_query: &PathAndQuery,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<http::Response<NodeBody>, Attempted> {
        let proxy_url = &endpoint.proxy_url;
        let body = Full::new(body);
        let sent = async {
            if let Some(http2) = self.http2.as_ref().filter(|_| endpoint.proxy_http2) {
                let (uri, host) = proxy_url.uri(path_and_query).ok_or(Attempted::Unreachable(None))?;
                let request = upstream_request(uri, (host, endpoint.authorization.as_ref()), backend, headers, body);
                return match http2.request(request).await {
                    Ok(response) => Ok(response.map(|body| self.http1.unpooled(body))),
                    Err(error) => Err(unreachable(error)),
                };
            }
            let (uri, host, origin) = proxy_url.origin_form(path_and_query).ok_or(Attempted::Unreachable(None))?;
            let request = upstream_request(uri, (host, endpoint.authorization.as_ref()), backend, headers, body);
            self.http1.send(origin, request).await.map_err(unreachable)
        };
        tokio::time::timeout(self.header_timeout, sent).await.unwrap_or(Err(Attempted::TimedOut(self.header_timeout)))
    }

    /// Cancelled when a shutdown's grace period is over.
    pub(crate) fn hard_stop(&self) -> &CancellationToken {
        &self.hard_stop
    }

    /// What bodies read whole may hold, all requests together.
    pub(crate) fn budget(&self) -> &Arc<super::body::Budget> {
        &self.budget
    }
}

fn unreachable(error: impl Into<super::classify::BoxError>) -> Attempted {
    Attempted::Unreachable(Some(error.into()))
}

/// Whether `text` is `n`, in decimal digits only.
pub(crate) fn is_decimal(text: &[u8], n: usize) -> bool {
    !text.is_empty()
        && text.iter().try_fold(0usize, |value, &digit| {
            digit.is_ascii_digit().then_some(())?;
            value.checked_mul(10)?.checked_add(usize::from(digit - b'0'))
        }) == Some(n)
}

/// The client's headers made into those a node is sent, in place: what is
/// not forwarded taken out, ours put in. A client sends a dozen headers or
/// more (the OpenAI SDKs, 17) and few of them are not forwarded: taking those out
/// is much cheaper than copying all the others into a new map, and a copy
/// (for an attempt a failover may follow) is cheapest as a clone, whose
/// names are not hashed again. `Host`, the length and the backend are the
/// attempt's own ([`upstream_request`]).
pub(crate) fn upstream_headers(mut headers: HeaderMap, facts: &Facts<'_>) -> HeaderMap {
    inferyes_proto::headers::remove_hop_by_hop_and(&mut headers, not_forwarded);
    if !facts.form {
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    }
    headers.insert(REQUEST_ID, facts.request_id.clone());
    if let Ok(v) = HeaderValue::from_str(facts.model) {
        headers.insert(MODEL_HEADER, v);
    }
    if let Some(v) = facts.session.and_then(|s| HeaderValue::from_str(s).ok()) {
        headers.insert(SESSION_HEADER, v);
    }
    inferyes_net::telemetry::inject(&tracing::Span::current(), &mut headers);
    headers
}

/// One attempt's request: `headers` from [`upstream_headers`], with this
/// node's `Host`, its agent's credential and backend, and the body's
/// length.
fn upstream_request(
    uri: http::Uri,
    (host, authorization): (HeaderValue, Option<&HeaderValue>),
    backend: Option<&HeaderValue>,
    mut headers: HeaderMap,
    body: Full<Bytes>,
) -> Request<Full<Bytes>> {
    headers.insert(header::HOST, host);
    // The client's `Authorization` was taken out: the agent's goes in.
    if let Some(value) = authorization {
        headers.insert(header::AUTHORIZATION, value.clone());
    }
    // A client's own `x-inferyes-*` were taken out: the route's backend goes in.
    if let Some(v) = backend {
        headers.insert(BACKEND_HEADER, v.clone());
    }
    // The client's length stands where it is the body's, alone (the usual
    // case; an alias or a usage request rewritten in the body changes it,
    // and an HTTP/2 client may repeat it, which a proxy must not pass on).
    let length = http_body::Body::size_hint(&body).exact().and_then(|n| usize::try_from(n).ok()).unwrap_or(0);
    let mut lengths = headers.get_all(header::CONTENT_LENGTH).iter();
    let single = lengths.next().filter(|_| lengths.next().is_none());
    if !single.is_some_and(|v| is_decimal(v.as_bytes(), length)) {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    }
    let mut request = Request::new(body);
    *request.method_mut() = Method::POST;
    *request.uri_mut() = uri;
    *request.headers_mut() = headers;
    request
}

/// Client headers that do not travel on, besides the hop-by-hop ones: the
/// client's credential (the agent adds the backend's own), and our routing
/// headers; its cookies, and what would speak for the operator's account
/// at a provider an `openai` backend calls with the operator's key (an
/// organization or project of the client's choosing); and what a client
/// could forge of the path it came by (`Forwarded`, `X-Forwarded-*`,
/// `X-Real-IP`); and llama-server's `X-Conversation-Id`, with which a
/// client could take over another's stream. `Host` and `Content-Length`
/// are written anew for each attempt.
fn not_forwarded(name: &HeaderName) -> bool {
    matches!(*name, header::PROXY_AUTHORIZATION | header::AUTHORIZATION | header::COOKIE | header::FORWARDED)
        || *name == inferyes_proto::headers::API_KEY
        || {
            let name = name.as_str();
            name.starts_with("x-inferyes-")
                || name.starts_with("x-forwarded-")
                || matches!(
                    name,
                    "openai-organization"
                        | "openai-project"
                        | "x-real-ip"
                        | "x-client-ip"
                        | "x-cluster-client-ip"
                        | "true-client-ip"
                        | "cf-connecting-ip"
                        | "via"
                        // llama-server resumes or cancels a stream by this
                        // id, whoever's it is.
                        | "x-conversation-id"
                )
        }
}

/// An answer's headers as the client gets them: without the hop-by-hop
/// ones; without cookies a backend sets (the data plane's origin is not
/// the backend's: a cookie would be the client's for every node); and
/// without what an `openai` backend says of the operator's account at its
/// provider (organization, project, its rate limits and their use).
pub(crate) fn answer_headers(headers: &mut HeaderMap) {
    inferyes_proto::headers::remove_hop_by_hop_and(headers, |name| {
        name == header::SET_COOKIE || {
            let name = name.as_str();
            name.starts_with("x-ratelimit-")
                || matches!(name, "openai-organization" | "openai-project" | "openai-processing-ms")
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_length_is_passed_on_only_where_it_is_the_body_s() {
        assert!(is_decimal(b"240", 240));
        assert!(is_decimal(b"0", 0));
        assert!(!is_decimal(b"241", 240));
        assert!(!is_decimal(b"", 0));
        assert!(!is_decimal(b"+240", 240));
        assert!(!is_decimal(b"24 0", 240));
        assert!(!is_decimal(b"99999999999999999999999", 0), "too long for a length");
    }

    /// The headers a client's request reaches a node with.
    fn sent(client: HeaderMap, backend: Option<&'static str>, body: &'static [u8]) -> HeaderMap {
        let request_id = HeaderValue::from_static("req_1");
        let facts = Facts { model: "llama", session: Some("chat-1"), request_id: &request_id, form: false };
        let headers = upstream_headers(client, &facts);
        let backend = backend.map(HeaderValue::from_static);
        let request = upstream_request(
            http::Uri::from_static("/v1/chat/completions"),
            (HeaderValue::from_static("node-a:9100"), None),
            backend.as_ref(),
            headers,
            Full::new(Bytes::from_static(body)),
        );
        request.into_parts().0.headers
    }

    #[test]
    fn a_client_s_headers_travel_on_but_its_credential_hop_by_hop_and_routing_headers_stay_behind() {
        let mut client = HeaderMap::new();
        client.insert(header::HOST, HeaderValue::from_static("gateway:8080"));
        client.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer sk-client"));
        client.insert(inferyes_proto::headers::API_KEY, HeaderValue::from_static("ify_client"));
        client.insert(header::PROXY_AUTHORIZATION, HeaderValue::from_static("Basic cHJveHk="));
        client.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, X-Hop"));
        client.insert(HeaderName::from_static("x-hop"), HeaderValue::from_static("for the gateway only"));
        client.insert(HeaderName::from_static("keep-alive"), HeaderValue::from_static("timeout=5"));
        client.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        client.insert(header::CONTENT_LENGTH, HeaderValue::from_static("61"));
        client.insert(BACKEND_HEADER, HeaderValue::from_static("chosen-by-the-client"));
        client.insert(HeaderName::from_static("x-inferyes-anything"), HeaderValue::from_static("1"));
        client.insert(HeaderName::from_static("x-stainless-lang"), HeaderValue::from_static("python"));
        client.append(HeaderName::from_static("x-trace"), HeaderValue::from_static("a"));
        client.append(HeaderName::from_static("x-trace"), HeaderValue::from_static("b"));
        client.insert(HeaderName::from_static("x-session-id"), HeaderValue::from_static("chat-1"));

        let headers = sent(client, Some("main"), b"{}");
        for gone in [
            "authorization",
            "x-api-key",
            "proxy-authorization",
            "connection",
            "keep-alive",
            "x-hop",
            "x-inferyes-anything",
        ] {
            assert!(!headers.contains_key(gone), "{gone} stays behind");
        }
        assert_eq!(headers[header::HOST], "node-a:9100");
        assert_eq!(headers[header::CONTENT_TYPE], "application/json");
        assert_eq!(headers[header::CONTENT_LENGTH], "2", "the body's length, not the client's");
        assert_eq!(headers[BACKEND_HEADER], "main", "the route's backend, not the client's");
        assert_eq!(headers[MODEL_HEADER], "llama");
        assert_eq!(headers[SESSION_HEADER], "chat-1");
        assert_eq!(headers[REQUEST_ID], "req_1");
        assert_eq!(headers["x-stainless-lang"], "python");
        assert_eq!(headers["x-session-id"], "chat-1");
        let trace: Vec<_> = headers.get_all("x-trace").iter().collect();
        assert_eq!(trace, ["a", "b"], "every value of a header, in order");
        assert_eq!(headers.len(), 11);
    }

    #[test]
    fn cookies_an_organization_of_the_client_s_and_forged_forwarding_stay_behind() {
        let mut client = HeaderMap::new();
        for (name, value) in [
            ("cookie", "session=abc"),
            ("openai-organization", "org-someone-else"),
            ("openai-project", "proj-x"),
            ("x-forwarded-for", "10.0.0.1"),
            ("x-forwarded-host", "admin.internal"),
            ("forwarded", "for=10.0.0.1"),
            ("x-real-ip", "10.0.0.1"),
            ("cf-connecting-ip", "10.0.0.1"),
            ("via", "1.1 someone"),
            ("x-conversation-id", "someone-elses-stream"),
            ("x-stainless-lang", "python"),
            ("openai-beta", "assistants=v2"),
        ] {
            client.insert(HeaderName::from_static(name), HeaderValue::from_static(value));
        }
        let headers = sent(client, None, b"{}");
        for gone in [
            "cookie",
            "openai-organization",
            "openai-project",
            "x-forwarded-for",
            "x-forwarded-host",
            "forwarded",
            "x-real-ip",
            "cf-connecting-ip",
            "via",
            "x-conversation-id",
        ] {
            assert!(!headers.contains_key(gone), "{gone} stays behind");
        }
        assert_eq!(headers["x-stainless-lang"], "python", "the rest travel on");
        assert_eq!(headers["openai-beta"], "assistants=v2", "a feature a client asks of the API travels on");
    }

    #[test]
    fn a_backend_s_cookies_do_not_reach_the_client() {
        let mut headers = HeaderMap::new();
        headers.append(header::SET_COOKIE, HeaderValue::from_static("a=1"));
        headers.append(header::SET_COOKIE, HeaderValue::from_static("b=2"));
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(HeaderName::from_static("openai-organization"), HeaderValue::from_static("org-operator"));
        headers.insert(HeaderName::from_static("x-ratelimit-remaining-tokens"), HeaderValue::from_static("7"));
        answer_headers(&mut headers);
        assert_eq!(headers.len(), 1, "{headers:?}");
        assert_eq!(headers[header::CONTENT_TYPE], "application/json");
    }

    #[test]
    fn a_route_without_a_backend_sends_none_and_a_right_length_is_kept() {
        let mut client = HeaderMap::new();
        client.insert(header::CONTENT_LENGTH, HeaderValue::from_static("2"));
        client.insert(BACKEND_HEADER, HeaderValue::from_static("chosen-by-the-client"));
        let headers = sent(client, None, b"{}");
        assert!(!headers.contains_key(BACKEND_HEADER));
        assert_eq!(headers[header::CONTENT_LENGTH], "2");
        let headers = sent(HeaderMap::new(), None, b"{\"a\":1}");
        assert_eq!(headers[header::CONTENT_LENGTH], "7", "written where the client sent none (a chunked upload)");
        let mut client = HeaderMap::new();
        client.append(header::CONTENT_LENGTH, HeaderValue::from_static("2"));
        client.append(header::CONTENT_LENGTH, HeaderValue::from_static("2"));
        let headers = sent(client, None, b"{}");
        let lengths: Vec<_> = headers.get_all(header::CONTENT_LENGTH).iter().collect();
        assert_eq!(lengths, ["2"], "a repeated length goes on once");
    }
}
