//! The Inferyes data plane: a stateless OpenAI-compatible gateway. It holds
//! the latest routing snapshot in memory, picks a node per request, and
//! streams the answer through.

pub mod allowance;
pub mod auth;
pub mod config;
pub mod error;
pub mod http;
pub mod metrics;
pub mod queue;
pub mod report;
pub mod routing;
pub mod shares;
pub mod slot_shares;
pub mod snapshot;
pub mod targets;
pub mod turns;
pub mod usage;
pub mod waiting;

use std::sync::Arc;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
// Background tasks end with `run`, however it ends (a dropped `run` is a
// crashed data plane, in tests).
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;

pub use config::Config;
pub use snapshot::SnapshotStore;

/// A client of a controller's `RoutingService`, sending the fleet's join
/// token with every call.
pub type RoutingClient = inferyes_proto::v1::routing_service_client::RoutingServiceClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, inferyes_proto::bearer::Bearer>,
>;

/// How this data plane reaches its controllers.
#[derive(Clone)]
pub struct Controllers {
    /// gRPC addresses, tried in turn.
    pub addresses: Vec<String>,
    pub tls: inferyes_proto::tls::Tls,
    /// The fleet's join token, sent with every call.
    pub bearer: inferyes_proto::bearer::Bearer,
}

impl Controllers {
    /// The endpoint of the controller at `address`, to configure and connect.
    pub fn endpoint(&self, address: &str) -> anyhow::Result<tonic::transport::Endpoint> {
        inferyes_proto::tls::grpc_endpoint(address, &self.tls)
    }

    /// The endpoint of the snapshot stream from the controller at `address`.
    pub fn stream_endpoint(&self, address: &str) -> anyhow::Result<tonic::transport::Endpoint> {
        inferyes_proto::tls::grpc_stream_endpoint(address, &self.tls)
    }

    pub fn client(&self, channel: tonic::transport::Channel) -> RoutingClient {
        inferyes_proto::v1::routing_service_client::RoutingServiceClient::with_interceptor(channel, self.bearer.clone())
    }
}

/// Where the data plane listens: `/v1/*` for clients, and `/metrics` with
/// health on an admin port of its own, so that what the metrics tell (node
/// ids, models, refusals) is not the public's.
pub struct Listeners {
    pub public: TcpListener,
    pub admin: TcpListener,
}

