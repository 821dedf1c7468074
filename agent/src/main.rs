use anyhow::Context;
use clap::Parser;
use inferyes_agent::config::{Args, Command, Config, LogFormat};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(Command::Simulate { listen, sim_config, model }) = &args.command {
        init_tracing(LogFormat::Text);
        return simulate(*listen, sim_config.as_deref(), model).await;
    }
    let config = Config::load(&args)?;
    if args.print_config {
        print!("{}", toml::to_string(&config)?);
        return Ok(());
    }
    init_tracing(config.log_format);
    let listeners = inferyes_agent::Listeners::bind(&config).await?;
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    inferyes_agent::run(config, listeners, shutdown).await
}

async fn simulate(listen: std::net::SocketAddr, file: Option<&std::path::Path>, model: &str) -> anyhow::Result<()> {
    let text = match file {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?,
        None => format!("[[models]]\nid = {model:?}\n"),
    };
    let config: inferyes_agent::sim::SimConfig = toml::from_str(&text).context("invalid simulator config")?;
    let simulator = inferyes_agent::sim::Simulator::new(config)?;
    let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("cannot listen on {listen}"))?;
    tracing::info!(%listen, "simulated backend listening");
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    simulator.serve(listener, shutdown).await?;
    Ok(())
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn cancel_on_signal(shutdown: CancellationToken) {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(error) => {
            tracing::error!(%error, "cannot listen for SIGTERM");
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
    shutdown.cancel();
}
