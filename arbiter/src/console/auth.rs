//! Signing in to the console: OIDC's authorization-code flow with PKCE,
//! `state` and `nonce`, and a server-side session behind a random cookie.
//!
//! A sign-in in progress keeps nothing on the server: its state, nonce,
//! PKCE verifier and return path travel in a cookie the console MACs with
//! a key of its own (made at start), bound to the browser that began it.
//! Nobody can flood the console with sign-ins to push out someone else's,
//! nor sign a victim in to their own account (login CSRF), nor redeem a
//! callback URL seen elsewhere without that cookie.
//!
//! The ID token is verified by the same verifier force-release uses
//! (signature, issuer, audience, expiry, age), and its roles are judged
//! once, at sign-in: the viewer role reads, the operator role (with a
//! second factor when `--oidc-require-mfa`) acts. The token itself is not
//! kept; what acting needs is the subject and the time of sign-in, which
//! must be within `--oidc-max-token-age-seconds` as latchctl's token must.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use parking_lot::Mutex;
use serde::Deserialize;
use sha2::Digest;
use tracing::{info, warn};

use super::Console;
use super::pages::{self, Page};
use crate::oidc::{SignedIn, has_role};

/// The session cookie's name over http (loopback only) and over https,
/// where the `__Host-` prefix keeps sibling hosts from setting it.
pub(super) const COOKIE: &str = "latchkey_console";
pub(super) const SECURE_COOKIE: &str = "__Host-latchkey_console";
/// The sign-in in progress's cookie: over http for /callback only; over
/// https `__Host-` (whose rules want path /), so no sibling host sets it.
const LOGIN_COOKIE: &str = "latchkey_login";
const SECURE_LOGIN_COOKIE: &str = "__Host-latchkey_login";
/// Sign-ins finished in the last [`LOGIN_TTL`], remembered so that each
/// is traded at most once; past this many at once, sign-ins wait.
const MAX_SPENT: usize = 4096;
/// Codes traded with the provider at once (each a request carrying the
/// client secret): a flood of callbacks does not become one at the provider.
pub(super) const MAX_TRADES: usize = 4;
/// Page renders a signed-in session may ask for: a burst, then per second.
const RENDER_BURST: f64 = 20.0;
const RENDERS_PER_SECOND: f64 = 5.0;
/// A sign-in must come back within this long.
const LOGIN_TTL: Duration = Duration::from_secs(10 * 60);
/// Signed-in sessions at once, and per person (the oldest goes).
const MAX_SESSIONS: usize = 1024;
const MAX_SESSIONS_PER_SUBJECT: usize = 8;
/// The token endpoint's answer is read up to this size.
const MAX_TOKEN_ANSWER: usize = 64 * 1024;
/// A session lasts at most this long, and no longer than its ID token.
const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);

/// A person signed in to the console.
#[derive(Debug, Clone)]
pub(super) struct Who {
    pub signed_in: SignedIn,
    /// May request and approve force-releases (within the token age).
    pub operator: bool,
    /// The operator role was there but a required second factor was not.
    pub operator_without_mfa: bool,
    /// When they signed in (orders sessions for eviction).
    pub at: Instant,
    /// When the provider issued their ID token (Unix seconds): acting is
    /// allowed within `--oidc-max-token-age-seconds` of it, by the clock.
    pub issued_unix: u64,
    /// Sent with every form and compared on every POST.
    pub csrf: String,
    /// Their session's id (the cookie's value): live streams end with it.
    pub id: Arc<str>,
}

/// A sign-in in progress, as its cookie carries it.
#[derive(serde::Serialize, Deserialize)]
struct Login {
    state: String,
    nonce: String,
    verifier: String,
    next: String,
    /// When it began (Unix seconds).
    at: u64,
}

struct Session {
    who: Who,
    expires: Instant,
    /// Renders left, and when they were last counted.
    renders: (f64, Instant),
}

