//! A PD pair whose decode runs on the CUDA backend (feature `gpu-tests`: `tests/gpu/run.sh`
//! runs it on a GPU; `make cuda-sim` on the CPU executor of kernels/cuda-sim, with
//! `TANDEM_CUDA_SIM=1` in the environment the servers inherit): the prefill, on the CPU
//! backend, runs the prompt and streams its KV over ZeroMQ; the decode (`--device cuda
//! --cuda-graphs on`) imports it into device memory and generates with the real `.cu`
//! kernels, device sampling and CUDA graphs, behind the real HTTP server.
//!
//! Its greedy tokens equal a CPU decode's (served by a CPU pair) up to the first near tie:
//! the backends' logits differ by the Q8-activation noise (see
//! `dataplane/src/model/cuda/gpu_tests/mod.rs`), so where they part the CPU's best two
//! log-probabilities must lie within 1.0 of each other. On the CUDA decode, device sampling
//! (a request without log-probabilities) gives exactly the tokens host sampling of the
//! same logits gives (one with them).
#![cfg(feature = "gpu-tests")]

mod common;

use common::{MODEL_NAME, Server, free_port, pd_env, start_decode, start_prefill};
use serde_json::json;

/// Below this log-probability margin between the CPU's best two tokens the CUDA decode may
/// pick the second (the TIE_MARGIN of the model tests).
const TIE_MARGIN: f64 = 1.0;

/// One step's top log-probabilities, best first: (token, logprob).
type TopLogprobs = Vec<(String, f64)>;

/// Greedy completion: its token strings, each step's top log-probabilities when asked
/// for, and the text.
fn complete(
    s: &Server,
    prompt: &str,
    n: usize,
    logprobs: bool,
) -> (Vec<String>, Vec<TopLogprobs>, String) {
    let mut body =
        json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": n, "temperature": 0});
    if logprobs {
        body["logprobs"] = json!(2);
    }
    let r = s.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let text = v["choices"][0]["text"].as_str().unwrap().to_owned();
    if !logprobs {
        return (Vec::new(), Vec::new(), text);
    }
    let lp = &v["choices"][0]["logprobs"];
    let toks = lp["tokens"].as_array().unwrap();
    let tops = lp["top_logprobs"].as_array().unwrap();
    let tops = tops
        .iter()
        .map(|t| {
            let mut v: Vec<(String, f64)> = t
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, l)| (k.clone(), l.as_f64().unwrap()))
                .collect();
            v.sort_by(|a, b| b.1.total_cmp(&a.1));
            v
        })
        .collect();
    let toks = toks
        .iter()
        .map(|t| t.as_str().unwrap().to_owned())
        .collect();
    (toks, tops, text)
}

#[test]
fn pd_decode_on_cuda_serves_the_tokens_of_a_cpu_decode() {
    let on_executor = std::env::var("TANDEM_CUDA_SIM").is_ok_and(|v| v == "1");
    // One decode step costs the executor about half a CPU-second: fewer tokens there.
    let n = if on_executor { 6 } else { 24 };
    let env = pd_env(&[("TANDEM_KV_TIMEOUT_SECONDS", "120")]);
    let (kv_cuda, kv_cpu) = (free_port(), free_port());
    let _prefill_cuda = start_prefill(kv_cuda, &env);
    let _prefill_cpu = start_prefill(kv_cpu, &env);
    let peer = format!("127.0.0.1:{kv_cuda}");
    let mut cuda = Server::spawn(
        &["--role", "decode", "--prefill", &peer],
        &["--device", "cuda", "--cuda-graphs", "on"],
        &env,
    );
    cuda.wait_ready();
    let cpu = start_decode(&[kv_cpu], &env, true);
    let log = cuda.log_text();
    assert!(
        log.contains("\"device\":\"cuda:0\"") && log.contains("CUDA runner options"),
        "the decode did not load on CUDA:\n{log}"
    );
    for prompt in ["The capital of France is", "def fibonacci(n):"] {
        let (toks, _, text) = complete(&cuda, prompt, n, true);
        let (_, _, device_text) = complete(&cuda, prompt, n, false);
        assert_eq!(
            device_text, text,
            "{prompt:?}: device sampling vs host sampling"
        );
        assert_eq!(toks.concat(), text);
        let (want, tops, _) = complete(&cpu, prompt, n, true);
        let same = toks.iter().zip(&want).take_while(|(a, b)| a == b).count();
        if same < n {
            let top = &tops[same];
            let margin = top[0].1 - top.get(1).map_or(f64::NEG_INFINITY, |t| t.1);
            assert!(
                margin < TIE_MARGIN,
                "{prompt:?}: CUDA decode {toks:?} parts from the CPU's {want:?} at token {same}, \
                 where the CPU's margin is {margin}"
            );
        }
        println!(
            "{prompt:?}: CUDA decode {text:?}; equal to the CPU decode for {same} of {n} tokens"
        );
        if prompt.contains("France") {
            assert!(text.contains("Paris"), "{text:?}");
        }
    }
    // The KV really came from the prefill: one room per request (two per prompt) done, and
    // bytes received; the CUDA decode's blocks are all free again.
    let rooms = cuda.metric("tandem_kv_rooms_total{state=\"done\",reason=\"none\"} ");
    assert_eq!(rooms, 4.0);
    assert!(cuda.metric("tandem_kv_transfer_bytes_total{direction=\"received\"} ") > 0.0);
    assert_eq!(cuda.metric("tandem_kv_blocks_used "), 0.0);
}
