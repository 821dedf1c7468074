//! The data plane's waiting room: the order in which requests that no node
//! can start now leave, once one can. Each tenant (each key where no tenant
//! is set) is a flow with a weight; requests leave by start-time fair
//! queuing across flows (a request's tag is where its flow's previous one
//! ends, or the room's present if that is later, plus its cost over its
//! flow's weight), interactive before batch, a batch request waiting past
//! the aging bound counted as interactive. So a flow that arrives behind
//! another's backlog is tagged at the present, ahead of that backlog: it
//! waits for requests already leaving, never for the backlog itself.
//!
//! Within a flow and class, the flow's tags go to its cheapest requests
//! first, by each request's expected time to read its prompt (what no
//! node holds of it) less the time it has waited (shortest job first,
//! aged): a conversation's next turn, whose history a node holds, leaves
//! ahead of the flow's new long prompts, but a long prompt waits behind
//! cheaper ones at most about its own expected time, not for as long as
//! cheap ones keep coming. Unaged, a burst of
//! conversations held its first turns for minutes behind the later turns
//! of those that had started, and finished seconds after a router that
//! sends in order. A request that has waited half the longest wait
//! (`max_wait_ms`) goes ahead of its flow's others, by arrival. Other flows see only the flow's tags, whichever of
//! its requests takes them: the one that leaves spends the tag it took.
//!
//! Pure: time comes in as milliseconds, and where a request can start now
//! as a function of it. [`crate::queue`] owns the waiting itself.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Which requests go first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    Interactive,
    Batch,
}

/// What the room holds at most.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Requests waiting, all flows together.
    pub requests: usize,
    /// Bytes of their bodies, all flows together.
    pub bytes: usize,
    /// Of `requests` and of `bytes`, what one flow may hold, in percent
    /// (of bytes, at least its one request).
    pub flow_share_percent: u32,
    /// How long a request may wait before it is refused.
    pub max_wait_ms: u64,
    /// How long a batch request waits before it goes with the interactive
    /// ones.
    pub aging_ms: u64,
}

/// A request entering the room.
#[derive(Clone, Debug)]
pub struct Entry {
    /// Its tenant, or its key where it has none.
    pub flow: Arc<str>,
    /// Its flow's weight, at least 1.
    pub weight: u32,
    pub class: Class,
    /// What it may cost a node, in tokens (its prompt and its limit): a
    /// flow of long requests leaves less often than one of short ones.
    pub cost: u64,
    /// Its body's bytes, held while it waits.
    pub bytes: usize,
    /// The model it asks for: it can leave only where that model has room.
    pub model: Arc<str>,
}

/// Why a request was not let in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The room holds all the requests or bytes it may.
    Full,
    /// Its flow holds all its share of the room.
    FlowShare,
}

/// A waiting request's place.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket(u64);

/// A waiting request, as the room keeps it.
#[derive(Clone, Debug)]
struct Waiting {
    entry: Entry,
    /// Its start tag, in cost units over weight.
    start: u128,
    since_ms: u64,
}

struct Flow {
    /// Where its last request's tag ends.
    finish: u128,
    waiting: usize,
    bytes: usize,
    /// The ticket of the request that brought it into the room: requests
    /// of before it were of a flow of the same name since forgotten.
    since: Ticket,
}

/// A flow's waiting requests of one class: the tags they hold, and who
/// takes which, in order (overdue ones by arrival, then the least expected
/// time less time waited, in ms).
#[derive(Default)]
struct Turns {
    tags: Vec<u128>,
    takers: Vec<(Standing, i64, Ticket)>,
}

/// Whether a request has waited half the longest wait: then it goes ahead
/// of its flow's cheaper requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Standing {
    Overdue,
    InTime,
}

/// Tags count in units this fine: a cost of 1 over a weight of up to this
/// many is still a step.
const TAG_SCALE: u128 = 1 << 20;

/// How far a cost moves its flow's tags, at its weight.
fn tag_length(cost: u64, weight: u32) -> u128 {
    u128::from(cost) * TAG_SCALE / u128::from(weight.max(1))
}

