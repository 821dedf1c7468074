//! Who may see the dashboard: a viewer's or the admin token, presented as
//! `Authorization: Bearer` (scripts), or kept by the browser in a session
//! cookie the login page gets. The cookie holds its expiry and a MAC of it
//! keyed by the token, not the token: a stolen cookie opens the dashboard,
//! not the fleet's API, and only until it expires; every controller of the
//! fleet takes it (no session state to share).

use axum::http::{HeaderMap, HeaderValue, header};
use inferyes_proto::bearer::Accepted;

/// The session cookie's name.
pub const COOKIE: &str = "inferyes_session";
/// How long a browser keeps its session: a working day.
const SESSION_SECONDS: u32 = 12 * 3600;
/// How far apart the controllers' clocks may be for one's session to be
/// another's.
const CLOCK_SKEW_SECONDS: u64 = 300;

pub struct Gate {
    tokens: Accepted,
}

impl Gate {
    pub fn new(tokens: Accepted) -> Gate {
        Gate { tokens }
    }

    /// Whether these headers carry a token, or a session of one that has
    /// not expired at `now` (Unix seconds).
    pub fn allows(&self, headers: &HeaderMap, now: u64) -> bool {
        let bearer = headers.get(header::AUTHORIZATION).map(HeaderValue::as_bytes);
        if inferyes_proto::bearer::check(bearer, &self.tokens).is_ok() {
            return true;
        }
        // The first of the name only: each costs a MAC per token.
        cookies(headers).find(|(name, _)| *name == COOKIE).is_some_and(|(_, value)| self.session_holds(value, now))
    }

    fn session_holds(&self, value: &str, now: u64) -> bool {
        let Some((expiry, mac)) = value.split_once('.') else { return false };
        let Ok(expires) = expiry.parse::<u64>() else { return false };
        // Made by a controller, so never further out than a session lasts
        // (give or take the controllers' clocks).
        if expires <= now || expires > now.saturating_add(u64::from(SESSION_SECONDS) + CLOCK_SKEW_SECONDS) {
            return false;
        }
        self.tokens.tokens().fold(false, |found, token| {
            found | inferyes_proto::apikey::constant_time_eq(mac.as_bytes(), session_mac(token, expires).as_bytes())
        })
    }

    /// The `Set-Cookie` that keeps a session for `token`, if it is one it
    /// takes, from `now` (Unix seconds); sent back over HTTPS only where the
    /// browser came `over_https`.
    pub fn login(&self, token: &str, now: u64, over_https: bool) -> Option<HeaderValue> {
        if !self.tokens.accepts(token.as_bytes()) {
            return None;
        }
        let expires = now + u64::from(SESSION_SECONDS);
        let mac = session_mac(token, expires);
        let secure = if over_https { "; Secure" } else { "" };
        let cookie =
            format!("{COOKIE}={expires}.{mac}; Path=/; Max-Age={SESSION_SECONDS}; HttpOnly; SameSite=Strict{secure}");
        HeaderValue::from_str(&cookie).ok()
    }
}

/// The `Set-Cookie` that ends a session.
pub fn logout() -> HeaderValue {
    HeaderValue::from_static("inferyes_session=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict")
}

/// A session's MAC: HMAC-SHA256 of a fixed label and its expiry, keyed by
/// the token.
fn session_mac(token: &str, expires: u64) -> String {
    inferyes_proto::bearer::mac_hex(token, format!("inferyes dashboard session v1 {expires}").as_bytes())
}

/// The `name=value` pairs of every `Cookie` header.
fn cookies(headers: &HeaderMap) -> impl Iterator<Item = (&str, &str)> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate() -> Gate {
        Gate::new(Accepted::new(vec!["viewer-token-0123456789".into(), "admin-token-0123456789".into()]))
    }

    fn with(name: header::HeaderName, value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(name, HeaderValue::from_str(value).unwrap());
        headers
    }

    #[test]
    fn a_token_or_its_session_opens_the_dashboard_and_nothing_else_does() {
        let gate = gate();
        let now = 1_800_000_000;
        assert!(!gate.allows(&HeaderMap::new(), now));
        assert!(gate.allows(&with(header::AUTHORIZATION, "Bearer viewer-token-0123456789"), now));
        assert!(!gate.allows(&with(header::AUTHORIZATION, "Bearer viewer-token-012345678"), now));
        let set = gate.login("admin-token-0123456789", now, false).expect("a token it takes");
        let set = set.to_str().unwrap();
        assert!(set.contains("HttpOnly") && set.contains("SameSite=Strict") && !set.contains("Secure"), "{set}");
        let over_https = gate.login("admin-token-0123456789", now, true).unwrap();
        assert!(over_https.to_str().unwrap().ends_with("; Secure"), "{over_https:?}");
        let session = set.split(';').next().unwrap();
        assert!(!session.contains("admin-token"), "the cookie is not the token: {session}");
        assert!(gate.allows(&with(header::COOKIE, &format!("theme=dark; {session}")), now));
        assert!(!gate.allows(&with(header::COOKIE, "inferyes_session=admin-token-0123456789"), now));
        assert!(!gate.allows(&with(header::COOKIE, &format!("{session}0")), now));
        assert!(gate.login("not-a-token", now, false).is_none());
        // Another gate of the same fleet (another controller) takes it.
        assert!(self::gate().allows(&with(header::COOKIE, session), now));
        // From a controller whose clock is a little ahead.
        let ahead = gate.login("viewer-token-0123456789", now + 10, false).unwrap();
        assert!(gate.allows(&with(header::COOKIE, ahead.to_str().unwrap().split(';').next().unwrap()), now));
        // Until it expires, whatever the browser keeps; an expiry moved on
        // breaks the MAC.
        let later = now + u64::from(SESSION_SECONDS);
        assert!(gate.allows(&with(header::COOKIE, session), later - 1));
        assert!(!gate.allows(&with(header::COOKIE, session), later));
        let (expiry, mac) = session.split_once('=').unwrap().1.split_once('.').unwrap();
        let moved = format!("{COOKIE}={}.{mac}", expiry.parse::<u64>().unwrap() + 1);
        assert!(!gate.allows(&with(header::COOKIE, &moved), now));
    }
}
