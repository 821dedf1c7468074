//! This data plane's own state of each node it sends requests to: its
//! requests in flight there, the memory held for cold loads it started,
//! and passive ejection after failures. A snapshot is the same in every
//! data plane; this is what each one adds from its own traffic, which no
//! report shows yet.
//!
//! One type writes it, [`NodeState`], and only through three doors: an
//! attempt's guard ([`Endpoint::enter`]), the outcome of every attempt and
//! every stream's end ([`Endpoint::observe`]), and the readiness each
//! decoded snapshot reports ([`NodeStates::endpoint`]). Beside it, where
//! each session's latest turn went ([`crate::turns`]), written by the
//! attempt that passed. Routing reads both through [`Local`] and nothing
//! else.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use http::HeaderValue;
use inferyes_net::base_url::BaseUrl;

use crate::turns::{Sent, SentTurns};

/// What routing reads of this data plane's state of a snapshot's nodes, by
/// their index in the snapshot. The one thing routing reads that changes
/// between two requests on the same snapshot, so it is an argument of its
/// own, and a test passes fixed values.
pub trait Local {
    /// Requests this data plane has in flight to the node.
    fn in_flight(&self, node: usize) -> u32;
    /// Memory held on the node for the cold loads this data plane started.
    fn reserved_vram_bytes(&self, node: usize) -> u64;
    /// Until when (ms since the epoch) the node is held out of routing, if
    /// it is at `now_ms`.
    fn ejected_until(&self, node: usize, now_ms: u64) -> Option<u64>;
    /// Where this data plane sent the latest turn of the session whose key
    /// hashes to `session`, if it is still trusted at `now_ms`.
    fn sent_turn(&self, session: u64, now_ms: u64) -> Option<Sent>;
}

/// No requests in flight, no loads, no ejections: a data plane that has
/// sent nothing yet.
#[derive(Clone, Copy, Debug, Default)]
pub struct Idle;

impl Local for Idle {
    fn in_flight(&self, _: usize) -> u32 {
        0
    }

    fn reserved_vram_bytes(&self, _: usize) -> u64 {
        0
    }

    fn ejected_until(&self, _: usize, _: u64) -> Option<u64> {
        None
    }

    fn sent_turn(&self, _: u64, _: u64) -> Option<Sent> {
        None
    }
}

/// A snapshot's nodes as this data plane's state of them, in the
/// snapshot's node order: built with the snapshot, read by routing.
#[derive(Debug, Default)]
pub struct View {
    nodes: Box<[Arc<NodeState>]>,
    turns: Arc<SentTurns>,
}

impl View {
    fn node(&self, node: usize) -> Option<&NodeState> {
        self.nodes.get(node).map(|state| &**state)
    }
}

impl Local for View {
    fn in_flight(&self, node: usize) -> u32 {
        self.node(node).map_or(0, NodeState::in_flight)
    }

    fn reserved_vram_bytes(&self, node: usize) -> u64 {
        self.node(node).map_or(0, |state| state.reserved_vram_bytes.load(Ordering::Relaxed))
    }

    fn ejected_until(&self, node: usize, now_ms: u64) -> Option<u64> {
        self.node(node).and_then(|state| state.ejected_until(now_ms))
    }

    fn sent_turn(&self, session: u64, now_ms: u64) -> Option<Sent> {
        self.turns.latest(session, now_ms)
    }
}

/// A node as attempts reach it: its agent's proxy, and this data plane's
/// state of the node. Made with each snapshot; an attempt, and a stream
/// that outlives its snapshot, holds its own.
#[derive(Debug)]
pub struct Endpoint {
    pub id: Arc<str>,
    /// The id as a header value, made once: every answer from the node
    /// names it. `None` where the id cannot be one.
    pub id_header: Option<HeaderValue>,
    /// Base URL of the node's agent proxy, read once per snapshot.
    pub proxy_url: BaseUrl,
    /// The proxy takes HTTP/2.
    pub proxy_http2: bool,
    /// The `Authorization` the node's agent takes, where it takes one.
    pub authorization: Option<HeaderValue>,
    state: Arc<NodeState>,
}

