//! Pipeline-parallel execution of a training step: this rank's stage (a contiguous range of
//! layers, balanced with `block_range`, possibly tensor parallel) runs the action list that
//! [`crate::parallel::schedule::actions`] gives for (schedule, stage, stages, micro-batches), moving
//! activations and their gradients with point-to-point calls on the pipeline communicator.
//!
//! Invariants: every stage reads the same micro-batches (the first needs the tokens, the last the
//! targets); micro-batch `mb` lives in stage slot `mb` from its forward to its backward; the loss
//! is computed on the last stage and summed over the pipeline group, so every rank reports it; the
//! tied embedding exists on the first and the last stage, starts equal on both, and its gradient is
//! summed between them before the data-parallel reduction, so both copies stay equal.

use std::ops::Range;
use std::time::{Duration, Instant};

use crate::comm::{block_range, Communicator, ReduceOp};
use crate::data::Batch;
use crate::error::{Error, Result};
use crate::model::{GptConfig, Stage, StageInput, StageOutput, StageSpec};
use crate::parallel::schedule::{actions, Action, Schedule};

/// One pipeline stage of one tensor-parallel rank, with its message buffers.
pub struct Pipeline {
    stage: Stage,
    tp: Communicator,
    pp: Communicator,
    /// The first and last stage (holders of the tied embedding); absent on middle stages.
    tied: Option<Communicator>,
    schedule: Schedule,
    microbatches: usize,
    /// Received activations, one per micro-batch: (rows, C).
    act_in: Vec<Vec<f32>>,
    /// Activations to send, one per micro-batch.
    act_out: Vec<Vec<f32>>,
    /// Received gradients of this stage's output, one per micro-batch.
    grad_in: Vec<Vec<f32>>,
    /// Gradients of this stage's input to send, one per micro-batch.
    grad_out: Vec<Vec<f32>>,
    /// Time of the last `run` spent computing, and in total.
    timing: (Duration, Duration),
}

