//! The `PDDeployment` custom resource (`tandem.dev/v1alpha1`, short name `pdd`).
//!
//! The spec says how many bootstrap groups to run and how to build their prefill and
//! decode pods; the status is both the user's view and the operator's memory between
//! reconciles (group incarnations, co-restart counts, backoff deadlines), so a restarted
//! operator picks up exactly where the previous one stopped.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, EnvVar, PodSecurityContext, ResourceRequirements, SecurityContext, Toleration,
    TopologySpreadConstraint,
};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// API group of every Tandem resource, label and annotation.
pub const GROUP: &str = "tandem.dev";

/// A set of bootstrap groups, each made of prefill pods and decode pods that live,
/// restart and are judged healthy together.
// The derive expands each `printcolumn(...)` into attributes clippy sees as duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "tandem.dev",
    version = "v1alpha1",
    kind = "PDDeployment",
    plural = "pddeployments",
    shortname = "pdd",
    namespaced,
    status = "PDDeploymentStatus",
    derive = "PartialEq",
    doc = "A prefill/decode disaggregated model deployment made of bootstrap groups that restart together.",
    scale(
        spec_replicas_path = ".spec.groups",
        status_replicas_path = ".status.groups",
        label_selector_path = ".status.selector"
    ),
    printcolumn(
        name = "Groups",
        type_ = "integer",
        json_path = ".spec.groups",
        description = "desired bootstrap groups"
    ),
    printcolumn(
        name = "Ready",
        type_ = "integer",
        json_path = ".status.readyGroups",
        description = "groups whose every member is ready at one incarnation"
    ),
    printcolumn(
        name = "Updated",
        type_ = "integer",
        json_path = ".status.updatedGroups",
        description = "groups at the update revision"
    ),
    printcolumn(
        name = "Available",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Available\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": args_rules::KV_DTYPE_PAIR_RULE,
    "message": args_rules::KV_DTYPE_PAIR_MESSAGE
}]))]
pub struct PDDeploymentSpec {
    /// The model every pod serves.
    pub model: ModelSpec,
    /// Number of bootstrap groups (the scale subresource acts on this field).
    #[serde(default = "default_groups")]
    #[schemars(range(min = 0, max = 999))]
    pub groups: i32,
    /// Prefill pods of each group.
    pub prefill: RoleSpec,
    /// Decode pods of each group (the client-facing front door).
    pub decode: RoleSpec,
    #[serde(default)]
    pub transfer: TransferSpec,
    #[serde(default)]
    pub health: HealthSpec,
    #[serde(default)]
    pub restart: RestartSpec,
    #[serde(default)]
    pub rollout: RolloutSpec,
    /// A router for this deployment (absent: none; the client Service `<name>` spreads
    /// requests over Ready groups' decodes). Not part of the revision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<RouterSpec>,
}

fn default_groups() -> i32 {
    1
}

/// Where the model lives inside the pods.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelSpec {
    /// Name the OpenAI API serves the model under.
    #[schemars(length(min = 1))]
    pub name: String,
    /// Path of the GGUF file inside the pod.
    #[schemars(length(min = 1))]
    pub path: String,
    /// Volume that holds the model file; without one the image must contain it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<ModelVolume>,
}

/// A read-only volume holding the model: a PersistentVolumeClaim or a host path.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "has(self.claimName) != has(self.hostPath)",
    "message": "model.volume needs exactly one of claimName and hostPath"
}]))]
pub struct ModelVolume {
    /// Name of a PersistentVolumeClaim in the same namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_name: Option<String>,
    /// Path on the node (for single-node and test clusters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// Where the volume is mounted in the dataplane container.
    #[serde(default = "default_mount_path")]
    pub mount_path: String,
}

fn default_mount_path() -> String {
    "/models".into()
}

/// Replicas per group, pod template and extra dataplane arguments of one role.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = args_rules::role_spec)]
pub struct RoleSpec {
    /// Pods of this role in every group.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 1, max = 64))]
    pub replicas: i32,
    pub template: PodTemplate,
    /// Extra arguments appended to the dataplane command line.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
}

fn default_replicas() -> i32 {
    1
}

