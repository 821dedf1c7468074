use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use inferyes_agent::config::{BackendConfig, BackendKind, GpuConfig, GpuSourceConfig};
use inferyes_dataplane::SnapshotStore;
use inferyes_dataplane::snapshot::RoutingSnapshot;
use inferyes_proto::v1::fleet_service_client::FleetServiceClient;
use inferyes_sim::{SimConfig, Simulator};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// Lease TTL used in tests: etcd's minimum.
pub const LEASE_TTL: Duration = Duration::from_secs(2);
/// The test fleets' admin and join tokens: on, as by default.
pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789";
pub const JOIN_TOKEN: &str = "test-join-token-0123456789";
pub const VIEWER_TOKEN: &str = "test-viewer-token-0123456789";
pub const DATAPLANE_TOKEN: &str = "test-dataplane-token-0123456789";

async fn local_listener(addr: Option<SocketAddr>) -> TcpListener {
    let addr = addr.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    TcpListener::bind(addr).await.unwrap_or_else(|e| panic!("bind {addr}: {e}"))
}

/// Polls `check` until it holds, failing the test with `what` after
/// `timeout`. For conditions that have no event to await (another
/// process's state seen through its API).
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out after {timeout:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A simulated llama-server (or llama-swap) on its own port.
pub struct SimHandle {
    pub url: String,
    pub sim: Simulator,
    token: CancellationToken,
    task: JoinHandle<std::io::Result<()>>,
}

impl SimHandle {
    pub async fn start(config: SimConfig) -> SimHandle {
        let listener = local_listener(None).await;
        let url = format!("http://{}", listener.local_addr().expect("bound"));
        let sim = Simulator::new(config).expect("valid simulator config");
        let token = CancellationToken::new();
        let task = tokio::spawn(sim.clone().serve(listener, token.clone()));
        SimHandle { url, sim, token, task }
    }

    pub async fn stop(self) {
        self.token.cancel();
        let _ = self.task.await;
    }
}

pub struct ControllerHandle {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    token: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
}

impl ControllerHandle {
    pub async fn start(etcd: &str, id: &str) -> ControllerHandle {
        Self::start_on(etcd, id, None).await
    }

    /// Starts a controller, on a given gRPC address when restarting one.
    pub async fn start_on(etcd: &str, id: &str, grpc_addr: Option<SocketAddr>) -> ControllerHandle {
        Self::start_with(etcd, id, grpc_addr, |_| {}).await
    }

    pub async fn start_with(
        etcd: &str,
        id: &str,
        grpc_addr: Option<SocketAddr>,
        tweak: impl FnOnce(&mut inferyes_controller::Config),
    ) -> ControllerHandle {
        // Below the ephemeral range, so a restart at the same address finds
        // it free (`crate::ports`).
        let grpc_addr = grpc_addr.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], crate::ports::stable_port())));
        let grpc = local_listener(Some(grpc_addr)).await;
        let http = local_listener(None).await;
        let grpc_addr = grpc.local_addr().expect("bound");
        let http_addr = http.local_addr().expect("bound");
        let mut config = inferyes_controller::Config {
            controller_id: id.to_string(),
            etcd_endpoints: vec![etcd.to_string()],
            grpc_listen: grpc_addr,
            http_listen: http_addr,
            lease_ttl_ms: u64::try_from(LEASE_TTL.as_millis()).expect("small"),
            heartbeat_interval_ms: 300,
            min_write_interval_ms: 20,
            snapshot_debounce_ms: 5,
            // Tests start fleets from scratch; the restart test sets it.
            startup_grace_ms: 0,
            admin_token: Some(ADMIN_TOKEN.into()),
            join_token: Some(JOIN_TOKEN.into()),
            viewer_token: Some(VIEWER_TOKEN.into()),
            dataplane_token: Some(DATAPLANE_TOKEN.into()),
            ..Default::default()
        };
        tweak(&mut config);
        config.validate().expect("valid controller config");
        let token = CancellationToken::new();
        let listeners = inferyes_controller::Listeners { grpc, http };
        let task = tokio::spawn(inferyes_controller::run(config, listeners, token.clone()));
        let ready = format!("http://{http_addr}/readyz");
        let http = crate::HttpClient::default();
        eventually("the controller read the fleet from etcd", Duration::from_secs(10), || {
            let (http, ready) = (http.clone(), ready.clone());
            async move { http.get(&ready).await.status == http::StatusCode::OK }
        })
        .await;
        ControllerHandle { grpc_addr, http_addr, token, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.grpc_addr)
    }

    /// The gRPC address for clients, when the controller serves TLS.
    pub fn https_url(&self) -> String {
        format!("https://{}", self.grpc_addr)
    }

    /// A FleetService client holding the admin token.
    pub async fn fleet(&self) -> inferyes_ctl::AdminClient {
        let channel = Channel::from_shared(self.url()).expect("url").connect().await.expect("controller reachable");
        inferyes_ctl::admin_client(channel, Some(ADMIN_TOKEN)).expect("admin client")
    }

    /// A RoutingService client presenting `token` (a data plane's: the
    /// fleet's join token).
    pub async fn routing(&self, token: Option<&str>) -> inferyes_dataplane::RoutingClient {
        let channel = Channel::from_shared(self.url()).expect("url").connect().await.expect("controller reachable");
        routing_client(channel, token)
    }

    /// A FleetService client without the admin token.
    pub async fn fleet_anonymous(&self) -> FleetServiceClient<Channel> {
        FleetServiceClient::connect(self.url()).await.expect("controller reachable")
    }

    /// Graceful stop: every stream it serves ends.
    pub async fn stop(self) {
        self.token.cancel();
        let result = tokio::time::timeout(Duration::from_secs(10), self.task).await;
        let outcome = result.expect("controller stops within 10s").expect("controller task");
        outcome.expect("controller exits cleanly");
    }
}