/// The waiting room; see the module's comment.
pub struct Room {
    limits: Limits,
    /// By ticket (tickets rise with arrival: among equal tags, the first
    /// come leaves first).
    waiting: BTreeMap<Ticket, Waiting>,
    flows: HashMap<Arc<str>, Flow>,
    /// The present, in tags: the start tag of the request that left last.
    now_tag: u128,
    bytes: usize,
    next_ticket: u64,
}

impl Room {
    pub fn new(limits: Limits) -> Room {
        Room { limits, waiting: BTreeMap::new(), flows: HashMap::new(), now_tag: 0, bytes: 0, next_ticket: 0 }
    }

    /// Lets `entry` in at `now_ms`, or says why not.
    pub fn enter(&mut self, entry: Entry, now_ms: u64) -> Result<Ticket, Refused> {
        let Limits { requests, bytes, flow_share_percent, .. } = self.limits;
        if self.waiting.len() >= requests || self.bytes.saturating_add(entry.bytes) > bytes {
            return Err(Refused::Full);
        }
        let share = (requests * flow_share_percent as usize / 100).max(1);
        let bytes_share = bytes / 100 * flow_share_percent as usize;
        let next = Ticket(self.next_ticket);
        let flow =
            self.flows.entry(Arc::clone(&entry.flow)).or_insert(Flow { finish: 0, waiting: 0, bytes: 0, since: next });
        if flow.waiting >= share || (flow.waiting > 0 && flow.bytes.saturating_add(entry.bytes) > bytes_share) {
            return Err(Refused::FlowShare);
        }
        let start = flow.finish.max(self.now_tag);
        flow.finish = start + tag_length(entry.cost.max(1), entry.weight);
        flow.waiting += 1;
        flow.bytes += entry.bytes;
        self.bytes += entry.bytes;
        self.next_ticket += 1;
        self.waiting.insert(next, Waiting { entry, start, since_ms: now_ms });
        Ok(next)
    }

    /// The requests that leave at `now_ms`: in order (interactive ones, and
    /// batch ones waiting past the aging bound, first; then the earliest
    /// tag, each flow's going to its cheapest requests; then the first
    /// come), each that `startable` finds a place for now (it answers
    /// where), in one pass. They have left the room. `expected_ms`: how
    /// long a request's prompt takes to read, less what a node holds of it
    /// now (its conversation's cache, known only as residency is reported,
    /// often after the request came). The flow is charged its cost
    /// whatever it holds: a client may name any of its conversations.
    pub fn leave_startable<R>(
        &mut self,
        now_ms: u64,
        expected_ms: impl Fn(Ticket, &Entry) -> u64,
        mut startable: impl FnMut(Ticket, &Entry) -> Option<R>,
    ) -> Vec<(Ticket, Entry, R)> {
        let Limits { aging_ms, max_wait_ms, .. } = self.limits;
        let mut flows: HashMap<(&str, Class), Turns> = HashMap::new();
        for (ticket, w) in &self.waiting {
            let waited = now_ms.saturating_sub(w.since_ms);
            let class = match w.entry.class {
                Class::Batch if waited < aging_ms => Class::Batch,
                _ => Class::Interactive,
            };
            let (standing, aged) = if waited >= max_wait_ms / 2 {
                (Standing::Overdue, 0)
            } else {
                let expected = i64::try_from(expected_ms(*ticket, &w.entry)).unwrap_or(i64::MAX);
                (Standing::InTime, expected.saturating_sub(i64::try_from(waited).unwrap_or(i64::MAX)))
            };
            let turns = flows.entry((&w.entry.flow, class)).or_default();
            turns.tags.push(w.start);
            turns.takers.push((standing, aged, *ticket));
        }
        let mut order: Vec<(Class, u128, Ticket)> = Vec::with_capacity(self.waiting.len());
        for ((_, class), Turns { mut tags, mut takers }) in flows {
            tags.sort_unstable();
            takers.sort_unstable();
            order.extend(tags.into_iter().zip(takers).map(|(tag, (_, _, ticket))| (class, tag, ticket)));
        }
        // Each keeps the tag it takes: the one its flow spends if it leaves.
        for &(_, tag, ticket) in &order {
            if let Some(w) = self.waiting.get_mut(&ticket) {
                w.start = tag;
            }
        }
        order.sort_unstable();
        let mut left = Vec::new();
        for (_, tag, ticket) in order {
            let Some(place) = startable(ticket, &self.waiting[&ticket].entry) else { continue };
            if let Some(gone) = self.take(ticket) {
                self.now_tag = self.now_tag.max(tag);
                left.push((ticket, gone.entry, place));
            }
        }
        left
    }

