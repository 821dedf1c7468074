//! The data plane's queue: a request whose best node has no free slot
//! waits here, not in that server's queue, and leaves in
//! [`crate::waiting::Room`]'s order as soon as routing finds it a node
//! that can start it. Routing runs again as it leaves (late binding): the
//! node is the one that frees first, or the conversation's home when it
//! frees before a recompute elsewhere would pay.
//!
//! One task, [`run`], lets requests out: woken when one of this data
//! plane's requests ends (a slot it held is free), when a snapshot comes
//! (another data plane's ended, a node joined), and on a tick for the age
//! bound. Requests come in by [`Queue::enter`] and wait on their
//! [`Place`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use inferyes_proto::v1::EndpointKind;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::routing::{self, Mode, Route, RouteError, RouteRequest};
use crate::snapshot::{RoutingSnapshot, SnapshotStore};
use crate::targets::{InFlight, Local};
use crate::waiting::{Class, Entry, Limits, Refused, Room, Ticket};

/// What routing needs of a waiting request besides its entry.
#[derive(Clone, Debug)]
pub struct Ask {
    pub kind: EndpointKind,
    pub session: Option<String>,
    pub prompt_tokens: u32,
    pub mode: Mode,
    pub carry: bool,
    /// Whose it is: an error as it leaves names only models it may use.
    pub caller: crate::auth::Caller,
    /// Its place in its flow's share of the model's slots: it leaves only
    /// while the flow has fewer running than its part here.
    pub slot: Option<Arc<crate::slot_shares::Hold>>,
}

/// How a wait ends.
#[derive(Debug)]
pub enum Turn {
    /// A node can start it: the route made as it left, on `snapshot`, and
    /// a count of it in flight at the first target, held until its own
    /// attempt counts it (so that the next request let out does not take
    /// the same slot).
    Go { route: Box<Route>, snapshot: Arc<RoutingSnapshot>, reserved: Option<InFlight> },
    /// Routing refused it as it left (its model went, say).
    Refused(RouteError),
    /// It waited as long as it may.
    TooLong { waited_ms: u64, retry_after_s: u32 },
    /// The data plane is shutting down.
    Closed,
}

/// What decides whether a waiting request can start, but for the free
/// slots: its model and kind, its conversation's node, and its prompt's
/// size (by powers of two: a shorter prompt may move where a longer one
/// may not).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Shape {
    model: Arc<str>,
    kind: EndpointKind,
    home: Option<crate::snapshot::Target>,
    size: u32,
}

/// Requests one pass routes at most: past them, the rest wait for the
/// next pass (a queue of a thousand conversations, each routed on every
/// request's end, would cost a core).
const MAX_ROUTED_PER_PASS: usize = 256;

/// Why a request was not let in, and when to try again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotIn {
    pub why: Refused,
    pub retry_after_s: u32,
}

/// The queue; see the module's comment.
pub struct Queue {
    limits: Limits,
    inner: Mutex<Inner>,
    freed: Arc<crate::targets::Freed>,
    metrics: Arc<crate::metrics::Metrics>,
}

struct Inner {
    room: Room,
    waiters: HashMap<Ticket, Waiter>,
    /// When the last requests left (ms), for the drain rate.
    left: VecDeque<u64>,
}

struct Waiter {
    ask: Ask,
    sender: oneshot::Sender<Turn>,
    since: std::time::Instant,
    labels: crate::metrics::QueueLabels,
}

/// Departures kept for the drain rate.
const DRAIN_WINDOW: usize = 64;

