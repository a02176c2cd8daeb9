//! Container probes as the kubelet runs them: HTTP GET (success is a status in 200..400)
//! or a TCP connect, each bounded by `timeoutSeconds`; a probe that does not answer in
//! time has failed. Consecutive results are counted against `successThreshold` and
//! `failureThreshold`.

use std::net::Ipv4Addr;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::http;

/// One probe's settings with the API defaults filled in.
#[derive(Debug, Clone)]
pub struct ProbeSpec {
    pub action: Action,
    pub initial_delay: Duration,
    pub period: Duration,
    pub timeout: Duration,
    pub success_threshold: u32,
    pub failure_threshold: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    HttpGet {
        port: u16,
        path: String,
    },
    TcpSocket {
        port: u16,
    },
    /// An action this kubelet cannot run (exec, gRPC): every probe fails with this text.
    Unsupported(String),
}

fn secs(v: Option<i32>, default: i32) -> Duration {
    Duration::from_secs(v.unwrap_or(default).max(0) as u64)
}

fn resolve_port(port: &IntOrString, container: &Container) -> Result<u16, String> {
    match port {
        IntOrString::Int(p) => u16::try_from(*p).map_err(|_| format!("port {p} out of range")),
        IntOrString::String(name) => container
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name.as_str()))
            .and_then(|p| u16::try_from(p.container_port).ok())
            .ok_or_else(|| format!("named port {name:?} is not a container port")),
    }
}

impl ProbeSpec {
    pub fn from_api(probe: &Probe, container: &Container) -> ProbeSpec {
        let action = if let Some(h) = &probe.http_get {
            match resolve_port(&h.port, container) {
                Ok(port) if h.scheme.as_deref().unwrap_or("HTTP") == "HTTP" => Action::HttpGet {
                    port,
                    path: h.path.clone().unwrap_or_else(|| "/".into()),
                },
                Ok(_) => Action::Unsupported("HTTPS probes are not supported".into()),
                Err(e) => Action::Unsupported(e),
            }
        } else if let Some(t) = &probe.tcp_socket {
            match resolve_port(&t.port, container) {
                Ok(port) => Action::TcpSocket { port },
                Err(e) => Action::Unsupported(e),
            }
        } else {
            Action::Unsupported("only httpGet and tcpSocket probes are supported".into())
        };
        ProbeSpec {
            action,
            initial_delay: secs(probe.initial_delay_seconds, 0),
            period: secs(probe.period_seconds, 10).max(Duration::from_secs(1)),
            timeout: secs(probe.timeout_seconds, 1).max(Duration::from_secs(1)),
            success_threshold: probe.success_threshold.unwrap_or(1).max(1) as u32,
            failure_threshold: probe.failure_threshold.unwrap_or(3).max(1) as u32,
        }
    }
}

/// Run the probe once against the pod's address. `Err` carries the failure's message.
pub async fn run(spec: &ProbeSpec, pod_ip: Ipv4Addr) -> Result<(), String> {
    match &spec.action {
        Action::HttpGet { port, path } => {
            let addr = format!("{pod_ip}:{port}");
            match http::get(&addr, path, spec.timeout).await {
                Ok(r) if (200..400).contains(&r.status) => Ok(()),
                Ok(r) => Err(format!("HTTP probe failed with statuscode: {}", r.status)),
                Err(e) => Err(format!("Get \"http://{addr}{path}\": {e:#}")),
            }
        }
        Action::TcpSocket { port } => {
            let addr = format!("{pod_ip}:{port}");
            match tokio::time::timeout(spec.timeout, tokio::net::TcpStream::connect(&addr)).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(format!("dial tcp {addr}: {e}")),
                Err(_) => Err(format!("dial tcp {addr}: i/o timeout")),
            }
        }
        Action::Unsupported(why) => Err(why.clone()),
    }
}

/// Consecutive results of one probe, turned into a verdict by the thresholds.
#[derive(Debug, Clone, Default)]
pub struct Tracker {
    pub successes: u32,
    pub failures: u32,
    /// Current verdict (probes start out failing: not ready, not started).
    pub passing: bool,
    pub last_error: Option<String>,
}

impl Tracker {
    /// Record one result; returns true when the verdict changed.
    pub fn record(&mut self, spec: &ProbeSpec, result: &Result<(), String>) -> bool {
        let before = self.passing;
        match result {
            Ok(()) => {
                self.successes += 1;
                self.failures = 0;
                self.last_error = None;
                if self.successes >= spec.success_threshold {
                    self.passing = true;
                }
            }
            Err(e) => {
                self.failures += 1;
                self.successes = 0;
                self.last_error = Some(e.clone());
                if self.failures >= spec.failure_threshold {
                    self.passing = false;
                }
            }
        }
        before != self.passing
    }

    /// The failure threshold has been reached (liveness and startup kill on this).
    pub fn exhausted(&self, spec: &ProbeSpec) -> bool {
        self.failures >= spec.failure_threshold
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ContainerPort, HTTPGetAction};

    fn container() -> Container {
        Container {
            name: "c".into(),
            ports: Some(vec![ContainerPort {
                name: Some("http".into()),
                container_port: 8000,
                ..Default::default()
            }]),
            ..Default::default()
        }
    }

    #[test]
    fn defaults_and_named_ports_follow_the_api() {
        let p = Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/ready".into()),
                port: IntOrString::String("http".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let s = ProbeSpec::from_api(&p, &container());
        assert_eq!(
            s.action,
            Action::HttpGet {
                port: 8000,
                path: "/ready".into()
            }
        );
        assert_eq!(s.period, Duration::from_secs(10));
        assert_eq!(s.timeout, Duration::from_secs(1));
        assert_eq!((s.success_threshold, s.failure_threshold), (1, 3));

        let bad = Probe {
            http_get: Some(HTTPGetAction {
                port: IntOrString::String("metrics".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(matches!(
            ProbeSpec::from_api(&bad, &container()).action,
            Action::Unsupported(_)
        ));
    }

    #[test]
    fn thresholds_gate_the_verdict() {
        let mut s = ProbeSpec::from_api(&Probe::default(), &container());
        s.success_threshold = 2;
        s.failure_threshold = 2;
        let mut t = Tracker::default();
        assert!(!t.record(&s, &Ok(())));
        assert!(t.record(&s, &Ok(())), "second success passes");
        assert!(!t.record(&s, &Err("x".into())), "one failure is tolerated");
        assert!(t.passing);
        assert!(t.record(&s, &Err("x".into())));
        assert!(!t.passing);
        assert!(t.exhausted(&s));
    }
}
