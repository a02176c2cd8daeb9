//! Pre-tokenizers of byte-level BPE vocabularies: split text into pieces before BPE so
//! that merges never cross word, number or whitespace boundaries. The variant is chosen by
//! the GGUF key `tokenizer.ggml.pre`, with the names llama.cpp gives them.
//!
//! Each pattern is a hand-written scanner rather than a regex, as in llama.cpp (whose
//! tokenization is the reference): its splits are the leftmost-first matches of the
//! pattern in its comment, including at the edges of a segment (a text between special
//! tokens, or between isolated digits), where a lookahead such as `\s+(?!\S)` sees the end
//! of the segment.

use super::unicode::{Flags, flags};

/// The split patterns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pattern {
    /// GPT-2: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    Gpt2,
    /// Llama 3: `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
    /// ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    Llama3,
    /// Qwen2: as Llama 3 with `\p{N}` (single digits) instead of `\p{N}{1,3}`.
    Qwen2,
}

/// The pre-tokenizer of a vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreTokenizer {
    pattern: Pattern,
    /// Every numeric character becomes its own piece before the pattern runs (the
    /// StarCoder family's `\p{N}` split), so numbers are tokenized digit by digit.
    split_digits: bool,
    /// A piece that is itself a token is that token, without merges (llama.cpp's
    /// `ignore_merges` of the Llama 3 vocabularies, HF's `ignore_merges`).
    pub ignore_merges: bool,
    /// BOS is added unless the file says otherwise (`tokenizer.ggml.add_bos_token`).
    pub add_bos_default: bool,
}

/// `(names, pattern, split_digits, ignore_merges, add_bos_default)`, as llama.cpp maps
/// `tokenizer.ggml.pre` names onto its pre-tokenizer types.
const NAMES: &[(&[&str], Pattern, bool, bool, bool)] = &[
    (
        &[
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
        ],
        Pattern::Gpt2,
        true,
        false,
        false,
    ),
    (
        &["gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "default"],
        Pattern::Gpt2,
        false,
        false,
        false,
    ),
    (
        &["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"],
        Pattern::Llama3,
        false,
        true,
        true,
    ),
    (&["dbrx", "smaug-bpe"], Pattern::Llama3, false, false, false),
    (
        &[
            "qwen2",
            "deepseek-r1-qwen",
            "megrez",
            "stablelm2",
            "hunyuan",
        ],
        Pattern::Qwen2,
        false,
        false,
        false,
    ),
];

/// Every `tokenizer.ggml.pre` name [`PreTokenizer::from_name`] accepts.
pub fn supported_names() -> Vec<&'static str> {
    NAMES.iter().flat_map(|n| n.0.iter().copied()).collect()
}

impl PreTokenizer {
    pub fn from_name(name: &str) -> crate::Result<Self> {
        let &(_, pattern, split_digits, ignore_merges, add_bos_default) =
            NAMES.iter().find(|n| n.0.contains(&name)).ok_or_else(|| {
                crate::Error::Tokenizer(format!(
                    "unsupported pre-tokenizer '{name}' (tokenizer.ggml.pre); supported: {}",
                    supported_names().join(", ")
                ))
            })?;
        Ok(Self {
            pattern,
            split_digits,
            ignore_merges,
            add_bos_default,
        })
    }

    pub fn split<'a>(&self, text: &'a str) -> Vec<&'a str> {
        let mut out = Vec::new();
        if self.split_digits {
            let mut start = 0;
            for (i, c) in text.char_indices() {
                if flags(c).number {
                    self.split_segment(&text[start..i], &mut out);
                    out.push(&text[i..i + c.len_utf8()]);
                    start = i + c.len_utf8();
                }
            }
            self.split_segment(&text[start..], &mut out);
        } else {
            self.split_segment(text, &mut out);
        }
        out
    }

    /// Split one segment: the pattern's matches, one after another, cover it.
    fn split_segment<'a>(&self, text: &'a str, out: &mut Vec<&'a str>) {
        if text.is_empty() {
            return;
        }
        let s = Scan::new(text);
        let mut ends = Vec::new();
        match self.pattern {
            Pattern::Gpt2 => s.gpt2(&mut ends),
            Pattern::Llama3 => s.llama3(&mut ends, 3),
            Pattern::Qwen2 => s.llama3(&mut ends, 1),
        }
        let mut from = 0;
        for end in ends {
            let to = s.byte(end);
            out.push(&text[from..to]);
            from = to;
        }
    }
}

