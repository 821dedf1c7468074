//! Who may use the fleet, and how much: API keys checked against the
//! snapshot's key records, and per-key request rates.
//!
//! A key is verified with argon2 (tens of milliseconds) once; the verdict is
//! cached under a keyed 128-bit digest of the presented key and compared in
//! constant time, so a request with a known key costs a hash and a map
//! lookup. Revocation and expiry are read from the snapshot on every
//! request, so they take effect with the next snapshot.
//!
//! A key that is malformed or names no key id costs no argon2 and is
//! refused at once. Wrong secrets for a key id that exists are what cost:
//! they make that key id suspect for a minute, and count against the
//! client that sent them. The [`verify`] queue checks keys whose id is not
//! suspect first, so no one's failures hold up or lock out a key no one is
//! guessing; a client past its failures is refused checks of suspect key
//! ids (its own guesses, or, behind one address with a holder of the key
//! it guesses, the holder's too: `trusted_proxies` tells them apart).

mod verify;

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderName, HeaderValue, header};
use inferyes_net::admit::peer_of;
use inferyes_proto::ErrorKind;
use inferyes_proto::FastMap;
use inferyes_proto::apikey;
use inferyes_proto::v1::ApiKey;
use serde::{Deserialize, Serialize};

use crate::error::{ApiError, ErrorCode};
use crate::snapshot::RoutingSnapshot;

/// `keys` (the default): every `/v1/*` request needs a key. `none`: open,
/// for a trusted network only.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AuthMode {
    #[default]
    Keys,
    None,
}

/// The caller of a request, once authenticated.
#[derive(Clone, Debug)]
pub enum Caller {
    /// Auth is off.
    Open,
    /// The key's record, as the snapshot holds it (shared, not copied).
    Key(Arc<ApiKey>),
}

/// Whose a session key is: a tenant's (`t:`) or a key's (`k:`), by id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionScope<'a> {
    pub kind: &'static str,
    pub id: &'a str,
}

impl Caller {
    /// What the caller's session keys are scoped by, so that no tenant can
    /// learn of, or join, another's residency: the key's tenant, or the key
    /// itself. None with auth off.
    pub fn session_scope(&self) -> Option<SessionScope<'_>> {
        match self {
            Caller::Open => None,
            Caller::Key(grant) if grant.tenant.is_empty() => Some(SessionScope { kind: "k:", id: &grant.key_id }),
            Caller::Key(grant) => Some(SessionScope { kind: "t:", id: &grant.tenant }),
        }
    }

    pub fn key_id(&self) -> Option<&str> {
        match self {
            Caller::Open => None,
            Caller::Key(grant) => Some(&grant.key_id),
        }
    }

    pub fn may_use(&self, model: &str) -> bool {
        match self {
            Caller::Open => true,
            Caller::Key(key) => apikey::model_allowed(&key.allowed_models, model),
        }
    }

    /// Whether the catalog shows this entry to the caller: a model it may
    /// use, or an alias of one.
    pub fn may_see(&self, entry: &crate::snapshot::CatalogEntry) -> bool {
        self.may_use(&entry.id) || entry.alias_of.as_ref().is_some_and(|model| self.may_use(model))
    }
}

/// Why a request was refused, for the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    Missing,
    Invalid,
    Revoked,
    Expired,
    TooManyFailures,
    /// The key checks' queue is full, for this client or for everyone.
    ChecksWaiting,
    RateLimited,
    TokenBudget,
    /// The key, or its tenant, has all the requests in flight its share
    /// allows.
    InFlightShare,
    /// The key, or its tenant, holds all the bytes its share allows.
    BytesShare,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::Invalid => "invalid",
            Refusal::Revoked => "revoked",
            Refusal::Expired => "expired",
            Refusal::TooManyFailures => "too_many_failures",
            Refusal::ChecksWaiting => "checks_waiting",
            Refusal::RateLimited => "rate_limited",
            Refusal::TokenBudget => "token_budget",
            Refusal::InFlightShare => "in_flight_share",
            Refusal::BytesShare => "bytes_share",
        }
    }
}

const FAILURE_WINDOW: Duration = Duration::from_secs(60);
/// Argon2 verifications at once: each holds 19 MiB and a core for tens of
/// milliseconds; one of them is kept for keys no one is guessing.
const CONCURRENT_VERIFICATIONS: usize = 2;

