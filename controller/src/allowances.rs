//! Splits each API key's fleet-wide limits (requests per minute, requests
//! in flight) among the data planes, by what each asked of them lately.
//!
//! Data planes report what each key asked of them every second, and take
//! their parts back in the report's answer; each then applies its parts on
//! its own, with no call on a request's path. The parts of a limit add up
//! to the limit: a key gets its limit however a balancer spreads its
//! requests, give or take what one round of reports moves between data
//! planes. Pure: the caller brings the reports, the time and the keys.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use inferyes_proto::FastMap;
use inferyes_proto::allowance::even_part;
use inferyes_proto::v1::{Allowances, KeyAllowance, KeyDemand};

/// A data plane that has not reported for this long is gone: its parts go
/// to the others. Data planes report every second.
pub const GONE_AFTER: Duration = Duration::from_secs(5);
/// Keys one data plane's report names at most.
pub const MAX_KEYS: usize = 4096;
/// Data planes the books follow at most; a report from one more is
/// answered with no parts, and the data plane keeps its last.
pub const MAX_DATAPLANES: usize = 256;
/// The longest data plane id and key id the books take.
const MAX_ID: usize = 128;
/// A key's requests a minute below which a quiet data plane forgets it.
const FORGOTTEN_BELOW: f64 = 0.5;

/// A key's limits, as its record gives them: 0 is none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub requests_per_minute: u32,
    pub max_concurrent: u32,
}

/// What every data plane asked lately.
#[derive(Default)]
pub struct Books {
    dataplanes: BTreeMap<String, Book>,
}

struct Book {
    at: Instant,
    keys: FastMap<String, Want>,
    /// The parts last given it, of keys where they are not its even part
    /// (what it takes for a key it was given nothing of).
    given: FastMap<String, Part>,
}

/// A data plane's part of one key's limits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Part {
    requests_per_minute: u32,
    max_concurrent: u32,
}

/// What one key wants of one data plane.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Want {
    /// Requests a minute it asked for, smoothed over reports: it rises at
    /// once and falls by half a report, so a burst keeps its part a while.
    per_minute: f64,
    in_flight: u32,
    refused_in_flight: u32,
}

/// Why a report is not taken.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    Id,
    TooManyKeys,
    TooManyDataPlanes,
}

impl Books {
    /// Takes `dataplane`'s report of what its keys asked since its last.
    pub fn report(&mut self, dataplane: &str, demand: &[KeyDemand], now: Instant) -> Result<(), Refused> {
        if dataplane.is_empty() || dataplane.len() > MAX_ID {
            return Err(Refused::Id);
        }
        if demand.len() > MAX_KEYS {
            return Err(Refused::TooManyKeys);
        }
        self.dataplanes.retain(|_, book| now.saturating_duration_since(book.at) < GONE_AFTER);
        if !self.dataplanes.contains_key(dataplane) && self.dataplanes.len() >= MAX_DATAPLANES {
            return Err(Refused::TooManyDataPlanes);
        }
        let book = self.dataplanes.entry(dataplane.to_owned()).or_insert_with(|| Book {
            at: now,
            keys: FastMap::default(),
            given: FastMap::default(),
        });
        // A first report covers a second, however long the data plane ran.
        let seconds = now.saturating_duration_since(book.at).as_secs_f64().clamp(1.0, GONE_AFTER.as_secs_f64());
        book.at = now;
        let mut reported: FastMap<String, Want> = FastMap::default();
        for asked in demand.iter().filter(|d| !d.key_id.is_empty() && d.key_id.len() <= MAX_ID) {
            let sample = f64::from(asked.asked) * 60.0 / seconds;
            let before = book.keys.get(&asked.key_id).map_or(0.0, |want| want.per_minute);
            let want = Want {
                per_minute: smoothed(before, sample),
                in_flight: asked.in_flight,
                refused_in_flight: asked.refused_in_flight,
            };
            reported.insert(asked.key_id.clone(), want);
        }
        for (key, want) in &book.keys {
            if !reported.contains_key(key) {
                let per_minute = smoothed(want.per_minute, 0.0);
                if per_minute >= FORGOTTEN_BELOW {
                    reported.insert(key.clone(), Want { per_minute, ..Want::default() });
                }
            }
        }
        book.keys = reported;
        Ok(())
    }

