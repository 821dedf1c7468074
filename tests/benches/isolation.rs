//! Isolation under a flood: what one tenant's backlog costs another's
//! requests. Two simulated llama-servers of 4 slots (prompts read at 2,000
//! tokens/s, 20 tokens/s generated per slot); tenant A keeps 64 streams of
//! ~3,000-token prompts in flight, each 32 tokens long; tenant B sends one
//! short chat at a time. B's time to first token is measured idle, then
//! under A's flood, with the data plane's queue on and then off (each on a
//! fresh fleet), in one run; A's service time is how long a slot held one
//! of its requests (the fleet's slots times the flood's length over the
//! requests it served).
//!
//! ```sh
//! cargo bench -p inferyes-tests --bench isolation                     # 30 s of flood each
//! cargo bench -p inferyes-tests --bench isolation -- --seconds 60 --streams 64
//! cargo bench -p inferyes-tests --bench isolation -- --dataplanes 4   # A's streams dealt over four, B's chats through the first
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Method;
use inferyes_dataplane::auth::AuthMode;
use inferyes_proto::v1::CreateKeyRequest;
use inferyes_sim::SimConfig;
use inferyes_tests::client::next_chunk;
use inferyes_tests::{AgentHandle, ControllerHandle, DataplaneHandle, Etcd, HttpClient, SimHandle};
use serde_json::json;

const NODES: usize = 2;
const SLOTS: u32 = 4;
const FLOOD_PROMPT_WORDS: usize = 1_500;
const FLOOD_MAX_TOKENS: u32 = 32;

fn sim() -> SimConfig {
    SimConfig {
        slots: SLOTS,
        context: SLOTS * 8_192,
        prefill_tokens_per_second: 2_000.0,
        decode_tokens_per_second: 20.0,
        ..SimConfig::llama_server("chat")
    }
}

/// One streamed chat: its time to first token, or `None` where it failed.
async fn stream(http: &HttpClient, url: &str, bearer: &str, text: String, max_tokens: u32) -> Option<Duration> {
    let body = json!({"model": "chat", "stream": true, "max_tokens": max_tokens,
                      "messages": [{"role": "user", "content": text}]});
    let started = Instant::now();
    // Requests wait in a server's queue for minutes with the data plane's
    // queue off: no deadline short of the data plane's own.
    let headers = [("authorization", bearer)];
    let sent = http.start_within(Method::POST, url, Bytes::from(body.to_string()), &headers, Duration::from_secs(600));
    let response = sent.await.ok()?.ok()?;
    if !response.status().is_success() {
        return None;
    }
    let mut body = response.into_body();
    let mut ttft = None;
    while let Some(chunk) = next_chunk(&mut body).await {
        // The first chunk that carries output: queue notes are comments.
        if ttft.is_none() && String::from_utf8_lossy(&chunk).contains("\"content\":\"") {
            ttft = Some(started.elapsed());
        }
    }
    ttft
}

/// B's requests, one at a time, through `url`, for `length`: their times
/// to first token.
async fn light(http: &HttpClient, url: &str, bearer: &str, length: Duration) -> (Vec<Duration>, usize) {
    let until = Instant::now() + length;
    let (mut ttfts, mut failed) = (Vec::new(), 0);
    let mut i = 0;
    while Instant::now() < until {
        i += 1;
        match stream(http, url, bearer, format!("light question {i}: how are you?"), 8).await {
            Some(ttft) => ttfts.push(ttft),
            None => failed += 1,
        }
    }
    ttfts.sort();
    (ttfts, failed)
}

struct Row {
    queue: bool,
    idle: Vec<Duration>,
    flooded: Vec<Duration>,
    light_failed: usize,
    flood_done: u64,
    flood_failed: u64,
    flood_service: Duration,
}

