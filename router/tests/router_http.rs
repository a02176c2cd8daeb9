//! The router over real sockets: a front server hosting `Router::forward`, stand-in
//! decodes (tests/common) that answer, refuse, fail or break off at chosen points, real
//! HTTP/1.1 between them.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{
    Answer, Behavior, StandIn, chat, front, metrics, send, system_prompt, targets, value,
};
use prometheus_client::registry::Registry;
use tandem_contract::api_keys::ApiKeys;
use tandem_router::policy::{Mode, PolicyConfig};
use tandem_router::{Router, RouterConfig, Target, Targets};
use tokio::sync::watch;

mod common;

struct Setup {
    addr: std::net::SocketAddr,
    registry: Registry,
    tx: watch::Sender<Arc<Targets>>,
    _poller: tokio::task::JoinHandle<()>,
}

impl Setup {
    async fn new(cfg: RouterConfig, t: Vec<Target>) -> Self {
        let (tx, rx) = watch::channel(Arc::new(targets(t)));
        let mut registry = Registry::with_prefix("tandem_router");
        let router = Arc::new(Router::new(cfg, rx, &mut registry));
        let poller = tokio::spawn(router.poller().run());
        let addr = front(router).await;
        Self {
            addr,
            registry,
            tx,
            _poller: poller,
        }
    }

    fn metric(&self, series: &str) -> f64 {
        value(&metrics(&self.registry), series)
    }

    fn outcome(&self, o: &str) -> f64 {
        self.metric(&format!("tandem_router_requests_total{{outcome=\"{o}\"}}"))
    }
}

/// The request sent to `from` was taken back for `reason` within `window` and answered by
/// the decode named "good": one retry, one attempt failure of that reason.
fn assert_moved(
    s: &Setup,
    r: &Answer,
    took: Duration,
    from: &StandIn,
    reason: &str,
    window: (u64, u64),
) {
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["pod"], "good");
    assert_eq!(
        from.requests(),
        1,
        "the request went to {} first",
        from.name
    );
    assert!(
        took >= Duration::from_millis(window.0) && took < Duration::from_millis(window.1),
        "answered after {took:?}"
    );
    assert_eq!(s.outcome("retried"), 1.0);
    assert_eq!(
        s.metric(&format!(
            "tandem_router_attempt_failures_total{{reason=\"{reason}\"}}"
        )),
        1.0
    );
}

