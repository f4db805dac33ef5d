//! Discrete-event execution of all pipeline ranks' action lists together, as a checker and as the
//! source of the theoretical bubble the training loop and benchmarks report.
//!
//! Semantics: each rank runs its list in order. A forward or backward of one chunk takes
//! `fwd_time / v` or `bwd_time / v` (per rank with [`simulate_ranks`]). Sends and receives are
//! blocking rendezvous over one ordered channel per (sender, receiver): a send and the receive at
//! the head of the peer's list complete together, at the later of the two ranks' clocks, and take
//! no time; if the peer's head receive from this rank expects a different message, that is a
//! protocol error, not a wait. No message is buffered, so a list set that completes here also
//! completes over any buffered transport. [`simulate_ranks`] can also model buffered links
//! ([`Delivery::Buffered`]: a send completes at once, its message waits in the channel's FIFO
//! until the receive at the head of the receiver's list takes it), which is how meshtrain's
//! shared-memory and TCP links behave while messages fit their slots.
//!
//! Every action is checked as it runs: a forward needs its input activation (received, or computed
//! locally by the previous chunk when `p == 1`), a backward needs its own forward and its output
//! gradient, a send needs its value computed and names the rank that holds the neighbouring stage,
//! nothing runs twice. At the end every (micro-batch, stage) must have run its forward and its
//! backward. Violations and deadlocks are `Error::Check` naming the rank, action index and action.

use std::collections::VecDeque;

use super::{actions, Action, Layout, Schedule};
use crate::error::{Error, Result};

/// How a simulated send completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// When the peer takes the message (no buffering; the strictest model).
    Rendezvous,
    /// At once; the message waits in an unbounded FIFO per (sender, receiver).
    Buffered,
}

/// What executing one step of a schedule on all ranks yields.
#[derive(Debug, Clone, PartialEq)]
pub struct SimReport {
    /// Time from the start to the last rank's last action, in the unit of `fwd_time`.
    pub makespan: f64,
    /// Compute time of each rank: `m * (fwd_time + bwd_time)` (of that rank).
    pub busy: Vec<f64>,
    /// When each rank's last action finished; `end[r] - busy[r]` is rank `r`'s idle time.
    pub end: Vec<f64>,
    /// Idle share of all ranks' time: `1 - sum(busy) / (p * makespan)`.
    pub bubble_fraction: f64,
    /// Per rank, the most (micro-batch, chunk) pairs whose forward has run and whose backward has
    /// not: activations held at once, in units of one chunk's activations for one micro-batch.
    pub peak_in_flight: Vec<usize>,
}

/// Executes the lists [`actions`] gives every rank of a `stages`-rank pipeline over `microbatches`
/// micro-batches, checking dependencies and message matching (see the module doc). `fwd_time` and
/// `bwd_time` are one micro-batch's forward and backward through all of one rank's layers.
///
/// Errors: those of [`actions`]; `Error::InvalidArgument` for a time that is not finite and
/// positive; `Error::Check` if the schedule deadlocks or breaks a dependency (a bug).
pub fn simulate(
    schedule: Schedule,
    stages: usize,
    microbatches: usize,
    fwd_time: f64,
    bwd_time: f64,
) -> Result<SimReport> {
    let (fwd, bwd) = (vec![fwd_time; stages], vec![bwd_time; stages]);
    simulate_ranks(schedule, stages, microbatches, &fwd, &bwd, Delivery::Rendezvous)
}

