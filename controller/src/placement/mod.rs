//! Placement: keeps each model warm on the nodes fleet policy declares
//! (`replicas`), loading and unloading models through the nodes' agents.
//! This module is its pure core: the fleet as placement reads it
//! ([`Fleet`]), what it has asked for and how that went ([`Placing`]), and
//! [`plan`], what to ask for next. The elected controller runs it
//! ([`leader`]); every other controller only relays its orders.
//!
//! It never takes a node past its admission threshold (loads under way
//! count as used, and a load that needs room waits until the unloads that
//! make it are done), never unloads a model with requests in flight on its
//! backend or sessions used within `idle_ms`, never unloads a model below
//! its own minimum, never touches a draining node (its orders are
//! withdrawn), asks one thing of a node at a time, and backs off per node
//! and model after a failed order.

pub mod leader;

use std::collections::{BTreeMap, BTreeSet};

use inferyes_proto::v1::{BackendKind, ModelState, PlacementAction, PlacementOrder, RoutingPolicy};

use crate::live::LiveView;
use crate::snapshot::Snapshot;

pub use inferyes_proto::replicas;

/// Every model policy declares replicas for, sorted.
fn declared(policy: &RoutingPolicy) -> BTreeSet<&str> {
    policy
        .replicas
        .keys()
        .map(String::as_str)
        .chain(policy.latency_critical_models.iter().map(String::as_str))
        .collect()
}

/// How long placement waits, and for what.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// An order not done by then has failed.
    pub order_timeout_ms: u64,
    /// A model whose sessions were used this lately is not unloaded.
    pub idle_ms: u64,
}

/// An unload takes seconds: one not done by then has failed, whatever the
/// (load-sized) order timeout, so that a node is not held up for long.
const UNLOAD_TIMEOUT_MS: u64 = 60_000;
/// How long room made for a model on a node is kept for it: the memory the
/// unloads freed may take a reading or two to show.
const ROOM_KEPT_MS: u64 = 10_000;
/// The first wait after a failed order, doubled per failure up to the most.
const BACKOFF_MS: u64 = 30_000;
const MAX_BACKOFF_MS: u64 = 15 * 60_000;
/// A model of unknown size is taken to need this share of its node's GPU
/// memory.
const UNKNOWN_SIZE_SHARE: u64 = 10;

/// The fleet as placement reads it.
#[derive(Clone, Debug, Default)]
pub struct Fleet {
    pub nodes: Vec<Node>,
}

#[derive(Clone, Debug, Default)]
pub struct Node {
    pub id: String,
    pub draining: bool,
    /// GPU memory in all, and in use, as last read.
    pub memory_total: u64,
    pub memory_used: u64,
    /// The GPUs were read lately: no load is started where they were not.
    pub memory_known: bool,
    /// The admission threshold, a fraction of the memory.
    pub threshold: f64,
    pub backends: Vec<Backend>,
}

#[derive(Clone, Debug, Default)]
pub struct Backend {
    pub id: String,
    /// It loads and unloads models on request (llama-swap, llama-server's
    /// router mode), and is up.
    pub places: bool,
    pub in_flight: u32,
    /// Models it holds at most (0: no limit of its own).
    pub models_max: u32,
    pub models: Vec<Model>,
}

#[derive(Clone, Debug, Default)]
pub struct Model {
    pub id: String,
    pub state: ModelState,
    /// Bytes of weights; 0: not known.
    pub size: u64,
    /// The latest use of its sessions on the node (ms), 0: none known.
    pub last_used_ms: u64,
}

