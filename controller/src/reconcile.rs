//! The single writer of the controller's view of the fleet: it reads the
//! etcd prefix, follows its watch, folds in the nodes' live state (from the
//! agent streams here and from peers), and publishes a new snapshot when
//! either changed. Everything else reads the published snapshots.

use inferyes_net::backoff::{Backoff, RECONNECT};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::fleet::FleetState;
use crate::live::{LiveBatch, LiveEvent, LiveState, LiveView};
use crate::snapshot::{self, Snapshot};
use crate::store::{EtcdStore, StoreError, WatchEvent};

/// `None` until the first full read of etcd succeeded.
pub type SnapshotTx = watch::Sender<Option<Arc<Snapshot>>>;
pub type SnapshotRx = watch::Receiver<Option<Arc<Snapshot>>>;
/// The live state as of the last batch, for this controller's own views:
/// apart from the snapshot, which changes only with etcd.
pub type LiveViewTx = watch::Sender<Arc<LiveView>>;
pub type LiveViewRx = watch::Receiver<Arc<LiveView>>;

/// Live changes (load, sessions) arrive all the time from every node: they
/// are gathered this long into one snapshot, well inside what a session's
/// next turn needs.
const LIVE_DEBOUNCE: Duration = Duration::from_millis(50);

/// The live state's batches, as the reconciler takes them: a receiver
/// that falls further behind than this many (10 s of them) gets the whole
/// state again.
pub type Batches = broadcast::Sender<Arc<LiveBatch>>;
pub const BATCHES_HELD: usize = 200;

/// What is asked of the live state beyond its batches.
pub enum LiveRequest {
    /// Every node's live state, for a new data plane, and the batch it is
    /// as of: later batches apply to it.
    Full(oneshot::Sender<(u64, Vec<inferyes_proto::v1::LiveNode>)>),
    /// This controller's own nodes, for a peer.
    Own(oneshot::Sender<(u64, inferyes_proto::v1::LiveUpdate)>),
    /// Resident sessions, most recent first, at most `limit`.
    Sessions {
        node_id: Option<String>,
        limit: usize,
        reply: oneshot::Sender<(Vec<inferyes_proto::v1::SessionInfo>, bool)>,
    },
}

/// What the reconciler reads from and publishes to.
pub struct Reconciler {
    pub store: EtcdStore,
    pub tx: SnapshotTx,
    pub live: mpsc::Receiver<LiveEvent>,
    pub requests: mpsc::Receiver<LiveRequest>,
    pub batches: Batches,
    pub views: LiveViewTx,
    /// Peers following this controller's nodes now: only then do batches
    /// carry those nodes' changes in the peers' form.
    pub peers_following: Arc<std::sync::atomic::AtomicUsize>,
    pub controller_id: String,
    pub debounce: Duration,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub shutdown: CancellationToken,
}

/// The state being reconciled: etcd's (once loaded) and the live state.
struct View {
    fleet: Option<FleetState>,
    live: LiveState,
    rebuild_at: Option<Instant>,
}

impl Reconciler {
    pub async fn run(mut self) {
        let mut view = View { fleet: None, live: LiveState::new(&self.controller_id), rebuild_at: None };
        let mut backoff = RECONNECT;
        loop {
            let store = self.store.clone();
            let Some(loaded) = self.meanwhile(&mut view, store.load()).await else { return };
            match loaded {
                Ok(batch) => view.fleet = Some(FleetState::from_load(batch)),
                Err(error) => {
                    tracing::warn!(%error, "fleet load failed; serving the last snapshot");
                    if self.wait(&mut view, &mut backoff).await {
                        return;
                    }
                    continue;
                }
            }
            backoff.reset();
            match self.follow(&mut view).await {
                Ok(()) => return,
                Err(error) => {
                    tracing::warn!(%error, "fleet watch lost; reloading");
                    if self.wait(&mut view, &mut backoff).await {
                        return;
                    }
                }
            }
        }
    }

