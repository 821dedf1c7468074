//! What a backend's response says about its prompt cache, read from the
//! last bytes of the response (JSON or the final SSE events) without
//! parsing the body. Pure.

use crate::residency::Usage;

/// The tail of a response kept for [`parse_usage`]: usage and timings are
/// in the last event or the last fields of a JSON body.
pub const TAIL_BYTES: usize = 4096;

/// Reads OpenAI `usage` (`prompt_tokens`, `completion_tokens`,
/// `prompt_tokens_details.cached_tokens`), else llama-server's `timings`
/// (`prompt_n` + `cache_n`, `predicted_n`), from the end of a response.
pub fn parse_usage(tail: &[u8]) -> Option<Usage> {
    if let Some(prompt) = last_number(tail, b"\"prompt_tokens\":") {
        return Some(Usage {
            prompt_tokens: prompt,
            completion_tokens: last_number(tail, b"\"completion_tokens\":").unwrap_or(0),
            cached_tokens: last_number(tail, b"\"cached_tokens\":")
                .or_else(|| last_number(tail, b"\"cache_n\":"))
                .unwrap_or(0),
        });
    }
    let processed = last_number(tail, b"\"prompt_n\":")?;
    let cached = last_number(tail, b"\"cache_n\":").unwrap_or(0);
    Some(Usage {
        prompt_tokens: processed.saturating_add(cached),
        completion_tokens: last_number(tail, b"\"predicted_n\":").unwrap_or(0),
        cached_tokens: cached,
    })
}

fn last_number(haystack: &[u8], key: &[u8]) -> Option<u32> {
    let at = haystack.windows(key.len()).rposition(|w| w == key)? + key.len();
    let digits: Vec<u8> = haystack[at..]
        .iter()
        .skip_while(|b| b.is_ascii_whitespace())
        .take_while(|b| b.is_ascii_digit())
        .copied()
        .collect();
    std::str::from_utf8(&digits).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_read_from_a_json_body() {
        let body = br#"{"choices":[],"usage":{"completion_tokens":8,"prompt_tokens":106,"total_tokens":114,"prompt_tokens_details":{"cached_tokens":63}},"timings":{"cache_n":63,"prompt_n":43}}"#;
        assert_eq!(parse_usage(body), Some(Usage { prompt_tokens: 106, completion_tokens: 8, cached_tokens: 63 }));
    }

    #[test]
    fn timings_serve_when_a_stream_carries_no_usage() {
        let tail = b"data: {\"choices\":[{\"finish_reason\":\"length\",\"delta\":{}}],\"timings\":{\"cache_n\": 20,\"prompt_n\":5,\"predicted_n\":7}}\n\ndata: [DONE]\n\n";
        assert_eq!(parse_usage(tail), Some(Usage { prompt_tokens: 25, completion_tokens: 7, cached_tokens: 20 }));
    }

    #[test]
    fn nothing_is_made_up() {
        assert_eq!(parse_usage(b"{\"data\":[{\"embedding\":[0.1]}]}"), None);
        assert_eq!(parse_usage(b""), None);
    }
}
