//! The agent's shared state. Each piece has one writer: the poller writes
//! observations (and tells the residency table each backend's capacity),
//! the proxy writes in-flight counts, the sessions in the residency table
//! and the jobs a backend answered 501 for; the reporter reads, through [`AgentState::status`], and takes
//! numbered residency updates.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use inferyes_proto::v1::{Backend, EndpointKind, Gpu, ModelState, NodeStatus};
use tokio::sync::Notify;

use crate::probe::BackendProbe;
use crate::residency::Residency;
pub use crate::shared::Shared;

/// The labels a backend's metrics are kept under.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct BackendLabels {
    pub backend: String,
}

pub struct BackendHandle {
    pub probe: BackendProbe,
    /// The probe's URL, read once for the proxy's requests.
    pub url: inferyes_net::base_url::BaseUrl,
    /// `Bearer <api key>`, made once, where the backend has a key.
    pub authorization: Option<http::HeaderValue>,
    /// Its metrics labels, made once: the proxy's first-byte histogram is
    /// observed under them on every request.
    pub labels: BackendLabels,
    pub in_flight: AtomicU32,
    /// Requests the backend answered with a success through the proxy,
    /// once their bodies ended or were dropped: the poller divides slot time
    /// by it. Requests sent to the backend around the proxy add slot time
    /// and no count, and make the service time look longer.
    pub finished: AtomicU64,
    /// Lets this backend's failures be logged once in a while, however
    /// many requests see them.
    pub log: inferyes_net::log::Gate,
    /// Kinds of job the backend answered 501 for, by model, until when
    /// they are believed: the proxy writes them, the status reads them.
    pub unsupported: Shared<Vec<Unsupported>>,
    /// Restored slots whose next turn read next to nothing from cache,
    /// and when the last did (Unix ms): the backend takes no more slots
    /// for [`RESTORE_FAILURE_HOLDS_MS`] after one.
    pub restores_reused_nothing: AtomicU32,
    pub restore_failed_unix_ms: AtomicU64,
    /// Slots restored into and not yet used, which the next restore must
    /// not take for empty; held while one restores, so two never pick the
    /// same slot.
    pub restore_marks: tokio::sync::Mutex<Vec<crate::slot::Restored>>,
    /// Its KV tier, where it keeps conversations' states on disk.
    pub tier: Option<crate::tier::Tier>,
}

/// A kind of job a backend said it does not do for a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unsupported {
    pub model: String,
    pub kind: EndpointKind,
    pub until: Instant,
}

/// How long a 501 is believed: a backend restarted with another build or
/// model may do the job, and is tried again after this.
const UNSUPPORTED_FOR: Duration = Duration::from_secs(10 * 60);
/// How long a backend takes no slots after a restore there held nothing:
/// long enough not to pile more on a server whose cache layout differs
/// from what it declared, short enough that one turn that sent another
/// history under a moved conversation's key costs little.
pub const RESTORE_FAILURE_HOLDS_MS: u64 = 10 * 60 * 1000;
/// Each backend's learned refusals, at most: every model of a backend
/// (256, the record's bound) for each kind learned, and no more, so a
/// client cannot grow the node's record.
const MAX_UNSUPPORTED: usize = 256 * 3;

impl BackendHandle {
    /// Notes that the backend answered 501 for `kind` of `model`; whether
    /// that is news.
    pub fn learn_unsupported(&self, model: &str, kind: EndpointKind, now: Instant) -> bool {
        let mut learned = self.unsupported.lock();
        learned.retain(|u| u.until > now);
        let until = now + UNSUPPORTED_FOR;
        if let Some(known) = learned.iter_mut().find(|u| u.model == model && u.kind == kind) {
            known.until = until;
            return false;
        }
        if learned.len() >= MAX_UNSUPPORTED {
            learned.remove(0);
        }
        learned.push(Unsupported { model: model.to_string(), kind, until });
        true
    }

