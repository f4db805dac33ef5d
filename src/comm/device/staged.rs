//! Path B: device collectives staged through host memory, chunk by chunk, over the host
//! communicator.
//!
//! Every collective is one call of [`pipeline`] with a plan: how many chunks, which byte ranges
//! of the input buffer each chunk downloads into a staging slot, the host collective it runs on
//! the slot, and which slot ranges it uploads into the output buffer. Two slots alternate, so the
//! downloads of chunk `i + 1` (and the uploads of chunk `i - 1`) run on the device while the host
//! collective of chunk `i` runs on the network; [`Staging`] refuses host access to a slot whose
//! copies may be in flight, so correctness never depends on timing. The CPU arm runs the same
//! code with copies that are `memcpy`.
//!
//! Chunking keeps every host call a valid collective on every rank: flat calls (all-reduce,
//! broadcast, reduce, send/recv) cut the element range into equal pieces; calls on blocks
//! (reduce-scatter, all-gather, all-to-all) take piece `c` of every block (`block_range` blocks
//! of `n`), `m` elements each (fewer at the end). Such pieces again differ by at most one element,
//! longer first, so they are exactly the `block_range` blocks of their concatenation, and the host
//! collective on the concatenation moves each piece where the whole call would have. The chunk
//! count depends only on (n, ranks, element size, chunk size), the same on every rank.
//!
//! As a path ([`Staged`]) it takes every call, so it is the last of every [`super::path::order`].

use std::ops::Range;

use super::path::{DeviceCall, DevicePath, PathCtx};
use crate::comm::device::{Bufs, Op};
use crate::comm::{block_range, Communicator, DType, Element, ReduceOp};
use crate::device::pinned::Staging;
use crate::device::Device;
use crate::error::Result;

/// Copies of one chunk: (buffer byte offset, slot byte offset, bytes).
type Copies = Vec<(usize, usize, usize)>;

/// The host collective a chunk runs on its slot (byte ranges of the slot).
#[derive(Clone)]
pub(crate) enum HostCall {
    AllReduce(Range<usize>, ReduceOp),
    Broadcast(Range<usize>, usize),
    Reduce(Range<usize>, ReduceOp, usize),
    Send(Range<usize>, usize),
    Recv(Range<usize>, usize),
    ReduceScatter { input: Range<usize>, output: Range<usize>, op: ReduceOp },
    AllGather { input: Range<usize>, output: Range<usize> },
    AllToAll { input: Range<usize>, output: Range<usize> },
}

fn typed<T: Element>(b: &mut [u8]) -> &mut [T] {
    bytemuck::cast_slice_mut(b)
}

/// `input` and `output` of one slot (input first, disjoint).
fn split<'s>(slot: &'s mut [u8], input: &Range<usize>, output: &Range<usize>) -> (&'s mut [u8], &'s mut [u8]) {
    let (a, b) = slot.split_at_mut(output.start);
    (&mut a[input.clone()], &mut b[..output.len()])
}

fn host_call<T: Element>(comm: &Communicator, call: &HostCall, slot: &mut [u8]) -> Result<()> {
    match call {
        HostCall::AllReduce(r, op) => comm.all_reduce(typed::<T>(&mut slot[r.clone()]), *op),
        HostCall::Broadcast(r, root) => comm.broadcast(typed::<T>(&mut slot[r.clone()]), *root),
        HostCall::Reduce(r, op, root) => comm.reduce(typed::<T>(&mut slot[r.clone()]), *op, *root),
        HostCall::Send(r, peer) => comm.send(typed::<T>(&mut slot[r.clone()]), *peer),
        HostCall::Recv(r, peer) => comm.recv_into(typed::<T>(&mut slot[r.clone()]), *peer),
        HostCall::ReduceScatter { input, output, op } => {
            let (i, o) = split(slot, input, output);
            comm.reduce_scatter_into(typed::<T>(i), typed::<T>(o), *op)
        }
        HostCall::AllGather { input, output } => {
            let (i, o) = split(slot, input, output);
            comm.all_gather_into(typed::<T>(i), typed::<T>(o))
        }
        HostCall::AllToAll { input, output } => {
            let (i, o) = split(slot, input, output);
            comm.all_to_all_into(typed::<T>(i), typed::<T>(o))
        }
    }
}

