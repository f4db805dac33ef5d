//! The training step after the backward, on every device arm: data-parallel gradient
//! reduction, the global-norm clip and AdamW, for ZeRO 0-3.
//!
//! The reduction is bucketed ([`DataParallel`]'s buckets) and where it runs is chosen once, here,
//! by the memory the model's buffers live in:
//! - host memory (the `cpu` arm) with more than one data-parallel rank: the backward hands each
//!   unit's gradients over as soon as they
//!   are final (a pipeline stage: its whole buffer after the round), they are staged into
//!   buckets and every full bucket is reduced on a communication thread with a communicator of
//!   its own while the backward goes on ([`OverlapReducer`]); the step waits only for what is left;
//! - device memory (cuda, hip, emu) with more than one data-parallel rank: the same hand-over,
//!   each unit's gradients packed into bucket staging on the device and every full bucket
//!   reduced with the device collectives (`comm::device`: peers' memory mapped within a node,
//!   libfabric rings or staging between nodes) on a communication thread with a device lane
//!   (a CUDA stream) of its own ([`DeviceReducer`]); `MESHTRAIN_GPU_OVERLAP=off` reduces on the
//!   compute thread instead: at ZeRO 0 and 1 once after the last backward, at ZeRO 2 after every
//!   backward, unit by unit during the backward of a whole model that frees its reduced
//!   gradients (ZeRO-2/3). Both give the same bits.
//!
//! At ZeRO 0 the reduced gradients are one flat buffer, clipped by their global norm (under
//! tensor parallelism the squares of the elements this rank counts, summed over the TP group: a
//! replicated tensor is counted once), AdamW runs on the flat f32 master weights and the updated
//! weights are copied back into the model's tensors. At ZeRO 1 to 3 the moments and reduced
//! gradients are this rank's shard only, and AdamW updates the shard's block of the model's own
//! f32 parameters, which are the master weights ([`super::device_zero`]).
//!
//! Under loss scaling (`loss_scale.rs`) the reduced gradients are S times the loss's: the norm
//! is divided by S before the verdict and the clip, and the AdamW factor that carries the clipping
//! scale carries 1/S too, so unscaling adds no pass over the gradients; a skipped step leaves the
//! moments and the step count alone.
//!
//! Invariants: the flat buffers follow the layout table (an entry is an offset range); the
//! device parameters and moments are the truth during training, the host copies (the model's
//! mirror, [`DataParallel`]'s AdamW states) are refreshed by [`DeviceStep::store`] before a
//! checkpoint and loaded by [`DeviceStep::load`] after initialisation or resume. The norm's
//! squares are added per (bucket, counted span), in bucket order, so the CPU arm's norm is the
//! same number whichever path reduced. On a GPU the compiler may fuse multiply-adds and the
//! norm's block sums differ, so results agree with the CPU's to rounding, not bit for bit.

use std::ops::Range;

use std::sync::Arc;

use super::buckets::{OverlapReducer, ReduceTiming, Reduction};
use super::device_overlap::DeviceReducer;
use super::device_whole::WholeState;
use super::device_zero::DeviceShards;
use super::grad_sync::{DataParallel, Spans, StepOutcome};
use super::ps::PsClient;
use crate::comm::device::{GpuCommConfig, GpuCommState};
use crate::comm::stats::CommStats;
use crate::comm::{Communicator, ReduceOp};
use crate::device::cpu::adamw::AdamWStep;
use crate::device::ops::SUM_BLOCKS;
use crate::device::Device;
use crate::device::DeviceBuffer;
use crate::error::{Error, Result};
use crate::model::DeviceGpt;
use crate::optim::clip_scale;
use crate::optim::AdamWConfig;

/// The device optimizer state: whole flat buffers (ZeRO 0) or this rank's shard (ZeRO 1/2);
/// none on a parameter-server worker (the servers hold the moments and run AdamW).
enum State {
    Whole(WholeState),
    Sharded(DeviceShards),
    Servers,
}

