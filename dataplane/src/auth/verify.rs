//! The argon2 verifier's queue: who is checked next when checks wait.
//!
//! Each check holds a core and 19 MiB for tens of milliseconds, so only a
//! few run at once and the rest wait. The order they wait in is what keeps
//! a flood of wrong secrets from holding up a valid key:
//!
//! - **Fresh** checks go first: their key id has failed no check lately.
//!   A key id has at most one fresh check at a time (a key has one secret;
//!   a second, different one for the same id is a guess until the first is
//!   settled), so a flood against one key makes one fresh check, then its
//!   key id is suspect.
//! - **Suspect** checks may hold all slots but one: a fresh check waits
//!   for no suspect one, only for fresh checks ahead of it, and the cores a
//!   flood can burn are bounded the same way.
//! - Within each class, clients take turns (round robin by client address),
//!   each in the order it sent. A client may have at most [`PER_CLIENT`]
//!   suspect checks waiting; fresh ones are bounded by the key ids, and
//!   each key id's by its first failure. Each class holds at most
//!   [`MAX_WAITING`]: suspect checks never crowd fresh ones out.
//!
//! A check runs as a task of its own, shared by every request presenting
//! the same key while it waits or runs, and once it has a slot it runs to
//! its end and reports its verdict whoever still waits: hanging up cannot
//! start more argon2 than there are slots, nor make a wrong secret go
//! uncounted. A check every request left before it got a slot is dropped.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{oneshot, watch};

use super::lock;

/// Suspect checks one client may have waiting; past it, its next is
/// refused (its own, never another client's).
pub const PER_CLIENT: usize = 8;
/// Checks waiting at most in each class, of every client: each holds a
/// request.
pub const MAX_WAITING: usize = 4096;

/// Why a check was not made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Busy {
    /// This client has [`PER_CLIENT`] checks waiting already.
    Client,
    /// [`MAX_WAITING`] checks of its class are waiting.
    Everyone,
}

pub struct Verifier {
    slots: usize,
    queue: Mutex<Queue>,
    /// Checks under way by the presented key's digest, for requests
    /// presenting the same key at once to share.
    checks: Mutex<HashMap<[u8; 16], Pending>>,
    ids: AtomicU64,
}

/// A check under way.
struct Pending {
    /// Tells a check from a later one of the same key.
    id: u64,
    verdict: watch::Receiver<Option<Result<bool, Busy>>>,
    /// Requests waiting on it.
    requests: usize,
    /// It has a slot: it runs to its end, whoever waits.
    running: bool,
    task: tokio::task::AbortHandle,
}

/// What a check holds while it waits or runs: the key id of a fresh check
/// (`None`: a suspect one).
type Claim = Option<String>;

#[derive(Default)]
struct Queue {
    running: usize,
    running_suspect: usize,
    fresh: Turns,
    suspect: Turns,
    /// Key ids with a fresh check waiting or running.
    fresh_keys: HashSet<String>,
}

/// Waiting checks of one class, by client, taken in turn.
#[derive(Default)]
struct Turns {
    order: VecDeque<IpAddr>,
    by_client: HashMap<IpAddr, VecDeque<oneshot::Sender<()>>>,
    /// Senders held, of waiters there or gone.
    waiting: usize,
}

impl Turns {
    /// Queues `waiter` behind `client`'s others, waiters that went away
    /// dropped on the way.
    fn push(&mut self, client: IpAddr, waiter: oneshot::Sender<()>, cap: usize) -> Result<(), Busy> {
        let queue = self.by_client.entry(client).or_default();
        let before = queue.len();
        queue.retain(|waiter| !waiter.is_closed());
        self.waiting -= before - queue.len();
        let full = if queue.len() >= cap {
            Some(Busy::Client)
        } else {
            (self.waiting >= MAX_WAITING).then_some(Busy::Everyone)
        };
        if let Some(busy) = full {
            if before == 0 {
                // Not in the order: nothing of it is left behind.
                self.by_client.remove(&client);
            }
            return Err(busy);
        }
        if before == 0 {
            self.order.push_back(client);
        }
        queue.push_back(waiter);
        self.waiting += 1;
        Ok(())
    }

