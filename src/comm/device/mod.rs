//! Collectives on device buffers ([`DeviceBuffer`] + [`Device`]) over a host [`Communicator`].
//!
//! Six paths carry them, each behind the one [`path::DevicePath`] trait; [`path::order`] is the
//! one place that says which paths an operation may take and in which order:
//! - **Stream-ordered** ([`oneshot`], small calls between GPUs of one node, the tensor- and
//!   sequence-parallel calls of every layer): each rank publishes its input into a workspace its
//!   peers mapped once, signals a flag and waits for the peers' flags in kernels on its own
//!   stream; no host sync, no host message per call. Errors are found at [`GpuCommState::check`].
//! - **IPC** ([`peer_mapped`], GPUs of one node): every rank maps its peers' buffers through IPC
//!   handles exchanged over the host communicator, and the GPU reduce kernels read peers' memory
//!   directly; mappings are cached per (peer, allocation). Used when every rank of the
//!   communicator runs on this node, in its own process, on a GPU whose buffers can be exported.
//! - **Hierarchical** (`hier`, all-reduce over several nodes with the same number of ranks
//!   each): reduce-scatter within the node, all-reduce of each rank's block between nodes,
//!   all-gather within the node, each stage on its own best path.
//! - **FI_HMEM rings** (`fabric_ring`, all-reduce, reduce-scatter, all-gather and broadcast when
//!   every rank's ring links are libfabric links whose ends offer FI_HMEM): ring hops post the
//!   device buffers themselves.
//! - **Point-to-point** (`p2p`, send/recv over a libfabric link whose two ends offer FI_HMEM): the
//!   device buffer is registered and posted itself; `MESHTRAIN_GPU_DIRECT=auto|on|off`.
//! - **Staged** ([`staged`], everything else: the CPU arm, `MESHTRAIN_GPU_IPC=off` within a node,
//!   links without FI_HMEM): chunks go through pinned host memory and the host collectives,
//!   double-buffered.
//!
//! Environment (parsed by [`crate::env`], applied by [`GpuCommConfig::from_env`], the same on
//! every rank):
//! `MESHTRAIN_GPU_IPC=auto|on|off` (`on` where IPC is impossible is an error; `off` also turns the
//! stream-ordered path off), `MESHTRAIN_GPU_STAGE_CHUNK` (bytes per staged chunk, e.g. `4M`),
//! `MESHTRAIN_GPU_ONESHOT` (largest bytes a rank publishes in a stream-ordered call, default
//! `1M`; `0` turns the path off) and `MESHTRAIN_GPU_DIRECT` (checked against the transport by
//! [`crate::transport::select`]).
//!
//! Invariants: every member calls the same collectives in the same order with the same counts,
//! element type and operator (as for the host API); the path choice depends only on facts every
//! rank agrees on (configuration, an exchange of node and process ids, an agreed export and
//! open status); sizes are checked before anything moves, with errors naming the operation and
//! bytes. A [`GpuCommState`] belongs to one (communicator, device) pair.

#[cfg(feature = "ofi")]
mod fabric_ring;
mod hier;
pub mod oneshot;
#[cfg(feature = "ofi")]
mod p2p;
pub(crate) mod path;
pub mod peer_mapped;
pub mod staged;
#[cfg(test)]
mod tests;

use crate::comm::{Communicator, DType, ReduceOp};
use crate::device::{Device, DeviceBuffer};
pub use crate::env::{GpuDirect, GpuIpc};
use crate::env;
use crate::error::{Error, Result};
use path::{DeviceCall, PathCtx, Paths};

/// Tunables of the device collectives (the same on every rank).
#[derive(Debug, Clone)]
pub struct GpuCommConfig {
    /// IPC path choice.
    pub ipc: GpuIpc,
    /// Bytes per staged chunk (the host collective's buffer size per step).
    pub stage_chunk: usize,
    /// Largest bytes one rank publishes in a stream-ordered call (0: never stream-ordered).
    pub oneshot_bytes: usize,
    /// Whether send/recv may post device buffers to libfabric directly.
    pub gpu_direct: GpuDirect,
    /// Whether the training step reduces device-memory gradient buckets on a communication
    /// thread while the backward runs (`MESHTRAIN_GPU_OVERLAP`, default on).
    pub overlap: bool,
}

