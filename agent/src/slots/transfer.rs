//! A slot's journey between two agents. The sending agent has its server
//! save the conversation's slot to a file, and PUTs the file to the
//! receiving agent's proxy (`/_inferyes/slots`), with a credential made
//! from the grant its controller gave it for that node; the receiving
//! agent makes the grant again with the intake key its controller issued
//! it, and checks the credential, the sender's address, the backend's
//! fingerprint and the file's size and hash,
//! has its server restore the file into a free slot, and records the
//! conversation as resident. Both files are removed whatever happens. The
//! servers' own slot endpoints are never reachable through the proxy.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use inferyes_proto::ErrorKind;
use inferyes_proto::v1::{ModelState, MoveTarget, ResidentSession};
use serde_json::Value;

use super::{NotFound, Restored, Slot, free_slot, holding_slot, parse_slots};
use crate::probe::ProbeClient;
use crate::state::{AgentState, BackendHandle};

/// The receiving agent's path, on its proxy's port. Data planes forward
/// only the kinds' paths, so no client reaches it through them.
pub const INTAKE_PATH: &str = "/_inferyes/slots";

pub use inferyes_proto::headers::{CARRY_PATH, MOVE_TO, MOVE_TO_BACKEND};

pub const SLOT_FINGERPRINT: HeaderName = HeaderName::from_static("x-inferyes-slot-fingerprint");

pub const MOVE_FROM: HeaderName = HeaderName::from_static("x-inferyes-move-from");
pub const MOVE_FROM_HOST: HeaderName = HeaderName::from_static("x-inferyes-move-from-host");
pub const MOVE_EXPIRES: HeaderName = HeaderName::from_static("x-inferyes-move-expires");
pub const MOVE_GRANT_EXPIRES: HeaderName = HeaderName::from_static("x-inferyes-move-grant-expires");
pub const SLOT_SHA256: HeaderName = HeaderName::from_static("x-inferyes-slot-sha256");
pub const SLOT_TOKENS: HeaderName = HeaderName::from_static("x-inferyes-slot-tokens");

/// The furthest ahead a credential's expiry may be.
const MAX_CREDENTIAL_MS: u64 = 10 * 60 * 1000;
/// The furthest ahead a grant's expiry may be: two renewal periods, and a
/// minute for the controller's clock being ahead of this node's.
const MAX_GRANT_MS: u64 = 2 * inferyes_proto::bearer::MOVE_GRANT_RENEW_MS + 60_000;
/// The most tokens a restored slot may hold for its next turn to be judged
/// (4 MiB of them, read from the file's head).
const MAX_JUDGED_TOKENS: u32 = 1 << 20;
/// A sender's host name that takes longer to look up is not believed.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a credential the sender makes is good for: longer than any one
/// file's transfer.
const CREDENTIAL_MS: u64 = 5 * 60 * 1000;
/// Credentials remembered as taken, until they expire: one is taken once.
const MAX_REMEMBERED_CREDENTIALS: usize = 4096;
/// A slot file that takes longer to arrive holds an intake permit no more.
const RECEIVE_TIMEOUT: Duration = Duration::from_secs(10 * 60);
/// A slot file none of whose bytes came for this long is given up.
const RECEIVE_IDLE: Duration = Duration::from_secs(30);
/// A carry given up past this (its save, the file's transfer, which the
/// target holds to [`RECEIVE_TIMEOUT`], and the answer): a slow or silent
/// target holds a carry permit no longer.
const CARRY_TIMEOUT: Duration = RECEIVE_TIMEOUT.saturating_add(SLOT_ACTION_TIMEOUT.saturating_mul(2));
/// A save or a restore waits for its slot to be idle; no longer than this.
pub const SLOT_ACTION_TIMEOUT: Duration = Duration::from_secs(60);

/// The receiving side, one per agent: its checks and bounds.
pub struct Intake {
    pub state: Arc<AgentState>,
    /// The proxy port's connections: a sender whose move checks out is a
    /// fleet member's, never counted among strangers.
    pub admission: Arc<inferyes_net::admit::Admission>,
    pub max_slot_bytes: u64,
    /// Free space left on a slot directory's filesystem by a file taken.
    pub min_free_bytes: u64,
    /// Slot files taken at once.
    pub permits: tokio::sync::Semaphore,
    /// The lengths of the slot files being taken now, whose bytes the
    /// filesystem's free space does not show yet.
    pub arriving: std::sync::atomic::AtomicU64,
    pub client: ProbeClient,
    pub metrics: crate::metrics::SlotMetrics,
    /// Credentials taken, with their expiry.
    pub used: std::sync::Mutex<std::collections::VecDeque<(String, u64)>>,
}

/// A move's credential that checked out, not yet taken: the host its
/// grant names the sender at, the credential and its expiry.
struct Made<'h> {
    from_host: &'h str,
    presented: &'h [u8],
    expires: u64,
}

/// Why a slot was not taken: the status, its OpenAI-shaped error and code.
#[derive(Debug)]
pub struct Refused {
    kind: ErrorKind,
    message: String,
    code: &'static str,
}

fn refused(kind: ErrorKind, message: impl Into<String>, code: &'static str) -> Refused {
    Refused { kind, message: message.into(), code }
}

impl Refused {
    /// Its machine-readable reason.
    pub fn code(&self) -> &'static str {
        self.code
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.kind.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = inferyes_proto::openai_error_body(self.kind, &self.message, Some(self.code), None);
        (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
    }
}

/// What the receiving agent answers a slot it took.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Taken {
    pub slot: u32,
    pub n_restored: u32,
    pub restore_ms: f64,
    pub bytes: u64,
}

/// A file in a slot directory, removed when this is dropped; and, where it
/// is not there yet (a save llama-server deferred past our wait), once the
/// server has had time to write it.
pub(crate) struct SlotFile(pub PathBuf);

impl Drop for SlotFile {
    fn drop(&mut self) {
        if std::fs::remove_file(&self.0).is_ok() {
            return;
        }
        let path = self.0.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                for wait in [SLOT_ACTION_TIMEOUT, 10 * SLOT_ACTION_TIMEOUT] {
                    tokio::time::sleep(wait).await;
                    if tokio::fs::remove_file(&path).await.is_ok() {
                        return;
                    }
                }
            });
        }
    }
}

/// A new slot file's name: `inferyes-<way>-<random>.bin`.
fn slot_file_name(way: &str) -> Result<String, String> {
    let random = inferyes_proto::apikey::random_chars(24).map_err(|e| e.to_string())?;
    Ok(format!("{SLOT_FILE_PREFIX}{way}-{random}.bin"))
}

/// What every slot file this agent makes is named from.
const SLOT_FILE_PREFIX: &str = "inferyes-";

