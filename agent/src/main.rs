use anyhow::Context;
use clap::Parser;
use inferyes_agent::config::{Args, Command, Config, LogFormat};

// Requests allocate and free many small buffers; mimalloc serves them
// with less CPU than glibc's malloc (docs/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(Command::Simulate { listen, sim_config, model }) = &args.command {
        let telemetry = inferyes_net::telemetry::init(LogFormat::Text, "inferyes-simulator")?;
        let result = simulate(*listen, sim_config.as_deref(), model).await;
        telemetry.shutdown().await;
        return result;
    }
    let config = Config::load(&args)?;
    if args.print_config {
        print!("{}", toml::to_string(&config)?);
        return Ok(());
    }
    let telemetry = inferyes_net::telemetry::init(config.log_format, "inferyes-agent")?;
    inferyes_net::process::raise_open_files_limit(config.max_connections);
    let listeners = inferyes_agent::Listeners::bind(&config).await?;
    let shutdown = inferyes_net::process::shutdown_on_signal();
    let result = inferyes_agent::run(config, listeners, shutdown).await;
    telemetry.shutdown().await;
    result
}

async fn simulate(listen: std::net::SocketAddr, file: Option<&std::path::Path>, model: &str) -> anyhow::Result<()> {
    let text = match file {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?,
        None => format!("[[models]]\nid = {model:?}\n"),
    };
    let config: inferyes_sim::SimConfig = toml::from_str(&text).context("invalid simulator config")?;
    let simulator = inferyes_sim::Simulator::new(config)?;
    let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("cannot listen on {listen}"))?;
    tracing::info!(%listen, "simulated backend listening");
    let shutdown = inferyes_net::process::shutdown_on_signal();
    simulator.serve(listener, shutdown).await?;
    Ok(())
}
