//! Which conversations the agent believes are resident on which backend.
//! llama-server has no notion of sessions and emits no cache events: only
//! the proxy, which sees each request's session key and the usage the
//! server reports, can keep this table. Pure: no I/O, no clocks.
//!
//! The model follows llama-server: a slot keeps its KV cache until the slot
//! is reused, so the most recent `slots` sessions are in slots; older ones
//! were saved to the host prompt cache (`--cache-ram`) and stay restorable
//! until it is full, so further sessions are kept while their tokens fit
//! in `host_cache_tokens`; beyond that, a session is gone.

use std::collections::{BTreeMap, BTreeSet};

use inferyes_proto::v1::{ResidencyUpdate, ResidentSession};
use inferyes_proto::{FastMap, value_for};

/// Sessions a backend's host cache is believed to hold at most, whatever
/// their tokens. A session whose usage never came (its requests failed, or
/// their clients left) counts no tokens: without a bound, such sessions
/// would pile up in the table, in the node's record and in every routing
/// snapshot.
pub const MAX_HOST_CACHED_SESSIONS: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    pub slots: usize,
    pub host_cache_tokens: u64,
}

impl Default for Capacity {
    /// Before the first poll: llama-server's defaults (`-np` auto gives 4
    /// slots; the host cache default of 8 GiB holds tens of thousands of
    /// tokens of a mid-size model).
    fn default() -> Capacity {
        Capacity { slots: 4, host_cache_tokens: 32_768 }
    }
}

#[derive(Clone, Debug, PartialEq)]
struct Entry {
    session: ResidentSession,
    /// Recency order; larger is more recent.
    tick: u64,
    /// Tokens restored into its slot from another node, not yet shown to
    /// be read from cache by a turn here; 0: none.
    restored: u32,
    /// Those tokens themselves, where the slot file said them: what tells
    /// a turn that continues the conversation from one that sent another
    /// history under its key.
    restored_tokens: Option<std::sync::Arc<[i32]>>,
    /// Out of the server's slots and host cache as modelled, but kept in
    /// its backend's KV tier: still resident, outside its backend's line.
    parked: bool,
}

/// What a restored conversation's first turn here showed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoreCheck {
    /// It read at least half of what was restored from cache.
    Held { restored: u32, cached: u32 },
    /// It read less: the restore is worth nothing here.
    ReusedNothing { restored: u32, cached: u32 },
}

pub use inferyes_proto::usage::Usage;

/// One backend's sessions by recency, and the tokens they hold together:
/// eviction reads the few newest, and walks the whole line only when
/// something must be evicted.
#[derive(Clone, Debug, Default)]
struct Lineup {
    /// Tick → session key and its tokens, oldest first.
    by_tick: BTreeMap<u64, (String, u64)>,
    tokens: u64,
}

#[derive(Clone, Debug, Default)]
pub struct Residency {
    capacity: FastMap<String, Capacity>,
    entries: FastMap<String, Entry>,
    lineups: FastMap<String, Lineup>,
    tick: u64,
    seq: u64,
    changed: BTreeSet<String>,
    removed: BTreeSet<String>,
    /// Sessions whose states a backend's KV tier keeps, and that backend:
    /// while they are there, never evicted from it, only parked.
    in_tier: BTreeMap<String, String>,
}

impl Residency {
    pub fn set_capacity(&mut self, backend_id: &str, capacity: Capacity) {
        if self.capacity.get(backend_id) != Some(&capacity) {
            self.capacity.insert(backend_id.to_string(), capacity);
            self.evict(backend_id);
        }
    }

