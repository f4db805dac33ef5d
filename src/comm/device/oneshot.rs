//! Path 0: stream-ordered device collectives for small calls (the tensor- and sequence-parallel
//! all-reduces, all-gathers and reduce-scatters of every layer), between GPUs of one node.
//!
//! Why: the IPC path ([`super::peer_mapped`]) synchronizes the stream and runs host agreement
//! rounds in every call (export, phase ends), a few hundred microseconds that dominate a call of a
//! few kilobytes. Here a call only queues work on the caller's stream and returns: no host thread
//! waits, no host message is sent.
//!
//! How: once per state (collectively), every rank allocates a shareable workspace, its peers map
//! it, and the ranks agree that all of this worked. Layout of a workspace (bytes):
//! `[0, 32)` the flags of slot 0 and 1 (`{fingerprint, sequence}` each), `[64, 96)` this rank's
//! error record, `[HEADER, HEADER + cap)` slot 0, then slot 1. Call number `s` (counted from 1,
//! the same on every rank) uses slot `s % 2`: copy the input into it, `oneshot_signal`,
//! `oneshot_wait` for every peer's signal of call `s`, then the ordinary reduce and copy kernels
//! read the peers' slots (see `kernels/oneshot.cu` for the ordering argument). Every rank reduces
//! in rank order, so every rank gets bitwise the same result.
//!
//! Reuse of a slot is safe without any host step: a rank writes slot `s % 2` in call `s` only after
//! its wait of call `s - 1` saw every peer's signal of call `s - 1`, which each peer queued after
//! its reads of call `s - 2` (the last use of that slot). This needs every rank to wait for every
//! peer in every call, which every call does, whatever the operation.
//!
//! Errors keep the semantics of the other paths (an error on one rank is an error on all, naming
//! the rank and the calls), but are reported at the next [`OneShot::check`], which the training
//! step runs once per step before it applies an update, instead of in every call: a failed wait
//! (a peer silent past half the communicator's deadline, or a peer in a different collective, found by
//! the call fingerprint in the flag) is recorded on the device, later waits return at once, and
//! the results of calls after a failure are not to be used.
//!
//! Used when `MESHTRAIN_GPU_ONESHOT` (bytes a rank publishes per call, default 1 MiB; 0 turns it
//! off) allows, the IPC path is eligible (every rank on this node, own process, same arm) and not
//! turned off; the capacity is agreed (minimum over the ranks) at setup, so the choice per call
//! depends only on (operation, count, element size, ranks) and is the same everywhere.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

use super::path::{DeviceCall, DevicePath, PathCtx};
use crate::comm::device::{Bufs, GpuIpc, Op};
use crate::comm::{block_range, Communicator, DType, ReduceOp};
use crate::device::ipc::{self as dipc, Mapping};
use crate::device::{ops, Device, DeviceBuffer, KernelArg, LaunchDims};
use crate::error::{Error, Result};

/// Bytes before slot 0 (flags and the error record), a multiple of 256 so slots stay aligned.
const HEADER: usize = 256;
/// Byte offset of the error record (4 words: code, peer, call, observed).
const ERROR_AT: usize = 64;
/// Bytes of one rank's setup record: handle (64), offset (8), status (8).
const RECORD: usize = 80;
/// Most ranks one wait launch serves (one thread per peer).
const MAX_RANKS: usize = 1024;

/// What a call is, packed so that a peer's call can be named from its flag: operation (3 bits),
/// reduce operator (3), element type (3), root (23), count (32).
fn fingerprint(op: Op, n: usize, dtype: DType) -> u64 {
    let (code, rop, root) = match op {
        Op::AllReduce(o) => (1, Some(o), 0),
        Op::Broadcast(r) => (2, None, r),
        Op::Reduce(o, r) => (3, Some(o), r),
        Op::ReduceScatter(o) => (4, Some(o), 0),
        Op::AllGather => (5, None, 0),
        Op::AllToAll => (6, None, 0),
        // Never on this path ([`super::path::order`]); numbered so that the print stays total.
        Op::Send(p) | Op::Recv(p) => (7, None, p),
    };
    let rop = rop.map_or(0, |o| 1 + ReduceOp::ALL.iter().position(|x| *x == o).unwrap_or(7) as u64);
    let dt = DType::ALL.iter().position(|d| *d == dtype).unwrap_or(7) as u64;
    code << 61 | rop << 58 | dt << 55 | (root as u64 & 0x7f_ffff) << 32 | (n as u64 & 0xffff_ffff)
}

