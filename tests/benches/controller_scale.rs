//! Controller scale: 1,000 agents reporting once a second against one
//! controller and a real etcd, with four data planes subscribed.
//!
//! ```sh
//! cargo bench -p inferyes-tests --bench controller_scale
//! AGENTS=2000 CHURN=0.3 SECONDS=30 cargo bench -p inferyes-tests --bench controller_scale
//! # Only the agents, joined to a fleet running elsewhere, for SECONDS:
//! CONTROLLER=http://127.0.0.1:7070 JOIN_TOKEN=... cargo bench -p inferyes-tests --bench controller_scale
//! ```
//!
//! The agents are light: each is one real `AgentService.Join` stream on its
//! own connection, speaking the protocol the agent speaks (register, a full
//! residency table, then each second either a changed status with a
//! residency delta, or a heartbeat when nothing changed), without polling
//! any backend. Each second a share `CHURN` of them changes (slots, in-flight
//! requests, GPU memory, one session in and one out); the rest are quiet.
//!
//! Measured, in one run:
//! - controller CPU, from its runtime's threads (`/proc/self/task`), and
//!   etcd's CPU (`/proc/<pid>`), in cores;
//! - etcd writes per second (revisions; every put and lease revoke is one)
//!   and node record writes per second, while churning and while quiet;
//! - snapshot build time (the controller's histogram), full snapshot and
//!   delta sizes on the wire;
//! - propagation: from an agent sending a changed status to each of the four
//!   data planes holding a decoded snapshot with it (p50, p99, max).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inferyes_dataplane::SnapshotStore;
use inferyes_proto::v1::agent_message::Msg;
use inferyes_proto::v1::agent_service_client::AgentServiceClient;
use inferyes_proto::v1::routing_service_client::RoutingServiceClient;
use inferyes_proto::v1::{
    AgentMessage, Backend, BackendKind, Gpu, GpuSource, Health, Heartbeat, Model, ModelState, NodeStatus, Register,
    ResidencyUpdate, ResidentSession, SubscribeRequest, snapshot_update,
};
use inferyes_tests::{Etcd, HttpClient};
use prost::Message;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const DATA_PLANES: usize = 4;
const SESSIONS_PER_NODE: usize = 32;
const GPU_TOTAL: u64 = 80 << 30;
/// GPU memory used is this plus the node's change counter: the data planes
/// read the counter back out of their decoded snapshots.
const GPU_BASE_USED: u64 = 40 << 30;

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// When each node's change number `n` was sent.
type Sent = Arc<Mutex<HashMap<(usize, u64), Instant>>>;

