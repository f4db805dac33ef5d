//! Bucketed gradient reduction overlapped with the backward pass.
//!
//! The flat gradient buffer is cut into buckets of about `bucket_mb` MB, from the end of the buffer
//! backwards (the order in which backward finishes gradients). The model reports each range of
//! gradients, with its values, as soon as it is final; the values are copied (scaled by
//! `1/grad_accum`) into the bucket's staging buffer, and when every element of a bucket has arrived
//! the buffer goes to a communication thread, which reduces it on its own communicator while the
//! backward goes on. [`OverlapReducer::finish`] waits for the last buckets and writes the results
//! back.
//!
//! Invariants: buckets are disjoint, contiguous and cover the buffer; every bucket is reduced
//! exactly once per step, in the same order on every rank (readiness order is deterministic);
//! with ZeRO >= 1 each bucket is reduce-scattered and this rank keeps block `dp_rank` of every
//! bucket ([`OverlapReducer::shard`]), which is the part its optimizer state covers.

use std::ops::Range;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::comm::{block_range, Communicator, ReduceOp};
use crate::error::{Error, Result};

/// Buckets over `n` elements, each at most `bucket_elems` long, in readiness order (last
/// elements first).
pub fn plan_buckets(n: usize, bucket_elems: usize) -> Vec<Range<usize>> {
    let step = bucket_elems.max(1);
    let mut out = Vec::new();
    let mut end = n;
    while end > 0 {
        let start = end.saturating_sub(step);
        out.push(start..end);
        end = start;
    }
    out
}

struct Job {
    bucket: usize,
    data: Vec<f32>,
}

struct Done {
    bucket: usize,
    data: Vec<f32>,
    busy: Duration,
}

/// Reduces gradient buckets on a communication thread as they become final.
pub struct OverlapReducer {
    buckets: Vec<Range<usize>>,
    /// Elements of each bucket reported final in this step.
    ready: Vec<usize>,
    /// Staging buffer of each bucket (absent while the thread holds it).
    staging: Vec<Option<Vec<f32>>>,
    launched: Vec<bool>,
    sharded: bool,
    dp_rank: usize,
    dp_size: usize,
    scale: f32,
    jobs: Option<Sender<Job>>,
    done: Receiver<Result<Done>>,
    thread: Option<JoinHandle<()>>,
    /// Time the communication thread spent in collectives this step.
    busy: Duration,
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
    /// A reducer for `n` gradients in buckets of `bucket_elems` on `comm` (which the thread owns;
    /// give it a communicator no other thread uses). `sharded` selects reduce-scatter (ZeRO >= 1)
    /// over all-reduce.
    pub fn new(comm: Communicator, n: usize, bucket_elems: usize, sharded: bool) -> Self {
        let buckets = plan_buckets(n, bucket_elems);
        let (dp_rank, dp_size) = (comm.rank(), comm.size());
        let (jobs_tx, jobs_rx) = channel::<Job>();
        let (done_tx, done_rx) = channel::<Result<Done>>();
        let thread = std::thread::Builder::new()
            .name("meshtrain-grad-comm".into())
            .spawn(move || {
                for mut job in jobs_rx {
                    let t0 = Instant::now();
                    let r = if sharded {
                        comm.reduce_scatter(&mut job.data, ReduceOp::Avg)
                    } else {
                        comm.all_reduce(&mut job.data, ReduceOp::Avg)
                    };
                    let out = r.map(|()| Done { bucket: job.bucket, data: job.data, busy: t0.elapsed() });
                    let failed = out.is_err();
                    if done_tx.send(out).is_err() || failed {
                        return;
                    }
                }
            })
            .expect("spawning the gradient communication thread");
        let k = buckets.len();
        let staging = buckets.iter().map(|b| Some(vec![0f32; b.len()])).collect();
        OverlapReducer {
            buckets,
            ready: vec![0; k],
            staging,
            launched: vec![false; k],
            sharded,
            dp_rank,
            dp_size,
            scale: 1.0,
            jobs: Some(jobs_tx),
            done: done_rx,
            thread: Some(thread),
            busy: Duration::ZERO,
        }
    }

    /// The buckets, in readiness order.
    pub fn buckets(&self) -> &[Range<usize>] {
        &self.buckets
    }

    /// The part of bucket `b` this rank owns (all of it without sharding).
    pub fn shard(&self, b: usize) -> Range<usize> {
        let r = self.buckets[b].clone();
        if !self.sharded {
            return r;
        }
        let blk = block_range(r.len(), self.dp_size, self.dp_rank);
        r.start + blk.start..r.start + blk.end
    }

    /// Starts a step whose gradients are sums over `micro_batches` micro-batches.
    pub fn begin(&mut self, micro_batches: usize) {
        self.ready.iter_mut().for_each(|r| *r = 0);
        self.launched.iter_mut().for_each(|l| *l = false);
        self.scale = 1.0 / micro_batches.max(1) as f32;
        self.busy = Duration::ZERO;
    }

