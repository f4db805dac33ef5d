//! The hierarchical reduce-scatter and all-gather ([`super::hier`]): the collectives whose result
//! is cut into world blocks (`block_range(count, k, rank)`), which the node-local blocks of the
//! stages do not line up with in general. Four ways, by layout:
//! - *world order* (every node holds `L` members, member `m` sits at place `m / n` of node
//!   `m % n`, as `mpirun --map-by node` places ranks; the count divides by `k`): local block `p` is
//!   exactly the world blocks of place `p` on nodes `0..n` in node order, so the stages run on the
//!   caller's buffer without copies: local reduce-scatter, reduce-scatter over the place's carrier
//!   (the reverse for all-gather);
//! - *blocked* (node `a` holds members `a L .. (a + 1) L`, as `--map-by slot` places them; any
//!   count): node `a`'s world blocks form one contiguous *chunk* whose local block `p` is the world
//!   block of its place `p`, so the stages run chunk by chunk on the caller's buffer: a local
//!   reduce-scatter of every chunk, then a reduce of every node's place-`p` block over place `p`'s
//!   carrier onto that node (all-gather: a broadcast of each from its node over the carrier, then
//!   a local all-gather of every chunk); `2n` stage calls instead of 2, no copy;
//! - *packed* (the other even layouts that are not *spread*, see pieces): a place's world blocks
//!   are neither one contiguous range nor one per contiguous chunk, and a local stage only cuts
//!   contiguous blocks in place order, so they are copied into `k` slots of the largest block
//!   ordered by (place, node), so that place `p`'s slots are its local block; the stages run on
//!   the slots and this member's block is copied back (one copy of the buffer per call). Pieces
//!   would avoid the copy but load the link between nodes unevenly there: a local block holding
//!   world blocks of one node only (ranks 0,1,1,1,0,0 on 2 nodes: local block 1 holds the world
//!   blocks of ranks 2 and 3, both on node 1) puts its carrier on that node at zero bytes and the
//!   other node's at twice its share, and the busiest member sets the time;
//! - *pieces* (uneven layouts, world order with a count that does not divide by `k`, and the
//!   *spread* even layouts: every run of `n` consecutive ranks holds one member of every node,
//!   e.g. 0,1,1,0, so every local block holds one world block of every node): the
//!   buffer is cut at every local block end and every world block end; after the local
//!   reduce-scatter, each piece is reduced over its carrier onto the node that owns its world
//!   block, and its carrier there hands it to the owner within the node (the reverse for
//!   all-gather: owners hand their pieces to the carriers, pieces are broadcast over their
//!   carriers, each node all-gathers its local blocks). On spread layouts every member sends its
//!   share between nodes (in world order with other counts the local blocks and the place's world
//!   blocks differ by a few elements at their ends, so only those move within a node); a member
//!   makes `n` carrier calls (one per piece) where world order makes one. Out of place, reduce-scatter copies no
//!   input: the local stage reduces it into this member's local block in the scratch (what a
//!   carrier holds), pieces go from there over their carriers and to their owners' outputs, and
//!   only the pieces a member both carries and owns are copied from the scratch to its output
//!   (at most its world block, as the out-of-place world-order way copies it). A node's local
//!   stage over one member is that copy (its local block is the whole buffer, which the carrier
//!   stage then reduces in place: the input stays unchanged), so the lone member of a 2+1 layout
//!   still copies the whole input and, being the slowest, sets the time there.
//!
//! Bytes between nodes: world order, blocked and packed send `(n-1)/n` of the buffer per node,
//! `1/L` of it per member (the minimum, evenly spread); pieces send every piece once from each node
//! that does not own its world block (reduce-scatter: `(k - L_a)/k` of the buffer from node `a`, the
//! minimum) or once into each node that does not (all-gather: `(n-1)` buffers in all, the minimum
//! total, forwarded along each carrier's chain).
//!
//! Invariants: the way is a function of the node map and the count only (the same on every
//! member); hand-overs within a node run in piece order, so every send meets its receive.

use std::ops::Range;

use super::hier::{sized, stage_reducer, Piece, Stages};
use super::{Call, Communicator};
use crate::comm::block_range;
use crate::dtype::{DType, Reducer};
use crate::error::Result;

/// How a reduce-scatter or all-gather of a given count runs in stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    WorldOrder,
    Blocked,
    Packed,
    Pieces,
}

