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
/// The longest session key a data plane passes on as the client sent it
/// (a longer one travels as a hash of itself) and an agent keeps.
pub const MAX_SESSION_KEY_BYTES: usize = 128;
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// Where Anthropic's clients send their API key; as `Authorization`, it
/// never travels past the data plane.
pub const API_KEY: HeaderName = HeaderName::from_static("x-api-key");

/// Where a data plane asks a conversation's home agent to carry its slot
/// to another node (`POST`, behind the node's credential, no body), with
/// the conversation's [`SESSION`] and where to: [`MOVE_TO`] (the node's
/// id) and [`MOVE_TO_BACKEND`]. The agent sends it only to a backend its
/// controller named (`Peers`), at the address the controller gave.
pub const CARRY_PATH: &str = "/_inferyes/slots/carry";
pub const MOVE_TO: HeaderName = HeaderName::from_static("x-inferyes-move-to");
pub const MOVE_TO_BACKEND: HeaderName = HeaderName::from_static("x-inferyes-move-to-backend");

/// Hop-by-hop headers (RFC 9110, 7.6.1): they describe one connection and
/// stop at every proxy. `Proxy-Connection` is no standard's, but older
/// clients still send it as a `Connection` meant for the proxy.
pub static HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    header::TRANSFER_ENCODING,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
];

/// The headers a message's `Connection` header names (RFC 9110, 7.6.1):
/// hop-by-hop for this message, so a proxy takes them out with
/// [`HOP_BY_HOP`]. Nothing is allocated for the usual options, `close` and
/// `keep-alive`, which name no header of their own to take out (a
/// `Keep-Alive` header is in [`HOP_BY_HOP`]).
fn connection_options(headers: &HeaderMap) -> Vec<HeaderName> {
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

/// Takes out the hop-by-hop headers, those its `Connection` header names
/// included.
pub fn remove_hop_by_hop(headers: &mut HeaderMap) {
    remove_hop_by_hop_and(headers, |_| false);
}

/// Takes out the hop-by-hop headers, those its `Connection` header names
/// included, and those `also` says stay behind, in one look at the names.
/// The map is looked into (a lookup costs a hash) only for what is there:
/// the `Connection` header when there is one, and each name to take out.
pub fn remove_hop_by_hop_and(headers: &mut HeaderMap, also: impl Fn(&HeaderName) -> bool) {
    // A bit per entry of HOP_BY_HOP, `Connection` the first.
    let mut hop_by_hop = 0u32;
    let mut others: Vec<HeaderName> = Vec::new();
    for name in headers.keys() {
        match HOP_BY_HOP.iter().position(|n| n == name) {
            Some(i) => hop_by_hop |= 1 << i,
            None if also(name) => others.push(name.clone()),
            None => {}
        }
    }
    if hop_by_hop & 1 != 0 {
        for name in connection_options(headers) {
            headers.remove(name);
        }
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if hop_by_hop & (1 << i) != 0 {
            headers.remove(name);
        }
    }
    for name in &others {
        headers.remove(name);
    }
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

    #[test]
    fn what_also_says_stays_behind_goes_too_every_value_of_it() {
        let mut headers = HeaderMap::new();
        headers.append(header::CONNECTION, HeaderValue::from_static("keep-alive"));
        headers.append(HeaderName::from_static("x-inferyes-model"), HeaderValue::from_static("m"));
        headers.append(HeaderName::from_static("x-inferyes-model"), HeaderValue::from_static("n"));
        headers.append(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        remove_hop_by_hop_and(&mut headers, |name| name.as_str().starts_with("x-inferyes-"));
        assert_eq!(headers.keys().map(HeaderName::as_str).collect::<Vec<_>>(), ["content-type"]);
        remove_hop_by_hop_and(&mut headers, |_| true);
        assert!(headers.is_empty());
    }

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_are_taken_out() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, x-hop"));
        headers.insert(HeaderName::from_static("x-hop"), HeaderValue::from_static("1"));
        headers.insert(HeaderName::from_static("keep-alive"), HeaderValue::from_static("timeout=5"));
        headers.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        headers.insert(HeaderName::from_static("proxy-connection"), HeaderValue::from_static("keep-alive"));
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(HeaderName::from_static("x-kept"), HeaderValue::from_static("1"));
        remove_hop_by_hop(&mut headers);
        let left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(left.len(), 2);
        assert!(left.contains(&"content-type") && left.contains(&"x-kept"), "{left:?}");
        // Without a Connection header, a header of the same name as an
        // option elsewhere is nobody's option.
        let mut headers = HeaderMap::new();
        headers.insert(HeaderName::from_static("x-hop"), HeaderValue::from_static("1"));
        remove_hop_by_hop(&mut headers);
        assert!(headers.contains_key("x-hop"));
    }
}
