//! The release gate (being written).
