//! What each command prints, in both forms from the same answer: a text
//! table or summary for people (`-o table`), JSON for scripts (`-o json`).
//! Every answer a command prints is a [`Render`]; `run` only makes the
//! call and picks the form.

use std::fmt::Write as _;

use inferyes_proto::kinds;
use inferyes_proto::v1::{
    ApiKey, Backend, CacheSource, Candidate, CreatedKey, EndpointKind, ExplainResponse, Gpu, ListAliasesResponse,
    ListKeysResponse, ListModelsResponse, ListNodesResponse, ListSessionsResponse, ModelPlacement, ModelState,
    MoveProgress, PlacementAction, PlacementOrder, RoutingDecision, RoutingPolicy, SnapshotNode, Standing, Strategy,
    UsageRecord, UsageReport, UsageRow,
};
use serde_json::{Value, json};

use crate::Output;

/// An answer as a command prints it.
pub trait Render {
    /// For people: a table, or a line or two.
    fn text(&self) -> String;
    /// For scripts.
    fn json(&self) -> Value;
}

/// `answer` in the form asked for. A table is for a terminal: names from
/// agents and backends in it cannot move the cursor, retitle the window
/// or reverse the text around them.
pub fn render(answer: &impl Render, output: Output) -> String {
    match output {
        Output::Table => inferyes_proto::shown_plain(&answer.text()).into_owned(),
        Output::Json => render_json(&answer.json()),
    }
}

impl Render for ListNodesResponse {
    fn text(&self) -> String {
        nodes_table(&self.nodes)
    }

    fn json(&self) -> Value {
        json!({"version": self.version, "nodes": self.nodes.iter().map(node_json).collect::<Vec<_>>()})
    }
}

impl Render for SnapshotNode {
    fn text(&self) -> String {
        node_detail(self)
    }

    fn json(&self) -> Value {
        node_json(self)
    }
}

impl Render for ListModelsResponse {
    fn text(&self) -> String {
        let rows = self
            .models
            .iter()
            .map(|m| {
                let placing: Vec<String> = m.orders.iter().map(order_text).collect();
                vec![
                    m.id.clone(),
                    m.loaded_on.len().to_string(),
                    if m.desired_replicas == 0 { "-".into() } else { m.desired_replicas.to_string() },
                    m.available_on.len().to_string(),
                    if m.context_window == 0 { "-".into() } else { m.context_window.to_string() },
                    m.placements.iter().map(placement_text).collect::<Vec<_>>().join(" "),
                    if placing.is_empty() { "-".into() } else { placing.join(", ") },
                ]
            })
            .collect();
        table(&["MODEL", "WARM", "WANT", "NODES", "CONTEXT", "ON (STATE: KINDS)", "PLACING"], rows)
    }

