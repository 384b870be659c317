//! The seal protocol (ADR-03) over the lock log: every answer's header is
//! checked (cluster id and revision against the epoch record, the
//! high-water mark and what this arbiter has seen) before anything in it is
//! used; a restore seals this arbiter and, through the seal record, every
//! other; only an operator's epoch advance lifts it.
//!
//! With a coord cluster, the witness is checked in both directions: the
//! coord cluster's mark must lie above every grant of the lock log (a restore
//! of the lock log), and the coord cluster must show at least what the lock
//! log recorded of it (`sys/coord-seen`) and what this arbiter read from it
//! before (a restore of the coord cluster). Either seals.

use std::future::Future;
use std::sync::Arc;

use parking_lot::Mutex;

use tracing::{error, info, warn};

use crate::epoch::{EpochGuard, EpochState};
use crate::error::ArbiterError;
use crate::high_water::{HighWater, Mark};
use crate::lock_log::{Header, LockLog, LogResult};
use crate::records::{
    CoordSeenRecord, EpochRecord, SealRecord, decode, decode_map_fence, encode, now_unix_ms,
    try_decode,
};
use crate::table::MapVersion;
use crate::token;
use crate::witness::{SharedWitness, Witness, Witnessed};

mod coord_seen;

pub use coord_seen::COORD_SEEN_EVERY;
use coord_seen::{CoordSeen, witnessed_of};

/// The arbiter's view of the epoch and its seal, and the checks every answer
/// goes through.
pub struct Seal {
    log: Arc<dyn LockLog>,
    guard: Arc<EpochGuard>,
    high_water: Arc<HighWater>,
    /// The highest revision any checked answer has shown in the serving
    /// epoch (in memory only). The durable mark holds this arbiter's own
    /// grants; this one also holds every other arbiter's grants it has seen,
    /// so a restore to below them seals this arbiter too, even when its own
    /// grants all lie below the restored revision.
    seen: Mutex<Option<Mark>>,
    /// The coord cluster's memory of this lock log, when there is one.
    witness: Option<SharedWitness>,
    /// What the witness said last.
    witnessed: Mutex<Witnessed>,
    /// What the lock log recorded of the witness.
    coord_seen: Mutex<CoordSeen>,
    /// The shard map version this arbiter routes by, checked against the
    /// cluster's fence whenever it is about to grant.
    map_version: MapVersion,
}

impl Seal {
    pub fn new(
        log: Arc<dyn LockLog>,
        guard: Arc<EpochGuard>,
        high_water: Arc<HighWater>,
        witness: Option<Arc<dyn Witness>>,
        map_version: MapVersion,
    ) -> Self {
        Self {
            log,
            guard,
            high_water,
            seen: Mutex::new(None),
            witness: witness.map(SharedWitness::new),
            witnessed: Mutex::new(Witnessed::default()),
            coord_seen: Mutex::new(CoordSeen::default()),
            map_version,
        }
    }

    /// Where the witness lives (`None`: the state directory is the only one).
    pub fn witness(&self) -> Option<String> {
        self.witness.as_ref().map(|w| w.witness().describe())
    }

    /// What the witness said last.
    pub fn witnessed(&self) -> Witnessed {
        *self.witnessed.lock()
    }

    /// What the lock log has recorded of the coord cluster in the serving
    /// epoch (`None`: nothing yet, or no coord cluster).
    pub fn coord_seen(&self) -> Option<Witnessed> {
        let epoch = self.guard.state().map(|s| s.epoch());
        self.coord_seen.lock().in_epoch(epoch)
    }

