//! Private PostgreSQL server harness (being written).
