//! The lock classes and prefix grants in force, reloaded when their files
//! change. A bad change is refused whole: the last good set stays in force
//! and the reason is logged (and reported by the admin status).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use latchkey_hook_host::HookHost;
use latchkey_policies::{Date, PolicyError, PolicySet, fingerprint};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub struct Policies {
    dir: PathBuf,
    current: RwLock<Arc<PolicySet>>,
    fingerprint: Mutex<u64>,
    last_error: RwLock<Option<String>>,
    /// Synced with every new set before it is swapped in, and on each poll.
    hooks: Option<Arc<HookHost>>,
}

impl Policies {
    pub fn load(dir: &Path) -> Result<Self, PolicyError> {
        // Fingerprint first: an edit made during the load is then seen as a change.
        let print = fingerprint(dir).unwrap_or(0);
        let set = PolicySet::load_dir(dir, Date::today_utc())?;
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
        match self.current.read() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    pub fn last_error(&self) -> Option<String> {
        self.last_error.read().ok().and_then(|e| e.clone())
    }

    /// Reloads if the files changed. Returns true when a new set took effect.
    pub fn reload_if_changed(&self) -> bool {
        let Ok(print) = fingerprint(&self.dir) else {
            return false;
        };
        {
            let Ok(mut last) = self.fingerprint.lock() else {
                return false;
            };
            if *last == print {
                return false;
            }
            *last = print;
        }
        match PolicySet::load_dir(&self.dir, Date::today_utc()) {
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
                if let Ok(mut cur) = self.current.write() {
                    *cur = Arc::new(set);
                }
                if let Ok(mut e) = self.last_error.write() {
                    *e = None;
                }
                true
            }
            Err(e) => {
                warn!(dir = %self.dir.display(), error = %e, "policy change refused; keeping the last good policies");
                if let Ok(mut le) = self.last_error.write() {
                    *le = Some(e.to_string());
                }
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
