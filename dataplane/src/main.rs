use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use inferyes_dataplane::config::{Args, Config};

// Requests allocate and free many small buffers; mimalloc serves them
// with less CPU than glibc's malloc (docs/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

// This runtime runs the acceptor and the background work (snapshots,
// reports, the usage ledger); requests are served on worker threads of
// their own (`inferyes_net::serve`).
#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = Config::load(&args)?;
    if args.print_config {
        print!("{}", toml::to_string(&config)?);
        return Ok(());
    }
    let telemetry = inferyes_net::telemetry::init(config.log_format, "inferyes-dataplane")?;
    inferyes_net::process::raise_open_files_limit(config.max_connections);
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let admin = tokio::net::TcpListener::bind(config.admin_listen)
        .await
        .with_context(|| format!("cannot listen on admin_listen {}", config.admin_listen))?;
    let shutdown = inferyes_net::process::shutdown_on_signal();
    let listeners = inferyes_dataplane::Listeners { public: listener, admin };
    let result = inferyes_dataplane::run(config, listeners, Arc::default(), shutdown).await;
    telemetry.shutdown().await;
    result
}
