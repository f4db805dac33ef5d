//! Activation and scratch buffers of the device model ([`super::DeviceGpt`]), allocated once.
//!
//! A slot keeps everything the backward of one micro-batch through one chunk needs (the chunk's
//! input, every block's saved activations and, on the model's last chunk, the head's), so a
//! pipeline can hold several micro-batches between their forward and backward, in any order; the
//! scratch is shared by every backward and fully rewritten before it is read. Shapes: B*T rows,
//! R = rows of the residual stream held here (B*T/tp with sequence parallelism, else B*T),
//! C = n_embd, Cl = C/tp (this rank's heads), H = 4C/tp, Vl = Vp/tp (this rank's vocabulary rows).
//!
//! Recomputation ([`Recompute`]) trades compute for activation memory: a slot then keeps only
//! part of each block's activations, and the backward recomputes the rest, block by block, into
//! one set of work buffers that the whole model shares (`selective`: the attention core's
//! probabilities (B, NH/tp, T, T); `full`: everything but the block's output, from the block's
//! input). The recomputation runs the same kernels on the same inputs as the forward, so the
//! gradients are bit for bit those without it.

use serde::{Deserialize, Serialize};

use crate::device::ipc::alloc_shareable;
use crate::device::{ops_vocab, Device, DeviceBuffer};
use crate::error::Result;
use crate::model::GptConfig;

/// This rank's sizes of one chunk, in elements: what the executor allocates, and what a planner
/// (`plan`) counts for a rank it does not build.
#[derive(Debug, Clone, Copy)]
pub struct ActDims {
    /// Rows of a micro-batch, B*T.
    pub bt: usize,
    /// Rows of the residual stream held here (R).
    pub rows: usize,
    /// Sequence parallelism: the residual stream is split into row blocks over TP.
    pub sp: bool,
    /// Width C.
    pub c: usize,
    /// This rank's attention width C/tp (Cl).
    pub cl: usize,
    /// This rank's MLP width 4C/tp (H; Llama: F/tp, the SwiGLU output).
    pub hl: usize,
    /// Width of this rank's qkv rows: 3Cl (Llama: (NH + 2 NKV) hd / tp, a shared KV head counted
    /// once).
    pub qkv: usize,
    /// Width of this rank's MLP up-projection output: H (Llama: 2F/tp, `[gate | up]`).
    pub fc: usize,
    /// This rank's vocabulary rows Vp/tp (Vl).
    pub vl: usize,
    /// Elements of one block's attention probabilities (B, NH/tp, T, T).
    pub att: usize,
    /// Whether a TP group all-reduces some buffers in place (they are then shareable, so GPUs of
    /// one node reduce them through IPC rather than staged through the host: CUDA pool memory
    /// cannot be exported).
    pub tp: bool,
    /// What the backward recomputes instead of keeping it in the slots.
    pub recompute: Recompute,
}

/// `train.recompute`: which block activations the backward recomputes instead of keeping them
/// from the forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep every activation.
    #[default]
    None,
    /// Recompute the attention core (scores and softmax) from the kept q, k, v: drops the
    /// (B, NH/tp, T, T) probabilities, the one term that grows with T².
    Selective,
    /// Keep only each block's output (its successor's input) and recompute the whole block's
    /// forward before its backward.
    Full,
}

impl Recompute {
    /// The name as written in a job file.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
    }

    /// Whether a slot keeps `f` from the forward.
    fn keeps(self, f: Field) -> bool {
        match self {
            Recompute::None => true,
            Recompute::Selective => f != Field::Att,
            Recompute::Full => f == Field::Residual3,
        }
    }

    /// Whether the backward recomputes `f` into the model's shared work buffers.
    fn recomputes(self, f: Field) -> bool {
        match self {
            Recompute::None => false,
            Recompute::Selective => matches!(f, Field::Att | Field::Atty),
            Recompute::Full => true,
        }
    }
}

/// The buffers of [`BlockActs`], for the tables of what is kept and what is recomputed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Ln1,
    Ln1Mean,
    Ln1Rstd,
    Qkv,
    Atty,
    Att,
    Residual2,
    Ln2,
    Ln2Mean,
    Ln2Rstd,
    Fch,
    FchGelu,
    Residual3,
}

const FIELDS: [Field; 13] = [
    Field::Ln1,
    Field::Ln1Mean,
    Field::Ln1Rstd,
    Field::Qkv,
    Field::Atty,
    Field::Att,
    Field::Residual2,
    Field::Ln2,
    Field::Ln2Mean,
    Field::Ln2Rstd,
    Field::Fch,
    Field::FchGelu,
    Field::Residual3,
];

