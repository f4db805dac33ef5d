//! Causal multi-head self-attention on a device: strided-batched GEMMs (`device::gemm`, one
//! call for all B*NH heads) around fused causal-softmax kernels (kernels/attention.cu).
//!
//! Forward: qkv (B, T, (NH + 2 NKV) hs) is split into per-head views Q (B, NH, T, hs), K and V
//! (B, NKV, T, hs), `att = Q Kᵀ` as one batched product, the softmax (scale, mask j > i, max,
//! exp, sum, normalise) in place, `out_h = att V` as one batched product, merged back to out
//! (B, T, C). Backward: `datt = dout_h Vᵀ`,
//! `dV = attᵀ dout_h`, the softmax backward in place (`dpre = scale * att * (datt - Σ att
//! datt)`), `dQ = dpre K`, `dK = dpreᵀ Q`, merged into dqkv. The products also fill the entries
//! above the diagonal (wasted, never read: the softmax writes zeros there, so `att V` and the
//! products of `dpre` equal the causal sums).
//!
//! Grouped-query attention (NKV < NH, group g = NH/NKV): the g query heads of a key/value head
//! are adjacent in Q, so the group's queries are one (g*T, hs) matrix and every product runs
//! over the B*NKV groups with g*T rows where multi-head attention has T: `att` (g*T, T) is then
//! exactly the g heads' (T, T) blocks of (B, NH, T, T), and `dV = attᵀ dout`, `dK = dpreᵀ Q`
//! sum over the group inside the product (no repeated K/V copies, no extra reduction). With
//! NKV = NH (g = 1) the calls are exactly the multi-head ones.
//!
//! On the CPU device the two attention ops run the reference `cpu::attention` instead, so the
//! device model's CPU arm is the reference the emu and GPU arms are tested against; the single
//! kernels' ops run host loops of the same arithmetic there.

use super::gemm::{Batch, Gemm, GemmInput, Operand};
use super::ops::{as_i32, as_u32, f32s, host, host_mut, need, stride_grid};
use super::{Device, DeviceBuffer, KernelArg as A, LaunchDims};
use crate::device::cpu::attention::{self, AttnShape};
use crate::error::Result;

/// The per-head views and the BLAS handle of [`attention_forward`] / [`attention_backward`]
/// (every buffer fully overwritten by each call; empty on the CPU device, which does not use them).
pub struct AttnWork {
    gemm: Gemm,
    heads: DeviceBuffer,     // Q (B, NH, T, hs), K, V (B, NKV, T, hs)
    head_out: DeviceBuffer,  // (B, NH, T, hs): att V in the forward, d(out) in the backward
    head_grads: DeviceBuffer, // dQ (B, NH, T, hs), dK, dV (B, NKV, T, hs)
}

impl AttnWork {
    /// Views for calls of shape `s` on `dev`.
    pub fn new(dev: &Device, s: AttnShape) -> Result<Self> {
        s.check()?;
        let (nq, nkv) = if let Device::Cpu = dev { (0, 0) } else { (q_elems(s), kv_elems(s)) };
        Ok(AttnWork {
            gemm: Gemm::new(dev)?,
            heads: dev.alloc(f32s(nq + 2 * nkv))?,
            head_out: dev.alloc(f32s(nq))?,
            head_grads: dev.alloc(f32s(nq + 2 * nkv))?,
        })
    }

    /// f32 elements the views take on `dev`.
    pub fn elements(dev: &Device, s: AttnShape) -> usize {
        if let Device::Cpu = dev { 0 } else { 3 * q_elems(s) + 4 * kv_elems(s) }
    }
}

/// Elements of Q (B, NH, T, hs).
fn q_elems(s: AttnShape) -> usize {
    s.b * s.nh * s.t * s.hs
}

/// Elements of K or V (B, NKV, T, hs).
fn kv_elems(s: AttnShape) -> usize {
    s.b * s.nkv * s.t * s.hs
}

/// Elements of `parts` per-head parts: Q, then `parts - 1` of K/V size.
fn parts_elems(s: AttnShape, parts: usize) -> usize {
    q_elems(s) + parts.saturating_sub(1) * kv_elems(s)
}

/// (rows, T) block-per-row launch of a softmax kernel: the smallest multiple of 64 (a wavefront,
/// two warps) covering T, at most 256 threads.
fn row_dims(k: &str, rows: usize, t: usize) -> Result<LaunchDims> {
    let threads = t.div_ceil(64).clamp(1, 4) as u32 * 64;
    Ok(LaunchDims::linear(as_u32(k, "rows", rows)?, threads))
}