/// [`simulate`] with per-rank times and a choice of [`Delivery`]: rank `r`'s forward and backward
/// of one micro-batch through all its chunks take `fwd_times[r]` and `bwd_times[r]` (e.g. measured
/// ones, to see how much bubble the imbalance between stages alone explains). Errors as
/// [`simulate`], and `Error::InvalidArgument` unless both slices have one time per rank.
pub fn simulate_ranks(
    schedule: Schedule,
    stages: usize,
    microbatches: usize,
    fwd_times: &[f64],
    bwd_times: &[f64],
    delivery: Delivery,
) -> Result<SimReport> {
    for (name, times) in [("fwd_time", fwd_times), ("bwd_time", bwd_times)] {
        if times.len() != stages {
            return Err(Error::InvalidArgument(format!(
                "simulate: {} {name}s for {stages} pipeline ranks",
                times.len()
            )));
        }
        if let Some(t) = times.iter().find(|t| !(t.is_finite() && **t > 0.0)) {
            return Err(Error::InvalidArgument(format!(
                "simulate: {name} {t} is not a finite positive time"
            )));
        }
    }
    let lists =
        (0..stages).map(|rank| actions(schedule, rank, stages, microbatches)).collect::<Result<Vec<_>>>()?;
    let layout = Layout { p: stages, m: microbatches, v: schedule.chunks() };
    let per_chunk = |times: &[f64]| times.iter().map(|t| t / layout.v as f64).collect::<Vec<_>>();
    execute(&lists, layout, &per_chunk(fwd_times), &per_chunk(bwd_times), delivery)
}

/// Message direction along the pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Activation,
    Grad,
}

/// A message, as both of its ends must describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Message {
    kind: Kind,
    mb: usize,
    from_stage: usize,
    to_stage: usize,
}

/// Runs `lists[r]` on rank `r` for every rank; one chunk's forward on rank `r` takes `fwd[r]`,
/// its backward `bwd[r]`.
fn execute(
    lists: &[Vec<Action>],
    layout: Layout,
    fwd: &[f64],
    bwd: &[f64],
    delivery: Delivery,
) -> Result<SimReport> {
    let p = layout.p;
    if lists.len() != p {
        return Err(Error::InvalidArgument(format!(
            "simulate: {} action lists for {p} pipeline ranks",
            lists.len()
        )));
    }
    let cells = layout.m * layout.stage_count();
    let mut sim = Sim {
        lists,
        layout,
        fwd,
        bwd,
        delivery,
        queues: vec![VecDeque::new(); p * p],
        pc: vec![0; p],
        clock: vec![0.0; p],
        busy: vec![0.0; p],
        in_flight: vec![0; p],
        peak_in_flight: vec![0; p],
        forwarded: vec![false; cells],
        backwarded: vec![false; cells],
        activation_in: vec![false; cells],
        grad_in: vec![false; cells],
    };
    while (0..p).any(|r| sim.pc[r] < lists[r].len()) {
        let mut progressed = false;
        for rank in 0..p {
            while sim.step(rank)? {
                progressed = true;
            }
        }
        if !progressed {
            return Err(sim.deadlock());
        }
    }
    sim.check_complete()?;
    let makespan = sim.clock.iter().copied().fold(0.0, f64::max);
    let work: f64 = sim.busy.iter().sum();
    Ok(SimReport {
        makespan,
        bubble_fraction: 1.0 - work / (p as f64 * makespan),
        busy: sim.busy,
        end: sim.clock,
        peak_in_flight: sim.peak_in_flight,
    })
}

struct Sim<'a> {
    lists: &'a [Vec<Action>],
    layout: Layout,
    /// Per rank: one chunk's forward and backward time.
    fwd: &'a [f64],
    bwd: &'a [f64],
    delivery: Delivery,
    /// Buffered delivery: messages sent and not yet received with their send times, FIFO per
    /// (sender, receiver) at `sender * p + receiver`.
    queues: Vec<VecDeque<(Message, f64)>>,
    /// Per rank: index of the next action.
    pc: Vec<usize>,
    /// Per rank: time at which its last action finished.
    clock: Vec<f64>,
    /// Per rank: total compute time so far.
    busy: Vec<f64>,
    in_flight: Vec<usize>,
    peak_in_flight: Vec<usize>,
    /// (m, p*v): forward of (mb, stage) has run.
    forwarded: Vec<bool>,
    /// (m, p*v): backward of (mb, stage) has run.
    backwarded: Vec<bool>,
    /// (m, p*v): input activation of (mb, stage) has arrived at its rank.
    activation_in: Vec<bool>,
    /// (m, p*v): output gradient of (mb, stage) has arrived at its rank.
    grad_in: Vec<bool>,
}

