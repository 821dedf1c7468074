//! The agent's configuration: defaults, then a TOML file, then `INFERYES_*`
//! environment variables, then flags. Only this module reads the
//! environment (through clap).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

use inferyes_sim::SimConfig;

#[derive(Clone, Debug, clap::Parser)]
#[command(name = "inferyes-agent", version, about = "Inferyes agent: watches one host's GPUs and inference servers")]
pub struct Args {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// TOML configuration file.
    #[arg(long, env = "INFERYES_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    pub print_config: bool,
    /// This node's id in the fleet (default: the hostname).
    #[arg(long, env = "INFERYES_NODE_ID")]
    pub node_id: Option<String>,
    /// Controller gRPC addresses, comma separated; tried in turn.
    #[arg(long, env = "INFERYES_CONTROLLERS", value_delimiter = ',')]
    pub controllers: Option<Vec<String>>,
    /// Listen address of the local proxy that fronts the backends.
    #[arg(long, env = "INFERYES_PROXY_LISTEN")]
    pub proxy_listen: Option<SocketAddr>,
    /// Listen address for /metrics and health, kept off the proxy's port.
    #[arg(long, env = "INFERYES_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// URL at which data planes reach the proxy (default: http://<proxy_listen>).
    #[arg(long, env = "INFERYES_ADVERTISE_URL")]
    pub advertise_url: Option<String>,
    /// Log format: text or json.
    #[arg(long, env = "INFERYES_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    /// The fleet's join token itself (prefer join_token_file in the config file).
    #[arg(long, env = "INFERYES_JOIN_TOKEN", hide_env_values = true)]
    pub join_token: Option<String>,
    /// Threads serving the proxy (default: one per core).
    #[arg(long, env = "INFERYES_WORKERS")]
    pub workers: Option<usize>,
    /// Address blocks of health probers, comma separated (e.g. the host's
    /// own address, 10.0.0.5/32): never counted as strangers.
    #[arg(long, env = "INFERYES_TRUSTED_PROBERS", value_delimiter = ',')]
    pub trusted_probers: Option<Vec<inferyes_net::forwarded::Cidr>>,
}

#[derive(Clone, Debug, clap::Subcommand)]
pub enum Command {
    /// Run a simulated inference server (llama-server or llama-swap API) on its own.
    Simulate {
        /// Listen address.
        #[arg(long, default_value = "127.0.0.1:8081")]
        listen: SocketAddr,
        /// TOML file with the simulator's settings (a `[simulator]`-style table at top level).
        #[arg(long)]
        sim_config: Option<PathBuf>,
        /// Model id, when no file is given.
        #[arg(long, default_value = "sim-chat")]
        model: String,
    },
}

