use inferyes_proto::v1::{ModelState, PlacementAction, Replicas as Declared, RoutingPolicy};
use proptest::prelude::*;

use super::*;

const GB: u64 = 1 << 30;
const NOW: u64 = 100_000_000;
const SETTINGS: Settings = Settings { order_timeout_ms: 60_000, idle_ms: 300_000 };

fn model(id: &str, state: ModelState, size: u64) -> Model {
    Model { id: id.into(), state, size, last_used_ms: 0 }
}

/// A node of `total` GB with one backend that places, listing `models`.
fn node(id: &str, total: u64, used: u64, models: Vec<Model>) -> Node {
    Node {
        id: id.into(),
        draining: false,
        memory_total: total * GB,
        memory_used: used * GB,
        memory_known: true,
        threshold: 0.92,
        backends: vec![Backend { id: "swap".into(), places: true, in_flight: 0, models_max: 0, models }],
    }
}

fn policy(replicas: &[(&str, u32, u32)]) -> RoutingPolicy {
    RoutingPolicy {
        replicas: replicas.iter().map(|(m, min, max)| (m.to_string(), Declared { min: *min, max: *max })).collect(),
        ..Default::default()
    }
}

fn loads(actions: &[Action]) -> Vec<(&str, &str)> {
    actions.iter().filter(|a| a.action == Kind::Load).map(|a| (a.node.as_str(), a.model.as_str())).collect()
}

fn unloads(actions: &[Action]) -> Vec<(&str, &str)> {
    actions.iter().filter(|a| a.action == Kind::Unload).map(|a| (a.node.as_str(), a.model.as_str())).collect()
}

#[test]
fn a_declared_model_is_loaded_on_the_nodes_with_most_room_and_only_there() {
    let fleet = Fleet {
        nodes: vec![
            node("a", 24, 10, vec![model("m", ModelState::Unloaded, 4 * GB)]),
            node("b", 24, 2, vec![model("m", ModelState::Unloaded, 4 * GB)]),
            node("c", 80, 70, vec![model("m", ModelState::Unloaded, 4 * GB)]),
            node("d", 24, 0, vec![model("other", ModelState::Unloaded, GB)]),
        ],
    };
    let actions = plan(&fleet, &policy(&[("m", 2, 0)]), &Placing::default(), SETTINGS, NOW);
    assert_eq!(loads(&actions), [("b", "m"), ("a", "m")], "the two with most memory free after; d lacks it");
    assert!(plan(&fleet, &RoutingPolicy::default(), &Placing::default(), SETTINGS, NOW).is_empty(), "undeclared");
    let off = RoutingPolicy { placement_off: true, ..policy(&[("m", 2, 0)]) };
    assert!(plan(&fleet, &off, &Placing::default(), SETTINGS, NOW).is_empty(), "placement off");
}

#[test]
fn a_latency_critical_model_wants_two_and_a_declaration_overrides_it() {
    let critical = RoutingPolicy { latency_critical_models: vec!["m".into()], ..Default::default() };
    assert_eq!(replicas(&critical, "m"), Declared { min: 2, max: 0 });
    let declared = RoutingPolicy { latency_critical_models: vec!["m".into()], ..policy(&[("m", 3, 4)]) };
    assert_eq!(replicas(&declared, "m"), Declared { min: 3, max: 4 });
    assert_eq!(replicas(&declared, "x"), Declared::default());
}

#[test]
fn a_drained_node_does_not_count_and_is_never_touched() {
    let mut drained = node("a", 24, 8, vec![model("m", ModelState::Loaded, 4 * GB)]);
    drained.draining = true;
    let fleet = Fleet {
        nodes: vec![
            drained,
            node("b", 24, 8, vec![model("m", ModelState::Loaded, 4 * GB)]),
            node("c", 24, 0, vec![model("m", ModelState::Unloaded, 4 * GB)]),
        ],
    };
    let actions = plan(&fleet, &policy(&[("m", 2, 2)]), &Placing::default(), SETTINGS, NOW);
    assert_eq!(loads(&actions), [("c", "m")]);
    assert!(unloads(&actions).is_empty(), "nothing leaves the drained node");
}

