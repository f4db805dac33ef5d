//! Per-micro-batch activations and shared backward scratch of a [`super::stage::Stage`].
//!
//! A slot keeps everything the backward of one micro-batch through one chunk needs, so a pipeline
//! can hold several micro-batches between their forward and backward; the scratch is reused by
//! every backward. Shapes use R = rows of the residual stream held by this rank (B*T/tp under
//! sequence parallelism, else B*T) and L = blocks of the chunk (a stage has one slot set per
//! chunk). Everything is allocated once at construction.

use super::activations::slab;
use super::attention::{attention_scratch_len, AttnShape};

/// Sizes of one stage at one TP rank.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    /// Micro-batch size (B) and sequence length (T).
    pub(super) b: usize,
    pub(super) t: usize,
    /// B * T.
    pub(super) bt: usize,
    /// Rows of the residual stream held here: B*T/tp with sequence parallelism, else B*T.
    pub(super) rows: usize,
    /// Global index of the first held row.
    pub(super) row0: usize,
    /// Embedding width (C).
    pub(super) c: usize,
    /// Attention width of the local heads (C / tp).
    pub(super) cl: usize,
    /// Local MLP hidden width (4C / tp).
    pub(super) hl: usize,
    /// Local heads (NH / tp) and head width.
    pub(super) nhl: usize,
    pub(super) hs: usize,
    /// Real vocabulary (V), local vocab rows (Vp / tp), first id of the shard, real ids in it.
    pub(super) v: usize,
    pub(super) vl: usize,
    pub(super) vstart: usize,
    pub(super) vreal: usize,
    /// Number of blocks in the chunk.
    pub(super) nl: usize,
    /// Whether sequence parallelism splits the residual stream's rows over TP.
    pub(super) sp: bool,
}

impl Dims {
    pub(super) fn attn(&self) -> AttnShape {
        AttnShape {
            b: self.b,
            t: self.t,
            nh: self.nhl,
            hs: self.hs,
        }
    }

    pub(super) fn att_len(&self) -> usize {
        self.b * self.nhl * self.t * self.t
    }
}

/// One micro-batch's forward activations through one chunk (L = blocks of the chunk, R = held
/// rows).
pub(super) struct SlotActs {
    /// Tokens (B, T) (embedding chunk) and targets (B, T) (the model's last chunk).
    pub(super) tokens: Vec<u32>,
    pub(super) targets: Vec<u32>,
    /// Input of the chunk's first block (R, C): the embedding output or the received hidden.
    pub(super) input: Vec<f32>,
    /// ln1 / ln2 row statistics (L, R).
    pub(super) ln1_mean: Vec<f32>,
    pub(super) ln1_rstd: Vec<f32>,
    pub(super) ln2_mean: Vec<f32>,
    pub(super) ln2_rstd: Vec<f32>,
    /// ln1 / ln2 outputs over all rows, gathered under SP (L, B*T, C).
    pub(super) ln1: Vec<f32>,
    pub(super) ln2: Vec<f32>,
    /// Local heads' q, k, v (L, B*T, 3C/tp), their output (L, B*T, C/tp), probabilities
    /// (L, B, NH/tp, T, T).
    pub(super) qkv: Vec<f32>,
    pub(super) atty: Vec<f32>,
    pub(super) att: Vec<f32>,
    /// Residual stream after attention and after the MLP (L, R, C).
    pub(super) residual2: Vec<f32>,
    pub(super) residual3: Vec<f32>,
    /// Local MLP hidden before and after GELU (L, B*T, 4C/tp).
    pub(super) fch: Vec<f32>,
    pub(super) fch_gelu: Vec<f32>,
    /// The model's last chunk: lnf output over all rows (B*T, C), its statistics (R), local logits
    /// (B*T, Vp/tp) and the global log-sum-exp per row (B*T).
    pub(super) lnf: Vec<f32>,
    pub(super) lnf_mean: Vec<f32>,
    pub(super) lnf_rstd: Vec<f32>,
    pub(super) logits: Vec<f32>,
    pub(super) lse: Vec<f32>,
    /// Whether a forward ran since this slot's last backward.
    pub(super) forward_done: bool,
}

