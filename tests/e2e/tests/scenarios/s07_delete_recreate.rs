//! Scenario 7: deleting a PDDeployment garbage-collects everything it owns (pods,
//! Services, NetworkPolicies, Secrets). Recreating it under the same name at once must not
//! adopt the old objects while the collector is still removing them: every object the new
//! deployment uses is owned by the new UID, and its group key is a new one.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use tandem_e2e::env::Env;
use tandem_e2e::wait;

use crate::common::*;

const KINDS: &str = "pods,services,networkpolicies,secrets";

/// `(kind/name, controller owner UID)` of every object labelled for the deployment.
async fn owned(env: &Env, ns: &str, name: &str) -> Result<Vec<(String, String)>> {
    let list = env
        .kubectl
        .json(&[
            "get",
            KINDS,
            "-n",
            ns,
            "-l",
            &format!("tandem.dev/deployment={name}"),
        ])
        .await?;
    let mut out = Vec::new();
    for item in list["items"].as_array().cloned().unwrap_or_default() {
        let owner = item["metadata"]["ownerReferences"]
            .as_array()
            .and_then(|refs| refs.iter().find(|r| r["controller"] == true))
            .map(|r| r["uid"].as_str().unwrap_or("").to_string())
            .unwrap_or_default();
        out.push((
            format!(
                "{}/{}",
                item["kind"].as_str().unwrap_or(""),
                item["metadata"]["name"].as_str().unwrap_or("")
            ),
            owner,
        ));
    }
    out.sort();
    Ok(out)
}

async fn group_key(env: &Env, ns: &str, name: &str) -> Result<String> {
    let s: Value = env
        .kubectl
        .json(&["get", "secret", &format!("{name}-g0-key"), "-n", ns])
        .await?;
    Ok(s["data"]["key"]
        .as_str()
        .context("key in the secret")?
        .to_string())
}

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s07", "pd");
    env.namespace(ns).await?;
    let manifest = yaml(&spec(name, 1));

    // Plain deletion: the garbage collector removes every child.
    env.kubectl.apply(ns, &manifest).await?;
    wait_ready(env, ns, name, 1, Duration::from_secs(180)).await?;
    let children = owned(env, ns, name).await?;
    ensure!(
        children.len() >= 6,
        "children before deletion: {children:?}"
    );
    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    wait::until_seen(
        "garbage collection of every child",
        Duration::from_secs(90),
        Duration::from_millis(500),
        || async {
            let left = owned(env, ns, name).await?;
            Ok(if left.is_empty() { Ok(()) } else { Err(left) })
        },
    )
    .await?;

    // Recreate at once after a deletion.
    env.kubectl.apply(ns, &manifest).await?;
    wait_ready(env, ns, name, 1, Duration::from_secs(180)).await?;
    let old_uid = get_pdd(env, ns, name).await?.metadata.uid.context("uid")?;
    let old_key = group_key(env, ns, name).await?;
    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=false"])
        .await?;
    env.kubectl.apply(ns, &manifest).await?;
    let new_uid = get_pdd(env, ns, name).await?.metadata.uid.context("uid")?;
    ensure!(
        new_uid != old_uid,
        "the recreated deployment has the old UID"
    );

    wait_ready(env, ns, name, 1, Duration::from_secs(240)).await?;
    let objects = wait::until_seen(
        "every child to belong to the new deployment",
        Duration::from_secs(90),
        Duration::from_millis(500),
        || async {
            let all = owned(env, ns, name).await?;
            let ok = !all.is_empty() && all.iter().all(|(_, uid)| *uid == new_uid);
            Ok(if ok { Ok(all) } else { Err(all) })
        },
    )
    .await?;
    ensure!(
        objects.iter().any(|(k, _)| k.starts_with("Secret/")),
        "no group Secret: {objects:?}"
    );
    let new_key = group_key(env, ns, name).await?;
    ensure!(
        new_key != old_key,
        "the new deployment reuses the old group key"
    );
    let p = get_pdd(env, ns, name).await?;
    let g = &p.status.as_ref().unwrap().group_statuses[0];
    ensure!(
        g.co_restarts == 0,
        "the new deployment's group was co-restarted {} times: {:?}",
        g.co_restarts,
        g.last_co_restart
    );
    for d in pods(env, ns, name).await? {
        if role(&d) == "decode" {
            chat(&pod_ip(&d).context("decode IP")?, Duration::from_secs(60)).await?;
        }
    }

    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
