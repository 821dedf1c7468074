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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OrderLabels {
    /// `load` or `unload`.
    pub action: &'static str,
    /// `issued`, `done`, `failed`, `gone` (its node left) or `withdrawn`
    /// (its node drains, or an unload's model is in use again).
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusedLabels {
    /// `grpc` or `http`.
    pub port: &'static str,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DashboardRefusedLabels {
    /// `token`: a wrong token; `attempts`: its address presented too many.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AgentRefusedLabels {
    /// `join_token`, `max_nodes`, `node_taken` or `write_budget`.
    pub reason: &'static str,
}

pub struct Metrics {
    nodes: Family<StateLabels, Gauge>,
    snapshot_version: Gauge,
    model_warm_nodes: Family<ModelLabels, Gauge>,
    critical_models_short: Gauge,
    model_desired_nodes: Family<ModelLabels, Gauge>,
    pub placement_orders: Family<OrderLabels, Counter>,
    pub placement_outstanding: Gauge,
    pub placement_leading: Gauge,
    pub agent_streams: Gauge,
    pub node_writes: Counter,
    pub node_write_bytes: Counter,
    pub node_write_failures: Counter,
    pub node_write_seconds: Histogram,
    pub lease_keepalives: Counter,
    pub lease_keepalive_failures: Counter,
    pub snapshot_build_seconds: Histogram,
    pub peers: Gauge,
    pub live_resyncs: Counter,
    pub etcd_db_size_bytes: Gauge,
    pub etcd_db_size_in_use_bytes: Gauge,
    pub etcd_quota_bytes: Gauge,
    pub connections_refused: Family<RefusedLabels, Counter>,
    pub dashboard_refused: Family<DashboardRefusedLabels, Counter>,
    pub agents_refused: Family<AgentRefusedLabels, Counter>,
    pub max_nodes: Gauge,
}

impl Metrics {
    pub fn new(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            nodes: Family::default(),
            snapshot_version: Gauge::default(),
            model_warm_nodes: Family::default(),
            critical_models_short: Gauge::default(),
            model_desired_nodes: Family::default(),
            placement_orders: Family::default(),
            placement_outstanding: Gauge::default(),
            placement_leading: Gauge::default(),
            agent_streams: Gauge::default(),
            node_writes: Counter::default(),
            node_write_bytes: Counter::default(),
            node_write_failures: Counter::default(),
            node_write_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            lease_keepalives: Counter::default(),
            lease_keepalive_failures: Counter::default(),
            snapshot_build_seconds: Histogram::new(exponential_buckets(0.00001, 2.0, 18)),
            peers: Gauge::default(),
            live_resyncs: Counter::default(),
            etcd_db_size_bytes: Gauge::default(),
            etcd_db_size_in_use_bytes: Gauge::default(),
            etcd_quota_bytes: Gauge::default(),
            connections_refused: Family::default(),
            dashboard_refused: Family::default(),
            agents_refused: Family::default(),
            max_nodes: Gauge::default(),
        };
        let r = registry.sub_registry_with_prefix("inferyes_controller");
        r.register("nodes", "Nodes in the snapshot, by state (active, draining)", m.nodes.clone());
        r.register("snapshot_version", "Version (etcd revision) of the snapshot served", m.snapshot_version.clone());
        r.register(
            "model_warm_nodes",
            "Nodes with the model loaded, per model of the catalog",
            m.model_warm_nodes.clone(),
        );
        r.register(
            "critical_models_short",
            "Latency-critical models (routing policy) warm on fewer than two nodes",
            m.critical_models_short.clone(),
        );
        r.register(
            "model_desired_nodes",
            "Warm nodes placement keeps each declared model on (fleet policy replicas)",
            m.model_desired_nodes.clone(),
        );
        r.register(
            "placement_orders",
            "Placement's load and unload orders, as issued and as they ended (on the leader)",
            m.placement_orders.clone(),
        );
        r.register(
            "placement_outstanding",
            "Placement orders issued and not yet done (on the leader)",
            m.placement_outstanding.clone(),
        );
        r.register(
            "placement_leading",
            "1 while this controller leads placement (and the usage ledger)",
            m.placement_leading.clone(),
        );
        r.register(
            "connections_refused",
            "Connections refused at once, by port and reason: full (max_*_connections), strangers (max_grpc_stranger_connections: the oldest stranger's connection closed to make room), peer (the per-address share)",
            m.connections_refused.clone(),
        );
        r.register(
            "dashboard_refused",
            "Dashboard logins and reads refused, by reason: token (a wrong token), attempts (its address presented too many wrong ones: 10, then one each 30 s)",
            m.dashboard_refused.clone(),
        );
        r.register(
            "agents_refused",
            "Agents refused as they joined, by reason: join_token (a wrong or missing one), max_nodes (the fleet holds as many nodes as it takes), node_taken (another agent's live lease holds the node id), write_budget (the controller's writes to etcd are at max_node_write_bytes_per_second)",
            m.agents_refused.clone(),
        );
        r.register("max_nodes", "Nodes the fleet takes (max_nodes)", m.max_nodes.clone());
        r.register("agent_streams", "Agent streams this controller holds", m.agent_streams.clone());
        r.register("node_writes", "Node records written to etcd", m.node_writes.clone());
        r.register(
            "node_write_bytes",
            "Bytes of node records written to etcd (at most max_node_write_bytes_per_second, after a burst)",
            m.node_write_bytes.clone(),
        );
        r.register(
            "node_write_failures",
            "Node record writes that failed (held for retry)",
            m.node_write_failures.clone(),
        );
        r.register("node_write_seconds", "Time to write a node record to etcd", m.node_write_seconds.clone());
        r.register("lease_keepalives", "Node lease keep-alives sent to etcd", m.lease_keepalives.clone());
        r.register(
            "lease_keepalive_failures",
            "Node lease keep-alives etcd did not answer (tried again at the next)",
            m.lease_keepalive_failures.clone(),
        );
        r.register("snapshot_build_seconds", "Time to build a routing snapshot", m.snapshot_build_seconds.clone());
        r.register("peers", "Other controllers this one follows for their nodes' live state", m.peers.clone());
        r.register(
            "live_resyncs",
            "Whole live states sent again to a data plane or peer that fell behind the live batches",
            m.live_resyncs.clone(),
        );
        r.register(
            "etcd_db_size_bytes",
            "Size of etcd's database file on the member this controller asks",
            m.etcd_db_size_bytes.clone(),
        );
        r.register(
            "etcd_db_size_in_use_bytes",
            "Part of etcd's database in use (the rest is free after compaction, given back by a defrag)",
            m.etcd_db_size_in_use_bytes.clone(),
        );
        r.register(
            "etcd_quota_bytes",
            "etcd's space quota: past it, etcd refuses every write",
            m.etcd_quota_bytes.clone(),
        );
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
        // Rebuilt whole, so a model that left the catalog leaves the scrape.
        self.model_warm_nodes.clear();
        let critical = &snapshot.policy().latency_critical_models;
        let mut short = 0;
        let models = crate::snapshot::model_summaries(snapshot);
        for model in &models {
            self.model_warm_nodes
                .get_or_create(&ModelLabels { model: model.id.clone() })
                .set(count(model.loaded_on.len()));
        }
        for id in critical {
            if models.iter().find(|m| &m.id == id).is_none_or(|m| m.loaded_on.len() < 2) {
                short += 1;
            }
        }
        self.critical_models_short.set(short);
        self.model_desired_nodes.clear();
        let policy = snapshot.policy();
        for model in policy.replicas.keys().chain(&policy.latency_critical_models) {
            let desired = inferyes_proto::replicas(policy, model).min;
            self.model_desired_nodes.get_or_create(&ModelLabels { model: model.clone() }).set(i64::from(desired));
        }
    }
}