/// A RoutingService client on `channel` presenting `token`.
pub fn routing_client(channel: Channel, token: Option<&str>) -> inferyes_dataplane::RoutingClient {
    let bearer = inferyes_proto::bearer::Bearer::new(token).expect("a token");
    inferyes_dataplane::Controllers { addresses: Vec::new(), tls: Default::default(), bearer }.client(channel)
}

/// The `Authorization` a data plane sends the agent of `node_id`: what the
/// fleet's controllers issued it, from the fleet key they keep in `etcd`
/// (under the default prefix); once the node's record says its agent
/// holds it.
pub async fn agent_authorization(etcd: &crate::Etcd, node_id: &str) -> String {
    use prost::Message as _;
    let mut client = etcd.client().await.expect("etcd");
    let node = format!("/inferyes/v1/nodes/{node_id}");
    // The instance the record's agent holds it with, once it holds it.
    let holds = |value: &[u8]| {
        let record = inferyes_proto::v1::NodeRecord::decode(value).ok()?;
        record.status.filter(|s| !s.awaiting_credential).map(|_| record.instance_digest)
    };
    let found = client.get(node.as_str(), None).await.expect("the node's record read");
    let instance = match found.kvs().first().and_then(|kv| holds(kv.value())) {
        Some(instance) => instance,
        None => {
            let from = found.header().map_or(0, |h| h.revision()) + 1;
            let options = etcd_client::WatchOptions::new().with_start_revision(from);
            let mut changes = client.watch(node.as_str(), Some(options)).await.expect("a watch");
            let issued = async {
                loop {
                    let changes = changes.message().await.expect("the watch").expect("the watch goes on");
                    if let Some(instance) =
                        changes.events().iter().filter_map(|e| e.kv()).find_map(|kv| holds(kv.value()))
                    {
                        return instance;
                    }
                }
            };
            tokio::time::timeout(Duration::from_secs(15), issued).await.expect("the node's credential issued in 15 s")
        }
    };
    format!("Bearer {}", fleet_key(etcd).await.proxy_credential(node_id, &instance))
}

/// The fleet key the fleet's controllers keep in `etcd`, under the default
/// prefix: there once an agent has joined or a data plane subscribed.
pub async fn fleet_key(etcd: &crate::Etcd) -> inferyes_proto::bearer::FleetKey {
    let mut client = etcd.client().await.expect("etcd");
    let found = client.get("/inferyes/v1/secrets/fleet-key", None).await.expect("the fleet key read");
    let secret = found.kvs().first().expect("a fleet key: an agent has joined").value();
    inferyes_proto::bearer::FleetKey::new(secret).expect("a controller's fleet key")
}

pub struct AgentHandle {
    pub node_id: String,
    pub proxy_addr: SocketAddr,
    /// Where its `/metrics` is.
    pub admin_addr: SocketAddr,
    token: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
}

