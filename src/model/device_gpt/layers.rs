//! The layers of [`DeviceGpt`] on one activation slot, with their tensor-parallel collectives:
//! embedding, block and head, forward and backward.
//!
//! Without sequence parallelism every TP rank holds all B*T rows of the residual stream: the
//! row-parallel products' partial outputs and the column-parallel products' partial input
//! gradients are all-reduced in place, and replicated tensors (LayerNorms, row-parallel biases,
//! `wpe`) get identical gradients on every rank. With sequence parallelism (`sp`) rank `r` holds
//! rows `r*R..` (R = B*T/tp): LayerNorms, residual adds, biases and `wpe` work on those rows; a
//! LayerNorm's output is all-gathered before the column-parallel product that reads it, the
//! row-parallel sums become reduce-scatters, d(residual) is all-gathered before the row-parallel
//! backward, and the replicated tensors' gradients of each micro-batch are computed into scratch,
//! summed over TP in one all-reduce and only then added to the accumulated gradients (summing the
//! accumulated buffer would multiply earlier micro-batches by tp).

use super::{DeviceGpt, Widths};
use crate::device::{ops_attention, ops_vocab};
use crate::device::ops::{CrossEntropyForward, EncoderBackward, EncoderForward, LayerNormBackward, LayerNormForward};
use crate::device::{ops, Device, DeviceBuffer};
use crate::error::Result;
use crate::device::cpu::attention::AttnShape;
use crate::device::ops_attention::AttnWork;
use crate::model::device_acts::{BlockActs, Recompute, Scratch, SlotActs};
use crate::model::device_linear::{Linear, Weight};
use crate::model::device_tp::{self, tp_sum, DeviceTp, Embed, LossBufs};
use super::llama_layers::{self, LlamaWork};

/// The rows of the residual stream this rank holds.
#[derive(Debug, Clone, Copy)]
pub(super) struct Rows {
    /// B*T.
    pub bt: usize,
    /// Held rows (R): B*T/tp under SP, else B*T.
    pub rows: usize,
    /// Global index of the first held row.
    pub row0: usize,
    /// Sequence parallelism on (only with a TP group).
    pub sp: bool,
}

/// The TP group of a sequence-parallel model.
pub(super) fn group(tp: &mut Option<DeviceTp>) -> &mut DeviceTp {
    tp.as_mut().expect("sequence parallelism runs in a TP group")
}

/// LayerNorm of the held rows `x` (R, C) into `full` (B*T, C): directly without SP, else into
/// `s.ln` and all-gathered.
#[allow(clippy::too_many_arguments)]
fn norm_gathered(
    dev: &Device,
    tp: &mut Option<DeviceTp>,
    rows: Rows,
    s: &mut Scratch,
    full: &mut DeviceBuffer,
    (mean, rstd): (&mut DeviceBuffer, &mut DeviceBuffer),
    x: &DeviceBuffer,
    (w, b): (&DeviceBuffer, &DeviceBuffer),
    c: usize,
) -> Result<()> {
    if !rows.sp {
        return ops::layernorm_forward(dev, LayerNormForward { out: full, mean, rstd, inp: x, weight: w, bias: b }, rows.rows, c);
    }
    ops::layernorm_forward(dev, LayerNormForward { out: &mut s.ln, mean, rstd, inp: x, weight: w, bias: b }, rows.rows, c)?;
    group(tp).gather_rows(dev, &s.ln, full, rows.bt * c)
}

/// `s.branch` (R, C) = the held rows of the TP sum of inp (B*T, K) · W (C, K)ᵀ, plus the bias.
#[allow(clippy::too_many_arguments)]
pub(super) fn row_parallel_forward(
    dev: &Device,
    tp: &mut Option<DeviceTp>,
    linear: &mut Linear,
    rows: Rows,
    s: &mut Scratch,
    inp: &DeviceBuffer,
    (w, bias): (Weight, Option<&DeviceBuffer>),
    (k, c): (usize, usize),
) -> Result<()> {
    let bt = rows.bt;
    if rows.sp {
        linear.forward(dev, &mut s.partial, inp, w, None, bt, k, c)?;
        group(tp).scatter_rows(dev, &s.partial, &mut s.branch, bt * c)?;
    } else {
        linear.forward(dev, &mut s.branch, inp, w, None, bt, k, c)?;
        tp_sum(tp, dev, &mut s.branch, bt * c)?;
    }
    match bias {
        Some(bias) => ops::bias_add(dev, &mut s.branch, bias, rows.rows, c),
        None => Ok(()),
    }
}

