use std::pin::Pin;
use std::sync::Arc;

use inferyes_proto::v1::routing_service_server::{RoutingService, RoutingServiceServer};
use inferyes_proto::v1::{
    Allowances, DataPlaneReport, FlowParts, FollowLiveRequest, LiveUpdate, ReportAck, SnapshotUpdate, SubscribeRequest,
    UsageAck, UsageBatch, snapshot_update,
};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::reconcile::{LiveRequest, SnapshotRx};
use crate::snapshot::{self, Snapshot};

/// Streams routing snapshots to data planes: one full snapshot, then a delta
/// per published change. Slow subscribers skip intermediate snapshots: each
/// delta is computed against what that subscriber last received.
#[derive(Clone)]
pub struct RoutingSvc {
    pub snapshots: SnapshotRx,
    pub controller_id: String,
    pub shutdown: CancellationToken,
    /// Subscribers get their first snapshot no earlier than this: after an
    /// outage of every controller, node leases may have run out, and the
    /// fleet in etcd is complete again only once the agents re-registered.
    /// Meanwhile data planes keep routing on what they hold.
    pub serve_after: tokio::time::Instant,
    pub activity: Arc<crate::activity::Activity>,
    /// What the data planes reporting here asked of the keys' fleet-wide
    /// limits, and so each one's parts.
    pub allowances: Arc<std::sync::Mutex<crate::allowances::Books>>,
    /// What each flow held of the data planes reporting here, and so each
    /// one's parts of the busy models' slots.
    pub slot_shares: Arc<std::sync::Mutex<crate::slot_shares::Loads>>,
    pub store: crate::store::EtcdStore,
    /// The data planes' tokens, presented with every call: snapshots carry
    /// the keys' hashes and the fleet's sessions, and usage written here is
    /// billed. Not the agents' join token, unless the fleet has one token
    /// for both. `None`: open.
    pub dataplane_tokens: Option<inferyes_proto::bearer::Accepted>,
    /// What every snapshot carries for data planes to send agents, HMACs
    /// of the join token, never the token itself: the key each node's
    /// credential is derived from, and the fleet-wide credential of agents
    /// from before credentials were per node. Empty: agents take requests
    /// without one.
    pub proxy_key: String,
    pub proxy_credential: String,
    /// What derives the credentials controllers issue nodes; `None`: no
    /// join token, so none issued.
    pub fleet_secret: Option<Arc<crate::store::FleetSecret>>,
    /// What peers following this controller's live state present, one per
    /// join token taken (`inferyes_proto::bearer::peer_credential`);
    /// `None`: no join token, so none asked.
    pub peer_credentials: Option<inferyes_proto::bearer::Accepted>,
    /// The live state's batches, and the way to ask for all of it.
    pub batches: crate::reconcile::Batches,
    pub live_requests: mpsc::Sender<LiveRequest>,
    /// How many peers `feed_live` serves now (the reconciler reads it).
    pub peers_following: Arc<std::sync::atomic::AtomicUsize>,
    pub metrics: Arc<crate::metrics::Metrics>,
}

/// Counts a peer as following while it lives.
struct Following(Arc<std::sync::atomic::AtomicUsize>);

impl Following {
    fn new(count: &Arc<std::sync::atomic::AtomicUsize>) -> Following {
        count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Following(Arc::clone(count))
    }
}

impl Drop for Following {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl RoutingSvc {
    pub fn svc(self) -> RoutingServiceServer<Self> {
        RoutingServiceServer::new(self)
    }

    /// Refuses a call without a data plane token (when one is set).
    fn member<T>(&self, request: &Request<T>) -> Result<(), Status> {
        inferyes_proto::bearer::check_call(request, self.dataplane_tokens.as_ref()).map_err(|refusal| match refusal {
            inferyes_proto::bearer::Refusal::Missing => Status::unauthenticated(
                "data planes present the fleet's data plane token (dataplane_token_file or INFERYES_DATAPLANE_TOKEN)",
            ),
            inferyes_proto::bearer::Refusal::Wrong => {
                Status::permission_denied("the token is not a data plane token of this fleet")
            }
        })
    }

