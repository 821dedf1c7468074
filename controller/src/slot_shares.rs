//! Fleet-wide fair shares of the nodes' slots. Each data plane's queue
//! orders its own waiting requests fairly, but data planes race for the
//! same slots: a tenant whose requests spread over four data planes would
//! take four turns to another's one, and a data plane whose requests end
//! takes their slots for what waits there before any other sees them free.
//!
//! So data planes report, every second, what each keyed flow (a tenant, or
//! a key without one) held of them per model: the most requests at once,
//! running and waiting. Where a model's flows together want more than its
//! nodes have slots, each flow gets its weighted max-min fair share of the
//! slots, and that share is split among the data planes by what the flow
//! wanted at each; a data plane starts no more of a flow's requests for
//! the model while it has its part running. A model one flow alone wants,
//! or one data plane alone sends to, is not split: there is no one to be
//! fair to, or that data plane's own queue is fair. A flow that wants less than
//! its fair share gets what it wants: its slots stay its own while it
//! keeps using them, so a light tenant's next request finds one free.
//!
//! Shares are fairness, not a limit a key pays for: a data plane that
//! hears no controller holds nothing back, and what a second of reports
//! misses is made good in the next.
//!
//! Pure: the caller brings the reports, the time and the slots.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use inferyes_proto::v1::{FlowLoad, FlowPart, FlowParts};

/// A data plane not heard for this long is gone. They report every second.
pub const GONE_AFTER: Duration = Duration::from_secs(3);
/// Where a flow's share is fewer slots than the data planes it comes
/// through, which of them get one turns this often: each turn costs a
/// slot the time the next data plane takes to see it free.
pub const TURN_EVERY: Duration = Duration::from_secs(10);
/// Data planes followed at most; one past them is given no parts.
pub const MAX_DATAPLANES: usize = 32;
/// Flows and models one report names at most (the data plane sends the
/// largest first).
pub const MAX_LOADS: usize = 256;
/// The longest flow and model names taken.
const MAX_NAME: usize = 512;
/// A demand past this is this.
const MAX_DEMAND: u32 = 1 << 20;

/// What the data planes reporting here wanted lately.
#[derive(Default)]
pub struct Loads {
    dataplanes: BTreeMap<String, Heard>,
    /// The first report's time: a flow's ties turn from it.
    since: Option<Instant>,
}

struct Heard {
    at: Instant,
    loads: Vec<FlowLoad>,
}

/// What one flow wants of one model, fleet-wide.
#[derive(Default)]
struct Want {
    weight: u32,
    demand: u64,
    /// By data plane.
    at: Vec<(u64, u32)>,
}

impl Loads {
    /// Takes a data plane's report: what it says replaces what it said.
    /// Entries past the bounds, or with names too long, are left out.
    pub fn report(&mut self, dataplane: &str, loads: &[FlowLoad], now: Instant) {
        self.since.get_or_insert(now);
        self.dataplanes.retain(|_, heard| now.saturating_duration_since(heard.at) < GONE_AFTER);
        if !self.dataplanes.contains_key(dataplane) && self.dataplanes.len() >= MAX_DATAPLANES {
            return;
        }
        let loads = loads
            .iter()
            .take(MAX_LOADS)
            .filter(|l| l.demand > 0 && l.flow.len() <= MAX_NAME && l.model.len() <= MAX_NAME)
            .map(|l| FlowLoad {
                weight: l.weight.clamp(1, inferyes_proto::apikey::MAX_WEIGHT),
                demand: l.demand.min(MAX_DEMAND),
                ..l.clone()
            })
            .collect();
        self.dataplanes.insert(dataplane.to_string(), Heard { at: now, loads });
    }

