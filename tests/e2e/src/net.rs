//! The pod network: one Linux bridge in the harness's network namespace, and per pod a
//! network namespace joined to it by a veth pair, with its own address, default route,
//! `resolv.conf` (the cluster DNS) and `hosts` (as the kubelet writes them).
//!
//! Everything is named with the prefix `tdm` so a run can remove what a killed run left.
//! Files for a namespace live in `/etc/netns/<name>/`, where `ip netns exec` also looks, so
//! `ip netns exec <name> getent hosts …` sees what the pod sees.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Mutex;

use anyhow::{Context, Result, bail};

use crate::proc::run;

/// Bridge name (the harness's side of the pod network).
pub const BRIDGE: &str = "tdm-e2e0";
/// Prefix of every network namespace and veth this harness creates.
pub const PREFIX: &str = "tdm";
/// The pod network: 10.213.0.0/24, gateway (bridge, DNS server) at .1.
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 1);
const PREFIX_LEN: u8 = 24;
const FIRST_POD_HOST: u8 = 10;
/// Cluster DNS domain.
pub const CLUSTER_DOMAIN: &str = "cluster.local";

async fn ip(args: &[&str]) -> Result<String> {
    run("ip", args).await
}

/// The bridge and the address pool.
pub struct PodNetwork {
    pool: Mutex<Pool>,
}

/// Addresses in use, and where the next search starts: addresses are handed out in turn,
/// so a freed one is reused as late as possible (neighbours may still cache its old MAC).
struct Pool {
    used: BTreeSet<u8>,
    next: u8,
}

impl PodNetwork {
    /// Remove what an earlier run left (namespaces, veths, the bridge), then create the
    /// bridge with the gateway address.
    pub async fn create() -> Result<PodNetwork> {
        cleanup_leftovers().await?;
        ip(&["link", "add", BRIDGE, "type", "bridge"]).await?;
        ip(&[
            "addr",
            "add",
            &format!("{GATEWAY}/{PREFIX_LEN}"),
            "dev",
            BRIDGE,
        ])
        .await?;
        ip(&["link", "set", BRIDGE, "up"]).await?;
        Ok(PodNetwork {
            pool: Mutex::new(Pool {
                used: BTreeSet::new(),
                next: FIRST_POD_HOST,
            }),
        })
    }

    fn allocate(&self) -> Result<Ipv4Addr> {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        let span = 254 - FIRST_POD_HOST + 1;
        for i in 0..span {
            let host = FIRST_POD_HOST + (pool.next - FIRST_POD_HOST + i) % span;
            if pool.used.insert(host) {
                pool.next = if host == 254 {
                    FIRST_POD_HOST
                } else {
                    host + 1
                };
                let [a, b, c, _] = GATEWAY.octets();
                return Ok(Ipv4Addr::new(a, b, c, host));
            }
        }
        bail!("pod network exhausted: more than {span} pods at once")
    }

    fn release(&self, addr: Ipv4Addr) {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        pool.used.remove(&addr.octets()[3]);
    }

    /// Create a pod's namespace: veth into the bridge, an address, a default route,
    /// loopback up, and its `resolv.conf` and `hosts`.
    pub async fn add_pod(&self, key: &str, dns: &PodDns<'_>) -> Result<PodSandbox> {
        let addr = self.allocate()?;
        let netns = format!("{PREFIX}-{key}");
        let host_if = format!("{PREFIX}h{key}");
        let sandbox = PodSandbox {
            netns: netns.clone(),
            host_if: host_if.clone(),
            addr,
        };
        let made = async {
            // A reused address may still sit in the bridge's neighbour cache with the MAC
            // of its previous pod.
            let _ = ip(&["neigh", "del", &addr.to_string(), "dev", BRIDGE]).await;
            ip(&["netns", "add", &netns]).await?;
            ip(&[
                "link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", &netns,
            ])
            .await?;
            ip(&["link", "set", &host_if, "master", BRIDGE, "up"]).await?;
            ip(&[
                "-n",
                &netns,
                "addr",
                "add",
                &format!("{addr}/{PREFIX_LEN}"),
                "dev",
                "eth0",
            ])
            .await?;
            ip(&["-n", &netns, "link", "set", "eth0", "up"]).await?;
            ip(&["-n", &netns, "link", "set", "lo", "up"]).await?;
            ip(&[
                "-n",
                &netns,
                "route",
                "add",
                "default",
                "via",
                &GATEWAY.to_string(),
            ])
            .await?;
            let etc = sandbox.etc_dir();
            std::fs::create_dir_all(&etc)?;
            std::fs::write(etc.join("resolv.conf"), dns.resolv_conf())?;
            std::fs::write(etc.join("hosts"), dns.hosts(addr))?;
            anyhow::Ok(())
        }
        .await;
        if let Err(e) = made {
            let _ = self.remove_pod(&sandbox).await;
            return Err(e).with_context(|| format!("creating the network of pod {key}"));
        }
        Ok(sandbox)
    }