pub struct Auth {
    mode: AuthMode,
    /// Two independently keyed SipHashes: a 128-bit digest no one outside
    /// this process can compute.
    digest: (std::collections::hash_map::RandomState, std::collections::hash_map::RandomState),
    /// Key id → the presented key's digest and the hash it was verified
    /// against (a re-created record with a new hash is verified again).
    verified: Arc<Mutex<FastMap<String, Verified>>>,
    /// Wrong secrets, by client.
    failed_clients: Arc<Mutex<Failures<IpAddr>>>,
    /// Wrong secrets, by key id: a key id in here is suspect.
    failed_keys: Arc<Mutex<Failures<String>>>,
    failures_per_minute: u32,
    buckets: Mutex<FastMap<String, Bucket>>,
    verifier: Arc<verify::Verifier>,
}

struct Verified {
    digest: [u8; 16],
    secret_hash: String,
}

struct Window {
    started: Instant,
    count: u32,
    last: Instant,
}

/// Failed key checks in the current window, by client or by key id.
struct Failures<K> {
    windows: HashMap<K, Window>,
    /// When windows past were last swept out.
    swept: Option<Instant>,
}

impl<K> Default for Failures<K> {
    fn default() -> Failures<K> {
        Failures { windows: HashMap::new(), swept: None }
    }
}

/// Clients (or key ids) whose failures are remembered at most.
const MAX_FAILING: usize = 100_000;

impl<K: std::hash::Hash + Eq> Failures<K> {
    fn add(&mut self, key: K, now: Instant) {
        if self.windows.len() >= MAX_FAILING && !self.windows.contains_key(&key) {
            // Past windows go, once a second at most: a sweep per failure
            // would hold the lock for every check of every client.
            if self.swept.is_none_or(|at| now.duration_since(at) >= Duration::from_secs(1)) {
                self.windows.retain(|_, w| now.duration_since(w.last) < FAILURE_WINDOW);
                self.swept = Some(now);
            }
            if self.windows.len() >= MAX_FAILING {
                // Full of current windows: this one goes uncounted (it
                // still has to get through the checks' own cost).
                return;
            }
        }
        let window = self.windows.entry(key).or_insert(Window { started: now, count: 0, last: now });
        if now.duration_since(window.started) >= FAILURE_WINDOW {
            *window = Window { started: now, count: 0, last: now };
        }
        window.count += 1;
        window.last = now;
    }

