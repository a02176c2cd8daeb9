//! Pure builders: the Kubernetes objects the controller applies for a `PDDeployment`.
//!
//! Every object carries the deployment's labels and a controller owner reference to the
//! `PDDeployment` (so garbage collection removes it with its owner and the controller is
//! woken by its changes). Nothing here does I/O; the controller decides when to apply.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction,
    HostPathVolumeSource, ObjectFieldSelector, PersistentVolumeClaimVolumeSource, Pod,
    PodReadinessGate, PodSecurityContext, PodSpec, Probe, SeccompProfile, Secret,
    SecretKeySelector, SecurityContext, Service, ServicePort, ServiceSpec, Volume, VolumeMount,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};

use crate::crd::{
    HealthSpec, PDDeployment, PDDeploymentSpec, PodTemplate, RevisionedSpec, conditions, labels,
};
use crate::names;
use crate::planner::{PodIntent, Role};

/// Name of the dataplane container in every pod.
pub const CONTAINER: &str = "dataplane";
/// Key of the group key inside the group Secret.
pub const SECRET_KEY: &str = "key";
/// Environment variable that carries the group key into the dataplane.
pub const GROUP_KEY_ENV: &str = "TANDEM_GROUP_KEY";
/// Name of the model volume.
const MODEL_VOLUME: &str = "model";
/// Name of the container port of the dataplane's HTTP server (API, probes, metrics).
pub const HTTP_PORT_NAME: &str = "http";
const KV_PORT_NAME: &str = "kv";
/// UID and GID dataplane pods run as unless their template says otherwise: the numeric
/// non-root user of the images in `docker/`.
pub const DEFAULT_UID: i64 = 65532;
/// Liveness: a process whose HTTP loop does not answer `/health` within this many seconds,
/// three times in a row, ten seconds apart, is killed (and its group co-restarted).
const LIVENESS_PERIOD_SECONDS: i32 = 10;
const LIVENESS_TIMEOUT_SECONDS: i32 = 5;
const LIVENESS_FAILURE_THRESHOLD: i32 = 3;

/// The `PDDeployment` lacks a field every owned object needs (objects read from the API
/// server always have them).
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("PDDeployment has no {0}")]
    Missing(&'static str),
}

/// Controller owner reference to the deployment (`controller: true`,
/// `blockOwnerDeletion: true`).
pub fn owner_reference(pdd: &PDDeployment) -> Result<OwnerReference, BuildError> {
    let owner = pdd
        .controller_owner_ref(&())
        .ok_or(BuildError::Missing("metadata.uid"))?;
    Ok(OwnerReference {
        block_owner_deletion: Some(true),
        ..owner
    })
}

fn namespace(pdd: &PDDeployment) -> Result<String, BuildError> {
    pdd.namespace()
        .ok_or(BuildError::Missing("metadata.namespace"))
}

/// Labels of every object of the deployment.
pub fn deployment_labels(deployment: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (labels::DEPLOYMENT.to_string(), deployment.to_string()),
        (labels::MANAGED_BY.to_string(), labels::MANAGER.to_string()),
    ])
}

/// Value of the `tandem.dev/ports` label: the ports a Service or NetworkPolicy serves.
pub fn ports_label(t: &crate::crd::TransferSpec) -> String {
    format!("{}-{}", t.http_port, t.kv_port)
}

/// `labels` plus the ports label of `pdd`'s current transfer spec.
fn with_ports(
    mut labels: BTreeMap<String, String>,
    pdd: &PDDeployment,
) -> BTreeMap<String, String> {
    labels.insert(labels::PORTS.to_string(), ports_label(&pdd.spec.transfer));
    labels
}

/// Labels of every object of one group.
pub fn group_labels(deployment: &str, group: i32) -> BTreeMap<String, String> {
    let mut l = deployment_labels(deployment);
    l.insert(labels::GROUP.to_string(), group.to_string());
    l
}

