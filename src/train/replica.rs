//! The model one rank trains: the shard executor ([`DeviceGpt`]) holding the whole GPT or this
//! rank's tensor-parallel shard of it, on this rank's device arm (CPU, CUDA, HIP or emu) in the
//! job's precision, or one pipeline stage of it ([`super::pipeline::Pipeline`]). Every layout and
//! device runs the same executor; the training loop, the data-parallel step and checkpoints only
//! see a flat parameter buffer (the layout table's order), and two span lists: which elements get
//! weight decay, and which elements this rank counts in the global gradient norm (a tensor
//! replicated over the TP group is counted by TP rank 0 only, so the norm summed over the group
//! counts every parameter once).

use std::ops::Range;

use super::pipeline::Pipeline;
use crate::comm::Communicator;
use crate::data::Batch;
use crate::device::Device;
use crate::error::Result;
use crate::model::init::Initializer;
use crate::model::{DeviceGpt, DeviceTp, ExecOptions, GptConfig, ParamLayout, ShardLayout, StageSpec};
use crate::parallel::schedule::Schedule;

/// A trainable model replica.
pub enum Replica {
    /// The whole model, or this rank's tensor-parallel shard of it.
    Whole(Box<DeviceGpt>),
    /// One stage of a pipeline (itself possibly tensor parallel).
    Pipeline(Box<Pipeline>),
}

/// What the model tells the trainer's step during [`Replica::run`].
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
    /// The device the model runs on, its precision and recomputation mode.
    pub device: (Device, ExecOptions),
}

impl Replica {
    /// A replica of `cfg` for (B, T) micro-batches with zero parameters (set them with
    /// [`Replica::initialize`] or a checkpoint); tensor parallel when `tp` has more than one
    /// member. No rank builds more of the model than its own part.
    pub fn new(cfg: GptConfig, b: usize, t: usize, l: ReplicaLayout) -> Result<Self> {
        cfg.validate()?;
        if l.pp.size() > 1 {
            let p = Pipeline::new(cfg, (b, t), l)?;
            return Ok(Replica::Pipeline(Box::new(p)));
        }
        let (dev, exec) = l.device;
        let tp = if l.tp.size() > 1 { Some(DeviceTp::new(l.tp)?) } else { None };
        let (rank, size) = tp.as_ref().map_or((0, 1), |g| (g.rank(), g.size()));
        let spec = StageSpec::whole(&cfg);
        let params = vec![0f32; ShardLayout::new(&cfg, rank, size, &spec)?.total_len()];
        let m = DeviceGpt::stage(dev, cfg, (b, t), params, exec, (tp, l.sequence_parallel), spec, 1)?;
        Ok(Replica::Whole(Box::new(m)))
    }

    /// The model this rank runs (the whole model, its TP shard, or its pipeline stage).
    pub fn model(&self) -> &DeviceGpt {
        match self {
            Replica::Whole(m) => m,
            Replica::Pipeline(p) => p.exec(),
        }
    }

    /// The model, mutable.
    pub fn model_mut(&mut self) -> &mut DeviceGpt {
        match self {
            Replica::Whole(m) => m,
            Replica::Pipeline(p) => p.exec_mut(),
        }
    }

    /// Sets this rank's parameters to the model's initialisation from `seed` (each element what
    /// the whole single-rank model starts with). At ZeRO-3 the device keeps only the owned blocks
    /// of this host copy once its step loads them.
    pub fn initialize(&mut self, cfg: &GptConfig, seed: u64) -> Result<()> {
        let init = Initializer::new(cfg, &ParamLayout::new(cfg), seed);
        self.model_mut().init_params(&init)
    }

    /// Micro-batches one call of [`Replica::run`] consumes per accumulation round.
    pub fn round(&self) -> usize {
        match self {
            Replica::Pipeline(p) => p.microbatches(),
            Replica::Whole(_) => 1,
        }
    }

