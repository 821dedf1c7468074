//! The dashboard's picture of the fleet: one JSON document built from a
//! routing snapshot and the recent activity of data planes. Pure: the page
//! renders exactly this, and tests read exactly this.

use inferyes_proto::v1::{GpuSource, Health, ModelState};
use serde_json::{Value, json};

use crate::activity::Recent;
use crate::history::Pressure;
use crate::snapshot::Snapshot;

/// Sessions listed, most recently active first; the total is always given.
pub const SESSIONS_SHOWN: usize = crate::live::RECENT_SESSIONS;
/// Session keys are cut to this many characters on the page.
const KEY_SHOWN: usize = 24;

use inferyes_proto::{DEFAULT_ADMISSION_THRESHOLD as DEFAULT_ADMISSION, DEFAULT_HARD_LIMIT};

pub fn build(
    controller_id: &str,
    snapshot: &Snapshot,
    live: &crate::live::LiveView,
    recent: &Recent,
    history: &Pressure,
    now_ms: u64,
) -> Value {
    let policy = snapshot.policy();
    let fleet_admission = or(policy.admission_threshold, DEFAULT_ADMISSION);
    let fleet_hard = or(policy.hard_limit, DEFAULT_HARD_LIMIT);
    let mut gpus: Vec<Value> = Vec::new();
    for node in snapshot.merged_nodes(live) {
        gpus.extend(gpu_cards(&node, recent, history, (fleet_admission, fleet_hard)));
    }
    // Pressure first: the cards an operator must look at lead.
    gpus.sort_by(|a, b| {
        let f = |v: &Value| v["gpu"]["fraction"].as_f64().unwrap_or(0.0);
        f(b).total_cmp(&f(a)).then_with(|| a["node"].as_str().cmp(&b["node"].as_str()))
    });

    let mut view = json!({
        "controller": controller_id,
        "version": snapshot.version(),
        "now_ms": now_ms,
        "policy": { "admission": fleet_admission, "hard_limit": fleet_hard },
        "gpus": gpus,
        "sessions": sessions(live, now_ms),
        "models": models(snapshot),
        "decisions": decisions(recent),
        "ttft": recent.ttft,
        "dropped_decisions": recent.dropped,
        "queue": queue(recent),
    });
    plain_strings(&mut view);
    view
}

/// One card per GPU of `node` (one for a node without GPUs), each with
/// the node's load, backends, models and badges, and the GPU's pressure
/// against the node's thresholds (else the fleet's).
fn gpu_cards(
    node: &inferyes_proto::v1::SnapshotNode,
    recent: &Recent,
    history: &Pressure,
    (fleet_admission, fleet_hard): (f64, f64),
) -> Vec<Value> {
    let Some(status) = node.status.as_ref() else { return Vec::new() };
    let admission = node.policy.as_ref().map_or(fleet_admission, |p| or(p.admission_threshold, fleet_admission));
    let hard = node.policy.as_ref().map_or(fleet_hard, |p| or(p.hard_limit, fleet_hard));
    let backends = &status.backends;
    let slots_total: u32 = backends.iter().map(|b| b.slots_total).sum();
    let slots_busy: u32 = backends.iter().map(|b| b.slots_busy).sum();
    let deferred: u32 = backends.iter().map(|b| b.requests_deferred).sum();
    let rates = backend_rates(backends);
    let models: Vec<Value> = backends
        .iter()
        .flat_map(|b| b.models.iter().map(move |m| (b, m)))
        .map(|(backend, model)| json!({ "id": model.id, "backend": backend.id, "state": model_state(model.state()) }))
        .collect();
    let badges = node_badges(node, recent, (slots_total, slots_busy, deferred));
    let card = |gpu: Value, index: Option<u32>| {
        let fraction = gpu["fraction"].as_f64().unwrap_or(0.0);
        let mut badges = badges.clone();
        if gpu["stale"] == true {
            badges.push("GPU not read lately: no loads".into());
        }
        if fraction >= hard {
            badges.push("over hard limit".into());
        } else if fraction >= admission {
            badges.push("no new sessions".into());
        }
        json!({
            "node": status.node_id,
            "host": status.hostname,
            "gpu": gpu,
            "pressure": pressure(fraction, admission, hard),
            "admission": admission,
            "hard_limit": hard,
            "slots_busy": slots_busy,
            "slots_total": slots_total,
            "deferred": deferred,
            "in_flight": backends.iter().map(|b| b.in_flight).sum::<u32>(),
            "tokens_per_second": backends.iter().map(|b| b.tokens_per_second).sum::<f64>(),
            "backends": rates,
            "sessions": backends.iter().map(|b| b.resident_sessions).sum::<u32>(),
            "moves": status.moves.as_ref().map(|m| json!({
                "running": m.running,
                "sessions": m.sessions,
                "moved": m.moved,
                "failed": m.failed,
                "not_movable": m.not_movable,
                "bytes": m.bytes,
                "ms": m.finished_unix_ms.max(m.started_unix_ms) - m.started_unix_ms,
                "last_error": m.last_error,
            })),
            "models": models,
            "badges": badges,
            "history": history.of(&status.node_id, index),
        })
    };
    if status.gpus.is_empty() {
        return vec![card(json!({ "index": null, "name": "no GPU reported", "fraction": 0.0 }), None)];
    }
    status.gpus.iter().map(|gpu| card(gpu_reading(gpu), Some(gpu.index))).collect()
}

