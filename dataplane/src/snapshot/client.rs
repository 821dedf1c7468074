//! Follows a controller's snapshot stream, failing over between controllers
//! with jittered backoff. While none is reachable the store keeps its last
//! snapshot and requests go on being routed on it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use inferyes_proto::v1::{Alias, RoutingPolicy, SnapshotNode, SubscribeRequest, snapshot_update};

use tokio_util::sync::CancellationToken;

use super::{Indices, Live, RoutingSnapshot, SnapshotStore, decode_live};

pub async fn run(
    store: Arc<SnapshotStore>,
    controllers: crate::Controllers,
    dataplane_id: String,
    shutdown: CancellationToken,
) {
    let mut backoff = inferyes_net::backoff::RECONNECT;
    let mut next = 0usize;
    // Outlives each stream: the next controller's full snapshot replaces
    // what this one held, node by node, in the one session index.
    let mut view = WireView::new(Arc::clone(store.sessions()));
    loop {
        let address = &controllers.addresses[next % controllers.addresses.len()];
        next += 1;
        tokio::select! {
            () = shutdown.cancelled() => return,
            result = follow(&store, &mut view, &controllers, address, &dataplane_id) => {
                match result {
                    Ok(received) => {
                        if received {
                            backoff.reset();
                        }
                        tracing::warn!(controller = %address, "snapshot stream ended; trying the next controller");
                    }
                    Err(error) => tracing::warn!(controller = %address, %error, "snapshot stream failed; trying the next controller"),
                }
            }
        }
        if backoff.sleep(&shutdown).await {
            return;
        }
    }
}

/// One subscription. Returns whether any update arrived, once the stream
/// ends or breaks.
async fn follow(
    store: &SnapshotStore,
    view: &mut WireView,
    controllers: &crate::Controllers,
    address: &str,
    dataplane_id: &str,
) -> anyhow::Result<bool> {
    let channel = controllers.stream_endpoint(address)?.connect().await?;
    let mut stream = controllers
        .client(channel)
        .max_decoding_message_size(256 << 20)
        .subscribe(SubscribeRequest { dataplane_id: dataplane_id.to_string() })
        .await?
        .into_inner();
    // This stream's last decoded indices: a next snapshot that changes only
    // keys, usage or the version shares them, not decoded again.
    let mut decoded: Option<Arc<Indices>> = None;
    let mut received = false;
    let mut ended = false;
    while !ended {
        let Some(update) = stream.message().await? else { break };
        let mut controller = update.controller_id.clone();
        let mut reroutes = view.apply(update)?;
        // Updates that arrived while the last decode ran are folded in
        // first: a busy data plane decodes the latest state once instead of
        // falling behind decoding every intermediate one.
        while let Ok(next) = tokio::time::timeout(Duration::ZERO, stream.message()).await {
            match next? {
                Some(update) => {
                    controller.clone_from(&update.controller_id);
                    reroutes |= view.apply(update)?;
                }
                None => {
                    ended = true;
                    break;
                }
            }
        }
        received = true;
        let version = view.version;
        let snapshot = view.snapshot(decoded.take().filter(|_| !reroutes), store.node_states());
        decoded = Some(Arc::clone(&snapshot.indices));
        if store.publish(snapshot) {
            tracing::debug!(version, nodes = view.nodes.len(), %controller, "snapshot installed");
        } else {
            tracing::debug!(version, "snapshot older than the one held; waiting for this controller to catch up");
        }
    }
    Ok(received)
}

/// The wire form of one stream's view, which deltas apply to.
#[derive(Default)]
struct WireView {
    version: u64,
    nodes: BTreeMap<String, SnapshotNode>,
    /// The nodes' load and sessions; the sessions' index is the store's,
    /// shared by every snapshot.
    live: Live,
    /// The controller's full snapshot said it sends no live state
    /// (`live_state` false): each node's status carries its load and
    /// sessions, read from there.
    live_in_statuses: bool,
    policy: Option<RoutingPolicy>,
    aliases: Vec<Alias>,
    api_keys: Arc<super::ApiKeys>,
    usage_today: Arc<inferyes_proto::v1::KeyUsageToday>,
    agent_credentials: crate::targets::AgentCredentials,
}

