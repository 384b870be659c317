//! Start-up: builds the arbiter's state from its [`Config`] — policies and
//! hooks, then one cluster per tier (etcd connection, high-water mark,
//! witness, epoch record, seal, hold count, quorum probe, force-release)
//! and the namespace bindings — and reads the etcd TLS material and
//! password once.

use std::sync::Arc;

use tokio_util::task::AbortOnDrop;
use tracing::{info, warn};

use crate::config::{Config, EtcdCredentials, LogLayer};
use crate::epoch::EpochGuard;
use crate::follow::follow;
use crate::high_water::HighWater;
use crate::identity::IdentitySource;
use crate::lock_log::LockLog;
use crate::lock_log::etcd::follow::EtcdFollower;
use crate::lock_log::etcd::{
    EtcdClient, EtcdLog, NoMemo, RenewalMemo, StoreConfig, connect_client,
};
use crate::lock_log::{Counted, FollowLog};
use crate::metrics::Metrics;
use crate::policy::Policies;
use crate::service::Arbiter;
use crate::shards::Shard;
use crate::shards::etcd::ShardMapStore;
use crate::shards::routing;
use crate::table::{LockTable, MapVersion, TableOptions};
use crate::witness::Witness;
use crate::witness::etcd::EtcdWitness;
use crate::{
    RunError, bounds, force_release, hold_counts, oidc, quorum_loss, session_counts, tiers,
    wasm_hooks,
};

/// Why an arbiter with no memory and no witness refuses to grant.
const UNWITNESSED: &str = "this arbiter has an empty state directory and no coord cluster, and the lock log already has an epoch record: nothing can tell whether it was restored from a snapshot since tokens were handed out, so it grants nothing. Run with --coord-etcd (a witness); or, if you know the lock log was not restored, restart with --trust-unwitnessed-log; or advance the epoch (latchctl admin advance-epoch) above every epoch ever used";

