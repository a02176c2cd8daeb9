use super::*;
use crate::test_support::{model_path, python, repo_root};
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// A tiny byte-level vocabulary: the 256 byte tokens, a few merges and two control tokens.
fn toy() -> Tokenizer {
    let bm = ByteMap::new();
    let mut tokens: Vec<String> = (0..=255u8).map(|b| bm.char_of(b).to_string()).collect();
    let mut merges = Vec::new();
    for (l, r) in [
        ("h", "e"),
        ("l", "l"),
        ("he", "ll"),
        ("hell", "o"),
        ("Ġ", "w"),
    ] {
        merges.push(format!("{l} {r}"));
        tokens.push(format!("{l}{r}"));
    }
    tokens.push("<|s|>".into());
    tokens.push("<|e|>".into());
    let mut types = vec![token_type::NORMAL; tokens.len()];
    let n = types.len();
    types[n - 2] = token_type::CONTROL;
    types[n - 1] = token_type::CONTROL;
    Tokenizer::new(TokenizerSpec {
        model: "gpt2".into(),
        pre: "smollm".into(),
        tokens,
        token_types: types,
        merges,
        bos_id: Some(n as u32 - 2),
        eos_id: Some(n as u32 - 1),
        add_bos: Some(true),
        ..Default::default()
    })
    .unwrap()
}

#[test]
fn toy_merges_apply_by_rank_and_specials_are_parsed() {
    let t = toy();
    let hello = 256 + 3;
    let s = t.bos_id().unwrap();
    // "hello" merges fully; " w" merges; "<|s|>" is one id only with parse_special.
    assert_eq!(t.encode("hello", false, true), vec![hello]);
    assert_eq!(t.encode("hello", true, true), vec![s, hello]);
    assert_eq!(
        t.encode("<|s|>hello w", false, true),
        vec![s, hello, 256 + 4]
    );
    let literal = t.encode("<|s|>", false, false);
    assert_eq!(literal.len(), 5);
    assert_eq!(t.decode(&literal, true), "<|s|>");
    assert_eq!(t.decode(&[s, hello], true), "hello");
    assert_eq!(t.decode(&[s, hello], false), "<|s|>hello");
    assert_eq!(t.end_of_generation(), &[t.eos_id().unwrap()]);
}

#[test]
fn unsupported_model_and_bad_merges_are_clear_errors() {
    let spec = TokenizerSpec {
        model: "bert".into(),
        pre: "smollm".into(),
        ..Default::default()
    };
    let e = Tokenizer::new(spec).err().unwrap().to_string();
    assert!(e.contains("unsupported tokenizer model 'bert'"), "{e}");
    assert!(e.contains("gpt2") && e.contains("llama"), "{e}");
    // SentencePiece needs its byte tokens for byte fallback.
    let spec = TokenizerSpec {
        model: "llama".into(),
        tokens: vec!["<unk>".into(), "a".into()],
        ..Default::default()
    };
    let e = Tokenizer::new(spec).err().unwrap().to_string();
    assert!(e.contains("<0xXX>"), "{e}");
    let bm = ByteMap::new();
    let spec = TokenizerSpec {
        model: "gpt2".into(),
        pre: "smollm".into(),
        tokens: (0..=255u8).map(|b| bm.char_of(b).to_string()).collect(),
        merges: vec!["a b".into()],
        ..Default::default()
    };
    let e = Tokenizer::new(spec).err().unwrap().to_string();
    assert!(e.contains("names 'ab', not in the vocabulary"), "{e}");
}

/// A varied corpus: unicode, emoji (multi-codepoint), whitespace runs, code, CJK, digits.
const CORPUS: &[&str] = &[
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is π.",
    "  leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\n\n\nand    runs",
    "fn main() {\n    println!(\"{}\", x + 1);\n}\n",
    "def f(x):\n\treturn x**2  # comment",
    "日本語のテキストと中文文本，还有한국어.",
    "Emoji: 🙂👍🏽👨‍👩‍👧‍👦 and flags 🇫🇷!",
    "Ünïcödé àccents ñ ß œ ﬁ",
    "I'm sure they've said it's John's and we'll see, they'd",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "mixed<|im_end|>specials<|endoftext|>inline",
    "URL: https://example.com/a?b=c&d=e#f",
    "",
    " ",
    "١٢٣ Arabic digits and ½ fractions",
];

struct Reference {
    tok: Tokenizer,
    ids: Vec<Vec<u32>>,
    decoded: Vec<String>,
}

