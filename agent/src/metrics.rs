//! The agent's Prometheus metrics, read at scrape time from what the agent
//! already observes: per GPU and per backend, plus its residency estimate.
//! Registered on a registry the caller passes in.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::state::{AgentState, BackendLabels};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GpuLabels {
    pub gpu: String,
    pub name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendOutcomeLabels {
    pub backend: String,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TierEventLabels {
    pub backend: String,
    pub event: &'static str,
}

/// What moving conversations' slots came to, on both sides.
#[derive(Clone, Default)]
pub struct SlotMetrics {
    /// Slots this node's drain sent, by outcome.
    pub sent: Family<OutcomeLabels, Counter>,
    /// Slots other nodes sent here, by outcome (`restored`, or why not).
    pub received: Family<OutcomeLabels, Counter>,
    /// Restored slots' next turns: `held`, `reused_nothing`, `diverged` or
    /// `unjudged`.
    pub checked: Family<BackendOutcomeLabels, Counter>,
}

impl SlotMetrics {
    /// Counts what a restored slot's next turn on `backend` showed.
    pub fn restore_checked(&self, backend: &crate::state::BackendHandle, outcome: &'static str) {
        let labels = BackendOutcomeLabels { backend: backend.probe.id.clone(), outcome };
        self.checked.get_or_create(&labels).inc();
    }
}

pub struct Metrics {
    pub slots: SlotMetrics,
    gpu_memory_used_bytes: Family<GpuLabels, Gauge>,
    gpu_memory_total_bytes: Family<GpuLabels, Gauge>,
    gpu_utilization_percent: Family<GpuLabels, Gauge>,
    backend_up: Family<BackendLabels, Gauge>,
    slots_busy: Family<BackendLabels, Gauge>,
    slots_total: Family<BackendLabels, Gauge>,
    requests_deferred: Family<BackendLabels, Gauge>,
    in_flight: Family<BackendLabels, Gauge>,
    tokens_per_second: Family<BackendLabels, Gauge<f64, AtomicU64>>,
    resident_sessions: Family<BackendLabels, Gauge>,
    residency_hits: Family<BackendLabels, Gauge>,
    residency_misses: Family<BackendLabels, Gauge>,
    backend_restarts: Family<BackendLabels, Counter>,
    kv_tier_bytes: Family<BackendLabels, Gauge>,
    kv_tier_states: Family<BackendLabels, Gauge>,
    /// The tiers' own counts, copied at each scrape.
    kv_tier_events: Family<TierEventLabels, Counter>,
    kv_tier_seconds: Family<TierEventLabels, Counter<f64, AtomicU64>>,
    /// Time from a request reaching the proxy to the backend's first byte.
    pub first_byte_seconds: Family<BackendLabels, Histogram, fn() -> Histogram>,
    pub connections_refused: Family<ReasonLabels, Counter>,
}

fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 18))
}

impl Metrics {
    pub fn new(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            slots: SlotMetrics::default(),
            gpu_memory_used_bytes: Family::default(),
            gpu_memory_total_bytes: Family::default(),
            gpu_utilization_percent: Family::default(),
            backend_up: Family::default(),
            slots_busy: Family::default(),
            slots_total: Family::default(),
            requests_deferred: Family::default(),
            in_flight: Family::default(),
            tokens_per_second: Family::default(),
            resident_sessions: Family::default(),
            residency_hits: Family::default(),
            residency_misses: Family::default(),
            backend_restarts: Family::default(),
            kv_tier_bytes: Family::default(),
            kv_tier_states: Family::default(),
            kv_tier_events: Family::default(),
            kv_tier_seconds: Family::default(),
            first_byte_seconds: Family::new_with_constructor(latency_histogram),
            connections_refused: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("inferyes_agent");
        r.register("gpu_memory_used_bytes", "GPU memory in use", m.gpu_memory_used_bytes.clone());
        r.register("gpu_memory_total_bytes", "GPU memory in all", m.gpu_memory_total_bytes.clone());
        r.register("gpu_utilization_percent", "GPU busy time", m.gpu_utilization_percent.clone());
        r.register("backend_up", "1 when the backend answers ready", m.backend_up.clone());
        r.register("slots_busy", "Backend slots processing a request", m.slots_busy.clone());
        r.register("slots_total", "Backend slots", m.slots_total.clone());
        r.register("requests_deferred", "Requests the backend queued for a slot", m.requests_deferred.clone());
        r.register("in_flight", "Requests in flight through the agent's proxy", m.in_flight.clone());
        r.register("tokens_per_second", "Backend decode speed", m.tokens_per_second.clone());
        r.register("resident_sessions", "Conversations believed resident on the backend", m.resident_sessions.clone());
        r.register(
            "residency_hits",
            "Turns of resident sessions that read at least half their prompt from cache",
            m.residency_hits.clone(),
        );
        r.register(
            "residency_misses",
            "Turns that recomputed more than half their prompt although their session was believed resident",
            m.residency_misses.clone(),
        );
        r.register(
            "backend_restarts",
            "Times the backend's counters went back: it restarted, and its slots and host cache were lost",
            m.backend_restarts.clone(),
        );
        r.register("kv_tier_bytes", "Bytes of conversations' slot states the KV tier keeps", m.kv_tier_bytes.clone());
        r.register("kv_tier_states", "Conversations' slot states the KV tier keeps", m.kv_tier_states.clone());
        r.register(
            "kv_tier_events",
            "KV tier events, by kind: saved (a turn's slot kept), skipped (not kept: its slot busy or taken, the \
             save failed, the disk full), evicted (given up for room), restored (into a slot for a returning \
             turn), restore_failed (the turn recomputed)",
            m.kv_tier_events.clone(),
        );
        r.register(
            "kv_tier_seconds",
            "Time the KV tier spent, by kind: saved (the server's save, the file's check and its record) and restored (on the returning turn's path)",
            m.kv_tier_seconds.clone(),
        );
        r.register(
            "first_byte_seconds",
            "Time from a request reaching the proxy to the backend's first byte (for llama-server: the first token)",
            m.first_byte_seconds.clone(),
        );
        r.register(
            "connections_refused",
            "Proxy connections refused at once, by reason: full (max_connections), strangers (max_stranger_connections: the oldest stranger's connection closed to make room), peer (max_stranger_connections_per_address)",
            m.connections_refused.clone(),
        );
        r.register("slots_sent", "Conversations' slots a drain sent to other nodes, by outcome", m.slots.sent.clone());
        r.register(
            "slots_received",
            "Conversations' slots other nodes sent here, by outcome (restored, or the refusal's code)",
            m.slots.received.clone(),
        );
        r.register(
            "slot_restores_checked",
            "Restored slots' next turns: held (read at least half the restored tokens from cache), reused_nothing \
             (carried on from them and read less: the backend takes no slots for a while), diverged (sent another \
             history), or unjudged (read less, and could not be told apart)",
            m.slots.checked.clone(),
        );
        m
    }