    /// A request of session `key` was sent to `backend_id`.
    pub fn touch(&mut self, key: &str, backend_id: &str, model: &str, now_ms: u64) {
        self.tick += 1;
        let tick = self.tick;
        let Residency { entries, lineups, .. } = self;
        // Its place in its backend's line is taken out, to be put back as
        // the newest: the key's string is reused.
        let mut key_in_line = None;
        if let Some(entry) = entries.get_mut(key) {
            let moved = entry.session.backend_id != backend_id;
            // A parked session's tokens are not in its line's.
            let counted = !std::mem::take(&mut entry.parked);
            if let Some(lineup) = lineups.get_mut(&entry.session.backend_id) {
                key_in_line = lineup.by_tick.remove(&entry.tick).map(|(key, _)| key);
                if moved && counted {
                    lineup.tokens = lineup.tokens.saturating_sub(u64::from(entry.session.tokens));
                }
                if !moved && !counted {
                    lineup.tokens = lineup.tokens.saturating_add(u64::from(entry.session.tokens));
                }
            }
            if moved {
                // The conversation moved: its cache is rebuilt there from scratch.
                entry.session = ResidentSession {
                    key: key.to_string(),
                    backend_id: backend_id.to_string(),
                    first_seen_unix_ms: now_ms,
                    ..Default::default()
                };
            }
        } else {
            let session = ResidentSession {
                key: key.to_string(),
                backend_id: backend_id.to_string(),
                first_seen_unix_ms: now_ms,
                ..Default::default()
            };
            entries.insert(key.to_string(), Entry { session, tick, restored: 0, restored_tokens: None, parked: false });
        }
        let Some(entry) = entries.get_mut(key) else { return };
        if entry.session.model != model {
            entry.session.model = model.to_string();
        }
        entry.session.last_seen_unix_ms = now_ms;
        entry.session.requests = entry.session.requests.saturating_add(1);
        entry.tick = tick;
        let tokens = u64::from(entry.session.tokens);
        value_for(lineups, backend_id, Lineup::default)
            .by_tick
            .insert(tick, (key_in_line.unwrap_or_else(|| key.to_string()), tokens));
        self.removed.remove(key);
        if !self.changed.contains(key) {
            self.changed.insert(key.to_string());
        }
        self.evict(backend_id);
    }

    /// Session `key`'s slot was restored on `backend_id` from another node,
    /// holding `tokens` (those `saved`, where the file said them): it is
    /// resident here, the newest, until its next turn says whether the
    /// restore held.
    pub fn restored(
        &mut self,
        key: &str,
        backend_id: &str,
        model: &str,
        (tokens, saved): (u32, Option<std::sync::Arc<[i32]>>),
        now_ms: u64,
    ) {
        self.touch(key, backend_id, model, now_ms);
        let Some(entry) = self.entries.get_mut(key) else { return };
        // Restoring is not a request.
        entry.session.requests = entry.session.requests.saturating_sub(1);
        entry.restored = tokens.max(1);
        entry.restored_tokens = saved;
        let before = u64::from(entry.session.tokens);
        entry.session.tokens = tokens;
        let lineup = value_for(&mut self.lineups, backend_id, Lineup::default);
        lineup.tokens = lineup.tokens.saturating_sub(before).saturating_add(u64::from(tokens));
        if let Some((_, held)) = lineup.by_tick.get_mut(&entry.tick) {
            *held = u64::from(tokens);
        }
        self.evict(backend_id);
    }

    /// The tokens restored into session `key`'s slot, while no turn here
    /// has yet said whether the restore held.
    pub fn unchecked_restore(&self, key: &str) -> Option<std::sync::Arc<[i32]>> {
        let entry = self.entries.get(key).filter(|e| e.restored > 0)?;
        entry.restored_tokens.clone()
    }

    /// Session `key` left this node (its slot moved elsewhere).
    pub fn remove(&mut self, key: &str) {
        self.in_tier.remove(key);
        let Some(entry) = self.entries.remove(key) else { return };
        if let Some(lineup) = self.lineups.get_mut(&entry.session.backend_id)
            && !entry.parked
        {
            lineup.by_tick.remove(&entry.tick);
            lineup.tokens = lineup.tokens.saturating_sub(u64::from(entry.session.tokens));
        }
        self.changed.remove(key);
        self.removed.insert(key.to_string());
    }

