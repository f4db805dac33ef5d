//! Single-copy schedules: a rank reads its peers' buffers directly instead of having them copied
//! through the link's FIFO.
//!
//! Written over the `expose` / `read_exposed` / `done_reading` primitives, so they run on any link
//! that offers read access to the peer's memory (Cross Memory Attach on shared memory today; GPU
//! peer access would be another such link). Each byte that crosses ranks is copied once, by its
//! reader, where a FIFO copies it twice (into the slot, out of it); whether that is faster depends
//! on how fast the kernel copies compared with two user-space copies through a cache-resident slot
//! (README, "where the time goes"). Reading also needs no handoff per piece: a rank waits for a
//! peer once per call, not once per slot, which is what wins on oversubscribed cores.
//!
//! Invariants: every rank exposes before it reads, so with links at least two messages deep nobody
//! waits on a peer that waits on it; a rank leaves a schedule only after every live peer it exposed
//! a buffer to has answered (done, or gave up after its own failure), on errors too (`Pending`),
//! and a peer that dies first is reported by that wait; all-reduce reduces exactly as the ring
//! does, so every rank ends with the same bits.

use std::ops::Range;

use crate::comm::algo::direct::{DirectShape, Peers};
use crate::comm::algo::ring::{self, RingShape};
use crate::comm::block_range;
use crate::dtype::Reducer;
use crate::error::Result;
use crate::transport::Waiter;

/// Byte range of rank `r`'s block of an `n`-element buffer.
fn block_bytes(s: &DirectShape, n: usize, r: usize) -> Range<usize> {
    let b = block_range(n, s.k, r);
    b.start * s.esize..b.end * s.esize
}

/// The answers one exchange of exposed buffers still owes, both ways. A schedule that fails
/// settles them before it returns: it tells every peer it has not answered that it gave up, then
/// waits until no live peer still reads this rank's buffers (ignoring the job abort that is under
/// way, not the deadline or dead peers), so that no buffer goes back to its caller while a peer
/// copies out of it.
struct Pending {
    /// Per peer: bytes the peer exposed that this rank has not answered yet.
    unanswered: Vec<usize>,
    /// Per peer: bytes this rank exposed to it that it has not answered yet.
    exposed: Vec<usize>,
}

impl Pending {
    /// Runs `body` with fresh bookkeeping; after an error, settles what is pending.
    fn settled<P: Peers>(
        peers: &mut P,
        s: &DirectShape,
        w: &Waiter,
        body: impl FnOnce(&mut P, &mut Pending) -> Result<()>,
    ) -> Result<()> {
        let mut pending = Pending { unanswered: vec![0; s.k], exposed: vec![0; s.k] };
        let result = body(peers, &mut pending);
        if result.is_err() {
            let w = w.ignoring_abort();
            for p in (0..s.k).filter(|&p| pending.unanswered[p] > 0) {
                // The link to `p` has room: it holds at most this rank's exposure besides this.
                let _ = peers.tx(p).give_up_reading(&w);
            }
            for p in (0..s.k).filter(|&p| pending.exposed[p] > 0) {
                // Ends with the answer, the peer's death or the deadline; the first error stands.
                let _ = peers.rx(p).wait_done_reading(pending.exposed[p], &w);
            }
        }
        result
    }
}

