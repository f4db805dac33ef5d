//! Tensor parallelism of the device model ([`super::DeviceGpt`]): its TP group with the device
//! collectives, and the vocabulary-parallel ends (embedding and loss) of a rank that holds one
//! shard of `wte`'s rows. The layout and the placement of the collectives are those of the CPU
//! shard executor (`stage.rs`): column-parallel qkv and fc,
//! row-parallel projections whose partial (B*T, C) outputs are summed over TP before the bias is
//! added once, replicated LayerNorms, a vocab-parallel embedding summed over TP and a
//! cross-entropy that combines per-shard maxima and sums (never gathering full logits). With
//! sequence parallelism the sums become reduce-scatters of row blocks and the LayerNorm outputs
//! are all-gathered (`device_gpt/layers.rs`).
//!
//! Invariant: every member of the group receives bitwise the same result from each collective
//! (the device collectives reduce each element once and copy it), so without sequence
//! parallelism every activation entering a replicated tensor is identical on all members and
//! replicated gradients need no reduction; with it they are summed over the group.

use crate::comm::device::{GpuCommConfig, GpuCommState};
use crate::comm::{Communicator, DType, ReduceOp};
use crate::device::ops_vocab::{self, VocabShard};
use crate::device::{Device, DeviceBuffer};
use crate::error::Result;

/// A tensor-parallel group of device models (communicator member index = TP rank).
pub struct DeviceTp {
    comm: Communicator,
    state: GpuCommState,
}

impl DeviceTp {
    /// The group of `comm`, with the device collectives configured from the environment.
    pub fn new(comm: Communicator) -> Result<Self> {
        Ok(DeviceTp { comm, state: GpuCommState::new(GpuCommConfig::from_env()?) })
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Members of the group.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// Element-wise sum over the group of the first `n` f32 of `buf`, in place.
    pub fn sum(&mut self, dev: &Device, buf: &mut DeviceBuffer, n: usize) -> Result<()> {
        self.state.bind(&self.comm, dev).all_reduce(buf, n, DType::F32, ReduceOp::Sum)
    }

    /// Element-wise maximum over the group of the first `n` f32 of `buf`, in place.
    pub fn max(&mut self, dev: &Device, buf: &mut DeviceBuffer, n: usize) -> Result<()> {
        self.state.bind(&self.comm, dev).all_reduce(buf, n, DType::F32, ReduceOp::Max)
    }

    /// `full` (`n_full` f32) gets every member's `local` block of rows, member `r`'s at block `r`.
    pub fn gather_rows(&mut self, dev: &Device, local: &DeviceBuffer, full: &mut DeviceBuffer, n_full: usize) -> Result<()> {
        self.state.bind(&self.comm, dev).all_gather_into(local, full, n_full, DType::F32)
    }

    /// `local` gets this member's block of rows of the group's element-wise sum of `full`
    /// (`n_full` f32).
    pub fn scatter_rows(&mut self, dev: &Device, full: &DeviceBuffer, local: &mut DeviceBuffer, n_full: usize) -> Result<()> {
        self.state.bind(&self.comm, dev).reduce_scatter_into(full, local, n_full, DType::F32, ReduceOp::Sum)
    }

    /// Collective: an error on every member if a stream-ordered call of the group failed on any.
    pub fn check(&mut self, dev: &Device) -> Result<()> {
        self.state.check(&self.comm, dev)
    }

    /// Checks the last calls, then closes the peer mappings the collectives cached (collective;
    /// before buffers are freed).
    pub fn release(&mut self, dev: &Device) -> Result<()> {
        self.state.check(&self.comm, dev)?;
        self.state.release_mappings(&self.comm, dev)
    }
}

/// Sums `buf`'s first `n` f32 over the group, if there is one.
pub(super) fn tp_sum(tp: &mut Option<DeviceTp>, dev: &Device, buf: &mut DeviceBuffer, n: usize) -> Result<()> {
    match tp {
        Some(g) => g.sum(dev, buf, n),
        None => Ok(()),
    }
}

/// The embedding's tensors and buffers.
pub(super) struct Embed<'a> {
    pub tokens: &'a DeviceBuffer, // (B*T) u32
    pub wte: &'a DeviceBuffer,    // (vl, C) shard
    pub wpe: &'a DeviceBuffer,    // (maxT, C)
}

/// out (B*T, C) = wte[token] + wpe[position]: each rank looks up its in-shard tokens (zero rows
/// elsewhere), the rows are summed over the group (adding zeros is exact), then positions added.
pub(super) fn embed_forward(
    dev: &Device,
    tp: &mut DeviceTp,
    out: &mut DeviceBuffer,
    e: Embed,
    (b, t, c): (usize, usize, usize),
    shard: VocabShard,
) -> Result<()> {
    let bt = b * t;
    ops_vocab::embedding_shard_forward(dev, out, e.tokens, e.wte, (bt, c), shard)?;
    tp.sum(dev, out, bt * c)?;
    ops_vocab::position_forward(dev, out, e.wpe, 0..bt, (t, c))
}

/// dwte_shard += the rows of dout (B*T, C, identical on every rank) of in-shard tokens;
/// dwpe += dout summed over the batch.
#[allow(clippy::too_many_arguments)]
pub(super) fn embed_backward(
    dev: &Device,
    dwte: &mut DeviceBuffer,
    dwpe: &mut DeviceBuffer,
    dout: &DeviceBuffer,
    tokens: &DeviceBuffer,
    (b, t, c): (usize, usize, usize),
    shard: VocabShard,
) -> Result<()> {
    ops_vocab::position_backward(dev, dwpe, dout, 0..b * t, (t, c))?;
    ops_vocab::embedding_shard_backward(dev, dwte, dout, tokens, (b * t, c), shard)
}

/// The loss's buffers: inputs, outputs and the group statistics.
pub(super) struct LossBufs<'a> {
    pub logits: &'a DeviceBuffer,  // (B*T, vl) this shard's logits
    pub targets: &'a DeviceBuffer, // (B*T) u32
    pub losses: &'a mut DeviceBuffer, // (B*T)
    pub lse: &'a mut DeviceBuffer, // (B*T) global log-sum-exp
    pub max: &'a mut DeviceBuffer, // (B*T) global row max
    pub stats: &'a mut DeviceBuffer, // (2*B*T) sum-exp | target logit, summed over the group
}

/// Per-row cross-entropy of the vocab-sharded logits: shard max, group max; shard sum-exp and
/// target logit, group sums; then lse and losses on every rank.
pub(super) fn loss_forward(dev: &Device, tp: &mut DeviceTp, l: LossBufs, n: usize, shard: VocabShard) -> Result<()> {
    ops_vocab::shard_max(dev, l.max, l.logits, n, shard)?;
    tp.max(dev, l.max, n)?;
    ops_vocab::shard_sum_exp(dev, l.stats, l.logits, l.max, l.targets, n, shard)?;
    tp.sum(dev, l.stats, 2 * n)?;
    ops_vocab::cross_entropy_combine(dev, l.losses, l.lse, l.max, l.stats, n)
}
