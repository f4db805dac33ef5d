//! Pipeline-parallel execution of a training step: this rank's stage (one contiguous range of
//! blocks, or `v` of them under the interleaved schedule, possibly tensor parallel) runs the
//! action list that [`crate::parallel::schedule::actions`] gives for (schedule, rank, stages,
//! micro-batches), moving activations and their gradients with point-to-point calls on the
//! pipeline communicator. Chunk `c` of pipeline rank `r` is global stage `c * p + r`; the global
//! stages' block ranges come from [`crate::parallel::stage_split`]. The stage runs on the shard
//! executor ([`DeviceGpt`], on any device arm); hidden states and their gradients cross between
//! stages as host buffers.
//!
//! Invariants: every rank reads the same micro-batches (the first stage needs the tokens, the last
//! the targets); micro-batch `mb` lives in one activation slot of each chunk from its forward to
//! its backward (slots are reused once free, so a stage holds as many as the schedule keeps in
//! flight: p - rank under 1F1B, all m under GPipe), and its messages in buffer `mb * v + chunk`; the loss is computed on the model's last
//! chunk and summed over the pipeline group, so every rank reports it; the tied embedding exists
//! on the first and the last pipeline rank, starts equal on both, and its gradient is summed
//! between them before the data-parallel reduction, so both copies stay equal.

use std::ops::Range;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::replica::ReplicaLayout;
use crate::comm::{Communicator, ReduceOp};
use crate::data::Batch;
use crate::error::{Error, Result};
use crate::model::{DeviceGpt, DeviceTp, GptConfig, ShardLayout, StageInput, StageOutput, StageSpec};
use crate::parallel::schedule::{actions, simulate_ranks, Action, Delivery, Schedule};

/// One pipeline rank of one tensor-parallel rank, with its message buffers.
pub struct Pipeline {
    exec: Box<DeviceGpt>,
    spec: StageSpec,
    tp_rank: usize,
    pp: Communicator,
    /// The first and last stage (holders of the tied embedding); absent on middle stages.
    tied: Option<Communicator>,
    schedule: Schedule,
    microbatches: usize,
    /// This rank's actions for one round.
    list: Vec<Action>,
    /// The activation slot of (micro-batch `mb`, chunk `c`) at `mb * v + c`.
    slot: Vec<usize>,
    /// Received activations, one per (micro-batch, chunk): (rows, C).
    act_in: Vec<Vec<f32>>,
    /// Activations to send, one per (micro-batch, chunk).
    act_out: Vec<Vec<f32>>,
    /// Received gradients of the chunks' outputs, one per (micro-batch, chunk).
    grad_in: Vec<Vec<f32>>,
    /// Gradients of the chunks' inputs to send, one per (micro-batch, chunk).
    grad_out: Vec<Vec<f32>>,
    timing: StepTiming,
}

/// Where the time of the pipeline rounds since [`Pipeline::start_step`] went.
#[derive(Debug, Clone)]
struct StepTiming {
    /// Rounds run.
    rounds: usize,
    /// This rank's rounds, each from its first action to its last.
    total: Duration,
    /// Seconds every pipeline rank (by index) spent in forwards and in backwards.
    forward_s: Vec<f64>,
    backward_s: Vec<f64>,
}

impl StepTiming {
    fn new(ranks: usize) -> Self {
        StepTiming {
            rounds: 0,
            total: Duration::ZERO,
            forward_s: vec![0.0; ranks],
            backward_s: vec![0.0; ranks],
        }
    }
}

