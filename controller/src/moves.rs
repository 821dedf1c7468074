//! Where a node's conversations may be moved: for a drain, the backends of
//! other nodes that take new sessions, can take a moved slot, and have a
//! slot free; for a carry a data plane asks for, every other node's
//! backends that can take a slot (its peers). Pure.

use inferyes_proto::v1::{Health, ModelState, MoveTarget, RoutingPolicy, SnapshotNode};

/// `from`'s move targets among `nodes` (each merged with its live load),
/// the most free slots first.
pub fn targets(nodes: impl IntoIterator<Item = SnapshotNode>, from: &str, policy: &RoutingPolicy) -> Vec<MoveTarget> {
    let mut targets = Vec::new();
    for node in nodes {
        let Some(status) = node.status.as_ref() else { continue };
        if status.node_id == from || node.draining || !under_threshold(&node, policy) {
            continue;
        }
        for backend in &status.backends {
            let free = backend.slots_total.saturating_sub(backend.slots_busy);
            if backend.health() != Health::Ready
                || backend.slot_fingerprint.is_empty()
                || backend.load_unknown
                || free == 0
            {
                continue;
            }
            let warm: Vec<_> = backend.models.iter().filter(|m| m.state() == ModelState::Loaded).collect();
            if warm.is_empty() {
                continue;
            }
            targets.push(MoveTarget {
                node_id: status.node_id.clone(),
                proxy_url: status.proxy_url.clone(),
                backend_id: backend.id.clone(),
                slot_fingerprint: backend.slot_fingerprint.clone(),
                models: warm.iter().map(|m| m.id.clone()).collect(),
                context_windows: warm.iter().map(|m| m.context_window).collect(),
                free_slots: free,
                instance_digest: node.instance_digest.clone(),
                ..Default::default()
            });
        }
    }
    targets.sort_by(|a, b| b.free_slots.cmp(&a.free_slots).then_with(|| a.node_id.cmp(&b.node_id)));
    targets
}

/// Every backend among `nodes` (records, no load) that can take a moved
/// slot: of a node not draining, with a slot fingerprint. Only where it
/// is and what it takes (no models, no load), so that it changes only as
/// nodes come and go: a node's peers are these less its own.
pub fn movable<'a>(nodes: impl IntoIterator<Item = &'a SnapshotNode>) -> Vec<MoveTarget> {
    let mut movable = Vec::new();
    for node in nodes.into_iter().filter(|n| !n.draining) {
        let Some(status) = node.status.as_ref() else { continue };
        for backend in status.backends.iter().filter(|b| !b.slot_fingerprint.is_empty()) {
            movable.push(MoveTarget {
                node_id: status.node_id.clone(),
                proxy_url: status.proxy_url.clone(),
                backend_id: backend.id.clone(),
                slot_fingerprint: backend.slot_fingerprint.clone(),
                instance_digest: node.instance_digest.clone(),
                ..Default::default()
            });
        }
    }
    movable
}

/// `from`'s peers: the movable backends of other nodes.
pub fn peers(movable: &[MoveTarget], from: &str) -> Vec<MoveTarget> {
    movable.iter().filter(|t| t.node_id != from).cloned().collect()
}

/// `targets` with the controller's grant for `from`, whose proxy is at
/// `from_host`, to send each one slots until `expires_unix_ms`.
pub fn granted(
    mut targets: Vec<MoveTarget>,
    key: &inferyes_proto::bearer::FleetKey,
    from: &str,
    from_host: &str,
    expires_unix_ms: u64,
) -> Vec<MoveTarget> {
    for target in &mut targets {
        let grant = inferyes_proto::bearer::MoveGrant {
            from,
            from_host,
            to: &target.node_id,
            backend: &target.backend_id,
            expires_unix_ms,
        };
        target.grant = key.move_grant(&grant, &target.instance_digest);
        target.grant_expires_unix_ms = expires_unix_ms;
    }
    targets
}

/// Every GPU of the node readable and under its admission threshold: a
/// moved conversation is a new session there.
fn under_threshold(node: &SnapshotNode, policy: &RoutingPolicy) -> bool {
    let threshold = [node.policy.as_ref().map_or(0.0, |p| p.admission_threshold), policy.admission_threshold]
        .into_iter()
        .find(|t| *t > 0.0)
        .unwrap_or(inferyes_proto::DEFAULT_ADMISSION_THRESHOLD);
    let gpus = node.status.as_ref().map(|s| s.gpus.as_slice()).unwrap_or_default();
    gpus.iter().all(|gpu| {
        !gpu.stale
            && (gpu.memory_total_bytes == 0
                || (gpu.memory_used_bytes as f64) < threshold * gpu.memory_total_bytes as f64)
    })
}

#[cfg(test)]
mod tests {
    use inferyes_proto::v1::{Backend, Gpu, Model, NodePolicy, NodeStatus};

    use super::*;

