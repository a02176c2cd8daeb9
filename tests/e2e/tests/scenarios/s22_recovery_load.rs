//! Scenario 22: the recovery table's cluster rows for the decode's faults under a steady
//! client (BENCHMARKS.md, "The recovery table"; the machinery in `recovery.rs`). A
//! PDDeployment with the router, first with two groups, then scaled to one; faults of
//! group 0's decode one after another — SIGKILL, SIGSTOP, its KV loop stalled 30 s (two
//! groups only), its engine holding its work without stepping — each while two clients
//! send a chat every 0.5 s (15 s timeout each), one through the router's Service and one
//! through the client Service. For each fault it prints both clients' per-request columns (refused after,
//! longest wait, served again, failed), when the co-restart was decided, when group 0 was
//! Ready again, and whether the weights were reloaded (new pods).
//!
//! It asserts what Tandem promises, not how fast: with two groups no request through the
//! router fails; a stalled KV loop is healed in place (the same pods: weights kept); a
//! killed or stopped decode and an engine that makes no progress get new pods (a reset would keep
//! the stopped process, or the stalled engine thread: the planner reads what stalled from
//! the `/ready` body's `stalled`); after every fault the group serves again through both
//! Services.

use std::time::Duration;

use anyhow::Result;
use serde_json::json;
use tandem_e2e::env::Env;

use crate::common::*;
use crate::recovery::{Fault, deploy, faults_under_load};

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s22", "pd");
    let (router, service) = deploy(env, ns, name, 2).await?;
    let faults = [
        Fault::DecodeSigkill,
        Fault::DecodeSigstop,
        Fault::KvLoopStall,
        Fault::EngineHeld,
    ];
    faults_under_load(env, ns, name, 2, &faults, (&router, &service)).await?;
    // One group: the faults whose handling differs without another group (a stalled KV
    // loop is reset in place alike; s20 shows the one-group in-place reset).
    let faults = [
        Fault::DecodeSigkill,
        Fault::DecodeSigstop,
        Fault::EngineHeld,
    ];
    merge_patch_pdd(env, ns, name, &json!({"spec": {"groups": 1}})).await?;
    wait_ready(env, ns, name, 1, Duration::from_secs(120)).await?;
    let one_group = faults_under_load(env, ns, name, 1, &faults, (&router, &service)).await;
    // The router's log, kept for reading beside the figures (its pod goes with the
    // deployment): target/e2e/s22-router.log.
    if let Ok(log) = env
        .kubectl
        .ok(&["logs", "-n", ns, &format!("deployment/{name}-router")])
        .await
    {
        let _ = std::fs::write(
            tandem_e2e::repo_root().join("target/e2e/s22-router.log"),
            log,
        );
    }
    one_group?;
    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
