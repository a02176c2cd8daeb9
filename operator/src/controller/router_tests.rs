//! `spec.router` against the mock API server: the router's objects are applied (RBAC
//! first, then the Deployment and its Service) right after the client Service, every
//! request allowed by the chart's RBAC; removing `spec.router` deletes them.

use std::sync::Arc;
use std::time::Duration;

use http::{Method, StatusCode};
use serde_json::json;

use super::mock_api::*;
use super::*;
use crate::crd::RouterSpec;

const SA: &str = "/api/v1/namespaces/default/serviceaccounts";
const ROLES: &str = "/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles";
const BINDINGS: &str = "/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings";
const DEPLOYMENTS: &str = "/apis/apps/v1/namespaces/default/deployments";

fn routed() -> PDDeployment {
    let mut p = pdd(None);
    p.spec.router = Some(RouterSpec::default());
    p
}

async fn reconcile_with<F>(
    trigger: PDDeployment,
    image: Option<&str>,
    script: impl FnOnce(MockApi) -> F,
) -> Result<Action, Error>
where
    F: Future<Output = ()> + Send + 'static,
{
    let (ctx, api) = context(FakeReady::default());
    let ctx = Arc::new(
        Arc::into_inner(ctx)
            .unwrap()
            .with_router_image(image.map(str::to_string)),
    );
    let server = tokio::spawn(script(api));
    let result = tokio::time::timeout(Duration::from_secs(10), reconcile(Arc::new(trigger), ctx))
        .await
        .expect("reconcile hung");
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("mock server hung")
        .expect("mock server assertions");
    result
}

#[tokio::test]
async fn spec_router_applies_its_rbac_deployment_and_service_after_the_client_service() {
    let p = routed();
    let result = reconcile_with(
        p.clone(),
        Some("tandem-operator:test"),
        |mut api| async move {
            api.reads(&p, &[], true).await;
            api.apply(SERVICES, NAME).await;
            api.apply(SA, "demo-router").await;
            let role = api.apply(ROLES, "demo-router").await;
            assert_eq!(role["rules"][1]["resources"], json!(["pods"]));
            api.apply(BINDINGS, "demo-router").await;
            let d = api.apply(DEPLOYMENTS, "demo-router").await;
            let pod = &d["spec"]["template"]["spec"];
            assert_eq!(pod["containers"][0]["image"], "tandem-operator:test");
            assert_eq!(pod["containers"][0]["args"][0], "router");
            assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
            let svc = api.apply(SERVICES, "demo-router").await;
            assert_eq!(svc["spec"]["type"], "ClusterIP");
            api.apply(SERVICES, "demo-g0-bootstrap").await;
            api.apply(POLICIES, "demo-g0-kv").await;
            api.create_pod("demo-g0-i1-p0").await;
            api.event().await;
            api.status().await;
            api.done().await;
        },
    )
    .await;
    result.unwrap();
}

#[tokio::test]
async fn without_a_router_image_the_reconcile_fails_and_says_so() {
    let p = routed();
    let result = reconcile_with(p.clone(), None, |mut api| async move {
        api.reads(&p, &[], true).await;
        api.apply(SERVICES, NAME).await;
        // Reported as a failed apply: a Warning Event and the Degraded condition.
        let ev = api.event().await;
        assert_eq!(ev["reason"], "ApplyFailed");
        let status = api.status().await;
        let d = status
            .conditions
            .iter()
            .find(|c| c.type_ == crate::crd::conditions::DEGRADED)
            .unwrap();
        assert!(d.message.contains("TANDEM_ROUTER_IMAGE"), "{}", d.message);
        api.done().await;
    })
    .await;
    let e = result.unwrap_err();
    assert!(e.to_string().contains("TANDEM_ROUTER_IMAGE"), "{e}");
}

#[tokio::test]
async fn removing_spec_router_deletes_its_objects_service_last() {
    let p = pdd(None);
    let result = reconcile_with(p.clone(), Some("img"), |mut api| async move {
        api.reads_with(&p, &[], true, vec![meta_item("demo-router", None)])
            .await;
        api.apply(SERVICES, NAME).await;
        for path in [DEPLOYMENTS, BINDINGS, ROLES, SA, SERVICES] {
            let seen = api
                .next(Method::DELETE, &format!("{path}/demo-router?"))
                .await;
            seen.reply(
                StatusCode::NOT_FOUND,
                status_error(404, "NotFound", "already gone"),
            );
        }
        api.apply(SERVICES, "demo-g0-bootstrap").await;
        api.apply(POLICIES, "demo-g0-kv").await;
        api.create_pod("demo-g0-i1-p0").await;
        api.event().await;
        api.status().await;
        api.done().await;
    })
    .await;
    result.unwrap();
}