/// A segment as code points, with the scanners' lookups (`None` past its ends).
struct Scan {
    cps: Vec<char>,
    bytes: Vec<usize>,
}

impl Scan {
    fn new(text: &str) -> Self {
        let (bytes, cps) = text.char_indices().unzip();
        Self { cps, bytes }
    }

    fn len(&self) -> usize {
        self.cps.len()
    }

    fn cp(&self, i: usize) -> Option<char> {
        self.cps.get(i).copied()
    }

    fn fl(&self, i: usize) -> Option<Flags> {
        self.cp(i).map(flags)
    }

    /// Byte offset of code point `i` (the segment's length at its end).
    fn byte(&self, i: usize) -> usize {
        self.bytes.get(i).copied().unwrap_or_else(|| {
            self.bytes
                .last()
                .map_or(0, |b| b + self.cps[i - 1].len_utf8())
        })
    }

    /// `'s|'t|'re|'ve|'m|'ll|'d` at `pos` (ASCII-case-insensitive when `fold`): its end.
    fn contraction(&self, pos: usize, fold: bool) -> Option<usize> {
        if self.cp(pos) != Some('\'') {
            return None;
        }
        let low = |i| {
            self.cp(i)
                .map(|c: char| if fold { c.to_ascii_lowercase() } else { c })
        };
        match low(pos + 1)? {
            's' | 't' | 'm' | 'd' => Some(pos + 2),
            a => match (a, low(pos + 2)?) {
                ('r', 'e') | ('v', 'e') | ('l', 'l') => Some(pos + 3),
                _ => None,
            },
        }
    }

    /// End of the run of code points from `pos` that satisfy `f`.
    fn run(&self, mut pos: usize, f: impl Fn(Flags) -> bool) -> usize {
        while self.fl(pos).is_some_and(&f) {
            pos += 1;
        }
        pos
    }

    fn other(f: Flags) -> bool {
        !(f.whitespace || f.letter || f.number)
    }

    /// `\s+(?!\S)|\s+` from `pos` over `n_ws` white-space code points: all but the last
    /// when more follows (that one starts the next piece), else all.
    fn spaces(&self, pos: usize, n_ws: usize) -> usize {
        if n_ws > 1 && pos + n_ws < self.len() {
            pos + n_ws - 1
        } else {
            pos + n_ws
        }
    }

    fn gpt2(&self, ends: &mut Vec<usize>) {
        let mut pos = 0;
        while pos < self.len() {
            let end = self.gpt2_piece(pos);
            ends.push(end);
            pos = end;
        }
    }

    fn gpt2_piece(&self, pos: usize) -> usize {
        if let Some(end) = self.contraction(pos, false) {
            return end;
        }
        let space = self.cp(pos) == Some(' ');
        let start = pos + usize::from(space);
        if let Some(f) = self.fl(start) {
            //  ?\p{L}+ |  ?\p{N}+ |  ?[^\s\p{L}\p{N}]+
            if f.letter {
                return self.run(start, |f| f.letter);
            }
            if f.number {
                return self.run(start, |f| f.number);
            }
            if Self::other(f) {
                return self.run(start, Self::other);
            }
        }
        let n_ws = self.run(pos, |f| f.whitespace) - pos;
        if n_ws > 0 {
            return self.spaces(pos, n_ws);
        }
        pos + 1
    }

    /// Llama 3's pattern with numbers in runs of up to `digits` (Qwen2: 1).
    fn llama3(&self, ends: &mut Vec<usize>, digits: usize) {
        let mut pos = 0;
        while pos < self.len() {
            let end = self.llama3_piece(pos, digits, ends);
            ends.push(end);
            pos = end;
        }
    }

