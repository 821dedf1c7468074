//! Tells a controller what this data plane did lately: its routing
//! decisions and the nodes it holds ejected, for the fleet dashboard.
//!
//! Best effort by design. The request path only offers a decision to a
//! bounded queue (never waits, never allocates a connection); a full queue
//! or an unreachable controller loses lines of a tail, and the next report
//! says how many.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use inferyes_proto::v1::{DataPlaneReport, RoutingDecision};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::SnapshotStore;

/// How often decisions go out.
const REPORT_EVERY: Duration = Duration::from_secs(1);
/// With nothing new, a report still goes out this often, so the controller
/// knows the ejections it shows are current.
const KEEPALIVE_EVERY: Duration = Duration::from_secs(10);
/// Decisions in one report, and waiting for it: the dashboard shows a
/// tail, not a ledger. Beyond that, decisions are counted, not built.
const MAX_PER_REPORT: usize = 512;
/// Flows of the queue a report names at most.
const MAX_QUEUED_FLOWS: usize = 64;
const SEND_TIMEOUT: Duration = Duration::from_secs(2);

/// The request path's end of the queue.
pub struct DecisionLog {
    tx: mpsc::Sender<RoutingDecision>,
    dropped: AtomicU64,
}

impl DecisionLog {
    pub fn new() -> (Arc<DecisionLog>, mpsc::Receiver<RoutingDecision>) {
        let (tx, rx) = mpsc::channel(MAX_PER_REPORT);
        (Arc::new(DecisionLog { tx, dropped: AtomicU64::new(0) }), rx)
    }

    /// Queues the decision `build` makes, or, when the queue is full (a
    /// busy second), only counts it: the record is not even built.
    pub fn record(&self, build: impl FnOnce() -> RoutingDecision) {
        let sent = match self.tx.try_reserve() {
            Ok(permit) => {
                permit.send(build());
                true
            }
            Err(_) => false,
        };
        if !sent {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

pub async fn run(
    log: Arc<DecisionLog>,
    mut rx: mpsc::Receiver<RoutingDecision>,
    (store, queue): (Arc<SnapshotStore>, Option<Arc<crate::queue::Queue>>),
    controllers: crate::Controllers,
    dataplane_id: String,
    shutdown: CancellationToken,
) {
    let clients: Vec<crate::RoutingClient> = controllers
        .addresses
        .iter()
        .filter_map(|address| match controllers.endpoint(address) {
            Ok(endpoint) => {
                Some(controllers.client(endpoint.connect_timeout(SEND_TIMEOUT).tcp_nodelay(true).connect_lazy()))
            }
            Err(error) => {
                tracing::warn!(controller = %address, error = format!("{error:#}"), "not reporting to this controller");
                None
            }
        })
        .collect();
    if clients.is_empty() {
        return;
    }
    let mut next = 0usize;
    let mut last_ejected: Vec<String> = Vec::new();
    let mut last_queued = false;
    let mut last_sent = tokio::time::Instant::now();
    let mut ticker = tokio::time::interval(REPORT_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let mut decisions = Vec::new();
        while decisions.len() < MAX_PER_REPORT {
            match rx.try_recv() {
                Ok(decision) => decisions.push(decision),
                Err(_) => break,
            }
        }
        let ejected = ejected_nodes(&store);
        let dropped = log.dropped.swap(0, Ordering::Relaxed);
        let queued = queue.as_ref().map(|queue| queue.waiting(MAX_QUEUED_FLOWS)).unwrap_or_default();
        // Each report says what waits now: an empty one after a queue
        // emptied, then nothing until it fills again.
        let quiet =
            decisions.is_empty() && dropped == 0 && ejected == last_ejected && queued.is_empty() && !last_queued;
        if quiet && last_sent.elapsed() < KEEPALIVE_EVERY {
            continue;
        }
        let waiting = !queued.is_empty();
        let report = DataPlaneReport {
            dataplane_id: dataplane_id.clone(),
            decisions,
            ejected_nodes: ejected.clone(),
            dropped,
            queued,
        };
        let mut client = clients[next % clients.len()].clone();
        match tokio::time::timeout(SEND_TIMEOUT, client.report(report)).await {
            Ok(Ok(_)) => {
                last_ejected = ejected;
                last_queued = waiting;
                last_sent = tokio::time::Instant::now();
            }
            Ok(Err(status)) => {
                tracing::debug!(code = ?status.code(), "report refused; trying the next controller next time");
                next += 1;
            }
            Err(_) => {
                tracing::debug!("report timed out; trying the next controller next time");
                next += 1;
            }
        }
    }
}

fn ejected_nodes(store: &SnapshotStore) -> Vec<String> {
    let now = inferyes_proto::unix_ms();
    store
        .current()
        .map(|snapshot| {
            snapshot.nodes().iter().filter(|node| node.endpoint.ejected(now)).map(|node| node.id.to_string()).collect()
        })
        .unwrap_or_default()
}