/// Builds the arbiter's state: policies, then each tier's cluster (etcd
/// connection, high-water mark, epoch record created on first start).
pub async fn build(config: &Config) -> Result<Arc<Arbiter>, RunError> {
    // etcd's endpoints and credentials first: a bad flag or file fails the
    // start before anything else is loaded.
    let credentials = &config.etcd_credentials;
    credentials.check(&config.etcd_endpoints)?;
    config.check_coord()?;
    let (etcd_tls, etcd_login) = (etcd_tls(credentials)?, etcd_login(credentials)?);
    let policies =
        Arc::new(Policies::load(&config.policies_dir)?.with_hooks(config.hook_host.clone()));
    // Compile the classes' hooks before serving (a class whose module is
    // refused fails closed; the others are served).
    let (host, set, dir) = (
        config.hook_host.clone(),
        policies.current(),
        config.policies_dir.clone(),
    );
    let _ = tokio::task::spawn_blocking(move || host.sync(&set, &dir)).await;
    let bounds = Arc::new(bounds::Bounds::new(config.max_sessions_per_identity));
    let lock_store = StoreConfig {
        endpoints: config.etcd_endpoints.clone(),
        prefix: config.prefix.clone(),
        connect_timeout: config.etcd_connect_timeout,
        request_timeout: config.etcd_request_timeout,
        tls: etcd_tls,
        login: etcd_login,
    };
    let witness = coord_witness(config, &lock_store).await?;
    let map_version = MapVersion::default();
    let entity = build_cluster(
        config,
        ClusterSpec {
            tier: latchkey_policies::Tier::Entity,
            store: lock_store.clone(),
            witness,
            state_dir: config.state_dir.clone(),
            layer: config.log_layer.as_ref(),
            session_tag: 0,
            map_version: map_version.clone(),
            memo: bounds.clone(),
            opens_sessions: true,
        },
    )
    .await?;
    // ADR-07: the coord tier's locks on the coord cluster. Its grants are
    // witnessed, and its epochs allocated, by the entity cluster: the two
    // clusters witness each other, so a restore of either one alone is seen.
    let coord = match config.split_tiers {
        false => None,
        true => {
            let store = StoreConfig {
                endpoints: config.coord_endpoints.clone(),
                ..lock_store.clone()
            };
            let witness = tier_witness(config, &lock_store).await?;
            Some(
                build_cluster(
                    config,
                    ClusterSpec {
                        tier: latchkey_policies::Tier::Coord,
                        store,
                        witness: Some(witness),
                        state_dir: config.state_dir.join("coord-tier"),
                        layer: None,
                        session_tag: tiers::COORD_SESSION_BIT,
                        map_version: MapVersion::default(),
                        memo: bounds.clone(),
                        opens_sessions: true,
                    },
                )
                .await?,
            )
        }
    };
    if coord.is_some() {
        info!(
            coord = %config.coord_endpoints.join(","),
            entity = %config.etcd_endpoints.join(","),
            "two tiers (ADR-07): coord-tier keys on the coord cluster, every other key on the entity cluster"
        );
    }
    // Every arbiter with a coord cluster routes by the namespaces' bindings
    // there, split or not (tiers/bindings.rs).
    let bindings = match config.coord_endpoints.is_empty() {
        true => None,
        false => {
            let store = StoreConfig {
                endpoints: config.coord_endpoints.clone(),
                prefix: config.coord_prefix.clone(),
                ..lock_store.clone()
            };
            let unreachable = |source| RunError::CoordUnreachable {
                endpoints: config.coord_endpoints.join(","),
                access: config.etcd_credentials.describe(),
                source,
            };
            let entity_client = connect_client(&lock_store)
                .await
                .map_err(|e| RunError::Store(e.into()))?;
            let bindings = tiers::bindings::Bindings::new(
                connect_client(&store).await.map_err(unreachable)?,
                &config.coord_prefix,
                &config.lock_cluster_name,
                entity_client,
                &config.prefix,
            );
            let n = bindings.load().await.map_err(unreachable)?;
            info!(
                namespaces = n,
                "namespace tier bindings read from the coord cluster"
            );
            Some(bindings)
        }
    };
    let entity = Arc::new(entity);
    let mut tiers = tiers::Tiers::new(entity.clone(), coord.map(Arc::new), bindings);
    // ADR-09: with a coord cluster, entity keys are routed by the shard map
    // there (none yet: every key on the lock cluster, as before).
    if !config.coord_endpoints.is_empty() {
        let store = StoreConfig {
            endpoints: config.coord_endpoints.clone(),
            prefix: config.coord_prefix.clone(),
            ..lock_store.clone()
        };
        let client = connect_client(&store)
            .await
            .map_err(|source| RunError::CoordUnreachable {
                endpoints: config.coord_endpoints.join(","),
                access: config.etcd_credentials.describe(),
                source,
            })?;
        let connect: Arc<dyn routing::Connect> = Arc::new(ShardConnector {
            config: config.clone(),
            lock_store: lock_store.clone(),
            map_version: map_version.clone(),
            policies: policies.clone(),
        });
        let routing = Arc::new(routing::ShardRouting::new(
            &config.lock_cluster_name,
            config.etcd_endpoints.clone(),
            entity,
            Arc::new(ShardMapStore::new(client, &config.coord_prefix)),
            connect,
            map_version,
        ));
        routing
            .load()
            .await
            .map_err(|e| RunError::Store(e.into()))?;
        if let Some(map) = routing.map() {
            info!(
                version = map.version,
                shards = map.shards.len(),
                "entity keys routed by the shard map on the coord cluster"
            );
        }
        let follow = routing.follow();
        tiers = tiers.with_shards(routing, follow);
    }
    let identity = match &config.tls {
        Some(_) => IdentitySource::Tls {
            trust_domain: config.trust_domain.clone(),
            edge_identity: config.edge_identity.clone(),
        },
        None => IdentitySource::InsecureDev {
            trust_domain: config.trust_domain.clone(),
        },
    };
    let metrics = {
        let tables: Vec<_> = tiers.all().into_iter().map(|c| c.table.clone()).collect();
        let quorum = tiers.entity().quorum.clone();
        Metrics::new(
            Arc::new(move || {
                tables
                    .iter()
                    .map(|t| t.totals())
                    .fold((0, 0), |(k, n), (k2, n2)| (k + k2, n + n2))
            }),
            tiers.entity().table.seal().guard_shared(),
            config.hook_host.clone(),
            Arc::new(move || quorum.snapshot()),
        )
    };
    {
        let counts: Vec<_> = tiers
            .session_clusters()
            .map(|c| c.sessions.clone())
            .collect();
        metrics.set_session_totals(Arc::new(move || counts.iter().map(|c| c.total()).sum()));
    }
    if let Some(coord) = tiers.coord() {
        let quorum = coord.quorum.clone();
        metrics.set_coord_tier(
            coord.table.seal().guard_shared(),
            Arc::new(move || quorum.snapshot()),
        );
    }
    let metrics = Arc::new(metrics);
    let admission = {
        let metrics = Arc::clone(&metrics);
        crate::overload::Admission::with_refusals(
            config.overload.clone(),
            Box::new(move |work, why| metrics.overload_refused(work, why)),
        )
    };
    metrics.set_admission(Arc::clone(&admission));
    // The overload signal: how long renewals take at the lanes.
    bounds.report_renewals_to(Arc::clone(&admission));
    // Semaphore waiters are granted by the permits the policies give now.
    for cluster in tiers.all() {
        cluster.table.set_permits_source(policies.clone());
    }
    Ok(Arc::new(Arbiter {
        metrics,
        admission,
        tiers,
        policies,
        identity,
        direct_workloads: config.edge_identity.is_none() || config.allow_direct_workloads,
        hooks: Arc::new(wasm_hooks::WasmHooks::new(
            config.hook_host.clone(),
            config.hooks.clone(),
        )),
        max_wait: config.max_wait,
        bounds,
        campaign_calls: Arc::default(),
        observe_calls: Arc::default(),
        max_campaigns_per_subject: config.max_waiters_per_identity,
        max_leaderships: config.max_holds_per_identity,
    }))
}

