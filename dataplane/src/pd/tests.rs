//! In-process tests of the PD loops with real ZeroMQ sockets: supervision and readiness
//! (rule 3) and bounded, non-blocking sends (rule 10); rules as numbered in
//! `docs/architecture.md`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::supervise::Fault;
use super::{Check, PdRole, decode, local_identity, wire};
use crate::config::PdTimings;
use crate::engine_api::ModelInfo;
use crate::kv::auth::GroupKey;
use crate::kv::{Envelope, Message};
use crate::metrics::Metrics;

fn info() -> ModelInfo {
    ModelInfo {
        name: "test".into(),
        vocab_size: 32,
        context_length: 64,
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 4,
        kv_block_size: 16,
        fingerprint: "00ff".into(),
    }
}

fn loop_check(role: &PdRole) -> Check {
    role.checks()
        .into_iter()
        .find(|c| c.name.starts_with("loop_"))
        .expect("a loop check in /ready")
}

/// Drain everything the stub prefill received; returns how many messages.
fn drain(sock: &zmq::Socket) -> usize {
    let mut n = 0;
    while wire::try_recv(sock).is_some() {
        n += 1;
    }
    n
}

fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

#[test]
fn rule3_stuck_kv_loop_flips_ready_within_one_probe_period_and_a_panicking_loop_restarts() {
    // A stub prefill: a ROUTER that never answers, so the real decode loop keeps sending
    // HELLO (one per bootstrap timeout) — observable proof that the loop is running.
    let ctx = zmq::Context::new();
    let stub = ctx.socket(zmq::ROUTER).unwrap();
    stub.set_linger(0).unwrap();
    stub.bind("tcp://127.0.0.1:*").unwrap();
    let ep = stub.get_last_endpoint().unwrap().unwrap();
    let addr = ep.trim_start_matches("tcp://").to_owned();

    let probe_period = Duration::from_millis(500);
    let timings = PdTimings {
        probe_period,
        failure_threshold: 2,
        bootstrap_timeout: Duration::from_millis(200),
        kv_timeout: Duration::from_secs(5),
    };
    let metrics = Arc::new(Metrics::new());
    let client = decode::start(
        std::slice::from_ref(&addr),
        local_identity(&info(), 0, super::random_id(), 7),
        GroupKey::new(b"k".to_vec()),
        timings,
        &info(),
        metrics.clone(),
    )
    .unwrap();
    let health = client.loop_health(0);
    let role = PdRole::Decode(client);

    // Healthy: the loop beats and talks to the peer.
    assert!(loop_check(&role).ok, "{:?}", loop_check(&role));
    assert!(
        wait_until(Duration::from_secs(3), || drain(&stub) > 0),
        "the decode loop never sent a HELLO"
    );

    // Stall the loop (as a blocking call would) and time how long until not-ready.
    health.inject(Fault::Stall(Duration::from_millis(1500)));
    assert!(wait_until(Duration::from_secs(1), || health
        .stalled_at()
        .is_some()));
    let stalled_at = health.stalled_at().unwrap();
    assert!(
        wait_until(Duration::from_secs(3), || !loop_check(&role).ok),
        "a stuck loop never turned /ready not-ready"
    );
    let flipped_after = stalled_at.elapsed();
    let tolerance = Duration::from_millis(150);
    assert!(
        flipped_after <= probe_period + tolerance,
        "not-ready only after {flipped_after:?} (probe period {probe_period:?})"
    );
    let c = loop_check(&role);
    assert_eq!(c.name, "loop_kv_peer_0");
    assert!(c.detail.contains("heartbeat"), "{c:?}");
    // The failing check is what makes /ready fail.
    assert!(
        role.checks()
            .iter()
            .any(|c| !c.ok && c.name == "loop_kv_peer_0")
    );

    // The stall ends: ready again, without a restart.
    assert!(wait_until(Duration::from_secs(3), || loop_check(&role).ok));
    assert_eq!(health.restarts(), 0);

    // A panic: counted, the loop restarts and keeps working the socket.
    drain(&stub);
    health.inject(Fault::Panic);
    assert!(
        wait_until(Duration::from_secs(3), || health.restarts() == 1),
        "the panic was not counted"
    );
    assert!(
        metrics
            .encode()
            .contains("tandem_kv_loop_restarts_total{loop=\"kv_peer_0\"} 1"),
        "{}",
        metrics.encode()
    );
    drain(&stub);
    assert!(
        wait_until(Duration::from_secs(3), || drain(&stub) > 0),
        "the restarted loop sent nothing"
    );
    let c = loop_check(&role);
    assert!(c.ok, "{c:?}");
    assert!(c.detail.contains("1 restarts"), "{c:?}");
}

