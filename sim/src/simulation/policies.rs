//! The policy files the whole arbiter's handlers read in a run
//! ([`SimConfig::whole_arbiter`]): reviewed files as an operator writes
//! them, in the run's scratch directory.
//!
//! Three classes of the TTL the workers renew by (30 s or more: the open
//! class is advisory) on the entity tier, and `sim-coord` (fenced) on the
//! coord tier for the `simc` namespace (`SimConfig::coord_keys`):
//! `sim` (fenced: its pause test is the simulation's own fenced resource,
//! which accepts only a token above the key's mark), `sim-durable` (fenced,
//! waiters queued in the log) and `sim-open` (advisory, open on quorum
//! loss); one grant of the `sim` and `simc` namespaces to every worker's identity
//! (`spiffe://sim.test/w/<n>`, a per-pod pattern, so the workers share
//! one grant subject).
//!
//! [`SimConfig::whole_arbiter`]: super::SimConfig::whole_arbiter

use std::path::Path;
use std::time::SystemTime;

/// The trust domain of the workers' identities.
pub(crate) const TRUST_DOMAIN: &str = "sim.test";
pub(crate) const CLASS: &str = "sim";
pub(crate) const DURABLE_CLASS: &str = "sim-durable";
pub(crate) const OPEN_CLASS: &str = "sim-open";
/// The electors' class (kind = "election", fenced like `sim`).
pub(crate) const ELECTION_CLASS: &str = "sim-election";
/// The coord keys' class (coord tier, fenced like `sim`), naming
/// [`COORD_NAMESPACE`].
pub(crate) const COORD_CLASS: &str = "sim-coord";
/// The namespace of the coord keys (`SimConfig::coord_keys`).
pub(crate) const COORD_NAMESPACE: &str = "simc";

/// A worker's SPIFFE ID.
/// The operator who moves shards (admin.v1, in the dev mode's header).
pub(crate) const OPERATOR: &str = "spiffe://sim.test/operator";

pub(crate) fn identity(worker: usize) -> String {
    format!("spiffe://{TRUST_DOMAIN}/w/{worker}")
}

/// Writes `dir/classes`, `dir/grants` and `dir/pause-tests`. `rollout`:
/// the files of a policy change half rolled out, in which no coord-tier
/// class names [`COORD_NAMESPACE`] any more (`sim-coord` is an entity-tier
/// class), as some arbiters read them while the others still read the
/// files before it (`SimConfig::coord_rollout`).
pub(crate) fn write(dir: &Path, ttl_seconds: u32, rollout: bool) -> std::io::Result<()> {
    for sub in ["classes", "grants", "pause-tests"] {
        std::fs::create_dir_all(dir.join(sub))?;
    }
    let (today, next_year) = dates(SystemTime::now());
    let fenced = |name: &str, fairness: &str| {
        format!(
            "[[class]]\nname = \"{name}\"\ndescription = \"The simulation's fenced keys.\"\ntier = \"entity\"\nenforcement = \"fenced\"\nttlSeconds = {ttl_seconds}\nfairness = \"{fairness}\"\nmaxWaitersPerKey = 16\n[class.pauseTest]\nresource = \"sim:memory\"\nresult = \"pause-tests/{name}.json\"\n\n"
        )
    };
    let classes = format!(
        "{}{}[[class]]\nname = \"{OPEN_CLASS}\"\ndescription = \"The simulation's open keys: granted from memory on quorum loss.\"\ntier = \"entity\"\nenforcement = \"advisory\"\nttlSeconds = {ttl_seconds}\nonQuorumLoss = \"open\"\nmaxWaitersPerKey = 16\nriskOwner = \"sim@example.com\"\nwaiverExpires = \"{next_year}\"\n",
        fenced(CLASS, "memory"),
        fenced(DURABLE_CLASS, "durable"),
    );
    std::fs::write(dir.join("classes/sim.toml"), classes)?;
    std::fs::write(
        dir.join("classes/sim-election.toml"),
        format!(
            "[[class]]\nname = \"{ELECTION_CLASS}\"\nkind = \"election\"\ndescription = \"The simulation's elections.\"\ntier = \"coord\"\nenforcement = \"fenced\"\nttlSeconds = {ttl_seconds}\nmaxWaitersPerKey = 16\n[class.pauseTest]\nresource = \"sim:memory\"\nresult = \"pause-tests/{ELECTION_CLASS}.json\"\n"
        ),
    )?;
    std::fs::write(
        dir.join("classes/sim-coord.toml"),
        format!(
            "[[class]]\nname = \"{COORD_CLASS}\"\ndescription = \"The simulation's coord keys.\"\n{}\nenforcement = \"fenced\"\nttlSeconds = {ttl_seconds}\nmaxWaitersPerKey = 16\n[class.pauseTest]\nresource = \"sim:memory\"\nresult = \"pause-tests/{COORD_CLASS}.json\"\n",
            match rollout {
                true => "tier = \"entity\"".to_string(),
                false => format!("tier = \"coord\"\nnamespaces = [\"{COORD_NAMESPACE}\"]"),
            }
        ),
    )?;
    std::fs::write(
        dir.join("grants/sim.toml"),
        format!(
            "[[grant]]\nidentity = \"spiffe://{TRUST_DOMAIN}/w/*\"\nprefixes = [\"sim\", \"{COORD_NAMESPACE}\"]\n\n[[operator]]\nidentity = \"{OPERATOR}\"\n"
        ),
    )?;
    for name in [CLASS, DURABLE_CLASS, ELECTION_CLASS, COORD_CLASS] {
        let result = format!(
            "{{\"version\":1,\"class\":\"{name}\",\"resource\":\"sim:memory\",\"startedAt\":\"{today}T00:00:00Z\",\"finishedAt\":\"{today}T00:00:01Z\",\"outcome\":\"pass\",\"kit\":\"latchkey-sim\",\"evidence\":{{\"ttlSeconds\":{ttl_seconds},\"pausedForMs\":{},\"firstWrite\":\"accepted\",\"secondHolderWrite\":\"accepted\",\"secondTokenGreater\":true,\"staleWriteAfterResume\":\"rejected\",\"finalRowFrom\":\"second-holder\"}},\"failure\":null}}\n",
            u64::from(ttl_seconds) * 1000 + 500
        );
        std::fs::write(dir.join(format!("pause-tests/{name}.json")), result)?;
    }
    Ok(())
}

/// Today and a year from now (UTC, `YYYY-MM-DD`).
fn dates(now: SystemTime) -> (String, String) {
    let days = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400);
    let (y, m, d) = civil(i64::try_from(days).unwrap_or(0));
    (
        format!("{y:04}-{m:02}-{d:02}"),
        format!("{:04}-{m:02}-01", y + 1),
    )
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian
/// calendar (Howard Hinnant's `civil_from_days`).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = u32::try_from(doy - (153 * mp + 2) / 5 + 1).unwrap_or(1);
    let m = u32::try_from(if mp < 10 { mp + 3 } else { mp - 9 }).unwrap_or(1);
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil(0), (1970, 1, 1));
        assert_eq!(civil(20_788), (2026, 12, 1));
        assert_eq!(civil(11_016), (2000, 2, 29));
    }
}
