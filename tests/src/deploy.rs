//! Checks on deploy/ (issue 20) that need no Kubernetes API server — none can
//! run on this machine kind. What they cover and what they cannot:
//! deploy/README.md.
//!
//! - Every overlay renders with `kubectl kustomize` and its output passes the
//!   Kubernetes 1.32 schemas (PyPI `kubernetes-validate`, strict: unknown fields
//!   fail). Custom resources have no schema there and are skipped by kind,
//!   explicitly ([`CUSTOM_KINDS`]); any other kind it does not know fails.
//! - Every metric name in the alert rules and the dashboard is one the code
//!   exports: the arbiter's and the audit tailer's from their registries'
//!   exposition, the edge's from the filter's stat names and Envoy's
//!   `stats_tags`, and the few Envoy built-ins in [`ENVOY_BUILTIN_METRICS`]
//!   (tests/e2e/health_check.rs finds those on a real Envoy).
//! - The edge's Envoy bootstrap stays in step with envoy/edge.yaml and passes
//!   `envoy --mode validate`.
//! - The dev overlay's policies load.
//!
//! The flags in the Deployments are checked against the real binaries' `--help`
//! in tests/e2e/deploy.rs (it has the binaries' paths).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail, ensure};

/// Kubernetes version whose schemas the rendered objects must pass.
pub const K8S_SCHEMA_VERSION: &str = "1.32.0";

/// Kinds `kubernetes-validate` has no schema for (custom resources), skipped
/// on purpose: Prometheus Operator's ServiceMonitor and PrometheusRule, SPIRE
/// Controller Manager's ClusterSPIFFEID, and Latchkey's own LockClass and
/// LockGrant (ADR-24).
pub const CUSTOM_KINDS: &[&str] = &[
    "ServiceMonitor",
    "PrometheusRule",
    "ClusterSPIFFEID",
    "LockClass",
    "LockGrant",
];

/// Envoy's own metrics the rules and dashboard use (not exported by our code).
pub const ENVOY_BUILTIN_METRICS: &[&str] = &[
    "envoy_cluster_membership_healthy",
    "envoy_cluster_membership_total",
];

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// The overlays under deploy/overlays.
pub fn overlays() -> anyhow::Result<Vec<String>> {
    let dir = repo().join("deploy/overlays");
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("{}", dir.display()))? {
        let entry = entry?;
        if entry.path().join("kustomization.yaml").exists() {
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    names.sort();
    Ok(names)
}

/// `kubectl kustomize deploy/overlays/<overlay>`.
pub fn render(overlay: &str) -> anyhow::Result<String> {
    let dir = repo().join("deploy/overlays").join(overlay);
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(&dir)
        .output()
        .context("kubectl did not run (scripts/setup checks it: kubectl 1.27+)")?;
    ensure!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// One object of a rendered overlay.
#[derive(Debug, Clone)]
pub struct Doc {
    pub kind: String,
    pub name: String,
    pub namespace: Option<String>,
    pub text: String,
}

/// The value of a top-level `key: value` line, or of `  key: value` directly
/// under the top-level `metadata:`.
fn top_level(text: &str, key: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}: ")))
        .map(|v| v.trim().trim_matches('"').to_string())
}

fn metadata(text: &str, key: &str) -> Option<String> {
    let mut in_metadata = false;
    for line in text.lines() {
        if !line.starts_with(' ') {
            in_metadata = line == "metadata:";
            continue;
        }
        if in_metadata && let Some(v) = line.strip_prefix(&format!("  {key}: ")) {
            return Some(v.trim().trim_matches('"').to_string());
        }
    }
    None
}

/// Splits kustomize's output (documents separated by `---` lines; keys at
/// column 0 are the object's top level).
pub fn documents(rendered: &str) -> anyhow::Result<Vec<Doc>> {
    let mut docs = Vec::new();
    let mut text = String::new();
    let mut flush = |text: &mut String| -> anyhow::Result<()> {
        if !text.trim().is_empty() {
            let kind = top_level(text, "kind").with_context(|| format!("no kind in:\n{text}"))?;
            let name =
                metadata(text, "name").with_context(|| format!("no metadata.name in:\n{text}"))?;
            docs.push(Doc {
                kind,
                name,
                namespace: metadata(text, "namespace"),
                text: std::mem::take(text),
            });
        }
        text.clear();
        Ok(())
    };
    for line in rendered.lines() {
        if line == "---" {
            flush(&mut text)?;
        } else {
            text.push_str(line);
            text.push('\n');
        }
    }
    flush(&mut text)?;
    Ok(docs)
}

/// The one object of `kind` named `name`.
pub fn find<'a>(docs: &'a [Doc], kind: &str, name: &str) -> anyhow::Result<&'a Doc> {
    docs.iter()
        .find(|d| d.kind == kind && d.name == name)
        .with_context(|| format!("no {kind} {name}"))
}

