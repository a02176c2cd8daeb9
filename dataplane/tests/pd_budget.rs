//! Sends bounded in bytes, with a real stalled peer: a decode process is SIGSTOPped after its
//! rooms reached the prefill, so it reads nothing while the prefill finishes them. With a
//! small send budget the prefill sends one room's KV, fails the others at once
//! (`send_budget`, counted) and its memory stays within the budget; with a budget larger
//! than all of them (the control, same run) it queues every room's KV for the stalled
//! peer and its memory grows by about that much — which is what the bound prevents.

mod common;

use std::time::Duration;

use common::{MODEL_NAME, Server, free_port, pd_env};
use serde_json::json;

/// Rooms per run and prompt tokens per room: with an F32 KV cache SmolLM2 keeps 46,080
/// bytes per token, so each room carries 5.9 MB of KV and all of them 59 MB.
const ROOMS: usize = 10;
const PROMPT: u32 = 128;
const KV_PER_ROOM: u64 = PROMPT as u64 * 30 * 2 * 3 * 64 * 4;

struct Run {
    prefill: Server,
    decode: Server,
    clients: Vec<std::thread::JoinHandle<common::HttpResponse>>,
    baseline_kib: u64,
}

fn body(i: usize) -> String {
    let prompt: Vec<u32> = (0..PROMPT)
        .map(|t| 200 + (t * 7 + i as u32) % 5000)
        .collect();
    json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}).to_string()
}

/// A prefill with `budget_mib` and its decode; one warm-up room so the engine's buffers
/// exist before the baseline; then `ROOMS` requests, and the decode frozen once they all
/// reached the prefill.
fn start(budget_mib: &str, env: &[(&str, &str)]) -> Run {
    let kv = free_port();
    let kv_arg = kv.to_string();
    let mut prefill = Server::spawn(
        &["--role", "prefill", "--kv-port", &kv_arg],
        &[
            "--kv-dtype",
            "f32",
            "--kv-send-budget-mib",
            budget_mib,
            // One room at a time: every room reuses the KV blocks (and pages) the warm-up
            // touched, so RSS growth is what the rooms' KV in flight pins, nothing else.
            "--max-batch",
            "1",
            // Without the prefix cache: it would keep each room's prompt blocks and hand
            // the next room untouched pool pages, growing RSS by the pool, not the sends.
            "--no-prefix-cache",
        ],
        env,
    );
    prefill.wait_ready();
    let peer = format!("127.0.0.1:{kv}");
    let mut decode = Server::spawn(
        &["--role", "decode", "--prefill", &peer],
        &["--kv-dtype", "f32"],
        env,
    );
    decode.wait_ready();
    for i in [98, 99] {
        let warm = decode.post("/v1/completions", &serde_json::from_str(&body(i)).unwrap());
        assert_eq!(warm.status, 200, "{}", warm.body);
    }
    Run {
        baseline_kib: prefill.rss_kib(),
        clients: Vec::new(),
        prefill,
        decode,
    }
}

fn launch(run: &mut Run) {
    let addr = run.decode.addr;
    run.clients = (0..ROOMS)
        .map(|i| {
            let b = body(i);
            std::thread::spawn(move || common::request(addr, "POST", "/v1/completions", Some(&b)))
        })
        .collect();
    run.prefill.wait_for(
        "every room reached the prefill",
        Duration::from_secs(60),
        |s| s.metric("tandem_kv_rooms_opened_total ") == (ROOMS + 2) as f64,
    );
    run.decode.signal("STOP");
}

/// Wait until the prefill ended every room (sent, or refused by the budget); its RSS growth
/// over the baseline in MiB.
fn growth_when_all_rooms_ended(run: &Run) -> f64 {
    run.prefill.wait_for(
        "every room ended on the prefill",
        Duration::from_secs(240),
        |s| s.metric_sum("tandem_kv_rooms_total") == (ROOMS + 2) as f64,
    );
    std::thread::sleep(Duration::from_millis(300));
    (run.prefill.rss_kib() as f64 - run.baseline_kib as f64) / 1024.0
}

