//! The routing view of a request body: the few fields routing reads. The
//! rest of the body is never materialised; it is forwarded as received.

use http::HeaderMap;
use inferyes_proto::ErrorKind;
use serde::Deserialize;

use super::ApiError;

#[derive(Debug, Deserialize)]
struct Wire<'a> {
    #[serde(borrow, default)]
    model: Option<std::borrow::Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<std::borrow::Cow<'a, str>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingView {
    pub model: String,
    pub stream: bool,
    pub prompt_cache_key: Option<String>,
}

pub fn parse_view(body: &[u8]) -> Result<RoutingView, ApiError> {
    let wire: Wire<'_> = serde_json::from_slice(body).map_err(|error| {
        let message = if error.is_data() {
            format!("the request body must be a JSON object: {error}")
        } else {
            format!("the request body is not valid JSON: {error}")
        };
        ApiError::new(ErrorKind::BadRequest, message, "invalid_json")
    })?;
    let model = wire.model.filter(|m| !m.is_empty()).ok_or_else(|| {
        ApiError::new(ErrorKind::BadRequest, "you must provide a model parameter", "missing_required_parameter")
            .param("model")
    })?;
    Ok(RoutingView {
        model: model.into_owned(),
        stream: wire.stream.unwrap_or(false),
        prompt_cache_key: wire.prompt_cache_key.filter(|k| !k.is_empty()).map(|k| k.into_owned()),
    })
}

/// Headers that name a conversation, in order of precedence.
const SESSION_HEADERS: &[&str] = &["x-session-id", "x-claude-code-session-id", "session-id", "x-session_id"];

/// The request's session key: an explicit header, else the body's
/// `prompt_cache_key` (OpenAI's own field for this), else none.
pub fn session_key(headers: &HeaderMap, view: &RoutingView) -> Option<String> {
    SESSION_HEADERS
        .iter()
        .find_map(|name| headers.get(*name).and_then(|v| v.to_str().ok()).filter(|v| !v.is_empty()))
        .map(str::to_string)
        .or_else(|| view.prompt_cache_key.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_routing_fields_are_read() {
        let view = parse_view(
            br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"prompt_cache_key":"k"}"#,
        )
        .unwrap();
        assert_eq!(view, RoutingView { model: "m".into(), stream: true, prompt_cache_key: Some("k".into()) });
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
    fn session_headers_win_over_the_body() {
        let view = parse_view(br#"{"model":"m","prompt_cache_key":"body"}"#).unwrap();
        let mut headers = HeaderMap::new();
        assert_eq!(session_key(&headers, &view).as_deref(), Some("body"));
        headers.insert("session-id", "agent".parse().unwrap());
        assert_eq!(session_key(&headers, &view).as_deref(), Some("agent"));
        headers.insert("x-session-id", "explicit".parse().unwrap());
        assert_eq!(session_key(&headers, &view).as_deref(), Some("explicit"));
    }
}
