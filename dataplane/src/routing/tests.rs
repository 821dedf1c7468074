use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use inferyes_proto::v1::{
    Backend, EndpointKind, Gpu, Health, Model, ModelState, NodePolicy, NodeStatus, ResidentSession, RoutingPolicy,
    SnapshotNode,
};
use proptest::prelude::{Just, any, prop, prop_assert, prop_assert_eq, prop_oneof, proptest};
use proptest::strategy::Strategy as Generator;

use super::*;
use crate::snapshot::decode;
use crate::targets::{Idle, NodeStates};

/// This data plane's own state of the nodes, as a test sets it: requests
/// in flight, memory held for loads, and ejections, by node index; and
/// sessions' latest turns, by session key hash.
#[derive(Default)]
struct Own {
    in_flight: HashMap<usize, u32>,
    reserved_vram_bytes: HashMap<usize, u64>,
    ejected_until: HashMap<usize, u64>,
    sent: HashMap<u64, crate::turns::Sent>,
}

impl Local for Own {
    fn in_flight(&self, node: usize) -> u32 {
        self.in_flight.get(&node).copied().unwrap_or(0)
    }

    fn reserved_vram_bytes(&self, node: usize) -> u64 {
        self.reserved_vram_bytes.get(&node).copied().unwrap_or(0)
    }

    fn ejected_until(&self, node: usize, now_ms: u64) -> Option<u64> {
        self.ejected_until.get(&node).copied().filter(|until| now_ms < *until)
    }

    fn sent_turn(&self, session: u64, _: u64) -> Option<crate::turns::Sent> {
        self.sent.get(&session).cloned()
    }
}

const GIB: u64 = 1 << 30;

#[derive(Clone, Debug)]
struct Spec {
    id: String,
    state: ModelState,
    health: Health,
    draining: bool,
    sessions: Vec<String>,
    /// GPU memory used, percent of 80 GiB.
    used_percent: u64,
    in_flight: u32,
    /// Extra sessions resident on the node (counts only).
    resident: u32,
    deferred: u32,
    slots: u32,
    weight: u32,
    context: u32,
    size_gib: u64,
    admission_override: f64,
    /// The GPU readings are the last ones read.
    stale: bool,
    busy: u32,
    load_unknown: bool,
    prefill_tokens_per_second: f64,
    service_ms: u32,
    /// Tokens each of `sessions` holds, and when each was last used.
    session_tokens: u32,
    session_last_seen_ms: u64,
    /// The backend holds another model loaded, and at most this many (0:
    /// no limit).
    other_loaded: bool,
    models_max: u32,
    /// Kinds the backend said it does not serve for the model.
    unsupported: Vec<EndpointKind>,
    /// Its slot fingerprint; empty: its slots cannot move.
    slot_fingerprint: String,
}

fn spec(id: &str) -> Spec {
    Spec {
        id: id.into(),
        state: ModelState::Loaded,
        health: Health::Ready,
        draining: false,
        sessions: Vec::new(),
        used_percent: 50,
        in_flight: 0,
        resident: 0,
        deferred: 0,
        slots: 0,
        weight: 1,
        context: 4096,
        size_gib: 5,
        admission_override: 0.0,
        stale: false,
        busy: 0,
        load_unknown: false,
        prefill_tokens_per_second: 0.0,
        service_ms: 0,
        session_tokens: 0,
        session_last_seen_ms: 0,
        other_loaded: false,
        models_max: 0,
        unsupported: Vec::new(),
        slot_fingerprint: String::new(),
    }
}

