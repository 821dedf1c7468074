//! The Inferyes agent: one per GPU host. It polls the host's inference
//! servers and GPUs, fronts the servers with a thin proxy that sees every
//! request, and keeps one stream to a controller with the node's status.

pub mod config;
pub mod metrics;
pub mod place;
pub mod poll;
pub mod probe;
pub mod proxy;
pub mod report;
pub mod residency;
pub mod shared;
pub mod slot;
pub mod slots;
pub mod state;
pub mod tier;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::Duration;

use anyhow::Context;
use inferyes_proto::v1::EndpointKind;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
// Background tasks end with `run`, however it ends.
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;

pub use config::Config;

use crate::probe::{BackendProbe, GpuReader, ProbeClient};
use crate::state::{AgentState, BackendHandle, Observations};

const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The proxy's port, for data planes; the admin port, for scrapers and
/// probes.
pub struct Listeners {
    pub proxy: TcpListener,
    pub admin: TcpListener,
}

impl Listeners {
    pub async fn bind(config: &Config) -> anyhow::Result<Listeners> {
        let proxy = TcpListener::bind(config.proxy_listen)
            .await
            .with_context(|| format!("cannot listen on proxy_listen {}", config.proxy_listen))?;
        let admin = TcpListener::bind(config.admin_listen)
            .await
            .with_context(|| format!("cannot listen on admin_listen {}", config.admin_listen))?;
        Ok(Listeners { proxy, admin })
    }
}

/// A data plane worker may send every request for this node as a stream of
/// one HTTP/2 connection: hyper's default of 200 at a time would queue long
/// generations behind each other.
const PROXY_HTTP2_STREAMS: u32 = 10_000;

/// Runs the agent until `shutdown` is cancelled.
pub async fn run(config: Config, listeners: Listeners, shutdown: CancellationToken) -> anyhow::Result<()> {
    let mut probes = configured_probes(&config);
    let (simulated, simulators) = start_simulators(&config, &shutdown).await?;
    probes.extend(simulated);
    let proxy_addr = listeners.proxy.local_addr()?;
    let tls_server = inferyes_net::tls::http_server(&config.tls).context("invalid TLS settings for the proxy")?;
    let join_token = join_token(&config)?;
    let backend_urls: Vec<String> = probes.iter().map(|p| p.url.clone()).collect();
    let scheme = if tls_server.is_some() { "https" } else { "http" };
    let state = agent_state(&config, probes, format!("{scheme}://{proxy_addr}"), join_token.is_some())?;
    let sweeper = sweep_slot_files(&config).await;

    let client = ProbeClient::new(PROBE_TIMEOUT);
    let gpus = GpuReader::detect(&config.gpu, backend_urls).await.context("GPU source unavailable")?;
    tracing::info!(source = gpus.source_name(), "reading GPUs");
    // The first report carries real readings, not an empty node.
    poll::poll_once(&state, &client, &gpus).await;
    let poller = AbortOnDropHandle::new(tokio::spawn(
        poll::run(Arc::clone(&state), client, gpus, config.poll_interval(), shutdown.clone())
            .instrument(tracing::info_span!("poller")),
    ));
    let (connection, _) = watch::channel(report::Connection::default());
    let (orders_tx, orders) = watch::channel(Vec::new());
    let (drains_tx, drains) = watch::channel(None);
    let reporter = AbortOnDropHandle::new(tokio::spawn(
        report::run(
            Arc::clone(&state),
            config.controllers.clone(),
            config.tls.clone(),
            join_token,
            config.min_report_interval(),
            report::Outlets { connection, orders: orders_tx, drains: drains_tx },
            shutdown.clone(),
        )
        .instrument(tracing::info_span!("reporter")),
    ));
    let placer = AbortOnDropHandle::new(tokio::spawn(
        place::run(Arc::clone(&state), orders, shutdown.clone()).instrument(tracing::info_span!("placement")),
    ));
    tracing::info!(node = %config.node_id, proxy = %proxy_addr, "agent running");

    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = metrics::Metrics::new(&mut registry);
    let connections_refused = metrics.connections_refused.clone();
    let slot_metrics = metrics.slots.clone();
    let scrape = Arc::new(proxy::Scrape { registry, metrics });
    let admission = inferyes_net::admit::Admission::new(config.connection_limits(), Some(config.prober()));
    let movers = SlotMovers::start(&config, &state, &admission, drains, slot_metrics, &shutdown)?;
    let keepers = spawn_keepers(&state, &shutdown);
    // One service per worker thread, each with its own pool of connections
    // to the backends.
    let services = (0..config.workers())
        .map(|_| {
            let service = proxy::Service::new(
                Arc::clone(&state),
                Arc::clone(&scrape),
                Arc::clone(&admission),
                Arc::clone(&movers.intake),
                Arc::clone(&movers.carrier),
            );
            move |peer| service.connection(peer)
        })
        .collect();
    let refused = Arc::new(move |why: inferyes_net::admit::Refused| {
        connections_refused.get_or_create(&metrics::ReasonLabels { reason: why.as_str() }).inc();
    });
    let options = inferyes_net::serve::Options { tls: tls_server, ..proxy_options(&config, admission, refused) };
    let admin_router = proxy::admin_router(Arc::clone(&state), scrape);
    let admin = AbortOnDropHandle::new(tokio::spawn(inferyes_net::serve::serve(
        listeners.admin,
        vec![move |_| hyper_util::service::TowerToHyperService::new(admin_router.clone())],
        inferyes_net::serve::Options::operators("agent-admin", inferyes_net::serve::OPERATORS_LIMITS, None),
        shutdown.clone(),
    )));

    let served = inferyes_net::serve::serve(listeners.proxy, services, options, shutdown.clone()).await;
    shutdown.cancel();
    admin.abort();
    let _ = poller.await;
    let _ = reporter.await;
    let _ = placer.await;
    let _ = movers.drainer.await;
    for keeper in keepers {
        let _ = keeper.await;
    }
    drop(sweeper);
    for simulator in simulators {
        let _ = simulator.await;
    }
    served.context("agent proxy failed")
}

