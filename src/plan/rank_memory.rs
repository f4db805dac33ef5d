//! Bytes one rank holds under a layout: the largest of the first pipeline rank (the most
//! micro-batches in flight, the embedding) and the last (the head and its logits).
//!
//! meshtrain: the parameter, gradient, AdamW and staging terms are [`MemoryEstimate`] itself (the
//! formula `meshtrain train` prints before step 0 and the README compares with measured peak RSS),
//! fed with the rank's parameter count, a synthetic unit list (`wte`, GPT-2's `wpe`, one block,
//! the final unit: GPT-2's LayerNorm, Llama's RMSNorm and untied `lm_head`; the formula only reads
//! the largest units and the tied embedding's; an untied `wte` is an ordinary unit) and the largest
//! gradient buckets; the activations are the executor's own counts (`model::ActDims`: one slot per
//! micro-batch in flight and chunk, the shared scratch, Llama's RoPE tables, q/k/v staging and
//! shared-KV gradient sums) plus the GEMM operands' bf16 staging and at bf16 the weights' bf16
//! copies are added. Everything is fp32 except those copies.
//!
//! Megatron-LM (the stack of the published runs): 18 bytes per parameter (bf16 weights, fp32 main
//! gradients, fp32 master weights and two moments; the distributed optimizer at ZeRO >= 1 shards
//! the last 12 over the data-parallel group, ZeRO 2 the gradients too, ZeRO 3 the weights) and the
//! activations per block and micro-batch of Korthikanti et al. 2022 (`s b h (34 + 5 a s / h)` bytes
//! without parallelism, divided by TP where it splits them: `10 + 24/t` without and `34/t` with
//! sequence parallelism; selective recomputation drops the `5 a s / h` attention-core term, full
//! recomputation keeps only the block input, `2 s b h`), plus the logits. A Llama block saves `8`
//! (no dropout masks), `(2 (h + 2 NKV hd) + 2 h + 6 F) / h` and `2 a s / h` in those places
//! (`megatron_block_bytes`).

use std::ops::Range;

use super::{Job, Layout, Recompute, Stack};
use crate::model::{ActDims, GptConfig};
use crate::train::{MemoryEstimate, MemoryInputs};

/// Micro-batches of one chunk whose activations a pipeline rank holds at once (its forwards not
/// yet matched by backwards): `p - rank` under 1F1B, the interleaved schedule's warm-up + 1
/// spread over the chunks (the schedule module's counts), at most `m`.
pub fn in_flight(layout: &Layout, rank: usize) -> usize {
    let (p, v, m) = (layout.pp, layout.virtual_stages, layout.grad_accum);
    if p == 1 {
        return 1;
    }
    if v == 1 {
        return (p - rank).min(m);
    }
    let warmup = (2 * (p - rank - 1) + (v - 1) * p).min(m * v);
    (warmup + 1).div_ceil(v).min(m)
}

/// Bytes of one rank, by term.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct RankMemory {
    /// Parameters (and their bf16 copies).
    pub params: f64,
    /// Gradients.
    pub grads: f64,
    /// Optimizer state (meshtrain: AdamW moments; Megatron: master weights and moments).
    pub optimizer: f64,
    /// Reduction staging buffers.
    pub staging: f64,
    /// Activations and scratch.
    pub activations: f64,
}

impl RankMemory {
    /// All terms.
    pub fn total(&self) -> f64 {
        self.params + self.grads + self.optimizer + self.staging + self.activations
    }
}

/// What one pipeline rank holds of the model.
#[derive(Debug, Clone, Copy)]
pub struct RankShare {
    /// Blocks over all its chunks.
    pub blocks: usize,
    /// Holds the embedding (first rank).
    pub embeds: bool,
    /// Holds the head (last rank).
    pub ends: bool,
    /// Its pipeline rank.
    pub rank: usize,
}

impl RankShare {
    /// Pipeline rank `rank`'s share when global stage `s` holds `stage_blocks[s]` blocks.
    pub fn of(layout: &Layout, stage_blocks: &[usize], rank: usize) -> RankShare {
        let p = layout.pp;
        let blocks = (0..layout.virtual_stages)
            .map(|c| stage_blocks[c * p + rank])
            .sum();
        RankShare {
            blocks,
            embeds: rank == 0,
            ends: rank == p - 1,
            rank,
        }
    }

