//! The controller's configuration: defaults, then a TOML file, then
//! `INFERYES_*` environment variables, then flags. Only this module reads
//! the environment (through clap).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "inferyes-controller",
    version,
    about = "Inferyes controller: fleet state in etcd, routing snapshots, fleet API"
)]
pub struct Args {
    /// TOML configuration file.
    #[arg(long, env = "INFERYES_CONFIG")]
    pub config: Option<PathBuf>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    pub print_config: bool,
    /// This controller's name in logs and records (default: controller-<hostname>).
    #[arg(long, env = "INFERYES_CONTROLLER_ID")]
    pub controller_id: Option<String>,
    /// etcd endpoints, comma separated.
    #[arg(long, env = "INFERYES_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Option<Vec<String>>,
    /// Key prefix of this fleet in etcd.
    #[arg(long, env = "INFERYES_ETCD_PREFIX")]
    pub etcd_prefix: Option<String>,
    /// The user to sign in to etcd as, where etcd has authentication on.
    #[arg(long, env = "INFERYES_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// The file whose first line is that user's password.
    #[arg(long, env = "INFERYES_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
    /// gRPC listen address (AgentService, RoutingService, FleetService).
    #[arg(long, env = "INFERYES_GRPC_LISTEN")]
    pub grpc_listen: Option<SocketAddr>,
    /// HTTP listen address (health, dashboard, metrics).
    #[arg(long, env = "INFERYES_HTTP_LISTEN")]
    pub http_listen: Option<SocketAddr>,
    /// Lease TTL of each node in milliseconds: a dead agent's node leaves the fleet within it.
    #[arg(long, env = "INFERYES_LEASE_TTL_MS")]
    pub lease_ttl_ms: Option<u64>,
    /// Log format: text or json.
    #[arg(long, env = "INFERYES_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    /// The admin token itself (prefer admin_token_file in the config file).
    #[arg(long, env = "INFERYES_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// The agents' join token itself (prefer join_token_file in the config file).
    #[arg(long, env = "INFERYES_JOIN_TOKEN", hide_env_values = true)]
    pub join_token: Option<String>,
    /// The data planes' token itself (prefer dataplane_token_file in the config file).
    #[arg(long, env = "INFERYES_DATAPLANE_TOKEN", hide_env_values = true)]
    pub dataplane_token: Option<String>,
    /// A read-only viewer token itself (prefer viewer_token_file in the config file).
    #[arg(long, env = "INFERYES_VIEWER_TOKEN", hide_env_values = true)]
    pub viewer_token: Option<String>,
    /// The gRPC address other controllers reach this one at (default: from grpc_listen).
    #[arg(long, env = "INFERYES_ADVERTISE_URL")]
    pub advertise_url: Option<String>,
}

