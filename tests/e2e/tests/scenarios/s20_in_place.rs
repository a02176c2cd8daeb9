//! Scenario 20: the in-place co-restart on the cluster. The prefill alone is reset to the
//! next group incarnation (a signed admin call, as a prefill that came back with another
//! incarnation under a decode that kept the old one): the decode refuses it
//! (`incarnation_mismatch`), turns not ready, and after the window the operator resets the
//! group in place — prefill first, then decode — over the pods' IPs, signing with the key
//! it reads from the group's Secret. The group is Ready at the next incarnation with the
//! very same pods (names, UIDs) and processes (PIDs): nothing was deleted, no weights
//! reloaded. Prints the time from the fault to the decision and to serving again, and what
//! a steady client saw.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use kube::ResourceExt;
use tandem_e2e::env::Env;
use tandem_e2e::wait;
use tandem_operator::planner::Role;
use tandem_operator::reset_call::{self, ResetReply};

use crate::common::*;

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s20", "pd");
    env.namespace(ns).await?;
    env.kubectl.apply(ns, &yaml(&spec(name, 1))).await?;
    wait_ready(env, ns, name, 1, Duration::from_secs(180)).await?;

    let p = member(env, ns, name, 0, "prefill").await?;
    let d = member(env, ns, name, 0, "decode").await?;
    let inc = incarnation(&p);
    let (p_pid, d_pid) = (
        env.pid_of(ns, &p.name_any())
            .await
            .context("prefill process")?,
        env.pid_of(ns, &d.name_any())
            .await
            .context("decode process")?,
    );
    let key = group_key(env, ns, name, 0).await?;
    let p_ip = pod_ip(&p).context("prefill IP")?;
    let d_ip = pod_ip(&d).context("decode IP")?;
    chat(&d_ip, Duration::from_secs(60)).await?;

    // The fault: the prefill alone moves to the next incarnation, under a steady client
    // through the client Service (the per-request columns of the recovery table).
    let load = start_load_through(&service_ip(env, ns, name).await?).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let at = load.now();
    let fault = Instant::now();
    let addr = format!("{p_ip}:{HTTP_PORT}").parse()?;
    let reply = reset_call::call(addr, Role::Prefill, inc + 1, &key, Duration::from_secs(5)).await;
    ensure!(
        matches!(reply, ResetReply::Ready { reset: true, .. }),
        "the prefill's reset: {reply:?}"
    );

    let decided = wait::until(
        "the operator to begin an in-place reset",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            let pdd = get_pdd(env, ns, name).await?;
            let g = &pdd.status.as_ref().context("status")?.group_statuses[0];
            Ok(g.last_co_restart
                .as_ref()
                .is_some_and(|r| r.in_place && g.incarnation == inc + 1)
                .then(|| fault.elapsed()))
        },
    )
    .await?;
    let pdd = wait_ready(env, ns, name, 1, Duration::from_secs(60)).await?;
    let g = &pdd.status.as_ref().unwrap().group_statuses[0];
    ensure!(
        g.incarnation == inc + 1 && g.co_restarts == 1,
        "group 0 at incarnation {} after {} co-restarts, expected {} after 1",
        g.incarnation,
        g.co_restarts,
        inc + 1
    );
    chat(&d_ip, Duration::from_secs(60)).await?;
    let served = fault.elapsed();

    // The very same pods and processes, at the new incarnation.
    let p2 = member(env, ns, name, 0, "prefill").await?;
    let d2 = member(env, ns, name, 0, "decode").await?;
    for (before, after) in [(&p, &p2), (&d, &d2)] {
        ensure!(
            before.name_any() == after.name_any() && before.uid() == after.uid(),
            "{} was replaced by {}",
            before.name_any(),
            after.name_any()
        );
        ensure!(
            incarnation(after) == inc + 1,
            "{} still labelled incarnation {}",
            after.name_any(),
            incarnation(after)
        );
    }
    ensure!(
        env.pid_of(ns, &p2.name_any()).await? == p_pid
            && env.pid_of(ns, &d2.name_any()).await? == d_pid,
        "the member processes were replaced"
    );
    let evs = events(env, ns, name).await?;
    ensure!(
        evs.iter()
            .any(|e| e.reason.as_deref() == Some("InPlaceResetCompleted")),
        "no InPlaceResetCompleted event"
    );
    figure(
        "prefill incarnation fault → in-place co-restart decided",
        format!("{:.1}s", decided.as_secs_f64()),
    );
    figure(
        "prefill incarnation fault → group serving again (same pods, same processes)",
        format!("{:.1}s", served.as_secs_f64()),
    );
    report_load(
        load,
        at,
        "prefill incarnation fault, requests through the client Service",
    )
    .await;
    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
