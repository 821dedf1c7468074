//! What every Inferyes server does the same way around its `run`: its log
//! format, its limit of open files, and SIGINT/SIGTERM turned into a
//! shutdown (logs and traces: [`crate::telemetry`]).

use tokio_util::sync::CancellationToken;

/// Log output: human-readable text, or one JSON object per line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// A token cancelled on the first SIGINT or SIGTERM.
pub fn shutdown_on_signal() -> CancellationToken {
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    tokio::spawn(async move {
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
        token.cancel();
    });
    shutdown
}

/// Raises the soft limit of open files to the hard one, and warns where
/// that is still below what the listeners' caps can hold: `connections`
/// client connections, each of which may hold one more upstream, and some
/// to spare for etcd, backends and logs. The soft limit is often 1,024,
/// past which accepts fail and a server refuses everyone; the hard one is
/// what the service manager allows (the shipped units: 1,048,576).
pub fn raise_open_files_limit(connections: usize) {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let wanted = (connections as u64).saturating_mul(2).saturating_add(256);
    let mut limit = getrlimit(Resource::Nofile);
    if let Some(hard) = limit.maximum
        && limit.current.is_some_and(|soft| soft < hard)
    {
        limit.current = Some(hard);
        if let Err(error) = setrlimit(Resource::Nofile, limit) {
            tracing::warn!(%error, "cannot raise the open files limit");
        }
    }
    let soft = getrlimit(Resource::Nofile).current;
    if let Some(soft) = soft
        && soft < wanted
    {
        tracing::warn!(
            open_files = soft,
            wanted,
            "the open files limit is below what the connection caps can hold: past it, new connections wait \
             until one closes (raise LimitNOFILE, or lower the caps)"
        );
    }
}
