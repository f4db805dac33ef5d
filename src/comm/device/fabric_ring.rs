//! Path D: device all-reduce, reduce-scatter, all-gather and broadcast as rings whose every hop
//! is a device-direct libfabric transfer (FI_HMEM), so collectives between nodes never copy
//! through host memory.
//!
//! When: member `r` sends to `r + 1` and receives from `r - 1` (mod `k`), and both of those links
//! go direct ([`crate::transport::DirectPeer::choice`]) on every member, on the CUDA, HIP or emu
//! arm, with `k >= 2` and a non-empty call. The members agree once per state with an all-gather
//! of one byte each over the host communicator, so all take the rings or none does; the outcome
//! is logged once. With `MESHTRAIN_TRANSPORT=auto`, links within a node are shared memory, not
//! libfabric, so rings need `MESHTRAIN_TRANSPORT=ofi` (or a single rank per node). Reduce and
//! all-to-all stay staged.
//!
//! Schedules (block `b` is `block_range(n, k, b)`; a hop posts the send to the next member and
//! the receive from the previous one together, [`direct_transfer`]):
//! - all-reduce, in place: for each piece (at most a slot of `MESHTRAIN_GPU_STAGE_CHUNK` bytes)
//!   of the blocks, steps `s = 0..k-1` send block `r - s` and receive block `r - s - 1` into the
//!   landing slot, which a kernel reduces into the buffer; member `r` then holds block `r + 1`
//!   complete (`Avg` divides it). Then steps send block `r + 1 - s` and receive block `r - s`
//!   straight into the buffer.
//! - reduce-scatter: the same steps shifted by one, so that member `r` ends with block `r`. The
//!   input is only read: each step reduces (own input piece, landed piece) into the accumulator
//!   slot that the next step sends, the last step into the output.
//! - all-gather: the own block copied into place, then `k - 1` steps forwarding whole blocks.
//! - broadcast: a chain from the root, in pieces: each member receives piece `t` while it
//!   forwards piece `t - 1`.
//!
//! Every call starts with a hop of the call's fingerprint (kind, type, operator, root, count,
//! collective number) from host memory: each member checks its previous one's, so a member in
//! another call is an error naming both calls on every member before any data moves (a mismatch
//! ahead of it, in the order of direct messages, shows up as a message of the wrong size or a
//! silent peer: an error naming the peer within the deadline). Every hop first waits for the
//! device (a kernel's output is sent, or a kernel may still read what a receive overwrites).

use std::ops::Range;
use std::sync::Arc;

use super::p2p::{device_memory, Memory, Registrations};
use super::path::{DeviceCall, DevicePath, PathCtx};
use super::{Bufs, Op};
use crate::comm::fingerprint::{self, OpKind, OpPrint, PRINT_LEN};
use crate::comm::{block_range, Communicator, DType, ReduceOp};
use crate::device::ipc::{part, part_mut};
use crate::device::{ops, Device, DeviceBuffer};
use crate::error::{Error, Result};
use crate::transport::select::GpuDirect;
use crate::transport::{direct_transfer, DirectLeg, DirectPeer, MemIface, Waiter};

/// The rings' state of one (communicator, device) pair.
pub(crate) struct RingState {
    /// Whether every member's ring links go direct (agreed at the first call that could use them).
    agreed: Option<bool>,
    /// Where received pieces land before a kernel reduces them (`slot` bytes).
    land: Option<DeviceBuffer>,
    /// Reduce-scatter's partial sums, sent by the next step (`slot` bytes).
    acc: Option<DeviceBuffer>,
    /// Host memory of the fingerprint hop: this call's print, then the previous member's.
    prints: Box<[u8; 2 * PRINT_LEN]>,
    calls: u64,
}

impl Default for RingState {
    fn default() -> Self {
        RingState { agreed: None, land: None, acc: None, prints: Box::new([0; 2 * PRINT_LEN]), calls: 0 }
    }
}

impl RingState {
    /// Collective calls that ran as rings so far.
    pub(crate) fn calls(&self) -> u64 {
        self.calls
    }
}