    fn json(&self) -> Value {
        let models: Vec<Value> = self
            .models
            .iter()
            .map(|m| {
                let placements: Vec<Value> = m
                    .placements
                    .iter()
                    .map(|p| {
                        json!({
                            "node_id": p.node_id,
                            "backend_id": p.backend_id,
                            "state": model_state(p.state()),
                            "kinds": kinds_served(p),
                        })
                    })
                    .collect();
                json!({
                    "id": m.id,
                    "loaded_on": m.loaded_on,
                    "available_on": m.available_on,
                    "context_window": m.context_window,
                    "endpoints": m.endpoints().map(|e| e.as_str_name()).collect::<Vec<_>>(),
                    "placements": placements,
                    "desired_replicas": m.desired_replicas,
                    "placing": m.orders.iter().map(|o| json!({
                        "action": action_name(o.action()),
                        "node_id": o.node_id,
                        "backend_id": o.backend_id,
                        "issued_unix_ms": o.issued_unix_ms,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        json!({"version": self.version, "models": models})
    }
}

/// An outstanding placement order, as `load node-c/main`.
fn order_text(order: &PlacementOrder) -> String {
    format!("{} {}/{}", action_name(order.action()), order.node_id, order.backend_id)
}

fn action_name(action: PlacementAction) -> &'static str {
    match action {
        PlacementAction::Load => "load",
        PlacementAction::Unload => "unload",
        PlacementAction::Unspecified => "unspecified",
    }
}

/// A model's state as routing sees it: warm where a request is served at
/// once, cold where it starts a load.
fn model_state(state: ModelState) -> &'static str {
    match state {
        ModelState::Loaded => "warm",
        ModelState::Loading => "loading",
        ModelState::Unloaded => "cold",
        ModelState::Unknown => "unknown",
    }
}

/// The kinds of job a backend serves for a model: those it lists, else
/// any but those it is known not to.
fn kinds_served(p: &ModelPlacement) -> String {
    let names = |kinds: &[i32]| {
        kinds.iter().filter_map(|k| EndpointKind::try_from(*k).ok()).map(kinds::name).collect::<Vec<_>>()
    };
    let unsupported = names(&p.unsupported);
    if p.endpoints.is_empty() {
        return match unsupported.is_empty() {
            true => "any".into(),
            false => format!("any but {}", unsupported.join(",")),
        };
    }
    let served: Vec<&str> = names(&p.endpoints).into_iter().filter(|k| !unsupported.contains(k)).collect();
    if served.is_empty() { "none".into() } else { served.join(",") }
}

fn placement_text(p: &ModelPlacement) -> String {
    format!("{}/{}({}: {})", p.node_id, p.backend_id, model_state(p.state()), kinds_served(p))
}

/// The fleet's sessions, their ages as of `now_s` (Unix seconds).
pub struct Sessions {
    pub response: ListSessionsResponse,
    pub now_s: u64,
}

impl Render for Sessions {
    fn text(&self) -> String {
        let rows = self
            .response
            .sessions
            .iter()
            .filter_map(|s| s.session.as_ref().map(|r| (s, r)))
            .map(|(s, r)| {
                vec![
                    r.key.clone(),
                    s.node_id.clone(),
                    r.backend_id.clone(),
                    r.model.clone(),
                    format!("{}s", self.now_s.saturating_sub(r.first_seen_unix_ms / 1000)),
                    format!("{}s", self.now_s.saturating_sub(r.last_seen_unix_ms / 1000)),
                    r.requests.to_string(),
                ]
            })
            .collect();
        let mut out = table(&["SESSION", "NODE", "BACKEND", "MODEL", "AGE", "IDLE", "REQUESTS"], rows);
        if self.response.truncated {
            out.push_str("(more sessions than one answer holds: the most recent shown)\n");
        }
        out
    }

    fn json(&self) -> Value {
        let sessions: Vec<Value> = self
            .response
            .sessions
            .iter()
            .filter_map(|s| s.session.as_ref().map(|r| (s, r)))
            .map(|(s, r)| {
                json!({"node": s.node_id, "key": r.key, "backend": r.backend_id, "model": r.model,
                       "first_seen_unix_ms": r.first_seen_unix_ms, "last_seen_unix_ms": r.last_seen_unix_ms, "requests": r.requests,
                       "tokens": r.tokens, "cache_hits": r.cache_hits, "cache_misses": r.cache_misses})
            })
            .collect();
        json!({"version": self.response.version, "sessions": sessions, "truncated": self.response.truncated})
    }
}

impl Render for ExplainResponse {
    fn text(&self) -> String {
        let Some(d) = &self.decision else { return "no decision in the answer\n".into() };
        let mut out = format!("request {} for {}, routed by data plane {}\n", d.request_id, d.model, self.dataplane_id);
        let session =
            if d.session_tag.is_empty() { "no session".to_string() } else { format!("session {}", d.session_tag) };
        let _ = writeln!(
            out,
            "{session}; route {} to {}; status {}{}",
            d.route,
            or_dash(&d.node_id),
            d.status,
            if d.ttft_ms > 0 { format!(", first token after {}", seconds(d.ttft_ms)) } else { String::new() },
        );
        if d.candidates.is_empty() {
            out.push_str("no node was weighed: the request ended before routing\n");
            return out;
        }
        out.push('\n');
        let rows = d
            .candidates
            .iter()
            .enumerate()
            .map(|(index, c)| {
                vec![
                    format!("{}/{}", c.node_id, c.backend_id),
                    candidate_role(index, c, d),
                    c.standing().name().to_string(),
                    if c.cached_tokens == 0 { "-".into() } else { format!("{} {}", c.cached_tokens, c.cache().name()) },
                    c.queue_ahead.to_string(),
                    seconds(c.wait_ms),
                    seconds(c.prefill_ms),
                    seconds(c.carry_ms),
                    seconds(c.move_ms),
                    if c.standing() == Standing::Cold {
                        "load + ".to_string() + &seconds(c.prefill_ms)
                    } else {
                        seconds(c.cost_ms)
                    },
                    format!("{}{}", c.sessions, if c.over_bound { " over bound" } else { "" }),
                    format!("{}%", c.memory_permille / 10),
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                "NODE", "ROLE", "STANDING", "CACHED", "AHEAD", "WAIT", "PREFILL", "CARRY", "MOVE", "COST", "SESSIONS",
                "MEMORY",
            ],
            rows,
        ));
        let _ = writeln!(out, "\nwhy: {}", why(d));
        out
    }

    fn json(&self) -> Value {
        let Some(d) = &self.decision else { return json!({"dataplane_id": self.dataplane_id}) };
        let candidates: Vec<Value> = d
            .candidates
            .iter()
            .map(|c| {
                json!({"node_id": c.node_id, "backend_id": c.backend_id, "passed_over": c.passed_over,
                       "standing": c.standing().name(), "prompt_tokens": c.prompt_tokens,
                       "cached_tokens": c.cached_tokens, "cache": c.cache().name(), "queue_ahead": c.queue_ahead,
                       "wait_ms": c.wait_ms, "prefill_ms": c.prefill_ms, "carry_ms": c.carry_ms,
                       "move_ms": c.move_ms, "ttft_ms": c.ttft_ms, "cost_ms": c.cost_ms, "sessions": c.sessions,
                       "over_bound": c.over_bound, "preferred": c.preferred, "memory_permille": c.memory_permille})
            })
            .collect();
        json!({
            "dataplane_id": self.dataplane_id, "request_id": d.request_id, "unix_ms": d.unix_ms,
            "model": d.model, "node_id": d.node_id, "route": d.route, "status": d.status,
            "error_code": d.error_code, "session_tag": d.session_tag, "key_id": d.key_id,
            "ttft_ms": d.ttft_ms, "expected_ttft_ms": d.expected_ttft_ms,
            "home_expected_ttft_ms": d.home_expected_ttft_ms, "candidates": candidates, "why": why(d),
        })
    }
}

/// What a candidate was to the request: the target tried first, a
/// failover, or the node its session preferred, passed over.
fn candidate_role(index: usize, c: &Candidate, d: &RoutingDecision) -> String {
    let mut role = match (index, c.passed_over) {
        (_, true) => "passed over".to_string(),
        (0, false) => "first".to_string(),
        _ => "failover".to_string(),
    };
    if c.preferred {
        role.push_str(", preferred");
    }
    if !c.passed_over && c.node_id == d.node_id {
        role.push_str(", answered");
    }
    role
}

/// Why the first candidate won, in one sentence, from the terms.
pub fn why(d: &RoutingDecision) -> String {
    let Some(first) = d.candidates.first() else { return "no node was weighed".into() };
    let home = d.candidates.iter().find(|c| c.standing() == Standing::Resident);
    let preferred = d.candidates.iter().find(|c| c.preferred);
    let first_is_preferred = preferred.is_some_and(|p| !p.passed_over && std::ptr::eq(p, first));
    let mut why = match d.route.as_str() {
        "resident" => {
            let warm = |c: &&Candidate| c.standing() == Standing::Warm;
            let cheapest_other = d.candidates.iter().skip(1).filter(warm).min_by_key(|c| c.cost_ms);
            match cheapest_other {
                Some(other) => format!(
                    "{} holds the conversation's cache{}: it costs {}, and the cheapest other, {}, {} \
                     (a move must gain {})",
                    first.node_id,
                    tokens_held(first),
                    seconds(first.cost_ms),
                    other.node_id,
                    seconds(other.cost_ms),
                    seconds(other.move_ms)
                ),
                None => format!(
                    "{} holds the conversation's cache{} and costs {}; no other node could be cheaper",
                    first.node_id,
                    tokens_held(first),
                    seconds(first.cost_ms)
                ),
            }
        }
        "moved" | "carried" => {
            let how = if first.cache() == CacheSource::Carried {
                format!("with the cache carried there ({})", seconds(first.carry_ms))
            } else {
                "reading the whole prompt again".into()
            };
            format!(
                "{} costs {} {how}, the move's gain of {} included, below the {} of waiting at its home {}",
                first.node_id,
                seconds(first.cost_ms),
                seconds(first.move_ms),
                home.map_or("-".into(), |h| seconds(h.cost_ms)),
                home.map_or("-", |h| h.node_id.as_str()),
            )
        }
        "placed" => match preferred {
            Some(_) if first_is_preferred => {
                format!("a new conversation, on its own node by rendezvous hash, {}", first.node_id)
            }
            Some(p) if p.over_bound => format!(
                "a new conversation: its own node {} holds {} sessions, over the load bound, so {} took it",
                p.node_id, p.sessions, first.node_id
            ),
            Some(p) => format!(
                "a new conversation: its own node {} would queue it ({} ahead), {} starts it sooner ({} ahead)",
                p.node_id, p.queue_ahead, first.node_id, first.queue_ahead
            ),
            None => format!("a new conversation, placed on {}", first.node_id),
        },
        "warm" => format!(
            "no conversation to keep: the model's strategy picked {} ({} ahead, {} expected)",
            first.node_id,
            first.queue_ahead,
            seconds(first.ttft_ms)
        ),
        "cold" => format!("no node with the model loaded could take it: {} loads it first", first.node_id),
        "failover" => format!("{} was tried first and failed; {} answered", first.node_id, or_dash(&d.node_id)),
        other => format!("route {other}"),
    };
    if d.route != "failover" && !d.node_id.is_empty() && d.node_id != first.node_id {
        let _ = write!(why, "; {} answered, after a failover", d.node_id);
    }
    why
}

/// The tokens a home's cache holds, where its agent reported them.
fn tokens_held(home: &Candidate) -> String {
    if home.cached_tokens == 0 { String::new() } else { format!(" ({} tokens)", home.cached_tokens) }
}

fn seconds(ms: u32) -> String {
    match ms {
        0 => "-".into(),
        ms if ms < 1_000 => format!("{ms} ms"),
        ms => format!("{:.1} s", f64::from(ms) / 1e3),
    }
}

fn or_dash(text: &str) -> &str {
    if text.is_empty() { "-" } else { text }
}

/// A node drained, or taking new sessions again.
pub struct Drained {
    pub node_id: String,
    pub draining: bool,
    pub revision: u64,
}

impl Render for Drained {
    fn text(&self) -> String {
        let state = if self.draining { "draining" } else { "accepting new sessions" };
        format!("node {} {state} (revision {})\n", self.node_id, self.revision)
    }

    fn json(&self) -> Value {
        json!({"node": self.node_id, "draining": self.draining, "revision": self.revision})
    }
}

impl Render for ListAliasesResponse {
    fn text(&self) -> String {
        let rows = self.aliases.iter().map(|a| vec![a.alias.clone(), a.model.clone()]).collect();
        table(&["ALIAS", "MODEL"], rows)
    }

    fn json(&self) -> Value {
        let aliases: Vec<Value> = self.aliases.iter().map(|a| json!({"alias": a.alias, "model": a.model})).collect();
        json!({"version": self.version, "aliases": aliases})
    }
}

/// A change written, at `revision`.
pub struct Written {
    pub what: String,
    pub revision: u64,
}

impl Render for Written {
    fn text(&self) -> String {
        format!("{} (revision {})\n", self.what, self.revision)
    }

    fn json(&self) -> Value {
        json!({"result": self.what, "revision": self.revision})
    }
}

impl Render for CreatedKey {
    fn text(&self) -> String {
        let key = self.key.clone().unwrap_or_default();
        format!(
            "key {} ({}) created:\n\n  {}\n\nStore it now: it is not shown again. Clients send it as `Authorization: Bearer <key>`.\n",
            key.key_id, key.name, self.secret
        )
    }

    fn json(&self) -> Value {
        let mut value = key_json(&self.key.clone().unwrap_or_default());
        value["secret"] = json!(self.secret);
        value["revision"] = json!(self.revision);
        value
    }
}

const KEY_COLUMNS: [&str; 10] =
    ["KEY ID", "NAME", "STATE", "MODELS", "RPM", "TOKENS/DAY", "AT ONCE", "WEIGHT", "PRIORITY", "EXPIRES"];

impl Render for ListKeysResponse {
    fn text(&self) -> String {
        table(&KEY_COLUMNS, self.keys.iter().map(key_row).collect())
    }

    fn json(&self) -> Value {
        json!({"version": self.version, "keys": self.keys.iter().map(key_json).collect::<Vec<_>>()})
    }
}

impl Render for ApiKey {
    fn text(&self) -> String {
        table(&KEY_COLUMNS, vec![key_row(self)])
    }

    fn json(&self) -> Value {
        key_json(self)
    }
}

impl Render for UsageReport {
    fn text(&self) -> String {
        let usage = |row: &UsageRow| row.usage.unwrap_or_default();
        let mut total = inferyes_proto::v1::UsageRollup::default();
        let mut rows: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|row| {
                let u = usage(row);
                inferyes_proto::usage::merge(&mut total, &u);
                let hour = inferyes_proto::usage::hour_of(row.hour_unix_ms);
                let dash = |text: &str| if text.is_empty() { "-".to_string() } else { text.to_string() };
                vec![
                    format!("{}-{}-{} {}:00", &hour[0..4], &hour[4..6], &hour[6..8], &hour[8..10]),
                    dash(&row.tenant),
                    dash(&row.key_id),
                    row.model.clone(),
                    u.requests.to_string(),
                    u.errors.to_string(),
                    u.prompt_tokens.to_string(),
                    u.cached_tokens.to_string(),
                    u.completion_tokens.to_string(),
                    u.estimated_requests.to_string(),
                    gpu_seconds(&u),
                ]
            })
            .collect();
        rows.push(vec![
            "total".into(),
            String::new(),
            String::new(),
            String::new(),
            total.requests.to_string(),
            total.errors.to_string(),
            total.prompt_tokens.to_string(),
            total.cached_tokens.to_string(),
            total.completion_tokens.to_string(),
            total.estimated_requests.to_string(),
            gpu_seconds(&total),
        ]);
        let mut head = vec![
            "HOUR (UTC)",
            "TENANT",
            "KEY",
            "MODEL",
            "REQUESTS",
            "ERRORS",
            "PROMPT",
            "CACHED",
            "COMPLETION",
            "ESTIMATED",
            "GPU-S",
        ];
        // Money only where some node is priced.
        if total.cost_micros > 0 {
            head.push("COST");
            let costs =
                self.rows.iter().map(|row| row.usage.unwrap_or_default().cost_micros).chain([total.cost_micros]);
            for (row, cost) in rows.iter_mut().zip(costs) {
                row.push(format!("{:.4}", cost as f64 / 1e6));
            }
        }
        let mut out = table(&head, rows);
        if self.pending_batches > 0 {
            let _ = writeln!(out, "({} batches received and not rolled up yet)", self.pending_batches);
        }
        out
    }

    fn json(&self) -> Value {
        let rows: Vec<Value> = self
            .rows
            .iter()
            .map(|row| {
                let u = row.usage.unwrap_or_default();
                json!({
                    "hour_unix_ms": row.hour_unix_ms, "tenant": row.tenant, "key_id": row.key_id, "model": row.model,
                    "requests": u.requests, "errors": u.errors, "prompt_tokens": u.prompt_tokens,
                    "cached_tokens": u.cached_tokens, "completion_tokens": u.completion_tokens,
                    "estimated_requests": u.estimated_requests, "latency_ms_sum": u.latency_ms_sum,
                    "prompt_ms": u.prompt_ms, "generation_ms": u.generation_ms, "cost_micros": u.cost_micros,
                })
            })
            .collect();
        json!({"rows": rows, "pending_batches": self.pending_batches})
    }
}

/// The backends' time on the requests, in seconds with one decimal.
fn gpu_seconds(usage: &inferyes_proto::v1::UsageRollup) -> String {
    let ms = usage.prompt_ms.saturating_add(usage.generation_ms);
    format!("{}.{}", ms / 1000, ms % 1000 / 100)
}

/// The report summed per hour, tenant and model: the keys of a tenant
/// together, named as [`inferyes_proto::usage::tenant_name`] says.
pub fn by_tenant(report: UsageReport) -> UsageReport {
    let mut sums: std::collections::BTreeMap<(u64, String, String), inferyes_proto::v1::UsageRollup> =
        std::collections::BTreeMap::new();
    for row in report.rows {
        let tenant = inferyes_proto::usage::tenant_name(&row.tenant, &row.key_id);
        let sum = sums.entry((row.hour_unix_ms, tenant, row.model)).or_default();
        inferyes_proto::usage::merge(sum, &row.usage.unwrap_or_default());
    }
    let rows = sums
        .into_iter()
        .map(|((hour_unix_ms, tenant, model), usage)| UsageRow {
            hour_unix_ms,
            tenant,
            key_id: String::new(),
            model,
            usage: Some(usage),
        })
        .collect();
    UsageReport { rows, pending_batches: report.pending_batches }
}

/// The routing policy; with the revision it was written at, where it was.
pub struct Policy {
    pub policy: RoutingPolicy,
    pub revision: Option<u64>,
}

impl Render for Policy {
    fn text(&self) -> String {
        let policy = &self.policy;
        let or_default = |v: f64, d: &str| if v == 0.0 { format!("{d} (default)") } else { v.to_string() };
        let mut out = String::new();
        let _ = writeln!(out, "admission threshold: {}", or_default(policy.admission_threshold, "0.92"));
        let _ = writeln!(out, "hard limit:          {}", or_default(policy.hard_limit, "0.98"));
        let _ = writeln!(out, "load bound:          {}", or_default(policy.load_bound, "1.25"));
        let _ = writeln!(out, "strategy:            {}", strategy_name(policy.default_strategy));
        let continues = if policy.continue_broken_streams {
            "every model".to_string()
        } else if policy.continue_models.is_empty() {
            "off".to_string()
        } else {
            policy.continue_models.join(", ")
        };
        let _ = writeln!(out, "continue streams:    {continues}");
        let critical = if policy.latency_critical_models.is_empty() {
            "none".into()
        } else {
            policy.latency_critical_models.join(", ")
        };
        let _ = writeln!(out, "latency-critical:    {critical}");
        let _ =
            writeln!(out, "placement:           {}", if policy.placement_off { "off (reports only)" } else { "on" });
        let mut replicas: Vec<_> = policy.replicas.iter().collect();
        replicas.sort_by(|a, b| a.0.cmp(b.0));
        for (model, r) in replicas {
            let max = if r.max == 0 { String::new() } else { format!(", at most {}", r.max) };
            let _ = writeln!(out, "  replicas of {model}: {}{max}", r.min);
        }
        let mut models: Vec<_> = policy.model_strategies.iter().collect();
        models.sort();
        for (model, strategy) in models {
            let _ = writeln!(out, "  {model}: {}", strategy_name(*strategy));
        }
        if let Some(revision) = self.revision {
            let _ = writeln!(out, "(revision {revision})");
        }
        out
    }

    fn json(&self) -> Value {
        let policy = &self.policy;
        let models: serde_json::Map<String, Value> =
            policy.model_strategies.iter().map(|(m, s)| (m.clone(), json!(strategy_name(*s)))).collect();
        json!({
            "admission_threshold": policy.admission_threshold,
            "hard_limit": policy.hard_limit,
            "load_bound": policy.load_bound,
            "default_strategy": strategy_name(policy.default_strategy),
            "model_strategies": models,
            "continue_broken_streams": policy.continue_broken_streams,
            "continue_models": policy.continue_models,
            "latency_critical_models": policy.latency_critical_models,
            "placement": !policy.placement_off,
            "replicas": policy.replicas.iter().map(|(m, r)| (m.clone(), json!({"min": r.min, "max": r.max})))
                .collect::<serde_json::Map<String, Value>>(),
        })
    }
}

fn strategy_name(strategy: i32) -> &'static str {
    Strategy::try_from(strategy).map(|s| s.as_str_name()).unwrap_or("STRATEGY_UNSPECIFIED")
}

/// One usage record, a line of `usage --export`.
pub fn usage_record_line(record: &UsageRecord) -> String {
    let mut line = usage_record_json(record).to_string();
    line.push('\n');
    line
}

fn usage_record_json(r: &UsageRecord) -> Value {
    json!({
        "request_id": r.request_id, "unix_ms": r.unix_ms, "key_id": r.key_id, "model": r.model,
        "node_id": r.node_id, "status": r.status, "outcome": r.outcome, "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens, "completion_tokens": r.completion_tokens, "estimated": r.estimated,
        "latency_ms": r.latency_ms, "ttft_ms": r.ttft_ms, "stream": r.stream, "prompt_ms": r.prompt_ms,
        "generation_ms": r.generation_ms, "cost_micros": r.cost_micros,
    })
}

fn key_state(key: &ApiKey) -> &'static str {
    if key.revoked {
        "revoked"
    } else if key.expires_unix_ms != 0 && key.expires_unix_ms <= inferyes_proto::unix_ms() {
        "expired"
    } else {
        "active"
    }
}

fn key_json(key: &ApiKey) -> Value {
    json!({
        "key_id": key.key_id,
        "name": key.name,
        "tenant": key.tenant,
        "state": key_state(key),
        "allowed_models": key.allowed_models,
        "requests_per_minute": key.requests_per_minute,
        "tokens_per_day": key.tokens_per_day,
        "max_concurrent": key.max_concurrent,
        "weight": key.weight.max(1),
        "priority": priority_name(key),
        "expires_unix_ms": key.expires_unix_ms,
        "created_unix_ms": key.created_unix_ms,
        "revoked_unix_ms": key.revoked_unix_ms,
    })
}

fn priority_name(key: &ApiKey) -> &'static str {
    match key.priority() {
        inferyes_proto::v1::Priority::Interactive => "interactive",
        inferyes_proto::v1::Priority::Batch => "batch",
    }
}

fn key_row(key: &ApiKey) -> Vec<String> {
    let or_none = |v: u64| if v == 0 { "-".to_string() } else { v.to_string() };
    let expires = if key.expires_unix_ms == 0 {
        "never".to_string()
    } else {
        let left_ms = key.expires_unix_ms.saturating_sub(inferyes_proto::unix_ms());
        if left_ms == 0 { "expired".to_string() } else { format!("in {}", human_duration(left_ms)) }
    };
    vec![
        key.key_id.clone(),
        key.name.clone(),
        key_state(key).to_string(),
        if key.allowed_models.is_empty() { "*".to_string() } else { key.allowed_models.join(",") },
        or_none(u64::from(key.requests_per_minute)),
        or_none(key.tokens_per_day),
        or_none(u64::from(key.max_concurrent)),
        key.weight.max(1).to_string(),
        priority_name(key).to_string(),
        expires,
    ]
}

fn human_duration(ms: u64) -> String {
    match ms / 1000 {
        s if s < 3600 => format!("{}m", s.div_ceil(60)),
        s if s < 86_400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

fn render_json(value: &Value) -> String {
    let mut text = serde_json::to_string_pretty(value).unwrap_or_default();
    text.push('\n');
    text
}

fn gpu_json(g: &Gpu) -> Value {
    json!({"index": g.index, "uuid": g.uuid, "name": g.name, "memory_total_bytes": g.memory_total_bytes,
           "memory_used_bytes": g.memory_used_bytes, "utilization_percent": g.utilization_percent,
           "source": g.source().as_str_name()})
}

fn backend_json(b: &Backend) -> Value {
    let models: Vec<Value> = b
        .models
        .iter()
        .map(|m| {
            json!({"id": m.id, "state": m.state().as_str_name(), "context_window": m.context_window,
                   "size_bytes": m.size_bytes, "endpoints": m.endpoints().map(|e| e.as_str_name()).collect::<Vec<_>>(),
                   "unsupported": m.unsupported().map(|e| e.as_str_name()).collect::<Vec<_>>()})
        })
        .collect();
    json!({"id": b.id, "kind": b.kind().as_str_name(), "health": b.health().as_str_name(), "weight": b.weight,
           "slots_total": b.slots_total, "slots_busy": b.slots_busy, "requests_deferred": b.requests_deferred,
           "in_flight": b.in_flight, "tokens_per_second": b.tokens_per_second, "probe_error": b.probe_error,
           "models_max": b.models_max, "models": models, "slot_fingerprint": b.slot_fingerprint,
           "slots_unmovable": b.slots_unmovable, "kv_tier": b.kv_tier.as_ref().map_or(Value::Null, kv_tier_json)})
}

fn kv_tier_json(t: &inferyes_proto::v1::KvTier) -> Value {
    json!({"bytes": t.bytes, "states": t.states, "saves": t.saves, "skipped": t.skipped, "restores": t.restores,
           "restore_failures": t.restore_failures, "evicted": t.evicted, "save_micros": t.save_micros,
           "restore_micros": t.restore_micros})
}

/// A backend's KV tier on one line: what it keeps, what it did, and what
/// a save and a restore took on average.
fn kv_tier_text(t: &inferyes_proto::v1::KvTier) -> String {
    let mean_ms = |micros: u64, count: u64| if count == 0 { 0.0 } else { micros as f64 / count as f64 / 1e3 };
    format!(
        "{} states, {} GiB; saved {} (skipped {}, {:.1} ms each), restored {} ({} failed, {:.1} ms each), evicted {}",
        t.states,
        gib(t.bytes),
        t.saves,
        t.skipped,
        mean_ms(t.save_micros, t.saves),
        t.restores,
        t.restore_failures,
        mean_ms(t.restore_micros, t.restores),
        t.evicted
    )
}

fn moves_json(m: &MoveProgress) -> Value {
    json!({"running": m.running, "sessions": m.sessions, "moved": m.moved, "failed": m.failed,
           "not_movable": m.not_movable, "bytes": m.bytes, "started_unix_ms": m.started_unix_ms,
           "finished_unix_ms": m.finished_unix_ms, "last_error": m.last_error})
}

/// A drain's moves in a line: `moved 4 of 6, failed 0, not movable 2 (12.7 MB, done in 3.1 s)`.
fn moves_text(m: &MoveProgress) -> String {
    let state = if m.running {
        "running".to_string()
    } else {
        format!("done in {:.1} s", m.finished_unix_ms.saturating_sub(m.started_unix_ms) as f64 / 1000.0)
    };
    let mut text = format!(
        "moved {} of {}, failed {}, not movable {} ({:.1} MB, {state})",
        m.moved,
        m.sessions,
        m.failed,
        m.not_movable,
        m.bytes as f64 / 1e6
    );
    if !m.last_error.is_empty() {
        let _ = write!(text, "; last: {}", m.last_error);
    }
    text
}

/// Sessions resident on the node, as the controller counted them.
fn resident(status: &inferyes_proto::v1::NodeStatus) -> u64 {
    status.backends.iter().map(|b| u64::from(b.resident_sessions)).sum()
}

/// What a node is to routing: draining, awaiting the credential its
/// controller issues (data planes send it nothing meanwhile), or active.
fn node_state(node: &SnapshotNode) -> &'static str {
    if node.draining {
        "draining"
    } else if node.status.as_ref().is_some_and(|s| s.awaiting_credential) {
        "awaiting credential"
    } else {
        "active"
    }
}

fn node_json(node: &SnapshotNode) -> Value {
    let Some(s) = node.status.as_ref() else { return Value::Null };
    json!({"node_id": s.node_id, "hostname": s.hostname, "proxy_url": s.proxy_url, "draining": node.draining,
           "awaiting_credential": s.awaiting_credential, "instance_digest": node.instance_digest,
           "agent_version": s.agent_version, "gpus": s.gpus.iter().map(gpu_json).collect::<Vec<_>>(),
           "backends": s.backends.iter().map(backend_json).collect::<Vec<_>>(), "sessions": resident(s),
           "moves": s.moves.as_ref().map_or(Value::Null, moves_json)})
}

fn gib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / f64::from(1u32 << 30))
}

