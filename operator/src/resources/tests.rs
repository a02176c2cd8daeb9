use super::*;
use crate::crd::{ModelVolume, PDDeploymentSpec};
use crate::testutil;

fn pdd(spec: PDDeploymentSpec) -> PDDeployment {
    let mut p = PDDeployment::new("demo", spec);
    p.metadata.namespace = Some("ns1".into());
    p.metadata.uid = Some("uid-1".into());
    p
}

fn intent(p: &PDDeployment, role: Role, index: i32) -> PodIntent {
    PodIntent {
        name: names::pod_name("demo", 2, 3, role, index),
        group: 2,
        role,
        index,
        incarnation: 3,
        revision: "rev1".into(),
        template: RevisionedSpec::from_spec(&p.spec),
    }
}

fn env_of(pod: &Pod) -> BTreeMap<String, EnvVar> {
    pod.spec.as_ref().unwrap().containers[0]
        .env
        .clone()
        .unwrap()
        .into_iter()
        .map(|e| (e.name.clone(), e))
        .collect()
}

fn value<'a>(env: &'a BTreeMap<String, EnvVar>, name: &str) -> &'a str {
    env[name].value.as_deref().unwrap()
}

fn assert_owned(meta: &ObjectMeta) {
    let refs = meta.owner_references.as_ref().unwrap();
    assert_eq!(refs.len(), 1);
    let r = &refs[0];
    assert_eq!(r.api_version, "tandem.dev/v1alpha1");
    assert_eq!(r.kind, "PDDeployment");
    assert_eq!(r.name, "demo");
    assert_eq!(r.uid, "uid-1");
    assert_eq!(r.controller, Some(true));
    assert_eq!(r.block_owner_deletion, Some(true));
    assert_eq!(meta.namespace.as_deref(), Some("ns1"));
    let l = meta.labels.as_ref().unwrap();
    assert_eq!(l[labels::DEPLOYMENT], "demo");
    assert_eq!(l[labels::MANAGED_BY], "tandem-operator");
}

#[test]
fn prefill_pod_has_labels_owner_hostname_ports_and_no_gate() {
    let mut spec = testutil::spec(3);
    spec.prefill
        .template
        .labels
        .insert("team".into(), "ml".into());
    spec.prefill
        .template
        .labels
        .insert(labels::ROLE.into(), "bogus".into());
    spec.prefill.args = vec!["--threads".into(), "4".into()];
    let p = pdd(spec);
    let pod = pod(&p, &intent(&p, Role::Prefill, 1)).unwrap();
    assert_owned(&pod.metadata);
    assert_eq!(pod.metadata.name.as_deref(), Some("demo-g2-i3-p1"));
    let l = pod.metadata.labels.as_ref().unwrap();
    assert_eq!(l[labels::GROUP], "2");
    assert_eq!(l[labels::ROLE], "prefill", "operator labels win");
    assert_eq!(l[labels::REVISION], "rev1");
    assert_eq!(l[labels::INCARNATION], "3");
    assert_eq!(l["team"], "ml");

    let spec = pod.spec.as_ref().unwrap();
    assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
    assert_eq!(spec.readiness_gates, None);
    assert_eq!(spec.hostname.as_deref(), Some("prefill-1"));
    assert_eq!(spec.subdomain.as_deref(), Some("demo-g2-bootstrap"));
    let c = &spec.containers[0];
    assert_eq!(c.name, "dataplane");
    assert_eq!(c.image.as_deref(), Some("tandem:1"));
    assert_eq!(
        c.args.as_ref().unwrap(),
        &[
            "--role=prefill",
            "--model=/models/smollm2.gguf",
            "--served-model-name=smollm2",
            "--port=8000",
            "--kv-port=5600",
            "--group-incarnation=3",
            "--probe-period-seconds=2",
            "--failure-threshold=3",
            "--bootstrap-timeout-seconds=10",
            "--kv-timeout-seconds=10",
            "--channel-deadline-ms=1000",
            "--no-progress-seconds=30",
            "--threads",
            "4"
        ]
    );
    let ports: Vec<_> = c
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .map(|p| (p.name.clone().unwrap(), p.container_port))
        .collect();
    assert_eq!(ports, [("http".into(), 8000), ("kv".into(), 5600)]);
    let ready = c.readiness_probe.as_ref().unwrap();
    assert_eq!(
        ready.http_get.as_ref().unwrap().path.as_deref(),
        Some("/ready")
    );
    assert_eq!(ready.period_seconds, Some(2));
    assert_eq!(ready.failure_threshold, Some(3));
    let live = c.liveness_probe.as_ref().unwrap();
    assert_eq!(
        live.http_get.as_ref().unwrap().path.as_deref(),
        Some("/health")
    );

    // The environment carries the group key only: every other setting is a flag.
    let env = env_of(&pod);
    assert_eq!(env.keys().collect::<Vec<_>>(), ["TANDEM_GROUP_KEY"]);
    let key = env["TANDEM_GROUP_KEY"].value_from.as_ref().unwrap();
    let key = key.secret_key_ref.as_ref().unwrap();
    assert_eq!(
        (key.name.as_str(), key.key.as_str()),
        ("demo-g2-key", "key")
    );
}

