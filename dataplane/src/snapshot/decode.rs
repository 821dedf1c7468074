use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};

use inferyes_proto::v1::{ModelState, SnapshotNode};

use super::{BackendView, CatalogEntry, Node, Placement, RoutingSnapshot, Target};

/// Per-node in-flight counters that survive snapshot swaps, so a request
/// that started under one snapshot is still counted under the next.
#[derive(Debug, Default)]
pub struct Counters {
    by_node: Mutex<HashMap<Arc<str>, Arc<AtomicU32>>>,
}

impl Counters {
    fn for_node(&self, id: &Arc<str>) -> Arc<AtomicU32> {
        match self.by_node.lock() {
            Ok(mut map) => Arc::clone(map.entry(Arc::clone(id)).or_default()),
            Err(_) => Arc::default(),
        }
    }

    /// Forgets nodes that left the fleet and have nothing in flight.
    fn retain(&self, present: &[Node]) {
        if let Ok(mut map) = self.by_node.lock() {
            map.retain(|id, count| {
                present.iter().any(|n| n.id == *id) || count.load(std::sync::atomic::Ordering::Relaxed) > 0
            });
        }
    }
}

/// Builds the routing indices from the wire form. Nodes come sorted by id
/// (a `BTreeMap`), so equal inputs give equal snapshots.
pub fn decode(version: u64, nodes: &BTreeMap<String, SnapshotNode>, counters: &Counters) -> RoutingSnapshot {
    let mut snapshot = RoutingSnapshot { version, ..Default::default() };
    for wire in nodes.values() {
        let Some(status) = wire.status.as_ref() else { continue };
        let node_index = snapshot.nodes.len();
        let id: Arc<str> = Arc::from(status.node_id.as_str());
        let total: u64 = status.gpus.iter().map(|g| g.memory_total_bytes).sum();
        let used: u64 = status.gpus.iter().map(|g| g.memory_used_bytes).sum();
        let free_vram_bytes = total.saturating_sub(used);
        let mut backends = Vec::with_capacity(status.backends.len());
        for (backend_index, backend) in status.backends.iter().enumerate() {
            let target = Target { node: node_index, backend: backend_index };
            for model in &backend.models {
                snapshot.models.entry(model.id.clone()).or_default().push(Placement {
                    target,
                    state: model.state(),
                    context_window: model.context_window,
                    endpoints: model.endpoints().collect(),
                    free_vram_bytes,
                });
            }
            backends.push(BackendView {
                id: Arc::from(backend.id.as_str()),
                health: backend.health(),
                weight: backend.weight.max(1),
                slots_total: backend.slots_total,
                slots_busy: backend.slots_busy,
                requests_deferred: backend.requests_deferred,
                in_flight: backend.in_flight,
            });
        }
        for session in &status.sessions {
            if let Some(backend) = status.backends.iter().position(|b| b.id == session.backend_id) {
                snapshot.sessions.insert(session.key.clone(), Target { node: node_index, backend });
            }
        }
        snapshot.nodes.push(Node {
            local_in_flight: counters.for_node(&id),
            id,
            proxy_url: Arc::from(status.proxy_url.trim_end_matches('/')),
            draining: wire.draining,
            backends,
        });
    }
    let mut catalog: Vec<CatalogEntry> = snapshot
        .models
        .iter()
        .map(|(id, placements)| {
            let mut nodes: Vec<usize> = placements.iter().map(|p| p.target.node).collect();
            nodes.sort_unstable();
            nodes.dedup();
            let mut warm: Vec<usize> = placements
                .iter()
                .filter(|p| matches!(p.state, ModelState::Loaded | ModelState::Unknown))
                .map(|p| p.target.node)
                .collect();
            warm.sort_unstable();
            warm.dedup();
            CatalogEntry {
                id: id.clone(),
                warm_nodes: u32::try_from(warm.len()).unwrap_or(u32::MAX),
                nodes: u32::try_from(nodes.len()).unwrap_or(u32::MAX),
                context_window: placements.iter().map(|p| p.context_window).max().unwrap_or(0),
            }
        })
        .collect();
    catalog.sort_by(|a, b| a.id.cmp(&b.id));
    snapshot.catalog = catalog;
    counters.retain(&snapshot.nodes);
    snapshot
}

#[cfg(test)]
mod tests {
    use inferyes_proto::v1::{Backend, Model, NodeStatus, ResidentSession};

    use super::*;

    fn node(id: &str, models: &[(&str, ModelState)], sessions: &[&str]) -> SnapshotNode {
        SnapshotNode {
            status: Some(NodeStatus {
                node_id: id.into(),
                proxy_url: format!("http://{id}/"),
                backends: vec![Backend {
                    id: "b0".into(),
                    models: models
                        .iter()
                        .map(|(m, s)| {
                            let mut model = Model { id: (*m).into(), ..Default::default() };
                            model.set_state(*s);
                            model
                        })
                        .collect(),
                    ..Default::default()
                }],
                sessions: sessions
                    .iter()
                    .map(|k| ResidentSession { key: (*k).into(), backend_id: "b0".into(), ..Default::default() })
                    .collect(),
                ..Default::default()
            }),
            draining: false,
        }
    }

    #[test]
    fn indices_cover_models_sessions_and_catalog() {
        let mut nodes = BTreeMap::new();
        nodes.insert("a".to_string(), node("a", &[("chat", ModelState::Loaded)], &["s1"]));
        nodes.insert("b".to_string(), node("b", &[("chat", ModelState::Unloaded), ("embed", ModelState::Loaded)], &[]));
        let counters = Counters::default();
        let snapshot = decode(4, &nodes, &counters);
        assert_eq!(snapshot.version(), 4);
        assert_eq!(snapshot.placements("chat").map(<[Placement]>::len), Some(2));
        assert_eq!(snapshot.resident("s1"), Some(Target { node: 0, backend: 0 }));
        assert_eq!(snapshot.nodes()[0].proxy_url.as_ref(), "http://a");
        let chat = snapshot.model("chat").unwrap();
        assert_eq!((chat.warm_nodes, chat.nodes), (1, 2));
        assert!(snapshot.model("nope").is_none());
    }

    #[test]
    fn counters_outlive_snapshots() {
        let mut nodes = BTreeMap::new();
        nodes.insert("a".to_string(), node("a", &[], &[]));
        let counters = Counters::default();
        let first = decode(1, &nodes, &counters);
        first.nodes()[0].local_in_flight.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let second = decode(2, &nodes, &counters);
        assert!(Arc::ptr_eq(&first.nodes()[0].local_in_flight, &second.nodes()[0].local_in_flight));
    }
}
