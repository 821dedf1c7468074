//! Moving a conversation's KV cache to another node, instead of
//! recomputing it there. llama-server saves a slot's state to a file in its
//! `--slot-save-path` and restores one into a slot; the agent finds the
//! slot holding a conversation, has it saved, sends the file to the other
//! node's agent (`transfer`), which restores it into a free slot and
//! records the conversation as resident; the conversation's next turn
//! there says whether the restore held (its prompt read from cache). A
//! drain moves every resident conversation it can (`drain`); a data plane
//! may ask for one to be carried (`transfer::Carrier`).
//!
//! A slot's file is only good for a server with the same model file, build
//! and KV cache flags: each backend's fingerprint (`probe::fingerprint`)
//! hashes them, and a slot moves only between backends whose fingerprints
//! are equal. This module's own part is pure: which slot holds what.

pub mod drain;
pub mod judge;
pub mod keeper;
pub mod transfer;

pub use crate::slot::{Restored, Slot};

use serde_json::Value;

/// llama-server's `/slots`, each slot's id, state, task and tokens.
pub fn parse_slots(body: &[u8]) -> Option<Vec<Slot>> {
    let Value::Array(slots) = serde_json::from_slice::<Value>(body).ok()? else { return None };
    let number = |slot: &Value, name: &str| slot.get(name).and_then(Value::as_u64);
    slots
        .iter()
        .map(|slot| {
            Some(Slot {
                id: u32::try_from(number(slot, "id")?).ok()?,
                busy: slot.get("is_processing").and_then(Value::as_bool).unwrap_or(true),
                task: number(slot, "id_task"),
                tokens: number(slot, "n_prompt_tokens").and_then(|n| u32::try_from(n).ok()),
            })
        })
        .collect()
}

/// Why a conversation's slot was not found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotFound {
    #[error("no slot holds its tokens (it is only in the host cache, or its slot was reused)")]
    Gone,
    #[error("several slots hold as many tokens")]
    Ambiguous,
    #[error("its slot is busy")]
    Busy,
}

/// The slot holding a conversation whose cache holds `tokens` (its last
/// prompt and reply, as the usage said): the one slot whose cache length
/// is one less (llama-server never evaluates the last token it sampled,
/// whatever stopped the reply), else, where none is, as many (what a turn
/// begun in a restored slot leaves). A slot of another length is another
/// conversation's, however close.
///
/// Several slots of one length hold as many conversations of those tokens
/// (`twins`: when each of their last turns began, in the order they
/// reached the proxy, this one's among them): llama-server numbers its
/// tasks in the order they arrive, so the conversations' order is their
/// slots' order by task. Only where that order is plain: as many
/// conversations as slots, each turn begun at least [`TWIN_GAP_MS`] after
/// the one before. Slots whose conversations moved away (`gone`, as
/// `/slots` showed them then) still hold their caches until they run
/// another task, and are not counted. Never a guess: anything else is not
/// found.
pub fn holding_slot(slots: &[Slot], gone: &[Slot], tokens: u32, twins: &[u64], began: u64) -> Result<u32, NotFound> {
    if tokens == 0 {
        return Err(NotFound::Gone);
    }
    // One less than the usage said, as a turn leaves it; else as many (a
    // turn that began in a slot restored from another node leaves that).
    let of_length = |less: u64| -> Vec<&Slot> {
        let length = u64::from(tokens) - less;
        slots.iter().filter(|s| s.tokens.is_some_and(|n| u64::from(n) == length) && !gone.contains(s)).collect()
    };
    let mut matching = of_length(1);
    if matching.is_empty() {
        matching = of_length(0);
    }
    if matching.is_empty() {
        return Err(NotFound::Gone);
    }
    // As many slots as conversations of these tokens, each slot's task
    // in the order their turns reached the proxy; one of each included.
    let mut order = twins.to_vec();
    order.sort_unstable();
    let plain = order.windows(2).all(|w| w[1].saturating_sub(w[0]) >= TWIN_GAP_MS);
    let rank = order.iter().position(|t| *t == began).ok_or(NotFound::Ambiguous)?;
    if order.len() != matching.len() || !plain || (matching.len() > 1 && matching.iter().any(|s| s.task.is_none())) {
        return Err(NotFound::Ambiguous);
    }
    matching.sort_by_key(|s| s.task);
    let found = matching[rank];
    if found.busy {
        return Err(NotFound::Busy);
    }
    Ok(found.id)
}

/// How far apart two conversations' last turns must have begun for the
/// proxy's order of them to be the server's.
pub const TWIN_GAP_MS: u64 = 20;

