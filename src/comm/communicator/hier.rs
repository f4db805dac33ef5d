//! Hierarchical host collectives for communicators whose members span several nodes: shared
//! memory (or CMA) within a node, the network between nodes, each crossed as few times as the
//! collective allows.
//!
//! Why: a flat ring over `k` ranks on `n` nodes sends `2(k-1)/k` of an all-reduce's buffer over
//! each of the n links that leave a node, all of it through the one rank at the node's end of the
//! ring. In stages, every node sends `2(n-1)/n` of the buffer between nodes (the minimum for the
//! node), spread over its members in proportion to their share of the node's work.
//!
//! Two kinds of stage communicators, made without messages from the node map every member holds
//! (their links are opened by the first call that uses them, on every member at the same call):
//! `local`, the members of this node (local rank = place), and the *carriers*: one member per
//! node (carrier rank = node index). Within a node of `L` members the buffer is cut into `L`
//! local blocks (`block_range(count, L, place)`); cutting it at every node's local block ends
//! gives the *segments*, each held by one member of every node, which form its carrier. On even
//! layouts (the same `L` on every node) segment `p` is local block `p` everywhere and its carrier
//! holds place `p` on every node; on uneven layouts (3+2, 4+2+1, a node with one member) a member
//! carries every segment inside its local block, so a node with fewer members carries the places
//! its missing members would hold.
//! - all-reduce: local reduce-scatter, an all-reduce of every segment over its carrier, local
//!   all-gather;
//! - broadcast: the root's node broadcasts within itself, every segment is broadcast over its
//!   carrier from the root's node, every other node all-gathers its local blocks;
//! - reduce: on every node but the root's, a local reduce-scatter (out of place into this member's
//!   local block in the scratch: non-root buffers stay unchanged); the root's node reduces onto the
//!   root within itself (a pipelined chain or direct sends, no block hand-over afterwards); then
//!   every segment is reduced over its carrier, the root standing for its node in every carrier;
//! - reduce-scatter and all-gather deliver world blocks (`block_range(count, k, rank)`), see
//!   [`super::hier_blocks`].
//!
//! Invariants: decided identically on every member (the tuner's choice; see
//! [`crate::comm::tuner::choose`]) and every member derives the same segments from the count and
//! the node map, so the stage calls line up; carrier calls run in segment order on every member
//! (the lowest unfinished segment always has all its members in it: no deadlock). `Avg` sums in
//! every stage and divides once by the member count; summation order: within a node in the local
//! ring's order, then between nodes in the carrier ring's order (with exact inputs, the same bits
//! as the flat schedules). The stage communicators' inter-node bytes count for this communicator;
//! all-to-all stays flat.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Mutex;

use super::{child_id, Call, Communicator};
use crate::comm::block_range;
use crate::comm::nodes::NodeMap;
use crate::dtype::{DType, ReduceOp, Reducer};
use crate::error::{Error, Result};

/// The stage communicators and this member's coordinates.
pub(super) struct Stages {
    pub(super) local: Communicator,
    /// Carrier communicators by their members (one per node, in node order), made on first use.
    carriers: Mutex<HashMap<Vec<usize>, Communicator>>,
    pub(super) map: NodeMap,
    /// Members; this member's rank, node and place.
    pub(super) k: usize,
    pub(super) me: usize,
    pub(super) node: usize,
    pub(super) place: usize,
    /// Ranks per node when every node holds the same number.
    pub(super) per: Option<usize>,
    /// Whether world rank order is place-major (member `m` at place `m / n` of node `m % n`).
    pub(super) world_order: bool,
    /// Working space of reduce, reduce-scatter and all-gather (grows, never shrinks).
    pub(super) scratch: Mutex<Vec<u8>>,
}

/// One piece of a buffer: its element range, the member of every node that carries it, and (where
/// pieces are cut at world blocks too) the member whose world block holds it.
pub(super) struct Piece {
    pub(super) range: Range<usize>,
    pub(super) owners: Vec<usize>,
    pub(super) block: usize,
}

