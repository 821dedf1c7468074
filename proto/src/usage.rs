//! What a backend's response says about its tokens and prompt cache, read
//! from the last bytes of the response (JSON or the final SSE events)
//! without parsing the body. Pure. The agent reads it for residency, the
//! data plane for the usage ledger.

use crate::v1::{UsageRecord, UsageRollup};

/// What the server said about one finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
}

/// The tail of a response kept for [`parse_usage`]: usage and timings are
/// in the last event or the last fields of a JSON body.
pub const TAIL_BYTES: usize = 4096;

/// The head of a stream kept for [`parse_stream_usage`]: its first event.
pub const HEAD_BYTES: usize = 4096;

/// Reads OpenAI `usage` (`prompt_tokens`, `completion_tokens`,
/// `prompt_tokens_details.cached_tokens`), the Responses API's and
/// Anthropic's (`input_tokens`, `output_tokens`, `cache_read_input_tokens`),
/// else llama-server's `timings` (`prompt_n` + `cache_n`, `predicted_n`),
/// from the end of a response.
pub fn parse_usage(tail: &[u8]) -> Option<Usage> {
    read(tail).usage()
}

/// A stream's usage where its first event says part of it: Anthropic's
/// `message_start` holds the prompt's tokens and cache reads, its
/// `message_delta` at the end the output's. What the tail says wins.
pub fn parse_stream_usage(head: &[u8], tail: &[u8]) -> Option<Usage> {
    // The head's first event, not its last: a short stream's head is the
    // whole stream, `message_delta` (output only) at its end.
    let first = FIRST_USAGE.find(head).map_or(&head[..0], |at| {
        let rest = &head[at..];
        // An event ends at a blank line, LF or CRLF.
        let end = [&b"\n\n"[..], b"\r\n\r\n"].iter().filter_map(|blank| memchr::memmem::find(rest, blank)).min();
        &rest[..end.unwrap_or(rest.len())]
    });
    // Each count where the tail says it, else where the head does; the
    // prompt made of them after.
    let (head, tail) = (anthropic_counts(first), anthropic_counts(tail));
    let [input, output, cache_read, cache_written] = std::array::from_fn(|i| tail[i].or(head[i]));
    let parts = [input, cache_read, cache_written];
    parts.iter().any(Option::is_some).then_some(())?;
    Some(Usage {
        // Anthropic's input tokens are those neither read from the cache
        // nor written to it.
        prompt_tokens: parts.into_iter().flatten().fold(0u32, u32::saturating_add),
        completion_tokens: output.unwrap_or(0),
        cached_tokens: cache_read.unwrap_or(0),
    })
}

/// Anthropic's counts in the last usage object of `part`: input, output,
/// cache reads, cache writes.
fn anthropic_counts(part: &[u8]) -> [Option<u32>; 4] {
    let Some(from) = FIRST_USAGE.find_iter(part).last() else { return [None; 4] };
    let numbers = last_numbers(&part[from..]);
    [numbers[6], numbers[7], numbers[8], numbers[9]]
}

/// Where a usage object starts.
static FIRST_USAGE: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"usage\":"));

/// What one part of a response says, each count where it says it.
#[derive(Clone, Copy, Debug, Default)]
struct Reading {
    prompt: Option<u32>,
    completion: Option<u32>,
    cached: Option<u32>,
}

impl Reading {
    /// Usage, where the prompt's tokens are known.
    fn usage(self) -> Option<Usage> {
        Some(Usage {
            prompt_tokens: self.prompt?,
            completion_tokens: self.completion.unwrap_or(0),
            cached_tokens: self.cached.unwrap_or(0),
        })
    }
}

fn read(tail: &[u8]) -> Reading {
    // Only from the last `usage` or `timings` object on: a stream's tail
    // holds hundreds of quotes before them. Searched forwards, to the last
    // match: a reverse search has no vectorised prefilter and costs a few
    // instructions per byte, most of all where the object is missing.
    let Some(from) = OBJECTS.iter().filter_map(|object| object.find_iter(tail).last()).min() else {
        return Reading::default();
    };
    let [prompt, completion, cached, cache_n, processed, predicted, input, output, cache_read, cache_written] =
        last_numbers(&tail[from..]);
    if prompt.is_some() {
        return Reading { prompt, completion: completion.or(Some(0)), cached: cached.or(cache_n).or(Some(0)) };
    }
    if cache_read.is_some() || cache_written.is_some() {
        // Anthropic's input tokens are those neither read from the cache
        // nor written to it.
        let prompt = [input, cache_read, cache_written].into_iter().flatten().fold(0u32, u32::saturating_add);
        return Reading { prompt: Some(prompt), completion: output, cached: cache_read.or(Some(0)) };
    }
    if input.is_some() || output.is_some() {
        // The Responses API's input tokens include the cached ones.
        return Reading { prompt: input, completion: output, cached };
    }
    let Some(processed) = processed else { return Reading::default() };
    let cached = cache_n.unwrap_or(0);
    Reading { prompt: Some(processed.saturating_add(cached)), completion: predicted.or(Some(0)), cached: Some(cached) }
}