fn main() {
    let agents: usize = env("AGENTS", 1000);
    let churn: f64 = env("CHURN", 0.3);
    let seconds: u64 = env("SECONDS", 20);
    if let Ok(controller) = std::env::var("CONTROLLER") {
        let token: String = env("JOIN_TOKEN", inferyes_tests::fleet::JOIN_TOKEN.to_string());
        join_only(&controller, &token, agents, churn, seconds);
        return;
    }
    let quiet_seconds: u64 = 5;

    // Three runtimes, so the controller's CPU can be told apart: its own
    // (threads named `controller`), the data planes', and this harness's.
    let controller_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("controller")
        .enable_all()
        .build()
        .expect("runtime");
    let dataplane_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("dataplane")
        .enable_all()
        .build()
        .expect("runtime");
    let harness_rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");

    harness_rt.block_on(async {
        let etcd = Etcd::start().await;
        let shutdown = CancellationToken::new();

        let grpc = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let http = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let (grpc_addr, http_addr) = (grpc.local_addr().expect("bound"), http.local_addr().expect("bound"));
        let config = inferyes_controller::Config {
            controller_id: "scale".into(),
            etcd_endpoints: vec![etcd.endpoint()],
            grpc_listen: grpc_addr,
            http_listen: http_addr,
            startup_grace_ms: 0,
            admin_token: Some(inferyes_tests::fleet::ADMIN_TOKEN.into()),
            join_token: Some(inferyes_tests::fleet::JOIN_TOKEN.into()),
            ..Default::default()
        };
        config.validate().expect("valid controller config");
        let controller_token = shutdown.clone();
        let controller = controller_rt.spawn(async move {
            grpc.set_nonblocking(true).expect("nonblocking");
            http.set_nonblocking(true).expect("nonblocking");
            let listeners = inferyes_controller::Listeners {
                grpc: tokio::net::TcpListener::from_std(grpc).expect("listener"),
                http: tokio::net::TcpListener::from_std(http).expect("listener"),
            };
            inferyes_controller::run(config, listeners, controller_token).await
        });
        let controller_url = format!("http://{grpc_addr}");
        let metrics_url = format!("http://{http_addr}/metrics");
        let client = HttpClient::default();
        inferyes_tests::eventually("the controller is ready", Duration::from_secs(20), || {
            let (client, url) = (client.clone(), format!("http://{http_addr}/readyz"));
            async move { client.get(&url).await.status == http::StatusCode::OK }
        })
        .await;

        // The data planes: the real subscription and decode, each into its
        // own store, each with a watcher that reads change numbers back.
        let swarm = Swarm::new(&controller_url, inferyes_tests::fleet::JOIN_TOKEN, churn, shutdown.clone());
        let latencies: Arc<Mutex<Vec<Duration>>> = Arc::default();
        let measuring = Arc::new(AtomicBool::new(false));
        for i in 0..DATA_PLANES {
            let store = Arc::new(SnapshotStore::default());
            let controllers = inferyes_dataplane::Controllers {
                addresses: vec![controller_url.clone()],
                tls: inferyes_proto::tls::Tls::default(),
                bearer: inferyes_proto::bearer::Bearer::new(Some(inferyes_tests::fleet::JOIN_TOKEN)).expect("a token"),
            };
            dataplane_rt.spawn(inferyes_dataplane::snapshot::subscribe(
                Arc::clone(&store),
                controllers,
                format!("dataplane-{i}"),
                shutdown.clone(),
            ));
            dataplane_rt.spawn(watch_changes(
                store,
                Arc::clone(&swarm.sent),
                Arc::clone(&latencies),
                Arc::clone(&measuring),
                shutdown.clone(),
            ));
        }

        let started = Instant::now();
        swarm.join(agents).await;
        inferyes_tests::eventually("every node in the snapshot", Duration::from_secs(120), || {
            let (client, url) = (client.clone(), metrics_url.clone());
            async move {
                let text = String::from_utf8_lossy(&client.get(&url).await.body).to_string();
                metric(&text, "inferyes_controller_nodes{state=\"active\"}") == agents as f64
            }
        })
        .await;
        println!("{agents} agents joined in {:.1} s", started.elapsed().as_secs_f64());
        // One raw subscriber for sizes on the wire.
        let sizes: Arc<Mutex<(usize, Vec<usize>)>> = Arc::default();
        tokio::spawn(measure_sizes(controller_url.clone(), Arc::clone(&sizes), Arc::clone(&measuring)));
        // Settle: first writes, residency tables.
        tokio::time::sleep(Duration::from_secs(3)).await;

        // Churning.
        measuring.store(true, Ordering::Relaxed);
        let before = Sample::take(&client, &metrics_url, &etcd).await;
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        let after = Sample::take(&client, &metrics_url, &etcd).await;
        measuring.store(false, Ordering::Relaxed);
        // Quiet: every agent only heartbeats.
        swarm.quiet.store(true, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let quiet_before = Sample::take(&client, &metrics_url, &etcd).await;
        tokio::time::sleep(Duration::from_secs(quiet_seconds)).await;
        let quiet_after = Sample::take(&client, &metrics_url, &etcd).await;

        let window = after.at.duration_since(before.at).as_secs_f64();
        let quiet_window = quiet_after.at.duration_since(quiet_before.at).as_secs_f64();
        let mut latencies = latencies.lock().expect("lock").clone();
        latencies.sort();
        let percentile = |p: f64| {
            latencies.get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1))).copied()
        };
        let ms = |d: Option<Duration>| d.map_or("n/a".to_string(), |d| format!("{:.1} ms", d.as_secs_f64() * 1e3));
        let (full_size, deltas) = sizes.lock().expect("lock").clone();
        let mean_delta = if deltas.is_empty() { 0 } else { deltas.iter().sum::<usize>() / deltas.len() };
        let builds = after.build_count - before.build_count;

        println!("\n{agents} agents, churn {churn} per second, {seconds} s measured, {DATA_PLANES} data planes\n");
        println!("| measure | value |");
        println!("|---|---:|");
        println!("| controller CPU | {:.2} cores |", (after.controller_cpu - before.controller_cpu) / window);
        println!("| etcd CPU | {:.2} cores |", (after.etcd_cpu - before.etcd_cpu) / window);
        println!("| status changes sent per second | {:.0} |", agents as f64 * churn);
        println!("| node writes per second, churning | {:.0} |", (after.node_writes - before.node_writes) / window);
        println!("| etcd revisions per second, churning | {:.0} |", (after.revision - before.revision) as f64 / window);
        println!(
            "| node writes per second, quiet | {:.1} |",
            (quiet_after.node_writes - quiet_before.node_writes) / quiet_window
        );
        println!(
            "| etcd revisions per second, quiet | {:.1} |",
            (quiet_after.revision - quiet_before.revision) as f64 / quiet_window
        );
        println!("| snapshots built per second | {:.1} |", builds / window);
        println!(
            "| snapshot build, mean | {:.2} ms |",
            if builds > 0.0 { (after.build_sum - before.build_sum) / builds * 1e3 } else { 0.0 }
        );
        println!("| full snapshot on the wire | {:.1} KiB |", full_size as f64 / 1024.0);
        println!("| delta on the wire, mean | {:.1} KiB ({} deltas) |", mean_delta as f64 / 1024.0, deltas.len());
        println!("| propagation p50 | {} |", ms(percentile(0.50)));
        println!("| propagation p99 | {} |", ms(percentile(0.99)));
        println!("| propagation max | {} |", ms(latencies.last().copied()));
        println!("| propagation samples | {} |", latencies.len());

        shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(10), controller).await;
    });
}

