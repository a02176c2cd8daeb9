//! Scenario 11: SIGKILL of a prefill container's process on the real node. The kubelet
//! reports the container terminated (exit code 137) and the pod Failed (restartPolicy
//! Never); the operator co-restarts the group — the decode removed, the prefill rebuilt
//! first — with a `MemberFailed` Event that carries what the kubelet reported. Prints the
//! time from the kill until the group is Ready again, and what a steady client saw.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use kube::ResourceExt;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tandem_e2e::env::Env;
use tandem_e2e::wait;

use crate::common::*;

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s11", "pd");
    env.namespace(ns).await?;
    env.kubectl.apply(ns, &yaml(&spec(name, 1))).await?;
    wait_ready(env, ns, name, 1, Duration::from_secs(180)).await?;

    let rec = PodRecorder::start(env, ns).await;
    let prefill = member(env, ns, name, 0, "prefill").await?;
    let decode = member(env, ns, name, 0, "decode").await?;
    let inc = incarnation(&prefill);
    let pid = env
        .pid_of(ns, &prefill.name_any())
        .await
        .context("prefill container")?;
    // A steady client through the client Service while it happens: the per-request
    // columns of the recovery table (one group: nothing to route to meanwhile).
    let load = start_load_through(&service_ip(env, ns, name).await?).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let fault = load.now();
    let killed = Instant::now();
    kill(Pid::from_raw(pid), Signal::SIGKILL)?;

    // The kubelet reports what happened (the pod watch keeps it, whatever the operator
    // does with the pod afterwards).
    let (reason, code) = wait::until(
        "the kubelet to report the killed prefill container",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async {
            Ok(rec
                .first(|c| c.pod == prefill.name_any() && matches!(c.what, Change::Terminated(..)))
                .and_then(|(_, c)| match c.what {
                    Change::Terminated(r, code) => Some((r, code)),
                    _ => None,
                }))
        },
    )
    .await?;
    ensure!(
        code == 137,
        "the killed prefill's exit code as the kubelet reports it: {code} ({reason}); want 137 = 128 + SIGKILL"
    );
    let p = wait::until(
        "group 0 at the next incarnation, Ready",
        Duration::from_secs(180),
        Duration::from_millis(300),
        || async {
            let p = get_pdd(env, ns, name).await?;
            let st = p.status.clone().unwrap_or_default();
            let g = st.group_statuses.first().cloned();
            Ok((st.ready_groups == 1 && g.is_some_and(|g| g.incarnation == inc + 1)).then_some(p))
        },
    )
    .await?;
    figure(
        "prefill SIGKILL → group Ready again (real kubelet)",
        format!("{:.1}s", killed.elapsed().as_secs_f64()),
    );
    report_load(
        load,
        fault,
        "prefill SIGKILL, requests through the client Service",
    )
    .await;
    let g = &p.status.as_ref().unwrap().group_statuses[0];
    let why = g.last_co_restart.as_ref().map(|r| r.reason.as_str());
    ensure!(why == Some("MemberFailed"), "co-restart reason {why:?}");

    // Order: the decode went before the prefill was replaced; the new prefill was Ready
    // before the new decode was created.
    let changes = rec.changes();
    let idx = |pod: &str, what: Change| {
        changes
            .iter()
            .position(|c| c.pod == pod && c.what == what)
            .with_context(|| format!("no {what:?} for {pod} in {changes:#?}"))
    };
    let new = |role: &str| {
        changes
            .iter()
            .find(|c| c.role == role && c.incarnation == inc + 1)
            .map(|c| c.pod.clone())
            .with_context(|| format!("no new {role}"))
    };
    let (new_prefill, new_decode) = (new("prefill")?, new("decode")?);
    ensure!(
        idx(&decode.name_any(), Change::Terminating)? < idx(&new_prefill, Change::Added)?,
        "the new prefill was created before the old decode was deleted"
    );
    ensure!(
        idx(&new_prefill, Change::ContainersReady(true))? < idx(&new_decode, Change::Added)?,
        "the new decode was created before the new prefill was Ready"
    );

    let evs = events(env, ns, name).await?;
    let note = evs
        .iter()
        .filter(|e| e.reason.as_deref() == Some("MemberFailed"))
        .filter_map(|e| e.note.clone())
        .find(|n| n.contains(&prefill.name_any()))
        .with_context(|| {
            format!(
                "no MemberFailed event naming {}: {:?}",
                prefill.name_any(),
                evs.iter().map(|e| e.note.clone()).collect::<Vec<_>>()
            )
        })?;
    ensure!(
        note.contains("exit code 137"),
        "the MemberFailed event does not carry the kubelet's exit code: {note}"
    );
    say(format!("    event: MemberFailed {note}"));
    let ip = pod_ip(&member(env, ns, name, 0, "decode").await?).context("decode IP")?;
    chat(&ip, Duration::from_secs(60)).await?;

    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
