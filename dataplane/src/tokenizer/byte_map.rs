//! GPT-2's reversible byte <-> unicode mapping. Byte-level BPE vocabularies store every
//! token as a string of "visible" characters: printable bytes stand for themselves and
//! the rest (control bytes, space, ...) are shifted to code points from U+0100 upwards,
//! so that no token contains whitespace or control characters.

use std::collections::HashMap;

pub struct ByteMap {
    to_char: [char; 256],
    to_byte: HashMap<char, u8>,
}

impl ByteMap {
    pub fn new() -> Self {
        let visible = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let mut to_char = ['\0'; 256];
        let mut next_shifted = 256u32;
        for b in 0..=255u8 {
            to_char[b as usize] = if visible(b) {
                char::from(b)
            } else {
                let c = char::from_u32(next_shifted).expect("U+0100..U+0143 are valid chars");
                next_shifted += 1;
                c
            };
        }
        let to_byte = to_char
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        Self { to_char, to_byte }
    }

    pub fn char_of(&self, b: u8) -> char {
        self.to_char[b as usize]
    }

    /// The raw bytes a vocabulary string stands for; `None` if it holds a character outside
    /// the mapping (then it is not a byte-level token).
    pub fn bytes_of(&self, token: &str) -> Option<Vec<u8>> {
        token
            .chars()
            .map(|c| self.to_byte.get(&c).copied())
            .collect()
    }
}

impl Default for ByteMap {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping_is_a_bijection_and_known_points_match_gpt2() {
        let m = ByteMap::new();
        let chars: std::collections::HashSet<char> = (0..=255u8).map(|b| m.char_of(b)).collect();
        assert_eq!(chars.len(), 256);
        // Space is the 33rd shifted byte in GPT-2's table: 'Ġ' (U+0120); newline is 'Ċ'.
        assert_eq!(m.char_of(b' '), 'Ġ');
        assert_eq!(m.char_of(b'\n'), 'Ċ');
        assert_eq!(m.char_of(b'a'), 'a');
        for b in 0..=255u8 {
            assert_eq!(m.bytes_of(&m.char_of(b).to_string()), Some(vec![b]));
        }
        assert_eq!(m.bytes_of("a\u{4e00}"), None);
    }
}
