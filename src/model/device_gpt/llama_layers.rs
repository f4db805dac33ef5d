//! Llama's layers in the one executor: the same block skeleton, collectives and activation slots
//! as GPT-2's (`layers.rs`), with RMSNorm for LayerNorm, no biases, rotary embeddings on q and k
//! right after the qkv projection (RoPE backward on dq, dk right after the attention backward),
//! grouped-query attention, SwiGLU for GELU, an embedding without positions, and the head's own
//! `lm_head` unless tied.
//!
//! The q, k and v weights are separate tensors (so that TP splits k and v by KV head, or shares a
//! KV head among ranks); their products write (P, B*T, W) part-major staging (W = this rank's
//! KV width, P = its query heads per KV head + 2) that `merge_heads` interleaves into the qkv rows
//! `[q | k | v]` the attention reads, and the backward splits dqkv the same way.
//!
//! With fewer KV heads than TP ranks, the ranks sharing a KV head each compute the part of its k
//! and v weight gradients that their query heads cause; per micro-batch those parts are summed
//! over the sharing ranks (one all-reduce of a buffer with a slot per KV head) before being added
//! to the gradients, so every sharing rank holds the exact gradient, as a replicated tensor does.
//! The input gradient needs nothing extra: it is summed over TP like any column-parallel one.

use super::layers::{add_replicated, group, pair, row_parallel_forward, sum_input_grad, BlockCtx, Rows};
use super::{DeviceGpt, Widths};
use crate::device::cpu::attention::AttnShape;
use crate::device::cpu::rope::RopeShape;
use crate::device::ipc::alloc_shareable;
use crate::device::ops_llama::{self, rope_table, Llama3Scaling, RmsNormBackward, RmsNormForward};
use crate::device::{ops, ops_attention, ops_vocab, Device, DeviceBuffer};
use crate::error::Result;
use crate::model::device_acts::{ActDims, BlockActs, Scratch};
use crate::model::device_linear::Weight;
use crate::model::device_tp::DeviceTp;
use crate::model::GptConfig;

/// Llama's per-model device buffers.
pub(super) struct LlamaWork {
    /// RoPE tables (T, hd/2).
    cos: DeviceBuffer,
    sin: DeviceBuffer,
    /// (P, B*T, W) q/k/v parts (forward) or their gradients (backward).
    stage: DeviceBuffer,
    /// RMSNorm epsilon.
    pub(super) eps: f32,
    /// With fewer KV heads than TP ranks: the sums of the shared KV heads' gradients.
    share: Option<KvShare>,
}

/// The buffers summing a shared KV head's k and v weight gradients over its ranks.
struct KvShare {
    /// This rank's KV head.
    head: usize,
    /// (NKV, 2, hd*C): one slot per KV head, k then v (shareable: TP all-reduces it).
    sum: DeviceBuffer,
    /// This micro-batch's k and v weight gradients (hd*C each).
    dk: DeviceBuffer,
    dv: DeviceBuffer,
}

impl LlamaWork {
    /// The work of `config` for (B, T) batches on TP rank `tp_rank` of `tp_size` (None for GPT-2).
    pub(super) fn new(dev: &Device, config: &GptConfig, (b, t): (usize, usize), d: &ActDims, (tp_rank, tp_size): (usize, usize)) -> Result<Option<Self>> {
        let Some(l) = &config.llama else { return Ok(None) };
        let (hd, c) = (config.head_dim(), config.n_embd);
        let scaling = l.rope_scaling().map(|s| Llama3Scaling {
            factor: s.factor,
            low_freq_factor: s.low_freq_factor,
            high_freq_factor: s.high_freq_factor,
            original_max_position: s.original_max_position,
        });
        let (cos_h, sin_h) = rope_table(hd, t, l.rope_theta, scaling);
        let mut cos = dev.alloc(cos_h.len() * 4)?;
        let mut sin = dev.alloc(sin_h.len() * 4)?;
        dev.copy_to_device(&mut cos, &cos_h)?;
        dev.copy_to_device(&mut sin, &sin_h)?;
        let nkv = l.n_kv_head;
        let share = if nkv < tp_size {
            let n = hd * c;
            Some(KvShare {
                head: tp_rank / (tp_size / nkv),
                sum: alloc_shareable(dev, nkv * 2 * n * 4)?,
                dk: dev.alloc(n * 4)?,
                dv: dev.alloc(n * 4)?,
            })
        } else {
            None
        };
        let stage = dev.alloc(b * t * d.qkv * 4)?;
        Ok(Some(LlamaWork { cos, sin, stage, eps: l.norm_eps as f32, share }))
    }

    /// f32 elements held (for the memory estimate).
    pub(super) fn elements(&self) -> usize {
        let share = self.share.as_ref().map_or(0, |s| (s.sum.len() + s.dk.len() + s.dv.len()) / 4);
        (self.cos.len() + self.sin.len() + self.stage.len()) / 4 + share
    }
}