/// Slot files last written longer ago than this are left over from a move
/// that ended: longer than a carry may take (`CARRY_TIMEOUT`) and a file
/// may take to arrive (`RECEIVE_TIMEOUT`).
pub const LEFT_OVER_AFTER: Duration = Duration::from_secs(30 * 60);
const _: () = assert!(LEFT_OVER_AFTER.as_secs() > CARRY_TIMEOUT.as_secs());
const _: () = assert!(LEFT_OVER_AFTER.as_secs() > RECEIVE_TIMEOUT.as_secs());

/// Removes this agent's slot files in `dir` last written longer than
/// `older_than` ago: at start, all a stopped agent left (a restore cut
/// off); while it runs, those a save wrote after its sender stopped
/// waiting, where the slot stayed busy past the retries to remove it.
pub fn sweep(dir: &std::path::Path, older_than: Duration) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let old = || {
            let written = entry.metadata().and_then(|m| m.modified());
            written.is_ok_and(|at| at.elapsed().is_ok_and(|age| age > older_than))
        };
        if name.starts_with(SLOT_FILE_PREFIX) && name.ends_with(".bin") && (older_than.is_zero() || old()) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

fn text<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok()).filter(|v| !v.is_empty())
}

impl Intake {
    /// Takes the slot file `request` carries, from `peer`.
    pub async fn receive(&self, request: Request<Incoming>, peer: std::net::IpAddr) -> Response {
        match tokio::time::timeout(RECEIVE_TIMEOUT, self.take(request, peer)).await {
            Ok(Ok(taken)) => {
                self.metrics.received.get_or_create(&crate::metrics::OutcomeLabels { outcome: "restored" }).inc();
                axum::Json(taken).into_response()
            }
            Ok(Err(refusal)) => {
                inferyes_net::warn_every!(reason = %refusal.message, "slot not taken");
                self.metrics.received.get_or_create(&crate::metrics::OutcomeLabels { outcome: refusal.code }).inc();
                refusal.into_response()
            }
            Err(_) => refused(ErrorKind::Timeout, "the slot file took too long to arrive", "timeout").into_response(),
        }
    }

    async fn take(&self, request: Request<Incoming>, peer: std::net::IpAddr) -> Result<Taken, Refused> {
        let (parts, body) = request.into_parts();
        if parts.method != http::Method::PUT {
            return Err(refused(ErrorKind::BadRequest, "slots are PUT here", "method_not_allowed"));
        }
        let headers = &parts.headers;
        let backend_id = text(headers, &inferyes_proto::headers::BACKEND)
            .ok_or_else(|| refused(ErrorKind::BadRequest, "no backend named", "invalid_request"))?;
        let model = text(headers, &inferyes_proto::headers::MODEL)
            .ok_or_else(|| refused(ErrorKind::BadRequest, "no model named", "invalid_request"))?;
        let session = text(headers, &inferyes_proto::headers::SESSION)
            .filter(|s| s.len() <= inferyes_proto::headers::MAX_SESSION_KEY_BYTES)
            .ok_or_else(|| refused(ErrorKind::BadRequest, "no session key, or one too long", "invalid_request"))?;
        let tokens: u32 = text(headers, &SLOT_TOKENS)
            .and_then(|t| t.parse().ok())
            .filter(|t| *t > 0)
            .ok_or_else(|| refused(ErrorKind::BadRequest, "no token count", "invalid_request"))?;
        let digest = text(headers, &SLOT_SHA256)
            .filter(|d| d.len() == 64 && d.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| refused(ErrorKind::BadRequest, "no SHA-256 of the file", "invalid_request"))?
            .to_ascii_lowercase();
        let length: u64 = text(headers, &header::CONTENT_LENGTH)
            .and_then(|l| l.parse().ok())
            .ok_or_else(|| refused(ErrorKind::BadRequest, "a slot file's length must be given", "length_required"))?;
        // Checked before anything of this node's is looked up: a stranger
        // learns nothing of its backends.
        let made = self.check_credential(headers, backend_id, session, &digest, tokens)?;
        // Held from here: a sender's host looked up, at most as many at
        // once as files taken.
        let _permit = self
            .permits
            .try_acquire()
            .map_err(|_| refused(ErrorKind::RateLimited, "this node takes as many slots at once as it will", "busy"))?;
        check_sender(made.from_host, peer).await?;
        // Taken only from the sending node's address: one sent from
        // elsewhere does not use it up.
        {
            let mut used = self.used.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            take_once(&mut used, made.presented, made.expires, inferyes_proto::unix_ms(), self.state.started_unix_ms)?;
        }
        // A node of the fleet, sending what its controller let it: its
        // connections are no stranger's, neither crowded out by strangers
        // nor cut for want of proof while the file comes.
        self.admission.vouch(peer);
        let handle = self.state.backend(backend_id).filter(|h| h.probe.slots.is_some()).ok_or_else(|| {
            refused(ErrorKind::NotFound, "no backend here takes slots by that name", "backend_not_found")
        })?;
        if length > self.max_slot_bytes {
            let message = format!("a slot file of {length} bytes is over this node's {}", self.max_slot_bytes);
            return Err(refused(ErrorKind::PayloadTooLarge, message, "slot_too_large"));
        }
        self.check_backend(handle, text(headers, &SLOT_FINGERPRINT).unwrap_or_default(), model, tokens)?;

        let slots = handle.probe.slots.as_ref().map(|s| s.dir.clone()).unwrap_or_default();
        let (arriving, others) = Arriving::add(&self.arriving, length);
        let min_free = self.min_free_bytes;
        let dir = slots.clone();
        // A shared volume's statvfs may take a while: not on the runtime.
        tokio::task::spawn_blocking(move || check_room(&dir, length, others, min_free))
            .await
            .map_err(|e| refused(ErrorKind::Internal, e.to_string(), "write_failed"))??;
        let url = handle.probe.url.as_str();
        let api_key = handle.probe.api_key.as_str();
        let no_free_slot = || refused(ErrorKind::Unavailable, "no idle slot to restore into", "no_free_slot");
        // Refused before the file is read where the server has no idle
        // slot now (one restored into and not run since is not idle): the
        // sender need not send it. The marks as they are, unless a restore
        // holds them.
        let marked = handle.restore_marks.try_lock().map(|r| r.clone()).unwrap_or_default();
        if free_slot(&list_slots(&self.client, url, api_key).await?, &marked).is_none() {
            // A file small enough is read into the void first: its sender
            // then hears this refusal, where a connection closed under its
            // write would read to it as a failed move. A large one is
            // spared the sending.
            drop(arriving);
            if length <= READ_REFUSED_BYTES {
                read_into_the_void(body, length).await;
            }
            return Err(no_free_slot());
        }
        let name = slot_file_name("in").map_err(|e| refused(ErrorKind::Internal, e, "write_failed"))?;
        let file = SlotFile(slots.join(&name));
        let bytes = write_body(body, &file.0, length, &digest).await?;
        let saved = read_saved_tokens(&file.0, tokens).await;
        let (slot, answer) = restore_into_free_slot(&self.client, &self.state, handle, &name, tokens).await?;
        self.state.residency.lock().restored(session, backend_id, model, (tokens, saved), inferyes_proto::unix_ms());
        self.state.changed.notify_one();
        tracing::info!(session, backend = backend_id, slot, tokens, bytes, "slot restored from another node");
        Ok(Taken { slot, n_restored: tokens, restore_ms: float(&answer, "/timings/restore_ms"), bytes })
    }