impl Field {
    /// f32 elements of the buffer.
    fn len(self, d: &ActDims) -> usize {
        match self {
            Field::Ln1 | Field::Ln2 => d.bt * d.c,
            Field::Ln1Mean | Field::Ln1Rstd | Field::Ln2Mean | Field::Ln2Rstd => d.rows,
            Field::Qkv => d.bt * d.qkv,
            Field::Atty => d.bt * d.cl,
            Field::Att => d.att,
            Field::Residual2 | Field::Residual3 => d.rows * d.c,
            Field::Fch => d.bt * d.fc,
            Field::FchGelu => d.bt * d.hl,
        }
    }
}

impl ActDims {
    /// The sizes of a rank of `tp`-way tensor parallelism (sequence parallel if `sp` and
    /// `tp > 1`) for micro-batches of `b` x `t` tokens of `config`.
    pub fn of_rank(config: &GptConfig, b: usize, t: usize, tp: usize, sp: bool) -> ActDims {
        let (bt, c, tp) = (b * t, config.n_embd, tp.max(1));
        let sp = sp && tp > 1;
        let (hl, qkv, fc) = match &config.llama {
            None => (4 * c / tp, 3 * c / tp, 4 * c / tp),
            Some(l) => {
                let kv_heads = (l.n_kv_head / tp).max(1);
                (l.ffn_dim / tp, c / tp + 2 * kv_heads * config.head_dim(), 2 * l.ffn_dim / tp)
            }
        };
        ActDims {
            bt,
            rows: if sp { bt / tp } else { bt },
            sp,
            c,
            cl: c / tp,
            hl,
            qkv,
            fc,
            vl: config.padded_vocab_size() / tp,
            att: b * (config.n_head / tp) * t * t,
            tp: tp > 1,
            recompute: Recompute::None,
        }
    }

    /// f32 elements of the work buffers the backward recomputes into (one set per model).
    pub fn recompute_elements(&self) -> usize {
        BlockActs::elements(self, |f| self.recompute.recomputes(f))
    }

    /// f32 elements of one micro-batch's slot through a chunk of `blocks` blocks (with the
    /// embedding's token ids if `embeds`, the head's activations if `ends`).
    pub fn slot_elements(&self, blocks: usize, embeds: bool, ends: bool) -> usize {
        SlotActs::elements(self, blocks, embeds, ends)
    }

    /// f32 elements of the scratch every backward shares (`head`: the rank computes the logits;
    /// `t`: sequence length).
    pub fn scratch_elements(&self, head: bool, t: usize) -> usize {
        Scratch::elements(self, head, t)
    }

    fn f32(dev: &Device, elems: usize) -> Result<DeviceBuffer> {
        dev.alloc(elems * 4)
    }

    /// A buffer the TP group reduces in place or reads from (the input of a collective).
    fn reduced(&self, dev: &Device, elems: usize) -> Result<DeviceBuffer> {
        if self.tp {
            alloc_shareable(dev, elems * 4)
        } else {
            Self::f32(dev, elems)
        }
    }
}

/// Activations of one block, kept from forward for backward.
pub(super) struct BlockActs {
    pub ln1: DeviceBuffer,       // (B*T, C) all rows (gathered under SP)
    pub ln1_mean: DeviceBuffer,  // (R)
    pub ln1_rstd: DeviceBuffer,  // (R)
    pub qkv: DeviceBuffer,       // (B*T, 3Cl) (Llama: after RoPE)
    pub atty: DeviceBuffer,      // (B*T, Cl)
    pub att: DeviceBuffer,       // (B, NH/tp, T, T)
    pub residual2: DeviceBuffer, // (R, C)
    pub ln2: DeviceBuffer,       // (B*T, C) all rows (gathered under SP)
    pub ln2_mean: DeviceBuffer,  // (R)
    pub ln2_rstd: DeviceBuffer,  // (R)
    pub fch: DeviceBuffer,       // (B*T, H) (Llama: (B*T, 2F/tp) [gate | up])
    pub fch_gelu: DeviceBuffer,  // (B*T, H)
    pub residual3: DeviceBuffer, // (R, C)
}

impl BlockActs {
    /// What a slot keeps of one block (everything without recomputation).
    fn new(dev: &Device, d: &ActDims) -> Result<Self> {
        Self::alloc(dev, d, |f| d.recompute.keeps(f))
    }

