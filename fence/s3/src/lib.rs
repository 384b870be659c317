//! The fence for S3-compatible object stores (issue 35): the record is an
//! object, its mark lives in the object's metadata
//! (`x-amz-meta-latchkey-fence`, [`Mark::to_hex`]'s 16 hex digits), and the
//! guarded write is a compare-and-swap on the object's ETag.
//!
//! [`FencedStore::guarded_write`] loops (docs/fencing-s3.md has the exact
//! requests):
//! 1. `HEAD` the object: its ETag and mark (missing → step 2 with
//!    `If-None-Match: *`; present without a readable mark →
//!    [`FenceError::Unfenced`], never overwritten);
//! 2. mark ≥ token → [`Guarded::FencedOut`]; nothing is written;
//! 3. `PUT` the new body and the token as the new mark with
//!    `If-Match: <that ETag>` (or `If-None-Match: *`);
//! 4. `200` → [`Guarded::Applied`]; `412 Precondition Failed` (or `404`: the
//!    object went away) → someone wrote in between: back to step 1;
//!    `409 ConditionalRequestConflict` → back to step 1 after a short jittered
//!    pause. After [`S3Config::attempts`] rounds → [`Guarded::Retry`].
//!
//! **Why the mark is also in the body.** A single-part S3 ETag is the MD5 of
//! the object's bytes: metadata is not part of it. If the body were the bare
//! payload, a later holder writing the *same bytes* with a higher mark would
//! leave the ETag unchanged, and an earlier holder's `If-Match` on that ETag
//! would still pass, overwriting the later write and lowering the mark (ABA).
//! So the body is `latchkey-fence/1 <mark>\n` followed by the payload: marks
//! only rise, so no two guarded writes produce the same bytes, and every one
//! changes the ETag. [`FencedStore::read`] strips that line and checks it
//! against the metadata.
//!
//! Tokens and marks are capabilities: no error, log line or `Debug` output
//! of this crate contains one; the store's error text is scrubbed with
//! [`latchkey_fence::redact`] before it is kept.

use std::fmt;
use std::time::{Duration, SystemTime};

use latchkey_fence::{BoxFuture, FenceError, FencedStore, Guarded, Mark, Record};
use reqwest::{Method, StatusCode, Url};

mod probe;
mod sigv4;

pub use probe::{NotHonoured, probe_conditional_writes};
pub use sigv4::Credentials;

/// The metadata header that carries the mark (`latchkey-fence` as a user
/// metadata key).
pub const MARK_HEADER: &str = "x-amz-meta-latchkey-fence";
/// The metadata header that counts the object's fenced writes (decimal;
/// missing: 0). An applied write's version ([`Guarded::Applied`]) is the
/// count it wrote: the conditional PUT makes one record's counts follow its
/// commit order.
pub const WRITES_HEADER: &str = "x-amz-meta-latchkey-writes";
/// The first line of every fenced object's body, before the mark's 16 hex
/// digits and a newline.
pub const BODY_PREFIX: &[u8] = b"latchkey-fence/1 ";
/// Rounds of HEAD + conditional PUT one guarded write tries before answering
/// [`Guarded::Retry`].
pub const DEFAULT_ATTEMPTS: usize = 8;
const STORE: &str = "s3";
const HEADER_LEN: usize = BODY_PREFIX.len() + 16 + 1;

/// Where the records live and how to sign for them.
#[derive(Debug, Clone)]
pub struct S3Config {
    /// `http(s)://host[:port]` of the S3 API (no path).
    pub endpoint: String,
    pub bucket: String,
    /// Prepended to every record name (`"fences/"`); may be empty.
    pub prefix: String,
    pub region: String,
    pub credentials: Credentials,
    /// `endpoint/bucket/key` (local servers) rather than `bucket.endpoint/key`.
    pub path_style: bool,
    pub attempts: usize,
    /// Per request.
    pub timeout: Duration,
}

/// What a `HEAD` tells about an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectHead {
    /// As the store sent it (quotes included).
    pub etag: String,
    /// The mark in its metadata; `None` when it has none (or an unreadable one).
    pub mark: Option<Mark>,
    /// Its write count ([`WRITES_HEADER`]); 0 when it has none, `None`
    /// when it has one that is not a count below 2^63 (foreign data: a
    /// guarded write refuses the object rather than reuse a version).
    pub writes: Option<u64>,
}

