//! A throwaway SPIFFE trust domain for tests and the local dev stack.
//!
//! There is no SPIRE on dev machines, so a local CA issues X.509 SVIDs that look like
//! the real thing: URI SAN `spiffe://<trust domain>/<name>`, ECDSA P-256, usable as
//! both client and server certificates on loopback. Real deployments get their SVIDs
//! from the SPIFFE Workload API instead; nothing here is meant for production.
//!
//! Layout of `dir`: `ca.pem`, `ca.key`, and per name `<name with '/' -> '-'>.pem`
//! (leaf + CA chain) and `.key` (PKCS#8).

use std::fs;
use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

const CA_CERT: &str = "ca.pem";
const CA_KEY: &str = "ca.key";
const CA_COMMON_NAME: &str = "Latchkey dev CA";
const ORGANIZATION: &str = "Latchkey dev";
const DAY: Duration = Duration::from_secs(24 * 60 * 60);
/// Back-dated so that small clock skew between processes never makes a fresh cert invalid.
const NOT_BEFORE_AGO: Duration = DAY;
const SVID_LIFETIME: Duration = Duration::from_secs(30 * 24 * 60 * 60);
/// The CA outlives many SVID reissues, so a reused `.dev/certs` keeps working.
const CA_LIFETIME: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// A directory holding a dev CA and the SVIDs it issued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevTrustDomain {
    pub dir: PathBuf,
    pub trust_domain: String,
}

/// Where one workload's SVID lives on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SvidFiles {
    pub spiffe_id: String,
    /// PEM chain: the leaf first, then the CA.
    pub cert: PathBuf,
    /// PKCS#8 PEM private key.
    pub key: PathBuf,
}

#[derive(thiserror::Error, Debug)]
pub enum DevCertError {
    #[error("invalid trust domain {trust_domain:?}: {reason}")]
    InvalidTrustDomain {
        trust_domain: String,
        reason: &'static str,
    },
    #[error("invalid workload name {name:?}: {reason}")]
    InvalidName { name: String, reason: &'static str },
    #[error("creating directory {}", path.display())]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("reading {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("writing {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("parsing CA key {}", path.display())]
    CaKey {
        path: PathBuf,
        #[source]
        source: rcgen::Error,
    },
    /// Reusing a CA that does not match would issue SVIDs that do not chain to `ca.pem`.
    #[error(
        "{} is not the dev CA for trust domain {trust_domain:?} with the key in ca.key; \
         remove the directory to start over",
        path.display()
    )]
    CaMismatch { path: PathBuf, trust_domain: String },
    #[error("issuing certificate for {subject}")]
    Issue {
        subject: String,
        #[source]
        source: rcgen::Error,
    },
}

/// The identities of the dev trust domain: the arbiter, the edge, an
/// operator, and the demo workloads (`latchctl dev-certs` and the tests).
pub const DEV_NAMES: &[&str] = &[
    "latchkey/arbiter",
    "latchkey/edge",
    "latchkey/operator",
    "workload/demo",
    "workload/alice",
    "workload/bob",
    "workload/mallory",
    "workload/bench",
    // A tenant whose prefix is granted for one class only (issue 34).
    "workload/tenant",
    // Per-pod identities (issue 30): three pods of one Deployment whose
    // ClusterSPIFFEID template names the pod, granted by one pattern.
    "ns/payments/sa/ledger/ledger-7d9f-a",
    "ns/payments/sa/ledger/ledger-7d9f-b",
    "ns/payments/sa/ledger/ledger-7d9f-c",
];

/// `spiffe://{trust_domain}/{name}`.
pub fn spiffe_id(trust_domain: &str, name: &str) -> String {
    format!("spiffe://{trust_domain}/{name}")
}

impl DevTrustDomain {
    /// The CA certificate (the trust bundle).
    pub fn ca(&self) -> PathBuf {
        self.dir.join(CA_CERT)
    }

    /// The files of `name`'s SVID (whether or not they were issued).
    pub fn svid(&self, name: &str) -> SvidFiles {
        let stem = name.replace('/', "-");
        SvidFiles {
            spiffe_id: spiffe_id(&self.trust_domain, name),
            cert: self.dir.join(format!("{stem}.pem")),
            key: self.dir.join(format!("{stem}.key")),
        }
    }
}