/// Every `--flag` (name only) in an object's `args`/`command` lists: the list
/// items that start with `--`. (Sidecars such as spiffe-helper use
/// single-dash flags, so in the arbiter's and the tailer's Deployments these
/// are their own flags.)
pub fn long_flags(doc: &Doc) -> Vec<String> {
    doc.text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- --"))
        .map(|f| {
            let name = f.split(['=', ' ']).next().unwrap_or(f);
            format!("--{}", name.trim_matches('"'))
        })
        .collect()
}

/// The `--flag` names a binary's `--help` lists.
pub fn help_flags(help: &str) -> BTreeSet<String> {
    help.split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']')
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| w.split(['=', '<']).next().unwrap_or(w).to_string())
        .collect()
}

/// The metric names an OpenMetrics exposition (prometheus-client's text) lets a
/// query use: `<name>_total` for a counter, `_bucket`/`_sum`/`_count` for a
/// histogram, the name itself otherwise.
pub fn exposition_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut parts = rest.split_whitespace();
        let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
            continue;
        };
        match kind {
            "counter" => {
                names.insert(format!("{name}_total"));
            }
            "histogram" => {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{suffix}"));
                }
            }
            _ => {
                names.insert(name.to_string());
            }
        }
    }
    names
}

/// The arbiter's exported names, from its registry.
pub fn arbiter_metric_names() -> anyhow::Result<BTreeSet<String>> {
    use std::sync::Arc;
    let metrics = latchkey_arbiter::metrics::Metrics::new(
        Arc::new(|| (0, 0)),
        Arc::new(latchkey_arbiter::epoch::EpochGuard::default()),
        Arc::new(latchkey_hook_host::HookHost::new(
            latchkey_hook_host::HostSettings::default(),
        )),
        Arc::new(latchkey_arbiter::quorum_loss::QuorumSnapshot::default),
    );
    // A family shows in the exposition only once it has a sample: give each one.
    use latchkey_arbiter::error::ArbiterError;
    use latchkey_arbiter::metrics::Scope;
    let scope = Scope::default();
    let refused: Result<(), ArbiterError> = Err(ArbiterError::SessionExpired { session: 1 });
    metrics.acquire(
        &scope,
        &Ok::<(), ArbiterError>(()),
        std::time::Duration::ZERO,
    );
    metrics.release(
        &scope,
        &Ok::<(), ArbiterError>(()),
        false,
        Some(std::time::Duration::ZERO),
    );
    metrics.renewal("renewed");
    if let Err(e) = &refused {
        metrics.renewal_refused(e);
    }
    metrics.identity_bound_refused("sessions");
    metrics.keepalive_paced("renewals");
    metrics.overload_refused(
        latchkey_arbiter::overload::Work::Open,
        latchkey_arbiter::overload::Refusal::QueueFull,
    );
    // The families added at start by the parts that have them.
    metrics.set_coord_tier(
        Arc::new(latchkey_arbiter::epoch::EpochGuard::default()),
        Arc::new(latchkey_arbiter::quorum_loss::QuorumSnapshot::default),
    );
    metrics.set_admission(latchkey_arbiter::overload::Admission::new(
        latchkey_arbiter::overload::OverloadConfig::default(),
    ));
    metrics.set_session_totals(Arc::new(|| Some(0)));
    Ok(exposition_names(&metrics.encode()?))
}

