//! The operator console (issue 36): who holds what, who waits, what
//! happened, and two-person force-release, in a browser.
//!
//! Served by the arbiter itself on `--console-listen` (plain HTTP: put it
//! behind the ingress's TLS, or keep it on loopback), from pages rendered
//! here and one small script of this crate's own (`console/assets`); nothing is
//! fetched from elsewhere at run time. Operators sign in with the OIDC
//! provider force-release already trusts (the authorization-code flow with
//! PKCE, state and nonce); the console keeps their session server-side
//! behind a random cookie. Everyone signed in with the viewer role reads;
//! only the operator role requests and approves force-releases, and only
//! within `--oidc-max-token-age-seconds` of signing in (as with latchctl).
//!
//! What it never shows: a fencing token, nor a revision (with the epoch,
//! one is a token); a holder's session id only to operators, as Inspect
//! allows. Everything a caller can make it keep is bounded: connections,
//! sign-ins in progress, signed-in sessions (in all and per person), and
//! live-update streams.

// Handlers answer a refusal as the response itself (`Result<_, Response>`),
// once per request: boxing it would only add an allocation.
#![allow(
    clippy::result_large_err,
    reason = "a refusal is the handler's whole answer, made once per request"
)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::Arbiter;
use crate::oidc::{OidcConfig, OidcVerifier};

mod assets;
mod auth;
mod listener;
mod live;
mod pages;
mod view;

/// The role that lets a signed-in person read the console.
pub const DEFAULT_VIEWER_ROLE: &str = "lock-viewer";
/// Connections the console serves at once (each costs a task and buffers).
pub const MAX_CONNECTIONS: usize = 256;
/// Largest form body accepted (a force-release reason is at most 512 bytes).
const MAX_BODY_BYTES: usize = 16 * 1024;

/// `--console-*`: where and how the console is served.
#[derive(Debug, Clone)]
pub struct ConsoleConfig {
    /// The address to listen on.
    pub listen: String,
    /// The URL browsers reach the console at (its sign-in redirect URI is
    /// `<url>/callback`); default `http://<listen>`.
    pub public_url: Option<String>,
    /// The OIDC client's secret, when the provider requires one (a
    /// confidential client); without it the console is a public client
    /// and PKCE alone binds the code to the sign-in.
    pub client_secret_file: Option<PathBuf>,
    /// The role (in `--oidc-role-claim`) that lets a person read.
    pub viewer_role: String,
    /// The audit store whose timeline the Key page shows (read-only user).
    pub audit_store: Option<String>,
    pub audit_store_password_file: Option<PathBuf>,
    /// Operators may request and approve force-releases in the console
    /// (`--console-force-release`): a sign-in with the operator role
    /// then acts without the operator SVID latchctl needs
    /// (docs/security.md, "The operator console"). Off: read-only.
    pub force_release: bool,
}

impl ConsoleConfig {
    pub fn new(listen: String) -> Self {
        Self {
            listen,
            public_url: None,
            client_secret_file: None,
            viewer_role: DEFAULT_VIEWER_ROLE.into(),
            audit_store: None,
            audit_store_password_file: None,
            force_release: false,
        }
    }
}

/// Why the console cannot start. Says which flag to fix.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    #[error(
        "--console-listen needs --oidc-issuer and --oidc-audience: operators sign in to the console with the provider force-release uses"
    )]
    NoOidc,
    #[error("cannot listen for the console on {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Config(String),
    #[error("cannot open the console's audit store {url}: {detail}")]
    AuditStore { url: String, detail: String },
}

/// Everything the console's handlers share.
pub(crate) struct Console {
    arbiter: Arc<Arbiter>,
    verifier: OidcVerifier,
    /// Browser-facing base URL, without a trailing slash.
    base_url: String,
    /// Its host and port, as browsers send them in `Host`.
    authority: String,
    /// Cookies marked `Secure` (the base URL is https).
    secure: bool,
    /// The session cookie's name (`__Host-` over https).
    cookie: &'static str,
    /// Signs the cookie of a sign-in in progress (made at start).
    login_key: [u8; 32],
    /// Force-releases may be requested and approved here.
    force_release: bool,
    client_id: String,
    client_secret: Option<String>,
    viewer_role: String,
    audit: Option<AuditSource>,
    sessions: auth::Sessions,
    streams: Arc<live::Streams>,
    holds: view::HoldsCache,
    /// Sign-in codes traded with the provider at once.
    trades: tokio::sync::Semaphore,
    stop: CancellationToken,
}

