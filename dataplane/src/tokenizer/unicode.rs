//! Unicode general categories of code points, as the pre-tokenizers' patterns use them
//! (`\p{L}`, `\p{N}`, `\s`). The category tables are regex-syntax's (the Unicode data the
//! `regex` crate matches with), read once into sorted ranges.

use std::sync::OnceLock;

use regex_syntax::hir::{Class, HirKind};

/// What the splitters ask of a code point.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Flags {
    /// `\p{L}`.
    pub letter: bool,
    /// `\p{N}` (Nd, Nl, No).
    pub number: bool,
    /// `\s`: Unicode White_Space.
    pub whitespace: bool,
}

struct Tables {
    letter: Vec<(u32, u32)>,
    number: Vec<(u32, u32)>,
}

/// The ranges of `\p{name}`.
fn ranges(name: &str) -> Vec<(u32, u32)> {
    let hir = regex_syntax::ParserBuilder::new()
        .build()
        .parse(&format!(r"\p{{{name}}}"))
        .expect("a general category regex-syntax knows");
    match hir.kind() {
        HirKind::Class(Class::Unicode(c)) => c
            .ranges()
            .iter()
            .map(|r| (r.start() as u32, r.end() as u32))
            .collect(),
        other => unreachable!("\\p{{{name}}} parsed as {other:?}"),
    }
}

fn tables() -> &'static Tables {
    static T: OnceLock<Tables> = OnceLock::new();
    T.get_or_init(|| Tables {
        letter: ranges("L"),
        number: ranges("N"),
    })
}

fn contains(ranges: &[(u32, u32)], c: u32) -> bool {
    ranges
        .binary_search_by(|&(lo, hi)| {
            if hi < c {
                std::cmp::Ordering::Less
            } else if lo > c {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        })
        .is_ok()
}

pub fn flags(c: char) -> Flags {
    if c.is_ascii() {
        return Flags {
            letter: c.is_ascii_alphabetic(),
            number: c.is_ascii_digit(),
            whitespace: c.is_ascii_whitespace() || c == '\x0b',
        };
    }
    let t = tables();
    Flags {
        letter: contains(&t.letter, c as u32),
        number: contains(&t.number, c as u32),
        whitespace: c.is_whitespace(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn categories_are_unicodes() {
        for c in ['a', 'Z', 'é', 'ß', '日', 'ق', 'ᄀ', 'ǅ', 'ʰ'] {
            assert!(flags(c).letter, "{c:?} is a letter");
        }
        // Marks and number letters are not letters (\p{L}), unlike `char::is_alphabetic`.
        for c in ['\u{301}', 'Ⅻ', '1', '½', '٣', '🙂', '_', ' '] {
            assert!(!flags(c).letter, "{c:?} is no letter");
        }
        for c in ['7', '٣', '½', 'Ⅻ', '²', '𝟘'] {
            assert!(flags(c).number, "{c:?} is a number");
        }
        for c in [
            ' ', '\t', '\n', '\r', '\x0b', '\x0c', '\u{a0}', '\u{3000}', '\u{2028}',
        ] {
            assert!(flags(c).whitespace, "{c:?} is white space");
        }
        assert!(
            !flags('\u{200b}').whitespace,
            "ZERO WIDTH SPACE is not White_Space"
        );
    }
}
