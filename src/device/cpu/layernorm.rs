//! LayerNorm over the channel dimension with learned weight and bias, eps = 1e-5.
//!
//! The forward saves the per-row mean and reciprocal standard deviation; the backward uses them
//! instead of recomputing. Rows are independent, so a row range can run on any worker.

use super::float::Float;

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
    let inv_c = F::from_f64(1.0 / c as f64);
    let rows = dinp
        .chunks_exact_mut(c)
        .zip(dout.chunks_exact(c))
        .zip(inp.chunks_exact(c));
    for (((di, dy), x), (&mu, &s)) in rows.zip(mean.iter().zip(rstd)) {
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
        let cols = di
            .iter_mut()
            .zip(dy)
            .zip(x)
            .zip(weight)
            .zip(dweight.iter_mut().zip(dbias.iter_mut()));
        for ((((dxi, &dyi), &xi), &w), (dw, db)) in cols {
            let xhat = (xi - mu) * s;
            *db += dyi;
            *dw += xhat * dyi;
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
}
