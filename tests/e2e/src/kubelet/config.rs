//! What a container is started with, resolved the way the kubelet resolves it: the
//! environment (literal values, `fieldRef`, `secretKeyRef` and `configMapKeyRef` read
//! through the API, `$(VAR)` references), the command line (`$(VAR)` expanded), volumes
//! (a PersistentVolumeClaim is followed to its bound PersistentVolume's path), and the
//! user from the security context (`runAsNonRoot` with a root user is refused).
//!
//! A failure carries the waiting reason and message a real kubelet reports
//! (`CreateContainerConfigError`, or `ContainerCreating` while a claim is unbound).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{
    ConfigMap, Container, EnvVar, PersistentVolume, PersistentVolumeClaim, Pod, Secret,
};
use kube::{Api, Client, ResourceExt};

/// A container ready to be started by `e2e-pod-exec`.
#[derive(Debug, Clone, PartialEq)]
pub struct ContainerConfig {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub mounts: Vec<Mount>,
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub read_only_root: bool,
    pub no_new_privs: bool,
    pub workdir: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Mount {
    pub source: PathBuf,
    pub target: String,
    pub read_only: bool,
}

/// Why a container cannot start (yet).
#[derive(Debug, Clone, PartialEq)]
pub struct NotStartable {
    pub reason: &'static str,
    pub message: String,
}

fn config_error(message: String) -> NotStartable {
    NotStartable {
        reason: "CreateContainerConfigError",
        message,
    }
}

/// Facts about the pod's placement that `fieldRef` can read.
pub struct Placement<'a> {
    pub node_name: &'a str,
    pub pod_ip: Ipv4Addr,
    pub host_ip: &'a str,
}

