//! The data plane's routing snapshot: decoded once per update into the
//! indices routing needs, then shared immutably by every request.

mod client;
mod decode;
mod live;
mod store;

pub use client::run as subscribe;
pub use decode::{decode, decode_live};
pub use live::{Live, SessionIndex};
pub use store::SnapshotStore;

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::Arc;

use inferyes_proto::FastMap;
use inferyes_proto::hash::Prehashed;
use inferyes_proto::v1::{EndpointKind, Health, ModelState, Strategy};

/// An immutable routing snapshot: the routing indices, and the fleet's API
/// keys with their usage today. Built by [`decode`].
///
/// The indices are shared (`Arc`) between snapshots that differ only in
/// keys and usage: every usage roll-up changes those, once a second or so
/// from each data plane, and decoding a 1,000-node fleet again for each
/// would cost every data plane milliseconds of a core.
#[derive(Debug, Default)]
pub struct RoutingSnapshot {
    pub(crate) version: u64,
    pub(crate) indices: Arc<Indices>,
    /// API keys by id, shared between snapshots until a key changes.
    pub(crate) api_keys: Arc<ApiKeys>,
    /// Tokens each key used today, as the ledger's roll-up says.
    pub(crate) usage_today: Arc<inferyes_proto::v1::KeyUsageToday>,
    /// Where sessions are resident: one index, shared by every snapshot
    /// and kept current by the subscription.
    pub(crate) sessions: Arc<SessionIndex>,
}

/// What routing reads, decoded from the fleet's nodes, policy and aliases.
/// A snapshot's fields read through to these.
#[derive(Debug, Default)]
pub struct Indices {
    pub(crate) nodes: Vec<Node>,
    /// Model id → every backend that lists it, sorted by (node, backend):
    /// routing finds a session's home by binary search.
    pub(crate) models: FastMap<String, Vec<Placement>>,
    /// For models on many nodes: a consistent-hash ring over their
    /// placements and the totals the load bound needs, so placing a new
    /// session walks a few ring positions instead of scoring every node.
    pub(crate) rings: FastMap<String, Ring>,
    /// The fleet's catalog, models and aliases, sorted by id.
    pub(crate) catalog: Vec<CatalogEntry>,
    /// Alias → model id.
    pub(crate) aliases: FastMap<String, String>,
    /// Node key (`stable_hash(node_id)`) → its index in `nodes`: resident
    /// sessions name their node by key.
    pub(crate) node_index: HashMap<u64, usize, BuildHasherDefault<Prehashed>>,
    pub(crate) policy: Policy,
    /// This data plane's state of the nodes, in the order of `nodes`:
    /// what routing reads besides the snapshot (see [`crate::targets`]).
    pub(crate) local: crate::targets::View,
}

impl std::ops::Deref for RoutingSnapshot {
    type Target = Indices;

    fn deref(&self) -> &Indices {
        &self.indices
    }
}

/// Where a session's KV cache is, and how much of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resident {
    pub target: Target,
    /// Tokens the cache holds: the part of the next prompt not read again.
    pub tokens: u32,
    /// When the session was last used there: settles a session two nodes
    /// report (it moved; the old node has not evicted it yet).
    pub last_seen_unix_ms: u64,
}

/// API keys by key id, hashes included.
pub type ApiKeys = FastMap<String, Arc<inferyes_proto::v1::ApiKey>>;

/// A model's placements on a hash ring, built at decode.
#[derive(Debug, Default)]
pub struct Ring {
    /// (point, placement index), sorted by point.
    pub points: Vec<(u64, u32)>,
    /// Sessions resident on the model's ready placements, and how many
    /// there are: the average for the load bound.
    pub resident_sessions: u64,
    pub ready_placements: u64,
}

/// Models on fewer placements are placed by scoring every one (rendezvous),
/// which is exact and cheap at that size.
pub const RING_MIN_PLACEMENTS: usize = 64;
/// Points per placement: enough for an even spread.
pub const RING_POINTS: u64 = 16;

/// The fleet's routing policy with every default filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    pub admission_threshold: f64,
    pub hard_limit: f64,
    pub load_bound: f64,
    pub default_strategy: Strategy,
    pub model_strategies: FastMap<String, Strategy>,
    /// Mid-stream continuation for every model, or for these.
    pub continue_all: bool,
    pub continue_models: Vec<String>,
}

impl Default for Policy {
    fn default() -> Policy {
        Policy {
            admission_threshold: inferyes_proto::DEFAULT_ADMISSION_THRESHOLD,
            hard_limit: inferyes_proto::DEFAULT_HARD_LIMIT,
            load_bound: 1.25,
            default_strategy: Strategy::LeastOutstanding,
            model_strategies: FastMap::default(),
            continue_all: false,
            continue_models: Vec::new(),
        }
    }
}

impl Policy {
    pub fn strategy(&self, model: &str) -> Strategy {
        self.model_strategies.get(model).copied().unwrap_or(self.default_strategy)
    }

