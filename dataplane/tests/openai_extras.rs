//! The OpenAI/vLLM extras (`ignore_eos`, `min_tokens`, `stop_token_ids`, the repetition,
//! frequency and presence penalties) and the refusal of fields Tandem does not implement,
//! on the real model over real HTTP: colocated (`--role both`), and through real prefill
//! and decode processes, where the prefill samples the first token with the parameters
//! that crossed the KV protocol.

mod common;

use std::time::Duration;

use common::{MODEL_NAME, Server, free_port, pd_env, start_decode, start_prefill};
use serde_json::{Value, json};
use tandem_dataplane::gguf::Gguf;
use tandem_dataplane::tokenizer::Tokenizer;

/// Greedy SmolLM2 answers "No." and ends the turn (3 tokens with the end-of-turn token).
const SKY: &str = "Is the sky blue? Answer yes or no.";
/// Greedy SmolLM2 repeats itself here ("a rare and precious gem, a rare and ...").
const COLOUR: &str = "Name a colour.";
/// A completion prompt whose greedy first token (" dog") is in the prompt.
const CAT: &str = "The cat and the dog. The cat and the";

fn tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(&Gguf::open(&common::model_path()).unwrap()).unwrap()
}

/// The id of a token from its text (as `logprobs.tokens` shows it).
fn token_id(tok: &Tokenizer, piece: &str) -> u32 {
    let ids = tok.encode(piece, false, false);
    assert_eq!(ids.len(), 1, "{piece:?} is not one token: {ids:?}");
    assert_eq!(tok.decode(&ids, false), piece);
    ids[0]
}

fn with(base: Value, extra: &Value) -> Value {
    let mut b = base;
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn chat(s: &Server, content: &str, extra: Value) -> Value {
    let body = json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": content}],
                      "temperature": 0});
    let r = s.post("/v1/chat/completions", &with(body, &extra));
    assert_eq!(r.status, 200, "{extra}: {}", r.body);
    r.json()
}

fn complete(s: &Server, prompt: &str, extra: Value) -> Value {
    let body = json!({"model": MODEL_NAME, "prompt": prompt, "temperature": 0});
    let r = s.post("/v1/completions", &with(body, &extra));
    assert_eq!(r.status, 200, "{extra}: {}", r.body);
    r.json()
}

/// (text, finish_reason, completion_tokens) of a chat or completion answer.
fn answer(v: &Value) -> (String, String, u64) {
    let c = &v["choices"][0];
    let text = c["message"]["content"].as_str().or(c["text"].as_str());
    (
        text.unwrap().to_owned(),
        c["finish_reason"].as_str().unwrap().to_owned(),
        v["usage"]["completion_tokens"].as_u64().unwrap(),
    )
}

fn tokens(v: &Value) -> Vec<String> {
    v["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs tokens in {v}"))
        .iter()
        .map(|t| t.as_str().unwrap().to_owned())
        .collect()
}

