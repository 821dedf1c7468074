//! What the dashboard draws over time, over the last five minutes: each
//! GPU's memory and slots ([`Pressure`]), and the fleet's time to first
//! token by route ([`TtftSeries`]), which is what routing saves. Pure and
//! bounded: fed samples and decisions, read by the view.

use std::collections::{BTreeMap, VecDeque};

use inferyes_proto::v1::RoutingDecision;
use serde_json::{Value, json};

use crate::snapshot::Snapshot;

/// One step of the pictures.
pub const STEP_MS: u64 = 5_000;
/// Steps kept: five minutes.
pub const STEPS: u64 = 60;
/// Routes drawn, in the legend's order. Decisions with another route
/// (`failover`, `none`) are not drawn: a failover's time is the failure's.
pub const ROUTES: [&str; 6] = ["resident", "carried", "moved", "placed", "warm", "cold"];
/// Times kept per route and step for its median; past that, each new one
/// replaces the oldest kept, so a busy step's median is its last 64.
const TIMES_PER_STEP: usize = 64;

/// A GPU's memory and slots, one sample per step.
#[derive(Default)]
pub struct Pressure {
    /// (node, GPU index; none for a node without GPUs) → samples, oldest
    /// first. Only GPUs in the last snapshot sampled are kept, so what is
    /// kept is bounded by the fleet, not by what agents ever reported.
    gpus: BTreeMap<(String, Option<u32>), VecDeque<Sample>>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Sample {
    at_ms: u64,
    memory: f64,
    slots_busy: u32,
    slots_total: u32,
}

impl Pressure {
    /// Takes a sample of every GPU in `snapshot` that has none in this step
    /// yet, so a node is drawn from the snapshot it joins in, and forgets
    /// GPUs no longer in it.
    pub fn sample(&mut self, snapshot: &Snapshot, live: &crate::live::LiveView, now_ms: u64) {
        let step = now_ms / STEP_MS;
        let mut seen = std::collections::BTreeSet::new();
        for node in snapshot.merged_nodes(live) {
            let Some(status) = node.status.as_ref() else { continue };
            let slots_busy = status.backends.iter().fold(0u32, |n, b| n.saturating_add(b.slots_busy));
            let slots_total = status.backends.iter().fold(0u32, |n, b| n.saturating_add(b.slots_total));
            let mut push = |index: Option<u32>, memory: f64| {
                let key = (status.node_id.clone(), index);
                seen.insert(key.clone());
                let samples = self.gpus.entry(key).or_default();
                if samples.back().is_none_or(|last| last.at_ms / STEP_MS < step) {
                    samples.push_back(Sample { at_ms: now_ms, memory, slots_busy, slots_total });
                }
            };
            if status.gpus.is_empty() {
                push(None, 0.0);
            }
            for gpu in &status.gpus {
                let memory = if gpu.memory_total_bytes == 0 {
                    0.0
                } else {
                    gpu.memory_used_bytes as f64 / gpu.memory_total_bytes as f64
                };
                push(Some(gpu.index), memory);
            }
        }
        let oldest = now_ms.saturating_sub(STEPS * STEP_MS);
        self.gpus.retain(|key, samples| {
            while samples.front().is_some_and(|s| s.at_ms <= oldest) {
                samples.pop_front();
            }
            seen.contains(key) && !samples.is_empty()
        });
    }