/// Writes ca.pem (+ ca.key), and an SVID (cert chain PEM + PKCS#8 key PEM) for each name.
///
/// Idempotent: an existing CA is reused (so already-distributed trust bundles stay valid)
/// and only SVIDs whose cert or key file is missing are (re)issued.
pub fn generate(
    dir: &Path,
    trust_domain: &str,
    names: &[&str],
) -> Result<DevTrustDomain, DevCertError> {
    validate_trust_domain(trust_domain)?;
    for name in names {
        validate_name(name)?;
    }
    fs::create_dir_all(dir).map_err(|source| DevCertError::CreateDir {
        path: dir.to_path_buf(),
        source,
    })?;
    let domain = DevTrustDomain {
        dir: dir.to_path_buf(),
        trust_domain: trust_domain.to_owned(),
    };

    let (ca_pem, issuer) = load_or_create_ca(&domain)?;
    for name in names {
        let files = domain.svid(name);
        if files.cert.exists() && files.key.exists() {
            continue;
        }
        let key = KeyPair::generate().map_err(|source| DevCertError::Issue {
            subject: files.spiffe_id.clone(),
            source,
        })?;
        let cert = svid_params(name, &files.spiffe_id)?
            .signed_by(&key, &issuer)
            .map_err(|source| DevCertError::Issue {
                subject: files.spiffe_id.clone(),
                source,
            })?;
        // Key first: a cert without its key is useless, and the cert's presence is what
        // the next run checks together with the key.
        write_file(&files.key, key.serialize_pem().as_bytes(), true)?;
        write_file(
            &files.cert,
            format!("{}{ca_pem}", cert.pem()).as_bytes(),
            false,
        )?;
    }
    Ok(domain)
}

fn load_or_create_ca(
    domain: &DevTrustDomain,
) -> Result<(String, Issuer<'static, KeyPair>), DevCertError> {
    let cert_path = domain.ca();
    let key_path = domain.dir.join(CA_KEY);
    let params = ca_params(&domain.trust_domain)?;

    if let Ok(ca_pem) = fs::read_to_string(&cert_path) {
        let key_pem = fs::read_to_string(&key_path).map_err(|source| DevCertError::Read {
            path: key_path.clone(),
            source,
        })?;
        let key = KeyPair::from_pem(&key_pem).map_err(|source| DevCertError::CaKey {
            path: key_path.clone(),
            source,
        })?;
        if !ca_matches(&ca_pem, &domain.trust_domain, &key) {
            return Err(DevCertError::CaMismatch {
                path: cert_path,
                trust_domain: domain.trust_domain.clone(),
            });
        }
        // Same subject name and key as the stored CA, so issued certs chain to it.
        return Ok((ca_pem, Issuer::new(params, key)));
    }

    let subject = format!("CA for {}", domain.trust_domain);
    let key = KeyPair::generate().map_err(|source| DevCertError::Issue {
        subject: subject.clone(),
        source,
    })?;
    let cert = params
        .self_signed(&key)
        .map_err(|source| DevCertError::Issue { subject, source })?;
    let ca_pem = cert.pem();
    // ca.pem is what marks the CA as present, so it is written last.
    write_file(&key_path, key.serialize_pem().as_bytes(), true)?;
    write_file(&cert_path, ca_pem.as_bytes(), false)?;
    Ok((ca_pem, Issuer::new(params, key)))
}

/// A cheap check without an X.509 parser: the stored CA must carry the trust domain's
/// URI SAN (as its exact DER encoding) and the public key of ca.key.
fn ca_matches(ca_pem: &str, trust_domain: &str, key: &KeyPair) -> bool {
    let mut reader = io::BufReader::new(ca_pem.as_bytes());
    let Some(Ok(der)) = rustls_pemfile::certs(&mut reader).next() else {
        return false;
    };
    let uri = format!("spiffe://{trust_domain}");
    let Ok(len) = u8::try_from(uri.len()) else {
        return false;
    };
    // GeneralName uniformResourceIdentifier: [6] IMPLICIT IA5String, short-form length.
    let mut san = vec![0x86, len];
    san.extend_from_slice(uri.as_bytes());
    contains(&der, &san) && contains(&der, key.public_key_raw())
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

fn ca_params(trust_domain: &str) -> Result<CertificateParams, DevCertError> {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, ORGANIZATION);
    dn.push(
        DnType::CommonName,
        format!("{CA_COMMON_NAME} ({trust_domain})"),
    );
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    // A SPIFFE CA may carry the trust domain's own ID; it also lets us recognise it.
    let uri = format!("spiffe://{trust_domain}");
    params.subject_alt_names = vec![SanType::URI(ia5(&uri, &uri)?)];
    let now = SystemTime::now();
    params.not_before = (now - NOT_BEFORE_AGO).into();
    params.not_after = (now + CA_LIFETIME).into();
    Ok(params)
}

