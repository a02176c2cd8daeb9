//! Certificates of the test cluster, made fresh for every run: a CA, the API server's
//! serving certificate, one client certificate per identity that talks to the API server
//! (the admin in `system:masters`, the controller manager, the scheduler, kube-proxy, the
//! API server's own client for kubelets, and per node the kubelet as `system:node:<name>`
//! in `system:nodes`, which the Node authorizer and NodeRestriction key on), each kubelet's
//! serving certificate, and the service-account signing key pair. ECDSA P-256 throughout.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// A certificate and its key, as files.
#[derive(Debug, Clone)]
pub struct CertPair {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A node the cluster will have: its kubelet gets a client and a serving certificate.
#[derive(Debug, Clone)]
pub struct NodeIdentity {
    pub name: String,
    pub ip: IpAddr,
}

/// Files written by [`Pki::create`].
#[derive(Debug, Clone)]
pub struct Pki {
    pub dir: PathBuf,
    pub ca_cert: PathBuf,
    pub ca_key: PathBuf,
    pub serving_cert: PathBuf,
    pub serving_key: PathBuf,
    pub admin_cert: PathBuf,
    pub admin_key: PathBuf,
    /// Private key that signs service-account tokens.
    pub sa_key: PathBuf,
    /// Its public half, which verifies them.
    pub sa_pub: PathBuf,
    clients: BTreeMap<String, CertPair>,
}

/// Client identities of the control plane and kube-proxy: file stem, CN, organization.
const COMPONENTS: &[(&str, &str, Option<&str>)] = &[
    (
        "kube-controller-manager",
        "system:kube-controller-manager",
        None,
    ),
    ("kube-scheduler", "system:kube-scheduler", None),
    ("kube-proxy", "system:kube-proxy", None),
    // The API server's client for kubelets (logs, exec); bound to system:kubelet-api-admin.
    (
        "apiserver-kubelet-client",
        "kube-apiserver-kubelet-client",
        None,
    ),
];

fn name(cn: &str, org: Option<&str>) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    if let Some(o) = org {
        dn.push(DnType::OrganizationName, o);
    }
    dn
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn serving_params(cn: &str, ips: &[IpAddr], names: &[&str]) -> Result<CertificateParams> {
    let mut p = CertificateParams::default();
    p.distinguished_name = name(cn, None);
    p.subject_alt_names = ips.iter().map(|ip| SanType::IpAddress(*ip)).collect();
    for n in names {
        p.subject_alt_names.push(SanType::DnsName((*n).try_into()?));
    }
    p.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    Ok(p)
}

fn client_params(cn: &str, org: Option<&str>) -> CertificateParams {
    let mut p = CertificateParams::default();
    p.distinguished_name = name(cn, org);
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    p
}

/// Sign `params` with a fresh key and write `<stem>.crt` and `<stem>.key` under `dir`.
fn issue(
    dir: &Path,
    stem: &str,
    params: CertificateParams,
    issuer: &Issuer<'_, KeyPair>,
) -> Result<CertPair> {
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, issuer)?;
    let pair = CertPair {
        cert: dir.join(format!("{stem}.crt")),
        key: dir.join(format!("{stem}.key")),
    };
    write(&pair.cert, &cert.pem())?;
    write(&pair.key, &key.serialize_pem())?;
    Ok(pair)
}

impl Pki {
    /// Create every file under `dir`. `serving_ips` and `serving_names` become the API
    /// server certificate's subject alternative names; each node gets a kubelet client
    /// certificate and a serving certificate for its address and name.
    pub fn create(
        dir: &Path,
        serving_ips: &[IpAddr],
        serving_names: &[&str],
        nodes: &[NodeIdentity],
    ) -> Result<Pki> {
        std::fs::create_dir_all(dir)?;
        let ca_key = KeyPair::generate()?;
        let mut ca = CertificateParams::default();
        ca.distinguished_name = name("tandem-e2e-ca", None);
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca.self_signed(&ca_key)?;
        let (ca_cert_path, ca_key_path) = (dir.join("ca.crt"), dir.join("ca.key"));
        write(&ca_cert_path, &ca_cert.pem())?;
        write(&ca_key_path, &ca_key.serialize_pem())?;
        let issuer = Issuer::new(ca, ca_key);

        let serving = issue(
            dir,
            "apiserver",
            serving_params("kube-apiserver", serving_ips, serving_names)?,
            &issuer,
        )?;
        let admin = issue(
            dir,
            "admin",
            client_params("tandem-e2e-admin", Some("system:masters")),
            &issuer,
        )?;
        let mut clients = BTreeMap::new();
        for (stem, cn, org) in COMPONENTS {
            clients.insert(
                stem.to_string(),
                issue(dir, stem, client_params(cn, *org), &issuer)?,
            );
        }
        for n in nodes {
            let cn = format!("system:node:{}", n.name);
            clients.insert(
                format!("kubelet-{}", n.name),
                issue(
                    dir,
                    &format!("kubelet-{}", n.name),
                    client_params(&cn, Some("system:nodes")),
                    &issuer,
                )?,
            );
            clients.insert(
                format!("kubelet-{}-serving", n.name),
                issue(
                    dir,
                    &format!("kubelet-{}-serving", n.name),
                    serving_params(&n.name, &[n.ip], &[&n.name])?,
                    &issuer,
                )?,
            );
        }

        let sa = KeyPair::generate()?;
        let (sa_key, sa_pub) = (dir.join("sa.key"), dir.join("sa.pub"));
        write(&sa_key, &sa.serialize_pem())?;
        write(&sa_pub, &sa.public_key_pem())?;
        Ok(Pki {
            dir: dir.to_path_buf(),
            ca_cert: ca_cert_path,
            ca_key: ca_key_path,
            serving_cert: serving.cert,
            serving_key: serving.key,
            admin_cert: admin.cert,
            admin_key: admin.key,
            sa_key,
            sa_pub,
            clients,
        })
    }

    /// A certificate made by [`Pki::create`]: a component's stem (`kube-scheduler`, …),
    /// `kubelet-<node>` or `kubelet-<node>-serving`.
    pub fn cert(&self, stem: &str) -> Result<&CertPair> {
        self.clients
            .get(stem)
            .with_context(|| format!("no certificate {stem:?} in {}", self.dir.display()))
    }
}
