//! The device collective paths behind one trait, and the one place that chooses among them.
//!
//! Why: each path (stream-ordered, IPC, hierarchical, FI_HMEM ring, point-to-point direct,
//! staged) used to take the same eight to ten arguments and was tried from a hand-written chain,
//! one for the collectives and another for send/recv. Now a call is one [`DeviceCall`], what the
//! paths share is one [`PathCtx`], every path implements [`DevicePath`], and [`order`] is the only
//! place that says which paths an operation may take and in which order (like NCCL's tuner).
//!
//! The order (the first path that takes a call runs it; the staged path takes every call):
//! - collectives: stream-ordered ([`super::oneshot`]), IPC ([`super::peer_mapped`]), hierarchical
//!   ([`super::hier`]), FI_HMEM ring (`fabric_ring`), staged ([`super::staged`]). Cheapest
//!   first: the stream-ordered path only queues kernels (small calls within a node); IPC
//!   synchronizes and maps peers' buffers (any size within a node); the hierarchical all-reduce
//!   splits a call that spans nodes into stages that choose again inside each node and between
//!   nodes; rings post device memory to the NIC between nodes; staging through pinned host
//!   memory works everywhere, the CPU arm included.
//! - send/recv: point-to-point FI_HMEM (`p2p`), staged.
//!
//! Invariants: a path takes or declines a call only from facts every member agrees on (the
//! configuration, agreed eligibility, the call itself), so every member runs a call on the same
//! path; a path that declines has moved no data, so the next one starts from the caller's
//! buffers; the staged path never declines, so every call runs somewhere.

use super::hier::HierState;
use super::peer_mapped::{IpcState, PeerAccess};
use super::oneshot::OneShot;
use super::staged::Staged;
use super::{Bufs, GpuCommConfig, Op};
use crate::comm::{Communicator, DType};
use crate::device::Device;
use crate::error::{Error, Result};
#[cfg(feature = "ofi")]
use super::p2p::{P2pState, Registrations};
#[cfg(feature = "ofi")]
use super::fabric_ring::RingState;

/// One device call as every path sees it.
pub(crate) struct DeviceCall<'b> {
    /// The operation, with its operator, root or peer.
    pub(crate) op: Op,
    /// Its buffers (checked against the device, the count and the element type before).
    pub(crate) bufs: Bufs<'b>,
    /// Elements of the whole call (the blocked operations cut it into `block_range` blocks).
    pub(crate) n: usize,
    /// Element type.
    pub(crate) dtype: DType,
}

/// What the paths share besides the call: the communicator, the device, the configuration, and
/// the state more than one path uses.
pub(crate) struct PathCtx<'a> {
    pub(crate) comm: &'a Communicator,
    pub(crate) dev: &'a Device,
    pub(crate) cfg: &'a GpuCommConfig,
    /// Whether the members may map each other's device memory (the IPC and stream-ordered paths).
    pub(crate) peers: &'a mut PeerAccess,
    /// FI_HMEM registrations of device buffers (the ring and point-to-point paths).
    #[cfg(feature = "ofi")]
    pub(crate) regs: &'a mut Registrations,
}

/// One way of running device calls.
pub(crate) trait DevicePath {
    /// The path's name (logs and errors).
    fn name(&self) -> &'static str;

    /// Runs `call` when this path applies to it: `Ok(true)` when it ran, `Ok(false)` when the
    /// next path of [`order`] is to try (decided identically on every member).
    fn try_call(&mut self, cx: &mut PathCtx, call: &mut DeviceCall) -> Result<bool>;
}

/// The paths, as [`order`] names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PathId {
    StreamOrdered,
    Ipc,
    Hierarchical,
    FabricRing,
    PointToPoint,
    Staged,
}

/// The paths `op` may take, in the order they are tried (see the module header).
pub(crate) fn order(op: Op) -> &'static [PathId] {
    use PathId::*;
    match op {
        Op::Send(_) | Op::Recv(_) => &[PointToPoint, Staged],
        _ => &[StreamOrdered, Ipc, Hierarchical, FabricRing, Staged],
    }
}

/// The state of every path of one (communicator, device) pair.
#[derive(Default)]
pub(crate) struct Paths {
    pub(crate) oneshot: OneShot,
    pub(crate) ipc: IpcState,
    pub(crate) hier: HierState,
    #[cfg(feature = "ofi")]
    pub(crate) ring: RingState,
    #[cfg(feature = "ofi")]
    pub(crate) p2p: P2pState,
    pub(crate) staged: Staged,
}

impl Paths {
    /// Path `id`; `None` where this build lacks it (no `ofi` feature).
    fn get(&mut self, id: PathId) -> Option<&mut dyn DevicePath> {
        Some(match id {
            PathId::StreamOrdered => &mut self.oneshot,
            PathId::Ipc => &mut self.ipc,
            PathId::Hierarchical => &mut self.hier,
            #[cfg(feature = "ofi")]
            PathId::FabricRing => &mut self.ring,
            #[cfg(feature = "ofi")]
            PathId::PointToPoint => &mut self.p2p,
            #[cfg(not(feature = "ofi"))]
            PathId::FabricRing | PathId::PointToPoint => return None,
            PathId::Staged => &mut self.staged,
        })
    }

    /// Runs `call` on the first path of [`order`] that takes it.
    pub(crate) fn run(&mut self, cx: &mut PathCtx, mut call: DeviceCall) -> Result<()> {
        for &id in order(call.op) {
            let Some(path) = self.get(id) else { continue };
            if path.try_call(cx, &mut call)? {
                log::trace!("rank {}: device {} of {} {} on the {} path", cx.comm.rank(), call.op.name(), call.n, call.dtype.name(), path.name());
                return Ok(());
            }
        }
        // The staged path takes every call: reaching this is a broken invariant, reported as an
        // error rather than a panic of the training step.
        Err(Error::Device(format!("device collective {}: no path took the call", call.op.name())))
    }
}
