//! The optimizer step of the device model on its device (ZeRO 0): gradients packed into one flat
//! buffer, averaged over the data-parallel group by the device collectives (`comm::device`: peers'
//! GPU memory mapped over IPC within a node, staged through pinned host memory otherwise; a CPU
//! device reduces its host buffers), clipped by their global norm (under tensor parallelism the
//! squares of the elements this rank counts, summed over the TP group: a replicated tensor is
//! counted once), AdamW on the flat
//! f32 master weights, and the updated weights copied back into the model's tensors. Nothing
//! crosses to the host but the norm's block sums, so a GPU step is not bound by PCIe or by host
//! memory bandwidth the way the host-mirror step is.
//!
//! Invariants: the flat buffers follow the layout table (an entry is an offset range); the
//! device master weights and moments are the truth during training, the host copies (the model's
//! mirror, [`DataParallel`]'s AdamW states) are refreshed by [`DeviceStep::store`] before a
//! checkpoint and loaded by [`DeviceStep::load`] after initialisation or resume. The arithmetic is
//! the host step's (same AdamW coefficients and expression, same clip scale): on the CPU device
//! element for element except the order in which the norm's squares add; on a GPU the compiler
//! may also fuse multiply-adds, so results agree to rounding, not bit for bit.

use std::ops::Range;
use std::time::Instant;

use super::buckets::ReduceTiming;
use super::grad_sync::{DataParallel, StepOutcome};
use crate::comm::device::{GpuCommConfig, GpuCommState};
use crate::comm::{Communicator, DType, ReduceOp};
use crate::device::ipc::alloc_shareable;
use crate::device::ops::{self, AdamWBuffers, SUM_BLOCKS};
use crate::device::DeviceBuffer;
use crate::error::{Error, Result};
use crate::model::DeviceGpt;
use crate::optim::clip::clip_scale;
use crate::optim::AdamWConfig;

/// Flat optimizer buffers of the device model.
pub struct DeviceStep {
    params: DeviceBuffer,   // (P) f32 master weights
    grads: DeviceBuffer,    // (P) f32 gradients of the step (shareable: peers map it over IPC)
    m: DeviceBuffer,        // (P) first moments
    v: DeviceBuffer,        // (P) second moments
    partials: DeviceBuffer, // (SUM_BLOCKS) block sums of squares
    /// (range, decay) segments of the flat buffer.
    decay: Vec<(Range<usize>, bool)>,
    /// Ranges whose squares this rank adds to the global norm (maximal runs).
    counted: Vec<Range<usize>>,
    config: AdamWConfig,
    /// Steps taken (the next is `step + 1`).
    step: u64,
    n: usize,
    /// The data-parallel gradient average on device buffers (IPC within a node, staged across).
    coll: GpuCommState,
}

impl DeviceStep {
    /// Buffers for `model`'s parameters with weight decay on the `decay` segments, counting the
    /// `(range, counted)` spans `norm` in the gradient norm.
    pub fn new(
        model: &DeviceGpt,
        decay: Vec<(Range<usize>, bool)>,
        norm: &[(Range<usize>, bool)],
        config: AdamWConfig,
    ) -> Result<Self> {
        let dev = model.device();
        let n = model.params().len();
        let flat = || dev.alloc(n * 4);
        Ok(DeviceStep {
            params: flat()?,
            grads: alloc_shareable(dev, n * 4)?,
            m: flat()?,
            v: flat()?,
            partials: dev.alloc(SUM_BLOCKS * 4)?,
            decay,
            counted: counted_runs(norm),
            config,
            step: 0,
            n,
            coll: GpuCommState::new(GpuCommConfig::from_env()?),
        })
    }

    /// Takes the master weights from the model's host mirror and the moments and step count from
    /// `sync`'s AdamW states (a fresh start or a resume), sets the model's tensors from them, and
    /// stops the model's backward from bringing gradients to the host (this step reads them on
    /// the device).
    pub fn load(&mut self, model: &mut DeviceGpt, sync: &DataParallel) -> Result<()> {
        let dev = model.device();
        dev.copy_to_device(&mut self.params, model.params())?;
        let (m, v, step) = gather_moments(sync, self.n)?;
        dev.copy_to_device(&mut self.m, &m)?;
        dev.copy_to_device(&mut self.v, &v)?;
        self.step = step;
        model.set_host_reports(false);
        model.unpack_params(&self.params)
    }