/// Selector labels of one role of one group (all incarnations).
fn role_selector(deployment: &str, group: i32, role: Role) -> BTreeMap<String, String> {
    BTreeMap::from([
        (labels::DEPLOYMENT.to_string(), deployment.to_string()),
        (labels::GROUP.to_string(), group.to_string()),
        (labels::ROLE.to_string(), role.as_str().to_string()),
    ])
}

fn meta(
    pdd: &PDDeployment,
    name: String,
    labels: BTreeMap<String, String>,
) -> Result<ObjectMeta, BuildError> {
    Ok(ObjectMeta {
        name: Some(name),
        namespace: Some(namespace(pdd)?),
        labels: Some(labels),
        owner_references: Some(vec![owner_reference(pdd)?]),
        ..Default::default()
    })
}

/// Bootstrap addresses of a group's prefill pods, as given to its decode pods.
pub fn prefill_peers(
    deployment: &str,
    namespace: &str,
    group: i32,
    template: &RevisionedSpec,
) -> Vec<String> {
    let service = names::group_service_name(deployment, group);
    let kv_port = template.transfer.kv_port;
    (0..template.prefill.replicas.max(1))
        .map(|k| {
            format!(
                "{}.{service}.{namespace}.svc:{kv_port}",
                names::prefill_hostname(k)
            )
        })
        .collect()
}

fn env_value(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: Some(value.into()),
        ..Default::default()
    }
}

fn env_field(name: &str, field_path: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: field_path.to_string(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn http_probe(path: &str, period: i32, timeout: i32, failure_threshold: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_string()),
            port: IntOrString::String(HTTP_PORT_NAME.to_string()),
            ..Default::default()
        }),
        period_seconds: Some(period),
        timeout_seconds: Some(timeout),
        failure_threshold: Some(failure_threshold),
        ..Default::default()
    }
}

/// The three probes of a dataplane container.
#[derive(Debug, Clone, PartialEq)]
pub struct Probes {
    /// `/health` every probe period until it answers, for at most
    /// `health.startupTimeoutSeconds`: the process binds its HTTP port only after the
    /// model is loaded, and the kubelet runs neither liveness nor readiness before the
    /// startup probe has succeeded, so a slow load is never mistaken for a hang.
    pub startup: Probe,
    /// `/ready` (the bootstrap channel) every probe period; a probe that takes longer
    /// than the period counts as failed, so readiness follows the channel's own
    /// `failureThreshold × probePeriod` bound.
    pub readiness: Probe,
    /// `/health` (the process and its event loop); generous, because it kills.
    pub liveness: Probe,
}

/// Probes derived from the (revisioned) health spec.
pub fn probes(h: &HealthSpec) -> Probes {
    let period = h.probe_period_seconds.max(1);
    // ceil(startup timeout / period), in i64 so that no spec value overflows.
    let startup_threshold =
        (i64::from(h.startup_timeout_seconds.max(1)) + i64::from(period) - 1) / i64::from(period);
    let startup_threshold = i32::try_from(startup_threshold).unwrap_or(i32::MAX);
    Probes {
        startup: http_probe("/health", period, period, startup_threshold),
        readiness: http_probe("/ready", period, period, h.failure_threshold.max(1)),
        liveness: http_probe(
            "/health",
            LIVENESS_PERIOD_SECONDS,
            LIVENESS_TIMEOUT_SECONDS,
            LIVENESS_FAILURE_THRESHOLD,
        ),
    }
}

/// The pod-level security context: the template's, with every field it leaves unset
/// taken from the restricted Pod Security profile (non-root UID/GID [`DEFAULT_UID`],
/// seccomp `RuntimeDefault`).
pub fn pod_security_context(tpl: &PodTemplate) -> PodSecurityContext {
    let mut sc = tpl.security_context.clone().unwrap_or_default();
    sc.run_as_non_root.get_or_insert(true);
    sc.run_as_user.get_or_insert(DEFAULT_UID);
    sc.run_as_group.get_or_insert(DEFAULT_UID);
    sc.seccomp_profile.get_or_insert_with(|| SeccompProfile {
        type_: "RuntimeDefault".into(),
        ..Default::default()
    });
    sc
}