/// An attempt's or a stream's outcome as it bears on its node's state:
/// answered well, failed (held out of routing or not), or no judgement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Observed {
    /// The node answered well: a failure streak ends, and any ejection
    /// with it.
    Answered,
    /// The node failed; `what` says how, in the log line. `eject` holds it
    /// out of routing for a while (1 s, doubling with each failure in a
    /// row, to 30 s).
    Failed { what: &'static str, eject: bool },
    /// Nothing is learnt of the node's health: a client's own error, a
    /// limit of this data plane's.
    Unjudged,
}

/// The request an outcome came from, for the log line, and the snapshot
/// version it was routed on.
#[derive(Clone, Copy, Debug)]
pub struct Witness<'a> {
    pub request_id: &'a HeaderValue,
    /// The snapshot the request was routed on: the node is taken back
    /// early only by a snapshot after it that reports it ready.
    pub version: u64,
}

impl Endpoint {
    /// This endpoint with the credential its agent takes: its own, derived
    /// from the key for what it `takes` (once per key: snapshots come
    /// often, and each would otherwise cost an HMAC per node); else the
    /// fleet-wide one.
    pub fn with_credential(self, takes: AgentTakes<'_>, credentials: &AgentCredentials) -> Endpoint {
        let (key, instance) = match takes {
            AgentTakes::FleetWide => return Endpoint { authorization: credentials.fleet.clone(), ..self },
            AgentTakes::JoinDerived => (credentials.key.as_ref(), None),
            AgentTakes::Issued { instance } => (credentials.node_key.as_ref(), Some(instance)),
        };
        let authorization = match key {
            Some(key) => {
                let mut derived = self.state.credential.lock().unwrap_or_else(PoisonError::into_inner);
                match &*derived {
                    Some((from, of, value)) if (Arc::ptr_eq(from, key) || from == key) && of.as_deref() == instance => {
                        Some(value.clone())
                    }
                    _ => {
                        let credential = match instance {
                            Some(instance) => inferyes_proto::bearer::issued_proxy_credential(key, &self.id, instance),
                            None => inferyes_proto::bearer::node_proxy_credential(key, &self.id),
                        };
                        let value = inferyes_proto::bearer::header_value(&credential);
                        *derived = value.clone().map(|value| (Arc::clone(key), instance.map(Box::from), value));
                        value
                    }
                }
            }
            None => None,
        };
        Endpoint { authorization, ..self }
    }

    /// Counts a request against the node until the guard is dropped, and,
    /// for a cold load, the model's size on `load`'s backend.
    pub fn enter(self: &Arc<Self>, load: Option<ColdLoad>) -> InFlight {
        let state = &self.state;
        state.in_flight.fetch_add(1, Ordering::Relaxed);
        if let Some(load) = &load {
            state.hold_load(load);
        }
        InFlight { state: Arc::clone(state), load }
    }

    /// Counts a request against the node if fewer than `below` of this
    /// data plane's are in flight there, in one step: two workers that
    /// both saw the node's last free slot do not both take it.
    pub fn claim(self: &Arc<Self>, below: u32) -> Option<InFlight> {
        let state = &self.state;
        state.in_flight.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| (n < below).then(|| n + 1)).ok()?;
        Some(InFlight { state: Arc::clone(state), load: None })
    }

    /// Takes an attempt's or a stream's outcome: the one place that ejects
    /// a node, ends its ejection, and logs why.
    pub fn observe(&self, observed: Observed, witness: Witness<'_>) {
        let state = &self.state;
        match observed {
            Observed::Answered => state.succeeded(),
            Observed::Unjudged => {}
            Observed::Failed { what, eject: true } => {
                let ejected_ms = state.eject(inferyes_proto::unix_ms(), witness.version);
                inferyes_net::warn_every!(
                    gate: state.log;
                    request_id = witness.request_id.to_str().unwrap_or_default(),
                    node = %self.id,
                    ejected_ms,
                    "node {what}; held out of routing"
                );
            }
            Observed::Failed { what, eject: false } => {
                let request_id = witness.request_id.to_str().unwrap_or_default();
                inferyes_net::warn_every!(gate: state.log; request_id, node = %self.id, "node {what}");
            }
        }
    }

    /// Whether the node is held out of routing at `now_ms`.
    pub fn ejected(&self, now_ms: u64) -> bool {
        self.state.ejected_until(now_ms).is_some()
    }

    /// This data plane's requests in flight to the node.
    pub fn in_flight(&self) -> u32 {
        self.state.in_flight()
    }

    /// Failures in a row.
    pub fn failures(&self) -> u32 {
        self.state.failures.load(Ordering::Relaxed)
    }

    /// Ejections since this data plane first saw the node.
    pub fn ejections(&self) -> u64 {
        self.state.ejections.load(Ordering::Relaxed)
    }

    /// Memory held on the node for cold loads this data plane started.
    pub fn reserved_vram_bytes(&self) -> u64 {
        self.state.reserved_vram_bytes.load(Ordering::Relaxed)
    }
}