    /// Its slot fingerprint as `observed`, unless a restore here reused
    /// nothing lately: then none, and it takes no slots for a while.
    pub fn slot_fingerprint(&self, observed: &Backend) -> String {
        if self.restore_failed_lately(inferyes_proto::unix_ms()) {
            return String::new();
        }
        observed.slot_fingerprint.clone()
    }

    fn restore_failed_lately(&self, now_ms: u64) -> bool {
        let failed = self.restore_failed_unix_ms.load(Ordering::Relaxed);
        failed > 0 && now_ms.saturating_sub(failed) < RESTORE_FAILURE_HOLDS_MS
    }

    /// Adds what the backend said it does not do to `backend`'s models.
    fn mark_unsupported(&self, backend: &mut Backend, now: Instant) {
        let learned = self.unsupported.lock();
        for u in learned.iter().filter(|u| u.until > now) {
            if let Some(model) = backend.models.iter_mut().find(|m| m.id == u.model)
                && !model.unsupported.contains(&(u.kind as i32))
            {
                model.unsupported.push(u.kind as i32);
            }
        }
    }
}

#[derive(Default)]
pub struct Observations {
    pub backends: Vec<Backend>,
    pub gpus: Vec<Gpu>,
    /// GPU readings failed in a row, up to now.
    pub gpu_failures: u32,
    /// Each backend's recent counters, in the configured order.
    pub throughput: Vec<crate::probe::Throughput>,
}

pub struct AgentState {
    pub node_id: String,
    /// Random for this start: presented on registering, so that only this
    /// process (moving between controllers) takes over its live node.
    pub instance: String,
    pub hostname: String,
    pub proxy_url: String,
    /// Whether data planes may speak HTTP/2 to `proxy_url`: only when it is
    /// this proxy itself, not an address in front of it that may not.
    pub proxy_http2: bool,
    pub started_unix_ms: u64,
    /// What an hour of the node's GPU time costs (0: not priced).
    pub gpu_hour_price: f64,
    pub backends: Vec<BackendHandle>,
    pub observations: Shared<Observations>,
    /// Other nodes' backends that can take this node's slots, as its
    /// controller last named them; written only by the reporter.
    pub peers: Shared<Vec<inferyes_proto::v1::MoveTarget>>,
    /// Whether the node joins with a token: its proxy then takes only the
    /// credential its controller issued it, and its intake slots only
    /// under its controller's grants.
    pub closed: bool,
    /// What its controller issued this node; `None` until one has: written
    /// only by the reporter, read by every request the proxy takes.
    pub issued: arc_swap::ArcSwapOption<Issued>,
    /// The drain's moves of this node's conversations, as last reported;
    /// written only by the drain.
    pub moves: Shared<Option<inferyes_proto::v1::MoveProgress>>,
    pub residency: Shared<Residency>,
    /// Woken when something worth reporting changed.
    pub changed: Notify,
    /// Wakes the poller before its next tick: a model load or unload was
    /// asked for, and its state is worth reading at once.
    pub poll_now: Notify,
}

/// What a controller issued this node (`NodeCredentials`).
#[derive(PartialEq, Eq)]
pub struct Issued {
    /// What data planes present to this proxy.
    pub proxy_credential: String,
    /// What the slots sent here are checked with.
    pub intake_key: String,
}

impl std::fmt::Debug for Issued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Issued(..)")
    }
}

impl AgentState {
    /// Whether `authorization` is `Bearer` and the credential this node was
    /// issued; never before one was.
    pub fn admits(&self, authorization: Option<&[u8]>) -> bool {
        let issued = self.issued.load();
        let presented = authorization.and_then(|value| value.strip_prefix(b"Bearer "));
        match (presented, issued.as_deref()) {
            (Some(token), Some(issued)) => {
                inferyes_proto::apikey::constant_time_eq(token, issued.proxy_credential.as_bytes())
            }
            _ => false,
        }
    }

