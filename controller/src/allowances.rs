//! Splits each API key's fleet-wide limits (requests per minute, requests
//! in flight, what is left of its daily budget) among the data planes, by
//! what each asked of them lately.
//!
//! Data planes report to every controller, every second, what each key
//! asked of them and the parts they hold of this controller's last split;
//! each takes its new parts back in the answer and applies, key by key,
//! the least part any controller gave it, with no call on a request's path.
//!
//! The parts data planes hold of one controller's split add up to at most
//! the limit at any time, as each data plane says it holds them or was
//! last given them, whichever is more:
//! - a part grows only into what the others hold;
//! - a key listed in no answer is split evenly by place. Even parts only
//!   shrink as data planes join and only grow as they go; while any data
//!   plane still holds even parts of a split among other members, the
//!   others take the lesser of their old and new even parts (`settling`),
//!   a newcomer none;
//! - a data plane that has not heard this controller holds nothing of it,
//!   and for a while after this controller starts each keeps what it holds.
//!
//! A daily budget is split as what the roll-up leaves of it: a data plane
//! holds its tokens in flight and those it used that the roll-up may not
//! show yet, and admits a request only where the request's tokens fit in
//! its part. The budget's overdraft (a limit of 1) lets the one data plane
//! that holds it admit one request past its part, so that the last tokens
//! of a budget are spent: the fleet overruns a budget by at most one
//! request's worth.
//!
//! Pure: the caller brings the reports, the time and the keys' limits.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use inferyes_proto::allowance::unlisted_part;
use inferyes_proto::v1::{Allowances, KeyAllowance, KeyDemand};
use inferyes_proto::{FastMap, FastSet, value_for};

/// A data plane that has not reported for this long is gone: its parts go
/// to the others. Data planes report every second.
pub const GONE_AFTER: Duration = Duration::from_secs(5);
/// Keys the books follow for one data plane at most.
pub const MAX_KEYS: usize = 4096;
/// Data planes the books follow at most. Each report's answer weighs every
/// key some data plane asked of against every data plane: its cost grows
/// with the keys times the data planes, and reports with the data planes.
pub const MAX_DATAPLANES: usize = 32;
/// The longest data plane id the books take.
const MAX_ID: usize = 128;
/// Requests a minute one report counts at most for a key.
const MAX_PER_MINUTE: f64 = 1e6;
/// A key's claim below which a quiet data plane forgets it.
const FORGOTTEN_BELOW: f64 = 0.5;

/// A key's limits, as its record gives them: 0 is none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub requests_per_minute: u32,
    pub max_concurrent: u32,
    pub tokens: Option<Budget>,
}

/// A key's daily budget, and what the fleet's roll-up leaves of it today.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Budget {
    pub per_day: u64,
    pub left: u64,
}

impl Limits {
    fn any(self) -> bool {
        self != Limits::default()
    }

    /// What is split now, by kind.
    fn now(self) -> Part {
        let tokens = self.tokens.map_or(0, |budget| budget.left);
        Part([
            u64::from(self.requests_per_minute),
            u64::from(self.max_concurrent),
            tokens,
            u64::from(self.tokens.is_some()),
        ])
    }

    /// What a part not listed is an even part of, by kind: of a budget, the
    /// whole of it, which no part of today's split can exceed.
    fn whole(self) -> Part {
        let mut whole = self.now();
        whole.0[TOKENS] = self.tokens.map_or(0, |budget| budget.per_day);
        whole
    }
}

/// What every data plane asked lately, and what each holds.
#[derive(Default)]
pub struct Books {
    dataplanes: BTreeMap<String, Book>,
    /// When the first report came: for a while after, data planes that
    /// have not reported yet may hold parts of an earlier split (this
    /// controller restarted), and each keeps what it holds.
    started: Option<Instant>,
}

struct Book {
    at: Instant,
    /// The reporting process's own number, and its last report's: another
    /// process under the id is refused while this one reports, and a report
    /// older than one taken is refused.
    instance: u64,
    sequence: u64,
    /// What it asked of each key and holds of it: one lookup a key, as an
    /// answer weighs every key against every data plane.
    keys: FastMap<String, Slot>,
    /// The splits it holds parts of, as it said, and as this controller
    /// last gave it: it may have taken either. Of a key it holds no listed
    /// part of, it holds the split's even part.
    said: Option<Split>,
    given: Option<Split>,
}

/// What one key asked of one data plane, and the parts it holds of the
/// key as listed in what it said it holds and in what it was given.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Slot {
    want: Want,
    said: Option<Part>,
    given: Option<Part>,
}

impl Slot {
    fn empty(&self) -> bool {
        *self == Slot::default()
    }
}

/// A split a data plane holds parts of, its keys' parts in their slots.
#[derive(Debug, PartialEq)]
struct Split {
    parts: Allowances,
    /// Listed more keys than the books keep: one not kept is taken to be
    /// held whole.
    cut: bool,
}

/// A data plane's part of one key's limits, by kind: [`RATE`], [`ROOM`],
/// [`TOKENS`], [`OVERDRAFT`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Part([u64; KINDS]);