/// `fingerprint` in words ("all_reduce sum of 4096 f32").
fn describe(fp: u64) -> String {
    const OPS: [&str; 8] = ["?", "all_reduce", "broadcast", "reduce", "reduce_scatter", "all_gather", "all_to_all", "send/recv"];
    let op = OPS[(fp >> 61) as usize];
    let rop = match (fp >> 58) & 7 {
        0 => String::new(),
        r => ReduceOp::ALL.get(r as usize - 1).map_or("?".into(), |o| format!(" {}", o.name())),
    };
    let dt = DType::ALL.get(((fp >> 55) & 7) as usize).map_or("?", |d| d.name());
    let root = match fp >> 61 {
        2 | 3 => format!(" root {}", (fp >> 32) & 0x7f_ffff),
        _ => String::new(),
    };
    format!("{op}{rop} of {} {dt}{root}", fp & 0xffff_ffff)
}

/// Bytes the largest publisher of `op` puts into its slot (the same on every rank).
fn publish_bytes(op: Op, n: usize, k: usize, dtype: DType) -> usize {
    match op {
        Op::AllGather => block_range(n, k, 0).len() * dtype.size(),
        _ => n * dtype.size(),
    }
}

/// The workspace, the peers' mapped workspaces and the call counter.
struct Ready {
    /// Slot capacity in bytes (agreed).
    cap: usize,
    workspace: DeviceBuffer,
    /// Per peer (by rank; `None` for this rank): the mapping and the workspace's offset in it.
    peers: Vec<Option<(Mapping, usize)>>,
    /// Device addresses of the peers' flag areas (0 for this rank), `k` u64.
    table: DeviceBuffer,
    /// Calls made (the sequence number of the last one).
    seq: u64,
    timeout_ns: u64,
}

/// Setup state and counters of path 0.
#[derive(Default)]
pub(crate) struct OneShot {
    /// `None` until set up; `Some(None)` when it cannot be used (agreed).
    ready: Option<Option<Ready>>,
    /// The first failure found by a check; every later call and check returns it.
    failed: Option<String>,
    calls: u64,
}

impl OneShot {
    /// Calls that took this path.
    pub(crate) fn calls(&self) -> u64 {
        self.calls
    }

    /// Collective: waits for this rank's queued calls, then every rank learns whether any call
    /// failed anywhere; an error names the failing rank, its peer and both calls.
    pub(crate) fn check(&mut self, comm: &Communicator, dev: &Device) -> Result<()> {
        if let Some(why) = &self.failed {
            return Err(Error::Device(why.clone()));
        }
        let Some(Some(r)) = &self.ready else { return Ok(()) };
        let mut head = [0i64; (ERROR_AT + 32) / 8];
        dev.copy_to_host(&r.workspace, &mut head)?;
        let mine = &head[ERROR_AT / 8..];
        let mut all = vec![0i64; 4 * comm.size()];
        comm.all_gather_into(mine, &mut all)?;
        let Some((rank, rec)) = all.chunks(4).enumerate().find(|(_, rec)| rec[0] != 0) else { return Ok(()) };
        let rec: Vec<u64> = rec.iter().map(|&w| w as u64).collect();
        let timeout_s = r.timeout_ns as f64 / 1e9;
        let what = match rec[0] {
            1 => format!("waited {timeout_s:.0} s for rank {} to reach it (that rank's last call was {})", rec[1], rec[3]),
            2 => format!("rank {} made a different call: {}", rec[1], describe(rec[3])),
            c => format!("unknown error code {c} from peer {}", rec[1]),
        };
        let why = format!("stream-ordered device collective: rank {rank}, call {}: {what}", rec[2]);
        self.failed = Some(why.clone());
        Err(Error::Device(why))
    }