fn scale_of(s: AttnShape) -> f32 {
    1.0 / (s.hs as f32).sqrt()
}

/// att (rows, T) in place: raw scores in, the causal softmax of `scale * scores` out (query
/// position `row % T`; zero above the diagonal, which is not read).
pub fn softmax_forward(dev: &Device, att: &mut DeviceBuffer, rows: usize, t: usize, scale: f32) -> Result<()> {
    let k = "attention_softmax_forward_f32";
    need(k, "att", att, f32s(rows * t))?;
    if let Device::Cpu = dev {
        for (r, row) in host_mut(k, att)?.view_mut::<f32>(rows * t).chunks_mut(t.max(1)).enumerate() {
            let (keep, above) = row.split_at_mut(r % t + 1);
            let max = keep.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x * scale));
            keep.iter_mut().for_each(|x| *x = crate::device::cpu::exp::exp_f32(*x * scale - max));
            let inv = 1.0 / keep.iter().sum::<f32>();
            keep.iter_mut().for_each(|x| *x *= inv);
            above.fill(0.0);
        }
        return Ok(());
    }
    if rows * t == 0 {
        return Ok(());
    }
    dev.launch(k, row_dims(k, rows, t)?, &[A::Buf(att), A::I32(as_i32(k, "t", t)?), A::F32(scale)])
}

/// d (rows, T) in place: d(att) in, d(scores) = `scale * att * (datt - Σ_{j<=i} att datt)` out,
/// zero above the diagonal (not read).
pub fn softmax_backward(dev: &Device, d: &mut DeviceBuffer, att: &DeviceBuffer, rows: usize, t: usize, scale: f32) -> Result<()> {
    let k = "attention_softmax_backward_f32";
    need(k, "d", d, f32s(rows * t))?;
    need(k, "att", att, f32s(rows * t))?;
    if let Device::Cpu = dev {
        let a = host(k, att)?.view::<f32>(rows * t);
        for (r, (row, a)) in host_mut(k, d)?.view_mut::<f32>(rows * t).chunks_mut(t.max(1)).zip(a.chunks(t.max(1))).enumerate() {
            let (keep, above) = row.split_at_mut(r % t + 1);
            let dot: f32 = keep.iter().zip(a).map(|(x, y)| x * y).sum();
            keep.iter_mut().zip(a).for_each(|(x, &y)| *x = scale * y * (*x - dot));
            above.fill(0.0);
        }
        return Ok(());
    }
    if rows * t == 0 {
        return Ok(());
    }
    let args = [A::Buf(d), A::Buf(att), A::I32(as_i32(k, "t", t)?), A::F32(scale)];
    dev.launch(k, row_dims(k, rows, t)?, &args)
}

/// The index in the row layout (B, T, [NH | NKV | NKV ...] hs) of element `i` of the per-head
/// layout (B, NH, T, hs) then (parts - 1) x (B, NKV, T, hs).
fn head_index(i: usize, s: AttnShape, parts: usize) -> usize {
    let (nq, nk) = (q_elems(s), kv_elems(s));
    let (p, j, heads) = if i < nq { (0, i, s.nh) } else { (1 + (i - nq) / nk, (i - nq) % nk, s.nkv) };
    let (x, r) = (j % s.hs, j / s.hs);
    let (ti, r) = (r % s.t, r / s.t);
    let (h, bi) = (r % heads, r / heads);
    let col = if p == 0 { h * s.hs } else { (s.nh + (p - 1) * s.nkv + h) * s.hs };
    (bi * s.t + ti) * (s.nh + parts.saturating_sub(1) * s.nkv) * s.hs + col + x
}

fn head_args<'a>(k: &str, s: AttnShape, parts: usize) -> Result<[A<'a>; 6]> {
    Ok([
        A::I32(as_i32(k, "b", s.b)?),
        A::I32(as_i32(k, "t", s.t)?),
        A::I32(as_i32(k, "parts", parts)?),
        A::I32(as_i32(k, "nh", s.nh)?),
        A::I32(as_i32(k, "nkv", s.nkv)?),
        A::I32(as_i32(k, "hs", s.hs)?),
    ])
}

