//! A simulated inference backend that speaks llama-server's HTTP API (and
//! optionally llama-swap's), so the product and its tests run without GPUs and
//! so routing quality, KV-cache reuse in particular, can be measured.
//!
//! The response shapes follow llama.cpp b11434 and llama-swap as recorded in
//! `FACTS.md`. Tokens, replies and embeddings are deterministic stand-ins; the
//! slot, prompt-cache and timing rules follow llama-server's.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use inferyes_sim::{SimConfig, Simulator};
//! let sim = Simulator::new(SimConfig::llama_server("qwen"))?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! tokio::spawn(sim.clone().serve(listener, shutdown.clone()));
//! # Ok(()) }
//! ```

mod api;
mod engine;
mod swap;
mod tokens;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use engine::{Engine, EngineParams, StatCounters, Timing};
use swap::{EngineFactory, Swap};

/// Which server the simulator impersonates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SimMode {
    /// One model, llama-server's own API.
    #[default]
    LlamaServer,
    /// Several models behind llama-swap, each loaded on demand.
    LlamaSwap,
    /// llama-server in router mode (`--models-dir`): several models, each
    /// loaded on its first request, `max_loaded_models` at once
    /// (`--models-max`), with llama-server's API and errors.
    LlamaServerRouter,
}

/// Configuration of a [`Simulator`].
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimConfig {
    #[serde(default)]
    pub mode: SimMode,
    /// Exactly one in llama-server mode; one or more in llama-swap mode.
    pub models: Vec<SimModel>,
    /// Parallel slots per loaded model (llama-server `-np`).
    #[serde(default = "default_slots")]
    pub slots: u32,
    /// Total context per model instance (`-c`); each slot gets `context / slots`.
    #[serde(default = "default_context")]
    pub context: u32,
    #[serde(default = "default_prefill_tps")]
    pub prefill_tokens_per_second: f64,
    #[serde(default = "default_decode_tps")]
    pub decode_tokens_per_second: f64,
    /// llama-server: `/health` answers 503 "Loading model" this long after
    /// start. llama-swap: the time to load a model on its first request.
    #[serde(default)]
    pub load_delay_ms: u64,
    /// Host prompt cache capacity in tokens (llama-server `--cache-ram`); 0
    /// disables it.
    #[serde(default = "default_cache_ram_tokens")]
    pub cache_ram_tokens: u64,
    #[serde(default)]
    pub gpu: SimGpu,
    /// llama-swap mode: models loaded at once; the least recently used one is
    /// unloaded beyond this.
    #[serde(default = "default_max_loaded_models")]
    pub max_loaded_models: u32,
    /// llama-swap mode: models loaded at start, without a load delay.
    #[serde(default)]
    pub preload: Vec<String>,
    /// llama-swap mode: behave like builds before mid-2026: `/v1/models`
    /// without `status` (clients must read `/running`), errors as a bare
    /// string `{"error":"..."}`, and 400 for an unknown model.
    #[serde(default)]
    pub llama_swap_legacy: bool,
    /// llama-swap mode: concurrent requests per model before 429.
    #[serde(default = "default_concurrency_limit")]
    pub concurrency_limit: u32,
    /// Reply length when a request sets no limit: a random model never emits
    /// EOS, so replies always run to their limit.
    #[serde(default = "default_max_tokens")]
    pub default_max_tokens: u32,
}

fn default_slots() -> u32 {
    4
}
fn default_context() -> u32 {
    4096
}
fn default_prefill_tps() -> f64 {
    2000.0
}
fn default_decode_tps() -> f64 {
    200.0
}
fn default_cache_ram_tokens() -> u64 {
    65536
}
fn default_max_loaded_models() -> u32 {
    1
}
fn default_concurrency_limit() -> u32 {
    10
}
fn default_max_tokens() -> u32 {
    16
}
fn default_size_bytes() -> u64 {
    4 << 30
}
fn default_embedding_dim() -> u32 {
    384
}

impl SimConfig {
    /// A llama-server with one chat model and default settings.
    pub fn llama_server(model_id: impl Into<String>) -> SimConfig {
        SimConfig::with_models(SimMode::LlamaServer, vec![SimModel::chat(model_id)])
    }