impl Sim<'_> {
    fn head(&self, rank: usize) -> Option<Action> {
        self.lists[rank].get(self.pc[rank]).copied()
    }

    fn fail(&self, rank: usize, why: impl std::fmt::Display) -> Error {
        let action = self.head(rank).map_or("end".to_string(), |a| format!("{a:?}"));
        Error::Check(format!("pipeline rank {rank}, action #{} {action}: {why}", self.pc[rank]))
    }

    /// Runs `rank`'s next action if it can run now; `Ok(false)` if it waits or the list is done.
    fn step(&mut self, rank: usize) -> Result<bool> {
        let Some(action) = self.head(rank) else {
            return Ok(false);
        };
        match action {
            Action::Forward { mb, chunk } => self.compute(rank, mb, chunk, true).map(|()| true),
            Action::Backward { mb, chunk } => self.compute(rank, mb, chunk, false).map(|()| true),
            Action::SendActivation { to_rank: peer, .. } | Action::SendGrad { to_rank: peer, .. } => {
                match self.delivery {
                    Delivery::Rendezvous => self.rendezvous(rank, peer, rank),
                    Delivery::Buffered => self.post(rank, peer, action).map(|()| true),
                }
            }
            Action::RecvActivation { from_rank: peer, .. } | Action::RecvGrad { from_rank: peer, .. } => {
                match self.delivery {
                    Delivery::Rendezvous => self.rendezvous(rank, peer, peer),
                    Delivery::Buffered => self.take(rank, peer, action),
                }
            }
        }
    }

    fn check_peer(&self, rank: usize, peer: usize) -> Result<()> {
        if peer >= self.layout.p || peer == rank {
            return Err(self.fail(rank, "peer is not another pipeline rank"));
        }
        Ok(())
    }

    /// Global stage of (rank, chunk), after range checks of `mb` and `chunk`.
    fn stage(&self, rank: usize, mb: usize, chunk: usize) -> Result<usize> {
        if mb >= self.layout.m || chunk >= self.layout.v {
            return Err(self.fail(rank, "micro-batch or chunk out of range"));
        }
        Ok(self.layout.stage(rank, chunk))
    }

    fn compute(&mut self, rank: usize, mb: usize, chunk: usize, forward: bool) -> Result<()> {
        let stage = self.stage(rank, mb, chunk)?;
        let slot = self.layout.slot(mb, stage);
        let last = self.layout.stage_count() - 1;
        let local = |s: usize| self.layout.owner(s).0 == rank;
        let (ready, duration) = if forward {
            if self.forwarded[slot] {
                return Err(self.fail(rank, "second forward"));
            }
            let input = stage == 0
                || if local(stage - 1) {
                    self.forwarded[self.layout.slot(mb, stage - 1)]
                } else {
                    self.activation_in[slot]
                };
            (input, self.fwd[rank])
        } else {
            if self.backwarded[slot] || !self.forwarded[slot] {
                return Err(self.fail(rank, "backward twice or before its forward"));
            }
            let grad = stage == last
                || if local(stage + 1) {
                    self.backwarded[self.layout.slot(mb, stage + 1)]
                } else {
                    self.grad_in[slot]
                };
            (grad, self.bwd[rank])
        };
        if !ready {
            return Err(self.fail(rank, "input not received or computed"));
        }
        if forward {
            self.forwarded[slot] = true;
            self.in_flight[rank] += 1;
            self.peak_in_flight[rank] = self.peak_in_flight[rank].max(self.in_flight[rank]);
        } else {
            self.backwarded[slot] = true;
            self.in_flight[rank] -= 1;
        }
        self.clock[rank] += duration;
        self.busy[rank] += duration;
        self.pc[rank] += 1;
        Ok(())
    }

    /// Completes the transfer between `rank`'s head and `peer`'s head if they are the two ends of
    /// one message from `sender`; `Ok(false)` if `peer` is not (yet) at a transfer with `rank`.
    fn rendezvous(&mut self, rank: usize, peer: usize, sender: usize) -> Result<bool> {
        self.check_peer(rank, peer)?;
        let receiver = if sender == rank { peer } else { rank };
        let (Some(send), Some(recv)) = (self.head(sender), self.head(receiver)) else {
            return Ok(false);
        };
        let (Some(sent), Some(expected)) =
            (self.message(sender, send, true)?, self.message(receiver, recv, false)?)
        else {
            return Ok(false);
        };
        let owner = |stage| self.layout.owner(stage).0;
        if owner(sent.to_stage) != receiver || owner(expected.from_stage) != sender {
            return Ok(false);
        }
        self.deliver(sender, receiver, sent, expected)?;
        let t = self.clock[sender].max(self.clock[receiver]);
        for r in [sender, receiver] {
            self.clock[r] = t;
            self.pc[r] += 1;
        }
        Ok(true)
    }

    /// Buffered delivery: queues the message `action` on `rank` sends to `peer`, completing the send.
    fn post(&mut self, rank: usize, peer: usize, action: Action) -> Result<()> {
        self.check_peer(rank, peer)?;
        let sent = self.message(rank, action, true)?.expect("a send action describes a message");
        self.queues[rank * self.layout.p + peer].push_back((sent, self.clock[rank]));
        self.pc[rank] += 1;
        Ok(())
    }

    /// Buffered delivery: completes the receive `action` on `rank` from `peer` with the oldest
    /// queued message of that channel, once it was sent; `Ok(false)` while none is queued.
    fn take(&mut self, rank: usize, peer: usize, action: Action) -> Result<bool> {
        self.check_peer(rank, peer)?;
        let channel = peer * self.layout.p + rank;
        let Some(&(sent, at)) = self.queues[channel].front() else {
            return Ok(false);
        };
        let expected = self.message(rank, action, false)?.expect("a receive action describes a message");
        self.deliver(peer, rank, sent, expected)?;
        self.queues[channel].pop_front();
        self.clock[rank] = self.clock[rank].max(at);
        self.pc[rank] += 1;
        Ok(true)
    }

    /// Checks that `receiver` expects what `sender` sent and marks it arrived.
    fn deliver(&mut self, sender: usize, receiver: usize, sent: Message, expected: Message) -> Result<()> {
        if sent != expected {
            return Err(self.fail(receiver, format!("expects {expected:?} but rank {sender} sends {sent:?}")));
        }
        let arrived = match sent.kind {
            Kind::Activation => &mut self.activation_in,
            Kind::Grad => &mut self.grad_in,
        };
        arrived[self.layout.slot(sent.mb, sent.to_stage)] = true;
        Ok(())
    }

    /// The message `action` on `rank` sends (`sending`) or receives, checked against the stage
    /// layout; `None` if `action` is not a transfer in that role.
    fn message(&self, rank: usize, action: Action, sending: bool) -> Result<Option<Message>> {
        let (kind, mb, chunk, peer) = match (action, sending) {
            (Action::SendActivation { mb, chunk, to_rank }, true) => (Kind::Activation, mb, chunk, to_rank),
            (Action::SendGrad { mb, chunk, to_rank }, true) => (Kind::Grad, mb, chunk, to_rank),
            (Action::RecvActivation { mb, chunk, from_rank }, false) => {
                (Kind::Activation, mb, chunk, from_rank)
            }
            (Action::RecvGrad { mb, chunk, from_rank }, false) => (Kind::Grad, mb, chunk, from_rank),
            _ => return Ok(None),
        };
        let stage = self.stage(rank, mb, chunk)?;
        let last = self.layout.stage_count() - 1;
        // Activations flow to the next stage, gradients to the previous one.
        let downstream = kind == Kind::Activation;
        let other = match (downstream == sending, stage) {
            (true, s) if s < last => s + 1,
            (false, s) if s > 0 => s - 1,
            _ => return Err(self.fail(rank, "no neighbouring stage in that direction")),
        };
        if self.layout.owner(other).0 != peer {
            return Err(self.fail(rank, format!("stage {other} is not on rank {peer}")));
        }
        let slot = self.layout.slot(mb, stage);
        let computed = match kind {
            Kind::Activation => self.forwarded[slot],
            Kind::Grad => self.backwarded[slot],
        };
        if sending && !computed {
            return Err(self.fail(rank, "sends a value it has not computed"));
        }
        let (from_stage, to_stage) = if sending { (stage, other) } else { (other, stage) };
        Ok(Some(Message { kind, mb, from_stage, to_stage }))
    }

    fn deadlock(&self) -> Error {
        let waiting: Vec<String> = (0..self.layout.p)
            .filter_map(|r| self.head(r).map(|a| format!("rank {r} at #{} {a:?}", self.pc[r])))
            .collect();
        Error::Check(format!("pipeline deadlock: {}", waiting.join("; ")))
    }

    fn check_complete(&self) -> Result<()> {
        if let Some(i) = self.queues.iter().position(|q| !q.is_empty()) {
            let (sender, receiver) = (i / self.layout.p, i % self.layout.p);
            return Err(Error::Check(format!(
                "pipeline rank {sender} sent {:?} to rank {receiver}, which never received it",
                self.queues[i][0].0
            )));
        }
        let stages = self.layout.stage_count();
        for (slot, (&f, &b)) in self.forwarded.iter().zip(&self.backwarded).enumerate() {
            if !(f && b) {
                let (mb, stage) = (slot / stages, slot % stages);
                let (rank, chunk) = self.layout.owner(stage);
                return Err(Error::Check(format!(
                    "pipeline rank {rank} never ran the {} of micro-batch {mb}, chunk {chunk}",
                    if f { "backward" } else { "forward" }
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::schedule::plan;
    use Action::{Backward as B, Forward as F, RecvActivation as RecvA, RecvGrad as RecvG, SendGrad as SendG};

    const TWO_RANKS_TWO_MB: Layout = Layout { p: 2, m: 2, v: 1 };

    fn run(lists: &[Vec<Action>]) -> Result<SimReport> {
        execute(lists, TWO_RANKS_TWO_MB, &[1.0; 2], &[1.0; 2], Delivery::Rendezvous)
    }

    fn check_error(r: Result<SimReport>, needle: &str) {
        match r {
            Err(Error::Check(msg)) => assert!(msg.contains(needle), "{msg}"),
            other => panic!("expected a check error containing `{needle}`, got {other:?}"),
        }
    }

    /// Rank 0 of a 2-rank GPipe over 2 micro-batches: both forwards, then both backwards.
    fn rank0() -> Vec<Action> {
        plan("F0 A0>1 F1 A1>1 G0<1 B0 G1<1 B1")
    }

    /// Rank 1 running 1F1B: it sends gradient 0 before it receives activation 1.
    fn rank1_one_f_one_b() -> Vec<Action> {
        plan("A0<0 F0 B0 G0>0 A1<0 F1 B1 G1>0")
    }

    #[test]
    fn hand_written_lists_run_with_exact_times() {
        // Rank 0 receives gradient 0 before sending activation 1, so the facing sends of
        // `facing_sends_deadlock` meet: rank 0 F0 [0,1] F1 [1,2], both transfers at t=3 after
        // rank 1's F0 [1,2] B0 [2,3]; rank 0 B0 [3,4]; rank 1 F1 [3,4] B1 [4,5]; rank 0 B1 [5,6].
        let fixed = plan("F0 A0>1 F1 G0<1 A1>1 B0 G1<1 B1");
        let report = run(&[fixed, rank1_one_f_one_b()]).unwrap();
        assert_eq!(report.makespan, 6.0);
        assert_eq!(report.busy, vec![4.0, 4.0]);
        assert_eq!(report.end, vec![6.0, 5.0]);
        assert_eq!(report.peak_in_flight, vec![2, 1]);
    }

    #[test]
    fn facing_sends_deadlock() {
        // Rank 0 blocks sending activation 1 while rank 1 blocks sending gradient 0.
        check_error(run(&[rank0(), rank1_one_f_one_b()]), "deadlock");
    }

    /// Buffered links let the facing sends pass: rank 0 F0 [0,1] F1 [1,2], both sends queued;
    /// rank 1 F0 [1,2] B0 [2,3] F1 [3,4] B1 [4,5]; rank 0 B0 [3,4] B1 [5,6].
    #[test]
    fn buffered_links_pass_facing_sends() {
        let lists = [rank0(), rank1_one_f_one_b()];
        let report = execute(&lists, TWO_RANKS_TWO_MB, &[1.0; 2], &[1.0; 2], Delivery::Buffered).unwrap();
        assert_eq!(report.end, vec![6.0, 5.0]);
    }

    #[test]
    fn a_message_never_received_is_caught() {
        let mut rank1 = rank1_one_f_one_b();
        // Rank 1 stops after micro-batch 0, rank 0 after its backward; activation 1 stays queued.
        let mb1 = |a: &Action| {
            matches!(a, RecvA { mb: 1, .. } | F { mb: 1, .. } | B { mb: 1, .. } | SendG { mb: 1, .. })
        };
        rank1.retain(|a| !mb1(a));
        let mut rank0 = rank0();
        rank0.retain(|a| !matches!(a, RecvG { mb: 1, .. } | B { mb: 1, .. }));
        match execute(&[rank0, rank1], TWO_RANKS_TWO_MB, &[1.0; 2], &[1.0; 2], Delivery::Buffered) {
            Err(Error::Check(msg)) => assert!(msg.contains("never received"), "{msg}"),
            other => panic!("expected an unreceived-message error, got {other:?}"),
        }
    }

    #[test]
    fn out_of_order_receive_is_a_protocol_error() {
        let mut rank1 = rank1_one_f_one_b();
        rank1[0] = RecvA { mb: 1, chunk: 0, from_rank: 0 };
        check_error(run(&[rank0(), rank1]), "expects");
    }

    #[test]
    fn forward_without_its_input_is_caught() {
        let mut rank1 = rank1_one_f_one_b();
        rank1.swap(0, 1);
        check_error(run(&[rank0(), rank1]), "input not received");
    }

    #[test]
    fn sending_an_uncomputed_value_is_caught() {
        let mut rank0 = rank0();
        rank0.swap(0, 1);
        check_error(run(&[rank0, rank1_one_f_one_b()]), "not computed");
    }

    #[test]
    fn wrong_peer_is_caught() {
        let mut rank1 = rank1_one_f_one_b();
        rank1[3] = SendG { mb: 0, chunk: 0, to_rank: 1 };
        check_error(run(&[rank0(), rank1]), "another pipeline rank");
    }

    #[test]
    fn missing_backward_is_caught() {
        let layout = Layout { p: 1, m: 2, v: 1 };
        let list = vec![F { mb: 0, chunk: 0 }, F { mb: 1, chunk: 0 }, B { mb: 1, chunk: 0 }];
        match execute(&[list], layout, &[1.0], &[1.0], Delivery::Rendezvous) {
            Err(Error::Check(msg)) => assert!(msg.contains("backward of micro-batch 0"), "{msg}"),
            other => panic!("expected a missing-backward error, got {other:?}"),
        }
    }
}
