//! A base URL (an agent's proxy, a backend) that requests are sent under,
//! read once. Every proxied request's URI is built from it, and parsing a
//! URL (and formatting a `Host` header) per request cost more than the
//! rest of the request's head.

use http::HeaderValue;
use http::uri::{Authority, PathAndQuery, Scheme, Uri};

#[derive(Clone, Debug)]
pub struct BaseUrl {
    /// As given, without a trailing slash.
    url: std::sync::Arc<str>,
    /// Scheme, authority and `Host` header, when the URL is a plain origin
    /// (no path of its own): requests are then put together from parts.
    origin: Option<(Scheme, Authority, HeaderValue)>,
}

impl BaseUrl {
    pub fn new(url: &str) -> BaseUrl {
        let url = url.trim_end_matches('/');
        let origin = url.parse::<Uri>().ok().and_then(|uri| {
            let parts = uri.into_parts();
            if parts.path_and_query.as_ref().is_some_and(|p| p.as_str() != "/") {
                return None;
            }
            let (scheme, authority) = (parts.scheme?, parts.authority?);
            // What an HTTP client would send: the port only when it is not
            // the scheme's own.
            let default_port = if scheme == Scheme::HTTPS { 443 } else { 80 };
            let host = match authority.port_u16() {
                Some(port) if port != default_port => format!("{}:{port}", authority.host()),
                _ => authority.host().to_string(),
            };
            Some((scheme, authority, HeaderValue::from_str(&host).ok()?))
        });
        BaseUrl { url: std::sync::Arc::from(url), origin }
    }

    pub fn as_str(&self) -> &str {
        &self.url
    }

    /// The URI of `path_and_query` under this URL, and the `Host` header to
    /// send with it when it is known already.
    pub fn uri(&self, path_and_query: &PathAndQuery) -> Option<(Uri, Option<HeaderValue>)> {
        match &self.origin {
            Some((scheme, authority, host)) => {
                let mut parts = http::uri::Parts::default();
                parts.scheme = Some(scheme.clone());
                parts.authority = Some(authority.clone());
                parts.path_and_query = Some(path_and_query.clone());
                Some((Uri::from_parts(parts).ok()?, Some(host.clone())))
            }
            None => Some((format!("{}{path_and_query}", self.url).parse().ok()?, None)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::BaseUrl;

    fn uri(url: &str, path: &'static str) -> (String, Option<String>) {
        let (uri, host) = BaseUrl::new(url).uri(&http::uri::PathAndQuery::from_static(path)).unwrap();
        (uri.to_string(), host.map(|h| h.to_str().unwrap().to_string()))
    }

    #[test]
    fn requests_are_built_from_parts_with_the_host_a_client_would_send() {
        let at = |uri: &str, host: &str| (uri.to_string(), Some(host.to_string()));
        assert_eq!(
            uri("http://10.0.0.7:8090/", "/v1/chat/completions"),
            at("http://10.0.0.7:8090/v1/chat/completions", "10.0.0.7:8090")
        );
        assert_eq!(uri("http://gpu-1:80", "/v1/models?x=1"), at("http://gpu-1:80/v1/models?x=1", "gpu-1"));
        assert_eq!(uri("https://gpu-1:443", "/v1/completions"), at("https://gpu-1:443/v1/completions", "gpu-1"));
        assert_eq!(uri("https://gpu-1:8443", "/v1/completions"), at("https://gpu-1:8443/v1/completions", "gpu-1:8443"));
        // A URL with a path of its own: joined as written, Host left to the client.
        assert_eq!(uri("http://lb/gpu-1/", "/v1/completions"), ("http://lb/gpu-1/v1/completions".to_string(), None));
        assert_eq!(BaseUrl::new("http://gpu-1:8090/").as_str(), "http://gpu-1:8090");
    }
}