/// The dataplane container's security context: the template's, with every field it
/// leaves unset taken from the restricted profile (no privilege escalation, every
/// capability dropped) plus a read-only root filesystem (the dataplane writes no file).
pub fn container_security_context(tpl: &PodTemplate) -> SecurityContext {
    let mut sc = tpl.container_security_context.clone().unwrap_or_default();
    sc.allow_privilege_escalation.get_or_insert(false);
    sc.read_only_root_filesystem.get_or_insert(true);
    sc.capabilities
        .get_or_insert_with(Capabilities::default)
        .drop
        .get_or_insert_with(|| vec!["ALL".into()]);
    sc
}

/// How a dataplane process is reached and how it reaches its peers.
#[derive(Debug, Clone, PartialEq)]
pub struct DataplaneNetwork {
    /// `--host`: `None` keeps the dataplane's default (every interface), as in a pod.
    pub host: Option<String>,
    pub http_port: i32,
    pub kv_port: i32,
    /// A decode's prefill KV endpoints in replica order (unused for a prefill).
    pub prefill_peers: Vec<String>,
}

impl DataplaneNetwork {
    /// A pod's network: the spec's ports on every interface, and the prefill pods' DNS
    /// names under the group's headless Service.
    pub fn in_cluster(deployment: &str, namespace: &str, intent: &PodIntent) -> Self {
        let t = &intent.template;
        Self {
            host: None,
            http_port: t.transfer.http_port,
            kv_port: t.transfer.kv_port,
            prefill_peers: prefill_peers(deployment, namespace, intent.group, t),
        }
    }
}

/// Command-line arguments and environment of one dataplane member.
#[derive(Debug, Clone, PartialEq)]
pub struct DataplaneInvocation {
    pub args: Vec<String>,
    /// In Kubernetes form: the group key comes from the group Secret and the pod's name
    /// and namespace from field references; the local runtime resolves these the way the
    /// kubelet does.
    pub env: Vec<EnvVar>,
}

/// Flags [`dataplane_invocation`] puts on every member's command line (from the spec's
/// model and transfer sections, the group and the executor), and `--check-config`. The
/// dataplane refuses a flag given twice, so a spec's `args` must not repeat one.
pub const OPERATOR_FLAGS: [&str; 7] = [
    "--role",
    "--model",
    "--served-model-name",
    "--port",
    "--kv-port",
    "--prefill",
    "--check-config",
];

/// A spec whose `prefill.args` or `decode.args` repeat an [`OPERATOR_FLAGS`] flag: its
/// pods would exit at once (`the argument '--port' cannot be used multiple times`). The
/// error names the field and where the value belongs.
pub fn check_role_args(spec: &PDDeploymentSpec) -> Result<(), String> {
    for (role, r) in [("prefill", &spec.prefill), ("decode", &spec.decode)] {
        for (i, a) in r.args.iter().enumerate() {
            let flag = a.split_once('=').map_or(a.as_str(), |(f, _)| f);
            if OPERATOR_FLAGS.contains(&flag) {
                return Err(format!(
                    "spec.{role}.args[{i}]: {flag} is set by the operator (from spec.model, spec.transfer and the group) and may not be repeated; remove it"
                ));
            }
        }
    }
    Ok(())
}

