//! Softmax cross-entropy over the real vocabulary, fused with the softmax.
//!
//! Logit rows are `Vp` wide (padded vocabulary); only the first `V` columns take part in the
//! softmax, so padded columns get no probability mass and a zero gradient. The forward keeps only
//! the per-row log-sum-exp (N), not the probabilities: the backward recomputes
//! `p = exp(logit - lse)`, which saves a (N, Vp) buffer. A vocab-parallel version would combine
//! per-shard maxima and sums into the same `lse`. Rows are split across cores.

use super::exp::{max_of, sum_exp};
use super::float::Float;
use super::parallel::{chunk_items, run_parts};
use super::simd;

/// losses (N) and lse (N) from logits (N, Vp) and targets (N); softmax over columns `0..v`.
pub fn cross_entropy_forward<F: Float>(
    losses: &mut [F],
    lse: &mut [F],
    logits: &[F],
    targets: &[u32],
    v: usize,
    vp: usize,
) {
    let per = chunk_items(losses.len(), vp);
    let outs = losses.chunks_mut(per).zip(lse.chunks_mut(per));
    let ins = logits.chunks(per * vp).zip(targets.chunks(per));
    run_parts(outs.zip(ins), |((lo, ls), (z, tg))| {
        cross_entropy_forward_serial(lo, ls, z, tg, v, vp)
    });
}

fn cross_entropy_forward_serial<F: Float>(
    losses: &mut [F],
    lse: &mut [F],
    logits: &[F],
    targets: &[u32],
    v: usize,
    vp: usize,
) {
    let rows = logits.chunks_exact(vp).zip(targets);
    for ((loss, l), (row, &target)) in losses.iter_mut().zip(lse.iter_mut()).zip(rows) {
        let real = &row[..v]; // (V)
        let max = max_of(real);
        let sum = sum_exp(real, max);
        *l = max + sum.ln();
        *loss = *l - row[target as usize];
    }
}

/// dlogits (N, Vp) += (softmax(logits) - onehot(targets)) * dloss; padded columns untouched.
pub fn cross_entropy_backward<F: Float>(
    dlogits: &mut [F],
    logits: &[F],
    lse: &[F],
    targets: &[u32],
    dloss: F,
    v: usize,
    vp: usize,
) {
    let per = chunk_items(lse.len(), vp);
    let ins = logits
        .chunks(per * vp)
        .zip(lse.chunks(per))
        .zip(targets.chunks(per));
    run_parts(dlogits.chunks_mut(per * vp).zip(ins), |(d, ((z, l), tg))| {
        cross_entropy_backward_serial(d, z, l, tg, dloss, v, vp)
    });
}

fn cross_entropy_backward_serial<F: Float>(
    dlogits: &mut [F],
    logits: &[F],
    lse: &[F],
    targets: &[u32],
    dloss: F,
    v: usize,
    vp: usize,
) {
    simd::widest(
        #[inline(always)]
        || {
            let rows = dlogits.chunks_exact_mut(vp).zip(logits.chunks_exact(vp));
            for ((drow, row), (&l, &target)) in rows.zip(lse.iter().zip(targets)) {
                for (d, &z) in drow[..v].iter_mut().zip(&row[..v]) {
                    *d += (z - l).fast_exp() * dloss;
                }
                drow[target as usize] -= dloss;
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_logits_give_log_v_and_ignore_padding() {
        let (v, vp) = (4, 6);
        // Padded columns hold a huge logit that must not change anything.
        let logits = [0.0f64, 0.0, 0.0, 0.0, 1e3, 1e3]; // (1, Vp)
        let (mut loss, mut lse) = ([0.0], [0.0]);
        cross_entropy_forward(&mut loss, &mut lse, &logits, &[2], v, vp);
        assert!((loss[0] - 4f64.ln()).abs() < 1e-15);
        let mut d = [0.0; 6];
        cross_entropy_backward(&mut d, &logits, &lse, &[2], 1.0, v, vp);
        let want = [0.25, 0.25, -0.75, 0.25, 0.0, 0.0];
        assert!(d.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-15), "{d:?}");
    }

    /// Splitting rows across threads computes every element exactly as one thread does.
    #[test]
    fn threaded_equals_serial_bitwise() {
        let (n, v, vp) = (67, 1000, 1024); // enough work to split, uneven rows per thread
        let logits: Vec<f32> = (0..n * vp)
            .map(|i| ((i * 37) % 101) as f32 * 0.05 - 2.0)
            .collect();
        let targets: Vec<u32> = (0..n as u32).map(|i| i * 13 % v as u32).collect();
        let (mut l1, mut s1, mut l2, mut s2) = (vec![0f32; n], vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        cross_entropy_forward(&mut l1, &mut s1, &logits, &targets, v, vp);
        cross_entropy_forward_serial(&mut l2, &mut s2, &logits, &targets, v, vp);
        assert_eq!((&l1, &s1), (&l2, &s2));
        let (mut d1, mut d2) = (vec![0f32; n * vp], vec![0f32; n * vp]);
        cross_entropy_backward(&mut d1, &logits, &s1, &targets, 0.5, v, vp);
        cross_entropy_backward_serial(&mut d2, &logits, &s1, &targets, 0.5, v, vp);
        assert_eq!(d1, d2);
    }
}
