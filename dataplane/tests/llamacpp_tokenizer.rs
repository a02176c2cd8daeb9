//! Tandem's tokenizers against llama.cpp's own, on the real vocabularies of the models CI
//! serves: SmolLM2 (byte-level BPE, `smollm` pre-tokenizer), Qwen2.5 (byte-level BPE,
//! `qwen2`) and Gemma 3 (SentencePiece with byte fallback, 262,144 tokens). The reference
//! ids are llama.cpp's `llama_tokenize` of a corpus of hard strings, with and without BOS
//! and special-token parsing, written once by scripts/llamacpp_reference.py into
//! tests/fixtures/llamacpp/. Every case must agree exactly. Only the GGUF header is read
//! (the vocabulary), so this runs whatever tensor types the file holds.

mod common;

use serde_json::Value;
use tandem_dataplane::gguf::Gguf;
use tandem_dataplane::tokenizer::Tokenizer;

fn fixture(name: &str) -> Value {
    let p = common::repo_root().join(format!("dataplane/tests/fixtures/llamacpp/{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Every tokenization of the fixture, each difference listed.
fn check(name: &str) {
    let f = fixture(name);
    let g = Gguf::open(&common::model_file(f["model"].as_str().unwrap())).unwrap();
    let t = Tokenizer::from_gguf(&g).unwrap();
    assert_eq!(t.vocab_size() as u64, f["n_vocab"].as_u64().unwrap());
    let mut bad = Vec::new();
    let cases = f["tokenize"].as_array().unwrap();
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let (add, parse) = (
            c["add_special"].as_bool().unwrap(),
            c["parse_special"].as_bool().unwrap(),
        );
        let want = ids(&c["ids"]);
        let got = t.encode(text, add, parse);
        if got != want {
            bad.push(format!(
                "{text:?} (add_special {add}, parse_special {parse}):\n  llama.cpp {want:?}\n  tandem    {got:?}"
            ));
        }
    }
    // The generation prompts too (BOS and special tokens, as a completion prompt).
    for p in f["generate"].as_array().unwrap() {
        let text = p["prompt"].as_str().unwrap();
        let (want, got) = (ids(&p["ids"]), t.encode(text, true, true));
        if got != want {
            bad.push(format!(
                "prompt {text:?}:\n  llama.cpp {want:?}\n  tandem    {got:?}"
            ));
        }
    }
    eprintln!(
        "{name}: {} of {} tokenizations equal llama.cpp's",
        cases.len() + f["generate"].as_array().unwrap().len() - bad.len(),
        cases.len() + f["generate"].as_array().unwrap().len()
    );
    assert!(
        bad.is_empty(),
        "{name}: {} differ:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn smollm2_tokenizes_as_llama_cpp() {
    check("smollm2");
}

#[test]
fn qwen2_5_tokenizes_as_llama_cpp() {
    check("qwen2.5-coder-0.5b");
}

#[test]
fn gemma3_tokenizes_as_llama_cpp() {
    check("gemma-3-270m");
}
