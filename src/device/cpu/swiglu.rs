//! SwiGLU, Llama's MLP activation: `out = silu(gate) * up`, `silu(x) = x / (1 + exp(-x))`.
//!
//! The input row holds `[gate (F) | up (F)]` (one fused gate-and-up projection's output), the
//! output row F values. The backward OVERWRITES the input gradient (both halves of every row are
//! written; nothing else adds into them), unlike the accumulating LayerNorm/GELU backwards.
//! The sigmoid is `1 / (1 + exp(-x))`, which saturates without NaN: for x far below zero
//! `exp(-x)` is inf and the sigmoid 0. Rows are independent and split across the cores, so the
//! results are bitwise independent of the thread count.

use super::float::Float;
use super::parallel::{chunk_items, run_parts};

fn sigmoid<F: Float>(x: F) -> F {
    F::one() / (F::one() + (-x).fast_exp())
}

/// out (N, F) = silu(gate) * up for inp (N, 2F) rows `[gate | up]`.
pub fn swiglu_forward<F: Float>(out: &mut [F], inp: &[F], f: usize) {
    let rows = chunk_items(out.len() / f.max(1), 2 * f) * f.max(1);
    run_parts(out.chunks_mut(rows).zip(inp.chunks(2 * rows)), |(o, x)| {
        swiglu_forward_serial(o, x, f)
    });
}

fn swiglu_forward_serial<F: Float>(out: &mut [F], inp: &[F], f: usize) {
    for (o, x) in out.chunks_exact_mut(f).zip(inp.chunks_exact(2 * f)) {
        let (gate, up) = x.split_at(f);
        for ((oi, &g), &u) in o.iter_mut().zip(gate).zip(up) {
            *oi = g * sigmoid(g) * u;
        }
    }
}

/// dinp (N, 2F) = [d gate | d up] (overwritten) from dout (N, F) and the forward's inp (N, 2F).
pub fn swiglu_backward<F: Float>(dinp: &mut [F], dout: &[F], inp: &[F], f: usize) {
    let rows = chunk_items(dout.len() / f.max(1), 2 * f) * f.max(1);
    let parts = dinp
        .chunks_mut(2 * rows)
        .zip(dout.chunks(rows))
        .zip(inp.chunks(2 * rows));
    run_parts(parts, |((d, dy), x)| swiglu_backward_serial(d, dy, x, f));
}

fn swiglu_backward_serial<F: Float>(dinp: &mut [F], dout: &[F], inp: &[F], f: usize) {
    for ((d, dy), x) in dinp
        .chunks_exact_mut(2 * f)
        .zip(dout.chunks_exact(f))
        .zip(inp.chunks_exact(2 * f))
    {
        let (dgate, dup) = d.split_at_mut(f);
        let (gate, up) = x.split_at(f);
        for i in 0..f {
            // silu'(g) = sig(g) (1 + g (1 - sig(g))).
            let (g, u, dyi) = (gate[i], up[i], dy[i]);
            let s = sigmoid(g);
            dup[i] = dyi * (g * s);
            dgate[i] = dyi * u * (s * (F::one() + g * (F::one() - s)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// silu(1) = 1 / (1 + e^-1); silu(-2) = -2 / (1 + e^2).
    #[test]
    fn forward_matches_the_formula() {
        let mut out = [0.0f64; 2];
        swiglu_forward(&mut out, &[1.0, -2.0, 3.0, 0.5], 2);
        let e = std::f64::consts::E;
        assert!((out[0] - 3.0 / (1.0 + 1.0 / e)).abs() < 1e-15);
        assert!((out[1] - 0.5 * -2.0 / (1.0 + e * e)).abs() < 1e-15);
    }

    /// L = Σ out * g; the gradient of both halves against central differences in f64, and the
    /// backward overwrites (a stale dinp does not leak through).
    #[test]
    fn backward_matches_finite_differences_and_overwrites() {
        let (n, f) = (3, 5);
        let inp: Vec<f64> = (0..n * 2 * f)
            .map(|i| ((i * 37) % 23) as f64 * 0.4 - 4.0)
            .collect();
        let g: Vec<f64> = (0..n * f)
            .map(|i| ((i * 53) % 17) as f64 * 0.1 - 0.8)
            .collect();
        let loss = |x: &[f64]| {
            let mut out = vec![0.0; n * f];
            swiglu_forward(&mut out, x, f);
            out.iter().zip(&g).map(|(o, g)| o * g).sum::<f64>()
        };
        let mut dinp = vec![f64::NAN; n * 2 * f];
        swiglu_backward(&mut dinp, &g, &inp, f);
        let h = 1e-6;
        for i in 0..inp.len() {
            let (mut p, mut m) = (inp.clone(), inp.clone());
            (p[i], m[i]) = (p[i] + h, m[i] - h);
            let fd = (loss(&p) - loss(&m)) / (2.0 * h);
            assert!(
                (dinp[i] - fd).abs() < 1e-8,
                "dinp[{i}]: {} vs {fd}",
                dinp[i]
            );
        }
    }

    /// Large gates saturate without NaN.
    #[test]
    fn saturates_without_nan() {
        let mut out = [0f32; 2];
        swiglu_forward(&mut out, &[-200.0, 200.0, 1.0, 1.0], 2);
        assert_eq!(out, [-0.0, 200.0]);
        let mut d = [0f32; 4];
        swiglu_backward(&mut d, &[1.0, 1.0], &[-200.0, 200.0, 1.0, 1.0], 2);
        assert_eq!(d, [0.0, 1.0, -0.0, 200.0]);
    }

    /// A split across threads computes each element exactly as the serial kernel does.
    #[test]
    fn threaded_equals_serial_bitwise() {
        let (n, f) = (301, 700);
        let inp: Vec<f32> = (0..n * 2 * f)
            .map(|i| ((i * 37) % 101) as f32 * 0.1 - 5.0)
            .collect();
        let dout: Vec<f32> = (0..n * f)
            .map(|i| ((i * 53) % 97) as f32 * 0.01 - 0.5)
            .collect();
        let (mut a, mut b) = (vec![0f32; n * f], vec![0f32; n * f]);
        swiglu_forward(&mut a, &inp, f);
        swiglu_forward_serial(&mut b, &inp, f);
        assert_eq!(a, b);
        let (mut a, mut b) = (vec![0f32; n * 2 * f], vec![0f32; n * 2 * f]);
        swiglu_backward(&mut a, &dout, &inp, f);
        swiglu_backward_serial(&mut b, &dout, &inp, f);
        assert_eq!(a, b);
    }
}