/// `s.dln` (R, C) = the held rows of the TP sum of a column-parallel product's input gradient
/// (B*T, C), which went to `s.partial` under SP and to `s.dln` otherwise.
pub(super) fn sum_input_grad(dev: &Device, tp: &mut Option<DeviceTp>, rows: Rows, s: &mut Scratch, c: usize) -> Result<()> {
    match rows.sp {
        true => group(tp).scatter_rows(dev, &s.partial, &mut s.dln, rows.bt * c),
        false => tp_sum(tp, dev, &mut s.dln, rows.bt * c),
    }
}

/// SP: sums the first `k` replicated-gradient parts (C each) over TP in one all-reduce and adds
/// part `i` into the gradient entry `entries[i]`.
pub(super) fn add_replicated(
    dev: &Device,
    tp: &mut Option<DeviceTp>,
    s: &mut Scratch,
    grads: &mut [DeviceBuffer],
    entries: &[usize],
    c: usize,
) -> Result<()> {
    let k = entries.len();
    for (i, part) in s.parts[..k].iter().enumerate() {
        ops::copy(dev, &mut s.repl, i * c, part, 0, c)?;
    }
    group(tp).sum(dev, &mut s.repl, k * c)?;
    for (i, &e) in entries.iter().enumerate() {
        ops::copy(dev, &mut s.parts[i], 0, &s.repl, i * c, c)?;
        ops::bias_add(dev, &mut grads[e], &s.parts[i], 1, c)?;
    }
    Ok(())
}

impl DeviceGpt {
    /// The embedding of the tokens in `slot.tokens` into `slot.input` (R, C).
    pub(super) fn embed_forward(&mut self, ci: usize, si: usize) -> Result<()> {
        if self.llama.is_some() {
            return self.llama_embed_forward(ci, si);
        }
        let (b, t, c) = (self.b, self.t, self.config.n_embd);
        let (dev, p, vocab, rows) = (&self.dev, &self.params, self.w.vocab, self.rows);
        let (wte, wpe) = (self.ends.wte.expect("a first stage"), self.ends.wpe.expect("a first stage"));
        let a = &mut self.chunks[ci].slots[si];
        match &mut self.tp {
            None => ops::encoder_forward(dev, EncoderForward { out: &mut a.input, tokens: &a.tokens, wte: &p[wte], wpe: &p[wpe] }, b * t, t, c),
            Some(g) if rows.sp => {
                let s = &mut self.s;
                ops_vocab::embedding_shard_forward(dev, &mut s.partial, &a.tokens, &p[wte], (b * t, c), vocab)?;
                g.scatter_rows(dev, &s.partial, &mut a.input, b * t * c)?;
                ops_vocab::position_forward(dev, &mut a.input, &p[wpe], rows.row0..rows.row0 + rows.rows, (t, c))
            }
            Some(g) => {
                let e = Embed { tokens: &a.tokens, wte: &p[wte], wpe: &p[wpe] };
                device_tp::embed_forward(dev, g, &mut a.input, e, (b, t, c), vocab)
            }
        }
    }

    /// Block `li` of chunk `ci` on `slot` (see [`block_compute`]). With recomputation the slot
    /// keeps only part of the activations: `selective` writes the attention probabilities to the
    /// work buffers, `full` computes the whole block there and keeps only its output.
    pub(super) fn block_forward(&mut self, ci: usize, si: usize, li: usize) -> Result<()> {
        let mut work = self.work.take();
        let done = self.block_forward_with(ci, si, li, work.as_mut());
        self.work = work;
        done
    }