/// The dataplane arguments and environment of a planned member: the one definition both
/// executors use (the controller puts them in the pod's container, the local runtime
/// starts a process with them), so a member is configured the same way everywhere.
pub fn dataplane_invocation(
    deployment: &str,
    intent: &PodIntent,
    net: &DataplaneNetwork,
) -> DataplaneInvocation {
    let t = &intent.template;
    let role_spec = match intent.role {
        Role::Prefill => &t.prefill,
        Role::Decode => &t.decode,
    };
    let mut args = vec![
        "--role".to_string(),
        intent.role.as_str().to_string(),
        "--model".to_string(),
        t.model.path.clone(),
        "--served-model-name".to_string(),
        t.model.name.clone(),
    ];
    if let Some(host) = &net.host {
        args.push("--host".to_string());
        args.push(host.clone());
    }
    args.extend([
        "--port".to_string(),
        net.http_port.to_string(),
        "--kv-port".to_string(),
        net.kv_port.to_string(),
    ]);
    let peers = net.prefill_peers.join(",");
    if intent.role == Role::Decode {
        args.push("--prefill".to_string());
        args.push(peers.clone());
    }
    args.extend(role_spec.args.iter().cloned());

    let mut env = vec![
        env_value("TANDEM_ROLE", intent.role.as_str()),
        env_value("TANDEM_GROUP", intent.group.to_string()),
        env_value("TANDEM_GROUP_INCARNATION", intent.incarnation.to_string()),
    ];
    if intent.role == Role::Decode {
        env.push(env_value("TANDEM_PREFILL_PEERS", peers));
    }
    env.extend([
        EnvVar {
            name: GROUP_KEY_ENV.into(),
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector {
                    name: names::group_secret_name(deployment, intent.group),
                    key: SECRET_KEY.into(),
                    optional: Some(false),
                }),
                ..Default::default()
            }),
            ..Default::default()
        },
        env_value(
            "TANDEM_PROBE_PERIOD_SECONDS",
            t.health.probe_period_seconds.to_string(),
        ),
        env_value(
            "TANDEM_FAILURE_THRESHOLD",
            t.health.failure_threshold.to_string(),
        ),
        env_value(
            "TANDEM_BOOTSTRAP_TIMEOUT_SECONDS",
            t.transfer.bootstrap_timeout_seconds.to_string(),
        ),
        env_value(
            "TANDEM_KV_TIMEOUT_SECONDS",
            t.transfer.kv_timeout_seconds.to_string(),
        ),
        env_field("TANDEM_POD_NAME", "metadata.name"),
        env_field("TANDEM_NAMESPACE", "metadata.namespace"),
    ]);
    // User variables come after ours; one that reuses an operator name is dropped (the
    // operator's value wins, and server-side apply rejects duplicate names).
    let ours: Vec<String> = env.iter().map(|e| e.name.clone()).collect();
    env.extend(
        role_spec
            .template
            .env
            .iter()
            .filter(|e| !ours.contains(&e.name))
            .cloned(),
    );
    DataplaneInvocation { args, env }
}