    fn node(id: &str, busy: u32, used_percent: u64) -> SnapshotNode {
        let mut backend = Backend {
            id: "main".into(),
            slots_total: 4,
            slots_busy: busy,
            slot_fingerprint: "f1".into(),
            models: vec![
                Model {
                    id: "gemma".into(),
                    state: ModelState::Loaded as i32,
                    context_window: 4096,
                    ..Default::default()
                },
                Model { id: "cold".into(), state: ModelState::Unloaded as i32, ..Default::default() },
            ],
            ..Default::default()
        };
        backend.set_health(Health::Ready);
        let gpu = Gpu { memory_total_bytes: 100, memory_used_bytes: used_percent, ..Default::default() };
        let status = NodeStatus {
            node_id: id.into(),
            proxy_url: format!("http://{id}:9100"),
            backends: vec![backend],
            gpus: vec![gpu],
            ..Default::default()
        };
        SnapshotNode { status: Some(status), draining: false, policy: None, instance_digest: String::new() }
    }

    #[test]
    fn peers_are_other_nodes_not_draining_with_movable_backends_where_they_are() {
        let mut draining = node("c", 0, 10);
        draining.draining = true;
        let mut unmovable = node("d", 0, 10);
        unmovable.status.as_mut().unwrap().backends[0].slot_fingerprint.clear();
        let nodes = [node("a", 0, 10), node("b", 4, 99), draining, unmovable];
        let found = peers(&movable(&nodes), "a");
        let found: Vec<_> = found.iter().map(|t| (t.node_id.as_str(), t.proxy_url.as_str(), t.free_slots)).collect();
        assert_eq!(found, [("b", "http://b:9100", 0)], "busy and full as it is: a carry is the data plane's call");
    }

    #[test]
    fn targets_are_other_nodes_taking_sessions_with_movable_warm_backends_and_room_roomiest_first() {
        let policy = RoutingPolicy::default();
        let found = targets([node("a", 0, 10), node("b", 3, 10), node("c", 1, 10)], "a", &policy);
        let found: Vec<_> = found.iter().map(|t| (t.node_id.as_str(), t.free_slots)).collect();
        assert_eq!(found, [("c", 3), ("b", 1)], "not the node drained; the roomiest first");
        let one = &targets([node("b", 0, 10)], "a", &policy)[0];
        assert_eq!((one.proxy_url.as_str(), one.backend_id.as_str()), ("http://b:9100", "main"));
        assert_eq!((one.models.clone(), one.context_windows.clone()), (vec!["gemma".to_string()], vec![4096]));

        let excluded = |change: &dyn Fn(&mut SnapshotNode)| {
            let mut b = node("b", 0, 10);
            change(&mut b);
            targets([b], "a", &policy).is_empty()
        };
        assert!(!excluded(&|_| {}));
        assert!(excluded(&|n| n.draining = true), "draining too");
        assert!(excluded(&|n| n.status.as_mut().unwrap().backends[0].slots_busy = 4), "no free slot");
        assert!(excluded(&|n| n.status.as_mut().unwrap().backends[0].slot_fingerprint.clear()), "cannot take slots");
        assert!(excluded(&|n| n.status.as_mut().unwrap().backends[0].load_unknown = true), "load unknown");
        assert!(excluded(&|n| n.status.as_mut().unwrap().backends[0].set_health(Health::Loading)), "not ready");
        assert!(excluded(&|n| n.status.as_mut().unwrap().backends[0].models.truncate(0)), "nothing warm");
        assert!(excluded(&|n| n.status.as_mut().unwrap().gpus[0].memory_used_bytes = 92), "at the threshold");
        assert!(excluded(&|n| n.status.as_mut().unwrap().gpus[0].stale = true), "memory unknown");
        assert!(
            !excluded(&|n| {
                n.status.as_mut().unwrap().gpus[0].memory_used_bytes = 94;
                n.policy = Some(NodePolicy { admission_threshold: 0.95, hard_limit: 0.0 });
            }),
            "a node's own threshold"
        );
    }

    #[test]
    fn each_target_carries_a_grant_only_its_node_can_check_naming_the_sender() {
        let key = inferyes_proto::bearer::FleetKey::new(&[1; inferyes_proto::bearer::FLEET_KEY_BYTES]).unwrap();
        let b = SnapshotNode { instance_digest: "b1".into(), ..node("b", 0, 10) };
        let found = granted(peers(&movable(&[node("a", 0, 10), b]), "a"), &key, "a", "10.0.0.1", 9);
        let [target] = found.as_slice() else { panic!("one peer: {found:?}") };
        assert_eq!(target.grant_expires_unix_ms, 9);
        let grant = |from_host| inferyes_proto::bearer::MoveGrant {
            from: "a",
            from_host,
            to: "b",
            backend: "main",
            expires_unix_ms: 9,
        };
        let intake = |instance| key.intake_key("b", instance);
        assert_eq!(target.grant, inferyes_proto::bearer::move_grant(&intake("b1"), &grant("10.0.0.1")));
        assert_ne!(target.grant, inferyes_proto::bearer::move_grant(&intake("b1"), &grant("10.0.0.2")));
        assert_ne!(target.grant, inferyes_proto::bearer::move_grant(&intake("b2"), &grant("10.0.0.1")));
    }
}
