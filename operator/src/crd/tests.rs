use super::*;
use kube::CustomResourceExt;

#[test]
fn revision_ignores_groups_restart_and_rollout() {
    let mut spec = crate::testutil::spec(2);
    let r1 = RevisionedSpec::from_spec(&spec).revision();
    spec.groups = 5;
    spec.rollout.partition = 3;
    spec.restart.policy = RestartPolicy::None;
    assert_eq!(RevisionedSpec::from_spec(&spec).revision(), r1);
    spec.decode.template.image = "tandem:2".into();
    assert_ne!(RevisionedSpec::from_spec(&spec).revision(), r1);
}

#[test]
fn crd_has_scale_status_short_name_and_columns() {
    let crd = PDDeployment::crd();
    assert_eq!(crd.spec.names.short_names, Some(vec!["pdd".to_string()]));
    let v = &crd.spec.versions[0];
    let sub = v.subresources.as_ref().expect("subresources");
    assert!(sub.status.is_some());
    let scale = sub.scale.as_ref().expect("scale subresource");
    assert_eq!(scale.spec_replicas_path, ".spec.groups");
    assert_eq!(scale.status_replicas_path, ".status.groups");
    assert_eq!(
        scale.label_selector_path.as_deref(),
        Some(".status.selector")
    );
    let cols: Vec<_> = v
        .additional_printer_columns
        .as_ref()
        .unwrap()
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(cols, ["Groups", "Ready", "Updated", "Available", "Age"]);
}

#[test]
fn committed_crd_matches_the_types() {
    let committed = include_str!("../../../crds/pddeployment.yaml");
    assert!(
        committed == crd_yaml().unwrap(),
        "crds/pddeployment.yaml is stale: run `make crds`"
    );
}

/// The rules a real API server applies to a v1 CRD schema ("structural schema"):
/// every node has a type (or is int-or-string / preserve-unknown-fields), no `$ref`,
/// no `properties` together with `additionalProperties`, and the logical junctors
/// carry no types, defaults or nullability.
fn assert_structural(path: &str, node: &serde_json::Value) {
    let obj = node
        .as_object()
        .unwrap_or_else(|| panic!("{path}: not an object"));
    assert!(!obj.contains_key("$ref"), "{path}: $ref is not allowed");
    let int_or_string = obj.get("x-kubernetes-int-or-string") == Some(&true.into());
    let preserve = obj.get("x-kubernetes-preserve-unknown-fields") == Some(&true.into());
    assert!(
        obj.contains_key("type") || int_or_string || preserve,
        "{path}: node without type"
    );
    assert!(
        !(obj.contains_key("properties") && obj.contains_key("additionalProperties")),
        "{path}: properties and additionalProperties together"
    );
    for junctor in ["allOf", "anyOf", "oneOf", "not"] {
        if let Some(j) = obj.get(junctor) {
            let text = j.to_string();
            for banned in [
                "\"type\"",
                "\"default\"",
                "\"nullable\"",
                "\"additionalProperties\"",
            ] {
                assert!(!text.contains(banned), "{path}.{junctor} contains {banned}");
            }
        }
    }
    if let Some(props) = obj.get("properties").and_then(|p| p.as_object()) {
        for (k, v) in props {
            assert_structural(&format!("{path}.{k}"), v);
        }
    }
    if let Some(items) = obj.get("items") {
        assert_structural(&format!("{path}[]"), items);
    }
    if let Some(ap) = obj.get("additionalProperties").filter(|v| v.is_object()) {
        assert_structural(&format!("{path}{{}}"), ap);
    }
}

#[test]
fn schema_is_structural_with_bounds() {
    let crd = serde_json::to_value(PDDeployment::crd()).unwrap();
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    assert_structural("", schema);
    let spec = &schema["properties"]["spec"]["properties"];
    assert_eq!(spec["groups"]["minimum"], 0.0);
    assert_eq!(spec["prefill"]["properties"]["replicas"]["minimum"], 1.0);
    assert_eq!(
        spec["transfer"]["properties"]["kvTimeoutSeconds"]["minimum"],
        1.0
    );
    assert_eq!(
        spec["health"]["properties"]["probePeriodSeconds"]["minimum"],
        1.0
    );
    assert_eq!(
        spec["rollout"]["properties"]["maxUnavailableGroups"]["minimum"],
        1.0
    );
    let policies = &spec["restart"]["properties"]["policy"]["enum"];
    assert_eq!(policies, &serde_json::json!(["CoRestartGroup", "None"]));
}

