//! Routing quality: how much KV cache each routing policy reuses, and what
//! that does to time to first token and to the workload's wall time, on
//! simulated fleets from idle to four conversations per slot.
//!
//! ```sh
//! cargo bench -p inferyes-tests --bench routing_quality                        # 8 and 64 nodes, 1x 2x 4x
//! cargo bench -p inferyes-tests --bench routing_quality -- --nodes 8 --load 2  # one scenario
//! cargo bench -p inferyes-tests --bench routing_quality -- --policies inferyes,round-robin
//! ```
//!
//! Fleet: simulated llama-servers of 4 slots, reading prompts at 1,000
//! tokens/s and generating 20 tokens/s per slot, a 64k-token host prompt
//! cache each. Five eighths of the nodes serve the popular model, a quarter
//! the second, an eighth the third. Workload: `load` conversations per slot
//! of the fleet, all at once, each its own user: 6 turns, 50-250 ms of
//! think time between them, a system prompt shared by a quarter of the
//! conversations and a document of its own (~1,100 tokens in all), a
//! 70/20/10 mix of the models. Each policy gets a fresh fleet (etcd,
//! controller, agents, simulators, data plane) and the same workload:
//!
//! - inferyes: the data plane's policy (sessions by conversation root);
//! - round-robin and least-outstanding: the same data plane in a baseline
//!   mode that ignores sessions;
//! - oracle: each conversation sent straight to one node's agent, spread
//!   evenly over the nodes serving its model: perfect stickiness.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Method;
use inferyes_dataplane::routing::Mode;
use inferyes_sim::SimConfig;
use inferyes_tests::client::next_chunk;
use inferyes_tests::{AgentHandle, ControllerHandle, DataplaneHandle, Etcd, HttpClient, SimHandle};
use serde_json::{Value, json};

const SLOTS: usize = 4;
const TURNS: usize = 6;
const MAX_TOKENS: u32 = 8;
/// The models, and the eighths of the fleet that serve each.
const MODELS: [(&str, usize); 3] = [("popular", 5), ("second", 2), ("third", 1)];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Policy {
    Inferyes,
    RoundRobin,
    LeastOutstanding,
    Oracle,
}

impl Policy {
    const ALL: [Policy; 4] = [Policy::Oracle, Policy::Inferyes, Policy::RoundRobin, Policy::LeastOutstanding];

    fn name(self) -> &'static str {
        match self {
            Policy::Inferyes => "inferyes",
            Policy::RoundRobin => "round-robin",
            Policy::LeastOutstanding => "least-outstanding",
            Policy::Oracle => "oracle",
        }
    }
}

/// A fleet size and how many conversations it carries per slot.
#[derive(Clone, Copy, Debug)]
struct Scenario {
    nodes: usize,
    load: usize,
}

impl Scenario {
    fn conversations(self) -> usize {
        self.nodes * SLOTS * self.load
    }

    /// Which model node `n` serves.
    fn model_of_node(self, n: usize) -> &'static str {
        let mut first = 0;
        for (model, eighths) in MODELS {
            first += self.nodes * eighths / 8;
            if n < first {
                return model;
            }
        }
        MODELS[0].0
    }
}

/// The model of conversation `c`: 70% popular, 20% second, 10% third.
fn model_of_conversation(c: usize) -> &'static str {
    match c % 10 {
        0..=6 => "popular",
        7 | 8 => "second",
        _ => "third",
    }
}

fn sim(model: &str) -> SimConfig {
    SimConfig {
        slots: SLOTS as u32,
        context: SLOTS as u32 * 4096,
        prefill_tokens_per_second: 1_000.0,
        decode_tokens_per_second: 20.0,
        cache_ram_tokens: 65_536,
        default_max_tokens: MAX_TOKENS,
        ..SimConfig::llama_server(model)
    }
}

fn system_prompt(c: usize) -> String {
    let topics = ["a travel agent", "a code reviewer", "a patient tutor", "a support engineer"];
    format!(
        "You are {}. {}",
        topics[c % topics.len()],
        "Answer carefully, cite what you rely on, keep a friendly tone, and never invent facts. ".repeat(12)
    )
}

/// The conversation's own material: what makes a lost cache expensive.
fn document(c: usize) -> String {
    (0..90).map(|i| format!("record {c} line {i} ")).collect()
}