fn vram(gpus: &[Gpu]) -> String {
    let used: u64 = gpus.iter().map(|g| g.memory_used_bytes).sum();
    let total: u64 = gpus.iter().map(|g| g.memory_total_bytes).sum();
    if total == 0 {
        return "-".into();
    }
    format!("{}/{} GiB ({:.0}%)", gib(used), gib(total), used as f64 * 100.0 / total as f64)
}

fn nodes_table(nodes: &[SnapshotNode]) -> String {
    let rows = nodes
        .iter()
        .filter_map(|n| n.status.as_ref().map(|s| (n, s)))
        .map(|(n, s)| {
            let loaded: Vec<&str> = s
                .backends
                .iter()
                .flat_map(|b| &b.models)
                .filter(|m| m.state() == ModelState::Loaded)
                .map(|m| m.id.as_str())
                .collect();
            let slots_busy: u32 = s.backends.iter().map(|b| b.slots_busy).sum();
            let slots_total: u32 = s.backends.iter().map(|b| b.slots_total).sum();
            let healthy = s.backends.iter().filter(|b| b.health() == inferyes_proto::v1::Health::Ready).count();
            vec![
                s.node_id.clone(),
                node_state(n).into(),
                s.gpus.first().map(|g| g.name.clone()).unwrap_or_else(|| "-".into()),
                vram(&s.gpus),
                format!("{slots_busy}/{slots_total}"),
                format!("{healthy}/{}", s.backends.len()),
                resident(s).to_string(),
                loaded.join(","),
            ]
        })
        .collect();
    table(&["NODE", "STATE", "GPU", "VRAM", "SLOTS", "BACKENDS", "SESSIONS", "LOADED MODELS"], rows)
}