/// A cold load an attempt waits on: the backend of the node, the model,
/// and its size, held against the node's free memory until the attempt
/// ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ColdLoad {
    pub backend: usize,
    pub model: Box<str>,
    pub bytes: u64,
}

/// Counts a request (and the memory of a cold load it waits on) against
/// its node until dropped: when its answer's body ends or goes.
#[derive(Debug)]
pub struct InFlight {
    state: Arc<NodeState>,
    load: Option<ColdLoad>,
}

impl InFlight {
    /// Whether this counts a request at `endpoint`'s node.
    pub fn counts_at(&self, endpoint: &Endpoint) -> bool {
        Arc::ptr_eq(&self.state, &endpoint.state)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.in_flight.fetch_sub(1, Ordering::Relaxed);
        if let Some(load) = &self.load {
            self.state.release_load(load);
        }
        self.state.freed.signal();
    }
}

/// Tells whoever waits for a node's slot that one of this data plane's
/// requests ended. Costs a request one relaxed load while nobody waits.
#[derive(Debug, Default)]
pub struct Freed {
    watched: AtomicBool,
    notify: tokio::sync::Notify,
}

impl Freed {
    /// Wakes the waiter where requests wait.
    pub(crate) fn signal(&self) {
        if self.watched.load(Ordering::Relaxed) {
            self.notify.notify_one();
        }
    }

    /// Wakes the waiter now, as an end would.
    pub fn wake(&self) {
        self.notify.notify_one();
    }

    /// Whether ends are signalled: on while requests wait.
    pub fn watch(&self, on: bool) {
        self.watched.store(on, Ordering::Relaxed);
    }

    pub fn watched(&self) -> bool {
        self.watched.load(Ordering::Relaxed)
    }

    /// Until a request ends, once watched (an end since the last call
    /// counts).
    pub async fn ended(&self) {
        self.notify.notified().await;
    }
}

/// Every node's state, by id: it outlives snapshots, so a request that
/// started under one is still counted under the next.
#[derive(Debug, Default)]
pub struct NodeStates {
    by_node: Mutex<HashMap<Arc<str>, Arc<NodeState>>>,
    freed: Arc<Freed>,
    turns: Arc<SentTurns>,
}

impl NodeStates {
    /// The endpoint of node `id` in a snapshot of `version`, which reports
    /// it `ready` or not: a node that turned ready after its ejection (its
    /// agent saw it fail and recover, or it joined again) is taken back
    /// early.
    pub fn endpoint(
        &self,
        id: &Arc<str>,
        proxy_url: BaseUrl,
        proxy_http2: bool,
        ready: bool,
        version: u64,
    ) -> Endpoint {
        let state = {
            let mut by_node = self.by_node.lock().unwrap_or_else(PoisonError::into_inner);
            let freed = &self.freed;
            Arc::clone(
                by_node
                    .entry(Arc::clone(id))
                    .or_insert_with(|| Arc::new(NodeState { freed: Arc::clone(freed), ..NodeState::default() })),
            )
        };
        state.readiness(ready, version);
        let id_header = HeaderValue::from_str(id).ok();
        Endpoint { id: Arc::clone(id), id_header, proxy_url, proxy_http2, authorization: None, state }
    }

    /// Signals the end of any of this data plane's requests.
    pub fn freed(&self) -> &Arc<Freed> {
        &self.freed
    }

    /// Where this data plane's sessions' latest turns went.
    pub fn turns(&self) -> &Arc<SentTurns> {
        &self.turns
    }

