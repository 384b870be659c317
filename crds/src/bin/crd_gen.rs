//! Writes the LockClass and LockGrant CRDs to deploy/crds/ (or to the
//! directory given as the only argument). The crate's drift test fails
//! until this has been run after a change to crds/src/resources.rs.

use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    let dir = match std::env::args_os().nth(1) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/crds"),
    };
    std::fs::create_dir_all(&dir)?;
    for (name, text) in latchkey_crds::crd_files() {
        let path = dir.join(name);
        std::fs::write(&path, text)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
