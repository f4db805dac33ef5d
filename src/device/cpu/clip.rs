//! Global gradient-norm clipping, split so that sharded gradients can be clipped.
//!
//! Each rank computes [`sum_of_squares`] of the gradients it holds; the caller sums those
//! across ranks (all-reduce), takes the square root, and every rank multiplies its gradients by
//! [`clip_scale`] via [`scale_grads`].

use super::float::Float;
use super::parallel::{chunk_items, run_parts};
use super::simd;

/// Elements summed in the working precision before a block's sum is added in f64.
const BLOCK: usize = 1024;
/// Independent partial sums within a block: breaks the serial add chain so the loop vectorizes.
const LANES: usize = 16;

/// Σ g² over `grads`. Blocks of `BLOCK` elements are summed in `F` over `LANES` lanes
/// (64 terms per lane: relative error ~64 ulp, far below what clipping cares about), block sums
/// in f64 and in order, so 10⁸+ f32 gradients lose nothing to the total's magnitude. Blocks are
/// summed in parallel; the result does not depend on the thread count.
pub fn sum_of_squares<F: Float>(grads: &[F]) -> f64 {
    sum_of_squares_pieces(&[grads])
}

/// [`sum_of_squares`] of the concatenation of `pieces`, bit for bit, without concatenating: blocks
/// are cut from the concatenation, and a block that straddles pieces is gathered into a scratch
/// block of its own.
pub fn sum_of_squares_pieces<F: Float>(pieces: &[&[F]]) -> f64 {
    let mut sums: Vec<f64> = Vec::new();
    let mut carry: Vec<F> = Vec::with_capacity(BLOCK);
    for &piece in pieces {
        let mut rest = piece;
        if !carry.is_empty() {
            let take = (BLOCK - carry.len()).min(rest.len());
            carry.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if carry.len() < BLOCK {
                continue;
            }
            sums.push(block_sum(&carry));
            carry.clear();
        }
        let full = rest.len() - rest.len() % BLOCK;
        block_sums_into(&rest[..full], &mut sums);
        carry.extend_from_slice(&rest[full..]);
    }
    if !carry.is_empty() {
        sums.push(block_sum(&carry));
    }
    sums.iter().fold(0f64, |total, s| total + s)
}

/// Appends the sums of the whole blocks of `full` (a multiple of `BLOCK` long) to `sums`,
/// computed across the cores.
fn block_sums_into<F: Float>(full: &[F], sums: &mut Vec<f64>) {
    let start = sums.len();
    let blocks = full.len() / BLOCK;
    sums.resize(start + blocks, 0.0);
    let per = chunk_items(blocks, BLOCK);
    let parts = sums[start..].chunks_mut(per).zip(full.chunks(per * BLOCK));
    run_parts(parts, |(out, data)| {
        simd::widest(
            #[inline(always)]
            || {
                for (o, block) in out.iter_mut().zip(data.chunks(BLOCK)) {
                    *o = block_sum(block);
                }
            },
        )
    });
}

/// Σ g² of one block of at most `BLOCK` elements: `LANES` partial sums in `F`, a short block's
/// remainder summed apart, the two added in f64.
#[inline(always)]
fn block_sum<F: Float>(block: &[F]) -> f64 {
    let mut acc = [F::zero(); LANES];
    let lanes = block.chunks_exact(LANES);
    let tail: F = lanes.remainder().iter().map(|&g| g * g).sum();
    for chunk in lanes {
        for (a, &g) in acc.iter_mut().zip(chunk) {
            *a += g * g;
        }
    }
    acc.iter().copied().sum::<F>().as_f64() + tail.as_f64()
}

/// Factor that brings a gradient of global norm `norm` down to `max_norm` (1 when already
/// below, or when `max_norm <= 0` means clipping is off).
pub fn clip_scale(norm: f64, max_norm: f64) -> f64 {
    if max_norm > 0.0 && norm > max_norm {
        max_norm / norm
    } else {
        1.0
    }
}

/// grads *= scale (nothing to do, and no pass over memory, when scale is 1).
pub fn scale_grads<F: Float>(grads: &mut [F], scale: f64) {
    if scale == 1.0 {
        return;
    }
    let s = F::from_f64(scale);
    grads.iter_mut().for_each(|g| *g *= s);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces of every awkward length (empty, inside a block, straddling blocks, many blocks)
    /// give the bits of the concatenation, threaded or not, and the old serial loop's bits.
    #[test]
    fn pieces_sum_like_their_concatenation() {
        let all: Vec<f32> = (0..200_003).map(|i| ((i * 7919) % 1013) as f32 * 1e-3 - 0.5).collect();
        let serial = all.chunks(BLOCK).fold(0f64, |t, b| t + block_sum(b));
        assert_eq!(sum_of_squares(&all).to_bits(), serial.to_bits());
        for cuts in [vec![0, 0, 9000], vec![1, 1023, 1025, 3000, 150_001], vec![512, 1536, 199_999]] {
            let mut pieces = Vec::new();
            let mut at = 0;
            for &c in &cuts {
                pieces.push(&all[at..c]);
                at = c;
            }
            pieces.push(&all[at..]);
            assert_eq!(sum_of_squares_pieces(&pieces).to_bits(), serial.to_bits(), "{cuts:?}");
        }
    }

    #[test]
    fn partial_sums_combine_and_clip_to_max_norm() {
        let g = [3.0f32, 4.0, 0.0, 12.0];
        let total = sum_of_squares(&g[..2]) + sum_of_squares(&g[2..]);
        assert_eq!(total, 169.0);
        // Longer than the lane count, with a remainder: 1² + ... + 19² = 2470.
        let ramp: Vec<f64> = (1..20).map(f64::from).collect();
        assert_eq!(sum_of_squares(&ramp), 2470.0);
        let norm = total.sqrt();
        assert_eq!(clip_scale(norm, 1.0), 1.0 / 13.0);
        assert_eq!(clip_scale(norm, 20.0), 1.0);
        assert_eq!(clip_scale(norm, 0.0), 1.0);
        let mut h = g;
        scale_grads(&mut h, clip_scale(norm, 6.5));
        assert_eq!(h, [1.5, 2.0, 0.0, 6.0]);
    }
}