/// The idle slot a moved conversation goes into: one that never ran a
/// task, else the one holding the fewest tokens; never one restored into
/// that has not run a task since.
pub fn free_slot(slots: &[Slot], restored: &[Restored]) -> Option<u32> {
    let taken = |slot: &Slot| restored.iter().any(|r| r.slot == *slot);
    slots
        .iter()
        .filter(|s| !s.busy && !taken(s))
        .min_by_key(|s| (s.task.is_some(), s.tokens.unwrap_or(0), s.id))
        .map(|s| s.id)
}

/// The tokens a slot file's head says its state is of: after `ggsq` and
/// the format's version, a count of 32-bit values, which llama-server
/// b11434 writes as its own record of the slot's tokens (-1, 1, their
/// number, the tokens, then more of its own) and earlier servers as the
/// tokens alone. `None` unless it names exactly `expected` tokens: a
/// layout not understood is not guessed at.
pub fn saved_tokens(head: &[u8], expected: u32) -> Option<Vec<i32>> {
    let word = |at: usize| head.get(at..at + 4).map(|b| [b[0], b[1], b[2], b[3]]);
    if head.get(..4)? != b"qsgg".as_slice() {
        return None;
    }
    let count = usize::try_from(u32::from_le_bytes(word(8)?)).ok()?;
    let expected = usize::try_from(expected).ok()?;
    let value = |i: usize| word(12 + 4 * i).map(i32::from_le_bytes);
    let (first, length) = match (value(0)?, value(1)?, value(2)?) {
        (-1, 1, n) => (3, usize::try_from(n).ok()?),
        _ => (0, count),
    };
    if length != expected || first + length > count {
        return None;
    }
    (first..first + length).map(value).collect()
}

/// The bytes of a slot file's head that hold the tokens of a state of
/// `tokens`: what [`saved_tokens`] reads.
pub fn saved_tokens_bytes(tokens: u32) -> usize {
    12 + 4 * (3 + usize::try_from(tokens).unwrap_or(usize::MAX / 8))
}