impl Fleet {
    /// The fleet of `snapshot`, with the load and session uses of `live`.
    pub fn read(snapshot: &Snapshot, live: &LiveView) -> Fleet {
        let fleet_threshold = snapshot.policy().admission_threshold;
        let nodes = snapshot
            .nodes()
            .filter_map(|node| {
                let durable = node.status.as_ref()?;
                let summary = live.nodes.get(&durable.node_id).map(AsRef::as_ref);
                let status = crate::live::merge(durable, summary);
                let last_used = |model: &str| summary.and_then(|s| s.last_used.get(model)).copied().unwrap_or(0);
                let threshold = [node.policy.as_ref().map_or(0.0, |p| p.admission_threshold), fleet_threshold]
                    .into_iter()
                    .find(|t| *t > 0.0)
                    .unwrap_or(inferyes_proto::DEFAULT_ADMISSION_THRESHOLD);
                let backends = status
                    .backends
                    .iter()
                    .map(|b| Backend {
                        id: b.id.clone(),
                        places: matches!(b.kind(), BackendKind::LlamaSwap | BackendKind::LlamaServerRouter)
                            && b.health() == inferyes_proto::v1::Health::Ready,
                        in_flight: b.in_flight,
                        models_max: b.models_max,
                        models: b
                            .models
                            .iter()
                            .map(|m| Model {
                                id: m.id.clone(),
                                state: m.state(),
                                size: m.size_bytes,
                                last_used_ms: last_used(&m.id),
                            })
                            .collect(),
                    })
                    .collect();
                Some(Node {
                    id: status.node_id.clone(),
                    draining: node.draining,
                    memory_total: status.gpus.iter().map(|g| g.memory_total_bytes).sum(),
                    memory_used: status.gpus.iter().map(|g| g.memory_used_bytes).sum(),
                    memory_known: !status.gpus.is_empty() && status.gpus.iter().all(|g| !g.stale),
                    threshold,
                    backends,
                })
            })
            .collect();
        Fleet { nodes }
    }

    fn node(&self, id: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.id == id)
    }
}

impl Node {
    fn state(&self, model: &str) -> Option<ModelState> {
        self.models().filter(|(_, m)| m.id == model).map(|(_, m)| m.state).max_by_key(|s| rank(*s))
    }

    /// Whether the node has `model` loaded, and takes its requests.
    fn warm(&self, model: &str) -> bool {
        !self.draining && self.state(model) == Some(ModelState::Loaded)
    }

    fn models(&self) -> impl Iterator<Item = (&Backend, &Model)> {
        self.backends.iter().flat_map(|b| b.models.iter().map(move |m| (b, m)))
    }
}

/// The most telling of a model's states on a node's backends.
fn rank(state: ModelState) -> u8 {
    match state {
        ModelState::Loaded => 3,
        ModelState::Loading => 2,
        ModelState::Unloaded => 1,
        ModelState::Unknown => 0,
    }
}

/// One thing to ask of a node.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Action {
    pub action: Kind,
    pub node: String,
    pub backend: String,
    pub model: String,
    /// An unload that makes room for a load of this model, which follows
    /// once it is done.
    pub room_for: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// An unload first: a load it makes room for comes after it.
    Unload,
    Load,
}

/// An order issued and not yet settled.
#[derive(Clone, Debug, PartialEq)]
struct Outstanding {
    order: PlacementOrder,
    /// The model was seen loading: a load that falls back to unloaded
    /// failed, before its timeout.
    seen_loading: bool,
    room_for: Option<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Backoff {
    failures: u32,
    until_ms: u64,
}

/// How an order ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Done,
    Failed,
    /// Its node left the fleet.
    Gone,
    /// No longer to be done: its node is draining, or an unload's model is
    /// in use again.
    Withdrawn,
}

/// What placement has asked for, and how that went: one leader's memory,
/// started afresh by each leadership.
#[derive(Clone, Debug, Default)]
pub struct Placing {
    outstanding: Vec<Outstanding>,
    backoff: BTreeMap<(String, String), Backoff>,
    /// (node, model) → until when room made for the model there is kept
    /// for it: it is loaded there with no more unloads, or not at all.
    room_made: BTreeMap<(String, String), u64>,
    issued: u64,
}

impl Placing {
    /// The orders not yet settled, as agents get them.
    pub fn orders(&self) -> Vec<PlacementOrder> {
        self.outstanding.iter().map(|o| o.order.clone()).collect()
    }

    /// Whether no order is outstanding.
    pub fn is_idle(&self) -> bool {
        self.outstanding.is_empty()
    }

