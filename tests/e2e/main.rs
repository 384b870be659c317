//! The end-to-end test binary: one `mod` per scenario file, linked once.
//!
//! Scenarios start real processes (etcd, the arbiter, Envoy, PostgreSQL,
//! ClickHouse, an OIDC provider) through the harnesses in `latchkey_tests`.

mod audit;
mod classes_crd;
mod client;
mod client_elections;
mod cluster;
mod deploy;
mod durable_waiters;
mod edge;
mod elections;
mod etcd_harness;
mod etcd_members;
mod etcd_tls;
mod fence_kv;
mod fence_s3;
mod fence_sql;
mod force_release;
mod force_release_elections;
mod grants;
mod grpc_health;
mod h2_limits;
mod health_check;
mod hooks;
mod hostile_arbiter;
mod hostile_bounds;
mod hostile_edge;
mod hostile_identity;
mod hostile_keepalive;
mod hostile_overload;
mod identity;
mod latchctl;
mod latchctl_elections;
mod lock_loss;
mod log_contract;
mod metrics;
mod otel;
mod overload;
mod pause_test;
mod pause_test_stores;
mod policies;
mod python_client;
mod quorum_loss;
mod quota;
mod replicas;
mod seal;
mod semaphores;
mod session_counts;
mod shard_moves;
mod shards;
mod shared;
mod support;
mod tiers;
mod waiting;
mod witness;