    /// Drops the peers' mappings and this rank's workspace, after every rank dropped its mappings
    /// (collective); the next eligible call sets up again.
    pub(crate) fn release(&mut self, comm: &Communicator, dev: &Device) -> Result<()> {
        if let Some(Some(r)) = &mut self.ready {
            dev.synchronize()?;
            r.peers.clear();
            comm.barrier()?;
        }
        self.ready = None;
        Ok(())
    }
}

impl DevicePath for OneShot {
    fn name(&self) -> &'static str {
        "stream-ordered"
    }

    /// Runs the call here when it is small enough and the members may map each other's memory
    /// (decided identically on every rank; the first such call sets the workspaces up).
    fn try_call(&mut self, cx: &mut PathCtx, call: &mut DeviceCall) -> Result<bool> {
        if let Some(why) = &self.failed {
            return Err(Error::Device(why.clone()));
        }
        let (k, op, n, dtype) = (cx.comm.size(), call.op, call.n, call.dtype);
        let cap = if cx.cfg.ipc == GpuIpc::Off { 0 } else { cx.cfg.oneshot_bytes };
        if cap == 0 || k == 1 || n == 0 || op.is_p2p() || publish_bytes(op, n, k, dtype) > cap || matches!(cx.dev, Device::Cpu) {
            return Ok(false);
        }
        if self.ready.is_none() {
            let ready = if cx.peers.eligible(cx.comm, cx.dev)? { setup(cx.comm, cx.dev, cap)? } else { None };
            self.ready = Some(ready);
        }
        let Some(Some(r)) = &mut self.ready else { return Ok(false) };
        if publish_bytes(op, n, k, dtype) > r.cap {
            return Ok(false);
        }
        r.seq += 1;
        r.call(cx.comm, cx.dev, call)?;
        self.calls += 1;
        Ok(true)
    }
}

/// Allocates, exports, maps and agrees (collective). `None` when some rank could not.
fn setup(comm: &Communicator, dev: &Device, cap: usize) -> Result<Option<Ready>> {
    let (k, me) = (comm.size(), comm.rank());
    let mut agreed = [cap.next_multiple_of(HEADER) as i64];
    comm.all_reduce(&mut agreed, ReduceOp::Min)?;
    let cap = agreed[0] as usize;
    let local = prepare(dev, cap);
    let mut rec = [0u8; RECORD];
    if let Ok((_, e)) = &local {
        rec[..64].copy_from_slice(&e.handle);
        rec[64..72].copy_from_slice(&e.offset.to_le_bytes());
        rec[72] = 1;
    }
    let mut all = vec![0u8; RECORD * k];
    comm.all_gather_into(&rec, &mut all)?;
    let opened = match local {
        Ok((ws, _)) if k <= MAX_RANKS && all.chunks(RECORD).all(|r| r[72] == 1) => open_peers(comm, dev, ws, &all, cap),
        Ok(_) => Err(Error::Device("some rank could not export its workspace".into())),
        Err(e) => Err(e),
    };
    let mut flag = [u8::from(opened.is_err())];
    comm.all_reduce(&mut flag, ReduceOp::Max)?;
    match opened {
        Ok(r) if flag[0] == 0 => {
            // Logged once per process at info (states are set up again after each release).
            static LOGGED: AtomicBool = AtomicBool::new(false);
            let level = if LOGGED.swap(true, Ordering::Relaxed) { log::Level::Debug } else { log::Level::Info };
            log::log!(level, "rank {me}: stream-ordered device collectives up to {cap} bytes per rank over {k} mapped workspaces");
            Ok(Some(r))
        }
        Ok(_) => {
            log::debug!("rank {me}: stream-ordered device collectives off: another rank could not set them up");
            Ok(None)
        }
        Err(e) => {
            log::warn!("rank {me}: stream-ordered device collectives off: {e}");
            Ok(None)
        }
    }
}

/// This rank's zeroed-header workspace and its export.
fn prepare(dev: &Device, cap: usize) -> Result<(DeviceBuffer, dipc::Export)> {
    let mut ws = dipc::alloc_shareable(dev, HEADER + 2 * cap)?;
    dev.copy_to_device(&mut ws, &[0u8; HEADER])?;
    let e = dipc::export(dev, &ws)?;
    Ok((ws, e))
}

