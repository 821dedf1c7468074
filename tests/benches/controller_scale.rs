//! Controller scale: 1,000 agents of 1,000 resident sessions each, every
//! node gaining 50 new sessions a second and serving 50 repeat turns,
//! against one controller (or `CONTROLLERS` of them, following each
//! other) and a real etcd, with four data planes subscribed.
//!
//! ```sh
//! cargo bench -p inferyes-tests --bench controller_scale
//! SECONDS=600 cargo bench -p inferyes-tests --bench controller_scale   # etcd over 10 minutes
//! AGENTS=200 SESSIONS=500 NEW=20 cargo bench -p inferyes-tests --bench controller_scale
//! # Three controllers, agents and data planes dealt round robin over them:
//! CONTROLLERS=3 cargo bench -p inferyes-tests --bench controller_scale
//! # 10,000 nodes of 100 sessions, ten agents' streams to a connection:
//! AGENTS=10000 SESSIONS=100 NEW=5 REPEATS=5 AGENTS_PER_CONNECTION=10 cargo bench -p inferyes-tests --bench controller_scale
//! # Only the agents, joined to a fleet running elsewhere, for SECONDS:
//! CONTROLLER=http://127.0.0.1:7070 JOIN_TOKEN=... cargo bench -p inferyes-tests --bench controller_scale
//! ```
//!
//! The agents are light: each is one real `AgentService.Join` stream on its
//! own connection (or `AGENTS_PER_CONNECTION` streams to one, where a
//! process's descriptors would not hold a connection each), speaking the
//! protocol the agent speaks (register, a full
//! residency table, then every `TICK_MS` a status with its slots' load and
//! a numbered residency delta: new sessions in, as many of the oldest out,
//! repeat turns' sessions updated), without polling any backend.
//!
//! Two phases, in one run: a tenth of the rate, then the whole rate, to
//! show etcd's traffic does not follow the requests. Measured:
//! - each controller's CPU, from its runtime's threads (`/proc/self/task`),
//!   and etcd's CPU (`/proc/<pid>`), in cores;
//! - etcd revisions per second and the bytes its clients send it per second
//!   (its own `etcd_network_client_grpc_received_bytes_total`), per phase;
//! - etcd's database size when the fleet has joined and at the end;
//! - the full snapshot and the live deltas on the wire;
//! - propagation: from an agent sending a new session to each data plane's
//!   session index holding it (p50, p99, max), one probe per agent a second;
//!   with several controllers, a data plane follows a controller other than
//!   most agents' own, so most probes cross a peer link;
//! - the data planes' memory: the process's resident memory before and after
//!   they subscribed, per data plane.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inferyes_dataplane::SnapshotStore;
use inferyes_proto::hash::stable_hash;
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

const GPU_TOTAL: u64 = 80 << 30;

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// What each agent does, per node.
#[derive(Clone, Copy)]
struct Profile {
    sessions: usize,
    /// New sessions and repeat turns per second, at the whole rate.
    new: f64,
    repeats: f64,
    tick: Duration,
}

/// Probes: a new session's key hash and when its agent sent it.
type Probes = Arc<Mutex<Vec<(u64, Instant)>>>;

