//! Chunked, pipelined ring schedules.
//!
//! Ring positions are `0..k`; `order[p]` is the communicator rank at position `p`, and the segment
//! a position owns is that rank's block (`block_range(n, k, order[p])`), so reduce-scatter leaves
//! rank `r` with block `r`. Every segment is cut into pieces of at most `chunk` elements; piece `j` of
//! all segments goes around the ring before piece `j + 1`, and because a link holds several
//! messages in flight, consecutive pieces overlap on the wire (pipelining). All-reduce is NCCL's
//! schedule: send; recv-reduce-send x(k-2); recv-reduce-copy-send; recv-copy-send x(k-2); recv.
//! Every piece is reduced in the same ring order on every rank, so all ranks end with identical bits.

use std::ops::Range;

use crate::comm::block_range;
use crate::dtype::Reducer;
use crate::comm::primitives::{Input, Pipe};
use crate::error::Result;
use crate::transport::Waiter;

/// Shape of one ring operation: positions, element size and piece length.
pub struct RingShape<'a> {
    /// Communicator rank at each ring position.
    pub order: &'a [usize],
    /// This rank's position.
    pub pos: usize,
    /// Element size in bytes.
    pub esize: usize,
    /// Largest piece, in elements.
    pub chunk: usize,
}

impl RingShape<'_> {
    fn k(&self) -> usize {
        self.order.len()
    }

    /// Communicator ranks this position receives from and sends to.
    pub fn neighbours(&self) -> (usize, usize) {
        (self.order[self.before(1)], self.order[(self.pos + 1) % self.k()])
    }

    /// Position `back` steps before `pos` (wrapping).
    fn before(&self, back: usize) -> usize {
        (self.pos + self.k() * 2 - back % self.k()) % self.k()
    }

    /// Byte range of piece `j` of the segment owned by position `p`, over `n` elements.
    fn piece(&self, n: usize, p: usize, j: usize) -> Range<usize> {
        let seg = block_range(n, self.k(), self.order[p]);
        let start = (seg.start + j * self.chunk).min(seg.end);
        let end = (start + self.chunk).min(seg.end);
        start * self.esize..end * self.esize
    }

    /// Number of piece rounds needed for the largest segment of `n` elements.
    fn rounds(&self, n: usize) -> usize {
        block_range(n, self.k(), 0).len().div_ceil(self.chunk)
    }

    /// Byte range of the `j`-th piece of a whole `n`-element buffer.
    fn whole_piece(&self, n: usize, j: usize) -> Range<usize> {
        let start = (j * self.chunk).min(n);
        start * self.esize..(start + self.chunk).min(n) * self.esize
    }
}

/// Reads `range` from the separate input, or from `out` when in place.
fn src<'a>(input: Option<&'a [u8]>, out: &'a [u8], range: Range<usize>) -> &'a [u8] {
    match input {
        Some(i) => &i[range],
        None => &out[range],
    }
}

fn input_of(input: Option<&[u8]>, range: Range<usize>) -> Input<'_> {
    match input {
        Some(i) => Input::Separate(&i[range]),
        None => Input::InPlace,
    }
}

/// All-reduce of `out.len()` bytes: reads `input` (or `out` in place), leaves the result in `out`.
pub fn all_reduce(
    p: &mut Pipe,
    s: &RingShape,
    input: Option<&[u8]>,
    out: &mut [u8],
    red: &Reducer,
    w: &Waiter,
) -> Result<()> {
    let (k, n) = (s.k(), out.len() / s.esize);
    for j in 0..s.rounds(n) {
        p.tx.send(src(input, out, s.piece(n, s.before(1), j)), w)?;
        for t in 1..k - 1 {
            p.recv_reduce_send(src(input, out, s.piece(n, s.before(t + 1), j)), red, w)?;
        }
        let mine = s.piece(n, s.pos, j);
        p.recv_reduce_copy_send(input_of(input, mine.clone()), &mut out[mine], red, Some(k), w)?;
        for t in 1..k - 1 {
            p.recv_copy_send(&mut out[s.piece(n, s.before(t), j)], w)?;
        }
        p.rx.recv(&mut out[s.piece(n, s.before(k - 1), j)], w)?;
    }
    Ok(())
}