/// The objects that hold the keys; searchers built once.
static OBJECTS: std::sync::LazyLock<[memchr::memmem::Finder<'static>; 2]> = std::sync::LazyLock::new(|| {
    [memchr::memmem::Finder::new(b"\"usage\":"), memchr::memmem::Finder::new(b"\"timings\":")]
});

/// The keys [`read`] reads, in the order [`last_numbers`] answers.
const KEYS: [&[u8]; 10] = [
    b"\"prompt_tokens\":",
    b"\"completion_tokens\":",
    b"\"cached_tokens\":",
    b"\"cache_n\":",
    b"\"prompt_n\":",
    b"\"predicted_n\":",
    b"\"input_tokens\":",
    b"\"output_tokens\":",
    b"\"cache_read_input_tokens\":",
    b"\"cache_creation_input_tokens\":",
];

/// The number after the last occurrence of each of [`KEYS`] (`None` where
/// the key is missing or no number follows it). One pass from the end,
/// stopping only at quotes (found with `memrchr`), and comparing keys only
/// where the quote is followed by their first letter: every response pays
/// for this.
fn last_numbers(haystack: &[u8]) -> [Option<u32>; 10] {
    let mut seen = [false; 10];
    let mut numbers = [None; 10];
    for at in memchr::memrchr_iter(b'"', haystack) {
        let rest = &haystack[at..];
        if !matches!(rest.get(1), Some(b'p' | b'c' | b'i' | b'o')) {
            continue;
        }
        let Some(k) = KEYS.iter().position(|key| rest.starts_with(key)) else { continue };
        if seen[k] {
            continue;
        }
        seen[k] = true;
        numbers[k] = number(&rest[KEYS[k].len()..]);
        if seen.iter().all(|s| *s) {
            break;
        }
    }
    numbers
}

/// The unsigned integer at the start of `text`, after any whitespace.
fn number(text: &[u8]) -> Option<u32> {
    let mut digits = text.iter().skip_while(|b| b.is_ascii_whitespace()).take_while(|b| b.is_ascii_digit());
    let first = digits.next()?;
    digits.try_fold(u32::from(first - b'0'), |n, b| n.checked_mul(10)?.checked_add(u32::from(b - b'0')))
}

/// What llama-server says of a prompt it is reading, in the events a
/// stream asked for with `return_progress` sends before its first token.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PromptProgress {
    /// The prompt's tokens.
    pub total: u32,
    /// Those it found in its cache.
    pub cache: u32,
    /// Those read so far, the cached ones included.
    pub processed: u32,
}

impl PromptProgress {
    /// The prompt's usage as far as it was read: what a request cut short
    /// by its client is counted for.
    pub fn usage(self, completion_tokens: u32) -> Usage {
        let prompt_tokens = self.processed.min(self.total);
        Usage { prompt_tokens, completion_tokens, cached_tokens: self.cache.min(prompt_tokens) }
    }
}

/// Where a progress object starts.
static PROGRESS: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"prompt_progress\":"));

/// Whether an event carries llama-server's `prompt_progress`.
pub fn is_progress_event(event: &[u8]) -> bool {
    PROGRESS.find(event).is_some()
}

/// Whether a stream's frame holds progress events and nothing after them:
/// the server has not produced a token yet.
pub fn only_progress(frame: &[u8]) -> bool {
    PROGRESS.find_iter(frame).last().is_some_and(|at| memchr::memmem::find(&frame[at..], b"\ndata:").is_none())
}

/// The `prompt_progress` an event carries: `{"total":T,"cache":C,
/// "processed":P,"time_ms":..}`. `None` where it has none, or lacks a count.
pub fn parse_prompt_progress(event: &[u8]) -> Option<PromptProgress> {
    let at = PROGRESS.find(event)? + PROGRESS.needle().len();
    let object = &event[at..];
    // Its own members only: the object holds no other object.
    let object = &object[..memchr::memchr(b'}', object)?];
    let count = |key: &[u8]| memchr::memmem::find(object, key).and_then(|at| number(&object[at + key.len()..]));
    Some(PromptProgress {
        total: count(b"\"total\":")?,
        cache: count(b"\"cache\":")?,
        processed: count(b"\"processed\":")?,
    })
}

