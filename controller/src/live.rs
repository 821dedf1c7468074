//! The fleet's soft state: each node's load and resident sessions. It
//! changes with every request, so it is never written to etcd: the agent
//! stream that receives it hands it to the reconciler, peers relay it to
//! each other (`RoutingService.FollowLive`), and snapshots carry it to data
//! planes. etcd keeps what a node *is* (its models, health, memory steps);
//! this keeps what it is *doing*. Pure: no I/O.

use std::collections::BTreeMap;
use std::sync::Arc;

use inferyes_proto::v1::{BackendLoad, GpuLoad, NodeLive, NodeLoad, NodeStatus};

/// GPU memory in etcd is rounded up to steps of this fraction of the GPU's
/// total: a node's record changes when a model is loaded, not when its KV
/// cache or a neighbour's process moves a few megabytes.
pub const MEMORY_STEPS: u64 = 100;

/// What an agent's status may put in etcd, at most: past it, the rest is
/// dropped from the record (and logged), so that no agent can make a record
/// too big to write or to watch.
pub const MAX_BACKENDS: usize = 64;
pub const MAX_MODELS_PER_BACKEND: usize = 256;
pub const MAX_GPUS: usize = 64;
const MAX_TEXT: usize = 256;

/// One node's live state and where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Live {
    /// The controller serving the node's agent stream.
    pub origin: Arc<str>,
    /// False once the stream it came over is gone (a peer unreachable):
    /// its counts are the last ones known, and routing takes them for
    /// unknown.
    pub fresh: bool,
    pub node: NodeLive,
}

/// A change to the live state.
#[derive(Clone, Debug)]
pub enum LiveEvent {
    /// A node's whole live state, from an agent stream here or a peer.
    Put(Arc<Live>),
    /// The agent stream of `node_id` at `origin` ended.
    Gone { node_id: String, origin: Arc<str> },
    /// A peer's whole set: replaces every node that came from it.
    PeerFull { origin: Arc<str>, nodes: Vec<Arc<Live>> },
    /// The stream from a peer ended: what it relayed is kept, not fresh.
    PeerLost { origin: Arc<str> },
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct LiveState {
    nodes: BTreeMap<String, Arc<Live>>,
}

impl LiveState {
    pub fn apply(&mut self, event: LiveEvent) {
        match event {
            LiveEvent::Put(live) => {
                self.nodes.insert(live.node.node_id.clone(), live);
            }
            LiveEvent::Gone { node_id, origin } => {
                if self.nodes.get(&node_id).is_some_and(|l| l.origin == origin) {
                    self.nodes.remove(&node_id);
                }
            }
            LiveEvent::PeerFull { origin, nodes } => {
                self.nodes.retain(|_, l| l.origin != origin);
                for live in nodes {
                    // A node that moved here meanwhile keeps its stream's state.
                    match self.nodes.get(&live.node.node_id) {
                        Some(held) if held.fresh => {}
                        _ => {
                            self.nodes.insert(live.node.node_id.clone(), live);
                        }
                    }
                }
            }
            LiveEvent::PeerLost { origin } => {
                for live in self.nodes.values_mut().filter(|l| l.origin == origin && l.fresh) {
                    Arc::make_mut(live).fresh = false;
                }
            }
        }
    }

    /// A node left the fleet (its etcd record is gone): what a peer relayed
    /// of it goes. A stream here still open keeps its own.
    pub fn node_left(&mut self, node_id: &str, own_id: &str) {
        if self.nodes.get(node_id).is_some_and(|l| &*l.origin != own_id) {
            self.nodes.remove(node_id);
        }
    }

    /// Equal by the nodes' `Arc`s, without comparing what they hold.
    pub fn same(&self, other: &LiveState) -> bool {
        self.nodes.len() == other.nodes.len()
            && self.nodes.iter().zip(&other.nodes).all(|((a, x), (b, y))| a == b && Arc::ptr_eq(x, y))
    }

    pub fn get(&self, node_id: &str) -> Option<&Arc<Live>> {
        self.nodes.get(node_id)
    }

    /// The nodes whose agents `origin` serves.
    pub fn from_origin<'a>(&'a self, origin: &'a str) -> impl Iterator<Item = &'a Arc<Live>> + 'a {
        self.nodes.values().filter(move |l| &*l.origin == origin)
    }
}

