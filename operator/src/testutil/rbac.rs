//! The permissions the install grants, read from the committed `manifests/install.yaml`
//! (the Helm chart rendered with its defaults), and a check that one API request is
//! allowed by them, decided the way the API server's RBAC authorizer decides it.
//!
//! The controller's and the leader elector's mock-API tests pass every request they
//! receive through [`assert_allowed`], so a new API call without its permission fails a
//! unit test rather than a cluster.

use std::sync::OnceLock;

use http::Method;
use serde::Deserialize;
use serde_json::Value;

/// One RBAC policy rule.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Rule {
    pub api_groups: Vec<String>,
    pub resources: Vec<String>,
    pub verbs: Vec<String>,
    #[serde(default)]
    pub resource_names: Option<Vec<String>>,
}

/// What one request asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct Attributes {
    pub group: String,
    /// `pods`, or `pods/status` for a subresource.
    pub resource: String,
    pub name: Option<String>,
    pub verb: &'static str,
}

impl Rule {
    fn allows(&self, a: &Attributes) -> bool {
        let has = |list: &[String], v: &str| list.iter().any(|x| x == v || x == "*");
        has(&self.api_groups, &a.group)
            && has(&self.resources, &a.resource)
            && has(&self.verbs, a.verb)
            && match &self.resource_names {
                None => true,
                Some(names) if names.is_empty() => true,
                Some(names) => a.name.as_ref().is_some_and(|n| names.contains(n)),
            }
    }
}

/// The controller's rules (the ClusterRole `tandem-operator`) followed by the leader
/// election Role's.
pub fn installed_rules() -> &'static [Rule] {
    static RULES: OnceLock<Vec<Rule>> = OnceLock::new();
    RULES.get_or_init(|| {
        let text = include_str!("../../../manifests/install.yaml");
        let mut rules = Vec::new();
        for doc in serde_yaml::Deserializer::from_str(text) {
            let v = Value::deserialize(doc).expect("manifests/install.yaml parses");
            let name = v["metadata"]["name"].as_str().unwrap_or_default();
            let wanted = matches!(
                (v["kind"].as_str(), name),
                (Some("ClusterRole"), "tandem-operator")
                    | (Some("Role"), "tandem-operator-leader-election")
            );
            if wanted {
                rules.extend(
                    serde_json::from_value::<Vec<Rule>>(v["rules"].clone())
                        .expect("RBAC rules parse"),
                );
            }
        }
        assert!(
            !rules.is_empty(),
            "no operator RBAC in manifests/install.yaml"
        );
        rules
    })
}

/// The attributes of a request to `uri` (path and query).
pub fn attributes(method: &Method, uri: &str) -> Attributes {
    let (path, query) = uri.split_once('?').unwrap_or((uri, ""));
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match segs.as_slice() {
        ["api", _version, rest @ ..] => (String::new(), rest),
        ["apis", group, _version, rest @ ..] => (group.to_string(), rest),
        _ => panic!("not a resource path: {uri}"),
    };
    let rest = match rest {
        ["namespaces", _ns, rest @ ..] if !rest.is_empty() => rest,
        r => r,
    };
    let (resource, name) = match rest {
        [res] => (res.to_string(), None),
        [res, name] => (res.to_string(), Some(name.to_string())),
        [res, name, sub] => (format!("{res}/{sub}"), Some(name.to_string())),
        _ => panic!("not a resource path: {uri}"),
    };
    let watch = query.split('&').any(|kv| kv == "watch=true");
    let verb = match (method.as_str(), name.is_some()) {
        ("GET", true) => "get",
        ("GET", false) if watch => "watch",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        (m, _) => panic!("unexpected method {m} for {uri}"),
    };
    Attributes {
        group,
        resource,
        name,
        verb,
    }
}

