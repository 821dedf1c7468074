//! The gRPC contracts of Inferyes (package `inferyes.v1`), the one error
//! vocabulary every component maps its failures onto, and what every
//! component must agree on to speak them: stable hashes, header names,
//! usage as backends report it, API keys and tokens, TLS settings. No
//! networking of its own: the proxies' (their connection pool, serving
//! loop, telemetry) is `inferyes-net`'s, so a client of the fleet API
//! (`inferyesctl`) builds without it.

pub mod v1 {
    #![allow(clippy::all, clippy::pedantic)]
    tonic::include_proto!("inferyes.v1");
}

pub mod allowance;
pub mod apikey;
pub mod bearer;
mod decision;
mod error;
pub mod files;
pub mod hash;
pub mod headers;
pub mod kinds;
pub mod tls;
pub mod usage;

pub use error::{ErrorKind, anthropic_error_body, openai_error_body};

/// The longest text the fleet keeps of each name an agent reports (a
/// model's id among them): a request naming a longer model names none the
/// fleet has.
pub const MAX_NAME_BYTES: usize = 256;

/// The routing policy's defaults for its zero values (see `RoutingPolicy`):
/// data planes route by them, the dashboard draws them.
pub const DEFAULT_ADMISSION_THRESHOLD: f64 = 0.92;
pub const DEFAULT_HARD_LIMIT: f64 = 0.98;

/// The warm replicas fleet policy declares for `model`: its `replicas`,
/// else two for a latency-critical model, else none (loaded on demand
/// only). Placement keeps them; the catalog, the dashboard and the
/// metrics show them.
pub fn replicas(policy: &v1::RoutingPolicy, model: &str) -> v1::Replicas {
    if let Some(declared) = policy.replicas.get(model) {
        return *declared;
    }
    let critical = policy.latency_critical_models.iter().any(|m| m == model);
    v1::Replicas { min: if critical { 2 } else { 0 }, max: 0 }
}

/// Milliseconds since the Unix epoch; 0 if the clock is before it.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// `text` with the characters that change how the text around them reads
/// without being seen (direction overrides, zero-width characters,
/// terminal escapes, a carriage return and other controls, line feeds
/// and tabs aside) replaced by U+FFFD: for showing text from clients,
/// agents and backends to people, on the dashboard and in a terminal.
pub fn shown_plain(text: &str) -> std::borrow::Cow<'_, str> {
    replaced(text, unseen)
}

/// As [`shown_plain`], and on one line: line feeds and tabs replaced too,
/// for a name in a row, which a line of its own could pass off as
/// another row.
pub fn shown_on_one_line(text: &str) -> std::borrow::Cow<'_, str> {
    replaced(text, |c| unseen(c) || c == '\n' || c == '\t')
}

/// Whether `text` shows on one line as it is ([`shown_on_one_line`]
/// changes nothing of it): what a name must be to be one.
pub fn is_plain(text: &str) -> bool {
    !text.chars().any(|c| unseen(c) || c == '\n' || c == '\t')
}

fn replaced(text: &str, hidden: impl Fn(char) -> bool) -> std::borrow::Cow<'_, str> {
    if text.chars().any(&hidden) {
        text.chars().map(|c| if hidden(c) { char::REPLACEMENT_CHARACTER } else { c }).collect::<String>().into()
    } else {
        text.into()
    }
}

/// Controls but line feeds and tabs, and Unicode's format characters
/// (category Cf).
fn unseen(c: char) -> bool {
    matches!(c,
        '\u{0}'..='\u{8}' | '\u{b}'..='\u{1f}' | '\u{7f}'..='\u{9f}' | '\u{ad}' | '\u{600}'..='\u{605}' | '\u{890}'..='\u{891}' | '\u{8e2}'
        | '\u{61c}' | '\u{6dd}' | '\u{70f}' | '\u{180e}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}'
        | '\u{2060}'..='\u{2064}' | '\u{2066}'..='\u{206f}' | '\u{feff}' | '\u{fff9}'..='\u{fffb}' | '\u{110bd}' | '\u{110cd}' | '\u{13430}'..='\u{1343f}' | '\u{1bca0}'..='\u{1bca3}'
        | '\u{1d173}'..='\u{1d17a}' | '\u{e0001}' | '\u{e0020}'..='\u{e007f}')
}

