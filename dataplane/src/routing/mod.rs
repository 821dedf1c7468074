//! Which backend gets a request: a pure function of the snapshot, this
//! data plane's own state of its nodes ([`Local`]) and the request's
//! facts. No I/O, no clocks, no randomness: data planes holding the same
//! snapshot make the same choice for a session, but where one sent its
//! latest turn and the reports do not show it yet.
//!
//! In order of preference (design §3):
//! 1. capable: serves this kind of request for this model, with a context
//!    window the prompt fits in;
//! 2. admitted: not draining, healthy, GPU memory below the node's
//!    admission threshold (a session already resident there may continue up
//!    to the hard limit);
//! 3. resident: the node holding the session's KV cache, unless a node
//!    with a free slot would give the first token sooner: each candidate's
//!    expected time to first token is its wait for a slot plus the prompt
//!    tokens not cached there over its prompt rate, so a session leaves its
//!    cache only when its wait at home is longer than a recompute of its
//!    prompt where a slot is free;
//! 4. warm: nodes with the model loaded; a new session goes to its
//!    rendezvous-hash home unless that node is over `load_bound` times the
//!    average load (resident sessions plus this data plane's requests in
//!    flight) or would make it wait where another home within the bound
//!    starts it sooner; keyless requests follow the model's strategy;
//! 5. cold: nodes that can load the model, a load already under way first,
//!    then the most free GPU memory, counting loads in progress.
//!
//! Every time weighed is a term of [`cost`]; a route keeps each of its
//! targets' terms ([`Route::weighed`]), so a decision can be read back.

use std::sync::Arc;

use inferyes_proto::ErrorKind;
use inferyes_proto::v1::{EndpointKind, ModelState, Strategy};

pub use inferyes_proto::hash::{rendezvous_score, stable_hash, text_hash, unit_interval};

use crate::error::{ApiError, ErrorCode};
use crate::snapshot::{Placement, Resident, RoutingSnapshot, Target};
use crate::targets::Local;

pub mod cost;
pub use cost::Terms;
use cost::{Cache, Estimate, Inputs, Standing};

/// What routing needs to know about a request.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// The model id, aliases already resolved.
    pub model: &'a str,
    pub kind: EndpointKind,
    pub session: Option<&'a str>,
    /// An estimate of the prompt's tokens, for the cost and to prefer the
    /// nodes whose window it fits (never to refuse); 0 when unknown.
    pub prompt_tokens: u32,
    pub mode: Mode,
    /// A session's cache may be carried from its busy home to a free slot
    /// elsewhere, where the two backends' slots are alike.
    pub carry: bool,
    /// A number that differs between consecutive requests (a counter), for
    /// strategies that rotate or sample. Passed in so routing stays pure.
    pub ticket: u64,
    /// The time, for ejections; passed in so routing stays pure.
    pub now_ms: u64,
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
    /// The session's cache is elsewhere, on a node whose queue would cost
    /// more than reading the prompt again here.
    Moved,
    /// As `Moved`, with its cache carried here from its home first: cheaper
    /// than reading the prompt again.
    Carried,
}

impl RouteReason {
    pub const ALL: [RouteReason; 6] = [
        RouteReason::Resident,
        RouteReason::Placed,
        RouteReason::Warm,
        RouteReason::Cold,
        RouteReason::Moved,
        RouteReason::Carried,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RouteReason::Resident => "resident",
            RouteReason::Placed => "placed",
            RouteReason::Warm => "warm",
            RouteReason::Cold => "cold",
            RouteReason::Moved => "moved",
            RouteReason::Carried => "carried",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// In order of preference; later ones are for failover.
    pub targets: Targets,
    pub reason: RouteReason,
    /// Which targets must load the model first, a bit each (bit 0 the
    /// first): a failover may go on to a cold node after a warm one.
    pub loads: u8,
    /// The candidates routing weighed, with their terms: the targets in
    /// order, then the session's preferred node where it passed that over.
    /// Shared, not copied: a route and the record of its request move
    /// through every phase of the request, and a few hundred bytes more
    /// in each would be copied at each.
    weighed: Arc<CandidateTerms>,
    /// The first target is warm and has no free slot: the request would
    /// wait in its server's queue (the best choice still, of the fleet as
    /// it is now).
    pub waits: bool,
    /// A `carried` route whose carry fails goes home (the second target),
    /// not on to read the prompt again at the first: only the carry made
    /// leaving worth it.
    pub home_if_not_carried: bool,
}

impl Route {
    /// Whether the first target must load the model first.
    pub fn cold(&self) -> bool {
        self.loads_at(0)
    }

    /// Whether the target tried at `attempt` must load the model first.
    pub fn loads_at(&self, attempt: usize) -> bool {
        attempt < 8 && self.loads & (1 << attempt) != 0
    }

    /// The candidates weighed and their terms: the targets in order, then
    /// the one passed over, if any.
    pub fn weighed(&self) -> impl Iterator<Item = (Target, &Terms)> {
        self.weighed.items[..self.weighed.len].iter().map(|c| (c.target, &c.terms))
    }

    /// The terms of the target tried at `attempt`.
    pub fn costs_at(&self, attempt: usize) -> Option<&Terms> {
        self.weighed.items[..self.weighed.len].get(attempt).filter(|_| attempt < self.targets.len()).map(|c| &c.terms)
    }

    /// The expected time to first token at the first target, in ms (0 for
    /// a cold load).
    pub fn expected_ttft_ms(&self) -> u32 {
        self.costs_at(0).map_or(0, |terms| terms.ttft_ms)
    }

    /// For a session sent away from its cache, the expected time to first
    /// token at the home it left (its second target), in ms; else 0.
    pub fn home_expected_ttft_ms(&self) -> u32 {
        match self.reason {
            RouteReason::Moved | RouteReason::Carried => self.costs_at(1).map_or(0, |home| home.ttft_ms),
            _ => 0,
        }
    }