fn main() {
    let agents: usize = env("AGENTS", 1000);
    let profile = Profile {
        sessions: env("SESSIONS", 1000),
        new: env("NEW", 50.0),
        repeats: env("REPEATS", 50.0),
        tick: Duration::from_millis(env("TICK_MS", 100u64).max(1)),
    };
    let seconds: u64 = env("SECONDS", 20);
    let data_planes: usize = env("DATA_PLANES", 4);
    let controllers: usize = env("CONTROLLERS", 1usize).max(1);
    let per_connection: usize = env("AGENTS_PER_CONNECTION", 1usize).max(1);
    if let Ok(controller) = std::env::var("CONTROLLER") {
        let token: String = env("JOIN_TOKEN", inferyes_tests::fleet::JOIN_TOKEN.to_string());
        join_only(&controller, &token, agents, per_connection, profile, seconds);
        return;
    }

    // A runtime per controller, so each one's CPU can be told apart (its
    // threads are named `controller-<i>`), one for the data planes, and
    // this harness's.
    let controller_rts: Vec<tokio::runtime::Runtime> = (0..controllers)
        .map(|i| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name(format!("controller-{i}"))
                .enable_all()
                .build()
                .expect("runtime")
        })
        .collect();
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
        let fleet: Vec<Controller> = controller_rts
            .iter()
            .enumerate()
            .map(|(i, runtime)| Controller::start(i, runtime, &etcd, agents, shutdown.clone()))
            .collect();
        let client = HttpClient::default();
        for controller in &fleet {
            inferyes_tests::eventually("the controller is ready", Duration::from_secs(20), || {
                let (client, url) = (client.clone(), format!("{}/readyz", controller.http_url));
                async move { client.get(&url).await.status == http::StatusCode::OK }
            })
            .await;
        }
        let grpc_urls: Vec<String> = fleet.iter().map(|c| c.grpc_url.clone()).collect();
        let metrics_urls: Vec<String> = fleet.iter().map(|c| format!("{}/metrics", c.http_url)).collect();

        let swarm =
            Swarm::new(&grpc_urls, inferyes_tests::fleet::JOIN_TOKEN, profile, per_connection, shutdown.clone());
        // Those joined report at a tenth of the rate while the rest join.
        swarm.rate.store(100, Ordering::Relaxed);
        let started = Instant::now();
        swarm.join(agents).await;
        inferyes_tests::eventually("every node in every controller's snapshot", Duration::from_secs(600), || {
            let (client, urls) = (client.clone(), metrics_urls.clone());
            async move {
                for url in urls {
                    let text = String::from_utf8_lossy(&client.get(&url).await.body).to_string();
                    if metric(&text, "inferyes_controller_nodes{state=\"active\"}") != agents as f64 {
                        return false;
                    }
                }
                true
            }
        })
        .await;
        println!("{agents} agents of {} sessions joined in {:.1} s", profile.sessions, started.elapsed().as_secs_f64());

        // The data planes: the real subscription, index and decode, each
        // into its own store, each with a watcher timing the probes. Each
        // follows the controllers in its own order: behind a balancer they
        // spread over them.
        let rss_before = resident_bytes();
        let latencies: Arc<Mutex<Vec<Duration>>> = Arc::default();
        let mut stores = Vec::new();
        for i in 0..data_planes {
            let store = Arc::new(SnapshotStore::default());
            // Each starts at another controller, as a balancer spreads them;
            // with several, most probes come from another one's agents,
            // across a peer link.
            let mut addresses = grpc_urls.clone();
            addresses.rotate_left(i % controllers);
            let controllers = inferyes_dataplane::Controllers {
                addresses,
                tls: inferyes_proto::tls::Tls::default(),
                bearer: inferyes_proto::bearer::Bearer::new(Some(inferyes_tests::fleet::DATAPLANE_TOKEN))
                    .expect("a token"),
            };
            dataplane_rt.spawn(inferyes_dataplane::snapshot::subscribe(
                Arc::clone(&store),
                controllers,
                format!("dataplane-{i}"),
                shutdown.clone(),
            ));
            // On the harness's runtime: timing is not the data plane's work.
            tokio::spawn(watch_probes(
                Arc::clone(&store),
                Arc::clone(&swarm.probes),
                Arc::clone(&latencies),
                shutdown.clone(),
            ));
            stores.push(store);
        }
        let expected = agents * profile.sessions;
        inferyes_tests::eventually("every data plane holds the fleet's sessions", Duration::from_secs(300), || {
            let held: Vec<usize> = stores.iter().map(|s| s.sessions().len()).collect();
            async move { held.iter().all(|n| *n >= expected * 99 / 100) }
        })
        .await;
        let rss_after = resident_bytes();
        // One raw subscriber for sizes on the wire.
        let sizes: Arc<Mutex<Sizes>> = Arc::default();
        let measuring = Arc::new(AtomicBool::new(false));
        tokio::spawn(measure_sizes(grpc_urls[0].clone(), Arc::clone(&sizes), Arc::clone(&measuring)));
        tokio::time::sleep(Duration::from_secs(2)).await;
        let db_start = etcd_db_size(&etcd).await;

        // A tenth of the rate, then all of it.
        swarm.rate.store(100, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let low_seconds = seconds.clamp(5, 20);
        let rejoins = || swarm.rejoins.load(Ordering::Relaxed);
        let rejoins_at_start = rejoins();
        let low_before = Sample::take(&client, &metrics_urls, &etcd).await;
        let low_rejoins = rejoins();
        tokio::time::sleep(Duration::from_secs(low_seconds)).await;
        let low_after = Sample::take(&client, &metrics_urls, &etcd).await;
        let low_rejoins = rejoins() - low_rejoins;

        swarm.rate.store(1000, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_secs(2)).await;
        latencies.lock().expect("lock").clear();
        swarm.probing.store(true, Ordering::Relaxed);
        measuring.store(true, Ordering::Relaxed);
        let before = Sample::take(&client, &metrics_urls, &etcd).await;
        let whole_rejoins = rejoins();
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        let after = Sample::take(&client, &metrics_urls, &etcd).await;
        let whole_rejoins = rejoins() - whole_rejoins;
        measuring.store(false, Ordering::Relaxed);
        swarm.probing.store(false, Ordering::Relaxed);
        let db_end = etcd_db_size(&etcd).await;

        let window = after.at.duration_since(before.at).as_secs_f64();
        let low_window = low_after.at.duration_since(low_before.at).as_secs_f64();
        let mut latencies = latencies.lock().expect("lock").clone();
        latencies.sort();
        let percentile = |p: f64| {
            latencies.get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1))).copied()
        };
        let ms = |d: Option<Duration>| d.map_or("n/a".to_string(), |d| format!("{:.1} ms", d.as_secs_f64() * 1e3));
        let sizes = sizes.lock().expect("lock").clone();
        let per_second = |rate: f64| rate * agents as f64;
        let mib = |bytes: f64| bytes / f64::from(1 << 20);

        println!(
            "\n{agents} agents of {} sessions, {} new sessions and {} repeat turns a second per node, {seconds} s \
             measured, {data_planes} data planes\n",
            profile.sessions, profile.new, profile.repeats
        );
        println!("| measure | a tenth of the rate | the whole rate |");
        println!("|---|---:|---:|");
        println!(
            "| session changes sent per second (new + repeat + evicted) | {:.0} | {:.0} |",
            per_second((2.0 * profile.new + profile.repeats) / 10.0),
            per_second(2.0 * profile.new + profile.repeats)
        );
        let cores = |before: &Sample, after: &Sample, window: f64| {
            let each: Vec<String> = (before.controller_cpu.iter().zip(&after.controller_cpu))
                .map(|(b, a)| format!("{:.2}", (a - b) / window))
                .collect();
            each.join(" · ")
        };
        println!(
            "| controller CPU{} | {} cores | {} cores |",
            if controllers > 1 { ", each" } else { "" },
            cores(&low_before, &low_after, low_window),
            cores(&before, &after, window)
        );
        println!(
            "| etcd CPU | {:.2} cores | {:.2} cores |",
            (low_after.etcd_cpu - low_before.etcd_cpu) / low_window,
            (after.etcd_cpu - before.etcd_cpu) / window
        );
        println!(
            "| etcd revisions per second | {:.2} | {:.2} |",
            (low_after.revision - low_before.revision) as f64 / low_window,
            (after.revision - before.revision) as f64 / window
        );
        println!(
            "| etcd bytes received per second | {:.0} | {:.0} |",
            (low_after.etcd_received - low_before.etcd_received) / low_window,
            (after.etcd_received - before.etcd_received) / window
        );
        println!(
            "| node record writes per second | {:.2} | {:.2} |",
            (low_after.node_writes - low_before.node_writes) / low_window,
            (after.node_writes - before.node_writes) / window
        );
        println!(
            "| whole live states sent again (a receiver fell behind) | {:.0} | {:.0} |",
            low_after.resyncs - low_before.resyncs,
            after.resyncs - before.resyncs
        );
        println!("| agent streams ended or refused, and joined again | {low_rejoins} | {whole_rejoins} |");
        println!();
        println!("| measure | value |");
        println!("|---|---:|");
        println!("| agent streams ended or refused, and joined again, before the measures | {rejoins_at_start} |");
        println!("| etcd database, fleet joined | {:.2} MiB |", mib(db_start as f64));
        println!("| etcd database, end | {:.2} MiB |", mib(db_end as f64));
        println!("| full snapshot on the wire | {:.1} MiB |", mib(sizes.full as f64));
        println!(
            "| live deltas on the wire, per data plane | {:.2} MiB/s ({:.1} KiB each, {:.1} a second) |",
            mib(sizes.live_bytes as f64 / window),
            sizes.live_bytes as f64 / sizes.live_count.max(1) as f64 / 1024.0,
            sizes.live_count as f64 / window
        );
        println!("| propagation p50 (agent sends → each data plane's index) | {} |", ms(percentile(0.50)));
        println!("| propagation p99 | {} |", ms(percentile(0.99)));
        println!("| propagation max | {} |", ms(latencies.last().copied()));
        println!("| propagation samples | {} |", latencies.len());
        for (why, count) in swarm.ends.lock().expect("lock").iter() {
            println!("| agent streams ended: {why} | {count} |");
        }
        // With several controllers the process's growth meanwhile holds
        // their peers' copies too, arriving as the data planes subscribe.
        if controllers == 1 {
            let held = stores[0].sessions().len();
            let each = rss_after.saturating_sub(rss_before) as f64 / data_planes as f64;
            println!("| data plane memory, each ({held} sessions) | {:.0} MiB |", mib(each));
            println!("| data plane memory per resident session | {:.0} bytes |", each / held.max(1) as f64);
        }

        shutdown.cancel();
        for controller in fleet {
            let _ = tokio::time::timeout(Duration::from_secs(10), controller.task).await;
        }
    });
}