/// The probes of the configured backends.
fn configured_probes(config: &Config) -> Vec<BackendProbe> {
    config
        .backends
        .iter()
        .map(|b| BackendProbe {
            id: b.id.clone(),
            url: b.url.clone(),
            kind: b.kind,
            weight: b.weight,
            endpoints: b.endpoints.iter().filter_map(|e| inferyes_proto::kinds::named(e)).collect(),
            api_key: b.api_key.clone(),
            declared_models: b.models.clone(),
            host_cache_tokens: b.host_cache_tokens,
            model_sizes: b.model_sizes.clone(),
            models_max: b.models_max(),
            slots: b.slots.clone(),
            slot_memo: Default::default(),
        })
        .collect()
}

/// Each simulated backend, listening and serving until `shutdown`, and its
/// probe.
async fn start_simulators(
    config: &Config,
    shutdown: &CancellationToken,
) -> anyhow::Result<(Vec<BackendProbe>, Vec<AbortOnDropHandle<std::io::Result<()>>>)> {
    let (mut probes, mut simulators) = (Vec::new(), Vec::new());
    for simulated in &config.simulated {
        let listener = TcpListener::bind(simulated.listen)
            .await
            .with_context(|| format!("simulated backend `{}`: cannot listen on {}", simulated.id, simulated.listen))?;
        let url = format!("http://{}", listener.local_addr()?);
        let simulator = inferyes_sim::Simulator::new(simulated.server.clone())
            .with_context(|| format!("simulated backend `{}`", simulated.id))?;
        let kind = match simulated.server.mode {
            // A simulated router is configured as a llama-server, as a real
            // one is: the probe finds it out from its `/props`.
            inferyes_sim::SimMode::LlamaServer | inferyes_sim::SimMode::LlamaServerRouter => {
                config::BackendKind::LlamaServer
            }
            inferyes_sim::SimMode::LlamaSwap => config::BackendKind::LlamaSwap,
        };
        tracing::info!(backend = %simulated.id, %url, "simulated backend listening");
        probes.push(BackendProbe {
            id: simulated.id.clone(),
            url,
            kind,
            weight: simulated.weight,
            endpoints: simulated_endpoints(&simulated.server.models),
            api_key: String::new(),
            declared_models: simulated.server.models.iter().map(|m| m.id.clone()).collect(),
            host_cache_tokens: simulated.server.cache_ram_tokens,
            model_sizes: simulated.server.models.iter().map(|m| (m.id.clone(), m.size_bytes)).collect(),
            // A router reports its model limit itself (`/props`); llama-swap
            // does not, so the simulator's is configured.
            models_max: if kind == config::BackendKind::LlamaSwap { simulated.server.max_loaded_models } else { 0 },
            slots: None,
            slot_memo: Default::default(),
        });
        let span = tracing::info_span!("simulator", backend = %simulated.id);
        simulators
            .push(AbortOnDropHandle::new(tokio::spawn(simulator.serve(listener, shutdown.clone()).instrument(span))));
    }
    Ok((probes, simulators))
}

