//! The compute of a [`super::stage::Stage`]: one block, the vocab-parallel head and loss, the
//! embedding backward, each with its tensor-parallel collectives (see `stage.rs` for where they
//! sit and why replicated gradients need a reduction only under sequence parallelism).
//!
//! Every function takes the sizes ([`Dims`]), the TP group, the flat parameter (and gradient)
//! shard, one slot's activations and the shared scratch; all TP ranks call them in the same order.

use std::ops::Range;

use super::activations::{slab, slab_mut};
use super::attention::{attention_backward, attention_forward};
use super::gelu::{gelu_backward, gelu_forward};
use super::layernorm::{layernorm_backward, layernorm_forward};
use super::layout::BlockRanges;
use super::linear::{linear_backward, linear_forward};
use super::residual::residual_forward;
use super::stage_buffers::{Dims, Scratch, SlotActs};
use super::tp_comm::TpComm;
use super::tp_layout::ShardLayout;
use super::vocab_parallel::{
    cross_entropy_shard_backward, embedding_shard_backward, position_backward, shard_max,
    shard_sum_exp,
};
use crate::error::Result;
/// full (B*T, C) = all ranks' held rows (R, C): a gather under SP, a copy otherwise.
pub(super) fn to_full(d: &Dims, tp: &dyn TpComm, local: &[f32], full: &mut [f32]) -> Result<()> {
    if d.sp {
        tp.all_gather_rows(local, full)
    } else {
        full.copy_from_slice(local);
        Ok(())
    }
}

/// out (R, C) = the held rows of the TP sum of `partial` (B*T, C); `partial` is clobbered.
pub(super) fn reduce_rows(
    d: &Dims,
    tp: &dyn TpComm,
    partial: &mut [f32],
    out: &mut [f32],
) -> Result<()> {
    if d.sp {
        tp.reduce_scatter_rows(partial, out)
    } else {
        tp.all_reduce_sum(partial)?;
        out.copy_from_slice(partial);
        Ok(())
    }
}

/// out (N, OC) += bias (OC) on every row.
pub(super) fn add_bias(out: &mut [f32], bias: &[f32]) {
    for row in out.chunks_exact_mut(bias.len()) {
        row.iter_mut().zip(bias).for_each(|(o, &b)| *o += b);
    }
}

/// dbias (OC) += column sums of dout (N, OC).
pub(super) fn add_column_sums(dbias: &mut [f32], dout: &[f32]) {
    for row in dout.chunks_exact(dbias.len()) {
        dbias.iter_mut().zip(row).for_each(|(g, &x)| *g += x);
    }
}

pub(super) fn zero(buf: &mut [f32]) {
    buf.iter_mut().for_each(|x| *x = 0.0);
}

/// Adds one micro-batch's replicated-tensor gradients `part` into `grad`, after summing them over
/// TP under SP (each rank saw only its rows); without SP they are already complete.
pub(super) fn add_replicated(
    d: &Dims,
    tp: &dyn TpComm,
    part: &mut [f32],
    grad: &mut [f32],
) -> Result<()> {
    if d.sp {
        tp.all_reduce_sum(part)?;
    }
    grad.iter_mut().zip(part.iter()).for_each(|(g, &p)| *g += p);
    Ok(())
}