    /// Notes that a turn of `session` begins on `backend_id`; the tokens
    /// restored into its slot, where this is its first turn since (its
    /// body is then kept to tell, should it read next to nothing, whether
    /// it carried on from them).
    pub fn turn_begins(&self, session: &str, backend_id: &str, model: &str) -> Option<std::sync::Arc<[i32]>> {
        let restored = {
            let mut residency = self.residency.lock();
            residency.touch(session, backend_id, model, inferyes_proto::unix_ms());
            residency.unchecked_restore(session)
        };
        self.changed.notify_one();
        restored
    }

    pub fn backend(&self, id: &str) -> Option<&BackendHandle> {
        self.backends.iter().find(|b| b.probe.id == id)
    }

    /// The backend to use when a request names none: the only one, or the
    /// first healthy one that lists `model` (loaded first).
    pub fn backend_for_model(&self, model: Option<&str>) -> Option<&BackendHandle> {
        if self.backends.len() == 1 {
            return self.backends.first();
        }
        let model = model?;
        let observations = self.observations.lock();
        let serving = |loaded_only: bool| {
            observations
                .backends
                .iter()
                .find(|b| b.models.iter().any(|m| m.id == model && (!loaded_only || m.state() == ModelState::Loaded)))
        };
        let id = serving(true).or_else(|| serving(false))?.id.clone();
        drop(observations);
        self.backend(&id)
    }

    pub fn loaded_model_bytes(&self) -> u64 {
        let observations = self.observations.lock();
        observations
            .backends
            .iter()
            .flat_map(|b| &b.models)
            .filter(|m| m.state() == ModelState::Loaded)
            .map(|m| m.size_bytes)
            .sum()
    }