/// One controller of the fleet, on a runtime of its own.
struct Controller {
    grpc_url: String,
    http_url: String,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Controller {
    fn start(
        index: usize,
        runtime: &tokio::runtime::Runtime,
        etcd: &Etcd,
        agents: usize,
        shutdown: CancellationToken,
    ) -> Controller {
        let grpc = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let http = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let (grpc_addr, http_addr) = (grpc.local_addr().expect("bound"), http.local_addr().expect("bound"));
        let defaults = inferyes_controller::Config::default();
        let config = inferyes_controller::Config {
            controller_id: format!("scale-{index}"),
            etcd_endpoints: vec![etcd.endpoint()],
            grpc_listen: grpc_addr,
            http_listen: http_addr,
            startup_grace_ms: 0,
            max_nodes: defaults.max_nodes.max(agents),
            admin_token: Some(inferyes_tests::fleet::ADMIN_TOKEN.into()),
            join_token: Some(inferyes_tests::fleet::JOIN_TOKEN.into()),
            dataplane_token: Some(inferyes_tests::fleet::DATAPLANE_TOKEN.into()),
            ..defaults
        };
        config.validate().expect("valid controller config");
        let task = runtime.spawn(async move {
            grpc.set_nonblocking(true).expect("nonblocking");
            http.set_nonblocking(true).expect("nonblocking");
            let listeners = inferyes_controller::Listeners {
                grpc: tokio::net::TcpListener::from_std(grpc).expect("listener"),
                http: tokio::net::TcpListener::from_std(http).expect("listener"),
            };
            inferyes_controller::run(config, listeners, shutdown).await
        });
        Controller { grpc_url: format!("http://{grpc_addr}"), http_url: format!("http://{http_addr}"), task }
    }
}

/// Joins the agents to a fleet running elsewhere (the proxy benchmark's,
/// say, to route with a 1,000-node snapshot) and keeps them reporting for
/// `seconds`.
fn join_only(controller: &str, token: &str, agents: usize, per_connection: usize, profile: Profile, seconds: u64) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
    runtime.block_on(async {
        let shutdown = CancellationToken::new();
        Swarm::new(&[controller.to_string()], token, profile, per_connection, shutdown.clone()).join(agents).await;
        println!("{agents} agents joined {controller}; reporting for {seconds} s");
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        shutdown.cancel();
    });
}