fn wire(s: &Spec) -> SnapshotNode {
    let mut model = Model {
        id: "chat".into(),
        endpoints: vec![EndpointKind::Chat as i32],
        context_window: s.context,
        size_bytes: s.size_gib * GIB,
        unsupported: s.unsupported.iter().map(|k| *k as i32).collect(),
        ..Default::default()
    };
    model.set_state(s.state);
    let mut models = vec![model];
    if s.other_loaded {
        let mut other = Model { id: "other".into(), ..Default::default() };
        other.set_state(ModelState::Loaded);
        models.push(other);
    }
    let mut backend = Backend {
        id: "b0".into(),
        models,
        models_max: s.models_max,
        in_flight: s.in_flight,
        requests_deferred: s.deferred,
        slots_total: s.slots,
        slots_busy: s.busy,
        weight: s.weight,
        load_unknown: s.load_unknown,
        prefill_tokens_per_second: s.prefill_tokens_per_second,
        service_ms: s.service_ms,
        slot_fingerprint: s.slot_fingerprint.clone(),
        ..Default::default()
    };
    backend.set_health(s.health);
    let status = NodeStatus {
        node_id: s.id.clone(),
        proxy_url: format!("http://{}", s.id),
        gpus: vec![Gpu {
            memory_total_bytes: 80 * GIB,
            memory_used_bytes: s.used_percent * 80 * GIB / 100,
            stale: s.stale,
            ..Default::default()
        }],
        backends: vec![backend],
        sessions: s
            .sessions
            .iter()
            .cloned()
            .chain((0..s.resident).map(|i| format!("{}-other-{i}", s.id)))
            .map(|k| ResidentSession {
                key: k,
                backend_id: "b0".into(),
                tokens: s.session_tokens,
                last_seen_unix_ms: s.session_last_seen_ms,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let policy = (s.admission_override > 0.0)
        .then_some(NodePolicy { admission_threshold: s.admission_override, hard_limit: 0.0 });
    SnapshotNode { status: Some(status), draining: s.draining, policy, instance_digest: String::new() }
}

fn snapshot_with(specs: &[Spec], policy: Option<RoutingPolicy>) -> RoutingSnapshot {
    let nodes: BTreeMap<String, SnapshotNode> = specs.iter().map(|s| (s.id.clone(), wire(s))).collect();
    decode(1, &nodes, policy.as_ref(), &[], &NodeStates::default())
}

fn snapshot(specs: &[Spec]) -> RoutingSnapshot {
    snapshot_with(specs, None)
}

/// A snapshot decoded while this data plane holds `held[i]` requests at
/// `specs[i]`'s node (its own count as the reports were read), and those
/// requests, held until dropped.
fn snapshot_holding(specs: &[Spec], held: &[u32]) -> (RoutingSnapshot, Vec<crate::targets::InFlight>) {
    let states = NodeStates::default();
    let url = inferyes_net::base_url::BaseUrl::new("http://node");
    let requests = specs
        .iter()
        .zip(held)
        .flat_map(|(spec, count)| {
            let endpoint = Arc::new(states.endpoint(&Arc::from(spec.id.as_str()), url.clone(), false, true, 1));
            (0..*count).map(move |_| endpoint.enter(None))
        })
        .collect();
    let nodes: BTreeMap<String, SnapshotNode> = specs.iter().map(|s| (s.id.clone(), wire(s))).collect();
    (decode(1, &nodes, None, &[], &states), requests)
}

fn chat(session: Option<&str>) -> RouteRequest<'_> {
    RouteRequest {
        model: "chat",
        kind: EndpointKind::Chat,
        session,
        prompt_tokens: 0,
        mode: Mode::Policy,
        carry: true,
        ticket: 0,
        now_ms: 1_000_000,
    }
}

fn node_of(snapshot: &RoutingSnapshot, target: Target) -> String {
    snapshot.nodes()[target.node].id.to_string()
}

fn first_node(snapshot: &RoutingSnapshot, route: &Route) -> String {
    node_of(snapshot, route.targets[0])
}

fn nodes(snapshot: &RoutingSnapshot, route: &Route) -> Vec<String> {
    route.targets.iter().map(|t| node_of(snapshot, *t)).collect()
}

#[test]
fn a_resident_session_goes_home() {
    let s = snapshot(&[spec("a"), Spec { sessions: vec!["conv-1".into()], ..spec("b") }, spec("c")]);
    let route = select(&s, &Idle, &chat(Some("conv-1"))).unwrap();
    assert_eq!(route.reason, RouteReason::Resident);
    assert_eq!(first_node(&s, &route), "b");
}

/// `session`'s latest turn, as this data plane sent it to `node`'s first
/// backend while the reports had it at `reported` (node, last seen).
fn sent(session: &str, node: &str, tokens: u32, reported: Option<(&str, u64)>) -> Own {
    let key = |node: &str| inferyes_proto::hash::stable_hash(node.as_bytes());
    let turn = crate::turns::Sent {
        node: key(node),
        backend: Arc::from("b0"),
        tokens,
        sent_unix_ms: 999_000,
        reported: reported.map(|(node, last_seen_unix_ms)| crate::turns::Seen { node: key(node), last_seen_unix_ms }),
    };
    Own { sent: HashMap::from([(crate::snapshot::session_hash(session), turn)]), ..Own::default() }
}

#[test]
fn a_later_turn_goes_where_the_last_was_sent_before_any_report_shows_it() {
    let s = snapshot(&[spec("a"), spec("b"), spec("c"), spec("d")]);
    let placed = first_node(&s, &select(&s, &Idle, &chat(Some("conv"))).unwrap());
    // Its first turn went to another node (its placement was busy then),
    // and no agent has reported the session yet.
    let elsewhere = ["a", "b", "c", "d"].into_iter().find(|n| *n != placed).unwrap();
    let own = sent("conv", elsewhere, 500, None);
    let route = select(&s, &own, &later_turn()).unwrap();
    assert_eq!((first_node(&s, &route), route.reason), (elsewhere.to_string(), RouteReason::Resident));
    let found = residence(&s, &own, "conv", 1_000_000).unwrap();
    assert_eq!((node_of(&s, found.target), found.tokens), (elsewhere.to_string(), 500));
    // Sent to a node that drains since: home is where the agents report.
    let drained = snapshot(&[
        Spec { draining: true, ..spec("a") },
        Spec { session_last_seen_ms: 998_000, ..home(spec("b")) },
        spec("c"),
    ]);
    let route = select(&drained, &sent("conv", "a", 1_200, Some(("b", 998_000))), &later_turn()).unwrap();
    assert_eq!((first_node(&drained, &route), route.reason), ("b".into(), RouteReason::Resident));
    // Or one this data plane holds out after a failure.
    let reported_at_b = snapshot(&[spec("a"), Spec { session_last_seen_ms: 998_000, ..home(spec("b")) }]);
    let held_out =
        Own { ejected_until: HashMap::from([(0, 2_000_000)]), ..sent("conv", "a", 1_200, Some(("b", 998_000))) };
    let route = select(&reported_at_b, &held_out, &later_turn()).unwrap();
    assert_eq!((first_node(&reported_at_b, &route), route.reason), ("b".into(), RouteReason::Resident));
    // A record of a node, or a backend, the snapshot does not hold is no
    // home.
    for gone in [sent("conv", "e", 500, None), Own { sent: HashMap::new(), ..Own::default() }] {
        assert_eq!(residence(&s, &gone, "conv", 1_000_000), None);
        assert_eq!(first_node(&s, &select(&s, &gone, &chat(Some("conv"))).unwrap()), placed);
    }
    let mut other_backend = sent("conv", elsewhere, 500, None);
    other_backend.sent.values_mut().for_each(|turn| turn.backend = Arc::from("b1"));
    assert_eq!(residence(&s, &other_backend, "conv", 1_000_000), None);
}

#[test]
fn a_sent_turn_is_the_home_until_the_reports_move_on() {
    let at_b = Spec { session_last_seen_ms: 998_000, ..home(spec("b")) };
    let s = snapshot(&[spec("a"), at_b, spec("c")]);
    let home_of = |own: &Own| {
        let found = residence(&s, own, "conv", 1_000_000).map(|found| (node_of(&s, found.target), found.tokens));
        found.unwrap_or_default()
    };
    // Sent to c while the reports had it at b, as they still do: c, whatever
    // the clocks say.
    assert_eq!(home_of(&sent("conv", "c", 1_200, Some(("b", 998_000)))), ("c".into(), 1_200));
    // The reports moved on since (another data plane's turn at b): b.
    assert_eq!(home_of(&sent("conv", "c", 1_200, Some(("b", 990_000)))), ("b".into(), 1_000));
    assert_eq!(home_of(&sent("conv", "c", 1_200, None)), ("b".into(), 1_000));
    // One backend both ways: the larger count.
    assert_eq!(home_of(&sent("conv", "b", 1_200, Some(("b", 998_000)))), ("b".into(), 1_200));
    assert_eq!(home_of(&sent("conv", "b", 800, None)), ("b".into(), 1_000));
    // Reported at a when the turn went there, and dropped by a since: no
    // home left.
    let none = snapshot(&[spec("a"), spec("b")]);
    assert_eq!(residence(&none, &sent("conv", "a", 1_200, Some(("a", 990_000))), "conv", 1_000_000), None);
    assert!(residence(&none, &sent("conv", "a", 1_200, Some(("b", 990_000))), "conv", 1_000_000).is_some());
}

#[test]
fn new_sessions_land_on_the_same_node_in_every_data_plane() {
    let specs = [spec("a"), spec("b"), spec("c"), spec("d")];
    let one = snapshot(&specs);
    let two = snapshot(&specs);
    let mut homes = std::collections::HashSet::new();
    for i in 0..64 {
        let key = format!("conversation-{i}");
        let r1 = select(&one, &Idle, &chat(Some(&key))).unwrap();
        let r2 = select(&two, &Idle, &chat(Some(&key))).unwrap();
        assert_eq!(r1, r2);
        assert_eq!(r1.reason, RouteReason::Placed);
        homes.insert(first_node(&one, &r1));
    }
    assert_eq!(homes.len(), 4, "64 sessions should spread over all 4 nodes");
}

#[test]
fn drained_unhealthy_and_cold_nodes_are_avoided() {
    let s = snapshot(&[
        Spec { draining: true, sessions: vec!["conv".into()], ..spec("a") },
        Spec { health: Health::Loading, ..spec("b") },
        Spec { state: ModelState::Unloaded, used_percent: 10, ..spec("c") },
        spec("d"),
    ]);
    for session in [None, Some("conv"), Some("other")] {
        let route = select(&s, &Idle, &chat(session)).unwrap();
        assert_eq!(nodes(&s, &route), ["d", "c"], "cold node only as the failover");
    }
}

#[test]
fn over_the_admission_threshold_only_resident_sessions_continue() {
    let s = snapshot(&[Spec { used_percent: 95, sessions: vec!["old".into()], ..spec("full") }, spec("free")]);
    let resident = select(&s, &Idle, &chat(Some("old"))).unwrap();
    assert_eq!((first_node(&s, &resident).as_str(), resident.reason), ("full", RouteReason::Resident));
    for session in [None, Some("new")] {
        let route = select(&s, &Idle, &chat(session)).unwrap();
        assert_eq!(nodes(&s, &route), ["free"]);
    }
    // Past the hard limit, not even resident sessions.
    let s = snapshot(&[Spec { used_percent: 99, sessions: vec!["old".into()], ..spec("full") }, spec("free")]);
    assert_eq!(nodes(&s, &select(&s, &Idle, &chat(Some("old"))).unwrap()), ["free"]);
    // Everything full: a clear refusal.
    let s = snapshot(&[Spec { used_percent: 93, ..spec("full") }]);
    let error = select(&s, &Idle, &chat(Some("new"))).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Overloaded);
    assert!(error.to_string().contains("admission threshold"), "{error}");
}

#[test]
fn thresholds_come_from_the_node_then_the_fleet() {
    let strict = Spec { used_percent: 85, admission_override: 0.8, ..spec("a") };
    let s = snapshot(&[strict.clone(), Spec { used_percent: 85, ..spec("b") }]);
    assert_eq!(nodes(&s, &select(&s, &Idle, &chat(None)).unwrap()), ["b"]);
    let fleet = RoutingPolicy { admission_threshold: 0.5, ..Default::default() };
    let s =
        snapshot_with(&[Spec { used_percent: 60, ..spec("a") }, Spec { used_percent: 40, ..spec("b") }], Some(fleet));
    assert_eq!(nodes(&s, &select(&s, &Idle, &chat(None)).unwrap()), ["b"]);
}

/// A node of 4 slots reading prompts at 100 tokens a second, whose
/// requests hold a slot 2 s: the real-model fleet's figures, rounded.
fn slow(id: &str, busy: u32, deferred: u32) -> Spec {
    Spec { slots: 4, busy, deferred, prefill_tokens_per_second: 100.0, service_ms: 2_000, ..spec(id) }
}

/// A later turn of `conv`: 1,050 tokens, 1,000 of them cached at home.
fn later_turn() -> RouteRequest<'static> {
    RouteRequest { prompt_tokens: 1_050, ..chat(Some("conv")) }
}