/// Runs `call` on the slot with the element type `dtype`.
fn run_host(comm: &Communicator, dtype: DType, call: &HostCall, slot: &mut [u8]) -> Result<()> {
    use half::{bf16, f16};
    match dtype {
        DType::F32 => host_call::<f32>(comm, call, slot),
        DType::F64 => host_call::<f64>(comm, call, slot),
        DType::BF16 => host_call::<bf16>(comm, call, slot),
        DType::F16 => host_call::<f16>(comm, call, slot),
        DType::I32 => host_call::<i32>(comm, call, slot),
        DType::I64 => host_call::<i64>(comm, call, slot),
        DType::U8 => host_call::<u8>(comm, call, slot),
    }
}

/// One staged collective: its chunks and what each does.
pub(crate) struct Plan<D, H, U> {
    pub chunks: usize,
    /// Staging bytes each slot needs.
    pub slot_bytes: usize,
    /// Downloads of chunk `c` from the input buffer.
    pub down: D,
    /// The host collective of chunk `c`.
    pub host: H,
    /// Uploads of chunk `c` into the output buffer.
    pub up: U,
}

/// Runs `plan` double-buffered (see the module header).
pub(crate) fn pipeline<D, H, U>(
    comm: &Communicator,
    dev: &Device,
    stage: &mut Staging,
    dtype: DType,
    bufs: &mut Bufs,
    plan: Plan<D, H, U>,
) -> Result<()>
where
    D: Fn(usize, &mut Copies),
    H: Fn(usize) -> HostCall,
    U: Fn(usize, &mut Copies),
{
    let mut copies = Copies::new();
    let mut download = |c: usize, s: usize, stage: &mut Staging, bufs: &mut Bufs| -> Result<()> {
        copies.clear();
        (plan.down)(c, &mut copies);
        copies.iter().try_for_each(|&(b, at, len)| stage.download(dev, s, at, bufs.input()?, b, len))
    };
    if plan.chunks > 0 {
        download(0, 0, stage, bufs)?;
    }
    let mut ups = Copies::new();
    for c in 0..plan.chunks {
        let s = c % 2;
        if c + 1 < plan.chunks {
            download(c + 1, 1 - s, stage, bufs)?;
        }
        stage.wait(dev, s)?;
        run_host(comm, dtype, &(plan.host)(c), stage.host(s)?)?;
        ups.clear();
        (plan.up)(c, &mut ups);
        for &(b, at, len) in &ups {
            stage.upload(dev, s, at, bufs.output()?, b, len)?;
        }
    }
    stage.wait(dev, 0)?;
    stage.wait(dev, 1)
}

/// The staged path: the staging memory (grown to the largest plan so far) and the plans of every
/// operation.
#[derive(Default)]
pub(crate) struct Staged {
    staging: Option<Staging>,
}

impl DevicePath for Staged {
    fn name(&self) -> &'static str {
        "staged"
    }

    fn try_call(&mut self, cx: &mut PathCtx, call: &mut DeviceCall) -> Result<bool> {
        let (k, me, es, chunk) = (cx.comm.size(), cx.comm.rank(), call.dtype.size(), cx.cfg.stage_chunk);
        let blocked = Blocked::new(call.n, k, es, chunk);
        match call.op {
            Op::AllReduce(o) => self.flat(cx, call, (true, true), &|r| HostCall::AllReduce(r, o)),
            Op::Broadcast(root) => self.flat(cx, call, (me == root, me != root), &|r| HostCall::Broadcast(r, root)),
            Op::Reduce(o, root) => self.flat(cx, call, (true, me == root), &|r| HostCall::Reduce(r, o, root)),
            Op::Send(peer) => self.flat(cx, call, (true, false), &|r| HostCall::Send(r, peer)),
            Op::Recv(peer) => self.flat(cx, call, (false, true), &|r| HostCall::Recv(r, peer)),
            Op::ReduceScatter(o) => self.reduce_scatter(cx, call, blocked, o),
            Op::AllGather => self.all_gather(cx, call, blocked),
            Op::AllToAll => self.all_to_all(cx, call, blocked),
        }?;
        Ok(true)
    }
}