pub use inferyes_net::process::LogFormat;
use inferyes_proto::bearer::Accepted;
pub use inferyes_proto::files::TokenAuth;
use inferyes_proto::files::read_tokens;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Version of this file's format.
    pub version: u32,
    pub controller_id: String,
    pub etcd_endpoints: Vec<String>,
    pub etcd_prefix: String,
    /// The user this controller signs in to etcd as, where etcd has
    /// authentication on (empty: none); its password is the first line of
    /// `etcd_password_file`.
    pub etcd_user: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub etcd_password_file: Option<PathBuf>,
    /// TLS to etcd, for `https://` endpoints: etcd's CA (`ca_file`; else
    /// the system's roots), and this controller's certificate
    /// (`cert_file`, `key_file`) where etcd asks clients for one.
    pub etcd_tls: inferyes_proto::tls::Tls,
    pub grpc_listen: SocketAddr,
    pub http_listen: SocketAddr,
    /// The gRPC address other controllers reach this one at, to exchange
    /// their nodes' live state. Empty: `grpc_listen` (with the hostname
    /// where it listens on every address).
    pub advertise_url: String,
    /// etcd's `--quota-backend-bytes`, against which the database's size is
    /// reported (etcd 3.6 and later report their own, which wins).
    pub etcd_quota_bytes: u64,
    pub lease_ttl_ms: u64,
    /// How often agents must be heard from; must be well under the lease TTL.
    pub heartbeat_interval_ms: u64,
    /// Per node: writes closer together than this are coalesced.
    pub min_write_interval_ms: u64,
    /// Changes arriving within this window are published as one snapshot.
    pub snapshot_debounce_ms: u64,
    /// After start, data planes get snapshots only after this long, so the
    /// agents of a fleet whose controllers were all down have re-registered
    /// (agents retry at least every 2 s).
    pub startup_grace_ms: u64,
    pub log_format: LogFormat,
    /// `token`: FleetService writes and everything about API keys need the
    /// admin token. `none`: open, for trusted networks only.
    pub admin_auth: TokenAuth,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_token_file: Option<PathBuf>,
    /// `token`: agents must present the join token. `none`: any agent that
    /// reaches the controller may join.
    pub join_auth: TokenAuth,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub join_token_file: Option<PathBuf>,
    /// The data planes' tokens: RoutingService (snapshots, usage, reports,
    /// and controllers following each other) takes these, and the agents'
    /// join token no longer. Unset: the join tokens, as one token for both.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dataplane_token_file: Option<PathBuf>,
    /// Read-only tokens: fleet reads (nodes, models, sessions, policy,
    /// aliases) and the dashboard, nothing that changes the fleet. The
    /// admin token reads too.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub viewer_token_file: Option<PathBuf>,
    /// `token`: the dashboard and its data need a viewer or the admin
    /// token (a login page keeps a session cookie). `none`: open to
    /// whoever reaches the HTTP port, for a trusted network.
    pub dashboard_auth: TokenAuth,
    /// Proxies (address blocks) in front of the HTTP port, whose
    /// `X-Forwarded-For` names the client: wrong dashboard tokens are
    /// counted per client, not per proxy.
    pub trusted_proxies: Vec<inferyes_net::forwarded::Cidr>,
    /// Hourly usage roll-ups are kept this long.
    pub usage_retention_days: u64,
    /// Raw usage records (for export) are kept this long.
    pub raw_usage_retention_days: u64,
    /// A placement order (a model load or unload) not done by then has
    /// failed, and is tried again elsewhere: longer than a model load.
    pub placement_order_timeout_secs: u64,
    /// Placement unloads no model whose sessions were used this lately.
    pub placement_idle_secs: u64,
    /// Nodes the fleet takes: past it, a join naming a node it does not
    /// hold is refused until one leaves.
    pub max_nodes: usize,
    /// Bytes of node records this controller writes to etcd a second, all
    /// nodes together, after a burst of 64 s of it.
    pub max_node_write_bytes_per_second: u64,
    /// Connections the gRPC port holds open at once (an agent or a data
    /// plane holds one or two), and of those what peers none of whose
    /// calls has yet succeeded may hold, together and per address (an
    /// IPv6 /64).
    pub max_grpc_connections: usize,
    pub max_grpc_stranger_connections: usize,
    pub max_grpc_stranger_connections_per_address: usize,
    /// Connections the HTTP port (dashboard, metrics, health) holds open
    /// at once, and per address.
    pub max_http_connections: usize,
    pub max_http_connections_per_address: usize,
    /// TLS on the gRPC port (see `inferyes_proto::tls`).
    pub tls: inferyes_proto::tls::Tls,
    /// From the environment or a flag; never written out.
    #[serde(skip)]
    pub admin_token: Option<String>,
    #[serde(skip)]
    pub join_token: Option<String>,
    #[serde(skip)]
    pub dataplane_token: Option<String>,
    #[serde(skip)]
    pub viewer_token: Option<String>,
}

const MIN_NODE_WRITE_BYTES_PER_SECOND: u64 = 32 << 10;

