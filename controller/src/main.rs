use clap::Parser;
use inferyes_controller::config::{Args, Config};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = Config::load(&args)?;
    if args.print_config {
        print!("{}", toml::to_string(&config)?);
        return Ok(());
    }
    let telemetry = inferyes_net::telemetry::init(config.log_format, "inferyes-controller")?;
    inferyes_net::process::raise_open_files_limit(
        config.max_grpc_connections.saturating_add(config.max_http_connections),
    );
    let listeners = inferyes_controller::Listeners::bind(&config).await?;
    let shutdown = inferyes_net::process::shutdown_on_signal();
    let result = inferyes_controller::run(config, listeners, shutdown).await;
    telemetry.shutdown().await;
    result
}
