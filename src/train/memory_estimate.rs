//! The per-rank memory formula of each ZeRO stage, printed before step 0 and compared with the
//! measured peak resident set (`meshtrain train` JSONL `peak_rss_mb`, README table). It counts
//! what the one executor and its step hold (`device_whole.rs`, `device_zero.rs`,
//! `model::device_gpt::shards`); on the CPU arm device memory is host memory, so it is all
//! resident.
//!
//! Everything is fp32 (4 bytes per element). With `n` parameters on the rank (its TP/PP shard),
//! `s` of them in its data-parallel shard (≈ n / dp):
//!
//! | term        | ZeRO-0 | ZeRO-1 | ZeRO-2 | ZeRO-3 |
//! |-------------|--------|--------|--------|--------|
//! | parameters  | n      | n      | n      | s + gathered |
//! | gradients   | n      | n + s  | live + s | live + s |
//! | AdamW m, v  | 2n     | 2s     | 2s     | 2s     |
//! | staging     | n or bucket | pool + bucket + block | pool + bucket + block | pool + 2 buckets + block |
//!
//! (`pool` depends on where the reduction runs, see below.)
//!
//! - parameters: the model's f32 tensors are the master weights (the step updates a block at a
//!   time in its receive buffer, or at ZeRO-3 the model's parameter shards in place), so no
//!   stage keeps a second copy;
//! - *gathered* (ZeRO-3): the units one layer reads at once, all of them (the embedding `wte` +
//!   `wpe`, one block, or the head `lnf` + `wte`), the largest of these;
//! - *live* gradients (ZeRO-2/3 on a whole model, which frees each unit's gradients once they
//!   are reduced): the tied `wte` gradient (written by the head, final after the embedding) plus
//!   the largest other unit; a pipeline stage keeps all `n`;
//! - *pool* where the reduction runs on a communication thread (dp > 1; either reducer adds the
//!   blocks it receives into the step's gradient shard, keeping no shard of its own): on the
//!   CPU arm the [`MAX_STAGED`] largest buckets; on device memory (`MESHTRAIN_GPU_OVERLAP=on`) at
//!   most [`MAX_STAGED`] staging buffers of the largest bucket and block each; at ZeRO-0 either
//!   reducer keeps every bucket's staging (`n`), the reduction after the backward one bucket;
//! - *bucket* and *block*: the device step's staging (largest bucket) and receive buffer (largest
//!   block); ZeRO-3 gathers through one more bucket.
//! - a parameter-server worker (`parallel.dp_sync = "ps"`) keeps no AdamW moments: the servers
//!   hold them, so its AdamW term is 0.
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
    /// The model frees each unit's gradients once reduced (ZeRO-2/3 on a whole model).
    pub releases_grads: bool,
    /// The reduction runs on a host thread (the CPU arm with more than one data-parallel rank).
    pub host_reduce: bool,
    /// The reduction runs on a communication thread over device memory (a device arm with more
    /// than one data-parallel rank and `MESHTRAIN_GPU_OVERLAP` on).
    pub device_overlap: bool,
    /// Activation elements (all slots and scratch).
    pub activations: usize,
    /// The rank keeps AdamW's moments for its shard (false on a parameter-server worker: the
    /// servers keep them).
    pub adamw_state: bool,
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