/// Splits an agent's status into what etcd keeps (bounded, load zeroed,
/// memory in steps, no sessions) and the load that changes per request.
/// The second value counts what the bounds dropped.
pub fn split(mut status: NodeStatus) -> (NodeStatus, NodeLoad, usize) {
    let mut dropped = 0;
    let mut load = NodeLoad::default();
    status.sessions = Vec::new();
    dropped += truncate_vec(&mut status.backends, MAX_BACKENDS);
    dropped += truncate_vec(&mut status.gpus, MAX_GPUS);
    truncate_text(&mut status.hostname);
    truncate_text(&mut status.agent_version);
    for backend in &mut status.backends {
        dropped += truncate_vec(&mut backend.models, MAX_MODELS_PER_BACKEND);
        truncate_text(&mut backend.id);
        truncate_text(&mut backend.probe_error);
        for model in &mut backend.models {
            truncate_text(&mut model.id);
        }
        load.backends.push(BackendLoad {
            backend_id: backend.id.clone(),
            slots_busy: std::mem::take(&mut backend.slots_busy),
            requests_deferred: std::mem::take(&mut backend.requests_deferred),
            in_flight: std::mem::take(&mut backend.in_flight),
            tokens_per_second: std::mem::take(&mut backend.tokens_per_second),
            prefill_tokens_per_second: std::mem::take(&mut backend.prefill_tokens_per_second),
            service_ms: std::mem::take(&mut backend.service_ms),
            load_unknown: std::mem::take(&mut backend.load_unknown),
        });
    }
    for gpu in &mut status.gpus {
        truncate_text(&mut gpu.uuid);
        truncate_text(&mut gpu.name);
        load.gpus.push(GpuLoad {
            index: gpu.index,
            memory_used_bytes: gpu.memory_used_bytes,
            utilization_percent: std::mem::take(&mut gpu.utilization_percent),
        });
        gpu.memory_used_bytes = memory_step(gpu.memory_used_bytes, gpu.memory_total_bytes);
    }
    (status, load, dropped)
}

/// `used` rounded up to the next step of the total: never less than read,
/// so that admission errs towards full.
pub fn memory_step(used: u64, total: u64) -> u64 {
    let step = (total / MEMORY_STEPS).max(1);
    used.div_ceil(step).saturating_mul(step).min(total.max(used))
}

/// The status the fleet sees: etcd's record with the node's live state.
/// A node whose live state is unknown or not fresh shows its backends'
/// load as unknown, so routing neither piles onto it nor moves sessions
/// to it.
pub fn merge(durable: &NodeStatus, live: Option<&Live>) -> NodeStatus {
    let mut status = durable.clone();
    let Some(live) = live else {
        status.backends.iter_mut().for_each(|b| b.load_unknown = true);
        return status;
    };
    let load = live.node.load.as_ref();
    for backend in &mut status.backends {
        match load.and_then(|l| l.backends.iter().find(|b| b.backend_id == backend.id)) {
            Some(reported) => {
                backend.slots_busy = reported.slots_busy;
                backend.requests_deferred = reported.requests_deferred;
                backend.in_flight = reported.in_flight;
                backend.tokens_per_second = reported.tokens_per_second;
                backend.prefill_tokens_per_second = reported.prefill_tokens_per_second;
                backend.service_ms = reported.service_ms;
                backend.load_unknown = reported.load_unknown || !live.fresh;
            }
            None => backend.load_unknown = true,
        }
    }
    for gpu in &mut status.gpus {
        if let Some(reported) = load.and_then(|l| l.gpus.iter().find(|g| g.index == gpu.index)) {
            gpu.memory_used_bytes = reported.memory_used_bytes;
            gpu.utilization_percent = reported.utilization_percent;
        }
    }
    status.sessions.clone_from(&live.node.sessions);
    status
}

fn truncate_vec<T>(items: &mut Vec<T>, max: usize) -> usize {
    let over = items.len().saturating_sub(max);
    items.truncate(max);
    over
}

