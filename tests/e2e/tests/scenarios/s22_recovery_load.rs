//! Scenario 22: the recovery table's cluster rows under a steady client (BENCHMARKS.md,
//! "The recovery table"). A PDDeployment with the router, first with two groups, then
//! scaled to one; in each, three faults of group 0's decode one after another — SIGSTOP,
//! its KV loop stalled 30 s, its engine holding its work without stepping — each while
//! two clients send a chat every 0.3 s (15 s timeout each: `start_load`), one through the router's
//! Service and one through the client Service. For each fault it prints the per-request
//! columns of both clients (refused after, longest wait, served again, failed), when the
//! co-restart was decided, when group 0 was Ready again, and whether the weights were
//! reloaded (new pods).
//!
//! It asserts what Tandem promises, not how fast: with two groups no request through the
//! router fails; a stalled KV loop is healed in place (the same pods: weights kept); a
//! stopped decode and an engine that makes no progress get new pods (a reset would keep
//! the stopped process, or the stalled engine thread: the planner reads what stalled from
//! the `/ready` body's `stalled`); after every fault the group serves again through both
//! Services.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use kube::ResourceExt;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;
use tandem_e2e::env::Env;
use tandem_e2e::load::{Outcome, Recovery, recovery};
use tandem_e2e::{http, wait};
use tandem_operator::crd::GroupPhase;

use crate::common::*;

/// `health.noProgressSeconds` here (the default is 30 s): the held engine's co-restart
/// comes sooner, the run is shorter; the router's stall limit (5 s), which moves the
/// requests, does not depend on it.
const NO_PROGRESS_S: i64 = 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    DecodeSigstop,
    KvLoopStall,
    EngineHeld,
}

impl Fault {
    fn label(self) -> &'static str {
        match self {
            Self::DecodeSigstop => "decode SIGSTOP",
            Self::KvLoopStall => "decode KV loop stalled 30 s",
            Self::EngineHeld => "decode engine held (no progress)",
        }
    }

    /// Whether the planner heals it in place (the members reset, the pods stay).
    fn in_place(self) -> bool {
        self == Self::KvLoopStall
    }
}

/// What group 0 went through after a fault.
struct Healed {
    decided: Duration,
    ready: Duration,
    in_place: bool,
    reason: String,
    reloaded: bool,
}

/// Arm a fault in the decode's dataplane through its `POST /debug/fault`.
async fn debug_fault(ip: &str, query: &str) -> Result<()> {
    let r = http::post_json(
        &format!("{ip}:{HTTP_PORT}"),
        &format!("/debug/fault?{query}"),
        &json!({}),
        Duration::from_secs(5),
    )
    .await?;
    ensure!(
        r.status == 200,
        "/debug/fault?{query}: HTTP {}: {}",
        r.status,
        r.body
    );
    Ok(())
}

async fn inject(
    env: &Env,
    ns: &str,
    decode: &k8s_openapi::api::core::v1::Pod,
    f: Fault,
) -> Result<()> {
    let ip = pod_ip(decode).context("the decode's IP")?;
    match f {
        Fault::DecodeSigstop => {
            let pid = env.pid_of(ns, &decode.name_any()).await?;
            kill(Pid::from_raw(pid), Signal::SIGSTOP)?;
            Ok(())
        }
        Fault::KvLoopStall => debug_fault(&ip, "loop=kv_peer_0&fault=stall&ms=30000").await,
        Fault::EngineHeld => debug_fault(&ip, "loop=engine&fault=hold&ms=120000").await,
    }
}

/// Group 0's co-restart after a fault at `t0`: decided (its incarnation moved past `inc`),
/// then Ready at it.
async fn healed(env: &Env, ns: &str, name: &str, inc: i64, t0: Instant) -> Result<Healed> {
    let decided = std::sync::Mutex::new(None);
    let seen = &decided;
    let g = wait::until(
        "group 0 to be Ready at its next incarnation",
        Duration::from_secs(150),
        Duration::from_millis(200),
        move || async move {
            let p = get_pdd(env, ns, name).await?;
            let g = p.status.and_then(|s| s.group_statuses.into_iter().next());
            Ok(g.filter(|g| {
                if g.incarnation > inc {
                    seen.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_or_insert_with(|| t0.elapsed());
                }
                g.incarnation > inc && g.phase == GroupPhase::Ready
            }))
        },
    )
    .await?;
    let ready = t0.elapsed();
    let last = g.last_co_restart.clone().context("a co-restart record")?;
    let decided = decided.into_inner().unwrap_or_else(|e| e.into_inner());
    Ok(Healed {
        decided: decided.unwrap_or(ready),
        ready,
        in_place: last.in_place,
        reason: last.reason.to_string(),
        reloaded: false,
    })
}