    /// The next client's first waiter; the client goes to the back.
    fn pop(&mut self) -> Option<oneshot::Sender<()>> {
        loop {
            let client = self.order.pop_front()?;
            let Some(queue) = self.by_client.get_mut(&client) else { continue };
            let waiter = queue.pop_front();
            if queue.is_empty() {
                self.by_client.remove(&client);
            } else {
                self.order.push_back(client);
            }
            if let Some(waiter) = waiter {
                self.waiting -= 1;
                return Some(waiter);
            }
        }
    }
}

impl Verifier {
    /// At least two slots: one is always kept from suspect checks.
    pub fn new(slots: usize) -> Arc<Verifier> {
        Arc::new(Verifier {
            slots: slots.max(2),
            queue: Mutex::default(),
            checks: Mutex::default(),
            ids: AtomicU64::new(0),
        })
    }

    /// The verdict of `check`, run on the blocking pool after its class's
    /// turn for a slot, once for every request presenting `digest` while
    /// it waits or runs; `settled` is told the verdict first, whether or
    /// not any request still waits. `Err` when the queue is full for this
    /// client or for everyone.
    pub async fn check<C, S>(self: &Arc<Self>, digest: [u8; 16], turn: Turn, check: C, settled: S) -> Result<bool, Busy>
    where
        C: FnOnce() -> bool + Send + 'static,
        S: FnOnce(bool) + Send + 'static,
    {
        let (id, mut verdict) = {
            let mut checks = lock(&self.checks);
            match checks.get_mut(&digest) {
                Some(pending) => {
                    pending.requests += 1;
                    (pending.id, pending.verdict.clone())
                }
                None => {
                    let id = self.ids.fetch_add(1, Ordering::Relaxed);
                    let (tell, verdict) = watch::channel(None);
                    let task = tokio::spawn(Arc::clone(self).run(digest, id, turn, check, settled, tell));
                    let pending = Pending {
                        id,
                        verdict: verdict.clone(),
                        requests: 1,
                        running: false,
                        task: task.abort_handle(),
                    };
                    checks.insert(digest, pending);
                    (id, verdict)
                }
            }
        };
        let _request = Request { verifier: self, digest, id };
        match verdict.wait_for(Option::is_some).await {
            Ok(told) => told.unwrap_or(Err(Busy::Everyone)),
            // The task ended without a verdict (it panicked).
            Err(_) => Err(Busy::Everyone),
        }
    }

    async fn run<C, S>(
        self: Arc<Self>,
        digest: [u8; 16],
        id: u64,
        turn: Turn,
        check: C,
        settled: S,
        tell: watch::Sender<Option<Result<bool, Busy>>>,
    ) where
        C: FnOnce() -> bool + Send + 'static,
        S: FnOnce(bool) + Send + 'static,
    {
        let slot = match self.slot(&turn).await {
            Ok(slot) => slot,
            Err(busy) => {
                self.finish(digest, id);
                let _ = tell.send(Some(Err(busy)));
                return;
            }
        };
        match lock(&self.checks).get_mut(&digest) {
            Some(pending) if pending.id == id => pending.running = true,
            // Every request went away before the slot came.
            _ => return,
        }
        // However this ends (a panic in `settled` included), the next
        // request presenting the key is not left waiting on this check.
        let _finished = Finished { verifier: &self, digest, id };
        let checked = tokio::task::spawn_blocking(move || {
            let _slot = slot;
            check()
        })
        .await;
        // A check that did not run to its verdict (it panicked, or the
        // runtime is shutting down) says nothing of the secret.
        let Ok(verdict) = checked else {
            let _ = tell.send(Some(Err(Busy::Everyone)));
            return;
        };
        settled(verdict);
        let _ = tell.send(Some(Ok(verdict)));
    }

    /// The check is over: the next request presenting its key starts
    /// afresh (or finds it verified).
    fn finish(&self, digest: [u8; 16], id: u64) {
        let mut checks = lock(&self.checks);
        if checks.get(&digest).is_some_and(|pending| pending.id == id) {
            checks.remove(&digest);
        }
    }

