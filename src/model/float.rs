//! The scalar type the model is generic over.
//!
//! Training runs in `f32`; the finite-difference gradient check runs the very same layer code in
//! `f64`, where central differences are accurate enough to validate every hand-written backward.
//! The trait adds to `num_traits::Float` only the conversions the layers need and the GEMM entry
//! point, so that each precision dispatches to its own BLAS routine.

use std::fmt::{Debug, Display};
use std::iter::Sum;

use num_traits::NumAssign;

/// A floating-point element type the model can run in (`f32` or `f64`).
pub trait Float:
    num_traits::Float + NumAssign + Sum + Default + Debug + Display + Send + Sync + 'static
{
    /// Converts an `f64` constant (rounding for `f32`).
    fn from_f64(x: f64) -> Self;
    /// Widens to `f64`, e.g. for accumulating norms and losses.
    fn as_f64(self) -> f64;
    /// Row-major `c(m, n) = alpha * a(m, k) * b(k, n) + beta * c` with explicit element strides;
    /// callers go through [`crate::model::gemm::matmul`], which checks the bounds.
    #[allow(clippy::too_many_arguments)]
    fn gemm_strided(
        m: usize,
        k: usize,
        n: usize,
        alpha: Self,
        a: &[Self],
        a_strides: (usize, usize),
        b: &[Self],
        b_strides: (usize, usize),
        beta: Self,
        c: &mut [Self],
    );
}

impl Float for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn as_f64(self) -> f64 {
        self as f64
    }
    fn gemm_strided(
        m: usize,
        k: usize,
        n: usize,
        alpha: f32,
        a: &[f32],
        (rsa, csa): (usize, usize),
        b: &[f32],
        (rsb, csb): (usize, usize),
        beta: f32,
        c: &mut [f32],
    ) {
        // SAFETY: `gemm::matmul` checked that every index `i*rs + j*cs` addressed in a, b and c
        // lies inside the slices; c is uniquely borrowed so it aliases neither a nor b.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                n,
                alpha,
                a.as_ptr(),
                rsa as isize,
                csa as isize,
                b.as_ptr(),
                rsb as isize,
                csb as isize,
                beta,
                c.as_mut_ptr(),
                n as isize,
                1,
            )
        }
    }
}

impl Float for f64 {
    fn from_f64(x: f64) -> Self {
        x
    }
    fn as_f64(self) -> f64 {
        self
    }
    fn gemm_strided(
        m: usize,
        k: usize,
        n: usize,
        alpha: f64,
        a: &[f64],
        (rsa, csa): (usize, usize),
        b: &[f64],
        (rsb, csb): (usize, usize),
        beta: f64,
        c: &mut [f64],
    ) {
        // SAFETY: as for f32: bounds checked by `gemm::matmul`, c does not alias a or b.
        unsafe {
            matrixmultiply::dgemm(
                m,
                k,
                n,
                alpha,
                a.as_ptr(),
                rsa as isize,
                csa as isize,
                b.as_ptr(),
                rsb as isize,
                csb as isize,
                beta,
                c.as_mut_ptr(),
                n as isize,
                1,
            )
        }
    }
}
