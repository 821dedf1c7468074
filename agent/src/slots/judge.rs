//! Whether a restored conversation's next turn continued it. A turn that
//! read next to nothing from a restored slot is the backend's fault only
//! where the turn's tokens carry on from those restored: a turn that sent
//! another history under the conversation's key (a chat interface's
//! edited message) is a new branch, and says nothing of the restore.

use std::sync::Arc;

use bytes::Bytes;
use inferyes_proto::v1::EndpointKind;
use serde_json::{Value, json};

use crate::probe::ProbeClient;

/// A restored conversation's turn, kept until its answer says whether it
/// read the restored tokens.
#[derive(Clone, Debug)]
pub struct Unchecked {
    pub restored: Arc<[i32]>,
    pub body: Bytes,
    pub kind: EndpointKind,
}

/// What the turn's prompt comes to before it is tokenized: a chat's
/// messages to render with the server's template, a completion's text,
/// or a completion's tokens as sent.
#[derive(Debug, PartialEq)]
enum Prompt {
    Chat(Value),
    Text(String),
    Tokens(Vec<i32>),
}

/// The turn's prompt; none where it cannot be read, or where the turn
/// asked the server not to reuse its cache (`cache_prompt: false`): such a
/// turn reads nothing from any slot, and says nothing of a restore.
fn prompt_of(kind: EndpointKind, body: &[u8]) -> Option<Prompt> {
    let body: Value = serde_json::from_slice(body).ok()?;
    if body.get("cache_prompt") == Some(&Value::Bool(false)) {
        return None;
    }
    match kind {
        EndpointKind::Chat => body.get("messages").is_some().then_some(Prompt::Chat(body)),
        EndpointKind::Completion => match body.get("prompt")? {
            Value::String(text) => Some(Prompt::Text(text.clone())),
            Value::Array(tokens) => tokens
                .iter()
                .map(|t| t.as_i64().and_then(|t| i32::try_from(t).ok()))
                .collect::<Option<_>>()
                .map(Prompt::Tokens),
            _ => None,
        },
        _ => None,
    }
}

fn tokens_of(answer: &[u8]) -> Option<Vec<i32>> {
    let answer: Value = serde_json::from_slice(answer).ok()?;
    let tokens = answer.get("tokens")?.as_array()?;
    tokens.iter().map(|t| t.as_i64().and_then(|t| i32::try_from(t).ok())).collect()
}

/// Whether the turn carried on from the restored tokens (at least half of
/// them, from its start: a template may render the last reply anew);
/// `None` where it cannot be told (another kind of job, a server that
/// does not render or tokenize).
pub async fn continues(client: &ProbeClient, url: &str, api_key: &str, turn: &Unchecked) -> Option<bool> {
    let text = match prompt_of(turn.kind, &turn.body)? {
        Prompt::Tokens(tokens) => return Some(carries_on(&turn.restored, &tokens)),
        Prompt::Text(text) => text,
        Prompt::Chat(body) => {
            let (status, rendered) = client.post_json(url, "/apply-template", api_key, &body).await.ok()?;
            let rendered: Value = serde_json::from_slice(&rendered).ok().filter(|_| status.is_success())?;
            rendered.get("prompt")?.as_str()?.to_string()
        }
    };
    let ask = json!({ "content": text, "add_special": true });
    let (status, answer) = client.post_json(url, "/tokenize", api_key, &ask).await.ok()?;
    let tokens = tokens_of(&answer).filter(|_| status.is_success())?;
    Some(carries_on(&turn.restored, &tokens))
}

fn carries_on(restored: &[i32], tokens: &[i32]) -> bool {
    super::common_prefix(restored, tokens) * 2 >= restored.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_s_prompt_is_read_as_its_kind_sends_it() {
        let chat = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        assert!(matches!(prompt_of(EndpointKind::Chat, chat), Some(Prompt::Chat(_))));
        let cached = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"cache_prompt":true}"#;
        assert!(matches!(prompt_of(EndpointKind::Chat, cached), Some(Prompt::Chat(_))));
        let text = br#"{"prompt":"Once upon"}"#;
        assert_eq!(prompt_of(EndpointKind::Completion, text), Some(Prompt::Text("Once upon".into())));
        let tokens = br#"{"prompt":[2,1567,1806]}"#;
        assert_eq!(prompt_of(EndpointKind::Completion, tokens), Some(Prompt::Tokens(vec![2, 1567, 1806])));
        for (kind, body) in [
            (EndpointKind::Chat, &br#"{"prompt":"no messages"}"#[..]),
            (EndpointKind::Completion, br#"{"prompt":[1.5]}"#),
            (EndpointKind::Completion, br#"{"prompt":[["a batch"]]}"#),
            (EndpointKind::Messages, br#"{"messages":[]}"#),
            (EndpointKind::Chat, b"not json"),
            // It asked the server not to read its cache: nothing to judge.
            (EndpointKind::Chat, br#"{"messages":[{"role":"user","content":"hi"}],"cache_prompt":false}"#),
            (EndpointKind::Completion, br#"{"prompt":"Once upon","cache_prompt":false}"#),
        ] {
            assert_eq!(prompt_of(kind, body), None, "{kind:?} {}", String::from_utf8_lossy(body));
        }
        assert_eq!(tokens_of(br#"{"tokens":[2,5,-1]}"#), Some(vec![2, 5, -1]));
        assert_eq!(tokens_of(br#"{"tokens":[{"id":2,"piece":"a"}]}"#), None, "pieces are not asked for");
    }

    #[test]
    fn a_turn_carries_on_where_it_starts_with_most_of_what_was_restored() {
        let restored = [2, 10, 11, 12, 13, 14];
        assert!(carries_on(&restored, &[2, 10, 11, 12, 13, 14, 15, 16]), "the next turn");
        assert!(carries_on(&restored, &[2, 10, 11, 12, 99, 98, 15]), "the last reply rendered anew");
        assert!(!carries_on(&restored, &[2, 10, 77, 78, 79, 80, 81, 82]), "an edited first message");
        assert!(!carries_on(&restored, &[]));
    }
}
