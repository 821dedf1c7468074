//! Which backend gets a request: a pure function of the snapshot and the
//! request's facts. No I/O, no clocks, no randomness: every data plane
//! holding the same snapshot makes the same choice for the same session.
//!
//! In order of preference (design §3):
//! 1. capable: serves this kind of request for this model, with a context
//!    window the prompt fits in;
//! 2. admitted: not draining, healthy, GPU memory below the node's
//!    admission threshold (a session already resident there may continue up
//!    to the hard limit);
//! 3. resident: the node holding the session's KV cache, unless saturated;
//! 4. warm: nodes with the model loaded; a new session goes to its
//!    rendezvous-hash home unless that node is over `load_bound` times the
//!    average load; keyless requests follow the model's strategy;
//! 5. cold: nodes that can load the model, a load already under way first,
//!    then the most free GPU memory, counting loads in progress.

mod hash;

use std::cmp::Reverse;
use std::sync::atomic::Ordering;

use inferyes_proto::ErrorKind;
use inferyes_proto::v1::{EndpointKind, Health, ModelState, Strategy};

pub use hash::{rendezvous_score, stable_hash, unit_interval};

use crate::snapshot::{Node, Placement, RoutingSnapshot, Target};

/// What routing needs to know about a request.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// The model id, aliases already resolved.
    pub model: &'a str,
    pub kind: EndpointKind,
    pub session: Option<&'a str>,
    /// A low estimate of the prompt's tokens; 0 when unknown.
    pub prompt_tokens: u32,
    pub mode: Mode,
    /// A number that differs between consecutive requests (a counter), for
    /// strategies that rotate or sample. Passed in so routing stays pure.
    pub ticket: u64,
}

/// The product's policy, or a baseline that ignores sessions (to measure
/// what affinity saves).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    #[default]
    Policy,
    RoundRobin,
    LeastOutstanding,
}

/// Why the first target was chosen; echoed as `x-inferyes-route`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteReason {
    /// The session's KV cache is on this node.
    Resident,
    /// A new session, placed by rendezvous hashing over the warm nodes.
    Placed,
    /// No session: a warm node by the model's strategy.
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
    /// Whether the first target must load the model first.
    pub cold: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("the model `{model}` does not exist{}", available_hint(.available))]
    ModelNotFound { model: String, available: Vec<String> },
    #[error("the model `{model}` does not serve {kind} requests")]
    NotServed { model: String, kind: &'static str },
    #[error(
        "the prompt (about {prompt_tokens} tokens) does not fit the context window of `{model}` \
         (at most {largest_window} tokens on any node)"
    )]
    ContextTooLong { model: String, prompt_tokens: u32, largest_window: u32 },
    #[error("no node can take a request for `{model}` right now ({why})")]
    NoCapacity { model: String, why: &'static str },
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
            RouteError::NotServed { .. } | RouteError::ContextTooLong { .. } => ErrorKind::BadRequest,
            RouteError::NoCapacity { .. } => ErrorKind::Overloaded,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            RouteError::ModelNotFound { .. } => "model_not_found",
            RouteError::NotServed { .. } => "unsupported_endpoint",
            RouteError::ContextTooLong { .. } => "context_length_exceeded",
            RouteError::NoCapacity { .. } => "no_capacity",
        }
    }
}

/// At most this many targets are returned: the first plus failovers.
pub const MAX_TARGETS: usize = 3;

/// One usable placement with what ordering needs.
#[derive(Clone, Copy)]
struct Candidate<'a> {
    placement: &'a Placement,
    node: &'a Node,
    load: u32,
    saturated: bool,
    weight: u32,
}

