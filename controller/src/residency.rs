//! The sessions resident on one node, as its agent's numbered updates
//! describe them. Pure: the agent stream handler owns one per stream.

use std::collections::BTreeMap;

use inferyes_proto::v1::{ResidencyUpdate, ResidentSession};

/// Sessions one node may have held here, and the longest key taken: a
/// table is in memory on every controller and in every snapshot, and an
/// agent claiming a million sessions must not fill them. An agent keeps far
/// fewer (1,024 past the slots per backend).
pub const MAX_SESSIONS: usize = 65_536;
pub const MAX_KEY_BYTES: usize = 256;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct SessionTable {
    sessions: BTreeMap<String, ResidentSession>,
    /// The sequence number the next incremental update must carry; `None`
    /// until a full table arrived.
    next_seq: Option<u64>,
    /// Whether the agent sends residency updates at all (older agents put
    /// sessions in their status instead).
    in_use: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    Changed,
    Unchanged,
    /// A gap in the numbering: the table is stale until a full update.
    Resync {
        expected_seq: u64,
    },
}

impl SessionTable {
    pub fn apply(&mut self, update: ResidencyUpdate) -> Applied {
        self.in_use = true;
        if update.full {
            let sessions: BTreeMap<String, ResidentSession> = update
                .upserted
                .into_iter()
                .filter(|s| s.key.len() <= MAX_KEY_BYTES)
                .take(MAX_SESSIONS)
                .map(|s| (s.key.clone(), s))
                .collect();
            self.next_seq = Some(update.seq + 1);
            if sessions == self.sessions {
                return Applied::Unchanged;
            }
            self.sessions = sessions;
            return Applied::Changed;
        }
        match self.next_seq {
            Some(expected) if expected == update.seq => {}
            Some(expected) => {
                self.next_seq = None;
                return Applied::Resync { expected_seq: expected };
            }
            // Waiting for a full table: incremental updates are dropped.
            None => return Applied::Resync { expected_seq: 0 },
        }
        self.next_seq = Some(update.seq + 1);
        let before = self.sessions.clone();
        for key in update.removed {
            self.sessions.remove(&key);
        }
        for session in update.upserted {
            let room = self.sessions.len() < MAX_SESSIONS || self.sessions.contains_key(&session.key);
            if room && session.key.len() <= MAX_KEY_BYTES {
                self.sessions.insert(session.key.clone(), session);
            }
        }
        if before == self.sessions { Applied::Unchanged } else { Applied::Changed }
    }

    /// This table's sessions, sorted by key; `own`, the status's, from an
    /// agent that sends no updates.
    pub fn sessions_or(&self, own: &[ResidentSession]) -> Vec<ResidentSession> {
        if self.in_use { self.sessions.values().cloned().collect() } else { own.to_vec() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(key: &str, requests: u32) -> ResidentSession {
        ResidentSession { key: key.into(), backend_id: "b".into(), requests, ..Default::default() }
    }

    fn update(seq: u64, full: bool, upserted: Vec<ResidentSession>, removed: &[&str]) -> ResidencyUpdate {
        ResidencyUpdate { seq, full, upserted, removed: removed.iter().map(|k| (*k).to_string()).collect() }
    }

    fn keys(table: &SessionTable) -> Vec<String> {
        table.sessions_or(&[]).into_iter().map(|s| s.key).collect()
    }

    #[test]
    fn updates_apply_in_sequence_and_a_gap_asks_for_a_full_table() {
        let mut table = SessionTable::default();
        assert_eq!(table.apply(update(3, false, vec![session("x", 1)], &[])), Applied::Resync { expected_seq: 0 });
        assert!(keys(&table).is_empty());
        assert_eq!(table.apply(update(4, true, vec![session("a", 1), session("b", 1)], &[])), Applied::Changed);
        assert_eq!(table.apply(update(5, false, vec![session("c", 1)], &["a"])), Applied::Changed);
        assert_eq!(keys(&table), ["b", "c"]);
        assert_eq!(table.apply(update(6, false, vec![session("c", 1)], &[])), Applied::Unchanged);
        assert_eq!(table.apply(update(8, false, vec![session("d", 1)], &[])), Applied::Resync { expected_seq: 7 });
        assert_eq!(keys(&table), ["b", "c"], "nothing applied across the gap");
        assert_eq!(table.apply(update(9, false, vec![], &["b"])), Applied::Resync { expected_seq: 0 });
        assert_eq!(table.apply(update(10, true, vec![session("d", 2)], &[])), Applied::Changed);
        assert_eq!(keys(&table), ["d"]);
    }

    #[test]
    fn a_table_holds_no_more_than_its_bound() {
        let mut table = SessionTable::default();
        let many: Vec<_> = (0..MAX_SESSIONS + 10).map(|i| session(&format!("s{i}"), 1)).collect();
        table.apply(update(1, true, many, &[]));
        assert_eq!(keys(&table).len(), MAX_SESSIONS);
        table.apply(update(2, false, vec![session("new", 1), session(&"k".repeat(MAX_KEY_BYTES + 1), 1)], &[]));
        assert_eq!(keys(&table).len(), MAX_SESSIONS, "no room for a new one, nor for a key too long");
        table.apply(update(3, false, vec![session("new", 1)], &["s0"]));
        assert!(keys(&table).contains(&"new".to_string()));
    }

    #[test]
    fn statuses_keep_their_own_sessions_until_updates_arrive() {
        let table = SessionTable::default();
        assert_eq!(table.sessions_or(&[session("own", 1)]).len(), 1);
    }
}
