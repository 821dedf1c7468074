//! Header names the data plane and the agent share: what the data plane
//! tells an agent about a request, and what no proxy passes on.

use http::header;
use http::{HeaderMap, HeaderName};

/// The backend on the node the data plane chose.
pub const BACKEND: HeaderName = HeaderName::from_static("x-inferyes-backend");
/// The model the request was routed for (an alias resolved).
pub const MODEL: HeaderName = HeaderName::from_static("x-inferyes-model");
/// The request's session key, for the agent's residency.
pub const SESSION: HeaderName = HeaderName::from_static("x-inferyes-session");
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Hop-by-hop headers (RFC 9110, 7.6.1): they describe one connection and
/// stop at every proxy.
pub const HOP_BY_HOP: [HeaderName; 6] = [
    header::CONNECTION,
    header::TRANSFER_ENCODING,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
    HeaderName::from_static("keep-alive"),
];

/// The headers a message's `Connection` header names (RFC 9110, 7.6.1):
/// hop-by-hop for this message, so a proxy takes them out with
/// [`HOP_BY_HOP`]. Nothing is allocated for the usual options, `close` and
/// `keep-alive`, which name no header of their own to take out (a
/// `Keep-Alive` header is in [`HOP_BY_HOP`]).
pub fn connection_options(headers: &HeaderMap) -> Vec<HeaderName> {
    let mut names = Vec::new();
    for value in headers.get_all(header::CONNECTION) {
        let Ok(value) = value.to_str() else { continue };
        for option in value.split(',').map(str::trim) {
            if option.is_empty() || option.eq_ignore_ascii_case("close") || option.eq_ignore_ascii_case("keep-alive") {
                continue;
            }
            if let Ok(name) = HeaderName::from_bytes(option.as_bytes()) {
                names.push(name);
            }
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn the_headers_a_connection_header_names_are_its_options_but_close_and_keep_alive() {
        let mut headers = HeaderMap::new();
        assert!(connection_options(&headers).is_empty());
        headers.append(header::CONNECTION, HeaderValue::from_static("keep-alive"));
        headers.append(header::CONNECTION, HeaderValue::from_static("Close"));
        assert!(connection_options(&headers).is_empty(), "the usual options name no header");
        headers.append(header::CONNECTION, HeaderValue::from_static(" X-Hop ,, x-other,keep-alive"));
        headers.append(header::CONNECTION, HeaderValue::from_static("bad header, te"));
        let names: Vec<String> = connection_options(&headers).iter().map(ToString::to_string).collect();
        assert_eq!(names, ["x-hop", "x-other", "te"], "every Connection header, names lowercased, bad tokens skipped");
    }
}
