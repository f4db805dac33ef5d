//! Bucketed gradient reduction overlapped with the backward pass.
//!
//! The flat gradient buffer is cut into buckets of about `bucket_mb` MB, from the end of the buffer
//! backwards (the order in which backward finishes gradients), never straddling a unit boundary
//! (with ZeRO-3 a bucket is also the granularity of parameter gathers, see `param_gather.rs`).
//! The model reports each range of gradients, with its values, as soon as it is final; the values
//! are copied (scaled by `1/micro_batches`) into a staging buffer of the bucket, and when every
//! element of a bucket has arrived the buffer goes to a communication thread, which reduces it on
//! its own communicator while the backward goes on. [`OverlapReducer::finish`] waits for the rest.
//!
//! Two reductions:
//! - [`Reduction::AllReduce`] (ZeRO-0): every rank gets the whole averaged bucket; each bucket has a
//!   staging buffer of its own for the whole run and `finish` writes the results back into the
//!   model's gradients.
//! - [`Reduction::ReduceScatter`] (ZeRO >= 1): this rank's result is block `dp_rank` of every
//!   bucket ([`OverlapReducer::shard`]), handed to the caller's sink as soon as it arrives (with
//!   whether it is the bucket's first this step), which sums it into the optimizer's gradient
//!   shard: the reducer keeps no shard of its own. Staging buffers come from a pool of at most
//!   [`MAX_STAGED`] (filling or in flight; a report waits for a finished bucket when the pool is
//!   empty), so transient gradient memory is bounded by `MAX_STAGED` buckets. A bucket may be
//!   reported several times per step (ZeRO-2/3 reduce every micro-batch instead of keeping the
//!   full accumulated gradient); the sink sums the reports.
//!
//! Invariants: buckets are disjoint, contiguous and cover the buffer; every rank launches the same
//! buckets in the same order (readiness order is deterministic), so the thread's collectives match
//! across ranks; `finish` fails if a bucket was never reported or only partly.

use std::ops::Range;
use std::time::{Duration, Instant};

use super::comm_worker::CommWorker;

use crate::comm::{block_range, Communicator, ReduceOp};
use crate::error::{Error, Result};

/// Most staging buffers (being filled or in flight) a sharded reducer holds at once.
pub const MAX_STAGED: usize = 4;

/// Buckets over the `units` (contiguous ranges in buffer order that partition it), each at most
/// `bucket_elems` long and inside one unit, in readiness order (last elements first).
pub fn plan_buckets(units: &[Range<usize>], bucket_elems: usize) -> Vec<Range<usize>> {
    let step = bucket_elems.max(1);
    let mut out = Vec::new();
    for u in units.iter().rev() {
        let mut end = u.end;
        while end > u.start {
            let start = end.saturating_sub(step).max(u.start);
            out.push(start..end);
            end = start;
        }
    }
    out
}

/// How a bucket is reduced over the data-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// Everyone gets the whole average (ZeRO-0).
    AllReduce,
    /// Everyone gets the average of its own block (ZeRO >= 1).
    ReduceScatter,
}

/// Reduces gradient buckets on a communication thread as they become final.
pub struct OverlapReducer {
    book: Ledger,
    /// Staging buffer of each bucket while it fills (AllReduce: also between steps).
    staging: Vec<Option<Vec<f32>>>,
    /// Free staging buffers (ReduceScatter).
    pool: Vec<Vec<f32>>,
    /// Staging buffers filling or in flight (ReduceScatter).
    staged: usize,
    in_flight: usize,
    worker: CommWorker<Vec<f32>>,
    /// First error of the communication thread, reported by `finish`.
    failed: Option<Error>,
}

/// Receives a reduced bucket: (bucket index, the flat range this rank owns, its averaged values,
/// whether it is the bucket's first result this step).
pub type BucketSink<'a> = dyn FnMut(usize, Range<usize>, &[f32], bool) -> Result<()> + 'a;

/// The bookkeeping the host and the device reducers share: which buckets a reported range
/// touches, how much of each has arrived, the launches and results of this step, and the block
/// this rank owns.
pub(super) struct Ledger {
    pub buckets: Vec<Range<usize>>,
    pub reduction: Reduction,
    /// (rank, size) in the data-parallel group.
    dp: (usize, usize),
    /// Elements of each bucket reported since its last launch.
    pub ready: Vec<usize>,
    /// Launches of each bucket this step.
    pub launches: Vec<usize>,
    /// Reduced results of each bucket received this step.
    pub received: Vec<usize>,
    /// 1 / micro-batches of this step.
    pub scale: f32,
    /// Time the communication thread spent in collectives this step.
    pub busy: Duration,
    /// A reported gradient held a NaN or an infinity this step (before the reduction).
    pub nonfinite: bool,
}

