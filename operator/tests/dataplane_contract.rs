//! The contract between the operator and the dataplane: every pod the operator builds
//! (for each example manifest in manifests/examples and a few edge specs) has arguments
//! and environment the real `tandem-dataplane` accepts, and they mean what the spec
//! asked for. Each pod's command line and environment run the binary of this build with
//! `--check-config` (a real child process; it checks everything short of loading the
//! model and prints the effective configuration), the environment resolved as the
//! kubelet would (the group key from a stand-in Secret) and the model path pointed at the
//! cached model. The in-process half of the contract (every rendering read back as it was
//! rendered) is a property test in the dataplane (`config::tests::contract`).
//!
//! Needs `target/<profile>/tandem-dataplane` (see `common::dataplane`).

use std::path::Path;
use std::process::{Command, Output};

use k8s_openapi::api::core::v1::{Container, Pod};
use kube::ResourceExt;
use serde_json::{Value, json};
use tandem_operator::crd::{PDDeployment, RevisionedSpec};
use tandem_operator::names;
use tandem_operator::planner::{PodIntent, Role};
use tandem_operator::resources::{self, DataplaneNetwork};

mod common;

/// What the stand-in Secret holds.
const KEY: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
/// The incarnation the pods are built for (past 2^32: the flag is 64-bit).
const INCARNATION: i64 = (1 << 33) + 7;

fn load(path: &Path) -> PDDeployment {
    let text = std::fs::read_to_string(path).unwrap();
    let mut pdd: PDDeployment = serde_yaml::from_str(&text)
        .unwrap_or_else(|e| panic!("{}: not a PDDeployment: {e}", path.display()));
    pdd.metadata
        .namespace
        .get_or_insert_with(|| "default".into());
    pdd.metadata.uid = Some("uid-contract".into());
    pdd
}

/// The spec's model replaced by the cached one (the pod's path is in a volume that does
/// not exist here).
fn with_cached_model(mut pdd: PDDeployment) -> PDDeployment {
    pdd.spec.model.path = common::model().to_string_lossy().into_owned();
    pdd
}

/// Every pod of group `g` at [`INCARNATION`], as the controller creates them.
fn pods(pdd: &PDDeployment, g: i32) -> Vec<(PodIntent, Pod)> {
    let template = RevisionedSpec::from_spec(&pdd.spec);
    let mut out = Vec::new();
    for (role, replicas) in [
        (Role::Prefill, template.prefill.replicas),
        (Role::Decode, template.decode.replicas),
    ] {
        for index in 0..replicas.max(1) {
            let intent = PodIntent {
                name: names::pod_name(&pdd.name_any(), g, INCARNATION, role, index),
                group: g,
                role,
                index,
                incarnation: INCARNATION,
                revision: template.revision(),
                template: template.clone(),
            };
            let pod = resources::pod(pdd, &intent).unwrap();
            out.push((intent, pod));
        }
    }
    out
}

fn container(pod: &Pod) -> &Container {
    let c = &pod.spec.as_ref().unwrap().containers[0];
    assert_eq!(c.name, resources::CONTAINER);
    c
}

/// The container's environment as the kubelet resolves it. A source the kubelet could
/// resolve but this test does not know fails the test: it must learn it first.
fn resolve_env(pod: &Pod) -> Vec<(String, String)> {
    let c = container(pod);
    let mut out = Vec::new();
    for e in c.env.iter().flatten() {
        let value = match &e.value_from {
            None => e.value.clone().unwrap_or_default(),
            Some(from) => {
                if let Some(s) = &from.secret_key_ref {
                    assert_eq!(e.name, resources::GROUP_KEY_ENV, "{e:?}");
                    assert_eq!(s.key, resources::SECRET_KEY);
                    KEY.to_string()
                } else if let Some(f) = &from.field_ref {
                    match f.field_path.as_str() {
                        "metadata.name" => pod.name_any(),
                        "metadata.namespace" => pod.namespace().unwrap(),
                        other => panic!("env {}: field {other} unknown to this test", e.name),
                    }
                } else {
                    panic!("env {}: a source unknown to this test: {from:?}", e.name)
                }
            }
        };
        out.push((e.name.clone(), value));
    }
    out
}