    /// Copies the master weights to the model's host mirror and the moments and step count into
    /// `sync`'s AdamW states, so a checkpoint sees the training state.
    pub fn store(&self, model: &mut DeviceGpt, sync: &mut DataParallel) -> Result<()> {
        model.host_params_from(&self.params)?;
        let dev = model.device();
        let (mut m, mut v) = (vec![0f32; self.n], vec![0f32; self.n]);
        dev.copy_to_host(&self.m, &mut m)?;
        dev.copy_to_host(&self.v, &mut v)?;
        for s in sync.states_mut() {
            let r = s.range();
            s.m.copy_from_slice(&m[r.clone()]);
            s.v.copy_from_slice(&v[r]);
            s.step = self.step;
        }
        Ok(())
    }

    /// Unmaps the peers' gradient buffers (collective over `dp`; before the buffers are freed).
    pub fn finish(&mut self, model: &DeviceGpt, dp: &Communicator) -> Result<()> {
        self.coll.release_mappings(dp, model.device())
    }

    /// One optimizer step from the model's device gradients summed over `micro_batches`,
    /// averaged over them and over `dp`; clips to `max_norm` (<= 0: off) and returns the
    /// pre-clip global norm, whose partial sums of squares are added over `groups` (the TP group).
    pub fn step(
        &mut self,
        model: &mut DeviceGpt,
        dp: &Communicator,
        groups: &[&Communicator],
        micro_batches: usize,
        lr: f64,
        max_norm: f64,
    ) -> Result<StepOutcome> {
        model.pack_grads(&mut self.grads)?;
        let dev = model.device();
        if micro_batches > 1 {
            // The host step's staging copy multiplies by the same f32 factor.
            ops::scale(dev, &mut self.grads, 0, self.n, 1.0 / micro_batches as f32)?;
        }
        // The backward and the packing are still queued: the communication time starts after them.
        dev.synchronize()?;
        let t0 = Instant::now();
        if dp.size() > 1 {
            self.coll.bind(dp, dev).all_reduce(&mut self.grads, self.n, DType::F32, ReduceOp::Avg)?;
        }
        let comm = t0.elapsed();
        if self.step == 0 && dp.size() > 1 {
            let (ipc, calls) = self.coll.path_counts();
            let path = if ipc == calls { "mapped peer memory (IPC)" } else { "staging through host memory" };
            log::info!("data-parallel gradient average over {} ranks: {path}", dp.size());
        }
        let mut sq = [0.0f64];
        for r in &self.counted {
            sq[0] += ops::sum_squares(dev, &mut self.partials, &self.grads, r.start, r.len())?;
        }
        for g in groups {
            g.all_reduce(&mut sq, ReduceOp::Sum)?;
        }
        let grad_norm = sq[0].sqrt();
        let scale = clip_scale(grad_norm, max_norm);
        if scale != 1.0 {
            ops::scale(dev, &mut self.grads, 0, self.n, scale as f32)?;
        }
        self.step += 1;
        for (span, decay) in &self.decay {
            let bufs = AdamWBuffers { params: &mut self.params, grads: &self.grads, m: &mut self.m, v: &mut self.v };
            ops::adamw_update(dev, bufs, span.clone(), &self.config, self.step, lr, *decay)?;
        }
        model.unpack_params(&self.params)?;
        // The reduction runs after the backward, so all of it is exposed.
        let timing = ReduceTiming { comm, exposed: comm };
        Ok(StepOutcome { grad_norm, timing })
    }
}

/// The counted ranges of `(range, counted)` spans, adjacent ones merged (one range on a rank that
/// counts everything, so the norm adds up as over the whole buffer).
fn counted_runs(spans: &[(Range<usize>, bool)]) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for (r, _) in spans.iter().filter(|(_, c)| *c) {
        match runs.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => runs.push(r.clone()),
        }
    }
    runs
}

/// The flat moments and the step count of `sync`'s states (ZeRO 0: they cover every element).
fn gather_moments(sync: &DataParallel, n: usize) -> Result<(Vec<f32>, Vec<f32>, u64)> {
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    let mut covered = 0;
    let mut step = None;
    for s in sync.states() {
        let r = s.range();
        covered += r.len();
        m[r.clone()].copy_from_slice(&s.m);
        v[r].copy_from_slice(&s.v);
        if *step.get_or_insert(s.step) != s.step {
            return Err(Error::Check("AdamW states of one model disagree on the step count".into()));
        }
    }
    if covered != n {
        return Err(Error::Check(format!("AdamW states cover {covered} of {n} parameters: the device step needs ZeRO 0")));
    }
    Ok((m, v, step.unwrap_or(0)))
}