fn home(mut node: Spec) -> Spec {
    node.sessions = vec!["conv".into()];
    node.session_tokens = 1_000;
    node
}

#[test]
fn a_session_leaves_its_cache_only_for_a_free_slot_that_beats_its_wait_at_home() {
    // Home: 4 busy, 4 queued, so 5 requests to leave first, a slot freeing
    // every 0.5 s: 2.5 s, plus 50 new tokens, 0.5 s. Elsewhere, idle: the
    // whole prompt, 10.5 s. The cache is worth the wait.
    let s = snapshot(&[home(slow("busy", 4, 4)), slow("idle", 0, 0)]);
    let route = select(&s, &Idle, &later_turn()).unwrap();
    assert_eq!((nodes(&s, &route), route.reason), (vec!["busy".into(), "idle".into()], RouteReason::Resident));
    assert_eq!(route.expected_ttft_ms(), 3_000);
    // 20 queued: 10.5 s of waiting at home, and 0.5 s more for the new
    // tokens, against 10.5 s elsewhere: half a second is within the error
    // of reports a poll interval old, and it stays.
    let s = snapshot(&[home(slow("busy", 4, 20)), slow("idle", 0, 0)]);
    assert_eq!(select(&s, &Idle, &later_turn()).unwrap().reason, RouteReason::Resident);
    // 22 queued: 12 s at home, a second and a half saved: it moves, home
    // kept as failover.
    let s = snapshot(&[home(slow("busy", 4, 22)), slow("idle", 0, 0)]);
    let route = select(&s, &Idle, &later_turn()).unwrap();
    assert_eq!((nodes(&s, &route), route.reason), (vec!["idle".into(), "busy".into()], RouteReason::Moved));
    assert_eq!((route.expected_ttft_ms(), route.home_expected_ttft_ms()), (10_500, 12_000));
    // A node that reads prompts 100 times as fast is worth the recompute
    // against a short queue already.
    let fast = Spec { prefill_tokens_per_second: 10_000.0, ..slow("fast", 0, 0) };
    let s = snapshot(&[home(slow("busy", 4, 4)), fast]);
    let route = select(&s, &Idle, &later_turn()).unwrap();
    assert_eq!((first_node(&s, &route), route.reason), ("fast".into(), RouteReason::Moved));
    assert_eq!(route.expected_ttft_ms(), 105);
}

#[test]
fn a_session_has_its_cache_carried_to_a_free_slot_when_that_beats_its_wait_and_a_recompute() {
    let alike = |s: Spec| Spec { slot_fingerprint: "0123456789abcdef0123456789abcdef".into(), ..s };
    // Home: 4 busy, 4 queued, 3 s. Elsewhere: the prompt again, 10.5 s;
    // its 1,000 cached tokens carried, 0.15 s, and the 50 new ones read,
    // 0.5 s.
    let s = snapshot(&[alike(home(slow("busy", 4, 4))), alike(slow("idle", 0, 0))]);
    let route = select(&s, &Idle, &later_turn()).unwrap();
    assert_eq!((nodes(&s, &route), route.reason), (vec!["idle".into(), "busy".into()], RouteReason::Carried));
    assert_eq!((route.expected_ttft_ms(), route.home_expected_ttft_ms()), (650, 3_000));
    assert!(route.home_if_not_carried, "reading the prompt there (10.5 s) is not worth leaving for");
    // Where reading it again there is worth leaving for too (a node 100
    // times as fast: 105 ms), a failed carry goes on there.
    let fast = Spec { prefill_tokens_per_second: 10_000.0, ..alike(slow("fast", 0, 0)) };
    let s = snapshot(&[alike(home(slow("busy", 4, 4))), fast]);
    let route = select(&s, &Idle, &later_turn()).unwrap();
    assert_eq!((first_node(&s, &route), route.reason), ("fast".into(), RouteReason::Moved), "reading it is cheaper");
    let fast = Spec { prefill_tokens_per_second: 1_500.0, ..alike(slow("fast", 0, 0)) };
    let s = snapshot(&[alike(home(slow("busy", 4, 22))), fast]);
    let route = select(&s, &Idle, &later_turn()).unwrap();
    assert_eq!(route.reason, RouteReason::Carried);
    assert!(!route.home_if_not_carried, "0.7 s to read it there, against 12 s at home");
    // Slots unlike the home's cannot take its cache: the wait is worth it.
    let unlike = Spec { slot_fingerprint: "fedcba9876543210fedcba9876543210".into(), ..slow("idle", 0, 0) };
    let s = snapshot(&[alike(home(slow("busy", 4, 4))), unlike]);
    assert_eq!(select(&s, &Idle, &later_turn()).unwrap().reason, RouteReason::Resident);
    // Nor a home whose slots cannot move.
    let s = snapshot(&[home(slow("busy", 4, 4)), alike(slow("idle", 0, 0))]);
    assert_eq!(select(&s, &Idle, &later_turn()).unwrap().reason, RouteReason::Resident);
    // Only into a free slot, and only for a second's gain: one request
    // ahead at home (1 s) stays.
    let s = snapshot(&[alike(home(slow("busy", 4, 4))), alike(slow("full", 4, 0))]);
    assert_eq!(select(&s, &Idle, &later_turn()).unwrap().reason, RouteReason::Resident);
    let s = snapshot(&[alike(home(slow("busy", 4, 0))), alike(slow("idle", 0, 0))]);
    assert_eq!(select(&s, &Idle, &later_turn()).unwrap().reason, RouteReason::Resident);
}