    fn block_forward_with(&mut self, ci: usize, si: usize, li: usize, work: Option<&mut BlockActs>) -> Result<()> {
        let recompute = self.recompute;
        let (mut cx, slot) = self.block_parts(ci, si, li);
        let (done, rest) = slot.blocks.split_at_mut(li);
        let x = if li == 0 { &slot.input } else { &done[li - 1].residual3 }; // (R, C)
        let a = &mut rest[0];
        match (recompute, work) {
            (Recompute::Full, Some(wk)) => {
                block_compute(&mut cx, x, wk, None)?;
                ops::copy(cx.dev, &mut a.residual3, 0, &wk.residual3, 0, cx.rows.rows * cx.c)
            }
            (Recompute::Selective, Some(wk)) => block_compute(&mut cx, x, a, Some(&mut wk.att)),
            _ => block_compute(&mut cx, x, a, None),
        }
    }

    /// The block context and the slot of block `li` of chunk `ci`, borrowed apart.
    fn block_parts(&mut self, ci: usize, si: usize, li: usize) -> (BlockCtx<'_>, &mut SlotActs) {
        let e = self.block_entries(self.chunks[ci].layers.start + li);
        let shape = self.attn_shape();
        let cx = BlockCtx {
            dev: &self.dev,
            tp: &mut self.tp,
            s: &mut self.s,
            linear: &mut self.linear,
            attn: &mut self.attn,
            p: &self.params,
            p16: &self.params16,
            g: &mut self.grads,
            rows: self.rows,
            w: self.w,
            c: self.config.n_embd,
            shape,
            e,
            llama: self.llama.as_mut(),
        };
        (cx, &mut self.chunks[ci].slots[si])
    }

    /// Final LayerNorm, tied head and loss of `slot` on the model's last chunk `ci`.
    pub(super) fn head_forward(&mut self, ci: usize, si: usize, targets: &[u32]) -> Result<f64> {
        let (c, v, rows) = (self.config.n_embd, self.config.vocab_size, self.rows);
        let bt = rows.bt;
        let (dev, p, vocab, s) = (&self.dev, &self.params, self.w.vocab, &mut self.s);
        let (wte, (lnf_w, lnf_b)) = (self.ends.head.expect("a last stage"), self.ends.lnf.expect("a last stage"));
        let SlotActs { input, blocks, head, .. } = &mut self.chunks[ci].slots[si];
        let x = blocks.last().map_or(&*input, |blk| &blk.residual3); // (R, C)
        let h = head.as_mut().expect("the last chunk keeps the head's activations");
        dev.copy_to_device(&mut h.targets, targets)?;
        match &self.llama {
            Some(lw) => llama_layers::rms_gathered(dev, &mut self.tp, rows, s, &mut h.lnf, &mut h.lnf_rstd, x, &p[lnf_w], (c, lw.eps))?,
            None => {
                let stats = (&mut h.lnf_mean, &mut h.lnf_rstd);
                norm_gathered(dev, &mut self.tp, rows, s, &mut h.lnf, stats, x, (&p[lnf_w], &p[lnf_b]), c)?
            }
        }
        let w = Weight { f32: &p[wte], bf16: self.params16[wte].as_ref() };
        self.linear.forward(dev, &mut h.logits, &h.lnf, w, None, bt, c, vocab.vl)?;
        match &mut self.tp {
            None => {
                let bufs = CrossEntropyForward { losses: &mut h.losses, lse: &mut h.lse, logits: &h.logits, targets: &h.targets };
                ops::cross_entropy_forward(dev, bufs, bt, v, vocab.vl)?
            }
            Some(g) => {
                let l = LossBufs {
                    logits: &h.logits,
                    targets: &h.targets,
                    losses: &mut h.losses,
                    lse: &mut h.lse,
                    max: &mut h.ce_max,
                    stats: &mut h.ce_stats,
                };
                device_tp::loss_forward(dev, g, l, bt, vocab)?;
            }
        }
        let mut losses = vec![0f32; bt];
        dev.copy_to_host(&h.losses, &mut losses)?;
        Ok(losses.iter().map(|&l| f64::from(l)).sum::<f64>() / bt as f64)
    }