/// The parts of a pod a user sets; the operator fills in everything else (command,
/// ports, probes, readiness gate, labels, environment for the group).
///
/// Security: unless set here, dataplane pods run under the restricted Pod Security
/// profile — pod: `runAsNonRoot`, UID/GID 65532, seccomp `RuntimeDefault`; container:
/// no privilege escalation, every capability dropped, read-only root filesystem — and
/// without a service-account token (the dataplane never calls the Kubernetes API).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodTemplate {
    /// Dataplane container image.
    #[schemars(length(min = 1))]
    pub image: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Node and pod (anti-)affinity of the pods, as in a pod spec. A group's members can be
    /// kept on one topology domain with `podAffinity` whose term selects the role it follows
    /// (`tandem.dev/role: prefill`) and sets `matchLabelKeys: [tandem.dev/group,
    /// tandem.dev/deployment]`: each pod then matches only its own group's pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// How the pods spread over topology domains (zones, nodes), as in a pod spec.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,
    /// PriorityClass of the pods (the API server resolves it to `spec.priority`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// Scheduler (profile) that places the pods; the cluster's default scheduler if unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler_name: Option<String>,
    /// Environment of the dataplane container; names must be unique.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub env: Vec<EnvVar>,
    /// Extra labels for the pods (the operator's own labels win on conflict).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
    /// Mount a service-account token into the pods (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub automount_service_account_token: Option<bool>,
    /// Pod-level security context. Fields left unset take the restricted defaults
    /// (runAsNonRoot true, runAsUser and runAsGroup 65532, seccompProfile RuntimeDefault);
    /// to run as root, set both runAsNonRoot false and runAsUser 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub security_context: Option<PodSecurityContext>,
    /// Security context of the dataplane container. Fields left unset take the restricted
    /// defaults (allowPrivilegeEscalation false, capabilities.drop [ALL],
    /// readOnlyRootFilesystem true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_security_context: Option<SecurityContext>,
}

/// Ports and timeouts of the KV transfer channel.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self.httpPort != self.kvPort",
    "message": "transfer.httpPort and transfer.kvPort must differ: the prefill listens on both"
}]))]
pub struct TransferSpec {
    /// HTTP port of every dataplane pod (OpenAI API, /health, /ready, /metrics).
    #[serde(default = "default_http_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub http_port: i32,
    /// KV transfer (bootstrap) port of the prefill pods.
    #[serde(default = "default_kv_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub kv_port: i32,
    /// Longest a handshake may take before the peer is counted as unreachable.
    #[serde(default = "default_bootstrap_timeout")]
    #[schemars(range(min = 1))]
    pub bootstrap_timeout_seconds: i32,
    /// Longest a room may go without progress (waiting for or receiving KV).
    #[serde(default = "default_kv_timeout")]
    #[schemars(range(min = 1))]
    pub kv_timeout_seconds: i32,
    /// Longest the decode lets a prefill leave a PING unanswered before its rooms there
    /// fail `peer_unresponsive` and new requests are refused, until a new handshake: how
    /// fast requests stop waiting on a hung prefill, independent of the probe period. A
    /// prefill answers from its socket loop, so a busy one still answers; raise it only for
    /// a prefill starved of CPU for longer than this (a tiny CPU limit).
    #[serde(default = "default_channel_deadline")]
    #[schemars(range(min = 50, max = 3600000))]
    pub channel_deadline_milliseconds: i32,
}

fn default_http_port() -> i32 {
    8000
}
fn default_kv_port() -> i32 {
    5600
}
fn default_bootstrap_timeout() -> i32 {
    10
}
fn default_kv_timeout() -> i32 {
    10
}
fn default_channel_deadline() -> i32 {
    1000
}

impl Default for TransferSpec {
    fn default() -> Self {
        Self {
            http_port: default_http_port(),
            kv_port: default_kv_port(),
            bootstrap_timeout_seconds: default_bootstrap_timeout(),
            kv_timeout_seconds: default_kv_timeout(),
            channel_deadline_milliseconds: default_channel_deadline(),
        }
    }
}