impl Stages {
    fn way(&self, count: usize) -> Way {
        match self.per {
            None => Way::Pieces,
            Some(_) if self.world_order && count % self.k == 0 => Way::WorldOrder,
            Some(l) if (0..self.k).all(|m| self.map.node[m] == m / l) => Way::Blocked,
            Some(_) if spread(&self.map.node, self.nodes()) => Way::Pieces,
            Some(_) => Way::Packed,
        }
    }

    /// `out` is the whole buffer in place (`input: None`), this member's block otherwise.
    pub(super) fn reduce_scatter(
        &self,
        p: &Communicator,
        dtype: DType,
        input: Option<&[u8]>,
        out: &mut [u8],
        n: usize,
        red: &Reducer,
    ) -> Result<()> {
        let es = dtype.size();
        let way = self.way(n);
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        match (way, input) {
            (Way::WorldOrder, None) => {
                self.local_reduce_scatter(dtype, out, n, red)?;
                let r = self.local_block(n);
                return self.rs_place(p, dtype, &mut out[r.start * es..r.end * es], red);
            }
            (Way::WorldOrder, Some(i)) => {
                let region = sized(&mut scratch, self.local_block(n).len() * es);
                self.local_reduce_scatter_into(dtype, i, region, red)?;
                self.rs_place(p, dtype, region, red)?;
                let b = n / self.k;
                out.copy_from_slice(&region[self.node * b * es..(self.node + 1) * b * es]);
                return Ok(());
            }
            (Way::Blocked, _) => return self.rs_blocked(p, dtype, (input, out), n, (red, &mut *scratch)),
            (Way::Packed, _) => {
                return self.rs_packed(p, dtype, (input, out), n, (red, &mut *scratch))
            }
            (Way::Pieces, None) => {
                self.local_reduce_scatter(dtype, out, n, red)?;
                self.rs_pieces(p, dtype, Halves::Whole(out), n, red)?;
            }
            (Way::Pieces, Some(i)) => {
                let lb = self.local_block(n);
                let held = sized(&mut scratch, lb.len() * es);
                self.local_reduce_scatter_into(dtype, i, held, red)?;
                let owned_at = block_range(n, self.k, self.me).start;
                let halves = Halves::Split { held, held_at: lb.start, owned: out, owned_at };
                self.rs_pieces(p, dtype, halves, n, red)?;
            }
        }
        Ok(())
    }

    /// Reduce-scatter of this member's local block over its place's carrier (world order): node
    /// `a` gets part `a`, this member's world block, finalized.
    fn rs_place(
        &self,
        p: &Communicator,
        dtype: DType,
        region: &mut [u8],
        red: &Reducer,
    ) -> Result<()> {
        let (es, nodes) = (dtype.size(), self.nodes());
        let count = region.len() / es;
        let sum = stage_reducer(red);
        let call = Call::ReduceScatter {
            input: None,
            out: &mut *region,
            n: count,
            red: sum,
        };
        self.carrier(p, &self.place_owners(self.place), |c| {
            c.collective(dtype, call)
        })?;
        let b = count / nodes;
        red.finalize(
            &mut region[self.node * b * es..(self.node + 1) * b * es],
            self.k,
        );
        Ok(())
    }

    /// The slot index of the member at (`node`, `place`): ordered by place, then node.
    fn slot(&self, node: usize, place: usize) -> usize {
        place * self.nodes() + node
    }

    fn rs_packed(
        &self,
        p: &Communicator,
        dtype: DType,
        (input, out): (Option<&[u8]>, &mut [u8]),
        n: usize,
        (red, scratch): (&Reducer, &mut Vec<u8>),
    ) -> Result<()> {
        let (k, es, b, nodes) = (
            self.k,
            dtype.size(),
            block_range(n, self.k, 0).len(),
            self.nodes(),
        );
        let slots = sized(scratch, k * b * es);
        let src = input.unwrap_or(out);
        for m in 0..k {
            let (r, s) = (
                block_range(n, k, m),
                self.slot(self.map.node[m], self.map.place(m)) * b,
            );
            slots[s * es..(s + r.len()) * es].copy_from_slice(&src[r.start * es..r.end * es]);
            slots[(s + r.len()) * es..(s + b) * es].fill(0);
        }
        let sum = stage_reducer(red);
        self.local.collective(
            dtype,
            Call::ReduceScatter {
                input: None,
                out: &mut *slots,
                n: k * b,
                red: sum,
            },
        )?;
        let region = &mut slots[self.place * nodes * b * es..(self.place + 1) * nodes * b * es];
        let call = Call::ReduceScatter {
            input: None,
            out: &mut *region,
            n: nodes * b,
            red: sum,
        };
        self.carrier(p, &self.place_owners(self.place), |c| {
            c.collective(dtype, call)
        })?;
        let r = block_range(n, k, self.me);
        let mine = &mut region[self.node * b * es..(self.node * b + r.len()) * es];
        red.finalize(mine, k);
        let dst = if input.is_none() {
            &mut out[r.start * es..r.end * es]
        } else {
            out
        };
        dst.copy_from_slice(mine);
        Ok(())
    }

