//! The in-place co-restart end to end on the local runtime: real `tandem-dataplane`
//! processes serving the real model, a real fault in a live process, and the group Ready
//! again at the next incarnation with the very same processes (their PIDs, so their
//! weights) — and the reset's figure printed.

use std::time::{Duration, Instant};

use common::local::*;
use serde_json::Value;

mod common;

/// The test manifest with fault injection on both roles (`--fault-injection` and the
/// variable it needs).
fn with_faults(name: &str) -> String {
    manifest(name, |m| {
        for role in ["prefill", "decode"] {
            let args = m["spec"][role]["args"].as_sequence_mut().unwrap();
            args.push("--fault-injection".into());
            m["spec"][role]["template"]["env"] =
                serde_yaml::from_str("[{name: TANDEM_ALLOW_FAULT_INJECTION, value: 'yes'}]")
                    .unwrap();
        }
    })
}

fn running(l: &Local, role: &str) -> Value {
    l.members()
        .into_iter()
        .find(|m| m["role"] == role && m["exit"].is_null() && m["terminating"].is_null())
        .unwrap_or_else(|| panic!("no running {role}: {}", l.get("/status").body))
}

fn post(addr: &str, path: &str) -> Response {
    http(
        addr.parse().unwrap(),
        "POST",
        path,
        None,
        Duration::from_secs(10),
    )
}

/// The decode's KV loop stalls (a wedged channel thread in a live process): the decode
/// turns not ready (`loop_stalled`), and after the window the group resets in place —
/// prefill first, then decode — and serves again without a process started or stopped.
#[test]
fn a_stalled_kv_loop_resets_the_group_in_place_keeping_its_processes() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut l = Local::start("inplace", &with_faults("inplace"));
    assert_chat(&l);
    let (p, d) = (running(&l, "prefill"), running(&l, "decode"));
    let pids = (p["pid"].clone(), d["pid"].clone());
    let r = post(
        d["http"].as_str().unwrap(),
        "/debug/fault?loop=kv_peer_0&fault=stall&ms=30000",
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let fault = Instant::now();
    l.wait_for(
        "the in-place reset to begin",
        Duration::from_secs(30),
        |l| l.group()["phase"] == "Resetting",
    );
    let began = fault.elapsed();
    let took = l.wait_for(
        "the group to be Ready at incarnation 2",
        Duration::from_secs(30),
        |l| {
            let g = l.group();
            g["phase"] == "Ready" && g["incarnation"] == 2
        },
    );
    assert_chat(&l);
    let (p2, d2) = (running(&l, "prefill"), running(&l, "decode"));
    assert_eq!(
        (p2["pid"].clone(), d2["pid"].clone()),
        pids,
        "the same processes"
    );
    assert_eq!(
        (p2["incarnation"].as_i64(), d2["incarnation"].as_i64()),
        (Some(2), Some(2))
    );
    assert_eq!(
        (p2["resets"].as_u64(), d2["resets"].as_u64()),
        (Some(1), Some(1))
    );
    let g = l.group();
    assert_eq!(g["lastCoRestart"]["inPlace"], true, "{g}");
    assert_eq!(g["coRestarts"], 1);
    let record = l.record();
    let reset_of = |pod: &Value| Local::seq(&record, "Reset", pod.as_str().unwrap());
    assert!(reset_of(&p["name"]) < reset_of(&d["name"]), "prefill first");
    assert!(
        record
            .iter()
            .any(|e| e["kind"] == "Event" && e["reason"] == "InPlaceResetCompleted"),
        "{record:#?}"
    );
    assert!(
        !record.iter().any(
            |e| e["kind"] == "Started" && e["seq"].as_u64() > Some(0) && {
                let pod = e["pod"].as_str().unwrap_or_default();
                pod.contains("-i2-")
            }
        ),
        "no member of incarnation 2 was started"
    );
    let text = l.get("/metrics").body;
    assert!(
        text.contains("tandem_operator_in_place_resets_total{outcome=\"completed\"} 1"),
        "{text}"
    );
    println!(
        "in-place reset: co-restart decided {:.1} s after the fault (window {WINDOW} s), group Ready again {:.2} s later",
        began.as_secs_f64(),
        took.as_secs_f64()
    );
}