    /// `dataplane`'s parts of the busy models' slots, `slots` giving each
    /// model's slots in the fleet (0: unknown, never busy).
    pub fn parts(&self, dataplane: &str, slots: impl Fn(&str) -> u32, now: Instant) -> FlowParts {
        let Some(own) = self.dataplanes.get(dataplane) else { return FlowParts::default() };
        let live = || self.dataplanes.iter().filter(|(_, h)| now.saturating_duration_since(h.at) < GONE_AFTER);
        // Only the models this data plane sends to are weighed.
        let mut models: BTreeMap<&str, BTreeMap<&str, Want>> =
            own.loads.iter().map(|l| (l.model.as_str(), BTreeMap::new())).collect();
        for (place, (_, heard)) in live().enumerate() {
            for load in &heard.loads {
                let Some(flows) = models.get_mut(load.model.as_str()) else { continue };
                let want = flows.entry(load.flow.as_str()).or_default();
                want.weight = want.weight.max(load.weight);
                want.demand += u64::from(load.demand);
                want.at.push((place as u64, load.demand));
            }
        }
        let place = live().position(|(id, _)| id == dataplane).unwrap_or(0) as u64;
        // Ties in a flow's split go round the data planes, so that none is
        // held at nothing for long.
        let turn = self.since.map_or(0, |since| now.saturating_duration_since(since).as_secs() / TURN_EVERY.as_secs());
        let mut parts = Vec::new();
        for (model, flows) in &models {
            let capacity = slots(model);
            let wanted: u64 = flows.values().map(|w| w.demand).sum();
            // A flow alone has no one to be fair to, and a data plane alone
            // orders its flows fairly in its own queue: parts would only
            // leave slots idle.
            let dataplanes: std::collections::BTreeSet<u64> =
                flows.values().flat_map(|want| want.at.iter().map(|(place, _)| *place)).collect();
            if capacity == 0 || wanted <= u64::from(capacity) || flows.len() < 2 || dataplanes.len() < 2 {
                continue;
            }
            let wants: Vec<(u32, u64)> = flows.values().map(|w| (w.weight, w.demand)).collect();
            for ((flow, want), share) in flows.iter().zip(fair_shares(u64::from(capacity), &wants, turn as usize)) {
                let Some(index) = want.at.iter().position(|(p, _)| *p == place) else { continue };
                let demands: Vec<u64> = want.at.iter().map(|(_, d)| u64::from(*d)).collect();
                let rotation = turn.wrapping_add(fastish(flow)) as usize;
                let part = split(share, &demands, rotation)[index];
                parts.push(FlowPart {
                    flow: (*flow).to_string(),
                    model: (*model).to_string(),
                    slots: u32::try_from(part).unwrap_or(u32::MAX),
                });
            }
        }
        FlowParts { parts }
    }
}