/// dst: Q (B, NH, T, hs) then (parts - 1) x (B, NKV, T, hs) = src (B, T, (NH + (parts-1) NKV)
/// hs) regrouped by head (parts = 3: qkv; parts = 1: an (B, T, NH hs) output or its gradient).
pub fn split_heads(dev: &Device, dst: &mut DeviceBuffer, src: &DeviceBuffer, s: AttnShape, parts: usize) -> Result<()> {
    let k = "attention_split_heads_f32";
    s.check()?;
    let n = parts_elems(s, parts);
    need(k, "dst", dst, f32s(n))?;
    need(k, "src", src, f32s(n))?;
    if let Device::Cpu = dev {
        let x = host(k, src)?.view::<f32>(n);
        for (i, y) in host_mut(k, dst)?.view_mut::<f32>(n).iter_mut().enumerate() {
            *y = x[head_index(i, s, parts)];
        }
        return Ok(());
    }
    let [b, t, p, nh, nkv, hs] = head_args(k, s, parts)?;
    dev.launch(k, stride_grid(n), &[A::Buf(dst), A::Buf(src), b, t, p, nh, nkv, hs, A::U64(n as u64)])
}

/// dst (B, T, (NH + (parts-1) NKV) hs) = src (per-head layout of [`split_heads`]) in row layout
/// (`accumulate`: +=).
pub fn merge_heads(dev: &Device, dst: &mut DeviceBuffer, src: &DeviceBuffer, s: AttnShape, parts: usize, accumulate: bool) -> Result<()> {
    let k = "attention_merge_heads_f32";
    s.check()?;
    let n = parts_elems(s, parts);
    need(k, "dst", dst, f32s(n))?;
    need(k, "src", src, f32s(n))?;
    if let Device::Cpu = dev {
        let x = host(k, src)?.view::<f32>(n);
        let y = host_mut(k, dst)?.view_mut::<f32>(n);
        for (i, &v) in x.iter().enumerate() {
            let j = head_index(i, s, parts);
            y[j] = if accumulate { y[j] + v } else { v };
        }
        return Ok(());
    }
    let [b, t, p, nh, nkv, hs] = head_args(k, s, parts)?;
    let args = [A::Buf(dst), A::Buf(src), b, t, p, nh, nkv, hs, A::I32(accumulate as i32), A::U64(n as u64)];
    dev.launch(k, stride_grid(n), &args)
}

/// One batched product over the B*NKV key/value groups (B*NH heads when NKV = NH):
/// `c_g (M, N) = op(a_g) · op(b_g)`, with the (offset, stride) of each operand's matrices.
#[allow(clippy::too_many_arguments)]
fn per_head(
    w: &Gemm,
    dev: &Device,
    c: &mut DeviceBuffer,
    (a, a_at): (Operand, (usize, usize)),
    (b, b_at): (Operand, (usize, usize)),
    dims: (usize, usize, usize),
    s: AttnShape,
) -> Result<()> {
    let c_stride = dims.0 * dims.1;
    let batch = Batch { count: s.b * s.nkv, c: (0, c_stride), a: a_at, b: b_at };
    w.matmul_batched(dev, c, a, b, dims, &batch, false)
}

/// out (B, T, C), att (B, NH, T, T) from qkv (B, T, (NH + 2 NKV) hs). Reference:
/// `cpu::attention::attention_forward` (run as is on the CPU device).
pub fn attention_forward(
    dev: &Device,
    out: &mut DeviceBuffer,
    att: &mut DeviceBuffer,
    qkv: &DeviceBuffer,
    w: &mut AttnWork,
    s: AttnShape,
) -> Result<()> {
    let k = "attention_forward";
    s.check()?;
    let (btc, tt, nk) = (q_elems(s), s.b * s.nh * s.t * s.t, kv_elems(s));
    need(k, "out", out, f32s(btc))?;
    need(k, "att", att, f32s(tt))?;
    need(k, "qkv", qkv, f32s(btc + 2 * nk))?;
    if let Device::Cpu = dev {
        let (o, a) = (host_mut(k, out)?.view_mut::<f32>(btc), host_mut(k, att)?.view_mut::<f32>(tt));
        attention::attention_forward(o, a, host(k, qkv)?.view::<f32>(btc + 2 * nk), s);
        return Ok(());
    }
    let f = |buf| Operand::plain(buf, GemmInput::F32);
    let ft = |buf| Operand::t(buf, GemmInput::F32);
    // head: one key/value head's (T, hs) matrix; gt: a group's query rows; group: (gT, hs).
    let (t, hs, head, gt) = (s.t, s.hs, s.t * s.hs, s.group() * s.t);
    let group = gt * hs;
    split_heads(dev, &mut w.heads, qkv, s, 3)?; // Q (B, NH, T, hs), K, V (B, NKV, T, hs)
    // att_g (gT, T) = Q_g (gT, hs) · K_gᵀ, K_g stored (T, hs).
    per_head(&w.gemm, dev, att, (f(&w.heads), (0, group)), (ft(&w.heads), (btc, head)), (gt, t, hs), s)?;
    softmax_forward(dev, att, s.b * s.nh * t, t, scale_of(s))?;
    // out_g (gT, hs) = att_g (gT, T) · V_g (T, hs).
    per_head(&w.gemm, dev, &mut w.head_out, (f(att), (0, gt * t)), (f(&w.heads), (btc + nk, head)), (gt, hs, t), s)?;
    merge_heads(dev, out, &w.head_out, s, 1, false)
}