    /// `[[at_ms, memory fraction, slots busy, slots total], ...]`, oldest
    /// first; `None` for the node's GPU-less card.
    pub fn of(&self, node: &str, gpu: Option<u32>) -> Value {
        let key = (node.to_string(), gpu);
        let samples = self.gpus.get(&key).map(|s| s.iter()).into_iter().flatten();
        Value::Array(
            samples
                .map(|s| json!([s.at_ms, (s.memory * 1000.0).round() / 1000.0, s.slots_busy, s.slots_total]))
                .collect(),
        )
    }
}

/// Time to first token by route, per step.
#[derive(Clone, Debug, Default)]
pub struct TtftSeries {
    /// Oldest first; a step is there once a decision fell in it.
    steps: VecDeque<Step>,
}

#[derive(Clone, Debug)]
struct Step {
    start_ms: u64,
    /// By [`ROUTES`] index.
    routes: [Times; ROUTES.len()],
}

#[derive(Clone, Debug, Default)]
struct Times {
    kept: Vec<u32>,
    count: u64,
    max: u32,
}

impl TtftSeries {
    /// Adds what `decision` took, if it was answered, by a drawn route,
    /// within the window by this controller's clock: a data plane whose
    /// clock is off, or that lies, cannot move the window.
    pub fn record(&mut self, decision: &RoutingDecision, now_ms: u64) {
        let Some(route) = ROUTES.iter().position(|r| *r == decision.route) else { return };
        if decision.ttft_ms == 0 || !(200..300).contains(&decision.status) {
            return;
        }
        let window_start = now_ms.saturating_sub(STEPS * STEP_MS);
        if decision.unix_ms <= window_start || decision.unix_ms > now_ms.saturating_add(STEP_MS) {
            return;
        }
        let start_ms = decision.unix_ms - decision.unix_ms % STEP_MS;
        let at = match self.steps.iter().rposition(|s| s.start_ms <= start_ms) {
            Some(i) if self.steps[i].start_ms == start_ms => i,
            found => {
                let i = found.map_or(0, |i| i + 1);
                self.steps.insert(i, Step { start_ms, routes: Default::default() });
                i
            }
        };
        let times = &mut self.steps[at].routes[route];
        if times.kept.len() < TIMES_PER_STEP {
            times.kept.push(decision.ttft_ms);
        } else {
            times.kept[(times.count % TIMES_PER_STEP as u64) as usize] = decision.ttft_ms;
        }
        times.count += 1;
        times.max = times.max.max(decision.ttft_ms);
        self.forget_before(window_start);
    }

    fn forget_before(&mut self, window_start: u64) {
        while self.steps.front().is_some_and(|s| s.start_ms + STEP_MS <= window_start) {
            self.steps.pop_front();
        }
    }

    /// `{"step_ms", "routes": {route: [[step start, p50 ms, max ms, count],
    /// ...]}}`, the steps of the window ending `now_ms` only.
    pub fn view(&self, now_ms: u64) -> Value {
        let window_start = now_ms.saturating_sub(STEPS * STEP_MS);
        let mut routes = serde_json::Map::new();
        for (r, name) in ROUTES.iter().enumerate() {
            let points: Vec<Value> = self
                .steps
                .iter()
                .filter(|s| s.start_ms + STEP_MS > window_start && s.routes[r].count > 0)
                .map(|s| {
                    let times = &s.routes[r];
                    let mut sorted = times.kept.clone();
                    sorted.sort_unstable();
                    let median = sorted[(sorted.len() - 1) / 2];
                    json!([s.start_ms, median, times.max, times.count])
                })
                .collect();
            routes.insert((*name).to_string(), Value::Array(points));
        }
        json!({ "step_ms": STEP_MS, "routes": routes })
    }
}

#[cfg(test)]
mod tests {
    use inferyes_proto::v1::{Backend, Gpu, NodeRecord, NodeStatus};

    use super::*;
    use crate::fleet::FleetState;
    use crate::store::{WatchBatch, WatchEvent};

    fn fleet(nodes: &[(&str, u64, u32)]) -> Snapshot {
        let events = nodes
            .iter()
            .map(|(id, used, busy)| {
                let status = NodeStatus {
                    node_id: (*id).into(),
                    gpus: vec![Gpu {
                        index: 0,
                        memory_total_bytes: 1_000,
                        memory_used_bytes: *used,
                        ..Default::default()
                    }],
                    backends: vec![Backend { slots_busy: *busy, slots_total: 4, ..Default::default() }],
                    ..Default::default()
                };
                WatchEvent::NodePut((*id).into(), NodeRecord { status: Some(status), ..Default::default() })
            })
            .collect();
        crate::snapshot::build(&FleetState::from_load(WatchBatch { revision: 1, events }), None)
    }