#[test]
fn a_session_moves_only_into_a_free_slot() {
    // Home: 44 queued, 23 s. Elsewhere every slot is taken, none queued:
    // 0.5 s of wait and 10.5 s of recompute would beat home for the mover,
    // but the recompute is slot time others there would have had.
    let s = snapshot(&[home(slow("busy", 4, 44)), slow("full", 4, 0)]);
    let route = select(&s, &Idle, &later_turn()).unwrap();
    assert_eq!((first_node(&s, &route), route.reason), ("busy".into(), RouteReason::Resident));
    // One slot free there, three running: the recompute would be read
    // beside them, slower than the node's rate, and slow them.
    let s = snapshot(&[home(slow("busy", 4, 44)), slow("room", 3, 0)]);
    let route = select(&s, &Idle, &later_turn()).unwrap();
    assert_eq!((first_node(&s, &route), route.reason), ("busy".into(), RouteReason::Resident));
    // Nothing running there: it moves.
    let s = snapshot(&[home(slow("busy", 4, 44)), slow("room", 3, 0), slow("idle", 0, 0)]);
    let route = select(&s, &Idle, &later_turn()).unwrap();
    assert_eq!((first_node(&s, &route), route.reason), ("idle".into(), RouteReason::Moved));
    assert_eq!((route.expected_ttft_ms(), route.home_expected_ttft_ms()), (10_500, 23_000));
    // This data plane's own request there counts, before any report shows it.
    let own = Own { in_flight: [(1, 1)].into(), ..Own::default() }; // "idle", second by id
    assert_eq!(select(&s, &own, &later_turn()).unwrap().reason, RouteReason::Resident);
}

#[test]
fn a_cache_is_carried_beside_running_requests_but_a_failed_carry_does_not_recompute_there() {
    let alike = |s: Spec| Spec { slot_fingerprint: "0123456789abcdef0123456789abcdef".into(), ..s };
    // A fast node, reading the prompt there would be worth leaving for, but
    // three requests run there: only the carry may go.
    let fast = Spec { prefill_tokens_per_second: 1_500.0, ..alike(slow("fast", 3, 0)) };
    let s = snapshot(&[alike(home(slow("busy", 4, 22))), fast]);
    let route = select(&s, &Idle, &later_turn()).unwrap();
    assert_eq!((first_node(&s, &route), route.reason), ("fast".into(), RouteReason::Carried));
    assert!(route.home_if_not_carried, "no recompute beside running requests");
}

#[test]
fn where_every_node_is_queued_a_session_stays_home() {
    // The home's queue is the longest, but not by a recompute of the prompt.
    let s = snapshot(&[home(slow("busy", 4, 8)), slow("queued", 4, 1), slow("queued-more", 4, 3)]);
    let route = select(&s, &Idle, &later_turn()).unwrap();
    assert_eq!((first_node(&s, &route), route.reason), ("busy".into(), RouteReason::Resident));
    // Failovers are those with room, none here, then the least queued:
    // a queue is better than an error if the home fails.
    assert_eq!(nodes(&s, &route), ["busy", "queued", "queued-more"]);
    // Without a cache to keep (a new session), the shortest queue wins.
    let route = select(&s, &Idle, &RouteRequest { prompt_tokens: 1_050, ..chat(Some("new")) }).unwrap();
    assert_eq!((first_node(&s, &route), route.reason), ("queued".into(), RouteReason::Placed));
}

#[test]
fn load_that_could_not_be_read_is_taken_for_busy_not_idle() {
    // Idle by its last counts, but unread: new sessions go to the node
    // known to be idle.
    let unknown = Spec { load_unknown: true, ..slow("unknown", 0, 0) };
    let s = snapshot(&[unknown.clone(), slow("idle", 0, 0)]);
    for i in 0..8 {
        let route = select(&s, &Idle, &RouteRequest { prompt_tokens: 100, ..chat(Some(&format!("new-{i}"))) }).unwrap();
        assert_eq!(first_node(&s, &route), "idle");
    }
    // A session at home there stays: every slot taken and a round queued
    // (5 requests ahead, 2.5 s) costs less than recomputing 1,000 tokens
    // elsewhere (10.5 s).
    let s = snapshot(&[home(unknown), slow("idle", 0, 0)]);
    let route = select(&s, &Idle, &later_turn()).unwrap();
    assert_eq!((first_node(&s, &route), route.reason), ("unknown".into(), RouteReason::Resident));
    assert_eq!(route.expected_ttft_ms(), 3_000, "5 requests ahead at 0.5 s, then 50 tokens");
}

#[test]
fn a_burst_between_two_reports_is_spread_by_the_own_counts() {
    // Both idle by their reports; the data plane has sent 4 requests to
    // one of them since, which fills its slots.
    let s = snapshot(&[slow("a", 0, 0), slow("b", 0, 0)]);
    let keys: Vec<String> = (0..16).map(|i| format!("new-{i}")).collect();
    let request = |i: usize| RouteRequest { prompt_tokens: 500, ..chat(Some(&keys[i])) };
    let home_of = |own: &Own, i: usize| first_node(&s, &select(&s, own, &request(i)).unwrap());
    let (on_a, on_b): (Vec<usize>, Vec<usize>) = (0..16).partition(|i| home_of(&Own::default(), *i) == "a");
    assert!(!on_a.is_empty() && !on_b.is_empty(), "both nodes are homes of some sessions");
    let busy_a = Own { in_flight: [(0, 4)].into(), ..Own::default() };
    for i in on_a {
        assert_eq!(home_of(&busy_a, i), "b", "a's slots are taken by this data plane's own requests");
    }
    // A reported count the own count is part of is not added to it.
    let s = snapshot(&[slow("a", 3, 0), slow("b", 3, 0)]);
    let own = Own { in_flight: [(0, 3)].into(), ..Own::default() };
    let route = select(&s, &own, &request(0)).unwrap();
    assert_eq!(route.expected_ttft_ms(), 5_000, "a free slot: no wait, 500 tokens at 100/s");
}

#[test]
fn a_slot_this_data_plane_freed_is_free_before_the_next_report() {
    // "a" reported its 4 slots taken, all by this data plane's requests,
    // which were in flight when the report was read; "b" is busier.
    let (s, held) = snapshot_holding(&[slow("a", 4, 0), Spec { in_flight: 8, ..slow("b", 4, 4) }], &[4, 0]);
    let request = RouteRequest { prompt_tokens: 500, ..chat(None) };
    let waits_on_a = |own: u32| {
        let own = Own { in_flight: [(0, own)].into(), ..Own::default() };
        let route = select(&s, &own, &request).unwrap();
        (first_node(&s, &route), route.waits)
    };
    assert_eq!(waits_on_a(4), ("a".to_string(), true), "as reported: full");
    assert_eq!(waits_on_a(3), ("a".to_string(), false), "one of its own ended: a slot is free");
    drop(held);
}

#[test]
fn of_two_requests_routed_from_the_same_counts_only_one_takes_the_last_slot() {
    // "a" has 4 slots, 3 held by this data plane's requests, which its
    // report shows; two workers route one request each from these counts.
    let (s, held) = snapshot_holding(&[slow("a", 3, 0)], &[3]);
    let request = RouteRequest { prompt_tokens: 500, ..chat(None) };
    let routes: Vec<Route> = (0..2).map(|_| select(&s, s.local(), &request).unwrap()).collect();
    assert!(routes.iter().all(|route| !route.waits), "each saw the free slot");
    assert_eq!(slot_room(&s, "chat", &routes[0]), Some(4));
    let barrier = std::sync::Barrier::new(2);
    let taken: Vec<_> = std::thread::scope(|scope| {
        let workers: Vec<_> = routes
            .iter()
            .map(|route| {
                scope.spawn(|| {
                    barrier.wait();
                    crate::queue::take_slot(&s, "chat", route)
                })
            })
            .collect();
        workers.into_iter().map(|worker| worker.join().unwrap()).collect()
    });
    let (won, lost): (Vec<_>, Vec<_>) = taken.into_iter().partition(Result::is_ok);
    assert_eq!((won.len(), lost.len()), (1, 1), "one takes the last slot, the other finds it taken");
    assert_eq!(s.local().in_flight(0), 4);
    drop(won);
    assert!(crate::queue::take_slot(&s, "chat", &routes[1]).is_ok_and(|r| r.is_some()), "freed, it is free again");
    drop(held);
}

