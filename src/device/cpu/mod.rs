//! The CPU arm's kernels: every layer's `_forward`/`_backward` over slices (llm.c style, one file
//! per layer), the matrix product (BLAS for f32, a blocked loop otherwise), the AdamW element
//! update, gradient-norm partials, and the worker threads they split across.
//!
//! They are the `Device::Cpu` arm of [`super::ops`] and the numerical reference the GPU kernels
//! (kernels/*.cu) are tested against; the single-rank reference model (`model::Gpt`) composes
//! the same functions. Everything is generic over [`Float`] (`f32` for training, `f64` for
//! gradient checks). Invariant: splitting a layer across threads never changes the order of any
//! floating-point sum, so its results are bitwise independent of the thread count (OpenBLAS's
//! f32 GEMM is the exception; see `blas.rs`).

pub mod adamw;
pub mod attention;
pub mod blas;
pub mod clip;
pub mod cross_entropy;
pub mod encoder;
pub mod exp;
pub mod float;
pub mod gelu;
pub mod layernorm;
pub mod linear;
pub mod matmul;
pub mod norm_params;
pub mod parallel;
pub mod residual;
pub mod rmsnorm;
pub mod rope;
pub mod simd;
pub mod swiglu;
pub mod vocab_parallel;

pub use float::Float;
pub use parallel::set_cpu_threads;
