//! Operator sign-in for force-release (ADR-20): verifies OIDC ID tokens.
//!
//! An operator's channel identity (an SVID listed as `[[operator]]`) says
//! which machine calls; the ID token says which person. A token counts when
//! its signature verifies against the provider's JWKS (found through
//! `<issuer>/.well-known/openid-configuration`), its `iss` and `aud` are the
//! configured ones, it has not expired, it carries the lock-operator role in
//! the configured claim and, when MFA is required, an `amr` naming a second
//! factor. The JWKS is cached and fetched again when a token names a key id
//! the cache does not know (a provider rotating its keys), at most once per
//! [`REFETCH_COOLDOWN`], so a caller cannot make the arbiter hammer the provider.
//!
//! No error, log line or `Debug` output ever contains a token.

use std::sync::Arc;
use std::time::{Duration, Instant};

use jsonwebtoken::jwk::{AlgorithmParameters, Jwk, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, Validation, decode, decode_header};
use serde::Deserialize;
use tokio::sync::Mutex;
use tracing::{info, warn};

/// The largest discovery document or key set read from the provider.
pub const MAX_PROVIDER_ANSWER: usize = 1024 * 1024;
/// How long the provider's sign-in endpoints are kept before they are read again.
pub const FLOW_ENDPOINTS_FOR: Duration = Duration::from_secs(300);
/// The shortest time between two JWKS fetches caused by unknown key ids.
pub const REFETCH_COOLDOWN: Duration = Duration::from_secs(10);
/// `--oidc-role-claim`'s default.
pub const DEFAULT_ROLE_CLAIM: &str = "roles";
/// `--oidc-role`'s default.
pub const DEFAULT_ROLE: &str = "lock-operator";
/// Clock skew allowed on `exp`, `nbf` and `iat` (`--oidc-leeway-seconds`).
pub const DEFAULT_LEEWAY: Duration = Duration::from_secs(30);
/// The largest `--oidc-leeway-seconds`: skew beyond minutes is a broken
/// clock, and the leeway keeps an expired token good for that long.
pub const MAX_LEEWAY: Duration = Duration::from_secs(300);

/// How old an ID token may be (`iat`) to request or approve, by default
/// (`--oidc-max-token-age-seconds`): a token copied from a screen, a log or
/// a shell history serves its finder only that long after the sign-in,
/// however long the provider made it live.
pub const DEFAULT_MAX_TOKEN_AGE: Duration = Duration::from_secs(15 * 60);

/// `amr` values (RFC 8176) that name a second factor or a factor stronger
/// than a password: one of them satisfies `--oidc-require-mfa`.
pub const MFA_METHODS: &[&str] = &[
    "mfa", "otp", "hwk", "swk", "sms", "tel", "fpt", "face", "iris", "retina", "vbm", "sc",
];

/// Signature algorithms accepted: asymmetric only (an `HS*` token would be
/// verified with a key anyone who can read the JWKS knows).
const ALGORITHMS: &[Algorithm] = &[
    Algorithm::RS256,
    Algorithm::RS384,
    Algorithm::RS512,
    Algorithm::PS256,
    Algorithm::PS384,
    Algorithm::PS512,
    Algorithm::ES256,
    Algorithm::ES384,
    Algorithm::EdDSA,
];

#[derive(Debug, Clone)]
pub struct OidcConfig {
    /// The provider's issuer URL, exactly as its tokens' `iss` says it.
    pub issuer: String,
    /// The `aud` the tokens must carry (the client id operators sign in with).
    pub audience: String,
    /// Where the roles are: a claim name, or a dotted path into nested
    /// objects (Keycloak: `realm_access.roles`).
    pub role_claim: String,
    /// The role that allows force-release.
    pub role: String,
    /// Require an `amr` value from [`MFA_METHODS`].
    pub require_mfa: bool,
    pub leeway: Duration,
    /// The oldest `iat` accepted (plus the leeway).
    pub max_age: Duration,
}