    async fn slot(self: &Arc<Self>, turn: &Turn) -> Result<Slot, Busy> {
        let (sender, receiver) = oneshot::channel();
        let claim = {
            let mut queue = self.lock();
            let claim = turn.key_id.as_ref().filter(|key_id| !queue.fresh_keys.contains(key_id.as_str())).cloned();
            // Fresh checks are bounded by the key ids, one each.
            match claim {
                Some(_) => queue.fresh.push(turn.client, sender, MAX_WAITING)?,
                None => queue.suspect.push(turn.client, sender, PER_CLIENT)?,
            }
            if let Some(key_id) = &claim {
                queue.fresh_keys.insert(key_id.clone());
            }
            queue.dispatch(self.slots);
            claim
        };
        let mut waiter = Waiter { verifier: self, receiver, claim: Some(claim) };
        // The queue hands every waiter a slot, or finds its receiver gone.
        if (&mut waiter.receiver).await.is_err() {
            return Err(Busy::Everyone);
        }
        let claim = waiter.claim.take().flatten();
        Ok(Slot { verifier: Arc::clone(self), claim })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        lock(&self.queue)
    }
}

/// Ends a running check's entry, however the check ends.
struct Finished<'a> {
    verifier: &'a Verifier,
    digest: [u8; 16],
    id: u64,
}

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.verifier.finish(self.digest, self.id);
    }
}

/// A request waiting on a check. The last to go, before the check has a
/// slot, drops the check.
struct Request<'a> {
    verifier: &'a Verifier,
    digest: [u8; 16],
    id: u64,
}

impl Drop for Request<'_> {
    fn drop(&mut self) {
        let mut checks = lock(&self.verifier.checks);
        let Some(pending) = checks.get_mut(&self.digest).filter(|pending| pending.id == self.id) else { return };
        pending.requests -= 1;
        if pending.requests == 0 && !pending.running {
            pending.task.abort();
            checks.remove(&self.digest);
        }
    }
}

impl Queue {
    /// A running check is done: its slot goes to the next waiter.
    fn release(&mut self, claim: &Claim, slots: usize) {
        self.running -= 1;
        if claim.is_none() {
            self.running_suspect -= 1;
        }
        self.release_key(claim);
        self.dispatch(slots);
    }

    fn release_key(&mut self, claim: &Claim) {
        if let Some(key_id) = claim {
            self.fresh_keys.remove(key_id);
        }
    }

    /// Hands free slots to waiters: fresh first, suspect while they hold
    /// fewer than all slots but one. A waiter that went away is skipped.
    fn dispatch(&mut self, slots: usize) {
        while self.running < slots {
            let (waiter, suspect) = match self.fresh.pop() {
                Some(waiter) => (waiter, false),
                None if self.running_suspect < slots - 1 => match self.suspect.pop() {
                    Some(waiter) => (waiter, true),
                    None => return,
                },
                None => return,
            };
            if waiter.send(()).is_ok() {
                self.running += 1;
                self.running_suspect += usize::from(suspect);
            }
        }
    }
}

/// Who a check is for: the client, and the key id when no check has
/// failed for it lately (a fresh check); `None` makes it suspect.
#[derive(Clone, Debug)]
pub struct Turn {
    pub client: IpAddr,
    pub key_id: Option<String>,
}

/// A check waiting for a slot. Dropped after it was handed one but before
/// it took it (its check was dropped), it hands the slot on.
struct Waiter<'a> {
    verifier: &'a Verifier,
    receiver: oneshot::Receiver<()>,
    /// Taken once the slot is.
    claim: Option<Claim>,
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        let Some(claim) = self.claim.take() else { return };
        // Under the lock slots are handed under: once closed, the receiver
        // can be handed none, and one handed already is passed on.
        let mut queue = self.verifier.lock();
        self.receiver.close();
        if self.receiver.try_recv().is_ok() {
            queue.release(&claim, self.verifier.slots);
        } else {
            queue.release_key(&claim);
        }
    }
}