/// Joins the agents to a fleet running elsewhere (the proxy benchmark's,
/// say, to route with a 1,000-node snapshot) and keeps them reporting for
/// `seconds`.
fn join_only(controller: &str, token: &str, agents: usize, churn: f64, seconds: u64) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
    runtime.block_on(async {
        let shutdown = CancellationToken::new();
        Swarm::new(controller, token, churn, shutdown.clone()).join(agents).await;
        println!("{agents} agents joined {controller}; reporting for {seconds} s");
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        shutdown.cancel();
    });
}

/// What the simulated agents share.
#[derive(Clone)]
struct Swarm {
    controller: String,
    join_token: Arc<str>,
    /// The share of agents whose status changes each second.
    churn: f64,
    /// When each change was sent, for propagation times.
    sent: Sent,
    /// Set: every agent only heartbeats.
    quiet: Arc<AtomicBool>,
    joined: Arc<AtomicU64>,
    shutdown: CancellationToken,
}

impl Swarm {
    fn new(controller: &str, join_token: &str, churn: f64, shutdown: CancellationToken) -> Swarm {
        Swarm {
            controller: controller.to_string(),
            join_token: Arc::from(join_token),
            churn,
            sent: Sent::default(),
            quiet: Arc::default(),
            joined: Arc::default(),
            shutdown,
        }
    }

    /// Starts `agents` agents and waits until every one has joined.
    async fn join(&self, agents: usize) {
        for index in 0..agents {
            tokio::spawn(agent(index, self.clone()));
        }
        inferyes_tests::eventually("every agent joined", Duration::from_secs(120), || {
            let joined = Arc::clone(&self.joined);
            async move { joined.load(Ordering::Relaxed) == agents as u64 }
        })
        .await;
    }
}

