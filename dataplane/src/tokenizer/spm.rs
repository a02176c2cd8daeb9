//! SentencePiece (llama.cpp's `llama` tokenizer model, Llama 2 / Mistral / Gemma
//! vocabularies): spaces become `▁`, the text starts as one symbol per UTF-8 character, and
//! adjacent symbols whose concatenation is a token merge, the highest-scoring pair first
//! (the leftmost among equal scores), until no pair is a token. A symbol that is not a token
//! becomes its bytes' `<0xXX>` tokens (byte fallback).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// SentencePiece's word-boundary marker, U+2581.
pub const SPACE: char = '\u{2581}';

pub struct Spm {
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    /// The `<0xXX>` token of each byte (or, lacking one, the byte's one-character token).
    byte_ids: [Option<u32>; 256],
}

/// A merge candidate: symbols `left` and `right` (adjacent when it was made), whose
/// texts together are `len` bytes long and a token of `score`.
#[derive(Debug, Clone, Copy)]
struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
/// The heap's greatest is the next merge: the highest score, then the leftmost.
impl Ord for Bigram {
    fn cmp(&self, o: &Self) -> Ordering {
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.left.cmp(&self.left))
    }
}

/// One symbol of the text being merged: bytes `start..start + len` (len 0: merged
/// away), linked to its neighbours.
#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    pub fn new(tokens: &[String], scores: Vec<f32>) -> Self {
        let ids: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let mut byte_ids = [None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = ids
                .get(&format!("<0x{b:02X}>"))
                .or_else(|| {
                    char::from_u32(b as u32)
                        .filter(|_| b < 128)
                        .and_then(|c| ids.get(&c.to_string()))
                })
                .copied();
        }
        Self {
            ids,
            scores,
            byte_ids,
        }
    }

    /// Whether byte fallback can spell every byte.
    pub fn has_byte_tokens(&self) -> bool {
        self.byte_ids.iter().all(Option::is_some)
    }

    /// Tokenize `text`, whose spaces the caller has already turned into [`SPACE`].
    pub fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let mut syms: Vec<Symbol> = Vec::new();
        for (i, (start, c)) in text.char_indices().enumerate() {
            syms.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: None,
            });
            if i > 0 {
                syms[i - 1].next = Some(i);
            }
        }
        let mut heap = BinaryHeap::new();
        for i in 1..syms.len() {
            self.push_bigram(text, &syms, i - 1, i, &mut heap);
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (syms[b.left], syms[b.right]);
            // Stale: one side was merged into another symbol since.
            if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
                continue;
            }
            syms[b.left].len += r.len;
            syms[b.right].len = 0;
            syms[b.left].next = r.next;
            if let Some(n) = r.next {
                syms[n].prev = Some(b.left);
            }
            if let Some(p) = syms[b.left].prev {
                self.push_bigram(text, &syms, p, b.left, &mut heap);
            }
            if let Some(n) = syms[b.left].next {
                self.push_bigram(text, &syms, b.left, n, &mut heap);
            }
        }
        let mut at = (!syms.is_empty()).then_some(0);
        while let Some(i) = at {
            let s = syms[i];
            let piece = &text[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                // Only single characters can be left over (merges make tokens).
                None => out.extend(piece.bytes().filter_map(|b| self.byte_ids[b as usize])),
            }
            at = s.next;
        }
    }

    fn push_bigram(
        &self,
        text: &str,
        syms: &[Symbol],
        left: usize,
        right: usize,
        heap: &mut BinaryHeap<Bigram>,
    ) {
        let (l, r) = (syms[left], syms[right]);
        let len = l.len + r.len;
        if let Some(&id) = self.ids.get(&text[l.start..l.start + len]) {
            heap.push(Bigram {
                left,
                right,
                score: self.scores.get(id as usize).copied().unwrap_or(0.0),
                len,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab(tokens: &[(&str, f32)]) -> (Spm, Vec<String>) {
        let mut all: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
        let mut scores = vec![0.0; 256];
        for (t, s) in tokens {
            all.push(t.to_string());
            scores.push(*s);
        }
        (Spm::new(&all, scores), all)
    }

    fn texts(all: &[String], ids: &[u32]) -> Vec<String> {
        ids.iter().map(|&i| all[i as usize].clone()).collect()
    }

    #[test]
    fn highest_scores_merge_first_and_leftovers_fall_back_to_bytes() {
        let (spm, all) = vocab(&[
            ("▁", -1.0),
            ("h", -2.0),
            ("e", -2.0),
            ("l", -2.0),
            ("o", -2.0),
            ("he", -3.0),
            ("ll", -1.5),
            ("hell", -4.0),
            ("hello", -5.0),
            ("▁hello", -0.5),
            ("lo", -1.0),
        ]);
        let mut out = Vec::new();
        spm.encode("▁hello", &mut out);
        // "lo" (-1.0) merges first, which leaves "ll" stale; then "he" (-3.0). "hel" and
        // "llo" are no tokens, so "▁hello" is never reached: merging is greedy.
        assert_eq!(texts(&all, &out), ["▁", "he", "l", "lo"]);
        out.clear();
        // "é" is no token: its two UTF-8 bytes are.
        spm.encode("hé", &mut out);
        assert_eq!(texts(&all, &out), ["h", "<0xC3>", "<0xA9>"]);
        out.clear();
        spm.encode("", &mut out);
        assert!(out.is_empty());
        assert!(spm.has_byte_tokens());
    }

    #[test]
    fn equal_scores_merge_leftmost_first() {
        let (spm, all) = vocab(&[("a", 0.0), ("aa", -1.0)]);
        let mut out = Vec::new();
        spm.encode("aaa", &mut out);
        assert_eq!(texts(&all, &out), ["aa", "a"]);
    }
}