fn open_peers(comm: &Communicator, dev: &Device, workspace: DeviceBuffer, all: &[u8], cap: usize) -> Result<Ready> {
    let me = comm.rank();
    let mut peers = Vec::with_capacity(comm.size());
    let mut addresses = vec![0u64; comm.size()];
    for (p, rec) in all.chunks(RECORD).enumerate() {
        if p == me {
            peers.push(None);
            continue;
        }
        let handle: [u8; 64] = rec[..64].try_into().expect("64 bytes");
        let offset = u64::from_le_bytes(rec[64..72].try_into().expect("8 bytes")) as usize;
        let map = dipc::open(dev, &handle).map_err(|e| Error::Device(format!("rank {me}: mapping rank {p}'s workspace: {e}")))?;
        addresses[p] = dipc::mapped(&map, offset..offset + HEADER).device_address(dev, "oneshot_wait", 0)?;
        peers.push(Some((map, offset)));
    }
    let table = dev.upload(&addresses)?;
    // Half the host deadline: a rank stuck in a wait records its error before a peer waiting for
    // it in the next host collective (the check) gives up on it.
    let timeout_ns = u64::try_from(comm.timeout().as_nanos() / 2).unwrap_or(u64::MAX);
    Ok(Ready { cap, workspace, peers, table, seq: 0, timeout_ns })
}

impl Ready {
    fn slot(&self, parity: usize) -> Range<usize> {
        HEADER + parity * self.cap..HEADER + (parity + 1) * self.cap
    }

    /// Bytes `range` of rank `p`'s slot `parity` (this rank's own workspace for `p == me`).
    fn peer_slot(&self, dev_rank: usize, p: usize, parity: usize, range: Range<usize>) -> Result<dipc::Borrowed<'_>> {
        let s = self.slot(parity);
        let abs = s.start + range.start..s.start + range.end;
        if p == dev_rank {
            return dipc::part(&self.workspace, abs);
        }
        let (map, offset) = self.peers[p].as_ref().expect("every peer is mapped");
        Ok(dipc::mapped(map, offset + abs.start..offset + abs.end))
    }

    /// One call: publish, signal, wait, compute (all queued on the stream).
    fn call(&mut self, comm: &Communicator, dev: &Device, call: &mut DeviceCall) -> Result<()> {
        let (op, n, dtype) = (call.op, call.n, call.dtype);
        let (k, me, es) = (comm.size(), comm.rank(), dtype.size());
        let parity = (self.seq % 2) as usize;
        let fp = fingerprint(op, n, dtype);
        let publish = match op {
            Op::Broadcast(root) if root != me => 0,
            Op::AllGather => block_range(n, k, me).len() * es,
            _ => n * es,
        };
        if publish > 0 {
            let s = self.slot(parity);
            let mut dst = dipc::part_mut(&mut self.workspace, s.start..s.start + publish)?;
            dev.copy_on_device(&mut dst, &*dipc::part(call.bufs.input()?, 0..publish)?)?;
        }
        let one = LaunchDims::linear(1, 64);
        let (par, seq) = (parity as i32, self.seq);
        dev.launch("oneshot_signal", one, &[KernelArg::Buf(&self.workspace), KernelArg::I32(par), KernelArg::U64(seq), KernelArg::U64(fp)])?;
        let wait = LaunchDims::linear(1, (k as u32).next_multiple_of(64));
        let args = [
            KernelArg::Buf(&self.table),
            KernelArg::I32(k as i32),
            KernelArg::I32(par),
            KernelArg::U64(seq),
            KernelArg::U64(fp),
            KernelArg::U64(self.timeout_ns),
            KernelArg::BufAt(&self.workspace, ERROR_AT),
        ];
        dev.launch("oneshot_wait", wait, &args)?;
        Slots { ready: self, dev, me, k, dtype, parity }.compute(call)
    }
}

/// The published slots of one call, as this rank reads them.
struct Slots<'r> {
    ready: &'r Ready,
    dev: &'r Device,
    me: usize,
    k: usize,
    dtype: DType,
    /// Which slot of every workspace the call uses.
    parity: usize,
}

