//! LayerNorm over the channel dimension with learned weight and bias, eps = 1e-5.
//!
//! The forward saves the per-row mean and reciprocal standard deviation; the backward uses them
//! instead of recomputing. Rows are independent, so the forward and the backward's input
//! gradient split rows across the cores; the weight and bias gradients are sums over rows, so
//! they split columns instead, each column still summing its rows in order (`norm_params`, shared
//! with RMSNorm). Either way every element is computed exactly as on one thread (bitwise
//! independent of the thread count).

use super::float::Float;
use super::norm_params::{norm_dparams, NormRows};
use super::parallel::{chunk_items, run_parts};

/// GPT-2's LayerNorm epsilon.
pub const LN_EPS: f64 = 1e-5;

/// out (N, C) = (inp - mean) * rstd * weight + bias; mean, rstd (N); inp (N, C); weight, bias (C).
pub fn layernorm_forward<F: Float>(
    out: &mut [F],
    mean: &mut [F],
    rstd: &mut [F],
    inp: &[F],
    weight: &[F],
    bias: &[F],
    c: usize,
) {
    let per = chunk_items(mean.len(), c);
    let outs = out
        .chunks_mut(per * c)
        .zip(mean.chunks_mut(per).zip(rstd.chunks_mut(per)));
    run_parts(outs.zip(inp.chunks(per * c)), |((o, (m, r)), x)| {
        layernorm_forward_serial(o, m, r, x, weight, bias, c)
    });
}

fn layernorm_forward_serial<F: Float>(
    out: &mut [F],
    mean: &mut [F],
    rstd: &mut [F],
    inp: &[F],
    weight: &[F],
    bias: &[F],
    c: usize,
) {
    let inv_c = F::from_f64(1.0 / c as f64);
    let eps = F::from_f64(LN_EPS);
    for (((o, x), m), r) in out
        .chunks_exact_mut(c)
        .zip(inp.chunks_exact(c))
        .zip(mean)
        .zip(rstd)
    {
        let mu = x.iter().copied().sum::<F>() * inv_c;
        let var = x.iter().map(|&xi| (xi - mu) * (xi - mu)).sum::<F>() * inv_c;
        let s = F::one() / (var + eps).sqrt();
        for (((oi, &xi), &w), &b) in o.iter_mut().zip(x).zip(weight).zip(bias) {
            *oi = (xi - mu) * s * w + b;
        }
        *m = mu;
        *r = s;
    }
}

/// dinp (N, C) += ..., dweight (C) += ..., dbias (C) += ...; dout, inp (N, C); mean, rstd (N).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<F: Float>(
    dinp: &mut [F],
    dweight: &mut [F],
    dbias: &mut [F],
    dout: &[F],
    inp: &[F],
    weight: &[F],
    mean: &[F],
    rstd: &[F],
    c: usize,
) {
    let saved = Saved {
        dout,
        inp,
        mean,
        rstd,
        c,
    };
    let per = chunk_items(mean.len(), c);
    let parts = dinp.chunks_mut(per * c).enumerate();
    run_parts(parts, |(i, di)| {
        dinp_rows(
            di,
            weight,
            &saved.rows(i * per..i * per + di.len() / c.max(1)),
        )
    });
    let rows = NormRows { dout, inp, mean: Some(mean), rstd, c };
    norm_dparams(dweight, Some(dbias), &rows);
}

/// What the backward reads besides the weight: dout, inp (rows of C) and the forward's mean and
/// rstd (one per row).
struct Saved<'a, F> {
    dout: &'a [F],
    inp: &'a [F],
    mean: &'a [F],
    rstd: &'a [F],
    c: usize,
}

impl<'a, F> Saved<'a, F> {
    fn rows(&self, r: std::ops::Range<usize>) -> Saved<'a, F> {
        let c = self.c;
        Saved {
            dout: &self.dout[r.start * c..r.end * c],
            inp: &self.inp[r.start * c..r.end * c],
            mean: &self.mean[r.clone()],
            rstd: &self.rstd[r],
            c,
        }
    }
}

