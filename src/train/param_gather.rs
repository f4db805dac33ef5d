//! ZeRO-3 parameter gathering: each data-parallel rank keeps only its shard of every parameter
//! bucket resident, and a unit's parameters are all-gathered right before the model reads them,
//! the next unit prefetched on a communication thread.
//!
//! The flat parameter buffer keeps its full length and layout (offsets never change), but only
//! pages that hold something live are resident: the owned block of every bucket (the range the
//! optimizer updates, [`super::buckets::OverlapReducer::shard`]) and the units gathered for the
//! current and the next use. Releasing a unit zeroes its non-owned elements with
//! [`crate::memory::zero_release`], which hands their pages back to the OS.
//!
//! Invariants: buckets lie inside units, so a unit is gathered as whole buckets; every rank
//! acquires the same units in the same order (SPMD), so the thread's all-gathers match across the
//! group; the owned block of a bucket is never released or overwritten with other values; after
//! the optimizer step the caller releases everything ([`ParamGate::release_all`]), because
//! gathered copies of other ranks' blocks are then stale.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::comm_worker::CommWorker;

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::memory::zero_release;
use crate::model::ParamGate;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Residency {
    /// Only the owned block is resident.
    Released,
    /// An all-gather is on the communication thread.
    InFlight,
    /// The whole bucket holds current values.
    Resident,
}

/// Gathers parameter units on demand; see the module documentation.
pub struct ParamGather {
    buckets: Vec<Range<usize>>,
    /// Owned block of each bucket (absolute flat range).
    owned: Vec<Range<usize>>,
    /// Each unit with the buckets inside it.
    units: Vec<(Range<usize>, Vec<usize>)>,
    state: Vec<Residency>,
    in_flight: usize,
    /// Gathers a bucket (its buffer holds this rank's block) in place.
    worker: CommWorker,
    /// Nanoseconds the compute thread waited for gathers (shared with the training loop).
    waited_ns: Arc<AtomicU64>,
}

impl ParamGather {
    /// A gate over `buckets` (each inside one of `units`, which partition the buffer) whose owned
    /// blocks are `owned`, gathering on `comm` (owned by the thread; give it a communicator no
    /// other thread uses). Returns the gate and the counter of nanoseconds spent waiting.
    pub fn new(
        comm: Communicator,
        units: &[Range<usize>],
        buckets: Vec<Range<usize>>,
        owned: Vec<Range<usize>>,
    ) -> Result<(Self, Arc<AtomicU64>)> {
        let mut per_unit = Vec::with_capacity(units.len());
        for u in units {
            let inside: Vec<usize> =
                (0..buckets.len()).filter(|&b| buckets[b].start >= u.start && buckets[b].end <= u.end).collect();
            let covered: usize = inside.iter().map(|&b| buckets[b].len()).sum();
            if covered != u.len() {
                return Err(Error::Check(format!("parameter unit {u:?} is not exactly covered by buckets")));
            }
            per_unit.push((u.clone(), inside));
        }
        let worker = CommWorker::spawn("meshtrain-param-gather", "parameter gather", comm, |c, data| c.all_gather(data));
        let waited_ns = Arc::new(AtomicU64::new(0));
        let gate = ParamGather {
            state: vec![Residency::Released; buckets.len()],
            buckets,
            owned,
            units: per_unit,
            in_flight: 0,
            worker,
            waited_ns: waited_ns.clone(),
        };
        Ok((gate, waited_ns))
    }

    fn unit_buckets(&self, unit: &Range<usize>) -> Result<&[usize]> {
        self.units
            .iter()
            .find(|(u, _)| u == unit)
            .map(|(_, b)| &b[..])
            .ok_or_else(|| Error::Check(format!("{unit:?} is not a parameter unit of this gate")))
    }

    fn launch(&mut self, b: usize, params: &[f32]) -> Result<()> {
        let (r, own) = (self.buckets[b].clone(), self.owned[b].clone());
        let mut data = vec![0f32; r.len()];
        data[own.start - r.start..own.end - r.start].copy_from_slice(&params[own]);
        self.worker.send(b, data)?;
        self.state[b] = Residency::InFlight;
        self.in_flight += 1;
        Ok(())
    }

    /// Waits for one gathered bucket and copies it into `params` (or drops it when `keep` is
    /// false).
    fn receive_one(&mut self, params: &mut [f32], keep: bool) -> Result<()> {
        let (b, data, _) = self.worker.recv()?;
        self.in_flight -= 1;
        if keep {
            params[self.buckets[b].clone()].copy_from_slice(&data);
            self.state[b] = Residency::Resident;
        } else {
            self.state[b] = Residency::Released;
        }
        Ok(())
    }