    /// The request of `ticket`, of `flow`, that entered at `charged` has
    /// ended, having `spent` (its prompt and what it generated): the
    /// flow's tags, those its waiting requests hold and the next one's,
    /// move by the difference. So turns follow what requests cost, not the
    /// guess they entered at: one that sets no `max_tokens` is guessed a
    /// typical answer and may generate thousands; one that sets a limit it
    /// does not reach is given back the rest, never past the present. Only
    /// the flow it entered is settled: one forgotten since (nothing of it
    /// waited) is gone with what it owed or was owed, and a flow of the
    /// same name that came after owes and is owed nothing of it.
    pub fn settle(&mut self, ticket: Ticket, flow: &str, weight: u32, charged: u64, spent: u64) {
        let Some(flow_state) = self.flows.get_mut(flow).filter(|f| f.since <= ticket) else { return };
        let (charged, spent) = (tag_length(charged.max(1), weight), tag_length(spent, weight));
        let now = self.now_tag;
        let shift = |tag: u128| match spent.checked_sub(charged) {
            Some(owed) => tag + owed,
            None => tag.saturating_sub(charged - spent).max(now.min(tag)),
        };
        flow_state.finish = shift(flow_state.finish);
        for waiting in self.waiting.values_mut().filter(|w| &*w.entry.flow == flow) {
            waiting.start = shift(waiting.start);
        }
    }

    /// Takes a request out of the room: its client went away, or it waited
    /// too long. What it was, if it was there.
    pub fn leave(&mut self, ticket: Ticket) -> Option<Entry> {
        self.take(ticket).map(|w| w.entry)
    }

    /// Those that have waited past the bound at `now_ms`, oldest first.
    pub fn expired(&self, now_ms: u64) -> Vec<Ticket> {
        let bound = self.limits.max_wait_ms;
        self.waiting.iter().filter(|(_, w)| now_ms.saturating_sub(w.since_ms) >= bound).map(|(t, _)| *t).collect()
    }