/// What the simulated agents share.
#[derive(Clone)]
struct Swarm {
    /// Agents are dealt over these, a connection's worth at a time.
    controllers: Arc<[String]>,
    join_token: Arc<str>,
    profile: Profile,
    per_connection: usize,
    /// Thousandths of the profile's rate the agents run at.
    rate: Arc<AtomicU64>,
    /// Set: each agent sends a probe a second.
    probing: Arc<AtomicBool>,
    probes: Probes,
    joined: Arc<AtomicU64>,
    /// Streams that ended and were joined again.
    rejoins: Arc<AtomicU64>,
    /// Why streams ended, as the controllers said.
    ends: Arc<Mutex<std::collections::BTreeMap<String, u64>>>,
    shutdown: CancellationToken,
}

impl Swarm {
    fn new(
        controllers: &[String],
        join_token: &str,
        profile: Profile,
        per_connection: usize,
        shutdown: CancellationToken,
    ) -> Swarm {
        Swarm {
            controllers: Arc::from(controllers),
            join_token: Arc::from(join_token),
            profile,
            per_connection,
            rate: Arc::new(AtomicU64::new(1000)),
            probing: Arc::default(),
            probes: Probes::default(),
            joined: Arc::default(),
            rejoins: Arc::default(),
            ends: Arc::default(),
            shutdown,
        }
    }

