use std::sync::Arc;

use arc_swap::ArcSwapOption;
use tokio::sync::watch;

use super::RoutingSnapshot;
use crate::targets::NodeStates;

/// The current snapshot behind one atomic pointer. Requests load it once
/// and route on that value; the subscription task is the only writer.
#[derive(Debug)]
pub struct SnapshotStore {
    current: ArcSwapOption<RoutingSnapshot>,
    versions: watch::Sender<u64>,
    /// This data plane's state of each node, which outlives snapshots.
    states: NodeStates,
    /// Where sessions are resident, kept across snapshots and controllers.
    sessions: Arc<super::SessionIndex>,
    /// When the current snapshot was installed (read at scrape time only).
    installed_at: std::sync::Mutex<Option<std::time::Instant>>,
}

impl Default for SnapshotStore {
    fn default() -> SnapshotStore {
        SnapshotStore {
            current: ArcSwapOption::empty(),
            versions: watch::channel(0).0,
            states: NodeStates::default(),
            sessions: Arc::default(),
            installed_at: std::sync::Mutex::new(None),
        }
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

    pub fn node_states(&self) -> &NodeStates {
        &self.states
    }

    pub fn sessions(&self) -> &Arc<super::SessionIndex> {
        &self.sessions
    }

    /// Installs `snapshot` unless it is older than the one held: after a
    /// move between controllers, the newer view wins.
    pub fn publish(&self, snapshot: RoutingSnapshot) -> bool {
        if self.version().is_some_and(|v| snapshot.version() < v) {
            return false;
        }
        let version = snapshot.version();
        self.current.store(Some(Arc::new(snapshot)));
        if let Ok(mut at) = self.installed_at.lock() {
            *at = Some(std::time::Instant::now());
        }
        self.versions.send_replace(version);
        true
    }

    /// Seconds since the current snapshot was installed.
    pub fn age_seconds(&self) -> f64 {
        self.installed_at.lock().ok().and_then(|at| *at).map_or(0.0, |at| at.elapsed().as_secs_f64())
    }

    /// Versions as they are installed, for whoever must wait for one.
    pub fn versions(&self) -> watch::Receiver<u64> {
        self.versions.subscribe()
    }
}
