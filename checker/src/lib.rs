//! Lock-history checker (being written).
