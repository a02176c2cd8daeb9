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

/// Longest name Kubernetes accepts for a Service (a DNS-1035 label) and for a label value.
pub const MAX_LABEL: usize = 63;

/// Check that every name derived from `deployment` is valid on a cluster for `groups`
/// groups: the name itself is the client Service's name and a label value (a DNS-1035
/// label: lowercase letters, digits and '-', starting with a letter, ending with a letter
/// or digit, at most 63 characters), and `<name>-g<group>-bootstrap`, the longest group
/// object name, must fit in 63 characters too. The error names the rule that failed.
pub fn validate_deployment_name(deployment: &str, groups: i32) -> Result<(), String> {
    let bad = |why: String| Err(format!("metadata.name {deployment:?}: {why}"));
    if deployment.is_empty() {
        return bad("must not be empty".into());
    }
    if let Some(c) = deployment
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
    {
        return bad(format!(
            "{c:?} is not allowed: the name becomes a Service name and a label value \
             (DNS-1035 label: lowercase letters, digits and '-')"
        ));
    }
    if !deployment.starts_with(|c: char| c.is_ascii_lowercase()) {
        return bad("must start with a lowercase letter (DNS-1035 label)".into());
    }
    if deployment.ends_with('-') {
        return bad("must end with a letter or a digit (DNS-1035 label)".into());
    }
    let longest = group_service_name(deployment, groups.max(1) - 1);
    if longest.len() > MAX_LABEL {
        let room = MAX_LABEL - (longest.len() - deployment.len());
        return bad(format!(
            "is {} characters; with {} group(s) the Service name {longest:?} would be {} \
             characters (at most {MAX_LABEL}), so the name may have at most {room}",
            deployment.len(),
            groups.max(1),
            longest.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_names_pass() {
        validate_deployment_name("smollm2", 1).unwrap();
        validate_deployment_name("a", 100).unwrap();
        // 63 - len("-g9-bootstrap") = 50
        validate_deployment_name(&"a".repeat(50), 10).unwrap();
    }

    #[test]
    fn names_a_cluster_would_reject_are_refused_with_the_reason() {
        let e = validate_deployment_name("llama-3.1-8b", 1).unwrap_err();
        assert!(e.contains("'.' is not allowed"), "{e}");
        let e = validate_deployment_name("Demo", 1).unwrap_err();
        assert!(e.contains("'D' is not allowed"), "{e}");
        let e = validate_deployment_name("8b", 1).unwrap_err();
        assert!(e.contains("start with a lowercase letter"), "{e}");
        let e = validate_deployment_name("demo-", 1).unwrap_err();
        assert!(e.contains("end with a letter or a digit"), "{e}");
        let e = validate_deployment_name("", 1).unwrap_err();
        assert!(e.contains("empty"), "{e}");
        let long = "a".repeat(60);
        let e = validate_deployment_name(&long, 1).unwrap_err();
        assert!(e.contains("at most 50"), "{e}");
        // The group count is part of the longest name.
        validate_deployment_name(&"a".repeat(50), 10).unwrap();
        let e = validate_deployment_name(&"a".repeat(50), 11).unwrap_err();
        assert!(e.contains("at most 49"), "{e}");
    }
}
