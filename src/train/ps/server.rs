//! A parameter server's loop: it holds the parameters and AdamW moments of the pieces it owns
//! ([`super::PiecePlan`]) and answers the workers' messages in the order every worker sends them
//! (load, then a gradient round per step, a state fetch per checkpoint, and finish).
//!
//! Invariants: a round's pieces are summed over the workers in worker order and divided by the
//! worker count once; the norm's squares are added in piece order on every server alike
//! (module `ps`); the update is applied or skipped on every server alike (non-finite norm or a
//! worker's non-finite loss: skipped, as `train.nonfinite` decides on the workers); the version
//! advances by one per round, applied or not.

use std::ops::Range;

use super::{
    shard_count, spans_from_words, whole_model_squares, worker_place, PiecePlan, PsLinks, HEADER,
    KIND_FETCH, KIND_FINISH, KIND_GRADS, KIND_LOAD, VERSION_HEADER,
};
use crate::comm::{Communicator, ReduceOp};
use crate::config::JobConfig;
use crate::device::cpu::adamw::{update_elements, AdamWStep, Coefficients};
use crate::error::{Error, Result};
use crate::optim::{clip_scale, sum_of_squares, AdamWConfig};

/// One owned piece: its range, parameters, moments and this round's summed gradient.
struct Piece {
    /// The (tp, pp) shard and the piece's index in its plan.
    shard: usize,
    index: usize,
    range: Range<usize>,
    params: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    grad: Vec<f32>,
    /// (start, end, weight decay) sub-ranges, relative to the piece.
    decay: Vec<(Range<usize>, bool)>,
    /// Counted (norm) sub-ranges, relative to the piece, and the slots of their squares.
    counted: Vec<Range<usize>>,
    first_slot: usize,
}

/// A server's state once loaded.
struct Server<'a> {
    cfg: &'a JobConfig,
    group: Communicator,
    links: PsLinks,
    /// Each shard's plan.
    plans: Vec<PiecePlan>,
    /// The owned pieces, shard by shard, each shard's in piece order.
    pieces: Vec<Piece>,
    /// Squares slots over all shards' pieces (the exchange among servers), and where each
    /// shard's slots start (`shard_slots[k]..shard_slots[k + 1]`).
    shard_slots: Vec<usize>,
    /// Per shard: the index among the owned pieces of each of its pieces (None: another server's).
    slot_of: Vec<Vec<Option<usize>>>,
    /// Per shard: its workers' link ranks in data-parallel order.
    workers_of: Vec<Vec<usize>>,
    /// Per worker: its shard.
    shard_of: Vec<usize>,
    steps_taken: u64,
    version: u64,
    adamw: AdamWConfig,
    scratch: Vec<f32>,
}

/// Runs server `group.rank()` until the workers finish (collective with the workers and servers).
pub fn serve(group: Communicator, links: PsLinks, cfg: &JobConfig) -> Result<()> {
    let heads = receive_headers(&links)?;
    if heads[0][0] != KIND_LOAD {
        return Err(Error::Check(format!(
            "parameter server {}: the first message of worker 0 is kind {}, not the load",
            group.rank(),
            heads[0][0]
        )));
    }
    let mut server = Server::load(cfg, group, links, heads[0][1] as u64)?;
    loop {
        let heads = receive_headers(&server.links)?;
        match heads[0][0] {
            KIND_GRADS => server.round(&heads)?,
            KIND_FETCH => server.fetch()?,
            KIND_FINISH => return server.finish(),
            k => {
                return Err(Error::Check(format!(
                    "parameter server {}: unknown message kind {k} from worker 0",
                    server.group.rank()
                )))
            }
        }
    }
}

/// The next header of every worker, which must all be of one kind.
fn receive_headers(links: &PsLinks) -> Result<Vec<[i64; HEADER]>> {
    let mut heads = Vec::with_capacity(links.workers);
    for w in 0..links.workers {
        let mut h = [0i64; HEADER];
        links.push.recv_into(&mut h, w)?;
        heads.push(h);
    }
    if let Some(w) = (0..heads.len()).find(|&w| heads[w][0] != heads[0][0]) {
        return Err(Error::Check(format!(
            "parameter server: worker {w} sent message kind {} while worker 0 sent {} (the workers disagree on the step sequence)",
            heads[w][0], heads[0][0]
        )));
    }
    Ok(heads)
}