/// The precondition of one `PUT`.
#[derive(Debug, Clone, Copy)]
pub enum Precondition<'a> {
    None,
    /// `If-Match: <etag>`: only if the object's ETag is this one.
    IfMatch(&'a str),
    /// `If-None-Match: *`: only if no object exists.
    IfNoneMatch,
}

/// How the store answered one `PUT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PutReply {
    Written {
        etag: Option<String>,
    },
    /// `412`: the precondition did not hold.
    PreconditionFailed,
    /// `409` (AWS: `ConditionalRequestConflict`, a concurrent conditional write).
    Conflict,
    /// `404` to an `If-Match` PUT: the object is gone.
    NotFound,
}

/// How often a plain write re-reads an object that changed under it.
const PLAIN_ATTEMPTS: usize = 8;

/// A fenced record store on one bucket (and prefix) of an S3-compatible store.
pub struct S3Store {
    config: S3Config,
    base: Url,
    http: reqwest::Client,
}

impl fmt::Debug for S3Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Store")
            .field("endpoint", &self.config.endpoint)
            .field("bucket", &self.config.bucket)
            .field("prefix", &self.config.prefix)
            .finish_non_exhaustive()
    }
}

fn config_error(message: impl fmt::Display) -> FenceError {
    FenceError::store(STORE, "configuring", message, false, &[])
}

impl S3Store {
    pub fn new(config: S3Config) -> Result<Self, FenceError> {
        check_names(&config)?;
        let mut config = config;
        // A prefix names a "directory": `fences` and record `-x` must not
        // make `fences-x` (the hostile review).
        if !config.prefix.is_empty() && !config.prefix.ends_with('/') {
            config.prefix.push('/');
        }
        let mut base =
            Url::parse(&config.endpoint).map_err(|_| config_error("the endpoint is not a URL"))?;
        if !matches!(base.scheme(), "http" | "https") || base.host_str().is_none() {
            return Err(config_error("endpoint must be http(s)://host[:port]"));
        }
        // Credentials go by environment only; a query or fragment has no
        // place in an endpoint. Not echoed: it may hold a secret.
        if !base.username().is_empty()
            || base.password().is_some()
            || base.query().is_some()
            || base.fragment().is_some()
            || base.path() != "/"
        {
            return Err(config_error(
                "the endpoint must be http(s)://host[:port] without a path, user, password, query \
                 or fragment (credentials come from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)",
            ));
        }
        if !config.path_style {
            let host = format!("{}.{}", config.bucket, base.host_str().unwrap_or_default());
            base.set_host(Some(&host))
                .map_err(|e| config_error(format_args!("virtual-hosted bucket name: {e}")))?;
        }
        // No redirects: a 303 would turn a conditional PUT into a GET whose
        // 200 reads as "written" (the hostile review), and a redirect to
        // another host would carry the session token along.
        let http = reqwest::Client::builder()
            .timeout(config.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| config_error(format_args!("building the HTTP client: {e}")))?;
        Ok(Self { config, base, http })
    }

    /// A store from `s3://bucket[/prefix]?endpoint=http://127.0.0.1:9000&region=us-east-1`
    /// (optional: `path_style=true|false`, `attempts=N`). Credentials come
    /// from `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and optionally
    /// `AWS_SESSION_TOKEN`, never from the URL. Without `endpoint`: AWS
    /// (`https://s3.<region>.amazonaws.com`, virtual-hosted); with one:
    /// path-style unless `path_style=false`.
    pub fn from_url(url: &str) -> Result<Self, FenceError> {
        Self::new(config_from_url(url, |name| std::env::var(name).ok())?)
    }

    pub fn config(&self) -> &S3Config {
        &self.config
    }

    /// The object key of `record`.
    pub fn key(&self, record: &str) -> String {
        format!("{}{record}", self.config.prefix)
    }

    /// Creates the bucket; one that exists already (and is ours) is fine.
    pub async fn create_bucket(&self) -> Result<(), FenceError> {
        // Outside us-east-1, S3 wants the region named in the body.
        let body = if self.config.region == "us-east-1" {
            Vec::new()
        } else {
            format!(
                "<CreateBucketConfiguration xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">\
                 <LocationConstraint>{}</LocationConstraint></CreateBucketConfiguration>",
                self.config.region
            )
            .into_bytes()
        };
        let r = self
            .send(Method::PUT, None, &[], body, "creating the bucket", &[])
            .await?;
        match r.status.as_u16() {
            200 => Ok(()),
            409 if r.code() == Some("BucketAlreadyOwnedByYou") => Ok(()),
            _ => Err(r.error("creating the bucket", &[])),
        }
    }

