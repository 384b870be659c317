//! The lock log on etcd (being written).