#[test]
fn no_slot_is_free_where_counts_are_unread_and_none_is_claimed_where_slots_are_not_counted() {
    // Unread counts are a full round queued: no own count leaves a slot.
    let s = snapshot(&[Spec { load_unknown: true, ..slow("a", 0, 0) }]);
    let route = select(&s, &Idle, &chat(None)).unwrap();
    assert_eq!((route.waits, slot_room(&s, "chat", &route)), (true, Some(0)));
    // Without a slot count the server's queue decides: the request is
    // counted at its node, whatever its count there.
    let s = snapshot(&[Spec { slots: 0, ..slow("a", 0, 0) }]);
    let route = select(&s, &Idle, &chat(None)).unwrap();
    assert_eq!(slot_room(&s, "chat", &route), None);
    let counted = crate::queue::take_slot(&s, "chat", &route).expect("nothing to claim").expect("counted");
    assert_eq!(s.local().in_flight(0), 1);
    drop(counted);
    // A cold load's count is its attempt's, with the memory it holds.
    let s = snapshot(&[Spec { state: ModelState::Unloaded, ..slow("a", 0, 0) }]);
    let route = select(&s, &Idle, &chat(None)).unwrap();
    assert!(route.cold());
    assert_eq!(slot_room(&s, "chat", &route), None);
    assert!(crate::queue::take_slot(&s, "chat", &route).is_ok_and(|r| r.is_none()));
    assert_eq!(s.local().in_flight(0), 0);
}

#[test]
fn keyless_requests_do_not_herd_on_the_node_the_last_report_showed_free() {
    // Reported: "a" has its 4 slots taken, "b" is idle. Since, this data
    // plane sent 8 requests to "b": by its own count "b" is the busier.
    let s = snapshot(&[Spec { in_flight: 4, ..slow("a", 4, 0) }, slow("b", 0, 0)]);
    assert_eq!(first_node(&s, &select(&s, &Idle, &chat(None)).unwrap()), "b");
    let busy_b = Own { in_flight: [(1, 8)].into(), ..Own::default() };
    for strategy in [Strategy::LeastOutstanding, Strategy::PowerOfTwo, Strategy::Weighted] {
        let policy = RoutingPolicy { default_strategy: strategy as i32, ..Default::default() };
        let s = snapshot_with(&[Spec { in_flight: 4, ..slow("a", 4, 0) }, slow("b", 0, 0)], Some(policy));
        for ticket in 0..4 {
            let route = select(&s, &busy_b, &RouteRequest { ticket, ..chat(None) }).unwrap();
            assert_eq!(first_node(&s, &route), "a", "{strategy:?}, ticket {ticket}");
        }
    }
}

#[test]
fn new_sessions_avoid_a_saturated_node() {
    let s = snapshot(&[Spec { deferred: 1, ..spec("busy") }, spec("idle")]);
    for i in 0..8 {
        assert_eq!(first_node(&s, &select(&s, &Idle, &chat(Some(&format!("new-{i}")))).unwrap()), "idle");
    }
}

#[test]
fn placement_respects_the_load_bound() {
    // Find a session whose home is "a", then load "a" far above average.
    let specs = [spec("a"), spec("b"), spec("c"), spec("d")];
    let s = snapshot(&specs);
    let key =
        (0..100).map(|i| format!("s{i}")).find(|k| first_node(&s, &select(&s, &Idle, &chat(Some(k))).unwrap()) == "a");
    let key = key.expect("some session lives on a");
    let loaded = snapshot(&[Spec { resident: 8, ..spec("a") }, spec("b"), spec("c"), spec("d")]);
    let route = select(&loaded, &Idle, &chat(Some(&key))).unwrap();
    assert_ne!(first_node(&loaded, &route), "a", "8 sessions are over 1.25 × the average of 2.25, plus one");
    // Reported in-flight counts do not move placements.
    let busy = snapshot(&[Spec { in_flight: 30, ..spec("a") }, spec("b"), spec("c"), spec("d")]);
    assert_eq!(first_node(&busy, &select(&busy, &Idle, &chat(Some(&key))).unwrap()), "a");
    // Within the bound (everyone equally loaded) it stays home.
    let busy = |id| Spec { resident: 1, ..spec(id) };
    let mildly = snapshot(&[busy("a"), busy("b"), busy("c"), busy("d")]);

    assert_eq!(first_node(&mildly, &select(&mildly, &Idle, &chat(Some(&key))).unwrap()), "a");
}

#[test]
fn cold_placement_prefers_free_memory_and_counts_loads_in_progress() {
    let s = snapshot(&[
        Spec { state: ModelState::Unloaded, used_percent: 50, ..spec("a") },
        Spec { state: ModelState::Unloaded, used_percent: 20, ..spec("b") },
        // Would not stay under 92% with 10 GiB more.
        Spec { state: ModelState::Unloaded, used_percent: 85, size_gib: 10, ..spec("c") },
    ]);
    let route = select(&s, &Idle, &chat(None)).unwrap();
    assert_eq!(route.reason, RouteReason::Cold);
    assert!(route.cold());
    assert_eq!(nodes(&s, &route), ["b", "a"]);
    // This data plane started a 40 GiB load on b: a has more room now.
    let loading_on_b = Own { reserved_vram_bytes: [(1, 40 * GIB)].into(), ..Own::default() };
    assert_eq!(first_node(&s, &select(&s, &loading_on_b, &chat(None)).unwrap()), "a");
    // A load already under way is joined.
    let joining = snapshot(&[
        Spec { state: ModelState::Unloaded, used_percent: 10, ..spec("a") },
        Spec { state: ModelState::Loading, used_percent: 60, ..spec("b") },
    ]);
    assert_eq!(first_node(&joining, &select(&joining, &Idle, &chat(None)).unwrap()), "b");
}

#[test]
fn a_cold_load_goes_where_it_unloads_no_model_before_where_it_unloads_one_sessions_use() {
    let full = |id: &str, used_percent: u64, resident: u32| Spec {
        state: ModelState::Unloaded,
        other_loaded: true,
        models_max: 1,
        used_percent,
        resident,
        ..spec(id)
    };
    let s = snapshot(&[
        // The most free memory, but its one model is in use.
        full("busy", 10, 3),
        full("idle", 40, 0),
        // Room for a second model.
        Spec { models_max: 2, ..full("room", 60, 3) },
    ]);
    let route = select(&s, &Idle, &chat(None)).unwrap();
    assert_eq!(route.reason, RouteReason::Cold);
    assert_eq!(nodes(&s, &route), ["room", "idle", "busy"]);
    // Without a limit of its own, a backend never counts as full.
    let unlimited = snapshot(&[Spec { models_max: 0, ..full("a", 10, 3) }, full("b", 40, 0)]);
    assert_eq!(first_node(&unlimited, &select(&unlimited, &Idle, &chat(None)).unwrap()), "a");
}

#[test]
fn a_kind_a_backend_said_it_does_not_serve_is_never_sent_there() {
    let s = snapshot(&[Spec { unsupported: vec![EndpointKind::Chat], ..spec("a") }, spec("b")]);
    assert_eq!(nodes(&s, &select(&s, &Idle, &chat(None)).unwrap()), ["b"]);
    let none = snapshot(&[Spec { unsupported: vec![EndpointKind::Chat], ..spec("a") }]);
    let refused = select(&none, &Idle, &chat(None)).unwrap_err();
    assert_eq!((refused.kind(), refused.code().as_str()), (ErrorKind::BadRequest, "unsupported_endpoint"));
    assert!(refused.to_string().contains("does not serve chat requests"), "{refused}");
}

