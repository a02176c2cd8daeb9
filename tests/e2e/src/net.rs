//! The cluster's network, inside the run's network namespace ([`crate::sandbox`]): a
//! bridge (`tdm-net0`, 10.213.0.1/24) for the control plane, and per node a network
//! namespace joined to it by a veth pair (the node's `eth0`, 10.213.0.1X/24, default route
//! via the bridge). Each node's pods get a /24 of 10.244.0.0/16 from its CNI bridge; the
//! run's namespace routes each /24 to its node, so pods reach each other across nodes, the
//! control plane reaches pods, and pods reach the API server and the cluster DNS at
//! 10.213.0.1 (directly, or through the `kubernetes` and `kube-dns` Service IPs that
//! kube-proxy translates on each node). Service IPs from the run's namespace itself are
//! routed through the first node.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use anyhow::{Context, Result};

use crate::proc::run;

/// The control plane's side of the cluster network.
pub const BRIDGE: &str = "tdm-net0";
/// The control plane's address: the API server (6443) and the cluster DNS server (53).
pub const CONTROL_PLANE_IP: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 1);
const PREFIX_LEN: u8 = 24;
/// All pod addresses (kube-proxy's `clusterCIDR`).
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// Service ClusterIP range (API server and controller manager).
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// ClusterIP of the `kubernetes` Service (the first of the range).
pub const API_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 1);
/// ClusterIP of `kube-system/kube-dns`: the kubelet's `clusterDNS`.
pub const DNS_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// Cluster DNS domain.
pub const CLUSTER_DOMAIN: &str = "cluster.local";

async fn ip(args: &[&str]) -> Result<String> {
    run("ip", args).await
}

/// The address of node `index` on the cluster network.
pub fn node_ip(index: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 213, 0, 10 + index)
}

/// The pod subnet of node `index` (its CNI bridge takes the first address).
pub fn pod_subnet(index: u8) -> (Ipv4Addr, u8) {
    (Ipv4Addr::new(10, 244, index, 0), 24)
}

/// The bridge of the control plane.
pub struct ClusterNetwork;

impl ClusterNetwork {
    pub async fn create() -> Result<ClusterNetwork> {
        ip(&["link", "add", BRIDGE, "type", "bridge"]).await?;
        ip(&[
            "addr",
            "add",
            &format!("{CONTROL_PLANE_IP}/{PREFIX_LEN}"),
            "dev",
            BRIDGE,
        ])
        .await?;
        ip(&["link", "set", BRIDGE, "up"]).await?;
        Ok(ClusterNetwork)
    }

    /// A node's network namespace, its `eth0` on the bridge, its routes, and the route to
    /// its pods.
    pub async fn add_node(&self, name: &str, index: u8) -> Result<NodeNetwork> {
        let net = NodeNetwork {
            netns: format!("tdm-{name}"),
            ip: node_ip(index),
            pod_subnet: pod_subnet(index),
        };
        let host_if = format!("tdmv{index}");
        let made = async {
            ip(&["netns", "add", &net.netns]).await?;
            ip(&[
                "link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns",
                &net.netns,
            ])
            .await?;
            ip(&["link", "set", &host_if, "master", BRIDGE, "up"]).await?;
            let n = ["-n", net.netns.as_str()];
            let addr = format!("{}/{PREFIX_LEN}", net.ip);
            for args in [
                vec!["addr", "add", &addr, "dev", "eth0"],
                vec!["link", "set", "eth0", "up"],
                vec!["link", "set", "lo", "up"],
                vec!["route", "add", "default", "via", "10.213.0.1"],
            ] {
                let mut a: Vec<&str> = n.to_vec();
                a.extend(args);
                ip(&a).await?;
            }
            let (subnet, len) = net.pod_subnet;
            ip(&[
                "route",
                "add",
                &format!("{subnet}/{len}"),
                "via",
                &net.ip.to_string(),
            ])
            .await?;
            // Service IPs from the run's namespace go to the first node, whose kube-proxy
            // translates them (and masquerades, the source being outside the cluster CIDR),
            // as a router in front of a cluster would send them: the suite's clients can use
            // a Service's ClusterIP like a pod does.
            if index == 0 {
                ip(&["route", "add", SERVICE_CIDR, "via", &net.ip.to_string()]).await?;
            }
            // Forwarding inside the node: pods ↔ the cluster network.
            crate::proc::run(
                "ip",
                &[
                    "netns",
                    "exec",
                    &net.netns,
                    "sh",
                    "-c",
                    "echo 1 > /proc/sys/net/ipv4/ip_forward",
                ],
            )
            .await?;
            anyhow::Ok(())
        }
        .await;
        made.with_context(|| format!("creating the network of node {name}"))?;
        Ok(net)
    }
}

/// One node's network namespace.
#[derive(Debug, Clone)]
pub struct NodeNetwork {
    pub netns: String,
    pub ip: Ipv4Addr,
    pub pod_subnet: (Ipv4Addr, u8),
}

impl NodeNetwork {
    pub fn netns_path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.netns)
    }

    /// `10.244.N.0/24`.
    pub fn pod_cidr(&self) -> String {
        format!("{}/{}", self.pod_subnet.0, self.pod_subnet.1)
    }

    /// The first address of the pod subnet: the CNI bridge, the pods' gateway.
    pub fn pod_gateway(&self) -> Ipv4Addr {
        let [a, b, c, _] = self.pod_subnet.0.octets();
        Ipv4Addr::new(a, b, c, 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_get_their_own_addresses_and_pod_subnets() {
        assert_eq!(node_ip(0), Ipv4Addr::new(10, 213, 0, 10));
        assert_eq!(node_ip(1), Ipv4Addr::new(10, 213, 0, 11));
        let n = NodeNetwork {
            netns: "tdm-a".into(),
            ip: node_ip(1),
            pod_subnet: pod_subnet(1),
        };
        assert_eq!(n.pod_cidr(), "10.244.1.0/24");
        assert_eq!(n.pod_gateway(), Ipv4Addr::new(10, 244, 1, 1));
        assert_eq!(n.netns_path(), PathBuf::from("/run/netns/tdm-a"));
    }
}
