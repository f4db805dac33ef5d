//! The flat parameter buffer of one (tensor-parallel rank, pipeline stage) shard of a GPT-2 or
//! Llama model.
//!
//! A stage holds the tensors of the blocks of all its chunks (one contiguous block range each; an
//! interleaved pipeline gives a rank several), plus `wte` when it embeds (first stage) or owns the
//! tied head (last stage), `wpe` when first, and the final LayerNorm when last; in the global
//! [`ParamLayout`] order. Each tensor is cut by its [`TpSplit`] over `tp` ranks (rank `r`):
//!
//! | split      | global shape | shard held by rank `r`                                      |
//! |------------|--------------|-------------------------------------------------------------|
//! | Vocab      | (Vp, C)      | rows `r*Vp/tp ..`                                            |
//! | Column     | (O, I) / (O) | rows `r*O/tp ..`; the fused qkv (3C, C) is three stacked    |
//! |            |              | (C, C) matrices and each rank keeps rows `r*C/tp ..` of each |
//! | Row        | (O, I)       | columns `r*I/tp ..`                                         |
//! | Replicated | any          | everything                                                  |
//!
//! Llama (`model.arch = "llama"`): q and the stacked gate/up (two (F, C) matrices, like the fused
//! qkv's three) are Column, o and down Row, the norms Replicated, `wte` and `lm_head` Vocab (an
//! untied `lm_head` lives on the last stage only, `wte` on the first); k and v are `KvHeads`:
//! Column by KV head when tp divides `n_kv_head`, else (tp a multiple of `n_kv_head`) rank `r`
//! holds rows `g*hd..(g+1)*hd` of KV head `g = r / (tp / n_kv_head)`, the one its query heads
//! read, shared with the other `tp / n_kv_head - 1` ranks of that head (`tp_sharing`); the first
//! of them is its `tp_owner` (writes it to checkpoints, counts it in the gradient norm), and the
//! executor sums the sharers' gradient parts so that all hold the same gradient.
//!
//! Every shard is one box of a *view* of the global tensor (the fused qkv is viewed as
//! (3, C, C), its bias as (3, C); other Column tensors as (1, O, ...)), described by
//! `view_shape`, `box_offset` (the per-dimension start) and `box_shape`; the local tensor holds
//! the box's elements row-major. That is all a checkpoint resharder needs.
//!
//! Invariants: entries tile `0..total_len()` contiguously in global order; a block's tensors are
//! contiguous ([`ShardLayout::block_span`]); `n_head` and `Vp` are divisible by `tp` (Llama also
//! `ffn_dim`, and `n_kv_head` divisible by or dividing `tp`), so every rank's shard has the same
//! shape.

use std::ops::Range;

use super::init::Initializer;
use super::layout::{BlockRanges, ParamLayout, TpSplit};
use super::GptConfig;
use crate::error::{Error, Result};

/// Which part of the model one pipeline rank runs: one model chunk (a contiguous range of blocks),
/// or several with the interleaved schedule, which gives a rank non-contiguous block ranges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageSpec {
    /// Transformer blocks of each chunk in execution order (global indices; ascending and disjoint,
    /// so the chunks' tensors follow each other in the flat buffer in chunk order).
    pub chunks: Vec<Range<usize>>,
    /// Whether chunk 0 embeds the tokens (holds `wpe` and the embedding use of `wte`).
    pub first: bool,
    /// Whether the last chunk ends the model: final LayerNorm, tied head (`wte`) and the loss.
    pub last: bool,
}

impl StageSpec {
    /// The whole model in one stage.
    pub fn whole(config: &GptConfig) -> Self {
        StageSpec::single(0..config.n_layer, true, true)
    }

    /// One chunk of the blocks `layers`.
    pub fn single(layers: Range<usize>, first: bool, last: bool) -> Self {
        StageSpec {
            chunks: vec![layers],
            first,
            last,
        }
    }

    /// Whether chunk `chunk` embeds the tokens.
    pub fn embeds(&self, chunk: usize) -> bool {
        self.first && chunk == 0
    }