/// The reduction overlapping the backward: on host memory or on device memory, or the pushes
/// to parameter servers (`parallel.dp_sync = "ps"`).
enum Overlap {
    Host(OverlapReducer),
    Device(DeviceReducer),
    Ps(Box<PsClient>),
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
    /// The bucket reducer overlapping the backward, and its traffic counters (more than one
    /// data-parallel rank).
    overlap: Option<(Overlap, Arc<CommStats>)>,
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
        (decay, norm): (&Spans, &Spans),
        config: AdamWConfig,
    ) -> Result<Self> {
        Self::build(model, sync, dp, (decay, norm), config, None)
    }

    /// [`DeviceStep::new`] whose gradients go to parameter servers through `client` instead of
    /// being reduced among the data-parallel ranks (the servers update; the step installs their
    /// parameters). No reducer or communicator of its own is made.
    pub fn with_ps(
        model: &DeviceGpt,
        sync: &DataParallel,
        dp: &Communicator,
        spans: (&Spans, &Spans),
        config: AdamWConfig,
        client: PsClient,
    ) -> Result<Self> {
        Self::build(model, sync, dp, spans, config, Some(client))
    }

    fn build(
        model: &DeviceGpt,
        sync: &DataParallel,
        dp: &Communicator,
        (decay, norm): (&Spans, &Spans),
        config: AdamWConfig,
        ps: Option<PsClient>,
    ) -> Result<Self> {
        let dev = model.device();
        let cfg = GpuCommConfig::from_env()?;
        let servers = ps.is_some();
        // One data-parallel rank has nothing to reduce: no thread, no staging of every bucket.
        let overlap = if let Some(client) = ps {
            let stats = client.stats();
            Some((Overlap::Ps(Box::new(client)), stats))
        } else if dp.size() > 1 && (cfg.overlap || matches!(dev, Device::Cpu)) {
            let comm = dp.split(Some(0), dp.rank() as i64)?.expect("every rank joins color 0");
            let stats = comm.stats();
            let reduction = if sync.zero == 0 { Reduction::AllReduce } else { Reduction::ReduceScatter };
            let buckets = sync.bucket_ranges().to_vec();
            let o = match dev {
                Device::Cpu => Overlap::Host(OverlapReducer::new(comm, buckets, reduction)),
                _ => Overlap::Device(DeviceReducer::new(dev, comm, cfg.clone(), buckets, reduction)?),
            };
            Some((o, stats))
        } else {
            None
        };
        let state = match sync.zero {
            _ if servers => State::Servers,
            0 => State::Whole(WholeState::new(model, sync, (decay, norm), overlap.is_none())?),
            1..=3 => State::Sharded(DeviceShards::new(model, sync, decay, norm)?),
            z => return Err(Error::config("parallel.zero", format!("the device step runs ZeRO 0-3, not {z}"))),
        };
        Ok(DeviceStep {
            state,
            partials: dev.alloc(SUM_BLOCKS * 4)?,
            config,
            step: 0,
            coll: GpuCommState::new(cfg),
            overlap,
            every_backward: sync.reduces_every_backward(),
        })
    }

    /// Whether the gradients are reduced during the backward on a communication thread, as
    /// (host reducer, device reducer): what the memory formula counts as staging.
    pub fn reduces_during_backward(&self) -> (bool, bool) {
        match &self.overlap {
            Some((Overlap::Host(_) | Overlap::Ps(_), _)) => (true, false),
            Some((Overlap::Device(_), _)) => (false, true),
            None => (false, false),
        }
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
        match &mut self.overlap {
            Some((Overlap::Host(r), _)) => r.begin(micro_batches),
            Some((Overlap::Device(r), _)) => r.begin(micro_batches),
            Some((Overlap::Ps(c), _)) => c.begin(micro_batches),
            None => {}
        }
    }

    /// Parameter servers: this worker's loss of the step (see [`PsClient::note_loss`]).
    pub fn note_loss(&mut self, loss: f64) {
        if let Some((Overlap::Ps(c), _)) = &mut self.overlap {
            c.note_loss(loss);
        }
    }

    /// Parameter servers: the staleness histogram and version, for the metrics (none otherwise).
    pub fn ps_metrics(&self) -> Vec<(String, serde_json::Value)> {
        match &self.overlap {
            Some((Overlap::Ps(c), _)) => c.metrics(),
            _ => Vec::new(),
        }
    }

    /// Device bytes of the optimizer state and its staging buffers.
    pub fn device_bytes(&self) -> usize {
        let staging = match &self.overlap {
            Some((Overlap::Device(r), _)) => r.device_bytes(),
            _ => 0,
        };
        staging
            + match &self.state {
                State::Whole(w) => w.device_bytes(),
                State::Sharded(s) => s.device_bytes(),
                State::Servers => 0,
            }
    }

    /// Takes the master weights from the model's host copy and the moments and step count from
    /// `sync`'s AdamW states (a fresh start or a resume) onto the device, stops the model's
    /// backward from bringing gradients to the host (this step reads them on the device), and
    /// gives the host copies' memory back: from here on the device holds the training state.
    pub fn load(&mut self, model: &mut DeviceGpt, sync: &mut DataParallel) -> Result<()> {
        model.set_host_reports(false);
        if let Some((Overlap::Ps(c), _)) = &mut self.overlap {
            c.load(model, sync)?;
        }
        self.step = match &mut self.state {
            State::Sharded(s) => s.load(model, sync)?,
            State::Whole(w) => w.load(model, sync)?,
            State::Servers => sync.states().first().map_or(0, |s| s.step),
        };
        model.release_host_params()?;
        sync.release_states();
        Ok(())
    }

    /// Brings the training state into the model's host copy of the parameters and `sync`'s
    /// AdamW states, so a checkpoint sees it (give it back with [`DataParallel::release_states`]
    /// once written).
    pub fn store(&mut self, model: &mut DeviceGpt, sync: &mut DataParallel) -> Result<()> {
        sync.ensure_states();
        if let Some((Overlap::Ps(c), _)) = &mut self.overlap {
            return c.fetch(model, sync);
        }
        match &self.state {
            State::Sharded(s) => s.store(model, sync, self.step),
            State::Whole(w) => w.store(model, sync, self.step),
            State::Servers => Err(Error::Check("a parameter-server worker stores what the servers send".into())),
        }
    }

    /// Unmaps the peers' buffers (collective over `dp`; before the buffers are freed).
    pub fn finish(&mut self, model: &DeviceGpt, dp: &Communicator) -> Result<()> {
        if let Some((Overlap::Device(r), _)) = &mut self.overlap {
            r.release(model.device())?;
        }
        if let Some((Overlap::Ps(c), _)) = &mut self.overlap {
            c.finish()?;
        }
        self.coll.release_mappings(dp, model.device())
    }

    /// Runs after each backward (a pipeline: each reporting round) of a step of
    /// `(micro_batches, covered)`: `covered` of the step's micro-batches are in the model's
    /// gradients. A pipeline stage's gradients are final here: the host reducer stages them (at
    /// ZeRO-2/3 then zeroes the model's); on device memory ZeRO-2 reduces them over `dp` into the
    /// shards (and zeroes the model's gradients).
    pub fn after_backward(&mut self, model: &mut DeviceGpt, dp: &Communicator, batches: (usize, usize)) -> Result<()> {
        if self.overlap.is_some() {
            // A whole model handed its units over during the backward.
            if !model.is_whole() {
                let n = model.layout().total_len();
                self.hand_over(model, 0..n)?;
                if self.every_backward {
                    model.zero_grad()?;
                }
            }
            return Ok(());
        }
        match &mut self.state {
            State::Sharded(s) => s.after_backward(model, dp, &mut self.coll, batches),
            State::Whole(_) | State::Servers => Ok(()),
        }
    }

    /// During a backward that hands each unit's gradients over as they become final
    /// ([`DeviceGpt::backward_reducing`]): reduces the unit `unit` (host memory: stages it and
    /// launches its complete buckets; device memory, ZeRO-2/3: reduce-scatters its buckets).
    pub fn reduce_unit(&mut self, model: &DeviceGpt, dp: &Communicator, micro_batches: usize, unit: Range<usize>) -> Result<()> {
        if self.overlap.is_some() {
            return self.hand_over(model, unit);
        }
        match &mut self.state {
            State::Sharded(s) if s.per_unit() => s.reduce_unit(model, dp, &mut self.coll, micro_batches, unit),
            _ => Err(Error::Check("a unit's gradients reached a device step that reduces them whole".into())),
        }
    }

    /// Hands the final gradients `range` to the overlapping reducer (a device reducer adds
    /// the blocks it receives meanwhile into the shards).
    fn hand_over(&mut self, model: &DeviceGpt, range: Range<usize>) -> Result<()> {
        match (&mut self.overlap, &mut self.state) {
            (Some((Overlap::Host(r), _)), state) => {
                let dev = model.device();
                model.host_grads_in(range, &mut |range, g| r.on_final(range, g, &mut host_sink(dev, state)))
            }
            (Some((Overlap::Device(r), _)), state) => r.on_final(model, range, &mut shard_sink(model.device(), state)),
            (Some((Overlap::Ps(c), _)), _) => {
                let mut failed = Ok(());
                let mut scratch = c.take_scratch();
                model.grads_to_host_in(range, &mut scratch, &mut |range, g| {
                    if failed.is_ok() {
                        failed = c.on_final(range, g);
                    }
                })?;
                c.put_scratch(scratch);
                failed
            }
            (None, _) => Err(Error::Check("gradients handed to a step that reduces after the backward".into())),
        }
    }

    /// Finishes the step's gradient reduction: returns this rank's sum of squares of the counted
    /// reduced gradients (summed over `dp` where sharded), the reduction's timing and whether this
    /// rank's own gradients held a NaN or an infinity before the reduction.
    fn reduce(&mut self, model: &mut DeviceGpt, dp: &Communicator, micro_batches: usize) -> Result<(f64, ReduceTiming, bool)> {
        Ok(match (&mut self.overlap, &mut self.state) {
            (Some((Overlap::Ps(_), _)), _) | (_, State::Servers) => {
                return Err(Error::Check("parameter-server steps end in PsClient::finish_step".into()))
            }
            (Some((Overlap::Host(r), _)), State::Whole(w)) => {
                let timing = w.take_reduced(model, r)?;
                (w.square(), timing, r.local_nonfinite())
            }
            (Some((Overlap::Host(r), _)), State::Sharded(s)) => {
                let timing = r.finish(&mut |k, _, block, first| s.add_host_block(model.device(), k, block, first))?;
                s.end_overlapped()?;
                (s.square(model, dp, &mut self.partials)?, timing, r.local_nonfinite())
            }
            (Some((Overlap::Device(r), _)), State::Whole(w)) => {
                let timing = w.take_device_reduced(model, r, &mut self.partials)?;
                (w.square(), timing, r.take_nonfinite(model.device())?)
            }
            (Some((Overlap::Device(r), _)), State::Sharded(s)) => {
                let timing = r.finish(&mut |k, _, block, first| s.add_block(model.device(), k, block, first))?;
                s.end_overlapped()?;
                (s.square(model, dp, &mut self.partials)?, timing, r.take_nonfinite(model.device())?)
            }
            (None, State::Whole(w)) => {
                let comm = w.reduce(model, (dp, &mut self.coll), &mut self.partials, micro_batches)?;
                // The reduction runs after the backward, so all of it is exposed.
                let sq = w.square();
                // One data-parallel rank: its squares are its own (before the TP sum).
                let bad = w.take_nonfinite(model)? || dp.size() == 1 && !sq.is_finite();
                (sq, ReduceTiming { comm, exposed: comm }, bad)
            }
            (None, State::Sharded(s)) => {
                let comm = s.reduce_all(model, dp, &mut self.coll, micro_batches)?;
                let sq = s.square(model, dp, &mut self.partials)?;
                let bad = s.take_nonfinite(model)? || dp.size() == 1 && !sq.is_finite();
                (sq, ReduceTiming { comm, exposed: comm }, bad)
            }
        })
    }

    /// One optimizer step from the model's device gradients summed over `micro_batches` (ZeRO-2:
    /// already reduced into the shards), averaged over them and over `dp`; the gradients are
    /// `loss_scale` times the loss's and the update divides them by it, in the factor that also
    /// clips to `max_norm` (<= 0: off). Returns the pre-clip global norm of the unscaled
    /// gradients, whose partial sums of squares are added over `groups` (the TP group). `apply(norm, own)` sees the norm, and whether this rank's own
    /// gradients were non-finite before the reduction, before anything changes; `false` (the
    /// same on every rank) skips the update.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        model: &mut DeviceGpt,
        dp: &Communicator,
        groups: &[&Communicator],
        micro_batches: usize,
        lr: f64,
        (max_norm, loss_scale): (f64, f64),
        apply: &mut dyn FnMut(f64, bool) -> Result<bool>,
    ) -> Result<StepOutcome> {
        // The step's stream-ordered TP calls are only checked here: before anything is applied.
        model.check_collectives()?;
        let (mut sq, timing, own_bad) = match &mut self.overlap {
            Some((Overlap::Ps(c), _)) => c.finish_step(model, lr)?,
            _ => self.reduce(model, dp, micro_batches)?,
        };
        // A device reducer's thread says which path its buckets took.
        if self.step == 0 && dp.size() > 1 && self.overlap.is_none() {
            let (ipc, calls) = self.coll.path_counts();
            let path = if ipc == calls { "mapped peer memory (IPC)" } else { "staging through host memory" };
            log::info!("data-parallel gradient reduction over {} ranks after the backward: {path}", dp.size());
        }
        // The servers' squares are the whole model's already.
        let groups = if matches!(self.overlap, Some((Overlap::Ps(_), _))) { &[] } else { groups };
        for g in groups {
            let mut s = [sq];
            g.all_reduce(&mut s, ReduceOp::Sum)?;
            sq = s[0];
        }
        self.coll.check(dp, model.device())?;
        // Unscaled: a power-of-two scale (every dynamic one from the defaults) changes no bit.
        let grad_norm = sq.sqrt() / loss_scale;
        if !apply(grad_norm, own_bad)? {
            return Ok(StepOutcome { grad_norm, timing });
        }
        self.step += 1;
        if let Some((Overlap::Ps(_), _)) = &self.overlap {
            // The servers updated; their parameters are in the model already.
            return Ok(StepOutcome { grad_norm, timing });
        }
        let update = AdamWStep {
            config: &self.config,
            step: self.step,
            lr,
            grad_scale: clip_scale(grad_norm, max_norm) / loss_scale,
        };
        match &mut self.state {
            State::Whole(w) => w.update(model, &update)?,
            State::Sharded(s) => s.update(model, dp, &mut self.coll, &update)?,
            State::Servers => return Err(Error::Check("a parameter-server worker's update is the servers'".into())),
        }
        Ok(StepOutcome { grad_norm, timing })
    }
}

/// The sink a device reducer hands reduced blocks to during the backward: the shards' (the
/// whole state all-reduces, and receives its buckets at the step only).
fn shard_sink<'a>(dev: &'a Device, state: &'a mut State) -> impl FnMut(usize, Range<usize>, &DeviceBuffer, bool) -> Result<()> + 'a {
    move |k, _, block, first| match state {
        State::Sharded(s) => s.add_block(dev, k, block, first),
        State::Whole(_) | State::Servers => Err(Error::Check("an all-reduced bucket was handed over before the step".into())),
    }
}

/// [`shard_sink`] for the host reducer's blocks in host memory.
fn host_sink<'a>(dev: &'a Device, state: &'a mut State) -> impl FnMut(usize, Range<usize>, &[f32], bool) -> Result<()> + 'a {
    move |k, _, block, first| match state {
        State::Sharded(s) => s.add_host_block(dev, k, block, first),
        State::Whole(_) | State::Servers => Err(Error::Check("an all-reduced bucket was handed over before the step".into())),
    }
}