    /// The view of a snapshot whose nodes are `endpoints`, in order; the
    /// state of nodes no longer in the fleet, with nothing in flight, is
    /// forgotten.
    pub fn view<'a>(&self, endpoints: impl ExactSizeIterator<Item = &'a Endpoint>) -> View {
        let nodes: Box<[Arc<NodeState>]> = endpoints.map(|e| Arc::clone(&e.state)).collect();
        // A set, not a scan of the nodes for each state: for 1,000 nodes a
        // scan is a million comparisons per snapshot.
        let present: HashSet<*const NodeState> = nodes.iter().map(Arc::as_ptr).collect();
        let mut by_node = self.by_node.lock().unwrap_or_else(PoisonError::into_inner);
        by_node.retain(|_, state| present.contains(&Arc::as_ptr(state)) || state.in_flight() > 0);
        View { nodes, turns: Arc::clone(&self.turns) }
    }
}

/// One node's state in this data plane. Its fields are written only by
/// this module's code.
#[derive(Debug, Default)]
struct NodeState {
    in_flight: AtomicU32,
    /// The sum of `loads`' bytes, kept beside it so that routing reads it
    /// without a lock; only `hold_load` and `release_load` write it.
    reserved_vram_bytes: AtomicU64,
    /// Loads this data plane waits on: a model's size is held once per
    /// backend, however many requests wait for it to load there.
    loads: Mutex<Vec<HeldLoad>>,
    /// Passive ejection: after a failure the node is a last resort until
    /// this time, with exponential backoff over consecutive failures.
    ejected_until_ms: AtomicU64,
    ejected_at_version: AtomicU64,
    failures: AtomicU32,
    ejections: AtomicU64,
    /// Whether the node was ready in the latest snapshot, and the version
    /// since which it has been.
    ready: AtomicBool,
    ready_since_version: AtomicU64,
    /// Lets this node's failures be logged once in a while, however many
    /// requests see them, without holding back another node's.
    log: inferyes_net::log::Gate,
    /// The node's credential, and what it was derived from.
    credential: Mutex<Option<Derived>>,
    /// Every node's, shared.
    freed: Arc<Freed>,
}

/// A node's credential as last derived: from which key, for which agent
/// instance (none: one derived from the join token's key).
type Derived = (Arc<str>, Option<Box<str>>, HeaderValue);

/// What the controller's snapshot says data planes send agents: the keys
/// each node's credential is derived from (the one its controller issued
/// it, or, for agents from before, the join token's), and the fleet-wide
/// credential agents from before those took. `None`: agents take requests
/// without one.
#[derive(Clone, Debug, Default)]
pub struct AgentCredentials {
    pub node_key: Option<Arc<str>>,
    pub key: Option<Arc<str>>,
    pub fleet: Option<HeaderValue>,
}

/// Which credential an agent takes, as its status says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentTakes<'a> {
    /// The one its controller issued it, derived from `node_key` and the
    /// agent's instance (its record's digest of it).
    Issued { instance: &'a str },
    /// Its own, derived from the join token's `key`.
    JoinDerived,
    /// The fleet-wide one.
    FleetWide,
}

impl AgentTakes<'_> {
    pub fn of(node: &inferyes_proto::v1::SnapshotNode) -> AgentTakes<'_> {
        let Some(status) = node.status.as_ref() else { return AgentTakes::FleetWide };
        if status.proxy_credential_issued {
            AgentTakes::Issued { instance: &node.instance_digest }
        } else if status.proxy_credential_per_node {
            AgentTakes::JoinDerived
        } else {
            AgentTakes::FleetWide
        }
    }
}

/// A load waited on: (backend, model), the requests waiting, the bytes.
#[derive(Debug)]
struct HeldLoad {
    backend: usize,
    model: Box<str>,
    waiting: u32,
    bytes: u64,
}

/// The first ejection lasts this long; each consecutive failure doubles it.
const EJECTION_BASE_MS: u64 = 1_000;
const EJECTION_MAX_MS: u64 = 30_000;

impl NodeState {
    fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    fn hold_load(&self, load: &ColdLoad) {
        let mut loads = self.loads.lock().unwrap_or_else(PoisonError::into_inner);
        match loads.iter_mut().find(|held| held.backend == load.backend && held.model == load.model) {
            Some(held) => held.waiting += 1,
            None => {
                loads.push(HeldLoad {
                    backend: load.backend,
                    model: load.model.clone(),
                    waiting: 1,
                    bytes: load.bytes,
                });
                self.reserved_vram_bytes.fetch_add(load.bytes, Ordering::Relaxed);
            }
        }
    }

