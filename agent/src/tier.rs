//! A backend's KV tier: which conversations' slot states it keeps on its
//! host's disk, which to give up when it is full (`Index`, pure: no I/O,
//! no clocks), and what the tier did. `slots::keeper` saves into it and
//! restores from it.
//!
//! Each kept state is two files in the backend's `--slot-save-path`: the
//! server's own slot file (`kv-<random>.bin`) and a record of it
//! (`kv-<random>.json`, a [`Kept`]), written after the slot file is whole,
//! so that a record names only a file that was. A record whose file is not
//! there, not its length or not its digest is refused at start, and both
//! go.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use inferyes_proto::FastMap;

use crate::probe::ProbeClient;
use crate::shared::Shared;

/// What every file of the tier is named from; unlike moves' files
/// (`inferyes-`), the sweep of left-over files leaves them be.
pub const FILE_PREFIX: &str = "kv-";

/// How long after its last use a kept state is worth half as much.
pub const HALF_VALUE_MS: u64 = 10 * 60 * 1000;

/// One conversation's saved slot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Kept {
    /// The conversation's session key.
    pub key: String,
    pub model: String,
    /// The backend's slot fingerprint when it saved it: restored only
    /// into a server alike (model file, build, KV cache flags).
    pub fingerprint: String,
    /// Tokens the state holds (the server's `n_saved`).
    pub tokens: u32,
    pub bytes: u64,
    /// SHA-256 of the slot file, in hex.
    pub digest: String,
    /// The slot file's name in the backend's slot directory.
    pub file: String,
    pub saved_unix_ms: u64,
    pub used_unix_ms: u64,
    /// Turns of the conversation seen when it was saved: one that came
    /// back often is likelier to come back again.
    pub turns: u32,
}

impl Kept {
    /// The name of the record of it: its slot file's, as `.json`.
    pub fn record_name(&self) -> String {
        record_name(&self.file)
    }

    /// What keeping it is worth, per byte of disk: the prefill it saves
    /// (its tokens) times how likely it is to be used again (more turns
    /// before, less time since), over its bytes.
    pub fn value(&self, now_ms: u64) -> f64 {
        let idle = now_ms.saturating_sub(self.used_unix_ms) as f64;
        let returns = f64::from(self.turns.clamp(1, 8)) / 8.0;
        let likely = returns * HALF_VALUE_MS as f64 / (HALF_VALUE_MS as f64 + idle);
        f64::from(self.tokens) * likely / self.bytes.max(1) as f64
    }

    /// Whether a record read from disk says something the tier can use:
    /// a file name of its own, a digest, tokens and bytes.
    pub fn is_sound(&self) -> bool {
        is_slot_file_name(&self.file)
            && self.digest.len() == 64
            && self.digest.bytes().all(|b| b.is_ascii_hexdigit())
            && self.tokens > 0
            && self.bytes > 0
            && !self.key.is_empty()
            && self.key.len() <= inferyes_proto::headers::MAX_SESSION_KEY_BYTES
            && !self.fingerprint.is_empty()
    }
}

/// Whether `name` is a slot file of the tier's: `kv-<letters and digits>.bin`.
pub fn is_slot_file_name(name: &str) -> bool {
    name.strip_prefix(FILE_PREFIX)
        .and_then(|rest| rest.strip_suffix(".bin"))
        .is_some_and(|random| !random.is_empty() && random.bytes().all(|b| b.is_ascii_alphanumeric()))
}

/// The record's name for the slot file `file`.
pub fn record_name(file: &str) -> String {
    format!("{}.json", file.strip_suffix(".bin").unwrap_or(file))
}

/// The limits a backend's tier keeps to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    pub max_bytes: u64,
    pub max_entries: usize,
}

/// A backend's kept states, by conversation.
#[derive(Clone, Debug)]
pub struct Index {
    entries: FastMap<String, Kept>,
    bytes: u64,
    bounds: Bounds,
}

