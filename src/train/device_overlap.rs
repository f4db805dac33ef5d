//! Bucketed gradient reduction overlapped with the backward, on device memory (cuda, hip, emu):
//! the device-memory counterpart of [`super::buckets::OverlapReducer`].
//!
//! As a unit's gradients become final during the backward (a pipeline stage: its whole buffer
//! after the round), the parts of every bucket they cover are packed on the compute queue into
//! that bucket's staging buffer and scaled by 1/micro-batches (the same f32 product as every
//! other path). When a bucket is complete the compute queue is synchronized and the bucket goes
//! to a communication thread, which owns a communicator of its own, a lane of the device
//! ([`Device::comm_lane`]: a second CUDA stream; on emu and the CPU a second handle) and the
//! device collectives' state for that pair. It reduces the bucket (average over the group),
//! synchronizes its lane and hands the buffer back, while the compute thread goes on with the
//! backward.
//!
//! Two reductions, as for host memory:
//! - [`Reduction::AllReduce`] (ZeRO-0): each bucket has a staging buffer of its own for the whole
//!   run (4Ψ bytes in all, the bucket copies every data-parallel framework keeps); the averaged
//!   buckets are handed to the caller at [`DeviceReducer::finish`], in launch order.
//! - [`Reduction::ReduceScatter`] (ZeRO >= 1): staging (a bucket and its block) comes from a pool
//!   of at most [`MAX_STAGED`]; every reduced block is handed to the caller's sink as soon as it
//!   is received (the pool's refill during the backward included), which adds it into the
//!   rank's gradient shard. No shard-sized copy is kept here.
//!
//! Invariants: buckets are disjoint, contiguous and cover the buffer; every rank launches the
//! same buckets in the same order, so the thread's collectives match across the group; a buffer
//! is touched by one queue at a time (the compute queue is synchronized before a launch and the
//! lane before the buffer comes back); `finish` fails if a bucket was never reported or only
//! partly; the arithmetic is the non-overlapped device step's, so results are the same bits.

use std::ops::Range;
use std::time::Instant;

use super::buckets::{Ledger, ReduceTiming, Reduction, MAX_STAGED};
use super::comm_worker::CommWorker;
use super::nonfinite::LocalFlag;
use crate::comm::device::{GpuCommConfig, GpuCommState};
use crate::comm::{Communicator, DType, ReduceOp};
use crate::device::ipc::alloc_shareable;
use crate::device::{ops, Device, DeviceBuffer};
use crate::error::{Error, Result};
use crate::model::DeviceGpt;

/// A staging buffer on its way through the communication thread.
pub struct Staged {
    buf: DeviceBuffer,   // (bucket) f32: the packed, scaled gradients; after an all-reduce their average
    block: DeviceBuffer, // (largest block) f32: this rank's averaged block after a reduce-scatter
    n: usize,
    /// The last job: release the thread's peer mappings (collective) instead of reducing.
    release: bool,
}

/// Receives a reduced bucket: (bucket index, its flat range this rank owns, the values from
/// element 0 of the buffer, whether it is the bucket's first result this step).
pub type DeviceSink<'a> = dyn FnMut(usize, Range<usize>, &DeviceBuffer, bool) -> Result<()> + 'a;

/// What the communication thread owns.
struct Lane {
    comm: Communicator,
    dev: Device,
    coll: GpuCommState,
    /// The path the first bucket took was logged.
    logged: bool,
}

/// Reduces device-memory gradient buckets on a communication thread as they become final.
pub struct DeviceReducer {
    book: Ledger,
    /// Staging of each bucket while it fills (AllReduce: also between launch and `finish`).
    staging: Vec<Option<Staged>>,
    /// Free staging (ReduceScatter).
    pool: Vec<Staged>,
    /// Staging allocated (ReduceScatter: at most MAX_STAGED).
    allocated: usize,
    /// Elements of the largest bucket and of the largest owned block (a pooled buffer fits any).
    largest: (usize, usize),
    in_flight: usize,
    worker: CommWorker<Staged>,
    /// Bytes of staging on the device.
    bytes: usize,
    /// This rank's packed gradients held a NaN or an infinity this step.
    flag: LocalFlag,
    failed: Option<Error>,
}

