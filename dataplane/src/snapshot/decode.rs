use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use inferyes_proto::FastMap;
use inferyes_proto::v1::{Alias, BackendKind, BackendLoad, Health, ModelState, RoutingPolicy, SnapshotNode, Strategy};

use super::{
    BackendView, CatalogEntry, DEFAULT_PREFILL_TOKENS_PER_SECOND, DEFAULT_SERVICE_SECONDS, Indices, Live, Node,
    Placement, Policy, Ring, RoutingSnapshot, Target,
};
use crate::targets::{AgentCredentials, NodeStates};

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

/// Builds the routing indices from statuses that carry their own load and
/// sessions (tests, benchmarks): [`decode_live`] with the live state read
/// from them.
pub fn decode(
    version: u64,
    nodes: &BTreeMap<String, SnapshotNode>,
    policy: Option<&RoutingPolicy>,
    aliases: &[Alias],
    states: &NodeStates,
) -> RoutingSnapshot {
    decode_live(version, nodes, &Live::from_statuses(nodes), policy, aliases, (states, &AgentCredentials::default()))
}

/// Builds the routing indices from the nodes' records and their live state
/// (load, resident sessions per backend). Nodes come sorted by id (a
/// `BTreeMap`), so equal inputs give equal snapshots. A node without live
/// state, or whose relay lost it, has its load taken for unknown.
pub fn decode_live(
    version: u64,
    nodes: &BTreeMap<String, SnapshotNode>,
    live: &Live,
    policy: Option<&RoutingPolicy>,
    aliases: &[Alias],
    (states, credentials): (&NodeStates, &AgentCredentials),
) -> RoutingSnapshot {
    let policy = resolve_policy(policy);
    let mut indices = Indices::default();
    for wire in nodes.values() {
        // One whose proxy takes no request until its controller issued it a
        // credential is not a node to send one to yet.
        let Some(status) = wire.status.as_ref().filter(|s| !s.awaiting_credential) else { continue };
        let id: Arc<str> = Arc::from(status.node_id.as_str());
        let node_live = live.node(&status.node_id);
        let ready = !wire.draining && status.backends.iter().all(|b| b.health() == Health::Ready);
        let proxy_url = inferyes_net::base_url::BaseUrl::new(&status.proxy_url);
        let endpoint = states
            .endpoint(&id, proxy_url, status.proxy_http2, ready, version)
            .with_credential(crate::targets::AgentTakes::of(wire), credentials);
        let own = wire.policy.as_ref();
        let or = |value: Option<f64>, default: f64| value.filter(|v| *v > 0.0).unwrap_or(default);
        let node = NodeFacts {
            index: indices.nodes.len(),
            key: inferyes_proto::hash::stable_hash(id.as_bytes()),
            memory: Memory::of(status, node_live),
            admission_threshold: or(own.map(|p| p.admission_threshold), policy.admission_threshold),
            hard_limit: or(own.map(|p| p.hard_limit), policy.hard_limit),
            draining: wire.draining,
            own_in_flight: endpoint.in_flight(),
            gpu_hour_price: gpu_hour_price(status.gpu_hour_price),
        };
        let mut backends = Vec::with_capacity(status.backends.len());
        let mut backend_of_load = Vec::new();
        for (backend_index, backend) in status.backends.iter().enumerate() {
            let (load_position, load) = reported_load(node_live, backend_index, &backend.id);
            let view = backend_view(backend, &load, node.gpu_hour_price);
            let resident_sessions =
                node_live.zip(load_position).map_or(0, |(l, position)| l.resident_sessions(position));
            if let (Some(l), Some(position)) = (node_live, load_position) {
                backend_of_load.resize(l.load.backends.len(), u32::MAX);
                backend_of_load[position] = u32::try_from(backend_index).unwrap_or(u32::MAX);
            }
            let target = Target { node: node.index, backend: backend_index };
            add_placements(&mut indices.models, (&node, target), backend, (&view, &load, resident_sessions));
            backends.push(view);
        }
        indices.node_index.insert(node.key, node.index);
        indices.nodes.push(Node {
            endpoint: Arc::new(endpoint),
            key: node.key,
            id,
            draining: wire.draining,
            backends,
            backend_of_load,
            vram_fraction: node.memory.fraction,
            vram_total_bytes: node.memory.total_bytes,
            vram_used_bytes: node.memory.used_bytes,
            vram_loading_bytes: node.memory.loading_bytes,
            admission_threshold: node.admission_threshold,
            hard_limit: node.hard_limit,
        });
    }
    indices.models.values_mut().for_each(|placements| fill_rates(placements));
    indices.rings = rings(&indices.models);
    (indices.catalog, indices.aliases) = catalog(&indices.models, aliases);
    indices.policy = policy;
    indices.local = states.view(indices.nodes.iter().map(|node| &*node.endpoint));
    RoutingSnapshot { version, indices: Arc::new(indices), sessions: Arc::clone(live.index()), ..Default::default() }
}

