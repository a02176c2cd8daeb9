//! Cluster DNS for the pods: a small authoritative server for `cluster.local` that answers
//! from the API server's Services and EndpointSlices, the way CoreDNS's kubernetes plugin
//! does for the names Tandem uses:
//!
//! - `<service>.<ns>.svc.cluster.local` → the ClusterIP, or for a headless Service the
//!   addresses of its ready endpoints (the EndpointSlice controller marks not-ready pods
//!   ready when the Service publishes not-ready addresses);
//! - `<hostname>.<service>.<ns>.svc.cluster.local` (headless Services) → the endpoint whose
//!   `hostname` the EndpointSlice controller took from the pod's `spec.hostname` and
//!   `spec.subdomain`.
//!
//! Other names get NXDOMAIN (there is no upstream), AAAA and other types of known names
//! NODATA. Pods reach it over UDP through their own resolver (`resolv.conf` with the
//! cluster's search path and `ndots:5`). Not served: SRV records, pod A records
//! (`a-b-c-d.<ns>.pod`), ExternalName Services, TCP.
//!
//! Why not CoreDNS: building it from its Go module adds minutes to every fresh CI run for
//! names this server answers from the same API objects by the same rules.

pub mod wire;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::net::UdpSocket;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::net::CLUSTER_DOMAIN;
use wire::{RCODE_NOERROR, RCODE_NXDOMAIN, TYPE_A};

/// TTL of every answer (CoreDNS's kubernetes plugin default).
pub const TTL: u32 = 5;
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// What a name resolves to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// The name exists; its A records (possibly none).
    Found(Vec<Ipv4Addr>),
    NotFound,
}

/// Resolve `name` (lower case, no trailing dot) against the cluster's objects.
pub fn resolve(name: &str, services: &[Arc<Service>], slices: &[Arc<EndpointSlice>]) -> Resolution {
    let suffix = format!(".svc.{CLUSTER_DOMAIN}");
    let Some(rest) = name.strip_suffix(&suffix) else {
        return Resolution::NotFound;
    };
    let parts: Vec<&str> = rest.split('.').collect();
    let (hostname, svc_name, ns) = match parts.as_slice() {
        [svc, ns] => (None, *svc, *ns),
        [host, svc, ns] => (Some(*host), *svc, *ns),
        _ => return Resolution::NotFound,
    };
    let Some(svc) = services
        .iter()
        .find(|s| s.name_any() == svc_name && s.namespace().as_deref() == Some(ns))
    else {
        return Resolution::NotFound;
    };
    let spec = svc.spec.clone().unwrap_or_default();
    let headless = spec.cluster_ip.as_deref() == Some("None");
    if !headless {
        if hostname.is_some() {
            return Resolution::NotFound;
        }
        let ip = spec
            .cluster_ip
            .as_deref()
            .and_then(|ip| ip.parse::<Ipv4Addr>().ok());
        return Resolution::Found(ip.into_iter().collect());
    }
    let mut addrs = Vec::new();
    for slice in slices.iter().filter(|s| {
        s.namespace().as_deref() == Some(ns)
            && s.labels().get(SERVICE_NAME_LABEL).map(String::as_str) == Some(svc_name)
            && s.address_type == "IPv4"
    }) {
        for ep in &slice.endpoints {
            let ready = ep.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
            if !ready {
                continue;
            }
            if let Some(h) = hostname
                && ep.hostname.as_deref() != Some(h)
            {
                continue;
            }
            addrs.extend(
                ep.addresses
                    .iter()
                    .filter_map(|a| a.parse::<Ipv4Addr>().ok()),
            );
        }
    }
    addrs.sort();
    addrs.dedup();
    match hostname {
        Some(_) if addrs.is_empty() => Resolution::NotFound,
        _ => Resolution::Found(addrs),
    }
}

/// Counters of the server (logged at the end of a run).
#[derive(Debug, Default)]
pub struct DnsStats {
    pub queries: AtomicU64,
    pub answered: AtomicU64,
    pub nxdomain: AtomicU64,
    pub malformed: AtomicU64,
}

/// The running server and its watches.
pub struct DnsServer {
    pub addr: SocketAddr,
    pub stats: Arc<DnsStats>,
    tasks: Vec<JoinHandle<()>>,
}