impl DeviceReducer {
    /// A reducer of `buckets` for `dev`'s buffers on `comm` (which the thread owns: give it a
    /// communicator no other thread uses), with the device collectives configured by `cfg`.
    pub fn new(dev: &Device, comm: Communicator, cfg: GpuCommConfig, buckets: Vec<Range<usize>>, reduction: Reduction) -> Result<Self> {
        let dp = (comm.rank(), comm.size());
        // No stream-ordered calls on the lane: their kernels wait for peers' flags, and on the
        // emu arm (launches take turns) one waiting there could hold up this rank's compute
        // queue, which a peer's may wait for in a tensor-parallel call.
        let cfg = GpuCommConfig { oneshot_bytes: 0, ..cfg };
        let lane = Lane { comm, dev: dev.comm_lane()?, coll: GpuCommState::new(cfg), logged: false };
        let worker = CommWorker::spawn("meshtrain-grad-comm", "gradient communication", lane, move |l: &mut Lane, job: &mut Staged| {
            l.dev.bind_thread()?;
            if job.release {
                return l.coll.release_mappings(&l.comm, &l.dev);
            }
            let mut c = l.coll.bind(&l.comm, &l.dev);
            match reduction {
                Reduction::AllReduce => c.all_reduce(&mut job.buf, job.n, DType::F32, ReduceOp::Avg)?,
                Reduction::ReduceScatter => c.reduce_scatter_into(&job.buf, &mut job.block, job.n, DType::F32, ReduceOp::Avg)?,
            }
            l.dev.synchronize()?;
            if !std::mem::replace(&mut l.logged, true) && l.comm.rank() == 0 {
                let (ipc, calls) = l.coll.path_counts();
                let path = if ipc == calls { "mapped peer memory (IPC)" } else { "staging through host memory" };
                log::info!("data-parallel gradient buckets over {} ranks, on a communication thread during the backward: {path}", l.comm.size());
            }
            Ok(())
        });
        let k = buckets.len();
        let mut red = DeviceReducer {
            book: Ledger::new(buckets, reduction, dp),
            staging: (0..k).map(|_| None).collect(),
            pool: Vec::new(),
            allocated: 0,
            largest: (0, 0),
            in_flight: 0,
            worker,
            bytes: 0,
            flag: LocalFlag::new(dev)?,
            failed: None,
        };
        let largest_block = (0..k).map(|b| red.shard(b).len()).max().unwrap_or(0);
        red.largest = (red.book.buckets.iter().map(|r| r.len()).max().unwrap_or(0), largest_block);
        if reduction == Reduction::AllReduce {
            for b in 0..k {
                let n = red.book.buckets[b].len();
                red.staging[b] = Some(red.alloc(dev, n, 0)?);
            }
        }
        Ok(red)
    }

    /// Shareable staging of `n` elements with a block of `block` (peers may map them).
    fn alloc(&mut self, dev: &Device, n: usize, block: usize) -> Result<Staged> {
        let buf = alloc_shareable(dev, n.max(1) * 4)?;
        let block = if block == 0 { dev.alloc(0)? } else { alloc_shareable(dev, block * 4)? };
        self.bytes += buf.len() + block.len();
        self.allocated += 1;
        Ok(Staged { buf, block, n, release: false })
    }

    /// Device bytes of the staging buffers allocated so far (ReduceScatter: at most
    /// [`MAX_STAGED`] buckets and blocks).
    pub fn device_bytes(&self) -> usize {
        self.bytes
    }

    /// The part of bucket `b` this rank owns (all of it with [`Reduction::AllReduce`]).
    pub fn shard(&self, b: usize) -> Range<usize> {
        self.book.shard(b)
    }

    /// Starts a step whose gradients are averaged over `micro_batches` micro-batches.
    pub fn begin(&mut self, micro_batches: usize) {
        self.book.begin(micro_batches);
    }

