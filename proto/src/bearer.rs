//! Shared secrets on the wire, as `Authorization: Bearer <token>`: the
//! admin token on `FleetService` calls, and the fleet's join token, which
//! data planes present to controllers (every `RoutingService` call) and to
//! agents (every request they forward).

use tonic::metadata::{Ascii, MetadataValue};

/// A tonic interceptor that sends a token, when it has one, with every call.
#[derive(Clone, Default)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl Bearer {
    pub fn new(token: Option<&str>) -> anyhow::Result<Bearer> {
        let value = token
            .map(|t| format!("Bearer {t}").parse::<MetadataValue<Ascii>>())
            .transpose()
            .map_err(|_| anyhow::anyhow!("a token must be printable ASCII"))?;
        Ok(Bearer(value))
    }
}

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request.metadata_mut().insert("authorization", value.clone());
        }
        Ok(request)
    }
}

/// The error code of an agent's refusal of a request without the fleet's
/// credential, for whoever reads the body.
pub const FLEET_TOKEN_REQUIRED: &str = "fleet_token_required";

/// The header an agent marks its own refusal with, and strips from every
/// backend answer: data planes tell the fleet's misconfiguration from a
/// client's 401 by it, which no backend can forge through the agent.
pub const AGENT_REFUSED: &str = "x-inferyes-agent-refused";

/// `Bearer <token>` as an HTTP header value, marked sensitive (never logged
/// or indexed); `None` for a token that cannot be one.
pub fn header_value(token: &str) -> Option<http::HeaderValue> {
    let mut value = http::HeaderValue::try_from(format!("Bearer {token}")).ok()?;
    value.set_sensitive(true);
    Some(value)
}

/// What data planes presented to every agent of a fleet whose join token is
/// `join_token`, before credentials were per node: HMAC-SHA256 of a fixed
/// label keyed by the token, in hex. Still sent to agents of that version.
pub fn proxy_credential(join_token: &str) -> String {
    mac_hex(join_token, b"inferyes agent proxy v1")
}

/// What each node's credential is derived from ([`node_proxy_credential`]):
/// HMAC-SHA256 of a fixed label keyed by the join token, in hex. The
/// controller hands it to data planes in snapshots; the join token itself
/// never leaves controllers and agents.
pub fn proxy_key(join_token: &str) -> String {
    mac_hex(join_token, b"inferyes agent proxy key v2")
}

/// The metadata a controller presents, beside the data plane token, when
/// it follows another's live state.
pub const PEER_CREDENTIAL: &str = "x-inferyes-peer";

/// What a controller presents to follow another's live state
/// ([`PEER_CREDENTIAL`]): HMAC-SHA256 of a fixed label keyed by the join
/// token, in hex. Controllers hold the join token; data planes, whose
/// token takes every other RoutingService call, do not.
pub fn peer_credential(join_token: &str) -> String {
    mac_hex(join_token, b"inferyes controller peer v1")
}

/// What data planes present to the agent of `node_id`: HMAC-SHA256 of the
/// node's id keyed by the [`proxy_key`], in hex. An agent derives its own
/// from its join tokens; one captured at a node opens no other node.
pub fn node_proxy_credential(proxy_key: &str, node_id: &str) -> String {
    mac_hex(proxy_key, format!("inferyes agent proxy v2 {node_id}").as_bytes())
}

/// What one slot's move is: from which node to which node's backend,
/// whose conversation, the file's SHA-256 and tokens, and until when it
/// may be taken.
#[derive(Clone, Copy, Debug)]
pub struct SlotMove<'a> {
    pub from: &'a str,
    pub to: &'a str,
    pub backend: &'a str,
    pub session: &'a str,
    pub sha256: &'a str,
    pub tokens: u32,
    pub expires_unix_ms: u64,
}

/// What the sending agent presents to the receiving one with a slot file:
/// HMAC-SHA256 of the whole move, keyed by a key derived from the join
/// token. The receiving agent makes it again from its own join tokens, so
/// it holds no list of credentials; one captured opens that node's intake
/// for that one file, from that node, once, until it expires.
pub fn slot_move_credential(join_token: &str, slot: &SlotMove<'_>) -> String {
    let key = mac_hex(join_token, b"inferyes slot move key v2");
    let SlotMove { from, to, backend, session, sha256, tokens, expires_unix_ms } = slot;
    // Node and backend ids hold no spaces; a session key may, and is last
    // but for fixed-form fields.
    let text = format!("inferyes slot move v2 {from} {to} {backend} {tokens} {expires_unix_ms} {sha256} {session}");
    mac_hex(&key, text.as_bytes())
}

/// HMAC-SHA256 of `label` keyed by `secret`, in hex: a value that proves
/// the secret without carrying it.
pub fn mac_hex(secret: &str, label: &[u8]) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.as_bytes());
    crate::hex(ring::hmac::sign(&key, label).as_ref())
}

/// SHA-256 of `bytes`, in hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    crate::hex(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref())
}

/// The tokens a secret may be (see [`crate::files::read_tokens`]).
#[derive(Clone, Debug)]
pub struct Accepted(std::sync::Arc<[String]>);

