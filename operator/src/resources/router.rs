//! The router's objects (`spec.router`; docs/routing.md, "On a cluster"): a Deployment of
//! `tandem-operator router` (the operator's own image), its Service `<name>-router`, and a
//! ServiceAccount with a Role that reads only what the router follows — this
//! PDDeployment's status and the namespace's pods.
//!
//! The router's pods carry `tandem.dev/router`, never `tandem.dev/deployment`: the
//! operator's pod list and the client Service select by the latter, and a router pod is
//! no group member.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, PodSpec, PodTemplateSpec, SecretVolumeSource, Service,
    ServiceAccount, ServiceSpec, Volume, VolumeMount,
};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::ResourceExt;

use super::{
    BuildError, HTTP_PORT_NAME, container_security_context, deployment_labels, http_probe, meta,
    namespace, pod_security_context, service_port,
};
use crate::crd::{PDDeployment, PodTemplate, RouterSpec};
use crate::names;

/// Label of the router's pods: the PDDeployment they route for.
pub const ROUTER_LABEL: &str = "tandem.dev/router";
/// Name of the router's container.
pub const ROUTER_CONTAINER: &str = "router";
/// Where the `apiKeySecret`'s keys are mounted (one file per key of the Secret).
pub const API_KEY_DIR: &str = "/etc/tandem/api-keys";

fn spec_of(pdd: &PDDeployment) -> Result<&RouterSpec, BuildError> {
    pdd.spec
        .router
        .as_ref()
        .ok_or(BuildError::Missing("spec.router"))
}

/// Labels of the router's pods (and the Deployment's and Service's selector).
pub fn router_pod_labels(deployment: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (ROUTER_LABEL.to_string(), deployment.to_string()),
        (
            crate::crd::labels::MANAGED_BY.to_string(),
            crate::crd::labels::MANAGER.to_string(),
        ),
    ])
}

fn router_meta(pdd: &PDDeployment) -> Result<ObjectMeta, BuildError> {
    let name = pdd.name_any();
    meta(pdd, names::router_name(&name), deployment_labels(&name))
}

/// The router's ServiceAccount.
pub fn router_service_account(pdd: &PDDeployment) -> Result<ServiceAccount, BuildError> {
    Ok(ServiceAccount {
        metadata: router_meta(pdd)?,
        ..Default::default()
    })
}

/// The router's Role: get/watch of this PDDeployment (its status says which groups are
/// Ready at which incarnation) and list/watch of the namespace's pods (the decodes' IPs,
/// incarnation labels and gates). The operator holds both itself, so it may grant them.
pub fn router_role(pdd: &PDDeployment) -> Result<Role, BuildError> {
    Ok(Role {
        metadata: router_meta(pdd)?,
        rules: Some(vec![
            PolicyRule {
                api_groups: Some(vec![crate::crd::GROUP.into()]),
                resources: Some(vec!["pddeployments".into()]),
                resource_names: Some(vec![pdd.name_any()]),
                verbs: vec!["get".into(), "list".into(), "watch".into()],
                ..Default::default()
            },
            PolicyRule {
                api_groups: Some(vec![String::new()]),
                resources: Some(vec!["pods".into()]),
                verbs: vec!["list".into(), "watch".into()],
                ..Default::default()
            },
        ]),
    })
}

/// Binds [`router_role`] to [`router_service_account`].
pub fn router_role_binding(pdd: &PDDeployment) -> Result<RoleBinding, BuildError> {
    let name = names::router_name(&pdd.name_any());
    Ok(RoleBinding {
        metadata: router_meta(pdd)?,
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "Role".into(),
            name: name.clone(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name,
            namespace: Some(namespace(pdd)?),
            ..Default::default()
        }]),
    })
}

/// The router's Deployment: `spec.router.replicas` pods of `image` running
/// `tandem-operator router`, with the restricted Pod Security profile (non-root, no
/// privilege escalation, no capability, seccomp `RuntimeDefault`, read-only root).
pub fn router_deployment(pdd: &PDDeployment, image: &str) -> Result<Deployment, BuildError> {
    let spec = spec_of(pdd)?;
    let name = pdd.name_any();
    let ns = namespace(pdd)?;
    let labels = router_pod_labels(&name);
    let mut args = vec![
        "router".to_string(),
        "--namespace".into(),
        ns,
        "--deployment".into(),
        name.clone(),
        "--port".into(),
        spec.port.to_string(),
    ];
    let (mut volumes, mut mounts) = (Vec::new(), Vec::new());
    if let Some(secret) = &spec.api_key_secret {
        args.extend(["--api-key-dir".into(), API_KEY_DIR.into()]);
        volumes.push(Volume {
            name: "api-keys".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(secret.clone()),
                ..Default::default()
            }),
            ..Default::default()
        });
        mounts.push(VolumeMount {
            name: "api-keys".into(),
            mount_path: API_KEY_DIR.into(),
            read_only: Some(true),
            ..Default::default()
        });
    }
    // Restricted defaults, as for the dataplane pods (no template to override them).
    let none = PodTemplate::default();
    let container = Container {
        name: ROUTER_CONTAINER.into(),
        image: Some(image.into()),
        args: Some(args),
        ports: Some(vec![ContainerPort {
            name: Some(HTTP_PORT_NAME.into()),
            container_port: spec.port,
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
        readiness_probe: Some(http_probe("/ready", 2, 2, 3)),
        liveness_probe: Some(http_probe("/health", 10, 5, 3)),
        security_context: Some(container_security_context(&none)),
        volume_mounts: (!mounts.is_empty()).then_some(mounts),
        ..Default::default()
    };
    Ok(Deployment {
        metadata: router_meta(pdd)?,
        spec: Some(DeploymentSpec {
            replicas: Some(spec.replicas.max(1)),
            selector: LabelSelector {
                match_labels: Some(labels.clone()),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    service_account_name: Some(names::router_name(&name)),
                    // The router reads the API server with its own token.
                    automount_service_account_token: Some(true),
                    security_context: Some(pod_security_context(&none)),
                    containers: vec![container],
                    volumes: (!volumes.is_empty()).then_some(volumes),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        status: None,
    })
}

/// The router's Service `<name>-router` (`spec.router.serviceType`, port
/// `spec.router.port`).
pub fn router_service(pdd: &PDDeployment) -> Result<Service, BuildError> {
    let spec = spec_of(pdd)?;
    let name = pdd.name_any();
    Ok(Service {
        metadata: router_meta(pdd)?,
        spec: Some(ServiceSpec {
            type_: Some(spec.service_type.as_str().into()),
            selector: Some(router_pod_labels(&name)),
            ports: Some(vec![service_port(HTTP_PORT_NAME, spec.port)]),
            ..Default::default()
        }),
        status: None,
    })
}

#[cfg(test)]
mod tests;
