//! Certificates of the test control plane, made fresh for every run: a CA, the API
//! server's serving certificate, a client certificate for the admin (`system:masters`),
//! and the service-account signing key pair. ECDSA P-256 throughout.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

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
}

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

impl Pki {
    /// Create every file under `dir`. `serving_ips` and `serving_names` become the serving
    /// certificate's subject alternative names.
    pub fn create(dir: &Path, serving_ips: &[IpAddr], serving_names: &[&str]) -> Result<Pki> {
        std::fs::create_dir_all(dir)?;
        let pki = Pki {
            dir: dir.to_path_buf(),
            ca_cert: dir.join("ca.crt"),
            ca_key: dir.join("ca.key"),
            serving_cert: dir.join("apiserver.crt"),
            serving_key: dir.join("apiserver.key"),
            admin_cert: dir.join("admin.crt"),
            admin_key: dir.join("admin.key"),
            sa_key: dir.join("sa.key"),
            sa_pub: dir.join("sa.pub"),
        };

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
        write(&pki.ca_cert, &ca_cert.pem())?;
        write(&pki.ca_key, &ca_key.serialize_pem())?;
        let issuer = Issuer::new(ca, ca_key);

        let serving_key = KeyPair::generate()?;
        let mut serving = CertificateParams::default();
        serving.distinguished_name = name("kube-apiserver", None);
        serving.subject_alt_names = serving_ips
            .iter()
            .map(|ip| SanType::IpAddress(*ip))
            .collect();
        for n in serving_names {
            serving
                .subject_alt_names
                .push(SanType::DnsName((*n).try_into()?));
        }
        serving.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = serving.signed_by(&serving_key, &issuer)?;
        write(&pki.serving_cert, &cert.pem())?;
        write(&pki.serving_key, &serving_key.serialize_pem())?;

        let admin_key = KeyPair::generate()?;
        let mut admin = CertificateParams::default();
        admin.distinguished_name = name("tandem-e2e-admin", Some("system:masters"));
        admin.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = admin.signed_by(&admin_key, &issuer)?;
        write(&pki.admin_cert, &cert.pem())?;
        write(&pki.admin_key, &admin_key.serialize_pem())?;

        let sa = KeyPair::generate()?;
        write(&pki.sa_key, &sa.serialize_pem())?;
        write(&pki.sa_pub, &sa.public_key_pem())?;
        Ok(pki)
    }
}
