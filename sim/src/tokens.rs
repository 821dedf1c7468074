//! Deterministic stand-ins for a tokenizer, a chat template, a sampler and an
//! embedding model.
//!
//! They are cheap and reproducible rather than realistic: what matters for
//! routing experiments is that the same text always yields the same tokens, and
//! that a reply fed back in the next turn re-tokenizes to exactly the tokens the
//! slot generated, so prefix reuse behaves as it does on a real server.

/// The Jinja source of the ChatML template that [`render_chatml`] implements,
/// reported by `/props` as llama-server does.
pub(crate) const CHATML_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Lowercase ASCII words, so each one tokenizes to a single token.
const WORDS: [&str; 32] = [
    "the", "model", "token", "cache", "slot", "prefix", "server", "fleet", "route", "quick", "brown", "fox", "jumps",
    "over", "lazy", "dog", "river", "stone", "light", "cloud", "green", "paper", "music", "field", "north", "south",
    "piano", "tiger", "amber", "delta", "orbit", "pixel",
];

const FNV32_OFFSET: u32 = 0x811c_9dc5;
const FNV32_PRIME: u32 = 0x0100_0193;
const FNV64_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV64_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv1a32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(FNV32_OFFSET, |h, b| (h ^ u32::from(*b)).wrapping_mul(FNV32_PRIME))
}

fn fnv1a64_step(h: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(h, |h, b| (h ^ u64::from(*b)).wrapping_mul(FNV64_PRIME))
}

/// The id of one token piece.
pub(crate) fn token_id(piece: &str) -> u32 {
    fnv1a32(piece.as_bytes())
}

/// Splits text into tokens: a maximal run of ASCII alphanumerics, or any other
/// single character.
pub(crate) fn tokenize(text: &str) -> Vec<u32> {
    pieces(text).map(token_id).collect()
}

/// The pieces of text each token stands for, in order.
pub(crate) fn pieces(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        let first = rest.chars().next()?;
        let len = if first.is_ascii_alphanumeric() {
            rest.find(|c: char| !c.is_ascii_alphanumeric()).unwrap_or(rest.len())
        } else {
            first.len_utf8()
        };
        let (piece, after) = rest.split_at(len);
        rest = after;
        Some(piece)
    })
}

/// One chat message after its content parts were joined.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// Renders messages with ChatML and the generation prompt, as llama-server
/// does for a model whose GGUF carries the ChatML template.
pub(crate) fn render_chatml(messages: &[ChatMessage]) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str("<|im_start|>");
        out.push_str(&m.role);
        out.push('\n');
        out.push_str(&m.content);
        out.push_str("<|im_end|>\n");
    }
    out.push_str("<|im_start|>assistant\n");
    out
}

/// Greedy "sampling" for a model that never emits EOS: the reply alternates
/// words and single spaces, and depends only on the prompt, so identical
/// requests get identical replies.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Generator {
    seed: u64,
}

impl Generator {
    pub(crate) fn new(prompt: &[u32]) -> Generator {
        let seed = prompt.iter().fold(FNV64_OFFSET, |h, t| fnv1a64_step(h, &t.to_le_bytes()));
        Generator { seed }
    }

    /// The piece generated at `position` (0-based) of the reply. Every piece
    /// re-tokenizes to exactly one token, and adjacent pieces never merge.
    pub(crate) fn piece(&self, position: usize) -> &'static str {
        if position % 2 == 1 {
            return " ";
        }
        let h = fnv1a64_step(self.seed, &(position as u64).to_le_bytes());
        // Fold the high bits in: FNV's low bits alone are poorly mixed.
        let idx = ((h ^ (h >> 32)) % WORDS.len() as u64) as usize;
        WORDS[idx]
    }
}

/// A deterministic, L2-normalised embedding: the mean of pseudo-random vectors
/// seeded by each token id, so texts that share tokens point the same way.
pub(crate) fn embed(tokens: &[u32], dim: usize) -> Vec<f32> {
    let mut acc = vec![0.0f32; dim];
    for t in tokens {
        let mut rng = fastrand::Rng::with_seed(u64::from(*t) ^ 0x9e37_79b9_7f4a_7c15);
        for v in acc.iter_mut() {
            *v += rng.f32() * 2.0 - 1.0;
        }
    }
    let norm = acc.iter().map(|v| v * v).sum::<f32>().sqrt();
    if norm > 0.0 {
        for v in acc.iter_mut() {
            *v /= norm;
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_splits_runs_and_single_chars() {
        let t = tokenize("Hello, wörld 42!\n");
        // "Hello" "," " " "w" "ö" "rld" " " "42" "!" "\n"
        assert_eq!(t.len(), 10);
        assert_eq!(t[0], token_id("Hello"));
        assert_eq!(t[4], token_id("ö"));
        assert_eq!(t[7], token_id("42"));
        assert!(tokenize("").is_empty());
    }

    #[test]
    fn generated_pieces_retokenize_one_to_one() {
        let g = Generator::new(&tokenize("some prompt"));
        let pieces: Vec<&str> = (0..9).map(|i| g.piece(i)).collect();
        let text: String = pieces.concat();
        let ids: Vec<u32> = pieces.iter().map(|p| token_id(p)).collect();
        assert_eq!(tokenize(&text), ids);
    }

    #[test]
    fn output_is_deterministic_per_prompt() {
        let a = Generator::new(&tokenize("prompt a"));
        let b = Generator::new(&tokenize("prompt a"));
        let c = Generator::new(&tokenize("prompt c"));
        let run = |g: &Generator| (0..40).map(|i| g.piece(i)).collect::<String>();
        assert_eq!(run(&a), run(&b));
        assert_ne!(run(&a), run(&c));
    }

    #[test]
    fn chatml_rendering() {
        let m = [ChatMessage { role: "user".into(), content: "hi".into() }];
        assert_eq!(render_chatml(&m), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn embeddings_are_normalised_and_deterministic() {
        let e = embed(&tokenize("hello world"), 16);
        let norm: f32 = e.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4);
        assert_eq!(e, embed(&tokenize("hello world"), 16));
        assert_eq!(embed(&[], 4), vec![0.0; 4]);
    }
}
