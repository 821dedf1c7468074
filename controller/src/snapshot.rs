//! Routing snapshots: built from the fleet state, served to data planes as a
//! full message followed by deltas. Pure: no I/O.

use std::collections::BTreeMap;
use std::sync::Arc;

use inferyes_proto::v1::{
    Alias, ApiKey, ControllerRecord, KeySet, KeyUsageToday, ModelPlacement, ModelState, ModelSummary, MoveTarget,
    NodeRecord, PlacementOrder, PlacementOrders, RoutingPolicy, RoutingSnapshot, SnapshotDelta, SnapshotNode,
};

use crate::fleet::FleetState;
use crate::live::{self, LiveView};

/// An immutable routing snapshot. Nodes are shared between consecutive
/// snapshots when they did not change, so building, comparing and diffing
/// them is mostly pointer checks: with a thousand nodes a change to one
/// costs one node's copy, not a thousand.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    version: u64,
    nodes: BTreeMap<String, Arc<SnapshotNode>>,
    /// The fleet state's record each node was built from: an unchanged
    /// record (the same `Arc`) means an unchanged node.
    sources: BTreeMap<String, Arc<NodeRecord>>,
    /// The fleet's controllers, this one included.
    controllers: Arc<BTreeMap<String, ControllerRecord>>,
    policy: RoutingPolicy,
    /// Sorted by alias.
    aliases: Vec<Alias>,
    /// By key id; the fleet state's own map, shared.
    api_keys: Arc<BTreeMap<String, ApiKey>>,
    usage_today: Arc<KeyUsageToday>,
    /// Placement's outstanding orders: for the agents' streams, not for
    /// data planes.
    placement: Arc<PlacementOrders>,
    /// Every backend that can take a moved slot (`moves::movable`): each
    /// agent stream sends its node the others'. Shared with the previous
    /// snapshot while unchanged, so a stream sees at a pointer's cost
    /// whether to send anything.
    movable: Arc<Vec<MoveTarget>>,
}

impl PartialEq for Snapshot {
    fn eq(&self, other: &Snapshot) -> bool {
        self.version == other.version
            && self.policy == other.policy
            && self.aliases == other.aliases
            && (Arc::ptr_eq(&self.api_keys, &other.api_keys) || self.api_keys == other.api_keys)
            && self.usage_today == other.usage_today
            && self.placement == other.placement
            && (Arc::ptr_eq(&self.controllers, &other.controllers) || self.controllers == other.controllers)
            && self.nodes.len() == other.nodes.len()
            && self.nodes.iter().zip(&other.nodes).all(|((a_id, a), (b_id, b))| a_id == b_id && same_node(a, b))
    }
}

fn same_node(a: &Arc<SnapshotNode>, b: &Arc<SnapshotNode>) -> bool {
    Arc::ptr_eq(a, b) || a == b
}

impl Snapshot {
    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn nodes(&self) -> impl Iterator<Item = &SnapshotNode> {
        self.nodes.values().map(|n| n.as_ref())
    }

    /// The record `node_id`'s node was built from.
    pub fn record(&self, node_id: &str) -> Option<&NodeRecord> {
        self.sources.get(node_id).map(|r| r.as_ref())
    }

    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    pub fn node(&self, node_id: &str) -> Option<&SnapshotNode> {
        self.nodes.get(node_id).map(|n| n.as_ref())
    }

    pub fn policy(&self) -> &RoutingPolicy {
        &self.policy
    }

    pub fn aliases(&self) -> &[Alias] {
        &self.aliases
    }

    pub fn api_keys(&self) -> impl Iterator<Item = &ApiKey> {
        self.api_keys.values()
    }

    /// Tokens each key used today, by the fleet's roll-up.
    pub fn usage_today(&self) -> &KeyUsageToday {
        &self.usage_today
    }

    pub fn api_key(&self, key_id: &str) -> Option<&ApiKey> {
        self.api_keys.get(key_id)
    }

