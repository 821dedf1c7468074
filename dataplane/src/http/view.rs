//! The routing view of a request body: the few fields routing reads. The
//! rest of the body is never materialised; it is forwarded as received.

use std::borrow::Cow;
use std::ops::Range;

use http::{HeaderMap, HeaderName};
use inferyes_proto::ErrorKind;
use inferyes_proto::headers::MAX_SESSION_KEY_BYTES;
use inferyes_proto::kinds::{ModelIn, Row, Session};

use super::form;
use super::scan::{Fields, Raw, ScanError, scan};
use crate::auth::SessionScope;
use crate::error::{ApiError, ErrorCode};
use crate::routing::{stable_hash, text_hash};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingView {
    pub model: String,
    /// Where the model's name sits in the body, inside its quotes, as
    /// written: an alias is rewritten there.
    pub model_span: Range<usize>,
    pub stream: bool,
    pub prompt_cache_key: Option<String>,
    /// A hash of the conversation's beginning (system prompt and first user
    /// message, or the prompt's first bytes), stable across its turns.
    pub root: Option<u64>,
    /// Whether the body carries images or audio, which make its size a poor
    /// measure of its tokens.
    pub has_media: bool,
    /// The client named `stream_options` (and so said whether it wants
    /// usage; `null` included: a second member beside it would be read by
    /// some servers and refused by others).
    pub has_stream_options: bool,
    /// The client named `return_progress`: its stream's progress events,
    /// if any, are its own.
    pub has_return_progress: bool,
    /// The output is constrained (tools, a response format, a grammar).
    pub constrained: bool,
    /// The model is a form's field, written as it is, not as JSON.
    pub in_form: bool,
    /// The most tokens the request asks to be generated, where it says.
    pub max_tokens: Option<u64>,
}

/// Bytes of a completion prompt that make up its root.
const PROMPT_ROOT_BYTES: usize = 512;

/// The routing view of a request to a path of `row`, its model where the
/// row says.
pub fn parse_request_view(row: &Row, headers: &HeaderMap, body: &[u8]) -> Result<RoutingView, ApiError> {
    match row.model {
        ModelIn::Json => parse_json_view(body, row.session),
        ModelIn::Multipart => parse_form_view(headers, body),
    }
}

/// The routing view of an upload: its form's `model` and `stream`.
fn parse_form_view(headers: &HeaderMap, body: &[u8]) -> Result<RoutingView, ApiError> {
    let invalid = |message: String| ApiError::new(ErrorKind::BadRequest, message, ErrorCode::InvalidBody);
    let content_type = headers.get(http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default();
    let Some(boundary) = form::boundary(content_type) else {
        return Err(invalid("this path takes a multipart/form-data body with a boundary".into()));
    };
    let fields = form::scan(body, boundary).map_err(|error| match error {
        form::FormError::Malformed(what) => invalid(format!("the multipart body is not well formed: {what}")),
        form::FormError::Duplicate(field) => invalid(format!("the form gives '{field}' more than once")),
    })?;
    let (Some(model), Some(model_span)) = (fields.model.filter(|m| !m.is_empty()), fields.model_span) else {
        return Err(missing_model());
    };
    short_enough(model)?;
    Ok(RoutingView {
        model: model.to_string(),
        model_span,
        stream: fields.stream,
        prompt_cache_key: None,
        root: None,
        has_media: true,
        has_stream_options: false,
        has_return_progress: false,
        constrained: false,
        in_form: true,
        max_tokens: None,
    })
}

fn missing_model() -> ApiError {
    ApiError::new(ErrorKind::BadRequest, "you must provide a model parameter", ErrorCode::MissingRequiredParameter)
        .param("model")
}

/// Refuses a model's name longer than any the fleet lists, without
/// repeating it back or keeping it anywhere.
fn short_enough(model: &str) -> Result<(), ApiError> {
    if model.len() <= inferyes_proto::MAX_NAME_BYTES {
        return Ok(());
    }
    let message = format!("model names are at most {} bytes long", inferyes_proto::MAX_NAME_BYTES);
    Err(ApiError::new(ErrorKind::BadRequest, message, ErrorCode::InvalidRequest).param("model"))
}

/// The routing view of a JSON body, as chat's are read.
pub fn parse_view(body: &[u8]) -> Result<RoutingView, ApiError> {
    parse_json_view(body, Session::Opening)
}

/// `session`: where the path's session key is found, the opening of which
/// kind of body its root is (if any).
fn parse_json_view(body: &[u8], session: Session) -> Result<RoutingView, ApiError> {
    let fields = scan(body).map_err(|error| refusal(body, error))?;
    guarded(body, &fields)?;
    let max_tokens = max_tokens(&fields);
    let root = match session {
        Session::None | Session::Named => None,
        Session::Opening => conversation_root(&fields, false),
        Session::MessagesOpening => conversation_root(&fields, true),
    };
    let (Some(model), Some(model_span)) = (fields.model.filter(|m| !m.is_empty()), fields.model_span) else {
        return Err(missing_model());
    };
    short_enough(&model)?;
    Ok(RoutingView {
        model: model.into_owned(),
        model_span,
        stream: fields.stream.unwrap_or(false),
        prompt_cache_key: fields.prompt_cache_key.filter(|k| !k.is_empty()).map(Cow::into_owned),
        root,
        has_media: fields.has_media,
        has_stream_options: fields.stream_options_named,
        has_return_progress: fields.return_progress_named,
        constrained: fields.constrained,
        in_form: false,
        max_tokens,
    })
}

/// The body's members that reach past the request into the shared server,
/// refused or held to their bounds (`super::guard`), and media named by a
/// URL the server would fetch.
fn guarded(body: &[u8], fields: &Fields<'_>) -> Result<(), ApiError> {
    let unsupported = |message: String, param: &'static str| {
        ApiError::new(ErrorKind::BadRequest, message, ErrorCode::UnsupportedParameter).param(param)
    };
    for &(at, raw) in &fields.guarded {
        if let Some(why) = super::guard::check(at, raw) {
            return Err(unsupported(why, super::guard::GUARDED[at].0));
        }
    }
    // Several prompts are as many tasks of the server's: each takes a slot,
    // evicting another conversation's cache, past the gateway's queue.
    if let Some(count) = fields.prompt.map(super::scan::prompts).filter(|n| *n > 1) {
        let message = format!(
            "a request takes one prompt, not {count}: each would take a slot of the server's, \
             evicting another conversation's cache"
        );
        return Err(unsupported(message, "prompt"));
    }
    if fields.has_media {
        let message = match super::guard::remote_media(body) {
            Ok(None) => return Ok(()),
            Ok(Some(url)) => {
                let shown: String = url.chars().take(64).collect();
                format!("media must be sent inline (a `data:` URL), not fetched from `{shown}`")
            }
            Err(_) => {
                "the conversation is not JSON the gateway reads (a number out of range, or a broken escape)".into()
            }
        };
        return Err(unsupported(message, "messages"));
    }
    Ok(())
}