fn svid_params(name: &str, spiffe_id: &str) -> Result<CertificateParams, DevCertError> {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, ORGANIZATION);
    dn.push(DnType::CommonName, name);
    params.distinguished_name = dn;
    params.is_ca = IsCa::ExplicitNoCa;
    params.subject_alt_names = vec![
        SanType::URI(ia5(spiffe_id, spiffe_id)?),
        SanType::DnsName(ia5("localhost", spiffe_id)?),
        SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
    ];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    let now = SystemTime::now();
    params.not_before = (now - NOT_BEFORE_AGO).into();
    params.not_after = (now + SVID_LIFETIME).into();
    Ok(params)
}

fn ia5(value: &str, subject: &str) -> Result<rcgen::string::Ia5String, DevCertError> {
    rcgen::string::Ia5String::try_from(value).map_err(|source| DevCertError::Issue {
        subject: subject.to_owned(),
        source,
    })
}

fn validate_trust_domain(trust_domain: &str) -> Result<(), DevCertError> {
    let reason = if trust_domain.is_empty() {
        Some("empty")
    } else if !trust_domain
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-._".contains(&b))
    {
        Some("only lowercase letters, digits, '-', '.' and '_' are allowed")
    } else if trust_domain.len() > 100 {
        Some("too long")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(DevCertError::InvalidTrustDomain {
            trust_domain: trust_domain.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

/// Names become file names, so they must not escape `dir` or collide with the CA files.
fn validate_name(name: &str) -> Result<(), DevCertError> {
    let reason = if name.is_empty() {
        Some("empty")
    } else if name
        .split('/')
        .any(|seg| seg.is_empty() || seg == "." || seg == "..")
    {
        Some("empty, '.' or '..' path segment")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-._/".contains(&b))
    {
        Some("only ASCII letters, digits, '-', '.', '_' and '/' are allowed")
    } else if name == "ca" {
        Some("reserved for the CA files")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(DevCertError::InvalidName {
            name: name.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

/// Writes via a temp file and rename, so an interrupted run never leaves a truncated
/// file that the next run would take as present. Keys are readable by the owner only.
fn write_file(path: &Path, contents: &[u8], private: bool) -> Result<(), DevCertError> {
    let err = |source| DevCertError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(".tmp");
    let tmp = PathBuf::from(tmp_name);
    let mut options = fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(if private { 0o600 } else { 0o644 });
    }
    #[cfg(not(unix))]
    let _ = private;
    let mut file = options.open(&tmp).map_err(err)?;
    file.write_all(contents).map_err(err)?;
    file.sync_all().map_err(err)?;
    fs::rename(&tmp, path).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    const TD: &str = "dev.latchkey";

    fn openssl_available() -> bool {
        Command::new("openssl")
            .arg("version")
            .output()
            .is_ok_and(|o| o.status.success())
    }

    fn openssl(args: &[&str]) -> String {
        let out = Command::new("openssl").args(args).output().unwrap();
        assert!(
            out.status.success(),
            "openssl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    #[test]
    fn spiffe_id_format() {
        assert_eq!(
            spiffe_id(TD, "workload/demo"),
            "spiffe://dev.latchkey/workload/demo"
        );
    }

    #[test]
    fn writes_ca_and_svids() {
        let tmp = tempfile::tempdir().unwrap();
        let td = generate(tmp.path(), TD, &["latchkey/arbiter", "workload/demo"]).unwrap();
        assert_eq!(td.ca(), tmp.path().join("ca.pem"));
        let demo = td.svid("workload/demo");
        assert_eq!(demo.cert, tmp.path().join("workload-demo.pem"));
        assert_eq!(demo.key, tmp.path().join("workload-demo.key"));
        assert_eq!(demo.spiffe_id, "spiffe://dev.latchkey/workload/demo");

        let ca = fs::read_to_string(td.ca()).unwrap();
        assert_eq!(ca.matches("BEGIN CERTIFICATE").count(), 1);
        let chain = fs::read_to_string(&demo.cert).unwrap();
        assert_eq!(chain.matches("BEGIN CERTIFICATE").count(), 2);
        assert!(chain.ends_with(&ca), "chain ends with the CA");
        let key = fs::read_to_string(&demo.key).unwrap();
        assert!(key.starts_with("-----BEGIN PRIVATE KEY-----"), "PKCS#8");
        // rcgen reads its own output back as a P-256 key.
        let key = KeyPair::from_pem(&key).unwrap();
        assert_eq!(key.algorithm(), &rcgen::PKCS_ECDSA_P256_SHA256);

        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(&demo.key).unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "key not readable by others");
        }
    }

    #[test]
    fn certificates_verify_with_openssl() {
        if !openssl_available() {
            eprintln!("openssl not found; skipping");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let td = generate(tmp.path(), TD, &["workload/demo"]).unwrap();
        let ca = td.ca();
        let svid = td.svid("workload/demo");
        let ca = ca.to_str().unwrap();
        let cert = svid.cert.to_str().unwrap();

        let text = openssl(&["x509", "-noout", "-text", "-in", cert]);
        assert!(
            text.contains("URI:spiffe://dev.latchkey/workload/demo"),
            "{text}"
        );
        assert!(text.contains("DNS:localhost"), "{text}");
        assert!(text.contains("IP Address:127.0.0.1"), "{text}");
        assert!(text.contains("prime256v1"), "{text}");
        assert!(text.contains("Digital Signature"), "{text}");
        assert!(
            text.contains("TLS Web Server Authentication, TLS Web Client Authentication"),
            "{text}"
        );

        let ca_text = openssl(&["x509", "-noout", "-text", "-in", ca]);
        assert!(ca_text.contains("CA:TRUE"), "{ca_text}");
        assert!(ca_text.contains("Certificate Sign"), "{ca_text}");

        for purpose in ["sslserver", "sslclient"] {
            let out = openssl(&["verify", "-purpose", purpose, "-CAfile", ca, cert]);
            assert!(out.contains(": OK"), "{out}");
        }
        // The key belongs to the certificate.
        let cert_pub = openssl(&["x509", "-noout", "-pubkey", "-in", cert]);
        let key_pub = openssl(&["pkey", "-pubout", "-in", svid.key.to_str().unwrap()]);
        assert_eq!(cert_pub, key_pub);
    }

    #[test]
    fn rerun_reuses_ca_and_issues_only_missing() {
        let tmp = tempfile::tempdir().unwrap();
        let td = generate(tmp.path(), TD, &["workload/alice"]).unwrap();
        let ca_before = fs::read(td.ca()).unwrap();
        let alice_before = fs::read(td.svid("workload/alice").cert).unwrap();

        let td = generate(tmp.path(), TD, &["workload/alice", "workload/bob"]).unwrap();
        assert_eq!(fs::read(td.ca()).unwrap(), ca_before, "CA reused");
        assert_eq!(
            fs::read(td.svid("workload/alice").cert).unwrap(),
            alice_before,
            "existing SVID left alone"
        );
        let bob = td.svid("workload/bob");
        assert!(bob.cert.exists() && bob.key.exists());

        // A missing key means the SVID is reissued.
        fs::remove_file(td.svid("workload/alice").key).unwrap();
        let td = generate(tmp.path(), TD, &["workload/alice"]).unwrap();
        assert_ne!(
            fs::read(td.svid("workload/alice").cert).unwrap(),
            alice_before
        );

        if openssl_available() {
            let ca = td.ca();
            for name in ["workload/alice", "workload/bob"] {
                let cert = td.svid(name).cert;
                let out = openssl(&[
                    "verify",
                    "-CAfile",
                    ca.to_str().unwrap(),
                    cert.to_str().unwrap(),
                ]);
                assert!(
                    out.contains(": OK"),
                    "{name} chains to the reused CA: {out}"
                );
            }
        }
    }

    #[test]
    fn refuses_ca_of_another_trust_domain() {
        let tmp = tempfile::tempdir().unwrap();
        generate(tmp.path(), TD, &[]).unwrap();
        let err = generate(tmp.path(), "other.example", &["workload/demo"]).unwrap_err();
        assert!(matches!(err, DevCertError::CaMismatch { .. }), "{err}");
    }

    #[test]
    fn refuses_ca_with_foreign_key() {
        let tmp = tempfile::tempdir().unwrap();
        generate(tmp.path(), TD, &[]).unwrap();
        fs::write(
            tmp.path().join(CA_KEY),
            KeyPair::generate().unwrap().serialize_pem(),
        )
        .unwrap();
        let err = generate(tmp.path(), TD, &["workload/demo"]).unwrap_err();
        assert!(matches!(err, DevCertError::CaMismatch { .. }), "{err}");
    }

    #[test]
    fn rejects_names_that_escape_the_directory() {
        let tmp = tempfile::tempdir().unwrap();
        for bad in ["", "../x", "a//b", "/abs", "ca", "a b"] {
            let err = generate(tmp.path(), TD, &[bad]).unwrap_err();
            assert!(
                matches!(err, DevCertError::InvalidName { .. }),
                "{bad:?}: {err}"
            );
        }
        let err = generate(tmp.path(), "Bad TD", &[]).unwrap_err();
        assert!(matches!(err, DevCertError::InvalidTrustDomain { .. }));
    }
}