    /// The route a `carried` one becomes when its carry fails: home, where
    /// only the carry made leaving worth it, else reading the prompt again
    /// at the first target.
    pub fn carry_failed(&mut self) {
        if self.home_if_not_carried && self.targets.len() >= 2 {
            self.targets.items.swap(0, 1);
            let weighed = Arc::make_mut(&mut self.weighed);
            weighed.items.swap(0, 1);
            // The node left behind reads the prompt, if it is tried at all.
            weighed.items[1].terms = weighed.uncarried;
            self.reason = RouteReason::Resident;
        } else {
            let weighed = Arc::make_mut(&mut self.weighed);
            weighed.items[0].terms = weighed.uncarried;
            self.reason = RouteReason::Moved;
        }
    }
}

/// A route's decision as a request's record keeps it: each candidate's
/// terms, in order, and what the first token was expected to cost at the
/// target that answered. Nodes are kept by key and named only when a record
/// is written: most records in a busy second are counted, not written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Weighed {
    /// At the target that answered; 0 where it is not the route's first
    /// (a failover's time is the failure's) or for a cold load.
    pub ttft_ms: u32,
    /// At the home a session was sent away from; else 0.
    pub home_ttft_ms: u32,
    candidates: Arc<CandidateTerms>,
    targets: usize,
}

impl Weighed {
    pub fn of(route: &Route) -> Weighed {
        Weighed {
            ttft_ms: route.expected_ttft_ms(),
            home_ttft_ms: route.home_expected_ttft_ms(),
            candidates: Arc::clone(&route.weighed),
            targets: route.targets.len(),
        }
    }

    /// The terms of the target tried first.
    pub fn first(&self) -> Option<&Terms> {
        self.candidates.items[..self.candidates.len.min(self.targets)].first().map(|c| &c.terms)
    }

    /// The candidates as a decision record names them, by the nodes of
    /// `snapshot` (a node gone from it meanwhile is named by nothing).
    pub fn to_wire(&self, snapshot: Option<&RoutingSnapshot>) -> Vec<inferyes_proto::v1::Candidate> {
        let candidates = &self.candidates.items[..self.candidates.len];
        let named = |c: &WeighedCandidate| {
            let node = snapshot.and_then(|s| s.node_by_key(c.node_key));
            let backend = node.and_then(|node| node.backends.get(c.target.backend));
            (node.map(|n| n.id.to_string()), backend.map(|b| b.id.to_string()))
        };
        candidates
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let (node, backend) = named(c);
                inferyes_proto::v1::Candidate {
                    passed_over: index >= self.targets,
                    ..c.terms.to_wire(node.unwrap_or_default(), backend.unwrap_or_default())
                }
            })
            .collect()
    }

    /// The same decision, as it holds where a later target answered.
    pub fn failed_over(&self) -> Weighed {
        Weighed { ttft_ms: 0, home_ttft_ms: 0, candidates: Arc::clone(&self.candidates), targets: self.targets }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("the model `{model}` does not exist{}", available_hint(.available))]
    ModelNotFound { model: String, available: Available },
    #[error("the model `{model}` does not serve {kind} requests")]
    NotServed { model: String, kind: &'static str },
    #[error("no node can take a request for `{model}` right now ({why})")]
    NoCapacity { model: String, why: &'static str },
}

/// What a model-not-found error names of the catalog.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Available {
    /// The fleet serves no model at all.
    NoneInFleet,
    /// The models the caller may use (none: it is told of none).
    Models(Vec<String>),
}

fn available_hint(available: &Available) -> String {
    match available {
        Available::NoneInFleet => "; the fleet has no models".into(),
        Available::Models(models) if models.is_empty() => String::new(),
        Available::Models(models) => format!("; available models: {}", models.join(", ")),
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

    pub fn code(&self) -> ErrorCode {
        match self {
            RouteError::ModelNotFound { .. } => ErrorCode::ModelNotFound,
            RouteError::NotServed { .. } => ErrorCode::UnsupportedEndpoint,
            RouteError::NoCapacity { .. } => ErrorCode::NoCapacity,
        }
    }
}

impl From<RouteError> for ApiError {
    fn from(error: RouteError) -> ApiError {
        let api = ApiError::new(error.kind(), error.to_string(), error.code());
        match error {
            RouteError::NoCapacity { .. } => api.retry_after(1),
            RouteError::ModelNotFound { .. } | RouteError::NotServed { .. } => api.param("model"),
        }
    }
}

/// At most this many targets are returned: the first plus failovers.
pub const MAX_TARGETS: usize = 3;
/// Candidates a decision keeps with their terms: its targets, and the
/// node it passed over.
pub const CANDIDATES: usize = MAX_TARGETS + 1;
// A route marks the targets that must load the model in a byte.
const _: () = assert!(MAX_TARGETS <= 8);

/// A route's targets, best first: at most [`MAX_TARGETS`], held inline (a
/// route is made for every request, and a `Vec` would be an allocation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Targets {
    items: [Target; MAX_TARGETS],
    len: usize,
}

impl Targets {
    /// Adds a target; past [`MAX_TARGETS`] there is no room, and it is not.
    pub fn push(&mut self, target: Target) {
        if let Some(slot) = self.items.get_mut(self.len) {
            *slot = target;
            self.len += 1;
        }
    }
}

impl std::ops::Deref for Targets {
    type Target = [Target];

    fn deref(&self) -> &[Target] {
        &self.items[..self.len]
    }
}

impl<'a> IntoIterator for &'a Targets {
    type Item = &'a Target;
    type IntoIter = std::slice::Iter<'a, Target>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl FromIterator<Target> for Targets {
    fn from_iter<I: IntoIterator<Item = Target>>(targets: I) -> Targets {
        let mut all = Targets::default();
        targets.into_iter().take(MAX_TARGETS).for_each(|target| all.push(target));
        all
    }
}

/// What a placement is to this request.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Eligibility {
    /// Holds the session's cache; allowed up to the hard limit.
    Resident,
    Warm,
    Cold,
    /// Not admitted; `memory` where for its GPU memory (said in the error).
    Unadmitted {
        memory: bool,
    },
    /// Would do, but failed recently: a last resort.
    Ejected,
}