    /// Packs `model`'s gradients of the flat range `range` (final for this report) into their
    /// buckets' staging and launches every bucket that became complete. May wait for a reduced
    /// bucket when the staging pool is used up, handing it to `sink`; errors of the
    /// communication thread are kept for `finish`, errors of the packing returned.
    pub fn on_final(&mut self, model: &DeviceGpt, range: Range<usize>, sink: &mut DeviceSink) -> Result<()> {
        let dev = model.device();
        for (b, part, ok) in self.book.touched(&range) {
            if let Err(e) = ok {
                self.failed.get_or_insert(e);
                continue;
            }
            if self.staging[b].is_none() {
                let s = self.take_staging(dev, b, sink)?;
                self.staging[b] = Some(s);
            }
            let at = part.start - self.book.buckets[b].start;
            let stage = self.staging[b].as_mut().expect("staged above");
            model.pack_grads_at(part.clone(), &mut stage.buf, at)?;
            if self.book.scale != 1.0 {
                // The host reducer's staging copy multiplies by the same f32 factor.
                ops::scale(dev, &mut stage.buf, at, part.len(), self.book.scale)?;
            }
            self.flag.mark(dev, &stage.buf, at, part.len())?;
            if self.book.arrived(b, part.len()) {
                // The packing is queued on the compute queue: it must be done before the lane reads.
                dev.synchronize()?;
                self.launch(b);
            }
        }
        Ok(())
    }

    /// Staging for bucket `b` (ReduceScatter): from the pool, newly allocated while fewer than
    /// [`MAX_STAGED`] exist, else the next reduced bucket's once `sink` has taken its block.
    fn take_staging(&mut self, dev: &Device, b: usize, sink: &mut DeviceSink) -> Result<Staged> {
        let (n, block) = (self.book.buckets[b].len(), self.shard(b).len());
        while self.pool.is_empty() && self.allocated >= MAX_STAGED && self.in_flight > 0 && self.failed.is_none() {
            if let Err(e) = self.receive_one(sink) {
                self.failed = Some(e);
            }
        }
        let mut s = match self.pool.pop() {
            Some(s) => s,
            // Every pooled buffer fits the largest bucket, so any bucket can reuse it.
            None => self.alloc(dev, self.largest.0, self.largest.1.max(1))?,
        };
        s.n = n;
        debug_assert!(s.block.len() >= block * 4);
        Ok(s)
    }

    fn launch(&mut self, b: usize) {
        let data = self.staging[b].take().expect("a launched bucket was staged");
        // A failed send means the thread stopped on an error, which `finish` reports.
        if self.worker.send(b, data).is_ok() {
            self.in_flight += 1;
        }
    }

    /// Waits for one reduced bucket and returns its index: ReduceScatter hands its block to
    /// `sink` and returns the staging to the pool; AllReduce keeps it for `finish`.
    fn receive_one(&mut self, sink: &mut DeviceSink) -> Result<usize> {
        let (b, data, busy) = self.worker.recv()?;
        self.in_flight -= 1;
        self.book.busy += busy;
        self.book.received[b] += 1;
        match self.book.reduction {
            Reduction::ReduceScatter => {
                let r = sink(b, self.shard(b), &data.block, self.book.received[b] == 1);
                self.pool.push(data);
                r.map(|()| b)
            }
            Reduction::AllReduce => {
                self.staging[b] = Some(data);
                Ok(b)
            }
        }
    }

    /// Waits for every launched bucket, hands each to `sink` (AllReduce: all of them now, in
    /// launch order; ReduceScatter: those not handed over yet) and checks that every bucket was
    /// reported whole.
    pub fn finish(&mut self, sink: &mut DeviceSink) -> Result<ReduceTiming> {
        let t0 = Instant::now();
        let mut order = Vec::new();
        while self.in_flight > 0 && self.failed.is_none() {
            match self.receive_one(sink) {
                Ok(b) => order.push(b),
                Err(e) => self.failed = Some(e),
            }
        }
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        let exposed = t0.elapsed();
        self.book.check_complete()?;
        if self.book.reduction == Reduction::AllReduce {
            for b in order {
                let s = self.staging[b].as_ref().expect("a received all-reduce bucket is kept");
                sink(b, self.book.buckets[b].clone(), &s.buf, true)?;
            }
        }
        Ok(ReduceTiming { comm: self.book.busy, exposed })
    }

    /// Whether this rank's gradients packed this step held a NaN or an infinity (before the
    /// reduction); clears the flag.
    pub fn take_nonfinite(&mut self, dev: &Device) -> Result<bool> {
        self.flag.take(dev)
    }

    /// Releases the thread's peer mappings (collective over the group; before buffers are freed).
    pub fn release(&mut self, dev: &Device) -> Result<()> {
        let job = Staged { buf: dev.alloc(0)?, block: dev.alloc(0)?, n: 0, release: true };
        self.worker.send(usize::MAX, job)?;
        self.worker.recv().map(|_| ())
    }
}
