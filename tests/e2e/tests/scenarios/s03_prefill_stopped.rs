//! Scenario 3: a prefill process hangs (SIGSTOP). Its own readiness probe times out and its
//! decode's KV channel goes quiet, so the decode turns not-ready too. SIGCONT within the
//! co-restart window: the group recovers by itself, no co-restart. Left stopped: the group
//! is co-restarted (reason MemberNotReady) once the window has passed, not before.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use kube::ResourceExt;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tandem_e2e::env::Env;
use tandem_e2e::wait;

use crate::common::*;

const WINDOW_S: u64 = 8;

/// Where the time from the co-restart decision to the group's Ready went: each step's
/// offset from the decision, from the pod watch (old members going, new ones created and
/// ready, prefill first).
fn steps_after(
    rec: &PodRecorder,
    stopped: Instant,
    decided: Duration,
    ready: Duration,
    inc: i64,
) -> String {
    let at = |role: &str, incarnation: i64, what: Change| {
        rec.first(|c| c.role == role && c.incarnation == incarnation && c.what == what)
            .map(|(_, c)| {
                let t = c.at.duration_since(stopped).as_secs_f64() - decided.as_secs_f64();
                format!("{t:+.1}s")
            })
            .unwrap_or_else(|| "–".into())
    };
    format!(
        "old prefill terminating {}, gone {}; old decode terminating {}, gone {}; \
         new prefill created {}, ready {}; new decode created {}, ready {}; group Ready {:+.1}s",
        at("prefill", inc, Change::Terminating),
        at("prefill", inc, Change::Deleted),
        at("decode", inc, Change::Terminating),
        at("decode", inc, Change::Deleted),
        at("prefill", inc + 1, Change::Added),
        at("prefill", inc + 1, Change::ContainersReady(true)),
        at("decode", inc + 1, Change::Added),
        at("decode", inc + 1, Change::ContainersReady(true)),
        ready.as_secs_f64() - decided.as_secs_f64(),
    )
}