/// The audit tailer's exported names, from its registry.
pub fn audit_metric_names() -> anyhow::Result<BTreeSet<String>> {
    Ok(exposition_names(
        &latchkey_audit::metrics::Metrics::new().text()?,
    ))
}

/// The tag segments Envoy's `stats_tags` turn into labels (`ns`, `reason`, ...):
/// the literal between `(\.` and `\.(` in each regex of envoy/edge.yaml.
pub fn stats_tag_segments(bootstrap: &str) -> Vec<String> {
    bootstrap
        .lines()
        .filter(|l| l.trim_start().starts_with("regex: '^wasmcustom"))
        .filter_map(|l| {
            let start = l.find("(\\.")? + 3;
            let end = l[start..].find("\\.(")? + start;
            Some(l[start..end].to_string())
        })
        .collect()
}

/// The edge's exported names on Envoy's `/stats/prometheus`: every stat name
/// in filter/core/src/metrics.rs (`latchkey_edge.<stat>...` literals and
/// `{PREFIX}.<stat>...` formats) up to its first tagged segment, dots as
/// underscores (Envoy strips `wasmcustom.`); histograms (the names the
/// filter's callbacks, filter/core/src/edge/, record with `.histogram(`) as
/// `_bucket`/`_sum`/`_count`.
pub fn edge_metric_names() -> anyhow::Result<BTreeSet<String>> {
    let source = std::fs::read_to_string(repo().join("filter/core/src/metrics.rs"))?;
    let mut files = std::fs::read_dir(repo().join("filter/core/src/edge"))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<Vec<_>, _>>()?;
    files.sort();
    let mut callbacks = String::new();
    for file in files {
        callbacks.push_str(&std::fs::read_to_string(file)?);
    }
    // Whitespace removed: rustfmt breaks a long call over lines.
    let callbacks: String = callbacks.chars().filter(|c| !c.is_whitespace()).collect();
    let bootstrap = std::fs::read_to_string(repo().join("envoy/edge.yaml"))?;
    let tags = stats_tag_segments(&bootstrap);
    ensure!(tags.len() >= 4, "stats_tags not found in envoy/edge.yaml");
    let base = |stat: &str| -> String {
        let parts: Vec<&str> = stat
            .split('.')
            .take_while(|p| !tags.iter().any(|t| t == p) && !p.is_empty() && !p.contains('{'))
            .collect();
        format!("latchkey_edge_{}", parts.join("_"))
    };
    // const NAME: &str = "latchkey_edge.<stat>";
    let mut consts = Vec::new();
    for line in source.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("pub const ")
            && let Some((name, value)) = rest.split_once(": &str = \"latchkey_edge.")
        {
            consts.push((name.to_string(), value.trim_end_matches("\";").to_string()));
        }
    }
    let mut names = BTreeSet::new();
    for (konst, stat) in &consts {
        let name = base(stat);
        if callbacks.contains(&format!(".histogram(host,metrics::{konst},")) {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        } else {
            names.insert(name);
        }
    }
    for piece in source.split("\"{PREFIX}.").skip(1) {
        let stat = piece.split('"').next().unwrap_or_default();
        names.insert(base(stat));
    }
    ensure!(
        names.len() >= 10,
        "too few edge stats parsed from filter/core/src/metrics.rs: {names:?}"
    );
    Ok(names)
}

/// Every name a query may use.
pub fn exported_metric_names() -> anyhow::Result<BTreeSet<String>> {
    let mut all = arbiter_metric_names()?;
    all.extend(audit_metric_names()?);
    all.extend(edge_metric_names()?);
    all.extend(ENVOY_BUILTIN_METRICS.iter().map(|s| s.to_string()));
    Ok(all)
}

