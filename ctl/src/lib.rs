//! `inferyesctl`: the operator's command line over the controller's
//! FleetService. The binary only parses arguments and prints what
//! [`run`] returns, so tests drive the same code.

mod render;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use inferyes_proto::v1::fleet_service_client::FleetServiceClient;
use inferyes_proto::v1::{
    Alias, CreateKeyRequest, DeleteAliasRequest, DrainRequest, ExplainRequest, GetKeyRequest, GetNodeRequest,
    GetPolicyRequest, ListAliasesRequest, ListKeysRequest, ListModelsRequest, ListNodesRequest, ListSessionsRequest,
    NodePolicy, Priority, RevokeKeyRequest, SetNodePolicyRequest, Strategy, UndrainRequest, UsageQuery,
};
pub use render::Render;
use render::{Drained, Policy, Sessions, Written, render, usage_record_line};
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
    /// A file holding a viewer token: reads only (nodes, models, sessions,
    /// policy, aliases). The admin token, when given, is sent instead.
    #[arg(long, global = true, env = "INFERYES_VIEWER_TOKEN_FILE")]
    pub viewer_token_file: Option<std::path::PathBuf>,
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
    /// Stop sending new sessions to a node; in-flight requests finish, and
    /// its resident conversations move to other nodes where their slots can
    /// (`inferyesctl node NODE` shows how far).
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
    /// Where a recent request went and why: every node routing weighed for
    /// it, with the terms of its cost.
    Explain {
        /// The request's `x-request-id` (none: the newest request).
        request_id: Option<String>,
    },
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
    /// Usage per hour, key (or tenant) and model, from the usage ledger:
    /// requests, tokens, and the backends' time on them (GPU-S: seconds
    /// reading prompts and generating, each request's own).
    Usage {
        /// Only this key id.
        #[arg(long)]
        key: Option<String>,
        /// Sum the keys of each tenant together (a key without a tenant is
        /// one of its own).
        #[arg(long)]
        by_tenant: bool,
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
        /// The tenant the key belongs to: its keys share their
        /// conversations' residency (none: the key is a tenant of its own).
        #[arg(long)]
        tenant: Option<String>,
        /// Requests in flight at once, on each data plane (none: the data
        /// plane's default share).
        #[arg(long)]
        max_concurrent: Option<u32>,
        /// Its requests' weight in a data plane's queue against other
        /// tenants' and keys': twice the weight, twice the turns (none: 1).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=i64::from(inferyes_proto::apikey::MAX_WEIGHT)))]
        weight: Option<u32>,
        /// The class its requests wait in: interactive (the default) go
        /// before batch; a request may ask for batch.
        #[arg(long, value_enum)]
        priority: Option<PriorityArg>,
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
        /// Keep MODEL warm on MIN nodes (at most MAX), loading and unloading it
        /// without a client asking; MODEL=0 removes it. Repeatable.
        #[arg(long = "replicas", value_name = "MODEL=MIN[:MAX]")]
        replicas: Vec<String>,
        /// `off`: placement only reports desired against warm, and loads or
        /// unloads nothing.
        #[arg(long, value_name = "on|off")]
        placement: Option<OnOff>,
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
pub enum OnOff {
    On,
    Off,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PriorityArg {
    Interactive,
    Batch,
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
    let mut client = connect(&cli).await?;
    let output = cli.output;
    let text = match cli.command {
        Command::Nodes => {
            render(&client.list_nodes(ListNodesRequest {}).await.map_err(rpc_error)?.into_inner(), output)
        }
        Command::Node { node_id } => {
            render(&client.get_node(GetNodeRequest { node_id }).await.map_err(rpc_error)?.into_inner(), output)
        }
        Command::Models => {
            render(&client.list_models(ListModelsRequest {}).await.map_err(rpc_error)?.into_inner(), output)
        }
        Command::Sessions { node } => {
            let request = ListSessionsRequest { node_id: node.unwrap_or_default() };
            let response = client.list_sessions(request).await.map_err(rpc_error)?.into_inner();
            render(&Sessions { response, now_s: inferyes_proto::unix_ms() / 1000 }, output)
        }
        Command::Explain { request_id } => {
            let request = ExplainRequest { request_id: request_id.unwrap_or_default() };
            render(&client.explain(request).await.map_err(rpc_error)?.into_inner(), output)
        }
        Command::Drain { node_id, reason, force } => {
            let response = client.drain(DrainRequest { node_id, reason, force }).await.map_err(rpc_error)?.into_inner();
            render(&Drained { node_id: response.node_id, draining: true, revision: response.revision }, output)
        }
        Command::Undrain { node_id } => {
            let response = client.undrain(UndrainRequest { node_id }).await.map_err(rpc_error)?.into_inner();
            render(&Drained { node_id: response.node_id, draining: false, revision: response.revision }, output)
        }
        Command::Alias(command) => alias(&mut client, command, output).await?,
        Command::Keys(command) => keys(&mut client, command, output).await?,
        Command::Usage { key, by_tenant, model, since, export } => {
            let since_unix_ms = match since {
                Some(text) => inferyes_proto::unix_ms().saturating_sub(parse_duration_ms(&text)?),
                None => 0,
            };
            let query = UsageQuery { key_id: key.unwrap_or_default(), model: model.unwrap_or_default(), since_unix_ms };
            usage(&mut client, query, (by_tenant, export), output).await?
        }
        Command::Policy(command) => policy(&mut client, command, output).await?,
        Command::Completions { .. } => unreachable!("answered before connecting"),
    };
    Ok(text)
}

/// The controller's admin API, with the admin token, else the viewer's.
async fn connect(cli: &Cli) -> anyhow::Result<AdminClient> {
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
    let token = match inferyes_proto::files::read_token(
        cli.admin_token.as_deref(),
        cli.admin_token_file.as_deref(),
        "admin token",
    )? {
        Some(token) => Some(token),
        None => inferyes_proto::files::read_token(None, cli.viewer_token_file.as_deref(), "viewer token")?,
    };
    admin_client(channel, token.as_deref())
}

async fn alias(client: &mut AdminClient, command: AliasCommand, output: Output) -> anyhow::Result<String> {
    Ok(match command {
        AliasCommand::List => {
            render(&client.list_aliases(ListAliasesRequest {}).await.map_err(rpc_error)?.into_inner(), output)
        }
        AliasCommand::Set { alias, model } => {
            let request = Alias { alias: alias.clone(), model: model.clone() };
            let response = client.set_alias(request).await.map_err(rpc_error)?.into_inner();
            render(&Written { what: format!("alias {alias} -> {model}"), revision: response.revision }, output)
        }
        AliasCommand::Rm { alias } => {
            let request = DeleteAliasRequest { alias: alias.clone() };
            let response = client.delete_alias(request).await.map_err(rpc_error)?.into_inner();
            render(&Written { what: format!("alias {alias} removed"), revision: response.revision }, output)
        }
    })
}

/// Usage by `query`: the records themselves, one JSON line each
/// (`export`), else the report, by tenant where asked.
async fn usage(
    client: &mut AdminClient,
    query: UsageQuery,
    (by_tenant, export): (bool, bool),
    output: Output,
) -> anyhow::Result<String> {
    if export {
        let mut stream = client.export_usage(query).await.map_err(rpc_error)?.into_inner();
        let mut out = String::new();
        while let Some(record) = stream.message().await.map_err(rpc_error)? {
            out.push_str(&usage_record_line(&record));
        }
        return Ok(out);
    }
    let report = client.get_usage(query).await.map_err(rpc_error)?.into_inner();
    Ok(render(&if by_tenant { render::by_tenant(report) } else { report }, output))
}

async fn policy(client: &mut AdminClient, command: PolicyCommand, output: Output) -> anyhow::Result<String> {
    Ok(match command {
        PolicyCommand::Show => {
            let policy = client.get_policy(GetPolicyRequest {}).await.map_err(rpc_error)?.into_inner();
            render(&Policy { policy, revision: None }, output)
        }
        PolicyCommand::Set {
            admission,
            hard_limit,
            load_bound,
            strategy,
            model_strategies,
            continue_streams,
            continue_models,
            latency_critical,
            replicas,
            placement,
        } => {
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
            if let Some(v) = placement {
                policy.placement_off = v == OnOff::Off;
            }
            for declared in replicas {
                let (model, counts) = parse_replicas(&declared)?;
                match counts {
                    Some(counts) => policy.replicas.insert(model, counts),
                    None => policy.replicas.remove(&model),
                };
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
            render(&Policy { policy, revision: Some(response.revision) }, output)
        }
        PolicyCommand::Node { node_id, admission, hard_limit } => {
            let request = SetNodePolicyRequest {
                node_id: node_id.clone(),
                policy: Some(NodePolicy { admission_threshold: admission, hard_limit }),
            };
            let response = client.set_node_policy(request).await.map_err(rpc_error)?.into_inner();
            render(&Written { what: format!("node {node_id} thresholds set"), revision: response.revision }, output)
        }
    })
}

async fn keys(client: &mut AdminClient, command: KeysCommand, output: Output) -> anyhow::Result<String> {
    Ok(match command {
        KeysCommand::Create {
            name,
            models,
            rpm,
            tokens_per_day,
            expires_in,
            tenant,
            max_concurrent,
            weight,
            priority,
        } => {
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
                tenant: tenant.unwrap_or_default(),
                max_concurrent: max_concurrent.unwrap_or(0),
                weight: weight.unwrap_or(0),
                priority: match priority.unwrap_or(PriorityArg::Interactive) {
                    PriorityArg::Interactive => Priority::Interactive,
                    PriorityArg::Batch => Priority::Batch,
                } as i32,
            };
            render(&client.create_key(request).await.map_err(rpc_error)?.into_inner(), output)
        }
        KeysCommand::List => {
            render(&client.list_keys(ListKeysRequest {}).await.map_err(rpc_error)?.into_inner(), output)
        }
        KeysCommand::Show { key_id } => {
            render(&client.get_key(GetKeyRequest { key_id }).await.map_err(rpc_error)?.into_inner(), output)
        }
        KeysCommand::Revoke { key_id } => {
            let response =
                client.revoke_key(RevokeKeyRequest { key_id: key_id.clone() }).await.map_err(rpc_error)?.into_inner();
            render(&Written { what: format!("key {key_id} revoked"), revision: response.revision }, output)
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

/// `qwen=2` or `qwen=2:3` → the model and its replicas; `qwen=0`: none.
fn parse_replicas(text: &str) -> anyhow::Result<(String, Option<inferyes_proto::v1::Replicas>)> {
    let (model, counts) =
        text.split_once('=').with_context(|| format!("`{text}`: write MODEL=MIN or MODEL=MIN:MAX, e.g. qwen=2"))?;
    anyhow::ensure!(!model.is_empty(), "`{text}`: the model is missing");
    let (min, max) = counts.split_once(':').unwrap_or((counts, "0"));
    let number = |n: &str| n.trim().parse::<u32>().with_context(|| format!("`{text}`: `{n}` is not a count"));
    let (min, max) = (number(min)?, number(max)?);
    if min == 0 && max == 0 {
        return Ok((model.to_string(), None));
    }
    anyhow::ensure!(max == 0 || max >= min, "`{text}`: the maximum is below the minimum");
    Ok((model.to_string(), Some(inferyes_proto::v1::Replicas { min, max })))
}

fn rpc_error(status: tonic::Status) -> anyhow::Error {
    let hint = match status.code() {
        tonic::Code::Unavailable => " (is the controller running and reachable?)",
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => " (check the admin token)",
        _ => "",
    };
    anyhow::anyhow!("{}{hint}", status.message())
}

#[cfg(test)]
mod tests {
    use inferyes_proto::v1::Replicas;

    #[test]
    fn replicas_are_written_model_equals_min_and_maybe_max() {
        assert_eq!(super::parse_replicas("qwen=2").unwrap(), ("qwen".into(), Some(Replicas { min: 2, max: 0 })));
        assert_eq!(super::parse_replicas("org/m=1:3").unwrap(), ("org/m".into(), Some(Replicas { min: 1, max: 3 })));
        assert_eq!(super::parse_replicas("qwen=0").unwrap(), ("qwen".into(), None));
        for bad in ["qwen", "=2", "qwen=two", "qwen=3:2", "qwen=-1"] {
            assert!(super::parse_replicas(bad).is_err(), "{bad}");
        }
    }
}
