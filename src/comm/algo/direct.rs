//! Direct (all-pairs) schedules: every rank talks to every other rank itself instead of relaying
//! around a ring.
//!
//! They cost one network hop instead of k-1, which wins for small messages (latency) and for
//! all-to-all traffic; all-gather uses them for sharded data parallelism where each rank needs every
//! other rank's shard at once. Each round posts this rank's piece to all peers before waiting for
//! any, so with links at least two messages deep no rank ever blocks on a peer that is itself
//! blocked. Reductions combine contributions in rank order 0..k, identically on every rank.

use std::ops::Range;

use crate::comm::block_range;
use crate::dtype::Reducer;
use crate::comm::primitives::{Pipe, Rx, Tx};
use crate::error::Result;
use crate::transport::Waiter;

/// Access to the links with every peer, by communicator rank.
pub trait Peers {
    /// Sending half towards `to`.
    fn tx(&mut self, to: usize) -> Tx<'_>;
    /// Receiving half from `from`.
    fn rx(&mut self, from: usize) -> Rx<'_>;
    /// Receive from `from` and send to `to` together (a ring position).
    fn pipe(&mut self, from: usize, to: usize) -> Pipe<'_>;
}

/// Shape of one direct operation.
pub struct DirectShape {
    /// Communicator size.
    pub k: usize,
    /// This rank.
    pub me: usize,
    /// Element size in bytes.
    pub esize: usize,
    /// Largest piece, in elements.
    pub chunk: usize,
}

impl DirectShape {
    /// Byte range of piece `j` within the element range `elems`, relative to the buffer start.
    fn piece(&self, elems: Range<usize>, j: usize) -> Range<usize> {
        let start = (elems.start + j * self.chunk).min(elems.end);
        start * self.esize..(start + self.chunk).min(elems.end) * self.esize
    }

    /// The other ranks, starting after this one (so that peers' first messages go to different
    /// ranks).
    pub fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (1..self.k).map(move |d| (self.me + d) % self.k)
    }

    fn rounds(&self, longest: usize) -> usize {
        longest.div_ceil(self.chunk)
    }
}

/// This rank's contribution for byte range `r`: from the separate input, or from `out` in place.
fn own_piece<'a>(input: Option<&'a [u8]>, out: &'a [u8], r: Range<usize>) -> &'a [u8] {
    match input {
        Some(i) => &i[r],
        None => &out[r],
    }
}

/// Shifts a byte range left by `by` bytes.
fn rebase(r: Range<usize>, by: usize) -> Range<usize> {
    r.start - by..r.end - by
}

/// Combines, in rank order, piece `r` of every rank's contribution into `scratch`: this rank's own
/// bytes come from `own`, the others' from their links.
fn reduce_in_rank_order<P: Peers>(
    peers: &mut P,
    s: &DirectShape,
    own: &[u8],
    scratch: &mut [u8],
    red: &Reducer,
    w: &Waiter,
) -> Result<()> {
    for src in 0..s.k {
        if src == s.me {
            if src == 0 {
                scratch.copy_from_slice(own);
            } else {
                red.reduce_into(scratch, own);
            }
        } else if src == 0 {
            peers.rx(src).recv(scratch, w)?;
        } else {
            peers.rx(src).recv_reduce(scratch, red, w)?;
        }
    }
    Ok(())
}

/// All-reduce: every rank sends each piece to every peer and reduces all contributions itself.
/// `scratch` must hold at least one piece.
pub fn all_reduce<P: Peers>(
    peers: &mut P,
    s: &DirectShape,
    input: Option<&[u8]>,
    out: &mut [u8],
    scratch: &mut [u8],
    red: &Reducer,
    w: &Waiter,
) -> Result<()> {
    let n = out.len() / s.esize;
    for j in 0..s.rounds(n) {
        let r = s.piece(0..n, j);
        let own = own_piece(input, out, r.clone());
        for to in s.peers() {
            peers.tx(to).send(own, w)?;
        }
        let acc = &mut scratch[..r.len()];
        reduce_in_rank_order(peers, s, own, acc, red, w)?;
        red.finalize(acc, s.k);
        out[r].copy_from_slice(acc);
    }
    Ok(())
}