/// Every extra on one server (colocated or a PD decode), each against the same greedy
/// request without it.
fn check_extras(s: &Server, tok: &Tokenizer) {
    // ignore_eos: the request that ends its turn after 3 tokens runs to max_tokens.
    let (base, fin, n) = answer(&chat(s, SKY, json!({"max_tokens": 20})));
    assert_eq!((fin.as_str(), n), ("stop", 3), "{base:?}");
    let (text, fin, n) = answer(&chat(s, SKY, json!({"max_tokens": 20, "ignore_eos": true})));
    assert_eq!((fin.as_str(), n), ("length", 20), "{text:?}");
    assert!(
        text.starts_with(&base) && text.len() > base.len(),
        "{text:?}"
    );

    // min_tokens: the end of turn cannot come before the 7th token; the start is the same.
    let (text, _, n) = answer(&chat(s, SKY, json!({"max_tokens": 20, "min_tokens": 6})));
    assert!(n >= 7, "{n} tokens: {text:?}");
    assert!(
        text.starts_with(&base) && text.len() > base.len(),
        "{text:?}"
    );
    // ... nor a stop string: "." ends "No." at once, but not before min_tokens.
    let (text, fin, _) = answer(&chat(s, SKY, json!({"max_tokens": 20, "stop": ["."]})));
    assert_eq!((text.as_str(), fin.as_str()), ("No", "stop"));
    let (text, fin, _) = answer(&chat(
        s,
        SKY,
        json!({"max_tokens": 20, "stop": ["."], "min_tokens": 6}),
    ));
    assert_eq!(fin, "stop");
    assert!(text.starts_with("No.") && text.len() > 6, "{text:?}");

    // stop_token_ids: stop on the id greedy generates at step k; the text is the first k
    // tokens' (the stop token is not part of it), streamed the same.
    let greedy = complete(s, CAT, json!({"max_tokens": 8, "logprobs": 0}));
    let t = tokens(&greedy);
    assert_eq!(t.len(), 8);
    let k = (2..t.len())
        .find(|&k| !t[..k].contains(&t[k]))
        .expect("a token not seen before");
    let id = token_id(tok, &t[k]);
    let (text, fin, n) = answer(&complete(
        s,
        CAT,
        json!({"max_tokens": 8, "stop_token_ids": [id]}),
    ));
    assert_eq!(
        (text.as_str(), fin.as_str(), n),
        (t[..k].concat().as_str(), "stop", k as u64 + 1)
    );
    let r = s.post(
        "/v1/completions",
        &json!({"model": MODEL_NAME, "prompt": CAT, "temperature": 0, "max_tokens": 8,
                "stop_token_ids": [id], "stream": true}),
    );
    let data = r.sse_data();
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, t[..k].concat());
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
    // The first token as a stop token ends at once; min_tokens 1 masks it there (on a PD
    // decode, the prefill samples that token: the masking crossed the KV protocol).
    let first = token_id(tok, &t[0]);
    let (text, fin, n) = answer(&complete(
        s,
        CAT,
        json!({"max_tokens": 8, "stop_token_ids": [first]}),
    ));
    assert_eq!((text.as_str(), fin.as_str(), n), ("", "stop", 1));
    let masked = complete(
        s,
        CAT,
        json!({"max_tokens": 8, "stop_token_ids": [first], "min_tokens": 1, "logprobs": 0}),
    );
    let mt = tokens(&masked);
    assert!(!mt.is_empty() && mt[0] != t[0], "{mt:?}");

    // Penalties change greedy output; their default values change nothing, bit for bit
    // (logprobs included).
    let with_lp = json!({"max_tokens": 8, "logprobs": 2});
    let plain = complete(s, CAT, with_lp.clone());
    let defaults = complete(
        s,
        CAT,
        with(
            with_lp,
            &json!({"repetition_penalty": 1.0, "frequency_penalty": 0, "presence_penalty": 0.0,
                    "min_tokens": 0, "ignore_eos": false, "stop_token_ids": []}),
        ),
    );
    assert_eq!(plain["choices"], defaults["choices"]);
    // The repetition penalty counts the prompt: " dog" is in it, so the first token moves.
    let rep = complete(
        s,
        CAT,
        json!({"max_tokens": 8, "logprobs": 0, "repetition_penalty": 2.0}),
    );
    assert_ne!(tokens(&rep)[0], t[0]);
    let (base, _, _) = answer(&chat(s, COLOUR, json!({"max_tokens": 24})));
    for p in [
        json!({"repetition_penalty": 1.2}),
        json!({"frequency_penalty": 1.0}),
        json!({"presence_penalty": 1.0}),
    ] {
        let (text, _, _) = answer(&chat(s, COLOUR, with(json!({"max_tokens": 24}), &p)));
        assert_ne!(text, base, "{p}");
    }

    // Refusals name their field; values that ask for nothing are accepted.
    let vocab = tok.vocab_size();
    for (field, value) in [
        ("ignore_eos", json!("yes")),
        ("min_tokens", json!(-1)),
        ("min_tokens", json!(30)),
        ("stop_token_ids", json!([vocab])),
        ("stop_token_ids", json!([-1])),
        ("stop_token_ids", json!(5)),
        ("repetition_penalty", json!(0)),
        ("frequency_penalty", json!(2.5)),
        ("presence_penalty", json!(-3)),
        ("logit_bias", json!({"11": 5})),
        ("best_of", json!(2)),
        ("response_format", json!({"type": "json_object"})),
        (
            "tools",
            json!([{"type": "function", "function": {"name": "f"}}]),
        ),
        ("guided_json", json!({"type": "object"})),
        ("use_beam_search", json!(true)),
        ("max_tokenz", json!(3)),
    ] {
        let body = json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": SKY}],
                          "max_tokens": 20, field: value});
        let r = s.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        let e = &r.json()["error"];
        assert_eq!(e["param"], field, "{body}: {e}");
        assert_eq!(e["type"], "invalid_request_error");
    }
    for (field, value) in [("suffix", json!("tail")), ("echo", json!(true))] {
        let body = json!({"model": MODEL_NAME, "prompt": CAT, field: value});
        let r = s.post("/v1/completions", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], field);
    }
    let neutral = json!({"max_tokens": 20, "best_of": 1, "echo": false, "logit_bias": {},
                         "tools": [], "user": "u-1", "metadata": {"run": "x"}, "store": false});
    assert_eq!(answer(&chat(s, SKY, neutral)).0, "No.");
}