impl Index {
    pub fn new(bounds: Bounds) -> Index {
        Index { entries: FastMap::default(), bytes: 0, bounds }
    }

    pub fn get(&self, key: &str) -> Option<&Kept> {
        self.entries.get(key)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Keeps `kept` in place of what its conversation had kept before,
    /// giving up, to stay within the bounds, the states worth least, each
    /// worth less than `kept`. Returns what is no longer kept, whose files
    /// the caller removes: the state replaced and those given up; or, where
    /// `kept` does not fit (past the bounds alone, or only by giving up a
    /// state worth as much), `kept` alone, and nothing kept changes.
    #[must_use = "the files of what is no longer kept must be removed"]
    pub fn keep(&mut self, kept: Kept, now_ms: u64) -> Vec<Kept> {
        if kept.bytes > self.bounds.max_bytes || self.bounds.max_entries == 0 {
            return vec![kept];
        }
        let replaced = self.entries.get(&kept.key).map(|k| k.bytes);
        let mut bytes = self.bytes.saturating_sub(replaced.unwrap_or(0)).saturating_add(kept.bytes);
        let mut count = self.entries.len() + usize::from(replaced.is_none());
        let worth = kept.value(now_ms);
        let mut others: Vec<(f64, &Kept)> =
            self.entries.values().filter(|k| k.key != kept.key).map(|k| (k.value(now_ms), k)).collect();
        others.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.key.cmp(&b.1.key)));
        let mut given_up = Vec::new();
        for (value, other) in others {
            if bytes <= self.bounds.max_bytes && count <= self.bounds.max_entries {
                break;
            }
            if value >= worth {
                return vec![kept];
            }
            bytes = bytes.saturating_sub(other.bytes);
            count -= 1;
            given_up.push(other.key.clone());
        }
        let mut gone: Vec<Kept> = self.remove(&kept.key).into_iter().collect();
        gone.extend(given_up.iter().filter_map(|key| self.remove(key)));
        self.bytes = self.bytes.saturating_add(kept.bytes);
        self.entries.insert(kept.key.clone(), kept);
        gone
    }

    /// A conversation's kept state was restored: it is worth more now.
    pub fn used(&mut self, key: &str, now_ms: u64) {
        if let Some(kept) = self.entries.get_mut(key) {
            kept.used_unix_ms = kept.used_unix_ms.max(now_ms);
        }
    }

    /// Takes a conversation's kept state out (its files are the caller's
    /// to remove).
    pub fn remove(&mut self, key: &str) -> Option<Kept> {
        let kept = self.entries.remove(key)?;
        self.bytes = self.bytes.saturating_sub(kept.bytes);
        Some(kept)
    }

    /// Every conversation kept.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }
}

/// Turns ended and not yet saved, at most: past this, a burst's saves are
/// left to the next turns.
const MAX_PENDING: usize = 4096;

/// A save of an idle slot takes milliseconds; one the server defers (its
/// slot taken meanwhile) is given up after this, and its file removed
/// once the server writes it.
pub const SAVE_WAIT: Duration = Duration::from_secs(10);

/// Removes the files of states no longer kept, off the runtime.
pub fn remove_files(dir: &Path, gone: Vec<Kept>) {
    if gone.is_empty() {
        return;
    }
    let dir = dir.to_path_buf();
    let remove = move || {
        for kept in gone {
            let _ = std::fs::remove_file(dir.join(kept.record_name()));
            let _ = std::fs::remove_file(dir.join(&kept.file));
        }
    };
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn_blocking(remove)),
        Err(_) => remove(),
    }
}