    /// The server's usage for a finished request of session `key`: how much
    /// the cache holds now, and whether the prefix was found; for the first
    /// turn after a restore, whether the restore held.
    pub fn record(&mut self, key: &str, backend_id: &str, usage: Usage) -> Option<RestoreCheck> {
        let entry = self.entries.get_mut(key)?;
        if entry.session.backend_id != backend_id {
            return None;
        }
        // A turn that sent less than was restored (another history under
        // the conversation's key) says nothing of the restore.
        let judged = entry.restored > 0 && usage.prompt_tokens >= entry.restored;
        let check = judged.then(|| {
            let (restored, cached) = (std::mem::take(&mut entry.restored), usage.cached_tokens);
            entry.restored_tokens = None;
            // The next turn's prompt holds the whole history; the template
            // may render its last tokens anew.
            let expected = restored;
            if u64::from(cached) * 2 >= u64::from(expected) && cached > 0 {
                RestoreCheck::Held { restored, cached }
            } else {
                RestoreCheck::ReusedNothing { restored, cached }
            }
        });
        let believed_resident = entry.session.requests > 1;
        // A turn found its conversation where it read most of its prompt
        // from cache; one that recomputed most of it did not, whatever a
        // prefix every conversation shares (a chat template's, a common
        // system prompt's) gave it.
        let found = usage.cached_tokens > 0 && u64::from(usage.cached_tokens) * 2 >= u64::from(usage.prompt_tokens);
        if found {
            entry.session.cache_hits = entry.session.cache_hits.saturating_add(1);
        } else if believed_resident {
            entry.session.cache_misses = entry.session.cache_misses.saturating_add(1);
        }
        let before = u64::from(entry.session.tokens);
        entry.session.tokens = usage.prompt_tokens.saturating_add(usage.completion_tokens);
        let after = u64::from(entry.session.tokens);
        if !entry.parked {
            let lineup = value_for(&mut self.lineups, backend_id, Lineup::default);
            lineup.tokens = lineup.tokens.saturating_sub(before).saturating_add(after);
            if let Some((_, tokens)) = lineup.by_tick.get_mut(&entry.tick) {
                *tokens = after;
            }
        }
        if !self.changed.contains(key) {
            self.changed.insert(key.to_string());
        }
        self.evict(backend_id);
        check
    }

    /// The newest `slots` sessions of a backend are in its slots; older ones
    /// stay while their tokens, newest first, fit its host cache, and while
    /// they number no more than [`MAX_HOST_CACHED_SESSIONS`].
    fn evict(&mut self, backend_id: &str) {
        let capacity = self.capacity.get(backend_id).copied().unwrap_or_default();
        let Residency { entries, lineups, changed, removed, in_tier, .. } = self;
        let kept_here = |key: &String| in_tier.get(key).is_some_and(|b| b == backend_id);
        let Some(lineup) = lineups.get_mut(backend_id) else { return };
        if lineup.by_tick.len() <= capacity.slots {
            return;
        }
        // The newest of those past the count, if any, oldest first.
        let past_count = lineup.by_tick.len().saturating_sub(capacity.slots + MAX_HOST_CACHED_SESSIONS);
        let newest_past_count = past_count.checked_sub(1).and_then(|i| lineup.by_tick.keys().nth(i).copied());
        let in_slots: u64 = lineup.by_tick.values().rev().take(capacity.slots).map(|(_, tokens)| tokens).sum();
        let newest_past_tokens = if lineup.tokens.saturating_sub(in_slots) <= capacity.host_cache_tokens {
            None
        } else {
            // The first, newest first, that no longer fits.
            let mut host_cache_used = 0u64;
            lineup.by_tick.iter().rev().skip(capacity.slots).find_map(|(tick, (_, tokens))| {
                host_cache_used = host_cache_used.saturating_add(*tokens);
                (host_cache_used > capacity.host_cache_tokens).then_some(*tick)
            })
        };
        // It goes, with all older.
        let Some(newest_gone) = newest_past_count.max(newest_past_tokens) else { return };
        let kept = lineup.by_tick.split_off(&(newest_gone + 1));
        let gone = std::mem::replace(&mut lineup.by_tick, kept);
        for (key, tokens) in gone.into_values() {
            lineup.tokens = lineup.tokens.saturating_sub(tokens);
            if kept_here(&key) {
                if let Some(entry) = entries.get_mut(&key) {
                    entry.parked = true;
                }
                continue;
            }
            entries.remove(&key);
            changed.remove(&key);
            removed.insert(key);
        }
    }

