//! Fully connected layer `out = inp · Wᵀ + bias` (PyTorch `nn.Linear` convention, W is (OC, C)).
//!
//! In and out widths are arguments, so a tensor-parallel shard (a slice of W's rows for a
//! column-parallel layer, a slice of its columns for a row-parallel one) runs through the same
//! code. Every backward output accumulates (`+=`), so gradients of micro-batches add up and a
//! caller zeroes activation gradients it wants fresh.

use super::float::Float;
use super::matmul::{matmul, Mat};

/// out (N, OC) = inp (N, C) · weight (OC, C)ᵀ + bias (OC).
pub fn linear_forward<F: Float>(
    out: &mut [F],
    inp: &[F],
    weight: &[F],
    bias: Option<&[F]>,
    n: usize,
    c: usize,
    oc: usize,
) {
    matmul(
        &mut out[..n * oc],
        Mat::new(inp, n, c),
        Mat::t(weight, oc, c),
        false,
    );
    if let Some(bias) = bias {
        for row in out[..n * oc].chunks_exact_mut(oc) {
            for (o, &b) in row.iter_mut().zip(bias) {
                *o += b;
            }
        }
    }
}

/// dinp (N, C) += dout (N, OC) · weight (OC, C); dweight (OC, C) += doutᵀ · inp (N, C);
/// dbias (OC) += column sums of dout.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward<F: Float>(
    dinp: &mut [F],
    dweight: &mut [F],
    dbias: Option<&mut [F]>,
    dout: &[F],
    inp: &[F],
    weight: &[F],
    n: usize,
    c: usize,
    oc: usize,
) {
    matmul(
        &mut dinp[..n * c],
        Mat::new(dout, n, oc),
        Mat::new(weight, oc, c),
        true,
    );
    matmul(
        &mut dweight[..oc * c],
        Mat::t(dout, n, oc),
        Mat::new(inp, n, c),
        true,
    );
    if let Some(dbias) = dbias {
        for row in dout[..n * oc].chunks_exact(oc) {
            for (db, &d) in dbias.iter_mut().zip(row) {
                *db += d;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_and_backward_on_integers() {
        let (n, c, oc) = (2, 3, 2);
        let inp = [1.0f32, 2.0, 3.0, -1.0, 0.0, 1.0]; // (N, C)
        let w = [1.0f32, 0.0, -1.0, 2.0, 1.0, 0.0]; // (OC, C)
        let b = [0.5f32, -0.5]; // (OC)
        let mut out = [0f32; 4];
        linear_forward(&mut out, &inp, &w, Some(&b), n, c, oc);
        assert_eq!(out, [-1.5, 3.5, -1.5, -2.5]);
        let dout = [1.0f32, 1.0, 0.0, 2.0]; // (N, OC)
        let (mut dinp, mut dw, mut db) = ([0f32; 6], [1f32; 6], [0f32; 2]);
        linear_backward(&mut dinp, &mut dw, Some(&mut db), &dout, &inp, &w, n, c, oc);
        assert_eq!(dinp, [3.0, 1.0, -1.0, 4.0, 2.0, 0.0]);
        assert_eq!(dw, [2.0, 3.0, 4.0, 0.0, 3.0, 6.0]); // 1 + doutᵀ·inp
        assert_eq!(db, [1.0, 3.0]);
    }
}
