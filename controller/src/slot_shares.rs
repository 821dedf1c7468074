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
    at: Vec<(usize, u32)>,
}

/// Which of a busy model's flows and data planes get the slots left over
/// from whole shares now: every controller counts turns from Unix time
/// alike, so the parts data planes take the least of agree.
pub fn turn_at(unix_ms: u64) -> u64 {
    unix_ms / 1000 / TURN_EVERY.as_secs()
}

impl Loads {
    /// Takes a data plane's report: what it says replaces what it said.
    /// Entries past the bounds, or with names too long, are left out.
    pub fn report(&mut self, dataplane: &str, loads: &[FlowLoad], now: Instant) {
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

    /// `dataplane`'s parts of the busy models' slots at `turn`
    /// ([`turn_at`]), `slots` giving each model's slots in the fleet (0:
    /// unknown, never busy).
    pub fn parts(&self, dataplane: &str, slots: impl Fn(&str) -> u32, now: Instant, turn: u64) -> FlowParts {
        let live: Vec<(&String, &Heard)> =
            self.dataplanes.iter().filter(|(_, h)| now.saturating_duration_since(h.at) < GONE_AFTER).collect();
        let Some(place) = live.iter().position(|(id, _)| *id == dataplane) else { return FlowParts::default() };
        // Only the models this data plane sends to are weighed.
        let mut models: BTreeMap<&str, BTreeMap<&str, Want>> =
            live[place].1.loads.iter().map(|l| (l.model.as_str(), BTreeMap::new())).collect();
        for (at, (_, heard)) in live.iter().enumerate() {
            for load in &heard.loads {
                let Some(flows) = models.get_mut(load.model.as_str()) else { continue };
                let want = flows.entry(load.flow.as_str()).or_default();
                want.weight = want.weight.max(load.weight);
                want.demand += u64::from(load.demand);
                want.at.push((at, load.demand));
            }
        }
        let mut parts = Vec::new();
        for (model, flows) in &models {
            // A flow alone has no one to be fair to, and a data plane alone
            // orders its flows fairly in its own queue: parts would only
            // leave slots idle.
            let dataplanes: std::collections::BTreeSet<usize> =
                flows.values().flat_map(|want| want.at.iter().map(|(at, _)| *at)).collect();
            if flows.len() < 2 || dataplanes.len() < 2 {
                continue;
            }
            let capacity = u64::from(slots(model));
            let wanted: u64 = flows.values().map(|w| w.demand).sum();
            if capacity == 0 || wanted <= capacity {
                continue;
            }
            let wants: Vec<(u32, u64)> = flows.values().map(|w| (w.weight, w.demand)).collect();
            for ((flow, want), share) in flows.iter().zip(fair_shares(capacity, &wants, turn as usize)) {
                let Some(index) = want.at.iter().position(|(at, _)| *at == place) else { continue };
                let demands: Vec<u64> = want.at.iter().map(|(_, d)| u64::from(*d)).collect();
                let rotation = turn.wrapping_add(flow_offset(flow)) as usize;
                parts.push(FlowPart {
                    flow: (*flow).to_string(),
                    model: (*model).to_string(),
                    slots: u32::try_from(split(share, &demands, rotation)[index]).unwrap_or(u32::MAX),
                });
            }
        }
        FlowParts { parts }
    }
}

/// Where a flow's turns start among the data planes, by its name: flows
/// take their turns at different data planes.
fn flow_offset(flow: &str) -> u64 {
    flow.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Each flow's weighted max-min fair share of `capacity` whole slots, by
/// `(weight, demand)`: flows wanting less than an even share by weight
/// get what they want, the rest split what is left by weight, one slot at
/// least each; the slots left over from the fractions go round the flows,
/// from the one at `rotation`. Where more flows want slots than there are,
/// each gets one: whole shares cannot be fair, and the turns between them
/// are the data planes' own queues'.
pub fn fair_shares(capacity: u64, wants: &[(u32, u64)], rotation: usize) -> Vec<u64> {
    let wanting = wants.iter().filter(|(_, demand)| *demand > 0).count() as u64;
    if wanting > capacity {
        return wants.iter().map(|(_, demand)| (*demand).min(1)).collect();
    }
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
    whole(&exact, capacity, |i| wants[i].1, rotation)
}

/// A flow's `share` split among the data planes by what it wanted at
/// each, in whole slots adding up to the share (or all it wanted), one at
/// least each. Where the share is fewer slots than the data planes that
/// want it, one each goes to as many as it has, in turn from `rotation`.
pub fn split(share: u64, demands: &[u64], rotation: usize) -> Vec<u64> {
    let total: u64 = demands.iter().sum();
    if total == 0 {
        return vec![0; demands.len()];
    }
    let exact: Vec<f64> = demands.iter().map(|d| share as f64 * *d as f64 / total as f64).collect();
    whole(&exact, share.min(total), |i| demands[i], rotation)
}

/// Whole numbers near `exact` adding up to `total`, each within `cap(i)`
/// and, where `total` allows, one at least where `cap(i)` is not 0. Where
/// it does not, one each to `total` of them, in turn from `rotation`.
/// Otherwise the floors; past `total`, one back at a time from the part
/// furthest over its exact share; short of it, one more at a time by
/// largest remainder, equal ones in turn from `rotation`.
fn whole(exact: &[f64], total: u64, cap: impl Fn(usize) -> u64, rotation: usize) -> Vec<u64> {
    let n = exact.len().max(1);
    let turn = |i: usize| (i + n - rotation % n) % n;
    let mut order: Vec<usize> = (0..exact.len()).collect();
    let wanting: Vec<usize> = {
        let mut wanting: Vec<usize> = order.iter().copied().filter(|&i| cap(i) > 0).collect();
        wanting.sort_by_key(|&i| turn(i));
        wanting
    };
    let mut parts = vec![0u64; exact.len()];
    if (wanting.len() as u64) > total {
        for &i in wanting.iter().take(total as usize) {
            parts[i] = 1;
        }
        return parts;
    }
    for &i in &wanting {
        parts[i] = (exact[i].floor() as u64).max(1).min(cap(i));
    }
    // Amounts in millionths: parts that are equal on paper stay equal past
    // floating point's last digits, and take their turns.
    let millionths = |x: f64| (x * 1e6).round() as i64;
    while parts.iter().sum::<u64>() > total {
        let over = |i: usize| millionths(parts[i] as f64 - exact[i]);
        let Some(&i) =
            wanting.iter().filter(|&&i| parts[i] > 1).max_by_key(|&&i| (over(i), std::cmp::Reverse(turn(i))))
        else {
            break;
        };
        parts[i] -= 1;
    }
    let remainder = |i: usize| millionths(exact[i] - exact[i].floor());
    order.sort_by_key(|&i| (std::cmp::Reverse(remainder(i)), turn(i)));
    let mut left = total.saturating_sub(parts.iter().sum());
    for i in order {
        if left == 0 {
            break;
        }
        if parts[i] < cap(i) && parts[i] as f64 <= exact[i] {
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
        // One slot at least each, and never more than there are.
        assert_eq!(fair_shares(3, &[(10, 9), (1, 9), (1, 9)], 0), vec![1, 1, 1]);
        assert_eq!(fair_shares(4, &[(10, 9), (1, 9), (1, 9)], 0), vec![2, 1, 1]);
        // More flows than slots: one each.
        assert_eq!(fair_shares(2, &[(1, 9), (1, 9), (1, 9)], 0), vec![1, 1, 1]);
        // Less wanted than there is: each what it wants.
        assert_eq!(fair_shares(8, &[(1, 2), (5, 3)], 0), vec![2, 3]);
    }

    #[test]
    fn a_share_is_split_by_demand_in_whole_slots_and_every_data_plane_has_its_turn() {
        assert_eq!(split(7, &[16, 16, 16, 16], 0), vec![2, 2, 2, 1]);
        assert_eq!(split(7, &[16, 16, 16, 16], 3), vec![2, 2, 1, 2]);
        assert_eq!(split(6, &[10, 2], 0), vec![5, 1]);
        assert_eq!(split(5, &[1, 1], 0), vec![1, 1], "never more than a data plane wanted");
        assert_eq!(split(3, &[100, 1, 1], 0), vec![1, 1, 1], "one each, however little wanted");
        assert_eq!(split(0, &[4, 4], 1), vec![0, 0]);
        // Fewer slots than data planes: each in turn, whatever it wanted.
        let turns: Vec<Vec<u64>> = (0..3).map(|r| split(1, &[5, 3, 1], r)).collect();
        assert_eq!(turns, vec![vec![1, 0, 0], vec![0, 1, 0], vec![0, 0, 1]]);
        for (share, demands) in [(9u64, vec![7u64, 3, 2, 8]), (4, vec![1, 1, 9]), (13, vec![2, 2, 2])] {
            let parts = split(share, &demands, 1);
            assert_eq!(
                parts.iter().sum::<u64>(),
                share.min(demands.iter().sum()),
                "{share} over {demands:?}: {parts:?}"
            );
        }
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
        assert_eq!(part_of(&loads.parts("dp-0", slots, now, 0), "t:light"), Some(1));
        for turn in 0..3 {
            let heavy: Vec<u32> = ["dp-1", "dp-2", "dp-3"]
                .iter()
                .map(|dp| part_of(&loads.parts(dp, slots, now, turn), "t:heavy").expect("heavy is held back"))
                .collect();
            assert_eq!(heavy.iter().sum::<u32>(), 1, "the flood shares the other slot, a data plane at a time");
        }
        assert_eq!(part_of(&loads.parts("dp-1", slots, now, 0), "t:light"), None, "dp-1 sends light nothing");

        // One data plane alone is fair in its own queue.
        let mut alone = Loads::default();
        alone.report("dp-0", &[load("t:light", 1), load("t:heavy", 12)], now);
        assert!(alone.parts("dp-0", slots, now, 0).parts.is_empty());
        // With slots to spare, nothing is held back.
        assert!(loads.parts("dp-1", |_| 40, now, 0).parts.is_empty());
        // Nor by a model of unknown slots.
        assert!(loads.parts("dp-1", |_| 0, now, 0).parts.is_empty());
    }

    #[test]
    fn data_planes_gone_quiet_are_not_counted() {
        let now = Instant::now();
        let mut loads = Loads::default();
        loads.report("dp-0", &[load("t:light", 1)], now);
        loads.report("dp-1", &[load("t:heavy", 12)], now);
        assert_eq!(part_of(&loads.parts("dp-1", |_| 2, now, 0), "t:heavy"), Some(1));
        let later = now + GONE_AFTER;
        assert!(loads.parts("dp-1", |_| 2, later, 0).parts.is_empty(), "dp-1 is gone itself");
        loads.report("dp-2", &[load("t:heavy", 12)], later);
        assert!(loads.parts("dp-0", |_| 2, later, 0).parts.is_empty(), "dp-0 is gone");
        assert!(loads.parts("dp-2", |_| 2, later, 0).parts.is_empty(), "the heavy flow is alone now");
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
        assert!(loads.parts(&past, |_| 1, now, 0).parts.is_empty(), "one past the bound is not followed");
    }

    #[test]
    fn every_controller_counts_the_same_turns() {
        let step = TURN_EVERY.as_millis() as u64;
        assert_eq!(turn_at(5 * step), turn_at(5 * step + step - 1));
        assert_eq!(turn_at(5 * step) + 1, turn_at(6 * step));
    }
}
