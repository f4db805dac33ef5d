//! The vocabulary-parallel ends of the model: embedding lookup and cross-entropy over one shard of
//! `wte`'s rows, so that no rank ever holds all Vp logits of a position.
//!
//! A shard covers vocabulary ids `start .. start + Vl`; of its columns only the first `real`
//! (those below V) are real, the rest are padding and get neither probability nor gradient.
//! Combining shards is the caller's job (one TP collective each):
//! - embedding: rows of tokens outside the shard are zero, so the SUM over shards is exactly
//!   `wte[token]` (adding zeros is exact); positions are added afterwards by [`position_forward`];
//! - cross-entropy: the global row max is the MAX of [`shard_max`]; the sum of `exp(z - max)` and
//!   the target's logit are SUMS of [`shard_sum_exp`]'s outputs (the target lives in exactly one
//!   shard); then `lse = max + ln(sum)` and `loss = lse - z_target` as in `cross_entropy.rs`.
//!
//! With one shard every function performs the arithmetic of `encoder.rs` / `cross_entropy.rs` in
//! the same order, so a one-rank stage reproduces [`super::Gpt`] bitwise.

use super::exp::{max_of, sum_exp};
use super::float::Float;
use super::parallel::{chunk_items, run_parts};
use super::simd;

/// Columns of a shard of `vl` ids starting at `start` that are real ids (below `v`).
pub fn real_columns(start: usize, vl: usize, v: usize) -> usize {
    v.saturating_sub(start).min(vl)
}

/// out (N, C) = wte_shard (Vl, C) row `token - start` for tokens (N) in the shard, else zeros.
pub fn embedding_shard_forward<F: Float>(
    out: &mut [F],
    tokens: &[u32],
    wte: &[F],
    start: usize,
    c: usize,
) {
    let vl = wte.len() / c;
    for (row, &tok) in out.chunks_exact_mut(c).zip(tokens) {
        match (tok as usize).checked_sub(start).filter(|&i| i < vl) {
            Some(i) => row.copy_from_slice(&wte[i * c..][..c]),
            None => row.iter_mut().for_each(|x| *x = F::zero()),
        }
    }
}

/// dwte_shard (Vl, C) += rows of dout (N, C) whose tokens (N) lie in the shard.
pub fn embedding_shard_backward<F: Float>(
    dwte: &mut [F],
    dout: &[F],
    tokens: &[u32],
    start: usize,
    c: usize,
) {
    let vl = dwte.len() / c;
    for (drow, &tok) in dout.chunks_exact(c).zip(tokens) {
        if let Some(i) = (tok as usize).checked_sub(start).filter(|&i| i < vl) {
            for (g, &d) in dwte[i * c..][..c].iter_mut().zip(drow) {
                *g += d;
            }
        }
    }
}

/// out (R, C) += wpe (maxT, C) rows of positions `(first_row + i) % t` (rows of the flat (B*T)).
pub fn position_forward<F: Float>(out: &mut [F], wpe: &[F], first_row: usize, t: usize, c: usize) {
    for (i, row) in out.chunks_exact_mut(c).enumerate() {
        let p = &wpe[(first_row + i) % t * c..][..c]; // (C)
        for (o, &pi) in row.iter_mut().zip(p) {
            *o += pi;
        }
    }
}

/// dwpe (maxT, C) += dout (R, C) rows at their positions (as in [`position_forward`]).
pub fn position_backward<F: Float>(
    dwpe: &mut [F],
    dout: &[F],
    first_row: usize,
    t: usize,
    c: usize,
) {
    for (i, drow) in dout.chunks_exact(c).enumerate() {
        let pos = (first_row + i) % t;
        for (g, &d) in dwpe[pos * c..][..c].iter_mut().zip(drow) {
            *g += d;
        }
    }
}

/// max (N) = maximum of each logits (N, Vl) row over its first `real` columns (-inf if none).
pub fn shard_max<F: Float>(max: &mut [F], logits: &[F], real: usize) {
    let vl = logits.len() / max.len().max(1);
    for (m, row) in max.iter_mut().zip(logits.chunks_exact(vl)) {
        *m = max_of(&row[..real]);
    }
}

/// sum (N) = Σ exp(z - max) over the real columns; target_logit (N) = z of the target when it is
/// in the shard, else 0. Logits (N, Vl), targets (N), global row max (N).
pub fn shard_sum_exp<F: Float>(
    sum: &mut [F],
    target_logit: &mut [F],
    logits: &[F],
    max: &[F],
    targets: &[u32],
    start: usize,
    real: usize,
) {
    let n = sum.len();
    let vl = logits.len() / n.max(1);
    let per = chunk_items(n, vl);
    let outs = sum.chunks_mut(per).zip(target_logit.chunks_mut(per));
    let ins = logits
        .chunks(per * vl)
        .zip(max.chunks(per))
        .zip(targets.chunks(per));
    run_parts(outs.zip(ins), |((s, zt), ((z, m), tg))| {
        let rows = z.chunks_exact(vl).zip(m).zip(tg);
        for ((s, zt), ((row, &m), &target)) in s.iter_mut().zip(zt).zip(rows) {
            *s = sum_exp(&row[..real], m);
            *zt = match (target as usize).checked_sub(start).filter(|&i| i < real) {
                Some(i) => row[i],
                None => F::zero(),
            };
        }
    });
}

/// lse (N) = max + ln(sum) and losses (N) = lse - target logit, from the group's row max (N) and
/// the group sums `stats` (2N: [`shard_sum_exp`]'s sum, then its target logit).
pub fn combine_shards<F: Float>(losses: &mut [F], lse: &mut [F], max: &[F], stats: &[F]) {
    let (sum, target_logit) = stats.split_at(max.len());
    for (i, (loss, l)) in losses.iter_mut().zip(lse.iter_mut()).enumerate() {
        *l = max[i] + sum[i].ln();
        *loss = *l - target_logit[i];
    }
}