    fn release_bucket(&mut self, b: usize, params: &mut [f32]) {
        let (r, own) = (self.buckets[b].clone(), self.owned[b].clone());
        zero_release(&mut params[r.start..own.start]);
        zero_release(&mut params[own.end..r.end]);
        self.state[b] = Residency::Released;
    }
}

impl ParamGate for ParamGather {
    fn acquire(&mut self, units: &[Range<usize>], next: &[Range<usize>], params: &mut [f32]) -> Result<()> {
        let mut wanted = Vec::new();
        for u in units {
            wanted.extend_from_slice(self.unit_buckets(u)?);
        }
        let mut prefetch = Vec::new();
        for u in next {
            prefetch.extend_from_slice(self.unit_buckets(u)?);
        }
        for b in 0..self.buckets.len() {
            if self.state[b] == Residency::Resident && !wanted.contains(&b) && !prefetch.contains(&b) {
                self.release_bucket(b, params);
            }
        }
        for &b in wanted.iter().chain(&prefetch) {
            if self.state[b] == Residency::Released {
                self.launch(b, params)?;
            }
        }
        let t0 = Instant::now();
        while wanted.iter().any(|&b| self.state[b] != Residency::Resident) {
            self.receive_one(params, true)?;
        }
        self.waited_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn release_all(&mut self, params: &mut [f32]) -> Result<()> {
        while self.in_flight > 0 {
            self.receive_one(params, false)?;
        }
        for b in 0..self.buckets.len() {
            self.release_bucket(b, params);
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init, clippy::needless_range_loop)] // unit lists; index = value
mod tests {
    use super::*;
    use crate::comm::testing::run_ranks;
    use crate::comm::{block_range, CommConfig};
    use crate::memory::rss_bytes;

    #[test]
    fn units_are_gathered_on_demand_and_released_to_the_owned_blocks() {
        let results = run_ranks(3, CommConfig::default(), |c| {
            let units = [0..10, 10..40, 40..41];
            let buckets = vec![40..41, 25..40, 10..25, 0..10];
            let owned: Vec<Range<usize>> = buckets
                .iter()
                .map(|r| {
                    let blk = block_range(r.len(), c.size(), c.rank());
                    r.start + blk.start..r.start + blk.end
                })
                .collect();
            // Each rank holds the true value (i + 1) only in its owned blocks.
            let mut params = vec![-1f32; 41];
            for o in &owned {
                o.clone().for_each(|i| params[i] = i as f32 + 1.0);
            }
            let comm = c.split(Some(0), c.rank() as i64).unwrap().unwrap();
            let (mut gate, _) = ParamGather::new(comm, &units, buckets, owned.clone()).unwrap();
            gate.release_all(&mut params).unwrap();
            let mut snapshots = Vec::new();
            gate.acquire(&[10..40], &[0..10], &mut params).unwrap();
            snapshots.push(params.clone());
            gate.acquire(&[0..10, 40..41], &[], &mut params).unwrap();
            snapshots.push(params.clone());
            (owned, snapshots)
        });
        for (owned, snaps) in results {
            let is_owned = |i: usize| owned.iter().any(|o| o.contains(&i));
            let want = |i: usize| i as f32 + 1.0;
            // After the first acquire: unit 10..40 complete; 0..10 prefetched may or may not have
            // landed; 40..41 only where owned (elsewhere released to zero).
            for i in 10..40 {
                assert_eq!(snaps[0][i], want(i), "i={i}");
            }
            assert_eq!(snaps[0][40], if is_owned(40) { want(40) } else { 0.0 });
            // After the second: 0..10 and 40..41 complete, 10..40 released to the owned blocks.
            for i in (0..10).chain(40..41) {
                assert_eq!(snaps[1][i], want(i), "i={i}");
            }
            for i in 10..40 {
                assert_eq!(snaps[1][i], if is_owned(i) { want(i) } else { 0.0 }, "i={i}");
            }
        }
    }

    #[test]
    fn releasing_gives_the_pages_back() {
        let results = run_ranks(2, CommConfig::default(), |c| {
            let n = 16 << 20; // 64 MiB of f32, one unit, one bucket per rank half
            let units = [0..n];
            let buckets = vec![0..n];
            let owned = vec![block_range(n, 2, c.rank())];
            let mut params = vec![1f32; n];
            let comm = c.split(Some(0), c.rank() as i64).unwrap().unwrap();
            let (mut gate, _) = ParamGather::new(comm, &units, buckets, owned).unwrap();
            gate.acquire(&[0..n], &[], &mut params).unwrap();
            let full = rss_bytes().unwrap();
            gate.release_all(&mut params).unwrap();
            let released = rss_bytes().unwrap();
            (full, released)
        });
        for (full, released) in results {
            // Each in-process rank gives back its non-owned 32 MiB half between its two readings
            // (the other rank shares the process, and its own release can only add to the drop).
            assert!(full > released + (24 << 20), "RSS {full} -> {released}");
        }
    }
}