#[derive(Default)]
struct Tally {
    prompt_tokens: u64,
    cached_tokens: u64,
    first_ttft: Vec<Duration>,
    later_ttft: Vec<Duration>,
    per_node: BTreeMap<String, u64>,
    /// Turns served on another node than the conversation's previous turn.
    moves: u64,
    /// `x-inferyes-route` of each turn after the first.
    routes: BTreeMap<String, u64>,
    errors: u64,
}

async fn turn(
    http: &HttpClient,
    url: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> Option<(Duration, Value, String, String)> {
    let started = Instant::now();
    let response = http.start(Method::POST, url, Bytes::from(body.to_string()), headers).await;
    if !response.status().is_success() {
        return None;
    }
    let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let (mut node, route) = (header("x-inferyes-node"), header("x-inferyes-route"));
    let mut stream = response.into_body();
    let mut ttft = None;
    let mut text = String::new();
    while let Some(chunk) = next_chunk(&mut stream).await {
        text.push_str(&String::from_utf8_lossy(&chunk));
        // The node's first event, not the queue's notes while it waits.
        if ttft.is_none() && text.contains("data: ") {
            ttft = Some(started.elapsed());
        }
    }
    // A stream let out of the queue names its node in a note.
    if let Some(named) = text.split("\n").find_map(|line| line.strip_prefix(": sent to node ")) {
        node = named.to_string();
    }
    let mut reply = String::new();
    let mut usage = Value::Null;
    for event in text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")) {
        let Ok(value) = serde_json::from_str::<Value>(event) else { continue };
        if let Some(piece) = value["choices"][0]["delta"]["content"].as_str() {
            reply.push_str(piece);
        }
        if value["usage"].is_object() {
            usage = value["usage"].clone();
        }
    }
    Some((ttft?, json!({"reply": reply, "usage": usage}), node, route))
}