impl Pipeline {
    /// Pipeline rank `l.pp.rank()` of `l.pp.size()` for `cfg` and (B, T) micro-batches in `l`'s
    /// layout, with zero parameters; `l.stage_layers` are the block ranges of all
    /// `pp.size() * schedule.chunks()` global stages.
    pub fn new(cfg: GptConfig, (b, t): (usize, usize), l: ReplicaLayout) -> Result<Self> {
        let ReplicaLayout { tp, pp, sequence_parallel, schedule, microbatches, stage_layers, device: (dev, exec) } = l;
        let stages = &stage_layers[..];
        let (r, p, v) = (pp.rank(), pp.size(), schedule.chunks());
        if stages.len() != p * v {
            return Err(Error::config(
                "parallel.stage_layers",
                format!("{} stage ranges for pp {p} x {v} chunks", stages.len()),
            ));
        }
        let list = actions(schedule, r, p, microbatches)?;
        let (slot, slots) = assign_slots(&list, microbatches, v);
        let spec = StageSpec {
            chunks: (0..v).map(|c| stages[c * p + r].clone()).collect(),
            first: r == 0,
            last: r + 1 == p,
        };
        let tp_rank = tp.rank();
        let group = if tp.size() > 1 { Some(DeviceTp::new(tp)?) } else { None };
        let n = ShardLayout::new(&cfg, tp_rank, group.as_ref().map_or(1, DeviceTp::size), &spec)?.total_len();
        let exec =
            Box::new(DeviceGpt::stage(dev, cfg, (b, t), vec![0f32; n], exec, (group, sequence_parallel), spec.clone(), slots)?);
        let ends = (r == 0 || r + 1 == p) && cfg.llama.is_none_or(|l| l.tie_embeddings);
        let tied = if p > 1 { pp.split(ends.then_some(0), r as i64)? } else { None };
        let rows = exec.hidden_len();
        let bufs = || (0..microbatches * v).map(|_| vec![0f32; rows]).collect::<Vec<_>>();
        Ok(Pipeline {
            exec,
            spec,
            tp_rank,
            pp,
            tied,
            schedule,
            microbatches,
            list,
            slot,
            act_in: bufs(),
            act_out: bufs(),
            grad_in: bufs(),
            grad_out: bufs(),
            timing: StepTiming::new(p),
        })
    }

    /// Micro-batches per pipeline round.
    pub fn microbatches(&self) -> usize {
        self.microbatches
    }

    /// The stage's model.
    pub fn exec(&self) -> &DeviceGpt {
        &self.exec
    }

    /// The stage's model, mutable.
    pub fn exec_mut(&mut self) -> &mut DeviceGpt {
        &mut self.exec
    }

    /// This rank's (TP rank, pipeline rank, pipeline size).
    pub fn position(&self) -> (usize, usize, usize) {
        (self.tp_rank, self.pp.rank(), self.pp.size())
    }

    /// Starts the timing of a new optimizer step (its rounds add up until the next call).
    pub fn start_step(&mut self) {
        self.timing = StepTiming::new(self.pp.size());
    }

    fn is_first(&self) -> bool {
        self.pp.rank() == 0
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
        let (rank, p, v) = (self.pp.rank(), self.pp.size(), self.schedule.chunks());
        let Pipeline { exec, spec, pp, list, slot, act_in, act_out, grad_in, grad_out, timing, .. } = self;
        let mut loss = 0.0f64;
        let (start, mut fwd, mut bwd) = (Instant::now(), Duration::ZERO, Duration::ZERO);
        for &a in list.iter() {
            let t0 = Instant::now();
            match a {
                Action::RecvActivation { mb, chunk, from_rank } => {
                    pp.recv_into(&mut act_in[mb * v + chunk], from_rank)?
                }
                Action::Forward { mb, chunk } => {
                    let k = mb * v + chunk;
                    let input = if spec.embeds(chunk) {
                        StageInput::Tokens(&batches[mb].inputs)
                    } else {
                        StageInput::Hidden(&act_in[k])
                    };
                    let targets = spec.ends(chunk).then_some(&batches[mb].targets[..]);
                    match exec.forward_stage(chunk, slot[k], input, targets)? {
                        StageOutput::Loss(l) => loss += f64::from(l),
                        StageOutput::Hidden(h) => act_out[k].copy_from_slice(h),
                    }
                    fwd += t0.elapsed();
                }
                Action::SendActivation { mb, chunk, to_rank } => {
                    pp.send(&act_out[mb * v + chunk], to_rank)?
                }
                Action::RecvGrad { mb, chunk, from_rank } => {
                    pp.recv_into(&mut grad_in[mb * v + chunk], from_rank)?
                }
                Action::Backward { mb, chunk } => {
                    let k = mb * v + chunk;
                    let go = if spec.ends(chunk) { None } else { Some(&grad_in[k][..]) };
                    if let Some(d) = exec.backward_stage(chunk, slot[k], go)? {
                        grad_out[k].copy_from_slice(d);
                    }
                    bwd += t0.elapsed();
                }
                Action::SendGrad { mb, chunk, to_rank } => pp.send(&grad_out[mb * v + chunk], to_rank)?,
            }
        }
        timing.total += start.elapsed();
        timing.rounds += 1;
        // One reduction for the loss and every rank's compute times (each fills its own entries).
        let mut sums = vec![0.0f64; 1 + 2 * p];
        sums[0] = loss;
        sums[1 + rank] = fwd.as_secs_f64();
        sums[1 + p + rank] = bwd.as_secs_f64();
        pp.all_reduce(&mut sums, ReduceOp::Sum)?;
        let add = |acc: &mut [f64], new: &[f64]| acc.iter_mut().zip(new).for_each(|(a, n)| *a += n);
        add(&mut timing.forward_s, &sums[1..1 + p]);
        add(&mut timing.backward_s, &sums[1 + p..]);
        Ok(sums[0])
    }