fn truncate_text(text: &mut String) {
    if text.len() > MAX_TEXT {
        let mut end = MAX_TEXT;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
}

#[cfg(test)]
mod tests {
    use inferyes_proto::v1::{Backend, Gpu, Model, ResidentSession};
    use prost::Message;

    use super::*;

    fn status(busy: u32, used: u64, sessions: usize) -> NodeStatus {
        NodeStatus {
            node_id: "n".into(),
            proxy_url: "http://n".into(),
            gpus: vec![Gpu {
                index: 0,
                memory_total_bytes: 80 << 30,
                memory_used_bytes: used,
                utilization_percent: 40,
                ..Default::default()
            }],
            backends: (0..8)
                .map(|b| Backend {
                    id: format!("b{b}"),
                    models: vec![Model { id: "gemma".into(), ..Default::default() }],
                    slots_total: 4,
                    slots_busy: busy,
                    in_flight: busy,
                    prefill_tokens_per_second: 1234.5,
                    service_ms: 800,
                    ..Default::default()
                })
                .collect(),
            sessions: (0..sessions)
                .map(|i| ResidentSession { key: format!("s{i}"), backend_id: "b0".into(), ..Default::default() })
                .collect(),
            ..Default::default()
        }
    }

    fn live(origin: &str, node_id: &str, load: NodeLoad) -> Arc<Live> {
        Arc::new(Live {
            origin: origin.into(),
            fresh: true,
            node: NodeLive { node_id: node_id.into(), load: Some(load), sessions: Vec::new() },
        })
    }

    #[test]
    fn traffic_changes_the_load_and_not_the_record() {
        let (quiet, _, _) = split(status(0, 30 << 30, 0));
        let (busy, load, _) = split(status(3, (30 << 30) + (50 << 20), 2_000));
        assert_eq!(quiet, busy, "busy slots, a few MB and sessions leave the record as it was");
        assert_eq!(load.backends[0].slots_busy, 3);
        assert_eq!(load.gpus[0].memory_used_bytes, (30 << 30) + (50 << 20));
        let (loaded, _, _) = split(status(0, 40 << 30, 0));
        assert_ne!(quiet, loaded, "a model's worth of memory is a new step");
        assert!(busy.encoded_len() < 16 << 10, "a node of 8 backends fits 16 kB: {}", busy.encoded_len());
    }

    #[test]
    fn memory_steps_round_up_and_stay_within_the_total() {
        assert_eq!(memory_step(0, 100), 0);
        assert_eq!(memory_step(1, 100), 1);
        assert_eq!(memory_step(101, 10_000), 200);
        assert_eq!(memory_step(9_950, 10_000), 10_000);
        assert_eq!(memory_step(5, 0), 5, "no total: as read");
    }

    #[test]
    fn a_hostile_status_is_bounded() {
        let mut huge = status(0, 0, 0);
        huge.hostname = "h".repeat(1 << 20);
        huge.backends = (0..1_000)
            .map(|b| Backend {
                id: format!("b{b}"),
                models: (0..1_000)
                    .map(|m| Model { id: format!("{m}{}", "é".repeat(500)), ..Default::default() })
                    .collect(),
                ..Default::default()
            })
            .collect();
        let (record, _, dropped) = split(huge);
        assert_eq!(dropped, (1_000 - MAX_BACKENDS) + MAX_BACKENDS * (1_000 - MAX_MODELS_PER_BACKEND));
        assert!(record.hostname.len() <= MAX_TEXT && record.backends[0].models[0].id.len() <= MAX_TEXT);
        assert!(record.encoded_len() < 5 << 20);
    }

    #[test]
    fn merge_puts_the_live_state_back_and_marks_what_is_not_known() {
        let full = status(2, 31 << 30, 3);
        let (durable, load, _) = split(full.clone());
        let mut node = live("c1", "n", load);
        Arc::make_mut(&mut node).node.sessions.clone_from(&full.sessions);
        assert_eq!(merge(&durable, Some(&node)), full);
        let unknown = merge(&durable, None);
        assert!(unknown.backends.iter().all(|b| b.load_unknown) && unknown.sessions.is_empty());
        let mut stale = LiveState::default();
        stale.apply(LiveEvent::Put(Arc::clone(&node)));
        stale.apply(LiveEvent::PeerLost { origin: "c1".into() });
        let merged = merge(&durable, stale.get("n").map(Arc::as_ref));
        assert!(merged.backends.iter().all(|b| b.load_unknown && b.slots_busy == 2));
        assert_eq!(merged.sessions, full.sessions, "sessions outlive the stream that brought them");
    }

    #[test]
    fn each_origin_replaces_and_removes_only_its_own() {
        let mut state = LiveState::default();
        state.apply(LiveEvent::Put(live("c1", "a", NodeLoad::default())));
        state.apply(LiveEvent::Put(live("c2", "b", NodeLoad::default())));
        state.apply(LiveEvent::Put(live("c2", "c", NodeLoad::default())));
        // `a` moved to c2; c1's stream end must not remove it.
        state.apply(LiveEvent::Put(live("c2", "a", NodeLoad::default())));
        state.apply(LiveEvent::Gone { node_id: "a".into(), origin: "c1".into() });
        assert_eq!(state.get("a").map(|l| &*l.origin), Some("c2"));
        state.apply(LiveEvent::PeerFull { origin: "c2".into(), nodes: vec![live("c2", "b", NodeLoad::default())] });
        assert!(state.get("a").is_none() && state.get("c").is_none() && state.get("b").is_some());
        state.apply(LiveEvent::Put(live("me", "d", NodeLoad::default())));
        state.apply(LiveEvent::PeerFull { origin: "c2".into(), nodes: vec![live("c2", "d", NodeLoad::default())] });
        assert_eq!(state.get("d").map(|l| &*l.origin), Some("me"), "a stream here wins over a peer's old word");
        state.node_left("d", "me");
        state.node_left("b", "me");
        assert!(state.get("d").is_some() && state.get("b").is_none());
        assert_eq!(state.from_origin("me").count(), 1);
    }
}