impl Queue {
    pub fn new(limits: Limits, store: &SnapshotStore, metrics: Arc<crate::metrics::Metrics>) -> Queue {
        Queue {
            limits,
            inner: Mutex::new(Inner { room: Room::new(limits), waiters: HashMap::new(), left: VecDeque::new() }),
            freed: Arc::clone(store.node_states().freed()),
            metrics,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lets a request in to wait, or says why not and when to try again.
    /// `flow_label` names its flow in metrics: a tenant or a key, never a
    /// client's address (the flow of a keyless request).
    pub fn enter(self: &Arc<Self>, entry: Entry, ask: Ask, flow_label: &str) -> Result<Place, NotIn> {
        let labels = crate::metrics::QueueLabels { flow: flow_label.to_string(), class: class_name(entry.class) };
        let mut inner = self.lock();
        let now_ms = inferyes_proto::unix_ms();
        let ticket = match inner.room.enter(entry, now_ms) {
            Ok(ticket) => ticket,
            Err(why) => {
                let retry_after_s = inner.retry_after_s(self.limits.max_wait_ms, now_ms);
                drop(inner);
                let reason = match why {
                    Refused::Full => "full",
                    Refused::FlowShare => "share",
                };
                self.metrics.queue_refused.get_or_create(&labels.with_reason(reason)).inc();
                return Err(NotIn { why, retry_after_s });
            }
        };
        let (sender, receiver) = oneshot::channel();
        self.metrics.queue_entered.get_or_create(&labels).inc();
        self.metrics.queue_waiting.get_or_create(&labels).inc();
        inner.waiters.insert(ticket, Waiter { ask, sender, since: std::time::Instant::now(), labels });
        self.freed.watch(true);
        drop(inner);
        // It may start at once: a slot freed between its routing and now.
        self.freed.wake();
        Ok(Place { queue: Arc::clone(self), ticket, receiver, done: false })
    }

    /// Lets out what may start now: a flow held back may not be any more.
    pub fn nudge(&self) {
        self.freed.wake();
    }

    /// The request of `ticket` has ended: see [`Room::settle`].
    pub fn settle(&self, ticket: Ticket, flow: &str, weight: u32, charged: u64, spent: u64) {
        self.lock().room.settle(ticket, flow, weight, charged, spent);
    }

    /// What waits now, by flow and class, the longest waiting first; at
    /// most `most` flows.
    pub fn waiting(&self, most: usize) -> Vec<inferyes_proto::v1::QueuedFlow> {
        let inner = self.lock();
        let mut flows: HashMap<&crate::metrics::QueueLabels, (u32, std::time::Instant)> = HashMap::new();
        for waiter in inner.waiters.values() {
            let flow = flows.entry(&waiter.labels).or_insert((0, waiter.since));
            flow.0 += 1;
            flow.1 = flow.1.min(waiter.since);
        }
        let mut flows: Vec<_> = flows.into_iter().collect();
        flows.sort_by_key(|(labels, (_, since))| (*since, labels.flow.clone()));
        flows
            .into_iter()
            .take(most)
            .map(|(labels, (waiting, since))| inferyes_proto::v1::QueuedFlow {
                flow: labels.flow.clone(),
                priority: match labels.class {
                    "batch" => inferyes_proto::v1::Priority::Batch,
                    _ => inferyes_proto::v1::Priority::Interactive,
                } as i32,
                waiting,
                oldest_wait_ms: u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX),
            })
            .collect()
    }

    /// Whether any request waits, without taking the lock: a request that
    /// could start at once still goes through the queue then, so that it
    /// does not take a slot freed for one that waits.
    pub fn holds_any(&self) -> bool {
        self.freed.watched()
    }

    /// Requests waiting now.
    pub fn len(&self) -> usize {
        self.lock().room.len().0
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn leave(&self, ticket: Ticket) {
        let mut inner = self.lock();
        if inner.room.leave(ticket).is_some()
            && let Some(waiter) = inner.waiters.remove(&ticket)
        {
            self.metrics.queue_waiting.get_or_create(&waiter.labels).dec();
        }
        self.freed.watch(!inner.room.is_empty());
    }

    /// Lets out every request a node can start now, and those that have
    /// waited too long, on `snapshot`.
    fn dispatch(&self, snapshot: &Arc<RoutingSnapshot>, tickets: &std::sync::atomic::AtomicU64) {
        let now_ms = inferyes_proto::unix_ms();
        let now = std::time::Instant::now();
        let mut inner = self.lock();
        let Inner { room, waiters, left } = &mut *inner;
        for ticket in room.expired(now_ms) {
            room.leave(ticket);
            let Some(waiter) = waiters.remove(&ticket) else { continue };
            let waited_ms = u64::try_from(waiter.since.elapsed().as_millis()).unwrap_or(u64::MAX);
            let retry_after_s = retry_after_s(left, room.len().0, self.limits.max_wait_ms, now_ms);
            self.finish(&waiter, "age");
            let _ = waiter.sender.send(Turn::TooLong { waited_ms, retry_after_s });
        }
        let mut frozen = PassView::of(snapshot);
        // Requests like one that could not start in this pass cannot either
        // (the pass only takes slots): they are not routed again.
        let mut blocked: HashSet<Shape> = HashSet::new();
        let mut routed = 0;
        // How long a request's prompt takes to read before its first token:
        // the part no node holds of its conversation, as reported now, at
        // its model's fastest prompt rate. Its output is left out: a limit
        // says little of what a request generates, and at the prompt rate
        // it would outweigh the prompt of a conversation's next turn.
        let expected_ms = |ticket, entry: &Entry| {
            let Some(ask) = waiters.get(&ticket).map(|w| &w.ask) else { return 0 };
            let local = snapshot.local();
            let resident = ask.session.as_deref().and_then(|s| routing::residence(snapshot, local, s, now_ms));
            let held = resident.map_or(0, |r| r.tokens);
            let rate = snapshot
                .placements(&entry.model)
                .and_then(|p| p.first())
                .map_or(crate::snapshot::DEFAULT_PREFILL_TOKENS_PER_SECOND, |p| p.fastest_prefill_tokens_per_second);
            (f64::from(ask.prompt_tokens.saturating_sub(held)) * 1e3 / rate.max(1.0)) as u64
        };
        let leaving = room.leave_startable(now_ms, expected_ms, |ticket, entry| {
            let ask = &waiters.get(&ticket)?.ask;
            // Its flow runs its part of the model's slots here: it waits,
            // others like it need not.
            if ask.slot.as_ref().is_some_and(|slot| !slot.may_start(now)) {
                return None;
            }
            let like = Shape {
                model: Arc::clone(&entry.model),
                kind: ask.kind,
                home: ask
                    .session
                    .as_deref()
                    .and_then(|s| routing::residence(snapshot, &frozen, s, now_ms))
                    .map(|r| r.target),
                size: ask.prompt_tokens.checked_ilog2().unwrap_or(0),
            };
            if routed >= MAX_ROUTED_PER_PASS || blocked.contains(&like) {
                return None;
            }
            routed += 1;
            let request = RouteRequest {
                model: &entry.model,
                kind: ask.kind,
                session: ask.session.as_deref(),
                prompt_tokens: ask.prompt_tokens,
                mode: ask.mode,
                carry: ask.carry,
                ticket: tickets.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                now_ms,
            };
            match routing::select(snapshot, &frozen, &request) {
                // No node could take it in this snapshot (none ready, say):
                // it waits on, within its age bound, for one that can.
                Ok(Route { waits: true, .. }) | Err(RouteError::NoCapacity { .. }) => {
                    blocked.insert(like);
                    None
                }
                Ok(route) => {
                    // Counted at its node now, so that the next request let
                    // out does not take the same slot. A slot a request
                    // sent on by a worker took meanwhile is not free: it
                    // waits for the next pass.
                    let Ok(reserved) = take_slot(snapshot, &entry.model, &route) else {
                        blocked.insert(like);
                        return None;
                    };
                    // A request of its flow started past the check above
                    // meanwhile: the slot goes back (`reserved` dropped).
                    if ask.slot.as_ref().is_some_and(|slot| !slot.try_start(now)) {
                        return None;
                    }
                    route.targets.first().inspect(|target| frozen.entered(target.node));
                    Some(Turn::Go { route: Box::new(route), snapshot: Arc::clone(snapshot), reserved })
                }
                Err(RouteError::ModelNotFound { .. }) => {
                    let visible = |entry: &crate::snapshot::CatalogEntry| ask.caller.may_see(entry);
                    Some(Turn::Refused(routing::model_not_found(snapshot, &entry.model, visible)))
                }
                Err(error) => Some(Turn::Refused(error)),
            }
        });
        for (ticket, _, turn) in leaving {
            let Some(waiter) = waiters.remove(&ticket) else { continue };
            left.push_back(now_ms);
            if left.len() > DRAIN_WINDOW {
                left.pop_front();
            }
            self.finish(&waiter, "dispatched");
            // A client gone meanwhile drops its turn, and the count held
            // for it with it.
            let _ = waiter.sender.send(turn);
        }
        self.freed.watch(!room.is_empty());
    }

    /// Ends every wait: the data plane is shutting down, and no request
    /// waiting now will be let out.
    fn close(&self) {
        let mut inner = self.lock();
        let Inner { room, waiters, .. } = &mut *inner;
        for (ticket, waiter) in waiters.drain() {
            room.leave(ticket);
            self.finish(&waiter, "shutdown");
            let _ = waiter.sender.send(Turn::Closed);
        }
        self.freed.watch(false);
    }

    fn finish(&self, waiter: &Waiter, how: &'static str) {
        let metrics = &self.metrics;
        metrics.queue_waiting.get_or_create(&waiter.labels).dec();
        metrics.queue_wait_seconds.get_or_create(&waiter.labels).observe(waiter.since.elapsed().as_secs_f64());
        if how == "dispatched" {
            metrics.queue_dispatched.get_or_create(&waiter.labels).inc();
        } else {
            metrics.queue_refused.get_or_create(&waiter.labels.with_reason(how)).inc();
        }
    }
}

impl Inner {
    fn retry_after_s(&self, max_wait_ms: u64, now_ms: u64) -> u32 {
        retry_after_s(&self.left, self.room.len().0, max_wait_ms, now_ms)
    }
}

/// When a request refused now would likely get in: the time the queue
/// takes to let out what waits, at the rate it let requests out lately,
/// within 1 s and the age bound.
fn retry_after_s(left: &VecDeque<u64>, waiting: usize, max_wait_ms: u64, now_ms: u64) -> u32 {
    let most = max_wait_ms.div_ceil(1_000).max(1);
    let (Some(first), Some(_)) = (left.front(), left.back()) else { return most.min(u64::from(u32::MAX)) as u32 };
    // Over the window up to now: a queue that stopped draining drains slowly.
    let span_ms = now_ms.saturating_sub(*first).max(1);
    let seconds = (waiting as u64 + 1).saturating_mul(span_ms).div_ceil(left.len() as u64 * 1_000);
    seconds.clamp(1, most).min(u64::from(u32::MAX)) as u32
}

/// Another request took the slot a route counted on.
#[derive(Debug)]
pub struct SlotTaken;

/// The slot a request routed to start now takes at its first target,
/// counted there from now on (`None` for a cold load: its attempt counts
/// it, with the memory it holds). Workers route at the same moment from
/// the same counts: the one whose node filled meanwhile is told so, and
/// waits. Where the node's slots are not counted the server's queue
/// decides, and the request is counted all the same, for the balance.
pub fn take_slot(snapshot: &RoutingSnapshot, model: &str, route: &Route) -> Result<Option<InFlight>, SlotTaken> {
    let Some(node) = route.targets.first().and_then(|target| snapshot.node(target.node)) else { return Ok(None) };
    if route.cold() {
        return Ok(None);
    }
    match routing::slot_room(snapshot, model, route) {
        Some(room) => node.endpoint.claim(room).map(Some).ok_or(SlotTaken),
        None => Ok(Some(node.endpoint.enter(None))),
    }
}

/// This data plane's state of the nodes as one pass of the dispatcher sees
/// it: its requests in flight as they were when the pass began, and those
/// the pass let out since. A request that ends mid-pass wakes the next
/// pass rather than free a slot for whichever request this one happens to
/// be routing then: the queue's order holds.
struct PassView<'s> {
    view: &'s crate::targets::View,
    in_flight: Vec<u32>,
}

impl<'s> PassView<'s> {
    fn of(snapshot: &'s RoutingSnapshot) -> PassView<'s> {
        let view = snapshot.local();
        PassView { view, in_flight: (0..snapshot.nodes().len()).map(|node| view.in_flight(node)).collect() }
    }

    fn entered(&mut self, node: usize) {
        if let Some(count) = self.in_flight.get_mut(node) {
            *count += 1;
        }
    }
}

impl Local for PassView<'_> {
    fn in_flight(&self, node: usize) -> u32 {
        self.in_flight.get(node).copied().unwrap_or(0)
    }