    /// Seconds this rank spent outside its forwards and backwards in the rounds of the step
    /// (pipeline bubble and transfers), and the rounds' total seconds.
    pub fn idle(&self) -> (f64, f64) {
        let (t, rank) = (&self.timing, self.pp.rank());
        let total = t.total.as_secs_f64();
        (total - t.forward_s[rank] - t.backward_s[rank], total)
    }

    /// Timing of the step's rounds for the metrics: `bubble_s` and `pipeline_s` ([`Pipeline::idle`]),
    /// every pipeline rank's `stage_forward_s` and `stage_backward_s`, and `bubble_sim_s` /
    /// `pipeline_sim_s`: the same as `bubble_s` / `pipeline_s` when the schedule runs with those
    /// per-rank compute times over buffered links whose transfers take no time ([`simulate_ranks`]),
    /// i.e. the bubble that the schedule and the stages' imbalance explain; the rest of `bubble_s`
    /// is transfers and waiting on them.
    pub fn step_metrics(&self) -> Result<Vec<(String, Value)>> {
        let (t, rank) = (&self.timing, self.pp.rank());
        if t.rounds == 0 {
            return Ok(Vec::new());
        }
        let (idle, total) = self.idle();
        let per_mb =
            |s: &[f64]| s.iter().map(|x| x / (t.rounds * self.microbatches) as f64).collect::<Vec<_>>();
        let (fwd, bwd) = (per_mb(&t.forward_s), per_mb(&t.backward_s));
        let sim =
            simulate_ranks(self.schedule, self.pp.size(), self.microbatches, &fwd, &bwd, Delivery::Buffered)?;
        let rounds = t.rounds as f64;
        Ok(vec![
            ("bubble_s".into(), json!(idle)),
            ("pipeline_s".into(), json!(total)),
            ("bubble_sim_s".into(), json!(rounds * (sim.end[rank] - sim.busy[rank]))),
            ("pipeline_sim_s".into(), json!(rounds * sim.end[rank])),
            ("stage_forward_s".into(), json!(t.forward_s)),
            ("stage_backward_s".into(), json!(t.backward_s)),
        ])
    }

    /// Sums the tied embedding's gradient between the first and the last stage (once the round's
    /// backwards are done, before the data-parallel reduction reads it).
    pub fn sum_tied_grads(&mut self) -> Result<()> {
        match &self.tied {
            Some(tied) => self.exec.sum_tied_grads(tied),
            None => Ok(()),
        }
    }