impl Staged {
    /// A staged call on the whole element range, chunk by chunk: `(down, up)` says whether this
    /// rank downloads its input and uploads the result; `host` makes the host call of a chunk's
    /// slot bytes.
    fn flat(
        &mut self,
        cx: &PathCtx,
        call: &mut DeviceCall,
        (down, up): (bool, bool),
        host: &dyn Fn(Range<usize>) -> HostCall,
    ) -> Result<()> {
        let flat = &Flat::new(call.n, call.dtype.size(), cx.cfg.stage_chunk);
        let copy = |on: bool| {
            move |c: usize, out: &mut Vec<_>| {
                if on {
                    flat.copy(c, out)
                }
            }
        };
        let plan = Plan {
            chunks: flat.chunks(),
            slot_bytes: flat.per * flat.esize,
            down: copy(down),
            host: |c: usize| host(0..flat.bytes(c).len()),
            up: copy(up),
        };
        self.stage(cx, call, plan)
    }

    fn reduce_scatter(&mut self, cx: &PathCtx, call: &mut DeviceCall, blk: Blocked, op: ReduceOp) -> Result<()> {
        let (me, out_at) = (cx.comm.rank(), blk.all_bytes());
        let mine = |c: usize| blk.piece(me, c);
        let plan = Plan {
            chunks: blk.chunks(),
            slot_bytes: out_at + blk.m * blk.esize,
            down: |c: usize, out: &mut Vec<_>| {
                out.extend((0..blk.k).map(|b| (blk.piece_bytes(b, c).start, blk.packed_at(b, c), blk.piece_bytes(b, c).len())))
            },
            host: |c: usize| HostCall::ReduceScatter {
                input: 0..blk.packed_bytes(c),
                output: out_at..out_at + mine(c).len() * blk.esize,
                op,
            },
            up: |c: usize, out: &mut Vec<_>| out.push((mine(c).start * blk.esize, out_at, mine(c).len() * blk.esize)),
        };
        self.stage(cx, call, plan)
    }

    fn all_gather(&mut self, cx: &PathCtx, call: &mut DeviceCall, blk: Blocked) -> Result<()> {
        let (me, out_at) = (cx.comm.rank(), blk.m * blk.esize);
        let mine = |c: usize| blk.piece(me, c);
        let plan = Plan {
            chunks: blk.chunks(),
            slot_bytes: out_at + blk.all_bytes(),
            down: |c: usize, out: &mut Vec<_>| out.push((mine(c).start * blk.esize, 0, mine(c).len() * blk.esize)),
            host: |c: usize| HostCall::AllGather {
                input: 0..mine(c).len() * blk.esize,
                output: out_at..out_at + blk.packed_bytes(c),
            },
            up: |c: usize, out: &mut Vec<_>| {
                out.extend((0..blk.k).map(|b| (blk.piece_bytes(b, c).start, out_at + blk.packed_at(b, c), blk.piece_bytes(b, c).len())))
            },
        };
        self.stage(cx, call, plan)
    }

    fn all_to_all(&mut self, cx: &PathCtx, call: &mut DeviceCall, blk: Blocked) -> Result<()> {
        let (me, k, es, out_at) = (cx.comm.rank(), blk.k, blk.esize, blk.all_bytes());
        let slot_len = block_range(blk.n, k, me).len();
        let mine = |c: usize| blk.piece(me, c);
        let plan = Plan {
            chunks: blk.chunks(),
            slot_bytes: 2 * out_at,
            down: |c: usize, out: &mut Vec<_>| {
                out.extend((0..k).map(|b| (blk.piece_bytes(b, c).start, blk.packed_at(b, c), blk.piece_bytes(b, c).len())))
            },
            host: |c: usize| HostCall::AllToAll { input: 0..blk.packed_bytes(c), output: out_at..out_at + k * mine(c).len() * es },
            up: |c: usize, out: &mut Vec<_>| {
                let p = mine(c);
                out.extend((0..k).map(|s| ((s * slot_len + p.start) * es, out_at + s * p.len() * es, p.len() * es)))
            },
        };
        self.stage(cx, call, plan)
    }

