use clap::Parser;
use inferyes_ctl::{Cli, run};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    match run(Cli::parse()).await {
        Ok(text) => print!("{text}"),
        Err(error) => {
            // The controller's messages may quote names from agents.
            eprintln!("inferyesctl: {}", inferyes_proto::shown_plain(&format!("{error:#}")));
            std::process::exit(1);
        }
    }
}