const KINDS: usize = 4;
/// Requests per minute.
const RATE: usize = 0;
/// Requests in flight.
const ROOM: usize = 1;
/// Tokens of what is left of a daily budget.
const TOKENS: usize = 2;
/// One request at a time past a data plane's part of a budget.
const OVERDRAFT: usize = 3;

impl Part {
    fn of(key: &KeyAllowance) -> Part {
        Part([u64::from(key.requests_per_minute), u64::from(key.max_concurrent), key.tokens, u64::from(key.overdraft)])
    }

    /// As an answer lists it. No part is more than its limit, and limits
    /// of requests are `u32`.
    fn allowance(self, key_id: &str) -> KeyAllowance {
        let small = |kind: usize| u32::try_from(self.0[kind]).unwrap_or(u32::MAX);
        KeyAllowance {
            key_id: key_id.to_owned(),
            requests_per_minute: small(RATE),
            max_concurrent: small(ROOM),
            tokens: self.0[TOKENS],
            overdraft: small(OVERDRAFT),
        }
    }

    /// The even parts of `whole` that `parts` gives a key it does not list.
    fn unlisted(whole: Part, parts: &Allowances) -> Part {
        Part(whole.0.map(|limit| unlisted_part(limit, parts)))
    }
}

/// What one key wants of one data plane, smoothed over reports: a claim
/// rises at once and falls by half a report, so a burst keeps its part a
/// while.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Want {
    per_minute: f64,
    in_flight: u32,
    refused_in_flight: f64,
    tokens_held: u64,
    tokens_refused: f64,
    overdrawn: bool,
}

impl Want {
    /// What it claims of each kind of limit: what it holds, and how much
    /// more it asked for.
    fn claims(self) -> [Claim; KINDS] {
        [
            Claim { held: 0, more: self.per_minute },
            Claim { held: u64::from(self.in_flight), more: self.refused_in_flight },
            Claim { held: self.tokens_held, more: self.tokens_refused },
            // Asked for by anything refused for want of tokens.
            Claim { held: u64::from(self.overdrawn), more: self.tokens_refused.min(1.0) },
        ]
    }
}

/// Why a report is not taken.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    Id,
    TooManyDataPlanes,
    /// Another process reports under this data plane's id.
    Twin,
    /// A report older than one taken, or sooner after it than
    /// [`MIN_REPORT_GAP`].
    Stale,
}

/// Reports of one data plane closer than this are refused: each costs an
/// answer that weighs every key against every data plane.
pub const MIN_REPORT_GAP: Duration = Duration::from_millis(250);

/// One data plane's report, as the books take it.
pub struct Report<'a> {
    pub dataplane: &'a str,
    pub instance: u64,
    pub sequence: u64,
    pub demand: &'a [KeyDemand],
    pub held: Option<&'a Allowances>,
}

impl Books {
    /// Takes a data plane's report of what its keys asked since its last,
    /// and what it holds. Only keys with limits count (`limits`).
    pub fn report(
        &mut self,
        report: &Report<'_>,
        limits: impl Fn(&str) -> Option<Limits>,
        now: Instant,
    ) -> Result<(), Refused> {
        if report.dataplane.is_empty() || report.dataplane.len() > MAX_ID {
            return Err(Refused::Id);
        }
        self.started.get_or_insert(now);
        self.dataplanes.retain(|_, book| now.saturating_duration_since(book.at) < GONE_AFTER);
        let full = self.dataplanes.len() >= MAX_DATAPLANES;
        match self.dataplanes.get(report.dataplane) {
            // Live, so what it holds still counts: a restarted process takes
            // the id over once the old one has been silent for GONE_AFTER.
            Some(book) if book.instance != report.instance => return Err(Refused::Twin),
            Some(book)
                if report.sequence <= book.sequence || now.saturating_duration_since(book.at) < MIN_REPORT_GAP =>
            {
                return Err(Refused::Stale);
            }
            None if full => return Err(Refused::TooManyDataPlanes),
            _ => {}
        }
        let limited =
            |key_id: &str| inferyes_proto::apikey::valid_key_id(key_id) && limits(key_id).is_some_and(Limits::any);
        let book =
            self.dataplanes.entry(report.dataplane.to_owned()).or_insert_with(|| Book::new(now, report.instance));
        // A first report covers a second, however long the data plane ran.
        let seconds = now.saturating_duration_since(book.at).as_secs_f64().clamp(1.0, GONE_AFTER.as_secs_f64());
        book.at = now;
        book.sequence = report.sequence;
        let mut wants: FastMap<String, Want> = FastMap::default();
        for asked in report.demand.iter().filter(|d| limited(&d.key_id)).take(MAX_KEYS) {
            let before = book.keys.get(&asked.key_id).map_or_else(Want::default, |slot| slot.want);
            let per_minute = (f64::from(asked.asked) * 60.0 / seconds).min(MAX_PER_MINUTE);
            #[allow(clippy::cast_precision_loss)] // a claim, not a count
            let want = Want {
                per_minute: smoothed(before.per_minute, per_minute),
                in_flight: asked.in_flight,
                refused_in_flight: smoothed(before.refused_in_flight, f64::from(asked.refused_in_flight)),
                tokens_held: asked.tokens_held,
                tokens_refused: smoothed(before.tokens_refused, asked.tokens_refused as f64),
                overdrawn: asked.overdrawn,
            };
            wants.insert(asked.key_id.clone(), want);
        }
        for (key, want) in book.keys.iter().map(|(key, slot)| (key, slot.want)) {
            if wants.len() >= MAX_KEYS {
                break;
            }
            if !wants.contains_key(key) {
                let faded = Want {
                    per_minute: smoothed(want.per_minute, 0.0),
                    refused_in_flight: smoothed(want.refused_in_flight, 0.0),
                    tokens_refused: smoothed(want.tokens_refused, 0.0),
                    ..Want::default()
                };
                if faded.per_minute.max(faded.refused_in_flight).max(faded.tokens_refused) >= FORGOTTEN_BELOW {
                    wants.insert(key.clone(), faded);
                }
            }
        }
        for (key, slot) in &mut book.keys {
            slot.want = wants.remove(key).unwrap_or_default();
        }
        for (key, want) in wants {
            book.keys.insert(key, Slot { want, ..Slot::default() });
        }
        // Whatever its limits now: a key's limit may come back before the
        // data plane takes another answer.
        book.take_said(report.held);
        Ok(())
    }