/// What every placement of a node shares.
struct NodeFacts {
    index: usize,
    key: u64,
    memory: Memory,
    admission_threshold: f64,
    hard_limit: f64,
    draining: bool,
    /// This data plane's requests in flight there as the snapshot is made.
    own_in_flight: u32,
    gpu_hour_price: f64,
}

/// A node's GPU memory.
struct Memory {
    /// The fullest GPU's used memory as a fraction of its total.
    fraction: f64,
    total_bytes: u64,
    used_bytes: u64,
    /// What the loads under way will take.
    loading_bytes: u64,
    /// A GPU's reading is the last one read.
    stale: bool,
}

impl Memory {
    /// The GPUs' exact readings where the node's load has them; etcd's
    /// record rounds them up to steps.
    fn of(status: &inferyes_proto::v1::NodeStatus, node_live: Option<&super::live::NodeLive>) -> Memory {
        let gpus: Vec<(u64, u64)> = status
            .gpus
            .iter()
            .enumerate()
            .map(|(position, g)| {
                // In the record's order, else by index.
                let reported = node_live.and_then(|l| {
                    let by_position = l.load.gpus.get(position).filter(|r| r.index == g.index);
                    by_position.or_else(|| l.load.gpus.iter().find(|r| r.index == g.index))
                });
                (g.memory_total_bytes, reported.map_or(g.memory_used_bytes, |r| r.memory_used_bytes))
            })
            .collect();
        Memory {
            fraction: gpus
                .iter()
                .filter(|(total, _)| *total > 0)
                .map(|(total, used)| *used as f64 / *total as f64)
                .fold(0.0, f64::max),
            total_bytes: gpus.iter().map(|(total, _)| total).sum(),
            used_bytes: gpus.iter().map(|(_, used)| used).sum(),
            loading_bytes: status
                .backends
                .iter()
                .flat_map(|b| &b.models)
                .filter(|m| m.state() == ModelState::Loading)
                .map(|m| m.size_bytes)
                .fold(0, u64::saturating_add),
            stale: status.gpus.iter().any(|g| g.stale),
        }
    }
}

/// The load the node's live state reports for backend `id`, the record's
/// `index`th, and its place in that state: in the same order as the
/// record's backends, else found by id. Unknown where there is none, or
/// the relay lost it.
fn reported_load<'a>(
    node_live: Option<&'a super::live::NodeLive>,
    index: usize,
    id: &str,
) -> (Option<usize>, Cow<'a, BackendLoad>) {
    let position = node_live.and_then(|l| {
        let by_index = l.load.backends.get(index).filter(|b| b.backend_id == id);
        by_index.map(|_| index).or_else(|| l.load.backends.iter().position(|b| b.backend_id == id))
    });
    let load = match node_live.zip(position) {
        Some((l, position)) if !l.stale => Cow::Borrowed(&l.load.backends[position]),
        Some((l, position)) => Cow::Owned(BackendLoad { load_unknown: true, ..l.load.backends[position].clone() }),
        None => Cow::Owned(BackendLoad { load_unknown: true, ..BackendLoad::default() }),
    };
    (position, load)
}