    /// Reads the witness (a read sent after this call began) so the next
    /// request's mark covers every token handed out before it, and checks
    /// the witness itself: it must show at least what this arbiter read from
    /// it before and what the lock log recorded of it. One that shows less
    /// was restored from a snapshot: that seals (the returned error is a
    /// store error only; the seal shows in the guard). A no-op without a
    /// witness.
    pub async fn refresh_witness(&self) -> Result<(), ArbiterError> {
        let Some(shared) = &self.witness else {
            return Ok(());
        };
        let lock_epoch = self.guard.state().map(|s| s.epoch());
        // Read from the lock log before the witness read is sent: the
        // witness must show at least this.
        let recorded = self.coord_seen.lock().in_epoch(lock_epoch);
        let read = shared.read_fresh().await?;
        let went_back = match (read.went_back_from, recorded) {
            (Some(before), _) => Some((before, "an earlier read by this arbiter")),
            (None, Some(recorded)) if !read.now.covers(&recorded) => {
                Some((recorded, "the lock cluster's record of it (sys/coord-seen)"))
            }
            _ => None,
        };
        if let Some((before, source)) = went_back {
            let reason = format!(
                "the coord cluster ({}) shows less than it did: mark {} and epoch {} now, {source} showed mark {} and epoch {}; it was restored from an earlier snapshot, so a restore of the lock cluster could now go unnoticed (advance the epoch: `latchctl admin advance-epoch`)",
                shared.witness().describe(),
                show_mark(read.now.mark),
                read.now.epoch,
                show_mark(before.mark),
                before.epoch,
            );
            // Only for the epoch the check was for: an advance installed
            // meanwhile (after a restore of the witness) starts over.
            if self.guard.state().map(|s| s.epoch()) == lock_epoch && self.guard.seal_now(&reason) {
                self.publish_seal(&reason).await;
            }
            return Ok(());
        }
        {
            let mut witnessed = self.witnessed.lock();
            *witnessed = witnessed.max(read.now);
        }
        if let Some(lock_epoch) = lock_epoch {
            self.record_coord_seen(lock_epoch, read.now).await;
        }
        Ok(())
    }

    /// [`Self::checked`] for a write whose answer reaches a caller (a grant,
    /// a hand-over, a claim, a release): the witness is read first, and an
    /// answer that `committed`
    /// must lie strictly above every grant vouched for before it was sent (a
    /// committed write takes a new revision; one at or below the mark comes
    /// from a restored log).
    pub async fn checked_write<T>(
        &self,
        request: impl Future<Output = LogResult<T>>,
        committed: impl Fn(&T) -> bool,
    ) -> Result<(T, Header), ArbiterError> {
        self.refresh_witness().await?;
        if self.witness.is_some() {
            // A restore of the coord cluster seen just now: send nothing.
            self.guard.serving()?;
        }
        let mark = self.mark_before_request();
        let answer = request.await?;
        let header = answer.header;
        self.observe(mark, header.cluster_id, Some(header.revision))
            .await?;
        if committed(&answer.value)
            && let (Some(mark), Some(state)) = (mark, self.guard.state())
            && mark.epoch == state.epoch()
            && mark.cluster_id == header.cluster_id
            && header.revision <= mark.revision
        {
            let reason = format!(
                "a grant committed at etcd revision {}, not above a grant of epoch {} already vouched for: the lock log was restored from an earlier snapshot",
                header.revision, mark.epoch
            );
            if self.guard.seal_now(&reason) {
                self.publish_seal(&reason).await;
            }
            return Err(ArbiterError::Sealed {
                reason,
                epoch: mark.epoch,
            });
        }
        self.saw(header);
        Ok((answer.value, header))
    }

    pub fn guard(&self) -> &EpochGuard {
        &self.guard
    }

    /// The guard, shared (for the metrics).
    pub fn guard_shared(&self) -> Arc<EpochGuard> {
        self.guard.clone()
    }

    pub fn high_water(&self) -> Option<Mark> {
        self.high_water.current()
    }

    /// Runs one request to the log and checks its header before its value is
    /// used. The mark is read BEFORE the request is sent: every grant made
    /// durable by then committed at or below any revision the log can report
    /// for this request, while a mark read after the answer could mistake a
    /// slow answer, overtaken by a later grant, for a restore.
    pub async fn checked<T>(
        &self,
        request: impl Future<Output = LogResult<T>>,
    ) -> Result<(T, Header), ArbiterError> {
        let mark = self.mark_before_request();
        let answer = request.await?;
        self.observe(mark, answer.header.cluster_id, Some(answer.header.revision))
            .await?;
        self.saw(answer.header);
        Ok((answer.value, answer.header))
    }

    /// [`Self::checked`] for a write that hands nothing out (a forced end of
    /// a hold): its header is judged the same way, so a restore it shows
    /// seals the cluster, but its answer is used while sealed too. Ending a
    /// hold is safe whatever the log's state; refusing to say that it
    /// happened would only hide a write that did.
    pub async fn judged<T>(
        &self,
        request: impl Future<Output = LogResult<T>>,
    ) -> Result<(T, Header), ArbiterError> {
        let mark = self.mark_before_request();
        let answer = request.await?;
        let header = answer.header;
        if let Some(reason) = self
            .guard
            .observe(header.cluster_id, Some(header.revision), mark)
        {
            self.publish_seal(&reason).await;
        }
        if self.guard.serving().is_ok() {
            self.saw(header);
        }
        Ok((answer.value, header))
    }