impl Slots<'_> {
    /// Bytes `range` of rank `p`'s slot.
    fn of(&self, p: usize, range: Range<usize>) -> Result<dipc::Borrowed<'_>> {
        self.ready.peer_slot(self.me, p, self.parity, range)
    }

    /// The kernels that read the published slots.
    fn compute(&self, call: &mut DeviceCall) -> Result<()> {
        let (me, k, dev, n, es) = (self.me, self.k, self.dev, call.n, self.dtype.size());
        let block = |b: usize| {
            let r = block_range(n, k, b);
            r.start * es..r.end * es
        };
        match (call.op, &mut call.bufs) {
            (Op::AllReduce(o), Bufs::InPlace(buf)) => self.reduce_all(o, buf, 0..n * es),
            (Op::Reduce(o, root), Bufs::InPlace(buf)) if root == me => self.reduce_all(o, buf, 0..n * es),
            (Op::Reduce(..), Bufs::InPlace(_)) => Ok(()),
            (Op::Broadcast(root), Bufs::InPlace(buf)) if root != me => {
                dev.copy_on_device(&mut *dipc::part_mut(buf, 0..n * es)?, &*self.of(root, 0..n * es)?)
            }
            (Op::Broadcast(_), Bufs::InPlace(_)) => Ok(()),
            (Op::ReduceScatter(o), Bufs::Split(_, recv)) => self.reduce_all(o, recv, block(me)),
            (Op::AllGather, Bufs::Split(_, recv)) => (0..k).filter(|&p| !block(p).is_empty()).try_for_each(|p| {
                let len = block(p).len();
                dev.copy_on_device(&mut *dipc::part_mut(recv, block(p))?, &*self.of(p, 0..len)?)
            }),
            (Op::AllToAll, Bufs::Split(_, recv)) => {
                let mine = block(me);
                if mine.is_empty() {
                    return Ok(());
                }
                (0..k).try_for_each(|s| {
                    let dst = s * mine.len()..(s + 1) * mine.len();
                    dev.copy_on_device(&mut *dipc::part_mut(recv, dst)?, &*self.of(s, mine.clone())?)
                })
            }
            _ => Err(Error::InvalidArgument("oneshot: buffers do not match the collective".into())),
        }
    }

    /// `out[0..range.len()]` = the ranks' slot bytes `range` combined in rank order.
    fn reduce_all(&self, op: ReduceOp, out: &mut DeviceBuffer, range: Range<usize>) -> Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        let (dev, dtype, k) = (self.dev, self.dtype, self.k);
        let elems = range.len() / dtype.size();
        let mut acc = dipc::part_mut(out, 0..range.len())?;
        let slot = |p: usize| self.of(p, range.clone());
        ops::reduce(dev, dtype, op, &mut acc, &*slot(0)?, &*slot(1)?, elems)?;
        for p in 2..k {
            ops::reduce_into(dev, dtype, op, &mut acc, &*slot(p)?, elems)?;
        }
        if op == ReduceOp::Avg {
            ops::avg_divide(dev, dtype, &mut acc, elems, k)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Every field of a call survives the fingerprint, and different calls differ.
    #[test]
    fn fingerprints_name_the_call() {
        let calls = [
            (Op::AllReduce(ReduceOp::Sum), 4096, DType::F32, "all_reduce sum of 4096 f32"),
            (Op::Broadcast(3), 7, DType::BF16, "broadcast of 7 bf16 root 3"),
            (Op::Reduce(ReduceOp::Max, 1), 1, DType::I64, "reduce max of 1 i64 root 1"),
            (Op::AllGather, 99, DType::U8, "all_gather of 99 u8"),
        ];
        let mut seen = HashMap::new();
        for (op, n, dt, text) in calls {
            let fp = fingerprint(op, n, dt);
            assert_eq!(describe(fp), text);
            assert!(seen.insert(fp, text).is_none());
        }
        assert_ne!(fingerprint(Op::AllReduce(ReduceOp::Sum), 4096, DType::F32), fingerprint(Op::AllReduce(ReduceOp::Avg), 4096, DType::F32));
    }
}