impl<'a> Server<'a> {
    /// Receives each shard's layout and this server's pieces' state from the shard's first
    /// worker (data-parallel index 0); `steps_taken`: the optimizer steps the state has seen.
    fn load(
        cfg: &'a JobConfig,
        group: Communicator,
        links: PsLinks,
        steps_taken: u64,
    ) -> Result<Self> {
        let me = group.rank();
        let shards = shard_count(cfg);
        let mut workers_of = vec![Vec::new(); shards];
        let mut shard_of = Vec::with_capacity(links.workers);
        for w in 0..links.workers {
            let (k, _) = worker_place(cfg, w);
            workers_of[k].push(w);
            shard_of.push(k);
        }
        if let Some(k) = workers_of.iter().position(|w| w.is_empty()) {
            return Err(Error::Check(format!(
                "parameter server {me}: shard {k} has no worker among the {} workers",
                links.workers
            )));
        }
        let mut sizes = vec![[0i64; 3]; shards];
        for (k, s) in sizes.iter_mut().enumerate() {
            links.push.recv_into(s, workers_of[k][0])?;
        }
        let n_of: Vec<usize> = sizes.iter().map(|s| s[0] as usize).collect();
        let plans = PiecePlan::of_job(cfg, &n_of);
        let (mut pieces, mut shard_slots, mut slot_of) = (Vec::new(), vec![0], Vec::new());
        for (k, plan) in plans.iter().enumerate() {
            let (n, nd, nn) = (n_of[k], sizes[k][1] as usize, sizes[k][2] as usize);
            let leader = workers_of[k][0];
            let mut words = vec![0i64; 3 * (nd + nn)];
            links.push.recv_into(&mut words, leader)?;
            let decay = spans_from_words(&words[..3 * nd], n, "decay")?;
            let norm = spans_from_words(&words[3 * nd..], n, "norm")?;
            let mut slots = *shard_slots.last().expect("starts at 0");
            let mut owned = vec![None; plan.pieces.len()];
            for (p, range) in plan.pieces.iter().enumerate() {
                let counted: Vec<Range<usize>> = relative(range, &norm)
                    .into_iter()
                    .filter(|(_, c)| *c)
                    .map(|(r, _)| r)
                    .collect();
                let ncounted = counted.len();
                if plan.owner[p] == me {
                    owned[p] = Some(pieces.len());
                    let decay = relative(range, &decay);
                    if decay.iter().map(|(r, _)| r.len()).sum::<usize>() != range.len() {
                        return Err(Error::Check(format!("parameter server {me}: the weight-decay spans of shard {k} do not cover piece {p} ({range:?})")));
                    }
                    let piece = Piece::receive(&links, leader, (k, p), range, decay, (counted, slots))?;
                    pieces.push(piece);
                }
                slots += ncounted;
            }
            shard_slots.push(slots);
            slot_of.push(owned);
        }
        let largest = pieces.iter().map(|p| p.range.len()).max().unwrap_or(0);
        let o = &cfg.optim;
        Ok(Server {
            cfg,
            group,
            links,
            plans,
            pieces,
            shard_slots,
            slot_of,
            workers_of,
            shard_of,
            steps_taken,
            version: 0,
            adamw: AdamWConfig {
                beta1: o.beta1,
                beta2: o.beta2,
                eps: o.eps,
                weight_decay: o.weight_decay,
            },
            scratch: vec![0.0; largest],
        })
    }

