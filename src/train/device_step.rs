//! The optimizer step of the device model on its device. At ZeRO 0 the gradients are packed into
//! one flat buffer, averaged over the data-parallel group by the device collectives
//! (`comm::device`: peers' GPU memory mapped over IPC within a node, staged through pinned host
//! memory otherwise; a CPU device reduces its host buffers), clipped by their global norm (under
//! tensor parallelism the squares of the elements this rank counts, summed over the TP group: a
//! replicated tensor is counted once), AdamW runs on the flat f32 master weights, and the updated
//! weights are copied back into the model's tensors. At ZeRO 1 and 2 the master weights, moments
//! and reduced gradients are this rank's shard only, reduce-scattered and all-gathered bucket by
//! bucket ([`super::device_zero`]). Nothing crosses to the host but the norm's block sums, so a
//! GPU step is not bound by PCIe or by host memory bandwidth the way a host-mirror step is.
//!
//! Invariants: the flat buffers follow the layout table (an entry is an offset range); the
//! device master weights and moments are the truth during training, the host copies (the model's
//! mirror, [`DataParallel`]'s AdamW states) are refreshed by [`DeviceStep::store`] before a
//! checkpoint and loaded by [`DeviceStep::load`] after initialisation or resume. The arithmetic is
//! the host step's (same AdamW coefficients and expression, same clip scale): on the CPU device
//! element for element (ZeRO 0: except the order in which the norm's squares add); on a GPU the
//! compiler may also fuse multiply-adds, so results agree to rounding, not bit for bit.

use std::ops::Range;
use std::time::{Duration, Instant};

use super::buckets::ReduceTiming;
use super::device_zero::DeviceShards;
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

/// The device optimizer state: whole flat buffers (ZeRO 0) or this rank's shard (ZeRO 1/2).
enum State {
    Whole(WholeBuffers),
    Sharded(DeviceShards),
}

/// Flat optimizer buffers of the whole model (ZeRO 0).
struct WholeBuffers {
    params: DeviceBuffer, // (P) f32 master weights
    grads: DeviceBuffer,  // (P) f32 gradients of the step (shareable: peers map it over IPC)
    m: DeviceBuffer,      // (P) first moments
    v: DeviceBuffer,      // (P) second moments
    /// (range, decay) segments of the flat buffer.
    decay: Vec<(Range<usize>, bool)>,
    /// Ranges whose squares this rank adds to the global norm (maximal runs).
    counted: Vec<Range<usize>>,
    n: usize,
}

/// The optimizer step of the device model on its device.
pub struct DeviceStep {
    state: State,
    partials: DeviceBuffer, // (SUM_BLOCKS) block sums of squares
    config: AdamWConfig,
    /// Steps taken (the next is `step + 1`).
    step: u64,
    /// The data-parallel gradient reduction on device buffers (IPC within a node, staged across).
    coll: GpuCommState,
}

impl DeviceStep {
    /// Buffers for `model`'s parameters laid out as `sync` shards them (ZeRO 0: whole; ZeRO 1/2:
    /// `sync`'s blocks of its buckets), with weight decay on the `decay` segments, counting the
    /// `(range, counted)` spans `norm` in the gradient norm.
    pub fn new(
        model: &DeviceGpt,
        sync: &DataParallel,
        decay: Vec<(Range<usize>, bool)>,
        norm: &[(Range<usize>, bool)],
        config: AdamWConfig,
    ) -> Result<Self> {
        let dev = model.device();
        let state = match sync.zero {
            0 => {
                let n = model.params().len();
                let flat = || dev.alloc(n * 4);
                State::Whole(WholeBuffers {
                    params: flat()?,
                    grads: alloc_shareable(dev, n * 4)?,
                    m: flat()?,
                    v: flat()?,
                    decay,
                    counted: counted_runs(norm),
                    n,
                })
            }
            1..=3 => State::Sharded(DeviceShards::new(model, sync, &decay, norm)?),
            z => return Err(Error::config("parallel.zero", format!("the device step runs ZeRO 0-3, not {z}"))),
        };
        Ok(DeviceStep {
            state,
            partials: dev.alloc(SUM_BLOCKS * 4)?,
            config,
            step: 0,
            coll: GpuCommState::new(GpuCommConfig::from_env()?),
        })
    }

    /// Device bytes of the optimizer state and its staging buffers.
    pub fn device_bytes(&self) -> usize {
        match &self.state {
            State::Whole(w) => 16 * w.n,
            State::Sharded(s) => s.device_bytes(),
        }
    }

    /// Takes the master weights from the model's host mirror and the moments and step count from
    /// `sync`'s AdamW states (a fresh start or a resume), sets the model's tensors from them, and
    /// stops the model's backward from bringing gradients to the host (this step reads them on
    /// the device).
    pub fn load(&mut self, model: &mut DeviceGpt, sync: &DataParallel) -> Result<()> {
        model.set_host_reports(false);
        let w = match &mut self.state {
            State::Sharded(s) => {
                self.step = s.load(model, sync)?;
                return Ok(());
            }
            State::Whole(w) => w,
        };
        let dev = model.device();
        dev.copy_to_device(&mut w.params, model.params())?;
        let (m, v, step) = gather_moments(sync, w.n)?;
        dev.copy_to_device(&mut w.m, &m)?;
        dev.copy_to_device(&mut w.v, &v)?;
        self.step = step;
        model.unpack_params(&w.params)
    }