/// Expand `$(NAME)` with `vars`; `$$` is a literal `$`; unknown references stay as they are.
pub fn expand(input: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(t) = tail.strip_prefix("$$") {
            out.push('$');
            rest = t;
        } else if let Some(body) = tail.strip_prefix("$(")
            && let Some(end) = body.find(')')
        {
            let name = &body[..end];
            match vars.get(name) {
                Some(v) => out.push_str(v),
                None => out.push_str(&tail[..end + 3]),
            }
            rest = &body[end + 1..];
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

fn field_ref(pod: &Pod, path: &str, place: &Placement<'_>) -> Result<String, String> {
    let bracket = |prefix: &str, map: &BTreeMap<String, String>| -> Option<String> {
        let key = path.strip_prefix(prefix)?.strip_suffix("']")?;
        Some(map.get(key).cloned().unwrap_or_default())
    };
    let spec = pod.spec.as_ref();
    Ok(match path {
        "metadata.name" => pod.name_any(),
        "metadata.namespace" => pod.namespace().unwrap_or_default(),
        "metadata.uid" => pod.metadata.uid.clone().unwrap_or_default(),
        "spec.nodeName" => place.node_name.to_string(),
        "spec.serviceAccountName" => spec
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_default(),
        "status.podIP" | "status.podIPs" => place.pod_ip.to_string(),
        "status.hostIP" | "status.hostIPs" => place.host_ip.to_string(),
        _ => {
            if let Some(v) = bracket("metadata.labels['", pod.labels()) {
                v
            } else if let Some(v) = bracket("metadata.annotations['", pod.annotations()) {
                v
            } else {
                return Err(format!("unsupported fieldRef {path:?}"));
            }
        }
    })
}

async fn env_value(
    client: &Client,
    ns: &str,
    pod: &Pod,
    e: &EnvVar,
    place: &Placement<'_>,
    vars: &BTreeMap<String, String>,
) -> Result<Option<String>, NotStartable> {
    if let Some(v) = &e.value {
        return Ok(Some(expand(v, vars)));
    }
    let Some(from) = &e.value_from else {
        return Ok(Some(String::new()));
    };
    if let Some(f) = &from.field_ref {
        return field_ref(pod, &f.field_path, place)
            .map(Some)
            .map_err(config_error);
    }
    if let Some(s) = &from.secret_key_ref {
        let optional = s.optional == Some(true);
        let secret = Api::<Secret>::namespaced(client.clone(), ns)
            .get_opt(&s.name)
            .await
            .map_err(|e| config_error(format!("reading secret {:?}: {e}", s.name)))?;
        let Some(secret) = secret else {
            return if optional {
                Ok(None)
            } else {
                Err(config_error(format!("secret \"{}\" not found", s.name)))
            };
        };
        let value = secret
            .data
            .as_ref()
            .and_then(|d| d.get(&s.key))
            .map(|b| String::from_utf8_lossy(&b.0).into_owned())
            .or_else(|| {
                secret
                    .string_data
                    .as_ref()
                    .and_then(|d| d.get(&s.key).cloned())
            });
        return match value {
            Some(v) => Ok(Some(v)),
            None if optional => Ok(None),
            None => Err(config_error(format!(
                "couldn't find key {} in Secret {ns}/{}",
                s.key, s.name
            ))),
        };
    }
    if let Some(c) = &from.config_map_key_ref {
        let optional = c.optional == Some(true);
        let cm = Api::<ConfigMap>::namespaced(client.clone(), ns)
            .get_opt(&c.name)
            .await
            .map_err(|e| config_error(format!("reading configmap {:?}: {e}", c.name)))?;
        let value = cm.and_then(|cm| cm.data.and_then(|d| d.get(&c.key).cloned()));
        return match value {
            Some(v) => Ok(Some(v)),
            None if optional => Ok(None),
            None => Err(config_error(format!(
                "couldn't find key {} in ConfigMap {ns}/{}",
                c.key, c.name
            ))),
        };
    }
    Err(config_error(format!(
        "env {}: only value, fieldRef, secretKeyRef and configMapKeyRef are supported",
        e.name
    )))
}

/// Resolve the volume named `volume` of `pod` to a path on this machine.
async fn volume_source(
    client: &Client,
    ns: &str,
    pod: &Pod,
    volume: &str,
    scratch: &Path,
) -> Result<PathBuf, NotStartable> {
    let spec = pod.spec.as_ref().expect("pods have a spec");
    let Some(v) = spec.volumes.iter().flatten().find(|v| v.name == volume) else {
        return Err(config_error(format!("volume {volume:?} is not defined")));
    };
    if let Some(h) = &v.host_path {
        return Ok(PathBuf::from(&h.path));
    }
    if v.empty_dir.is_some() {
        let dir = scratch.join("volumes").join(volume);
        std::fs::create_dir_all(&dir).map_err(|e| config_error(format!("emptyDir: {e}")))?;
        // World-writable like a fresh emptyDir, so a non-root container can use it.
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777));
        return Ok(dir);
    }
    if let Some(c) = &v.persistent_volume_claim {
        let unbound = |m: String| NotStartable {
            reason: "ContainerCreating",
            message: m,
        };
        let pvc = Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns)
            .get_opt(&c.claim_name)
            .await
            .map_err(|e| unbound(format!("reading claim {:?}: {e}", c.claim_name)))?
            .ok_or_else(|| {
                unbound(format!(
                    "persistentvolumeclaim \"{}\" not found",
                    c.claim_name
                ))
            })?;
        let bound = pvc.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
        let Some(pv_name) = pvc
            .spec
            .as_ref()
            .and_then(|s| s.volume_name.clone())
            .filter(|_| bound)
        else {
            return Err(unbound(format!(
                "persistentvolumeclaim \"{}\" is not bound",
                c.claim_name
            )));
        };
        let pv = Api::<PersistentVolume>::all(client.clone())
            .get(&pv_name)
            .await
            .map_err(|e| unbound(format!("reading volume {pv_name:?}: {e}")))?;
        let spec = pv.spec.unwrap_or_default();
        return spec
            .host_path
            .map(|h| PathBuf::from(h.path))
            .or_else(|| spec.local.map(|l| PathBuf::from(l.path)))
            .ok_or_else(|| {
                config_error(format!(
                    "PersistentVolume {pv_name}: only hostPath and local volumes can be mounted here"
                ))
            });
    }
    if let Some(p) = &v.projected {
        let dir = scratch.join("volumes").join(volume);
        project(client, ns, pod, p, &dir).await?;
        return Ok(dir);
    }
    Err(config_error(format!(
        "volume {volume:?}: only hostPath, emptyDir, persistentVolumeClaim and projected volumes are supported"
    )))
}

