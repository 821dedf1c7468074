use clap::Parser;
use inferyes_ctl::{Cli, run};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    match run(Cli::parse()).await {
        Ok(text) => print!("{text}"),
        Err(error) => {
            eprintln!("inferyesctl: {error:#}");
            std::process::exit(1);
        }
    }
}
