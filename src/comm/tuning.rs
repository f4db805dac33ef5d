//! Tunables of a communicator ([`CommConfig`]): defaults, overridden by the environment
//! ([`crate::env`] reads and parses the variables).
//!
//! Invariant: every member of a communicator must use the same values (the schedule choice
//! depends on them), so they come from the job-wide environment, read the same way on every rank.

use std::sync::Arc;
use std::time::Duration;

pub use crate::env::{Algo, Cma};
use crate::comm::tuner::Tuning;
use crate::env;
use crate::error::Result;

/// Tunables shared by every member of a communicator (they must agree: take them from the same
/// environment on every rank).
#[derive(Debug, Clone)]
pub struct CommConfig {
    /// Deadline of one operation.
    pub timeout: Duration,
    /// Algorithm override (`MESHTRAIN_ALGO=auto|ring|direct|split`).
    pub algo: Algo,
    /// Largest message size, in bytes, for which `Auto` picks the direct schedule.
    pub small_bytes: usize,
    /// Largest message a schedule puts on a link, in bytes (every transport carries at least this).
    pub chunk_bytes: usize,
    /// Single-copy reads of peers' buffers (`MESHTRAIN_CMA=auto|on|off`).
    pub cma: Cma,
    /// Hierarchical schedules for communicators spanning nodes (`MESHTRAIN_HIER=auto|off`).
    pub hier: bool,
    /// The measured schedule table ([`crate::comm::tuner`]); `None`: the fixed `small_bytes`
    /// threshold. A forced `algo` or `cma` wins over it.
    pub tuning: Option<Arc<Tuning>>,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            timeout: Duration::from_secs(300),
            algo: Algo::Auto,
            small_bytes: 64 << 10,
            chunk_bytes: 1 << 20,
            cma: Cma::Auto,
            hier: true,
            tuning: None,
        }
    }
}

impl CommConfig {
    /// Defaults overridden by `MESHTRAIN_TIMEOUT` (seconds), `MESHTRAIN_ALGO`, `MESHTRAIN_CMA`,
    /// `MESHTRAIN_SMALL_BYTES`, `MESHTRAIN_CHUNK_BYTES` and `MESHTRAIN_HIER`; the tuning table is the built-in one
    /// unless `MESHTRAIN_TUNING` names a file (or `off`).
    pub fn from_env() -> Result<Self> {
        let d = CommConfig::default();
        // Read in this order so that, of several bad variables, the same one is reported as before.
        Ok(CommConfig {
            timeout: env::timeout()?.unwrap_or(d.timeout),
            algo: env::algo()?.unwrap_or(d.algo),
            cma: env::cma()?.unwrap_or(d.cma),
            small_bytes: env::small_bytes()?.unwrap_or(d.small_bytes),
            chunk_bytes: env::chunk_bytes()?.unwrap_or(d.chunk_bytes),
            hier: env::hier()?.unwrap_or(d.hier),
            tuning: match env::tuning() {
                None => Some(Arc::new(Tuning::builtin()?)),
                Some(v) if v.eq_ignore_ascii_case("off") => None,
                Some(path) => Some(Arc::new(Tuning::load(std::path::Path::new(&path))?)),
            },
        })
    }
}