/// How many tokens `request` has of `restored` from its start.
pub fn common_prefix(restored: &[i32], request: &[i32]) -> usize {
    restored.iter().zip(request).take_while(|(a, b)| a == b).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(id: u32, busy: bool, task: Option<u64>, tokens: Option<u32>) -> Slot {
        Slot { id, busy, task, tokens }
    }

    #[test]
    fn slots_are_read_as_llama_server_shows_them() {
        let body = br#"[{"id":0,"n_ctx":4096,"is_processing":false},
            {"id":1,"n_ctx":4096,"is_processing":false,"id_task":4,"n_prompt_tokens":1140,"next_token":[{"n_decoded":0}]},
            {"id":2,"is_processing":true,"id_task":9,"n_prompt_tokens":12}]"#;
        assert_eq!(
            parse_slots(body),
            Some(vec![
                slot(0, false, None, None),
                slot(1, false, Some(4), Some(1140)),
                slot(2, true, Some(9), Some(12))
            ])
        );
        assert_eq!(parse_slots(br#"[{"is_processing":false}]"#), None, "a slot without an id");
        assert_eq!(parse_slots(br#"{"id":0}"#), None);
        assert_eq!(parse_slots(br#"[{"id":0}]"#).map(|s| s[0].busy), Some(true), "no state: taken for busy");
    }

    #[test]
    fn a_conversation_s_slot_is_the_one_holding_its_tokens_or_none() {
        let slots =
            [slot(0, false, Some(1), Some(500)), slot(1, false, Some(4), Some(1140)), slot(2, true, None, None)];
        // Prompt 1,121 and reply 20 leave 1,140 in the cache.
        assert_eq!(holding_slot(&slots, &[], 1141, &[5], 5), Ok(1));
        assert_eq!(holding_slot(&slots, &[], 1140, &[5], 5), Ok(1), "as many, where none is one less");
        assert_eq!(holding_slot(&slots, &[], 1142, &[5], 5), Err(NotFound::Gone), "one token more: another's");
        assert_eq!(holding_slot(&slots, &[], 1139, &[5], 5), Err(NotFound::Gone), "two less: another's");
        // A conversation of as many tokens whose slot is elsewhere (in the
        // host cache) leaves this one in doubt: never a guess.
        assert_eq!(holding_slot(&slots, &[], 1141, &[5, 9], 5), Err(NotFound::Ambiguous));
        assert_eq!(holding_slot(&slots, &[], 0, &[5], 5), Err(NotFound::Gone));
        let busy = [slot(0, true, Some(1), Some(500))];
        assert_eq!(holding_slot(&busy, &[], 501, &[5], 5), Err(NotFound::Busy));
        // A slot whose conversation moved away holds it still: not counted.
        let moved = slot(0, false, Some(1), Some(500));
        let both = [moved, slot(1, false, Some(2), Some(500))];
        assert_eq!(holding_slot(&both, &[moved], 501, &[5], 5), Ok(1));
        assert_eq!(holding_slot(&[moved], &[moved], 501, &[5], 5), Err(NotFound::Gone));
        let reused = slot(0, false, Some(3), Some(500));
        assert_eq!(holding_slot(&[reused], &[moved], 501, &[5], 5), Ok(0), "once it ran a task, it counts");
    }

    #[test]
    fn twins_are_told_apart_by_the_order_their_turns_reached_the_server_or_not_at_all() {
        // Two conversations of 501 tokens; slot 1 ran the earlier task.
        let twins =
            [slot(0, false, Some(9), Some(500)), slot(1, false, Some(4), Some(500)), slot(2, false, None, None)];
        assert_eq!(holding_slot(&twins, &[], 501, &[1_000, 2_000], 1_000), Ok(1), "the earlier turn, the earlier task");
        assert_eq!(holding_slot(&twins, &[], 501, &[2_000, 1_000], 2_000), Ok(0));
        let never = |twins_began: &[u64], began| holding_slot(&twins, &[], 501, twins_began, began);
        assert_eq!(never(&[1_000, 1_010], 1_000), Err(NotFound::Ambiguous), "begun too close together");
        assert_eq!(never(&[1_000], 1_000), Err(NotFound::Ambiguous), "a slot no conversation here explains");
        assert_eq!(never(&[1_000, 2_000, 3_000], 1_000), Err(NotFound::Ambiguous), "more twins than slots");
        // Neighbours by a token are each their own.
        let neighbours = [slot(0, false, Some(9), Some(500)), slot(1, false, Some(4), Some(501))];
        assert_eq!(holding_slot(&neighbours, &[], 501, &[1_000], 1_000), Ok(0));
        assert_eq!(holding_slot(&neighbours, &[], 502, &[2_000], 2_000), Ok(1));
    }

    #[test]
    fn a_moved_conversation_takes_an_empty_slot_then_the_smallest_never_one_just_restored() {
        let slots = [slot(0, false, Some(3), Some(900)), slot(1, false, None, None), slot(2, false, Some(5), Some(40))];
        assert_eq!(free_slot(&slots, &[]), Some(1));
        let restored = [Restored { slot: slot(1, false, None, None) }];
        assert_eq!(free_slot(&slots, &restored), Some(2));
        // Once it ran a task it looks like any other.
        let used = [slot(0, false, Some(3), Some(900)), slot(1, false, Some(7), Some(1200))];
        assert_eq!(free_slot(&used, &restored), Some(0));
        assert_eq!(free_slot(&[slot(0, true, None, None)], &[]), None);
    }

    #[test]
    fn a_slot_file_s_tokens_are_read_as_llama_server_writes_them() {
        let file = |values: &[i32]| {
            let mut head = b"qsgg".to_vec();
            head.extend_from_slice(&4u32.to_le_bytes());
            head.extend_from_slice(&u32::try_from(values.len()).unwrap().to_le_bytes());
            values.iter().for_each(|v| head.extend_from_slice(&v.to_le_bytes()));
            head.extend_from_slice(b"the state that follows");
            head
        };
        // What b11434 saved of a slot that read "Name three stones." and
        // wrote three tokens: 12 values, its record around 8 tokens.
        let b11434 = file(&[-1, 1, 8, 2, 1567, 1806, 23795, 236761, 108, 236746, 236761, 0]);
        let tokens = vec![2, 1567, 1806, 23795, 236761, 108, 236746, 236761];
        assert_eq!(saved_tokens(&b11434, 8), Some(tokens.clone()));
        assert!(saved_tokens_bytes(8) <= b11434.len());
        assert_eq!(saved_tokens(&file(&tokens), 8), Some(tokens.clone()), "tokens alone");
        assert_eq!(saved_tokens(&b11434, 7), None, "another number than the server saved");
        assert_eq!(saved_tokens(&file(&[-1, 1, 9, 2, 3]), 9), None, "more than the count");
        assert_eq!(saved_tokens(&b11434[..30], 8), None, "cut short");
        assert_eq!(saved_tokens(b"ggsn and more bytes than that", 1), None, "not a slot file");
        assert_eq!(common_prefix(&tokens, &[2, 1567, 1806, 9]), 3);
        assert_eq!(common_prefix(&tokens, &tokens), 8);
        assert_eq!(common_prefix(&tokens, &[]), 0);
    }
}