    /// One step's round: the workers' gradients summed, the norm, the update, the new version
    /// sent to every worker.
    fn round(&mut self, heads: &[[i64; HEADER]]) -> Result<()> {
        let step = heads[0][1];
        let me = self.group.rank();
        for (w, h) in heads.iter().enumerate() {
            let lag = step - 1 - h[2];
            if h[1] != step || lag < 0 || lag as u64 > self.cfg.ps.staleness {
                return Err(Error::Check(format!(
                    "parameter server {me}: worker {w} pushed step {} trained on version {} (step {step}, staleness at most {})",
                    h[1], h[2], self.cfg.ps.staleness
                )));
            }
        }
        if step as u64 != self.version + 1 {
            return Err(Error::Check(format!(
                "parameter server {me}: gradients of step {step} after version {}",
                self.version
            )));
        }
        self.receive_gradients()?;
        let (mut loss_bad, mut lr) = (false, None);
        for w in 0..self.links.workers {
            let mut trailer = [0i64; 2];
            self.links.push.recv_into(&mut trailer, w)?;
            loss_bad |= trailer[0] & 1 != 0;
            if *lr.get_or_insert(trailer[1]) != trailer[1] {
                return Err(Error::Check(format!("parameter server {me}: worker {w} sent another learning rate for step {step} than worker 0")));
            }
        }
        let lr = f64::from_bits(lr.unwrap_or(0) as u64);
        let sq = self.sum_of_squares()?;
        let applied = sq.is_finite() && !loss_bad;
        if applied {
            self.steps_taken += 1;
            let update = AdamWStep {
                config: &self.adamw,
                step: self.steps_taken,
                lr,
                grad_scale: clip_scale(sq.sqrt(), self.cfg.optim.grad_clip),
            };
            let coef = Coefficients::<f32>::new(&update);
            let wd = self.adamw.weight_decay as f32;
            for p in &mut self.pieces {
                for (r, decay) in &p.decay {
                    let r = r.clone();
                    update_elements(
                        &coef,
                        if *decay { wd } else { 0.0 },
                        &mut p.params[r.clone()],
                        &p.grad[r.clone()],
                        &mut p.m[r.clone()],
                        &mut p.v[r],
                    );
                }
            }
        }
        self.version += 1;
        let head = [0.0, self.version as f64, sq, f64::from(u8::from(applied))];
        for w in 0..self.links.workers {
            self.links.pull.send(&head, w)?;
            let k = self.shard_of[w];
            for p in self.pieces.iter().filter(|p| p.shard == k) {
                self.links.pull.send(&p.params, w)?;
            }
        }
        Ok(())
    }

    /// Receives this server's pieces of every shard from the shard's workers, shard by shard,
    /// in the order the workers pushed them (the backward's, the same on every worker of a
    /// shard), and sums each in data-parallel order, then divides by the data-parallel degree.
    fn receive_gradients(&mut self) -> Result<()> {
        for k in 0..self.workers_of.len() {
            let owned = self.slot_of[k].iter().flatten().count();
            for _ in 0..owned {
                self.receive_piece(k)?;
            }
        }
        Ok(())
    }

    /// The next piece of shard `k` from each of its workers, summed and averaged.
    fn receive_piece(&mut self, k: usize) -> Result<()> {
        let me = self.group.rank();
        let mut first = None;
        for (i, &w) in self.workers_of[k].iter().enumerate() {
            let mut idx = [0i64; 1];
            self.links.push.recv_into(&mut idx, w)?;
            let p = idx[0] as usize;
            let slot = self.slot_of[k].get(p).copied().flatten().ok_or_else(|| {
                Error::Check(format!(
                    "parameter server {me}: worker {w} pushed piece {} of shard {k}, which it does not own",
                    idx[0]
                ))
            })?;
            if *first.get_or_insert(slot) != slot {
                let f = self.pieces[first.unwrap_or(slot)].index;
                return Err(Error::Check(format!("parameter server {me}: worker {w} pushed piece {p} of shard {k} where its first worker pushed piece {f}")));
            }
            let piece = &mut self.pieces[slot];
            let len = piece.range.len();
            if i == 0 {
                self.links.push.recv_into(&mut piece.grad, w)?;
            } else {
                self.links.push.recv_into(&mut self.scratch[..len], w)?;
                piece
                    .grad
                    .iter_mut()
                    .zip(&self.scratch[..len])
                    .for_each(|(a, b)| *a += b);
            }
        }
        let dp = self.workers_of[k].len();
        if dp > 1 {
            let piece = &mut self.pieces[first.expect("at least one worker")];
            let n = dp as f32;
            piece.grad.iter_mut().for_each(|g| *g /= n);
        }
        Ok(())
    }