impl Stages {
    /// The stage communicators of `comm` (no messages: links open on first use).
    fn new(comm: &Communicator) -> Result<Stages> {
        let map = comm.nodes.clone();
        let nodes = map.staged().map_err(Error::InvalidArgument)?;
        let me = comm.rank;
        let (node, place) = (map.node[me], map.place(me));
        let local: Vec<usize> = map.members[node].iter().map(|&m| comm.members[m]).collect();
        let parts = (child_id(comm.id, u64::MAX, node as u64), local, place);
        let local = Communicator::with_counter(
            comm.connector.clone(),
            parts,
            comm.cfg.clone(),
            comm.net_sent.clone(),
        )?;
        let per = map.uniform().ok().map(|(_, l)| l);
        let world_order =
            per.is_some() && (0..comm.size()).all(|m| map.place(m) * nodes + map.node[m] == m);
        let (carriers, scratch) = (Mutex::default(), Mutex::default());
        Ok(Stages {
            local,
            carriers,
            k: comm.size(),
            me,
            node,
            place,
            per,
            world_order,
            scratch,
            map,
        })
    }

    pub(super) fn nodes(&self) -> usize {
        self.map.nodes()
    }

    /// Members of node `a`.
    fn len(&self, a: usize) -> usize {
        self.map.members[a].len()
    }

    /// The carriers of place `p` on an even layout.
    pub(super) fn place_owners(&self, p: usize) -> Vec<usize> {
        (0..self.nodes()).map(|a| self.map.member(a, p)).collect()
    }

    /// The pieces of a `count`-element buffer in order: cut at every node's local block ends, and
    /// at the world block ends too with `world_blocks`.
    pub(super) fn pieces(&self, count: usize, world_blocks: bool) -> Vec<Piece> {
        let mut cuts = vec![0, count];
        for a in 0..self.nodes() {
            cuts.extend((0..self.len(a)).map(|j| block_range(count, self.len(a), j).end));
        }
        if world_blocks {
            cuts.extend((0..self.k).map(|m| block_range(count, self.k, m).end));
        }
        cuts.sort_unstable();
        cuts.dedup();
        let piece = |w: &[usize]| Piece {
            range: w[0]..w[1],
            owners: (0..self.nodes())
                .map(|a| self.map.member(a, block_of(count, self.len(a), w[0])))
                .collect(),
            block: block_of(count, self.k, w[0]),
        };
        cuts.windows(2).filter(|w| w[0] < w[1]).map(piece).collect()
    }

    /// The pieces this member carries.
    pub(super) fn mine(&self, count: usize, world_blocks: bool) -> Vec<Piece> {
        let mut all = self.pieces(count, world_blocks);
        all.retain(|s| s.owners[self.node] == self.me);
        all
    }