impl OidcConfig {
    pub fn new(issuer: String, audience: String) -> Self {
        Self {
            issuer,
            audience,
            role_claim: DEFAULT_ROLE_CLAIM.into(),
            role: DEFAULT_ROLE.into(),
            require_mfa: false,
            leeway: DEFAULT_LEEWAY,
            max_age: DEFAULT_MAX_TOKEN_AGE,
        }
    }

    /// The issuer must be https, except on a loopback address (a provider
    /// on the same machine, for dev and tests): over plain http anyone on
    /// the path could hand the arbiter their own signing keys.
    pub fn check(&self) -> Result<(), String> {
        if !safe_url(&self.issuer) {
            return Err(format!(
                "--oidc-issuer {:?} must be an https:// URL (plain http only on a loopback address), without a user or password",
                self.issuer
            ));
        }
        if self.audience.is_empty() {
            return Err("--oidc-audience is required with --oidc-issuer (the client id operators sign in with)".into());
        }
        if self.role_claim.is_empty() || self.role.is_empty() {
            return Err("--oidc-role-claim and --oidc-role must not be empty".into());
        }
        Ok(())
    }
}

/// Whether `url` may be trusted to reach the provider: https, or plain
/// http to a loopback address (a provider on the same machine), and no
/// user or password in it (`http://127.0.0.1:1@evil.example` is evil's).
pub fn safe_url(url: &str) -> bool {
    let Ok(parsed) = url::Url::parse(url) else {
        return false;
    };
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return false;
    }
    match parsed.scheme() {
        "https" => parsed.host().is_some(),
        "http" => match parsed.host() {
            Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
            Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
            Some(url::Host::Domain(d)) => d == "localhost",
            None => false,
        },
        _ => false,
    }
}

/// Why a token does not let its bearer force-release. Messages say what to
/// do, and never quote the token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OidcError {
    #[error(
        "no ID token: sign in with the OIDC provider and pass the ID token (latchctl: --id-token-file or LATCHKEY_ID_TOKEN)"
    )]
    Missing,
    #[error(
        "the ID token is not a well-formed signed JWT ({0}); pass the id_token your provider issued, not an access token"
    )]
    Malformed(String),
    #[error("the ID token's signature does not verify against the provider's keys; sign in again")]
    BadSignature,
    #[error("the ID token is signed with a key the provider does not publish; sign in again")]
    UnknownKey,
    #[error("the ID token has expired; sign in again")]
    Expired,
    #[error("the ID token was issued by another provider; sign in with {expected}")]
    WrongIssuer { expected: String },
    #[error("the ID token was issued for another client; sign in to client {expected:?}")]
    WrongAudience { expected: String },
    #[error("the ID token is not valid: {0}; sign in again")]
    Invalid(String),
    #[error(
        "the ID token was issued {age_minutes} min ago, and this arbiter accepts tokens at most {max_minutes} min old (--oidc-max-token-age-seconds); sign in again"
    )]
    TooOld { age_minutes: u64, max_minutes: u64 },
    #[error(
        "the signed-in user lacks the {role:?} role (claim {claim:?}); ask your identity administrators to grant it"
    )]
    NoRole { claim: String, role: String },
    #[error(
        "this arbiter requires multi-factor sign-in, and the ID token's amr names no second factor; sign in again with your second factor"
    )]
    NoMfa,
    #[error("cannot reach the OIDC provider: {0}; retry, or check --oidc-issuer")]
    Provider(#[source] ProviderError),
}

/// What went wrong asking the OIDC provider: the request and what failed,
/// in words, and the HTTP client's own error when it was one, whose source
/// chain says why (DNS, TLS, a refused connection) in the logs.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{detail}")]
pub struct ProviderError {
    detail: String,
    #[source]
    source: Option<Arc<reqwest::Error>>,
}

impl ProviderError {
    fn new(detail: impl Into<String>) -> Self {
        Self {
            detail: detail.into(),
            source: None,
        }
    }

    fn caused(detail: impl Into<String>, source: reqwest::Error) -> Self {
        Self {
            detail: detail.into(),
            source: Some(Arc::new(source)),
        }
    }
}

