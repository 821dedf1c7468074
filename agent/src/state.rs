//! The agent's shared state. Each piece has one writer: the poller writes
//! observations (and tells the residency table each backend's capacity),
//! the proxy writes in-flight counts and the sessions in the residency
//! table; the reporter reads, through [`AgentState::status`], and takes
//! numbered residency updates.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use inferyes_proto::v1::{Backend, Gpu, ModelState, NodeStatus};
use tokio::sync::Notify;

use crate::probe::BackendProbe;
use crate::residency::Residency;

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
    pub backends: Vec<BackendHandle>,
    pub observations: Mutex<Observations>,
    pub residency: Mutex<Residency>,
    /// Woken when something worth reporting changed.
    pub changed: Notify,
}

impl AgentState {
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
        let observations = self.observations.lock().ok()?;
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
        let Ok(observations) = self.observations.lock() else { return 0 };
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
        let (mut backends, gpus) = match self.observations.lock() {
            Ok(o) => (o.backends.clone(), o.gpus.clone()),
            Err(_) => (Vec::new(), Vec::new()),
        };
        for backend in &mut backends {
            if let Some(handle) = self.backend(&backend.id) {
                backend.in_flight = handle.in_flight.load(Ordering::Relaxed);
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
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            started_unix_ms: self.started_unix_ms,
            proxy_http2: self.proxy_http2,
        }
    }
}
