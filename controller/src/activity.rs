//! What data planes report they did lately: their routing decisions and the
//! nodes they hold ejected. Kept in memory for the dashboard, bounded, and
//! fed only by the `Report` RPC. A data plane reports to every controller
//! it lists, so each shows every data plane that reaches it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use inferyes_proto::v1::{DataPlaneReport, QueuedFlow, RoutingDecision};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::history::TtftSeries;
use crate::live::tidy_text;

/// Decisions shown, newest first: a tail for eyes, not a ledger.
const TAIL: usize = 200;
/// Decisions kept, newest first, for `Explain` to find a request by its id
/// a while after it was answered.
pub const KEPT: usize = 4096;
/// Candidates a decision names, at most (a data plane keeps four).
const CANDIDATES: usize = 4;
/// A data plane silent this long no longer vouches for its ejections (it
/// reports every second).
const STALE_AFTER: Duration = Duration::from_secs(30);
/// A data plane with requests waiting reports every second: what it said
/// of its queue this long ago is gone.
const QUEUE_STALE_AFTER: Duration = Duration::from_secs(5);
/// Flows of one data plane's queue kept, and the length of a flow's name.
const QUEUED_FLOWS: usize = 64;
/// Data planes whose queues, and whose ejections, are kept at once.
const DATAPLANES: usize = 256;
const FLOW_NAME: usize = 128;
/// Nodes one data plane's ejections name, at most: a data plane that
/// holds more out of routing has no fleet left to route to.
const EJECTED: usize = 1024;

pub struct Activity {
    inner: Mutex<Inner>,
    changed: watch::Sender<u64>,
}

#[derive(Default)]
struct Inner {
    decisions: VecDeque<Decision>,
    ejections: BTreeMap<String, (Vec<String>, Instant)>,
    queues: BTreeMap<String, (Vec<QueuedFlow>, Instant)>,
    dropped: u64,
    ttft: TtftSeries,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub dataplane_id: String,
    pub decision: RoutingDecision,
}

/// A copy of the activity at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Recent {
    /// Newest first.
    pub decisions: Vec<Decision>,
    /// Node → the data planes that hold it ejected.
    pub ejected: BTreeMap<String, BTreeSet<String>>,
    /// Decisions data planes dropped before reporting them (queue full).
    pub dropped: u64,
    /// What waits in each data plane's queue, by flow.
    pub queued: Vec<(String, QueuedFlow)>,
    /// Time to first token by route over the last minutes, as drawn.
    pub ttft: serde_json::Value,
}

impl Default for Activity {
    fn default() -> Self {
        Activity { inner: Mutex::default(), changed: watch::Sender::new(0) }
    }
}

impl Activity {
    pub fn record(&self, report: DataPlaneReport, now: Instant) {
        // Data planes report every second, quiet or not: watchers (the
        // dashboard, `Explain`) are told only of a report that says more.
        let changed = {
            let mut inner = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let now_ms = inferyes_proto::unix_ms();
            let mut dataplane_id = report.dataplane_id;
            tidy_text(&mut dataplane_id);
            // Every decision counts in the chart; only the newest of a
            // report can stay.
            let mut changed = !report.decisions.is_empty() || report.dropped > 0;
            let mut decisions = report.decisions;
            for decision in &decisions {
                inner.ttft.record(decision, now_ms);
            }
            decisions.drain(..decisions.len().saturating_sub(KEPT));
            for mut decision in decisions {
                decision.candidates.truncate(CANDIDATES);
                for candidate in &mut decision.candidates {
                    for text in [&mut candidate.node_id, &mut candidate.backend_id] {
                        tidy_text(text);
                    }
                }
                for text in [
                    &mut decision.request_id,
                    &mut decision.model,
                    &mut decision.node_id,
                    &mut decision.route,
                    &mut decision.error_code,
                    &mut decision.session_tag,
                    &mut decision.key_id,
                ] {
                    tidy_text(text);
                }
                inner.decisions.push_front(Decision { dataplane_id: dataplane_id.clone(), decision });
            }
            inner.decisions.truncate(KEPT);
            inner.dropped = inner.dropped.saturating_add(report.dropped);
            let mut queued = report.queued;
            queued.truncate(QUEUED_FLOWS);
            for flow in &mut queued {
                flow.flow = flow.flow.chars().take(FLOW_NAME).collect();
            }
            // A data plane gone silent leaves no row behind, and however
            // many ids reports name, the map stays bounded.
            inner.queues.retain(|_, (_, at)| now.saturating_duration_since(*at) < QUEUE_STALE_AFTER);
            if queued.is_empty() {
                changed |= inner.queues.remove(&dataplane_id).is_some();
            } else if inner.queues.len() < DATAPLANES || inner.queues.contains_key(&dataplane_id) {
                inner.queues.insert(dataplane_id.clone(), (queued, now));
                changed = true;
            }
            inner.ejections.retain(|_, (_, at)| now.saturating_duration_since(*at) < STALE_AFTER);
            // Node ids only, each once.
            let mut ejected = report.ejected_nodes;
            ejected.retain(|node| crate::live::valid_node_id(node));
            ejected.sort_unstable();
            ejected.dedup();
            ejected.truncate(EJECTED);
            if ejected.is_empty() {
                changed |= inner.ejections.remove(&dataplane_id).is_some();
            } else if inner.ejections.len() < DATAPLANES || inner.ejections.contains_key(&dataplane_id) {
                let before = inner.ejections.insert(dataplane_id, (ejected.clone(), now));
                changed |= before.is_none_or(|(nodes, _)| nodes != ejected);
            }
            changed
        };
        if changed {
            self.changed.send_modify(|n| *n += 1);
        }
    }

