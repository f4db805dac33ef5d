//! Pipeline-parallel schedules as pure functions: what each pipeline rank does, in order.
//!
//! The model is cut into `p * v` global stages; with `p` pipeline ranks and `v` model chunks per
//! rank, chunk `c` of rank `r` is global stage `c * p + r`, so a micro-batch visits the ranks
//! `0, 1, .., p-1` `v` times. [`actions`] returns one rank's ordered list of [`Action`]s for one
//! optimizer step over `m` micro-batches; it depends only on (schedule, rank, p, m), so every rank
//! computes its own list without talking to the others.
//!
//! Compute order. All three schedules are "warm-up forwards, then alternate one forward and one
//! backward, then cool-down backwards"; they differ in the warm-up count and in the order in
//! which (micro-batch, chunk) pairs are visited:
//! - GPipe: warm-up = `m`: all forwards, then all backwards, both in ascending micro-batch order
//!   (the backward of micro-batch 0 runs first, so its activations are freed first).
//! - 1F1B (PipeDream-flush): warm-up = `min(p - rank - 1, m)`; at most `p - rank` micro-batches
//!   hold activations at once.
//! - Interleaved 1F1B (Megatron-LM): needs `m % p == 0`. Forwards visit micro-batches in groups of
//!   `p`: the group goes through chunk 0, then chunk 1, .., then the next group; backwards visit
//!   the same groups through the chunks in reverse. Warm-up = `min(2 * (p - rank - 1) +
//!   (v - 1) * p, m * v)` (Megatron-LM's count; its special case of an all-forward warm-up when
//!   `m == p` is not needed here because communication order is derived separately, below).
//!
//! Communication order. Point-to-point operations are blocking rendezvous: a send completes only
//! when the peer has posted the matching receive, and the messages between two ranks form one
//! ordered channel per direction (no tags, no buffering assumed). Each rank's list is its
//! computes and messages sorted by their times in an ideal timeline (every forward of one chunk
//! takes one time unit, every backward one unit for GPipe and 1F1B and two for interleaved, and
//! each starts as soon as its inputs exist and its rank is free); a message is placed at the time
//! its producer finishes, before a compute that starts at the same time, and messages at equal
//! times are ordered by (kind, micro-batch, stage). Both ends of a message therefore place it
//! under the same key, so all ranks' actions merge into one global order by key in which every
//! rank's list is a subsequence, a message's two ends are one event, and every compute comes
//! after the receive of its input: executing that order runs every action with its inputs
//! present and both ends of every message at the heads of their lists, so the lists cannot
//! deadlock, and since blocking rendezvous execution is deterministic they cannot for any compute
//! times. How long they run depends on the times: GPipe and 1F1B meet [`bubble_fraction`]
//! exactly at backward = 1x and 2x forward; interleaved meets it at 2x over buffered links (how
//! meshtrain's links behave while a message fits their slots), and runs up to 33% (equal times)
//! or 43% (2x, blocking sends) longer otherwise (p <= 8, m <= 16, v <= 4), because a fixed order
//! suits one time ratio and one kind of link only; 2x is what a backward costs in FLOPs.
//!
//! Invariants: each rank runs exactly one forward and one backward per (micro-batch, own chunk);
//! a forward follows the arrival of its input activation, a backward follows its own forward and
//! the arrival of its output gradient; with `p == 1` there are no messages (chunks hand over
//! locally). [`simulate`] executes all ranks' lists together and checks all of this.

mod sim;
#[cfg(test)]
mod tests;

/// An action list written compactly, for tests: space-separated `F3` / `B3` (forward, backward of
/// micro-batch 3), `A3>1` / `A3<0` (send activation 3 to rank 1, receive it from rank 0),
/// `G3>0` / `G3<1` (the same for gradients); `F3.1` etc. name local chunk 1 (default 0).
#[cfg(test)]
pub(crate) fn plan(text: &str) -> Vec<Action> {
    let num = |s: &str| s.parse::<usize>().unwrap_or_else(|_| panic!("plan: bad number in `{text}`"));
    let unit = |s: &str| match s.split_once('.') {
        Some((mb, chunk)) => (num(mb), num(chunk)),
        None => (num(s), 0),
    };
    text.split_whitespace()
        .map(|tok| {
            let (kind, rest) = tok.split_at(1);
            let (who, peer, send) = match (rest.split_once('>'), rest.split_once('<')) {
                (Some((w, p)), _) => (w, Some(num(p)), true),
                (_, Some((w, p))) => (w, Some(num(p)), false),
                _ => (rest, None, false),
            };
            let (mb, chunk) = unit(who);
            match (kind, peer, send) {
                ("F", None, _) => Action::Forward { mb, chunk },
                ("B", None, _) => Action::Backward { mb, chunk },
                ("A", Some(to_rank), true) => Action::SendActivation { mb, chunk, to_rank },
                ("A", Some(from_rank), false) => Action::RecvActivation { mb, chunk, from_rank },
                ("G", Some(to_rank), true) => Action::SendGrad { mb, chunk, to_rank },
                ("G", Some(from_rank), false) => Action::RecvGrad { mb, chunk, from_rank },
                _ => panic!("plan: bad action `{tok}` in `{text}`"),
            }
        })
        .collect()
}

