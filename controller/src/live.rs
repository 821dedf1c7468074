//! The fleet's soft state: each node's load and resident sessions. It
//! changes with every request, so it is never written to etcd: the agent
//! stream that receives it hands it to the reconciler, peers relay it to
//! each other (`RoutingService.FollowLive`), and data planes get it as
//! deltas beside the snapshot (`LiveDelta`). etcd keeps what a node *is*
//! (its models, health, memory steps); this keeps what it is *doing*.
//!
//! Changes are gathered between two batches per node and key, so a batch
//! carries each changed session once, and only what changed: a node of a
//! thousand sessions that gains one sends one. Pure: no I/O.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use inferyes_proto::FastMap;
use inferyes_proto::v1::{
    BackendLoad, GpuLoad, LiveDelta, LiveNode, LiveUpdate, NodeLive, NodeLoad, NodeStatus, ResidentSession,
    SessionEntry, SessionInfo,
};

/// GPU memory in etcd is rounded up to steps of this fraction of the GPU's
/// total: a node's record changes when a model is loaded, not when its KV
/// cache or a neighbour's process moves a few megabytes.
pub const MEMORY_STEPS: u64 = 100;

/// What an agent's status may put in etcd, at most: past it, the rest is
/// dropped from the record (and logged), so that no agent can make a record
/// too big to write or to watch.
pub const MAX_BACKENDS: usize = 64;
pub const MAX_MODELS_PER_BACKEND: usize = 256;
/// Kinds of job a model lists, at most: more than there are.
const MAX_KINDS: usize = 16;
pub const MAX_GPUS: usize = 64;
const MAX_TEXT: usize = inferyes_proto::MAX_NAME_BYTES;
/// A node's record, encoded, at most: its last models are dropped past
/// it. Far above what a real node's lists come to, far below etcd's
/// limit on a request.
pub const MAX_RECORD_BYTES: usize = 512 << 10;

/// Sessions one node may hold here, and the longest key taken: every
/// controller and every data plane holds them in memory, and an agent
/// claiming a million must not fill them. An agent keeps far fewer (1,024
/// past the slots per backend).
pub const MAX_SESSIONS: usize = 65_536;
pub const MAX_KEY_BYTES: usize = 256;
/// Sessions the whole fleet may hold here: what a full snapshot carries
/// to each data plane (some 100 MB at this bound) stays sendable.
pub const MAX_FLEET_SESSIONS: usize = 4_000_000;

/// Every this many batches, one of this controller's nodes is sent to
/// peers whole, in turn: a peer that missed a change (a move between
/// controllers it saw in another order) has it right again within
/// minutes.
const REFRESH_EVERY: u64 = 5;

/// The most recently used sessions the dashboard lists.
pub const RECENT_SESSIONS: usize = 50;

/// A change to the live state.
#[derive(Clone, Debug)]
pub enum LiveEvent {
    /// A node's load, from `origin`: this controller's agent stream number
    /// `stream`, or a peer's relay (stream 0).
    Load { node_id: String, origin: Arc<str>, stream: u64, load: NodeLoad },
    /// A node's sessions: the whole table (`full`), or what changed.
    Sessions {
        node_id: String,
        origin: Arc<str>,
        stream: u64,
        full: bool,
        upserted: Vec<ResidentSession>,
        removed: Vec<String>,
    },
    /// That stream ended.
    Gone { node_id: String, origin: Arc<str>, stream: u64 },
    /// A peer's whole set: replaces every node that came from it.
    PeerFull { origin: Arc<str>, nodes: Vec<NodeLive> },
    /// A peer's changes.
    PeerDelta { origin: Arc<str>, nodes: Vec<NodeLive>, gone: Vec<String> },
    /// The stream from a peer ended: what it relayed is kept, not fresh.
    PeerLost { origin: Arc<str> },
}

/// What the controller's own views (FleetService, the dashboard, metrics)
/// show of one node's live state.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// The controller serving the node's agent stream.
    pub origin: Arc<str>,
    /// False once the stream it came over is gone (a peer unreachable):
    /// the load is the last known, and routing takes it for unknown.
    pub fresh: bool,
    pub load: NodeLoad,
    /// Resident sessions by backend id.
    pub sessions: BTreeMap<String, u32>,
    /// The latest use of a resident session of each model (ms), for
    /// placement: a model used lately is not unloaded.
    pub last_used: BTreeMap<String, u64>,
}