async fn run(queue: bool, streams: usize, seconds: u64, dataplanes_count: usize) -> Row {
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller").await;
    let mut sims = Vec::new();
    let mut agents = Vec::new();
    for n in 0..NODES {
        let sim = SimHandle::start(sim()).await;
        let backends = inferyes_tests::fleet::sim_backends(&[("main", &sim)]);
        let defaults = inferyes_agent::Config::default();
        let agent = AgentHandle::start_tweaked(
            &format!("node-{n}"),
            &[controller.url()],
            inferyes_agent::config::GpuSourceConfig::Simulated,
            backends,
            |c| {
                c.poll_interval_ms = defaults.poll_interval_ms;
                c.min_report_interval_ms = defaults.min_report_interval_ms;
            },
        )
        .await;
        agents.push(agent);
        sims.push(sim);
    }
    let mut dataplanes = Vec::new();
    for i in 0..dataplanes_count {
        // Each its own id: the controllers split shares among them.
        let dataplane = DataplaneHandle::start_with(&[controller.url()], |c| {
            c.auth = AuthMode::Keys;
            c.queue = queue;
            c.dataplane_id = format!("dp-{i}");
        })
        .await;
        dataplane.wait_for_nodes(&["node-0", "node-1"]).await;
        dataplanes.push(dataplane);
    }
    let mut admin = controller.fleet().await;
    let mut secrets = Vec::new();
    for tenant in ["heavy", "light"] {
        let request = CreateKeyRequest { name: tenant.into(), tenant: tenant.into(), ..Default::default() };
        let created = admin.create_key(request).await.expect("key created").into_inner();
        let id = created.key.expect("a key").key_id;
        for dataplane in &dataplanes {
            let id = id.clone();
            dataplane.wait_for("the key", Duration::from_secs(10), move |s| s.api_key(&id).is_some()).await;
        }
        secrets.push(created.secret);
    }
    let (heavy, light_bearer) = (format!("Bearer {}", secrets[0]), format!("Bearer {}", secrets[1]));
    let http = HttpClient::default();
    // Each of A's streams on one data plane, in turn; B's requests all
    // through the first: fair shares hold across data planes, not only
    // within each one's queue.
    let urls: Vec<String> = dataplanes.iter().map(|d| format!("{}/v1/chat/completions", d.url)).collect();

    let idle = light(&http, &urls[0], &light_bearer, Duration::from_secs(5)).await.0;

    let stop = Arc::new(AtomicBool::new(false));
    let (done, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let flood_started = Instant::now();
    let document: String = (0..FLOOD_PROMPT_WORDS).map(|w| format!("w{} ", w % 97)).collect();
    let flood: Vec<_> = (0..streams)
        .map(|s| {
            let url = urls[s % urls.len()].clone();
            let (http, heavy, document) = (http.clone(), heavy.clone(), document.clone());
            let (stop, done, failed) = (stop.clone(), done.clone(), failed.clone());
            tokio::spawn(async move {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    // A fresh first token: no cache helps it.
                    let text = format!("stream {s} request {i}: {document}");
                    let counter = match stream(&http, &url, &heavy, text, FLOOD_MAX_TOKENS).await {
                        Some(_) => &done,
                        None => &failed,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    // Until the flood fills every slot and its backlog has formed.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (flooded, light_failed) = light(&http, &urls[0], &light_bearer, Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for task in flood {
        task.abort();
    }
    // A's service time: how long a slot holds one of its requests, from
    // the rate the saturated fleet served them.
    let served = done.load(Ordering::Relaxed).max(1);
    let flood_service = flood_started.elapsed().mul_f64(f64::from(SLOTS) * NODES as f64 / served as f64);
    drop((sims, agents, dataplanes));
    Row {
        queue,
        idle,
        flooded,
        light_failed,
        flood_done: done.load(Ordering::Relaxed),
        flood_failed: failed.load(Ordering::Relaxed),
        flood_service,
    }
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn arg(args: &[String], name: &str, default: u64) -> u64 {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let seconds = arg(&args, "--seconds", 30);
    let streams = arg(&args, "--streams", 64) as usize;
    let dataplanes = arg(&args, "--dataplanes", 1).max(1) as usize;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    let rows: Vec<Row> =
        [true, false].into_iter().map(|queue| runtime.block_on(run(queue, streams, seconds, dataplanes))).collect();
    println!(
        "isolation: {NODES} nodes x {SLOTS} slots, {dataplanes} data plane(s); tenant A keeps {streams} streams of \
         ~{} prompt tokens in flight; tenant B, one short chat at a time, {seconds} s",
        2 * FLOOD_PROMPT_WORDS
    );
    println!(
        "{:<10} {:>12} {:>12} {:>12} {:>12} {:>12} {:>10} {:>10} {:>12}",
        "queue",
        "B idle p50",
        "B idle p90",
        "B flood p50",
        "B flood p90",
        "B flood max",
        "B served",
        "A served",
        "A service"
    );
    for row in &rows {
        let ms = |d: Duration| format!("{} ms", d.as_millis());
        println!(
            "{:<10} {:>12} {:>12} {:>12} {:>12} {:>12} {:>10} {:>10} {:>12}",
            if row.queue { "on" } else { "off" },
            ms(percentile(&row.idle, 0.5)),
            ms(percentile(&row.idle, 0.9)),
            ms(percentile(&row.flooded, 0.5)),
            ms(percentile(&row.flooded, 0.9)),
            ms(row.flooded.last().copied().unwrap_or_default()),
            format!("{}/{}", row.flooded.len(), row.flooded.len() + row.light_failed),
            format!("{}/{}", row.flood_done, row.flood_done + row.flood_failed),
            ms(row.flood_service),
        );
    }
    for row in &rows {
        let bound = percentile(&row.idle, 0.9) + row.flood_service;
        let p90 = percentile(&row.flooded, 0.9);
        println!(
            "queue {}: B's p90 under the flood {} ms against idle p90 + one of A's service times, {} ms: {}",
            if row.queue { "on" } else { "off" },
            p90.as_millis(),
            bound.as_millis(),
            // A request that failed (refused after the queue's longest
            // wait, say) waited past any bound.
            if row.light_failed > 0 || row.flooded.is_empty() {
                "over (B's requests failed)"
            } else if p90 <= bound {
                "within"
            } else {
                "over"
            }
        );
    }
}
