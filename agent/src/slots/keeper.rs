//! The KV tier's I/O: a conversation's slot is saved to its host's disk
//! when its turn ends, and restored into an idle slot when it comes back
//! and is in none, so that its cache outlives the slot, the server's host
//! cache and the server itself.
//!
//! A save runs off the request's path, one at a time per backend, and
//! keeps only the state its slot held when the turn ended: a slot already
//! running the next turn, or taken by another conversation, is left (the
//! server's answer says how many tokens it saved). A restore runs on the
//! returning turn's path, before it is sent: a `/slots` read, the restore
//! (milliseconds: a slot file is read at disk speed), then the turn, which
//! the server gives the restored slot, the idle one holding its prefix.
//! Saves and restores of one backend take its restore marks in turn, so a
//! save never reads a slot a restore is filling.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::holding_slot;
use super::transfer::{SlotFile, list_slots, open_saved, read_saved_tokens, restore_into_free_slot, slot_action};
use crate::state::{AgentState, BackendHandle};
use crate::tier::{FILE_PREFIX, Kept, Tier, is_slot_file_name, record_name, remove_files};

/// A returning turn waits no longer than this for its restore; past it,
/// it goes on without (the restore itself finishes, unseen by the turn).
pub const RESTORE_WAIT: Duration = Duration::from_secs(3);

/// The largest record of a kept state read at start, and the most records
/// read: what a directory filled by someone else can cost a start.
const MAX_RECORD_BYTES: u64 = 64 << 10;
const MAX_RECORDS: usize = 4 * crate::config::MAX_TIER_ENTRIES;

/// Rebuilds `backend`'s tier from its directory, then saves the turns
/// that end there, until `shutdown`.
pub async fn run(state: Arc<AgentState>, backend: usize, shutdown: CancellationToken) {
    let Some(handle) = state.backends.get(backend) else { return };
    let Some(tier) = &handle.tier else { return };
    let (dir, max) = (tier.dir.clone(), tier.max_slot_bytes);
    let found = tokio::select! {
        () = shutdown.cancelled() => return,
        found = tokio::task::spawn_blocking(move || rebuild(&dir, max)) => found.unwrap_or_default(),
    };
    let count = found.len();
    let now = inferyes_proto::unix_ms();
    for kept in found {
        let (key, model, tokens) = (kept.key.clone(), kept.model.clone(), kept.tokens);
        // One more than the slot holds, as a turn's usage says it.
        state.residency.lock().kept_from_before(&key, &handle.probe.id, &model, tokens.saturating_add(1), now);
        take_in(tier, &state, &handle.probe.id, kept, now);
    }
    if count > 0 {
        tracing::info!(backend = %handle.probe.id, states = count, "KV tier read from disk");
        state.changed.notify_one();
    }
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tier.turns_ended() => {}
        }
        while let Some(key) = tier.next_ended() {
            if shutdown.is_cancelled() {
                return;
            }
            let started = Instant::now();
            match save(&state, handle, tier, &key).await {
                Saved::Kept => {
                    tier.counts.saves.fetch_add(1, Ordering::Relaxed);
                    tier.counts.save_micros.fetch_add(micros(started), Ordering::Relaxed);
                    state.changed.notify_one();
                }
                Saved::Unneeded => {}
                Saved::Skipped(why) => {
                    tier.counts.saves_skipped.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(backend = %handle.probe.id, session = key, why, "turn's state not kept");
                }
            }
        }
    }
}

/// Takes `kept` into the index; where that gave up other states (or
/// `kept` itself), residency hears which left the tier, and their
/// files go. Whether `kept` is kept.
fn take_in(tier: &Tier, state: &AgentState, backend_id: &str, kept: Kept, now_ms: u64) -> bool {
    let (key, file) = (kept.key.clone(), kept.file.clone());
    let (gone, kept_now, still) = {
        let mut index = tier.index.lock();
        let gone = index.keep(kept, now_ms);
        let entry = index.get(&key);
        (gone, entry.is_some_and(|k| k.file == file), entry.is_some())
    };
    let evicted: Vec<&str> = gone.iter().filter(|g| g.key != key).map(|g| g.key.as_str()).collect();
    {
        let mut residency = state.residency.lock();
        if still {
            residency.kept_in_tier(&key, backend_id);
        } else {
            residency.left_tier(&key, backend_id);
        }
        evicted.iter().for_each(|lost| residency.left_tier(lost, backend_id));
    }
    tier.counts.evicted.fetch_add(u64::try_from(evicted.len()).unwrap_or(0), Ordering::Relaxed);
    remove_files(&tier.dir, gone);
    kept_now
}

