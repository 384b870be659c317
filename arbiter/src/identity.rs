//! Who is calling: the SPIFFE ID behind every request.
//!
//! On a TLS connection the caller is the URI SAN of the client certificate
//! (the certificate chain is already verified against the trust bundle by
//! rustls; the SAN is parsed and validated as a SPIFFE ID here and must belong
//! to the configured trust domain). Only when that certificate is the
//! configured edge proxy's own identity does the arbiter take the caller from
//! the edge's identity header instead — Envoy strips whatever a client sent
//! and sets the verified one. Without TLS nothing is served, except in the
//! explicit insecure dev mode, where a header names the caller.

use std::str::FromStr;

use spiffe::SpiffeId;
use tonic::Request;
use x509_parser::extensions::GeneralName;

use crate::error::ArbiterError;

/// The header the edge proxy sets to the verified caller's SPIFFE ID.
pub const EDGE_IDENTITY_HEADER: &str = "x-latchkey-identity";
/// The header naming the caller in insecure dev mode only.
pub const DEV_IDENTITY_HEADER: &str = "x-latchkey-dev-identity";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The caller's SPIFFE ID, e.g. `spiffe://prod.example/ns/payments/sa/worker`.
    pub identity: String,
}

#[derive(Debug, Clone)]
pub enum IdentitySource {
    /// mTLS: the peer certificate's SPIFFE ID; the edge may vouch for callers.
    Tls {
        trust_domain: String,
        edge_identity: Option<String>,
    },
    /// Insecure dev mode: the caller names itself in a header.
    InsecureDev { trust_domain: String },
}

fn unauthenticated(detail: impl Into<String>) -> ArbiterError {
    ArbiterError::Unauthenticated {
        detail: detail.into(),
    }
}

/// Validates a SPIFFE ID and its trust domain.
pub fn parse_spiffe_id(raw: &str, trust_domain: &str) -> Result<String, ArbiterError> {
    let id = SpiffeId::from_str(raw)
        .map_err(|e| unauthenticated(format!("{raw:?} is not a valid SPIFFE ID ({e})")))?;
    if id.trust_domain_name() != trust_domain {
        return Err(unauthenticated(format!(
            "SPIFFE ID {id} is not in trust domain {trust_domain:?}"
        )));
    }
    Ok(id.to_string())
}

/// The SPIFFE ID in a DER certificate's URI SAN (exactly one is allowed).
pub fn spiffe_id_of_certificate(der: &[u8], trust_domain: &str) -> Result<String, ArbiterError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| unauthenticated(format!("client certificate does not parse: {e}")))?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| unauthenticated(format!("client certificate SAN does not parse: {e}")))?
        .ok_or_else(|| unauthenticated("client certificate has no URI SAN (not an X.509 SVID)"))?;
    let uris: Vec<&str> = san
        .value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::URI(u) => Some(*u),
            _ => None,
        })
        .collect();
    match uris.as_slice() {
        [one] => parse_spiffe_id(one, trust_domain),
        [] => Err(unauthenticated(
            "client certificate has no URI SAN (not an X.509 SVID)",
        )),
        _ => Err(unauthenticated(
            "client certificate has more than one URI SAN; an X.509 SVID has exactly one",
        )),
    }
}

impl IdentitySource {
    pub fn trust_domain(&self) -> &str {
        match self {
            Self::Tls { trust_domain, .. } | Self::InsecureDev { trust_domain } => trust_domain,
        }
    }

    /// The peer itself (its own SVID), never an identity it vouches for.
    pub fn peer<T>(&self, request: &Request<T>) -> Result<Caller, ArbiterError> {
        match self {
            Self::InsecureDev { .. } => self.caller(request),
            Self::Tls { trust_domain, .. } => Ok(Caller {
                identity: peer_svid(request, trust_domain)?,
            }),
        }
    }

    pub fn is_edge(&self, identity: &str) -> bool {
        matches!(self, Self::Tls { edge_identity: Some(e), .. } if e == identity)
    }

    pub fn caller<T>(&self, request: &Request<T>) -> Result<Caller, ArbiterError> {
        match self {
            Self::InsecureDev { trust_domain } => {
                let raw = header(request, DEV_IDENTITY_HEADER).ok_or_else(|| {
                    unauthenticated(format!(
                        "insecure dev mode: set the {DEV_IDENTITY_HEADER} header to your SPIFFE ID"
                    ))
                })?;
                Ok(Caller {
                    identity: parse_spiffe_id(raw, trust_domain)?,
                })
            }
            Self::Tls {
                trust_domain,
                edge_identity,
            } => {
                let peer = peer_svid(request, trust_domain)?;
                if edge_identity.as_deref() == Some(peer.as_str()) {
                    let vouched = header(request, EDGE_IDENTITY_HEADER).ok_or_else(|| {
                        unauthenticated(format!(
                            "the edge proxy sent no {EDGE_IDENTITY_HEADER} header"
                        ))
                    })?;
                    return Ok(Caller {
                        identity: parse_spiffe_id(vouched, trust_domain)?,
                    });
                }
                // Any identity header from anyone but the edge is ignored.
                Ok(Caller { identity: peer })
            }
        }
    }
}

/// The SPIFFE ID of the connection's client certificate.
fn peer_svid<T>(request: &Request<T>, trust_domain: &str) -> Result<String, ArbiterError> {
    let certs = request
        .peer_certs()
        .ok_or_else(|| unauthenticated("no client certificate on the connection"))?;
    let leaf = certs
        .first()
        .ok_or_else(|| unauthenticated("no client certificate on the connection"))?;
    spiffe_id_of_certificate(leaf.as_ref(), trust_domain)
}

fn header<'a, T>(request: &'a Request<T>, name: &str) -> Option<&'a str> {
    request.metadata().get(name).and_then(|v| v.to_str().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spiffe_ids_are_validated_with_their_trust_domain() {
        assert_eq!(
            parse_spiffe_id("spiffe://dev.latchkey/workload/a", "dev.latchkey").ok(),
            Some("spiffe://dev.latchkey/workload/a".to_string())
        );
        assert!(parse_spiffe_id("spiffe://other/workload/a", "dev.latchkey").is_err());
        assert!(parse_spiffe_id("https://dev.latchkey/a", "dev.latchkey").is_err());
        assert!(parse_spiffe_id("spiffe://dev.latchkey/a/../b", "dev.latchkey").is_err());
    }

    #[test]
    fn dev_mode_takes_the_header_and_tls_ignores_it() {
        let mut req = Request::new(());
        req.metadata_mut().insert(
            DEV_IDENTITY_HEADER,
            "spiffe://dev.latchkey/workload/a"
                .parse()
                .unwrap_or_else(|_| unreachable!()),
        );
        let dev = IdentitySource::InsecureDev {
            trust_domain: "dev.latchkey".into(),
        };
        assert!(dev.caller(&req).is_ok());
        let tls = IdentitySource::Tls {
            trust_domain: "dev.latchkey".into(),
            edge_identity: None,
        };
        assert!(matches!(
            tls.caller(&req),
            Err(ArbiterError::Unauthenticated { .. })
        ));
    }
}
