//! The nodes' live state: their load and resident sessions, from the
//! controller's live deltas. Sessions go into one index shared by every
//! snapshot and updated in place: a fleet of a thousand nodes holds a
//! million sessions and changes thousands a second, too many to decode
//! into each snapshot. Loads are read at decode, like the nodes' records.

use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasherDefault;
use std::sync::{Arc, RwLock};

use inferyes_proto::v1::{LiveDelta, LiveNode, NodeLoad, SnapshotNode};

use super::{Prehashed, session_hash};

type Map<V> = HashMap<u64, V, BuildHasherDefault<Prehashed>>;

/// Where a session's cache is resident, by the node's key
/// (`stable_hash(node_id)`, which outlives snapshots) and backend index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub node: u64,
    pub backend: u32,
    pub tokens: u32,
    pub last_seen_unix_ms: u64,
}

const SHARDS: usize = 64;

/// Session key hash → where it is resident, fleet-wide. Written only by the
/// subscription task; requests read one shard for one lookup.
#[derive(Debug)]
pub struct SessionIndex {
    shards: Box<[RwLock<Map<Entry>>]>,
}

impl Default for SessionIndex {
    fn default() -> SessionIndex {
        SessionIndex { shards: (0..SHARDS).map(|_| RwLock::default()).collect() }
    }
}

impl SessionIndex {
    fn shard(&self, key: u64) -> &RwLock<Map<Entry>> {
        // The keys are well-mixed hashes, and each shard's table takes its
        // bucket from the low bits and its tags from the top seven: the
        // shard is picked by bits neither uses, or every key of a shard
        // would carry the same tag and each lookup probe every slot.
        &self.shards[(key >> 40) as usize % SHARDS]
    }

    pub fn get(&self, key: u64) -> Option<Entry> {
        self.shard(key).read().ok()?.get(&key).copied()
    }

    /// A session two nodes hold (it moved, and the old one has not evicted
    /// it yet) is where it was used last.
    fn upsert(&self, key: u64, entry: Entry) {
        let Ok(mut shard) = self.shard(key).write() else { return };
        match shard.get(&key) {
            Some(held) if held.node != entry.node && held.last_seen_unix_ms > entry.last_seen_unix_ms => {}
            _ => {
                shard.insert(key, entry);
            }
        }
    }

    fn remove(&self, key: u64, node: u64) {
        let Ok(mut shard) = self.shard(key).write() else { return };
        if shard.get(&key).is_some_and(|held| held.node == node) {
            shard.remove(&key);
        }
    }