    /// Runs `f` on the carrier of `owners` (made on first use; this member is one of them).
    pub(super) fn carrier(
        &self,
        parent: &Communicator,
        owners: &[usize],
        f: impl FnOnce(&Communicator) -> Result<()>,
    ) -> Result<()> {
        let mut made = self.carriers.lock().unwrap_or_else(|e| e.into_inner());
        if !made.contains_key(owners) {
            let key = owners
                .iter()
                .flat_map(|&m| (m as u64).to_le_bytes())
                .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                    (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
                });
            let world = owners.iter().map(|&m| parent.members[m]).collect();
            let parts = (child_id(parent.id, u64::MAX - 1, key), world, self.node);
            let c = Communicator::with_counter(
                parent.connector.clone(),
                parts,
                parent.cfg.clone(),
                parent.net_sent.clone(),
            )?;
            made.insert(owners.to_vec(), c);
        }
        f(&made[owners])
    }

    /// The in-place reduce-scatter of the `n`-element `work` within this node, summing for `Avg`
    /// (the last stage divides): this member's local block of `work` ends up holding the node's
    /// partial result; the other blocks are left as the local schedule leaves them.
    pub(super) fn local_reduce_scatter(
        &self,
        dtype: DType,
        work: &mut [u8],
        n: usize,
        red: &Reducer,
    ) -> Result<()> {
        let call = Call::ReduceScatter {
            input: None,
            out: work,
            n,
            red: stage_reducer(red),
        };
        self.local.collective(dtype, call)
    }

    /// The reduce-scatter of the whole buffer `input` within this node into `block`, this
    /// member's local block of it (summing for `Avg`, as [`Self::local_reduce_scatter`]).
    pub(super) fn local_reduce_scatter_into(
        &self,
        dtype: DType,
        input: &[u8],
        block: &mut [u8],
        red: &Reducer,
    ) -> Result<()> {
        let call = Call::ReduceScatter {
            input: Some(input),
            n: input.len() / dtype.size(),
            out: block,
            red: stage_reducer(red),
        };
        self.local.collective(dtype, call)
    }

    /// This member's local block of a `count`-element buffer.
    pub(super) fn local_block(&self, count: usize) -> Range<usize> {
        block_range(count, self.len(self.node), self.place)
    }

    fn all_reduce(
        &self,
        p: &Communicator,
        dtype: DType,
        input: Option<&[u8]>,
        out: &mut [u8],
        red: &Reducer,
    ) -> Result<()> {
        let (es, sum) = (dtype.size(), stage_reducer(red));
        let n = out.len() / es;
        if let Some(i) = input {
            out.copy_from_slice(i);
        }
        self.local_reduce_scatter(dtype, out, n, red)?;
        for s in self.mine(n, false) {
            let part = &mut out[s.range.start * es..s.range.end * es];
            self.carrier(p, &s.owners, |c| {
                c.collective(
                    dtype,
                    Call::AllReduce {
                        input: None,
                        out: part,
                        red: sum,
                    },
                )
            })?;
        }
        let r = self.local_block(n);
        red.finalize(&mut out[r.start * es..r.end * es], self.k);
        self.local
            .collective(dtype, Call::AllGather { input: None, out })
    }

    fn broadcast(&self, p: &Communicator, dtype: DType, root: usize, buf: &mut [u8]) -> Result<()> {
        let (es, n) = (dtype.size(), buf.len() / dtype.size());
        let root_node = self.map.node[root];
        if self.node == root_node {
            self.local.collective(
                dtype,
                Call::Broadcast {
                    root: self.map.place(root),
                    buf: &mut *buf,
                },
            )?;
        }
        for s in self.mine(n, false) {
            let part = &mut buf[s.range.start * es..s.range.end * es];
            self.carrier(p, &s.owners, |c| {
                c.collective(
                    dtype,
                    Call::Broadcast {
                        root: root_node,
                        buf: part,
                    },
                )
            })?;
        }
        if self.node != root_node {
            self.local.collective(
                dtype,
                Call::AllGather {
                    input: None,
                    out: buf,
                },
            )?;
        }
        Ok(())
    }

    /// Reduce of `n` elements onto member `root`; `out` as in [`Call::Reduce`].
    fn reduce(
        &self,
        p: &Communicator,
        dtype: DType,
        (root, n): (usize, usize),
        input: Option<&[u8]>,
        out: &mut [u8],
        red: &Reducer,
    ) -> Result<()> {
        let (es, r, sum) = (dtype.size(), self.local_block(n), stage_reducer(red));
        let root_node = self.map.node[root];
        if self.node == root_node {
            return self.reduce_on_root_node(p, dtype, (root, n), input, out, red);
        }
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        // The node's partial sums of this member's local block, in the scratch (the caller's
        // buffer stays unchanged off the root).
        let block = sized(&mut scratch, r.len() * es);
        self.local_reduce_scatter_into(dtype, input.unwrap_or(&*out), block, red)?;
        for s in self.mine(n, false) {
            let (len, at) = (s.range.len(), s.range.start - r.start);
            let call = Call::Reduce {
                root: root_node,
                input: None,
                out: &mut block[at * es..(at + len) * es],
                n: len,
                red: sum,
            };
            self.carrier(p, &self.rooted(&s.owners, root), |c| c.collective(dtype, call))?;
        }
        Ok(())
    }

    /// The reduce on the root's node: a reduce within the node onto the root, then the root
    /// receives every segment over its carrier (the root standing for its node in all of them).
    fn reduce_on_root_node(
        &self,
        p: &Communicator,
        dtype: DType,
        (root, n): (usize, usize),
        input: Option<&[u8]>,
        out: &mut [u8],
        red: &Reducer,
    ) -> Result<()> {
        let (es, sum, root_place) = (dtype.size(), stage_reducer(red), self.map.place(root));
        if self.me != root {
            let call = Call::Reduce {
                root: root_place,
                input: Some(input.unwrap_or(&*out)),
                out: &mut [],
                n,
                red: sum,
            };
            return self.local.collective(dtype, call);
        }
        let call = Call::Reduce {
            root: root_place,
            input,
            out: &mut *out,
            n,
            red: sum,
        };
        self.local.collective(dtype, call)?;
        for s in self.pieces(n, false) {
            let call = Call::Reduce {
                root: self.node,
                input: None,
                out: &mut out[s.range.start * es..s.range.end * es],
                n: s.range.len(),
                red: sum,
            };
            self.carrier(p, &self.rooted(&s.owners, root), |c| c.collective(dtype, call))?;
        }
        red.finalize(out, self.k);
        Ok(())
    }

    /// A segment's carriers with the root standing for its node.
    fn rooted(&self, owners: &[usize], root: usize) -> Vec<usize> {
        let mut owners = owners.to_vec();
        owners[self.map.node[root]] = root;
        owners
    }
}

