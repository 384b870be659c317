//! A real OIDC provider for the force-release tests: PyPI's
//! `oidc-provider-mock` (installed by `scripts/setup`), started on a free
//! loopback port and killed on drop.
//!
//! It signs RS256 ID tokens with a key it publishes at `/jwks`, found
//! through `/.well-known/openid-configuration`, exactly as a production
//! provider does. Users and their claims are set with `PUT /users/<sub>`;
//! an ID token is had without a browser by driving the authorization-code
//! flow with plain HTTP: `POST /oauth2/authorize` with the form field `sub`
//! answers a redirect carrying the code, and `POST /oauth2/token` trades
//! the code for the tokens. Unregistered clients are accepted, so the client
//! id (the token's `aud`) is whatever the test asks for.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use tempfile::TempDir;

use crate::eventually;

const REDIRECT_URI: &str = "http://localhost/callback";

pub struct OidcProvider {
    child: Option<Child>,
    issuer: String,
    http: reqwest::Client,
    log: std::path::PathBuf,
    _dir: TempDir,
}

impl OidcProvider {
    /// A provider whose tokens live an hour.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_with(None).await
    }

    /// A provider whose ID tokens expire after `token_max_age` (whole seconds).
    pub async fn start_with(token_max_age: Option<Duration>) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("latchkey-oidc-")
            .tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let log = dir.path().join("provider.log");
        let out = std::fs::File::create(&log)?;
        let mut cmd = Command::new("python3");
        cmd.args(["-W", "ignore", "-m", "oidc_provider_mock"])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        if let Some(age) = token_max_age {
            cmd.args(["--token-max-age", &age.as_secs().max(1).to_string()]);
        }
        let child = cmd
            .spawn()
            .context("starting python3 -m oidc_provider_mock (run scripts/setup)")?;
        let provider = Self {
            child: Some(child),
            issuer: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .timeout(Duration::from_secs(10))
                .build()?,
            log,
            _dir: dir,
        };
        let url = format!("{}/.well-known/openid-configuration", provider.issuer);
        eventually(
            "the OIDC provider to answer",
            Duration::from_secs(30),
            || async {
                let r = provider.http.get(&url).send().await?;
                anyhow::ensure!(r.status().is_success(), "HTTP {}", r.status());
                Ok(())
            },
        )
        .await
        .with_context(|| {
            format!(
                "oidc-provider-mock did not start (is it installed? scripts/setup): {}",
                std::fs::read_to_string(&provider.log).unwrap_or_default()
            )
        })?;
        Ok(provider)
    }

    /// The issuer URL, as the provider's tokens name it.
    pub fn issuer(&self) -> &str {
        &self.issuer
    }

    /// Sets `sub`'s claims (replacing earlier ones); they go into every
    /// ID token issued to `sub` afterwards.
    pub async fn set_user(&self, sub: &str, claims: serde_json::Value) -> anyhow::Result<()> {
        let r = self
            .http
            .put(format!("{}/users/{sub}", self.issuer))
            .json(&claims)
            .send()
            .await?;
        if !r.status().is_success() {
            bail!("PUT /users/{sub}: HTTP {}", r.status());
        }
        Ok(())
    }

    /// An ID token for `sub`, issued to `client_id` (its `aud`), through the
    /// authorization-code flow.
    pub async fn id_token(&self, sub: &str, client_id: &str) -> anyhow::Result<String> {
        let r = self
            .http
            .post(format!("{}/oauth2/authorize", self.issuer))
            .query(&[
                ("client_id", client_id),
                ("redirect_uri", REDIRECT_URI),
                ("response_type", "code"),
                ("scope", "openid"),
            ])
            .form(&[("sub", sub)])
            .send()
            .await?;
        let location = r
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|l| l.to_str().ok())
            .with_context(|| format!("no redirect from /oauth2/authorize (HTTP {})", r.status()))?
            .to_string();
        let code = reqwest::Url::parse(&location)?
            .query_pairs()
            .find(|(k, _)| k == "code")
            .map(|(_, v)| v.into_owned())
            .with_context(|| format!("no code in the redirect to {location}"))?;
        let r = self
            .http
            .post(format!("{}/oauth2/token", self.issuer))
            .form(&[
                ("grant_type", "authorization_code"),
                ("code", code.as_str()),
                ("redirect_uri", REDIRECT_URI),
                ("client_id", client_id),
                ("client_secret", "unused"),
            ])
            .send()
            .await?;
        if !r.status().is_success() {
            bail!("POST /oauth2/token: HTTP {}", r.status());
        }
        let body: serde_json::Value = r.json().await?;
        body.get("id_token")
            .and_then(|t| t.as_str())
            .map(str::to_string)
            .context("no id_token in the token response")
    }
}

impl Drop for OidcProvider {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