/// Runs until `shutdown` is cancelled. The caller binds the listeners
/// (tests bind port 0) and may pass in the store to watch snapshot versions.
pub async fn run(
    config: Config,
    Listeners { public: listener, admin }: Listeners,
    snapshots: Arc<SnapshotStore>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let dataplane_token = config.dataplane_token()?;
    if dataplane_token.is_none() {
        tracing::warn!("no data plane token: controllers must be open to any data plane");
    }
    let controllers = Controllers {
        addresses: config.controllers.clone(),
        tls: config.tls.clone(),
        bearer: inferyes_proto::bearer::Bearer::new(dataplane_token.as_deref())?,
    };
    let subscription = AbortOnDropHandle::new(tokio::spawn(
        snapshot::subscribe(Arc::clone(&snapshots), controllers.clone(), config.dataplane_id.clone(), shutdown.clone())
            .instrument(tracing::info_span!("snapshots")),
    ));
    let (decisions, decision_rx) = report::DecisionLog::new();
    let hard_stop = CancellationToken::new();
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Arc::new(metrics::Metrics::new(&mut registry));
    let forwarder_settings = http::ForwarderSettings {
        connect_timeout: config.connect_timeout(),
        header_timeout: config.response_header_timeout(),
        read_timeout: config.read_timeout(),
        http2: config.agent_protocol == config::AgentProtocol::Http2,
    };
    let client_tls = inferyes_net::tls::http_client(&config.tls)?;
    // One budget for every worker: the memory is the process's.
    let budget = http::Budget::new(config.max_buffered_bytes);
    let forwarder =
        || http::Forwarder::new(&forwarder_settings, client_tls.clone(), hard_stop.clone(), Arc::clone(&budget));
    let queue = config.queue().map(|limits| Arc::new(queue::Queue::new(limits, &snapshots, Arc::clone(&metrics))));
    let tickets: Arc<std::sync::atomic::AtomicU64> = Arc::default();
    let freed = Arc::clone(snapshots.node_states().freed());
    let state = http::AppState {
        snapshots,
        forwarder: forwarder(),
        metrics,
        registry: Arc::new(registry),
        max_body_bytes: config.max_body_bytes,
        request_body_timeout: config.request_body_timeout(),
        mode: config.routing_mode,
        carry: config.carry,
        tickets,
        queue,
        decisions,
        auth: Arc::new(auth::Auth::new(config.auth, config.auth_failures_per_minute)),
        trusted_proxies: config.trusted_proxies.clone().into(),
        ledger: usage::Ledger::new(&config.dataplane_id, config.usage_records),
        shares: {
            let (key, tenant) = config.shares();
            shares::Shares::new(key, tenant)
        },
        allowances: Arc::default(),
        slot_shares: slot_shares::SlotShares::new(freed),
    };
    // Cancelled once no request can record usage any more: the ledger then
    // flushes what is left and ends; reports end once it has.
    let drained = CancellationToken::new();
    let flushed = CancellationToken::new();
    let reporter = AbortOnDropHandle::new(tokio::spawn(
        report::Reporter {
            log: Arc::clone(&state.decisions),
            decisions: decision_rx,
            snapshots: Arc::clone(&state.snapshots),
            queue: state.queue.clone(),
            allowances: Arc::clone(&state.allowances),
            slot_shares: Arc::clone(&state.slot_shares),
            shares: Arc::clone(&state.shares),
            ledger: Arc::clone(&state.ledger),
            controllers: controllers.clone(),
            dataplane_id: config.dataplane_id.clone(),
            done: flushed.clone(),
        }
        .run()
        .instrument(tracing::info_span!("report")),
    ));
    let ledger = AbortOnDropHandle::new(tokio::spawn(
        usage::run(Arc::clone(&state.ledger), controllers, drained.clone()).instrument(tracing::info_span!("usage")),
    ));
    // Lets requests out until the grace period of a shutdown is over:
    // those waiting at a shutdown still go to nodes meanwhile.
    let _dispatcher = state.queue.as_ref().map(|queue| {
        let stop = hard_stop.clone();
        let run = queue::run(Arc::clone(queue), Arc::clone(&state.snapshots), Arc::clone(&state.tickets), stop);
        AbortOnDropHandle::new(tokio::spawn(run.instrument(tracing::info_span!("queue"))))
    });
    if config.trusted_proxies.iter().any(inferyes_net::forwarded::Cidr::is_everything) {
        tracing::warn!(
            "trusted_proxies holds a /0: any client can name its own address in X-Forwarded-For, and so escape \
             its failed key checks; list only the proxies in front"
        );
    }
    if config.auth == auth::AuthMode::None {
        tracing::warn!("auth = \"none\": the API is open to anyone who can reach it");
    }
    // One gateway per worker thread, each with its own pool of connections
    // to agents (a pooled connection is driven by the thread that opened it).
    let mut gateways = vec![http::Gateway::new(state.clone())];
    for _ in 1..config.workers() {
        gateways.push(http::Gateway::new(http::AppState { forwarder: forwarder(), ..state.clone() }));
    }
    tracing::info!(listen = %listener.local_addr()?, id = %config.dataplane_id, workers = gateways.len(), "data plane running");
    let connections_refused = state.metrics.connections_refused.clone();
    // On shutdown: stop accepting, let requests in flight finish, but not
    // for longer than the grace period; then end the streams still running
    // (with an error event) and give their connections a moment to close.
    let options = inferyes_net::serve::Options {
        name: "dataplane",
        tls: None,
        http2_streams: inferyes_net::serve::DEFAULT_HTTP2_STREAMS,
        shutdown_grace: config.shutdown_grace(),
        past_grace: hard_stop,
        header_read_timeout: inferyes_net::serve::HEADER_READ_TIMEOUT,
        limit: inferyes_net::serve::ConnectionLimit {
            admission: Some(connection_admission(&config, Arc::clone(&state.trusted_proxies))),
            refusal: error::ApiError::overloaded("connections").http1_response(),
            refused: Some(Arc::new(move |why: inferyes_net::admit::Refused| {
                connections_refused.get_or_create(&metrics::ReasonLabels { reason: why.as_str() }).inc();
            })),
        },
        max_requests_per_connection: config.max_requests_per_connection,
        proxy_protocol: config.proxy_protocol.then(|| trusted(Arc::clone(&state.trusted_proxies))),
    };
    let admin_router = http::admin_router(Arc::new(state.clone()));
    let admin = AbortOnDropHandle::new(tokio::spawn(inferyes_net::serve::serve(
        admin,
        vec![move |_| hyper_util::service::TowerToHyperService::new(admin_router.clone())],
        inferyes_net::serve::Options::operators("dataplane-admin", inferyes_net::serve::OPERATORS_LIMITS, None),
        shutdown.clone(),
    )));
    let connections = gateways.into_iter().map(|gateway| move |peer| gateway.connection(peer)).collect();
    let served = inferyes_net::serve::serve(listener, connections, options, shutdown.clone()).await;
    shutdown.cancel();
    drained.cancel();
    let _ = ledger.await;
    flushed.cancel();
    let _ = subscription.await;
    let _ = reporter.await;
    admin.abort();
    served.context("HTTP server failed")
}

/// Which client connections the public listener takes: a share per client
/// address, none for the trusted proxies in front (their connections carry
/// every client's requests).
fn connection_admission(
    config: &Config,
    proxies: Arc<[inferyes_net::forwarded::Cidr]>,
) -> Arc<inferyes_net::admit::Admission> {
    let known = trusted(proxies);
    let limits = inferyes_net::admit::Limits {
        max: config.max_connections,
        per_peer: config.max_connections_per_client,
        strangers: 0,
        prove_within: None,
    };
    inferyes_net::admit::Admission::new(limits, Some(known))
}

/// Whether an address is one of the trusted proxies'.
fn trusted(proxies: Arc<[inferyes_net::forwarded::Cidr]>) -> inferyes_net::admit::KnownPeers {
    Arc::new(move |address| proxies.iter().any(|cidr| cidr.contains(address.to_canonical())))
}