impl SlotActs {
    pub(super) fn new(d: &Dims, embeds: bool, ends: bool) -> Self {
        let (l, r, bt, c) = (d.nl, d.rows, d.bt, d.c);
        let z = |n: usize| vec![0f32; n];
        let zl = |n: usize| if ends { vec![0f32; n] } else { Vec::new() };
        SlotActs {
            tokens: vec![0; if embeds { bt } else { 0 }],
            targets: vec![0; if ends { bt } else { 0 }],
            input: z(r * c),
            ln1_mean: z(l * r),
            ln1_rstd: z(l * r),
            ln2_mean: z(l * r),
            ln2_rstd: z(l * r),
            ln1: z(l * bt * c),
            ln2: z(l * bt * c),
            qkv: z(l * bt * 3 * d.cl),
            atty: z(l * bt * d.cl),
            att: z(l * d.att_len()),
            residual2: z(l * r * c),
            residual3: z(l * r * c),
            fch: z(l * bt * d.hl),
            fch_gelu: z(l * bt * d.hl),
            lnf: zl(bt * c),
            lnf_mean: zl(r),
            lnf_rstd: zl(r),
            logits: zl(bt * d.vl),
            lse: zl(bt),
            forward_done: false,
        }
    }

    /// Output of the chunk's last block (R, C) (its input when the chunk has no blocks).
    pub(super) fn hidden_out(&self, d: &Dims) -> &[f32] {
        match d.nl {
            0 => &self.input,
            n => slab(&self.residual3, n - 1, d.rows * d.c),
        }
    }

    pub(super) fn num_elements(&self) -> usize {
        let bufs = [
            &self.input,
            &self.ln1_mean,
            &self.ln1_rstd,
            &self.ln2_mean,
            &self.ln2_rstd,
            &self.ln1,
            &self.ln2,
            &self.qkv,
            &self.atty,
            &self.att,
            &self.residual2,
            &self.residual3,
            &self.fch,
            &self.fch_gelu,
            &self.lnf,
            &self.lnf_mean,
            &self.lnf_rstd,
            &self.logits,
            &self.lse,
        ];
        bufs.iter().map(|b| b.len()).sum()
    }
}

/// Scratch shared by all slots; every buffer is (re)written before it is read.
pub(super) struct Scratch {
    /// A LayerNorm's output on the held rows before the gather (R, C).
    pub(super) ln: Vec<f32>,
    /// A row-parallel linear's reduced output on the held rows (R, C).
    pub(super) branch: Vec<f32>,
    /// A rank's partial sum over its shard, before the TP reduction (B*T, C).
    pub(super) partial: Vec<f32>,
    /// d(residual) gathered over all rows (B*T, C).
    pub(super) full: Vec<f32>,
    /// d(residual stream) on the held rows (R, C), d(LayerNorm output) (R, C).
    pub(super) dres: Vec<f32>,
    pub(super) dln: Vec<f32>,
    /// d attention output (B*T, C/tp), d qkv (B*T, 3C/tp), d MLP hidden (B*T, 4C/tp) x2.
    pub(super) datty: Vec<f32>,
    pub(super) dqkv: Vec<f32>,
    pub(super) dfch_gelu: Vec<f32>,
    pub(super) dfch: Vec<f32>,
    /// attention backward rows (cores, T).
    pub(super) datt_row: Vec<f32>,
    /// d local logits (B*T, Vp/tp).
    pub(super) dlogits: Vec<f32>,
    /// Cross-entropy row statistics: max | sum-exp | target logit (3, B*T).
    pub(super) ce: Vec<f32>,
    /// One micro-batch's gradients of replicated tensors before the SP all-reduce:
    /// max(6C for a block, 2C for lnf, T*C for wpe).
    pub(super) repl: Vec<f32>,
}

impl Scratch {
    pub(super) fn new(d: &Dims) -> Self {
        let (r, bt, c) = (d.rows, d.bt, d.c);
        let z = |n: usize| vec![0f32; n];
        Scratch {
            ln: z(r * c),
            branch: z(r * c),
            partial: z(bt * c),
            full: z(bt * c),
            dres: z(r * c),
            dln: z(r * c),
            datty: z(bt * d.cl),
            dqkv: z(bt * 3 * d.cl),
            dfch_gelu: z(bt * d.hl),
            dfch: z(bt * d.hl),
            datt_row: z(attention_scratch_len(d.t)),
            dlogits: z(bt * d.vl),
            ce: z(3 * bt),
            repl: z((6 * c).max(d.t * c)),
        }
    }
}
