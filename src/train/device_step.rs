//! The training step after the backward, on every device arm: data-parallel gradient
//! reduction, the global-norm clip and AdamW, for ZeRO 0-3.
//!
//! The reduction is bucketed ([`DataParallel`]'s buckets) and where it runs is chosen once, here,
//! by the memory the model's buffers live in:
//! - host memory (the `cpu` arm): the backward hands each unit's gradients over as soon as they
//!   are final (a pipeline stage: its whole buffer after the round), they are staged into
//!   buckets and every full bucket is reduced on a communication thread with a communicator of
//!   its own while the backward goes on ([`OverlapReducer`]); the step waits only for what is left;
//! - device memory (cuda, hip, emu): the device collectives (`comm::device`: peers' memory mapped
//!   within a node, stream-ordered small calls, libfabric rings or staging between nodes): at ZeRO
//!   0 and 1 once after the last backward, at ZeRO 2 after every backward, unit by unit during
//!   the backward of a whole model that frees its reduced gradients (ZeRO-2/3).
//!
//! At ZeRO 0 the reduced gradients are one flat buffer, clipped by their global norm (under
//! tensor parallelism the squares of the elements this rank counts, summed over the TP group: a
//! replicated tensor is counted once), AdamW runs on the flat f32 master weights and the updated
//! weights are copied back into the model's tensors. At ZeRO 1 to 3 the master weights, moments
//! and reduced gradients are this rank's shard only ([`super::device_zero`]).
//!
//! Invariants: the flat buffers follow the layout table (an entry is an offset range); the
//! device master weights and moments are the truth during training, the host copies (the model's
//! mirror, [`DataParallel`]'s AdamW states) are refreshed by [`DeviceStep::store`] before a
//! checkpoint and loaded by [`DeviceStep::load`] after initialisation or resume. The norm's
//! squares are added per (bucket, counted span), in bucket order, so the CPU arm's norm is the
//! same number whichever path reduced. On a GPU the compiler may fuse multiply-adds and the
//! norm's block sums differ, so results agree with the CPU's to rounding, not bit for bit.

use std::ops::Range;
use std::time::{Duration, Instant};

use std::sync::Arc;

use super::buckets::{OverlapReducer, ReduceTiming, Reduction};
use super::device_zero::DeviceShards;
use super::grad_sync::{DataParallel, StepOutcome};
use crate::comm::device::{GpuCommConfig, GpuCommState};
use crate::comm::stats::CommStats;
use crate::comm::{Communicator, DType, ReduceOp};
use crate::device::Device;
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
    /// Ranges whose squares this rank adds to the global norm: (bucket ∩ counted span), in
    /// bucket order.
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
    /// Host-memory arms: the bucket reducer overlapping the backward, and its traffic counters.
    overlap: Option<(OverlapReducer, Arc<CommStats>)>,
    /// ZeRO-2/3: every backward's gradients are reduced (not only the step's last).
    every_backward: bool,
}