    /// Follows the watch from the loaded state on. Returns on shutdown, or
    /// with an error when only a full reload can continue (compaction), or
    /// when the watch cannot be re-established from the last revision.
    async fn follow(&mut self, view: &mut View) -> Result<(), StoreError> {
        self.publish(view);
        let revision = view.fleet.as_ref().map_or(0, FleetState::revision);
        let store = self.store.clone();
        let Some(watch) = self.meanwhile(view, store.watch(revision + 1)).await else { return Ok(()) };
        let mut watch = watch?;
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => return Ok(()),
                batch = watch.next() => match batch {
                    Ok(batch) => {
                        for event in &batch.events {
                            if let WatchEvent::NodeDeleted(id) = event {
                                view.live.node_left(id);
                            }
                        }
                        if let Some(fleet) = view.fleet.as_mut() {
                            fleet.apply(batch);
                        }
                        view.rebuild_at.get_or_insert_with(|| Instant::now() + self.debounce);
                    }
                    Err(StoreError::Compacted(revision)) => return Err(StoreError::Compacted(revision)),
                    Err(error) => {
                        let revision = view.fleet.as_ref().map_or(0, FleetState::revision);
                        tracing::warn!(%error, revision, "fleet watch interrupted; resuming");
                        watch = self.resume(view, revision).await?;
                    }
                },
                Some(event) = self.live.recv() => self.live_event(view, event),
                Some(request) = self.requests.recv() => answer(view, request),
                () = sleep_until(view.rebuild_at) => self.publish(view),
            }
        }
    }

    fn live_event(&self, view: &mut View, event: LiveEvent) {
        view.live.apply(event);
        view.rebuild_at.get_or_insert_with(|| Instant::now() + LIVE_DEBOUNCE.max(self.debounce));
    }

    /// Re-establishes the watch from the last applied revision, retrying
    /// while etcd is away. Live changes are published meanwhile: routing
    /// goes on from the last etcd state and the nodes' current load.
    async fn resume(&mut self, view: &mut View, revision: u64) -> Result<crate::store::Watch, StoreError> {
        let mut backoff = RECONNECT;
        loop {
            let store = self.store.clone();
            let Some(watched) = self.meanwhile(view, store.watch(revision + 1)).await else {
                return Err(StoreError::WatchEnded);
            };
            match watched {
                Ok(watch) => return Ok(watch),
                Err(error) => {
                    tracing::debug!(%error, "fleet watch not yet re-established");
                    if self.wait(view, &mut backoff).await {
                        return Err(StoreError::WatchEnded);
                    }
                }
            }
        }
    }

    /// Waits out a jittered, growing backoff while etcd is away; true when
    /// shutdown came first.
    async fn wait(&mut self, view: &mut View, backoff: &mut Backoff) -> bool {
        let until = Instant::now() + backoff.next_wait();
        self.meanwhile(view, tokio::time::sleep_until(until)).await.is_none()
    }

    /// Awaits `etcd` (a load, a watch being set up, a backoff) while
    /// applying and publishing live changes, so that a slow or paused etcd
    /// never holds up the nodes' load and sessions; `None` when shutdown
    /// came first.
    async fn meanwhile<T>(&mut self, view: &mut View, etcd: impl Future<Output = T>) -> Option<T> {
        let mut etcd = std::pin::pin!(etcd);
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => return None,
                done = &mut etcd => return Some(done),
                Some(event) = self.live.recv() => self.live_event(view, event),
                Some(request) = self.requests.recv() => answer(view, request),
                () = sleep_until(view.rebuild_at) => self.publish(view),
            }
        }
    }

    /// Sends the live state's changes to whoever follows them, and the new
    /// snapshot to everyone.
    fn publish(&self, view: &mut View) {
        view.rebuild_at = None;
        let for_peers = self.peers_following.load(std::sync::atomic::Ordering::Relaxed) > 0;
        if let Some(batch) = view.live.take_batch(for_peers) {
            // None listening is fine: a follower that comes later asks for
            // the whole state.
            let _ = self.batches.send(Arc::new(batch));
            self.views.send_replace(Arc::new(view.live.view()));
        }
        let Some(fleet) = view.fleet.as_ref() else { return };
        let metrics = &self.metrics;
        self.tx.send_if_modified(|current| {
            let started = std::time::Instant::now();
            let next = snapshot::build(fleet, current.as_deref());
            metrics.snapshot_build_seconds.observe(started.elapsed().as_secs_f64());
            if current.as_deref() == Some(&next) {
                return false;
            }
            tracing::debug!(version = next.version(), nodes = next.nodes().count(), "snapshot published");
            *current = Some(Arc::new(next));
            true
        });
    }
}

fn answer(view: &View, request: LiveRequest) {
    // A requester that went away meanwhile is no one's concern.
    match request {
        LiveRequest::Full(reply) => {
            let _ = reply.send((view.live.seq(), view.live.full()));
        }
        LiveRequest::Own(reply) => {
            let _ = reply.send((view.live.seq(), view.live.full_own()));
        }
        LiveRequest::Sessions { node_id, limit, reply } => {
            let _ = reply.send(view.live.list(node_id.as_deref(), limit));
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