    /// On a fresh seal, records it in the log for every arbiter; while sealed,
    /// nothing read or written under this header is used (a grant committed
    /// in a restored log is never answered with its token).
    pub(super) async fn observe(
        &self,
        mark: Option<Mark>,
        cluster_id: u64,
        revision: Option<i64>,
    ) -> Result<(), ArbiterError> {
        if let Some(reason) = self.guard.observe(cluster_id, revision, mark) {
            self.publish_seal(&reason).await;
        }
        if self.guard.serving().is_err() {
            // Sealed: an advance made through another arbiter may have lifted it.
            self.load_epoch().await?;
        }
        self.guard.serving().map(|_| ())
    }

    /// What an answer to a request sent now must not go below: the durable
    /// mark of this arbiter's grants, or the highest revision it has seen in
    /// this epoch, whichever is further.
    pub(super) fn mark_before_request(&self) -> Option<Mark> {
        let durable = self.high_water.current();
        let seen = *self.seen.lock();
        let witnessed = self.witnessed.lock().mark;
        // The furthest of the three (a tie goes to the earlier one: this
        // arbiter's own durable mark first).
        [durable, seen, witnessed]
            .into_iter()
            .flatten()
            .fold(None, |best: Option<Mark>, m| match best {
                Some(b) if b.covers(&m) => Some(b),
                _ => Some(m),
            })
    }

    /// Raises the seen mark after an answer passed the checks.
    fn saw(&self, header: Header) {
        let Some(state) = self.guard.state() else {
            return;
        };
        if state.cluster_id != header.cluster_id || self.guard.serving().is_err() {
            return;
        }
        let now = Mark {
            epoch: state.epoch(),
            cluster_id: header.cluster_id,
            revision: header.revision,
        };
        let mut seen = self.seen.lock();
        if seen.is_none_or(|s| !s.covers(&now)) {
            *seen = Some(now);
        }
    }

    /// One above every epoch this arbiter has granted in or served. (Not
    /// the witness's epochs: the seal uses this floor to tell whether an
    /// advance came after what this arbiter saw, and the witness already
    /// knows the advance's own epoch.)
    fn next_epoch_floor(&self) -> u32 {
        let marked = self.high_water.current().map_or(0, |m| m.epoch);
        let served = self.guard.state().map_or(0, |s| s.epoch());
        marked.max(served).saturating_add(1)
    }

    /// One above every epoch the witness has seen allocated or vouched for.
    /// (And above what the lock log recorded of the witness: after a restore
    /// of the coord cluster, that may be more than it shows now.)
    fn witnessed_epoch_floor(&self) -> u32 {
        let recorded = self
            .coord_seen
            .lock()
            .record
            .as_ref()
            .map(witnessed_of)
            .unwrap_or_default();
        let witnessed = self.witnessed().max(recorded);
        let there = witnessed.mark.map_or(0, |m| m.epoch).max(witnessed.epoch);
        there.saturating_add(1)
    }