#[test]
fn no_load_goes_past_the_threshold_nor_where_memory_is_unknown() {
    let mut blind = node("blind", 80, 0, vec![model("m", ModelState::Unloaded, 4 * GB)]);
    blind.memory_known = false;
    // 24 GB at 0.92 is 22.08 GB: 18 used and 4.5 to load is past it.
    let fleet =
        Fleet { nodes: vec![blind, node("full", 24, 18, vec![model("m", ModelState::Unloaded, 4 * GB + GB / 2)])] };
    assert!(plan(&fleet, &policy(&[("m", 1, 0)]), &Placing::default(), SETTINGS, NOW).is_empty());
}

#[test]
fn room_is_made_by_unloading_the_idlest_model_that_may_go() {
    let mut models = vec![
        model("m", ModelState::Unloaded, 8 * GB),
        model("recent", ModelState::Loaded, 8 * GB),
        model("idle", ModelState::Loaded, 8 * GB),
        model("kept", ModelState::Loaded, 4 * GB),
    ];
    models[1].last_used_ms = NOW - 1_000;
    let fleet = Fleet { nodes: vec![node("a", 24, 20, models)] };
    // `kept` is declared and warm only here: it stays at its minimum.
    let declared = policy(&[("m", 1, 0), ("kept", 1, 0)]);
    let mut placing = Placing::default();
    let actions = plan(&fleet, &declared, &placing, SETTINGS, NOW);
    assert_eq!(unloads(&actions), [("a", "idle")]);
    assert!(loads(&actions).is_empty(), "the unload alone first: the load needs its room");
    assert_eq!(actions[0].room_for.as_deref(), Some("m"));
    placing.issue(actions, "c1", 1, NOW);
    assert!(plan(&fleet, &declared, &placing, SETTINGS, NOW).is_empty(), "room is being made: nothing more");
    // The unload done, its memory not shown free yet: nothing more is
    // unloaded for the model, here or elsewhere, while the room is kept.
    let mut unloaded = fleet.clone();
    unloaded.nodes[0].backends[0].models[2].state = ModelState::Unloaded;
    let mut waiting = placing.clone();
    assert_eq!(waiting.settle(&unloaded, SETTINGS, NOW + 1)[0].1, Outcome::Done);
    assert!(plan(&unloaded, &declared, &waiting, SETTINGS, NOW + 2).is_empty(), "the room is kept for m");
    // Once the unload is done and its memory free, the load.
    let mut freed = fleet.clone();
    freed.nodes[0].memory_used -= 8 * GB;
    freed.nodes[0].backends[0].models[2].state = ModelState::Unloaded;
    assert_eq!(placing.settle(&freed, SETTINGS, NOW + 1).iter().map(|(_, o)| *o).collect::<Vec<_>>(), [Outcome::Done]);
    assert_eq!(loads(&plan(&freed, &declared, &placing, SETTINGS, NOW + 1)), [("a", "m")]);
}

#[test]
fn a_model_with_requests_in_flight_is_not_unloaded() {
    let mut busy =
        node("a", 24, 20, vec![model("m", ModelState::Unloaded, 8 * GB), model("idle", ModelState::Loaded, 8 * GB)]);
    busy.backends[0].in_flight = 1;
    assert!(plan(&Fleet { nodes: vec![busy] }, &policy(&[("m", 1, 0)]), &Placing::default(), SETTINGS, NOW).is_empty());
}

#[test]
fn a_backend_at_its_own_limit_has_its_idlest_model_unloaded_first() {
    let mut router =
        node("a", 80, 10, vec![model("m", ModelState::Unloaded, GB), model("old", ModelState::Loaded, GB)]);
    router.backends[0].models_max = 1;
    let actions = plan(&Fleet { nodes: vec![router] }, &policy(&[("m", 1, 0)]), &Placing::default(), SETTINGS, NOW);
    assert_eq!(unloads(&actions), [("a", "old")]);
    assert!(loads(&actions).is_empty(), "then the load, once it is done");
}