/// Block `li` of the stage: residual3 = r2 + mlp(ln2(r2)), r2 = x + attn(ln1(x)).
pub(super) fn block_forward(
    d: &Dims,
    tp: &dyn TpComm,
    p: &[f32],
    r: &BlockRanges,
    a: &mut SlotActs,
    s: &mut Scratch,
    li: usize,
) -> Result<()> {
    let (rc, bt, c) = (d.rows * d.c, d.bt, d.c);
    let (prev, rest) = a.residual3.split_at_mut(li * rc);
    let x: &[f32] = if li == 0 {
        &a.input
    } else {
        slab(prev, li - 1, rc)
    }; // (R, C)
    let residual3 = &mut rest[..rc]; // (R, C)
                                     // Attention: ln1 on the held rows, gathered, column-parallel qkv, local heads, row-parallel
                                     // projection summed over TP, bias once.
    let (mean, rstd) = (
        slab_mut(&mut a.ln1_mean, li, d.rows),
        slab_mut(&mut a.ln1_rstd, li, d.rows),
    );
    layernorm_forward(
        &mut s.ln,
        mean,
        rstd,
        x,
        &p[r.ln1_w.clone()],
        &p[r.ln1_b.clone()],
        c,
    );
    let ln1 = slab_mut(&mut a.ln1, li, bt * c); // (B*T, C)
    to_full(d, tp, &s.ln, ln1)?;
    let qkv = slab_mut(&mut a.qkv, li, bt * 3 * d.cl); // (B*T, 3C/tp)
    linear_forward(
        qkv,
        ln1,
        &p[r.qkv_w.clone()],
        Some(&p[r.qkv_b.clone()]),
        bt,
        c,
        3 * d.cl,
    );
    let atty = slab_mut(&mut a.atty, li, bt * d.cl); // (B*T, C/tp)
    attention_forward(atty, slab_mut(&mut a.att, li, d.att_len()), qkv, d.attn());
    linear_forward(
        &mut s.partial,
        atty,
        &p[r.attn_proj_w.clone()],
        None,
        bt,
        d.cl,
        c,
    );
    reduce_rows(d, tp, &mut s.partial, &mut s.branch)?;
    add_bias(&mut s.branch, &p[r.attn_proj_b.clone()]);
    let residual2 = slab_mut(&mut a.residual2, li, rc); // (R, C)
    residual_forward(residual2, x, &s.branch);
    // MLP: the same pattern with the column-parallel fc and the row-parallel proj.
    let (mean, rstd) = (
        slab_mut(&mut a.ln2_mean, li, d.rows),
        slab_mut(&mut a.ln2_rstd, li, d.rows),
    );
    layernorm_forward(
        &mut s.ln,
        mean,
        rstd,
        residual2,
        &p[r.ln2_w.clone()],
        &p[r.ln2_b.clone()],
        c,
    );
    let ln2 = slab_mut(&mut a.ln2, li, bt * c); // (B*T, C)
    to_full(d, tp, &s.ln, ln2)?;
    let fch = slab_mut(&mut a.fch, li, bt * d.hl); // (B*T, 4C/tp)
    linear_forward(
        fch,
        ln2,
        &p[r.fc_w.clone()],
        Some(&p[r.fc_b.clone()]),
        bt,
        c,
        d.hl,
    );
    let fch_gelu = slab_mut(&mut a.fch_gelu, li, bt * d.hl); // (B*T, 4C/tp)
    gelu_forward(fch_gelu, fch);
    linear_forward(
        &mut s.partial,
        fch_gelu,
        &p[r.mlp_proj_w.clone()],
        None,
        bt,
        d.hl,
        c,
    );
    reduce_rows(d, tp, &mut s.partial, &mut s.branch)?;
    add_bias(&mut s.branch, &p[r.mlp_proj_b.clone()]);
    residual_forward(residual3, residual2, &s.branch);
    Ok(())
}