    /// Loss of one batch, forward only, passed stage to stage (on every rank).
    pub fn eval(&mut self, batch: &Batch) -> Result<f64> {
        let (r, p) = (self.pp.rank(), self.pp.size());
        let v = self.schedule.chunks();
        let last = p * v - 1;
        let Pipeline { exec, pp, act_in, act_out, .. } = self;
        let mut loss = [0.0f64];
        // Slot 0 of each chunk; message buffers 0 * v + chunk.
        for chunk in 0..v {
            let g = chunk * p + r; // global stage
            if g > 0 {
                pp.recv_into(&mut act_in[chunk], (g - 1) % p)?;
            }
            let input =
                if g == 0 { StageInput::Tokens(&batch.inputs) } else { StageInput::Hidden(&act_in[chunk]) };
            match exec.forward_stage(chunk, 0, input, (g == last).then_some(&batch.targets[..]))? {
                StageOutput::Loss(l) => loss[0] = f64::from(l),
                StageOutput::Hidden(h) => act_out[chunk].copy_from_slice(h),
            }
            if g < last {
                pp.send(&act_out[chunk], (g + 1) % p)?;
            }
        }
        pp.all_reduce(&mut loss, ReduceOp::Sum)?;
        Ok(loss[0])
    }

    /// `(range, counted)` spans for the global gradient norm: a tensor replicated over TP is counted
    /// by TP rank 0, and the tied embedding by the first stage only.
    pub fn norm_spans(&self) -> Vec<(Range<usize>, bool)> {
        let first = self.is_first();
        self.exec
            .layout()
            .entries()
            .iter()
            .map(|e| {
                let tp_ok = e.tp_owner;
                let pp_ok = e.name != "wte" || first;
                (e.offset..e.offset + e.len, tp_ok && pp_ok)
            })
            .collect()
    }
}

/// A static slot for every (micro-batch, chunk) of one round of `list`: a forward takes a free
/// slot of its chunk (or a new one), the backward frees it. Returns the slots by `mb * v + chunk`
/// and the most any chunk needs (at least one: evaluation uses slot 0).
fn assign_slots(list: &[Action], microbatches: usize, v: usize) -> (Vec<usize>, usize) {
    let mut slot = vec![0; microbatches * v];
    let mut free: Vec<Vec<usize>> = vec![Vec::new(); v];
    let mut used = vec![0; v];
    for a in list {
        match *a {
            Action::Forward { mb, chunk } => {
                slot[mb * v + chunk] = free[chunk].pop().unwrap_or_else(|| {
                    used[chunk] += 1;
                    used[chunk] - 1
                });
            }
            Action::Backward { mb, chunk } => free[chunk].push(slot[mb * v + chunk]),
            _ => {}
        }
    }
    (slot, used.into_iter().max().unwrap_or(0).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1F1B keeps p - rank micro-batches in flight, GPipe all of them, interleaved 1F1B a bounded
    /// number per chunk; a slot is never shared by two micro-batches in flight at once.
    #[test]
    fn slots_follow_the_schedules_in_flight_count() {
        let (p, m) = (4, 8);
        for rank in 0..p {
            let (_, n) = assign_slots(&actions(Schedule::OneFOneB, rank, p, m).unwrap(), m, 1);
            assert_eq!(n, p - rank, "1F1B rank {rank}");
            let (_, n) = assign_slots(&actions(Schedule::GPipe, rank, p, m).unwrap(), m, 1);
            assert_eq!(n, m, "GPipe rank {rank}");
        }
        let interleaved = |m: usize| actions(Schedule::Interleaved { virtual_stages: 2 }, 0, p, m).unwrap();
        let (_, n32) = assign_slots(&interleaved(32), 32, 2);
        let (m, list) = (16, interleaved(16));
        let (slot, n) = assign_slots(&list, m, 2);
        assert!(n < m && n == n32, "interleaved rank 0 needs {n} slots at m = 16, {n32} at m = 32");
        let mut holder = vec![vec![None; n]; 2];
        for a in &list {
            match *a {
                Action::Forward { mb, chunk } => {
                    let s = &mut holder[chunk][slot[mb * 2 + chunk]];
                    assert!(s.is_none(), "slot of chunk {chunk} taken twice");
                    *s = Some(mb);
                }
                Action::Backward { mb, chunk } => {
                    assert_eq!(holder[chunk][slot[mb * 2 + chunk]].take(), Some(mb));
                }
                _ => {}
            }
        }
    }
}
