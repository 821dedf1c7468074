//! The controller's HTTP port: health for load balancers and orchestrators.

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use crate::reconcile::SnapshotRx;

pub fn router(snapshots: SnapshotRx) -> Router {
    Router::new().route("/healthz", get(|| async { "ok\n" })).route("/readyz", get(readyz)).with_state(snapshots)
}

/// Ready once the fleet has been read from etcd at least once.
async fn readyz(State(snapshots): State<SnapshotRx>) -> (StatusCode, String) {
    match snapshots.borrow().as_ref() {
        Some(snapshot) => (StatusCode::OK, format!("ready, snapshot version {}\n", snapshot.version())),
        None => (StatusCode::SERVICE_UNAVAILABLE, "fleet not loaded from etcd yet\n".into()),
    }
}
