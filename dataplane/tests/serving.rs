//! End-to-end: the real `tandem-dataplane` binary serving SmolLM2 over real HTTP.

mod common;

use std::io::BufReader;
use std::time::Duration;

use common::http_client::{read_chunk, read_head, send};
use common::{MODEL_NAME, Server, chat_with_system};
use serde_json::{Value, json};

fn chat(content: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
}

#[test]
fn chat_completion_json_and_sse_and_bad_requests() {
    let s = Server::start(&[]);
    let r = s.post(
        "/v1/chat/completions",
        &chat("What is the capital of France?", 12, false),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], MODEL_NAME);
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(!text.is_empty());
    let usage = &v["usage"];
    assert!(
        usage["prompt_tokens"].as_u64().unwrap() > 20,
        "system prompt + question: {usage}"
    );
    let n = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..=12).contains(&n));
    assert_eq!(
        v["choices"][0]["finish_reason"],
        if n == 12 { "length" } else { "stop" }
    );

    // The same greedy request streamed yields the same text.
    let r = s.post(
        "/v1/chat/completions",
        &chat("What is the capital of France?", 12, true),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, text);
    let last = chunks.last().unwrap();
    assert_eq!(
        last["choices"][0]["finish_reason"],
        v["choices"][0]["finish_reason"]
    );
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(last["usage"][k], v["usage"][k], "{k}");
    }
    // The second request of the same prompt reused the first's whole KV blocks.
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(last["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0));

    // Bad requests: 400 with an OpenAI error body; unknown path 404.
    let bad = [
        json!({"model": MODEL_NAME, "messages": []}),
        json!({"model": MODEL_NAME}),
        json!({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}),
        json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
        json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "temperature": "warm"}),
        json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": "word ".repeat(9000)}]}),
    ];
    for b in bad {
        let r = s.post("/v1/chat/completions", &b);
        assert_eq!(r.status, 400, "{b}: {}", r.body);
        let e = &r.json()["error"];
        assert!(
            e["message"].is_string() && e["type"] == "invalid_request_error",
            "{e}"
        );
    }
    let r = common::request(s.addr, "POST", "/v1/chat/completions", Some("{\"model\":"));
    assert_eq!(r.status, 400);
    assert_eq!(s.get("/v1/nothing").status, 404);
    assert_eq!(s.get("/v1/models").json()["data"][0]["id"], MODEL_NAME);
    assert_eq!(s.get("/health").status, 200);
}

/// Greedy completion tokens (as token strings) of one prompt, with the fields of `extra`.
fn greedy_tokens(s: &Server, prompt: &str, extra: &Value) -> Vec<String> {
    let mut body = json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let r = s.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let toks: Vec<String> = v["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_owned())
        .collect();
    assert!(!toks.is_empty());
    toks
}

#[test]
fn concurrent_greedy_requests_equal_sequential_runs() {
    concurrent_equals_sequential(&[], &json!({}));
}

/// With the penalties and min_tokens on: each sequence's sampler adjusts its own logits
/// from its own history, so its output still does not depend on the batch.
#[test]
fn concurrent_greedy_requests_with_penalties_equal_sequential_runs() {
    let penalties = json!({"repetition_penalty": 1.3, "frequency_penalty": 0.7,
                           "presence_penalty": 0.4, "min_tokens": 4});
    let (s, penalized) = concurrent_equals_sequential(&[], &penalties);
    // They took effect: some prompts answer differently without them.
    let changed = PROMPTS
        .iter()
        .zip(&penalized)
        .filter(|(p, pen)| &greedy_tokens(&s, p, &json!({})) != *pen)
        .count();
    assert!(changed >= 2, "penalties changed {changed} of 8 answers");
}

/// The same with the Q8_0 KV cache (`--kv-dtype q8_0`): its attention path must not depend
/// on the batch either.
#[test]
fn concurrent_greedy_requests_equal_sequential_runs_with_q8_0_kv_cache() {
    let (s, _) = concurrent_equals_sequential(&["--kv-dtype", "q8_0"], &json!({}));
    assert!(
        !s.log_lines(&["model loaded", "Q8_0"]).is_empty(),
        "the startup log names the KV dtype:\n{}",
        s.log_text()
    );
}

const PROMPTS: [&str; 8] = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
    "1, 2, 3, 4,",
    "Water boils at a temperature of",
    "My favourite fruit is",
    "The quick brown fox",
];

