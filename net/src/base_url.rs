//! A base URL (an agent's proxy, a backend) that requests are sent under,
//! read once. Every proxied request's URI is built from it, and parsing a
//! URL (and formatting a `Host` header) per request cost more than the
//! rest of the request's head.

use http::HeaderValue;
use http::uri::{Authority, PathAndQuery, Scheme, Uri};

use crate::pool::Origin;

#[derive(Clone, Debug)]
pub struct BaseUrl {
    /// As given, without a trailing slash.
    url: std::sync::Arc<str>,
    /// `None` when the URL is not an `http`/`https` URL.
    parts: Option<std::sync::Arc<Parts>>,
}

#[derive(Debug)]
struct Parts {
    scheme: Scheme,
    authority: Authority,
    /// What an HTTP client would send: the port only when it is not the
    /// scheme's own.
    host: HeaderValue,
    origin: Origin,
    /// The URL's own path, without a trailing slash; empty for a plain
    /// origin (requests then reuse their own path as it is).
    prefix: String,
}

impl BaseUrl {
    pub fn new(url: &str) -> BaseUrl {
        let url = url.trim_end_matches('/');
        let parts = url.parse::<Uri>().ok().and_then(|uri| {
            let parts = uri.into_parts();
            let (scheme, authority) = (parts.scheme?, parts.authority?);
            let origin = Origin::new(&scheme, &authority)?;
            let default_port = if scheme == Scheme::HTTPS { 443 } else { 80 };
            let host = match authority.port_u16() {
                Some(port) if port != default_port => format!("{}:{port}", authority.host()),
                _ => authority.host().to_string(),
            };
            let prefix = parts.path_and_query.map(|p| p.as_str().trim_end_matches('/').to_string()).unwrap_or_default();
            Some(std::sync::Arc::new(Parts {
                scheme,
                authority,
                host: HeaderValue::from_str(&host).ok()?,
                origin,
                prefix,
            }))
        });
        BaseUrl { url: std::sync::Arc::from(url), parts }
    }

    pub fn as_str(&self) -> &str {
        &self.url
    }

    /// Where connections for this URL go; `None` when it is not an
    /// `http`/`https` URL.
    pub fn origin(&self) -> Option<&Origin> {
        self.parts.as_ref().map(|parts| &parts.origin)
    }

    /// The URI of `path_and_query` under this URL, in absolute form, and the
    /// `Host` header to send with it.
    pub fn uri(&self, path_and_query: &PathAndQuery) -> Option<(Uri, HeaderValue)> {
        let parts = self.parts.as_ref()?;
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(parts.scheme.clone());
        uri.authority = Some(parts.authority.clone());
        uri.path_and_query = Some(parts.path(path_and_query)?);
        Some((Uri::from_parts(uri).ok()?, parts.host.clone()))
    }

    /// The same in origin form (`/v1/chat/completions`), as an HTTP/1.1
    /// request line carries it, with the `Host` header and the origin to
    /// send it to.
    pub fn origin_form(&self, path_and_query: &PathAndQuery) -> Option<(Uri, HeaderValue, &Origin)> {
        let parts = self.parts.as_ref()?;
        Some((Uri::from(parts.path(path_and_query)?), parts.host.clone(), &parts.origin))
    }
}

impl Parts {
    fn path(&self, path_and_query: &PathAndQuery) -> Option<PathAndQuery> {
        if self.prefix.is_empty() {
            return Some(path_and_query.clone());
        }
        format!("{}{path_and_query}", self.prefix).parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::BaseUrl;

    fn uri(url: &str, path: &'static str) -> (String, String) {
        let (uri, host) = BaseUrl::new(url).uri(&http::uri::PathAndQuery::from_static(path)).unwrap();
        (uri.to_string(), host.to_str().unwrap().to_string())
    }

    fn origin_form(url: &str, path: &'static str) -> (String, String, String) {
        let base = BaseUrl::new(url);
        let (uri, host, origin) = base.origin_form(&http::uri::PathAndQuery::from_static(path)).unwrap();
        (uri.to_string(), host.to_str().unwrap().to_string(), origin.as_str().to_string())
    }

    #[test]
    fn requests_are_built_from_parts_with_the_host_a_client_would_send() {
        let at = |uri: &str, host: &str| (uri.to_string(), host.to_string());
        assert_eq!(
            uri("http://10.0.0.7:8090/", "/v1/chat/completions"),
            at("http://10.0.0.7:8090/v1/chat/completions", "10.0.0.7:8090")
        );
        assert_eq!(uri("http://gpu-1:80", "/v1/models?x=1"), at("http://gpu-1:80/v1/models?x=1", "gpu-1"));
        assert_eq!(uri("https://gpu-1:443", "/v1/completions"), at("https://gpu-1:443/v1/completions", "gpu-1"));
        assert_eq!(uri("https://gpu-1:8443", "/v1/completions"), at("https://gpu-1:8443/v1/completions", "gpu-1:8443"));
        // A URL with a path of its own: joined as written.
        assert_eq!(uri("http://lb/gpu-1/", "/v1/completions"), at("http://lb/gpu-1/v1/completions", "lb"));
        assert_eq!(BaseUrl::new("http://gpu-1:8090/").as_str(), "http://gpu-1:8090");
    }

    #[test]
    fn the_request_line_carries_the_path_and_the_pool_key_names_the_port() {
        let at = |uri: &str, host: &str, origin: &str| (uri.to_string(), host.to_string(), origin.to_string());
        assert_eq!(
            origin_form("http://10.0.0.7:8090/", "/v1/chat/completions"),
            at("/v1/chat/completions", "10.0.0.7:8090", "http://10.0.0.7:8090")
        );
        assert_eq!(origin_form("http://gpu-1", "/v1/models?x=1"), at("/v1/models?x=1", "gpu-1", "http://gpu-1:80"));
        assert_eq!(origin_form("https://gpu-1", "/v1/models"), at("/v1/models", "gpu-1", "https://gpu-1:443"));
        assert_eq!(
            origin_form("http://lb:81/gpu-1/", "/v1/completions"),
            at("/gpu-1/v1/completions", "lb:81", "http://lb:81")
        );
        assert_eq!(origin_form("http://[::1]:9000", "/v1/models"), at("/v1/models", "[::1]:9000", "http://[::1]:9000"));
    }

    #[test]
    fn urls_that_are_not_http_have_no_origin() {
        for url in ["", "gpu-1:8090", "unix:///run/agent.sock", "ftp://gpu-1"] {
            assert!(BaseUrl::new(url).origin().is_none(), "{url}");
        }
    }
}