/// Run the dataplane with `args` and `env` (and nothing else in its environment) and
/// `--check-config`.
fn check(args: &[String], env: &[(String, String)]) -> Output {
    Command::new(common::dataplane())
        .args(args)
        .arg("--check-config")
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("start tandem-dataplane")
}

/// The effective configuration of an accepted invocation.
fn accepted(what: &str, args: &[String], env: &[(String, String)]) -> Value {
    let out = check(args, env);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{what}: refused ({}): {stderr}\nargs: {args:?}\nenv: {env:?}",
        out.status
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{what}: not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// The pod's dataplane accepts its arguments and environment, and the effective
/// configuration is the spec's. Returns the configuration for further checks.
fn assert_pod_matches_spec(pdd: &PDDeployment, intent: &PodIntent, pod: &Pod) -> Value {
    let what = format!("{} pod {}", intent.role.as_str(), pod.name_any());
    let c = container(pod);
    let args = c.args.clone().unwrap_or_default();
    assert!(c.command.is_none(), "{what}: the image's entrypoint runs");
    let v = accepted(&what, &args, &resolve_env(pod));
    let cfg = &v["config"];
    let t = &intent.template;
    let ns = pdd.namespace().unwrap();
    let peers = match intent.role {
        Role::Prefill => json!([]),
        Role::Decode => json!(resources::prefill_peers(
            &pdd.name_any(),
            &ns,
            intent.group,
            t
        )),
    };
    let want = json!({
        "role": intent.role.as_str(),
        "model": t.model.path,
        "served_model_name": t.model.name,
        "host": "0.0.0.0",
        "port": t.transfer.http_port,
        "kv_port": t.transfer.kv_port,
        "prefill_peers": peers,
        "group_incarnation": INCARNATION,
        "group_key": format!("<redacted: {} bytes>", KEY.len()),
        "probe_period_seconds": f64::from(t.health.probe_period_seconds),
        "failure_threshold": t.health.failure_threshold,
        "bootstrap_timeout_seconds": f64::from(t.transfer.bootstrap_timeout_seconds),
        "kv_timeout_seconds": f64::from(t.transfer.kv_timeout_seconds),
        "channel_deadline_ms": t.transfer.channel_deadline_milliseconds,
        "no_progress_seconds": t.health.no_progress_seconds,
    });
    for (k, w) in want.as_object().unwrap() {
        assert_eq!(&cfg[k], w, "{what}: {k} in {cfg:#}");
    }
    assert_eq!(v["derived"]["served_model_name"], t.model.name, "{what}");
    v
}

/// The value that follows `flag` in `args`.
fn arg_after<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

#[test]
fn every_example_manifests_pods_are_accepted_as_the_spec_says() {
    let dir = common::repo().join("manifests/examples");
    let mut checked = 0;
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        if !text.contains("kind: PDDeployment") {
            continue; // the model volume and its Job
        }
        let pdd = with_cached_model(load(&path));
        for (intent, pod) in pods(&pdd, 0) {
            let role_spec = match intent.role {
                Role::Prefill => &pdd.spec.prefill,
                Role::Decode => &pdd.spec.decode,
            };
            let args = container(&pod).args.clone().unwrap_or_default();
            let cuda =
                arg_after(&role_spec.args, "--device").is_some_and(|d| d.starts_with("cuda"));
            let out = check(&args, &resolve_env(&pod));
            if cuda && !out.status.success() {
                // The CUDA example runs the CUDA image's dataplane; a build without CUDA
                // refuses it for that reason alone, and for nothing else.
                let stderr = String::from_utf8_lossy(&out.stderr);
                assert_eq!(out.status.code(), Some(2), "{}: {stderr}", path.display());
                assert!(
                    stderr.contains("built without CUDA support"),
                    "{}: {stderr}",
                    path.display()
                );
                let mut cpu = args.clone();
                let i = cpu.iter().position(|a| a == "--device").unwrap();
                cpu[i + 1] = "cpu".into();
                let mut on_cpu = pod.clone();
                on_cpu.spec.as_mut().unwrap().containers[0].args = Some(cpu);
                let v = assert_pod_matches_spec(&pdd, &intent, &on_cpu);
                assert_user_args(&v, &role_spec.args, true);
            } else {
                let v = assert_pod_matches_spec(&pdd, &intent, &pod);
                assert_user_args(&v, &role_spec.args, false);
            }
            checked += 1;
        }
        eprintln!("{}: every pod accepted", path.display());
    }
    assert!(checked >= 8, "only {checked} pods checked");
}

