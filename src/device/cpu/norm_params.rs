//! The parameter gradients of the norm layers, LayerNorm's and RMSNorm's alike: column sums over
//! the rows of `xhat * dout` (the weight gradient) and, for LayerNorm, of `dout` (the bias
//! gradient), with `xhat = (inp - mean) * rstd` (LayerNorm) or `inp * rstd` (RMSNorm).
//!
//! One function serves both so the two layers cannot drift apart; it is the CPU arm of the one
//! kernel `norm_backward_dparams_f32` (kernels/layernorm.cu). Invariants: every column adds its
//! rows in row order, and the columns are split across the cores, so every element is computed
//! exactly as on one thread (bitwise independent of the thread count). RMSNorm's `xhat` is
//! computed as `(inp - 0) * rstd`: subtracting +0 returns every float unchanged (-0 included),
//! so its bits are those of `inp * rstd`.

use super::float::Float;
use super::parallel::{chunk_items, run_parts};

/// What the parameter gradients read: dout and inp (rows of `c`), the forward's per-row mean
/// (LayerNorm; None for RMSNorm) and rstd.
pub struct NormRows<'a, F> {
    /// Output gradient (N, C).
    pub dout: &'a [F],
    /// The forward's input (N, C).
    pub inp: &'a [F],
    /// Per-row mean (N), LayerNorm only.
    pub mean: Option<&'a [F]>,
    /// Per-row reciprocal standard deviation (N).
    pub rstd: &'a [F],
    /// Channels per row.
    pub c: usize,
}

/// dweight (C) += Σ_rows xhat * dout and, if given, dbias (C) += Σ_rows dout, the columns split
/// across the cores.
pub fn norm_dparams<F: Float>(dweight: &mut [F], dbias: Option<&mut [F]>, rows: &NormRows<F>) {
    let per_col = chunk_items(rows.c, rows.rstd.len()).max(1);
    let dws = dweight.chunks_mut(per_col).enumerate();
    match dbias {
        Some(db) => run_parts(dws.zip(db.chunks_mut(per_col)), |((i, dw), db)| {
            dparams_columns(dw, Some(db), i * per_col, rows)
        }),
        None => run_parts(dws, |(i, dw)| dparams_columns(dw, None, i * per_col, rows)),
    }
}

/// [`norm_dparams`] on one thread for the columns `first..` that `dweight` (and `dbias`) hold.
pub(crate) fn dparams_columns<F: Float>(
    dweight: &mut [F],
    mut dbias: Option<&mut [F]>,
    first: usize,
    rows: &NormRows<F>,
) {
    let c = rows.c;
    let each = rows
        .dout
        .chunks_exact(c)
        .zip(rows.inp.chunks_exact(c))
        .zip(rows.rstd);
    for (r, ((dy, x), &s)) in each.enumerate() {
        let mu = rows.mean.map_or(F::zero(), |m| m[r]);
        let (dy, x) = (&dy[first..], &x[first..]);
        for (dw, (&dyi, &xi)) in dweight.iter_mut().zip(dy.iter().zip(x)) {
            *dw += (xi - mu) * s * dyi;
        }
        if let Some(db) = dbias.as_deref_mut() {
            db.iter_mut().zip(dy).for_each(|(b, &dyi)| *b += dyi);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a mean the weight gradient is bit for bit Σ inp * rstd * dout in row order, signed
    /// zeros, subnormals and infinities included (subtracting +0 changes no float).
    #[test]
    fn rmsnorm_columns_are_inp_times_rstd_times_dout_bitwise() {
        let odd = [
            -0.0f32,
            0.0,
            1e-40,
            -1e-40,
            f32::MAX,
            -3.5,
            7.25e-3,
            f32::INFINITY,
        ];
        let (n, c) = (5, odd.len());
        let inp: Vec<f32> = (0..n * c)
            .map(|i| odd[(i * 3) % c] * if i % 2 == 0 { 1.0 } else { -0.5 })
            .collect();
        let dout: Vec<f32> = (0..n * c).map(|i| odd[(i * 5 + 1) % c] * 0.75).collect();
        let rstd = [1.0f32, -0.0, 2.5, 1e-30, 0.125];
        let mut got = vec![-0.0f32; c];
        norm_dparams(
            &mut got,
            None,
            &NormRows {
                dout: &dout,
                inp: &inp,
                mean: None,
                rstd: &rstd,
                c,
            },
        );
        let mut want = vec![-0.0f32; c];
        for r in 0..n {
            for i in 0..c {
                want[i] += inp[r * c + i] * rstd[r] * dout[r * c + i];
            }
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want));
    }
}
