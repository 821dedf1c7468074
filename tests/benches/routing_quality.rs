//! Routing quality: how much KV cache each routing policy reuses, and what
//! that does to time to first token, on a simulated 8-node fleet.
//!
//! ```sh
//! cargo bench -p inferyes-tests --bench routing_quality
//! ```
//!
//! Workload: 64 concurrent multi-turn chats of 6 turns with think time
//! between turns, four shared system prompts, and a skewed mix of three
//! models (70/20/10) over 8 simulated llama-servers (5 serve the popular
//! model, 2 the second, 1 the third). Each policy gets a fresh fleet (etcd,
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
use inferyes_agent::sim::SimConfig;
use inferyes_dataplane::routing::Mode;
use inferyes_tests::client::next_chunk;
use inferyes_tests::{AgentHandle, ControllerHandle, DataplaneHandle, Etcd, HttpClient, SimHandle};
use serde_json::{Value, json};

const NODES: usize = 8;
const CONVERSATIONS: usize = 64;
const TURNS: usize = 6;
const MODELS: [(&str, usize); 3] = [("popular", 5), ("second", 2), ("third", 1)];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Policy {
    Inferyes,
    RoundRobin,
    LeastOutstanding,
    Oracle,
}

impl Policy {
    fn name(self) -> &'static str {
        match self {
            Policy::Inferyes => "inferyes",
            Policy::RoundRobin => "round-robin",
            Policy::LeastOutstanding => "least-outstanding",
            Policy::Oracle => "oracle",
        }
    }
}

/// Which model node `n` serves.
fn model_of_node(n: usize) -> &'static str {
    let mut first = 0;
    for (model, count) in MODELS {
        if n < first + count {
            return model;
        }
        first += count;
    }
    MODELS[0].0
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
        slots: 4,
        context: 4 * 4096,
        prefill_tokens_per_second: 3000.0,
        decode_tokens_per_second: 400.0,
        cache_ram_tokens: 16_384,
        default_max_tokens: 24,
        ..SimConfig::llama_server(model)
    }
}

fn system_prompt(i: usize) -> String {
    let topics = ["a travel agent", "a code reviewer", "a patient tutor", "a support engineer"];
    format!(
        "You are {}. {}",
        topics[i % topics.len()],
        "Answer carefully, cite what you rely on, keep a friendly tone, and never invent facts. ".repeat(12)
    )
}

