//! The single writer of the controller's view of the fleet: it reads the
//! etcd prefix, follows its watch, and publishes a new snapshot when the
//! state changed. Everything else reads the published snapshots.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::fleet::FleetState;
use crate::snapshot::{self, Snapshot};
use crate::store::{EtcdStore, StoreError};

/// `None` until the first full read of etcd succeeded.
pub type SnapshotTx = watch::Sender<Option<Arc<Snapshot>>>;
pub type SnapshotRx = watch::Receiver<Option<Arc<Snapshot>>>;

const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);

pub async fn run(
    store: EtcdStore,
    tx: SnapshotTx,
    debounce: Duration,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    shutdown: CancellationToken,
) {
    let mut backoff = RETRY_MIN;
    loop {
        let state = match store.load().await {
            Ok(batch) => FleetState::from_load(batch),
            Err(error) => {
                tracing::warn!(%error, "fleet load failed; serving the last snapshot");
                if sleep_or_shutdown(&mut backoff, &shutdown).await {
                    return;
                }
                continue;
            }
        };
        backoff = RETRY_MIN;
        match follow(&store, state, &tx, debounce, &metrics, &shutdown).await {
            Ok(()) => return,
            Err(error) => {
                tracing::warn!(%error, "fleet watch lost; reloading");
                if sleep_or_shutdown(&mut backoff, &shutdown).await {
                    return;
                }
            }
        }
    }
}

/// Follows the watch from the loaded state on. Returns on shutdown, or with
/// an error when only a full reload can continue (compaction), or when the
/// watch cannot be re-established from the last revision.
async fn follow(
    store: &EtcdStore,
    mut state: FleetState,
    tx: &SnapshotTx,
    debounce: Duration,
    metrics: &crate::metrics::Metrics,
    shutdown: &CancellationToken,
) -> Result<(), StoreError> {
    publish(tx, &state, metrics);
    let mut watch = store.watch(state.revision() + 1).await?;
    let mut rebuild_at: Option<Instant> = None;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            batch = watch.next() => {
                match batch {
                    Ok(batch) => {
                        state.apply(batch);
                        rebuild_at.get_or_insert_with(|| Instant::now() + debounce);
                    }
                    Err(StoreError::Compacted(revision)) => return Err(StoreError::Compacted(revision)),
                    Err(error) => {
                        tracing::warn!(%error, revision = state.revision(), "fleet watch interrupted; resuming");
                        if rebuild_at.take().is_some() {
                            publish(tx, &state, metrics);
                        }
                        watch = resume(store, &state, shutdown).await?;
                    }
                }
            }
            () = sleep_until(rebuild_at) => {
                rebuild_at = None;
                publish(tx, &state, metrics);
            }
        }
    }
}

/// Re-establishes the watch from the last applied revision, retrying while
/// etcd is away. Routing goes on from the last snapshot meanwhile.
async fn resume(
    store: &EtcdStore,
    state: &FleetState,
    shutdown: &CancellationToken,
) -> Result<crate::store::Watch, StoreError> {
    let mut backoff = RETRY_MIN;
    loop {
        match store.watch(state.revision() + 1).await {
            Ok(watch) => return Ok(watch),
            Err(error) => {
                tracing::debug!(%error, "fleet watch not yet re-established");
                if sleep_or_shutdown(&mut backoff, shutdown).await {
                    return Err(StoreError::WatchEnded);
                }
            }
        }
    }
}

fn publish(tx: &SnapshotTx, state: &FleetState, metrics: &crate::metrics::Metrics) {
    tx.send_if_modified(|current| {
        let started = std::time::Instant::now();
        let next = snapshot::build(state, current.as_deref());
        metrics.snapshot_build_seconds.observe(started.elapsed().as_secs_f64());
        if current.as_deref() == Some(&next) {
            return false;
        }
        tracing::debug!(version = next.version(), nodes = next.nodes().count(), "snapshot published");
        *current = Some(Arc::new(next));
        true
    });
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Sleeps with jittered exponential backoff; true when shutdown came first.
pub(crate) async fn sleep_or_shutdown(backoff: &mut Duration, shutdown: &CancellationToken) -> bool {
    let jittered = backoff.mul_f64(0.5 + fastrand::f64());
    *backoff = (*backoff * 2).min(RETRY_MAX);
    tokio::select! {
        () = shutdown.cancelled() => true,
        () = tokio::time::sleep(jittered) => false,
    }
}
