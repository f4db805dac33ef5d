//! Hierarchical host collectives for communicators whose members span several nodes: shared
//! memory (or CMA) within a node, the network between nodes, each crossed as few times as the
//! collective allows.
//!
//! Why: a flat ring over `k = n·L` ranks (n nodes, L ranks each) sends `2(k-1)/k` of an
//! all-reduce's buffer over each of the n links that leave a node, all of it through the one rank
//! at the node's end of the ring. In stages, every rank sends only `2(n-1)/n` of its `1/L` share
//! between nodes: the minimum for the node as a whole, spread over all L ranks.
//!
//! Two stage communicators, made without messages from the node map every member holds (their
//! links are opened by the first call that runs in stages, on every member at the same call):
//! `local`, the members of this node (member order: local rank = place), and `cross`, the members
//! holding this member's place on every node (node order: cross rank = node index).
//! - all-reduce: local reduce-scatter (place `p` gets block `p` of `L`), cross all-reduce of that
//!   block, local all-gather;
//! - reduce-scatter: the world blocks are copied into a padded buffer of `k` slots of the largest
//!   block, ordered by (place, node), so that place `p`'s slots are contiguous; local
//!   reduce-scatter gives place `p` its `n` slots, cross reduce-scatter gives node `a` slot
//!   `(p, a)`, which is this member's world block;
//! - all-gather: the reverse (cross all-gather of the slots of place `p`, local all-gather of the
//!   places, slots copied to their world blocks);
//! - broadcast: the root's node broadcasts within itself, each place broadcasts its `1/L` part
//!   from the root's node to the others, every other node all-gathers its parts.
//!
//! Invariants: decided identically on every member (the tuner's choice; see
//! [`crate::comm::tuner::choose`]); `Avg` sums in every stage and divides once by the member count;
//! summation order: within a node in the local ring's order, then between nodes in the cross
//! ring's order (with exact inputs, the same bits as the flat schedules). The stage communicators'
//! inter-node bytes count for this communicator; reduce and all-to-all stay flat.

use std::sync::Mutex;

use super::{child_id, Call, Communicator};
use crate::comm::block_range;
use crate::dtype::{DType, ReduceOp, Reducer};
use crate::error::Result;

/// The stage communicators and this member's coordinates.
pub(super) struct Stages {
    local: Communicator,
    cross: Communicator,
    /// Nodes, ranks per node.
    nodes: usize,
    per: usize,
    /// This member's rank, node and place.
    me: usize,
    node: usize,
    place: usize,
    /// (node, place) of every member.
    coords: Vec<(usize, usize)>,
    /// The padded slot buffer of reduce-scatter and all-gather (grows, never shrinks).
    slots: Mutex<Vec<u8>>,
}

impl Stages {
    /// The stage communicators of `comm` (links to their ring neighbours opened here, so every
    /// member must get here at the same call).
    fn new(comm: &Communicator) -> Result<Stages> {
        let (nodes, per) = comm.nodes.uniform().map_err(crate::error::Error::InvalidArgument)?;
        let (me, map) = (comm.rank, &comm.nodes);
        let (node, place) = (map.node[me], map.place(me));
        let world = |ms: Vec<usize>| ms.iter().map(|&m| comm.members[m]).collect::<Vec<_>>();
        let local = world(map.members[node].clone());
        let cross = world((0..nodes).map(|a| map.member(a, place)).collect());
        let make = |id, members, rank| {
            let parts = (id, members, rank);
            Communicator::with_counter(comm.connector.clone(), parts, comm.cfg.clone(), comm.net_sent.clone())
        };
        let local = make(child_id(comm.id, u64::MAX, node as u64), local, place)?;
        let cross = make(child_id(comm.id, u64::MAX - 1, place as u64), cross, node)?;
        let coords = (0..comm.size()).map(|m| (map.node[m], map.place(m))).collect();
        Ok(Stages { local, cross, nodes, per, me, node, place, coords, slots: Mutex::default() })
    }

    /// The slot index of the member at (`node`, `place`): ordered by place, then node.
    fn slot(&self, node: usize, place: usize) -> usize {
        place * self.nodes + node
    }

    fn all_reduce(&self, dtype: DType, input: Option<&[u8]>, out: &mut [u8], red: &Reducer) -> Result<()> {
        let (n, es, sum) = (out.len() / dtype.size(), dtype.size(), stage_reducer(red));
        if let Some(i) = input {
            out.copy_from_slice(i);
        }
        self.local.collective(dtype, Call::ReduceScatter { input: None, out: &mut *out, n, red: sum })?;
        let mine = block_range(n, self.per, self.place);
        let block = &mut out[mine.start * es..mine.end * es];
        self.cross.collective(dtype, Call::AllReduce { input: None, out: &mut *block, red: sum })?;
        red.finalize(block, self.nodes * self.per);
        self.local.collective(dtype, Call::AllGather { input: None, out })
    }