    fn ended(&self, why: &str) {
        *self.ends.lock().expect("lock").entry(why.to_string()).or_default() += 1;
    }

    /// Starts `agents` agents and waits until every one has joined.
    async fn join(&self, agents: usize) {
        let per = self.per_connection;
        for first in (0..agents).step_by(per) {
            let swarm = self.clone();
            tokio::spawn(async move {
                let url = &swarm.controllers[(first / per) % swarm.controllers.len()];
                let Some(channel) = connect(url, first, &swarm.shutdown).await else { return };
                for index in first..(first + per).min(agents) {
                    tokio::spawn(agent(index, channel.clone(), swarm.clone()));
                }
            });
        }
        inferyes_tests::eventually("every agent joined", Duration::from_secs(300), || {
            let joined = Arc::clone(&self.joined);
            async move { joined.load(Ordering::Relaxed) == agents as u64 }
        })
        .await;
    }
}

/// How many of `per_second` fall in one tick: the whole part, and one more
/// as often as the fraction says.
fn per_tick(rng: &mut fastrand::Rng, per_second: f64, tick: Duration) -> usize {
    let expected = per_second * tick.as_secs_f64();
    expected.floor() as usize + usize::from(rng.f64() < expected.fract())
}

/// A connection to a controller, tried until it opens: past its share of
/// connections not yet proven, a controller refuses more from one address.
async fn connect(url: &str, seed: usize, shutdown: &CancellationToken) -> Option<tonic::transport::Channel> {
    let mut rng = fastrand::Rng::with_seed(seed as u64);
    let endpoint = tonic::transport::Endpoint::from_shared(url.to_string()).expect("a controller's URL");
    loop {
        match endpoint.connect().await {
            Ok(channel) => return Some(channel),
            Err(_) if shutdown.is_cancelled() => return None,
            Err(_) => tokio::time::sleep(Duration::from_millis(200 + rng.u64(..300))).await,
        }
    }
}

