//! The live fleet dashboard on the controller's HTTP port: one static page
//! (no build step), the fleet as JSON, and a server-sent event stream that
//! pushes the same JSON whenever the snapshot or the data planes' activity
//! changes. With `dashboard_auth = "token"`, all three need a viewer's or
//! the admin token ([`gate`]); without one, `/` is a login page.

pub mod attempts;
pub mod gate;
pub mod usage;
pub mod view;

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::extract::{ConnectInfo, FromRequestParts, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use crate::activity::Activity;
use crate::history::{Pressure, STEP_MS};
use crate::reconcile::SnapshotRx;

const PAGE: &str = include_str!("index.html");
const LOGIN: &str = include_str!("login.html");
/// At most this many pushes per second per viewer: a busy fleet changes
/// every few milliseconds, eyes do not.
const PUSH_EVERY: Duration = Duration::from_millis(500);

#[derive(Clone)]
pub struct Dashboard {
    pub controller_id: String,
    pub snapshots: SnapshotRx,
    pub views: crate::reconcile::LiveViewRx,
    pub activity: Arc<Activity>,
    /// Written only by [`sample_pressure`].
    pub pressure: Arc<std::sync::Mutex<Pressure>>,
    /// Written only by [`usage::sample`].
    pub usage: Arc<std::sync::Mutex<usage::TenantUsage>>,
    /// Ticks when either sampler has written: the page shows what they
    /// sampled, whether or not anything else changed.
    pub sampled: Arc<tokio::sync::watch::Sender<u64>>,
    /// Event streams end with it, so a graceful shutdown is not held up.
    pub shutdown: CancellationToken,
    /// Who may look; `None`: anyone who reaches the port.
    pub gate: Option<Arc<gate::Gate>>,
    /// Wrong tokens per client address.
    pub attempts: Arc<Mutex<attempts::Attempts>>,
    /// Proxies whose `X-Forwarded-For` names the client.
    pub trusted_proxies: Arc<[inferyes_net::forwarded::Cidr]>,
    pub refused: prometheus_client::metrics::family::Family<
        crate::metrics::DashboardRefusedLabels,
        prometheus_client::metrics::counter::Counter,
    >,
}

pub fn router(dashboard: Dashboard) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/api/v1/fleet", get(fleet))
        .route("/api/v1/events", get(events))
        .route("/api/v1/login", axum::routing::post(login))
        .route("/api/v1/logout", axum::routing::post(logout))
        .with_state(dashboard)
        .layer(axum::middleware::map_response(with_page_headers))
}

/// What a browser may do with the dashboard's answers: run only the pages'
/// own scripts (hashed), load nothing from elsewhere, be framed nowhere,
/// keep nothing in a cache, send no referrer. Text from clients and
/// agents is escaped where the pages write it; this holds if an escape is
/// ever missed.
async fn with_page_headers(mut response: Response) -> Response {
    static POLICY: std::sync::LazyLock<header::HeaderValue> = std::sync::LazyLock::new(|| {
        header::HeaderValue::from_str(&content_security_policy(&[PAGE, LOGIN]))
            .unwrap_or(header::HeaderValue::from_static("default-src 'none'"))
    });
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_SECURITY_POLICY, POLICY.clone());
    headers.insert(header::X_FRAME_OPTIONS, header::HeaderValue::from_static("DENY"));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, header::HeaderValue::from_static("nosniff"));
    headers.insert(header::REFERRER_POLICY, header::HeaderValue::from_static("no-referrer"));
    headers.insert(header::CACHE_CONTROL, header::HeaderValue::from_static("no-store"));
    response
}

/// The policy that lets each page's one inline script run, by its SHA-256,
/// and nothing else; inline styles are the pages' own (bars and colours).
fn content_security_policy(pages: &[&str]) -> String {
    use base64::Engine as _;
    let scripts = pages.iter().filter_map(|page| page.split_once("<script>")?.1.split_once("</script>").map(|s| s.0));
    let hashes: String = scripts
        .map(|script| {
            let digest = ring::digest::digest(&ring::digest::SHA256, script.as_bytes());
            format!(" 'sha256-{}'", base64::engine::general_purpose::STANDARD.encode(digest.as_ref()))
        })
        .collect();
    format!(
        "default-src 'none'; script-src{hashes}; style-src 'unsafe-inline'; connect-src 'self'; base-uri 'none'; \
         form-action 'none'; frame-ancestors 'none'"
    )
}