/// RMSNorm of the held rows `x` (R, C) into `full` (B*T, C): directly without SP, else into
/// `s.ln` and all-gathered.
#[allow(clippy::too_many_arguments)]
pub(super) fn rms_gathered(
    dev: &Device,
    tp: &mut Option<DeviceTp>,
    rows: Rows,
    s: &mut Scratch,
    full: &mut DeviceBuffer,
    rstd: &mut DeviceBuffer,
    x: &DeviceBuffer,
    w: &DeviceBuffer,
    (c, eps): (usize, f32),
) -> Result<()> {
    if !rows.sp {
        return ops_llama::rmsnorm_forward(dev, RmsNormForward { out: full, rstd, inp: x, weight: w }, rows.rows, c, eps);
    }
    ops_llama::rmsnorm_forward(dev, RmsNormForward { out: &mut s.ln, rstd, inp: x, weight: w }, rows.rows, c, eps)?;
    group(tp).gather_rows(dev, &s.ln, full, rows.bt * c)
}

/// RMSNorm backward on the held rows from d(output) in `s.dln`: d(input) added into `s.dres`, the
/// weight gradient into entry `entry` (no SP) or `s.parts[part]` (SP).
#[allow(clippy::too_many_arguments)]
pub(super) fn rms_backward(
    dev: &Device,
    rows: Rows,
    s: &mut Scratch,
    g: &mut [DeviceBuffer],
    (entry, part): (usize, usize),
    x: &DeviceBuffer,
    weight: &DeviceBuffer,
    rstd: &DeviceBuffer,
    c: usize,
) -> Result<()> {
    let dw = if rows.sp { &mut s.parts[part] } else { &mut g[entry] };
    let bufs = RmsNormBackward { dinp: &mut s.dres, dweight: dw, dout: &s.dln, inp: x, weight, rstd };
    ops_llama::rmsnorm_backward(dev, bufs, rows.rows, c)
}

/// Parts per KV width of this rank's q (its query heads per KV head held) and the staging's
/// shape for `merge_heads` / `split_heads`: (1, B*T, 1 head of W).
fn stage_shape(w: Widths, hd: usize, bt: usize) -> (usize, usize, AttnShape) {
    let kvw = w.nkvl * hd;
    (w.cl / kvw, kvw, AttnShape::mha(1, bt, 1, kvw))
}

/// One Llama block's forward from its input `x` (R, C) into `a` (see `layers::block_compute`).
pub(super) fn block_compute(cx: &mut BlockCtx<'_>, x: &DeviceBuffer, a: &mut BlockActs, att: Option<&mut DeviceBuffer>) -> Result<()> {
    let (c, rows, bt, r) = (cx.c, cx.rows, cx.rows.bt, cx.rows.rows);
    let Widths { hl, cl, .. } = cx.w;
    let [an, q, k, v, o, mn, gu, dn, ..] = cx.e;
    let (dev, p, shape) = (cx.dev, cx.p, cx.shape);
    let w = |i: usize| Weight { f32: &p[i], bf16: cx.p16[i].as_ref() };
    let lw = cx.llama.as_deref_mut().expect("a Llama block");
    let (tp, s, linear) = (&mut *cx.tp, &mut *cx.s, &mut *cx.linear);
    rms_gathered(dev, tp, rows, s, &mut a.ln1, &mut a.ln1_rstd, x, &p[an], (c, lw.eps))?;
    let (qp, kvw, st) = stage_shape(cx.w, shape.hs, bt);
    linear.forward_stacked(dev, &mut lw.stage, &a.ln1, &[(w(q), qp), (w(k), 1), (w(v), 1)], (bt, c, kvw))?;
    ops_attention::merge_heads(dev, &mut a.qkv, &lw.stage, st, qp + 2, false)?;
    ops_llama::rope_forward(dev, &mut a.qkv, &lw.cos, &lw.sin, rope_shape(shape))?;
    let att = match att {
        Some(buf) => buf,
        None => &mut a.att,
    };
    ops_attention::attention_forward(dev, &mut a.atty, att, &a.qkv, cx.attn, shape)?;
    row_parallel_forward(dev, tp, linear, rows, s, &a.atty, (w(o), None), (cl, c))?;
    ops::residual_forward(dev, &mut a.residual2, x, &s.branch, r * c)?;
    rms_gathered(dev, tp, rows, s, &mut a.ln2, &mut a.ln2_rstd, &a.residual2, &p[mn], (c, lw.eps))?;
    linear.forward(dev, &mut a.fch, &a.ln2, w(gu), None, bt, c, 2 * hl)?;
    ops_llama::swiglu_forward(dev, &mut a.fch_gelu, &a.fch, bt, hl)?;
    row_parallel_forward(dev, tp, linear, rows, s, &a.fch_gelu, (w(dn), None), (hl, c))?;
    ops::residual_forward(dev, &mut a.residual3, &a.residual2, &s.branch, r * c)
}