#[test]
fn a_stalled_decode_pins_at_most_the_send_budget_on_the_prefill() {
    // Long probe period and timeouts: the decode is frozen on purpose and must not be
    // expired while the prefill works through the rooms.
    let env = pd_env(&[
        ("TANDEM_PROBE_PERIOD_SECONDS", "20"),
        ("TANDEM_FAILURE_THRESHOLD", "3"),
        ("TANDEM_KV_TIMEOUT_SECONDS", "300"),
    ]);
    let mut bounded = start("2", &env);
    let mut control = start("1024", &env);
    launch(&mut bounded);
    launch(&mut control);
    let bounded_mib = growth_when_all_rooms_ended(&bounded);
    let control_mib = growth_when_all_rooms_ended(&control);
    let room_mib = KV_PER_ROOM as f64 / (1 << 20) as f64;
    println!(
        "prefill RSS growth with a stalled decode: budget 2 MiB -> {bounded_mib:.1} MiB, \
         budget 1024 MiB -> {control_mib:.1} MiB ({ROOMS} rooms of {room_mib:.1} MiB)"
    );
    let in_flight = bounded.prefill.metric("tandem_kv_bytes_in_flight ");
    let refused = bounded
        .prefill
        .metric("tandem_kv_rooms_total{state=\"failed\",reason=\"send_budget\"} ");
    // With nothing in flight one room is always sent; every later one would pass the budget.
    assert_eq!(
        refused,
        (ROOMS - 1) as f64,
        "{}",
        bounded.prefill.log_text()
    );
    assert_eq!(
        bounded
            .prefill
            .metric("tandem_kv_send_failures_total{result=\"byte_budget\"} "),
        refused
    );
    // (A room's KV travels with its 32-byte export header.)
    let room_bytes = (KV_PER_ROOM + 32) as f64;
    assert_eq!(in_flight, room_bytes, "one room unacknowledged");
    assert_eq!(
        control
            .prefill
            .metric("tandem_kv_rooms_total{state=\"failed\",reason=\"send_budget\"} "),
        0.0
    );
    assert_eq!(
        control.prefill.metric("tandem_kv_bytes_in_flight "),
        ROOMS as f64 * room_bytes
    );
    // Memory: the bounded prefill holds at most one room (plus allocator slack); the
    // control holds the KV of every room it queued for the frozen peer.
    let slack = 12.0;
    assert!(
        bounded_mib <= room_mib + slack,
        "bounded prefill grew {bounded_mib:.1} MiB (control {control_mib:.1} MiB)"
    );
    assert!(
        control_mib >= bounded_mib + 3.0 * room_mib,
        "the control should pin far more: {control_mib:.1} vs {bounded_mib:.1} MiB"
    );

    // The decode reads again: the refused rooms' clients got 503 send_budget at once, the
    // others their completions; the acknowledgements bring the bytes in flight to zero.
    for run in [&mut bounded, &mut control] {
        run.decode.signal("CONT");
        let results: Vec<_> = run.clients.drain(..).map(|c| c.join().unwrap()).collect();
        let ok = results.iter().filter(|r| r.status == 200).count();
        let budget = results
            .iter()
            .filter(|r| r.status == 503 && r.json()["error"]["code"] == "send_budget")
            .count();
        assert_eq!(ok + budget, ROOMS, "{results:?}");
        run.prefill
            .wait_for("bytes acknowledged", Duration::from_secs(30), |s| {
                s.metric("tandem_kv_bytes_in_flight ") == 0.0
            });
        run.decode
            .wait_for("decode ready", Duration::from_secs(30), Server::is_ready);
    }
    assert_eq!(
        bounded
            .decode
            .metric("tandem_kv_rooms_total{state=\"failed\",reason=\"send_budget\"} "),
        (ROOMS - 1) as f64
    );
}