    /// `HEAD` of `record`'s object, or `None` when it does not exist.
    pub async fn head(&self, record: &str) -> Result<Option<ObjectHead>, FenceError> {
        let r = self
            .send(Method::HEAD, Some(record), &[], Vec::new(), "HEAD", &[])
            .await?;
        match r.status.as_u16() {
            200 => {
                let etag = r
                    .etag
                    .clone()
                    .ok_or_else(|| r.error("HEAD answered without an ETag", &[]))?;
                Ok(Some(ObjectHead {
                    etag,
                    mark: r.mark.as_deref().and_then(Mark::from_hex),
                    writes: match r.writes.as_deref() {
                        None => Some(0),
                        // Digits only (`parse` would take "+5").
                        Some(w) if !w.is_empty() && w.bytes().all(|b| b.is_ascii_digit()) => {
                            w.parse::<u64>().ok().filter(|n| *n < 1 << 63)
                        }
                        Some(_) => None,
                    },
                }))
            }
            404 => Ok(None),
            _ => Err(r.error("HEAD", &[])),
        }
    }

    /// One `PUT` of a fenced body (`mark`'s line, then `payload`), `mark`
    /// and the write count `writes` in the metadata, under `precondition`.
    pub async fn put(
        &self,
        record: &str,
        precondition: Precondition<'_>,
        mark: Mark,
        writes: u64,
        payload: &[u8],
    ) -> Result<PutReply, FenceError> {
        let mut headers = vec![
            (MARK_HEADER.to_string(), mark.to_hex()),
            (WRITES_HEADER.to_string(), writes.to_string()),
        ];
        match precondition {
            Precondition::None => {}
            Precondition::IfMatch(etag) => headers.push(("if-match".into(), etag.into())),
            Precondition::IfNoneMatch => headers.push(("if-none-match".into(), "*".into())),
        }
        let secrets = [mark.get()];
        let r = self
            .send(
                Method::PUT,
                Some(record),
                &headers,
                fenced_body(mark, payload),
                "PUT",
                &secrets,
            )
            .await?;
        match r.status.as_u16() {
            200..=299 => Ok(PutReply::Written { etag: r.etag }),
            412 => Ok(PutReply::PreconditionFailed),
            409 => Ok(PutReply::Conflict),
            404 if matches!(precondition, Precondition::IfMatch(_)) => Ok(PutReply::NotFound),
            _ => Err(r.error("PUT", &secrets)),
        }
    }

    /// A `PUT` of `payload` as it is, without a mark or the fence line:
    /// what any other S3 client writes. Guarded writes refuse such objects
    /// ([`FenceError::Unfenced`]).
    pub async fn put_unfenced(&self, record: &str, payload: &[u8]) -> Result<(), FenceError> {
        let r = self
            .send(Method::PUT, Some(record), &[], payload.to_vec(), "PUT", &[])
            .await?;
        match r.status.as_u16() {
            200..=299 => Ok(()),
            _ => Err(r.error("PUT", &[])),
        }
    }

    /// `DELETE` of `record`'s object (unconditional; missing is fine).
    pub async fn delete(&self, record: &str) -> Result<(), FenceError> {
        let r = self
            .send(Method::DELETE, Some(record), &[], Vec::new(), "DELETE", &[])
            .await?;
        match r.status.as_u16() {
            200..=299 | 404 => Ok(()),
            _ => Err(r.error("DELETE", &[])),
        }
    }

