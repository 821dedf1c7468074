//! The routing view of a request body: the few fields routing reads. The
//! rest of the body is never materialised; it is forwarded as received.

use std::borrow::Cow;
use std::ops::Range;

use http::{HeaderMap, HeaderName};
use inferyes_proto::ErrorKind;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::ApiError;
use crate::routing::{stable_hash, text_hash};

#[derive(Debug, Deserialize)]
struct Wire<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<Cow<'a, str>>,
    /// Chat: the conversation's opening, for its root.
    #[serde(borrow, default)]
    messages: Option<Opening<'a>>,
    /// Completions: the prompt, whose beginning is the conversation's root.
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    /// Responses API: instructions and input.
    #[serde(borrow, default)]
    instructions: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    /// Whether the client set stream options itself.
    #[serde(borrow, default)]
    stream_options: Option<&'a RawValue>,
}

#[derive(Debug, Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

/// What a conversation's root needs of its messages: the content of the
/// first message of each opening role (`None` inside: that message had
/// none). Read message by message: a long conversation is not kept.
#[derive(Debug, Default)]
struct Opening<'a> {
    system: Option<Option<&'a RawValue>>,
    developer: Option<Option<&'a RawValue>>,
    user: Option<Option<&'a RawValue>>,
}

impl<'de: 'a, 'a> Deserialize<'de> for Opening<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Messages<'a>(std::marker::PhantomData<&'a ()>);

        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Messages<'a> {
            type Value = Opening<'a>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of messages")
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut messages: A) -> Result<Opening<'a>, A::Error> {
                let mut opening = Opening::default();
                while let Some(message) = messages.next_element::<Message<'a>>()? {
                    let first = match message.role.as_deref() {
                        Some("system") => &mut opening.system,
                        Some("developer") => &mut opening.developer,
                        Some("user") => &mut opening.user,
                        _ => continue,
                    };
                    first.get_or_insert(message.content);
                }
                Ok(opening)
            }
        }

        deserializer.deserialize_seq(Messages(std::marker::PhantomData))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingView {
    pub model: String,
    /// Where the model's name sits in the body (inside its quotes), when it
    /// was written without escapes: an alias is rewritten there.
    pub model_span: Option<Range<usize>>,
    pub stream: bool,
    pub prompt_cache_key: Option<String>,
    /// A hash of the conversation's beginning (system prompt and first user
    /// message, or the prompt's first bytes), stable across its turns.
    pub root: Option<u64>,
    /// Whether the body carries images or audio, which make its size a poor
    /// measure of its tokens.
    pub has_media: bool,
    /// The client set `stream_options` (and so said whether it wants usage).
    pub has_stream_options: bool,
}

/// Bytes of a completion prompt that make up its root.
const PROMPT_ROOT_BYTES: usize = 512;

pub fn parse_view(body: &[u8]) -> Result<RoutingView, ApiError> {
    let wire: Wire<'_> = serde_json::from_slice(body).map_err(|error| {
        let message = if error.is_data() {
            format!("the request body must be a JSON object: {error}")
        } else {
            format!("the request body is not valid JSON: {error}")
        };
        ApiError::new(ErrorKind::BadRequest, message, "invalid_json")
    })?;
    let root = conversation_root(&wire);
    let model = wire.model.filter(|m| !m.is_empty()).ok_or_else(|| {
        ApiError::new(ErrorKind::BadRequest, "you must provide a model parameter", "missing_required_parameter")
            .param("model")
    })?;
    let model_span = match &model {
        Cow::Borrowed(name) => span_of(body, name.as_bytes()),
        Cow::Owned(_) => None,
    };
    Ok(RoutingView {
        model: model.into_owned(),
        model_span,
        stream: wire.stream.unwrap_or(false),
        prompt_cache_key: wire.prompt_cache_key.filter(|k| !k.is_empty()).map(Cow::into_owned),
        root,
        has_media: MEDIA.iter().any(|media| media.find(body).is_some()),
        has_stream_options: wire.stream_options.is_some(),
    })
}

/// The body with `"stream_options":{"include_usage":true}` added, so the
/// backend ends its stream with the usage the ledger needs. Spliced in
/// after the opening brace: the rest of the bytes are untouched. `None` when
/// the body does not start with an object.
pub fn with_usage_requested(body: &bytes::Bytes) -> Option<bytes::Bytes> {
    let at = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[at] != b'{' {
        return None;
    }
    const MEMBER: &[u8] = br#""stream_options":{"include_usage":true},"#;
    let mut out = Vec::with_capacity(body.len() + MEMBER.len());
    out.extend_from_slice(&body[..=at]);
    out.extend_from_slice(MEMBER);
    out.extend_from_slice(&body[at + 1..]);
    Some(out.into())
}

/// The position of `part`, a slice borrowed from `whole`.
fn span_of(whole: &[u8], part: &[u8]) -> Option<Range<usize>> {
    let start = (part.as_ptr() as usize).checked_sub(whole.as_ptr() as usize)?;
    let end = start.checked_add(part.len())?;
    (end <= whole.len() && &whole[start..end] == part).then_some(start..end)
}

/// What marks a body with images or audio; searchers built once (building
/// one costs more than searching a small body).
static MEDIA: std::sync::LazyLock<[memchr::memmem::Finder<'static>; 2]> = std::sync::LazyLock::new(|| {
    [memchr::memmem::Finder::new(b"\"image_url\""), memchr::memmem::Finder::new(b"\"input_audio\"")]
});

