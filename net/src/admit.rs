//! Which connections a listener takes. Every connection holds a descriptor
//! and some memory before it has said who it is, so a listener takes at
//! most `max` at once and, of those, at most `per_peer` from one peer it
//! does not know, and `strangers` from all the peers it does not know
//! together. A peer is an IPv4 address or an IPv6 /64 (one host's
//! allocation). A listener knows a peer by configuration (a trusted proxy
//! in front of a data plane) or because one of its requests proved a
//! credential ([`Admission::vouch`]): fleet members are never held back by
//! what strangers hold. Past `strangers`, the oldest stranger's connection
//! is closed to make room for the newcomer: strangers merely holding the
//! whole pool do not keep out a member that has not proved itself yet (a
//! data plane's first connections to an agent, agents rejoining a
//! controller that restarted), which proves itself within milliseconds;
//! to close its connection first, strangers must open a pool's worth of
//! newer ones in that time.

use std::collections::VecDeque;
use std::future::Future;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use inferyes_proto::FastMap;
use tokio_util::sync::CancellationToken;

/// The connections a listener holds open at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// All connections; 0: no limit.
    pub max: usize,
    /// From one peer the listener does not know; 0: no share of its own.
    pub per_peer: usize,
    /// From all the peers it does not know together; 0: up to `max`.
    pub strangers: usize,
    /// Where a credential makes a peer known: a stranger's connection is
    /// closed this long after it was taken unless its peer is known by
    /// then ([`Ticket::closing`]), so that strangers cannot hold their
    /// places for ever. None: no deadline.
    pub prove_within: Option<Duration>,
}

impl Limits {
    /// No limit at all, for a listener only tests reach.
    pub const NONE: Limits = Limits { max: 0, per_peer: 0, strangers: 0, prove_within: None };
}

/// Why a connection was not taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The listener holds all the connections it may.
    Full,
    /// Peers it does not know hold all it gives them (and, where a
    /// newcomer was taken, the oldest of their connections was closed to
    /// make room: [`Ticket::made_room`]).
    Strangers,
    /// This peer holds all its share.
    Peer,
}

impl Refused {
    pub fn as_str(self) -> &'static str {
        match self {
            Refused::Full => "full",
            Refused::Strangers => "strangers",
            Refused::Peer => "peer",
        }
    }
}

/// The peer an address belongs to: an IPv4 address, or an IPv6 /64 (one
/// host's allocation: its addresses are one peer).
pub fn peer_of(address: IpAddr) -> IpAddr {
    match address.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => IpAddr::V6(std::net::Ipv6Addr::from(v6.to_bits() & !u128::from(u64::MAX))),
    }
}

/// Peers a listener knows by configuration.
pub type KnownPeers = Arc<dyn Fn(IpAddr) -> bool + Send + Sync>;

/// How long a peer that proved a credential stays known without proving
/// it again.
pub const VOUCHED_FOR: Duration = Duration::from_secs(600);
/// How long a stranger's connection may go without its peer proving a
/// credential, where the listener asks for one: a request's head takes at
/// most [`crate::serve::HEADER_READ_TIMEOUT`] too.
pub const PROVE_WITHIN: Duration = Duration::from_secs(30);
/// Peers vouched for at once, at most: a fleet has far fewer members, and
/// only a credential adds one.
const MAX_VOUCHED: usize = 65_536;

/// What a listener holds now, against its [`Limits`].
pub struct Admission {
    limits: Limits,
    configured: Option<KnownPeers>,
    held: Mutex<Held>,
}

#[derive(Default)]
struct Held {
    open: usize,
    strangers: usize,
    /// Strangers' connections by peer: how many, and the entry's epoch (a
    /// peer vouched for leaves, its connections no longer a stranger's; a
    /// place counts only under the entry it was taken under).
    peers: FastMap<IpAddr, (usize, u64)>,
    epochs: u64,
    /// Where strangers have a pool of their own: their places, oldest
    /// first (some no longer counted, dropped as they come up). When the
    /// pool is full the oldest is closed to make room: strangers holding
    /// it cannot keep a newcomer (a fleet member not yet vouched for) out.
    queue: VecDeque<Arc<Place>>,
    /// Peers known by a credential, until when.
    vouched: FastMap<IpAddr, Instant>,
}