    fn reserved_vram_bytes(&self, node: usize) -> u64 {
        self.view.reserved_vram_bytes(node)
    }

    fn ejected_until(&self, node: usize, now_ms: u64) -> Option<u64> {
        self.view.ejected_until(node, now_ms)
    }

    fn sent_turn(&self, session: u64, now_ms: u64) -> Option<crate::turns::Sent> {
        self.view.sent_turn(session, now_ms)
    }
}

fn class_name(class: Class) -> &'static str {
    match class {
        Class::Interactive => "interactive",
        Class::Batch => "batch",
    }
}

/// A request's place in the queue: awaited for its turn; dropped (its
/// client gone), it leaves.
pub struct Place {
    queue: Arc<Queue>,
    ticket: Ticket,
    receiver: oneshot::Receiver<Turn>,
    done: bool,
}

impl Place {
    /// Its place in the room's order, for [`Queue::settle`].
    pub fn ticket(&self) -> Ticket {
        self.ticket
    }

    pub async fn turn(&mut self) -> Turn {
        let turn = (&mut self.receiver).await;
        self.done = true;
        // The queue ends every wait it holds with a turn, a shutdown's
        // included: a turn lost is one.
        turn.unwrap_or(Turn::Closed)
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if !self.done {
            self.queue.leave(self.ticket);
        }
    }
}

/// Lets requests out of `queue` until `shutdown` (the end of a shutdown's
/// grace period: those waiting till then are sent on meanwhile), then
/// answers those still waiting that the data plane is shutting down.
pub async fn run(
    queue: Arc<Queue>,
    store: Arc<SnapshotStore>,
    tickets: Arc<std::sync::atomic::AtomicU64>,
    shutdown: CancellationToken,
) {
    /// The age bound is checked this often, whatever else happens.
    const TICK: Duration = Duration::from_millis(250);
    let mut versions = store.versions();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = queue.freed.ended() => {}
            changed = versions.changed() => if changed.is_err() { break },
            () = tokio::time::sleep(TICK) => {}
        }
        if queue.is_empty() {
            continue;
        }
        if let Some(snapshot) = store.current() {
            queue.dispatch(&snapshot, &tickets);
        }
    }
    queue.close();
}