/// The best `K` placements by a key (smallest first), without allocating.
struct Best<const K: usize> {
    items: [([u64; 3], usize); K],
    len: usize,
}

impl<const K: usize> Best<K> {
    fn new() -> Best<K> {
        Best { items: [([u64::MAX; 3], usize::MAX); K], len: 0 }
    }

    fn offer(&mut self, key: [u64; 3], index: usize) {
        let mut at = self.len;
        if at == K {
            if key >= self.items[K - 1].0 {
                return;
            }
            at = K - 1;
        } else {
            self.len += 1;
        }
        self.items[at] = (key, index);
        while at > 0 && self.items[at].0 < self.items[at - 1].0 {
            self.items.swap(at, at - 1);
            at -= 1;
        }
    }

    fn indices(&self) -> impl Iterator<Item = usize> + '_ {
        self.items[..self.len].iter().map(|(_, i)| *i)
    }
}

/// The placements as one request sees them: each with what this data
/// plane adds of its node ([`Local`]), at the request's time.
struct LocalView<'l, L> {
    local: &'l L,
    now_ms: u64,
}

impl<L: Local> LocalView<'_, L> {
    /// This data plane's requests in flight to the placement's node.
    fn in_flight(&self, p: &Placement) -> u32 {
        self.local.in_flight(p.target.node)
    }

    /// Until when the placement's node is held out of routing, if it is.
    fn ejected_until(&self, p: &Placement) -> Option<u64> {
        self.local.ejected_until(p.target.node, self.now_ms)
    }

    /// Requests in flight to the backend: as its agent last reported them, or
    /// as this data plane has them there now, whichever is more. The own count
    /// is fresh, so a burst between two reports spreads; the report holds the
    /// other data planes' requests, and the own ones it shows are not counted
    /// twice.
    fn load(&self, p: &Placement) -> u32 {
        p.reported_in_flight.max(self.in_flight(p))
    }

    /// The load a new session is balanced against: the sessions already living
    /// on the backend (each will come back), and this data plane's requests in
    /// flight there (sessions it placed that no report shows yet). Reported
    /// in-flight counts are left out on purpose: they change with every report,
    /// and a placement must not flip between a conversation's first turns or
    /// between data planes because a count moved.
    fn session_load(&self, p: &Placement) -> u32 {
        p.resident_sessions.saturating_add(self.in_flight(p))
    }

    /// Requests that must leave a slot before one more gets one on `p`
    /// ([`queue_ahead`]), with this data plane's count there now.
    fn queue_ahead(&self, p: &Placement) -> u32 {
        queue_ahead(p, self.in_flight(p))
    }

    /// Requests running on `p`'s backend now ([`running`]).
    fn running(&self, p: &Placement) -> u32 {
        running(p, self.in_flight(p))
    }

    /// Whether one more request would wait for a slot. Judged with the own
    /// count, not the last report's flag: taken from the report alone, every
    /// request until the next one would go to the nodes that looked free in
    /// it, a herd.
    fn waits(&self, p: &Placement) -> bool {
        self.queue_ahead(p) > 0
    }

    /// What a request costs on `p` ([`cost::estimate`]), the first
    /// `cached` of its `prompt` tokens taken from `cache`.
    fn inputs(&self, p: &Placement, prompt: u32, (cached, cache): (u32, Cache), leaves_home: bool) -> Inputs {
        Inputs {
            prompt_tokens: prompt,
            cached_tokens: cached,
            cache,
            queue_ahead: self.queue_ahead(p),
            slots: p.slots,
            service_seconds: p.service_seconds,
            prefill_tokens_per_second: p.prefill_tokens_per_second,
            leaves_home,
        }
    }

    fn estimate(&self, p: &Placement, prompt: u32, cached: (u32, Cache), leaves_home: bool) -> Estimate {
        cost::estimate(&self.inputs(p, prompt, cached, leaves_home))
    }

    /// `p`'s terms as a target of a route weighed with `weighing`, its
    /// session's cache `home`, reading `cached` tokens from where it says.
    fn terms(&self, p: &Placement, home: Option<Target>, weighing: &Weighing, cached: (u32, Cache)) -> Terms {
        let inputs = self.inputs(p, weighing.prompt, cached, home.is_some_and(|home| home != p.target));
        let standing = match self.class_of(p, home) {
            Eligibility::Resident => Standing::Resident,
            Eligibility::Warm => Standing::Warm,
            Eligibility::Cold => Standing::Cold,
            Eligibility::Ejected | Eligibility::Unadmitted { .. } => Standing::Ejected,
        };
        let sessions = self.session_load(p);
        Terms {
            sessions,
            over_bound: weighing.bound.is_some_and(|bound| cost::over_bound(sessions, bound)),
            memory_permille: (p.vram_fraction * 1e3).round().clamp(0.0, 1e3) as u32,
            ..Terms::of(&inputs, &cost::estimate(&inputs), standing)
        }
    }

    /// A new session's key for where it starts soonest: the requests ahead of
    /// it, 0 where it gets a slot at once (the rendezvous order decides among
    /// equals, which spreads sessions and keeps data planes agreeing). A count,
    /// not a time: a node's recent service time swings with the requests it
    /// happened to finish. Still, counts move with every report and differ
    /// between data planes, so a conversation's second turn, sent before its
    /// first one's residency is reported, may land elsewhere where its home
    /// has just begun to queue: the price of sending new sessions where they
    /// start soonest.
    fn start_key(&self, p: &Placement) -> u64 {
        u64::from(self.queue_ahead(p))
    }

    /// Memory the node can still give: total, less used and loading, less
    /// loads this data plane started.
    fn free_memory(&self, p: &Placement) -> u64 {
        p.vram_total_bytes
            .saturating_sub(p.vram_committed_bytes)
            .saturating_sub(self.local.reserved_vram_bytes(p.target.node))
    }

    /// Whether loading the model keeps the node under its admission threshold.
    /// A node without GPUs, or a model of unknown size, cannot be judged and is
    /// not refused; a node whose GPUs could not be read lately is: its memory
    /// may have filled since.
    fn fits_in_memory(&self, p: &Placement) -> bool {
        if p.vram_stale {
            return false;
        }
        if p.vram_total_bytes == 0 || p.size_bytes == 0 {
            return true;
        }
        // A load under way is counted already, in the node's committed memory.
        let loading = if p.state == ModelState::Loading { 0 } else { p.size_bytes };
        let after = p.vram_total_bytes - self.free_memory(p) + loading;
        (after as f64) < p.admission_threshold * p.vram_total_bytes as f64
    }

    fn class_of(&self, p: &Placement, home: Option<Target>) -> Eligibility {
        if !p.usable {
            return Eligibility::Unadmitted { memory: false };
        }
        if self.ejected_until(p).is_some() {
            let warm = matches!(p.state, ModelState::Loaded | ModelState::Unknown);
            return if warm && p.vram_fraction < p.hard_limit {
                Eligibility::Ejected
            } else {
                Eligibility::Unadmitted { memory: false }
            };
        }
        if p.vram_fraction >= p.hard_limit {
            return Eligibility::Unadmitted { memory: true };
        }
        let warm = matches!(p.state, ModelState::Loaded | ModelState::Unknown);
        if warm && home == Some(p.target) {
            Eligibility::Resident
        } else if p.vram_fraction >= p.admission_threshold {
            Eligibility::Unadmitted { memory: true }
        } else if warm {
            Eligibility::Warm
        } else if self.fits_in_memory(p) {
            Eligibility::Cold
        } else {
            Eligibility::Unadmitted { memory: true }
        }
    }
}

