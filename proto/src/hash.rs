//! Hashes that must give the same value in every data plane and every
//! controller, on every build: `std`'s hashers promise neither, so these
//! are spelled out; and a hasher for maps keyed by them.

/// FNV-1a over the bytes, finished with a SplitMix64 mix for avalanche.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix(hash)
}

/// A stable hash of long texts (a conversation's opening: a system prompt
/// runs to tens of kilobytes), eight bytes a step: FNV-1a, a multiply per
/// byte, took 11 µs for 10 KB, a third of the data plane's CPU for a whole
/// request. Each part's length is mixed in, so parts need no separator.
pub fn text_hash(parts: &[&[u8]]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        let mut words = part.chunks_exact(8);
        for word in &mut words {
            let word = u64::from_le_bytes([word[0], word[1], word[2], word[3], word[4], word[5], word[6], word[7]]);
            hash = (hash ^ word).wrapping_mul(K).rotate_left(29);
        }
        let mut last = [0u8; 8];
        last[..words.remainder().len()].copy_from_slice(words.remainder());
        hash = (hash ^ u64::from_le_bytes(last)).wrapping_mul(K).rotate_left(29);
        hash = (hash ^ part.len() as u64).wrapping_mul(K);
    }
    mix(hash)
}

/// Rendezvous (highest random weight) score of a key on a node.
pub fn rendezvous_score(key: u64, node: u64) -> u64 {
    mix(key ^ mix(node))
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Maps a 64-bit hash into the open interval (0, 1).
pub fn unit_interval(hash: u64) -> f64 {
    ((hash >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// A hasher for keys that already are well-mixed hashes.
#[derive(Default)]
pub struct Prehashed(u64);

impl std::hash::Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used by `u64` keys; fold anything else.
        for byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*byte);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_hashes_are_pinned_and_tell_parts_apart() {
        // Pinned: data planes of different builds must derive the same
        // session key from the same conversation.
        assert_eq!(text_hash(&[b"You are helpful.", b"hello"]), 0x09a6_fc1b_8136_1f6e);
        assert_eq!(text_hash(&[]), mix(0xcbf2_9ce4_8422_2325));
        // Where one part ends and the next starts counts, and every byte.
        assert_ne!(text_hash(&[b"ab", b"c"]), text_hash(&[b"a", b"bc"]));
        assert_ne!(text_hash(&[b"", b"abc"]), text_hash(&[b"abc", b""]));
        let long = vec![b'x'; 10_000];
        let mut other = long.clone();
        other[9_999] = b'y';
        assert_ne!(text_hash(&[&long]), text_hash(&[&other]));
        assert_ne!(text_hash(&[b"abcdefgh"]), text_hash(&[b"abcdefgh\0"]));
    }

    #[test]
    fn hashes_are_pinned() {
        // Pinned values: a change here would move every session in a
        // mixed-version fleet.
        assert_eq!(stable_hash(b""), mix(0xcbf2_9ce4_8422_2325));
        assert_ne!(stable_hash(b"a"), stable_hash(b"b"));
        assert_eq!(stable_hash(b"session-1"), stable_hash(b"session-1"));
    }

    #[test]
    fn rendezvous_spreads_keys_evenly() {
        let nodes: Vec<u64> = (0..4u8).map(|n| stable_hash(&[n])).collect();
        let mut counts = [0usize; 4];
        for key in 0..4000u32 {
            let key = stable_hash(&key.to_le_bytes());
            let best = (0..4).max_by_key(|&i| rendezvous_score(key, nodes[i])).unwrap();
            counts[best] += 1;
        }
        assert!(counts.iter().all(|&c| (800..1200).contains(&c)), "{counts:?}");
    }
}