/// What routing weighs a queue and a recompute with, per backend.
fn backend_rates(backends: &[inferyes_proto::v1::Backend]) -> Vec<Value> {
    backends
        .iter()
        .map(|b| {
            json!({
                "id": b.id,
                "prefill_tokens_per_second": b.prefill_tokens_per_second,
                "service_ms": b.service_ms,
                "load_unknown": b.load_unknown,
                "slots_movable": !b.slot_fingerprint.is_empty(),
                "slots_unmovable": b.slots_unmovable,
                "kv_tier": b.kv_tier.as_ref().map(|t| json!({
                    "bytes": t.bytes,
                    "states": t.states,
                    "saves": t.saves,
                    "skipped": t.skipped,
                    "restores": t.restores,
                    "restore_failures": t.restore_failures,
                    "evicted": t.evicted,
                })),
            })
        })
        .collect()
}

/// What a node's card says of it whatever its GPUs read: draining, held
/// out by data planes, a backend not ready, requests queueing.
fn node_badges(
    node: &inferyes_proto::v1::SnapshotNode,
    recent: &Recent,
    (slots_total, slots_busy, deferred): (u32, u32, u32),
) -> Vec<String> {
    let Some(status) = node.status.as_ref() else { return Vec::new() };
    let mut badges: Vec<String> = Vec::new();
    if node.draining {
        badges.push("draining".into());
    }
    if let Some(by) = recent.ejected.get(&status.node_id) {
        badges.push(format!("ejected by {}", by.iter().cloned().collect::<Vec<_>>().join(", ")));
    }
    for backend in &status.backends {
        match backend.health() {
            Health::Down => badges.push(format!("{} down", backend.id)),
            Health::Loading => badges.push(format!("{} loading", backend.id)),
            Health::Unknown => badges.push(format!("{} unknown", backend.id)),
            Health::Ready => {}
        }
    }
    if slots_total > 0 && slots_busy >= slots_total && deferred > 0 {
        badges.push("queueing".into());
    }
    badges
}

fn gpu_reading(gpu: &inferyes_proto::v1::Gpu) -> Value {
    let fraction =
        if gpu.memory_total_bytes == 0 { 0.0 } else { gpu.memory_used_bytes as f64 / gpu.memory_total_bytes as f64 };
    json!({
        "index": gpu.index,
        "name": gpu.name,
        "used_bytes": gpu.memory_used_bytes,
        "total_bytes": gpu.memory_total_bytes,
        "fraction": fraction,
        "utilization_percent": gpu.utilization_percent,
        "source": gpu_source(gpu.source()),
        "stale": gpu.stale,
    })
}

/// Every string of `value` shown plain ([`inferyes_proto::shown_plain`]):
/// names come from clients, agents and backends, and one could make a row
/// read as another.
fn plain_strings(value: &mut Value) {
    match value {
        Value::String(text) => {
            if let std::borrow::Cow::Owned(plain) = inferyes_proto::shown_plain(text) {
                *text = plain;
            }
        }
        Value::Array(items) => items.iter_mut().for_each(plain_strings),
        Value::Object(members) => members.values_mut().for_each(plain_strings),
        _ => {}
    }
}

/// What waits in the data planes' queues, the longest waiting first.
fn queue(recent: &Recent) -> Vec<Value> {
    let mut flows: Vec<&(String, inferyes_proto::v1::QueuedFlow)> = recent.queued.iter().collect();
    flows.sort_by_key(|(_, flow)| std::cmp::Reverse(flow.oldest_wait_ms));
    flows
        .into_iter()
        .map(|(dataplane, flow)| {
            json!({
                "dataplane": dataplane,
                "flow": flow.flow,
                "class": if flow.priority() == inferyes_proto::v1::Priority::Batch { "batch" } else { "interactive" },
                "waiting": flow.waiting,
                "oldest_wait_ms": flow.oldest_wait_ms,
            })
        })
        .collect()
}