#[test]
fn decode_pod_has_gate_peers_and_the_key_in_its_env() {
    let mut spec = testutil::spec(3);
    spec.prefill.replicas = 2;
    spec.decode.args = vec!["--max-batch".into(), "8".into()];
    spec.decode.template.env = vec![
        EnvVar {
            name: "RUST_LOG".into(),
            value: Some("debug".into()),
            ..Default::default()
        },
        EnvVar {
            name: "TANDEM_ROLE".into(),
            value: Some("prefill".into()),
            ..Default::default()
        },
    ];
    spec.decode
        .template
        .node_selector
        .insert("gpu".into(), "h100".into());
    spec.decode.template.service_account_name = Some("sa".into());
    spec.decode
        .template
        .annotations
        .insert("a".into(), "b".into());
    let p = pdd(spec);
    let pod = pod(&p, &intent(&p, Role::Decode, 0)).unwrap();
    assert_owned(&pod.metadata);
    assert_eq!(pod.metadata.annotations.as_ref().unwrap()["a"], "b");
    let s = pod.spec.as_ref().unwrap();
    let gates = s.readiness_gates.as_ref().unwrap();
    assert_eq!(gates.len(), 1);
    assert_eq!(gates[0].condition_type, "tandem.dev/group-ready");
    assert_eq!(s.hostname, None);
    assert_eq!(s.subdomain, None);
    assert_eq!(s.node_selector.as_ref().unwrap()["gpu"], "h100");
    assert_eq!(s.service_account_name.as_deref(), Some("sa"));
    let c = &s.containers[0];
    let peers = "prefill-0.demo-g2-bootstrap.ns1.svc:5600,prefill-1.demo-g2-bootstrap.ns1.svc:5600";
    let args = c.args.as_ref().unwrap();
    assert_eq!(args[0], "--role=decode");
    assert_eq!(
        &args[5..],
        [
            &format!("--prefill={peers}"),
            "--group-incarnation=3",
            "--probe-period-seconds=2",
            "--failure-threshold=3",
            "--bootstrap-timeout-seconds=10",
            "--kv-timeout-seconds=10",
            "--channel-deadline-ms=1000",
            "--no-progress-seconds=30",
            "--max-batch",
            "8"
        ]
    );
    let ports: Vec<_> = c
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .map(|p| p.container_port)
        .collect();
    assert_eq!(ports, [8000], "decode exposes no KV port");

    // The user's variables follow the key; one that names a setting the operator gives
    // (TANDEM_ROLE here) is left out: the flag would win, and it would only mislead.
    let env = env_of(&pod);
    assert_eq!(value(&env, "RUST_LOG"), "debug");
    assert!(!env.contains_key("TANDEM_ROLE"));
    let names: Vec<_> = c
        .env
        .as_ref()
        .unwrap()
        .iter()
        .map(|e| e.name.as_str())
        .collect();
    assert_eq!(names, ["TANDEM_GROUP_KEY", "RUST_LOG"]);
}

