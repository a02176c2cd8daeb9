//! Scenario 21: the router the operator runs for a PDDeployment with `spec.router`. Its
//! Deployment (the operator's image, `tandem-operator router`) becomes Ready under the
//! restricted Pod Security profile; chats through its Service reach the decodes of both
//! groups; while one group's decode is SIGKILLed and the group co-restarts, a steady load
//! through the router fails no request (Ready groups only, one retry before the first
//! byte); afterwards the co-restarted group gets traffic again; after a scale-up to three
//! groups the new group gets traffic too. Prints the counts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use kube::ResourceExt;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tandem_e2e::env::Env;
use tandem_e2e::{http, wait};

use crate::common::*;

/// Chat completions a decode has answered, from its own `/metrics`.
async fn answered(ip: &str) -> Result<u64> {
    let r = http::get(
        &format!("{ip}:{HTTP_PORT}"),
        "/metrics",
        Duration::from_secs(5),
    )
    .await?;
    Ok(r.body
        .lines()
        .filter(|l| {
            l.starts_with("tandem_http_requests_total{")
                && l.contains("/v1/chat/completions")
                && l.contains("status=\"200\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64)
}

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s21", "pd");
    env.namespace(ns).await?;
    let mut pdd = spec(name, 2);
    pdd["spec"]["router"] = serde_json::json!({"replicas": 1});
    env.kubectl.apply(ns, &yaml(&pdd)).await?;
    wait_ready(env, ns, name, 2, Duration::from_secs(180)).await?;

    let router_ip = router_ip(env, ns, name, 2).await?;

    // Both groups get traffic through the router.
    let d0 = member(env, ns, name, 0, "decode").await?;
    let d1 = member(env, ns, name, 1, "decode").await?;
    let (ip0, ip1) = (
        pod_ip(&d0).context("decode 0 IP")?,
        pod_ip(&d1).context("decode 1 IP")?,
    );
    let (before0, before1) = (answered(&ip0).await?, answered(&ip1).await?);
    for i in 0..16 {
        chat(&router_ip, Duration::from_secs(60))
            .await
            .with_context(|| format!("chat {i} through the router"))?;
    }
    let (n0, n1) = (
        answered(&ip0).await? - before0,
        answered(&ip1).await? - before1,
    );
    figure(
        "chats through the router per group",
        format!("group 0: {n0}, group 1: {n1}"),
    );
    ensure!(
        n0 + n1 >= 16 && n0 > 0 && n1 > 0,
        "both groups serve: {n0}, {n1}"
    );

    // A steady load while group 0's decode is killed: no request fails.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let load = {
        let (stop, ok, failed, ip) = (stop.clone(), ok.clone(), failed.clone(), router_ip.clone());
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
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            last_err
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pid = env
        .pid_of(ns, &d0.name_any())
        .await
        .context("decode 0 process")?;
    kill(Pid::from_raw(pid), Signal::SIGKILL)?;
    let p = wait::until(
        "group 0 to be Ready at its next incarnation",
        Duration::from_secs(120),
        Duration::from_millis(500),
        || async {
            let p = get_pdd(env, ns, name).await?;
            let g = p
                .status
                .as_ref()
                .and_then(|s| s.group_statuses.first().cloned());
            Ok(g.filter(|g| {
                g.incarnation > incarnation(&d0)
                    && g.phase == tandem_operator::crd::GroupPhase::Ready
            })
            .map(|_| ()))
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::SeqCst);
    let last_err = load.await?;
    p?;
    let (ok, failed) = (ok.load(Ordering::SeqCst), failed.load(Ordering::SeqCst));
    figure(
        "chats through the router while group 0 co-restarts",
        format!("{ok} ok, {failed} failed"),
    );
    ensure!(
        failed == 0 && ok > 0,
        "no request may fail through the router: {ok} ok, {failed} failed (last error: {last_err:?})"
    );

    // The rebuilt group gets traffic again.
    let d0 = member(env, ns, name, 0, "decode").await?;
    let ip0 = pod_ip(&d0).context("new decode 0 IP")?;
    let before = answered(&ip0).await?;
    wait::until(
        "the router to send to the rebuilt group",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            chat(&router_ip, Duration::from_secs(30)).await?;
            Ok((answered(&ip0).await? > before).then_some(()))
        },
    )
    .await?;

    // A scale-up: the router finds the third group once it is Ready and sends to it. The
    // chats share their prompt's first blocks (the chat template), which the two old
    // groups hold: one at a time they stay there (prefix affinity, by design), so the
    // chats go in bursts, whose load outweighs that affinity.
    merge_patch_pdd(env, ns, name, &serde_json::json!({"spec": {"groups": 3}})).await?;
    wait_ready(env, ns, name, 3, Duration::from_secs(180)).await?;
    let d2 = member(env, ns, name, 2, "decode").await?;
    let ip2 = pod_ip(&d2).context("decode 2 IP")?;
    let before = answered(&ip2).await?;
    let scaled = std::time::Instant::now();
    let mut sent = 0u32;
    let (rip, ip2r) = (router_ip.as_str(), ip2.as_str());
    wait::until(
        "the router to send to the group the scale-up added",
        Duration::from_secs(90),
        Duration::from_millis(200),
        || {
            sent += 6;
            async move {
                let burst = (0..6).map(|_| chat(rip, Duration::from_secs(60)));
                for r in futures::future::join_all(burst).await {
                    r?;
                }
                Ok((answered(ip2r).await? > before).then_some(()))
            }
        },
    )
    .await?;
    figure(
        "router follows a scale-up",
        format!(
            "group 2 answered a chat {:.1} s after it was Ready ({sent} chats sent in bursts of 6)",
            scaled.elapsed().as_secs_f64()
        ),
    );

    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