    /// Whether chunk `chunk` ends with the head and the loss.
    pub fn ends(&self, chunk: usize) -> bool {
        self.last && chunk + 1 == self.chunks.len()
    }

    /// Whether block `layer` belongs to one of the chunks.
    pub fn holds(&self, layer: usize) -> bool {
        self.chunks.iter().any(|c| c.contains(&layer))
    }

    /// Checks that there is at least one chunk and the chunks ascend within `n_layer` blocks.
    fn validate(&self, n_layer: usize) -> Result<()> {
        let mut end = 0;
        for c in &self.chunks {
            if c.start < end || c.start > c.end || c.end > n_layer {
                return Err(Error::InvalidArgument(format!(
                    "stage chunks {:?} are not ascending, disjoint block ranges within the model's \
                     {n_layer} blocks",
                    self.chunks
                )));
            }
            end = c.end;
        }
        if self.chunks.is_empty() {
            return Err(Error::InvalidArgument("a stage needs at least one chunk".into()));
        }
        Ok(())
    }
}

/// One tensor's shard in the stage's flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardEntry {
    /// Global name, as in [`ParamLayout`] (e.g. `h.3.attn.qkv.weight`).
    pub name: String,
    /// Block index, `None` for embeddings and the final LayerNorm.
    pub layer: Option<usize>,
    /// How the tensor is split over TP.
    pub split: TpSplit,
    /// Shape of the whole tensor.
    pub global_shape: Vec<usize>,
    /// Offset of the whole tensor in the single-rank flat buffer.
    pub global_offset: usize,
    /// The global tensor viewed so that the shard is one box (same elements, row-major).
    pub view_shape: Vec<usize>,
    /// Start of the box along each view dimension.
    pub box_offset: Vec<usize>,
    /// Extent of the box along each view dimension.
    pub box_shape: Vec<usize>,
    /// Shape the compute kernels see, e.g. (3C/tp, C) for the fused qkv weight.
    pub local_shape: Vec<usize>,
    /// First element in the stage's flat buffer.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
    /// Whether AdamW applies weight decay (2-D weights).
    pub decay: bool,
    /// Whether every TP rank holds the whole tensor (and, after backward, the same gradient).
    pub replicated_over_tp: bool,
    /// Whether this rank writes the shard to checkpoints and counts it in the gradient norm: every
    /// rank for split tensors, TP rank 0 for replicated ones, the first of the ranks sharing a KV
    /// head for Llama's k and v with fewer KV heads than ranks.
    pub tp_owner: bool,
    /// TP ranks holding this same box (1 for split tensors, tp for replicated ones, tp/NKV for
    /// shared KV heads).
    pub tp_sharing: usize,
}

impl ShardEntry {
    /// Element range in the stage's flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }

    /// Calls `f(global_index, local_index, run_length)` for each contiguous run of the box.
    fn for_each_run(&self, mut f: impl FnMut(usize, usize, usize)) {
        let d = self.view_shape.len();
        let run = self.box_shape[d - 1];
        let mut strides = vec![1; d];
        for i in (0..d - 1).rev() {
            strides[i] = strides[i + 1] * self.view_shape[i + 1];
        }
        let runs: usize = self.box_shape[..d - 1].iter().product();
        for k in 0..runs {
            let (mut rest, mut global) = (k, self.global_offset + self.box_offset[d - 1]);
            for i in (0..d - 1).rev() {
                global += (self.box_offset[i] + rest % self.box_shape[i]) * strides[i];
                rest /= self.box_shape[i];
            }
            f(global, self.offset + k * run, run);
        }
    }
}

/// The layout table of one shard.
#[derive(Debug, Clone)]
pub struct ShardLayout {
    entries: Vec<ShardEntry>,
    /// Global indices of the blocks held, ascending (buffer order).
    blocks: Vec<usize>,
    /// Index into `entries` of the first tensor of block `blocks[0]`.
    first_block_entry: usize,
    /// Tensors per block.
    per_block: usize,
    total: usize,
    global_total: usize,
}

