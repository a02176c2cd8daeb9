//! `/ready` names why a decode's KV channel is down, in the stable format of
//! docs/readiness.md, for every handshake refusal: a wrong group key, another KV layout,
//! another model, another group incarnation, another protocol version. Real processes
//! (and, for the version, a stub prefill speaking version 2).

mod common;

use std::time::Duration;

use common::{OtherModel, Server, free_port, pd_env, start_decode, start_prefill};
use serde_json::Value;
use tandem_dataplane::kv;

/// Check the body against the documented format and return the decode's one peer.
fn check_format(body: &Value, reason: &str) -> Value {
    assert_eq!(body["format"], 1, "{body}");
    assert_eq!(body["ready"], false, "{body}");
    assert_eq!(body["role"], "decode", "{body}");
    assert_eq!(body["reason"], reason, "{body}");
    let message = body["message"].as_str().unwrap();
    assert!(message.starts_with("handshake "), "{body}");
    for c in body["checks"].as_array().unwrap() {
        let ok = c["ok"].as_bool().unwrap();
        assert!(c["name"].is_string() && c["detail"].is_string(), "{c}");
        assert_eq!(
            c["reason"].is_null(),
            ok,
            "a reason exactly when failing: {c}"
        );
    }
    let peers = body["peers"].as_array().unwrap();
    assert_eq!(peers.len(), 1, "{body}");
    let p = peers[0].clone();
    assert!(p["address"].as_str().unwrap().starts_with("127.0.0.1:"));
    assert!(
        ["idle", "handshaking"].contains(&p["state"].as_str().unwrap()),
        "{p}"
    );
    let r = &p["last_refusal"];
    assert_eq!(r["reason"], reason, "{p}");
    assert!(!r["message"].as_str().unwrap().is_empty());
    // RFC 3339 UTC with milliseconds, and its age.
    let at = r["at"].as_str().unwrap();
    assert!(
        at.len() == 24 && at.ends_with('Z') && at.as_bytes()[10] == b'T',
        "{at}"
    );
    assert!(r["age_ms"].as_u64().unwrap() < 60_000, "{r}");
    p
}

fn wait_reason(decode: &Server, reason: &str) -> Value {
    decode.wait_for(reason, Duration::from_secs(60), |s| {
        std::net::TcpStream::connect(s.addr).is_ok() && s.ready_body()["reason"] == reason
    });
    decode.ready_body()
}

#[test]
fn every_refused_handshake_is_named_in_ready_with_its_time() {
    let env = pd_env(&[]);
    let kv = free_port();
    let prefill = start_prefill(kv, &env);
    let other = OtherModel::new();
    let peer = format!("127.0.0.1:{kv}");
    let wrong_key = pd_env(&[("TANDEM_GROUP_KEY", "not-the-key")]);
    let other_group = pd_env(&[("TANDEM_GROUP_INCARNATION", "8")]);
    let cases: Vec<(&str, Server)> = vec![
        (
            "auth_failed",
            Server::spawn(&["--role", "decode", "--prefill", &peer], &[], &wrong_key),
        ),
        (
            "layout_mismatch",
            Server::spawn(
                &["--role", "decode", "--prefill", &peer],
                &["--kv-dtype", "q8_0"],
                &env,
            ),
        ),
        (
            "model_mismatch",
            Server::spawn(
                &["--role", "decode", "--prefill", &peer],
                &["--model", other.path()],
                &env,
            ),
        ),
        (
            "incarnation_mismatch",
            Server::spawn(&["--role", "decode", "--prefill", &peer], &[], &other_group),
        ),
    ];
    for (reason, decode) in &cases {
        let body = wait_reason(decode, reason);
        check_format(&body, reason);
        assert!(
            decode.metric(&format!(
                "tandem_kv_handshakes_total{{result=\"{reason}\"}} "
            )) >= 1.0,
            "{reason} not counted"
        );
        assert_eq!(decode.get("/health").status, 200, "liveness is unaffected");
    }
    // The prefill stays ready and names the last decode it refused. A decode shows its
    // refusal before its REJECT reaches the prefill, whose report follows within
    // `REPORT_EVERY` (100 ms): when all four are refused at once, the check above can come
    // first, so this waits (a missing refusal still fails, with the log).
    assert!(prefill.is_ready());
    let named = |p: &Server| {
        p.ready_body()["peers"].as_array().is_some_and(|peers| {
            peers
                .iter()
                .any(|p| p["last_refusal"]["reason"].is_string())
        })
    };
    let waited = prefill.wait_for(
        "the prefill names a refused decode",
        Duration::from_secs(5),
        named,
    );
    eprintln!("the prefill named a refused decode {waited:?} after the last decode did");
    assert!(prefill.is_ready());

    // A good decode next to them is ready: the refusals were about those peers only.
    let good = start_decode(&[kv], &env, true);
    let body = good.ready_body();
    assert_eq!(body["ready"], true, "{body}");
    assert!(
        body["reason"].is_null() && body["message"].is_null(),
        "{body}"
    );
    assert_eq!(body["peers"][0]["state"], "established");
}

/// A prefill of another protocol version: the decode cannot even parse its answer, and
/// says so (`version_mismatch`) instead of "handshaking".
#[test]
fn a_prefill_of_another_protocol_version_is_named() {
    let env = pd_env(&[]);
    let kv = free_port();
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).unwrap();
    router.set_rcvtimeo(60_000).unwrap();
    router.set_linger(0).unwrap();
    router.bind(&format!("tcp://127.0.0.1:{kv}")).unwrap();
    let decode = start_decode(&[kv], &env, false);
    let hello = router.recv_multipart(0).expect("the decode's HELLO");
    // An answer from version 2: same magic and layout of the first bytes, older version.
    let [mut h, p] = kv::encode(&kv::Envelope {
        incarnation: 5,
        group_incarnation: 7,
        room: 0,
        msg: kv::Message::Accepted,
    });
    h[4..6].copy_from_slice(&2u16.to_le_bytes());
    router
        .send_multipart([hello[0].as_slice(), &h, &p], 0)
        .unwrap();
    let body = wait_reason(&decode, "version_mismatch");
    let peer = check_format(&body, "version_mismatch");
    assert!(decode.metric("tandem_kv_handshakes_total{result=\"version_mismatch\"} ") >= 1.0);
    let msg = peer["last_refusal"]["message"].as_str().unwrap();
    assert!(
        msg.contains("version 2") && msg.contains(&format!("{}", kv::PROTOCOL_VERSION)),
        "{msg}"
    );
}
