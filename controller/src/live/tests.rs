use std::collections::HashMap;

use inferyes_proto::v1::{Backend, EndpointKind, Gpu, Model};
use prost::Message;

use super::*;

fn status(busy: u32, used: u64, sessions: usize) -> NodeStatus {
    NodeStatus {
        node_id: "n".into(),
        proxy_url: "http://n".into(),
        gpus: vec![Gpu {
            index: 0,
            memory_total_bytes: 80 << 30,
            memory_used_bytes: used,
            utilization_percent: 40,
            ..Default::default()
        }],
        backends: (0..8)
            .map(|b| Backend {
                id: format!("b{b}"),
                models: vec![Model { id: "gemma".into(), ..Default::default() }],
                slots_total: 4,
                slots_busy: busy,
                in_flight: busy,
                prefill_tokens_per_second: 1234.5,
                service_ms: 800,
                ..Default::default()
            })
            .collect(),
        sessions: (0..sessions).map(|i| session(&format!("s{i}"), "b0", 1)).collect(),
        ..Default::default()
    }
}

fn session(key: &str, backend: &str, last_seen: u64) -> ResidentSession {
    ResidentSession {
        key: key.into(),
        backend_id: backend.into(),
        last_seen_unix_ms: last_seen,
        tokens: 10,
        ..Default::default()
    }
}

fn load(backends: &[&str]) -> NodeLoad {
    NodeLoad {
        backends: backends.iter().map(|b| BackendLoad { backend_id: (*b).into(), ..Default::default() }).collect(),
        gpus: Vec::new(),
        moves: None,
    }
}

fn origin(id: &str) -> Arc<str> {
    id.into()
}

/// The stream of `from`: this controller's first agent stream, or a peer's.
fn stream(from: &str) -> u64 {
    u64::from(from == "me")
}

fn put(state: &mut LiveState, node: &str, from: &str, full: bool, upserted: Vec<ResidentSession>, removed: &[&str]) {
    state.apply(LiveEvent::Sessions {
        node_id: node.into(),
        origin: origin(from),
        stream: stream(from),
        full,
        upserted,
        removed: removed.iter().map(|k| (*k).to_string()).collect(),
    });
}

#[test]
fn traffic_changes_the_load_and_not_the_record() {
    let (quiet, _, _) = split(status(0, 30 << 30, 0));
    let (busy, load, _) = split(status(3, (30 << 30) + (50 << 20), 2_000));
    assert_eq!(quiet, busy, "busy slots, a few MB and sessions leave the record as it was");
    assert_eq!(load.backends[0].slots_busy, 3);
    assert_eq!(load.gpus[0].memory_used_bytes, (30 << 30) + (50 << 20));
    let (loaded, _, _) = split(status(0, 40 << 30, 0));
    assert_ne!(quiet, loaded, "a model's worth of memory is a new step");
    assert!(busy.encoded_len() < 16 << 10, "a node of 8 backends fits 16 kB: {}", busy.encoded_len());
}

#[test]
fn memory_steps_round_up_and_stay_within_the_total() {
    assert_eq!(memory_step(0, 100), 0);
    assert_eq!(memory_step(1, 100), 1);
    assert_eq!(memory_step(101, 10_000), 200);
    assert_eq!(memory_step(9_950, 10_000), 10_000);
    assert_eq!(memory_step(5, 0), 5, "no total: as read");
}