/// One of the verifier's slots, held while a check runs.
struct Slot {
    verifier: Arc<Verifier>,
    claim: Claim,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.verifier.lock().release(&self.claim, self.verifier.slots);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
    use tokio::task::JoinHandle;

    /// A verifier whose checks say when they start and run until let go.
    struct Bench {
        verifier: Arc<Verifier>,
        started: UnboundedReceiver<&'static str>,
        log: UnboundedSender<&'static str>,
        /// Verdicts the checks settled, by name.
        settled: Arc<Mutex<Vec<(&'static str, bool)>>>,
    }

    /// A check under way: its task, and what lets it finish.
    struct Running {
        task: JoinHandle<Result<bool, Busy>>,
        finish: mpsc::Sender<bool>,
    }

    impl Bench {
        fn new() -> Bench {
            let (log, started) = unbounded_channel();
            Bench { verifier: Verifier::new(2), started, log, settled: Arc::default() }
        }

        /// Sends a check for `name` from `client`, fresh for `key_id`, and
        /// waits until it is queued or running.
        async fn send(&self, name: &'static str, client: u8, key_id: Option<&'static str>) -> Running {
            let (finish, verdict) = mpsc::channel();
            let (verifier, log, settled) = (Arc::clone(&self.verifier), self.log.clone(), Arc::clone(&self.settled));
            let before = self.queued();
            let task = tokio::spawn(async move {
                let turn = Turn { client: IpAddr::from([192, 0, 2, client]), key_id: key_id.map(str::to_string) };
                let digest = [
                    name.len() as u8,
                    name.as_bytes()[0],
                    name.as_bytes()[name.len() - 1],
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                ];
                let check = move || {
                    log.send(name).unwrap();
                    verdict.recv().unwrap_or(false)
                };
                let settle = move |verdict| settled.lock().unwrap().push((name, verdict));
                verifier.check(digest, turn, check, settle).await
            });
            self.until(|| self.queued() > before || task.is_finished()).await;
            Running { task, finish }
        }

        /// Checks waiting (their requests still there) or running.
        fn queued(&self) -> usize {
            let queue = self.verifier.lock();
            let live = |turns: &Turns| turns.by_client.values().flatten().filter(|w| !w.is_closed()).count();
            live(&queue.fresh) + live(&queue.suspect) + queue.running
        }

        async fn until(&self, mut done: impl FnMut() -> bool) {
            for _ in 0..10_000 {
                if done() {
                    return;
                }
                tokio::task::yield_now().await;
            }
            panic!("never came to pass");
        }

        async fn next_started(&mut self) -> &'static str {
            self.started.recv().await.unwrap()
        }
    }

    impl Running {
        async fn finish(self, verdict: bool) -> Result<bool, Busy> {
            self.finish.send(verdict).unwrap();
            self.task.await.unwrap()
        }
    }

    #[tokio::test]
    async fn fresh_checks_go_first_and_suspect_ones_never_hold_every_slot() {
        let mut bench = Bench::new();
        let s1 = bench.send("s1", 1, None).await;
        assert_eq!(bench.next_started().await, "s1");
        let s2 = bench.send("s2", 1, None).await;
        // The second slot is kept from suspects: a fresh check takes it.
        let f1 = bench.send("f1", 2, Some("k1")).await;
        assert_eq!(bench.next_started().await, "f1");
        let s3 = bench.send("s3", 3, None).await;
        let f2 = bench.send("f2", 4, Some("k2")).await;
        assert_eq!(s1.finish(false).await, Ok(false));
        assert_eq!(bench.next_started().await, "f2", "a fresh check before the suspects that waited longer");
        assert_eq!(f1.finish(true).await, Ok(true));
        assert_eq!(bench.next_started().await, "s2");
        assert_eq!(f2.finish(true).await, Ok(true));
        assert!(bench.started.try_recv().is_err(), "s3 waits: s2 holds the suspects' slot");
        assert_eq!(s2.finish(false).await, Ok(false));
        assert_eq!(bench.next_started().await, "s3");
        assert_eq!(s3.finish(false).await, Ok(false));
    }

