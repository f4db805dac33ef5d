//! RMSNorm over the channel dimension with a learned weight (Llama; no mean, no bias).
//!
//! `rstd = 1 / sqrt(mean(x²) + eps)` and `out = (x * rstd) * weight`, in that order: Hugging
//! Face's `LlamaRMSNorm` normalises first and multiplies by the weight last, so the f32 results
//! round the same way. The forward saves `rstd` per row for the backward. Rows are independent,
//! so the forward and the input gradient split rows across the cores; the weight gradient is a
//! sum over rows, so it splits columns, each column still adding its rows in order (`norm_params`,
//! shared with LayerNorm). Either way every element is computed exactly as on one thread (bitwise
//! independent of the thread count).

use super::float::Float;
use super::norm_params::{norm_dparams, NormRows};
use super::parallel::{chunk_items, run_parts};

/// out (N, C) = inp * rstd * weight; rstd (N) = 1/sqrt(mean(inp²) + eps); inp (N, C); weight (C).
pub fn rmsnorm_forward<F: Float>(
    out: &mut [F],
    rstd: &mut [F],
    inp: &[F],
    weight: &[F],
    c: usize,
    eps: F,
) {
    let per = chunk_items(rstd.len(), c);
    let parts = out.chunks_mut(per * c.max(1)).zip(rstd.chunks_mut(per));
    run_parts(parts.zip(inp.chunks(per * c.max(1))), |((o, r), x)| {
        rmsnorm_forward_serial(o, r, x, weight, c, eps)
    });
}

fn rmsnorm_forward_serial<F: Float>(
    out: &mut [F],
    rstd: &mut [F],
    inp: &[F],
    weight: &[F],
    c: usize,
    eps: F,
) {
    let inv_c = F::from_f64(1.0 / c as f64);
    for ((o, x), r) in out.chunks_exact_mut(c).zip(inp.chunks_exact(c)).zip(rstd) {
        let ms = x.iter().map(|&xi| xi * xi).sum::<F>() * inv_c;
        let s = F::one() / (ms + eps).sqrt();
        for ((oi, &xi), &w) in o.iter_mut().zip(x).zip(weight) {
            *oi = xi * s * w;
        }
        *r = s;
    }
}

/// dinp (N, C) += ..., dweight (C) += ...; dout, inp (N, C); weight (C); rstd (N) of the forward.
pub fn rmsnorm_backward<F: Float>(
    dinp: &mut [F],
    dweight: &mut [F],
    dout: &[F],
    inp: &[F],
    weight: &[F],
    rstd: &[F],
    c: usize,
) {
    let n = rstd.len();
    let per = chunk_items(n, c);
    let rows = dinp.chunks_mut(per * c.max(1)).enumerate();
    run_parts(rows, |(i, di)| {
        let r = i * per..i * per + di.len() / c.max(1);
        dinp_rows(
            di,
            weight,
            &dout[r.start * c..r.end * c],
            &inp[r.start * c..r.end * c],
            &rstd[r],
            c,
        )
    });
    norm_dparams(dweight, None, &NormRows { dout, inp, mean: None, rstd, c });
}