/// The request's limit on generated tokens: the largest it names, in any
/// of the members an API names it by, as often as it names them. The
/// server takes one of them (llama-server: `n_predict` before
/// `max_completion_tokens` before `max_tokens`, the last of a repeated
/// member), so what is held for the request and what the queue charges is
/// never less than what it may generate.
fn max_tokens(fields: &Fields<'_>) -> Option<u64> {
    fields
        .guarded
        .iter()
        .filter_map(|&(at, raw)| match super::guard::GUARDED[at].0 {
            "max_tokens" | "max_completion_tokens" | "max_output_tokens" | "n_predict" => raw.parse().ok(),
            _ => None,
        })
        .max()
}

/// A refused body's error, in the words OpenAI uses where it has them.
fn refusal(body: &[u8], error: ScanError) -> ApiError {
    match error {
        ScanError::Syntax { what, at } => {
            let (line, column) = ScanError::line_and_column(body, at);
            ApiError::new(
                ErrorKind::BadRequest,
                format!("the request body is not valid JSON: {what} at line {line} column {column}"),
                ErrorCode::InvalidJson,
            )
        }
        ScanError::NotObject { found } => ApiError::new(
            ErrorKind::BadRequest,
            format!("the request body must be a JSON object, not {found}"),
            ErrorCode::InvalidJson,
        ),
        ScanError::Type { path, param, expected, found } => ApiError::new(
            ErrorKind::BadRequest,
            format!("Invalid type for '{path}': expected {expected}, but got {found} instead."),
            ErrorCode::InvalidType,
        )
        .param(param),
        ScanError::Duplicate { path, param } => ApiError::new(
            ErrorKind::BadRequest,
            format!("the request body gives '{path}' more than once"),
            ErrorCode::InvalidJson,
        )
        .param(param),
    }
}