#[test]
fn the_invocation_takes_its_network_from_the_executor() {
    let p = pdd(testutil::spec(3));
    let i = intent(&p, Role::Decode, 0);
    // The pod's: no --host, the spec's ports, the prefills' DNS names.
    let pod = pod(&p, &i).unwrap();
    let c = &pod.spec.unwrap().containers[0];
    let cluster =
        dataplane_invocation("demo", &i, &DataplaneNetwork::in_cluster("demo", "ns1", &i));
    assert_eq!(c.args.as_ref(), Some(&cluster.args));
    assert_eq!(c.env.as_ref(), Some(&cluster.env));
    assert!(!cluster.args.contains(&"--host".to_string()));
    // The local runtime's: loopback, its own ports, the prefills' loopback addresses;
    // everything else the same.
    let local = dataplane_invocation(
        "demo",
        &i,
        &DataplaneNetwork {
            host: Some("127.0.0.1".into()),
            http_port: 41000,
            kv_port: 41001,
            prefill_peers: vec!["127.0.0.1:42001".into()],
        },
    );
    assert_eq!(
        local.args,
        [
            "--role=decode",
            "--model=/models/smollm2.gguf",
            "--served-model-name=smollm2",
            "--host=127.0.0.1",
            "--port=41000",
            "--kv-port=41001",
            "--prefill=127.0.0.1:42001",
            "--group-incarnation=3",
            "--probe-period-seconds=2",
            "--failure-threshold=3",
            "--bootstrap-timeout-seconds=10",
            "--kv-timeout-seconds=10",
            "--channel-deadline-ms=1000",
            "--no-progress-seconds=30",
        ]
    );
    assert_eq!(local.env, cluster.env, "the key, the same way");
}

#[test]
fn pod_uses_the_intent_template_not_the_live_spec() {
    let p = pdd(testutil::spec(1));
    let mut i = intent(&p, Role::Prefill, 0);
    i.template.prefill.template.image = "tandem:old".into();
    let pod = pod(&p, &i).unwrap();
    let c = &pod.spec.unwrap().containers[0];
    assert_eq!(c.image.as_deref(), Some("tandem:old"));
}

#[test]
fn model_volume_is_mounted_read_only() {
    let mut spec = testutil::spec(1);
    spec.model.volume = Some(ModelVolume {
        claim_name: Some("models".into()),
        host_path: None,
        mount_path: "/models".into(),
    });
    let p = pdd(spec);
    let pod = pod(&p, &intent(&p, Role::Decode, 0)).unwrap();
    let s = pod.spec.unwrap();
    let v = &s.volumes.unwrap()[0];
    let pvc = v.persistent_volume_claim.as_ref().unwrap();
    assert_eq!(
        (pvc.claim_name.as_str(), pvc.read_only),
        ("models", Some(true))
    );
    let m = &s.containers[0].volume_mounts.as_ref().unwrap()[0];
    assert_eq!(
        (m.mount_path.as_str(), m.read_only),
        ("/models", Some(true))
    );

    let mut spec = testutil::spec(1);
    spec.model.volume = Some(ModelVolume {
        claim_name: None,
        host_path: Some("/data/models".into()),
        mount_path: "/m".into(),
    });
    let p = pdd(spec);
    let s = super::pod(&p, &intent(&p, Role::Prefill, 0))
        .unwrap()
        .spec
        .unwrap();
    let hp = s.volumes.unwrap()[0].host_path.clone().unwrap();
    assert_eq!(hp.path, "/data/models");

    let p = pdd(testutil::spec(1));
    let s = super::pod(&p, &intent(&p, Role::Prefill, 0))
        .unwrap()
        .spec
        .unwrap();
    assert_eq!(s.volumes, None);
    assert_eq!(s.containers[0].volume_mounts, None);
}

