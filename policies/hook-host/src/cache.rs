//! Compiled modules on disk, named by the SHA-256 of the module bytes and a
//! hash of the engine's compatibility settings, so a restart or a hot
//! reload of an unchanged module skips Cranelift.
//!
//! The cache directory must be writable only by the arbiter: a file there
//! becomes machine code. Files are written to a temporary name and renamed,
//! so a reader never sees half a file; wasmtime checks the header (version,
//! target, settings) on load and a mismatch falls back to compiling.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use tracing::{debug, warn};
use wasmtime::{Engine, Module};

/// Hex SHA-256 of `bytes`.
pub fn digest(bytes: &[u8]) -> String {
    let sum = Sha256::digest(bytes);
    sum.iter().map(|b| format!("{b:02x}")).collect()
}

fn engine_tag(engine: &Engine) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut h);
    h.finish()
}

/// Where `digest`'s compiled form lives in `dir` for `engine`.
pub fn path_for(dir: &Path, engine: &Engine, digest: &str) -> PathBuf {
    dir.join(format!("{digest}-{:016x}.cwasm", engine_tag(engine)))
}

/// Whether the compiled module came from disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Cache,
    Compiled,
}

/// Compiles `bytes`, or loads the compiled form cached under `digest`.
pub fn load(
    engine: &Engine,
    dir: Option<&Path>,
    bytes: &[u8],
    digest: &str,
) -> Result<(Module, Source), wasmtime::Error> {
    let Some(dir) = dir else {
        return Ok((Module::new(engine, bytes)?, Source::Compiled));
    };
    let path = path_for(dir, engine, digest);
    // Read into memory rather than mapped: a cache file truncated in place
    // while mapped would crash the process (SIGBUS).
    if let Ok(compiled) = std::fs::read(&path) {
        #[allow(unsafe_code)]
        // SAFETY: the file was written by `store` below from
        // `Module::serialize` into the arbiter's private state directory,
        // under the content hash of the module it was compiled from;
        // wasmtime checks its header against this engine.
        let cached = unsafe { Module::deserialize(engine, &compiled) };
        match cached {
            Ok(module) => return Ok((module, Source::Cache)),
            Err(e) => {
                warn!(path = %path.display(), error = %e, "unusable compiled hook in the cache; compiling again");
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    let module = Module::new(engine, bytes)?;
    store(dir, &path, &module);
    Ok((module, Source::Compiled))
}

fn store(dir: &Path, path: &Path, module: &Module) {
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let bytes = module
            .serialize()
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, path)
    };
    match write() {
        Ok(()) => debug!(path = %path.display(), "cached compiled hook"),
        // The cache only saves time; a failure to write it is not an error.
        Err(e) => warn!(path = %path.display(), error = %e, "cannot cache compiled hook"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compiled_once_then_read_back() {
        let engine = Engine::default();
        let dir = tempfile::tempdir().unwrap();
        let bytes = wat::parse_str("(module (func (export \"f\")))").unwrap();
        let d = digest(&bytes);
        let (_, first) = load(&engine, Some(dir.path()), &bytes, &d).unwrap();
        assert_eq!(first, Source::Compiled);
        assert!(path_for(dir.path(), &engine, &d).is_file());
        let (m, second) = load(&engine, Some(dir.path()), &bytes, &d).unwrap();
        assert_eq!(second, Source::Cache);
        assert!(m.get_export("f").is_some());
        // A corrupt cache file is replaced, not trusted.
        std::fs::write(path_for(dir.path(), &engine, &d), b"junk").unwrap();
        let (_, third) = load(&engine, Some(dir.path()), &bytes, &d).unwrap();
        assert_eq!(third, Source::Compiled);
    }
}
