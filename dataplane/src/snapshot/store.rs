use std::sync::Arc;

use arc_swap::ArcSwapOption;
use tokio::sync::watch;

use super::{Counters, RoutingSnapshot};

/// The current snapshot behind one atomic pointer. Requests load it once
/// and route on that value; the subscription task is the only writer.
#[derive(Debug)]
pub struct SnapshotStore {
    current: ArcSwapOption<RoutingSnapshot>,
    versions: watch::Sender<u64>,
    counters: Counters,
}

impl Default for SnapshotStore {
    fn default() -> SnapshotStore {
        SnapshotStore { current: ArcSwapOption::empty(), versions: watch::channel(0).0, counters: Counters::default() }
    }
}

impl SnapshotStore {
    /// `None` until the first snapshot arrived: the data plane is not ready.
    pub fn current(&self) -> Option<Arc<RoutingSnapshot>> {
        self.current.load_full()
    }

    pub fn version(&self) -> Option<u64> {
        self.current.load().as_ref().map(|s| s.version())
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Installs `snapshot` unless it is older than the one held: after a
    /// move between controllers, the newer view wins.
    pub fn publish(&self, snapshot: RoutingSnapshot) -> bool {
        if self.version().is_some_and(|v| snapshot.version() < v) {
            return false;
        }
        let version = snapshot.version();
        self.current.store(Some(Arc::new(snapshot)));
        self.versions.send_replace(version);
        true
    }

    /// Versions as they are installed, for whoever must wait for one.
    pub fn versions(&self) -> watch::Receiver<u64> {
        self.versions.subscribe()
    }
}