    /// The model's work buffers that the backward recomputes into; `None` without recomputation.
    pub(super) fn work(dev: &Device, d: &ActDims) -> Result<Option<Self>> {
        match d.recompute {
            Recompute::None => Ok(None),
            r => Self::alloc(dev, d, |f| r.recomputes(f)).map(Some),
        }
    }

    /// The buffers `keep` selects at full size, the others empty.
    fn alloc(dev: &Device, d: &ActDims, keep: impl Fn(Field) -> bool) -> Result<Self> {
        let f = |field: Field| ActDims::f32(dev, if keep(field) { field.len(d) } else { 0 });
        Ok(BlockActs {
            ln1: f(Field::Ln1)?,
            ln1_mean: f(Field::Ln1Mean)?,
            ln1_rstd: f(Field::Ln1Rstd)?,
            qkv: f(Field::Qkv)?,
            atty: f(Field::Atty)?,
            att: f(Field::Att)?,
            residual2: f(Field::Residual2)?,
            ln2: f(Field::Ln2)?,
            ln2_mean: f(Field::Ln2Mean)?,
            ln2_rstd: f(Field::Ln2Rstd)?,
            fch: f(Field::Fch)?,
            fch_gelu: f(Field::FchGelu)?,
            residual3: f(Field::Residual3)?,
        })
    }

    /// f32 elements of the buffers `keep` selects.
    fn elements(d: &ActDims, keep: impl Fn(Field) -> bool) -> usize {
        FIELDS.iter().filter(|&&f| keep(f)).map(|f| f.len(d)).sum()
    }
}

/// The head's activations (the model's last chunk only).
pub(super) struct HeadActs {
    pub targets: DeviceBuffer,  // (B*T) u32
    pub lnf: DeviceBuffer,      // (B*T, C) all rows (gathered under SP)
    pub lnf_mean: DeviceBuffer, // (R)
    pub lnf_rstd: DeviceBuffer, // (R)
    pub logits: DeviceBuffer,   // (B*T, Vl)
    pub losses: DeviceBuffer,   // (B*T)
    pub lse: DeviceBuffer,      // (B*T)
    pub ce_max: DeviceBuffer,   // (B*T) under TP: the group's row max (else empty)
    pub ce_stats: DeviceBuffer, // (2*B*T) under TP: the group's sum-exp | target logit (else empty)
}

impl HeadActs {
    fn new(dev: &Device, d: &ActDims) -> Result<Self> {
        let f = |n: usize| ActDims::f32(dev, n);
        let bt = d.bt;
        Ok(HeadActs {
            targets: dev.alloc(bt * 4)?,
            lnf: f(bt * d.c)?,
            lnf_mean: f(d.rows)?,
            lnf_rstd: f(d.rows)?,
            logits: f(bt * d.vl)?,
            losses: f(bt)?,
            lse: f(bt)?,
            ce_max: d.reduced(dev, if d.tp { bt } else { 0 })?,
            ce_stats: d.reduced(dev, if d.tp { 2 * bt } else { 0 })?,
        })
    }

    fn elements(d: &ActDims) -> usize {
        let ce = if d.tp { 3 * d.bt } else { 0 };
        d.bt * (d.c + d.vl) + 3 * d.bt + 2 * d.rows + ce
    }
}

/// One micro-batch's activations through one chunk.
pub(super) struct SlotActs {
    /// The token index of the micro-batch (`ops_vocab::token_index`: the ids (B*T) first), u32: read by
    /// the embedding forward and backward (embedding chunk; else empty).
    pub tokens: DeviceBuffer,
    /// Input of the chunk's first block (R, C): the embedding output or the received hidden.
    pub input: DeviceBuffer,
    /// One per block of the chunk.
    pub blocks: Vec<BlockActs>,
    /// The model's last chunk.
    pub head: Option<HeadActs>,
    /// Whether a forward ran since this slot's last backward.
    pub forward_done: bool,
}

impl SlotActs {
    pub(super) fn new(dev: &Device, d: &ActDims, blocks: usize, embeds: bool, ends: bool) -> Result<Self> {
        Ok(SlotActs {
            tokens: dev.alloc(if embeds { 4 * ops_vocab::token_index_len(d.bt) } else { 0 })?,
            // Without SP the embedding's output is summed over TP in place.
            input: if embeds && !d.sp { d.reduced(dev, d.rows * d.c)? } else { ActDims::f32(dev, d.rows * d.c)? },
            blocks: (0..blocks).map(|_| BlockActs::new(dev, d)).collect::<Result<_>>()?,
            head: if ends { Some(HeadActs::new(dev, d)?) } else { None },
            forward_done: false,
        })
    }