    /// Session `key`'s slot was taken for another conversation's state:
    /// where the KV tier keeps its own, it is parked; else it is gone.
    pub fn slot_reused(&mut self, key: &str) {
        let Some(entry) = self.entries.get_mut(key).filter(|e| !e.parked) else { return };
        if self.in_tier.get(key) != Some(&entry.session.backend_id) {
            return self.remove(key);
        }
        entry.parked = true;
        if let Some(lineup) = self.lineups.get_mut(&entry.session.backend_id) {
            lineup.by_tick.remove(&entry.tick);
            lineup.tokens = lineup.tokens.saturating_sub(u64::from(entry.session.tokens));
        }
    }

    /// `backend_id`'s server restarted: its slots and host cache hold
    /// nothing. Its sessions the KV tier keeps are parked; the rest go.
    pub fn server_restarted(&mut self, backend_id: &str) {
        let Some(lineup) = self.lineups.get_mut(backend_id) else { return };
        let gone = std::mem::take(&mut lineup.by_tick);
        lineup.tokens = 0;
        for (key, _) in gone.into_values() {
            if self.in_tier.get(&key).is_some_and(|b| b == backend_id) {
                if let Some(entry) = self.entries.get_mut(&key) {
                    entry.parked = true;
                }
                continue;
            }
            self.entries.remove(&key);
            self.changed.remove(&key);
            self.removed.insert(key);
        }
    }

    /// Session `key`'s state is kept in `backend_id`'s KV tier: there, it
    /// stays resident past the slots and the host cache.
    pub fn kept_in_tier(&mut self, key: &str, backend_id: &str) {
        if self.in_tier.get(key).is_none_or(|b| b != backend_id) {
            self.in_tier.insert(key.to_string(), backend_id.to_string());
        }
    }

    /// Whether session `key` is resident only by its state in a KV tier
    /// (not in its server's slots or host cache, as modelled).
    pub fn parked(&self, key: &str) -> bool {
        self.entries.get(key).is_some_and(|e| e.parked)
    }

    /// Session `key`'s state, of `tokens`, was found in `backend_id`'s KV
    /// tier at start: resident there (parked), unless already here.
    pub fn kept_from_before(&mut self, key: &str, backend_id: &str, model: &str, tokens: u32, now_ms: u64) {
        self.kept_in_tier(key, backend_id);
        if self.entries.contains_key(key) {
            return;
        }
        let session = ResidentSession {
            key: key.to_string(),
            backend_id: backend_id.to_string(),
            model: model.to_string(),
            tokens,
            first_seen_unix_ms: now_ms,
            last_seen_unix_ms: now_ms,
            ..Default::default()
        };
        self.entries
            .insert(key.to_string(), Entry { session, tick: 0, restored: 0, restored_tokens: None, parked: true });
        self.removed.remove(key);
        self.changed.insert(key.to_string());
    }

    /// Session `key`'s state left `backend_id`'s KV tier; a session held
    /// only there is gone.
    pub fn left_tier(&mut self, key: &str, backend_id: &str) {
        if self.in_tier.get(key).is_none_or(|b| b != backend_id) {
            return;
        }
        self.in_tier.remove(key);
        if self.entries.get(key).is_some_and(|e| e.parked && e.session.backend_id == backend_id) {
            self.entries.remove(key);
            self.changed.remove(key);
            self.removed.insert(key.to_string());
        }
    }

    /// Whether anything changed since the last update was taken.
    pub fn has_changes(&self) -> bool {
        !self.changed.is_empty() || !self.removed.is_empty()
    }

    /// The next numbered update: the whole table when `full`, else what
    /// changed since the last one.
    pub fn take_update(&mut self, full: bool) -> ResidencyUpdate {
        self.seq += 1;
        let changed = std::mem::take(&mut self.changed);
        let removed = std::mem::take(&mut self.removed);
        let mut update = ResidencyUpdate { seq: self.seq, full, ..Default::default() };
        if full {
            update.upserted = self.entries.values().map(|e| e.session.clone()).collect();
            update.upserted.sort_by(|a, b| a.key.cmp(&b.key));
        } else {
            update.upserted = changed.iter().filter_map(|k| self.entries.get(k)).map(|e| e.session.clone()).collect();
            update.removed = removed.into_iter().collect();
        }
        update
    }

