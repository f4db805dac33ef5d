//! One rank's training step built exactly as [`super::train`] builds it, for `meshtrain bench
//! step`: the grid of one rank, the [`Replica`] (the shard executor [`crate::model::DeviceGpt`]
//! holding the whole model on the chosen device arm and precision), the data-parallel layout
//! ([`DataParallel`], ZeRO 0) and the device optimizer step ([`DeviceStep`]). One
//! [`StepHarness::step`] is the trainer's step body for one micro-batch: zero the gradients,
//! forward and backward through `Replica::run` with the trainer's device events, then the device
//! step (the bucket reduction, global-norm clipping, AdamW in place on the model's tensors).
//!
//! Why a harness and not the bench building these objects: the bench must time what trains, and
//! the trainer's objects stay private to `train/`; this file is the one place outside `train()`
//! that assembles them. It repeats the calls of `train()`'s set-up and loop body (without data,
//! metrics, checkpoints or the non-finite guard): a change there must be made here too.
//!
//! Invariants: the harness is one rank of its own communicator's grid (tp = pp = dp = 1, ZeRO 0,
//! default parallel settings); after [`StepHarness::new`] the device step holds the training
//! state (master weights, moments), as after the trainer's load; [`StepHarness::step`] returns
//! only once the device has finished the step's work, so wall time around it is the step's.

use std::time::Instant;

use super::device_step::DeviceStep;
use super::grad_sync::DataParallel;
use super::replica::{DeviceEvent, Replica, ReplicaLayout};
use crate::comm::Communicator;
use crate::config::{ParallelConfig, Precision};
use crate::data::Batch;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::model::GptConfig;
use crate::optim::AdamWConfig;
use crate::parallel::grid::{Grid, GridShape};
use crate::parallel::schedule::Schedule;
use crate::parallel::stage_split;

/// Bytes the training step's objects hold on one rank, by term (ZeRO 0, one rank): what the
/// peak resident set of a CPU-arm step is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct HeldBytes {
    /// The device step's staging of one bucket (f32; one rank has no host reducer, and the
    /// model's host copies are given back while the device holds the state).
    pub staging: u64,
    /// The model's per-tensor device parameters and gradients (f32), plus the bf16 copies of the
    /// 2-D weights under bf16.
    pub model_tensors: u64,
    /// The device step's AdamW m and v (f32 each; updated in place on the model's tensors).
    pub optimizer: u64,
    /// Activations of every slot, layer scratch, GEMM and attention scratch.
    pub activations: u64,
    /// The CPU arm's GEMM widens bf16 operands into f32 copies: the largest pair a step
    /// multiplies (the tied head's: `wte` (Vp, C) and the (B*T, Vp) logit gradients); f32
    /// operands are read in place, and a GPU arm has none.
    pub gemm_staging: u64,
}

impl HeldBytes {
    /// Sum of the terms.
    pub fn total(&self) -> u64 {
        self.staging + self.model_tensors + self.optimizer + self.activations + self.gemm_staging
    }
}

/// What one step returns.
#[derive(Debug, Clone, Copy)]
pub struct StepResult {
    /// Mean loss of the micro-batch.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Wall seconds of the step (device work included).
    pub seconds: f64,
}

/// One rank's training step; see the module documentation.
pub struct StepHarness {
    model: Replica,
    /// Kept alive as in `train()`: the reducer's communicator and the host AdamW states (which
    /// the device step reads at load and writes only for a checkpoint).
    _sync: DataParallel,
    step: DeviceStep,
    dp: Communicator,
    batches: Vec<Batch>,
    config: GptConfig,
    precision: Precision,
}