impl WireView {
    fn new(sessions: Arc<super::SessionIndex>) -> WireView {
        WireView { live: Live::new(sessions), ..WireView::default() }
    }

    /// Applies an update; returns whether it changed what routing is built
    /// from (nodes, policy, aliases), not only keys, usage or the version.
    fn apply(&mut self, update: inferyes_proto::v1::SnapshotUpdate) -> anyhow::Result<bool> {
        let reroutes = match update.update {
            Some(snapshot_update::Update::Full(full)) => {
                self.version = full.version;
                self.nodes = full.nodes.into_iter().map(|n| (node_id(&n), n)).collect();
                self.policy = full.policy;
                self.aliases = full.aliases;
                self.api_keys = Arc::new(full.keys.into_iter().map(|k| (k.key_id.clone(), Arc::new(k))).collect());
                self.usage_today = Arc::new(full.usage_today.unwrap_or_default());
                self.live_in_statuses = !full.live_state;
                self.agent_credentials = crate::targets::AgentCredentials {
                    node_key: (!full.node_key.is_empty()).then(|| Arc::from(full.node_key.as_str())),
                    key: (!full.proxy_key.is_empty()).then(|| Arc::from(full.proxy_key.as_str())),
                    fleet: (!full.proxy_credential.is_empty())
                        .then(|| inferyes_proto::bearer::header_value(&full.proxy_credential))
                        .flatten(),
                };
                let nodes = &self.nodes;
                self.live.apply_full(full.live, |id| nodes.contains_key(id));
                true
            }
            // Load and resident counts are read at decode.
            Some(snapshot_update::Update::Live(delta)) => self.live.apply(delta),
            Some(snapshot_update::Update::Delta(delta)) => {
                if delta.base_version != self.version {
                    anyhow::bail!(
                        "delta for version {} but holding {}; resubscribing",
                        delta.base_version,
                        self.version
                    );
                }
                let reroutes = !delta.removed.is_empty()
                    || !delta.upserted.is_empty()
                    || self.policy != delta.policy
                    || self.aliases != delta.aliases;
                for id in &delta.removed {
                    self.nodes.remove(id);
                    // Kept as stale by a full snapshot that did not list
                    // it, its sessions go with its record.
                    self.live.remove(id);
                }
                for node in delta.upserted {
                    self.nodes.insert(node_id(&node), node);
                }
                self.version = delta.version;
                self.policy = delta.policy;
                self.aliases = delta.aliases;
                if let Some(usage) = delta.usage_today {
                    self.usage_today = Arc::new(usage);
                }
                if let Some(keys) = delta.keys {
                    self.api_keys = Arc::new(keys.keys.into_iter().map(|k| (k.key_id.clone(), Arc::new(k))).collect());
                }
                reroutes
            }
            None => false,
        };
        if self.live_in_statuses && reroutes {
            // No live state on the wire: made again from the statuses
            // whenever the nodes change.
            self.live.apply_full(super::live::of_statuses(&self.nodes), |_| false);
        }
        Ok(reroutes)
    }
}

impl WireView {
    /// The routing snapshot of this view: routed by `indices` where given
    /// (nothing they are made of changed since), else by indices decoded
    /// anew; with the view's keys and usage either way.
    fn snapshot(&self, indices: Option<Arc<Indices>>, states: &crate::targets::NodeStates) -> RoutingSnapshot {
        let indices = indices.unwrap_or_else(|| {
            let (policy, aliases, credentials) = (self.policy.as_ref(), &self.aliases, &self.agent_credentials);
            decode_live(self.version, &self.nodes, &self.live, policy, aliases, (states, credentials)).indices
        });
        RoutingSnapshot {
            version: self.version,
            indices,
            sessions: Arc::clone(self.live.index()),
            api_keys: Arc::clone(&self.api_keys),
            usage_today: Arc::clone(&self.usage_today),
        }
    }
}