    /// A llama-swap with the given chat models and default settings.
    pub fn llama_swap<I, S>(model_ids: I) -> SimConfig
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let models = model_ids.into_iter().map(SimModel::chat).collect();
        SimConfig::with_models(SimMode::LlamaSwap, models)
    }

    fn with_models(mode: SimMode, models: Vec<SimModel>) -> SimConfig {
        SimConfig {
            mode,
            models,
            slots: default_slots(),
            context: default_context(),
            prefill_tokens_per_second: default_prefill_tps(),
            decode_tokens_per_second: default_decode_tps(),
            load_delay_ms: 0,
            cache_ram_tokens: default_cache_ram_tokens(),
            gpu: SimGpu::default(),
            max_loaded_models: default_max_loaded_models(),
            preload: Vec::new(),
            concurrency_limit: default_concurrency_limit(),
            llama_swap_legacy: false,
            default_max_tokens: default_max_tokens(),
        }
    }

    fn validate(&self) -> Result<(), SimError> {
        if self.models.is_empty() {
            return Err(SimError::NoModels);
        }
        if self.mode == SimMode::LlamaServer && self.models.len() != 1 {
            return Err(SimError::LlamaServerModelCount(self.models.len()));
        }
        let mut seen = std::collections::HashSet::new();
        for m in &self.models {
            if m.id.trim().is_empty() {
                return Err(SimError::EmptyModelId);
            }
            if !seen.insert(m.id.as_str()) {
                return Err(SimError::DuplicateModel(m.id.clone()));
            }
            if m.embedding && m.embedding_dim == 0 {
                return Err(SimError::ZeroEmbeddingDim(m.id.clone()));
            }
        }
        if self.slots == 0 {
            return Err(SimError::ZeroSlots);
        }
        if self.context < self.slots {
            return Err(SimError::ContextTooSmall { context: self.context, slots: self.slots });
        }
        for (name, value) in [
            ("prefill_tokens_per_second", self.prefill_tokens_per_second),
            ("decode_tokens_per_second", self.decode_tokens_per_second),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(SimError::InvalidRate { name, value });
            }
        }
        match self.mode {
            SimMode::LlamaServer => {
                if !self.preload.is_empty() {
                    return Err(SimError::PreloadWithoutSwap);
                }
            }
            SimMode::LlamaSwap | SimMode::LlamaServerRouter => {
                if self.max_loaded_models == 0 {
                    return Err(SimError::ZeroMaxLoadedModels);
                }
                if self.concurrency_limit == 0 {
                    return Err(SimError::ZeroConcurrencyLimit);
                }
                for id in &self.preload {
                    if !self.models.iter().any(|m| &m.id == id) {
                        return Err(SimError::UnknownPreload(id.clone()));
                    }
                }
                if self.preload.len() > self.max_loaded_models as usize {
                    return Err(SimError::TooManyPreloads {
                        preload: self.preload.len(),
                        max_loaded_models: self.max_loaded_models,
                    });
                }
            }
        }
        Ok(())
    }

    fn engine_params(&self) -> EngineParams {
        EngineParams {
            slots: self.slots as usize,
            n_ctx_slot: (self.context / self.slots) as usize,
            cache_ram_tokens: self.cache_ram_tokens,
        }
    }

    fn timing(&self) -> Timing {
        Timing {
            prefill_tokens_per_second: self.prefill_tokens_per_second,
            decode_tokens_per_second: self.decode_tokens_per_second,
        }
    }
}

/// One simulated model.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimModel {
    pub id: String,
    /// Serves `/v1/embeddings` instead of chat, like llama-server `--embeddings`.
    #[serde(default)]
    pub embedding: bool,
    /// What kind of server it is behind llama-swap: llama-server (text), or
    /// one that transcribes, speaks or draws.
    #[serde(default)]
    pub job: SimJob,
    /// Size of the weights; counts towards simulated GPU memory when loaded.
    #[serde(default = "default_size_bytes")]
    pub size_bytes: u64,
    #[serde(default = "default_embedding_dim")]
    pub embedding_dim: u32,
}

impl SimModel {
    /// A chat model with default size.
    pub fn chat(id: impl Into<String>) -> SimModel {
        SimModel {
            id: id.into(),
            embedding: false,
            job: SimJob::Text,
            size_bytes: default_size_bytes(),
            embedding_dim: default_embedding_dim(),
        }
    }

    /// A model of a server that does `job`, with default size.
    pub fn doing(id: impl Into<String>, job: SimJob) -> SimModel {
        SimModel { job, ..SimModel::chat(id) }
    }

    /// An embedding model with default size and dimension.
    pub fn embedding(id: impl Into<String>) -> SimModel {
        SimModel { embedding: true, ..SimModel::chat(id) }
    }
}

/// The server a model runs in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SimJob {
    /// llama-server: chat and completions, or embeddings.
    #[default]
    Text,
    /// whisper.cpp's server (`/v1/audio/transcriptions`).
    Transcription,
    /// A text-to-speech server (`/v1/audio/speech`).
    Speech,
    /// stable-diffusion.cpp's server (`/v1/images/generations`, `/edits`).
    Images,
}

/// The simulated GPU reported by `/sim/gpu`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimGpu {
    pub name: String,
    pub memory_total_bytes: u64,
    /// KV cache size per context token; with `context`, the memory a loaded
    /// model reserves beyond its weights.
    pub kv_bytes_per_token: u64,
}

impl Default for SimGpu {
    fn default() -> SimGpu {
        SimGpu { name: "Simulated GPU 24GB".to_owned(), memory_total_bytes: 24 << 30, kv_bytes_per_token: 131_072 }
    }
}

/// Totals across all models since start, for tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Inference requests admitted (chat, completions, embeddings).
    pub requests: u64,
    /// Prompt tokens of those requests, cached ones included.
    pub prompt_tokens: u64,
    /// Prompt tokens reused from a slot or the host prompt cache.
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