/// Equal when they say the same thing (the HTTP client's error has no
/// equality of its own).
impl PartialEq for ProviderError {
    fn eq(&self, other: &Self) -> bool {
        self.detail == other.detail
    }
}

impl Eq for ProviderError {}

/// Why an [`OidcVerifier`] could not be made.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The settings (the operator's flags) cannot work.
    #[error("{0}")]
    Config(String),
    #[error("cannot build the OIDC HTTP client: {0}")]
    HttpClient(#[source] reqwest::Error),
}

impl OidcError {
    /// The token was fine but its bearer may not do this.
    pub fn is_permission(&self) -> bool {
        matches!(self, Self::NoRole { .. } | Self::NoMfa)
    }
}

/// A person signed in with the provider, as their token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedIn {
    pub subject: String,
    pub issuer: String,
}

struct KeyCache {
    jwks_uri: Option<String>,
    keys: JwkSet,
    fetched: Option<Instant>,
}

/// Verifies ID tokens of one provider. Shared by every request.
pub struct OidcVerifier {
    config: OidcConfig,
    http: reqwest::Client,
    cache: Mutex<KeyCache>,
    /// The browser flow's endpoints, or the failure, and when either was
    /// had: apart from the keys, so a sign-in never waits on a token check.
    flow: Mutex<Option<(Result<FlowEndpoints, OidcError>, Instant)>>,
}

impl std::fmt::Debug for OidcVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OidcVerifier")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct Discovery {
    issuer: String,
    jwks_uri: String,
    /// Where a browser signs in (the console's authorization-code flow).
    #[serde(default)]
    authorization_endpoint: Option<String>,
    /// Where a sign-in's code is traded for its tokens.
    #[serde(default)]
    token_endpoint: Option<String>,
}

/// The provider's endpoints for a browser's sign-in (the authorization-code
/// flow), from its discovery document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowEndpoints {
    pub authorization: String,
    pub token: String,
}

impl OidcVerifier {
    pub fn new(config: OidcConfig) -> Result<Self, SetupError> {
        config.check().map_err(SetupError::Config)?;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(SetupError::HttpClient)?;
        Ok(Self {
            config,
            http,
            flow: Mutex::new(None),
            cache: Mutex::new(KeyCache {
                jwks_uri: None,
                keys: JwkSet { keys: Vec::new() },
                fetched: None,
            }),
        })
    }

    pub fn config(&self) -> &OidcConfig {
        &self.config
    }

    /// Verifies `token` and the claims force-release needs.
    pub async fn verify(&self, token: &str) -> Result<SignedIn, OidcError> {
        let (signed_in, claims) = self.verify_claims(token).await?;
        self.judge_role(&claims)?;
        Ok(signed_in)
    }

    /// Whether verified `claims` carry the operator role (and a second
    /// factor when the arbiter requires one).
    pub fn judge_role(&self, claims: &serde_json::Value) -> Result<(), OidcError> {
        if !has_role(claims, &self.config.role_claim, &self.config.role) {
            return Err(OidcError::NoRole {
                claim: self.config.role_claim.clone(),
                role: self.config.role.clone(),
            });
        }
        if self.config.require_mfa && !has_mfa(claims) {
            return Err(OidcError::NoMfa);
        }
        Ok(())
    }