use super::options::{ParallelConfig, ScheduleName};
use crate::error::{Error, Result};

pub use sim::{simulate, simulate_ranks, Delivery, SimReport};

/// A pipeline schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// All forwards, then all backwards.
    GPipe,
    /// PipeDream-flush: warm-up forwards, one forward / one backward, cool-down backwards.
    OneFOneB,
    /// Megatron-LM's interleaved 1F1B over `virtual_stages` model chunks per rank.
    Interleaved {
        /// Model chunks per pipeline rank (`v`).
        virtual_stages: usize,
    },
}

impl Schedule {
    /// The schedule `[parallel]` asks for (`virtual_stages` only counts for `interleaved`).
    pub fn from_config(parallel: &ParallelConfig) -> Schedule {
        match parallel.schedule {
            ScheduleName::GPipe => Schedule::GPipe,
            ScheduleName::OneFOneB => Schedule::OneFOneB,
            ScheduleName::Interleaved => {
                Schedule::Interleaved { virtual_stages: parallel.virtual_stages }
            }
        }
    }

    /// Model chunks per pipeline rank: `virtual_stages` for interleaved, 1 otherwise.
    pub fn chunks(self) -> usize {
        match self {
            Schedule::GPipe | Schedule::OneFOneB => 1,
            Schedule::Interleaved { virtual_stages } => virtual_stages,
        }
    }

    /// Duration of a backward in the ideal timeline that orders the messages, in forwards: 2 for
    /// interleaved (a backward costs about twice a forward, and interleaved lists ordered for equal
    /// times run up to 22% long at that ratio even over buffered links), 1 for GPipe and 1F1B
    /// (whose lists meet the formula at both ratios either way).
    fn backward_units(self) -> u64 {
        match self {
            Schedule::GPipe | Schedule::OneFOneB => 1,
            Schedule::Interleaved { .. } => 2,
        }
    }

    /// Forwards this rank runs before its first backward.
    fn warmup(self, rank: usize, stages: usize, microbatches: usize) -> usize {
        match self {
            Schedule::GPipe => microbatches,
            Schedule::OneFOneB => (stages - rank - 1).min(microbatches),
            Schedule::Interleaved { virtual_stages: v } => {
                (2 * (stages - rank - 1) + (v - 1) * stages).min(microbatches * v)
            }
        }
    }
}

/// One step of one pipeline rank. `chunk` is always this rank's local model chunk (0 unless
/// interleaved); the peer's chunk follows from the global stage numbering (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Run the forward of micro-batch `mb` through local chunk `chunk`.
    Forward { mb: usize, chunk: usize },
    /// Run the backward of micro-batch `mb` through local chunk `chunk`.
    Backward { mb: usize, chunk: usize },
    /// Send the output activation of (`mb`, `chunk`) to the rank holding the next stage.
    SendActivation { mb: usize, chunk: usize, to_rank: usize },
    /// Receive the input activation of (`mb`, `chunk`) from the rank holding the previous stage.
    RecvActivation { mb: usize, chunk: usize, from_rank: usize },
    /// Send the input gradient of (`mb`, `chunk`) to the rank holding the previous stage.
    SendGrad { mb: usize, chunk: usize, to_rank: usize },
    /// Receive the output gradient of (`mb`, `chunk`) from the rank holding the next stage.
    RecvGrad { mb: usize, chunk: usize, from_rank: usize },
}

/// Rank `rank`'s ordered actions for one optimizer step of `microbatches` micro-batches over a
/// pipeline of `stages` ranks.
///
/// Errors: `Error::Config` naming `parallel.pp`, `parallel.microbatches` or
/// `parallel.virtual_stages` for zero counts or `microbatches % stages != 0` with interleaving;
/// `Error::InvalidArgument` for `rank >= stages`.
pub fn actions(schedule: Schedule, rank: usize, stages: usize, microbatches: usize) -> Result<Vec<Action>> {
    validate(schedule, stages, microbatches)?;
    if rank >= stages {
        return Err(Error::InvalidArgument(format!(
            "pipeline rank {rank} is not below the stage count {stages}"
        )));
    }
    let layout = Layout { p: stages, m: microbatches, v: schedule.chunks() };
    let orders: Vec<Vec<Work>> = (0..stages).map(|r| compute_order(schedule, r, layout)).collect();
    let timeline = IdealTimeline::new(&orders, layout, schedule.backward_units());
    Ok(place_messages(&orders[rank], rank, &timeline, layout))
}

