//! This data plane's parts of each key's fleet-wide limits (requests per
//! minute, requests in flight, what is left of its daily budget), and what
//! the keys asked of it since its last report.
//!
//! A controller splits each limit among the data planes by what each asked
//! (`inferyes_controller::allowances`); the report loop carries what was
//! asked out to every controller and the parts back, once a second.
//! Requests only read the parts here and count what they asked: nothing on
//! a request's path waits for a controller.
//!
//! Each controller splits among the data planes that report to it, so a
//! data plane takes, key by key, the least part any controller gives it:
//! where every data plane reaches every controller, the parts add up to
//! the limit whichever controller each heard last. A controller not heard
//! for [`STALE_AFTER`] stops counting while another answers; a data plane
//! that reaches none keeps its last parts. One that no controller answered
//! yet holds nothing of a limited key; a controller that answers without
//! parts (one from before keys' limits were split) does not limit it.

use std::sync::{Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use inferyes_proto::FastMap;
use inferyes_proto::allowance::{unlisted_part, unlisted_part_u32};
use inferyes_proto::v1::{self, ApiKey, KeyDemand};

/// Keys counted between two reports at most; a key past them is not
/// counted, and takes its even part.
pub const MAX_KEYS: usize = 4096;
/// A controller's parts older than this stop counting while another
/// controller's are newer: it went away, or this data plane cannot reach
/// it. Reports go out every second.
pub const STALE_AFTER: Duration = Duration::from_secs(10);

#[derive(Default)]
pub struct Allowances {
    /// What each controller answered last, by the controller's place in
    /// the data plane's list.
    heard: RwLock<Vec<Option<Heard>>>,
    asked: Mutex<FastMap<String, Asked>>,
}

enum Heard {
    Split {
        at: Instant,
        answer: v1::Allowances,
        keys: FastMap<String, Part>,
        /// When this data plane sent the report whose answer was the last
        /// split that read the fleet's roll-up (not what it held, kept);
        /// `None` before one.
        read_since: Option<Instant>,
    },
    /// A controller that splits no limits.
    Unsplit { at: Instant },
}

impl Heard {
    fn at(&self) -> Instant {
        match self {
            Heard::Split { at, .. } | Heard::Unsplit { at } => *at,
        }
    }

    /// This controller's part of `limit`, a key's, by `of`; of a key it
    /// lists no part of, `unlisted`'s.
    fn part<T>(&self, key_id: &str, limit: T, of: impl Fn(&Part) -> T, unlisted: impl Fn(&v1::Allowances) -> T) -> T {
        match self {
            Heard::Unsplit { .. } => limit,
            Heard::Split { answer, keys, .. } => match keys.get(key_id) {
                Some(part) => of(part),
                None => unlisted(answer),
            },
        }
    }

    fn splits_budgets(&self) -> bool {
        matches!(self, Heard::Split { answer, .. } if answer.budgets)
    }
}

#[derive(Clone, Copy, Default)]
struct Part {
    requests_per_minute: u32,
    max_concurrent: u32,
    tokens: u64,
    overdraft: u32,
}

#[derive(Clone, Copy, Default)]
struct Asked {
    asked: u32,
    refused_in_flight: u32,
    tokens_refused: u64,
}

impl Allowances {
    /// This data plane's part of `grant`'s requests per minute, counting
    /// the request that asks; 0 where the key has no such limit.
    pub fn requests_per_minute(&self, grant: &ApiKey) -> u32 {
        if grant.requests_per_minute == 0 && grant.max_concurrent == 0 {
            return 0;
        }
        self.count(&grant.key_id, |asked| asked.asked = asked.asked.saturating_add(1));
        let limit = grant.requests_per_minute;
        self.part(grant, limit, |part| part.requests_per_minute, |answer| unlisted_part_u32(limit, answer))
    }

    /// This data plane's part of `grant`'s requests in flight; `None` where
    /// the key has no such limit.
    pub fn max_concurrent(&self, grant: &ApiKey) -> Option<u32> {
        let limit = grant.max_concurrent;
        (limit > 0)
            .then(|| self.part(grant, limit, |part| part.max_concurrent, |answer| unlisted_part_u32(limit, answer)))
    }

    /// This data plane's part of what is left today of `grant`'s daily
    /// budget (of a key with one), and whether it holds the budget's
    /// overdraft. `spent_today`: the roll-up this data plane holds shows
    /// some of the budget spent, so that a part not listed is none (the
    /// whole budget's even part is of a budget nobody spent of).
    pub fn budget(&self, grant: &ApiKey, spent_today: bool) -> crate::usage::BudgetPart {
        let budget = grant.tokens_per_day;
        let even = |answer: &v1::Allowances| if spent_today { 0 } else { unlisted_part(budget, answer) };
        // A controller that splits no budgets limits none.
        let tokens = self.fold(budget, |heard| match heard.splits_budgets() {
            true => heard.part(&grant.key_id, budget, |part| part.tokens, even),
            false => budget,
        });
        let overdraft = self.fold(1, |heard| match heard.splits_budgets() {
            true => heard.part(&grant.key_id, 1, |part| part.overdraft, |answer| unlisted_part_u32(1, answer)),
            false => 1,
        });
        crate::usage::BudgetPart { tokens, overdraft: overdraft >= 1 }
    }

    /// Tokens a controller acknowledged before this are in the roll-up that
    /// the last split (not a kept answer) of every controller heard lately
    /// that splits budgets read: forgotten, as far as
    /// [`crate::usage::ROLLED_UP_WITHIN`] holds. `None`: forget none yet.
    /// Read before the part it is held against: a split taken in between
    /// only moves it later.
    pub fn forget_acknowledged_before(&self, now: Instant) -> Option<Instant> {
        let within = crate::usage::ROLLED_UP_WITHIN;
        let mut before = now.checked_sub(within)?;
        let heard = self.heard.read().unwrap_or_else(PoisonError::into_inner);
        let newest = heard.iter().flatten().map(Heard::at).max()?;
        let fresh = heard.iter().flatten().filter(|heard| newest.saturating_duration_since(heard.at()) < STALE_AFTER);
        for heard in fresh.filter(|heard| heard.splits_budgets()) {
            if let Heard::Split { read_since, .. } = heard {
                before = before.min(read_since.and_then(|read| read.checked_sub(within))?);
            }
        }
        Some(before)
    }

    /// A request of `key_id` refused for want of this data plane's part of
    /// what is left of its budget: the `tokens` it would have held are
    /// asked for, for the next split.
    pub fn refused_tokens(&self, key_id: &str, tokens: u64) {
        self.count(key_id, |asked| asked.tokens_refused = asked.tokens_refused.saturating_add(tokens));
    }

    /// A request of `key_id` refused for want of its part of requests in
    /// flight: asked for, for the next split.
    pub fn refused_in_flight(&self, key_id: &str) {
        self.count(key_id, |asked| asked.refused_in_flight = asked.refused_in_flight.saturating_add(1));
    }

    /// What the keys asked since the last call, with the requests in flight
    /// of the keys that hold any and have a limit of them, and what the
    /// keys with budgets hold of them: the keys that hold anything first,
    /// then the busiest, [`MAX_KEYS`] in all.
    pub fn demand(&self, in_flight: &[(String, u32)], holdings: &[crate::usage::Holding]) -> Vec<KeyDemand> {
        let asked = std::mem::take(&mut *self.asked.lock().unwrap_or_else(PoisonError::into_inner));
        let mut demand: FastMap<String, KeyDemand> = asked
            .into_iter()
            .map(|(key_id, asked)| {
                let demand = KeyDemand {
                    key_id: key_id.clone(),
                    asked: asked.asked,
                    refused_in_flight: asked.refused_in_flight,
                    tokens_refused: asked.tokens_refused,
                    ..KeyDemand::default()
                };
                (key_id, demand)
            })
            .collect();
        let new = |key_id: &String| KeyDemand { key_id: key_id.clone(), ..KeyDemand::default() };
        for (key_id, count) in in_flight {
            inferyes_proto::value_for(&mut demand, key_id, || new(key_id)).in_flight = *count;
        }
        for holding in holdings {
            let key = inferyes_proto::value_for(&mut demand, &holding.key_id, || new(&holding.key_id));
            (key.tokens_held, key.overdrawn) = (holding.tokens, holding.overdrawn);
        }
        let mut demand: Vec<KeyDemand> = demand.into_values().collect();
        // What is held is what a split must never give away, an overdraft
        // above all.
        let order = |d: &KeyDemand| {
            let holds = d.in_flight > 0 || d.tokens_held > 0;
            (d.overdrawn, holds, d.in_flight, u64::from(d.asked) + u64::from(d.refused_in_flight) + d.tokens_refused)
        };
        demand.sort_unstable_by(|a, b| order(b).cmp(&order(a)).then_with(|| a.key_id.cmp(&b.key_id)));
        demand.truncate(MAX_KEYS);
        demand
    }

    /// Takes the answer of controller `from` (its place in the data
    /// plane's list): what it gives replaces all it gave before. `None`: it
    /// splits no limits.
    /// `asked`: when the report it answers was sent.
    pub fn take(&self, from: usize, answer: Option<v1::Allowances>, asked: Instant, now: Instant) {
        // Built before the lock every request reads is taken.
        let keys: Option<FastMap<String, Part>> = answer.as_ref().map(|answer| {
            let part = |key: &v1::KeyAllowance| Part {
                requests_per_minute: key.requests_per_minute,
                max_concurrent: key.max_concurrent,
                tokens: key.tokens,
                overdraft: key.overdraft,
            };
            answer.keys.iter().map(|key| (key.key_id.clone(), part(key))).collect()
        });
        let mut all = self.heard.write().unwrap_or_else(PoisonError::into_inner);
        if all.len() <= from {
            all.resize_with(from + 1, || None);
        }
        let heard = match (answer, keys) {
            (Some(answer), Some(keys)) => {
                let read_since = match (&all[from], answer.kept) {
                    (_, false) => Some(asked),
                    (Some(Heard::Split { read_since, .. }), true) => *read_since,
                    (_, true) => None,
                };
                Heard::Split { at: now, answer, keys, read_since }
            }
            _ => Heard::Unsplit { at: now },
        };
        all[from] = Some(heard);
    }

    /// The parts this data plane applies of controller `from`'s split, as
    /// its last answer gave them: what that controller takes it to hold.
    pub fn held(&self, from: usize) -> Option<v1::Allowances> {
        match self.heard.read().unwrap_or_else(PoisonError::into_inner).get(from) {
            Some(Some(Heard::Split { answer, .. })) => Some(answer.clone()),
            _ => None,
        }
    }

    /// The data planes the fleet's limits are split among, the most any
    /// controller heard lately counts; 0 before any split them.
    pub fn dataplanes(&self) -> u32 {
        let heard = self.heard.read().unwrap_or_else(PoisonError::into_inner);
        let newest = heard.iter().flatten().map(Heard::at).max();
        heard
            .iter()
            .flatten()
            .filter(|heard| newest.is_some_and(|newest| newest.saturating_duration_since(heard.at()) < STALE_AFTER))
            .filter_map(|heard| match heard {
                Heard::Split { answer, .. } => Some(answer.dataplanes),
                Heard::Unsplit { .. } => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// Expects answers from `controllers` controllers: until each has
    /// answered, the split is not whole here ([`Allowances::settling`]).
    pub fn expect(&self, controllers: usize) {
        let mut heard = self.heard.write().unwrap_or_else(PoisonError::into_inner);
        if heard.len() < controllers {
            heard.resize_with(controllers, || None);
        }
    }

    /// Whether the split is not whole here: a controller expected has not
    /// answered yet, or one's split is settling (this data plane takes
    /// less than its even parts of keys nobody asked of).
    pub fn settling(&self) -> bool {
        let heard = self.heard.read().unwrap_or_else(PoisonError::into_inner);
        let newest = heard.iter().flatten().map(Heard::at).max();
        let fresh = heard
            .iter()
            .flatten()
            .filter(|heard| newest.is_some_and(|newest| newest.saturating_duration_since(heard.at()) < STALE_AFTER));
        heard.is_empty()
            || heard.iter().any(Option::is_none)
            || fresh.into_iter().any(|heard| matches!(heard, Heard::Split { answer, .. } if answer.settling))
    }

    fn part<T: Ord + Copy + Default>(
        &self,
        grant: &ApiKey,
        limit: T,
        of: impl Fn(&Part) -> T,
        unlisted: impl Fn(&v1::Allowances) -> T,
    ) -> T {
        self.fold(limit, |heard| heard.part(&grant.key_id, limit, &of, &unlisted))
    }

    /// The least of `each` over the controllers heard lately, and `limit`:
    /// the controllers' parts are of the limits they read, and a key's
    /// record changed since is held to its new limit. Nothing before any
    /// controller answered.
    fn fold<T: Ord + Copy + Default>(&self, limit: T, each: impl Fn(&Heard) -> T) -> T {
        let heard = self.heard.read().unwrap_or_else(PoisonError::into_inner);
        let Some(newest) = heard.iter().flatten().map(Heard::at).max() else { return T::default() };
        heard
            .iter()
            .flatten()
            .filter(|heard| newest.saturating_duration_since(heard.at()) < STALE_AFTER)
            .map(each)
            .fold(limit, T::min)
    }

    fn count(&self, key_id: &str, add: impl FnOnce(&mut Asked)) {
        let mut asked = self.asked.lock().unwrap_or_else(PoisonError::into_inner);
        if asked.len() < MAX_KEYS || asked.contains_key(key_id) {
            add(inferyes_proto::value_for(&mut asked, key_id, Asked::default));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str, rpm: u32, max_concurrent: u32) -> ApiKey {
        ApiKey { key_id: id.into(), requests_per_minute: rpm, max_concurrent, ..ApiKey::default() }
    }

    fn split(dataplanes: u32, place: u32, requests_per_minute: u32, max_concurrent: u32) -> Option<v1::Allowances> {
        let key = v1::KeyAllowance { key_id: "k".into(), requests_per_minute, max_concurrent, ..Default::default() };
        Some(v1::Allowances { dataplanes, place, keys: vec![key], ..v1::Allowances::default() })
    }

    #[test]
    fn a_limited_key_has_nothing_until_a_controller_answers_then_its_part() {
        let allowances = Allowances::default();
        let (limited, other) = (key("k", 60, 4), key("other", 10, 0));
        assert_eq!((allowances.requests_per_minute(&limited), allowances.max_concurrent(&limited)), (0, Some(0)));
        assert!(allowances.settling(), "no controller answered yet");
        allowances.take(0, split(4, 3, 45, 3), Instant::now(), Instant::now());
        assert!(!allowances.settling());
        assert_eq!((allowances.requests_per_minute(&limited), allowances.max_concurrent(&limited)), (45, Some(3)));
        assert_eq!((allowances.requests_per_minute(&other), allowances.max_concurrent(&other)), (2, None));
        // A limit lowered since the split holds.
        assert_eq!(allowances.requests_per_minute(&key("k", 30, 0)), 30);
        assert_eq!(allowances.dataplanes(), 4);
        assert_eq!(allowances.held(0), split(4, 3, 45, 3), "what it holds goes back with its next report");
        assert_eq!(allowances.held(1), None);
    }

    #[test]
    fn a_settling_split_gives_no_even_part_and_a_controller_without_parts_limits_nothing() {
        let allowances = Allowances::default();
        let mut settling = split(4, 0, 45, 3);
        settling.as_mut().unwrap().settling = true;
        allowances.take(0, settling, Instant::now(), Instant::now());
        assert_eq!(allowances.requests_per_minute(&key("k", 60, 0)), 45);
        assert_eq!(allowances.requests_per_minute(&key("even", 60, 0)), 0);
        assert!(allowances.settling());
        let unsplit = Allowances::default();
        unsplit.take(0, None, Instant::now(), Instant::now());
        assert_eq!(unsplit.requests_per_minute(&key("k", 60, 0)), 60);
    }

    #[test]
    fn the_least_part_any_controller_gives_counts_until_it_goes_stale() {
        let (allowances, limited, now) = (Allowances::default(), key("k", 60, 4), Instant::now());
        allowances.expect(3);
        allowances.take(0, split(4, 0, 45, 3), now, now);
        assert!(allowances.settling(), "two controllers still to answer");
        // A controller that counts five data planes.
        allowances.take(2, split(5, 1, 50, 1), now, now);
        assert_eq!((allowances.requests_per_minute(&limited), allowances.max_concurrent(&limited)), (45, Some(1)));
        assert_eq!(allowances.requests_per_minute(&key("even", 60, 0)), 12, "a fifth of 60 is less than a quarter");
        assert_eq!(allowances.dataplanes(), 5);
        // The second controller not heard for a while: the first's parts.
        allowances.take(0, split(4, 0, 40, 2), now + STALE_AFTER, now + STALE_AFTER);
        assert_eq!((allowances.requests_per_minute(&limited), allowances.max_concurrent(&limited)), (40, Some(2)));
        assert_eq!(allowances.dataplanes(), 4);
    }

    #[test]
    fn a_budget_s_part_is_the_least_listed_and_an_unlisted_one_the_even_part_of_a_budget_nobody_spent_of() {
        let (allowances, now) = (Allowances::default(), Instant::now());
        let budgeted = ApiKey { key_id: "k".into(), tokens_per_day: 1_000, ..ApiKey::default() };
        let part = |tokens, overdraft| crate::usage::BudgetPart { tokens, overdraft };
        assert_eq!(allowances.budget(&budgeted, false), part(0, false), "nothing before an answer");
        allowances.expect(2);
        let listed = v1::KeyAllowance { key_id: "k".into(), tokens: 300, overdraft: 1, ..Default::default() };
        let splits = |answer| Some(v1::Allowances { dataplanes: 4, budgets: true, ..answer });
        allowances.take(0, splits(v1::Allowances { keys: vec![listed], ..Default::default() }), now, now);
        allowances.take(1, splits(v1::Allowances { place: 2, ..Default::default() }), now, now);
        assert_eq!(
            allowances.budget(&budgeted, false),
            part(250, false),
            "a quarter of 1,000; the overdraft at place 0"
        );
        assert_eq!(allowances.budget(&budgeted, true), part(0, false), "spent of today: not listed is none");
        allowances.take(1, None, now, now);
        assert_eq!(allowances.budget(&budgeted, true), part(300, true), "a controller that splits no budgets");
        let lowered = ApiKey { tokens_per_day: 200, ..budgeted.clone() };
        assert_eq!(allowances.budget(&lowered, true), part(200, true), "a budget lowered since the split holds");
        // A controller from before budgets were split limits none.
        let old = Allowances::default();
        let listed = v1::KeyAllowance { key_id: "k".into(), requests_per_minute: 3, ..Default::default() };
        old.take(0, Some(v1::Allowances { dataplanes: 4, keys: vec![listed], ..Default::default() }), now, now);
        assert_eq!(old.budget(&budgeted, true), part(1_000, true));
    }

    #[test]
    fn acknowledged_tokens_are_forgotten_once_every_controller_split_after_the_roll_up_could_show_them() {
        let (allowances, start) = (Allowances::default(), Instant::now());
        let within = crate::usage::ROLLED_UP_WITHIN;
        let at = |seconds| start + Duration::from_secs(seconds);
        let budgets = |kept| Some(v1::Allowances { dataplanes: 1, budgets: true, kept, ..Default::default() });
        assert_eq!(allowances.forget_acknowledged_before(at(20)), None, "no controller answered");
        allowances.take(0, budgets(false), at(10), at(10));
        assert_eq!(allowances.forget_acknowledged_before(at(20)), Some(at(10) - within));
        allowances.take(1, budgets(false), at(12), at(12));
        assert_eq!(allowances.forget_acknowledged_before(at(20)), Some(at(10) - within));
        // A starting controller gives back what was held: it read nothing.
        allowances.take(0, budgets(true), at(15), at(15));
        assert_eq!(allowances.forget_acknowledged_before(at(20)), Some(at(10) - within));
        allowances.take(0, budgets(false), at(16), at(16));
        assert_eq!(allowances.forget_acknowledged_before(at(20)), Some(at(12) - within));
        assert_eq!(
            allowances.forget_acknowledged_before(at(11)),
            Some(at(11) - within),
            "never sooner than the roll-up"
        );
        // A controller that splits no budgets holds nothing back.
        allowances.take(1, None, at(17), at(17));
        assert_eq!(allowances.forget_acknowledged_before(at(30)), Some(at(16) - within));
    }

    #[test]
    fn demand_holds_an_overdraft_first_then_what_is_held_then_the_busiest() {
        let allowances = Allowances::default();
        for _ in 0..3 {
            allowances.requests_per_minute(&key("busy", 60, 0));
        }
        allowances.requests_per_minute(&key("quiet", 60, 0));
        allowances.requests_per_minute(&key("unlimited", 0, 0));
        allowances.refused_in_flight("quiet");
        allowances.refused_tokens("budget", 500);
        let holding = crate::usage::Holding { key_id: "spending".into(), tokens: 40, overdrawn: true };
        let demand = allowances.demand(&[("holding".into(), 2)], &[holding]);
        let seen: Vec<(&str, u32, u32, u32, u64, u64, bool)> = demand
            .iter()
            .map(|d| {
                (
                    d.key_id.as_str(),
                    d.asked,
                    d.in_flight,
                    d.refused_in_flight,
                    d.tokens_held,
                    d.tokens_refused,
                    d.overdrawn,
                )
            })
            .collect();
        assert_eq!(
            seen,
            vec![
                ("spending", 0, 0, 0, 40, 0, true),
                ("holding", 0, 2, 0, 0, 0, false),
                ("budget", 0, 0, 0, 0, 500, false),
                ("busy", 3, 0, 0, 0, 0, false),
                ("quiet", 1, 0, 1, 0, 0, false)
            ]
        );
        assert_eq!(allowances.demand(&[], &[]), Vec::new(), "each ask is reported once");
    }
}
