//! The data plane's Prometheus metrics, registered on a registry the caller
//! passes in (no globals). Label values come from bounded sets only: models
//! of the catalog (anything else is `_unknown`), nodes of the fleet, HTTP
//! status codes and route reasons.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::snapshot::RoutingSnapshot;

#[derive(Clone, Debug, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub model: String,
    pub node: String,
    pub status: u16,
    pub route: &'static str,
}

// Looked up once a request, in a family's SipHash map: one word of a
// faster hash (seeded per process) is hashed there in place of each field.
impl std::hash::Hash for RequestLabels {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(inferyes_proto::fast_digest(&(&self.model, &self.node, self.status, self.route)));
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabels {
    pub node: String,
}

/// A queue's flow: a tenant, a key where it has none (`_open` with auth
/// off), and a class.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    pub flow: String,
    pub class: &'static str,
}

impl QueueLabels {
    pub fn with_reason(&self, reason: &'static str) -> QueueReasonLabels {
        QueueReasonLabels { flow: self.flow.clone(), class: self.class, reason }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueReasonLabels {
    pub flow: String,
    pub class: &'static str,
    pub reason: &'static str,
}

fn latency_histogram() -> Histogram {
    // 5 ms to about 20 minutes: a cold load can take minutes.
    Histogram::new(exponential_buckets(0.005, 2.0, 18))
}

pub struct Metrics {
    pub requests: Family<RequestLabels, Counter>,
    pub request_seconds: Family<ModelLabels, Histogram, fn() -> Histogram>,
    pub first_token_seconds: Family<ModelLabels, Histogram, fn() -> Histogram>,
    pub stream_seconds: Family<ModelLabels, Histogram, fn() -> Histogram>,
    pub retries: Counter,
    pub auth_refusals: Family<ReasonLabels, Counter>,
    pub continuations: Counter,
    /// Bytes of bodies read whole held now (set when scraped).
    pub buffered_bytes: Gauge,
    /// The data planes the keys' fleet-wide limits are split among (set
    /// when scraped).
    pub allowance_dataplanes: Gauge,
    /// 1 while the split is not whole here (set when scraped).
    pub allowance_settling: Gauge,
    pub connections_refused: Family<ReasonLabels, Counter>,
    pub queue_waiting: Family<QueueLabels, Gauge>,
    pub queue_entered: Family<QueueLabels, Counter>,
    pub queue_dispatched: Family<QueueLabels, Counter>,
    pub queue_refused: Family<QueueReasonLabels, Counter>,
    pub queue_wait_seconds: Family<QueueLabels, Histogram, fn() -> Histogram>,
    snapshot_version: Gauge,
    snapshot_age_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    node_in_flight: Family<NodeLabels, Gauge>,
    node_ejected: Family<NodeLabels, Gauge>,
    node_failures: Family<NodeLabels, Gauge>,
    node_ejections: Family<NodeLabels, Counter>,
    /// Held from [`Metrics::observe`] to the end of the encoding: two
    /// scrapes at once (workers run in parallel) would clear each other's
    /// per-node series, or count a node's ejections twice.
    pub scrape: std::sync::Mutex<()>,
}

impl Metrics {
    pub fn new(registry: &mut Registry) -> Metrics {
        let metrics = Metrics {
            requests: Family::default(),
            request_seconds: Family::new_with_constructor(latency_histogram),
            first_token_seconds: Family::new_with_constructor(latency_histogram),
            stream_seconds: Family::new_with_constructor(latency_histogram),
            retries: Counter::default(),
            auth_refusals: Family::default(),
            continuations: Counter::default(),
            buffered_bytes: Gauge::default(),
            allowance_dataplanes: Gauge::default(),
            allowance_settling: Gauge::default(),
            connections_refused: Family::default(),
            queue_waiting: Family::default(),
            queue_entered: Family::default(),
            queue_dispatched: Family::default(),
            queue_refused: Family::default(),
            queue_wait_seconds: Family::new_with_constructor(latency_histogram),
            snapshot_version: Gauge::default(),
            snapshot_age_seconds: Gauge::default(),
            node_in_flight: Family::default(),
            node_ejected: Family::default(),
            node_failures: Family::default(),
            node_ejections: Family::default(),
            scrape: std::sync::Mutex::new(()),
        };
        metrics.register(registry.sub_registry_with_prefix("inferyes_dataplane"));
        metrics
    }

    fn register(&self, registry: &mut Registry) {
        let metrics = self;
        registry.register(
            "requests",
            "Requests answered, by model, node, HTTP status and route; a stream is counted when it ends",
            metrics.requests.clone(),
        );
        registry.register(
            "request_seconds",
            "Time to a complete answer of requests that were not streamed",
            metrics.request_seconds.clone(),
        );
        registry.register(
            "first_token_seconds",
            "Time to the first token of a streamed answer (its first chunk carrying output), from its admission",
            metrics.first_token_seconds.clone(),
        );
        registry.register(
            "stream_seconds",
            "Time to the end of a streamed answer that ended well, from its admission",
            metrics.stream_seconds.clone(),
        );
        registry.register(
            "retries",
            "Requests sent to another node after one failed before the first byte",
            metrics.retries.clone(),
        );
        registry.register(
            "auth_refusals",
            "Requests refused by API key checks and limits, by reason (missing, invalid, revoked, expired, too_many_failures, checks_waiting, rate_limited, token_budget)",
            metrics.auth_refusals.clone(),
        );
        registry.register("continuations", "Broken streams resumed on another node", metrics.continuations.clone());
        registry.register(
            "buffered_bytes",
            "Bytes of request bodies and whole answers held now, all requests together (limit: max_buffered_bytes)",
            metrics.buffered_bytes.clone(),
        );
        registry.register(
            "allowance_dataplanes",
            "Data planes each key's fleet-wide limits are split among, as a controller last said (0: none said yet)",
            metrics.allowance_dataplanes.clone(),
        );
        registry.register(
            "allowance_settling",
            "1 while this data plane takes less than its even part of keys nobody asked of lately: a controller has not answered yet, or another data plane still holds parts of an older split",
            metrics.allowance_settling.clone(),
        );
        registry.register(
            "connections_refused",
            "Client connections refused at once, by reason: full (max_connections), peer (max_connections_per_client)",
            metrics.connections_refused.clone(),
        );
        registry.register(
            "queue_waiting",
            "Requests waiting in this data plane's queue for a free slot, by flow (tenant, else key) and class",
            metrics.queue_waiting.clone(),
        );
        registry.register(
            "queue_entered",
            "Requests that waited in the queue, by flow and class",
            metrics.queue_entered.clone(),
        );
        registry.register(
            "queue_dispatched",
            "Requests let out of the queue to a node, by flow and class",
            metrics.queue_dispatched.clone(),
        );
        registry.register(
            "queue_refused",
            "Requests the queue refused, by flow, class and reason: share (the flow holds its share of the queue), full (max_requests or max_bytes), age (waited max_wait_ms)",
            metrics.queue_refused.clone(),
        );
        registry.register(
            "queue_wait_seconds",
            "Time requests waited in the queue, by flow and class",
            metrics.queue_wait_seconds.clone(),
        );
        registry.register(
            "snapshot_version",
            "Version (etcd revision) of the routing snapshot held",
            metrics.snapshot_version.clone(),
        );
        registry.register(
            "snapshot_age_seconds",
            "Time since the routing snapshot held was installed",
            metrics.snapshot_age_seconds.clone(),
        );
        registry.register(
            "node_in_flight",
            "This data plane's requests in flight per node",
            metrics.node_in_flight.clone(),
        );
        registry.register("node_ejected", "1 while a node is ejected after failures", metrics.node_ejected.clone());
        registry.register("node_failures", "Consecutive failures per node", metrics.node_failures.clone());
        registry.register(
            "node_ejections",
            "Times a node was held out of routing after a failure (for rates and alerts)",
            metrics.node_ejections.clone(),
        );
    }

    /// Gauges read at scrape time from the snapshot held.
    pub fn observe(&self, snapshot: Option<&RoutingSnapshot>, installed_age_seconds: f64) {
        self.node_in_flight.clear();
        self.node_ejected.clear();
        self.node_failures.clear();
        self.node_ejections.clear();
        let Some(snapshot) = snapshot else { return };
        self.snapshot_version.set(i64::try_from(snapshot.version()).unwrap_or(i64::MAX));
        self.snapshot_age_seconds.set(installed_age_seconds);
        let now = inferyes_proto::unix_ms();
        for node in snapshot.nodes() {
            let labels = NodeLabels { node: node.id.to_string() };
            let endpoint = &node.endpoint;
            self.node_in_flight.get_or_create(&labels).set(i64::from(endpoint.in_flight()));
            self.node_ejected.get_or_create(&labels).set(i64::from(endpoint.ejected(now)));
            self.node_failures.get_or_create(&labels).set(i64::from(endpoint.failures()));
            // Counted by the node's state, which outlives snapshots: the
            // series only grows while the node stays in the fleet.
            self.node_ejections.get_or_create(&labels).inc_by(endpoint.ejections());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_s_labels_find_their_own_series_and_no_other() {
        let family = Family::<RequestLabels, Counter>::default();
        let labels = |model: &str, node: &str, status, route| RequestLabels {
            model: model.to_string(),
            node: node.to_string(),
            status,
            route,
        };
        family.get_or_create(&labels("m", "n", 200, "sticky")).inc();
        family.get_or_create(&labels("m", "n", 200, "sticky")).inc();
        // Fields that would run together as one string stay apart.
        for other in [labels("mn", "", 200, "sticky"), labels("m", "n", 500, "sticky"), labels("m", "n", 200, "placed")]
        {
            family.get_or_create(&other).inc();
        }
        assert_eq!(family.get_or_create(&labels("m", "n", 200, "sticky")).get(), 2);
        assert_eq!(family.get_or_create(&labels("mn", "", 200, "sticky")).get(), 1);
    }
}