    /// The tenant of key `key_id` as the fleet knows it now; empty for a
    /// key of no tenant, or none.
    pub fn tenant_of(&self, key_id: &str) -> String {
        self.api_key(key_id).map(|key| key.tenant.clone()).unwrap_or_default()
    }

    /// The node as the fleet sees it: its record with its load and its
    /// resident sessions counted, from `live`.
    pub fn merged(&self, node_id: &str, live: &LiveView) -> Option<SnapshotNode> {
        self.nodes.get(node_id).map(|node| merge(node, live))
    }

    /// Every node as the fleet sees it, sorted by id.
    pub fn merged_nodes<'a>(&'a self, live: &'a LiveView) -> impl Iterator<Item = SnapshotNode> + 'a {
        self.nodes.values().map(move |node| merge(node, live))
    }

    /// Every backend that can take a moved slot, shared while unchanged.
    pub fn movable(&self) -> &Arc<Vec<MoveTarget>> {
        &self.movable
    }

    /// Placement's outstanding orders, fleet-wide.
    pub fn placement(&self) -> &PlacementOrders {
        &self.placement
    }

    /// The outstanding orders for one node, in the order they were issued.
    pub fn orders_for(&self, node_id: &str) -> Vec<PlacementOrder> {
        self.placement.orders.iter().filter(|o| o.node_id == node_id).cloned().collect()
    }

    pub fn controllers(&self) -> impl Iterator<Item = &ControllerRecord> {
        self.controllers.values()
    }

    pub fn to_full(&self) -> RoutingSnapshot {
        RoutingSnapshot {
            version: self.version,
            nodes: self.nodes.values().map(|n| SnapshotNode::clone(n)).collect(),
            policy: Some(self.policy.clone()),
            aliases: self.aliases.clone(),
            keys: self.api_keys.values().cloned().collect(),
            usage_today: Some(KeyUsageToday::clone(&self.usage_today)),
            live: Vec::new(),
            live_state: true,
            // The routing service's, not the fleet's state.
            proxy_credential: String::new(),
            proxy_key: String::new(),
            node_key: String::new(),
        }
    }
}

fn merge(node: &SnapshotNode, live: &LiveView) -> SnapshotNode {
    let Some(status) = node.status.as_ref() else { return node.clone() };
    let summary = live.nodes.get(&status.node_id).map(Arc::as_ref);
    SnapshotNode {
        status: Some(live::merge(status, summary)),
        draining: node.draining,
        policy: node.policy,
        instance_digest: node.instance_digest.clone(),
    }
}

/// Builds the snapshot for `state`, reusing `previous`'s unchanged nodes.
pub fn build(state: &FleetState, previous: Option<&Snapshot>) -> Snapshot {
    let mut nodes = BTreeMap::new();
    let mut sources = BTreeMap::new();
    for (id, record) in state.nodes() {
        if record.status.is_none() {
            continue;
        }
        let draining = state.drain(id).is_some();
        let policy = state.node_policy(id);
        let old = previous.and_then(|p| Some((p.nodes.get(id)?, p.sources.get(id)?)));
        let shared = match old {
            // The same record, drain and override: the same node.
            Some((node, source))
                if Arc::ptr_eq(source, record) && node.draining == draining && node.policy.as_ref() == policy =>
            {
                Arc::clone(node)
            }
            _ => {
                let node = SnapshotNode {
                    status: record.status.clone(),
                    draining,
                    policy: policy.cloned(),
                    instance_digest: record.instance_digest.clone(),
                };
                match old {
                    // Rewritten but equal (a lease renewal, a controller
                    // restart): keep the old one, so deltas skip it.
                    Some((previous, _)) if **previous == node => Arc::clone(previous),
                    _ => Arc::new(node),
                }
            }
        };
        nodes.insert(id.to_string(), shared);
        sources.insert(id.to_string(), Arc::clone(record));
    }
    let aliases = state.aliases().map(|(alias, model)| Alias { alias: alias.into(), model: model.into() }).collect();
    let movable = crate::moves::movable(nodes.values().map(AsRef::as_ref));
    let movable = match previous {
        Some(previous) if *previous.movable == movable => Arc::clone(&previous.movable),
        _ => Arc::new(movable),
    };
    Snapshot {
        movable,
        version: state.revision(),
        nodes,
        sources,
        policy: state.policy().clone(),
        aliases,
        api_keys: Arc::clone(state.api_keys()),
        usage_today: Arc::clone(state.usage_today()),
        controllers: Arc::clone(state.controllers()),
        placement: Arc::clone(state.placement()),
    }
}

