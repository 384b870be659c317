//! The end-to-end test binary: one `mod` per scenario file, linked once.
//!
//! Scenarios start real processes (etcd, the arbiter, later Envoy) through the
//! harnesses in `latchkey_tests`.

mod audit;
mod client;
mod cluster;
mod edge;
mod etcd_harness;
mod etcd_tls;
mod force_release;
mod gate;
mod grants;
mod grpc_health;
mod h2_limits;
mod hooks;
mod hostile_arbiter;
mod hostile_edge;
mod hostile_identity;
mod identity;
mod lock_loss;
mod log_contract;
mod metrics;
mod pause_test;
mod policies;
mod seal;
mod support;
mod waiting;
mod witness;