/// The kinds of job a simulated backend's models do, each once.
fn simulated_endpoints(models: &[inferyes_sim::SimModel]) -> Vec<EndpointKind> {
    let mut endpoints = Vec::new();
    for model in models {
        let kinds: &[EndpointKind] = match model.job {
            inferyes_sim::SimJob::Text if model.embedding => &[EndpointKind::Embedding],
            inferyes_sim::SimJob::Text => {
                &[EndpointKind::Chat, EndpointKind::Completion, EndpointKind::Messages, EndpointKind::Responses]
            }
            inferyes_sim::SimJob::Transcription => &[EndpointKind::Transcription],
            inferyes_sim::SimJob::Speech => &[EndpointKind::Speech],
            inferyes_sim::SimJob::Images => &[EndpointKind::Images],
        };
        for kind in kinds {
            if !endpoints.contains(kind) {
                endpoints.push(*kind);
            }
        }
    }
    endpoints
}

/// The join token presented to controllers: of several (a rotation's),
/// the first. What data planes and other agents present is what the
/// controller issues this node once it joins.
fn join_token(config: &Config) -> anyhow::Result<Option<Arc<str>>> {
    let join_tokens = inferyes_proto::files::read_tokens(
        config.join_token.as_deref(),
        config.join_token_file.as_deref(),
        "join token",
    )?;
    let join_token: Option<Arc<str>> =
        join_tokens.as_ref().and_then(|tokens| tokens.first()).map(|t| Arc::from(t.as_str()));
    if join_token.is_none() {
        tracing::warn!("no join token: the proxy forwards anyone's requests to the backends");
    }
    Ok(join_token)
}

/// The agent's state before its first poll: its backends, none observed.
/// `listening`: the proxy's own URL, advertised unless another is
/// configured. `closed`: the proxy takes only presented credentials.
fn agent_state(
    config: &Config,
    probes: Vec<BackendProbe>,
    listening: String,
    closed: bool,
) -> anyhow::Result<Arc<AgentState>> {
    let proxy_url = if config.advertise_url.is_empty() { listening } else { config.advertise_url.clone() };
    Ok(Arc::new(AgentState {
        node_id: config.node_id.clone(),
        // 160 bits.
        instance: inferyes_proto::apikey::random_chars(32)?,
        hostname: config::hostname(),
        proxy_url,
        // `inferyes_net::serve` takes HTTP/1.1 and HTTP/2; what listens at
        // an advertised address may not.
        proxy_http2: config.advertise_url.is_empty(),
        started_unix_ms: inferyes_proto::unix_ms(),
        gpu_hour_price: config.gpu_hour_price,
        backends: probes
            .into_iter()
            .map(|probe| BackendHandle {
                url: inferyes_net::base_url::BaseUrl::new(&probe.url),
                authorization: bearer(&probe.api_key),
                labels: state::BackendLabels { backend: probe.id.clone() },
                in_flight: AtomicU32::new(0),
                finished: AtomicU64::new(0),
                log: inferyes_net::log::Gate::new(),
                unsupported: state::Shared::default(),
                restores_reused_nothing: AtomicU32::new(0),
                restore_failed_unix_ms: AtomicU64::new(0),
                restore_marks: Default::default(),
                tier: tier_of(config, &probe.id),
                probe,
            })
            .collect(),
        observations: state::Shared::new(Observations::default()),
        moves: state::Shared::default(),
        peers: state::Shared::default(),
        closed,
        issued: Default::default(),
        residency: state::Shared::new(residency::Residency::default()),
        changed: tokio::sync::Notify::new(),
        poll_now: tokio::sync::Notify::new(),
    }))
}

/// Slot files a stopped agent left behind hold conversations: gone, before
/// this returns. And while it runs, those its moves left over, by the task
/// returned.
async fn sweep_slot_files(config: &Config) -> AbortOnDropHandle<()> {
    let dirs: Arc<[std::path::PathBuf]> =
        config.backends.iter().filter_map(|b| b.slots.as_ref()).map(|s| s.dir.clone()).collect();
    let sweep = move |older_than| {
        let dirs = Arc::clone(&dirs);
        tokio::task::spawn_blocking(move || dirs.iter().for_each(|dir| slots::transfer::sweep(dir, older_than)))
    };
    let _ = sweep(Duration::ZERO).await;
    AbortOnDropHandle::new(tokio::spawn(async move {
        let mut every = tokio::time::interval(slots::transfer::LEFT_OVER_AFTER / 3);
        loop {
            every.tick().await;
            let _ = sweep(slots::transfer::LEFT_OVER_AFTER).await;
        }
    }))
}

/// What moves slots between agents: the proxy's hands for slots carried
/// out and taken in, and the task that empties a draining node.
struct SlotMovers {
    carrier: Arc<slots::transfer::Carrier>,
    intake: Arc<slots::transfer::Intake>,
    drainer: AbortOnDropHandle<()>,
}

