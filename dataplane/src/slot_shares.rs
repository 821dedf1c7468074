//! This data plane's parts of the fleet's busy models' slots, flow by flow
//! (`inferyes_controller::slot_shares` says how they are split), and what
//! each keyed flow held of it since the last report, which the report loop
//! carries to every controller.
//!
//! A request holds its flow's [`Hold`] from the moment its model is known
//! until its answer is written out; the hold counts it running once it is
//! sent to a node. The queue lets a flow's request out only while the
//! flow has fewer running than its part; a request that could start at
//! once waits in the queue instead. A flow and model no controller lists
//! is not held back, and parts not renewed for [`STALE_AFTER`] lapse:
//! fairness among data planes needs a controller, serving does not.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use inferyes_proto::FastMap;
use inferyes_proto::v1::{FlowLoad, FlowParts};

/// Parts older than this lapse. Reports go out every second.
pub const STALE_AFTER: Duration = Duration::from_secs(3);
/// Flows and models one report names at most, the largest first.
pub const MAX_LOADS: usize = 256;

/// A flow and model, by [`inferyes_proto::fast_digest`] of their names:
/// a request finds its count without copying them.
type FlowModel = u64;

fn flow_model(flow: &str, model: &str) -> FlowModel {
    inferyes_proto::fast_digest(&(flow, model))
}

#[derive(Default)]
pub struct SlotShares {
    inner: Mutex<Inner>,
    /// Told when a running request ends: its flow's next may start.
    freed: Arc<crate::targets::Freed>,
}

#[derive(Default)]
struct Inner {
    counts: FastMap<FlowModel, Count>,
    /// Each controller's last parts, by its place in the data plane's list.
    heard: Vec<Option<(Instant, FastMap<FlowModel, u32>)>>,
}

#[derive(Default)]
struct Count {
    flow: String,
    model: String,
    weight: u32,
    held: u32,
    running: u32,
    /// The most held at once since the last report.
    peak: u32,
}

/// One request's place in its flow's count for its model.
pub struct Hold {
    shares: Arc<SlotShares>,
    key: FlowModel,
    running: AtomicBool,
}

impl SlotShares {
    /// `freed` wakes the queue, as a node's slot freed does.
    pub fn new(freed: Arc<crate::targets::Freed>) -> Arc<SlotShares> {
        Arc::new(SlotShares { inner: Mutex::default(), freed })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a request of `flow` (of `weight`) for `model` held here.
    pub fn hold(self: &Arc<Self>, flow: &str, model: &str, weight: u32) -> Hold {
        let key = flow_model(flow, model);
        let mut inner = self.lock();
        let count = inner.counts.entry(key).or_insert_with(|| Count {
            flow: flow.to_string(),
            model: model.to_string(),
            ..Count::default()
        });
        count.weight = weight;
        count.held += 1;
        count.peak = count.peak.max(count.held);
        Hold { shares: Arc::clone(self), key, running: AtomicBool::new(false) }
    }

    /// Takes a controller's answer: its parts, or none where it splits no
    /// slots.
    pub fn take(&self, from: usize, parts: Option<FlowParts>, now: Instant) {
        let mut inner = self.lock();
        if inner.heard.len() <= from {
            inner.heard.resize_with(from + 1, || None);
        }
        inner.heard[from] = parts.map(|parts| {
            let parts =
                parts.parts.into_iter().take(MAX_LOADS).map(|p| (flow_model(&p.flow, &p.model), p.slots)).collect();
            (now, parts)
        });
    }

    /// What each flow held since the last report, the largest first; the
    /// peaks start again from what is held now.
    pub fn loads(&self) -> Vec<FlowLoad> {
        let mut inner = self.lock();
        inner.counts.retain(|_, count| count.held > 0 || count.peak > 0);
        let mut loads: Vec<FlowLoad> = inner
            .counts
            .values_mut()
            .map(|count| {
                let load = FlowLoad {
                    flow: count.flow.clone(),
                    model: count.model.clone(),
                    weight: count.weight,
                    demand: count.peak,
                };
                count.peak = count.held;
                load
            })
            .filter(|load| load.demand > 0)
            .collect();
        loads.sort_unstable_by(|a, b| b.demand.cmp(&a.demand).then_with(|| a.flow.cmp(&b.flow)));
        loads.truncate(MAX_LOADS);
        loads
    }

    /// The least part any controller heard within [`STALE_AFTER`] gives
    /// `key`; `None`: not held back.
    fn part(inner: &Inner, key: &FlowModel, now: Instant) -> Option<u32> {
        inner
            .heard
            .iter()
            .flatten()
            .filter(|(at, _)| now.saturating_duration_since(*at) < STALE_AFTER)
            .filter_map(|(_, parts)| parts.get(key).copied())
            .min()
    }
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hold").field("running", &self.running).finish_non_exhaustive()
    }
}