/// The `expr:` values of a PrometheusRule file (plain or block scalars).
pub fn rule_exprs(yaml: &str) -> Vec<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut exprs = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let indent = line.len() - line.trim_start().len();
        if let Some(rest) = line.trim_start().strip_prefix("expr:") {
            let rest = rest.trim();
            if rest.starts_with('>') || rest.starts_with('|') {
                let mut expr = String::new();
                while i + 1 < lines.len() {
                    let next = lines[i + 1];
                    let next_indent = next.len() - next.trim_start().len();
                    if !next.trim().is_empty() && next_indent <= indent {
                        break;
                    }
                    expr.push_str(next.trim());
                    expr.push(' ');
                    i += 1;
                }
                exprs.push(expr);
            } else {
                exprs.push(rest.to_string());
            }
        }
        i += 1;
    }
    exprs
}

/// Every PromQL expression of a Grafana dashboard: panels' `expr` and
/// templating queries.
pub fn dashboard_exprs(json: &serde_json::Value) -> Vec<String> {
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    match (k.as_str(), v) {
                        ("expr", serde_json::Value::String(s)) => out.push(s.clone()),
                        ("query", serde_json::Value::String(s)) if s.contains('(') => {
                            out.push(s.clone())
                        }
                        _ => walk(v, out),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|i| walk(i, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(json, &mut out);
    out
}

/// PromQL functions, aggregations and keywords the rules and dashboard may use.
const PROMQL_WORDS: &[&str] = &[
    "sum",
    "max",
    "min",
    "avg",
    "count",
    "rate",
    "irate",
    "increase",
    "deriv",
    "histogram_quantile",
    "time",
    "and",
    "or",
    "unless",
    "label_values",
    "absent",
];

/// The metric names an expression uses: what is left after removing strings,
/// label matchers `{...}`, ranges `[...]`, grouping clauses (`by (...)`, ...)
/// and numbers, minus PromQL's own words. Anything else is taken for a metric
/// name, so a typo in a function name fails too.
pub fn metric_names_in(expr: &str) -> BTreeSet<String> {
    let mut cleaned = String::new();
    let mut depth_brace = 0;
    let mut depth_bracket = 0;
    let mut in_string = false;
    for c in expr.chars() {
        match c {
            '"' if depth_brace == 0 => in_string = !in_string,
            _ if in_string => {}
            '{' => depth_brace += 1,
            '}' => depth_brace -= 1,
            '[' => depth_bracket += 1,
            ']' => depth_bracket -= 1,
            _ if depth_brace > 0 || depth_bracket > 0 => {}
            c => cleaned.push(c),
        }
    }
    // tokens: names, numbers, and '(' / ')' on their own
    let mut tokens: Vec<String> = Vec::new();
    let mut cur = String::new();
    for c in cleaned.chars() {
        if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            cur.push(c);
            continue;
        }
        if !cur.is_empty() {
            tokens.push(std::mem::take(&mut cur));
        }
        if c == '(' || c == ')' {
            tokens.push(c.to_string());
        }
    }
    if !cur.is_empty() {
        tokens.push(cur);
    }
    // drop grouping clauses (`by (a, b)`, `without (...)`, `on (...)`, ...) and
    // label_values' label argument
    let mut words: Vec<String> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let t = tokens[i].as_str();
        let clause = [
            "by",
            "without",
            "on",
            "ignoring",
            "group_left",
            "group_right",
        ]
        .contains(&t);
        if clause && tokens.get(i + 1).is_some_and(|n| n == "(") {
            while i < tokens.len() && tokens[i] != ")" {
                i += 1;
            }
        } else if t == "label_values" {
            if let Some(metric) = tokens.get(i + 2) {
                words.push(metric.clone());
            }
            while i < tokens.len() && tokens[i] != ")" {
                i += 1;
            }
        } else if t != "(" && t != ")" && !t.starts_with(|c: char| c.is_ascii_digit()) {
            words.push(t.to_string());
        }
        i += 1;
    }
    words
        .into_iter()
        .filter(|w| !PROMQL_WORDS.contains(&w.as_str()))
        .collect()
}