/// Where a cold load is best started, lowest first: one already under way
/// is joined; then a backend with room for one more model; then one that
/// must unload another, where no session is resident before where one is.
fn cold_rank(p: &Placement) -> u64 {
    match (p.state == ModelState::Loading, p.evicts, p.resident_sessions > 0) {
        (true, _, _) => 0,
        (false, false, _) => 1,
        (false, true, false) => 2,
        (false, true, true) => 3,
    }
}

fn place_key(p: &Placement) -> u64 {
    (p.target.node as u64) << 16 | p.target.backend as u64
}

/// The error for a model the fleet does not have, naming those it has
/// that `visible` lets the caller see: a key allowed a few models learns
/// of no others.
pub fn model_not_found(
    snapshot: &RoutingSnapshot,
    model: &str,
    visible: impl Fn(&crate::snapshot::CatalogEntry) -> bool,
) -> RouteError {
    let catalog = snapshot.catalog();
    let available = if catalog.is_empty() {
        Available::NoneInFleet
    } else {
        Available::Models(catalog.iter().filter(|e| visible(e)).map(|e| e.id.clone()).collect())
    };
    RouteError::ModelNotFound { model: model.to_string(), available }
}

/// Requests that must leave a slot on `p` before one more gets one,
/// with `own` of this data plane's in flight at its node: the backend's
/// requests, as reported less those of this data plane's that ended since,
/// or `own`, whichever is more (a burst between two reports is spread by
/// the own count, the own requests a report shows are not counted twice,
/// and a slot this data plane's request freed is free at once, not at the
/// next report). Counts that could not be read are taken for a round of
/// every slot queued: unknown, not idle. Without a slot count, the
/// server's queue.
fn queue_ahead(p: &Placement, own: u32) -> u32 {
    if p.slots == 0 {
        return if p.load_unknown { p.deferred.max(1) } else { p.deferred };
    }
    let mut occupancy = occupied(p, own);
    if p.load_unknown {
        occupancy = occupancy.max(p.slots.saturating_mul(2));
    }
    occupancy.saturating_add(1).saturating_sub(p.slots)
}

/// The requests `p`'s backend holds, as reported less those of this data
/// plane's that ended since, or `own`, whichever is more (see
/// [`queue_ahead`]).
fn occupied(p: &Placement, own: u32) -> u32 {
    let freed = p.own_in_flight_when_read.saturating_sub(own);
    p.occupancy.saturating_sub(freed).max(own)
}

/// Requests running on `p`'s backend (queued there too, where slots are
/// not counted), with `own` of this data plane's in flight at its node;
/// counts that could not be read are taken for some.
fn running(p: &Placement, own: u32) -> u32 {
    let running = occupied(p, own).min(if p.slots == 0 { u32::MAX } else { p.slots });
    if p.load_unknown { running.max(1) } else { running }
}

/// How many of this data plane's requests may be in flight at the node of
/// `route`'s first target with one more still getting a free slot there at
/// once: a request routed as not waiting takes its slot only while fewer
/// are ([`crate::targets::Endpoint::claim`]), so that two routed at the
/// same moment on two workers do not both take the last one. `None` where
/// slots are not counted (no slot count, a cold load): no slot to claim.
pub fn slot_room(snapshot: &RoutingSnapshot, model: &str, route: &Route) -> Option<u32> {
    let first = *route.targets.first()?;
    let placements = snapshot.placements(model)?;
    let at = placements.binary_search_by_key(&(first.node, first.backend), |p| (p.target.node, p.target.backend));
    let p = &placements[at.ok()?];
    if p.slots == 0 || route.cold() {
        return None;
    }
    // The own counts that leave a slot free are those below the first that
    // does not; `queue_ahead` grows with the own count, and from `slots`
    // own requests on none is free.
    let (mut low, mut high) = (0u32, p.slots);
    while low < high {
        let mid = low + (high - low) / 2;
        if queue_ahead(p, mid) == 0 {
            low = mid + 1;
        } else {
            high = mid;
        }
    }
    Some(low)
}

/// Where `session`'s cache is: where its node's agent reports it, or
/// where this data plane sent its latest turn while the reports have not
/// moved on from what they said then ([`crate::turns`]). Both at one
/// backend: the larger count of tokens, the reported one being the
/// server's own, the sent one at least the prompt that turn read.
pub fn residence(snapshot: &RoutingSnapshot, local: &impl Local, session: &str, now_ms: u64) -> Option<Resident> {
    residences(snapshot, local, session, now_ms)[0]
}