    /// Reduce-scatter in pieces after the local stage (the node's partial sums of this member's
    /// local block are in `bufs`' held part): this member's world block ends up reduced and
    /// finalized in `bufs`' owned part.
    fn rs_pieces(
        &self,
        p: &Communicator,
        dtype: DType,
        mut bufs: Halves,
        n: usize,
        red: &Reducer,
    ) -> Result<()> {
        let (es, sum) = (dtype.size(), stage_reducer(red));
        let pieces = self.pieces(n, true);
        for s in pieces.iter().filter(|s| s.owners[self.node] == self.me) {
            let (root, len) = (self.map.node[s.block], s.range.len());
            let call = Call::Reduce {
                root,
                input: None,
                out: bufs.held(&s.range, es),
                n: len,
                red: sum,
            };
            self.carrier(p, &s.owners, |c| c.collective(dtype, call))?;
        }
        self.hand_over(&pieces, &mut bufs, es, true)?;
        let r = block_range(n, self.k, self.me);
        red.finalize(bufs.owned(&r, es), self.k);
        Ok(())
    }

    /// Within this node, moves every piece of a local member's world block between the piece's
    /// carrier (its held part of `bufs`) and that member (its owned part): to the member
    /// (`to_owner`) or to the carrier. A piece carried by its own owner is copied from the held
    /// part to the owned one when they are apart (out of place, `to_owner`).
    fn hand_over(
        &self,
        pieces: &[Piece],
        bufs: &mut Halves,
        es: usize,
        to_owner: bool,
    ) -> Result<()> {
        for s in pieces
            .iter()
            .filter(|s| self.map.node[s.block] == self.node)
        {
            let carrier = s.owners[self.node];
            if carrier == s.block {
                if self.me == carrier && to_owner {
                    bufs.settle(&s.range, es);
                }
                continue;
            }
            let (from, to) = if to_owner {
                (carrier, s.block)
            } else {
                (s.block, carrier)
            };
            if self.me == from {
                let part = if to_owner { bufs.held(&s.range, es) } else { bufs.owned(&s.range, es) };
                self.local.send(&*part, self.map.place(to))?;
            } else if self.me == to {
                let part = if to_owner { bufs.owned(&s.range, es) } else { bufs.held(&s.range, es) };
                self.local.recv_into(part, self.map.place(from))?;
            }
        }
        Ok(())
    }

    /// `out` is the whole buffer; this member's block comes from `input` or sits in `out`.
    pub(super) fn all_gather(
        &self,
        p: &Communicator,
        dtype: DType,
        input: Option<&[u8]>,
        out: &mut [u8],
    ) -> Result<()> {
        let es = dtype.size();
        let n = out.len() / es;
        match self.way(n) {
            Way::WorldOrder => {
                let r = self.local_block(n);
                let call = Call::AllGather {
                    input,
                    out: &mut out[r.start * es..r.end * es],
                };
                self.carrier(p, &self.place_owners(self.place), |c| {
                    c.collective(dtype, call)
                })?;
            }
            Way::Blocked => return self.ag_blocked(p, dtype, input, out),
            Way::Packed => return self.ag_packed(p, dtype, input, out),
            Way::Pieces => {
                let r = block_range(n, self.k, self.me);
                if let Some(i) = input {
                    out[r.start * es..r.end * es].copy_from_slice(i);
                }
                let pieces = self.pieces(n, true);
                self.hand_over(&pieces, &mut Halves::Whole(out), es, false)?;
                for s in pieces.iter().filter(|s| s.owners[self.node] == self.me) {
                    let (root, part) = (
                        self.map.node[s.block],
                        &mut out[s.range.start * es..s.range.end * es],
                    );
                    self.carrier(p, &s.owners, |c| {
                        c.collective(dtype, Call::Broadcast { root, buf: part })
                    })?;
                }
            }
        }
        self.local
            .collective(dtype, Call::AllGather { input: None, out })
    }

