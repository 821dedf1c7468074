//! The routing decision and the snapshot decode at fleet scale.
//!
//! ```sh
//! cargo bench -p inferyes-dataplane --bench routing
//! ```
//!
//! Fleets of 8, 64, 512 and 1,000 nodes hold 100,000 resident sessions in
//! all. "every node" places one model on all nodes (the worst case for a
//! decision); "5% of nodes" spreads 20 models, each on a twentieth of the
//! fleet. After criterion's runs, a percentile pass prints p50/p99/max per
//! decision, the figures the targets are stated in. Then the routing view
//! of a long conversation and of a one-line request, and the hash of a
//! conversation's root.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use inferyes_dataplane::http::{parse_view, session_key};
use inferyes_dataplane::routing::{Mode, RouteRequest, select, stable_hash, text_hash};
use inferyes_dataplane::snapshot::{Live, RoutingSnapshot, decode, decode_live};
use inferyes_proto::v1::{
    Backend, EndpointKind, Gpu, Health, Model, ModelState, NodeStatus, ResidentSession, SnapshotNode,
};

const SESSIONS: usize = 100_000;
const FLEETS: [usize; 4] = [8, 64, 512, 1000];

/// `spread`: how many models share the fleet (1: one model everywhere).
fn fleet(nodes: usize, spread: usize) -> BTreeMap<String, SnapshotNode> {
    (0..nodes)
        .map(|n| {
            let id = format!("gpu-{n:04}");
            let mut model = Model {
                id: format!("model-{}", n % spread),
                context_window: 8192,
                size_bytes: 8 << 30,
                endpoints: vec![EndpointKind::Chat as i32],
                ..Default::default()
            };
            model.set_state(ModelState::Loaded);
            let mut backend = Backend {
                id: "llama-0".into(),
                models: vec![model],
                slots_total: 8,
                slots_busy: (n % 5) as u32,
                in_flight: (n % 7) as u32,
                weight: 1,
                ..Default::default()
            };
            backend.set_health(Health::Ready);
            let sessions = (0..SESSIONS / nodes)
                .map(|s| ResidentSession {
                    key: format!("session-{n}-{s}"),
                    backend_id: "llama-0".into(),
                    requests: 3,
                    tokens: 2000,
                    ..Default::default()
                })
                .collect();
            let status = NodeStatus {
                node_id: id.clone(),
                proxy_url: format!("http://10.0.{}.{}:9100", n / 250, n % 250),
                gpus: vec![Gpu {
                    memory_total_bytes: 80 << 30,
                    memory_used_bytes: (30 + (n % 50) as u64) << 30,
                    ..Default::default()
                }],
                backends: vec![backend],
                sessions,
                ..Default::default()
            };
            (id, SnapshotNode { status: Some(status), draining: false, policy: None, instance_digest: String::new() })
        })
        .collect()
}

fn request<'a>(model: &'a str, session: Option<&'a str>, ticket: u64) -> RouteRequest<'a> {
    RouteRequest {
        model,
        kind: EndpointKind::Chat,
        session,
        prompt_tokens: 500,
        mode: Mode::Policy,
        carry: true,
        ticket,
        now_ms: 0,
    }
}

struct Case {
    name: &'static str,
    nodes: usize,
    snapshot: RoutingSnapshot,
    wire: BTreeMap<String, SnapshotNode>,
    resident: Vec<String>,
    fresh: Vec<String>,
}

fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (name, spread) in [("every node", 1usize), ("5% of nodes", 20)] {
        for nodes in FLEETS {
            let spread = spread.min(nodes);
            let wire = fleet(nodes, spread);
            let snapshot = decode(1, &wire, None, &[], &inferyes_dataplane::targets::NodeStates::default());
            // Sessions resident on nodes serving model-0.
            let resident =
                (0..1000).map(|i| format!("session-{}-{}", (i * spread) % nodes, i % (SESSIONS / nodes))).collect();
            let fresh = (0..1000).map(|i| format!("new-{i}")).collect();
            cases.push(Case { name, nodes, snapshot, wire, resident, fresh });
        }
    }
    cases
}

