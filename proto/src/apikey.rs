//! API keys: `ify_<key_id>_<secret>`. The key id names the stored record;
//! the secret is checked against the record's argon2id hash and never
//! stored, logged or sent anywhere after it was shown once.

use argon2::Argon2;
use argon2::password_hash::{PasswordHasher, PasswordVerifier};

const PREFIX: &str = "ify_";
/// Lowercase base32 (RFC 4648 alphabet, no padding): no `_`, so the
/// key's parts split unambiguously, and nothing a shell or URL mangles.
const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
/// 60 bits: ids are looked up, not guessed at.
const ID_CHARS: usize = 12;
/// 160 bits of secret.
const SECRET_CHARS: usize = 32;

/// A freshly made key: the whole key for the client, once, and what is
/// stored of it.
pub struct NewKey {
    pub key_id: String,
    /// `ify_<key_id>_<secret>`.
    pub token: String,
    /// argon2id PHC string of the secret.
    pub secret_hash: String,
}

pub fn generate() -> anyhow::Result<NewKey> {
    let key_id = random_chars(ID_CHARS)?;
    let secret = random_chars(SECRET_CHARS)?;
    let secret_hash = hash(&secret)?;
    Ok(NewKey { token: format!("{PREFIX}{key_id}_{secret}"), key_id, secret_hash })
}

/// The largest weight a key's requests may have in a data plane's queue:
/// enough to give one flow most of a fleet, not to overflow its tags.
pub const MAX_WEIGHT: u32 = 1_000;

/// Whether `tenant` may name a tenant of keys: empty (none), or 1-64 of
/// `A-Z a-z 0-9 . _ -` (it becomes part of session keys, which travel as
/// header values).
pub fn valid_tenant(tenant: &str) -> bool {
    tenant.len() <= 64 && tenant.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// `(key_id, secret)` of a presented key; `None` when it is not one.
pub fn parse(token: &str) -> Option<(&str, &str)> {
    let (key_id, secret) = token.strip_prefix(PREFIX)?.split_once('_')?;
    let valid = |part: &str, len: usize| part.len() == len && part.bytes().all(in_alphabet);
    (valid(key_id, ID_CHARS) && valid(secret, SECRET_CHARS)).then_some((key_id, secret))
}

/// Whether `b` is in [`ALPHABET`], as two ranges: every keyed request asks
/// this of 44 bytes, and searching the alphabet for each was 4k
/// instructions of the request's 64k.
fn in_alphabet(b: u8) -> bool {
    matches!(b, b'a'..=b'z' | b'2'..=b'7')
}

/// Whether `key_id` has the shape of a key id (for input validation).
pub fn valid_key_id(key_id: &str) -> bool {
    key_id.len() == ID_CHARS && key_id.bytes().all(in_alphabet)
}

/// Argon2id with the crate's default parameters (19 MiB, 2 passes): tens
/// of milliseconds, which is why data planes verify a key once and cache
/// the verdict.
pub fn hash(secret: &str) -> anyhow::Result<String> {
    Argon2::default()
        .hash_password(secret.as_bytes())
        .map(|h| h.to_string())
        .map_err(|e| anyhow::anyhow!("cannot hash the key: {e}"))
}

/// Whether `secret` matches the PHC string (parameters are read from it).
pub fn verify(secret: &str, secret_hash: &str) -> bool {
    Argon2::default().verify_password(secret.as_bytes(), secret_hash).is_ok()
}

/// Whether a key limited to `patterns` may use `model`: an exact id, or a
/// prefix ending in `*`. No patterns: every model.
pub fn model_allowed(patterns: &[String], model: &str) -> bool {
    patterns.is_empty()
        || patterns.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => model.starts_with(prefix),
            None => p == model,
        })
}

/// Whether a `presented` secret equals the `expected` one, in time that
/// depends only on what was presented: a length that differs is not
/// answered at once, which would tell a caller the secret's length.
pub fn constant_time_eq(presented: &[u8], expected: &[u8]) -> bool {
    let same_length = presented.len() == expected.len();
    // As many steps as were presented, either way: against itself where
    // the lengths differ, already unequal.
    let against = if same_length { expected } else { presented };
    let difference = presented.iter().zip(against).fold(u8::from(!same_length), |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(difference) == 0
}

/// `n` random characters of the key alphabet (5 bits each), from the OS.
pub fn random_chars(n: usize) -> anyhow::Result<String> {
    let mut bytes = vec![0u8; n];
    getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("no randomness from the OS: {e}"))?;
    // 256 is a multiple of 32: taking the low 5 bits keeps the choice uniform.
    Ok(bytes.iter().map(|b| ALPHABET[usize::from(b & 31)] as char).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_are_short_plain_names_or_none() {
        for good in ["", "acme", "team-7.prod_eu", &"a".repeat(64)] {
            assert!(valid_tenant(good), "{good}");
        }
        for bad in ["a b", "a/b", "é", "a\n", &"a".repeat(65)] {
            assert!(!valid_tenant(bad), "{bad:?}");
        }
    }

    #[test]
    fn a_generated_key_parses_and_verifies_and_nothing_else_does() {
        let key = generate().unwrap();
        let (key_id, secret) = parse(&key.token).unwrap();
        assert_eq!(key_id, key.key_id);
        assert!(key.secret_hash.starts_with("$argon2id$"), "{}", key.secret_hash);
        assert!(!key.secret_hash.contains(secret));
        assert!(verify(secret, &key.secret_hash));
        let mut wrong = secret.to_string();
        wrong.replace_range(0..1, if wrong.starts_with('a') { "b" } else { "a" });
        assert!(!verify(&wrong, &key.secret_hash));
        assert!(!verify(secret, "not a hash"));
        for bad in ["", "ify_", "sk-abc", &key.token[1..], &format!("{}x", key.token), &key.token.to_uppercase()] {
            assert!(parse(bad).is_none(), "{bad}");
        }
        assert_ne!(generate().unwrap().token, key.token);
    }

    #[test]
    fn the_alphabet_test_is_the_alphabet() {
        for b in 0..=u8::MAX {
            assert_eq!(in_alphabet(b), ALPHABET.contains(&b), "{b}");
        }
    }

    #[test]
    fn model_patterns_are_exact_or_prefixes() {
        let patterns = vec!["llama-3-8b".to_string(), "qwen*".to_string()];
        assert!(model_allowed(&patterns, "llama-3-8b"));
        assert!(model_allowed(&patterns, "qwen2.5-7b"));
        assert!(!model_allowed(&patterns, "llama-3-70b"));
        assert!(model_allowed(&[], "anything"));
    }

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"ab", b"abc"));
        assert!(!constant_time_eq(b"abab", b"ab"), "not the expected secret repeated");
        assert!(!constant_time_eq(b"", b"ab"));
        assert!(!constant_time_eq(b"a", b""));
        assert!(constant_time_eq(b"", b""));
    }
}