/// The pod for one planned member. The image's entrypoint must be the dataplane binary;
/// the operator only supplies its arguments.
pub fn pod(pdd: &PDDeployment, intent: &PodIntent) -> Result<Pod, BuildError> {
    let deployment = pdd.name_any();
    let ns = namespace(pdd)?;
    let t = &intent.template;
    let role_spec = match intent.role {
        Role::Prefill => &t.prefill,
        Role::Decode => &t.decode,
    };
    let tpl = &role_spec.template;

    // User labels first: the operator's own labels win on conflict.
    let mut pod_labels = tpl.labels.clone();
    pod_labels.extend(group_labels(&deployment, intent.group));
    pod_labels.insert(labels::ROLE.into(), intent.role.as_str().into());
    pod_labels.insert(labels::REVISION.into(), intent.revision.clone());
    pod_labels.insert(labels::INCARNATION.into(), intent.incarnation.to_string());

    let mut metadata = meta(pdd, intent.name.clone(), pod_labels)?;
    if !tpl.annotations.is_empty() {
        metadata.annotations = Some(tpl.annotations.clone());
    }

    let DataplaneInvocation { args, env } = dataplane_invocation(
        &deployment,
        intent,
        &DataplaneNetwork::in_cluster(&deployment, &ns, intent),
    );

    let mut ports = vec![ContainerPort {
        name: Some(HTTP_PORT_NAME.into()),
        container_port: t.transfer.http_port,
        protocol: Some("TCP".into()),
        ..Default::default()
    }];
    if intent.role == Role::Prefill {
        ports.push(ContainerPort {
            name: Some(KV_PORT_NAME.into()),
            container_port: t.transfer.kv_port,
            protocol: Some("TCP".into()),
            ..Default::default()
        });
    }

    let (volumes, mounts) = match &t.model.volume {
        Some(v) if v.claim_name.is_some() || v.host_path.is_some() => {
            let mut volume = Volume {
                name: MODEL_VOLUME.into(),
                ..Default::default()
            };
            if let Some(claim) = &v.claim_name {
                volume.persistent_volume_claim = Some(PersistentVolumeClaimVolumeSource {
                    claim_name: claim.clone(),
                    read_only: Some(true),
                });
            } else if let Some(path) = &v.host_path {
                volume.host_path = Some(HostPathVolumeSource {
                    path: path.clone(),
                    type_: Some("Directory".into()),
                });
            }
            let mount = VolumeMount {
                name: MODEL_VOLUME.into(),
                mount_path: v.mount_path.clone(),
                read_only: Some(true),
                ..Default::default()
            };
            (Some(vec![volume]), Some(vec![mount]))
        }
        _ => (None, None),
    };

    let probes = probes(&t.health);
    let container = Container {
        name: CONTAINER.into(),
        image: Some(tpl.image.clone()),
        image_pull_policy: tpl.image_pull_policy.clone(),
        args: Some(args),
        env: Some(env),
        ports: Some(ports),
        resources: tpl.resources.clone(),
        startup_probe: Some(probes.startup),
        readiness_probe: Some(probes.readiness),
        liveness_probe: Some(probes.liveness),
        security_context: Some(container_security_context(tpl)),
        volume_mounts: mounts,
        ..Default::default()
    };

    let (hostname, subdomain) = match intent.role {
        Role::Prefill => (
            Some(names::prefill_hostname(intent.index)),
            Some(names::group_service_name(&deployment, intent.group)),
        ),
        Role::Decode => (None, None),
    };
    let readiness_gates = (intent.role == Role::Decode).then(|| {
        vec![PodReadinessGate {
            condition_type: conditions::GROUP_READY.into(),
        }]
    });

    Ok(Pod {
        metadata,
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            containers: vec![container],
            readiness_gates,
            hostname,
            subdomain,
            node_selector: (!tpl.node_selector.is_empty()).then(|| tpl.node_selector.clone()),
            tolerations: (!tpl.tolerations.is_empty()).then(|| tpl.tolerations.clone()),
            affinity: tpl.affinity.clone(),
            topology_spread_constraints: (!tpl.topology_spread_constraints.is_empty())
                .then(|| tpl.topology_spread_constraints.clone()),
            priority_class_name: tpl.priority_class_name.clone(),
            scheduler_name: tpl.scheduler_name.clone(),
            service_account_name: tpl.service_account_name.clone(),
            automount_service_account_token: Some(
                tpl.automount_service_account_token.unwrap_or(false),
            ),
            security_context: Some(pod_security_context(tpl)),
            volumes,
            ..Default::default()
        }),
        status: None,
    })
}

fn service_port(name: &str, port: i32) -> ServicePort {
    ServicePort {
        name: Some(name.into()),
        port,
        target_port: Some(IntOrString::String(name.into())),
        protocol: Some("TCP".into()),
        ..Default::default()
    }
}