/// The index of the block of `block_range(count, parts, _)` that holds element `x < count`.
fn block_of(count: usize, parts: usize, x: usize) -> usize {
    let (base, rem) = (count / parts, count % parts);
    let big = rem * (base + 1);
    if x < big {
        x / (base + 1)
    } else {
        rem + (x - big) / base
    }
}

/// The reducer of a stage: `Avg` sums (the last stage divides once).
pub(super) fn stage_reducer(red: &Reducer) -> Reducer {
    if red.op == ReduceOp::Avg {
        Reducer::new(red.dtype, ReduceOp::Sum)
    } else {
        *red
    }
}

/// `buf` grown to at least `len` bytes; its first `len` bytes.
pub(super) fn sized(buf: &mut Vec<u8>, len: usize) -> &mut [u8] {
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
            Call::AllReduce { input, out, red } => s.all_reduce(self, dtype, input, out, &red),
            Call::ReduceScatter { input, out, n, red } => {
                s.reduce_scatter(self, dtype, input, out, n, &red)
            }
            Call::AllGather { input, out } => s.all_gather(self, dtype, input, out),
            Call::Broadcast { root, buf } => s.broadcast(self, dtype, root, buf),
            Call::Reduce {
                root,
                input,
                out,
                n,
                red,
            } => s.reduce(self, dtype, (root, n), input, out, &red),
        });
        self.stats.record(name, bytes, start.elapsed());
        result
    }

    fn stages(&self) -> Result<&Stages> {
        if let Some(s) = self.hier.get() {
            return Ok(s);
        }
        let made =
            Stages::new(self).inspect_err(|e| self.connector.abort().raise(&e.to_string()))?;
        Ok(self.hier.get_or_init(|| Box::new(made)))
    }
}

#[cfg(test)]
mod tests {
    use super::block_of;
    use crate::comm::block_range;

    #[test]
    fn block_of_inverts_block_range() {
        for count in 1..40 {
            for parts in 1..9 {
                for b in 0..parts {
                    for x in block_range(count, parts, b) {
                        assert_eq!(
                            block_of(count, parts, x),
                            b,
                            "count {count} parts {parts} x {x}"
                        );
                    }
                }
            }
        }
    }
}