impl Default for GpuCommConfig {
    fn default() -> Self {
        GpuCommConfig { ipc: GpuIpc::Auto, stage_chunk: 4 << 20, oneshot_bytes: 1 << 20, gpu_direct: GpuDirect::Auto, overlap: true }
    }
}

impl GpuCommConfig {
    /// Defaults overridden by `MESHTRAIN_GPU_IPC`, `MESHTRAIN_GPU_STAGE_CHUNK`,
    /// `MESHTRAIN_GPU_ONESHOT`, `MESHTRAIN_GPU_DIRECT` and `MESHTRAIN_GPU_OVERLAP`.
    pub fn from_env() -> Result<Self> {
        let d = GpuCommConfig::default();
        // Read in this order so that, of several bad variables, the same one is reported as before.
        let gpu_direct = env::gpu_direct()?;
        Ok(GpuCommConfig {
            ipc: env::gpu_ipc()?.unwrap_or(d.ipc),
            stage_chunk: env::gpu_stage_chunk()?.unwrap_or(d.stage_chunk),
            oneshot_bytes: env::gpu_oneshot()?.unwrap_or(d.oneshot_bytes),
            gpu_direct,
            overlap: env::gpu_overlap()?.unwrap_or(d.overlap),
        })
    }
}

/// What device collectives keep between calls: the configuration, the state the paths share
/// (the agreed peer-mapping eligibility, the FI_HMEM registrations) and every path's own (staging
/// memory, IPC mappings, stream-ordered workspaces, ...). One per (communicator, device) pair;
/// [`GpuCommState::bind`] gives the collectives.
pub struct GpuCommState {
    cfg: GpuCommConfig,
    peers: peer_mapped::PeerAccess,
    #[cfg(feature = "ofi")]
    regs: p2p::Registrations,
    paths: Paths,
    /// Collective calls other than send/recv.
    calls: u64,
}

impl GpuCommState {
    /// State for `cfg`; allocates nothing until the first call.
    pub fn new(cfg: GpuCommConfig) -> Self {
        GpuCommState {
            cfg,
            peers: peer_mapped::PeerAccess::default(),
            #[cfg(feature = "ofi")]
            regs: p2p::Registrations::default(),
            paths: Paths::default(),
            calls: 0,
        }
    }

    /// The collectives of `comm` on `dev`'s buffers.
    pub fn bind<'a>(&'a mut self, comm: &'a Communicator, dev: &'a Device) -> DeviceCollectives<'a> {
        DeviceCollectives { comm, dev, state: self }
    }

    /// (calls that took the IPC path, collective calls other than send/recv) so far.
    pub fn path_counts(&self) -> (u64, u64) {
        (self.paths.ipc.ipc_calls(), self.calls)
    }

    /// Calls that took the stream-ordered path so far.
    pub fn stream_ordered_calls(&self) -> u64 {
        self.paths.oneshot.calls()
    }

    /// Collective: waits for this rank's queued device collectives and returns an error on every
    /// rank if a stream-ordered call failed on any (a peer silent past the deadline, or in a
    /// different collective), naming the rank, the peer and the calls. The training step runs it
    /// once per step before applying an update; results of calls after a failure are unusable.
    pub fn check(&mut self, comm: &Communicator, dev: &Device) -> Result<()> {
        self.paths.oneshot.check(comm, dev)?;
        self.paths.hier.check(dev)
    }

    /// All-reduces that ran in three stages across nodes (within, between, within) so far.
    pub fn hierarchical_calls(&self) -> u64 {
        self.paths.hier.calls()
    }

    /// Collective calls that ran as FI_HMEM rings (device memory to device memory across links)
    /// so far.
    pub fn ring_calls(&self) -> u64 {
        #[cfg(feature = "ofi")]
        return self.paths.ring.calls();
        #[cfg(not(feature = "ofi"))]
        0
    }

    /// (send/recv calls posted straight from/to the device buffer, send/recv calls staged) so far.
    pub fn direct_counts(&self) -> (u64, u64) {
        #[cfg(feature = "ofi")]
        return self.paths.p2p.counts();
        #[cfg(not(feature = "ofi"))]
        (0, 0)
    }

    /// Closes every peer mapping and device-direct registration this rank cached, then waits for
    /// every rank to do the same (collective). Call it before freeing buffers that IPC
    /// collectives or device send/recv used: a peer must not hold a mapping of a freed
    /// allocation, nor may a new allocation inherit a registration. The stream-ordered
    /// workspaces are freed too (set up again by the next call).
    pub fn release_mappings(&mut self, comm: &Communicator, dev: &Device) -> Result<()> {
        self.paths.hier.release(dev)?;
        self.paths.oneshot.release(comm, dev)?;
        self.paths.ipc.release(dev)?;
        #[cfg(feature = "ofi")]
        self.regs.clear();
        comm.barrier()
    }
}