/// One tier's cluster, as [`build_cluster`] starts it.
struct ClusterSpec<'c> {
    tier: latchkey_policies::Tier,
    store: StoreConfig,
    /// The other cluster that witnesses this one's grants; `None`: the
    /// state directory is the only witness.
    witness: Option<Arc<EtcdWitness>>,
    /// Its high-water mark and quorum-loss spool.
    state_dir: std::path::PathBuf,
    layer: Option<&'c LogLayer>,
    session_tag: i64,
    /// The shard map version this arbiter routes by (entity shards share
    /// the routing's; the coord tier is never fenced).
    map_version: MapVersion,
    /// The renewal memo its lease renewals consult: the arbiter's, except
    /// on other shards (their leases are shadows with the sessions' ids).
    memo: Arc<dyn RenewalMemo>,
    /// Sessions are opened on it (the entity cluster, the coord cluster):
    /// its session index is counted.
    opens_sessions: bool,
}

/// Connects to one cluster and readies its table: the epoch record, the
/// seal, the hold count, the quorum probe and force-release.
async fn build_cluster(config: &Config, spec: ClusterSpec<'_>) -> Result<tiers::Cluster, RunError> {
    let credentials = &config.etcd_credentials;
    let tier = tiers::tier_name(spec.tier);
    let high_water = Arc::new(HighWater::open(&spec.state_dir)?);
    let has_state = high_water.current().is_some();
    let guard = Arc::new(EpochGuard::default());
    let unreachable = |source: crate::ArbiterError| RunError::EtcdUnreachable {
        endpoints: spec.store.endpoints.join(","),
        access: credentials.describe(),
        // etcd with --client-cert-auth drops a TLS client without a
        // certificate with no more than a broken pipe.
        hint: if credentials.ca.is_some() && credentials.client_cert.is_none() {
            "; if etcd runs with --client-cert-auth, pass --etcd-cert and --etcd-key"
        } else {
            ""
        },
        source: Box::new(source),
    };
    // Force-release's hold ends are the log's (its owner runs them), on
    // the force-release user's client.
    let (force, force_client) = match force_release(config, &spec.store).await? {
        Some((force, client)) => (Some(force), Some(client)),
        None => (None, None),
    };
    let mut etcd = EtcdLog::connect(&spec.store, spec.memo.clone())
        .await
        .map_err(|e| unreachable(e.into()))?;
    if let Some(client) = force_client {
        etcd = etcd.with_force_client(client);
    }
    let mut log: Arc<dyn LockLog> = Arc::new(etcd);
    if let Some(layer) = spec.layer {
        warn!(layer = %layer.name, "RUNNING WITH A LAYER AROUND THE LOCK LOG (a test build): this arbiter may be deliberately unsafe");
        log = (layer.wrap)(log);
    }
    let mut unwitnessed = false;
    match &spec.witness {
        Some(w) => info!(
            tier,
            witness = %w.describe(),
            "another cluster witnesses this cluster's grants and allocates its epochs"
        ),
        None => {
            info!(
                tier,
                state_dir = %spec.state_dir.display(),
                "one cluster, no coord cluster (--coord-etcd): this arbiter's state directory is the only witness of the tokens handed out"
            );
            // Read before the first start of an empty log could create the
            // epoch record: a record found now was there before this start.
            if !has_state
                && log
                    .records()
                    .await
                    .map_err(|e| unreachable(e.into()))?
                    .value
                    .epoch
                    .is_some()
            {
                unwitnessed = true;
                warn!(
                    state_dir = %spec.state_dir.display(),
                    trusted = config.trust_unwitnessed_log,
                    "starting with an empty state directory on a lock log that already has an epoch record, and with no coord cluster: nothing can tell whether the lock log was restored from a snapshot since tokens were handed out, and if it was, tokens may be issued again below earlier ones (issue 15); run with --coord-etcd, and keep --state-dir on durable disk"
                );
            }
        }
    }
    let table = LockTable::witnessed(
        log,
        guard.clone(),
        high_water,
        spec.witness.clone().map(|w| w as Arc<dyn Witness>),
        TableOptions {
            poll: config.retry_poll,
            max_waiters_per_identity: config.max_waiters_per_identity,
            session_tag: spec.session_tag,
            map_version: spec.map_version.clone(),
            ..TableOptions::default()
        },
    );
    // The first request: the connection, TLS handshake and auth happen here.
    let state = table.start().await.map_err(unreachable)?;
    info!(tier, access = %credentials.describe(), "connected to etcd");
    if let Some(coord) = spec.witness.as_ref().and_then(|w| w.coord_cluster_id()) {
        let lock = table.current_cluster_id().await.map_err(unreachable)?;
        if lock == coord {
            return Err(RunError::CoordIsLockCluster { cluster_id: lock });
        }
    }
    if unwitnessed && !config.trust_unwitnessed_log {
        // Sealed here only (no seal record: the other arbiters may well
        // have the memory this one lacks). An operator's advance lifts it.
        guard.seal_now(UNWITNESSED);
    } else if guard.seal_reason().is_none() {
        // Remember the log as it is now, so a restart with this state
        // directory is not "empty" even if this arbiter never grants.
        table.mark_start(&state).await.map_err(unreachable)?;
    }
    match guard.seal_reason() {
        Some(reason) => warn!(tier, epoch = state.epoch(), %reason, "starting SEALED"),
        None => info!(
            tier,
            epoch = state.epoch(),
            cluster_id = state.cluster_id,
            "lock log ready"
        ),
    }
    // Its own connection: the watches of every holder record and session
    // entry must not queue behind grants on the lock log's.
    let holds = hold_counts::HoldCounts::new(config.max_holds_per_identity);
    let sessions = session_counts::SessionCounts::new(config.max_sessions_per_identity);
    let (hold_watch, session_watch) = {
        let client = connect_client(&spec.store)
            .await
            .map_err(|e| unreachable(e.into()))?;
        let follower: Arc<dyn FollowLog> = Arc::new(EtcdFollower::new(client, &config.prefix));
        let session_watch = spec.opens_sessions.then(|| {
            let task = follow(sessions.clone(), follower.clone(), Counted::SessionIndex);
            AbortOnDrop::new(tokio::spawn(task).abort_handle())
        });
        let task = follow(holds.clone(), follower, Counted::Holds);
        (
            AbortOnDrop::new(tokio::spawn(task).abort_handle()),
            session_watch,
        )
    };
    // ADR-04: the probe that decides quorum loss, and the open classes' spool.
    let quorum = Arc::new(
        quorum_loss::QuorumLoss::new(
            config.quorum_loss.clone(),
            &spec.state_dir,
            config.max_holds_per_identity,
            config.max_waiters_per_identity,
        )
        .map_err(RunError::QuorumLossSpool)?,
    );
    quorum.set_cluster_id(state.cluster_id);
    let quorum_probe = quorum.spawn_probe(table.log().clone());
    Ok(tiers::Cluster {
        tier: spec.tier,
        owner: crate::owner::KeyOwner::new(table.clone(), holds.clone(), quorum.clone()),
        elections: Arc::new(crate::election::Elections::new(table.clone())),
        table,
        holds,
        sessions,
        quorum,
        force,
        _tasks: [Some(hold_watch), session_watch, Some(quorum_probe)]
            .into_iter()
            .flatten()
            .collect(),
    })
}