/// One backend's KV tier.
pub struct Tier {
    /// The backend's `--slot-save-path`, where the server writes and reads
    /// the states.
    pub dir: PathBuf,
    pub index: Shared<Index>,
    /// Conversations whose turns ended here, to be saved, oldest first.
    pending: Shared<VecDeque<String>>,
    ended: Notify,
    /// Free space a state saved leaves on the directory's filesystem.
    pub min_free_bytes: u64,
    pub max_slot_bytes: u64,
    /// To the server, for saves.
    pub client: ProbeClient,
    pub counts: Counts,
}

/// What a tier did, since the agent started.
#[derive(Default)]
pub struct Counts {
    pub saves: AtomicU64,
    /// Turns whose states were not kept: the slot was busy or taken, the
    /// save failed, the disk was full, or it was worth too little.
    pub saves_skipped: AtomicU64,
    pub save_micros: AtomicU64,
    pub restores: AtomicU64,
    /// Restores that failed or timed out: the turn recomputed.
    pub restores_failed: AtomicU64,
    pub restore_micros: AtomicU64,
    /// States given up to keep within the tier's bounds.
    pub evicted: AtomicU64,
}

impl Tier {
    pub fn new(dir: PathBuf, bounds: Bounds, min_free_bytes: u64, max_slot_bytes: u64) -> Tier {
        Tier {
            dir,
            index: Shared::new(Index::new(bounds)),
            pending: Shared::default(),
            ended: Notify::new(),
            min_free_bytes,
            max_slot_bytes,
            client: ProbeClient::new(SAVE_WAIT),
            counts: Counts::default(),
        }
    }

    /// A turn of `key` ended on this tier's backend: its slot is saved.
    pub fn turn_ended(&self, key: &str) {
        let mut pending = self.pending.lock();
        if pending.len() >= MAX_PENDING || pending.iter().any(|k| k == key) {
            return;
        }
        pending.push_back(key.to_string());
        drop(pending);
        self.ended.notify_one();
    }

    /// The oldest conversation whose turn ended and is not yet saved.
    pub fn next_ended(&self) -> Option<String> {
        self.pending.lock().pop_front()
    }

    /// Until a turn ends (at once, where one ended since the last call).
    pub async fn turns_ended(&self) {
        self.ended.notified().await;
    }

    /// What it keeps and did, as reported and scraped.
    pub fn report(&self) -> inferyes_proto::v1::KvTier {
        let (bytes, states) = {
            let index = self.index.lock();
            (index.bytes(), u32::try_from(index.len()).unwrap_or(u32::MAX))
        };
        let read = |count: &AtomicU64| count.load(Ordering::Relaxed);
        let counts = &self.counts;
        inferyes_proto::v1::KvTier {
            bytes,
            states,
            saves: read(&counts.saves),
            skipped: read(&counts.saves_skipped),
            restores: read(&counts.restores),
            restore_failures: read(&counts.restores_failed),
            evicted: read(&counts.evicted),
            save_micros: read(&counts.save_micros),
            restore_micros: read(&counts.restore_micros),
        }
    }