/// Theoretical idle fraction of the pipeline (idle time over total rank time) with equal
/// per-micro-batch compute on every rank: `(p-1) / (m+p-1)` for GPipe and 1F1B,
/// `(p-1) / (v*m+p-1)` interleaved. Errors as [`actions`].
pub fn bubble_fraction(schedule: Schedule, stages: usize, microbatches: usize) -> Result<f64> {
    validate(schedule, stages, microbatches)?;
    let fill = (stages - 1) as f64;
    Ok(fill / ((schedule.chunks() * microbatches) as f64 + fill))
}

fn validate(schedule: Schedule, stages: usize, microbatches: usize) -> Result<()> {
    if stages == 0 {
        return Err(Error::config("parallel.pp", "a pipeline needs at least 1 stage"));
    }
    if microbatches == 0 {
        return Err(Error::config("parallel.microbatches", "a step needs at least 1 micro-batch"));
    }
    if let Schedule::Interleaved { virtual_stages } = schedule {
        if virtual_stages == 0 {
            return Err(Error::config(
                "parallel.virtual_stages",
                "interleaved needs at least 1 model chunk per rank",
            ));
        }
        if microbatches % stages != 0 {
            return Err(Error::config(
                "parallel.microbatches",
                format!(
                    "interleaved: {microbatches} micro-batches are not a multiple of the \
                     {stages} pipeline stages (parallel.pp)"
                ),
            ));
        }
    }
    Ok(())
}

/// Pipeline shape: `p` ranks, `m` micro-batches, `v` chunks per rank.
#[derive(Debug, Clone, Copy)]
struct Layout {
    p: usize,
    m: usize,
    v: usize,
}

impl Layout {
    fn stage_count(self) -> usize {
        self.p * self.v
    }

    fn stage(self, rank: usize, chunk: usize) -> usize {
        chunk * self.p + rank
    }

    /// (rank, chunk) of global stage `stage`.
    fn owner(self, stage: usize) -> (usize, usize) {
        (stage % self.p, stage / self.p)
    }