    /// Requests waiting, and their bodies' bytes.
    pub fn len(&self) -> (usize, usize) {
        (self.waiting.len(), self.bytes)
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    fn take(&mut self, ticket: Ticket) -> Option<Waiting> {
        let left = self.waiting.remove(&ticket)?;
        self.bytes -= left.entry.bytes;
        if let Some(flow) = self.flows.get_mut(&left.entry.flow) {
            flow.waiting -= 1;
            flow.bytes -= left.entry.bytes;
            // A flow with nothing waiting is forgotten (the room holds only
            // flows that wait): its next request is tagged at the present,
            // ahead by at most its last request's cost.
            if flow.waiting == 0 {
                self.flows.remove(&left.entry.flow);
            }
        }
        Some(left)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits =
        Limits { requests: 1_000, bytes: 1 << 30, flow_share_percent: 50, max_wait_ms: 60_000, aging_ms: 10_000 };

    fn entry(flow: &str, class: Class, cost: u64) -> Entry {
        Entry { flow: Arc::from(flow), weight: 1, class, cost, bytes: 100, model: Arc::from("m") }
    }

    /// The one request that leaves next of those `startable` takes, where
    /// no node holds any of them.
    fn next(room: &mut Room, now_ms: u64, startable: impl Fn(&Entry) -> bool) -> Option<(Ticket, Entry)> {
        next_holding(room, now_ms, &[], startable)
    }

    /// The same, where a node holds `held`'s tokens of its tickets' prompts
    /// (a token is expected to take a millisecond).
    fn next_holding(
        room: &mut Room,
        now_ms: u64,
        held: &[(Ticket, u64)],
        startable: impl Fn(&Entry) -> bool,
    ) -> Option<(Ticket, Entry)> {
        let held = |ticket| held.iter().find(|(t, _)| *t == ticket).map_or(0, |(_, tokens)| *tokens);
        let expected_ms = |ticket, entry: &Entry| entry.cost.saturating_sub(held(ticket));
        let mut taken = false;
        let left = room.leave_startable(now_ms, expected_ms, |_, entry| {
            let take = !taken && startable(entry);
            taken |= take;
            take.then_some(())
        });
        left.into_iter().next().map(|(ticket, entry, ())| (ticket, entry))
    }

    fn any(_: &Entry) -> bool {
        true
    }

    fn order(room: &mut Room, now_ms: u64) -> Vec<String> {
        let left = room.leave_startable(now_ms, |_, _| 0, |_, _| Some(()));
        left.into_iter().map(|(_, e, ())| e.flow.to_string()).collect()
    }

    #[test]
    fn a_flow_arriving_behind_a_backlog_leaves_next_not_after_it() {
        let mut room = Room::new(LIMITS);
        for _ in 0..64 {
            room.enter(entry("a", Class::Interactive, 3_000), 0).unwrap();
        }
        // Two of A's leave; then B arrives with one short request.
        assert_eq!(order(&mut room, 0).len(), 64, "all of A's, in turn");
        for _ in 0..64 {
            room.enter(entry("a", Class::Interactive, 3_000), 1).unwrap();
        }
        next(&mut room, 1, any).unwrap();
        room.enter(entry("b", Class::Interactive, 100), 2).unwrap();
        let (_, next) = next(&mut room, 2, any).unwrap();
        assert_eq!(&*next.flow, "b", "B waits for no more than the request leaving");
    }

    #[test]
    fn flows_share_by_weight_and_cost() {
        let mut room = Room::new(LIMITS);
        for _ in 0..30 {
            room.enter(Entry { weight: 2, ..entry("heavy", Class::Interactive, 100) }, 0).unwrap();
            room.enter(entry("light", Class::Interactive, 100), 0).unwrap();
        }
        let first: Vec<String> = order(&mut room, 0).into_iter().take(30).collect();
        let heavy = first.iter().filter(|f| *f == "heavy").count();
        assert!((19..=21).contains(&heavy), "twice the weight, twice the turns: {heavy} of 30");
        // Twice the cost, half the turns.
        let mut room = Room::new(LIMITS);
        for _ in 0..30 {
            room.enter(entry("long", Class::Interactive, 200), 0).unwrap();
            room.enter(entry("short", Class::Interactive, 100), 0).unwrap();
        }
        let first: Vec<String> = order(&mut room, 0).into_iter().take(30).collect();
        let long = first.iter().filter(|f| *f == "long").count();
        assert!((9..=11).contains(&long), "{long} of 30");
    }

    #[test]
    fn interactive_goes_first_and_batch_is_not_starved() {
        let mut room = Room::new(LIMITS);
        let batch = room.enter(entry("b", Class::Batch, 1), 0).unwrap();
        room.enter(entry("i", Class::Interactive, 1_000_000), 5_000).unwrap();
        let (first, _) = next(&mut room, 5_000, any).unwrap();
        assert_ne!(first, batch, "interactive first");
        room.enter(entry("i", Class::Interactive, 1), 5_000).unwrap();
        // Past the aging bound, batch goes with the interactive ones, by tag.
        let (after, _) = next(&mut room, 10_000, any).unwrap();
        assert_eq!(after, batch);
    }

    #[test]
    fn only_what_can_start_leaves_and_first_come_goes_first_within_a_flow() {
        let mut room = Room::new(LIMITS);
        let a = room.enter(Entry { model: Arc::from("x"), ..entry("f", Class::Interactive, 1) }, 0).unwrap();
        let b = room.enter(Entry { model: Arc::from("y"), ..entry("f", Class::Interactive, 1) }, 0).unwrap();
        let c = room.enter(Entry { model: Arc::from("y"), ..entry("f", Class::Interactive, 1) }, 0).unwrap();
        let model = |name: &'static str| move |e: &Entry| &*e.model == name;
        assert_eq!(next(&mut room, 0, model("y")).map(|(t, _)| t), Some(b));
        assert!(next(&mut room, 0, model("z")).is_none());
        assert_eq!(next(&mut room, 0, any).map(|(t, _)| t), Some(a));
        assert_eq!(next(&mut room, 0, any).map(|(t, _)| t), Some(c));
        assert!(room.is_empty());
    }

    #[test]
    fn a_flow_s_cheap_requests_leave_ahead_of_its_long_ones_until_those_are_overdue() {
        let mut room = Room::new(LIMITS);
        // Long ones: 100 s expected each (a token takes a millisecond here).
        let long: Vec<Ticket> =
            (0..3).map(|_| room.enter(entry("f", Class::Interactive, 100_000), 0).unwrap()).collect();
        // Long too, but a node holds all its prompt but 50 tokens: known
        // once its node reports it, after it came.
        let short = room.enter(entry("f", Class::Interactive, 100_000), 10_000).unwrap();
        let other = room.enter(entry("g", Class::Interactive, 1_000), 10_000).unwrap();
        let held = [(short, 99_950)];
        // The short one takes its flow's first tag; the other flow keeps
        // its place, whichever of f's requests took that tag.
        assert_eq!(next_holding(&mut room, 10_000, &held, any).map(|(t, _)| t), Some(short));
        // The flow spent its first tag: the other flow's turn is next.
        assert_eq!(next(&mut room, 10_000, any).map(|(t, _)| t), Some(other));
        assert_eq!(next(&mut room, 10_000, any).map(|(t, _)| t), Some(long[0]));
        // Past half the longest wait (30 s), the long ones go by arrival,
        // ahead of a newer short one, whatever is left of their time.
        let newer = room.enter(entry("f", Class::Interactive, 100_000), 29_000).unwrap();
        assert_eq!(next_holding(&mut room, 30_000, &[(newer, 99_950)], any).map(|(t, _)| t), Some(long[1]));
    }

    #[test]
    fn a_long_request_waits_behind_its_flow_s_cheap_ones_about_its_own_expected_time_at_most() {
        let mut room = Room::new(LIMITS);
        // A first turn, 1,000 ms expected, then later turns of 50 ms each,
        // arriving as fast as they leave.
        let long = room.enter(entry("f", Class::Interactive, 1_000), 0).unwrap();
        let mut now = 0;
        loop {
            let short = room.enter(entry("f", Class::Interactive, 1_000), now).unwrap();
            let (left, _) = next_holding(&mut room, now, &[(short, 950)], any).unwrap();
            if left == long {
                break;
            }
            assert_eq!(left, short);
            assert!(now < 1_000, "still behind cheap ones after {now} ms");
            now += 50;
        }
        // Its 1,000 ms less the 950 it waited ties with a new one's 50, and
        // it came first.
        assert_eq!(now, 950);
    }

    #[test]
    fn bounds_refuse_and_leaving_gives_room_back() {
        let limits = Limits { requests: 4, bytes: 1_000, flow_share_percent: 50, ..LIMITS };
        let mut room = Room::new(limits);
        let first = room.enter(entry("a", Class::Interactive, 1), 0).unwrap();
        room.enter(entry("a", Class::Interactive, 1), 0).unwrap();
        assert_eq!(room.enter(entry("a", Class::Interactive, 1), 0), Err(Refused::FlowShare));
        room.enter(entry("b", Class::Interactive, 1), 0).unwrap();
        assert_eq!(room.enter(Entry { bytes: 901, ..entry("c", Class::Interactive, 1) }, 0), Err(Refused::Full));
        room.enter(entry("c", Class::Interactive, 1), 0).unwrap();
        assert_eq!(room.enter(entry("d", Class::Interactive, 1), 0), Err(Refused::Full));
        assert_eq!(room.len(), (4, 400));
        assert!(room.leave(first).is_some());
        assert!(room.leave(first).is_none(), "once");
        assert!(room.enter(entry("a", Class::Interactive, 1), 1_000).is_ok());
        assert_eq!(room.expired(59_999), Vec::new());
        assert_eq!(room.expired(60_000).len(), 3, "those that came at 0");
        assert_eq!(room.expired(61_000).len(), 4);
    }

    #[test]
    fn a_flow_holds_at_most_its_share_of_the_bytes_beyond_its_first_request() {
        let limits = Limits { requests: 100, bytes: 1_000, flow_share_percent: 50, ..LIMITS };
        let mut room = Room::new(limits);
        let big = |flow| Entry { bytes: 600, ..entry(flow, Class::Interactive, 1) };
        room.enter(big("a"), 0).unwrap();
        assert_eq!(room.enter(Entry { bytes: 100, ..entry("a", Class::Interactive, 1) }, 0), Err(Refused::FlowShare));
        assert_eq!(room.enter(big("b"), 0), Err(Refused::Full), "the room's own bound");
        assert!(room.enter(Entry { bytes: 300, ..entry("b", Class::Interactive, 1) }, 0).is_ok());
    }

    #[test]
    fn a_flow_s_turns_follow_what_its_requests_spent_not_what_they_were_guessed_to() {
        let mut room = Room::new(LIMITS);
        for _ in 0..4 {
            room.enter(entry("guessed", Class::Interactive, 100), 0).unwrap();
            room.enter(entry("honest", Class::Interactive, 100), 0).unwrap();
        }
        let (ticket, first) = next(&mut room, 0, any).unwrap();
        assert_eq!(&*first.flow, "guessed");
        // It generated four times its guess: its flow's next turns come
        // after as much of the other's.
        room.settle(ticket, "guessed", 1, 100, 400);
        assert_eq!(order(&mut room, 0), ["honest", "honest", "honest", "honest", "guessed", "guessed", "guessed"]);

        // One that spent nothing of a long limit gives it back.
        let mut room = Room::new(LIMITS);
        room.enter(entry("limited", Class::Interactive, 300), 0).unwrap();
        for _ in 0..3 {
            room.enter(entry("other", Class::Interactive, 100), 0).unwrap();
        }
        room.enter(entry("limited", Class::Interactive, 300), 0).unwrap();
        let (ticket, first) = next(&mut room, 0, any).unwrap();
        assert_eq!(&*first.flow, "limited");
        room.settle(ticket, "limited", 1, 300, 0);
        assert_eq!(order(&mut room, 0), ["other", "limited", "other", "other"]);
        // A flow no longer in the room is left forgotten.
        room.settle(ticket, "limited", 3, 300, 3_000);
        assert!(room.flows.is_empty());
    }

    #[test]
    fn a_refund_is_for_the_flow_that_paid_and_not_past_the_present() {
        let mut room = Room::new(LIMITS);
        // A request whose limit is a whole window leaves, alone: its flow
        // is forgotten.
        room.enter(entry("a", Class::Interactive, 100_000), 0).unwrap();
        let (paid, _) = next(&mut room, 0, any).unwrap();
        for _ in 0..3 {
            room.enter(entry("b", Class::Interactive, 100), 0).unwrap();
        }
        room.enter(entry("a", Class::Interactive, 100), 0).unwrap();
        room.enter(entry("a", Class::Interactive, 100), 0).unwrap();
        // It spent nothing: the requests of the same name that came after
        // it are no earlier for that.
        room.settle(paid, "a", 1, 100_000, 0);
        assert_eq!(order(&mut room, 0), ["b", "a", "b", "a", "b"]);

        // Within one flow, a refund takes its tags back to the present at
        // most.
        let mut room = Room::new(LIMITS);
        room.enter(entry("a", Class::Interactive, 1_000), 0).unwrap();
        room.enter(entry("b", Class::Interactive, 100), 0).unwrap();
        room.enter(entry("b", Class::Interactive, 100), 0).unwrap();
        room.enter(entry("a", Class::Interactive, 1_000), 0).unwrap();
        let (a_first, _) = next(&mut room, 0, |e| &*e.flow == "a").unwrap();
        for _ in 0..2 {
            next(&mut room, 0, |e| &*e.flow == "b").unwrap();
        }
        assert_eq!(room.now_tag, tag_length(100, 1), "b's second tag");
        // It spent nothing of its 1,000: a's second, at 1,000, would go
        // back to 0; the present is 100.
        room.settle(a_first, "a", 1, 1_000, 0);
        let a_second = room.waiting.values().find(|w| &*w.entry.flow == "a").unwrap();
        assert_eq!((a_second.start, room.flows["a"].finish), (room.now_tag, tag_length(1_000, 1)));
    }

    #[test]
    fn flows_with_nothing_waiting_are_forgotten() {
        let mut room = Room::new(LIMITS);
        for i in 0..1_000 {
            room.enter(entry(&format!("flow-{i}"), Class::Interactive, 1), 0).unwrap();
            next(&mut room, 0, any).unwrap();
        }
        assert!(room.flows.is_empty(), "{} flows kept", room.flows.len());
    }
}