#[test]
fn a_hostile_status_is_bounded() {
    let mut huge = status(0, 0, 0);
    huge.hostname = "h".repeat(1 << 20);
    huge.backends = (0..1_000)
        .map(|b| Backend {
            id: format!("b{b}"),
            models: (0..1_000).map(|m| Model { id: format!("{m}{}", "é".repeat(500)), ..Default::default() }).collect(),
            ..Default::default()
        })
        .collect();
    let (record, _, dropped) = split(huge);
    let kept: usize = record.backends.iter().map(|b| b.models.len()).sum();
    assert_eq!(dropped, (1_000 - MAX_BACKENDS) + MAX_BACKENDS * 1_000 - kept, "every model not kept is counted");
    assert!(kept > 1_000 && record.backends.len() == MAX_BACKENDS, "{kept}");
    assert!(record.hostname.len() <= MAX_TEXT && record.backends[0].models[0].id.len() <= MAX_TEXT);
    assert!(record.encoded_len() <= MAX_RECORD_BYTES, "{}", record.encoded_len());
    assert!(record.encoded_len() > MAX_RECORD_BYTES - 1024, "no more dropped than need be");

    // A kind said a million times is one; one that is none is dropped.
    let mut repeated = status(0, 0, 0);
    let kinds: Vec<i32> = std::iter::repeat_n(EndpointKind::Infill as i32, 1_000_000).chain([-7, 0, 999]).collect();
    let model = Model { id: "m".into(), endpoints: kinds.clone(), unsupported: kinds, ..Default::default() };
    repeated.backends = vec![Backend { id: "b".into(), models: vec![model], ..Default::default() }];
    let (record, _, dropped) = split(repeated);
    let model = &record.backends[0].models[0];
    assert_eq!((model.endpoints.len(), model.unsupported.len(), dropped), (1, 1, 2 * (999_999 + 3)));

    // What is shown of it reads as it is, on one line; a backend or a
    // model whose id would not is dropped, never renamed (both sides know
    // it by that id).
    let mut spoofing = status(0, 0, 0);
    spoofing.hostname = "gpu-1\ngpu-2  ready".into();
    spoofing.gpus = vec![Gpu { name: "H200\u{1b}[2J\u{202e}".into(), ..Default::default() }];
    let model = |id: &str| Model { id: id.into(), ..Default::default() };
    spoofing.backends = vec![
        Backend { id: "main".into(), models: vec![model("qwen"), model("qwen\ngpu-2")], ..Default::default() },
        Backend { id: "main\u{200b}".into(), models: vec![model("qwen")], ..Default::default() },
    ];
    let (record, _, dropped) = split(spoofing);
    assert_eq!(dropped, 2);
    assert_eq!(record.backends.len(), 1);
    assert_eq!((record.backends[0].id.as_str(), record.backends[0].models.len()), ("main", 1));
    assert_eq!(
        (record.hostname.as_str(), record.gpus[0].name.as_str()),
        ("gpu-1\u{fffd}gpu-2  ready", "H200\u{fffd}[2J\u{fffd}")
    );
}

#[test]
fn a_batch_carries_only_what_changed_since_the_last() {
    let mut state = LiveState::new("me");
    state.apply(LiveEvent::Load { node_id: "n".into(), origin: origin("me"), stream: 1, load: load(&["b0", "b1"]) });
    let table: Vec<_> = (0..1_000).map(|i| session(&format!("s{i}"), "b0", i)).collect();
    put(&mut state, "n", "me", true, table, &[]);
    let first = state.take_batch(true).expect("a batch");
    let node = &first.delta.nodes[0];
    assert!(node.sessions_full && node.load.is_some());
    assert_eq!((node.upserted.len(), first.own.nodes[0].sessions.len()), (1_000, 1_000));

    put(&mut state, "n", "me", false, vec![session("new", "b1", 5_000)], &["s1", "missing"]);
    // The same session again, unchanged: nothing to send.
    put(&mut state, "n", "me", false, vec![session("s2", "b0", 2)], &[]);
    let second = state.take_batch(true).expect("a batch");
    let node = &second.delta.nodes[0];
    assert!(!node.sessions_full && node.load.is_none(), "the load did not change");
    assert_eq!(node.upserted.len(), 1);
    assert_eq!(node.upserted[0].backend, 1, "b1's index in the node's backends");
    assert_eq!(node.removed, [inferyes_proto::hash::stable_hash(b"s1")]);
    assert_eq!(second.own.nodes[0].removed, ["s1"]);
    assert!(state.take_batch(true).is_none(), "nothing new");
    assert_eq!(second.seq, first.seq + 1);

    let view = state.view();
    assert_eq!(view.sessions, 1_000);
    assert_eq!(view.nodes["n"].sessions, BTreeMap::from([("b0".to_string(), 999), ("b1".to_string(), 1)]));
    assert_eq!(view.recent.len(), RECENT_SESSIONS);
    assert_eq!(view.recent[0].1.key, "new", "most recent first");
}