#[test]
fn services_select_the_right_pods() {
    let p = pdd(testutil::spec(2));
    let client = client_service(&p).unwrap();
    assert_owned(&client.metadata);
    assert_eq!(client.metadata.name.as_deref(), Some("demo"));
    let s = client.spec.unwrap();
    assert_eq!(
        s.selector.unwrap(),
        BTreeMap::from([
            (labels::DEPLOYMENT.into(), "demo".into()),
            (labels::ROLE.into(), "decode".into())
        ])
    );
    assert_eq!(s.ports.unwrap()[0].port, 8000);
    assert_eq!(s.cluster_ip, None);

    let g = group_service(&p, 1).unwrap();
    assert_owned(&g.metadata);
    assert_eq!(g.metadata.name.as_deref(), Some("demo-g1-bootstrap"));
    assert_eq!(g.metadata.labels.as_ref().unwrap()[labels::GROUP], "1");
    let s = g.spec.unwrap();
    assert_eq!(s.cluster_ip.as_deref(), Some("None"));
    assert_eq!(s.publish_not_ready_addresses, Some(true));
    assert_eq!(s.selector.unwrap(), role_selector("demo", 1, Role::Prefill));
    let ports: Vec<_> = s
        .ports
        .unwrap()
        .into_iter()
        .map(|p| (p.name.unwrap(), p.port))
        .collect();
    assert_eq!(ports, [("kv".into(), 5600), ("http".into(), 8000)]);
}

#[test]
fn network_policy_admits_kv_only_from_the_groups_decode() {
    let p = pdd(testutil::spec(2));
    let np = network_policy(&p, 1).unwrap();
    assert_owned(&np.metadata);
    assert_eq!(np.metadata.name.as_deref(), Some("demo-g1-kv"));
    let s = np.spec.unwrap();
    assert_eq!(
        s.pod_selector.unwrap().match_labels.unwrap(),
        role_selector("demo", 1, Role::Prefill)
    );
    assert_eq!(s.policy_types.unwrap(), ["Ingress"]);
    let rules = s.ingress.unwrap();
    assert_eq!(rules.len(), 2);
    let from = rules[0].from.as_ref().unwrap();
    assert_eq!(from.len(), 1);
    assert_eq!(
        from[0].pod_selector.clone().unwrap().match_labels.unwrap(),
        role_selector("demo", 1, Role::Decode)
    );
    assert_eq!(from[0].namespace_selector, None, "same namespace only");
    assert_eq!(
        rules[0].ports.as_ref().unwrap()[0].port,
        Some(IntOrString::Int(5600))
    );
    assert_eq!(rules[1].from, None, "http from anywhere");
    assert_eq!(
        rules[1].ports.as_ref().unwrap()[0].port,
        Some(IntOrString::Int(8000))
    );
}