    async fn guarded(
        &self,
        record: &str,
        token: u64,
        payload: &[u8],
    ) -> Result<Guarded, FenceError> {
        let new_mark = Mark::new(token);
        for attempt in 0..self.config.attempts.max(1) {
            let head = self.head(record).await?;
            let (etag, writes) = match &head {
                None => (None, 0),
                Some(h) => {
                    let mark = h.mark.ok_or_else(|| unfenced(record, "no readable mark"))?;
                    if mark >= new_mark {
                        return Ok(Guarded::FencedOut { mark });
                    }
                    let writes = h.writes.ok_or_else(|| FenceError::Unfenced {
                        store: STORE,
                        record: record.to_string(),
                        why: format!(
                            "{WRITES_HEADER} is not a write count; refusing to overwrite an object \
                             no fence wrote"
                        ),
                    })?;
                    (Some(h.etag.as_str()), writes)
                }
            };
            let precondition = etag.map_or(Precondition::IfNoneMatch, Precondition::IfMatch);
            let version = writes.saturating_add(1);
            match self
                .put(record, precondition, new_mark, version, payload)
                .await?
            {
                PutReply::Written { .. } => return Ok(Guarded::Applied { version }),
                // Another writer changed (or removed) the object since the
                // HEAD: read again and decide again.
                PutReply::PreconditionFailed | PutReply::NotFound => {}
                PutReply::Conflict => {
                    let ms = 5 * (attempt as u64 + 1) + fastrand::u64(0..10);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
            }
        }
        Ok(Guarded::Retry)
    }

    async fn read_record(&self, record: &str) -> Result<Option<Record>, FenceError> {
        let r = self
            .send(Method::GET, Some(record), &[], Vec::new(), "GET", &[])
            .await?;
        match r.status.as_u16() {
            200 => {}
            404 => return Ok(None),
            _ => return Err(r.error("GET", &[])),
        }
        let mark = r
            .mark
            .as_deref()
            .and_then(Mark::from_hex)
            .ok_or_else(|| unfenced(record, "no readable mark"))?;
        let payload = split_body(mark, &r.body).ok_or_else(|| {
            unfenced(
                record,
                "its body does not begin with the fence line its metadata names \
                 (written by something other than this fence)",
            )
        })?;
        Ok(Some(Record {
            mark,
            payload: payload.to_vec(),
        }))
    }

    async fn plain(&self, record: &str, payload: &[u8]) -> Result<(), FenceError> {
        // What a naive writer does: no fence, but the record's mark kept as
        // it is. The PUT is conditional on the object the HEAD saw, so a
        // guarded write that landed in between is never undone (an
        // unconditional PUT would write the older mark back, and a stale
        // holder's guarded write could then land: the hostile review).
        for _ in 0..PLAIN_ATTEMPTS {
            let head = self.head(record).await?;
            let (precondition, mark, writes) = match &head {
                None => (Precondition::IfNoneMatch, Mark::new(0), 0),
                Some(h) => (
                    Precondition::IfMatch(&h.etag),
                    h.mark.ok_or_else(|| unfenced(record, "no readable mark"))?,
                    h.writes.unwrap_or(0),
                ),
            };
            match self
                .put(
                    record,
                    precondition,
                    mark,
                    writes.saturating_add(1),
                    payload,
                )
                .await?
            {
                PutReply::Written { .. } => return Ok(()),
                PutReply::PreconditionFailed | PutReply::NotFound | PutReply::Conflict => continue,
            }
        }
        Err(FenceError::store(
            STORE,
            "plain PUT",
            format_args!(
                "the object changed under each of {PLAIN_ATTEMPTS} attempts; nothing was written"
            ),
            true,
            &[],
        ))
    }

    async fn send(
        &self,
        method: Method,
        record: Option<&str>,
        extra: &[(String, String)],
        body: Vec<u8>,
        op: &'static str,
        secrets: &[u64],
    ) -> Result<Reply, FenceError> {
        let mut path = self.base.path().trim_end_matches('/').to_string();
        if self.config.path_style {
            path.push('/');
            path.push_str(&sigv4::uri_encode(&self.config.bucket, false));
        }
        path.push('/');
        if let Some(record) = record {
            check_record(record)?;
            path.push_str(&sigv4::uri_encode(&self.key(record), true));
        }
        let mut url = self.base.clone();
        url.set_path(&path);
        let host = match (url.host_str(), url.port()) {
            (Some(h), Some(p)) => format!("{h}:{p}"),
            (Some(h), None) => h.to_string(),
            (None, _) => return Err(config_error("endpoint has no host")),
        };
        let payload_sha = sigv4::sha256_hex(&body);
        let amz_date = sigv4::amz_date(SystemTime::now());
        let mut headers = vec![
            ("host".to_string(), host),
            ("x-amz-content-sha256".to_string(), payload_sha.clone()),
            ("x-amz-date".to_string(), amz_date.clone()),
        ];
        if !body.is_empty() {
            headers.push(("content-type".into(), "application/octet-stream".into()));
        }
        if let Some(token) = &self.config.credentials.session_token {
            headers.push(("x-amz-security-token".into(), token.clone()));
        }
        headers.extend(extra.iter().cloned());
        let authorization = sigv4::authorization(
            &self.config.credentials,
            &sigv4::Signing {
                method: method.as_str(),
                canonical_uri: url.path(),
                canonical_query: "",
                headers: &headers,
                payload_sha256: &payload_sha,
                amz_date: &amz_date,
                region: &self.config.region,
                service: "s3",
            },
        );
        let mut req = self.http.request(method, url.clone());
        for (name, value) in headers.iter().filter(|(n, _)| n != "host") {
            req = req.header(name.as_str(), value.as_str());
        }
        let resp = req
            .header("authorization", authorization)
            .body(body)
            .send()
            .await
            .map_err(|e| transport_error(op, &e, secrets))?;
        let status = resp.status();
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let etag = header("etag");
        let mark = header(MARK_HEADER);
        let writes = header(WRITES_HEADER);
        let body = resp
            .bytes()
            .await
            .map_err(|e| transport_error(op, &e, secrets))?;
        Ok(Reply {
            status,
            etag,
            mark,
            writes,
            body: body.to_vec(),
        })
    }
}

fn transport_error(op: &'static str, e: &reqwest::Error, secrets: &[u64]) -> FenceError {
    // reqwest's own text leads with the URL; the kind and the chain of
    // causes are what help.
    let mut message = if e.is_timeout() {
        "timed out".to_string()
    } else if e.is_connect() {
        "cannot connect".to_string()
    } else {
        "request failed".to_string()
    };
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    FenceError::store(STORE, op, message, true, secrets)
}

struct Reply {
    status: StatusCode,
    etag: Option<String>,
    mark: Option<String>,
    writes: Option<String>,
    body: Vec<u8>,
}

impl Reply {
    /// The S3 error code (`<Code>` of the XML error body), if any.
    fn code(&self) -> Option<&str> {
        xml_field(&self.body, "Code")
    }