pub use inferyes_net::process::LogFormat;

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub version: u32,
    pub node_id: String,
    pub controllers: Vec<String>,
    pub proxy_listen: SocketAddr,
    /// `/metrics` and health, for scrapers and probes: the proxy's port is
    /// the data planes'.
    pub admin_listen: SocketAddr,
    pub advertise_url: String,
    /// How often backends and GPUs are polled.
    pub poll_interval_ms: u64,
    /// The shortest gap between two reports; changes inside it are merged.
    pub min_report_interval_ms: u64,
    pub log_format: LogFormat,
    pub gpu: GpuConfig,
    pub backends: Vec<BackendConfig>,
    /// Simulated backends this agent starts itself (for machines without
    /// GPUs, demos and tests). Each is added as a backend.
    pub simulated: Vec<SimulatedBackend>,
    /// A file holding the fleet's join token, presented to controllers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub join_token_file: Option<PathBuf>,
    /// TLS to `https://` controllers, and on the proxy when a certificate
    /// is given (see `inferyes_proto::tls`).
    pub tls: inferyes_proto::tls::Tls,
    /// Threads serving the proxy, each with its own connections and its
    /// own pool of connections to the backends; 0 is one per core.
    pub workers: usize,
    /// On shutdown, requests in flight through the proxy get this long to
    /// finish; then they are cut.
    pub shutdown_grace_ms: u64,
    /// Connections the proxy holds open at once, all peers together.
    pub max_connections: usize,
    /// Of those, what peers no request has yet proved a fleet member
    /// (with the join token) may hold, all together and per address (an
    /// IPv6 /64): what a stranger can cost the node, in descriptors and
    /// memory, however many connections it opens.
    pub max_stranger_connections: usize,
    pub max_stranger_connections_per_address: usize,
    /// Address blocks whose connections are never a stranger's: health
    /// probes (the kubelet on the agent's own host, a balancer's checks),
    /// which strangers filling their places must not turn away.
    pub trusted_probers: Vec<inferyes_net::forwarded::Cidr>,
    /// From the environment or a flag; never written out.
    #[serde(skip)]
    pub join_token: Option<String>,
    pub moves: MovesConfig,
    /// The KV tier of each backend with a slots directory.
    pub tier: TierConfig,
    /// What an hour of this node's GPU time costs, in the operator's
    /// currency (every node priced in the same one); 0: not priced. Usage
    /// records are priced with it.
    pub gpu_hour_price: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    /// Unique within this node.
    pub id: String,
    pub url: String,
    #[serde(default)]
    pub kind: BackendKind,
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Endpoint kinds its models serve (chat, completion, embedding, rerank,
    /// responses, messages, infill, transcription, speech, images). Empty:
    /// not known, any is tried (but what a backend answers 501 for, and
    /// infill on a llama-server model without its tokens).
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// Models this backend serves, as reported while its own catalog cannot
    /// be read (e.g. while llama-server loads). Optional: once read, the
    /// backend's catalog is what counts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    /// GPU memory each model takes once loaded (weights and KV cache), by
    /// model id, where the backend does not say: llama-swap does not.
    /// Routing holds a cold load to the node's admission threshold with it,
    /// and two loads never start at once on a GPU that holds one.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub model_sizes: std::collections::BTreeMap<String, u64>,
    /// Tokens the backend's host prompt cache holds (llama-server's
    /// `--cache-ram` divided by the model's KV bytes per token; 0 when it
    /// runs with `--cache-ram 0`). Sessions beyond the slots are believed
    /// resident while they fit in it.
    #[serde(default = "default_host_cache_tokens")]
    pub host_cache_tokens: u64,
    /// Models it holds loaded at once, where it does not say: llama-swap
    /// runs one model at a time outside its groups, and loading another
    /// stops it (unset: 1 for llama-swap); router-mode llama-server says
    /// its own `--models-max`. Placement then picks which idle model makes
    /// room, rather than the backend stopping one in use. 0: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models_max: Option<u32>,
    /// Credential the proxy adds to every request to this backend (e.g.
    /// llama-server's --api-key). It never leaves this host, and is never
    /// printed (`--print-config` leaves it out).
    #[serde(default, skip_serializing)]
    pub api_key: String,
    /// The credential read from this file instead, which must not be
    /// readable by the file's group or others.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_file: Option<std::path::PathBuf>,
    /// The credential read from this environment variable instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// Where its slots are saved, for moving conversations between nodes
    /// (a llama-server only). Unset: its slots are not moved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<SlotsConfig>,
}

/// A llama-server's slot files, as the agent reaches them.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotsConfig {
    /// The server's `--slot-save-path`, as a directory this agent reads
    /// and writes (the same host, or a shared volume); a relative path is
    /// the agent's working directory's.
    pub dir: PathBuf,
    /// The server's flags that shape its KV cache, as given to it: the
    /// cache types (`-ctk`, `-ctv`), flash attention (`-fa`),
    /// `--swa-full`, `--kv-unified`. A slot moves only between servers
    /// whose model file, build and these flags are alike; a
    /// sliding-window model's slots only with `--swa-full`.
    #[serde(default)]
    pub flags: String,
}

