//! Incremental detokenization: tokens are byte strings and a multi-byte UTF-8 character
//! may be split across tokens, so bytes are held until they form complete characters.

#[derive(Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Append one token's bytes; returns the text that became complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // Incomplete character at the end: wait for the next token.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        // Truly invalid bytes can never complete: replace them, as a lossy
                        // decode of the whole sequence would.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// End of stream: whatever is still held is an incomplete character.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multibyte_char_split_across_pushes_is_emitted_once_complete() {
        let bytes = "a🙂é".as_bytes();
        let mut d = StreamDecoder::new();
        let mut outs = Vec::new();
        for b in bytes {
            outs.push(d.push(&[*b]));
        }
        assert_eq!(outs, vec!["a", "", "", "", "🙂", "", "é"]);
        assert_eq!(d.finish(), "");
    }

    #[test]
    fn invalid_bytes_become_replacement_chars_and_trailing_partial_is_flushed() {
        let mut d = StreamDecoder::new();
        assert_eq!(d.push(&[b'x', 0xFF, b'y']), "x\u{FFFD}y");
        assert_eq!(d.push(&[0xF0, 0x9F]), "");
        assert_eq!(d.finish(), "\u{FFFD}");
    }
}