impl StepHarness {
    /// The step of `config` for (B, T) micro-batches on `device` in `precision`, initialised from
    /// `seed`, on `comm` (a communicator of one rank).
    pub fn new(comm: &Communicator, config: GptConfig, (b, t): (usize, usize), device: (Device, Precision), seed: u64) -> Result<Self> {
        if comm.size() != 1 {
            return Err(Error::InvalidArgument(format!("the step harness runs on one rank, not {}", comm.size())));
        }
        let parallel = ParallelConfig::default();
        let precision = device.1;
        let Grid { tp, pp, dp, .. } = Grid::new(comm, GridShape::from_config(&parallel))?;
        let stage_layers = stage_split::stage_layers(&config, t, 1, &parallel.stage_layers)?;
        let layout = ReplicaLayout {
            tp,
            pp,
            sequence_parallel: false,
            schedule: Schedule::from_config(&parallel),
            microbatches: 1,
            stage_layers,
            device: (device.0, device.1.into()),
        };
        let mut model = Replica::new(config, b, t, layout)?;
        model.initialize(&config, seed)?;
        let bucket_elems = (parallel.bucket_mb * (1 << 20) as f64 / 4.0) as usize;
        let mut sync = DataParallel::new((dp.rank(), dp.size()), &model.units(), parallel.zero, bucket_elems)?;
        let spans = (model.decay_spans(), model.norm_spans());
        let mut step = DeviceStep::new(model.model(), &sync, &dp, (&spans.0, &spans.1), AdamWConfig::default())?;
        step.load(model.model_mut(), &mut sync)?;
        let batches = vec![Batch::new(b, t)];
        Ok(StepHarness { model, _sync: sync, step, dp, batches, config, precision })
    }

    /// Sets the micro-batch every step trains on: `tokens` and `targets` (B, T).
    pub fn set_batch(&mut self, tokens: &[u32], targets: &[u32]) -> Result<()> {
        let batch = &mut self.batches[0];
        if tokens.len() != batch.inputs.len() || targets.len() != batch.targets.len() {
            return Err(Error::InvalidArgument(format!("a step batch has B*T = {} tokens", batch.inputs.len())));
        }
        batch.inputs.copy_from_slice(tokens);
        batch.targets.copy_from_slice(targets);
        Ok(())
    }

    /// One training step on the batch at learning rate `lr`, clipping the global gradient norm
    /// to `max_norm` (<= 0: off).
    pub fn step(&mut self, lr: f64, max_norm: f64) -> Result<StepResult> {
        let start = Instant::now();
        self.model.zero_grad()?;
        self.step.begin(1);
        let units = self.step.wants_units(self.model.model());
        let (step, dp) = (&mut self.step, &self.dp);
        let mut events = |e: DeviceEvent| match e {
            DeviceEvent::UnitFinal(m, unit) => step.reduce_unit(m, dp, 1, unit),
            DeviceEvent::BackwardDone(m) => step.after_backward(m, dp, (1, 1)),
        };
        let loss = self.model.run(&self.batches, (false, units), &mut events)?;
        let outcome = self.step.step(self.model.model_mut(), &self.dp, &[], 1, lr, (max_norm, 1.0), &mut |_, _| Ok(true))?;
        self.model.device().synchronize()?;
        Ok(StepResult { loss, grad_norm: outcome.grad_norm, seconds: start.elapsed().as_secs_f64() })
    }

    /// Parameters of the model (the flat buffer's length, padded vocabulary included).
    pub fn params(&self) -> usize {
        self.model.model().layout().total_len()
    }

    /// What the step's objects hold (see [`HeldBytes`]).
    pub fn held_bytes(&self) -> HeldBytes {
        let m = self.model.model();
        let n = m.layout().total_len() as u64;
        let weights16: usize = match self.precision {
            Precision::Bf16 | Precision::Fp16 => m.layout().entries().iter().filter(|e| e.local_shape.len() == 2).map(|e| e.len).sum(),
            Precision::Fp32 => 0,
        };
        let (bt, c, vp) = (self.batches[0].inputs.len(), self.config.n_embd, self.config.padded_vocab_size());
        let host = matches!(m.device(), Device::Cpu | Device::Emu(_));
        let gemm_staging = match (host, self.precision) {
            (true, Precision::Bf16 | Precision::Fp16) => 4 * (vp * c + bt * vp) as u64,
            _ => 0,
        };
        HeldBytes {
            // One rank: the device step's one staging bucket (the host reducer needs two ranks).
            staging: self.step.device_bytes() as u64 - 8 * n,
            model_tensors: 8 * n + 2 * weights16 as u64,
            optimizer: 8 * n,
            activations: 4 * m.activation_elements() as u64,
            gemm_staging,
        }
    }

    /// Closes the device step's and the model's collectives (before the harness is dropped).
    pub fn finish(mut self) -> Result<()> {
        self.step.finish(self.model.model(), &self.dp)?;
        self.model.model_mut().release_collectives()
    }
}