/// The largest `moves.max_slot_bytes`: 1 PiB.
pub const MAX_SLOT_BYTES: u64 = 1 << 50;
/// The largest `moves.max_incoming`.
pub const MAX_INCOMING: usize = 4096;

/// Bounds on moving conversations' slots.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MovesConfig {
    /// The largest slot file sent or taken.
    pub max_slot_bytes: u64,
    /// A drain starts no move after this long.
    pub drain_seconds: u64,
    /// Nor once it has sent this many bytes.
    pub drain_bytes: u64,
    /// Slot files taken from other nodes at once, and carries data planes
    /// ask for at once; more are refused (429) and go elsewhere.
    pub max_incoming: usize,
    /// Free space a slot file taken leaves on its directory's filesystem,
    /// counting the files still arriving at their full length.
    pub min_free_bytes: u64,
}

impl Default for MovesConfig {
    fn default() -> MovesConfig {
        MovesConfig {
            max_slot_bytes: 4 << 30,
            drain_seconds: 120,
            drain_bytes: 64 << 30,
            max_incoming: 2,
            min_free_bytes: 4 << 30,
        }
    }
}

/// Bounds on each backend's KV tier: conversations' slot states kept in
/// its slots directory after each turn, restored when they return to a
/// slot that no longer holds them. Free space is kept as for moves
/// (`moves.min_free_bytes`).
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierConfig {
    /// Bytes of slot states kept per backend; 0: no tier.
    pub max_bytes: u64,
    /// States kept per backend.
    pub max_entries: usize,
}

/// The most states a backend's tier keeps: each is a resident session
/// reported to the controller.
pub const MAX_TIER_ENTRIES: usize = 4096;

impl Default for TierConfig {
    fn default() -> TierConfig {
        TierConfig { max_bytes: 16 << 30, max_entries: 1024 }
    }
}

impl BackendConfig {
    /// Models it holds loaded at once: as configured, else llama-swap's
    /// one at a time, else no limit known (0).
    pub fn models_max(&self) -> u32 {
        self.models_max.unwrap_or(if self.kind == BackendKind::LlamaSwap { 1 } else { 0 })
    }

    /// `api_key` filled in from `api_key_file` or `api_key_env`, at most
    /// one of the three set.
    fn read_api_key(&mut self) -> anyhow::Result<()> {
        let id = &self.id;
        let sources = usize::from(!self.api_key.is_empty())
            + usize::from(self.api_key_file.is_some())
            + usize::from(self.api_key_env.is_some());
        if sources > 1 {
            bail!("backend `{id}`: give one of api_key, api_key_file and api_key_env");
        }
        if let Some(path) = &self.api_key_file {
            self.api_key = read_secret_file(path).with_context(|| format!("backend `{id}`: api_key_file"))?;
        }
        if let Some(variable) = &self.api_key_env {
            self.api_key = std::env::var(variable)
                .map(|value| value.trim().to_string())
                .with_context(|| format!("backend `{id}`: api_key_env names `{variable}`, which is not set"))?;
        }
        if (self.api_key_file.is_some() || self.api_key_env.is_some()) && self.api_key.is_empty() {
            bail!("backend `{id}`: its api key is empty");
        }
        if !self.api_key.is_empty() && inferyes_proto::bearer::header_value(&self.api_key).is_none() {
            bail!("backend `{id}`: its api key must be printable ASCII");
        }
        Ok(())
    }
}

/// A secret kept in a file only its owner can read: one that the file's
/// group or everyone may read is refused, as ssh refuses a key file.
fn read_secret_file(path: &std::path::Path) -> anyhow::Result<String> {
    use std::io::Read as _;
    use std::os::unix::fs::PermissionsExt as _;
    // The mode of the file opened, not of what the path names a moment
    // before it is read.
    let mut file = std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mode = file.metadata().with_context(|| format!("cannot read {}", path.display()))?.permissions().mode();
    if mode & 0o077 != 0 {
        bail!(
            "{} may be read by its group or others (mode {:o}): chmod 600 it (a Kubernetes Secret: defaultMode 0400)",
            path.display(),
            mode & 0o777
        );
    }
    let mut text = String::new();
    file.read_to_string(&mut text).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(text.trim().to_string())
}

