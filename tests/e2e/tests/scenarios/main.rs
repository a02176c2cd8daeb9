//! The end-to-end scenarios on a real cluster (see `tandem_e2e` for what is real). One
//! environment is started for the whole run, with Tandem installed by `helm install`;
//! each scenario runs in its own namespace, all served by the chart's operator.
//!
//! Order: two lanes first, side by side — the long, mostly waiting scenarios of
//! [`Lane::Beside`] (a load under a 1 % CPU limit, a rolling update, the recovery figures
//! under a steady client) beside the
//! [`Lane::Main`] ones, one after another in each lane — then the [`Lane::Alone`] ones, one
//! at a time with nothing beside them, because they change what every scenario depends on
//! (a node lost, the operator's leader killed, the operator upgraded or uninstalled, the
//! operator's logs read for forbidden answers). A scenario's lines are printed together
//! when it ends, so the two lanes' output does not interleave.
//!
//! `cargo test -p tandem-e2e --test scenarios -- [FILTER…]` runs the scenarios whose name
//! contains any FILTER (all without one). Logs: `target/e2e/` (`logs/`: control plane,
//! nodes; `nodes/<node>/pod-logs/`: every container, the operator's included; the
//! harness's own log).

mod common;
mod recovery;
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
mod s11_prefill_killed;
mod s12_network_policy;
mod s13_partition;
mod s14_sigterm;
mod s15_slow_load;
mod s16_oom_killed;
mod s17_placement;
mod s18_helm_upgrade;
mod s19_helm_uninstall;
mod s20_in_place;
mod s21_router;
mod s22_recovery_load;
mod s23_recovery_prefill;

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use futures::FutureExt;
use tandem_e2e::env::Env;

type ScenarioFn = for<'a> fn(&'a Env) -> Pin<Box<dyn Future<Output = anyhow::Result<()>> + 'a>>;

/// Where a scenario runs (see the module header).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Lane {
    /// One after another, beside the `Beside` lane.
    Main,
    /// One after another, beside the `Main` lane: scenarios that mostly wait.
    Beside,
    /// After both lanes, one at a time, nothing beside it.
    Alone,
}

/// Name, lane, time limit, body.
type Scenario = (&'static str, Lane, Duration, ScenarioFn);

const SCENARIOS: &[Scenario] = &[
    (
        "s01_example_serves",
        Lane::Main,
        Duration::from_secs(300),
        |e| Box::pin(s01_example::run(e)),
    ),
    (
        "s02_decode_killed",
        Lane::Main,
        Duration::from_secs(300),
        |e| Box::pin(s02_decode_killed::run(e)),
    ),
    (
        "s03_prefill_stopped",
        Lane::Main,
        Duration::from_secs(300),
        |e| Box::pin(s03_prefill_stopped::run(e)),
    ),
    (
        "s04_rolling_update",
        Lane::Beside,
        Duration::from_secs(420),
        |e| Box::pin(s04_rolling::run(e)),
    ),
    ("s05_scale", Lane::Main, Duration::from_secs(300), |e| {
        Box::pin(s05_scale::run(e))
    }),
    (
        "s06_node_lost",
        Lane::Alone,
        Duration::from_secs(360),
        |e| Box::pin(s06_node_lost::run(e)),
    ),
    (
        "s07_delete_recreate",
        Lane::Main,
        Duration::from_secs(300),
        |e| Box::pin(s07_delete_recreate::run(e)),
    ),
    (
        "s08_leader_election",
        Lane::Alone,
        Duration::from_secs(300),
        |e| Box::pin(s08_leader::run(e)),
    ),
    (
        "s10_validation",
        Lane::Main,
        Duration::from_secs(120),
        |e| Box::pin(s10_validation::run(e)),
    ),
    (
        "s11_prefill_killed",
        Lane::Main,
        Duration::from_secs(300),
        |e| Box::pin(s11_prefill_killed::run(e)),
    ),
    (
        "s12_network_policy",
        Lane::Main,
        Duration::from_secs(300),
        |e| Box::pin(s12_network_policy::run(e)),
    ),
    ("s13_partition", Lane::Main, Duration::from_secs(240), |e| {
        Box::pin(s13_partition::run(e))
    }),
    ("s20_in_place", Lane::Main, Duration::from_secs(240), |e| {
        Box::pin(s20_in_place::run(e))
    }),
    ("s21_router", Lane::Main, Duration::from_secs(300), |e| {
        Box::pin(s21_router::run(e))
    }),
    (
        "s23_recovery_prefill",
        Lane::Main,
        Duration::from_secs(420),
        |e| Box::pin(s23_recovery_prefill::run(e)),
    ),
    ("s14_sigterm", Lane::Main, Duration::from_secs(300), |e| {
        Box::pin(s14_sigterm::run(e))
    }),
    (
        "s15_slow_load",
        Lane::Beside,
        Duration::from_secs(600),
        |e| Box::pin(s15_slow_load::run(e)),
    ),
    // Beside too: it mostly waits for co-restarts (its two clients' chats are short).
    (
        "s22_recovery_load",
        Lane::Beside,
        Duration::from_secs(600),
        |e| Box::pin(s22_recovery_load::run(e)),
    ),
    (
        "s16_oom_killed",
        Lane::Main,
        Duration::from_secs(360),
        |e| Box::pin(s16_oom_killed::run(e)),
    ),
    ("s17_placement", Lane::Main, Duration::from_secs(300), |e| {
        Box::pin(s17_placement::run(e))
    }),
    // After every scenario the chart's operator served before the upgrade replaces it:
    // its replicas' logs are still on the nodes.
    (
        "s09_manifests_rbac",
        Lane::Alone,
        Duration::from_secs(180),
        |e| Box::pin(s09_manifests_rbac::run(e)),
    ),
    (
        "s18_helm_upgrade",
        Lane::Alone,
        Duration::from_secs(600),
        |e| Box::pin(s18_helm_upgrade::run(e)),
    ),
    // Last: it removes the operator.
    (
        "s19_helm_uninstall",
        Lane::Alone,
        Duration::from_secs(300),
        |e| Box::pin(s19_helm_uninstall::run(e)),
    ),
];

/// `/proc/loadavg`'s first three fields: timings mean little on a loaded machine.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// After a failed scenario: its PDDeployments go (the pods with them), so that what it
/// left running does not take part in the next scenarios (scenario `sNN_…` uses namespace
/// `sNN`; the first one cleans `default` itself).
async fn remove_leftovers(env: &Env, scenario: &str) {
    let ns = scenario.split('_').next().unwrap_or(scenario);
    let _ = env
        .kubectl
        .run(&["delete", "pdd", "--all", "-n", ns, "--wait=false"])
        .await;
}

/// Run a lane's scenarios one after another: (passed, failed).
async fn run_lane(env: &Env, scenarios: Vec<&Scenario>) -> (usize, usize) {
    let (mut passed, mut failed) = (0, 0);
    for scenario in scenarios {
        if run_one(env, scenario).await {
            passed += 1;
        } else {
            failed += 1;
        }
    }
    (passed, failed)
}

/// Run one scenario within its time limit; print what it said, then its result line.
async fn run_one(env: &Env, (name, _, limit, body): &Scenario) -> bool {
    let said = common::Said::default();
    let t = Instant::now();
    let guarded = AssertUnwindSafe(body(env)).catch_unwind();
    let outcome = tokio::time::timeout(*limit, common::capture(&said, guarded)).await;
    let secs = t.elapsed().as_secs_f64();
    let ok = matches!(outcome, Ok(Ok(Ok(()))));
    if !ok {
        remove_leftovers(env, name).await;
    }
    let result = match outcome {
        Ok(Ok(Ok(()))) => format!("test {name} ... ok ({secs:.1}s)"),
        Ok(Ok(Err(e))) => format!("test {name} ... FAILED ({secs:.1}s)\n{e:#}\n"),
        Ok(Err(panic)) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            format!("test {name} ... FAILED ({secs:.1}s): panicked: {what}")
        }
        Err(_) => format!("test {name} ... FAILED: over its {limit:?} limit"),
    };
    for line in said.take() {
        println!("{line}");
    }
    println!("{result}");
    ok
}

