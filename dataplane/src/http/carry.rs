//! Carrying a conversation's cache ahead of its turn: routing sent the
//! turn to a free slot on another node (`carried`) because having the
//! home's agent move the conversation's slot there costs less than reading
//! the prompt again. The home's agent is asked first. Where the carry
//! fails (the conversation's slot was reused meanwhile, say), the request
//! goes where it would have gone without carrying: home, or on to read the
//! prompt again at the first target (`moved`) where that alone was worth
//! leaving.

use std::time::Duration;

use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue};
use inferyes_proto::headers::{CARRY_PATH, MOVE_TO, MOVE_TO_BACKEND, SESSION};

use super::client::Forwarder;
use crate::routing::{Route, RouteReason};
use crate::snapshot::RoutingSnapshot;

/// Has the session's slot carried to the route's first target, when the
/// route says so; a route whose carry failed becomes what it would have
/// been without carrying.
pub(crate) async fn carry(
    forwarder: &Forwarder,
    snapshot: &RoutingSnapshot,
    route: &mut Route,
    session: Option<&str>,
    request_id: &str,
) {
    if route.reason != RouteReason::Carried {
        return;
    }
    // Past twice what routing expected and half a second, the turn's other
    // ways are sooner.
    let bound = Duration::from_millis(u64::from(route.expected_ttft_ms()).saturating_mul(2).saturating_add(500));
    let carried = match tokio::time::timeout(bound, ask(forwarder, snapshot, route, session)).await {
        Ok(carried) => carried,
        Err(_) => Err(format!("no answer within {} ms", bound.as_millis())),
    };
    if let Err(why) = carried {
        tracing::debug!(request_id, reason = %why, "conversation's cache not carried");
        route.carry_failed();
    }
}

async fn ask(
    forwarder: &Forwarder,
    snapshot: &RoutingSnapshot,
    route: &Route,
    session: Option<&str>,
) -> Result<(), String> {
    let (to, home) = match route.targets.get(..2) {
        Some([to, home]) => (*to, *home),
        _ => return Err("no home in the route".into()),
    };
    let node = |index| snapshot.node(index).ok_or("a node not in the snapshot");
    let (to_node, home_node) = (node(to.node)?, node(home.node)?);
    let to_backend = to_node.backends.get(to.backend).ok_or("a backend not in the snapshot")?;
    let home_backend = home_node.backends.get(home.backend).ok_or("a backend not in the snapshot")?;
    let value = |text: &str| HeaderValue::from_str(text).map_err(|_| "a value that cannot be a header".to_string());
    let mut headers = HeaderMap::new();
    headers.insert(SESSION, value(session.ok_or("no session")?)?);
    headers.insert(MOVE_TO, value(&to_node.id)?);
    headers.insert(MOVE_TO_BACKEND, to_backend.id_header.clone().ok_or("a backend id that cannot be a header")?);
    let path = PathAndQuery::from_static(CARRY_PATH);
    // Not counted against the home: it serves no request.
    let response = forwarder
        .send((&home_node.endpoint, home_backend.id_header.as_ref()), &path, headers, Bytes::new())
        .await
        .map_err(|e| format!("the home's agent: {e:?}"))?;
    let status = response.status();
    let answer = super::body::read_whole_within(response.into_body(), 16 << 10, None).await.unwrap_or_default();
    if !status.is_success() {
        return Err(format!("HTTP {}: {}", status.as_u16(), String::from_utf8_lossy(&answer)));
    }
    Ok(())
}
