//! Scenario 2: SIGKILL of a decode process. Its group is co-restarted as a unit, decode
//! removed first and prefill rebuilt first (the pod watch and the Events prove the order);
//! the client EndpointSlice drops the group at once; the other group serves throughout.
//! Prints the time from the kill until the group serves again.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use kube::ResourceExt;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tandem_e2e::env::Env;
use tandem_e2e::wait;

use crate::common::*;

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s02", "pd");
    env.namespace(ns).await?;
    env.kubectl.apply(ns, &yaml(&spec(name, 2))).await?;
    wait_ready(env, ns, name, 2, Duration::from_secs(180)).await?;

    let rec = PodRecorder::start(env, ns).await;
    let d0 = member(env, ns, name, 0, "decode").await?;
    let p0 = member(env, ns, name, 0, "prefill").await?;
    let d1 = member(env, ns, name, 1, "decode").await?;
    let p1 = member(env, ns, name, 1, "prefill").await?;
    let inc0 = incarnation(&d0);
    let d1_ip = pod_ip(&d1).context("decode 1 IP")?;

    // The other group serves throughout.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let load = {
        let (stop, ok, failed, ip) = (stop.clone(), ok.clone(), failed.clone(), d1_ip.clone());
        tokio::spawn(async move {
            let mut last_err = None;
            while !stop.load(Ordering::SeqCst) {
                match chat(&ip, Duration::from_secs(30)).await {
                    Ok(_) => ok.fetch_add(1, Ordering::SeqCst),
                    Err(e) => {
                        last_err = Some(format!("{e:#}"));
                        failed.fetch_add(1, Ordering::SeqCst)
                    }
                };
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            last_err
        })
    };

    // And a steady client through the client Service, which holds both groups' decodes
    // (the per-request columns of the recovery table, two groups without the router).
    let service_load = start_load_through(&service_ip(env, ns, name).await?).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let at = service_load.now();
    let pid = env
        .pid_of(ns, &d0.name_any())
        .await
        .context("decode 0 process")?;
    let killed = Instant::now();
    kill(Pid::from_raw(pid), Signal::SIGKILL)?;

    // The client Service drops group 0 long before the group is back.
    wait::until(
        "the client EndpointSlice to drop the killed decode",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async {
            let ready = ready_endpoint_pods(env, ns, name).await?;
            Ok((!ready.contains(&d0.name_any())).then_some(()))
        },
    )
    .await?;
    let dropped = killed.elapsed();

    // Serving again: a new decode of group 0 is a ready endpoint and answers.
    let new_decode = wait::until(
        "group 0 to serve again through the client Service",
        Duration::from_secs(120),
        Duration::from_millis(200),
        || async {
            let eps = endpoints(env, ns, name).await?;
            for e in eps.iter().filter(|e| e.ready && e.pod != d1.name_any()) {
                if e.pod != d0.name_any() && chat(&e.ip, Duration::from_secs(20)).await.is_ok() {
                    return Ok(Some(e.pod.clone()));
                }
            }
            Ok(None)
        },
    )
    .await?;
    let serving_again = killed.elapsed();
    stop.store(true, Ordering::SeqCst);
    let last_err = load.await?;
    report_load(
        service_load,
        at,
        "decode SIGKILL, requests through the client Service",
    )
    .await;

    figure(
        "decode SIGKILL → endpoint removed",
        format!("{:.1}s", dropped.as_secs_f64()),
    );
    figure(
        "decode SIGKILL → group serving again",
        format!("{:.1}s", serving_again.as_secs_f64()),
    );
    let (ok, failed) = (ok.load(Ordering::SeqCst), failed.load(Ordering::SeqCst));
    figure(
        "other group's chats during the co-restart",
        format!("{ok} ok, {failed} failed"),
    );
    ensure!(
        failed == 0 && ok > 0,
        "group 1 must serve throughout: {ok} ok, {failed} failed (last error: {last_err:?})"
    );

    // Order, from the pod watch.
    let p = wait_ready(env, ns, name, 2, Duration::from_secs(60)).await?;
    let g0 = &p.status.as_ref().unwrap().group_statuses[0];
    ensure!(
        g0.incarnation == inc0 + 1,
        "group 0 incarnation {} after one co-restart from {inc0}",
        g0.incarnation
    );
    let changes = rec.changes();
    let idx = |pod: &str, what: Change| {
        changes
            .iter()
            .position(|c| c.pod == pod && c.what == what)
            .with_context(|| format!("no {what:?} for {pod} in {changes:#?}"))
    };
    let new_prefill = changes
        .iter()
        .find(|c| c.group == 0 && c.role == "prefill" && c.incarnation == inc0 + 1)
        .context("no new prefill pod")?
        .pod
        .clone();
    let old_decode_gone = idx(&d0.name_any(), Change::Deleted)?;
    let old_prefill_terminating = idx(&p0.name_any(), Change::Terminating)?;
    let old_prefill_gone = idx(&p0.name_any(), Change::Deleted)?;
    let new_prefill_added = idx(&new_prefill, Change::Added)?;
    let new_prefill_ready = idx(&new_prefill, Change::ContainersReady(true))?;
    let new_decode_added = idx(&new_decode, Change::Added)?;
    ensure!(
        old_decode_gone < old_prefill_terminating,
        "the old prefill was deleted before the old decode was gone"
    );
    ensure!(
        old_prefill_gone < new_prefill_added,
        "the new prefill was created before the old one was gone"
    );
    ensure!(
        new_prefill_ready < new_decode_added,
        "the new decode was created before the new prefill was Ready"
    );
    // Group 1 was not touched.
    for p in [&p1, &d1] {
        ensure!(
            !changes
                .iter()
                .any(|c| c.pod == p.name_any() && c.what == Change::Terminating),
            "{} of the healthy group was deleted",
            p.name_any()
        );
    }

    // Events tell the same story: the co-restart and its reason, then the phases.
    let evs = events(env, ns, name).await?;
    let notes: Vec<String> = evs
        .iter()
        .map(|e| {
            format!(
                "{} {}",
                e.reason.clone().unwrap_or_default(),
                e.note.clone().unwrap_or_default()
            )
        })
        .collect();
    let co = notes
        .iter()
        .position(|n| {
            n.starts_with("MemberFailed")
                && n.contains(&format!("incarnation {inc0} → {}", inc0 + 1))
        })
        .with_context(|| format!("no MemberFailed co-restart event: {notes:#?}"))?;
    ensure!(
        notes[co..]
            .iter()
            .any(|n| n.contains("group 0") && n.contains("→ Ready")),
        "no Ready phase event for group 0 after the co-restart: {notes:#?}"
    );

    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
