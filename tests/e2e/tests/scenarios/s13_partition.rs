//! Scenario 13: a network partition between a decode and its prefill — a drop rule for
//! the prefill's address in the decode pod's own network namespace (iptables there, not on
//! the node). The decode's channel probe stops getting answers and the kubelet reports it
//! not ready within two of its probe periods after the channel's own failure threshold;
//! the client Service drops it. Healed (the rule removed) within the co-restart window, the
//! channel recovers by itself: Ready again, same incarnation, no co-restart.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::{Api, ResourceExt};
use tandem_e2e::env::Env;
use tandem_e2e::wait;

use crate::common::*;

/// Probe period and failure threshold of the scenario's deployment.
const PERIOD_S: u64 = 1;
const THRESHOLD: u64 = 2;

async fn iptables_in(pid: i32, args: &[&str]) -> Result<()> {
    let netns = format!("--net=/proc/{pid}/ns/net");
    let mut a = vec![netns.as_str(), "iptables"];
    a.extend_from_slice(args);
    tandem_e2e::proc::run("nsenter", &a).await.map(|_| ())
}

async fn wait_containers_ready(
    env: &Env,
    ns: &str,
    pod: &str,
    want: bool,
    within: Duration,
) -> Result<()> {
    let api: Api<Pod> = Api::namespaced(env.cluster.client.clone(), ns);
    let want_s = if want { "True" } else { "False" };
    wait::until(
        &format!("{pod} to report ContainersReady={want_s}"),
        within,
        Duration::from_millis(100),
        || {
            let api = api.clone();
            async move {
                let p = api.get(pod).await?;
                Ok((pod_condition(&p, "ContainersReady").as_deref() == Some(want_s)).then_some(()))
            }
        },
    )
    .await
}

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s13", "pd");
    env.namespace(ns).await?;
    let mut s = spec(name, 1);
    s["spec"]["health"]["probePeriodSeconds"] = PERIOD_S.into();
    s["spec"]["health"]["failureThreshold"] = THRESHOLD.into();
    s["spec"]["health"]["coRestartAfterSeconds"] = 60.into();
    env.kubectl.apply(ns, &yaml(&s)).await?;
    let p = wait_ready(env, ns, name, 1, Duration::from_secs(180)).await?;
    let inc = p.status.as_ref().unwrap().group_statuses[0].incarnation;
    let decode = member(env, ns, name, 0, "decode").await?;
    let prefill = member(env, ns, name, 0, "prefill").await?;
    let prefill_ip = pod_ip(&prefill).context("prefill IP")?;
    let pid = env.pid_of(ns, &decode.name_any()).await?;
    wait_ready_endpoints(env, ns, name, 1).await?;

    let rule = ["-d", prefill_ip.as_str(), "-j", "DROP"];
    // A steady client through the client Service (the per-request columns of the
    // recovery table).
    let load = start_load_through(&service_ip(env, ns, name).await?).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let at = load.now();
    let cut = Instant::now();
    let mut add = vec!["-I", "OUTPUT"];
    add.extend_from_slice(&rule);
    iptables_in(pid, &add).await?;
    let partitioned = async {
        // Channel: THRESHOLD missed PINGs; kubelet: THRESHOLD failed readiness probes.
        let bound = Duration::from_secs(2 * THRESHOLD * PERIOD_S + 2 * PERIOD_S + 1);
        wait_containers_ready(
            env,
            ns,
            &decode.name_any(),
            false,
            bound + Duration::from_secs(10),
        )
        .await?;
        let took = cut.elapsed();
        figure(
            "partition decode ↛ prefill → decode not ready (kubelet)",
            format!(
                "{:.1}s (channel {THRESHOLD}×{PERIOD_S}s + kubelet {THRESHOLD}×{PERIOD_S}s)",
                took.as_secs_f64()
            ),
        );
        ensure!(
            took <= bound,
            "the partitioned decode took {took:?} to turn not ready (bound {bound:?})"
        );
        wait::until(
            "the client Service to drop the partitioned decode",
            Duration::from_secs(15),
            Duration::from_millis(200),
            || async {
                Ok(ready_endpoint_pods(env, ns, name)
                    .await?
                    .is_empty()
                    .then_some(()))
            },
        )
        .await
    }
    .await;
    let mut del = vec!["-D", "OUTPUT"];
    del.extend_from_slice(&rule);
    let healed_at = Instant::now();
    let removed = iptables_in(pid, &del).await;
    partitioned?;
    removed?;
    wait_containers_ready(env, ns, &decode.name_any(), true, Duration::from_secs(30)).await?;
    figure(
        "partition healed → decode ready again",
        format!("{:.1}s", healed_at.elapsed().as_secs_f64()),
    );
    let p = wait_ready(env, ns, name, 1, Duration::from_secs(30)).await?;
    report_load(
        load,
        at,
        "channel partition healed within the window, requests through the client Service",
    )
    .await;
    let g = &p.status.as_ref().unwrap().group_statuses[0];
    ensure!(
        g.incarnation == inc && g.co_restarts == 0,
        "a healed partition caused a co-restart: incarnation {} (was {inc}), {} co-restarts",
        g.incarnation,
        g.co_restarts
    );
    ensure!(
        member(env, ns, name, 0, "decode").await?.name_any() == decode.name_any(),
        "the decode pod was replaced"
    );
    wait_ready_endpoints(env, ns, name, 1).await?;
    chat(
        &pod_ip(&decode).context("decode IP")?,
        Duration::from_secs(60),
    )
    .await?;

    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
