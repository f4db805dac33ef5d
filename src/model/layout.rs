//! The parameter layout table: where each named tensor lives in the ONE flat parameter buffer.
//!
//! Order (gradients and AdamW state use the same layout):
//!
//! | name                    | shape     | decay | tensor-parallel split |
//! |-------------------------|-----------|-------|-----------------------|
//! | `wte`                   | (Vp, C)   | yes   | vocab (rows)          |
//! | `wpe`                   | (maxT, C) | yes   | replicated            |
//! | `h.{l}.ln1.weight`      | (C)       | no    | replicated            |
//! | `h.{l}.ln1.bias`        | (C)       | no    | replicated            |
//! | `h.{l}.attn.qkv.weight` | (3C, C)   | yes   | column (output rows)  |
//! | `h.{l}.attn.qkv.bias`   | (3C)      | no    | column                |
//! | `h.{l}.attn.proj.weight`| (C, C)    | yes   | row (input columns)   |
//! | `h.{l}.attn.proj.bias`  | (C)       | no    | replicated            |
//! | `h.{l}.ln2.weight`      | (C)       | no    | replicated            |
//! | `h.{l}.ln2.bias`        | (C)       | no    | replicated            |
//! | `h.{l}.mlp.fc.weight`   | (4C, C)   | yes   | column                |
//! | `h.{l}.mlp.fc.bias`     | (4C)      | no    | column                |
//! | `h.{l}.mlp.proj.weight` | (C, 4C)   | yes   | row                   |
//! | `h.{l}.mlp.proj.bias`   | (C)       | no    | replicated            |
//! | `lnf.weight`, `lnf.bias`| (C)       | no    | replicated            |
//!
//! Llama (`model.arch = "llama"`; F = `ffn_dim`, hd = C/NH, no biases, no position table):
//!
//! | name                       | shape        | decay | tensor-parallel split        | transformers name (`model.` prefix)   |
//! |----------------------------|--------------|-------|------------------------------|---------------------------------------|
//! | `wte`                      | (Vp, C)      | yes   | vocab                        | `embed_tokens.weight`                 |
//! | `h.{l}.attn_norm.weight`   | (C)          | no    | replicated                   | `layers.{l}.input_layernorm.weight`   |
//! | `h.{l}.attn.q.weight`      | (NH*hd, C)   | yes   | column (query heads)         | `layers.{l}.self_attn.q_proj.weight`  |
//! | `h.{l}.attn.k.weight`      | (NKV*hd, C)  | yes   | KV heads (shared if NKV < tp)| `layers.{l}.self_attn.k_proj.weight`  |
//! | `h.{l}.attn.v.weight`      | (NKV*hd, C)  | yes   | KV heads (shared if NKV < tp)| `layers.{l}.self_attn.v_proj.weight`  |
//! | `h.{l}.attn.proj.weight`   | (C, NH*hd)   | yes   | row                          | `layers.{l}.self_attn.o_proj.weight`  |
//! | `h.{l}.mlp_norm.weight`    | (C)          | no    | replicated                   | `layers.{l}.post_attention_layernorm.weight` |
//! | `h.{l}.mlp.gate_up.weight` | (2F, C)      | yes   | column (gate and up stacked) | `layers.{l}.mlp.gate_proj.weight` rows 0..F, `up_proj` rows F..2F |
//! | `h.{l}.mlp.proj.weight`    | (C, F)       | yes   | row                          | `layers.{l}.mlp.down_proj.weight`     |
//! | `norm.weight`              | (C)          | no    | replicated                   | `norm.weight`                         |
//! | `lm_head.weight`           | (Vp, C)      | yes   | vocab (absent when tied)     | `lm_head.weight` (no `model.` prefix) |
//!
//! Gate and up are one tensor so that one product yields the SwiGLU input `[gate | up]`; under
//! TP it is two stacked (F, C) matrices, each split by rows, so a rank's shard is `[its gate rows |
//! its up rows]`.
//!
//! Invariants: entries are contiguous and non-overlapping, in the order above, covering
//! `0..total_len()`; every block has the same size, so blocks `a..b` occupy one contiguous range
//! ([`ParamLayout::layers_range`]) — the unit of pipeline stages and ZeRO shards. Weight decay
//! applies to 2-D tensors only.