fn ping() -> Envelope {
    Envelope {
        incarnation: 1,
        group_incarnation: 7,
        room: 0,
        msg: Message::Ping {
            nonce: 1,
            timestamp_us: 0,
        },
    }
}

#[test]
fn rule10_sends_are_bounded_when_the_peer_stops_reading() {
    // The prefill's ROUTER exactly as `prefill::start` sets it up, and a decode DEALER
    // that says hello once and then never reads again.
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).unwrap();
    wire::configure(&router).unwrap();
    router.set_router_mandatory(true).unwrap();
    router.bind("tcp://127.0.0.1:*").unwrap();
    let ep = router.get_last_endpoint().unwrap().unwrap();
    let dealer = ctx.socket(zmq::DEALER).unwrap();
    wire::configure(&dealer).unwrap();
    dealer.connect(&ep).unwrap();
    wire::send(&dealer, None, &ping()).unwrap();
    router.poll(zmq::POLLIN, 3000).unwrap();
    let frames = wire::try_recv(&router).expect("the DEALER's hello");
    let route = frames[0].to_vec();

    // Send until the pipe is full: every call returns at once, and the failure is the
    // counted would-block, not a blocked thread.
    let start = Instant::now();
    let mut slowest = Duration::ZERO;
    let mut sent = 0usize;
    let err = loop {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no back-pressure after {sent} sends"
        );
        let t = Instant::now();
        let r = wire::send(&router, Some(&route), &ping());
        slowest = slowest.max(t.elapsed());
        match r {
            Ok(_) => sent += 1,
            Err(e) => break e,
        }
    };
    assert!(sent >= 1, "the first send should have been queued");
    assert_eq!(wire::send_error_label(err), "queue_full_or_disconnected");
    assert!(
        slowest < Duration::from_millis(100),
        "a send took {slowest:?}"
    );
    let metrics = Metrics::new();
    metrics.kv.send_failure(wire::send_error_label(err));
    assert!(
        metrics
            .encode()
            .contains("tandem_kv_send_failures_total{result=\"queue_full_or_disconnected\"} 1"),
        "{}",
        metrics.encode()
    );

    // Still full: further sends, KV chunks included, fail at once too.
    let data = vec![7u8; 1 << 20];
    let chunk = crate::kv::KvChunkRef {
        index: 0,
        count: 1,
        first_layer: 0,
        end_layer: 1,
        offset: 0,
        total: data.len() as u64,
        crc32: 0,
        data: &data,
    };
    for _ in 0..100 {
        let t = Instant::now();
        let r = wire::send_chunk(&router, Some(&route), 1, 7, 42, &chunk);
        assert!(t.elapsed() < Duration::from_millis(100));
        assert_eq!(r.err(), Some(zmq::Error::EAGAIN));
    }

    // A route that is gone fails at once as well (ROUTER_MANDATORY), with its own label.
    let t = Instant::now();
    let e = wire::send(&router, Some(b"no-such-peer"), &ping()).unwrap_err();
    assert!(t.elapsed() < Duration::from_millis(100));
    assert_eq!(wire::send_error_label(e), "peer_unreachable");

    // The peer reads again: sends recover (the socket is not wedged).
    assert!(drain(&dealer) > 0);
    assert!(
        wait_until(Duration::from_secs(10), || {
            drain(&dealer);
            wire::send(&router, Some(&route), &ping()).is_ok()
        }),
        "sends never recovered once the peer read again"
    );
}