impl DevicePath for RingState {
    fn name(&self) -> &'static str {
        "fabric-ring"
    }

    /// Runs the call as a ring when every member's ring links go direct; `Ok(false)`: the next
    /// path. A piece is at most `MESHTRAIN_GPU_STAGE_CHUNK` bytes.
    fn try_call(&mut self, cx: &mut PathCtx, call: &mut DeviceCall) -> Result<bool> {
        let (comm, dev, regs, mode, slot) = (cx.comm, cx.dev, &mut *cx.regs, cx.cfg.gpu_direct, cx.cfg.stage_chunk);
        let DeviceCall { op, bufs, n, dtype } = call;
        let (op, n, dtype) = (*op, *n, *dtype);
        let k = comm.size();
        let ringed = matches!(op, Op::AllReduce(_) | Op::ReduceScatter(_) | Op::AllGather | Op::Broadcast(_));
        if k < 2 || n == 0 || !ringed || matches!(dev, Device::Cpu) {
            return Ok(false);
        }
        let (me, es) = (comm.rank(), dtype.size());
        let (next, prev) = ((me + 1) % k, (me + k - 1) % k);
        if self.agreed.is_none() {
            self.agreed = Some(agree(mode, comm, next, prev)?);
        }
        if self.agreed != Some(true) {
            return Ok(false);
        }
        let link = |p: usize| -> Result<Arc<DirectPeer>> {
            comm.direct_peer(p)?.ok_or_else(|| Error::Fabric(format!("device ring: the link with member {p} is no longer direct")))
        };
        let (next, prev) = (link(next)?, link(prev)?);
        if matches!(op, Op::AllReduce(_) | Op::ReduceScatter(_)) && self.land.is_none() {
            self.land = Some(dev.alloc(slot)?);
        }
        if matches!(op, Op::ReduceScatter(_)) && self.acc.is_none() {
            self.acc = Some(dev.alloc(slot)?);
        }
        let (input, output) = match bufs {
            Bufs::InPlace(b) => (device_memory(dev, b)?, device_memory(dev, b)?),
            Bufs::Split(i, o) => (device_memory(dev, i)?, device_memory(dev, o)?),
            Bufs::ReadOnly(_) => return Ok(false),
        };
        let land = self.land.as_ref().map(|b| device_memory(dev, b)).transpose()?;
        let acc = self.acc.as_ref().map(|b| device_memory(dev, b)).transpose()?;
        // What the schedule hands to the NIC (the rest is only touched by kernels).
        let prints: Memory = (self.prints.as_mut_ptr(), self.prints.len(), MemIface::System);
        let want: Vec<Memory> = match op {
            Op::ReduceScatter(_) => [Some(input), land, acc].into_iter().flatten().collect(),
            Op::AllReduce(_) => [Some(output), land].into_iter().flatten().collect(),
            _ => vec![output],
        };
        let want = [want, vec![prints]].concat();
        regs.ensure(&next, &want, "device ring")?;
        let (name, print) = describe(op, dtype, n);
        let regs = &*regs;
        comm.run_direct_collective(name, print, n * es, |w, numbered| {
            let ring = Ring { next: &next, prev: &prev, regs, w, dev, k, me, n, dtype, piece: (slot / es).max(1) };
            // The fingerprint hop: this call's print to the next member, the previous one's back.
            self.prints[..PRINT_LEN].copy_from_slice(&numbered.encode());
            ring.hop(Some((prints, 0..PRINT_LEN)), Some((prints, PRINT_LEN..2 * PRINT_LEN)))?;
            ring.check_print(comm, numbered, &self.prints[PRINT_LEN..])?;
            let land = || self.land.as_ref().zip(land).ok_or_else(|| missing("landing"));
            match (op, bufs) {
                (Op::AllReduce(o), Bufs::InPlace(b)) => ring.all_reduce(b, output, land()?, o),
                (Op::ReduceScatter(o), Bufs::Split(i, out)) => {
                    let acc = self.acc.as_mut().zip(acc).ok_or_else(|| missing("accumulator"))?;
                    ring.reduce_scatter((*i, input), out, land()?, acc, o)
                }
                (Op::AllGather, Bufs::Split(i, out)) => ring.all_gather(i, out, output),
                (Op::Broadcast(root), Bufs::InPlace(_)) => ring.broadcast(output, root),
                _ => Err(Error::InvalidArgument(format!("device ring: {name} with these buffers"))),
            }
        })?;
        self.calls += 1;
        Ok(true)
    }
}

fn missing(what: &str) -> Error {
    Error::InvalidArgument(format!("device ring: no {what} slot"))
}

/// The host collective a ring call stands for (its name and fingerprint).
fn describe(op: Op, dtype: DType, n: usize) -> (&'static str, OpPrint) {
    let (name, kind, reduce, root) = match op {
        Op::AllReduce(o) => ("all_reduce", OpKind::AllReduce, Some(o), None),
        Op::ReduceScatter(o) => ("reduce_scatter", OpKind::ReduceScatter, Some(o), None),
        Op::AllGather => ("all_gather", OpKind::AllGather, None, None),
        Op::Broadcast(r) => ("broadcast", OpKind::Broadcast, None, Some(r)),
        Op::Reduce(o, r) => ("reduce", OpKind::Reduce, Some(o), Some(r)),
        // Never on this path ([`super::path::order`]); described for completeness.
        Op::Send(_) | Op::Recv(_) => ("send/recv", OpKind::SendRecv, None, None),
        Op::AllToAll => ("all_to_all", OpKind::AllToAll, None, None),
    };
    (name, OpPrint { kind, dtype, reduce, root, count: n as u64, seq: 0 })
}