#[derive(Default)]
pub(super) struct Sessions {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    sessions: HashMap<Arc<str>, Session>,
    /// Sign-ins traded (their state), with when.
    spent: HashMap<String, Instant>,
}

impl Sessions {
    fn open(&self, who: Who, expires: Instant) {
        let mut inner = self.inner.lock();
        let now = Instant::now();
        inner.sessions.retain(|_, s| s.expires > now);
        let subject = who.signed_in.subject.clone();
        let theirs: Vec<(Arc<str>, Instant)> = inner
            .sessions
            .iter()
            .filter(|(_, s)| s.who.signed_in.subject == subject)
            .map(|(id, s)| (id.clone(), s.who.at))
            .collect();
        if theirs.len() >= MAX_SESSIONS_PER_SUBJECT
            && let Some((oldest, _)) = theirs.iter().min_by_key(|(_, at)| *at)
        {
            inner.sessions.remove(oldest);
        }
        if inner.sessions.len() >= MAX_SESSIONS
            && let Some(oldest) = inner
                .sessions
                .iter()
                .min_by_key(|(_, s)| s.who.at)
                .map(|(id, _)| id.clone())
        {
            inner.sessions.remove(&oldest);
        }
        inner.sessions.insert(
            who.id.clone(),
            Session {
                who,
                expires,
                renders: (RENDER_BURST, now),
            },
        );
    }

    /// Whether session `id` may have one more page rendered now (a
    /// scripted loop over keys would otherwise read etcd at will).
    pub(super) fn may_render(&self, id: &str) -> bool {
        let mut inner = self.inner.lock();
        let Some(s) = inner.sessions.get_mut(id) else {
            return false;
        };
        let (left, at) = &mut s.renders;
        let now = Instant::now();
        *left =
            (*left + now.duration_since(*at).as_secs_f64() * RENDERS_PER_SECOND).min(RENDER_BURST);
        *at = now;
        if *left < 1.0 {
            return false;
        }
        *left -= 1.0;
        true
    }

    /// Marks sign-in `state` traded; `false`: it was already, or too many
    /// sign-ins are finishing at once.
    fn spend(&self, state: &str) -> bool {
        let mut inner = self.inner.lock();
        if inner.spent.contains_key(state) {
            return false;
        }
        if inner.spent.len() >= MAX_SPENT {
            inner.spent.retain(|_, at| at.elapsed() < LOGIN_TTL);
            if inner.spent.len() >= MAX_SPENT {
                return false;
            }
        }
        inner.spent.insert(state.to_string(), Instant::now());
        true
    }

    /// The person behind `id`, while their session lasts.
    pub(super) fn get(&self, id: &str) -> Option<Who> {
        let inner = self.inner.lock();
        let s = inner.sessions.get(id)?;
        (s.expires > Instant::now()).then(|| s.who.clone())
    }

    fn close(&self, id: &str) {
        self.inner.lock().sessions.remove(id);
    }
}

/// The value of cookie `name`, if the request has exactly one (a second
/// one of the same name is someone else's doing: neither is trusted).
pub(super) fn cookie<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    let mut found = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .filter(|(n, _)| *n == name)
        .map(|(_, value)| value);
    let first = found.next()?;
    found.next().is_none().then_some(first)
}

/// Who is signed in, or the response that sends them to sign in.
pub(super) fn who(console: &Console, headers: &HeaderMap, next: &str) -> Result<Who, Response> {
    match cookie(headers, console.cookie).and_then(|id| console.sessions.get(id)) {
        Some(who) => Ok(who),
        None => Err(pages::redirect(&format!(
            "/login?next={}",
            pages::url_encode(next)
        ))),
    }
}

fn random_text(bytes: usize) -> Result<String, Response> {
    let mut buf = vec![0u8; bytes];
    getrandom::getrandom(&mut buf).map_err(|e| {
        pages::error_page(
            StatusCode::INTERNAL_SERVER_ERROR,
            "No randomness",
            &format!("the console cannot make a sign-in secret: {e}"),
        )
    })?;
    Ok(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(buf))
}