/// Whether the browser reached the dashboard over HTTPS, as a trusted
/// proxy in front of it says (`X-Forwarded-Proto`): the port itself serves
/// plain HTTP, and a session cookie sent back over plain HTTP could be
/// read on the way.
fn over_https(peer: Option<IpAddr>, headers: &HeaderMap, trusted: &[inferyes_net::forwarded::Cidr]) -> bool {
    let via_trusted = peer.is_some_and(|peer| inferyes_net::forwarded::is_trusted(peer, trusted));
    via_trusted && headers.get("x-forwarded-proto").is_some_and(|proto| proto.as_bytes().eq_ignore_ascii_case(b"https"))
}

/// Whether a browser says a request comes from another site: its forms
/// can post here (a logout, a login with a token of the other site's
/// choosing), never read the answer. Clients that are not browsers send
/// no `Sec-Fetch-Site`.
fn from_another_site(headers: &HeaderMap) -> bool {
    headers.get("sec-fetch-site").is_some_and(|site| site != "same-origin")
}

fn cross_site() -> Response {
    let error = "the dashboard takes sign-ins and sign-outs from its own pages only";
    (StatusCode::FORBIDDEN, axum::Json(serde_json::json!({ "error": error }))).into_response()
}

async fn logout(headers: HeaderMap) -> Response {
    if from_another_site(&headers) {
        return cross_site();
    }
    (StatusCode::NO_CONTENT, [(header::SET_COOKIE, gate::logout())]).into_response()
}

/// The address a request came from, where the server put it in the
/// request (`ConnectInfo`).
struct Peer(Option<IpAddr>);

impl<S: Send + Sync> FromRequestParts<S> for Peer {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, _: &S) -> Result<Peer, Infallible> {
        Ok(Peer(parts.extensions.get::<ConnectInfo<SocketAddr>>().map(|info| info.0.ip())))
    }
}

impl Dashboard {
    /// The refusal of a read presenting these headers from `peer`, if it
    /// is not let in. A Bearer token is a try: a wrong one counts against
    /// its client's address, which past its tries is refused before its
    /// token is looked at. A session cookie is not a try.
    fn refusal(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> Option<Response> {
        let gate = self.gate.as_ref()?;
        let tries = headers.contains_key(header::AUTHORIZATION).then(|| self.client(peer, headers)).flatten();
        match self.check(gate, tries, |gate, now| gate.allows(headers, now)) {
            Ok(()) => None,
            Err(None) => Some(refused()),
            Err(Some(wait)) => Some(self.too_many(wait)),
        }
    }

    /// The client of a request from `peer`: itself, or the one a trusted
    /// proxy names.
    fn client(&self, peer: Option<IpAddr>, headers: &HeaderMap) -> Option<IpAddr> {
        peer.map(|peer| inferyes_net::forwarded::client_address(peer, headers, &self.trusted_proxies))
    }

    /// `allowed`, for an address that may still try (`tries`: the address,
    /// where this counts as a try). A try is taken before its token is
    /// checked, and given back if the token is right: tries at once cannot
    /// all pass before any is counted. `Err(None)`: refused; `Err(Some(s))`:
    /// refused untried, for `s` seconds more.
    fn check(
        &self,
        gate: &gate::Gate,
        tries: Option<IpAddr>,
        allowed: impl FnOnce(&gate::Gate, u64) -> bool,
    ) -> Result<(), Option<u64>> {
        let now = inferyes_proto::unix_ms() / 1000;
        let attempts = || self.attempts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(client) = tries {
            attempts().take(client, now).map_err(Some)?;
        }
        if allowed(gate, now) {
            if let Some(client) = tries {
                attempts().give_back(client, now);
            }
            return Ok(());
        }
        // A wrong token, not a stale cookie (a browser sends every cookie
        // of the host) nor a visit with none.
        if tries.is_some() {
            self.refused.get_or_create(&crate::metrics::DashboardRefusedLabels { reason: "token" }).inc();
        }
        Err(None)
    }

    fn too_many(&self, retry_after: u64) -> Response {
        self.refused.get_or_create(&crate::metrics::DashboardRefusedLabels { reason: "attempts" }).inc();
        let error = format!("too many wrong tokens from this address: try again in {retry_after} s");
        let retry_after = header::HeaderValue::from(retry_after);
        (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, retry_after)],
            axum::Json(serde_json::json!({ "error": error })),
        )
            .into_response()
    }
}

