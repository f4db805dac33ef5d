//! Path A: device collectives between GPUs of one node through IPC-mapped peer memory.
//!
//! Once per state, the ranks exchange (boot id, process id, device arm): the path is eligible
//! when every rank runs in its own process on this node's kernel with the same GPU arm. Per call:
//! 1. each rank synchronizes its stream (its input is final) and exports the input buffer (IPC
//!    handle, offset, length); the records are all-gathered over the host communicator, which
//!    also tells every rank that every peer's input is ready;
//! 2. each rank maps the peers' allocations it reads, from its cache of (peer, handle) or by
//!    opening the handle, and the ranks agree that every export and open worked (otherwise,
//!    under `auto`, every rank falls back to the staged path together; under `on`, all fail);
//! 3. the kernels run: all-reduce reduces block `r` from every peer's input into rank `r`'s own
//!    buffer (own data first, then peers in rank order), then copies every peer's finished block;
//!    reduce-scatter does the first half, all-gather the second, reduce runs on the root,
//!    broadcast and all-to-all copy. Each phase ends with a stream synchronize and an agreement
//!    round (a host all-reduce of the error flag): no rank overwrites what a peer may still read,
//!    or returns before every peer finished reading its buffers, and an error on one rank
//!    becomes an error on all.
//!
//! Peers only ever read each other's inputs; nobody writes a peer's memory. Cached mappings stay
//! open until [`super::GpuCommState::release_mappings`]: an allocation used here must not be
//! freed before every rank released (CUDA and HIP leave freeing a mapped allocation undefined).

use std::collections::HashMap;
use std::ops::Range;

use super::path::{DeviceCall, DevicePath, PathCtx};
use crate::comm::device::{Bufs, GpuIpc, Op};
use crate::comm::{block_range, Communicator, DType, ReduceOp};
use crate::device::ipc::{self as dipc, Mapping};
use crate::device::{ops, Device, DeviceBuffer};
use crate::error::{Error, Result};

/// Bytes of one rank's record: handle (64), offset (8), length (8), status (1), padding.
const RECORD: usize = 88;
const EXPORTED: u8 = 1;
const EMPTY: u8 = 2;

/// One rank's input as its peers see it.
struct Record {
    handle: [u8; 64],
    offset: usize,
    len: usize,
    status: u8,
}

impl Record {
    fn to_bytes(&self) -> [u8; RECORD] {
        let mut b = [0u8; RECORD];
        b[..64].copy_from_slice(&self.handle);
        b[64..72].copy_from_slice(&(self.offset as u64).to_le_bytes());
        b[72..80].copy_from_slice(&(self.len as u64).to_le_bytes());
        b[80] = self.status;
        b
    }

    fn from_bytes(b: &[u8]) -> Record {
        let word = |r: Range<usize>| u64::from_le_bytes(b[r].try_into().expect("8 bytes")) as usize;
        Record { handle: b[..64].try_into().expect("64 bytes"), offset: word(64..72), len: word(72..80), status: b[80] }
    }
}

/// Whether the members may map each other's device memory: every rank in its own process on
/// this node's kernel with the same device arm (exchanged once, agreed everywhere). Shared by
/// this path and the stream-ordered one; a failed mapping here turns it off for both.
#[derive(Default)]
pub(crate) struct PeerAccess {
    /// `None` until checked; then `Err(reason)` when peers' memory cannot be mapped.
    verdict: Option<std::result::Result<(), String>>,
}

/// The mapping cache and the call count.
#[derive(Default)]
pub(crate) struct IpcState {
    /// Peers' allocations mapped here, by (peer, IPC handle).
    cache: HashMap<(usize, [u8; 64]), Mapping>,
    /// Collectives that ran here.
    ipc_calls: u64,
}

/// Agrees on whether `local` failed anywhere: every rank returns an error if any rank did.
fn agree(comm: &Communicator, local: Result<()>) -> Result<()> {
    let mut flag = [u8::from(local.is_err())];
    comm.all_reduce(&mut flag, ReduceOp::Max)?;
    match (local, flag[0]) {
        (Err(e), _) => Err(e),
        (Ok(()), 0) => Ok(()),
        (Ok(()), _) => Err(Error::Device("ipc collective: another rank failed (see its error)".into())),
    }
}

fn forced(why: &str) -> Error {
    Error::config("MESHTRAIN_GPU_IPC", format!("forced on, but IPC cannot be used: {why}"))
}

/// Identifies the running kernel (one per node; containers on one host share it).
fn boot_id_hash() -> i64 {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    id.trim().bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)) as i64
}