    /// The credential names this very move, under the controller's grant
    /// for the sending node to send here.
    fn check_credential<'h>(
        &self,
        headers: &'h HeaderMap,
        backend: &str,
        session: &str,
        sha256: &str,
        slot_tokens: u32,
    ) -> Result<Made<'h>, Refused> {
        let denied = |message: &str| refused(ErrorKind::Unauthenticated, message, "invalid_credential");
        if !self.state.closed {
            let message = "this node takes no slots: it joins with no token";
            return Err(refused(ErrorKind::PermissionDenied, message, "moves_off"));
        }
        let issued = self.state.issued.load_full().ok_or_else(|| {
            refused(ErrorKind::Unavailable, "no controller has issued this node its credentials yet", "not_ready")
        })?;
        let from = text(headers, &MOVE_FROM).ok_or_else(|| denied("no sending node named"))?;
        let from_host = text(headers, &MOVE_FROM_HOST).ok_or_else(|| denied("no sending host named"))?;
        let expiry = |name: &HeaderName| text(headers, name).and_then(|e| e.parse::<u64>().ok());
        let expires = expiry(&MOVE_EXPIRES).ok_or_else(|| denied("no expiry given"))?;
        let grant_expires = expiry(&MOVE_GRANT_EXPIRES).ok_or_else(|| denied("no grant's expiry given"))?;
        let now = inferyes_proto::unix_ms();
        let within = |at: u64, most: u64| at > now && at <= now.saturating_add(most);
        if !within(expires, MAX_CREDENTIAL_MS) || !within(grant_expires, MAX_GRANT_MS) {
            return Err(denied("the credential or its grant has expired, or expires too far ahead"));
        }
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
            .ok_or_else(|| denied("no credential"))?;
        let to = self.state.node_id.as_str();
        let grant = inferyes_proto::bearer::MoveGrant { from, from_host, to, backend, expires_unix_ms: grant_expires };
        let grant = inferyes_proto::bearer::move_grant(&issued.intake_key, &grant);
        let slot = inferyes_proto::bearer::SlotMove {
            from,
            to,
            backend,
            session,
            sha256,
            tokens: slot_tokens,
            expires_unix_ms: expires,
        };
        let made = inferyes_proto::bearer::slot_move_credential(&grant, &slot);
        if !inferyes_proto::apikey::constant_time_eq(presented, made.as_bytes()) {
            return Err(denied("the credential is not one this node's controller granted for that move"));
        }
        Ok(Made { from_host, presented, expires })
    }

    fn check_backend(
        &self,
        handle: &BackendHandle,
        fingerprint: &str,
        model: &str,
        tokens: u32,
    ) -> Result<(), Refused> {
        let observations = self.state.observations.lock();
        let observed = observations
            .backends
            .iter()
            .find(|b| b.id == handle.probe.id)
            .ok_or_else(|| refused(ErrorKind::Unavailable, "the backend has not been read yet", "not_ready"))?;
        let ours = handle.slot_fingerprint(observed);
        if ours.is_empty() || ours != fingerprint {
            let why = if ours.is_empty() { "takes no slots now" } else { "has another fingerprint" };
            return Err(refused(ErrorKind::Unavailable, format!("the backend {why}"), "fingerprint_differs"));
        }
        let served = observed.models.iter().find(|m| m.id == model && m.state() == ModelState::Loaded);
        let Some(served) = served else {
            return Err(refused(
                ErrorKind::Unavailable,
                "the backend does not have that model loaded",
                "model_not_loaded",
            ));
        };
        if served.context_window > 0 && tokens >= served.context_window {
            let message = format!("{tokens} tokens do not fit a slot of {}", served.context_window);
            return Err(refused(ErrorKind::Unavailable, message, "slot_too_small"));
        }
        Ok(())
    }
}

/// The server's slots, as `/slots` lists them.
pub async fn list_slots(client: &ProbeClient, url: &str, api_key: &str) -> Result<Vec<Slot>, Refused> {
    let unread = |why: String| refused(ErrorKind::Upstream, format!("the server's slots: {why}"), "slots_unread");
    let (status, body) = client.get(url, "/slots", api_key).await.map_err(|e| unread(e.to_string()))?;
    if !status.is_success() {
        return Err(unread(format!("HTTP {}", status.as_u16())));
    }
    parse_slots(&body).ok_or_else(|| unread("not a list of slots".into()))
}

/// Restores the slot file `name`, of `tokens` tokens, in `handle`'s slot
/// directory into one of its server's idle slots (see [`free_slot`]): the
/// slot, and the server's answer. Whatever conversation of this node's
/// that slot held is out of it. Restores into one backend, whether of a
/// file another node sent or of one its KV tier kept, go one at a time,
/// so two never pick the same slot.
pub async fn restore_into_free_slot(
    client: &ProbeClient,
    state: &AgentState,
    handle: &crate::state::BackendHandle,
    name: &str,
    tokens: u32,
) -> Result<(u32, Value), Refused> {
    let (url, api_key, backend_id) = (handle.probe.url.as_str(), handle.probe.api_key.as_str(), &handle.probe.id);
    let no_free_slot = || refused(ErrorKind::Unavailable, "no idle slot to restore into", "no_free_slot");
    let mut restored = handle.restore_marks.lock().await;
    let listed = list_slots(client, url, api_key).await?;
    let slot = free_slot(&listed, &restored).ok_or_else(no_free_slot)?;
    // The conversation that slot held, if one of this node's, is out of it.
    if let Some(held) = listed.iter().find(|s| s.id == slot).and_then(|s| s.tokens) {
        let mut residency = state.residency.lock();
        let owners: Vec<String> = residency
            .sessions()
            .into_iter()
            .filter(|s| &s.backend_id == backend_id && u64::from(s.tokens) == u64::from(held) + 1)
            .map(|s| s.key)
            .collect();
        if let [owner] = owners.as_slice() {
            residency.slot_reused(owner);
        }
    }
    let answer = slot_action(client, url, api_key, slot, "restore", name).await.map_err(|e| {
        refused(ErrorKind::Upstream, format!("the server did not restore the slot: {e}"), "restore_failed")
    })?;
    let n_restored = number(&answer, "/n_restored");
    if n_restored != u64::from(tokens) {
        let message = format!("the server restored {n_restored} tokens of {tokens}");
        return Err(refused(ErrorKind::Upstream, message, "restore_failed"));
    }
    // Until the slot runs a task, `/slots` shows nothing of what it now
    // holds: it is not taken for empty meanwhile. Unread, the marks
    // stand, and this slot's is what was read before.
    match list_slots(client, url, api_key).await {
        Ok(now_listed) => {
            restored.retain(|r| now_listed.contains(&r.slot));
            if let Some(slot) = now_listed.iter().find(|s| s.id == slot) {
                restored.push(Restored { slot: *slot });
            }
        }
        Err(_) => restored.extend(listed.iter().filter(|s| s.id == slot).map(|s| Restored { slot: *s })),
    }
    Ok((slot, answer))
}

