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

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

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

/// The largest token limit a request may name: llama-server's `int32_t`.
const MAX_TOKEN_LIMIT: i64 = i32::MAX as i64;

/// The guarded members, by name.
pub const GUARDED: [(&str, Rule); 38] = [
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
    // is full, or, where the server shifts its context, never ends. The
    // server reads a limit as a 32-bit integer, which a larger one wraps
    // to a negative.
    ("max_tokens", Rule::Within { min: 0, max: MAX_TOKEN_LIMIT }),
    ("max_completion_tokens", Rule::Within { min: 0, max: MAX_TOKEN_LIMIT }),
    ("max_output_tokens", Rule::Within { min: 0, max: MAX_TOKEN_LIMIT }),
    ("n_predict", Rule::Within { min: 0, max: MAX_TOKEN_LIMIT }),
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
    // It trims llama-server's own answers to the members named, `timings`
    // (their usage) among them.
    ("response_fields", Rule::Refused("it can keep out of the answer the usage the gateway counts")),
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
        "response_fields" => 37,
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
            _ => Some(format!("`{name}` must be an integer from {min} to {max}")),
        },
        Rule::AtMostItems(most) => match items(raw) {
            Ok(items) => {
                let items = items.unwrap_or(0);
                (items > most).then(|| format!("`{name}` may hold at most {most} items, not {items}"))
            }
            Err(_) => Some(unreadable(name)),
        },
        Rule::AtMostBytes(most) => too_long(name, most, raw),
        Rule::Strings { .. } if raw == "null" => None,
        Rule::Strings { most, bytes } => too_long(name, bytes, raw).or_else(|| match items(raw) {
            Ok(strings) => {
                // A string alone is one.
                let strings = strings.unwrap_or(1);
                (strings > most).then(|| format!("`{name}` may hold at most {most} strings, not {strings}"))
            }
            Err(_) => Some(unreadable(name)),
        }),
        Rule::One(_) if raw == "null" || raw == "1" => None,
        Rule::One(why) => Some(format!("`{name}` must be 1: {why}")),
        Rule::True(_) if raw == "true" => None,
        Rule::True(why) => Some(format!("`{name}` may only be true: {why}")),
    }
}

/// The items of an array or an object, as written; `None` for any other
/// value. Counted as the value is read, keeping none of it: a bound on
/// items is checked before the value's length is. An error where the
/// value cannot be read (a number past a double, a broken escape): what
/// is not read is not let through.
fn items(raw: &str) -> Result<Option<usize>, serde_json::Error> {
    let mut reader = serde_json::Deserializer::from_str(raw);
    serde::Deserializer::deserialize_any(&mut reader, Items)
}

/// Why `name` is refused where it cannot be read.
fn unreadable(name: &str) -> String {
    format!("`{name}` is not JSON the gateway reads (a number out of range, or a broken escape)")
}

/// A visitor's answer to every scalar but a string: nothing found in it.
/// (serde's default is an error, which the checks take for an unreadable
/// value.)
macro_rules! scalars_are_none {
    ($found:ty) => {
        fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Option<$found>, E> {
            Ok(None)
        }

        fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Option<$found>, E> {
            Ok(None)
        }

        fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Option<$found>, E> {
            Ok(None)
        }

        fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Option<$found>, E> {
            Ok(None)
        }

        fn visit_unit<E: serde::de::Error>(self) -> Result<Option<$found>, E> {
            Ok(None)
        }
    };
}

/// Counts a container's items, each skipped unread.
struct Items;

impl<'de> Visitor<'de> for Items {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an array or an object")
    }

    scalars_are_none!(usize);

    fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<Option<usize>, E> {
        Ok(None)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Option<usize>, A::Error> {
        let mut count = 0;
        while items.next_element::<IgnoredAny>()?.is_some() {
            count += 1;
        }
        Ok(Some(count))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut items: A) -> Result<Option<usize>, A::Error> {
        let mut count = 0;
        while items.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {
            count += 1;
        }
        Ok(Some(count))
    }
}

