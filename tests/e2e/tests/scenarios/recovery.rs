//! What the recovery scenarios (s22: the decode's faults, s23: the prefill's and the
//! session's) share: the deployment (two groups behind the router, fault injection on),
//! each fault and how it is injected into group 0, and one fault under two steady clients
//! — one through the router's Service, one through the client Service — with the recovery
//! table's per-request columns of each, the co-restart that followed and whether the
//! weights were reloaded (new pods). See BENCHMARKS.md, "The recovery table".

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;
use tandem_e2e::env::Env;
use tandem_e2e::load::{Outcome, Recovery, recovery};
use tandem_e2e::{http, wait};
use tandem_operator::crd::GroupPhase;
use tandem_operator::planner::Role;
use tandem_operator::reset_call::{self, ResetReply};

use crate::common::*;

/// `health.noProgressSeconds` here (the default is 30 s): the held engine's co-restart
/// comes sooner, the run is shorter; the router's stall limit (5 s), which moves the
/// requests, does not depend on it.
const NO_PROGRESS_S: i64 = 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    DecodeSigkill,
    DecodeSigstop,
    KvLoopStall,
    EngineHeld,
    PrefillSigstop,
    PrefillSigkill,
    /// The prefill alone reset to the next group incarnation (a signed admin call): a
    /// prefill that came back with another incarnation under a decode that kept the old.
    PrefillIncarnation,
}

impl Fault {
    fn label(self) -> &'static str {
        match self {
            Self::DecodeSigkill => "decode SIGKILL",
            Self::DecodeSigstop => "decode SIGSTOP",
            Self::KvLoopStall => "decode KV loop stalled 30 s",
            Self::EngineHeld => "decode engine held (no progress)",
            Self::PrefillSigstop => "prefill SIGSTOP",
            Self::PrefillSigkill => "prefill SIGKILL",
            Self::PrefillIncarnation => "prefill incarnation fault",
        }
    }

    /// Whether the planner heals it in place (the members reset, the pods stay).
    fn in_place(self) -> bool {
        matches!(self, Self::KvLoopStall | Self::PrefillIncarnation)
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

/// Inject `f` into group 0, whose members are `prefill` and `decode`.
async fn inject(
    env: &Env,
    ns: &str,
    name: &str,
    (prefill, decode): (&Pod, &Pod),
    f: Fault,
) -> Result<()> {
    let ip = pod_ip(decode).context("the decode's IP")?;
    match f {
        Fault::DecodeSigstop
        | Fault::DecodeSigkill
        | Fault::PrefillSigstop
        | Fault::PrefillSigkill => {
            let (pod, sig) = match f {
                Fault::DecodeSigstop => (decode, Signal::SIGSTOP),
                Fault::DecodeSigkill => (decode, Signal::SIGKILL),
                Fault::PrefillSigstop => (prefill, Signal::SIGSTOP),
                _ => (prefill, Signal::SIGKILL),
            };
            let pid = env.pid_of(ns, &pod.name_any()).await?;
            kill(Pid::from_raw(pid), sig)?;
            Ok(())
        }
        Fault::KvLoopStall => debug_fault(&ip, "loop=kv_peer_0&fault=stall&ms=30000").await,
        Fault::EngineHeld => debug_fault(&ip, "loop=engine&fault=hold&ms=120000").await,
        Fault::PrefillIncarnation => {
            let key = group_key(env, ns, name, 0).await?;
            let addr = format!(
                "{}:{HTTP_PORT}",
                pod_ip(prefill).context("the prefill's IP")?
            )
            .parse()?;
            let to = incarnation(prefill) + 1;
            let reply =
                reset_call::call(addr, Role::Prefill, to, &key, Duration::from_secs(5)).await;
            ensure!(
                matches!(reply, ResetReply::Ready { reset: true, .. }),
                "the prefill's reset: {reply:?}"
            );
            Ok(())
        }
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
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (fault_r, fault_s) = (via_router.now(), via_service.now());
    let t0 = Instant::now();
    let injected = inject(env, ns, name, (&prefill, &decode), f).await;
    let healed = match injected {
        Ok(()) => healed(env, ns, name, inc, t0).await,
        Err(e) => Err(e),
    };
    // Served again for a while after the group is back (or the wait gave up).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (router_samples, service_samples) = (via_router.stop().await, via_service.stop().await);
    let mut healed = healed?;
    // The deployment was healthy: every request answered before the fault was served.
    for (samples, fault, via) in [
        (&router_samples, fault_r, "the router"),
        (&service_samples, fault_s, "the client Service"),
    ] {
        let failed: Vec<_> = samples
            .iter()
            .filter(|s| s.ended < fault && s.outcome != Outcome::Ok)
            .collect();
        ensure!(
            failed.is_empty(),
            "requests through {via} failed before the fault: {failed:?}"
        );
    }
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

/// The deployment of the recovery scenarios: `groups` groups behind the router, fault
/// injection on; once Ready, the router's and the client Service's ClusterIPs.
pub async fn deploy(env: &Env, ns: &str, name: &str, groups: i32) -> Result<(String, String)> {
    env.namespace(ns).await?;
    let mut pdd = spec(name, groups);
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
    wait_ready(env, ns, name, groups, Duration::from_secs(180)).await?;
    Ok((
        router_ip(env, ns, name, groups as usize).await?,
        service_ip(env, ns, name).await?,
    ))
}

/// Each of `faults` in turn in group 0 of `groups` groups under both clients: prints the
/// figures; asserts the co-restart's kind (in place or new pods), that the group serves
/// again, and with two groups that no request through the router failed.
pub async fn faults_under_load(
    env: &Env,
    ns: &str,
    name: &str,
    groups: i32,
    faults: &[Fault],
    (router, service): (&str, &str),
) -> Result<()> {
    for &f in faults {
        let (r, s, h) = under_load(env, ns, name, f, (router, service))
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
        // The router answers every request, also while no group can take one: refused
        // with a reason at once (503 `no_ready_group`), never left to the network. (A
        // router that took itself out of its Service while the group co-restarted left its
        // clients' connections unanswered — retried SYNs, answered late or not at all.)
        // Only a held engine keeps its requests: with no other group, the router waits on
        // a stall that may pass.
        ensure!(
            !r.outcomes.contains_key(&Outcome::Error.to_string())
                && (f == Fault::EngineHeld
                    || !r.outcomes.contains_key(&Outcome::Timeout.to_string())),
            "{}: requests through the router were not answered: {r}",
            f.label()
        );
        ensure!(
            r.served_again.is_some() && s.served_again.is_some(),
            "{}: not served again after the co-restart (router: {r}; Service: {s})",
            f.label()
        );
    }
    Ok(())
}