/// Refuses a slot file that does not come from the host its grant names:
/// a node's grant captured on the way is no use elsewhere.
async fn check_sender(host: &str, peer: std::net::IpAddr) -> Result<(), Refused> {
    let peer = peer.to_canonical();
    let elsewhere = || {
        let message = format!("the sending node's grant names {host}, not this connection's address");
        refused(ErrorKind::PermissionDenied, message, "wrong_address")
    };
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return if ip.to_canonical() == peer { Ok(()) } else { Err(elsewhere()) };
    }
    let found = tokio::time::timeout(LOOKUP_TIMEOUT, tokio::net::lookup_host((host, 0))).await;
    match found {
        Ok(Ok(mut addresses)) => {
            if addresses.any(|a| a.ip().to_canonical() == peer) {
                Ok(())
            } else {
                Err(elsewhere())
            }
        }
        Ok(Err(_)) | Err(_) => Err(refused(
            ErrorKind::Unavailable,
            format!("the sending node's host {host} is unresolved"),
            "wrong_address",
        )),
    }
}

/// A slot file's length counted as arriving until this is dropped.
struct Arriving<'a> {
    total: &'a std::sync::atomic::AtomicU64,
    length: u64,
}

impl<'a> Arriving<'a> {
    /// Counts `length` in; the lengths of the others arriving now.
    fn add(total: &'a std::sync::atomic::AtomicU64, length: u64) -> (Arriving<'a>, u64) {
        let others = total.fetch_add(length, std::sync::atomic::Ordering::Relaxed);
        (Arriving { total, length }, others)
    }
}