/// The force-release path, when an OIDC provider is configured, and its own
/// etcd client (for the lock log's forced ends), logged in as the
/// restricted force-release user if one is given (the arbiter's own
/// credentials otherwise, with a warning).
async fn force_release(
    config: &Config,
    lock_store: &StoreConfig,
) -> Result<Option<(Arc<force_release::ForceRelease>, EtcdClient)>, RunError> {
    let settings = &config.force_release;
    let Some(oidc) = &settings.oidc else {
        if settings.etcd_user.is_some() {
            warn!("--force-etcd-user is set but force-release is off (no --oidc-issuer)");
        }
        info!("force-release is off (start with --oidc-issuer and --oidc-audience to turn it on)");
        return Ok(None);
    };
    let verifier = oidc::OidcVerifier::new(oidc.clone()).map_err(|e| match e {
        oidc::SetupError::Config(message) => RunError::ForceRelease(message),
        oidc::SetupError::HttpClient(source) => RunError::OidcClient(source),
    })?;
    let connect = |store: StoreConfig, who: String| async move {
        connect_client(&store)
            .await
            .map_err(|e| RunError::EtcdUnreachable {
                endpoints: store.endpoints.join(","),
                access: who,
                hint: "",
                source: Box::new(e.into()),
            })
    };
    let main = connect(lock_store.clone(), config.etcd_credentials.describe()).await?;
    let force = match &settings.etcd_user {
        Some(user) => {
            let credentials = EtcdCredentials {
                user: Some(user.clone()),
                ..config.etcd_credentials.clone()
            };
            credentials.check(&config.etcd_endpoints)?;
            let store = StoreConfig {
                login: etcd_login(&credentials)?,
                ..lock_store.clone()
            };
            let client = connect(store, credentials.describe()).await?;
            info!(user = %user.name, "force-release runs as its own etcd user");
            client
        }
        None => {
            warn!(
                "force-release runs with the arbiter's own etcd credentials: pass --force-etcd-user and --force-etcd-password-file for a user whose role may only delete holds and write force records (docs/security.md)"
            );
            main.clone()
        }
    };
    info!(issuer = %oidc.issuer, audience = %oidc.audience, require_mfa = oidc.require_mfa, "force-release is on: two operators signed in with OIDC");
    Ok(Some((
        force_release::ForceRelease::new(
            verifier,
            force_release::etcd::ForceStore::new(force.clone(), &config.prefix),
            settings.request_ttl,
        ),
        force,
    )))
}

