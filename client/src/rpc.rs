//! The channel to the arbiter and the per-call metadata every request carries.

use std::time::Duration;

use latchkey_proto::adminv1::admin_client::AdminClient;
use latchkey_proto::lockv1::lock_client::LockClient;
use tonic::metadata::{AsciiMetadataValue, MetadataKey};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::config::ClientConfig;
use crate::error::Error;

/// The header that carries the caller's SPIFFE ID in dev mode.
pub const DEV_IDENTITY_HEADER: &str = "x-latchkey-dev-identity";

/// A cheap-to-clone handle: the channel multiplexes every call and stream.
#[derive(Clone, Debug)]
pub(crate) struct Rpc {
    channel: Channel,
    dev_identity: Option<AsciiMetadataValue>,
    request_timeout: Duration,
}

impl Rpc {
    pub(crate) async fn connect(config: &ClientConfig) -> Result<Self, Error> {
        let mut endpoint = Endpoint::from_shared(config.endpoint.clone())
            .map_err(|e| Error::Config {
                field: "endpoint",
                problem: format!("{:?} is not a URI: {e}", config.endpoint),
            })?
            .connect_timeout(config.connect_timeout)
            .tcp_nodelay(true);
        let https = config.endpoint.starts_with("https://");
        match &config.tls {
            Some(files) => {
                if !https {
                    return Err(Error::Config {
                        field: "endpoint",
                        problem: "TLS files were given, so the endpoint must be https://".into(),
                    });
                }
                let ca = read("CA bundle", &files.ca)?;
                let cert = read("SVID certificate", &files.cert)?;
                let key = read("SVID key", &files.key)?;
                let tls = ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(ca))
                    .identity(Identity::from_pem(cert, key))
                    .domain_name(config.tls_domain.as_deref().unwrap_or("localhost"));
                endpoint = endpoint
                    .tls_config(tls)
                    .map_err(|source| Error::Transport {
                        endpoint: config.endpoint.clone(),
                        source,
                    })?;
            }
            None => {
                if https {
                    return Err(Error::Config {
                        field: "endpoint",
                        problem: "dev mode speaks plain HTTP/2: use an http:// endpoint".into(),
                    });
                }
            }
        }
        let dev_identity =
            match (&config.tls, &config.dev_identity) {
                (None, Some(id)) => Some(AsciiMetadataValue::try_from(id.as_str()).map_err(
                    |_| Error::Config {
                        field: "dev_identity",
                        problem: "not a valid header value".into(),
                    },
                )?),
                _ => None,
            };
        let channel = endpoint
            .connect()
            .await
            .map_err(|source| Error::Transport {
                endpoint: config.endpoint.clone(),
                source,
            })?;
        Ok(Self {
            channel,
            dev_identity,
            request_timeout: config.request_timeout,
        })
    }

    pub(crate) fn lock(&self) -> LockClient<Channel> {
        LockClient::new(self.channel.clone())
    }

    pub(crate) fn admin(&self) -> AdminClient<Channel> {
        AdminClient::new(self.channel.clone())
    }

    /// A request with the dev identity and the default deadline.
    pub(crate) fn unary<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = self.stream(message);
        request.set_timeout(self.request_timeout);
        request
    }

    /// A request with the dev identity and no deadline (streams, waits).
    pub(crate) fn stream<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if let Some(id) = &self.dev_identity {
            request
                .metadata_mut()
                .insert(MetadataKey::from_static(DEV_IDENTITY_HEADER), id.clone());
        }
        request
    }
}

fn read(what: &'static str, path: &std::path::Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|source| Error::ReadFile {
        what,
        path: path.to_path_buf(),
        source,
    })
}
