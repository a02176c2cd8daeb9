//! Scenario 10: resources the operator could never serve are refused by the API server
//! itself (the CRD's OpenAPI bounds and CEL rules), each with a message that names what is
//! wrong — among them role `args` whose pods could never start (an operator flag repeated)
//! or never pair (a KV dtype only one role sets); the longest valid name, and roles that
//! agree on a KV dtype, are accepted.

use anyhow::{Result, ensure};
use serde_json::{Value, json};
use tandem_e2e::env::Env;

use crate::common::*;

/// The longest name whose children (`<name>-g<group>-bootstrap`, at most 999 groups) are
/// valid Service names.
pub const MAX_NAME: usize = 48;

fn with(mut v: Value, path: &[&str], value: Value) -> Value {
    let mut at = &mut v;
    for p in &path[..path.len() - 1] {
        at = &mut at[*p];
    }
    at[path[path.len() - 1]] = value;
    v
}

pub async fn run(env: &Env) -> Result<()> {
    let ns = "s10";
    env.namespace(ns).await?;
    let good = spec("ok", 1);
    let long: String = std::iter::once('a')
        .chain("bcdefghij0".chars().cycle())
        .take(60)
        .collect();
    let cases: Vec<(&str, Value, &[&str])> = vec![
        (
            "a name with dots",
            with(good.clone(), &["metadata", "name"], json!("llama-3.1-8b")),
            &["metadata.name", "DNS-1035"],
        ),
        (
            "a 60-character name",
            with(good.clone(), &["metadata", "name"], json!(long)),
            &["metadata.name", "48"],
        ),
        (
            "httpPort == kvPort",
            with(good.clone(), &["spec", "transfer", "kvPort"], json!(8000)),
            &["httpPort", "kvPort"],
        ),
        (
            "a volume with both sources",
            with(
                good.clone(),
                &["spec", "model", "volume"],
                json!({"claimName": "models", "hostPath": "/models", "mountPath": "/models"}),
            ),
            &["claimName", "hostPath"],
        ),
        (
            "a volume with no source",
            with(
                good.clone(),
                &["spec", "model", "volume"],
                json!({"mountPath": "/models"}),
            ),
            &["claimName", "hostPath"],
        ),
        (
            "duplicate env names",
            with(
                good.clone(),
                &["spec", "decode", "template", "env"],
                json!([{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]),
            ),
            &["env", "Duplicate"],
        ),
        (
            "a zero timeout",
            with(
                good.clone(),
                &["spec", "transfer", "kvTimeoutSeconds"],
                json!(0),
            ),
            &["kvTimeoutSeconds", "greater than or equal to 1"],
        ),
        (
            "a negative timeout",
            with(
                good.clone(),
                &["spec", "transfer", "bootstrapTimeoutSeconds"],
                json!(-5),
            ),
            &["bootstrapTimeoutSeconds", "greater than or equal to 1"],
        ),
        (
            "args repeating an operator flag",
            with(
                good.clone(),
                &["spec", "decode", "args"],
                json!(["--max-batch=8", "--port=9000"]),
            ),
            &["spec.decode.args", "--port", "may not repeat"],
        ),
        (
            "a KV dtype only the prefill sets",
            with(
                good.clone(),
                &["spec", "prefill", "args"],
                json!(["--kv-dtype=q8_0"]),
            ),
            &["spec.prefill.args and spec.decode.args", "--kv-dtype"],
        ),
        (
            "--kv-dtype as two arguments",
            with(
                good.clone(),
                &["spec", "prefill", "args"],
                json!(["--kv-dtype", "q8_0"]),
            ),
            &["spec.prefill.args", "--kv-dtype=VALUE"],
        ),
        (
            "a negative co-restart window",
            with(
                good.clone(),
                &["spec", "health", "coRestartAfterSeconds"],
                json!(-1),
            ),
            &["coRestartAfterSeconds", "greater than or equal to 1"],
        ),
    ];
    let mut messages = Vec::new();
    for (what, obj, needles) in &cases {
        let out = env
            .kubectl
            .run_with(&["apply", "-n", ns, "-f", "-"], Some(&yaml(obj)))
            .await?;
        ensure!(!out.success, "{what} was accepted");
        let msg = out.stderr.trim().to_string();
        for n in *needles {
            ensure!(
                msg.contains(n),
                "{what}: the message does not name {n:?}: {msg}"
            );
        }
        messages.push(format!("{what}: {msg}"));
    }
    for m in &messages {
        say(format!("    rejected: {m}"));
    }

    // The boundary: the longest valid name is accepted (a server-side dry run).
    let name: String = std::iter::once('a')
        .chain("bcdefghij0".chars().cycle())
        .take(MAX_NAME - 1)
        .chain(std::iter::once('z'))
        .collect();
    let obj = with(good.clone(), &["metadata", "name"], json!(name));
    accepted(env, ns, &obj, &format!("a {MAX_NAME}-character name")).await?;
    // And roles that agree on a KV dtype other than the default, with other args.
    let both = with(
        with(
            good,
            &["spec", "prefill", "args"],
            json!(["--kv-dtype=q8_0"]),
        ),
        &["spec", "decode", "args"],
        json!(["--max-batch=8", "--kv-dtype=q8_0"]),
    );
    accepted(env, ns, &both, "roles agreeing on --kv-dtype=q8_0").await?;
    Ok(())
}

/// `obj` passes the API server's validation (a server-side dry run).
async fn accepted(env: &Env, ns: &str, obj: &Value, what: &str) -> Result<()> {
    let out = env
        .kubectl
        .run_with(
            &["apply", "--dry-run=server", "-n", ns, "-f", "-"],
            Some(&yaml(obj)),
        )
        .await?;
    ensure!(out.success, "{what} was refused: {}", out.stderr.trim());
    Ok(())
}
