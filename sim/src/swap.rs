//! llama-swap's model management: which models are loaded, loading on first
//! use, least-recently-used unloading and the per-model concurrency limit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span};

use super::SimModel;
use super::engine::{Engine, EngineParams, StatCounters, Timing};

/// Builds the engine of a model when it loads.
#[derive(Debug, Clone)]
pub(crate) struct EngineFactory {
    pub params: EngineParams,
    pub timing: Timing,
    pub stats: Arc<StatCounters>,
}

impl EngineFactory {
    pub(crate) fn build(&self, model: SimModel) -> Arc<Engine> {
        Engine::new(model, self.params, self.timing, Arc::clone(&self.stats))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SwapError {
    #[error("could not find suitable inference handler for {0}")]
    NotFound(String),
    #[error("too many concurrent requests for model {0}, try again later")]
    ConcurrencyLimit(String),
    #[error("model {0} did not finish loading: the server is shutting down")]
    LoadAborted(String),
}

/// The `status.value` llama-swap reports per model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ModelStatus {
    Unloaded,
    Loading,
    Loaded,
}

impl ModelStatus {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ModelStatus::Unloaded => "unloaded",
            ModelStatus::Loading => "loading",
            ModelStatus::Loaded => "loaded",
        }
    }
}

#[derive(Debug)]
enum Status {
    Unloaded,
    /// Flips to `true` when loaded; dropped without that if the load aborts.
    Loading(watch::Receiver<bool>),
    Loaded(Arc<Engine>),
}

#[derive(Debug)]
struct Entry {
    model: SimModel,
    status: Status,
    last_used: u64,
    in_flight: u32,
}

#[derive(Debug)]
struct SwapState {
    entries: HashMap<String, Entry>,
    clock: u64,
}

impl SwapState {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Unloads least recently used models, other than `keep`, until at most
    /// `max_loaded` remain. Requests already running on an unloaded engine
    /// finish on it: they hold its `Arc`.
    fn evict_beyond(&mut self, max_loaded: usize, keep: &str) {
        loop {
            let loaded = self.entries.values().filter(|e| matches!(e.status, Status::Loaded(_))).count();
            if loaded <= max_loaded {
                return;
            }
            let victim = self
                .entries
                .iter()
                .filter(|(id, e)| matches!(e.status, Status::Loaded(_)) && id.as_str() != keep)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(id, _)| id.clone());
            let Some(victim) = victim else { return };
            if let Some(e) = self.entries.get_mut(&victim) {
                e.status = Status::Unloaded;
                info!(model = %victim, "model unloaded");
            }
        }
    }
}

/// All configured models of a llama-swap instance.
#[derive(Debug)]
pub(crate) struct Swap {
    /// Configured order, for stable listings.
    order: Vec<String>,
    state: Mutex<SwapState>,
    factory: EngineFactory,
    load_delay: Duration,
    max_loaded: usize,
    concurrency_limit: u32,
    shutdown: CancellationToken,
}

impl Swap {
    /// `preload` models start loaded, without a load delay.
    pub(crate) fn new(
        models: &[SimModel],
        preload: &[String],
        factory: EngineFactory,
        load_delay: Duration,
        max_loaded: usize,
        concurrency_limit: u32,
        shutdown: CancellationToken,
    ) -> Arc<Swap> {
        let mut state = SwapState { entries: HashMap::new(), clock: 0 };
        for m in models {
            state
                .entries
                .insert(m.id.clone(), Entry { model: m.clone(), status: Status::Unloaded, last_used: 0, in_flight: 0 });
        }
        for id in preload {
            let now = state.tick();
            if let Some(e) = state.entries.get_mut(id) {
                e.status = Status::Loaded(factory.build(e.model.clone()));
                e.last_used = now;
            }
            state.evict_beyond(max_loaded, id);
        }
        Arc::new(Swap {
            order: models.iter().map(|m| m.id.clone()).collect(),
            state: Mutex::new(state),
            factory,
            load_delay,
            max_loaded,
            concurrency_limit,
            shutdown,
        })
    }