/// Let the poller take a report of every decode.
async fn reports() {
    tokio::time::sleep(Duration::from_millis(600)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_shared_prompt_sticks_to_the_decode_that_holds_it_and_prompts_spread() {
    let decodes = [
        StandIn::start("d0", Behavior::Answer).await,
        StandIn::start("d1", Behavior::Answer).await,
        StandIn::start("d2", Behavior::Answer).await,
        StandIn::start("d3", Behavior::Answer).await,
    ];
    let s = Setup::new(
        RouterConfig::default(),
        decodes
            .iter()
            .enumerate()
            .map(|(g, d)| d.target(g as i32))
            .collect(),
    )
    .await;
    // Eight prompts of 25 blocks, each asked once (one at a time: loads stay equal).
    let mut home = Vec::new();
    for p in 0..8 {
        let r = send(
            s.addr,
            "/v1/chat/completions",
            &chat(&system_prompt(p, 25), "hi", false),
            &[],
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        home.push(r.header("x-tandem-pod").unwrap().to_string());
    }
    reports().await;
    // Asked again, by other users: each goes where its prompt is.
    for round in 0..3 {
        for (p, want) in home.iter().enumerate() {
            let user = format!("user {round}");
            let r = send(
                s.addr,
                "/v1/chat/completions",
                &chat(&system_prompt(p, 25), &user, false),
                &[],
            )
            .await;
            assert_eq!(r.status, 200, "{}", r.body);
            assert_eq!(
                r.header("x-tandem-pod"),
                Some(want.as_str()),
                "prompt {p} round {round}"
            );
            assert_eq!(r.header("x-tandem-route"), Some("prefix"));
        }
    }
    let used: std::collections::BTreeSet<&String> = home.iter().collect();
    assert_eq!(
        used.len(),
        4,
        "eight prompts on an idle fleet use every decode: {home:?}"
    );
    // 24 repeated requests matched all 25 blocks; the first 8 matched none.
    assert_eq!(s.metric("tandem_router_prompt_blocks_total"), 32.0 * 25.0);
    assert_eq!(s.metric("tandem_router_matched_blocks_total"), 24.0 * 25.0);
    assert_eq!(s.outcome("forwarded"), 32.0);
    // The prompt-keys calls went to the least loaded decode: all four at equal load.
    let calls: usize = decodes
        .iter()
        .map(|d| d.prompt_key_calls.load(Ordering::SeqCst))
        .sum();
    assert_eq!(calls, 32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_prefix_spreads_once_its_decode_is_loaded() {
    let d0 = StandIn::start("d0", Behavior::Answer).await;
    let d1 = StandIn::start("d1", Behavior::Answer).await;
    let s = Setup::new(RouterConfig::default(), vec![d0.target(0), d1.target(1)]).await;
    let body = chat(&system_prompt(1, 25), "hi", false);
    let r = send(s.addr, "/v1/chat/completions", &body, &[]).await;
    let home = r.header("x-tandem-pod").unwrap().to_string();
    let (hot, other) = if home == "d0" { (&d0, &d1) } else { (&d1, &d0) };
    // The decode holding the prompt reports a queue that costs more than computing it.
    hot.waiting.store(4, Ordering::SeqCst);
    reports().await;
    let r = send(s.addr, "/v1/chat/completions", &body, &[]).await;
    assert_eq!(r.header("x-tandem-pod"), Some(other.name.as_str()));
    assert_eq!(r.header("x-tandem-route"), Some("load"));
}

/// One failure before the first byte: the request goes to the other group once, the
/// client gets that answer, and the failure is counted by its reason.
async fn retried_after(b: Behavior, reason: &str) {
    let bad = StandIn::start("bad", b).await;
    let good = StandIn::start("good", Behavior::Answer).await;
    // The bad decode is preferred: the good one reports a queue.
    good.waiting.store(3, Ordering::SeqCst);
    let s = Setup::new(RouterConfig::default(), vec![bad.target(0), good.target(1)]).await;
    reports().await;
    let r = send(s.addr, "/v1/chat/completions", &chat("x", "hi", false), &[]).await;
    assert_eq!(r.status, 200, "{b:?}: {}", r.body);
    assert_eq!(r.json()["pod"], "good", "{b:?}");
    assert_eq!((bad.requests(), good.requests()), (1, 1), "{b:?}");
    assert_eq!(s.outcome("retried"), 1.0, "{b:?}");
    assert_eq!(s.metric("tandem_router_retries_total"), 1.0);
    assert_eq!(
        s.metric(&format!(
            "tandem_router_attempt_failures_total{{reason=\"{reason}\"}}"
        )),
        1.0,
        "{b:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_decode_fails_before_the_first_byte_is_retried_once_elsewhere() {
    retried_after(Behavior::Unavailable, "status_503").await;
    retried_after(Behavior::CloseBeforeHead, "closed_before_response").await;
    retried_after(Behavior::CloseAfterHead, "closed_before_first_byte").await;
}

/// A decode whose engine stopped stepping: the request waiting there for its first byte
/// is taken back once the decode's reports show the stall past the limit and answered by
/// the other group; the next request goes straight to the other group. Alone, a stalled
/// decode keeps its request, which is answered when the stall passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_held_by_a_stalled_engine_moves_to_the_group_that_steps() {
    let held = StandIn::start("held", Behavior::Hold { ms: 20_000 }).await;
    let good = StandIn::start("good", Behavior::Answer).await;
    // The held decode is preferred: the good one reports a queue.
    good.waiting.store(3, Ordering::SeqCst);
    let cfg = RouterConfig {
        stall_limit: Duration::from_secs(1),
        ..RouterConfig::default()
    };
    let s = Setup::new(cfg.clone(), vec![held.target(0), good.target(1)]).await;
    reports().await;
    let t = std::time::Instant::now();
    let r = send(s.addr, "/v1/chat/completions", &chat("x", "hi", false), &[]).await;
    // The stall limit, plus at most a report period and a check period.
    assert_moved(&s, &r, t.elapsed(), &held, "engine_stalled", (1000, 2500));
    // The router closed its connection: the held request ended in the decode.
    held.until_abandoned().await;
    // A decode still stalled (a second request held there) gets nothing new.
    held.set(Behavior::Hold { ms: 20_000 });
    *held.held_since.lock().unwrap() = Some(std::time::Instant::now() - Duration::from_secs(2));
    reports().await;
    let r = send(s.addr, "/v1/chat/completions", &chat("x", "hi", false), &[]).await;
    assert_eq!(r.json()["pod"], "good", "{}", r.body);
    assert_eq!(held.requests(), 1, "nothing new went to the stalled decode");

    // One group only: nowhere to move, so the request stays and is answered.
    let alone = StandIn::start("alone", Behavior::Hold { ms: 1800 }).await;
    let s = Setup::new(cfg, vec![alone.target(0)]).await;
    reports().await;
    let r = send(s.addr, "/v1/chat/completions", &chat("x", "hi", false), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["pod"], "alone");
    assert_eq!(
        s.metric("tandem_router_attempt_failures_total{reason=\"engine_stalled\"}"),
        0.0
    );
}

/// A decode that stopped (SIGSTOP): it answers nothing, report calls included. The
/// request waiting there for its first byte is taken back once the decode has answered no
/// report call for the limit, and answered by the other group; the next request goes
/// straight to the other group. Alone, the request is answered 503 `decode_unresponsive`
/// after the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_on_a_decode_gone_silent_moves_to_the_group_that_answers() {
    let silent = StandIn::start("silent", Behavior::Answer).await;
    let good = StandIn::start("good", Behavior::Answer).await;
    // The silent decode is preferred: the good one reports a queue.
    good.waiting.store(3, Ordering::SeqCst);
    // The prompt-keys call (asked of the silent decode too, while it ranks first) gives up
    // well inside the limit, so the request is sent there before the silence counts.
    let cfg = RouterConfig {
        stall_limit: Duration::from_secs(2),
        prompt_keys_timeout: Duration::from_millis(300),
        ..RouterConfig::default()
    };
    let s = Setup::new(cfg.clone(), vec![silent.target(0), good.target(1)]).await;
    reports().await;
    silent.frozen.store(true, Ordering::SeqCst);
    let t = std::time::Instant::now();
    let r = send(s.addr, "/v1/chat/completions", &chat("x", "hi", false), &[]).await;
    // The limit counts from the last answered report (at most a poll period before the
    // freeze); then at most a check period.
    assert_moved(
        &s,
        &r,
        t.elapsed(),
        &silent,
        "decode_unresponsive",
        (1700, 3500),
    );
    assert_eq!(
        s.metric("tandem_router_attempt_failures_total{reason=\"engine_stalled\"}"),
        0.0
    );
    // The router dropped its connection there.
    silent.until_abandoned().await;
    // Still silent: nothing new goes there.
    let r = send(s.addr, "/v1/chat/completions", &chat("x", "hi", false), &[]).await;
    assert_eq!(r.json()["pod"], "good", "{}", r.body);
    assert_eq!(
        silent.requests(),
        1,
        "nothing new went to the silent decode"
    );
    // It runs again and reports: it is preferred again for a new prompt (the good one
    // still queues, and its cooling after the failed attempt is over).
    silent.frozen.store(false, Ordering::SeqCst);
    reports().await;
    tokio::time::sleep(tandem_router::fleet::COOLING).await;
    let r = send(
        s.addr,
        "/v1/chat/completions",
        &chat("another", "prompt", false),
        &[],
    )
    .await;
    assert_eq!(r.json()["pod"], "silent", "{}", r.body);

    // One group only: nowhere to move; the request is answered 503 `decode_unresponsive`
    // once the decode has been silent for the limit, not held until it runs again.
    let alone = StandIn::start("alone", Behavior::Answer).await;
    let s = Setup::new(cfg, vec![alone.target(0)]).await;
    reports().await;
    alone.frozen.store(true, Ordering::SeqCst);
    let t = std::time::Instant::now();
    let r = send(s.addr, "/v1/chat/completions", &chat("x", "hi", false), &[]).await;
    let took = t.elapsed();
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(
        r.json()["error"]["code"],
        "decode_unresponsive",
        "{}",
        r.body
    );
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("answered no report call"),
        "{}",
        r.body
    );
    assert!(
        took >= Duration::from_millis(1700) && took < Duration::from_millis(3500),
        "answered after {took:?}"
    );
    assert_eq!(s.outcome("failed"), 1.0);
    assert_eq!(
        s.metric("tandem_router_attempt_failures_total{reason=\"decode_unresponsive\"}"),
        1.0
    );
    // It runs again: served.
    alone.frozen.store(false, Ordering::SeqCst);
    reports().await;
    let r = send(s.addr, "/v1/chat/completions", &chat("y", "hi", false), &[]).await;
    assert_eq!(
        (r.status, r.json()["pod"].clone()),
        (200, "alone".into()),
        "{}",
        r.body
    );
}

/// A decode that holds a request while its reports look fine (its KV loop stalled: no
/// engine work to stall, the process answers): once its group has left Ready for the limit
/// — the operator saw the member fail its probes — the request is taken back and answered
/// by the other group. A group back within the limit keeps its request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_on_a_group_that_left_ready_moves_to_a_ready_group() {
    let stuck = StandIn::start("stuck", Behavior::AwaitKv { ms: 20_000 }).await;
    let good = StandIn::start("good", Behavior::Answer).await;
    // The stuck decode is preferred: the good one reports a queue.
    good.waiting.store(3, Ordering::SeqCst);
    let cfg = RouterConfig {
        stall_limit: Duration::from_secs(1),
        ..RouterConfig::default()
    };
    let s = Setup::new(cfg, vec![stuck.target(0), good.target(1)]).await;
    reports().await;
    let not_ready = Target {
        group_ready: false,
        ..stuck.target(0)
    };
    let flip = |ready: bool, after_ms: u64| {
        let tx = s.tx.clone();
        let (stuck_t, not_ready, good_t) = (stuck.target(0), not_ready.clone(), good.target(1));
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(after_ms)).await;
            let first = if ready { stuck_t } else { not_ready };
            tx.send_replace(Arc::new(targets(vec![first, good_t])));
        })
    };
    let out = flip(false, 300);
    let t = std::time::Instant::now();
    let r = send(s.addr, "/v1/chat/completions", &chat("x", "hi", false), &[]).await;
    let took = t.elapsed();
    out.await.unwrap();
    // Out of Ready at 0.3 s, plus the limit.
    assert_moved(&s, &r, took, &stuck, "group_not_ready", (1250, 2500));
    stuck.until_abandoned().await;

    // Ready again within the limit: the request stays where it is and is answered there.
    stuck.set(Behavior::AwaitKv { ms: 1500 });
    s.tx.send_replace(Arc::new(targets(vec![stuck.target(0), good.target(1)])));
    tokio::time::sleep(tandem_router::fleet::COOLING).await;
    let (out, back) = (flip(false, 200), flip(true, 700));
    let r = send(
        s.addr,
        "/v1/chat/completions",
        &chat("another", "prompt", false),
        &[],
    )
    .await;
    out.await.unwrap();
    back.await.unwrap();
    assert_eq!(r.json()["pod"], "stuck", "{}", r.body);
    assert_eq!(
        s.metric("tandem_router_attempt_failures_total{reason=\"group_not_ready\"}"),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_retried_and_a_dead_fleet_answers_503() {
    let good = StandIn::start("good", Behavior::Answer).await;
    let dead = Target {
        pod: "dead".into(),
        addr: StandIn::dead_addr().await,
        ..good.target(0)
    };
    // The dead decode first: the live one is loaded.
    good.waiting.store(3, Ordering::SeqCst);
    let s = Setup::new(RouterConfig::default(), vec![dead.clone(), good.target(1)]).await;
    reports().await;
    let r = send(
        s.addr,
        "/v1/completions",
        &serde_json::json!({"prompt": "x"}),
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["pod"], "good");
    assert_eq!(
        s.metric("tandem_router_attempt_failures_total{reason=\"connect_failed\"}"),
        1.0
    );
    // Nothing reachable: 503, never a hang.
    s.tx.send_replace(Arc::new(targets(vec![
        dead.clone(),
        Target {
            pod: "dead2".into(),
            group: 1,
            addr: StandIn::dead_addr().await,
            ..dead
        },
    ])));
    let r = send(
        s.addr,
        "/v1/completions",
        &serde_json::json!({"prompt": "x"}),
        &[],
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "upstream_unreachable");
    assert_eq!(s.outcome("failed"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_that_broke_off_after_its_first_byte_is_never_retried() {
    let bad = StandIn::start("bad", Behavior::CloseAfterFirstByte).await;
    let good = StandIn::start("good", Behavior::Answer).await;
    good.waiting.store(3, Ordering::SeqCst);
    let s = Setup::new(RouterConfig::default(), vec![bad.target(0), good.target(1)]).await;
    reports().await;
    let r = send(s.addr, "/v1/chat/completions", &chat("x", "hi", true), &[]).await;
    assert_eq!(r.status, 200);
    assert!(r.body.contains("\"first\":true"), "{}", r.body);
    assert!(
        !r.complete,
        "the client sees the answer end early: {}",
        r.body
    );
    assert_eq!((bad.requests(), good.requests()), (1, 0));
    assert_eq!(s.outcome("forwarded"), 1.0);
    assert_eq!(s.metric("tandem_router_broken_answers_total"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_retries_the_decodes_failure_is_the_answer() {
    let bad = StandIn::start("bad", Behavior::Unavailable).await;
    let good = StandIn::start("good", Behavior::Answer).await;
    good.waiting.store(3, Ordering::SeqCst);
    let cfg = RouterConfig {
        retries: 0,
        ..RouterConfig::default()
    };
    let s = Setup::new(cfg, vec![bad.target(0), good.target(1)]).await;
    reports().await;
    let r = send(s.addr, "/v1/chat/completions", &chat("x", "hi", false), &[]).await;
    assert_eq!(r.status, 503);
    assert_eq!(
        r.json()["error"]["code"],
        "no_peer",
        "the decode's own answer: {}",
        r.body
    );
    assert_eq!((bad.requests(), good.requests()), (1, 0));
    assert_eq!(s.outcome("failed"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_pass_through_whole() {
    let d = StandIn::start(
        "d",
        Behavior::Stream {
            frames: 5,
            delay_ms: 20,
        },
    )
    .await;
    let s = Setup::new(RouterConfig::default(), vec![d.target(0)]).await;
    let r = send(s.addr, "/v1/chat/completions", &chat("x", "hi", true), &[]).await;
    assert_eq!(r.status, 200);
    assert!(
        r.complete && r.body.ends_with("data: [DONE]\n\n"),
        "{}",
        r.body
    );
    assert_eq!(r.body.matches("data: {").count(), 5, "{}", r.body);
    assert_eq!(
        d.prompt_key_calls.load(Ordering::SeqCst),
        0,
        "one decode: no prompt keys needed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_stays_on_its_decode_until_its_group_is_not_ready() {
    let d0 = StandIn::start("d0", Behavior::Answer).await;
    let d1 = StandIn::start("d1", Behavior::Answer).await;
    let s = Setup::new(RouterConfig::default(), vec![d0.target(0), d1.target(1)]).await;
    let session = [("x-session-id", "conversation-7")];
    let r = send(
        s.addr,
        "/v1/chat/completions",
        &chat("x", "hi", false),
        &session,
    )
    .await;
    let home = r.header("x-tandem-pod").unwrap().to_string();
    let (at_home, away) = if home == "d0" { (&d0, &d1) } else { (&d1, &d0) };
    // Its decode gets busier than the other; the session stays.
    at_home.waiting.store(6, Ordering::SeqCst);
    reports().await;
    for _ in 0..3 {
        let r = send(
            s.addr,
            "/v1/chat/completions",
            &chat("y", "hi", false),
            &session,
        )
        .await;
        assert_eq!(r.header("x-tandem-pod"), Some(home.as_str()));
        assert_eq!(r.header("x-tandem-route"), Some("session"));
    }
    // Without the header the same request goes by load.
    let r = send(s.addr, "/v1/chat/completions", &chat("y", "hi", false), &[]).await;
    assert_eq!(r.header("x-tandem-pod"), Some(away.name.as_str()));
    // Its group goes not Ready: the session moves, and stays where it moved.
    let mut gone = at_home.target(if home == "d0" { 0 } else { 1 });
    gone.group_ready = false;
    let other = away.target(if home == "d0" { 1 } else { 0 });
    s.tx.send_replace(Arc::new(targets(vec![gone.clone(), other.clone()])));
    let r = send(
        s.addr,
        "/v1/chat/completions",
        &chat("y", "hi", false),
        &session,
    )
    .await;
    assert_eq!(r.header("x-tandem-pod"), Some(away.name.as_str()));
    gone.group_ready = true;
    s.tx.send_replace(Arc::new(targets(vec![gone, other])));
    let r = send(
        s.addr,
        "/v1/chat/completions",
        &chat("y", "hi", false),
        &session,
    )
    .await;
    assert_eq!(r.header("x-tandem-pod"), Some(away.name.as_str()));
    assert_eq!(r.header("x-tandem-route"), Some("session"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_groups_ready_at_their_current_incarnation_get_requests() {
    let ready = StandIn::start("ready", Behavior::Answer).await;
    let not_ready = StandIn::start("not-ready", Behavior::Answer).await;
    let old = StandIn::start("old", Behavior::Answer).await;
    let mut nr = not_ready.target(1);
    nr.group_ready = false;
    let mut stale = old.target(2);
    stale.group_incarnation = 2;
    let s = Setup::new(
        RouterConfig::default(),
        vec![nr.clone(), ready.target(0), stale.clone()],
    )
    .await;
    for i in 0..12 {
        let r = send(
            s.addr,
            "/v1/chat/completions",
            &chat(&system_prompt(i, 3), "hi", false),
            &[],
        )
        .await;
        assert_eq!(r.json()["pod"], "ready");
    }
    assert_eq!((not_ready.requests(), old.requests()), (0, 0));
    s.tx.send_replace(Arc::new(targets(vec![nr, stale])));
    let r = send(s.addr, "/v1/chat/completions", &chat("x", "hi", false), &[]).await;
    assert_eq!(r.status, 503);
    let v = r.json();
    assert_eq!(v["error"]["code"], "no_ready_group");
    assert_eq!(v["error"]["message"], "no group is ready: test");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(s.outcome("no_ready_group"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_bound_is_refused_413_before_any_decode_sees_it() {
    let d = StandIn::start("d", Behavior::Answer).await;
    let cfg = RouterConfig {
        max_body_bytes: 1024,
        ..RouterConfig::default()
    };
    let s = Setup::new(cfg, vec![d.target(0)]).await;
    let r = send(
        s.addr,
        "/v1/chat/completions",
        &chat(&"x".repeat(2000), "hi", false),
        &[],
    )
    .await;
    assert_eq!(r.status, 413, "{}", r.body);
    let v = r.json();
    assert_eq!(v["error"]["code"], "body_too_large");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("1024 bytes")
    );
    assert_eq!(d.requests(), 0);
    assert_eq!(s.outcome("body_too_large"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_are_required_and_refusals_are_openai_errors() {
    let d = StandIn::start("d", Behavior::Answer).await;
    let cfg = RouterConfig {
        api_keys: ApiKeys::from_parts(Some("sk-right"), None).unwrap(),
        upstream_key: Some(tandem_router::Secret("sk-decode".into())),
        ..RouterConfig::default()
    };
    let s = Setup::new(cfg, vec![d.target(0)]).await;
    let body = chat("x", "hi", false);
    let r = send(s.addr, "/v1/chat/completions", &body, &[]).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    let v = r.json();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["code"], "missing_api_key");
    let r = send(
        s.addr,
        "/v1/chat/completions",
        &body,
        &[("authorization", "Bearer sk-wrong")],
    )
    .await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (401, Some("invalid_api_key"))
    );
    assert!(
        !r.body.contains("sk-wrong"),
        "a key is never echoed: {}",
        r.body
    );
    assert_eq!(d.requests(), 0);
    let r = send(
        s.addr,
        "/v1/chat/completions",
        &body,
        &[("authorization", "Bearer sk-right")],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // The decode gets the router's own key, not the client's.
    assert_eq!(
        d.auth_seen.lock().unwrap().as_slice(),
        &[Some("Bearer sk-decode".to_string())]
    );
    assert_eq!(s.outcome("unauthorized"), 2.0);
    assert_eq!(
        s.metric("tandem_router_auth_refusals_total{reason=\"missing_api_key\"}"),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_ignores_prefixes_and_load() {
    let decodes = [
        StandIn::start("d0", Behavior::Answer).await,
        StandIn::start("d1", Behavior::Answer).await,
        StandIn::start("d2", Behavior::Answer).await,
    ];
    let cfg = RouterConfig {
        policy: PolicyConfig {
            mode: Mode::RoundRobin,
            ..PolicyConfig::default()
        },
        ..RouterConfig::default()
    };
    let s = Setup::new(
        cfg,
        decodes
            .iter()
            .enumerate()
            .map(|(g, d)| d.target(g as i32))
            .collect(),
    )
    .await;
    let body = chat(&system_prompt(0, 25), "hi", false);
    let mut pods = Vec::new();
    for _ in 0..6 {
        let r = send(s.addr, "/v1/chat/completions", &body, &[]).await;
        pods.push(r.json()["pod"].as_str().unwrap().to_string());
    }
    assert_eq!(pods, ["d0", "d1", "d2", "d0", "d1", "d2"]);
    assert!(
        decodes
            .iter()
            .all(|d| d.prompt_key_calls.load(Ordering::SeqCst) == 0)
    );
}
