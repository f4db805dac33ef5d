//! Matrix multiply over row-major slices: the one place the model calls BLAS.
//!
//! Backend: system OpenBLAS through `cblas_{s,d}gemm` (see `blas.rs`), chosen by measurement
//! against the `matrixmultiply` crate (0.3, `threading`, 2 threads) on this 2-core AMD EPYC
//! (AVX2/FMA) at the d12 step's shapes (B=4, T=64: M = B*T = 256, C = 768, Vp = 50304): sgemm,
//! both with 2 threads, best of 3 interleaved rounds of ~20 GFLOP each. The machine is shared
//! with other builds, so two runs are shown: a loaded one (load average ~5) and a quieter one
//! (~2.2):
//!
//! | GEMM (M x N x K)              | loaded: mm / OpenBLAS | quieter: mm / OpenBLAS |
//! |-------------------------------|-----------------------|------------------------|
//! | qkv fwd 256x2304x768          | 59.6 / 69.5 GFLOP/s   | 82.1 / 138.1 GFLOP/s   |
//! | mlp fc fwd 256x3072x768       | 65.3 / 71.8           | 109.2 / 147.4          |
//! | mlp proj fwd 256x768x3072     | 62.2 / 68.6           | 112.2 / 142.0          |
//! | logits fwd 256x50304x768      | 53.5 / 70.9           | 82.3 / 138.4           |
//! | logits dinp 256x768x50304     | 72.8 / 77.3           | 104.0 / 132.7          |
//! | logits dW 50304x768x256 (Aᵀ)  | 71.5 / 76.3           | 137.3 / 149.4          |
//! | fc dW 3072x768x256 (Aᵀ)       | 79.4 / 81.7           | 142.6 / 148.6          |
//!
//! OpenBLAS is faster on every shape (up to 1.7x, most on the forward GEMMs and the largest,
//! the logits), and it scales past the 4 threads `matrixmultiply` caps at, which matters on
//! many-core nodes. The price is a system library (`libopenblas-dev`) at build time.
//!
//! Invariant: every operand is a dense row-major matrix in its slice (leading dimension = its
//! column count); a transposed operand is read through swapped strides, never copied.

use super::blas::Operand;
use super::float::Float;

/// A dense row-major operand: `data` holds `rows * cols` elements; `transposed` means the GEMM
/// reads it as its transpose (`cols x rows`).
#[derive(Clone, Copy)]
pub struct Mat<'a, F> {
    /// Row-major storage.
    pub data: &'a [F],
    /// Stored row count.
    pub rows: usize,
    /// Stored column count (the leading dimension).
    pub cols: usize,
    /// Whether the product uses the transpose of the stored matrix.
    pub transposed: bool,
}

impl<'a, F> Mat<'a, F> {
    /// The stored `rows x cols` matrix as is.
    pub fn new(data: &'a [F], rows: usize, cols: usize) -> Self {
        Mat {
            data,
            rows,
            cols,
            transposed: false,
        }
    }

    /// The transpose of the stored `rows x cols` matrix.
    pub fn t(data: &'a [F], rows: usize, cols: usize) -> Self {
        Mat {
            data,
            rows,
            cols,
            transposed: true,
        }
    }

    /// (rows, cols) as seen by the product.
    fn logical(&self) -> (usize, usize) {
        if self.transposed {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }

    /// The operand as BLAS takes it.
    fn operand(&self) -> Operand<'a, F> {
        Operand {
            data: self.data,
            ld: self.cols,
            trans: self.transposed,
        }
    }
}

/// `c(m, n) = a(m, k) * b(k, n) + (accumulate ? c : 0)`, c dense row-major `m x n`.
///
/// Panics if the shapes disagree or a slice is too short: callers size every buffer from the
/// model shape, so a mismatch is a broken internal invariant, not a user error.
pub fn matmul<F: Float>(c: &mut [F], a: Mat<'_, F>, b: Mat<'_, F>, accumulate: bool) {
    let (m, k) = a.logical();
    let (kb, n) = b.logical();
    assert_eq!(k, kb, "matmul: inner dimensions differ ({m}x{k} * {kb}x{n})");
    assert!(
        a.data.len() >= a.rows * a.cols,
        "matmul: a shorter than {}x{}",
        a.rows,
        a.cols
    );
    assert!(
        b.data.len() >= b.rows * b.cols,
        "matmul: b shorter than {}x{}",
        b.rows,
        b.cols
    );
    assert!(c.len() >= m * n, "matmul: c shorter than {m}x{n}");
    if m == 0 || n == 0 {
        return;
    }
    let beta = if accumulate { F::one() } else { F::zero() };
    F::GEMM(m, n, k, a.operand(), b.operand(), beta, &mut c[..m * n]);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exact small-integer products, so equality is exact in f32.
    #[test]
    fn all_transpose_combinations_match_naive() {
        let (m, k, n) = (3usize, 4usize, 5usize);
        let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 - 3.0).collect(); // (m, k)
        let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 - 2.0).collect(); // (k, n)
        let mut want = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                want[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        let transpose = |x: &[f32], r: usize, c: usize| {
            let mut y = vec![0f32; r * c];
            for i in 0..r {
                for j in 0..c {
                    y[j * r + i] = x[i * c + j];
                }
            }
            y
        };
        let at = transpose(&a, m, k); // (k, m)
        let bt = transpose(&b, k, n); // (n, k)
        for (ma, mb) in [
            (Mat::new(&a, m, k), Mat::new(&b, k, n)),
            (Mat::t(&at, k, m), Mat::new(&b, k, n)),
            (Mat::new(&a, m, k), Mat::t(&bt, n, k)),
            (Mat::t(&at, k, m), Mat::t(&bt, n, k)),
        ] {
            let mut c = vec![1f32; m * n];
            matmul(&mut c, ma, mb, true);
            let plus_one: Vec<f32> = want.iter().map(|w| w + 1.0).collect();
            assert_eq!(c, plus_one);
            matmul(&mut c, ma, mb, false);
            assert_eq!(c, want);
        }
    }
}