impl DnsServer {
    /// Watch Services and EndpointSlices in every namespace and serve on `addr` (UDP).
    pub async fn start(client: Client, addr: SocketAddr) -> Result<DnsServer> {
        let (services, svc_writer) = reflector::store::<Service>();
        let (slices, slice_writer) = reflector::store::<EndpointSlice>();
        let svc_watch = watcher(
            Api::<Service>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .reflect(svc_writer)
        .applied_objects()
        .for_each(|_| async {});
        let slice_watch = watcher(
            Api::<EndpointSlice>::all(client),
            watcher::Config::default(),
        )
        .default_backoff()
        .reflect(slice_writer)
        .applied_objects()
        .for_each(|_| async {});
        let socket = UdpSocket::bind(addr)
            .await
            .with_context(|| format!("binding the cluster DNS on {addr}"))?;
        let stats = Arc::new(DnsStats::default());
        let tasks = vec![
            tokio::spawn(svc_watch),
            tokio::spawn(slice_watch),
            tokio::spawn(serve(
                socket,
                services.clone(),
                slices.clone(),
                stats.clone(),
            )),
        ];
        services.wait_until_ready().await?;
        slices.wait_until_ready().await?;
        Ok(DnsServer { addr, stats, tasks })
    }

    pub fn stop(&self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn serve(
    socket: UdpSocket,
    services: Store<Service>,
    slices: Store<EndpointSlice>,
    stats: Arc<DnsStats>,
) {
    let mut buf = [0u8; 1500];
    loop {
        let (n, peer) = match socket.recv_from(&mut buf).await {
            Ok(r) => r,
            Err(e) => {
                warn!("cluster DNS: receive failed: {e}");
                continue;
            }
        };
        stats.queries.fetch_add(1, Ordering::Relaxed);
        let reply = match wire::parse_query(&buf[..n]) {
            Ok(q) => {
                let found = resolve(&q.name, &services.state(), &slices.state());
                debug!(name = %q.name, qtype = q.qtype, %peer, ?found, "cluster DNS query");
                match found {
                    Resolution::Found(addrs) => {
                        stats.answered.fetch_add(1, Ordering::Relaxed);
                        let addrs = if q.qtype == TYPE_A { addrs } else { Vec::new() };
                        Some(wire::answer(&q, RCODE_NOERROR, &addrs, TTL))
                    }
                    Resolution::NotFound => {
                        stats.nxdomain.fetch_add(1, Ordering::Relaxed);
                        Some(wire::answer(&q, RCODE_NXDOMAIN, &[], TTL))
                    }
                }
            }
            Err(r) => {
                stats.malformed.fetch_add(1, Ordering::Relaxed);
                warn!(%peer, ?r, "cluster DNS: malformed query");
                wire::error_answer(&r)
            }
        };
        if let Some(reply) = reply
            && let Err(e) = socket.send_to(&reply, peer).await
        {
            warn!(%peer, "cluster DNS: send failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ServiceSpec;
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn service(name: &str, ns: &str, cluster_ip: &str) -> Arc<Service> {
        Arc::new(Service {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(ns.into()),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                cluster_ip: Some(cluster_ip.into()),
                ..Default::default()
            }),
            status: None,
        })
    }

    fn endpoint(ip: &str, hostname: Option<&str>, ready: Option<bool>) -> Endpoint {
        Endpoint {
            addresses: vec![ip.into()],
            hostname: hostname.map(Into::into),
            conditions: Some(EndpointConditions {
                ready,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn slice(svc: &str, ns: &str, endpoints: Vec<Endpoint>) -> Arc<EndpointSlice> {
        Arc::new(EndpointSlice {
            metadata: ObjectMeta {
                name: Some(format!("{svc}-abcde")),
                namespace: Some(ns.into()),
                labels: Some([(SERVICE_NAME_LABEL.to_string(), svc.to_string())].into()),
                ..Default::default()
            },
            address_type: "IPv4".into(),
            endpoints,
            ports: None,
        })
    }

    #[test]
    fn headless_names_resolve_to_ready_endpoints_and_hostnames() {
        let services = vec![
            service("demo-g0-bootstrap", "ns1", "None"),
            service("demo", "ns1", "10.96.0.20"),
        ];
        let slices = vec![slice(
            "demo-g0-bootstrap",
            "ns1",
            vec![
                endpoint("10.213.0.11", Some("prefill-0"), Some(true)),
                endpoint("10.213.0.12", Some("prefill-1"), None),
                endpoint("10.213.0.13", Some("prefill-2"), Some(false)),
            ],
        )];
        let r = |n: &str| resolve(n, &services, &slices);
        assert_eq!(
            r("prefill-0.demo-g0-bootstrap.ns1.svc.cluster.local"),
            Resolution::Found(vec![Ipv4Addr::new(10, 213, 0, 11)])
        );
        assert_eq!(
            r("prefill-1.demo-g0-bootstrap.ns1.svc.cluster.local"),
            Resolution::Found(vec![Ipv4Addr::new(10, 213, 0, 12)])
        );
        assert_eq!(
            r("prefill-2.demo-g0-bootstrap.ns1.svc.cluster.local"),
            Resolution::NotFound,
            "not ready"
        );
        assert_eq!(
            r("demo-g0-bootstrap.ns1.svc.cluster.local"),
            Resolution::Found(vec![
                Ipv4Addr::new(10, 213, 0, 11),
                Ipv4Addr::new(10, 213, 0, 12)
            ])
        );
        assert_eq!(
            r("demo.ns1.svc.cluster.local"),
            Resolution::Found(vec![Ipv4Addr::new(10, 96, 0, 20)])
        );
        // The search path's wrong guesses.
        assert_eq!(
            r("prefill-0.demo-g0-bootstrap.ns1.svc.ns1.svc.cluster.local"),
            Resolution::NotFound
        );
        assert_eq!(r("demo.ns2.svc.cluster.local"), Resolution::NotFound);
        assert_eq!(r("example.com"), Resolution::NotFound);
        assert_eq!(r("x.demo.ns1.svc.cluster.local"), Resolution::NotFound);
    }

    #[test]
    fn a_headless_service_without_endpoints_exists_but_has_no_records() {
        let services = vec![service("demo-g1-bootstrap", "ns1", "None")];
        assert_eq!(
            resolve("demo-g1-bootstrap.ns1.svc.cluster.local", &services, &[]),
            Resolution::Found(vec![])
        );
    }
}
