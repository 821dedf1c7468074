//! The fleet as etcd describes it: pure state, changed only by applying
//! store events, in order. No I/O here.

use std::collections::BTreeMap;
use std::sync::Arc;

use inferyes_proto::v1::{
    ApiKey, ControllerRecord, DrainRecord, KeyUsageToday, NodePolicy, NodeRecord, PlacementOrders, RoutingPolicy,
};

use crate::store::{WatchBatch, WatchEvent};

#[derive(Clone, Debug, Default, PartialEq)]
pub struct FleetState {
    revision: u64,
    nodes: BTreeMap<String, Arc<NodeRecord>>,
    drains: BTreeMap<String, DrainRecord>,
    policy: RoutingPolicy,
    node_policies: BTreeMap<String, NodePolicy>,
    /// Alias → model id.
    aliases: BTreeMap<String, String>,
    /// Key id → API key. Changed as a whole value, so snapshots can tell
    /// "no key changed" by pointer.
    api_keys: Arc<BTreeMap<String, ApiKey>>,
    usage_today: Arc<KeyUsageToday>,
    /// Controller id → how its peers reach it.
    controllers: Arc<BTreeMap<String, ControllerRecord>>,
    /// The placement leader's outstanding orders.
    placement: Arc<PlacementOrders>,
}

impl FleetState {
    /// The state as of a full read of the prefix.
    pub fn from_load(batch: WatchBatch) -> FleetState {
        let mut state = FleetState::default();
        state.apply(batch);
        state
    }

    pub fn apply(&mut self, batch: WatchBatch) {
        for event in batch.events {
            match event {
                WatchEvent::NodePut(id, record) => {
                    self.nodes.insert(id, Arc::new(record));
                }
                WatchEvent::NodeDeleted(id) => {
                    self.nodes.remove(&id);
                }
                WatchEvent::DrainPut(id, record) => {
                    self.drains.insert(id, record);
                }
                WatchEvent::DrainDeleted(id) => {
                    self.drains.remove(&id);
                }
                WatchEvent::PolicyPut(policy) => self.policy = policy,
                WatchEvent::PolicyDeleted => self.policy = RoutingPolicy::default(),
                WatchEvent::NodePolicyPut(id, policy) => {
                    self.node_policies.insert(id, policy);
                }
                WatchEvent::NodePolicyDeleted(id) => {
                    self.node_policies.remove(&id);
                }
                WatchEvent::AliasPut(alias, record) => {
                    self.aliases.insert(alias, record.model);
                }
                WatchEvent::AliasDeleted(alias) => {
                    self.aliases.remove(&alias);
                }
                WatchEvent::ApiKeyPut(id, key) => {
                    Arc::make_mut(&mut self.api_keys).insert(id, key);
                }
                WatchEvent::UsageTodayPut(usage) => self.usage_today = Arc::new(usage),
                WatchEvent::UsageTodayDeleted => self.usage_today = Arc::default(),
                WatchEvent::ControllerPut(id, record) => {
                    Arc::make_mut(&mut self.controllers).insert(id, record);
                }
                WatchEvent::ControllerDeleted(id) => {
                    if self.controllers.contains_key(&id) {
                        Arc::make_mut(&mut self.controllers).remove(&id);
                    }
                }
                WatchEvent::PlacementPut(orders) => self.placement = Arc::new(orders),
                WatchEvent::PlacementDeleted => self.placement = Arc::default(),
                WatchEvent::ApiKeyDeleted(id) => {
                    if self.api_keys.contains_key(&id) {
                        Arc::make_mut(&mut self.api_keys).remove(&id);
                    }
                }
            }
        }
        self.revision = self.revision.max(batch.revision);
    }

    pub fn revision(&self) -> u64 {
        self.revision
    }

    pub fn nodes(&self) -> impl Iterator<Item = (&str, &Arc<NodeRecord>)> {
        self.nodes.iter().map(|(id, record)| (id.as_str(), record))
    }

    pub fn drain(&self, node_id: &str) -> Option<&DrainRecord> {
        self.drains.get(node_id)
    }

    pub fn policy(&self) -> &RoutingPolicy {
        &self.policy
    }

    pub fn node_policy(&self, node_id: &str) -> Option<&NodePolicy> {
        self.node_policies.get(node_id)
    }

    pub fn usage_today(&self) -> &Arc<KeyUsageToday> {
        &self.usage_today
    }

    pub fn api_keys(&self) -> &Arc<BTreeMap<String, ApiKey>> {
        &self.api_keys
    }

    pub fn controllers(&self) -> &Arc<BTreeMap<String, ControllerRecord>> {
        &self.controllers
    }

    pub fn placement(&self) -> &Arc<PlacementOrders> {
        &self.placement
    }

    pub fn has_node(&self, node_id: &str) -> bool {
        self.nodes.contains_key(node_id)
    }

    pub fn aliases(&self) -> impl Iterator<Item = (&str, &str)> {
        self.aliases.iter().map(|(a, m)| (a.as_str(), m.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use inferyes_proto::v1::{NodeRecord, NodeStatus};

    use super::*;

    fn record(id: &str) -> NodeRecord {
        NodeRecord { status: Some(NodeStatus { node_id: id.into(), ..Default::default() }), ..Default::default() }
    }

    #[test]
    fn events_apply_in_order_and_revision_never_goes_back() {
        let mut state = FleetState::from_load(WatchBatch {
            revision: 10,
            events: vec![WatchEvent::NodePut("a".into(), record("a"))],
        });
        state.apply(WatchBatch {
            revision: 12,
            events: vec![
                WatchEvent::NodePut("b".into(), record("b")),
                WatchEvent::NodeDeleted("a".into()),
                WatchEvent::DrainPut("b".into(), DrainRecord::default()),
            ],
        });
        assert_eq!(state.nodes().map(|(id, _)| id).collect::<Vec<_>>(), ["b"]);
        assert!(state.drain("b").is_some());
        assert_eq!(state.revision(), 12);
        state.apply(WatchBatch { revision: 11, events: vec![WatchEvent::DrainDeleted("b".into())] });
        assert_eq!(state.revision(), 12);
        assert!(state.drain("b").is_none());
    }

    #[test]
    fn replaying_events_is_idempotent() {
        let events = vec![
            WatchEvent::NodePut("a".into(), record("a")),
            WatchEvent::DrainPut("a".into(), DrainRecord::default()),
            WatchEvent::NodeDeleted("c".into()),
        ];
        let mut once = FleetState::default();
        once.apply(WatchBatch { revision: 3, events: events.clone() });
        let mut twice = once.clone();
        twice.apply(WatchBatch { revision: 3, events });
        assert_eq!(once, twice);
    }
}