    /// `dataplane`'s new parts; `None` for a data plane the books do not
    /// follow. `limits` gives a key's limits, `None` for a key that is gone.
    /// `spent` names the keys whose budgets were spent of today: their
    /// parts are listed whoever asked of them.
    pub fn allowances<'a>(
        &mut self,
        dataplane: &str,
        limits: impl Fn(&str) -> Option<Limits>,
        spent: impl IntoIterator<Item = &'a str>,
        now: Instant,
    ) -> Option<Allowances> {
        if self.started.is_none_or(|started| now.saturating_duration_since(started) < GONE_AFTER) {
            return self.dataplanes.get(dataplane).map(Book::said_kept);
        }
        let live: Vec<(&String, &Book)> =
            self.dataplanes.iter().filter(|(_, book)| now.saturating_duration_since(book.at) < GONE_AFTER).collect();
        let place = live.iter().position(|(id, _)| id.as_str() == dataplane)?;
        let count = index(live.len());
        let members = digest(live.iter().map(|(id, _)| id.as_str()));
        // Until no other data plane holds even parts of a split among other
        // members, even parts here could add to those. One that is settling
        // holds the lesser of its old and new even parts: no more than the
        // new split's.
        let settling = live.iter().enumerate().any(|(i, (_, book))| {
            i != place
                && book
                    .said
                    .iter()
                    .chain(&book.given)
                    .any(|split| !split.parts.settling && split.parts.members != members)
        });
        // While settling, the split this one held even parts of before.
        let (before_dataplanes, before_place) = match live[place].1.said.as_ref().map(|said| &said.parts) {
            Some(parts) if settling && !parts.settling => (parts.dataplanes, parts.place),
            Some(parts) if settling => (parts.before_dataplanes, parts.before_place),
            _ => (0, 0),
        };
        // Hashed, not ordered: it takes every key of every book.
        let mut named: FastSet<&str> = live.iter().flat_map(|(_, book)| book.keys.keys()).map(String::as_str).collect();
        let spent: FastSet<&str> = spent.into_iter().take(MAX_KEYS).collect();
        named.extend(&spent);
        let mut answer = Allowances {
            dataplanes: count,
            place: index(place),
            keys: Vec::new(),
            members,
            settling,
            before_dataplanes,
            before_place,
            budgets: true,
            kept: false,
        };
        // Reused for every key: an answer weighs thousands.
        let (mut claims, mut kind_claims): (Vec<[Claim; KINDS]>, Vec<Claim>) = (Vec::new(), Vec::new());
        for key_id in named {
            let Some(limits) = limits(key_id).filter(|l| l.any()) else { continue };
            let (split_now, whole) = (limits.now(), limits.whole());
            // What each asked, and what the others hold: their parts, or
            // what they say they hold where that is more (an overdrawn
            // request, a part given since it was admitted).
            claims.clear();
            let mut held = [0u64; KINDS];
            for (i, (_, book)) in live.iter().enumerate() {
                let slot = book.keys.get(key_id);
                let claim = slot.map_or_else(Want::default, |slot| slot.want).claims();
                claims.push(claim);
                if i != place {
                    let holds = book.holds(slot, whole);
                    for ((sum, part), claim) in held.iter_mut().zip(holds.0).zip(claim) {
                        *sum = sum.saturating_add(part.max(claim.held));
                    }
                }
            }
            let mut part = Part::default();
            for (kind, limit) in split_now.0.into_iter().enumerate().filter(|(_, limit)| *limit > 0) {
                kind_claims.clear();
                kind_claims.extend(claims.iter().map(|claim| claim[kind]));
                part.0[kind] = split_at(limit, &kind_claims, place).min(limit.saturating_sub(held[kind]));
            }
            // A budget spent of today is listed whatever its part: a data
            // plane whose roll-up shows it spent of takes none of it
            // unlisted, and the roll-ups data planes hold may be behind or
            // ahead of this one.
            let spent_of = limits.tokens.is_some() && spent.contains(key_id);
            if spent_of || part != Part::unlisted(whole, &answer) {
                answer.keys.push(part.allowance(key_id));
            }
        }
        if let Some(book) = self.dataplanes.get_mut(dataplane) {
            book.take_given(&answer);
        }
        Some(answer)
    }
}

