//! Composed all-reduce: a reduce-scatter, then an all-gather of the reduced blocks, each half
//! carried by the schedule the tuner picks for *that* collective at the same byte size.
//!
//! Why it wins: the pipelined ring all-reduce makes 2(k-1) dependent steps, each a hand-off
//! between two ranks; when ranks share cores (more ranks than free cores, or busy cores), every
//! hand-off waits for a context switch, and mid-sized buffers (tens of KiB to a few MiB) are
//! dominated by those waits rather than by bandwidth. Split in two, each half takes its own
//! best schedule: the direct reduce-scatter and all-gather make one exchange each (every pair at
//! once), and at larger sizes the ring reduce-scatter can be followed by the single-copy
//! all-gather (peers read the owner's block), which the ring all-reduce cannot use. The halves'
//! cross-overs differ, so no single family is best for the whole all-reduce at every size.
//!
//! Invariants:
//! - the reduce-scatter leaves member `r`'s reduced block (`block_range(n, k, r)`) at that
//!   block's place in `out` on member `r`; the all-gather then copies every owner's block
//!   unchanged to every member, so every member ends with the same bits (each element was
//!   reduced once, by its owner);
//! - out of place, the input is only read: the reduce-scatter writes the block straight into
//!   `out`, and the all-gather runs in place on `out`;
//! - both halves run inside one all-reduce call (one sequence number, one fingerprint on every
//!   link), in the same order on every member; a peer's failure in either half is that call's
//!   error.

use crate::comm::algo::direct::DirectShape;
use crate::comm::block_range;
use crate::error::Result;

/// The two halves of the composed all-reduce, each run with its own schedule.
pub trait Halves {
    /// Reduce-scatter of an `n`-element buffer: `input` (`None`: in place) into `out`, which is
    /// this rank's block out of place and the whole buffer in place (the communicator's
    /// convention).
    fn reduce_scatter(&mut self, input: Option<&[u8]>, out: &mut [u8], n: usize) -> Result<()>;
    /// In-place all-gather of `buf`: this rank's block is sent, every other block filled in.
    fn all_gather(&mut self, buf: &mut [u8]) -> Result<()>;
}

/// All-reduce of `input` (`None`: in place) into `out` (the whole buffer on every member) as a
/// reduce-scatter followed by an all-gather; `shape` gives the member count, this member and the
/// element size (its chunk is unused: each half has its own).
pub fn all_reduce(
    h: &mut impl Halves,
    shape: &DirectShape,
    input: Option<&[u8]>,
    out: &mut [u8],
) -> Result<()> {
    let n = out.len() / shape.esize;
    match input {
        Some(input) => {
            let b = block_range(n, shape.k, shape.me);
            h.reduce_scatter(
                Some(input),
                &mut out[b.start * shape.esize..b.end * shape.esize],
                n,
            )?;
        }
        None => h.reduce_scatter(None, out, n)?,
    }
    h.all_gather(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the calls and emulates the halves on one member of `k` (the reduction is the
    /// identity): checks that the composition hands each half the right buffers.
    struct Trace {
        k: usize,
        me: usize,
        log: Vec<String>,
    }

    impl Halves for Trace {
        fn reduce_scatter(&mut self, input: Option<&[u8]>, out: &mut [u8], n: usize) -> Result<()> {
            let b = block_range(n, self.k, self.me);
            self.log.push(format!(
                "rs n={n} in={} out={}",
                input.map_or(0, <[u8]>::len),
                out.len()
            ));
            if let Some(i) = input {
                out.copy_from_slice(&i[b.start * 4..b.end * 4]);
            }
            Ok(())
        }
        fn all_gather(&mut self, buf: &mut [u8]) -> Result<()> {
            self.log.push(format!("ag {}", buf.len()));
            Ok(())
        }
    }

    #[test]
    fn out_of_place_reduces_into_the_own_block_then_gathers_the_whole_buffer() {
        for (n, k, me) in [(10usize, 3usize, 1usize), (2, 4, 3), (0, 2, 0), (7, 1, 0)] {
            let shape = DirectShape {
                k,
                me,
                esize: 4,
                chunk: 16,
            };
            let input: Vec<u8> = (0..n * 4).map(|i| i as u8).collect();
            let mut out = vec![0xAAu8; n * 4];
            let mut t = Trace { k, me, log: vec![] };
            all_reduce(&mut t, &shape, Some(&input), &mut out).unwrap();
            let b = block_range(n, k, me);
            assert_eq!(
                t.log,
                [
                    format!("rs n={n} in={} out={}", n * 4, b.len() * 4),
                    format!("ag {}", n * 4)
                ]
            );
            assert_eq!(
                out[b.start * 4..b.end * 4],
                input[b.start * 4..b.end * 4],
                "n={n} k={k} me={me}"
            );
            let mut t = Trace { k, me, log: vec![] };
            all_reduce(&mut t, &shape, None, &mut out).unwrap();
            assert_eq!(
                t.log,
                [
                    format!("rs n={n} in=0 out={}", n * 4),
                    format!("ag {}", n * 4)
                ]
            );
        }
    }
}