    /// Parameters on this rank (its TP shard).
    pub fn params(&self, job: &Job, tp: usize) -> f64 {
        let z = ShardSizes::of(&job.model, tp);
        let embed = if self.embeds { z.wte + z.wpe } else { 0 };
        let head = if !self.ends {
            0
        } else if z.tied && !self.embeds {
            z.fin + z.wte
        } else {
            z.fin
        };
        (self.blocks * z.block + embed + head) as f64
    }
}

/// Elements of one TP rank's shard of each parameter unit, as `model::ShardLayout` lays them out
/// (checked against it in the tests): one block, the token embedding `wte`, the position
/// embedding `wpe` (GPT-2 only; Llama rotates q and k instead), and the final unit (GPT-2: the
/// final LayerNorm; Llama: the final RMSNorm and, untied, `lm_head`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSizes {
    /// One block.
    pub block: usize,
    /// The `wte` shard (Vp/tp rows).
    pub wte: usize,
    /// `wpe` (replicated; 0 for Llama).
    pub wpe: usize,
    /// The tensors after the blocks.
    pub fin: usize,
    /// The head reads `wte` (the last stage then holds it too).
    pub tied: bool,
}

impl ShardSizes {
    /// The sizes on one of `tp` ranks (a `tp` that `model::tp_layout::check_tp` accepts).
    pub fn of(model: &GptConfig, tp: usize) -> ShardSizes {
        let (c, t) = (model.n_embd, tp.max(1));
        let wte = model.padded_vocab_size() * c / t;
        match &model.llama {
            None => ShardSizes {
                // qkv (3C, C) + 3C bias, fc (4C, C) + 4C bias split; proj weights split by
                // column; ln1, ln2 (w, b) and the two proj biases replicated.
                block: 12 * c * c / t + 7 * c / t + 6 * c,
                wte,
                wpe: model.max_seq_len * c,
                fin: 2 * c,
                tied: true,
            },
            Some(l) => {
                // q and o split by head, k and v by KV head (a shared one whole), gate/up and
                // down by F, the two RMSNorm weights replicated.
                let kv = (l.n_kv_head / t).max(1) * model.head_dim();
                ShardSizes {
                    block: 2 * c * c / t + 2 * kv * c + 3 * l.ffn_dim * c / t + 2 * c,
                    wte,
                    wpe: 0,
                    fin: c + if l.tie_embeddings { 0 } else { wte },
                    tied: l.tie_embeddings,
                }
            }
        }
    }
}

/// The larger of the first and the last pipeline rank's bytes.
pub fn peak(
    job: &Job,
    layout: &Layout,
    stack: Stack,
    bf16: bool,
    host_reduce: bool,
    stage_blocks: &[usize],
) -> RankMemory {
    let ranks = [0, layout.pp - 1];
    ranks
        .iter()
        .map(|&r| {
            let share = RankShare::of(layout, stage_blocks, r);
            match stack {
                Stack::Meshtrain => meshtrain(job, layout, &share, bf16, host_reduce, stage_blocks),
                Stack::Megatron => megatron(job, layout, &share),
            }
        })
        .max_by(|a, b| a.total().total_cmp(&b.total()))
        .unwrap_or_default()
}

/// The GEMMs' bf16 operand staging and the attention views of a GPU arm, in f32 elements (the
/// sizes `DeviceGpt::new` gives its linear and attention work buffers: `AttnWork` holds three
/// query-sized and four key/value-sized views, `kv` elements each).
fn gemm_staging(d: &ActDims, head: bool, kv: usize) -> f64 {
    let vl = if head { d.vl } else { 0 };
    let x = d.bt * d.c.max(d.qkv).max(d.fc).max(vl);
    let y = d.bt * d.c.max(d.hl);
    (x + y) as f64 / 2.0 + (3 * d.bt * d.cl + 4 * kv) as f64
}

