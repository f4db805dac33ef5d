//! Data-parallel gradient synchronisation and the optimizer step: replicated optimizer state
//! (ZeRO-0) or state sharded across the data-parallel group (ZeRO-1), both with bucketed
//! reduction overlapped with the backward pass ([`super::buckets`]).
//!
//! Invariants: after [`DataParallel::step`] every data-parallel rank holds bit-identical
//! parameters; the optimizer sees the mean gradient over ranks and micro-batches; the global
//! gradient norm is the same on every rank, so clipping agrees everywhere. With ZeRO-1 a rank's
//! shard is block `dp_rank` of every bucket (an offset range per bucket): its AdamW state covers
//! exactly those ranges, and the updated parameters are all-gathered bucket by bucket.

use std::ops::Range;
use std::sync::Arc;

use super::buckets::{OverlapReducer, ReduceTiming};
use crate::comm::stats::CommStats;
use crate::comm::{Communicator, ReduceOp};
use crate::error::Result;
use crate::optim::{clip_scale, scale_grads, sum_of_squares, AdamW, AdamWState};

/// How gradients and optimizer state are laid out across the data-parallel group.
pub struct DataParallel {
    /// ZeRO stage (0: replicated state; 1: state sharded).
    pub zero: u8,
    reducer: OverlapReducer,
    /// Traffic of the reduction thread's communicator.
    bucket_stats: Arc<CommStats>,
    /// One AdamW state per bucket, covering that bucket's owned range.
    states: Vec<AdamWState<f32>>,
}

/// What one optimizer step reports.
pub struct StepOutcome {
    /// Global L2 norm of the averaged gradient, before clipping.
    pub grad_norm: f64,
    /// Gradient communication time and how much of it was not hidden behind backward.
    pub timing: ReduceTiming,
}

impl DataParallel {
    /// Layout for `n` parameters on `dp`'s ranks at ZeRO `zero` (0 or 1) with buckets of
    /// `bucket_elems` gradients. Collective over `dp` (it makes the communication thread's own
    /// communicator).
    pub fn new(dp: &Communicator, n: usize, zero: u8, bucket_elems: usize) -> Result<Self> {
        let thread_comm = dp.split(Some(0), dp.rank() as i64)?.expect("every rank joins color 0");
        let bucket_stats = thread_comm.stats();
        let reducer = OverlapReducer::new(thread_comm, n, bucket_elems, zero > 0);
        let states = (0..reducer.buckets().len())
            .map(|b| {
                let r = reducer.shard(b);
                AdamWState::new(r.start, r.len())
            })
            .collect();
        Ok(DataParallel { zero, reducer, bucket_stats, states })
    }

    /// Elements of optimizer state this rank holds (m and v each).
    pub fn state_len(&self) -> usize {
        self.states.iter().map(|s| s.m.len()).sum()
    }

    /// Traffic counters of the gradient-bucket communicator.
    pub fn bucket_stats(&self) -> Arc<CommStats> {
        self.bucket_stats.clone()
    }

    /// Number of gradient buckets.
    pub fn buckets(&self) -> usize {
        self.states.len()
    }

    /// AdamW states, one per bucket (covering this rank's part of it).
    pub fn states(&self) -> &[AdamWState<f32>] {
        &self.states
    }

    /// Mutable AdamW states (for restoring a checkpoint).
    pub fn states_mut(&mut self) -> &mut [AdamWState<f32>] {
        &mut self.states
    }

    /// The flat ranges this rank updates.
    pub fn owned(&self) -> Vec<Range<usize>> {
        self.states.iter().map(|s| s.range()).collect()
    }

    /// Starts a step of `micro_batches` micro-batches.
    pub fn begin(&mut self, micro_batches: usize) {
        self.reducer.begin(micro_batches);
    }

    /// Hook for the last micro-batch's backward: the gradients `range` are final, with values
    /// `data`.
    pub fn on_final(&mut self, range: Range<usize>, data: &[f32]) {
        self.reducer.on_final(range, data);
    }

    /// Finishes the reduction, clips by the global norm (`max_norm` 0 = off), applies AdamW at
    /// learning rate `lr`, and leaves identical `params` on every data-parallel rank. `counted`
    /// says which elements this rank counts in the norm; partial norms are summed over `groups`
    /// (the tensor- and pipeline-parallel groups) and, with ZeRO, over `dp`.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        dp: &Communicator,
        groups: &[&Communicator],
        counted: &[(Range<usize>, bool)],
        opt: &AdamW,
        lr: f64,
        max_norm: f64,
        params: &mut [f32],
        grads: &mut [f32],
    ) -> Result<StepOutcome> {
        let timing = self.reducer.finish(grads)?;
        let mut partial = 0.0f64;
        for s in &self.states {
            let owned = s.range();
            for (span, _) in counted.iter().filter(|(_, c)| *c) {
                let (lo, hi) = (owned.start.max(span.start), owned.end.min(span.end));
                if lo < hi {
                    partial += sum_of_squares(&grads[lo..hi]);
                }
            }
        }
        let mut sq = [partial];
        if self.zero > 0 {
            dp.all_reduce(&mut sq, ReduceOp::Sum)?;
        }
        for g in groups {
            g.all_reduce(&mut sq, ReduceOp::Sum)?;
        }
        let grad_norm = sq[0].sqrt();
        let scale = clip_scale(grad_norm, max_norm);
        for s in &mut self.states {
            let r = s.range();
            scale_grads(&mut grads[r.clone()], scale);
            opt.step(s, lr, &mut params[r.clone()], &grads[r])?;
        }
        if self.zero > 0 {
            for b in self.reducer.buckets().to_vec() {
                dp.all_gather(&mut params[b])?;
            }
        }
        Ok(StepOutcome { grad_norm, timing })
    }
}