    /// Withdraws every outstanding order (placement turned off). Ids go on
    /// from where they were: an agent carries an id out once only.
    pub fn withdraw_all(&mut self) {
        self.outstanding.clear();
        self.backoff.clear();
        self.room_made.clear();
    }

    /// Settles the orders the fleet shows done, failed (timed out, or a load
    /// that fell back to unloaded) or moot (their node left or drains, an
    /// unload's model is in use again).
    pub fn settle(&mut self, fleet: &Fleet, settings: Settings, now_ms: u64) -> Vec<(PlacementOrder, Outcome)> {
        let mut settled = Vec::new();
        let mut kept = Vec::new();
        self.room_made.retain(|_, until| now_ms < *until);
        for mut outstanding in std::mem::take(&mut self.outstanding) {
            let order = &outstanding.order;
            let outcome = match fleet.node(&order.node_id) {
                None => Some(Outcome::Gone),
                Some(node) if node.draining => Some(Outcome::Withdrawn),
                Some(node) => {
                    let backend = node.backends.iter().find(|b| b.id == order.backend_id);
                    let listed = backend.and_then(|b| b.models.iter().find(|m| m.id == order.model));
                    let state = listed.map(|m| m.state);
                    let in_use = backend.is_some_and(|b| b.in_flight > 0)
                        || listed.is_some_and(|m| now_ms.saturating_sub(m.last_used_ms) < settings.idle_ms);
                    let timeout = match order.action() {
                        PlacementAction::Unload => settings.order_timeout_ms.min(UNLOAD_TIMEOUT_MS),
                        _ => settings.order_timeout_ms,
                    };
                    let timed_out = now_ms.saturating_sub(order.issued_unix_ms) >= timeout;
                    match order.action() {
                        PlacementAction::Load => match state {
                            Some(ModelState::Loaded) => Some(Outcome::Done),
                            Some(ModelState::Loading) => {
                                outstanding.seen_loading = true;
                                timed_out.then_some(Outcome::Failed)
                            }
                            Some(ModelState::Unloaded) if outstanding.seen_loading => Some(Outcome::Failed),
                            _ => timed_out.then_some(Outcome::Failed),
                        },
                        PlacementAction::Unload => match state {
                            Some(ModelState::Loaded | ModelState::Loading) if in_use => Some(Outcome::Withdrawn),
                            Some(ModelState::Loaded | ModelState::Loading) => timed_out.then_some(Outcome::Failed),
                            _ => Some(Outcome::Done),
                        },
                        PlacementAction::Unspecified => Some(Outcome::Gone),
                    }
                }
            };
            match outcome {
                None => kept.push(outstanding),
                Some(outcome) => {
                    let key = (outstanding.order.node_id.clone(), outstanding.order.model.clone());
                    match outcome {
                        Outcome::Failed => {
                            let backoff = self.backoff.entry(key).or_default();
                            backoff.failures = backoff.failures.saturating_add(1);
                            let wait = BACKOFF_MS.saturating_mul(1 << (backoff.failures - 1).min(10));
                            backoff.until_ms = now_ms.saturating_add(wait.min(MAX_BACKOFF_MS));
                        }
                        Outcome::Done if outstanding.order.action() == PlacementAction::Load => {
                            self.backoff.remove(&key);
                            self.room_made.remove(&key);
                        }
                        Outcome::Done => {
                            if let Some(model) = &outstanding.room_for {
                                let room = (outstanding.order.node_id.clone(), model.clone());
                                self.room_made.insert(room, now_ms.saturating_add(ROOM_KEPT_MS));
                            }
                        }
                        _ => {}
                    }
                    settled.push((outstanding.order, outcome));
                }
            }
        }
        self.outstanding = kept;
        settled
    }

    /// Issues `actions` as orders of `leader`'s, numbered from `epoch` (its
    /// leadership's start, so that no two leaderships' ids meet).
    pub fn issue(&mut self, actions: Vec<Action>, leader: &str, epoch: u64, now_ms: u64) -> Vec<PlacementOrder> {
        let mut orders = Vec::with_capacity(actions.len());
        for action in actions {
            self.issued += 1;
            let order = PlacementOrder {
                id: format!("{leader}.{epoch}.{}", self.issued),
                node_id: action.node,
                backend_id: action.backend,
                model: action.model,
                action: match action.action {
                    Kind::Load => PlacementAction::Load,
                    Kind::Unload => PlacementAction::Unload,
                } as i32,
                issued_unix_ms: now_ms,
            };
            self.outstanding.push(Outstanding { order: order.clone(), seen_loading: false, room_for: action.room_for });
            orders.push(order);
        }
        orders
    }