    pub fn recent(&self, now: Instant) -> Recent {
        let inner = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut ejected: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (dataplane, (nodes, at)) in &inner.ejections {
            if now.saturating_duration_since(*at) < STALE_AFTER {
                for node in nodes {
                    ejected.entry(node.clone()).or_default().insert(dataplane.clone());
                }
            }
        }
        let queued = inner
            .queues
            .iter()
            .filter(|(_, (_, at))| now.saturating_duration_since(*at) < QUEUE_STALE_AFTER)
            .flat_map(|(dataplane, (flows, _))| flows.iter().map(|flow| (dataplane.clone(), flow.clone())))
            .collect();
        Recent {
            decisions: inner.decisions.iter().take(TAIL).cloned().collect(),
            ejected,
            queued,
            dropped: inner.dropped,
            ttft: inner.ttft.view(inferyes_proto::unix_ms()),
        }
    }

    /// The newest decision reported for `request_id` among those kept;
    /// for an empty one, the newest of all.
    pub fn explain(&self, request_id: &str) -> Option<Decision> {
        let inner = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut kept = inner.decisions.iter();
        if request_id.is_empty() { kept.next() } else { kept.find(|d| d.decision.request_id == request_id) }.cloned()
    }

    /// Ticks on a report that brings decisions, drops, a queue waiting, a
    /// queue emptied, or other ejections.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use inferyes_proto::v1::Candidate;

    use super::*;