/// Binds the console's address (before the arbiter starts: a taken port
/// fails the start).
pub async fn bind(config: &ConsoleConfig) -> Result<TcpListener, ConsoleError> {
    TcpListener::bind(&config.listen)
        .await
        .map_err(|source| ConsoleError::Listen {
            addr: config.listen.clone(),
            source,
        })
}

/// Starts serving the console on `listener` until `stop`.
pub async fn start(
    listener: TcpListener,
    config: &ConsoleConfig,
    oidc: Option<&OidcConfig>,
    arbiter: Arc<Arbiter>,
    stop: CancellationToken,
    tasks: &TaskTracker,
) -> Result<(), ConsoleError> {
    let oidc = oidc.ok_or(ConsoleError::NoOidc)?;
    let addr = listener
        .local_addr()
        .map_err(|source| ConsoleError::Listen {
            addr: config.listen.clone(),
            source,
        })?;
    let base_url = match &config.public_url {
        Some(url) => url.trim_end_matches('/').to_string(),
        None => format!("http://{addr}"),
    };
    if !(base_url.starts_with("http://") || base_url.starts_with("https://")) {
        return Err(ConsoleError::Config(format!(
            "--console-url {base_url:?} must be an http:// or https:// URL (where browsers reach the console)"
        )));
    }
    let authority = match url::Url::parse(&base_url) {
        Ok(u) if matches!(u.path(), "" | "/") && u.query().is_none() && u.host().is_some() => {
            match u.port() {
                Some(port) => format!("{}:{port}", u.host_str().unwrap_or_default()),
                None => u.host_str().unwrap_or_default().to_string(),
            }
        }
        _ => {
            return Err(ConsoleError::Config(format!(
                "--console-url {base_url:?} must be a scheme and a host (and port), without a path: the console's pages and cookies are at its root"
            )));
        }
    };
    if !base_url.starts_with("https://") && !addr.ip().is_loopback() {
        return Err(ConsoleError::Config(format!(
            "--console-listen {addr} is not a loopback address and --console-url is not https: the console speaks plain HTTP, so put it behind TLS (your ingress) and give --console-url https://…, or listen on 127.0.0.1"
        )));
    }
    if config.viewer_role.trim().is_empty() {
        return Err(ConsoleError::Config(
            "--console-viewer-role must not be empty".into(),
        ));
    }
    let client_secret = match &config.client_secret_file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                ConsoleError::Config(format!(
                    "cannot read --console-client-secret-file {}: {e}",
                    path.display()
                ))
            })?;
            Some(text.trim().to_string())
        }
        None => None,
    };
    let verifier = OidcVerifier::new(oidc.clone())
        .map_err(|e| ConsoleError::Config(format!("console sign-in: {e}")))?;
    let audit = match &config.audit_store {
        Some(url) if latchkey_audit::store::url_password(url).is_some() => {
            return Err(ConsoleError::AuditStore {
                url: latchkey_audit::store::redact(url),
                detail: "the URL has a password: pass it in --console-audit-store-password-file"
                    .into(),
            });
        }
        Some(url) => Some(AuditSource {
            url: url.clone(),
            password_file: config.audit_store_password_file.clone(),
            store: tokio::sync::Mutex::new(None),
        }),
        None => None,
    };
    let mut login_key = [0u8; 32];
    getrandom::getrandom(&mut login_key)
        .map_err(|e| ConsoleError::Config(format!("no randomness for the console's key: {e}")))?;
    let secure = base_url.starts_with("https://");
    let console = Arc::new(Console {
        arbiter,
        verifier,
        secure,
        authority,
        cookie: if secure {
            auth::SECURE_COOKIE
        } else {
            auth::COOKIE
        },
        login_key,
        force_release: config.force_release,
        base_url,
        client_id: oidc.audience.clone(),
        client_secret,
        viewer_role: config.viewer_role.clone(),
        audit,
        sessions: auth::Sessions::default(),
        streams: Arc::default(),
        holds: view::HoldsCache::default(),
        trades: tokio::sync::Semaphore::new(auth::MAX_TRADES),
        stop: stop.clone(),
    });
    let app = router(console.clone());
    info!(%addr, url = %console.base_url, "serving the operator console");
    let listener = listener::Bounded::new(listener, MAX_CONNECTIONS);
    tasks.spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await;
        if let Err(e) = served {
            warn!(error = %e, "the console stopped");
        }
    });
    Ok(())
}

