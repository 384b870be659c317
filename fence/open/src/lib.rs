//! One place a URL becomes a fence adapter (issue 35): `latchctl
//! pause-test --resource-url` and the release gate's rotation through every
//! store open their stores here.
//!
//! [`open`] is the one place a URL becomes an adapter; a new store is one
//! more arm there. An S3-compatible store is used only after its
//! conditional writes are probed: one that accepts a stale `If-Match` or an
//! `If-None-Match: *` over an existing object is refused, never used as a
//! fence. Nothing here repeats a URL (it may hold a password): errors name
//! the scheme, and [`locator`] is the URL without credentials or query.

use latchkey_fence::{FenceError, FencedStore};
use latchkey_fence_etcd::EtcdStore;
use latchkey_fence_mysql::MysqlStore;
use latchkey_fence_postgres::{self as pg_fence, PostgresStore};
use latchkey_fence_redis::RedisStore;
use latchkey_fence_s3::{S3Store, probe_conditional_writes};

/// The schemes [`open`] knows, for `--help` and errors.
pub const SCHEMES: &str = "postgresql://, mysql:// (mariadb://), redis://, etcd://, s3://";

/// Why a store could not be opened. The URL (it may hold a password) is
/// never part of it; the scheme is.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(
        "the resource URL has no scheme (expected one of {SCHEMES}); it is not repeated here \
         because it may hold a password"
    )]
    NoScheme,
    #[error("unknown resource scheme {0:?}:// (expected one of {SCHEMES})")]
    UnknownScheme(String),
    #[error("the S3 store cannot be certified as fenced: {0}")]
    NotFenced(latchkey_fence_s3::NotHonoured),
    #[error("cannot open the {kind} resource: {error}")]
    Store {
        kind: &'static str,
        error: FenceError,
    },
}

/// The adapter for `url`'s scheme, connected (and, for the SQL stores, its
/// reference table created).
pub async fn open(url: &str) -> Result<Box<dyn FencedStore>, OpenError> {
    let (scheme, rest) = url.split_once("://").ok_or(OpenError::NoScheme)?;
    // Only a scheme-shaped prefix is ever echoed: what comes before the
    // first "://" may be a password (":hunter2@host/?next=redis://x").
    let scheme_shaped = scheme
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '.' | '-'));
    if !scheme_shaped {
        return Err(OpenError::NoScheme);
    }
    let store = |kind: &'static str| move |error| OpenError::Store { kind, error };
    match scheme.to_ascii_lowercase().as_str() {
        "postgresql" | "postgres" => Ok(Box::new(
            PostgresStore::connect(url)
                .await
                .map_err(store(pg_fence::KIND))?,
        )),
        // mysql_async reads only mysql://.
        "mysql" | "mariadb" => Ok(Box::new(
            MysqlStore::connect(&format!("mysql://{rest}"))
                .await
                .map_err(store(latchkey_fence_mysql::KIND))?,
        )),
        "redis" => Ok(Box::new(
            RedisStore::connect(url)
                .await
                .map_err(store(latchkey_fence_redis::KIND))?,
        )),
        "etcd" => Ok(Box::new(
            EtcdStore::connect(url)
                .await
                .map_err(store(latchkey_fence_etcd::KIND))?,
        )),
        // Credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY only
        // (a URL holding them is refused); probed before it is used.
        "s3" => {
            let s3 = S3Store::from_url(url).map_err(store("s3"))?;
            probe_conditional_writes(&s3)
                .await
                .map_err(OpenError::NotFenced)?;
            Ok(Box::new(s3))
        }
        other => Err(OpenError::UnknownScheme(other.to_owned())),
    }
}

/// The adapter kind a URL's scheme opens (`mariadb://` is `mysql`), or
/// `None` for a scheme [`open`] does not know.
pub fn scheme_kind(url: &str) -> Option<&'static str> {
    let (scheme, _) = url.split_once("://")?;
    match scheme.to_ascii_lowercase().as_str() {
        "postgresql" | "postgres" => Some(pg_fence::KIND),
        "mysql" | "mariadb" => Some(latchkey_fence_mysql::KIND),
        "redis" => Some(latchkey_fence_redis::KIND),
        "etcd" => Some(latchkey_fence_etcd::KIND),
        "s3" => Some("s3"),
        _ => None,
    }
}

/// Refuses a `--resource` whose kind (before its `:`) is not the store the
/// URL opens: a result saying `redis:ledger` must come from a Redis fence.
/// `postgres` and `mariadb` are taken as their adapters' kinds.
pub fn check_resource_kind(resource: &str, url: &str) -> Result<(), String> {
    let Some(kind) = scheme_kind(url) else {
        // open() says what is wrong with the scheme.
        return Ok(());
    };
    let named = resource
        .split_once(':')
        .map(|(k, _)| k.to_ascii_lowercase());
    let named_kind = match named.as_deref() {
        Some("postgres") => Some(pg_fence::KIND),
        Some("mariadb") => Some(latchkey_fence_mysql::KIND),
        Some(k) => [
            pg_fence::KIND,
            latchkey_fence_mysql::KIND,
            latchkey_fence_redis::KIND,
            latchkey_fence_etcd::KIND,
            "s3",
        ]
        .into_iter()
        .find(|known| *known == k),
        None => None,
    };
    if named_kind == Some(kind) {
        Ok(())
    } else {
        Err(format!(
            "--resource {resource:?} does not name a {kind} resource, but --resource-url opens \
             a {kind} store: name it {kind}:<name> (the result must say which store was proven)"
        ))
    }
}