/// The server and the sequential answers of `PROMPTS` with the request fields `fields`.
fn concurrent_equals_sequential(extra: &[&str], fields: &Value) -> (Server, Vec<Vec<String>>) {
    // Chunk size above every prompt here: prompts are prefilled whole, so this compares
    // batching alone (chunked interleaving is covered by the scheduler's unit tests).
    let mut args = vec!["--max-batch", "8", "--chunk-size", "256"];
    args.extend_from_slice(extra);
    let s = Server::start(&args);
    let prompts = PROMPTS;
    let sequential: Vec<Vec<String>> = prompts
        .iter()
        .map(|p| greedy_tokens(&s, p, fields))
        .collect();
    let steps = |s: &Server| {
        (
            s.metric("tandem_engine_steps_total "),
            s.metric("tandem_engine_step_sequences_total "),
        )
    };
    let (steps0, seqs0) = steps(&s);
    let concurrent: Vec<Vec<String>> = std::thread::scope(|sc| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| sc.spawn(|| greedy_tokens(&s, p, fields)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, b)) in sequential.iter().zip(&concurrent).enumerate() {
        assert_eq!(a, b, "prompt {:?}", prompts[i]);
    }
    // The requests ran together: their steps carried more than one sequence on average
    // (one after another, every step would carry exactly one).
    let (steps1, seqs1) = steps(&s);
    let (n_steps, n_seqs) = (steps1 - steps0, seqs1 - seqs0);
    assert!(n_steps > 0.0, "no engine step counted");
    assert!(
        n_seqs / n_steps >= 1.5,
        "the concurrent requests shared few steps: {n_seqs} sequences in {n_steps} steps"
    );
    let distinct: std::collections::HashSet<_> = sequential.iter().collect();
    assert!(
        distinct.len() > 4,
        "different prompts should give different outputs"
    );
    (s, sequential)
}

/// Requests sharing a ~230-token system prompt: after the first, each reports the prefix
/// as cached (`usage.prompt_tokens_details.cached_tokens`) and answers exactly as a
/// server without the prefix cache does: the same text and the same logprobs.
#[test]
fn a_shared_system_prompt_is_served_from_the_prefix_cache_with_identical_outputs() {
    let system = "You are a meticulous assistant for a library. ".repeat(25);
    let questions = [
        "Which shelf holds the atlases?",
        "When does the reading room open?",
        "Which shelf holds the atlases?",
    ];
    let cached = Server::start(&[]);
    let plain = Server::start(&["--no-prefix-cache"]);
    let mut hits = Vec::new();
    for q in questions {
        let (text, lps, prompt, hit) = chat_with_system(&cached, &system, q, 3);
        let (text0, lps0, prompt0, hit0) = chat_with_system(&plain, &system, q, 3);
        assert_eq!((&text, &lps, prompt), (&text0, &lps0, prompt0), "{q}");
        assert_eq!(hit0, 0, "--no-prefix-cache reuses nothing");
        assert!(prompt > 200 && !text.is_empty(), "{prompt} {text:?}");
        hits.push((hit, prompt));
    }
    assert_eq!(hits[0].0, 0, "the first request finds nothing");
    // Whole 16-token blocks of the system prompt (and the question, when it repeats).
    assert!(hits[1].0 >= 192 && hits[1].0 % 16 == 0, "{hits:?}");
    assert!(hits[2].0 > hits[1].0 && hits[2].0 < hits[2].1, "{hits:?}");
    let hit_tokens = cached.metric("tandem_prefix_cache_hit_tokens_total ");
    assert_eq!(hit_tokens, (hits[1].0 + hits[2].0) as f64);
    let looked_up = cached.metric("tandem_prefix_cache_lookup_tokens_total ");
    assert_eq!(looked_up, hits.iter().map(|h| h.1).sum::<u64>() as f64);
    assert!(cached.metric("tandem_prefix_cache_blocks ") >= 16.0);
    assert_eq!(cached.metric("tandem_prefix_cache_evictions_total "), 0.0);
    // Idle cached blocks are free once the sequences are retired (just after their last
    // token is sent, hence a wait).
    cached.wait_for("idle cached blocks free", Duration::from_secs(10), |s| {
        s.metric("tandem_kv_blocks_used ") == 0.0
    });
    assert_eq!(
        plain.metric("tandem_prefix_cache_lookup_tokens_total "),
        0.0
    );
    assert_eq!(plain.metric("tandem_prefix_cache_blocks "), 0.0);
}

