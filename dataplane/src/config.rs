//! The data plane's configuration: defaults, then a TOML file, then
//! `INFERYES_*` environment variables, then flags. Only this module reads
//! the environment (through clap).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "inferyes-dataplane",
    version,
    about = "Inferyes data plane: the OpenAI-compatible gateway of the fleet"
)]
pub struct Args {
    /// TOML configuration file.
    #[arg(long, env = "INFERYES_CONFIG")]
    pub config: Option<PathBuf>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    pub print_config: bool,
    /// HTTP listen address for /v1/*.
    #[arg(long, env = "INFERYES_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// HTTP listen address for /metrics and health, kept off the public port.
    #[arg(long, env = "INFERYES_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// Controller gRPC addresses, comma separated; the data plane fails over between them.
    #[arg(long, env = "INFERYES_CONTROLLERS", value_delimiter = ',')]
    pub controllers: Option<Vec<String>>,
    /// This data plane's name in logs (default: dataplane-<hostname>).
    #[arg(long, env = "INFERYES_DATAPLANE_ID")]
    pub dataplane_id: Option<String>,
    /// Largest request body accepted, in bytes.
    #[arg(long, env = "INFERYES_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Log format: text or json.
    #[arg(long, env = "INFERYES_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    /// API keys required (`keys`, the default) or not (`none`: trusted networks only).
    #[arg(long, env = "INFERYES_AUTH")]
    pub auth: Option<crate::auth::AuthMode>,
    /// Threads serving requests (default: one per core).
    #[arg(long, env = "INFERYES_WORKERS")]
    pub workers: Option<usize>,
    /// How requests travel to agents: http1 (the default) or http2.
    #[arg(long, env = "INFERYES_AGENT_PROTOCOL")]
    pub agent_protocol: Option<AgentProtocol>,
    /// The data planes' token itself (prefer dataplane_token_file in the config file).
    #[arg(long, env = "INFERYES_DATAPLANE_TOKEN", hide_env_values = true)]
    pub dataplane_token: Option<String>,
}