/// The body with `"stream_options":{"include_usage":true}` added, so the
/// backend ends its stream with the usage the ledger needs. `None` when the
/// body does not start with an object.
pub fn with_usage_requested(body: &bytes::Bytes) -> Option<bytes::Bytes> {
    with_member(body, br#""stream_options":{"include_usage":true},"#)
}

/// The body with `"return_progress":true` added, so that llama-server says
/// how much of the prompt it read before the first token. `None` when the
/// body does not start with an object.
pub fn with_progress_requested(body: &bytes::Bytes) -> Option<bytes::Bytes> {
    with_member(body, br#""return_progress":true,"#)
}

/// `member` (with its comma) spliced in after the body's opening brace:
/// the rest of the bytes are untouched.
fn with_member(body: &bytes::Bytes, member: &[u8]) -> Option<bytes::Bytes> {
    let at = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[at] != b'{' {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() + member.len());
    out.extend_from_slice(&body[..=at]);
    out.extend_from_slice(member);
    out.extend_from_slice(&body[at + 1..]);
    Some(out.into())
}

fn conversation_root(fields: &Fields<'_>, anthropic: bool) -> Option<u64> {
    if let Some(opening) = &fields.messages {
        let user = opening.user.flatten()?;
        if anthropic {
            // The system prompt stands beside the messages.
            let system = fields.system.or(opening.system.flatten());
            return Some(text_hash(&[&without_cache_marks(system), &without_cache_marks(Some(user))]));
        }
        let system = opening.system.flatten().or(opening.developer.flatten());
        Some(text_hash(&[text(system), text(Some(user))]))
    } else if let Some(input) = fields.input {
        Some(text_hash(&[text(fields.instructions), head(input)]))
    } else {
        fields.prompt.map(|prompt| text_hash(&[head(prompt)]))
    }
}

/// A JSON value's text, or nothing.
fn text(value: Option<Raw<'_>>) -> &[u8] {
    value.map_or(&[], str::as_bytes)
}

/// A Messages API content as its root hashes it: a hash of each content
/// block's members but `cache_control` (which Anthropic clients move to
/// the latest turn, so the first message has one in its first turn and none
/// after), whatever order they came in. A string is hashed as the text
/// block it stands for, so a client that writes the turn as a block once
/// and as a string after keeps its root.
fn without_cache_marks(value: Option<Raw<'_>>) -> Cow<'_, [u8]> {
    let Some(raw) = value else { return Cow::Borrowed(&[]) };
    if raw.starts_with('"') {
        let block = member_hash("text", raw).wrapping_add(member_hash("type", "\"text\""));
        return Cow::Owned(block.to_le_bytes().to_vec());
    }
    if !raw.starts_with('[') {
        return Cow::Borrowed(raw.as_bytes());
    }
    let mut out = Vec::new();
    let mut blocks = serde_json::Deserializer::from_str(raw);
    // Stopped early (enough was read) or not, what was written is the root.
    let _ = serde::Deserializer::deserialize_seq(&mut blocks, Blocks { out: &mut out });
    Cow::Owned(out)
}

/// Content blocks that make up a root, at most: each is read whole, and a
/// root of this many is enough to tell conversations apart.
const ROOT_BLOCKS: usize = 4096;

/// Writes each content block's hash into `out`, up to [`ROOT_BLOCKS`]; then
/// stops the parse with an error, which the caller ignores. Each block is
/// read as borrowed text, one at a time.
struct Blocks<'o> {
    out: &'o mut Vec<u8>,
}

impl<'de> serde::de::Visitor<'de> for Blocks<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("content blocks")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        for _ in 0..ROOT_BLOCKS {
            let Some(block) = seq.next_element::<&'de serde_json::value::RawValue>()? else { return Ok(()) };
            let block = block.get();
            let members = block
                .starts_with('{')
                .then(|| {
                    let mut object = serde_json::Deserializer::from_str(block);
                    serde::Deserializer::deserialize_map(&mut object, Members).ok()
                })
                .flatten();
            let hash = members.unwrap_or_else(|| text_hash(&[block.as_bytes()]));
            self.out.extend_from_slice(&hash.to_le_bytes());
        }
        Err(serde::de::Error::custom("enough of the opening read"))
    }
}

/// One member of a block, hashed: a block's hash is the sum of its
/// members', which no order of theirs changes.
fn member_hash(name: &str, value: &str) -> u64 {
    text_hash(&[name.as_bytes(), value.as_bytes()])
}

/// A block's hash: the sum of its members' but `cache_control`, each as
/// written.
struct Members;

impl<'de> serde::de::Visitor<'de> for Members {
    type Value = u64;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a content block")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<u64, A::Error> {
        let mut hash = 0u64;
        while let Some(name) = map.next_key::<Cow<'de, str>>()? {
            let value = map.next_value::<&'de serde_json::value::RawValue>()?;
            if name != "cache_control" {
                hash = hash.wrapping_add(member_hash(&name, value.get()));
            }
        }
        Ok(hash)
    }
}

/// The first bytes of a JSON value's text that make up a root.
fn head(value: Raw<'_>) -> &[u8] {
    let bytes = value.as_bytes();
    &bytes[..bytes.len().min(PROMPT_ROOT_BYTES)]
}

/// The header a client names its conversation with, first of all.
const SESSION_HEADER: HeaderName = HeaderName::from_static("x-session-id");

/// Headers coding agents name their conversations with, after the body's
/// `prompt_cache_key`: the client's own field says more than a tool's
/// header. Names, not strings: a lookup by string parses and hashes it
/// first.
static AGENT_SESSION_HEADERS: [HeaderName; 3] = [
    HeaderName::from_static("x-claude-code-session-id"),
    HeaderName::from_static("session-id"),
    HeaderName::from_static("x-session_id"),
];

/// The request's session key: the `X-Session-ID` header, else the body's
/// `prompt_cache_key` (OpenAI's own field for this), else a coding agent's
/// session header, else a hash of the model and the conversation's root,
/// so a multi-turn chat sticks without any change on the client. Scoped
/// by `scope` where there is one, before it is bounded: one tenant's
/// conversation is never another's, whatever key either sends or derives.
pub fn session_key(headers: &HeaderMap, view: &RoutingView, scope: Option<SessionScope<'_>>) -> Option<String> {
    let header = |name: &HeaderName| headers.get(name).and_then(|v| v.to_str().ok()).filter(|v| !v.is_empty());
    let sent = header(&SESSION_HEADER)
        .or(view.prompt_cache_key.as_deref().filter(|v| !v.is_empty()))
        .or_else(|| AGENT_SESSION_HEADERS.iter().find_map(header));
    let Some(key) = sent else {
        return view
            .root
            .map(|root| hashed_key(*b"root-", scope_hash(scope), root ^ stable_hash(view.model.as_bytes())));
    };
    let scoped = match scope {
        Some(SessionScope { kind, id }) => Cow::Owned(format!("{kind}{id}/{key}")),
        None => Cow::Borrowed(key),
    };
    Some(if travels(&scoped) {
        scoped.into_owned()
    } else {
        hashed_key(*b"sess-", scope_hash(scope), text_hash(&[key.as_bytes()]))
    })
}

