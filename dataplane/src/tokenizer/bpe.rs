//! Byte-pair encoding over token ids: a piece starts as one id per byte and the adjacent
//! pair with the lowest merge rank is merged until no known pair remains.

use std::collections::HashMap;

use super::byte_map::ByteMap;

pub struct Bpe {
    /// (left, right) -> (rank, merged id). Ranks are the merges' order in the file.
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// None: the vocabulary has no token for this byte (SmolLM2 lacks some control
    /// bytes); such bytes are dropped, as llama.cpp and HF `tokenizers` do.
    byte_ids: [Option<u32>; 256],
    /// Every token by its (byte-mapped) text, for `ignore_merges`.
    whole: HashMap<String, u32>,
    bytes: ByteMap,
}

impl Bpe {
    pub fn new(
        merges: HashMap<(u32, u32), (u32, u32)>,
        byte_ids: [Option<u32>; 256],
        whole: HashMap<String, u32>,
    ) -> Self {
        Self {
            merges,
            byte_ids,
            whole,
            bytes: ByteMap::new(),
        }
    }

    /// Append the tokens of one pre-tokenized piece. `ignore_merges`: a piece that is a
    /// token as a whole is that token (Llama 3 vocabularies).
    pub fn encode_piece(&self, piece: &[u8], ignore_merges: bool, out: &mut Vec<u32>) {
        if ignore_merges {
            let text: String = piece.iter().map(|&b| self.bytes.char_of(b)).collect();
            if let Some(&id) = self.whole.get(&text) {
                out.push(id);
                return;
            }
        }
        let mut syms: Vec<u32> = piece
            .iter()
            .filter_map(|&b| self.byte_ids[b as usize])
            .collect();
        loop {
            // Leftmost pair with the lowest rank, as in the reference implementations;
            // pieces are short (a word), so a linear scan per merge is cheap.
            let best = syms
                .windows(2)
                .enumerate()
                .filter_map(|(i, w)| self.merges.get(&(w[0], w[1])).map(|&(r, m)| (r, i, m)))
                .min_by_key(|&(r, i, _)| (r, i));
            let Some((_, i, merged)) = best else { break };
            syms[i] = merged;
            syms.remove(i + 1);
        }
        out.extend_from_slice(&syms);
    }
}