    /// Whether anything is asked of `node` and not yet settled.
    fn busy(&self, node: &str) -> bool {
        self.outstanding.iter().any(|o| o.order.node_id == node)
    }

    fn backed_off(&self, node: &str, model: &str, now_ms: u64) -> bool {
        self.backoff.get(&(node.to_string(), model.to_string())).is_some_and(|b| now_ms < b.until_ms)
    }
}

/// What one round of planning has claimed so far.
#[derive(Default)]
struct Round {
    /// Bytes each node's loads will take, outstanding and planned.
    reserved: BTreeMap<String, u64>,
    /// (node, model) loading, or to be unloaded, by an order.
    loading: BTreeSet<(String, String)>,
    unloading: BTreeSet<(String, String)>,
    /// Nodes asked for something this round: one thing at a time each.
    touched: BTreeSet<String>,
    /// (node, model) for which unloads are making room.
    making_room: BTreeSet<(String, String)>,
}

impl Round {
    /// What the outstanding orders hold: loads their memory, unloads the
    /// room they make; and loads under way that placement did not ask
    /// for (a client's cold load, a former leader's order) their memory
    /// too.
    fn of(fleet: &Fleet, placing: &Placing) -> Round {
        let mut round = Round::default();
        for outstanding in &placing.outstanding {
            let order = &outstanding.order;
            let key = (order.node_id.clone(), order.model.clone());
            match order.action() {
                PlacementAction::Load => {
                    let size = fleet.node(&order.node_id).map_or(0, |n| footprint(n, &order.model));
                    *round.reserved.entry(order.node_id.clone()).or_default() += size;
                    round.loading.insert(key);
                }
                _ => {
                    round.unloading.insert(key);
                    if let Some(model) = &outstanding.room_for {
                        round.making_room.insert((order.node_id.clone(), model.clone()));
                    }
                }
            }
        }
        for node in &fleet.nodes {
            for (_, m) in node.models().filter(|(_, m)| m.state == ModelState::Loading) {
                if !round.loading.contains(&(node.id.clone(), m.id.clone())) {
                    *round.reserved.entry(node.id.clone()).or_default() += footprint(node, &m.id);
                }
            }
        }
        round
    }
}

