//! What a process has used, from `/proc`: the benchmarks print CPU per
//! process beside their results, so a reader sees which process a 2-core
//! machine ran out of.

/// Clock ticks per second of `/proc/<pid>/stat` (USER_HZ, 100 on Linux).
const TICKS_PER_SEC: f64 = 100.0;

/// CPU time (user + system) and resident memory of one process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub cpu_ticks: u64,
    pub rss_kib: u64,
}

impl Usage {
    /// CPU seconds between `earlier` and this.
    pub fn cpu_secs_since(&self, earlier: &Usage) -> f64 {
        ticks_to_secs(self.cpu_ticks.saturating_sub(earlier.cpu_ticks))
    }
}

/// `pid`'s usage now (zeros for a process that is gone).
pub fn usage(pid: u32) -> Usage {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the ")" of the command name: utime and stime are the
    // 12th and 13th there.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    Usage {
        cpu_ticks: tick(11) + tick(12),
        rss_kib,
    }
}

pub fn ticks_to_secs(t: u64) -> f64 {
    t as f64 / TICKS_PER_SEC
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_uses_some_memory() {
        let me = usage(std::process::id());
        assert!(me.rss_kib > 0, "{me:?}");
        assert_eq!(usage(u32::MAX), Usage::default());
    }
}