    /// Writes the seal record so every arbiter, even one with no memory of
    /// the old log, refuses too. Not when the epoch record already shows an
    /// epoch above everything this arbiter served or marked: then an advance
    /// came after what this arbiter saw (it only noticed late), the anomaly
    /// is behind the new epoch, and a seal written now would shut the
    /// advanced log for good. The local seal then lifts on the next epoch
    /// read.
    async fn publish_seal(&self, reason: &str) {
        error!(
            reason,
            "lock log sealed: refusing every grant until the epoch advances"
        );
        let floor = self.next_epoch_floor();
        let record = encode(&SealRecord {
            reason: reason.to_string(),
            sealed_at_unix_ms: now_unix_ms(),
            next_epoch_at_least: floor,
        });
        // Write the seal, or raise the floor of one another arbiter wrote.
        for _ in 0..3 {
            let records = match self.log.records().await {
                Ok(answer) => answer.value,
                Err(e) => {
                    warn!(error = %e.detail(), "could not read the seal record; this arbiter stays sealed");
                    return;
                }
            };
            if let Some(kv) = &records.epoch
                && let Some(epoch) = decode::<EpochRecord>(&kv.value)
                && epoch.epoch >= floor
            {
                warn!(
                    epoch = epoch.epoch,
                    "the epoch advanced past what this arbiter saw; not sealing the new epoch"
                );
                return;
            }
            let existing = records.seal.as_ref().map(|kv| {
                let theirs = decode::<SealRecord>(&kv.value).map_or(0, |s| s.next_epoch_at_least);
                (kv.mod_revision, theirs)
            });
            if existing.is_some_and(|(_, theirs)| theirs >= floor) {
                return;
            }
            let epoch_at = records.epoch.as_ref().map(|kv| kv.mod_revision);
            match self
                .log
                .put_seal(record.clone(), existing.map(|(rev, _)| rev), epoch_at)
                .await
            {
                Ok(answer) if answer.value => return,
                Ok(_) => continue,
                Err(e) => {
                    warn!(error = %e.detail(), "could not write the seal record; this arbiter stays sealed");
                    return;
                }
            }
        }
    }

    /// Reads (creating on first start) the epoch record and installs it.
    /// The witness is read first: an arbiter with no memory of its own
    /// learns there what was handed out before.
    pub async fn load_epoch(&self) -> Result<EpochState, ArbiterError> {
        self.refresh_witness().await?;
        for _ in 0..3 {
            let mark = self.mark_before_request();
            let answer = self.log.records().await?;
            let header = answer.header;
            let records = answer.value;
            let seal = records
                .seal
                .as_ref()
                .and_then(|kv| decode::<SealRecord>(&kv.value));
            let (record, bytes) = match records.epoch.clone() {
                Some(kv) => {
                    let record: EpochRecord = try_decode(&kv.value).map_err(|e| {
                        ArbiterError::internal_caused(
                            "the epoch record in the lock log is not valid",
                            e,
                        )
                    })?;
                    (record, kv.value)
                }
                None => {
                    let record = EpochRecord {
                        epoch: 1,
                        cluster_id: header.cluster_id.to_string(),
                        advanced_at_unix_ms: now_unix_ms(),
                        reason: "first start".into(),
                    };
                    let bytes = encode(&record);
                    if !self.log.create_epoch(bytes.clone()).await?.value {
                        // Another arbiter created it first: read theirs.
                        continue;
                    }
                    info!(
                        cluster_id = header.cluster_id,
                        "created epoch record: epoch 1"
                    );
                    (record, bytes)
                }
            };
            let (fence_at, fence_version) = match &records.map_fence {
                None => (0, 0),
                Some(kv) => {
                    // Not JSON: nothing underneath to keep.
                    let version = decode_map_fence(&kv.value).ok_or_else(|| {
                        ArbiterError::internal("the shard-map fence in the lock log is not valid")
                    })?;
                    (kv.mod_revision, version)
                }
            };
            let state = EpochState {
                cluster_id: record.cluster_id().unwrap_or(0),
                record,
                bytes,
                fence_at,
                fence_version,
            };
            let before = self.guard.state().map(|s| s.epoch());
            if let Some(reason) = self.guard.install(
                state.clone(),
                header.cluster_id,
                Some(header.revision),
                mark,
                seal.as_ref(),
            ) && seal.is_none()
            {
                self.publish_seal(&reason).await;
            }
            if let Some(shared) = &self.witness {
                let installed = self.guard.state().map(|s| s.epoch());
                if installed > before && before.is_some() {
                    // An advance: the witness as it is now is the new
                    // baseline (the advance may follow a restore of it).
                    shared.start_over();
                    *self.witnessed.lock() = Witnessed::default();
                }
                {
                    let mut seen = self.coord_seen.lock();
                    seen.at = records.coord_seen.as_ref().map(|kv| kv.mod_revision);
                    seen.record = records
                        .coord_seen
                        .as_ref()
                        .and_then(|kv| decode::<CoordSeenRecord>(&kv.value));
                }
                // Read after the record: the witness must show at least it.
                self.refresh_witness().await?;
                if self.guard.serving().is_ok() && self.witnessed().epoch < state.epoch() {
                    // An epoch from before the witness came (the first
                    // start's epoch 1), or one it lost: the next allocation
                    // must be above it.
                    shared.witness().note_epoch(state.epoch()).await?;
                    self.refresh_witness().await?;
                }
            }
            // ADR-09: a fence below the map this arbiter routes by (rolled
            // back by a restore, or a shard fenced before the last move) is
            // raised to it, so an arbiter still on an older map stays fenced
            // out. Fences only go up, and only keep older maps out.
            let routed = self.map_version.get();
            if routed > state.fence_version
                && let Err(e) = self.log.raise_map_fence(routed).await
            {
                tracing::warn!(error = %e, routed, "could not raise the shard-map fence to the map this arbiter routes by");
            }
            return Ok(state);
        }
        Err(ArbiterError::store(
            "the epoch record kept changing while it was being read",
        ))
    }