#[test]
fn the_targets_that_must_load_the_model_are_marked_and_a_load_under_way_counts_once() {
    let s = snapshot(&[
        spec("a"),
        Spec { state: ModelState::Unloaded, used_percent: 10, ..spec("b") },
        Spec { state: ModelState::Unloaded, used_percent: 20, ..spec("c") },
    ]);
    let route = select(&s, &Idle, &chat(None)).unwrap();
    assert_eq!(nodes(&s, &route), ["a", "b", "c"]);
    assert!(!route.cold() && !route.loads_at(0) && route.loads_at(1) && route.loads_at(2), "{route:?}");
    // 35 GiB loading onto 8 GiB used of 80: 43 committed, under 92% once,
    // not twice.
    let joining = snapshot(&[Spec { state: ModelState::Loading, used_percent: 10, size_gib: 35, ..spec("b") }]);
    let route = select(&joining, &Idle, &chat(None)).unwrap();
    assert!(route.cold());
}

#[test]
fn a_node_whose_memory_is_not_read_lately_starts_no_load_but_serves_what_it_holds() {
    let cold = [
        Spec { state: ModelState::Unloaded, used_percent: 50, ..spec("a") },
        // The emptiest, as last read: it may have filled since.
        Spec { state: ModelState::Unloaded, used_percent: 10, stale: true, ..spec("b") },
    ];
    let s = snapshot(&cold);
    assert_eq!(nodes(&s, &select(&s, &Idle, &chat(None)).unwrap()), ["a"]);
    let alone = snapshot(&cold[1..]);
    let refused = select(&alone, &Idle, &chat(None)).unwrap_err();
    assert_eq!(refused.code().as_str(), "no_capacity", "{refused:?}");
    // Loaded there, the model goes on serving, its sessions included.
    let warm = snapshot(&[Spec { stale: true, sessions: vec!["conv".into()], ..spec("b") }]);
    let route = select(&warm, &Idle, &chat(Some("conv"))).unwrap();
    assert_eq!((first_node(&warm, &route), route.reason), ("b".to_string(), RouteReason::Resident));
}

#[test]
fn keyless_strategies() {
    let specs = [
        Spec { in_flight: 3, ..spec("a") },
        Spec { in_flight: 1, weight: 1, ..spec("b") },
        Spec { in_flight: 2, weight: 8, ..spec("c") },
    ];
    let s = snapshot(&specs);
    assert_eq!(first_node(&s, &select(&s, &Idle, &chat(None)).unwrap()), "b", "least outstanding");
    let weighted = snapshot_with(
        &specs,
        Some(RoutingPolicy { default_strategy: Strategy::Weighted as i32, ..Default::default() }),
    );
    assert_eq!(first_node(&weighted, &select(&weighted, &Idle, &chat(None)).unwrap()), "c", "2/8 beats 1/1");
    let rr = snapshot_with(
        &specs,
        Some(RoutingPolicy { default_strategy: Strategy::RoundRobin as i32, ..Default::default() }),
    );
    let order: Vec<String> = (0..3)
        .map(|ticket| first_node(&rr, &select(&rr, &Idle, &RouteRequest { ticket, ..chat(None) }).unwrap()))
        .collect();
    assert_eq!(order, ["a", "b", "c"]);
    let p2 = snapshot_with(
        &specs,
        Some(RoutingPolicy { default_strategy: Strategy::PowerOfTwo as i32, ..Default::default() }),
    );
    for ticket in 0..20 {
        let route = select(&p2, &Idle, &RouteRequest { ticket, ..chat(None) }).unwrap();
        assert_ne!(first_node(&p2, &route), "a", "the most loaded never wins a pair");
    }
}

#[test]
fn power_of_two_draws_its_pair_from_the_warm_placements() {
    // Three warm nodes among thirty that would have to load the model.
    let mut specs: Vec<Spec> =
        (0..30).map(|i| Spec { state: ModelState::Unloaded, ..spec(&format!("cold-{i:02}")) }).collect();
    specs.extend([
        Spec { in_flight: 1, ..spec("w1") },
        Spec { in_flight: 2, ..spec("w2") },
        Spec { in_flight: 3, ..spec("w3") },
    ]);
    let p2 = snapshot_with(
        &specs,
        Some(RoutingPolicy { default_strategy: Strategy::PowerOfTwo as i32, ..Default::default() }),
    );
    let mut wins: BTreeMap<String, usize> = BTreeMap::new();
    for ticket in 0..300 {
        let route = select(&p2, &Idle, &RouteRequest { ticket, ..chat(None) }).unwrap();
        assert_eq!(route.reason, RouteReason::Warm);
        *wins.entry(first_node(&p2, &route)).or_default() += 1;
    }
    // Pairs {w1,w2} and {w1,w3} go to w1, {w2,w3} to w2: about 2/3 and 1/3.
    assert_eq!(wins.get("w3"), None, "the most loaded never wins a pair: {wins:?}");
    let w2 = wins.get("w2").copied().unwrap_or(0);
    assert!((60..=140).contains(&w2), "w2 wins the pairs without w1: {wins:?}");
}

#[test]
fn baselines_ignore_sessions() {
    let s = snapshot(&[Spec { sessions: vec!["conv".into()], ..spec("a") }, spec("b"), spec("c")]);
    let order: Vec<String> = (0..3)
        .map(|ticket| {
            let request = RouteRequest { mode: Mode::RoundRobin, ticket, ..chat(Some("conv")) };
            let route = select(&s, &Idle, &request).unwrap();
            assert_eq!(route.reason, RouteReason::Warm);
            first_node(&s, &route)
        })
        .collect();
    assert_eq!(order, ["a", "b", "c"]);
}

#[test]
fn errors_name_what_is_wrong() {
    let s = snapshot(&[spec("a")]);
    let missing = select(&s, &Idle, &RouteRequest { model: "gpt-9", ..chat(None) }).unwrap_err();
    assert_eq!(missing.kind(), ErrorKind::NotFound);
    assert!(missing.to_string().contains("available models: chat"));
    let embed = select(&s, &Idle, &RouteRequest { kind: EndpointKind::Embedding, ..chat(None) }).unwrap_err();
    assert_eq!(embed.kind(), ErrorKind::BadRequest);
    let down = snapshot(&[Spec { health: Health::Down, ..spec("a") }]);
    assert_eq!(select(&down, &Idle, &chat(None)).unwrap_err().kind(), ErrorKind::Overloaded);
}

#[test]
fn a_prompt_estimated_past_every_window_goes_to_the_largest_to_be_counted_there() {
    // The estimate may be high (a fifth of the bytes, for a tokenizer that
    // takes six): only the server's own count refuses.
    let s = snapshot(&[
        Spec { context: 2048, ..spec("small") },
        Spec { context: 4096, in_flight: 3, ..spec("large") },
        Spec { context: 4096, in_flight: 1, ..spec("large-idle") },
    ]);
    let route = select(&s, &Idle, &RouteRequest { prompt_tokens: 5000, ..chat(None) }).unwrap();
    assert_eq!(nodes(&s, &route), ["large-idle", "large"]);
    assert_eq!(route.costs_at(0).map(|terms| terms.prompt_tokens), Some(4096));
    // The largest window of a node that cannot take it now is no reason to
    // wait: the largest that can counts.
    let s = snapshot(&[
        Spec { context: 4096, ..spec("ready") },
        Spec { context: 8192, health: Health::Down, ..spec("down") },
    ]);
    let route = select(&s, &Idle, &RouteRequest { prompt_tokens: 9000, ..chat(None) }).unwrap();
    assert_eq!(nodes(&s, &route), ["ready"]);
}

