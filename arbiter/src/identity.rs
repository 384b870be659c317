//! Who is calling: the SPIFFE ID behind every request.
//!
//! On a TLS connection the caller is the URI SAN of the client certificate
//! (the certificate chain is already verified against the trust bundle by
//! rustls; the SAN is parsed and validated as a SPIFFE ID here and must belong
//! to the configured trust domain). Only when that certificate is the
//! configured edge proxy's own identity does the arbiter take the caller from
//! the edge's identity header instead — the edge filter refuses whatever a
//! client sent and sets the verified one. That header counts only from the
//! initial request headers ([`channel`]: never from trailers, which tonic
//! would merge into metadata). Without TLS nothing is served, except in the
//! explicit insecure dev mode, where a header names the caller.
//! docs/security.md has the whole threat model.

pub mod channel;

use std::str::FromStr;

use spiffe::SpiffeId;
use tonic::Request;
use x509_parser::extensions::GeneralName;

use self::channel::{ForwardedIdentity, Named};
use crate::error::ArbiterError;

/// The header the edge proxy sets to the verified caller's SPIFFE ID.
pub const EDGE_IDENTITY_HEADER: &str = "x-latchkey-identity";
/// The header naming the caller in insecure dev mode only.
pub const DEV_IDENTITY_HEADER: &str = "x-latchkey-dev-identity";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The caller's SPIFFE ID, e.g. `spiffe://prod.example/ns/payments/sa/worker`.
    pub identity: String,
    /// Reached the arbiter on its own certificate (or in dev mode), not
    /// named by the edge.
    pub direct: bool,
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

    /// The identity a call acts for: the peer's SVID, or the caller the edge
    /// names. An edge peer that names nobody acts for nobody (its only call of
    /// its own is the grant-table refresh, see [`Self::is_edge_itself`]).
    pub fn caller<T>(&self, request: &Request<T>) -> Result<Caller, ArbiterError> {
        let forwarded = forwarded(request);
        match self {
            Self::InsecureDev { trust_domain } => {
                let raw = named(&forwarded.dev, DEV_IDENTITY_HEADER)?.ok_or_else(|| {
                    unauthenticated(format!(
                        "insecure dev mode: set the {DEV_IDENTITY_HEADER} header to your SPIFFE ID"
                    ))
                })?;
                Ok(Caller {
                    identity: parse_spiffe_id(raw, trust_domain)?,
                    direct: true,
                })
            }
            Self::Tls {
                trust_domain,
                edge_identity,
            } => {
                let peer = peer_svid(request, trust_domain)?;
                if edge_identity.as_deref() == Some(peer.as_str()) {
                    let vouched = named(&forwarded.edge, EDGE_IDENTITY_HEADER)?.ok_or_else(|| {
                        unauthenticated(format!(
                            "the edge proxy named no caller ({EDGE_IDENTITY_HEADER}); the edge acts only for the callers it names"
                        ))
                    })?;
                    let identity = parse_spiffe_id(vouched, trust_domain)?;
                    if identity == peer {
                        return Err(unauthenticated(
                            "the edge named itself as the caller; the edge acts only for its callers",
                        ));
                    }
                    return Ok(Caller {
                        identity,
                        direct: false,
                    });
                }
                // Only the edge may name a caller: anyone else who tries is
                // refused rather than silently taken as themselves.
                if !forwarded.edge.is_absent() {
                    return Err(unauthenticated(format!(
                        "{peer} sent {EDGE_IDENTITY_HEADER}; only the edge proxy may name a caller, and your certificate already names you: drop the header"
                    )));
                }
                Ok(Caller {
                    identity: peer,
                    direct: true,
                })
            }
        }
    }

    /// True when the peer is the edge acting on its own behalf: its SVID, with
    /// no caller named in the initial headers. Only the filter's own
    /// grant-table refresh (a call Envoy makes outside the filter chain) looks
    /// like this; every call the edge forwards names its caller.
    pub fn is_edge_itself<T>(&self, request: &Request<T>) -> bool {
        match self {
            Self::InsecureDev { .. } => false,
            Self::Tls {
                trust_domain,
                edge_identity: Some(edge),
            } => {
                forwarded(request).edge.is_absent()
                    && peer_svid(request, trust_domain).is_ok_and(|p| &p == edge)
            }
            Self::Tls { .. } => false,
        }
    }
}

/// The reserved headers the channel took from the initial headers; nothing
/// when the request did not pass the channel (then nothing was forwarded).
fn forwarded<T>(request: &Request<T>) -> ForwardedIdentity {
    request
        .extensions()
        .get::<ForwardedIdentity>()
        .cloned()
        .unwrap_or_default()
}

fn named<'a>(value: &'a Named, header: &str) -> Result<Option<&'a str>, ArbiterError> {
    match value {
        Named::Absent => Ok(None),
        Named::One(v) => Ok(Some(v)),
        Named::Invalid(why) => Err(unauthenticated(format!("the {header} header was {why}"))),
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

    fn with_forwarded(f: ForwardedIdentity) -> Request<()> {
        let mut req = Request::new(());
        req.extensions_mut().insert(f);
        req
    }

    #[test]
    fn dev_mode_takes_the_header_from_the_channel_and_tls_ignores_it() {
        let req = with_forwarded(ForwardedIdentity {
            dev: Named::One("spiffe://dev.latchkey/workload/a".into()),
            ..Default::default()
        });
        let dev = IdentitySource::InsecureDev {
            trust_domain: "dev.latchkey".into(),
        };
        assert_eq!(
            dev.caller(&req).ok().map(|c| c.identity),
            Some("spiffe://dev.latchkey/workload/a".to_string())
        );
        let tls = IdentitySource::Tls {
            trust_domain: "dev.latchkey".into(),
            edge_identity: None,
        };
        assert!(matches!(
            tls.caller(&req),
            Err(ArbiterError::Unauthenticated { .. })
        ));
    }

    /// Metadata is where tonic puts a unary request's trailers: an identity
    /// header there names nobody.
    #[test]
    fn metadata_alone_never_names_a_caller() {
        let mut req = Request::new(());
        for name in [DEV_IDENTITY_HEADER, EDGE_IDENTITY_HEADER] {
            req.metadata_mut().insert(
                name,
                "spiffe://dev.latchkey/latchkey/operator"
                    .parse()
                    .unwrap_or_else(|_| unreachable!()),
            );
        }
        let dev = IdentitySource::InsecureDev {
            trust_domain: "dev.latchkey".into(),
        };
        assert!(matches!(
            dev.caller(&req),
            Err(ArbiterError::Unauthenticated { .. })
        ));
        assert!(!dev.is_edge_itself(&req));
    }

    #[test]
    fn an_invalid_forwarded_header_is_refused() {
        let req = with_forwarded(ForwardedIdentity {
            dev: Named::Invalid("sent more than once"),
            ..Default::default()
        });
        let dev = IdentitySource::InsecureDev {
            trust_domain: "dev.latchkey".into(),
        };
        assert!(matches!(
            dev.caller(&req),
            Err(ArbiterError::Unauthenticated { .. })
        ));
    }
}