/// One agent: a join stream with the real protocol, a report every tick.
/// As a real agent does, it joins again, with its whole table, when its
/// stream ends (a starved controller takes it for silent and drops it).
async fn agent(index: usize, channel: tonic::transport::Channel, swarm: Swarm) {
    let mut node = SimulatedNode {
        index,
        rng: fastrand::Rng::with_seed(index as u64),
        status: node_status(index),
        next: 0,
        sessions: VecDeque::new(),
    };
    for _ in 0..swarm.profile.sessions {
        let fresh = node.fresh_key();
        node.sessions.push_back(fresh);
    }
    let mut joined = false;
    loop {
        node.serve(AgentServiceClient::new(channel.clone()), &swarm, &mut joined).await;
        if swarm.shutdown.is_cancelled() {
            return;
        }
        swarm.rejoins.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(500 + node.rng.u64(..1500))).await;
    }
}

/// What an agent keeps between its streams.
struct SimulatedNode {
    index: usize,
    rng: fastrand::Rng,
    status: NodeStatus,
    /// The number of the next session key.
    next: usize,
    sessions: VecDeque<String>,
}

impl SimulatedNode {
    fn fresh_key(&mut self) -> String {
        self.next += 1;
        format!("n{}-s{}", self.index, self.next)
    }