    /// Verifies `token`'s signature, issuer, audience, expiry and age, and
    /// answers its claims without judging any role: the console signs in
    /// people who may only read.
    pub async fn verify_claims(
        &self,
        token: &str,
    ) -> Result<(SignedIn, serde_json::Value), OidcError> {
        let token = token.trim();
        if token.is_empty() {
            return Err(OidcError::Missing);
        }
        let header = decode_header(token).map_err(|e| OidcError::Malformed(kind_text(&e)))?;
        if !ALGORITHMS.contains(&header.alg) {
            return Err(OidcError::Malformed(format!(
                "algorithm {:?} is not accepted",
                header.alg
            )));
        }
        let keys = self.keys_for(header.kid.as_deref()).await?;
        let mut validation = Validation::new(header.alg);
        validation.set_issuer(&[self.config.issuer.as_str()]);
        validation.set_audience(&[self.config.audience.as_str()]);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        validation.validate_nbf = true;
        validation.leeway = self.config.leeway.as_secs();
        let mut last = OidcError::UnknownKey;
        for jwk in &keys {
            let Ok(key) = DecodingKey::from_jwk(jwk) else {
                continue;
            };
            match decode::<serde_json::Value>(token, &key, &validation) {
                Ok(data) => return self.judge(&data.claims).map(|s| (s, data.claims)),
                Err(e) => {
                    last = self.classify(&e);
                    // Anything but a signature that fails under this key is
                    // about the token itself: no other key changes it.
                    if !matches!(last, OidcError::BadSignature | OidcError::UnknownKey) {
                        return Err(last);
                    }
                }
            }
        }
        Err(last)
    }

    fn classify(&self, e: &jsonwebtoken::errors::Error) -> OidcError {
        use jsonwebtoken::errors::ErrorKind as K;
        match e.kind() {
            K::InvalidSignature => OidcError::BadSignature,
            K::InvalidAlgorithm | K::InvalidKeyFormat | K::InvalidRsaKey(_) => {
                OidcError::UnknownKey
            }
            K::ExpiredSignature => OidcError::Expired,
            K::InvalidIssuer => OidcError::WrongIssuer {
                expected: self.config.issuer.clone(),
            },
            K::InvalidAudience => OidcError::WrongAudience {
                expected: self.config.audience.clone(),
            },
            K::MissingRequiredClaim(c) => OidcError::Invalid(format!("no {c:?} claim")),
            K::ImmatureSignature => OidcError::Invalid("not valid yet (nbf)".into()),
            K::InvalidToken | K::Base64(_) | K::Json(_) | K::Utf8(_) => {
                OidcError::Malformed(kind_text(e))
            }
            _ => OidcError::Invalid(kind_text(e)),
        }
    }