impl Default for Config {
    fn default() -> Config {
        Config {
            version: 1,
            controller_id: String::new(),
            etcd_endpoints: vec!["http://127.0.0.1:2379".into()],
            etcd_prefix: "/inferyes/v1/".into(),
            etcd_user: String::new(),
            etcd_password_file: None,
            etcd_tls: inferyes_proto::tls::Tls::default(),
            grpc_listen: SocketAddr::from(([127, 0, 0, 1], 7070)),
            http_listen: SocketAddr::from(([127, 0, 0, 1], 7071)),
            advertise_url: String::new(),
            etcd_quota_bytes: 2 << 30,
            lease_ttl_ms: 6000,
            heartbeat_interval_ms: 1000,
            min_write_interval_ms: 100,
            snapshot_debounce_ms: 10,
            startup_grace_ms: 3000,
            log_format: LogFormat::Text,
            admin_auth: TokenAuth::Token,
            admin_token_file: None,
            join_auth: TokenAuth::Token,
            join_token_file: None,
            dataplane_token_file: None,
            viewer_token_file: None,
            dashboard_auth: TokenAuth::Token,
            trusted_proxies: Vec::new(),
            usage_retention_days: 400,
            raw_usage_retention_days: 7,
            placement_order_timeout_secs: 600,
            placement_idle_secs: 300,
            max_nodes: 4_096,
            max_node_write_bytes_per_second: 1 << 20,
            max_grpc_connections: 16_384,
            max_grpc_stranger_connections: 1_024,
            max_grpc_stranger_connections_per_address: 128,
            max_http_connections: 1_024,
            max_http_connections_per_address: 64,
            tls: inferyes_proto::tls::Tls::default(),
            admin_token: None,
            join_token: None,
            dataplane_token: None,
            viewer_token: None,
        }
    }
}

impl Config {
    /// Which connections the gRPC port takes, and the HTTP port.
    pub fn connection_limits(&self) -> (inferyes_net::admit::Limits, inferyes_net::admit::Limits) {
        let grpc = inferyes_net::admit::Limits {
            max: self.max_grpc_connections,
            per_peer: self.max_grpc_stranger_connections_per_address,
            strangers: self.max_grpc_stranger_connections,
            prove_within: Some(inferyes_net::admit::PROVE_WITHIN),
        };
        let http = inferyes_net::admit::Limits {
            max: self.max_http_connections,
            per_peer: self.max_http_connections_per_address,
            strangers: 0,
            prove_within: None,
        };
        (grpc, http)
    }