/// The buffers of one call: in place, or an input and an output, or a buffer only read (send).
pub(crate) enum Bufs<'b> {
    InPlace(&'b mut DeviceBuffer),
    Split(&'b DeviceBuffer, &'b mut DeviceBuffer),
    ReadOnly(&'b DeviceBuffer),
}

impl Bufs<'_> {
    pub(crate) fn input(&self) -> Result<&DeviceBuffer> {
        Ok(match self {
            Bufs::InPlace(b) => b,
            Bufs::Split(i, _) => i,
            Bufs::ReadOnly(b) => b,
        })
    }

    pub(crate) fn output(&mut self) -> Result<&mut DeviceBuffer> {
        match self {
            Bufs::InPlace(b) => Ok(b),
            Bufs::Split(_, o) => Ok(o),
            Bufs::ReadOnly(_) => Err(Error::InvalidArgument("device collective: a send buffer is never written".into())),
        }
    }
}

/// Errors unless `buf` belongs to `dev`'s arm and holds `n` elements of `dtype`.
fn check_buf(op: &str, what: &str, dev: &Device, buf: &DeviceBuffer, n: usize, dtype: DType) -> Result<()> {
    let dev_arm = dev.arm();
    if buf.arm() != dev_arm {
        return Err(Error::InvalidArgument(format!("{op}: `{what}` is a {} buffer but the device is {dev_arm}", buf.arm())));
    }
    let need = n.checked_mul(dtype.size()).ok_or_else(|| Error::InvalidArgument(format!("{op}: {n} elements overflow")))?;
    if buf.len() < need {
        return Err(Error::InvalidArgument(format!(
            "{op}: `{what}` holds {} bytes, but {n} {} elements need {need}",
            buf.len(),
            dtype.name()
        )));
    }
    Ok(())
}

fn check_rank(op: &str, what: &str, r: usize, comm: &Communicator) -> Result<()> {
    if r >= comm.size() {
        return Err(Error::InvalidArgument(format!("{op}: {what} {r} out of range (size {})", comm.size())));
    }
    Ok(())
}

/// One operation as the paths see it (its operator, root or peer included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    AllReduce(ReduceOp),
    Broadcast(usize),
    Reduce(ReduceOp, usize),
    ReduceScatter(ReduceOp),
    AllGather,
    AllToAll,
    /// Send to a member (its buffer is only read).
    Send(usize),
    /// Receive from a member.
    Recv(usize),
}

impl Op {
    /// The operation's name, as the host API spells it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::AllReduce(_) => "all_reduce",
            Op::Broadcast(_) => "broadcast",
            Op::Reduce(..) => "reduce",
            Op::ReduceScatter(_) => "reduce_scatter",
            Op::AllGather => "all_gather",
            Op::AllToAll => "all_to_all",
            Op::Send(_) => "send",
            Op::Recv(_) => "recv",
        }
    }

    /// Send or receive (not a collective: not counted, other paths).
    pub(crate) fn is_p2p(self) -> bool {
        matches!(self, Op::Send(_) | Op::Recv(_))
    }
}

/// The collectives of one communicator on one device's buffers. Counts are elements of `dtype`;
/// buffers may be larger than a call needs (only the first bytes are used).
pub struct DeviceCollectives<'a> {
    comm: &'a Communicator,
    dev: &'a Device,
    state: &'a mut GpuCommState,
}