    /// Loss, head and final LayerNorm backward of `slot`: leaves d(chunk output) (R, C) in
    /// `s.dres`.
    pub(super) fn head_backward(&mut self, ci: usize, si: usize) -> Result<()> {
        let (c, vocab, rows) = (self.config.n_embd, self.w.vocab, self.rows);
        let bt = rows.bt;
        let (wte, (lnf_w, lnf_b)) = (self.ends.head.expect("a last stage"), self.ends.lnf.expect("a last stage"));
        let llama = self.llama.is_some();
        let (dev, s, p, g, tp) = (&self.dev, &mut self.s, &self.params, &mut self.grads, &mut self.tp);
        let SlotActs { input, blocks, head, .. } = &self.chunks[ci].slots[si];
        let x = blocks.last().map_or(input, |blk| &blk.residual3); // (R, C)
        let h = head.as_ref().expect("the last chunk keeps the head's activations");
        let dloss = match std::mem::take(&mut self.poison) {
            true => f32::NAN,
            false => (self.loss_scale / bt as f64) as f32,
        };
        let bufs = ops_vocab::CrossEntropyBackward { dlogits: &mut s.dlogits, logits: &h.logits, lse: &h.lse, targets: &h.targets };
        ops_vocab::cross_entropy_backward(dev, bufs, dloss, bt, vocab)?;
        let w = Weight { f32: &p[wte], bf16: self.params16[wte].as_ref() };
        let dinp = if rows.sp { &mut s.partial } else { &mut s.dln };
        self.linear.backward(dev, dinp, &mut g[wte], None, &s.dlogits, &h.lnf, w, (bt, c, vocab.vl))?;
        sum_input_grad(dev, tp, rows, s, c)?;
        ops::fill_zero(dev, &mut s.dres, rows.rows * c)?;
        if llama {
            if rows.sp {
                ops::fill_zero(dev, &mut s.parts[0], c)?;
            }
            llama_layers::rms_backward(dev, rows, s, g, (lnf_w, 0), x, &p[lnf_w], &h.lnf_rstd, c)?;
            return if rows.sp { add_replicated(dev, tp, s, g, &[lnf_w], c) } else { Ok(()) };
        }
        let (mean, rstd) = (&h.lnf_mean, &h.lnf_rstd);
        if !rows.sp {
            let (gw, gb) = pair(g, lnf_w, lnf_b);
            let bufs = LayerNormBackward { dinp: &mut s.dres, dweight: gw, dbias: gb, dout: &s.dln, inp: x, weight: &p[lnf_w], mean, rstd };
            return ops::layernorm_backward(dev, bufs, rows.rows, c);
        }
        let [gw, gb] = &mut s.parts[..2] else { unreachable!("two parts") };
        ops::fill_zero(dev, gw, c)?;
        ops::fill_zero(dev, gb, c)?;
        let bufs = LayerNormBackward { dinp: &mut s.dres, dweight: gw, dbias: gb, dout: &s.dln, inp: x, weight: &p[lnf_w], mean, rstd };
        ops::layernorm_backward(dev, bufs, rows.rows, c)?;
        add_replicated(dev, tp, s, g, &[lnf_w, lnf_b], c)
    }

    /// Backward of block `li` of chunk `ci` on `slot`: `s.dres` holds d(block output) (R, C) on
    /// entry, d(block input) on exit (see [`block_backward`]). With recomputation the activations
    /// the slot does not keep are computed again first, into the work buffers, from the kept ones.
    pub(super) fn block_backward(&mut self, ci: usize, si: usize, li: usize) -> Result<()> {
        let mut work = self.work.take();
        let done = self.block_backward_with(ci, si, li, work.as_mut());
        self.work = work;
        done
    }

    fn block_backward_with(&mut self, ci: usize, si: usize, li: usize, work: Option<&mut BlockActs>) -> Result<()> {
        let recompute = self.recompute;
        let (mut cx, slot) = self.block_parts(ci, si, li);
        let x = if li == 0 { &slot.input } else { &slot.blocks[li - 1].residual3 }; // (R, C)
        let kept = &slot.blocks[li];
        match (recompute, work) {
            (Recompute::Full, Some(wk)) => {
                block_compute(&mut cx, x, wk, None)?;
                block_backward(&mut cx, x, wk, &wk.att)
            }
            (Recompute::Selective, Some(wk)) => {
                ops_attention::attention_forward(cx.dev, &mut wk.atty, &mut wk.att, &kept.qkv, cx.attn, cx.shape)?;
                block_backward(&mut cx, x, kept, &wk.att)
            }
            _ => block_backward(&mut cx, x, kept, &kept.att),
        }
    }