    pub fn load(args: &Args) -> anyhow::Result<Config> {
        let mut config: Config = inferyes_proto::files::load_toml(args.config.as_deref())?;
        if let Some(v) = &args.controller_id {
            config.controller_id.clone_from(v);
        }
        if let Some(v) = &args.etcd_endpoints {
            config.etcd_endpoints.clone_from(v);
        }
        if let Some(v) = &args.etcd_prefix {
            config.etcd_prefix.clone_from(v);
        }
        if let Some(v) = &args.etcd_user {
            config.etcd_user.clone_from(v);
        }
        if let Some(v) = &args.etcd_password_file {
            config.etcd_password_file = Some(v.clone());
        }
        if let Some(v) = args.grpc_listen {
            config.grpc_listen = v;
        }
        if let Some(v) = args.http_listen {
            config.http_listen = v;
        }
        if let Some(v) = args.lease_ttl_ms {
            config.lease_ttl_ms = v;
        }
        if let Some(v) = args.log_format {
            config.log_format = v;
        }
        if let Some(v) = &args.admin_token {
            config.admin_token = Some(v.clone());
        }
        if let Some(v) = &args.join_token {
            config.join_token = Some(v.clone());
        }
        if let Some(v) = &args.dataplane_token {
            config.dataplane_token = Some(v.clone());
        }
        if let Some(v) = &args.viewer_token {
            config.viewer_token = Some(v.clone());
        }
        if let Some(v) = &args.advertise_url {
            config.advertise_url.clone_from(v);
        }
        if config.controller_id.is_empty() {
            config.controller_id = format!("controller-{}", hostname());
        }
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if self.version != 1 {
            bail!("config version {} is not supported: set `version = 1`", self.version);
        }
        self.tls.validate()?;
        if self.usage_retention_days == 0 || self.raw_usage_retention_days == 0 {
            bail!("usage_retention_days and raw_usage_retention_days must be at least 1");
        }
        if [
            self.max_nodes,
            self.max_grpc_connections,
            self.max_grpc_stranger_connections,
            self.max_grpc_stranger_connections_per_address,
            self.max_http_connections,
            self.max_http_connections_per_address,
        ]
        .contains(&0)
        {
            bail!("max_nodes, max_grpc_connections, max_http_connections and their shares must be positive");
        }
        if self.max_node_write_bytes_per_second < MIN_NODE_WRITE_BYTES_PER_SECOND {
            bail!(
                "max_node_write_bytes_per_second must be at least {MIN_NODE_WRITE_BYTES_PER_SECOND}: its burst of \
                 64 s must hold the largest node record, 512 KiB, several times over"
            );
        }
        if self.placement_order_timeout_secs == 0 {
            bail!("placement_order_timeout_secs must be at least 1: longer than a model takes to load");
        }
        if self.etcd_endpoints.is_empty() {
            bail!("etcd_endpoints is empty: list at least one, e.g. [\"http://127.0.0.1:2379\"]");
        }
        if !self.etcd_prefix.starts_with('/') {
            bail!("etcd_prefix `{}` must start with `/`", self.etcd_prefix);
        }
        if self.etcd_user.is_empty() != self.etcd_password_file.is_none() {
            bail!("etcd_user and etcd_password_file go together: set both or neither");
        }
        let https = self.etcd_endpoints.iter().filter(|e| e.starts_with("https://")).count();
        if https != 0 && https != self.etcd_endpoints.len() {
            bail!("etcd_endpoints are all https:// or none: the client takes one TLS setting for all");
        }
        let etcd_tls = &self.etcd_tls;
        if https == 0 && (etcd_tls.ca_file.is_some() || etcd_tls.cert_file.is_some()) {
            bail!("etcd_tls is for https:// etcd_endpoints: write them so, or leave etcd_tls out");
        }
        if etcd_tls.client_ca_file.is_some() {
            bail!("etcd_tls.client_ca_file has no use: etcd is the server (its CA is etcd_tls.ca_file)");
        }
        etcd_tls.validate().map_err(|e| anyhow::anyhow!("etcd_{e}"))?;
        let url = &self.advertise_url;
        if !(url.is_empty() || url.starts_with("http://") || url.starts_with("https://")) {
            bail!("advertise_url `{}` must be an http:// or https:// URL", self.advertise_url);
        }
        if self.lease_ttl_ms < 2000 {
            bail!("lease_ttl_ms = {} is below etcd's minimum lease TTL of 2000", self.lease_ttl_ms);
        }
        if self.heartbeat_interval_ms == 0 || self.heartbeat_interval_ms * 2 > self.lease_ttl_ms {
            bail!(
                "heartbeat_interval_ms = {} must be positive and at most half of lease_ttl_ms = {}",
                self.heartbeat_interval_ms,
                self.lease_ttl_ms
            );
        }
        if self.admin_auth == TokenAuth::Token && self.admin_token.is_none() && self.admin_token_file.is_none() {
            bail!(
                "admin_auth = \"token\" (the default) needs the admin token: set admin_token_file (or \
                 INFERYES_ADMIN_TOKEN), or admin_auth = \"none\" to leave fleet writes open on a trusted network"
            );
        }
        if self.join_auth == TokenAuth::Token && self.join_token.is_none() && self.join_token_file.is_none() {
            bail!(
                "join_auth = \"token\" (the default) needs the agents' join token: set join_token_file (or \
                 INFERYES_JOIN_TOKEN), or join_auth = \"none\" to let any agent join on a trusted network"
            );
        }
        let viewer = self.viewer_token.is_some() || self.viewer_token_file.is_some();
        if self.dashboard_auth == TokenAuth::Token && self.admin_auth == TokenAuth::None && !viewer {
            bail!(
                "dashboard_auth = \"token\" (the default) needs a token to take: set viewer_token_file (or \
                 INFERYES_VIEWER_TOKEN), or dashboard_auth = \"none\" to leave the dashboard open on a trusted network"
            );
        }
        Ok(())
    }

