//! The model one rank trains: the whole GPT (tensor parallelism 1), the whole GPT or this rank's
//! tensor-parallel shard of it on a device ([`DeviceGpt`]: a GPU, or bf16 numerics on the CPU;
//! the same [`ShardLayout`] as the CPU shard executor), this rank's tensor-parallel shard of it
//! ([`crate::model::Stage`] over the TP communicator), or one pipeline stage of it
//! ([`super::pipeline::Pipeline`]). The training
//! loop, the data-parallel reducer and the optimizer only see a flat parameter buffer, its
//! gradients, and two span lists: which elements get weight decay, and which elements this rank
//! counts in the global gradient norm (a tensor replicated over the TP group is counted by TP
//! rank 0 only, so the norm summed over the group counts every parameter once).

use std::ops::Range;

use super::pipeline::{Pipeline, StageExec};
use crate::comm::Communicator;
use crate::data::Batch;
use crate::error::{Error, Result};
use crate::config::Precision;
use crate::device::Device;
use crate::model::init::Initializer;
use crate::model::{
    DeviceGpt, DeviceTp, Gpt, GptConfig, ParamGate, ParamLayout, ShardLayout, Stage, StageInput, StageOutput, StageSpec,
};
use crate::parallel::schedule::Schedule;

/// A trainable model replica.
pub enum Replica {
    /// The whole model on this rank.
    Whole(Box<Gpt<f32>>),
    /// The whole model, or this rank's tensor-parallel shard of it, on this rank's device.
    Device(Box<DeviceGpt>),
    /// One shard of a tensor-parallel group.
    TensorParallel {
        /// The shard.
        stage: Box<Stage>,
        /// The tensor-parallel communicator.
        tp: Box<Communicator>,
    },
    /// One stage of a pipeline (itself possibly tensor parallel).
    Pipeline(Box<Pipeline>),
}

