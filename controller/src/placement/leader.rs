//! The placement loop. It acts only on the controller that leads the
//! fleet's singleton work (the usage ledger's election), and only while
//! it leads: each second, or when the fleet changes, it settles its
//! outstanding orders against the fleet, plans, and writes the orders to
//! etcd under the leader's lease. Every controller relays each node's
//! orders to its agent; when the leader goes, its lease and its orders go
//! with it, and nothing more is asked of any node until another leads.

use std::sync::Arc;
use std::time::Duration;

use inferyes_proto::v1::{PlacementAction, PlacementOrder, PlacementOrders};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{Fleet, Outcome, Placing, Settings, plan};
use crate::metrics::{Metrics, OrderLabels};
use crate::reconcile::{LiveViewRx, SnapshotRx};
use crate::store::EtcdStore;

/// How often the fleet is looked at when nothing changed: orders time out,
/// backoffs end, sessions go idle without a snapshot.
const ROUND_EVERY: Duration = Duration::from_secs(1);

pub struct Placer {
    pub store: EtcdStore,
    pub snapshots: SnapshotRx,
    pub views: LiveViewRx,
    /// The lease of this controller's leadership, while it leads.
    pub leading: watch::Receiver<Option<i64>>,
    pub controller_id: String,
    pub settings: Settings,
    pub metrics: Arc<Metrics>,
    pub shutdown: CancellationToken,
}

/// One leadership's placement.
struct Term {
    lease: i64,
    epoch: u64,
    placing: Placing,
    /// The orders as last written.
    written: Option<Vec<PlacementOrder>>,
}

impl Placer {
    pub async fn run(mut self) {
        let mut term: Option<Term> = None;
        let mut every = tokio::time::interval(ROUND_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut snapshots = self.snapshots.clone();
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => return,
                _ = every.tick() => {}
                changed = self.leading.changed() => if changed.is_err() { return },
                changed = snapshots.changed() => if changed.is_err() { return },
            }
            let lease = *self.leading.borrow_and_update();
            let Some(lease) = lease else {
                if term.take().is_some() {
                    tracing::info!("placement stopped: this controller no longer leads");
                }
                self.metrics.placement_leading.set(0);
                self.metrics.placement_outstanding.set(0);
                continue;
            };
            if term.as_ref().is_none_or(|t| t.lease != lease) {
                tracing::info!("placing models: this controller leads");
                let epoch = inferyes_proto::unix_ms();
                term = Some(Term { lease, epoch, placing: Placing::default(), written: None });
            }
            self.metrics.placement_leading.set(1);
            let Some(term) = term.as_mut() else { continue };
            let Some(snapshot) = snapshots.borrow_and_update().clone() else { continue };
            let live = Arc::clone(&self.views.borrow());
            self.round(term, &snapshot, &live).await;
        }
    }

    async fn round(&self, term: &mut Term, snapshot: &crate::snapshot::Snapshot, live: &crate::live::LiveView) {
        // Nothing declared, nothing asked, nothing left to withdraw: the
        // fleet is not read.
        let idle = super::declared(snapshot.policy()).is_empty() && term.placing.is_idle();
        if idle && term.written.as_ref().is_some_and(Vec::is_empty) {
            return;
        }
        let now = inferyes_proto::unix_ms();
        let fleet = Fleet::read(snapshot, live);
        for (order, outcome) in term.placing.settle(&fleet, self.settings, now) {
            let outcome = match outcome {
                Outcome::Done => "done",
                Outcome::Failed => "failed",
                Outcome::Gone => "gone",
                Outcome::Withdrawn => "withdrawn",
            };
            self.count(&order, outcome);
            let log = |message: &str| match outcome {
                "failed" => tracing::warn!(node = %order.node_id, model = %order.model, id = %order.id, "{message}"),
                _ => tracing::info!(node = %order.node_id, model = %order.model, id = %order.id, "{message}"),
            };
            log(&format!("placement: {} {outcome}", action_name(&order)));
        }
        if snapshot.policy().placement_off {
            term.placing.withdraw_all();
        }
        let actions = plan(&fleet, snapshot.policy(), &term.placing, self.settings, now);
        for order in term.placing.issue(actions, &self.controller_id, term.epoch, now) {
            self.count(&order, "issued");
            tracing::info!(
                node = %order.node_id, backend = %order.backend_id, model = %order.model, id = %order.id,
                "placement: {} issued", action_name(&order)
            );
        }
        let orders = term.placing.orders();
        self.metrics.placement_outstanding.set(i64::try_from(orders.len()).unwrap_or(i64::MAX));
        if term.written.as_ref() == Some(&orders) {
            return;
        }
        let record = PlacementOrders { controller_id: self.controller_id.clone(), orders: orders.clone() };
        match self.store.put_placement(&record, term.lease).await {
            Ok(_) => term.written = Some(orders),
            // Tried again next round; the orders not delivered time out.
            Err(error) => tracing::warn!(%error, "placement orders not written"),
        }
    }

    fn count(&self, order: &PlacementOrder, outcome: &'static str) {
        let labels = OrderLabels { action: action_name(order), outcome };
        self.metrics.placement_orders.get_or_create(&labels).inc();
    }
}

fn action_name(order: &PlacementOrder) -> &'static str {
    match order.action() {
        PlacementAction::Load => "load",
        PlacementAction::Unload => "unload",
        PlacementAction::Unspecified => "unspecified",
    }
}