/// One agent: a join stream with the real protocol, one report a second.
async fn agent(index: usize, swarm: Swarm) {
    let mut rng = fastrand::Rng::with_seed(index as u64);
    let mut status = node_status(index, 0);
    let (tx, rx) = mpsc::channel::<AgentMessage>(8);
    let mut client = loop {
        match AgentServiceClient::connect(swarm.controller.clone()).await {
            Ok(client) => break client,
            Err(_) => tokio::time::sleep(Duration::from_millis(200 + rng.u64(..300))).await,
        }
    };
    let _ = tx
        .send(AgentMessage {
            msg: Some(Msg::Register(Register {
                status: Some(status.clone()),
                join_token: swarm.join_token.to_string(),
            })),
        })
        .await;
    let mut sessions: Vec<String> = (0..SESSIONS_PER_NODE).map(|s| format!("n{index}-s{s}")).collect();
    let mut seq = 1u64;
    let full = ResidencyUpdate {
        seq,
        full: true,
        upserted: sessions.iter().map(|key| session(key)).collect(),
        removed: Vec::new(),
    };
    let _ = tx.send(AgentMessage { msg: Some(Msg::Residency(full)) }).await;
    let mut inbound = match client.join(tokio_stream::wrappers::ReceiverStream::new(rx)).await {
        Ok(response) => response.into_inner(),
        Err(status) => panic!("agent {index} could not join: {status}"),
    };
    swarm.joined.fetch_add(1, Ordering::Relaxed);
    // Spread the reports over the second, as independent agents would be.
    tokio::time::sleep(Duration::from_millis(rng.u64(..1000))).await;
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    let mut change = 0u64;
    let mut next_session = SESSIONS_PER_NODE;
    loop {
        tokio::select! {
            () = swarm.shutdown.cancelled() => return,
            message = inbound.message() => match message {
                Ok(Some(_)) => continue,
                _ => return,
            },
            _ = ticker.tick() => {}
        }
        let message = if !swarm.quiet.load(Ordering::Relaxed) && rng.f64() < swarm.churn {
            change += 1;
            status = node_status(index, change);
            let backend = &mut status.backends[0];
            backend.slots_busy = rng.u32(0..=8);
            backend.in_flight = backend.slots_busy;
            backend.requests_deferred = u32::from(rng.f64() < 0.05);
            // One conversation ends, another starts.
            seq += 1;
            let gone = sessions.remove(rng.usize(..sessions.len()));
            let key = format!("n{index}-s{next_session}");
            next_session += 1;
            sessions.push(key.clone());
            let delta = ResidencyUpdate { seq, full: false, upserted: vec![session(&key)], removed: vec![gone] };
            if tx.send(AgentMessage { msg: Some(Msg::Residency(delta)) }).await.is_err() {
                return;
            }
            swarm.sent.lock().expect("lock").insert((index, change), Instant::now());
            AgentMessage { msg: Some(Msg::Status(status.clone())) }
        } else {
            AgentMessage { msg: Some(Msg::Heartbeat(Heartbeat {})) }
        };
        if tx.send(message).await.is_err() {
            return;
        }
    }
}

fn node_status(index: usize, change: u64) -> NodeStatus {
    let model = |id: &str, state: ModelState| Model {
        id: id.into(),
        state: state as i32,
        context_window: 8192,
        endpoints: Vec::new(),
        size_bytes: 8 << 30,
    };
    NodeStatus {
        node_id: format!("gpu-{index:05}"),
        hostname: format!("host-{index:05}"),
        proxy_url: format!("http://10.0.{}.{}:7070", index / 250, index % 250),
        gpus: vec![Gpu {
            index: 0,
            uuid: format!("GPU-{index:08x}"),
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_total_bytes: GPU_TOTAL,
            memory_used_bytes: GPU_BASE_USED + change,
            utilization_percent: 50,
            source: GpuSource::Nvml as i32,
            stale: false,
        }],
        backends: vec![Backend {
            id: "main".into(),
            kind: BackendKind::LlamaSwap as i32,
            health: Health::Ready as i32,
            models: vec![
                model(&format!("model-{}", index % 20), ModelState::Loaded),
                model(&format!("model-{}", (index + 7) % 20), ModelState::Unloaded),
            ],
            weight: 1,
            slots_total: 8,
            slots_busy: 0,
            requests_deferred: 0,
            in_flight: 0,
            tokens_per_second: 0.0,
            probe_error: String::new(),
            prefill_tokens_per_second: 0.0,
            service_ms: 0,
            load_unknown: false,
            resident_sessions: 0,
        }],
        sessions: Vec::new(),
        agent_version: "scale".into(),
        started_unix_ms: 1,
        proxy_http2: true,
    }
}

fn session(key: &str) -> ResidentSession {
    ResidentSession {
        key: key.into(),
        backend_id: "main".into(),
        model: "model-0".into(),
        first_seen_unix_ms: 1,
        last_seen_unix_ms: 1,
        requests: 1,
        tokens: 512,
        cache_hits: 0,
        cache_misses: 1,
    }
}

