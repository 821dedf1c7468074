use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use inferyes_dataplane::config::{Args, Config};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = Config::load(&args)?;
    if args.print_config {
        print!("{}", toml::to_string(&config)?);
        return Ok(());
    }
    inferyes_proto::process::init_tracing(config.log_format);
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let shutdown = inferyes_proto::process::shutdown_on_signal();
    inferyes_dataplane::run(config, listener, Arc::default(), shutdown).await
}