impl Candidate<'_> {
    fn target(&self) -> Target {
        self.placement.target
    }
}

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
    let fits = |p: &&Placement| {
        request.prompt_tokens == 0 || p.context_window == 0 || p.context_window >= request.prompt_tokens
    };
    let fitting: Vec<&Placement> = capable.iter().copied().filter(fits).collect();
    if fitting.is_empty() {
        return Err(RouteError::ContextTooLong {
            model: request.model.to_string(),
            prompt_tokens: request.prompt_tokens,
            largest_window: capable.iter().map(|p| p.context_window).max().unwrap_or(0),
        });
    }

    let affinity = request.mode == Mode::Policy;
    let home = request.session.filter(|_| affinity).and_then(|s| snapshot.resident(s));
    let mut resident: Option<Candidate<'_>> = None;
    let mut warm: Vec<Candidate<'_>> = Vec::new();
    let mut cold: Vec<Candidate<'_>> = Vec::new();
    let mut refused_for_memory = false;
    for placement in fitting {
        let Some(candidate) = candidate(snapshot, placement) else { continue };
        let node = candidate.node;
        if node.draining || node.vram_fraction >= node.hard_limit {
            refused_for_memory |= !node.draining;
            continue;
        }
        let is_warm = matches!(placement.state, ModelState::Loaded | ModelState::Unknown);
        if is_warm && home == Some(placement.target) {
            // Resident sessions continue up to the hard limit.
            resident = Some(candidate);
        } else if node.vram_fraction >= node.admission_threshold {
            refused_for_memory = true;
        } else if is_warm {
            warm.push(candidate);
        } else if fits_in_memory(&candidate) {
            cold.push(candidate);
        } else {
            refused_for_memory = true;
        }
    }

    let strategy = snapshot.policy().strategy(request.model);
    match (request.mode, request.session.filter(|_| affinity)) {
        (Mode::Policy, Some(session)) => place(&mut warm, session, strategy, snapshot.policy().load_bound),
        (Mode::Policy, None) => order_keyless(&mut warm, strategy, request.ticket),
        (Mode::RoundRobin, _) => order_keyless(&mut warm, Strategy::RoundRobin, request.ticket),
        (Mode::LeastOutstanding, _) => order_keyless(&mut warm, Strategy::LeastOutstanding, request.ticket),
    }
    // A load already under way is joined before a new one is started.
    cold.sort_by_key(|c| {
        (c.placement.state != ModelState::Loading, Reverse(free_memory(c.node)), c.target().node, c.target().backend)
    });

    let resident_first = resident.filter(|r| !r.saturated);
    let mut targets: Vec<Target> = Vec::with_capacity(MAX_TARGETS);
    let ordered = resident_first.iter().chain(&warm).chain(resident.iter()).chain(&cold);
    for candidate in ordered {
        if targets.len() == MAX_TARGETS {
            break;
        }
        if !targets.contains(&candidate.target()) {
            targets.push(candidate.target());
        }
    }
    let Some(first) = targets.first() else {
        let why = if refused_for_memory { "GPU memory above the admission threshold" } else { "none is ready" };
        return Err(RouteError::NoCapacity { model: request.model.to_string(), why });
    };
    let cold_first = cold.iter().any(|c| c.target() == *first);
    let reason = if resident.is_some_and(|r| r.target() == *first) {
        RouteReason::Resident
    } else if cold_first {
        RouteReason::Cold
    } else if affinity && request.session.is_some() {
        RouteReason::Placed
    } else {
        RouteReason::Warm
    };
    Ok(Route { targets, reason, cold: cold_first })
}

fn candidate<'a>(snapshot: &'a RoutingSnapshot, placement: &'a Placement) -> Option<Candidate<'a>> {
    let node = snapshot.node(placement.target.node)?;
    let backend = node.backends.get(placement.target.backend)?;
    if backend.health != Health::Ready {
        return None;
    }
    // What its agent last reported, plus what this data plane sent since.
    let load = backend.in_flight.saturating_add(node.local.in_flight.load(Ordering::Relaxed));
    Some(Candidate { placement, node, load, saturated: backend.saturated(), weight: backend.weight.max(1) })
}

/// Memory the node can still give: total, less what is used, less models
/// loading and loads this data plane started.
fn free_memory(node: &Node) -> u64 {
    node.vram_total_bytes
        .saturating_sub(node.vram_used_bytes)
        .saturating_sub(node.vram_loading_bytes)
        .saturating_sub(node.local.reserved_vram_bytes.load(Ordering::Relaxed))
}