/// A block of a YAML file: the line whose trimmed text starts with `key` (the
/// `nth` such line) and every following line indented deeper, comments and
/// blank lines dropped.
pub fn yaml_block(text: &str, key: &str, nth: usize) -> anyhow::Result<String> {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.trim_start().starts_with(key))
        .map(|(i, _)| i)
        .nth(nth)
        .with_context(|| format!("no {key:?} #{nth}"))?;
    let indent = lines[start].len() - lines[start].trim_start().len();
    let mut out = vec![lines[start].trim_start().to_string()];
    for line in &lines[start + 1..] {
        if line.trim().is_empty() || line.trim_start().starts_with('#') {
            continue;
        }
        let i = line.len() - line.trim_start().len();
        if i <= indent && !line.trim_start().starts_with("- ") || i < indent {
            break;
        }
        out.push(format!("{}{}", " ".repeat(i - indent), line.trim_start()));
    }
    Ok(out.join("\n"))
}

/// envoy/edge.yaml as the filter-enabled template renders it: the NO_FILTER and
/// SECOND_ARBITER blocks dropped.
pub fn edge_template_with_filter() -> anyhow::Result<String> {
    let text = std::fs::read_to_string(repo().join("envoy/edge.yaml"))?;
    let mut out = String::new();
    let mut skipping = false;
    for line in text.lines() {
        if line.contains("# @@BEGIN NO_FILTER@@") || line.contains("# @@BEGIN SECOND_ARBITER@@") {
            skipping = true;
        }
        if !skipping && !line.contains("# @@") {
            out.push_str(line);
            out.push('\n');
        }
        if line.contains("# @@END NO_FILTER@@") || line.contains("# @@END SECOND_ARBITER@@") {
            skipping = false;
        }
    }
    Ok(out)
}