/// The orders to issue next, given what is outstanding: for each model
/// declared, loads until it is warm (or loading) on its minimum of nodes,
/// on the best nodes that can take it, with what must be unloaded to make
/// room first; and an unload where it is warm on more than its maximum.
/// Empty when placement is off.
pub fn plan(fleet: &Fleet, policy: &RoutingPolicy, placing: &Placing, settings: Settings, now_ms: u64) -> Vec<Action> {
    if policy.placement_off {
        return Vec::new();
    }
    let mut round = Round::of(fleet, placing);
    let planning = Planning { fleet, policy, placing, settings, now_ms };
    let mut actions = Vec::new();
    for model in declared(policy) {
        let want = replicas(policy, model);
        let warm = fleet
            .nodes
            .iter()
            .filter(|n| n.warm(model) && !round.unloading.contains(&(n.id.clone(), model.to_string())))
            .count();
        let coming = fleet
            .nodes
            .iter()
            .filter(|n| !n.draining && !n.warm(model))
            .filter(|n| {
                let key = (n.id.clone(), model.to_string());
                n.state(model) == Some(ModelState::Loading)
                    || round.loading.contains(&key)
                    || round.making_room.contains(&key)
            })
            .count();
        let short = (want.min as usize).saturating_sub(warm + coming);
        for _ in 0..short {
            // Room made for the model is its first: it loads there, or, while
            // the freed memory does not show yet, nowhere else.
            let room = placing.room_made.keys().find(|(n, m)| m == model && !round.touched.contains(n));
            let chosen = match room {
                Some((node, _)) => match fleet.node(node).and_then(|n| planning.candidate(n, &round, model)) {
                    Some(chosen) => chosen,
                    None => {
                        round.touched.insert(node.clone());
                        continue;
                    }
                },
                None => match planning.best_node(&round, model) {
                    Some(chosen) => chosen,
                    None => break,
                },
            };
            round.touched.insert(chosen.node.clone());
            if !chosen.evictions.is_empty() {
                // The unloads first, alone: the load is planned once they
                // are done and the memory they free is seen free.
                for (backend, evicted) in &chosen.evictions {
                    round.unloading.insert((chosen.node.clone(), evicted.clone()));
                    actions.push(Action {
                        action: Kind::Unload,
                        node: chosen.node.clone(),
                        backend: backend.clone(),
                        model: evicted.clone(),
                        room_for: Some(model.to_string()),
                    });
                }
                round.making_room.insert((chosen.node.clone(), model.to_string()));
                continue;
            }
            *round.reserved.entry(chosen.node.clone()).or_default() += chosen.size;
            round.loading.insert((chosen.node.clone(), model.to_string()));
            actions.push(Action {
                action: Kind::Load,
                node: chosen.node,
                backend: chosen.backend,
                model: model.to_string(),
                room_for: None,
            });
        }
        // Never below the minimum, whatever the maximum says.
        if want.max > 0 && warm > want.max.max(want.min) as usize && coming == 0 {
            // One at a time: the next round sees it gone.
            actions.extend(planning.unload_idlest(&mut round, model));
        }
    }
    actions
}

/// The bytes `model` is taken to need on `node`: its size where a backend
/// says it, else a tenth of the node's memory.
fn footprint(node: &Node, model: &str) -> u64 {
    match node.models().filter(|(_, m)| m.id == model).map(|(_, m)| m.size).max().unwrap_or(0) {
        0 => node.memory_total / UNKNOWN_SIZE_SHARE,
        size => size,
    }
}

/// A node chosen to load a model on.
struct Chosen {
    node: String,
    backend: String,
    size: u64,
    /// What is unloaded first to make room: (backend, model).
    evictions: Vec<(String, String)>,
    /// Bytes free under the threshold once it is loaded.
    free_after: u64,
}

/// What a round of planning reads: the same for every model it plans.
struct Planning<'a> {
    fleet: &'a Fleet,
    policy: &'a RoutingPolicy,
    placing: &'a Placing,
    settings: Settings,
    now_ms: u64,
}