fn default_weight() -> u32 {
    1
}

fn default_host_cache_tokens() -> u64 {
    crate::residency::Capacity::default().host_cache_tokens
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackendKind {
    /// One model, or (detected from its `/props`) router mode.
    #[default]
    LlamaServer,
    /// llama-server in router mode (`--models-dir`, `--models-preset`):
    /// models loaded on demand.
    LlamaServerRouter,
    LlamaSwap,
    Openai,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimulatedBackend {
    pub id: String,
    /// Listen address; port 0 picks a free one.
    #[serde(default = "default_sim_listen")]
    pub listen: SocketAddr,
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// The simulated server's settings.
    pub server: SimConfig,
}

fn default_sim_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GpuConfig {
    pub source: GpuSourceConfig,
    /// GPUs this host declares (for `source = "declared"`, or as the
    /// fallback of `auto` when neither NVML nor nvidia-smi answers).
    pub declared: Vec<DeclaredGpu>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuSourceConfig {
    /// NVML, else nvidia-smi, else the declared GPUs, else the simulated
    /// backends' GPUs, else none (a CPU node).
    #[default]
    Auto,
    Nvml,
    NvidiaSmi,
    Declared,
    Simulated,
    None,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeclaredGpu {
    pub name: String,
    pub memory_total_bytes: u64,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            version: 1,
            node_id: String::new(),
            controllers: vec!["http://127.0.0.1:7070".into()],
            proxy_listen: SocketAddr::from(([127, 0, 0, 1], 9100)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 9200)),
            advertise_url: String::new(),
            poll_interval_ms: 1000,
            min_report_interval_ms: 50,
            log_format: LogFormat::Text,
            gpu: GpuConfig::default(),
            backends: Vec::new(),
            simulated: Vec::new(),
            join_token_file: None,
            join_token: None,
            tls: inferyes_proto::tls::Tls::default(),
            workers: 0,
            shutdown_grace_ms: 10_000,
            max_connections: 16_384,
            max_stranger_connections: 512,
            max_stranger_connections_per_address: 128,
            trusted_probers: Vec::new(),
            moves: MovesConfig::default(),
            tier: TierConfig::default(),
            gpu_hour_price: 0.0,
        }
    }
}

impl Config {
    pub fn load(args: &Args) -> anyhow::Result<Config> {
        let mut config: Config = inferyes_proto::files::load_toml(args.config.as_deref())?;
        if let Some(v) = &args.node_id {
            config.node_id.clone_from(v);
        }
        if let Some(v) = &args.controllers {
            config.controllers.clone_from(v);
        }
        if let Some(v) = args.proxy_listen {
            config.proxy_listen = v;
        }
        if let Some(v) = args.admin_listen {
            config.admin_listen = v;
        }
        if let Some(v) = &args.join_token {
            config.join_token = Some(v.clone());
        }
        if let Some(v) = &args.advertise_url {
            config.advertise_url.clone_from(v);
        }
        if let Some(v) = args.log_format {
            config.log_format = v;
        }
        if let Some(v) = args.workers {
            config.workers = v;
        }
        if let Some(v) = &args.trusted_probers {
            config.trusted_probers.clone_from(v);
        }
        if config.node_id.is_empty() {
            config.node_id = hostname();
        }
        for backend in &mut config.backends {
            backend.read_api_key()?;
        }
        config.validate()?;
        Ok(config)
    }

    pub fn shutdown_grace(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.shutdown_grace_ms)
    }

    pub fn workers(&self) -> usize {
        inferyes_net::serve::workers(self.workers)
    }

    /// Whether a connection from `address` is a configured prober's.
    pub fn prober(&self) -> inferyes_net::admit::KnownPeers {
        let probers: Arc<[inferyes_net::forwarded::Cidr]> = self.trusted_probers.clone().into();
        Arc::new(move |address| probers.iter().any(|cidr| cidr.contains(address.to_canonical())))
    }

    /// Which connections the proxy takes.
    pub fn connection_limits(&self) -> inferyes_net::admit::Limits {
        inferyes_net::admit::Limits {
            max: self.max_connections,
            per_peer: self.max_stranger_connections_per_address,
            strangers: self.max_stranger_connections,
            prove_within: Some(inferyes_net::admit::PROVE_WITHIN),
        }
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if self.version != 1 {
            bail!("config version {} is not supported: set `version = 1`", self.version);
        }
        if self.controllers.is_empty() {
            bail!("controllers is empty: list at least one controller address, e.g. [\"http://127.0.0.1:7070\"]");
        }
        if self.max_connections == 0
            || self.max_stranger_connections == 0
            || self.max_stranger_connections_per_address == 0
        {
            bail!(
                "max_connections, max_stranger_connections and max_stranger_connections_per_address must be positive"
            );
        }
        // A prober's address holds connections without a stranger's bounds:
        // a block wide enough to take in clients takes those bounds away.
        if let Some(wide) = self.trusted_probers.iter().find(|cidr| cidr.host_bits() > 8) {
            bail!("trusted_probers: {wide} is wider than 256 addresses; list the probers' own addresses");
        }
        if self.backends.is_empty() && self.simulated.is_empty() {
            bail!("no backends: add a [[backends]] entry (url and kind) or a [[simulated]] backend");
        }
        let bound = inferyes_proto::usage::MAX_GPU_HOUR_PRICE;
        if !(self.gpu_hour_price.is_finite() && (0.0..=bound).contains(&self.gpu_hour_price)) {
            bail!("gpu_hour_price must be a number from 0 (not priced) to {bound}, not {}", self.gpu_hour_price);
        }
        let mut ids: Vec<&str> = self.backends.iter().map(|b| b.id.as_str()).collect();
        ids.extend(self.simulated.iter().map(|s| s.id.as_str()));
        for (i, id) in ids.iter().enumerate() {
            if id.is_empty() {
                bail!("every backend needs a non-empty `id`");
            }
            if ids[..i].contains(id) {
                bail!("backend id `{id}` is used twice: backend ids must be unique on a node");
            }
        }
        for backend in &self.backends {
            // Backends sit next to the agent (the same host or network):
            // it speaks plain HTTP to them.
            if !backend.url.starts_with("http://") {
                bail!(
                    "backend `{}`: url `{}` must start with http:// (the agent speaks plain HTTP to its backends)",
                    backend.id,
                    backend.url
                );
            }
            if let Some(slots) = &backend.slots {
                if backend.kind != BackendKind::LlamaServer {
                    bail!("backend `{}`: slots are moved only between single-model llama-servers", backend.id);
                }
                if slots.dir.as_os_str().is_empty() {
                    bail!("backend `{}`: slots.dir is empty", backend.id);
                }
            }
            for endpoint in &backend.endpoints {
                if inferyes_proto::kinds::named(endpoint).is_none() {
                    let names: Vec<&str> =
                        inferyes_proto::kinds::KINDS.iter().map(|k| inferyes_proto::kinds::name(*k)).collect();
                    bail!("backend `{}`: unknown endpoint kind `{endpoint}` (use {})", backend.id, names.join(", "));
                }
            }
        }
        if self.gpu.source == GpuSourceConfig::Declared && self.gpu.declared.is_empty() {
            bail!("gpu.source = \"declared\" but no [[gpu.declared]] entry (name, memory_total_bytes)");
        }
        if self.poll_interval_ms == 0 {
            bail!("poll_interval_ms must be positive");
        }
        if self.moves.max_slot_bytes == 0 || self.moves.max_incoming == 0 {
            bail!("moves.max_slot_bytes and moves.max_incoming must be positive");
        }
        // So that the lengths of the files arriving at once add up.
        if self.moves.max_slot_bytes > MAX_SLOT_BYTES || self.moves.max_incoming > MAX_INCOMING {
            bail!("moves.max_slot_bytes is at most {MAX_SLOT_BYTES} and moves.max_incoming {MAX_INCOMING}");
        }
        if self.tier.max_entries > MAX_TIER_ENTRIES {
            bail!("tier.max_entries is at most {MAX_TIER_ENTRIES}");
        }
        // Each backend's tier takes every state file in its directory for
        // its own.
        let mut dirs = std::collections::HashSet::new();
        for slots in self.backends.iter().filter_map(|b| b.slots.as_ref()) {
            if self.tier.max_bytes > 0 && !dirs.insert(&slots.dir) {
                bail!(
                    "two backends share slots.dir {}: give each its own while the KV tier is on",
                    slots.dir.display()
                );
            }
        }
        Ok(())
    }

    pub fn poll_interval(&self) -> Duration {
        Duration::from_millis(self.poll_interval_ms)
    }

    pub fn min_report_interval(&self) -> Duration {
        Duration::from_millis(self.min_report_interval_ms)
    }
}

pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[test]
    fn flags_override_the_file_which_overrides_defaults() {
        let dir = std::env::temp_dir().join(format!("inferyes-agent-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("agent.toml");
        std::fs::write(
            &path,
            r#"
version = 1
node_id = "from-file"
poll_interval_ms = 250
[[backends]]
id = "main"
url = "http://127.0.0.1:8081"
kind = "llama-swap"
"#,
        )
        .unwrap();
        let args =
            Args::try_parse_from(["inferyes-agent", "--config", path.to_str().unwrap(), "--node-id", "from-flag"])
                .unwrap();
        let config = Config::load(&args).unwrap();
        assert_eq!(config.node_id, "from-flag");
        assert_eq!(config.poll_interval_ms, 250);
        assert_eq!(config.backends[0].kind, BackendKind::LlamaSwap);
        assert_eq!(config.proxy_listen, Config::default().proxy_listen);
    }

    #[test]
    fn invalid_configs_say_what_to_fix() {
        assert!(toml::from_str::<Config>("polling = 3").is_err());
        let config = Config::default();
        assert!(config.validate().unwrap_err().to_string().contains("no backends"));
        let twice = BackendConfig {
            id: "a".into(),
            url: "http://x".into(),
            kind: BackendKind::LlamaServer,
            weight: 1,
            endpoints: vec![],
            models: vec![],
            model_sizes: std::collections::BTreeMap::new(),
            host_cache_tokens: 0,
            models_max: None,
            api_key: String::new(),
            api_key_file: None,
            api_key_env: None,
            slots: None,
        };
        let swap: BackendConfig = toml::from_str("id = \"s\"\nurl = \"http://x\"\nkind = \"llama-swap\"").unwrap();
        assert_eq!(swap.models_max(), 1, "llama-swap runs one model at a time unless told");
        assert_eq!(BackendConfig { models_max: Some(3), ..swap }.models_max(), 3);
        assert_eq!(twice.models_max(), 0, "a llama-server says its own, or has none");
        let config = Config { backends: vec![twice.clone(), twice.clone()], ..Config::default() };
        assert!(config.validate().unwrap_err().to_string().contains("used twice"));
        let probers = |block: &str| Config {
            backends: vec![twice.clone()],
            trusted_probers: vec![block.parse().unwrap()],
            ..Config::default()
        };
        assert!(probers("10.0.0.0/16").validate().unwrap_err().to_string().contains("wider than 256"));
        assert!(probers("10.0.9.0/24").validate().is_ok());
        let swapped_slots = BackendConfig {
            kind: BackendKind::LlamaSwap,
            slots: Some(SlotsConfig { dir: "/slots".into(), flags: String::new() }),
            ..twice.clone()
        };
        let config = Config { backends: vec![swapped_slots], ..Config::default() };
        assert!(config.validate().unwrap_err().to_string().contains("single-model llama-servers"));
        let https = BackendConfig { url: "https://x".into(), ..twice.clone() };
        let config = Config { backends: vec![https], ..Config::default() };
        assert!(config.validate().unwrap_err().to_string().contains("must start with http://"));
        let moves = |max_slot_bytes, max_incoming| Config {
            backends: vec![twice.clone()],
            moves: MovesConfig { max_slot_bytes, max_incoming, ..MovesConfig::default() },
            ..Config::default()
        };
        assert!(moves(MAX_SLOT_BYTES, MAX_INCOMING).validate().is_ok());
        for (bytes, incoming) in [(MAX_SLOT_BYTES + 1, 1), (1, MAX_INCOMING + 1), (0, 1), (1, 0)] {
            assert!(
                moves(bytes, incoming).validate().unwrap_err().to_string().contains("moves."),
                "{bytes} {incoming}"
            );
        }
        // Two tiers in one directory would take each other's files.
        let slots = Some(SlotsConfig { dir: "/slots".into(), flags: String::new() });
        let sharing = |tier| Config {
            backends: vec![
                BackendConfig { id: "a".into(), slots: slots.clone(), ..twice.clone() },
                BackendConfig { id: "b".into(), slots: slots.clone(), ..twice.clone() },
            ],
            tier,
            ..Config::default()
        };
        assert!(sharing(TierConfig::default()).validate().unwrap_err().to_string().contains("share slots.dir"));
        assert!(sharing(TierConfig { max_bytes: 0, ..TierConfig::default() }).validate().is_ok());
        let entries = |max_entries| Config {
            backends: vec![twice.clone()],
            tier: TierConfig { max_entries, ..TierConfig::default() },
            ..Config::default()
        };
        assert!(entries(MAX_TIER_ENTRIES).validate().is_ok());
        assert!(entries(MAX_TIER_ENTRIES + 1).validate().unwrap_err().to_string().contains("tier.max_entries"));
        let priced = |gpu_hour_price| Config { backends: vec![twice.clone()], gpu_hour_price, ..Config::default() };
        assert!(priced(2.5).validate().is_ok() && priced(0.0).validate().is_ok());
        for price in [-1.0, f64::NAN, f64::INFINITY, 2e6] {
            assert!(priced(price).validate().unwrap_err().to_string().contains("gpu_hour_price"), "{price}");
        }
    }

    #[test]
    fn a_backend_s_key_comes_from_a_file_only_its_owner_reads_or_the_environment() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("inferyes-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("key");
        std::fs::write(&file, "sk-local-123\n").unwrap();
        let backend = |file: Option<std::path::PathBuf>, env: Option<&str>, key: &str| BackendConfig {
            id: "main".into(),
            url: "http://127.0.0.1:8080".into(),
            api_key: key.into(),
            api_key_file: file,
            api_key_env: env.map(str::to_string),
            ..toml::from_str::<BackendConfig>("id = \"main\"\nurl = \"http://127.0.0.1:8080\"").unwrap()
        };
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let error = backend(Some(file.clone()), None, "").read_api_key().unwrap_err();
        assert!(format!("{error:#}").contains("chmod 600"), "{error:#}");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let mut from_file = backend(Some(file.clone()), None, "");
        from_file.read_api_key().unwrap();
        assert_eq!(from_file.api_key, "sk-local-123");
        let printed = toml::to_string(&from_file).unwrap();
        assert!(!printed.contains("sk-local") && printed.contains("api_key_file"), "never printed: {printed}");
        assert!(!toml::to_string(&backend(None, None, "sk-inline")).unwrap().contains("sk-inline"));
        let twice = backend(Some(file), None, "sk-inline").read_api_key().unwrap_err();
        assert!(twice.to_string().contains("give one of"), "{twice}");
        let missing = backend(None, Some("INFERYES_TEST_SURELY_UNSET_VARIABLE"), "").read_api_key().unwrap_err();
        assert!(missing.to_string().contains("not set"), "{missing}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
