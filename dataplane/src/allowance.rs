//! This data plane's parts of each key's fleet-wide limits (requests per
//! minute, requests in flight), and what the keys asked of it since its
//! last report.
//!
//! A controller splits each limit among the data planes by what each asked
//! (`inferyes_controller::allowances`); the report loop carries what was
//! asked out and the parts back, once a second. Requests only read the
//! parts here and count what they asked: nothing on a request's path waits
//! for a controller. A data plane that reaches no controller keeps its
//! last parts; one that never reached one applies each key's whole limit,
//! as a lone data plane would.

use std::sync::{Mutex, PoisonError, RwLock};

use inferyes_proto::FastMap;
use inferyes_proto::v1::{self, ApiKey, KeyDemand};

/// Keys counted between two reports at most; a key past them is not
/// counted, and takes its even part.
pub const MAX_KEYS: usize = 4096;

#[derive(Default)]
pub struct Allowances {
    parts: RwLock<Parts>,
    asked: Mutex<FastMap<String, Asked>>,
}

#[derive(Default)]
struct Parts {
    /// Whether a controller ever answered with parts.
    heard: bool,
    dataplanes: u32,
    place: u32,
    keys: FastMap<String, Part>,
}

#[derive(Clone, Copy, Default)]
struct Part {
    requests_per_minute: u32,
    max_concurrent: u32,
}

#[derive(Clone, Copy, Default)]
struct Asked {
    asked: u32,
    refused_in_flight: u32,
}

impl Allowances {
    /// This data plane's part of `grant`'s requests per minute, counting
    /// the request that asks; 0 where the key has no such limit.
    pub fn requests_per_minute(&self, grant: &ApiKey) -> u32 {
        if grant.requests_per_minute == 0 && grant.max_concurrent == 0 {
            return 0;
        }
        self.count(&grant.key_id, |asked| asked.asked = asked.asked.saturating_add(1));
        self.part(grant, grant.requests_per_minute, |part| part.requests_per_minute)
    }

    /// This data plane's part of `grant`'s requests in flight; `None` where
    /// the key has no such limit.
    pub fn max_concurrent(&self, grant: &ApiKey) -> Option<u32> {
        (grant.max_concurrent > 0).then(|| self.part(grant, grant.max_concurrent, |part| part.max_concurrent))
    }

    /// A request of `key_id` refused for want of its part of requests in
    /// flight: asked for, for the next split.
    pub fn refused_in_flight(&self, key_id: &str) {
        self.count(key_id, |asked| asked.refused_in_flight = asked.refused_in_flight.saturating_add(1));
    }

    /// What the keys asked since the last call, with their requests in
    /// flight now (`in_flight` gives the keys that hold any): the busiest
    /// [`MAX_KEYS`].
    pub fn demand(&self, in_flight: &[(String, u32)]) -> Vec<KeyDemand> {
        let asked = std::mem::take(&mut *self.asked.lock().unwrap_or_else(PoisonError::into_inner));
        let mut demand: FastMap<String, KeyDemand> = asked
            .into_iter()
            .map(|(key_id, asked)| {
                let demand = KeyDemand {
                    key_id: key_id.clone(),
                    asked: asked.asked,
                    in_flight: 0,
                    refused_in_flight: asked.refused_in_flight,
                };
                (key_id, demand)
            })
            .collect();
        for (key_id, count) in in_flight {
            inferyes_proto::value_for(&mut demand, key_id, || KeyDemand {
                key_id: key_id.clone(),
                ..KeyDemand::default()
            })
            .in_flight = *count;
        }
        let mut demand: Vec<KeyDemand> = demand.into_values().collect();
        let busy = |d: &KeyDemand| u64::from(d.asked) + u64::from(d.in_flight) + u64::from(d.refused_in_flight);
        demand.sort_unstable_by(|a, b| busy(b).cmp(&busy(a)).then_with(|| a.key_id.cmp(&b.key_id)));
        demand.truncate(MAX_KEYS);
        demand
    }

    /// Takes a controller's answer: the parts it gives replace all before.
    pub fn take(&self, answer: v1::Allowances) {
        let keys = answer
            .keys
            .into_iter()
            .map(|key| {
                let part = Part { requests_per_minute: key.requests_per_minute, max_concurrent: key.max_concurrent };
                (key.key_id, part)
            })
            .collect();
        let parts = Parts { heard: true, dataplanes: answer.dataplanes, place: answer.place, keys };
        *self.parts.write().unwrap_or_else(PoisonError::into_inner) = parts;
    }

    /// The data planes the fleet's limits are split among, as last heard;
    /// 0 before any controller answered.
    pub fn dataplanes(&self) -> u32 {
        self.parts.read().unwrap_or_else(PoisonError::into_inner).dataplanes
    }

    fn part(&self, grant: &ApiKey, limit: u32, of: impl Fn(&Part) -> u32) -> u32 {
        let parts = self.parts.read().unwrap_or_else(PoisonError::into_inner);
        if !parts.heard {
            return limit;
        }
        // The controller's parts are of the limits it read; a key's record
        // changed since is held to its new limit.
        match parts.keys.get(&grant.key_id) {
            Some(part) => of(part).min(limit),
            None => inferyes_proto::allowance::even_part(limit, parts.dataplanes, parts.place),
        }
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

    #[test]
    fn parts_are_the_whole_limit_until_a_controller_answers_then_its_split() {
        let allowances = Allowances::default();
        let (limited, other) = (key("k", 60, 4), key("other", 10, 0));
        assert_eq!((allowances.requests_per_minute(&limited), allowances.max_concurrent(&limited)), (60, Some(4)));
        allowances.take(v1::Allowances {
            dataplanes: 4,
            place: 3,
            keys: vec![v1::KeyAllowance { key_id: "k".into(), requests_per_minute: 45, max_concurrent: 3 }],
        });
        assert_eq!((allowances.requests_per_minute(&limited), allowances.max_concurrent(&limited)), (45, Some(3)));
        assert_eq!((allowances.requests_per_minute(&other), allowances.max_concurrent(&other)), (2, None));
        // A limit lowered since the split holds.
        assert_eq!(allowances.requests_per_minute(&key("k", 30, 0)), 30);
        assert_eq!(allowances.dataplanes(), 4);
    }

    #[test]
    fn demand_is_what_was_asked_since_the_last_report_busiest_first() {
        let allowances = Allowances::default();
        for _ in 0..3 {
            allowances.requests_per_minute(&key("busy", 60, 0));
        }
        allowances.requests_per_minute(&key("quiet", 60, 0));
        allowances.requests_per_minute(&key("unlimited", 0, 0));
        allowances.refused_in_flight("quiet");
        let demand = allowances.demand(&[("holding".into(), 2)]);
        let seen: Vec<(&str, u32, u32, u32)> =
            demand.iter().map(|d| (d.key_id.as_str(), d.asked, d.in_flight, d.refused_in_flight)).collect();
        assert_eq!(seen, vec![("busy", 3, 0, 0), ("holding", 0, 2, 0), ("quiet", 1, 0, 1)]);
        assert_eq!(allowances.demand(&[]), Vec::new(), "each ask is reported once");
    }
}