/// Whether loading the model keeps the node under its admission threshold.
/// A node without GPU readings, or a model of unknown size, cannot be
/// judged and is not refused.
fn fits_in_memory(candidate: &Candidate<'_>) -> bool {
    let node = candidate.node;
    if node.vram_total_bytes == 0 || candidate.placement.size_bytes == 0 {
        return true;
    }
    let after = node.vram_total_bytes - free_memory(node) + candidate.placement.size_bytes;
    (after as f64) < node.admission_threshold * node.vram_total_bytes as f64
}

/// New sessions: rendezvous order (weighted by the backends' weights under
/// `Weighted`), skipping homes that are saturated or over `load_bound`
/// times the average load; they stay as failovers.
fn place(warm: &mut [Candidate<'_>], session: &str, strategy: Strategy, load_bound: f64) {
    if warm.is_empty() {
        return;
    }
    let key = stable_hash(session.as_bytes());
    let score = |c: &Candidate<'_>| {
        let node_key = stable_hash(c.node.id.as_bytes()) ^ c.target().backend as u64;
        let raw = rendezvous_score(key, node_key);
        if strategy == Strategy::Weighted {
            // Weighted rendezvous: -w / ln(u) keeps each node's share
            // proportional to its weight.
            -f64::from(c.weight) / unit_interval(raw).ln()
        } else {
            raw as f64
        }
    };
    warm.sort_by(|a, b| score(b).total_cmp(&score(a)).then(a.target().node.cmp(&b.target().node)));
    let total: u64 = warm.iter().map(|c| u64::from(c.load)).sum();
    let bound = (load_bound * (total + 1) as f64 / warm.len() as f64).ceil();
    // Stable: eligible homes first, in rendezvous order, then the rest.
    warm.sort_by_key(|c| c.saturated || f64::from(c.load) + 1.0 > bound);
}

/// Requests without a session, by the model's strategy; saturated
/// backends last whatever the strategy.
fn order_keyless(warm: &mut [Candidate<'_>], strategy: Strategy, ticket: u64) {
    let by_place = |c: &Candidate<'_>| (c.target().node, c.target().backend);
    match strategy {
        Strategy::RoundRobin => {
            warm.sort_by_key(by_place);
            if !warm.is_empty() {
                let turn = usize::try_from(ticket % warm.len() as u64).unwrap_or(0);
                warm.rotate_left(turn);
            }
        }
        Strategy::Weighted => warm.sort_by(|a, b| {
            let share = |c: &Candidate<'_>| f64::from(c.load) / f64::from(c.weight);
            share(a).total_cmp(&share(b)).then(b.weight.cmp(&a.weight)).then(by_place(a).cmp(&by_place(b)))
        }),
        Strategy::PowerOfTwo if warm.len() > 2 => {
            // Two choices drawn from the ticket, the less loaded first.
            warm.sort_by_key(by_place);
            let n = warm.len() as u64;
            let first = usize::try_from(stable_hash(&ticket.to_le_bytes()) % n).unwrap_or(0);
            let mut second = usize::try_from(stable_hash(&(!ticket).to_le_bytes()) % (n - 1)).unwrap_or(0);
            if second >= first {
                second += 1;
            }
            let (best, other) = if warm[second].load < warm[first].load { (second, first) } else { (first, second) };
            let rank = |i: usize| {
                if i == best {
                    0
                } else if i == other {
                    1
                } else {
                    2
                }
            };
            let mut indexed: Vec<(usize, Candidate<'_>)> = warm.iter().copied().enumerate().collect();
            indexed.sort_by_key(|(i, c)| (rank(*i), c.load, by_place(c)));
            for (slot, (_, c)) in warm.iter_mut().zip(indexed) {
                *slot = c;
            }
        }
        Strategy::LeastOutstanding | Strategy::PowerOfTwo | Strategy::Unspecified => {
            warm.sort_by_key(|c| (c.load, by_place(c)));
        }
    }
    warm.sort_by_key(|c| c.saturated);
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
