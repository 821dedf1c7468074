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

use std::collections::{BTreeSet, HashMap};

use inferyes_proto::v1::{ResidencyUpdate, ResidentSession};

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
}

pub use inferyes_proto::usage::Usage;

#[derive(Clone, Debug, Default)]
pub struct Residency {
    capacity: HashMap<String, Capacity>,
    entries: HashMap<String, Entry>,
    tick: u64,
    seq: u64,
    changed: BTreeSet<String>,
    removed: BTreeSet<String>,
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
        // Looked up before inserting: a session's later turns (most
        // requests) allocate nothing here.
        if !self.entries.contains_key(key) {
            let session = ResidentSession {
                key: key.to_string(),
                backend_id: backend_id.to_string(),
                first_seen_unix_ms: now_ms,
                ..Default::default()
            };
            self.entries.insert(key.to_string(), Entry { session, tick });
        }
        let Some(entry) = self.entries.get_mut(key) else { return };
        if entry.session.backend_id != backend_id {
            // The conversation moved: its cache is rebuilt there from scratch.
            entry.session = ResidentSession {
                key: key.to_string(),
                backend_id: backend_id.to_string(),
                first_seen_unix_ms: now_ms,
                ..Default::default()
            };
        }
        if entry.session.model != model {
            entry.session.model = model.to_string();
        }
        entry.session.last_seen_unix_ms = now_ms;
        entry.session.requests = entry.session.requests.saturating_add(1);
        entry.tick = tick;
        self.removed.remove(key);
        if !self.changed.contains(key) {
            self.changed.insert(key.to_string());
        }
        self.evict(backend_id);
    }

    /// The server's usage for a finished request of session `key`: how much
    /// the cache holds now, and whether the prefix was found.
    pub fn record(&mut self, key: &str, backend_id: &str, usage: Usage) {
        let Some(entry) = self.entries.get_mut(key) else { return };
        if entry.session.backend_id != backend_id {
            return;
        }
        let believed_resident = entry.session.requests > 1;
        if usage.cached_tokens > 0 {
            entry.session.cache_hits = entry.session.cache_hits.saturating_add(1);
        } else if believed_resident {
            entry.session.cache_misses = entry.session.cache_misses.saturating_add(1);
        }
        entry.session.tokens = usage.prompt_tokens.saturating_add(usage.completion_tokens);
        self.changed.insert(key.to_string());
        self.evict(backend_id);
    }

    fn evict(&mut self, backend_id: &str) {
        let capacity = self.capacity.get(backend_id).copied().unwrap_or_default();
        let mut on_backend: Vec<(u64, &String, u64)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.session.backend_id == backend_id)
            .map(|(k, e)| (e.tick, k, u64::from(e.session.tokens)))
            .collect();
        if on_backend.len() <= capacity.slots {
            return;
        }
        on_backend.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
        let mut host_cache_used = 0u64;
        let mut evicted = Vec::new();
        for (_, key, tokens) in on_backend.into_iter().skip(capacity.slots) {
            host_cache_used = host_cache_used.saturating_add(tokens);
            if host_cache_used > capacity.host_cache_tokens {
                evicted.push(key.clone());
            }
        }
        for key in evicted {
            self.entries.remove(&key);
            self.changed.remove(&key);
            self.removed.insert(key);
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
    fn without_a_host_cache_only_the_slots_hold_sessions() {
        let mut r = table(1, 0);
        used(&mut r, "a", "b0", 5);
        used(&mut r, "b", "b0", 5);
        assert_eq!(keys(&mut r), ["b"]);
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
        let session = r.take_update(true).upserted.remove(0);
        assert_eq!((session.requests, session.cache_hits, session.cache_misses, session.tokens), (3, 1, 1, 35));
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