impl Accepted {
    pub fn new(tokens: Vec<String>) -> Accepted {
        Accepted(tokens.into())
    }

    /// The one to present oneself: the first (a file's first line is the
    /// current token, later lines are taken during a rotation).
    pub fn presented(&self) -> Option<&str> {
        self.0.first().map(String::as_str)
    }

    pub fn tokens(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(String::as_str)
    }

    /// Whether `token` is one of them, compared in constant time with each.
    pub fn accepts(&self, token: &[u8]) -> bool {
        self.0.iter().fold(false, |found, expected| found | crate::apikey::constant_time_eq(token, expected.as_bytes()))
    }
}

/// Why a token was not accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No `Bearer` token at all.
    Missing,
    /// A token, not the expected one.
    Wrong,
}

/// Checks an `Authorization` value against the accepted tokens.
pub fn check(authorization: Option<&[u8]>, accepted: &Accepted) -> Result<(), Refusal> {
    match authorization.and_then(|value| value.strip_prefix(b"Bearer ")) {
        Some(token) if accepted.accepts(token) => Ok(()),
        Some(_) => Err(Refusal::Wrong),
        None => Err(Refusal::Missing),
    }
}

/// Checks a gRPC call's token, when one is expected.
pub fn check_call<T>(request: &tonic::Request<T>, accepted: Option<&Accepted>) -> Result<(), Refusal> {
    let Some(accepted) = accepted else { return Ok(()) };
    check(request.metadata().get("authorization").map(MetadataValue::as_bytes), accepted)
}

#[cfg(test)]
mod tests {
    use tonic::service::Interceptor;

    use super::*;

    #[test]
    fn the_token_sent_is_the_token_checked() {
        let expected = "a-token-of-the-fleet";
        let accepted = |tokens: &[&str]| Accepted::new(tokens.iter().map(ToString::to_string).collect());
        let mut sent = Bearer::new(Some(expected)).unwrap().call(tonic::Request::new(())).unwrap();
        assert_eq!(check_call(&sent, Some(&accepted(&[expected]))), Ok(()));
        assert_eq!(check_call(&sent, Some(&accepted(&["another-token-entirely"]))), Err(Refusal::Wrong));
        // While a token is rotated, the old and the new are both taken.
        assert_eq!(check_call(&sent, Some(&accepted(&["the-new-token-of-the-fleet", expected]))), Ok(()));
        assert_eq!(check_call(&sent, None), Ok(()), "nothing expected, nothing checked");
        sent.metadata_mut().remove("authorization");
        assert_eq!(check_call(&sent, Some(&accepted(&[expected]))), Err(Refusal::Missing));
        let unsent = Bearer::new(None).unwrap().call(tonic::Request::new(())).unwrap();
        assert!(unsent.metadata().get("authorization").is_none());
        assert_eq!(check(Some(b"Basic a-token-of-the-fleet"), &accepted(&[expected])), Err(Refusal::Missing));
        assert!(Bearer::new(Some("line\nbreak")).is_err());
        let value = header_value(expected).unwrap();
        assert!(value.is_sensitive());
        assert_eq!(check(Some(value.as_bytes()), &accepted(&[expected])), Ok(()));
        assert!(header_value("line\nbreak").is_none());
    }

    #[test]
    fn a_slot_move_credential_names_the_whole_move() {
        let slot = SlotMove {
            from: "a",
            to: "b",
            backend: "main",
            session: "root-1",
            sha256: "00ff",
            tokens: 10,
            expires_unix_ms: 1_000,
        };
        let credential = slot_move_credential("join", &slot);
        assert_eq!(credential, slot_move_credential("join", &slot), "made again, the same");
        for other in [
            slot_move_credential("other", &slot),
            slot_move_credential("join", &SlotMove { from: "c", ..slot }),
            slot_move_credential("join", &SlotMove { to: "c", ..slot }),
            slot_move_credential("join", &SlotMove { from: "b", to: "a", ..slot }),
            slot_move_credential("join", &SlotMove { backend: "other", ..slot }),
            slot_move_credential("join", &SlotMove { session: "root-2", ..slot }),
            slot_move_credential("join", &SlotMove { sha256: "00fe", ..slot }),
            slot_move_credential("join", &SlotMove { tokens: 11, ..slot }),
            slot_move_credential("join", &SlotMove { expires_unix_ms: 1_001, ..slot }),
        ] {
            assert_ne!(credential, other);
        }
        assert_ne!(credential, node_proxy_credential(&proxy_key("join"), "b"), "not the node's proxy credential");
    }

    #[test]
    fn a_node_s_credential_is_its_own() {
        let key = proxy_key("the-fleet-join-token");
        let a = node_proxy_credential(&key, "node-a");
        assert_eq!(a, node_proxy_credential(&proxy_key("the-fleet-join-token"), "node-a"), "derived alike");
        assert_ne!(a, node_proxy_credential(&key, "node-b"));
        assert_ne!(a, node_proxy_credential(&proxy_key("another-join-token"), "node-a"));
        for other in [&key, &proxy_credential("the-fleet-join-token")] {
            assert_ne!(&a, other);
        }
        assert_eq!(a.len(), 64);
    }
}