/// The buffers of [`attention_backward`].
pub struct AttentionBackward<'a> {
    /// Gradient of the qkv rows (B, T, (NH + 2 NKV) hs), accumulated.
    pub dqkv: &'a mut DeviceBuffer,
    /// Scratch (B, NH, T, T), overwritten.
    pub dpre: &'a mut DeviceBuffer,
    /// Output gradient (B, T, C).
    pub dout: &'a DeviceBuffer,
    /// The forward's qkv rows and attention weights.
    pub qkv: &'a DeviceBuffer,
    pub att: &'a DeviceBuffer,
}

/// dqkv (B, T, (NH + 2 NKV) hs) += the attention gradient from dout (B, T, C) and the forward's qkv and
/// att; `dpre` is (B, NH, T, T) scratch, fully overwritten. Reference:
/// `cpu::attention::attention_backward` (run as is on the CPU device).
pub fn attention_backward(dev: &Device, bufs: AttentionBackward, w: &mut AttnWork, s: AttnShape) -> Result<()> {
    let AttentionBackward { dqkv, dpre, dout, qkv, att } = bufs;
    let k = "attention_backward";
    s.check()?;
    let (btc, tt, nk) = (q_elems(s), s.b * s.nh * s.t * s.t, kv_elems(s));
    need(k, "dqkv", dqkv, f32s(btc + 2 * nk))?;
    need(k, "qkv", qkv, f32s(btc + 2 * nk))?;
    need(k, "dout", dout, f32s(btc))?;
    need(k, "dpre", dpre, f32s(tt))?;
    need(k, "att", att, f32s(tt))?;
    if let Device::Cpu = dev {
        let n = btc + 2 * nk;
        let (dy, x, a) = (host(k, dout)?.view::<f32>(btc), host(k, qkv)?.view::<f32>(n), host(k, att)?.view::<f32>(tt));
        let p = host_mut(k, dpre)?.view_mut::<f32>(tt);
        attention::attention_backward(host_mut(k, dqkv)?.view_mut::<f32>(n), p, dy, x, a, s);
        return Ok(());
    }
    let f = |buf| Operand::plain(buf, GemmInput::F32);
    let ft = |buf| Operand::t(buf, GemmInput::F32);
    // head: one key/value head's (T, hs) matrix; gt: a group's query rows; group: (gT, hs).
    let (t, hs, head, gt) = (s.t, s.hs, s.t * s.hs, s.group() * s.t);
    let (group, count) = (gt * hs, s.b * s.nkv);
    split_heads(dev, &mut w.heads, qkv, s, 3)?; // Q (B, NH, T, hs), K, V (B, NKV, T, hs)
    split_heads(dev, &mut w.head_out, dout, s, 1)?; // dout_h (B, NH, T, hs)
    let (heads, dy, g) = (&w.heads, &w.head_out, &mut w.head_grads);
    // datt_g (gT, T) = dout_g (gT, hs) · V_gᵀ, into dpre.
    per_head(&w.gemm, dev, dpre, (f(dy), (0, group)), (ft(heads), (btc + nk, head)), (gt, t, hs), s)?;
    // dV_g (T, hs) = att_gᵀ · dout_g (the sum over the group's heads), att_g stored (gT, T).
    let dv = Batch { count, c: (btc + nk, head), a: (0, gt * t), b: (0, group) };
    w.gemm.matmul_batched(dev, g, ft(att), f(dy), (t, hs, gt), &dv, false)?;
    softmax_backward(dev, dpre, att, s.b * s.nh * t, t, scale_of(s))?; // dpre (B, NH, T, T)
    // dQ_g (gT, hs) = dpre_g (gT, T) · K_g (T, hs).
    per_head(&w.gemm, dev, g, (f(dpre), (0, gt * t)), (f(heads), (btc, head)), (gt, hs, t), s)?;
    // dK_g (T, hs) = dpre_gᵀ · Q_g.
    let dk = Batch { count, c: (btc, head), a: (0, gt * t), b: (0, group) };
    w.gemm.matmul_batched(dev, g, ft(dpre), f(heads), (t, hs, gt), &dk, false)?;
    merge_heads(dev, dqkv, g, s, 3, true)
}