impl Ledger {
    pub fn new(buckets: Vec<Range<usize>>, reduction: Reduction, dp: (usize, usize)) -> Self {
        let k = buckets.len();
        let z = vec![0; k];
        Ledger { buckets, reduction, dp, ready: z.clone(), launches: z.clone(), received: z, scale: 1.0, busy: Duration::ZERO, nonfinite: false }
    }

    /// The part of bucket `b` this rank owns (all of it with [`Reduction::AllReduce`]).
    pub fn shard(&self, b: usize) -> Range<usize> {
        let r = self.buckets[b].clone();
        if self.reduction == Reduction::AllReduce {
            return r;
        }
        let blk = block_range(r.len(), self.dp.1, self.dp.0);
        r.start + blk.start..r.start + blk.end
    }

    /// Starts a step of `micro_batches` micro-batches.
    pub fn begin(&mut self, micro_batches: usize) {
        self.ready.iter_mut().for_each(|r| *r = 0);
        self.launches.iter_mut().for_each(|l| *l = 0);
        self.received.iter_mut().for_each(|l| *l = 0);
        self.scale = 1.0 / micro_batches.max(1) as f32;
        self.busy = Duration::ZERO;
        self.nonfinite = false;
    }

    /// The buckets the flat range `range` touches, with the part inside each, in bucket order;
    /// an all-reduced bucket reported again after its launch is an error.
    pub fn touched(&self, range: &Range<usize>) -> Vec<(usize, Range<usize>, Result<()>)> {
        let mut out = Vec::new();
        for (b, r) in self.buckets.iter().enumerate() {
            let (lo, hi) = (r.start.max(range.start), r.end.min(range.end));
            if lo >= hi {
                continue;
            }
            let ok = match self.reduction == Reduction::AllReduce && self.launches[b] > 0 {
                true => Err(Error::Check(format!("gradient bucket {b} reported twice in one step"))),
                false => Ok(()),
            };
            out.push((b, lo..hi, ok));
        }
        out
    }

    /// Counts `len` more elements of bucket `b`; true when it is complete (then launched).
    pub fn arrived(&mut self, b: usize, len: usize) -> bool {
        self.ready[b] += len;
        let full = self.ready[b] == self.buckets[b].len();
        if full {
            self.ready[b] = 0;
            self.launches[b] += 1;
        }
        full
    }

    /// Fails if a bucket was never launched this step or is partly reported.
    pub fn check_complete(&self) -> Result<()> {
        for (b, r) in self.buckets.iter().enumerate() {
            if self.launches[b] == 0 || self.ready[b] != 0 {
                return Err(Error::Check(format!(
                    "gradient bucket {b} ({r:?}): {} of {} elements reported after {} launches",
                    self.ready[b],
                    r.len(),
                    self.launches[b]
                )));
            }
        }
        Ok(())
    }
}

/// Timing of one step's gradient reduction.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReduceTiming {
    /// Time the communication thread spent reducing.
    pub comm: Duration,
    /// Time the caller waited in `finish` (communication not hidden behind backward).
    pub exposed: Duration,
}

impl OverlapReducer {
    /// A reducer of `buckets` (from [`plan_buckets`]) on `comm`, which the thread owns (give it a
    /// communicator no other thread uses).
    pub fn new(comm: Communicator, buckets: Vec<Range<usize>>, reduction: Reduction) -> Self {
        let dp = (comm.rank(), comm.size());
        let worker = CommWorker::spawn("meshtrain-grad-comm", "gradient communication", comm, move |c: &mut Communicator, data: &mut Vec<f32>| match reduction {
            Reduction::ReduceScatter => c.reduce_scatter(data, ReduceOp::Avg),
            Reduction::AllReduce => c.all_reduce(data, ReduceOp::Avg),
        });
        let sharded = reduction == Reduction::ReduceScatter;
        let staging = buckets.iter().map(|b| (!sharded).then(|| vec![0f32; b.len()])).collect();
        OverlapReducer { book: Ledger::new(buckets, reduction, dp), staging, pool: Vec::new(), staged: 0, in_flight: 0, worker, failed: None }
    }

    /// The part of bucket `b` this rank owns (all of it with [`Reduction::AllReduce`]).
    pub fn shard(&self, b: usize) -> Range<usize> {
        self.book.shard(b)
    }

    /// Starts a step whose gradients are averaged over `micro_batches` micro-batches.
    pub fn begin(&mut self, micro_batches: usize) {
        self.book.begin(micro_batches);
    }