    /// Every session believed resident.
    pub fn sessions(&self) -> Vec<ResidentSession> {
        self.entries.values().map(|e| e.session.clone()).collect()
    }

    /// Session `key`, if resident.
    pub fn session(&self, key: &str) -> Option<ResidentSession> {
        self.entries.get(key).map(|e| e.session.clone())
    }

    /// Whether session `key` is believed in one of its backend's slots
    /// (among its newest `slots`), not only in the host cache.
    pub fn in_slot(&self, key: &str) -> bool {
        let Some(entry) = self.entries.get(key).filter(|e| !e.parked) else { return false };
        let slots = self.capacity.get(&entry.session.backend_id).copied().unwrap_or_default().slots;
        self.lineups
            .get(&entry.session.backend_id)
            .is_some_and(|lineup| lineup.by_tick.range(entry.tick + 1..).count() < slots)
    }

    /// `backend_id`'s sessions believed in its slots (its newest), newest
    /// first.
    pub fn in_slots(&self, backend_id: &str) -> impl Iterator<Item = &ResidentSession> {
        let slots = self.capacity.get(backend_id).copied().unwrap_or_default().slots;
        let line = self.lineups.get(backend_id).into_iter().flat_map(|lineup| lineup.by_tick.values().rev());
        line.take(slots).filter_map(|(key, _)| self.entries.get(key)).map(|e| &e.session)
    }

    /// When each conversation believed in one of `session`'s backend's
    /// slots with as many tokens began its last turn, `session`'s own
    /// included: what tells their slots apart
    /// ([`crate::slots::holding_slot`]). Conversations past the slots (in
    /// the host cache, or parked) hold none.
    pub fn twins_in_slots(&self, session: &ResidentSession) -> Vec<u64> {
        let mut twins: Vec<u64> = self
            .in_slots(&session.backend_id)
            .filter(|s| s.tokens == session.tokens && s.key != session.key)
            .map(|s| s.last_seen_unix_ms)
            .collect();
        twins.push(session.last_seen_unix_ms);
        twins
    }

