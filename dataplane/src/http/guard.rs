//! Members of a request body that reach past the request into the server
//! behind, which every tenant shares: its slots and caches, its
//! configuration, or work without bound. Each is refused, or held to a
//! bound, before the request goes on (a 400 naming the member). The list
//! follows llama-server's request parsing (b11434: `id_slot` and the other
//! members its chat layer sets itself) and its samplers' allocations; what
//! every other member does touches only the request's own slot.
//!
//! Media a body names by URL is refused too: llama-server fetches such a
//! URL itself, from inside the fleet's network.

use serde_json::Value;

/// What the data plane allows of a member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Never: why, as the client is told.
    Refused(&'static str),
    /// An integer in `min..=max` (or `null`).
    Within { min: i64, max: i64 },
    /// An array or object of at most this many items (or `null`).
    AtMostItems(usize),
    /// At most this many bytes, as written (or `null`).
    AtMostBytes(usize),
    /// At most `most` strings (a string alone is one), of `bytes` bytes as
    /// written in all (or `null`).
    Strings { most: usize, bytes: usize },
    /// 1, or `null`: why no other.
    One(&'static str),
    /// `true` only: why no other (`null` included).
    True(&'static str),
}

/// The guarded members, by name.
pub const GUARDED: [(&str, Rule); 37] = [
    ("id_slot", Rule::Refused("it would choose the server's slot, evicting whichever conversation's cache is there")),
    ("slot_id", Rule::Refused("it would choose the server's slot, evicting whichever conversation's cache is there")),
    ("n_cache_reuse", Rule::Refused("it changes how the server shifts its caches")),
    ("lora", Rule::Refused("it changes the server's adapters, which the fleet does not offer per request")),
    ("samplers", Rule::Refused("a sampler chain of the client's choosing is not offered")),
    ("backend_sampling", Rule::Refused("it is a setting of the server's")),
    ("speculative", Rule::Refused("it is a setting of the server's")),
    ("grammar_triggers", Rule::Refused("it is set by the server's chat layer, not by clients")),
    ("grammar_lazy", Rule::Refused("it is set by the server's chat layer, not by clients")),
    ("grammar_type", Rule::Refused("it is set by the server's chat layer, not by clients")),
    ("preserved_tokens", Rule::Refused("it is set by the server's chat layer, not by clients")),
    ("chat_format", Rule::Refused("it is set by the server's chat layer, not by clients")),
    ("chat_parser", Rule::Refused("it is set by the server's chat layer, not by clients")),
    ("generation_prompt", Rule::Refused("it is set by the server's chat layer, not by clients")),
    ("message_delimiters", Rule::Refused("it is set by the server's chat layer, not by clients")),
    ("reasoning_control", Rule::Refused("it is set by the server's chat layer, not by clients")),
    // Each is a buffer of that many tokens the server allocates as the
    // request starts, and reads at every token.
    ("repeat_last_n", Rule::Within { min: -1, max: 32_768 }),
    ("dry_penalty_last_n", Rule::Within { min: -1, max: 32_768 }),
    // Each sequence breaker is matched against the whole vocabulary as the
    // request starts.
    ("dry_sequence_breakers", Rule::AtMostItems(16)),
    // Probabilities of this many tokens, sorted, for every token.
    ("n_probs", Rule::Within { min: 0, max: 20 }),
    ("top_logprobs", Rule::Within { min: 0, max: 20 }),
    ("logit_bias", Rule::AtMostItems(300)),
    // A negative limit is none: a generation that runs until the context
    // is full, or, where the server shifts its context, never ends.
    ("max_tokens", Rule::Within { min: 0, max: i64::MAX }),
    ("max_completion_tokens", Rule::Within { min: 0, max: i64::MAX }),
    ("max_output_tokens", Rule::Within { min: 0, max: i64::MAX }),
    ("n_predict", Rule::Within { min: 0, max: i64::MAX }),
    // Each choice past the first takes a slot of its own, up to all of the
    // server's, evicting other conversations' caches.
    ("n", Rule::One("each choice takes a slot of the server's, evicting another conversation's cache")),
    ("n_cmpl", Rule::One("each choice takes a slot of the server's, evicting another conversation's cache")),
    // Each stop string is matched, whole, at every token, on the server's
    // one loop that every slot waits on.
    ("stop", Rule::Strings { most: 16, bytes: 4 << 10 }),
    ("stop_sequences", Rule::Strings { most: 16, bytes: 4 << 10 }),
    // Compiled into a grammar as the request starts, and run at every
    // token.
    ("grammar", Rule::AtMostBytes(64 << 10)),
    ("json_schema", Rule::AtMostBytes(64 << 10)),
    ("response_format", Rule::AtMostBytes(64 << 10)),
    // Values the chat template reads as it renders the prompt.
    ("chat_template_kwargs", Rule::AtMostBytes(4 << 10)),
    // Asked for by the gateway itself where it is not given; without it a
    // stream cut short is counted for a guess at its prompt.
    ("return_progress", Rule::True("the gateway reads the prompt's progress to count what a stream cut short used")),
    // Rendered into the prompt, and compiled into a grammar for the calls
    // as the request starts: bounded as the grammars are, with room for
    // an agent's many tools.
    ("tools", Rule::AtMostBytes(256 << 10)),
    ("functions", Rule::AtMostBytes(256 << 10)),
];

/// The index in [`GUARDED`] of a top-level member's name. A `match`, not a
/// search of the table: every request's members that routing does not read
/// pass through here.
pub fn index(name: &str) -> Option<usize> {
    Some(match name {
        "id_slot" => 0,
        "slot_id" => 1,
        "n_cache_reuse" => 2,
        "lora" => 3,
        "samplers" => 4,
        "backend_sampling" => 5,
        "speculative" => 6,
        "grammar_triggers" => 7,
        "grammar_lazy" => 8,
        "grammar_type" => 9,
        "preserved_tokens" => 10,
        "chat_format" => 11,
        "chat_parser" => 12,
        "generation_prompt" => 13,
        "message_delimiters" => 14,
        "reasoning_control" => 15,
        "repeat_last_n" => 16,
        "dry_penalty_last_n" => 17,
        "dry_sequence_breakers" => 18,
        "n_probs" => 19,
        "top_logprobs" => 20,
        "logit_bias" => 21,
        "max_tokens" => 22,
        "max_completion_tokens" => 23,
        "max_output_tokens" => 24,
        "n_predict" => 25,
        "n" => 26,
        "n_cmpl" => 27,
        "stop" => 28,
        "stop_sequences" => 29,
        "grammar" => 30,
        "json_schema" => 31,
        "response_format" => 32,
        "chat_template_kwargs" => 33,
        "return_progress" => 34,
        "tools" => 35,
        "functions" => 36,
        _ => return None,
    })
}

/// Why the member `GUARDED[index]`, whose value is `raw`, is refused; none
/// where it may go on.
pub fn check(index: usize, raw: &str) -> Option<String> {
    let (name, rule) = GUARDED[index];
    match rule {
        Rule::Refused(why) => Some(format!("`{name}` is not accepted: {why}")),
        Rule::Within { .. } if raw == "null" => None,
        Rule::Within { min, max } => match raw.parse::<i64>() {
            Ok(n) if (min..=max).contains(&n) => None,
            _ if max == i64::MAX => Some(format!("`{name}` must be an integer of at least {min}")),
            _ => Some(format!("`{name}` must be an integer from {min} to {max}")),
        },
        Rule::AtMostItems(most) => {
            let items = items(raw).unwrap_or(0);
            (items > most).then(|| format!("`{name}` may hold at most {most} items, not {items}"))
        }
        Rule::AtMostBytes(most) => too_long(name, most, raw),
        Rule::Strings { .. } if raw == "null" => None,
        Rule::Strings { most, bytes } => too_long(name, bytes, raw).or_else(|| {
            // A string alone is one.
            let strings = items(raw).unwrap_or(1);
            (strings > most).then(|| format!("`{name}` may hold at most {most} strings, not {strings}"))
        }),
        Rule::One(_) if raw == "null" || raw == "1" => None,
        Rule::One(why) => Some(format!("`{name}` must be 1: {why}")),
        Rule::True(_) if raw == "true" => None,
        Rule::True(why) => Some(format!("`{name}` may only be true: {why}")),
    }
}

/// The items of an array or an object, as written; `None` for any other value.
fn items(raw: &str) -> Option<usize> {
    match serde_json::from_str::<Value>(raw) {
        Ok(Value::Array(items)) => Some(items.len()),
        Ok(Value::Object(items)) => Some(items.len()),
        _ => None,
    }
}

/// Why `name`, written as `raw`, is over `most` bytes; none where it is not.
fn too_long(name: &str, most: usize, raw: &str) -> Option<String> {
    (raw.len() > most).then(|| format!("`{name}` may be at most {most} bytes long, not {}", raw.len()))
}

/// Where in `body` media is named by a URL the server would fetch itself:
/// the URL, or none. Read only for bodies the scanner saw media in.
pub fn remote_media(body: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(body).ok()?;
    ["messages", "input"].iter().filter_map(|member| value.get(member)).find_map(remote_url)
}

/// A URL in `value` of a media part (`image_url`, `input_audio`, an
/// Anthropic `source`, a video) that is not the media itself (`data:`).
fn remote_url(value: &Value) -> Option<String> {
    match value {
        Value::Array(items) => items.iter().find_map(remote_url),
        Value::Object(members) => members.iter().find_map(|(key, item)| {
            let names_media = matches!(key.as_str(), "url" | "image_url" | "video_url" | "audio_url" | "file_url");
            match item {
                Value::String(url) if names_media && !url.trim_start().starts_with("data:") => Some(url.clone()),
                _ => remote_url(item),
            }
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_guarded_name_is_found_at_its_own_place() {
        for (at, (name, _)) in GUARDED.iter().enumerate() {
            assert_eq!(index(name), Some(at), "{name}");
        }
        assert_eq!(index("temperature"), None);
    }

    #[test]
    fn members_are_refused_or_held_to_their_bounds() {
        let at = |name| index(name).unwrap();
        assert!(check(at("id_slot"), "3").unwrap().contains("evicting"));
        assert_eq!(check(at("n_probs"), "20"), None);
        assert_eq!(check(at("n_probs"), "null"), None);
        assert!(check(at("n_probs"), "21").is_some());
        assert!(check(at("n_probs"), "2.5").is_some());
        assert_eq!(check(at("repeat_last_n"), "-1"), None);
        assert!(check(at("repeat_last_n"), "2147483647").is_some());
        assert_eq!(check(at("max_tokens"), "0"), None);
        assert_eq!(check(at("max_tokens"), "100000"), None);
        assert!(check(at("max_tokens"), "-1").unwrap().contains("at least 0"));
        let many: Vec<String> = (0..301).map(|i| format!("\"{i}\":1")).collect();
        assert!(check(at("logit_bias"), &format!("{{{}}}", many.join(","))).unwrap().contains("not 301"));
        assert_eq!(check(at("logit_bias"), "{\"15\": -100}"), None);
        assert!(check(at("dry_sequence_breakers"), &format!("[{}]", vec!["\"x\""; 17].join(","))).is_some());
        assert_eq!(check(at("n"), "1"), None);
        assert!(check(at("n"), "8").unwrap().contains("slot"));
        assert!(check(at("n_cmpl"), "2").is_some());
        assert_eq!(check(at("stop"), "\"end\""), None);
        assert_eq!(check(at("stop"), "null"), None);
        assert!(check(at("stop"), &format!("[{}]", vec!["\"x\""; 17].join(","))).unwrap().contains("not 17"));
        // One long string, or a few, is held to the bytes all of them may take.
        let long = format!("\"{}\"", "x".repeat(4 << 10));
        assert!(check(at("stop"), &long).unwrap().contains("at most 4096 bytes"));
        assert!(check(at("stop_sequences"), &format!("[{long}]")).unwrap().contains("at most 4096 bytes"));
        assert_eq!(check(at("stop"), &format!("[{}]", vec!["\"\\n\\nUser:\""; 16].join(","))), None);
        let tools = format!(
            "[{{\"type\":\"function\",\"function\":{{\"name\":\"f\",\"description\":\"{}\"}}}}]",
            "d".repeat(256 << 10)
        );
        assert!(check(at("tools"), &tools).unwrap().contains("at most 262144 bytes"));
        assert!(check(at("functions"), &tools).is_some());
        assert_eq!(check(at("tools"), r#"[{"type":"function","function":{"name":"f"}}]"#), None);
        let grammar = format!("\"{}\"", "a".repeat(64 << 10));
        assert!(check(at("grammar"), &grammar).unwrap().contains("at most 65536 bytes"));
        assert_eq!(check(at("grammar"), "\"root ::= [a-z]+\""), None);
        assert!(check(at("chat_template_kwargs"), &format!("{{\"k\":\"{}\"}}", "v".repeat(5000))).is_some());
        assert_eq!(check(at("chat_template_kwargs"), "{\"enable_thinking\":false}"), None);
        assert_eq!(check(at("return_progress"), "true"), None);
        for opting_out in ["false", "null", "0"] {
            assert!(check(at("return_progress"), opting_out).unwrap().contains("only be true"), "{opting_out}");
        }
    }

    #[test]
    fn media_named_by_url_is_found_and_inline_media_is_not() {
        let url = br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://10.0.0.1/x.png"}}]}]}"#;
        assert_eq!(remote_media(url).as_deref(), Some("http://10.0.0.1/x.png"));
        let inline = br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,AA"}}]}]}"#;
        assert_eq!(remote_media(inline), None);
        let anthropic =
            br#"{"messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","url":"file:///etc/passwd"}}]}]}"#;
        assert_eq!(remote_media(anthropic).as_deref(), Some("file:///etc/passwd"));
        let responses = br#"{"input":[{"role":"user","content":[{"type":"input_image","image_url":"https://x/y"}]}]}"#;
        assert_eq!(remote_media(responses).as_deref(), Some("https://x/y"));
        let elsewhere = br#"{"messages":[],"tools":[{"function":{"parameters":{"url":"http://x"}}}]}"#;
        assert_eq!(remote_media(elsewhere), None, "only the conversation is read");
    }
}