#[test]
fn client_disconnect_mid_stream_frees_kv_blocks() {
    let s = Server::start(&[]);
    let body = chat("Write a long story about a dragon.", 400, true).to_string();
    let mut r = BufReader::new(send(s.addr, "POST", "/v1/chat/completions", Some(&body)));
    let (status, _) = read_head(&mut r);
    assert_eq!(status, 200);
    // Read a few chunks: generation is under way and holds KV blocks.
    for _ in 0..3 {
        assert!(read_chunk(&mut r).is_some());
    }
    assert!(s.metric("tandem_kv_blocks_used ") > 0.0);
    assert_eq!(s.metric("tandem_requests_running "), 1.0);
    drop(r);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while s.metric("tandem_kv_blocks_used ") > 0.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "blocks not freed after disconnect"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        s.metric("tandem_request_failures_total{reason=\"client_disconnected\"} "),
        1.0
    );
    assert_eq!(s.metric("tandem_requests_running "), 0.0);
    // Far fewer than 400 tokens were generated.
    assert!(s.metric("tandem_generation_tokens_total ") < 200.0);
}

#[test]
fn sigterm_finishes_in_flight_stream_and_exits_zero() {
    let mut s = Server::start(&["--drain-seconds", "60"]);
    let body = chat("Tell me about the moon.", 24, true).to_string();
    let mut r = BufReader::new(send(s.addr, "POST", "/v1/chat/completions", Some(&body)));
    let (status, _) = read_head(&mut r);
    assert_eq!(status, 200);
    assert!(read_chunk(&mut r).is_some());
    s.sigterm();
    // The in-flight stream runs to its end.
    let mut rest = Vec::new();
    while let Some(c) = read_chunk(&mut r) {
        rest.extend(c);
    }
    let rest = String::from_utf8(rest).unwrap();
    assert!(rest.ends_with("data: [DONE]\n\n"), "{rest}");
    assert!(
        rest.contains("\"finish_reason\":\"length\"")
            || rest.contains("\"finish_reason\":\"stop\""),
        "{rest}"
    );
    let st = s.wait_exit(Duration::from_secs(30));
    assert!(st.success(), "exit status {st}; log:\n{}", s.log_text());
    // New connections are refused once it is gone.
    assert!(std::net::TcpStream::connect(s.addr).is_err());
    assert!(s.log_text().contains("SIGTERM"));
}

#[test]
fn openai_python_client_works_unchanged() {
    let s = Server::start(&[]);
    let py = std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| {
        let venv = common::repo_root().join(".venv/bin/python");
        if venv.is_file() {
            venv.display().to_string()
        } else {
            "python3".into()
        }
    });
    let out = std::process::Command::new(py)
        .arg(common::repo_root().join("scripts/openai_client_check.py"))
        .arg(format!("http://{}/v1", s.addr))
        .arg(MODEL_NAME)
        .output()
        .expect("run python (set TANDEM_PYTHON or run `make pyenv`)");
    assert!(
        out.status.success(),
        "openai client check failed (run `make pyenv` if the package is missing):\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("openai client: all checks passed"));
}

#[test]
fn pd_roles_without_a_group_key_are_refused_clearly() {
    for role in ["prefill", "decode"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem-dataplane"))
            .args([
                "--role",
                role,
                "--port",
                "0",
                "--prefill",
                "127.0.0.1:1",
                "--model",
            ])
            .arg(common::model_path())
            .env_remove("TANDEM_GROUP_KEY")
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!("role '{role}' needs a group key")),
            "{err}"
        );
    }
}

#[test]
fn a_cuda_device_without_cuda_is_refused_clearly() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem-dataplane"))
        .args(["--device", "cuda:0", "--port", "0", "--model"])
        .arg(common::model_path())
        .output()
        .unwrap();
    assert!(!out.status.success(), "started without a GPU");
    let err = String::from_utf8_lossy(&out.stderr);
    // Without the `cuda` feature the binary says so; with it, the driver probe does.
    assert!(
        err.contains("without CUDA support") || err.contains("no CUDA driver"),
        "unclear error: {err}"
    );
}