    /// The epoch to grant in; while sealed, re-reads the record first so an
    /// advance made through another arbiter is seen. Every grant and
    /// hand-over starts here, so each passes [`Self::serving`].
    pub async fn serving_epoch(&self) -> Result<EpochState, ArbiterError> {
        match self.guard.serving() {
            Ok(_) => {}
            Err(ArbiterError::Sealed { .. }) | Err(ArbiterError::StoreUnavailable { .. }) => {
                self.load_epoch().await?;
            }
            Err(e) => return Err(e),
        }
        self.serving()
    }

    /// The epoch to grant in, if this arbiter may grant on this cluster now:
    /// not sealed, and routing by a shard map at least as new as the one
    /// the cluster is fenced at (ADR-09: a move fences the cluster before
    /// the range changes hands, so an arbiter on the older map must not
    /// grant there). The arbiter's version is read at each call: a map it
    /// has loaded since the records were read counts at once, with no
    /// re-read; the records' fence is as of the last read, which a grant
    /// compares in its own transaction.
    pub fn serving(&self) -> Result<EpochState, ArbiterError> {
        let state = self.guard.serving()?;
        let arbiter = self.map_version.get();
        if state.fence_version > arbiter {
            return Err(ArbiterError::ShardMapAhead {
                cluster: state.fence_version,
                arbiter,
            });
        }
        Ok(state)
    }

    /// Makes a grant's revision durable before its token is handed out: in
    /// the state directory and, when there is one, in the witness.
    pub async fn make_durable(
        &self,
        state: &EpochState,
        revision: i64,
    ) -> Result<(), ArbiterError> {
        let mark = Mark {
            epoch: state.epoch(),
            cluster_id: state.cluster_id,
            revision,
        };
        let witnessed = async {
            match &self.witness {
                Some(shared) => shared.raise(mark).await.map_err(|e| {
                    error!(error = %e.detail(), "the witness did not take the grant; refusing it");
                    ArbiterError::store_caused(
                        format!(
                            "the coord cluster could not witness the grant: {}",
                            e.detail()
                        ),
                        e,
                    )
                }),
                None => Ok(()),
            }
        };
        let (local, witnessed) = tokio::join!(durable_locally(&self.high_water, mark), witnessed);
        witnessed?;
        local
    }

    /// ADR-03's unseal: compare epoch E, write the next epoch bound to the
    /// current cluster id, delete every hold, every durable waiter and the
    /// seal. Returns the new record and how many holds went.
    pub async fn advance_epoch(
        &self,
        expected: u32,
        reason: &str,
    ) -> Result<(EpochRecord, i64), ArbiterError> {
        self.advance_epoch_at_least(expected, reason, 0).await
    }

