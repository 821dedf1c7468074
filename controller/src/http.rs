//! The controller's HTTP port: health for load balancers and orchestrators,
//! Prometheus metrics, and the live dashboard.

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use crate::reconcile::SnapshotRx;

/// The controller's metrics and the registry they are encoded from.
pub struct Scrape {
    pub registry: prometheus_client::registry::Registry,
    pub metrics: std::sync::Arc<crate::metrics::Metrics>,
}

#[derive(Clone)]
struct HttpState {
    snapshots: SnapshotRx,
    scrape: std::sync::Arc<Scrape>,
}

pub fn router(snapshots: SnapshotRx, scrape: std::sync::Arc<Scrape>, dashboard: crate::dashboard::Dashboard) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(HttpState { snapshots, scrape })
        .merge(crate::dashboard::router(dashboard))
}

async fn metrics(State(state): State<HttpState>) -> (StatusCode, [(axum::http::HeaderName, &'static str); 1], String) {
    let snapshot = state.snapshots.borrow().clone();
    state.scrape.metrics.observe(snapshot.as_deref());
    let mut text = String::new();
    let status = match prometheus_client::encoding::text::encode(&mut text, &state.scrape.registry) {
        Ok(()) => StatusCode::OK,
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (status, [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text)
}

/// Ready once the fleet has been read from etcd at least once.
async fn readyz(State(state): State<HttpState>) -> (StatusCode, String) {
    match state.snapshots.borrow().as_ref() {
        Some(snapshot) => (StatusCode::OK, format!("ready, snapshot version {}\n", snapshot.version())),
        None => (StatusCode::SERVICE_UNAVAILABLE, "fleet not loaded from etcd yet\n".into()),
    }
}