/// Drops the states saved under another fingerprint than the server's
/// now (another build or KV cache flags since a restart): no restore
/// of them could hold.
fn drop_unlike(tier: &Tier, state: &AgentState, backend_id: &str, fingerprint: &str) {
    let unlike: Vec<Kept> = {
        let mut index = tier.index.lock();
        let keys: Vec<String> = index
            .keys()
            .filter(|k| index.get(k).is_some_and(|e| e.fingerprint != fingerprint))
            .map(str::to_string)
            .collect();
        keys.iter().filter_map(|k| index.remove(k)).collect()
    };
    if unlike.is_empty() {
        return;
    }
    let mut residency = state.residency.lock();
    unlike.iter().for_each(|gone| residency.left_tier(&gone.key, backend_id));
    drop(residency);
    remove_files(&tier.dir, unlike);
}

fn micros(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// What became of a turn's save.
enum Saved {
    Kept,
    /// Nothing to save: the conversation left, or its state is kept.
    Unneeded,
    Skipped(String),
}

/// Saves the slot holding `key`'s conversation as its turn left it.
async fn save(state: &AgentState, handle: &BackendHandle, tier: &Tier, key: &str) -> Saved {
    let backend_id = handle.probe.id.as_str();
    let session = state.residency.lock().session(key).filter(|s| s.backend_id == backend_id && s.tokens > 0);
    let Some(session) = session else { return Saved::Unneeded };
    let fingerprint = {
        let observations = state.observations.lock();
        observations.backends.iter().find(|b| b.id == backend_id).map(|b| b.slot_fingerprint.clone())
    }
    .unwrap_or_default();
    if fingerprint.is_empty() {
        return Saved::Skipped("the server's slots cannot be saved now".into());
    }
    drop_unlike(tier, state, backend_id, &fingerprint);
    let already = tier.index.lock().get(key).is_some_and(|k| u64::from(k.tokens) + 1 == u64::from(session.tokens));
    if already {
        return Saved::Unneeded;
    }
    let (dir, min_free) = (tier.dir.clone(), tier.min_free_bytes);
    let room = tokio::task::spawn_blocking(move || free_bytes(&dir).is_ok_and(|free| free >= min_free)).await;
    if !room.unwrap_or(false) {
        return Saved::Skipped(format!("under {} bytes free on the slot directory's filesystem", tier.min_free_bytes));
    }
    let Ok(random) = inferyes_proto::apikey::random_chars(24) else {
        return Saved::Skipped("no randomness for a file name".into());
    };
    let file = format!("{FILE_PREFIX}{random}.bin");
    let expected = match save_slot(state, handle, tier, &session, &file).await {
        Ok(expected) => expected,
        Err(why) => return Saved::Skipped(why),
    };
    let now = inferyes_proto::unix_ms();
    let mut kept = Kept {
        key: key.to_string(),
        model: session.model.clone(),
        fingerprint,
        tokens: expected,
        bytes: 0,
        digest: String::new(),
        file,
        saved_unix_ms: now,
        used_unix_ms: now,
        turns: session.requests,
    };
    let path = tier.dir.join(&kept.file);
    let (dir, max, min_free) = (tier.dir.clone(), tier.max_slot_bytes, tier.min_free_bytes);
    let sealed = tokio::task::spawn_blocking(move || {
        let result = seal(&dir, &mut kept, max, min_free).map(|()| kept);
        if result.is_err() {
            let _ = std::fs::remove_file(&path);
        }
        result
    })
    .await;
    let kept = match sealed {
        Ok(Ok(kept)) => kept,
        Ok(Err(why)) => return Saved::Skipped(why),
        Err(e) => return Saved::Skipped(e.to_string()),
    };
    // Moved away while it was saved: not kept here.
    let here = state.residency.lock().backend_of(key) == Some(backend_id);
    if !here {
        remove_files(&tier.dir, vec![kept]);
        return Saved::Unneeded;
    }
    if take_in(tier, state, backend_id, kept, now) {
        Saved::Kept
    } else {
        Saved::Skipped("worth less than what it would displace".into())
    }
}

/// Has the server save the slot holding `session` to `file`, holding the
/// backend's restore marks (no restore fills a slot meanwhile): the tokens
/// saved. A save the server did not answer in time leaves its file to be
/// removed once written.
async fn save_slot(
    state: &AgentState,
    handle: &BackendHandle,
    tier: &Tier,
    session: &inferyes_proto::v1::ResidentSession,
    file: &str,
) -> Result<u32, String> {
    let (url, api_key) = (handle.probe.url.as_str(), handle.probe.api_key.as_str());
    let marks = handle.restore_marks.lock().await;
    let listed = list_slots(&tier.client, url, api_key).await.map_err(|e| e.to_string())?;
    // Conversations of as many tokens that may be in a slot: those past
    // the slots (in the host cache, or parked) are not. A slot taken for
    // another's of the same length costs only its reuse: a server reuses
    // a cached token only where the prompt's own token is the same.
    let twins = state.residency.lock().twins_in_slots(session);
    let slot =
        holding_slot(&listed, &[], session.tokens, &twins, session.last_seen_unix_ms).map_err(|e| e.to_string())?;
    // A slot restored into and not run since (its mark still what `/slots`
    // shows of it) shows nothing of what it holds.
    if marks.iter().any(|r| r.slot.id == slot && listed.contains(&r.slot)) {
        return Err("its slot was restored into since".into());
    }
    let expected = listed.iter().find(|s| s.id == slot).and_then(|s| s.tokens).unwrap_or(0);
    let saved = slot_action(&tier.client, url, api_key, slot, "save", file).await;
    drop(marks);
    let n_saved = saved.as_ref().ok().and_then(|a| a.pointer("/n_saved")).and_then(serde_json::Value::as_u64);
    if n_saved == Some(u64::from(expected)) {
        return Ok(expected);
    }
    // Removed now, or once the server writes it.
    drop(SlotFile(tier.dir.join(file)));
    Err(match saved {
        Err(why) => format!("save: {why}"),
        Ok(_) => format!("saved {n_saved:?} tokens, the slot held {expected} (taken since)"),
    })
}

/// Free bytes on `dir`'s filesystem.
fn free_bytes(dir: &Path) -> Result<u64, String> {
    let stat = rustix::fs::statvfs(dir).map_err(|e| e.to_string())?;
    Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
}

/// Checks a state the server just saved into `dir` and writes its record:
/// its bytes and digest filled in, both files on disk before the record
/// is named (a crash leaves at worst a state with no record, removed at
/// the next start).
fn seal(dir: &Path, kept: &mut Kept, max_slot_bytes: u64, min_free_bytes: u64) -> Result<(), String> {
    let path = dir.join(&kept.file);
    let (file, bytes, digest) = open_saved(&path, max_slot_bytes)?;
    file.sync_all().map_err(|e| e.to_string())?;
    if free_bytes(dir)? < min_free_bytes {
        return Err(format!("under {min_free_bytes} bytes free on the slot directory's filesystem"));
    }
    kept.bytes = bytes;
    kept.digest = digest;
    let record = serde_json::to_vec(&kept).map_err(|e| e.to_string())?;
    let name = kept.record_name();
    let unnamed = dir.join(format!("{name}.new"));
    let written = (|| {
        use std::io::Write as _;
        let mut out = std::fs::OpenOptions::new().write(true).create_new(true).open(&unnamed)?;
        out.write_all(&record)?;
        out.sync_all()?;
        std::fs::rename(&unnamed, dir.join(&name))
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&unnamed);
        return Err(format!("its record: {e}"));
    }
    Ok(())
}

/// Whether `name` is one of the files the tier writes: a slot file, its
/// record, or a record being written.
fn is_tier_file(name: &str) -> bool {
    [".bin", ".json", ".json.new"]
        .iter()
        .any(|suffix| name.strip_suffix(suffix).is_some_and(|stem| is_slot_file_name(&format!("{stem}.bin"))))
}

/// The states kept in `dir` by an earlier run, each checked against its
/// record (its file's length and digest). Everything else of the tier's
/// there goes: records that do not check out and their files, files no
/// record names, records half-written, and all but the newest state of a
/// conversation. Files of other names are left be.
pub fn rebuild(dir: &Path, max_slot_bytes: u64) -> Vec<Kept> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let names: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|name| is_tier_file(name))
        .take(2 * MAX_RECORDS)
        .collect();
    let mut found: inferyes_proto::FastMap<String, Kept> = Default::default();
    for name in names.iter().filter(|n| n.ends_with(".json")).take(MAX_RECORDS) {
        let Some(kept) = read_record(dir, name, max_slot_bytes) else { continue };
        match found.get(&kept.key) {
            Some(other) if other.saved_unix_ms >= kept.saved_unix_ms => continue,
            _ => {}
        }
        found.insert(kept.key.clone(), kept);
    }
    let wanted: std::collections::HashSet<String> =
        found.values().flat_map(|kept| [kept.file.clone(), kept.record_name()]).collect();
    for name in &names {
        if !wanted.contains(name) {
            let _ = std::fs::remove_file(dir.join(name));
        }
    }
    let mut kept: Vec<Kept> = found.into_values().collect();
    // Oldest first: the index gives up the least worth as it fills.
    kept.sort_by_key(|k| (k.used_unix_ms, k.key.clone()));
    kept
}