/// An invalid [`SimConfig`].
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("no models configured: add at least one entry to `models`")]
    NoModels,
    #[error(
        "llama-server mode serves exactly one model but {0} are configured: keep one, or set `mode = \"llama-swap\"`"
    )]
    LlamaServerModelCount(usize),
    #[error("a model has an empty `id`: give every model a name")]
    EmptyModelId,
    #[error("model `{0}` is configured twice: model ids must be unique")]
    DuplicateModel(String),
    #[error("embedding model `{0}` has `embedding_dim = 0`: set a positive dimension")]
    ZeroEmbeddingDim(String),
    #[error("`slots` is 0: set at least 1")]
    ZeroSlots,
    #[error("`context` ({context}) is smaller than `slots` ({slots}), leaving no context per slot: raise `context`")]
    ContextTooSmall { context: u32, slots: u32 },
    #[error("`{name}` is {value}: it must be a finite number above 0")]
    InvalidRate { name: &'static str, value: f64 },
    #[error("`preload` only applies in llama-swap mode: remove it or set `mode = \"llama-swap\"`")]
    PreloadWithoutSwap,
    #[error("`max_loaded_models` is 0: set at least 1")]
    ZeroMaxLoadedModels,
    #[error("`concurrency_limit` is 0: set at least 1")]
    ZeroConcurrencyLimit,
    #[error("`preload` names `{0}`, which is not in `models`")]
    UnknownPreload(String),
    #[error(
        "`preload` lists {preload} models but `max_loaded_models` is {max_loaded_models}: preload fewer or raise the limit"
    )]
    TooManyPreloads { preload: usize, max_loaded_models: u32 },
}

/// What serves inference requests.
#[derive(Debug)]
enum Backend {
    Server(Arc<Engine>),
    Swap(Arc<Swap>),
}

#[derive(Debug)]
struct Inner {
    config: SimConfig,
    started: tokio::time::Instant,
    /// Unix time of start, reported as `created` for models.
    created: u64,
    backend: Backend,
    stats: Arc<StatCounters>,
    /// Set through `POST /sim/gpu`.
    extra_used_bytes: AtomicU64,
    /// Set through `POST /sim/gpu`: the GPU cannot be read (NVML's "GPU is
    /// lost").
    gpu_lost: std::sync::atomic::AtomicBool,
    /// Ends streams and waits when [`Simulator::serve`] shuts down.
    shutdown: CancellationToken,
}

impl Inner {
    fn is_loading(&self) -> bool {
        self.config.mode == SimMode::LlamaServer
            && self.started.elapsed() < Duration::from_millis(self.config.load_delay_ms)
    }

    fn loaded_engines(&self) -> Vec<Arc<Engine>> {
        match &self.backend {
            Backend::Server(e) => vec![Arc::clone(e)],
            Backend::Swap(s) => s.loaded_engines(),
        }
    }
}

/// A simulated llama-server or llama-swap. Cheap to clone; clones share state.
#[derive(Clone, Debug)]
pub struct Simulator {
    inner: Arc<Inner>,
}

impl Simulator {
    /// Validates the configuration and builds the simulator. In llama-server
    /// mode the load delay starts counting now.
    pub fn new(config: SimConfig) -> Result<Simulator, SimError> {
        config.validate()?;
        let stats = Arc::new(StatCounters::default());
        let shutdown = CancellationToken::new();
        let factory =
            EngineFactory { params: config.engine_params(), timing: config.timing(), stats: Arc::clone(&stats) };
        let backend = match config.mode {
            SimMode::LlamaServer => {
                let model = config.models.first().cloned().ok_or(SimError::NoModels)?;
                Backend::Server(factory.build(model))
            }
            SimMode::LlamaSwap | SimMode::LlamaServerRouter => Backend::Swap(Swap::new(
                &config.models,
                &config.preload,
                factory,
                Duration::from_millis(config.load_delay_ms),
                config.max_loaded_models as usize,
                config.concurrency_limit,
                shutdown.clone(),
            )),
        };
        let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Ok(Simulator {
            inner: Arc::new(Inner {
                config,
                started: tokio::time::Instant::now(),
                created,
                backend,
                stats,
                extra_used_bytes: AtomicU64::new(0),
                gpu_lost: std::sync::atomic::AtomicBool::new(false),
                shutdown,
            }),
        })
    }

    /// Every route of the configured mode, plus the simulator's `/sim/gpu`.
    pub fn router(&self) -> axum::Router {
        api::router(Arc::clone(&self.inner))
    }

    /// Serves until `shutdown` is cancelled. Open streams end at that point,
    /// so shutdown does not wait for them; the simulator then refuses further
    /// inference work, even through other clones.
    pub async fn serve(self, listener: tokio::net::TcpListener, shutdown: CancellationToken) -> std::io::Result<()> {
        let internal = self.inner.shutdown.clone();
        axum::serve(listener, self.router())
            .with_graceful_shutdown(async move {
                shutdown.cancelled().await;
                internal.cancel();
            })
            .await
    }

    pub fn config(&self) -> &SimConfig {
        &self.inner.config
    }

    /// Totals since start, across all models.
    pub fn stats(&self) -> SimStats {
        self.inner.stats.snapshot()
    }
}

#[cfg(test)]
mod tests;