/// Backward of block `li`: on entry `s.dres` holds d(block output) (R, C), on exit d(block input).
#[allow(clippy::too_many_arguments)]
pub(super) fn block_backward(
    d: &Dims,
    tp: &dyn TpComm,
    p: &[f32],
    g: &mut [f32],
    r: &BlockRanges,
    a: &SlotActs,
    s: &mut Scratch,
    li: usize,
) -> Result<()> {
    let (rc, bt, c) = (d.rows * d.c, d.bt, d.c);
    let x: &[f32] = if li == 0 {
        &a.input
    } else {
        slab(&a.residual3, li - 1, rc)
    }; // (R, C)
       // Replicated tensors' gradients of this micro-batch: ln1 w, b | attn.proj b | ln2 w, b |
       // mlp.proj b, C each.
    let repl = &mut s.repl[..6 * c];
    zero(repl);
    let (ln1_g, rest) = repl.split_at_mut(2 * c);
    let (attn_b_g, rest) = rest.split_at_mut(c);
    let (ln2_g, mlp_b_g) = rest.split_at_mut(2 * c);
    // MLP sub-block; its output gradient is the residual stream's.
    add_column_sums(mlp_b_g, &s.dres);
    to_full(d, tp, &s.dres, &mut s.full)?;
    zero(&mut s.dfch_gelu);
    let fch_gelu = slab(&a.fch_gelu, li, bt * d.hl); // (B*T, 4C/tp)
    let (w, dw) = (&p[r.mlp_proj_w.clone()], &mut g[r.mlp_proj_w.clone()]);
    linear_backward(
        &mut s.dfch_gelu,
        dw,
        None,
        &s.full,
        fch_gelu,
        w,
        bt,
        d.hl,
        c,
    );
    zero(&mut s.dfch);
    gelu_backward(&mut s.dfch, slab(&a.fch, li, bt * d.hl), &s.dfch_gelu);
    zero(&mut s.partial);
    let (dw, db) = pair_mut(g, r.fc_w.clone(), r.fc_b.clone());
    let ln2 = slab(&a.ln2, li, bt * c); // (B*T, C)
    linear_backward(
        &mut s.partial,
        dw,
        Some(db),
        &s.dfch,
        ln2,
        &p[r.fc_w.clone()],
        bt,
        c,
        d.hl,
    );
    reduce_rows(d, tp, &mut s.partial, &mut s.dln)?;
    let (ln2_w_g, ln2_b_g) = ln2_g.split_at_mut(c);
    let (mean, rstd) = (slab(&a.ln2_mean, li, d.rows), slab(&a.ln2_rstd, li, d.rows));
    let residual2 = slab(&a.residual2, li, rc); // (R, C)
    let w = &p[r.ln2_w.clone()];
    layernorm_backward(
        &mut s.dres,
        ln2_w_g,
        ln2_b_g,
        &s.dln,
        residual2,
        w,
        mean,
        rstd,
        c,
    );
    // Attention sub-block.
    add_column_sums(attn_b_g, &s.dres);
    to_full(d, tp, &s.dres, &mut s.full)?;
    zero(&mut s.datty);
    let atty = slab(&a.atty, li, bt * d.cl); // (B*T, C/tp)
    let (w, dw) = (&p[r.attn_proj_w.clone()], &mut g[r.attn_proj_w.clone()]);
    linear_backward(&mut s.datty, dw, None, &s.full, atty, w, bt, d.cl, c);
    zero(&mut s.dqkv);
    let (qkv, att) = (
        slab(&a.qkv, li, bt * 3 * d.cl),
        slab(&a.att, li, d.att_len()),
    );
    attention_backward(&mut s.dqkv, &mut s.datt_row, &s.datty, qkv, att, d.attn());
    zero(&mut s.partial);
    let (dw, db) = pair_mut(g, r.qkv_w.clone(), r.qkv_b.clone());
    let ln1 = slab(&a.ln1, li, bt * c); // (B*T, C)
    linear_backward(
        &mut s.partial,
        dw,
        Some(db),
        &s.dqkv,
        ln1,
        &p[r.qkv_w.clone()],
        bt,
        c,
        3 * d.cl,
    );
    reduce_rows(d, tp, &mut s.partial, &mut s.dln)?;
    let (ln1_w_g, ln1_b_g) = ln1_g.split_at_mut(c);
    let (mean, rstd) = (slab(&a.ln1_mean, li, d.rows), slab(&a.ln1_rstd, li, d.rows));
    let w = &p[r.ln1_w.clone()];
    layernorm_backward(&mut s.dres, ln1_w_g, ln1_b_g, &s.dln, x, w, mean, rstd, c);
    // One TP reduction (under SP) for all of the block's replicated gradients.
    let repl = &mut s.repl[..6 * c];
    if d.sp {
        tp.all_reduce_sum(repl)?;
    }
    let targets = [
        &r.ln1_w,
        &r.ln1_b,
        &r.attn_proj_b,
        &r.ln2_w,
        &r.ln2_b,
        &r.mlp_proj_b,
    ];
    for (range, part) in targets.into_iter().zip(repl.chunks_exact(c)) {
        g[range.clone()]
            .iter_mut()
            .zip(part)
            .for_each(|(g, &x)| *g += x);
    }
    Ok(())
}

