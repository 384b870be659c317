//! The caller's SPIFFE ID, from what Envoy says about the TLS peer.
//!
//! Envoy has already verified the client certificate chain against the trust
//! bundle and required a `spiffe://<trust domain>/` URI SAN (listener
//! validation context). The filter still validates the URI SAN as a SPIFFE ID
//! in the configured trust domain, and refuses anything else: a listener
//! misconfiguration must not turn into an unauthenticated caller.

use std::str::FromStr;

use spiffe::SpiffeId;
use thiserror::Error;

/// The header the edge sets to the verified caller's SPIFFE ID (and strips
/// from every client request first). The arbiter trusts it only from a peer
/// whose own SVID is the configured edge identity.
pub const IDENTITY_HEADER: &str = "x-latchkey-identity";

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum IdentityError {
    #[error("the connection is not mutual TLS")]
    NotMtls,
    #[error("the peer certificate has no URI SAN")]
    NoUriSan,
    #[error("the peer URI SAN is not a valid SPIFFE ID")]
    NotSpiffe,
    #[error("the peer SPIFFE ID is outside trust domain {trust_domain:?}")]
    WrongTrustDomain { trust_domain: String },
}

/// `mtls` is the `connection.mtls` property (one byte, 1 = mTLS); `uri_san`
/// is `connection.uri_san_peer_certificate`. Returns the canonical SPIFFE ID.
pub fn peer_identity(
    mtls: Option<&[u8]>,
    uri_san: Option<&[u8]>,
    trust_domain: &str,
) -> Result<String, IdentityError> {
    if mtls != Some(&[1u8][..]) {
        return Err(IdentityError::NotMtls);
    }
    identity_from_san(uri_san, trust_domain)
}

/// The caller's SPIFFE ID from `connection.uri_san_peer_certificate` alone:
/// what the filter reads on every request. Envoy derives that property from
/// the peer certificate of the TLS connection, so a non-empty value already
/// means a peer certificate was presented (all `connection.mtls` says) — and
/// the listener only accepts connections whose certificate chains to the
/// trust bundle with a `spiffe://<trust domain>/` URI SAN. The result depends
/// on `uri_san` and `trust_domain` only, so it may be cached by them.
pub fn identity_from_san(
    uri_san: Option<&[u8]>,
    trust_domain: &str,
) -> Result<String, IdentityError> {
    let raw = uri_san
        .filter(|s| !s.is_empty())
        .ok_or(IdentityError::NoUriSan)?;
    let raw = std::str::from_utf8(raw).map_err(|_| IdentityError::NotSpiffe)?;
    let id = SpiffeId::from_str(raw).map_err(|_| IdentityError::NotSpiffe)?;
    if id.trust_domain_name() != trust_domain {
        return Err(IdentityError::WrongTrustDomain {
            trust_domain: trust_domain.to_owned(),
        });
    }
    Ok(id.to_string())
}

/// Whether `trust_domain` is a valid SPIFFE trust domain name.
pub fn valid_trust_domain(trust_domain: &str) -> bool {
    SpiffeId::from_str(&format!("spiffe://{trust_domain}/x"))
        .map(|id| id.trust_domain_name() == trust_domain)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TD: &str = "dev.latchkey";

    #[test]
    fn a_valid_svid_in_the_trust_domain_is_the_caller() {
        assert_eq!(
            peer_identity(Some(&[1]), Some(b"spiffe://dev.latchkey/workload/a"), TD),
            Ok("spiffe://dev.latchkey/workload/a".to_string())
        );
    }

    #[test]
    fn everything_else_is_refused() {
        let ok = b"spiffe://dev.latchkey/workload/a".as_slice();
        assert_eq!(
            peer_identity(None, Some(ok), TD),
            Err(IdentityError::NotMtls)
        );
        assert_eq!(
            peer_identity(Some(&[0]), Some(ok), TD),
            Err(IdentityError::NotMtls)
        );
        assert_eq!(
            peer_identity(Some(&[1]), None, TD),
            Err(IdentityError::NoUriSan)
        );
        assert_eq!(
            peer_identity(Some(&[1]), Some(b""), TD),
            Err(IdentityError::NoUriSan)
        );
        for bad in [
            &b"https://dev.latchkey/a"[..],
            b"spiffe://dev.latchkey/a/../b",
            b"spiffe://dev.latchkey/",
            b"spiffe://dev.latchkey/a?x",
            b"\xff\xfe",
        ] {
            assert_eq!(
                peer_identity(Some(&[1]), Some(bad), TD),
                Err(IdentityError::NotSpiffe)
            );
        }
        assert!(matches!(
            peer_identity(Some(&[1]), Some(b"spiffe://other.td/workload/a"), TD),
            Err(IdentityError::WrongTrustDomain { .. })
        ));
    }

    #[test]
    fn the_san_alone_gives_the_same_answers_less_the_mtls_byte() {
        for san in [
            &b"spiffe://dev.latchkey/workload/a"[..],
            b"spiffe://dev.latchkey/a/../b",
            b"spiffe://other.td/workload/a",
            b"",
            b"\xff",
        ] {
            assert_eq!(
                identity_from_san(Some(san), TD),
                peer_identity(Some(&[1]), Some(san), TD)
            );
        }
        assert_eq!(identity_from_san(None, TD), Err(IdentityError::NoUriSan));
    }

    #[test]
    fn trust_domains_are_validated() {
        assert!(valid_trust_domain("dev.latchkey"));
        assert!(!valid_trust_domain("Dev Latchkey"));
        assert!(!valid_trust_domain(""));
    }
}