/// Write a projected volume (the ServiceAccount admission plugin adds one with a token,
/// the cluster CA and the namespace) into `dir`.
async fn project(
    client: &Client,
    ns: &str,
    pod: &Pod,
    p: &k8s_openapi::api::core::v1::ProjectedVolumeSource,
    dir: &Path,
) -> Result<(), NotStartable> {
    use std::os::unix::fs::PermissionsExt;
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        config_error(format!("projected volume: {what}: {e}"))
    };
    std::fs::create_dir_all(dir).map_err(|e| fail("creating", &e))?;
    let write = |rel: &str, data: &[u8]| -> Result<(), NotStartable> {
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| fail(rel, &e))?;
        }
        std::fs::write(&path, data).map_err(|e| fail(rel, &e))?;
        let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644));
        Ok(())
    };
    for src in p.sources.iter().flatten() {
        if let Some(t) = &src.service_account_token {
            let sa = pod
                .spec
                .as_ref()
                .and_then(|s| s.service_account_name.clone())
                .unwrap_or_else(|| "default".into());
            let req = serde_json::json!({
                "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {
                    "audiences": t.audience.iter().collect::<Vec<_>>(),
                    "expirationSeconds": t.expiration_seconds.unwrap_or(3600),
                    "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                                       "name": pod.name_any(), "uid": pod.metadata.uid},
                },
            });
            let api: Api<k8s_openapi::api::core::v1::ServiceAccount> =
                Api::namespaced(client.clone(), ns);
            let resp: serde_json::Value = api
                .create_subresource("token", &sa, &Default::default(), &req)
                .await
                .map_err(|e| fail("token request", &e))?;
            let token = resp["status"]["token"].as_str().unwrap_or_default();
            write(&t.path, token.as_bytes())?;
        }
        if let Some(c) = &src.config_map {
            let cm = Api::<ConfigMap>::namespaced(client.clone(), ns)
                .get_opt(&c.name)
                .await
                .map_err(|e| fail(&c.name, &e))?;
            let data = cm.and_then(|cm| cm.data).unwrap_or_default();
            match &c.items {
                Some(items) => {
                    for i in items {
                        if let Some(v) = data.get(&i.key) {
                            write(&i.path, v.as_bytes())?;
                        }
                    }
                }
                None => {
                    for (k, v) in &data {
                        write(k, v.as_bytes())?;
                    }
                }
            }
        }
        if let Some(d) = &src.downward_api {
            for i in d.items.iter().flatten() {
                if let Some(f) = &i.field_ref {
                    let place = Placement {
                        node_name: "",
                        pod_ip: Ipv4Addr::UNSPECIFIED,
                        host_ip: "",
                    };
                    let v = field_ref(pod, &f.field_path, &place).map_err(|e| fail(&i.path, &e))?;
                    write(&i.path, v.as_bytes())?;
                }
            }
        }
    }
    Ok(())
}