impl Hold {
    /// Whether its flow may have one more request running for its model
    /// here now.
    pub fn may_start(&self, now: Instant) -> bool {
        let inner = self.shares.lock();
        let running = inner.counts.get(&self.key).map_or(0, |count| count.running);
        SlotShares::part(&inner, &self.key, now).is_none_or(|part| running < part)
    }

    /// Counts it running, where its flow may have one more running for
    /// its model here now: checked and counted in one step, so that two
    /// requests starting at once do not both take the part's last place.
    /// True where it runs already.
    pub fn try_start(&self, now: Instant) -> bool {
        if self.running.load(Ordering::Relaxed) {
            return true;
        }
        let mut inner = self.shares.lock();
        let part = SlotShares::part(&inner, &self.key, now);
        let Some(count) = inner.counts.get_mut(&self.key) else { return true };
        if part.is_some_and(|part| count.running >= part) {
            return false;
        }
        count.running += 1;
        self.running.store(true, Ordering::Relaxed);
        true
    }

    /// Counts it no longer running: the slot it was to take was taken.
    pub fn unstart(&self) {
        if self.running.swap(false, Ordering::Relaxed) {
            let mut inner = self.shares.lock();
            if let Some(count) = inner.counts.get_mut(&self.key) {
                count.running = count.running.saturating_sub(1);
            }
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let running = *self.running.get_mut();
        let mut inner = self.shares.lock();
        if let Some(count) = inner.counts.get_mut(&self.key) {
            count.held = count.held.saturating_sub(1);
            if running {
                count.running = count.running.saturating_sub(1);
            }
        }
        drop(inner);
        if running {
            self.shares.freed.signal();
        }
    }
}

#[cfg(test)]
mod tests {
    use inferyes_proto::v1::FlowPart;

    use super::*;

    fn parts(flow: &str, slots: u32) -> Option<FlowParts> {
        Some(FlowParts { parts: vec![FlowPart { flow: flow.into(), model: "chat".into(), slots }] })
    }

    #[test]
    fn a_flow_starts_no_more_than_its_part_and_a_request_that_ends_gives_its_place_back() {
        let shares = Arc::new(SlotShares::default());
        let now = Instant::now();
        let first = shares.hold("t:heavy", "chat", 1);
        let second = shares.hold("t:heavy", "chat", 1);
        assert!(second.may_start(now), "not held back before a controller says so");
        shares.take(0, parts("t:heavy", 1), now);
        assert!(first.try_start(now));
        assert!(first.try_start(now), "once running, it runs");
        assert!(!second.may_start(now), "its one part is running");
        assert!(!second.try_start(now));
        assert!(shares.hold("t:light", "chat", 1).try_start(now), "another flow is not held back");
        first.unstart();
        assert!(second.try_start(now), "the slot first was to take was taken");
        second.unstart();
        assert!(first.try_start(now));
        drop(first);
        assert!(second.try_start(now));
        // Parts lapse without a controller.
        let third = shares.hold("t:heavy", "chat", 1);
        assert!(!third.may_start(now));
        assert!(third.try_start(now + STALE_AFTER));
    }

    #[test]
    fn the_least_part_of_the_controllers_heard_lately_holds() {
        let shares = Arc::new(SlotShares::default());
        let now = Instant::now();
        let running = shares.hold("t:a", "chat", 1);
        assert!(running.try_start(now));
        let waiting = shares.hold("t:a", "chat", 1);
        shares.take(0, parts("t:a", 3), now);
        shares.take(1, parts("t:a", 1), now);
        assert!(!waiting.may_start(now));
        shares.take(1, None, now);
        assert!(waiting.may_start(now), "the second controller splits no slots now");
    }

    #[test]
    fn a_report_names_the_most_each_flow_held_since_the_last() {
        let shares = Arc::new(SlotShares::default());
        let holds: Vec<Hold> = (0..3).map(|_| shares.hold("t:a", "chat", 2)).collect();
        assert!(holds[0].try_start(Instant::now()));
        let light = shares.hold("t:b", "chat", 1);
        drop(light);
        let loads = shares.loads();
        let named: Vec<(&str, u32, u32)> = loads.iter().map(|l| (l.flow.as_str(), l.weight, l.demand)).collect();
        assert_eq!(named, vec![("t:a", 2, 3), ("t:b", 1, 1)]);
        drop(holds);
        let loads = shares.loads();
        assert_eq!(loads.len(), 1, "t:b held nothing since");
        assert_eq!(loads[0].demand, 3, "t:a held three until they ended");
        assert!(shares.loads().is_empty());
    }
}