    /// The piece at `pos`; whole groups of `digits` digits before it go straight to `ends`.
    fn llama3_piece(&self, pos: usize, digits: usize, ends: &mut Vec<usize>) -> usize {
        if let Some(end) = self.contraction(pos, true) {
            return end;
        }
        let c = self.cps[pos];
        let f = flags(c);
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if !(c == '\r' || c == '\n' || f.number)
            && (f.letter || self.fl(pos + 1).is_some_and(|g| g.letter))
        {
            return self.run(pos + 1, |f| f.letter);
        }
        // \p{N}{1,digits}
        if f.number {
            let end = self.run(pos, |f| f.number);
            let mut at = pos + digits;
            while at < end {
                ends.push(at);
                at += digits;
            }
            return end;
        }
        //  ?[^\s\p{L}\p{N}]+[\r\n]*  (an optional space then other symbols; a space
        // at the end of the segment is a piece of its own here)
        let start = pos + usize::from(c == ' ');
        if self.fl(start).is_none_or(Self::other) {
            let mut end = self.run(start, Self::other);
            while matches!(self.cp(end), Some('\r' | '\n')) {
                end += 1;
            }
            return end;
        }
        // \s*[\r\n]+ : white space up to its last line break
        let ws_end = self.run(pos, |f| f.whitespace);
        if let Some(last) = (pos..ws_end)
            .rev()
            .find(|&i| matches!(self.cps[i], '\r' | '\n'))
        {
            return last + 1;
        }
        if ws_end > pos {
            return self.spaces(pos, ws_end - pos);
        }
        pos + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(name: &str, s: &str) -> Vec<String> {
        PreTokenizer::from_name(name)
            .unwrap()
            .split(s)
            .into_iter()
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn smollm_splits_digits_individually_and_words_gpt2_style() {
        assert_eq!(
            split("smollm", "Hello world's 123  x\n\n"),
            [
                "Hello", " world", "'s", " ", "1", "2", "3", " ", " x", "\n\n"
            ]
        );
    }

    #[test]
    fn gpt2_keeps_numbers_together() {
        assert_eq!(split("gpt2", "a 123!?"), ["a", " 123", "!?"]);
        assert_eq!(split("gpt2", "x   y"), ["x", "  ", " y"]);
    }

    #[test]
    fn llama3_groups_digits_by_three_and_keeps_newlines_apart() {
        assert_eq!(
            split("llama-bpe", "Hello World's 1234567 x\n\n  y"),
            [
                "Hello", " World", "'s", " ", "123", "456", "7", " x", "\n\n", " ", " y"
            ]
        );
        // A case-folded contraction, a letter run led by a symbol, symbols then newlines.
        assert_eq!(
            split("llama-bpe", "I'LL $x ...\r\n"),
            ["I", "'LL", " $", "x", " ...\r\n"]
        );
        assert_eq!(split("llama-bpe", "$x"), ["$x"]);
        assert_eq!(split("llama-bpe", "\tfn"), ["\tfn"]);
    }

    #[test]
    fn qwen2_splits_every_digit() {
        assert_eq!(split("qwen2", "v2024 ok"), ["v", "2", "0", "2", "4", " ok"]);
        assert_eq!(split("qwen2", "end "), ["end", " "]);
    }

    #[test]
    fn unknown_pre_tokenizer_is_a_clear_error() {
        let err = PreTokenizer::from_name("tekken").err().unwrap().to_string();
        assert!(err.contains("unsupported pre-tokenizer 'tekken'"), "{err}");
        assert!(err.contains("llama-bpe") && err.contains("qwen2"), "{err}");
    }

    #[test]
    fn pieces_cover_the_text_exactly() {
        for name in ["smollm", "gpt2", "llama-bpe", "qwen2"] {
            for s in [
                "",
                "   ",
                "日本語 テキスト",
                "a\tb \r\n 9½",
                "🙂🙂 x",
                "'",
                "a'",
                " \n",
            ] {
                assert_eq!(split(name, s).concat(), s, "{name} {s:?}");
                assert!(split(name, s).iter().all(|p| !p.is_empty()), "{name} {s:?}");
            }
        }
    }
}
