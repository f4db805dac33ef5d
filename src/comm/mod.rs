//! Communicators and collectives, written over transport links.
//!
//! Layering: [`primitives`] turns links into NCCL's message primitives (copies through a link's
//! FIFO, and single-copy reads of a peer's buffer where the link allows them); [`algo`] holds the
//! schedules (ring, direct, read) as plain functions over those primitives; [`communicator`] owns
//! the links of one group of ranks, chooses a schedule per call ([`tuning`] holds the tunables)
//! and exposes the typed, `Result` returning API. No algorithm knows which transport or device
//! carries its bytes.
//!
//! Buffers that are split across ranks (reduce-scatter output, all-gather input, all-to-all
//! blocks) use [`block_range`]: `n` elements cut into `k` contiguous blocks whose lengths differ by
//! at most one, the longer ones first. Any `n`, including 0 and counts not divisible by `k`, works.

pub mod algo;
pub mod communicator;
pub mod device;
pub mod fingerprint;
pub mod flight;
pub mod primitives;
pub mod probe;
pub mod selftest;
pub mod stats;
pub mod tuning;
#[cfg(test)]
mod collective_tests;
#[cfg(test)]
pub(crate) mod testing;

use std::ops::Range;

pub use communicator::Communicator;
pub use tuning::{Algo, Cma, CommConfig};
// The element types moved to the crate-root leaf [`crate::dtype`]; re-exported here so that code
// written against `comm::{DType, ReduceOp, ...}` keeps compiling.
pub use crate::dtype::{self, DType, Element, ReduceOp};

/// Element range of block `i` when `n` elements are cut into `k` near-equal contiguous blocks.
pub fn block_range(n: usize, k: usize, i: usize) -> Range<usize> {
    let (base, rem) = (n / k, n % k);
    let start = i * base + i.min(rem);
    start..start + base + usize::from(i < rem)
}

#[cfg(test)]
mod tests {
    use super::block_range;

    #[test]
    fn blocks_tile_the_buffer() {
        for n in [0, 1, 2, 7, 8, 13, 1000] {
            for k in 1..=8 {
                let mut next = 0;
                for i in 0..k {
                    let r = block_range(n, k, i);
                    assert_eq!(r.start, next);
                    assert!(r.len() == n / k || r.len() == n / k + 1);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }
}