/// Whether a client's key can be a session key as it is: short, and able to
/// travel in a header unchanged. Every other key is hashed: every data
/// plane derives the same, and a client cannot fill its node's session
/// table, the node's record in etcd and every routing snapshot with
/// megabytes of key.
fn travels(key: &str) -> bool {
    let bytes = key.as_bytes();
    bytes.len() <= MAX_SESSION_KEY_BYTES
        && bytes.iter().all(|b| (b' '..=b'~').contains(b))
        && bytes.first() != Some(&b' ')
        && bytes.last() != Some(&b' ')
}

fn scope_hash(scope: Option<SessionScope<'_>>) -> u64 {
    scope.map_or(0, |SessionScope { kind, id }| text_hash(&[kind.as_bytes(), id.as_bytes()]))
}

/// A prefix, the scope's hash and the key's, in 16 hex digits each, written
/// without the formatting machinery (every request without a session of
/// its own has one). The scope's hash stands apart rather than mixed into
/// the key's: these hashes are unkeyed and invertible, so a client could
/// choose an opening, or a long key, whose mixed hash equals another
/// tenant's; it cannot choose the scope its own key is written under.
fn hashed_key(prefix: [u8; 5], scope: u64, hash: u64) -> String {
    let mut key = [0u8; 37];
    key[..5].copy_from_slice(&prefix);
    inferyes_proto::write_hex(&mut key[5..], (u128::from(scope) << 64) | u128::from(hash));
    // ASCII throughout: the check is a few word compares, not a lossy copy.
    String::from_utf8(key.to_vec()).unwrap_or_default()
}

/// An estimate of a body's prompt tokens, for routing's cost and its
/// preference for nodes whose window the prompt fits: an English token is
/// four to six bytes and JSON adds framing, so a fifth of the bytes. It
/// refuses nothing: the server's tokenizer counts a prompt for a refusal
/// (and [`least_prompt_tokens`], a count no tokenizer goes under). Bodies with media
/// are not estimated: an image's bytes say little of its tokens.
pub fn estimated_prompt_tokens(body_len: usize, view: &RoutingView) -> u32 {
    if view.has_media { 0 } else { metered_prompt_estimate(body_len) }
}

/// More bytes than any token of a vocabulary in use spans (the longest are
/// runs of spaces or symbols, tens of bytes).
pub const MAX_BYTES_PER_TOKEN: usize = 128;

/// The fewest tokens a body's prompt may be, whatever the tokenizer: its
/// bytes over [`MAX_BYTES_PER_TOKEN`]. A body whose bytes are that many
/// windows is refused without a node tokenizing it (megabytes of it, each
/// time). Bodies with media are not counted.
pub fn least_prompt_tokens(body_len: usize, view: &RoutingView) -> u64 {
    if view.has_media { 0 } else { (body_len / MAX_BYTES_PER_TOKEN) as u64 }
}

/// The prompt tokens a request is billed for when its answer says none: a
/// fifth of its bytes, media or not. For a body with an image that errs
/// high, never at 0: adding an image cannot make a request free.
pub fn metered_prompt_estimate(body_len: usize) -> u32 {
    u32::try_from(body_len / 5).unwrap_or(u32::MAX)
}

