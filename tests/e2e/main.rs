//! The end-to-end test binary: one `mod` per scenario file, linked once.
//!
//! Scenarios start real processes (etcd, later the arbiter and Envoy) through the
//! harnesses in `latchkey_tests`.

mod etcd_harness;