/// Collective: whether every member's links to its ring neighbours go direct. With
/// `MESHTRAIN_GPU_DIRECT=on`, a member whose links cannot is an error on every member.
fn agree(mode: GpuDirect, comm: &Communicator, next: usize, prev: usize) -> Result<bool> {
    let local = match mode {
        GpuDirect::Off => Err("MESHTRAIN_GPU_DIRECT=off".to_string()),
        _ => ring_links(comm, next, prev)?,
    };
    let mut flags = vec![0u8; comm.size()];
    comm.all_gather_into(&[u8::from(local.is_ok())], &mut flags)?;
    if let Err(why) = &local {
        log::info!("device collectives: this rank's ring links cannot go FI_HMEM direct ({why})");
    }
    match flags.iter().position(|&f| f == 0) {
        None => {
            if comm.rank() == 0 {
                log::info!("device collectives: FI_HMEM rings over {} members (all-reduce, reduce-scatter, all-gather, broadcast)", comm.size());
            }
            Ok(true)
        }
        Some(r) if mode != GpuDirect::On => {
            if comm.rank() == 0 {
                log::info!("device collectives: staged through host memory (the ring links of member {r} are not FI_HMEM direct)");
            }
            Ok(false)
        }
        Some(r) => {
            let why = local.err().map_or_else(|| format!("member {r}'s log says why"), |why| format!("here: {why}"));
            Err(Error::config(
                "MESHTRAIN_GPU_DIRECT",
                format!("on, but device collectives cannot run as FI_HMEM rings: the ring links of member {r} are not direct ({why})"),
            ))
        }
    }
}

/// `Ok(Err(why))` unless the links to `next` and from `prev` both go direct.
fn ring_links(comm: &Communicator, next: usize, prev: usize) -> Result<std::result::Result<(), String>> {
    for (peer, dir) in [(next, "to"), (prev, "from")] {
        let world = comm.world_rank(peer);
        match comm.direct_peer(peer)? {
            None => return Ok(Err(format!("the link {dir} rank {world} is not a libfabric link"))),
            Some(link) => {
                if let Err(why) = link.choice() {
                    return Ok(Err(format!("link {dir} rank {world}: {why}")));
                }
            }
        }
    }
    Ok(Ok(()))
}

/// One ring call: the neighbours' links, the registrations and the call's shape.
struct Ring<'a> {
    next: &'a DirectPeer,
    prev: &'a DirectPeer,
    regs: &'a Registrations,
    w: &'a Waiter,
    dev: &'a Device,
    k: usize,
    me: usize,
    n: usize,
    dtype: DType,
    /// Most elements of a piece.
    piece: usize,
}

/// A device buffer and its registered memory.
type Slot<'b> = (&'b DeviceBuffer, Memory);