/// The body with `model` replaced (an alias resolved) where the view found
/// the name, the rest untouched.
pub fn with_model(body: &bytes::Bytes, view: &RoutingView, model: &str) -> bytes::Bytes {
    let quoted = serde_json::to_string(model).unwrap_or_default();
    let escaped = if view.in_form {
        // A form's value is its bytes: a name that could end the part is
        // not written into one.
        if model.bytes().any(|b| b.is_ascii_control() || b == b'"') {
            inferyes_net::warn_every!(
                model,
                "an upload's alias names a model that cannot be written into a form; sent as the alias"
            );
            return body.clone();
        }
        model
    } else {
        // Inside its quotes (a name can end with an escaped quote of its own).
        quoted.get(1..quoted.len().saturating_sub(1)).unwrap_or_default()
    };
    let span = &view.model_span;
    let (Some(before), Some(after)) = (body.get(..span.start), body.get(span.end..)) else {
        // Not this body's view: nothing is cut blind.
        return body.clone();
    };
    let mut out = Vec::with_capacity(body.len() + escaped.len());
    out.extend_from_slice(before);
    out.extend_from_slice(escaped.as_bytes());
    out.extend_from_slice(after);
    out.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashed_keys_are_the_prefix_and_the_hash_in_hex() {
        assert_eq!(
            hashed_key(*b"root-", 0xfedc_ba98_7654_3210, 0x0123_4567_89ab_cdef),
            format!("root-{:016x}{:016x}", 0xfedc_ba98_7654_3210_u64, 0x0123_4567_89ab_cdef_u64)
        );
        assert_eq!(hashed_key(*b"sess-", 0, 7), format!("sess-{:032x}", 7));
    }

    #[test]
    fn keys_too_long_or_that_cannot_travel_in_a_header_are_hashed() {
        let key = |k: &str| {
            let view = parse_view(format!(r#"{{"model":"m","prompt_cache_key":{}}}"#, serde_json::json!(k)).as_bytes())
                .unwrap();
            session_key(&HeaderMap::new(), &view, None).unwrap()
        };
        let longest = "k".repeat(MAX_SESSION_KEY_BYTES);
        assert_eq!(key(&longest), longest);
        assert_eq!(key("chat 1"), "chat 1");
        for sent in [
            "k".repeat(MAX_SESSION_KEY_BYTES + 1),
            "k".repeat(400_000),
            "café".into(),
            " padded".into(),
            "tab\t".into(),
        ] {
            let kept = key(&sent);
            assert!(kept.starts_with("sess-") && kept.len() == 37, "{sent:?} became {kept:?}");
            assert_eq!(kept, key(&sent), "the same key hashes the same");
        }
        assert_ne!(key(&"a".repeat(200)), key(&"b".repeat(200)));
        // Headers are bounded the same way.
        let view = parse_view(br#"{"model":"m"}"#).unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("x-session-id", "s".repeat(4096).parse().unwrap());
        assert!(session_key(&headers, &view, None).unwrap().starts_with("sess-"));
    }

    #[test]
    fn usage_is_requested_by_splicing() {
        let body = bytes::Bytes::from_static(br#" {"model":"m","stream":true,"messages":[]}"#);
        let spliced = with_usage_requested(&body).unwrap();
        let value: serde_json::Value = serde_json::from_slice(&spliced).unwrap();
        assert_eq!(value["stream_options"]["include_usage"], true);
        assert_eq!(value["model"], "m");
        assert!(with_usage_requested(&bytes::Bytes::from_static(b"[1]")).is_none());
        assert!(parse_view(&spliced).unwrap().has_stream_options);
        assert!(!parse_view(&body).unwrap().has_stream_options);
        let both = with_progress_requested(&spliced).unwrap();
        let value: serde_json::Value = serde_json::from_slice(&both).unwrap();
        assert_eq!(
            (value["return_progress"].as_bool(), value["stream_options"]["include_usage"].as_bool()),
            (Some(true), Some(true))
        );
        assert!(parse_view(&both).unwrap().has_return_progress);
        assert!(!parse_view(&spliced).unwrap().has_return_progress);
        assert!(parse_view(br#"{"model":"m","return_progress":true}"#).unwrap().has_return_progress);
        for opting_out in [&br#"{"model":"m","return_progress":null}"#[..], br#"{"model":"m","return_progress":false}"#]
        {
            let refused = parse_view(opting_out).unwrap_err();
            assert_eq!(refused.code_str(), Some("unsupported_parameter"));
        }
    }

    #[test]
    fn only_routing_fields_are_read() {
        let view = parse_view(
            br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"prompt_cache_key":"k"}"#,
        )
        .unwrap();
        assert_eq!(view.model, "m");
        assert!(view.stream);
        assert_eq!(view.prompt_cache_key.as_deref(), Some("k"));
        assert!(view.root.is_some() && !view.has_media);
    }

    #[test]
    fn bad_bodies_are_rejected_with_the_reason() {
        let not_json = parse_view(b"{nope").unwrap_err();
        assert_eq!(not_json.kind, ErrorKind::BadRequest);
        assert!(not_json.message.contains("not valid JSON"));
        let array = parse_view(b"[1,2]").unwrap_err();
        assert!(array.message.contains("JSON object"));
        let no_model = parse_view(br#"{"messages":[]}"#).unwrap_err();
        assert_eq!(no_model.param, Some("model"));
        let wrong_type = parse_view(br#"{"model":3}"#).unwrap_err();
        assert_eq!(wrong_type.kind, ErrorKind::BadRequest);
        assert_eq!((wrong_type.code_str(), wrong_type.param), (Some("invalid_type"), Some("model")));
        assert_eq!(wrong_type.message, "Invalid type for 'model': expected a string, but got a number instead.");
        let broken = parse_view(b"{\"model\":\"m\",\n \"messages\": [}").unwrap_err();
        assert_eq!(broken.message, "the request body is not valid JSON: expected value at line 2 column 15");
        let twice = parse_view(br#"{"model":"a","model":"b"}"#).unwrap_err();
        assert_eq!((twice.code_str(), twice.param), (Some("invalid_json"), Some("model")));
        // A name no model of the fleet has, never repeated back.
        let longest = "m".repeat(inferyes_proto::MAX_NAME_BYTES);
        assert_eq!(parse_view(format!(r#"{{"model":"{longest}"}}"#).as_bytes()).unwrap().model, longest);
        let long = parse_view(format!(r#"{{"model":"{}"}}"#, "m".repeat(1 << 20)).as_bytes()).unwrap_err();
        assert_eq!(
            (long.kind, long.code_str(), long.param),
            (ErrorKind::BadRequest, Some("invalid_request"), Some("model"))
        );
        assert!(long.message.len() < 100, "{}", long.message);
    }

    #[test]
    fn a_request_s_token_limit_is_the_largest_it_names() {
        let limit = |members: &str| parse_view(format!(r#"{{"model":"m",{members}}}"#).as_bytes()).unwrap().max_tokens;
        assert_eq!(limit(r#""max_tokens":7"#), Some(7));
        assert_eq!(limit(r#""stream":false"#), None);
        // llama-server reads `n_predict` first, and a repeated member's last.
        assert_eq!(limit(r#""max_tokens":1,"n_predict":8192"#), Some(8192));
        assert_eq!(limit(r#""n_predict":8192,"max_tokens":1"#), Some(8192));
        assert_eq!(limit(r#""max_tokens":1,"max_tokens":8192"#), Some(8192));
        assert_eq!(limit(r#""max_completion_tokens":300,"max_tokens":2,"max_output_tokens":5"#), Some(300));
    }

    #[test]
    fn a_request_takes_one_prompt_as_the_server_counts_them() {
        for one in [
            r#""hello""#,
            r#"["hello"]"#,
            "[1, 2, 3]",
            r#"["a", 12, "b"]"#,
            r#"[[1, 2]]"#,
            r#"[{"prompt_string":"a"}]"#,
            r#"["a", "b", 1.5]"#,
            r#"[-1, "a"]"#,
            "[ ]",
        ] {
            let body = format!(r#"{{"model":"m","prompt":{one}}}"#);
            assert!(parse_view(body.as_bytes()).is_ok(), "{one}");
        }
        for (several, count) in [
            (r#"["a","b"]"#, 2),
            (r#"[ "a" , [1, 2] , {"prompt_string":"c"} ]"#, 3),
            (r#"[[1], [2], [3], [4]]"#, 4),
            (r#"["a", null]"#, 2),
        ] {
            let body = format!(r#"{{"model":"m","prompt":{several}}}"#);
            let refused = parse_view(body.as_bytes()).unwrap_err();
            assert_eq!(
                (refused.code_str(), refused.param),
                (Some("unsupported_parameter"), Some("prompt")),
                "{several}"
            );
            assert!(refused.message.contains(&format!("not {count}")), "{}", refused.message);
        }
    }

    #[test]
    fn the_session_header_wins_over_the_body_which_wins_over_agent_headers_and_the_root() {
        let view = parse_view(br#"{"model":"m","prompt_cache_key":"body","messages":[{"role":"user","content":"x"}]}"#)
            .unwrap();
        let bare = parse_view(br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#).unwrap();
        let mut headers = HeaderMap::new();
        assert!(session_key(&headers, &bare, None).unwrap().starts_with("root-"));
        headers.insert("session-id", "agent".parse().unwrap());
        assert_eq!(session_key(&headers, &bare, None).as_deref(), Some("agent"));
        assert_eq!(session_key(&headers, &view, None).as_deref(), Some("body"));
        headers.insert("x-session-id", "explicit".parse().unwrap());
        assert_eq!(session_key(&headers, &view, None).as_deref(), Some("explicit"));
        // An empty name names nothing.
        headers.insert("x-session-id", "".parse().unwrap());
        assert_eq!(session_key(&headers, &view, None).as_deref(), Some("body"));
    }

    #[test]
    fn later_turns_of_a_conversation_share_its_root() {
        let turn1 =
            br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hello"}]}"#;
        let turn2 =
            br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hello"},
            {"role":"assistant","content":"hi!"},{"role":"user","content":"how are you?"}],"temperature":0.2}"#;
        let other =
            br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"bye"}]}"#;
        let root = |b: &[u8]| session_key(&HeaderMap::new(), &parse_view(b).unwrap(), None);
        assert_eq!(root(turn1), root(turn2));
        assert_ne!(root(turn1), root(other));
        let other_model =
            br#"{"model":"n","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hello"}]}"#;
        assert_ne!(root(turn1), root(other_model), "the model is part of the root");
        let completion = |p: &str| root(format!(r#"{{"model":"m","prompt":"{p}"}}"#).as_bytes());
        assert_eq!(completion("Once upon a time"), completion("Once upon a time"));
        assert_eq!(root(br#"{"model":"m","messages":[]}"#), None);
    }

    #[test]
    fn an_alias_is_rewritten_in_place() {
        let body = bytes::Bytes::from_static(br#"{"messages":[],"model":"gpt-4o","stream":false}"#);
        let view = parse_view(&body).unwrap();
        let rewritten = with_model(&body, &view, "qwen/\"7b\"");
        assert_eq!(&rewritten[..], br#"{"messages":[],"model":"qwen/\"7b\"","stream":false}"#);
        // Written with escapes, the name is replaced as written; nothing
        // else is parsed again (a lone surrogate elsewhere, which no reader
        // of the name minds, stays as it was).
        let escaped = bytes::Bytes::from_static(br#"{"model" : "gpt\u002d4o", "x":"\ud800"}"#);
        let view = parse_view(&escaped).unwrap();
        assert_eq!(view.model, "gpt-4o");
        assert_eq!(&with_model(&escaped, &view, "qwen")[..], br#"{"model" : "qwen", "x":"\ud800"}"#);
    }

    #[test]
    fn a_messages_conversation_keeps_its_root_as_its_cache_marks_move_on() {
        let messages = inferyes_proto::kinds::row("/v1/messages").unwrap();
        let root = |b: &str| {
            let view = parse_request_view(messages, &HeaderMap::new(), b.as_bytes()).unwrap();
            session_key(&HeaderMap::new(), &view, None)
        };
        let turn1 = r#"{"model":"m","system":[{"type":"text","text":"be brief","cache_control":{"type":"ephemeral"}}],
            "messages":[{"role":"user","content":[{"type":"text","text":"hello","cache_control":{"type":"ephemeral"}}]}]}"#;
        let turn2 = r#"{"model":"m","system":[{"type":"text","text":"be brief","cache_control":{"type":"ephemeral"}}],
            "messages":[{"role":"user","content":[{"type":"text","text":"hello"}]},
            {"role":"assistant","content":"hi"},
            {"role":"user","content":[{"type":"text","text":"more","cache_control":{"type":"ephemeral"}}]}]}"#;
        assert_eq!(root(turn1), root(turn2));
        let other_system = turn1.replace("be brief", "be long");
        assert_ne!(root(turn1), root(&other_system), "the system prompt beside the messages is part of the root");
        let other_opening = turn1.replace("hello", "goodbye");
        assert_ne!(root(turn1), root(&other_opening));
        // Members in another order, and a huge opening, read only so far.
        let reordered = turn1.replace(r#"{"type":"text","text":"hello","#, r#"{"text":"hello","type":"text","#);
        assert_ne!(reordered, turn1);
        assert_eq!(root(turn1), root(&reordered));
        let huge = |text: &str, tail: &str| {
            let blocks = format!(r#"[{{"type":"text","text":"{text}"}},{}]"#, "[0],".repeat(1 << 18) + tail);
            format!(r#"{{"model":"m","messages":[{{"role":"user","content":{blocks}}}]}}"#)
        };
        let long = |last: char| format!("{}{last}", "x".repeat(1 << 20));
        assert_eq!(
            root(&huge(&long('a'), "1")),
            root(&huge(&long('a'), "2")),
            "blocks past the first 4,096 are not read"
        );
        assert_ne!(root(&huge(&long('a'), "1")), root(&huge(&long('b'), "1")), "a block is read whole");
        assert_ne!(root(&huge(&long('a'), "1")), root(turn1));
        // A turn written as a text block, then as a string, keeps its root.
        let as_block = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi","cache_control":{"type":"ephemeral"}}]}]}"#;
        let as_string =
            r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}]}"#;
        assert_eq!(root(as_block), root(as_string));
        // So does a system prompt, a string or a block.
        let plain = r#"{"model":"m","system":"s","messages":[{"role":"user","content":"u"}]}"#;
        let block = r#"{"model":"m","system":[{"text":"s","type":"text"}],"messages":[{"role":"user","content":"u"}]}"#;
        assert_eq!(root(plain), root(block));
        assert_ne!(root(plain), root(&plain.replace(r#""s""#, r#""t""#)));
    }

    #[test]
    fn an_editor_s_completions_share_a_session_only_where_it_names_one() {
        let infill = inferyes_proto::kinds::row("/infill").unwrap();
        let view =
            parse_request_view(infill, &HeaderMap::new(), br#"{"model":"m","prompt":"","input_prefix":"x"}"#).unwrap();
        assert_eq!(session_key(&HeaderMap::new(), &view, None), None, "no root from the line being typed");
        let mut named = HeaderMap::new();
        named.insert(SESSION_HEADER, http::HeaderValue::from_static("file.rs"));
        assert_eq!(session_key(&named, &view, None).as_deref(), Some("file.rs"));
    }

    #[test]
    fn an_upload_names_its_model_in_its_form() {
        let row = inferyes_proto::kinds::row("/v1/audio/transcriptions").unwrap();
        let body = b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n--b--\r\n";
        let mut headers = HeaderMap::new();
        headers.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("multipart/form-data; boundary=b"));
        let view = parse_request_view(row, &headers, body).unwrap();
        assert_eq!((view.model.as_str(), view.stream, view.root), ("whisper", false, None));
        let renamed = with_model(&bytes::Bytes::from_static(body), &view, "whisper-large-v3");
        let again = parse_request_view(row, &headers, &renamed).unwrap();
        assert_eq!(again.model, "whisper-large-v3");
        assert!(renamed.ends_with(b"whisper-large-v3\r\n--b--\r\n"), "only the field's value changed");
        let json = parse_request_view(row, &HeaderMap::new(), br#"{"model":"whisper"}"#).unwrap_err();
        assert_eq!((json.kind, json.code_str()), (ErrorKind::BadRequest, Some("invalid_body")));
        let no_model = b"--b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nx\r\n--b--\r\n";
        assert_eq!(parse_request_view(row, &headers, no_model).unwrap_err().param, Some("model"));
        let long =
            format!("--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{}\r\n--b--\r\n", "w".repeat(257));
        let long = parse_request_view(row, &headers, long.as_bytes()).unwrap_err();
        assert_eq!((long.code_str(), long.param), (Some("invalid_request"), Some("model")));
    }

    #[test]
    fn constrained_output_is_seen() {
        let constrained = |body: &[u8]| parse_view(body).unwrap().constrained;
        assert!(!constrained(br#"{"model":"m","messages":[{"role":"user","content":"\"tools\": none"}]}"#));
        assert!(constrained(br#"{"model":"m","messages":[],"tools":[]}"#));
        assert!(constrained(br#"{"model":"m","messages":[],"response_format":{"type":"json_object"}}"#));
        assert!(!constrained(br#"{"model":"m","messages":[],"tool_choice":null}"#), "null is no constraint");
    }

    #[test]
    fn stream_options_set_to_null_are_the_client_s_own_all_the_same() {
        for body in [
            &br#"{"model":"m","stream":true,"stream_options":null}"#[..],
            br#"{"model":"m","stream":true,"stream_options":{}}"#,
        ] {
            assert!(parse_view(body).unwrap().has_stream_options, "{}", String::from_utf8_lossy(body));
        }
        assert!(!parse_view(br#"{"model":"m","stream":true}"#).unwrap().has_stream_options);
    }

    #[test]
    fn media_bodies_are_not_estimated_for_routing_but_are_billed() {
        let view = parse_view(br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:"}}]}]}"#).unwrap();
        assert!(view.has_media);
        assert_eq!(estimated_prompt_tokens(1_000_000, &view), 0);
        assert_eq!(metered_prompt_estimate(1_000_000), 200_000);
    }

    #[test]
    fn sessions_are_scoped_by_tenant_or_key_and_left_alone_with_auth_off() {
        let mut headers = HeaderMap::new();
        headers.insert(SESSION_HEADER, http::HeaderValue::from_static("chat-1"));
        let view = parse_view(br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        let key = |id: &'static str| Some(SessionScope { kind: "k:", id });
        let tenant = |id: &'static str| Some(SessionScope { kind: "t:", id });
        let sent = |scope| session_key(&headers, &view, scope).unwrap();
        assert_eq!(sent(None), "chat-1");
        assert_eq!(sent(key("aaaa")), "k:aaaa/chat-1");
        assert_ne!(sent(key("aaaa")), sent(key("bbbb")), "two keys' conversations are apart, whatever their keys say");
        assert_eq!(sent(tenant("acme")), "t:acme/chat-1", "one tenant's keys share them");
        assert_ne!(sent(key("acme")), sent(tenant("acme")));
        let derived = |scope| session_key(&HeaderMap::new(), &view, scope).unwrap();
        assert_ne!(derived(key("aaaa")), derived(key("bbbb")), "derived keys are apart too");
        assert_eq!(derived(tenant("acme")), derived(tenant("acme")));
        assert_ne!(derived(None), derived(key("aaaa")));
        let mut long = HeaderMap::new();
        long.insert(SESSION_HEADER, http::HeaderValue::from_str(&"s".repeat(MAX_SESSION_KEY_BYTES)).unwrap());
        let (long_a, long_b) =
            (session_key(&long, &view, key("aaaa")).unwrap(), session_key(&long, &view, key("bbbb")).unwrap());
        assert!(long_a.len() <= MAX_SESSION_KEY_BYTES, "an agent keeps it: {long_a}");
        assert_ne!(long_a, long_b, "hashed, still apart");
    }

    #[test]
    fn no_opening_or_long_key_makes_another_tenants_session_key() {
        // The root and key hashes are unkeyed and invertible: a client can
        // write an opening with any root it likes. Mixed with the scope's
        // hash, the root that lands on tenant a's key from tenant b is
        // this one; the key must still be b's.
        let (a, b) = (SessionScope { kind: "t:", id: "a" }, SessionScope { kind: "t:", id: "b" });
        let mut view = parse_view(br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        let victims = session_key(&HeaderMap::new(), &view, Some(a)).unwrap();
        view.root = view.root.map(|root| root ^ scope_hash(Some(a)) ^ scope_hash(Some(b)));
        let forged = session_key(&HeaderMap::new(), &view, Some(b)).unwrap();
        assert_ne!(forged, victims);
        // A hashed key's scope part is the scope's alone: no key a client
        // sends moves it.
        let scope_part = |scope, sent: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(SESSION_HEADER, http::HeaderValue::from_str(sent).unwrap());
            session_key(&headers, &view, Some(scope)).unwrap()[5..21].to_string()
        };
        let long = |c: &str| c.repeat(MAX_SESSION_KEY_BYTES);
        assert_eq!(scope_part(b, &long("x")), scope_part(b, &long("y")));
        assert_eq!(scope_part(b, &long("x")), forged[5..21]);
        assert_ne!(scope_part(b, &long("x")), scope_part(a, &long("x")));
    }
}
