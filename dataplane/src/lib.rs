//! The Inferyes data plane: a stateless OpenAI-compatible gateway. It holds
//! the latest routing snapshot in memory, picks a node per request, and
//! streams the answer through.

pub mod config;
pub mod http;
pub mod routing;
pub mod snapshot;

use std::sync::Arc;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use config::Config;
pub use snapshot::SnapshotStore;

/// Runs until `shutdown` is cancelled. The caller binds the listener (tests
/// bind port 0) and may pass in the store to watch snapshot versions.
pub async fn run(
    config: Config,
    listener: TcpListener,
    snapshots: Arc<SnapshotStore>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let subscription = tokio::spawn(
        snapshot::subscribe(
            Arc::clone(&snapshots),
            config.controllers.clone(),
            config.dataplane_id.clone(),
            shutdown.clone(),
        )
        .instrument(tracing::info_span!("snapshots")),
    );
    let state = http::AppState {
        snapshots,
        forwarder: http::forward_client(&config),
        max_body_bytes: config.max_body_bytes,
        mode: config.routing_mode,
        tickets: Arc::default(),
    };
    tracing::info!(listen = %listener.local_addr()?, id = %config.dataplane_id, "data plane running");
    let served =
        axum::serve(listener, http::router(state)).with_graceful_shutdown(shutdown.clone().cancelled_owned()).await;
    shutdown.cancel();
    let _ = subscription.await;
    served.context("HTTP server failed")
}
