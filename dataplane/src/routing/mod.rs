//! Which backend gets a request: a pure function of the snapshot and the
//! request's facts. No I/O, no clocks, no randomness: every data plane
//! holding the same snapshot makes the same choice for the same session.

mod hash;

use std::sync::atomic::Ordering;

use inferyes_proto::ErrorKind;
use inferyes_proto::v1::{EndpointKind, Health, ModelState};

pub use hash::{rendezvous_score, stable_hash};

use crate::snapshot::{Placement, RoutingSnapshot, Target};

/// What routing needs to know about a request.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    pub model: &'a str,
    pub kind: EndpointKind,
    pub session: Option<&'a str>,
    pub strategy: Strategy,
    /// A number that differs between consecutive requests (a counter), for
    /// strategies that rotate. Passed in so routing stays pure.
    pub ticket: u64,
}

/// How the warm nodes are ordered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// A session goes where its KV cache is, a new session to its
    /// rendezvous-hash home; requests without a session to the least loaded.
    #[default]
    SessionAffinity,
    /// Ignore sessions and load; rotate over the warm nodes. Exists to
    /// measure what affinity saves.
    RoundRobin,
}

/// Why the first target was chosen; echoed as `x-inferyes-route`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteReason {
    /// The session's KV cache is on this node.
    Resident,
    /// A new session, placed by rendezvous hashing over the warm nodes.
    Placed,
    /// No session: the least loaded warm node.
    Warm,
    /// No warm node: the model must be loaded first.
    Cold,
}

impl RouteReason {
    pub fn as_str(self) -> &'static str {
        match self {
            RouteReason::Resident => "resident",
            RouteReason::Placed => "placed",
            RouteReason::Warm => "warm",
            RouteReason::Cold => "cold",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// In order of preference; later ones are for failover.
    pub targets: Vec<Target>,
    pub reason: RouteReason,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("the model `{model}` does not exist{}", available_hint(.available))]
    ModelNotFound { model: String, available: Vec<String> },
    #[error("the model `{model}` does not serve {kind} requests")]
    NotServed { model: String, kind: &'static str },
    #[error("no node can take a request for `{model}` right now")]
    NoCapacity { model: String },
}

fn available_hint(available: &[String]) -> String {
    if available.is_empty() {
        "; the fleet has no models".into()
    } else {
        format!("; available models: {}", available.join(", "))
    }
}

impl RouteError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            RouteError::ModelNotFound { .. } => ErrorKind::NotFound,
            RouteError::NotServed { .. } => ErrorKind::BadRequest,
            RouteError::NoCapacity { .. } => ErrorKind::Overloaded,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            RouteError::ModelNotFound { .. } => "model_not_found",
            RouteError::NotServed { .. } => "unsupported_endpoint",
            RouteError::NoCapacity { .. } => "no_capacity",
        }
    }
}

/// At most this many targets are returned: the first plus failovers.
pub const MAX_TARGETS: usize = 3;

pub fn select(snapshot: &RoutingSnapshot, request: &RouteRequest<'_>) -> Result<Route, RouteError> {
    let Some(placements) = snapshot.placements(request.model) else {
        return Err(RouteError::ModelNotFound {
            model: request.model.to_string(),
            available: snapshot.catalog().iter().map(|e| e.id.clone()).collect(),
        });
    };
    let capable: Vec<&Placement> =
        placements.iter().filter(|p| p.endpoints.is_empty() || p.endpoints.contains(&request.kind)).collect();
    if capable.is_empty() {
        return Err(RouteError::NotServed { model: request.model.to_string(), kind: kind_name(request.kind) });
    }
    let admitted: Vec<&Placement> = capable.into_iter().filter(|p| admitted(snapshot, p.target)).collect();
    let (mut warm, mut cold): (Vec<&Placement>, Vec<&Placement>) =
        admitted.into_iter().partition(|p| matches!(p.state, ModelState::Loaded | ModelState::Unknown));
    if warm.is_empty() && cold.is_empty() {
        return Err(RouteError::NoCapacity { model: request.model.to_string() });
    }

    let affinity = request.strategy == Strategy::SessionAffinity;
    let resident = request
        .session
        .filter(|_| affinity)
        .and_then(|s| snapshot.resident(s))
        .filter(|t| warm.iter().any(|p| p.target == *t));

    match request.session.filter(|_| affinity) {
        // Highest rendezvous score first: every data plane agrees on it.
        Some(session) => {
            let key = stable_hash(session.as_bytes());
            warm.sort_by_cached_key(|p| {
                let node = &snapshot.nodes()[p.target.node];
                std::cmp::Reverse(rendezvous_score(key, stable_hash(node.id.as_bytes()) ^ p.target.backend as u64))
            });
        }
        None if affinity => warm.sort_by_key(|p| (load(snapshot, p.target), p.target.node, p.target.backend)),
        None => {
            warm.sort_by_key(|p| (p.target.node, p.target.backend));
            if !warm.is_empty() {
                let turn = usize::try_from(request.ticket % warm.len() as u64).unwrap_or(0);
                warm.rotate_left(turn);
            }
        }
    }
    cold.sort_by_key(|p| (std::cmp::Reverse(p.free_vram_bytes), p.target.node, p.target.backend));

    let mut targets: Vec<Target> = Vec::with_capacity(MAX_TARGETS);
    targets.extend(resident);
    for p in warm.iter().chain(cold.iter()) {
        if targets.len() == MAX_TARGETS {
            break;
        }
        if !targets.contains(&p.target) {
            targets.push(p.target);
        }
    }
    let reason = if resident.is_some() {
        RouteReason::Resident
    } else if warm.is_empty() {
        RouteReason::Cold
    } else if affinity && request.session.is_some() {
        RouteReason::Placed
    } else {
        RouteReason::Warm
    };
    Ok(Route { targets, reason })
}

fn admitted(snapshot: &RoutingSnapshot, target: Target) -> bool {
    let Some(node) = snapshot.node(target.node) else { return false };
    let Some(backend) = node.backends.get(target.backend) else { return false };
    !node.draining && backend.health == Health::Ready
}

/// Outstanding requests on a backend: what its agent last reported plus
/// what this data plane has sent since.
fn load(snapshot: &RoutingSnapshot, target: Target) -> u32 {
    let Some(node) = snapshot.node(target.node) else { return u32::MAX };
    let reported = node.backends.get(target.backend).map(|b| b.in_flight).unwrap_or(0);
    reported.saturating_add(node.local_in_flight.load(Ordering::Relaxed))
}

pub fn kind_name(kind: EndpointKind) -> &'static str {
    match kind {
        EndpointKind::Chat => "chat completion",
        EndpointKind::Completion => "completion",
        EndpointKind::Embedding => "embedding",
        EndpointKind::Rerank => "rerank",
        EndpointKind::Responses => "responses",
        EndpointKind::Unspecified => "unspecified",
    }
}

#[cfg(test)]
mod tests;