/// dinp += ... for the rows of `saved` (dinp holds the same rows).
fn dinp_rows<F: Float>(dinp: &mut [F], weight: &[F], saved: &Saved<F>) {
    let c = saved.c;
    let inv_c = F::from_f64(1.0 / c as f64);
    let rows = dinp
        .chunks_exact_mut(c)
        .zip(saved.dout.chunks_exact(c))
        .zip(saved.inp.chunks_exact(c));
    for (((di, dy), x), (&mu, &s)) in rows.zip(saved.mean.iter().zip(saved.rstd)) {
        // dnorm = dy * weight; dx = s * (dnorm - mean(dnorm) - xhat * mean(dnorm * xhat)).
        let mut dnorm_mean = F::zero();
        let mut dnorm_xhat_mean = F::zero();
        for ((&dyi, &xi), &w) in dy.iter().zip(x).zip(weight) {
            let dnorm = dyi * w;
            dnorm_mean += dnorm;
            dnorm_xhat_mean += dnorm * (xi - mu) * s;
        }
        dnorm_mean *= inv_c;
        dnorm_xhat_mean *= inv_c;
        for (((dxi, &dyi), &xi), &w) in di.iter_mut().zip(dy).zip(x).zip(weight) {
            let xhat = (xi - mu) * s;
            *dxi += s * (dyi * w - dnorm_mean - xhat * dnorm_xhat_mean);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_normalizes_rows() {
        let inp = [1.0f64, 2.0, 3.0, 4.0, -2.0, 0.0, 2.0, 4.0]; // (2, 4)
        let (w, b) = ([1.0f64; 4], [0.5f64; 4]);
        let (mut out, mut mean, mut rstd) = ([0.0; 8], [0.0; 2], [0.0; 2]);
        layernorm_forward(&mut out, &mut mean, &mut rstd, &inp, &w, &b, 4);
        assert_eq!(mean, [2.5, 1.0]);
        for row in out.chunks(4) {
            let mu: f64 = row.iter().sum::<f64>() / 4.0;
            let var: f64 = row.iter().map(|o| (o - mu) * (o - mu)).sum::<f64>() / 4.0;
            // Mean is exactly the bias; variance is 1 shrunk by eps: var/(var+eps) with var >= 1.25.
            assert!((mu - 0.5).abs() < 1e-15);
            assert!((var - 1.0).abs() < 1e-5);
        }
    }

    /// The one-pass backward (rows in order, every gradient in the same loop) that the split
    /// backward must equal bit for bit.
    #[allow(clippy::too_many_arguments)]
    fn one_pass_backward(
        dinp: &mut [f32],
        dw: &mut [f32],
        db: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        w: &[f32],
        mean: &[f32],
        rstd: &[f32],
        c: usize,
    ) {
        let inv_c = (1.0 / c as f64) as f32;
        for r in 0..mean.len() {
            let (dy, x, di) = (
                &dout[r * c..][..c],
                &inp[r * c..][..c],
                &mut dinp[r * c..][..c],
            );
            let (mu, s) = (mean[r], rstd[r]);
            let (mut dm, mut dxm) = (0f32, 0f32);
            for i in 0..c {
                dm += dy[i] * w[i];
                dxm += dy[i] * w[i] * (x[i] - mu) * s;
            }
            (dm, dxm) = (dm * inv_c, dxm * inv_c);
            for i in 0..c {
                let xhat = (x[i] - mu) * s;
                db[i] += dy[i];
                dw[i] += xhat * dy[i];
                di[i] += s * (dy[i] * w[i] - dm - xhat * dxm);
            }
        }
    }

    /// Rows and columns split across threads compute every element exactly as one pass does.
    #[test]
    fn threaded_equals_one_pass_bitwise() {
        let (n, c) = (203, 768); // enough work to split, uneven rows per thread
        let f = |i: usize, a: usize, m: usize| ((i * a) % m) as f32 * 0.03 - 1.0;
        let inp: Vec<f32> = (0..n * c).map(|i| f(i, 37, 101)).collect();
        let dout: Vec<f32> = (0..n * c).map(|i| f(i, 53, 97)).collect();
        let (w, b): (Vec<f32>, Vec<f32>) = (
            (0..c).map(|i| f(i, 7, 13)).collect(),
            (0..c).map(|i| f(i, 5, 11)).collect(),
        );
        let (mut out, mut mean, mut rstd) = (vec![0f32; n * c], vec![0f32; n], vec![0f32; n]);
        layernorm_forward(&mut out, &mut mean, &mut rstd, &inp, &w, &b, c);
        let (mut out1, mut mean1, mut rstd1) = (vec![0f32; n * c], vec![0f32; n], vec![0f32; n]);
        layernorm_forward_serial(&mut out1, &mut mean1, &mut rstd1, &inp, &w, &b, c);
        assert_eq!((&out, &mean, &rstd), (&out1, &mean1, &rstd1));
        let start = |k: usize| (0..k).map(|i| f(i, 3, 7)).collect::<Vec<f32>>();
        let (mut d1, mut dw1, mut db1) = (start(n * c), start(c), start(c));
        let (mut d2, mut dw2, mut db2) = (d1.clone(), dw1.clone(), db1.clone());
        layernorm_backward(
            &mut d1, &mut dw1, &mut db1, &dout, &inp, &w, &mean, &rstd, c,
        );
        one_pass_backward(
            &mut d2, &mut dw2, &mut db2, &dout, &inp, &w, &mean, &rstd, c,
        );
        assert_eq!((d1, dw1, db1), (d2, dw2, db2));
    }
}
