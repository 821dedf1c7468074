//! Header names the data plane and the agent share: what the data plane
//! tells an agent about a request, and what no proxy passes on.

use http::HeaderName;
use http::header;

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