    /// Takes what a data plane's keys asked of it and what it holds, and
    /// gives its parts of their limits back, and whether the report was
    /// taken. A data plane whose report is refused (a twin, one past the
    /// data planes followed) is given nothing. Without a snapshot, or for
    /// a report older than one taken, the answer is an error: the data
    /// plane keeps what it holds of this controller's split, which stops
    /// counting once another answers.
    fn allowances_for(&self, report: &DataPlaneReport) -> Result<(Allowances, bool), Status> {
        let Some(snapshot) = self.snapshots.borrow().clone() else {
            return Err(Status::unavailable("this controller has not loaded the fleet from etcd yet"));
        };
        // What the roll-up shows spent today: nothing where it counts
        // another day.
        let usage = snapshot.usage_today();
        let today = (usage.day == inferyes_proto::usage::hour_of(inferyes_proto::unix_ms())[..8]).then_some(usage);
        let limits = |key_id: &str| {
            snapshot.api_key(key_id).map(|key| crate::allowances::Limits {
                requests_per_minute: key.requests_per_minute,
                max_concurrent: key.max_concurrent,
                tokens: (key.tokens_per_day > 0).then(|| {
                    let spent = today.and_then(|today| today.tokens.get(key_id)).copied().unwrap_or(0);
                    crate::allowances::Budget {
                        per_day: key.tokens_per_day,
                        left: key.tokens_per_day.saturating_sub(spent),
                    }
                }),
            })
        };
        // Keys with budgets spent of today: their parts are listed.
        let spent = today
            .into_iter()
            .flat_map(|today| today.tokens.keys())
            .filter(|key_id| snapshot.api_key(key_id).is_some_and(|key| key.tokens_per_day > 0))
            .map(String::as_str);
        let now = std::time::Instant::now();
        let taken = crate::allowances::Report {
            dataplane: &report.dataplane_id,
            instance: report.instance,
            sequence: report.sequence,
            demand: &report.demand,
            held: report.held.as_ref(),
        };
        let mut books = self.allowances.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match books.report(&taken, limits, now) {
            Ok(()) => Ok((
                books.allowances(&report.dataplane_id, limits, spent, now).unwrap_or_else(crate::allowances::nothing),
                true,
            )),
            Err(crate::allowances::Refused::Stale) => {
                Err(Status::aborted("a later report of this data plane was taken, or one came too soon after it"))
            }
            Err(refused) => {
                tracing::warn!(?refused, dataplane = %report.dataplane_id, "a data plane's report gets no parts of the keys' limits");
                Ok((crate::allowances::nothing(), false))
            }
        }
    }
}

impl RoutingSvc {
    /// Takes what each flow held of a data plane and gives its parts of the
    /// busy models' slots back; `None` before the fleet is loaded.
    fn flow_parts_for(&self, report: &DataPlaneReport) -> Option<FlowParts> {
        let snapshot = self.snapshots.borrow().clone()?;
        let now = std::time::Instant::now();
        let mut loads = self.slot_shares.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        loads.report(&report.dataplane_id, &report.flows, now);
        let turn = crate::slot_shares::turn_at(inferyes_proto::unix_ms());
        Some(loads.parts(&report.dataplane_id, |model| model_slots(&snapshot, model), now, turn))
    }
}

/// The slots of the backends that hold `model` loaded, fleet-wide; 0
/// (unknown) where one of them does not say how many it has.
fn model_slots(snapshot: &Snapshot, model: &str) -> u32 {
    let mut slots = 0u32;
    let backends = snapshot.nodes().filter_map(|node| node.status.as_ref()).flat_map(|status| &status.backends);
    for backend in backends {
        let holds =
            |m: &inferyes_proto::v1::Model| m.id == model && m.state() == inferyes_proto::v1::ModelState::Loaded;
        if !backend.models.iter().any(holds) {
            continue;
        }
        if backend.slots_total == 0 {
            return 0;
        }
        slots = slots.saturating_add(backend.slots_total);
    }
    slots
}

/// Keeps one batch well inside etcd's request size limit (1.5 MiB).
const MAX_RECORDS_PER_BATCH: usize = 2000;
const MAX_DELTAS_PER_BATCH: usize = 100;

type UpdateStream = Pin<Box<dyn Stream<Item = Result<SnapshotUpdate, Status>> + Send>>;
type LiveStream = Pin<Box<dyn Stream<Item = Result<LiveUpdate, Status>> + Send>>;

#[tonic::async_trait]
impl RoutingService for RoutingSvc {
    type SubscribeStream = UpdateStream;
    type FollowLiveStream = LiveStream;