    /// The elements of chunk `c` of an `n`-element buffer on the blocked layout: the world blocks
    /// of members `c L .. (c + 1) L` (node `c`), whose local block `p` is exactly the world block of
    /// the chunk's place `p` (`block_range` makes the first `n mod k` world blocks one element
    /// longer, and so the first blocks of a chunk, as it cuts the chunk into `L`).
    fn chunk(&self, n: usize, c: usize, l: usize) -> Range<usize> {
        block_range(n, self.k, c * l).start..block_range(n, self.k, (c + 1) * l - 1).end
    }

    /// Reduce-scatter on the blocked layout (node `a` holds members `a L .. (a + 1) L`, any count):
    /// a local reduce-scatter of every node's chunk, then for every node a reduce of its place-`p`
    /// world block over place `p`'s carrier onto that node. No copy: in place on the caller's
    /// buffer; out of place the partial sums of the other nodes' blocks go to `n - 1` slots of the
    /// scratch and this member's own straight into `out`.
    fn rs_blocked(
        &self,
        p: &Communicator,
        dtype: DType,
        (input, out): (Option<&[u8]>, &mut [u8]),
        n: usize,
        (red, scratch): (&Reducer, &mut Vec<u8>),
    ) -> Result<()> {
        let (es, l, nodes) = (dtype.size(), self.k / self.nodes(), self.nodes());
        let b = block_range(n, self.k, 0).len();
        let slots = sized(scratch, if input.is_some() { nodes * b * es } else { 0 });
        // Where chunk `c`'s place-`p` block sits: in `out` or in slot `c`.
        let at = |c: usize| {
            let r = block_range(n, self.k, c * l + self.place);
            match input {
                None => r.start * es..r.end * es,
                Some(_) => c * b * es..(c * b + r.len()) * es,
            }
        };
        for c in 0..nodes {
            let r = self.chunk(n, c, l);
            match input {
                None => self.local_reduce_scatter(dtype, &mut out[r.start * es..r.end * es], r.len(), red)?,
                Some(i) => {
                    let dst = if c == self.node { &mut *out } else { &mut slots[at(c)] };
                    self.local_reduce_scatter_into(dtype, &i[r.start * es..r.end * es], dst, red)?;
                }
            }
        }
        let sum = stage_reducer(red);
        for c in 0..nodes {
            let part = match input {
                Some(_) if c == self.node => &mut *out,
                Some(_) => &mut slots[at(c)],
                None => &mut out[at(c)],
            };
            let call = Call::Reduce { root: c, input: None, n: part.len() / es, out: part, red: sum };
            self.carrier(p, &self.place_owners(self.place), |cm| cm.collective(dtype, call))?;
        }
        let mine = if input.is_some() { 0..out.len() } else { at(self.node) };
        red.finalize(&mut out[mine], self.k);
        Ok(())
    }

    /// All-gather on the blocked layout: every node's place-`p` world block is broadcast over place
    /// `p`'s carrier from that node, then every node's chunk is all-gathered within each node; all
    /// on the caller's buffer (out of place, this member's block is the one copy: into `out`).
    fn ag_blocked(&self, p: &Communicator, dtype: DType, input: Option<&[u8]>, out: &mut [u8]) -> Result<()> {
        let (es, l, nodes) = (dtype.size(), self.k / self.nodes(), self.nodes());
        let n = out.len() / es;
        if let Some(i) = input {
            let r = block_range(n, self.k, self.me);
            out[r.start * es..r.end * es].copy_from_slice(i);
        }
        for c in 0..nodes {
            let r = block_range(n, self.k, c * l + self.place);
            let buf = &mut out[r.start * es..r.end * es];
            self.carrier(p, &self.place_owners(self.place), |cm| {
                cm.collective(dtype, Call::Broadcast { root: c, buf })
            })?;
        }
        for c in 0..nodes {
            let r = self.chunk(n, c, l);
            let call = Call::AllGather { input: None, out: &mut out[r.start * es..r.end * es] };
            self.local.collective(dtype, call)?;
        }
        Ok(())
    }

