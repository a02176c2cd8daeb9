//! `spec.router`: a router the operator runs on a cluster for the deployment
//! (docs/routing.md, "On a cluster"). Not part of the pod revision: turning it on, off or
//! changing it never rolls a group.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A Deployment of `tandem-operator router` and its Service `<name>-router`: requests go
/// to the decodes of groups Ready at their current incarnation, by prefix affinity and
/// load, with one retry before the first byte.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RouterSpec {
    /// Router pods (each reads the same decode reports, so any number route alike).
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 1, max = 64))]
    pub replicas: i32,
    /// Type of the Service `<name>-router`.
    #[serde(default)]
    pub service_type: RouterServiceType,
    /// Port of the router's Service and container (OpenAI API, /health, /ready, /metrics).
    #[serde(default = "default_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// A Secret in the deployment's namespace whose every value is an accepted API key
    /// (`Authorization: Bearer <key>` on `/v1/*`); unset: no key needed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub api_key_secret: Option<String>,
}

/// Service type of the router's Service.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum RouterServiceType {
    #[default]
    ClusterIP,
    NodePort,
    LoadBalancer,
}

impl RouterServiceType {
    pub fn as_str(&self) -> &'static str {
        match self {
            RouterServiceType::ClusterIP => "ClusterIP",
            RouterServiceType::NodePort => "NodePort",
            RouterServiceType::LoadBalancer => "LoadBalancer",
        }
    }
}

fn default_replicas() -> i32 {
    1
}

fn default_port() -> i32 {
    8000
}

impl Default for RouterSpec {
    fn default() -> Self {
        Self {
            replicas: default_replicas(),
            service_type: RouterServiceType::default(),
            port: default_port(),
            api_key_secret: None,
        }
    }
}
