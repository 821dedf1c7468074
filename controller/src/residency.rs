//! The sessions resident on one node, as its agent's numbered updates
//! describe them. Pure: the agent stream handler owns one per stream.

use std::collections::BTreeMap;

use inferyes_proto::v1::{NodeStatus, ResidencyUpdate, ResidentSession};

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
            let sessions: BTreeMap<String, ResidentSession> =
                update.upserted.into_iter().map(|s| (s.key.clone(), s)).collect();
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
            self.sessions.insert(session.key.clone(), session);
        }
        if before == self.sessions { Applied::Unchanged } else { Applied::Changed }
    }

    /// The agent's status with this table's sessions, sorted by key.
    pub fn merged(&self, status: &NodeStatus) -> NodeStatus {
        let mut merged = status.clone();
        if self.in_use {
            merged.sessions = self.sessions.values().cloned().collect();
        }
        merged
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
        table.merged(&NodeStatus::default()).sessions.into_iter().map(|s| s.key).collect()
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
    fn statuses_keep_their_own_sessions_until_updates_arrive() {
        let table = SessionTable::default();
        let status = NodeStatus { sessions: vec![session("own", 1)], ..Default::default() };
        assert_eq!(table.merged(&status).sessions.len(), 1);
    }
}