    fn report(dataplane: &str, requests: &[&str], ejected: &[&str]) -> DataPlaneReport {
        DataPlaneReport {
            dataplane_id: dataplane.into(),
            decisions: requests
                .iter()
                .map(|id| RoutingDecision { request_id: (*id).into(), ..Default::default() })
                .collect(),
            ejected_nodes: ejected.iter().map(|s| (*s).into()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn the_tail_is_newest_first_and_bounded() {
        let activity = Activity::default();
        let now = Instant::now();
        let ids: Vec<String> = (0..TAIL + 10).map(|i| format!("r{i}")).collect();
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        activity.record(report("dp-1", &refs, &[]), now);
        let recent = activity.recent(now);
        assert_eq!(recent.decisions.len(), TAIL);
        assert_eq!(recent.decisions[0].decision.request_id, format!("r{}", TAIL + 9));
        assert_eq!(recent.decisions[TAIL - 1].decision.request_id, "r10");
    }

    #[test]
    fn a_request_is_found_by_its_id_long_after_it_left_the_tail_until_it_is_not_kept() {
        let activity = Activity::default();
        let now = Instant::now();
        let mut said = report("dp-1", &["first"], &[]);
        said.decisions[0].candidates = vec![
            Candidate {
                node_id: "gpu\u{1b}[2J-a".into(),
                backend_id: "b".repeat(1 << 20),
                cost_ms: 7,
                ..Default::default()
            };
            2 * CANDIDATES
        ];
        activity.record(said, now);
        let ids: Vec<String> = (0..TAIL).map(|i| format!("r{i}")).collect();
        activity.record(report("dp-1", &ids.iter().map(String::as_str).collect::<Vec<_>>(), &[]), now);
        assert!(activity.recent(now).decisions.iter().all(|d| d.decision.request_id != "first"));
        let found = activity.explain("first").expect("kept past the tail");
        assert_eq!(found.dataplane_id, "dp-1");
        assert_eq!(found.decision.candidates.len(), CANDIDATES, "a report names at most this many");
        let plain =
            |c: &Candidate| !c.node_id.contains('\u{1b}') && c.backend_id.len() <= inferyes_proto::MAX_NAME_BYTES;
        assert!(found.decision.candidates.iter().all(|c| c.cost_ms == 7 && plain(c)), "shown plain, and bounded");
        let ids: Vec<String> = (0..KEPT).map(|i| format!("later{i}")).collect();
        activity.record(report("dp-1", &ids.iter().map(String::as_str).collect::<Vec<_>>(), &[]), now);
        assert_eq!(activity.explain("first"), None, "{KEPT} newer ones push it out");
        assert!(activity.explain("later0").is_some());
        let newest = activity.explain("").expect("the newest of all");
        assert_eq!(newest.decision.request_id, format!("later{}", KEPT - 1));
    }

    #[test]
    fn ejections_are_the_latest_word_of_each_data_plane_until_it_goes_silent() {
        let activity = Activity::default();
        let start = Instant::now();
        activity.record(report("dp-1", &[], &["n1", "n2"]), start);
        activity.record(report("dp-2", &[], &["n1"]), start);
        let recent = activity.recent(start);
        assert_eq!(recent.ejected["n1"], BTreeSet::from(["dp-1".to_string(), "dp-2".to_string()]));
        activity.record(report("dp-1", &[], &[]), start + Duration::from_secs(1));
        let recent = activity.recent(start + Duration::from_secs(1));
        assert_eq!(recent.ejected.keys().collect::<Vec<_>>(), ["n1"]);
        // dp-2 went silent: what it said no longer counts.
        assert!(activity.recent(start + STALE_AFTER + Duration::from_secs(1)).ejected.is_empty());
    }

    #[test]
    fn every_decision_of_a_report_counts_in_the_chart_though_only_the_newest_are_kept() {
        let activity = Activity::default();
        let now_ms = inferyes_proto::unix_ms();
        let decision = |i: usize| RoutingDecision {
            request_id: format!("r{i}"),
            unix_ms: now_ms,
            route: "placed".into(),
            status: 200,
            ttft_ms: 5,
            ..Default::default()
        };
        let said = DataPlaneReport {
            dataplane_id: "dp-1".into(),
            decisions: (0..2 * TAIL).map(decision).collect(),
            ..Default::default()
        };
        activity.record(said, Instant::now());
        let recent = activity.recent(Instant::now());
        assert_eq!(recent.decisions.len(), TAIL);
        let counted: u64 =
            recent.ttft["routes"]["placed"].as_array().unwrap().iter().map(|point| point[3].as_u64().unwrap()).sum();
        assert_eq!(counted, 2 * TAIL as u64);
    }

    #[test]
    fn however_many_data_planes_report_and_whatever_they_say_what_is_kept_is_bounded() {
        let activity = Activity::default();
        let start = Instant::now();
        // Long past any bound on a name: what is kept is cut to it.
        let long = "x".repeat(16 * inferyes_proto::MAX_NAME_BYTES);
        for i in 0..10 * DATAPLANES {
            let mut said = report(&format!("dp-{i}-{long}"), &[&long, &long], &[&long, "n1", "n1", "a b"]);
            said.dropped = u64::MAX;
            activity.record(said, start);
        }
        let inner = activity.inner.lock().unwrap();
        assert_eq!(inner.ejections.len(), DATAPLANES);
        assert_eq!(inner.dropped, u64::MAX);
        let kept = |text: &String| text.len() <= inferyes_proto::MAX_NAME_BYTES;
        assert!(inner.ejections.values().all(|(nodes, _)| nodes == &["n1"]), "node ids only, each once");
        assert!(inner.ejections.keys().all(kept));
        assert!(inner.decisions.iter().all(|d| kept(&d.dataplane_id) && kept(&d.decision.request_id)));
        drop(inner);
        // Those gone silent make room, and a data plane that ejects nothing
        // holds none.
        activity.record(report("dp-new", &[], &["n2"]), start + STALE_AFTER);
        activity.record(report("dp-new", &[], &[]), start + STALE_AFTER);
        assert!(activity.inner.lock().unwrap().ejections.is_empty());
    }

    #[test]
    fn a_report_wakes_subscribers_only_when_it_says_more() {
        let activity = Activity::default();
        let mut rx = activity.subscribe();
        rx.mark_unchanged();
        activity.record(report("dp-1", &["r"], &[]), Instant::now());
        assert!(rx.has_changed().unwrap(), "a decision");
        rx.mark_unchanged();
        activity.record(report("dp-1", &[], &[]), Instant::now());
        assert!(!rx.has_changed().unwrap(), "a quiet report");
        activity.record(report("dp-1", &[], &["node-a"]), Instant::now());
        assert!(rx.has_changed().unwrap(), "an ejection");
        rx.mark_unchanged();
        activity.record(report("dp-1", &[], &["node-a"]), Instant::now());
        assert!(!rx.has_changed().unwrap(), "the same ejection again");
        activity.record(report("dp-1", &[], &[]), Instant::now());
        assert!(rx.has_changed().unwrap(), "the ejection over");
    }
}