/// [`residence`], then the other of the two where they differ: a home to
/// try where the first cannot take the turn.
fn residences(snapshot: &RoutingSnapshot, local: &impl Local, session: &str, now_ms: u64) -> [Option<Resident>; 2] {
    let key = crate::snapshot::session_hash(session);
    let reported = snapshot.resident_by_hash(key);
    let Some(sent) = local.sent_turn(key, now_ms) else { return [reported, None] };
    let Some(sent_to) = snapshot.sent_to(&sent) else { return [reported, None] };
    match reported {
        Some(reported) if reported.target == sent_to.target => {
            [Some(Resident { tokens: reported.tokens.max(sent_to.tokens), ..reported }), None]
        }
        // Another data plane's turn went elsewhere since, and it is reported.
        Some(reported) if snapshot.reported(key) != sent.reported => [Some(reported), Some(sent_to)],
        Some(reported) => [Some(sent_to), Some(reported)],
        // Reported at the same node when the turn was sent, and gone from
        // there since: its server dropped it (restarted, or evicted it).
        None if sent.reported.is_some_and(|then| then.node == sent.node) => [None, None],
        None => [Some(sent_to), None],
    }
}

/// The route of `request` over `snapshot`'s nodes, as this data plane's
/// `local` state of them adds to it.
pub fn select(snapshot: &RoutingSnapshot, local: &impl Local, request: &RouteRequest<'_>) -> Result<Route, RouteError> {
    let seen = LocalView { local, now_ms: request.now_ms };
    let Some(placements) = snapshot.placements(request.model) else {
        // Routing is asked only of models the caller may use.
        return Err(model_not_found(snapshot, request.model, |_| true));
    };
    let capable = |p: &Placement| {
        (p.endpoints.is_empty() || p.endpoints.contains(&request.kind)) && !p.unsupported.contains(&request.kind)
    };
    let batch = inferyes_proto::kinds::is_batch(request.kind);
    let fits = |p: &Placement| {
        request.prompt_tokens == 0 || batch || p.context_window == 0 || p.context_window >= request.prompt_tokens
    };
    let affinity = request.mode == Mode::Policy;
    let session = request.session.filter(|_| affinity);
    let [resident, fallback] = session.map_or([None, None], |s| residences(snapshot, local, s, request.now_ms));
    let home = resident.map(|r| r.target);

    let strategy = match request.mode {
        Mode::Policy => snapshot.policy().strategy(request.model),
        Mode::RoundRobin => Strategy::RoundRobin,
        Mode::LeastOutstanding => Strategy::LeastOutstanding,
    };
    let home_at = |r: Resident| {
        let at =
            placements.binary_search_by_key(&(r.target.node, r.target.backend), |p| (p.target.node, p.target.backend));
        let at = at.ok().filter(|i| {
            let p = &placements[*i];
            capable(p) && fits(p) && seen.class_of(p, Some(r.target)) == Eligibility::Resident
        });
        at.map(|at| (at, r))
    };
    // The first home cannot take this turn (its node drains, say): the
    // other, where there is one.
    if let Some((at, resident)) = resident.and_then(home_at).or_else(|| fallback.and_then(home_at)) {
        return Ok(route_session_home(&seen, placements, at, resident, request, &capable, &fits));
    }
    let session_key = session.map(|s| stable_hash(s.as_bytes()));
    if let (Some(key), Some(ring)) = (session_key, snapshot.ring(request.model))
        && snapshot.policy().strategy(request.model) != Strategy::Weighted
        && let Some(route) = place_on_ring(&seen, snapshot, placements, ring, key, request, &capable, &fits)
    {
        return Ok(route);
    }
    let scan = Scan::of(&seen, placements, request, (&capable, &fits), home, (session_key, strategy));
    if !scan.any_capable {
        return Err(RouteError::NotServed {
            model: request.model.to_string(),
            kind: inferyes_proto::kinds::name(request.kind),
        });
    }
    if !scan.any_fitting {
        // The estimate is only that, and no request is refused for one: a
        // prompt it says fits nowhere goes where the window is largest of
        // the nodes that can take it now (else of all), and the server,
        // which counts with the model's own tokenizer, says whether it fits.
        let usable = placements
            .iter()
            .filter(|p| {
                capable(p)
                    && matches!(seen.class_of(p, home), Eligibility::Resident | Eligibility::Warm | Eligibility::Cold)
            })
            .map(|p| p.context_window)
            .max();
        let prompt_tokens = usable.unwrap_or(scan.largest_window);
        return select(snapshot, local, &RouteRequest { prompt_tokens, ..*request });
    }
    let mut scan = scan;
    let bound = session_key.map(|_| cost::load_bound(snapshot.policy().load_bound, scan.warm_load, scan.warm_count));
    if let (Some(key), Some(bound)) = (session_key, bound) {
        let warm_home = |p: &Placement| capable(p) && fits(p) && seen.class_of(p, home) == Eligibility::Warm;
        scan.rank_homes(&seen, placements, (key, bound, strategy), &warm_home);
    }
    scan.put_pair_first(&seen, placements);
    let preferred = scan.homes.indices().next().filter(|_| session_key.is_some()).map(|i| placements[i].target);
    let weighing = Weighing { bound, preferred, ..Weighing::of(request.prompt_tokens) };
    scan.route(&seen, placements, request.model, session_key.is_some(), &weighing)
}

/// What one pass over a model's placements finds: what is possible, the
/// totals the load bound needs, a session's best homes by rendezvous
/// score, and the best few keyless, cold and ejected placements.
struct Scan {
    any_capable: bool,
    any_fitting: bool,
    largest_window: u32,
    warm_count: u64,
    /// Sessions on the warm placements, resident and this data plane's in
    /// flight: the load bound's total.
    warm_load: u64,
    unadmitted_for_memory: bool,
    homes: Best<HOMES>,
    warm: Best<MAX_TARGETS>,
    cold: Best<MAX_TARGETS>,
    ejected: Best<MAX_TARGETS>,
    /// Power of two choices: the two warm placements this ticket draws
    /// (the lowest of a hash of the ticket and each one's position),
    /// whichever of all the placements are warm.
    pair: Best<2>,
}