fn rope_shape(s: AttnShape) -> RopeShape {
    RopeShape { b: s.b, t: s.t, nh: s.nh, nkv: s.nkv, hd: s.hs }
}

/// One Llama block's backward (see `layers::block_backward`): `s.dres` holds d(block output)
/// (R, C) on entry, d(block input) on exit.
pub(super) fn block_backward(cx: &mut BlockCtx<'_>, x: &DeviceBuffer, a: &BlockActs, att: &DeviceBuffer) -> Result<()> {
    let (c, rows, bt) = (cx.c, cx.rows, cx.rows.bt);
    let Widths { hl, cl, .. } = cx.w;
    let [an, q, k, v, o, mn, gu, dn, ..] = cx.e;
    let (dev, p, shape) = (cx.dev, cx.p, cx.shape);
    let w = |i: usize| Weight { f32: &p[i], bf16: cx.p16[i].as_ref() };
    let lw = cx.llama.as_deref_mut().expect("a Llama block");
    let (tp, s, linear, attn, g) = (&mut *cx.tp, &mut *cx.s, &mut *cx.linear, &mut *cx.attn, &mut *cx.g);
    if rows.sp {
        for part in &mut s.parts[..2] {
            ops::fill_zero(dev, part, c)?;
        }
    }
    // MLP: d(residual2) = dres + d through the MLP norm of the SwiGLU branch.
    row_parallel_backward(dev, tp, linear, rows, s, (&mut g[dn], w(dn)), &a.fch_gelu, (hl, c), Dst::Mlp)?;
    ops_llama::swiglu_backward(dev, &mut s.dfch, &s.dfch_gelu, &a.fch, bt, hl)?;
    let dinp = if rows.sp { &mut s.partial } else { &mut s.dln };
    linear.backward(dev, dinp, &mut g[gu], None, &s.dfch, &a.ln2, w(gu), (bt, c, 2 * hl))?;
    sum_input_grad(dev, tp, rows, s, c)?;
    rms_backward(dev, rows, s, g, (mn, 1), &a.residual2, &p[mn], &a.ln2_rstd, c)?;
    // Attention: d(block input) = d(residual2) + d through the attention norm.
    row_parallel_backward(dev, tp, linear, rows, s, (&mut g[o], w(o)), &a.atty, (cl, c), Dst::Attn)?;
    ops::fill_zero(dev, &mut s.dqkv, bt * (cl + 2 * cx.w.nkvl * shape.hs))?;
    let bufs = ops_attention::AttentionBackward { dqkv: &mut s.dqkv, dpre: &mut s.dpre, dout: &s.datty, qkv: &a.qkv, att };
    ops_attention::attention_backward(dev, bufs, attn, shape)?;
    ops_llama::rope_backward(dev, &mut s.dqkv, &lw.cos, &lw.sin, rope_shape(shape))?;
    let (qp, kvw, st) = stage_shape(cx.w, shape.hs, bt);
    ops_attention::split_heads(dev, &mut lw.stage, &s.dqkv, st, qp + 2)?;
    let dinp = if rows.sp { &mut s.partial } else { &mut s.dln };
    let ws = [(w(q), qp), (w(k), 1), (w(v), 1)];
    match &mut lw.share {
        None => {
            let (gq, rest) = g[q..].split_first_mut().expect("q precedes k and v");
            let (gk, gv) = pair(rest, k - q - 1, v - q - 1);
            linear.backward_stacked(dev, dinp, &mut [gq, gk, gv], &lw.stage, &a.ln1, &ws, (bt, c, kvw))?;
        }
        Some(sh) => {
            ops::fill_zero(dev, &mut sh.dk, kvw * c)?;
            ops::fill_zero(dev, &mut sh.dv, kvw * c)?;
            linear.backward_stacked(dev, dinp, &mut [&mut g[q], &mut sh.dk, &mut sh.dv], &lw.stage, &a.ln1, &ws, (bt, c, kvw))?;
            sum_shared_kv(dev, tp, sh, g, (k, v), kvw * c)?;
        }
    }
    sum_input_grad(dev, tp, rows, s, c)?;
    rms_backward(dev, rows, s, g, (an, 0), x, &p[an], &a.ln1_rstd, c)?;
    if rows.sp {
        add_replicated(dev, tp, s, g, &[an, mn], c)?;
    }
    Ok(())
}

/// Which row-parallel product a backward is for: where its input gradient goes.
#[derive(Clone, Copy)]
enum Dst {
    /// `down`: d(SwiGLU output) into `s.dfch_gelu`.
    Mlp,
    /// `o`: d(attention output) into `s.datty`.
    Attn,
}

