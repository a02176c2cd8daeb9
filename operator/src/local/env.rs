//! The environment of a local member, resolved the way the kubelet resolves a pod's:
//! plain values as they are, the group key from the runtime's Secret store (what
//! `CreateGroupSecret` made), and the pod's name and namespace from field references.
//! References that have no local source (ConfigMaps, other Secrets, resource fields) are
//! left out; the manifest check lists them as ignored.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::EnvVar;
use serde_json::Value;

use crate::resources::GROUP_KEY_ENV;

const LOCAL_FIELDS: [&str; 2] = ["metadata.name", "metadata.namespace"];

/// Whether a manifest's `valueFrom` (JSON, null when absent) can be resolved locally.
pub fn resolvable_locally(value_from: &Value) -> bool {
    if value_from.is_null() {
        return true;
    }
    value_from["fieldRef"]["fieldPath"]
        .as_str()
        .is_some_and(|f| LOCAL_FIELDS.contains(&f))
}

/// The facts about a member that field references read.
#[derive(Debug, Clone, Copy)]
pub struct PodFacts<'a> {
    pub name: &'a str,
    pub namespace: &'a str,
}

/// Resolve `env` to name/value pairs. `secrets` maps a Secret's name to the group key it
/// holds. The only error is a missing group key (the planner creates the Secret before
/// any member of its group, so this is a bookkeeping bug, never user input).
pub fn resolve(
    env: &[EnvVar],
    pod: PodFacts<'_>,
    secrets: &BTreeMap<String, String>,
) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::with_capacity(env.len());
    for e in env {
        let Some(from) = &e.value_from else {
            out.push((e.name.clone(), e.value.clone().unwrap_or_default()));
            continue;
        };
        if let Some(s) = &from.secret_key_ref {
            match secrets.get(&s.name) {
                Some(key) if s.key == crate::resources::SECRET_KEY => {
                    out.push((e.name.clone(), key.clone()));
                }
                _ if e.name == GROUP_KEY_ENV => {
                    return Err(format!(
                        "env {}: no group key in Secret {:?} (it is created before the group's members)",
                        e.name, s.name
                    ));
                }
                _ => {}
            }
        } else if let Some(f) = &from.field_ref {
            match f.field_path.as_str() {
                "metadata.name" => out.push((e.name.clone(), pod.name.to_string())),
                "metadata.namespace" => out.push((e.name.clone(), pod.namespace.to_string())),
                _ => {}
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        ConfigMapKeySelector, EnvVarSource, ObjectFieldSelector, SecretKeySelector,
    };

    fn plain(name: &str, value: &str) -> EnvVar {
        EnvVar {
            name: name.into(),
            value: Some(value.into()),
            ..Default::default()
        }
    }

    fn from(name: &str, source: EnvVarSource) -> EnvVar {
        EnvVar {
            name: name.into(),
            value_from: Some(source),
            ..Default::default()
        }
    }

    fn secret(name: &str) -> EnvVarSource {
        EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: name.into(),
                key: "key".into(),
                optional: Some(false),
            }),
            ..Default::default()
        }
    }

    fn field(path: &str) -> EnvVarSource {
        EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn values_keys_and_fields_resolve_like_the_kubelet() {
        let env = vec![
            plain("A", "1"),
            from(GROUP_KEY_ENV, secret("demo-g0-key")),
            from("POD", field("metadata.name")),
            from("NS", field("metadata.namespace")),
            from("IP", field("status.podIP")),
            from(
                "CM",
                EnvVarSource {
                    config_map_key_ref: Some(ConfigMapKeySelector {
                        name: "c".into(),
                        key: "k".into(),
                        optional: None,
                    }),
                    ..Default::default()
                },
            ),
            from("OTHER", secret("someone-elses")),
        ];
        let secrets = BTreeMap::from([("demo-g0-key".to_string(), "abc".to_string())]);
        let pod = PodFacts {
            name: "demo-g0-i1-p0",
            namespace: "default",
        };
        let got = resolve(&env, pod, &secrets).unwrap();
        let want: Vec<(String, String)> = [
            ("A", "1"),
            (GROUP_KEY_ENV, "abc"),
            ("POD", "demo-g0-i1-p0"),
            ("NS", "default"),
        ]
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_missing_group_key_is_an_error() {
        let env = vec![from(GROUP_KEY_ENV, secret("demo-g0-key"))];
        let pod = PodFacts {
            name: "p",
            namespace: "default",
        };
        let err = resolve(&env, pod, &BTreeMap::new()).unwrap_err();
        assert!(err.contains("demo-g0-key"), "{err}");
    }

    #[test]
    fn resolvable_value_sources() {
        assert!(resolvable_locally(&Value::Null));
        assert!(resolvable_locally(
            &serde_json::json!({"fieldRef": {"fieldPath": "metadata.name"}})
        ));
        assert!(!resolvable_locally(
            &serde_json::json!({"fieldRef": {"fieldPath": "spec.nodeName"}})
        ));
        assert!(!resolvable_locally(
            &serde_json::json!({"secretKeyRef": {"name": "s", "key": "k"}})
        ));
    }
}