impl DeviceStep {
    /// Buffers for `model`'s parameters laid out as `sync` shards them over `dp` (ZeRO 0: whole;
    /// ZeRO 1-3: `sync`'s blocks of its buckets), with weight decay on the `decay` segments,
    /// counting the `(range, counted)` spans `norm` in the gradient norm. Collective over `dp`
    /// (a host-memory arm's reducer thread gets a communicator of its own).
    pub fn new(
        model: &DeviceGpt,
        sync: &DataParallel,
        dp: &Communicator,
        (decay, norm): (Vec<(Range<usize>, bool)>, &[(Range<usize>, bool)]),
        config: AdamWConfig,
    ) -> Result<Self> {
        let dev = model.device();
        let overlap = match dev {
            Device::Cpu => {
                let comm = dp.split(Some(0), dp.rank() as i64)?.expect("every rank joins color 0");
                let stats = comm.stats();
                let reduction = if sync.zero == 0 { Reduction::AllReduce } else { Reduction::ReduceScatter };
                Some((OverlapReducer::new(comm, sync.bucket_ranges().to_vec(), reduction), stats))
            }
            _ => None,
        };
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
                    counted: bucket_spans(sync.bucket_ranges(), norm),
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
            overlap,
            every_backward: sync.reduces_every_backward(),
        })
    }

    /// Traffic counters of the overlapping reducer's communicator (host-memory arms).
    pub fn bucket_stats(&self) -> Option<Arc<CommStats>> {
        self.overlap.as_ref().map(|(_, s)| s.clone())
    }

    /// Whether a whole model's reporting backward should hand each unit's gradients to
    /// [`DeviceStep::reduce_unit`] as they become final.
    pub fn wants_units(&self, model: &DeviceGpt) -> bool {
        model.releases_grads() || self.overlap.is_some() && model.is_whole()
    }

    /// Starts a step of `micro_batches` micro-batches (their gradients are averaged).
    pub fn begin(&mut self, micro_batches: usize) {
        if let Some((r, _)) = &mut self.overlap {
            r.begin(micro_batches);
        }
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
    /// gradients. A pipeline stage's gradients are final here: the host reducer stages them (at
    /// ZeRO-2/3 then zeroes the model's); on device memory ZeRO-2 reduces them over `dp` into the
    /// shards (and zeroes the model's gradients).
    pub fn after_backward(&mut self, model: &mut DeviceGpt, dp: &Communicator, batches: (usize, usize)) -> Result<()> {
        if let Some((r, _)) = &mut self.overlap {
            // A whole model handed its units over during the backward.
            if !model.is_whole() {
                let n = model.params().len();
                model.host_grads_in(0..n, &mut |range, g| r.on_final(range, g))?;
                if self.every_backward {
                    model.zero_grad()?;
                }
            }
            return Ok(());
        }
        match &mut self.state {
            State::Sharded(s) => s.after_backward(model, dp, &mut self.coll, batches),
            State::Whole(_) => Ok(()),
        }
    }

    /// During a backward that hands each unit's gradients over as they become final
    /// ([`DeviceGpt::backward_reducing`]): reduces the unit `unit` (host memory: stages it and
    /// launches its complete buckets; device memory, ZeRO-2/3: reduce-scatters its buckets).
    pub fn reduce_unit(&mut self, model: &DeviceGpt, dp: &Communicator, micro_batches: usize, unit: Range<usize>) -> Result<()> {
        if let Some((r, _)) = &mut self.overlap {
            return model.host_grads_in(unit, &mut |range, g| r.on_final(range, g));
        }
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
        let (mut sq, timing) = match (&mut self.overlap, &mut self.state) {
            (Some((r, _)), State::Whole(w)) => {
                let timing = r.finish(ops::host_mut("reduced gradients", &mut w.grads)?.view_mut::<f32>(w.n))?;
                (w.square(model.device(), &mut self.partials)?, timing)
            }
            (Some((r, _)), State::Sharded(s)) => {
                let timing = r.finish(&mut [])?;
                s.take_reduced(model, r)?;
                (s.square(model, dp, &mut self.partials)?, timing)
            }
            (None, State::Whole(w)) => {
                let comm = w.reduce(model, dp, &mut self.coll, micro_batches)?;
                // The reduction runs after the backward, so all of it is exposed.
                (w.square(model.device(), &mut self.partials)?, ReduceTiming { comm, exposed: comm })
            }
            (None, State::Sharded(s)) => {
                let comm = s.reduce_all(model, dp, &mut self.coll, micro_batches)?;
                (s.square(model, dp, &mut self.partials)?, ReduceTiming { comm, exposed: comm })
            }
        };
        if self.step == 0 && dp.size() > 1 && self.overlap.is_none() {
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
    /// Packs the gradients and averages them over the micro-batches and `dp` with the device
    /// collectives; returns the reduction time.
    fn reduce(&mut self, model: &DeviceGpt, dp: &Communicator, coll: &mut GpuCommState, micro_batches: usize) -> Result<Duration> {
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
        Ok(t0.elapsed())
    }

    /// This rank's sum of squares of the counted elements of the reduced gradients.
    fn square(&self, dev: &Device, partials: &mut DeviceBuffer) -> Result<f64> {
        let mut sq = 0.0f64;
        for r in &self.counted {
            sq += ops::sum_squares(dev, partials, &self.grads, r.start, r.len())?;
        }
        Ok(sq)
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

/// The counted parts of `(range, counted)` spans cut at the bucket boundaries, in bucket order
/// (each bucket's parts in span order).
fn bucket_spans(buckets: &[Range<usize>], spans: &[(Range<usize>, bool)]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    for b in buckets {
        for (r, _) in spans.iter().filter(|(_, c)| *c) {
            let (lo, hi) = (b.start.max(r.start), b.end.min(r.end));
            if lo < hi {
                out.push(lo..hi);
            }
        }
    }
    out
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
