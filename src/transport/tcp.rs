//! TCP transport (under construction).