/// What a receiver holding `from` needs to arrive at `to`.
pub fn delta(from: &Snapshot, to: &Snapshot) -> SnapshotDelta {
    let upserted = to
        .nodes
        .iter()
        .filter(|(id, node)| from.nodes.get(*id).is_none_or(|old| !same_node(old, node)))
        .map(|(_, node)| SnapshotNode::clone(node))
        .collect();
    let removed = from.nodes.keys().filter(|id| !to.nodes.contains_key(*id)).cloned().collect();
    SnapshotDelta {
        version: to.version,
        base_version: from.version,
        upserted,
        removed,
        policy: Some(to.policy.clone()),
        aliases: to.aliases.clone(),
        keys: (!Arc::ptr_eq(&from.api_keys, &to.api_keys) && from.api_keys != to.api_keys)
            .then(|| KeySet { keys: to.api_keys.values().cloned().collect() }),
        usage_today: (from.usage_today != to.usage_today).then(|| KeyUsageToday::clone(&to.usage_today)),
    }
}

/// Applies a delta to a full snapshot message: the receiver's side of
/// [`delta`], kept here so the two cannot drift. Data planes have their own
/// decoder; this one backs the tests and `inferyesctl`.
pub fn apply_delta(full: &mut RoutingSnapshot, delta: SnapshotDelta) {
    let mut nodes: BTreeMap<String, SnapshotNode> =
        std::mem::take(&mut full.nodes).into_iter().map(|n| (node_id(&n).to_string(), n)).collect();
    for id in &delta.removed {
        nodes.remove(id);
    }
    for node in delta.upserted {
        nodes.insert(node_id(&node).to_string(), node);
    }
    full.nodes = nodes.into_values().collect();
    full.version = delta.version;
    full.policy = delta.policy;
    full.aliases = delta.aliases;
    if let Some(keys) = delta.keys {
        full.keys = keys.keys;
    }
    if let Some(usage) = delta.usage_today {
        full.usage_today = Some(usage);
    }
}

fn node_id(node: &SnapshotNode) -> &str {
    node.status.as_ref().map(|s| s.node_id.as_str()).unwrap_or_default()
}

/// The fleet's model catalog: one entry per model id, with where it is
/// loaded and where it could be.
pub fn model_summaries(snapshot: &Snapshot) -> Vec<ModelSummary> {
    let mut models: BTreeMap<&str, ModelSummary> = BTreeMap::new();
    for status in snapshot.nodes().filter_map(|n| n.status.as_ref()) {
        for (backend, model) in status.backends.iter().flat_map(|b| b.models.iter().map(move |m| (b, m))) {
            let summary =
                models.entry(&model.id).or_insert_with(|| ModelSummary { id: model.id.clone(), ..Default::default() });
            summary.placements.push(ModelPlacement {
                node_id: status.node_id.clone(),
                backend_id: backend.id.clone(),
                state: model.state,
                endpoints: model.endpoints.clone(),
                unsupported: model.unsupported.clone(),
            });
            if !summary.available_on.contains(&status.node_id) {
                summary.available_on.push(status.node_id.clone());
            }
            if model.state() == ModelState::Loaded && !summary.loaded_on.contains(&status.node_id) {
                summary.loaded_on.push(status.node_id.clone());
            }
            summary.context_window = summary.context_window.max(model.context_window);
            summary.desired_replicas = inferyes_proto::replicas(&snapshot.policy, &model.id).min;
            for endpoint in &model.endpoints {
                if !summary.endpoints.contains(endpoint) {
                    summary.endpoints.push(*endpoint);
                }
            }
        }
    }
    for order in &snapshot.placement.orders {
        if let Some(summary) = models.get_mut(order.model.as_str()) {
            summary.orders.push(order.clone());
        }
    }
    models.into_values().collect()
}