impl Ring<'_> {
    /// Elements of block `b` (mod `k`).
    fn block(&self, b: usize) -> Range<usize> {
        block_range(self.n, self.k, b % self.k)
    }

    /// Elements of piece `p` of block `b` (empty past the block's end).
    fn piece_of(&self, b: usize, p: usize) -> Range<usize> {
        let blk = self.block(b);
        let start = (blk.start + p * self.piece).min(blk.end);
        start..(start + self.piece).min(blk.end)
    }

    /// Pieces of the longest block (the first).
    fn pieces(&self) -> usize {
        self.block(0).len().div_ceil(self.piece)
    }

    fn bytes(&self, elems: &Range<usize>) -> Range<usize> {
        let es = self.dtype.size();
        elems.start * es..elems.end * es
    }

    /// Sends `tx` to the next member while receiving `rx` from the previous one (either may be
    /// absent or empty: both ends of a link derive the same lengths from the same blocks).
    fn hop(&self, tx: Option<(Memory, Range<usize>)>, rx: Option<(Memory, Range<usize>)>) -> Result<()> {
        self.dev.synchronize()?;
        let mut legs = Vec::with_capacity(2);
        for (side, link, send) in [(tx, self.next, true), (rx, self.prev, false)] {
            if let Some((mem, r)) = side.filter(|(_, r)| !r.is_empty()) {
                legs.push(DirectLeg { link, mr: self.regs.get(&mem)?, offset: r.start, len: r.len(), send });
            }
        }
        if legs.is_empty() {
            return Ok(());
        }
        direct_transfer(&legs, self.w)
    }

    /// Errors unless the previous member's print `theirs` is `mine`, naming both calls.
    fn check_print(&self, comm: &Communicator, mine: &OpPrint, theirs: &[u8]) -> Result<()> {
        if OpPrint::decode(theirs).as_ref() == Some(mine) {
            return Ok(());
        }
        let (me, prev) = (comm.world_rank(self.me), comm.world_rank((self.me + self.k - 1) % self.k));
        Err(self.w.fail(prev, fingerprint::mismatch(me, mine, prev, theirs)))
    }

    fn avg(&self, buf: &mut DeviceBuffer, elems: &Range<usize>, at: Range<usize>, op: ReduceOp) -> Result<()> {
        if op == ReduceOp::Avg && !elems.is_empty() {
            ops::avg_divide(self.dev, self.dtype, &mut *part_mut(buf, at)?, elems.len(), self.k)?;
        }
        Ok(())
    }

    fn all_reduce(&self, buf: &mut DeviceBuffer, mem: Memory, land: Slot, op: ReduceOp) -> Result<()> {
        let (k, me) = (self.k, self.me);
        for p in 0..self.pieces() {
            for s in 0..k - 1 {
                let (tx, rx) = (self.piece_of(me + k - s, p), self.piece_of(me + 2 * k - s - 1, p));
                let landed = 0..self.bytes(&rx).len();
                self.hop(Some((mem, self.bytes(&tx))), Some((land.1, landed.clone())))?;
                if !rx.is_empty() {
                    let mut acc = part_mut(buf, self.bytes(&rx))?;
                    ops::reduce_into(self.dev, self.dtype, op, &mut acc, &*part(land.0, landed)?, rx.len())?;
                }
            }
            let done = self.piece_of(me + 1, p);
            self.avg(buf, &done, self.bytes(&done), op)?;
        }
        for s in 0..k - 1 {
            let (tx, rx) = (self.block(me + 1 + k - s), self.block(me + k - s));
            self.hop(Some((mem, self.bytes(&tx))), Some((mem, self.bytes(&rx))))?;
        }
        Ok(())
    }

    fn reduce_scatter(
        &self,
        (input, in_mem): Slot,
        out: &mut DeviceBuffer,
        land: Slot,
        (acc, acc_mem): (&mut DeviceBuffer, Memory),
        op: ReduceOp,
    ) -> Result<()> {
        let (k, me) = (self.k, self.me);
        let mine = self.block(me).start;
        for p in 0..self.pieces() {
            for s in 0..k - 1 {
                let (tx, rx) = (self.piece_of(me + 2 * k - 1 - s, p), self.piece_of(me + 2 * k - 2 - s, p));
                let sent = if s == 0 { (in_mem, self.bytes(&tx)) } else { (acc_mem, 0..self.bytes(&tx).len()) };
                let landed = 0..self.bytes(&rx).len();
                self.hop(Some(sent), Some((land.1, landed.clone())))?;
                if rx.is_empty() {
                    continue;
                }
                let (own, got) = (part(input, self.bytes(&rx))?, part(land.0, landed.clone())?);
                if s + 2 == k {
                    let at = self.bytes(&(rx.start - mine..rx.end - mine));
                    ops::reduce(self.dev, self.dtype, op, &mut *part_mut(out, at.clone())?, &own, &got, rx.len())?;
                    self.avg(out, &rx, at, op)?;
                } else {
                    ops::reduce(self.dev, self.dtype, op, &mut *part_mut(acc, landed)?, &own, &got, rx.len())?;
                }
            }
        }
        Ok(())
    }

    fn all_gather(&self, input: &DeviceBuffer, out: &mut DeviceBuffer, mem: Memory) -> Result<()> {
        let (k, me) = (self.k, self.me);
        let mine = self.bytes(&self.block(me));
        if !mine.is_empty() {
            let own = part(input, 0..mine.len())?;
            self.dev.copy_on_device(&mut *part_mut(out, mine)?, &own)?;
        }
        for s in 0..k - 1 {
            let (tx, rx) = (self.block(me + k - s), self.block(me + 2 * k - 1 - s));
            self.hop(Some((mem, self.bytes(&tx))), Some((mem, self.bytes(&rx))))?;
        }
        Ok(())
    }

    fn broadcast(&self, mem: Memory, root: usize) -> Result<()> {
        let (k, n, piece) = (self.k, self.n, self.piece);
        let pos = (self.me + k - root) % k;
        let pieces = n.div_ceil(piece);
        let at = |t: usize| self.bytes(&(t * piece..((t + 1) * piece).min(n)));
        if pos == 0 {
            return (0..pieces).try_for_each(|t| self.hop(Some((mem, at(t))), None));
        }
        for t in 0..=pieces {
            let rx = (t < pieces).then(|| (mem, at(t)));
            let tx = (t >= 1 && pos + 1 < k).then(|| (mem, at(t - 1)));
            self.hop(tx, rx)?;
        }
        Ok(())
    }
}