/// What a snapshot shows of the live state.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LiveView {
    pub nodes: BTreeMap<String, Arc<Summary>>,
    /// The most recently used sessions, most recent first, with their node.
    pub recent: Vec<(String, ResidentSession)>,
    pub sessions: usize,
}

/// The changes between two batches, in each receiver's form.
#[derive(Debug)]
pub struct LiveBatch {
    pub seq: u64,
    /// For data planes: every node's changes.
    pub delta: LiveDelta,
    /// For peers: the changes of the nodes whose agents are here.
    pub own: LiveUpdate,
}

#[derive(Debug)]
struct Node {
    origin: Arc<str>,
    /// The agent stream here it came over: a later stream of the same node
    /// (the agent reconnected before the old one was seen to end) wins.
    stream: u64,
    fresh: bool,
    load: NodeLoad,
    /// By the key's stable hash, which is also the data planes' key: no
    /// copy of the key string per change.
    sessions: FastMap<u64, ResidentSession>,
    counts: BTreeMap<String, u32>,
    last_used: BTreeMap<String, u64>,
    summary: Arc<Summary>,
}

/// A node's changes since the last batch.
#[derive(Debug, Default)]
struct Pending {
    /// The load, or its freshness, changed.
    load: bool,
    /// The table was replaced: the batch carries all of it.
    full: bool,
    upserted: BTreeSet<u64>,
    /// By hash, with the key for peers.
    removed: BTreeMap<u64, String>,
}

fn hash(key: &str) -> u64 {
    inferyes_proto::hash::stable_hash(key.as_bytes())
}

#[derive(Debug, Default)]
pub struct LiveState {
    own_id: Arc<str>,
    nodes: BTreeMap<String, Node>,
    pending: BTreeMap<String, Pending>,
    /// Nodes gone since the last batch, and which of those were this
    /// controller's.
    gone: BTreeSet<String>,
    gone_own: BTreeSet<String>,
    seq: u64,
    /// (last use, node, key hash) of the most recently used sessions, as
    /// of the last batch: a few more than shown, for those gone since.
    recent: BTreeSet<(u64, String, u64)>,
    sessions: usize,
    /// The last node sent to peers whole by the refresh.
    refreshed: Option<String>,
}

/// Recent sessions kept, so that some removed since still leave enough.
const RECENT_KEPT: usize = 2 * RECENT_SESSIONS;

impl LiveState {
    pub fn new(own_id: &str) -> LiveState {
        LiveState { own_id: own_id.into(), ..Default::default() }
    }

    pub fn apply(&mut self, event: LiveEvent) {
        match event {
            LiveEvent::Load { node_id, origin, stream, load } => self.load(&node_id, &origin, stream, false, load),
            LiveEvent::Sessions { node_id, origin, stream, full, upserted, removed } => {
                self.sessions(&node_id, &origin, stream, full, upserted, removed);
            }
            LiveEvent::Gone { node_id, origin, stream } => {
                if self.nodes.get(&node_id).is_some_and(|n| n.origin == origin && n.stream == stream) {
                    self.remove(&node_id);
                }
            }
            LiveEvent::PeerFull { origin, nodes } => {
                let listed: BTreeSet<&str> = nodes.iter().map(|n| n.node_id.as_str()).collect();
                let dropped: Vec<String> = self
                    .nodes
                    .iter()
                    .filter(|(id, n)| n.origin == origin && !listed.contains(id.as_str()))
                    .map(|(id, _)| id.clone())
                    .collect();
                dropped.iter().for_each(|id| self.remove(id));
                for mut node in nodes {
                    node.sessions_full = true;
                    self.peer_node(&origin, node);
                }
            }
            LiveEvent::PeerDelta { origin, nodes, gone } => {
                for node in nodes {
                    self.peer_node(&origin, node);
                }
                for node_id in gone {
                    self.apply(LiveEvent::Gone { node_id, origin: Arc::clone(&origin), stream: 0 });
                }
            }
            LiveEvent::PeerLost { origin } => {
                let lost: Vec<String> = self
                    .nodes
                    .iter()
                    .filter(|(_, n)| n.origin == origin && n.fresh)
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in lost {
                    if let Some(node) = self.nodes.get_mut(&id) {
                        node.fresh = false;
                    }
                    self.pending.entry(id).or_default().load = true;
                }
            }
        }
    }