/// A stranger's connection, as the listener counts it.
struct Place {
    peer: IpAddr,
    epoch: u64,
    /// Set, under the lock, once it is given back: closed, or made room.
    given_back: AtomicBool,
    /// Cancelled when it is closed to make room.
    evicted: CancellationToken,
}

impl Held {
    /// Whether `place` is still counted as a stranger's.
    fn counts(&self, place: &Place) -> bool {
        !place.given_back.load(Ordering::Relaxed)
            && self.peers.get(&place.peer).is_some_and(|(_, epoch)| *epoch == place.epoch)
    }

    fn give_back(&mut self, place: &Place) {
        if self.counts(place) {
            if let Some((count, _)) = self.peers.get_mut(&place.peer) {
                *count -= 1;
                if *count == 0 {
                    self.peers.remove(&place.peer);
                }
            }
            self.strangers = self.strangers.saturating_sub(1);
        }
        place.given_back.store(true, Ordering::Relaxed);
    }

    /// Closes the oldest stranger's connection still counted; whether
    /// there was one.
    fn make_room(&mut self) -> bool {
        while let Some(oldest) = self.queue.pop_front() {
            if self.counts(&oldest) {
                self.give_back(&oldest);
                oldest.evicted.cancel();
                return true;
            }
        }
        false
    }
}

impl Admission {
    /// `known`: the peers known by configuration, if any.
    pub fn new(limits: Limits, known: Option<KnownPeers>) -> Arc<Admission> {
        Arc::new(Admission { limits, configured: known, held: Mutex::default() })
    }

    /// One more connection from `address`, held until the ticket is
    /// dropped; or why not.
    pub fn admit(self: &Arc<Self>, address: IpAddr) -> Result<Ticket, Refused> {
        let peer = peer_of(address);
        let configured = self.configured.as_ref().is_some_and(|known| known(address));
        let now = Instant::now();
        let mut guard = self.lock();
        let held = &mut *guard;
        let Limits { max, per_peer, strangers, .. } = self.limits;
        if max > 0 && held.open >= max {
            return Err(Refused::Full);
        }
        let known = configured || held.vouched.get(&peer).is_some_and(|until| *until > now);
        // Built only once taken: a ticket dropped gives its place back,
        // which takes the lock held here.
        let (mut place, mut made_room) = (None, false);
        if !known {
            let from_peer = held.peers.get(&peer).map_or(0, |(count, _)| *count);
            if per_peer > 0 && from_peer >= per_peer {
                return Err(Refused::Peer);
            }
            if strangers > 0 && held.strangers >= strangers {
                if !held.make_room() {
                    return Err(Refused::Strangers);
                }
                made_room = true;
            }
            held.strangers += 1;
            held.epochs += 1;
            let epoch = held.epochs;
            let entry = held.peers.entry(peer).or_insert((0, epoch));
            entry.0 += 1;
            let taken = Arc::new(Place {
                peer,
                epoch: entry.1,
                given_back: AtomicBool::new(false),
                evicted: CancellationToken::new(),
            });
            if strangers > 0 {
                // Places given back in the meantime are dropped now and
                // then: the queue stays within twice the pool.
                if held.queue.len() >= 2 * strangers {
                    let queue = std::mem::take(&mut held.queue);
                    held.queue = queue.into_iter().filter(|place| held.counts(place)).collect();
                }
                held.queue.push_back(Arc::clone(&taken));
            }
            place = Some(taken);
        }
        held.open += 1;
        Ok(Ticket { admission: Arc::clone(self), place, made_room })
    }

    /// `address` proved a credential: its peer is known for
    /// [`VOUCHED_FOR`] from now, and its next connections are taken as a
    /// fleet member's. Its connections open now are no longer a stranger's
    /// either.
    pub fn vouch(&self, address: IpAddr) {
        let peer = peer_of(address);
        let now = Instant::now();
        let mut held = self.lock();
        if held.vouched.len() >= MAX_VOUCHED && !held.vouched.contains_key(&peer) {
            held.vouched.retain(|_, until| *until > now);
            // Still full: the one that would lapse soonest makes room.
            if held.vouched.len() >= MAX_VOUCHED
                && let Some(soonest) = held.vouched.iter().min_by_key(|(_, until)| **until).map(|(peer, _)| *peer)
            {
                held.vouched.remove(&soonest);
            }
        }
        held.vouched.insert(peer, now + VOUCHED_FOR);
        if let Some((count, _)) = held.peers.remove(&peer) {
            held.strangers = held.strangers.saturating_sub(count);
        }
    }