fn conversation_root(wire: &Wire<'_>) -> Option<u64> {
    if let Some(opening) = &wire.messages {
        let user = opening.user.flatten()?;
        let system = opening.system.flatten().or(opening.developer.flatten());
        Some(text_hash(&[text(system), text(Some(user))]))
    } else if let Some(input) = wire.input {
        Some(text_hash(&[text(wire.instructions), head(input)]))
    } else {
        wire.prompt.map(|prompt| text_hash(&[head(prompt)]))
    }
}

/// A JSON value's text, or nothing.
fn text(value: Option<&RawValue>) -> &[u8] {
    value.map_or(&[], |value| value.get().as_bytes())
}

/// The first bytes of a JSON value's text that make up a root.
fn head(value: &RawValue) -> &[u8] {
    let bytes = value.get().as_bytes();
    &bytes[..bytes.len().min(PROMPT_ROOT_BYTES)]
}

/// Headers that name a conversation, in order of precedence.
/// Names, not strings: a lookup by string parses and hashes it first.
const SESSION_HEADERS: [HeaderName; 4] = [
    HeaderName::from_static("x-session-id"),
    HeaderName::from_static("x-claude-code-session-id"),
    HeaderName::from_static("session-id"),
    HeaderName::from_static("x-session_id"),
];

/// The request's session key: an explicit header, else the body's
/// `prompt_cache_key` (OpenAI's own field for this), else a hash of the
/// model and the conversation's root, so a multi-turn chat sticks without
/// any change on the client.
pub fn session_key(headers: &HeaderMap, view: &RoutingView) -> Option<String> {
    SESSION_HEADERS
        .iter()
        .find_map(|name| headers.get(name).and_then(|v| v.to_str().ok()).filter(|v| !v.is_empty()))
        .map(str::to_string)
        .or_else(|| view.prompt_cache_key.clone())
        .or_else(|| view.root.map(|root| root_key(root ^ stable_hash(view.model.as_bytes()))))
}

/// `root-` and the hash in 16 hex digits, written without the formatting
/// machinery (every request without a session of its own has one).
fn root_key(hash: u64) -> String {
    let mut key = *b"root-0000000000000000";
    super::write_hex(&mut key[5..], u128::from(hash));
    String::from_utf8_lossy(&key).into_owned()
}

/// A low estimate of a body's prompt tokens, for the context-window check:
/// an English token is about four bytes and JSON adds framing, so a fifth
/// of the bytes rarely overestimates. Bodies with media are not estimated.
pub fn estimated_prompt_tokens(body_len: usize, view: &RoutingView) -> u32 {
    if view.has_media { 0 } else { u32::try_from(body_len / 5).unwrap_or(u32::MAX) }
}

/// The body with `model` replaced (an alias resolved), the rest untouched.
pub fn with_model(body: &bytes::Bytes, view: &RoutingView, model: &str) -> Result<bytes::Bytes, ApiError> {
    let quoted = serde_json::to_string(model).unwrap_or_default();
    let escaped = quoted.trim_start_matches('"').trim_end_matches('"');
    if let Some(span) = &view.model_span {
        let mut out = Vec::with_capacity(body.len() + escaped.len());
        out.extend_from_slice(&body[..span.start]);
        out.extend_from_slice(escaped.as_bytes());
        out.extend_from_slice(&body[span.end..]);
        return Ok(out.into());
    }
    // The name had escapes: rewrite the document.
    let mut value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|_| ApiError::new(ErrorKind::BadRequest, "the request body is not valid JSON", "invalid_json"))?;
    value["model"] = serde_json::Value::String(model.to_string());
    Ok(value.to_string().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_keys_are_the_hash_in_hex() {
        assert_eq!(root_key(0x0123_4567_89ab_cdef), format!("root-{:016x}", 0x0123_4567_89ab_cdef_u64));
        assert_eq!(root_key(7), "root-0000000000000007");
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
    }

    #[test]
    fn session_headers_win_over_the_body_which_wins_over_the_root() {
        let view = parse_view(br#"{"model":"m","prompt_cache_key":"body","messages":[{"role":"user","content":"x"}]}"#)
            .unwrap();
        let mut headers = HeaderMap::new();
        assert_eq!(session_key(&headers, &view).as_deref(), Some("body"));
        headers.insert("session-id", "agent".parse().unwrap());
        assert_eq!(session_key(&headers, &view).as_deref(), Some("agent"));
        headers.insert("x-session-id", "explicit".parse().unwrap());
        assert_eq!(session_key(&headers, &view).as_deref(), Some("explicit"));
        let rootless = parse_view(br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#).unwrap();
        assert!(session_key(&HeaderMap::new(), &rootless).unwrap().starts_with("root-"));
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
        let root = |b: &[u8]| session_key(&HeaderMap::new(), &parse_view(b).unwrap());
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
        let rewritten = with_model(&body, &view, "qwen/\"7b\"").unwrap();
        assert_eq!(&rewritten[..], br#"{"messages":[],"model":"qwen/\"7b\"","stream":false}"#);
        let escaped = bytes::Bytes::from_static(br#"{"model":"gpt\u002d4o"}"#);
        let view = parse_view(&escaped).unwrap();
        assert_eq!(view.model, "gpt-4o");
        assert_eq!(view.model_span, None);
        let rewritten: serde_json::Value =
            serde_json::from_slice(&with_model(&escaped, &view, "qwen").unwrap()).unwrap();
        assert_eq!(rewritten["model"], "qwen");
    }

    #[test]
    fn media_bodies_are_not_estimated() {
        let view = parse_view(br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:"}}]}]}"#).unwrap();
        assert!(view.has_media);
        assert_eq!(estimated_prompt_tokens(1_000_000, &view), 0);
    }
}
