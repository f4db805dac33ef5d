//! The per-rank memory formula of each ZeRO stage, printed before step 0 and compared with the
//! measured peak resident set (`meshtrain train` JSONL `peak_rss_mb`, README table).
//!
//! Everything is fp32 (4 bytes per element). With `n` parameters on the rank (its TP/PP shard),
//! `s` of them in its data-parallel shard (≈ n / dp):
//!
//! | term        | ZeRO-0 | ZeRO-1 | ZeRO-2 | ZeRO-3 |
//! |-------------|--------|--------|--------|--------|
//! | parameters  | n      | n      | n      | s + gathered units |
//! | gradients   | n      | n + s  | live + s | live + s |
//! | AdamW m, v  | 2n     | 2s     | 2s     | 2s     |
//! | staging     | n      | pool   | pool   | pool   |
//!
//! - *gathered units* (ZeRO-3): the non-owned part (1 - 1/dp) of the unit group being computed
//!   plus the next group's prefetch buffers (whole buckets), or, once the next group is acquired
//!   (the current one released first), its non-owned part plus one bucket still being copied in;
//!   the largest of these over the executor's passes;
//! - *live* gradients (ZeRO-2/3): gradients written but not yet reported final; in our executor the
//!   tied `wte` gradient (written by the head, final after the embedding) plus the largest other
//!   unit;
//! - *pool*: the [`MAX_STAGED`] largest gradient buckets (staging buffers filling or in flight).
//!
//! plus the activations and the runtime baseline (binary, libraries, communication buffers), which
//! is measured, not modelled.

use std::ops::Range;

use super::buckets::MAX_STAGED;

/// Bytes per element (fp32 parameters, gradients and optimizer state).
const F32: u64 = 4;

/// What the formula needs to know about the rank's layout.
pub struct MemoryInputs<'a> {
    /// ZeRO stage.
    pub zero: u8,
    /// Parameters on this rank.
    pub n: usize,
    /// Elements of this rank's data-parallel shard (its optimizer state covers them).
    pub shard: usize,
    /// Data-parallel group size.
    pub dp: usize,
    /// Gradient buckets.
    pub buckets: &'a [Range<usize>],
    /// Parameter units (partition of the flat buffer).
    pub units: &'a [Range<usize>],
    /// The tied `wte` unit, if this rank holds it.
    pub wte: Option<Range<usize>>,
    /// Unit groups the executor acquires, per pass (forward, backward), in order (ZeRO-3).
    pub passes: &'a [Vec<Vec<Range<usize>>>],
    /// Activation elements (all slots and scratch).
    pub activations: usize,
}

/// Estimated resident bytes of one rank, by term.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Parameters resident (all, or the shard plus gathered units).
    pub params: u64,
    /// Gradients resident (model buffer plus reduced shard).
    pub grads: u64,
    /// AdamW first and second moments.
    pub optimizer: u64,
    /// Gradient staging buffers of the reducer.
    pub staging: u64,
    /// Activations and scratch.
    pub activations: u64,
}

fn group_len(g: &[Range<usize>]) -> usize {
    g.iter().map(|r| r.len()).sum()
}

/// Elements of the union of two unit groups.
fn union_len(a: &[Range<usize>], b: &[Range<usize>]) -> usize {
    group_len(a) + b.iter().filter(|r| !a.contains(r)).map(|r| r.len()).sum::<usize>()
}

impl MemoryEstimate {
    /// The formula of the module documentation.
    pub fn new(i: &MemoryInputs<'_>) -> Self {
        let (n, s) = (i.n as u64, i.shard as u64);
        let mut bucket_lens: Vec<usize> = i.buckets.iter().map(|b| b.len()).collect();
        bucket_lens.sort_unstable_by(|a, b| b.cmp(a));
        let pool = bucket_lens.iter().take(MAX_STAGED).sum::<usize>() as u64;
        let largest_other = i.units.iter().filter(|u| Some(*u) != i.wte.as_ref()).map(|u| u.len()).max();
        let live = (i.wte.as_ref().map_or(0, |w| w.len()) + largest_other.unwrap_or(0)) as u64;
        let others = 1.0 - 1.0 / i.dp.max(1) as f64;
        let largest_bucket = bucket_lens.first().copied().unwrap_or(0) as f64;
        let transition = |cur: &[Range<usize>], next: &[Range<usize>]| {
            let computing = others * group_len(cur) as f64 + (union_len(cur, next) - group_len(cur)) as f64;
            let arriving = others * group_len(next) as f64 + largest_bucket;
            computing.max(arriving)
        };
        let gathered = i
            .passes
            .iter()
            .flat_map(|p| p.windows(2).map(|w| transition(&w[0], &w[1])).chain(p.last().map(|g| transition(g, &[]))))
            .fold(0.0, f64::max)
            .ceil() as u64;
        let (params, grads, optimizer, staging) = match i.zero {
            0 => (n, n, 2 * n, n),
            1 => (n, n + s, 2 * s, pool),
            2 => (n, live + s, 2 * s, pool),
            _ => (s + gathered, live + s, 2 * s, pool),
        };
        MemoryEstimate {
            params: params * F32,
            grads: grads * F32,
            optimizer: optimizer * F32,
            staging: staging * F32,
            activations: i.activations as u64 * F32,
        }
    }

    /// Sum of the terms (without the runtime baseline).
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer + self.staging + self.activations
    }

    /// One line for the log, in MB.
    pub fn describe(&self) -> String {
        let mb = |b: u64| b as f64 / 1e6;
        format!(
            "params {:.1} MB, grads {:.1} MB, AdamW {:.1} MB, staging {:.1} MB, activations {:.1} MB = {:.1} MB",
            mb(self.params),
            mb(self.grads),
            mb(self.optimizer),
            mb(self.staging),
            mb(self.activations),
            mb(self.total())
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs<'a>(zero: u8, buckets: &'a [Range<usize>], units: &'a [Range<usize>], passes: &'a [Vec<Vec<Range<usize>>>]) -> MemoryInputs<'a> {
        MemoryInputs { zero, n: 1000, shard: 250, dp: 4, buckets, units, wte: Some(0..400), passes, activations: 10 }
    }

    #[test]
    fn each_stage_follows_its_formula() {
        let units = [0..400, 400..700, 700..1000];
        let buckets: Vec<Range<usize>> = (0..10).map(|b| b * 100..(b + 1) * 100).collect();
        let fwd = vec![vec![0..400], vec![400..700], vec![700..1000]];
        let bwd = vec![vec![700..1000, 0..400], vec![400..700]];
        let passes = [fwd, bwd];
        let e = |z| MemoryEstimate::new(&inputs(z, &buckets, &units, &passes));
        assert_eq!(e(0), MemoryEstimate { params: 4000, grads: 4000, optimizer: 8000, staging: 4000, activations: 40 });
        // Pool: the 4 largest buckets (100 elements each).
        assert_eq!(e(1), MemoryEstimate { params: 4000, grads: 5000, optimizer: 2000, staging: 1600, activations: 40 });
        // Live gradients: wte 400 + largest other unit 300.
        assert_eq!(e(2).grads, (700 + 250) * 4);
        // Gathered: computing the backward's head group (3/4 of 700) while the next block's 300
        // arrive = 825; larger than any arrival (3/4 of a group + a 100-element bucket).
        assert_eq!(e(3).params, (250 + 825) * 4);
        assert_eq!(e(3).total(), e(3).params + e(3).grads + 2000 + 1600 + 40);
    }
}
