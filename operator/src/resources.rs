//! Pure builders: the Kubernetes objects the controller applies for a `PDDeployment`.
//!
//! Every object carries the deployment's labels and a controller owner reference to the
//! `PDDeployment` (so garbage collection removes it with its owner and the controller is
//! woken by its changes). Nothing here does I/O; the controller decides when to apply.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction,
    HostPathVolumeSource, PersistentVolumeClaimVolumeSource, Pod, PodReadinessGate,
    PodSecurityContext, PodSpec, Probe, SeccompProfile, Secret, SecretKeySelector, SecurityContext,
    Service, ServicePort, ServiceSpec, Volume, VolumeMount,
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
use tandem_contract::{self as contract, MemberRole, MemberSettings};

/// Name of the dataplane container in every pod.
pub const CONTAINER: &str = "dataplane";
/// Key of the group key inside the group Secret.
pub const SECRET_KEY: &str = "key";
/// Environment variable that carries the group key into the dataplane.
pub const GROUP_KEY_ENV: &str = contract::GROUP_KEY_ENV;
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
    /// `spec.router` is set but the operator was not told which image runs the router.
    #[error(
        "spec.router is set but the operator has no router image: set TANDEM_ROUTER_IMAGE (the chart sets the operator's own image)"
    )]
    NoRouterImage,
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
    pub http_port: u16,
    pub kv_port: u16,
    /// A decode's prefill KV endpoints in replica order (unused for a prefill).
    pub prefill_peers: Vec<String>,
}

/// A port of the spec (the CRD admits 1-65535 only).
fn spec_port(p: i32) -> u16 {
    u16::try_from(p.clamp(1, i32::from(u16::MAX))).unwrap_or(u16::MAX)
}

/// Seconds of the spec (the CRD admits at least 1).
fn spec_seconds(s: i32) -> u32 {
    s.max(1).unsigned_abs()
}

impl DataplaneNetwork {
    /// A pod's network: the spec's ports on every interface, and the prefill pods' DNS
    /// names under the group's headless Service.
    pub fn in_cluster(deployment: &str, namespace: &str, intent: &PodIntent) -> Self {
        let t = &intent.template;
        Self {
            host: None,
            http_port: spec_port(t.transfer.http_port),
            kv_port: spec_port(t.transfer.kv_port),
            prefill_peers: prefill_peers(deployment, namespace, intent.group, t),
        }
    }
}

/// Command-line arguments and environment of one dataplane member.
#[derive(Debug, Clone, PartialEq)]
pub struct DataplaneInvocation {
    pub args: Vec<String>,
    /// In Kubernetes form: the group key comes from the group Secret; the local runtime
    /// resolves it (and any field reference of the user's variables) as the kubelet does.
    pub env: Vec<EnvVar>,
}

/// Flags [`dataplane_invocation`] puts on a member's command line (every setting of the
/// contract), and `--check-config`. The dataplane refuses a flag given twice, so a spec's
/// `args` must not repeat one.
pub fn operator_flags() -> Vec<String> {
    contract::settings::reserved()
}