/// One fault in group 0 under both clients: the two clients' columns and the group's
/// recovery.
async fn under_load(
    env: &Env,
    ns: &str,
    name: &str,
    f: Fault,
    (router, service): (&str, &str),
) -> Result<(Recovery, Recovery, Healed)> {
    let prefill = member(env, ns, name, 0, "prefill").await?;
    let decode = member(env, ns, name, 0, "decode").await?;
    let inc = incarnation(&decode);
    let before = [prefill.name_any(), decode.name_any()];
    let via_router = start_load_through(router).await?;
    let via_service = start_load_through(service).await?;
    // Served before the fault (the columns count from it): the deployment starts healthy.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (fault_r, fault_s) = (via_router.now(), via_service.now());
    let t0 = Instant::now();
    let injected = inject(env, ns, &decode, f).await;
    let healed = match injected {
        Ok(()) => healed(env, ns, name, inc, t0).await,
        Err(e) => Err(e),
    };
    // Served again for a while after the group is back (or the wait gave up).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (router_samples, service_samples) = (via_router.stop().await, via_service.stop().await);
    let mut healed = healed?;
    let before_fault = router_samples
        .iter()
        .chain(&service_samples)
        .filter(|s| s.sent + Duration::from_millis(100) < fault_r.min(fault_s))
        .collect::<Vec<_>>();
    ensure!(
        before_fault.iter().all(|s| s.outcome == Outcome::Ok),
        "requests failed before the fault: {:?}",
        before_fault
            .iter()
            .filter(|s| s.outcome != Outcome::Ok)
            .collect::<Vec<_>>()
    );
    let after = [
        member(env, ns, name, 0, "prefill").await?.name_any(),
        member(env, ns, name, 0, "decode").await?.name_any(),
    ];
    healed.reloaded = after != before;
    Ok((
        recovery(&router_samples, fault_r, LOAD_TIMEOUT),
        recovery(&service_samples, fault_s, LOAD_TIMEOUT),
        healed,
    ))
}

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s22", "pd");
    env.namespace(ns).await?;
    let mut pdd = spec(name, 2);
    pdd["spec"]["router"] = json!({"replicas": 1});
    pdd["spec"]["health"]["noProgressSeconds"] = NO_PROGRESS_S.into();
    for role in ["prefill", "decode"] {
        let r = &mut pdd["spec"][role];
        r["args"]
            .as_array_mut()
            .context("args")?
            .push("--fault-injection".into());
        r["template"]["env"]
            .as_array_mut()
            .context("env")?
            .push(json!({"name": "TANDEM_ALLOW_FAULT_INJECTION", "value": "yes"}));
    }
    // As JSON: YAML would write the env value `yes` bare, which reads back as a boolean.
    env.kubectl.apply(ns, &pdd.to_string()).await?;
    wait_ready(env, ns, name, 2, Duration::from_secs(180)).await?;
    let router = router_ip(env, ns, name).await?;
    let service = service_ip(env, ns, name).await?;

    for groups in [2, 1] {
        if groups == 1 {
            merge_patch_pdd(env, ns, name, &json!({"spec": {"groups": 1}})).await?;
            wait_ready(env, ns, name, 1, Duration::from_secs(120)).await?;
        }
        for f in [Fault::DecodeSigstop, Fault::KvLoopStall, Fault::EngineHeld] {
            let (r, s, h) = under_load(env, ns, name, f, (&router, &service))
                .await
                .with_context(|| format!("{groups} group(s), {}", f.label()))?;
            figure(
                &format!("recovery, {groups} group(s), {}", f.label()),
                format!(
                    "through the router: {r}; through the client Service: {s}; \
                     co-restart decided {:.1} s ({}, {}), group 0 Ready {:.1} s, weights reloaded: {}",
                    h.decided.as_secs_f64(),
                    h.reason,
                    if h.in_place { "in place" } else { "new pods" },
                    h.ready.as_secs_f64(),
                    if h.reloaded { "yes" } else { "no" },
                ),
            );
            ensure!(
                h.in_place == f.in_place() && h.reloaded != f.in_place(),
                "{}: co-restart {} and pods {} (expected {})",
                f.label(),
                if h.in_place {
                    "in place"
                } else {
                    "by new pods"
                },
                if h.reloaded { "replaced" } else { "kept" },
                if f.in_place() {
                    "in place, pods kept"
                } else {
                    "new pods"
                }
            );
            if groups == 2 {
                ensure!(
                    r.failed == 0,
                    "{}: requests through the router failed with another group Ready: {r}",
                    f.label()
                );
            }
            ensure!(
                r.served_again.is_some() && s.served_again.is_some(),
                "{}: not served again after the co-restart (router: {r}; Service: {s})",
                f.label()
            );
        }
    }

    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