/// f32 elements of Llama's per-model work (`LlamaWork`): the RoPE tables (T, hd/2) twice, the
/// q/k/v staging (B*T, qkv) and, with fewer KV heads than TP ranks, the shared KV gradients'
/// sum (NKV, 2, hd*C) and one micro-batch's k and v gradients; 0 for GPT-2.
fn llama_work(model: &GptConfig, d: &ActDims, t: usize, tp: usize) -> usize {
    let Some(l) = &model.llama else { return 0 };
    let (hd, c) = (model.head_dim(), model.n_embd);
    let share = if l.n_kv_head < tp { (l.n_kv_head * 2 + 2) * hd * c } else { 0 };
    t * hd + d.bt * d.qkv + share
}

/// f32 elements of the activations, scratch and work buffers pipeline rank `share.rank` holds
/// (what the executor's `DeviceGpt::activation_elements` counts on a GPU arm; the CPU arm has no
/// attention views): one slot per micro-batch in flight and chunk, the recomputation work, the
/// shared scratch, Llama's work, and at bf16 the GEMM operands' staging.
pub fn activation_elements(
    job: &Job,
    l: &Layout,
    share: &RankShare,
    stage_blocks: &[usize],
    bf16: bool,
) -> f64 {
    let d = ActDims { recompute: l.recompute, ..ActDims::of_rank(&job.model, l.micro_batch, job.seq_len, l.tp, l.sp) };
    let slots = in_flight(l, share.rank) as f64;
    // Chunks of this rank: the embedding's is chunk 0, the head's the last one.
    let p = l.pp;
    let mut acts = 0.0;
    for c in 0..l.virtual_stages {
        let blocks = stage_blocks[c * p + share.rank];
        let (embeds, ends) = (
            share.embeds && c == 0,
            share.ends && c + 1 == l.virtual_stages,
        );
        acts += slots * d.slot_elements(blocks, embeds, ends) as f64;
    }
    let kv = d.bt * (job.model.n_kv_head() / l.tp).max(1) * job.model.head_dim();
    acts += (d.recompute_elements()
        + d.scratch_elements(share.ends, job.seq_len)
        + llama_work(&job.model, &d, job.seq_len, l.tp)) as f64
        + if bf16 {
            gemm_staging(&d, share.ends, kv)
        } else {
            0.0
        };
    acts
}

fn meshtrain(
    job: &Job,
    l: &Layout,
    share: &RankShare,
    bf16: bool,
    host_reduce: bool,
    stage_blocks: &[usize],
) -> RankMemory {
    let n = share.params(job, l.tp);
    let acts = activation_elements(job, l, share, stage_blocks, bf16);
    let z = ShardSizes::of(&job.model, l.tp);
    let (wte_len, wpe_len, lnf_len, block_len) = (z.wte, z.wpe, z.fin, z.block);
    let mut units: Vec<Range<usize>> = Vec::new();
    let mut at = 0;
    let mut push = |len: usize, units: &mut Vec<Range<usize>>| {
        units.push(at..at + len);
        at += len;
    };
    let holds_wte = share.embeds || (share.ends && z.tied);
    if holds_wte {
        push(wte_len, &mut units);
    }
    if share.embeds && wpe_len > 0 {
        push(wpe_len, &mut units);
    }
    push(block_len, &mut units);
    if share.ends {
        push(lnf_len, &mut units);
    }
    let n_elems = n as usize;
    let bucket = ((25usize << 20) / 4).min(n_elems.max(1));
    let count = n_elems.div_ceil(bucket).min(crate::train::MAX_STAGED + 1);
    let buckets: Vec<Range<usize>> = (0..count).map(|b| b * bucket..(b + 1) * bucket).collect();
    let e = MemoryEstimate::new(&MemoryInputs {
        zero: l.zero,
        n: n_elems,
        shard: n_elems.div_ceil(l.dp),
        dp: l.dp,
        buckets: &buckets,
        units: &units,
        // The tied `wte` only (as `train::Replica::wte`): an untied one is an ordinary unit.
        wte: if holds_wte && z.tied { Some(0..wte_len) } else { None },
        releases_grads: l.zero >= 2 && l.pp == 1,
        host_reduce,
        device_overlap: !host_reduce && l.dp > 1,
        activations: 0,
        adamw_state: true,
    });
    // bf16 copies of the 2D weights (all but biases and LayerNorms: ~ every parameter).
    let copies = if bf16 { 2.0 * n } else { 0.0 };
    RankMemory {
        params: e.params as f64 + copies,
        grads: e.grads as f64,
        optimizer: e.optimizer as f64,
        staging: e.staging as f64,
        activations: 4.0 * acts,
    }
}