    /// Connections open now, and how many of them strangers hold.
    pub fn open(&self) -> (usize, usize) {
        let held = self.lock();
        (held.open, held.strangers)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One connection a listener took, given back when dropped.
pub struct Ticket {
    admission: Arc<Admission>,
    /// Where it was a stranger's when taken.
    place: Option<Arc<Place>>,
    made_room: bool,
}

impl Ticket {
    /// Whether taking it closed another stranger's connection, the oldest,
    /// to make room (count it as [`Refused::Strangers`]).
    pub fn made_room(&self) -> bool {
        self.made_room
    }

    /// Whether the connection is still a stranger's: its peer has not
    /// been vouched for since it was taken, nor has it been closed to make
    /// room.
    pub fn is_stranger(&self) -> bool {
        self.place.as_ref().is_some_and(|place| self.admission.lock().counts(place))
    }

    /// What resolves once the listener wants the connection closed: it was
    /// closed to make room for a newer stranger, or its proof deadline
    /// ([`Limits::prove_within`], from now) passed while its peer was still
    /// a stranger. None where nothing can close it: serve it to its end.
    pub fn closing(&self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let place = Arc::clone(self.place.as_ref()?);
        let limits = self.admission.limits;
        if limits.prove_within.is_none() && limits.strangers == 0 {
            return None;
        }
        let admission = Arc::clone(&self.admission);
        let deadline = limits.prove_within.map(|within| tokio::time::Instant::now() + within);
        Some(async move {
            let unproven = async {
                if let Some(deadline) = deadline {
                    tokio::time::sleep_until(deadline).await;
                    if admission.lock().counts(&place) {
                        return;
                    }
                }
                std::future::pending().await
            };
            tokio::select! {
                () = place.evicted.cancelled() => {}
                () = unproven => {}
            }
        })
    }

    /// What resolves once the connection is no stranger's any more (its
    /// peer was vouched for, or its place given up), looked at every
    /// [`PROMOTED_CHECK`]; `None` for a connection that was never one.
    pub fn promoted(&self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let place = Arc::clone(self.place.as_ref()?);
        let admission = Arc::clone(&self.admission);
        Some(async move {
            let mut every = tokio::time::interval(PROMOTED_CHECK);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                if !admission.lock().counts(&place) {
                    return;
                }
            }
        })
    }
}

/// How often a stranger's connection that would be offered more as a
/// member's looks whether it has become one.
const PROMOTED_CHECK: Duration = Duration::from_secs(1);

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut held = self.admission.lock();
        held.open = held.open.saturating_sub(1);
        if let Some(place) = &self.place {
            held.give_back(place);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn a_peer_has_its_share_and_the_others_theirs() {
        let admission = Admission::new(Limits { max: 10, per_peer: 2, strangers: 0, prove_within: None }, None);
        let first = admission.admit(ip("10.0.0.1")).unwrap();
        let _second = admission.admit(ip("10.0.0.1")).unwrap();
        assert_eq!(admission.admit(ip("10.0.0.1")).err(), Some(Refused::Peer));
        assert!(admission.admit(ip("10.0.0.2")).is_ok(), "another peer is taken");
        drop(first);
        assert!(admission.admit(ip("10.0.0.1")).is_ok(), "a closed connection is given back");
    }

    #[test]
    fn an_ipv6_host_is_one_peer_and_an_ipv4_one_in_ipv6_form_is_itself() {
        let admission = Admission::new(Limits { max: 10, per_peer: 1, strangers: 0, prove_within: None }, None);
        let _one = admission.admit(ip("2001:db8:1:2::1")).unwrap();
        assert_eq!(admission.admit(ip("2001:db8:1:2::ffff")).err(), Some(Refused::Peer), "one /64");
        assert!(admission.admit(ip("2001:db8:1:3::1")).is_ok(), "another /64");
        let _v4 = admission.admit(ip("192.0.2.1")).unwrap();
        assert_eq!(admission.admit(ip("::ffff:192.0.2.1")).err(), Some(Refused::Peer));
    }

    #[test]
    fn strangers_share_what_they_are_given_and_members_are_not_held_back() {
        let proxy: KnownPeers = Arc::new(|address| address == ip("10.9.9.9"));
        let admission = Admission::new(Limits { max: 6, per_peer: 2, strangers: 3, prove_within: None }, Some(proxy));
        let held: Vec<Ticket> =
            ["10.0.0.1", "10.0.0.2", "10.0.0.3"].into_iter().map(|peer| admission.admit(ip(peer)).unwrap()).collect();
        // The pool is full: the oldest stranger's connection makes room.
        let newcomer = admission.admit(ip("10.0.0.4")).unwrap();
        assert!(newcomer.made_room() && !held[0].is_stranger() && held[1].is_stranger());
        assert_eq!(admission.open(), (4, 3));
        let _proxied = [admission.admit(ip("10.9.9.9")).unwrap(), admission.admit(ip("10.9.9.9")).unwrap()];
        assert_eq!(admission.open(), (6, 3), "a known peer holds no stranger's place");
        assert_eq!(admission.admit(ip("10.9.9.9")).err(), Some(Refused::Full), "no one passes the whole");
        drop(held);
        assert_eq!(admission.open(), (3, 1), "the one closed to make room is given back once");
    }

    #[tokio::test]
    async fn a_connection_closed_to_make_room_is_told_so() {
        let admission = Admission::new(Limits { max: 0, per_peer: 1, strangers: 1, prove_within: None }, None);
        let oldest = admission.admit(ip("10.0.0.1")).unwrap();
        let closing = oldest.closing().expect("a stranger's can be closed");
        assert_eq!(admission.admit(ip("10.0.0.1")).err(), Some(Refused::Peer), "its own share first");
        let _newer = admission.admit(ip("10.0.0.2")).unwrap();
        tokio::time::timeout(Duration::from_secs(5), closing).await.expect("closed to make room");
    }

    #[test]
    fn a_peer_vouched_for_takes_its_open_connections_out_of_the_strangers_count() {
        let limits = Limits { max: 0, per_peer: 2, strangers: 2, prove_within: Some(Duration::from_secs(1)) };
        let admission = Admission::new(limits, None);
        let first = admission.admit(ip("10.0.0.1")).unwrap();
        let second = admission.admit(ip("10.0.0.1")).unwrap();
        assert!(first.is_stranger() && first.closing().is_some());
        admission.vouch(ip("10.0.0.1"));
        assert!(!first.is_stranger(), "its peer proved itself");
        assert_eq!(admission.open(), (2, 0));
        let other = admission.admit(ip("10.0.0.2")).unwrap();
        assert!(!other.made_room(), "the vouch gave the pool its places back");
        let member = admission.admit(ip("10.0.0.1")).unwrap();
        assert!(member.closing().is_none(), "nothing closes a member's connection");
        drop((first, second));
        assert_eq!(admission.open(), (2, 1), "given back once, as taken");
        drop((other, member));
        assert_eq!(admission.open(), (0, 0));
    }

    #[tokio::test]
    async fn a_strangers_connection_is_unproven_at_its_deadline_and_a_members_never() {
        let within = Duration::from_millis(200);
        let limits = Limits { max: 0, per_peer: 0, strangers: 0, prove_within: Some(within) };
        let admission = Admission::new(limits, None);
        let stranger = admission.admit(ip("10.0.0.1")).unwrap();
        let proving = admission.admit(ip("10.0.0.2")).unwrap();
        let started = tokio::time::Instant::now();
        stranger.closing().unwrap().await;
        assert!(started.elapsed() >= within);
        admission.vouch(ip("10.0.0.2"));
        let waited = tokio::time::timeout(within * 5, proving.closing().unwrap()).await;
        assert!(waited.is_err(), "a peer that proved itself keeps its connection");
    }
}
