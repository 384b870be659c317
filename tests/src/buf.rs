//! buf's lint and breaking-change checks of proto/ (issue 20), run with the real
//! `buf` (npm `@bufbuild/buf`, installed by scripts/setup) so `scripts/test`
//! runs them. The configuration is proto/buf.yaml; the baseline of the breaking
//! check is the last released protos, proto/released/latchkey-proto.binpb.

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::process::{Command, Output};

    const BASELINE: &str = "proto/released/latchkey-proto.binpb";

    fn repo() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
    }

    fn buf(dir: &Path, args: &[&str]) -> Output {
        Command::new("buf")
            .args(args)
            .current_dir(dir)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "buf did not run ({e}); scripts/setup installs it: npm install -g @bufbuild/buf"
                )
            })
    }

    fn text(out: &Output) -> String {
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    #[test]
    fn buf_lint_passes() {
        let out = buf(&repo(), &["lint", "proto"]);
        assert!(out.status.success(), "buf lint proto:\n{}", text(&out));
    }

    #[test]
    fn no_breaking_change_against_the_released_protos() {
        let out = buf(&repo(), &["breaking", "proto", "--against", BASELINE]);
        assert!(
            out.status.success(),
            "buf breaking against {BASELINE} (a deliberate break needs a new package version):\n{}",
            text(&out)
        );
    }

    /// The breaking check is live: a copy of proto/ with one field renumbered
    /// and one RPC removed fails it, naming both.
    #[test]
    fn the_breaking_check_catches_a_renumbered_field_and_a_removed_rpc() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let copy = tmp.path().join("proto");
        for rel in [
            "buf.yaml",
            "latchkey/lock/v1/lock.proto",
            "latchkey/admin/v1/admin.proto",
        ] {
            let dest = copy.join(rel);
            std::fs::create_dir_all(dest.parent().unwrap_or(&copy))
                .unwrap_or_else(|e| panic!("mkdir: {e}"));
            std::fs::copy(repo().join("proto").join(rel), &dest)
                .unwrap_or_else(|e| panic!("copy {rel}: {e}"));
        }
        let lock = copy.join("latchkey/lock/v1/lock.proto");
        let proto = std::fs::read_to_string(&lock).unwrap_or_else(|e| panic!("read: {e}"));
        let renumbered = proto.replacen("string key = 1;", "string key = 99;", 1);
        assert_ne!(renumbered, proto, "no `string key = 1;` in lock.proto");
        let removed: String = renumbered
            .lines()
            .filter(|l| !l.trim_start().starts_with("rpc Inspect("))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_ne!(removed, renumbered, "no `rpc Inspect(` in lock.proto");
        std::fs::write(&lock, removed).unwrap_or_else(|e| panic!("write: {e}"));

        let baseline = repo().join(BASELINE);
        let baseline = baseline.to_string_lossy();
        let out = buf(tmp.path(), &["breaking", "proto", "--against", &baseline]);
        let said = text(&out);
        assert!(!out.status.success(), "buf breaking passed:\n{said}");
        assert!(said.contains("Inspect"), "{said}");
        assert!(said.contains(r#"field "1" with name "key""#), "{said}");
    }
}
