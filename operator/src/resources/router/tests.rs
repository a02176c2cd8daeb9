use serde_json::{Value, json};

use super::*;
use crate::crd::{RouterServiceType, labels};
use crate::testutil;

fn pdd(router: Option<RouterSpec>) -> PDDeployment {
    let mut spec = testutil::spec(2);
    spec.router = router;
    let mut p = PDDeployment::new("demo", spec);
    p.metadata.namespace = Some("ns1".into());
    p.metadata.uid = Some("uid-1".into());
    p
}

fn assert_owned(meta: &ObjectMeta) {
    let refs = meta.owner_references.as_ref().unwrap();
    assert_eq!(refs.len(), 1);
    assert_eq!(refs[0].uid, "uid-1");
    assert_eq!(refs[0].kind, "PDDeployment");
    assert_eq!(refs[0].controller, Some(true));
    assert_eq!(refs[0].block_owner_deletion, Some(true));
    assert_eq!(meta.name.as_deref(), Some("demo-router"));
    assert_eq!(meta.namespace.as_deref(), Some("ns1"));
    assert_eq!(meta.labels.as_ref().unwrap()[labels::DEPLOYMENT], "demo");
}

#[test]
fn every_router_object_is_owned_and_named_after_the_deployment() {
    let p = pdd(Some(RouterSpec::default()));
    assert_owned(&router_service_account(&p).unwrap().metadata);
    assert_owned(&router_role(&p).unwrap().metadata);
    assert_owned(&router_role_binding(&p).unwrap().metadata);
    assert_owned(&router_deployment(&p, "img:1").unwrap().metadata);
    assert_owned(&router_service(&p).unwrap().metadata);
}

#[test]
fn the_deployment_runs_the_router_subcommand_restricted() {
    let p = pdd(Some(RouterSpec {
        replicas: 3,
        port: 9000,
        ..RouterSpec::default()
    }));
    let d = serde_json::to_value(router_deployment(&p, "tandem-operator:1").unwrap()).unwrap();
    let spec = &d["spec"];
    assert_eq!(spec["replicas"], 3);
    let pod_labels =
        json!({"tandem.dev/router": "demo", "app.kubernetes.io/managed-by": "tandem-operator"});
    assert_eq!(spec["selector"]["matchLabels"], pod_labels);
    assert_eq!(spec["template"]["metadata"]["labels"], pod_labels);
    // Never a member's label: the operator's pod list and the client Service skip it.
    assert!(
        spec["template"]["metadata"]["labels"]
            .get(labels::DEPLOYMENT)
            .is_none()
    );
    let pod = &spec["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "demo-router");
    assert_eq!(pod["automountServiceAccountToken"], true);
    assert_eq!(
        pod["securityContext"],
        json!({"runAsNonRoot": true, "runAsUser": 65532, "runAsGroup": 65532,
               "seccompProfile": {"type": "RuntimeDefault"}})
    );
    let c = &pod["containers"][0];
    assert_eq!(c["image"], "tandem-operator:1");
    assert_eq!(
        c["args"],
        json!([
            "router",
            "--namespace",
            "ns1",
            "--deployment",
            "demo",
            "--port",
            "9000"
        ])
    );
    assert_eq!(
        c["ports"],
        json!([{"name": "http", "containerPort": 9000, "protocol": "TCP"}])
    );
    assert_eq!(
        c["securityContext"],
        json!({"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
               "capabilities": {"drop": ["ALL"]}})
    );
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/ready");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/health");
    assert!(pod.get("volumes").is_none());
}

#[test]
fn an_api_key_secret_is_mounted_and_named_to_the_router() {
    let p = pdd(Some(RouterSpec {
        api_key_secret: Some("keys".into()),
        ..RouterSpec::default()
    }));
    let d = serde_json::to_value(router_deployment(&p, "img").unwrap()).unwrap();
    let pod = &d["spec"]["template"]["spec"];
    assert_eq!(
        pod["volumes"],
        json!([{"name": "api-keys", "secret": {"secretName": "keys"}}])
    );
    let c = &pod["containers"][0];
    assert_eq!(
        c["volumeMounts"],
        json!([{"name": "api-keys", "mountPath": API_KEY_DIR, "readOnly": true}])
    );
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(&args[args.len() - 2..], ["--api-key-dir", API_KEY_DIR]);
}

#[test]
fn the_service_has_the_asked_type_and_selects_the_router_pods() {
    for (t, want) in [
        (RouterServiceType::ClusterIP, "ClusterIP"),
        (RouterServiceType::NodePort, "NodePort"),
        (RouterServiceType::LoadBalancer, "LoadBalancer"),
    ] {
        let p = pdd(Some(RouterSpec {
            service_type: t,
            ..RouterSpec::default()
        }));
        let s = serde_json::to_value(router_service(&p).unwrap()).unwrap();
        assert_eq!(s["spec"]["type"], want);
        assert_eq!(s["spec"]["selector"]["tandem.dev/router"], "demo");
        assert_eq!(
            s["spec"]["ports"],
            json!([{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}])
        );
    }
}

#[test]
fn the_role_grants_only_what_the_router_reads() {
    let p = pdd(Some(RouterSpec::default()));
    let r = serde_json::to_value(router_role(&p).unwrap()).unwrap();
    assert_eq!(
        r["rules"],
        json!([
            {"apiGroups": ["tandem.dev"], "resources": ["pddeployments"],
             "resourceNames": ["demo"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
        ])
    );
    let b = serde_json::to_value(router_role_binding(&p).unwrap()).unwrap();
    assert_eq!(
        b["roleRef"],
        json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "demo-router"})
    );
    assert_eq!(
        b["subjects"],
        json!([{"kind": "ServiceAccount", "name": "demo-router", "namespace": "ns1"}])
    );
}

#[test]
fn without_spec_router_nothing_is_built() {
    let p = pdd(None);
    assert!(router_deployment(&p, "img").is_err());
    assert!(router_service(&p).is_err());
    let _: Value = serde_json::to_value(router_role(&p).unwrap()).unwrap();
}