fn refused() -> Response {
    let error = "the dashboard needs a viewer token or the admin token: sign in at /, or send it as a Bearer token";
    (StatusCode::UNAUTHORIZED, axum::Json(serde_json::json!({ "error": error }))).into_response()
}

/// The dashboard, or its sign-in page where the request is not let in: a
/// Bearer token sent for it is a try, as for a read, or which page came
/// back would tell a right token from a wrong one untried.
async fn page(State(dashboard): State<Dashboard>, Peer(peer): Peer, headers: HeaderMap) -> Response {
    match dashboard.refusal(&headers, peer) {
        None => Html(PAGE).into_response(),
        Some(too_many) if too_many.status() == StatusCode::TOO_MANY_REQUESTS => too_many,
        Some(_) => Html(LOGIN).into_response(),
    }
}

#[derive(serde::Deserialize)]
struct Login {
    token: String,
}

async fn login(
    State(dashboard): State<Dashboard>,
    Peer(peer): Peer,
    headers: HeaderMap,
    axum::Json(login): axum::Json<Login>,
) -> Response {
    if from_another_site(&headers) {
        return cross_site();
    }
    let Some(gate) = &dashboard.gate else { return StatusCode::NO_CONTENT.into_response() };
    let over_https = over_https(peer, &headers, &dashboard.trusted_proxies);
    let mut cookie = None;
    let checked = dashboard.check(gate, dashboard.client(peer, &headers), |gate, now| {
        cookie = gate.login(login.token.trim(), now, over_https);
        cookie.is_some()
    });
    match (checked, cookie) {
        (Ok(()), Some(cookie)) => (StatusCode::NO_CONTENT, [(header::SET_COOKIE, cookie)]).into_response(),
        (Err(Some(wait)), _) => dashboard.too_many(wait),
        _ => refused(),
    }
}

impl Dashboard {
    fn view(&self) -> Option<serde_json::Value> {
        let snapshot = self.snapshots.borrow().clone()?;
        let live = Arc::clone(&self.views.borrow());
        let recent = self.activity.recent(tokio::time::Instant::now());
        let usage = self.usage.lock().unwrap_or_else(std::sync::PoisonError::into_inner).to_json();
        let pressure = self.pressure.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut view =
            view::build(&self.controller_id, &snapshot, &live, &recent, &pressure, inferyes_proto::unix_ms());
        view["usage"] = usage;
        Some(view)
    }
}

/// Samples every GPU's pressure once a step, and a node that joins at
/// once, from the current snapshot, until shutdown: the history is there
/// before anyone looks.
pub async fn sample_pressure(dashboard: Dashboard) {
    let mut every = tokio::time::interval(Duration::from_millis(STEP_MS));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut snapshots = dashboard.snapshots.clone();
    loop {
        tokio::select! {
            () = dashboard.shutdown.cancelled() => return,
            _ = every.tick() => {}
            changed = snapshots.changed() => if changed.is_err() { return },
        }
        let Some(snapshot) = dashboard.snapshots.borrow().clone() else { continue };
        let live = Arc::clone(&dashboard.views.borrow());
        let mut pressure = dashboard.pressure.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        pressure.sample(&snapshot, &live, inferyes_proto::unix_ms());
        drop(pressure);
        dashboard.sampled.send_modify(|n| *n += 1);
    }
}

async fn fleet(State(dashboard): State<Dashboard>, Peer(peer): Peer, headers: HeaderMap) -> Response {
    if let Some(refusal) = dashboard.refusal(&headers, peer) {
        return refusal;
    }
    match dashboard.view() {
        Some(view) => axum::Json(view).into_response(),
        None => (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, "1")],
            axum::Json(serde_json::json!({ "error": "fleet not loaded from etcd yet" })),
        )
            .into_response(),
    }
}

/// One `fleet` event at once, then one per change, at most every
/// [`PUSH_EVERY`]. The browser's `EventSource` reconnects by itself.
async fn events(State(dashboard): State<Dashboard>, Peer(peer): Peer, headers: HeaderMap) -> Response {
    if let Some(refusal) = dashboard.refusal(&headers, peer) {
        return refusal;
    }
    let (tx, rx) = mpsc::channel(2);
    tokio::spawn(push(dashboard, tx));
    Sse::new(ReceiverStream::new(rx)).keep_alive(KeepAlive::default()).into_response()
}