#[test]
fn a_long_prompt_goes_where_it_fits() {
    let s = snapshot(&[Spec { context: 2048, ..spec("small") }, Spec { context: 32768, in_flight: 5, ..spec("big") }]);
    let route = select(&s, &Idle, &RouteRequest { prompt_tokens: 3000, ..chat(None) }).unwrap();
    assert_eq!(nodes(&s, &route), ["big"]);
}

fn arb_spec() -> impl Generator<Value = Spec> {
    (
        prop_oneof![
            Just(ModelState::Loaded),
            Just(ModelState::Unloaded),
            Just(ModelState::Unknown),
            Just(ModelState::Loading)
        ],
        prop_oneof![Just(Health::Ready), Just(Health::Loading), Just(Health::Down)],
        any::<bool>(),
        0u64..100,
        0u32..20,
        0u32..3,
        any::<bool>(),
    )
        .prop_map(|(state, health, draining, used_percent, in_flight, deferred, resident)| Spec {
            state,
            health,
            draining,
            used_percent,
            in_flight,
            deferred,
            sessions: if resident { vec!["conv".into()] } else { Vec::new() },
            ..spec("x")
        })
}

fn arb_fleet() -> impl Generator<Value = Vec<Spec>> {
    proptest::collection::vec(arb_spec(), 1..12)
        .prop_map(|specs| specs.into_iter().enumerate().map(|(i, s)| Spec { id: format!("n{i:02}"), ..s }).collect())
}

proptest! {
    #[test]
    fn never_a_drained_unhealthy_or_overfull_node(specs in arb_fleet(), session in prop::option::of("[a-z]{1,8}|conv")) {
        let s = snapshot(&specs);
        if let Ok(route) = select(&s, &Idle, &chat(session.as_deref())) {
            prop_assert!(!route.targets.is_empty());
            for target in &route.targets {
                let node = &s.nodes()[target.node];
                let spec = specs.iter().find(|sp| sp.id == *node.id).unwrap();
                prop_assert!(!spec.draining);
                prop_assert_eq!(spec.health, Health::Ready);
                prop_assert!(node.vram_fraction < node.hard_limit);
                let resident_here = session.as_deref() == Some("conv") && spec.sessions.iter().any(|k| k == "conv");
                if !resident_here {
                    prop_assert!(node.vram_fraction < node.admission_threshold);
                }
            }
        }
    }

    #[test]
    fn a_request_takes_a_slot_exactly_where_routing_says_it_need_not_wait(
        specs in arb_fleet(),
        loads in proptest::collection::vec((1u32..8, 0u32..10, any::<bool>()), 12),
        when_read in proptest::collection::vec(0u32..6, 12),
        own in 0u32..12,
        session in prop::option::of("[a-z]{1,8}|conv"),
    ) {
        let specs: Vec<Spec> = specs
            .into_iter()
            .zip(loads)
            .map(|(spec, (slots, busy, load_unknown))| Spec { slots, busy, load_unknown, ..spec })
            .collect();
        // This data plane's requests in flight as the reports were read:
        // those that end before the next report free slots at once.
        let (s, held) = snapshot_holding(&specs, &when_read);
        drop(held);
        let counts = Own { in_flight: (0..specs.len()).map(|node| (node, own)).collect(), ..Own::default() };
        if let Ok(route) = select(&s, &counts, &chat(session.as_deref()))
            && let Some(room) = slot_room(&s, "chat", &route)
        {
            prop_assert_eq!(!route.waits, own < room, "room {}", room);
        }
    }

    #[test]
    fn the_same_snapshot_and_session_give_the_same_node(specs in arb_fleet(), session in "[a-z]{1,12}") {
        let one = snapshot(&specs);
        let two = snapshot(&specs);
        prop_assert_eq!(select(&one, &Idle, &chat(Some(&session))), select(&two, &Idle, &chat(Some(&session))));
    }

    #[test]
    fn new_sessions_never_go_above_the_load_bound(loads in proptest::collection::vec(0u32..30, 2..10), session in "[a-z]{1,12}") {
        let specs: Vec<Spec> =
            loads.iter().enumerate().map(|(i, l)| Spec { resident: *l, ..spec(&format!("n{i}")) }).collect();
        let s = snapshot(&specs);
        let route = select(&s, &Idle, &chat(Some(&session))).unwrap();
        let total: u32 = loads.iter().sum();
        let bound = (1.25 * f64::from(total + 1) / loads.len() as f64).ceil() + 1.0;
        let chosen = &specs[route.targets[0].node];
        prop_assert!(f64::from(chosen.resident) + 1.0 <= bound, "{} resident, bound {}", chosen.resident, bound);
    }
}

#[test]
fn a_failed_node_is_ejected_and_used_only_as_a_last_resort() {
    let s = snapshot(&[Spec { sessions: vec!["conv".into()], ..spec("a") }, spec("b")]);
    let now = chat(None).now_ms;
    let a_ejected = Own { ejected_until: [(0, now + 1_000)].into(), ..Own::default() };
    for session in [None, Some("conv"), Some("new")] {
        let route = select(&s, &a_ejected, &chat(session)).unwrap();
        assert_eq!(nodes(&s, &route), ["b", "a"], "session {session:?}: a only as the last failover");
    }
    // Once its time is up it is back.
    let later = RouteRequest { now_ms: now + 1_000, ..chat(Some("conv")) };
    assert_eq!(select(&s, &a_ejected, &later).unwrap().reason, RouteReason::Resident);
    // Alone, an ejected node still serves: better than refusing.
    let alone = snapshot(&[spec("a")]);
    assert_eq!(nodes(&alone, &select(&alone, &a_ejected, &chat(None)).unwrap()), ["a"]);
}

#[test]
fn large_models_place_new_sessions_on_a_ring_deterministically_and_within_the_bound() {
    let fleet: Vec<Spec> = (0..100).map(|i| spec(&format!("n{i:03}"))).collect();
    let one = snapshot(&fleet);
    let two = snapshot(&fleet);
    assert!(one.ring("chat").is_some(), "100 placements get a ring");
    let mut homes = std::collections::HashSet::new();
    for i in 0..400 {
        let key = format!("conversation-{i}");
        let r1 = select(&one, &Idle, &chat(Some(&key))).unwrap();
        assert_eq!(r1, select(&two, &Idle, &chat(Some(&key))).unwrap(), "every data plane agrees");
        assert_eq!((r1.reason, r1.targets.len()), (RouteReason::Placed, 3));
        homes.insert(r1.targets[0]);
    }
    assert!(homes.len() > 80, "400 sessions spread over {} of 100 nodes", homes.len());

    // A home over the bound is passed over for the next node on the ring.
    let key = "conversation-7";
    let home = first_node(&one, &select(&one, &Idle, &chat(Some(key))).unwrap());
    let mut loaded = fleet.clone();
    loaded.iter_mut().find(|s| s.id == home).unwrap().resident = 10;
    let loaded = snapshot(&loaded);
    let route = select(&loaded, &Idle, &chat(Some(key))).unwrap();
    assert_ne!(first_node(&loaded, &route), home);

    // Nothing usable on the ring walk: the full scan still finds a node.
    let mut mostly_down: Vec<Spec> = fleet.iter().map(|s| Spec { health: Health::Down, ..s.clone() }).collect();
    mostly_down[42].health = Health::Ready;
    let s = snapshot(&mostly_down);
    assert_eq!(nodes(&s, &select(&s, &Idle, &chat(Some(key))).unwrap()), ["n042"]);
}