fn node_detail(node: &SnapshotNode) -> String {
    let Some(s) = node.status.as_ref() else { return String::new() };
    let mut out = String::new();
    let state = if node_state(node) == "active" { String::new() } else { format!(" ({})", node_state(node)) };
    let _ = writeln!(out, "node:      {}{state}", s.node_id);
    let _ = writeln!(out, "host:      {}", s.hostname);
    let _ = writeln!(out, "proxy:     {}", s.proxy_url);
    let _ = writeln!(out, "agent:     {}", s.agent_version);
    for g in &s.gpus {
        let _ = writeln!(
            out,
            "gpu {}:     {} {} GiB used of {} ({}% busy, {})",
            g.index,
            g.name,
            gib(g.memory_used_bytes),
            gib(g.memory_total_bytes),
            g.utilization_percent,
            g.source().as_str_name()
        );
    }
    for b in &s.backends {
        let _ = writeln!(
            out,
            "backend {}: {} {} slots {}/{} deferred {} in-flight {}",
            b.id,
            b.kind().as_str_name(),
            b.health().as_str_name(),
            b.slots_busy,
            b.slots_total,
            b.requests_deferred,
            b.in_flight
        );
        for m in &b.models {
            let _ = writeln!(out, "  model {} {} ctx {}", m.id, m.state().as_str_name(), m.context_window);
        }
        if b.slot_fingerprint.is_empty() {
            let _ = writeln!(out, "  slots not movable: {}", b.slots_unmovable);
        } else {
            let _ = writeln!(out, "  slots movable, fingerprint {}", b.slot_fingerprint);
        }
        if let Some(tier) = &b.kv_tier {
            let _ = writeln!(out, "  kv tier: {}", kv_tier_text(tier));
        }
    }
    let _ = writeln!(out, "sessions:  {}", resident(s));
    if let Some(moves) = &s.moves {
        let _ = writeln!(out, "moves:     {}", moves_text(moves));
    }
    out
}