/// What the device model tells the trainer's device step during [`Replica::run`].
pub enum DeviceEvent<'a> {
    /// A unit's gradients (a flat range) are final for this micro-batch (a whole model whose
    /// gradients are freed once reduced: ZeRO-2/3): reduce them now.
    UnitFinal(&'a DeviceGpt, Range<usize>),
    /// A backward finished (a pipeline: a reporting round, after the tied embedding's sum).
    BackwardDone(&'a mut DeviceGpt),
}

/// One tensor of this rank's flat buffer as a box of the global tensor (for checkpoints).
#[derive(Debug, Clone)]
pub struct TensorMap {
    /// Global name (layout table).
    pub name: String,
    /// Shape of the whole tensor.
    pub global_shape: Vec<usize>,
    /// The global tensor viewed so that this rank's part is one box (a reshape of it).
    pub view_shape: Vec<usize>,
    /// Start of the box along each view dimension.
    pub box_offset: Vec<usize>,
    /// Extent of the box along each view dimension.
    pub box_shape: Vec<usize>,
    /// Elements in the rank's flat buffer.
    pub range: Range<usize>,
    /// Whether this rank writes it (copies replicated over TP, and the last stage's copy of the tied
    /// embedding, are written by another rank).
    pub owner: bool,
}

/// How a replica is laid out over the grid.
pub struct ReplicaLayout {
    /// Tensor-parallel communicator.
    pub tp: Communicator,
    /// Pipeline communicator.
    pub pp: Communicator,
    /// Sequence parallelism on.
    pub sequence_parallel: bool,
    /// Pipeline schedule.
    pub schedule: Schedule,
    /// Micro-batches per pipeline round.
    pub microbatches: usize,
    /// Blocks of each global pipeline stage ([`crate::parallel::stage_split::stage_layers`]).
    pub stage_layers: Vec<Range<usize>>,
    /// Run the whole model through the shard executor ([`Stage`]) even without tensor
    /// parallelism: ZeRO-2/3 need its units, parameter gate and mutable gradient reports.
    pub shard_executor: bool,
    /// Run the device model (tensor parallel over `tp`, possibly pipelined) on this device in
    /// this precision.
    pub device: Option<(Device, Precision)>,
}

impl Replica {
    /// A replica of `cfg` for (B, T) micro-batches with zero parameters (set them with
    /// [`Replica::initialize`] or a checkpoint); tensor parallel when `tp` has more than one
    /// member. No rank builds more of the model than its own part.
    pub fn new(cfg: GptConfig, b: usize, t: usize, l: ReplicaLayout) -> Result<Self> {
        cfg.validate()?;
        let zeros = || vec![0f32; ParamLayout::new(&cfg).total_len()];
        if l.device.is_some() && l.shard_executor {
            return Err(Error::Check("the device model runs without the CPU shard executor".into()));
        }
        if l.pp.size() > 1 {
            let p = Pipeline::new(
                cfg,
                b,
                t,
                l.tp,
                l.pp,
                l.sequence_parallel,
                l.schedule,
                l.microbatches,
                &l.stage_layers,
                l.device,
            )?;
            return Ok(Replica::Pipeline(Box::new(p)));
        }
        if let Some((dev, precision)) = l.device {
            let tp = if l.tp.size() > 1 { Some(DeviceTp::new(l.tp)?) } else { None };
            let (rank, size) = tp.as_ref().map_or((0, 1), |g| (g.rank(), g.size()));
            let spec = StageSpec::whole(&cfg);
            let params = vec![0f32; ShardLayout::new(&cfg, rank, size, &spec)?.total_len()];
            let m = DeviceGpt::stage(dev, cfg, (b, t), params, precision, (tp, l.sequence_parallel), spec, 1)?;
            return Ok(Replica::Device(Box::new(m)));
        }
        if l.tp.size() == 1 && !l.shard_executor {
            return Ok(Replica::Whole(Box::new(Gpt::from_params(cfg, b, t, zeros())?)));
        }
        let stage = Stage::new(cfg, l.tp.rank(), l.tp.size(), StageSpec::whole(&cfg), l.sequence_parallel, b, t, 1)?;
        Ok(Replica::TensorParallel { stage: Box::new(stage), tp: Box::new(l.tp) })
    }

    /// Sets this rank's parameters to the model's initialisation from `seed` (each element what
    /// the whole single-rank model starts with); with `only`, just the elements of those flat
    /// ranges (a ZeRO-3 rank's owned shard: the rest is gathered when needed and never touched
    /// here, so it takes no memory).
    pub fn initialize(&mut self, cfg: &GptConfig, seed: u64, only: Option<&[Range<usize>]>) -> Result<()> {
        let init = Initializer::new(cfg, &ParamLayout::new(cfg), seed);
        if let Some(m) = self.device_model_mut() {
            // The host mirror is whole (at ZeRO-3 the device keeps only the owned blocks).
            return m.init_params(&init);
        }
        match self.stage_mut() {
            Some(stage) => stage.init_params(&init, only),
            None if only.is_some() => Err(Error::Check("a partial initialisation needs the shard executor".into())),
            None => {
                let params = self.params_mut();
                init.fill(0..params.len(), params);
                Ok(())
            }
        }
    }

    /// Micro-batches one call of [`Replica::run`] consumes per accumulation round.
    pub fn round(&self) -> usize {
        match self {
            Replica::Pipeline(p) => p.microbatches(),
            _ => 1,
        }
    }

    /// Forward and backward of every batch, adding into the gradients; `on_final(range, values)`
    /// reports gradients as they become final, in the last backward only or (`every_backward`)
    /// in each (a pipeline reports once per round); the device model tells `device` when a
    /// backward is done (its device step reduces there at ZeRO 2/3; a pipeline once per reporting
    /// round, after the tied embedding's gradient is summed) or, when it frees reduced gradients,
    /// each unit as it becomes final. Returns the mean loss.
    pub fn run(
        &mut self,
        batches: &[Batch],
        every_backward: bool,
        on_final: &mut dyn FnMut(Range<usize>, &mut [f32]),
        device: &mut dyn FnMut(DeviceEvent) -> Result<()>,
    ) -> Result<f64> {
        let mut sum = 0.0;
        if let Replica::Pipeline(p) = self {
            p.start_step();
            let rounds = batches.len() / p.microbatches().max(1);
            for (i, round) in batches.chunks(p.microbatches()).enumerate() {
                sum += p.run(round)?;
                if every_backward || i + 1 == rounds {
                    p.report_grads(on_final)?;
                    if let StageExec::Device(m) = p.exec_mut() {
                        device(DeviceEvent::BackwardDone(m))?;
                    }
                }
            }
            return Ok(sum / batches.len() as f64);
        }
        for (i, b) in batches.iter().enumerate() {
            sum += self.forward(b)?;
            match self {
                Replica::Device(m) if m.releases_grads() => {
                    m.backward_reducing(&mut |m, unit| device(DeviceEvent::UnitFinal(m, unit)))?
                }
                _ if every_backward || i + 1 == batches.len() => self.backward(true, on_final)?,
                _ => self.backward(false, &mut |_, _| {})?,
            }
            if let Replica::Device(m) = self {
                device(DeviceEvent::BackwardDone(m))?;
            }
        }
        Ok(sum / batches.len() as f64)
    }

    /// The parameter units of the flat buffer (ZeRO-3 gathers them one by one): the shard
    /// executor's or the device model's units, or the whole buffer as one.
    pub fn units(&self) -> Vec<Range<usize>> {
        match (self.stage(), self.device_model()) {
            (Some(s), _) => s.units(),
            (None, Some(m)) => m.units(),
            (None, None) => std::iter::once(0..self.params().len()).collect(),
        }
    }

    /// Installs the ZeRO-3 parameter gate; the replica must run on the shard executor.
    pub fn set_param_gate(&mut self, gate: Box<dyn ParamGate>) -> Result<()> {
        match self.stage_mut() {
            Some(s) => {
                s.set_gate(gate);
                Ok(())
            }
            None => Err(Error::Check("a parameter gate needs the shard executor".into())),
        }
    }

    /// Gives back gathered parameter units (ZeRO-3) after the owned shard changed.
    pub fn release_gathered(&mut self) -> Result<()> {
        match self.stage_mut() {
            Some(s) => s.release_gathered(),
            None => Ok(()),
        }
    }

    /// The unit groups each pass acquires (empty without the shard executor).
    pub fn gather_passes(&self) -> Vec<Vec<Vec<Range<usize>>>> {
        self.stage().map_or(Vec::new(), |s| s.gather_passes().to_vec())
    }

    /// The flat range of the tied `wte` (shard), if this rank holds it.
    pub fn wte(&self) -> Option<Range<usize>> {
        match self {
            Replica::Whole(m) => Some(m.layout().wte()),
            Replica::Device(m) => m.layout().wte(),
            Replica::TensorParallel { stage, .. } => stage.layout().wte(),
            Replica::Pipeline(p) => p.exec().layout().wte(),
        }
    }

    fn stage(&self) -> Option<&Stage> {
        match self {
            Replica::Whole(_) | Replica::Device(_) => None,
            Replica::TensorParallel { stage, .. } => Some(stage),
            Replica::Pipeline(p) => match p.exec() {
                StageExec::Host { stage, .. } => Some(stage),
                StageExec::Device(_) => None,
            },
        }
    }

    fn stage_mut(&mut self) -> Option<&mut Stage> {
        match self {
            Replica::Whole(_) | Replica::Device(_) => None,
            Replica::TensorParallel { stage, .. } => Some(stage),
            Replica::Pipeline(p) => match p.exec_mut() {
                StageExec::Host { stage, .. } => Some(stage),
                StageExec::Device(_) => None,
            },
        }
    }

    /// Seconds of the last step this rank spent idle in the pipeline (bubble and transfers), and
    /// the pipeline rounds' total seconds; `None` without pipeline parallelism.
    pub fn pipeline_idle(&self) -> Option<(f64, f64)> {
        match self {
            Replica::Pipeline(p) => Some(p.idle()),
            _ => None,
        }
    }

    /// Pipeline metrics of the last step (bubble, per-stage compute, see
    /// [`Pipeline::step_metrics`]); empty without pipeline parallelism.
    pub fn pipeline_metrics(&self) -> Result<Vec<(String, serde_json::Value)>> {
        match self {
            Replica::Pipeline(p) => p.step_metrics(),
            _ => Ok(Vec::new()),
        }
    }

    /// Loss of one batch, forward only (on every rank).
    pub fn eval(&mut self, batch: &Batch) -> Result<f64> {
        match self {
            Replica::Pipeline(p) => p.eval(batch),
            _ => self.forward(batch),
        }
    }

    /// The device of the device model, if this replica is one.
    pub fn device(&self) -> Option<&Device> {
        self.device_model().map(DeviceGpt::device)
    }

    /// The device model (whole, a TP shard or a pipeline stage), if this replica is one.
    pub fn device_model(&self) -> Option<&DeviceGpt> {
        match self {
            Replica::Device(m) => Some(m),
            Replica::Pipeline(p) => match p.exec() {
                StageExec::Device(m) => Some(m),
                StageExec::Host { .. } => None,
            },
            _ => None,
        }
    }

    /// The device model, mutable.
    pub fn device_model_mut(&mut self) -> Option<&mut DeviceGpt> {
        match self {
            Replica::Device(m) => Some(m),
            Replica::Pipeline(p) => match p.exec_mut() {
                StageExec::Device(m) => Some(m),
                StageExec::Host { .. } => None,
            },
            _ => None,
        }
    }

    /// Parameters (flat, this rank's part).
    pub fn params(&self) -> &[f32] {
        match self {
            Replica::Whole(m) => m.params(),
            Replica::Device(m) => m.params(),
            Replica::TensorParallel { stage, .. } => stage.params(),
            Replica::Pipeline(p) => match p.exec() {
                StageExec::Host { stage, .. } => stage.params(),
                StageExec::Device(m) => m.params(),
            },
        }
    }

    /// Parameters and gradients.
    pub fn params_and_grads(&mut self) -> (&mut [f32], &mut [f32]) {
        match self {
            Replica::Whole(m) => m.params_and_grads(),
            Replica::Device(m) => m.params_and_grads(),
            Replica::TensorParallel { stage, .. } => stage.params_and_grads(),
            Replica::Pipeline(p) => match p.exec_mut() {
                StageExec::Host { stage, .. } => stage.params_and_grads(),
                StageExec::Device(m) => m.params_and_grads(),
            },
        }
    }

    /// Clears the gradients.
    pub fn zero_grad(&mut self) -> Result<()> {
        match self {
            Replica::Whole(m) => m.zero_grad(),
            Replica::Device(m) => return m.zero_grad(),
            Replica::TensorParallel { stage, .. } => stage.zero_grad(),
            Replica::Pipeline(p) => match p.exec_mut() {
                StageExec::Host { stage, .. } => stage.zero_grad(),
                StageExec::Device(m) => return m.zero_grad(),
            },
        }
        Ok(())
    }

    /// Mean loss of one micro-batch (identical on every TP rank), keeping activations for backward.
    fn forward(&mut self, batch: &Batch) -> Result<f64> {
        match self {
            Replica::Whole(m) => Ok(f64::from(m.forward(&batch.inputs, &batch.targets)?)),
            Replica::Device(m) => m.forward(&batch.inputs, &batch.targets),
            Replica::TensorParallel { stage, tp } => {
                match stage.forward(0, 0, StageInput::Tokens(&batch.inputs), Some(&batch.targets), &**tp)? {
                    StageOutput::Loss(l) => Ok(f64::from(l)),
                    StageOutput::Hidden(_) => unreachable!("a whole-model stage ends with the loss"),
                }
            }
            Replica::Pipeline(_) => unreachable!("pipelines run through `run`"),
        }
    }

    /// Backward of the last forward, adding into the gradients; `on_final(range, values)` is called
    /// for each range as soon as it is final.
    fn backward(&mut self, report: bool, on_final: &mut dyn FnMut(Range<usize>, &mut [f32])) -> Result<()> {
        match self {
            Replica::Whole(m) => m.backward_with(on_final),
            Replica::Device(m) => m.backward(report, on_final),
            Replica::TensorParallel { stage, tp } => {
                stage.backward(0, 0, None, &**tp, &mut |r, g| on_final(r, g))?;
                Ok(())
            }
            Replica::Pipeline(_) => unreachable!("pipelines run through `run`"),
        }
    }

    /// `(range, decay)` spans of the flat buffer.
    pub fn decay_spans(&self) -> Vec<(Range<usize>, bool)> {
        match self {
            Replica::Whole(m) => m.layout().decay_spans(),
            Replica::Device(m) => m.layout().decay_spans(),
            Replica::TensorParallel { stage, .. } => stage.layout().decay_spans(),
            Replica::Pipeline(p) => p.exec().layout().decay_spans(),
        }
    }

    /// `(range, counted)` spans: whether this rank counts the elements in the global gradient norm.
    pub fn norm_spans(&self) -> Vec<(Range<usize>, bool)> {
        match self {
            Replica::Whole(_) => vec![(0..self.params().len(), true)],
            // One span without TP: the host-mirror step's norm then adds up as the device step's.
            Replica::Device(m) if m.tp_size() == 1 => vec![(0..self.params().len(), true)],
            Replica::Device(m) => shard_norm_spans(m.layout(), m.tp_rank()),
            Replica::TensorParallel { stage, tp } => shard_norm_spans(stage.layout(), tp.rank()),
            Replica::Pipeline(p) => p.norm_spans(),
        }
    }

    /// Elements held by activations (for the memory estimate).
    pub fn activation_elements(&self) -> usize {
        match self {
            Replica::Whole(m) => m.activation_elements(),
            Replica::Device(m) => m.activation_elements(),
            Replica::TensorParallel { stage, .. } => stage.activation_elements(),
            Replica::Pipeline(p) => match p.exec() {
                StageExec::Host { stage, .. } => stage.activation_elements(),
                StageExec::Device(m) => m.activation_elements(),
            },
        }
    }

    /// This rank's tensors as boxes of the global tensors.
    pub fn tensor_maps(&self) -> Vec<TensorMap> {
        let (layout, tp_rank, pp_first, pp_size) = match self {
            Replica::Whole(m) => return whole_maps(m.layout()),
            Replica::Device(m) => (m.layout(), m.tp_rank(), true, 1),
            Replica::TensorParallel { stage, tp } => (stage.layout(), tp.rank(), true, 1),
            Replica::Pipeline(p) => {
                let (tp_rank, pp_rank, pp_size) = p.position();
                (p.exec().layout(), tp_rank, pp_rank == 0, pp_size)
            }
        };
        layout
            .entries()
            .iter()
            .map(|e| TensorMap {
                name: e.name.clone(),
                global_shape: e.global_shape.clone(),
                view_shape: e.view_shape.clone(),
                box_offset: e.box_offset.clone(),
                box_shape: e.box_shape.clone(),
                range: e.range(),
                owner: (!e.replicated_over_tp || tp_rank == 0) && (e.name != "wte" || pp_first || pp_size == 1),
            })
            .collect()
    }

    /// Parameters, mutable.
    pub fn params_mut(&mut self) -> &mut [f32] {
        self.params_and_grads().0
    }
}

/// `(range, counted)` spans of a TP shard's flat buffer: a tensor replicated over the TP group is
/// counted by TP rank 0 only, so the norm summed over the group counts every parameter once.
fn shard_norm_spans(layout: &ShardLayout, tp_rank: usize) -> Vec<(Range<usize>, bool)> {
    layout.entries().iter().map(|e| (e.range(), !e.replicated_over_tp || tp_rank == 0)).collect()
}

/// The tensors of a whole model: each its own global tensor, written by this rank.
fn whole_maps(layout: &ParamLayout) -> Vec<TensorMap> {
    layout
        .entries()
        .iter()
        .map(|e| TensorMap {
            name: e.name.clone(),
            global_shape: e.shape.clone(),
            view_shape: e.shape.clone(),
            box_offset: vec![0; e.shape.len()],
            box_shape: e.shape.clone(),
            range: e.range(),
            owner: true,
        })
        .collect()
}