impl Drop for Arriving<'_> {
    fn drop(&mut self) {
        self.total.fetch_sub(self.length, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Whether a file of `length` bytes, with `arriving` more on their way,
/// leaves `min_free` of `available`.
fn fits(available: u64, length: u64, arriving: u64, min_free: u64) -> bool {
    length.checked_add(arriving).and_then(|n| n.checked_add(min_free)).is_some_and(|needed| needed <= available)
}

/// Refuses a slot file the filesystem holding `dir` has no room for:
/// a full disk would fail the file half-way, and whatever else writes
/// there (the server's own saves, logs) with it.
fn check_room(dir: &std::path::Path, length: u64, arriving: u64, min_free: u64) -> Result<(), Refused> {
    let stat = rustix::fs::statvfs(dir).map_err(|e| {
        refused(ErrorKind::Internal, format!("the slot directory's free space is unread: {e}"), "write_failed")
    })?;
    let available = stat.f_bavail.saturating_mul(stat.f_frsize);
    if fits(available, length, arriving, min_free) {
        return Ok(());
    }
    let message = format!(
        "no room for a slot file of {length} bytes: {available} bytes free, {arriving} more arriving, {min_free} kept free"
    );
    Err(refused(ErrorKind::Unavailable, message, "no_room"))
}

/// The largest file a refused move is read whole before its refusal is
/// sent.
const READ_REFUSED_BYTES: u64 = 32 << 20;

/// How long a refused file is read at most: a sender trickling it holds
/// one of the node's intake permits no longer.
const READ_REFUSED_WITHIN: Duration = Duration::from_secs(30);

/// Reads `body` to its end, or until bytes stop coming, it breaks off,
/// more than `length` (at most [`READ_REFUSED_BYTES`]) came, or
/// [`READ_REFUSED_WITHIN`] passed.
async fn read_into_the_void(mut body: Incoming, length: u64) {
    let read_all = async {
        let mut read = 0u64;
        while let Ok(Some(Ok(frame))) = tokio::time::timeout(RECEIVE_IDLE, body.frame()).await {
            read = read.saturating_add(frame.data_ref().map_or(0, |data| data.len() as u64));
            if read > length.min(READ_REFUSED_BYTES) {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(READ_REFUSED_WITHIN, read_all).await;
}

/// Writes a slot file's body to `path`: exactly `length` bytes, whose
/// SHA-256 is `digest`. Its bytes.
async fn write_body(body: Incoming, path: &std::path::Path, length: u64, digest: &str) -> Result<u64, Refused> {
    use tokio::io::AsyncWriteExt as _;
    let io = |e: std::io::Error| refused(ErrorKind::Internal, format!("slot file not written: {e}"), "write_failed");
    // Only this user reads it: it holds a conversation. Opened off the
    // runtime, as the slot directory may be a network volume.
    let mut file =
        tokio::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path).await.map_err(io)?;
    // Given up once bytes stop coming, however long the file takes while
    // they come (within `RECEIVE_TIMEOUT`, and only from a sender whose
    // move checked out).
    let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
    let mut written = 0u64;
    let mut body = body;
    while let Some(frame) = tokio::time::timeout(RECEIVE_IDLE, body.frame())
        .await
        .map_err(|_| refused(ErrorKind::Timeout, "no bytes of the slot file came for 30 s", "timeout"))?
    {
        let frame =
            frame.map_err(|e| refused(ErrorKind::BadRequest, format!("the slot file broke off: {e}"), "broken"))?;
        let Ok(data) = frame.into_data() else { continue };
        written = written.saturating_add(data.len() as u64);
        if written > length {
            return Err(refused(ErrorKind::BadRequest, "more bytes than the length given", "invalid_request"));
        }
        hash.update(&data);
        file.write_all(&data).await.map_err(io)?;
    }
    file.flush().await.map_err(io)?;
    if written != length {
        return Err(refused(ErrorKind::BadRequest, "fewer bytes than the length given", "invalid_request"));
    }
    let got = inferyes_proto::hex(hash.finish().as_ref());
    if got != digest {
        return Err(refused(ErrorKind::BadRequest, "the slot file's SHA-256 differs", "digest_mismatch"));
    }
    Ok(written)
}

/// The tokens the slot file at `path` is of, where its head says exactly
/// `tokens` of them (see [`super::saved_tokens`]).
pub async fn read_saved_tokens(path: &std::path::Path, tokens: u32) -> Option<Arc<[i32]>> {
    use tokio::io::AsyncReadExt as _;
    // A slot of more tokens than any context window is not judged: its
    // head is not read into memory.
    if tokens > MAX_JUDGED_TOKENS {
        return None;
    }
    let file = tokio::fs::File::open(path).await.ok()?;
    let mut head = Vec::new();
    let wanted = u64::try_from(super::saved_tokens_bytes(tokens)).ok()?;
    file.take(wanted).read_to_end(&mut head).await.ok()?;
    super::saved_tokens(&head, tokens).map(Arc::from)
}

/// `POST /slots/{slot}?action=...` with a file name; the server's answer.
pub async fn slot_action(
    client: &ProbeClient,
    url: &str,
    api_key: &str,
    slot: u32,
    action: &str,
    filename: &str,
) -> Result<Value, String> {
    let body = serde_json::json!({ "filename": filename });
    let path = format!("/slots/{slot}?action={action}");
    let (status, answer) = client.post_json(url, &path, api_key, &body).await.map_err(|e| e.to_string())?;
    let answer: Value = serde_json::from_slice(&answer).unwrap_or(Value::Null);
    if !status.is_success() {
        let message = answer.pointer("/error/message").and_then(Value::as_str).unwrap_or("no message");
        return Err(format!("HTTP {}: {message}", status.as_u16()));
    }
    Ok(answer)
}

fn number(value: &Value, pointer: &str) -> u64 {
    value.pointer(pointer).and_then(Value::as_u64).unwrap_or(0)
}

fn float(value: &Value, pointer: &str) -> f64 {
    value.pointer(pointer).and_then(Value::as_f64).unwrap_or(0.0)
}

/// Why a conversation was not moved to a target.
#[derive(Debug, PartialEq)]
pub enum MoveError {
    /// It cannot be moved from here at all: recomputed where it goes.
    NotMovable(String),
    /// Its slot is busy: tried again later.
    Busy,
    /// The target took it not (no room, busy, another fingerprint): the
    /// next target may.
    Refused(String),
    /// Tried and failed.
    Failed(String),
}

/// What a move cost.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Moved {
    pub tokens: u32,
    pub bytes: u64,
    pub save_ms: f64,
    pub restore_ms: f64,
    /// From asking for the save to the target's answer.
    pub total_ms: u64,
}

/// What a move sends (see `Sender::outgoing`).
struct Outgoing {
    /// The slot saved, as `/slots` showed it then; none for the tier's.
    slot: Option<Slot>,
    /// The file saved for this move, removed once it is sent; none for
    /// the tier's own.
    file: Option<SlotFile>,
    path: PathBuf,
    tokens: u32,
    /// The server's answer to the save.
    saved: Value,
    /// The digest the tier recorded of its state, which the file must
    /// still have.
    kept_digest: Option<String>,
}

/// The sending side: this node's servers and a pool to other agents.
pub struct Sender {
    pub state: Arc<AgentState>,
    /// Per backend, slots whose conversations moved to other nodes, as
    /// `/slots` showed them then: they hold those caches until they run
    /// another task, and must not be taken for another conversation's of
    /// as many tokens.
    pub moved: std::sync::Mutex<std::collections::HashMap<String, Vec<Slot>>>,
    /// Conversations whose slots are moving now: one move of each at once,
    /// or two targets would restore it (each evicting another's cache).
    pub moving: std::sync::Mutex<std::collections::HashSet<String>>,
    pub client: ProbeClient,
    pub pool: inferyes_net::pool::Pool<FileBody>,
    pub max_slot_bytes: u64,
}

pub type FileBody = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;

impl Sender {
    /// Moves `session`'s slot to `target`; the session leaves this node's
    /// table once the target has it.
    pub async fn send(&self, session: &ResidentSession, target: &MoveTarget) -> Result<Moved, MoveError> {
        let started = Instant::now();
        let _moving = Moving::start(&self.moving, &session.key).ok_or(MoveError::Busy)?;
        let handle = self
            .state
            .backend(&session.backend_id)
            .ok_or_else(|| MoveError::NotMovable("its backend is not this agent's any more".into()))?;
        let dir = handle
            .probe
            .slots
            .as_ref()
            .map(|s| s.dir.clone())
            .ok_or_else(|| MoveError::NotMovable(format!("backend `{}` has no slots dir", session.backend_id)))?;
        // As the server is, not as its restores lately went: a backend that
        // did not hold one still saves its own slots well.
        let fingerprint = {
            let observations = self.state.observations.lock();
            observations.backends.iter().find(|b| b.id == session.backend_id).map(|b| b.slot_fingerprint.clone())
        }
        .unwrap_or_default();
        if fingerprint.is_empty() {
            return Err(MoveError::NotMovable(format!("backend `{}` cannot move slots now", session.backend_id)));
        }
        if fingerprint != target.slot_fingerprint {
            return Err(MoveError::Refused("the target has another fingerprint".into()));
        }
        let grant = self
            .grant_for(target)
            .ok_or_else(|| MoveError::Refused("no grant of the controller's, live, to send that node slots".into()))?;
        let failed = |what: &str, why: String| MoveError::Failed(format!("{what}: {why}"));
        let Outgoing { slot, file, path, tokens: expected, saved, kept_digest } =
            self.outgoing(handle, session, &dir, &fingerprint).await?;
        let max = self.max_slot_bytes;
        let opened = tokio::task::spawn_blocking(move || open_saved(&path, max)).await;
        let (reader, bytes, digest) = match opened {
            Ok(Ok(opened)) => opened,
            Ok(Err(why)) => return Err(failed("slot file", why)),
            Err(_) => return Err(failed("slot file", "hashing stopped".into())),
        };
        if kept_digest.is_some_and(|kept| kept != digest) {
            if let Some(tier) = &handle.tier {
                tier.forget(&session.key);
            }
            return Err(MoveError::NotMovable("the KV tier's file changed since it was kept".into()));
        }
        let reader = tokio::io::AsyncReadExt::take(tokio::fs::File::from_std(reader), bytes);
        let frames = tokio_util::io::ReaderStream::new(reader);
        let body = http_body_util::StreamBody::new(tokio_stream::StreamExt::map(frames, |chunk| {
            chunk.map(http_body::Frame::data)
        }));
        let request = self.request(target, &grant, session, (expected, bytes, &digest), BodyExt::boxed(body))?;
        let origin = inferyes_net::base_url::BaseUrl::new(&target.proxy_url);
        let origin = origin.origin().ok_or_else(|| failed("target", "its proxy URL is not one".into()))?.clone();
        let response = self.pool.send(&origin, request).await.map_err(|e| failed("send", e.to_string()))?;
        let status = response.status();
        if status.is_success() {
            // The target holds it now: said before anything else is awaited,
            // so that a move given up from here on (a drain's deadline, a
            // carry's caller gone) leaves it resident there only.
            self.state.residency.lock().remove(&session.key);
            if let Some(tier) = &handle.tier {
                tier.forget(&session.key);
            }
            self.state.changed.notify_one();
            if let Some(moved) = slot {
                let mut gone = self.moved.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                gone.entry(session.backend_id.clone()).or_default().push(moved);
            }
        }
        let answer = http_body_util::Limited::new(response.into_body(), 64 << 10)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        drop(file);
        let answer: Value = serde_json::from_slice(&answer).unwrap_or(Value::Null);
        if !status.is_success() {
            // Its words stay here: a caller of the carry hears the status.
            let message = answer.pointer("/error/message").and_then(Value::as_str).unwrap_or("no message");
            tracing::info!(target = %target.node_id, status = status.as_u16(), message, "the target took no slot");
            let why = format!("the target answered HTTP {}", status.as_u16());
            return Err(match status.as_u16() {
                409 | 413 | 429 | 503 => MoveError::Refused(why),
                _ => MoveError::Failed(format!("target: {why}")),
            });
        }
        Ok(Moved {
            tokens: expected,
            bytes,
            save_ms: float(&saved, "/timings/save_ms"),
            restore_ms: float(&answer, "/restore_ms"),
            total_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        })
    }

    /// The state a move of `session` sends: the slot holding it, saved
    /// now; or, where no slot holds it any more (taken by another
    /// conversation, or its server restarted), what the KV tier kept of it.
    async fn outgoing(
        &self,
        handle: &crate::state::BackendHandle,
        session: &ResidentSession,
        dir: &std::path::Path,
        fingerprint: &str,
    ) -> Result<Outgoing, MoveError> {
        let (url, api_key) = (handle.probe.url.as_str(), handle.probe.api_key.as_str());
        let failed = |what: &str, why: String| MoveError::Failed(format!("{what}: {why}"));
        let (status, body) =
            self.client.get(url, "/slots", api_key).await.map_err(|e| failed("slots", e.to_string()))?;
        let listed = (status.is_success()).then(|| parse_slots(&body)).flatten();
        let listed = listed.ok_or_else(|| failed("slots", format!("HTTP {} or not a list", status.as_u16())))?;
        let twins = self.state.residency.lock().twins_in_slots(session);
        let gone: Vec<Slot> = {
            let mut moved = self.moved.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let gone = moved.entry(session.backend_id.clone()).or_default();
            gone.retain(|s| listed.contains(s));
            gone.clone()
        };
        match holding_slot(&listed, &gone, session.tokens, &twins, session.last_seen_unix_ms) {
            Ok(slot) => {
                let expected = listed.iter().find(|s| s.id == slot).and_then(|s| s.tokens).unwrap_or(0);
                let name = slot_file_name("out").map_err(|e| failed("slot file", e))?;
                let file = SlotFile(dir.join(&name));
                let saved = slot_action(&self.client, url, api_key, slot, "save", &name)
                    .await
                    .map_err(|e| failed("save", e))?;
                if number(&saved, "/n_saved") != u64::from(expected) {
                    let why = format!("saved {} tokens, the slot held {expected}", number(&saved, "/n_saved"));
                    return Err(MoveError::NotMovable(why));
                }
                let path = file.0.clone();
                let slot = listed.iter().find(|s| s.id == slot).copied();
                Ok(Outgoing { slot, file: Some(file), path, tokens: expected, saved, kept_digest: None })
            }
            Err(NotFound::Busy) => Err(MoveError::Busy),
            Err(why) => {
                let kept = handle.tier.as_ref().and_then(|tier| {
                    let kept = tier.index.lock().get(&session.key).filter(|k| k.fingerprint == *fingerprint).cloned();
                    kept.map(|k| (tier.dir.join(&k.file), k.tokens, k.digest))
                });
                let (path, tokens, digest) = kept.ok_or_else(|| MoveError::NotMovable(why.to_string()))?;
                Ok(Outgoing { slot: None, file: None, path, tokens, saved: Value::Null, kept_digest: Some(digest) })
            }
        }
    }

    /// The controller's freshest live grant to send `target`'s backend
    /// slots: the target's own, or that of its entry among the peers,
    /// renewed over the stream since a drain named it.
    fn grant_for(&self, target: &MoveTarget) -> Option<(String, u64)> {
        let now = inferyes_proto::unix_ms();
        let peers = self.state.peers.lock();
        let same = |p: &&MoveTarget| p.node_id == target.node_id && p.backend_id == target.backend_id;
        std::iter::once(target)
            .chain(peers.iter().filter(same))
            .filter(|t| !t.grant.is_empty() && t.grant_expires_unix_ms > now)
            .max_by_key(|t| t.grant_expires_unix_ms)
            .map(|t| (t.grant.clone(), t.grant_expires_unix_ms))
    }

    fn request(
        &self,
        target: &MoveTarget,
        (grant, grant_expires): &(String, u64),
        session: &ResidentSession,
        (tokens, bytes, digest): (u32, u64, &str),
        body: FileBody,
    ) -> Result<Request<FileBody>, MoveError> {
        let base = inferyes_net::base_url::BaseUrl::new(&target.proxy_url);
        let (uri, host) = base
            .uri(&http::uri::PathAndQuery::from_static(INTAKE_PATH))
            .ok_or_else(|| MoveError::Failed("the target's proxy URL is not one".into()))?;
        let value = |text: &str| {
            HeaderValue::from_str(text).map_err(|_| MoveError::Failed("a header value that cannot be sent".into()))
        };
        let from_host = inferyes_proto::bearer::url_host(&self.state.proxy_url)
            .ok_or_else(|| MoveError::NotMovable("this node's proxy URL names no host".into()))?;
        let expires = inferyes_proto::unix_ms().saturating_add(CREDENTIAL_MS);
        let slot = inferyes_proto::bearer::SlotMove {
            from: &self.state.node_id,
            to: &target.node_id,
            backend: &target.backend_id,
            session: &session.key,
            sha256: digest,
            tokens,
            expires_unix_ms: expires,
        };
        let credential = inferyes_proto::bearer::slot_move_credential(grant, &slot);
        let mut credential = value(&format!("Bearer {credential}"))?;
        credential.set_sensitive(true);
        let mut request = Request::put(uri).body(body).map_err(|e| MoveError::Failed(e.to_string()))?;
        let headers = request.headers_mut();
        headers.insert(header::HOST, host);
        headers.insert(header::AUTHORIZATION, credential);
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(bytes));
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
        headers.insert(MOVE_FROM, value(&self.state.node_id)?);
        headers.insert(MOVE_FROM_HOST, value(&from_host)?);
        headers.insert(MOVE_EXPIRES, HeaderValue::from(expires));
        headers.insert(MOVE_GRANT_EXPIRES, HeaderValue::from(*grant_expires));
        headers.insert(inferyes_proto::headers::BACKEND, value(&target.backend_id)?);
        headers.insert(inferyes_proto::headers::MODEL, value(&session.model)?);
        headers.insert(inferyes_proto::headers::SESSION, value(&session.key)?);
        headers.insert(SLOT_FINGERPRINT, value(&target.slot_fingerprint)?);
        headers.insert(SLOT_SHA256, value(digest)?);
        headers.insert(SLOT_TOKENS, HeaderValue::from(tokens));
        Ok(request)
    }
}

/// Takes a checked credential, expiring at `expires`, once: refused where it
/// was taken before, by this process (`used`, those taken and not expired)
/// or by one before it (made before this one `started`); and, while `used`
/// is full, refused rather than forgetting one that could come again.
fn take_once(
    used: &mut std::collections::VecDeque<(String, u64)>,
    presented: &[u8],
    expires: u64,
    now: u64,
    started: u64,
) -> Result<(), Refused> {
    let denied = |message: &str| refused(ErrorKind::Unauthenticated, message, "invalid_credential");
    if expires.saturating_sub(CREDENTIAL_MS) < started {
        return Err(denied("the credential was made before this node started"));
    }
    used.retain(|(_, until)| *until > now);
    if used.iter().any(|(seen, _)| seen.as_bytes() == presented) {
        return Err(denied("the credential was taken before"));
    }
    if used.len() >= MAX_REMEMBERED_CREDENTIALS {
        return Err(refused(ErrorKind::RateLimited, "this node takes no more slots until credentials expire", "busy"));
    }
    used.push_back((String::from_utf8_lossy(presented).into_owned(), expires));
    Ok(())
}

/// A conversation's move under way; another may start once this is gone.
struct Moving<'a> {
    under_way: &'a std::sync::Mutex<std::collections::HashSet<String>>,
    key: String,
}

impl<'a> Moving<'a> {
    /// `None` where `key`'s conversation is moving already.
    fn start(under_way: &'a std::sync::Mutex<std::collections::HashSet<String>>, key: &str) -> Option<Moving<'a>> {
        let mut keys = under_way.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        keys.insert(key.to_string()).then(|| Moving { under_way, key: key.to_string() })
    }
}

impl Drop for Moving<'_> {
    fn drop(&mut self) {
        self.under_way.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&self.key);
    }
}