/// Reads each node's change number out of every snapshot the data plane
/// installs, and times the first sight of each against its sending.
async fn watch_changes(
    store: Arc<SnapshotStore>,
    sent: Sent,
    latencies: Arc<Mutex<Vec<Duration>>>,
    measuring: Arc<AtomicBool>,
    shutdown: CancellationToken,
) {
    let mut versions = store.versions();
    let mut seen: HashMap<usize, u64> = HashMap::new();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = versions.changed() => if changed.is_err() { return },
        }
        let now = Instant::now();
        let Some(snapshot) = store.current() else { continue };
        let mut found = Vec::new();
        for node in snapshot.nodes() {
            let Some(index) = node.id.strip_prefix("gpu-").and_then(|i| i.parse::<usize>().ok()) else { continue };
            let change = node.vram_used_bytes.saturating_sub(GPU_BASE_USED);
            let last = seen.entry(index).or_insert(0);
            if change > *last {
                *last = change;
                found.push((index, change));
            }
        }
        if !measuring.load(Ordering::Relaxed) {
            continue;
        }
        let sent = sent.lock().expect("lock");
        let mut latencies = latencies.lock().expect("lock");
        for key in found {
            if let Some(at) = sent.get(&key) {
                latencies.push(now.duration_since(*at));
            }
        }
    }
}

async fn measure_sizes(controller: String, sizes: Arc<Mutex<(usize, Vec<usize>)>>, measuring: Arc<AtomicBool>) {
    let Ok(channel) = tonic::transport::Endpoint::from_shared(controller) else { return };
    let Ok(channel) = channel.connect().await else { return };
    let bearer = inferyes_proto::bearer::Bearer::new(Some(inferyes_tests::fleet::JOIN_TOKEN)).expect("a token");
    let mut client = RoutingServiceClient::with_interceptor(channel, bearer).max_decoding_message_size(256 << 20);
    let Ok(response) = client.subscribe(SubscribeRequest { dataplane_id: "sizes".into() }).await else { return };
    let mut stream = response.into_inner();
    while let Ok(Some(update)) = stream.message().await {
        let size = update.encoded_len();
        let mut sizes = sizes.lock().expect("lock");
        match update.update {
            Some(snapshot_update::Update::Full(_)) => sizes.0 = size,
            Some(snapshot_update::Update::Delta(_)) if measuring.load(Ordering::Relaxed) => sizes.1.push(size),
            _ => {}
        }
    }
}

struct Sample {
    at: Instant,
    controller_cpu: f64,
    etcd_cpu: f64,
    node_writes: f64,
    build_sum: f64,
    build_count: f64,
    revision: i64,
}

impl Sample {
    async fn take(client: &HttpClient, metrics_url: &str, etcd: &Etcd) -> Sample {
        let text = String::from_utf8_lossy(&client.get(metrics_url).await.body).to_string();
        let mut kv = etcd_client::Client::connect([etcd.endpoint()], None).await.expect("etcd");
        let revision = kv.get("/", None).await.expect("etcd get").header().map_or(0, |h| h.revision());
        Sample {
            at: Instant::now(),
            controller_cpu: thread_cpu_seconds("controller"),
            etcd_cpu: process_cpu_seconds(etcd.pid()),
            node_writes: metric(&text, "inferyes_controller_node_writes_total"),
            build_sum: metric(&text, "inferyes_controller_snapshot_build_seconds_sum"),
            build_count: metric(&text, "inferyes_controller_snapshot_build_seconds_count"),
            revision,
        }
    }
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|line| line.strip_prefix(series).and_then(|rest| rest.trim().parse::<f64>().ok()))
        .unwrap_or(0.0)
}

fn clock_ticks() -> f64 {
    100.0
}

/// utime + stime of a `/proc/.../stat` line, in seconds.
fn stat_cpu_seconds(stat: &str) -> f64 {
    // Fields after the command (which may hold spaces) in parentheses.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of the line; 12 and 13 here.
    (ticks(11) + ticks(12)) / clock_ticks()
}

fn thread_cpu_seconds(name: &str) -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0.0 };
    tasks
        .filter_map(Result::ok)
        .filter(|task| std::fs::read_to_string(task.path().join("comm")).is_ok_and(|comm| comm.trim() == name))
        .filter_map(|task| std::fs::read_to_string(task.path().join("stat")).ok())
        .map(|stat| stat_cpu_seconds(&stat))
        .sum()
}

fn process_cpu_seconds(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(0.0, |stat| stat_cpu_seconds(&stat))
}