async fn push(dashboard: Dashboard, tx: mpsc::Sender<Result<Event, Infallible>>) {
    let mut snapshots = dashboard.snapshots.clone();
    let mut views = dashboard.views.clone();
    let mut activity = dashboard.activity.subscribe();
    let mut sampled = dashboard.sampled.subscribe();
    loop {
        snapshots.mark_unchanged();
        views.mark_unchanged();
        activity.mark_unchanged();
        sampled.mark_unchanged();
        if let Some(view) = dashboard.view() {
            let event = Event::default().event("fleet").data(view.to_string());
            if tx.send(Ok(event)).await.is_err() {
                return;
            }
        }
        tokio::select! {
            () = dashboard.shutdown.cancelled() => return,
            () = tx.closed() => return,
            changed = snapshots.changed() => if changed.is_err() { return },
            changed = views.changed() => if changed.is_err() { return },
            changed = activity.changed() => if changed.is_err() { return },
            changed = sampled.changed() => if changed.is_err() { return },
        }
        tokio::select! {
            () = dashboard.shutdown.cancelled() => return,
            () = tx.closed() => return,
            () = tokio::time::sleep(PUSH_EVERY) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_lets_each_page_s_one_script_run_and_nothing_else() {
        let policy = content_security_policy(&[PAGE, LOGIN]);
        for page in [PAGE, LOGIN] {
            // One inline script a page: a second would be blocked.
            assert_eq!(page.matches("<script").count(), 1);
            // No inline handlers (`onclick=...`) in the markup, the script's
            // own text aside: the policy runs none.
            let (before, rest) = page.split_once("<script>").unwrap();
            let markup = format!("{before}{}", rest.split_once("</script>").unwrap().1);
            assert!(!inline_handler(&markup), "an inline handler");
        }
        assert!(inline_handler("<img src=x\n  onerror = 'x()'>") && !inline_handler("<p>only one</p>"));
        assert!(inline_handler("<svg/onload=x()>") && inline_handler("<a href=\"#\"onclick=x()>"));
        let sources: Vec<&str> = policy.split("; ").collect();
        let scripts = sources.iter().find(|s| s.starts_with("script-src")).unwrap();
        assert_eq!(scripts.matches("'sha256-").count(), 2, "{policy}");
        assert!(!scripts.contains("unsafe"), "{policy}");
        assert_ne!(content_security_policy(&["<script>a</script>"]), content_security_policy(&["<script>b</script>"]));
        for must in ["default-src 'none'", "frame-ancestors 'none'", "base-uri 'none'", "connect-src 'self'"] {
            assert!(sources.contains(&must), "{must} in {policy}");
        }
    }

    /// Whether markup has an attribute `on<letters>` with a value: an
    /// inline event handler, however it is spaced or quoted.
    fn inline_handler(markup: &str) -> bool {
        let lower = markup.to_ascii_lowercase();
        let bytes = lower.as_bytes();
        (1..bytes.len()).any(|at| {
            let Some(name) = bytes[at..].strip_prefix(b"on") else { return false };
            let letters = name.iter().take_while(|b| b.is_ascii_lowercase()).count();
            let after_attribute = bytes[at - 1].is_ascii_whitespace() || b"/\"'".contains(&bytes[at - 1]);
            after_attribute && letters > 0 && name[letters..].trim_ascii_start().starts_with(b"=")
        })
    }

    #[test]
    fn a_browser_is_over_https_where_a_trusted_proxy_says_so() {
        let trusted: Vec<inferyes_net::forwarded::Cidr> = vec!["10.0.0.0/8".parse().unwrap()];
        let (proxy, stranger) = (Some("10.1.2.3".parse().unwrap()), Some("192.0.2.1".parse().unwrap()));
        let mut https = HeaderMap::new();
        https.insert("x-forwarded-proto", header::HeaderValue::from_static("HTTPS"));
        assert!(over_https(proxy, &https, &trusted));
        assert!(!over_https(stranger, &https, &trusted), "anyone can send the header");
        assert!(!over_https(proxy, &HeaderMap::new(), &trusted));
        https.insert("x-forwarded-proto", header::HeaderValue::from_static("http"));
        assert!(!over_https(proxy, &https, &trusted));
    }
}
