//! Pre-tokenizers: split text into pieces before BPE so merges never cross word, number
//! or whitespace boundaries. The variant is chosen by the GGUF key `tokenizer.ggml.pre`.

use fancy_regex::Regex;

/// GPT-2's split pattern: common English contractions, optional-space + letters,
/// optional-space + numbers, optional-space + other symbols, whitespace not followed by
/// non-whitespace (so the last space attaches to the next word), remaining whitespace.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

pub struct PreTokenizer {
    regex: Regex,
    /// Every numeric character becomes its own piece before the regex runs (HF's
    /// `Digits(individual_digits=true)`), so numbers are tokenized digit by digit.
    split_digits: bool,
}

impl PreTokenizer {
    /// `smollm` (SmolLM/SmolLM2, also StarCoder-family vocabularies): individual digits,
    /// then the GPT-2 pattern. `gpt2`/`gpt-2`: the GPT-2 pattern alone.
    pub fn from_name(name: &str) -> crate::Result<Self> {
        let split_digits = match name {
            "smollm" | "starcoder" | "refact" => true,
            "gpt2" | "gpt-2" => false,
            other => {
                return Err(crate::Error::Tokenizer(format!(
                    "unsupported pre-tokenizer '{other}' (tokenizer.ggml.pre); supported: smollm, starcoder, refact, gpt2"
                )));
            }
        };
        let regex = Regex::new(GPT2_PATTERN)
            .map_err(|e| crate::Error::Tokenizer(format!("pre-tokenizer regex: {e}")))?;
        Ok(Self {
            regex,
            split_digits,
        })
    }

    pub fn split<'a>(&self, text: &'a str) -> Vec<&'a str> {
        let mut out = Vec::new();
        if self.split_digits {
            let mut start = 0;
            for (i, c) in text.char_indices() {
                if c.is_numeric() {
                    self.split_regex(&text[start..i], &mut out);
                    out.push(&text[i..i + c.len_utf8()]);
                    start = i + c.len_utf8();
                }
            }
            self.split_regex(&text[start..], &mut out);
        } else {
            self.split_regex(text, &mut out);
        }
        out
    }

    fn split_regex<'a>(&self, text: &'a str, out: &mut Vec<&'a str>) {
        let mut pos = 0;
        for m in self.regex.find_iter(text) {
            // The pattern covers every character class, so a match error (backtrack
            // limit) is the only way to get here; keep the rest as one piece, losing no
            // text.
            let Ok(m) = m else { break };
            pos = m.end();
            out.push(m.as_str());
        }
        if pos < text.len() {
            out.push(&text[pos..]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm_splits_digits_individually_and_words_gpt2_style() {
        let p = PreTokenizer::from_name("smollm").unwrap();
        assert_eq!(
            p.split("Hello world's 123  x\n\n"),
            vec![
                "Hello", " world", "'s", " ", "1", "2", "3", " ", " x", "\n\n"
            ]
        );
    }

    #[test]
    fn gpt2_keeps_numbers_together() {
        let p = PreTokenizer::from_name("gpt2").unwrap();
        assert_eq!(p.split("a 123!?"), vec!["a", " 123", "!?"]);
    }

    #[test]
    fn unknown_pre_tokenizer_is_a_clear_error() {
        let err = PreTokenizer::from_name("llama-bpe")
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("unsupported pre-tokenizer 'llama-bpe'"),
            "{err}"
        );
    }

    #[test]
    fn pieces_cover_the_text_exactly() {
        let p = PreTokenizer::from_name("smollm").unwrap();
        for s in ["", "   ", "日本語 テキスト", "a\tb \r\n 9½", "🙂🙂 x"] {
            assert_eq!(p.split(s).concat(), s);
        }
    }
}