impl SlotMovers {
    fn start(
        config: &Config,
        state: &Arc<AgentState>,
        admission: &Arc<inferyes_net::admit::Admission>,
        drains: watch::Receiver<Option<inferyes_proto::v1::DrainState>>,
        slot_metrics: metrics::SlotMetrics,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<SlotMovers> {
        let agent_tls = Arc::new(inferyes_net::tls::http_client(&config.tls).context("invalid TLS settings")?);
        let sender = Arc::new(slots::transfer::Sender {
            state: Arc::clone(state),
            moved: Default::default(),
            moving: Default::default(),
            client: ProbeClient::new(slots::transfer::SLOT_ACTION_TIMEOUT),
            pool: inferyes_net::pool::Pool::new(inferyes_net::pool::Settings {
                connect_timeout: Duration::from_secs(2),
                idle_timeout: Duration::from_secs(10),
                tls: Some(agent_tls),
                read_timeout: slots::transfer::SLOT_ACTION_TIMEOUT,
                idle_limits: inferyes_net::pool::IdleLimits::default(),
            }),
            max_slot_bytes: config.moves.max_slot_bytes,
        });
        let carrier = Arc::new(slots::transfer::Carrier {
            sender: Arc::clone(&sender),
            permits: Arc::new(tokio::sync::Semaphore::new(config.moves.max_incoming)),
            metrics: slot_metrics.clone(),
        });
        let drainer = AbortOnDropHandle::new(tokio::spawn(
            slots::drain::run(
                Arc::clone(state),
                sender,
                drains,
                config.moves.clone(),
                slot_metrics.clone(),
                shutdown.clone(),
            )
            .instrument(tracing::info_span!("drain")),
        ));
        let intake = Arc::new(slots::transfer::Intake {
            admission: Arc::clone(admission),
            state: Arc::clone(state),
            max_slot_bytes: config.moves.max_slot_bytes,
            min_free_bytes: config.moves.min_free_bytes,
            permits: tokio::sync::Semaphore::new(config.moves.max_incoming),
            arriving: Default::default(),
            client: ProbeClient::new(slots::transfer::SLOT_ACTION_TIMEOUT),
            metrics: slot_metrics,
            used: Default::default(),
        });
        Ok(SlotMovers { carrier, intake, drainer })
    }
}

/// How the proxy serves, but for TLS: on shutdown, requests in flight get
/// a grace period; then the rest are cut.
fn proxy_options(
    config: &Config,
    admission: Arc<inferyes_net::admit::Admission>,
    refused: Arc<dyn Fn(inferyes_net::admit::Refused) + Send + Sync>,
) -> inferyes_net::serve::Options {
    inferyes_net::serve::Options {
        name: "proxy",
        tls: None,
        http2_streams: PROXY_HTTP2_STREAMS,
        shutdown_grace: config.shutdown_grace(),
        past_grace: CancellationToken::new(),
        header_read_timeout: inferyes_net::serve::HEADER_READ_TIMEOUT,
        limit: inferyes_net::serve::ConnectionLimit {
            admission: Some(admission),
            refusal: proxy::connections_refusal(),
            refused: Some(refused),
        },
        max_requests_per_connection: 0,
        proxy_protocol: None,
    }
}

/// Each KV tier's keeper, until `shutdown`.
fn spawn_keepers(state: &Arc<AgentState>, shutdown: &CancellationToken) -> Vec<AbortOnDropHandle<()>> {
    (0..state.backends.len())
        .filter(|i| state.backends[*i].tier.is_some())
        .map(|i| {
            let span = tracing::info_span!("tier", backend = %state.backends[i].probe.id);
            AbortOnDropHandle::new(tokio::spawn(
                slots::keeper::run(Arc::clone(state), i, shutdown.clone()).instrument(span),
            ))
        })
        .collect()
}

/// The KV tier of backend `id`, where it has a slots directory and tiers
/// are on.
fn tier_of(config: &Config, id: &str) -> Option<tier::Tier> {
    let backend = config.backends.iter().find(|b| b.id == id)?;
    let slots = backend.slots.as_ref().filter(|_| config.tier.max_bytes > 0 && config.tier.max_entries > 0)?;
    let bounds = tier::Bounds { max_bytes: config.tier.max_bytes, max_entries: config.tier.max_entries };
    Some(tier::Tier::new(slots.dir.clone(), bounds, config.moves.min_free_bytes, config.moves.max_slot_bytes))
}

/// The `Authorization` value for a backend's API key (none without one):
/// marked sensitive, so it is never logged or indexed.
pub(crate) fn bearer(api_key: &str) -> Option<http::HeaderValue> {
    if api_key.is_empty() {
        return None;
    }
    inferyes_proto::bearer::header_value(api_key)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_backend_key_is_sent_as_a_sensitive_bearer_token() {
        let value = super::bearer("sk-local").expect("a key makes a value");
        assert_eq!(value, "Bearer sk-local");
        assert!(value.is_sensitive(), "never logged or indexed");
        assert_eq!(super::bearer(""), None, "no key, no header");
        assert_eq!(super::bearer("bad\nkey"), None, "a key that cannot be a header is not sent");
    }
}