fn bench(c: &mut Criterion, cases: &[Case]) {
    let mut group = c.benchmark_group("route");
    group.measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    for case in cases {
        let label = format!("{} / {} nodes", case.name, case.nodes);
        group.bench_with_input(BenchmarkId::new("resident", &label), case, |b, case| {
            let mut i = 0usize;
            b.iter(|| {
                i = (i + 1) % case.resident.len();
                black_box(select(
                    &case.snapshot,
                    case.snapshot.local(),
                    &request("model-0", Some(&case.resident[i]), i as u64),
                ))
            })
        });
        group.bench_with_input(BenchmarkId::new("new session", &label), case, |b, case| {
            let mut i = 0usize;
            b.iter(|| {
                i = (i + 1) % case.fresh.len();
                black_box(select(
                    &case.snapshot,
                    case.snapshot.local(),
                    &request("model-0", Some(&case.fresh[i]), i as u64),
                ))
            })
        });
        group.bench_with_input(BenchmarkId::new("no session", &label), case, |b, case| {
            let mut i = 0u64;
            b.iter(|| {
                i += 1;
                black_box(select(&case.snapshot, case.snapshot.local(), &request("model-0", None, i)))
            })
        });
    }
    group.finish();
    let mut group = c.benchmark_group("decode");
    group.sample_size(10).measurement_time(Duration::from_secs(3));
    for case in cases.iter().filter(|c| c.name == "every node") {
        group.bench_with_input(BenchmarkId::new("full snapshot, 100k sessions", case.nodes), case, |b, case| {
            let states = inferyes_dataplane::targets::NodeStates::default();
            b.iter(|| black_box(decode(2, &case.wire, None, &[], &states)))
        });
        // What a data plane does per live batch: the records again, with
        // the loads and session counts of a live state it already holds.
        let live = Live::from_statuses(&case.wire);
        group.bench_with_input(BenchmarkId::new("records with live state", case.nodes), case, |b, case| {
            let states = inferyes_dataplane::targets::NodeStates::default();
            b.iter(|| black_box(decode_live(2, &case.wire, &live, None, &[], (&states, &Default::default()))))
        });
    }
    group.finish();
    // The routing view of a long conversation (a 10 KB system prompt and
    // twenty turns, as coding agents send), and its root hashed the way
    // session keys are, next to FNV-1a over the same bytes.
    let mut group = c.benchmark_group("view");
    group.measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    let body = long_conversation();
    group.bench_function("parse_view + session_key, 10 KB system prompt, 20 turns", |b| {
        b.iter(|| {
            let view = parse_view(black_box(&body)).expect("a valid body");
            black_box(session_key(&http::HeaderMap::new(), &view, None))
        })
    });
    let small = br#"{"model":"model-0","messages":[{"role":"user","content":"hello"}],"max_tokens":2}"#;
    group.bench_function("parse_view + session_key, a one-line chat request", |b| {
        b.iter(|| {
            let view = parse_view(black_box(small)).expect("a valid body");
            black_box(session_key(&http::HeaderMap::new(), &view, None))
        })
    });
    let text = vec![b'a'; 10_000];
    group.bench_function("text_hash, 10 KB", |b| b.iter(|| black_box(text_hash(&[black_box(&text)]))));
    group.bench_function("stable_hash (FNV-1a), 10 KB", |b| b.iter(|| black_box(stable_hash(black_box(&text)))));
    group.finish();
}

fn long_conversation() -> Vec<u8> {
    let mut messages =
        vec![serde_json::json!({"role": "system", "content": "You are a careful assistant. ".repeat(345)})];
    for turn in 0..20 {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        messages
            .push(serde_json::json!({"role": role, "content": format!("turn {turn}: {}", "some words ".repeat(40))}));
    }
    serde_json::to_vec(&serde_json::json!({"model": "model-0", "stream": true, "messages": messages}))
        .expect("serialisable")
}

/// p50/p99/max of single decisions, timed one by one.
fn percentiles(cases: &[Case]) {
    println!("\nper-decision latency (100,000 decisions each; includes ~20 ns of timer overhead)");
    println!("{:<34} {:>10} {:>10} {:>10}", "case", "p50", "p99", "max");
    for case in cases {
        for (kind, keys) in [("resident", &case.resident), ("new session", &case.fresh)] {
            let mut samples = Vec::with_capacity(100_000);
            for i in 0..100_000 {
                let key = &keys[i % keys.len()];
                let started = Instant::now();
                black_box(select(&case.snapshot, case.snapshot.local(), &request("model-0", Some(key), i as u64)).ok());
                samples.push(started.elapsed());
            }
            samples.sort_unstable();
            let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
            println!(
                "{:<34} {:>10.2?} {:>10.2?} {:>10.2?}",
                format!("{kind}, {}, {}", case.name, case.nodes),
                at(0.50),
                at(0.99),
                samples[samples.len() - 1]
            );
        }
    }
}

fn main() {
    let cases = cases();
    let mut criterion = Criterion::default().configure_from_args();
    bench(&mut criterion, &cases);
    criterion.final_summary();
    if !std::env::args().any(|a| a == "--list" || a == "--test") {
        percentiles(&cases);
    }
}
