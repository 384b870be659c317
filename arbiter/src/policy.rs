//! The lock classes and prefix grants in force, reloaded when their files
//! change. A bad change is refused whole: the last good set stays in force
//! and the reason is logged (and reported by the admin status).
//!
//! The directory holds either the reviewed policy files (a `classes/`
//! subdirectory) or, as Argo CD delivers them (ADR-24), LockClass and
//! LockGrant manifests (`*.yaml`, e.g. a mounted ConfigMap), checked by the
//! same loader rules (`latchkey-crds`). Which one is decided at every load.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use latchkey_crds::CrdError;
use latchkey_hook_host::HookHost;
use latchkey_policies::{CLASSES_DIR, Date, PolicyError, PolicySet, fingerprint};
use parking_lot::{Mutex, RwLock};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Why a policy directory did not load.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Files(#[from] PolicyError),
    #[error("{dir} (LockClass/LockGrant manifests): {source}")]
    Manifests {
        dir: String,
        #[source]
        source: Box<CrdError>,
    },
}

/// A policy directory (with `classes/`) or a directory of manifests.
fn is_manifest_dir(dir: &Path) -> bool {
    !dir.join(CLASSES_DIR).is_dir()
}

fn load_set(dir: &Path) -> Result<PolicySet, LoadError> {
    if is_manifest_dir(dir) {
        latchkey_crds::load_manifest_dir(dir, std::time::SystemTime::now()).map_err(|source| {
            LoadError::Manifests {
                dir: dir.display().to_string(),
                source: Box::new(source),
            }
        })
    } else {
        Ok(PolicySet::load_dir(dir, Date::today_utc())?)
    }
}

fn fingerprint_of(dir: &Path) -> Option<u64> {
    if is_manifest_dir(dir) {
        latchkey_crds::manifest_fingerprint(dir).ok()
    } else {
        fingerprint(dir).ok()
    }
}

pub struct Policies {
    dir: PathBuf,
    current: RwLock<Arc<PolicySet>>,
    fingerprint: Mutex<u64>,
    last_error: RwLock<Option<String>>,
    /// Synced with every new set before it is swapped in, and on each poll.
    hooks: Option<Arc<HookHost>>,
}

impl crate::table::ClassPermits for Policies {
    fn permits(&self, class: &str) -> Option<u32> {
        let set = self.current();
        let class = set.class(class)?;
        match class.kind {
            latchkey_policies::ClassKind::Semaphore => class.permits,
            _ => None,
        }
    }

    fn max_hold(&self, class: &str) -> Option<std::time::Duration> {
        let set = self.current();
        let seconds = set.class(class)?.max_hold_seconds?;
        Some(std::time::Duration::from_secs(u64::from(seconds)))
    }

    fn any_max_hold(&self) -> bool {
        self.current()
            .classes()
            .values()
            .any(|c| c.max_hold_seconds.is_some())
    }
}

impl Policies {
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        // Fingerprint first: an edit made during the load is then seen as a change.
        let print = fingerprint_of(dir).unwrap_or(0);
        let set = load_set(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            current: RwLock::new(Arc::new(set)),
            fingerprint: Mutex::new(print),
            last_error: RwLock::new(None),
            hooks: None,
        })
    }

    /// Keeps `host` in line with the policies in force (see `refresh`).
    pub fn with_hooks(mut self, host: Arc<HookHost>) -> Self {
        self.hooks = Some(host);
        self
    }

    /// One poll: reload changed policy files, else pick up rebuilt hook
    /// modules of the set in force. Blocking; run off the request path.
    pub fn refresh(&self) {
        if !self.reload_if_changed()
            && let Some(host) = &self.hooks
        {
            host.sync(&self.current(), &self.dir);
        }
    }

    pub fn current(&self) -> Arc<PolicySet> {
        self.current.read().clone()
    }

    pub fn last_error(&self) -> Option<String> {
        self.last_error.read().clone()
    }

    /// Reloads if the files changed. Returns true when a new set took effect.
    pub fn reload_if_changed(&self) -> bool {
        let Some(print) = fingerprint_of(&self.dir) else {
            return false;
        };
        {
            let mut last = self.fingerprint.lock();
            if *last == print {
                return false;
            }
            *last = print;
        }
        match load_set(&self.dir) {
            Ok(set) => {
                // The new set's hooks are compiled before it takes effect.
                if let Some(host) = &self.hooks {
                    host.sync(&set, &self.dir);
                }
                info!(
                    dir = %self.dir.display(),
                    classes = set.classes().len(),
                    "policies reloaded"
                );
                *self.current.write() = Arc::new(set);
                *self.last_error.write() = None;
                true
            }
            Err(e) => {
                warn!(dir = %self.dir.display(), error = %e, "policy change refused; keeping the last good policies");
                *self.last_error.write() = Some(e.to_string());
                false
            }
        }
    }

    pub fn spawn_reloader(
        self: Arc<Self>,
        every: Duration,
        stop: CancellationToken,
        tasks: &tokio_util::task::TaskTracker,
    ) {
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {
                        let this = self.clone();
                        let _ = tokio::task::spawn_blocking(move || this.refresh()).await;
                    }
                }
            }
        });
    }
}