/// Where a sign-in may return to: a path of this console, never another site.
fn local_path(next: Option<&str>) -> String {
    match next {
        Some(p)
            if p.starts_with('/')
                && !p.starts_with("//")
                && !p.contains('\\')
                && p.len() <= 1024
                && p.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            p.to_string()
        }
        _ => "/keys".into(),
    }
}

#[derive(Deserialize)]
pub(super) struct LoginQuery {
    next: Option<String>,
}

/// Starts a sign-in: to the provider, with this sign-in's state, nonce
/// and PKCE challenge.
pub(super) async fn login(
    State(console): State<Arc<Console>>,
    Query(q): Query<LoginQuery>,
) -> Response {
    let flow = match console.verifier.flow_endpoints().await {
        Ok(flow) => flow,
        Err(e) => {
            return pages::error_page(
                StatusCode::BAD_GATEWAY,
                "Cannot sign in",
                &format!("the sign-in provider cannot be asked: {e}"),
            );
        }
    };
    let (state, nonce, verifier) = match (random_text(24), random_text(24), random_text(32)) {
        (Ok(s), Ok(n), Ok(v)) => (s, n, v),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return e,
    };
    let challenge = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(sha2::Sha256::digest(verifier.as_bytes()));
    let mut url = match url::Url::parse(&flow.authorization) {
        Ok(url) => url,
        Err(e) => {
            return pages::error_page(
                StatusCode::BAD_GATEWAY,
                "Cannot sign in",
                &format!("the provider's authorization_endpoint is not a URL: {e}"),
            );
        }
    };
    url.query_pairs_mut()
        .append_pair("response_type", "code")
        .append_pair("client_id", &console.client_id)
        .append_pair("redirect_uri", &console.redirect_uri())
        .append_pair("scope", "openid")
        .append_pair("state", &state)
        .append_pair("nonce", &nonce)
        .append_pair("code_challenge", &challenge)
        .append_pair("code_challenge_method", "S256");
    let login = Login {
        state,
        nonce,
        verifier,
        next: local_path(q.next.as_deref()),
        at: unix_now(),
    };
    let mut response = pages::redirect(url.as_str());
    let value = console.seal_login(&login);
    let (name, path) = console.login_cookie();
    console.set_cookie(&mut response, name, &value, path, Some(LOGIN_TTL.as_secs()));
    response
}

pub(super) fn unix_now() -> u64 {
    u64::try_from(crate::records::now_unix_ms() / 1000).unwrap_or(0)
}

#[derive(Deserialize)]
pub(super) struct Callback {
    code: Option<String>,
    state: Option<String>,
    error: Option<String>,
}

#[derive(Deserialize)]
struct TokenAnswer {
    id_token: Option<String>,
}