    fn peer_node(&mut self, origin: &Arc<str>, node: NodeLive) {
        let NodeLive { node_id, load, sessions, sessions_full, removed } = node;
        if !valid_node_id(&node_id) {
            return;
        }
        if let Some(load) = load {
            self.load(&node_id, origin, 0, sessions_full, load);
        }
        if sessions_full || !sessions.is_empty() || !removed.is_empty() {
            self.sessions(&node_id, origin, 0, sessions_full, sessions, removed);
        }
    }

    /// A node's etcd record is gone: what a peer relayed of it goes too.
    /// An agent stream here still open keeps its own.
    pub fn node_left(&mut self, node_id: &str) {
        if self.nodes.get(node_id).is_some_and(|n| n.origin != self.own_id) {
            self.remove(node_id);
        }
    }

    /// The node as `origin` (and its agent stream `stream`, when here) may
    /// change it: an agent stream here always may, the latest one of the
    /// node (the agent is here now); a peer where the node is its, or where
    /// what is held is not fresh, and only with the whole table (`full`):
    /// its changes apply to a table this controller holds, not to none.
    fn claim(&mut self, node_id: &str, origin: &Arc<str>, stream: u64, full: bool) -> bool {
        let local = *origin == self.own_id;
        let Some(node) = self.nodes.get_mut(node_id) else {
            if !local && !full {
                return false;
            }
            let summary = Arc::new(Summary {
                origin: Arc::clone(origin),
                fresh: true,
                load: NodeLoad::default(),
                sessions: BTreeMap::new(),
                last_used: BTreeMap::new(),
            });
            let node = Node {
                origin: Arc::clone(origin),
                stream,
                fresh: true,
                load: NodeLoad::default(),
                sessions: FastMap::default(),
                counts: BTreeMap::new(),
                last_used: BTreeMap::new(),
                summary,
            };
            self.nodes.insert(node_id.to_string(), node);
            self.gone.remove(node_id);
            if local {
                self.gone_own.remove(node_id);
            }
            // New to the receivers too: the batch carries all of it.
            let pending = self.pending.entry(node_id.to_string()).or_default();
            (pending.load, pending.full) = (true, true);
            return true;
        };
        if node.origin == *origin && (!local || stream >= node.stream) {
            node.stream = stream;
            if !node.fresh {
                // The peer's stream is back.
                node.fresh = true;
                self.pending.entry(node_id.to_string()).or_default().load = true;
            }
            return true;
        }
        if (local && node.origin != *origin) || (!local && !node.fresh && full) {
            node.origin = Arc::clone(origin);
            node.stream = stream;
            node.fresh = true;
            let pending = self.pending.entry(node_id.to_string()).or_default();
            (pending.load, pending.full) = (true, true);
            return true;
        }
        false
    }

    fn load(&mut self, node_id: &str, origin: &Arc<str>, stream: u64, full: bool, load: NodeLoad) {
        if !self.claim(node_id, origin, stream, full) {
            return;
        }
        let Some(node) = self.nodes.get_mut(node_id) else { return };
        if node.load != load {
            // Sessions name their backend by its place in the load: a new
            // list of backends sends the table again, placed anew.
            let ids = |l: &NodeLoad| l.backends.iter().map(|b| b.backend_id.clone()).collect::<Vec<_>>();
            let reordered = ids(&node.load) != ids(&load);
            node.load = load;
            let pending = self.pending.entry(node_id.to_string()).or_default();
            pending.load = true;
            if reordered {
                *pending = Pending { load: true, full: true, ..Pending::default() };
            }
        }
    }