fn sessions(live: &crate::live::LiveView, now_ms: u64) -> Value {
    let shown: Vec<Value> = live
        .recent
        .iter()
        .take(SESSIONS_SHOWN)
        .map(|(node, s)| {
            json!({
                "tag": inferyes_proto::session_tag(&s.key),
                "key": s.key.chars().take(KEY_SHOWN).collect::<String>(),
                "node": node,
                "backend": s.backend_id,
                "model": s.model,
                "age_ms": now_ms.saturating_sub(s.first_seen_unix_ms),
                "idle_ms": now_ms.saturating_sub(s.last_seen_unix_ms),
                "turns": s.requests,
                "tokens": s.tokens,
                "cache_hits": s.cache_hits,
                "cache_misses": s.cache_misses,
            })
        })
        .collect();
    json!({ "total": live.sessions, "shown": shown })
}

fn models(snapshot: &Snapshot) -> Vec<Value> {
    let critical = &snapshot.policy().latency_critical_models;
    crate::snapshot::model_summaries(snapshot)
        .into_iter()
        .map(|m| {
            let is_critical = critical.contains(&m.id);
            let (warm, wanted) = (m.loaded_on.len(), m.desired_replicas as usize);
            let warning = (warm < wanted).then(|| match (is_critical, warm) {
                (true, 0 | 1) => format!("latency-critical but warm on {warm} node(s): no failover"),
                _ => format!("wants {wanted} warm nodes, warm on {warm} node(s)"),
            });
            let placing: Vec<String> = m
                .orders
                .iter()
                .map(|o| {
                    let action =
                        if o.action() == inferyes_proto::v1::PlacementAction::Load { "loading" } else { "unloading" };
                    format!("{action} on {}", o.node_id)
                })
                .collect();
            json!({
                "id": m.id,
                "warm_on": m.loaded_on,
                "desired": m.desired_replicas,
                "placing": placing,
                "available_on": m.available_on,
                "context_window": m.context_window,
                "latency_critical": is_critical,
                "warning": warning,
            })
        })
        .collect()
}

fn decisions(recent: &Recent) -> Vec<Value> {
    recent
        .decisions
        .iter()
        .map(|d| {
            let r = &d.decision;
            json!({
                "at_ms": r.unix_ms,
                "dataplane": d.dataplane_id,
                "request_id": r.request_id,
                "model": r.model,
                "node": r.node_id,
                "route": r.route,
                "status": r.status,
                "error": r.error_code,
                "latency_ms": r.latency_ms,
                "ttft_ms": r.ttft_ms,
                "expected_ttft_ms": r.expected_ttft_ms,
                "home_expected_ttft_ms": r.home_expected_ttft_ms,
                // What each node weighed would have cost; `inferyesctl
                // explain` has every term.
                "candidates": r.candidates.iter().map(|c| json!({
                    "node": c.node_id,
                    "standing": c.standing().name(),
                    "cache": c.cache().name(),
                    "cached_tokens": c.cached_tokens,
                    "queue_ahead": c.queue_ahead,
                    "cost_ms": c.cost_ms,
                    "over_bound": c.over_bound,
                    "passed_over": c.passed_over,
                })).collect::<Vec<_>>(),
                "stream": r.stream,
                "session": r.session_tag,
                "key": r.key_id,
            })
        })
        .collect()
}

fn or(value: f64, default: f64) -> f64 {
    if value > 0.0 { value } else { default }
}

fn pressure(fraction: f64, admission: f64, hard: f64) -> &'static str {
    if fraction >= hard {
        "critical"
    } else if fraction >= admission {
        "full"
    } else if fraction >= admission - 0.10 {
        "high"
    } else {
        "ok"
    }
}

fn model_state(state: ModelState) -> &'static str {
    match state {
        ModelState::Loaded => "warm",
        ModelState::Unloaded => "cold",
        ModelState::Loading => "loading",
        ModelState::Unknown => "unknown",
    }
}

fn gpu_source(source: GpuSource) -> &'static str {
    match source {
        GpuSource::Nvml => "nvml",
        GpuSource::NvidiaSmi => "nvidia-smi",
        GpuSource::Declared => "declared",
        GpuSource::Simulated => "simulated",
        GpuSource::Unspecified => "unknown",
    }
}
