//! A real network partition: the decode and the prefill run in two network namespaces
//! joined by a veth pair, and the test takes that link down and up again. Cut: the decode's
//! channel deadline ends the session, so it turns not-ready and the room in flight fails
//! `peer_unresponsive` within the deadline (before the liveness window and long before the
//! KV timeout), no loop is stuck. Heal: ready again without a restart.

mod common;

use std::time::{Duration, Instant};

use common::{MODEL_NAME, NetPair, Server, free_port, pd_env};
use serde_json::json;

#[test]
fn a_partition_is_seen_within_the_channel_deadline_and_heals_without_a_restart() {
    let pair = match NetPair::create(1) {
        Ok(p) => p,
        Err(e) => {
            // Listed among the suite's skipped checks (`make unit` prints them).
            common::skipped(
                "pd_partition (a real network partition)",
                &format!("the kernel refused a network namespace or veth pair ({e})"),
            );
            return;
        }
    };
    // Channel deadline 600 ms (PINGs every 150 ms), inside the liveness window 2 x 0.5 s =
    // 1 s, so the deadline is what finds the cut; KV timeout 3 s; the prefill expires a
    // silent decode after max(2 x 1 s, bootstrap 2 s) = 2 s.
    let env = pd_env(&[
        ("TANDEM_PROBE_PERIOD_SECONDS", "0.5"),
        ("TANDEM_FAILURE_THRESHOLD", "2"),
        ("TANDEM_BOOTSTRAP_TIMEOUT_SECONDS", "2"),
        ("TANDEM_KV_TIMEOUT_SECONDS", "3"),
        ("TANDEM_CHANNEL_DEADLINE_MS", "600"),
    ]);
    let deadline = Duration::from_millis(600);
    let heartbeat = Duration::from_millis(150);
    let kv = free_port().to_string();
    let mut prefill = Server::spawn_in(
        Some((&pair.prefill, pair.prefill_http)),
        &["--role", "prefill", "--kv-port", &kv],
        &["--chunk-size", "16"],
        &env,
    );
    prefill.wait_ready();
    let peer = format!("{}:{kv}", pair.prefill_kv);
    let mut decode = Server::spawn_in(
        Some((&pair.decode, pair.decode_http)),
        &["--role", "decode", "--prefill", &peer],
        &[],
        &env,
    );
    decode.wait_ready();
    let decode_pid = decode.child.id();
    let short = json!({"model": MODEL_NAME, "prompt": "The sky is", "max_tokens": 3});
    assert_eq!(decode.post("/v1/completions", &short).status, 200);

    // A room in flight when the link goes: a prompt that takes the prefill seconds.
    let long = json!({"model": MODEL_NAME, "max_tokens": 2,
                      "prompt": "one two three four five six seven ".repeat(40)})
    .to_string();
    let addr = decode.addr;
    let client = std::thread::spawn(move || {
        let r = common::request(addr, "POST", "/v1/completions", Some(&long));
        (r, Instant::now())
    });
    prefill.wait_for("room on the prefill", Duration::from_secs(10), |s| {
        s.metric("tandem_kv_rooms_opened_total ") == 2.0
    });

    pair.cut();
    let cut_at = Instant::now();
    let not_ready = decode.wait_for("not ready after the cut", Duration::from_secs(5), |s| {
        !s.is_ready()
    });
    let body = decode.ready_body();
    assert_eq!(body["reason"], "peer_unresponsive", "{body}");
    let (r, failed_at) = client.join().unwrap();
    let failed_after = failed_at.duration_since(cut_at);
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "peer_unresponsive", "{}", r.body);
    // No loop is stuck on either side, though one cannot reach the other.
    for s in [&decode, &prefill] {
        let b = s.ready_body();
        let loops: Vec<_> = b["checks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["name"].as_str().unwrap().starts_with("loop_"))
            .collect();
        assert!(
            !loops.is_empty() && loops.iter().all(|c| c["ok"] == true),
            "{b}"
        );
    }
    // New requests are refused at once with the reason.
    let r = decode.post("/v1/completions", &short);
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], "no_peer", "{}", r.body);
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("peer_unresponsive"), "{message}");
    // The prefill expires the silent decode and fails its side of the room.
    prefill.wait_for("session expired", Duration::from_secs(10), |s| {
        s.metric("tandem_kv_sessions_dropped_total{reason=\"expired\"} ") == 1.0
    });
    std::thread::sleep(Duration::from_secs(1));

    pair.heal();
    let healed = decode.wait_for("ready after the heal", Duration::from_secs(30), |s| {
        s.is_ready()
    });
    let r = decode.post("/v1/completions", &short);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(decode.child.id(), decode_pid, "same process");
    assert!(decode.child.try_wait().unwrap().is_none());
    // It came back through a new handshake, and says why it needed one.
    let body = decode.ready_body();
    let refusal = &body["peers"][0]["last_refusal"];
    assert_eq!(refusal["reason"], "peer_expired", "{body}");
    // (Every message the decode queued during the cut is refused the same way.)
    assert!(decode.metric("tandem_kv_handshakes_total{result=\"peer_expired\"} ") >= 1.0);
    println!(
        "partition: not ready {:.2} s after the cut and the room in flight failed {:.2} s \
         after it (channel deadline {:.2} s, PINGs every {:.2} s; KV timeout 3 s); ready \
         {:.2} s after the heal",
        not_ready.as_secs_f64(),
        failed_after.as_secs_f64(),
        deadline.as_secs_f64(),
        heartbeat.as_secs_f64(),
        healed.as_secs_f64(),
    );
    let bound = deadline + heartbeat + Duration::from_millis(400);
    assert!(
        not_ready <= bound,
        "not ready only {not_ready:?} after the cut"
    );
    assert!(
        failed_after <= bound,
        "the room failed {failed_after:?} after the cut"
    );
    assert!(healed < Duration::from_secs(10), "healed after {healed:?}");
}