/// Runs `kubernetes-validate --strict` on `yaml`; its complaints on failure.
pub fn kubernetes_validate(yaml: &str) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("objects.yaml");
    std::fs::write(&file, yaml)?;
    let out = Command::new("kubernetes-validate")
        .args(["--strict", "--quiet", "-k", K8S_SCHEMA_VERSION])
        .arg(&file)
        .output()
        .context("kubernetes-validate did not run (scripts/setup installs it from PyPI)")?;
    if !out.status.success() {
        bail!(
            "kubernetes-validate: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_overlay_renders_and_passes_the_kubernetes_schemas() -> anyhow::Result<()> {
        let overlays = overlays()?;
        assert!(
            overlays.contains(&"dev".to_string()) && overlays.contains(&"production".to_string()),
            "{overlays:?}"
        );
        for overlay in &overlays {
            let docs = documents(&render(overlay)?)?;
            let (custom, standard): (Vec<&Doc>, Vec<&Doc>) = docs
                .iter()
                .partition(|d| CUSTOM_KINDS.contains(&d.kind.as_str()));
            let yaml: Vec<&str> = standard.iter().map(|d| d.text.as_str()).collect();
            kubernetes_validate(&yaml.join("---\n"))
                .with_context(|| format!("overlay {overlay}"))?;
            for kind in [
                "Deployment",
                "StatefulSet",
                "NetworkPolicy",
                "PodDisruptionBudget",
            ] {
                assert!(
                    standard.iter().any(|d| d.kind == kind),
                    "{overlay}: no {kind}"
                );
            }
            for kind in ["ServiceMonitor", "PrometheusRule", "ClusterSPIFFEID"] {
                assert!(
                    custom.iter().any(|d| d.kind == kind),
                    "{overlay}: no {kind}"
                );
            }
            // cluster-scoped objects carry no namespace; everything else is placed
            for d in &docs {
                let cluster_scoped = matches!(d.kind.as_str(), "Namespace" | "ClusterSPIFFEID");
                assert_eq!(
                    d.namespace.is_none(),
                    cluster_scoped,
                    "{overlay}: {} {} namespace {:?}",
                    d.kind,
                    d.name,
                    d.namespace
                );
            }
        }
        Ok(())
    }

    /// The validation is live: a Deployment with a misspelt field fails it.
    #[test]
    fn kubernetes_validate_refuses_an_unknown_field() -> anyhow::Result<()> {
        let docs = documents(&render("dev")?)?;
        let arbiter = find(&docs, "Deployment", "latchkey-arbiter")?;
        let bad = arbiter
            .text
            .replacen("containerPort:", "containerPorts:", 1);
        assert_ne!(bad, arbiter.text);
        let err = kubernetes_validate(&bad).err().map(|e| format!("{e:#}"));
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("latchkey-arbiter")),
            "{err:?}"
        );
        Ok(())
    }

    #[test]
    fn alert_rules_and_dashboard_use_only_exported_metric_names() -> anyhow::Result<()> {
        let exported = exported_metric_names()?;
        let base = repo().join("deploy/base/monitoring");
        let rules = rule_exprs(&std::fs::read_to_string(base.join("rules.yaml"))?);
        let dashboard: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(base.join("dashboard.json"))?)?;
        let panels = dashboard_exprs(&dashboard);
        assert!(rules.len() >= 10, "{rules:?}");
        assert!(panels.len() >= 20, "{panels:?}");
        let mut used = BTreeSet::new();
        for expr in rules.iter().chain(&panels) {
            let names = metric_names_in(expr);
            assert!(!names.is_empty(), "no metric in {expr:?}");
            for name in names {
                assert!(
                    exported.contains(&name),
                    "{name} (in {expr:?}) is not exported by the code; exported: {exported:?}"
                );
                used.insert(name);
            }
        }
        // the alerts issue 20 asks for
        let rule_names: BTreeSet<String> = rules.iter().flat_map(|e| metric_names_in(e)).collect();
        for needed in [
            "latchkey_arbiter_sealed",
            "latchkey_arbiter_session_renewals_refused_total",
            "latchkey_arbiter_waiters",
            "latchkey_edge_denied",
            "latchkey_audit_lag_alarm",
            "latchkey_audit_lag_seconds",
        ] {
            assert!(rule_names.contains(needed), "no alert on {needed}");
        }
        // the dashboard covers both the arbiter and the edge
        assert!(used.iter().any(|n| n.starts_with("latchkey_arbiter_")));
        assert!(used.iter().any(|n| n.starts_with("latchkey_edge_")));
        Ok(())
    }

    #[test]
    fn the_metric_name_extraction_sees_names_and_only_names() {
        let names = metric_names_in(
            r#"histogram_quantile(0.99, sum by (le, class) (rate(latchkey_arbiter_grant_wait_seconds_bucket{namespace="$namespace", class=~"a|b"}[$__rate_interval]))) > 0 and on (pod) foo_bar"#,
        );
        let want: BTreeSet<String> = ["latchkey_arbiter_grant_wait_seconds_bucket", "foo_bar"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(names, want);
        let edge = edge_metric_names().unwrap_or_default();
        for name in [
            "latchkey_edge_denied",
            "latchkey_edge_allowed",
            "latchkey_edge_waiters",
            "latchkey_edge_policy_refresh",
            "latchkey_edge_decision_us_bucket",
            "latchkey_edge_grant_table_confirmed_at_s",
        ] {
            assert!(edge.contains(name), "{name} not in {edge:?}");
        }
        assert!(!edge.contains("latchkey_edge_decision_us"), "{edge:?}");
        let arbiter = arbiter_metric_names().unwrap_or_default();
        assert!(
            arbiter.contains("latchkey_arbiter_acquires_total"),
            "{arbiter:?}"
        );
        assert!(arbiter.contains("latchkey_arbiter_sealed"), "{arbiter:?}");
        assert!(
            arbiter.contains("latchkey_arbiter_hold_seconds_bucket"),
            "{arbiter:?}"
        );
    }

    /// The edge's bootstrap in deploy/ is envoy/edge.yaml's with Kubernetes
    /// addresses and SDS: same stats_tags, HTTP filters, routes and arbiter
    /// health checks.
    #[test]
    fn the_deployed_edge_config_keeps_in_step_with_the_template() -> anyhow::Result<()> {
        let template =
            edge_template_with_filter()?.replace("@@ECDS_DIR@@", "/etc/latchkey-edge/ecds");
        let template = template
            .replace("@@RATE_BURST@@", "200")
            .replace("@@RATE_PER_SECOND@@", "100");
        let deployed = std::fs::read_to_string(repo().join("deploy/base/edge/envoy.yaml"))?;
        for (key, nth) in [
            ("stats_config:", 0),
            ("http_filters:", 0),
            ("route_config:", 0),
            ("health_checks:", 0),
            ("circuit_breakers:", 0),
            ("circuit_breakers:", 1),
        ] {
            let want = yaml_block(&template, key, nth)?;
            let got = yaml_block(&deployed, key, nth)?;
            assert_eq!(got, want, "{key} #{nth} differs from envoy/edge.yaml");
        }
        let hc = yaml_block(&deployed, "health_checks:", 0)?;
        assert!(
            hc.contains("service_name: latchkey.lock.v1.Lock")
                && hc.contains("no_traffic_interval"),
            "{hc}"
        );
        Ok(())
    }

    /// `envoy --mode validate` accepts the deployed bootstrap (paths moved to a
    /// temp dir: validation wants the ECDS file to exist).
    #[test]
    fn envoy_validates_the_deployed_edge_config() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let d = dir.path().display().to_string();
        let ecds = dir.path().join("ecds");
        std::fs::create_dir_all(&ecds)?;
        let resource = std::fs::read_to_string(repo().join("deploy/base/edge/latchkey-edge.json"))?
            .replace("@@ADMISSION_SECRET@@", "0123456789abcdef0123456789abcdef")
            .replace("/etc/latchkey-edge/ecds", &format!("{d}/ecds"));
        // the filter configuration is the one dev-up ships, trust domain aside
        let parsed: serde_json::Value = serde_json::from_str(&resource)?;
        let config = parsed["resources"][0]["typed_config"]["config"]["configuration"]["value"]
            .as_str()
            .context("no configuration value")?;
        let config: serde_json::Value = serde_json::from_str(config)?;
        let dev = crate::envoy::arbiter_only_filter_config(serde_json::json!({}))?;
        let keys = |v: &serde_json::Value| -> BTreeSet<String> {
            v.as_object()
                .map(|m| m.keys().cloned().collect())
                .unwrap_or_default()
        };
        assert_eq!(keys(&config), keys(&dev), "{config}");
        assert_eq!(config["refresh"], dev["refresh"]);
        std::fs::write(ecds.join("latchkey-edge.json"), resource)?;
        let bootstrap = std::fs::read_to_string(repo().join("deploy/base/edge/envoy.yaml"))?
            .replace("/etc/latchkey-edge/ecds", &format!("{d}/ecds"))
            .replace(
                "/var/run/latchkey-edge/admin.sock",
                &format!("{d}/admin.sock"),
            );
        let file = dir.path().join("envoy.yaml");
        std::fs::write(&file, bootstrap)?;
        let out = Command::new(crate::envoy::envoy_binary())
            .args(["--mode", "validate", "-c"])
            .arg(&file)
            .current_dir(dir.path())
            .output()
            .context("envoy did not run (scripts/setup installs it)")?;
        assert!(
            out.status.success(),
            "envoy --mode validate:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// The value of `--flag=value` in an object's arguments.
    fn flag_value(doc: &Doc, flag: &str) -> Option<String> {
        doc.text.lines().find_map(|l| {
            l.trim()
                .strip_prefix(&format!("- {flag}="))
                .map(|v| v.trim_matches('"').to_string())
        })
    }

    fn port_of(addr: &str) -> String {
        addr.rsplit(':').next().unwrap_or_default().to_string()
    }

    /// Ports agree: what the binaries listen on is what the containers,
    /// Services and the edge's Envoy name.
    #[test]
    fn listen_flags_container_ports_and_the_edge_agree() -> anyhow::Result<()> {
        let edge_config = std::fs::read_to_string(repo().join("deploy/base/edge/envoy.yaml"))?;
        for overlay in overlays()? {
            let docs = documents(&render(&overlay)?)?;
            let arbiter = find(&docs, "Deployment", "latchkey-arbiter")?;
            let audit = find(&docs, "Deployment", "latchkey-audit")?;
            for (doc, flag) in [
                (arbiter, "--listen"),
                (arbiter, "--metrics-listen"),
                (audit, "--metrics-listen"),
            ] {
                let port = port_of(&flag_value(doc, flag).with_context(|| flag.to_string())?);
                assert!(
                    doc.text.contains(&format!("containerPort: {port}\n")),
                    "{overlay}: {} {flag} port {port} is no containerPort",
                    doc.name
                );
            }
            let grpc = port_of(&flag_value(arbiter, "--listen").unwrap_or_default());
            let service = find(&docs, "Service", "latchkey-arbiter")?;
            assert!(
                service.text.contains(&format!("port: {grpc}\n")),
                "{}",
                service.text
            );
            assert!(
                edge_config.contains(&format!(
                    "address: latchkey-arbiter.latchkey.svc.cluster.local, port_value: {grpc} }}"
                )),
                "the edge's arbiter clusters do not use port {grpc}"
            );
            let edge = find(&docs, "Deployment", "latchkey-edge")?;
            for port in ["7443", "9902"] {
                assert!(edge_config.contains(&format!("port_value: {port} }}")));
                assert!(edge.text.contains(&format!("containerPort: {port}\n")));
            }
            // the identities the arbiter trusts are the ones SPIRE hands out
            let domain = flag_value(arbiter, "--trust-domain").unwrap_or_default();
            assert_eq!(
                flag_value(arbiter, "--edge-identity").as_deref(),
                Some(format!("spiffe://{domain}/latchkey/edge").as_str())
            );
            assert!(edge_config.contains(&format!("spiffe://{domain}/latchkey/arbiter")));
            assert!(
                !long_flags(arbiter).contains(&"--allow-direct-workloads".to_string()),
                "{overlay}: workloads must come through the edge"
            );
            assert!(!long_flags(arbiter).contains(&"--insecure-dev".to_string()));
            assert!(!long_flags(arbiter).contains(&"--trust-unwitnessed-log".to_string()));
        }
        Ok(())
    }

    /// The dev overlay's policies are what the arbiter loads (classes/ and
    /// grants/ as the Deployment projects them).
    #[test]
    fn the_dev_overlay_policies_load() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let src = repo().join("deploy/overlays/dev/policies");
        for (file, sub) in [("classes.toml", "classes"), ("grants.toml", "grants")] {
            std::fs::create_dir_all(dir.path().join(sub))?;
            std::fs::copy(src.join(file), dir.path().join(sub).join(file))?;
        }
        let set = latchkey_policies::PolicySet::load_dir(
            dir.path(),
            latchkey_policies::Date::today_utc(),
        )
        .context("deploy/overlays/dev/policies")?;
        assert!(set.classes().contains_key("demo"));
        let demo = "spiffe://latchkey.internal/workload/latchkey-demo/demo";
        assert!(set.grants().identities().any(|i| i == demo));
        Ok(())
    }
}
