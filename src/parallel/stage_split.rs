//! How the transformer blocks are split into pipeline stages: balanced by estimated compute by
//! default, or given explicitly (`parallel.stage_layers`).
//!
//! A pipeline runs as fast as its slowest stage, and the last stage does more than its blocks: it
//! also runs the head (final LayerNorm, the tied `(B*T, C) x (C, Vp)` logits matmul and the
//! cross-entropy). In training FLOPs per token (forward + backward = 3x forward, as in
//! [`crate::metrics`]) a block costs `72 C^2 + 12 C T` and the head `6 C Vp`, so the head weighs
//! `Vp / (12 C + 2 T)` blocks: 0.05 at width 384 with a 256-token vocabulary, 4.5 for GPT-2 small.
//! The embedding (a row lookup and a position add, `O(C)` per token) is counted as free.
//!
//! The default split minimizes the largest stage cost, then the sum of squared stage costs (the
//! most even of the optimal splits), and among equal splits gives earlier stages the extra block,
//! so without a head cost it is the even split with the remainder on the first stages.
//!
//! Invariants: `stages` global stages in pipeline order (with `v` model chunks per rank, global
//! stage `c * p + r` is chunk `c` of rank `r`); each holds at least one block; together they
//! cover `0..n_layer` contiguously in order.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::model::GptConfig;

/// Cost of the head (final LayerNorm, logits, cross-entropy) in units of one block's training
/// FLOPs at sequence length `seq_len`: `Vp / (12 C + 2 T)`.
pub fn head_cost_in_blocks(model: &GptConfig, seq_len: usize) -> f64 {
    model.padded_vocab_size() as f64 / (12 * model.n_embd + 2 * seq_len) as f64
}

/// Checks explicit per-stage block counts: `stages` of them, each at least 1, summing to `n_layer`.
/// Errors name `parallel.stage_layers`.
pub fn check_counts(counts: &[usize], stages: usize, n_layer: usize) -> Result<()> {
    let key = "parallel.stage_layers";
    if counts.len() != stages {
        return Err(Error::config(
            key,
            format!(
                "{} counts for {stages} pipeline stages (parallel.pp x parallel.virtual_stages)",
                counts.len()
            ),
        ));
    }
    if let Some(s) = counts.iter().position(|&n| n == 0) {
        return Err(Error::config(key, format!("stage {s} holds no block; every stage needs at least one")));
    }
    let total: usize = counts.iter().sum();
    if total != n_layer {
        return Err(Error::config(
            key,
            format!("the counts {counts:?} sum to {total}, not model.n_layer {n_layer}"),
        ));
    }
    Ok(())
}

/// The block range of each of `stages` global stages of `model` at `seq_len`: `counts` if given
/// (checked by [`check_counts`]), else the cost-balanced split (see the module doc). Errors:
/// `Error::Config` naming `parallel.stage_layers`, or `parallel.pp` when there are more stages than
/// blocks.
pub fn stage_layers(
    model: &GptConfig,
    seq_len: usize,
    stages: usize,
    counts: &[usize],
) -> Result<Vec<Range<usize>>> {
    let n = model.n_layer;
    let counts = if counts.is_empty() {
        if stages == 0 || stages > n {
            return Err(Error::config(
                "parallel.pp",
                format!(
                    "{stages} pipeline stages (parallel.pp x parallel.virtual_stages) for model.n_layer \
                     {n} blocks"
                ),
            ));
        }
        balanced(n, stages, head_cost_in_blocks(model, seq_len))
    } else {
        check_counts(counts, stages, n)?;
        counts.to_vec()
    };
    let mut start = 0;
    Ok(counts
        .iter()
        .map(|&k| {
            start += k;
            start - k..start
        })
        .collect())
}

