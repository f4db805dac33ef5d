//! Path C: device send/recv posted straight from and to the device buffer over a libfabric link
//! (FI_HMEM registration), skipping the copy through pinned host memory.
//!
//! When: the link to the peer is a libfabric link, both ends' endpoints were opened with FI_HMEM
//! and neither has `MESHTRAIN_GPU_DIRECT=off` ([`crate::transport::DirectPeer::choice`], which
//! both ends compute from the same two capability bytes exchanged at link setup, so they always
//! agree). Otherwise the call is staged ([`super::staged`]); with `MESHTRAIN_GPU_DIRECT=on` that
//! is a configuration error naming the variable and why. The choice is logged once per
//! (communicator state, peer, direction).
//!
//! Registrations ([`Registrations`], shared with the FI_HMEM rings) are cached per (address,
//! length) of the buffer and closed when the state is dropped or
//! [`super::GpuCommState::release_mappings`] runs: as for IPC mappings, release them before
//! freeing buffers that device send/recv used, since a new allocation at the same address must
//! not inherit an old registration.

use std::collections::{HashMap, HashSet};

use super::path::{DeviceCall, DevicePath, PathCtx};
use crate::comm::device::{Bufs, Op};
use crate::comm::Communicator;
use crate::device::{Device, DeviceBuffer};
use crate::error::{Error, Result};
use crate::transport::select::GpuDirect;
use crate::transport::{DirectMr, DirectPeer, MemIface};

/// Registrations kept at most; beyond, the cache starts over (bounded pinned memory).
const MAX_REGISTRATIONS: usize = 64;

/// One direction of a point-to-point device transfer.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Dir {
    Send,
    Recv,
}

/// Registrations of whole buffers, keyed by (address, length); one endpoint per process, so a
/// registration serves every link.
#[derive(Default)]
pub(crate) struct Registrations(HashMap<(usize, usize), DirectMr>);

/// A buffer's memory as libfabric registers it: start, length, interface.
pub(crate) type Memory = (*mut u8, usize, MemIface);

impl Registrations {
    /// Registers whatever of `want` is not registered yet on `link`'s endpoint (starting the
    /// cache over first if it would exceed [`MAX_REGISTRATIONS`], so all of `want` stay).
    pub(crate) fn ensure(&mut self, link: &DirectPeer, want: &[Memory], what: &str) -> Result<()> {
        let missing = want.iter().filter(|(a, l, _)| !self.0.contains_key(&(*a as usize, *l))).count();
        if self.0.len() + missing > MAX_REGISTRATIONS {
            self.0.clear();
        }
        for &(addr, len, iface) in want {
            if let std::collections::hash_map::Entry::Vacant(slot) = self.0.entry((addr as usize, len)) {
                let mr = link.register(addr, len, iface).map_err(|e| match e {
                    Error::Fabric(why) => Error::Fabric(format!(
                        "{what}: {why} (MESHTRAIN_GPU_DIRECT=off stages through host memory instead)"
                    )),
                    other => other,
                })?;
                slot.insert(mr);
            }
        }
        Ok(())
    }

    /// The registration of `mem` ([`Registrations::ensure`]d before).
    pub(crate) fn get(&self, mem: &Memory) -> Result<&DirectMr> {
        self.0
            .get(&(mem.0 as usize, mem.1))
            .ok_or_else(|| Error::InvalidArgument(format!("device-direct: {} bytes at {:p} are not registered", mem.1, mem.0)))
    }

    /// Closes every registration.
    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }
}

/// The point-to-point direct path's state of one (communicator, device) pair (the registrations
/// are shared with the rings: [`PathCtx::regs`]).
#[derive(Default)]
pub(crate) struct P2pState {
    logged: HashSet<(usize, Dir)>,
    direct: u64,
    staged: u64,
}

impl P2pState {
    /// (send/recv calls that went direct, send/recv calls staged) so far.
    pub(crate) fn counts(&self) -> (u64, u64) {
        (self.direct, self.staged)
    }

    fn staged(&mut self, comm: &Communicator, peer: usize, dir: Dir, why: &str) {
        self.staged += 1;
        if self.logged.insert((peer, dir)) {
            log::info!("device {} rank {}: staged ({why})", dir.phrase(), comm.world_rank(peer));
        }
    }
}