/// Tokens `key_id` used on the day of `now_ms` (UTC), as `today` shows
/// them: none where it counts another day.
pub fn tokens_today(today: &crate::v1::KeyUsageToday, key_id: &str, now_ms: u64) -> u64 {
    if today.day != hour_of(now_ms)[..8] {
        return 0;
    }
    today.tokens.get(key_id).copied().unwrap_or(0)
}

/// The hour a record falls in, as `YYYYMMDDHH` (UTC): keys sort by time.
pub fn hour_of(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let (y, m, d) = civil_from_days(i64::try_from(secs / 86_400).unwrap_or(0));
    format!("{y:04}{m:02}{d:02}{:02}", (secs % 86_400) / 3600)
}

/// The start of an hour key, back in milliseconds.
pub fn hour_start_ms(hour: &str) -> Option<u64> {
    if hour.len() != 10 {
        return None;
    }
    let (y, m, d, h) = (
        hour[0..4].parse().ok()?,
        hour[4..6].parse().ok()?,
        hour[6..8].parse().ok()?,
        hour[8..10].parse::<u64>().ok()?,
    );
    let days = u64::try_from(days_from_civil(y, m, d)).ok()?;
    Some((days * 86_400 + h * 3600) * 1000)
}

/// Howard Hinnant's days-from-civil and back: the proleptic Gregorian
/// calendar without a date crate.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = u32::try_from(doy - (153 * mp + 2) / 5 + 1).unwrap_or(1);
    let m = u32::try_from(if mp < 10 { mp + 3 } else { mp - 9 }).unwrap_or(1);
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The backend's own time on a request, from llama-server's `timings`
/// (`prompt_ms`, `predicted_ms`), whole milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendTime {
    pub prompt_ms: u32,
    pub generation_ms: u32,
}

/// The backend's time on a request, where the end of its answer says it
/// (the last `timings` object); `None` where it does not.
pub fn parse_backend_time(tail: &[u8]) -> Option<BackendTime> {
    let from = TIMINGS.find_iter(tail).last()?;
    let [prompt, generation] = timing_numbers(&tail[from..]);
    (prompt.is_some() || generation.is_some())
        .then(|| BackendTime { prompt_ms: prompt.unwrap_or(0), generation_ms: generation.unwrap_or(0) })
}

static TIMINGS: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"timings\":"));