/// Block counts of the split of `n` unit-cost blocks into `k` stages (`1 <= k <= n`), the last also
/// paying `head`: the smallest largest stage cost, then the smallest sum of squared costs among
/// the splits reaching it, then the smallest last stages (ties resolved from the back).
fn balanced(n: usize, k: usize, head: f64) -> Vec<usize> {
    let cost = |part: usize, blocks: usize| blocks as f64 + if part + 1 == k { head } else { 0.0 };
    // Pass 1, min-max: worst[i][j] = the smallest largest cost splitting the first j blocks into i
    // parts. Pass 2: the smallest sum of squares with every part within that bound.
    let mut worst = vec![vec![f64::INFINITY; n + 1]; k + 1];
    worst[0][0] = 0.0;
    for i in 1..=k {
        for j in i..=n {
            for take in 1..=j - (i - 1) {
                let w = worst[i - 1][j - take].max(cost(i - 1, take));
                worst[i][j] = worst[i][j].min(w);
            }
        }
    }
    let limit = worst[k][n];
    // best[i][j]: (sum of squares, blocks of part i) of the best bounded split of j blocks into i.
    let mut best = vec![vec![None::<(f64, usize)>; n + 1]; k + 1];
    best[0][0] = Some((0.0, 0));
    for i in 1..=k {
        for j in i..=n {
            for take in 1..=j - (i - 1) {
                let c = cost(i - 1, take);
                let Some((sq, _)) = best[i - 1][j - take] else { continue };
                if c > limit {
                    continue;
                }
                // Strictly better only: among equal sums the smallest last part (seen first) stays.
                if best[i][j].is_none_or(|(s, _)| sq + c * c < s) {
                    best[i][j] = Some((sq + c * c, take));
                }
            }
        }
    }
    let mut counts = vec![0; k];
    let mut j = n;
    for i in (1..=k).rev() {
        let (_, take) = best[i][j].expect("the min-max split is within its own bound");
        counts[i - 1] = take;
        j -= take;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::block_range;

    fn model(n_layer: usize, n_embd: usize, vocab_size: usize) -> GptConfig {
        GptConfig { n_layer, n_head: 4, n_embd, vocab_size, max_seq_len: 1024, llama: None }
    }

    /// Without a head the split is `block_range`'s: even, remainder on the first stages.
    #[test]
    fn no_head_cost_gives_the_even_split() {
        for n in 1..=13 {
            for k in 1..=n {
                let want: Vec<usize> = (0..k).map(|i| block_range(n, k, i).len()).collect();
                assert_eq!(balanced(n, k, 0.0), want, "n {n} k {k}");
            }
        }
    }

    #[test]
    fn a_heavy_head_moves_blocks_off_the_last_stage() {
        // 4, 4, 3 + 1.5 is the only split of 11 blocks with every stage within 4.5.
        assert_eq!(balanced(11, 3, 1.5), vec![4, 4, 3]);
        // 12 blocks, head 1: the bound is 5, reached by 4, 4, 4 + 1 and 5, 4, 3 + 1 (squares 57)
        // and by 5, 5, 2 + 1 (59); the flattest win, the smaller last stage among them.
        assert_eq!(balanced(12, 3, 1.0), vec![5, 4, 3]);
        // GPT-2 small on 4 stages: the head (~4.5 blocks) leaves the last stage one block.
        let d12 = model(12, 768, 50257);
        let head = head_cost_in_blocks(&d12, 1024);
        assert!((head - 50304.0 / (12.0 * 768.0 + 2048.0)).abs() < 1e-12 && head > 4.0);
        let ranges = stage_layers(&d12, 1024, 4, &[]).unwrap();
        assert_eq!(ranges, vec![0..4, 4..8, 8..11, 11..12]);
        // A light head (width 384, vocabulary 256: 0.05 blocks) changes nothing.
        assert_eq!(stage_layers(&model(4, 384, 256), 64, 2, &[]).unwrap(), vec![0..2, 2..4]);
        // 5 blocks, head 0.6: 3, 2 + 0.6 (max 3) beats 2, 3 + 0.6 (max 3.6).
        assert_eq!(balanced(5, 2, 0.6), vec![3, 2]);
        // 7 blocks on 3 stages, head 3: the bound is 4, reached by 3, 3, 1 + 3 (squares 34) and
        // 4, 2, 1 + 3 (36).
        assert_eq!(balanced(7, 3, 3.0), vec![3, 3, 1]);
    }

    #[test]
    fn explicit_counts_are_used_and_checked() {
        let m = model(8, 64, 256);
        assert_eq!(stage_layers(&m, 32, 3, &[3, 4, 1]).unwrap(), vec![0..3, 3..7, 7..8]);
        for bad in [&[4, 4][..], &[3, 3, 3], &[4, 4, 0]] {
            let e = stage_layers(&m, 32, 3, bad).unwrap_err();
            assert!(e.to_string().contains("parallel.stage_layers"), "{bad:?}: {e}");
        }
        let e = stage_layers(&m, 32, 9, &[]).unwrap_err();
        assert!(e.to_string().contains("parallel.pp"), "{e}");
    }
}