/// Final LayerNorm, local logits and the vocab-parallel mean cross-entropy.
pub(super) fn head_forward(
    d: &Dims,
    tp: &dyn TpComm,
    p: &[f32],
    layout: &ShardLayout,
    a: &mut SlotActs,
    s: &mut Scratch,
) -> Result<f32> {
    let (bt, c) = (d.bt, d.c);
    let (lnf_w, lnf_b) = layout.lnf().expect("a last stage holds lnf");
    let x = match d.nl {
        0 => &a.input,
        n => slab(&a.residual3, n - 1, d.rows * c),
    }; // (R, C)
    layernorm_forward(
        &mut s.ln,
        &mut a.lnf_mean,
        &mut a.lnf_rstd,
        x,
        &p[lnf_w],
        &p[lnf_b],
        c,
    );
    to_full(d, tp, &s.ln, &mut a.lnf)?;
    let wte = &p[layout.wte().expect("a last stage holds wte")];
    linear_forward(&mut a.logits, &a.lnf, wte, None, bt, c, d.vl);
    let (max, stats) = s.ce.split_at_mut(bt);
    shard_max(max, &a.logits, d.vreal);
    tp.all_reduce_max(max)?;
    let (sum, target_logit) = stats.split_at_mut(bt);
    shard_sum_exp(
        sum,
        target_logit,
        &a.logits,
        max,
        &a.targets,
        d.vstart,
        d.vreal,
    );
    tp.all_reduce_sum(stats)?;
    let (sum, target_logit) = stats.split_at(bt);
    let mut total = 0f64;
    for (i, l) in a.lse.iter_mut().enumerate() {
        *l = max[i] + sum[i].ln();
        total += (*l - target_logit[i]) as f64;
    }
    Ok((total / bt as f64) as f32)
}

/// Backward of the loss, head and final LayerNorm: leaves d(stage output) in `s.dres`.
pub(super) fn head_backward(
    d: &Dims,
    tp: &dyn TpComm,
    p: &[f32],
    g: &mut [f32],
    layout: &ShardLayout,
    a: &SlotActs,
    s: &mut Scratch,
) -> Result<()> {
    let (bt, c) = (d.bt, d.c);
    zero(&mut s.dlogits);
    let dloss = (1.0 / bt as f64) as f32;
    cross_entropy_shard_backward(
        &mut s.dlogits,
        &a.logits,
        &a.lse,
        &a.targets,
        dloss,
        d.vstart,
        d.vreal,
    );
    let wte = layout.wte().expect("a last stage holds wte");
    zero(&mut s.partial);
    linear_backward(
        &mut s.partial,
        &mut g[wte.clone()],
        None,
        &s.dlogits,
        &a.lnf,
        &p[wte],
        bt,
        c,
        d.vl,
    );
    reduce_rows(d, tp, &mut s.partial, &mut s.dln)?;
    zero(&mut s.dres);
    let (lnf_w, lnf_b) = layout.lnf().expect("a last stage holds lnf");
    let part = &mut s.repl[..2 * c];
    zero(part);
    let (dw, db) = part.split_at_mut(c);
    let x = a.hidden_out(d); // (R, C)
    layernorm_backward(
        &mut s.dres,
        dw,
        db,
        &s.dln,
        x,
        &p[lnf_w.clone()],
        &a.lnf_mean,
        &a.lnf_rstd,
        c,
    );
    add_replicated(d, tp, &mut s.repl[..2 * c], &mut g[lnf_w.start..lnf_b.end])
}

/// Backward of the vocab-parallel embedding from d(block 0 input) in `s.dres`.
pub(super) fn embedding_backward(
    d: &Dims,
    tp: &dyn TpComm,
    g: &mut [f32],
    layout: &ShardLayout,
    a: &SlotActs,
    s: &mut Scratch,
) -> Result<()> {
    let tc = d.t * d.c;
    zero(&mut s.repl[..tc]);
    position_backward(&mut s.repl[..tc], &s.dres, d.row0, d.t, d.c);
    let wpe = layout.wpe().expect("a first stage holds wpe");
    add_replicated(d, tp, &mut s.repl[..tc], &mut g[wpe.start..wpe.start + tc])?;
    to_full(d, tp, &s.dres, &mut s.full)?;
    let wte = layout.wte().expect("a first stage holds wte");
    embedding_shard_backward(&mut g[wte], &s.full, &a.tokens, d.vstart, d.c);
    Ok(())
}

/// Disjoint mutable views of two ranges of `buf`; `first` must end before `second` starts.
pub(super) fn pair_mut(
    buf: &mut [f32],
    first: Range<usize>,
    second: Range<usize>,
) -> (&mut [f32], &mut [f32]) {
    assert!(
        first.end <= second.start,
        "pair_mut: {first:?} overlaps or follows {second:?}"
    );
    let (lo, hi) = buf.split_at_mut(second.start);
    (&mut lo[first], &mut hi[..second.end - second.start])
}