/// The coord cluster's witness, when `--coord-etcd` names one: connected
/// with the lock cluster's credentials and read once, so a wrong address or
/// refused credentials fail the start with the coord cluster named.
async fn coord_witness(
    config: &Config,
    lock_store: &StoreConfig,
) -> Result<Option<Arc<EtcdWitness>>, RunError> {
    if config.coord_endpoints.is_empty() {
        return Ok(None);
    }
    witness_named(config, lock_store, &config.lock_cluster_name)
        .await
        .map(Some)
}

/// The coord cluster's witness of the lock cluster called `name`.
async fn witness_named(
    config: &Config,
    lock_store: &StoreConfig,
    name: &str,
) -> Result<Arc<EtcdWitness>, RunError> {
    let unreachable = |source| RunError::CoordUnreachable {
        endpoints: config.coord_endpoints.join(","),
        access: config.etcd_credentials.describe(),
        source,
    };
    let store = StoreConfig {
        endpoints: config.coord_endpoints.clone(),
        prefix: config.coord_prefix.clone(),
        ..lock_store.clone()
    };
    let witness = EtcdWitness::connect(&store, name)
        .await
        .map_err(unreachable)?;
    witness.read().await.map_err(unreachable)?;
    Ok(Arc::new(witness))
}

/// Connects the entity tier's other shards as the shard map names them:
/// the lock cluster's credentials, a witness of their own on the coord
/// cluster (by shard name: each shard's epochs come from there), and a
/// state directory of their own under `<state-dir>/shards/`.
struct ShardConnector {
    config: Config,
    lock_store: StoreConfig,
    map_version: MapVersion,
    /// Where a shard's table reads semaphore classes' current permits.
    policies: Arc<Policies>,
}

impl routing::Connect for ShardConnector {
    fn connect(
        &self,
        shard: Shard,
    ) -> futures::future::BoxFuture<'static, Result<Arc<tiers::Cluster>, Box<RunError>>> {
        let (config, lock_store, map_version, policies) = (
            self.config.clone(),
            self.lock_store.clone(),
            self.map_version.clone(),
            self.policies.clone(),
        );
        Box::pin(async move {
            let witness = witness_named(&config, &lock_store, &shard.name).await?;
            let spec = ClusterSpec {
                tier: latchkey_policies::Tier::Entity,
                store: StoreConfig {
                    endpoints: shard.endpoints.clone(),
                    ..lock_store.clone()
                },
                witness: Some(witness),
                state_dir: config.state_dir.join("shards").join(&shard.name),
                layer: None,
                session_tag: 0,
                map_version,
                memo: Arc::new(NoMemo),
                // Other shards hold only shadows of sessions.
                opens_sessions: false,
            };
            let cluster = build_cluster(&config, spec).await?;
            // A shard connected at run time reads semaphores' permits from
            // the policies too (the second hostile review).
            cluster.table.set_permits_source(policies);
            Ok(Arc::new(cluster))
        })
    }
}