/// The spec's extra arguments took effect (the ones the examples use).
fn assert_user_args(v: &Value, args: &[String], device_replaced: bool) {
    let cfg = &v["config"];
    for (flag, field) in [("--kv-blocks", "kv_blocks"), ("--max-batch", "max_batch")] {
        if let Some(n) = arg_after(args, flag) {
            assert_eq!(cfg[field], n.parse::<u64>().unwrap(), "{flag} in {cfg}");
        }
    }
    if let Some(d) = arg_after(args, "--device")
        && !device_replaced
    {
        assert_eq!(cfg["device"], if d == "cuda" { "cuda:0" } else { d });
    }
}

#[test]
fn edge_specs_are_accepted_as_the_spec_says() {
    let base = with_cached_model(load(
        &common::repo().join("manifests/examples/smollm2.yaml"),
    ));
    // The longest name the CRD admits (48 characters), with dots; other ports; three
    // prefill replicas; every timing off its default; a group index past 9.
    let mut edge = base.clone();
    edge.metadata.name = Some(format!("a.b-{}", "c".repeat(44)));
    assert_eq!(edge.name_any().len(), 48);
    edge.metadata.namespace = Some("team-a".into());
    let s = &mut edge.spec;
    s.transfer.http_port = 9000;
    s.transfer.kv_port = 7001;
    s.transfer.bootstrap_timeout_seconds = 3;
    s.transfer.kv_timeout_seconds = 45;
    s.transfer.channel_deadline_milliseconds = 2500;
    s.health.probe_period_seconds = 1;
    s.health.failure_threshold = 5;
    s.health.no_progress_seconds = 0;
    s.prefill.replicas = 3;
    s.decode.replicas = 2;
    s.decode.args = vec!["--kv-dtype".into(), "q8_0".into()];
    s.prefill.args = vec!["--kv-dtype".into(), "q8_0".into()];
    // User environment: a dataplane setting by variable, and one that tries to override
    // a setting the operator gives (dropped from the pod: the operator's value wins).
    let user_env = serde_json::from_value(json!([
        {"name": "TANDEM_KV_BLOCKS", "value": "64"},
        {"name": "TANDEM_GROUP_INCARNATION", "value": "999"},
        {"name": "RUST_BACKTRACE", "value": "1"},
    ]))
    .unwrap();
    s.decode.template.env = user_env;
    for g in [0, 11] {
        for (intent, pod) in pods(&edge, g) {
            let names: Vec<String> = resolve_env(&pod).into_iter().map(|(k, _)| k).collect();
            let want: &[&str] = match intent.role {
                Role::Prefill => &[resources::GROUP_KEY_ENV],
                Role::Decode => &[
                    resources::GROUP_KEY_ENV,
                    "TANDEM_KV_BLOCKS",
                    "RUST_BACKTRACE",
                ],
            };
            assert_eq!(names, want, "only the key and the user's own variables");
            let v = assert_pod_matches_spec(&edge, &intent, &pod);
            assert_eq!(v["config"]["kv_dtype"], "q8_0");
            if intent.role == Role::Decode {
                assert_eq!(v["config"]["kv_blocks"], 64, "the user's variable");
                assert_eq!(
                    v["config"]["prefill_peers"].as_array().unwrap().len(),
                    3,
                    "one peer per prefill replica"
                );
                assert_eq!(v["derived"]["liveness_window_seconds"], 5.0);
                // A quarter of the 2.5 s channel deadline.
                assert_eq!(v["derived"]["channel_heartbeat_seconds"], 0.625);
            }
        }
    }

    // The local runtime's invocation of the same intents: loopback host and ports.
    for (intent, _) in pods(&edge, 0) {
        let net = DataplaneNetwork {
            host: Some("127.0.0.1".into()),
            http_port: 41000,
            kv_port: 41001,
            prefill_peers: vec!["127.0.0.1:41011".into(), "127.0.0.1:41021".into()],
        };
        let inv = resources::dataplane_invocation(&edge.name_any(), &intent, &net);
        let pod_name = intent.name.clone();
        let env: Vec<(String, String)> = inv
            .env
            .iter()
            .map(|e| {
                let v = match (&e.value, &e.value_from) {
                    (Some(v), _) => v.clone(),
                    (None, Some(f)) if f.secret_key_ref.is_some() => KEY.into(),
                    (None, Some(_)) => pod_name.clone(),
                    (None, None) => String::new(),
                };
                (e.name.clone(), v)
            })
            .collect();
        let v = accepted(&format!("local {}", intent.name), &inv.args, &env);
        let cfg = &v["config"];
        assert_eq!(
            (&cfg["host"], &cfg["port"], &cfg["kv_port"]),
            (&json!("127.0.0.1"), &json!(41000), &json!(41001))
        );
        if intent.role == Role::Decode {
            assert_eq!(
                cfg["prefill_peers"],
                json!(["127.0.0.1:41011", "127.0.0.1:41021"])
            );
        }
    }
}