impl PeerAccess {
    /// Whether peers' memory may be mapped: a GPU arm (or emu) whose ranks all run on this node,
    /// each in its own process (exchanged once, agreed everywhere; collective on first use).
    pub(crate) fn eligible(&mut self, comm: &Communicator, dev: &Device) -> Result<bool> {
        if matches!(dev, Device::Cpu) || comm.size() == 1 {
            return Ok(false);
        }
        Ok(self.check(comm, dev)?.is_ok())
    }

    /// Whether every rank can map every other's memory (exchanged once, agreed everywhere).
    fn check(&mut self, comm: &Communicator, dev: &Device) -> Result<std::result::Result<(), String>> {
        if let Some(e) = &self.verdict {
            return Ok(e.clone());
        }
        let arm = match dev {
            Device::Cpu => 0,
            Device::Cuda(_) => 1,
            Device::Hip(_) => 2,
            Device::Emu(_) => 3,
        };
        let mine = [boot_id_hash(), i64::from(std::process::id()), arm];
        let mut all = vec![0i64; 3 * comm.size()];
        comm.all_gather_into(&mine, &mut all)?;
        let rows: Vec<&[i64]> = all.chunks(3).collect();
        let mut pids: Vec<i64> = rows.iter().map(|r| r[1]).collect();
        pids.sort_unstable();
        let verdict = if let Some(r) = rows.iter().position(|r| r[0] != rows[0][0]) {
            Err(format!("rank {r} runs on another node than rank 0"))
        } else if let Some(r) = (0..comm.size()).find(|&r| comm.node_of(r) != comm.node_of(0)) {
            Err(format!("rank {r} runs on another host than rank 0 (another hostname)"))
        } else if let Some(r) = rows.iter().position(|r| r[2] != rows[0][2]) {
            Err(format!("rank {r} uses another device arm than rank 0"))
        } else if pids.windows(2).any(|w| w[0] == w[1]) {
            Err("two ranks share one process (IPC handles cannot be opened by their exporter)".into())
        } else {
            Ok(())
        };
        self.verdict = Some(verdict.clone());
        Ok(verdict)
    }

    /// Turns peer mapping off for good (agreed: every rank calls it after the same failure).
    fn refuse(&mut self, why: String) {
        self.verdict = Some(Err(why));
    }
}

impl IpcState {
    /// Calls that took the IPC path.
    pub(crate) fn ipc_calls(&self) -> u64 {
        self.ipc_calls
    }

    /// Closes every cached mapping (after the device finished using them).
    pub(crate) fn release(&mut self, dev: &Device) -> Result<()> {
        dev.synchronize()?;
        self.cache.clear();
        Ok(())
    }

    /// Step 1: synchronize, export the input, all-gather the records; `Ok(Err(why))` when some
    /// rank could not export (agreed: every rank sees every record).
    fn exchange(&mut self, comm: &Communicator, dev: &Device, call: &DeviceCall) -> Result<std::result::Result<Vec<Record>, String>> {
        let (n, dtype, input) = (call.n, call.dtype, call.bufs.input()?);
        let read_bytes = match call.op {
            Op::AllGather => block_range(n, comm.size(), comm.rank()).len(),
            _ => n,
        } * dtype.size();
        let mut why = String::new();
        dev.synchronize()?;
        let mine = if read_bytes == 0 {
            Record { handle: [0; 64], offset: 0, len: 0, status: EMPTY }
        } else {
            match dipc::export(dev, input) {
                Ok(e) => Record { handle: e.handle, offset: e.offset as usize, len: read_bytes, status: EXPORTED },
                Err(e) => {
                    why = e.to_string();
                    Record { handle: [0; 64], offset: 0, len: 0, status: 0 }
                }
            }
        };
        let mut all = vec![0u8; RECORD * comm.size()];
        comm.all_gather_into(&mine.to_bytes(), &mut all)?;
        let records: Vec<Record> = all.chunks(RECORD).map(Record::from_bytes).collect();
        if let Some(r) = records.iter().position(|r| r.status == 0) {
            let detail = if r == comm.rank() { why } else { "see that rank's log".into() };
            return Ok(Err(format!(
                "rank {r} could not export its buffer (CUDA pool memory cannot be shared: allocate it \
                 with device::ipc::alloc_shareable): {detail}"
            )));
        }
        Ok(Ok(records))
    }

    /// Step 2: maps every peer's input not mapped yet.
    fn open_peers(&mut self, comm: &Communicator, dev: &Device, records: &[Record]) -> Result<()> {
        for (p, r) in records.iter().enumerate() {
            if p == comm.rank() || r.status != EXPORTED || self.cache.contains_key(&(p, r.handle)) {
                continue;
            }
            let m = dipc::open(dev, &r.handle)
                .map_err(|e| Error::Device(format!("rank {}: mapping rank {p}'s buffer: {e}", comm.rank())))?;
            self.cache.insert((p, r.handle), m);
        }
        Ok(())
    }
}