/// The client-facing Service `<name>`: the decode pods of every group, port `http`. Only
/// decode pods whose group gate is open are Ready, so only complete groups get traffic.
pub fn client_service(pdd: &PDDeployment) -> Result<Service, BuildError> {
    let name = pdd.name_any();
    let selector = BTreeMap::from([
        (labels::DEPLOYMENT.to_string(), name.clone()),
        (labels::ROLE.to_string(), Role::Decode.as_str().to_string()),
    ]);
    Ok(Service {
        metadata: meta(pdd, name.clone(), with_ports(deployment_labels(&name), pdd))?,
        spec: Some(ServiceSpec {
            selector: Some(selector),
            ports: Some(vec![service_port(
                HTTP_PORT_NAME,
                pdd.spec.transfer.http_port,
            )]),
            ..Default::default()
        }),
        status: None,
    })
}

/// The headless bootstrap Service of a group: its prefill pods' DNS names
/// (`prefill-<k>.<service>.<ns>.svc`). Published whether or not the prefill is Ready:
/// readiness is judged by the decode's channel probe and the operator's window, and a
/// name that vanished with a brief not-ready would break the decode's reconnects and turn
/// a blip into a co-restart.
pub fn group_service(pdd: &PDDeployment, group: i32) -> Result<Service, BuildError> {
    let name = pdd.name_any();
    Ok(Service {
        metadata: meta(
            pdd,
            names::group_service_name(&name, group),
            with_ports(group_labels(&name, group), pdd),
        )?,
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(role_selector(&name, group, Role::Prefill)),
            ports: Some(vec![
                service_port(KV_PORT_NAME, pdd.spec.transfer.kv_port),
                service_port(HTTP_PORT_NAME, pdd.spec.transfer.http_port),
            ]),
            publish_not_ready_addresses: Some(true),
            ..Default::default()
        }),
        status: None,
    })
}

/// The NetworkPolicy of a group: its prefill pods accept the KV port only from the
/// group's decode pods; the HTTP port (probes, metrics, API) from anywhere.
pub fn network_policy(pdd: &PDDeployment, group: i32) -> Result<NetworkPolicy, BuildError> {
    let name = pdd.name_any();
    let port = |p: i32| NetworkPolicyPort {
        port: Some(IntOrString::Int(p)),
        protocol: Some("TCP".into()),
        ..Default::default()
    };
    Ok(NetworkPolicy {
        metadata: meta(
            pdd,
            names::network_policy_name(&name, group),
            with_ports(group_labels(&name, group), pdd),
        )?,
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(role_selector(&name, group, Role::Prefill)),
                ..Default::default()
            }),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![
                NetworkPolicyIngressRule {
                    from: Some(vec![NetworkPolicyPeer {
                        pod_selector: Some(LabelSelector {
                            match_labels: Some(role_selector(&name, group, Role::Decode)),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }]),
                    ports: Some(vec![port(pdd.spec.transfer.kv_port)]),
                },
                NetworkPolicyIngressRule {
                    from: None,
                    ports: Some(vec![port(pdd.spec.transfer.http_port)]),
                },
            ]),
            ..Default::default()
        }),
    })
}

/// A fresh random group key: 32 random bytes, hex-encoded.
pub fn random_group_key() -> String {
    hex::encode(rand::random::<[u8; 32]>())
}