#[test]
fn a_stream_here_wins_and_each_origin_removes_only_its_own() {
    let mut state = LiveState::new("me");
    let owners = |state: &LiveState| -> Vec<(String, String)> {
        state.view().nodes.iter().map(|(id, s)| (id.clone(), s.origin.to_string())).collect()
    };
    state.apply(LiveEvent::PeerFull {
        origin: origin("c2"),
        nodes: ["a", "b"]
            .iter()
            .map(|id| NodeLive { node_id: (*id).into(), load: Some(load(&["b0"])), ..Default::default() })
            .collect(),
    });
    state.take_batch(true);
    // `a`'s agent moved here: the stream here takes it over, and a late
    // word from c2 about it changes nothing.
    put(&mut state, "a", "me", true, vec![session("x", "b0", 1)], &[]);
    put(&mut state, "a", "c2", false, vec![], &["x"]);
    state.apply(LiveEvent::Gone { node_id: "a".into(), origin: origin("c2"), stream: 0 });
    state.take_batch(true);
    assert_eq!(owners(&state), [("a".into(), "me".into()), ("b".into(), "c2".into())]);
    assert_eq!(state.view().nodes["a"].sessions["b0"], 1);

    // c2 goes away: its node stays, not fresh, until another has it whole.
    state.apply(LiveEvent::PeerLost { origin: origin("c2") });
    let batch = state.take_batch(true).expect("the freshness changed");
    assert!(batch.delta.nodes.iter().any(|n| n.node_id == "b" && n.stale));
    assert!(batch.own.nodes.is_empty(), "peers hear only of this controller's own nodes");
    put(&mut state, "b", "c3", false, vec![session("y", "b0", 1)], &[]);
    assert_eq!(state.view().sessions, 1, "a delta from another peer is not the whole table");
    put(&mut state, "b", "c3", true, vec![session("y", "b0", 1)], &[]);
    state.take_batch(true);
    assert_eq!(owners(&state)[1], ("b".into(), "c3".into()));
    assert!(state.view().nodes["b"].fresh);

    // A peer's new whole set drops its nodes not in it; etcd losing a node
    // drops a peer's, never a stream's here.
    state.apply(LiveEvent::PeerFull { origin: origin("c3"), nodes: Vec::new() });
    state.node_left("a");
    let batch = state.take_batch(true).expect("a node gone");
    assert_eq!(batch.delta.gone, ["b"]);
    assert_eq!(owners(&state), [("a".into(), "me".into())]);
    state.apply(LiveEvent::Gone { node_id: "a".into(), origin: origin("me"), stream: 1 });
    let batch = state.take_batch(true).expect("a node gone");
    assert_eq!(
        (batch.delta.gone.as_slice(), batch.own.gone.as_slice()),
        (["a".to_string()].as_slice(), ["a".to_string()].as_slice())
    );
}

#[test]
fn a_node_holds_no_more_sessions_than_its_bound() {
    let mut state = LiveState::new("me");
    state.apply(LiveEvent::Load { node_id: "n".into(), origin: origin("me"), stream: 1, load: load(&["b0"]) });
    let many: Vec<_> = (0..MAX_SESSIONS + 10).map(|i| session(&format!("s{i}"), "b0", 1)).collect();
    put(&mut state, "n", "me", true, many, &[]);
    assert_eq!(state.view().sessions, MAX_SESSIONS);
    put(
        &mut state,
        "n",
        "me",
        false,
        vec![session("new", "b0", 2), session(&"k".repeat(MAX_KEY_BYTES + 1), "b0", 2)],
        &[],
    );
    assert_eq!(state.view().sessions, MAX_SESSIONS, "no room for a new one, nor for a key too long");
    put(&mut state, "n", "me", false, vec![session("new", "b0", 2)], &["s0"]);
    assert_eq!(state.list(Some("n"), 1).0[0].session.as_ref().map(|s| s.key.as_str()), Some("new"));
}

