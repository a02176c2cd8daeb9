//! Reading the `PDDeployment` manifest the local runtime runs.
//!
//! A manifest goes through the checks a cluster would make before anything runs: the CRD's
//! schema (types, bounds, unknown fields; see [`super::schema`]) and the name limits of
//! every derived name ([`crate::names::validate_deployment_name`]). On top of that, the
//! model file must exist on this machine: a relative `spec.model.path` is looked up from
//! the current directory, then from the manifest's directory and each of its parents (so
//! `.cache/models/…` in `manifests/examples/` finds the repository's model cache).
//!
//! Fields that only mean something on a cluster (image, resources, scheduling, volumes,
//! the ports — local processes get free loopback ports) are accepted and listed in
//! [`Manifest::cluster_only`] so the runtime can say once that it ignores them. A pod
//! template is therefore optional locally, and so is its `image`.

use std::path::{Path, PathBuf};

use k8s_openapi::jiff::Timestamp;
use kube::CustomResourceExt;
use serde_json::{Map, Value};

use crate::controller::restart_requested_at;
use crate::crd::PDDeployment;
use crate::names;

/// Image recorded for a role whose template names none (never used locally).
pub const LOCAL_IMAGE: &str = "local";

/// A validated manifest.
#[derive(Debug, Clone, PartialEq)]
pub struct Manifest {
    /// The deployment, with `spec.model.path` resolved to an absolute path.
    pub pdd: PDDeployment,
    /// Parsed `tandem.dev/restart-requested-at` annotation.
    pub restart_requested_at: Option<Timestamp>,
    /// Paths of the fields set in the file that the local runtime ignores.
    pub cluster_only: Vec<String>,
}

impl Manifest {
    pub fn name(&self) -> &str {
        self.pdd.metadata.name.as_deref().unwrap_or_default()
    }
}

/// Read and check `file`. The error names the file and every field that is wrong.
pub fn load(file: &Path) -> Result<Manifest, String> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| format!("{}: cannot read: {e}", file.display()))?;
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    let dir = file
        .parent()
        .map(|d| {
            if d.as_os_str().is_empty() {
                Path::new(".")
            } else {
                d
            }
        })
        .unwrap_or(Path::new("."));
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    parse(&text, &cwd, &dir).map_err(|e| format!("{}: {e}", file.display()))
}

/// Check a manifest's text; relative model paths are looked up from `cwd`, then from
/// `manifest_dir` and its parents.
pub fn parse(text: &str, cwd: &Path, manifest_dir: &Path) -> Result<Manifest, String> {
    let mut doc: Value = serde_yaml::from_str(text).map_err(|e| format!("not valid YAML: {e}"))?;
    let top = doc
        .as_object()
        .ok_or("expected a PDDeployment (a YAML map with apiVersion, kind, metadata, spec)")?;
    let field = |k: &str| top.get(k).and_then(Value::as_str);
    let api_version = format!("{}/v1alpha1", crate::crd::GROUP);
    if field("apiVersion") != Some(api_version.as_str()) {
        return Err(format!(
            "apiVersion: expected {api_version}, got {}",
            top.get("apiVersion")
                .map_or("nothing".into(), |v| v.to_string())
        ));
    }
    if field("kind") != Some("PDDeployment") {
        return Err(format!(
            "kind: expected PDDeployment, got {}",
            top.get("kind").map_or("nothing".into(), |v| v.to_string())
        ));
    }
    for k in top.keys() {
        if !["apiVersion", "kind", "metadata", "spec", "status"].contains(&k.as_str()) {
            return Err(format!(
                "{k}: unknown field (known: apiVersion, kind, metadata, spec)"
            ));
        }
    }
    if !top.get("spec").is_some_and(Value::is_object) {
        return Err("spec: required (a map)".into());
    }
    let cluster_only = cluster_only_fields(&doc);
    fill_local_defaults(&mut doc);

    let crd = serde_json::to_value(PDDeployment::crd()).expect("the CRD serializes");
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    let problems = super::schema::violations(schema, &doc["spec"], "spec");
    if !problems.is_empty() {
        return Err(problems.join("; "));
    }
    if let Some(obj) = doc.as_object_mut() {
        // The status is the runtime's own; one in the file is not read.
        obj.remove("status");
    }
    let mut pdd: PDDeployment =
        serde_json::from_value(doc).map_err(|e| format!("not a PDDeployment: {e}"))?;
    let name = pdd.metadata.name.clone().ok_or("metadata.name: required")?;
    names::validate_deployment_name(&name)?;
    crate::resources::check_role_args(&pdd.spec)?;
    let restart_requested_at = restart_requested_at(&pdd)?;
    let model = resolve_model(&pdd.spec.model.path, cwd, manifest_dir)?;
    pdd.spec.model.path = model.to_string_lossy().into_owned();
    Ok(Manifest {
        pdd,
        restart_requested_at,
        cluster_only,
    })
}