    /// f32 elements of a slot (u32 ids count as one each).
    pub(super) fn elements(d: &ActDims, blocks: usize, embeds: bool, ends: bool) -> usize {
        let ids = if embeds { d.bt } else { 0 };
        let head = if ends { HeadActs::elements(d) } else { 0 };
        ids + d.rows * d.c + blocks * BlockActs::elements(d, |f| d.recompute.keeps(f)) + head
    }

    /// The chunk's output (R, C): the last block's residual stream (the input without blocks).
    pub(super) fn output(&self) -> &DeviceBuffer {
        self.blocks.last().map_or(&self.input, |b| &b.residual3)
    }
}

/// Scratch shared by every slot (each buffer is written before it is read). The sequence-parallel
/// buffers are empty without SP.
pub(super) struct Scratch {
    pub branch: DeviceBuffer,    // (R, C) sub-block output before the residual add
    pub dlogits: DeviceBuffer,   // (B*T, Vl) (a model's last chunk only, else empty)
    pub dres: DeviceBuffer,      // (R, C) gradient of the residual stream
    pub dln: DeviceBuffer,       // (R, C) gradient of a LayerNorm output
    pub datty: DeviceBuffer,     // (B*T, Cl)
    pub dqkv: DeviceBuffer,      // (B*T, 3Cl)
    pub dpre: DeviceBuffer,      // (B, NH/tp, T, T)
    pub dfch_gelu: DeviceBuffer, // (B*T, H)
    pub dfch: DeviceBuffer,      // (B*T, H)
    /// SP: a LayerNorm's output on the held rows before the gather (R, C).
    pub ln: DeviceBuffer,
    /// SP: a rank's partial product over its shard before the reduce-scatter (B*T, C).
    pub partial: DeviceBuffer,
    /// SP: d(residual stream) gathered over all rows (B*T, C).
    pub full: DeviceBuffer,
    /// SP: one micro-batch's replicated-tensor gradients packed for one TP all-reduce:
    /// max(6C for a block, T*C for wpe).
    pub repl: DeviceBuffer,
    /// SP: the six (C) replicated-gradient parts of a block (ln1 w, b, attn.proj b, ln2 w, b,
    /// mlp.proj b; the final LayerNorm uses the first two).
    pub parts: Vec<DeviceBuffer>,
}

impl Scratch {
    pub(super) fn new(dev: &Device, d: &ActDims, head: bool, t: usize) -> Result<Self> {
        let f = |n: usize| ActDims::f32(dev, n);
        let (bt, r, c) = (d.bt, d.rows, d.c);
        let sp = |n: usize| if d.sp { n } else { 0 };
        Ok(Scratch {
            branch: if d.sp { f(r * c)? } else { d.reduced(dev, bt * c)? },
            dlogits: f(if head { bt * d.vl } else { 0 })?,
            // Under SP d(residual) is gathered (read by the peers); else d(LayerNorm output) is
            // summed over TP in place.
            dres: if d.sp { d.reduced(dev, r * c)? } else { f(r * c)? },
            dln: if d.sp { f(r * c)? } else { d.reduced(dev, bt * c)? },
            datty: f(bt * d.cl)?,
            dqkv: f(bt * d.qkv)?,
            dpre: f(d.att)?,
            dfch_gelu: f(bt * d.hl)?,
            dfch: f(bt * d.fc)?,
            ln: d.reduced(dev, sp(r * c))?,
            partial: d.reduced(dev, sp(bt * c))?,
            full: f(sp(bt * c))?,
            repl: d.reduced(dev, sp((6 * c).max(t * c)))?,
            parts: (0..sp(6)).map(|_| f(c)).collect::<Result<_>>()?,
        })
    }

    pub(super) fn elements(d: &ActDims, head: bool, t: usize) -> usize {
        let dlogits = if head { d.bt * d.vl } else { 0 };
        let sp = if d.sp { d.rows * d.c + 2 * d.bt * d.c + (6 * d.c).max(t * d.c) + 6 * d.c } else { 0 };
        d.rows * 3 * d.c + d.bt * (d.cl + d.qkv + d.hl + d.fc) + dlogits + d.att + sp
    }
}