    /// Copies the master weights to the model's host mirror and the moments and step count into
    /// `sync`'s AdamW states, so a checkpoint sees the training state.
    pub fn store(&self, model: &mut DeviceGpt, sync: &mut DataParallel) -> Result<()> {
        let w = match &self.state {
            State::Sharded(s) => return s.store(model, sync, self.step),
            State::Whole(w) => w,
        };
        model.host_params_from(&w.params)?;
        let dev = model.device();
        let (mut m, mut v) = (vec![0f32; w.n], vec![0f32; w.n]);
        dev.copy_to_host(&w.m, &mut m)?;
        dev.copy_to_host(&w.v, &mut v)?;
        for s in sync.states_mut() {
            let r = s.range();
            s.m.copy_from_slice(&m[r.clone()]);
            s.v.copy_from_slice(&v[r]);
            s.step = self.step;
        }
        Ok(())
    }

    /// Unmaps the peers' buffers (collective over `dp`; before the buffers are freed).
    pub fn finish(&mut self, model: &DeviceGpt, dp: &Communicator) -> Result<()> {
        self.coll.release_mappings(dp, model.device())
    }

    /// Runs after each backward (a pipeline: each reporting round) of a step of
    /// `(micro_batches, covered)`: `covered` of the step's micro-batches are in the model's
    /// gradients; ZeRO-2 reduces them over `dp` into the shards there (and zeroes the model's
    /// gradients).
    pub fn after_backward(&mut self, model: &mut DeviceGpt, dp: &Communicator, batches: (usize, usize)) -> Result<()> {
        match &mut self.state {
            State::Sharded(s) => s.after_backward(model, dp, &mut self.coll, batches),
            State::Whole(_) => Ok(()),
        }
    }

    /// During a backward that hands each unit's gradients over as they become final
    /// ([`DeviceGpt::backward_reducing`], ZeRO-2/3 on a whole model): reduces the unit `unit`.
    pub fn reduce_unit(&mut self, model: &DeviceGpt, dp: &Communicator, micro_batches: usize, unit: Range<usize>) -> Result<()> {
        match &mut self.state {
            State::Sharded(s) if s.per_unit() => s.reduce_unit(model, dp, &mut self.coll, micro_batches, unit),
            _ => Err(Error::Check("a unit's gradients reached a device step that reduces them whole".into())),
        }
    }

    /// One optimizer step from the model's device gradients summed over `micro_batches` (ZeRO-2:
    /// already reduced into the shards), averaged over them and over `dp`; clips to `max_norm`
    /// (<= 0: off) and returns the pre-clip global norm, whose partial sums of squares are added
    /// over `groups` (the TP group). `apply` sees the norm before anything changes; `false` (the
    /// same on every rank) skips the update.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        model: &mut DeviceGpt,
        dp: &Communicator,
        groups: &[&Communicator],
        micro_batches: usize,
        lr: f64,
        max_norm: f64,
        apply: &mut dyn FnMut(f64) -> Result<bool>,
    ) -> Result<StepOutcome> {
        // The step's stream-ordered TP calls are only checked here: before anything is applied.
        model.check_collectives()?;
        let (mut sq, comm) = match &mut self.state {
            State::Whole(w) => w.reduce_and_square(model, dp, &mut self.coll, &mut self.partials, micro_batches)?,
            State::Sharded(s) => s.reduce_and_square(model, dp, &mut self.coll, &mut self.partials, micro_batches)?,
        };
        if self.step == 0 && dp.size() > 1 {
            let (ipc, calls) = self.coll.path_counts();
            let path = if ipc == calls { "mapped peer memory (IPC)" } else { "staging through host memory" };
            log::info!("data-parallel gradient reduction over {} ranks: {path}", dp.size());
        }
        for g in groups {
            let mut s = [sq];
            g.all_reduce(&mut s, ReduceOp::Sum)?;
            sq = s[0];
        }
        self.coll.check(dp, model.device())?;
        let grad_norm = sq.sqrt();
        // The reduction runs after the backward, so all of it is exposed.
        let timing = ReduceTiming { comm, exposed: comm };
        if !apply(grad_norm)? {
            return Ok(StepOutcome { grad_norm, timing });
        }
        let scale = clip_scale(grad_norm, max_norm);
        self.step += 1;
        match &mut self.state {
            State::Whole(w) => w.update(model, scale, &self.config, self.step, lr)?,
            State::Sharded(s) => s.update(model, dp, &mut self.coll, scale, &self.config, self.step, lr)?,
        }
        Ok(StepOutcome { grad_norm, timing })
    }
}

impl WholeBuffers {
    /// Packs the gradients, averages them over the micro-batches and `dp`, and returns this
    /// rank's sum of squares of the counted elements and the reduction time.
    fn reduce_and_square(
        &mut self,
        model: &DeviceGpt,
        dp: &Communicator,
        coll: &mut GpuCommState,
        partials: &mut DeviceBuffer,
        micro_batches: usize,
    ) -> Result<(f64, Duration)> {
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
            coll.bind(dp, dev).all_reduce(&mut self.grads, self.n, DType::F32, ReduceOp::Avg)?;
        }
        let comm = t0.elapsed();
        let mut sq = 0.0f64;
        for r in &self.counted {
            sq += ops::sum_squares(dev, partials, &self.grads, r.start, r.len())?;
        }
        Ok((sq, comm))
    }

    /// Clips by `scale`, applies AdamW step `step` at `lr` and sets the model's tensors.
    fn update(&mut self, model: &mut DeviceGpt, scale: f64, config: &AdamWConfig, step: u64, lr: f64) -> Result<()> {
        let dev = model.device();
        if scale != 1.0 {
            ops::scale(dev, &mut self.grads, 0, self.n, scale as f32)?;
        }
        for (span, decay) in &self.decay {
            let bufs = AdamWBuffers { params: &mut self.params, grads: &self.grads, m: &mut self.m, v: &mut self.v };
            ops::adamw_update(dev, bufs, span.clone(), config, step, lr, *decay)?;
        }
        model.unpack_params(&self.params)
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
