//! Data-parallel gradient synchronisation and the optimizer step, for ZeRO stages 0-3, all with
//! bucketed reduction overlapped with the backward pass ([`super::buckets`]):
//!
//! | stage | gradients reduced by | resident per rank (fp32, Ψ parameters, N ranks)         |
//! |-------|----------------------|----------------------------------------------------------|
//! | 0     | all-reduce           | params 4Ψ, grads 4Ψ (+4Ψ staging), AdamW 8Ψ              |
//! | 1     | reduce-scatter       | params 4Ψ, grads 4Ψ + 4Ψ/N shard, AdamW 8Ψ/N             |
//! | 2     | reduce-scatter each micro-batch | params 4Ψ, grads 4Ψ/N shard, AdamW 8Ψ/N     |
//! | 3     | reduce-scatter each micro-batch | params 4Ψ/N, grads 4Ψ/N shard, AdamW 8Ψ/N   |
//!
//! plus working buffers (staging buckets, the units being computed, see `memory_estimate.rs`).
//! With ZeRO >= 1 a rank's shard is block `dp_rank` of every bucket (an offset range per bucket):
//! its AdamW state and its reduced gradients cover exactly those ranges. ZeRO-1/2 all-gather the
//! updated parameters bucket by bucket; ZeRO-2/3 give a gradient range's pages back as soon as it
//! is staged (the model's flat gradient buffer is then mostly unbacked); ZeRO-3 keeps only the
//! owned blocks of the parameters and gathers the rest unit by unit ([`super::param_gather`]).
//!
//! Invariants: after [`DataParallel::step`] every data-parallel rank holds bit-identical
//! parameters (ZeRO-3: bit-identical blocks, identical gathers); the optimizer sees the mean
//! gradient over ranks and micro-batches; the global gradient norm is the same on every rank, so
//! clipping agrees everywhere.

use std::ops::Range;
use std::sync::Arc;

use super::buckets::{plan_buckets, OverlapReducer, ReduceTiming, Reduction};
use crate::comm::stats::CommStats;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::optim::AdamWState;

/// How gradients and optimizer state are laid out across the data-parallel group.
pub struct DataParallel {
    /// ZeRO stage (0-3, see the module documentation).
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
    /// Layout for the parameters `units` (contiguous ranges partitioning the flat buffer, in
    /// order) on `dp`'s ranks at ZeRO `zero` with buckets of `bucket_elems` gradients. Collective
    /// over `dp` (it makes the communication thread's own communicator).
    pub fn new(dp: &Communicator, units: &[Range<usize>], zero: u8, bucket_elems: usize) -> Result<Self> {
        if zero > 3 {
            return Err(Error::config("parallel.zero", format!("{zero} is not a ZeRO stage (0-3)")));
        }
        let thread_comm = dp.split(Some(0), dp.rank() as i64)?.expect("every rank joins color 0");
        let bucket_stats = thread_comm.stats();
        let n = units.last().map_or(0, |u| u.end);
        // ZeRO-3 gathers parameters bucket by bucket and the device model at ZeRO-2/3 reduces
        // gradients unit by unit as they become final, so those buckets must not straddle units.
        let whole = 0..n;
        let buckets = if zero >= 2 { plan_buckets(units, bucket_elems) } else { plan_buckets(std::slice::from_ref(&whole), bucket_elems) };
        let reduction = if zero == 0 { Reduction::AllReduce } else { Reduction::ReduceScatter };
        let reducer = OverlapReducer::new(thread_comm, buckets, reduction);
        let states = (0..reducer.buckets().len())
            .map(|b| {
                let r = reducer.shard(b);
                AdamWState::new(r.start, r.len())
            })
            .collect();
        Ok(DataParallel { zero, reducer, bucket_stats, states })
    }

    /// Whether every backward reports its gradients (ZeRO-2/3 reduce each micro-batch so that
    /// no rank holds the full accumulated gradient); otherwise only the last one does.
    pub fn reduces_every_backward(&self) -> bool {
        self.zero >= 2
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

    /// The gradient buckets, in readiness order.
    pub fn bucket_ranges(&self) -> &[Range<usize>] {
        self.reducer.buckets()
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
}