/// Why `name`, written as `raw`, is over `most` bytes; none where it is not.
fn too_long(name: &str, most: usize, raw: &str) -> Option<String> {
    (raw.len() > most).then(|| format!("`{name}` may be at most {most} bytes long, not {}", raw.len()))
}

/// Where in `body` media is named by a URL the server would fetch itself:
/// the URL, or none. Read only for bodies the scanner saw media in, as a
/// walk that keeps nothing but the URL: a body of many small values would
/// take many times its size as a tree. An error where the conversation
/// cannot be read (a number past a double, a broken escape), which is
/// refused rather than let through unread.
pub fn remote_media(body: &[u8]) -> Result<Option<String>, serde_json::Error> {
    let mut reader = serde_json::Deserializer::from_slice(body);
    serde::Deserializer::deserialize_map(&mut reader, Conversation)
}

/// A body's `messages` and `input`, walked for a media URL; every other
/// member skipped unread.
struct Conversation;

impl<'de> Visitor<'de> for Conversation {
    type Value = Option<String>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut members: A) -> Result<Option<String>, A::Error> {
        let mut found = None;
        while let Some(read) = members.next_key_seed(Name(|name| matches!(name, "messages" | "input")))? {
            let url = if read {
                members.next_value_seed(MediaUrl { named: false })?
            } else {
                members.next_value::<IgnoredAny>().map(|_| None)?
            };
            found = found.or(url);
        }
        Ok(found)
    }
}

/// Whether a member's name is one `is` picks, read without keeping it.
struct Name(fn(&str) -> bool);

impl<'de> DeserializeSeed<'de> for Name {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, reader: D) -> Result<bool, D::Error> {
        reader.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Name {
    type Value = bool;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a member's name")
    }

    fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<bool, E> {
        Ok((self.0)(name))
    }
}

/// A URL in a value of a media part (`image_url`, `input_audio`, an
/// Anthropic `source`, a video) that is not the media itself (`data:`):
/// a string is one where its member names media (`named`).
#[derive(Clone, Copy)]
struct MediaUrl {
    named: bool,
}

impl<'de> DeserializeSeed<'de> for MediaUrl {
    type Value = Option<String>;