/// A spec whose members could never start or never pair (the CRD's rules say the same at
/// admission: `crd::args_rules`): `prefill.args` or `decode.args` repeating an
/// [`operator_flags`] flag (its pods would exit at once: `the argument '--port' cannot be
/// used multiple times`), `--kv-dtype` given as two arguments, or a KV dtype that differs
/// between the roles, in `args` or in the `TANDEM_KV_DTYPE` variable of their templates
/// (the decode receives the prefill's KV in the prefill's layout; the handshake would
/// refuse the pair once both had loaded the model). The error names the field.
pub fn check_role_args(spec: &PDDeploymentSpec) -> Result<(), String> {
    use crate::crd::args_rules::KV_DTYPE_FLAG;
    let reserved = operator_flags();
    for (role, r) in [("prefill", &spec.prefill), ("decode", &spec.decode)] {
        for (i, a) in r.args.iter().enumerate() {
            let flag = a.split_once('=').map_or(a.as_str(), |(f, _)| f);
            if reserved.iter().any(|r| r == flag) {
                return Err(format!(
                    "spec.{role}.args[{i}]: {flag} is set by the operator (from spec.model, spec.transfer, spec.health and the group) and may not be repeated; remove it"
                ));
            }
            if a == KV_DTYPE_FLAG {
                return Err(format!(
                    "spec.{role}.args[{i}]: write {KV_DTYPE_FLAG} as one argument, {KV_DTYPE_FLAG}=VALUE: prefill and decode must agree on it, which is checked in that form"
                ));
            }
        }
    }
    let dtype_args = |r: &crate::crd::RoleSpec| -> Vec<String> {
        let prefix = format!("{KV_DTYPE_FLAG}=");
        r.args
            .iter()
            .filter(|a| a.starts_with(&prefix))
            .cloned()
            .collect()
    };
    if dtype_args(&spec.prefill) != dtype_args(&spec.decode) {
        return Err(format!(
            "spec.prefill.args and spec.decode.args must give the same {KV_DTYPE_FLAG} (or neither): prefill {:?}, decode {:?}; the decode receives the prefill's KV cache in the prefill's layout, and the handshake refuses a pair that differs",
            dtype_args(&spec.prefill),
            dtype_args(&spec.decode)
        ));
    }
    let dtype_env = |r: &crate::crd::RoleSpec| -> Option<String> {
        r.template
            .env
            .iter()
            .find(|e| e.name == "TANDEM_KV_DTYPE")
            .map(|e| e.value.clone().unwrap_or_else(|| "<valueFrom>".into()))
    };
    if dtype_env(&spec.prefill) != dtype_env(&spec.decode) {
        return Err(format!(
            "spec.prefill.template.env and spec.decode.template.env must set TANDEM_KV_DTYPE alike (or neither): prefill {:?}, decode {:?}; the decode receives the prefill's KV cache in the prefill's layout",
            dtype_env(&spec.prefill),
            dtype_env(&spec.decode)
        ));
    }
    Ok(())
}

/// What the operator tells a planned member: the contract both executors render (the
/// controller into the pod, the local runtime into a process).
pub fn member_settings(intent: &PodIntent, net: &DataplaneNetwork) -> MemberSettings {
    let t = &intent.template;
    MemberSettings {
        role: match intent.role {
            Role::Prefill => MemberRole::Prefill,
            Role::Decode => MemberRole::Decode,
        },
        model: t.model.path.clone(),
        served_model_name: t.model.name.clone(),
        host: net.host.clone(),
        port: net.http_port,
        kv_port: net.kv_port,
        prefill_peers: match intent.role {
            Role::Prefill => Vec::new(),
            Role::Decode => net.prefill_peers.clone(),
        },
        group_incarnation: intent.incarnation.max(0).unsigned_abs(),
        probe_period_seconds: spec_seconds(t.health.probe_period_seconds),
        failure_threshold: spec_seconds(t.health.failure_threshold),
        bootstrap_timeout_seconds: spec_seconds(t.transfer.bootstrap_timeout_seconds),
        kv_timeout_seconds: spec_seconds(t.transfer.kv_timeout_seconds),
        channel_deadline_ms: t
            .transfer
            .channel_deadline_milliseconds
            .max(50)
            .unsigned_abs(),
        no_progress_seconds: t.health.no_progress_seconds.max(0).unsigned_abs(),
    }
}

/// The dataplane arguments and environment of a planned member: the one definition both
/// executors use, so a member is configured the same way everywhere. Every setting goes
/// once, on the command line ([`member_settings`]), then the spec's `args`; the
/// environment carries only the group key (from the group's Secret) and the user's
/// variables, less any that name a setting the operator gives (it would be ignored
/// beside the flag, and only mislead a reader of the pod).
pub fn dataplane_invocation(
    deployment: &str,
    intent: &PodIntent,
    net: &DataplaneNetwork,
) -> DataplaneInvocation {
    let role_spec = match intent.role {
        Role::Prefill => &intent.template.prefill,
        Role::Decode => &intent.template.decode,
    };
    let mut args = member_settings(intent, net).to_args();
    args.extend(role_spec.args.iter().cloned());
    let mut env = vec![EnvVar {
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
    }];
    let operator_set = |name: &str| contract::settings::ALL.iter().any(|s| s.env == name);
    env.extend(
        role_spec
            .template
            .env
            .iter()
            .filter(|e| !operator_set(&e.name))
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

mod router;
pub use router::{
    API_KEY_DIR, ROUTER_LABEL, router_deployment, router_pod_labels, router_role,
    router_role_binding, router_service, router_service_account,
};

#[cfg(test)]
mod tests;