    /// Whether a broken stream of `model` is resumed on another node.
    pub fn continues(&self, model: &str) -> bool {
        self.continue_all || self.continue_models.iter().any(|m| m == model)
    }
}

#[derive(Debug)]
pub struct Node {
    pub id: Arc<str>,
    /// `stable_hash(id)`, computed once: rendezvous placement scores every
    /// node for every new session.
    pub key: u64,
    /// Where requests for the node go, and this data plane's state of it.
    pub endpoint: Arc<crate::targets::Endpoint>,
    pub draining: bool,
    pub backends: Vec<BackendView>,
    /// A backend's place in the node's live load → its index in
    /// `backends`: resident sessions name it by the first, which may differ
    /// while a new list of backends travels (`u32::MAX`: not in the record).
    pub backend_of_load: Vec<u32>,
    /// The fullest GPU's used memory as a fraction of its total; 0 on a node
    /// without GPUs.
    pub vram_fraction: f64,
    pub vram_total_bytes: u64,
    pub vram_used_bytes: u64,
    /// Models loading on the node right now: memory they will take that the
    /// GPU readings may not show yet.
    pub vram_loading_bytes: u64,
    /// This node's thresholds: its own override, else the fleet's.
    pub admission_threshold: f64,
    pub hard_limit: f64,
}

#[derive(Debug)]
pub struct BackendView {
    pub id: Arc<str>,
    /// The id as a header value, made once: every request to the backend
    /// names it. `None` where the id cannot be one.
    pub id_header: Option<http::HeaderValue>,
    pub health: Health,
    /// The backend is llama-server, alone, as a router or behind
    /// llama-swap: it tells a stream's prompt progress when asked.
    pub reports_progress: bool,
    pub weight: u32,
    pub slots_total: u32,
    pub slots_busy: u32,
    pub requests_deferred: u32,
    pub in_flight: u32,
    pub load_unknown: bool,
    /// What a request sent here is read and generated at, as reported (0
    /// where not): what a request cut before its answer said its usage
    /// is billed by.
    pub rates: Rates,
}

impl BackendView {
    /// Requests the backend holds, running or queued: its own counts, or
    /// the agent proxy's in-flight count where that is more (a server
    /// without `--slots` and `--metrics` reports none).
    pub fn occupancy(&self) -> u32 {
        self.slots_busy.saturating_add(self.requests_deferred).max(self.in_flight)
    }
}

/// What a backend reads prompts and generates at, in tokens a second, as
/// its agent reports them (0: not known), and what its GPU time costs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Rates {
    pub prefill_tokens_per_second: f64,
    pub decode_tokens_per_second: f64,
    /// What an hour of its node's GPU time costs (0: not priced).
    pub gpu_hour_price: f64,
}

/// Rates assumed where a backend has reported none yet (and no other
/// placement of the model has either): a mid-size model on one GPU.
pub const DEFAULT_PREFILL_TOKENS_PER_SECOND: f64 = 1_000.0;
pub const DEFAULT_SERVICE_SECONDS: f64 = 1.0;

/// Where a model can run: a backend of a node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Target {
    pub node: usize,
    pub backend: usize,
}

#[derive(Clone, Debug)]
pub struct Placement {
    pub target: Target,
    pub state: ModelState,
    pub context_window: u32,
    /// Empty: not known, so any kind is tried.
    pub endpoints: Vec<EndpointKind>,
    /// Kinds the backend is known not to serve for the model.
    pub unsupported: Vec<EndpointKind>,
    pub size_bytes: u64,
    /// The rest is copied from the node and backend at decode time, so a
    /// decision reads one contiguous array instead of chasing pointers.
    /// Backend ready and node not draining.
    pub usable: bool,
    pub reported_in_flight: u32,
    /// What the wait for a slot is estimated from: the backend's slots (0:
    /// not known), the requests it holds, its queue, and whether those
    /// counts could be read.
    pub slots: u32,
    pub occupancy: u32,
    /// This data plane's requests in flight to the node when the report was
    /// read: those that have ended since freed slots the report still
    /// shows taken.
    pub own_in_flight_when_read: u32,
    pub deferred: u32,
    pub load_unknown: bool,
    /// Prompt tokens a request is read at, per second, and the seconds a
    /// request holds a slot: reported, else the model's other placements'
    /// median, else the defaults. Never zero.
    pub prefill_tokens_per_second: f64,
    pub service_seconds: f64,
    /// The fastest prompt rate among the model's placements: no move can
    /// read the whole prompt sooner, so a home that answers sooner than
    /// that is kept without looking further.
    pub fastest_prefill_tokens_per_second: f64,
    /// Sessions the backend's agent reports resident: the load a new
    /// session is balanced against, since each will come back.
    pub resident_sessions: u32,
    /// Loading the model here unloads another: the backend holds as many
    /// as it may (llama-server's `--models-max`).
    pub evicts: bool,
    pub weight: u32,
    pub node_key: u64,
    pub vram_fraction: f64,
    pub admission_threshold: f64,
    pub hard_limit: f64,
    pub vram_total_bytes: u64,
    /// Used plus loading.
    pub vram_committed_bytes: u64,
    /// The node's GPUs could not be read lately: its memory figures are the
    /// last ones read.
    pub vram_stale: bool,
    /// Which slots it can take: placements with the same non-zero group
    /// can take each other's (their backends' slot fingerprints are
    /// equal); 0: its slots cannot move.
    pub slot_group: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CatalogEntry {
    pub id: String,
    /// For an alias, the model it names.
    pub alias_of: Option<String>,
    /// Nodes with the model loaded (or possibly loaded).
    pub warm_nodes: u32,
    pub nodes: u32,
    pub context_window: u32,
}

impl RoutingSnapshot {
    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, index: usize) -> Option<&Node> {
        self.nodes.get(index)
    }

