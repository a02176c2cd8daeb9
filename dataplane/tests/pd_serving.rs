//! End-to-end PD serving: real prefill and decode processes, real ZeroMQ, the real model.

mod common;

use std::io::BufReader;
use std::time::Duration;

use common::http_client::{read_chunk, read_head, send};
use common::{
    MODEL_NAME, Server, chat_with_system, free_port, pd_env, start_decode, start_prefill,
};
use serde_json::{Value, json};

/// Greedy completion: (token strings with their logprobs, text, finish reason).
fn greedy(s: &Server, prompt: &str, max_tokens: u32) -> (Vec<(String, f64)>, String, Value) {
    let r = s.post(
        "/v1/completions",
        &json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "logprobs": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let lp = &v["choices"][0]["logprobs"];
    let toks = lp["tokens"].as_array().unwrap();
    let lps = lp["token_logprobs"].as_array().unwrap();
    let pairs: Vec<(String, f64)> = toks
        .iter()
        .zip(lps)
        .map(|(t, l)| (t.as_str().unwrap().to_owned(), l.as_f64().unwrap()))
        .collect();
    assert!(!pairs.is_empty());
    (
        pairs,
        v["choices"][0]["text"].as_str().unwrap().to_owned(),
        v["choices"][0]["finish_reason"].clone(),
    )
}

fn chat_stream_text(s: &Server, content: &str, max_tokens: u32) -> String {
    let r = s.post(
        "/v1/chat/completions",
        &json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, "temperature": 0, "stream": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

#[test]
fn pd_greedy_output_equals_colocated_token_for_token() {
    let env = pd_env(&[]);
    let kv = free_port();
    let prefill = start_prefill(kv, &env);
    let decode = start_decode(&[kv], &env, true);
    let both = Server::start(&[]);
    let prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        // Longer than one prefill chunk at --chunk-size 256? Not needed: several layers per
        // KV chunk are exercised by any prompt; this one just differs in length.
        "Once upon a time, in a land far away, there lived a dragon who loved to read books about",
    ];
    for p in prompts {
        let (pd_toks, pd_text, pd_fin) = greedy(&decode, p, 16);
        let (b_toks, b_text, b_fin) = greedy(&both, p, 16);
        assert_eq!(
            pd_toks.iter().map(|t| &t.0).collect::<Vec<_>>(),
            b_toks.iter().map(|t| &t.0).collect::<Vec<_>>(),
            "prompt {p:?}"
        );
        // Same numbers too (the first token's logprob is computed on the prefill).
        for (a, b) in pd_toks.iter().zip(&b_toks) {
            assert!((a.1 - b.1).abs() < 1e-3, "{p:?}: {a:?} vs {b:?}");
        }
        assert_eq!((pd_text, pd_fin), (b_text, b_fin));
    }
    // Seeded sampling continues the same random stream across the two processes.
    let seeded = json!({"model": MODEL_NAME, "prompt": "My favourite fruit is", "max_tokens": 12,
                        "temperature": 0.9, "seed": 42});
    let texts: Vec<String> = [&decode, &both]
        .iter()
        .map(|s| {
            let r = s.post("/v1/completions", &seeded);
            assert_eq!(r.status, 200, "{}", r.body);
            r.json()["choices"][0]["text"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(texts[0], texts[1]);
    for q in ["What is the capital of France?", "Name three colors."] {
        assert_eq!(
            chat_stream_text(&decode, q, 12),
            chat_stream_text(&both, q, 12)
        );
    }
    // The KV really moved through rooms: one per request, all done, bytes both ways.
    let rooms = decode.metric("tandem_kv_rooms_total{state=\"done\",reason=\"none\"} ");
    assert_eq!(rooms, 6.0);
    assert_eq!(
        prefill.metric("tandem_kv_rooms_total{state=\"done\",reason=\"none\"} "),
        6.0
    );
    let sent = prefill.metric("tandem_kv_transfer_bytes_total{direction=\"sent\"} ");
    let received = decode.metric("tandem_kv_transfer_bytes_total{direction=\"received\"} ");
    assert!(sent > 10_000.0 && sent == received, "{sent} vs {received}");
    // The decode never prefilled a prompt itself.
    assert_eq!(decode.metric("tandem_prompt_tokens_total "), 0.0);
    assert!(prefill.metric("tandem_prompt_tokens_total ") > 50.0);
    assert_eq!(
        decode.metric("tandem_kv_handshakes_total{result=\"ok\"} "),
        1.0
    );
    assert!(decode.metric("tandem_kv_ping_rtt_seconds_count ") >= 1.0);
    // Both sides hold no KV once the requests are over.
    assert_eq!(decode.metric("tandem_kv_blocks_used "), 0.0);
    assert_eq!(prefill.metric("tandem_kv_blocks_used "), 0.0);
}

/// PD with the prefix cache: the decode finds a shared system prompt in its own cache,
/// tells the prefill, and receives only the KV of the rest; the answers stay those of
/// `--role both`, and KV bytes per request drop by exactly the cached share.
#[test]
fn pd_prefix_cache_moves_only_the_uncached_suffix() {
    let env = pd_env(&[]);
    let kv = free_port();
    let prefill = start_prefill(kv, &env);
    let decode = start_decode(&[kv], &env, true);
    let both = Server::start(&[]);
    let system = "You are a meticulous assistant for a library. ".repeat(25);
    let received = || decode.metric("tandem_kv_transfer_bytes_total{direction=\"received\"} ");
    let mut rows = Vec::new(); // (prompt tokens, cached tokens, KV bytes received)
    for q in [
        "Which shelf holds the atlases?",
        "When does the reading room open?",
        "Which shelf holds the atlases?",
    ] {
        let before = received();
        let (text, lps, prompt, cached) = chat_with_system(&decode, &system, q, 2);
        let bytes = received() - before;
        let (text0, lps0, prompt0, _) = chat_with_system(&both, &system, q, 2);
        assert_eq!((&text, prompt), (&text0, prompt0), "{q}");
        let lp = |v: &Value| -> Vec<(String, f64)> {
            v["content"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| {
                    (
                        t["token"].as_str().unwrap().to_owned(),
                        t["logprob"].as_f64().unwrap(),
                    )
                })
                .collect()
        };
        for (a, b) in lp(&lps).iter().zip(lp(&lps0)) {
            assert!(
                a.0 == b.0 && (a.1 - b.1).abs() < 1e-3,
                "{q}: {a:?} vs {b:?}"
            );
        }
        rows.push((prompt as f64, cached as f64, bytes));
    }
    for (prompt, cached, bytes) in &rows {
        eprintln!(
            "PD prefix cache: {prompt} prompt tokens, {cached} cached on the decode, {bytes} KV bytes received"
        );
    }
    assert_eq!(rows[0].1, 0.0, "{rows:?}");
    assert!(rows[1].1 >= 192.0 && rows[2].1 > rows[1].1, "{rows:?}");
    // The KV export is a 32-byte header and the same bytes per token: the cached tokens'
    // share did not cross the wire.
    let per_token = (rows[0].2 - 32.0) / rows[0].0;
    for (prompt, cached, bytes) in &rows {
        assert_eq!(*bytes, 32.0 + per_token * (prompt - cached), "{rows:?}");
    }
    assert!(rows[1].2 < rows[0].2 / 4.0, "{rows:?}");
    // The prefill computed from its own cache too.
    assert!(prefill.metric("tandem_prefix_cache_hit_tokens_total ") >= rows[1].1);
    assert_eq!(
        decode.metric("tandem_prefix_cache_hit_tokens_total "),
        rows[1].1 + rows[2].1
    );
    // Idle cached blocks count as free once the sequences are retired (just after their
    // last token is sent, hence a wait).
    for s in [&decode, &prefill] {
        s.wait_for("blocks freed", Duration::from_secs(10), |s| {
            s.metric("tandem_kv_blocks_used ") == 0.0
        });
    }
}

#[test]
fn decode_restart_against_a_long_running_prefill() {
    let env = pd_env(&[]);
    let kv = free_port();
    let prefill = start_prefill(kv, &env);
    let d1 = start_decode(&[kv], &env, true);
    let first = greedy(&d1, "The three primary colors are", 8);
    let old_incarnation = d1.incarnation();
    assert_eq!(prefill.metric("tandem_kv_sessions "), 1.0);
    drop(d1); // SIGKILL: no goodbye reaches the prefill
    let killed_at = std::time::Instant::now();
    let d2 = start_decode(&[kv], &env, true);
    let new_incarnation = d2.incarnation();
    assert_ne!(old_incarnation, new_incarnation);
    assert_eq!(greedy(&d2, "The three primary colors are", 8), first);
    // The prefill authenticated two decode processes and never restarted.
    assert_eq!(
        prefill.metric("tandem_kv_handshakes_total{result=\"ok\"} "),
        2.0
    );
    // It drops the dead decode's session once it has been silent for the session expiry
    // (max(2 x failure_threshold x probe_period, bootstrap timeout) = 4 s here).
    let dropped = "tandem_kv_sessions_dropped_total{reason=\"expired\"} ";
    prefill.wait_for("old session expired", Duration::from_secs(15), |s| {
        s.metric(dropped) == 1.0
    });
    // (Measured from the kill; the last PING went out up to one probe period before it.)
    assert!(
        killed_at.elapsed() >= Duration::from_secs(3),
        "not before the expiry: {:?}",
        killed_at.elapsed()
    );
    let lines = prefill.log_lines(&["decode session dropped"]);
    assert_eq!(lines.len(), 1, "{}", prefill.log_text());
    for needle in [
        format!("\"peer_incarnation\":\"{old_incarnation}\""),
        "\"reason\":\"expired\"".to_owned(),
        "\"peer\":".to_owned(),
    ] {
        assert!(lines[0].contains(&needle), "{needle} not in {}", lines[0]);
    }
    // Only the old session went: the new decode keeps being served and stays ready.
    assert_eq!(prefill.metric("tandem_kv_sessions "), 1.0);
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(
        prefill.metric(dropped),
        1.0,
        "the live decode is not expired"
    );
    assert!(d2.is_ready() && prefill.is_ready());
    assert_eq!(greedy(&d2, "The three primary colors are", 8), first);
    assert_eq!(
        prefill.metric("tandem_kv_handshakes_total{result=\"ok\"} "),
        2.0,
        "the new decode never had to handshake again"
    );
}

#[test]
fn two_prefills_share_rooms_and_each_gates_readiness() {
    let env = pd_env(&[]);
    let (kv1, kv2) = (free_port(), free_port());
    let p1 = start_prefill(kv1, &env);
    let p2 = start_prefill(kv2, &env);
    let decode = start_decode(&[kv1, kv2], &env, true);
    let out: Vec<_> = (0..4)
        .map(|_| greedy(&decode, "Water boils at", 4))
        .collect();
    assert!(
        out.windows(2).all(|w| w[0] == w[1]),
        "same output from either prefill"
    );
    for p in [&p1, &p2] {
        assert!(
            p.metric("tandem_kv_rooms_opened_total ") >= 1.0,
            "idle peers share the work"
        );
    }
    // Least loaded, not round-robin: while one prefill works on a long prompt, every short
    // request goes to the other one (round-robin would send half of them to the busy one).
    let opened = |p: &Server| p.metric("tandem_kv_rooms_opened_total ");
    let before = (opened(&p1), opened(&p2));
    let long = json!({"model": MODEL_NAME, "max_tokens": 2,
                      "prompt": "one two three four five six seven eight ".repeat(60)})
    .to_string();
    let addr = decode.addr;
    let busy_request =
        std::thread::spawn(move || common::request(addr, "POST", "/v1/completions", Some(&long)));
    decode.wait_for("the long room opened", Duration::from_secs(10), |_| {
        opened(&p1) + opened(&p2) == before.0 + before.1 + 1.0
    });
    let (busy, idle) = if opened(&p1) > before.0 {
        (&p1, &p2)
    } else {
        (&p2, &p1)
    };
    let (busy_before, idle_before) = (opened(busy), opened(idle));
    for _ in 0..4 {
        assert_eq!(greedy(&decode, "Water boils at", 4), out[0]);
    }
    assert!(
        !busy_request.is_finished(),
        "the long prompt should still be in prefill"
    );
    assert_eq!(
        opened(idle),
        idle_before + 4.0,
        "all short rooms on the idle prefill"
    );
    assert_eq!(opened(busy), busy_before, "none on the busy one");
    assert_eq!(busy_request.join().unwrap().status, 200);

    // Losing one prefill makes the decode not-ready (every configured peer must be
    // healthy), but requests keep going to the healthy one.
    drop(p2);
    decode.wait_for("not ready without prefill 2", Duration::from_secs(4), |s| {
        !s.is_ready()
    });
    let ready = decode.get("/ready").json();
    let failing: Vec<&str> = ready["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["ok"] == false)
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert!(
        !failing.is_empty() && failing.iter().all(|n| n.ends_with(&format!(":{kv2}"))),
        "{ready}"
    );
    let before = p1.metric("tandem_kv_rooms_opened_total ");
    assert_eq!(greedy(&decode, "Water boils at", 4), out[0]);
    assert_eq!(p1.metric("tandem_kv_rooms_opened_total "), before + 1.0);
}

#[test]
fn abort_cascade_frees_blocks_on_both_sides() {
    // Without the prefix cache: the test needs prefills that are still running when their
    // clients leave, and a cached prefix shortens them (the cache has tests of its own).
    let env = pd_env(&[("TANDEM_NO_PREFIX_CACHE", "1")]);
    let kv = free_port();
    let prefill = start_prefill(kv, &env);
    let decode = start_decode(&[kv], &env, true);
    // ~450 tokens each: eight of them keep the prefill busy for seconds, so the first
    // clients are gone while their rooms are still in prefill (with ~110 tokens the
    // prefill sometimes finished every room first: no abort to check).
    let long = "Tell me everything about dragons, castles and knights. ".repeat(40);
    let n = 8;
    let start = |i: usize| {
        let body = json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": format!("{i} {long}")}],
                          "max_tokens": 200, "temperature": 0, "stream": true})
        .to_string();
        send(decode.addr, "POST", "/v1/chat/completions", Some(&body))
    };
    // Client 0 alone first, gone the moment its room is open: a room certainly aborted in
    // prefill, however fast the machine prefills. (The decode reserves a sequence's KV
    // before its room opens, so with this pool the rooms open one after another, and
    // clients that vanish right after sending often leave before theirs opened.)
    let first = start(0);
    decode.wait_for("client 0's room opened", Duration::from_secs(30), |s| {
        s.metric("tandem_kv_rooms_opened_total ") >= 1.0
    });
    drop(first);
    // Then half the clients vanish right after sending (in the queue or in prefill), half
    // after the first streamed chunks (their sequences are decoding).
    let streams: Vec<_> = (1..n).map(start).collect();
    let mut read_some = 0;
    for (i, s) in (1..n).zip(streams) {
        if i % 2 == 0 {
            drop(s);
            continue;
        }
        let mut r = BufReader::new(s);
        let (status, _) = read_head(&mut r);
        if status == 200 && read_chunk(&mut r).is_some() {
            read_some += 1;
        }
        drop(r);
    }
    assert!(
        read_some > 0,
        "some streams got going before their client left"
    );
    let freed = |s: &Server| {
        s.metric("tandem_kv_blocks_used ") == 0.0 && s.metric("tandem_requests_running ") == 0.0
    };
    decode.wait_for("decode blocks freed", Duration::from_secs(60), freed);
    prefill.wait_for("prefill blocks freed", Duration::from_secs(60), freed);
    // No room left in transfer; every room ended (done, or aborted and acknowledged).
    let peer = format!("tandem_kv_transfer_blocks_held{{peer=\"127.0.0.1:{kv}\"}} ");
    decode.wait_for("rooms drained", Duration::from_secs(10), |s| {
        s.metric(&peer) == 0.0
    });
    // (A client may vanish before its handler opened a room, hence "opened", not n.)
    for s in [&decode, &prefill] {
        let opened = s.metric("tandem_kv_rooms_opened_total ");
        let done = s.metric("tandem_kv_rooms_total{state=\"done\",reason=\"none\"} ");
        let aborted = s.metric("tandem_kv_rooms_total{state=\"aborted\",reason=\"client_abort\"} ");
        let body = s.get("/metrics").body;
        assert!(opened >= 1.0 && opened <= n as f64, "{body}");
        assert_eq!(done + aborted, opened, "{body}");
        let failed: f64 = body
            .lines()
            .filter(|l| l.starts_with("tandem_kv_rooms_total{state=\"failed\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        assert_eq!(failed, 0.0, "{body}");
    }
    // The clients that left while their rooms were still in prefill did abort rooms: at
    // least one room on each side ended aborted, not done.
    for s in [&decode, &prefill] {
        let aborted = s.metric("tandem_kv_rooms_total{state=\"aborted\",reason=\"client_abort\"} ");
        assert!(
            aborted > 0.0,
            "no room was aborted:\n{}",
            s.get("/metrics").body
        );
    }
    let t = decode.wait_for("decode ready", Duration::from_secs(1), Server::is_ready);
    assert!(t <= Duration::from_secs(1));
    assert!(prefill.is_ready());
    // And it still serves.
    let (toks, _, _) = greedy(&decode, "1, 2, 3, 4,", 4);
    assert!(!toks.is_empty());
}