use std::ops::Range;

use super::GptConfig;

/// Which dimension tensor parallelism would split a tensor along.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum TpSplit {
    /// Output features (weight rows, bias): column-parallel linear.
    Column,
    /// Input features (weight columns): row-parallel linear; its bias stays replicated.
    Row,
    /// Vocabulary rows of the embedding / output projection.
    Vocab,
    /// Rows by key/value head (Llama's k and v): like `Column` when `n_kv_head` is a multiple of
    /// tp; with fewer KV heads than ranks each rank holds the one KV head its query heads read,
    /// shared with the other ranks of that head.
    KvHeads,
    /// Every rank keeps a full copy.
    Replicated,
}

/// One named tensor in the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ParamEntry {
    /// Dotted name, e.g. `h.0.attn.qkv.weight`.
    pub name: String,
    /// Shape, row-major.
    pub shape: Vec<usize>,
    /// First element in the flat buffer.
    pub offset: usize,
    /// Number of elements (product of `shape`).
    pub len: usize,
    /// Block index, `None` for embeddings and the final LayerNorm.
    pub layer: Option<usize>,
    /// Whether AdamW applies weight decay (2-D weights).
    pub decay: bool,
    /// How tensor parallelism would split it.
    pub tp_split: TpSplit,
}

impl ParamEntry {
    /// Element range in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }
}

/// Flat-buffer ranges of one block's tensors (absolute offsets).
#[derive(Debug, Clone)]
pub struct BlockRanges {
    /// ln1 weight (C).
    pub ln1_w: Range<usize>,
    /// ln1 bias (C).
    pub ln1_b: Range<usize>,
    /// qkv weight (3C, C).
    pub qkv_w: Range<usize>,
    /// qkv bias (3C).
    pub qkv_b: Range<usize>,
    /// attention output projection weight (C, C).
    pub attn_proj_w: Range<usize>,
    /// attention output projection bias (C).
    pub attn_proj_b: Range<usize>,
    /// ln2 weight (C).
    pub ln2_w: Range<usize>,
    /// ln2 bias (C).
    pub ln2_b: Range<usize>,
    /// MLP up projection weight (4C, C).
    pub fc_w: Range<usize>,
    /// MLP up projection bias (4C).
    pub fc_b: Range<usize>,
    /// MLP down projection weight (C, 4C).
    pub mlp_proj_w: Range<usize>,
    /// MLP down projection bias (C).
    pub mlp_proj_b: Range<usize>,
}

impl BlockRanges {
    /// The ranges of a block's tensors, `r(i)` giving the `i`-th in layout order
    /// (`BLOCK_TENSORS`).
    pub fn from_fn(r: impl Fn(usize) -> Range<usize>) -> Self {
        BlockRanges {
            ln1_w: r(0),
            ln1_b: r(1),
            qkv_w: r(2),
            qkv_b: r(3),
            attn_proj_w: r(4),
            attn_proj_b: r(5),
            ln2_w: r(6),
            ln2_b: r(7),
            fc_w: r(8),
            fc_b: r(9),
            mlp_proj_w: r(10),
            mlp_proj_b: r(11),
        }
    }
}

/// Per-block tensor table, in buffer order; shapes are in units of C.
const BLOCK_TENSORS: &[(&str, usize, usize, TpSplit)] = &[
    // suffix, rows (in units of C), cols (in units of C; 0 = a 1-D tensor), split
    ("ln1.weight", 1, 0, TpSplit::Replicated),
    ("ln1.bias", 1, 0, TpSplit::Replicated),
    ("attn.qkv.weight", 3, 1, TpSplit::Column),
    ("attn.qkv.bias", 3, 0, TpSplit::Column),
    ("attn.proj.weight", 1, 1, TpSplit::Row),
    ("attn.proj.bias", 1, 0, TpSplit::Replicated),
    ("ln2.weight", 1, 0, TpSplit::Replicated),
    ("ln2.bias", 1, 0, TpSplit::Replicated),
    ("mlp.fc.weight", 4, 1, TpSplit::Column),
    ("mlp.fc.bias", 4, 0, TpSplit::Column),
    ("mlp.proj.weight", 1, 4, TpSplit::Row),
    ("mlp.proj.bias", 1, 0, TpSplit::Replicated),
];