/// Resolve everything `container` of `pod` needs. `entrypoint` is what every image runs.
pub async fn resolve(
    client: &Client,
    pod: &Pod,
    container: &Container,
    place: &Placement<'_>,
    entrypoint: &Path,
    scratch: &Path,
) -> Result<ContainerConfig, NotStartable> {
    let ns = pod.namespace().unwrap_or_default();
    let spec = pod.spec.as_ref().expect("pods have a spec");
    let mut vars = BTreeMap::new();
    let mut env = Vec::new();
    for e in container.env.iter().flatten() {
        if let Some(v) = env_value(client, &ns, pod, e, place, &vars).await? {
            vars.insert(e.name.clone(), v.clone());
            env.retain(|(k, _): &(String, String)| k != &e.name);
            env.push((e.name.clone(), v));
        }
    }
    if container.env_from.as_ref().is_some_and(|f| !f.is_empty()) {
        return Err(config_error("envFrom is not supported".into()));
    }
    let hostname = spec.hostname.clone().unwrap_or_else(|| pod.name_any());
    for (k, v) in [
        (
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
        ),
        ("HOSTNAME", hostname),
    ] {
        if !env.iter().any(|(name, _)| name == k) {
            env.push((k.to_string(), v));
        }
    }

    let command: Vec<String> = container
        .command
        .iter()
        .flatten()
        .map(|c| expand(c, &vars))
        .collect();
    let mut args: Vec<String> = container
        .args
        .iter()
        .flatten()
        .map(|a| expand(a, &vars))
        .collect();
    let program = match command.split_first() {
        Some((p, rest)) => {
            let mut a = rest.to_vec();
            a.append(&mut args);
            args = a;
            PathBuf::from(p)
        }
        None => entrypoint.to_path_buf(),
    };

    let mut mounts = Vec::new();
    for m in container.volume_mounts.iter().flatten() {
        if m.sub_path.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(config_error(format!(
                "volume mount {}: subPath is not supported",
                m.name
            )));
        }
        let source = volume_source(client, &ns, pod, &m.name, scratch).await?;
        mounts.push(Mount {
            source,
            target: m.mount_path.clone(),
            read_only: m.read_only == Some(true),
        });
    }

    let psc = spec.security_context.clone().unwrap_or_default();
    let csc = container.security_context.clone().unwrap_or_default();
    // No image metadata here: an image without a user runs as root, as it would in a
    // container runtime.
    let uid = csc.run_as_user.or(psc.run_as_user).unwrap_or(0);
    let gid = csc.run_as_group.or(psc.run_as_group).unwrap_or(0);
    let non_root = csc.run_as_non_root.or(psc.run_as_non_root) == Some(true);
    if non_root && uid == 0 {
        return Err(config_error(format!(
            "container has runAsNonRoot and image will run as root (pod: \"{}_{}({})\", container: {})",
            pod.name_any(),
            ns,
            pod.metadata.uid.clone().unwrap_or_default(),
            container.name
        )));
    }
    let mut groups: Vec<u32> = psc
        .supplemental_groups
        .iter()
        .flatten()
        .filter_map(|g| u32::try_from(*g).ok())
        .collect();
    if let Some(fs) = psc.fs_group.and_then(|g| u32::try_from(g).ok()) {
        groups.push(fs);
    }
    Ok(ContainerConfig {
        program,
        args,
        env,
        mounts,
        uid: u32::try_from(uid).map_err(|_| config_error(format!("runAsUser {uid}")))?,
        gid: u32::try_from(gid).map_err(|_| config_error(format!("runAsGroup {gid}")))?,
        groups,
        read_only_root: csc.read_only_root_filesystem == Some(true),
        no_new_privs: csc.allow_privilege_escalation == Some(false),
        workdir: container.working_dir.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expansion_follows_the_kubelet() {
        let vars = BTreeMap::from([
            ("A".to_string(), "one".to_string()),
            ("B".to_string(), "two".to_string()),
        ]);
        assert_eq!(expand("$(A)-$(B)", &vars), "one-two");
        assert_eq!(expand("$$(A)", &vars), "$(A)");
        assert_eq!(expand("$(MISSING) $(A", &vars), "$(MISSING) $(A");
        assert_eq!(expand("cost $5", &vars), "cost $5");
    }
}