#[test]
fn an_order_is_withdrawn_when_its_node_drains_or_its_unload_s_model_is_used_again() {
    let fleet = Fleet { nodes: vec![node("a", 24, 8, vec![model("m", ModelState::Loaded, 4 * GB)])] };
    let mut placing = Placing::default();
    let unload =
        Action { action: Kind::Unload, node: "a".into(), backend: "swap".into(), model: "m".into(), room_for: None };
    placing.issue(vec![unload.clone()], "c1", 1, NOW);
    let mut used = fleet.clone();
    used.nodes[0].backends[0].models[0].last_used_ms = NOW;
    assert_eq!(placing.settle(&used, SETTINGS, NOW + 1)[0].1, Outcome::Withdrawn);
    placing.issue(vec![unload], "c1", 1, NOW);
    let mut drained = fleet;
    drained.nodes[0].draining = true;
    assert_eq!(placing.settle(&drained, SETTINGS, NOW + 1)[0].1, Outcome::Withdrawn);
    assert!(placing.orders().is_empty());
}

#[test]
fn order_ids_go_on_after_every_order_is_withdrawn() {
    let mut placing = Placing::default();
    let load =
        Action { action: Kind::Load, node: "a".into(), backend: "swap".into(), model: "m".into(), room_for: None };
    let first = placing.issue(vec![load.clone()], "c1", 1, NOW);
    placing.withdraw_all();
    let second = placing.issue(vec![load], "c1", 1, NOW);
    assert_ne!(first[0].id, second[0].id, "an agent carries out an id once");
}

#[test]
fn past_its_maximum_the_idlest_copy_is_unloaded_one_at_a_time() {
    let mut nodes: Vec<Node> =
        ["a", "b", "c"].iter().map(|id| node(id, 24, 8, vec![model("m", ModelState::Loaded, 4 * GB)])).collect();
    nodes[0].backends[0].models[0].last_used_ms = NOW - 10_000_000;
    nodes[1].backends[0].models[0].last_used_ms = NOW - 1_000;
    nodes[2].backends[0].models[0].last_used_ms = NOW - 20_000_000;
    let actions = plan(&Fleet { nodes }, &policy(&[("m", 1, 1)]), &Placing::default(), SETTINGS, NOW);
    assert_eq!(unloads(&actions), [("c", "m")]);
}

#[test]
fn an_order_is_settled_by_what_the_fleet_shows_and_a_failure_backs_off() {
    let unloaded = Fleet { nodes: vec![node("a", 24, 0, vec![model("m", ModelState::Unloaded, GB)])] };
    let mut placing = Placing::default();
    let actions = plan(&unloaded, &policy(&[("m", 1, 0)]), &placing, SETTINGS, NOW);
    let issued = placing.issue(actions, "c1", 7, NOW);
    assert_eq!(issued.len(), 1);
    assert_eq!(issued[0].id, "c1.7.1");
    assert_eq!(issued[0].action(), PlacementAction::Load);
    assert!(plan(&unloaded, &policy(&[("m", 1, 0)]), &placing, SETTINGS, NOW).is_empty(), "outstanding");
    assert!(placing.settle(&unloaded, SETTINGS, NOW + 1_000).is_empty(), "still waiting");
    // It loads, then falls back: a failed load, before its timeout.
    let loading = Fleet { nodes: vec![node("a", 24, 0, vec![model("m", ModelState::Loading, GB)])] };
    assert!(placing.settle(&loading, SETTINGS, NOW + 2_000).is_empty());
    let settled = placing.settle(&unloaded, SETTINGS, NOW + 3_000);
    assert_eq!(settled.iter().map(|(_, o)| *o).collect::<Vec<_>>(), [Outcome::Failed]);
    assert!(plan(&unloaded, &policy(&[("m", 1, 0)]), &placing, SETTINGS, NOW + 4_000).is_empty(), "backing off");
    let later = NOW + 3_000 + BACKOFF_MS;
    let again = plan(&unloaded, &policy(&[("m", 1, 0)]), &placing, SETTINGS, later);
    assert_eq!(loads(&again), [("a", "m")], "tried again once the backoff ends");
    placing.issue(again, "c1", 7, later);
    let loaded = Fleet { nodes: vec![node("a", 24, 1, vec![model("m", ModelState::Loaded, GB)])] };
    let settled = placing.settle(&loaded, SETTINGS, later + 1);
    assert_eq!(settled.iter().map(|(_, o)| *o).collect::<Vec<_>>(), [Outcome::Done]);
    assert!(placing.orders().is_empty());
    // An order past its timeout failed; one whose node left is moot.
    let load = |node: &str, model: &str| Action {
        action: Kind::Load,
        node: node.into(),
        backend: "swap".into(),
        model: model.into(),
        room_for: None,
    };
    placing.issue(vec![load("a", "x")], "c1", 7, later);
    placing.issue(vec![load("gone", "m")], "c1", 7, later);
    let settled = placing.settle(&loaded, SETTINGS, later + SETTINGS.order_timeout_ms);
    assert_eq!(settled.iter().map(|(_, o)| *o).collect::<Vec<_>>(), [Outcome::Failed, Outcome::Gone]);
}