    /// Whether one failed within the last window's length.
    fn recent<Q>(&self, key: &Q, now: Instant) -> bool
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        self.windows.get(key).is_some_and(|window| now.saturating_duration_since(window.last) < FAILURE_WINDOW)
    }

    /// Failures in the current window, and how long it has left.
    fn current<Q>(&self, key: &Q, now: Instant) -> Option<(u32, Duration)>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        let window = self.windows.get(key)?;
        let age = now.saturating_duration_since(window.started);
        (age < FAILURE_WINDOW).then(|| (window.count, FAILURE_WINDOW - age))
    }
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Auth {
    pub fn new(mode: AuthMode, failures_per_minute: u32) -> Auth {
        Auth {
            mode,
            digest: Default::default(),
            verified: Arc::default(),
            failed_clients: Arc::default(),
            failed_keys: Arc::default(),
            failures_per_minute,
            buckets: Mutex::default(),
            verifier: verify::Verifier::new(CONCURRENT_VERIFICATIONS),
        }
    }

    pub fn mode(&self) -> AuthMode {
        self.mode
    }

    /// The caller of a request with these headers, from `client` (its
    /// address, as the trusted proxies in front tell it).
    pub async fn authenticate(
        &self,
        headers: &HeaderMap,
        client: IpAddr,
        snapshot: &RoutingSnapshot,
    ) -> Result<Caller, (Refusal, ApiError)> {
        if self.mode == AuthMode::None {
            return Ok(Caller::Open);
        }
        let Some(token) = bearer(headers) else {
            return Err((
                Refusal::Missing,
                unauthorized(
                    "You didn't provide an API key. Send it in the Authorization header (`Authorization: Bearer ify_...`) or in `x-api-key`.",
                ),
            ));
        };
        let incorrect = || (Refusal::Invalid, unauthorized("Incorrect API key provided."));
        let Some((key_id, secret)) = apikey::parse(token) else { return Err(incorrect()) };
        let Some(key) = snapshot.api_key(key_id) else { return Err(incorrect()) };
        let digest = self.digest_of(token);
        if !self.known(key, &digest) {
            let client = peer_of(client);
            let now = Instant::now();
            let suspect = lock(&self.failed_keys).recent(key_id, now);
            if suspect && let Some(retry) = self.blocked(client, now) {
                return Err((
                    Refusal::TooManyFailures,
                    ApiError::new(
                        ErrorKind::RateLimited,
                        "Too many failed authentication attempts from this address; try again later.",
                        ErrorCode::RateLimitExceeded,
                    )
                    .retry_after(retry),
                ));
            }
            let turn = verify::Turn { client, key_id: (!suspect).then(|| key_id.to_string()) };
            let (secret, secret_hash) = (secret.to_string(), key.secret_hash.clone());
            let check = move || apikey::verify(&secret, &secret_hash);
            match self.verifier.check(digest, turn, check, self.settle(key, digest, client)).await {
                Ok(true) => {}
                Ok(false) => return Err(incorrect()),
                Err(busy) => return Err((Refusal::ChecksWaiting, checks_waiting(busy))),
            }
        }
        let now = inferyes_proto::unix_ms();
        if key.revoked {
            return Err((Refusal::Revoked, unauthorized("This API key has been revoked.")));
        }
        if key.expires_unix_ms != 0 && key.expires_unix_ms <= now {
            return Err((Refusal::Expired, unauthorized("This API key has expired.")));
        }
        Ok(Caller::Key(Arc::clone(key)))
    }

    /// Takes one request from the caller's per-minute allowance: `part` of
    /// its key's requests per minute are this data plane's
    /// ([`crate::allowance`]), a burst of that many refilled at as many a
    /// minute. The headers describe the allowance either way (OpenAI's
    /// `x-ratelimit-*`): the key's limit, and what is left of it here.
    pub fn admit(&self, caller: &Caller, part: u32, now: Instant) -> Result<RateHeaders, (Refusal, ApiError)> {
        let Caller::Key(grant) = caller else { return Ok(RateHeaders::default()) };
        let limit = grant.requests_per_minute;
        if limit == 0 {
            return Ok(RateHeaders::default());
        }
        let capacity = f64::from(part.min(limit));
        let per_second = capacity / 60.0;
        // Seconds until `tokens` more are here; with no part here, the
        // next split comes within a second.
        let within = |tokens: f64| if per_second > 0.0 { (tokens / per_second).ceil() as u32 } else { 1 };
        let mut buckets = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
        let bucket = inferyes_proto::value_for(&mut buckets, &grant.key_id, || Bucket { tokens: capacity, at: now });
        let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * per_second).min(capacity);
        bucket.at = now;
        let admitted = bucket.tokens >= 1.0;
        if admitted {
            bucket.tokens -= 1.0;
        }
        let headers = RateHeaders {
            limit: Some(limit),
            remaining: bucket.tokens.floor() as u32,
            reset_seconds: within(capacity - bucket.tokens),
        };
        if admitted {
            return Ok(headers);
        }
        // When the part here refills; a split may give it more sooner.
        let retry = within(1.0 - bucket.tokens).clamp(1, 60);
        let here = if capacity < f64::from(limit) {
            format!(", of which this data plane holds {capacity} now")
        } else {
            String::new()
        };
        let mut error = ApiError::new(
            ErrorKind::RateLimited,
            format!("Rate limit reached for requests: {limit} per minute for this key{here}. Try again in {retry}s."),
            ErrorCode::RateLimitExceeded,
        )
        .retry_after(retry);
        error.headers = headers.to_vec();
        Err((Refusal::RateLimited, error))
    }

    fn digest_of(&self, token: &str) -> [u8; 16] {
        let half = |state: &std::collections::hash_map::RandomState| {
            let mut hasher = state.build_hasher();
            hasher.write(token.as_bytes());
            hasher.finish().to_le_bytes()
        };
        let mut digest = [0u8; 16];
        digest[..8].copy_from_slice(&half(&self.digest.0));
        digest[8..].copy_from_slice(&half(&self.digest.1));
        digest
    }

    fn known(&self, key: &ApiKey, digest: &[u8; 16]) -> bool {
        let verified = self.verified.lock().unwrap_or_else(PoisonError::into_inner);
        verified
            .get(&key.key_id)
            .is_some_and(|v| v.secret_hash == key.secret_hash && apikey::constant_time_eq(digest, &v.digest))
    }

    /// What a check's verdict leaves behind, told by the check itself, so
    /// that it counts however many of its requests are still there: the
    /// key remembered as verified, or a wrong secret counted.
    fn settle(&self, key: &ApiKey, digest: [u8; 16], client: IpAddr) -> impl FnOnce(bool) + Send + 'static {
        let (verified, failed_clients, failed_keys) =
            (Arc::clone(&self.verified), Arc::clone(&self.failed_clients), Arc::clone(&self.failed_keys));
        let (key_id, secret_hash) = (key.key_id.clone(), key.secret_hash.clone());
        move |valid| {
            if valid {
                lock(&verified).insert(key_id, Verified { digest, secret_hash });
            } else {
                let now = Instant::now();
                lock(&failed_clients).add(client, now);
                lock(&failed_keys).add(key_id, now);
            }
        }
    }

    /// Seconds until `client` may have suspect keys checked again, if it
    /// is past its failures.
    fn blocked(&self, client: IpAddr, now: Instant) -> Option<u32> {
        let (count, left) = lock(&self.failed_clients).current(&client, now)?;
        (count >= self.failures_per_minute).then(|| left.as_secs().max(1) as u32)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn checks_waiting(busy: verify::Busy) -> ApiError {
    match busy {
        verify::Busy::Client => ApiError::new(
            ErrorKind::RateLimited,
            "Too many API key checks from this address are waiting; try again shortly.",
            ErrorCode::RateLimitExceeded,
        )
        .retry_after(1),
        verify::Busy::Everyone => ApiError::overloaded("API key checks"),
    }
}

/// OpenAI's request-rate headers.
#[derive(Clone, Copy, Debug, Default)]
pub struct RateHeaders {
    /// `None`: the caller has no limit, and no headers are sent.
    pub limit: Option<u32>,
    pub remaining: u32,
    pub reset_seconds: u32,
}

impl RateHeaders {
    pub fn to_vec(self) -> Vec<(HeaderName, HeaderValue)> {
        let Some(limit) = self.limit else { return Vec::new() };
        vec![
            (HeaderName::from_static("x-ratelimit-limit-requests"), HeaderValue::from(limit)),
            (HeaderName::from_static("x-ratelimit-remaining-requests"), HeaderValue::from(self.remaining)),
            (
                HeaderName::from_static("x-ratelimit-reset-requests"),
                HeaderValue::from_str(&format!("{}s", self.reset_seconds)).unwrap_or(HeaderValue::from_static("0s")),
            ),
        ]
    }
}

/// The key a request presents: `Authorization: Bearer`, as OpenAI's clients
/// send it, else `x-api-key`, as Anthropic's do.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let authorization = || {
        let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
        let (scheme, token) = value.split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim()).filter(|t| !t.is_empty())
    };
    let api_key =
        || headers.get(inferyes_proto::headers::API_KEY)?.to_str().ok().map(str::trim).filter(|t| !t.is_empty());
    authorization().or_else(api_key)
}