    fn error(&self, op: &'static str, secrets: &[u64]) -> FenceError {
        let status = self.status.as_u16();
        let mut message = format!("HTTP {status}");
        if let Some(code) = self.code() {
            message.push_str(&format!(" {code}"));
        }
        if let Some(text) = xml_field(&self.body, "Message") {
            message.push_str(&format!(": {text}"));
        }
        // Throttling and server-side trouble may pass; refusals do not.
        let transient = status >= 500 || status == 429 || status == 408;
        FenceError::store(STORE, op, message, transient, secrets)
    }
}

fn xml_field<'a>(body: &'a [u8], tag: &str) -> Option<&'a str> {
    let text = std::str::from_utf8(body).ok()?;
    let open = format!("<{tag}>");
    let start = text.find(&open)? + open.len();
    let len = text.get(start..)?.find(&format!("</{tag}>"))?;
    text.get(start..start + len)
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

/// The bucket, region and prefix become parts of the request's host and
/// path (`s3.<region>.amazonaws.com`, `<bucket>.<host>`): anything but the
/// characters those names use is refused, so that no name can move a
/// signed request to another host or outside the prefix (the hostile
/// review: a region of `x.evil.example/` named the host).
fn check_names(config: &S3Config) -> Result<(), FenceError> {
    let bucket = &config.bucket;
    if bucket.is_empty()
        || bucket.len() > 63
        || !bucket
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
    {
        return Err(config_error(
            "the bucket name must be 1 to 63 letters, digits, '.', '-' or '_'",
        ));
    }
    let region = &config.region;
    if region.is_empty()
        || region.len() > 32
        || !region
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(config_error(
            "the region must be 1 to 32 lower-case letters, digits or '-' (e.g. us-east-1)",
        ));
    }
    let prefix = config.prefix.trim_end_matches('/');
    if !prefix.is_empty() {
        check_record(prefix).map_err(|_| {
            config_error(
                "the prefix is limited to letters, digits, '-', '_', '.', '~', '/' and spaces, \
                 without empty, . or .. segments",
            )
        })?;
        if prefix.split('/').any(str::is_empty) || config.prefix.starts_with('/') {
            return Err(config_error("the prefix has an empty segment ('//')"));
        }
    }
    Ok(())
}