    /// The tokens fleet reads take (the admin's and the viewers'), read
    /// now; `None` when admin_auth is `none`: reads are as open as writes.
    pub fn reader_tokens(&self) -> anyhow::Result<Option<Accepted>> {
        if self.admin_auth == TokenAuth::None {
            return Ok(None);
        }
        self.readers()
    }

    /// The tokens the dashboard takes, read now; `None` when
    /// dashboard_auth is `none`.
    pub fn dashboard_tokens(&self) -> anyhow::Result<Option<Accepted>> {
        if self.dashboard_auth == TokenAuth::None {
            return Ok(None);
        }
        self.readers()
    }

    fn readers(&self) -> anyhow::Result<Option<Accepted>> {
        let mut tokens = Vec::new();
        if self.admin_auth == TokenAuth::Token {
            tokens.extend(
                read_tokens(self.admin_token.as_deref(), self.admin_token_file.as_deref(), "admin token")?
                    .unwrap_or_default(),
            );
        }
        tokens.extend(
            read_tokens(self.viewer_token.as_deref(), self.viewer_token_file.as_deref(), "viewer token")?
                .unwrap_or_default(),
        );
        if tokens.is_empty() {
            anyhow::bail!("no admin or viewer token to take for reads");
        }
        Ok(Some(Accepted::new(tokens)))
    }

    /// How to reach etcd: the user and its password, read now, and TLS
    /// where the endpoints are `https://`.
    pub fn etcd_access(&self) -> anyhow::Result<crate::store::EtcdAccess> {
        let user = match &self.etcd_password_file {
            Some(file) => {
                Some((self.etcd_user.clone(), inferyes_proto::files::read_password(file, "etcd user's password")?))
            }
            None => None,
        };
        let tls = match self.etcd_endpoints.iter().all(|e| e.starts_with("https://")) {
            true => Some(anyhow::Context::context(self.etcd_tls.grpc_client(), "etcd_tls")?),
            false => None,
        };
        Ok(crate::store::EtcdAccess { user, tls })
    }

    /// The admin tokens taken, read now; `None` when admin_auth is `none`.
    pub fn admin_token(&self) -> anyhow::Result<Option<Accepted>> {
        if self.admin_auth == TokenAuth::None {
            return Ok(None);
        }
        let tokens = read_tokens(self.admin_token.as_deref(), self.admin_token_file.as_deref(), "admin token")?;
        Ok(tokens.map(Accepted::new))
    }

    /// The tokens RoutingService takes, read now: the data planes', or,
    /// when none are set, the join tokens; `None` when join_auth is `none`.
    pub fn dataplane_tokens(&self) -> anyhow::Result<Option<Accepted>> {
        if self.join_auth == TokenAuth::None {
            return Ok(None);
        }
        match read_tokens(self.dataplane_token.as_deref(), self.dataplane_token_file.as_deref(), "data plane token")? {
            Some(tokens) => Ok(Some(Accepted::new(tokens))),
            None => self.join_token(),
        }
    }

    /// Whether data planes have tokens of their own.
    pub fn separate_dataplane_tokens(&self) -> bool {
        self.dataplane_token.is_some() || self.dataplane_token_file.is_some()
    }

    /// The join tokens taken, read now; `None` when join_auth is `none`.
    pub fn join_token(&self) -> anyhow::Result<Option<Accepted>> {
        if self.join_auth == TokenAuth::None {
            return Ok(None);
        }
        let tokens = read_tokens(self.join_token.as_deref(), self.join_token_file.as_deref(), "join token")?;
        Ok(tokens.map(Accepted::new))
    }

