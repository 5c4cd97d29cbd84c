//! Hash slots: which slot a key belongs to, so tests can pick keys per slot.

/// The number of hash slots in a Valkey cluster.
pub const SLOTS: u16 = 16384;

/// The hash slot of `key`, as `CLUSTER KEYSLOT` computes it: CRC16 (XMODEM) modulo 16384 of
/// the key, or of its hash tag, the part between the first `{` and the next `}` if that part
/// is not empty.
pub fn key_slot(key: &[u8]) -> u16 {
    let hashed = match key.iter().position(|&b| b == b'{') {
        Some(open) => match key[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &key[open + 1..open + 1 + len],
            _ => key,
        },
        None => key,
    };
    crc16(hashed) % SLOTS
}

/// A hash tag, `{...}`, whose keys all fall in `slot`: `format!("{}:x", hash_tag_for_slot(s))`
/// is a key in slot `s`.
///
/// # Panics
/// If `slot` is not below [`SLOTS`].
pub fn hash_tag_for_slot(slot: u16) -> String {
    assert!(slot < SLOTS, "slot {slot} is out of range");
    // Every slot is hit within a few hundred thousand decimal tags (CRC16 spreads well).
    (0u64..)
        .map(|n| n.to_string())
        .find(|tag| key_slot(tag.as_bytes()) == slot)
        .map(|tag| format!("{{{tag}}}"))
        .expect("the search is unbounded")
}

/// A hash tag for every slot, indexed by slot: `tags[s]` is `{...}` with keys in slot `s`.
/// One pass over decimal tags, so it is cheap where many slots are needed at once.
pub fn slot_tags() -> Vec<String> {
    let mut tags: Vec<Option<String>> = vec![None; usize::from(SLOTS)];
    let mut missing = usize::from(SLOTS);
    for n in 0u64.. {
        let tag = n.to_string();
        let slot = usize::from(key_slot(tag.as_bytes()));
        if tags[slot].is_none() {
            tags[slot] = Some(format!("{{{tag}}}"));
            missing -= 1;
            if missing == 0 {
                break;
            }
        }
    }
    tags.into_iter().map(|t| t.unwrap_or_default()).collect()
}

/// CRC16-CCITT (XMODEM): polynomial 0x1021, initial value 0, no reflection.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        // The check value of CRC16/XMODEM, and the examples of the cluster spec.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(key_slot(b"123456789"), 12739);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"bar"), 5061);
        assert_eq!(key_slot(b""), 0);
    }

    #[test]
    fn hash_tags() {
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"{user1000}.followers"), key_slot(b"user1000"));
        // The first `{` and the first `}` after it; an empty tag hashes the whole key.
        assert_eq!(key_slot(b"foo{}{bar}"), key_slot(b"foo{}{bar}"));
        assert_ne!(key_slot(b"foo{}{bar}"), key_slot(b"bar"));
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
        assert_eq!(key_slot(b"foo{bar}{zap}"), key_slot(b"bar"));
        assert_eq!(key_slot(b"a{b"), crc16(b"a{b") % SLOTS);
    }

    #[test]
    fn tags_for_slots() {
        for slot in [0, 1, 5460, 5461, 12182, 16383] {
            let tag = hash_tag_for_slot(slot);
            assert_eq!(key_slot(format!("{tag}:k").as_bytes()), slot, "{tag}");
        }
    }
}