impl Planning<'_> {
    /// An unload of `model` from the node where it has been idle longest
    /// (idle: nothing in flight, unused for the idle time, no order under
    /// way or backed off there), if any.
    fn unload_idlest(&self, round: &mut Round, model: &str) -> Option<Action> {
        let (placing, settings, now_ms) = (self.placing, self.settings, self.now_ms);
        let (_, node, backend) = self
            .fleet
            .nodes
            .iter()
            .filter(|n| n.warm(model) && !round.unloading.contains(&(n.id.clone(), model.to_string())))
            .filter_map(|n| {
                let (backend, m) = n.models().find(|(_, m)| m.id == model && m.state == ModelState::Loaded)?;
                let idle = backend.places
                    && backend.in_flight == 0
                    && now_ms.saturating_sub(m.last_used_ms) >= settings.idle_ms
                    && !placing.busy(&n.id)
                    && !round.touched.contains(&n.id)
                    && !placing.backed_off(&n.id, model, now_ms);
                idle.then(|| (m.last_used_ms, n.id.clone(), backend.id.clone()))
            })
            .min()?;
        round.unloading.insert((node.clone(), model.to_string()));
        round.touched.insert(node.clone());
        Some(Action { action: Kind::Unload, node, backend, model: model.to_string(), room_for: None })
    }

    /// The best node to load `model` on: one that needs the fewest unloads
    /// to take it under its threshold, then the one with the most memory
    /// free after, then the first by id.
    fn best_node(&self, round: &Round, model: &str) -> Option<Chosen> {
        self.fleet
            .nodes
            .iter()
            .filter_map(|node| self.candidate(node, round, model))
            .min_by_key(|c| (c.evictions.len(), std::cmp::Reverse(c.free_after), c.node.clone()))
    }

    /// How `node` could take `model`, if it can.
    fn candidate(&self, node: &Node, round: &Round, model: &str) -> Option<Chosen> {
        let Planning { fleet, policy, placing, settings, now_ms } = *self;
        let key = (node.id.clone(), model.to_string());
        if node.draining
            || !node.memory_known
            || node.memory_total == 0
            || round.loading.contains(&key)
            || round.touched.contains(&node.id)
            || placing.busy(&node.id)
            || placing.backed_off(&node.id, model, now_ms)
            || node.state(model) != Some(ModelState::Unloaded)
        {
            return None;
        }
        let (backend, listed) =
            node.models().find(|(b, m)| b.places && m.id == model && m.state == ModelState::Unloaded)?;
        let budget = (node.memory_total as f64 * node.threshold.clamp(0.0, 1.0)) as u64;
        let used = node.memory_used.saturating_add(round.reserved.get(&node.id).copied().unwrap_or(0));
        let need = footprint(node, &listed.id);
        // What may go to make room: loaded on a backend that unloads, idle, not
        // this model, and warm enough elsewhere to stay at its own minimum.
        let mut evictable: Vec<(&Backend, &Model)> = node
            .models()
            .filter(|(b, m)| {
                b.places
                    && m.state == ModelState::Loaded
                    && m.id != model
                    && b.in_flight == 0
                    && now_ms.saturating_sub(m.last_used_ms) >= settings.idle_ms
                    && !round.unloading.contains(&(node.id.clone(), m.id.clone()))
                    && !placing.backed_off(&node.id, &m.id, now_ms)
                    && warm_elsewhere(fleet, round, &m.id, &node.id) >= replicas(policy, &m.id).min as usize
            })
            .collect();
        // The idlest first, then the largest.
        evictable.sort_by(|a, b| {
            (a.1.last_used_ms, std::cmp::Reverse(a.1.size)).cmp(&(b.1.last_used_ms, std::cmp::Reverse(b.1.size)))
        });
        let mut evictions: Vec<(String, String)> = Vec::new();
        // Room already made here for the model: it fits in it, or waits.
        let room_made = placing.room_made.contains_key(&key);
        let mut freed = 0u64;
        // A backend with a limit of its own unloads a model to load one more:
        // placement picks which. Its state is all there is to count: a node
        // with orders outstanding, or asked this round, is no candidate.
        if backend.models_max > 0 {
            let held =
                backend.models.iter().filter(|m| matches!(m.state, ModelState::Loaded | ModelState::Loading)).count()
                    as i64;
            let over = held + 1 - i64::from(backend.models_max);
            for (b, m) in
                evictable.iter().filter(|(b, _)| b.id == backend.id).take(usize::try_from(over.max(0)).unwrap_or(0))
            {
                evictions.push((b.id.clone(), m.id.clone()));
                freed += m.size;
            }
            if (evictions.len() as i64) < over {
                return None;
            }
        }
        for (b, m) in &evictable {
            if used.saturating_add(need) <= budget.saturating_add(freed) {
                break;
            }
            if evictions.iter().any(|(eb, em)| eb == &b.id && em == &m.id) || m.size == 0 {
                continue;
            }
            evictions.push((b.id.clone(), m.id.clone()));
            freed += m.size;
        }
        if room_made && !evictions.is_empty() {
            return None;
        }
        let after = budget.saturating_add(freed).checked_sub(used.saturating_add(need))?;
        Some(Chosen { node: node.id.clone(), backend: backend.id.clone(), size: need, evictions, free_after: after })
    }
}

/// The nodes other than `except` where `model` is warm and stays so.
fn warm_elsewhere(fleet: &Fleet, round: &Round, model: &str, except: &str) -> usize {
    fleet
        .nodes
        .iter()
        .filter(|n| n.id != except && n.warm(model) && !round.unloading.contains(&(n.id.clone(), model.to_string())))
        .count()
}

#[cfg(test)]
mod tests;