/// Reduce-scatter: piece `j` of block `b` goes straight to rank `b`, which reduces in rank order.
/// Out of place `out` is this rank's block; in place it is the whole `n`-element buffer.
#[allow(clippy::too_many_arguments)]
pub fn reduce_scatter<P: Peers>(
    peers: &mut P,
    s: &DirectShape,
    input: Option<&[u8]>,
    out: &mut [u8],
    n: usize,
    scratch: &mut [u8],
    red: &Reducer,
    w: &Waiter,
) -> Result<()> {
    let mine = block_range(n, s.k, s.me);
    for j in 0..s.rounds(block_range(n, s.k, 0).len()) {
        for to in s.peers() {
            let r = s.piece(block_range(n, s.k, to), j);
            peers.tx(to).send(own_piece(input, out, r.clone()), w)?;
        }
        let r = s.piece(mine.clone(), j);
        let acc = &mut scratch[..r.len()];
        reduce_in_rank_order(peers, s, own_piece(input, out, r.clone()), acc, red, w)?;
        red.finalize(acc, s.k);
        let dst = if input.is_some() { rebase(r, mine.start * s.esize) } else { r };
        out[dst].copy_from_slice(acc);
    }
    Ok(())
}

/// All-gather into the `n`-element `out`; this rank's block comes from `input` or already sits at
/// its offset in `out`.
pub fn all_gather<P: Peers>(
    peers: &mut P,
    s: &DirectShape,
    input: Option<&[u8]>,
    out: &mut [u8],
    w: &Waiter,
) -> Result<()> {
    let n = out.len() / s.esize;
    let mine = block_range(n, s.k, s.me);
    for j in 0..s.rounds(block_range(n, s.k, 0).len()) {
        let r = s.piece(mine.clone(), j);
        if let Some(i) = input {
            out[r.clone()].copy_from_slice(&i[rebase(r.clone(), mine.start * s.esize)]);
        }
        for to in s.peers() {
            peers.tx(to).send(&out[r.clone()], w)?;
        }
        for from in s.peers() {
            peers.rx(from).recv(&mut out[s.piece(block_range(n, s.k, from), j)], w)?;
        }
    }
    Ok(())
}

/// All-to-all: block `b` of `input` (`n` elements cut into k blocks) goes to rank `b`; rank `src`'s
/// block for this rank lands at `out[src * len .. (src + 1) * len]`, `len` being this rank's block
/// length.
pub fn all_to_all<P: Peers>(
    peers: &mut P,
    s: &DirectShape,
    input: &[u8],
    out: &mut [u8],
    w: &Waiter,
) -> Result<()> {
    let n = input.len() / s.esize;
    let len = block_range(n, s.k, s.me).len();
    for j in 0..s.rounds(block_range(n, s.k, 0).len()) {
        for to in s.peers() {
            peers.tx(to).send(&input[s.piece(block_range(n, s.k, to), j)], w)?;
        }
        let own = s.piece(block_range(n, s.k, s.me), j);
        out[s.piece(s.me * len..(s.me + 1) * len, j)].copy_from_slice(&input[own]);
        for from in s.peers() {
            peers.rx(from).recv(&mut out[s.piece(from * len..(from + 1) * len, j)], w)?;
        }
    }
    Ok(())
}

/// Broadcast: the root sends every piece to every peer.
pub fn broadcast<P: Peers>(
    peers: &mut P,
    s: &DirectShape,
    root: usize,
    buf: &mut [u8],
    w: &Waiter,
) -> Result<()> {
    let n = buf.len() / s.esize;
    for j in 0..s.rounds(n) {
        let r = s.piece(0..n, j);
        if s.me == root {
            for to in s.peers() {
                peers.tx(to).send(&buf[r.clone()], w)?;
            }
        } else {
            peers.rx(root).recv(&mut buf[r], w)?;
        }
    }
    Ok(())
}

/// Reduce: every rank sends its pieces to the root, which reduces them in rank order.
#[allow(clippy::too_many_arguments)]
pub fn reduce<P: Peers>(
    peers: &mut P,
    s: &DirectShape,
    root: usize,
    input: Option<&[u8]>,
    out: &mut [u8],
    n: usize,
    scratch: &mut [u8],
    red: &Reducer,
    w: &Waiter,
) -> Result<()> {
    for j in 0..s.rounds(n) {
        let r = s.piece(0..n, j);
        let own = own_piece(input, out, r.clone());
        if s.me != root {
            peers.tx(root).send(own, w)?;
            continue;
        }
        let acc = &mut scratch[..r.len()];
        reduce_in_rank_order(peers, s, own, acc, red, w)?;
        red.finalize(acc, s.k);
        out[r].copy_from_slice(acc);
    }
    Ok(())
}
