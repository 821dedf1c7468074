//! The Inferyes controller: keeps fleet state in etcd, builds routing
//! snapshots from it, and serves agents, data planes and operators.

pub mod activity;
pub mod allowances;
pub mod config;
pub mod dashboard;
pub mod fleet;
pub mod grpc;
pub mod history;
pub mod http;
pub mod ledger;
pub mod live;
pub mod metrics;
pub mod moves;
pub mod peers;
pub mod placement;
pub mod reconcile;
pub mod residency;
pub mod slot_shares;

pub mod snapshot;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use inferyes_proto::bearer::Accepted;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use config::Config;

/// Sockets bound by the caller, so tests can bind port 0.
pub struct Listeners {
    pub grpc: TcpListener,
    pub http: TcpListener,
}

impl Listeners {
    pub async fn bind(config: &Config) -> anyhow::Result<Listeners> {
        let grpc = TcpListener::bind(config.grpc_listen)
            .await
            .with_context(|| format!("cannot listen on grpc_listen {}", config.grpc_listen))?;
        let http = TcpListener::bind(config.http_listen)
            .await
            .with_context(|| format!("cannot listen on http_listen {}", config.http_listen))?;
        Ok(Listeners { grpc, http })
    }
}

/// Runs until `shutdown` is cancelled; every stream it serves ends then.
pub async fn run(config: Config, listeners: Listeners, shutdown: CancellationToken) -> anyhow::Result<()> {
    let tokens = Tokens::read(&config)?;
    warn_of_open_doors(&config, tokens.admin.is_some(), tokens.join.is_some());
    let keys = store::Keys::new(&config.etcd_prefix);
    let access = config.etcd_access()?;
    let Some(store) = store::EtcdStore::connect(&config.etcd_endpoints, keys, access, &shutdown)
        .await
        .context("cannot set up the etcd client")?
    else {
        return Ok(());
    };
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Arc::new(metrics::Metrics::new(&mut registry));
    metrics.max_nodes.set(i64::try_from(config.max_nodes).unwrap_or(i64::MAX));
    // Bounded: a reconciler that falls behind slows the agent streams
    // feeding it rather than growing a queue.
    let (live_tx, live_rx) = tokio::sync::mpsc::channel(4096);
    let (requests_tx, requests_rx) = tokio::sync::mpsc::channel(64);
    let (batches, _) = tokio::sync::broadcast::channel(reconcile::BATCHES_HELD);
    let (snapshot_tx, snapshots) = watch::channel(None);
    let (views_tx, views) = watch::channel(Arc::default());
    let parts = Parts {
        config: &config,
        store,
        snapshots,
        views,
        metrics,
        activity: Arc::default(),
        peers_following: Arc::default(),
        shutdown: shutdown.clone(),
    };

    let reconciler = reconcile::Reconciler {
        store: parts.store.clone(),
        tx: snapshot_tx,
        live: live_rx,
        requests: requests_rx,
        batches: batches.clone(),
        views: views_tx,
        peers_following: Arc::clone(&parts.peers_following),
        controller_id: config.controller_id.clone(),
        debounce: config.snapshot_debounce(),
        metrics: Arc::clone(&parts.metrics),
        shutdown: shutdown.clone(),
    };
    let mut tasks = vec![
        tokio::spawn(reconciler.run().instrument(tracing::info_span!("reconciler"))),
        tokio::spawn(parts.peers(live_tx.clone(), &tokens)?.run().instrument(tracing::info_span!("peers"))),
        tokio::spawn(sample_etcd_size(
            parts.store.clone(),
            Arc::clone(&parts.metrics),
            config.etcd_quota_bytes,
            shutdown.clone(),
        )),
    ];
    tasks.extend(parts.ledger_and_placement());

    // Credentials are issued to nodes where agents join with a token.
    let fleet_secret = tokens.join.is_some().then(|| Arc::new(store::FleetSecret::new(parts.store.clone())));
    let agents = parts.agents(tokens.join.clone(), live_tx, fleet_secret.clone());
    let fleet = grpc::FleetSvc {
        store: parts.store.clone(),
        snapshots: parts.snapshots.clone(),
        admin_token: tokens.admin.clone(),
        reader_tokens: config.reader_tokens()?,
        live_requests: requests_tx.clone(),
        views: parts.views.clone(),
        activity: Arc::clone(&parts.activity),
    };
    let routing = parts.routing(tokens, (batches, requests_tx), fleet_secret);
    let (grpc_limits, http_limits) = config.connection_limits();
    let refused = refusals_counted(&parts.metrics);
    let grpc_server =
        grpc_server(&config, listeners.grpc, grpc_limits, refused("grpc"), (agents, routing, fleet), &shutdown)?;

    let scrape = Arc::new(http::Scrape { registry, metrics: Arc::clone(&parts.metrics) });
    let dashboard = parts.dashboard(&scrape)?;
    tasks.push(tokio::spawn(dashboard::sample_pressure(dashboard.clone()).instrument(tracing::info_span!("pressure"))));
    tasks.push(tokio::spawn(
        dashboard::usage::sample(dashboard.clone(), parts.store.clone()).instrument(tracing::info_span!("usage_chart")),
    ));
    let router = http::router(parts.snapshots.clone(), scrape, dashboard);
    let options = inferyes_net::serve::Options::operators("controller-http", http_limits, refused("http"));
    let http_server = http_server(listeners.http, router, options, &shutdown);

    tracing::info!(id = %config.controller_id, "controller running");
    let (grpc_result, http_result) = tokio::join!(grpc_server, http_server);
    shutdown.cancel();
    for task in tasks {
        let _ = task.await;
    }
    grpc_result.context("gRPC server failed")?;
    http_result.context("HTTP server failed")?;
    Ok(())
}