/// dinp += s * (dnorm - xhat * mean(dnorm * xhat)) with dnorm = dout * weight, xhat = x * s, for
/// the rows `dinp` holds (`dout`, `inp`, `rstd` the same rows).
fn dinp_rows<F: Float>(dinp: &mut [F], weight: &[F], dout: &[F], inp: &[F], rstd: &[F], c: usize) {
    let inv_c = F::from_f64(1.0 / c as f64);
    let rows = dinp
        .chunks_exact_mut(c)
        .zip(dout.chunks_exact(c))
        .zip(inp.chunks_exact(c));
    for (((di, dy), x), &s) in rows.zip(rstd) {
        let mut m = F::zero();
        for ((&dyi, &xi), &w) in dy.iter().zip(x).zip(weight) {
            m += dyi * w * (xi * s);
        }
        m *= inv_c;
        for (((dxi, &dyi), &xi), &w) in di.iter_mut().zip(dy).zip(x).zip(weight) {
            *dxi += s * (dyi * w - xi * s * m);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, a: usize, m: usize, scale: f64) -> Vec<f64> {
        (0..n)
            .map(|i| (((i * a) % m) as f64 / m as f64 - 0.45) * scale)
            .collect()
    }

    /// A hand-computed row: x = (3, 4), mean(x²) = 12.5, eps = 0.5: rstd = 1/sqrt(13).
    #[test]
    fn forward_matches_the_formula() {
        let (mut out, mut rstd) = ([0.0f64; 2], [0.0f64]);
        rmsnorm_forward(&mut out, &mut rstd, &[3.0, 4.0], &[2.0, -1.0], 2, 0.5);
        let s = 1.0 / 13f64.sqrt();
        assert!((rstd[0] - s).abs() < 1e-16);
        assert!((out[0] - 6.0 * s).abs() < 1e-15 && (out[1] + 4.0 * s).abs() < 1e-15);
    }

    /// The loss L = Σ out * g; every input and weight gradient against central differences in
    /// f64, with non-zero starting gradients (the backward accumulates).
    #[test]
    fn backward_matches_finite_differences() {
        let (n, c, eps) = (3, 7, 1e-5);
        let (inp, w, g) = (
            data(n * c, 37, 101, 4.0),
            data(c, 7, 13, 2.0),
            data(n * c, 53, 97, 1.0),
        );
        let loss = |x: &[f64], w: &[f64]| {
            let (mut out, mut r) = (vec![0.0; n * c], vec![0.0; n]);
            rmsnorm_forward(&mut out, &mut r, x, w, c, eps);
            out.iter().zip(&g).map(|(o, g)| o * g).sum::<f64>()
        };
        let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
        rmsnorm_forward(&mut out, &mut rstd, &inp, &w, c, eps);
        let (d0, dw0) = (data(n * c, 3, 7, 1.0), data(c, 5, 11, 1.0));
        let (mut dinp, mut dw) = (d0.clone(), dw0.clone());
        rmsnorm_backward(&mut dinp, &mut dw, &g, &inp, &w, &rstd, c);
        // dinp against d loss / d inp, then dweight against d loss / d weight.
        check_fd("dinp", &inp, &dinp, &d0, |x: &[f64]| loss(x, &w));
        check_fd("dweight", &w, &dw, &dw0, |x: &[f64]| loss(&inp, x));
    }

    /// Asserts that `got - start` (a gradient accumulated onto `start`) matches the central
    /// difference of `loss` at `at`, element by element.
    fn check_fd(what: &str, at: &[f64], got: &[f64], start: &[f64], loss: impl Fn(&[f64]) -> f64) {
        let h = 1e-6;
        for i in 0..at.len() {
            let (mut p, mut m) = (at.to_vec(), at.to_vec());
            (p[i], m[i]) = (p[i] + h, m[i] - h);
            let fd = (loss(&p) - loss(&m)) / (2.0 * h);
            let d = got[i] - start[i];
            assert!((d - fd).abs() < 1e-7, "{what}[{i}]: {d} vs {fd}");
        }
    }

    /// Rows and columns split across threads compute every element exactly as one pass does.
    #[test]
    fn threaded_equals_serial_bitwise() {
        let (n, c) = (203, 768);
        let f = |i: usize, a: usize, m: usize| ((i * a) % m) as f32 * 0.03 - 1.0;
        let inp: Vec<f32> = (0..n * c).map(|i| f(i, 37, 101)).collect();
        let dout: Vec<f32> = (0..n * c).map(|i| f(i, 53, 97)).collect();
        let w: Vec<f32> = (0..c).map(|i| f(i, 7, 13)).collect();
        let (mut out, mut rstd) = (vec![0f32; n * c], vec![0f32; n]);
        rmsnorm_forward(&mut out, &mut rstd, &inp, &w, c, 1e-5);
        let (mut out1, mut rstd1) = (vec![0f32; n * c], vec![0f32; n]);
        rmsnorm_forward_serial(&mut out1, &mut rstd1, &inp, &w, c, 1e-5);
        assert_eq!((&out, &rstd), (&out1, &rstd1));
        let (mut d1, mut dw1) = (vec![0.5f32; n * c], vec![0.25f32; c]);
        let (mut d2, mut dw2) = (d1.clone(), dw1.clone());
        rmsnorm_backward(&mut d1, &mut dw1, &dout, &inp, &w, &rstd, c);
        dinp_rows(&mut d2, &w, &dout, &inp, &rstd, c);
        // The weight gradient written out directly: Σ_rows inp * rstd * dout, rows in order.
        for ((dy, x), &s) in dout.chunks_exact(c).zip(inp.chunks_exact(c)).zip(&rstd) {
            for ((dw, &dyi), &xi) in dw2.iter_mut().zip(dy).zip(x) {
                *dw += xi * s * dyi;
            }
        }
        assert_eq!((d1, dw1), (d2, dw2));
    }
}