    pub fn len(&self) -> usize {
        self.shards.iter().filter_map(|s| s.read().ok()).map(|s| s.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One node's live state.
#[derive(Debug, Default)]
pub struct NodeLive {
    pub load: NodeLoad,
    /// The controller relaying it lost the node's stream: the load is the
    /// last known.
    pub stale: bool,
    /// Its sessions, by key hash, with their backend index.
    sessions: Map<u32>,
    /// Sessions per backend index.
    counts: Vec<u32>,
}

impl NodeLive {
    pub fn resident_sessions(&self, backend: usize) -> u32 {
        self.counts.get(backend).copied().unwrap_or(0)
    }
}

/// Every node's live state, as one controller stream describes it.
#[derive(Debug, Default)]
pub struct Live {
    nodes: BTreeMap<String, NodeLive>,
    index: Arc<SessionIndex>,
}

impl Live {
    pub fn new(index: Arc<SessionIndex>) -> Live {
        Live { nodes: BTreeMap::new(), index }
    }

    /// The live state that statuses carry themselves (their backends' load
    /// fields and sessions): what tests and benchmarks write, in an index
    /// of its own.
    pub fn from_statuses(nodes: &BTreeMap<String, SnapshotNode>) -> Live {
        let mut live = Live::default();
        live.apply_full(of_statuses(nodes), |_| false);
        live
    }

    pub fn index(&self) -> &Arc<SessionIndex> {
        &self.index
    }

    pub fn node(&self, node_id: &str) -> Option<&NodeLive> {
        self.nodes.get(node_id)
    }

    /// Replaces everything with a full snapshot's live state. Nodes listed
    /// are replaced one by one, so a session resident before and after is
    /// never missing from the index meanwhile. A node it does not list but
    /// whose record it has (`in_fleet`: a controller that has not heard
    /// from the node's peer yet) keeps what it had, as stale.
    pub fn apply_full(&mut self, nodes: Vec<LiveNode>, in_fleet: impl Fn(&str) -> bool) {
        let listed: std::collections::BTreeSet<String> = nodes.iter().map(|n| n.node_id.clone()).collect();
        let unlisted: Vec<String> = self.nodes.keys().filter(|id| !listed.contains(*id)).cloned().collect();
        for id in unlisted {
            match self.nodes.get_mut(&id) {
                Some(node) if in_fleet(&id) => node.stale = true,
                _ => self.remove(&id),
            }
        }
        for mut node in nodes {
            node.sessions_full = true;
            self.apply_node(node);
        }
    }

    /// Applies a live delta; returns whether anything changed.
    pub fn apply(&mut self, delta: LiveDelta) -> bool {
        let changed = !delta.nodes.is_empty() || !delta.gone.is_empty();
        for node in delta.nodes {
            self.apply_node(node);
        }
        for id in &delta.gone {
            self.remove(id);
        }
        changed
    }

    fn apply_node(&mut self, wire: LiveNode) {
        let key = inferyes_proto::hash::stable_hash(wire.node_id.as_bytes());
        let node = self.nodes.entry(wire.node_id).or_default();
        if let Some(load) = wire.load {
            node.load = load;
        }
        node.stale = wire.stale;
        let backends = node.load.backends.len();
        if node.counts.len() != backends {
            // A new list of backends: sessions on one no longer listed go,
            // the rest are counted again.
            node.sessions.retain(|session, backend| {
                let kept = (*backend as usize) < backends;
                if !kept {
                    self.index.remove(*session, key);
                }
                kept
            });
            node.counts = vec![0; backends];
            for backend in node.sessions.values() {
                node.counts[*backend as usize] += 1;
            }
        }
        if wire.sessions_full {
            let kept: std::collections::HashSet<u64> = wire.upserted.iter().map(|e| e.key).collect();
            for (session, _) in node.sessions.iter().filter(|(s, _)| !kept.contains(s)) {
                self.index.remove(*session, key);
            }
            node.sessions.clear();
            node.counts.iter_mut().for_each(|c| *c = 0);
        }
        for session in wire.removed {
            if let Some(backend) = node.sessions.remove(&session) {
                if let Some(count) = node.counts.get_mut(backend as usize) {
                    *count = count.saturating_sub(1);
                }
                self.index.remove(session, key);
            }
        }
        for entry in wire.upserted {
            // A backend the node's load does not list: not routable.
            if entry.backend as usize >= backends {
                continue;
            }
            if let Some(old) = node.sessions.insert(entry.key, entry.backend)
                && let Some(count) = node.counts.get_mut(old as usize)
            {
                *count = count.saturating_sub(1);
            }
            node.counts[entry.backend as usize] += 1;
            let resident = Entry {
                node: key,
                backend: entry.backend,
                tokens: entry.tokens,
                last_seen_unix_ms: entry.last_seen_unix_ms,
            };
            self.index.upsert(entry.key, resident);
        }
    }

    /// Forgets a node and its sessions: it left the fleet's records.
    pub fn remove(&mut self, node_id: &str) {
        let Some(node) = self.nodes.remove(node_id) else { return };
        let key = inferyes_proto::hash::stable_hash(node_id.as_bytes());
        for session in node.sessions.keys() {
            self.index.remove(*session, key);
        }
    }
}

/// The live state statuses carry themselves, as full live nodes.
pub fn of_statuses(nodes: &BTreeMap<String, SnapshotNode>) -> Vec<LiveNode> {
    nodes.values().filter_map(|n| n.status.as_ref()).map(live_of_status).collect()
}

/// A status's own load and sessions as a full live node.
fn live_of_status(status: &inferyes_proto::v1::NodeStatus) -> LiveNode {
    use inferyes_proto::v1::{BackendLoad, GpuLoad, SessionEntry};
    let load = NodeLoad {
        backends: status
            .backends
            .iter()
            .map(|b| BackendLoad {
                backend_id: b.id.clone(),
                slots_busy: b.slots_busy,
                requests_deferred: b.requests_deferred,
                in_flight: b.in_flight,
                tokens_per_second: b.tokens_per_second,
                prefill_tokens_per_second: b.prefill_tokens_per_second,
                service_ms: b.service_ms,
                load_unknown: b.load_unknown,
                // Routing reads none of the tier's figures.
                kv_tier: None,
            })
            .collect(),
        gpus: status
            .gpus
            .iter()
            .map(|g| GpuLoad {
                index: g.index,
                memory_used_bytes: g.memory_used_bytes,
                utilization_percent: g.utilization_percent,
            })
            .collect(),
        moves: None,
    };
    let upserted = status
        .sessions
        .iter()
        .filter_map(|s| {
            let backend = status.backends.iter().position(|b| b.id == s.backend_id)?;
            Some(SessionEntry {
                key: session_hash(&s.key),
                backend: u32::try_from(backend).ok()?,
                tokens: s.tokens,
                last_seen_unix_ms: s.last_seen_unix_ms,
            })
        })
        .collect();
    LiveNode {
        node_id: status.node_id.clone(),
        load: Some(load),
        stale: false,
        sessions_full: true,
        upserted,
        removed: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use inferyes_proto::v1::{BackendLoad, SessionEntry};

    use super::*;

    fn entry(key: u64, backend: u32, last_seen: u64) -> SessionEntry {
        SessionEntry { key, backend, tokens: 7, last_seen_unix_ms: last_seen }
    }

    fn node(id: &str, full: bool, upserted: Vec<SessionEntry>, removed: Vec<u64>) -> LiveNode {
        LiveNode {
            node_id: id.into(),
            load: Some(NodeLoad {
                backends: (0..2).map(|b| BackendLoad { backend_id: format!("b{b}"), ..Default::default() }).collect(),
                gpus: Vec::new(),
                moves: None,
            }),
            stale: false,
            sessions_full: full,
            upserted,
            removed,
        }
    }

    #[test]
    fn deltas_keep_the_index_and_the_counts() {
        let mut live = Live::default();
        live.apply_full(vec![node("a", true, vec![entry(1, 0, 1), entry(2, 1, 1)], vec![])], |_| false);
        let a = inferyes_proto::hash::stable_hash(b"a");
        assert_eq!(live.index().get(1).map(|e| (e.node, e.backend)), Some((a, 0)));
        live.apply(LiveDelta {
            nodes: vec![node("a", false, vec![entry(3, 1, 2), entry(9, 5, 2)], vec![1])],
            gone: vec![],
        });
        assert_eq!(live.index().get(1), None);
        assert_eq!(live.index().get(9), None, "a backend the node does not list");
        let a_live = live.node("a").unwrap();
        assert_eq!((a_live.resident_sessions(0), a_live.resident_sessions(1)), (0, 2));

        // A session that moved to b is where it was used last, and a's
        // removal of its old copy leaves b's.
        live.apply(LiveDelta { nodes: vec![node("b", true, vec![entry(2, 0, 5)], vec![])], gone: vec![] });
        let b = inferyes_proto::hash::stable_hash(b"b");
        assert_eq!(live.index().get(2).map(|e| e.node), Some(b));
        live.apply(LiveDelta { nodes: vec![node("a", false, vec![], vec![2])], gone: vec![] });
        assert_eq!(live.index().get(2).map(|e| e.node), Some(b));

        // A node gone takes its sessions; a full state drops nodes not in it.
        live.apply(LiveDelta { nodes: vec![], gone: vec!["a".into()] });
        assert_eq!(live.index().get(3), None);
        live.apply_full(vec![node("c", true, vec![entry(4, 0, 1)], vec![])], |id| id == "b");
        assert_eq!(live.index().len(), 2, "b is still in the fleet: kept, stale");
        assert!(live.node("b").is_some_and(|b| b.stale));
        live.apply_full(vec![node("c", true, vec![entry(4, 0, 1)], vec![])], |_| false);
        assert_eq!((live.index().len(), live.node("b").is_none()), (1, true));
    }

    #[test]
    fn a_full_table_replaces_a_node_s_sessions() {
        let mut live = Live::default();
        live.apply_full(vec![node("a", true, vec![entry(1, 0, 1), entry(2, 0, 1)], vec![])], |_| false);
        live.apply(LiveDelta { nodes: vec![node("a", true, vec![entry(2, 1, 3)], vec![])], gone: vec![] });
        assert_eq!(live.index().get(1), None);
        assert_eq!(live.index().get(2).map(|e| e.backend), Some(1));
        let a = live.node("a").unwrap();
        assert_eq!((a.resident_sessions(0), a.resident_sessions(1)), (0, 1));
    }
}