impl DevicePath for P2pState {
    fn name(&self) -> &'static str {
        "p2p"
    }

    /// Sends (`Op::Send`, a read-only buffer) or receives (`Op::Recv`) the first `n` elements of
    /// the buffer to or from the peer directly when the link allows; `Ok(false)`: the next path
    /// (staged) runs the call instead.
    fn try_call(&mut self, cx: &mut PathCtx, call: &mut DeviceCall) -> Result<bool> {
        let (dir, peer) = match call.op {
            Op::Send(peer) => (Dir::Send, peer),
            Op::Recv(peer) => (Dir::Recv, peer),
            _ => return Ok(false),
        };
        let (comm, dev, regs, mode) = (cx.comm, cx.dev, &mut *cx.regs, cx.cfg.gpu_direct);
        if mode == GpuDirect::Off {
            self.staged(comm, peer, dir, "MESHTRAIN_GPU_DIRECT=off");
            return Ok(false);
        }
        let world = comm.world_rank(peer);
        let Some(link) = comm.direct_peer(peer)? else {
            let why = "the link is not a libfabric link";
            if mode == GpuDirect::On {
                return Err(forced_error(world, why));
            }
            self.staged(comm, peer, dir, why);
            return Ok(false);
        };
        if let Err(why) = link.choice() {
            if link.forced() {
                return Err(forced_error(world, &why));
            }
            self.staged(comm, peer, dir, &why);
            return Ok(false);
        }
        let mem = memory(dev, &mut call.bufs)?;
        let (addr, iface) = (mem.0, mem.2);
        regs.ensure(&link, &[mem], &format!("device-direct {} with rank {world}", dir.name()))?;
        let mr = regs.get(&mem)?;
        // Kernels queued on the buffer (writing what is sent, or reading what a receive
        // overwrites) finish before the NIC touches it.
        dev.synchronize()?;
        if self.logged.insert((peer, dir)) {
            log::info!("device {} rank {world}: FI_HMEM direct (provider {}, iface {})", dir.phrase(), link.provider(), iface.name());
        }
        let (count, dtype) = (call.n, call.dtype);
        let bytes = count * dtype.size();
        comm.run_direct(dir == Dir::Send, peer, count, dtype, |w| match dir {
            Dir::Send => link.send(mr, addr, bytes, w),
            Dir::Recv => link.recv(mr, addr, bytes, w),
        })?;
        self.direct += 1;
        Ok(true)
    }
}

impl Dir {
    fn name(self) -> &'static str {
        match self {
            Dir::Send => "send",
            Dir::Recv => "recv",
        }
    }

    fn phrase(self) -> &'static str {
        match self {
            Dir::Send => "send to",
            Dir::Recv => "recv from",
        }
    }
}

/// Error for `MESHTRAIN_GPU_DIRECT=on` where a transfer cannot go direct.
fn forced_error(peer: usize, why: &str) -> Error {
    Error::config(
        "MESHTRAIN_GPU_DIRECT",
        format!("on, but device send/recv with rank {peer} cannot skip host staging: {why}"),
    )
}

/// Start address, length and memory interface of the call's buffer (whose arm the caller
/// checked against `dev`); host memory is borrowed for writing when the call receives.
fn memory(dev: &Device, bufs: &mut Bufs) -> Result<Memory> {
    let host = match bufs {
        Bufs::ReadOnly(DeviceBuffer::Host(h) | DeviceBuffer::Emu(h)) => Some(h.bytes().as_ptr() as *mut u8),
        Bufs::InPlace(DeviceBuffer::Host(h) | DeviceBuffer::Emu(h)) => Some(h.bytes_mut().as_mut_ptr()),
        _ => None,
    };
    let buf = bufs.input()?;
    let len = buf.len();
    if let Some(p) = host {
        return Ok((p, len, MemIface::System));
    }
    device_memory(dev, buf)
}

/// Start, length and memory interface of a buffer of the CUDA, HIP or emu arm (emu memory is
/// host memory, registered as FI_HMEM_SYSTEM).
pub(crate) fn device_memory(dev: &Device, buf: &DeviceBuffer) -> Result<Memory> {
    let address = buf.device_address(dev, "device-direct", 0)? as *mut u8;
    Ok(match dev {
        Device::Cuda(d) => (address, buf.len(), MemIface::Cuda(d.ordinal())),
        Device::Emu(_) => (address, buf.len(), MemIface::System),
        _ => (address, buf.len(), MemIface::Rocr),
    })
}