// -------------------------------------------------------------- properties

fn arb_model(ids: &'static [&'static str]) -> impl Strategy<Value = Model> {
    (
        proptest::sample::select(ids),
        prop_oneof![
            Just(ModelState::Loaded),
            Just(ModelState::Unloaded),
            Just(ModelState::Loading),
            Just(ModelState::Unknown)
        ],
        0u64..12,
        prop_oneof![Just(0u64), Just(NOW - 1_000), Just(NOW - 1_000_000)],
    )
        .prop_map(|(id, state, size, last_used_ms)| Model { id: id.into(), state, size: size * GB, last_used_ms })
}

fn arb_node(index: usize) -> impl Strategy<Value = Node> {
    const MODELS: &[&str] = &["m1", "m2", "m3", "m4"];
    (
        any::<bool>(),
        prop_oneof![Just(0u64), Just(24), Just(80)],
        0u64..80,
        prop::bool::weighted(0.9),
        proptest::collection::vec(
            (any::<bool>(), 0u32..2, 0u32..3, proptest::collection::vec(arb_model(MODELS), 0..4)),
            1..3,
        ),
    )
        .prop_map(move |(draining, total, used, known, backends)| Node {
            id: format!("n{index}"),
            draining,
            memory_total: total * GB,
            memory_used: (used * GB).min(total * GB),
            memory_known: known,
            threshold: 0.92,
            backends: backends
                .into_iter()
                .enumerate()
                .map(|(i, (places, in_flight, models_max, mut models))| {
                    models.sort_by(|a, b| a.id.cmp(&b.id));
                    models.dedup_by(|a, b| a.id == b.id);
                    Backend { id: format!("b{i}"), places, in_flight, models_max, models }
                })
                .collect(),
        })
}

fn arb_fleet() -> impl Strategy<Value = Fleet> {
    (1usize..6).prop_flat_map(|n| (0..n).map(arb_node).collect::<Vec<_>>()).prop_map(|nodes| Fleet { nodes })
}

