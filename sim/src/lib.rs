//! Deterministic simulation of the grant protocol (being written).