fn table(headers: &[&str], rows: Vec<Vec<String>>) -> String {
    // A cell is one line: a name with a line of its own would be a row.
    let rows: Vec<Vec<String>> = rows
        .into_iter()
        .map(|row| row.iter().map(|c| inferyes_proto::shown_on_one_line(c).into_owned()).collect())
        .collect();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<&str>| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                text.push_str(cell);
            } else {
                let _ = write!(text, "{cell:<w$}  ");
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(headers.to_vec());
    for row in &rows {
        line(row.iter().map(String::as_str).collect());
    }
    out
}

#[cfg(test)]
mod tests {
    use inferyes_proto::v1::{Alias, Health, Model, NodeStatus, ResidentSession, SessionInfo, UsageRollup, UsageRow};

    use super::*;

    fn node(id: &str, draining: bool) -> SnapshotNode {
        let backend = Backend {
            id: "main".into(),
            health: Health::Ready as i32,
            slots_total: 4,
            slots_busy: 1,
            resident_sessions: 3,
            models: vec![Model { id: "qwen".into(), state: ModelState::Loaded as i32, ..Default::default() }],
            ..Default::default()
        };
        let gpu =
            Gpu { name: "L4".into(), memory_total_bytes: 24 << 30, memory_used_bytes: 6 << 30, ..Default::default() };
        let status = NodeStatus { node_id: id.into(), gpus: vec![gpu], backends: vec![backend], ..Default::default() };
        SnapshotNode { status: Some(status), draining, ..Default::default() }
    }

