//! 3-member etcd cluster harness (being written).