/// A backend as routing reads it, its reported rates held within what
/// hardware can do: an agent claiming a billion tokens a second would
/// draw every session to itself.
fn backend_view(backend: &inferyes_proto::v1::Backend, load: &BackendLoad, gpu_hour_price: f64) -> BackendView {
    let prefill = load.prefill_tokens_per_second;
    let prefill_tokens_per_second =
        if prefill.is_finite() && prefill > 0.0 { prefill.clamp(1.0, MAX_PREFILL_TOKENS_PER_SECOND) } else { 0.0 };
    let decode = load.tokens_per_second;
    let decode_tokens_per_second =
        if decode.is_finite() && decode > 0.0 { decode.clamp(1.0, MAX_DECODE_TOKENS_PER_SECOND) } else { 0.0 };
    BackendView {
        id: Arc::from(backend.id.as_str()),
        id_header: http::HeaderValue::from_str(&backend.id).ok(),
        health: backend.health(),
        reports_progress: matches!(
            backend.kind(),
            BackendKind::LlamaServer | BackendKind::LlamaServerRouter | BackendKind::LlamaSwap
        ),
        weight: backend.weight.max(1),
        slots_total: backend.slots_total,
        slots_busy: load.slots_busy,
        requests_deferred: load.requests_deferred,
        in_flight: load.in_flight,
        load_unknown: load.load_unknown,
        rates: crate::snapshot::Rates { prefill_tokens_per_second, decode_tokens_per_second, gpu_hour_price },
    }
}

/// One placement per model `backend` lists, at `target` of `node`, with
/// its `view`, `load` and resident session count.
fn add_placements(
    models: &mut FastMap<String, Vec<Placement>>,
    (node, target): (&NodeFacts, Target),
    backend: &inferyes_proto::v1::Backend,
    (view, load, resident_sessions): (&BackendView, &BackendLoad, u32),
) {
    // A slot freed in no time would draw every session to itself too.
    let service_seconds = match load.service_ms {
        0 => 0.0,
        ms => (f64::from(ms) / 1e3).clamp(MIN_SERVICE_SECONDS, MAX_SERVICE_SECONDS),
    };
    let slot_group = slot_group(&backend.slot_fingerprint).unwrap_or(0);
    let held = backend.models.iter().filter(|m| matches!(m.state(), ModelState::Loaded | ModelState::Loading));
    let full = backend.models_max > 0 && held.count() >= backend.models_max as usize;
    for model in &backend.models {
        models.entry(model.id.clone()).or_default().push(Placement {
            evicts: full && !matches!(model.state(), ModelState::Loaded | ModelState::Loading),
            target,
            state: model.state(),
            context_window: model.context_window,
            endpoints: model.endpoints().collect(),
            unsupported: model.unsupported().collect(),
            size_bytes: model.size_bytes,
            usable: view.health == Health::Ready && !node.draining,
            reported_in_flight: view.in_flight,
            slots: view.slots_total,
            occupancy: view.occupancy(),
            own_in_flight_when_read: node.own_in_flight,
            deferred: view.requests_deferred,
            load_unknown: view.load_unknown,
            prefill_tokens_per_second: view.rates.prefill_tokens_per_second,
            service_seconds,
            fastest_prefill_tokens_per_second: 0.0,
            resident_sessions,
            weight: view.weight,
            node_key: node.key,
            vram_fraction: node.memory.fraction,
            admission_threshold: node.admission_threshold,
            hard_limit: node.hard_limit,
            vram_total_bytes: node.memory.total_bytes,
            vram_committed_bytes: node.memory.used_bytes.saturating_add(node.memory.loading_bytes),
            vram_stale: node.memory.stale,
            slot_group,
        });
    }
}

/// A hash ring for each model on enough placements to need one.
fn rings(models: &FastMap<String, Vec<Placement>>) -> FastMap<String, Ring> {
    let mut rings = inferyes_proto::FastMap::default();
    for (model, placements) in models {
        if placements.len() < super::RING_MIN_PLACEMENTS {
            continue;
        }
        let mut ring = Ring::default();
        for (index, p) in placements.iter().enumerate() {
            for v in 0..super::RING_POINTS {
                let point = inferyes_proto::hash::rendezvous_score(p.node_key ^ p.target.backend as u64, v);
                ring.points.push((point, u32::try_from(index).unwrap_or(u32::MAX)));
            }
            if p.usable {
                ring.ready_placements += 1;
                ring.resident_sessions += u64::from(p.resident_sessions);
            }
        }
        ring.points.sort_unstable();
        rings.insert(model.clone(), ring);
    }
    rings
}

