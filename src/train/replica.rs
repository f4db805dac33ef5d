//! The model one rank trains: the whole GPT (tensor parallelism 1) or this rank's
//! tensor-parallel shard of it ([`crate::model::Stage`] over the TP communicator). The training
//! loop, the data-parallel reducer and the optimizer only see a flat parameter buffer, its
//! gradients, and two span lists: which elements get weight decay, and which elements this rank
//! counts in the global gradient norm (a tensor replicated over the TP group is counted by TP
//! rank 0 only, so the norm summed over the group counts every parameter once).

use std::ops::Range;

use crate::comm::Communicator;
use crate::data::Batch;
use crate::error::Result;
use crate::model::{Gpt, GptConfig, Stage, StageInput, StageOutput, StageSpec};

/// A trainable model replica.
pub enum Replica {
    /// The whole model on this rank.
    Whole(Gpt<f32>),
    /// One shard of a tensor-parallel group.
    TensorParallel {
        /// The shard.
        stage: Box<Stage>,
        /// The tensor-parallel communicator.
        tp: Communicator,
    },
}

impl Replica {
    /// A replica of `cfg` for (B, T) micro-batches initialized from `seed`; tensor parallel when
    /// `tp` has more than one member.
    pub fn new(cfg: GptConfig, b: usize, t: usize, seed: u64, tp: Communicator, sequence_parallel: bool) -> Result<Self> {
        let full = Gpt::<f32>::new(cfg, b, t, seed)?;
        if tp.size() == 1 {
            return Ok(Replica::Whole(full));
        }
        let mut stage = Stage::new(cfg, tp.rank(), tp.size(), StageSpec::whole(&cfg), sequence_parallel, b, t, 1)?;
        stage.load_from_full(full.params())?;
        Ok(Replica::TensorParallel { stage: Box::new(stage), tp })
    }

    /// Parameters (flat, this rank's part).
    pub fn params(&self) -> &[f32] {
        match self {
            Replica::Whole(m) => m.params(),
            Replica::TensorParallel { stage, .. } => stage.params(),
        }
    }

    /// Parameters and gradients.
    pub fn params_and_grads(&mut self) -> (&mut [f32], &mut [f32]) {
        match self {
            Replica::Whole(m) => m.params_and_grads(),
            Replica::TensorParallel { stage, .. } => stage.params_and_grads(),
        }
    }

    /// Clears the gradients.
    pub fn zero_grad(&mut self) {
        match self {
            Replica::Whole(m) => m.zero_grad(),
            Replica::TensorParallel { stage, .. } => stage.zero_grad(),
        }
    }

    /// Mean loss of one micro-batch (identical on every TP rank), keeping activations for backward.
    pub fn forward(&mut self, batch: &Batch) -> Result<f64> {
        match self {
            Replica::Whole(m) => Ok(f64::from(m.forward(&batch.inputs, &batch.targets)?)),
            Replica::TensorParallel { stage, tp } => {
                match stage.forward(0, StageInput::Tokens(&batch.inputs), Some(&batch.targets), tp)? {
                    StageOutput::Loss(l) => Ok(f64::from(l)),
                    StageOutput::Hidden(_) => unreachable!("a whole-model stage ends with the loss"),
                }
            }
        }
    }

    /// Backward of the last forward, adding into the gradients; `on_final(range, values)` is called
    /// for each range as soon as it is final.
    pub fn backward(&mut self, on_final: &mut dyn FnMut(Range<usize>, &[f32])) -> Result<()> {
        match self {
            Replica::Whole(m) => m.backward_with(&mut |r, g| on_final(r.clone(), &g[r])),
            Replica::TensorParallel { stage, tp } => {
                stage.backward(0, None, tp, &mut |r, g| on_final(r, g))?;
                Ok(())
            }
        }
    }

    /// `(range, decay)` spans of the flat buffer.
    pub fn decay_spans(&self) -> Vec<(Range<usize>, bool)> {
        match self {
            Replica::Whole(m) => m.layout().decay_spans(),
            Replica::TensorParallel { stage, .. } => stage.layout().decay_spans(),
        }
    }

    /// `(range, counted)` spans: whether this rank counts the elements in the global gradient norm.
    pub fn norm_spans(&self) -> Vec<(Range<usize>, bool)> {
        match self {
            Replica::Whole(m) => vec![(0..m.params().len(), true)],
            Replica::TensorParallel { stage, tp } => stage
                .layout()
                .entries()
                .iter()
                .map(|e| (e.offset..e.offset + e.len, !e.replicated_over_tp || tp.rank() == 0))
                .collect(),
        }
    }

    /// Elements held by activations (for the memory estimate).
    pub fn activation_elements(&self) -> usize {
        match self {
            Replica::Whole(m) => m.activation_elements(),
            Replica::TensorParallel { stage, .. } => stage.activation_elements(),
        }
    }

    /// The whole model, when this replica is one (checkpoints of sharded replicas are not built).
    pub fn whole(&self) -> Option<&Gpt<f32>> {
        match self {
            Replica::Whole(m) => Some(m),
            Replica::TensorParallel { .. } => None,
        }
    }

    /// Mutable whole model (see [`Replica::whole`]).
    pub fn whole_mut(&mut self) -> Option<&mut Gpt<f32>> {
        match self {
            Replica::Whole(m) => Some(m),
            Replica::TensorParallel { .. } => None,
        }
    }
}