#[test]
fn extras_on_the_colocated_server() {
    let s = Server::start(&[]);
    check_extras(&s, &tokenizer());
    // Every request ended and freed its blocks (the engine retires a sequence just after
    // its last token is sent, hence a wait rather than a single sample).
    s.wait_for(
        "requests retired and blocks freed",
        Duration::from_secs(10),
        |s| {
            s.metric("tandem_requests_running ") == 0.0 && s.metric("tandem_kv_blocks_used ") == 0.0
        },
    );
}

#[test]
fn extras_through_prefill_and_decode_equal_colocated() {
    let env = pd_env(&[]);
    let kv = free_port();
    let prefill = start_prefill(kv, &env);
    let decode = start_decode(&[kv], &env, true);
    let both = Server::start(&[]);
    let tok = tokenizer();
    check_extras(&decode, &tok);
    // Token for token what the colocated server answers, logprobs included, for requests
    // whose first token (sampled by the prefill) depends on the new parameters.
    let dog = token_id(&tok, " dog");
    for extra in [
        json!({"repetition_penalty": 2.0}),
        json!({"repetition_penalty": 0.7, "frequency_penalty": 0.8, "presence_penalty": -0.5}),
        json!({"stop_token_ids": [dog], "min_tokens": 3}),
        json!({"ignore_eos": true, "min_tokens": 4, "stop": ["."]}),
    ] {
        let body = with(json!({"max_tokens": 12, "logprobs": 0}), &extra);
        let (pd, co) = (
            complete(&decode, CAT, body.clone()),
            complete(&both, CAT, body),
        );
        assert_eq!(answer(&pd), answer(&co), "{extra}");
        assert_eq!(tokens(&pd), tokens(&co), "{extra}");
    }
    // Every generation went through a room (the refusals opened none).
    assert_eq!(decode.metric("tandem_prompt_tokens_total "), 0.0);
    let rooms = decode.metric("tandem_kv_rooms_total{state=\"done\",reason=\"none\"} ");
    assert_eq!(
        rooms,
        prefill.metric("tandem_kv_rooms_total{state=\"done\",reason=\"none\"} ")
    );
    assert!(rooms >= 20.0, "{rooms} rooms");
}
