//! The docs' reference tables checked against the code (issue 32): the
//! arbiter's metrics in the operators' guide, and the lock log's operations
//! in docs/grant-protocol.md. A metric or an operation added, renamed or
//! removed without its row fails here.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context as _, ensure};

use crate::deploy::repo;

/// The rows of the markdown table that follows `heading` in `doc`: each
/// row's cells, trimmed, the header and separator rows left out.
pub fn table_after(doc: &str, heading: &str) -> anyhow::Result<Vec<Vec<String>>> {
    let start = doc
        .find(heading)
        .with_context(|| format!("no {heading:?} in the document"))?;
    let rows: Vec<Vec<String>> = doc[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            l.trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect();
    ensure!(rows.len() > 2, "no table after {heading:?}");
    Ok(rows.into_iter().skip(2).collect())
}

/// The names written in backticks in `cell`, with the docs' shorthands
/// expanded: `_name` is `prefix_name`, `a_{b,c}_d` is `a_b_d` and `a_c_d`.
pub fn names_in(cell: &str, prefix: &str) -> Vec<String> {
    let mut names = Vec::new();
    for (i, part) in cell.split('`').enumerate() {
        if i % 2 == 0 || part.contains(' ') {
            continue;
        }
        let full = match part.strip_prefix('_') {
            Some(rest) => format!("{prefix}_{rest}"),
            None => part.to_string(),
        };
        match (full.find('{'), full.find('}')) {
            (Some(open), Some(close)) if open < close => {
                for choice in full[open + 1..close].split(',') {
                    names.push(format!("{}{choice}{}", &full[..open], &full[close + 1..]));
                }
            }
            _ => names.push(full),
        }
    }
    names
}

/// Each trait of arbiter/src/lock_log.rs and the methods it declares.
pub fn lock_log_traits() -> anyhow::Result<BTreeMap<String, BTreeSet<String>>> {
    let source = std::fs::read_to_string(repo().join("arbiter/src/lock_log.rs"))?;
    let mut traits = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in source.lines() {
        if let Some(rest) = line.strip_prefix("pub trait ") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            traits.insert(name.clone(), BTreeSet::new());
            current = Some(name);
        } else if line == "}" {
            current = None;
        } else if let Some(name) = &current {
            let method = line
                .trim_start()
                .strip_prefix("async fn ")
                .or_else(|| line.trim_start().strip_prefix("fn "))
                .filter(|_| line.starts_with("    ") && !line.starts_with("     "));
            if let Some(method) = method {
                let method: String = method
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                traits.entry(name.clone()).or_default().insert(method);
            }
        }
    }
    Ok(traits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_operators_metrics_table_names_every_arbiter_metric_and_only_those() -> anyhow::Result<()>
    {
        let doc = std::fs::read_to_string(repo().join("docs/guides/operators.md"))?;
        let mut documented = BTreeSet::new();
        for row in table_after(&doc, "## Metrics")? {
            documented.extend(names_in(&row[0], "latchkey_arbiter"));
        }
        // The exposition names a histogram by its series; the table by
        // its family.
        let exported: BTreeSet<String> = crate::deploy::arbiter_metric_names()?
            .into_iter()
            .map(|n| {
                ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| n.strip_suffix(s).map(str::to_string))
                    .unwrap_or(n)
            })
            .collect();
        let undocumented: Vec<_> = exported.difference(&documented).collect();
        let unknown: Vec<_> = documented.difference(&exported).collect();
        ensure!(
            undocumented.is_empty() && unknown.is_empty(),
            "docs/guides/operators.md's metrics table: missing {undocumented:?}; names no metric the arbiter exports: {unknown:?}"
        );
        Ok(())
    }

    #[test]
    fn the_protocols_operations_table_matches_the_lock_log_traits() -> anyhow::Result<()> {
        let doc = std::fs::read_to_string(repo().join("docs/grant-protocol.md"))?;
        let traits = lock_log_traits()?;
        ensure!(
            traits.contains_key("HoldLog") && traits.contains_key("LockLog"),
            "lock_log.rs: traits not found ({:?})",
            traits.keys().collect::<Vec<_>>()
        );
        // The traits LockLog is made of, as lock_log.rs declares it.
        let source = std::fs::read_to_string(repo().join("arbiter/src/lock_log.rs"))?;
        // The declaration as rustfmt lays it out: on one line, or one
        // supertrait per line.
        let declaration = source
            .split_once("pub trait LockLog:")
            .and_then(|(_, rest)| rest.split_once('{'))
            .context("lock_log.rs: no `pub trait LockLog: ... {}`")?
            .0;
        let log_traits: Vec<&str> = declaration
            .split('+')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .collect();
        ensure!(log_traits.len() >= 4, "LockLog is made of {log_traits:?}");
        let declared: BTreeMap<&str, &str> = traits
            .iter()
            .filter(|(t, _)| log_traits.contains(&t.as_str()))
            .flat_map(|(t, methods)| methods.iter().map(move |m| (m.as_str(), t.as_str())))
            .collect();
        let mut documented = BTreeMap::new();
        for row in table_after(&doc, "## The log's operations")? {
            for op in names_in(&row[0], "") {
                documented.insert(op, row[1].clone());
            }
        }
        let mut wrong = Vec::new();
        for (op, owner) in &declared {
            match documented.get(*op) {
                None => wrong.push(format!("{op} ({owner}) has no row")),
                // A row names its trait, and may say where one of its
                // operations differs: "HoldLog (`watch_queue`: DurableQueueLog)".
                Some(cell)
                    if !(cell.starts_with(owner) || cell.contains(&format!("`{op}`: {owner}"))) =>
                {
                    wrong.push(format!("{op} is in {owner}, its row says {cell:?}"));
                }
                Some(_) => {}
            }
        }
        for op in documented.keys() {
            if !declared.contains_key(op.as_str()) {
                wrong.push(format!("{op} is in the table and in no LockLog trait"));
            }
        }
        ensure!(wrong.is_empty(), "docs/grant-protocol.md: {wrong:#?}");
        Ok(())
    }

    #[test]
    fn shorthands_expand() {
        assert_eq!(
            names_in(
                "`latchkey_arbiter_hook_{invocations,denials}_total`, `_epoch`",
                "latchkey_arbiter"
            ),
            vec![
                "latchkey_arbiter_hook_invocations_total",
                "latchkey_arbiter_hook_denials_total",
                "latchkey_arbiter_epoch"
            ]
        );
    }
}