/// How the channel is probed and how long a broken group is tolerated.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HealthSpec {
    /// Period of the PING/PONG channel probe and of the pods' readiness probes.
    #[serde(default = "default_probe_period")]
    #[schemars(range(min = 1))]
    pub probe_period_seconds: i32,
    /// Consecutive failed probes before a pod reports not-ready.
    #[serde(default = "default_failure_threshold")]
    #[schemars(range(min = 1))]
    pub failure_threshold: i32,
    /// A member with queued or running work whose engine steps nothing successfully, or
    /// whose KV bytes in flight do not move, for this long reports not-ready with reason
    /// `no_progress` (an idle member stays ready); 0 turns the check off. The default is
    /// above the dataplane's 10 s engine-stall limit, which already covers one slow step.
    #[serde(default = "default_no_progress")]
    #[schemars(range(min = 0, max = 86400))]
    pub no_progress_seconds: i32,
    /// How long a member that was Ready may stay not-ready before its group is co-restarted,
    /// counted from its first failed probe: its readiness turns false (failureThreshold − 1)
    /// probe periods after that, so the probes' tuning does not add to the window.
    #[serde(default = "default_co_restart_after")]
    #[schemars(range(min = 1))]
    pub co_restart_after_seconds: i32,
    /// How long a pod may take from start to serving `/health` (loading the model)
    /// before the kubelet kills it; the startup probe holds off the liveness probe
    /// until then.
    #[serde(default = "default_startup_timeout")]
    #[schemars(range(min = 1, max = 86400))]
    pub startup_timeout_seconds: i32,
    /// Grace period of a member removed because it is hung or failed (not ready, exited,
    /// or on a node that stopped reporting): it is deleted with this grace instead of its
    /// pod's own, since a stopped or wedged process cannot act on SIGTERM and would hold
    /// its group's co-restart for the whole grace period. Members removed by a rollout, a
    /// scale-down or a restart request, and a failed group's healthy members, keep their
    /// full grace and drain. At least 1: a grace of 0 removes the pod from the API before
    /// its kubelet has stopped the container, which may then still hold its node's GPU
    /// while the next incarnation starts. At most 30, the pods' own grace period. Not part
    /// of the revision: changing it rolls no group.
    #[serde(default = "default_unresponsive_grace")]
    #[schemars(range(min = 1, max = 30))]
    pub unresponsive_grace_seconds: i32,
}

fn default_probe_period() -> i32 {
    2
}
fn default_failure_threshold() -> i32 {
    3
}
fn default_no_progress() -> i32 {
    30
}
fn default_co_restart_after() -> i32 {
    30
}
fn default_startup_timeout() -> i32 {
    600
}
/// The default of `health.unresponsiveGraceSeconds`.
pub const DEFAULT_UNRESPONSIVE_GRACE_SECONDS: i32 = 1;
fn default_unresponsive_grace() -> i32 {
    DEFAULT_UNRESPONSIVE_GRACE_SECONDS
}

impl Default for HealthSpec {
    fn default() -> Self {
        Self {
            probe_period_seconds: default_probe_period(),
            failure_threshold: default_failure_threshold(),
            no_progress_seconds: default_no_progress(),
            co_restart_after_seconds: default_co_restart_after(),
            startup_timeout_seconds: default_startup_timeout(),
            unresponsive_grace_seconds: default_unresponsive_grace(),
        }
    }
}

/// What the operator does with a broken group.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum RestartPolicy {
    /// Delete the whole group (decode first, then prefill) and rebuild it, prefill first.
    #[default]
    CoRestartGroup,
    /// Never delete a pod; only report what would have been done.
    None,
}

#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RestartSpec {
    #[serde(default)]
    pub policy: RestartPolicy,
    #[serde(default)]
    pub backoff: BackoffSpec,
    /// How long an in-place co-restart may take before the operator falls back to deleting
    /// the group's pods (docs/in-place-reset.md). When both members are alive and the fault
    /// is the channel or the session (a decode not ready for a channel reason while its
    /// prefills are ready), the members reset to the next incarnation without exiting,
    /// prefill first, and keep their weights; a member that crashed, hangs or was deleted
    /// is always replaced. 0: never in place, every co-restart deletes and recreates the
    /// pods. Not part of the revision.
    #[serde(default = "default_in_place_reset")]
    #[schemars(range(min = 0, max = 300))]
    pub in_place_reset_seconds: i32,
}

/// Default of `restart.inPlaceResetSeconds`: a reset takes well under a second when it
/// works; a member that has not answered in 10 s is better replaced.
pub const DEFAULT_IN_PLACE_RESET_SECONDS: i32 = 10;

fn default_in_place_reset() -> i32 {
    DEFAULT_IN_PLACE_RESET_SECONDS
}

impl Default for RestartSpec {
    fn default() -> Self {
        Self {
            policy: RestartPolicy::default(),
            backoff: BackoffSpec::default(),
            in_place_reset_seconds: default_in_place_reset(),
        }
    }
}

/// Exponential backoff between failure co-restarts of the same group: base × 2^(n-1),
/// capped. It holds a group that fails again before it is Ready at its new incarnation (a
/// crash loop), and one that has failed twice in a row after serving without staying Ready
/// for maxSeconds; a group that came back Ready and fails once more is repaired at once.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackoffSpec {
    #[serde(default = "default_backoff_base")]
    #[schemars(range(min = 1))]
    pub base_seconds: i32,
    #[serde(default = "default_backoff_max")]
    #[schemars(range(min = 1))]
    pub max_seconds: i32,
}