/// `oracle`: the backend to ask for, and the node's credential, where the
/// conversation goes straight to an agent.
async fn conversation(http: HttpClient, c: usize, target: String, oracle: Option<(String, String)>) -> Tally {
    let model = model_of_conversation(c);
    let mut tally = Tally::default();
    let mut messages = vec![
        json!({"role": "system", "content": system_prompt(c)}),
        json!({"role": "user", "content": format!("Conversation {c}, about this: {}. Where do we start?", document(c))}),
    ];
    // Deterministic think time, 50-250 ms.
    let think = Duration::from_millis(50 + (c as u64 * 37) % 200);
    let mut previous: Option<String> = None;
    for t in 0..TURNS {
        let body = json!({
            "model": model, "messages": messages, "stream": true,
            "stream_options": {"include_usage": true}, "max_tokens": MAX_TOKENS,
        });
        // The oracle goes around the data plane, so it shows the agent its
        // credential as a data plane does.
        let headers: Vec<(&str, &str)> = match &oracle {
            Some((backend, authorization)) => vec![
                ("x-inferyes-backend", backend.as_str()),
                ("x-inferyes-model", model),
                ("authorization", authorization.as_str()),
            ],
            None => Vec::new(),
        };
        match turn(&http, &target, &body, &headers).await {
            Some((ttft, result, node, route)) => {
                if t > 0 && !route.is_empty() {
                    *tally.routes.entry(route).or_default() += 1;
                }
                if t == 0 { &mut tally.first_ttft } else { &mut tally.later_ttft }.push(ttft);
                tally.prompt_tokens += result["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
                tally.cached_tokens += result["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
                let node = if node.is_empty() { target.clone() } else { node };
                if previous.as_ref().is_some_and(|p| *p != node) {
                    tally.moves += 1;
                }
                previous = Some(node.clone());
                *tally.per_node.entry(node).or_default() += 1;
                messages.push(json!({"role": "assistant", "content": result["reply"]}));
            }
            None => tally.errors += 1,
        }
        messages.push(json!({"role": "user", "content": format!("Turn {t}: tell me more about step {t}.")}));
        tokio::time::sleep(think).await;
    }
    tally
}

async fn run(scenario: Scenario, policy: Policy) -> (Tally, Duration) {
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller").await;
    let mut sims = Vec::new();
    let mut agents = Vec::new();
    for n in 0..scenario.nodes {
        let sim = SimHandle::start(sim(scenario.model_of_node(n))).await;
        // Agents poll and report at their default intervals, as deployed.
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
    let mode = match policy {
        Policy::RoundRobin => Mode::RoundRobin,
        Policy::LeastOutstanding => Mode::LeastOutstanding,
        Policy::Inferyes | Policy::Oracle => Mode::Policy,
    };
    let dataplane = DataplaneHandle::start_with(&[controller.url()], |c| {
        c.routing_mode = mode;
        // Every conversation comes from this one client, as if from many:
        // it may hold every connection (1,024 at 64 nodes, 4x) and fill
        // the queue (768 of them wait), which one address or one flow may
        // not by default.
        c.max_connections_per_client = c.max_connections;
        c.queue_flow_share_percent = 100;
    })
    .await;
    let ids: Vec<String> = (0..scenario.nodes).map(|n| format!("node-{n}")).collect();
    dataplane.wait_for_nodes(&ids.iter().map(String::as_str).collect::<Vec<_>>()).await;

    let http = HttpClient::default();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..scenario.conversations() {
        let (target, oracle) = if policy == Policy::Oracle {
            // Spread the model's conversations evenly over its nodes.
            let model = model_of_conversation(c);
            let nodes: Vec<usize> = (0..scenario.nodes).filter(|n| scenario.model_of_node(*n) == model).collect();
            let same_model_index = (0..c).filter(|o| model_of_conversation(*o) == model).count();
            let node = nodes[same_model_index % nodes.len()];
            let authorization = inferyes_tests::fleet::agent_authorization(&etcd, &agents[node].node_id).await;
            (
                format!("http://{}/v1/chat/completions", agents[node].proxy_addr),
                Some(("main".to_string(), authorization)),
            )
        } else {
            (format!("{}/v1/chat/completions", dataplane.url), None)
        };
        tasks.push(tokio::spawn(conversation(http.clone(), c, target, oracle)));
    }
    let mut total = Tally::default();
    for task in tasks {
        // A conversation whose request went unanswered past the client's
        // deadline ended there: an error, not the end of the run.
        let Ok(tally) = task.await else {
            total.errors += 1;
            continue;
        };
        total.prompt_tokens += tally.prompt_tokens;
        total.cached_tokens += tally.cached_tokens;
        total.first_ttft.extend(tally.first_ttft);
        total.later_ttft.extend(tally.later_ttft);
        total.errors += tally.errors;
        total.moves += tally.moves;
        for (route, count) in tally.routes {
            *total.routes.entry(route).or_default() += count;
        }
        for (node, count) in tally.per_node {
            *total.per_node.entry(node).or_default() += count;
        }
    }
    let wall = started.elapsed();
    if policy == Policy::Oracle {
        // Name nodes like the data plane does.
        total.per_node = total
            .per_node
            .into_iter()
            .map(|(url, count)| {
                let n = agents.iter().position(|a| url.contains(&a.proxy_addr.to_string())).unwrap_or(0);
                (format!("node-{n}"), count)
            })
            .collect();
    }
    dataplane.stop().await;
    for agent in agents {
        agent.stop().await;
    }
    for sim in sims {
        sim.stop().await;
    }
    controller.stop().await;
    total.first_ttft.sort_unstable();
    total.later_ttft.sort_unstable();
    (total, wall)
}

/// Requests per node relative to the average over the nodes serving the
/// same model: the balance the policy can influence.
fn max_load_ratio(scenario: Scenario, per_node: &BTreeMap<String, u64>) -> f64 {
    let mut worst: f64 = 0.0;
    for (model, _) in MODELS {
        let loads: Vec<u64> = (0..scenario.nodes)
            .filter(|n| scenario.model_of_node(*n) == model)
            .map(|n| per_node.get(&format!("node-{n}")).copied().unwrap_or(0))
            .collect();
        let average = loads.iter().sum::<u64>() as f64 / loads.len().max(1) as f64;
        if average > 0.0 {
            worst = worst.max(*loads.iter().max().unwrap_or(&0) as f64 / average);
        }
    }
    worst
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    sorted.get(((sorted.len() as f64 * q) as usize).min(sorted.len().saturating_sub(1))).copied().unwrap_or_default()
}

fn report(scenario: Scenario, rows: &[(Policy, Tally, Duration)]) {
    let reuse = |t: &Tally| t.cached_tokens as f64 / t.prompt_tokens.max(1) as f64;
    let oracle_reuse = rows.iter().find(|(p, ..)| *p == Policy::Oracle).map(|(_, t, _)| reuse(t));
    let round_robin = rows.iter().find(|(p, ..)| *p == Policy::RoundRobin).map(|(_, t, w)| (t, *w));
    let conversations = scenario.conversations();
    println!(
        "\n{} nodes x {SLOTS} slots, {conversations} conversations at once ({}x the slots) x {TURNS} turns; \
         KV reuse = cached prompt tokens / prompt tokens",
        scenario.nodes, scenario.load
    );
    println!(
        "{:<18} {:>8} {:>9} {:>11} {:>11} {:>11} {:>8} {:>6} {:>8} {:>7} {:>6}",
        "policy",
        "KV reuse",
        "of oracle",
        "turn 1 p50",
        "later p50",
        "later p99",
        "max/avg",
        "moves",
        "wall",
        "/ RR",
        "errors"
    );
    for (policy, tally, wall) in rows {
        let of_oracle = oracle_reuse.map_or("-".to_string(), |o| format!("{:.1}%", reuse(tally) / o * 100.0));
        let of_rr =
            round_robin.map_or("-".to_string(), |(_, rr)| format!("{:.2}", wall.as_secs_f64() / rr.as_secs_f64()));
        println!(
            "{:<18} {:>7.1}% {:>9} {:>11.1?} {:>11.1?} {:>11.1?} {:>8.2} {:>6} {:>7.1}s {:>7} {:>6}",
            policy.name(),
            reuse(tally) * 100.0,
            of_oracle,
            percentile(&tally.first_ttft, 0.5),
            percentile(&tally.later_ttft, 0.5),
            percentile(&tally.later_ttft, 0.99),
            max_load_ratio(scenario, &tally.per_node),
            tally.moves,
            wall.as_secs_f64(),
            of_rr,
            tally.errors,
        );
    }
    for (policy, tally, _) in rows {
        if !tally.routes.is_empty() {
            println!("{}: routes of turns 2-{TURNS}: {:?}", policy.name(), tally.routes);
        }
    }
    if let (Some((_, inferyes, wall)), Some((rr, rr_wall)), Some(oracle)) =
        (rows.iter().find(|(p, ..)| *p == Policy::Inferyes), round_robin, oracle_reuse)
    {
        println!(
            "targets: reuse {:.1}% of the oracle's (>= 90%), wall {:.2}x round-robin's (<= 0.8), \
             later-turn p99 {:.2}x round-robin's (<= 1)",
            reuse(inferyes) / oracle * 100.0,
            wall.as_secs_f64() / rr_wall.as_secs_f64(),
            percentile(&inferyes.later_ttft, 0.99).as_secs_f64() / percentile(&rr.later_ttft, 0.99).as_secs_f64(),
        );
    }
}

/// `--name 1,2,3`, else `default`.
fn list(args: &[String], name: &str, default: &[usize]) -> Vec<usize> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.split(',').map(|n| n.trim().parse().expect("a number")).collect())
        .unwrap_or_else(|| default.to_vec())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let sizes = list(&args, "--nodes", &[8, 64]);
    let loads = list(&args, "--load", &[1, 2, 4]);
    let policies: Vec<Policy> = match args.iter().position(|a| a == "--policies").and_then(|i| args.get(i + 1)) {
        Some(names) => names
            .split(',')
            .map(|name| *Policy::ALL.iter().find(|p| p.name() == name.trim()).expect("a policy's name"))
            .collect(),
        None => Policy::ALL.to_vec(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    for nodes in sizes {
        assert!(nodes >= 8 && nodes % 8 == 0, "--nodes takes multiples of 8: the models take eighths of the fleet");
        for &load in &loads {
            let scenario = Scenario { nodes, load };
            let rows: Vec<(Policy, Tally, Duration)> = policies
                .iter()
                .copied()
                .map(|policy| {
                    let (tally, wall) = runtime.block_on(run(scenario, policy));
                    (policy, tally, wall)
                })
                .collect();
            report(scenario, &rows);
        }
    }
}