/// A short tag for a session key, the same in every component: enough to
/// follow one conversation across the dashboard's lists, without showing
/// (or letting anyone recover) the key itself. FNV-1a, 32 bits, as hex.
pub fn session_tag(key: &str) -> String {
    let mut hash: u32 = 0x811c_9dc5;
    for byte in key.bytes() {
        hash ^= u32::from(byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    let mut tag = [0u8; 8];
    write_hex(&mut tag, u128::from(hash));
    String::from_utf8(tag.to_vec()).unwrap_or_default()
}

/// `bytes` in lowercase hex: digests, MACs.
pub fn hex(bytes: &[u8]) -> String {
    let mut out = vec![0u8; 2 * bytes.len()];
    for (digits, byte) in out.chunks_exact_mut(2).zip(bytes) {
        write_hex(digits, u128::from(*byte));
    }
    String::from_utf8(out).unwrap_or_default()
}

/// Writes the low digits of `bits` into `out` as lowercase hex, the last
/// digit last: ids, keys and tags on the request path, without the
/// formatting machinery.
pub fn write_hex(out: &mut [u8], mut bits: u128) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for digit in out.iter_mut().rev() {
        *digit = HEX[(bits & 0xf) as usize];
        bits >>= 4;
    }
}

/// A hash map for keys looked up on the request path (model names, key
/// ids, upstream origins): foldhash instead of the standard SipHash, about a
/// fifth of the instructions per lookup. Seeded per process, so keys a
/// client chooses cannot be picked to collide.
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
/// The set of [`FastMap`].
pub type FastSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

/// `value`'s hash under [`FastMap`]'s hasher, seeded once per process: one
/// word for a map that must hash with SipHash (a metric family's label
/// set) to hash in place of every field.
pub fn fast_digest(value: &impl std::hash::Hash) -> u64 {
    static SEED: std::sync::LazyLock<foldhash::fast::RandomState> = std::sync::LazyLock::new(Default::default);
    std::hash::BuildHasher::hash_one(&*SEED, value)
}

/// `map`'s value for `key`, made by `make` where there is none. Looked up
/// first: `entry` takes the key owned, a copy on every call, where the
/// common case (the key is there) needs none.
pub fn value_for<'a, V>(map: &'a mut FastMap<String, V>, key: &str, make: impl FnOnce() -> V) -> &'a mut V {
    if !map.contains_key(key) {
        map.insert(key.to_string(), make());
    }
    map.get_mut(key).expect("the value is there: inserted just above when missing")
}

#[cfg(test)]
mod tests {
    #[test]
    fn bytes_are_written_in_hex_two_digits_each() {
        assert_eq!(super::hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        assert_eq!(super::hex(&[]), "");
    }

    #[test]
    fn value_for_makes_a_value_once_and_then_finds_it() {
        let mut map = super::FastMap::default();
        *super::value_for(&mut map, "a", || 1) += 10;
        *super::value_for(&mut map, "a", || unreachable!("made once")) += 100;
        assert_eq!(*super::value_for(&mut map, "b", || 2), 2);
        assert_eq!((map["a"], map.len()), (111, 2));
    }

    #[test]
    fn text_that_reads_other_than_it_is_is_shown_as_it_is() {
        assert_eq!(super::shown_plain("chat\u{202e}txt.exe"), "chat\u{fffd}txt.exe");
        assert_eq!(super::shown_plain("node\u{200b}-a \u{1b}]0;title\u{7}"), "node\u{fffd}-a \u{fffd}]0;title\u{fffd}");
        let plain = "plain, ünïcode, 日本\nnext\tline";
        assert!(matches!(super::shown_plain(plain), std::borrow::Cow::Borrowed(p) if p == plain));
        assert_eq!(super::shown_plain("row\rover"), "row\u{fffd}over");
        assert_eq!(super::shown_on_one_line(plain), "plain, ünïcode, 日本\u{fffd}next\u{fffd}line");
        assert!(super::is_plain("plain, ünïcode, 日本") && !super::is_plain(plain) && !super::is_plain("a\u{200b}"));
    }

    #[test]
    fn session_tags_are_pinned_and_short() {
        // Pinned: data planes and controllers of different builds must agree.
        assert_eq!(super::session_tag(""), "811c9dc5");
        assert_eq!(super::session_tag("a"), "e40c292c");
        assert_eq!(super::session_tag("s2496"), "0004353b", "zero-padded to eight digits");
        assert_ne!(super::session_tag("conversation-1"), super::session_tag("conversation-2"));
    }
}
