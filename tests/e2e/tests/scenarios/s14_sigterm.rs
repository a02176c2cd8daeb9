//! Scenario 14: SIGTERM, as the platform sends it. A decode's process gets SIGTERM (as a
//! runtime stopping it would send): it drains and exits 0 within its drain deadline, and the
//! real kubelet reports the container terminated with exit code 0 (`Completed`), the pod
//! `Succeeded`. Then `kubectl delete pod` of a prefill: the kubelet sends SIGTERM, the
//! prefill exits 0 within the deadline (reported before the pod object goes away). Each
//! time the group is co-restarted and Ready again.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use kube::ResourceExt;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tandem_e2e::env::Env;
use tandem_e2e::wait;

use crate::common::*;

/// `--drain-seconds` of the scenarios' deployment.
const DRAIN: Duration = Duration::from_secs(2);
/// From the exit to the kubelet's status in the API: its PLEG relists every second.
const REPORT_SLACK: Duration = Duration::from_secs(4);

/// Wait for the recorder to see `pod` terminated; returns (reason, exit code, when seen).
async fn terminated_seen(rec: &PodRecorder, pod: &str) -> Result<(String, i32, Instant)> {
    wait::until(
        &format!("the kubelet to report {pod} terminated"),
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            Ok(rec
                .first(|c| c.pod == pod && matches!(c.what, Change::Terminated(..)))
                .and_then(|(_, c)| match c.what {
                    Change::Terminated(r, code) => Some((r, code, c.at)),
                    _ => None,
                }))
        },
    )
    .await
}

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s14", "pd");
    env.namespace(ns).await?;
    env.kubectl.apply(ns, &yaml(&spec(name, 1))).await?;
    let p = wait_ready(env, ns, name, 1, Duration::from_secs(180)).await?;
    let inc = p.status.as_ref().unwrap().group_statuses[0].incarnation;
    let rec = PodRecorder::start(env, ns).await;

    // 1. SIGTERM to the decode's process.
    let decode = member(env, ns, name, 0, "decode").await?.name_any();
    let pid = env.pid_of(ns, &decode).await?;
    let sent = Instant::now();
    kill(Pid::from_raw(pid), Signal::SIGTERM)?;
    let (reason, code, seen) = terminated_seen(&rec, &decode).await?;
    let took = seen.duration_since(sent);
    figure(
        "decode SIGTERM → kubelet reports exit",
        format!("{:.1}s: {reason}, exit code {code}", took.as_secs_f64()),
    );
    ensure!(
        code == 0 && reason == "Completed",
        "the decode's exit after SIGTERM as the kubelet reports it: {reason}, exit code {code}"
    );
    ensure!(
        took <= DRAIN + REPORT_SLACK,
        "the decode took {took:?} to exit and be reported (drain {DRAIN:?})"
    );
    let p = wait_ready_at(env, ns, name, inc + 1).await?;
    let why = p.status.as_ref().unwrap().group_statuses[0]
        .last_co_restart
        .as_ref()
        .map(|r| r.reason.as_str().to_string());
    ensure!(
        why.as_deref() == Some("MemberFailed"),
        "co-restart after the decode's exit: {why:?}"
    );

    // 2. kubectl delete of the prefill: the kubelet's SIGTERM.
    let prefill = member(env, ns, name, 0, "prefill").await?.name_any();
    let sent = Instant::now();
    env.kubectl
        .ok(&["delete", "pod", &prefill, "-n", ns, "--wait=false"])
        .await?;
    let (reason, code, seen) = terminated_seen(&rec, &prefill).await?;
    let took = seen.duration_since(sent);
    figure(
        "kubectl delete prefill → kubelet reports exit",
        format!("{:.1}s: {reason}, exit code {code}", took.as_secs_f64()),
    );
    ensure!(
        code == 0,
        "the prefill's exit after the kubelet's SIGTERM: {reason}, exit code {code}"
    );
    ensure!(
        took <= DRAIN + REPORT_SLACK,
        "the prefill took {took:?} to exit and be reported (drain {DRAIN:?})"
    );
    wait_ready_at(env, ns, name, inc + 2).await?;
    let ip = pod_ip(&member(env, ns, name, 0, "decode").await?).context("decode IP")?;
    chat(&ip, Duration::from_secs(60)).await?;

    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}

async fn wait_ready_at(
    env: &Env,
    ns: &str,
    name: &str,
    inc: i64,
) -> Result<tandem_operator::crd::PDDeployment> {
    wait::until(
        &format!("group 0 Ready at incarnation {inc}"),
        Duration::from_secs(180),
        Duration::from_millis(300),
        || async {
            let p = get_pdd(env, ns, name).await?;
            let st = p.status.clone().unwrap_or_default();
            let ok = st.ready_groups == 1
                && st
                    .group_statuses
                    .first()
                    .is_some_and(|g| g.incarnation == inc);
            Ok(ok.then_some(p))
        },
    )
    .await
}
