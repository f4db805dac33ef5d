//! Path E: device all-reduce across nodes in three stages, each on the path that suits it: a
//! reduce-scatter among the members of a node (IPC or stream-ordered), an all-reduce of each
//! member's block among the members that hold the same place on every node (FI_HMEM rings where
//! the links allow, else staged), and an all-gather within the node. Each member sends only its
//! `1/L` of the data between nodes, and the hops within a node never touch the network.
//!
//! When: the communicator spans two or more nodes (by hostname and boot id) with the same number
//! `L >= 2` of members each, on the CUDA, HIP or emu arm, with `MESHTRAIN_GPU_IPC` not off.
//! Decided from the node map every rank holds (no agreement round) at the first non-empty
//! all-reduce, which also sets the stages up: two `split`s of the communicator (collective) and a
//! device state for each part. Each stage picks its own path inside its part, so a node whose IPC
//! is impossible stages its own stages; the result is the same either way.
//!
//! Invariants: `Avg` sums in both reducing stages and divides each block once by the member
//! count. The scratch block (shareable device memory, the largest block of `n` over `L`) only
//! grows; before it is replaced both parts release their mappings and registrations, on every
//! rank at the same call (its size depends only on `n` and `L`).

use super::path::{DeviceCall, DevicePath, PathCtx};
use super::{Bufs, GpuCommConfig, GpuCommState, GpuIpc, Op};
use crate::comm::nodes::NodeMap;
use crate::comm::{block_range, Communicator, DType, ReduceOp};
use crate::device::ipc::alloc_shareable;
use crate::device::{ops, Device, DeviceBuffer};
use crate::error::{Error, Result};

/// The hierarchical path's state of one (communicator, device) pair.
#[derive(Default)]
pub(crate) struct HierState {
    /// `None` until the first all-reduce decides; then the stages, or `None` where flat.
    plan: Option<Option<Box<Stages>>>,
    calls: u64,
}

/// The two parts of the communicator and their device states.
struct Stages {
    /// The members on this node.
    local: Communicator,
    /// The members holding this member's place on every node.
    cross: Communicator,
    local_state: GpuCommState,
    cross_state: GpuCommState,
    /// This member's block between the stages (largest block bytes).
    scratch: Option<DeviceBuffer>,
}

impl HierState {
    /// All-reduces that ran in three stages so far.
    pub(crate) fn calls(&self) -> u64 {
        self.calls
    }

    /// Collective: [`GpuCommState::check`] of both parts (no-op where flat).
    pub(crate) fn check(&mut self, dev: &Device) -> Result<()> {
        if let Some(Some(s)) = &mut self.plan {
            s.local_state.check(&s.local, dev)?;
            s.cross_state.check(&s.cross, dev)?;
        }
        Ok(())
    }

    /// Collective: [`GpuCommState::release_mappings`] of both parts (no-op where flat).
    pub(crate) fn release(&mut self, dev: &Device) -> Result<()> {
        match &mut self.plan {
            Some(Some(s)) => s.release(dev),
            _ => Ok(()),
        }
    }
}

impl DevicePath for HierState {
    fn name(&self) -> &'static str {
        "hierarchical"
    }

    /// Runs an all-reduce in three stages when the communicator spans nodes evenly; `Ok(false)`:
    /// the next path (decided identically on every rank).
    fn try_call(&mut self, cx: &mut PathCtx, call: &mut DeviceCall) -> Result<bool> {
        let (Op::AllReduce(op), Bufs::InPlace(buf)) = (call.op, &mut call.bufs) else { return Ok(false) };
        if call.n == 0 {
            return Ok(false);
        }
        if self.plan.is_none() {
            self.plan = Some(plan(cx.cfg, cx.comm, cx.dev)?.map(Box::new));
        }
        let Some(Some(stages)) = &mut self.plan else { return Ok(false) };
        stages.all_reduce(cx.comm.size(), cx.dev, buf, call.n, call.dtype, op)?;
        self.calls += 1;
        Ok(true)
    }
}

/// Collective: the stages, where the communicator spans nodes evenly (see the module header).
fn plan(cfg: &GpuCommConfig, comm: &Communicator, dev: &Device) -> Result<Option<Stages>> {
    let k = comm.size();
    if k < 4 || matches!(dev, Device::Cpu) || cfg.ipc == GpuIpc::Off {
        return Ok(None);
    }
    let keys: Vec<usize> = (0..k).map(|m| comm.node_of(m)).collect();
    let map = NodeMap::new(&keys);
    let Ok((nodes, per)) = map.uniform() else { return Ok(None) };
    let me = comm.rank();
    let place = map.place(me);
    let part = |color: usize, what: &str| -> Result<Communicator> {
        comm.split(Some(color as u32), me as i64)?
            .ok_or_else(|| Error::InvalidArgument(format!("hierarchical all-reduce: no {what} communicator")))
    };
    let (local, cross) = (part(map.node[me], "node")?, part(place, "cross-node")?);
    if me == 0 {
        log::info!(
            "device all-reduce: hierarchical over {nodes} nodes x {per} ranks (reduce-scatter and all-gather within a node, \
             all-reduce of each rank's 1/{per} between nodes)"
        );
    }
    let (local_state, cross_state) = (GpuCommState::new(cfg.clone()), GpuCommState::new(cfg.clone()));
    Ok(Some(Stages { local, cross, local_state, cross_state, scratch: None }))
}

impl Stages {
    fn all_reduce(&mut self, k: usize, dev: &Device, buf: &mut DeviceBuffer, n: usize, dtype: DType, op: ReduceOp) -> Result<()> {
        let most = block_range(n, self.local.size(), 0).len() * dtype.size();
        if self.scratch.as_ref().is_none_or(|s| s.len() < most) {
            if self.scratch.is_some() {
                self.release(dev)?;
            }
            self.scratch = None;
            self.scratch = Some(alloc_shareable(dev, most)?);
        }
        let scratch = self.scratch.as_mut().expect("allocated above");
        let mine = self.local.block(n).len();
        let inner = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
        self.local_state.bind(&self.local, dev).reduce_scatter_into(buf, scratch, n, dtype, inner)?;
        self.cross_state.bind(&self.cross, dev).all_reduce(scratch, mine, dtype, inner)?;
        if op == ReduceOp::Avg && mine > 0 {
            ops::avg_divide(dev, dtype, scratch, mine, k)?;
        }
        self.local_state.bind(&self.local, dev).all_gather_into(scratch, buf, n, dtype)
    }

    fn release(&mut self, dev: &Device) -> Result<()> {
        self.local_state.release_mappings(&self.local, dev)?;
        self.cross_state.release_mappings(&self.cross, dev)
    }
}