    fn sessions(
        &mut self,
        node_id: &str,
        origin: &Arc<str>,
        stream: u64,
        full: bool,
        upserted: Vec<ResidentSession>,
        removed: Vec<String>,
    ) {
        if !self.claim(node_id, origin, stream, full) {
            return;
        }
        let LiveState { nodes, pending, sessions, .. } = self;
        let Some(node) = nodes.get_mut(node_id) else { return };
        let pending = pending.entry(node_id.to_string()).or_default();
        if full {
            *sessions -= node.sessions.len();
            node.sessions.clear();
            node.counts.clear();
            node.last_used.clear();
            *pending = Pending { load: pending.load, full: true, ..Pending::default() };
        }
        for key in removed {
            let h = hash(&key);
            let Some(session) = node.sessions.remove(&h) else { continue };
            count(&mut node.counts, &session.backend_id, false);
            *sessions -= 1;
            if !pending.full {
                pending.upserted.remove(&h);
                pending.removed.insert(h, key);
            }
        }
        for session in upserted {
            if session.key.len() > MAX_KEY_BYTES
                || session.backend_id.len() > MAX_TEXT
                || session.model.len() > MAX_TEXT
                || !inferyes_proto::is_plain(&session.backend_id)
                || !inferyes_proto::is_plain(&session.model)
            {
                continue;
            }
            let h = hash(&session.key);
            match node.sessions.get(&h) {
                Some(held) if *held == session => continue,
                Some(held) => {
                    count(&mut node.counts, &held.backend_id, false);
                    *sessions -= 1;
                }
                None if node.sessions.len() >= MAX_SESSIONS || *sessions >= MAX_FLEET_SESSIONS => continue,
                None => {}
            }
            count(&mut node.counts, &session.backend_id, true);
            used(&mut node.last_used, &session.model, session.last_seen_unix_ms);
            *sessions += 1;
            node.sessions.insert(h, session);
            if !pending.full {
                pending.removed.remove(&h);
                pending.upserted.insert(h);
            }
        }
    }

    fn remove(&mut self, node_id: &str) {
        let Some(node) = self.nodes.remove(node_id) else { return };
        self.sessions -= node.sessions.len();
        self.pending.remove(node_id);
        self.gone.insert(node_id.to_string());
        if node.origin == self.own_id {
            self.gone_own.insert(node_id.to_string());
        }
    }

    /// The changes since the last batch, if any; with the changes of this
    /// controller's own nodes in peers' form when `for_peers`.
    pub fn take_batch(&mut self, for_peers: bool) -> Option<LiveBatch> {
        if self.pending.is_empty() && self.gone.is_empty() {
            return None;
        }
        self.seq += 1;
        let mut delta = LiveDelta { nodes: Vec::new(), gone: std::mem::take(&mut self.gone).into_iter().collect() };
        let gone_own = std::mem::take(&mut self.gone_own);
        let mut own = LiveUpdate {
            controller_id: self.own_id.to_string(),
            full: false,
            nodes: Vec::new(),
            gone: if for_peers { gone_own.into_iter().collect() } else { Vec::new() },
        };
        // The newest of the batch's sessions, for the recent list.
        let mut newest: Vec<(u64, &str, u64)> = Vec::new();
        let pending = std::mem::take(&mut self.pending);
        for (id, pending) in &pending {
            let Some(node) = self.nodes.get_mut(id) else { continue };
            let changed: Vec<(u64, &ResidentSession)> = if pending.full {
                node.sessions.iter().map(|(h, s)| (*h, s)).collect()
            } else {
                pending.upserted.iter().filter_map(|h| node.sessions.get(h).map(|s| (*h, s))).collect()
            };
            newest.extend(changed.iter().map(|(h, s)| (s.last_seen_unix_ms, id.as_str(), *h)));
            if newest.len() > 4 * RECENT_KEPT {
                newest.select_nth_unstable_by(RECENT_KEPT, |a, b| b.0.cmp(&a.0));
                newest.truncate(RECENT_KEPT);
            }
            delta.nodes.push(LiveNode {
                node_id: id.clone(),
                load: pending.load.then(|| node.load.clone()),
                stale: !node.fresh,
                sessions_full: pending.full,
                upserted: changed.iter().filter_map(|(h, s)| entry(&node.load, *h, s)).collect(),
                removed: pending.removed.keys().copied().collect(),
            });
            if for_peers && node.origin == self.own_id {
                own.nodes.push(NodeLive {
                    node_id: id.clone(),
                    load: pending.load.then(|| node.load.clone()),
                    sessions: changed.iter().map(|(_, s)| (*s).clone()).collect(),
                    sessions_full: pending.full,
                    removed: pending.removed.values().cloned().collect(),
                });
            }
        }
        if for_peers && self.seq.is_multiple_of(REFRESH_EVERY) {
            self.refresh(&pending, &mut own);
        }
        let newest: Vec<(u64, String, u64)> = newest.into_iter().map(|(at, id, h)| (at, id.to_string(), h)).collect();
        for id in pending.keys() {
            if let Some(node) = self.nodes.get_mut(id) {
                node.summary = Arc::new(Summary {
                    origin: Arc::clone(&node.origin),
                    fresh: node.fresh,
                    load: node.load.clone(),
                    sessions: node.counts.clone(),
                    last_used: node.last_used.clone(),
                });
            }
        }
        self.recent.extend(newest);
        while self.recent.len() > RECENT_KEPT {
            self.recent.pop_first();
        }
        Some(LiveBatch { seq: self.seq, delta, own })
    }