/// The fleet's catalog, models and aliases, sorted by id; and the aliases
/// routing resolves (alias → model).
fn catalog(
    models: &FastMap<String, Vec<Placement>>,
    aliases: &[Alias],
) -> (Vec<CatalogEntry>, FastMap<String, String>) {
    let mut catalog: Vec<CatalogEntry> = models
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
    let mut resolved = inferyes_proto::FastMap::default();
    for alias in aliases {
        // An alias of a model the fleet does not serve right now is still
        // listed: a request for it gets the model's own error.
        let target = catalog.iter().find(|e| e.id == alias.model).cloned();
        if models.contains_key(&alias.alias) {
            continue;
        }
        resolved.insert(alias.alias.clone(), alias.model.clone());
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
    (catalog, resolved)
}

/// The bounds reported rates are held to.
const MAX_PREFILL_TOKENS_PER_SECOND: f64 = 1e6;
const MAX_DECODE_TOKENS_PER_SECOND: f64 = 1e5;
const MIN_SERVICE_SECONDS: f64 = 0.001;
const MAX_SERVICE_SECONDS: f64 = 3_600.0;

/// A slot fingerprint's group: its first 64 bits, where it is the hex an
/// agent makes (anything else cannot move).
fn slot_group(fingerprint: &str) -> Option<u64> {
    let head = fingerprint.get(..16).filter(|_| fingerprint.len() == 32)?;
    u64::from_str_radix(head, 16).ok().filter(|group| *group != 0)
}

/// Gives every placement of a model a prompt rate and a service time: its
/// own, else the median of those its peers reported (the same model on
/// like hardware, most likely), else the defaults; and the fastest rate.
fn fill_rates(placements: &mut [Placement]) {
    let median = |mut known: Vec<f64>, default: f64| {
        known.sort_by(f64::total_cmp);
        known.get(known.len() / 2).copied().unwrap_or(default)
    };
    let known = |rate: fn(&Placement) -> f64| placements.iter().map(rate).filter(|r| *r > 0.0).collect::<Vec<_>>();
    let prefill = median(known(|p| p.prefill_tokens_per_second), DEFAULT_PREFILL_TOKENS_PER_SECOND);
    let service = median(known(|p| p.service_seconds), DEFAULT_SERVICE_SECONDS);
    let mut fastest: f64 = 0.0;
    for p in placements.iter_mut() {
        if p.prefill_tokens_per_second <= 0.0 {
            p.prefill_tokens_per_second = prefill;
        }
        if p.service_seconds <= 0.0 {
            p.service_seconds = service;
        }
        // Among those a session could move to: a draining or cold node's
        // rate would only make every busy home scan for nothing.
        if p.usable && matches!(p.state, ModelState::Loaded | ModelState::Unknown) {
            fastest = fastest.max(p.prefill_tokens_per_second);
        }
    }
    if fastest == 0.0 {
        fastest = prefill;
    }
    placements.iter_mut().for_each(|p| p.fastest_prefill_tokens_per_second = fastest);
}

/// An agent's GPU hour price, where it is one (a figure past the bound, or
/// not a number, prices nothing).
fn gpu_hour_price(reported: f64) -> f64 {
    let bound = inferyes_proto::usage::MAX_GPU_HOUR_PRICE;
    if reported.is_finite() && (0.0..=bound).contains(&reported) { reported } else { 0.0 }
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
            instance_digest: String::new(),
        }
    }

    #[test]
    fn rates_not_reported_are_the_peers_median_and_claims_past_hardware_are_cut() {
        let with_rates = |id: &str, prefill: f64, service_ms: u32| {
            let mut wire = node(id, &[("chat", ModelState::Loaded)], &[]);
            let backend = &mut wire.status.as_mut().unwrap().backends[0];
            (backend.prefill_tokens_per_second, backend.service_ms) = (prefill, service_ms);
            (id.to_string(), wire)
        };
        let nodes: BTreeMap<String, SnapshotNode> = [
            with_rates("a", 100.0, 2_000),
            with_rates("b", 300.0, 4_000),
            with_rates("c", 200.0, 3_000),
            with_rates("unknown", 0.0, 0),
            with_rates("hostile", f64::INFINITY, 0),
        ]
        .into();
        let snapshot = decode(1, &nodes, None, &[], &NodeStates::default());
        let rates: Vec<(f64, f64)> = snapshot
            .placements("chat")
            .unwrap()
            .iter()
            .map(|p| (p.prefill_tokens_per_second, p.service_seconds))
            .collect();
        assert_eq!(rates, [(100.0, 2.0), (300.0, 4.0), (200.0, 3.0), (200.0, 3.0), (200.0, 3.0)]);
        let nodes: BTreeMap<String, SnapshotNode> = [with_rates("liar", 1e300, 1), with_rates("alone", 0.0, 0)].into();
        let snapshot = decode(1, &nodes, None, &[], &NodeStates::default());
        let chat = snapshot.placements("chat").unwrap();
        assert_eq!((chat[0].prefill_tokens_per_second, chat[0].service_seconds), (1e6, 0.001));
        assert_eq!(chat[1].fastest_prefill_tokens_per_second, 1e6);
        let nodes: BTreeMap<String, SnapshotNode> = [with_rates("new", 0.0, 0)].into();
        let snapshot = decode(1, &nodes, None, &[], &NodeStates::default());
        let p = &snapshot.placements("chat").unwrap()[0];
        assert_eq!(
            (p.prefill_tokens_per_second, p.service_seconds),
            (DEFAULT_PREFILL_TOKENS_PER_SECOND, DEFAULT_SERVICE_SECONDS)
        );
    }

    #[test]
    fn indices_cover_models_sessions_aliases_and_catalog() {
        let mut nodes = BTreeMap::new();
        nodes.insert("a".to_string(), node("a", &[("chat", ModelState::Loaded)], &["s1"]));
        nodes
            .insert("b".to_string(), node("b", &[("chat", ModelState::Unloaded), ("embed", ModelState::Loading)], &[]));
        let aliases = [Alias { alias: "gpt-4o".into(), model: "chat".into() }];
        let snapshot = decode(4, &nodes, None, &aliases, &NodeStates::default());
        assert_eq!(snapshot.version(), 4);
        assert_eq!(snapshot.placements("chat").map(<[Placement]>::len), Some(2));
        let chat = snapshot.placements("chat").unwrap();
        assert!(
            chat.windows(2).all(|w| (w[0].target.node, w[0].target.backend) < (w[1].target.node, w[1].target.backend))
        );
        assert_eq!(snapshot.resident("s1").map(|r| r.target), Some(Target { node: 0, backend: 0 }));
        assert_eq!(snapshot.nodes()[0].endpoint.proxy_url.as_str(), "http://a");
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
    fn a_node_awaiting_its_credential_is_no_node_to_send_to() {
        let mut nodes = BTreeMap::new();
        let mut awaiting = node("a", &[("chat", ModelState::Loaded)], &["s1"]);
        awaiting.status.as_mut().unwrap().awaiting_credential = true;
        nodes.insert("a".to_string(), awaiting);
        nodes.insert("b".to_string(), node("b", &[("chat", ModelState::Loaded)], &[]));
        let snapshot = decode(1, &nodes, None, &[], &NodeStates::default());
        let ids: Vec<&str> = snapshot.nodes().iter().map(|n| n.id.as_ref()).collect();
        assert_eq!(ids, ["b"]);
    }

    #[test]
    fn policies_fill_in_defaults_and_node_overrides_win() {
        let mut nodes = BTreeMap::new();
        nodes.insert("a".to_string(), node("a", &[], &[]));
        let mut b = node("b", &[], &[]);
        b.policy = Some(NodePolicy { admission_threshold: 0.8, hard_limit: 0.0 });
        nodes.insert("b".to_string(), b);
        let policy = RoutingPolicy { hard_limit: 0.95, ..Default::default() };
        let snapshot = decode(1, &nodes, Some(&policy), &[], &NodeStates::default());
        let thresholds: Vec<(f64, f64)> =
            snapshot.nodes().iter().map(|n| (n.admission_threshold, n.hard_limit)).collect();
        assert_eq!(thresholds, [(0.92, 0.95), (0.8, 0.95)]);
        assert_eq!(snapshot.policy().load_bound, 1.25);
    }
}
