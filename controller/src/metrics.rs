//! The controller's Prometheus metrics, on a registry the caller passes in.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::snapshot::Snapshot;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: String,
}

pub struct Metrics {
    nodes: Family<StateLabels, Gauge>,
    snapshot_version: Gauge,
    pub agent_streams: Gauge,
    pub node_writes: Counter,
    pub node_write_failures: Counter,
    pub node_write_seconds: Histogram,
    pub snapshot_build_seconds: Histogram,
}

impl Metrics {
    pub fn new(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            nodes: Family::default(),
            snapshot_version: Gauge::default(),
            agent_streams: Gauge::default(),
            node_writes: Counter::default(),
            node_write_failures: Counter::default(),
            node_write_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            snapshot_build_seconds: Histogram::new(exponential_buckets(0.00001, 2.0, 18)),
        };
        let r = registry.sub_registry_with_prefix("inferyes_controller");
        r.register("nodes", "Nodes in the snapshot, by state (active, draining)", m.nodes.clone());
        r.register("snapshot_version", "Version (etcd revision) of the snapshot served", m.snapshot_version.clone());
        r.register("agent_streams", "Agent streams this controller holds", m.agent_streams.clone());
        r.register("node_writes", "Node records written to etcd", m.node_writes.clone());
        r.register(
            "node_write_failures",
            "Node record writes that failed (held for retry)",
            m.node_write_failures.clone(),
        );
        r.register("node_write_seconds", "Time to write a node record to etcd", m.node_write_seconds.clone());
        r.register("snapshot_build_seconds", "Time to build a routing snapshot", m.snapshot_build_seconds.clone());
        m
    }

    pub fn observe(&self, snapshot: Option<&Snapshot>) {
        let Some(snapshot) = snapshot else { return };
        let draining = snapshot.nodes().filter(|n| n.draining).count();
        let active = snapshot.nodes().count() - draining;
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.nodes.get_or_create(&StateLabels { state: "active".into() }).set(count(active));
        self.nodes.get_or_create(&StateLabels { state: "draining".into() }).set(count(draining));
        self.snapshot_version.set(i64::try_from(snapshot.version()).unwrap_or(i64::MAX));
    }
}