    /// Backward of the embedding from d(block 0 input) (R, C) in `s.dres`.
    pub(super) fn embed_backward(&mut self, ci: usize, si: usize) -> Result<()> {
        if self.llama.is_some() {
            return self.llama_embed_backward(ci, si);
        }
        let (b, t, c, rows) = (self.b, self.t, self.config.n_embd, self.rows);
        let (wte, wpe) = (self.ends.wte.expect("a first stage"), self.ends.wpe.expect("a first stage"));
        let (dev, s, g, a) = (&self.dev, &mut self.s, &mut self.grads, &self.chunks[ci].slots[si]);
        if rows.sp {
            ops::fill_zero(dev, &mut s.repl, t * c)?;
            ops_vocab::position_backward(dev, &mut s.repl, &s.dres, rows.row0..rows.row0 + rows.rows, (t, c))?;
            let tp = group(&mut self.tp);
            tp.sum(dev, &mut s.repl, t * c)?;
            ops::bias_add(dev, &mut g[wpe], &s.repl, 1, t * c)?;
            tp.gather_rows(dev, &s.dres, &mut s.full, rows.bt * c)?;
            return ops_vocab::embedding_shard_backward(dev, &mut g[wte], &s.full, &a.tokens, (rows.bt, c), self.w.vocab);
        }
        let (gte, gpe) = pair(g, wte, wpe);
        match self.tp {
            None => ops::encoder_backward(dev, EncoderBackward { dwte: gte, dwpe: gpe, dout: &s.dres, tokens: &a.tokens }, b, t, c),
            Some(_) => device_tp::embed_backward(dev, gte, gpe, &s.dres, &a.tokens, (b, t, c), self.w.vocab),
        }
    }
}

/// What one block reads and writes besides its activations: the device, the TP group, the
/// scratch, the matrix-product and attention work, the parameters and gradients, the shapes and
/// the block's entry indices (ln1 w, b; qkv w, b; attn.proj w, b; ln2 w, b; fc w, b; mlp.proj w, b).
pub(super) struct BlockCtx<'a> {
    pub(super) dev: &'a Device,
    pub(super) tp: &'a mut Option<DeviceTp>,
    pub(super) s: &'a mut Scratch,
    pub(super) linear: &'a mut Linear,
    pub(super) attn: &'a mut AttnWork,
    pub(super) p: &'a [DeviceBuffer],
    pub(super) p16: &'a [Option<DeviceBuffer>],
    pub(super) g: &'a mut [DeviceBuffer],
    pub(super) rows: Rows,
    pub(super) w: Widths,
    pub(super) c: usize,
    pub(super) shape: AttnShape,
    pub(super) e: [usize; 12],
    /// Llama's work (None for GPT-2: the block is GPT-2's).
    pub(super) llama: Option<&'a mut LlamaWork>,
}

