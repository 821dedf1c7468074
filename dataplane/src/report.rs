//! Tells every controller what this data plane did lately: its routing
//! decisions and the nodes it holds ejected, for the fleet dashboard; and
//! what the keys asked of it, for which the answer brings back this data
//! plane's parts of their fleet-wide limits ([`crate::allowance`]); and
//! what each flow held of it, for its parts of the busy models' slots
//! ([`crate::slot_shares`]).
//!
//! Decisions are best effort by design. The request path only offers a
//! decision to a bounded queue (never waits, never allocates a connection);
//! a full queue or an unreachable controller loses lines of a tail, and the
//! next report says how many. A report goes out every second, quiet or not:
//! a controller counts the data planes it splits limits among by them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use inferyes_proto::v1::{DataPlaneReport, ReportAck, RoutingDecision};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::SnapshotStore;

/// How often reports go out.
const REPORT_EVERY: Duration = Duration::from_secs(1);
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

/// What the report loop reads and where it sends.
pub struct Reporter {
    pub log: Arc<DecisionLog>,
    pub decisions: mpsc::Receiver<RoutingDecision>,
    pub snapshots: Arc<SnapshotStore>,
    pub queue: Option<Arc<crate::queue::Queue>>,
    pub allowances: Arc<crate::allowance::Allowances>,
    pub slot_shares: Arc<crate::slot_shares::SlotShares>,
    pub shares: Arc<crate::shares::Shares>,
    pub ledger: Arc<crate::usage::Ledger>,
    pub controllers: crate::Controllers,
    pub dataplane_id: String,
    /// Cancelled once no request runs any more and the usage of the last
    /// has been sent: until then, what requests hold of the keys' limits,
    /// and what they used until the roll-up shows it, must be reported, or
    /// the controllers give it to the other data planes.
    pub done: CancellationToken,
}

impl Reporter {
    pub async fn run(mut self) {
        let clients: Vec<crate::RoutingClient> = self
            .controllers
            .addresses
            .iter()
            .filter_map(|address| match self.controllers.endpoint(address) {
                Ok(endpoint) => Some(
                    self.controllers.client(endpoint.connect_timeout(SEND_TIMEOUT).tcp_nodelay(true).connect_lazy()),
                ),
                Err(error) => {
                    tracing::warn!(controller = %address, error = format!("{error:#}"), "not reporting to this controller");
                    None
                }
            })
            .collect();
        if clients.is_empty() {
            return;
        }
        self.allowances.expect(clients.len());
        let instance = fastrand::u64(..);
        let mut sequence = 0u64;
        let mut ticker = tokio::time::interval(REPORT_EVERY);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // One report at a time to each controller; one slow to answer
        // misses rounds, the others do not wait for it.
        // Each report's controller, and when it went out.
        let mut sending: std::collections::HashMap<tokio::task::Id, (usize, std::time::Instant)> =
            std::collections::HashMap::new();
        let mut sends: tokio::task::JoinSet<Result<Result<ReportAck, tonic::Status>, _>> = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                () = self.done.cancelled() => return,
                _ = ticker.tick() => {}
                Some(sent) = sends.join_next_with_id() => {
                    let (id, answer) = match sent {
                        Ok((id, answer)) => (id, Some(answer)),
                        Err(error) => (error.id(), None),
                    };
                    let Some((from, asked)) = sending.remove(&id) else { continue };
                    match answer {
                        Some(Ok(Ok(answer))) => {
                            let now = std::time::Instant::now();
                            self.allowances.take(from, answer.allowances, asked, now);
                            self.slot_shares.take(from, answer.flow_parts, now);
                            // A flow held back may start now.
                            if let Some(queue) = &self.queue {
                                queue.nudge();
                            }
                        }
                        Some(Ok(Err(status))) => tracing::debug!(code = ?status.code(), from, "report refused"),
                        Some(Err(_)) => tracing::debug!(from, "report timed out"),
                        None => tracing::warn!(from, "a report's send failed"),
                    }
                    continue;
                }
            }
            if sending.len() == clients.len() {
                // What was asked waits for the next report that goes out.
                continue;
            }
            sequence += 1;
            let report = DataPlaneReport { instance, sequence, ..self.report() };
            for (from, client) in clients.iter().enumerate() {
                if sending.values().any(|(busy, _)| *busy == from) {
                    continue;
                }
                let mut client = client.clone();
                let report = DataPlaneReport { held: self.allowances.held(from), ..report.clone() };
                let task = sends.spawn(async move {
                    tokio::time::timeout(SEND_TIMEOUT, client.report(report))
                        .await
                        .map(|answer| answer.map(tonic::Response::into_inner))
                });
                sending.insert(task.id(), (from, std::time::Instant::now()));
            }
        }
    }

    /// What happened since the last report. What the keys asked is told
    /// once, whether or not the report arrives: a lost report only makes
    /// the next split a little late.
    fn report(&mut self) -> DataPlaneReport {
        let mut decisions = Vec::new();
        while decisions.len() < MAX_PER_REPORT {
            match self.decisions.try_recv() {
                Ok(decision) => decisions.push(decision),
                Err(_) => break,
            }
        }
        DataPlaneReport {
            dataplane_id: self.dataplane_id.clone(),
            decisions,
            ejected_nodes: ejected_nodes(&self.snapshots),
            dropped: self.log.dropped.swap(0, Ordering::Relaxed),
            queued: self.queue.as_ref().map(|queue| queue.waiting(MAX_QUEUED_FLOWS)).unwrap_or_default(),
            demand: self.allowances.demand(&self.limited_in_flight(), &self.budgets_held()),
            flows: self.slot_shares.loads(),
            ..DataPlaneReport::default()
        }
    }

    /// The keys with a limit of requests in flight that hold any here.
    fn limited_in_flight(&self) -> Vec<(String, u32)> {
        let Some(snapshot) = self.snapshots.current() else { return Vec::new() };
        let mut in_flight = self.shares.keys_in_flight();
        in_flight.retain(|(key_id, _)| snapshot.api_key(key_id).is_some_and(|key| key.max_concurrent > 0));
        in_flight
    }

    /// What the keys with daily budgets hold of them here.
    fn budgets_held(&self) -> Vec<crate::usage::Holding> {
        let Some(snapshot) = self.snapshots.current() else { return Vec::new() };
        let forget_before = self.allowances.forget_acknowledged_before(std::time::Instant::now());
        let part = |key_id: &str| {
            let key = snapshot.api_key(key_id).filter(|key| key.tokens_per_day > 0)?;
            Some(self.allowances.budget(key, snapshot.tokens_today(key_id) > 0))
        };
        self.ledger.holdings(part, forget_before)
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