    /// `dataplane`'s parts of the limits of every key some data plane asked
    /// of lately; `limits` gives a key's, `None` for a key that is gone.
    ///
    /// A part shrinks at once, and grows only into what the other data
    /// planes were last told they hold: a part taken from one data plane
    /// goes to another once the first has heard it, a report later. So the
    /// parts every data plane holds add up to the limit at any time, but
    /// for an answer lost on its way.
    pub fn allowances(&mut self, dataplane: &str, limits: impl Fn(&str) -> Option<Limits>, now: Instant) -> Allowances {
        self.dataplanes.retain(|_, book| now.saturating_duration_since(book.at) < GONE_AFTER);
        let Some(place) = self.dataplanes.keys().position(|id| id == dataplane) else {
            return Allowances::default();
        };
        let count = u32::try_from(self.dataplanes.len()).unwrap_or(u32::MAX);
        let books: Vec<&Book> = self.dataplanes.values().collect();
        let named: BTreeSet<&str> =
            books.iter().flat_map(|book| book.keys.keys().chain(book.given.keys())).map(String::as_str).collect();
        // Each key's part, and whether it is the even one; `None` for a
        // key with no limits (any more).
        let mut parts: Vec<(String, Option<(Part, bool)>)> = Vec::new();
        for key_id in named {
            let Some(limits) = limits(key_id).filter(|l| *l != Limits::default()) else {
                parts.push((key_id.to_owned(), None));
                continue;
            };
            let wants: Vec<Want> =
                books.iter().map(|book| book.keys.get(key_id).copied().unwrap_or_default()).collect();
            let rate: Vec<Claim> = wants.iter().map(|w| Claim { held: 0, more: w.per_minute }).collect();
            let room: Vec<Claim> =
                wants.iter().map(|w| Claim { held: w.in_flight, more: f64::from(w.refused_in_flight) }).collect();
            // What the others do not hold, as they were last told.
            let free = |limit: u32, of: fn(&Part) -> u32| -> u32 {
                let held = books
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != place)
                    .map(|(i, book)| book.given.get(key_id).map_or_else(|| even_part(limit, count, index(i)), of));
                limit.saturating_sub(held.fold(0, u32::saturating_add))
            };
            let part = Part {
                requests_per_minute: split(limits.requests_per_minute, &rate)[place]
                    .min(free(limits.requests_per_minute, |p| p.requests_per_minute)),
                max_concurrent: split(limits.max_concurrent, &room)[place]
                    .min(free(limits.max_concurrent, |p| p.max_concurrent)),
            };
            let even = Part {
                requests_per_minute: even_part(limits.requests_per_minute, count, index(place)),
                max_concurrent: even_part(limits.max_concurrent, count, index(place)),
            };
            parts.push((key_id.to_owned(), Some((part, part == even))));
        }
        let book = self.dataplanes.get_mut(dataplane).expect("placed above");
        let mut keys = Vec::new();
        for (key_id, part) in parts {
            let Some((part, even)) = part else {
                book.given.remove(&key_id);
                continue;
            };
            keys.push(KeyAllowance {
                key_id: key_id.clone(),
                requests_per_minute: part.requests_per_minute,
                max_concurrent: part.max_concurrent,
            });
            if even {
                book.given.remove(&key_id);
            } else {
                book.given.insert(key_id, part);
            }
        }
        Allowances { dataplanes: count, place: index(place), keys }
    }
}

fn index(place: usize) -> u32 {
    u32::try_from(place).unwrap_or(u32::MAX)
}

fn smoothed(before: f64, sample: f64) -> f64 {
    if sample >= before { sample } else { (before + sample) / 2.0 }
}

/// One data plane's claim on a limit: what it holds now (requests in
/// flight it cannot give back) and how much more it asked for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Claim {
    pub held: u32,
    pub more: f64,
}