fn router(console: Arc<Console>) -> axum::Router {
    axum::Router::new()
        .route("/", get(|| async { pages::redirect("/keys") }))
        .route("/login", get(auth::login))
        .route("/callback", get(auth::callback))
        .route("/logout", post(auth::logout))
        .route("/keys", get(pages::keys))
        .route("/key", get(pages::key))
        .route("/hot", get(pages::hot))
        .route("/sessions", get(pages::sessions))
        .route("/elections", get(pages::elections))
        .route("/system", get(pages::system))
        .route("/force-release", get(pages::force_release))
        .route("/force-release/confirm", get(pages::confirm_force))
        .route("/force-release/request", post(pages::request_force))
        .route("/force-release/approve", post(pages::approve_force))
        .route("/live", get(live::stream))
        .route("/static/console.js", get(assets::script))
        .route("/static/console.css", get(assets::style))
        .fallback(pages::not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            console.clone(),
            only_our_host,
        ))
        .with_state(console)
}

/// The audit store, opened when first read and again after a failed
/// read: the console never keeps the arbiter from starting, nor from
/// serving, because the store is down.
pub(crate) struct AuditSource {
    url: String,
    password_file: Option<PathBuf>,
    store: tokio::sync::Mutex<Option<Arc<dyn latchkey_audit::AuditStore>>>,
}

impl AuditSource {
    async fn history(
        &self,
        query: &latchkey_audit::HistoryQuery,
    ) -> Result<Vec<latchkey_audit::StoredEvent>, String> {
        let store = {
            let mut open = self.store.lock().await;
            match &*open {
                Some(store) => store.clone(),
                None => {
                    let store: Arc<dyn latchkey_audit::AuditStore> =
                        open_audit(&self.url, self.password_file.as_deref())
                            .await
                            .map_err(|e| e.to_string())?
                            .into();
                    *open = Some(store.clone());
                    store
                }
            }
        };
        match store.history(query).await {
            Ok(events) => Ok(events),
            Err(e) => {
                *self.store.lock().await = None;
                Err(e.to_string())
            }
        }
    }
}

/// Refuses a request whose `Host` is not the console's own (`--console-url`):
/// a page reached by another name (DNS rebinding) must not be served, with
/// or without the person's cookies.
async fn only_our_host(
    axum::extract::State(console): axum::extract::State<Arc<Console>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let host = request
        .headers()
        .get(axum::http::header::HOST)
        .and_then(|h| h.to_str().ok());
    if host.is_some_and(|h| !h.eq_ignore_ascii_case(&console.authority)) {
        return pages::error_page(
            axum::http::StatusCode::MISDIRECTED_REQUEST,
            "Wrong address",
            &format!(
                "the console answers at {} only (--console-url)",
                console.base_url
            ),
        );
    }
    next.run(request).await
}

/// Opens the audit store to read (never with an audit key).
async fn open_audit(
    url: &str,
    password_file: Option<&std::path::Path>,
) -> Result<Box<dyn latchkey_audit::AuditStore>, ConsoleError> {
    let failed = |detail: String| ConsoleError::AuditStore {
        url: latchkey_audit::store::redact(url),
        detail,
    };
    if latchkey_audit::store::url_password(url).is_some() {
        return Err(failed(
            "the URL has a password: pass it in --console-audit-store-password-file".into(),
        ));
    }
    let password = match password_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| failed(format!("cannot read {}: {e}", path.display())))?
                .trim_end_matches('\n')
                .to_string(),
        ),
        None => None,
    };
    let options = latchkey_audit::StoreOptions {
        password,
        audit_key: None,
    };
    latchkey_audit::store::open_with(url, options)
        .await
        .map_err(|e| failed(e.to_string()))
}

/// How long ago `d` was, for people: `42 s`, `3 min 5 s`, `2 h 10 min`.
fn ago(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min {} s", s / 60, s % 60),
        3600..86_400 => format!("{} h {} min", s / 3600, s % 3600 / 60),
        _ => format!("{} d {} h", s / 86_400, s % 86_400 / 3600),
    }
}
