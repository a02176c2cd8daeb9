//! Hostile input against a running prefill over its real KV socket: garbage, truncated and
//! unknown frames, other protocol versions, unauthenticated and mis-keyed handshakes, ABORT
//! for unknown rooms. The prefill answers or drops each one, counts it by kind, and keeps
//! serving its decode.

mod common;

use std::sync::Arc;

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
    let mut v2 = ping[0].clone();
    v2[4..6].copy_from_slice(&2u16.to_le_bytes());
    c.raw(&[&v2, &ping[1]]);
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

    // Each kind was counted exactly as often as it was sent.
    let m = |k: &str| {
        prefill.metric(&format!(
            "tandem_kv_malformed_messages_total{{kind=\"{k}\"}} "
        ))
    };
    prefill.wait_for(
        "unexpected type counted",
        std::time::Duration::from_secs(5),
        |_| m("unexpected_type") == 1.0,
    );
    for (kind, n) in [
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
        (1.0, 1.0, 1.0)
    );
    assert_eq!(h("ok"), 2.0, "the real decode and the test client");
    assert_eq!(prefill.metric("tandem_kv_rooms_opened_total "), 0.0);

    // Both processes keep serving.
    assert!(prefill.is_ready() && decode.is_ready());
    let r = decode.post(
        "/v1/completions",
        &json!({"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}