/// What a data plane holds after applying batches: node → key → entry.
type Held = HashMap<String, HashMap<u64, (u32, u32, u64)>>;

fn receive(held: &mut Held, delta: &LiveDelta) {
    for node in &delta.nodes {
        let table = held.entry(node.node_id.clone()).or_default();
        if node.sessions_full {
            table.clear();
        }
        for key in &node.removed {
            table.remove(key);
        }
        for e in &node.upserted {
            table.insert(e.key, (e.backend, e.tokens, e.last_seen_unix_ms));
        }
    }
    for id in &delta.gone {
        held.remove(id);
    }
}

#[test]
fn batches_applied_in_order_give_the_whole_state() {
    let mut state = LiveState::new("me");
    let mut held = Held::new();
    let mut rng = fastrand::Rng::with_seed(7);
    for round in 0..300u64 {
        let node = format!("n{}", rng.usize(0..4));
        let from = ["me", "me", "c2"][rng.usize(0..3)];
        match rng.u8(0..10) {
            0 => state.apply(LiveEvent::Gone { node_id: node, origin: origin(from), stream: stream(from) }),
            1 => state.apply(LiveEvent::PeerLost { origin: origin("c2") }),
            2 => state.apply(LiveEvent::Load {
                node_id: node,
                origin: origin(from),
                stream: stream(from),
                load: load(&["b0", "b1"]),
            }),
            _ => {
                let upserted = (0..rng.usize(0..5))
                    .map(|_| session(&format!("k{}", rng.u8(0..20)), ["b0", "b1"][rng.usize(0..2)], round))
                    .collect();
                let removed: Vec<String> = (0..rng.usize(0..3)).map(|_| format!("k{}", rng.u8(0..20))).collect();
                let removed: Vec<&str> = removed.iter().map(String::as_str).collect();
                put(&mut state, &node, from, rng.u8(0..8) == 0, upserted, &removed);
            }
        }
        if rng.bool()
            && let Some(batch) = state.take_batch(true)
        {
            receive(&mut held, &batch.delta);
        }
    }
    if let Some(batch) = state.take_batch(true) {
        receive(&mut held, &batch.delta);
    }
    let mut whole = Held::new();
    receive(&mut whole, &LiveDelta { nodes: state.full(), gone: Vec::new() });
    assert_eq!(held, whole);
}

#[test]
fn merge_puts_the_load_back_and_marks_what_is_not_known() {
    let full = status(2, 31 << 30, 0);
    let (durable, node_load, _) = split(full.clone());
    let summary = Summary {
        origin: origin("me"),
        fresh: true,
        load: node_load,
        sessions: BTreeMap::from([("b0".to_string(), 3)]),
        last_used: BTreeMap::new(),
    };
    let merged = merge(&durable, Some(&summary));
    assert_eq!(merged.backends[0].resident_sessions, 3);
    let mut expected = full.clone();
    expected.backends[0].resident_sessions = 3;
    assert_eq!(merged, expected);
    assert!(merge(&durable, None).backends.iter().all(|b| b.load_unknown));
    let stale = Summary { fresh: false, ..summary };
    assert!(merge(&durable, Some(&stale)).backends.iter().all(|b| b.load_unknown && b.slots_busy == 2));
}

