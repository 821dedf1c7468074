use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use inferyes_proto::v1::{Alias, Health, ModelState, RoutingPolicy, SnapshotNode, Strategy};

use super::{
    BackendView, CatalogEntry, Indices, LocalCounters, Node, Placement, Policy, Ring, RoutingSnapshot, Target,
    session_hash,
};

/// Per-node counters that survive snapshot swaps, so a request that started
/// under one snapshot is still counted under the next.
#[derive(Debug, Default)]
pub struct Counters {
    by_node: Mutex<HashMap<Arc<str>, Arc<LocalCounters>>>,
}

impl Counters {
    fn for_node(&self, id: &Arc<str>) -> Arc<LocalCounters> {
        match self.by_node.lock() {
            Ok(mut map) => Arc::clone(map.entry(Arc::clone(id)).or_default()),
            Err(_) => Arc::default(),
        }
    }

    /// Forgets nodes that left the fleet and have nothing in flight.
    fn retain(&self, present: &[Node]) {
        // A set, not a scan of `present` per node: a thousand nodes made
        // that a million comparisons per decode.
        let present: std::collections::HashSet<&str> = present.iter().map(|n| &*n.id).collect();
        if let Ok(mut map) = self.by_node.lock() {
            map.retain(|id, counters| {
                present.contains(&**id) || counters.in_flight.load(std::sync::atomic::Ordering::Relaxed) > 0
            });
        }
    }
}

fn resolve_policy(wire: Option<&RoutingPolicy>) -> Policy {
    let defaults = Policy::default();
    let Some(wire) = wire else { return defaults };
    let or = |value: f64, default: f64| if value > 0.0 { value } else { default };
    let strategy = |value: i32| Strategy::try_from(value).ok().filter(|s| *s != Strategy::Unspecified);
    Policy {
        admission_threshold: or(wire.admission_threshold, defaults.admission_threshold),
        hard_limit: or(wire.hard_limit, defaults.hard_limit),
        load_bound: or(wire.load_bound, defaults.load_bound).max(1.0),
        default_strategy: strategy(wire.default_strategy).unwrap_or(defaults.default_strategy),
        model_strategies: wire
            .model_strategies
            .iter()
            .filter_map(|(model, s)| strategy(*s).map(|s| (model.clone(), s)))
            .collect(),
        continue_all: wire.continue_broken_streams,
        continue_models: wire.continue_models.clone(),
    }
}