/// Where `url` points, without anything that may be a secret: the scheme,
/// the hosts and the path, never the user, the password or the query (an
/// S3 URL keeps its `endpoint` and `region` parameters, which are not).
pub fn locator(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<no scheme>".to_owned();
    };
    let scheme = scheme.to_ascii_lowercase();
    // Everything up to the LAST '@' may be credentials, whatever it holds:
    // drivers take a password with '/', '?' or '#' in it
    // (`postgresql://app:Xy/9kq@db/ledger` connects), so no earlier cut is
    // safe (the hostile review). A path or query with an '@' loses its
    // front: less said, never a secret.
    let rest = rest.rsplit_once('@').map_or(rest, |(_, after)| after);
    // Then a fragment, which is never the store's (and may hold a secret).
    let rest = rest.split_once('#').map_or(rest, |(before, _)| before);
    let (before_query, query) = match rest.split_once(['?', '#']) {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let (authority, path) = match before_query.split_once('/') {
        Some((a, p)) => (a, Some(p)),
        None => (before_query, None),
    };
    let mut out = format!("{scheme}://{authority}");
    if let Some(path) = path {
        out.push('/');
        out.push_str(path);
    }
    if scheme == "s3" {
        // Only values that cannot hide anything: a region of its own
        // characters, an endpoint of a scheme and a host[:port].
        let mut kept = Vec::new();
        for kv in query.unwrap_or("").split('&') {
            if let Some(region) = kv.strip_prefix("region=")
                && !region.is_empty()
                && region
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            {
                kept.push(kv.to_owned());
            }
            if let Some(endpoint) = kv.strip_prefix("endpoint=")
                && let Some((scheme, host)) = endpoint.split_once("://")
                && matches!(scheme, "http" | "https")
                && !host.is_empty()
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':'))
            {
                kept.push(format!("endpoint={scheme}://{host}"));
            }
        }
        if !kept.is_empty() {
            out.push('?');
            out.push_str(&kept.join("&"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locators_carry_no_secret() {
        assert_eq!(
            locator("mysql://app:hunter2@10.0.0.5:3306/ledger?ssl-mode=off"),
            "mysql://10.0.0.5:3306/ledger"
        );
        assert_eq!(
            locator("redis://:hunter2@127.0.0.1:6379/0"),
            "redis://127.0.0.1:6379/0"
        );
        assert_eq!(
            locator("etcd://u:p@w@h1:2379,h2:2379/fenced"),
            "etcd://h1:2379,h2:2379/fenced"
        );
        assert_eq!(
            locator("postgresql://127.0.0.1:5432/db?password=hunter2"),
            "postgresql://127.0.0.1:5432/db"
        );
        assert_eq!(
            locator(
                "s3://bucket/prefix?endpoint=http://127.0.0.1:9000&region=eu-west-1&attempts=3"
            ),
            "s3://bucket/prefix?endpoint=http://127.0.0.1:9000&region=eu-west-1"
        );
        assert_eq!(locator("postgresql://u@h/db#hunter2"), "postgresql://h/db");
        // Passwords with the characters URLs split on (they connect).
        assert_eq!(
            locator("postgresql://app:Xy/9kq@db:5432/ledger"),
            "postgresql://db:5432/ledger"
        );
        assert_eq!(
            locator("postgresql://app:Xy?9kq@db/ledger"),
            "postgresql://db/ledger"
        );
        assert_eq!(
            locator("etcd://app:Xy#9kq@10.0.0.1:2379/fenced"),
            "etcd://10.0.0.1:2379/fenced"
        );
        assert!(!locator("s3://b/p?endpoint=http://minio:minio-secret@h:9000").contains("secret"));
        assert!(!locator("s3://b/p?region=us-east-1#hunter2").contains("hunter2"));
        assert!(
            !locator("s3://b/p?endpoint=http%3A%2F%2FAKIA%3Ahunter2%40h&region=x")
                .contains("hunter2")
        );
    }

    #[test]
    fn the_resource_must_name_the_store_the_url_opens() {
        assert!(check_resource_kind("redis:ledger", "redis://h:1").is_ok());
        assert!(check_resource_kind("mariadb:ledger.t", "mysql://h:1/db").is_ok());
        assert!(check_resource_kind("postgres:ledger", "postgresql://h/db").is_ok());
        assert!(check_resource_kind("s3:bucket/x", "s3://bucket/x").is_ok());
        let err = check_resource_kind("postgresql:ledger", "redis://:pw@h:1").unwrap_err();
        assert!(err.contains("redis store") && !err.contains("pw"), "{err}");
        assert!(check_resource_kind("ledger", "redis://h:1").is_err());
    }
}