/// The sending side's answer to data planes: carries a conversation's
/// slot where a data plane's routing sends its next turn, when carrying
/// its cache costs less than reading the prompt again there.
pub struct Carrier {
    pub sender: Arc<Sender>,
    /// Carries under way at once; more are refused, and their turns read
    /// the prompt again.
    pub permits: Arc<tokio::sync::Semaphore>,
    pub metrics: crate::metrics::SlotMetrics,
}

impl Carrier {
    pub async fn carry(&self, request: Request<Incoming>) -> Response {
        let outcome = if request.method() == http::Method::POST {
            self.try_carry(request.headers()).await
        } else {
            Err(refused(ErrorKind::BadRequest, "a carry is POSTed", "method_not_allowed"))
        };
        let label = match &outcome {
            Ok(_) => "carried",
            Err(refusal) => refusal.code,
        };
        self.metrics.sent.get_or_create(&crate::metrics::OutcomeLabels { outcome: label }).inc();
        match outcome {
            Ok(moved) => axum::Json(serde_json::json!({
                "tokens": moved.tokens,
                "bytes": moved.bytes,
                "save_ms": moved.save_ms,
                "restore_ms": moved.restore_ms,
                "total_ms": moved.total_ms,
            }))
            .into_response(),
            Err(refusal) => refusal.into_response(),
        }
    }