/// Rows of the global tensor stacked along dimension 0 that each split separately: the fused
/// qkv projection is three (C, C) matrices (and three biases), everything else is one.
fn stacked_matrices(name: &str) -> usize {
    if name.ends_with(".attn.qkv.weight") || name.ends_with(".attn.qkv.bias") {
        3
    } else if name.ends_with(".mlp.gate_up.weight") {
        2
    } else {
        1
    }
}

impl ShardLayout {
    /// The layout of TP rank `tp_rank` of `tp_size` for the stage `spec` of `config`.
    pub fn new(
        config: &GptConfig,
        tp_rank: usize,
        tp_size: usize,
        spec: &StageSpec,
    ) -> Result<Self> {
        config.validate()?;
        check_tp(config, tp_rank, tp_size)?;
        spec.validate(config.n_layer)?;
        let global = ParamLayout::new(config);
        let tied = config.llama.is_none_or(|l| l.tie_embeddings);
        let keep = |name: &str, layer: Option<usize>| match layer {
            Some(l) => spec.holds(l),
            None if name == "wte" => spec.first || (spec.last && tied),
            None if name == "wpe" => spec.first,
            None => spec.last,
        };
        let mut entries = Vec::new();
        let mut offset = 0;
        let mut first_block_entry = None;
        for e in global.entries().iter().filter(|e| keep(&e.name, e.layer)) {
            if e.layer.is_some() && first_block_entry.is_none() {
                first_block_entry = Some(entries.len());
            }
            let (split, sharing) = match e.tp_split {
                TpSplit::KvHeads if config.n_kv_head() < tp_size => (TpSplit::KvHeads, tp_size / config.n_kv_head()),
                TpSplit::KvHeads => (TpSplit::Column, 1),
                TpSplit::Replicated => (TpSplit::Replicated, tp_size),
                s => (s, 1),
            };
            let (view_shape, box_offset, box_shape, local_shape) = if split == TpSplit::KvHeads {
                // The KV head of this rank's query heads: rows g*hd.. of (NKV*hd, C).
                let (hd, g) = (config.head_dim(), tp_rank / sharing);
                (e.shape.clone(), vec![g * hd, 0], vec![hd, e.shape[1]], vec![hd, e.shape[1]])
            } else {
                shard_box(&e.shape, split, stacked_matrices(&e.name), tp_rank, tp_size)
            };
            let len = local_shape.iter().product();
            entries.push(ShardEntry {
                name: e.name.clone(),
                layer: e.layer,
                split: e.tp_split,
                global_shape: e.shape.clone(),
                global_offset: e.offset,
                view_shape,
                box_offset,
                box_shape,
                local_shape,
                offset,
                len,
                decay: e.decay,
                replicated_over_tp: e.tp_split == TpSplit::Replicated || tp_size == 1,
                tp_owner: tp_rank % sharing == 0,
                tp_sharing: sharing,
            });
            offset += len;
        }
        Ok(ShardLayout {
            first_block_entry: first_block_entry.unwrap_or(entries.len()),
            entries,
            blocks: (0..config.n_layer).filter(|&l| spec.holds(l)).collect(),
            per_block: global.block_tensor_count(),
            total: offset,
            global_total: global.total_len(),
        })
    }

    /// All entries in buffer order.
    pub fn entries(&self) -> &[ShardEntry] {
        &self.entries
    }

    /// Length of the stage's flat buffer.
    pub fn total_len(&self) -> usize {
        self.total
    }

    /// The entry called `name` (global name).
    pub fn get(&self, name: &str) -> Option<&ShardEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// Local range of the `wte` shard (Vp/tp, C), if this stage holds it.
    pub fn wte(&self) -> Option<Range<usize>> {
        self.get("wte").map(ShardEntry::range)
    }

    /// Local range of `wpe` (maxT, C), if this stage holds it.
    pub fn wpe(&self) -> Option<Range<usize>> {
        self.get("wpe").map(ShardEntry::range)
    }

    /// The contiguous local range of the tensors after the blocks (GPT-2: `lnf.weight`,
    /// `lnf.bias`; Llama: `norm.weight` and, untied, `lm_head.weight`), if this stage holds them.
    pub fn final_unit(&self) -> Option<Range<usize>> {
        let first = self.entries.iter().position(|e| e.layer.is_none() && (e.name == "lnf.weight" || e.name == "norm.weight"))?;
        Some(self.entries[first].offset..self.total)
    }

