//! Shared-memory transport (under construction).