/// Keys a reported holding keeps at most; past them, each key it does not
/// keep is taken to be held whole.
const MAX_HELD_KEYS: usize = 65_536;

impl Book {
    fn new(at: Instant, instance: u64) -> Book {
        Book { at, instance, sequence: 0, keys: FastMap::default(), said: None, given: None }
    }

    /// What it holds of a key whose slot is `slot` and whose limits are
    /// even parts of `whole`: the more of what it said and what it was
    /// given.
    fn holds(&self, slot: Option<&Slot>, whole: Part) -> Part {
        let said = holding(self.said.as_ref(), slot.and_then(|slot| slot.said), whole);
        let given = holding(self.given.as_ref(), slot.and_then(|slot| slot.given), whole);
        Part(std::array::from_fn(|kind| said.0[kind].max(given.0[kind])))
    }

    /// Takes what it says it holds: at most [`MAX_HELD_KEYS`] keys.
    fn take_said(&mut self, said: Option<&Allowances>) {
        for slot in self.keys.values_mut() {
            slot.said = None;
        }
        self.said = said.map(|parts| {
            let mut kept = 0;
            let valid = parts.keys.iter().filter(|key| inferyes_proto::apikey::valid_key_id(&key.key_id));
            for key in valid.take(MAX_HELD_KEYS) {
                let slot = value_for(&mut self.keys, &key.key_id, Slot::default);
                kept += usize::from(slot.said.is_none());
                slot.said = Some(Part::of(key));
            }
            // A key listed twice, or one not kept, counts whole.
            Split { parts: Allowances { keys: Vec::new(), ..parts.clone() }, cut: kept < parts.keys.len() }
        });
        self.keys.retain(|_, slot| !slot.empty());
    }

    /// Takes what this controller gave it.
    fn take_given(&mut self, given: &Allowances) {
        for slot in self.keys.values_mut() {
            slot.given = None;
        }
        for key in &given.keys {
            value_for(&mut self.keys, &key.key_id, Slot::default).given = Some(Part::of(key));
        }
        self.given = Some(Split { parts: Allowances { keys: Vec::new(), ..given.clone() }, cut: false });
        self.keys.retain(|_, slot| !slot.empty());
    }

    /// The parts it says it holds, to keep as they are; nothing where the
    /// books did not keep them all.
    fn said_kept(&self) -> Allowances {
        match &self.said {
            Some(said) if !said.cut => {
                let listed = self.keys.iter().filter_map(|(key_id, slot)| Some(slot.said?.allowance(key_id)));
                Allowances { keys: listed.collect(), kept: true, ..said.parts.clone() }
            }
            _ => nothing(),
        }
    }
}

/// What a data plane holds of a key, by a split it holds parts of (none),
/// the key's part listed in it, and the key's limits' `whole`.
fn holding(split: Option<&Split>, listed: Option<Part>, whole: Part) -> Part {
    match (split, listed) {
        (None, _) => Part::default(),
        (Some(_), Some(part)) => part,
        (Some(split), None) if split.cut => whole,
        (Some(split), None) => Part::unlisted(whole, &split.parts),
    }
}

/// Parts of nothing: what a data plane whose report is refused holds of
/// this controller's split.
pub fn nothing() -> Allowances {
    Allowances { settling: true, budgets: true, kept: true, ..Allowances::default() }
}

/// A digest of a split's members, sorted.
fn digest<'a>(ids: impl Iterator<Item = &'a str>) -> u64 {
    let mut joined = Vec::new();
    for id in ids {
        joined.extend_from_slice(id.as_bytes());
        joined.push(0);
    }
    inferyes_proto::hash::stable_hash(&joined)
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
    pub held: u64,
    pub more: f64,
}

/// Splits `limit` among claims, in whole parts that add up to it (or to
/// what is held, where that is more: nothing held is taken back). What is
/// not held goes by what each asked for; where that is less than there is,
/// each gets what it asked and the spare is spread evenly, so that a data
/// plane nobody used lately can still take a key's next request.
pub fn split(limit: u64, claims: &[Claim]) -> Vec<u64> {
    let mut parts: Vec<u64> = claims.iter().map(|c| c.held).collect();
    let held = parts.iter().fold(0u64, |sum, &p| sum.saturating_add(p));
    if claims.is_empty() || held >= limit {
        return parts;
    }
    let rest = limit - held;
    let asked: f64 = claims.iter().map(|c| c.more.max(0.0)).sum();
    #[allow(clippy::cast_precision_loss)] // shares, not counts: whole parts are counted below
    let (rest_f, n) = (rest as f64, claims.len() as f64);
    let shares: Vec<f64> = if asked <= rest_f {
        claims.iter().map(|c| c.more.max(0.0) + (rest_f - asked) / n).collect()
    } else {
        claims.iter().map(|c| rest_f * c.more.max(0.0) / asked).collect()
    };
    // Whole parts: each share's floor (never past what is left: a large
    // limit's shares are rounded), then what is left by the largest
    // fractions (the first place on a tie).
    let mut given = 0u64;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // 0 <= share, saturating
    let floors: Vec<u64> = shares
        .iter()
        .map(|s| {
            let floor = (s.floor() as u64).min(rest - given);
            given += floor;
            floor
        })
        .collect();
    // Less than one a claim, but where rounding took more: the fractions
    // sum to less than their count.
    let count = claims.len() as u64;
    let (each, left) = ((rest - given) / count, usize::try_from((rest - given) % count).unwrap_or(usize::MAX));
    let mut order: Vec<usize> = (0..claims.len()).collect();
    #[allow(clippy::cast_precision_loss)]
    order.sort_by(|&a, &b| (shares[b] - floors[b] as f64).total_cmp(&(shares[a] - floors[a] as f64)).then(a.cmp(&b)));
    for (part, floor) in parts.iter_mut().zip(&floors) {
        *part = part.saturating_add(*floor + each);
    }
    for &i in order.iter().take(left) {
        parts[i] = parts[i].saturating_add(1);
    }
    parts
}