    async fn try_carry(&self, headers: &HeaderMap) -> Result<Moved, Refused> {
        let bad = |what: &str| refused(ErrorKind::BadRequest, format!("no {what}"), "invalid_request");
        let key = text(headers, &inferyes_proto::headers::SESSION).ok_or_else(|| bad("session key"))?;
        let to = text(headers, &MOVE_TO).ok_or_else(|| bad("receiving node"))?;
        let backend = text(headers, &MOVE_TO_BACKEND).ok_or_else(|| bad("receiving backend"))?;
        // Only to a backend this node's controller named, at the address it
        // gave: never where a caller says.
        let target =
            self.sender.state.peers.lock().iter().find(|p| p.node_id == to && p.backend_id == backend).cloned();
        let target = target.ok_or_else(|| {
            refused(ErrorKind::NotFound, "no peer of this node takes slots by that name", "unknown_peer")
        })?;
        let session = self.sender.state.residency.lock().session(key);
        let session = session
            .ok_or_else(|| refused(ErrorKind::NotFound, "the conversation is not resident here", "not_resident"))?;
        // Past the newest of its backend, its slot was given to another
        // conversation (its cache is in the host cache at best): said at
        // once, without asking a busy server, unless its backend's KV tier
        // kept it.
        let kept = self
            .sender
            .state
            .backend(&session.backend_id)
            .and_then(|h| h.tier.as_ref())
            .is_some_and(|tier| tier.index.lock().get(key).is_some());
        if !kept && !self.sender.state.residency.lock().in_slot(key) {
            return Err(refused(ErrorKind::Unavailable, "the conversation is no longer in a slot", "not_movable"));
        }
        let permit = Arc::clone(&self.permits).try_acquire_owned().map_err(|_| {
            refused(ErrorKind::RateLimited, "this node carries as many slots at once as it will", "busy")
        })?;
        // A task of its own, with its permit: a caller that stops waiting
        // (a data plane that gave up on it) does not cut the move short
        // while the target restores, which would leave the conversation
        // recorded on both nodes and free another move of it meanwhile.
        let sender = Arc::clone(&self.sender);
        let carry = tokio::spawn(async move {
            let _permit = permit;
            tokio::time::timeout(CARRY_TIMEOUT, sender.send(&session, &target)).await
        });
        let sent = carry.await.map_err(|_| refused(ErrorKind::Internal, "the carry stopped", "failed"))?;
        let sent = sent.map_err(|_| refused(ErrorKind::Timeout, "the carry took too long", "timeout"))?;
        sent.map_err(|error| match error {
            MoveError::Busy => refused(ErrorKind::Unavailable, "its slot is busy", "busy"),
            MoveError::NotMovable(why) => refused(ErrorKind::Unavailable, why, "not_movable"),
            MoveError::Refused(why) => refused(ErrorKind::Unavailable, why, "refused"),
            MoveError::Failed(why) => refused(ErrorKind::Upstream, why, "failed"),
        })
    }
}