#[test]
fn a_renamed_flag_still_works_for_one_release_and_says_so() {
    let pdd = with_cached_model(load(
        &common::repo().join("manifests/examples/smollm2.yaml"),
    ));
    let (_, pod) = pods(&pdd, 0).pop().unwrap();
    let env = resolve_env(&pod);
    let mut args = container(&pod).args.clone().unwrap();
    args.extend(["--drain-secs".into(), "7".into()]);
    let out = check(&args, &env);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("warning: --drain-secs is deprecated")
            && stderr.contains("--drain-seconds"),
        "{stderr}"
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["config"]["drain_seconds"], 7.0);
    // The old variable, too.
    let mut old_env = env.clone();
    old_env.push(("TANDEM_DRAIN_SECS".into(), "4".into()));
    let out = check(&container(&pod).args.clone().unwrap(), &old_env);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("TANDEM_DRAIN_SECS is deprecated"),
        "{stderr}"
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["config"]["drain_seconds"], 4.0);
}

#[test]
fn the_check_can_fail_a_wrong_flag_is_refused() {
    let pdd = with_cached_model(load(
        &common::repo().join("manifests/examples/smollm2.yaml"),
    ));
    let (_, pod) = pods(&pdd, 0).pop().unwrap();
    let env = resolve_env(&pod);
    let mut args = container(&pod).args.clone().unwrap();
    accepted("the unchanged decode pod", &args, &env);

    args.push("--kv-blocs".into());
    args.push("64".into());
    let out = check(&args, &env);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--kv-blocs"), "names the flag: {stderr}");
    assert!(out.stdout.is_empty());

    // Without the group key (a pod whose Secret reference was lost): refused by name.
    let args = container(&pod).args.clone().unwrap();
    let no_key: Vec<_> = env
        .iter()
        .filter(|(k, _)| k != resources::GROUP_KEY_ENV)
        .cloned()
        .collect();
    let out = check(&args, &no_key);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--group-key"), "{stderr}");

    // A spec whose args repeat a flag the operator sets: the dataplane refuses the
    // command line, which is why the operator refuses the spec (reported as InvalidArgs,
    // no pod made).
    let mut repeat = pdd.clone();
    repeat.spec.decode.args = vec!["--port".into(), "9000".into()];
    let why = resources::check_role_args(&repeat.spec).unwrap_err();
    assert!(why.starts_with("spec.decode.args[0]: --port"), "{why}");
    let (_, pod) = pods(&repeat, 0).pop().unwrap();
    let out = check(&container(&pod).args.clone().unwrap(), &resolve_env(&pod));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("'--port <PORT>' cannot be used multiple times"),
        "{stderr}"
    );
    for flag in resources::operator_flags() {
        let mut s = pdd.spec.clone();
        s.prefill.args = vec![format!("{flag}=x")];
        assert!(resources::check_role_args(&s).is_err(), "{flag}");
    }
}