    /// Forward and backward of every batch, adding into the gradients. Reporting backwards are
    /// every one with `every_backward`, else the last (a pipeline: reporting rounds). `device`
    /// hears when a backward is done (a pipeline: after each reporting round, once the tied
    /// embedding's gradient is summed) and, with `units` (a whole model), each unit as its
    /// gradients become final in a reporting backward. Returns the mean loss.
    pub fn run(
        &mut self,
        batches: &[Batch],
        (every_backward, units): (bool, bool),
        device: &mut dyn FnMut(DeviceEvent) -> Result<()>,
    ) -> Result<f64> {
        let mut sum = 0.0;
        if let Replica::Pipeline(p) = self {
            p.start_step();
            let rounds = batches.len() / p.microbatches().max(1);
            for (i, round) in batches.chunks(p.microbatches()).enumerate() {
                sum += p.run(round)?;
                if every_backward || i + 1 == rounds {
                    p.sum_tied_grads()?;
                    device(DeviceEvent::BackwardDone(p.exec_mut()))?;
                }
            }
            return Ok(sum / batches.len() as f64);
        }
        let m = self.model_mut();
        for (i, b) in batches.iter().enumerate() {
            sum += m.forward(&b.inputs, &b.targets)?;
            let reporting = every_backward || i + 1 == batches.len();
            if m.releases_grads() || units && reporting {
                m.backward_reducing(&mut |m, unit| device(DeviceEvent::UnitFinal(m, unit)))?;
            } else {
                m.backward(false, &mut |_, _| {})?;
            }
            device(DeviceEvent::BackwardDone(m))?;
        }
        Ok(sum / batches.len() as f64)
    }

    /// The parameter units of the flat buffer (ZeRO-3 gathers them one by one).
    pub fn units(&self) -> Vec<Range<usize>> {
        self.model().units()
    }

    /// The flat range of the tied `wte` (shard), if this rank holds it.
    pub fn wte(&self) -> Option<Range<usize>> {
        self.model().layout().wte()
    }

    /// Seconds of the last step this rank spent idle in the pipeline (bubble and transfers), and
    /// the pipeline rounds' total seconds; `None` without pipeline parallelism.
    pub fn pipeline_idle(&self) -> Option<(f64, f64)> {
        match self {
            Replica::Pipeline(p) => Some(p.idle()),
            Replica::Whole(_) => None,
        }
    }

    /// Pipeline metrics of the last step (bubble, per-stage compute, see
    /// [`Pipeline::step_metrics`]); empty without pipeline parallelism.
    pub fn pipeline_metrics(&self) -> Result<Vec<(String, serde_json::Value)>> {
        match self {
            Replica::Pipeline(p) => p.step_metrics(),
            Replica::Whole(_) => Ok(Vec::new()),
        }
    }

    /// Loss of one batch, forward only (on every rank).
    pub fn eval(&mut self, batch: &Batch) -> Result<f64> {
        match self {
            Replica::Pipeline(p) => p.eval(batch),
            Replica::Whole(m) => m.forward(&batch.inputs, &batch.targets),
        }
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        self.model().device()
    }

    /// Parameters (flat, this rank's part; the host copy).
    pub fn params(&self) -> &[f32] {
        self.model().params()
    }

    /// Parameters, mutable (the host copy; the device takes it at the step's load).
    pub fn params_mut(&mut self) -> &mut [f32] {
        self.model_mut().params_and_grads().0
    }

    /// Clears the gradients.
    pub fn zero_grad(&mut self) -> Result<()> {
        self.model_mut().zero_grad()
    }

    /// `(range, decay)` spans of the flat buffer.
    pub fn decay_spans(&self) -> Vec<(Range<usize>, bool)> {
        self.model().layout().decay_spans()
    }

    /// `(range, counted)` spans: whether this rank counts the elements in the global gradient norm.
    pub fn norm_spans(&self) -> Vec<(Range<usize>, bool)> {
        match self {
            // One span without TP: the norm then adds up over the whole buffer at once.
            Replica::Whole(m) if m.tp_size() == 1 => vec![(0..self.params().len(), true)],
            Replica::Whole(m) => shard_norm_spans(m.layout(), m.tp_rank()),
            Replica::Pipeline(p) => p.norm_spans(),
        }
    }

    /// Elements held by activations (for the memory estimate).
    pub fn activation_elements(&self) -> usize {
        self.model().activation_elements()
    }

    /// This rank's tensors as boxes of the global tensors.
    pub fn tensor_maps(&self) -> Vec<TensorMap> {
        let (layout, _tp_rank, pp_first, pp_size) = match self {
            Replica::Whole(m) => (m.layout(), m.tp_rank(), true, 1),
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
                owner: e.tp_owner && (e.name != "wte" || pp_first || pp_size == 1),
            })
            .collect()
    }
}

/// `(range, counted)` spans of a TP shard's flat buffer: a tensor replicated over the TP group is
/// counted by TP rank 0 only, so the norm summed over the group counts every parameter once.
fn shard_norm_spans(layout: &ShardLayout, _tp_rank: usize) -> Vec<(Range<usize>, bool)> {
    layout.entries().iter().map(|e| (e.range(), e.tp_owner)).collect()
}