async fn wait_not_ready(env: &Env, ns: &str, pod: &str, within: Duration) -> Result<()> {
    let api =
        kube::Api::<k8s_openapi::api::core::v1::Pod>::namespaced(env.cluster.client.clone(), ns);
    wait::until(
        &format!("{pod} to report ContainersReady=False"),
        within,
        Duration::from_millis(200),
        || {
            let api = api.clone();
            async move {
                let p = api.get(pod).await?;
                Ok(
                    (pod_condition(&p, "ContainersReady").as_deref() == Some("False"))
                        .then_some(()),
                )
            }
        },
    )
    .await
}

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s03", "pd");
    env.namespace(ns).await?;
    let mut s = spec(name, 1);
    s["spec"]["health"]["coRestartAfterSeconds"] = WINDOW_S.into();
    env.kubectl.apply(ns, &yaml(&s)).await?;
    wait_ready(env, ns, name, 1, Duration::from_secs(180)).await?;

    let prefill = member(env, ns, name, 0, "prefill").await?;
    let decode = member(env, ns, name, 0, "decode").await?;
    let inc = incarnation(&prefill);
    let pid = Pid::from_raw(
        env.pid_of(ns, &prefill.name_any())
            .await
            .context("prefill process")?,
    );

    // 1. Stop, see both members go not-ready, continue within the window.
    let stopped = Instant::now();
    kill(pid, Signal::SIGSTOP)?;
    let r = async {
        wait_not_ready(env, ns, &prefill.name_any(), Duration::from_secs(20)).await?;
        wait_not_ready(env, ns, &decode.name_any(), Duration::from_secs(20)).await
    }
    .await;
    let not_ready_after = stopped.elapsed();
    kill(pid, Signal::SIGCONT)?;
    r?;
    figure(
        "prefill SIGSTOP → prefill and decode not ready",
        format!("{:.1}s", not_ready_after.as_secs_f64()),
    );
    ensure!(
        not_ready_after < Duration::from_secs(WINDOW_S),
        "members took {not_ready_after:?} to turn not-ready; the test needs them well inside the {WINDOW_S}s window"
    );
    wait_ready(env, ns, name, 1, Duration::from_secs(30)).await?;
    let recovered = stopped.elapsed();
    figure(
        "SIGCONT → group Ready again (no co-restart)",
        format!("{:.1}s after the stop", recovered.as_secs_f64()),
    );
    // Past the window: still the same incarnation, the same pods.
    tokio::time::sleep(Duration::from_secs(WINDOW_S + 3).saturating_sub(stopped.elapsed())).await;
    let p = wait_ready(env, ns, name, 1, Duration::from_secs(10)).await?;
    let g = &p.status.as_ref().unwrap().group_statuses[0];
    ensure!(
        g.incarnation == inc && g.co_restarts == 0,
        "a continued prefill caused a co-restart: incarnation {} (was {inc}), {} co-restarts",
        g.incarnation,
        g.co_restarts
    );
    member(env, ns, name, 0, "prefill").await?;
    ensure!(
        member(env, ns, name, 0, "decode").await?.name_any() == decode.name_any(),
        "the decode pod was replaced"
    );

    // 2. Stop and leave it: co-restart after the window, not before. A steady client
    // through the client Service meanwhile (the per-request columns of the recovery table).
    let rec = PodRecorder::start(env, ns).await;
    let load = start_load_through(&service_ip(env, ns, name).await?).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let at = load.now();
    let stopped = Instant::now();
    kill(pid, Signal::SIGSTOP)?;
    wait_not_ready(env, ns, &prefill.name_any(), Duration::from_secs(20)).await?;
    let not_ready_at = stopped.elapsed();
    let p = wait::until(
        "the co-restart of the hung group",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            let p = get_pdd(env, ns, name).await?;
            let g = p
                .status
                .as_ref()
                .and_then(|s| s.group_statuses.first().cloned());
            Ok(g.filter(|g| g.incarnation > inc).map(|_| p))
        },
    )
    .await?;
    let co_restart_at = stopped.elapsed();
    let g = &p.status.as_ref().unwrap().group_statuses[0];
    let reason = g.last_co_restart.as_ref().map(|r| r.reason.as_str());
    ensure!(
        reason == Some("MemberNotReady"),
        "co-restart reason {reason:?}"
    );
    figure(
        "prefill SIGSTOP → co-restart decided",
        format!(
            "{:.1}s (not ready after {:.1}s, window {WINDOW_S}s)",
            co_restart_at.as_secs_f64(),
            not_ready_at.as_secs_f64()
        ),
    );
    ensure!(
        co_restart_at >= Duration::from_secs(WINDOW_S),
        "co-restart after {co_restart_at:?}, before the {WINDOW_S}s window"
    );
    // The stopped prefill ignores SIGTERM; it is deleted with the short grace of an
    // unresponsive member (health.unresponsiveGraceSeconds, 1 s by default: not its pod's 30 s), the
    // kubelet's SIGKILL after it ends it, and the group comes back at the next incarnation.
    let p = wait_ready(env, ns, name, 1, Duration::from_secs(120)).await?;
    let ready_at = stopped.elapsed();
    figure(
        "prefill SIGSTOP → group Ready at the next incarnation",
        format!("{:.1}s", ready_at.as_secs_f64()),
    );
    figure(
        "  after the decision, as the pod watch saw it",
        steps_after(&rec, stopped, co_restart_at, ready_at, inc),
    );
    report_load(
        load,
        at,
        "prefill SIGSTOP, requests through the client Service",
    )
    .await;
    let g = &p.status.as_ref().unwrap().group_statuses[0];
    ensure!(
        g.incarnation == inc + 1,
        "incarnation {} after the co-restart",
        g.incarnation
    );
    let evs = events(env, ns, name).await?;
    ensure!(
        evs.iter()
            .any(|e| e.reason.as_deref() == Some("MemberNotReady")),
        "no MemberNotReady event"
    );
    ensure!(
        evs.iter()
            .any(|e| e.reason.as_deref() == Some("UnresponsiveMemberDeleted")),
        "the stopped prefill was not deleted with the short grace: {:?}",
        evs.iter().map(|e| e.reason.clone()).collect::<Vec<_>>()
    );

    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
