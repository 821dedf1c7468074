//! Which conversations the agent believes are resident on which backend.
//! llama-server has no notion of sessions: only the proxy, which sees each
//! request's session key, can keep this table. Pure: no I/O, no clocks.

use std::collections::HashMap;

use inferyes_proto::v1::ResidentSession;

#[derive(Clone, Debug)]
struct Entry {
    backend_id: String,
    model: String,
    first_seen_s: u64,
    last_seen_s: u64,
    requests: u32,
    /// Recency order; larger is more recent.
    tick: u64,
}

/// A least-recently-used table of session keys, bounded per backend: a
/// backend holds only so many conversations' KV caches before older ones
/// are evicted.
#[derive(Clone, Debug)]
pub struct Residency {
    capacity_per_backend: usize,
    entries: HashMap<String, Entry>,
    tick: u64,
}

impl Residency {
    pub fn new(capacity_per_backend: usize) -> Residency {
        Residency { capacity_per_backend: capacity_per_backend.max(1), entries: HashMap::new(), tick: 0 }
    }

    /// Records a request of session `key` on `backend_id`.
    pub fn touch(&mut self, key: &str, backend_id: &str, model: &str, now_s: u64) {
        self.tick += 1;
        let tick = self.tick;
        match self.entries.get_mut(key) {
            Some(entry) => {
                if entry.backend_id != backend_id {
                    // The conversation moved: its cache is being rebuilt there.
                    entry.backend_id = backend_id.to_string();
                    entry.first_seen_s = now_s;
                    entry.requests = 0;
                }
                entry.model = model.to_string();
                entry.last_seen_s = now_s;
                entry.requests = entry.requests.saturating_add(1);
                entry.tick = tick;
            }
            None => {
                self.entries.insert(
                    key.to_string(),
                    Entry {
                        backend_id: backend_id.to_string(),
                        model: model.to_string(),
                        first_seen_s: now_s,
                        last_seen_s: now_s,
                        requests: 1,
                        tick,
                    },
                );
            }
        }
        self.evict(backend_id);
    }

    fn evict(&mut self, backend_id: &str) {
        let mut on_backend: Vec<(u64, &String)> =
            self.entries.iter().filter(|(_, e)| e.backend_id == backend_id).map(|(k, e)| (e.tick, k)).collect();
        if on_backend.len() <= self.capacity_per_backend {
            return;
        }
        on_backend.sort_unstable();
        let excess = on_backend.len() - self.capacity_per_backend;
        let evicted: Vec<String> = on_backend[..excess].iter().map(|(_, k)| (*k).clone()).collect();
        for key in evicted {
            self.entries.remove(&key);
        }
    }

    /// The table as reported, sorted by key so equal tables give equal
    /// reports.
    pub fn sessions(&self) -> Vec<ResidentSession> {
        let mut sessions: Vec<ResidentSession> = self
            .entries
            .iter()
            .map(|(key, e)| ResidentSession {
                key: key.clone(),
                backend_id: e.backend_id.clone(),
                model: e.model.clone(),
                first_seen_unix_s: e.first_seen_s,
                last_seen_unix_s: e.last_seen_s,
                requests: e.requests,
            })
            .collect();
        sessions.sort_by(|a, b| a.key.cmp(&b.key));
        sessions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_recent_sessions_are_evicted_per_backend() {
        let mut table = Residency::new(2);
        table.touch("a", "b0", "m", 1);
        table.touch("b", "b0", "m", 2);
        table.touch("x", "b1", "m", 2);
        table.touch("a", "b0", "m", 3);
        table.touch("c", "b0", "m", 4);
        let keys: Vec<_> = table.sessions().into_iter().map(|s| s.key).collect();
        assert_eq!(keys, ["a", "c", "x"]);
    }

    #[test]
    fn a_session_that_moves_starts_over_on_its_new_backend() {
        let mut table = Residency::new(4);
        table.touch("a", "b0", "m", 1);
        table.touch("a", "b0", "m", 2);
        assert_eq!(table.sessions()[0].requests, 2);
        table.touch("a", "b1", "m", 5);
        let session = &table.sessions()[0];
        assert_eq!((session.backend_id.as_str(), session.requests, session.first_seen_unix_s), ("b1", 1, 5));
    }
}