    /// Runs a plan, growing the staging memory to what it needs first.
    fn stage<D, H, U>(&mut self, cx: &PathCtx, call: &mut DeviceCall, plan: Plan<D, H, U>) -> Result<()>
    where
        D: Fn(usize, &mut Vec<(usize, usize, usize)>),
        H: Fn(usize) -> HostCall,
        U: Fn(usize, &mut Vec<(usize, usize, usize)>),
    {
        if self.staging.as_ref().is_none_or(|s| s.slot_bytes() < plan.slot_bytes) {
            self.staging = None;
            self.staging = Some(Staging::new(cx.dev, plan.slot_bytes)?);
        }
        let stage = self.staging.as_mut().expect("allocated above");
        pipeline(cx.comm, cx.dev, stage, call.dtype, &mut call.bufs, plan)
    }
}

/// Chunks of a flat `n`-element call: `per` elements each (the last may be shorter).
pub(crate) struct Flat {
    pub n: usize,
    pub per: usize,
    pub esize: usize,
}

impl Flat {
    pub fn new(n: usize, esize: usize, chunk_bytes: usize) -> Flat {
        Flat { n, per: (chunk_bytes / esize).max(1), esize }
    }

    pub fn chunks(&self) -> usize {
        self.n.div_ceil(self.per)
    }

    /// Byte range of chunk `c` in the buffer.
    pub fn bytes(&self, c: usize) -> Range<usize> {
        let start = c * self.per;
        start * self.esize..(start + self.per).min(self.n) * self.esize
    }

    /// The copy of chunk `c` between the buffer and the start of the slot.
    pub fn copy(&self, c: usize, out: &mut Copies) {
        let r = self.bytes(c);
        out.push((r.start, 0, r.len()));
    }
}

/// Chunks of a call on the `k` blocks of `n` elements: piece `c` of each block, `m` elements.
pub(crate) struct Blocked {
    pub n: usize,
    pub k: usize,
    pub m: usize,
    pub esize: usize,
}

impl Blocked {
    pub fn new(n: usize, k: usize, esize: usize, chunk_bytes: usize) -> Blocked {
        Blocked { n, k, m: (chunk_bytes / (k * esize)).max(1), esize }
    }

    pub fn chunks(&self) -> usize {
        block_range(self.n, self.k, 0).len().div_ceil(self.m)
    }

    /// Elements of piece `c` of block `b`, relative to the block's start.
    pub fn piece(&self, b: usize, c: usize) -> Range<usize> {
        let len = block_range(self.n, self.k, b).len();
        (c * self.m).min(len)..((c + 1) * self.m).min(len)
    }

    /// Byte range of piece `c` of block `b` in the whole `n`-element buffer.
    pub fn piece_bytes(&self, b: usize, c: usize) -> Range<usize> {
        let (start, p) = (block_range(self.n, self.k, b).start, self.piece(b, c));
        (start + p.start) * self.esize..(start + p.end) * self.esize
    }

    /// Bytes of the largest concatenation of pieces (`k * m` elements).
    pub fn all_bytes(&self) -> usize {
        self.k * self.m * self.esize
    }

    /// Byte offset of piece `c` of block `b` within the concatenation of chunk `c`'s pieces.
    pub fn packed_at(&self, b: usize, c: usize) -> usize {
        (0..b).map(|x| self.piece(x, c).len()).sum::<usize>() * self.esize
    }

    /// Bytes of the concatenation of chunk `c`'s pieces.
    pub fn packed_bytes(&self, c: usize) -> usize {
        self.packed_at(self.k, c)
    }
}