/// `split(limit, claims)[place]`, in two passes over the claims and
/// nothing allocated: an answer splits every key some data plane asked of.
pub fn split_at(limit: u64, claims: &[Claim], place: usize) -> u64 {
    let own = claims.get(place).map_or(0, |claim| claim.held);
    let held = claims.iter().fold(0u64, |sum, c| sum.saturating_add(c.held));
    if held >= limit {
        return own;
    }
    let rest = limit - held;
    let asked: f64 = claims.iter().map(|c| c.more.max(0.0)).sum();
    #[allow(clippy::cast_precision_loss)] // as in `split`
    let (rest_f, n) = (rest as f64, claims.len() as f64);
    let share = |c: &Claim| {
        if asked <= rest_f { c.more.max(0.0) + (rest_f - asked) / n } else { rest_f * c.more.max(0.0) / asked }
    };
    // Each claim's floor and fraction, as `split` takes them in turn.
    let floors = || {
        let mut given = 0u64;
        claims.iter().map(move |c| {
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // 0 <= share, saturating
            let floor = (share(c).floor() as u64).min(rest - given);
            given += floor;
            #[allow(clippy::cast_precision_loss)]
            (floor, share(c) - floor as f64)
        })
    };
    let given: u64 = floors().map(|(floor, _)| floor).sum();
    let Some((floor, fraction)) = floors().nth(place) else { return own };
    let count = claims.len() as u64;
    let (each, left) = ((rest - given) / count, (rest - given) % count);
    // Its place in `split`'s order: larger fractions first, then the first
    // places.
    let before = floors()
        .enumerate()
        .filter(|(i, (_, other))| {
            other.total_cmp(&fraction).is_gt() || (other.total_cmp(&fraction).is_eq() && *i < place)
        })
        .count() as u64;
    own.saturating_add(floor + each).saturating_add(u64::from(before < left))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims(more: &[f64]) -> Vec<Claim> {
        more.iter().map(|&more| Claim { held: 0, more }).collect()
    }

    #[test]
    fn parts_add_up_to_the_limit_whatever_was_asked() {
        for limit in [0, 1, 2, 3, 7, 60, 1000, u64::MAX / 3] {
            for asked in [&[0.0, 0.0, 0.0, 0.0][..], &[5.0, 0.0, 0.0, 1.0], &[1e9, 3.0, 0.5, 0.0], &[2.0, 2.0, 2.0]] {
                let parts = split(limit, &claims(asked));
                assert_eq!(parts.iter().sum::<u64>(), limit, "{limit} split by {asked:?}: {parts:?}");
            }
        }
    }

    #[test]
    fn a_part_alone_is_the_part_the_whole_split_gives() {
        let mut seed = 11u64;
        for _ in 0..20_000 {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let n = usize::try_from(seed >> 60).unwrap() % 6 + 1;
            let limit = [0, 1, 3, 60, 1_000, u64::MAX / 7][usize::try_from(seed >> 40).unwrap() % 6];
            let claims: Vec<Claim> = (0..n)
                .map(|i| {
                    let bits = seed.rotate_left(u32::try_from(i * 11).unwrap());
                    #[allow(clippy::cast_precision_loss)]
                    Claim { held: bits % 5 * (limit / 13), more: (bits >> 8) as f64 % 2_000.0 / 7.0 }
                })
                .collect();
            let whole = split(limit, &claims);
            for (place, part) in whole.into_iter().enumerate() {
                assert_eq!(split_at(limit, &claims, place), part, "{limit} by {claims:?}, place {place}");
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

    const KEY: &str = "keyaaaaaaaaa";
    /// A key nobody asks of: each data plane holds its even part of it.
    const QUIET: &str = "quietaaaaaaa";

    fn demand(key: &str, asked: u32, in_flight: u32, refused_in_flight: u32) -> KeyDemand {
        KeyDemand { key_id: key.into(), asked, in_flight, refused_in_flight, ..KeyDemand::default() }
    }

    fn limits(key: &str) -> Option<Limits> {
        match key {
            KEY => Some(Limits {
                requests_per_minute: 60,
                max_concurrent: 4,
                tokens: Some(Budget { per_day: 1_000, left: 700 }),
            }),
            QUIET => Some(Limits {
                requests_per_minute: 7,
                max_concurrent: 3,
                tokens: Some(Budget { per_day: 900, left: 900 }),
            }),
            _ => None,
        }
    }

    /// A data plane as the books see it: it reports what it holds, and
    /// takes each answer.
    struct Plane {
        id: String,
        instance: u64,
        sequence: u64,
        held: Option<Allowances>,
    }

    impl Plane {
        fn new(id: &str) -> Plane {
            Plane { id: id.into(), instance: 1, sequence: 0, held: None }
        }

        fn report<'a>(&'a mut self, demand: &'a [KeyDemand]) -> Report<'a> {
            self.sequence += 1;
            Report {
                dataplane: &self.id,
                instance: self.instance,
                sequence: self.sequence,
                demand,
                held: self.held.as_ref(),
            }
        }

        fn round(&mut self, books: &mut Books, demand: &[KeyDemand], now: Instant) -> Allowances {
            let report = self.report(demand);
            books.report(&report, limits, now).unwrap();
            let answer = books.allowances(&self.id, limits, [], now).unwrap();
            self.held = Some(answer.clone());
            answer
        }

        /// What it applies of the key: `(requests per minute, in flight)`.
        fn part(&self) -> (u64, u64) {
            let part = self.part_of(KEY);
            (part.0[RATE], part.0[ROOM])
        }

        /// What it applies of a key, at most: of a budget not listed, the
        /// even part of the whole of it.
        fn part_of(&self, key_id: &str) -> Part {
            let Some(held) = &self.held else { return Part::default() };
            match held.keys.iter().find(|k| k.key_id == key_id) {
                Some(k) => Part::of(k),
                None => Part::unlisted(limits(key_id).unwrap().whole(), held),
            }
        }
    }

    /// Books with data planes dp-a and dp-b, past the time a starting
    /// controller leaves each what it holds: the time to split from.
    fn two_planes_past_the_warm_up() -> (Books, Plane, Plane, Instant) {
        let (mut books, warming) = (Books::default(), Instant::now());
        let (mut a, mut b) = (Plane::new("dp-a"), Plane::new("dp-b"));
        for at in [warming, warming + GONE_AFTER / 2] {
            a.round(&mut books, &[], at);
            b.round(&mut books, &[], at);
        }
        (books, a, b, warming + GONE_AFTER)
    }

    #[test]
    fn a_key_s_parts_follow_the_data_planes_it_was_asked_of() {
        let (mut books, mut a, mut b, start) = two_planes_past_the_warm_up();
        // 120 a minute asked of dp-a (5 since its report 2.5 s before),
        // more than the 60 there are; it holds 2 in flight and asked 3 more.
        // dp-b holds nothing: this controller gave it nothing yet.
        let answer = a.round(&mut books, &[demand(KEY, 5, 2, 3)], start);
        assert_eq!((answer.dataplanes, answer.place, a.part()), (2, 0, (60, 4)));
        let answer = b.round(&mut books, &[], start);
        assert_eq!((answer.place, b.part()), (1, (0, 0)));

        // dp-a goes quiet and its claim fades; dp-b is asked now. dp-b
        // grows into what dp-a gave up once dp-a says it holds less.
        let mut now = start;
        for _ in 0..3 {
            now += Duration::from_secs(1);
            a.round(&mut books, &[], now);
            b.round(&mut books, &[demand(KEY, 1, 1, 0)], now);
        }
        let ((a_rate, a_room), (b_rate, b_room)) = (a.part(), b.part());
        assert!(b_rate > a_rate && a_rate + b_rate <= 60, "{:?}", (a.part(), b.part()));
        assert_eq!((a_room, b_room), (2, 2), "one held on dp-b, the spare spread");

        // dp-a is gone: dp-b has it all, alone among the data planes.
        now += GONE_AFTER;
        let answer = b.round(&mut books, &[demand(KEY, 1, 0, 0)], now);
        assert_eq!((answer.dataplanes, answer.place, b.part()), (1, 0, (60, 4)));
    }

    #[test]
    fn a_budget_s_parts_follow_the_tokens_held_and_asked_and_its_overdraft_the_refusals() {
        let (mut books, mut a, mut b, start) = two_planes_past_the_warm_up();
        // 700 left of the key's budget: dp-a holds 200 and was refused
        // requests that would have held 400 more; dp-b asked nothing.
        let asked = KeyDemand { tokens_held: 200, tokens_refused: 400, ..demand(KEY, 1, 0, 0) };
        a.round(&mut books, &[asked], start);
        let answer = b.round(&mut books, &[], start);
        let (a_part, b_part) = (a.part_of(KEY), b.part_of(KEY));
        assert_eq!((a_part.0[TOKENS], a_part.0[OVERDRAFT]), (650, 1), "what it holds, asked, and half the spare");
        assert_eq!((b_part.0[TOKENS], b_part.0[OVERDRAFT]), (50, 0));
        let listed: Vec<&str> = answer.keys.iter().map(|k| k.key_id.as_str()).collect();
        assert_eq!(listed, vec![KEY], "a budget nobody spent of today is not listed");
        // A key whose budget was spent of today is listed by every answer:
        // each data plane counts what is left by its own view.
        let later = start + Duration::from_secs(1);
        books.report(&b.report(&[]), limits, later).unwrap();
        let answer = books.allowances("dp-b", limits, [QUIET], later).unwrap();
        let quiet = answer.keys.iter().find(|k| k.key_id == QUIET).map(|k| (k.tokens, k.overdraft));
        assert_eq!(quiet, Some((450, 0)), "half of the 900 left; dp-a holds the overdraft of the even split");
        // Once the roll-up shows it spent of no more (a new day), its even
        // part is not listed again.
        let later = later + Duration::from_secs(1);
        books.report(&b.report(&[]), limits, later).unwrap();
        let answer = books.allowances("dp-b", limits, [], later).unwrap();
        assert!(answer.keys.iter().all(|k| k.key_id != QUIET), "{answer:?}");
    }

    #[test]
    fn an_overdraft_two_data_planes_say_they_use_is_given_to_neither() {
        // Each says an overdrawn request runs there (one took it before a
        // split gave it away): what they say they hold counts, whatever
        // parts they were given.
        let (mut books, mut a, mut b, start) = two_planes_past_the_warm_up();
        let overdrawn = [KeyDemand { tokens_held: 300, overdrawn: true, ..demand(KEY, 0, 0, 0) }];
        a.round(&mut books, &overdrawn, start);
        b.round(&mut books, &overdrawn, start);
        let later = start + Duration::from_secs(1);
        let (a_part, b_part) = (a.round(&mut books, &overdrawn, later), b.round(&mut books, &overdrawn, later));
        let overdraft = |answer: &Allowances| answer.keys.iter().find(|k| k.key_id == KEY).map(|k| k.overdraft);
        assert_eq!((overdraft(&a_part), overdraft(&b_part)), (Some(0), Some(0)));
    }

    #[test]
    fn the_parts_data_planes_hold_never_add_up_past_the_limit() {
        // Data planes joining, going and coming back, a controller starting
        // over, answers lost, the key's traffic moving among them at random:
        // after each answer, what every live data plane holds adds up to
        // at most the limit.
        let mut books = Books::default();
        let start = Instant::now();
        let mut planes: Vec<Plane> = ["dp-b", "dp-d", "dp-a", "dp-c", "dp-e"].into_iter().map(Plane::new).collect();
        let mut seed = 7u64;
        for round in 0..3000u64 {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let roll = seed >> 33;
            let now = start + Duration::from_millis(200 * round);
            // Each reports once a second, in turn; dp-e comes and goes (and
            // holds nothing while gone).
            let e_runs = (round / 500) % 2 == 0;
            if !e_runs {
                planes[4].held = None;
            }
            let i = usize::try_from(round % 5).unwrap();
            if i == 4 && !e_runs {
                continue;
            }
            match roll % 97 {
                0 => books = Books::default(),
                1 => {
                    planes[i].held = None;
                    planes[i].instance += 1;
                }
                _ => {}
            }
            // It holds no more than its part: of tokens, at most one
            // request past it where it holds the overdraft.
            let part = planes[i].part_of(KEY);
            let overdrawn = part.0[OVERDRAFT] == 1 && roll.is_multiple_of(4);
            let asked = KeyDemand {
                tokens_held: (roll % 300).min(part.0[TOKENS]) + if overdrawn { 250 } else { 0 },
                tokens_refused: roll % 7 * 100,
                overdrawn,
                ..demand(
                    KEY,
                    u32::try_from(roll % 50).unwrap(),
                    u32::try_from((roll % 3).min(part.0[ROOM])).unwrap(),
                    u32::try_from(roll % 5).unwrap(),
                )
            };
            let plane = &mut planes[i];
            let asked = [asked];
            let report = plane.report(&asked);
            let answer = match books.report(&report, limits, now) {
                Ok(()) => books.allowances(&plane.id, limits, [], now).unwrap(),
                Err(_) => nothing(),
            };
            // One answer in 13 is lost on its way.
            if !roll.is_multiple_of(13) {
                plane.held = Some(answer);
            }
            for key_id in [KEY, QUIET] {
                let running = planes.iter().enumerate().filter(|(i, _)| *i != 4 || e_runs);
                let held: Vec<Part> = running.map(|(_, plane)| plane.part_of(key_id)).collect();
                let limits = limits(key_id).unwrap().now();
                for kind in 0..KINDS {
                    // An overdrawn request holds tokens past its data
                    // plane's part; the parts add up all the same.
                    let sum: u64 = held.iter().map(|part| part.0[kind]).sum();
                    assert!(sum <= limits.0[kind], "round {round}, {key_id}: parts held {held:?}");
                }
            }
        }
        // Not all nothing: the limit is used.
        let held: Vec<(u64, u64)> = planes[..4].iter().map(Plane::part).collect();
        assert!(held.iter().map(|h| h.0).sum::<u64>() >= 30, "{held:?}");
    }

    fn report<'a>(dataplane: &'a str, instance: u64, sequence: u64, demand: &'a [KeyDemand]) -> Report<'a> {
        Report { dataplane, instance, sequence, demand, held: None }
    }

    #[test]
    fn for_a_while_after_its_start_a_controller_leaves_each_data_plane_what_it_holds() {
        let (mut books, start) = (Books::default(), Instant::now());
        let held = Allowances {
            dataplanes: 3,
            place: 1,
            keys: vec![KeyAllowance {
                key_id: KEY.into(),
                requests_per_minute: 40,
                max_concurrent: 3,
                tokens: 100,
                overdraft: 0,
            }],
            ..Allowances::default()
        };
        let asked = [demand(KEY, 100, 0, 0)];
        books.report(&Report { held: Some(&held), ..report("dp-a", 1, 1, &asked) }, limits, start).unwrap();
        let kept = Allowances { kept: true, ..held.clone() };
        assert_eq!(books.allowances("dp-a", limits, [], start).unwrap(), kept, "what it holds, marked kept");
        books.report(&report("dp-new", 1, 1, &asked), limits, start).unwrap();
        assert_eq!(books.allowances("dp-new", limits, [], start).unwrap(), nothing());
        // Every data plane has reported since: it splits again.
        let later = start + GONE_AFTER / 2;
        books.report(&Report { held: Some(&held), ..report("dp-a", 1, 2, &asked) }, limits, later).unwrap();
        let later = start + GONE_AFTER;
        books.report(&Report { held: Some(&held), ..report("dp-a", 1, 3, &asked) }, limits, later).unwrap();
        assert_ne!(books.allowances("dp-a", limits, [], later).unwrap(), kept);
    }

    #[test]
    fn keys_without_limits_bad_reports_and_twins_get_nothing() {
        let (mut books, start) = (Books::default(), Instant::now());
        let odd = [demand("unlimited123", 5, 1, 0), demand("", 1, 0, 0), demand("not a key id", 1, 0, 0)];
        books.report(&report("dp-a", 1, 1, &odd), limits, start).unwrap();
        assert!(books.dataplanes["dp-a"].keys.is_empty(), "only keys with limits are followed");
        let now = start + GONE_AFTER;
        books.report(&report("dp-b", 1, 1, &odd), limits, now).unwrap();
        assert!(books.allowances("dp-b", limits, [], now).unwrap().keys.is_empty());
        assert_eq!(books.allowances("dp-unknown", limits, [], now), None);
        assert_eq!(books.report(&report("", 1, 1, &[]), limits, now), Err(Refused::Id));
        // A report older than one taken, or too soon after it.
        let soon = now + MIN_REPORT_GAP / 2;
        assert_eq!(books.report(&report("dp-b", 1, 1, &[]), limits, soon + MIN_REPORT_GAP), Err(Refused::Stale));
        assert_eq!(books.report(&report("dp-b", 1, 2, &[]), limits, soon), Err(Refused::Stale));
        // Another process under a live data plane's id; once the first has
        // been silent long enough, a restarted one takes the id over.
        assert_eq!(books.report(&report("dp-b", 2, 1, &[]), limits, soon), Err(Refused::Twin));
        let later = now + GONE_AFTER;
        books.report(&report("dp-b", 2, 1, &[]), limits, later).unwrap();
        for i in 1..MAX_DATAPLANES {
            books.report(&report(&format!("dp-{i}"), 1, 1, &[]), limits, later).unwrap();
        }
        assert_eq!(books.report(&report("dp-one-more", 1, 1, &[]), limits, later), Err(Refused::TooManyDataPlanes));
    }

    #[test]
    fn a_holding_past_what_the_books_keep_counts_whole() {
        let (mut books, start) = (Books::default(), Instant::now());
        let many: Vec<KeyAllowance> = (0..=MAX_HELD_KEYS)
            .map(|i| KeyAllowance { key_id: format!("{:a>12}", to_letters(i)), ..KeyAllowance::default() })
            .chain([KeyAllowance {
                key_id: KEY.into(),
                requests_per_minute: 60,
                max_concurrent: 4,
                tokens: 700,
                overdraft: 1,
            }])
            .collect();
        let members = digest(["dp-a", "dp-b"].into_iter());
        let held = Allowances { dataplanes: 2, keys: many, members, ..Allowances::default() };
        let now = start + GONE_AFTER;
        books.report(&report("dp-a", 1, 1, &[]), limits, start).unwrap();
        books.report(&Report { held: Some(&held), ..report("dp-a", 1, 2, &[]) }, limits, now).unwrap();
        books.report(&report("dp-b", 1, 1, &[demand(KEY, 100, 0, 5)]), limits, now).unwrap();
        let answer = books.allowances("dp-b", limits, [], now).unwrap();
        assert!(!answer.settling);
        let part = answer.keys.iter().find(|k| k.key_id == KEY).map(|k| (k.requests_per_minute, k.max_concurrent));
        assert_eq!(part, Some((0, 0)), "dp-a is taken to hold the key whole, not its even half");
    }

    /// `i` in the key alphabet's letters.
    fn to_letters(mut i: usize) -> String {
        let mut letters = String::new();
        loop {
            letters.insert(0, char::from(b'a' + u8::try_from(i % 26).unwrap()));
            i /= 26;
            if i == 0 {
                return letters;
            }
        }
    }
}
