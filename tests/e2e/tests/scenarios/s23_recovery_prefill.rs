//! Scenario 23: the recovery table's cluster rows for the prefill's and the session's
//! faults with two groups behind the router, under the steady clients of s22 (the
//! machinery in `recovery.rs`): group 0's prefill SIGSTOPped, SIGKILLed, and reset alone to
//! the next group incarnation. Prints both clients' per-request columns and the
//! co-restart; asserts that no request through the router fails, that the incarnation
//! fault is healed in place (same pods) and the others by new pods, and that the group
//! serves again after each.

use anyhow::Result;
use tandem_e2e::env::Env;

use crate::recovery::{Fault, deploy, faults_under_load};

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s23", "pd");
    let (router, service) = deploy(env, ns, name, 2).await?;
    let faults = [
        Fault::PrefillSigstop,
        Fault::PrefillSigkill,
        Fault::PrefillIncarnation,
    ];
    faults_under_load(env, ns, name, 2, &faults, (&router, &service)).await?;
    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