/// A stable number of a flow's name: flows take their turns at different
/// data planes.
fn fastish(flow: &str) -> u64 {
    flow.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Each flow's weighted max-min fair share of `capacity` whole slots, by
/// `(weight, demand)`: flows wanting less than an even share by weight
/// get what they want, the rest split what is left by weight. The shares
/// add up to the capacity where the flows want that much; a fraction left
/// over goes to the largest remainders, equal ones in turn from the flow
/// at `rotation`. Every flow gets one slot at least: where more flows
/// want slots than there are, whole shares cannot be fair, and the turns
/// between them are the data planes' own queues'.
pub fn fair_shares(capacity: u64, wants: &[(u32, u64)], rotation: usize) -> Vec<u64> {
    let mut order: Vec<usize> = (0..wants.len()).collect();
    // Least demand per weight first: those are satisfied first.
    order.sort_by(|&a, &b| {
        let (wa, da) = wants[a];
        let (wb, db) = wants[b];
        (u128::from(da) * u128::from(wb.max(1))).cmp(&(u128::from(db) * u128::from(wa.max(1))))
    });
    let mut exact = vec![0f64; wants.len()];
    let mut left = capacity as f64;
    let mut weight_left: f64 = wants.iter().map(|(w, _)| f64::from((*w).max(1))).sum();
    for &i in &order {
        let (weight, demand) = wants[i];
        let weight = f64::from(weight.max(1));
        let even = left * weight / weight_left;
        exact[i] = (demand as f64).min(even);
        left -= exact[i];
        weight_left -= weight;
    }
    let mut shares = whole(&exact, capacity, |i| wants[i].1, rotation);
    for (share, (_, demand)) in shares.iter_mut().zip(wants) {
        *share = (*share).max(1).min(*demand);
    }
    shares
}

/// A flow's `share` split among the data planes by what it wanted at
/// each, whole slots adding up to the share (or all it wanted); equal
/// remainders go first to the data plane at `rotation`, then on in turn.
pub fn split(share: u64, demands: &[u64], rotation: usize) -> Vec<u64> {
    let total: u64 = demands.iter().sum();
    if total == 0 {
        return vec![0; demands.len()];
    }
    let exact: Vec<f64> = demands.iter().map(|d| share as f64 * *d as f64 / total as f64).collect();
    whole(&exact, share.min(total), |i| demands[i], rotation)
}

/// Whole numbers from `exact` adding up to `total` (where their caps
/// allow): the floors, then one more each by largest remainder, never past
/// `cap(i)`; equal remainders in turn from `rotation`.
fn whole(exact: &[f64], total: u64, cap: impl Fn(usize) -> u64, rotation: usize) -> Vec<u64> {
    let mut parts: Vec<u64> = exact.iter().enumerate().map(|(i, x)| (x.floor() as u64).min(cap(i))).collect();
    let n = exact.len().max(1);
    let mut order: Vec<usize> = (0..exact.len()).collect();
    // Remainders in millionths: shares that are equal on paper stay equal
    // past floating point's last digits, and take their turns.
    let remainder = |i: usize| ((exact[i] - exact[i].floor()) * 1e6).round() as u64;
    let turn = |i: usize| (i + n - rotation % n) % n;
    order.sort_by_key(|&i| (std::cmp::Reverse(remainder(i)), turn(i)));
    let mut left = total.saturating_sub(parts.iter().sum());
    for i in order {
        if left == 0 {
            break;
        }
        if parts[i] < cap(i) {
            parts[i] += 1;
            left -= 1;
        }
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(flow: &str, demand: u32) -> FlowLoad {
        FlowLoad { flow: flow.into(), model: "chat".into(), weight: 1, demand }
    }

    fn part_of(parts: &FlowParts, flow: &str) -> Option<u32> {
        parts.parts.iter().find(|p| p.flow == flow && p.model == "chat").map(|p| p.slots)
    }

    #[test]
    fn a_flow_wanting_less_than_its_share_gets_what_it_wants_and_the_rest_split_by_weight() {
        assert_eq!(fair_shares(8, &[(1, 1), (1, 64)], 0), vec![1, 7]);
        assert_eq!(fair_shares(8, &[(3, 40), (1, 40)], 0), vec![6, 2]);
        assert_eq!(fair_shares(2, &[(1, 48), (1, 1)], 0), vec![1, 1]);
        // Three even flows of eight slots: the two left over go round.
        let turns: Vec<Vec<u64>> = (0..3).map(|r| fair_shares(8, &[(1, 9), (1, 9), (1, 9)], r)).collect();
        assert_eq!(turns, vec![vec![3, 3, 2], vec![2, 3, 3], vec![3, 2, 3]]);
        // More flows than slots: one each.
        assert_eq!(fair_shares(2, &[(1, 9), (1, 9), (1, 9)], 0), vec![1, 1, 1]);
        // Less wanted than there is: each what it wants.
        assert_eq!(fair_shares(8, &[(1, 2), (5, 3)], 0), vec![2, 3]);
    }

    #[test]
    fn a_share_is_split_by_demand_in_whole_slots_and_its_ties_turn() {
        assert_eq!(split(7, &[16, 16, 16, 16], 0), vec![2, 2, 2, 1]);
        assert_eq!(split(7, &[16, 16, 16, 16], 3), vec![2, 2, 1, 2]);
        assert_eq!(split(6, &[10, 2], 0), vec![5, 1]);
        assert_eq!(split(5, &[1, 1], 0), vec![1, 1], "never more than a data plane wanted");
        assert_eq!(split(0, &[4, 4], 1), vec![0, 0]);
        let turns: Vec<Vec<u64>> = (0..3).map(|r| split(1, &[5, 5, 5], r)).collect();
        assert_eq!(turns, vec![vec![1, 0, 0], vec![0, 1, 0], vec![0, 0, 1]]);
    }

    #[test]
    fn a_light_flow_at_one_data_plane_keeps_its_slot_from_a_flood_at_three() {
        let now = Instant::now();
        let mut loads = Loads::default();
        loads.report("dp-0", &[load("t:light", 1)], now);
        for dp in ["dp-1", "dp-2", "dp-3"] {
            loads.report(dp, &[load("t:heavy", 12)], now);
        }
        let slots = |model: &str| if model == "chat" { 2 } else { 0 };
        assert_eq!(part_of(&loads.parts("dp-0", slots, now), "t:light"), Some(1));
        let heavy: u32 = ["dp-1", "dp-2", "dp-3"]
            .iter()
            .map(|dp| part_of(&loads.parts(dp, slots, now), "t:heavy").expect("heavy is held back"))
            .sum();
        assert_eq!(heavy, 1, "the flood shares the other slot");
        assert_eq!(part_of(&loads.parts("dp-1", slots, now), "t:light"), None, "dp-1 sends light nothing");

        // One data plane alone is fair in its own queue.
        let mut alone = Loads::default();
        alone.report("dp-0", &[load("t:light", 1), load("t:heavy", 12)], now);
        assert!(alone.parts("dp-0", slots, now).parts.is_empty());

        // With slots to spare, nothing is held back.
        assert!(loads.parts("dp-1", |_| 40, now).parts.is_empty());
        // Nor by a model of unknown slots.
        assert!(loads.parts("dp-1", |_| 0, now).parts.is_empty());
    }

    #[test]
    fn data_planes_gone_quiet_are_not_counted() {
        let now = Instant::now();
        let mut loads = Loads::default();
        loads.report("dp-0", &[load("t:light", 1)], now);
        loads.report("dp-1", &[load("t:heavy", 12)], now);
        assert_eq!(part_of(&loads.parts("dp-1", |_| 2, now), "t:heavy"), Some(1));
        let later = now + GONE_AFTER;
        loads.report("dp-2", &[load("t:heavy", 12)], later);
        assert!(loads.parts("dp-0", |_| 2, later).parts.is_empty(), "dp-0 is gone");
        assert!(loads.parts("dp-2", |_| 2, later).parts.is_empty(), "the heavy flow is alone now");
    }

    #[test]
    fn a_report_past_the_bounds_is_cut_to_them() {
        let now = Instant::now();
        let mut loads = Loads::default();
        let long = "x".repeat(MAX_NAME + 1);
        let many: Vec<FlowLoad> = (0..MAX_LOADS + 10).map(|i| load(&format!("t:{i}"), 1)).collect();
        loads.report("dp-0", &many, now);
        loads.report("dp-1", &[load(&long, 5), FlowLoad { weight: 0, ..load("t:zero", u32::MAX) }], now);
        assert_eq!(loads.dataplanes["dp-0"].loads.len(), MAX_LOADS);
        let dp1 = &loads.dataplanes["dp-1"].loads;
        assert_eq!(dp1.len(), 1);
        assert_eq!((dp1[0].weight, dp1[0].demand), (1, MAX_DEMAND));
        for i in 0..MAX_DATAPLANES {
            loads.report(&format!("more-{i}"), &[load("t:a", 1)], now);
        }
        assert_eq!(loads.dataplanes.len(), MAX_DATAPLANES);
        let past = format!("more-{}", MAX_DATAPLANES - 1);
        assert!(loads.parts(&past, |_| 1, now).parts.is_empty(), "one past the bound is not followed");
    }
}
