//! Residual connection `out = skip + branch`.
//!
//! Its backward is the identity onto both inputs, so the model keeps ONE gradient buffer for the
//! residual stream: the branch's output gradient is read straight from it, and the branch's input
//! gradient (LayerNorm backward) is accumulated back into it. No function is needed for that.

use super::float::Float;

/// out (N) = skip (N) + branch (N).
pub fn residual_forward<F: Float>(out: &mut [F], skip: &[F], branch: &[F]) {
    for ((o, &a), &b) in out.iter_mut().zip(skip).zip(branch) {
        *o = a + b;
    }
}