/// dlogits (N, Vl) = (softmax - onehot(targets)) * dloss on the real columns, 0 on the padded
/// ones: written, never read, so the caller clears nothing first (the logit gradient is the
/// largest activation buffer of the step). `lse` (N) is the global log-sum-exp of each row.
pub fn cross_entropy_shard_backward<F: Float>(
    dlogits: &mut [F],
    logits: &[F],
    lse: &[F],
    targets: &[u32],
    dloss: F,
    start: usize,
    real: usize,
) {
    let n = lse.len();
    let vl = logits.len() / n.max(1);
    let per = chunk_items(n, vl);
    let ins = logits
        .chunks(per * vl)
        .zip(lse.chunks(per))
        .zip(targets.chunks(per));
    run_parts(
        dlogits.chunks_mut(per * vl).zip(ins),
        |(d, ((z, l), tg))| {
            simd::widest(
                #[inline(always)]
                || {
                    let rows = d.chunks_exact_mut(vl).zip(z.chunks_exact(vl));
                    for ((drow, row), (&l, &target)) in rows.zip(l.iter().zip(tg)) {
                        let (dreal, padding) = drow.split_at_mut(real);
                        for (d, &z) in dreal.iter_mut().zip(&row[..real]) {
                            *d = (z - l).fast_exp() * dloss;
                        }
                        padding.fill(F::zero());
                        if let Some(i) = (target as usize).checked_sub(start).filter(|&i| i < real) {
                            drow[i] -= dloss;
                        }
                    }
                },
            )
        },
    );
}

#[cfg(test)]
mod tests {
    use super::super::cross_entropy::{cross_entropy_backward, cross_entropy_forward};
    use super::*;

    /// Two shards of a (2, 8) logit matrix with V = 6 (columns 6, 7 padded, one shard all real,
    /// the other half padding) combine to the one-shard loss and gradient.
    #[test]
    fn two_shards_combine_to_the_full_cross_entropy() {
        let (n, v, vp) = (2, 6, 8);
        let logits: Vec<f64> = (0..n * vp)
            .map(|i| ((i * 7) % 5) as f64 * 0.3 - 0.4)
            .collect();
        let targets = [5u32, 1];
        let (mut loss, mut lse) = (vec![0.0; n], vec![0.0; n]);
        cross_entropy_forward(&mut loss, &mut lse, &logits, &targets, v, vp);
        let mut dfull = vec![0.0; n * vp];
        cross_entropy_backward(&mut dfull, &logits, &lse, &targets, 0.5, v, vp);
        let shard = |s: usize| -> Vec<f64> {
            logits
                .chunks(vp)
                .flat_map(|r| r[s * 4..s * 4 + 4].to_vec())
                .collect()
        };
        let (mut m, mut sum, mut zt) = (vec![f64::NEG_INFINITY; n], vec![0.0; n], vec![0.0; n]);
        for s in 0..2 {
            let mut ms = vec![0.0; n];
            shard_max(&mut ms, &shard(s), real_columns(s * 4, 4, v));
            m.iter_mut()
                .zip(&ms)
                .for_each(|(a, &b)| *a = f64::max(*a, b));
        }
        for s in 0..2 {
            let (mut ss, mut zs) = (vec![0.0; n], vec![0.0; n]);
            shard_sum_exp(
                &mut ss,
                &mut zs,
                &shard(s),
                &m,
                &targets,
                s * 4,
                real_columns(s * 4, 4, v),
            );
            (0..n).for_each(|i| (sum[i] += ss[i], zt[i] += zs[i]).1);
        }
        for i in 0..n {
            let l = m[i] + sum[i].ln();
            assert!((l - lse[i]).abs() < 1e-14 && (l - zt[i] - loss[i]).abs() < 1e-14);
        }
        for s in 0..2 {
            let mut d = vec![0.0; n * 4];
            cross_entropy_shard_backward(
                &mut d,
                &shard(s),
                &lse,
                &targets,
                0.5,
                s * 4,
                real_columns(s * 4, 4, v),
            );
            let want: Vec<f64> = dfull
                .chunks(vp)
                .flat_map(|r| r[s * 4..s * 4 + 4].to_vec())
                .collect();
            assert!(
                d.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-15),
                "{d:?} vs {want:?}"
            );
        }
    }

    #[test]
    fn embedding_shards_sum_to_the_lookup() {
        let c = 2;
        let wte: Vec<f32> = (0..4 * c).map(|i| i as f32 + 1.0).collect(); // (4, C)
        let tokens = [3u32, 0, 2];
        let mut sum = vec![0f32; 3 * c];
        for s in 0..2 {
            let mut out = vec![9f32; 3 * c];
            embedding_shard_forward(
                &mut out,
                &tokens,
                &wte[s * 2 * c..(s + 1) * 2 * c],
                s * 2,
                c,
            );
            sum.iter_mut().zip(&out).for_each(|(a, b)| *a += b);
        }
        assert_eq!(sum, [7.0, 8.0, 1.0, 2.0, 5.0, 6.0]);
        let mut dwte = vec![0f32; 2 * c]; // shard 1: ids 2, 3
        embedding_shard_backward(&mut dwte, &[1.0, 1.0, 5.0, 5.0, 2.0, 3.0], &tokens, 2, c);
        assert_eq!(dwte, [2.0, 3.0, 1.0, 1.0]);
    }
}