#[cfg(test)]
mod tests {
    use inferyes_proto::v1::{DrainRecord, NodeRecord, NodeStatus};

    use super::*;
    use crate::store::{WatchBatch, WatchEvent};

    fn put(id: &str, proxy: &str) -> WatchEvent {
        WatchEvent::NodePut(
            id.into(),
            NodeRecord {
                status: Some(NodeStatus { node_id: id.into(), proxy_url: proxy.into(), ..Default::default() }),
                ..Default::default()
            },
        )
    }

    fn state(revision: u64, events: Vec<WatchEvent>) -> FleetState {
        FleetState::from_load(WatchBatch { revision, events })
    }

    #[test]
    fn build_is_deterministic_and_marks_drains() {
        let s = state(
            7,
            vec![put("b", "http://b"), put("a", "http://a"), WatchEvent::DrainPut("b".into(), DrainRecord::default())],
        );
        let one = build(&s, None);
        let two = build(&s, None);
        assert_eq!(one, two);
        assert_eq!(one.version(), 7);
        let full = one.to_full();
        let ids: Vec<_> = full.nodes.iter().map(node_id).collect();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!(full.nodes.iter().map(|n| n.draining).collect::<Vec<_>>(), [false, true]);
    }

    #[test]
    fn a_rebuild_copies_only_the_nodes_whose_records_changed() {
        let mut fleet = state(3, vec![put("a", "http://a"), put("b", "http://b")]);
        let first = build(&fleet, None);
        fleet.apply(WatchBatch { revision: 4, events: vec![put("b", "http://b2")] });
        let second = build(&fleet, Some(&first));
        assert!(Arc::ptr_eq(&first.nodes["a"], &second.nodes["a"]));
        assert!(!Arc::ptr_eq(&first.nodes["b"], &second.nodes["b"]));
        // A drain changes the node without a new record.
        fleet.apply(WatchBatch { revision: 5, events: vec![WatchEvent::DrainPut("a".into(), DrainRecord::default())] });
        let third = build(&fleet, Some(&second));
        assert!(third.nodes["a"].draining);
        assert!(Arc::ptr_eq(&second.nodes["b"], &third.nodes["b"]));
        // A record rewritten with the same content keeps its node: no delta.
        fleet.apply(WatchBatch { revision: 6, events: vec![put("b", "http://b2")] });
        let fourth = build(&fleet, Some(&third));
        assert!(Arc::ptr_eq(&third.nodes["b"], &fourth.nodes["b"]));
        assert!(delta(&third, &fourth).upserted.is_empty());
    }

    #[test]
    fn delta_applied_to_the_old_snapshot_gives_the_new_one() {
        let old = build(&state(5, vec![put("a", "http://a"), put("b", "http://b")]), None);
        let mut next_state = state(5, vec![put("a", "http://a"), put("b", "http://b")]);
        next_state.apply(WatchBatch {
            revision: 9,
            events: vec![WatchEvent::NodeDeleted("a".into()), put("b", "http://b2"), put("c", "http://c")],
        });
        let new = build(&next_state, Some(&old));
        let d = delta(&old, &new);
        assert_eq!(d.removed, ["a"]);
        assert_eq!(d.upserted.len(), 2);
        assert_eq!((d.base_version, d.version), (5, 9));
        let mut full = old.to_full();
        apply_delta(&mut full, d);
        assert_eq!(full, new.to_full());
    }

    #[test]
    fn unchanged_nodes_are_shared_and_not_resent() {
        let s = state(3, vec![put("a", "http://a")]);
        let old = build(&s, None);
        let mut s2 = s.clone();
        s2.apply(WatchBatch { revision: 4, events: vec![put("a", "http://a")] });
        let new = build(&s2, Some(&old));
        assert!(Arc::ptr_eq(&old.nodes["a"], &new.nodes["a"]));
        assert!(delta(&old, &new).upserted.is_empty());
    }
}