/// The milliseconds after the last `prompt_ms` and `predicted_ms` keys of
/// `object`, rounded (llama-server writes them with decimals).
fn timing_numbers(object: &[u8]) -> [Option<u32>; 2] {
    [&b"\"prompt_ms\":"[..], b"\"predicted_ms\":"].map(|key| {
        let at = memchr::memmem::find_iter(object, key).last()?;
        let text = object[at + key.len()..].trim_ascii_start();
        let end = text.iter().position(|b| !matches!(b, b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-'));
        let ms: f64 = std::str::from_utf8(&text[..end.unwrap_or(text.len())]).ok()?.parse().ok()?;
        // Saturates past u32 (and a negative or not-a-number is none).
        (ms.is_finite() && ms >= 0.0).then(|| ms.round() as u32)
    })
}

/// The most an hour of a node's GPU time may be priced at (an agent's
/// `gpu_hour_price`); a figure past it prices nothing.
pub const MAX_GPU_HOUR_PRICE: f64 = 1e6;

/// What use without a key (auth off) is summed under, by tenant.
pub const NO_KEY: &str = "(no key)";

/// The name a key's use is summed under, by tenant: its tenant, else the
/// key as a tenant of its own (`key:<id>`), else [`NO_KEY`]. No tenant can
/// have either of the last two (a tenant's name is of `A-Z a-z 0-9 . _ -`).
pub fn tenant_name(tenant: &str, key_id: &str) -> String {
    match (tenant.is_empty(), key_id.is_empty()) {
        (false, _) => tenant.to_string(),
        (true, false) => format!("key:{key_id}"),
        (true, true) => NO_KEY.to_string(),
    }
}

/// Counts one request into a roll-up.
pub fn add(rollup: &mut UsageRollup, record: &UsageRecord) {
    rollup.requests += 1;
    rollup.errors += u64::from(record.outcome != "ok");
    rollup.prompt_tokens += record.prompt_tokens;
    rollup.cached_tokens += record.cached_tokens;
    rollup.completion_tokens += record.completion_tokens;
    rollup.estimated_requests += u64::from(record.estimated);
    rollup.latency_ms_sum += u64::from(record.latency_ms);
    rollup.prompt_ms += record.prompt_ms;
    rollup.generation_ms += record.generation_ms;
    rollup.cost_micros += record.cost_micros;
}

/// Adds one roll-up to another.
pub fn merge(into: &mut UsageRollup, from: &UsageRollup) {
    into.requests += from.requests;
    into.errors += from.errors;
    into.prompt_tokens += from.prompt_tokens;
    into.cached_tokens += from.cached_tokens;
    into.completion_tokens += from.completion_tokens;
    into.estimated_requests += from.estimated_requests;
    into.latency_ms_sum += from.latency_ms_sum;
    into.prompt_ms += from.prompt_ms;
    into.generation_ms += from.generation_ms;
    into.cost_micros += from.cost_micros;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backend_s_time_is_read_from_its_last_timings() {
        let chat = br#"{"usage":{"prompt_tokens":11},"timings":{"cache_n":0,"prompt_n":11,"prompt_ms":31.526,"prompt_per_token_ms":2.82,"predicted_n":5,"predicted_ms":44.445,"predicted_per_second":89.7}}"#;
        assert_eq!(parse_backend_time(chat), Some(BackendTime { prompt_ms: 32, generation_ms: 44 }));
        let stream = b"data: {\"timings\":{\"prompt_ms\":1.0}}\n\ndata: {\"timings\":{\"prompt_ms\":1200,\"predicted_ms\":7}}\n\ndata: [DONE]\n\n";
        assert_eq!(parse_backend_time(stream), Some(BackendTime { prompt_ms: 1200, generation_ms: 7 }));
        assert_eq!(parse_backend_time(br#"{"usage":{"prompt_tokens":3}}"#), None);
        assert_eq!(parse_backend_time(br#"{"timings":{"cache_n":3}}"#), None);
        let tiny = br#"{"timings":{"prompt_ms":1.5e-05,"predicted_ms":2.5e3}}"#;
        assert_eq!(parse_backend_time(tiny), Some(BackendTime { prompt_ms: 0, generation_ms: 2_500 }));
    }

    #[test]
    fn hours_are_utc_and_round_trip() {
        assert_eq!(hour_of(0), "1970010100");
        // 2026-11-29 10:42:05 UTC.
        assert_eq!(hour_of(1_795_948_925_000), "2026112910");
        assert_eq!(hour_of(951_782_400_000), "2000022900");
        for ms in [0, 951_782_400_000, 1_795_948_925_000] {
            let hour = hour_of(ms);
            assert_eq!(hour_of(hour_start_ms(&hour).unwrap()), hour);
            assert!(hour_start_ms(&hour).unwrap() <= ms && ms - hour_start_ms(&hour).unwrap() < 3_600_000);
        }
    }

    #[test]
    fn prompt_progress_is_read_from_llama_server_s_event() {
        // b11434's chat chunk, as it sends it with `return_progress`.
        let event = br#"data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1796320784,"id":"chatcmpl-o","model":"m","system_fingerprint":"b0-unknown","object":"chat.completion.chunk","prompt_progress":{"total":818,"cache":12,"processed":256,"time_ms":5}}"#;
        let progress = parse_prompt_progress(event).unwrap();
        assert_eq!(progress, PromptProgress { total: 818, cache: 12, processed: 256 });
        assert!(is_progress_event(event));
        assert!(only_progress(event));
        let then_a_token = [&event[..], b"\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n"].concat();
        assert!(is_progress_event(&then_a_token) && !only_progress(&then_a_token));
        assert!(!only_progress(b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n"));
        assert_eq!(progress.usage(3), Usage { prompt_tokens: 256, completion_tokens: 3, cached_tokens: 12 });
        // Counts past the prompt's are not believed beyond it.
        let wild = PromptProgress { total: 10, cache: 50, processed: 40 };
        assert_eq!(wild.usage(0), Usage { prompt_tokens: 10, completion_tokens: 0, cached_tokens: 10 });
        for partial in [
            &br#"data: {"choices":[{"delta":{"content":"total"}}]}"#[..],
            br#"data: {"prompt_progress":{"total":818,"processed":256}}"#,
            br#"data: {"prompt_progress":{"total":818,"cache":0,"processed":"#,
            br#"data: {"prompt_progress":{"cache":1,"processed":2}, "total":3}"#,
        ] {
            assert_eq!(parse_prompt_progress(partial), None, "{}", String::from_utf8_lossy(partial));
        }
    }

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
    fn the_last_value_of_each_key_counts_and_quoted_text_is_not_a_key() {
        let tail = concat!(
            "data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\n",
            "data: {\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":30}}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"\\\"prompt_tokens\\\":9\"}}]}\n\n",
        );
        assert_eq!(
            parse_usage(tail.as_bytes()),
            Some(Usage { prompt_tokens: 12, completion_tokens: 30, cached_tokens: 0 })
        );
    }

    #[test]
    fn keys_before_the_last_usage_object_do_not_count() {
        let tail = b"data: {\"prompt_tokens\":5}\n\ndata: {\"usage\":{\"completion_tokens\":3}}\n\n";
        assert_eq!(parse_usage(tail), None);
        let tail = b"{\"timings\":{\"prompt_n\":4},\"usage\":{\"prompt_tokens\":6}}";
        assert_eq!(parse_usage(tail), Some(Usage { prompt_tokens: 6, completion_tokens: 0, cached_tokens: 0 }));
    }

    #[test]
    fn anthropic_usage_counts_cache_reads_into_the_prompt() {
        let whole = br#"{"type":"message","usage":{"cache_read_input_tokens":52,"input_tokens":1,"output_tokens":4}}"#;
        assert_eq!(parse_usage(whole), Some(Usage { prompt_tokens: 53, completion_tokens: 4, cached_tokens: 52 }));
        // llama-server's stream: the prompt in `message_start`, the output
        // in `message_delta`, thousands of bytes apart.
        let head = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":",
            "{\"cache_read_input_tokens\":18,\"input_tokens\":3,\"output_tokens\":0}}}\n\n"
        );
        let tail = concat!(
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":40}}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
        );
        assert_eq!(parse_usage(tail.as_bytes()), None, "the tail alone has no prompt");
        let usage = Usage { prompt_tokens: 21, completion_tokens: 40, cached_tokens: 18 };
        assert_eq!(parse_stream_usage(head.as_bytes(), tail.as_bytes()), Some(usage));
        // A short stream is all head: its first usage is the prompt's.
        let whole = format!("{head}event: content_block_delta\ndata: {{}}\n\n{tail}");
        assert_eq!(parse_stream_usage(whole.as_bytes(), whole.as_bytes()), Some(usage));
        // A `message_delta` that names its input alone is still Anthropic's.
        let input_only = b"data: {\"usage\":{\"input_tokens\":2,\"output_tokens\":9}}";
        assert_eq!(
            parse_stream_usage(head.as_bytes(), input_only),
            Some(Usage { prompt_tokens: 20, completion_tokens: 9, cached_tokens: 18 })
        );
        // A client gone before the end: what the head said.
        let early = Usage { completion_tokens: 0, ..usage };
        assert_eq!(parse_stream_usage(head.as_bytes(), b"event: content_block_delta\n"), Some(early));
        // Anthropic's own `message_delta` says it all again: it wins.
        let full = br#"data: {"usage":{"input_tokens":5,"cache_creation_input_tokens":7,"cache_read_input_tokens":0,"output_tokens":9}}"#;
        assert_eq!(
            parse_stream_usage(head.as_bytes(), full),
            Some(Usage { prompt_tokens: 12, completion_tokens: 9, cached_tokens: 0 })
        );
    }

    #[test]
    fn responses_usage_counts_its_cached_tokens_within_its_input() {
        let body = br#"{"usage":{"input_tokens":30,"input_tokens_details":{"cached_tokens":20},"output_tokens":5,"total_tokens":35}}"#;
        assert_eq!(parse_usage(body), Some(Usage { prompt_tokens: 30, completion_tokens: 5, cached_tokens: 20 }));
    }

    #[test]
    fn nothing_is_made_up() {
        assert_eq!(parse_usage(b"{\"data\":[{\"embedding\":[0.1]}]}"), None);
        assert_eq!(parse_usage(b""), None);
        // No digits, or more than a u32 holds: no number.
        assert_eq!(parse_usage(b"{\"usage\":{\"prompt_tokens\":null}}"), None);
        assert_eq!(parse_usage(b"{\"usage\":{\"prompt_tokens\":4294967296}}"), None);
        assert_eq!(parse_usage(b"{\"usage\":{\"prompt_tokens\":4294967295}}").map(|u| u.prompt_tokens), Some(u32::MAX));
    }
}