    #[test]
    fn a_node_awaiting_its_credential_says_so_and_is_not_active() {
        let mut awaiting = node("gpu-a", false);
        awaiting.status.as_mut().unwrap().awaiting_credential = true;
        assert!(nodes_table(&[awaiting.clone()]).contains("awaiting credential"));
        assert!(!nodes_table(&[awaiting.clone()]).contains("active"));
        assert_eq!(node_json(&awaiting)["awaiting_credential"], true);
        assert!(nodes_table(&[node("gpu-b", false)]).contains("active"));
    }

    #[test]
    fn a_backend_s_kv_tier_shows_what_it_keeps_and_what_its_saves_and_restores_took() {
        let mut keeping = node("gpu-a", false);
        let backend = &mut keeping.status.as_mut().unwrap().backends[0];
        backend.kv_tier = Some(inferyes_proto::v1::KvTier {
            bytes: 3 << 30,
            states: 240,
            saves: 400,
            skipped: 7,
            restores: 50,
            restore_failures: 1,
            evicted: 12,
            save_micros: 400 * 6_500,
            restore_micros: 50 * 3_200,
        });
        let detail = node_detail(&keeping);
        assert!(
            detail.contains(
                "kv tier: 240 states, 3.0 GiB; saved 400 (skipped 7, 6.5 ms each), restored 50 (1 failed, 3.2 ms each), \
                 evicted 12"
            ),
            "{detail}"
        );
        assert_eq!(node_json(&keeping)["backends"][0]["kv_tier"]["restores"], 50);
        assert!(!node_detail(&node("gpu-b", false)).contains("kv tier"));
        assert_eq!(node_json(&node("gpu-b", false))["backends"][0]["kv_tier"], Value::Null);
    }

