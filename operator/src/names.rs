//! Names of the objects a `PDDeployment` owns, all derived from the deployment's name.
//! One place, so the planner, the controller, the local runtime and the CRD's name
//! validation agree on every suffix.

use crate::planner::Role;

/// Deterministic pod name: deployment, group, incarnation, role, index. The incarnation
/// in the name keeps a rebuilt pod from colliding with its terminating predecessor.
pub fn pod_name(deployment: &str, group: i32, incarnation: i64, role: Role, index: i32) -> String {
    let r = match role {
        Role::Prefill => 'p',
        Role::Decode => 'd',
    };
    format!("{deployment}-g{group}-i{incarnation}-{r}{index}")
}

/// Name of a group's headless bootstrap Service (selects its prefill pods).
pub fn group_service_name(deployment: &str, group: i32) -> String {
    format!("{deployment}-g{group}-bootstrap")
}

/// Name of a group's key Secret.
pub fn group_secret_name(deployment: &str, group: i32) -> String {
    format!("{deployment}-g{group}-key")
}

/// Name of a group's NetworkPolicy.
pub fn network_policy_name(deployment: &str, group: i32) -> String {
    format!("{deployment}-g{group}-kv")
}

/// Hostname of the prefill pod with replica index `index` (its DNS name is
/// `<hostname>.<group service>.<namespace>.svc`).
pub fn prefill_hostname(index: i32) -> String {
    format!("prefill-{index}")
}