    /// Adds the next of this controller's own nodes, whole, to the peers'
    /// batch, unless the batch has all of it already.
    fn refresh(&mut self, pending: &BTreeMap<String, Pending>, own: &mut LiveUpdate) {
        let after = self.refreshed.take().unwrap_or_default();
        let mut own_nodes = self.nodes.iter().filter(|(_, n)| n.origin == self.own_id);
        let next = own_nodes.clone().find(|(id, _)| **id > after).or_else(|| own_nodes.next());
        let Some((id, node)) = next else { return };
        self.refreshed = Some(id.clone());
        if pending.get(id).is_some_and(|p| p.full) {
            return;
        }
        own.nodes.retain(|n| n.node_id != *id);
        own.nodes.push(NodeLive {
            node_id: id.clone(),
            load: Some(node.load.clone()),
            sessions: node.sessions.values().cloned().collect(),
            sessions_full: true,
            removed: Vec::new(),
        });
    }

    /// The sequence number of the last batch taken.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Every node's live state, sessions whole, for a new data plane.
    pub fn full(&self) -> Vec<LiveNode> {
        self.nodes
            .iter()
            .map(|(id, node)| LiveNode {
                node_id: id.clone(),
                load: Some(node.load.clone()),
                stale: !node.fresh,
                sessions_full: true,
                upserted: node.sessions.iter().filter_map(|(h, s)| entry(&node.load, *h, s)).collect(),
                removed: Vec::new(),
            })
            .collect()
    }

    /// The live state of this controller's own nodes, whole, for a peer.
    pub fn full_own(&self) -> LiveUpdate {
        let nodes = self
            .nodes
            .iter()
            .filter(|(_, n)| n.origin == self.own_id)
            .map(|(id, node)| NodeLive {
                node_id: id.clone(),
                load: Some(node.load.clone()),
                sessions: node.sessions.values().cloned().collect(),
                sessions_full: true,
                removed: Vec::new(),
            })
            .collect();
        LiveUpdate { controller_id: self.own_id.to_string(), full: true, nodes, gone: Vec::new() }
    }

    /// What a snapshot shows: each node's summary as of the last batch.
    pub fn view(&self) -> LiveView {
        LiveView {
            nodes: self.nodes.iter().map(|(id, n)| (id.clone(), Arc::clone(&n.summary))).collect(),
            recent: self
                .recent
                .iter()
                .rev()
                .filter_map(|(at, node, h)| {
                    let session = self.nodes.get(node)?.sessions.get(h)?;
                    (session.last_seen_unix_ms == *at).then(|| (node.clone(), session.clone()))
                })
                .take(RECENT_SESSIONS)
                .collect(),
            sessions: self.sessions,
        }
    }

    /// The resident sessions of one node or of all, most recent first, at
    /// most `limit`; true when there were more.
    pub fn list(&self, node_id: Option<&str>, limit: usize) -> (Vec<SessionInfo>, bool) {
        // References first: only the `limit` kept are copied.
        let mut all: Vec<(&String, &ResidentSession)> = self
            .nodes
            .iter()
            .filter(|(id, _)| node_id.is_none_or(|wanted| wanted == id.as_str()))
            .flat_map(|(id, node)| node.sessions.values().map(move |s| (id, s)))
            .collect();
        let newest_first = |a: &(&String, &ResidentSession), b: &(&String, &ResidentSession)| {
            b.1.last_seen_unix_ms
                .cmp(&a.1.last_seen_unix_ms)
                .then_with(|| a.0.cmp(b.0))
                .then_with(|| a.1.key.cmp(&b.1.key))
        };
        let truncated = all.len() > limit;
        if truncated {
            all.select_nth_unstable_by(limit, newest_first);
            all.truncate(limit);
        }
        all.sort_by(newest_first);
        let listed = all.into_iter().map(|(id, s)| SessionInfo { node_id: id.clone(), session: Some(s.clone()) });
        (listed.collect(), truncated)
    }
}