    /// Which backend holds `key`, if any.
    pub fn backend_of(&self, key: &str) -> Option<&str> {
        self.entries.get(key).map(|e| e.session.backend_id.as_str())
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(slots: usize, host_cache_tokens: u64) -> Residency {
        let mut residency = Residency::default();
        for backend in ["b0", "b1"] {
            residency.set_capacity(backend, Capacity { slots, host_cache_tokens });
        }
        residency
    }

    fn used(residency: &mut Residency, key: &str, backend: &str, tokens: u32) {
        residency.touch(key, backend, "m", 1);
        residency.record(key, backend, Usage { prompt_tokens: tokens, completion_tokens: 0, cached_tokens: 0 });
    }

    fn keys(residency: &mut Residency) -> Vec<String> {
        residency.take_update(true).upserted.into_iter().map(|s| s.key).collect()
    }

    #[test]
    fn slots_keep_the_most_recent_and_the_host_cache_keeps_what_fits() {
        let mut r = table(2, 100);
        used(&mut r, "a", "b0", 60);
        used(&mut r, "b", "b0", 60);
        used(&mut r, "c", "b0", 10);
        used(&mut r, "d", "b0", 10);
        // Slots: d, c. Host cache (100 tokens): b (60) fits, a (60 more) not.
        assert_eq!(keys(&mut r), ["b", "c", "d"]);
        used(&mut r, "x", "b1", 500);
        assert_eq!(keys(&mut r), ["b", "c", "d", "x"], "backends are independent");
    }

    #[test]
    fn sessions_that_hold_no_tokens_are_bounded_by_count() {
        let mut r = table(2, 1 << 40);
        let sent = 2 + MAX_HOST_CACHED_SESSIONS + 10;
        for i in 0..sent {
            // Usage never came: no tokens held.
            r.touch(&format!("s{i:05}"), "b0", "m", 1);
        }
        used(&mut r, "big", "b1", 100);
        assert_eq!(r.len(), 2 + MAX_HOST_CACHED_SESSIONS + 1);
        let kept = keys(&mut r);
        assert!(!kept.contains(&"s00009".to_string()) && kept.contains(&"s00010".to_string()), "the oldest go");
        assert!(kept.contains(&"big".to_string()), "other backends keep theirs");
        let line = &r.lineups["b0"];
        assert_eq!((line.by_tick.len(), line.tokens), (2 + MAX_HOST_CACHED_SESSIONS, 0));
    }

    #[test]
    fn twins_are_the_conversations_of_as_many_tokens_in_the_slots() {
        let mut r = table(2, 1000);
        used(&mut r, "cached", "b0", 40);
        used(&mut r, "other", "b1", 40);
        used(&mut r, "twin", "b0", 40);
        used(&mut r, "longer", "b0", 41);
        used(&mut r, "me", "b0", 40);
        // Slots: me, longer; `twin` and `cached` are in the host cache.
        let me = r.session("me").unwrap();
        assert_eq!(r.twins_in_slots(&me), vec![me.last_seen_unix_ms]);
        used(&mut r, "twin", "b0", 40);
        let (me, twin) = (r.session("me").unwrap(), r.session("twin").unwrap());
        assert_eq!(r.twins_in_slots(&me), vec![twin.last_seen_unix_ms, me.last_seen_unix_ms]);
    }

    #[test]
    fn without_a_host_cache_only_the_slots_hold_sessions() {
        let mut r = table(1, 0);
        used(&mut r, "a", "b0", 5);
        used(&mut r, "b", "b0", 5);
        assert_eq!(keys(&mut r), ["b"]);
    }

    #[test]
    fn a_session_the_tier_keeps_stays_resident_out_of_its_line_until_it_returns_or_leaves_the_tier() {
        let mut r = table(1, 0);
        used(&mut r, "a", "b0", 50);
        r.kept_in_tier("a", "b0");
        used(&mut r, "b", "b0", 5);
        assert_eq!(keys(&mut r), ["a", "b"], "parked, not evicted");
        assert!(!r.in_slot("a") && r.in_slot("b"));
        assert_eq!((r.lineups["b0"].by_tick.len(), r.lineups["b0"].tokens), (1, 5), "not counted in the line");
        // Back: in its line again with its tokens; `b` is out (not kept).
        used(&mut r, "a", "b0", 60);
        assert!(r.in_slot("a"));
        assert_eq!(keys(&mut r), ["a"]);
        assert_eq!(r.lineups["b0"].tokens, 60);
        used(&mut r, "c", "b0", 7);
        assert_eq!(keys(&mut r), ["a", "c"]);
        // A restarted server holds nothing: what the tier keeps is parked.
        used(&mut r, "d", "b1", 9);
        r.server_restarted("b0");
        assert!(!r.in_slot("a") && !r.in_slot("c") && r.in_slot("d"));
        assert_eq!(keys(&mut r), ["a", "d"]);
        assert_eq!((r.lineups["b0"].by_tick.len(), r.lineups["b0"].tokens), (0, 0));
        used(&mut r, "c", "b0", 7);
        r.take_update(false);
        r.left_tier("a", "b1");
        assert!(r.take_update(false).removed.is_empty(), "another backend's tier never kept it");
        r.left_tier("a", "b0");
        assert_eq!(r.take_update(false).removed, ["a"]);
        assert_eq!(keys(&mut r), ["c", "d"]);
        assert_eq!((r.lineups["b0"].by_tick.len(), r.lineups["b0"].tokens), (1, 7));
    }

    #[test]
    fn updates_carry_only_changes_and_are_numbered() {
        let mut r = table(1, 0);
        used(&mut r, "a", "b0", 5);
        let first = r.take_update(false);
        assert_eq!((first.seq, first.upserted.len(), first.removed.len()), (1, 1, 0));
        assert!(!r.has_changes());
        used(&mut r, "b", "b0", 5);
        let second = r.take_update(false);
        assert_eq!(second.seq, 2);
        assert_eq!(second.upserted.iter().map(|s| s.key.as_str()).collect::<Vec<_>>(), ["b"]);
        assert_eq!(second.removed, ["a"]);
        let full = r.take_update(true);
        assert!(full.full && full.removed.is_empty() && full.upserted.len() == 1 && full.seq == 3);
    }

    #[test]
    fn cache_hits_and_misses_follow_what_the_server_reported() {
        let mut r = table(4, 0);
        r.touch("a", "b0", "m", 1);
        r.record("a", "b0", Usage { prompt_tokens: 10, completion_tokens: 5, cached_tokens: 0 });
        r.touch("a", "b0", "m", 2);
        r.record("a", "b0", Usage { prompt_tokens: 20, completion_tokens: 5, cached_tokens: 14 });
        r.touch("a", "b0", "m", 3);
        r.record("a", "b0", Usage { prompt_tokens: 30, completion_tokens: 5, cached_tokens: 0 });
        // Only the chat template's first tokens, which every conversation
        // shares, were found: a miss.
        r.touch("a", "b0", "m", 4);
        r.record("a", "b0", Usage { prompt_tokens: 40, completion_tokens: 5, cached_tokens: 19 });
        let session = r.take_update(true).upserted.remove(0);
        assert_eq!((session.requests, session.cache_hits, session.cache_misses, session.tokens), (4, 1, 2, 45));
    }

    #[test]
    fn a_restored_session_is_resident_and_its_next_turn_says_whether_the_restore_held() {
        let mut r = table(2, 0);
        r.restored("held", "b0", "m", (1_000, None), 5);
        r.restored("lost", "b0", "m", (1_000, Some(std::sync::Arc::from([7; 1_000]))), 6);
        assert_eq!(r.unchecked_restore("held"), None, "its file said no tokens");
        assert_eq!(r.unchecked_restore("lost").map(|t| t.len()), Some(1_000));
        let update = r.take_update(false);
        let mut tokens: Vec<_> = update.upserted.iter().map(|s| (s.key.as_str(), s.tokens, s.requests)).collect();
        tokens.sort_unstable();
        assert_eq!(tokens, [("held", 1_000, 0), ("lost", 1_000, 0)], "resident, with what was restored");
        let usage = |cached| Usage { prompt_tokens: 1_030, completion_tokens: 10, cached_tokens: cached };
        r.touch("held", "b0", "m", 7);
        assert_eq!(r.record("held", "b0", usage(999)), Some(RestoreCheck::Held { restored: 1_000, cached: 999 }));
        r.touch("held", "b0", "m", 8);
        assert_eq!(r.record("held", "b0", usage(1_030)), None, "only the first turn checks");
        r.touch("lost", "b0", "m", 9);
        assert_eq!(
            r.record("lost", "b0", usage(12)),
            Some(RestoreCheck::ReusedNothing { restored: 1_000, cached: 12 })
        );
        assert_eq!(r.unchecked_restore("lost"), None, "checked");
        // A session moved away leaves the table, said as removed.
        r.take_update(false);
        r.remove("held");
        r.remove("absent");
        let update = r.take_update(false);
        assert_eq!((update.upserted.len(), update.removed), (0, vec!["held".to_string()]));
        assert_eq!(r.backend_of("held"), None);
    }

    #[test]
    fn a_session_is_in_a_slot_while_it_is_among_its_backend_s_newest() {
        let mut r = table(2, 1_000_000);
        for (i, key) in ["a", "b", "c"].iter().enumerate() {
            r.touch(key, "b0", "m", i as u64);
        }
        r.touch("x", "b1", "m", 9);
        assert_eq!((r.in_slot("a"), r.in_slot("b"), r.in_slot("c"), r.in_slot("x")), (false, true, true, true));
        r.touch("a", "b0", "m", 10);
        assert_eq!((r.in_slot("a"), r.in_slot("b"), r.in_slot("c")), (true, false, true), "used again: newest");
        assert!(!r.in_slot("nobody"));
    }

    #[test]
    fn a_session_that_moves_starts_over_on_its_new_backend() {
        let mut r = table(4, 0);
        used(&mut r, "a", "b0", 5);
        r.touch("a", "b1", "m", 9);
        assert_eq!(r.backend_of("a"), Some("b1"));
        let session = r.take_update(true).upserted.remove(0);
        assert_eq!((session.requests, session.first_seen_unix_ms, session.tokens), (1, 9, 0));
    }
}

/// The table held to the plain reading of its rule: every session of a
/// backend sorted by recency on every change.
#[cfg(test)]
mod against_a_full_sort {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[derive(Default)]
    struct Plain {
        capacity: HashMap<&'static str, Capacity>,
        /// Key → (backend, tick, tokens).
        sessions: HashMap<&'static str, (&'static str, u64, u64)>,
        tick: u64,
    }

