//! Names of the objects a `PDDeployment` owns, all derived from the deployment's name.
//! One place, so the planner, the controller, the local runtime and the CRD's name
//! validation agree on every suffix.

use crate::role::Role;

/// Deterministic pod name: deployment, group, incarnation, role, index. The incarnation
/// in the name keeps a rebuilt pod from colliding with its terminating predecessor.
pub fn pod_name(deployment: &str, group: i32, incarnation: i64, role: Role, index: i32) -> String {
    let r = match role {
        Role::Prefill => 'p',
        Role::Decode => 'd',
    };
    format!("{deployment}-g{group}-i{incarnation}-{r}{index}")
}

/// The replica index at the end of a member's name ([`pod_name`]: `…-p0`, `…-d12`).
pub fn member_index(pod: &str, role: Role) -> Option<i32> {
    let r = match role {
        Role::Prefill => 'p',
        Role::Decode => 'd',
    };
    let (_, last) = pod.rsplit_once('-')?;
    let digits = last.strip_prefix(r)?;
    let i: i32 = digits.parse().ok()?;
    // Canonical spelling only ("d01", "d+1" are not ours).
    (i >= 0 && i.to_string() == digits).then_some(i)
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

/// Name of the router's Deployment, Service, ServiceAccount, Role and RoleBinding
/// (`spec.router`; `<name>-router` fits whenever `<name>` does).
pub fn router_name(deployment: &str) -> String {
    format!("{deployment}-router")
}

/// Hostname of the prefill pod with replica index `index` (its DNS name is
/// `<hostname>.<group service>.<namespace>.svc`).
pub fn prefill_hostname(index: i32) -> String {
    format!("prefill-{index}")
}

/// Longest name Kubernetes accepts for a Service (a DNS-1035 label) and for a label value.
pub const MAX_LABEL: usize = 63;

/// Most groups a deployment may have (the CRD's bound), so that the longest group suffix
/// is known.
pub const MAX_GROUPS: i32 = 999;

/// The longest child-name suffix, `-g<MAX_GROUPS - 1>-bootstrap`.
fn longest_suffix() -> usize {
    group_service_name("", MAX_GROUPS - 1).len()
}

/// Longest deployment name whose every child name is valid: the bootstrap Service of its
/// last possible group must stay a DNS-1035 label (at most 63 characters). The CRD's CEL
/// rule says the same, so a name is refused the same way at any group count.
pub const MAX_DEPLOYMENT_NAME: usize = 48;

/// Why `deployment` cannot be a PDDeployment's name: it is the client Service's name, a
/// label value and the pods' subdomain (a DNS-1035 label: lowercase letters, digits and
/// '-', starting with a letter, ending with a letter or digit), and
/// `<name>-g<group>-bootstrap` must fit in 63 characters for every group the CRD allows.
/// The error names the rule that failed. The CRD's CEL rule says the same to the API
/// server; this catches objects created before the rule existed and local manifests.
pub fn validate_deployment_name(deployment: &str) -> Result<(), String> {
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
    if deployment.len() + longest_suffix() > MAX_LABEL {
        return bad(format!(
            "is {} characters; at most {MAX_DEPLOYMENT_NAME} fit, so that `<name>{}` stays a \
             {MAX_LABEL}-character Service name",
            deployment.len(),
            group_service_name("", MAX_GROUPS - 1)
        ));
    }
    Ok(())
}

/// The group index in `name` if it is `<deployment>-g<group><suffix>` (e.g. `-bootstrap`).
pub fn group_of(deployment: &str, name: &str, suffix: &str) -> Option<i32> {
    let digits = name
        .strip_prefix(deployment)?
        .strip_prefix("-g")?
        .strip_suffix(suffix)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let g: i32 = digits.parse().ok()?;
    // Canonical spelling only ("g01" is not ours).
    (g.to_string() == digits).then_some(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_index_is_read_back_from_its_name() {
        for (role, i) in [(Role::Prefill, 0), (Role::Decode, 3), (Role::Decode, 12)] {
            let name = pod_name("llm-d1", 2, 7, role, i);
            assert_eq!(member_index(&name, role), Some(i), "{name}");
        }
        let other = pod_name("x", 0, 1, Role::Prefill, 0);
        assert_eq!(member_index(&other, Role::Decode), None);
        for bad in [
            "x-g0-i1-d",
            "x-g0-i1-d01",
            "x-g0-i1-d+1",
            "x-g0-i1-dx",
            "d1",
        ] {
            assert_eq!(member_index(bad, Role::Decode), None, "{bad}");
        }
    }

    #[test]
    fn the_longest_name_leaves_room_for_the_longest_suffix() {
        assert_eq!(MAX_DEPLOYMENT_NAME + longest_suffix(), MAX_LABEL);
        let name = "a".repeat(MAX_DEPLOYMENT_NAME);
        assert!(validate_deployment_name(&name).is_ok());
        assert_eq!(group_service_name(&name, MAX_GROUPS - 1).len(), MAX_LABEL);
        let e = validate_deployment_name(&"a".repeat(MAX_DEPLOYMENT_NAME + 1)).unwrap_err();
        assert!(e.contains("at most 48"), "{e}");
    }

    #[test]
    fn names_a_cluster_would_reject_are_refused_with_the_reason() {
        let e = validate_deployment_name("llama-3.1-8b").unwrap_err();
        assert!(e.contains("'.' is not allowed"), "{e}");
        let e = validate_deployment_name("Demo").unwrap_err();
        assert!(e.contains("'D' is not allowed"), "{e}");
        let e = validate_deployment_name("de_mo").unwrap_err();
        assert!(e.contains("'_' is not allowed"), "{e}");
        let e = validate_deployment_name("8b").unwrap_err();
        assert!(e.contains("start with a lowercase letter"), "{e}");
        let e = validate_deployment_name("demo-").unwrap_err();
        assert!(e.contains("end with a letter or a digit"), "{e}");
        let e = validate_deployment_name("").unwrap_err();
        assert!(e.contains("empty"), "{e}");
        validate_deployment_name("llama-3-1-8b").unwrap();
    }

    #[test]
    fn group_indexes_are_read_back_from_child_names() {
        assert_eq!(
            group_of("demo", "demo-g12-bootstrap", "-bootstrap"),
            Some(12)
        );
        assert_eq!(group_of("demo", "demo-g1-kv", "-kv"), Some(1));
        assert_eq!(group_of("demo", "demo-g01-kv", "-kv"), None);
        assert_eq!(group_of("demo", "demo-x-g1-kv", "-kv"), None);
        assert_eq!(group_of("demo", "demo-g-kv", "-kv"), None);
        assert_eq!(group_of("demo", "other-g1-kv", "-kv"), None);
    }
}