/// Bytes per `s b h` of one block's saved activations in Megatron-LM's 16-bit convention (Korthikanti
/// et al. 2022, section 4.1), by how TP splits them: (the norms' inputs and outputs and the
/// dropout masks, which only sequence parallelism splits; what TP splits; the attention core's
/// coefficient of `a s / h`). GPT-2: `10`, `24` (q, k, v, the projection's input, GELU's input
/// and output), `5` (softmax output, its dropout mask and output). Llama has no dropout: `8` (two
/// RMSNorm inputs and outputs); q, k (after RoPE), v of `h + 2 NKV hd` columns, the projection's
/// input, SwiGLU's gate and up and their product (`3 F`): `(2 (h + 2 NKV hd) + 2 h + 6 F) / h`;
/// the softmax output, `2`.
fn megatron_block_bytes(model: &GptConfig) -> (f64, f64, f64) {
    let h = model.n_embd as f64;
    match &model.llama {
        None => (10.0, 24.0, 5.0),
        Some(l) => {
            let kv = (l.n_kv_head * model.head_dim()) as f64;
            let f = l.ffn_dim as f64;
            (8.0, (2.0 * (h + 2.0 * kv) + 2.0 * h + 6.0 * f) / h, 2.0)
        }
    }
}

fn megatron(job: &Job, l: &Layout, share: &RankShare) -> RankMemory {
    let n = share.params(job, l.tp);
    let dp = l.dp as f64;
    let shard = |sharded: bool| if sharded { n / dp } else { n };
    let (s, b, h, a, t) = (
        job.seq_len as f64,
        l.micro_batch as f64,
        job.model.n_embd as f64,
        job.model.n_head as f64,
        l.tp as f64,
    );
    let sbh = s * b * h;
    let (norms, split, core) = megatron_block_bytes(&job.model);
    let attn_core = core * a * s / (h * t);
    let per_block = match (l.recompute, l.sp) {
        (Recompute::Full, sp) => 2.0 * sbh / if sp { t } else { 1.0 },
        (Recompute::Selective, true) => sbh * (norms + split) / t,
        (Recompute::Selective, false) => sbh * (norms + split / t),
        (Recompute::None, true) => sbh * ((norms + split) / t + attn_core),
        (Recompute::None, false) => sbh * (norms + split / t + attn_core),
    };
    // Full recomputation rebuilds one block's activations at a time during its backward.
    let rebuilt = if l.recompute == Recompute::Full {
        sbh * (norms + split / t + attn_core)
    } else {
        0.0
    };
    let blocks_per_chunk = share.blocks as f64 / l.virtual_stages as f64;
    let held = in_flight(l, share.rank) as f64 * l.virtual_stages as f64 * blocks_per_chunk;
    // Logits (fp32 for the loss) and their gradient on the last rank.
    let logits = if share.ends {
        2.0 * 4.0 * s * b * job.vocab() as f64 / t
    } else {
        0.0
    };
    RankMemory {
        params: 2.0 * shard(l.zero >= 3),
        grads: 4.0 * shard(l.zero >= 2),
        optimizer: 12.0 * shard(l.zero >= 1),
        staging: 0.0,
        activations: held * per_block + rebuilt + logits,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GptConfig;

    fn layout(tp: usize, pp: usize, v: usize, m: usize) -> Layout {
        Layout {
            tp,
            pp,
            virtual_stages: v,
            dp: 1,
            zero: 0,
            micro_batch: 1,
            grad_accum: m,
            sp: false,
            recompute: Recompute::None,
        }
    }

    #[test]
    fn in_flight_follows_the_schedules() {
        // 1F1B: p - rank; one stage: 1; capped by m.
        assert_eq!(
            (
                in_flight(&layout(1, 4, 1, 8), 0),
                in_flight(&layout(1, 4, 1, 8), 3)
            ),
            (4, 1)
        );
        assert_eq!(in_flight(&layout(1, 4, 1, 2), 0), 2);
        assert_eq!(in_flight(&layout(1, 1, 1, 8), 0), 1);
        // Interleaved v = 2, p = 4, rank 0: warm-up 2*3 + 4 = 10, 11 forwards over 2 chunks.
        assert_eq!(in_flight(&layout(1, 4, 2, 8), 0), 6);
    }

    #[test]
    fn meshtrain_terms_match_the_training_formula() {
        // One rank, ZeRO-0: 16 bytes per parameter plus staging of one bucket, no copies at fp32.
        let job = Job::new("d12", &GptConfig::named("d12").unwrap(), 1, 4, 1024).unwrap();
        let l = Layout {
            micro_batch: 4,
            grad_accum: 1,
            ..layout(1, 1, 1, 1)
        };
        let m = peak(&job, &l, Stack::Meshtrain, false, false, &[12]);
        let n = RankShare::of(&l, &[12], 0).params(&job, 1);
        assert!(
            (m.params - 4.0 * n).abs() < 8.0 && (m.optimizer - 8.0 * n).abs() < 16.0,
            "{m:?} n {n}"
        );
        // d12 at B=4, T=1024: per block 4096 rows x (16C + 4) plus 4 x 12 x 1024^2 attention
        // probabilities = 100.6M f32, 4.83 GB for 12 blocks; with the head, the logits' gradient
        // and the scratch about 6.9 GB.
        let gb = m.activations / 1e9;
        assert!((6.5..7.3).contains(&gb), "{gb} GB");
        // TP halves the large terms; sequence parallelism removes part of the rest.
        let t2 = peak(
            &job,
            &Layout { tp: 2, ..l },
            Stack::Meshtrain,
            false,
            false,
            &[12],
        );
        let sp = peak(
            &job,
            &Layout {
                tp: 2,
                sp: true,
                ..l
            },
            Stack::Meshtrain,
            false,
            false,
            &[12],
        );
        assert!(t2.activations < 0.7 * m.activations && sp.activations < t2.activations + 1e9);
    }

    /// The executor's own activation bytes for d12 on one rank at B=4, T=256 in each
    /// recomputation mode, as `meshtrain train benches/recompute_memory.toml` prints them in its
    /// memory estimate (1233.3, 1098.1 and 578.9 MB).
    #[test]
    fn meshtrain_recomputation_matches_the_executor() {
        let job = Job::new("d12", &GptConfig::named("d12").unwrap(), 1, 4, 256).unwrap();
        for (recompute, mb) in [(Recompute::None, 1233.3), (Recompute::Selective, 1098.1), (Recompute::Full, 578.9)] {
            let l = Layout { micro_batch: 4, recompute, ..layout(1, 1, 1, 1) };
            let m = peak(&job, &l, Stack::Meshtrain, false, false, &[12]);
            assert!((m.activations / 1e6 - mb).abs() < 0.1, "{recompute:?}: {} MB, the executor {mb} MB", m.activations / 1e6);
        }
    }

    #[test]
    fn megatron_activations_follow_korthikanti() {
        // 175B, t = 8, SP + selective: 34 s b h / t bytes per block; 1F1B rank 0 holds p * L/p = L.
        let c = GptConfig {
            n_layer: 96,
            n_head: 96,
            n_embd: 12288,
            vocab_size: 51200,
            max_seq_len: 2048,
            llama: None,
        };
        let job = Job::new("175b", &c, 64, 64, 2048).unwrap();
        let l = Layout {
            sp: true,
            recompute: Recompute::Selective,
            ..layout(8, 8, 1, 64)
        };
        let m = megatron(&job, &l, &RankShare::of(&l, &[12; 8], 0));
        let expect = 96.0 * 34.0 * 2048.0 * 12288.0 / 8.0;
        assert!(
            (m.activations - expect).abs() < 1.0,
            "{} vs {expect}",
            m.activations
        );
        let full = megatron(
            &job,
            &Layout {
                recompute: Recompute::Full,
                ..l
            },
            &RankShare::of(&l, &[12; 8], 0),
        );
        assert!(full.activations < m.activations / 5.0);
    }
}
