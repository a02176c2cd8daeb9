//! The operator binary's leader election, end to end through `main`: SIGTERM releases the
//! Lease and exits 0; a replica that finds its Lease taken over exits 1 (the Deployment
//! restarts it as a standby) without touching the other holder's Lease.
//!
//! The real `tandem-operator` process talks to a stand-in API server on 127.0.0.1 (the
//! Kubernetes API cannot run here; the e2e suite runs the real one): it keeps one Lease,
//! answers every list with an empty list and holds every watch open, and records the
//! requests it saw.

use std::convert::Infallible;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};
use tokio::net::TcpListener;

const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/ops/leases/tandem-operator";
const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/ops/leases";

#[derive(Default)]
struct State {
    lease: Option<Value>,
    version: u64,
    /// `METHOD path?query` of every request, in order.
    seen: Vec<String>,
    /// Bodies of the Lease writes (POST and PUT), in order.
    writes: Vec<Value>,
    /// Lease writes refused because another replica holds it.
    writes_while_stolen: usize,
}

/// The stand-in API server.
#[derive(Clone, Default)]
struct Fake {
    state: Arc<Mutex<State>>,
    /// Another replica holds the Lease from now on (reads show it; writes conflict).
    stolen: Arc<AtomicBool>,
}

type Body = BoxBody<Bytes, Infallible>;

fn json_body(status: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(v.to_string())).boxed())
        .unwrap()
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

impl Fake {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap()
    }

    async fn handle(&self, req: Request<Incoming>) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let body = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let path = parts.uri.path().to_string();
        let query = parts.uri.query().unwrap_or("").to_string();
        let mut st = self.state();
        st.seen.push(format!("{} {path}?{query}", parts.method));
        let stolen = self.stolen.load(Ordering::SeqCst);
        match (&parts.method, path.as_str()) {
            (&Method::GET, LEASE) if stolen => json_body(
                StatusCode::OK,
                &json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                        "metadata": {"name": "tandem-operator", "namespace": "ops", "resourceVersion": "999"},
                        "spec": {"holderIdentity": "other-replica", "leaseDurationSeconds": 15,
                                 "renewTime": now(), "acquireTime": now(), "leaseTransitions": 9}}),
            ),
            (&Method::GET, LEASE) => match &st.lease {
                Some(l) => json_body(StatusCode::OK, l),
                None => json_body(
                    StatusCode::NOT_FOUND,
                    &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "reason": "NotFound", "code": 404}),
                ),
            },
            (&Method::POST, LEASES) | (&Method::PUT, LEASE) if stolen => {
                st.writes_while_stolen += 1;
                json_body(
                    StatusCode::CONFLICT,
                    &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "reason": "Conflict", "code": 409}),
                )
            }
            (&Method::POST, LEASES) | (&Method::PUT, LEASE) => {
                st.version += 1;
                let mut l = body.clone();
                l["metadata"]["resourceVersion"] = json!(st.version.to_string());
                st.writes.push(body);
                st.lease = Some(l.clone());
                let code = if parts.method == Method::POST {
                    StatusCode::CREATED
                } else {
                    StatusCode::OK
                };
                json_body(code, &l)
            }
            (&Method::GET, _) if query.contains("watch=true") || query.contains("watch=1") => {
                // Held open and silent, as a quiet watch is.
                Response::builder()
                    .status(StatusCode::OK)
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(BodyExt::boxed(StreamBody::new(futures::stream::pending::<
                        Result<Frame<Bytes>, Infallible>,
                    >())))
                    .unwrap()
            }
            (&Method::GET, _) => json_body(
                StatusCode::OK,
                &json!({"apiVersion": "v1", "kind": "List",
                        "metadata": {"resourceVersion": "1"}, "items": []}),
            ),
            _ => json_body(
                StatusCode::METHOD_NOT_ALLOWED,
                &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "reason": "MethodNotAllowed", "code": 405}),
            ),
        }
    }

    async fn serve(self) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let fake = self.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let fake = fake.clone();
                        async move { Ok::<_, Infallible>(fake.handle(req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        addr
    }
}

/// The operator binary against the fake, its output in a temporary directory.
struct Operator {
    child: Child,
    dir: std::path::PathBuf,
}

impl Operator {
    fn start(api: std::net::SocketAddr, name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("tandem-leader-test-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters: [{{name: fake, cluster: {{server: 'http://{api}'}}}}]\nusers: [{{name: u, user: {{}}}}]\ncontexts: [{{name: c, context: {{cluster: fake, user: u, namespace: default}}}}]\ncurrent-context: c\n"
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.join("operator.log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_tandem-operator"))
            .args([
                "--namespace",
                "default",
                "--lease-namespace",
                "ops",
                "--identity",
                name,
                "--metrics-addr",
                "127.0.0.1:0",
            ])
            .env("KUBECONFIG", &kubeconfig)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("POD_NAME")
            .env_remove("POD_NAMESPACE")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start tandem-operator");
        Self { child, dir }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("operator.log")).unwrap_or_default()
    }

    async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            assert!(
                start.elapsed() < within,
                "no exit within {within:?}; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Wait until the operator holds the Lease and its controller has started (it lists the
/// PDDeployments first).
async fn wait_leading(fake: &Fake, op: &Operator) -> String {
    let start = Instant::now();
    loop {
        {
            let st = fake.state();
            let holder = st
                .lease
                .as_ref()
                .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_string));
            let listed = st.seen.iter().any(|r| {
                r.starts_with("GET /apis/tandem.dev/v1alpha1/namespaces/default/pddeployments")
            });
            if let (Some(h), true) = (holder, listed) {
                return h;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "not leading; requests: {:#?}\nlog:\n{}",
            fake.state().seen,
            op.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_releases_the_lease_and_exits_0() {
    let fake = Fake::default();
    let api = fake.clone().serve().await;
    let mut op = Operator::start(api, "term");
    let me = wait_leading(&fake, &op).await;
    assert!(me.starts_with("term-"), "{me}");

    kill(Pid::from_raw(op.child.id() as i32), Signal::SIGTERM).unwrap();
    let stopped = Instant::now();
    let st = op.wait_exit(Duration::from_secs(30)).await;
    assert_eq!(st.code(), Some(0), "log:\n{}", op.log());
    let writes = fake.state().writes.clone();
    let last = writes.last().unwrap();
    assert_eq!(
        (
            &last["spec"]["holderIdentity"],
            &last["spec"]["leaseDurationSeconds"]
        ),
        (&Value::Null, &json!(1)),
        "the last write gives the Lease up: {last:#}"
    );
    eprintln!(
        "SIGTERM → Lease released and exit 0 in {:?}",
        stopped.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_lease_is_taken_over_exits_1_without_releasing_it() {
    let fake = Fake::default();
    let api = fake.clone().serve().await;
    let mut op = Operator::start(api, "lose");
    wait_leading(&fake, &op).await;

    fake.stolen.store(true, Ordering::SeqCst);
    let stolen = Instant::now();
    // The next renewal (every retry period, 5 s) finds another holder.
    let st = op.wait_exit(Duration::from_secs(30)).await;
    assert_eq!(st.code(), Some(1), "log:\n{}", op.log());
    assert!(
        op.log().contains("lost the leader lease"),
        "says why: {}",
        op.log()
    );
    // It never wrote the Lease again: the new holder's Lease is not ours to release.
    let st = fake.state();
    assert_eq!(st.writes_while_stolen, 0, "{:#?}", st.seen);
    eprintln!("Lease taken over → exit 1 in {:?}", stolen.elapsed());
}
