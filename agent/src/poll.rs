//! The poller: the one writer of the agent's observations.

use std::sync::Arc;
use std::time::Duration;

use inferyes_proto::v1::{Backend, Gpu};
use tokio_util::sync::CancellationToken;

use crate::probe::{Counters, GpuReader, GpuReading, ProbeClient, Probed, Throughput};
use crate::state::{AgentState, Observations};

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
            () = state.poll_now.notified() => {
                poll_once(&state, &client, &gpus).await;
                ticker.reset();
            }
        }
    }
}

/// Polls every backend (concurrently) and the GPUs once; wakes the reporter
/// when anything changed.
pub async fn poll_once(state: &AgentState, client: &ProbeClient, gpus: &GpuReader) {
    let probed = probe_all(state, client).await;
    let (backends, restarted) = with_rates(state, probed, inferyes_proto::unix_ms());
    {
        let mut residency = state.residency.lock();
        for id in &restarted {
            tracing::info!(backend = %id, "the server restarted: its slots and host cache hold nothing");
            residency.server_restarted(id);
        }
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
    let changed_backends = {
        let mut observations = state.observations.lock();
        let changed = observations.backends != backends;
        if changed {
            observations.backends = backends;
        }
        changed
    };
    let reading = gpus.read(client, state.loaded_model_bytes()).await;
    if let Some(error) = &reading.error {
        tracing::warn!(source = gpus.source_name(), %error, "GPU reading failed");
    }
    let changed_gpus = {
        let mut observations = state.observations.lock();
        let Observations { gpus, gpu_failures, .. } = &mut *observations;
        let reported = reported_gpus(gpus, reading, gpu_failures);
        let changed = *gpus != reported;
        *gpus = reported;
        changed
    };
    if changed_backends || changed_gpus {
        state.changed.notify_one();
    }
}

/// Failed readings in a row after which the last values are reported stale:
/// one failure is a blip, not worth two writes of the node's record.
const STALE_AFTER_FAILURES: u32 = 3;

/// The GPUs to report after `reading`. A failed reading keeps the last
/// values, marked stale once readings have failed a few times in a row:
/// reported empty, a node whose driver hiccuped would look like a node with
/// all its memory free, and take any model load.
fn reported_gpus(last: &[Gpu], reading: GpuReading, failures: &mut u32) -> Vec<Gpu> {
    if reading.error.is_none() {
        *failures = 0;
        return reading.gpus;
    }
    *failures = failures.saturating_add(1);
    if last.is_empty() || last.iter().all(|gpu| gpu.memory_total_bytes == 0 && gpu.stale) {
        // Nothing read yet (the agent started while its GPUs could not be
        // read): what this reading got, stale, or a GPU of unknown memory.
        // Reported as no GPU, the node would look like a CPU node, whose
        // memory no load is held to.
        let read = if reading.gpus.is_empty() {
            vec![Gpu { name: "unreadable GPU".into(), ..Default::default() }]
        } else {
            reading.gpus
        };
        return read.into_iter().map(|gpu| Gpu { stale: true, ..gpu }).collect();
    }
    let stale = *failures >= STALE_AFTER_FAILURES;
    last.iter().map(|gpu| Gpu { stale, ..gpu.clone() }).collect()
}

/// The backends as probed, with the prompt rate and service time their
/// counters give over the last readings; and those whose servers
/// restarted since the last.
fn with_rates(state: &AgentState, probed: Vec<Probed>, now_ms: u64) -> (Vec<Backend>, Vec<String>) {
    let mut observations = state.observations.lock();
    let windows = &mut observations.throughput;
    windows.resize_with(state.backends.len(), Throughput::default);
    let mut restarted = Vec::new();
    let backends = probed
        .into_iter()
        .zip(state.backends.iter().zip(windows.iter_mut()))
        .map(|(Probed { mut backend, counters }, (handle, window))| {
            let rates = match counters {
                Some(counters) => {
                    let finished = handle.finished.load(std::sync::atomic::Ordering::Relaxed);
                    let restarts = window.restarts;
                    let rates = window.observe(now_ms, Counters { finished, ..counters });
                    if window.restarts != restarts {
                        restarted.push(handle.probe.id.clone());
                    }
                    rates
                }
                // Not read this time: the last rates stand.
                None => window.rates(),
            };
            backend.prefill_tokens_per_second = rates.prefill_tokens_per_second;
            backend.service_ms = rates.service_ms;
            backend
        })
        .collect();
    (backends, restarted)
}

/// Probes every backend concurrently, keeping the configured order.
async fn probe_all(state: &AgentState, client: &ProbeClient) -> Vec<Probed> {
    let mut set = tokio::task::JoinSet::new();
    let previous: Vec<Option<Backend>> = {
        let observations = state.observations.lock();
        state.backends.iter().map(|h| observations.backends.iter().find(|b| b.id == h.probe.id).cloned()).collect()
    };
    for ((i, handle), previous) in state.backends.iter().enumerate().zip(previous) {
        let probe = handle.probe.clone();
        let client = client.clone();
        set.spawn(async move { (i, probe.probe(&client, previous.as_ref()).await) });
    }
    let mut results: Vec<Option<Probed>> = vec![None; state.backends.len()];
    while let Some(done) = set.join_next().await {
        match done {
            Ok((i, backend)) => results[i] = Some(backend),
            Err(error) => tracing::error!(%error, "backend probe task failed"),
        }
    }
    // One per backend, in order, whatever became of its probe: the list is
    // read side by side with the configured backends.
    results
        .into_iter()
        .zip(&state.backends)
        .map(|(probed, handle)| {
            probed.unwrap_or_else(|| Probed { backend: unprobed(&handle.probe.id), counters: None })
        })
        .collect()
}

/// A backend whose probe failed to report (a bug panicked it): not known
/// to serve anything.
fn unprobed(id: &str) -> Backend {
    let mut backend = Backend { id: id.to_string(), ..Default::default() };
    backend.set_health(inferyes_proto::v1::Health::Unknown);
    backend
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(used: u64) -> Gpu {
        Gpu { name: "L4".into(), memory_total_bytes: 100, memory_used_bytes: used, ..Default::default() }
    }

    fn failed() -> GpuReading {
        GpuReading { gpus: Vec::new(), error: Some("NVML: GPU is lost".into()) }
    }

    #[test]
    fn a_failed_reading_keeps_the_last_values_and_marks_them_stale_after_a_few() {
        let mut failures = 0;
        let read = reported_gpus(&[], GpuReading { gpus: vec![gpu(90)], error: None }, &mut failures);
        assert_eq!(read, [gpu(90)]);
        // A blip: the last values, not an empty (all free) node.
        let mut last = read;
        for _ in 1..STALE_AFTER_FAILURES {
            last = reported_gpus(&last, failed(), &mut failures);
            assert_eq!(last, [gpu(90)]);
        }
        last = reported_gpus(&last, failed(), &mut failures);
        assert_eq!(last, [Gpu { stale: true, ..gpu(90) }], "failed {failures} times in a row");
        // A good reading ends it.
        let back = reported_gpus(&last, GpuReading { gpus: vec![gpu(40)], error: None }, &mut failures);
        assert_eq!((back, failures), (vec![gpu(40)], 0));
        // Before any good reading there is nothing to keep: a GPU of unknown
        // memory, stale at once, until one is read.
        let mut failures = 0;
        let unknown = reported_gpus(&[], failed(), &mut failures);
        assert_eq!(unknown.len(), 1);
        assert!(unknown[0].stale && unknown[0].memory_total_bytes == 0);
        assert_eq!(reported_gpus(&unknown, failed(), &mut failures), unknown);
        assert_eq!(reported_gpus(&unknown, GpuReading { gpus: vec![gpu(40)], error: None }, &mut failures), [gpu(40)]);
    }
}