impl Scan {
    fn of<L: Local>(
        seen: &LocalView<'_, L>,
        placements: &[Placement],
        request: &RouteRequest<'_>,
        (capable, fits): (&impl Fn(&Placement) -> bool, &impl Fn(&Placement) -> bool),
        home: Option<Target>,
        (session_key, strategy): (Option<u64>, Strategy),
    ) -> Scan {
        let n = placements.len() as u64;
        let turn = request.ticket % n.max(1);
        let mut scan = Scan {
            any_capable: false,
            any_fitting: false,
            largest_window: 0,
            warm_count: 0,
            warm_load: 0,
            unadmitted_for_memory: false,
            homes: Best::new(),
            warm: Best::new(),
            cold: Best::new(),
            ejected: Best::new(),
            pair: Best::new(),
        };
        for (i, p) in placements.iter().enumerate() {
            if !capable(p) {
                continue;
            }
            scan.any_capable = true;
            scan.largest_window = scan.largest_window.max(p.context_window);
            if !fits(p) {
                continue;
            }
            scan.any_fitting = true;
            match seen.class_of(p, home) {
                // A usable home took the early return: here it is not one.
                Eligibility::Resident | Eligibility::Warm => {
                    scan.warm_count += 1;
                    let saturated = u64::from(seen.waits(p));
                    let position = i as u64;
                    match (session_key, strategy) {
                        (Some(key), _) => {
                            scan.warm_load += u64::from(seen.session_load(p));
                            scan.homes.offer([!score(key, p, strategy), place_key(p), 0], i);
                        }
                        (None, Strategy::RoundRobin) => scan.warm.offer([saturated, (position + n - turn) % n, 0], i),
                        (None, Strategy::Weighted) => {
                            let share = (u64::from(seen.load(p)) << 32) / u64::from(p.weight.max(1));
                            scan.warm.offer([saturated, share, u64::from(u32::MAX - p.weight) << 32 | place_key(p)], i);
                        }
                        (None, Strategy::PowerOfTwo) => {
                            scan.pair.offer([draw(request.ticket, position), 0, 0], i);
                            scan.warm.offer([saturated, 1 << 32 | u64::from(seen.load(p)), position], i);
                        }
                        (None, _) => scan.warm.offer([saturated, u64::from(seen.load(p)), place_key(p)], i),
                    }
                }
                Eligibility::Cold => scan.cold.offer([cold_rank(p), !seen.free_memory(p), place_key(p)], i),
                Eligibility::Unadmitted { memory } => scan.unadmitted_for_memory |= memory,
                // The soonest back first.
                Eligibility::Ejected => scan.ejected.offer([seen.ejected_until(p).unwrap_or(0), place_key(p), 0], i),
            }
        }
        scan
    }

    /// A new session's warm targets: its best homes by score, those within
    /// the load `bound` first, those that start it at once before those
    /// that queue it, the soonest first. Where every top home is over the
    /// bound (heavy imbalance) or would queue it, every `warm_home` ranked
    /// so: another may have room.
    fn rank_homes<L: Local>(
        &mut self,
        seen: &LocalView<'_, L>,
        placements: &[Placement],
        (key, bound, strategy): (u64, f64, Strategy),
        warm_home: &impl Fn(&Placement) -> bool,
    ) {
        let over = |p: &Placement| cost::over_bound(seen.session_load(p), bound);
        for index in self.homes.indices() {
            let p = &placements[index];
            self.warm.offer([u64::from(over(p)), seen.start_key(p), homes_rank(&self.homes, index)], index);
        }
        let none_free = self.homes.indices().all(|i| over(&placements[i]) || seen.waits(&placements[i]));
        if none_free && self.warm_count > HOMES as u64 {
            self.warm = Best::new();
            for (i, p) in placements.iter().enumerate().filter(|(_, p)| warm_home(p)) {
                self.warm.offer([u64::from(over(p)), seen.start_key(p), !score(key, p, strategy)], i);
            }
        }
    }

    /// The ticket's pair first, the less loaded leading; then the least
    /// loaded of the rest.
    fn put_pair_first<L: Local>(&mut self, seen: &LocalView<'_, L>, placements: &[Placement]) {
        if self.pair.len == 0 {
            return;
        }
        let rest = std::mem::replace(&mut self.warm, Best::new());
        for i in self.pair.indices() {
            let p = &placements[i];
            self.warm.offer([u64::from(seen.waits(p)), u64::from(seen.load(p)), i as u64], i);
        }
        for i in rest.indices().filter(|i| !self.pair.indices().any(|j| j == *i)) {
            let p = &placements[i];
            self.warm.offer([u64::from(seen.waits(p)), 1 << 32 | u64::from(seen.load(p)), i as u64], i);
        }
    }

    /// The route: the warm targets, then the cold (which load the model),
    /// then the ejected, at most [`MAX_TARGETS`].
    fn route<L: Local>(
        &self,
        seen: &LocalView<'_, L>,
        placements: &[Placement],
        model: &str,
        session: bool,
        weighing: &Weighing,
    ) -> Result<Route, RouteError> {
        let mut targets = Targets::default();
        let mut loads = 0u8;
        let mut waits = false;
        let ordered = self.warm.indices().chain(self.cold.indices()).chain(self.ejected.indices());
        for index in ordered {
            if targets.len() == MAX_TARGETS {
                break;
            }
            let target = placements[index].target;
            if !targets.contains(&target) {
                if self.cold.indices().any(|i| i == index) {
                    loads |= 1 << targets.len();
                } else if targets.is_empty() {
                    waits = seen.waits(&placements[index]);
                }
                targets.push(target);
            }
        }
        if targets.is_empty() {
            let why = if self.unadmitted_for_memory {
                "GPU memory above the admission threshold, or not read lately"
            } else {
                "none is ready"
            };
            return Err(RouteError::NoCapacity { model: model.to_string(), why });
        }
        let reason = if loads & 1 != 0 {
            RouteReason::Cold
        } else if session {
            RouteReason::Placed
        } else {
            RouteReason::Warm
        };
        Ok(Route {
            targets,
            reason,
            loads,
            waits,
            home_if_not_carried: false,
            weighed: Arc::new(weighed(seen, placements, &targets, weighing)),
        })
    }
}