impl DevicePath for IpcState {
    fn name(&self) -> &'static str {
        "ipc"
    }

    /// Runs the call on the IPC path when it applies; `Ok(false)` sends it on to the next path
    /// (decided identically on every rank).
    fn try_call(&mut self, cx: &mut PathCtx, call: &mut DeviceCall) -> Result<bool> {
        let (comm, dev, mode) = (cx.comm, cx.dev, cx.cfg.ipc);
        if mode == GpuIpc::Off || call.op.is_p2p() {
            return Ok(false);
        }
        if matches!(dev, Device::Cpu) {
            return match mode {
                GpuIpc::On => Err(forced("the CPU device has no IPC handles (use MESHTRAIN_GPU_IPC=auto or off)")),
                _ => Ok(false),
            };
        }
        if comm.size() == 1 || call.n == 0 {
            return Ok(false);
        }
        if let Err(why) = cx.peers.check(comm, dev)? {
            return if mode == GpuIpc::On { Err(forced(&why)) } else { Ok(false) };
        }
        let records = match self.exchange(comm, dev, call)? {
            Ok(r) => r,
            Err(why) if mode == GpuIpc::On => return Err(forced(&why)),
            Err(why) => {
                log::debug!("rank {}: device collective staged: {why}", comm.rank());
                return Ok(false);
            }
        };
        let opened = self.open_peers(comm, dev, &records);
        if let Err(e) = agree(comm, opened) {
            if mode == GpuIpc::On {
                return Err(forced(&e.to_string()));
            }
            log::warn!("rank {}: IPC mapping failed, device collectives are staged from now on: {e}", comm.rank());
            cx.peers.refuse(e.to_string());
            return Ok(false);
        }
        let run = Run { comm, dev, dtype: call.dtype, n: call.n, records: &records, cache: &self.cache };
        run.op(call.op, &mut call.bufs)?;
        self.ipc_calls += 1;
        Ok(true)
    }
}

/// One call on the IPC path.
struct Run<'a> {
    comm: &'a Communicator,
    dev: &'a Device,
    dtype: DType,
    n: usize,
    records: &'a [Record],
    cache: &'a HashMap<(usize, [u8; 64]), Mapping>,
}