#[test]
fn a_ring_walk_lists_each_node_once_however_many_it_passes_over() {
    // A quarter of the nodes ready: the walk meets more than its first few
    // placements, and each ready one at several of its points.
    let fleet: Vec<Spec> = (0..64)
        .map(|i| Spec { health: if i % 4 == 0 { Health::Ready } else { Health::Down }, ..spec(&format!("n{i:03}")) })
        .collect();
    let s = snapshot(&fleet);
    assert!(s.ring("chat").is_some());
    for i in 0..200 {
        let route = select(&s, &Idle, &chat(Some(&format!("conversation-{i}")))).unwrap();
        let listed = nodes(&s, &route);
        let distinct: std::collections::HashSet<_> = listed.iter().collect();
        assert_eq!(distinct.len(), listed.len(), "conversation-{i}: {listed:?}");
        assert_eq!(listed.len(), 3);
    }
}

#[test]
fn targets_keep_the_first_three_in_order() {
    let target = |node| Target { node, backend: 0 };
    let targets: Targets = (0..5).map(target).collect();
    assert_eq!(&targets[..], &[target(0), target(1), target(2)]);
    let mut pushed = Targets::default();
    assert!(pushed.is_empty());
    for node in [7, 8, 9, 10] {
        pushed.push(target(node));
    }
    assert_eq!(pushed.len(), MAX_TARGETS);
    assert_eq!(pushed.iter().map(|t| t.node).collect::<Vec<_>>(), [7, 8, 9]);
}

/// The terms of the route's candidate on node `id`.
fn terms_at(s: &RoutingSnapshot, route: &Route, id: &str) -> Terms {
    let found = route.weighed().find(|(target, _)| node_of(s, *target) == id);
    found.map(|(_, terms)| *terms).unwrap_or_else(|| panic!("{id} not weighed"))
}

#[test]
fn a_session_s_decision_reads_from_its_candidates_terms() {
    // Home: 5 requests ahead at 0.5 s each, then the 50 uncached tokens.
    // Elsewhere: the whole prompt again, and the gain a move must bring.
    let s = snapshot(&[home(slow("busy", 4, 4)), slow("idle", 0, 0)]);
    let route = select(&s, &Idle, &later_turn()).unwrap();
    let (at_home, idle) = (terms_at(&s, &route, "busy"), terms_at(&s, &route, "idle"));
    assert_eq!(
        (at_home.standing, at_home.cache, at_home.cached_tokens, at_home.queue_ahead),
        (cost::Standing::Resident, cost::Cache::Resident, 1_000, 5)
    );
    assert_eq!((at_home.wait_ms, at_home.prefill_ms, at_home.move_ms, at_home.cost_ms()), (2_500, 500, 0, 3_000));
    assert_eq!((idle.standing, idle.cache, idle.cached_tokens), (cost::Standing::Warm, cost::Cache::None, 0));
    assert_eq!((idle.wait_ms, idle.prefill_ms, idle.move_ms, idle.cost_ms()), (0, 10_500, 1_000, 11_500));
    assert!(at_home.cost_ms() < idle.cost_ms() && route.reason == RouteReason::Resident);
    // 22 queued: home costs 12 s, and the free slot's 11.5 s wins.
    let s = snapshot(&[home(slow("busy", 4, 22)), slow("idle", 0, 0)]);
    let route = select(&s, &Idle, &later_turn()).unwrap();
    let costs: Vec<u32> = route.weighed().map(|(_, terms)| terms.cost_ms()).collect();
    assert_eq!((route.reason, costs), (RouteReason::Moved, vec![11_500, 12_000]));
}

#[test]
fn a_carry_is_a_term_of_its_own_and_a_failed_one_takes_the_terms_of_what_is_left() {
    let alike = |s: Spec| Spec { slot_fingerprint: "0123456789abcdef0123456789abcdef".into(), ..s };
    let s = snapshot(&[alike(home(slow("busy", 4, 4))), alike(slow("idle", 0, 0))]);
    let mut route = select(&s, &Idle, &later_turn()).unwrap();
    let carried = terms_at(&s, &route, "idle");
    assert_eq!((carried.cache, carried.cached_tokens, carried.carry_ms), (cost::Cache::Carried, 1_000, 150));
    assert_eq!((carried.prefill_ms, carried.ttft_ms, carried.cost_ms()), (500, 650, 1_650));
    // Reading the prompt there is not worth leaving for: a failed carry goes home.
    route.carry_failed();
    assert_eq!((first_node(&s, &route), route.reason), ("busy".into(), RouteReason::Resident));
    assert_eq!((route.expected_ttft_ms(), route.home_expected_ttft_ms()), (3_000, 0));
    // Where it is, the first target stays, and its terms are a recompute's.
    let fast = Spec { prefill_tokens_per_second: 1_500.0, ..alike(slow("fast", 0, 0)) };
    let s = snapshot(&[alike(home(slow("busy", 4, 22))), fast]);
    let mut route = select(&s, &Idle, &later_turn()).unwrap();
    assert_eq!(route.reason, RouteReason::Carried);
    route.carry_failed();
    let read = terms_at(&s, &route, "fast");
    assert_eq!(
        (route.reason, read.cache, read.carry_ms, read.prefill_ms),
        (RouteReason::Moved, cost::Cache::None, 0, 700)
    );
}

#[test]
fn a_new_session_s_preferred_node_is_weighed_where_it_is_passed_over() {
    let specs = [spec("a"), spec("b"), spec("c"), spec("d")];
    let s = snapshot(&specs);
    let key = (0..100)
        .map(|i| format!("s{i}"))
        .find(|k| first_node(&s, &select(&s, &Idle, &chat(Some(k))).unwrap()) == "a")
        .expect("some session lives on a");
    let route = select(&s, &Idle, &chat(Some(&key))).unwrap();
    let a = terms_at(&s, &route, "a");
    assert!(a.preferred && !a.over_bound, "its own node, within the bound: {a:?}");
    assert_eq!(route.weighed().count(), route.targets.len(), "nothing passed over");
    // Loaded far above the rest, "a" is over the bound: the terms say why
    // the session went elsewhere, though "a" is not among the targets.
    let loaded = snapshot(&[Spec { resident: 8, ..spec("a") }, spec("b"), spec("c"), spec("d")]);
    let route = select(&loaded, &Idle, &chat(Some(&key))).unwrap();
    assert!(!route.targets.iter().any(|t| node_of(&loaded, *t) == "a"));
    let a = terms_at(&loaded, &route, "a");
    assert!(a.preferred && a.over_bound && a.sessions == 8, "{a:?}");
    let first = *route.costs_at(0).unwrap();
    assert!(!first.preferred && !first.over_bound, "{first:?}");
    // Keyless requests have no preferred node.
    let route = select(&s, &Idle, &chat(None)).unwrap();
    assert!(route.weighed().all(|(_, terms)| !terms.preferred));
}

#[test]
fn every_target_is_weighed_in_order_and_a_cold_load_has_no_expected_time() {
    let s = snapshot(&[Spec { state: ModelState::Unloaded, ..spec("cold") }]);
    let route = select(&s, &Idle, &chat(Some("new"))).unwrap();
    assert_eq!(route.reason, RouteReason::Cold);
    assert_eq!((route.costs_at(0).unwrap().standing, route.expected_ttft_ms()), (cost::Standing::Cold, 0));
    let s = snapshot(&[spec("a"), spec("b"), spec("c")]);
    let route = select(&s, &Idle, &chat(None)).unwrap();
    let weighed: Vec<Target> = route.weighed().map(|(target, _)| target).collect();
    assert_eq!(weighed, route.targets.to_vec());
}