pub use inferyes_net::process::LogFormat;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub version: u32,
    pub listen: SocketAddr,
    /// `/metrics` (node ids, models, every key's refusals) and health, for
    /// scrapers and probes: never on the public port.
    pub admin_listen: SocketAddr,
    pub controllers: Vec<String>,
    pub dataplane_id: String,
    pub max_body_bytes: usize,
    /// Bytes of bodies read whole (requests, answers that are not
    /// streamed) all requests may hold at once; past it, 503.
    pub max_buffered_bytes: usize,
    /// Client connections held open at once; past it, a new one is sent
    /// 503 and closed.
    pub max_connections: usize,
    /// Of those, what one client address (an IPv6 /64) may hold; a
    /// trusted proxy has no share of its own. Past it, 503 for that
    /// address alone.
    pub max_connections_per_client: usize,
    /// Requests one client connection may carry before it is closed
    /// (gracefully: its answers in flight go out first); 0: no limit.
    pub max_requests_per_connection: u64,
    /// The share of this data plane one key may hold at once, in percent:
    /// of `max_connections` in requests in flight (unless its record sets
    /// `max_concurrent`) and of `max_buffered_bytes` in bytes. Past it, 429.
    pub key_share_percent: u8,
    /// As `key_share_percent`, for all the keys of one tenant together.
    pub tenant_share_percent: u8,
    /// Requests whose best node has no free slot wait in this data plane
    /// and leave by fair shares when one frees; off, they are sent on at
    /// once to wait in the servers' queues.
    pub queue: bool,
    /// Requests waiting at once, all together; past it, 503.
    pub queue_max_requests: usize,
    /// Bytes of their bodies, all together; past it, 503.
    pub queue_max_bytes: usize,
    /// Of `queue_max_requests`, what one flow (a tenant; a key where it has
    /// none; a client address with auth off) may hold, in percent; past
    /// it, 429 for that flow alone.
    pub queue_flow_share_percent: u8,
    /// How long a request may wait; then 429.
    pub queue_max_wait_ms: u64,
    /// How long a batch request waits behind interactive ones before it
    /// goes with them.
    pub queue_batch_aging_ms: u64,
    /// A client must send its whole request body within this: one that
    /// trickles holds a connection and up to `max_body_bytes` of memory.
    pub request_body_timeout_ms: u64,
    /// Connecting to a node's agent must succeed within this.
    pub connect_timeout_ms: u64,
    /// A node must start answering within this; generous, because a cold
    /// load can take minutes.
    pub response_header_timeout_ms: u64,
    /// A node's answer, once started, may go this long without a byte
    /// (a long prompt is read before the first token); past it, the answer
    /// is broken off as a node failing would break it.
    pub read_timeout_ms: u64,
    /// On SIGTERM, requests in flight get this long to finish.
    pub shutdown_grace_ms: u64,
    /// `policy` (the product: sessions stay with their KV cache, the fleet's
    /// routing policy for the rest), or a baseline that ignores sessions,
    /// `round-robin` or `least-outstanding`, to measure what affinity saves.
    pub routing_mode: crate::routing::Mode,
    /// A later turn whose home is busy may have its conversation's cache
    /// carried to a free slot on another node whose slots are alike, where
    /// that costs less than reading the prompt again there; `false`: it is
    /// read again, as before caches could move.
    pub carry: bool,
    pub log_format: LogFormat,
    /// `keys`: every `/v1/*` request needs an API key. `none`: no keys, for
    /// a trusted network; say so explicitly.
    pub auth: crate::auth::AuthMode,
    /// Wrong secrets a client may send per minute; past it, its checks of
    /// key ids that wrong secrets were sent for lately are refused
    /// unchecked (429). Other key ids are still checked, first.
    pub auth_failures_per_minute: u32,
    /// Proxies (address blocks) in front of the data plane whose
    /// `X-Forwarded-For` names the client; from anyone else the header is
    /// ignored. Without them, a balancer's clients are one client.
    pub trusted_proxies: Vec<inferyes_net::forwarded::Cidr>,
    /// Connections from `trusted_proxies` start with a PROXY protocol
    /// header (v1 or v2) naming the client each relays: that client is
    /// then the connection's, for its share and its requests.
    pub proxy_protocol: bool,
    /// Send each request's usage record to the ledger, for export, besides
    /// the hourly sums. Off: only sums travel and are stored (about 100
    /// bytes of etcd per request saved).
    pub usage_records: bool,
    /// TLS to `https://` controllers and agents (see `inferyes_proto::tls`).
    pub tls: inferyes_proto::tls::Tls,
    /// Threads serving requests, each with its own connections and its own
    /// pool of connections to agents; 0 is one per core.
    pub workers: usize,
    /// How requests travel to agents: `http1`, a pool of connections, one
    /// request each at a time; or `http2` (h2c, or h2 over TLS) to agents
    /// that take it, one connection per worker and agent carrying every
    /// request as a stream. HTTP/1.1 is the default: HTTP/2 cost about 60 µs
    /// more per request at low concurrency (docs/performance.md).
    pub agent_protocol: AgentProtocol,
    /// A file holding the data planes' token, presented to controllers;
    /// without one, they must be open to data planes. Agents are sent what
    /// the controller's snapshot says they take, never a token of this
    /// data plane's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dataplane_token_file: Option<PathBuf>,
    /// From the environment or a flag; never written out.
    #[serde(skip)]
    pub dataplane_token: Option<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AgentProtocol {
    #[default]
    Http1,
    Http2,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            version: 1,
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 9190)),
            controllers: vec!["http://127.0.0.1:7070".into()],
            dataplane_id: String::new(),
            max_body_bytes: 32 << 20,
            max_buffered_bytes: 256 << 20,
            max_connections: 4096,
            max_connections_per_client: 256,
            max_requests_per_connection: 10_000,
            key_share_percent: 25,
            tenant_share_percent: 50,
            queue: true,
            queue_max_requests: 1024,
            queue_max_bytes: 64 << 20,
            queue_flow_share_percent: 25,
            queue_max_wait_ms: 300_000,
            queue_batch_aging_ms: 30_000,
            request_body_timeout_ms: 60_000,
            connect_timeout_ms: 2000,
            response_header_timeout_ms: 600_000,
            read_timeout_ms: 600_000,
            shutdown_grace_ms: 30_000,
            routing_mode: crate::routing::Mode::Policy,
            carry: true,
            log_format: LogFormat::Text,
            auth: crate::auth::AuthMode::Keys,
            auth_failures_per_minute: 10,
            trusted_proxies: Vec::new(),
            proxy_protocol: false,
            usage_records: false,
            tls: inferyes_proto::tls::Tls::default(),
            workers: 0,
            agent_protocol: AgentProtocol::Http1,
            dataplane_token_file: None,
            dataplane_token: None,
        }
    }
}

