//! `inferyesctl`: the operator's command line over the controller's
//! FleetService. The binary only parses arguments and prints what
//! [`run`] returns, so tests drive the same code.

use std::fmt::Write as _;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use inferyes_proto::v1::fleet_service_client::FleetServiceClient;
use inferyes_proto::v1::{
    Alias, ApiKey, CreateKeyRequest, DeleteAliasRequest, GetKeyRequest, GetPolicyRequest, ListAliasesRequest,
    ListKeysRequest, NodePolicy, RevokeKeyRequest, RoutingPolicy, SetNodePolicyRequest, Strategy,
};
use inferyes_proto::v1::{
    Backend, DrainRequest, GetNodeRequest, Gpu, ListModelsRequest, ListNodesRequest, ListSessionsRequest, ModelState,
    SnapshotNode, UndrainRequest, UsageQuery, UsageRecord, UsageReport, UsageRow,
};
use serde_json::{Value, json};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

#[derive(Debug, Parser)]
#[command(name = "inferyesctl", version, about = "Inspect and operate an Inferyes fleet")]
pub struct Cli {
    /// Controller gRPC address.
    #[arg(long, global = true, env = "INFERYES_CONTROLLER", default_value = "http://127.0.0.1:7070")]
    pub controller: String,
    /// Output format.
    #[arg(short, long, global = true, value_enum, default_value_t = Output::Table)]
    pub output: Output,
    /// The admin token, for changes and keys (prefer --admin-token-file).
    #[arg(long, global = true, env = "INFERYES_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// A file holding the admin token.
    #[arg(long, global = true, env = "INFERYES_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<std::path::PathBuf>,
    /// CA that signs an `https://` controller's certificate (default: the system's).
    #[arg(long, global = true, env = "INFERYES_TLS_CA_FILE")]
    pub tls_ca_file: Option<std::path::PathBuf>,
    /// Client certificate, for a controller that requires one (with --tls-key-file).
    #[arg(long, global = true, env = "INFERYES_TLS_CERT_FILE")]
    pub tls_cert_file: Option<std::path::PathBuf>,
    #[arg(long, global = true, env = "INFERYES_TLS_KEY_FILE")]
    pub tls_key_file: Option<std::path::PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the fleet's nodes with their GPUs, backends and load.
    Nodes,
    /// Show one node in full.
    Node { node_id: String },
    /// List the fleet's models and where they are loaded.
    Models,
    /// List the conversations resident on the fleet's backends.
    Sessions {
        /// Only this node's sessions.
        #[arg(long)]
        node: Option<String>,
    },
    /// Stop sending new sessions to a node; in-flight requests finish.
    Drain {
        node_id: String,
        #[arg(long, default_value = "")]
        reason: String,
        /// Drain a node that is not in the fleet right now.
        #[arg(long)]
        force: bool,
    },
    /// Let a drained node take new sessions again.
    Undrain { node_id: String },
    /// Print a shell completion script, e.g. `inferyesctl completions bash > /etc/bash_completion.d/inferyesctl`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Model aliases: names clients may use for a model.
    #[command(subcommand)]
    Alias(AliasCommand),
    /// The fleet's routing policy and per-node overrides.
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// API keys for the OpenAI API.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Token usage per hour, key and model, from the usage ledger.
    Usage {
        /// Only this key id.
        #[arg(long)]
        key: Option<String>,
        /// Only this model.
        #[arg(long)]
        model: Option<String>,
        /// From this long ago: 90m, 24h, 7d (default 24h).
        #[arg(long, value_name = "DURATION")]
        since: Option<String>,
        /// Print the raw records as JSON lines instead.
        #[arg(long)]
        export: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Create a key. Its secret is printed once and stored nowhere.
    Create {
        /// Who or what the key is for.
        name: String,
        /// Models the key may use: an id, or a prefix ending in `*`; repeatable. None: every model.
        #[arg(long = "model", value_name = "PATTERN")]
        models: Vec<String>,
        /// Requests per minute (none: no limit).
        #[arg(long)]
        rpm: Option<u32>,
        /// Tokens (prompt plus completion) per day (none: no limit).
        #[arg(long)]
        tokens_per_day: Option<u64>,
        /// Expire after this long: 90m, 12h, 30d (none: never).
        #[arg(long, value_name = "DURATION")]
        expires_in: Option<String>,
    },
    /// List the keys (never their secrets).
    List,
    /// Show one key.
    Show { key_id: String },
    /// Revoke a key: every data plane refuses it from its next snapshot on.
    Revoke { key_id: String },
}

#[derive(Debug, Subcommand)]
pub enum AliasCommand {
    /// List the aliases.
    List,
    /// Make ALIAS name MODEL (replacing what it named before).
    Set { alias: String, model: String },
    /// Remove an alias.
    Rm { alias: String },
}

#[derive(Debug, Subcommand)]
pub enum PolicyCommand {
    /// Show the fleet's routing policy (zero: the default).
    Show,
    /// Change the fleet's routing policy; options not given keep their value.
    Set {
        /// GPU memory fraction at which a node takes no new sessions (default 0.92).
        #[arg(long)]
        admission: Option<f64>,
        /// GPU memory fraction at which a node takes nothing (default 0.98).
        #[arg(long)]
        hard_limit: Option<f64>,
        /// No node gets more than this times the average load from new sessions (default 1.25).
        #[arg(long)]
        load_bound: Option<f64>,
        /// Order of warm nodes for requests without a session.
        #[arg(long, value_enum)]
        strategy: Option<StrategyArg>,
        /// Per-model strategy, MODEL=STRATEGY; repeatable. STRATEGY `default` removes it.
        #[arg(long = "model-strategy", value_name = "MODEL=STRATEGY")]
        model_strategies: Vec<String>,
        /// Resume chat streams that break mid-answer on another node, for every model.
        #[arg(long)]
        continue_streams: Option<bool>,
        /// Resume broken streams of these models only (replaces the list); repeatable.
        #[arg(long = "continue-model", value_name = "MODEL")]
        continue_models: Option<Vec<String>>,
        /// Models that must stay warm on two nodes or more (replaces the list); repeatable.
        /// `--latency-critical ''` clears it.
        #[arg(long = "latency-critical", value_name = "MODEL")]
        latency_critical: Option<Vec<String>>,
    },
    /// Override a node's thresholds (0 or omitted: the fleet's).
    Node {
        node_id: String,
        #[arg(long, default_value_t = 0.0)]
        admission: f64,
        #[arg(long, default_value_t = 0.0)]
        hard_limit: f64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StrategyArg {
    LeastOutstanding,
    Weighted,
    RoundRobin,
    PowerOfTwo,
}

impl StrategyArg {
    fn wire(self) -> Strategy {
        match self {
            StrategyArg::LeastOutstanding => Strategy::LeastOutstanding,
            StrategyArg::Weighted => Strategy::Weighted,
            StrategyArg::RoundRobin => Strategy::RoundRobin,
            StrategyArg::PowerOfTwo => Strategy::PowerOfTwo,
        }
    }
}

pub async fn run(cli: Cli) -> anyhow::Result<String> {
    if let Command::Completions { shell } = cli.command {
        // Needs no controller.
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut <Cli as clap::CommandFactory>::command(), "inferyesctl", &mut script);
        return Ok(String::from_utf8_lossy(&script).into_owned());
    }
    let tls = inferyes_proto::tls::Tls {
        ca_file: cli.tls_ca_file.clone(),
        cert_file: cli.tls_cert_file.clone(),
        key_file: cli.tls_key_file.clone(),
        client_ca_file: None,
    };
    tls.validate()?;
    let channel = inferyes_proto::tls::grpc_endpoint(&cli.controller, &tls)?
        .connect_timeout(std::time::Duration::from_secs(3))
        .connect()
        .await
        .with_context(|| {
            format!("cannot reach the controller at {} (set --controller or INFERYES_CONTROLLER)", cli.controller)
        })?;
    let token =
        inferyes_proto::files::read_token(cli.admin_token.as_deref(), cli.admin_token_file.as_deref(), "admin token")?;
    let mut client = admin_client(channel, token.as_deref())?;
    let json_out = cli.output == Output::Json;
    let text = match cli.command {
        Command::Nodes => {
            let response = client.list_nodes(ListNodesRequest {}).await.map_err(rpc_error)?.into_inner();
            if json_out {
                render_json(
                    &json!({"version": response.version, "nodes": response.nodes.iter().map(node_json).collect::<Vec<_>>()}),
                )
            } else {
                nodes_table(&response.nodes)
            }
        }
        Command::Node { node_id } => {
            let node = client.get_node(GetNodeRequest { node_id }).await.map_err(rpc_error)?.into_inner();
            if json_out { render_json(&node_json(&node)) } else { node_detail(&node) }
        }
        Command::Models => {
            let response = client.list_models(ListModelsRequest {}).await.map_err(rpc_error)?.into_inner();
            if json_out {
                let models: Vec<Value> = response
                    .models
                    .iter()
                    .map(|m| {
                        json!({
                            "id": m.id,
                            "loaded_on": m.loaded_on,
                            "available_on": m.available_on,
                            "context_window": m.context_window,
                            "endpoints": m.endpoints().map(|e| e.as_str_name()).collect::<Vec<_>>(),
                        })
                    })
                    .collect();
                render_json(&json!({"version": response.version, "models": models}))
            } else {
                let rows = response
                    .models
                    .iter()
                    .map(|m| {
                        vec![
                            m.id.clone(),
                            m.loaded_on.len().to_string(),
                            m.available_on.len().to_string(),
                            if m.context_window == 0 { "-".into() } else { m.context_window.to_string() },
                            m.loaded_on.join(","),
                        ]
                    })
                    .collect();
                table(&["MODEL", "LOADED", "NODES", "CONTEXT", "LOADED ON"], rows)
            }
        }
        Command::Sessions { node } => {
            let request = ListSessionsRequest { node_id: node.unwrap_or_default() };
            let response = client.list_sessions(request).await.map_err(rpc_error)?.into_inner();
            let now = inferyes_proto::unix_ms() / 1000;
            if json_out {
                let sessions: Vec<Value> = response
                    .sessions
                    .iter()
                    .filter_map(|s| s.session.as_ref().map(|r| (s, r)))
                    .map(|(s, r)| {
                        json!({"node": s.node_id, "key": r.key, "backend": r.backend_id, "model": r.model,
                               "first_seen_unix_ms": r.first_seen_unix_ms, "last_seen_unix_ms": r.last_seen_unix_ms, "requests": r.requests})
                    })
                    .collect();
                render_json(&json!({"version": response.version, "sessions": sessions}))
            } else {
                let rows = response
                    .sessions
                    .iter()
                    .filter_map(|s| s.session.as_ref().map(|r| (s, r)))
                    .map(|(s, r)| {
                        vec![
                            r.key.clone(),
                            s.node_id.clone(),
                            r.backend_id.clone(),
                            r.model.clone(),
                            format!("{}s", now.saturating_sub(r.first_seen_unix_ms / 1000)),
                            format!("{}s", now.saturating_sub(r.last_seen_unix_ms / 1000)),
                            r.requests.to_string(),
                        ]
                    })
                    .collect();
                table(&["SESSION", "NODE", "BACKEND", "MODEL", "AGE", "IDLE", "REQUESTS"], rows)
            }
        }
        Command::Drain { node_id, reason, force } => {
            let response = client.drain(DrainRequest { node_id, reason, force }).await.map_err(rpc_error)?.into_inner();
            if json_out {
                render_json(&json!({"node": response.node_id, "draining": true, "revision": response.revision}))
            } else {
                format!("node {} draining (revision {})\n", response.node_id, response.revision)
            }
        }
        Command::Undrain { node_id } => {
            let response = client.undrain(UndrainRequest { node_id }).await.map_err(rpc_error)?.into_inner();
            if json_out {
                render_json(&json!({"node": response.node_id, "draining": false, "revision": response.revision}))
            } else {
                format!("node {} accepting new sessions (revision {})\n", response.node_id, response.revision)
            }
        }
        Command::Alias(AliasCommand::List) => {
            let response = client.list_aliases(ListAliasesRequest {}).await.map_err(rpc_error)?.into_inner();
            if json_out {
                let aliases: Vec<Value> =
                    response.aliases.iter().map(|a| json!({"alias": a.alias, "model": a.model})).collect();
                render_json(&json!({"version": response.version, "aliases": aliases}))
            } else {
                let rows = response.aliases.iter().map(|a| vec![a.alias.clone(), a.model.clone()]).collect();
                table(&["ALIAS", "MODEL"], rows)
            }
        }
        Command::Alias(AliasCommand::Set { alias, model }) => {
            let request = Alias { alias: alias.clone(), model: model.clone() };
            let response = client.set_alias(request).await.map_err(rpc_error)?.into_inner();
            written(json_out, &format!("alias {alias} -> {model}"), response.revision)
        }
        Command::Alias(AliasCommand::Rm { alias }) => {
            let request = DeleteAliasRequest { alias: alias.clone() };
            let response = client.delete_alias(request).await.map_err(rpc_error)?.into_inner();
            written(json_out, &format!("alias {alias} removed"), response.revision)
        }
        Command::Keys(command) => keys(&mut client, command, json_out).await?,
        Command::Usage { key, model, since, export } => {
            let since_unix_ms = match since {
                Some(text) => inferyes_proto::unix_ms().saturating_sub(parse_duration_ms(&text)?),
                None => 0,
            };
            let query = UsageQuery { key_id: key.unwrap_or_default(), model: model.unwrap_or_default(), since_unix_ms };
            if export {
                let mut stream = client.export_usage(query).await.map_err(rpc_error)?.into_inner();
                let mut out = String::new();
                while let Some(record) = stream.message().await.map_err(rpc_error)? {
                    out.push_str(&usage_record_json(&record).to_string());
                    out.push('\n');
                }
                out
            } else {
                let report = client.get_usage(query).await.map_err(rpc_error)?.into_inner();
                render_usage(&report, json_out)
            }
        }
        Command::Policy(PolicyCommand::Show) => {
            let policy = client.get_policy(GetPolicyRequest {}).await.map_err(rpc_error)?.into_inner();
            render_policy(&policy, json_out)
        }
        Command::Policy(PolicyCommand::Set {
            admission,
            hard_limit,
            load_bound,
            strategy,
            model_strategies,
            continue_streams,
            continue_models,
            latency_critical,
        }) => {
            let mut policy = client.get_policy(GetPolicyRequest {}).await.map_err(rpc_error)?.into_inner();
            if let Some(v) = admission {
                policy.admission_threshold = v;
            }
            if let Some(v) = hard_limit {
                policy.hard_limit = v;
            }
            if let Some(v) = load_bound {
                policy.load_bound = v;
            }
            if let Some(v) = strategy {
                policy.set_default_strategy(v.wire());
            }
            if let Some(v) = continue_streams {
                policy.continue_broken_streams = v;
            }
            if let Some(v) = continue_models {
                policy.continue_models = v;
            }
            if let Some(v) = latency_critical {
                policy.latency_critical_models = v.into_iter().filter(|m| !m.is_empty()).collect();
            }
            for pair in model_strategies {
                let (model, name) = pair
                    .split_once('=')
                    .with_context(|| format!("`{pair}`: write MODEL=STRATEGY, e.g. qwen=weighted"))?;
                if name == "default" {
                    policy.model_strategies.remove(model);
                } else {
                    let value = StrategyArg::from_str(name, true).map_err(|e| anyhow::anyhow!("`{name}`: {e}"))?;
                    policy.model_strategies.insert(model.to_string(), value.wire() as i32);
                }
            }
            let response = client.set_policy(policy.clone()).await.map_err(rpc_error)?.into_inner();
            if json_out {
                render_policy(&policy, true)
            } else {
                format!("{}(revision {})\n", render_policy(&policy, false), response.revision)
            }
        }
        Command::Completions { .. } => unreachable!("answered before connecting"),
        Command::Policy(PolicyCommand::Node { node_id, admission, hard_limit }) => {
            let request = SetNodePolicyRequest {
                node_id: node_id.clone(),
                policy: Some(NodePolicy { admission_threshold: admission, hard_limit }),
            };
            let response = client.set_node_policy(request).await.map_err(rpc_error)?.into_inner();
            written(json_out, &format!("node {node_id} thresholds set"), response.revision)
        }
    };
    Ok(text)
}

fn written(json_out: bool, what: &str, revision: u64) -> String {
    if json_out {
        render_json(&json!({"result": what, "revision": revision}))
    } else {
        format!("{what} (revision {revision})\n")
    }
}

async fn keys(client: &mut AdminClient, command: KeysCommand, json_out: bool) -> anyhow::Result<String> {
    Ok(match command {
        KeysCommand::Create { name, models, rpm, tokens_per_day, expires_in } => {
            let expires_unix_ms = match expires_in {
                Some(text) => inferyes_proto::unix_ms() + parse_duration_ms(&text)?,
                None => 0,
            };
            let request = CreateKeyRequest {
                name,
                allowed_models: models,
                requests_per_minute: rpm.unwrap_or(0),
                tokens_per_day: tokens_per_day.unwrap_or(0),
                expires_unix_ms,
            };
            let created = client.create_key(request).await.map_err(rpc_error)?.into_inner();
            let key = created.key.unwrap_or_default();
            if json_out {
                let mut value = key_json(&key);
                value["secret"] = json!(created.secret);
                value["revision"] = json!(created.revision);
                render_json(&value)
            } else {
                format!(
                    "key {} ({}) created:\n\n  {}\n\nStore it now: it is not shown again. Clients send it as `Authorization: Bearer <key>`.\n",
                    key.key_id, key.name, created.secret
                )
            }
        }
        KeysCommand::List => {
            let response = client.list_keys(ListKeysRequest {}).await.map_err(rpc_error)?.into_inner();
            if json_out {
                let keys: Vec<Value> = response.keys.iter().map(key_json).collect();
                render_json(&json!({"version": response.version, "keys": keys}))
            } else {
                let rows = response.keys.iter().map(key_row).collect();
                table(&["KEY ID", "NAME", "STATE", "MODELS", "RPM", "TOKENS/DAY", "EXPIRES"], rows)
            }
        }
        KeysCommand::Show { key_id } => {
            let key = client.get_key(GetKeyRequest { key_id }).await.map_err(rpc_error)?.into_inner();
            if json_out {
                render_json(&key_json(&key))
            } else {
                table(&["KEY ID", "NAME", "STATE", "MODELS", "RPM", "TOKENS/DAY", "EXPIRES"], vec![key_row(&key)])
            }
        }
        KeysCommand::Revoke { key_id } => {
            let response =
                client.revoke_key(RevokeKeyRequest { key_id: key_id.clone() }).await.map_err(rpc_error)?.into_inner();
            written(json_out, &format!("key {key_id} revoked"), response.revision)
        }
    })
}

/// A FleetService client that sends the admin token, when it has one, with
/// every call.
pub type AdminClient = FleetServiceClient<InterceptedService<Channel, inferyes_proto::bearer::Bearer>>;

pub fn admin_client(channel: Channel, token: Option<&str>) -> anyhow::Result<AdminClient> {
    let bearer = inferyes_proto::bearer::Bearer::new(token)
        .map_err(|_| anyhow::anyhow!("the admin token must be printable ASCII"))?;
    Ok(FleetServiceClient::with_interceptor(channel, bearer))
}

fn usage_record_json(r: &UsageRecord) -> Value {
    json!({
        "request_id": r.request_id, "unix_ms": r.unix_ms, "key_id": r.key_id, "model": r.model,
        "node_id": r.node_id, "status": r.status, "outcome": r.outcome, "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens, "completion_tokens": r.completion_tokens, "estimated": r.estimated,
        "latency_ms": r.latency_ms, "ttft_ms": r.ttft_ms, "stream": r.stream,
    })
}

fn render_usage(report: &UsageReport, json_out: bool) -> String {
    let usage = |row: &UsageRow| row.usage.unwrap_or_default();
    if json_out {
        let rows: Vec<Value> = report
            .rows
            .iter()
            .map(|row| {
                let u = usage(row);
                json!({
                    "hour_unix_ms": row.hour_unix_ms, "key_id": row.key_id, "model": row.model,
                    "requests": u.requests, "errors": u.errors, "prompt_tokens": u.prompt_tokens,
                    "cached_tokens": u.cached_tokens, "completion_tokens": u.completion_tokens,
                    "estimated_requests": u.estimated_requests, "latency_ms_sum": u.latency_ms_sum,
                })
            })
            .collect();
        return render_json(&json!({"rows": rows, "pending_batches": report.pending_batches}));
    }
    let mut total = inferyes_proto::v1::UsageRollup::default();
    let mut rows: Vec<Vec<String>> = report
        .rows
        .iter()
        .map(|row| {
            let u = usage(row);
            inferyes_proto::usage::merge(&mut total, &u);
            let hour = inferyes_proto::usage::hour_of(row.hour_unix_ms);
            vec![
                format!("{}-{}-{} {}:00", &hour[0..4], &hour[4..6], &hour[6..8], &hour[8..10]),
                if row.key_id.is_empty() { "-".into() } else { row.key_id.clone() },
                row.model.clone(),
                u.requests.to_string(),
                u.errors.to_string(),
                u.prompt_tokens.to_string(),
                u.cached_tokens.to_string(),
                u.completion_tokens.to_string(),
                u.estimated_requests.to_string(),
            ]
        })
        .collect();
    rows.push(vec![
        "total".into(),
        String::new(),
        String::new(),
        total.requests.to_string(),
        total.errors.to_string(),
        total.prompt_tokens.to_string(),
        total.cached_tokens.to_string(),
        total.completion_tokens.to_string(),
        total.estimated_requests.to_string(),
    ]);
    let mut out = table(
        &["HOUR (UTC)", "KEY", "MODEL", "REQUESTS", "ERRORS", "PROMPT", "CACHED", "COMPLETION", "ESTIMATED"],
        rows,
    );
    if report.pending_batches > 0 {
        let _ = writeln!(out, "({} batches received and not rolled up yet)", report.pending_batches);
    }
    out
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
        "state": key_state(key),
        "allowed_models": key.allowed_models,
        "requests_per_minute": key.requests_per_minute,
        "tokens_per_day": key.tokens_per_day,
        "expires_unix_ms": key.expires_unix_ms,
        "created_unix_ms": key.created_unix_ms,
        "revoked_unix_ms": key.revoked_unix_ms,
    })
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

/// `90m`, `12h`, `30d`, `45s` → milliseconds.
fn parse_duration_ms(text: &str) -> anyhow::Result<u64> {
    let text = text.trim();
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let number: u64 = number.parse().with_context(|| format!("`{text}`: write a number and a unit, e.g. 30d"))?;
    let unit_ms = match unit {
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => anyhow::bail!("`{text}`: the unit must be s, m, h or d"),
    };
    anyhow::ensure!(number > 0, "`{text}`: the duration must be positive");
    Ok(number.saturating_mul(unit_ms))
}

fn render_policy(policy: &RoutingPolicy, json_out: bool) -> String {
    let or_default = |v: f64, d: &str| if v == 0.0 { format!("{d} (default)") } else { v.to_string() };
    let strategy_name = |s: i32| Strategy::try_from(s).map(|s| s.as_str_name()).unwrap_or("STRATEGY_UNSPECIFIED");
    if json_out {
        let models: serde_json::Map<String, Value> =
            policy.model_strategies.iter().map(|(m, s)| (m.clone(), json!(strategy_name(*s)))).collect();
        return render_json(&json!({
            "admission_threshold": policy.admission_threshold,
            "hard_limit": policy.hard_limit,
            "load_bound": policy.load_bound,
            "default_strategy": strategy_name(policy.default_strategy),
            "model_strategies": models,
            "continue_broken_streams": policy.continue_broken_streams,
            "continue_models": policy.continue_models,
            "latency_critical_models": policy.latency_critical_models,
        }));
    }
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
    let mut models: Vec<_> = policy.model_strategies.iter().collect();
    models.sort();
    for (model, strategy) in models {
        let _ = writeln!(out, "  {model}: {}", strategy_name(*strategy));
    }
    out
}

fn rpc_error(status: tonic::Status) -> anyhow::Error {
    let hint = match status.code() {
        tonic::Code::Unavailable => " (is the controller running and reachable?)",
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => " (check the admin token)",
        _ => "",
    };
    anyhow::anyhow!("{}{hint}", status.message())
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
                   "size_bytes": m.size_bytes, "endpoints": m.endpoints().map(|e| e.as_str_name()).collect::<Vec<_>>()})
        })
        .collect();
    json!({"id": b.id, "kind": b.kind().as_str_name(), "health": b.health().as_str_name(), "weight": b.weight,
           "slots_total": b.slots_total, "slots_busy": b.slots_busy, "requests_deferred": b.requests_deferred,
           "in_flight": b.in_flight, "tokens_per_second": b.tokens_per_second, "probe_error": b.probe_error,
           "models": models})
}

/// Sessions resident on the node, as the controller counted them.
fn resident(status: &inferyes_proto::v1::NodeStatus) -> u64 {
    status.backends.iter().map(|b| u64::from(b.resident_sessions)).sum()
}

fn node_json(node: &SnapshotNode) -> Value {
    let Some(s) = node.status.as_ref() else { return Value::Null };
    json!({"node_id": s.node_id, "hostname": s.hostname, "proxy_url": s.proxy_url, "draining": node.draining,
           "agent_version": s.agent_version, "gpus": s.gpus.iter().map(gpu_json).collect::<Vec<_>>(),
           "backends": s.backends.iter().map(backend_json).collect::<Vec<_>>(), "sessions": resident(s)})
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
                if n.draining { "draining".into() } else { "active".into() },
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
    let _ = writeln!(out, "node:      {}{}", s.node_id, if node.draining { " (draining)" } else { "" });
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
    }
    let _ = writeln!(out, "sessions:  {}", resident(s));
    out
}

fn table(headers: &[&str], rows: Vec<Vec<String>>) -> String {
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
