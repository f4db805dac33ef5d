//! Global gradient-norm clipping, split so that sharded gradients can be clipped.
//!
//! Each rank computes [`sum_of_squares`] of the gradients it holds; the caller sums those
//! across ranks (all-reduce), takes the square root, and every rank multiplies its gradients by
//! [`clip_scale`] via [`scale_grads`]. Sums accumulate in f64 so that f32 gradients of 10⁸+
//! elements do not lose the small contributions.

use crate::model::Float;

/// Σ g² over `grads`, accumulated in f64.
pub fn sum_of_squares<F: Float>(grads: &[F]) -> f64 {
    grads.iter().map(|&g| g.as_f64() * g.as_f64()).sum()
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

/// grads *= scale.
pub fn scale_grads<F: Float>(grads: &mut [F], scale: f64) {
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
        let norm = total.sqrt();
        assert_eq!(clip_scale(norm, 1.0), 1.0 / 13.0);
        assert_eq!(clip_scale(norm, 20.0), 1.0);
        assert_eq!(clip_scale(norm, 0.0), 1.0);
        let mut h = g;
        scale_grads(&mut h, clip_scale(norm, 6.5));
        assert_eq!(h, [1.5, 2.0, 0.0, 6.0]);
    }
}
