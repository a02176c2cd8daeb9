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

/// Most groups a deployment may have (the CRD's bound), so that the longest group suffix
/// is known.
pub const MAX_GROUPS: i32 = 999;

/// The longest child-name suffix, `-g<MAX_GROUPS - 1>-bootstrap`.
fn longest_suffix() -> usize {
    group_service_name("", MAX_GROUPS - 1).len()
}

/// Longest deployment name whose every child name is valid: the bootstrap Service of its
/// last group must stay a DNS-1035 label (at most 63 characters). The name itself is a
/// label value and the pods' subdomain, so it obeys the same rule.
pub const MAX_DEPLOYMENT_NAME: usize = 48;

/// Why `name` cannot be a PDDeployment's name (the CRD's CEL rule says the same; this
/// catches objects created before the rule existed).
pub fn validate_deployment_name(name: &str) -> Result<(), String> {
    let ok_chars = name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    let starts = name.bytes().next().is_some_and(|b| b.is_ascii_lowercase());
    let ends = name
        .bytes()
        .last()
        .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if !(ok_chars && starts && ends) {
        return Err(format!(
            "metadata.name {name:?} must be a DNS-1035 label (lower-case letters, digits and '-', starting with a letter and ending with a letter or digit, no dots): it names the Services and labels of every group"
        ));
    }
    if name.len() + longest_suffix() > 63 {
        return Err(format!(
            "metadata.name {name:?} is {} characters; at most {MAX_DEPLOYMENT_NAME} fit, so that `<name>{}` stays a 63-character Service name",
            name.len(),
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
    fn the_longest_name_leaves_room_for_the_longest_suffix() {
        assert_eq!(MAX_DEPLOYMENT_NAME + longest_suffix(), 63);
        let name = "a".repeat(MAX_DEPLOYMENT_NAME);
        assert!(validate_deployment_name(&name).is_ok());
        assert_eq!(group_service_name(&name, MAX_GROUPS - 1).len(), 63);
        let too_long = "a".repeat(MAX_DEPLOYMENT_NAME + 1);
        assert!(
            validate_deployment_name(&too_long)
                .unwrap_err()
                .contains("48")
        );
    }

    #[test]
    fn names_that_cannot_make_child_names_are_refused_with_the_reason() {
        for bad in ["llama-3.1-8b", "Demo", "1st", "demo-", "de_mo", ""] {
            let e = validate_deployment_name(bad).unwrap_err();
            assert!(e.contains("DNS-1035"), "{bad}: {e}");
        }
        assert!(validate_deployment_name("llama-3-1-8b").is_ok());
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
