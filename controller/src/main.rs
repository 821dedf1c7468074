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
    inferyes_proto::process::init_tracing(config.log_format);
    let listeners = inferyes_controller::Listeners::bind(&config).await?;
    let shutdown = inferyes_proto::process::shutdown_on_signal();
    inferyes_controller::run(config, listeners, shutdown).await
}
