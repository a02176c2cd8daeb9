//! Scenario 15: a model load slower than the liveness probe tolerates, held by the startup
//! probe. The prefill's CPU limit (a CFS quota the kubelet sets) stretches its load past
//! the liveness window (3 failures × 10 s); the startup probe (`/health` every probe
//! period for `health.startupTimeoutSeconds`) keeps liveness and readiness off until the
//! port opens, so the container is never killed: no restart, no co-restart, the group
//! Ready at its first incarnation.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use kube::ResourceExt;
use serde_json::json;
use tandem_e2e::env::Env;

use crate::common::*;

/// How long the liveness probe alone would let a silent container live:
/// failureThreshold 3 × periodSeconds 10 (operator/src/resources.rs).
const LIVENESS_WINDOW: Duration = Duration::from_secs(30);
/// The prefill's CPU limit, the smallest CFS quota there is (1 ms per 100 ms period):
/// loading SmolLM2-135M from the debug-profile image takes ~0.75 CPU-seconds, so the load
/// stretches to over a minute here (50 s at 15m), twice the liveness window, with room for
/// a faster CPU.
const CPU_LIMIT: &str = "10m";

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s15", "pd");
    env.namespace(ns).await?;
    let mut s = spec(name, 1);
    s["spec"]["prefill"]["template"]["resources"] =
        json!({"requests": {"cpu": "10m", "memory": "128Mi"}, "limits": {"cpu": CPU_LIMIT}});
    s["spec"]["health"]["probePeriodSeconds"] = 2.into();
    s["spec"]["health"]["startupTimeoutSeconds"] = 600.into();
    // The chat at the end is prefilled under the same 1 % of a CPU: while it computes, the
    // prefill can stay silent (no PROGRESS) past the default 10 s KV timeout and miss its
    // readiness probes past `coRestartAfterSeconds` — right for a healthy pod, and not what
    // this scenario is about (CI runs saw `kv_timeout: no progress while waiting_kv`, and a
    // MemberNotReady co-restart, ~20 s after Ready).
    s["spec"]["transfer"]["kvTimeoutSeconds"] = 120.into();
    // Likewise the channel deadline (1 s by default): the prefill's socket loop answers
    // PING while its engine computes, but under a 10m quota the whole process, that loop
    // included, runs a millisecond every 100 ms. Measured with a real CFS quota (cgroup v1,
    // debug binary, SmolLM2, a 60-token prompt): at 10m PONGs took up to 0.8 s and the
    // prefill computing the prompt missed the 1 s deadline (the room failed
    // peer_unresponsive); at 25m the slowest PONG was 0.41 s, at 100m 0.2 s, neither missed it.
    s["spec"]["transfer"]["channelDeadlineMilliseconds"] = 60_000.into();
    s["spec"]["health"]["coRestartAfterSeconds"] = 300.into();
    let rec = PodRecorder::start(env, ns).await;
    env.kubectl.apply(ns, &yaml(&s)).await?;
    let applied = Instant::now();
    let p = wait_ready(env, ns, name, 1, Duration::from_secs(600)).await?;
    let g = &p.status.as_ref().unwrap().group_statuses[0];
    ensure!(
        g.incarnation == 1 && g.co_restarts == 0,
        "the slow load caused a co-restart: incarnation {}, {} co-restarts ({:?})",
        g.incarnation,
        g.co_restarts,
        g.last_co_restart
    );
    let prefill = member(env, ns, name, 0, "prefill").await?;
    let changes = rec.changes();
    let added = changes
        .iter()
        .find(|c| c.pod == prefill.name_any() && c.what == Change::Added)
        .context("the prefill's creation was not seen")?
        .at;
    let ready = changes
        .iter()
        .find(|c| c.pod == prefill.name_any() && c.what == Change::ContainersReady(true))
        .context("the prefill's readiness was not seen")?
        .at;
    let load = ready.duration_since(added);
    figure(
        &format!("prefill load under a {CPU_LIMIT} CPU limit → Ready, not killed"),
        format!(
            "{:.1}s (liveness alone would kill after {}s; group Ready {:.1}s after the apply)",
            load.as_secs_f64(),
            LIVENESS_WINDOW.as_secs(),
            applied.elapsed().as_secs_f64()
        ),
    );
    ensure!(
        load > LIVENESS_WINDOW,
        "the throttled load took only {load:?}, within the liveness window: the scenario no longer proves the startup probe (lower CPU_LIMIT)"
    );
    let statuses = prefill
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.clone())
        .unwrap_or_default();
    ensure!(
        statuses.first().is_some_and(|c| c.restart_count == 0),
        "the prefill container was restarted: {statuses:?}"
    );
    ensure!(
        !changes
            .iter()
            .any(|c| matches!(c.what, Change::Terminated(..)) || c.what == Change::Terminating),
        "a member was killed or deleted during the load: {changes:#?}"
    );
    let ip = pod_ip(&member(env, ns, name, 0, "decode").await?).context("decode IP")?;
    chat(&ip, Duration::from_secs(180)).await?;

    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