    /// The node's status as reported to the controller.
    pub fn status(&self) -> NodeStatus {
        let (mut backends, gpus) = {
            let observations = self.observations.lock();
            (observations.backends.clone(), observations.gpus.clone())
        };
        let now = Instant::now();
        for backend in &mut backends {
            if let Some(handle) = self.backend(&backend.id) {
                backend.in_flight = handle.in_flight.load(Ordering::Relaxed);
                backend.kv_tier = handle.tier.as_ref().map(crate::tier::Tier::report);
                handle.mark_unsupported(backend, now);
                let reused_nothing = handle.restores_reused_nothing.load(Ordering::Relaxed);
                if handle.restore_failed_lately(inferyes_proto::unix_ms()) && !backend.slot_fingerprint.is_empty() {
                    backend.slot_fingerprint.clear();
                    backend.slots_unmovable = format!(
                        "{reused_nothing} restored slot(s) read next to nothing from cache here: taking none for \
                         10 minutes after each (do slots.flags match the server's?)"
                    );
                }
            }
        }
        NodeStatus {
            node_id: self.node_id.clone(),
            hostname: self.hostname.clone(),
            proxy_url: self.proxy_url.clone(),
            gpus,
            backends,
            // Sessions travel as numbered residency updates.
            sessions: Vec::new(),
            moves: self.moves.lock().clone(),
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            started_unix_ms: self.started_unix_ms,
            proxy_http2: self.proxy_http2,
            proxy_credential_per_node: true,
            proxy_credential_issued: true,
            awaiting_credential: self.closed && self.issued.load().is_none(),
            gpu_hour_price: self.gpu_hour_price,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle() -> BackendHandle {
        let probe = BackendProbe {
            id: "b0".into(),
            url: "http://127.0.0.1:1".into(),
            kind: crate::config::BackendKind::LlamaServer,
            weight: 1,
            endpoints: Vec::new(),
            api_key: String::new(),
            declared_models: Vec::new(),
            host_cache_tokens: 0,
            model_sizes: Default::default(),
            models_max: 0,
            slots: None,
            slot_memo: Default::default(),
        };
        BackendHandle {
            url: inferyes_net::base_url::BaseUrl::new(&probe.url),
            probe,
            authorization: None,
            labels: BackendLabels { backend: "b0".into() },
            in_flight: AtomicU32::new(0),
            finished: AtomicU64::new(0),
            log: inferyes_net::log::Gate::new(),
            unsupported: Shared::default(),
            restores_reused_nothing: AtomicU32::new(0),
            restore_failed_unix_ms: AtomicU64::new(0),
            restore_marks: Default::default(),
            tier: None,
        }
    }

    /// A closed node's state with `backends`, issued nothing yet.
    fn state(backends: Vec<BackendHandle>) -> AgentState {
        AgentState {
            node_id: "n".into(),
            instance: String::new(),
            hostname: String::new(),
            proxy_url: "http://127.0.0.1:1".into(),
            proxy_http2: true,
            started_unix_ms: 0,
            gpu_hour_price: 0.0,
            backends,
            observations: Shared::default(),
            moves: Shared::default(),
            peers: Shared::default(),
            closed: true,
            issued: Default::default(),
            residency: Shared::default(),
            changed: Notify::new(),
            poll_now: Notify::new(),
        }
    }

    /// A panic on `lock`'s thread while it holds a guard, as a bug in
    /// the proxy or the poller would leave it.
    fn poison<T: Send>(shared: &Shared<T>) {
        std::thread::scope(|scope| {
            let held = scope.spawn(|| {
                let _guard = shared.lock();
                panic!("a bug while the lock is held");
            });
            assert!(held.join().is_err());
        });
        assert!(shared.0.is_poisoned());
    }

    #[test]
    fn a_panic_while_a_lock_was_held_switches_nothing_off() {
        let state = state(vec![handle()]);
        poison(&state.residency);
        state.residency.lock().touch("conversation", "b0", "chat", 1);
        let update = state.residency.lock().take_update(false);
        assert!(update.upserted.iter().any(|s| s.key == "conversation"), "residency still tracked: {update:?}");

        poison(&state.observations);
        state.observations.lock().backends = vec![Backend { id: "b0".into(), ..Default::default() }];
        assert_eq!(state.status().backends.len(), 1, "observations still reported");
        poison(&state.backends[0].unsupported);
        assert!(state.backends[0].learn_unsupported("chat", EndpointKind::Infill, Instant::now()));
    }

    #[test]
    fn the_proxy_admits_only_the_credential_its_controller_issued() {
        let state = state(Vec::new());
        assert!(!state.admits(Some(b"Bearer issued")), "none issued yet");
        assert!(state.status().awaiting_credential, "no data plane sends it a request meanwhile");
        let issued = super::Issued { proxy_credential: "issued".into(), intake_key: "k".into() };
        state.issued.store(Some(std::sync::Arc::new(issued)));
        assert!(state.admits(Some(b"Bearer issued")));
        assert!(!state.status().awaiting_credential);
        for refused in [None, Some(&b"issued"[..]), Some(b"Bearer other"), Some(b"Bearer issue"), Some(b"Bearer k")] {
            assert!(!state.admits(refused), "{refused:?}");
        }
    }

    #[test]
    fn a_501_is_believed_for_a_while_for_its_model_only_and_a_few_at_most() {
        let handle = handle();
        let now = Instant::now();
        assert!(handle.learn_unsupported("code", EndpointKind::Infill, now));
        assert!(!handle.learn_unsupported("code", EndpointKind::Infill, now), "not news");
        let mut backend = Backend { id: "b0".into(), ..Default::default() };
        backend.models =
            ["code", "chat"].map(|id| inferyes_proto::v1::Model { id: id.into(), ..Default::default() }).into();
        handle.mark_unsupported(&mut backend, now);
        assert_eq!(backend.models[0].unsupported, [EndpointKind::Infill as i32]);
        assert!(backend.models[1].unsupported.is_empty());
        let mut later = Backend { id: "b0".into(), models: backend.models.clone(), ..Default::default() };
        later.models[0].unsupported.clear();
        handle.mark_unsupported(&mut later, now + UNSUPPORTED_FOR);
        assert!(later.models[0].unsupported.is_empty(), "tried again after a while");
        for i in 0..2 * MAX_UNSUPPORTED {
            handle.learn_unsupported(&format!("made-up-{i}"), EndpointKind::Embedding, now);
        }
        assert_eq!(handle.unsupported.lock().len(), MAX_UNSUPPORTED);
    }
}
