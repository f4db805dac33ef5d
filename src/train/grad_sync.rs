//! How the data-parallel group shares gradients and optimizer state, for ZeRO stages 0-3:
//!
//! | stage | gradients reduced by | resident per rank (fp32, Ψ parameters, N ranks)         |
//! |-------|----------------------|----------------------------------------------------------|
//! | 0     | all-reduce           | params 4Ψ, grads 4Ψ (+4Ψ staging), AdamW 8Ψ              |
//! | 1     | reduce-scatter       | params 4Ψ, grads 4Ψ + 4Ψ/N shard, AdamW 8Ψ/N             |
//! | 2     | reduce-scatter each micro-batch | params 4Ψ, grads 4Ψ/N shard, AdamW 8Ψ/N     |
//! | 3     | reduce-scatter each micro-batch | params 4Ψ/N, grads 4Ψ/N shard, AdamW 8Ψ/N   |
//!
//! The flat gradient buffer is cut into buckets ([`super::buckets::plan_buckets`]); with ZeRO >= 1
//! a rank's shard is block `dp_rank` of every bucket (an offset range per bucket): its AdamW state
//! and its reduced gradients cover exactly those ranges. The step that reduces, clips and updates
//! is [`super::device_step::DeviceStep`], on every device arm; this type is only the plan and the
//! host copy of the optimizer state that checkpoints read and write.
//!
//! Invariants: buckets are disjoint, contiguous, cover the buffer and never straddle a unit at
//! ZeRO >= 2 (units are reduced as they become final, and ZeRO-3 gathers by bucket); every rank
//! of the group plans the same buckets; the states' ranges are the owned blocks, in bucket order.

use std::ops::Range;

use super::buckets::{plan_buckets, ReduceTiming};
use crate::comm::block_range;
use crate::error::{Error, Result};
use crate::optim::AdamWState;

/// `(flat range, flag)` spans of a parameter buffer: weight decay on, or counted in the norm.
pub type Spans = [(Range<usize>, bool)];

/// How gradients and optimizer state are laid out across the data-parallel group.
pub struct DataParallel {
    /// ZeRO stage (0-3, see the module documentation).
    pub zero: u8,
    /// Gradient buckets, in readiness order (last elements first).
    buckets: Vec<Range<usize>>,
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
    /// order) on rank `dp_rank` of `dp_size` at ZeRO `zero`, with buckets of `bucket_elems`
    /// gradients.
    pub fn new((dp_rank, dp_size): (usize, usize), units: &[Range<usize>], zero: u8, bucket_elems: usize) -> Result<Self> {
        if zero > 3 {
            return Err(Error::config("parallel.zero", format!("{zero} is not a ZeRO stage (0-3)")));
        }
        let n = units.last().map_or(0, |u| u.end);
        let whole = 0..n;
        let buckets = if zero >= 2 { plan_buckets(units, bucket_elems) } else { plan_buckets(std::slice::from_ref(&whole), bucket_elems) };
        let states = buckets
            .iter()
            .map(|b| {
                let own = match zero {
                    0 => b.clone(),
                    _ => {
                        let blk = block_range(b.len(), dp_size, dp_rank);
                        b.start + blk.start..b.start + blk.end
                    }
                };
                AdamWState::new(own.start, own.len())
            })
            .collect();
        Ok(DataParallel { zero, buckets, states })
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

    /// Number of gradient buckets.
    pub fn buckets(&self) -> usize {
        self.states.len()
    }

    /// The gradient buckets, in readiness order.
    pub fn bucket_ranges(&self) -> &[Range<usize>] {
        &self.buckets
    }

    /// AdamW states, one per bucket (covering this rank's part of it).
    pub fn states(&self) -> &[AdamWState<f32>] {
        &self.states
    }

    /// Mutable AdamW states (for restoring a checkpoint).
    pub fn states_mut(&mut self) -> &mut [AdamWState<f32>] {
        &mut self.states
    }

    /// Gives the host moments' memory back (the device step holds the training state).
    pub fn release_states(&mut self) {
        self.states.iter_mut().for_each(AdamWState::release);
    }

    /// Brings released host moments back to their lengths (before a checkpoint reads them).
    pub fn ensure_states(&mut self) {
        self.states.iter_mut().for_each(AdamWState::ensure);
    }

    /// The flat ranges this rank updates.
    pub fn owned(&self) -> Vec<Range<usize>> {
        self.states.iter().map(|s| s.range()).collect()
    }
}