    #[test]
    fn each_gpu_keeps_its_last_minutes_of_memory_and_slots() {
        let mut pressure = Pressure::default();
        pressure.sample(&fleet(&[("a", 500, 1), ("b", 900, 4)]), &Default::default(), STEP_MS);
        // One sample a step: a second look in the same step changes nothing.
        pressure.sample(&fleet(&[("a", 550, 3), ("b", 900, 4)]), &Default::default(), STEP_MS + 10);
        pressure.sample(&fleet(&[("a", 600, 2), ("b", 900, 4)]), &Default::default(), 2 * STEP_MS);
        assert_eq!(pressure.of("a", Some(0)), json!([[STEP_MS, 0.5, 1, 4], [2 * STEP_MS, 0.6, 2, 4]]));
        assert_eq!(pressure.of("b", Some(0)), json!([[STEP_MS, 0.9, 4, 4], [2 * STEP_MS, 0.9, 4, 4]]));
        assert_eq!(pressure.of("a", Some(1)), json!([]));
        // b left: forgotten. a's first samples fall out of the window.
        pressure.sample(&fleet(&[("a", 700, 3)]), &Default::default(), (STEPS + 1) * STEP_MS + 1);
        assert_eq!(
            pressure.of("a", Some(0)),
            json!([[2 * STEP_MS, 0.6, 2, 4], [(STEPS + 1) * STEP_MS + 1, 0.7, 3, 4]])
        );
        assert!(!pressure.gpus.contains_key(&("b".to_string(), Some(0))));
    }

    fn decision(route: &str, unix_ms: u64, ttft_ms: u32) -> RoutingDecision {
        RoutingDecision { route: route.into(), unix_ms, ttft_ms, status: 200, ..Default::default() }
    }

    #[test]
    fn times_are_drawn_by_route_and_step_as_median_and_max() {
        let mut series = TtftSeries::default();
        let t = 1_000 * STEP_MS;
        let now = t + 2 * STEP_MS;
        for ms in [100, 300, 200] {
            series.record(&decision("resident", t + 10, ms), now);
        }
        series.record(&decision("placed", t + STEP_MS + 1, 4_000), now);
        let view = series.view(now);
        assert_eq!(view["routes"]["resident"], json!([[t, 200, 300, 3]]));
        assert_eq!(view["routes"]["placed"], json!([[t + STEP_MS, 4_000, 4_000, 1]]));
        assert_eq!(view["routes"]["cold"], json!([]));
        // Nothing new for the whole window: nothing drawn.
        assert_eq!(series.view(now + STEPS * STEP_MS)["routes"]["placed"], json!([]));
    }

    #[test]
    fn errors_failovers_and_unknown_routes_are_not_drawn() {
        let mut series = TtftSeries::default();
        let mut failed = decision("resident", STEP_MS, 50);
        failed.status = 502;
        series.record(&failed, STEP_MS);
        series.record(&decision("failover", STEP_MS, 50), STEP_MS);
        series.record(&decision("<script>", STEP_MS, 50), STEP_MS);
        series.record(&decision("warm", STEP_MS, 0), STEP_MS);
        assert!(series.steps.is_empty());
    }

    #[test]
    fn the_window_is_this_controllers_and_each_step_is_bounded() {
        let mut series = TtftSeries::default();
        let now = 100 * STEP_MS;
        for i in 0..1_000u32 {
            series.record(&decision("warm", now - 1, i + 1), now);
        }
        assert_eq!(series.view(now)["routes"]["warm"][0], json!([99 * STEP_MS, 968, 1_000, 1_000]));
        let warm = ROUTES.iter().position(|r| *r == "warm").unwrap();
        assert_eq!(series.steps[0].routes[warm].kept.len(), TIMES_PER_STEP);
        // Out of order within the window: inserted in its place.
        series.record(&decision("warm", now - STEP_MS - 1, 7), now);
        assert_eq!(series.steps.iter().map(|s| s.start_ms).collect::<Vec<_>>(), [98 * STEP_MS, 99 * STEP_MS]);
        // From before the window, or from a clock far ahead (or lying): not
        // drawn, and the window does not move.
        for unix_ms in [now - STEPS * STEP_MS, now + 2 * STEP_MS, u64::MAX] {
            series.record(&decision("warm", unix_ms, 9), now);
        }
        assert_eq!(series.steps.len(), 2);
        // Time passes: old steps go.
        series.record(&decision("warm", now + STEPS * STEP_MS, 9), now + STEPS * STEP_MS);
        assert_eq!(series.steps.iter().map(|s| s.start_ms).collect::<Vec<_>>(), [(100 + STEPS) * STEP_MS]);
    }
}