/// The backward of a row-parallel product without bias from d(residual) in `s.dres` (gathered
/// over all rows first under SP): its weight gradient into `dw`, its input gradient into the
/// scratch `dst` names.
#[allow(clippy::too_many_arguments)]
fn row_parallel_backward(
    dev: &Device,
    tp: &mut Option<DeviceTp>,
    linear: &mut crate::model::device_linear::Linear,
    rows: Rows,
    s: &mut Scratch,
    (dw, w): (&mut DeviceBuffer, Weight),
    inp: &DeviceBuffer,
    (k, c): (usize, usize),
    dst: Dst,
) -> Result<()> {
    let bt = rows.bt;
    if rows.sp {
        group(tp).gather_rows(dev, &s.dres, &mut s.full, bt * c)?;
    }
    let dout = if rows.sp { &s.full } else { &s.dres };
    let dinp = match dst {
        Dst::Mlp => &mut s.dfch_gelu,
        Dst::Attn => &mut s.datty,
    };
    linear.backward(dev, dinp, dw, None, dout, inp, w, (bt, k, c))
}

/// Sums this micro-batch's k and v weight gradients (`sh.dk`, `sh.dv`, `n` elements each) over
/// the ranks sharing the KV head and adds them into the gradient entries `(k, v)`.
fn sum_shared_kv(dev: &Device, tp: &mut Option<DeviceTp>, sh: &mut KvShare, g: &mut [DeviceBuffer], (k, v): (usize, usize), n: usize) -> Result<()> {
    let slots = sh.sum.len() / 4;
    ops::fill_zero(dev, &mut sh.sum, slots)?;
    let at = sh.head * 2 * n;
    ops::copy(dev, &mut sh.sum, at, &sh.dk, 0, n)?;
    ops::copy(dev, &mut sh.sum, at + n, &sh.dv, 0, n)?;
    group(tp).sum(dev, &mut sh.sum, slots)?;
    ops::copy(dev, &mut sh.dk, 0, &sh.sum, at, n)?;
    ops::copy(dev, &mut sh.dv, 0, &sh.sum, at + n, n)?;
    ops::bias_add(dev, &mut g[k], &sh.dk, 1, n)?;
    ops::bias_add(dev, &mut g[v], &sh.dv, 1, n)
}

impl DeviceGpt {
    /// Entry indices of Llama block `l`'s tensors in layout order (attn_norm, q, k, v, o,
    /// mlp_norm, gate_up, down), the last four of the twelve GPT-2 slots unused.
    pub(super) fn llama_block_entries(&self, l: usize) -> [usize; 12] {
        let mut e = [usize::MAX; 12];
        for (i, r) in self.layout.block_ranges(l).iter().enumerate() {
            e[i] = self.entry(r);
        }
        e
    }

    /// Llama's embedding of `slot.tokens` into `slot.input` (R, C): the token rows only.
    pub(super) fn llama_embed_forward(&mut self, ci: usize, si: usize) -> Result<()> {
        let (bt, c) = (self.b * self.t, self.config.n_embd);
        let (dev, p, vocab, rows) = (&self.dev, &self.params, self.w.vocab, self.rows);
        let wte = self.ends.wte.expect("a first stage");
        let a = &mut self.chunks[ci].slots[si];
        match &mut self.tp {
            None => ops_vocab::embedding_shard_forward(dev, &mut a.input, &a.tokens, &p[wte], (bt, c), vocab),
            Some(g) if rows.sp => {
                let s = &mut self.s;
                ops_vocab::embedding_shard_forward(dev, &mut s.partial, &a.tokens, &p[wte], (bt, c), vocab)?;
                g.scatter_rows(dev, &s.partial, &mut a.input, bt * c)
            }
            Some(g) => {
                ops_vocab::embedding_shard_forward(dev, &mut a.input, &a.tokens, &p[wte], (bt, c), vocab)?;
                g.sum(dev, &mut a.input, bt * c)
            }
        }
    }

    /// Backward of Llama's embedding from d(block 0 input) (R, C) in `s.dres`.
    pub(super) fn llama_embed_backward(&mut self, ci: usize, si: usize) -> Result<()> {
        let (c, rows) = (self.config.n_embd, self.rows);
        let wte = self.ends.wte.expect("a first stage");
        let (dev, s, g, a) = (&self.dev, &mut self.s, &mut self.grads, &self.chunks[ci].slots[si]);
        let dout = if rows.sp {
            group(&mut self.tp).gather_rows(dev, &s.dres, &mut s.full, rows.bt * c)?;
            &s.full
        } else {
            &s.dres
        };
        ops_vocab::embedding_shard_backward(dev, &mut g[wte], dout, &a.tokens, (rows.bt, c), self.w.vocab)
    }
}