    /// The claims beyond the signature: a subject, and an age.
    fn judge(&self, claims: &serde_json::Value) -> Result<SignedIn, OidcError> {
        let subject = claims
            .get("sub")
            .and_then(|s| s.as_str())
            .filter(|s| !s.is_empty())
            .ok_or_else(|| OidcError::Invalid("no \"sub\" claim".into()))?;
        // OIDC Core requires `iat` in an ID token.
        let issued = claims
            .get("iat")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| OidcError::Invalid("no \"iat\" (issued at) claim".into()))?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let leeway = self.config.leeway.as_secs();
        if issued > now.saturating_add(leeway) {
            return Err(OidcError::Invalid(
                "it was issued in the future (check the provider's and this host's clocks)".into(),
            ));
        }
        let age = now.saturating_sub(issued);
        if age > self.config.max_age.as_secs().saturating_add(leeway) {
            return Err(OidcError::TooOld {
                age_minutes: age / 60,
                max_minutes: self.config.max_age.as_secs() / 60,
            });
        }
        Ok(SignedIn {
            subject: subject.to_string(),
            issuer: self.config.issuer.clone(),
        })
    }

    /// The keys that may have signed a token with `kid` (every key when the
    /// token names none), fetching the JWKS when the cache is empty or does
    /// not know `kid`.
    async fn keys_for(&self, kid: Option<&str>) -> Result<Vec<Jwk>, OidcError> {
        let mut cache = self.cache.lock().await;
        let known = |cache: &KeyCache| match kid {
            Some(kid) => cache.keys.find(kid).is_some(),
            None => !cache.keys.keys.is_empty(),
        };
        let cooled = cache
            .fetched
            .is_none_or(|at| at.elapsed() >= REFETCH_COOLDOWN);
        if !known(&cache) && cooled {
            self.refresh(&mut cache).await?;
        }
        let keys: Vec<Jwk> = match kid {
            Some(kid) => cache.keys.find(kid).cloned().into_iter().collect(),
            None => cache.keys.keys.clone(),
        };
        if keys.is_empty() {
            return Err(OidcError::UnknownKey);
        }
        Ok(keys
            .into_iter()
            .filter(|k| !matches!(k.algorithm, AlgorithmParameters::OctetKey(_)))
            .collect())
    }

    /// The provider's authorization and token endpoints (its discovery
    /// document, read again after [`FLOW_ENDPOINTS_FOR`]): every sign-in
    /// asks, and nobody signed in yet must be able to make the arbiter
    /// fetch the document at will.
    pub async fn flow_endpoints(&self) -> Result<FlowEndpoints, OidcError> {
        let mut flow = self.flow.lock().await;
        if let Some((had, at)) = &*flow {
            let keep = match had {
                Ok(_) => FLOW_ENDPOINTS_FOR,
                Err(_) => REFETCH_COOLDOWN,
            };
            if at.elapsed() < keep {
                return had.clone();
            }
        }
        let read = self.read_flow_endpoints().await;
        *flow = Some((read.clone(), Instant::now()));
        read
    }

    async fn read_flow_endpoints(&self) -> Result<FlowEndpoints, OidcError> {
        let url = format!(
            "{}/.well-known/openid-configuration",
            self.config.issuer.trim_end_matches('/')
        );
        let found: Discovery = self.get_json(&url).await?;
        let wrong = |what: String| {
            OidcError::Provider(ProviderError::new(format!(
                "the discovery document at {url} {what}: the console's sign-in needs it"
            )))
        };
        if found.issuer != self.config.issuer {
            return Err(wrong(format!(
                "names issuer {:?}, not {:?}",
                found.issuer, self.config.issuer
            )));
        }
        let endpoint = |name: &str, value: Option<String>| match value {
            Some(v) if safe_url(&v) => Ok(v),
            Some(v) => Err(wrong(format!(
                "names {name} {v:?}, which is not https (or http on a loopback address)"
            ))),
            None => Err(wrong(format!("names no {name}"))),
        };
        Ok(FlowEndpoints {
            authorization: endpoint("authorization_endpoint", found.authorization_endpoint)?,
            token: endpoint("token_endpoint", found.token_endpoint)?,
        })
    }

    /// The HTTP client the verifier asks the provider with (5 s timeout,
    /// no redirects followed).
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    async fn refresh(&self, cache: &mut KeyCache) -> Result<(), OidcError> {
        cache.fetched = Some(Instant::now());
        let jwks_uri = match &cache.jwks_uri {
            Some(uri) => uri.clone(),
            None => {
                let url = format!(
                    "{}/.well-known/openid-configuration",
                    self.config.issuer.trim_end_matches('/')
                );
                let found: Discovery = self.get_json(&url).await?;
                if found.issuer != self.config.issuer {
                    return Err(OidcError::Provider(ProviderError::new(format!(
                        "the discovery document at {url} names issuer {:?}, not {:?}",
                        found.issuer, self.config.issuer
                    ))));
                }
                if !safe_url(&found.jwks_uri) {
                    return Err(OidcError::Provider(ProviderError::new(format!(
                        "the discovery document at {url} names jwks_uri {:?}, which is not https (or http on a loopback address): its keys could be anyone's",
                        found.jwks_uri
                    ))));
                }
                cache.jwks_uri = Some(found.jwks_uri.clone());
                found.jwks_uri
            }
        };
        let keys: JwkSet = self.get_json(&jwks_uri).await?;
        info!(jwks_uri = %jwks_uri, keys = keys.keys.len(), "fetched the OIDC provider's signing keys");
        cache.keys = keys;
        Ok(())
    }

    async fn get_json<T: for<'de> Deserialize<'de>>(&self, url: &str) -> Result<T, OidcError> {
        let response = self.http.get(url).send().await.map_err(|e| {
            // As an error: reqwest's message leaves out why (DNS, TLS, refused).
            warn!(
                url,
                error = &e as &dyn std::error::Error,
                "the OIDC provider did not answer"
            );
            OidcError::Provider(ProviderError::caused(format!("GET {url}: {e}"), e))
        })?;
        if !response.status().is_success() {
            return Err(OidcError::Provider(ProviderError::new(format!(
                "GET {url}: HTTP {}",
                response.status()
            ))));
        }
        let mut response = response;
        let mut body = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| OidcError::Provider(ProviderError::caused(format!("GET {url}: {e}"), e)))?
        {
            body.extend_from_slice(&chunk);
            if body.len() > MAX_PROVIDER_ANSWER {
                return Err(OidcError::Provider(ProviderError::new(format!(
                    "GET {url}: the answer is over {MAX_PROVIDER_ANSWER} bytes"
                ))));
            }
        }
        serde_json::from_slice(&body).map_err(|e| {
            OidcError::Provider(ProviderError::new(format!(
                "GET {url}: not the expected JSON ({e})"
            )))
        })
    }
}