fn node_id(node: &SnapshotNode) -> String {
    node.status.as_ref().map(|s| s.node_id.clone()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use inferyes_proto::v1::{KeyUsageToday, NodeStatus, SnapshotDelta, SnapshotUpdate};

    use super::*;

    fn node(id: &str) -> SnapshotNode {
        SnapshotNode {
            status: Some(NodeStatus { node_id: id.into(), proxy_url: format!("http://{id}/"), ..Default::default() }),
            ..Default::default()
        }
    }

    fn delta(view: &WireView, change: impl FnOnce(&mut SnapshotDelta)) -> SnapshotUpdate {
        let mut delta = SnapshotDelta {
            version: view.version + 1,
            base_version: view.version,
            policy: view.policy.clone(),
            aliases: view.aliases.clone(),
            ..Default::default()
        };
        change(&mut delta);
        SnapshotUpdate { update: Some(snapshot_update::Update::Delta(delta)), ..Default::default() }
    }

    #[test]
    fn only_nodes_policy_and_aliases_change_how_requests_are_routed() {
        let mut view = WireView::default();
        let full = inferyes_proto::v1::RoutingSnapshot { version: 1, nodes: vec![node("a")], ..Default::default() };
        assert!(
            view.apply(SnapshotUpdate { update: Some(snapshot_update::Update::Full(full)), ..Default::default() })
                .unwrap()
        );
        let usage = KeyUsageToday { day: "20261130".into(), tokens: [("k".to_string(), 9)].into() };
        let keys_and_usage = delta(&view, |d| {
            d.usage_today = Some(usage.clone());
            d.keys = Some(Default::default());
        });
        assert!(!view.apply(keys_and_usage).unwrap());
        assert_eq!((view.version, view.usage_today.tokens["k"]), (2, 9));
        assert!(!view.apply(delta(&view, |_| {})).unwrap(), "the version alone");
        assert!(view.apply(delta(&view, |d| d.upserted = vec![node("b")])).unwrap());
        assert!(view.apply(delta(&view, |d| d.removed = vec!["b".into()])).unwrap());
        assert!(
            view.apply(delta(&view, |d| d.policy = Some(RoutingPolicy { hard_limit: 0.5, ..Default::default() })))
                .unwrap()
        );
        let alias = Alias { alias: "fast".into(), model: "m".into() };
        assert!(view.apply(delta(&view, |d| d.aliases = vec![alias])).unwrap());
        assert!(view.apply(delta(&view, |d| d.base_version = 0)).is_err(), "a delta for another version");
    }

    fn live_node(id: &str, sessions: &[&str]) -> inferyes_proto::v1::LiveNode {
        use inferyes_proto::v1::{BackendLoad, NodeLoad, SessionEntry};
        inferyes_proto::v1::LiveNode {
            node_id: id.into(),
            load: Some(NodeLoad {
                backends: vec![BackendLoad { backend_id: "b0".into(), slots_busy: 3, ..Default::default() }],
                gpus: Vec::new(),
                moves: None,
            }),
            sessions_full: true,
            upserted: sessions
                .iter()
                .map(|k| SessionEntry { key: super::super::session_hash(k), ..Default::default() })
                .collect(),
            ..Default::default()
        }
    }

    fn with_backend(id: &str) -> SnapshotNode {
        let mut node = node(id);
        node.status.as_mut().unwrap().backends =
            vec![inferyes_proto::v1::Backend { id: "b0".into(), ..Default::default() }];
        node
    }

    #[test]
    fn live_deltas_route_without_changing_the_version_and_a_new_stream_replaces_them() {
        let states = crate::targets::NodeStates::default();
        let index = Arc::new(super::super::SessionIndex::default());
        let mut view = WireView::new(Arc::clone(&index));
        let full = inferyes_proto::v1::RoutingSnapshot {
            version: 5,
            nodes: vec![with_backend("a"), with_backend("b")],
            live: vec![live_node("a", &["s1", "s2"])],
            live_state: true,
            ..Default::default()
        };
        view.apply(SnapshotUpdate { update: Some(snapshot_update::Update::Full(full.clone())), ..Default::default() })
            .unwrap();
        let first = view.snapshot(None, &states);
        assert_eq!(first.resident("s1").map(|r| r.target.node), Some(0));
        assert_eq!(first.nodes()[0].backends[0].slots_busy, 3);
        assert!(first.nodes()[1].backends[0].load_unknown, "no live state: its load is not known");

        let removal = inferyes_proto::v1::LiveDelta {
            nodes: vec![inferyes_proto::v1::LiveNode {
                node_id: "a".into(),
                removed: vec![super::super::session_hash("s1")],
                ..Default::default()
            }],
            gone: Vec::new(),
        };
        let update = SnapshotUpdate { update: Some(snapshot_update::Update::Live(removal)), ..Default::default() };
        assert!(view.apply(update).unwrap(), "decoded again: load and counts may have changed");
        let second = view.snapshot(None, &states);
        assert_eq!((second.version(), second.resident("s1")), (5, None));
        assert_eq!(first.resident("s2").map(|r| r.target.node), Some(0), "one index, shared by every snapshot");

        // Another controller's first snapshot: b holds s2 now, a is gone.
        let full = inferyes_proto::v1::RoutingSnapshot {
            nodes: vec![with_backend("b")],
            live: vec![live_node("b", &["s2"])],
            ..full
        };
        view.apply(SnapshotUpdate { update: Some(snapshot_update::Update::Full(full)), ..Default::default() }).unwrap();
        let third = view.snapshot(None, &states);
        assert_eq!(third.resident("s2").map(|r| r.target.node), Some(0));
        assert_eq!(index.len(), 1);

        // A node the new controller does not know yet keeps its sessions,
        // stale, until its record goes.
        let full = inferyes_proto::v1::RoutingSnapshot {
            version: 6,
            nodes: vec![with_backend("b"), with_backend("c")],
            live: vec![live_node("b", &["s2"]), live_node("c", &["s3"])],
            live_state: true,
            ..Default::default()
        };
        view.apply(SnapshotUpdate { update: Some(snapshot_update::Update::Full(full.clone())), ..Default::default() })
            .unwrap();
        let without_c = inferyes_proto::v1::RoutingSnapshot { live: vec![live_node("b", &["s2"])], ..full };
        view.apply(SnapshotUpdate { update: Some(snapshot_update::Update::Full(without_c)), ..Default::default() })
            .unwrap();
        let fourth = view.snapshot(None, &states);
        assert_eq!(fourth.resident("s3").map(|r| r.target.node), Some(1));
        assert!(fourth.nodes()[1].backends[0].load_unknown, "its load is not known any more");
        view.apply(delta(&view, |d| d.removed = vec!["c".into()])).unwrap();
        assert_eq!(view.snapshot(None, &states).resident("s3"), None);
        assert_eq!(index.len(), 1);
    }

    #[test]
    fn a_snapshot_that_routes_the_same_shares_the_indices_and_takes_the_new_keys() {
        let states = crate::targets::NodeStates::default();
        let mut view = WireView::default();
        let full = inferyes_proto::v1::RoutingSnapshot { version: 1, nodes: vec![node("a")], ..Default::default() };
        view.apply(SnapshotUpdate { update: Some(snapshot_update::Update::Full(full)), ..Default::default() }).unwrap();
        let first = view.snapshot(None, &states);
        assert_eq!((first.version(), first.nodes().len()), (1, 1));

        let usage = KeyUsageToday { day: "20261130".into(), tokens: [("k".to_string(), 9)].into() };
        let reroutes = view.apply(delta(&view, |d| d.usage_today = Some(usage.clone()))).unwrap();
        let second = view.snapshot(Some(Arc::clone(&first.indices)).filter(|_| !reroutes), &states);
        assert!(Arc::ptr_eq(&first.indices, &second.indices), "not decoded again");
        assert_eq!((second.version(), second.usage_today.tokens["k"]), (2, 9), "the new version and usage");

        let reroutes = view.apply(delta(&view, |d| d.upserted = vec![node("b")])).unwrap();
        let third = view.snapshot(Some(Arc::clone(&second.indices)).filter(|_| !reroutes), &states);
        assert!(!Arc::ptr_eq(&second.indices, &third.indices));
        assert_eq!((third.version(), third.nodes().len()), (3, 2), "a node more: decoded anew");
    }
}