/// The layout table of a [`GptConfig`].
#[derive(Debug, Clone)]
pub struct ParamLayout {
    entries: Vec<ParamEntry>,
    n_layer: usize,
    /// Entries before block 0 (`wte`, `wpe` for GPT-2; `wte` for Llama).
    pre: usize,
    /// Tensors per block.
    per_block: usize,
    /// Offset of block 0.
    blocks_start: usize,
    /// Elements per block.
    block_len: usize,
    total: usize,
}

/// One tensor of a table: name (suffix within a block), shape, split.
type TensorSpec = (String, Vec<usize>, TpSplit);

/// The tensors before the blocks, of one block (suffixes) and after the blocks, in buffer order.
fn tables(config: &GptConfig) -> (Vec<TensorSpec>, Vec<TensorSpec>, Vec<TensorSpec>) {
    let (c, vp) = (config.n_embd, config.padded_vocab_size());
    let t = |name: &str, shape: Vec<usize>, split| (name.to_string(), shape, split);
    let Some(l) = &config.llama else {
        let pre = vec![t("wte", vec![vp, c], TpSplit::Vocab), t("wpe", vec![config.max_seq_len, c], TpSplit::Replicated)];
        let block = BLOCK_TENSORS
            .iter()
            .map(|&(suffix, rows, cols, split)| {
                let shape = if cols == 0 { vec![rows * c] } else { vec![rows * c, cols * c] };
                t(suffix, shape, split)
            })
            .collect();
        let post = vec![t("lnf.weight", vec![c], TpSplit::Replicated), t("lnf.bias", vec![c], TpSplit::Replicated)];
        return (pre, block, post);
    };
    let (hd, f) = (config.head_dim(), l.ffn_dim);
    let block = vec![
        t("attn_norm.weight", vec![c], TpSplit::Replicated),
        t("attn.q.weight", vec![config.n_head * hd, c], TpSplit::Column),
        t("attn.k.weight", vec![l.n_kv_head * hd, c], TpSplit::KvHeads),
        t("attn.v.weight", vec![l.n_kv_head * hd, c], TpSplit::KvHeads),
        t("attn.proj.weight", vec![c, config.n_head * hd], TpSplit::Row),
        t("mlp_norm.weight", vec![c], TpSplit::Replicated),
        t("mlp.gate_up.weight", vec![2 * f, c], TpSplit::Column),
        t("mlp.proj.weight", vec![c, f], TpSplit::Row),
    ];
    let mut post = vec![t("norm.weight", vec![c], TpSplit::Replicated)];
    if !l.tie_embeddings {
        post.push(t("lm_head.weight", vec![vp, c], TpSplit::Vocab));
    }
    (vec![t("wte", vec![vp, c], TpSplit::Vocab)], block, post)
}

impl ParamLayout {
    /// Builds the table for `config` (assumed validated).
    pub fn new(config: &GptConfig) -> Self {
        let (pre, block, post) = tables(config);
        let mut entries = Vec::new();
        let mut offset = 0;
        let mut push = |name: String, shape: Vec<usize>, layer, split| {
            let len = shape.iter().product();
            let decay = shape.len() == 2;
            entries.push(ParamEntry {
                name,
                shape,
                offset,
                len,
                layer,
                decay,
                tp_split: split,
            });
            offset += len;
        };
        for (name, shape, split) in &pre {
            push(name.clone(), shape.clone(), None, *split);
        }
        for l in 0..config.n_layer {
            for (suffix, shape, split) in &block {
                push(format!("h.{l}.{suffix}"), shape.clone(), Some(l), *split);
            }
        }
        for (name, shape, split) in &post {
            push(name.clone(), shape.clone(), None, *split);
        }
        let blocks_start: usize = entries[..pre.len()].iter().map(|e| e.len).sum();
        let block_len: usize = block.iter().map(|(_, s, _)| s.iter().product::<usize>()).sum();
        ParamLayout {
            entries,
            n_layer: config.n_layer,
            pre: pre.len(),
            per_block: block.len(),
            blocks_start,
            block_len,
            total: offset,
        }
    }