    /// Whether the output head reads `wte` (GPT-2, and Llama with tied embeddings).
    pub fn tied_head(&self) -> bool {
        self.get("lm_head.weight").is_none()
    }

    /// Local ranges of all the tensors of block `l` (`l` one of the stage's blocks), in layout
    /// order.
    pub fn block_ranges(&self, l: usize) -> Vec<Range<usize>> {
        self.block_entries(l).iter().map(ShardEntry::range).collect()
    }

    /// Local ranges of `lnf.weight` and `lnf.bias` (C each), if this stage holds them.
    pub fn lnf(&self) -> Option<(Range<usize>, Range<usize>)> {
        Some((
            self.get("lnf.weight")?.range(),
            self.get("lnf.bias")?.range(),
        ))
    }

    /// Local ranges of block `l`'s shards (`l` global, one of the stage's blocks).
    pub fn block(&self, l: usize) -> BlockRanges {
        let e = &self.block_entries(l);
        let r = |i: usize| e[i].range();
        BlockRanges::from_fn(r)
    }

    /// The contiguous local range of all of block `l`'s shards.
    pub fn block_span(&self, l: usize) -> Range<usize> {
        let e = self.block_entries(l);
        e[0].offset..e[e.len() - 1].range().end
    }

    fn block_entries(&self, l: usize) -> &[ShardEntry] {
        let k = self
            .blocks
            .binary_search(&l)
            .unwrap_or_else(|_| panic!("block {l} is not among this stage's {:?}", self.blocks));
        let first = self.first_block_entry + k * self.per_block;
        &self.entries[first..first + self.per_block]
    }

    /// Maximal runs of equal decay flag covering `0..total_len()` (for AdamW).
    pub fn decay_spans(&self) -> Vec<(Range<usize>, bool)> {
        let mut spans: Vec<(Range<usize>, bool)> = Vec::new();
        for e in &self.entries {
            match spans.last_mut() {
                Some((r, d)) if *d == e.decay => r.end = e.range().end,
                _ => spans.push((e.range(), e.decay)),
            }
        }
        spans
    }

    /// Copies this shard's elements out of a single-rank flat buffer `full` into `local`.
    pub fn gather_from_full(&self, full: &[f32], local: &mut [f32]) -> Result<()> {
        self.check_lens("gather_from_full", full.len(), local.len())?;
        for e in &self.entries {
            e.for_each_run(|g, l, n| local[l..l + n].copy_from_slice(&full[g..g + n]));
        }
        Ok(())
    }

    /// Sets this shard's elements of `local` to their values in the whole model's initialisation
    /// `init`; with `only`, just the local elements inside those ranges (others untouched).
    pub fn init_local(&self, init: &Initializer, local: &mut [f32], only: Option<&[Range<usize>]>) -> Result<()> {
        self.check_lens("init_local", init.len(), local.len())?;
        let everything = 0..self.total;
        let only = only.unwrap_or(std::slice::from_ref(&everything));
        for e in &self.entries {
            e.for_each_run(|g, l, n| {
                for r in only {
                    let (a, b) = (r.start.max(l), r.end.min(l + n));
                    if a < b {
                        init.fill(g + (a - l)..g + (b - l), &mut local[a..b]);
                    }
                }
            });
        }
        Ok(())
    }

    /// Writes `local` over this shard's elements of a single-rank flat buffer `full` (others
    /// untouched).
    pub fn scatter_into_full(&self, local: &[f32], full: &mut [f32]) -> Result<()> {
        self.check_lens("scatter_into_full", full.len(), local.len())?;
        for e in &self.entries {
            e.for_each_run(|g, l, n| full[g..g + n].copy_from_slice(&local[l..l + n]));
        }
        Ok(())
    }

    fn check_lens(&self, op: &str, full: usize, local: usize) -> Result<()> {
        if full != self.global_total || local != self.total {
            return Err(Error::InvalidArgument(format!(
                "{op}: buffers of {full} (full) and {local} (shard) elements, layout needs {} and {}",
                self.global_total, self.total
            )));
        }
        Ok(())
    }
}

