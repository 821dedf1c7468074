//! The simulator's own `/sim/gpu`, not a route of llama.cpp or llama-swap:
//! the simulated GPU, standing in for what the agent reads from NVML on a
//! real host, and a way for tests to fill or lose it.

use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::response::Response;
use bytes::Bytes;
use http::StatusCode;
use serde_json::{Value, json};

use super::{Shared, bad_request, json_response};
use crate::Inner;

/// Simulator-only: not a llama.cpp or llama-swap route. Reports the simulated
/// GPU, standing in for what the agent reads from NVML on a real host.
pub(super) async fn gpu_get(State(s): State<Shared>) -> Response {
    if s.gpu_lost.load(Ordering::Relaxed) {
        return json_response(StatusCode::INTERNAL_SERVER_ERROR, json!({"error": "GPU is lost"}));
    }
    json_response(StatusCode::OK, gpu_body(&s))
}

fn gpu_body(s: &Inner) -> Value {
    let engines = s.loaded_engines();
    let per_model_kv = u64::from(s.config.context) * s.config.gpu.kv_bytes_per_token;
    let (mut busy, mut total) = (0usize, 0usize);
    let mut used = s.extra_used_bytes.load(Ordering::Relaxed);
    for e in &engines {
        used = used.saturating_add(e.model().size_bytes).saturating_add(per_model_kv);
        let (b, t) = e.busy();
        busy += b;
        total += t;
    }
    let utilization = if total == 0 { 0.0 } else { busy as f64 / total as f64 * 100.0 };
    json!({
        "name": s.config.gpu.name,
        "memory_total_bytes": s.config.gpu.memory_total_bytes,
        "memory_used_bytes": used,
        "extra_used_bytes": s.extra_used_bytes.load(Ordering::Relaxed),
        "utilization_percent": utilization,

    })
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct GpuUpdate {
    extra_used_bytes: Option<u64>,
    lost: Option<bool>,
}

/// Simulator-only: not a llama.cpp or llama-swap route. Sets memory used
/// beyond the loaded models, so tests can push a node over a VRAM threshold,
/// or makes the GPU unreadable.
pub(super) async fn gpu_post(State(s): State<Shared>, body: Bytes) -> Response {
    match serde_json::from_slice::<GpuUpdate>(&body) {
        Ok(u) => {
            if let Some(bytes) = u.extra_used_bytes {
                s.extra_used_bytes.store(bytes, Ordering::Relaxed);
            }
            if let Some(lost) = u.lost {
                s.gpu_lost.store(lost, Ordering::Relaxed);
            }
            json_response(StatusCode::OK, gpu_body(&s))
        }
        Err(e) => bad_request(e.to_string()),
    }
}