    /// The node whose key ([`Node::key`]) is `key`.
    pub fn node_by_key(&self, key: u64) -> Option<&Node> {
        self.node(*self.node_index.get(&key)?)
    }

    pub fn placements(&self, model: &str) -> Option<&[Placement]> {
        self.models.get(model).map(Vec::as_slice)
    }

    pub fn ring(&self, model: &str) -> Option<&Ring> {
        self.rings.get(model)
    }

    pub fn resident(&self, session: &str) -> Option<Resident> {
        self.resident_by_hash(session_hash(session))
    }

    /// Where the session whose key hashes to `session` is resident, as its
    /// node's agent reported.
    pub fn resident_by_hash(&self, session: u64) -> Option<Resident> {
        let entry = self.sessions.get(session)?;
        let node = *self.node_index.get(&entry.node)?;
        let backend = *self.nodes[node].backend_of_load.get(usize::try_from(entry.backend).ok()?)?;
        let backend = usize::try_from(backend).ok().filter(|b| *b < self.nodes[node].backends.len())?;
        Some(Resident {
            target: Target { node, backend },
            tokens: entry.tokens,
            last_seen_unix_ms: entry.last_seen_unix_ms,
        })
    }

    /// Where a turn this data plane sent went, as a residence in this
    /// snapshot: `None` where its node or backend is not in it.
    pub fn sent_to(&self, sent: &crate::turns::Sent) -> Option<Resident> {
        let node = *self.node_index.get(&sent.node)?;
        let backend = self.nodes[node].backends.iter().position(|b| b.id == sent.backend)?;
        Some(Resident { target: Target { node, backend }, tokens: sent.tokens, last_seen_unix_ms: sent.sent_unix_ms })
    }

    /// Where the reports have the session whose key hashes to `session`,
    /// as far as telling it from a later report goes.
    pub fn reported(&self, session: u64) -> Option<crate::turns::Seen> {
        let entry = self.sessions.get(session)?;
        Some(crate::turns::Seen { node: entry.node, last_seen_unix_ms: entry.last_seen_unix_ms })
    }

    /// Sessions resident anywhere in the fleet.
    pub fn resident_sessions(&self) -> usize {
        self.sessions.len()
    }

    pub fn catalog(&self) -> &[CatalogEntry] {
        &self.catalog
    }

    pub fn model(&self, id: &str) -> Option<&CatalogEntry> {
        self.catalog.binary_search_by(|e| e.id.as_str().cmp(id)).ok().map(|i| &self.catalog[i])
    }

    /// The model an id names: itself, or the model behind an alias.
    pub fn resolve<'a>(&'a self, id: &'a str) -> &'a str {
        self.aliases.get(id).map(String::as_str).unwrap_or(id)
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// This data plane's state of the snapshot's nodes, for routing.
    pub fn local(&self) -> &crate::targets::View {
        &self.local
    }

    /// This snapshot with `keys` as its API keys.
    pub fn with_api_keys(self, keys: impl IntoIterator<Item = inferyes_proto::v1::ApiKey>) -> RoutingSnapshot {
        let api_keys = keys.into_iter().map(|key| (key.key_id.clone(), Arc::new(key))).collect();
        RoutingSnapshot { api_keys: Arc::new(api_keys), ..self }
    }

    pub fn api_key(&self, key_id: &str) -> Option<&Arc<inferyes_proto::v1::ApiKey>> {
        self.api_keys.get(key_id)
    }

    /// Tokens `key_id` used today (UTC), per the fleet's roll-up.
    pub fn tokens_today(&self, key_id: &str) -> u64 {
        inferyes_proto::usage::tokens_today(&self.usage_today, key_id, inferyes_proto::unix_ms())
    }
}

/// The key of the resident-session index: a 64-bit stable hash. Two keys
/// colliding would at worst send one session to the other's node.
pub fn session_hash(key: &str) -> u64 {
    inferyes_proto::hash::stable_hash(key.as_bytes())
}
