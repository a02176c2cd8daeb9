//! In-process tests of the PD loops with real ZeroMQ sockets and the production loops:
//! supervision and readiness of both sides' loops (a stuck or dead loop makes the process
//! not ready), sends bounded in bytes and never blocking the engine, and eviction at the
//! session cap. The prefill runs on the toy engine
//! (`test_support::fake_runner`); its peers are stub decodes speaking the real protocol.

use crate::sampling::SamplingParams;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::settings::PdTimings;
use super::supervise::Fault;
use super::{ChannelConfig, Check, PdLimits, PdRole, decode, local_identity, prefill, wire};
use crate::engine_api::ModelInfo;
use crate::kv::auth::{GroupKey, Initiator, LocalIdentity};
use crate::kv::{Envelope, FailCode, Message, PrefillRequest, RejectReason};
use crate::metrics::Metrics;
use crate::scheduler::{self, SchedulerConfig};
use crate::test_support::fake_runner::{self, fake, letters};

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
fn a_stuck_kv_loop_flips_ready_within_one_probe_period_and_a_panicking_loop_restarts() {
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
        channel_deadline: Duration::from_secs(1),
    };
    let metrics = Arc::new(Metrics::new());
    let client = decode::start(
        std::slice::from_ref(&addr),
        super::ChannelConfig {
            local: local_identity(&info(), 0, super::random_id(), 7),
            key: GroupKey::new(b"k".to_vec()),
            timings,
            limits: super::PdLimits::default(),
        },
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

const KEY: &[u8] = b"test key";
const GROUP: u64 = 7;

fn metric(m: &Metrics, line_prefix: &str) -> f64 {
    let body = m.encode();
    body.lines()
        .find_map(|l| {
            l.strip_prefix(line_prefix)
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or_else(|| panic!("no series {line_prefix:?}:\n{body}"))
}

fn toy_identity(incarnation: u64) -> LocalIdentity {
    let (r, _) = fake(1);
    local_identity(
        crate::engine_api::ModelRunner::info(&r),
        0,
        incarnation,
        GROUP,
    )
}

fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A real prefill (ROUTER loop) on the toy engine; `step_delay` slows every engine step.
struct TestPrefill {
    handle: prefill::PrefillHandle,
    metrics: Arc<Metrics>,
    port: u16,
}

fn start_prefill(limits: PdLimits, timings: PdTimings, step_delay: Duration) -> TestPrefill {
    let (runner, st) = fake(100_000);
    st.lock().unwrap().step_delay = step_delay;
    let metrics = Arc::new(Metrics::new());
    let (engine, _) = scheduler::spawn(
        runner,
        letters(),
        SchedulerConfig::default(),
        metrics.clone(),
    )
    .unwrap();
    let port = free_tcp_port();
    let channel = ChannelConfig {
        local: toy_identity(super::random_id()),
        key: GroupKey::new(KEY),
        timings,
        limits,
    };
    let handle = prefill::start("127.0.0.1", port, channel, engine, metrics.clone()).unwrap();
    TestPrefill {
        handle,
        metrics,
        port,
    }
}

fn timings() -> PdTimings {
    PdTimings {
        probe_period: Duration::from_millis(500),
        failure_threshold: 2,
        bootstrap_timeout: Duration::from_secs(5),
        kv_timeout: Duration::from_secs(20),
        channel_deadline: Duration::from_secs(1),
    }
}

/// A decode speaking the real protocol over its own DEALER, driven step by step.
struct StubDecode {
    sock: zmq::Socket,
    me: LocalIdentity,
}

impl StubDecode {
    fn connect(ctx: &zmq::Context, port: u16) -> Self {
        let sock = ctx.socket(zmq::DEALER).unwrap();
        sock.set_linger(0).unwrap();
        sock.set_rcvtimeo(10_000).unwrap();
        sock.connect(&format!("tcp://127.0.0.1:{port}")).unwrap();
        Self {
            sock,
            me: toy_identity(super::random_id()),
        }
    }

    fn send(&self, room: u64, msg: Message) {
        let env = Envelope {
            incarnation: self.me.incarnation,
            group_incarnation: GROUP,
            room,
            msg,
        };
        let [h, p] = crate::kv::encode(&env);
        self.sock.send_multipart([h, p], 0).unwrap();
    }

    fn recv(&self) -> Envelope {
        let f = self
            .sock
            .recv_multipart(0)
            .expect("a message from the prefill");
        crate::kv::decode(&[&f[0], &f[1]]).unwrap()
    }

    fn hello(&self) -> Initiator {
        let init = Initiator::new(rand::random());
        self.send(0, init.hello(&self.me));
        init
    }

    /// Answer the WELCOME to `init`'s HELLO.
    fn auth(&self, init: &Initiator) {
        let welcome = self.recv();
        let (auth, _) = init
            .on_welcome(
                &self.me,
                &GroupKey::new(KEY),
                welcome.incarnation,
                welcome.group_incarnation,
                &welcome.msg,
            )
            .unwrap();
        self.send(0, auth);
    }

    fn accepted(&self) {
        let m = self.recv().msg;
        assert_eq!(m, Message::Accepted);
    }

    fn handshake(&self) {
        let init = self.hello();
        self.auth(&init);
        self.accepted();
    }

    fn prefill(&self, room: u64, tokens: usize) {
        let req = PrefillRequest {
            tokens: (0..tokens as u32).map(|t| 2 + t % 30).collect(),
            sampling: greedy(),
            ..Default::default()
        };
        self.send(room, Message::Prefill(req));
    }

    /// Every message until each of `rooms` ended (DONE or FAILED): per room, the KV bytes
    /// received and the message that ended it.
    fn until_ended(&self, rooms: &[u64]) -> std::collections::HashMap<u64, (u64, Message)> {
        let mut kv = std::collections::HashMap::<u64, u64>::new();
        let mut ended = std::collections::HashMap::new();
        while ended.len() < rooms.len() {
            let env = self.recv();
            if !rooms.contains(&env.room) {
                continue;
            }
            match env.msg {
                Message::KvChunk(c) => *kv.entry(env.room).or_default() += c.data.len() as u64,
                Message::Progress { .. } => {}
                m @ (Message::Done { .. } | Message::Failed { .. }) => {
                    ended.insert(env.room, (kv.get(&env.room).copied().unwrap_or(0), m));
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        ended
    }

    fn until_end(&self, room: u64) -> (u64, Message) {
        self.until_ended(&[room]).remove(&room).unwrap()
    }
}

/// Sends bounded in bytes, on the production path: a decode that stops reading. The prefill's own loop
/// sends within its byte budget and refuses the rest at once, counted and pushed, without
/// its loop ever blocking; acknowledgements (CREDIT) free the budget again.
#[test]
fn the_prefill_bounds_kv_in_flight_by_bytes_and_refuses_past_it_at_once() {
    // The toy engine exports 4 bytes per prompt token: rooms of 100 tokens carry 400 bytes.
    let limits = PdLimits {
        send_budget: 1000,
        ..PdLimits::default()
    };
    // (Steps of 50 ms, so the vanished decode below is gone before its room ends.)
    let p = start_prefill(limits, timings(), Duration::from_millis(50));
    let ctx = zmq::Context::new();
    let d = StubDecode::connect(&ctx, p.port);
    d.handshake();
    // Five rooms at once; the stub reads nothing meanwhile.
    for room in 1..=5 {
        d.prefill(room, 100);
    }
    let m = &p.metrics;
    let ended = || {
        metric(m, "tandem_kv_rooms_total{state=\"done\",reason=\"none\"} ")
            + metric(
                m,
                "tandem_kv_rooms_total{state=\"failed\",reason=\"send_budget\"} ",
            )
    };
    assert!(wait_until(Duration::from_secs(10), || ended() == 5.0));
    // 400 + 400 fit in 1000; a third room would not.
    assert_eq!(
        metric(m, "tandem_kv_rooms_total{state=\"done\",reason=\"none\"} "),
        2.0
    );
    assert_eq!(
        metric(
            m,
            "tandem_kv_rooms_total{state=\"failed\",reason=\"send_budget\"} "
        ),
        3.0
    );
    assert_eq!(
        metric(m, "tandem_kv_send_failures_total{result=\"byte_budget\"} "),
        3.0
    );
    assert!(wait_until(Duration::from_secs(2), || metric(
        m,
        "tandem_kv_bytes_in_flight "
    ) == 800.0));
    // The loop never blocked: its heartbeat stayed fresh throughout.
    assert!(
        p.handle.checks().iter().all(|c| c.ok),
        "{:?}",
        p.handle.checks()
    );

    // The stub reads: two rooms of KV, three refusals naming the budget.
    let mut kv = 0;
    let mut refused = 0;
    for (_, end) in d.until_ended(&[1, 2, 3, 4, 5]) {
        match end {
            (n, Message::Done { .. }) => kv += n,
            (0, Message::Failed { reason, text }) => {
                assert_eq!(reason, FailCode::SendBudget);
                assert!(text.contains("send budget of 1000 bytes"), "{text}");
                refused += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((kv, refused), (800, 3));
    // Acknowledged: the budget is free again and a new room goes through.
    d.send(0, Message::Credit { consumed: 800 });
    assert!(wait_until(Duration::from_secs(2), || metric(
        m,
        "tandem_kv_bytes_in_flight "
    ) == 0.0));
    d.prefill(6, 100);
    assert!(matches!(d.until_end(6), (400, Message::Done { .. })));

    // A decode that vanished: the reply to its room fails at once with its own label.
    let gone = StubDecode::connect(&ctx, p.port);
    gone.handshake();
    gone.prefill(7, 10);
    drop(gone);
    assert!(wait_until(Duration::from_secs(10), || metric(
        m,
        "tandem_kv_send_failures_total{result=\"peer_unreachable\"} "
    ) >= 1.0));
}

/// Supervision of the prefill's loop: a stall turns `/ready` not-ready within one probe period
/// and heals by itself; a panic fails the rooms the loop held (FAILED `loop_panic` pushed to
/// the decode), is counted, and the restarted loop serves again.
#[test]
fn the_prefill_loop_is_supervised_stall_and_panic() {
    let t = timings();
    let p = start_prefill(PdLimits::default(), t, Duration::from_millis(300));
    let role = PdRole::Prefill(p.handle);
    let health = role.loops()[0].clone();
    assert_eq!(health.name, "kv_router");
    assert!(loop_check(&role).ok);

    health.inject(Fault::Stall(Duration::from_millis(1500)));
    assert!(wait_until(Duration::from_secs(2), || health
        .stalled_at()
        .is_some()));
    let stalled_at = health.stalled_at().unwrap();
    assert!(
        wait_until(Duration::from_secs(3), || !loop_check(&role).ok),
        "a stuck prefill loop never turned /ready not-ready"
    );
    let after = stalled_at.elapsed();
    assert!(
        after <= t.probe_period + Duration::from_millis(150),
        "not-ready only after {after:?}"
    );
    let c = loop_check(&role);
    assert_eq!(
        (c.name.as_str(), c.reason.as_deref()),
        ("loop_kv_router", Some("loop_stalled"))
    );
    assert!(wait_until(Duration::from_secs(3), || loop_check(&role).ok));

    // A room in flight (the toy engine takes 300 ms a step), then a panic in the loop.
    let ctx = zmq::Context::new();
    let d = StubDecode::connect(&ctx, p.port);
    d.handshake();
    d.prefill(1, 50);
    assert!(wait_until(Duration::from_secs(5), || metric(
        &p.metrics,
        "tandem_kv_rooms_opened_total "
    ) == 1.0));
    health.inject(Fault::Panic);
    let (_, end) = d.until_end(1);
    assert!(
        matches!(
            end,
            Message::Failed {
                reason: FailCode::LoopPanic,
                ..
            }
        ),
        "{end:?}"
    );
    assert_eq!(health.restarts(), 1);
    assert_eq!(
        metric(
            &p.metrics,
            "tandem_kv_loop_restarts_total{loop=\"kv_router\"} "
        ),
        1.0
    );
    // (Counted right after the FAILED went out.)
    assert!(wait_until(Duration::from_secs(1), || metric(
        &p.metrics,
        "tandem_kv_rooms_total{state=\"failed\",reason=\"loop_panic\"} "
    ) == 1.0));
    // The restarted loop kept the session and serves the next room.
    d.prefill(2, 5);
    assert!(matches!(d.until_end(2), (20, Message::Done { .. })));
    let c = loop_check(&role);
    assert!(c.ok && c.detail.contains("1 restarts"), "{c:?}");
}

/// The session table holds 1,024 decodes: one more evicts the longest-silent session,
/// counted as `capacity`; the evicted decode is told why (`peer_expired`) on its next
/// message, and the others keep being served.
#[test]
fn the_1025th_decode_evicts_the_longest_silent_session() {
    raise_fd_limit(4096);
    let p = start_prefill(PdLimits::default(), timings(), Duration::ZERO);
    // A context holds at most 1,023 sockets (libzmq's default): spread them over several.
    let contexts: Vec<zmq::Context> = (0..3).map(|_| zmq::Context::new()).collect();
    let ctx = &contexts[0];
    let first = StubDecode::connect(ctx, p.port);
    first.handshake();
    std::thread::sleep(Duration::from_millis(20));
    // 1,023 more, pipelined in groups smaller than the table of pending handshakes:
    // every HELLO, then every AUTH, then every ACCEPTED.
    let rest: Vec<StubDecode> = (0..super::router_loop::MAX_SESSIONS - 1)
        .map(|i| StubDecode::connect(&contexts[1 + i % 2], p.port))
        .collect();
    for group in rest.chunks(200) {
        let inits: Vec<Initiator> = group.iter().map(StubDecode::hello).collect();
        for (d, i) in group.iter().zip(&inits) {
            d.auth(i);
        }
        for d in group {
            d.accepted();
        }
    }
    let m = &p.metrics;
    assert_eq!(metric(m, "tandem_kv_sessions "), 1024.0);
    assert_eq!(
        metric(m, "tandem_kv_sessions_dropped_total{reason=\"capacity\"} "),
        0.0
    );
    // Everyone but the first speaks again, so the first is the longest silent.
    for d in &rest {
        d.send(
            0,
            Message::Ping {
                nonce: 1,
                timestamp_us: 0,
            },
        );
    }
    for d in &rest {
        assert!(matches!(d.recv().msg, Message::Pong { .. }));
    }
    let newcomer = StubDecode::connect(ctx, p.port);
    newcomer.handshake();
    assert_eq!(metric(m, "tandem_kv_sessions "), 1024.0);
    assert_eq!(
        metric(m, "tandem_kv_sessions_dropped_total{reason=\"capacity\"} "),
        1.0
    );
    first.send(
        0,
        Message::Ping {
            nonce: 2,
            timestamp_us: 0,
        },
    );
    match first.recv().msg {
        Message::Reject { reason, text } => {
            assert_eq!(reason, RejectReason::SessionExpired);
            assert!(text.contains("session table full (1024)"), "{text}");
        }
        other => panic!("expected REJECT, got {other:?}"),
    }
    rest[0].send(
        0,
        Message::Ping {
            nonce: 3,
            timestamp_us: 0,
        },
    );
    assert!(matches!(rest[0].recv().msg, Message::Pong { .. }));
    newcomer.prefill(1, 4);
    assert!(matches!(newcomer.until_end(1), (16, Message::Done { .. })));
    // The prefill stays ready; its /ready lists the most recent sessions and names the
    // last refusal (the evicted decode, told why).
    assert!(p.handle.checks().iter().all(|c| c.ok));
    assert!(wait_until(Duration::from_secs(2), || {
        p.handle.peers().iter().any(|p| {
            p.last_refusal.as_ref().is_some_and(|r| {
                r.reason == "peer_expired" && r.message.contains("session table full")
            })
        })
    }));
    assert!(p.handle.peers().len() <= super::router_loop::REPORTED_PEERS + 1);
}

/// Sessions need two descriptors each here (both ends live in this process) plus ZeroMQ's
/// own; raise the soft limit when it is lower (up to the hard limit) with `prlimit`.
fn raise_fd_limit(want: u64) {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let nums: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    let (soft, hard) = (nums[0], nums[1]);
    if soft >= want {
        return;
    }
    assert!(
        hard >= want,
        "this test needs {want} open files; the hard limit is {hard}"
    );
    let pid = std::process::id().to_string();
    let ok = std::process::Command::new("prlimit")
        .args(["--pid", &pid, &format!("--nofile={want}:{hard}")])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "prlimit could not raise the open-file limit to {want}");
}

#[test]
fn the_toy_runner_exports_four_bytes_per_token() {
    // The byte arithmetic of the tests above rests on this.
    assert_eq!(fake_runner::BLOCK, 4);
    let (mut r, _) = fake(10);
    use crate::engine_api::{ModelRunner, SeqId, StepInput};
    r.reserve(SeqId(1), 8).unwrap();
    r.step(&[StepInput {
        seq: SeqId(1),
        tokens: vec![2, 3, 4],
        want_logits: false,
    }])
    .unwrap();
    assert_eq!(r.export_kv(SeqId(1)).unwrap().len(), 12);
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..Default::default()
    }
}