    /// Index of (mb, stage) in per-(micro-batch, stage) tables.
    fn slot(self, mb: usize, stage: usize) -> usize {
        mb * self.stage_count() + stage
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward,
    Backward,
}

/// One compute of one rank: a forward or backward of (micro-batch, local chunk).
#[derive(Debug, Clone, Copy)]
struct Work {
    pass: Pass,
    mb: usize,
    chunk: usize,
}

/// The compute order of `rank`: warm-up forwards, 1F1B steady state, cool-down backwards over
/// the `m * v` (micro-batch, chunk) pairs in the schedule's visiting order.
fn compute_order(schedule: Schedule, rank: usize, layout: Layout) -> Vec<Work> {
    let total = layout.m * layout.v;
    let warmup = schedule.warmup(rank, layout.p, layout.m);
    let fwd = |k| visit(Pass::Forward, k, layout);
    let bwd = |k| visit(Pass::Backward, k, layout);
    let mut order: Vec<Work> = (0..warmup).map(fwd).collect();
    for k in 0..total - warmup {
        order.push(fwd(warmup + k));
        order.push(bwd(k));
    }
    order.extend((total - warmup..total).map(bwd));
    order
}

/// The `k`-th (micro-batch, chunk) a rank visits in `pass`: micro-batches in groups of `p`, each
/// group through all chunks (ascending for forward, descending for backward) before the next.
/// With one chunk this is simply micro-batch `k`.
fn visit(pass: Pass, k: usize, layout: Layout) -> Work {
    let group_len = layout.p * layout.v;
    let in_group = k % group_len;
    let mb = (k / group_len) * layout.p + in_group % layout.p;
    let chunk = match pass {
        Pass::Forward => in_group / layout.p,
        Pass::Backward => layout.v - 1 - in_group / layout.p,
    };
    Work { pass, mb, chunk }
}

/// End times of every forward and backward in the ideal timeline where each forward takes one
/// unit, each backward `bwd_units`, and each starts once its rank is free and its inputs exist.
struct IdealTimeline {
    bwd_units: u64,
    /// (m, p*v) end time of the forward of (mb, stage).
    fwd_end: Vec<u64>,
    /// (m, p*v) end time of the backward of (mb, stage).
    bwd_end: Vec<u64>,
}

impl IdealTimeline {
    fn new(orders: &[Vec<Work>], layout: Layout, bwd_units: u64) -> IdealTimeline {
        let cells = layout.m * layout.stage_count();
        let (mut fwd_end, mut bwd_end) = (vec![None; cells], vec![None; cells]);
        let mut next = vec![0usize; layout.p];
        let mut free = vec![0u64; layout.p];
        let mut remaining: usize = orders.iter().map(Vec::len).sum();
        while remaining > 0 {
            let mut progressed = false;
            for (rank, order) in orders.iter().enumerate() {
                while let Some(&work) = order.get(next[rank]) {
                    let stage = layout.stage(rank, work.chunk);
                    let Some(ready) = input_ready(work, stage, layout, &fwd_end, &bwd_end) else {
                        break;
                    };
                    let end = free[rank].max(ready) + if work.pass == Pass::Forward { 1 } else { bwd_units };
                    let table = match work.pass {
                        Pass::Forward => &mut fwd_end,
                        Pass::Backward => &mut bwd_end,
                    };
                    table[layout.slot(work.mb, stage)] = Some(end);
                    free[rank] = end;
                    next[rank] += 1;
                    remaining -= 1;
                    progressed = true;
                }
            }
            assert!(progressed, "pipeline compute orders wait on each other: {layout:?}");
        }
        let done = |t: Vec<Option<u64>>| t.into_iter().map(|e| e.expect("every compute ran"));
        IdealTimeline { bwd_units, fwd_end: done(fwd_end).collect(), bwd_end: done(bwd_end).collect() }
    }
}

/// When all inputs of `work` (at global `stage`) exist, or `None` if one is not computed yet.
fn input_ready(
    work: Work,
    stage: usize,
    layout: Layout,
    fwd_end: &[Option<u64>],
    bwd_end: &[Option<u64>],
) -> Option<u64> {
    match work.pass {
        Pass::Forward if stage == 0 => Some(0),
        Pass::Forward => fwd_end[layout.slot(work.mb, stage - 1)],
        Pass::Backward => {
            let own_forward = fwd_end[layout.slot(work.mb, stage)]?;
            if stage + 1 == layout.stage_count() {
                Some(own_forward)
            } else {
                Some(own_forward.max(bwd_end[layout.slot(work.mb, stage + 1)]?))
            }
        }
    }
}

/// Order of one rank's actions: (ideal time, 0 for a message / 1 for a compute, 0 activation /
/// 1 gradient, micro-batch, sender stage). Both ends of a message give it the same key.
type EventKey = (u64, u8, u8, usize, usize);

/// Interleaves `rank`'s computes with its messages in ideal-time order (see the module doc).
fn place_messages(order: &[Work], rank: usize, timeline: &IdealTimeline, layout: Layout) -> Vec<Action> {
    let mut events: Vec<(EventKey, Action)> = Vec::new();
    let last = layout.stage_count() - 1;
    let talks = layout.p > 1;
    for &Work { pass, mb, chunk } in order {
        let stage = layout.stage(rank, chunk);
        let fwd_end = |s| timeline.fwd_end[layout.slot(mb, s)];
        let bwd_end = |s| timeline.bwd_end[layout.slot(mb, s)];
        match pass {
            Pass::Forward => {
                let start = fwd_end(stage) - 1;
                if talks && stage > 0 {
                    let from_rank = layout.owner(stage - 1).0;
                    let key = (fwd_end(stage - 1), 0, 0, mb, stage - 1);
                    events.push((key, Action::RecvActivation { mb, chunk, from_rank }));
                }
                events.push(((start, 1, 0, mb, stage), Action::Forward { mb, chunk }));
                if talks && stage < last {
                    let to_rank = layout.owner(stage + 1).0;
                    let key = (fwd_end(stage), 0, 0, mb, stage);
                    events.push((key, Action::SendActivation { mb, chunk, to_rank }));
                }
            }
            Pass::Backward => {
                let start = bwd_end(stage) - timeline.bwd_units;
                if talks && stage < last {
                    let from_rank = layout.owner(stage + 1).0;
                    let key = (bwd_end(stage + 1), 0, 1, mb, stage + 1);
                    events.push((key, Action::RecvGrad { mb, chunk, from_rank }));
                }
                events.push(((start, 1, 1, mb, stage), Action::Backward { mb, chunk }));
                if talks && stage > 0 {
                    let to_rank = layout.owner(stage - 1).0;
                    let key = (bwd_end(stage), 0, 1, mb, stage);
                    events.push((key, Action::SendGrad { mb, chunk, to_rank }));
                }
            }
        }
    }
    events.sort_unstable_by_key(|&(key, _)| key);
    events.into_iter().map(|(_, action)| action).collect()
}