/// All-gather into the `n`-element `out`: this rank's block comes from `input` (or already sits at
/// its offset in `out`); every other block is read straight out of its owner's buffer.
pub fn all_gather<P: Peers>(
    peers: &mut P,
    s: &DirectShape,
    input: Option<&[u8]>,
    out: &mut [u8],
    w: &Waiter,
) -> Result<()> {
    let n = out.len() / s.esize;
    let mine = block_bytes(s, n, s.me);
    let (head, rest) = out.split_at_mut(mine.start);
    let (block, tail) = rest.split_at_mut(mine.len());
    if let Some(i) = input {
        block.copy_from_slice(i);
    }
    // Out of place, peers read the caller's input (equal to `block`); in place, `block` itself,
    // which is never written below.
    let exposed: &[u8] = input.unwrap_or(block);
    Pending::settled(peers, s, w, |peers, pending| {
        for to in s.peers() {
            peers.tx(to).expose(exposed, w)?;
            pending.exposed[to] = exposed.len();
        }
        for from in s.peers() {
            pending.unanswered[from] = block_bytes(s, n, from).len();
        }
        for from in s.peers() {
            let r = block_bytes(s, n, from);
            let dst = if r.end <= mine.start {
                &mut head[r.clone()]
            } else {
                &mut tail[r.start - mine.end..r.end - mine.end]
            };
            peers.rx(from).read_exposed(dst, w)?;
            peers.tx(from).done_reading(r.len(), w)?;
            pending.unanswered[from] = 0;
        }
        for to in s.peers() {
            peers.rx(to).wait_done_reading(exposed.len(), w)?;
            pending.exposed[to] = 0;
        }
        Ok(())
    })
}

/// All-to-all (the layout of [`crate::comm::algo::direct::all_to_all`]): every rank exposes its
/// input once per peer, each peer reads its own block of it straight into its slot of `out`.
pub fn all_to_all<P: Peers>(
    peers: &mut P,
    s: &DirectShape,
    input: &[u8],
    out: &mut [u8],
    w: &Waiter,
) -> Result<()> {
    let n = input.len() / s.esize;
    let len = block_bytes(s, n, s.me).len();
    out[s.me * len..(s.me + 1) * len].copy_from_slice(&input[block_bytes(s, n, s.me)]);
    Pending::settled(peers, s, w, |peers, pending| {
        for to in s.peers() {
            let block = &input[block_bytes(s, n, to)];
            peers.tx(to).expose(block, w)?;
            pending.exposed[to] = block.len();
        }
        for from in s.peers() {
            pending.unanswered[from] = len;
        }
        for from in s.peers() {
            peers.rx(from).read_exposed(&mut out[from * len..(from + 1) * len], w)?;
            peers.tx(from).done_reading(len, w)?;
            pending.unanswered[from] = 0;
        }
        for to in s.peers() {
            peers.rx(to).wait_done_reading(pending.exposed[to], w)?;
            pending.exposed[to] = 0;
        }
        Ok(())
    })
}

/// Broadcast of `buf` from `root`: every other rank reads the root's buffer directly.
pub fn broadcast<P: Peers>(
    peers: &mut P,
    s: &DirectShape,
    root: usize,
    buf: &mut [u8],
    w: &Waiter,
) -> Result<()> {
    Pending::settled(peers, s, w, |peers, pending| {
        if s.me == root {
            for to in s.peers() {
                peers.tx(to).expose(buf, w)?;
                pending.exposed[to] = buf.len();
            }
            for to in s.peers() {
                peers.rx(to).wait_done_reading(buf.len(), w)?;
                pending.exposed[to] = 0;
            }
            return Ok(());
        }
        pending.unanswered[root] = buf.len();
        peers.rx(root).read_exposed(buf, w)?;
        peers.tx(root).done_reading(buf.len(), w)?;
        pending.unanswered[root] = 0;
        Ok(())
    })
}

/// All-reduce: the ring's reduce-scatter (reduction fused into its copies) leaves each rank's
/// reduced block at its offset in `out`, then the all-gather reads every other block from its
/// owner.
#[allow(clippy::too_many_arguments)]
pub fn all_reduce<P: Peers>(
    peers: &mut P,
    ring_shape: &RingShape,
    s: &DirectShape,
    input: Option<&[u8]>,
    out: &mut [u8],
    red: &Reducer,
    w: &Waiter,
) -> Result<()> {
    let n = out.len() / s.esize;
    let (prev, next) = ring_shape.neighbours();
    ring::reduce_scatter(&mut peers.pipe(prev, next), ring_shape, input, out, n, red, w)?;
    all_gather(peers, s, None, out, w)
}