/// Record names become object keys under the prefix: empty names and `.`
/// or `..` segments (which HTTP clients resolve, leaving the prefix) are
/// refused.
fn check_record(record: &str) -> Result<(), FenceError> {
    // SigV4 canonicalises reserved characters (`:`, `=`, `&`, ...) in a
    // key differently across S3-compatible servers (moto refuses our
    // AWS-style encoding of them with 403): names are kept to characters
    // every server agrees on, and anything else is refused before a request.
    if let Some(c) = record
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '~' | '/' | ' ')))
    {
        return Err(FenceError::store(
            STORE,
            "naming the object",
            format_args!(
                "record name {record:?} has {c:?}: S3 record names are limited to letters, \
                 digits, '-', '_', '.', '~', '/' and spaces (choose another name, e.g. \
                 `latchctl pause-test --row`)"
            ),
            false,
            &[],
        ));
    }
    if record.is_empty() || record.split('/').any(|seg| seg == "." || seg == "..") {
        return Err(FenceError::store(
            STORE,
            "naming the object",
            format_args!("record name {record:?} is empty or has a . or .. segment"),
            false,
            &[],
        ));
    }
    Ok(())
}

fn unfenced(record: &str, why: &str) -> FenceError {
    FenceError::Unfenced {
        store: STORE,
        record: record.to_string(),
        why: format!("{why} in {MARK_HEADER}; refusing to overwrite an object no fence wrote"),
    }
}

/// The stored bytes of a fenced write: the fence line, then the payload.
pub fn fenced_body(mark: Mark, payload: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(HEADER_LEN + payload.len());
    body.extend_from_slice(BODY_PREFIX);
    body.extend_from_slice(mark.to_hex().as_bytes());
    body.push(b'\n');
    body.extend_from_slice(payload);
    body
}

/// The payload of a fenced body written with `mark`, or `None` when the body
/// does not carry that mark's line.
fn split_body(mark: Mark, body: &[u8]) -> Option<&[u8]> {
    let header = fenced_body(mark, b"");
    body.strip_prefix(header.as_slice())
}