/// The record `name` in `dir`, where it is sound and its file is whole.
fn read_record(dir: &Path, name: &str, max_slot_bytes: u64) -> Option<Kept> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    // Never through a link, never blocking on what is not a file.
    let record = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(dir.join(name))
        .ok()?;
    if !record.metadata().ok()?.is_file() {
        return None;
    }
    let mut text = Vec::new();
    record.take(MAX_RECORD_BYTES).read_to_end(&mut text).ok()?;
    let kept: Kept = serde_json::from_slice(&text).ok()?;
    if !kept.is_sound() || record_name(&kept.file) != name {
        return None;
    }
    let (mut file, bytes, digest) = open_saved(&dir.join(&kept.file), max_slot_bytes).ok()?;
    // A slot file begins as llama-server writes one.
    let mut magic = [0u8; 4];
    file.read_exact(&mut magic).ok()?;
    (bytes == kept.bytes && digest == kept.digest && &magic == b"qsgg").then_some(kept)
}

/// Before a turn of `key` is sent to the backend at `index`: where the
/// conversation is not believed in its server's slots or host cache and
/// the tier keeps its state, that state is restored into an idle slot.
/// Whether it was, within [`RESTORE_WAIT`].
pub async fn bring_back(state: &Arc<AgentState>, index: usize, key: &str, model: &str) -> bool {
    let Some(handle) = state.backends.get(index) else { return false };
    let Some(tier) = &handle.tier else { return false };
    let backend_id = handle.probe.id.as_str();
    {
        let residency = state.residency.lock();
        // Believed in a slot or the host cache here: the server has it.
        if residency.backend_of(key) == Some(backend_id) && !residency.parked(key) {
            return false;
        }
    }
    let Some(kept) = tier.index.lock().get(key).cloned() else { return false };
    let fingerprint = {
        let observations = state.observations.lock();
        observations.backends.iter().find(|b| b.id == backend_id).map(|b| handle.slot_fingerprint(b))
    };
    if fingerprint.as_deref() != Some(kept.fingerprint.as_str()) {
        return false;
    }
    let started = Instant::now();
    // Its own task: a restore cut off half-way would leave a slot the
    // server fills unmarked.
    let (state, model) = (Arc::clone(state), model.to_string());
    let restoring = tokio::spawn(async move { restore(&state, index, &kept, &model).await });
    let outcome = tokio::time::timeout(RESTORE_WAIT, restoring).await;
    match outcome {
        Ok(Ok(Ok(Restore::Done))) => {
            tier.counts.restores.fetch_add(1, Ordering::Relaxed);
            tier.counts.restore_micros.fetch_add(micros(started), Ordering::Relaxed);
            true
        }
        Ok(Ok(Ok(Restore::InASlot))) => false,
        outcome => {
            let why = match outcome {
                Ok(Ok(Err(why))) => why,
                Ok(Err(e)) => e.to_string(),
                _ => "timed out".to_string(),
            };
            tier.counts.restores_failed.fetch_add(1, Ordering::Relaxed);
            tracing::info!(backend = backend_id, session = key, why, "KV tier state not restored: the turn recomputes");
            false
        }
    }
}