/// The coord tier's witness when the tiers are split: the
/// `--coord-tier-witness-etcd` cluster, or else the entity (lock) cluster,
/// under the coord prefix, with the coord tier's own name.
async fn tier_witness(
    config: &Config,
    lock_store: &StoreConfig,
) -> Result<Arc<EtcdWitness>, RunError> {
    let endpoints = match config.coord_tier_witness_endpoints.is_empty() {
        true => config.etcd_endpoints.clone(),
        false => config.coord_tier_witness_endpoints.clone(),
    };
    let unreachable = |source| RunError::CoordUnreachable {
        endpoints: endpoints.join(","),
        access: config.etcd_credentials.describe(),
        source,
    };
    let store = StoreConfig {
        endpoints: endpoints.clone(),
        prefix: config.coord_prefix.clone(),
        ..lock_store.clone()
    };
    let witness = EtcdWitness::connect(&store, COORD_TIER_WITNESS_NAME)
        .await
        .map_err(unreachable)?;
    witness.read().await.map_err(unreachable)?;
    Ok(Arc::new(witness))
}

/// The coord tier's name in the witness records of its witness cluster.
pub const COORD_TIER_WITNESS_NAME: &str = "coord-tier";

fn read(path: &std::path::Path) -> Result<Vec<u8>, RunError> {
    std::fs::read(path).map_err(|source| RunError::ReadTls {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads a PEM file that must hold at least one `kind` block.
fn read_pem(path: &std::path::Path, kind: PemKind) -> Result<Vec<u8>, RunError> {
    let pem = read(path)?;
    let mut reader = std::io::BufReader::new(pem.as_slice());
    let found = rustls_pemfile::read_all(&mut reader).any(|item| {
        matches!(
            (kind, item),
            (
                PemKind::Certificate,
                Ok(rustls_pemfile::Item::X509Certificate(_))
            ) | (
                PemKind::Key,
                Ok(rustls_pemfile::Item::Pkcs1Key(_)
                    | rustls_pemfile::Item::Pkcs8Key(_)
                    | rustls_pemfile::Item::Sec1Key(_))
            )
        )
    });
    if !found {
        return Err(RunError::BadFile {
            path: path.to_path_buf(),
            what: match kind {
                PemKind::Certificate => "no PEM certificate in this file",
                PemKind::Key => "no PEM private key in this file",
            },
        });
    }
    Ok(pem)
}

#[derive(Debug, Clone, Copy)]
enum PemKind {
    Certificate,
    Key,
}

/// etcd's TLS material, read once at start.
fn etcd_tls(credentials: &EtcdCredentials) -> Result<Option<latchkey_etcd::TlsPem>, RunError> {
    let Some(ca) = &credentials.ca else {
        return Ok(None);
    };
    let identity = match &credentials.client_cert {
        Some(c) => Some((
            read_pem(&c.cert, PemKind::Certificate)?,
            read_pem(&c.key, PemKind::Key)?,
        )),
        None => None,
    };
    Ok(Some(latchkey_etcd::TlsPem {
        ca: read_pem(ca, PemKind::Certificate)?,
        identity,
    }))
}

/// The etcd user's password, read once at start: the file's content without
/// its trailing newline. No error ever quotes the content.
fn etcd_login(credentials: &EtcdCredentials) -> Result<Option<latchkey_etcd::Login>, RunError> {
    let Some(user) = &credentials.user else {
        return Ok(None);
    };
    let bytes = read(&user.password_file)?;
    let Ok(text) = String::from_utf8(bytes) else {
        return Err(RunError::BadFile {
            path: user.password_file.clone(),
            what: "the etcd password file is not UTF-8",
        });
    };
    let password = text.strip_suffix('\n').unwrap_or(&text);
    let password = password.strip_suffix('\r').unwrap_or(password);
    if password.is_empty() {
        return Err(RunError::BadFile {
            path: user.password_file.clone(),
            what: "the etcd password file is empty",
        });
    }
    Ok(Some(latchkey_etcd::Login::new(
        user.name.clone(),
        password.to_string(),
    )))
}