/// Builds the routing indices from the wire form. Nodes come sorted by id
/// (a `BTreeMap`), so equal inputs give equal snapshots.
pub fn decode(
    version: u64,
    nodes: &BTreeMap<String, SnapshotNode>,
    policy: Option<&RoutingPolicy>,
    aliases: &[Alias],
    counters: &Counters,
) -> RoutingSnapshot {
    let policy = resolve_policy(policy);
    let mut indices = Indices::default();
    for wire in nodes.values() {
        let Some(status) = wire.status.as_ref() else { continue };
        let node_index = indices.nodes.len();
        let id: Arc<str> = Arc::from(status.node_id.as_str());
        let key = crate::routing::stable_hash(id.as_bytes());
        let local = counters.for_node(&id);
        let vram_fraction = status
            .gpus
            .iter()
            .filter(|g| g.memory_total_bytes > 0)
            .map(|g| g.memory_used_bytes as f64 / g.memory_total_bytes as f64)
            .fold(0.0, f64::max);
        let vram_total_bytes: u64 = status.gpus.iter().map(|g| g.memory_total_bytes).sum();
        let vram_used_bytes: u64 = status.gpus.iter().map(|g| g.memory_used_bytes).sum();
        let vram_stale = status.gpus.iter().any(|g| g.stale);
        let vram_loading_bytes: u64 = status
            .backends
            .iter()
            .flat_map(|b| &b.models)
            .filter(|m| m.state() == ModelState::Loading)
            .map(|m| m.size_bytes)
            .fold(0, u64::saturating_add);
        let ready = !wire.draining && status.backends.iter().all(|b| b.health() == Health::Ready);
        if ready && !local.ready.swap(true, Ordering::Relaxed) {
            local.ready_since_version.store(version, Ordering::Relaxed);
        } else if !ready {
            local.ready.store(false, Ordering::Relaxed);
        }
        let own = wire.policy.as_ref();
        let or = |value: Option<f64>, default: f64| value.filter(|v| *v > 0.0).unwrap_or(default);
        let admission_threshold = or(own.map(|p| p.admission_threshold), policy.admission_threshold);
        let hard_limit = or(own.map(|p| p.hard_limit), policy.hard_limit);
        let mut backends = Vec::with_capacity(status.backends.len());
        for (backend_index, backend) in status.backends.iter().enumerate() {
            let view = BackendView {
                id: Arc::from(backend.id.as_str()),
                id_header: http::HeaderValue::from_str(&backend.id).ok(),
                health: backend.health(),
                weight: backend.weight.max(1),
                slots_total: backend.slots_total,
                slots_busy: backend.slots_busy,
                requests_deferred: backend.requests_deferred,
                in_flight: backend.in_flight,
            };
            let target = Target { node: node_index, backend: backend_index };
            let resident_sessions = status.sessions.iter().filter(|s| s.backend_id == backend.id).count();
            let resident_sessions = u32::try_from(resident_sessions).unwrap_or(u32::MAX);
            for model in &backend.models {
                indices.models.entry(model.id.clone()).or_default().push(Placement {
                    target,
                    state: model.state(),
                    context_window: model.context_window,
                    endpoints: model.endpoints().collect(),
                    size_bytes: model.size_bytes,
                    usable: view.health == Health::Ready && !wire.draining,
                    saturated: view.saturated(),
                    overloaded: view.overloaded(),
                    reported_in_flight: view.in_flight,
                    resident_sessions,
                    weight: view.weight,
                    node_key: key,
                    vram_fraction,
                    admission_threshold,
                    hard_limit,
                    vram_total_bytes,
                    vram_committed_bytes: vram_used_bytes.saturating_add(vram_loading_bytes),
                    vram_stale,
                    local: Arc::clone(&local),
                });
            }
            backends.push(view);
        }
        for session in &status.sessions {
            let Some(backend) = status.backends.iter().position(|b| b.id == session.backend_id) else { continue };
            // A session that moved is reported by both nodes until the old
            // one evicts it: the most recent use wins.
            let target = Target { node: node_index, backend };
            let seen = session.last_seen_unix_ms;
            match indices.sessions.entry(session_hash(&session.key)) {
                Entry::Occupied(mut held) if held.get().1 < seen => {
                    held.insert((target, seen));
                }
                Entry::Occupied(_) => {}
                Entry::Vacant(slot) => {
                    slot.insert((target, seen));
                }
            }
        }
        indices.nodes.push(Node {
            local,
            key,
            id_header: http::HeaderValue::from_str(&id).ok(),
            id,
            proxy_url: inferyes_proto::base_url::BaseUrl::new(&status.proxy_url),
            proxy_http2: status.proxy_http2,
            draining: wire.draining,
            backends,
            vram_fraction,
            vram_total_bytes,
            vram_used_bytes,
            vram_loading_bytes,
            admission_threshold,
            hard_limit,
        });
    }
    for (model, placements) in &indices.models {
        if placements.len() < super::RING_MIN_PLACEMENTS {
            continue;
        }
        let mut ring = Ring::default();
        for (index, p) in placements.iter().enumerate() {
            for v in 0..super::RING_POINTS {
                let point = crate::routing::rendezvous_score(p.node_key ^ p.target.backend as u64, v);
                ring.points.push((point, u32::try_from(index).unwrap_or(u32::MAX)));
            }
            if p.usable {
                ring.ready_placements += 1;
                ring.resident_sessions += u64::from(p.resident_sessions);
            }
        }
        ring.points.sort_unstable();
        indices.rings.insert(model.clone(), ring);
    }
    let mut catalog: Vec<CatalogEntry> = indices
        .models
        .iter()
        .map(|(id, placements)| {
            let distinct = |warm_only: bool| {
                let mut nodes: Vec<usize> = placements
                    .iter()
                    .filter(|p| !warm_only || matches!(p.state, ModelState::Loaded | ModelState::Unknown))
                    .map(|p| p.target.node)
                    .collect();
                nodes.sort_unstable();
                nodes.dedup();
                u32::try_from(nodes.len()).unwrap_or(u32::MAX)
            };
            CatalogEntry {
                id: id.clone(),
                alias_of: None,
                warm_nodes: distinct(true),
                nodes: distinct(false),
                context_window: placements.iter().map(|p| p.context_window).max().unwrap_or(0),
            }
        })
        .collect();
    for alias in aliases {
        // An alias of a model the fleet does not serve right now is still
        // listed: a request for it gets the model's own error.
        let target = catalog.iter().find(|e| e.id == alias.model).cloned();
        if indices.models.contains_key(&alias.alias) {
            continue;
        }
        indices.aliases.insert(alias.alias.clone(), alias.model.clone());
        let mut entry = target.unwrap_or(CatalogEntry {
            id: String::new(),
            alias_of: None,
            warm_nodes: 0,
            nodes: 0,
            context_window: 0,
        });
        entry.id = alias.alias.clone();
        entry.alias_of = Some(alias.model.clone());
        catalog.push(entry);
    }
    catalog.sort_by(|a, b| a.id.cmp(&b.id));
    indices.catalog = catalog;
    indices.policy = policy;
    counters.retain(&indices.nodes);
    RoutingSnapshot { version, indices: Arc::new(indices), ..Default::default() }
}

