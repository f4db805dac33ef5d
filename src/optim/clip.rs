//! Global gradient-norm clipping, split so that sharded gradients can be clipped.
//!
//! Each rank computes [`sum_of_squares`] of the gradients it holds; the caller sums those
//! across ranks (all-reduce), takes the square root, and every rank multiplies its gradients by
//! [`clip_scale`] via [`scale_grads`].

use crate::model::Float;

/// Elements summed in the working precision before a block's sum is added in f64.
const BLOCK: usize = 1024;
/// Independent partial sums within a block: breaks the serial add chain so the loop vectorizes.
const LANES: usize = 16;

/// Σ g² over `grads`. Blocks of `BLOCK` elements are summed in `F` over `LANES` lanes
/// (64 terms per lane: relative error ~64 ulp, far below what clipping cares about), block sums
/// in f64, so 10⁸+ f32 gradients lose nothing to the total's magnitude.
pub fn sum_of_squares<F: Float>(grads: &[F]) -> f64 {
    let mut total = 0f64;
    for block in grads.chunks(BLOCK) {
        let mut acc = [F::zero(); LANES];
        let lanes = block.chunks_exact(LANES);
        let tail: F = lanes.remainder().iter().map(|&g| g * g).sum();
        for chunk in lanes {
            for (a, &g) in acc.iter_mut().zip(chunk) {
                *a += g * g;
            }
        }
        total += acc.iter().copied().sum::<F>().as_f64() + tail.as_f64();
    }
    total
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