/// Every key of `orig` (a manifest as written) is present in `back` (the parsed
/// resource serialized again): no typo that serde would silently drop.
fn assert_covered(orig: &serde_json::Value, back: &serde_json::Value, path: &str) {
    if let (serde_json::Value::Object(o), serde_json::Value::Object(b)) = (orig, back) {
        for (k, v) in o {
            let bv = b.get(k).unwrap_or_else(|| panic!("{path}.{k} was dropped"));
            assert_covered(v, bv, &format!("{path}.{k}"));
        }
    }
    if let (serde_json::Value::Array(o), serde_json::Value::Array(b)) = (orig, back) {
        assert_eq!(o.len(), b.len(), "{path}: list length");
        for (i, (o, b)) in o.iter().zip(b).enumerate() {
            assert_covered(o, b, &format!("{path}[{i}]"));
        }
    }
}

#[test]
fn the_api_server_is_told_what_can_never_be_served() {
    let crd = serde_json::to_value(crd()).unwrap();
    let root = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    assert_eq!(root["x-kubernetes-validations"][0]["rule"], NAME_RULE);
    assert!(NAME_RULE.contains(&format!("size() <= {}", crate::names::MAX_DEPLOYMENT_NAME)));
    let spec = &root["properties"]["spec"]["properties"];
    assert_eq!(
        spec["groups"]["maximum"],
        f64::from(crate::names::MAX_GROUPS)
    );
    assert_eq!(
        spec["transfer"]["x-kubernetes-validations"][0]["rule"],
        "self.httpPort != self.kvPort"
    );
    assert_eq!(
        spec["model"]["properties"]["volume"]["x-kubernetes-validations"][0]["rule"],
        "has(self.claimName) != has(self.hostPath)"
    );
    let env = &spec["decode"]["properties"]["template"]["properties"]["env"];
    assert_eq!(env["x-kubernetes-list-type"], "map");
    assert_eq!(
        env["x-kubernetes-list-map-keys"],
        serde_json::json!(["name"])
    );
}

#[test]
fn example_manifest_parses_and_uses_every_section() {
    let text = include_str!("../../../manifests/examples/smollm2.yaml");
    let pdd: PDDeployment = serde_yaml::from_str(text).unwrap();
    assert_eq!(pdd.spec.groups, 2);
    assert_eq!(pdd.spec.restart.backoff.max_seconds, 300);
    assert_eq!(pdd.spec.health.startup_timeout_seconds, 600);
    let vol = pdd.spec.model.volume.as_ref().unwrap();
    assert_eq!(vol.claim_name.as_deref(), Some("models"));
    let back: serde_json::Value = serde_json::to_value(&pdd).unwrap();
    let orig: serde_json::Value = serde_yaml::from_str(text).unwrap();
    assert_covered(&orig["spec"], &back["spec"], "spec");
}

/// Every PDDeployment under `manifests/` (every document of every YAML file) parses
/// and keeps every field it writes.
#[test]
fn every_example_pddeployment_parses_and_keeps_every_field() {
    use serde::Deserialize as _;
    fn yaml_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                yaml_files(&p, out);
            } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
                out.push(p);
            }
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests");
    let mut files = Vec::new();
    yaml_files(&root, &mut files);
    let mut seen = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let orig = serde_json::Value::deserialize(doc).unwrap();
            if orig["kind"] != "PDDeployment" {
                continue;
            }
            let name = format!("{}: {}", f.display(), orig["metadata"]["name"]);
            let pdd: PDDeployment =
                serde_json::from_value(orig.clone()).unwrap_or_else(|e| panic!("{name}: {e}"));
            let back = serde_json::to_value(&pdd).unwrap();
            assert_covered(&orig["spec"], &back["spec"], &name);
            seen.push(pdd);
        }
    }
    let find = |name: &str| {
        seen.iter()
            .find(|p| p.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no PDDeployment {name} under manifests/"))
    };
    find("smollm2");
    let gpu = find("smollm2-gpu");
    for role in [&gpu.spec.prefill, &gpu.spec.decode] {
        assert_eq!(&role.args[..2], ["--device", "cuda"]);
        let limits = role.template.resources.as_ref().unwrap().limits.as_ref();
        assert_eq!(limits.unwrap()["nvidia.com/gpu"].0, "1");
    }
    let two_to_one = find("smollm2-2p1d");
    assert_eq!(
        (
            two_to_one.spec.prefill.replicas,
            two_to_one.spec.decode.replicas
        ),
        (2, 1)
    );
}

