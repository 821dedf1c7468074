//! Where this data plane sent each session's latest turn. A node's agent
//! reports the sessions its server holds a moment after a turn reaches
//! it (its next poll, relayed by a controller): a conversation's next turn
//! sent in between finds no home in the snapshot and is placed afresh,
//! maybe away from its cache. Routing reads this beside the reported
//! residency ([`crate::routing::residences`]): a record stands until the
//! reports have moved on from what they said when its turn was sent.
//! No clocks are compared: the agents' and the data planes' may differ.
//!
//! Kept [`TRUSTED_MS`]: long enough for the reports to catch up normally,
//! short enough that a record they would correct misleads routing
//! briefly. Bounded: a flood of new sessions rotates records out early,
//! and routing then waits for the reports, as it would without this.

use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, PoisonError};

use inferyes_proto::FastMap;

/// How long a record stands for the session's home.
pub const TRUSTED_MS: u64 = 10_000;

const SHARDS: usize = 16;

/// Records a shard's generation holds before it rotates early: 65,536
/// sessions a generation in all.
const PER_SHARD: usize = 4096;

/// A session's latest turn sent by this data plane, and where to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sent {
    /// The node's key (`stable_hash(node_id)`, which outlives snapshots).
    pub node: u64,
    /// The backend's id: its place in the node's list may change.
    pub backend: Arc<str>,
    /// Tokens of the turn's prompt, as estimated: the next turn's prompt
    /// starts with them.
    pub tokens: u32,
    pub sent_unix_ms: u64,
    /// Where the reports had the session when the turn was sent.
    pub reported: Option<Seen>,
}

/// A reported residency, as far as telling it from a later one goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seen {
    pub node: u64,
    pub last_seen_unix_ms: u64,
}

/// Records' times may run ahead of the clock that reads them by this much
/// (a step back of the clock): past it, a record is not believed.
const AHEAD_MS: u64 = 1_000;

type Map = FastMap<u64, Sent>;

/// Two generations: records go into `current`; once it is [`TRUSTED_MS`]
/// old (or full) it becomes `previous`, whose records are then all past
/// trust or nearly, and the one before is dropped whole.
#[derive(Debug, Default)]
struct Shard {
    current: Map,
    previous: Map,
    current_since_ms: u64,
}

/// Session key hash → its latest turn sent by this data plane.
#[derive(Debug)]
pub struct SentTurns {
    shards: Box<[Mutex<Shard>]>,
    /// Picks a key's shard: seeded per process, so that no client can aim
    /// its sessions at one shard.
    seed: std::collections::hash_map::RandomState,
}

impl Default for SentTurns {
    fn default() -> SentTurns {
        SentTurns { shards: (0..SHARDS).map(|_| Mutex::default()).collect(), seed: Default::default() }
    }
}

impl SentTurns {
    fn shard(&self, session: u64) -> &Mutex<Shard> {
        &self.shards[(self.seed.hash_one(session) % SHARDS as u64) as usize]
    }

    /// A turn of `session` was answered from where `sent` says.
    pub fn sent(&self, session: u64, sent: Sent) {
        let mut shard = self.shard(session).lock().unwrap_or_else(PoisonError::into_inner);
        let aged = sent.sent_unix_ms >= shard.current_since_ms.saturating_add(TRUSTED_MS);
        if aged || shard.current.len() >= PER_SHARD {
            let Shard { current, previous, .. } = &mut *shard;
            std::mem::swap(current, previous);
            current.clear();
            shard.current_since_ms = sent.sent_unix_ms;
        }
        shard.previous.remove(&session);
        shard.current.insert(session, sent);
    }

    /// `session`'s latest turn, where it was sent less than
    /// [`TRUSTED_MS`] before `now_ms`.
    pub fn latest(&self, session: u64, now_ms: u64) -> Option<Sent> {
        let shard = self.shard(session).lock().unwrap_or_else(PoisonError::into_inner);
        let sent = shard.current.get(&session).or_else(|| shard.previous.get(&session))?;
        let trusted = sent.sent_unix_ms <= now_ms.saturating_add(AHEAD_MS)
            && now_ms.saturating_sub(sent.sent_unix_ms) < TRUSTED_MS;
        trusted.then(|| sent.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(node: u64, at: u64) -> Sent {
        Sent { node, backend: Arc::from("b0"), tokens: 100, sent_unix_ms: at, reported: None }
    }

    #[test]
    fn the_latest_turn_is_trusted_for_a_while() {
        let turns = SentTurns::default();
        turns.sent(7, sent(1, 1_000));
        turns.sent(7, sent(2, 2_000));
        assert_eq!(turns.latest(7, 2_000), Some(sent(2, 2_000)));
        assert_eq!(turns.latest(7, 2_000 + TRUSTED_MS - 1), Some(sent(2, 2_000)));
        assert_eq!(turns.latest(7, 2_000 + TRUSTED_MS), None);
        assert_eq!(turns.latest(8, 2_000), None);
        // Sent by the clock's reading before it stepped back.
        assert_eq!(turns.latest(7, 2_000 - AHEAD_MS - 1), None);
    }

    #[test]
    fn a_record_outlives_one_rotation_and_not_two() {
        let turns = SentTurns::default();
        turns.sent(7, sent(1, 1_000));
        // Another session of the same shard, past the generation's age.
        let other = (8..).find(|k| std::ptr::eq(turns.shard(*k), turns.shard(7))).unwrap();
        turns.sent(other, sent(1, 1_000 + TRUSTED_MS));
        assert_eq!(turns.latest(7, 1_500), Some(sent(1, 1_000)), "kept in the previous generation");
        turns.sent(other, sent(1, 1_000 + 2 * TRUSTED_MS));
        assert_eq!(turns.latest(7, 1_500), None, "dropped with the generation before");
    }

    #[test]
    fn a_flood_of_sessions_is_held_to_two_generations() {
        let turns = SentTurns::default();
        for session in 0..(10 * SHARDS * PER_SHARD) as u64 {
            turns.sent(session, sent(1, 1_000));
        }
        let held: usize =
            turns.shards.iter().map(|s| s.lock().map(|s| s.current.len() + s.previous.len()).unwrap_or_default()).sum();
        assert!(held <= 2 * SHARDS * PER_SHARD, "{held}");
        // The latest ones are still known.
        let last = (10 * SHARDS * PER_SHARD - 1) as u64;
        assert_eq!(turns.latest(last, 1_000), Some(sent(1, 1_000)));
    }
}
