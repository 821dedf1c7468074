use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use inferyes_proto::v1::{
    Backend, EndpointKind, Gpu, Health, Model, ModelState, NodeStatus, ResidentSession, SnapshotNode,
};

use super::*;
use crate::snapshot::{Counters, decode};

struct Spec {
    id: &'static str,
    state: ModelState,
    health: Health,
    draining: bool,
    sessions: &'static [&'static str],
    free_gib: u64,
}

fn spec(id: &'static str) -> Spec {
    Spec { id, state: ModelState::Loaded, health: Health::Ready, draining: false, sessions: &[], free_gib: 10 }
}

fn snapshot(specs: &[Spec]) -> RoutingSnapshot {
    let nodes: BTreeMap<String, SnapshotNode> = specs
        .iter()
        .map(|s| {
            let mut model =
                Model { id: "chat".into(), endpoints: vec![EndpointKind::Chat as i32], ..Default::default() };
            model.set_state(s.state);
            let mut backend = Backend { id: "b0".into(), models: vec![model], ..Default::default() };
            backend.set_health(s.health);
            let status = NodeStatus {
                node_id: s.id.into(),
                proxy_url: format!("http://{}", s.id),
                gpus: vec![Gpu {
                    memory_total_bytes: 80 << 30,
                    memory_used_bytes: (80 - s.free_gib) << 30,
                    ..Default::default()
                }],
                backends: vec![backend],
                sessions: s
                    .sessions
                    .iter()
                    .map(|k| ResidentSession { key: (*k).into(), backend_id: "b0".into(), ..Default::default() })
                    .collect(),
                ..Default::default()
            };
            (s.id.to_string(), SnapshotNode { status: Some(status), draining: s.draining })
        })
        .collect();
    decode(1, &nodes, &Counters::default())
}

fn chat(session: Option<&str>) -> RouteRequest<'_> {
    RouteRequest { model: "chat", kind: EndpointKind::Chat, session, strategy: Strategy::SessionAffinity, ticket: 0 }
}

fn first_node(snapshot: &RoutingSnapshot, route: &Route) -> String {
    snapshot.nodes()[route.targets[0].node].id.to_string()
}

#[test]
fn a_resident_session_goes_home() {
    let s = snapshot(&[spec("a"), Spec { sessions: &["conv-1"], ..spec("b") }, spec("c")]);
    let route = select(&s, &chat(Some("conv-1"))).unwrap();
    assert_eq!(route.reason, RouteReason::Resident);
    assert_eq!(first_node(&s, &route), "b");
}

#[test]
fn new_sessions_land_on_the_same_node_in_every_data_plane() {
    let specs = || [spec("a"), spec("b"), spec("c"), spec("d")];
    let one = snapshot(&specs());
    let two = snapshot(&specs());
    let mut homes = std::collections::HashSet::new();
    for i in 0..64 {
        let key = format!("conversation-{i}");
        let r1 = select(&one, &chat(Some(&key))).unwrap();
        let r2 = select(&two, &chat(Some(&key))).unwrap();
        assert_eq!(r1, r2);
        assert_eq!(r1.reason, RouteReason::Placed);
        homes.insert(first_node(&one, &r1));
    }
    assert_eq!(homes.len(), 4, "64 sessions should spread over all 4 nodes");
}

#[test]
fn drained_unhealthy_and_cold_nodes_are_avoided() {
    let s = snapshot(&[
        Spec { draining: true, sessions: &["conv"], ..spec("a") },
        Spec { health: Health::Loading, ..spec("b") },
        Spec { state: ModelState::Unloaded, free_gib: 70, ..spec("c") },
        spec("d"),
    ]);
    for session in [None, Some("conv"), Some("other")] {
        let route = select(&s, &chat(session)).unwrap();
        assert_eq!(first_node(&s, &route), "d");
        let nodes: Vec<_> = route.targets.iter().map(|t| s.nodes()[t.node].id.to_string()).collect();
        assert_eq!(nodes, ["d", "c"], "cold node only as the failover");
    }
}

#[test]
fn cold_placement_prefers_free_vram() {
    let s = snapshot(&[
        Spec { state: ModelState::Unloaded, free_gib: 5, ..spec("a") },
        Spec { state: ModelState::Unloaded, free_gib: 50, ..spec("b") },
    ]);
    let route = select(&s, &chat(None)).unwrap();
    assert_eq!(route.reason, RouteReason::Cold);
    assert_eq!(first_node(&s, &route), "b");
}

#[test]
fn keyless_traffic_goes_to_the_least_loaded_node() {
    let s = snapshot(&[spec("a"), spec("b")]);
    s.nodes()[0].local_in_flight.fetch_add(3, Ordering::Relaxed);
    let route = select(&s, &chat(None)).unwrap();
    assert_eq!(route.reason, RouteReason::Warm);
    assert_eq!(first_node(&s, &route), "b");
}

#[test]
fn errors_name_what_is_wrong() {
    let s = snapshot(&[spec("a")]);
    let missing = select(&s, &RouteRequest { model: "gpt-9", ..chat(None) }).unwrap_err();
    assert_eq!(missing.kind(), ErrorKind::NotFound);
    assert!(missing.to_string().contains("available models: chat"));
    let embed = select(&s, &RouteRequest { kind: EndpointKind::Embedding, ..chat(None) }).unwrap_err();
    assert_eq!(embed.kind(), ErrorKind::BadRequest);
    let down = snapshot(&[Spec { health: Health::Down, ..spec("a") }]);
    assert_eq!(select(&down, &chat(None)).unwrap_err().kind(), ErrorKind::Overloaded);
}

#[test]
fn round_robin_ignores_sessions_and_rotates() {
    let s = snapshot(&[Spec { sessions: &["conv"], ..spec("a") }, spec("b"), spec("c")]);
    let nodes: Vec<String> = (0..6)
        .map(|ticket| {
            let request = RouteRequest { strategy: Strategy::RoundRobin, ticket, ..chat(Some("conv")) };
            let route = select(&s, &request).unwrap();
            assert_eq!(route.reason, RouteReason::Warm);
            first_node(&s, &route)
        })
        .collect();
    assert_eq!(nodes, ["a", "b", "c", "a", "b", "c"]);
}