/// A pod template and its image are optional locally.
fn fill_local_defaults(doc: &mut Value) {
    for role in ["prefill", "decode"] {
        let Some(r) = doc["spec"].get_mut(role).and_then(Value::as_object_mut) else {
            continue;
        };
        let t = r
            .entry("template")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Some(t) = t.as_object_mut() {
            t.entry("image")
                .or_insert_with(|| Value::String(LOCAL_IMAGE.into()));
        }
    }
}

/// Paths of the fields set in `doc` that have no meaning for local processes.
fn cluster_only_fields(doc: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let mut note = |v: &Value, path: &str| {
        if !v.is_null() {
            out.push(path.to_string());
        }
    };
    note(&doc["metadata"]["namespace"], "metadata.namespace");
    let spec = &doc["spec"];
    note(&spec["model"]["volume"], "spec.model.volume");
    note(&spec["transfer"]["httpPort"], "spec.transfer.httpPort");
    note(&spec["transfer"]["kvPort"], "spec.transfer.kvPort");
    for role in ["prefill", "decode"] {
        let t = &spec[role]["template"];
        for f in [
            "image",
            "imagePullPolicy",
            "resources",
            "nodeSelector",
            "tolerations",
            "affinity",
            "topologySpreadConstraints",
            "priorityClassName",
            "schedulerName",
            "labels",
            "annotations",
            "serviceAccountName",
            "automountServiceAccountToken",
            "securityContext",
            "containerSecurityContext",
        ] {
            note(&t[f], &format!("spec.{role}.template.{f}"));
        }
        if let Some(env) = t["env"].as_array() {
            for (i, e) in env.iter().enumerate() {
                if !super::env::resolvable_locally(&e["valueFrom"]) {
                    note(
                        &e["valueFrom"],
                        &format!("spec.{role}.template.env[{i}].valueFrom"),
                    );
                }
            }
        }
    }
    out
}