    /// [`Self::advance_epoch`] to an epoch of at least `at_least` (the
    /// operator's floor, for what nothing here remembers).
    pub async fn advance_epoch_at_least(
        &self,
        expected: u32,
        reason: &str,
        at_least: u32,
    ) -> Result<(EpochRecord, i64), ArbiterError> {
        if at_least >= token::MAX_EPOCH {
            return Err(ArbiterError::BadRequest(format!(
                "at_least_epoch {at_least} is beyond the epoch space (below {}); pass one above the highest epoch your fenced resources have seen (token >> 48)",
                token::MAX_EPOCH
            )));
        }
        let answer = self.log.records().await?;
        let cluster_id = answer.header.cluster_id;
        let records = answer.value;
        let seal_floor = records
            .seal
            .as_ref()
            .and_then(|kv| decode::<SealRecord>(&kv.value))
            .map_or(0, |s| s.next_epoch_at_least);
        let seal_at = records.seal.as_ref().map(|kv| kv.mod_revision);
        let Some(existing) = records.epoch else {
            return Err(ArbiterError::BadRequest(
                "there is no epoch record yet; start an arbiter against this etcd first".into(),
            ));
        };
        let record: EpochRecord = try_decode(&existing.value)
            .map_err(|e| ArbiterError::internal_caused("the epoch record is not valid", e))?;
        if record.epoch != expected {
            return Err(ArbiterError::BadRequest(format!(
                "the epoch is {}, not {expected}; check `latchctl admin status` and pass the current epoch",
                record.epoch
            )));
        }
        // Above the log's record, above every epoch a sealing arbiter has used
        // (the seal's floor) and above every epoch this arbiter has used:
        // after a restore to before an earlier advance, record + 1 may be an
        // epoch that already issued tokens.
        // ... and above every epoch the witness allocated.
        self.refresh_witness().await?;
        let mut next = (record.epoch + 1)
            .max(seal_floor)
            .max(self.next_epoch_floor())
            .max(self.witnessed_epoch_floor())
            .max(at_least);
        if let Some(shared) = &self.witness {
            next = shared.witness().allocate_epoch(next).await?;
        }
        if next >= token::MAX_EPOCH {
            return Err(ArbiterError::internal("the epoch space is exhausted"));
        }
        let new_record = EpochRecord {
            epoch: next,
            cluster_id: cluster_id.to_string(),
            advanced_at_unix_ms: now_unix_ms(),
            reason: reason.to_string(),
        };
        let advanced = self
            .log
            .advance(existing.value, seal_at, encode(&new_record))
            .await?
            .value;
        let Some(deleted) = advanced else {
            return Err(ArbiterError::BadRequest(
                "the epoch record or the seal changed while advancing; read the status and try again".into(),
            ));
        };
        self.load_epoch().await?;
        Ok((new_record, deleted))
    }
}

/// Records `mark` in the state directory. A grant whose mark is not on disk
/// is committed but cannot be vouched for after a restore: refused, its
/// token never handed out (the write's error stays the refusal's source).
async fn durable_locally(high_water: &HighWater, mark: Mark) -> Result<(), ArbiterError> {
    high_water.record(mark).await.map_err(|e| {
        error!(error = %e, "high-water mark not durable; refusing the grant");
        ArbiterError::internal_caused(
            "the arbiter could not make the grant durable in its state directory",
            e,
        )
    })
}

fn show_mark(mark: Option<Mark>) -> String {
    mark.map_or_else(
        || "none".into(),
        |m| format!("e{}:r{}", m.epoch, m.revision),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::high_water::HighWaterError;
    use std::error::Error as _;

    /// A grant refused because its mark could not be written keeps the
    /// write's error under it (for the logs); its status says what it said.
    #[tokio::test]
    async fn a_mark_not_written_keeps_its_cause_under_the_refusal() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let state = dir.path().join("state");
        let high_water = HighWater::open(&state).expect("the state directory");
        // The state directory goes away: the slots file cannot be created.
        std::fs::remove_dir_all(&state).expect("remove the state directory");
        let mark = Mark {
            epoch: 1,
            cluster_id: 7,
            revision: 10,
        };
        let err = durable_locally(&high_water, mark)
            .await
            .expect_err("no state directory to write to");

        // The write's error, as it was stored (an `Arc`'s own place in the
        // source chain hides its type from a downcast: look inside it)...
        let ArbiterError::Internal {
            source: Some(cause),
            ..
        } = &err
        else {
            panic!("not an internal error with a cause: {err:?}");
        };
        let write = cause
            .downcast_ref::<HighWaterError>()
            .unwrap_or_else(|| panic!("no high-water error under {err:?}"));
        assert!(matches!(write, HighWaterError::Write { .. }), "{write:?}");
        // ...and the chain as a log walks it: the write, then the I/O error.
        let first = err.source().expect("a source");
        assert_eq!(first.to_string(), write.to_string());
        let io = first
            .source()
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .unwrap_or_else(|| panic!("no I/O error under {write:?}"));
        assert_eq!(io.kind(), std::io::ErrorKind::NotFound);

        // The status is what it was: Internal, the same words, no path.
        let status = tonic::Status::from(err);
        assert_eq!(status.code(), tonic::Code::Internal);
        assert_eq!(
            status.message(),
            "internal error: the arbiter could not make the grant durable in its state directory"
        );
    }
}
