//! Reference PostgreSQL fence (being written).