#[derive(Default)]
struct Tally {
    prompt_tokens: u64,
    cached_tokens: u64,
    ttft: Vec<Duration>,
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
    let (node, route) = (header("x-inferyes-node"), header("x-inferyes-route"));
    let mut stream = response.into_body();
    let mut ttft = None;
    let mut text = String::new();
    while let Some(chunk) = next_chunk(&mut stream).await {
        ttft.get_or_insert_with(|| started.elapsed());
        text.push_str(&String::from_utf8_lossy(&chunk));
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

async fn conversation(http: HttpClient, c: usize, target: String, oracle_headers: Option<String>) -> Tally {
    let model = model_of_conversation(c);
    let mut tally = Tally::default();
    let mut messages = vec![
        json!({"role": "system", "content": system_prompt(c)}),
        json!({"role": "user", "content": format!("Conversation {c}: where do we start?")}),
    ];
    // Deterministic think time, 50-250 ms.
    let think = Duration::from_millis(50 + (c as u64 * 37) % 200);
    let mut previous: Option<String> = None;
    for t in 0..TURNS {
        let body = json!({
            "model": model, "messages": messages, "stream": true,
            "stream_options": {"include_usage": true}, "max_tokens": 24,
        });
        // The oracle goes around the data plane, so it shows the agent the
        // fleet's join token as a data plane does.
        let authorization = inferyes_tests::fleet::agent_authorization();
        let headers: Vec<(&str, &str)> = match &oracle_headers {
            Some(backend) => vec![
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
                tally.ttft.push(ttft);
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

async fn run(policy: Policy) -> Tally {
    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller").await;
    let mut sims = Vec::new();
    let mut agents = Vec::new();
    for n in 0..NODES {
        let sim = SimHandle::start(sim(model_of_node(n))).await;
        agents.push(AgentHandle::start(&format!("node-{n}"), &[controller.url()], &[("main", &sim)]).await);
        sims.push(sim);
    }
    let mode = match policy {
        Policy::RoundRobin => Mode::RoundRobin,
        Policy::LeastOutstanding => Mode::LeastOutstanding,
        Policy::Inferyes | Policy::Oracle => Mode::Policy,
    };
    let dataplane = DataplaneHandle::start_with(&[controller.url()], |c| c.routing_mode = mode).await;
    let ids: Vec<String> = (0..NODES).map(|n| format!("node-{n}")).collect();
    dataplane.wait_for_nodes(&ids.iter().map(String::as_str).collect::<Vec<_>>()).await;

    let http = HttpClient::default();
    let mut tasks = Vec::new();
    for c in 0..CONVERSATIONS {
        let (target, oracle) = if policy == Policy::Oracle {
            // Spread the model's conversations evenly over its nodes.
            let nodes: Vec<usize> = (0..NODES).filter(|n| model_of_node(*n) == model_of_conversation(c)).collect();
            let same_model_index = (0..c).filter(|o| model_of_conversation(*o) == model_of_conversation(c)).count();
            let node = nodes[same_model_index % nodes.len()];
            (format!("http://{}/v1/chat/completions", agents[node].proxy_addr), Some("main".to_string()))
        } else {
            (format!("{}/v1/chat/completions", dataplane.url), None)
        };
        tasks.push(tokio::spawn(conversation(http.clone(), c, target, oracle)));
    }
    let mut total = Tally::default();
    for task in tasks {
        let tally = task.await.expect("conversation task");
        total.prompt_tokens += tally.prompt_tokens;
        total.cached_tokens += tally.cached_tokens;
        total.ttft.extend(tally.ttft);
        total.errors += tally.errors;
        total.moves += tally.moves;
        for (route, count) in tally.routes {
            *total.routes.entry(route).or_default() += count;
        }
        for (node, count) in tally.per_node {
            *total.per_node.entry(node).or_default() += count;
        }
    }
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
    total
}

/// Requests per node relative to the average over the nodes serving the
/// same model: the balance the policy can influence.
fn max_load_ratio(per_node: &BTreeMap<String, u64>) -> f64 {
    let mut worst: f64 = 0.0;
    for (model, _) in MODELS {
        let loads: Vec<u64> = (0..NODES)
            .filter(|n| model_of_node(*n) == model)
            .map(|n| per_node.get(&format!("node-{n}")).copied().unwrap_or(0))
            .collect();
        let average = loads.iter().sum::<u64>() as f64 / loads.len() as f64;
        if average > 0.0 {
            worst = worst.max(*loads.iter().max().unwrap_or(&0) as f64 / average);
        }
    }
    worst
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    sorted.get(((sorted.len() as f64 * q) as usize).min(sorted.len().saturating_sub(1))).copied().unwrap_or_default()
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    let policies = [Policy::Oracle, Policy::Inferyes, Policy::RoundRobin, Policy::LeastOutstanding];
    let mut rows = Vec::new();
    for policy in policies {
        let mut tally = runtime.block_on(run(policy));
        tally.ttft.sort_unstable();
        rows.push((policy, tally));
    }
    let oracle_reuse = {
        let o = &rows[0].1;
        o.cached_tokens as f64 / o.prompt_tokens.max(1) as f64
    };
    let oracle_p50 = percentile(&rows[0].1.ttft, 0.5);
    println!(
        "\n{} conversations x {} turns, {} nodes; KV reuse = cached prompt tokens / prompt tokens",
        CONVERSATIONS, TURNS, NODES
    );
    println!(
        "{:<18} {:>9} {:>11} {:>10} {:>10} {:>12} {:>14} {:>7} {:>7}",
        "policy", "KV reuse", "of oracle", "TTFT p50", "TTFT p99", "p50/oracle", "max/avg load", "moves", "errors"
    );
    for (policy, tally) in &rows {
        let reuse = tally.cached_tokens as f64 / tally.prompt_tokens.max(1) as f64;
        let p50 = percentile(&tally.ttft, 0.5);
        println!(
            "{:<18} {:>8.1}% {:>10.1}% {:>10.1?} {:>10.1?} {:>12.2} {:>14.2} {:>7} {:>7}",
            policy.name(),
            reuse * 100.0,
            reuse / oracle_reuse * 100.0,
            p50,
            percentile(&tally.ttft, 0.99),
            p50.as_secs_f64() / oracle_p50.as_secs_f64(),
            max_load_ratio(&tally.per_node),
            tally.moves,
            tally.errors,
        );
    }
    for (policy, tally) in &rows {
        if !tally.routes.is_empty() {
            println!("{}: routes of turns 2-{TURNS}: {:?}", policy.name(), tally.routes);
        }
    }
}
