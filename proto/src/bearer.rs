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

/// A fleet's secret, which only controllers hold (the first makes it and
/// keeps it in etcd): what vouches for one node is derived from it, so
/// that the join token, which every agent holds, lets an agent ask to
/// join and vouches for nothing.
#[derive(Clone)]
pub struct FleetKey(String);

impl std::fmt::Debug for FleetKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FleetKey(..)")
    }
}

/// The bytes of a fleet secret a controller makes.
pub const FLEET_KEY_BYTES: usize = 32;

impl FleetKey {
    /// `None` for a secret too short to be one a controller made.
    pub fn new(secret: &[u8]) -> Option<FleetKey> {
        (secret.len() >= FLEET_KEY_BYTES).then(|| FleetKey(crate::hex(secret)))
    }

    /// What data planes derive each node's proxy credential from
    /// (`RoutingSnapshot.node_key`, with [`node_proxy_credential`]).
    pub fn node_key(&self) -> String {
        mac_hex(&self.0, b"inferyes node proxy key v3")
    }

    /// What data planes present to the proxy of `node_id`, held by the
    /// agent `instance` (its digest), issued to that agent.
    pub fn proxy_credential(&self, node_id: &str, instance: &str) -> String {
        issued_proxy_credential(&self.node_key(), node_id, instance)
    }

    /// What `node_id`, held by the agent `instance`, checks the slots sent
    /// to it with, issued to it alone: no other node (nor another agent
    /// that once held the id) can make a grant to send it one.
    pub fn intake_key(&self, node_id: &str, instance: &str) -> String {
        mac_hex(&self.0, format!("inferyes slot intake v3 {node_id} {instance}").as_bytes())
    }

    /// The controller's leave for one node to send another's backend
    /// slots, while the agent `to_instance` holds the receiving node.
    pub fn move_grant(&self, grant: &MoveGrant<'_>, to_instance: &str) -> String {
        move_grant(&self.intake_key(grant.to, to_instance), grant)
    }
}

/// What data planes present to the proxy of `node_id` held by the agent
/// `instance`, derived from the snapshot's `node_key`, as its controller
/// issued it.
pub fn issued_proxy_credential(node_key: &str, node_id: &str, instance: &str) -> String {
    // A node id holds no spaces; the instance digest is hex.
    mac_hex(node_key, format!("inferyes node proxy v3 {node_id} {instance}").as_bytes())
}

/// Which node may send slots to which node's backend, from which address,
/// until when.
#[derive(Clone, Copy, Debug)]
pub struct MoveGrant<'a> {
    pub from: &'a str,
    /// The host of the sending node's proxy URL: the receiver takes the
    /// slot only from that address.
    pub from_host: &'a str,
    pub to: &'a str,
    pub backend: &'a str,
    pub expires_unix_ms: u64,
}

/// How often controllers make their move grants again; each one holds
/// for between one and two of these.
pub const MOVE_GRANT_RENEW_MS: u64 = 5 * 60 * 1000;

/// When a grant made at `now_ms` expires: the same for every controller
/// within one renewal period, so that grants change only once a period.
pub fn move_grant_expiry(now_ms: u64) -> u64 {
    (now_ms / MOVE_GRANT_RENEW_MS).saturating_add(2).saturating_mul(MOVE_GRANT_RENEW_MS)
}

/// The host of a proxy URL, as a grant names it: lowercase, an IPv6
/// address without its brackets.
pub fn url_host(url: &str) -> Option<String> {
    let uri = url.parse::<http::Uri>().ok()?;
    let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty()).then(|| host.to_ascii_lowercase())
}