    async fn follow_live(&self, request: Request<FollowLiveRequest>) -> Result<Response<LiveStream>, Status> {
        self.member(&request)?;
        // Raw session keys of every tenant: a controller's, not a data
        // plane's to read.
        if let Some(credentials) = &self.peer_credentials {
            let presented = request.metadata().get(inferyes_proto::bearer::PEER_CREDENTIAL);
            if !presented.is_some_and(|presented| credentials.accepts(presented.as_bytes())) {
                return Err(Status::permission_denied(
                    "following a controller's live state takes a controller's credential (made from the join token)",
                ));
            }
        }
        let peer = request.into_inner().controller_id;
        // Only a controller of this fleet, as its record in etcd says.
        let registered = self
            .snapshots
            .borrow()
            .as_ref()
            .is_some_and(|s| s.controllers().any(|c| c.controller_id == peer) && peer != self.controller_id);
        if !registered {
            return Err(Status::permission_denied(format!(
                "`{peer}` is not another controller of this fleet (controllers/ in etcd)"
            )));
        }
        let (tx, rx) = mpsc::channel(4);
        let span = tracing::info_span!("peer", %peer);
        tokio::spawn(self.clone().feed_live(tx).instrument(span));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn subscribe(&self, request: Request<SubscribeRequest>) -> Result<Response<UpdateStream>, Status> {
        self.member(&request)?;
        let dataplane = request.into_inner().dataplane_id;
        let (tx, rx) = mpsc::channel(4);
        let span = tracing::info_span!("subscriber", %dataplane);
        tokio::spawn(self.clone().feed(tx).instrument(span));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn report(&self, request: Request<DataPlaneReport>) -> Result<Response<ReportAck>, Status> {
        self.member(&request)?;
        let report = request.into_inner();
        if report.dataplane_id.is_empty() {
            return Err(Status::invalid_argument("a report needs the data plane's id"));
        }
        let allowances = self.allowances_for(&report);
        // A twin's report, or one past the data planes followed, would
        // stand for another data plane's loads.
        let flow_parts = match &allowances {
            Ok((_, true)) => self.flow_parts_for(&report),
            _ => None,
        };
        self.activity.record(report, tokio::time::Instant::now());
        Ok(Response::new(ReportAck { allowances: Some(allowances?.0), flow_parts }))
    }

    async fn record_usage(&self, request: Request<UsageBatch>) -> Result<Response<UsageAck>, Status> {
        self.member(&request)?;
        let batch = request.into_inner();
        let id_ok = !batch.batch_id.is_empty()
            && batch.batch_id.len() <= 256
            && batch.batch_id.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        if !id_ok {
            return Err(Status::invalid_argument("batch_id must be 1-256 characters of [A-Za-z0-9._-]"));
        }
        crate::ledger::check_batch(&batch, inferyes_proto::unix_ms()).map_err(Status::invalid_argument)?;
        if batch.records.len() > MAX_RECORDS_PER_BATCH {
            return Err(Status::invalid_argument(format!("at most {MAX_RECORDS_PER_BATCH} records per batch")));
        }
        // Each delta is one roll-up write in the transaction that applies
        // the batch; etcd allows 128 operations in one.
        if batch.deltas.len() > MAX_DELTAS_PER_BATCH
            || (batch.deltas.is_empty() && crate::ledger::rollup_deltas(&batch).len() > MAX_DELTAS_PER_BATCH)
        {
            return Err(Status::invalid_argument(format!(
                "at most {MAX_DELTAS_PER_BATCH} distinct hours, keys and models per batch"
            )));
        }
        // Acknowledged only once it is in etcd: from then on it is counted
        // exactly once. A resend of a batch already here is acknowledged
        // without being stored again.
        let new = self.store.put_usage_batch(&batch).await?;
        tracing::debug!(batch = %batch.batch_id, records = batch.records.len(), new, "usage batch received");
        Ok(Response::new(UsageAck {}))
    }
}

impl RoutingSvc {
    /// Relays the live state of the nodes whose agents this controller
    /// serves: all of it first, then each batch's changes to them.
    async fn feed_live(self, tx: mpsc::Sender<Result<LiveUpdate, Status>>) {
        // Counted before the whole state is asked for: every batch after it
        // carries this controller's changes for peers.
        let _following = Following::new(&self.peers_following);
        let mut batches = self.batches.subscribe();
        let Some((mut seq, full)) = self.ask(LiveRequest::Own).await else { return };
        if tx.send(Ok(full)).await.is_err() {
            return;
        }
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => return,
                () = tx.closed() => return,
                batch = batches.recv() => match batch {
                    Ok(batch) if batch.seq > seq => {
                        seq = batch.seq;
                        if (!batch.own.nodes.is_empty() || !batch.own.gone.is_empty())
                            && tx.send(Ok(batch.own.clone())).await.is_err()
                        {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(missed)) => {
                        tracing::warn!(missed, "peer behind the live batches; sending it all again");
                        self.metrics.live_resyncs.inc();
                        batches = batches.resubscribe();
                        let Some((now, full)) = self.ask(LiveRequest::Own).await else { return };
                        seq = now;
                        if tx.send(Ok(full)).await.is_err() {
                            return;
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                },
            }
        }
    }

    /// Asks the reconciler for something of the live state; `None` once it
    /// is gone (shutdown).
    async fn ask<T>(&self, request: impl FnOnce(tokio::sync::oneshot::Sender<T>) -> LiveRequest) -> Option<T> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.live_requests.send(request(reply)).await.ok()?;
        answer.await.ok()
    }

    /// A full snapshot with the whole live state, then a delta per change
    /// of the records (against what this subscriber last received) and the
    /// live state's batches as they come. A subscriber that falls behind
    /// the batches gets a full snapshot again.
    async fn feed(self, tx: mpsc::Sender<Result<SnapshotUpdate, Status>>) {
        tokio::select! {
            () = self.shutdown.cancelled() => return,
            () = tx.closed() => return,
            () = tokio::time::sleep_until(self.serve_after) => {}
        }
        let mut snapshots = self.snapshots.clone();
        let mut batches = self.batches.subscribe();
        let mut sent: Option<Arc<Snapshot>> = None;
        let mut seq = 0;
        loop {
            let current = snapshots.borrow_and_update().clone();
            if let Some(current) = current {
                let update = match &sent {
                    // The first, after a lag, or after a reload from a
                    // lagging etcd member: start over.
                    None => Some(self.full(&current, &mut seq, &mut batches).await),
                    Some(last) if current.version() < last.version() => {
                        Some(self.full(&current, &mut seq, &mut batches).await)
                    }
                    Some(last) if Arc::ptr_eq(last, &current) || **last == *current => None,
                    Some(last) => Some(Some(snapshot_update::Update::Delta(snapshot::delta(last, &current)))),
                };
                match update {
                    Some(Some(update)) => {
                        let message =
                            SnapshotUpdate { controller_id: self.controller_id.clone(), update: Some(update) };
                        if tx.send(Ok(message)).await.is_err() {
                            return;
                        }
                        sent = Some(current);
                    }
                    Some(None) => return,
                    None => {}
                }
            }
            tokio::select! {
                () = self.shutdown.cancelled() => return,
                () = tx.closed() => return,
                changed = snapshots.changed() => if changed.is_err() { return },
                batch = batches.recv(), if sent.is_some() => match batch {
                    Ok(batch) if batch.seq > seq => {
                        seq = batch.seq;
                        let message = SnapshotUpdate {
                            controller_id: self.controller_id.clone(),
                            update: Some(snapshot_update::Update::Live(batch.delta.clone())),
                        };
                        if tx.send(Ok(message)).await.is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(missed)) => {
                        tracing::warn!(missed, "subscriber behind the live batches; sending it all again");
                        self.metrics.live_resyncs.inc();
                        sent = None;
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                },
            }
        }
    }

    /// A full snapshot of `current` with the whole live state; `None` once
    /// the reconciler is gone.
    async fn full(
        &self,
        current: &Snapshot,
        seq: &mut u64,
        batches: &mut tokio::sync::broadcast::Receiver<Arc<crate::live::LiveBatch>>,
    ) -> Option<snapshot_update::Update> {
        // Subscribed before asking: every batch after the state returned
        // arrives on it.
        *batches = batches.resubscribe();
        let (now, live) = self.ask(LiveRequest::Full).await?;
        *seq = now;
        let mut full = current.to_full();
        full.live = live;
        full.proxy_credential.clone_from(&self.proxy_credential);
        full.proxy_key.clone_from(&self.proxy_key);
        if let Some(secret) = &self.fleet_secret {
            // Without it, no node that took its credential from a controller
            // is reachable: the stream ends, and the data plane comes again.
            match secret.get().await {
                Ok(key) => full.node_key = key.node_key(),
                Err(error) => {
                    tracing::warn!(%error, "the fleet key is unread; a data plane is sent no snapshot");
                    return None;
                }
            }
        }
        Some(snapshot_update::Update::Full(full))
    }
}