/// The slot file a backend saved at `path`, opened to be sent: the handle
/// rewound, its size and SHA-256 (hex), refused past `max` bytes. Only a
/// regular file at that very path, with no other name: the directory is
/// the backend's too, and a link a backend put there (symbolic, or a hard
/// link to a file it may write, the join token, say) would have this agent
/// read and send what it points to, a FIFO or a device hold the transfer
/// for ever. What is sent is read from the handle that was hashed.
pub fn open_saved(path: &std::path::Path, max: u64) -> Result<(std::fs::File, u64, String), String> {
    use std::io::{Read as _, Seek as _};
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| e.to_string())?;
    let metadata = file.metadata().map_err(|e| e.to_string())?;
    if !metadata.is_file() {
        return Err("not a regular file".into());
    }
    if std::os::unix::fs::MetadataExt::nlink(&metadata) != 1 {
        return Err("a file with another name too".into());
    }
    let size = metadata.len();
    if size > max {
        return Err(format!("{size} bytes, over moves.max_slot_bytes ({max})"));
    }
    let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buffer = vec![0u8; 1 << 20];
    let mut read_in_all = 0;
    let mut sized = (&mut file).take(size);
    loop {
        let read = sized.read(&mut buffer).map_err(|e| e.to_string())?;
        if read == 0 {
            break;
        }
        hash.update(&buffer[..read]);
        read_in_all += read as u64;
    }
    if read_in_all != size {
        return Err(format!("{read_in_all} bytes read of {size}: the file changed"));
    }
    file.rewind().map_err(|e| e.to_string())?;
    Ok((file, size, inferyes_proto::hex(hash.finish().as_ref())))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_credential_is_taken_once_by_this_process_and_never_if_made_before_it() {
        let (started, now) = (1_000_000, 2_000_000);
        let expires = now + super::CREDENTIAL_MS;
        let mut used = std::collections::VecDeque::new();
        assert!(super::take_once(&mut used, b"a", expires, now, started).is_ok());
        let again = super::take_once(&mut used, b"a", expires, now, started).unwrap_err();
        assert!(again.message.contains("taken before"), "{}", again.message);
        // Made before this process started: its predecessor may have taken it.
        let early = started - 1 + super::CREDENTIAL_MS;
        let before = super::take_once(&mut used, b"b", early, now, started).unwrap_err();
        assert!(before.message.contains("before this node started"), "{}", before.message);
        // Expired ones are forgotten; while the list is full of live ones,
        // none is forgotten to make room.
        used.clear();
        for i in 0..super::MAX_REMEMBERED_CREDENTIALS {
            super::take_once(&mut used, i.to_string().as_bytes(), expires, now, started).unwrap();
        }
        let full = super::take_once(&mut used, b"x", expires, now, started).unwrap_err();
        assert_eq!(full.code, "busy");
        assert!(super::take_once(&mut used, b"0", expires, now, started).is_err(), "the first is still known");
        assert!(super::take_once(&mut used, b"x", expires + 1, expires, started).is_ok(), "past their expiry");
    }

    #[test]
    fn slot_files_are_swept_all_at_start_and_when_left_over_while_running() {
        let dir = std::env::temp_dir().join(format!("inferyes-sweep-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, age: std::time::Duration| {
            let path = dir.join(name);
            let file = std::fs::File::create(&path).unwrap();
            file.set_modified(std::time::SystemTime::now() - age).unwrap();
            path
        };
        let fresh = file("inferyes-in-fresh.bin", std::time::Duration::ZERO);
        let left_over = file("inferyes-out-old.bin", 2 * super::LEFT_OVER_AFTER);
        let not_ours = file("conversation.bin", 2 * super::LEFT_OVER_AFTER);
        super::sweep(&dir, super::LEFT_OVER_AFTER);
        assert!(fresh.exists() && !left_over.exists() && not_ours.exists());
        super::sweep(&dir, std::time::Duration::ZERO);
        assert!(!fresh.exists() && not_ours.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_slot_file_is_taken_only_where_it_leaves_room_counting_those_arriving() {
        let dir = std::env::temp_dir();
        let stat = rustix::fs::statvfs(&dir).unwrap();
        let free = stat.f_bavail * stat.f_frsize;
        let arriving = std::sync::atomic::AtomicU64::new(0);
        let (first, others) = super::Arriving::add(&arriving, free / 4);
        assert_eq!(others, 0);
        assert!(super::check_room(&dir, free / 4, others, 0).is_ok());
        // A second as large while the first arrives, then one as large
        // as the disk's free space.
        let (second, others) = super::Arriving::add(&arriving, free / 4);
        assert_eq!(others, free / 4);
        assert!(super::check_room(&dir, free / 4, others, 0).is_ok());
        let (_third, others) = super::Arriving::add(&arriving, free);
        let full = super::check_room(&dir, free, others, 0).unwrap_err();
        assert_eq!(full.code, "no_room");
        assert_eq!(full.kind.http_status(), 503, "the sender tries another node");
        drop((first, second));
        assert_eq!(arriving.load(std::sync::atomic::Ordering::Relaxed), free);
        // What must stay free counts too.
        assert!(super::check_room(&dir, 1, 0, free).is_err());
        assert!(super::check_room(&dir.join("no-such-dir"), 1, 0, 0).is_err());
        assert!(super::fits(10, 4, 3, 3) && !super::fits(10, 4, 3, 4) && !super::fits(u64::MAX, u64::MAX, 1, 0));
    }

    #[test]
    fn a_conversation_moves_once_at_a_time() {
        let under_way = std::sync::Mutex::default();
        let first = super::Moving::start(&under_way, "a").expect("nothing moving yet");
        assert!(super::Moving::start(&under_way, "a").is_none(), "a second move of the same conversation");
        let other = super::Moving::start(&under_way, "b");
        assert!(other.is_some(), "another conversation moves meanwhile");
        drop(first);
        assert!(super::Moving::start(&under_way, "a").is_some(), "once the first is over");
    }

    #[test]
    fn a_saved_slot_is_sent_only_from_a_regular_file_at_its_path() {
        use std::io::Read as _;
        let dir = std::env::temp_dir().join(format!("inferyes-open-saved-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let saved = dir.join("saved.bin");
        std::fs::write(&saved, b"abc").unwrap();
        let (mut file, size, digest) = super::open_saved(&saved, 3).unwrap();
        assert_eq!((size, digest.as_str()), (3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"));
        let mut sent = Vec::new();
        file.read_to_end(&mut sent).unwrap();
        assert_eq!(sent, b"abc", "what is sent is read again from the start");
        assert!(super::open_saved(&saved, 2).unwrap_err().contains("over moves.max_slot_bytes"));

        // What a backend could put in its place: a link to a secret,
        // symbolic or hard, a directory, a FIFO (whose open must not wait
        // for a writer).
        let secret = dir.join("join-token");
        std::fs::write(&secret, b"secret").unwrap();
        std::os::unix::fs::symlink(&secret, dir.join("link.bin")).unwrap();
        std::fs::create_dir(dir.join("dir.bin")).unwrap();
        std::fs::hard_link(&secret, dir.join("hard.bin")).unwrap();
        let fifo = std::process::Command::new("mkfifo").arg(dir.join("fifo.bin")).status().unwrap();
        assert!(fifo.success());
        for name in ["link.bin", "hard.bin", "dir.bin", "fifo.bin"] {
            assert!(super::open_saved(&dir.join(name), 1 << 20).is_err(), "{name} was opened");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