/// A grant as the receiving node makes it again with its `intake_key`:
/// HMAC-SHA256 of the grant, in hex.
pub fn move_grant(intake_key: &str, grant: &MoveGrant<'_>) -> String {
    let MoveGrant { from, from_host, to, backend, expires_unix_ms } = grant;
    // Node and backend ids hold no spaces; a host is last.
    mac_hex(
        intake_key,
        format!("inferyes move grant v3 {from} {to} {backend} {expires_unix_ms} {from_host}").as_bytes(),
    )
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
/// HMAC-SHA256 of the whole move, keyed by the controller's grant for
/// that pair of nodes. The receiving agent makes the grant again with its
/// own intake key, so it holds no list of credentials; one captured opens
/// that node's intake for that one file, from that node, once, until it
/// expires.
pub fn slot_move_credential(grant: &str, slot: &SlotMove<'_>) -> String {
    let SlotMove { from, to, backend, session, sha256, tokens, expires_unix_ms } = slot;
    // Node and backend ids hold no spaces; a session key may, and is last
    // but for fixed-form fields.
    let text = format!("inferyes slot move v3 {from} {to} {backend} {tokens} {expires_unix_ms} {sha256} {session}");
    mac_hex(grant, text.as_bytes())
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
        let credential = slot_move_credential("grant", &slot);
        assert_eq!(credential, slot_move_credential("grant", &slot), "made again, the same");
        for other in [
            slot_move_credential("other", &slot),
            slot_move_credential("grant", &SlotMove { from: "c", ..slot }),
            slot_move_credential("grant", &SlotMove { to: "c", ..slot }),
            slot_move_credential("grant", &SlotMove { from: "b", to: "a", ..slot }),
            slot_move_credential("grant", &SlotMove { backend: "other", ..slot }),
            slot_move_credential("grant", &SlotMove { session: "root-2", ..slot }),
            slot_move_credential("grant", &SlotMove { sha256: "00fe", ..slot }),
            slot_move_credential("grant", &SlotMove { tokens: 11, ..slot }),
            slot_move_credential("grant", &SlotMove { expires_unix_ms: 1_001, ..slot }),
        ] {
            assert_ne!(credential, other);
        }
    }

    #[test]
    fn what_vouches_for_a_node_comes_from_the_fleet_key_and_names_that_node() {
        assert!(FleetKey::new(&[7; FLEET_KEY_BYTES - 1]).is_none(), "too short to be a controller's");
        let key = FleetKey::new(&[7; FLEET_KEY_BYTES]).unwrap();
        let other = FleetKey::new(&[8; FLEET_KEY_BYTES]).unwrap();
        assert_eq!(format!("{key:?}"), "FleetKey(..)", "never logged");
        // A data plane derives from the snapshot's key what the node was issued.
        assert_eq!(key.proxy_credential("a", "i1"), issued_proxy_credential(&key.node_key(), "a", "i1"));
        assert_ne!(key.proxy_credential("a", "i1"), key.proxy_credential("b", "i1"));
        assert_ne!(key.proxy_credential("a", "i1"), key.proxy_credential("a", "i2"), "another agent, the same id");
        assert_ne!(key.proxy_credential("a", "i1"), other.proxy_credential("a", "i1"));
        // Nothing a join token derives opens a node.
        assert_ne!(key.node_key(), proxy_key("a"));
        assert_ne!(key.intake_key("a", "i1"), key.intake_key("b", "i1"));
        assert_ne!(key.intake_key("a", "i1"), key.intake_key("a", "i2"));
        assert_ne!(key.intake_key("a", "i1"), key.proxy_credential("a", "i1"));
        let grant = MoveGrant { from: "a", from_host: "10.0.0.1", to: "b", backend: "main", expires_unix_ms: 1_000 };
        let made = key.move_grant(&grant, "i1");
        assert_eq!(made, move_grant(&key.intake_key("b", "i1"), &grant), "the receiver makes it again");
        assert_ne!(made, move_grant(&key.intake_key("c", "i1"), &grant), "no other node can");
        assert_ne!(made, move_grant(&key.intake_key("b", "i2"), &grant), "nor another agent of that id");
        let (renew, now) = (MOVE_GRANT_RENEW_MS, 7 * MOVE_GRANT_RENEW_MS + 1);
        assert_eq!(move_grant_expiry(now), move_grant_expiry(now + renew - 2), "one grant a period");
        assert!((now + renew..=now + 2 * renew).contains(&move_grant_expiry(now)));
        assert_eq!(url_host("http://Node-A.example:9100").as_deref(), Some("node-a.example"));
        assert_eq!(url_host("https://[::1]:9100/").as_deref(), Some("::1"));
        assert_eq!(url_host("not a url"), None);
        for changed in [
            MoveGrant { from: "c", ..grant },
            MoveGrant { from_host: "10.0.0.2", ..grant },
            MoveGrant { backend: "other", ..grant },
            MoveGrant { expires_unix_ms: 1_001, ..grant },
        ] {
            assert_ne!(made, key.move_grant(&changed, "i1"));
        }
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
