//! The poller: the one writer of the agent's observations.

use std::sync::Arc;
use std::time::Duration;

use inferyes_proto::v1::Backend;
use tokio_util::sync::CancellationToken;

use crate::probe::{GpuReader, ProbeClient};
use crate::state::AgentState;

pub async fn run(
    state: Arc<AgentState>,
    client: ProbeClient,
    gpus: GpuReader,
    interval: Duration,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticker.tick() => poll_once(&state, &client, &gpus).await,
        }
    }
}

/// Polls every backend (concurrently) and the GPUs once; wakes the reporter
/// when anything changed.
pub async fn poll_once(state: &AgentState, client: &ProbeClient, gpus: &GpuReader) {
    let backends = probe_all(state, client).await;
    if let Ok(mut residency) = state.residency.lock() {
        for (handle, backend) in state.backends.iter().zip(&backends) {
            let slots = if backend.slots_total > 0 {
                usize::try_from(backend.slots_total).unwrap_or(usize::MAX)
            } else {
                crate::residency::Capacity::default().slots
            };
            let capacity = crate::residency::Capacity { slots, host_cache_tokens: handle.probe.host_cache_tokens };
            residency.set_capacity(&handle.probe.id, capacity);
        }
    }
    let changed_backends = match state.observations.lock() {
        Ok(mut o) if o.backends != backends => {
            o.backends = backends;
            true
        }
        _ => false,
    };
    let reading = gpus.read(client, state.loaded_model_bytes()).await;
    if let Some(error) = &reading.error {
        tracing::warn!(source = gpus.source_name(), %error, "GPU reading failed");
    }
    let changed_gpus = match state.observations.lock() {
        Ok(mut o) if o.gpus != reading.gpus => {
            o.gpus = reading.gpus;
            true
        }
        _ => false,
    };
    if changed_backends || changed_gpus {
        state.changed.notify_one();
    }
}

/// Probes every backend concurrently, keeping the configured order.
async fn probe_all(state: &AgentState, client: &ProbeClient) -> Vec<Backend> {
    let mut set = tokio::task::JoinSet::new();
    let previous: Vec<Option<Backend>> = match state.observations.lock() {
        Ok(o) => state.backends.iter().map(|h| o.backends.iter().find(|b| b.id == h.probe.id).cloned()).collect(),
        Err(_) => vec![None; state.backends.len()],
    };
    for ((i, handle), previous) in state.backends.iter().enumerate().zip(previous) {
        let probe = handle.probe.clone();
        let client = client.clone();
        set.spawn(async move { (i, probe.probe(&client, previous.as_ref()).await) });
    }
    let mut results: Vec<(usize, Backend)> = Vec::with_capacity(state.backends.len());
    while let Some(done) = set.join_next().await {
        match done {
            Ok(done) => results.push(done),
            Err(error) => tracing::error!(%error, "backend probe task failed"),
        }
    }
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, backend)| backend).collect()
}
