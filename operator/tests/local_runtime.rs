//! The local runtime end to end: the real `tandem-operator local` binary running the
//! example manifest (`manifests/examples/smollm2-local.yaml`, with short probe periods and
//! windows so the tests take seconds), real `tandem-dataplane` processes serving the real
//! model, real HTTP. Faults are real signals sent by PID; "no process left" is checked by
//! PID and process group.
//!
//! Needs `target/<profile>/tandem-dataplane` next to the operator binary, built from the
//! current sources (`make test` builds it first; so does `cargo test --workspace`).
//! The tests run one at a time: each starts two model processes, and two cores are not
//! enough to run several runtimes side by side with one-second probes.

use std::process::Command;
use std::time::{Duration, Instant};

use common::local::*;
use nix::sys::signal::Signal;
use serde_json::Value;

mod common;

#[test]
fn a_killed_decode_co_restarts_its_group_prefill_first_and_serving_resumes() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let l = Local::start("kill", &manifest("kill", |_| {}));
    let p1 = l.member("prefill", 1);
    let d1 = l.member("decode", 1);

    // A chat request, and the same streamed: SSE events through the router.
    let content = assert_chat(&l);
    let r = l.chat(true);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-tandem-pod"), Some(name_of(&d1).as_str()));
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream")),
        "{:?}",
        r.headers
    );
    let events: Vec<&str> = r
        .body
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{}", r.body);
    let streamed: String = events
        .iter()
        .filter(|e| **e != "[DONE]")
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(
        streamed, content,
        "greedy: streamed and whole answers agree"
    );

    // SIGKILL of the decode; the endpoint answers 503 (never hangs) until the group is
    // back, then serves again.
    signal(pid_of(&d1), Signal::SIGKILL);
    let killed = Instant::now();
    let mut saw_503 = false;
    let recovery = loop {
        let r = l.chat(false);
        match r.status {
            200 => break killed.elapsed(),
            503 => {
                let v = r.json();
                // Until the runtime has seen the exit, the dead decode is still listed and
                // refuses the connection; after that, no group is ready.
                match v["error"]["code"].as_str() {
                    Some("upstream_unreachable") => {}
                    Some("no_ready_group") => {
                        let msg = v["error"]["message"].as_str().unwrap();
                        assert!(msg.contains("group 0"), "{v}");
                        saw_503 = true;
                    }
                    _ => panic!("unexpected 503: {v}"),
                }
            }
            // The request that raced the kill: the decode accepted and died.
            502 if r.json()["error"]["code"] == "upstream_failed" => {}
            s => panic!("unexpected {s}: {}", r.body),
        }
        assert!(
            killed.elapsed() < Duration::from_secs(120),
            "not serving again; log:\n{}",
            l.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    println!(
        "local_runtime: SIGKILL of the decode → serving again after {:.2} s (co-restart, new prefill ready, new decode ready, first answer)",
        recovery.as_secs_f64()
    );
    assert!(saw_503, "requests got 503 while the group was down");

    let g = l.group();
    assert_eq!(g["incarnation"], 2, "{g}");
    assert_eq!(g["coRestarts"], 1, "{g}");
    assert_eq!(g["lastCoRestart"]["reason"], "MemberFailed", "{g}");
    assert_eq!(g["phase"], "Ready", "{g}");
    let p2 = l.member("prefill", 2);
    let d2 = l.member("decode", 2);
    assert_eq!(l.members().len(), 2, "only the new incarnation runs");
    assert!(!alive(pid_of(&p1)), "the old prefill is gone");

    // The order, from the runtime's record.
    let rec = l.record();
    let (p1, d1, p2, d2) = (name_of(&p1), name_of(&d1), name_of(&p2), name_of(&d2));
    let exited_d1 = Local::seq(&rec, "Exited", &d1);
    let removed_d1 = Local::seq(&rec, "Removed", &d1);
    let term_p1 = Local::seq(&rec, "Terminating", &p1);
    let exited_p1 = Local::seq(&rec, "Exited", &p1);
    let started_p2 = Local::seq(&rec, "Started", &p2);
    let ready_p2 = Local::seq(&rec, "Ready", &p2);
    let started_d2 = Local::seq(&rec, "Started", &d2);
    let gate_d2 = Local::seq(&rec, "GateOpened", &d2);
    let order = [
        exited_d1, removed_d1, term_p1, exited_p1, started_p2, ready_p2, started_d2, gate_d2,
    ];
    assert!(
        order.windows(2).all(|w| w[0] < w[1]),
        "decode gone, then prefill stopped, then prefill started and ready, then decode: {order:?}\n{rec:#?}"
    );
    let co_restart = rec
        .iter()
        .find(|e| e["kind"] == "Event" && e["reason"] == "MemberFailed")
        .expect("a MemberFailed event");
    let seq = co_restart["seq"].as_u64().unwrap();
    assert!(exited_d1 < seq && seq < term_p1, "{rec:#?}");
    assert!(
        co_restart["message"]
            .as_str()
            .unwrap()
            .contains("incarnation 1 → 2"),
        "{co_restart}"
    );
    // The same count the operator exports.
    let metrics = l.get("/metrics").body;
    assert!(
        metrics.contains("tandem_operator_co_restarts_total{reason=\"MemberFailed\"} 1"),
        "{metrics}"
    );
    assert_chat(&l);
}

#[test]
fn a_stopped_prefill_makes_the_group_unavailable_then_co_restarts_it_after_the_window() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut l = Local::start(
        "stop",
        &manifest("stop", |m| {
            m["spec"]["health"]["unresponsiveGraceSeconds"] =
                serde_yaml::Value::Number(UNRESPONSIVE_GRACE.into());
        }),
    );
    assert_chat(&l);
    let p1 = l.member("prefill", 1);
    let d1 = l.member("decode", 1);

    // SIGSTOP: alive, accepts connections, answers nothing — the wedge.
    signal(pid_of(&p1), Signal::SIGSTOP);
    let stopped = Instant::now();
    let d1_name = name_of(&d1);
    l.wait_for("the decode to go not ready", Duration::from_secs(30), |l| {
        l.members()
            .iter()
            .any(|m| m["name"] == d1_name.as_str() && m["readiness"]["ready"] == false)
    });
    // Traffic is refused at once with the reason, not left hanging on the wedged pair.
    let asked = Instant::now();
    let r = l.chat(false);
    let took = asked.elapsed();
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(took < Duration::from_secs(3), "503 took {took:?}");
    let v = r.json();
    assert_eq!(v["error"]["code"], "no_ready_group", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.starts_with("no group is ready: group 0"), "{msg}");

    // The co-restart comes after the window, not before.
    l.wait_for("the co-restart", Duration::from_secs(60), |l| {
        l.group()["incarnation"] == 2
    });
    let co_restart_after = stopped.elapsed();
    assert!(
        co_restart_after >= Duration::from_secs(WINDOW),
        "co-restarted {co_restart_after:?} after SIGSTOP, window {WINDOW}s"
    );
    assert_eq!(l.group()["lastCoRestart"]["reason"], "MemberNotReady");
    // The stopped prefill ignores SIGTERM: it is SIGKILLed after the short grace of an
    // unresponsive member, not the runtime's grace; the decode, its healthy peer, was
    // given the full grace (and exited at SIGTERM).
    let p1_name = name_of(&p1);
    l.wait_for(
        "the stopped prefill to be killed",
        Duration::from_secs(GRACE + 30),
        |l| {
            l.record()
                .iter()
                .any(|e| e["kind"] == "Exited" && e["pod"] == p1_name.as_str())
        },
    );
    let rec = l.record();
    assert!(Local::seq(&rec, "Killed", &p1_name) > Local::seq(&rec, "Terminating", &p1_name));
    assert!(Local::seq(&rec, "Exited", &d1_name) < Local::seq(&rec, "Terminating", &p1_name));
    assert!(!alive(pid_of(&p1)));
    let entry = |kind: &str, pod: &str| {
        rec.iter()
            .find(|e| e["kind"] == kind && e["pod"] == pod)
            .unwrap_or_else(|| panic!("no {kind} entry for {pod}"))
            .clone()
    };
    let at = |e: &Value| -> k8s_openapi::jiff::Timestamp {
        e["time"].as_str().unwrap().parse().unwrap()
    };
    let term_p = entry("Terminating", &p1_name);
    let term_d = entry("Terminating", &d1_name);
    let msg = |e: &Value| e["message"].as_str().unwrap().to_string();
    assert!(
        msg(&term_p).contains(&format!("SIGKILL after {UNRESPONSIVE_GRACE}s"))
            && msg(&term_p).contains("unresponsive"),
        "{}",
        msg(&term_p)
    );
    assert!(
        msg(&term_d).contains(&format!("SIGKILL after {GRACE}s")),
        "{}",
        msg(&term_d)
    );
    let killed_after = at(&entry("Killed", &p1_name))
        .duration_since(at(&term_p))
        .as_secs_f64();
    assert!(
        (UNRESPONSIVE_GRACE as f64..GRACE as f64).contains(&killed_after),
        "the stopped prefill was killed {killed_after:.2}s after SIGTERM: short grace {UNRESPONSIVE_GRACE}s, full {GRACE}s"
    );
    let recovered = l.wait_for("serving again", Duration::from_secs(120), |l| {
        l.get("/ready").status == 200
    });
    println!(
        "local_runtime: SIGSTOP of the prefill → co-restart after {:.1} s (window {WINDOW} s), the stopped prefill SIGKILLed {killed_after:.2} s after its SIGTERM (unresponsiveGraceSeconds {UNRESPONSIVE_GRACE}, full grace {GRACE} s), serving again {:.1} s later",
        co_restart_after.as_secs_f64(),
        recovered.as_secs_f64()
    );
    assert_chat(&l);

    // SIGKILL of the runtime itself: its members die with it.
    let members: Vec<i64> = l.members().iter().map(pid_of).collect();
    assert_eq!(members.len(), 2);
    for &pid in &members {
        assert!(
            alive(pid) && group_alive(pid),
            "member {pid} runs in its own group"
        );
    }
    signal(l.child.id() as i64, Signal::SIGKILL);
    l.wait_exit(Duration::from_secs(5));
    let start = Instant::now();
    while members.iter().any(|&p| alive(p) || group_alive(p)) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "members outlived the SIGKILLed runtime: {:?}",
            members.iter().filter(|&&p| alive(p)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_spec_edit_rolls_the_group_and_an_invalid_edit_keeps_it_serving() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut l = Local::start("edit", &manifest("edit", |_| {}));
    assert_chat(&l);
    let p1 = name_of(&l.member("prefill", 1));
    let d1 = name_of(&l.member("decode", 1));

    // An invalid edit: named in the status, the running spec stays.
    let bad = manifest("edit", |m| {
        m["spec"]["health"]["probePeriodSeconds"] = 0.into();
    });
    std::fs::write(&l.file, bad).unwrap();
    l.wait_for(
        "the invalid edit to be reported",
        Duration::from_secs(15),
        |l| {
            l.status()["specError"].as_str().is_some_and(|e| {
                e.contains("spec.health.probePeriodSeconds: 0 is less than the minimum 1")
            })
        },
    );
    assert_eq!(l.status()["generation"], 1);
    assert_chat(&l);
    assert_eq!(l.group()["incarnation"], 1);

    // A valid pod-shaping edit rolls the group: decode first down, prefill first up.
    let good = manifest("edit", |m| {
        m["spec"]["decode"]["args"] =
            serde_yaml::from_str("[--kv-blocks, '128', --max-batch, '4']").unwrap();
    });
    std::fs::write(&l.file, good).unwrap();
    l.wait_for("the rolled group to serve", Duration::from_secs(120), |l| {
        let g = l.group();
        g["incarnation"] == 2 && g["phase"] == "Ready"
    });
    let st = l.status();
    assert_eq!(st["generation"], 2);
    assert!(st["specError"].is_null(), "{}", st["specError"]);
    assert_eq!(l.group()["lastCoRestart"]["reason"], "RevisionChanged");
    let d2 = l.member("decode", 2);
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", pid_of(&d2))).unwrap();
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    assert!(
        args.windows(2).any(|w| w == ["--max-batch", "4"]),
        "{args:?}"
    );
    let p2 = name_of(&l.member("prefill", 2));
    let rec = l.record();
    let order = [
        Local::seq(&rec, "Terminating", &d1),
        Local::seq(&rec, "Exited", &d1),
        Local::seq(&rec, "Terminating", &p1),
        Local::seq(&rec, "Exited", &p1),
        Local::seq(&rec, "Started", &p2),
        Local::seq(&rec, "Started", &name_of(&d2)),
    ];
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}\n{rec:#?}");
    assert_chat(&l);

    // SIGTERM of the runtime: every member stops, the runtime exits 0.
    let members: Vec<i64> = l.members().iter().map(pid_of).collect();
    signal(l.child.id() as i64, Signal::SIGTERM);
    let st = l.wait_exit(Duration::from_secs(GRACE * 2 + 10));
    assert!(st.success(), "exit status {st}; log:\n{}", l.log());
    for p in members {
        assert!(
            !alive(p) && !group_alive(p),
            "member {p} outlived the runtime"
        );
    }
    let log = l.log();
    assert!(log.contains("every member has exited"), "{log}");
}

#[test]
fn a_manifest_a_cluster_would_refuse_is_refused_before_anything_starts() {
    let dir = std::env::temp_dir().join(format!("tandem-local-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("m.yaml");
    let cases = [
        (
            manifest("llama-3.1-8b", |_| {}),
            "metadata.name \"llama-3.1-8b\": '.' is not allowed",
        ),
        (
            manifest("ok", |m| m["spec"]["groups"] = (-1).into()),
            "spec.groups: -1 is less than the minimum 0",
        ),
        (
            manifest("ok", |m| {
                m["spec"]["model"]["path"] = "/nowhere/m.gguf".into()
            }),
            "spec.model.path: no model file \"/nowhere/m.gguf\"",
        ),
    ];
    for (text, want) in cases {
        std::fs::write(&file, text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_tandem-operator"))
            .args(["local", "-f"])
            .arg(&file)
            .args(["--port", "0"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains(want), "{want:?} not in {err}");
        assert!(
            err.contains(&file.display().to_string()),
            "names the file: {err}"
        );
    }
    std::fs::write(&file, manifest("ok", |_| {})).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tandem-operator"))
        .args(["local", "-f"])
        .arg(&file)
        .args(["--port", "0", "--dataplane", "/nowhere/tandem-dataplane"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("/nowhere/tandem-dataplane")
            && err.contains("cargo build --release -p tandem-dataplane"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_decode_with_the_wrong_group_key_says_auth_failed_in_the_group_status() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // The decode's own `--group-key` comes after the operator's variable and wins: it
    // holds another key than its prefill.
    let m = manifest("wrongkey", |m| {
        m["spec"]["decode"]["args"] =
            serde_yaml::from_str("[--kv-blocks, '128', --group-key, not-the-group-key]").unwrap();
    });
    let mut l = Local::spawn("wrongkey", &m);
    let took = l.wait_for(
        "auth_failed in the group status",
        Duration::from_secs(180),
        |l| l.group()["decodeNotReady"]["reason"] == "auth_failed",
    );
    eprintln!("runtime start → auth_failed in the status: {took:?}");
    let st = l.status();
    let g = &st["status"]["groupStatuses"][0];
    let d = l.member("decode", 1);
    assert_eq!(g["decodeNotReady"]["pod"], name_of(&d), "{g:#}");
    assert_eq!(g["phase"], "StartingDecode", "{g:#}");
    let message = g["message"].as_str().unwrap();
    assert!(
        message.starts_with(&format!(
            "decode pod {}: auth_failed: handshake 127.0.0.1:",
            name_of(&d)
        )),
        "{message}"
    );
    let c = st["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "BootstrapHealthy")
        .unwrap()
        .clone();
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("False"), Some("auth_failed")),
        "{c:#}"
    );
    assert!(
        c["message"]
            .as_str()
            .unwrap()
            .contains(&format!("group 0 decode pod {}: auth_failed:", name_of(&d))),
        "{c:#}"
    );
    // Nothing serves, and the record says why.
    assert_eq!(l.get("/ready").status, 503);
    assert!(
        l.record().iter().any(|e| e["kind"] == "NotReady"
            && e["pod"] == name_of(&d).as_str()
            && e["message"].as_str().unwrap().contains("auth_failed")),
        "{:#?}",
        l.record()
    );
}