    /// `out` is the whole buffer in place (`input: None`), this member's block otherwise.
    fn reduce_scatter(
        &self,
        dtype: DType,
        input: Option<&[u8]>,
        out: &mut [u8],
        n: usize,
        red: &Reducer,
    ) -> Result<()> {
        let (k, es, b) = (self.nodes * self.per, dtype.size(), block_range(n, self.nodes * self.per, 0).len());
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let slots = sized(&mut slots, k * b * es);
        let src = input.unwrap_or(out);
        for m in 0..k {
            let (a, p) = self.coords[m];
            let (r, s) = (block_range(n, k, m), self.slot(a, p) * b);
            slots[s * es..(s + r.len()) * es].copy_from_slice(&src[r.start * es..r.end * es]);
            slots[(s + r.len()) * es..(s + b) * es].fill(0);
        }
        let sum = stage_reducer(red);
        self.local.collective(dtype, Call::ReduceScatter { input: None, out: &mut *slots, n: k * b, red: sum })?;
        let region = &mut slots[self.place * self.nodes * b * es..(self.place + 1) * self.nodes * b * es];
        self.cross
            .collective(dtype, Call::ReduceScatter { input: None, out: &mut *region, n: self.nodes * b, red: sum })?;
        let r = block_range(n, k, self.me);
        let mine = &mut region[self.node * b * es..(self.node * b + r.len()) * es];
        red.finalize(mine, k);
        let dst = if input.is_none() { &mut out[r.start * es..r.end * es] } else { out };
        dst.copy_from_slice(mine);
        Ok(())
    }

    /// `out` is the whole buffer; this member's block comes from `input` or sits in `out`.
    fn all_gather(&self, dtype: DType, input: Option<&[u8]>, out: &mut [u8]) -> Result<()> {
        let (k, es) = (self.nodes * self.per, dtype.size());
        let n = out.len() / es;
        let b = block_range(n, k, 0).len();
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let slots = sized(&mut slots, k * b * es);
        let r = block_range(n, k, self.me);
        let s = self.slot(self.node, self.place) * b;
        let mine = input.unwrap_or(&out[r.start * es..r.end * es]);
        slots[s * es..(s + r.len()) * es].copy_from_slice(mine);
        slots[(s + r.len()) * es..(s + b) * es].fill(0);
        let region = self.place * self.nodes * b * es..(self.place + 1) * self.nodes * b * es;
        self.cross.collective(dtype, Call::AllGather { input: None, out: &mut slots[region] })?;
        self.local.collective(dtype, Call::AllGather { input: None, out: &mut *slots })?;
        for m in 0..k {
            let ((a, p), r) = (self.coords[m], block_range(n, k, m));
            let s = self.slot(a, p) * b;
            out[r.start * es..r.end * es].copy_from_slice(&slots[s * es..(s + r.len()) * es]);
        }
        Ok(())
    }

    fn broadcast(&self, dtype: DType, root: (usize, usize), buf: &mut [u8]) -> Result<()> {
        let (es, n) = (dtype.size(), buf.len() / dtype.size());
        if self.node == root.0 {
            self.local.collective(dtype, Call::Broadcast { root: root.1, buf: &mut *buf })?;
        }
        let part = block_range(n, self.per, self.place);
        let mine = &mut buf[part.start * es..part.end * es];
        self.cross.collective(dtype, Call::Broadcast { root: root.0, buf: mine })?;
        if self.node != root.0 {
            self.local.collective(dtype, Call::AllGather { input: None, out: buf })?;
        }
        Ok(())
    }
}

/// The reducer of a stage: `Avg` sums (the last stage divides once).
fn stage_reducer(red: &Reducer) -> Reducer {
    if red.op == ReduceOp::Avg {
        Reducer::new(red.dtype, ReduceOp::Sum)
    } else {
        *red
    }
}

/// `buf` grown to at least `len` bytes; its first `len` bytes.
fn sized(buf: &mut Vec<u8>, len: usize) -> &mut [u8] {
    if buf.len() < len {
        buf.resize(len, 0);
    }
    &mut buf[..len]
}

impl Communicator {
    /// Runs `call` in stages (the tuner chose [`super::Sched::Hier`]); the stage communicators are
    /// made by the first such call. One operation at a time: this communicator's lock is held.
    pub(super) fn hier_call(&self, dtype: DType, call: Call, bytes: usize) -> Result<()> {
        let _one_at_a_time = self.lock();
        let (start, name) = (std::time::Instant::now(), call.name());
        let result = self.stages().and_then(|s| match call {
            Call::AllReduce { input, out, red } => s.all_reduce(dtype, input, out, &red),
            Call::ReduceScatter { input, out, n, red } => s.reduce_scatter(dtype, input, out, n, &red),
            Call::AllGather { input, out } => s.all_gather(dtype, input, out),
            Call::Broadcast { root, buf } => s.broadcast(dtype, (self.nodes.node[root], self.nodes.place(root)), buf),
            Call::Reduce { .. } => unreachable!("the tuner never picks hier for reduce"),
        });
        self.stats.record(name, bytes, start.elapsed());
        result
    }

    fn stages(&self) -> Result<&Stages> {
        if let Some(s) = self.hier.get() {
            return Ok(s);
        }
        let made = Stages::new(self).inspect_err(|e| self.connector.abort().raise(&e.to_string()))?;
        Ok(self.hier.get_or_init(|| Box::new(made)))
    }
}