    /// One join stream, until it ends or the run does.
    async fn serve(
        &mut self,
        mut client: AgentServiceClient<tonic::transport::Channel>,
        swarm: &Swarm,
        joined: &mut bool,
    ) {
        let profile = swarm.profile;
        let (tx, rx) = mpsc::channel::<AgentMessage>(64);
        let register = Register {
            status: Some(self.status.clone()),
            join_token: swarm.join_token.to_string(),
            instance: format!("swarm{:0>16}", self.index),
        };
        let _ = tx.send(AgentMessage { msg: Some(Msg::Register(register)) }).await;
        let mut seq = 1u64;
        let full = ResidencyUpdate {
            seq,
            full: true,
            upserted: self.sessions.iter().map(|key| session(key, 1)).collect(),
            removed: Vec::new(),
        };
        let _ = tx.send(AgentMessage { msg: Some(Msg::Residency(full)) }).await;
        let mut inbound = match client.join(tokio_stream::wrappers::ReceiverStream::new(rx)).await {
            Ok(response) => response.into_inner(),
            Err(status) => return swarm.ended(&format!("join refused: {}", status.message())),
        };
        if !*joined {
            *joined = true;
            swarm.joined.fetch_add(1, Ordering::Relaxed);
        }
        // Spread the reports over the tick, as independent agents would be.
        tokio::time::sleep(Duration::from_millis(self.rng.u64(..profile.tick.as_millis() as u64))).await;
        let mut ticker = tokio::time::interval(profile.tick);
        let mut probed_at = Instant::now();
        let mut sent_at = Instant::now();
        loop {
            tokio::select! {
                () = swarm.shutdown.cancelled() => return,
                message = inbound.message() => match message {
                    Ok(Some(_)) => continue,
                    Ok(None) => return swarm.ended("closed"),
                    Err(status) => return swarm.ended(status.message()),
                },
                _ = ticker.tick() => {}
            }
            let rate = swarm.rate.load(Ordering::Relaxed) as f64 / 1000.0;
            let new = per_tick(&mut self.rng, profile.new * rate, profile.tick);
            let repeats = per_tick(&mut self.rng, profile.repeats * rate, profile.tick);
            if new + repeats == 0 {
                // As the agent does, a heartbeat where nothing else went
                // for a second: a controller drops a silent agent.
                if sent_at.elapsed() >= Duration::from_secs(1) {
                    sent_at = Instant::now();
                    if tx.send(AgentMessage { msg: Some(Msg::Heartbeat(Heartbeat {})) }).await.is_err() {
                        return swarm.ended("send failed");
                    }
                }
                continue;
            }
            sent_at = Instant::now();
            let now = inferyes_proto::unix_ms();
            let mut upserted = Vec::with_capacity(new + repeats);
            let mut removed = Vec::with_capacity(new);
            // Repeat turns go to sessions this tick does not evict: a delta
            // applies its removals first, so one both used and evicted would
            // stay resident at the controller and not here.
            let len = self.sessions.len();
            for _ in 0..repeats {
                if let Some(key) = self.sessions.get(self.rng.usize(new.min(len.saturating_sub(1))..len.max(1))) {
                    upserted.push(session(key, now));
                }
            }
            for _ in 0..new {
                let fresh = self.fresh_key();
                upserted.push(session(&fresh, now));
                self.sessions.push_back(fresh);
                if let Some(oldest) = self.sessions.pop_front() {
                    removed.push(oldest);
                }
            }
            seq += 1;
            let probe =
                (new > 0 && swarm.probing.load(Ordering::Relaxed) && probed_at.elapsed() >= Duration::from_secs(1))
                    .then(|| stable_hash(self.sessions.back().map(String::as_bytes).unwrap_or_default()));
            let delta = ResidencyUpdate { seq, full: false, upserted, removed };
            if tx.send(AgentMessage { msg: Some(Msg::Residency(delta)) }).await.is_err() {
                return swarm.ended("send failed");
            }
            if let Some(probe) = probe {
                probed_at = Instant::now();
                swarm.probes.lock().expect("lock").push((probe, probed_at));
            }
            // Each turn moves the slots: the load changes with the traffic.
            let backend = &mut self.status.backends[0];
            backend.slots_busy = self.rng.u32(0..=8);
            backend.in_flight = backend.slots_busy;
            backend.requests_deferred = u32::from(self.rng.f64() < 0.05);
            backend.tokens_per_second = f64::from(self.rng.u32(100..2000));
            if tx.send(AgentMessage { msg: Some(Msg::Status(self.status.clone())) }).await.is_err() {
                return swarm.ended("send failed");
            }
        }
    }
}

fn node_status(index: usize) -> NodeStatus {
    let model = |id: &str, state: ModelState| Model {
        id: id.into(),
        state: state as i32,
        context_window: 8192,
        endpoints: Vec::new(),
        size_bytes: 8 << 30,
        unsupported: Vec::new(),
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
            memory_used_bytes: 40 << 30,
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
            ..Default::default()
        }],
        sessions: Vec::new(),
        agent_version: "scale".into(),
        started_unix_ms: 1,
        proxy_http2: true,
        proxy_credential_per_node: true,
        proxy_credential_issued: true,
        awaiting_credential: false,
        gpu_hour_price: 0.0,
        moves: None,
    }
}

fn session(key: &str, now: u64) -> ResidentSession {
    ResidentSession {
        key: key.into(),
        backend_id: "main".into(),
        model: "model-0".into(),
        first_seen_unix_ms: 1,
        last_seen_unix_ms: now,
        requests: 1,
        tokens: 512,
        cache_hits: 0,
        cache_misses: 1,
    }
}