    fn ag_packed(
        &self,
        p: &Communicator,
        dtype: DType,
        input: Option<&[u8]>,
        out: &mut [u8],
    ) -> Result<()> {
        let (k, es, nodes) = (self.k, dtype.size(), self.nodes());
        let n = out.len() / es;
        let b = block_range(n, k, 0).len();
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let slots = sized(&mut scratch, k * b * es);
        let r = block_range(n, k, self.me);
        let s = self.slot(self.node, self.place) * b;
        let mine = input.unwrap_or(&out[r.start * es..r.end * es]);
        slots[s * es..(s + r.len()) * es].copy_from_slice(mine);
        slots[(s + r.len()) * es..(s + b) * es].fill(0);
        let region = self.place * nodes * b * es..(self.place + 1) * nodes * b * es;
        let call = Call::AllGather {
            input: None,
            out: &mut slots[region],
        };
        self.carrier(p, &self.place_owners(self.place), |c| {
            c.collective(dtype, call)
        })?;
        self.local.collective(
            dtype,
            Call::AllGather {
                input: None,
                out: &mut *slots,
            },
        )?;
        for m in 0..k {
            let r = block_range(n, k, m);
            let s = self.slot(self.map.node[m], self.map.place(m)) * b;
            out[r.start * es..r.end * es].copy_from_slice(&slots[s * es..(s + r.len()) * es]);
        }
        Ok(())
    }
}

/// Whether every run of `n` consecutive members (`n` nodes, `node[m]` member `m`'s) holds one member
/// of every node: then every local block holds one world block of every node (within a block's
/// rounding), so in pieces every member sends its share between nodes. World order is one such
/// layout.
fn spread(node: &[usize], n: usize) -> bool {
    node.chunks(n).all(|run| {
        let mut seen = vec![false; n];
        run.iter().all(|&a| !std::mem::replace(&mut seen[a], true))
    })
}

/// The buffers of a pieces schedule: the elements a member holds as a carrier (its local block)
/// and those it owns (its world block). In place both are views of the whole buffer; out of place
/// (reduce-scatter) the held part is the local block in the scratch, starting at element `held_at`
/// of the buffer, and the owned part the caller's output, starting at element `owned_at`.
enum Halves<'a> {
    Whole(&'a mut [u8]),
    Split {
        held: &'a mut [u8],
        held_at: usize,
        owned: &'a mut [u8],
        owned_at: usize,
    },
}

impl Halves<'_> {
    /// The bytes of elements `r` (inside this member's local block) as held by the carrier.
    fn held(&mut self, r: &Range<usize>, es: usize) -> &mut [u8] {
        match self {
            Halves::Whole(b) => &mut b[r.start * es..r.end * es],
            Halves::Split { held, held_at, .. } => &mut held[(r.start - *held_at) * es..(r.end - *held_at) * es],
        }
    }

    /// The bytes of elements `r` (inside this member's world block) as owned.
    fn owned(&mut self, r: &Range<usize>, es: usize) -> &mut [u8] {
        match self {
            Halves::Whole(b) => &mut b[r.start * es..r.end * es],
            Halves::Split { owned, owned_at, .. } => &mut owned[(r.start - *owned_at) * es..(r.end - *owned_at) * es],
        }
    }

    /// Copies elements `r` (in both this member's local and world block) from the held part to
    /// the owned one; nothing in place.
    fn settle(&mut self, r: &Range<usize>, es: usize) {
        if let Halves::Split { held, held_at, owned, owned_at } = self {
            owned[(r.start - *owned_at) * es..(r.end - *owned_at) * es]
                .copy_from_slice(&held[(r.start - *held_at) * es..(r.end - *held_at) * es]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::spread;

    #[test]
    fn spread_layouts_hold_every_node_in_every_run_of_n_ranks() {
        for (node, n) in [(vec![0, 1, 0, 1], 2), (vec![0, 1, 1, 0], 2), (vec![1, 0, 0, 1, 1, 0], 2), (vec![0, 1, 2, 2, 0, 1], 3)] {
            assert!(spread(&node, n), "{node:?}");
        }
        for (node, n) in [(vec![0, 0, 1, 1], 2), (vec![0, 1, 1, 1, 0, 0], 2), (vec![0, 1, 1, 2, 2, 0], 3)] {
            assert!(!spread(&node, n), "{node:?}");
        }
    }
}
