//! Tunables of a communicator ([`CommConfig`]) and how the environment sets them.
//!
//! Invariant: every member of a communicator must use the same values (the schedule choice
//! depends on them), so they come from the job-wide environment, read the same way on every rank.

use std::time::Duration;

use crate::error::{Error, Result};

/// Which schedule a collective uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algo {
    /// Direct below [`CommConfig::small_bytes`], ring above (all-to-all is always direct).
    Auto,
    /// Always the ring (all-to-all stays direct).
    Ring,
    /// Always the direct all-pairs schedule.
    Direct,
}

/// Whether all-gather, all-reduce and broadcast may read peers' buffers directly (Cross Memory
/// Attach) instead of copying through the shared-memory FIFOs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cma {
    /// All-gather and all-reduce above [`CommConfig::small_bytes`] under `Algo::Auto`, when the
    /// probe shows reads work (broadcast keeps the ring, measured faster).
    Auto,
    /// All three at every size, whatever [`Algo`] says; a failed probe is an error.
    On,
    /// Never.
    Off,
}

/// Tunables shared by every member of a communicator (they must agree: take them from the same
/// environment on every rank).
#[derive(Debug, Clone)]
pub struct CommConfig {
    /// Deadline of one operation.
    pub timeout: Duration,
    /// Algorithm override (`MESHTRAIN_ALGO=auto|ring|direct`).
    pub algo: Algo,
    /// Largest message size, in bytes, for which `Auto` picks the direct schedule.
    pub small_bytes: usize,
    /// Largest message a schedule puts on a link, in bytes (every transport carries at least this).
    pub chunk_bytes: usize,
    /// Single-copy reads of peers' buffers (`MESHTRAIN_CMA=auto|on|off`).
    pub cma: Cma,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            timeout: Duration::from_secs(300),
            algo: Algo::Auto,
            small_bytes: 64 << 10,
            chunk_bytes: 1 << 20,
            cma: Cma::Auto,
        }
    }
}

impl CommConfig {
    /// Defaults overridden by `MESHTRAIN_TIMEOUT` (seconds), `MESHTRAIN_ALGO`, `MESHTRAIN_CMA`,
    /// `MESHTRAIN_SMALL_BYTES` and `MESHTRAIN_CHUNK_BYTES`.
    pub fn from_env() -> Result<Self> {
        let mut c = CommConfig::default();
        let get = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let num = |k: &str, v: String| {
            v.parse::<f64>()
                .ok()
                .filter(|x| *x > 0.0)
                .ok_or_else(|| Error::config(k, format!("`{v}` is not a positive number")))
        };
        if let Some(v) = get("MESHTRAIN_TIMEOUT") {
            c.timeout = Duration::from_secs_f64(num("MESHTRAIN_TIMEOUT", v)?);
        }
        if let Some(v) = get("MESHTRAIN_ALGO") {
            c.algo = match v.to_ascii_lowercase().as_str() {
                "auto" => Algo::Auto,
                "ring" => Algo::Ring,
                "direct" => Algo::Direct,
                _ => {
                    return Err(Error::config(
                        "MESHTRAIN_ALGO",
                        format!("`{v}` is not one of auto, ring, direct"),
                    ))
                }
            };
        }
        if let Some(v) = get("MESHTRAIN_CMA") {
            c.cma = match v.to_ascii_lowercase().as_str() {
                "auto" => Cma::Auto,
                "on" | "1" => Cma::On,
                "off" | "0" => Cma::Off,
                _ => {
                    return Err(Error::config(
                        "MESHTRAIN_CMA",
                        format!("`{v}` is not one of auto, on (1), off (0)"),
                    ))
                }
            };
        }
        if let Some(v) = get("MESHTRAIN_SMALL_BYTES") {
            c.small_bytes = num("MESHTRAIN_SMALL_BYTES", v)? as usize;
        }
        if let Some(v) = get("MESHTRAIN_CHUNK_BYTES") {
            let b = num("MESHTRAIN_CHUNK_BYTES", v)? as usize;
            if b < 64 || b % 64 != 0 {
                return Err(Error::config("MESHTRAIN_CHUNK_BYTES", "must be a multiple of 64 bytes"));
            }
            c.chunk_bytes = b;
        }
        Ok(c)
    }
}
