//! Data-parallel gradient synchronisation and the optimizer step, replicated (ZeRO-0) or with the
//! optimizer state sharded (ZeRO-1).
//!
//! Invariants: after [`DataParallel::step`] every data-parallel rank holds bit-identical
//! parameters; the gradient that the optimizer sees is the mean over ranks (and the caller has
//! already averaged over micro-batches); the global gradient norm is computed from the same
//! averaged gradient on every rank, so clipping agrees everywhere. A ZeRO shard is the offset range
//! `block_range(n_params, dp, dp_rank)` of the flat buffers.

use std::ops::Range;

use crate::comm::{block_range, Communicator, ReduceOp};
use crate::error::Result;
use crate::optim::{clip_scale, scale_grads, sum_of_squares, AdamW, AdamWState};

/// How gradients and optimizer state are laid out across the data-parallel group.
pub struct DataParallel {
    /// ZeRO stage (0: replicated state; 1: state sharded).
    pub zero: u8,
    /// The flat range this rank updates.
    shard: Range<usize>,
    state: AdamWState<f32>,
}

/// What one optimizer step reports.
pub struct StepOutcome {
    /// Global L2 norm of the averaged gradient, before clipping.
    pub grad_norm: f64,
}

impl DataParallel {
    /// Layout for `n` parameters on `dp`'s ranks at ZeRO `zero` (0 or 1).
    pub fn new(dp: &Communicator, n: usize, zero: u8) -> Self {
        let shard = if zero == 0 { 0..n } else { block_range(n, dp.size(), dp.rank()) };
        let state = AdamWState::new(shard.start, shard.len());
        DataParallel { zero, shard, state }
    }

    /// Elements of optimizer state this rank holds (m and v each).
    pub fn state_len(&self) -> usize {
        self.shard.len()
    }

    /// Optimizer steps taken.
    pub fn steps_taken(&self) -> u64 {
        self.state.step
    }

    /// Averages `grads` over the group, clips by the global norm (`max_norm` 0 = off), applies AdamW
    /// at learning rate `lr`, and leaves identical `params` on every rank.
    pub fn step(
        &mut self,
        dp: &Communicator,
        opt: &AdamW,
        lr: f64,
        max_norm: f64,
        params: &mut [f32],
        grads: &mut [f32],
    ) -> Result<StepOutcome> {
        let shard = self.shard.clone();
        if self.zero == 0 {
            dp.all_reduce(grads, ReduceOp::Avg)?;
        } else {
            dp.reduce_scatter(grads, ReduceOp::Avg)?;
        }
        let mut sq = [sum_of_squares(&grads[shard.clone()])];
        if self.zero > 0 {
            dp.all_reduce(&mut sq, ReduceOp::Sum)?;
        }
        let grad_norm = sq[0].sqrt();
        let scale = clip_scale(grad_norm, max_norm);
        if scale != 1.0 {
            scale_grads(&mut grads[shard.clone()], scale);
        }
        opt.step(&mut self.state, lr, &mut params[shard.clone()], &grads[shard])?;
        if self.zero > 0 {
            dp.all_gather(params)?;
        }
        Ok(StepOutcome { grad_norm })
    }
}