fn unauthorized(message: &str) -> ApiError {
    ApiError::new(ErrorKind::Unauthenticated, message, ErrorCode::InvalidApiKey)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(rpm: u32) -> Caller {
        Caller::Key(Arc::new(ApiKey { key_id: "k".into(), requests_per_minute: rpm, ..Default::default() }))
    }

    #[test]
    fn the_request_rate_refills_continuously_and_refuses_with_retry_after() {
        let auth = Auth::new(AuthMode::Keys, 10);
        let start = Instant::now();
        let caller = caller(60);
        for i in 0..60 {
            let headers = auth.admit(&caller, 60, start).unwrap_or_else(|_| panic!("request {i} within the limit"));
            assert_eq!(headers.remaining, 59 - i);
        }
        let (refusal, error) = auth.admit(&caller, 60, start).unwrap_err();
        assert_eq!(refusal, Refusal::RateLimited);
        assert_eq!(error.retry_after, Some(1));
        assert_eq!(error.status(), http::StatusCode::TOO_MANY_REQUESTS);
        assert!(error.headers.iter().any(|(n, v)| n == "x-ratelimit-remaining-requests" && v == "0"));
        // 60 per minute is one a second.
        assert!(auth.admit(&caller, 60, start + Duration::from_millis(1_001)).is_ok());
        assert!(auth.admit(&Caller::Open, 0, start).is_ok());
        assert!(auth.admit(&self::caller(0), 0, start).unwrap().limit.is_none());
    }

    #[test]
    fn a_key_s_rate_is_its_part_here_and_no_part_is_refused_for_a_second() {
        let auth = Auth::new(AuthMode::Keys, 10);
        let (start, caller) = (Instant::now(), caller(60));
        for _ in 0..15 {
            assert_eq!(auth.admit(&caller, 15, start).unwrap().limit, Some(60), "the key's limit is told");
        }
        let (_, error) = auth.admit(&caller, 15, start).unwrap_err();
        assert!(
            error.message.contains("60 per minute for this key, of which this data plane holds 15"),
            "{}",
            error.message
        );
        assert_eq!(error.retry_after, Some(4), "when the part here refills: 15 a minute");
        // A quarter of 60 a minute is one every 4 s.
        assert!(auth.admit(&caller, 15, start + Duration::from_millis(3_900)).is_err());
        assert!(auth.admit(&caller, 15, start + Duration::from_millis(4_100)).is_ok());
        let (_, error) = auth.admit(&self::caller(60), 0, start + Duration::from_secs(60)).unwrap_err();
        assert_eq!(error.retry_after, Some(1));
    }

    fn fail(auth: &Auth, client: IpAddr) {
        let key = ApiKey { key_id: "k".into(), ..Default::default() };
        auth.settle(&key, [0; 16], client)(false);
    }

    #[test]
    fn failures_are_counted_per_ipv4_address_and_per_ipv6_64() {
        let auth = Auth::new(AuthMode::Keys, 3);
        let now = Instant::now();
        let client = |s: &str| peer_of(s.parse::<IpAddr>().unwrap());
        for host in ["2001:db8:1:2::1", "2001:db8:1:2::2", "2001:db8:1:2:ffff::9"] {
            assert!(auth.blocked(client(host), now).is_none());
            fail(&auth, client(host));
        }
        assert!(auth.blocked(client("2001:db8:1:2::77"), now).is_some(), "one /64, one client");
        assert!(auth.blocked(client("2001:db8:1:3::1"), now).is_none(), "another /64");
        for _ in 0..3 {
            fail(&auth, client("192.0.2.1"));
        }
        assert!(auth.blocked(client("::ffff:192.0.2.1"), now).is_some(), "the same IPv4 client, mapped");
        assert!(auth.blocked(client("192.0.2.2"), now).is_none());
        assert!(auth.blocked(client("192.0.2.1"), now + FAILURE_WINDOW * 2).is_none(), "a minute on");
    }

    #[test]
    fn the_authorization_header_is_read_as_a_bearer_token() {
        let mut headers = HeaderMap::new();
        assert_eq!(bearer(&headers), None);
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer ify_abc_def"));
        assert_eq!(bearer(&headers), Some("ify_abc_def"));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("bearer   tok "));
        assert_eq!(bearer(&headers), Some("tok"));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic dXNlcg=="));
        assert_eq!(bearer(&headers), None);
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer "));
        assert_eq!(bearer(&headers), None);
    }

    #[test]
    fn an_anthropic_client_s_x_api_key_is_read_where_no_bearer_token_is_sent() {
        let mut headers = HeaderMap::new();
        headers.insert(inferyes_proto::headers::API_KEY, HeaderValue::from_static(" ify_abc_def "));
        assert_eq!(bearer(&headers), Some("ify_abc_def"));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer ify_first"));
        assert_eq!(bearer(&headers), Some("ify_first"), "the Authorization header first");
        headers.remove(header::AUTHORIZATION);
        headers.insert(inferyes_proto::headers::API_KEY, HeaderValue::from_static(""));
        assert_eq!(bearer(&headers), None);
    }
}