impl MemoryEstimate {
    /// The formula of the module documentation.
    pub fn new(i: &MemoryInputs<'_>) -> Self {
        let (n, s) = (i.n as u64, i.shard as u64);
        let mut bucket_lens: Vec<usize> = i.buckets.iter().map(|b| b.len()).collect();
        bucket_lens.sort_unstable_by(|a, b| b.cmp(a));
        let largest_bucket = bucket_lens.first().copied().unwrap_or(0) as u64;
        let block = largest_bucket.div_ceil(i.dp.max(1) as u64);
        let pool = match (i.host_reduce, i.device_overlap) {
            (true, _) => bucket_lens.iter().take(MAX_STAGED).sum::<usize>() as u64,
            (false, true) => bucket_lens.len().min(MAX_STAGED) as u64 * (largest_bucket + block),
            (false, false) => 0,
        };
        let wte = i.wte.as_ref().map_or(0, |w| w.len()) as u64;
        let others = || i.units.iter().filter(|u| Some(*u) != i.wte.as_ref());
        let largest_other = others().map(|u| u.len()).max().unwrap_or(0) as u64;
        let live = if i.releases_grads { wte + largest_other } else { n };
        // ZeRO-3 materialises what one layer reads: wte + wpe, one block, or lnf + wte. The
        // first other unit after wte is wpe on a stage that embeds; lnf is the last unit.
        let (wpe, lnf) = (others().next().map_or(0, |u| u.len()) as u64, others().next_back().map_or(0, |u| u.len()) as u64);
        let gathered = (wte + wpe).max(largest_other).max(lnf + wte);
        let (params, grads, optimizer, staging) = match i.zero {
            0 => (n, n, 2 * n, if i.host_reduce || i.device_overlap { n } else { largest_bucket }),
            1 => (n, n + s, 2 * s, pool + largest_bucket + block),
            2 => (n, live + s, 2 * s, pool + largest_bucket + block),
            _ => (s + gathered, live + s, 2 * s, pool + 2 * largest_bucket + block),
        };
        MemoryEstimate {
            params: params * F32,
            grads: grads * F32,
            optimizer: if i.adamw_state { optimizer * F32 } else { 0 },
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

    fn inputs<'a>(zero: u8, buckets: &'a [Range<usize>], units: &'a [Range<usize>], host_reduce: bool) -> MemoryInputs<'a> {
        let releases_grads = zero >= 2;
        MemoryInputs { zero, n: 1000, shard: 250, dp: 4, buckets, units, wte: Some(0..400), releases_grads, host_reduce, device_overlap: false, activations: 10, adamw_state: true }
    }

    #[test]
    fn each_stage_follows_its_formula() {
        // wte 400, wpe 100, two blocks of 200, lnf 100.
        let units = [0..400, 400..500, 500..700, 700..900, 900..1000];
        let buckets: Vec<Range<usize>> = (0..10).map(|b| b * 100..(b + 1) * 100).collect();
        let e = |z, host| MemoryEstimate::new(&inputs(z, &buckets, &units, host));
        // ZeRO-0: host staging of every bucket, or one bucket on a device.
        assert_eq!(e(0, true), MemoryEstimate { params: 4000, grads: 4000, optimizer: 8000, staging: 4000, activations: 40 });
        assert_eq!(e(0, false).staging, 400);
        // ZeRO-1: no second copy of the weights, gradient shard 250; host: a pool of the 4
        // largest buckets (100 each); staging bucket 100 and block 25.
        assert_eq!(e(1, true), MemoryEstimate { params: 4000, grads: 5000, optimizer: 2000, staging: 2100, activations: 40 });
        assert_eq!(e(1, false).grads, 5000);
        assert_eq!(e(1, false).staging, 500);
        // Device memory reduced on a communication thread: every bucket's staging at ZeRO-0; at
        // ZeRO-1 no summed shard and a pool of 4 (bucket 100 + block 25) besides the step's
        // bucket and block.
        let dev = |z| MemoryEstimate::new(&MemoryInputs { device_overlap: true, ..inputs(z, &buckets, &units, false) });
        assert_eq!(dev(0).staging, 4000);
        assert_eq!((dev(1).grads, dev(1).staging), (5000, (4 * 125 + 125) * 4));
        // Live gradients: wte 400 + largest other unit 200.
        assert_eq!(e(2, false).grads, (600 + 250) * 4);
        // Gathered: lnf + wte = wte + wpe = 500 > a block; parameters s + 500.
        assert_eq!(e(3, false).params, (250 + 500) * 4);
        assert_eq!(e(3, false).staging, (200 + 25) * 4);
        assert_eq!(e(3, true).total(), e(3, true).params + e(3, true).grads + 2000 + (400 + 225) * 4 + 40);
        // A parameter-server worker keeps no AdamW state; nothing else changes.
        let worker = MemoryEstimate::new(&MemoryInputs { adamw_state: false, ..inputs(0, &buckets, &units, true) });
        assert_eq!(worker, MemoryEstimate { optimizer: 0, ..e(0, true) });
    }
}
