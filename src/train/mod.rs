//! `meshtrain train`: the training loop (its phases are [`session::Session`]'s).
//!
//! One optimizer step = `grad_accum` micro-batches of (B, T) on every data-parallel rank, gradients
//! averaged over micro-batches and ranks, clipped by the global norm, AdamW with the warm-up +
//! cosine schedule. Every rank computes the same loss (averaged over the group) and rank 0 writes
//! the metrics. Invariants: the same seed and config give bit-identical losses run to run; a
//! data-parallel run sees exactly the windows a single rank sees with `grad_accum * dp`
//! micro-batches, so both follow the same trajectory up to float summation order.

mod bench_step;
mod buckets;
#[cfg(test)]
pub(crate) use buckets::plan_buckets;
mod checkpointing;
mod comm_worker;
mod config_agree;
mod device_overlap;
mod device_step;
mod device_whole;
mod device_zero;
mod grad_sync;
mod loss_scale;
mod memory_estimate;
mod memory_fit;
mod nonfinite;
mod pipeline;
mod ps;
mod replica;
mod session;
mod shutdown;
mod stragglers;

use std::path::PathBuf;

use crate::config::JobConfig;
use crate::error::Result;
use crate::world::World;

pub use bench_step::{HeldBytes, StepHarness, StepResult};
pub use grad_sync::DataParallel;
pub use buckets::MAX_STAGED;
pub use memory_fit::available_bytes;
pub use memory_estimate::{MemoryEstimate, MemoryInputs};
pub use replica::{DeviceEvent, Replica, ReplicaLayout};
use session::{Session, StepEnd};

/// Options of one run that are not part of the job config.
#[derive(Debug, Clone, Default)]
pub struct TrainOptions {
    /// Where rank 0 writes one JSON line per step.
    pub metrics: Option<PathBuf>,
}

/// What a finished run reports (identical on every rank).
#[derive(Debug, Clone)]
pub struct TrainReport {
    /// Training loss of each step.
    pub losses: Vec<f64>,
    /// (step, validation loss) pairs.
    pub val_losses: Vec<(u64, f64)>,
    /// Mean tokens per second over the steps after the first.
    pub tokens_per_s: f64,
}

/// Trains `cfg` on this world (every rank calls it): set-up, the steps, the finish
/// ([`session::Session`]).
pub fn train(world: &World, cfg: &JobConfig, opts: &TrainOptions) -> Result<TrainReport> {
    // From here on SIGTERM/SIGUSR1 stop the run after a step, with a checkpoint (`shutdown.rs`).
    shutdown::install()?;
    let mut colocated = None;
    let mut session = match cfg.uses_ps() {
        false => Session::setup(world, cfg, opts)?,
        true => match ps::start(world, cfg)? {
            ps::Role::Worker(workers, links) => Session::setup_on(world, workers, Some(links), cfg, opts)?,
            ps::Role::Server(servers, links) => {
                ps::serve(servers, links, cfg)?;
                return Ok(TrainReport { losses: Vec::new(), val_losses: Vec::new(), tokens_per_s: 0.0 });
            }
            ps::Role::Colocated(workers, links, server) => {
                colocated = Some(ps::spawn_colocated(server, cfg)?);
                Session::setup_on(world, workers, Some(links), cfg, opts)?
            }
        },
    };
    let mut last = session.steps().start() - 1;
    for step in session.steps() {
        last = step;
        if let StepEnd::Stop = session.step(step)? {
            break;
        }
    }
    let report = session.finish(last)?;
    // The colocated server ends once every worker has finished.
    colocated.map_or(Ok(()), ps::join_colocated)?;
    Ok(report)
}
