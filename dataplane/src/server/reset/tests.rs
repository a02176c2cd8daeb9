//! The in-place reset over real HTTP and real ZeroMQ, in process: a prefill and a decode,
//! each the real `serve` with a `PdSlot` on the toy engine, reset through
//! `POST /admin/reset` as the operator does it. The same with the real model and real
//! processes: `tests/pd_reset.rs`.

use std::sync::Mutex;

use serde_json::json;
use tandem_contract::MemberRole;

use super::super::test_server::toy_tokenizer;
use super::*;
use crate::kv::auth::GroupKey;
use crate::metrics::Metrics;
use crate::pd::reset::proof;
use crate::pd::{PdLimits, PdStarter, PdTimings};
use crate::scheduler::{self, SchedulerConfig};
use crate::server::{HttpLimits, serve};
use crate::test_support::fake_runner::{FakeState, fake};
use crate::test_support::http_client::{HttpResponse, request, request_with};
use crate::tokenizer::TokenText;

const KEY: &str = "reset-test-key";
const GROUP: u64 = 7;

#[test]
fn the_body_takes_a_group_incarnation_and_a_bounded_timeout_and_names_what_is_wrong() {
    let ok = parse_ask(br#"{"group_incarnation": 8}"#).unwrap();
    assert_eq!(ok.group_incarnation, 8);
    assert_eq!(ok.timeout, Duration::from_millis(DEFAULT_TIMEOUT_MS));
    let ok = parse_ask(br#"{"group_incarnation": 0, "timeout_ms": 60000}"#).unwrap();
    assert_eq!((ok.group_incarnation, ok.timeout.as_millis()), (0, 60_000));
    let ok = parse_ask(br#"{"group_incarnation": 18446744073709551615, "timeout_ms": 0}"#).unwrap();
    assert_eq!(
        (ok.group_incarnation, ok.timeout),
        (u64::MAX, Duration::ZERO)
    );
    for (body, field, code) in [
        (r#"{}"#, Some("group_incarnation"), "missing_field"),
        (
            r#"{"group_incarnation": null}"#,
            Some("group_incarnation"),
            "missing_field",
        ),
        (
            r#"{"group_incarnation": -1}"#,
            Some("group_incarnation"),
            "invalid_type",
        ),
        (
            r#"{"group_incarnation": 1.5}"#,
            Some("group_incarnation"),
            "invalid_type",
        ),
        (
            r#"{"group_incarnation": "8"}"#,
            Some("group_incarnation"),
            "invalid_type",
        ),
        (
            r#"{"group_incarnation": 8, "timeout_ms": 60001}"#,
            Some("timeout_ms"),
            "out_of_range",
        ),
        (
            r#"{"group_incarnation": 8, "timeout_ms": -5}"#,
            Some("timeout_ms"),
            "invalid_type",
        ),
        (
            r#"{"groupIncarnation": 8}"#,
            Some("groupIncarnation"),
            "unknown_field",
        ),
        (r#"[8]"#, None, "not_an_object"),
        (r#"{"group_incarnation": 8"#, None, "invalid_json"),
    ] {
        let e = parse_ask(body.as_bytes()).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(e.param.as_deref(), field, "{body}: {}", e.message);
        assert_eq!(e.code, Some(code), "{body}: {}", e.message);
    }
}

/// Fast protocol timings, so that a decode is ready within a few hundred ms.
fn timings() -> PdTimings {
    PdTimings {
        probe_period: Duration::from_millis(300),
        failure_threshold: 3,
        bootstrap_timeout: Duration::from_secs(2),
        kv_timeout: Duration::from_secs(10),
        channel_deadline: Duration::from_secs(1),
    }
}

struct PdServer {
    addr: std::net::SocketAddr,
    runner: Arc<Mutex<FakeState>>,
    state: Arc<AppState>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    serving: Option<std::thread::JoinHandle<()>>,
}

impl Drop for PdServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.serving.take() {
            let _ = t.join();
        }
        if let Some(pd) = &self.state.pd {
            pd.stop(Instant::now() + Duration::from_secs(2));
        }
    }
}

impl PdServer {
    fn start(role: MemberRole, kv_port: u16, peers: &[u16]) -> Self {
        let (runner, st) = fake(10_000);
        let info = crate::engine_api::ModelRunner::info(&runner).clone();
        let tok = Arc::new(toy_tokenizer());
        let metrics = Arc::new(Metrics::new());
        let text: Arc<dyn TokenText> = tok.clone();
        let (engine, _) =
            scheduler::spawn(runner, text, SchedulerConfig::default(), metrics.clone()).unwrap();
        let starter = PdStarter {
            role,
            host: "127.0.0.1".into(),
            kv_port,
            prefill_peers: peers.iter().map(|p| format!("127.0.0.1:{p}")).collect(),
            info,
            kv_dtype: 0,
            key: GroupKey::new(KEY.as_bytes()),
            timings: timings(),
            limits: PdLimits::default(),
            engine: engine.clone(),
            metrics: metrics.clone(),
        };
        let pd = crate::pd::PdSlot::start(starter, GROUP).unwrap();
        let state = Arc::new(AppState {
            engine,
            tokenizer: tok,
            chat: None,
            add_bos: false,
            model_name: "toy".into(),
            context_length: 1024,
            default_max_tokens: 16,
            metrics,
            max_heartbeat_age: Duration::from_secs(5),
            limits: HttpLimits::default(),
            role: role.as_str(),
            shutdown: Default::default(),
            pd: Some(pd),
            fault_injection: false,
            no_progress: Duration::from_secs(30),
            progress: Default::default(),
            readiness: Default::default(),
            api_keys: Default::default(),
            kv_block_tokens: crate::test_support::fake_runner::BLOCK,
        });
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let st2 = state.clone();
        let serving = std::thread::spawn(move || {
            rt.block_on(serve(
                listener,
                st2,
                async { drop(rx.await) },
                Duration::from_secs(1),
            ));
        });
        Self {
            addr,
            runner: st,
            state,
            stop: Some(tx),
            serving: Some(serving),
        }
    }

    fn ready(&self) -> serde_json::Value {
        request(self.addr, "GET", "/ready", None).json()
    }

    fn wait(&self, what: &str, limit: Duration, f: impl Fn(&serde_json::Value) -> bool) {
        let t = Instant::now();
        loop {
            let body = self.ready();
            if f(&body) {
                return;
            }
            assert!(t.elapsed() < limit, "{what}: not within {limit:?}: {body}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn reset_as(&self, role: MemberRole, key: &str, n: u64, timeout_ms: u64) -> HttpResponse {
        let p = proof(&GroupKey::new(key.as_bytes()), role, n);
        let auth = format!("Tandem-Reset {p}");
        let body = json!({"group_incarnation": n, "timeout_ms": timeout_ms}).to_string();
        request_with(
            self.addr,
            "POST",
            "/admin/reset",
            &[("Authorization", &auth)],
            Some(&body),
        )
    }

    fn reset(&self, n: u64) -> HttpResponse {
        let role = self.state.pd.as_ref().unwrap().role();
        self.reset_as(role, KEY, n, 5_000)
    }

    fn metric(&self, line_prefix: &str) -> f64 {
        let body = self.state.metrics.encode();
        body.lines()
            .find_map(|l| {
                l.strip_prefix(line_prefix)
                    .and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or_else(|| panic!("no series {line_prefix:?}:\n{body}"))
    }

    fn blocks_used(&self) -> usize {
        self.runner.lock().unwrap().used()
    }

    fn complete(&self, max_tokens: u32) -> HttpResponse {
        let body = json!({"model": "toy", "prompt": "Hi there", "max_tokens": max_tokens,
                          "temperature": 0, "ignore_eos": true})
        .to_string();
        request(self.addr, "POST", "/v1/completions", Some(&body))
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn pair() -> (PdServer, PdServer) {
    let kv = free_port();
    let prefill = PdServer::start(MemberRole::Prefill, kv, &[]);
    let decode = PdServer::start(MemberRole::Decode, 0, &[kv]);
    decode.wait("decode ready", Duration::from_secs(10), |b| {
        b["ready"] == true
    });
    (prefill, decode)
}

fn ready_reason(b: &serde_json::Value) -> String {
    b["reason"].as_str().unwrap_or("").to_owned()
}

#[test]
fn a_reset_without_a_valid_proof_is_401_and_counted_and_changes_nothing() {
    let (prefill, _decode) = pair();
    let body = json!({"group_incarnation": 8}).to_string();
    let bare = request(prefill.addr, "POST", "/admin/reset", Some(&body));
    let good = proof(&GroupKey::new(KEY.as_bytes()), MemberRole::Prefill, 8);
    let malformed = request_with(
        prefill.addr,
        "POST",
        "/admin/reset",
        &[("Authorization", &format!("Bearer {good}"))],
        Some(&body),
    );
    let wrong_key = prefill.reset_as(MemberRole::Prefill, "another-key", 8, 1000);
    // The decode's proof for the same incarnation does not reset the prefill.
    let wrong_role = prefill.reset_as(MemberRole::Decode, KEY, 8, 1000);
    // A proof for 9 with a body asking for 8.
    let p9 = proof(&GroupKey::new(KEY.as_bytes()), MemberRole::Prefill, 9);
    let wrong_incarnation = request_with(
        prefill.addr,
        "POST",
        "/admin/reset",
        &[("Authorization", &format!("Tandem-Reset {p9}"))],
        Some(&body),
    );
    for r in [
        &bare,
        &malformed,
        &wrong_key,
        &wrong_role,
        &wrong_incarnation,
    ] {
        assert_eq!(r.status, 401, "{}", r.body);
        let v = r.json();
        assert_eq!(v["error"]["code"], "reset_unauthorized", "{}", r.body);
        assert!(
            !r.body.contains(&good) && !r.body.contains(&p9),
            "{}",
            r.body
        );
    }
    assert_eq!(
        prefill.metric("tandem_resets_total{outcome=\"unauthorized\"} "),
        5.0
    );
    assert_eq!(prefill.ready()["group_incarnation"], GROUP);
    // A bad body with a proof is 400, naming the field.
    let p = proof(&GroupKey::new(KEY.as_bytes()), MemberRole::Prefill, 8);
    let r = request_with(
        prefill.addr,
        "POST",
        "/admin/reset",
        &[("Authorization", &format!("Tandem-Reset {p}"))],
        Some(r#"{"group_incarnation": 8, "timeout_ms": 999999}"#),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "timeout_ms", "{}", r.body);
    // GET is 405 (the path exists for this role).
    let r = request(prefill.addr, "GET", "/admin/reset", None);
    assert_eq!(r.status, 405, "{}", r.body);
}

#[test]
fn the_route_does_not_exist_for_role_both() {
    let s = super::super::test_server::start(100);
    let p = proof(&GroupKey::new(KEY.as_bytes()), MemberRole::Decode, 1);
    let r = request_with(
        s.addr,
        "POST",
        "/admin/reset",
        &[("Authorization", &format!("Tandem-Reset {p}"))],
        Some(r#"{"group_incarnation": 1}"#),
    );
    assert_eq!(r.status, 404, "{}", r.body);
    let ready = request(s.addr, "GET", "/ready", None).json();
    assert_eq!(
        ready["group_incarnation"],
        serde_json::Value::Null,
        "{ready}"
    );
}

#[test]
fn prefill_then_decode_reset_in_place_and_serve_again_at_the_next_incarnation() {
    let (prefill, decode) = pair();
    assert_eq!(decode.complete(4).status, 200);
    assert_eq!(decode.ready()["group_incarnation"], GROUP);
    let (p0, d0) = (prefill.blocks_used(), decode.blocks_used());
    let decode_incarnation = decode.ready()["peers"][0]["incarnation"].clone();
    let t = Instant::now();

    // 1. The prefill, first.
    let r = prefill.reset(GROUP + 1);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["reset"], true, "{v}");
    assert_eq!(v["ready"], true, "{v}");
    assert_eq!(v["group_incarnation"], GROUP + 1, "{v}");
    assert_eq!(v["incarnation"].as_str().unwrap().len(), 16, "{v}");
    assert_eq!(prefill.ready()["group_incarnation"], GROUP + 1);
    // The decode, still at 7, is refused by the prefill at 8 with the mismatch reason.
    decode.wait("decode refused", Duration::from_secs(5), |b| {
        b["ready"] == false && ready_reason(b) == "incarnation_mismatch"
    });
    let r = decode.complete(4);
    assert_eq!(r.status, 503, "{}", r.body);

    // 2. The decode.
    let r = decode.reset(GROUP + 1);
    let pair_took = t.elapsed();
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(
        (v["reset"].clone(), v["ready"].clone()),
        (json!(true), json!(true)),
        "{v}"
    );
    assert_ne!(
        decode.ready()["peers"][0]["incarnation"],
        decode_incarnation
    );
    let ready = decode.ready();
    assert_eq!(ready["ready"], true, "{ready}");
    assert_eq!(ready["group_incarnation"], GROUP + 1, "{ready}");
    assert_eq!(decode.complete(4).status, 200);
    println!("in-process reset of the pair (prefill then decode): {pair_took:?}");

    // 3. Repeating is a no-op; going back is refused.
    let r = decode.reset(GROUP + 1);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["reset"], false, "{}", r.body);
    assert_eq!(r.json()["incarnation"], v["incarnation"], "{}", r.body);
    let r = decode.reset(GROUP);
    assert_eq!(r.status, 409, "{}", r.body);
    let e = r.json();
    assert_eq!(e["error"]["code"], "stale_incarnation", "{e}");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("7") && msg.contains("8"), "{msg}");
    for s in [&prefill, &decode] {
        assert_eq!(s.metric("tandem_resets_total{outcome=\"done\"} "), 1.0);
    }
    assert_eq!(decode.metric("tandem_resets_total{outcome=\"noop\"} "), 1.0);
    assert_eq!(
        decode.metric("tandem_resets_total{outcome=\"stale\"} "),
        1.0
    );
    // Nothing leaked: the engines hold the blocks they held before.
    let settle = Instant::now();
    while (prefill.blocks_used(), decode.blocks_used()) != (p0, d0)
        && settle.elapsed() < Duration::from_secs(2)
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!((prefill.blocks_used(), decode.blocks_used()), (p0, d0));
}

#[test]
fn rooms_and_requests_in_flight_end_with_reset_at_once_and_free_their_blocks() {
    let (prefill, decode) = pair();
    let (p0, d0) = (prefill.blocks_used(), decode.blocks_used());

    // A room waiting for its KV on a slow prefill engine: the prefill's reset fails it with
    // `reset`, pushed to the decode, whose request answers 503 `reset` at once.
    prefill.runner.lock().unwrap().step_delay = Duration::from_millis(1500);
    let addr = decode.addr;
    let body = json!({"model": "toy", "prompt": "Hi there", "max_tokens": 4}).to_string();
    let b2 = body.clone();
    let waiting = std::thread::spawn(move || {
        let r = request(addr, "POST", "/v1/completions", Some(&b2));
        (Instant::now(), r)
    });
    prefill.wait("room open", Duration::from_secs(5), |b| {
        b["peers"][0]["rooms"] == 1
    });
    let r = prefill.reset(GROUP + 1);
    let reset_at = Instant::now();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["rooms_ended"], 1, "{}", r.body);
    let (answered, r) = waiting.join().unwrap();
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "reset", "{}", r.body);
    assert!(answered <= reset_at + Duration::from_millis(500));
    prefill.runner.lock().unwrap().step_delay = Duration::ZERO;
    for s in [&prefill, &decode] {
        assert_eq!(
            s.metric("tandem_kv_rooms_total{state=\"failed\",reason=\"reset\"} "),
            1.0
        );
    }

    // A streaming request generating on the decode (its room done) when the decode resets:
    // its stream ends with the reason, not with the rest of the tokens.
    let r = decode.reset(GROUP + 1);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(decode.complete(2).status, 200);
    decode.runner.lock().unwrap().step_delay = Duration::from_millis(50);
    let body = json!({"model": "toy", "prompt": "Hi there", "max_tokens": 200,
                      "ignore_eos": true, "stream": true})
    .to_string();
    let streaming = std::thread::spawn(move || {
        let r = request(addr, "POST", "/v1/completions", Some(&body));
        (Instant::now(), r)
    });
    std::thread::sleep(Duration::from_millis(500));
    let r = decode.reset_as(MemberRole::Decode, KEY, GROUP + 2, 1000);
    let reset_at = Instant::now();
    // The prefill is still at 8: the decode resets but cannot be ready at 9.
    assert_eq!(r.status, 504, "{}", r.body);
    let v = r.json();
    assert_eq!(v["error"]["code"], "reset_incomplete", "{v}");
    assert_eq!(
        (v["reset"].clone(), v["ready"].clone()),
        (json!(true), json!(false)),
        "{v}"
    );
    let (answered, r) = streaming.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let data = r.sse_data();
    assert!(data.len() > 3, "{}", r.body);
    let last_event = &data[data.len() - 2];
    assert!(last_event.contains("\"code\":\"reset\""), "{}", r.body);
    assert_eq!(data.last().unwrap(), "[DONE]");
    // Ended within the reset call (which then waited its 1 s for readiness).
    assert!(
        answered < reset_at,
        "the stream ended {:?} after the reset call answered",
        answered - reset_at
    );
    decode.runner.lock().unwrap().step_delay = Duration::ZERO;
    assert_eq!(
        decode.metric("tandem_resets_total{outcome=\"incomplete\"} "),
        1.0
    );
    assert_eq!(
        decode.metric("tandem_request_failures_total{reason=\"reset\"} "),
        1.0
    );
    // And after the prefill follows, the pair serves at 9.
    assert_eq!(prefill.reset(GROUP + 2).status, 200);
    decode.wait("decode ready at 9", Duration::from_secs(5), |b| {
        b["ready"] == true
    });
    assert_eq!(decode.complete(2).status, 200);
    let settle = Instant::now();
    while (prefill.blocks_used(), decode.blocks_used()) != (p0, d0)
        && settle.elapsed() < Duration::from_secs(2)
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!((prefill.blocks_used(), decode.blocks_used()), (p0, d0));
}

#[test]
fn a_reset_while_draining_is_409_draining() {
    let (prefill, _decode) = pair();
    prefill.state.shutdown.begin_drain();
    let r = prefill.reset(GROUP + 1);
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "draining", "{}", r.body);
    assert_eq!(
        prefill.metric("tandem_resets_total{outcome=\"draining\"} "),
        1.0
    );
    assert_eq!(
        prefill.state.pd.as_ref().unwrap().group_incarnation(),
        GROUP
    );
}

/// A decode whose KV loop is stuck (as in a blocking call) with a full batch of requests
/// queued on it: the reset abandons the loop after its bound, ends those requests with
/// `reset`, and the new channel serves at once — the requests of the old channel must not
/// hold the engine's batch slots or blocks until the stuck thread wakes (they did: found by
/// `bench_recovery.py --faults kv_loop_stall`, requests after the reset answered only when
/// the 30 s stall ended).
#[test]
fn a_reset_that_abandons_a_stuck_kv_loop_serves_at_once_on_the_new_channel() {
    let (prefill, decode) = pair();
    let (p0, d0) = (prefill.blocks_used(), decode.blocks_used());
    let stall = Duration::from_secs(12);
    let run = decode.state.pd.as_ref().unwrap().current();
    let crate::pd::PdRole::Decode(d) = &run.role else {
        unreachable!("the decode's run")
    };
    d.loops()[0].inject(crate::pd::Fault::Stall(stall));
    let stalled_at = Instant::now();
    // Within the loop's stale window the decode still takes rooms: a whole batch of them
    // (SchedulerConfig::default's 16) queues on the stuck loop.
    let addr = decode.addr;
    let stuck: Vec<_> = (0..16)
        .map(|_| {
            std::thread::spawn(move || {
                let body =
                    json!({"model": "toy", "prompt": "Hi there", "max_tokens": 4}).to_string();
                request(addr, "POST", "/v1/completions", Some(&body))
            })
        })
        .collect();
    decode.wait(
        "decode not ready: loop_stalled",
        Duration::from_secs(5),
        |b| b["ready"] == false && ready_reason(b) == "loop_stalled",
    );
    assert_eq!(prefill.reset(GROUP + 1).status, 200);
    let reset_at = Instant::now();
    let r = decode.reset(GROUP + 1);
    let reset_took = reset_at.elapsed();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["ready"], true, "{}", r.body);
    // The loop had missed its heartbeats: the reset does not wait its 2 s for it.
    assert!(
        reset_took < Duration::from_secs(1),
        "the reset took {reset_took:?}"
    );
    for t in stuck {
        let r = t.join().unwrap();
        assert_eq!(r.status, 503, "{}", r.body);
        assert_eq!(r.json()["error"]["code"], "reset", "{}", r.body);
    }
    let asked = Instant::now();
    let r = decode.complete(4);
    let took = asked.elapsed();
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        stalled_at.elapsed() < stall,
        "the check ran past the stall; it proves nothing"
    );
    assert!(
        took < Duration::from_secs(2),
        "served {took:?} after the reset: the old channel's requests held the engine"
    );
    println!("reset (abandoning a stuck KV loop) {reset_took:?}, then served {took:?} after it");
    // Their blocks are back too, before the stuck thread wakes.
    let settle = Instant::now();
    while (prefill.blocks_used(), decode.blocks_used()) != (p0, d0)
        && settle.elapsed() < Duration::from_secs(2)
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!((prefill.blocks_used(), decode.blocks_used()), (p0, d0));
}