    /// Only held for short synchronous updates, so poisoned data is still sound.
    fn lock(&self) -> MutexGuard<'_, SwapState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a request against the model's concurrency limit for as long as
    /// the returned guard lives.
    pub(crate) fn enter(self: &Arc<Self>, model: &str) -> Result<InFlight, SwapError> {
        let mut st = self.lock();
        let entry = st.entries.get_mut(model).ok_or_else(|| SwapError::NotFound(model.to_owned()))?;
        if entry.in_flight >= self.concurrency_limit {
            return Err(SwapError::ConcurrencyLimit(model.to_owned()));
        }
        entry.in_flight += 1;
        Ok(InFlight { swap: Arc::clone(self), model: model.to_owned() })
    }

    /// The model's engine, loading it first if needed. Concurrent callers for
    /// a loading model share one load.
    pub(crate) async fn engine(self: &Arc<Self>, model: &str) -> Result<Arc<Engine>, SwapError> {
        loop {
            let mut rx = {
                let mut st = self.lock();
                let now = st.tick();
                let entry = st.entries.get_mut(model).ok_or_else(|| SwapError::NotFound(model.to_owned()))?;
                match &entry.status {
                    Status::Loaded(engine) => {
                        entry.last_used = now;
                        return Ok(Arc::clone(engine));
                    }
                    Status::Loading(rx) => rx.clone(),
                    Status::Unloaded => {
                        let (tx, rx) = watch::channel(false);
                        entry.status = Status::Loading(rx.clone());
                        self.spawn_load(model.to_owned(), tx);
                        rx
                    }
                }
            };
            if rx.wait_for(|loaded| *loaded).await.is_err() {
                return Err(SwapError::LoadAborted(model.to_owned()));
            }
            // Loaded; loop to take it, or to load again if it was already
            // swapped out by another model in the meantime.
        }
    }

    /// The load runs in its own task so that a client giving up does not
    /// strand the other requests waiting for the same model.
    fn spawn_load(self: &Arc<Self>, model: String, tx: watch::Sender<bool>) {
        let swap = Arc::clone(self);
        let span = info_span!("sim_model_load", model = %model);
        tokio::spawn(
            async move {
                info!("loading model");
                tokio::select! {
                    () = tokio::time::sleep(swap.load_delay) => {}
                    () = swap.shutdown.cancelled() => {
                        let mut st = swap.lock();
                        if let Some(e) = st.entries.get_mut(&model) {
                            e.status = Status::Unloaded;
                        }
                        // Dropping `tx` tells the waiters the load failed.
                        return;
                    }
                }
                {
                    let mut st = swap.lock();
                    let now = st.tick();
                    if let Some(e) = st.entries.get_mut(&model) {
                        e.status = Status::Loaded(swap.factory.build(e.model.clone()));
                        e.last_used = now;
                    }
                    st.evict_beyond(swap.max_loaded, &model);
                }
                info!("model loaded");
                // Waiters may all have gone away; nothing to do then.
                let _ = tx.send(true);
            }
            .instrument(span),
        );
    }

    /// Starts loading `model` without waiting for it, as llama-server's
    /// router does on `POST /models/load`; `Ok(false)`: it is loaded or
    /// loading already.
    pub(crate) fn start_load(self: &Arc<Self>, model: &str) -> Result<bool, SwapError> {
        let mut st = self.lock();
        let entry = st.entries.get_mut(model).ok_or_else(|| SwapError::NotFound(model.to_owned()))?;
        if !matches!(entry.status, Status::Unloaded) {
            return Ok(false);
        }
        let (tx, rx) = watch::channel(false);
        entry.status = Status::Loading(rx);
        drop(st);
        self.spawn_load(model.to_owned(), tx);
        Ok(true)
    }

