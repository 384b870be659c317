//! Connecting to etcd: endpoints, TLS, login and the channel's options in
//! one [`Connection`], and one [`connect`] for the arbiter, the audit tailer
//! and the tests' harnesses.

use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};

use crate::Error;
use crate::failover::Failover;

/// How to reach one etcd cluster.
#[derive(Debug, Clone)]
pub struct Connection {
    pub endpoints: Vec<String>,
    /// TLS for `https://` endpoints (`None` for `http://`).
    pub tls: Option<TlsPem>,
    /// etcd username/password auth; the token is refreshed when it expires.
    pub login: Option<Login>,
    pub connect_timeout: Option<Duration>,
    /// A deadline on every call. `None` for a client whose watches must stay
    /// open (the audit tailer bounds its own reads instead).
    pub request_timeout: Option<Duration>,
    /// HTTP/2 keep-alive pings, so a member that stopped answering is
    /// noticed without a request to it timing out.
    pub keep_alive: Option<KeepAlive>,
    /// Refuse to be served by a member cut off from the quorum: it fails
    /// the call fast instead of serving a stale view or hanging.
    pub require_leader: bool,
    /// A unary call that could not connect to one member goes to another
    /// ([`crate::failover`]).
    pub failover: bool,
}

/// HTTP/2 keep-alive: a ping every `interval`, answered within `timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeepAlive {
    pub interval: Duration,
    pub timeout: Duration,
    /// Ping with no call in flight too.
    pub while_idle: bool,
}

impl Connection {
    /// `endpoints` as they are: no TLS, no login, no deadlines, no
    /// keep-alive, any member, no failover. A test's client; the services
    /// start from [`Self::service`].
    pub fn new(endpoints: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            tls: None,
            login: None,
            connect_timeout: None,
            request_timeout: None,
            keep_alive: None,
            require_leader: false,
            failover: false,
        }
    }

    /// How the arbiter and the audit tailer reach etcd: the leader required,
    /// and a keep-alive ping every 5 s answered within 3 s.
    pub fn service(
        endpoints: impl IntoIterator<Item = impl Into<String>>,
        connect_timeout: Duration,
    ) -> Self {
        Self {
            connect_timeout: Some(connect_timeout),
            keep_alive: Some(KeepAlive {
                interval: Duration::from_secs(5),
                timeout: Duration::from_secs(3),
                while_idle: false,
            }),
            require_leader: true,
            ..Self::new(endpoints)
        }
    }

    /// etcd-client's options for this connection. They hold the password in
    /// their `Debug` output: never log them.
    fn options(&self) -> ConnectOptions {
        let mut options = ConnectOptions::new();
        if self.require_leader {
            options = options.with_require_leader(true);
        }
        if let Some(timeout) = self.connect_timeout {
            options = options.with_connect_timeout(timeout);
        }
        if let Some(timeout) = self.request_timeout {
            options = options.with_timeout(timeout);
        }
        if let Some(k) = self.keep_alive {
            options = options.with_keep_alive(k.interval, k.timeout);
            if k.while_idle {
                options = options.with_keep_alive_while_idle(true);
            }
        }
        if let Some(tls) = &self.tls {
            // No domain_name: tonic verifies etcd's certificate against each
            // endpoint's own host, so every member is checked by its name.
            let mut tls_options = TlsOptions::new().ca_certificate(Certificate::from_pem(&tls.ca));
            if let Some((cert, key)) = &tls.identity {
                tls_options = tls_options.identity(Identity::from_pem(cert, key));
            }
            options = options.with_tls(tls_options);
        }
        if let Some(login) = &self.login {
            // Tokens expire (etcd's --auth-token-ttl); refresh rather than fail.
            options = options
                .with_user(login.name.clone(), login.password.clone())
                .with_auto_token_refresh(true);
        }
        options
    }
}

/// A client for `connection`. Balanced over its endpoints; with
/// [`Connection::failover`], a call that could not connect to one member
/// (down, restarting) goes to another.
pub async fn connect(connection: &Connection) -> Result<Client, Error> {
    let options = Some(connection.options());
    let endpoints = &connection.endpoints;
    let client = match connection.failover {
        true => Client::connect_with_balanced_channel(endpoints, options, Failover).await,
        false => Client::connect(endpoints, options).await,
    };
    Ok(client?)
}

/// etcd TLS material, already read from disk (PEM).
#[derive(Clone)]
pub struct TlsPem {
    /// Trust bundle for etcd's server certificate.
    pub ca: Vec<u8>,
    /// The client certificate chain and key.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

/// Sizes and presence only: the key must never reach a log.
impl std::fmt::Debug for TlsPem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsPem")
            .field("ca_bytes", &self.ca.len())
            .field("client_certificate", &self.identity.is_some())
            .finish()
    }
}

/// An etcd user and its password. `Debug` never shows the password, and
/// there is no `Display`.
#[derive(Clone)]
pub struct Login {
    pub name: String,
    password: String,
}

impl Login {
    pub fn new(name: impl Into<String>, password: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            password: password.into(),
        }
    }
}

impl std::fmt::Debug for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Login")
            .field("name", &self.name)
            .field("password", &"<redacted>")
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_secrets() {
        let connection = Connection {
            tls: Some(TlsPem {
                ca: b"ca".to_vec(),
                identity: Some((b"cert".to_vec(), b"PRIVATE KEY".to_vec())),
            }),
            login: Some(Login::new("arbiter", "hunter2")),
            ..Connection::service(["https://127.0.0.1:2379"], Duration::from_secs(1))
        };
        let shown = format!("{connection:?}");
        assert!(shown.contains("arbiter"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(!shown.contains("PRIVATE"), "{shown}");
    }

    #[tokio::test]
    async fn no_endpoints_is_refused_before_any_connection() {
        let refused = connect(&Connection::new(Vec::<String>::new())).await;
        assert!(refused.is_err_and(|e| e.kind() == crate::ErrorKind::Other));
    }
}