/// A session whose home (`placements[at]`) can take it: home, unless
/// another warm node with a free slot costs less, reading the whole prompt
/// or having the session's cache carried there (when the two backends'
/// slots are alike and that is cheaper), the gain a move must bring
/// included. A home cheaper than any other node could be
/// ([`cost::least_elsewhere`]) is kept without a scan; failovers are then
/// the next warm placements with room.
fn route_session_home<L: Local>(
    seen: &LocalView<'_, L>,
    placements: &[Placement],
    at: usize,
    resident: Resident,
    request: &RouteRequest<'_>,
    capable: &impl Fn(&Placement) -> bool,
    fits: &impl Fn(&Placement) -> bool,
) -> Route {
    let home = &placements[at];
    // A later turn's prompt holds at least what its cache holds.
    let prompt = request.prompt_tokens.max(resident.tokens);
    let at_home = seen.estimate(home, prompt, (resident.tokens, Cache::Resident), false).seconds();
    let alternative =
        |p: &Placement| capable(p) && fits(p) && seen.class_of(p, Some(resident.target)) == Eligibility::Warm;
    let after = || placements[at + 1..].iter().chain(&placements[..at]);
    let mut targets = Targets::default();
    let carries = request.carry && home.slot_group != 0;
    let weighing = Weighing { resident: Some(resident), ..Weighing::of(prompt) };
    // What a free slot costs the session at `p`, and whether carrying its
    // cache there is what makes it so. Not to another backend of the home's
    // node: its agent carries slots to other nodes only.
    // A recompute only where nothing else runs: where slots share a
    // processor (a CPU, a compute-bound GPU), a prompt read beside other
    // requests is read slower than the node's prompt rate, and slows them.
    // On the real-model benchmark under load, each such move read its
    // prompt two to ten times slower than expected and lost the cache it
    // left; a carried cache leaves little to read, and takes a free slot.
    let recomputes = |p: &Placement| seen.running(p) == 0;
    let cost = |p: &Placement| {
        let recompute = seen.estimate(p, prompt, (0, Cache::None), true).seconds();
        let recompute = if recomputes(p) { recompute } else { f64::MAX };
        if carries && p.slot_group == home.slot_group && p.target.node != home.target.node {
            let carried = seen.estimate(p, prompt, (resident.tokens, Cache::Carried), true).seconds();
            if carried < recompute {
                return (carried, true);
            }
        }
        (recompute, false)
    };
    if at_home > cost::least_elsewhere(prompt, resident.tokens, home.fastest_prefill_tokens_per_second, carries) {
        // Only a free slot is worth a recompute: into a queue, the mover's
        // prompt is slot time taken from requests that would have had it
        // (and where slots share a processor, from every request running
        // there), so the fleet loses what the mover gains; and two queues'
        // waits are estimated too roughly to trade one for the other
        // without flapping. Ordered by cost, microseconds; the placement
        // breaks ties.
        let mut best: Best<2> = Best::new();
        for (i, p) in placements.iter().enumerate().filter(|(_, p)| alternative(p) && !seen.waits(p)) {
            let (cost, _) = cost(p);
            if cost < f64::MAX {
                best.offer([(cost * 1e6) as u64, place_key(p), 0], i);
            }
        }
        if let Some(&(_, moved)) = best.items[..best.len].first().filter(|(key, _)| (key[0] as f64) < at_home * 1e6) {
            let (_, carried) = cost(&placements[moved]);
            targets.push(placements[moved].target);
            targets.push(home.target);
            best.indices().skip(1).for_each(|i| targets.push(placements[i].target));
            let recompute = match recomputes(&placements[moved]) {
                true => seen.estimate(&placements[moved], prompt, (0, Cache::None), true).seconds(),
                false => f64::MAX,
            };
            let carried_to = carried.then_some(placements[moved].target);
            let uncarried = seen.terms(&placements[moved], Some(resident.target), &weighing, (0, Cache::None));
            return Route {
                targets,
                reason: if carried { RouteReason::Carried } else { RouteReason::Moved },
                loads: 0,
                weighed: Arc::new(CandidateTerms {
                    uncarried,
                    ..weighed(seen, placements, &targets, &Weighing { carried_to, ..weighing })
                }),
                waits: false,
                home_if_not_carried: carried && recompute >= at_home,
            };
        }
    }
    targets.push(home.target);
    // Failovers: those with room, then the least queued: a queue behind a
    // home that failed is still better than an error.
    for p in after().filter(|p| alternative(p) && !seen.waits(p)) {
        if targets.len() == MAX_TARGETS {
            break;
        }
        targets.push(p.target);
    }
    let mut queued: Best<MAX_TARGETS> = Best::new();
    for (i, p) in placements.iter().enumerate().filter(|(i, p)| *i != at && alternative(p) && seen.waits(p)) {
        queued.offer([u64::from(seen.load(p)), place_key(p), 0], i);
    }
    for i in queued.indices() {
        if targets.len() == MAX_TARGETS {
            break;
        }
        targets.push(placements[i].target);
    }
    Route {
        targets,
        reason: RouteReason::Resident,
        loads: 0,
        waits: seen.waits(home),
        home_if_not_carried: false,
        weighed: Arc::new(weighed(seen, placements, &targets, &weighing)),
    }
}

/// What a route's targets are weighed with, besides the fleet: the prompt,
/// the session's cache and where it is carried, the load bound a new
/// session is held to, and the node it would have by rendezvous hash.
#[derive(Clone, Copy)]
struct Weighing {
    prompt: u32,
    resident: Option<Resident>,
    carried_to: Option<Target>,
    bound: Option<f64>,
    preferred: Option<Target>,
}