/// Everything the API server authorizes for one request: the request itself; `create`
/// too for a server-side apply of a whole object (it creates the object when missing);
/// and `update` of the owner's `finalizers` for an object that sets
/// `blockOwnerDeletion` (the OwnerReferencesPermissionEnforcement admission plugin).
pub fn required(
    method: &Method,
    uri: &str,
    content_type: Option<&str>,
    body: &Value,
) -> Vec<Attributes> {
    let a = attributes(method, uri);
    let mut out = vec![a.clone()];
    let apply = content_type.is_some_and(|c| c.starts_with("application/apply-patch"));
    if a.verb == "patch" && apply && !a.resource.contains('/') {
        out.push(Attributes {
            verb: "create",
            ..a.clone()
        });
    }
    for owner in body["metadata"]["ownerReferences"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if owner["blockOwnerDeletion"] != Value::Bool(true) {
            continue;
        }
        let group = owner["apiVersion"]
            .as_str()
            .and_then(|v| v.split_once('/'))
            .map(|(g, _)| g.to_string())
            .unwrap_or_default();
        let plural = match owner["kind"].as_str() {
            Some("PDDeployment") => "pddeployments",
            other => panic!("owner kind {other:?}: add its plural here"),
        };
        out.push(Attributes {
            group,
            resource: format!("{plural}/finalizers"),
            name: owner["name"].as_str().map(String::from),
            verb: "update",
        });
    }
    out
}

/// Panic unless the installed RBAC allows the request (every attribute it needs).
pub fn assert_allowed(method: &Method, uri: &str, content_type: Option<&str>, body: &Value) {
    for a in required(method, uri, content_type, body) {
        assert!(
            installed_rules().iter().any(|r| r.allows(&a)),
            "{method} {uri} needs {a:?}, which manifests/install.yaml (charts/tandem) does not grant"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requests_map_to_rbac_attributes() {
        let a = attributes(
            &Method::PATCH,
            "/api/v1/namespaces/default/pods/demo-g0-i1-d0/status?",
        );
        assert_eq!(
            (a.group.as_str(), a.resource.as_str(), a.verb),
            ("", "pods/status", "patch")
        );
        let a = attributes(
            &Method::GET,
            "/apis/networking.k8s.io/v1/namespaces/x/networkpolicies?&labelSelector=a%3Db",
        );
        assert_eq!((a.group.as_str(), a.verb), ("networking.k8s.io", "list"));
        let a = attributes(
            &Method::GET,
            "/apis/tandem.dev/v1alpha1/pddeployments?watch=true",
        );
        assert_eq!((a.resource.as_str(), a.verb), ("pddeployments", "watch"));
        let body = json!({"metadata": {"ownerReferences": [{
            "apiVersion": "tandem.dev/v1alpha1", "kind": "PDDeployment", "name": "demo",
            "blockOwnerDeletion": true}]}});
        let r = required(
            &Method::PATCH,
            "/api/v1/namespaces/default/pods/p?&force=true",
            Some("application/apply-patch+yaml"),
            &body,
        );
        let verbs: Vec<_> = r.iter().map(|a| (a.resource.as_str(), a.verb)).collect();
        assert_eq!(
            verbs,
            [
                ("pods", "patch"),
                ("pods", "create"),
                ("pddeployments/finalizers", "update")
            ]
        );
    }

    #[test]
    fn the_check_refuses_what_the_install_does_not_grant() {
        for (method, uri) in [
            // A group key is read (to sign an in-place reset), never written.
            (
                Method::PATCH,
                "/api/v1/namespaces/default/secrets/demo-g0-key",
            ),
            (Method::PATCH, "/api/v1/nodes/n1"),
            (Method::GET, "/api/v1/namespaces/default/configmaps/demo"),
            (
                Method::PUT,
                "/apis/tandem.dev/v1alpha1/namespaces/d/pddeployments/x",
            ),
            (
                Method::GET,
                "/apis/coordination.k8s.io/v1/namespaces/o/leases/someone-else",
            ),
        ] {
            let needed = required(&method, uri, None, &Value::Null);
            assert!(
                needed
                    .iter()
                    .any(|a| !installed_rules().iter().any(|r| r.allows(a))),
                "{method} {uri} should not be allowed"
            );
        }
    }

    /// The watches `controller::run` starts (the PDDeployments and every owned kind),
    /// which the mock-API tests do not exercise.
    #[test]
    fn the_controllers_watches_are_allowed() {
        for path in [
            "/apis/tandem.dev/v1alpha1/pddeployments",
            "/api/v1/pods",
            "/api/v1/services",
            "/apis/networking.k8s.io/v1/networkpolicies",
            "/api/v1/secrets",
        ] {
            assert_allowed(&Method::GET, path, None, &Value::Null);
            assert_allowed(
                &Method::GET,
                &format!("{path}?watch=true"),
                None,
                &Value::Null,
            );
        }
    }
}