/// One block's forward from its input `x` (R, C) into `a`: column-parallel qkv and fc (this
/// rank's heads and hidden units), row-parallel projections summed over TP before the bias is
/// added once. The attention probabilities go to `att` if given (selective recomputation keeps
/// them out of the slot), else to `a.att`.
fn block_compute(cx: &mut BlockCtx<'_>, x: &DeviceBuffer, a: &mut BlockActs, att: Option<&mut DeviceBuffer>) -> Result<()> {
    if cx.llama.is_some() {
        return llama_layers::block_compute(cx, x, a, att);
    }
    let (c, rows, bt, r) = (cx.c, cx.rows, cx.rows.bt, cx.rows.rows);
    let Widths { cl, hl, .. } = cx.w;
    let [ln1_w, ln1_b, qkv_w, qkv_b, ap_w, ap_b, ln2_w, ln2_b, fc_w, fc_b, mp_w, mp_b] = cx.e;
    let (dev, p) = (cx.dev, cx.p);
    let w = |i: usize| Weight { f32: &p[i], bf16: cx.p16[i].as_ref() };
    let (tp, s, linear) = (&mut *cx.tp, &mut *cx.s, &mut *cx.linear);
    norm_gathered(dev, tp, rows, s, &mut a.ln1, (&mut a.ln1_mean, &mut a.ln1_rstd), x, (&p[ln1_w], &p[ln1_b]), c)?;
    linear.forward(dev, &mut a.qkv, &a.ln1, w(qkv_w), Some(&p[qkv_b]), bt, c, 3 * cl)?;
    let att = match att {
        Some(buf) => buf,
        None => &mut a.att,
    };
    ops_attention::attention_forward(dev, &mut a.atty, att, &a.qkv, cx.attn, cx.shape)?;
    row_parallel_forward(dev, tp, linear, rows, s, &a.atty, (w(ap_w), Some(&p[ap_b])), (cl, c))?;
    ops::residual_forward(dev, &mut a.residual2, x, &s.branch, r * c)?;
    let stats = (&mut a.ln2_mean, &mut a.ln2_rstd);
    norm_gathered(dev, tp, rows, s, &mut a.ln2, stats, &a.residual2, (&p[ln2_w], &p[ln2_b]), c)?;
    linear.forward(dev, &mut a.fch, &a.ln2, w(fc_w), Some(&p[fc_b]), bt, c, hl)?;
    ops::gelu_forward(dev, &mut a.fch_gelu, &a.fch, bt * hl)?;
    row_parallel_forward(dev, tp, linear, rows, s, &a.fch_gelu, (w(mp_w), Some(&p[mp_b])), (hl, c))?;
    ops::residual_forward(dev, &mut a.residual3, &a.residual2, &s.branch, r * c)
}