    #[test]
    fn a_table_carries_no_terminal_escape_from_an_agent() {
        let mut hostile = node("gpu-a", false);
        let status = hostile.status.as_mut().unwrap();
        status.gpus[0].name = "L4\u{1b}[2J\u{1b}]0;owned\u{7}".into();
        status.backends[0].models[0].id = "qwen\u{202e}fig\ngpu-z  active\rx".into();
        let nodes = ListNodesResponse { version: 1, nodes: vec![hostile] };
        let table = render(&nodes, Output::Table);
        assert!(!table.contains('\u{1b}') && !table.contains('\u{202e}') && !table.contains('\r'), "{table}");
        assert_eq!(table.lines().count(), 2, "the header and the node, no row of the model's: {table}");
        // Scripts get the names as the controller keeps them.
        assert!(render(&nodes, Output::Json).contains("qwen\u{202e}fig\\ngpu-z"));
    }

    #[test]
    fn nodes_are_a_table_for_people_and_their_whole_status_for_scripts() {
        let nodes = ListNodesResponse { version: 7, nodes: vec![node("gpu-a", false), node("gpu-b", true)] };
        let text = nodes.text();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("NODE   STATE     GPU  VRAM"), "{text}");
        assert!(lines[1].contains("gpu-a  active") && lines[1].contains("6.0/24.0 GiB (25%)"), "{text}");
        assert!(lines[1].contains("1/4") && lines[1].ends_with("qwen"), "{text}");
        assert!(lines[2].contains("gpu-b  draining"), "{text}");
        let json = nodes.json();
        assert_eq!(json["version"], 7);
        assert_eq!(json["nodes"][1]["draining"], true);
        assert_eq!(json["nodes"][0]["sessions"], 3);
        assert_eq!(json["nodes"][0]["backends"][0]["models"][0]["state"], "MODEL_STATE_LOADED");
    }

    #[test]
    fn one_answer_renders_as_the_output_asked_for() {
        let drained = Drained { node_id: "gpu-a".into(), draining: true, revision: 42 };
        assert_eq!(render(&drained, Output::Table), "node gpu-a draining (revision 42)\n");
        let json: Value = serde_json::from_str(&render(&drained, Output::Json)).unwrap();
        assert_eq!(json, json!({"node": "gpu-a", "draining": true, "revision": 42}));
        let back = Drained { draining: false, ..drained };
        assert_eq!(back.text(), "node gpu-a accepting new sessions (revision 42)\n");
        let written = Written { what: "alias fast -> qwen".into(), revision: 9 };
        assert_eq!(written.text(), "alias fast -> qwen (revision 9)\n");
        assert_eq!(written.json(), json!({"result": "alias fast -> qwen", "revision": 9}));
    }

    #[test]
    fn a_policy_shows_its_defaults_and_the_revision_it_was_written_at() {
        let mut policy =
            RoutingPolicy { admission_threshold: 0.9, continue_models: vec!["qwen".into()], ..Default::default() };
        policy.model_strategies.insert("qwen".into(), Strategy::Weighted as i32);
        let shown = Policy { policy: policy.clone(), revision: None };
        let text = shown.text();
        assert!(text.contains("admission threshold: 0.9\n"), "{text}");
        assert!(text.contains("hard limit:          0.98 (default)\n"), "{text}");
        assert!(text.contains("continue streams:    qwen\n") && text.contains("  qwen: STRATEGY_WEIGHTED\n"), "{text}");
        assert!(!text.contains("revision"));
        let set = Policy { policy, revision: Some(5) };
        assert!(set.text().ends_with("(revision 5)\n"));
        assert_eq!(set.json()["model_strategies"]["qwen"], "STRATEGY_WEIGHTED");
        assert_eq!(set.json(), shown.json(), "the JSON is the policy alone");
    }

    fn usage_row(tenant: &str, key: &str, requests: u64) -> UsageRow {
        UsageRow {
            hour_unix_ms: 1_764_590_400_000,
            tenant: tenant.into(),
            key_id: key.into(),
            model: "qwen".into(),
            usage: Some(UsageRollup {
                requests,
                prompt_tokens: requests * 10,
                prompt_ms: requests * 400,
                generation_ms: requests * 1_050,
                ..Default::default()
            }),
        }
    }

    #[test]
    fn usage_adds_a_total_and_says_what_is_not_rolled_up() {
        let report = UsageReport { rows: vec![usage_row("team-a", "k1", 2), usage_row("", "", 3)], pending_batches: 1 };
        let text = report.text();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].ends_with("GPU-S"), "{text}");
        assert!(lines[1].starts_with("2025-12-01 12:00  team-a  k1"), "{text}");
        assert!(lines[1].ends_with("  2.9"), "2 x 1.45 s: {text}");
        assert!(lines[2].contains("  -  "), "no key shows as -: {text}");
        assert!(lines[3].starts_with("total") && lines[3].contains("50") && lines[3].ends_with("7.2"), "{text}");
        assert_eq!(lines[4], "(1 batches received and not rolled up yet)");
        assert_eq!(report.json()["rows"][1]["prompt_tokens"], 30);
        assert_eq!(report.json()["rows"][0]["tenant"], "team-a");
        assert_eq!(report.json()["rows"][0]["generation_ms"], 2_100);
        assert_eq!(report.json()["pending_batches"], 1);
        assert!(!text.contains("COST"), "no node priced, no money: {text}");

        let mut priced = usage_row("team-a", "k1", 2);
        priced.usage.as_mut().unwrap().cost_micros = 1_234;
        let text = UsageReport { rows: vec![priced, usage_row("", "", 1)], pending_batches: 0 }.text();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].ends_with("GPU-S  COST") && lines[1].ends_with("0.0012"), "{text}");
        assert!(lines[2].ends_with("0.0000") && lines[3].ends_with("0.0012"), "{text}");
    }

    #[test]
    fn usage_by_tenant_sums_a_tenant_s_keys_and_counts_a_key_without_one_as_its_own() {
        let rows = vec![usage_row("team-a", "k1", 2), usage_row("team-a", "k2", 3), usage_row("", "k3", 4)];
        let report = by_tenant(UsageReport { rows, pending_batches: 0 });
        let tenants: Vec<(&str, u64, u64)> = report
            .rows
            .iter()
            .map(|row| {
                let usage = row.usage.unwrap_or_default();
                (row.tenant.as_str(), usage.requests, usage.prompt_ms + usage.generation_ms)
            })
            .collect();
        assert_eq!(tenants, [("key:k3", 4, 5_800), ("team-a", 5, 7_250)]);
        assert!(report.rows.iter().all(|row| row.key_id.is_empty()));
    }

    #[test]
    fn sessions_show_their_age_and_idle_time_as_of_now() {
        let session = ResidentSession {
            key: "chat-1".into(),
            backend_id: "main".into(),
            model: "qwen".into(),
            first_seen_unix_ms: 1_000_000,
            last_seen_unix_ms: 1_090_000,
            requests: 4,
            ..Default::default()
        };
        let sessions = Sessions {
            response: ListSessionsResponse {
                version: 3,
                sessions: vec![SessionInfo { node_id: "gpu-a".into(), session: Some(session) }],
                truncated: true,
            },
            now_s: 1_100,
        };
        let text = sessions.text();
        assert!(
            text.lines().nth(1).unwrap().split_whitespace().eq(["chat-1", "gpu-a", "main", "qwen", "100s", "10s", "4"]),
            "{text}"
        );
        assert_eq!(text.lines().last(), Some("(more sessions than one answer holds: the most recent shown)"));
        assert_eq!(sessions.json()["sessions"][0]["key"], "chat-1");
        assert_eq!(sessions.json()["truncated"], true);
    }

    #[test]
    fn a_new_key_s_secret_is_shown_once_in_either_form() {
        let key = ApiKey { key_id: "abc".into(), name: "ci".into(), ..Default::default() };
        let created = CreatedKey { key: Some(key.clone()), secret: "ify_abc_s3cret".into(), revision: 2 };
        assert!(created.text().contains("key abc (ci) created:\n\n  ify_abc_s3cret\n"), "{}", created.text());
        assert_eq!(
            (created.json()["secret"].as_str(), created.json()["state"].as_str()),
            (Some("ify_abc_s3cret"), Some("active"))
        );
        let listed = ListKeysResponse { version: 1, keys: vec![ApiKey { revoked: true, ..key }] };
        assert!(listed.text().lines().nth(1).unwrap().contains("revoked"), "{}", listed.text());
        assert_eq!(listed.json()["keys"][0]["state"], "revoked");
        let aliases =
            ListAliasesResponse { version: 1, aliases: vec![Alias { alias: "fast".into(), model: "qwen".into() }] };
        assert_eq!(aliases.text(), "ALIAS  MODEL\nfast   qwen\n");
    }
}