    /// The last request waiting on a load gives its bytes back.
    fn release_load(&self, load: &ColdLoad) {
        let mut loads = self.loads.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(at) = loads.iter().position(|held| held.backend == load.backend && held.model == load.model) else {
            return;
        };
        loads[at].waiting -= 1;
        if loads[at].waiting == 0 {
            let held = loads.swap_remove(at);
            self.reserved_vram_bytes.fetch_sub(held.bytes, Ordering::Relaxed);
        }
    }

    /// A failure: how long the node is now ejected.
    fn eject(&self, now_ms: u64, version: u64) -> u64 {
        let failures = self.failures.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        self.ejections.fetch_add(1, Ordering::Relaxed);
        let backoff = EJECTION_BASE_MS.saturating_mul(1 << (failures - 1).min(5)).min(EJECTION_MAX_MS);
        self.ejected_at_version.store(version, Ordering::Relaxed);
        self.ejected_until_ms.store(now_ms.saturating_add(backoff), Ordering::Relaxed);
        backoff
    }

    fn succeeded(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
            self.ejected_until_ms.store(0, Ordering::Relaxed);
        }
    }

    fn readiness(&self, ready: bool, version: u64) {
        if ready && !self.ready.swap(true, Ordering::Relaxed) {
            self.ready_since_version.store(version, Ordering::Relaxed);
        } else if !ready {
            self.ready.store(false, Ordering::Relaxed);
        }
    }

    fn ejected_until(&self, now_ms: u64) -> Option<u64> {
        let until = self.ejected_until_ms.load(Ordering::Relaxed);
        let back_early =
            self.ready_since_version.load(Ordering::Relaxed) > self.ejected_at_version.load(Ordering::Relaxed);
        (now_ms < until && !back_early).then_some(until)
    }
}

#[cfg(test)]
mod tests {
    use inferyes_proto::bearer::FleetKey;

    use super::*;

    fn endpoint(states: &NodeStates, ready: bool, version: u64) -> Arc<Endpoint> {
        Arc::new(states.endpoint(&Arc::from("a"), BaseUrl::new("http://a"), false, ready, version))
    }

    fn failed() -> Observed {
        Observed::Failed { what: "is unreachable", eject: true }
    }

    #[test]
    fn each_node_is_sent_its_own_credential_and_an_older_agent_the_fleet_s() {
        let states = NodeStates::default();
        let key: Arc<str> = Arc::from(inferyes_proto::bearer::proxy_key("join").as_str());
        let fleet = inferyes_proto::bearer::header_value("fleet-wide");
        let issued_key = FleetKey::new(&[3; inferyes_proto::bearer::FLEET_KEY_BYTES]).unwrap();
        let node_key: Arc<str> = Arc::from(issued_key.node_key().as_str());
        let credentials = AgentCredentials {
            node_key: Some(Arc::clone(&node_key)),
            key: Some(Arc::clone(&key)),
            fleet: fleet.clone(),
        };
        let of = |id: &str, per_node: bool, credentials: &AgentCredentials| {
            let endpoint = states.endpoint(&Arc::from(id), BaseUrl::new("http://a"), false, true, 1);
            let takes = if per_node { AgentTakes::JoinDerived } else { AgentTakes::FleetWide };
            endpoint.with_credential(takes, credentials).authorization
        };
        let issued = |id: &str, instance: &str| {
            let endpoint = states.endpoint(&Arc::from(id), BaseUrl::new("http://a"), false, true, 1);
            endpoint.with_credential(AgentTakes::Issued { instance }, &credentials).authorization
        };
        let header = inferyes_proto::bearer::header_value;
        assert_eq!(issued("d", "i1"), header(&issued_key.proxy_credential("d", "i1")), "what its controller issued");
        assert_eq!(issued("d", "i1"), header(&issued_key.proxy_credential("d", "i1")), "the same, from the cache");
        assert_eq!(issued("d", "i2"), header(&issued_key.proxy_credential("d", "i2")), "another agent of that id");
        let own =
            |id: &str| inferyes_proto::bearer::header_value(&inferyes_proto::bearer::node_proxy_credential(&key, id));
        assert_eq!(of("a", true, &credentials), own("a"));
        assert_eq!(of("b", true, &credentials), own("b"));
        assert_ne!(own("a"), own("b"));
        assert_eq!(of("a", true, &credentials), own("a"), "the same, from the cache");
        assert_eq!(of("c", false, &credentials), fleet, "an agent from before takes the fleet's");
        let rotated = AgentCredentials {
            key: Some(Arc::from(inferyes_proto::bearer::proxy_key("new").as_str())),
            fleet,
            ..credentials.clone()
        };
        let new = inferyes_proto::bearer::node_proxy_credential(rotated.key.as_deref().unwrap(), "a");
        assert_eq!(of("a", true, &rotated), inferyes_proto::bearer::header_value(&new), "derived anew for a new key");
        assert_eq!(of("a", true, &AgentCredentials::default()), None, "an open fleet sends none");
    }