/// Checks that `tp_size` ranks can split `config` evenly and `tp_rank` is one of them.
pub fn check_tp(config: &GptConfig, tp_rank: usize, tp_size: usize) -> Result<()> {
    if tp_size == 0 || tp_rank >= tp_size {
        return Err(Error::InvalidArgument(format!(
            "tensor-parallel rank {tp_rank} of {tp_size} ranks"
        )));
    }
    if config.n_head % tp_size != 0 {
        return Err(Error::config(
            "parallel.tp",
            format!("n_head {} is not divisible by tp {tp_size}", config.n_head),
        ));
    }
    if config.padded_vocab_size() % tp_size != 0 {
        return Err(Error::config(
            "parallel.tp",
            format!(
                "padded vocabulary {} is not divisible by tp {tp_size}",
                config.padded_vocab_size()
            ),
        ));
    }
    if let Some(l) = &config.llama {
        let nkv = l.n_kv_head;
        if nkv % tp_size != 0 && tp_size % nkv != 0 {
            return Err(Error::config(
                "parallel.tp",
                format!("tp {tp_size} must divide model.n_kv_head {nkv} or be a multiple of it"),
            ));
        }
        if l.ffn_dim % tp_size != 0 {
            return Err(Error::config(
                "parallel.tp",
                format!("model.ffn_dim {} is not divisible by tp {tp_size}", l.ffn_dim),
            ));
        }
    }
    Ok(())
}