fn default_backoff_base() -> i32 {
    10
}
fn default_backoff_max() -> i32 {
    300
}

impl Default for BackoffSpec {
    fn default() -> Self {
        Self {
            base_seconds: default_backoff_base(),
            max_seconds: default_backoff_max(),
        }
    }
}

/// Rolling update of groups to a new revision.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutSpec {
    /// Most groups that may be down at once on the rollout's account.
    #[serde(default = "default_max_unavailable")]
    #[schemars(range(min = 1))]
    pub max_unavailable_groups: i32,
    /// Groups with an index below this stay on their revision.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub partition: i32,
    /// Stop starting new group updates.
    #[serde(default)]
    pub paused: bool,
    /// Seconds a rebuilt group must have been Ready before it counts as available and the
    /// rollout takes down the next one (as a Deployment's `minReadySeconds`). The endpoint
    /// controller lists a group's decode in the client Service a moment after it turns
    /// Ready; a few seconds here keep the Service from dipping below `groups -
    /// maxUnavailableGroups` in that moment. 0: at once.
    #[serde(default)]
    #[schemars(range(min = 0, max = 3600))]
    pub min_ready_seconds: i32,
}

fn default_max_unavailable() -> i32 {
    1
}

impl Default for RolloutSpec {
    fn default() -> Self {
        Self {
            max_unavailable_groups: default_max_unavailable(),
            partition: 0,
            paused: false,
            min_ready_seconds: 0,
        }
    }
}

/// The part of the spec that shapes pods. Its hash is the revision: a change here
/// rolls groups; a change elsewhere (groups, restart, rollout) does not.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RevisionedSpec {
    pub model: ModelSpec,
    pub prefill: RoleSpec,
    pub decode: RoleSpec,
    pub transfer: TransferSpec,
    pub health: HealthSpec,
}

impl RevisionedSpec {
    pub fn from_spec(spec: &PDDeploymentSpec) -> Self {
        Self {
            model: spec.model.clone(),
            prefill: spec.prefill.clone(),
            decode: spec.decode.clone(),
            transfer: spec.transfer.clone(),
            health: spec.health.clone(),
        }
    }

    /// Short stable hash of the pod-shaping spec (serde_json keeps struct field order,
    /// and maps are BTreeMaps, so the encoding is canonical). `health` is hashed without
    /// `unresponsiveGraceSeconds`, which only the operator reads when it deletes a pod:
    /// changing it must not roll a group, and adding it left every revision as it was.
    pub fn revision(&self) -> String {
        let h = &self.health;
        let hashed = Hashed {
            model: &self.model,
            prefill: &self.prefill,
            decode: &self.decode,
            transfer: &self.transfer,
            health: HashedHealth {
                probe_period_seconds: h.probe_period_seconds,
                failure_threshold: h.failure_threshold,
                no_progress_seconds: h.no_progress_seconds,
                co_restart_after_seconds: h.co_restart_after_seconds,
                startup_timeout_seconds: h.startup_timeout_seconds,
            },
        };
        let json = serde_json::to_vec(&hashed).expect("spec types always serialize");
        let digest = Sha256::digest(&json);
        hex::encode(&digest[..5])
    }
}

/// What [`RevisionedSpec::revision`] hashes: the spec's fields, in its order.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Hashed<'a> {
    model: &'a ModelSpec,
    prefill: &'a RoleSpec,
    decode: &'a RoleSpec,
    transfer: &'a TransferSpec,
    health: HashedHealth,
}

/// The fields of [`HealthSpec`] that shape pods or the group's triggers, in its order.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct HashedHealth {
    probe_period_seconds: i32,
    failure_threshold: i32,
    /// The dataplane's `--no-progress-seconds`: a pod setting, so part of the revision.
    no_progress_seconds: i32,
    co_restart_after_seconds: i32,
    startup_timeout_seconds: i32,
}

/// The CEL rule on `metadata.name`: every child name derives from it (see
/// [`crate::names::validate_deployment_name`], which says the same to the operator).
pub const NAME_RULE: &str =
    "self.metadata.name.size() <= 48 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')";