impl Run<'_> {
    /// Bytes of block `b` of the `n` elements.
    fn block(&self, b: usize) -> Range<usize> {
        let r = block_range(self.n, self.comm.size(), b);
        r.start * self.dtype.size()..r.end * self.dtype.size()
    }

    /// Bytes `range` of peer `p`'s input.
    fn peer(&self, p: usize, range: Range<usize>) -> Result<dipc::Borrowed<'_>> {
        let r = &self.records[p];
        if range.end > r.len || (r.status != EXPORTED && !range.is_empty()) {
            return Err(Error::InvalidArgument(format!(
                "ipc: reading bytes {}..{} of rank {p}'s {}-byte buffer (do the ranks agree on the count?)",
                range.start, range.end, r.len
            )));
        }
        let map = self.cache.get(&(p, r.handle)).ok_or_else(|| Error::Device(format!("ipc: rank {p}'s buffer is not mapped")))?;
        Ok(dipc::mapped(map, r.offset + range.start..r.offset + range.end))
    }

    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.comm.size()).filter(|&p| p != self.comm.rank())
    }

    /// Ends a phase: the stream drains, then every rank agrees it succeeded.
    fn phase(&self, f: impl FnOnce() -> Result<()>) -> Result<()> {
        let local = f().and_then(|_| self.dev.synchronize());
        agree(self.comm, local)
    }

    fn op(&self, op: Op, bufs: &mut Bufs) -> Result<()> {
        match (op, bufs) {
            (Op::AllReduce(o), Bufs::InPlace(buf)) => {
                self.phase(|| self.reduce_block(buf, o))?;
                self.phase(|| self.gather_blocks(buf))
            }
            (Op::Reduce(o, root), Bufs::InPlace(buf)) => self.phase(|| self.reduce_root(buf, o, root)),
            (Op::Broadcast(root), Bufs::InPlace(buf)) => self.phase(|| {
                if self.comm.rank() == root {
                    return Ok(());
                }
                let src = self.peer(root, 0..self.n * self.dtype.size())?;
                self.dev.copy_on_device(&mut *dipc::part_mut(buf, 0..src.len())?, &src)
            }),
            (Op::ReduceScatter(o), Bufs::Split(send, recv)) => self.phase(|| self.reduce_scatter(send, recv, o)),
            (Op::AllGather, Bufs::Split(send, recv)) => self.phase(|| self.all_gather(send, recv)),
            (Op::AllToAll, Bufs::Split(send, recv)) => self.phase(|| self.all_to_all(send, recv)),
            _ => Err(Error::InvalidArgument("ipc: buffers do not match the collective".into())),
        }
    }

    /// All-reduce, first half: this rank's block of its own buffer combined with every peer's.
    fn reduce_block(&self, buf: &mut DeviceBuffer, op: ReduceOp) -> Result<()> {
        let mine = self.block(self.comm.rank());
        if mine.is_empty() {
            return Ok(());
        }
        let elems = mine.len() / self.dtype.size();
        let mut acc = dipc::part_mut(buf, mine.clone())?;
        for p in self.peers() {
            ops::reduce_into(self.dev, self.dtype, op, &mut acc, &*self.peer(p, mine.clone())?, elems)?;
        }
        self.finish_avg(&mut acc, elems, op)
    }

    fn finish_avg(&self, acc: &mut DeviceBuffer, elems: usize, op: ReduceOp) -> Result<()> {
        if op == ReduceOp::Avg {
            ops::avg_divide(self.dev, self.dtype, acc, elems, self.comm.size())?;
        }
        Ok(())
    }

    /// All-reduce, second half: every peer's finished block copied into this rank's buffer.
    fn gather_blocks(&self, buf: &mut DeviceBuffer) -> Result<()> {
        for p in self.peers() {
            let b = self.block(p);
            if !b.is_empty() {
                let src = self.peer(p, b.clone())?;
                self.dev.copy_on_device(&mut *dipc::part_mut(buf, b)?, &src)?;
            }
        }
        Ok(())
    }

    fn reduce_root(&self, buf: &mut DeviceBuffer, op: ReduceOp, root: usize) -> Result<()> {
        if self.comm.rank() != root {
            return Ok(());
        }
        let all = 0..self.n * self.dtype.size();
        let mut acc = dipc::part_mut(buf, all.clone())?;
        for p in self.peers() {
            ops::reduce_into(self.dev, self.dtype, op, &mut acc, &*self.peer(p, all.clone())?, self.n)?;
        }
        self.finish_avg(&mut acc, self.n, op)
    }

    fn reduce_scatter(&self, send: &DeviceBuffer, recv: &mut DeviceBuffer, op: ReduceOp) -> Result<()> {
        let mine = self.block(self.comm.rank());
        if mine.is_empty() {
            return Ok(());
        }
        let elems = mine.len() / self.dtype.size();
        let own = dipc::part(send, mine.clone())?;
        let mut out = dipc::part_mut(recv, 0..mine.len())?;
        let mut peers = self.peers();
        let first = peers.next().expect("the IPC path runs on two or more ranks");
        ops::reduce(self.dev, self.dtype, op, &mut out, &own, &*self.peer(first, mine.clone())?, elems)?;
        for p in peers {
            ops::reduce_into(self.dev, self.dtype, op, &mut out, &*self.peer(p, mine.clone())?, elems)?;
        }
        self.finish_avg(&mut out, elems, op)
    }

    fn all_gather(&self, send: &DeviceBuffer, recv: &mut DeviceBuffer) -> Result<()> {
        for p in 0..self.comm.size() {
            let b = self.block(p);
            if b.is_empty() {
                continue;
            }
            let mut dst = dipc::part_mut(recv, b.clone())?;
            if p == self.comm.rank() {
                self.dev.copy_on_device(&mut dst, &*dipc::part(send, 0..b.len())?)?;
            } else {
                self.dev.copy_on_device(&mut dst, &*self.peer(p, 0..b.len())?)?;
            }
        }
        Ok(())
    }

    /// Slot `s` of `recv` receives block `me` of member `s`'s send buffer.
    fn all_to_all(&self, send: &DeviceBuffer, recv: &mut DeviceBuffer) -> Result<()> {
        let (me, mine) = (self.comm.rank(), self.block(self.comm.rank()));
        for s in 0..self.comm.size() {
            if mine.is_empty() {
                break;
            }
            let mut dst = dipc::part_mut(recv, s * mine.len()..(s + 1) * mine.len())?;
            if s == me {
                self.dev.copy_on_device(&mut dst, &*dipc::part(send, mine.clone())?)?;
            } else {
                self.dev.copy_on_device(&mut dst, &*self.peer(s, mine.clone())?)?;
            }
        }
        Ok(())
    }
}