#[test]
fn a_peer_that_comes_back_is_fresh_again_and_an_old_stream_here_removes_nothing() {
    let mut state = LiveState::new("me");
    let node = |sessions: Vec<ResidentSession>| NodeLive {
        node_id: "b".into(),
        load: Some(load(&["b0"])),
        sessions,
        sessions_full: true,
        removed: Vec::new(),
    };
    state.apply(LiveEvent::PeerFull { origin: origin("c2"), nodes: vec![node(vec![session("y", "b0", 1)])] });
    state.apply(LiveEvent::PeerLost { origin: origin("c2") });
    state.take_batch(true);
    assert!(!state.view().nodes["b"].fresh);
    state.apply(LiveEvent::PeerFull { origin: origin("c2"), nodes: vec![node(vec![session("y", "b0", 1)])] });
    let batch = state.take_batch(true).expect("fresh again");
    assert!(batch.delta.nodes.iter().any(|n| n.node_id == "b" && !n.stale));
    assert!(state.view().nodes["b"].fresh);

    // The agent of `n` reconnected here (stream 2) before its old stream
    // (1) was seen to end: the old one's end and late words change nothing.
    let sessions = |stream: u64, keys: &[&str]| LiveEvent::Sessions {
        node_id: "n".into(),
        origin: origin("me"),
        stream,
        full: true,
        upserted: keys.iter().map(|k| session(k, "b0", 1)).collect(),
        removed: Vec::new(),
    };
    state.apply(LiveEvent::Load { node_id: "n".into(), origin: origin("me"), stream: 1, load: load(&["b0"]) });
    state.apply(sessions(1, &["old"]));
    state.apply(LiveEvent::Load { node_id: "n".into(), origin: origin("me"), stream: 2, load: load(&["b0"]) });
    state.apply(sessions(2, &["new"]));
    state.apply(sessions(1, &["late"]));
    state.apply(LiveEvent::Gone { node_id: "n".into(), origin: origin("me"), stream: 1 });
    state.take_batch(true);
    let listed: Vec<String> =
        state.list(Some("n"), 10).0.into_iter().filter_map(|i| i.session).map(|s| s.key).collect();
    assert_eq!(listed, ["new"]);
}

#[test]
fn a_node_new_here_goes_out_whole_and_a_peer_s_changes_need_its_table() {
    let mut state = LiveState::new("me");
    // A peer's changes to a node not held: no table to apply them to.
    state.apply(LiveEvent::PeerDelta {
        origin: origin("c2"),
        nodes: vec![NodeLive {
            node_id: "p".into(),
            load: Some(load(&["b0"])),
            sessions: vec![session("x", "b0", 1)],
            ..Default::default()
        }],
        gone: Vec::new(),
    });
    assert!(state.take_batch(true).is_none());
    // A node first heard of through a delta goes out with load and table.
    put(&mut state, "n", "me", false, vec![session("s", "b0", 1)], &[]);
    let batch = state.take_batch(true).expect("a batch");
    assert!(batch.delta.nodes[0].sessions_full && batch.delta.nodes[0].load.is_some());
    // A new list of backends places every session anew.
    state.apply(LiveEvent::Load { node_id: "n".into(), origin: origin("me"), stream: 1, load: load(&["bx", "b0"]) });
    let batch = state.take_batch(true).expect("a batch");
    let node = &batch.delta.nodes[0];
    assert!(node.sessions_full);
    assert_eq!(node.upserted.iter().map(|e| e.backend).collect::<Vec<_>>(), [1]);
}

#[test]
fn peers_get_each_node_of_this_controller_whole_in_turn() {
    let mut state = LiveState::new("me");
    for id in ["a", "b"] {
        put(&mut state, id, "me", true, vec![session(&format!("{id}-s"), "b0", 1)], &[]);
        state.apply(LiveEvent::Load { node_id: id.into(), origin: origin("me"), stream: 1, load: load(&["b0"]) });
    }
    state.take_batch(true);
    let mut refreshed = Vec::new();
    for _ in 0..(4 * REFRESH_EVERY) {
        let at = state.seq();
        put(&mut state, "a", "me", false, vec![session("tick", "b0", at)], &[]);
        let batch = state.take_batch(true).expect("a batch");
        refreshed.extend(batch.own.nodes.iter().filter(|n| n.sessions_full).map(|n| n.node_id.clone()));
    }
    assert_eq!(refreshed, ["a", "b", "a", "b"]);
}