/// The Secret of a group holding `key` under [`SECRET_KEY`].
pub fn group_secret(pdd: &PDDeployment, group: i32, key: &str) -> Result<Secret, BuildError> {
    let name = pdd.name_any();
    Ok(Secret {
        metadata: meta(
            pdd,
            names::group_secret_name(&name, group),
            group_labels(&name, group),
        )?,
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([(
            SECRET_KEY.to_string(),
            ByteString(key.as_bytes().to_vec()),
        )])),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
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
                "--role",
                "prefill",
                "--model",
                "/models/smollm2.gguf",
                "--served-model-name",
                "smollm2",
                "--port",
                "8000",
                "--kv-port",
                "5600",
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

        let env = env_of(&pod);
        assert_eq!(value(&env, "TANDEM_ROLE"), "prefill");
        assert!(!env.contains_key("TANDEM_PREFILL_PEERS"));
        let key = env["TANDEM_GROUP_KEY"].value_from.as_ref().unwrap();
        let key = key.secret_key_ref.as_ref().unwrap();
        assert_eq!(
            (key.name.as_str(), key.key.as_str()),
            ("demo-g2-key", "key")
        );
    }

    #[test]
    fn decode_pod_has_gate_peers_and_group_env() {
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
        let peers =
            "prefill-0.demo-g2-bootstrap.ns1.svc:5600,prefill-1.demo-g2-bootstrap.ns1.svc:5600";
        let args = c.args.as_ref().unwrap();
        assert_eq!(&args[..2], ["--role", "decode"]);
        assert_eq!(&args[10..], ["--prefill", peers, "--max-batch", "8"]);
        let ports: Vec<_> = c
            .ports
            .as_ref()
            .unwrap()
            .iter()
            .map(|p| p.container_port)
            .collect();
        assert_eq!(ports, [8000], "decode exposes no KV port");

        let env = env_of(&pod);
        assert_eq!(value(&env, "TANDEM_ROLE"), "decode", "operator env wins");
        assert_eq!(value(&env, "RUST_LOG"), "debug");
        assert_eq!(value(&env, "TANDEM_GROUP"), "2");
        assert_eq!(value(&env, "TANDEM_GROUP_INCARNATION"), "3");
        assert_eq!(value(&env, "TANDEM_PREFILL_PEERS"), peers);
        assert_eq!(value(&env, "TANDEM_PROBE_PERIOD_SECONDS"), "2");
        assert_eq!(value(&env, "TANDEM_FAILURE_THRESHOLD"), "3");
        assert_eq!(value(&env, "TANDEM_BOOTSTRAP_TIMEOUT_SECONDS"), "10");
        assert_eq!(value(&env, "TANDEM_KV_TIMEOUT_SECONDS"), "10");
        let field = |n: &str| {
            env[n]
                .value_from
                .as_ref()
                .unwrap()
                .field_ref
                .as_ref()
                .unwrap()
                .field_path
                .clone()
        };
        assert_eq!(field("TANDEM_POD_NAME"), "metadata.name");
        assert_eq!(field("TANDEM_NAMESPACE"), "metadata.namespace");
        let names: Vec<_> = c
            .env
            .as_ref()
            .unwrap()
            .iter()
            .map(|e| e.name.as_str())
            .collect();
        assert_eq!(names.iter().filter(|n| **n == "TANDEM_ROLE").count(), 1);
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
                "--role",
                "decode",
                "--model",
                "/models/smollm2.gguf",
                "--served-model-name",
                "smollm2",
                "--host",
                "127.0.0.1",
                "--port",
                "41000",
                "--kv-port",
                "41001",
                "--prefill",
                "127.0.0.1:42001"
            ]
        );
        let names = |e: &[EnvVar]| e.iter().map(|v| v.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&local.env), names(&cluster.env));
        let peers = local
            .env
            .iter()
            .find(|e| e.name == "TANDEM_PREFILL_PEERS")
            .unwrap();
        assert_eq!(peers.value.as_deref(), Some("127.0.0.1:42001"));
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
    fn args_that_repeat_an_operator_flag_are_refused_by_field() {
        let mut s = crate::testutil::spec(1);
        s.decode.args = vec!["--max-batch".into(), "32".into()];
        check_role_args(&s).unwrap();
        s.decode.args.push("--port=9000".into());
        assert_eq!(
            check_role_args(&s).unwrap_err(),
            "spec.decode.args[2]: --port is set by the operator (from spec.model, spec.transfer and the group) and may not be repeated; remove it"
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
            for f in OPERATOR_FLAGS.iter().filter(|f| **f != "--check-config") {
                if *f == "--prefill" && role == Role::Prefill {
                    continue;
                }
                assert!(
                    inv.args.iter().any(|a| a == f),
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
}
