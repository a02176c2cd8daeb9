//! Scenario 16: a decode whose memory limit is below what loading the model takes. The
//! kernel's OOM killer ends it inside its cgroup; containerd and the real kubelet report
//! the container `OOMKilled`; the operator co-restarts the group with a `MemberFailed`
//! Event that says so, backing off as it repeats. Raising the limit (a template edit) rolls
//! the group to a revision that loads and serves.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::json;
use tandem_e2e::env::Env;
use tandem_e2e::wait;

use crate::common::*;

/// Below the dataplane's resident memory once the weights are repacked (~100 MB for
/// SmolLM2-135M Q4_1).
const TOO_LITTLE: &str = "40Mi";

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s16", "pd");
    env.namespace(ns).await?;
    let mut s = spec(name, 1);
    s["spec"]["decode"]["template"]["resources"] = json!({"requests": {"cpu": "100m", "memory": TOO_LITTLE}, "limits": {"memory": TOO_LITTLE}});
    let rec = PodRecorder::start(env, ns).await;
    let applied = Instant::now();
    env.kubectl.apply(ns, &yaml(&s)).await?;

    let (pod, reason, code) = wait::until(
        "the kubelet to report a decode OOMKilled",
        Duration::from_secs(180),
        Duration::from_millis(200),
        || async {
            Ok(rec
                .first(|c| c.role == "decode" && matches!(c.what, Change::Terminated(..)))
                .and_then(|(_, c)| match c.what {
                    Change::Terminated(r, code) => Some((c.pod, r, code)),
                    _ => None,
                }))
        },
    )
    .await?;
    figure(
        "decode over its memory limit → kubelet reports",
        format!(
            "{reason}, exit code {code}, {:.1}s after the apply",
            applied.elapsed().as_secs_f64()
        ),
    );
    ensure!(
        reason == "OOMKilled",
        "decode {pod} over a {TOO_LITTLE} limit ended as {reason} (exit code {code})"
    );
    let note = wait::until(
        "a MemberFailed event naming OOMKilled",
        Duration::from_secs(60),
        Duration::from_millis(500),
        || async {
            Ok(events(env, ns, name)
                .await?
                .into_iter()
                .filter(|e| e.reason.as_deref() == Some("MemberFailed"))
                .filter_map(|e| e.note)
                .find(|n| n.contains("OOMKilled")))
        },
    )
    .await?;
    say(format!("    event: MemberFailed {note}"));
    // The status records the co-restart too (written after the Event, in the same
    // reconcile or the next).
    wait::until(
        "the group status to name the MemberFailed co-restart",
        Duration::from_secs(30),
        Duration::from_millis(300),
        || async {
            let p = get_pdd(env, ns, name).await?;
            let g = p
                .status
                .as_ref()
                .and_then(|s| s.group_statuses.first().cloned());
            Ok(g.and_then(|g| g.last_co_restart)
                .filter(|r| r.reason.as_str() == "MemberFailed")
                .map(|_| ()))
        },
    )
    .await?;

    // Enough memory: the next revision serves.
    let fix = json!({"spec": {"decode": {"template": {"resources":
        {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}}}}});
    merge_patch_pdd(env, ns, name, &fix).await?;
    wait_ready(env, ns, name, 1, Duration::from_secs(240)).await?;
    let ip = pod_ip(&member(env, ns, name, 0, "decode").await?).context("decode IP")?;
    chat(&ip, Duration::from_secs(60)).await?;

    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