/// Reduce-scatter of the `n`-element `input` (or `out` in place): this rank's block ends up in
/// `out`, which is either exactly the block or the whole buffer (the block written at its own
/// offset; always so in place). Only the block is written.
pub fn reduce_scatter(
    p: &mut Pipe,
    s: &RingShape,
    input: Option<&[u8]>,
    out: &mut [u8],
    n: usize,
    red: &Reducer,
    w: &Waiter,
) -> Result<()> {
    let k = s.k();
    // A block-sized `out` is addressed relative to the block. (When the block is the whole buffer
    // it starts at 0, so both readings agree.)
    let base = if out.len() == n * s.esize { 0 } else { block_range(n, k, s.order[s.pos]).start * s.esize };
    for j in 0..s.rounds(n) {
        p.tx.send(src(input, out, s.piece(n, s.before(1), j)), w)?;
        for t in 1..k - 1 {
            p.recv_reduce_send(src(input, out, s.piece(n, s.before(t + 1), j)), red, w)?;
        }
        let mine = s.piece(n, s.pos, j);
        let dst = mine.start - base..mine.end - base;
        p.rx.recv_reduce_copy(input_of(input, mine), &mut out[dst], red, Some(k), w)?;
    }
    Ok(())
}

/// All-gather into the `n`-element `out`: this rank's block comes from `input` (or already sits at
/// its offset in `out` when in place).
pub fn all_gather(
    p: &mut Pipe,
    s: &RingShape,
    input: Option<&[u8]>,
    out: &mut [u8],
    w: &Waiter,
) -> Result<()> {
    let (k, n) = (s.k(), out.len() / s.esize);
    let my_start = block_range(n, k, s.order[s.pos]).start * s.esize;
    for j in 0..s.rounds(n) {
        let mine = s.piece(n, s.pos, j);
        if let Some(i) = input {
            out[mine.clone()].copy_from_slice(&i[mine.start - my_start..mine.end - my_start]);
        }
        p.tx.send(&out[mine], w)?;
        for t in 1..k - 1 {
            p.recv_copy_send(&mut out[s.piece(n, s.before(t), j)], w)?;
        }
        p.rx.recv(&mut out[s.piece(n, s.before(k - 1), j)], w)?;
    }
    Ok(())
}

/// Broadcast of `buf` from the rank at ring position `root_pos`, pipelined piece by piece.
pub fn broadcast(p: &mut Pipe, s: &RingShape, root_pos: usize, buf: &mut [u8], w: &Waiter) -> Result<()> {
    let (k, n) = (s.k(), buf.len() / s.esize);
    let rel = (s.pos + k - root_pos) % k;
    for j in 0..n.div_ceil(s.chunk) {
        let r = s.whole_piece(n, j);
        match rel {
            0 => p.tx.send(&buf[r], w)?,
            x if x == k - 1 => p.rx.recv(&mut buf[r], w)?,
            _ => p.recv_copy_send(&mut buf[r], w)?,
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
/// Reduce onto the rank at ring position `root_pos`: the chain starts right after the root and ends
/// at it; only the root writes `out`.
pub fn reduce(
    p: &mut Pipe,
    s: &RingShape,
    root_pos: usize,
    input: Option<&[u8]>,
    out: &mut [u8],
    n: usize,
    red: &Reducer,
    w: &Waiter,
) -> Result<()> {
    let k = s.k();
    let rel = (s.pos + 2 * k - root_pos - 1) % k;
    for j in 0..n.div_ceil(s.chunk) {
        let r = s.whole_piece(n, j);
        match rel {
            0 => p.tx.send(src(input, out, r), w)?,
            x if x == k - 1 => {
                p.rx.recv_reduce_copy(input_of(input, r.clone()), &mut out[r], red, Some(k), w)?
            }
            _ => p.recv_reduce_send(src(input, out, r), red, w)?,
        }
    }
    Ok(())
}