/// The tokens the controller takes, read once at start.
struct Tokens {
    admin: Option<Accepted>,
    join: Option<Accepted>,
    dataplane: Option<Accepted>,
}

impl Tokens {
    fn read(config: &Config) -> anyhow::Result<Tokens> {
        Ok(Tokens { admin: config.admin_token()?, join: config.join_token()?, dataplane: config.dataplane_tokens()? })
    }
}

/// What the controller's parts are made of: each takes clones of what it
/// reads.
struct Parts<'a> {
    config: &'a Config,
    store: store::EtcdStore,
    snapshots: reconcile::SnapshotRx,
    views: reconcile::LiveViewRx,
    metrics: Arc<metrics::Metrics>,
    activity: Arc<activity::Activity>,
    /// Peers following this controller's nodes now (the reconciler's
    /// batches carry their form only then).
    peers_following: Arc<std::sync::atomic::AtomicUsize>,
    shutdown: CancellationToken,
}

impl Parts<'_> {
    /// Follows the other controllers' nodes, feeding `live`.
    fn peers(&self, live: tokio::sync::mpsc::Sender<live::LiveEvent>, tokens: &Tokens) -> anyhow::Result<peers::Peers> {
        Ok(peers::Peers {
            store: self.store.clone(),
            snapshots: self.snapshots.clone(),
            live,
            record: inferyes_proto::v1::ControllerRecord {
                controller_id: self.config.controller_id.clone(),
                grpc_url: self.config.grpc_url(),
                started_unix_ms: inferyes_proto::unix_ms(),
            },
            lease_ttl: self.config.lease_ttl(),
            tls: self.config.tls.clone(),
            // Following another controller is a RoutingService call.
            bearer: inferyes_proto::bearer::Bearer::new(
                tokens.dataplane.as_ref().and_then(inferyes_proto::bearer::Accepted::presented),
            )?,
            peer_credential: tokens
                .join
                .as_ref()
                .and_then(inferyes_proto::bearer::Accepted::presented)
                .map(|token| inferyes_proto::bearer::peer_credential(token).parse())
                .transpose()
                .context("a peer credential is hex")?,
            metrics: Arc::clone(&self.metrics),
            shutdown: self.shutdown.clone(),
        })
    }

    /// The usage ledger, and placement, which runs where it leads.
    fn ledger_and_placement(&self) -> [tokio::task::JoinHandle<()>; 2] {
        let config = self.config;
        let (leading_tx, leading) = watch::channel(None);
        let retention =
            ledger::Retention { rollup_days: config.usage_retention_days, raw_days: config.raw_usage_retention_days };
        let ledger =
            ledger::run(self.store.clone(), config.controller_id.clone(), retention, leading_tx, self.shutdown.clone());
        let placer = placement::leader::Placer {
            store: self.store.clone(),
            snapshots: self.snapshots.clone(),
            views: self.views.clone(),
            leading,
            controller_id: config.controller_id.clone(),
            settings: config.placement(),
            metrics: Arc::clone(&self.metrics),
            shutdown: self.shutdown.clone(),
        };
        [
            tokio::spawn(ledger.instrument(tracing::info_span!("ledger"))),
            tokio::spawn(placer.run().instrument(tracing::info_span!("placement"))),
        ]
    }

    /// The agents' service: their streams, feeding `live`.
    fn agents(
        &self,
        join_token: Option<Accepted>,
        live: tokio::sync::mpsc::Sender<live::LiveEvent>,
        fleet_secret: Option<Arc<store::FleetSecret>>,
    ) -> grpc::AgentSvc {
        let config = self.config;
        grpc::AgentSvc {
            store: self.store.clone(),
            snapshots: self.snapshots.clone(),
            controller_id: config.controller_id.clone(),
            lease_ttl: config.lease_ttl(),
            heartbeat_interval: config.heartbeat_interval(),
            min_write_interval: config.min_write_interval(),
            shutdown: self.shutdown.clone(),
            metrics: Arc::clone(&self.metrics),
            join_token,
            live,
            views: self.views.clone(),
            streams: Arc::default(),
            pacing: Arc::new(grpc::WritePacing::new(config.max_node_write_bytes_per_second)),
            seats: Arc::new(grpc::Seats::new(config.max_nodes)),
            fleet_secret,
        }
    }

    /// The data planes' (and peers') service: snapshots, live batches
    /// from `batches`, and `live_requests` for what a follower asks.
    fn routing(
        &self,
        tokens: Tokens,
        (batches, live_requests): (reconcile::Batches, tokio::sync::mpsc::Sender<reconcile::LiveRequest>),
        fleet_secret: Option<Arc<store::FleetSecret>>,
    ) -> grpc::RoutingSvc {
        let presented = tokens.join.as_ref().and_then(inferyes_proto::bearer::Accepted::presented);
        grpc::RoutingSvc {
            snapshots: self.snapshots.clone(),
            controller_id: self.config.controller_id.clone(),
            shutdown: self.shutdown.clone(),
            serve_after: tokio::time::Instant::now() + self.config.startup_grace(),
            activity: Arc::clone(&self.activity),
            allowances: Arc::default(),
            slot_shares: Arc::default(),
            store: self.store.clone(),
            proxy_key: presented.map(inferyes_proto::bearer::proxy_key).unwrap_or_default(),
            proxy_credential: presented.map(inferyes_proto::bearer::proxy_credential).unwrap_or_default(),
            fleet_secret,
            peer_credentials: tokens
                .join
                .as_ref()
                .map(|tokens| Accepted::new(tokens.tokens().map(inferyes_proto::bearer::peer_credential).collect())),
            dataplane_tokens: tokens.dataplane,
            batches,
            live_requests,
            peers_following: Arc::clone(&self.peers_following),
            metrics: Arc::clone(&self.metrics),
        }
    }

    fn dashboard(&self, scrape: &http::Scrape) -> anyhow::Result<dashboard::Dashboard> {
        let config = self.config;
        Ok(dashboard::Dashboard {
            controller_id: config.controller_id.clone(),
            snapshots: self.snapshots.clone(),
            views: self.views.clone(),
            activity: Arc::clone(&self.activity),
            pressure: Arc::default(),
            sampled: Arc::new(watch::channel(0).0),
            usage: Arc::default(),
            shutdown: self.shutdown.clone(),
            gate: config.dashboard_tokens()?.map(|tokens| Arc::new(dashboard::gate::Gate::new(tokens))),
            attempts: Arc::default(),
            trusted_proxies: config.trusted_proxies.clone().into(),
            refused: scrape.metrics.dashboard_refused.clone(),
        })
    }
}