/// One block's backward from its input `x` (R, C), its activations `a` and attention
/// probabilities `att`: `s.dres` holds d(block output) (R, C) on entry, d(block input) on exit.
/// The column-parallel products' input gradients are partial sums over this rank's heads and
/// hidden units, summed over TP before the LayerNorm backward.
fn block_backward(cx: &mut BlockCtx<'_>, x: &DeviceBuffer, a: &BlockActs, att: &DeviceBuffer) -> Result<()> {
    if cx.llama.is_some() {
        return llama_layers::block_backward(cx, x, a, att);
    }
    let (c, rows, bt, r) = (cx.c, cx.rows, cx.rows.bt, cx.rows.rows);
    let Widths { cl, hl, .. } = cx.w;
    let shape = cx.shape;
    let [ln1_w, ln1_b, qkv_w, qkv_b, ap_w, ap_b, ln2_w, ln2_b, fc_w, fc_b, mp_w, mp_b] = cx.e;
    let (dev, p) = (cx.dev, cx.p);
    let w = |i: usize| Weight { f32: &p[i], bf16: cx.p16[i].as_ref() };
    let (tp, s, linear, attn, g) = (&mut *cx.tp, &mut *cx.s, &mut *cx.linear, &mut *cx.attn, &mut *cx.g);
    // Under SP the replicated gradients of this micro-batch go to the parts (ln1 w, b,
    // attn.proj b, ln2 w, b, mlp.proj b) and d(residual) is gathered before each
    // row-parallel backward; otherwise straight into the gradients and read in place.
    if rows.sp {
        for part in &mut s.parts {
            ops::fill_zero(dev, part, c)?;
        }
    }
    // MLP: d(residual2) = dres + d through ln2 of the MLP branch.
    if rows.sp {
        ops::bias_backward(dev, &mut s.parts[5], &s.dres, r, c)?;
        group(tp).gather_rows(dev, &s.dres, &mut s.full, bt * c)?;
        linear.backward(dev, &mut s.dfch_gelu, &mut g[mp_w], None, &s.full, &a.fch_gelu, w(mp_w), (bt, hl, c))?;
    } else {
        let (gw, gb) = pair(g, mp_w, mp_b);
        linear.backward(dev, &mut s.dfch_gelu, gw, Some(gb), &s.dres, &a.fch_gelu, w(mp_w), (bt, hl, c))?;
    }
    ops::fill_zero(dev, &mut s.dfch, bt * hl)?;
    ops::gelu_backward(dev, &mut s.dfch, &a.fch, &s.dfch_gelu, bt * hl)?;
    let (gw, gb) = pair(g, fc_w, fc_b);
    let dinp = if rows.sp { &mut s.partial } else { &mut s.dln };
    linear.backward(dev, dinp, gw, Some(gb), &s.dfch, &a.ln2, w(fc_w), (bt, c, hl))?;
    sum_input_grad(dev, tp, rows, s, c)?;
    let stats = (&a.ln2_mean, &a.ln2_rstd);
    ln_backward(dev, rows, s, g, (ln2_w, ln2_b), (3, 4), &a.residual2, &p[ln2_w], stats, c)?;
    // Attention: d(block input) = d(residual2) + d through ln1 of the attention branch.
    if rows.sp {
        ops::bias_backward(dev, &mut s.parts[2], &s.dres, r, c)?;
        group(tp).gather_rows(dev, &s.dres, &mut s.full, bt * c)?;
        linear.backward(dev, &mut s.datty, &mut g[ap_w], None, &s.full, &a.atty, w(ap_w), (bt, cl, c))?;
    } else {
        let (gw, gb) = pair(g, ap_w, ap_b);
        linear.backward(dev, &mut s.datty, gw, Some(gb), &s.dres, &a.atty, w(ap_w), (bt, cl, c))?;
    }
    ops::fill_zero(dev, &mut s.dqkv, bt * 3 * cl)?;
    let bufs = ops_attention::AttentionBackward { dqkv: &mut s.dqkv, dpre: &mut s.dpre, dout: &s.datty, qkv: &a.qkv, att };
    ops_attention::attention_backward(dev, bufs, attn, shape)?;
    let (gw, gb) = pair(g, qkv_w, qkv_b);
    let dinp = if rows.sp { &mut s.partial } else { &mut s.dln };
    linear.backward(dev, dinp, gw, Some(gb), &s.dqkv, &a.ln1, w(qkv_w), (bt, c, 3 * cl))?;
    sum_input_grad(dev, tp, rows, s, c)?;
    let stats = (&a.ln1_mean, &a.ln1_rstd);
    ln_backward(dev, rows, s, g, (ln1_w, ln1_b), (0, 1), x, &p[ln1_w], stats, c)?;
    if rows.sp {
        add_replicated(dev, tp, s, g, &[ln1_w, ln1_b, ap_b, ln2_w, ln2_b, mp_b], c)?;
    }
    Ok(())
}

/// LayerNorm backward on the held rows: d(input) added into `s.dres`, the weight and bias
/// gradients into the entries `(w, b)` (no SP) or into `s.parts[parts]` (SP).
#[allow(clippy::too_many_arguments)]
fn ln_backward(
    dev: &Device,
    rows: Rows,
    s: &mut Scratch,
    grads: &mut [DeviceBuffer],
    (w, b): (usize, usize),
    parts: (usize, usize),
    x: &DeviceBuffer,
    weight: &DeviceBuffer,
    (mean, rstd): (&DeviceBuffer, &DeviceBuffer),
    c: usize,
) -> Result<()> {
    let (gw, gb) = match rows.sp {
        true => {
            let (lo, hi) = s.parts.split_at_mut(parts.1);
            (&mut lo[parts.0], &mut hi[0])
        }
        false => pair(grads, w, b),
    };
    let bufs = LayerNormBackward { dinp: &mut s.dres, dweight: gw, dbias: gb, dout: &s.dln, inp: x, weight, mean, rstd };
    ops::layernorm_backward(dev, bufs, rows.rows, c)
}

/// Two distinct entries of `bufs`, both mutable (`i < j`, as layout order always gives here).
pub(super) fn pair(bufs: &mut [DeviceBuffer], i: usize, j: usize) -> (&mut DeviceBuffer, &mut DeviceBuffer) {
    assert!(i < j, "pair: entry {i} must precede entry {j}");
    let (lo, hi) = bufs.split_at_mut(j);
    (&mut lo[i], &mut hi[0])
}
