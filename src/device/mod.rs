//! Compute devices. The CPU is always available and is the numerical reference; CUDA and HIP arms
//! are not built yet (`--device cuda|hip` is rejected by the config check with a clear message).
//!
//! The CPU arm's peak FLOP rate is measured, not guessed: MFU on CPU is reported against the sgemm
//! rate this process reaches with its share of the node's cores.

use std::time::Instant;

use crate::model::gemm::{matmul, Mat};
use crate::model::parallel::set_cpu_threads;

/// Cores this rank may use when `ranks_on_node` ranks share the node (at least 1).
pub fn cores_per_rank(ranks_on_node: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / ranks_on_node.max(1)).max(1)
}

/// Splits the node's cores among its ranks for this process's BLAS and layer threads
/// (oversubscribed OpenBLAS threads spin and slow every rank down).
pub fn bind_cpu_threads(ranks_on_node: usize) {
    set_cpu_threads(cores_per_rank(ranks_on_node));
}

/// Measured sgemm TFLOP/s of this process (a square GEMM of 768, best of a few runs, ~0.1 s),
/// used as the CPU's peak for MFU.
pub fn cpu_peak_tflops(ranks_on_node: usize) -> f64 {
    bind_cpu_threads(ranks_on_node);
    let n = 768;
    let a = vec![1.0f32; n * n];
    let b = vec![0.5f32; n * n];
    let mut c = vec![0.0f32; n * n];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        matmul(&mut c, Mat::new(&a, n, n), Mat::new(&b, n, n), false);
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (n * n * n) as f64 / best / 1e12
}