/// The provider sends the browser back here with a code: traded for the
/// ID token, which is verified and judged; a session opens only for a
/// person with the viewer or the operator role.
pub(super) async fn callback(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    Query(q): Query<Callback>,
) -> Response {
    let refused = |title: &str, detail: &str| {
        pages::error_page(StatusCode::FORBIDDEN, title, detail).into_response()
    };
    if let Some(error) = q.error.as_deref() {
        // Only the code, and only if it is one: the description is the
        // sender's text, on the console's page.
        let code: String = error
            .chars()
            .filter(|c| c.is_ascii_lowercase() || *c == '_')
            .take(64)
            .collect();
        return refused(
            "Sign-in refused",
            &format!(
                "the provider answered {code:?}: sign in again, or ask your identity administrators"
            ),
        );
    }
    let (Some(code), Some(state)) = (q.code.as_deref(), q.state.as_deref()) else {
        return refused(
            "Sign-in incomplete",
            "the provider's answer has no code or no state: sign in again",
        );
    };
    let login = cookie(&headers, console.login_cookie().0).and_then(|c| console.open_login(c));
    let Some(login) = login.filter(|l| {
        constant_time_eq(l.state.as_bytes(), state.as_bytes())
            && unix_now().saturating_sub(l.at) < LOGIN_TTL.as_secs()
    }) else {
        return refused(
            "Sign-in expired",
            "this sign-in was not started in this browser, or is older than 10 minutes: sign in again",
        );
    };
    if !console.sessions.spend(&login.state) {
        return refused(
            "Sign-in already used",
            "this sign-in was finished already (or too many are finishing at once): sign in again",
        );
    }
    // At most a few trades at once: a flood of callbacks waits here.
    let Ok(_trading) = tokio::time::timeout(Duration::from_secs(5), console.trades.acquire()).await
    else {
        return pages::error_page(
            StatusCode::SERVICE_UNAVAILABLE,
            "Busy",
            "too many sign-ins are finishing at once: sign in again in a moment",
        );
    };
    let id_token = match console.trade(code, &login.verifier).await {
        Ok(token) => token,
        Err(detail) => {
            warn!(%detail, "console sign-in: the code could not be traded for an ID token");
            return pages::error_page(StatusCode::BAD_GATEWAY, "Sign-in failed", &detail);
        }
    };
    let (signed_in, claims) = match console.verifier.verify_claims(&id_token).await {
        Ok(v) => v,
        Err(e) => {
            warn!("console sign-in refused: {e}");
            return refused("Sign-in refused", &e.to_string());
        }
    };
    if claims.get("nonce").and_then(|n| n.as_str()) != Some(login.nonce.as_str()) {
        warn!(subject = ?signed_in.subject, "console sign-in refused: the ID token's nonce is not this sign-in's");
        return refused(
            "Sign-in refused",
            "the ID token was not issued for this sign-in (its nonce differs): sign in again",
        );
    }
    let oidc = console.verifier.config();
    let operator_role = has_role(&claims, &oidc.role_claim, &oidc.role);
    let operator = console.verifier.judge_role(&claims).is_ok();
    let viewer = has_role(&claims, &oidc.role_claim, &console.viewer_role);
    if !operator && !operator_role && !viewer {
        warn!(subject = ?signed_in.subject, "console sign-in refused: neither the viewer nor the operator role");
        return refused(
            "Not allowed",
            &format!(
                "{} is signed in but has neither the {:?} role nor the {:?} role (claim {:?}): the console shows nothing without one. Ask your identity administrators.",
                signed_in.subject, console.viewer_role, oidc.role, oidc.role_claim
            ),
        );
    }
    let id: Arc<str> = match random_text(32) {
        Ok(id) => id.into(),
        Err(e) => return e,
    };
    let csrf = match random_text(24) {
        Ok(c) => c,
        Err(e) => return e,
    };
    let now = Instant::now();
    let unix = unix_now();
    let token_left = claims
        .get("exp")
        .and_then(serde_json::Value::as_u64)
        .map_or(Duration::ZERO, |exp| {
            Duration::from_secs(exp.saturating_sub(unix))
        });
    let expires = now + token_left.min(SESSION_TTL);
    // The sign-in counts from when the provider issued the token (acting
    // is bounded by the token's age, as latchctl's token is).
    let issued_ago = claims
        .get("iat")
        .and_then(serde_json::Value::as_u64)
        .map_or(Duration::ZERO, |iat| {
            Duration::from_secs(unix.saturating_sub(iat))
        });
    let at = now;
    let issued_unix = unix.saturating_sub(issued_ago.as_secs());
    info!(subject = ?signed_in.subject, operator, viewer, "signed in to the console");
    console.sessions.open(
        Who {
            signed_in,
            operator,
            operator_without_mfa: operator_role && !operator,
            at,
            issued_unix,
            csrf,
            id: id.clone(),
        },
        expires,
    );
    // A browser that was signed in as someone else is signed out of that.
    if let Some(old) = cookie(&headers, console.cookie) {
        console.sessions.close(old);
    }
    let mut response = pages::redirect(&login.next);
    console.set_cookie(&mut response, console.cookie, &id, "/", None);
    let (login_name, login_path) = console.login_cookie();
    console.set_cookie(&mut response, login_name, "", login_path, Some(0));
    response
}

