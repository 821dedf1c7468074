//! Whether a llama-server's slots can move to another's, and with which:
//! its slot fingerprint, a hash of what a saved slot depends on (the model
//! file, the llama.cpp build, the declared KV cache flags), read with the
//! backend's other facts each poll.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

use super::ProbeClient;
use super::gguf;
use crate::config::SlotsConfig;

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

#[cfg(test)]
mod tests {
    use super::*;

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