/// [`S3Store::from_url`] with the environment as `env`.
pub fn config_from_url(
    url: &str,
    env: impl Fn(&str) -> Option<String>,
) -> Result<S3Config, FenceError> {
    let parsed =
        Url::parse(url).map_err(|e| config_error(format_args!("not an s3:// URL: {e}")))?;
    if parsed.scheme() != "s3" {
        return Err(config_error("the URL's scheme must be s3://"));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        // Not echoed: it may hold a secret.
        return Err(config_error(
            "credentials in the URL are refused: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        ));
    }
    let bucket = parsed
        .host_str()
        .filter(|b| !b.is_empty())
        .ok_or_else(|| config_error("s3://<bucket>/… names no bucket"))?
        .to_string();
    let mut prefix = parsed.path().trim_start_matches('/').to_string();
    if !prefix.is_empty() && !prefix.ends_with('/') {
        prefix.push('/');
    }
    let (mut endpoint, mut region, mut path_style, mut attempts) = (None, None, None, None);
    for (k, v) in parsed.query_pairs() {
        match k.as_ref() {
            "endpoint" => endpoint = Some(v.trim_end_matches('/').to_string()),
            "region" => region = Some(v.to_string()),
            "path_style" => {
                path_style = Some(
                    v.parse::<bool>()
                        .map_err(|_| config_error("path_style must be true or false"))?,
                )
            }
            "attempts" => {
                attempts = Some(
                    v.parse::<usize>()
                        .ok()
                        .filter(|n| *n > 0)
                        .ok_or_else(|| config_error("attempts must be a positive number"))?,
                )
            }
            other => return Err(config_error(format_args!("unknown parameter {other:?}"))),
        }
    }
    let region = region
        .or_else(|| env("AWS_REGION"))
        .or_else(|| env("AWS_DEFAULT_REGION"))
        .unwrap_or_else(|| "us-east-1".to_string());
    let path_style = path_style.unwrap_or(endpoint.is_some());
    let endpoint = endpoint.unwrap_or_else(|| format!("https://s3.{region}.amazonaws.com"));
    let access_key = env("AWS_ACCESS_KEY_ID")
        .filter(|s| !s.is_empty())
        .ok_or_else(|| config_error("AWS_ACCESS_KEY_ID is not set"))?;
    let secret_key = env("AWS_SECRET_ACCESS_KEY")
        .filter(|s| !s.is_empty())
        .ok_or_else(|| config_error("AWS_SECRET_ACCESS_KEY is not set"))?;
    let mut credentials = Credentials::new(access_key, secret_key);
    if let Some(token) = env("AWS_SESSION_TOKEN").filter(|s| !s.is_empty()) {
        credentials = credentials.with_session_token(token);
    }
    Ok(S3Config {
        endpoint,
        bucket,
        prefix,
        region,
        credentials,
        path_style,
        attempts: attempts.unwrap_or(DEFAULT_ATTEMPTS),
        timeout: Duration::from_secs(30),
    })
}

impl FencedStore for S3Store {
    fn kind(&self) -> &'static str {
        STORE
    }

    fn caveats(&self) -> Vec<String> {
        vec![
            "an object lifecycle rule that expires fenced objects removes their marks with \
             them, and a stale write then creates the object anew: keep expiration rules off \
             the fenced prefix"
                .to_owned(),
        ]
    }

    fn guarded_write<'a>(
        &'a self,
        record: &'a str,
        token: u64,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<Guarded, FenceError>> {
        Box::pin(self.guarded(record, token, payload))
    }

    fn read<'a>(&'a self, record: &'a str) -> BoxFuture<'a, Result<Option<Record>, FenceError>> {
        Box::pin(self.read_record(record))
    }

    fn plain_write<'a>(
        &'a self,
        record: &'a str,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<(), FenceError>> {
        Box::pin(self.plain(record, payload))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "AWS_ACCESS_KEY_ID" => Some("AKID".into()),
            "AWS_SECRET_ACCESS_KEY" => Some("s3cr3t".into()),
            _ => None,
        }
    }

    #[test]
    fn urls_name_bucket_prefix_endpoint_and_region() {
        let c = config_from_url(
            "s3://fences/team/a?endpoint=http://127.0.0.1:9000&region=eu-west-1",
            env,
        )
        .unwrap();
        assert_eq!(c.bucket, "fences");
        assert_eq!(c.prefix, "team/a/");
        assert_eq!(c.endpoint, "http://127.0.0.1:9000");
        assert_eq!(c.region, "eu-west-1");
        assert!(c.path_style);
        assert!(!format!("{c:?}").contains("s3cr3t"));

        let aws = config_from_url("s3://fences", env).unwrap();
        assert_eq!(aws.endpoint, "https://s3.us-east-1.amazonaws.com");
        assert!(!aws.path_style);
        assert_eq!(aws.prefix, "");
    }

    #[test]
    fn urls_refuse_credentials_and_unknown_parameters() {
        let e = config_from_url("s3://AKID:hunter2@fences/x", env).unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
        assert!(config_from_url("s3://fences?endpint=x", env).is_err());
        assert!(config_from_url("s3://fences", |_| None).is_err());
        assert!(config_from_url("http://fences", env).is_err());
    }

    #[test]
    fn bodies_carry_the_mark_line() {
        let m = Mark::new(0x0001_0000_0000_002a);
        let body = fenced_body(m, b"hello");
        assert_eq!(&body[..], b"latchkey-fence/1 000100000000002a\nhello");
        assert_eq!(split_body(m, &body), Some(&b"hello"[..]));
        assert_eq!(split_body(Mark::new(1), &body), None);
        assert_eq!(split_body(m, b"hello"), None);
        // Same payload, higher mark: other bytes, so another ETag.
        assert_ne!(
            fenced_body(Mark::new(2), b"x"),
            fenced_body(Mark::new(3), b"x")
        );
    }

    #[test]
    fn s3_error_bodies_are_read() {
        let body = b"<?xml version=\"1.0\"?><Error><Code>PreconditionFailed</Code>\
                     <Message>At least one of the pre-conditions you specified did not hold</Message></Error>";
        assert_eq!(xml_field(body, "Code"), Some("PreconditionFailed"));
        assert!(xml_field(body, "Message").unwrap().starts_with("At least"));
        assert_eq!(xml_field(b"", "Code"), None);
    }

    #[test]
    fn record_names_stay_under_the_prefix() {
        for bad in ["", "..", "a/../b", "./a", "a/."] {
            assert!(check_record(bad).is_err(), "{bad:?}");
        }
        for good in ["a", "a/b", "a..b", ".hidden", "orders/42"] {
            assert!(check_record(good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn unfenced_errors_name_the_record_not_a_mark() {
        let e = unfenced("orders/7", "no readable mark");
        let text = e.to_string();
        assert!(
            text.contains("orders/7") && text.contains(MARK_HEADER),
            "{text}"
        );
    }
}