#[test]
fn secret_holds_a_random_hex_key() {
    let p = pdd(testutil::spec(1));
    let k1 = random_group_key();
    let k2 = random_group_key();
    assert_eq!(k1.len(), 64);
    assert!(k1.chars().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(k1, k2);
    let s = group_secret(&p, 0, &k1).unwrap();
    assert_owned(&s.metadata);
    assert_eq!(s.metadata.name.as_deref(), Some("demo-g0-key"));
    assert_eq!(s.data.unwrap()["key"].0, k1.as_bytes());
}

/// The checks of the "restricted" Pod Security Standard (Kubernetes 1.33) that a pod
/// built here could fail; returns one line per violation.
fn restricted_violations(pod: &Pod) -> Vec<String> {
    let mut v = Vec::new();
    let spec = pod.spec.as_ref().unwrap();
    let psc = spec.security_context.clone().unwrap_or_default();
    for (what, on) in [
        ("hostNetwork", spec.host_network),
        ("hostPID", spec.host_pid),
        ("hostIPC", spec.host_ipc),
    ] {
        if on == Some(true) {
            v.push(what.to_string());
        }
    }
    for vol in spec.volumes.iter().flatten() {
        if vol.host_path.is_some() {
            v.push(format!("volume {} is a hostPath", vol.name));
        }
    }
    let seccomp_ok = |p: &Option<SeccompProfile>| {
        p.as_ref()
            .is_some_and(|p| p.type_ == "RuntimeDefault" || p.type_ == "Localhost")
    };
    if psc.run_as_user == Some(0) {
        v.push("pod runAsUser 0".into());
    }
    for c in &spec.containers {
        let sc = c.security_context.clone().unwrap_or_default();
        if sc.privileged == Some(true) {
            v.push(format!("{}: privileged", c.name));
        }
        if sc.allow_privilege_escalation != Some(false) {
            v.push(format!("{}: allowPrivilegeEscalation not false", c.name));
        }
        let caps = sc.capabilities.clone().unwrap_or_default();
        if !caps.drop.iter().flatten().any(|d| d == "ALL") {
            v.push(format!("{}: capabilities do not drop ALL", c.name));
        }
        if caps.add.iter().flatten().any(|a| a != "NET_BIND_SERVICE") {
            v.push(format!("{}: adds a capability", c.name));
        }
        if sc.run_as_non_root.or(psc.run_as_non_root) != Some(true) {
            v.push(format!("{}: runAsNonRoot not true", c.name));
        }
        if sc.run_as_user == Some(0) {
            v.push(format!("{}: runAsUser 0", c.name));
        }
        if !seccomp_ok(&sc.seccomp_profile) && !seccomp_ok(&psc.seccomp_profile) {
            v.push(format!("{}: no RuntimeDefault/Localhost seccomp", c.name));
        }
        if c.ports.iter().flatten().any(|p| p.host_port.is_some()) {
            v.push(format!("{}: hostPort", c.name));
        }
    }
    v
}

#[test]
fn pods_are_admitted_under_restricted_pod_security_by_default() {
    let mut spec = testutil::spec(1);
    spec.model.volume = Some(ModelVolume {
        claim_name: Some("models".into()),
        host_path: None,
        mount_path: "/models".into(),
    });
    let p = pdd(spec);
    for role in [Role::Prefill, Role::Decode] {
        let pod = pod(&p, &intent(&p, role, 0)).unwrap();
        assert_eq!(
            restricted_violations(&pod),
            Vec::<String>::new(),
            "{role:?}"
        );
        let s = pod.spec.as_ref().unwrap();
        let psc = s.security_context.as_ref().unwrap();
        assert_eq!(psc.run_as_non_root, Some(true));
        assert_eq!(psc.run_as_user, Some(65532));
        assert_eq!(psc.run_as_group, Some(65532));
        assert_eq!(psc.fs_group, None, "no recursive chown of model volumes");
        assert_eq!(
            psc.seccomp_profile.as_ref().unwrap().type_,
            "RuntimeDefault"
        );
        let sc = s.containers[0].security_context.as_ref().unwrap();
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(
            sc.capabilities.as_ref().unwrap().drop.as_deref(),
            Some(&["ALL".to_string()][..])
        );
        assert_eq!(s.automount_service_account_token, Some(false));
    }
    // A hostPath model volume is for test clusters; restricted namespaces refuse it,
    // and the check says so.
    let mut spec = testutil::spec(1);
    spec.model.volume = Some(ModelVolume {
        claim_name: None,
        host_path: Some("/data".into()),
        mount_path: "/models".into(),
    });
    let p = pdd(spec);
    let pod = pod(&p, &intent(&p, Role::Prefill, 0)).unwrap();
    assert_eq!(restricted_violations(&pod), ["volume model is a hostPath"]);
}

#[test]
fn template_security_settings_override_the_defaults_field_by_field() {
    let mut spec = testutil::spec(1);
    spec.decode.template.security_context = Some(PodSecurityContext {
        run_as_user: Some(1000),
        fs_group: Some(2000),
        ..Default::default()
    });
    spec.decode.template.container_security_context = Some(SecurityContext {
        capabilities: Some(Capabilities {
            add: Some(vec!["NET_BIND_SERVICE".into()]),
            drop: None,
        }),
        read_only_root_filesystem: Some(false),
        ..Default::default()
    });
    spec.decode.template.automount_service_account_token = Some(true);
    // Root, explicitly: both fields set.
    spec.prefill.template.security_context = Some(PodSecurityContext {
        run_as_non_root: Some(false),
        run_as_user: Some(0),
        ..Default::default()
    });
    let p = pdd(spec);

    let decode = pod(&p, &intent(&p, Role::Decode, 0)).unwrap();
    assert_eq!(restricted_violations(&decode), Vec::<String>::new());
    let s = decode.spec.as_ref().unwrap();
    let psc = s.security_context.as_ref().unwrap();
    assert_eq!(
        (psc.run_as_user, psc.fs_group, psc.run_as_group),
        (Some(1000), Some(2000), Some(65532))
    );
    assert_eq!(psc.run_as_non_root, Some(true));
    let sc = s.containers[0].security_context.as_ref().unwrap();
    let caps = sc.capabilities.as_ref().unwrap();
    assert_eq!(
        caps.add.as_deref(),
        Some(&["NET_BIND_SERVICE".to_string()][..])
    );
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
    assert_eq!(sc.read_only_root_filesystem, Some(false));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(s.automount_service_account_token, Some(true));

    let prefill = pod(&p, &intent(&p, Role::Prefill, 0)).unwrap();
    assert_eq!(
        restricted_violations(&prefill),
        ["pod runAsUser 0", "dataplane: runAsNonRoot not true"]
    );
}

#[test]
fn probes_wait_for_model_loading_and_have_explicit_timeouts() {
    let p = pdd(testutil::spec(1));
    let pod = pod(&p, &intent(&p, Role::Decode, 0)).unwrap();
    let c = &pod.spec.unwrap().containers[0];
    let path = |p: &Probe| p.http_get.as_ref().unwrap().path.clone().unwrap();
    let shape = |p: &Probe| {
        (
            p.period_seconds,
            p.timeout_seconds,
            p.failure_threshold,
            p.initial_delay_seconds,
        )
    };
    // Defaults: probe period 2 s, failure threshold 3, startup timeout 600 s.
    let startup = c.startup_probe.as_ref().expect("a startup probe");
    assert_eq!(path(startup), "/health");
    assert_eq!(shape(startup), (Some(2), Some(2), Some(300), None));
    let ready = c.readiness_probe.as_ref().unwrap();
    assert_eq!(path(ready), "/ready");
    assert_eq!(shape(ready), (Some(2), Some(2), Some(3), None));
    let live = c.liveness_probe.as_ref().unwrap();
    assert_eq!(path(live), "/health");
    assert_eq!(shape(live), (Some(10), Some(5), Some(3), None));

    // The startup window covers the spec's timeout (rounded up to whole periods),
    // however the period divides it; liveness alone would kill after 30 s.
    for (timeout, period, threshold) in [(45, 4, 12), (1, 5, 1), (86400, 1, 86400)] {
        let h = HealthSpec {
            probe_period_seconds: period,
            startup_timeout_seconds: timeout,
            ..HealthSpec::default()
        };
        let s = probes(&h).startup;
        assert_eq!(s.failure_threshold, Some(threshold), "{timeout}/{period}");
        assert!(period * threshold >= timeout);
        assert_eq!(s.timeout_seconds, Some(period));
    }
}

#[test]
fn startup_timeout_is_part_of_the_revision() {
    let mut spec = testutil::spec(1);
    let r1 = RevisionedSpec::from_spec(&spec).revision();
    spec.health.startup_timeout_seconds = 1200;
    assert_ne!(RevisionedSpec::from_spec(&spec).revision(), r1);
}

#[test]
fn a_kv_dtype_the_roles_do_not_share_is_refused_by_field() {
    let mut s = crate::testutil::spec(1);
    s.prefill.args = vec!["--kv-dtype=q8_0".into()];
    let e = check_role_args(&s).unwrap_err();
    assert!(
        e.starts_with("spec.prefill.args and spec.decode.args must give the same --kv-dtype")
            && e.contains(r#"prefill ["--kv-dtype=q8_0"], decode []"#),
        "{e}"
    );
    s.decode.args = vec!["--max-batch=8".into(), "--kv-dtype=q8_0".into()];
    check_role_args(&s).unwrap();
    s.decode.args = vec!["--kv-dtype".into(), "q8_0".into()];
    assert!(
        check_role_args(&s)
            .unwrap_err()
            .starts_with("spec.decode.args[0]: write --kv-dtype as one argument"),
    );
    s.decode.args = vec!["--kv-dtype=q8_0".into()];
    s.decode.template.env = vec![k8s_openapi::api::core::v1::EnvVar {
        name: "TANDEM_KV_DTYPE".into(),
        value: Some("f16".into()),
        ..Default::default()
    }];
    let e = check_role_args(&s).unwrap_err();
    assert!(
        e.starts_with(
            "spec.prefill.template.env and spec.decode.template.env must set TANDEM_KV_DTYPE alike"
        ) && e.contains(r#"prefill None, decode Some("f16")"#),
        "{e}"
    );
    s.prefill.template.env = s.decode.template.env.clone();
    check_role_args(&s).unwrap();
}

#[test]
fn args_that_repeat_an_operator_flag_are_refused_by_field() {
    let mut s = crate::testutil::spec(1);
    s.decode.args = vec!["--max-batch".into(), "32".into()];
    check_role_args(&s).unwrap();
    s.decode.args.push("--port=9000".into());
    assert_eq!(
        check_role_args(&s).unwrap_err(),
        "spec.decode.args[2]: --port is set by the operator (from spec.model, spec.transfer, spec.health and the group) and may not be repeated; remove it"
    );
    s.decode.args.clear();
    s.prefill.args = vec!["--model".into(), "/other.gguf".into()];
    assert!(
        check_role_args(&s)
            .unwrap_err()
            .starts_with("spec.prefill.args[0]: --model")
    );
    // The invocation sets every one of them (but --check-config).
    let p = pdd(crate::testutil::spec(1));
    for role in [Role::Prefill, Role::Decode] {
        let i = intent(&p, role, 0);
        let inv =
            dataplane_invocation("demo", &i, &DataplaneNetwork::in_cluster("demo", "ns1", &i));
        for f in operator_flags().iter().filter(|f| *f != "--check-config") {
            // --host only locally; --prefill only for a decode.
            if f == "--host" || (f == "--prefill" && role == Role::Prefill) {
                continue;
            }
            assert!(
                inv.args.iter().any(|a| a.starts_with(&format!("{f}="))),
                "{role:?} sets {f}: {:?}",
                inv.args
            );
        }
    }
}

#[test]
fn missing_uid_is_an_error_not_a_panic() {
    let mut p = pdd(testutil::spec(1));
    p.metadata.uid = None;
    assert!(client_service(&p).is_err());
}

#[test]
fn scheduling_fields_of_the_template_reach_the_pod() {
    use k8s_openapi::api::core::v1::{
        Affinity, PodAffinity, PodAffinityTerm, TopologySpreadConstraint,
    };
    let mut spec = crate::testutil::spec(1);
    let term = PodAffinityTerm {
        topology_key: "topology.kubernetes.io/zone".into(),
        match_label_keys: Some(vec![labels::GROUP.into()]),
        ..Default::default()
    };
    spec.decode.template.affinity = Some(Affinity {
        pod_affinity: Some(PodAffinity {
            required_during_scheduling_ignored_during_execution: Some(vec![term]),
            ..Default::default()
        }),
        ..Default::default()
    });
    spec.decode.template.topology_spread_constraints = vec![TopologySpreadConstraint {
        max_skew: 1,
        topology_key: "kubernetes.io/hostname".into(),
        when_unsatisfiable: "ScheduleAnyway".into(),
        ..Default::default()
    }];
    spec.decode.template.priority_class_name = Some("serving".into());
    spec.decode.template.scheduler_name = Some("packer".into());
    let p = pdd(spec);
    let decode = pod(&p, &intent(&p, Role::Decode, 0)).unwrap();
    let s = decode.spec.unwrap();
    assert_eq!(s.affinity, p.spec.decode.template.affinity);
    assert_eq!(
        s.topology_spread_constraints.as_deref(),
        Some(&p.spec.decode.template.topology_spread_constraints[..])
    );
    assert_eq!(s.priority_class_name.as_deref(), Some("serving"));
    assert_eq!(s.scheduler_name.as_deref(), Some("packer"));
    // The prefill's template sets none of them: the pod leaves them to the cluster.
    let prefill = pod(&p, &intent(&p, Role::Prefill, 0))
        .unwrap()
        .spec
        .unwrap();
    assert!(prefill.affinity.is_none() && prefill.topology_spread_constraints.is_none());
    assert!(prefill.priority_class_name.is_none() && prefill.scheduler_name.is_none());
}
