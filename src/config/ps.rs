//! The `[ps]` section: parameter-server data parallelism (`parallel.dp_sync = "ps"`), and the
//! checks of its combination with the rest of the job. The servers themselves are
//! `train::ps`; this module only holds the values, their defaults and their validation, so that
//! a bad combination is refused with the key named before any rank starts work.

use serde::{Deserialize, Serialize};

use super::JobConfig;
use crate::error::{Error, Result};
use crate::parallel::options::DpSync;

/// How servers apply the workers' gradients (`ps.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PsMode {
    /// One update per step from every worker's gradient of that step, then every worker pulls it.
    #[serde(rename = "sync")]
    Sync,
    /// Stale synchronous parallel: a worker trains on the newest version it has pulled, at most
    /// `staleness` versions behind its own step count.
    #[serde(rename = "async")]
    Async,
}

/// `[ps]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PsConfig {
    /// Server ranks beyond the tp x pp x dp workers (default 1).
    pub servers: usize,
    /// `sync` (default) or `async`.
    pub mode: PsMode,
    /// Async: how many versions a worker's parameters may lag its step count (default 0 = sync).
    pub staleness: u64,
    /// Run the servers inside the worker processes instead of extra ranks (default false).
    pub colocate: bool,
}

impl Default for PsConfig {
    fn default() -> Self {
        PsConfig {
            servers: 1,
            mode: PsMode::Sync,
            staleness: 0,
            colocate: false,
        }
    }
}

impl JobConfig {
    /// Whether this job trains with parameter servers.
    pub fn uses_ps(&self) -> bool {
        self.parallel.dp_sync == DpSync::Ps
    }

    /// Ranks the job needs: the tp x pp x dp workers, plus the server ranks of `dp_sync = "ps"`
    /// (none when colocated).
    pub fn ranks_needed(&self) -> usize {
        let p = &self.parallel;
        let extra = self.uses_ps() && !self.ps.colocate;
        p.tp * p.pp * p.dp + if extra { self.ps.servers } else { 0 }
    }

    /// The parameter servers of the job: `ps.servers` ranks, or one per worker when colocated.
    pub fn ps_servers(&self) -> usize {
        let p = &self.parallel;
        if self.ps.colocate {
            p.tp * p.pp * p.dp
        } else {
            self.ps.servers
        }
    }

    /// The `[ps]` keys and what they combine with; errors name the key.
    pub(super) fn validate_ps(&self) -> Result<()> {
        let (ps, p) = (&self.ps, &self.parallel);
        if !self.uses_ps() {
            return Ok(());
        }
        let workers = p.tp * p.pp * p.dp;
        if ps.colocate && ps.servers != 1 && ps.servers != workers {
            return Err(Error::config(
                "ps.servers",
                format!("{}: with ps.colocate = true every worker process runs one server (tp x pp x dp = {workers}); leave ps.servers unset", ps.servers),
            ));
        }
        if ps.servers == 0 {
            return Err(Error::config(
                "ps.servers",
                "must be at least 1 with parallel.dp_sync = \"ps\"",
            ));
        }
        if ps.mode == PsMode::Sync && ps.staleness > 0 {
            return Err(Error::config(
                "ps.staleness",
                format!(
                    "{} applies to ps.mode = \"async\" only (sync has no staleness)",
                    ps.staleness
                ),
            ));
        }
        if p.zero != 0 {
            return Err(Error::config(
                "parallel.zero",
                format!("{}: with parallel.dp_sync = \"ps\" the servers hold the optimizer state, so ZeRO does not apply; use zero = 0", p.zero),
            ));
        }
        if self.train.loss_scale != super::LossScale::None {
            return Err(Error::config(
                "train.loss_scale",
                "the parameter servers update with unscaled gradients and cannot skip a step yet; use loss_scale = \"none\" (and a precision other than fp16) with parallel.dp_sync = \"ps\"",
            ));
        }
        Ok(())
    }
}
