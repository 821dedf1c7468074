//! Moving a conversation's KV cache to another node, instead of
//! recomputing it there. llama-server saves a slot's state to a file in its
//! `--slot-save-path` and restores one into a slot; the agent finds the
//! slot holding a conversation, has it saved, sends the file to the other
//! node's agent (`transfer`), which restores it into a free slot and
//! records the conversation as resident; the conversation's next turn
//! there says whether the restore held (its prompt read from cache). A
//! drain moves every resident conversation it can (`drain`).
//!
//! A slot's file is only good for a server with the same model file, build
//! and KV cache flags: each backend's **fingerprint** hashes them, and a
//! slot moves only between backends whose fingerprints are equal.

pub mod drain;
pub mod gguf;
pub mod transfer;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

use crate::config::SlotsConfig;
use crate::probe::ProbeClient;

/// What is read of a model file: its GGUF header (the metadata; a large
/// vocabulary takes a few MiB) and the bytes fingerprinted, with its tail.
const MODEL_HEAD_BYTES: u64 = 16 << 20;
const MODEL_TAIL_BYTES: u64 = 1 << 20;
/// A model file on a mount that hangs does not hold the poll for longer.
const MODEL_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// A backend's fingerprint, kept for as long as what it was made of is
/// unchanged: the model file is read again only when the server names
/// another file or build, or the file changed.
#[derive(Debug, Default)]
pub struct Memo {
    known: Mutex<Option<(MemoKey, String)>>,
    /// A look at the model file is under way: a mount that hangs holds one
    /// blocking thread, not one more each poll.
    looking: AtomicBool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct MemoKey {
    model_path: String,
    build: String,
    flags: String,
    size: u64,
    modified: Option<std::time::SystemTime>,
}

impl Memo {
    fn known(&self) -> std::sync::MutexGuard<'_, Option<(MemoKey, String)>> {
        self.known.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Whether this llama-server's slots can move, and if so its fingerprint;
/// else why not, for the fleet view.
pub async fn movability(
    client: &ProbeClient,
    url: &str,
    api_key: &str,
    slots: &SlotsConfig,
    props: Option<&Value>,
    memo: &Arc<Memo>,
) -> Result<String, String> {
    let props = props.ok_or("its /props could not be read")?;
    let text = |pointer: &str| props.pointer(pointer).and_then(Value::as_str).unwrap_or_default().to_string();
    let (model_path, build) = (text("/model_path"), text("/build_info"));
    if model_path.is_empty() {
        return Err("its /props names no model file".into());
    }
    // A file name llama-server refuses before doing anything: it answers
    // 400 when it takes slot actions, 501 when it was started without
    // `--slot-save-path`.
    let probe = serde_json::json!({ "filename": "../inferyes-probe" });
    match client.post_json(url, "/slots/0?action=save", api_key, &probe).await {
        Ok((status, _)) if status == http::StatusCode::BAD_REQUEST => {}
        Ok((status, _)) if status == http::StatusCode::NOT_IMPLEMENTED => {
            return Err("the server was started without --slot-save-path".into());
        }
        Ok((status, _)) => return Err(format!("its slot actions answer HTTP {}", status.as_u16())),
        Err(error) => return Err(format!("its slot actions: {error}")),
    }
    if memo.looking.swap(true, Ordering::AcqRel) {
        // The last look has not come back: what it last found stands.
        return memo
            .known()
            .as_ref()
            .map(|(_, fingerprint)| fingerprint.clone())
            .ok_or_else(|| format!("model file {model_path} is still being read"));
    }
    let (dir, flags, shared) = (slots.dir.clone(), normalized_flags(&slots.flags), Arc::clone(memo));
    let look = tokio::task::spawn_blocking(move || {
        let looked = look(&dir, model_path, build, flags, &shared);
        shared.looking.store(false, Ordering::Release);
        looked
    });
    match tokio::time::timeout(MODEL_READ_TIMEOUT, look).await {
        Ok(Ok(looked)) => looked,
        Ok(Err(_)) => Err("the model file's check stopped".into()),
        Err(_) => Err("the model file took over 10 s to read".into()),
    }
}

/// The slot directory and the model file, read on a blocking thread: the
/// fingerprint remembered while the file is unchanged, else made again.
fn look(dir: &Path, model_path: String, build: String, flags: String, memo: &Memo) -> Result<String, String> {
    if !std::fs::metadata(dir).is_ok_and(|m| m.is_dir()) {
        return Err(format!("slots.dir {} is not a directory here", dir.display()));
    }
    let unreadable = |error: std::io::Error| format!("model file {model_path} cannot be read here: {error}");
    let metadata = std::fs::metadata(&model_path).map_err(unreadable)?;
    let key = MemoKey { size: metadata.len(), modified: metadata.modified().ok(), model_path, build, flags };
    if let Some((known, fingerprint)) = &*memo.known()
        && *known == key
    {
        return Ok(fingerprint.clone());
    }
    let unreadable = |error: std::io::Error| format!("model file {} cannot be read here: {error}", key.model_path);
    let (head, tail) = read_ends(Path::new(&key.model_path)).map_err(unreadable)?;
    let fingerprint = fingerprint(&key, &head, &tail)?;
    *memo.known() = Some((key, fingerprint.clone()));
    Ok(fingerprint)
}

/// The fingerprint of a model file's ends, its size, the build and the
/// flags; an error for a sliding-window model without `--swa-full`, whose
/// restored slots reuse nothing.
fn fingerprint(key: &MemoKey, head: &[u8], tail: &[u8]) -> Result<String, String> {
    match gguf::window(head) {
        Ok(gguf::Window::Sliding(_)) if !key.flags.split(' ').any(|flag| flag == "--swa-full") => {
            return Err("a sliding-window model: run the server with --swa-full and list it in slots.flags".to_string());
        }
        Ok(_) => {}
        Err(error) => return Err(format!("model file header: {error}")),
    }
    let text = format!(
        "inferyes slot v1\n{}\n{}\n{}\n{}\n{}",
        key.size,
        inferyes_proto::bearer::sha256_hex(head),
        inferyes_proto::bearer::sha256_hex(tail),
        key.build,
        key.flags
    );
    Ok(inferyes_proto::bearer::sha256_hex(text.as_bytes())[..32].to_string())
}

/// The flags as one string, whatever the spacing they were written with.
fn normalized_flags(flags: &str) -> String {
    flags.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A file's first [`MODEL_HEAD_BYTES`] and last [`MODEL_TAIL_BYTES`]:
/// the header, the first tensors and the last, so that two fine-tunes of
/// one size and metadata differ.
fn read_ends(path: &Path) -> std::io::Result<(Vec<u8>, Vec<u8>)> {
    use std::io::{Read as _, Seek as _};
    let mut file = std::fs::File::open(path)?;
    let size = file.metadata()?.len();
    let mut head = Vec::new();
    (&mut file).take(MODEL_HEAD_BYTES).read_to_end(&mut head)?;
    file.seek(std::io::SeekFrom::Start(size.saturating_sub(MODEL_TAIL_BYTES)))?;
    let mut tail = Vec::new();
    file.take(MODEL_TAIL_BYTES).read_to_end(&mut tail)?;
    Ok((head, tail))
}

/// A slot as `/slots` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub id: u32,
    pub busy: bool,
    /// The last task it ran, if any.
    pub task: Option<u64>,
    /// Tokens its cache holds (the last prompt and reply), if it ran one.
    pub tokens: Option<u32>,
}

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
/// whatever stopped the reply). A slot of another length is another
/// conversation's, however close: one token more is the one whose cache
/// holds one more.
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
    let mut matching: Vec<&Slot> = slots
        .iter()
        .filter(|s| s.tokens.is_some_and(|n| u64::from(n) + 1 == u64::from(tokens)) && !gone.contains(s))
        .collect();
    let found = match matching.as_slice() {
        [] => return Err(NotFound::Gone),
        [one] => *one,
        several => {
            let mut order = twins.to_vec();
            order.sort_unstable();
            let plain = order.windows(2).all(|w| w[1].saturating_sub(w[0]) >= TWIN_GAP_MS);
            let rank = order.iter().position(|t| *t == began);
            if order.len() != several.len() || !plain || several.iter().any(|s| s.task.is_none()) {
                return Err(NotFound::Ambiguous);
            }
            matching.sort_by_key(|s| s.task);
            matching[rank.ok_or(NotFound::Ambiguous)?]
        }
    };
    if found.busy {
        return Err(NotFound::Busy);
    }
    Ok(found.id)
}

/// How far apart two conversations' last turns must have begun for the
/// proxy's order of them to be the server's.
pub const TWIN_GAP_MS: u64 = 20;

/// A slot restored into, and what `/slots` showed of it then: until it
/// runs a task, it shows no sign of what it holds, and must not be taken
/// for empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Restored {
    pub slot: Slot,
}

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
        assert_eq!(holding_slot(&slots, &[], 1140, &[5], 5), Err(NotFound::Gone), "one token less: another's");
        assert_eq!(holding_slot(&slots, &[], 1142, &[5], 5), Err(NotFound::Gone), "one token more: another's");
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
    fn a_sliding_window_model_moves_only_with_swa_full() {
        let mut head = b"GGUF".to_vec();
        head.extend(3u32.to_le_bytes());
        head.extend(0u64.to_le_bytes());
        head.extend(1u64.to_le_bytes());
        let key = b"gemma3.attention.sliding_window";
        head.extend((key.len() as u64).to_le_bytes());
        head.extend(key);
        head.extend(4u32.to_le_bytes());
        head.extend(512u32.to_le_bytes());
        let key = |flags: &str| MemoKey {
            model_path: "/m.gguf".into(),
            build: "b11434".into(),
            flags: normalized_flags(flags),
            size: 1,
            modified: None,
        };
        let tail = b"last tensors";
        assert!(fingerprint(&key("-fa on"), &head, tail).is_err_and(|e| e.contains("--swa-full")));
        let one = fingerprint(&key("--swa-full   -fa on"), &head, tail).expect("movable");
        assert_eq!(Ok(one.clone()), fingerprint(&key("--swa-full -fa on"), &head, tail), "spacing aside");
        assert_ne!(Ok(one.clone()), fingerprint(&key("--swa-full -fa off"), &head, tail), "the flags count");
        let other_build = MemoKey { build: "b9999".into(), ..key("--swa-full -fa on") };
        assert_ne!(Ok(one.clone()), fingerprint(&other_build, &head, tail), "the build counts");
        assert_ne!(Ok(one), fingerprint(&key("--swa-full -fa on"), &head, b"other tensors"), "the tail counts");
        assert!(fingerprint(&key("--swa-full"), b"not gguf", tail).is_err());
    }
}
