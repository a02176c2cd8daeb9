//! Scenario 8: the chart's two operator replicas. Only the Lease holder reconciles and
//! writes (the standby never reconciles; every Event names the leader); a `kubectl` edit of
//! an owned Service or NetworkPolicy is reverted; SIGKILL of the leader's container (no
//! release) hands the Lease to the standby within the lease duration plus one retry
//! period, the kubelet restarts the killed container (the Deployment's restartPolicy
//! Always) as the new standby, and the new leader acts on the next change.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;
use tandem_e2e::env::Env;
use tandem_e2e::operator;
use tandem_e2e::wait;

use crate::common::*;

/// The operator's lease duration and retry period (`leader::ElectionConfig::new`).
const LEASE: Duration = Duration::from_secs(15);
const RETRY: Duration = Duration::from_secs(5);

async fn reconciles(pod: &Pod) -> u64 {
    let m = operator::metrics(pod).await.unwrap_or_default();
    m.lines()
        .filter(|l| l.starts_with("tandem_operator_reconciles_total"))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn restarts(p: &Pod) -> i32 {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .map_or(0, |c| c.restart_count)
}

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s08", "pd");
    env.namespace(ns).await?;
    let client = &env.cluster.client;
    // Both replicas Ready first: s06, which runs just before this one, takes a node and
    // the operator replica on it away, and its replacement may still be starting.
    let t = std::time::Instant::now();
    loop {
        let pdb = env
            .kubectl
            .json(&[
                "get",
                "pdb",
                operator::DEPLOYMENT,
                "-n",
                operator::OPERATOR_NAMESPACE,
            ])
            .await?;
        if pdb["status"]["currentHealthy"] == 2 {
            break;
        }
        ensure!(
            t.elapsed() < Duration::from_secs(180),
            "the operator's two replicas were not Ready within 180 s: {}",
            pdb["status"]
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let a = operator::wait_leader(client, Duration::from_secs(60)).await?;
    let replicas = operator::pods(client).await?;
    ensure!(
        replicas.len() == 2,
        "the chart runs 2 operator replicas; found {:?}",
        replicas.iter().map(|p| p.name_any()).collect::<Vec<_>>()
    );
    let b = replicas
        .into_iter()
        .find(|p| p.name_any() != a.name_any())
        .context("a standby replica")?;
    ensure!(!operator::is_leader(&b).await?, "two leaders");
    let holder = operator::lease_holder(client).await?.unwrap_or_default();
    ensure!(
        holder.starts_with(&a.name_any()),
        "the Lease is held by {holder:?}, the leading replica is {}",
        a.name_any()
    );
    let standby_reconciles = reconciles(&b).await;
    // What the chart promised: a PodDisruptionBudget keeping one replica through voluntary
    // disruptions, and probes the kubelet runs (both replicas Ready through /ready).
    let pdb = env
        .kubectl
        .json(&[
            "get",
            "pdb",
            operator::DEPLOYMENT,
            "-n",
            operator::OPERATOR_NAMESPACE,
        ])
        .await?;
    ensure!(
        pdb["status"]["currentHealthy"] == 2 && pdb["status"]["disruptionsAllowed"] == 1,
        "the operator's PodDisruptionBudget: {}",
        pdb["status"]
    );
    for p in [&a, &b] {
        let c = &p.spec.as_ref().context("pod spec")?.containers[0];
        ensure!(
            c.liveness_probe.is_some()
                && c.readiness_probe.is_some()
                && pod_condition(p, "Ready").as_deref() == Some("True"),
            "operator pod {} lacks its probes or is not Ready",
            p.name_any()
        );
    }

    env.kubectl.apply(ns, &yaml(&spec(name, 1))).await?;
    wait_ready(env, ns, name, 1, Duration::from_secs(180)).await?;

    // Only the leader reconciled and wrote.
    ensure!(reconciles(&a).await > 0, "the leader never reconciled");
    ensure!(
        reconciles(&b).await == standby_reconciles,
        "the standby reconciled"
    );
    let evs = events(env, ns, name).await?;
    ensure!(!evs.is_empty(), "no events");
    for e in &evs {
        let who = e.reporting_instance.clone().unwrap_or_default();
        ensure!(
            who.starts_with(&a.name_any()),
            "event {:?} reported by {who}, not the leader {}",
            e.reason,
            a.name_any()
        );
    }

    // Drift in owned objects is reverted.
    let selector = json!({"spec": {"selector": {"tandem.dev/role": "prefill"}}});
    env.kubectl
        .ok(&[
            "patch",
            "service",
            name,
            "-n",
            ns,
            "--type",
            "merge",
            "-p",
            &selector.to_string(),
        ])
        .await?;
    let edited = Instant::now();
    wait::until(
        "the client Service's selector to be restored",
        Duration::from_secs(30),
        Duration::from_millis(300),
        || async {
            let s = env
                .kubectl
                .json(&["get", "service", name, "-n", ns])
                .await?;
            Ok((s["spec"]["selector"]["tandem.dev/role"] == "decode").then_some(()))
        },
    )
    .await?;
    figure(
        "kubectl edit of the client Service → reverted",
        format!("{:.1}s", edited.elapsed().as_secs_f64()),
    );
    let np = format!("{name}-g0-kv");
    let open = json!({"spec": {"ingress": [{}]}});
    env.kubectl
        .ok(&[
            "patch",
            "networkpolicy",
            &np,
            "-n",
            ns,
            "--type",
            "merge",
            "-p",
            &open.to_string(),
        ])
        .await?;
    let edited = Instant::now();
    wait::until(
        "the NetworkPolicy to be restored",
        Duration::from_secs(30),
        Duration::from_millis(300),
        || async {
            let p = env
                .kubectl
                .json(&["get", "networkpolicy", &np, "-n", ns])
                .await?;
            let rules = p["spec"]["ingress"].as_array().cloned().unwrap_or_default();
            Ok((rules.len() == 2 && !rules[0]["from"].is_null()).then_some(()))
        },
    )
    .await?;
    figure(
        "kubectl edit of a NetworkPolicy → reverted",
        format!("{:.1}s", edited.elapsed().as_secs_f64()),
    );

    // SIGKILL the leader's container: no release; the Lease changes hands only once it
    // expires. Meanwhile the kubelet restarts the killed container in place, so the new
    // leader is the standby or the restarted replica, whichever asks first after expiry.
    let a_restarts = restarts(&a);
    let pid = env
        .pid_of(operator::OPERATOR_NAMESPACE, &a.name_any())
        .await?;
    kill(Pid::from_raw(pid), Signal::SIGKILL)?;
    let killed = Instant::now();
    let new_holder = wait::until(
        "another identity to hold the Lease",
        LEASE + RETRY + Duration::from_secs(10),
        Duration::from_millis(300),
        || async {
            Ok(operator::lease_holder(client)
                .await?
                .filter(|h| *h != holder))
        },
    )
    .await?;
    let takeover = killed.elapsed();
    figure(
        "leader SIGKILL → a new leader",
        format!(
            "{:.1}s (lease {}s, retry {}s; new holder {new_holder})",
            takeover.as_secs_f64(),
            LEASE.as_secs(),
            RETRY.as_secs()
        ),
    );
    ensure!(
        takeover >= LEASE.saturating_sub(RETRY)
            && takeover <= LEASE + RETRY + Duration::from_secs(2),
        "takeover after {takeover:?}: a SIGKILLed leader's Lease must run out first (lease {LEASE:?}, retry {RETRY:?})"
    );
    let api: kube::Api<Pod> = kube::Api::namespaced(client.clone(), operator::OPERATOR_NAMESPACE);
    wait::until(
        "the killed replica's container to be restarted and Ready",
        Duration::from_secs(90),
        Duration::from_millis(500),
        || async {
            let p = api.get(&a.name_any()).await?;
            let ready = pod_condition(&p, "Ready").as_deref() == Some("True");
            Ok((restarts(&p) > a_restarts && ready).then_some(()))
        },
    )
    .await?;
    let leader = operator::wait_leader(client, Duration::from_secs(30)).await?;
    ensure!(
        new_holder.starts_with(&leader.name_any()),
        "replica {} leads, the Lease names {new_holder}",
        leader.name_any()
    );

    // The new leader acts.
    env.kubectl
        .ok(&["scale", "pdd", name, "-n", ns, "--replicas", "2"])
        .await?;
    wait_ready(env, ns, name, 2, Duration::from_secs(180)).await?;
    let evs = events(env, ns, name).await?;
    ensure!(
        evs.iter().any(|e| e
            .reporting_instance
            .as_deref()
            .unwrap_or("")
            .starts_with(new_holder.as_str())),
        "no event from the new leader {new_holder}"
    );

    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