    impl Plain {
        fn touch(&mut self, key: &'static str, backend: &'static str) {
            self.tick += 1;
            let session = self.sessions.entry(key).or_insert((backend, 0, 0));
            if session.0 != backend {
                *session = (backend, 0, 0);
            }
            session.1 = self.tick;
            self.evict(backend);
        }

        fn record(&mut self, key: &'static str, backend: &'static str, tokens: u64) {
            match self.sessions.get_mut(key) {
                Some(session) if session.0 == backend => session.2 = tokens,
                _ => return,
            }
            self.evict(backend);
        }

        fn evict(&mut self, backend: &'static str) {
            let capacity = self.capacity.get(backend).copied().unwrap_or_default();
            let mut on_backend: Vec<_> = self.sessions.iter().filter(|(_, s)| s.0 == backend).collect();
            on_backend.sort_unstable_by_key(|(_, s)| std::cmp::Reverse(s.1));
            let mut used = 0;
            let gone: Vec<&'static str> = on_backend
                .into_iter()
                .skip(capacity.slots)
                .enumerate()
                .filter(|(i, (_, s))| {
                    used += s.2;
                    used > capacity.host_cache_tokens || *i >= MAX_HOST_CACHED_SESSIONS
                })
                .map(|(_, session)| session)
                .map(|(key, _)| *key)
                .collect();
            for key in gone {
                self.sessions.remove(key);
            }
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Touch(&'static str, &'static str),
        Record(&'static str, &'static str, u32),
        Capacity(&'static str, usize, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        let key = prop::sample::select(vec!["a", "b", "c", "d", "e", "f", "g"]);
        let backend = prop::sample::select(vec!["b0", "b1"]);
        prop_oneof![
            4 => (key.clone(), backend.clone()).prop_map(|(k, b)| Op::Touch(k, b)),
            4 => (key, backend.clone(), 0..120u32).prop_map(|(k, b, t)| Op::Record(k, b, t)),
            1 => (backend, 0..4usize, 0..300u64).prop_map(|(b, s, h)| Op::Capacity(b, s, h)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        #[test]
        fn the_table_keeps_what_a_full_sort_keeps(ops in prop::collection::vec(op(), 1..60)) {
            let mut table = Residency::default();
            let mut plain = Plain::default();
            for op in ops {
                match op {
                    Op::Touch(key, backend) => {
                        table.touch(key, backend, "m", 1);
                        plain.touch(key, backend);
                    }
                    Op::Record(key, backend, tokens) => {
                        table.record(key, backend, Usage { prompt_tokens: tokens, completion_tokens: 0, cached_tokens: 0 });
                        plain.record(key, backend, u64::from(tokens));
                    }
                    Op::Capacity(backend, slots, host_cache_tokens) => {
                        let capacity = Capacity { slots, host_cache_tokens };
                        table.set_capacity(backend, capacity);
                        plain.capacity.insert(backend, capacity);
                        plain.evict(backend);
                    }
                }
                let mut kept: Vec<_> =
                    table.sessions().into_iter().map(|s| (s.key, s.backend_id, u64::from(s.tokens))).collect();
                kept.sort();
                let mut expected: Vec<_> =
                    plain.sessions.iter().map(|(k, s)| (k.to_string(), s.0.to_string(), s.2)).collect();
                expected.sort();
                prop_assert_eq!(kept, expected);
                // Each line holds its backend's sessions and their tokens.
                for (backend, lineup) in &table.lineups {
                    let on_backend = table.entries.values().filter(|e| &e.session.backend_id == backend);
                    let tokens: u64 = on_backend.clone().map(|e| u64::from(e.session.tokens)).sum();
                    prop_assert_eq!((lineup.by_tick.len(), lineup.tokens), (on_backend.count(), tokens));
                    let in_line: u64 = lineup.by_tick.values().map(|(_, tokens)| tokens).sum();
                    prop_assert_eq!(in_line, tokens);
                }
            }
        }
    }
}