/// A llama-server backend `main` at `url`, declaring `models` (none: the
/// agent reads them from the server).
pub fn llama_server(url: &str, models: &[&str]) -> BackendConfig {
    BackendConfig {
        id: "main".into(),
        url: url.into(),
        kind: BackendKind::LlamaServer,
        weight: 1,
        endpoints: Vec::new(),
        models: models.iter().map(|m| (*m).to_string()).collect(),
        model_sizes: std::collections::BTreeMap::new(),
        host_cache_tokens: 0,
        models_max: None,
        api_key: String::new(),
        api_key_file: None,
        api_key_env: None,
        slots: None,
    }
}

/// The agent's backend configuration for simulated backends, as an
/// operator would write it.
pub fn sim_backends(backends: &[(&str, &SimHandle)]) -> Vec<BackendConfig> {
    backends
        .iter()
        .map(|(id, sim)| BackendConfig {
            id: (*id).to_string(),
            kind: match sim.sim.config().mode {
                // A router is found out from what it says, as in production.
                inferyes_sim::SimMode::LlamaServer | inferyes_sim::SimMode::LlamaServerRouter => {
                    BackendKind::LlamaServer
                }
                inferyes_sim::SimMode::LlamaSwap => BackendKind::LlamaSwap,
            },
            models: sim.sim.config().models.iter().map(|m| m.id.clone()).collect(),
            // What an operator declares for llama-swap, which says none.
            model_sizes: sim.sim.config().models.iter().map(|m| (m.id.clone(), m.size_bytes)).collect(),
            host_cache_tokens: sim.sim.config().cache_ram_tokens,
            // What an operator declares for a llama-swap: how many it runs.
            models_max: Some(sim.sim.config().max_loaded_models),
            ..llama_server(&sim.url, &[])
        })
        .collect()
}

impl AgentHandle {
    /// An agent fronting the given simulated backends, reading their GPUs.
    pub async fn start(node_id: &str, controllers: &[String], backends: &[(&str, &SimHandle)]) -> AgentHandle {
        Self::start_with(node_id, controllers, GpuSourceConfig::Simulated, sim_backends(backends)).await
    }

    /// An agent fronting any backends.
    pub async fn start_with(
        node_id: &str,
        controllers: &[String],
        gpu: GpuSourceConfig,
        backends: Vec<BackendConfig>,
    ) -> AgentHandle {
        Self::start_tweaked(node_id, controllers, gpu, backends, |_| {}).await
    }

    /// An agent fronting any backends, its configuration adjusted.
    pub async fn start_tweaked(
        node_id: &str,
        controllers: &[String],
        gpu: GpuSourceConfig,
        backends: Vec<BackendConfig>,
        tweak: impl FnOnce(&mut inferyes_agent::Config),
    ) -> AgentHandle {
        let proxy = local_listener(None).await;
        let proxy_addr = proxy.local_addr().expect("bound");
        let mut config = inferyes_agent::Config {
            node_id: node_id.to_string(),
            controllers: controllers.to_vec(),
            proxy_listen: proxy_addr,
            poll_interval_ms: 200,
            min_report_interval_ms: 10,
            gpu: GpuConfig { source: gpu, declared: Vec::new() },
            backends,
            join_token: Some(JOIN_TOKEN.into()),
            ..Default::default()
        };
        tweak(&mut config);
        config.validate().expect("valid agent config");
        let token = CancellationToken::new();
        let admin = local_listener(None).await;
        let admin_addr = admin.local_addr().expect("bound");
        let listeners = inferyes_agent::Listeners { proxy, admin };
        let task = tokio::spawn(inferyes_agent::run(config, listeners, token.clone()));
        AgentHandle { node_id: node_id.to_string(), proxy_addr, admin_addr, token, task }
    }

    /// Kills the agent as a crash would: its tasks are dropped mid-flight,
    /// its sockets close, nothing is said to the controller.
    pub fn kill(self) {
        self.task.abort();
        // Spawned sub-tasks (poller, reporter, proxy connections) end with
        // the token; the reporter's stream breaks when they do.
        self.token.cancel();
    }

    pub async fn stop(self) {
        self.stop_within(Duration::from_secs(10)).await;
    }

    /// Stops the agent as SIGTERM would; whether it ended within `limit`.
    pub async fn stop_within(self, limit: Duration) -> bool {
        self.token.cancel();
        tokio::time::timeout(limit, self.task).await.is_ok()
    }
}

pub struct DataplaneHandle {
    pub url: String,
    /// Where its `/metrics` is.
    pub admin_url: String,
    pub store: Arc<SnapshotStore>,
    token: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
}