/// Says at start each door left open: what anyone who reaches a port may
/// then do.
fn warn_of_open_doors(config: &Config, admin_token: bool, join_token: bool) {
    if join_token && !config.separate_dataplane_tokens() {
        tracing::warn!(
            "no dataplane_token_file: the agents' join token is the data planes' too, and reads snapshots \
             (keys' hashes, sessions, and the key every node's proxy credential derives from, so that any \
             agent can reach every node's proxy) and writes usage; give data planes a token of their own"
        );
    }
    if !admin_token {
        tracing::warn!("admin_auth = \"none\": anyone who reaches the gRPC port can change the fleet and its keys");
    }
    if config.dashboard_auth == config::TokenAuth::None {
        tracing::warn!(
            "dashboard_auth = \"none\": anyone who reaches the HTTP port sees the fleet, its sessions and keys' ids"
        );
    }
    if !join_token {
        tracing::warn!(
            "join_auth = \"none\": any agent that reaches the gRPC port can join the fleet, and anyone can \
             read its routing snapshots and write usage"
        );
    }
}

/// What counts each connection a port refused, by reason.
type Refusals = Option<Arc<dyn Fn(inferyes_net::admit::Refused) + Send + Sync>>;

/// Makes, for a port's name, what counts its refused connections.
fn refusals_counted(metrics: &Arc<metrics::Metrics>) -> impl Fn(&'static str) -> Refusals + use<> {
    let metrics = Arc::clone(metrics);
    move |port: &'static str| -> Refusals {
        let metrics = Arc::clone(&metrics);
        Some(Arc::new(move |why: inferyes_net::admit::Refused| {
            metrics.connections_refused.get_or_create(&metrics::RefusedLabels { port, reason: why.as_str() }).inc();
        }))
    }
}