    /// `key`'s state is no longer wanted here (its conversation moved to
    /// another node): its files go, and a save of it under way is not
    /// kept (it finds the conversation no longer resident here).
    pub fn forget(&self, key: &str) {
        let gone = self.index.lock().remove(key);
        remove_files(&self.dir, gone.into_iter().collect());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(key: &str, tokens: u32, bytes: u64, used: u64, turns: u32) -> Kept {
        Kept {
            key: key.into(),
            model: "m".into(),
            fingerprint: "f".into(),
            tokens,
            bytes,
            digest: "ab".repeat(32),
            file: format!("kv-{key}.bin"),
            saved_unix_ms: used,
            used_unix_ms: used,
            turns,
        }
    }

    #[test]
    fn a_full_tier_gives_up_what_saves_least_prefill_per_byte_and_is_least_likely_back() {
        let bounds = Bounds { max_bytes: 300, max_entries: 10 };
        let mut index = Index::new(bounds);
        let (minute, now) = (60_000, 30 * 60_000);
        assert!(index.keep(kept("old", 100, 100, 0, 3), 0).is_empty());
        assert!(index.keep(kept("once", 100, 100, 20 * minute, 1), 20 * minute).is_empty());
        assert!(index.keep(kept("often", 100, 100, 20 * minute, 8), 20 * minute).is_empty());
        // Of the same age and size, the conversation seen once goes before
        // the one seen often; then the one unused for half an hour, though
        // seen three times.
        let gone: Vec<String> = index.keep(kept("new", 100, 100, now, 1), now).into_iter().map(|k| k.key).collect();
        assert_eq!(gone, ["once"]);
        let gone: Vec<String> = index.keep(kept("new2", 100, 100, now, 1), now).into_iter().map(|k| k.key).collect();
        assert_eq!(gone, ["old"]);
        assert_eq!(index.bytes(), 300);
        // More tokens in the same bytes save more prefill.
        let gone: Vec<String> = index.keep(kept("dense", 400, 100, now, 1), now).into_iter().map(|k| k.key).collect();
        assert_eq!(gone.len(), 1);
        assert!(index.get("dense").is_some());
        assert!(index.get("often").is_some(), "eight turns ten minutes ago outweigh one just now");
        // Worth less than any it would displace: not kept, nothing given up.
        let before: Vec<String> = {
            let mut keys: Vec<String> = index.keys().map(str::to_string).collect();
            keys.sort();
            keys
        };
        let cheap = kept("cheap", 10, 100, now, 1);
        assert_eq!(index.keep(cheap.clone(), now), vec![cheap]);
        let mut after: Vec<String> = index.keys().map(str::to_string).collect();
        after.sort();
        assert_eq!((after, index.bytes()), (before, 300));
    }

    #[test]
    fn a_new_state_replaces_its_conversation_s_last_and_one_too_large_is_never_kept() {
        let mut index = Index::new(Bounds { max_bytes: 250, max_entries: 2 });
        assert!(index.keep(kept("a", 10, 100, 0, 1), 0).is_empty());
        let mut later = kept("a", 20, 150, 5, 2);
        later.file = "kv-a2.bin".into();
        let gone = index.keep(later.clone(), 5);
        assert_eq!(gone.iter().map(|k| k.file.as_str()).collect::<Vec<_>>(), ["kv-a.bin"]);
        assert_eq!((index.len(), index.bytes()), (1, 150));
        let huge = kept("b", 10, 251, 5, 1);
        assert_eq!(index.keep(huge.clone(), 5), vec![huge]);
        assert_eq!(index.get("a"), Some(&later));
        // Past the count: the least worth goes, whatever the bytes.
        assert!(index.keep(kept("c", 10, 10, 5, 1), 5).is_empty());
        let gone = index.keep(kept("d", 10, 10, 5, 8), 5);
        assert_eq!(gone.iter().map(|k| k.key.as_str()).collect::<Vec<_>>(), ["a"]);
        assert_eq!((index.len(), index.bytes()), (2, 20));
    }

    #[test]
    fn only_records_of_the_tier_s_own_files_with_a_digest_and_a_size_are_sound() {
        let good = kept("a", 10, 100, 0, 1);
        assert!(good.is_sound());
        assert_eq!(good.record_name(), "kv-a.json");
        for bad in [
            Kept { file: "../etc/passwd".into(), ..good.clone() },
            Kept { file: "kv-.bin".into(), ..good.clone() },
            Kept { file: "kv-a/b.bin".into(), ..good.clone() },
            Kept { file: "inferyes-in-a.bin".into(), ..good.clone() },
            Kept { digest: "zz".repeat(32), ..good.clone() },
            Kept { tokens: 0, ..good.clone() },
            Kept { bytes: 0, ..good.clone() },
            Kept { key: String::new(), ..good.clone() },
            Kept { fingerprint: String::new(), ..good.clone() },
        ] {
            assert!(!bad.is_sound(), "{bad:?}");
        }
    }
}
