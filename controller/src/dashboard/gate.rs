//! Who may see the dashboard: a viewer's or the admin token, presented as
//! `Authorization: Bearer` (scripts), or kept by the browser in a session
//! cookie the login page gets. The cookie holds a MAC of the token, not the
//! token: a stolen cookie opens the dashboard, not the fleet's API, and
//! every controller of the fleet takes it (no session state to share).

use axum::http::{HeaderMap, HeaderValue, header};
use inferyes_proto::bearer::Accepted;

/// The session cookie's name.
pub const COOKIE: &str = "inferyes_session";
/// How long a browser keeps its session: a working day.
const SESSION_SECONDS: u32 = 12 * 3600;

pub struct Gate {
    tokens: Accepted,
    /// The session value of each token.
    sessions: Accepted,
}

impl Gate {
    pub fn new(tokens: Accepted) -> Gate {
        let sessions = Accepted::new(tokens.tokens().map(session_of).collect());
        Gate { tokens, sessions }
    }

    /// Whether these headers carry a token or a session it takes.
    pub fn allows(&self, headers: &HeaderMap) -> bool {
        let bearer = headers.get(header::AUTHORIZATION).map(HeaderValue::as_bytes);
        if inferyes_proto::bearer::check(bearer, &self.tokens).is_ok() {
            return true;
        }
        cookies(headers).any(|(name, value)| name == COOKIE && self.sessions.accepts(value.as_bytes()))
    }

    /// The `Set-Cookie` that keeps a session for `token`, if it is one it
    /// takes.
    pub fn login(&self, token: &str) -> Option<HeaderValue> {
        if !self.tokens.accepts(token.as_bytes()) {
            return None;
        }
        let cookie =
            format!("{COOKIE}={}; Path=/; Max-Age={SESSION_SECONDS}; HttpOnly; SameSite=Strict", session_of(token));
        HeaderValue::from_str(&cookie).ok()
    }
}

/// The `Set-Cookie` that ends a session.
pub fn logout() -> HeaderValue {
    HeaderValue::from_static("inferyes_session=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict")
}

/// A session's value: HMAC-SHA256 of a fixed label, keyed by the token.
fn session_of(token: &str) -> String {
    inferyes_proto::bearer::mac_hex(token, b"inferyes dashboard session v1")
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
        assert!(!gate.allows(&HeaderMap::new()));
        assert!(gate.allows(&with(header::AUTHORIZATION, "Bearer viewer-token-0123456789")));
        assert!(!gate.allows(&with(header::AUTHORIZATION, "Bearer viewer-token-012345678")));
        let set = gate.login("admin-token-0123456789").expect("a token it takes");
        let set = set.to_str().unwrap();
        assert!(set.contains("HttpOnly") && set.contains("SameSite=Strict"), "{set}");
        let session = set.split(';').next().unwrap();
        assert!(!session.contains("admin-token"), "the cookie is not the token: {session}");
        assert!(gate.allows(&with(header::COOKIE, &format!("theme=dark; {session}"))));
        assert!(!gate.allows(&with(header::COOKIE, "inferyes_session=admin-token-0123456789")));
        assert!(!gate.allows(&with(header::COOKIE, &format!("{session}0"))));
        assert!(gate.login("not-a-token").is_none());
        // Another gate of the same fleet (another controller) takes it.
        assert!(self::gate().allows(&with(header::COOKIE, session)));
    }
}
