//! The numbering of an agent's residency updates: which to pass on to the
//! node's live state, and when to ask for a full table. Pure: the agent
//! stream handler owns one per stream.

use inferyes_proto::v1::ResidencyUpdate;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Numbering {
    /// The sequence number the next incremental update must carry; `None`
    /// until a full table arrived.
    next_seq: Option<u64>,
    /// Whether the agent sends residency updates at all (older agents put
    /// sessions in their status instead).
    in_use: bool,
    /// A full table was asked for and has not come yet: ask once per gap.
    asked: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// In sequence (or a full table): apply it.
    Apply,
    /// A gap in the numbering: dropped, and the table is stale until a full
    /// update.
    Resync { expected_seq: u64 },
    /// Dropped while the full table asked for is on its way.
    Drop,
}

impl Numbering {
    pub fn check(&mut self, update: &ResidencyUpdate) -> Check {
        self.in_use = true;
        if update.full {
            self.next_seq = Some(update.seq.wrapping_add(1));
            self.asked = false;
            return Check::Apply;
        }
        match self.next_seq {
            Some(expected) if expected == update.seq => {
                self.next_seq = Some(update.seq.wrapping_add(1));
                Check::Apply
            }
            Some(expected) => {
                self.next_seq = None;
                self.asked = true;
                Check::Resync { expected_seq: expected }
            }
            // Waiting for a full table: incremental updates are dropped.
            None if self.asked => Check::Drop,
            None => {
                self.asked = true;
                Check::Resync { expected_seq: 0 }
            }
        }
    }

    /// Whether the agent sends numbered updates (else its status carries
    /// its sessions).
    pub fn in_use(&self) -> bool {
        self.in_use
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn update(seq: u64, full: bool) -> ResidencyUpdate {
        ResidencyUpdate { seq, full, ..Default::default() }
    }

    #[test]
    fn updates_apply_in_sequence_and_a_gap_asks_for_a_full_table() {
        let mut numbering = Numbering::default();
        assert!(!numbering.in_use());
        assert_eq!(numbering.check(&update(3, false)), Check::Resync { expected_seq: 0 });
        assert!(numbering.in_use());
        assert_eq!(numbering.check(&update(4, true)), Check::Apply);
        assert_eq!(numbering.check(&update(5, false)), Check::Apply);
        assert_eq!(numbering.check(&update(7, false)), Check::Resync { expected_seq: 6 });
        assert_eq!(numbering.check(&update(8, false)), Check::Drop, "nothing across the gap, and one ask");
        assert_eq!(numbering.check(&update(9, true)), Check::Apply);
        assert_eq!(numbering.check(&update(10, false)), Check::Apply);
    }
}