    /// Remove a pod's namespace (its veth goes with it) and free its address.
    pub async fn remove_pod(&self, sandbox: &PodSandbox) -> Result<()> {
        let r = ip(&["netns", "del", &sandbox.netns]).await;
        let _ = ip(&["link", "del", &sandbox.host_if]).await;
        let _ = std::fs::remove_dir_all(sandbox.etc_dir());
        self.release(sandbox.addr);
        r.map(|_| ())
    }

    /// Remove the bridge (and any namespace still there).
    pub async fn destroy(&self) -> Result<()> {
        cleanup_leftovers().await
    }
}

/// One pod's network namespace.
#[derive(Debug, Clone)]
pub struct PodSandbox {
    pub netns: String,
    pub host_if: String,
    pub addr: Ipv4Addr,
}

impl PodSandbox {
    pub fn netns_path(&self) -> PathBuf {
        PathBuf::from("/var/run/netns").join(&self.netns)
    }

    /// `/etc/netns/<name>`: the files bind-mounted over `/etc/…` inside the pod.
    pub fn etc_dir(&self) -> PathBuf {
        PathBuf::from("/etc/netns").join(&self.netns)
    }
}

/// What a pod's `resolv.conf` and `hosts` say (the kubelet's `ClusterFirst` DNS policy).
pub struct PodDns<'a> {
    pub namespace: &'a str,
    pub hostname: &'a str,
    /// `spec.subdomain`, for the pod's fully qualified name in `hosts`.
    pub subdomain: Option<&'a str>,
}

impl PodDns<'_> {
    pub fn resolv_conf(&self) -> String {
        format!(
            "nameserver {GATEWAY}\nsearch {ns}.svc.{d} svc.{d} {d}\noptions ndots:5\n",
            ns = self.namespace,
            d = CLUSTER_DOMAIN
        )
    }

    pub fn hosts(&self, addr: Ipv4Addr) -> String {
        let mut names = String::new();
        if let Some(sub) = self.subdomain {
            names.push_str(&format!(
                "{}.{sub}.{}.svc.{CLUSTER_DOMAIN} ",
                self.hostname, self.namespace
            ));
        }
        names.push_str(self.hostname);
        format!(
            "# Kubernetes-managed hosts file (tandem e2e process kubelet).\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n{addr}\t{names}\n"
        )
    }
}

/// Delete every `tdm-*` namespace, `tdm*` link and the bridge.
async fn cleanup_leftovers() -> Result<()> {
    let list = ip(&["netns", "list"]).await.unwrap_or_default();
    for line in list.lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        if name.starts_with(&format!("{PREFIX}-")) {
            let _ = ip(&["netns", "del", name]).await;
            let _ = std::fs::remove_dir_all(PathBuf::from("/etc/netns").join(name));
        }
    }
    let links = ip(&["-o", "link", "show"]).await.unwrap_or_default();
    for line in links.lines() {
        // "12: tdmh0123abcd@if3: <...>"
        let Some(name) = line.split(':').nth(1).map(str::trim) else {
            continue;
        };
        let name = name.split('@').next().unwrap_or(name);
        if name.starts_with(PREFIX) {
            let _ = ip(&["link", "del", name]).await;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_addresses_are_reused_last() {
        let net = PodNetwork {
            pool: Mutex::new(Pool {
                used: BTreeSet::new(),
                next: FIRST_POD_HOST,
            }),
        };
        let a = net.allocate().unwrap();
        let b = net.allocate().unwrap();
        assert_eq!((a.octets()[3], b.octets()[3]), (10, 11));
        net.release(a);
        assert_eq!(
            net.allocate().unwrap().octets()[3],
            12,
            "not the one just freed"
        );
        for _ in 13..=254 {
            net.allocate().unwrap();
        }
        assert_eq!(
            net.allocate().unwrap().octets()[3],
            10,
            "wraps around to the freed address"
        );
        assert!(net.allocate().is_err(), "all 245 in use");
    }

    #[test]
    fn resolv_conf_searches_like_a_cluster() {
        let d = PodDns {
            namespace: "team-a",
            hostname: "prefill-0",
            subdomain: Some("demo-g0-bootstrap"),
        };
        assert_eq!(
            d.resolv_conf(),
            "nameserver 10.213.0.1\nsearch team-a.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n"
        );
        let hosts = d.hosts(Ipv4Addr::new(10, 213, 0, 12));
        assert!(
            hosts.contains(
                "10.213.0.12\tprefill-0.demo-g0-bootstrap.team-a.svc.cluster.local prefill-0\n"
            ),
            "{hosts}"
        );
    }
}