/// Node ids are etcd key segments and header values: 1-128 characters of
/// `[A-Za-z0-9._-]`, from an agent stream or a peer alike.
pub fn valid_node_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// A session as data planes route on it; `None` for a backend the node's
/// load does not list.
fn entry(load: &NodeLoad, key: u64, session: &ResidentSession) -> Option<SessionEntry> {
    let backend = load.backends.iter().position(|b| b.backend_id == session.backend_id)?;
    Some(SessionEntry {
        key,
        backend: u32::try_from(backend).ok()?,
        tokens: session.tokens,
        last_seen_unix_ms: session.last_seen_unix_ms,
    })
}

/// Models a node's last uses are kept for; an agent naming more is not
/// believed for the rest.
const MAX_MODELS_USED: usize = 256;

/// Records a use of `model` at `at`, if later than the last one known.
fn used(last_used: &mut BTreeMap<String, u64>, model: &str, at: u64) {
    if let Some(last) = last_used.get_mut(model) {
        *last = (*last).max(at);
    } else if last_used.len() < MAX_MODELS_USED {
        last_used.insert(model.to_string(), at);
    }
}

fn count(counts: &mut BTreeMap<String, u32>, backend: &str, add: bool) {
    if add {
        // Looked up first: the backend is almost always counted already.
        match counts.get_mut(backend) {
            Some(n) => *n += 1,
            None => {
                counts.insert(backend.to_string(), 1);
            }
        }
    } else if let Some(n) = counts.get_mut(backend) {
        *n -= 1;
        if *n == 0 {
            counts.remove(backend);
        }
    }
}

/// Splits an agent's status into what etcd keeps (bounded, load zeroed,
/// memory in steps, no sessions) and the load that changes per request.
/// The third value counts what the bounds dropped.
pub fn split(mut status: NodeStatus) -> (NodeStatus, NodeLoad, usize) {
    let mut dropped = 0;
    let mut load = NodeLoad::default();
    status.sessions = Vec::new();
    // A backend or a model is known by its id on both sides (placement
    // orders, moves, sessions): one that would not show as it is is
    // dropped, never renamed.
    dropped += drop_unless(&mut status.backends, |b| inferyes_proto::is_plain(&b.id));
    dropped += truncate_vec(&mut status.backends, MAX_BACKENDS);
    dropped += truncate_vec(&mut status.gpus, MAX_GPUS);
    tidy_text(&mut status.hostname);
    tidy_text(&mut status.agent_version);
    for backend in &mut status.backends {
        dropped += drop_unless(&mut backend.models, |m| inferyes_proto::is_plain(&m.id));
        dropped += truncate_vec(&mut backend.models, MAX_MODELS_PER_BACKEND);
        tidy_text(&mut backend.id);
        tidy_text(&mut backend.probe_error);
        tidy_text(&mut backend.slot_fingerprint);
        tidy_text(&mut backend.slots_unmovable);
        for model in &mut backend.models {
            tidy_text(&mut model.id);
            // Each kind at most once: an agent cannot grow the record with
            // a kind said over and over.
            for kinds in [&mut model.endpoints, &mut model.unsupported] {
                let before = kinds.len();
                // Only kinds there are: unknown values, which sort first,
                // would push real ones out.
                kinds.retain(|k| {
                    inferyes_proto::v1::EndpointKind::try_from(*k)
                        .is_ok_and(|k| k != inferyes_proto::v1::EndpointKind::Unspecified)
                });
                kinds.sort_unstable();
                kinds.dedup();
                truncate_vec(kinds, MAX_KINDS);
                dropped += before - kinds.len();
            }
        }
        backend.resident_sessions = 0;
        load.backends.push(BackendLoad {
            backend_id: backend.id.clone(),
            slots_busy: std::mem::take(&mut backend.slots_busy),
            requests_deferred: std::mem::take(&mut backend.requests_deferred),
            in_flight: std::mem::take(&mut backend.in_flight),
            tokens_per_second: std::mem::take(&mut backend.tokens_per_second),
            prefill_tokens_per_second: std::mem::take(&mut backend.prefill_tokens_per_second),
            service_ms: std::mem::take(&mut backend.service_ms),
            load_unknown: std::mem::take(&mut backend.load_unknown),
            kv_tier: backend.kv_tier.take(),
        });
    }
    // A drain's progress changes with every move: live state, not etcd's.
    load.moves = status.moves.take().map(|mut moves| {
        tidy_text(&mut moves.last_error);
        moves
    });
    for gpu in &mut status.gpus {
        tidy_text(&mut gpu.uuid);
        tidy_text(&mut gpu.name);
        load.gpus.push(GpuLoad {
            index: gpu.index,
            memory_used_bytes: gpu.memory_used_bytes,
            utilization_percent: std::mem::take(&mut gpu.utilization_percent),
        });
        gpu.memory_used_bytes = memory_step(gpu.memory_used_bytes, gpu.memory_total_bytes);
    }
    dropped += within_record_bytes(&mut status);
    (status, load, dropped)
}