/// The gRPC port, serving agents, data planes and operators until
/// `shutdown`: TLS where configured, keepalives, and connections taken
/// within `limits` (a peer vouched for once it proves a token).
fn grpc_server(
    config: &Config,
    listener: TcpListener,
    limits: inferyes_net::admit::Limits,
    refused: Refusals,
    (agents, routing, fleet): (grpc::AgentSvc, grpc::RoutingSvc, grpc::FleetSvc),
    shutdown: &CancellationToken,
) -> anyhow::Result<impl std::future::Future<Output = Result<(), tonic::transport::Error>> + use<>> {
    let admission = inferyes_net::admit::Admission::new(limits, None);
    let incoming = inferyes_net::listen::incoming(
        listener,
        Arc::clone(&admission),
        inferyes_net::serve::HEADER_READ_TIMEOUT,
        refused,
    );
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = config.tls.grpc_server()? {
        server = server.tls_config(tls).context("invalid TLS settings for the gRPC port")?;
        tracing::info!(mutual = config.tls.client_ca_file.is_some(), "gRPC over TLS");
    }
    Ok(server
        .http2_keepalive_interval(Some(Duration::from_secs(2)))
        .http2_keepalive_timeout(Some(Duration::from_secs(4)))
        .layer(inferyes_net::listen::Vouching::new(admission))
        .add_service(agents.svc())
        .add_service(routing.svc())
        .add_service(fleet.svc())
        .serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned()))
}

/// The HTTP port (dashboard, metrics, health) until `shutdown`, each
/// request carrying its peer: the dashboard counts wrong tokens per
/// address.
fn http_server(
    listener: TcpListener,
    router: axum::Router,
    options: inferyes_net::serve::Options,
    shutdown: &CancellationToken,
) -> impl std::future::Future<Output = std::io::Result<()>> + use<> {
    inferyes_net::serve::serve(
        listener,
        vec![move |peer: std::net::SocketAddr| {
            let router = tower::ServiceExt::map_request(router.clone(), move |mut request: axum::http::Request<_>| {
                request.extensions_mut().insert(axum::extract::ConnectInfo(peer));
                request
            });
            hyper_util::service::TowerToHyperService::new(router)
        }],
        options,
        shutdown.clone(),
    )
}

/// How often etcd's database size is read for the metrics.
const ETCD_SIZE_EVERY: Duration = Duration::from_secs(15);

/// Keeps the etcd size metrics current: what to alert on before the quota
/// stops every write (see docs/operations.md).
async fn sample_etcd_size(
    store: store::EtcdStore,
    metrics: Arc<metrics::Metrics>,
    quota: u64,
    shutdown: CancellationToken,
) {
    let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    metrics.etcd_quota_bytes.set(gauge(quota));
    let mut every = tokio::time::interval(ETCD_SIZE_EVERY);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = every.tick() => match store.db_size().await {
                Ok(size) => {
                    metrics.etcd_db_size_bytes.set(gauge(size.size));
                    metrics.etcd_db_size_in_use_bytes.set(gauge(size.in_use));
                    if size.quota > 0 {
                        metrics.etcd_quota_bytes.set(gauge(size.quota));
                    }
                }
                Err(error) => tracing::debug!(%error, "etcd status not read"),
            },
        }
    }
}