/// Splits `limit` among claims, in whole parts that add up to it (or to
/// what is held, where that is more: nothing held is taken back). What is
/// not held goes by what each asked for; where that is less than there is,
/// each gets what it asked and the spare is spread evenly, so that a data
/// plane nobody used lately can still take a key's next request.
pub fn split(limit: u32, claims: &[Claim]) -> Vec<u32> {
    let mut parts: Vec<u32> = claims.iter().map(|c| c.held).collect();
    let held: u64 = parts.iter().map(|&p| u64::from(p)).sum();
    if claims.is_empty() || held >= u64::from(limit) {
        return parts;
    }
    let rest = u64::from(limit) - held;
    let asked: f64 = claims.iter().map(|c| c.more.max(0.0)).sum();
    #[allow(clippy::cast_precision_loss)] // limits are u32
    let (rest_f, n) = (rest as f64, claims.len() as f64);
    let shares: Vec<f64> = if asked <= rest_f {
        claims.iter().map(|c| c.more.max(0.0) + (rest_f - asked) / n).collect()
    } else {
        claims.iter().map(|c| rest_f * c.more.max(0.0) / asked).collect()
    };
    // Whole parts: each share's floor, then what is left by the largest
    // fractions (the first place on a tie).
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // 0 <= share <= rest
    let floors: Vec<u64> = shares.iter().map(|s| s.floor() as u64).collect();
    // Less than one a claim: the fractions sum to less than their count.
    let left = usize::try_from(rest.saturating_sub(floors.iter().sum())).unwrap_or(usize::MAX);
    let mut order: Vec<usize> = (0..claims.len()).collect();
    #[allow(clippy::cast_precision_loss)]
    order.sort_by(|&a, &b| (shares[b] - floors[b] as f64).total_cmp(&(shares[a] - floors[a] as f64)).then(a.cmp(&b)));
    for (i, floor) in floors.iter().enumerate() {
        parts[i] = parts[i].saturating_add(u32::try_from(*floor).unwrap_or(u32::MAX));
    }
    for &i in order.iter().take(left) {
        parts[i] = parts[i].saturating_add(1);
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims(more: &[f64]) -> Vec<Claim> {
        more.iter().map(|&more| Claim { held: 0, more }).collect()
    }

    #[test]
    fn parts_add_up_to_the_limit_whatever_was_asked() {
        for limit in [0, 1, 2, 3, 7, 60, 1000] {
            for asked in [&[0.0, 0.0, 0.0, 0.0][..], &[5.0, 0.0, 0.0, 1.0], &[1e9, 3.0, 0.5, 0.0], &[2.0, 2.0, 2.0]] {
                let parts = split(limit, &claims(asked));
                assert_eq!(parts.iter().sum::<u32>(), limit, "{limit} split by {asked:?}: {parts:?}");
            }
        }
    }

    #[test]
    fn what_is_asked_for_is_given_and_the_spare_spread_evenly() {
        // 60 a minute: one data plane asked for 20, the others nothing; each
        // of the four gets a tenth of the 40 spare.
        assert_eq!(split(60, &claims(&[20.0, 0.0, 0.0, 0.0])), vec![30, 10, 10, 10]);
        // Asked for more than there is: by what each asked.
        assert_eq!(split(60, &claims(&[300.0, 100.0, 0.0, 0.0])), vec![45, 15, 0, 0]);
        assert_eq!(split(4, &claims(&[10.0, 10.0, 10.0, 10.0])), vec![1, 1, 1, 1]);
    }

    #[test]
    fn requests_in_flight_are_never_taken_back() {
        let room = |held, more| Claim { held, more };
        // Four in flight on the first, three more asked on the second: the
        // limit of 4 is all held, and the second waits.
        assert_eq!(split(4, &[room(4, 0.0), room(0, 3.0)]), vec![4, 0]);
        // More held than the limit (a limit lowered): nothing is taken.
        assert_eq!(split(2, &[room(3, 0.0), room(1, 5.0)]), vec![3, 1]);
        // One in flight on each, a burst refused on the first: the two
        // spare go to it.
        assert_eq!(split(4, &[room(1, 6.0), room(1, 0.0)]), vec![3, 1]);
    }

    fn demand(key: &str, asked: u32, in_flight: u32, refused_in_flight: u32) -> KeyDemand {
        KeyDemand { key_id: key.into(), asked, in_flight, refused_in_flight }
    }

    fn limits(key: &str) -> Option<Limits> {
        (key == "k").then_some(Limits { requests_per_minute: 60, max_concurrent: 4 })
    }

    #[test]
    fn a_key_s_parts_follow_the_data_planes_it_was_asked_of() {
        let (mut books, start) = (Books::default(), Instant::now());
        books.report("dp-a", &[demand("k", 2, 2, 3)], start).unwrap();
        books.report("dp-b", &[], start).unwrap();
        let part =
            |rpm, max_concurrent| vec![KeyAllowance { key_id: "k".into(), requests_per_minute: rpm, max_concurrent }];
        // 120 a minute asked of dp-a (2 in its first second), more than the
        // 60 there are; it holds 2 in flight and asked 3 more. It keeps its
        // even half until dp-b has heard it holds none.
        let a = books.allowances("dp-a", limits, start);
        assert_eq!((a.dataplanes, a.place, a.keys), (2, 0, part(30, 2)));
        let b = books.allowances("dp-b", limits, start);
        assert_eq!((b.place, b.keys), (1, part(0, 0)));
        assert_eq!(books.allowances("dp-a", limits, start).keys, part(60, 4));

        // dp-a goes quiet and its claim fades; dp-b is asked now.
        let later = start + Duration::from_secs(1);
        books.report("dp-a", &[], later).unwrap();
        books.report("dp-b", &[demand("k", 1, 1, 0)], later).unwrap();
        let (a, b) = (books.allowances("dp-a", limits, later), books.allowances("dp-b", limits, later));
        // dp-a's 120 a minute fades to 60; dp-b asked 60: half each.
        assert_eq!((a.keys[0].requests_per_minute, b.keys[0].requests_per_minute), (30, 30));
        assert_eq!((a.keys[0].max_concurrent, b.keys[0].max_concurrent), (2, 2), "one held, the spare spread");

        // dp-a is gone: dp-b has it all, alone among the data planes.
        let gone = later + GONE_AFTER;
        books.report("dp-b", &[demand("k", 1, 0, 0)], gone).unwrap();
        let b = books.allowances("dp-b", limits, gone);
        assert_eq!((b.dataplanes, b.place, b.keys[0].requests_per_minute, b.keys[0].max_concurrent), (1, 0, 60, 4));
    }

    #[test]
    fn the_parts_data_planes_hold_never_add_up_past_the_limit() {
        // Four data planes reporting in turn, the key's traffic moving among
        // them at random; after each answer, what each holds as last told
        // (its even part before any) adds up to at most the limit.
        let (mut books, start) = (Books::default(), Instant::now());
        let names = ["dp-a", "dp-b", "dp-c", "dp-d"];
        for name in names {
            books.report(name, &[], start).unwrap();
        }
        let mut held = [(15, 1); 4];
        let mut seed = 7u64;
        for round in 0..400u64 {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let (i, busy) = (usize::try_from(round % 4).unwrap(), seed >> 33);
            let in_flight = u32::try_from(busy % 3).unwrap().min(held[i].1);
            let asked = demand("k", u32::try_from(busy % 50).unwrap(), in_flight, u32::try_from(busy % 5).unwrap());
            let now = start + Duration::from_millis(250 * round);
            books.report(names[i], &[asked], now).unwrap();
            let answer = books.allowances(names[i], limits, now);
            let part = answer.keys.first().map_or((15, 1), |k| (k.requests_per_minute, k.max_concurrent));
            held[i] = part;
            let (rpm, room): (u32, u32) = (held.iter().map(|h| h.0).sum(), held.iter().map(|h| h.1).sum());
            assert!(rpm <= 60 && room <= 4, "round {round}: parts held {held:?}");
        }
    }

    #[test]
    fn keys_without_limits_and_bad_reports_give_nothing() {
        let (mut books, now) = (Books::default(), Instant::now());
        books.report("dp-a", &[demand("unlimited", 5, 1, 0), demand("", 1, 0, 0)], now).unwrap();
        assert!(books.allowances("dp-a", limits, now).keys.is_empty());
        assert_eq!(books.allowances("dp-unknown", limits, now), Allowances::default());
        assert_eq!(books.report("", &[], now), Err(Refused::Id));
        let many: Vec<KeyDemand> = (0..=MAX_KEYS).map(|i| demand(&format!("k{i}"), 1, 0, 0)).collect();
        assert_eq!(books.report("dp-b", &many, now), Err(Refused::TooManyKeys));
        for i in 1..MAX_DATAPLANES {
            books.report(&format!("dp-{i}"), &[], now).unwrap();
        }
        assert_eq!(books.report("dp-one-more", &[], now), Err(Refused::TooManyDataPlanes));
    }
}
