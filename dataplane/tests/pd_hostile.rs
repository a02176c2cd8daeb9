//! Hostile input against a running prefill over its real KV socket: garbage, truncated and
//! unknown frames, other protocol versions, unauthenticated and mis-keyed handshakes, ABORT
//! for unknown rooms. The prefill answers or drops each one, counts it by kind, and keeps
//! serving its decode.

mod common;

use std::sync::Arc;
use tandem_dataplane::sampling::SamplingParams;

use common::{GROUP_KEY, MODEL_NAME, free_port, model_path, pd_env, start_decode, start_prefill};
use serde_json::json;
use tandem_dataplane::engine_api::ModelRunner;
use tandem_dataplane::gguf::Gguf;
use tandem_dataplane::kv::auth::{GroupKey, Initiator, LocalIdentity};
use tandem_dataplane::kv::{self, Envelope, KvLayout, Message, RejectReason};
use tandem_dataplane::model::{CpuModelRunner, KvCacheConfig, RunnerConfig};

/// What a legitimate decode of this model claims (computed from the model, as the binary does).
fn identity() -> LocalIdentity {
    let g = Arc::new(Gguf::open(&model_path()).unwrap());
    let rc = RunnerConfig {
        kv: KvCacheConfig {
            n_blocks: 1,
            ..KvCacheConfig::default()
        },
        ..RunnerConfig::default()
    };
    let r = CpuModelRunner::new(g, rc, tandem_kernels::best_backend()).unwrap();
    let info = r.info();
    LocalIdentity {
        incarnation: 1234,
        group_incarnation: 7,
        fingerprint: info.fingerprint.clone(),
        layout: KvLayout {
            dtype: r.kv_config().dtype.id(),
            layers: info.n_layers as u32,
            kv_heads: info.n_kv_heads as u32,
            head_dim: info.head_dim as u32,
            block_size: info.kv_block_size as u32,
        },
    }
}

struct Client {
    sock: zmq::Socket,
    _ctx: zmq::Context,
}

impl Client {
    fn connect(port: u16) -> Self {
        let ctx = zmq::Context::new();
        let sock = ctx.socket(zmq::DEALER).unwrap();
        sock.set_rcvtimeo(5000).unwrap();
        sock.set_linger(0).unwrap();
        sock.connect(&format!("tcp://127.0.0.1:{port}")).unwrap();
        Self { sock, _ctx: ctx }
    }
    fn raw(&self, frames: &[&[u8]]) {
        self.sock.send_multipart(frames, 0).unwrap();
    }
    fn send(&self, env: &Envelope) {
        let [h, p] = kv::encode(env);
        self.raw(&[&h, &p]);
    }
    fn recv(&self) -> Envelope {
        let f = self.sock.recv_multipart(0).expect("a reply");
        kv::decode(&[&f[0], &f[1]]).unwrap()
    }
    fn expect_reject(&self, want: RejectReason) {
        match self.recv().msg {
            Message::Reject { reason, .. } => assert_eq!(reason, want),
            other => panic!("expected REJECT {want:?}, got {other:?}"),
        }
    }
}

fn env(me: &LocalIdentity, room: u64, msg: Message) -> Envelope {
    Envelope {
        incarnation: me.incarnation,
        group_incarnation: me.group_incarnation,
        room,
        msg,
    }
}