    /// Unloads `model` if it is loaded; requests running on it finish.
    pub(crate) fn unload(&self, model: &str) -> Result<(), SwapError> {
        let mut st = self.lock();
        let entry = st.entries.get_mut(model).ok_or_else(|| SwapError::NotFound(model.to_owned()))?;
        if matches!(entry.status, Status::Loaded(_)) {
            entry.status = Status::Unloaded;
            info!(%model, "model unloaded");
        }
        Ok(())
    }

    pub(crate) fn statuses(&self) -> Vec<(String, ModelStatus)> {
        let st = self.lock();
        self.order
            .iter()
            .filter_map(|id| {
                let status = match st.entries.get(id)?.status {
                    Status::Unloaded => ModelStatus::Unloaded,
                    Status::Loading(_) => ModelStatus::Loading,
                    Status::Loaded(_) => ModelStatus::Loaded,
                };
                Some((id.clone(), status))
            })
            .collect()
    }

    pub(crate) fn loaded_engines(&self) -> Vec<Arc<Engine>> {
        let st = self.lock();
        self.order
            .iter()
            .filter_map(|id| match &st.entries.get(id)?.status {
                Status::Loaded(e) => Some(Arc::clone(e)),
                _ => None,
            })
            .collect()
    }
}

/// One request counted against a model's concurrency limit.
#[derive(Debug)]
pub(crate) struct InFlight {
    swap: Arc<Swap>,
    model: String,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut st = self.swap.lock();
        if let Some(e) = st.entries.get_mut(&self.model) {
            e.in_flight = e.in_flight.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn swap(max_loaded: usize, preload: &[&str], limit: u32) -> Arc<Swap> {
        let models = [SimModel::chat("a"), SimModel::chat("b"), SimModel::chat("c")];
        let factory = EngineFactory {
            params: EngineParams { slots: 2, n_ctx_slot: 512, cache_ram_tokens: 0 },
            timing: Timing { prefill_tokens_per_second: 1e15, decode_tokens_per_second: 1e15 },
            stats: Arc::new(StatCounters::default()),
        };
        let preload: Vec<String> = preload.iter().map(|s| (*s).to_owned()).collect();
        Swap::new(&models, &preload, factory, Duration::ZERO, max_loaded, limit, CancellationToken::new())
    }

    fn status_of(s: &Swap, id: &str) -> ModelStatus {
        s.statuses().into_iter().find(|(m, _)| m == id).map(|(_, st)| st).unwrap()
    }

    #[tokio::test]
    async fn loads_on_demand_and_unloads_least_recently_used() {
        let s = swap(2, &["a"], 10);
        assert_eq!(status_of(&s, "a"), ModelStatus::Loaded);
        assert_eq!(status_of(&s, "b"), ModelStatus::Unloaded);
        s.engine("b").await.unwrap();
        s.engine("a").await.unwrap();
        s.engine("c").await.unwrap();
        // b was used least recently.
        assert_eq!(status_of(&s, "b"), ModelStatus::Unloaded);
        assert_eq!(status_of(&s, "a"), ModelStatus::Loaded);
        assert_eq!(status_of(&s, "c"), ModelStatus::Loaded);
        assert_eq!(s.loaded_engines().len(), 2);
    }

    #[tokio::test]
    async fn concurrent_requests_share_one_load() {
        let s = swap(1, &[], 10);
        let (x, y) = tokio::join!(s.engine("b"), s.engine("b"));
        assert!(Arc::ptr_eq(&x.unwrap(), &y.unwrap()));
    }

    #[tokio::test]
    async fn unknown_model_and_concurrency_limit() {
        let s = swap(1, &[], 2);
        assert_eq!(s.engine("zzz").await.unwrap_err(), SwapError::NotFound("zzz".into()));
        assert!(matches!(s.enter("zzz"), Err(SwapError::NotFound(_))));
        let g1 = s.enter("a").unwrap();
        let _g2 = s.enter("a").unwrap();
        assert!(matches!(s.enter("a"), Err(SwapError::ConcurrencyLimit(_))));
        drop(g1);
        assert!(s.enter("a").is_ok());
    }
}