    /// The whole model's sum of squares of the averaged gradients: per (shard, piece, counted
    /// span), exchanged among the servers, added in piece order within a shard, then over the
    /// shards as the all-reduce step adds its partial norms ([`whole_model_squares`]).
    fn sum_of_squares(&self) -> Result<f64> {
        let mut squares = vec![0f64; *self.shard_slots.last().expect("starts at 0")];
        for p in &self.pieces {
            for (k, c) in p.counted.iter().enumerate() {
                squares[p.first_slot + k] = sum_of_squares(&p.grad[c.clone()]);
            }
        }
        if self.group.size() > 1 {
            self.group.all_reduce(&mut squares, ReduceOp::Sum)?;
        }
        let shard_sq: Vec<f64> = self
            .shard_slots
            .windows(2)
            .map(|w| squares[w[0]..w[1]].iter().fold(0.0, |acc, s| acc + s))
            .collect();
        Ok(whole_model_squares(&shard_sq, self.cfg.parallel.tp))
    }

    /// A checkpoint: every worker gets the optimizer steps, the version and this server's pieces'
    /// parameters and moments.
    fn fetch(&mut self) -> Result<()> {
        let head = [self.steps_taken as i64, self.version as i64];
        for w in 0..self.links.workers {
            self.links.reply.send(&head, w)?;
            let k = self.shard_of[w];
            for p in self.pieces.iter().filter(|p| p.shard == k) {
                for buf in [&p.params, &p.m, &p.v] {
                    self.links.reply.send(buf, w)?;
                }
            }
        }
        Ok(())
    }

    /// The workers are done: their pull threads get the finish header.
    fn finish(self) -> Result<()> {
        let head = [1.0, self.version as f64, 0.0, 0.0];
        debug_assert_eq!(head.len(), VERSION_HEADER);
        for w in 0..self.links.workers {
            self.links.pull.send(&head, w)?;
        }
        log::debug!(
            "parameter server {}: {} pieces of {}, {} versions",
            self.group.rank(),
            self.pieces.len(),
            self.plans.iter().map(|p| p.pieces.len()).sum::<usize>(),
            self.version
        );
        Ok(())
    }
}

impl Piece {
    /// Piece `p` of shard `k` over `range` with its `decay` spans and `counted` spans (whose
    /// squares go to the slots from `first_slot`): its parameters and moments from `leader`.
    fn receive(
        links: &PsLinks,
        leader: usize,
        (shard, index): (usize, usize),
        range: &Range<usize>,
        decay: Vec<(Range<usize>, bool)>,
        (counted, first_slot): (Vec<Range<usize>>, usize),
    ) -> Result<Self> {
        let len = range.len();
        let mut piece = Piece {
            shard,
            index,
            range: range.clone(),
            params: vec![0.0; len],
            m: vec![0.0; len],
            v: vec![0.0; len],
            grad: vec![0.0; len],
            decay,
            counted,
            first_slot,
        };
        for buf in [&mut piece.params, &mut piece.m, &mut piece.v] {
            links.push.recv_into(buf, leader)?;
        }
        Ok(piece)
    }
}

/// The parts of `spans` inside `piece`, relative to its start, in span order.
fn relative(piece: &Range<usize>, spans: &[(Range<usize>, bool)]) -> Vec<(Range<usize>, bool)> {
    spans
        .iter()
        .filter_map(|(r, f)| {
            let (lo, hi) = (piece.start.max(r.start), piece.end.min(r.end));
            (lo < hi).then(|| (lo - piece.start..hi - piece.start, *f))
        })
        .collect()
}