impl Weighing {
    fn of(prompt: u32) -> Weighing {
        Weighing { prompt, resident: None, carried_to: None, bound: None, preferred: None }
    }
}

/// A route's candidates with their terms, inline (made for every request).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct CandidateTerms {
    items: [WeighedCandidate; CANDIDATES],
    len: usize,
    /// For a `carried` route, the first target's terms without the carry:
    /// what they become if the carry fails.
    uncarried: Terms,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct WeighedCandidate {
    target: Target,
    /// Its node's key, which names it in any snapshot: a target's node
    /// index holds only in the snapshot routed on.
    node_key: u64,
    terms: Terms,
}

/// `targets`' terms, in their order, then the preferred node's where it
/// is not one of them.
fn weighed<L: Local>(
    seen: &LocalView<'_, L>,
    placements: &[Placement],
    targets: &Targets,
    weighing: &Weighing,
) -> CandidateTerms {
    let mut candidates = CandidateTerms::default();
    let passed_over = weighing.preferred.filter(|preferred| !targets.contains(preferred));
    for target in targets.iter().chain(passed_over.as_ref()) {
        let key = (target.node, target.backend);
        let Ok(at) = placements.binary_search_by_key(&key, |p| (p.target.node, p.target.backend)) else { continue };
        let cached = match weighing.resident {
            Some(resident) if resident.target == *target => (resident.tokens, Cache::Resident),
            Some(resident) if weighing.carried_to == Some(*target) => (resident.tokens, Cache::Carried),
            _ => (0, Cache::None),
        };
        let p = &placements[at];
        let terms = seen.terms(p, weighing.resident.map(|r| r.target), weighing, cached);
        let terms = Terms { preferred: weighing.preferred == Some(*target), ..terms };
        candidates.items[candidates.len] = WeighedCandidate { target: *target, node_key: p.node_key, terms };
        candidates.len += 1;
    }
    candidates
}

/// How many of a session's best-scoring homes are kept while scanning; the
/// load bound is applied to them once the totals are known.
const HOMES: usize = 8;

/// The position of `index` among the kept homes (they are sorted by score).
fn homes_rank(homes: &Best<HOMES>, index: usize) -> u64 {
    homes.indices().position(|i| i == index).unwrap_or(HOMES) as u64
}

/// A placement's rendezvous score for a session key: the highest wins.
/// Under `Weighted`, weighted rendezvous (-w / ln u) gives each backend a
/// share in proportion to its weight; positive floats order like their bits.
fn score(key: u64, p: &Placement, strategy: Strategy) -> u64 {
    let raw = rendezvous_score(key, p.node_key ^ p.target.backend as u64);
    if strategy == Strategy::Weighted { (-f64::from(p.weight) / unit_interval(raw).ln()).to_bits() } else { raw }
}

/// A new session of a model on many nodes: walk the ring from the session's
/// point, keep the first few distinct warm placements, and take the first
/// within the load bound (computed from the totals built at decode). `None`
/// when the walk finds nothing usable: the full scan decides then.
#[allow(clippy::too_many_arguments)]
fn place_on_ring<L: Local>(
    seen: &LocalView<'_, L>,
    snapshot: &RoutingSnapshot,
    placements: &[Placement],
    ring: &crate::snapshot::Ring,
    key: u64,
    request: &RouteRequest<'_>,
    capable: &impl Fn(&Placement) -> bool,
    fits: &impl Fn(&Placement) -> bool,
) -> Option<Route> {
    const WALK: usize = 8 * crate::snapshot::RING_POINTS as usize;
    let bound = cost::load_bound(snapshot.policy().load_bound, ring.resident_sessions, ring.ready_placements);
    let start = ring.points.partition_point(|(point, _)| *point < key);
    // The first few placements met, not judged again at their other points
    // (past those, a placement may be judged twice: the homes are checked).
    let mut met: [u32; HOMES] = [u32::MAX; HOMES];
    let mut homes: Vec<usize> = Vec::with_capacity(HOMES);
    for step in 0..WALK.min(ring.points.len()) {
        let (_, index) = ring.points[(start + step) % ring.points.len()];
        if met.contains(&index) {
            continue;
        }
        if let Some(free) = met.iter_mut().find(|s| **s == u32::MAX) {
            *free = index;
        }
        let index = index as usize;
        if homes.contains(&index) {
            continue;
        }
        let p = &placements[index];
        if capable(p) && fits(p) && seen.class_of(p, None) == Eligibility::Warm {
            homes.push(index);
            if homes.len() == HOMES {
                break;
            }
        }
    }
    let over = |p: &Placement| cost::over_bound(seen.session_load(p), bound);
    // None within the bound with room: the full scan looks further.
    if homes.iter().all(|i| over(&placements[*i]) || seen.waits(&placements[*i])) {
        return None;
    }
    let first_met = homes[0];
    // Within the bound first, then those that start it at once (in ring
    // order), then the soonest.
    homes.sort_by_key(|i| (over(&placements[*i]), seen.start_key(&placements[*i])));
    let targets: Targets = homes.iter().map(|i| placements[*i].target).collect();
    let preferred = Some(placements[first_met].target);
    let weighing = Weighing { bound: Some(bound), preferred, ..Weighing::of(request.prompt_tokens) };
    Some(Route {
        targets,
        reason: RouteReason::Placed,
        loads: 0,
        waits: seen.waits(&placements[homes[0]]),
        home_if_not_carried: false,
        weighed: Arc::new(weighed(seen, placements, &targets, &weighing)),
    })
}

/// A placement's draw for a ticket: the two lowest among the warm ones are
/// the ticket's pair, any two as likely as any other.
fn draw(ticket: u64, position: u64) -> u64 {
    stable_hash(&(ticket ^ position.rotate_left(32)).to_le_bytes())
}

#[cfg(test)]
mod tests;