    /// Where peers reach this controller's gRPC port.
    pub fn grpc_url(&self) -> String {
        if !self.advertise_url.is_empty() {
            return self.advertise_url.clone();
        }
        let scheme = if self.tls.serves() { "https" } else { "http" };
        if self.grpc_listen.ip().is_unspecified() {
            return format!("{scheme}://{}:{}", hostname(), self.grpc_listen.port());
        }
        format!("{scheme}://{}", self.grpc_listen)
    }

    pub fn lease_ttl(&self) -> Duration {
        Duration::from_millis(self.lease_ttl_ms)
    }

    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
    }

    pub fn min_write_interval(&self) -> Duration {
        Duration::from_millis(self.min_write_interval_ms)
    }

    pub fn snapshot_debounce(&self) -> Duration {
        Duration::from_millis(self.snapshot_debounce_ms)
    }

    pub fn startup_grace(&self) -> Duration {
        Duration::from_millis(self.startup_grace_ms)
    }

    pub fn placement(&self) -> crate::placement::Settings {
        crate::placement::Settings {
            order_timeout_ms: self.placement_order_timeout_secs.saturating_mul(1000),
            idle_ms: self.placement_idle_secs.saturating_mul(1000),
        }
    }
}

fn hostname() -> String {
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
        let dir = std::env::temp_dir().join(format!("inferyes-ctl-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("controller.toml");
        std::fs::write(
            &path,
            "version = 1\nlease_ttl_ms = 9000\netcd_prefix = \"/file/\"\nadmin_token_file = \"/a\"\njoin_auth = \"none\"\n",
        )
        .unwrap();
        let args = Args::try_parse_from([
            "inferyes-controller",
            "--config",
            path.to_str().unwrap(),
            "--etcd-prefix",
            "/flag/",
        ])
        .unwrap();
        let config = Config::load(&args).unwrap();
        assert_eq!(config.etcd_prefix, "/flag/");
        assert_eq!(config.lease_ttl_ms, 9000);
        assert_eq!(config.heartbeat_interval_ms, Config::default().heartbeat_interval_ms);
    }

    #[test]
    fn tokens_are_required_unless_switched_off_and_are_never_written_out() {
        let error = Config::default().validate().unwrap_err().to_string();
        assert!(error.contains("admin_token_file") && error.contains("admin_auth = \"none\""), "{error}");
        let open = Config {
            admin_auth: TokenAuth::None,
            join_auth: TokenAuth::None,
            dashboard_auth: TokenAuth::None,
            ..Config::default()
        };
        open.validate().unwrap();
        assert!(open.admin_token().unwrap().is_none());
        let secret = "s3cret-token-0123456789";
        let set = Config { admin_token: Some(secret.into()), join_token: Some(secret.into()), ..Config::default() };
        set.validate().unwrap();
        assert!(set.admin_token().unwrap().expect("a token").accepts(secret.as_bytes()));
        assert!(!toml::to_string(&set).unwrap().contains(secret));
        // A file lists the tokens taken while one is rotated.
        let dir = std::env::temp_dir().join(format!("inferyes-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("join-token");
        std::fs::write(&file, "the-new-join-token-0123\n\nthe-old-join-token-0123\n").unwrap();
        let rotating = Config { join_token_file: Some(file.clone()), join_token: None, ..set.clone() };
        let accepted = rotating.join_token().unwrap().expect("tokens");
        assert!(accepted.accepts(b"the-new-join-token-0123") && accepted.accepts(b"the-old-join-token-0123"));
        assert!(!accepted.accepts(b"s3cret-token-0123456789"));
        let presented = inferyes_proto::files::read_token(None, Some(&file), "join token").unwrap();
        assert_eq!(presented.as_deref(), Some("the-new-join-token-0123"), "the first line is presented");
        std::fs::remove_dir_all(&dir).unwrap();
        let short = Config { admin_token: Some("short".into()), ..set };
        assert!(short.admin_token().unwrap_err().to_string().contains("at least 16"));
    }

    #[test]
    fn data_planes_and_viewers_have_tokens_of_their_own() {
        let (admin, join) = ("the-admin-token-0123", "the-join-token-01234");
        let one = Config { admin_token: Some(admin.into()), join_token: Some(join.into()), ..Config::default() };
        // One token for agents and data planes, as before there were two.
        assert!(one.dataplane_tokens().unwrap().unwrap().accepts(join.as_bytes()));
        let two = Config { dataplane_token: Some("the-dataplane-token-0".into()), ..one.clone() };
        let routing = two.dataplane_tokens().unwrap().unwrap();
        assert!(routing.accepts(b"the-dataplane-token-0") && !routing.accepts(join.as_bytes()));
        // Reads take the admin's and the viewers' tokens; an open fleet,
        // none; a dashboard with no token to take is refused.
        let viewed = Config { viewer_token: Some("the-viewer-token-012".into()), ..one.clone() };
        let readers = viewed.reader_tokens().unwrap().unwrap();
        assert!(readers.accepts(admin.as_bytes()) && readers.accepts(b"the-viewer-token-012"));
        assert!(!readers.accepts(join.as_bytes()));
        let open = Config { admin_auth: TokenAuth::None, join_auth: TokenAuth::None, ..Config::default() };
        assert!(open.validate().unwrap_err().to_string().contains("dashboard_auth"));
        let open = Config { dashboard_auth: TokenAuth::None, ..open };
        open.validate().unwrap();
        assert!(open.reader_tokens().unwrap().is_none() && open.dashboard_tokens().unwrap().is_none());
    }

    #[test]
    fn etcd_is_reached_as_a_user_over_tls_only_where_both_are_whole() {
        let base = Config {
            admin_token: Some("the-admin-token-0123".into()),
            join_auth: TokenAuth::None,
            ..Config::default()
        };
        let refused = |config: Config| config.validate().unwrap_err().to_string();
        let user_only = Config { etcd_user: "inferyes".into(), ..base.clone() };
        assert!(refused(user_only).contains("etcd_password_file"));
        let pem = Some(PathBuf::from("/ca.pem"));
        let tls_over_http = Config {
            etcd_tls: inferyes_proto::tls::Tls { ca_file: pem.clone(), ..Default::default() },
            ..base.clone()
        };
        assert!(refused(tls_over_http).contains("https://"));
        let https = |n: usize| (0..n).map(|i| format!("https://etcd-{i}:2379")).collect::<Vec<_>>();
        let mixed = Config { etcd_endpoints: [https(1), vec!["http://etcd-9:2379".into()]].concat(), ..base.clone() };
        assert!(refused(mixed).contains("all https://"));
        let half_identity = Config {
            etcd_endpoints: https(2),
            etcd_tls: inferyes_proto::tls::Tls { cert_file: pem.clone(), ..Default::default() },
            ..base.clone()
        };
        assert!(refused(half_identity).contains("etcd_tls.cert_file and tls.key_file"));
        // Whole: the password is the file's first line, as written.
        let dir = std::env::temp_dir().join(format!("inferyes-etcd-password-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("password"), "a pass phrase \nsecond line\n").unwrap();
        let whole = Config {
            etcd_endpoints: https(3),
            etcd_user: "inferyes".into(),
            etcd_password_file: Some(dir.join("password")),
            ..base
        };
        whole.validate().unwrap();
        let access = whole.etcd_access().unwrap();
        assert_eq!(access.user, Some(("inferyes".into(), "a pass phrase ".into())));
        assert!(access.tls.is_some(), "https:// endpoints, the system's roots");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unknown_keys_and_bad_values_are_rejected() {
        assert!(toml::from_str::<Config>("lease_ttl = 5").is_err());
        let config = Config { lease_ttl_ms: 500, ..Config::default() };
        assert!(config.validate().unwrap_err().to_string().contains("lease_ttl_ms"));
    }
}