    /// Records that the gradients `range` are final with values `data` (`range.len()` of them)
    /// and launches every bucket that became complete.
    pub fn on_final(&mut self, range: Range<usize>, data: &[f32]) {
        debug_assert_eq!(range.len(), data.len());
        for b in 0..self.buckets.len() {
            let r = self.buckets[b].clone();
            let (lo, hi) = (r.start.max(range.start), r.end.min(range.end));
            if lo >= hi {
                continue;
            }
            let stage = self.staging[b].as_mut().expect("a bucket is staged once per step");
            for (d, s) in stage[lo - r.start..hi - r.start].iter_mut().zip(&data[lo - range.start..hi - range.start]) {
                *d = s * self.scale;
            }
            self.ready[b] += hi - lo;
            if self.ready[b] == r.len() {
                self.launch(b);
            }
        }
    }

    fn launch(&mut self, b: usize) {
        self.launched[b] = true;
        let data = self.staging[b].take().expect("a bucket is launched once per step");
        if let Some(tx) = &self.jobs {
            // A closed channel means the thread stopped on an error, which `finish` reports.
            let _ = tx.send(Job { bucket: b, data });
        }
    }

    /// Launches what is left, waits for every bucket, and writes the reduced gradients back into
    /// `grads` (the owned part of each bucket when sharded).
    pub fn finish(&mut self, grads: &mut [f32]) -> Result<ReduceTiming> {
        let t0 = Instant::now();
        for b in 0..self.buckets.len() {
            if !self.launched[b] {
                let r = self.buckets[b].clone();
                let missing: Vec<f32> = grads[r.clone()].to_vec();
                self.ready[b] = 0;
                self.on_final(r, &missing);
            }
        }
        for _ in 0..self.buckets.len() {
            let done = self
                .done
                .recv()
                .map_err(|_| Error::Check("gradient communication thread stopped unexpectedly".into()))??;
            self.busy += done.busy;
            let dst = self.shard(done.bucket);
            let src = if self.sharded { dst.start - self.buckets[done.bucket].start..dst.end - self.buckets[done.bucket].start } else { 0..dst.len() };
            grads[dst].copy_from_slice(&done.data[src]);
            self.staging[done.bucket] = Some(done.data);
        }
        Ok(ReduceTiming { comm: self.busy, exposed: t0.elapsed() })
    }
}

impl Drop for OverlapReducer {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::testing::run_ranks;
    use crate::comm::CommConfig;
    use crate::model::{Gpt, GptConfig};

    #[test]
    fn buckets_cover_the_buffer_backwards() {
        let b = plan_buckets(10, 4);
        assert_eq!(b, vec![6..10, 2..6, 0..2]);
        assert!(plan_buckets(0, 4).is_empty());
    }

    #[test]
    fn model_reports_disjoint_final_ranges_covering_every_gradient() {
        let cfg = GptConfig::named("tiny").unwrap();
        let mut m = Gpt::<f32>::new(cfg, 2, 8, 1).unwrap();
        let tokens: Vec<u32> = (0..16).map(|i| (i * 7 % 200) as u32).collect();
        m.forward(&tokens, &tokens).unwrap();
        let mut seen: Vec<(Range<usize>, Vec<f32>)> = Vec::new();
        m.backward_with(&mut |r, g| seen.push((r.clone(), g[r].to_vec()))).unwrap();
        let mut covered = vec![0u8; m.grads().len()];
        for (r, snapshot) in &seen {
            r.clone().for_each(|i| covered[i] += 1);
            assert_eq!(&m.grads()[r.clone()], &snapshot[..], "range {r:?} changed after it was reported final");
        }
        assert!(covered.iter().all(|&c| c == 1));
    }

    #[test]
    fn overlapped_reduction_equals_a_plain_average() {
        for sharded in [false, true] {
            let results = run_ranks(3, CommConfig::default(), move |c| {
                let n = 1000;
                let grads: Vec<f32> = (0..n).map(|i| (i % 17) as f32 + c.rank() as f32).collect();
                let thread_comm = c.split(Some(0), c.rank() as i64).unwrap().unwrap();
                let mut red = OverlapReducer::new(thread_comm, n, 128, sharded);
                let mut g = grads.clone();
                red.begin(2);
                // Reported out of bucket order and in pieces, as a backward would.
                red.on_final(600..n, &g[600..n]);
                red.on_final(0..300, &g[..300]);
                red.on_final(300..600, &g[300..600]);
                red.finish(&mut g).unwrap();
                let owned: Vec<Range<usize>> = (0..red.buckets().len()).map(|b| red.shard(b)).collect();
                (g, owned)
            });
            for (g, owned) in results {
                for r in owned {
                    for i in r {
                        // mean over ranks 0,1,2 of (i%17 + rank), times 1/2 for two micro-batches.
                        assert_eq!(g[i], ((i % 17) as f32 + 1.0) * 0.5, "sharded={sharded} i={i}");
                    }
                }
            }
        }
    }
}