/// The error's kind without anything from the token (jsonwebtoken's
/// messages do not quote input, but say it only by kind to be sure).
fn kind_text(e: &jsonwebtoken::errors::Error) -> String {
    use jsonwebtoken::errors::ErrorKind as K;
    match e.kind() {
        K::InvalidToken => "not three base64url parts".into(),
        K::Base64(_) => "bad base64url".into(),
        K::Json(_) => "bad JSON".into(),
        K::Utf8(_) => "bad UTF-8".into(),
        other => format!("{other:?}")
            .split(['(', '{'])
            .next()
            .unwrap_or("invalid")
            .trim()
            .to_string(),
    }
}

/// Whether the claim at `path` (dotted) is `role`, contains it (an array),
/// or lists it among space-separated words (a string).
pub fn has_role(claims: &serde_json::Value, path: &str, role: &str) -> bool {
    let mut at = claims;
    for part in path.split('.') {
        match at.get(part) {
            Some(next) => at = next,
            None => return false,
        }
    }
    match at {
        serde_json::Value::String(s) => s.split_whitespace().any(|r| r == role),
        serde_json::Value::Array(items) => items.iter().any(|r| r.as_str() == Some(role)),
        _ => false,
    }
}

/// Whether `amr` names a second factor.
pub fn has_mfa(claims: &serde_json::Value) -> bool {
    claims
        .get("amr")
        .and_then(|a| a.as_array())
        .is_some_and(|methods| {
            methods
                .iter()
                .filter_map(|m| m.as_str())
                .any(|m| MFA_METHODS.contains(&m))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn roles_are_found_in_arrays_strings_and_nested_claims() {
        let claims = json!({
            "roles": ["a", "lock-operator"],
            "scope": "x lock-operator",
            "realm_access": {"roles": ["lock-operator"]},
            "n": 3
        });
        assert!(has_role(&claims, "roles", "lock-operator"));
        assert!(has_role(&claims, "scope", "lock-operator"));
        assert!(has_role(&claims, "realm_access.roles", "lock-operator"));
        assert!(!has_role(&claims, "roles", "lock"));
        assert!(!has_role(&claims, "n", "3"));
        assert!(!has_role(&claims, "missing.roles", "lock-operator"));
    }

    #[test]
    fn mfa_needs_a_second_factor_in_amr() {
        assert!(has_mfa(&json!({"amr": ["pwd", "otp"]})));
        assert!(has_mfa(&json!({"amr": ["mfa"]})));
        assert!(!has_mfa(&json!({"amr": ["pwd"]})));
        assert!(!has_mfa(&json!({"amr": "otp"})));
        assert!(!has_mfa(&json!({})));
    }

    #[test]
    fn the_issuer_must_be_https_except_on_loopback() {
        let ok = |issuer: &str| OidcConfig::new(issuer.into(), "latchkey".into()).check();
        assert!(ok("https://sso.example.com/realms/ops").is_ok());
        assert!(ok("http://127.0.0.1:9400").is_ok());
        assert!(ok("http://localhost:9400/").is_ok());
        assert!(ok("http://sso.example.com").is_err());
        assert!(ok("http://127.0.0.1.evil.example").is_err());
        assert!(ok("http://localhost.evil.example").is_err());
        assert!(ok("http://127.0.0.1:1@evil.example").is_err());
        assert!(ok("https://user:pw@sso.example.com").is_err());
        assert!(ok("ftp://127.0.0.1").is_err());
        let err = OidcConfig::new("https://sso".into(), String::new())
            .check()
            .unwrap_err();
        assert!(err.contains("--oidc-audience"), "{err}");
    }

    #[test]
    fn a_token_is_accepted_only_shortly_after_its_sign_in() {
        let v =
            OidcVerifier::new(OidcConfig::new("http://127.0.0.1:1".into(), "a".into())).unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let claims = |iat: Option<u64>| {
            let mut c = json!({"sub": "alice", "roles": ["lock-operator"]});
            if let Some(iat) = iat {
                c["iat"] = json!(iat);
            }
            c
        };
        assert!(v.judge(&claims(Some(now - 60))).is_ok());
        // at the bound, with the leeway
        assert!(v.judge(&claims(Some(now - 15 * 60 - 20))).is_ok());
        let old = v.judge(&claims(Some(now - 3600))).unwrap_err();
        assert!(
            matches!(
                old,
                OidcError::TooOld {
                    max_minutes: 15,
                    ..
                }
            ),
            "{old:?}"
        );
        assert!(old.to_string().contains("sign in again"), "{old}");
        assert!(matches!(
            v.judge(&claims(None)),
            Err(OidcError::Invalid(m)) if m.contains("iat")
        ));
        assert!(matches!(
            v.judge(&claims(Some(now + 600))),
            Err(OidcError::Invalid(m)) if m.contains("future")
        ));
    }

    #[tokio::test]
    async fn garbage_and_symmetric_tokens_are_refused_before_any_fetch() {
        // Nothing listens on port 1: a fetch would be a Provider error.
        let v =
            OidcVerifier::new(OidcConfig::new("http://127.0.0.1:1".into(), "a".into())).unwrap();
        assert_eq!(v.verify("  ").await, Err(OidcError::Missing));
        let garbage = "not.a.token-at-all";
        let err = v.verify(garbage).await.unwrap_err();
        assert!(matches!(err, OidcError::Malformed(_)), "{err:?}");
        assert!(!err.to_string().contains(garbage), "{err}");
        // {"alg":"HS256","typ":"JWT"} . {"sub":"x"} . sig
        let hs = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiJ4In0.c2ln";
        let err = v.verify(hs).await.unwrap_err();
        assert!(err.to_string().contains("HS256"), "{err}");
    }

    /// Issue 32: a provider that cannot be reached keeps the HTTP client's
    /// error as the source, under the message operators already read.
    #[tokio::test]
    async fn an_unreachable_provider_keeps_the_http_clients_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let issuer = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        let v = OidcVerifier::new(OidcConfig::new(issuer.clone(), "a".into())).unwrap();
        // {"alg":"RS256","kid":"k"} . {"sub":"x"} . sig: fetches the keys.
        let rs = "eyJhbGciOiJSUzI1NiIsImtpZCI6ImsifQ.eyJzdWIiOiJ4In0.c2ln";
        let err = v.verify(rs).await.unwrap_err();
        assert!(matches!(err, OidcError::Provider(_)), "{err:?}");
        let message = err.to_string();
        assert!(
            message.starts_with(&format!(
                "cannot reach the OIDC provider: GET {issuer}/.well-known/openid-configuration: "
            )),
            "{message}"
        );
        let mut chain = Vec::new();
        let mut next = std::error::Error::source(&err);
        while let Some(e) = next {
            chain.push(e);
            next = e.source();
        }
        assert!(
            chain
                .iter()
                .any(|e| e.downcast_ref::<Arc<reqwest::Error>>().is_some()),
            "{err:?}"
        );
        assert!(
            chain
                .iter()
                .any(|e| e.downcast_ref::<std::io::Error>().is_some()),
            "the refused connection is at the bottom: {err:?}"
        );
    }
}