#[cfg(test)]
mod tests {
    use inferyes_proto::v1::{Backend, Gpu, Model, NodePolicy, NodeStatus, ResidentSession};

    use super::*;

    fn node(id: &str, models: &[(&str, ModelState)], sessions: &[&str]) -> SnapshotNode {
        SnapshotNode {
            status: Some(NodeStatus {
                node_id: id.into(),
                proxy_url: format!("http://{id}/"),
                gpus: vec![
                    Gpu { memory_total_bytes: 100, memory_used_bytes: 50, ..Default::default() },
                    Gpu { memory_total_bytes: 100, memory_used_bytes: 90, ..Default::default() },
                ],
                backends: vec![Backend {
                    id: "b0".into(),
                    models: models
                        .iter()
                        .map(|(m, s)| {
                            let mut model = Model { id: (*m).into(), size_bytes: 7, ..Default::default() };
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
            policy: None,
        }
    }

    #[test]
    fn indices_cover_models_sessions_aliases_and_catalog() {
        let mut nodes = BTreeMap::new();
        nodes.insert("a".to_string(), node("a", &[("chat", ModelState::Loaded)], &["s1"]));
        nodes
            .insert("b".to_string(), node("b", &[("chat", ModelState::Unloaded), ("embed", ModelState::Loading)], &[]));
        let aliases = [Alias { alias: "gpt-4o".into(), model: "chat".into() }];
        let snapshot = decode(4, &nodes, None, &aliases, &Counters::default());
        assert_eq!(snapshot.version(), 4);
        assert_eq!(snapshot.placements("chat").map(<[Placement]>::len), Some(2));
        let chat = snapshot.placements("chat").unwrap();
        assert!(
            chat.windows(2).all(|w| (w[0].target.node, w[0].target.backend) < (w[1].target.node, w[1].target.backend))
        );
        assert_eq!(snapshot.resident("s1"), Some(Target { node: 0, backend: 0 }));
        assert_eq!(snapshot.nodes()[0].proxy_url.as_str(), "http://a");
        assert!((snapshot.nodes()[0].vram_fraction - 0.9).abs() < 1e-9, "the fullest GPU counts");
        assert_eq!(snapshot.nodes()[1].vram_loading_bytes, 7);
        let chat = snapshot.model("chat").unwrap();
        assert_eq!((chat.warm_nodes, chat.nodes), (1, 2));
        assert_eq!(snapshot.resolve("gpt-4o"), "chat");
        assert_eq!(snapshot.resolve("chat"), "chat");
        let alias = snapshot.model("gpt-4o").unwrap();
        assert_eq!((alias.alias_of.as_deref(), alias.nodes), (Some("chat"), 2));
        assert!(snapshot.model("nope").is_none());
    }

    #[test]
    fn policies_fill_in_defaults_and_node_overrides_win() {
        let mut nodes = BTreeMap::new();
        nodes.insert("a".to_string(), node("a", &[], &[]));
        let mut b = node("b", &[], &[]);
        b.policy = Some(NodePolicy { admission_threshold: 0.8, hard_limit: 0.0 });
        nodes.insert("b".to_string(), b);
        let policy = RoutingPolicy { hard_limit: 0.95, ..Default::default() };
        let snapshot = decode(1, &nodes, Some(&policy), &[], &Counters::default());
        let thresholds: Vec<(f64, f64)> =
            snapshot.nodes().iter().map(|n| (n.admission_threshold, n.hard_limit)).collect();
        assert_eq!(thresholds, [(0.92, 0.95), (0.8, 0.95)]);
        assert_eq!(snapshot.policy().load_bound, 1.25);
    }

    #[test]
    fn counters_outlive_snapshots() {
        let mut nodes = BTreeMap::new();
        nodes.insert("a".to_string(), node("a", &[], &[]));
        let counters = Counters::default();
        let first = decode(1, &nodes, None, &[], &counters);
        first.nodes()[0].local.in_flight.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let second = decode(2, &nodes, None, &[], &counters);
        assert!(Arc::ptr_eq(&first.nodes()[0].local, &second.nodes()[0].local));
    }
}