impl DataplaneHandle {
    pub async fn start(controllers: &[String]) -> DataplaneHandle {
        Self::start_with(controllers, |_| {}).await
    }

    pub async fn start_with(
        controllers: &[String],
        tweak: impl FnOnce(&mut inferyes_dataplane::Config),
    ) -> DataplaneHandle {
        let listener = local_listener(None).await;
        let url = format!("http://{}", listener.local_addr().expect("bound"));
        let mut config = inferyes_dataplane::Config {
            controllers: controllers.to_vec(),
            dataplane_id: "test-dataplane".into(),
            // Most tests are about routing; the auth tests turn keys on.
            auth: inferyes_dataplane::auth::AuthMode::None,
            dataplane_token: Some(DATAPLANE_TOKEN.into()),
            ..Default::default()
        };
        tweak(&mut config);
        config.validate().expect("valid data plane config");
        let store = Arc::new(SnapshotStore::default());
        let token = CancellationToken::new();
        let admin = local_listener(None).await;
        let admin_url = format!("http://{}", admin.local_addr().expect("bound"));
        let listeners = inferyes_dataplane::Listeners { public: listener, admin };
        let task = tokio::spawn(inferyes_dataplane::run(config, listeners, Arc::clone(&store), token.clone()));
        DataplaneHandle { url, admin_url, store, token, task }
    }

    /// Waits, on snapshot installs, until `check` holds for the current one.
    pub async fn wait_for(&self, what: &str, timeout: Duration, check: impl Fn(&RoutingSnapshot) -> bool) {
        let mut versions = self.store.versions();
        let wait = async {
            loop {
                if self.store.current().is_some_and(|s| check(&s)) {
                    return;
                }
                if versions.changed().await.is_err() {
                    return;
                }
            }
        };
        if tokio::time::timeout(timeout, wait).await.is_err() {
            panic!("timed out after {timeout:?} waiting for the data plane to see: {what}");
        }
    }

    /// Starts watching every snapshot the data plane installs; the watch
    /// reports the fewest nodes any of them had, and checks that versions
    /// never went back.
    pub fn watch_snapshots(&self) -> SnapshotWatch {
        let store = Arc::clone(&self.store);
        let mut versions = store.versions();
        let done = CancellationToken::new();
        let watching = done.clone();
        let task = tokio::spawn(async move {
            let (mut fewest, mut last) = (usize::MAX, 0u64);
            loop {
                tokio::select! {
                    () = watching.cancelled() => return fewest,
                    changed = versions.changed() => if changed.is_err() { return fewest },
                }
                if let Some(snapshot) = store.current() {
                    fewest = fewest.min(snapshot.nodes().len());
                    assert!(snapshot.version() >= last, "snapshot version went back");
                    last = snapshot.version();
                }
            }
        });
        SnapshotWatch { done, task }
    }

    /// Waits until the data plane routes over exactly these nodes.
    pub async fn wait_for_nodes(&self, nodes: &[&str]) {
        let mut expected: Vec<&str> = nodes.to_vec();
        expected.sort_unstable();
        self.wait_for(&format!("nodes {expected:?}"), Duration::from_secs(15), |s| {
            let mut ids: Vec<&str> = s.nodes().iter().map(|n| n.id.as_ref()).collect();
            ids.sort_unstable();
            ids == expected
                && s.nodes().iter().all(|n| n.backends.iter().all(|b| b.health == inferyes_proto::v1::Health::Ready))
        })
        .await;
    }

    pub async fn stop(self) {
        self.token.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.task).await;
    }

    /// Kills the data plane as a crash would: nothing is flushed, its
    /// background tasks end with it.
    pub fn kill(self) {
        self.task.abort();
    }

    /// Starts a shutdown (as SIGTERM does) without waiting for it.
    pub fn begin_shutdown(&self) {
        self.token.cancel();
    }

    /// Waits for the data plane to exit; how long it took.
    pub async fn exited(self) -> Duration {
        let started = tokio::time::Instant::now();
        let result = tokio::time::timeout(Duration::from_secs(30), self.task).await;
        result.expect("the data plane exits").expect("data plane task").expect("clean exit");
        started.elapsed()
    }
}

pub struct SnapshotWatch {
    done: CancellationToken,
    task: JoinHandle<usize>,
}

impl SnapshotWatch {
    /// The fewest nodes any installed snapshot had since the watch began.
    pub async fn fewest_nodes(self) -> usize {
        self.done.cancel();
        self.task.await.expect("snapshot watch")
    }
}
