//! The OpenAI-compatible HTTP surface. Requests are parsed only as far as
//! routing needs ([`view`]); the original bytes are what is forwarded.

mod body;
mod continuation;
mod error;
mod forward;
mod scan;
mod server;
mod sse;
mod upstream;
mod view;

pub use error::ApiError;
pub use server::{AppState, ENDPOINTS, Endpoint, Gateway, Peer, router};
pub use view::{RoutingView, parse_view, session_key};

/// A request's id as text, for log lines and records. Always the whole id:
/// the data plane takes a client's id only where it is text
/// (`server::request_id`), and makes its own of hex digits otherwise.
fn id_text(id: &http::HeaderValue) -> &str {
    id.to_str().unwrap_or_default()
}

/// Writes the low digits of `bits` into `out` as lowercase hex, the last
/// digit last: ids and keys on the request path, without the formatting
/// machinery.
fn write_hex(out: &mut [u8], mut bits: u128) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for digit in out.iter_mut().rev() {
        *digit = HEX[(bits & 0xf) as usize];
        bits >>= 4;
    }
}

/// The `Authorization` a data plane sends agents: the fleet's join token.
pub fn agent_authorization(join_token: &str) -> anyhow::Result<http::HeaderValue> {
    inferyes_proto::bearer::header_value(join_token)
        .ok_or_else(|| anyhow::anyhow!("the join token must be printable ASCII"))
}

/// The pooled client to agents, as configured. `hard_stop` ends the streams
/// still running when a shutdown's grace is over.
pub fn forward_client(
    config: &crate::Config,
    agent_authorization: Option<http::HeaderValue>,
    hard_stop: tokio_util::sync::CancellationToken,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
) -> anyhow::Result<forward::Forwarder> {
    let tls = config.tls.http_client()?;
    Ok(forward::Forwarder::new(config, tls, agent_authorization, hard_stop, metrics))
}