fn main() -> ExitCode {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let selected: Vec<&Scenario> = SCENARIOS
        .iter()
        .filter(|(name, _, _, _)| filters.is_empty() || filters.iter().any(|f| name.contains(f)))
        .collect();
    let beside = selected.iter().filter(|s| s.1 == Lane::Beside).count();
    let alone = selected.iter().filter(|s| s.1 == Lane::Alone).count();
    let exec = std::path::PathBuf::from(env!("CARGO_BIN_EXE_e2e-exec"));
    // First of all: into the run's own network, mount and PID namespaces (re-executes
    // this program there).
    if let Err(e) = tandem_e2e::sandbox::enter(&exec) {
        println!("e2e: cannot enter the run's namespaces: {e:#}");
        return ExitCode::FAILURE;
    }
    tandem_e2e::proc::set_exec_binary(exec);
    let run_dir = tandem_e2e::repo_root().join("target/e2e");
    // Root may own leftovers of a killed run; the logs of the last run are replaced.
    let _ = std::fs::remove_dir_all(&run_dir);
    let _ = std::fs::create_dir_all(&run_dir);
    // No symlink in the paths the kubelet and containerd mount under (CI links target/ to
    // a cache directory): mount tables name resolved paths.
    let run_dir = run_dir.canonicalize().unwrap_or(run_dir);
    common::init_logging(&run_dir);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async move {
        println!(
            "running {} e2e scenarios ({beside} in a lane beside the others, then {alone} alone)",
            selected.len()
        );
        let level = tandem_e2e::cluster::pod_security_level();
        if level != "restricted" {
            println!("WARNING: TANDEM_E2E_POD_SECURITY={level}: namespaces are NOT restricted; this run proves less than the suite promises");
        }
        let started = Instant::now();
        let env = match Env::start(&run_dir).await {
            Ok(e) => e,
            Err(e) => {
                Env::clean_up_failed_start(&run_dir).await;
                println!("e2e environment failed to start: {e:#}");
                println!("logs: {}", run_dir.display());
                println!("0 passed, {} failed", selected.len());
                return ExitCode::FAILURE;
            }
        };
        println!(
            "environment up in {:.1}s: 2 nodes Ready, Tandem installed by helm in {:.1}s (load average {})",
            started.elapsed().as_secs_f64(),
            env.install_took.as_secs_f64(),
            load_average()
        );
        // Both lanes, side by side, then the scenarios that run alone.
        let in_lane = |lane: Lane| -> Vec<&Scenario> {
            selected.iter().copied().filter(|s| s.1 == lane).collect()
        };
        let ((p1, f1), (p2, f2)) = tokio::join!(
            run_lane(&env, in_lane(Lane::Main)),
            run_lane(&env, in_lane(Lane::Beside))
        );
        let (p3, f3) = run_lane(&env, in_lane(Lane::Alone)).await;
        let (passed, failed) = (p1 + p2 + p3, f1 + f2 + f3);
        env.stop().await;
        println!(
            "e2e total {:.1}s (load average {}); logs in {}",
            started.elapsed().as_secs_f64(),
            load_average(),
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