/// (view_shape, box_offset, box_shape, local_shape) of rank `r`'s shard of a tensor.
fn shard_box(
    shape: &[usize],
    split: TpSplit,
    stacked: usize,
    r: usize,
    tp: usize,
) -> (Vec<usize>, Vec<usize>, Vec<usize>, Vec<usize>) {
    match split {
        TpSplit::Replicated => (
            shape.to_vec(),
            vec![0; shape.len()],
            shape.to_vec(),
            shape.to_vec(),
        ),
        TpSplit::Vocab => {
            let rows = shape[0] / tp;
            let (view, off) = (shape.to_vec(), vec![r * rows, 0]);
            (view, off, vec![rows, shape[1]], vec![rows, shape[1]])
        }
        TpSplit::Column => {
            let per = shape[0] / stacked; // rows of one stacked matrix
            let mut view = vec![stacked, per];
            view.extend_from_slice(&shape[1..]);
            let mut off = vec![0, r * per / tp];
            off.extend(std::iter::repeat_n(0, shape.len() - 1));
            let mut boxed = vec![stacked, per / tp];
            boxed.extend_from_slice(&shape[1..]);
            let mut local = vec![shape[0] / tp];
            local.extend_from_slice(&shape[1..]);
            (view, off, boxed, local)
        }
        TpSplit::KvHeads => unreachable!("KV-head shards are placed by ShardLayout::new"),
        TpSplit::Row => {
            let cols = shape[1] / tp;
            let local = vec![shape[0], cols];
            (shape.to_vec(), vec![0, r * cols], local.clone(), local)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> GptConfig {
        GptConfig {
            n_layer: 4,
            n_head: 4,
            n_embd: 8,
            vocab_size: 200,
            max_seq_len: 5,
            llama: None,
        }
    }

    /// The shards of all TP ranks of all stages cover the full buffer: every element of a split
    /// tensor exactly once per stage holding it, replicated ones on every rank; with contiguous
    /// stages and with interleaved ones (two chunks per rank).
    #[test]
    fn shards_tile_the_full_buffer() {
        check_tiling(&[
            StageSpec::single(0..1, true, false),
            StageSpec::single(1..4, false, true),
        ]);
        let interleaved = [
            StageSpec {
                chunks: vec![0..1, 2..3],
                first: true,
                last: false,
            },
            StageSpec {
                chunks: vec![1..2, 3..4],
                first: false,
                last: true,
            },
        ];
        check_tiling(&interleaved);
        // Rank 1 holds blocks 1 and 3 back to back, and nothing of blocks 0 and 2.
        let lay = ShardLayout::new(&cfg(), 0, 1, &interleaved[1]).unwrap();
        assert_eq!(lay.block_span(1).end, lay.block_span(3).start);
        assert!(lay.get("h.0.ln1.weight").is_none() && lay.get("h.2.ln1.weight").is_none());
        assert_eq!(lay.block(3).ln1_w, lay.get("h.3.ln1.weight").unwrap().range());
    }

    /// A shard initialised on its own holds exactly the whole model's initial values; initialised
    /// over some ranges only, it holds them there and leaves every other element untouched.
    #[test]
    fn shards_initialise_on_their_own_as_the_whole_model_does() {
        let c = cfg();
        let init = Initializer::new(&c, &ParamLayout::new(&c), 9);
        let full: Vec<f32> = super::super::init::init_params(&c, &ParamLayout::new(&c), 9);
        let specs = [StageSpec::single(0..4, true, true), StageSpec { chunks: vec![1..2, 3..4], first: false, last: true }];
        for spec in &specs {
            for (rank, tp) in [(0, 1), (0, 2), (1, 2), (3, 4)] {
                let lay = ShardLayout::new(&c, rank, tp, spec).unwrap();
                let mut want = vec![0f32; lay.total_len()];
                lay.gather_from_full(&full, &mut want).unwrap();
                let mut got = vec![f32::NAN; lay.total_len()];
                lay.init_local(&init, &mut got, None).unwrap();
                assert_eq!(got, want, "tp rank {rank} of {tp}");
                let n = lay.total_len();
                let only = [1..n / 3, n / 2..n / 2 + 7];
                let mut part = vec![f32::NAN; n];
                lay.init_local(&init, &mut part, Some(&only)).unwrap();
                for (i, (p, w)) in part.iter().zip(&want).enumerate() {
                    if only.iter().any(|r| r.contains(&i)) {
                        assert_eq!(p, w, "element {i}");
                    } else {
                        assert!(p.is_nan(), "element {i} outside the ranges was written");
                    }
                }
            }
        }
    }

    fn check_tiling(stages: &[StageSpec]) {
        let c = cfg();
        let full_len = ParamLayout::new(&c).total_len();
        let tp = 2;
        let mut count = vec![0usize; full_len];
        for spec in stages {
            for r in 0..tp {
                let lay = ShardLayout::new(&c, r, tp, spec).unwrap();
                let mut next = 0;
                for e in lay.entries() {
                    assert_eq!(e.offset, next, "{}", e.name);
                    next += e.len;
                }
                assert_eq!(next, lay.total_len());
                // Mark each global element this shard holds, via the index each slot maps to.
                let local: Vec<f32> = (0..lay.total_len()).map(|i| i as f32).collect();
                let mut full = vec![-1f32; full_len];
                lay.scatter_into_full(&local, &mut full).unwrap();
                for (g, &v) in full.iter().enumerate() {
                    if v >= 0.0 {
                        count[g] += 1;
                    }
                }
                let mut back = vec![0f32; lay.total_len()];
                lay.gather_from_full(&full, &mut back).unwrap();
                assert_eq!(back, local);
            }
        }
        let global = ParamLayout::new(&c);
        for e in global.entries() {
            // wte lives on the first and the last stage; replicated tensors on both TP ranks.
            let stages_holding = if e.name == "wte" { 2 } else { 1 };
            let ranks = if e.tp_split == TpSplit::Replicated {
                tp
            } else {
                1
            };
            for g in e.range() {
                assert_eq!(count[g], stages_holding * ranks, "{} element {g}", e.name);
            }
        }
    }

    /// Rank 1 of 2 holds rows 4..8, 12..16 and 20..24 of the fused (24, 8) qkv weight: the second
    /// half of each of q, k and v, i.e. heads 2 and 3.
    #[test]
    fn fused_qkv_shard_keeps_q_k_and_v_of_its_heads() {
        let c = cfg();
        let lay = ShardLayout::new(&c, 1, 2, &StageSpec::whole(&c)).unwrap();
        let e = lay.get("h.0.attn.qkv.weight").unwrap();
        assert_eq!(e.local_shape, vec![12, 8]);
        let full: Vec<f32> = (0..ParamLayout::new(&c).total_len())
            .map(|i| i as f32)
            .collect();
        let mut local = vec![0f32; lay.total_len()];
        lay.gather_from_full(&full, &mut local).unwrap();
        let rows: Vec<usize> = local[e.range()]
            .chunks(8)
            .map(|row| (row[0] as usize - e.global_offset) / 8)
            .collect();
        assert_eq!(rows, [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]);
        let p = lay.get("h.0.mlp.proj.weight").unwrap(); // (8, 32) row-parallel: columns 16..32
        let first_row: Vec<usize> = local[p.range()][..16]
            .iter()
            .map(|&v| v as usize - p.global_offset)
            .collect();
        assert_eq!(first_row, (16..32).collect::<Vec<_>>());
        assert!(!p.replicated_over_tp && lay.get("h.0.mlp.proj.bias").unwrap().replicated_over_tp);
    }

    fn llama(nkv: usize) -> GptConfig {
        let mut c = GptConfig::named("llama-tiny").unwrap();
        c.n_layer = 2;
        c.llama.as_mut().unwrap().n_kv_head = nkv;
        c
    }

    /// Llama shards: q, gate/up split by rows, k and v by KV head (shared by tp/NKV ranks when
    /// there are fewer KV heads than ranks), `lm_head` on the last stage only; the owners' boxes
    /// tile every tensor exactly once.
    #[test]
    fn llama_shards_split_by_heads_and_share_kv_heads() {
        for (nkv, tp) in [(2, 2), (1, 2), (2, 4), (4, 4), (1, 4)] {
            let c = llama(nkv);
            let full_len = ParamLayout::new(&c).total_len();
            let mut owned = vec![0usize; full_len];
            for r in 0..tp {
                let lay = ShardLayout::new(&c, r, tp, &StageSpec::whole(&c)).unwrap();
                let k = lay.get("h.1.attn.k.weight").unwrap();
                let hd = c.head_dim();
                assert_eq!(k.local_shape, vec![hd * (nkv / tp).max(1), 64], "nkv {nkv} tp {tp}");
                assert_eq!(k.tp_sharing, (tp / nkv).max(1));
                // Query heads r*NH/tp.. read KV head (first query head) / (NH/NKV).
                assert_eq!(k.box_offset[k.box_offset.len() - 2] / hd, (r * 4 / tp) / (4 / nkv) * usize::from(nkv < tp) + (r * nkv / tp) * usize::from(nkv >= tp));
                let gu = lay.get("h.0.mlp.gate_up.weight").unwrap();
                assert_eq!(gu.local_shape, vec![2 * 176 / tp, 64]);
                let local: Vec<f32> = (0..lay.total_len()).map(|i| i as f32).collect();
                let mut full = vec![-1f32; full_len];
                lay.scatter_into_full(&local, &mut full).unwrap();
                for e in lay.entries().iter().filter(|e| e.tp_owner) {
                    let mut one = vec![-1f32; full_len];
                    let mut l2 = vec![-1f32; lay.total_len()];
                    l2[e.range()].copy_from_slice(&local[e.range()]);
                    lay.scatter_into_full(&l2, &mut one).unwrap();
                    one.iter().enumerate().filter(|(_, &v)| v >= 0.0).for_each(|(g, _)| owned[g] += 1);
                }
            }
            assert!(owned.iter().all(|&n| n == 1), "nkv {nkv} tp {tp}: owners do not tile the model");
        }
        let c = llama(2);
        let last = ShardLayout::new(&c, 0, 1, &StageSpec::single(1..2, false, true)).unwrap();
        assert!(last.get("wte").is_none() && last.get("lm_head.weight").is_some());
        assert!(ShardLayout::new(&llama(2), 0, 3, &StageSpec::whole(&c)).is_err());
    }

    #[test]
    fn rejects_indivisible_tp() {
        let c = cfg();
        assert!(ShardLayout::new(&c, 0, 3, &StageSpec::whole(&c)).is_err()); // 4 heads
        assert!(ShardLayout::new(&c, 2, 2, &StageSpec::whole(&c)).is_err());
    }
}