    /// Records that the gradients `range` are final for this report with values `data`
    /// (`range.len()` of them) and launches every bucket that became complete. May wait for a
    /// reduced bucket when the staging pool is used up, handing it to `sink`; an error (of the
    /// communication thread or the sink) is kept for `finish`.
    pub fn on_final(&mut self, range: Range<usize>, data: &[f32], sink: &mut BucketSink) {
        debug_assert_eq!(range.len(), data.len());
        for (b, part, ok) in self.book.touched(&range) {
            if let Err(e) = ok {
                self.failed.get_or_insert(e);
                continue;
            }
            let r = self.book.buckets[b].clone();
            if self.staging[b].is_none() {
                let buf = self.take_staging(r.len(), sink);
                self.staging[b] = Some(buf);
            }
            let stage = self.staging[b].as_mut().expect("staged above");
            let src = &data[part.start - range.start..part.end - range.start];
            // Exponent bits all set: NaN or infinite (an OR of integers vectorizes with the copy).
            let mut bad = 0u32;
            for (d, s) in stage[part.start - r.start..part.end - r.start].iter_mut().zip(src) {
                *d = s * self.book.scale;
                bad |= u32::from(s.to_bits() & 0x7f80_0000 == 0x7f80_0000);
            }
            self.book.nonfinite |= bad != 0;
            if self.book.arrived(b, part.len()) {
                self.launch(b);
            }
        }
    }

    /// Whether a gradient reported this step was NaN or infinite (before the reduction).
    pub fn local_nonfinite(&self) -> bool {
        self.book.nonfinite
    }

    /// A staging buffer of `len` elements from the pool, waiting for a finished bucket if
    /// [`MAX_STAGED`] are out.
    fn take_staging(&mut self, len: usize, sink: &mut BucketSink) -> Vec<f32> {
        while self.staged >= MAX_STAGED && self.in_flight > 0 && self.failed.is_none() {
            if let Err(e) = self.receive_one(sink) {
                self.failed = Some(e);
            }
        }
        self.staged += 1;
        let mut buf = self.pool.pop().unwrap_or_default();
        buf.resize(len, 0.0);
        buf
    }

    fn launch(&mut self, b: usize) {
        let data = self.staging[b].take().expect("a launched bucket was staged");
        // A failed send means the thread stopped on an error, which `finish` reports.
        if self.worker.send(b, data).is_ok() {
            self.in_flight += 1;
        }
    }

    /// Waits for one reduced bucket and hands it to `sink`: its block (ReduceScatter, the buffer
    /// back to the pool) or all of it (AllReduce, the buffer kept as the bucket's staging).
    fn receive_one(&mut self, sink: &mut BucketSink) -> Result<()> {
        let (b, data, busy) = self.worker.recv()?;
        self.in_flight -= 1;
        self.book.busy += busy;
        self.book.received[b] += 1;
        let own = self.shard(b);
        let base = self.book.buckets[b].start;
        match self.book.reduction {
            Reduction::ReduceScatter => {
                let r = sink(b, own.clone(), &data[own.start - base..own.end - base], self.book.received[b] == 1);
                self.pool.push(data);
                self.staged -= 1;
                r
            }
            Reduction::AllReduce => {
                let r = sink(b, own, &data, true);
                self.staging[b] = Some(data);
                r
            }
        }
    }

    /// Waits for every launched bucket, handing each result not handed over yet to `sink` (in
    /// launch order), and checks that every bucket was reported whole.
    pub fn finish(&mut self, sink: &mut BucketSink) -> Result<ReduceTiming> {
        let t0 = Instant::now();
        while self.in_flight > 0 && self.failed.is_none() {
            if let Err(e) = self.receive_one(sink) {
                self.failed = Some(e);
            }
        }
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        self.book.check_complete()?;
        Ok(ReduceTiming { comm: self.book.busy, exposed: t0.elapsed() })
    }
}

/// Reduce-scattered blocks summed per bucket, as an optimizer's gradient shard sums them (the
/// reference in tests).
#[cfg(test)]
pub(crate) struct ShardSums(pub Vec<Vec<f32>>);

#[cfg(test)]
impl ShardSums {
    /// Zeroed sums of `red`'s owned blocks of its `buckets` buckets.
    pub fn new(red: &OverlapReducer, buckets: usize) -> Self {
        ShardSums((0..buckets).map(|b| vec![0.0; red.shard(b).len()]).collect())
    }