impl Pipeline {
    /// Stage `pp.rank()` of `pp.size()` for `cfg`, loaded from the full parameters `full`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: GptConfig,
        full: &[f32],
        b: usize,
        t: usize,
        tp: Communicator,
        pp: Communicator,
        sequence_parallel: bool,
        schedule: Schedule,
        microbatches: usize,
    ) -> Result<Self> {
        if matches!(schedule, Schedule::Interleaved { .. }) {
            return Err(Error::config("parallel.schedule", "the interleaved schedule is not wired into training yet"));
        }
        let (s, p) = (pp.rank(), pp.size());
        if cfg.n_layer < p {
            return Err(Error::config("parallel.pp", format!("{p} stages for {} layers", cfg.n_layer)));
        }
        let spec = StageSpec { layers: block_range(cfg.n_layer, p, s), first: s == 0, last: s + 1 == p };
        let mut stage = Stage::new(cfg, tp.rank(), tp.size(), spec, sequence_parallel, b, t, microbatches)?;
        stage.load_from_full(full)?;
        let ends = s == 0 || s + 1 == p;
        let tied = if p > 1 { pp.split(ends.then_some(0), s as i64)? } else { None };
        let rows = stage.hidden_len();
        let bufs = || (0..microbatches).map(|_| vec![0f32; rows]).collect::<Vec<_>>();
        Ok(Pipeline {
            stage,
            tp,
            pp,
            tied,
            schedule,
            microbatches,
            act_in: bufs(),
            act_out: bufs(),
            grad_in: bufs(),
            grad_out: bufs(),
            timing: (Duration::ZERO, Duration::ZERO),
        })
    }

    /// Micro-batches per pipeline round.
    pub fn microbatches(&self) -> usize {
        self.microbatches
    }

    /// The stage.
    pub fn stage(&self) -> &Stage {
        &self.stage
    }

    /// The stage, mutable.
    pub fn stage_mut(&mut self) -> &mut Stage {
        &mut self.stage
    }

    /// The tensor-parallel and pipeline communicators.
    pub fn groups(&self) -> (&Communicator, &Communicator) {
        (&self.tp, &self.pp)
    }

    fn is_first(&self) -> bool {
        self.pp.rank() == 0
    }

    fn is_last(&self) -> bool {
        self.pp.rank() + 1 == self.pp.size()
    }

    /// Runs forward and backward of `batches` (exactly `microbatches` of them) through the
    /// pipeline, adding into the gradients; returns the sum of their losses (on every rank).
    pub fn run(&mut self, batches: &[Batch]) -> Result<f64> {
        if batches.len() != self.microbatches {
            return Err(Error::InvalidArgument(format!(
                "pipeline step: {} micro-batches, configured for {}",
                batches.len(),
                self.microbatches
            )));
        }
        let (first, last) = (self.is_first(), self.is_last());
        let list = actions(self.schedule, self.pp.rank(), self.pp.size(), self.microbatches)?;
        let Pipeline { stage, tp, pp, act_in, act_out, grad_in, grad_out, timing, .. } = self;
        let mut loss = 0.0f64;
        let (start, mut compute) = (Instant::now(), Duration::ZERO);
        for a in list {
            let t0 = Instant::now();
            let is_compute = matches!(a, Action::Forward { .. } | Action::Backward { .. });
            match a {
                Action::RecvActivation { mb, from_rank, .. } => pp.recv_into(&mut act_in[mb], from_rank)?,
                Action::Forward { mb, .. } => {
                    let input =
                        if first { StageInput::Tokens(&batches[mb].inputs) } else { StageInput::Hidden(&act_in[mb]) };
                    let targets = last.then_some(&batches[mb].targets[..]);
                    match stage.forward(mb, input, targets, tp)? {
                        StageOutput::Loss(l) => loss += f64::from(l),
                        StageOutput::Hidden(h) => act_out[mb].copy_from_slice(h),
                    }
                }
                Action::SendActivation { mb, to_rank, .. } => pp.send(&act_out[mb], to_rank)?,
                Action::RecvGrad { mb, from_rank, .. } => pp.recv_into(&mut grad_in[mb], from_rank)?,
                Action::Backward { mb, .. } => {
                    let go = if last { None } else { Some(&grad_in[mb][..]) };
                    if let Some(d) = stage.backward(mb, go, tp, &mut |_, _| {})? {
                        grad_out[mb].copy_from_slice(d);
                    }
                }
                Action::SendGrad { mb, to_rank, .. } => pp.send(&grad_out[mb], to_rank)?,
            }
            if is_compute {
                compute += t0.elapsed();
            }
        }
        *timing = (compute, start.elapsed());
        let mut total = [loss];
        pp.all_reduce(&mut total, ReduceOp::Sum)?;
        Ok(total[0])
    }

    /// (compute, total) time of the last [`Pipeline::run`]: the rest is pipeline bubble and
    /// point-to-point waiting.
    pub fn timing(&self) -> (Duration, Duration) {
        self.timing
    }

    /// Sums the tied embedding's gradient between the first and the last stage.
    pub fn sync_tied_grads(&mut self) -> Result<()> {
        if let (Some(tied), Some(wte)) = (&self.tied, self.stage.layout().wte()) {
            tied.all_reduce(&mut self.stage.grads_mut()[wte], ReduceOp::Sum)?;
        }
        Ok(())
    }

    /// Loss of one batch, forward only, passed stage to stage (on every rank).
    pub fn eval(&mut self, batch: &Batch) -> Result<f64> {
        let (first, last, s) = (self.is_first(), self.is_last(), self.pp.rank());
        let Pipeline { stage, tp, pp, act_in, act_out, .. } = self;
        if !first {
            pp.recv_into(&mut act_in[0], s - 1)?;
        }
        let input = if first { StageInput::Tokens(&batch.inputs) } else { StageInput::Hidden(&act_in[0]) };
        let mut loss = [0.0f64];
        match stage.forward(0, input, last.then_some(&batch.targets[..]), tp)? {
            StageOutput::Loss(l) => loss[0] = f64::from(l),
            StageOutput::Hidden(h) => act_out[0].copy_from_slice(h),
        }
        if !last {
            pp.send(&act_out[0], s + 1)?;
        }
        pp.all_reduce(&mut loss, ReduceOp::Sum)?;
        Ok(loss[0])
    }

    /// `(range, counted)` spans for the global gradient norm: a tensor replicated over TP is counted
    /// by TP rank 0, and the tied embedding by the first stage only.
    pub fn norm_spans(&self) -> Vec<(Range<usize>, bool)> {
        let first = self.is_first();
        self.stage
            .layout()
            .entries()
            .iter()
            .map(|e| {
                let tp_ok = !e.replicated_over_tp || self.tp.rank() == 0;
                let pp_ok = e.name != "wte" || first;
                (e.offset..e.offset + e.len, tp_ok && pp_ok)
            })
            .collect()
    }
}