    #[tokio::test]
    async fn a_key_id_has_one_fresh_check_at_a_time_and_clients_take_turns() {
        let mut bench = Bench::new();
        let hold = bench.send("hold", 9, None).await;
        let f1 = bench.send("f1", 9, Some("k")).await;
        assert_eq!([bench.next_started().await, bench.next_started().await], ["hold", "f1"]);
        // Slots full. A second secret for k while f1 runs is suspect, as
        // are a flood's; one client's many wait behind another's one.
        let mut flood = Vec::new();
        for name in ["a1", "a2", "a3"] {
            flood.push(bench.send(name, 1, Some("k")).await);
        }
        let b1 = bench.send("b1", 2, None).await;
        assert_eq!(hold.finish(false).await, Ok(false));
        assert_eq!(bench.next_started().await, "a1");
        let mut flood = flood.into_iter();
        assert_eq!(flood.next().unwrap().finish(false).await, Ok(false));
        assert_eq!(bench.next_started().await, "b1", "client 2's turn before client 1's second");
        assert_eq!(b1.finish(false).await, Ok(false));
        assert_eq!(bench.next_started().await, "a2");
        for check in flood {
            check.finish(false).await.unwrap();
        }
        assert_eq!(f1.finish(true).await, Ok(true));
    }

    #[tokio::test]
    async fn one_check_serves_every_request_presenting_the_same_key() {
        let mut bench = Bench::new();
        let first = bench.send("same", 1, Some("k")).await;
        assert_eq!(bench.next_started().await, "same");
        let (verifier, digest) = (Arc::clone(&bench.verifier), [4, b's', b'e', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        let others: Vec<_> = (0..5)
            .map(|_| {
                let verifier = Arc::clone(&verifier);
                let turn = Turn { client: IpAddr::from([192, 0, 2, 1]), key_id: Some("k".into()) };
                tokio::spawn(async move { verifier.check(digest, turn, || panic!("checked twice"), |_| {}).await })
            })
            .collect();
        bench.until(|| bench.verifier.checks.lock().unwrap()[&digest].requests == 6).await;
        assert_eq!(first.finish(true).await, Ok(true));
        for other in others {
            assert_eq!(other.await.unwrap(), Ok(true));
        }
        assert!(bench.verifier.checks.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_client_s_waiting_checks_are_bounded_and_one_that_went_away_frees_its_place() {
        let mut bench = Bench::new();
        let hold = [bench.send("h1", 9, Some("x")).await, bench.send("h2", 9, Some("y")).await];
        bench.next_started().await;
        bench.next_started().await;
        let mut waiting = Vec::new();
        for name in ["w0", "w1", "w2", "w3", "w4", "w5", "w6", "w7"] {
            waiting.push(bench.send(name, 1, None).await);
        }
        let refused = bench.send("w8", 1, None).await;
        assert_eq!(refused.task.await.unwrap(), Err(Busy::Client));
        let other = bench.send("other", 2, None).await;
        assert!(!other.task.is_finished(), "another client still queues");
        let gone = waiting.remove(0);
        gone.task.abort();
        assert!(gone.task.await.unwrap_err().is_cancelled());
        let again = bench.send("again", 1, None).await;
        assert!(!again.task.is_finished(), "the place it held is free");
        let [h1, h2] = hold;
        h1.finish(true).await.unwrap();
        assert_eq!(bench.next_started().await, "w1", "the check that went away is skipped");
        h2.finish(true).await.unwrap();
        for check in waiting.into_iter().chain([other, again]) {
            check.task.abort();
        }
    }

    #[tokio::test]
    async fn a_check_whose_request_went_away_holds_its_slot_until_it_returns() {
        let mut bench = Bench::new();
        let s1 = bench.send("s1", 1, None).await;
        assert_eq!(bench.next_started().await, "s1");
        s1.task.abort();
        let s2 = bench.send("s2", 2, None).await;
        let f1 = bench.send("f1", 3, Some("k")).await;
        assert_eq!(bench.next_started().await, "f1");
        assert_eq!(f1.finish(true).await, Ok(true));
        assert!(bench.started.try_recv().is_err(), "s1's argon2 still runs: s2 waits");
        s1.finish.send(false).unwrap();
        assert_eq!(bench.next_started().await, "s2");
        assert_eq!(s2.finish(false).await, Ok(false));
    }

    #[tokio::test]
    async fn a_check_every_request_left_still_counts_its_verdict() {
        let mut bench = Bench::new();
        let guess = bench.send("guess", 1, Some("k")).await;
        assert_eq!(bench.next_started().await, "guess");
        guess.task.abort();
        assert!(guess.task.await.unwrap_err().is_cancelled());
        // Hung up while argon2 ran: the wrong secret is counted all the same.
        guess.finish.send(false).unwrap();
        bench.until(|| !bench.settled.lock().unwrap().is_empty()).await;
        assert_eq!(*bench.settled.lock().unwrap(), [("guess", false)]);
        bench.until(|| bench.verifier.checks.lock().unwrap().is_empty()).await;
    }

    #[tokio::test]
    async fn a_check_every_request_left_before_its_slot_is_dropped() {
        let mut bench = Bench::new();
        let hold = [bench.send("h1", 9, Some("x")).await, bench.send("h2", 9, Some("y")).await];
        bench.next_started().await;
        bench.next_started().await;
        let left = bench.send("left", 1, None).await;
        left.task.abort();
        assert!(left.task.await.unwrap_err().is_cancelled());
        assert_eq!(bench.verifier.checks.lock().unwrap().len(), 2, "nothing is kept of it");
        let [h1, h2] = hold;
        h1.finish(true).await.unwrap();
        h2.finish(true).await.unwrap();
        let next = bench.send("next", 2, None).await;
        assert_eq!(bench.next_started().await, "next", "the dropped check never ran");
        next.finish(false).await.unwrap();
        assert_eq!(bench.settled.lock().unwrap().iter().filter(|(name, _)| *name == "left").count(), 0);
    }

    #[test]
    fn a_full_class_refuses_its_own_checks_only() {
        let mut queue = Queue::default();
        let mut receivers = Vec::new();
        let mut push = |turns: &mut Turns, client: u32, cap: usize| {
            let (sender, receiver) = oneshot::channel();
            receivers.push(receiver);
            turns.push(IpAddr::from(client.to_be_bytes()), sender, cap)
        };
        for client in 0..MAX_WAITING as u32 / PER_CLIENT as u32 {
            for _ in 0..PER_CLIENT {
                push(&mut queue.suspect, client, PER_CLIENT).unwrap();
            }
        }
        assert_eq!(push(&mut queue.suspect, u32::MAX, PER_CLIENT), Err(Busy::Everyone));
        assert!(!queue.suspect.by_client.contains_key(&IpAddr::from(u32::MAX.to_be_bytes())), "nothing left of it");
        assert_eq!(
            push(&mut queue.fresh, u32::MAX, MAX_WAITING),
            Ok(()),
            "a full suspect class crowds no fresh check out"
        );
    }

    #[tokio::test]
    async fn a_check_that_breaks_counts_nothing_and_leaves_nothing_behind() {
        let verifier = Verifier::new(2);
        let turn = Turn { client: IpAddr::from([192, 0, 2, 1]), key_id: Some("k".into()) };
        let settled = Arc::new(Mutex::new(Vec::new()));
        let told = Arc::clone(&settled);
        let verdict =
            verifier.check([7; 16], turn, || panic!("argon2 broke"), move |v| told.lock().unwrap().push(v)).await;
        assert_eq!(verdict, Err(Busy::Everyone), "not a wrong secret");
        assert!(settled.lock().unwrap().is_empty());
        assert!(verifier.checks.lock().unwrap().is_empty());
        let queue = verifier.lock();
        assert_eq!((queue.running, queue.fresh_keys.len()), (0, 0), "the slot and key id are free");
    }
}