/// What a restore from the tier came to.
enum Restore {
    Done,
    /// A slot holds the state already: nothing to restore.
    InASlot,
}

/// Restores `kept` into an idle slot of the backend at `index`, unless a
/// slot holds it already.
async fn restore(state: &AgentState, index: usize, kept: &Kept, model: &str) -> Result<Restore, String> {
    let handle = state.backends.get(index).ok_or("no such backend")?;
    let tier = handle.tier.as_ref().ok_or("no tier")?;
    let (url, api_key) = (handle.probe.url.as_str(), handle.probe.api_key.as_str());
    let listed = list_slots(&tier.client, url, api_key).await.map_err(|e| e.to_string())?;
    // A slot of its length holds it still (the agent restarted, its server
    // did not), unless a conversation of as many tokens believed in a slot
    // is what it holds.
    let twin_in_slot = || {
        let residency = state.residency.lock();
        let twin =
            |s: &inferyes_proto::v1::ResidentSession| s.key != kept.key && s.tokens == kept.tokens.saturating_add(1);
        residency.in_slots(&handle.probe.id).any(twin)
    };
    if listed.iter().any(|s| s.tokens == Some(kept.tokens)) && !twin_in_slot() {
        return Ok(Restore::InASlot);
    }
    let (slot, _) = restore_into_free_slot(&tier.client, state, handle, &kept.file, kept.tokens)
        .await
        .map_err(|e| format!("{} ({})", e, e.code()))?;
    let saved = read_saved_tokens(&tier.dir.join(&kept.file), kept.tokens).await;
    let now = inferyes_proto::unix_ms();
    tier.index.lock().used(&kept.key, now);
    state.residency.lock().restored(&kept.key, &handle.probe.id, model, (kept.tokens, saved), now);
    state.changed.notify_one();
    tracing::debug!(backend = %handle.probe.id, session = kept.key, slot, tokens = kept.tokens, "restored from the KV tier");
    Ok(Restore::Done)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes a state of `body` and, unless `record` is false, its record;
    /// the record.
    fn state(dir: &Path, name: &str, key: &str, saved: u64, body: &[u8], record: bool) -> Kept {
        std::fs::write(dir.join(format!("kv-{name}.bin")), body).unwrap();
        let kept = Kept {
            key: key.into(),
            model: "m".into(),
            fingerprint: "f".into(),
            tokens: 3,
            bytes: body.len() as u64,
            digest: inferyes_proto::hex(ring::digest::digest(&ring::digest::SHA256, body).as_ref()),
            file: format!("kv-{name}.bin"),
            saved_unix_ms: saved,
            used_unix_ms: saved,
            turns: 1,
        };
        if record {
            std::fs::write(dir.join(kept.record_name()), serde_json::to_vec(&kept).unwrap()).unwrap();
        }
        kept
    }

    #[test]
    fn a_tier_is_rebuilt_from_whole_states_only_and_the_rest_of_its_files_go() {
        let dir = std::env::temp_dir().join(format!("inferyes-tier-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let good = state(&dir, "good", "a", 5, b"qsgg good state", true);
        let older = state(&dir, "older", "a", 4, b"qsgg older state", true);
        let newest_b = state(&dir, "b2", "b", 9, b"qsgg b", true);
        let _ = state(&dir, "b1", "b", 8, b"qsgg b before", true);
        // Changed after its record was written; not a slot file; no record.
        let changed = state(&dir, "changed", "c", 5, b"qsgg changed", true);
        std::fs::write(dir.join(&changed.file), b"qsgg chanGed").unwrap();
        let foreign = state(&dir, "foreign", "d", 5, b"#!/bin/sh", true);
        let orphan = state(&dir, "orphan", "e", 5, b"qsgg orphan", false);
        std::fs::write(dir.join("kv-half.json.new"), b"{").unwrap();
        std::fs::write(dir.join("kv-bad.json"), b"not json").unwrap();
        std::fs::write(dir.join("someone-else.bin"), b"kept").unwrap();
        std::fs::write(dir.join("kv-notes"), b"an operator's").unwrap();
        let mut found = rebuild(&dir, 1 << 20);
        found.sort_by(|a, b| a.key.cmp(&b.key));
        assert_eq!(found, [good.clone(), newest_b.clone()]);
        let mut left: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        let mut expected = vec![
            good.file.clone(),
            good.record_name(),
            newest_b.file.clone(),
            newest_b.record_name(),
            "kv-notes".to_string(),
            "someone-else.bin".to_string(),
        ];
        expected.sort();
        assert_eq!(left, expected);
        for gone in [&older, &changed, &foreign, &orphan] {
            assert!(!dir.join(&gone.file).exists(), "{}", gone.file);
        }
        // Past the largest slot file: refused too.
        assert!(rebuild(&dir, 4).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