/// The CRD: the derived one plus the rule on `metadata.name`, which only the root schema
/// can state.
pub fn crd()
-> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    use kube::CustomResourceExt;
    let mut crd = PDDeployment::crd();
    for v in &mut crd.spec.versions {
        if let Some(schema) = v
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        {
            let rule = serde_json::json!({
                "rule": NAME_RULE,
                "message": format!(
                    "metadata.name must be a DNS-1035 label (lower-case letters, digits and '-', starting with a letter, no dots) of at most {} characters, so that `<name>-g<group>-bootstrap` stays a valid Service name",
                    crate::names::MAX_DEPLOYMENT_NAME
                ),
            });
            schema.x_kubernetes_validations = Some(vec![
                serde_json::from_value(rule).expect("a validation rule"),
            ]);
        }
    }
    without_pod_spec_descriptions(crd)
}

/// Template fields whose schema is Kubernetes' own pod spec type, documented there.
const POD_SPEC_FIELDS: [&str; 2] = ["affinity", "topologySpreadConstraints"];

/// The CRD with the descriptions inside [`POD_SPEC_FIELDS`] removed wherever a template
/// appears (the spec's roles and the revisions the status keeps); each field keeps its
/// own. Kubernetes' texts for node/pod affinity and topology spread would more than double
/// the CRD, past what `kubectl apply` without `--server-side` can store in its
/// last-applied annotation (256 kB). The schema itself, and so the API server's
/// validation, is unchanged.
fn without_pod_spec_descriptions(
    crd: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
) -> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    use serde_json::Value;
    fn strip(v: &mut Value) {
        match v {
            Value::Object(m) => {
                m.remove("description");
                m.values_mut().for_each(strip);
            }
            Value::Array(a) => a.iter_mut().for_each(strip),
            _ => {}
        }
    }
    fn visit(v: &mut Value) {
        match v {
            Value::Object(m) => {
                if let Some(Value::Object(props)) = m.get_mut("properties") {
                    for field in POD_SPEC_FIELDS {
                        if let Some(Value::Object(f)) = props.get_mut(field) {
                            f.iter_mut()
                                .filter(|(k, _)| *k != "description")
                                .for_each(|(_, sub)| strip(sub));
                        }
                    }
                }
                m.values_mut().for_each(visit);
            }
            Value::Array(a) => a.iter_mut().for_each(visit),
            _ => {}
        }
    }
    let mut v = serde_json::to_value(&crd).expect("a CRD serializes");
    visit(&mut v["spec"]["versions"]);
    serde_json::from_value(v).expect("the CRD still deserializes")
}

/// The CRD as YAML, exactly as committed in `crds/pddeployment.yaml`.
pub fn crd_yaml() -> Result<String, serde_yaml::Error> {
    let body = serde_yaml::to_string(&crd())?;
    Ok(format!(
        "# Generated by `cargo run -p tandem-operator --bin crdgen`; do not edit.\n---\n{body}"
    ))
}

/// Condition types: those of the PDDeployment's status, and the decode pods' gate.
pub mod conditions {
    pub const AVAILABLE: &str = "Available";
    pub const PROGRESSING: &str = "Progressing";
    pub const DEGRADED: &str = "Degraded";
    pub const BOOTSTRAP_HEALTHY: &str = "BootstrapHealthy";
    /// Pod readiness gate the operator sets True only while the whole group is Ready.
    pub const GROUP_READY: &str = "tandem.dev/group-ready";
}

/// Labels the operator puts on what it owns.
pub mod labels {
    pub const DEPLOYMENT: &str = "tandem.dev/deployment";
    pub const GROUP: &str = "tandem.dev/group";
    pub const ROLE: &str = "tandem.dev/role";
    pub const REVISION: &str = "tandem.dev/revision";
    pub const INCARNATION: &str = "tandem.dev/incarnation";
    /// Annotation: when the pod last reset in place (its `tandem.dev/incarnation` label and
    /// annotation then name the incarnation it serves; its name keeps the one it was
    /// created at).
    pub const RESET_AT: &str = "tandem.dev/reset-at";
    pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
    /// On Services and NetworkPolicies: the `<httpPort>-<kvPort>` they were built for,
    /// so a port change in the spec re-applies them.
    pub const PORTS: &str = "tandem.dev/ports";
    /// Value of [`MANAGED_BY`], and the field manager of every server-side apply.
    pub const MANAGER: &str = "tandem-operator";
}

/// Annotations users put on a PDDeployment.
pub mod annotations {
    /// An RFC 3339 time; a group whose last co-restart is older than it is co-restarted
    /// (one group at a time, like a rollout).
    pub const RESTART_REQUESTED_AT: &str = "tandem.dev/restart-requested-at";
}

pub mod args_rules;
mod router;
mod status;

pub use router::{RouterServiceType, RouterSpec};
pub use status::*;

#[cfg(test)]
mod tests;