    /// All entries in buffer order.
    pub fn entries(&self) -> &[ParamEntry] {
        &self.entries
    }

    /// Number of parameters (length of the flat buffer).
    pub fn total_len(&self) -> usize {
        self.total
    }

    /// The entry called `name`.
    pub fn get(&self, name: &str) -> Option<&ParamEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// Flat range of the first tensor, `wte` (Vp, C).
    pub fn wte(&self) -> Range<usize> {
        self.entries[0].range()
    }

    /// Flat range of `wpe` (maxT, C) (GPT-2).
    pub fn wpe(&self) -> Range<usize> {
        self.entries[1].range()
    }

    /// Flat ranges of `lnf.weight` and `lnf.bias` (C each) (GPT-2).
    pub fn lnf(&self) -> (Range<usize>, Range<usize>) {
        let n = self.entries.len();
        (self.entries[n - 2].range(), self.entries[n - 1].range())
    }

    /// Contiguous flat range covering blocks `layers` (e.g. one pipeline stage's blocks).
    pub fn layers_range(&self, layers: Range<usize>) -> Range<usize> {
        assert!(
            layers.end <= self.n_layer,
            "layers {layers:?} beyond {} blocks",
            self.n_layer
        );
        self.blocks_start + layers.start * self.block_len..self.blocks_start + layers.end * self.block_len
    }

    /// Number of tensors in every block.
    pub fn block_tensor_count(&self) -> usize {
        self.per_block
    }

    /// Ranges of block `l`'s tensors (GPT-2).
    pub fn block(&self, l: usize) -> BlockRanges {
        let first = self.pre + l * self.per_block;
        let r = |i: usize| self.entries[first + i].range();
        BlockRanges::from_fn(r)
    }

    /// Maximal runs of equal decay flag, covering `0..total_len()` in order: what AdamW needs
    /// to apply decay element-wise over any offset range.
    pub fn decay_spans(&self) -> Vec<(Range<usize>, bool)> {
        let mut spans: Vec<(Range<usize>, bool)> = Vec::new();
        for e in &self.entries {
            match spans.last_mut() {
                Some((r, d)) if *d == e.decay => r.end = e.offset + e.len,
                _ => spans.push((e.range(), e.decay)),
            }
        }
        spans
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> GptConfig {
        GptConfig {
            n_layer: 3,
            n_head: 2,
            n_embd: 8,
            vocab_size: 20,
            max_seq_len: 5,
            llama: None,
        }
    }

    #[test]
    fn entries_tile_the_buffer_and_blocks_are_contiguous() {
        let lay = ParamLayout::new(&cfg());
        let mut next = 0;
        for e in lay.entries() {
            assert_eq!(e.offset, next, "{}", e.name);
            assert_eq!(e.len, e.shape.iter().product::<usize>());
            next += e.len;
        }
        assert_eq!(next, lay.total_len());
        let c = 8;
        // 12C^2 weights + 13C biases/LN per block.
        assert_eq!(lay.layers_range(0..1).len(), 12 * c * c + 13 * c);
        assert_eq!(
            lay.layers_range(1..3).start,
            lay.get("h.1.ln1.weight").unwrap().offset
        );
        assert_eq!(lay.layers_range(1..3).end, lay.get("lnf.weight").unwrap().offset);
        assert_eq!(
            lay.block(2).qkv_w,
            lay.get("h.2.attn.qkv.weight").unwrap().range()
        );
        assert_eq!(lay.get("h.0.mlp.proj.weight").unwrap().shape, vec![c, 4 * c]);
        assert_eq!(
            lay.total_len(),
            128 * c + 5 * c + 3 * (12 * c * c + 13 * c) + 2 * c
        );
    }

    #[test]
    fn decay_spans_cover_exactly_the_2d_weights() {
        let lay = ParamLayout::new(&cfg());
        let spans = lay.decay_spans();
        assert_eq!(spans.first().unwrap().0.start, 0);
        assert_eq!(spans.last().unwrap().0.end, lay.total_len());
        for e in lay.entries() {
            let (_, d) = spans.iter().find(|(r, _)| r.contains(&e.offset)).unwrap();
            assert_eq!(*d, e.shape.len() == 2, "{}", e.name);
        }
    }
}
