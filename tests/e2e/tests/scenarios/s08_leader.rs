//! Scenario 8: two operator replicas. Only the Lease holder reconciles and writes (the
//! standby never reconciles; every Event names the leader); a `kubectl` edit of an owned
//! Service or NetworkPolicy is reverted; SIGKILL of the leader (no release) hands the
//! Lease to the standby within the lease duration plus one retry period, and the new
//! leader acts on the next change.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::json;
use tandem_e2e::env::Env;
use tandem_e2e::operator::Operator;
use tandem_e2e::wait;

use crate::common::*;

/// The operator's lease duration and retry period (`leader::ElectionConfig::new`).
const LEASE: Duration = Duration::from_secs(15);
const RETRY: Duration = Duration::from_secs(5);

async fn reconciles(op: &Operator) -> u64 {
    let m = op.metrics().await.unwrap_or_default();
    m.lines()
        .filter(|l| l.starts_with("tandem_operator_reconciles_total"))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s08", "pd");
    env.namespace(ns).await?;
    let mut a = env.operator("s08-a", ns)?;
    a.wait_leading(Duration::from_secs(60)).await?;
    let mut b = env.operator("s08-b", ns)?;
    // b is up and standing by.
    wait::until(
        "the standby's /ready",
        Duration::from_secs(30),
        Duration::from_millis(300),
        || async {
            let r = tandem_e2e::http::get(
                &format!("127.0.0.1:{}", b.metrics_port),
                "/ready",
                Duration::from_secs(2),
            )
            .await;
            Ok(r.ok().filter(|r| r.status == 200).map(|_| ()))
        },
    )
    .await?;
    ensure!(!b.is_leader().await?, "two leaders");

    env.kubectl.apply(ns, &yaml(&spec(name, 1))).await?;
    wait_ready(env, ns, name, 1, Duration::from_secs(180)).await?;

    // Only the leader reconciled and wrote.
    ensure!(reconciles(&a).await > 0, "the leader never reconciled");
    ensure!(reconciles(&b).await == 0, "the standby reconciled");
    let evs = events(env, ns, name).await?;
    ensure!(!evs.is_empty(), "no events");
    for e in &evs {
        let who = e.reporting_instance.clone().unwrap_or_default();
        ensure!(
            who.starts_with("s08-a"),
            "event {:?} reported by {who}",
            e.reason
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

    // SIGKILL the leader: no release, the standby waits for the lease to expire.
    a.kill()?;
    let killed = Instant::now();
    b.wait_leading(LEASE + RETRY + Duration::from_secs(10))
        .await?;
    let takeover = killed.elapsed();
    figure(
        "leader SIGKILL → standby leads",
        format!(
            "{:.1}s (lease {}s, retry {}s)",
            takeover.as_secs_f64(),
            LEASE.as_secs(),
            RETRY.as_secs()
        ),
    );
    ensure!(
        takeover <= LEASE + RETRY + Duration::from_secs(2),
        "takeover took {takeover:?}"
    );
    let _ = a.process.wait(Duration::from_secs(5)).await;

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
            .starts_with("s08-b")),
        "no event from the new leader"
    );

    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    b.stop().await.context("stopping the new leader")?;
    Ok(())
}
