//! The end-to-end scenarios against a real control plane (see `tandem_e2e` for what is
//! real). One environment is started for the whole run; scenarios run one after another,
//! each in its own namespace with its own operator replica(s).
//!
//! `cargo test -p tandem-e2e --test scenarios -- [FILTER…]` runs the scenarios whose name
//! contains any FILTER (all without one). Logs: `target/e2e/` (control plane, operator,
//! one file per pod, the harness's own log).

mod common;
mod s01_example;
mod s02_decode_killed;
mod s03_prefill_stopped;
mod s04_rolling;
mod s05_scale;
mod s06_node_lost;
mod s07_delete_recreate;
mod s08_leader;
mod s09_manifests_rbac;
mod s10_validation;

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use futures::FutureExt;
use tandem_e2e::env::Env;

type ScenarioFn = for<'a> fn(&'a Env) -> Pin<Box<dyn Future<Output = anyhow::Result<()>> + 'a>>;

/// Name, time limit, body.
const SCENARIOS: &[(&str, Duration, ScenarioFn)] = &[
    ("s01_example_serves", Duration::from_secs(300), |e| {
        Box::pin(s01_example::run(e))
    }),
    ("s02_decode_killed", Duration::from_secs(300), |e| {
        Box::pin(s02_decode_killed::run(e))
    }),
    ("s03_prefill_stopped", Duration::from_secs(300), |e| {
        Box::pin(s03_prefill_stopped::run(e))
    }),
    ("s04_rolling_update", Duration::from_secs(420), |e| {
        Box::pin(s04_rolling::run(e))
    }),
    ("s05_scale", Duration::from_secs(300), |e| {
        Box::pin(s05_scale::run(e))
    }),
    ("s06_node_lost", Duration::from_secs(360), |e| {
        Box::pin(s06_node_lost::run(e))
    }),
    ("s07_delete_recreate", Duration::from_secs(300), |e| {
        Box::pin(s07_delete_recreate::run(e))
    }),
    ("s08_leader_election", Duration::from_secs(300), |e| {
        Box::pin(s08_leader::run(e))
    }),
    ("s09_manifests_rbac", Duration::from_secs(180), |e| {
        Box::pin(s09_manifests_rbac::run(e))
    }),
    ("s10_validation", Duration::from_secs(120), |e| {
        Box::pin(s10_validation::run(e))
    }),
];

fn main() -> ExitCode {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let selected: Vec<_> = SCENARIOS
        .iter()
        .filter(|(name, _, _)| filters.is_empty() || filters.iter().any(|f| name.contains(f)))
        .collect();
    tandem_e2e::proc::set_pod_exec_binary(env!("CARGO_BIN_EXE_e2e-pod-exec").into());
    let run_dir = tandem_e2e::repo_root().join("target/e2e");
    // Root may own leftovers of a killed run; the logs of the last run are replaced.
    let _ = std::fs::remove_dir_all(&run_dir);
    let _ = std::fs::create_dir_all(&run_dir);
    common::init_logging(&run_dir);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async move {
        println!("running {} e2e scenarios", selected.len());
        let level = tandem_e2e::cluster::pod_security_level();
        if level != "restricted" {
            println!("WARNING: TANDEM_E2E_POD_SECURITY={level}: namespaces are NOT restricted; this run proves less than the suite promises");
        }
        let started = Instant::now();
        let env = match Env::start(&run_dir).await {
            Ok(e) => e,
            Err(e) => {
                println!("e2e environment failed to start: {e:#}");
                println!("logs: {}", run_dir.display());
                println!("0 passed, {} failed", selected.len());
                return ExitCode::FAILURE;
            }
        };
        println!(
            "environment up in {:.1}s (operator RBAC from {})",
            started.elapsed().as_secs_f64(),
            env.rbac_source
        );
        let (mut passed, mut failed) = (0, 0);
        for (name, limit, body) in &selected {
            let t = Instant::now();
            let guarded = AssertUnwindSafe(body(&env)).catch_unwind();
            let outcome = tokio::time::timeout(*limit, guarded).await;
            let secs = t.elapsed().as_secs_f64();
            match outcome {
                Ok(Ok(Ok(()))) => {
                    passed += 1;
                    println!("test {name} ... ok ({secs:.1}s)");
                }
                Ok(Ok(Err(e))) => {
                    failed += 1;
                    println!("test {name} ... FAILED ({secs:.1}s)\n{e:#}\n");
                }
                Ok(Err(panic)) => {
                    failed += 1;
                    let what = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    println!("test {name} ... FAILED ({secs:.1}s): panicked: {what}");
                }
                Err(_) => {
                    failed += 1;
                    println!("test {name} ... FAILED: over its {limit:?} limit");
                }
            }
        }
        env.stop().await;
        println!(
            "e2e total {:.1}s; logs in {}",
            started.elapsed().as_secs_f64(),
            run_dir.display()
        );
        println!("{passed} passed, {failed} failed");
        if failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    })
}