/// Find the model file. Absolute paths are taken as they are; a relative one is tried
/// from `cwd`, then from `manifest_dir` and each of its parents.
pub fn resolve_model(path: &str, cwd: &Path, manifest_dir: &Path) -> Result<PathBuf, String> {
    let p = Path::new(path);
    let mut tried: Vec<PathBuf> = Vec::new();
    if p.is_absolute() {
        tried.push(p.to_path_buf());
    } else {
        tried.push(cwd.join(p));
        tried.extend(manifest_dir.ancestors().map(|d| d.join(p)));
    }
    tried.dedup();
    if let Some(found) = tried.iter().find(|c| c.is_file()) {
        return Ok(std::fs::canonicalize(found).unwrap_or_else(|_| found.clone()));
    }
    let list: Vec<String> = tried.iter().map(|t| t.display().to_string()).collect();
    Err(format!(
        "spec.model.path: no model file {path:?} (looked at {}); `make model` fetches SmolLM2-135M-Instruct into .cache/models",
        list.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory with a model file at `.cache/models/m.gguf` and a manifest directory
    /// two levels below it.
    fn tree() -> (PathBuf, PathBuf) {
        let root = std::env::temp_dir().join(format!(
            "tandem-manifest-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let models = root.join(".cache/models");
        std::fs::create_dir_all(&models).unwrap();
        std::fs::write(models.join("m.gguf"), b"x").unwrap();
        let dir = root.join("manifests/examples");
        std::fs::create_dir_all(&dir).unwrap();
        (root, dir)
    }

    const MINIMAL: &str = "
apiVersion: tandem.dev/v1alpha1
kind: PDDeployment
metadata: {name: demo}
spec:
  model: {name: m, path: .cache/models/m.gguf}
  prefill: {args: [--kv-blocks, '64']}
  decode: {}
";

    #[test]
    fn a_minimal_local_manifest_loads_with_the_model_found_from_the_manifest_dir() {
        let (root, dir) = tree();
        let m = parse(MINIMAL, Path::new("/"), &dir).unwrap();
        assert_eq!(m.name(), "demo");
        let want = std::fs::canonicalize(root.join(".cache/models/m.gguf")).unwrap();
        assert_eq!(m.pdd.spec.model.path, want.to_string_lossy());
        assert_eq!(m.pdd.spec.prefill.template.image, LOCAL_IMAGE);
        assert_eq!(m.pdd.spec.prefill.args, ["--kv-blocks", "64"]);
        assert!(m.cluster_only.is_empty(), "{:?}", m.cluster_only);
        assert_eq!(m.restart_requested_at, None);
    }

    #[test]
    fn cluster_only_fields_are_listed() {
        let (_, dir) = tree();
        let text = MINIMAL.replace(
            "decode: {}",
            "decode: {template: {image: x, resources: {limits: {cpu: '1'}}, priorityClassName: p, topologySpreadConstraints: [{maxSkew: 1, topologyKey: zone, whenUnsatisfiable: DoNotSchedule}], env: [{name: A, valueFrom: {configMapKeyRef: {name: c, key: k}}}, {name: B, valueFrom: {fieldRef: {fieldPath: metadata.name}}}]}}\n  transfer: {httpPort: 9000}",
        );
        let m = parse(&text, Path::new("/"), &dir).unwrap();
        assert_eq!(
            m.cluster_only,
            [
                "spec.transfer.httpPort",
                "spec.decode.template.image",
                "spec.decode.template.resources",
                "spec.decode.template.topologySpreadConstraints",
                "spec.decode.template.priorityClassName",
                "spec.decode.template.env[0].valueFrom"
            ]
        );
    }

    #[test]
    fn every_kind_of_mistake_names_the_field() {
        let (_, dir) = tree();
        let cases = [
            ("spec: [", "not valid YAML"),
            (
                &MINIMAL.replace("v1alpha1", "v1"),
                "apiVersion: expected tandem.dev/v1alpha1",
            ),
            (
                &MINIMAL.replace("decode: {}", "decode: {}\n  helth: {}"),
                "spec.helth: unknown field",
            ),
            (
                &MINIMAL.replace(
                    "decode: {}",
                    "decode: {}\n  health: {probePeriodSeconds: 0}",
                ),
                "spec.health.probePeriodSeconds: 0 is less than the minimum 1",
            ),
            (
                &MINIMAL.replace("decode: {}", "decode: {replicas: two}"),
                "spec.decode.replicas: expected an integer, got a string",
            ),
            (
                &MINIMAL.replace("name: demo", "name: llama-3.1-8b"),
                "metadata.name \"llama-3.1-8b\": '.' is not allowed",
            ),
            (
                &MINIMAL.replace("m.gguf", "missing.gguf"),
                "spec.model.path: no model file \".cache/models/missing.gguf\"",
            ),
            (
                &MINIMAL.replace(
                    "metadata: {name: demo}",
                    "metadata: {name: demo, annotations: {tandem.dev/restart-requested-at: soon}}",
                ),
                "tandem.dev/restart-requested-at: \"soon\" is not an RFC 3339 time",
            ),
        ];
        for (text, want) in cases {
            let err = parse(text, Path::new("/"), &dir).unwrap_err();
            assert!(err.contains(want), "{want:?} not in {err:?}");
        }
    }

    #[test]
    fn the_example_manifest_loads() {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let text =
            std::fs::read_to_string(repo.join("manifests/examples/smollm2-local.yaml")).unwrap();
        // The model itself may be absent in a unit-test run; point at a file that exists.
        let (_, dir) = tree();
        let text = text.replace(
            ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf",
            ".cache/models/m.gguf",
        );
        let m = parse(&text, Path::new("/"), &dir).unwrap();
        assert_eq!(m.pdd.spec.groups, 1);
        assert_eq!(m.pdd.spec.prefill.replicas, 1);
        assert_eq!(m.pdd.spec.decode.replicas, 1);
    }
}