/// `used` rounded up to the next step of the total: never less than read,
/// so that admission errs towards full.
pub fn memory_step(used: u64, total: u64) -> u64 {
    let step = (total / MEMORY_STEPS).max(1);
    used.div_ceil(step).saturating_mul(step).min(total.max(used))
}

/// The status as the fleet sees it: etcd's record with the node's load, and
/// its resident sessions counted per backend (the sessions themselves are
/// listed by `ListSessions`). A node whose live state is unknown or not
/// fresh shows its load as unknown.
pub fn merge(durable: &NodeStatus, summary: Option<&Summary>) -> NodeStatus {
    let mut status = durable.clone();
    status.backends.iter_mut().for_each(|b| b.load_unknown = true);
    let Some(summary) = summary else { return status };
    status.moves.clone_from(&summary.load.moves);
    for (position, backend) in status.backends.iter_mut().enumerate() {
        let by_position = summary.load.backends.get(position).filter(|b| b.backend_id == backend.id);
        let reported = by_position.or_else(|| summary.load.backends.iter().find(|b| b.backend_id == backend.id));
        if let Some(reported) = reported {
            backend.slots_busy = reported.slots_busy;
            backend.requests_deferred = reported.requests_deferred;
            backend.in_flight = reported.in_flight;
            backend.tokens_per_second = reported.tokens_per_second;
            backend.prefill_tokens_per_second = reported.prefill_tokens_per_second;
            backend.service_ms = reported.service_ms;
            backend.load_unknown = reported.load_unknown || !summary.fresh;
            backend.kv_tier.clone_from(&reported.kv_tier);
        }
        backend.resident_sessions = summary.sessions.get(&backend.id).copied().unwrap_or(0);
    }
    for (position, gpu) in status.gpus.iter_mut().enumerate() {
        // In the record's order (the agent's), else by index.
        let by_position = summary.load.gpus.get(position).filter(|g| g.index == gpu.index);
        if let Some(reported) = by_position.or_else(|| summary.load.gpus.iter().find(|g| g.index == gpu.index)) {
            gpu.memory_used_bytes = reported.memory_used_bytes;
            gpu.utilization_percent = reported.utilization_percent;
        }
    }
    status
}

/// Keeps the items that `keep` takes; how many it dropped.
fn drop_unless<T>(items: &mut Vec<T>, keep: impl Fn(&T) -> bool) -> usize {
    let before = items.len();
    items.retain(keep);
    before - items.len()
}

fn truncate_vec<T>(items: &mut Vec<T>, max: usize) -> usize {
    let over = items.len().saturating_sub(max);
    items.truncate(max);
    over
}

/// Drops models, the last backend's last first, until `status` encodes in
/// [`MAX_RECORD_BYTES`]; how many it dropped.
fn within_record_bytes(status: &mut NodeStatus) -> usize {
    use prost::Message as _;
    let mut over = status.encoded_len().saturating_sub(MAX_RECORD_BYTES);
    let mut dropped = 0;
    for backend in status.backends.iter_mut().rev() {
        while over > 0 {
            let Some(model) = backend.models.pop() else { break };
            // The model's own bytes, its field's tag and length.
            let len = model.encoded_len();
            over = over.saturating_sub(len + prost::length_delimiter_len(len) + 1);
            dropped += 1;
        }
    }
    dropped
}

/// Keeps `text` on one line and shown plain
/// ([`inferyes_proto::shown_on_one_line`]), and at most the fleet's
/// longest name: what agents and data planes report reaches the
/// dashboard, inferyesctl's tables and every API client as it is kept
/// here.
pub fn tidy_text(text: &mut String) {
    if let std::borrow::Cow::Owned(plain) = inferyes_proto::shown_on_one_line(text) {
        *text = plain;
    }
    if text.len() > MAX_TEXT {
        let mut end = MAX_TEXT;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
}

#[cfg(test)]
mod tests;