#[test]
fn hostile_input_is_counted_by_kind_and_serving_continues() {
    let pd = pd_env(&[]);
    let port = free_port();
    let prefill = start_prefill(port, &pd);
    let decode = start_decode(&[port], &pd, true);
    let me = identity();
    let key = GroupKey::new(GROUP_KEY.as_bytes());
    let c = Client::connect(port);

    // Garbage that is dropped silently (counted): wrong frame count, bad magic, a cut
    // header, an unknown type, a payload shorter than the header says.
    let ping = kv::encode(&env(
        &me,
        0,
        Message::Ping {
            nonce: 1,
            timestamp_us: 2,
        },
    ));
    c.raw(&[b"just one frame"]);
    c.raw(&[b"XXXXjunkjunkjunkjunkjunkjunkjunkjunk", b""]);
    c.raw(&[b"TK", b""]);
    let mut unknown = ping[0].clone();
    unknown[6] = 99;
    c.raw(&[&unknown, &ping[1]]);
    c.raw(&[&ping[0], &ping[1][..5]]);
    // Another protocol version is refused with the reason.
    let mut other = ping[0].clone();
    other[4..6].copy_from_slice(&(kv::PROTOCOL_VERSION + 1).to_le_bytes());
    c.raw(&[&other, &ping[1]]);
    c.expect_reject(RejectReason::VersionMismatch);
    // Room messages before a handshake: refused, no state.
    c.send(&env(&me, 77, Message::Abort));
    c.expect_reject(RejectReason::NotAuthenticated);
    // Handshakes claiming another model, another group incarnation, or a wrong key.
    let init = Initiator::new([5; 32]);
    let mut other_model = me.clone();
    other_model.fingerprint = "0".repeat(64);
    c.send(&env(&me, 0, init.hello(&other_model)));
    c.expect_reject(RejectReason::ModelMismatch);
    let mut other_group = me.clone();
    other_group.group_incarnation = 8;
    c.send(&env(&other_group, 0, init.hello(&other_group)));
    c.expect_reject(RejectReason::IncarnationMismatch);
    c.send(&env(&me, 0, init.hello(&me)));
    let welcome = c.recv();
    let wrong = GroupKey::new(*b"guessed key");
    // With the wrong key the decode side cannot verify the prefill's proof...
    let verify = init.on_welcome(&me, &wrong, welcome.incarnation, 7, &welcome.msg);
    assert_eq!(verify.unwrap_err().0, RejectReason::AuthFailed);
    // ...and a forged AUTH is refused by the prefill.
    c.send(&env(&me, 0, Message::Auth { mac: [0xAB; 32] }));
    c.expect_reject(RejectReason::AuthFailed);

    // With the right key: authenticated; ABORT for an unknown room is acknowledged and
    // changes nothing; PING is answered; a message a prefill never expects is dropped.
    c.send(&env(&me, 0, init.hello(&me)));
    let welcome = c.recv();
    let (auth, _) = init
        .on_welcome(&me, &key, welcome.incarnation, 7, &welcome.msg)
        .unwrap();
    c.send(&env(&me, 0, auth));
    assert_eq!(c.recv().msg, Message::Accepted);
    c.send(&env(&me, 4242, Message::Abort));
    let ack = c.recv();
    assert_eq!((ack.room, ack.msg), (4242, Message::AbortAck));
    c.send(&env(
        &me,
        0,
        Message::Ping {
            nonce: 9,
            timestamp_us: 1,
        },
    ));
    assert_eq!(
        c.recv().msg,
        Message::Pong {
            nonce: 9,
            timestamp_us: 1
        }
    );
    c.send(&env(&me, 5, Message::AbortAck));
    // A KV chunk sent to the prefill (only decodes receive KV): dropped, counted.
    c.send(&env(
        &me,
        6,
        Message::KvChunk(kv::KvChunk {
            index: 0,
            count: 1,
            first_layer: 0,
            end_layer: 1,
            offset: 0,
            total: 4,
            crc32: kv::checksum::crc32c(b"kv!!"),
            data: b"kv!!".to_vec(),
        }),
    ));
    // A frame beyond the protocol's payload limit (that libzmq still delivers): counted.
    let mut big = ping[0].clone();
    let over = kv::MAX_PAYLOAD + 8;
    big[32..36].copy_from_slice(&(over as u32).to_le_bytes());
    c.raw(&[&big, &vec![0u8; over]]);
    // The same authenticated peer claiming another model in a new handshake: refused, and
    // its session is left as it was.
    c.send(&env(&me, 0, init.hello(&other_model)));
    c.expect_reject(RejectReason::ModelMismatch);
    // Duplicate room ids: a second PREFILL for a live room, then (after its KV and DONE
    // came back) a PREFILL for the finished room. Neither disturbs the room.
    let prefill_req = |n: u32| {
        Message::Prefill(kv::PrefillRequest {
            tokens: (0..n).map(|i| 100 + i % 1000).collect(),
            sampling: greedy(),
            ..Default::default()
        })
    };
    c.send(&env(&me, 900, prefill_req(200)));
    c.send(&env(&me, 900, prefill_req(3)));
    let mut chunks = 0;
    loop {
        let e = c.recv();
        assert_eq!(e.room, 900, "{e:?}");
        match e.msg {
            Message::KvChunk(_) => chunks += 1,
            // Keep-alives while the prompt is prefilled.
            Message::Progress { .. } => {}
            Message::Done { prompt_tokens, .. } => {
                assert_eq!(
                    prompt_tokens, 200,
                    "the first PREFILL ran, not the duplicate"
                );
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(chunks >= 1);
    c.send(&env(&me, 900, prefill_req(3)));
    // Still served after all that.
    c.send(&env(
        &me,
        0,
        Message::Ping {
            nonce: 10,
            timestamp_us: 1,
        },
    ));
    assert_eq!(
        c.recv().msg,
        Message::Pong {
            nonce: 10,
            timestamp_us: 1
        },
        "the finished-room PREFILL got no answer; the PING did"
    );
    // A frame far beyond the limit: libzmq cuts that connection before we see a byte
    // (`maxmsgsize`); the prefill itself is unaffected.
    let c2 = Client::connect(port);
    let huge = kv::MAX_PAYLOAD + (1 << 20);
    big[32..36].copy_from_slice(&(huge as u32).to_le_bytes());
    c2.raw(&[&big, &vec![0u8; huge]]);
    drop(c2);

    // Each kind was counted exactly as often as it was sent.
    let m = |k: &str| {
        prefill.metric(&format!(
            "tandem_kv_malformed_messages_total{{kind=\"{k}\"}} "
        ))
    };
    prefill.wait_for(
        "unexpected type counted",
        std::time::Duration::from_secs(5),
        |_| m("finished_room") == 1.0,
    );
    for (kind, n) in [
        ("unexpected_type", 2.0),
        ("oversized", 1.0),
        ("duplicate_room", 1.0),
        ("frame_count", 1.0),
        ("bad_magic", 1.0),
        ("truncated", 1.0),
        ("unknown_type", 1.0),
        ("bad_length", 1.0),
        ("wrong_version", 1.0),
        ("unauthenticated", 1.0),
    ] {
        assert_eq!(m(kind), n, "{kind}: {}", prefill.get("/metrics").body);
    }
    let h = |r: &str| prefill.metric(&format!("tandem_kv_handshakes_total{{result=\"{r}\"}} "));
    assert_eq!(
        (
            h("model_mismatch"),
            h("incarnation_mismatch"),
            h("auth_failed")
        ),
        (2.0, 1.0, 1.0)
    );
    assert_eq!(
        h("version_mismatch"),
        1.0,
        "the other version was refused and counted"
    );
    assert_eq!(h("ok"), 2.0, "the real decode and the test client");
    // One room (the first PREFILL for 900), done; the duplicates opened nothing.
    assert_eq!(prefill.metric("tandem_kv_rooms_opened_total "), 1.0);
    assert_eq!(
        prefill.metric("tandem_kv_rooms_total{state=\"done\",reason=\"none\"} "),
        1.0
    );

    // Both processes keep serving.
    assert!(prefill.is_ready() && decode.is_ready());
    let r = decode.post(
        "/v1/completions",
        &json!({"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

/// Write `bytes` to a fresh connection (half-closing when asked) and return the status
/// line of whatever the server answers ("" when it closes without answering).
fn raw_http(addr: std::net::SocketAddr, bytes: &[u8], half_close: bool) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    // The server may answer (and close) before taking everything: ignore write errors.
    let _ = s.write_all(bytes);
    if half_close {
        let _ = s.shutdown(std::net::Shutdown::Write);
    }
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out)
        .lines()
        .next()
        .unwrap_or("")
        .to_owned()
}

#[test]
fn http_ports_of_both_roles_survive_hostile_input_and_count_it() {
    let pd = pd_env(&[]);
    let port = free_port();
    let prefill = start_prefill(port, &pd);
    let decode = start_decode(&[port], &pd, true);
    let post = |body: &str, declared: usize| {
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {declared}\r\n\r\n{body}"
        )
    };
    for s in [&prefill, &decode] {
        let a = s.addr;
        // Raw garbage (a TLS ClientHello prefix and binary): hyper answers 400 and closes.
        let garbage = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\xff\xfe garbage\r\n\r\n";
        assert!(raw_http(a, garbage, false).contains(" 400"), "garbage");
        // A request cut inside its head, then the client half-closes.
        assert_eq!(
            raw_http(
                a,
                b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Le",
                true
            ),
            "",
            "no answer to a truncated head"
        );
        // A body shorter than its Content-Length, then the client half-closes.
        raw_http(a, post("{\"model\": \"x\"", 100).as_bytes(), true);
        // A 1 MiB header.
        let big = format!(
            "GET /health HTTP/1.1\r\nHost: t\r\nX-Big: {}\r\n\r\n",
            "a".repeat(1 << 20)
        );
        assert!(
            raw_http(a, big.as_bytes(), false).contains(" 431"),
            "big header"
        );
        // A body declared beyond the 8 MiB limit: refused before it is read.
        assert!(
            raw_http(a, post("", 9 << 20).as_bytes(), false).contains(" 413"),
            "big body"
        );
        // Malformed JSON, a non-object, wrong types.
        for (body, want) in [
            ("{not json", "invalid_json"),
            ("[1, 2]", "not_an_object"),
            (
                &*json!({"model": MODEL_NAME, "prompt": "Hi", "max_tokens": "ten"}).to_string(),
                "invalid_type",
            ),
            (
                &*json!({"model": MODEL_NAME, "prompt": "Hi", "stream": 3}).to_string(),
                "invalid_type",
            ),
        ] {
            let r = common::request(a, "POST", "/v1/completions", Some(body));
            assert_eq!(r.status, 400, "{body}: {}", r.body);
            assert_eq!(r.json()["error"]["code"], want, "{}", r.body);
        }
        // Each kind counted.
        let conn = |k: &str| {
            s.metric(&format!(
                "tandem_http_connection_errors_total{{kind=\"{k}\"}} "
            ))
        };
        let rej = |k: &str| {
            s.metric(&format!(
                "tandem_http_rejected_requests_total{{reason=\"{k}\"}} "
            ))
        };
        s.wait_for(
            "connection errors counted",
            std::time::Duration::from_secs(5),
            |_| conn("parse_error") == 1.0 && conn("header_too_large") == 1.0,
        );
        let body = s.get("/metrics").body;
        assert_eq!(conn("incomplete_request"), 1.0, "{body}");
        assert_eq!(rej("body_read_error"), 1.0, "{body}");
        assert_eq!(rej("body_too_large"), 1.0, "{body}");
        assert_eq!(rej("invalid_json"), 1.0, "{body}");
        assert_eq!(rej("not_an_object"), 1.0, "{body}");
        assert_eq!(rej("invalid_type"), 2.0, "{body}");
        // Still live and ready.
        assert_eq!(s.get("/health").status, 200);
        assert!(s.is_ready(), "{}", s.get("/ready").body);
    }
    // And a real request completes through both.
    let r = decode.post(
        "/v1/completions",
        &json!({"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        prefill.metric("tandem_kv_rooms_total{state=\"done\",reason=\"none\"} "),
        1.0
    );
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..Default::default()
    }
}