impl DeviceCollectives<'_> {
    /// In-place all-reduce of the first `n` elements of `buf`.
    pub fn all_reduce(&mut self, buf: &mut DeviceBuffer, n: usize, dtype: DType, op: ReduceOp) -> Result<()> {
        check_buf("all_reduce", "buf", self.dev, buf, n, dtype)?;
        self.run(Op::AllReduce(op), Bufs::InPlace(buf), n, dtype)
    }

    /// Broadcast of the first `n` elements of `buf` from member `root`.
    pub fn broadcast(&mut self, buf: &mut DeviceBuffer, n: usize, dtype: DType, root: usize) -> Result<()> {
        check_rank("broadcast", "root", root, self.comm)?;
        check_buf("broadcast", "buf", self.dev, buf, n, dtype)?;
        self.run(Op::Broadcast(root), Bufs::InPlace(buf), n, dtype)
    }

    /// In-place reduce onto `root`: the root's first `n` elements receive the result, other
    /// ranks' buffers are unchanged.
    pub fn reduce(&mut self, buf: &mut DeviceBuffer, n: usize, dtype: DType, op: ReduceOp, root: usize) -> Result<()> {
        check_rank("reduce", "root", root, self.comm)?;
        check_buf("reduce", "buf", self.dev, buf, n, dtype)?;
        self.run(Op::Reduce(op, root), Bufs::InPlace(buf), n, dtype)
    }

    /// Reduce-scatter of `send` (`n` elements): `recv` receives this rank's block
    /// (`comm.block(n).len()` elements).
    pub fn reduce_scatter_into(
        &mut self,
        send: &DeviceBuffer,
        recv: &mut DeviceBuffer,
        n: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        check_buf("reduce_scatter", "send", self.dev, send, n, dtype)?;
        check_buf("reduce_scatter", "recv", self.dev, recv, self.comm.block(n).len(), dtype)?;
        self.run(Op::ReduceScatter(op), Bufs::Split(send, recv), n, dtype)
    }

    /// All-gather into `recv` (`n` elements) of every rank's block, which `send` holds
    /// (`comm.block(n).len()` elements).
    pub fn all_gather_into(&mut self, send: &DeviceBuffer, recv: &mut DeviceBuffer, n: usize, dtype: DType) -> Result<()> {
        check_buf("all_gather", "send", self.dev, send, self.comm.block(n).len(), dtype)?;
        check_buf("all_gather", "recv", self.dev, recv, n, dtype)?;
        self.run(Op::AllGather, Bufs::Split(send, recv), n, dtype)
    }

    /// All-to-all: `send` (`n` elements) is cut into `size` blocks ([`block_range`]), block `b`
    /// going to member `b`; `recv` holds `size` slots of `comm.block(n).len()` elements, slot `s`
    /// receiving member `s`'s block for this rank.
    pub fn all_to_all_into(&mut self, send: &DeviceBuffer, recv: &mut DeviceBuffer, n: usize, dtype: DType) -> Result<()> {
        check_buf("all_to_all", "send", self.dev, send, n, dtype)?;
        check_buf("all_to_all", "recv", self.dev, recv, self.comm.block(n).len() * self.comm.size(), dtype)?;
        self.run(Op::AllToAll, Bufs::Split(send, recv), n, dtype)
    }

    /// Sends the first `n` elements of `buf` to member `peer` (which calls [`Self::recv_into`]
    /// with the same count). Direct over libfabric where both ends allow it, else staged.
    pub fn send(&mut self, buf: &DeviceBuffer, n: usize, dtype: DType, peer: usize) -> Result<()> {
        self.check_peer("send", peer)?;
        check_buf("send", "buf", self.dev, buf, n, dtype)?;
        self.run(Op::Send(peer), Bufs::ReadOnly(buf), n, dtype)
    }

    /// Receives `n` elements from member `peer` into the start of `buf`. Direct over libfabric
    /// where both ends allow it, else staged.
    pub fn recv_into(&mut self, buf: &mut DeviceBuffer, n: usize, dtype: DType, peer: usize) -> Result<()> {
        self.check_peer("recv", peer)?;
        check_buf("recv", "buf", self.dev, buf, n, dtype)?;
        self.run(Op::Recv(peer), Bufs::InPlace(buf), n, dtype)
    }

    fn check_peer(&self, op: &str, peer: usize) -> Result<()> {
        check_rank(op, "peer", peer, self.comm)?;
        if peer == self.comm.rank() {
            return Err(Error::InvalidArgument(format!("{op}: peer {peer} is this rank")));
        }
        Ok(())
    }

    /// Runs one call on the path [`path::order`] chooses for it.
    fn run(&mut self, op: Op, bufs: Bufs, n: usize, dtype: DType) -> Result<()> {
        let st = &mut *self.state;
        if !op.is_p2p() {
            st.calls += 1;
        }
        let mut cx = PathCtx {
            comm: self.comm,
            dev: self.dev,
            cfg: &st.cfg,
            peers: &mut st.peers,
            #[cfg(feature = "ofi")]
            regs: &mut st.regs,
        };
        st.paths.run(&mut cx, DeviceCall { op, bufs, n, dtype })
    }
}