    #[test]
    fn ejections_back_off_and_end_on_success_or_recovery() {
        let states = NodeStates::default();
        let a = endpoint(&states, true, 1);
        let request_id = HeaderValue::from_static("r");
        let witness = Witness { request_id: &request_id, version: 1 };
        let mut backoffs = Vec::new();
        for _ in 0..7 {
            let now = inferyes_proto::unix_ms();
            a.observe(failed(), witness);
            backoffs.push(a.state.ejected_until_ms.load(Ordering::Relaxed) - now);
        }
        // Each within a few ms of its due, however slow the machine.
        let expected = [1_000, 2_000, 4_000, 8_000, 16_000, 30_000, 30_000];
        for (backoff, expected) in backoffs.iter().zip(expected) {
            assert!((expected..expected + 1_000).contains(backoff), "{backoffs:?}");
        }
        assert_eq!((a.failures(), a.ejections()), (7, 7));
        assert!(a.ejected(inferyes_proto::unix_ms()));
        a.observe(Observed::Answered, witness);
        assert!(!a.ejected(inferyes_proto::unix_ms()));
        a.observe(failed(), witness);
        assert_eq!(a.failures(), 1, "the streak starts over");
        a.observe(Observed::Failed { what: "ended a stream early", eject: false }, witness);
        a.observe(Observed::Unjudged, witness);
        assert_eq!((a.failures(), a.ejections()), (1, 8), "only a failure that ejects counts");

        // The node's agent reports it down, then ready again: taken back
        // early, by a snapshot after the failure's.
        let states = NodeStates::default();
        let first = endpoint(&states, true, 1);
        first.observe(failed(), witness);
        assert!(first.ejected(0));
        let down = endpoint(&states, false, 2);
        assert!(down.ejected(0));
        let recovered = endpoint(&states, true, 3);
        assert!(!recovered.ejected(0) && !first.ejected(0), "one state, whichever snapshot's endpoint");
    }

    #[test]
    fn a_model_s_size_is_held_once_however_many_requests_wait_for_its_load() {
        let states = NodeStates::default();
        let a = endpoint(&states, true, 1);
        let load = |backend, model: &str, bytes| Some(ColdLoad { backend, model: model.into(), bytes });
        let m0 = a.enter(load(0, "m", 10));
        let m0_again = a.enter(load(0, "m", 10));
        let n0 = a.enter(load(0, "n", 5));
        assert_eq!(a.reserved_vram_bytes(), 15);
        // The same model loading on another backend of the node takes its own.
        let m1 = a.enter(load(1, "m", 10));
        assert_eq!((a.reserved_vram_bytes(), a.in_flight()), (25, 4));
        drop(m1);
        drop(m0);
        assert_eq!(a.reserved_vram_bytes(), 15, "one request still waits on m");
        drop((m0_again, n0));
        assert_eq!((a.reserved_vram_bytes(), a.in_flight()), (0, 0));
    }

    #[test]
    fn states_outlive_snapshots_while_their_nodes_stay_or_have_requests_in_flight() {
        let states = NodeStates::default();
        let first = endpoint(&states, true, 1);
        let guard = first.enter(None);
        let second = endpoint(&states, true, 2);
        assert_eq!(second.in_flight(), 1, "the same node's state");
        let view = states.view([&*second].into_iter());
        assert_eq!(view.in_flight(0), 1);
        states.view(std::iter::empty());
        assert_eq!(endpoint(&states, true, 3).in_flight(), 1, "kept while a request is in flight");
        drop(guard);
        states.view(std::iter::empty());
        assert_eq!(endpoint(&states, true, 4).in_flight(), 0, "forgotten once gone and idle");
    }
}