/// Times each probe from its sending to this data plane's session index
/// holding it, looking every 10 ms: more often, and a data plane behind
/// (many probes pending) would have its timing cost more than its work.
async fn watch_probes(
    store: Arc<SnapshotStore>,
    probes: Probes,
    latencies: Arc<Mutex<Vec<Duration>>>,
    shutdown: CancellationToken,
) {
    let mut taken = 0;
    let mut pending: Vec<(u64, Instant)> = Vec::new();
    let mut every = tokio::time::interval(Duration::from_millis(10));
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = every.tick() => {}
        }
        {
            let probes = probes.lock().expect("lock");
            if probes.len() < taken {
                taken = 0;
            }
            pending.extend_from_slice(&probes[taken..]);
            taken = probes.len();
        }
        let now = Instant::now();
        let index = store.sessions();
        let mut found = Vec::new();
        pending.retain(|(key, sent)| {
            let held = index.get(*key).is_some();
            if held {
                found.push(now.duration_since(*sent));
            }
            !held && now.duration_since(*sent) < Duration::from_secs(30)
        });
        latencies.lock().expect("lock").extend(found);
    }
}

#[derive(Clone, Default)]
struct Sizes {
    full: usize,
    live_bytes: usize,
    live_count: usize,
}

async fn measure_sizes(controller: String, sizes: Arc<Mutex<Sizes>>, measuring: Arc<AtomicBool>) {
    let Ok(channel) = tonic::transport::Endpoint::from_shared(controller) else { return };
    let Ok(channel) = channel.connect().await else { return };
    let bearer = inferyes_proto::bearer::Bearer::new(Some(inferyes_tests::fleet::DATAPLANE_TOKEN)).expect("a token");
    let mut client = RoutingServiceClient::with_interceptor(channel, bearer).max_decoding_message_size(1 << 30);
    let Ok(response) = client.subscribe(SubscribeRequest { dataplane_id: "sizes".into() }).await else { return };
    let mut stream = response.into_inner();
    while let Ok(Some(update)) = stream.message().await {
        let size = update.encoded_len();
        let mut sizes = sizes.lock().expect("lock");
        match update.update {
            Some(snapshot_update::Update::Full(_)) => sizes.full = size,
            Some(snapshot_update::Update::Live(_)) if measuring.load(Ordering::Relaxed) => {
                sizes.live_bytes += size;
                sizes.live_count += 1;
            }
            _ => {}
        }
    }
}

struct Sample {
    at: Instant,
    /// Each controller's, in cores-seconds.
    controller_cpu: Vec<f64>,
    etcd_cpu: f64,
    node_writes: f64,
    revision: i64,
    etcd_received: f64,
    resyncs: f64,
}

impl Sample {
    /// The controllers' counters are summed over them.
    async fn take(client: &HttpClient, metrics_urls: &[String], etcd: &Etcd) -> Sample {
        let mut texts = Vec::new();
        for url in metrics_urls {
            texts.push(String::from_utf8_lossy(&client.get(url).await.body).to_string());
        }
        let sum = |series: &str| texts.iter().map(|text| metric(text, series)).sum::<f64>();
        let etcd_text =
            String::from_utf8_lossy(&client.get(&format!("{}/metrics", etcd.endpoint())).await.body).to_string();
        let mut kv = etcd_client::Client::connect([etcd.endpoint()], None).await.expect("etcd");
        let revision = kv.get("/", None).await.expect("etcd get").header().map_or(0, |h| h.revision());
        Sample {
            at: Instant::now(),
            controller_cpu: (0..metrics_urls.len()).map(|i| thread_cpu_seconds(&format!("controller-{i}"))).collect(),
            etcd_cpu: process_cpu_seconds(etcd.pid()),
            node_writes: sum("inferyes_controller_node_writes_total"),
            revision,
            etcd_received: metric(&etcd_text, "etcd_network_client_grpc_received_bytes_total"),
            resyncs: sum("inferyes_controller_live_resyncs_total"),
        }
    }
}

async fn etcd_db_size(etcd: &Etcd) -> i64 {
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await.expect("etcd");
    client.status().await.expect("etcd status").db_size()
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|line| line.strip_prefix(series).and_then(|rest| rest.trim().parse::<f64>().ok()))
        .unwrap_or(0.0)
}

fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
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