#[test]
fn defaults_fill_a_minimal_manifest() {
    let yaml = r#"
apiVersion: tandem.dev/v1alpha1
kind: PDDeployment
metadata: {name: demo, namespace: default}
spec:
  model: {name: smollm2, path: /models/m.gguf}
  prefill: {template: {image: tandem:1}}
  decode: {template: {image: tandem:1}}
"#;
    let pdd: PDDeployment = serde_yaml::from_str(yaml).unwrap();
    assert_eq!(pdd.spec.groups, 1);
    assert_eq!(pdd.spec.prefill.replicas, 1);
    assert_eq!(pdd.spec.transfer.kv_port, 5600);
    assert_eq!(pdd.spec.restart.policy, RestartPolicy::CoRestartGroup);
    assert_eq!(pdd.spec.rollout.max_unavailable_groups, 1);
}

#[test]
fn pod_spec_fields_are_schema_checked_and_the_crd_fits_client_side_apply() {
    let v = serde_json::to_value(crd()).unwrap();
    let compact = serde_json::to_string(&v).unwrap().len();
    // `kubectl apply` (client side) keeps the object in a 256 kB annotation.
    assert!(compact < 200_000, "the CRD is {compact} bytes of JSON");
    let tpl = &v["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        ["decode"]["properties"]["template"]["properties"];
    let affinity = &tpl["affinity"];
    assert!(
        affinity["description"]
            .as_str()
            .unwrap()
            .contains("matchLabelKeys")
    );
    let term = &affinity["properties"]["podAffinity"]["properties"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["items"];
    assert_eq!(term["properties"]["topologyKey"]["type"], "string");
    assert!(
        term["required"]
            .as_array()
            .unwrap()
            .contains(&"topologyKey".into())
    );
    assert!(
        term.get("description").is_none()
            && term["properties"]["topologyKey"]
                .get("description")
                .is_none()
    );
    let spread = &tpl["topologySpreadConstraints"]["items"];
    assert!(
        spread["required"]
            .as_array()
            .unwrap()
            .contains(&"maxSkew".into())
    );
    for f in ["priorityClassName", "schedulerName"] {
        assert_eq!(tpl[f]["type"], "string", "{f}");
        assert!(
            tpl[f]["description"].is_string(),
            "{f} keeps its description"
        );
    }
}

#[test]
fn the_roles_args_are_bounded_and_ruled_at_admission() {
    let crd = serde_json::to_value(crd()).unwrap();
    let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    assert_eq!(
        spec["x-kubernetes-validations"][0]["rule"],
        super::args_rules::KV_DTYPE_PAIR_RULE
    );
    for role in ["prefill", "decode"] {
        let r = &spec["properties"][role];
        let args = &r["properties"]["args"];
        assert_eq!(args["maxItems"], super::args_rules::MAX_ARGS, "{role}");
        assert_eq!(
            args["items"]["maxLength"],
            super::args_rules::MAX_ARG_LENGTH,
            "{role}"
        );
        let rules = r["x-kubernetes-validations"]
            .as_array()
            .expect("rules on the role");
        let reserved = rules[0]["rule"].as_str().unwrap();
        for flag in crate::resources::operator_flags() {
            assert!(
                reserved.contains(&format!("'{flag}'")),
                "{role}: {flag} not in {reserved}"
            );
        }
        assert_eq!(rules[0]["fieldPath"], ".args");
        assert!(
            rules[1]["rule"]
                .as_str()
                .unwrap()
                .contains("a == '--kv-dtype'")
        );
    }
}

/// `health.unresponsiveGraceSeconds` is read by the operator alone, when it deletes a pod:
/// changing it rolls no group, and its arrival left every revision as it was (the hash
/// is the one of the encoding without the field, which is what the spec was before).
#[test]
fn revision_ignores_the_unresponsive_grace_and_kept_its_old_value() {
    use sha2::Digest as _;
    let mut spec = crate::testutil::spec(1);
    let r1 = RevisionedSpec::from_spec(&spec).revision();
    spec.health.unresponsive_grace_seconds = 7;
    let rev = RevisionedSpec::from_spec(&spec);
    assert_eq!(rev.revision(), r1);
    let full = serde_json::to_string(&rev).unwrap();
    let field = ",\"unresponsiveGraceSeconds\":7";
    assert!(full.contains(field), "{full}");
    let before = full.replace(field, "");
    let digest = sha2::Sha256::digest(before.as_bytes());
    assert_eq!(hex::encode(&digest[..5]), r1);
    // Every other health field is still part of it (the dataplane's no-progress limit too:
    // changing it must roll the pods that read it).
    spec.health.no_progress_seconds += 1;
    let r2 = RevisionedSpec::from_spec(&spec).revision();
    assert_ne!(r2, r1);
    spec.health.co_restart_after_seconds += 1;
    assert_ne!(RevisionedSpec::from_spec(&spec).revision(), r2);
}