    /// A [`BucketSink`] body: sets (first) or adds bucket `b`'s block.
    pub fn add(&mut self, b: usize, block: &[f32], first: bool) -> Result<()> {
        match first {
            true => self.0[b].copy_from_slice(block),
            false => self.0[b].iter_mut().zip(block).for_each(|(s, x)| *s += x),
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one-unit bucket plans
mod tests {
    use super::*;
    use crate::comm::testing::run_ranks;
    use crate::comm::CommConfig;
    use crate::model::{Gpt, GptConfig};

    #[test]
    fn buckets_cover_the_buffer_backwards_within_units() {
        assert_eq!(plan_buckets(&[0..10], 4), vec![6..10, 2..6, 0..2]);
        assert_eq!(plan_buckets(&[0..3, 3..10], 4), vec![6..10, 3..6, 0..3]);
        assert!(plan_buckets(&[0..0], 4).is_empty());
    }

    #[test]
    fn model_reports_disjoint_final_ranges_covering_every_gradient() {
        let cfg = GptConfig::named("tiny").unwrap();
        let mut m = Gpt::<f32>::new(cfg, 2, 8, 1).unwrap();
        let tokens: Vec<u32> = (0..16).map(|i| (i * 7 % 200) as u32).collect();
        m.forward(&tokens, &tokens).unwrap();
        let mut seen: Vec<(Range<usize>, Vec<f32>)> = Vec::new();
        m.backward_with(&mut |r, g| seen.push((r.clone(), g.to_vec()))).unwrap();
        let mut covered = vec![0u8; m.grads().len()];
        for (r, snapshot) in &seen {
            r.clone().for_each(|i| covered[i] += 1);
            assert_eq!(&m.grads()[r.clone()], &snapshot[..], "range {r:?} changed after it was reported final");
        }
        assert!(covered.iter().all(|&c| c == 1));
    }

    /// Rank `rank`'s gradient `i` in report `k`.
    fn grad(i: usize, rank: usize, k: usize) -> f32 {
        (i % 17) as f32 + rank as f32 + 4.0 * k as f32
    }

    #[test]
    fn overlapped_reduction_equals_a_plain_average() {
        for (reduction, reports) in
            [(Reduction::AllReduce, 1), (Reduction::ReduceScatter, 1), (Reduction::ReduceScatter, 3)]
        {
            let results = run_ranks(3, CommConfig::default(), move |c| {
                let n = 1000;
                let thread_comm = c.split(Some(0), c.rank() as i64).unwrap().unwrap();
                // Two units; small buckets so that more than MAX_STAGED are in play.
                let buckets = plan_buckets(&[0..380, 380..n], 64);
                let mut red = OverlapReducer::new(thread_comm, buckets.clone(), reduction);
                let mut g = vec![0f32; n];
                let mut sums = ShardSums::new(&red, buckets.len());
                // Two steps: the second must not see anything of the first (reused staging,
                // shard accumulators).
                for _step in 0..2 {
                    red.begin(2);
                    for k in 0..reports {
                        let data: Vec<f32> = (0..n).map(|i| grad(i, c.rank(), k)).collect();
                        // Reported out of bucket order and in pieces, as a backward would.
                        let mut sink = |b, _, v: &[f32], first| sums.add(b, v, first);
                        red.on_final(600..n, &data[600..n], &mut sink);
                        red.on_final(0..300, &data[..300], &mut sink);
                        red.on_final(300..600, &data[300..600], &mut sink);
                    }
                    red.finish(&mut |b, r, v, first| match reduction {
                        Reduction::AllReduce => {
                            g[r].copy_from_slice(v);
                            Ok(())
                        }
                        Reduction::ReduceScatter => sums.add(b, v, first),
                    })
                    .unwrap();
                }
                (0..buckets.len())
                    .map(|b| {
                        let own = red.shard(b);
                        let v = if reduction == Reduction::AllReduce {
                            g[own.clone()].to_vec()
                        } else {
                            sums.0[b].clone()
                        };
                        (own, v)
                    })
                    .collect::<Vec<_>>()
            });
            for shards in results {
                let covered: usize = shards.iter().map(|(r, _)| r.len()).sum();
                if reduction == Reduction::AllReduce {
                    assert_eq!(covered, 1000);
                }
                for (own, v) in shards {
                    for (i, x) in own.zip(v) {
                        // Mean over ranks 0,1,2 of the reports' sum, times 1/2 for two micro-batches;
                        // every partial sum is an integer or half-integer, so this is exact.
                        let want: f32 = (0..reports).map(|k| grad(i, 1, k)).sum::<f32>() * 0.5;
                        assert_eq!(x, want, "{reduction:?} x{reports} i={i}");
                    }
                }
            }
        }
    }

    #[test]
    fn an_unreported_bucket_is_an_error_not_a_silent_zero() {
        let results = run_ranks(2, CommConfig::default(), |c| {
            let thread_comm = c.split(Some(0), c.rank() as i64).unwrap().unwrap();
            let mut red = OverlapReducer::new(thread_comm, plan_buckets(&[0..100], 40), Reduction::ReduceScatter);
            red.begin(1);
            let mut ignore = |_, _, _: &[f32], _| Ok(());
            red.on_final(30..100, &[1.0; 70], &mut ignore);
            red.finish(&mut ignore).map(|_| ()).map_err(|e| e.to_string())
        });
        for r in results {
            let e = r.unwrap_err();
            assert!(e.contains("gradient bucket 1 (20..60): 30 of 40 elements"), "{e}");
        }
    }
}