impl Config {
    pub fn load(args: &Args) -> anyhow::Result<Config> {
        let mut config: Config = inferyes_proto::files::load_toml(args.config.as_deref())?;
        if let Some(v) = args.listen {
            config.listen = v;
        }
        if let Some(v) = args.admin_listen {
            config.admin_listen = v;
        }
        if let Some(v) = &args.controllers {
            config.controllers.clone_from(v);
        }
        if let Some(v) = &args.dataplane_id {
            config.dataplane_id.clone_from(v);
        }
        if let Some(v) = args.max_body_bytes {
            config.max_body_bytes = v;
        }
        if let Some(v) = args.log_format {
            config.log_format = v;
        }
        if let Some(v) = args.auth {
            config.auth = v;
        }
        if let Some(v) = args.workers {
            config.workers = v;
        }
        if let Some(v) = args.agent_protocol {
            config.agent_protocol = v;
        }
        if let Some(v) = &args.dataplane_token {
            config.dataplane_token = Some(v.clone());
        }
        if config.dataplane_id.is_empty() {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            config.dataplane_id = format!("dataplane-{}-{}", host.trim(), std::process::id());
        }
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if self.version != 1 {
            bail!("config version {} is not supported: set `version = 1`", self.version);
        }
        if self.dataplane_id.len() > 128 || self.dataplane_id.chars().any(char::is_control) {
            bail!("dataplane_id must be at most 128 bytes, without control characters");
        }
        if self.controllers.is_empty() {
            bail!("controllers is empty: list at least one controller address, e.g. [\"http://127.0.0.1:7070\"]");
        }
        self.tls.validate()?;
        if self.auth_failures_per_minute == 0 {
            bail!("auth_failures_per_minute must be positive");
        }
        if self.max_buffered_bytes < self.max_body_bytes {
            bail!("max_buffered_bytes must be at least max_body_bytes: one request must fit");
        }
        if !(1..=100).contains(&self.key_share_percent) || !(1..=100).contains(&self.tenant_share_percent) {
            bail!("key_share_percent and tenant_share_percent must be 1-100");
        }
        if self.max_body_bytes == 0 {
            bail!("max_body_bytes must be positive");
        }
        if !(1..=100).contains(&self.queue_flow_share_percent) {
            bail!("queue_flow_share_percent must be 1-100");
        }
        if self.queue && self.queue_max_bytes < self.max_body_bytes {
            bail!("queue_max_bytes must be at least max_body_bytes: one request must fit");
        }
        if self.queue && (self.queue_max_requests == 0 || self.queue_max_wait_ms == 0) {
            bail!(
                "queue_max_requests and queue_max_wait_ms must be positive; to send requests on at once, set queue = false"
            );
        }
        if self.proxy_protocol && self.trusted_proxies.is_empty() {
            bail!("proxy_protocol needs trusted_proxies: the proxies whose connections start with the header");
        }
        if self.max_connections_per_client == 0 {
            bail!("max_connections_per_client must be positive");
        }
        if self.request_body_timeout_ms == 0 {
            bail!("request_body_timeout_ms must be positive");
        }
        if self.connect_timeout_ms == 0 || self.response_header_timeout_ms == 0 || self.read_timeout_ms == 0 {
            bail!("connect_timeout_ms, response_header_timeout_ms and read_timeout_ms must be positive");
        }
        Ok(())
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    pub fn response_header_timeout(&self) -> Duration {
        Duration::from_millis(self.response_header_timeout_ms)
    }

    /// The data planes' token, read from where it was given.
    pub fn dataplane_token(&self) -> anyhow::Result<Option<String>> {
        inferyes_proto::files::read_token(
            self.dataplane_token.as_deref(),
            self.dataplane_token_file.as_deref(),
            "data plane token",
        )
    }

    /// What one key, and one tenant, may hold by default.
    pub fn shares(&self) -> (crate::shares::Limits, crate::shares::Limits) {
        let of = |percent| {
            crate::shares::Limits::percent_of(
                percent,
                self.max_connections,
                self.max_buffered_bytes,
                self.max_body_bytes,
            )
        };
        (of(self.key_share_percent), of(self.tenant_share_percent))
    }

    /// What the queue holds at most; `None` where it is off.
    pub fn queue(&self) -> Option<crate::waiting::Limits> {
        self.queue.then_some(crate::waiting::Limits {
            requests: self.queue_max_requests,
            bytes: self.queue_max_bytes,
            flow_share_percent: u32::from(self.queue_flow_share_percent),
            max_wait_ms: self.queue_max_wait_ms,
            aging_ms: self.queue_batch_aging_ms,
        })
    }

    pub fn request_body_timeout(&self) -> Duration {
        Duration::from_millis(self.request_body_timeout_ms)
    }

    pub fn read_timeout(&self) -> Duration {
        Duration::from_millis(self.read_timeout_ms)
    }

    pub fn workers(&self) -> usize {
        inferyes_net::serve::workers(self.workers)
    }

    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_millis(self.shutdown_grace_ms)
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[test]
    fn flags_override_the_file_which_overrides_defaults() {
        let dir = std::env::temp_dir().join(format!("inferyes-dp-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("dataplane.toml");
        std::fs::write(&path, "version = 1\nmax_body_bytes = 1024\nlisten = \"127.0.0.1:9999\"\n").unwrap();
        let args =
            Args::try_parse_from(["inferyes-dataplane", "--config", path.to_str().unwrap(), "--listen", "127.0.0.1:1"])
                .unwrap();
        let config = Config::load(&args).unwrap();
        assert_eq!(config.listen.port(), 1);
        assert_eq!(config.max_body_bytes, 1024);
        assert_eq!(config.controllers, Config::default().controllers);
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let error = toml::from_str::<Config>("listen_addr = \"127.0.0.1:1\"").unwrap_err();
        assert!(error.to_string().contains("listen_addr"));
    }

    #[test]
    fn the_proxy_protocol_is_taken_only_from_trusted_proxies() {
        let config: Config = toml::from_str("proxy_protocol = true").unwrap();
        let error = config.validate().unwrap_err();
        assert!(error.to_string().contains("trusted_proxies"), "{error}");
        let config: Config = toml::from_str("proxy_protocol = true\ntrusted_proxies = [\"10.0.0.0/8\"]").unwrap();
        assert!(config.validate().is_ok());
    }
}
