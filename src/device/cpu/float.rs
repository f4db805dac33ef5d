//! The scalar type the model is generic over.
//!
//! Training runs in `f32`; the finite-difference gradient check runs the very same layer code in
//! `f64`, where central differences are accurate enough to validate every hand-written backward.
//! The trait adds to `num_traits::Float` only the conversions the layers need and the GEMM entry
//! point, so that each precision dispatches to its own BLAS routine.

use std::fmt::{Debug, Display};
use std::iter::Sum;

use num_traits::NumAssign;

use super::blas;

/// A floating-point element type the model can run in (`f32` or `f64`).
pub trait Float:
    num_traits::Float + NumAssign + Sum + Default + Debug + Display + Send + Sync + 'static
{
    /// Converts an `f64` constant (rounding for `f32`).
    fn from_f64(x: f64) -> Self;
    /// Widens to `f64`, e.g. for accumulating norms and losses.
    fn as_f64(self) -> f64;
    /// BLAS GEMM for this precision (row-major, see [`crate::device::cpu::blas`]); callers go through
    /// [`crate::device::cpu::matmul::matmul`], which checks shapes and bounds.
    const GEMM: blas::Gemm<Self>;
    /// e^self for the softmaxes and sigmoids: [`super::exp::exp_f32`] (vectorisable, <= 2 ulp)
    /// for `f32`, libm's `exp` for `f64`.
    fn fast_exp(self) -> Self;
}

impl Float for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn as_f64(self) -> f64 {
        self as f64
    }
    const GEMM: blas::Gemm<f32> = blas::sgemm;
    #[inline(always)]
    fn fast_exp(self) -> Self {
        super::exp::exp_f32(self)
    }
}

impl Float for f64 {
    fn from_f64(x: f64) -> Self {
        x
    }
    fn as_f64(self) -> f64 {
        self
    }
    const GEMM: blas::Gemm<f64> = blas::dgemm;
    #[inline(always)]
    fn fast_exp(self) -> Self {
        self.exp()
    }
}