fn arb_policy() -> impl Strategy<Value = RoutingPolicy> {
    proptest::collection::vec((proptest::sample::select(&["m1", "m2", "m3", "m4"][..]), 0u32..4, 0u32..4), 0..4)
        .prop_map(|declared| policy(&declared.iter().map(|(m, a, b)| (*m, *a, *b)).collect::<Vec<_>>()))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn a_plan_keeps_every_promise(fleet in arb_fleet(), policy in arb_policy()) {
        let actions = plan(&fleet, &policy, &Placing::default(), SETTINGS, NOW);
        let mut seen = std::collections::BTreeSet::new();
        for action in &actions {
            prop_assert!(seen.insert((action.node.clone(), action.model.clone())), "one order per node and model");
            let node = fleet.node(&action.node).unwrap();
            prop_assert!(!node.draining, "a draining node is never touched");
            let backend = node.backends.iter().find(|b| b.id == action.backend).unwrap();
            prop_assert!(backend.places, "only a backend that loads on request");
            let listed = backend.models.iter().find(|m| m.id == action.model).unwrap();
            match action.action {
                Kind::Load => {
                    prop_assert!(node.memory_known && listed.state == ModelState::Unloaded);
                    prop_assert!(replicas(&policy, &action.model).min > 0, "only declared models are loaded");
                }
                Kind::Unload => {
                    prop_assert_eq!(listed.state, ModelState::Loaded);
                    prop_assert_eq!(backend.in_flight, 0, "nothing with requests in flight");
                    prop_assert!(NOW - listed.last_used_ms >= SETTINGS.idle_ms, "nothing used lately");
                }
            }
        }
        for node in &fleet.nodes {
            // Memory after the node's loads and unloads stays under the
            // threshold wherever loads were planned.
            let mine: Vec<&Action> = actions.iter().filter(|a| a.node == node.id).collect();
            if !mine.iter().any(|a| a.action == Kind::Load) {
                continue;
            }
            let size = |a: &Action| footprint(node, &a.model);
            let loaded: u64 = mine.iter().filter(|a| a.action == Kind::Load).map(|a| size(a)).sum();
            let freed: u64 = mine.iter().filter(|a| a.action == Kind::Unload).map(|a| {
                node.models().find(|(b, m)| b.id == a.backend && m.id == a.model).map_or(0, |(_, m)| m.size)
            }).sum();
            let budget = (node.memory_total as f64 * node.threshold) as u64;
            prop_assert!(node.memory_used + loaded <= budget + freed, "{} over its threshold", node.id);
            for backend in node.backends.iter().filter(|b| b.models_max > 0) {
                let held = backend.models.iter().filter(|m| matches!(m.state, ModelState::Loaded | ModelState::Loading)).count();
                let added = mine.iter().filter(|a| a.backend == backend.id && a.action == Kind::Load).count();
                let removed = mine.iter().filter(|a| a.backend == backend.id && a.action == Kind::Unload).count();
                if added > 0 {
                    prop_assert!(held + added - removed <= backend.models_max as usize, "past its own limit");
                }
            }
        }
        // No declared model goes below its minimum by an unload.
        for model in declared(&policy) {
            let warm = fleet.nodes.iter().filter(|n| n.warm(model)).count();
            let unloaded = actions.iter().filter(|a| a.action == Kind::Unload && a.model == model).count();
            prop_assert!(unloaded == 0 || warm - unloaded >= replicas(&policy, model).min as usize);
        }
    }
}

/// Carries out `orders` at once, as the nodes would: a load takes its
/// footprint, an unload gives it back. Whether a load stayed under its
/// node's threshold.
fn carry_out(fleet: &mut Fleet, orders: &[PlacementOrder]) -> bool {
    let mut under = true;
    for order in orders {
        let Some(node) = fleet.nodes.iter_mut().find(|n| n.id == order.node_id) else { continue };
        let footprint = footprint(node, &order.model);
        let budget = (node.memory_total as f64 * node.threshold) as u64;
        let Some(model) = node
            .backends
            .iter_mut()
            .filter(|b| b.id == order.backend_id)
            .flat_map(|b| b.models.iter_mut())
            .find(|m| m.id == order.model)
        else {
            continue;
        };
        match order.action() {
            PlacementAction::Load => {
                model.state = ModelState::Loaded;
                node.memory_used += footprint;
                under &= node.memory_used <= budget;
            }
            _ => {
                model.state = ModelState::Unloaded;
                node.memory_used = node.memory_used.saturating_sub(footprint);
            }
        }
    }
    under
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn rounds_of_orders_stay_under_the_threshold_and_settle(fleet in arb_fleet(), policy in arb_policy()) {
        let mut fleet = fleet;
        let mut placing = Placing::default();
        for round in 0..12u64 {
            let now = NOW + round * 1_000;
            placing.settle(&fleet, SETTINGS, now);
            let actions = plan(&fleet, &policy, &placing, SETTINGS, now);
            let mut nodes: Vec<&str> = actions.iter().filter(|a| a.action == Kind::Load).map(|a| a.node.as_str()).collect();
            nodes.sort_unstable();
            let loads = nodes.len();
            nodes.dedup();
            prop_assert_eq!(nodes.len(), loads, "one load at a time per node");
            let issued = placing.issue(actions, "c1", 1, now);
            prop_assert!(carry_out(&mut fleet, &issued), "a load took its node past the threshold");
        }
        let now = NOW + 12_000;
        placing.settle(&fleet, SETTINGS, now);
        prop_assert!(plan(&fleet, &policy, &placing, SETTINGS, now).is_empty(), "placement settles");
    }
}