    fn deserialize<D: Deserializer<'de>>(self, reader: D) -> Result<Option<String>, D::Error> {
        reader.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for MediaUrl {
    type Value = Option<String>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Option<String>, E> {
        Ok((self.named && !text.trim_start().starts_with("data:")).then(|| text.to_string()))
    }

    scalars_are_none!(String);

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Option<String>, A::Error> {
        let mut found = None;
        while let Some(url) = items.next_element_seed(MediaUrl { named: false })? {
            found = found.or(url);
        }
        Ok(found)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut members: A) -> Result<Option<String>, A::Error> {
        let mut found = None;
        let names_media = |name: &str| matches!(name, "url" | "image_url" | "video_url" | "audio_url" | "file_url");
        while let Some(named) = members.next_key_seed(Name(names_media))? {
            found = found.or(members.next_value_seed(MediaUrl { named })?);
        }
        Ok(found)
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
        assert!(check(at("response_fields"), r#"["content"]"#).unwrap().contains("usage"));
        assert_eq!(check(at("n_probs"), "20"), None);
        assert_eq!(check(at("n_probs"), "null"), None);
        assert!(check(at("n_probs"), "21").is_some());
        assert!(check(at("n_probs"), "2.5").is_some());
        assert_eq!(check(at("repeat_last_n"), "-1"), None);
        assert!(check(at("repeat_last_n"), "2147483647").is_some());
        assert_eq!(check(at("max_tokens"), "0"), None);
        assert_eq!(check(at("max_tokens"), "100000"), None);
        assert!(check(at("max_tokens"), "-1").unwrap().contains("from 0 to 2147483647"));
        assert_eq!(check(at("n_predict"), "2147483647"), None);
        // Read by the server as an `int32_t`: -1, no limit at all.
        assert!(check(at("n_predict"), "4294967295").is_some());
        assert!(check(at("max_completion_tokens"), "2147483648").is_some());
        let many: Vec<String> = (0..301).map(|i| format!("\"{i}\":1")).collect();
        assert!(check(at("logit_bias"), &format!("{{{}}}", many.join(","))).unwrap().contains("not 301"));
        assert_eq!(check(at("logit_bias"), "{\"15\": -100}"), None);
        // Counted as read, nothing of it kept: a million items as cheaply.
        let million = format!("[{}0]", "0,".repeat(999_999));
        assert!(check(at("logit_bias"), &million).unwrap().contains("not 1000000"));
        assert_eq!((items("\"x\"").unwrap(), items("3").unwrap(), items("null").unwrap()), (None, None, None));
        assert!(items("[1,").is_err() && items("1e400").is_err());
        assert_eq!(items(r#"{"a":[1,{"b":[2]}],"c":"d"}"#).unwrap(), Some(2));
        // An item the gateway cannot read refuses the member, as the
        // server would.
        let surrogate = format!("{{\"\\ud800\":1,{}\"0\":1}}", "\"1\":1,".repeat(400));
        assert!(check(at("logit_bias"), &surrogate).unwrap().contains("not JSON the gateway reads"));
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
        assert_eq!(remote_media(url).unwrap().as_deref(), Some("http://10.0.0.1/x.png"));
        let inline = br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,AA"}}]}]}"#;
        assert_eq!(remote_media(inline).unwrap(), None);
        let anthropic =
            br#"{"messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","url":"file:///etc/passwd"}}]}]}"#;
        assert_eq!(remote_media(anthropic).unwrap().as_deref(), Some("file:///etc/passwd"));
        let responses = br#"{"input":[{"role":"user","content":[{"type":"input_image","image_url":"https://x/y"}]}]}"#;
        assert_eq!(remote_media(responses).unwrap().as_deref(), Some("https://x/y"));
        let elsewhere = br#"{"messages":[],"tools":[{"function":{"parameters":{"url":"http://x"}}}]}"#;
        assert_eq!(remote_media(elsewhere).unwrap(), None, "only the conversation is read");
        // Names as the server reads them, after the other members, in any
        // of the conversation's members named twice.
        let escaped = br#"{"model":"m","stream":true,"messages":[{"content":[{"image_url":" http://x/1"}]}]}"#;
        assert_eq!(remote_media(escaped).unwrap().as_deref(), Some(" http://x/1"));
        let twice = br#"{"messages":[{"content":"hi"}],"messages":[{"content":[{"url":"http://x/2"}]}]}"#;
        assert_eq!(remote_media(twice).unwrap().as_deref(), Some("http://x/2"));
        let listed = br#"{"messages":[{"content":[{"image_url":["http://x/3"]},{"url":3,"image_url":null}]}]}"#;
        assert_eq!(remote_media(listed).unwrap(), None, "a media member's string only");
        let spelled = br#"{"messages":[{"content":[{"\u0069mage_url":{"\u0075rl":"http://x/5"}}]}]}"#;
        assert_eq!(remote_media(spelled).unwrap().as_deref(), Some("http://x/5"));
        // What cannot be read is not let through: a number past a double,
        // a lone surrogate, before or after the URL.
        for unread in [
            &br#"{"messages":[{"content":[{"url":"http://x/6"}],"n":1e400}]}"#[..],
            br#"{"messages":[{"content":"\ud800"},{"content":[{"url":"http://x/7"}]}]}"#,
            br#"{"messages":[{"url":"http://x/4"}"#,
        ] {
            assert!(remote_media(unread).is_err(), "{}", String::from_utf8_lossy(unread));
        }
    }
}