/// Runs scripts/tokenizer_reference.py once: it reads the GGUF with the `gguf` package and
/// tokenizes CORPUS with HuggingFace `tokenizers`; our tokenizer is built from the same
/// metadata it returns.
fn reference() -> &'static Reference {
    static R: OnceLock<Reference> = OnceLock::new();
    R.get_or_init(|| {
        let model = model_path();
        let script = repo_root().join("scripts/tokenizer_reference.py");
        let mut child = Command::new(python())
            .arg(&script)
            .arg(&model)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn python (set TANDEM_PYTHON or run `make pyenv`)");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(serde_json::to_string(CORPUS).unwrap().as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "reference script failed (run `make pyenv`): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let spec = &v["spec"];
        let strings = |k: &str| -> Vec<String> {
            spec[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_owned())
                .collect()
        };
        let spec = TokenizerSpec {
            model: spec["model"].as_str().unwrap().into(),
            pre: spec["pre"].as_str().unwrap().into(),
            tokens: strings("tokens"),
            merges: strings("merges"),
            token_types: spec["token_types"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_i64().unwrap() as i32)
                .collect(),
            bos_id: spec["bos_id"].as_u64().map(|x| x as u32),
            eos_id: spec["eos_id"].as_u64().map(|x| x as u32),
            add_bos: spec["add_bos"].as_bool(),
            ..Default::default()
        };
        Reference {
            tok: Tokenizer::new(spec).unwrap(),
            ids: serde_json::from_value(v["ids"].clone()).unwrap(),
            decoded: serde_json::from_value(v["decoded"].clone()).unwrap(),
        }
    })
}

#[test]
fn real_vocab_matches_reference_tokenization() {
    let r = reference();
    for (i, text) in CORPUS.iter().enumerate() {
        assert_eq!(r.tok.encode(text, false, true), r.ids[i], "text {text:?}");
        assert_eq!(
            r.tok.decode(&r.ids[i], false),
            r.decoded[i],
            "text {text:?}"
        );
    }
}

#[test]
fn real_vocab_round_trips_and_streams() {
    let t = &reference().tok;
    for text in CORPUS {
        let ids = t.encode(text, false, true);
        assert_eq!(t.decode(&ids, false), *text);
        // Streaming, token by token, yields the same text even when a character's bytes
        // are split across tokens (emoji and CJK in the corpus are).
        let mut d = StreamDecoder::new();
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&d.push(&t.pieces[id as usize]));
        }
        streamed.push_str(&d.finish());
        assert_eq!(streamed, *text);
    }
    // Without special parsing the markers are plain text, yet still round-trip.
    let s = "<|im_start|>x";
    let ids = t.encode(s, false, false);
    assert!(ids.len() > 2 && !ids.iter().any(|&i| t.is_special(i)));
    assert_eq!(t.decode(&ids, false), s);
}

#[test]
fn real_vocab_emoji_spans_several_tokens() {
    let t = &reference().tok;
    let ids = t.encode("👨‍👩‍👧‍👦", false, true);
    assert!(ids.len() > 1, "expected a byte-split emoji, got {ids:?}");
    assert!(std::str::from_utf8(&t.pieces[ids[0] as usize]).is_err());
    // SmolLM2: EOS is <|im_end|>, <|endoftext|> also ends generation.
    let eog: Vec<String> = t
        .end_of_generation()
        .iter()
        .map(|&i| t.token_text(i).unwrap())
        .collect();
    assert!(eog.contains(&"<|im_end|>".to_string()) && eog.contains(&"<|endoftext|>".to_string()));
}

#[test]
fn from_gguf_reads_the_same_tokenizer_as_the_reference_metadata() {
    let g = crate::gguf::Gguf::open(&model_path()).unwrap();
    let t = Tokenizer::from_gguf(&g).unwrap();
    let r = reference();
    for (i, text) in CORPUS.iter().enumerate() {
        assert_eq!(t.encode(text, false, true), r.ids[i], "text {text:?}");
    }
    assert_eq!(
        (t.bos_id(), t.eos_id(), t.add_bos),
        (Some(1), Some(2), false)
    );
    let tmpl = chat_template(&g)
        .unwrap()
        .expect("SmolLM2 ships a chat template");
    let chat = crate::chat::ChatTemplate::new(&tmpl, "<|im_start|>", "<|im_end|>").unwrap();
    let msg = crate::chat::ChatMessage::text("user", "Hi");
    let text = chat.render(&[msg], true).unwrap();
    assert!(
        text.starts_with("<|im_start|>system\n")
            && text.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        "{text:?}"
    );
    let ids = t.encode(&text, false, true);
    assert_eq!(
        ids.iter().filter(|&&i| i == 1).count(),
        3,
        "three <|im_start|> markers"
    );
}
