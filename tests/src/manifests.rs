//! Checks on the shipped manifests (deploy/) that need no Kubernetes API server.
//!
//! Issue 18: every etcd Latchkey starts — the shipped StatefulSet, dev-up's and
//! the tests' — runs with auto-compaction, because every grant, release and
//! renewal writes a revision and an uncompacted etcd grows until its quota
//! refuses writes.

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use crate::etcd::{MemberFlags, member_flags};

    fn repo() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
    }

    fn read(path: &str) -> String {
        let full = repo().join(path);
        std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("reading {}: {e}", full.display()))
    }

    /// The value of `--flag=value` (or `--flag value`) in a list of arguments.
    fn flag<'a>(args: &'a [&'a str], name: &str) -> Option<&'a str> {
        args.iter().enumerate().find_map(|(i, a)| {
            let rest = a.strip_prefix(name)?;
            if let Some(v) = rest.strip_prefix('=') {
                Some(v)
            } else if rest.is_empty() {
                args.get(i + 1).copied()
            } else {
                None
            }
        })
    }

    /// The etcd command of the shipped StatefulSet: its `- --flag=value` lines.
    fn statefulset_args(yaml: &str) -> Vec<&str> {
        yaml.lines()
            .filter_map(|l| l.trim().strip_prefix("- "))
            .filter(|a| a.starts_with("--"))
            .collect()
    }

    #[test]
    fn the_shipped_etcd_compacts_keeps_an_hour_and_has_a_quota() {
        let yaml = read("deploy/base/etcd/statefulset.yaml");
        let args = statefulset_args(&yaml);
        assert_eq!(flag(&args, "--auto-compaction-mode"), Some("periodic"));
        assert_eq!(flag(&args, "--auto-compaction-retention"), Some("1h"));
        assert_eq!(flag(&args, "--quota-backend-bytes"), Some("8589934592"));
        // mutual TLS for clients and peers (ADR-18: only the arbiter has a client cert)
        assert!(args.contains(&"--client-cert-auth"), "{args:?}");
        assert!(args.contains(&"--peer-client-cert-auth"), "{args:?}");
    }

    #[test]
    fn dev_up_and_the_tests_etcd_compact_too() {
        let dev_up = read("scripts/dev-up");
        let words: Vec<&str> = dev_up.split_whitespace().collect();
        assert_eq!(flag(&words, "--auto-compaction-mode"), Some("revision"));
        assert_eq!(flag(&words, "--auto-compaction-retention"), Some("10000"));

        let dir = Path::new("/nonexistent");
        let ours = member_flags(&MemberFlags {
            name: "m",
            data_dir: dir,
            client_url: "http://127.0.0.1:1",
            peer_url: "http://127.0.0.1:2",
            initial_cluster: "m=http://127.0.0.1:2",
            cluster_token: "t",
        });
        let ours: Vec<&str> = ours.iter().filter_map(|a| a.to_str()).collect();
        assert_eq!(flag(&ours, "--auto-compaction-mode"), Some("revision"));
        assert_eq!(flag(&ours, "--auto-compaction-retention"), Some("10000"));
    }
}