    /// Sets every gauge from the agent's current view.
    pub fn observe(&self, state: &AgentState) {
        for family in [&self.gpu_memory_used_bytes, &self.gpu_memory_total_bytes, &self.gpu_utilization_percent] {
            family.clear();
        }
        let status = state.status();
        for gpu in &status.gpus {
            let labels = GpuLabels { gpu: gpu.index.to_string(), name: gpu.name.clone() };
            let bytes = |b: u64| i64::try_from(b).unwrap_or(i64::MAX);
            self.gpu_memory_used_bytes.get_or_create(&labels).set(bytes(gpu.memory_used_bytes));
            self.gpu_memory_total_bytes.get_or_create(&labels).set(bytes(gpu.memory_total_bytes));
            self.gpu_utilization_percent.get_or_create(&labels).set(i64::from(gpu.utilization_percent));
        }
        let sessions = state.residency.lock().sessions();
        for backend in &status.backends {
            let labels = BackendLabels { backend: backend.id.clone() };
            let ready = backend.health() == inferyes_proto::v1::Health::Ready;
            self.backend_up.get_or_create(&labels).set(i64::from(ready));
            self.slots_busy.get_or_create(&labels).set(i64::from(backend.slots_busy));
            self.slots_total.get_or_create(&labels).set(i64::from(backend.slots_total));
            self.requests_deferred.get_or_create(&labels).set(i64::from(backend.requests_deferred));
            self.in_flight.get_or_create(&labels).set(i64::from(backend.in_flight));
            self.tokens_per_second.get_or_create(&labels).set(backend.tokens_per_second);
            let mine = sessions.iter().filter(|s| s.backend_id == backend.id);
            let (count, hits, misses) = mine.fold((0i64, 0i64, 0i64), |(n, h, m), s| {
                (n + 1, h + i64::from(s.cache_hits), m + i64::from(s.cache_misses))
            });
            self.resident_sessions.get_or_create(&labels).set(count);
            self.residency_hits.get_or_create(&labels).set(hits);
            self.residency_misses.get_or_create(&labels).set(misses);
        }
        let restarts: Vec<u64> = state.observations.lock().throughput.iter().map(|t| t.restarts).collect();
        for (handle, restarts) in state.backends.iter().zip(restarts) {
            let labels = BackendLabels { backend: handle.probe.id.clone() };
            self.backend_restarts.get_or_create(&labels).inner().store(restarts, std::sync::atomic::Ordering::Relaxed);
        }
        for handle in &state.backends {
            if let Some(tier) = &handle.tier {
                self.observe_tier(&handle.probe.id, tier);
            }
        }
    }

    fn observe_tier(&self, backend: &str, tier: &crate::tier::Tier) {
        use std::sync::atomic::Ordering::Relaxed;
        let labels = BackendLabels { backend: backend.to_string() };
        let report = tier.report();
        self.kv_tier_bytes.get_or_create(&labels).set(i64::try_from(report.bytes).unwrap_or(i64::MAX));
        self.kv_tier_states.get_or_create(&labels).set(i64::from(report.states));
        let event = |event: &'static str| TierEventLabels { backend: backend.to_string(), event };
        for (name, count) in [
            ("saved", report.saves),
            ("skipped", report.skipped),
            ("evicted", report.evicted),
            ("restored", report.restores),
            ("restore_failed", report.restore_failures),
        ] {
            self.kv_tier_events.get_or_create(&event(name)).inner().store(count, Relaxed);
        }
        for (name, micros) in [("saved", report.save_micros), ("restored", report.restore_micros)] {
            let seconds = micros as f64 / 1e6;
            self.kv_tier_seconds.get_or_create(&event(name)).inner().store(seconds.to_bits(), Relaxed);
        }
    }
}