#[derive(Deserialize)]
pub(super) struct LogoutForm {
    csrf: String,
}

pub(super) async fn logout(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    axum::Form(form): axum::Form<LogoutForm>,
) -> Response {
    let who = match who(&console, &headers, "/keys") {
        Ok(who) => who,
        Err(r) => return r,
    };
    if let Err(refused) = checked_form(&console, &headers, &who, &form.csrf) {
        return refused;
    }
    console.sessions.close(&who.id);
    let mut response = Page::plain(
        "Signed out",
        "<p>Signed out. <a href=\"/login\">Sign in again</a></p>",
    );
    console.set_cookie(&mut response, console.cookie, "", "/", Some(0));
    response
}

/// A POST is the signed-in person's own: its form carries their session's
/// CSRF secret, and a browser's Origin (when sent) is the console's.
pub(super) fn checked_form(
    console: &Console,
    headers: &HeaderMap,
    who: &Who,
    csrf: &str,
) -> Result<(), Response> {
    let forbidden = |detail: &str| Err(pages::error_page(StatusCode::FORBIDDEN, "Refused", detail));
    if let Some(origin) = headers.get(header::ORIGIN) {
        let own = console.origin();
        if origin.to_str().ok() != Some(own.as_str()) {
            return forbidden("the form was sent from another site: nothing was done");
        }
    }
    if !constant_time_eq(csrf.as_bytes(), who.csrf.as_bytes()) {
        return forbidden(
            "the form is not from your current console session (reload the page and try again): nothing was done",
        );
    }
    Ok(())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

impl Console {
    /// The sign-in cookie's name and path.
    fn login_cookie(&self) -> (&'static str, &'static str) {
        match self.secure {
            true => (SECURE_LOGIN_COOKIE, "/"),
            false => (LOGIN_COOKIE, "/callback"),
        }
    }

    /// Sets cookie `name` (HttpOnly, SameSite=Lax; Secure over https).
    fn set_cookie(
        &self,
        response: &mut Response,
        name: &str,
        value: &str,
        path: &str,
        max_age: Option<u64>,
    ) {
        let mut cookie = format!("{name}={value}; Path={path}; HttpOnly; SameSite=Lax");
        if self.secure {
            cookie.push_str("; Secure");
        }
        if let Some(age) = max_age {
            cookie.push_str(&format!("; Max-Age={age}"));
        }
        if let Ok(v) = HeaderValue::from_str(&cookie) {
            response.headers_mut().append(header::SET_COOKIE, v);
        }
    }

    /// A sign-in in progress as a cookie value: its JSON and the MAC of
    /// it under the console's key, both base64url.
    fn seal_login(&self, login: &Login) -> String {
        let payload = serde_json::to_vec(login).unwrap_or_default();
        let mac = latchkey_audit::pseudonym::hmac_sha256(&self.login_key, &payload);
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        format!("{}.{}", b64.encode(&payload), b64.encode(mac))
    }

    /// The sign-in a cookie carries, if its MAC is the console's.
    fn open_login(&self, value: &str) -> Option<Login> {
        let (payload, mac) = value.split_once('.')?;
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let payload = b64.decode(payload).ok()?;
        let mac = b64.decode(mac).ok()?;
        let expected = latchkey_audit::pseudonym::hmac_sha256(&self.login_key, &payload);
        if !constant_time_eq(&mac, &expected) {
            return None;
        }
        serde_json::from_slice(&payload).ok()
    }

    fn redirect_uri(&self) -> String {
        format!("{}/callback", self.base_url)
    }

    /// `scheme://host[:port]` of the base URL, as browsers send Origin.
    pub(super) fn origin(&self) -> String {
        match url::Url::parse(&self.base_url) {
            Ok(u) => u.origin().ascii_serialization(),
            Err(_) => self.base_url.clone(),
        }
    }

    /// Trades a sign-in's code for its ID token at the token endpoint.
    async fn trade(&self, code: &str, verifier: &str) -> Result<String, String> {
        let flow = self
            .verifier
            .flow_endpoints()
            .await
            .map_err(|e| e.to_string())?;
        let redirect_uri = self.redirect_uri();
        let mut form = vec![
            ("grant_type", "authorization_code"),
            ("code", code),
            ("redirect_uri", redirect_uri.as_str()),
            ("code_verifier", verifier),
        ];
        let mut request = self.verifier.http().post(&flow.token);
        match &self.client_secret {
            // RFC 6749 2.3.1: both form-encoded before Basic's base64.
            Some(secret) => {
                request = request.basic_auth(
                    pages::url_encode(&self.client_id),
                    Some(pages::url_encode(secret)),
                );
            }
            None => form.push(("client_id", self.client_id.as_str())),
        }
        let answer = request
            .form(&form)
            .send()
            .await
            .map_err(|e| format!("the provider's token endpoint did not answer: {e}"))?;
        let status = answer.status();
        if !status.is_success() {
            return Err(format!(
                "the provider's token endpoint refused the sign-in's code (HTTP {status}): sign in again"
            ));
        }
        let mut answer = answer;
        let mut bytes = Vec::new();
        while let Some(chunk) = answer
            .chunk()
            .await
            .map_err(|e| format!("the provider's token endpoint's answer broke off: {e}"))?
        {
            bytes.extend_from_slice(&chunk);
            if bytes.len() > MAX_TOKEN_ANSWER {
                return Err(format!(
                    "the provider's token endpoint answered more than {MAX_TOKEN_ANSWER} bytes"
                ));
            }
        }
        let body: TokenAnswer = serde_json::from_slice(&bytes)
            .map_err(|e| format!("the provider's token endpoint answered no JSON: {e}"))?;
        body.id_token.ok_or_else(|| {
            "the provider answered no id_token (is the openid scope allowed?)".into()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sign_in_returns_only_to_a_path_of_the_console() {
        assert_eq!(local_path(Some("/key?k=a%2Fb")), "/key?k=a%2Fb");
        for bad in [
            "//evil.example/x",
            "https://evil.example",
            "/\\evil",
            "keys",
            "/a b",
        ] {
            assert_eq!(local_path(Some(bad)), "/keys", "{bad}");
        }
        assert_eq!(local_path(None), "/keys");
    }

    #[test]
    fn the_cookie_is_found_among_others_and_only_alone() {
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            HeaderValue::from_static("a=1; latchkey_console=xyz; b=2"),
        );
        assert_eq!(cookie(&h, COOKIE), Some("xyz"));
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            HeaderValue::from_static("latchkey_consoleX=1"),
        );
        assert_eq!(cookie(&h, COOKIE), None);
        // a second one of the same name (tossed in by a sibling host): neither
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            HeaderValue::from_static("latchkey_console=evil; latchkey_console=xyz"),
        );
        assert_eq!(cookie(&h, COOKIE), None);
    }

    #[test]
    fn sessions_are_bounded_per_person() {
        let sessions = Sessions::default();
        let far = Instant::now() + Duration::from_secs(60);
        for i in 0..(MAX_SESSIONS_PER_SUBJECT + 3) {
            let who = Who {
                signed_in: SignedIn {
                    subject: "ana".into(),
                    issuer: "i".into(),
                },
                operator: false,
                operator_without_mfa: false,
                at: Instant::now(),
                issued_unix: 0,
                csrf: String::new(),
                id: format!("s{i}").into(),
            };
            sessions.open(who, far);
        }
        assert_eq!(
            sessions.inner.lock().sessions.len(),
            MAX_SESSIONS_PER_SUBJECT
        );
        assert!(sessions.get("s0").is_none(), "the oldest went");
        assert!(
            sessions
                .get(&format!("s{}", MAX_SESSIONS_PER_SUBJECT + 2))
                .is_some()
        );
    }
}
