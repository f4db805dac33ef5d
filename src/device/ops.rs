//! Typed launchers for every kernel in `kernels/*.cu`: they check each buffer against the
//! elements the kernel will touch (so no launch can read or write out of bounds), pick the grid,
//! and pass arguments in the kernel's C order. Shapes and semantics are those of the CPU
//! reference functions named in each doc comment; all model kernels are f32.
//!
//! On the CPU device every op runs its reference function on the host buffers instead of a
//! kernel (after the same checks), so code written against these ops (the device model, the
//! device collectives) runs and is tested on any machine; on a GPU only the kernels differ.

use std::ops::Range;

use super::buffer::wrong_device;
use super::cpu::adamw::{self, AdamWStep};
use super::cpu::parallel::{chunk_items, run_parts};
use super::cpu::{cross_entropy, encoder, gelu, layernorm, residual};
use super::kernels::{avg_div_kernel, reduce_kernel};
use super::{Device, DeviceBuffer, HostBytes, KernelArg as A, LaunchDims};
use crate::dtype::{DType, ReduceOp, Reducer};
use crate::error::{Error, Result};

/// Threads per block of the 1-D launches: a multiple of both warp (32) and wavefront (64) widths.
pub(crate) const THREADS: u32 = 256;

/// Columns per block and row lanes per column of the column-sum kernels (`MT_COL_TILE`,
/// `MT_ROW_LANES` in kernels/compat.h).
const COL_TILE: u32 = 64;
const ROW_LANES: u32 = 16;

/// The launch of a column-sum kernel over `cols` columns: one (COL_TILE, ROW_LANES) block per
/// COL_TILE columns.
fn column_tiles(k: &str, cols: usize) -> Result<LaunchDims> {
    let blocks = as_u32(k, "columns", cols.div_ceil(COL_TILE as usize))?.max(1);
    Ok(LaunchDims { grid: (blocks, 1, 1), block: (COL_TILE, ROW_LANES, 1), shared_bytes: 0 })
}
/// Grid cap for grid-stride kernels (plenty to fill any current GPU).
const MAX_BLOCKS: u64 = 1 << 16;

pub(crate) fn f32s(n: usize) -> usize {
    n * 4
}

/// Errors unless `buf` holds at least `bytes` bytes.
pub(crate) fn need(kernel: &str, what: &str, buf: &DeviceBuffer, bytes: usize) -> Result<()> {
    if buf.len() < bytes {
        return Err(Error::InvalidArgument(format!(
            "{kernel}: `{what}` holds {} bytes but the shape needs {bytes}",
            buf.len()
        )));
    }
    Ok(())
}

pub(crate) fn as_i32(kernel: &str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::InvalidArgument(format!("{kernel}: `{what}` = {v} exceeds i32")))
}

pub(crate) fn as_u32(kernel: &str, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::InvalidArgument(format!("{kernel}: `{what}` = {v} exceeds u32")))
}

/// The host bytes of a CPU-device or emu buffer (ops check sizes before viewing them).
pub(crate) fn host<'a>(op: &str, buf: &'a DeviceBuffer) -> Result<&'a HostBytes> {
    match buf {
        DeviceBuffer::Host(h) | DeviceBuffer::Emu(h) => Ok(h),
        other => Err(wrong_device(op, &Device::Cpu, other)),
    }
}

/// [`host`], mutable.
pub(crate) fn host_mut<'a>(op: &str, buf: &'a mut DeviceBuffer) -> Result<&'a mut HostBytes> {
    match buf {
        DeviceBuffer::Host(h) | DeviceBuffer::Emu(h) => Ok(h),
        other => Err(wrong_device(op, &Device::Cpu, other)),
    }
}

/// Grid for a grid-stride loop over `items` work items, one per thread (at least one block:
/// a grid of zero blocks is a launch error, and the loop bound makes the extra block idle; kernels
/// launched one block per row return early on zero rows instead).
pub(crate) fn stride_grid(items: usize) -> LaunchDims {
    let blocks = (items as u64).div_ceil(THREADS as u64).clamp(1, MAX_BLOCKS);
    LaunchDims::linear(blocks as u32, THREADS)
}

/// A buffer an op writes, named, with the bytes its kernel touches.
pub(crate) type Out<'a> = (&'static str, &'a mut DeviceBuffer, usize);
/// A buffer an op only reads, named, with the bytes its kernel touches.
pub(crate) type In<'a> = (&'static str, &'a DeviceBuffer, usize);

/// The shape every launcher shares: checks each buffer of `outs` and `ins` against the bytes its
/// kernel touches (an error naming kernel `k` and the buffer, before anything runs), then on the
/// CPU device runs `cpu` on the buffers' host bytes (the reference), on the others `gpu` on the
/// buffers themselves (it picks the grid and launches). Both get the buffers in the order given.
pub(crate) fn launch_op<'a, const W: usize, const R: usize>(
    dev: &Device,
    k: &str,
    (outs, ins): ([Out<'a>; W], [In<'a>; R]),
    cpu: impl FnOnce([&mut HostBytes; W], [&HostBytes; R]),
    gpu: impl FnOnce([&DeviceBuffer; W], [&DeviceBuffer; R]) -> Result<()>,
) -> Result<()> {
    for (what, buf, bytes) in &outs {
        need(k, what, buf, *bytes)?;
    }
    for (what, buf, bytes) in &ins {
        need(k, what, buf, *bytes)?;
    }
    if let Device::Cpu = dev {
        let outs = all_ok(outs.map(|(_, buf, _)| host_mut(k, buf)))?;
        cpu(outs, all_ok(ins.map(|(_, buf, _)| host(k, buf)))?);
        return Ok(());
    }
    gpu(outs.map(|(_, buf, _)| shared(buf)), ins.map(|(_, buf, _)| buf))
}

fn shared(buf: &mut DeviceBuffer) -> &DeviceBuffer {
    buf
}

/// The values of `xs`, or the first error.
fn all_ok<T, const N: usize>(xs: [Result<T>; N]) -> Result<[T; N]> {
    let v = xs.into_iter().collect::<Result<Vec<T>>>()?;
    v.try_into().map_err(|_| Error::Check("all_ok: length changed".into()))
}

/// Launches kernel `k` one block of [`THREADS`] per row over `n` rows; nothing on zero rows (a
/// grid of no blocks is a launch error, and there is no work).
pub(crate) fn launch_rows(dev: &Device, k: &str, n: usize, args: &[A]) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    dev.launch(k, LaunchDims::linear(as_u32(k, "rows", n)?, THREADS), args)
}

/// `out = a (op) b` over `n` elements of `dtype` (`Avg` sums; finish it with [`avg_divide`]);
/// `out` may be `a`'s buffer only through [`reduce_into`]. Reference: `Reducer::reduce_out`.
pub fn reduce(
    dev: &Device,
    dtype: DType,
    op: ReduceOp,
    out: &mut DeviceBuffer,
    a: &DeviceBuffer,
    b: &DeviceBuffer,
    n: usize,
) -> Result<()> {
    let k = reduce_kernel(dtype, op);
    let bytes = n * dtype.size();
    let cpu = |[out]: [&mut HostBytes; 1], [a, b]: [&HostBytes; 2]| {
        Reducer::new(dtype, op).reduce_out(&mut out.bytes_mut()[..bytes], &a.bytes()[..bytes], &b.bytes()[..bytes])
    };
    launch_op(dev, &k, ([("out", out, bytes)], [("a", a, bytes), ("b", b, bytes)]), cpu, |[out], [a, b]| {
        dev.launch(&k, reduce_grid(dtype, n), &[A::Buf(out), A::Buf(a), A::Buf(b), A::U64(n as u64)])
    })
}

/// The grid of the reduce kernels: one thread per 16-byte vector of `n` elements of `dtype`.
fn reduce_grid(dtype: DType, n: usize) -> LaunchDims {
    stride_grid(n.div_ceil(16 / dtype.size()))
}

/// `acc = acc (op) x` over `n` elements. Reference: `Reducer::reduce_into`.
pub fn reduce_into(
    dev: &Device,
    dtype: DType,
    op: ReduceOp,
    acc: &mut DeviceBuffer,
    x: &DeviceBuffer,
    n: usize,
) -> Result<()> {
    let k = reduce_kernel(dtype, op);
    let bytes = n * dtype.size();
    let cpu = |[acc]: [&mut HostBytes; 1], [x]: [&HostBytes; 1]| {
        Reducer::new(dtype, op).reduce_into(&mut acc.bytes_mut()[..bytes], &x.bytes()[..bytes])
    };
    launch_op(dev, &k, ([("acc", acc, bytes)], [("x", x, bytes)]), cpu, |[acc], [x]| {
        dev.launch(&k, reduce_grid(dtype, n), &[A::Buf(acc), A::Buf(acc), A::Buf(x), A::U64(n as u64)])
    })
}

/// Divides `n` summed elements by `ranks` (the end of `Avg`). Reference: `Reducer::finalize`.
pub fn avg_divide(dev: &Device, dtype: DType, buf: &mut DeviceBuffer, n: usize, ranks: usize) -> Result<()> {
    let k = avg_div_kernel(dtype);
    need(&k, "buf", buf, n * dtype.size())?;
    if ranks == 0 || (dtype == DType::U8 && ranks > u8::MAX as usize) {
        return Err(Error::InvalidArgument(format!(
            "{k}: cannot divide by {ranks} ranks"
        )));
    }
    if let Device::Cpu = dev {
        let bytes = n * dtype.size();
        Reducer::new(dtype, ReduceOp::Avg).finalize(&mut host_mut(&k, buf)?.bytes_mut()[..bytes], ranks);
        return Ok(());
    }
    dev.launch(
        &k,
        stride_grid(n),
        &[A::Buf(buf), A::U64(n as u64), A::I64(ranks as i64)],
    )
}

/// The buffers of [`layernorm_forward`].
pub struct LayerNormForward<'a> {
    /// Output (N, C).
    pub out: &'a mut DeviceBuffer,
    /// Per-row mean (N).
    pub mean: &'a mut DeviceBuffer,
    /// Per-row reciprocal standard deviation (N).
    pub rstd: &'a mut DeviceBuffer,
    /// Input (N, C).
    pub inp: &'a DeviceBuffer,
    /// Weight (C).
    pub weight: &'a DeviceBuffer,
    /// Bias (C).
    pub bias: &'a DeviceBuffer,
}

/// LayerNorm forward over `n` rows of `c`. Buffers: out (N, C), mean, rstd (N), inp (N, C),
/// weight, bias (C). Reference: `cpu::layernorm::layernorm_forward`.
pub fn layernorm_forward(dev: &Device, bufs: LayerNormForward, n: usize, c: usize) -> Result<()> {
    let LayerNormForward { out, mean, rstd, inp, weight, bias } = bufs;
    let k = "layernorm_forward_f32";
    let outs = [("out", out, f32s(n * c)), ("mean", mean, f32s(n)), ("rstd", rstd, f32s(n))];
    let ins = [("inp", inp, f32s(n * c)), ("weight", weight, f32s(c)), ("bias", bias, f32s(c))];
    let cpu = |[out, mean, rstd]: [&mut HostBytes; 3], [inp, w, b]: [&HostBytes; 3]| {
        let (out, mean, rstd) = (out.view_mut::<f32>(n * c), mean.view_mut::<f32>(n), rstd.view_mut::<f32>(n));
        layernorm::layernorm_forward(out, mean, rstd, inp.view::<f32>(n * c), w.view::<f32>(c), b.view::<f32>(c), c)
    };
    launch_op(dev, k, (outs, ins), cpu, |[out, mean, rstd], [inp, weight, bias]| {
        let args = [A::Buf(out), A::Buf(mean), A::Buf(rstd), A::Buf(inp), A::Buf(weight), A::Buf(bias), A::I32(as_i32(k, "c", c)?)];
        launch_rows(dev, k, n, &args)
    })
}

/// The buffers of [`layernorm_backward`].
pub struct LayerNormBackward<'a> {
    /// Input gradient (N, C), accumulated.
    pub dinp: &'a mut DeviceBuffer,
    /// Weight gradient (C), accumulated.
    pub dweight: &'a mut DeviceBuffer,
    /// Bias gradient (C), accumulated.
    pub dbias: &'a mut DeviceBuffer,
    /// Output gradient (N, C).
    pub dout: &'a DeviceBuffer,
    /// The forward's input (N, C).
    pub inp: &'a DeviceBuffer,
    /// Weight (C).
    pub weight: &'a DeviceBuffer,
    /// The forward's per-row mean (N).
    pub mean: &'a DeviceBuffer,
    /// The forward's per-row reciprocal standard deviation (N).
    pub rstd: &'a DeviceBuffer,
}

/// LayerNorm backward, accumulating: dinp (N, C) +=, dweight, dbias (C) +=. Reference:
/// `cpu::layernorm::layernorm_backward`.
pub fn layernorm_backward(dev: &Device, bufs: LayerNormBackward, n: usize, c: usize) -> Result<()> {
    let LayerNormBackward { dinp, dweight, dbias, dout, inp, weight, mean, rstd } = bufs;
    let k = "layernorm_backward_dinp_f32";
    let outs = [("dinp", dinp, f32s(n * c)), ("dweight", dweight, f32s(c)), ("dbias", dbias, f32s(c))];
    let ins = [
        ("dout", dout, f32s(n * c)),
        ("inp", inp, f32s(n * c)),
        ("weight", weight, f32s(c)),
        ("mean", mean, f32s(n)),
        ("rstd", rstd, f32s(n)),
    ];
    let cpu = |[dinp, dw, db]: [&mut HostBytes; 3], [dout, inp, w, mean, rstd]: [&HostBytes; 5]| {
        let (dinp, dw, db) = (dinp.view_mut::<f32>(n * c), dw.view_mut::<f32>(c), db.view_mut::<f32>(c));
        let (dout, inp) = (dout.view::<f32>(n * c), inp.view::<f32>(n * c));
        layernorm::layernorm_backward(dinp, dw, db, dout, inp, w.view::<f32>(c), mean.view::<f32>(n), rstd.view::<f32>(n), c)
    };
    launch_op(dev, k, (outs, ins), cpu, |[dinp, dweight, dbias], [dout, inp, weight, mean, rstd]| {
        let ci = as_i32(k, "c", c)?;
        let args = [A::Buf(dinp), A::Buf(dout), A::Buf(inp), A::Buf(weight), A::Buf(mean), A::Buf(rstd), A::I32(ci)];
        launch_rows(dev, k, n, &args)?;
        let grads = NormParamGrads { dweight, dbias: Some(dbias), dout, inp, mean: Some(mean), rstd };
        norm_dparams(dev, grads, n, c)
    })
}

/// The buffers of a norm layer's parameter gradients (kernel `norm_backward_dparams_f32`):
/// LayerNorm's, or RMSNorm's without `dbias` and `mean`.
pub(crate) struct NormParamGrads<'a> {
    /// Weight gradient (C), accumulated.
    pub dweight: &'a DeviceBuffer,
    /// Bias gradient (C), accumulated (LayerNorm).
    pub dbias: Option<&'a DeviceBuffer>,
    /// Output gradient and the forward's input (N, C).
    pub dout: &'a DeviceBuffer,
    pub inp: &'a DeviceBuffer,
    /// The forward's per-row mean (LayerNorm) and reciprocal standard deviation (N).
    pub mean: Option<&'a DeviceBuffer>,
    pub rstd: &'a DeviceBuffer,
}

/// Launches the column sums of a norm layer's parameter gradients over `n` rows of `c` (GPU arms;
/// the CPU arm is `cpu::norm_params`, run by the reference backward). The caller checked the
/// buffers' sizes. Nothing on zero rows.
pub(crate) fn norm_dparams(dev: &Device, g: NormParamGrads, n: usize, c: usize) -> Result<()> {
    let k = "norm_backward_dparams_f32";
    if n == 0 {
        return Ok(());
    }
    fn opt(b: Option<&DeviceBuffer>) -> A<'_> {
        b.map_or(A::Null, A::Buf)
    }
    let (ni, ci) = (A::I32(as_i32(k, "n", n)?), A::I32(as_i32(k, "c", c)?));
    let args = [A::Buf(g.dweight), opt(g.dbias), A::Buf(g.dout), A::Buf(g.inp), opt(g.mean), A::Buf(g.rstd), ni, ci];
    dev.launch(k, column_tiles(k, c)?, &args)
}

/// out (N) = gelu(inp (N)). Reference: `cpu::gelu::gelu_forward`.
pub fn gelu_forward(
    dev: &Device,
    out: &mut DeviceBuffer,
    inp: &DeviceBuffer,
    n: usize,
) -> Result<()> {
    let k = "gelu_forward_f32";
    let cpu = |[out]: [&mut HostBytes; 1], [inp]: [&HostBytes; 1]| gelu::gelu_forward(out.view_mut::<f32>(n), inp.view::<f32>(n));
    launch_op(dev, k, ([("out", out, f32s(n))], [("inp", inp, f32s(n))]), cpu, |[out], [inp]| {
        dev.launch(k, stride_grid(n), &[A::Buf(out), A::Buf(inp), A::U64(n as u64)])
    })
}

/// dinp (N) += gelu'(inp) * dout. Reference: `cpu::gelu::gelu_backward`.
pub fn gelu_backward(
    dev: &Device,
    dinp: &mut DeviceBuffer,
    inp: &DeviceBuffer,
    dout: &DeviceBuffer,
    n: usize,
) -> Result<()> {
    let k = "gelu_backward_f32";
    let bufs = ([("dinp", dinp, f32s(n))], [("inp", inp, f32s(n)), ("dout", dout, f32s(n))]);
    let cpu = |[dinp]: [&mut HostBytes; 1], [inp, dout]: [&HostBytes; 2]| {
        gelu::gelu_backward(dinp.view_mut::<f32>(n), inp.view::<f32>(n), dout.view::<f32>(n))
    };
    launch_op(dev, k, bufs, cpu, |[dinp], [inp, dout]| {
        dev.launch(k, stride_grid(n), &[A::Buf(dinp), A::Buf(inp), A::Buf(dout), A::U64(n as u64)])
    })
}

/// The buffers of [`cross_entropy_forward`].
pub struct CrossEntropyForward<'a> {
    /// Per-row loss (N).
    pub losses: &'a mut DeviceBuffer,
    /// Per-row log-sum-exp (N).
    pub lse: &'a mut DeviceBuffer,
    /// Logits (N, Vp).
    pub logits: &'a DeviceBuffer,
    /// Target token ids (N, u32).
    pub targets: &'a DeviceBuffer,
}

/// losses (N), lse (N) from logits (N, Vp) and u32 targets (N) over columns 0..v. Reference:
/// `cpu::cross_entropy::cross_entropy_forward`.
pub fn cross_entropy_forward(dev: &Device, bufs: CrossEntropyForward, n: usize, v: usize, vp: usize) -> Result<()> {
    let CrossEntropyForward { losses, lse, logits, targets } = bufs;
    let k = "cross_entropy_forward_f32";
    check_vocab(k, v, vp)?;
    let outs = [("losses", losses, f32s(n)), ("lse", lse, f32s(n))];
    let ins = [("targets", targets, 4 * n), ("logits", logits, f32s(n * vp))];
    let cpu = |[losses, lse]: [&mut HostBytes; 2], [targets, logits]: [&HostBytes; 2]| {
        let (logits, targets) = (logits.view::<f32>(n * vp), targets.view::<u32>(n));
        cross_entropy::cross_entropy_forward(losses.view_mut::<f32>(n), lse.view_mut::<f32>(n), logits, targets, v, vp)
    };
    launch_op(dev, k, (outs, ins), cpu, |[losses, lse], [targets, logits]| {
        let (vi, vpi) = (A::I32(as_i32(k, "v", v)?), A::I32(as_i32(k, "vp", vp)?));
        launch_rows(dev, k, n, &[A::Buf(losses), A::Buf(lse), A::Buf(logits), A::Buf(targets), vi, vpi])
    })
}

fn check_vocab(k: &str, v: usize, vp: usize) -> Result<()> {
    if v == 0 || v > vp {
        return Err(Error::InvalidArgument(format!(
            "{k}: vocabulary {v} must be in 1..={vp} (padded)"
        )));
    }
    Ok(())
}

/// Buffers of one AdamW update: the flat parameter, gradient and moment buffers (f32).
pub struct AdamWBuffers<'a> {
    /// Parameters, updated in place.
    pub params: &'a mut DeviceBuffer,
    /// Gradients.
    pub grads: &'a DeviceBuffer,
    /// First moments, updated in place.
    pub m: &'a mut DeviceBuffer,
    /// Second moments, updated in place.
    pub v: &'a mut DeviceBuffer,
}

/// The AdamW update `s` (step number from 1, learning rate, gradient multiplier for clipping)
/// over the elements `span` of the four flat buffers, with weight decay `s.config.weight_decay`
/// if `decay`, else none. The caller launches once per decay-mask segment. Per-step coefficients
/// are computed in f64 and rounded to f32 exactly as the CPU arm does; the CPU arm splits the
/// span across its threads (element-wise, so the bits do not depend on the split). Reference:
/// `cpu::adamw::update_elements`.
pub fn adamw_update(
    dev: &Device,
    bufs: AdamWBuffers,
    span: Range<usize>,
    s: &AdamWStep,
    decay: bool,
) -> Result<()> {
    let k = "adamw_f32";
    check_adamw(s, &span, [&*bufs.params, bufs.grads, &*bufs.m, &*bufs.v])?;
    let wd = if decay { s.config.weight_decay } else { 0.0 };
    let coef = adamw::Coefficients::<f32>::new(s);
    if let Device::Cpu = dev {
        let g = &host(k, bufs.grads)?.view::<f32>(span.end)[span.clone()];
        let p = &mut host_mut(k, bufs.params)?.view_mut::<f32>(span.end)[span.clone()];
        let m = &mut host_mut(k, bufs.m)?.view_mut::<f32>(span.end)[span.clone()];
        let v = &mut host_mut(k, bufs.v)?.view_mut::<f32>(span.end)[span.clone()];
        let per = chunk_items(span.len(), 1);
        let parts = p.chunks_mut(per).zip(g.chunks(per));
        let moments = m.chunks_mut(per).zip(v.chunks_mut(per));
        run_parts(parts.zip(moments), |((p, g), (m, v))| {
            adamw::update_elements(&coef, wd as f32, p, g, m, v)
        });
        return Ok(());
    }
    let [b1, b2, one_b1, one_b2, inv_bc1, inv_bc2, lr, eps, grad_scale] = coef.in_kernel_order().map(A::F32);
    let off = f32s(span.start);
    let n = span.len();
    let args = [
        A::BufAt(bufs.params, off),
        A::BufAt(bufs.grads, off),
        A::BufAt(bufs.m, off),
        A::BufAt(bufs.v, off),
        A::U64(n as u64),
        b1,
        b2,
        one_b1,
        one_b2,
        inv_bc1,
        inv_bc2,
        lr,
        eps,
        A::F32(wd as f32),
        grad_scale,
    ];
    dev.launch(k, stride_grid(n), &args)
}

/// Errors unless `s` is a step from 1 and each of params, grads, m, v holds the elements of `span`.
fn check_adamw(s: &AdamWStep, span: &Range<usize>, bufs: [&DeviceBuffer; 4]) -> Result<()> {
    let k = "adamw_f32";
    if s.step == 0 {
        return Err(Error::InvalidArgument(format!("{k}: steps count from 1")));
    }
    for (what, buf) in ["params", "grads", "m", "v"].into_iter().zip(bufs) {
        need(k, what, buf, f32s(span.end))?;
    }
    Ok(())
}

/// The buffers of [`adamw_update_clearing`]: [`AdamWBuffers`] with the gradients writable.
pub struct AdamWClearing<'a> {
    /// Parameters, updated in place.
    pub params: &'a mut DeviceBuffer,
    /// Gradients, read and (CPU arm) set to zero.
    pub grads: &'a mut DeviceBuffer,
    /// First moments, updated in place.
    pub m: &'a mut DeviceBuffer,
    /// Second moments, updated in place.
    pub v: &'a mut DeviceBuffer,
}

/// [`adamw_update`] that also leaves the gradients of `span` at zero where that costs no pass of
/// its own: the CPU arm zeroes each gradient in the update's loop, right after reading it
/// (`cpu::adamw::update_elements_clearing`, the same bits as the plain update), and returns
/// true; the GPU arms run the plain update, leave the gradients as they are and return false.
pub fn adamw_update_clearing(dev: &Device, bufs: AdamWClearing, span: Range<usize>, s: &AdamWStep, decay: bool) -> Result<bool> {
    let AdamWClearing { params, grads, m, v } = bufs;
    if !matches!(dev, Device::Cpu) {
        adamw_update(dev, AdamWBuffers { params, grads, m, v }, span, s, decay)?;
        return Ok(false);
    }
    let k = "adamw_f32";
    check_adamw(s, &span, [&*params, &*grads, &*m, &*v])?;
    let wd = if decay { s.config.weight_decay as f32 } else { 0.0 };
    let coef = adamw::Coefficients::new(s);
    let g = &mut host_mut(k, grads)?.view_mut::<f32>(span.end)[span.clone()];
    let p = &mut host_mut(k, params)?.view_mut::<f32>(span.end)[span.clone()];
    let m = &mut host_mut(k, m)?.view_mut::<f32>(span.end)[span.clone()];
    let v = &mut host_mut(k, v)?.view_mut::<f32>(span.end)[span.clone()];
    let per = chunk_items(span.len(), 1);
    let parts = p.chunks_mut(per).zip(g.chunks_mut(per));
    let moments = m.chunks_mut(per).zip(v.chunks_mut(per));
    run_parts(parts.zip(moments), |((p, g), (m, v))| adamw::update_elements_clearing(&coef, wd, p, g, m, v));
    Ok(true)
}

/// The element-wise cast kernel `k`: out (N) of `O` = inp (N) of `I`, `f` on the CPU arm.
fn cast<I: bytemuck::Pod, O: bytemuck::Pod>(dev: &Device, k: &str, out: &mut DeviceBuffer, inp: &DeviceBuffer, n: usize, f: impl Fn(I) -> O) -> Result<()> {
    let bufs = ([("out", out, n * std::mem::size_of::<O>())], [("inp", inp, n * std::mem::size_of::<I>())]);
    let cpu = |[out]: [&mut HostBytes; 1], [inp]: [&HostBytes; 1]| {
        out.view_mut::<O>(n).iter_mut().zip(inp.view::<I>(n)).for_each(|(o, &x)| *o = f(x));
    };
    launch_op(dev, k, bufs, cpu, |[out], [inp]| dev.launch(k, stride_grid(n), &[A::Buf(out), A::Buf(inp), A::U64(n as u64)]))
}

/// out (N) bf16 = inp (N) f32, rounding to nearest even.
pub fn cast_f32_to_bf16(dev: &Device, out: &mut DeviceBuffer, inp: &DeviceBuffer, n: usize) -> Result<()> {
    cast::<f32, half::bf16>(dev, "cast_f32_to_bf16", out, inp, n, half::bf16::from_f32)
}

/// out (N) f32 = inp (N) bf16.
pub fn cast_bf16_to_f32(dev: &Device, out: &mut DeviceBuffer, inp: &DeviceBuffer, n: usize) -> Result<()> {
    cast::<half::bf16, f32>(dev, "cast_bf16_to_f32", out, inp, n, |x: half::bf16| x.to_f32())
}

/// out (N) IEEE half = inp (N) f32, rounding to nearest even; beyond fp16's range (65504 and the
/// half-way point above it) the result is infinity, as the hardware conversions do.
pub fn cast_f32_to_f16(dev: &Device, out: &mut DeviceBuffer, inp: &DeviceBuffer, n: usize) -> Result<()> {
    cast::<f32, half::f16>(dev, "cast_f32_to_f16", out, inp, n, half::f16::from_f32)
}

/// out (N) f32 = inp (N) IEEE half (exact).
pub fn cast_f16_to_f32(dev: &Device, out: &mut DeviceBuffer, inp: &DeviceBuffer, n: usize) -> Result<()> {
    cast::<half::f16, f32>(dev, "cast_f16_to_f32", out, inp, n, |x: half::f16| x.to_f32())
}

/// out (N) = skip (N) + branch (N). Reference: `cpu::residual::residual_forward`.
pub fn residual_forward(
    dev: &Device,
    out: &mut DeviceBuffer,
    skip: &DeviceBuffer,
    branch: &DeviceBuffer,
    n: usize,
) -> Result<()> {
    let k = "residual_forward_f32";
    let bufs = ([("out", out, f32s(n))], [("skip", skip, f32s(n)), ("branch", branch, f32s(n))]);
    let cpu = |[out]: [&mut HostBytes; 1], [skip, branch]: [&HostBytes; 2]| {
        residual::residual_forward(out.view_mut::<f32>(n), skip.view::<f32>(n), branch.view::<f32>(n))
    };
    launch_op(dev, k, bufs, cpu, |[out], [skip, branch]| {
        dev.launch(k, stride_grid(n), &[A::Buf(out), A::Buf(skip), A::Buf(branch), A::U64(n as u64)])
    })
}

/// The buffers of [`encoder_forward`].
pub struct EncoderForward<'a> {
    /// Output (B*T, C).
    pub out: &'a mut DeviceBuffer,
    /// Token ids (B*T, u32).
    pub tokens: &'a DeviceBuffer,
    /// Token embeddings (Vp, C).
    pub wte: &'a DeviceBuffer,
    /// Position embeddings (>= T, C).
    pub wpe: &'a DeviceBuffer,
}

/// out (B*T, C) = wte (Vp, C) rows of `tokens` (B*T, u32, each < Vp) + wpe (>= T, C) rows
/// `i % t`. Reference: `cpu::encoder::encoder_forward`.
pub fn encoder_forward(dev: &Device, bufs: EncoderForward, bt: usize, t: usize, c: usize) -> Result<()> {
    let EncoderForward { out, tokens, wte, wpe } = bufs;
    let k = "encoder_forward_f32";
    need(k, "out", out, f32s(bt * c))?;
    need(k, "tokens", tokens, 4 * bt)?;
    need(k, "wpe", wpe, f32s(t * c))?;
    if let Device::Cpu = dev {
        let vp = wte.len() / f32s(c);
        encoder::encoder_forward(
            host_mut(k, out)?.view_mut::<f32>(bt * c),
            host(k, tokens)?.view::<u32>(bt),
            host(k, wte)?.view::<f32>(vp * c),
            host(k, wpe)?.view::<f32>(t * c),
            t,
            c,
        );
        return Ok(());
    }
    let args = [
        A::Buf(out),
        A::Buf(tokens),
        A::Buf(wte),
        A::Buf(wpe),
        A::U64((bt * c) as u64),
        A::I32(as_i32(k, "t", t)?),
        A::I32(as_i32(k, "c", c)?),
    ];
    dev.launch(k, stride_grid(bt * c), &args)
}

/// The buffers of [`encoder_backward`].
pub struct EncoderBackward<'a> {
    /// Token embedding gradient (Vp, C), accumulated.
    pub dwte: &'a mut DeviceBuffer,
    /// Position embedding gradient (>= T, C), accumulated.
    pub dwpe: &'a mut DeviceBuffer,
    /// Output gradient (B*T, C).
    pub dout: &'a DeviceBuffer,
    /// The token index of the batch ([`super::ops_vocab::token_index`], u32): the ids (B*T) first.
    pub tokens: &'a DeviceBuffer,
}

/// dwte (Vp, C) += dout (B*T, C) scattered to the rows of the tokens; dwpe (>= T, C) += the sum
/// over the batch. Reference: `cpu::encoder::encoder_backward` (the same additions in the same
/// order on every arm). `tokens` holds the batch's [`super::ops_vocab::token_index`] (the CPU arm
/// reads its first
/// B*T entries only).
pub fn encoder_backward(dev: &Device, bufs: EncoderBackward, b: usize, t: usize, c: usize) -> Result<()> {
    let EncoderBackward { dwte, dwpe, dout, tokens } = bufs;
    let k = "encoder_backward_wte_f32";
    let bt = b * t;
    need(k, "dout", dout, f32s(bt * c))?;
    need(k, "dwpe", dwpe, f32s(t * c))?;
    if let Device::Cpu = dev {
        need(k, "tokens", tokens, 4 * bt)?;
        let vp = dwte.len() / f32s(c);
        encoder::encoder_backward(
            host_mut(k, dwte)?.view_mut::<f32>(vp * c),
            host_mut(k, dwpe)?.view_mut::<f32>(t * c),
            host(k, dout)?.view::<f32>(bt * c),
            host(k, tokens)?.view::<u32>(bt),
            t,
            c,
        );
        return Ok(());
    }
    let ci = A::I32(as_i32(k, "c", c)?);
    let wpe_args = [A::Buf(dwpe), A::Buf(dout), A::U64(bt as u64), A::U64(0), A::I32(as_i32(k, "t", t)?), ci];
    dev.launch("encoder_backward_wpe_f32", stride_grid(t * c), &wpe_args)?;
    need(k, "tokens", tokens, 4 * super::ops_vocab::token_index_len(bt))?;
    let args = [A::Buf(dwte), A::Buf(dout), A::Buf(tokens), A::U64(bt as u64), ci];
    dev.launch(k, stride_grid(bt * c), &args)
}

/// out (N, OC) += bias (OC) on every row. Reference: `cpu::linear::linear_forward`'s bias.
pub fn bias_add(
    dev: &Device,
    out: &mut DeviceBuffer,
    bias: &DeviceBuffer,
    n: usize,
    oc: usize,
) -> Result<()> {
    let k = "bias_add_f32";
    let cpu = |[out]: [&mut HostBytes; 1], [bias]: [&HostBytes; 1]| {
        let bias = bias.view::<f32>(oc);
        let rows = out.view_mut::<f32>(n * oc).chunks_mut(chunk_items(n, oc) * oc.max(1));
        run_parts(rows, |part| {
            for row in part.chunks_exact_mut(oc.max(1)) {
                row.iter_mut().zip(bias).for_each(|(o, &b)| *o += b);
            }
        });
    };
    launch_op(dev, k, ([("out", out, f32s(n * oc))], [("bias", bias, f32s(oc))]), cpu, |[out], [bias]| {
        let args = [A::Buf(out), A::Buf(bias), A::U64((n * oc) as u64), A::I32(as_i32(k, "oc", oc)?)];
        dev.launch(k, stride_grid(n * oc), &args)
    })
}

/// dbias (OC) += column sums of dout (N, OC). Reference: `cpu::linear::linear_backward`'s bias.
pub fn bias_backward(
    dev: &Device,
    dbias: &mut DeviceBuffer,
    dout: &DeviceBuffer,
    n: usize,
    oc: usize,
) -> Result<()> {
    let k = "bias_backward_f32";
    let cpu = |[dbias]: [&mut HostBytes; 1], [dout]: [&HostBytes; 1]| {
        // Columns split across the cores; each column adds its rows in order.
        let dout = dout.view::<f32>(n * oc);
        let per = chunk_items(oc, n);
        run_parts(dbias.view_mut::<f32>(oc).chunks_mut(per).enumerate(), |(i, part)| {
            for row in dout.chunks_exact(oc) {
                part.iter_mut().zip(&row[i * per..]).for_each(|(g, &d)| *g += d);
            }
        });
    };
    launch_op(dev, k, ([("dbias", dbias, f32s(oc))], [("dout", dout, f32s(n * oc))]), cpu, |[dbias], [dout]| {
        let args = [A::Buf(dbias), A::Buf(dout), A::I32(as_i32(k, "n", n)?), A::I32(as_i32(k, "oc", oc)?)];
        dev.launch(k, column_tiles(k, oc)?, &args)
    })
}

/// buf (N) f32 = 0.
pub fn fill_zero(dev: &Device, buf: &mut DeviceBuffer, n: usize) -> Result<()> {
    let k = "fill_zero_f32";
    let cpu = |[buf]: [&mut HostBytes; 1], []: [&HostBytes; 0]| {
        let buf = buf.view_mut::<f32>(n);
        run_parts(buf.chunks_mut(chunk_items(n, 1)), |part| part.fill(0.0));
    };
    launch_op(dev, k, ([("buf", buf, f32s(n))], []), cpu, |[buf], []| {
        dev.launch(k, stride_grid(n), &[A::Buf(buf), A::U64(n as u64)])
    })
}

/// Blocks of [`sum_squares`] (and the length of its partials buffer).
pub const SUM_BLOCKS: usize = 1024;

/// Σ g² over the `n` f32 elements of `g` from element `start`; `partials` holds at least
/// [`SUM_BLOCKS`] f32. On a GPU each block sums its share in f32 and the host adds the block sums
/// in f64; the CPU arm is `cpu::clip::sum_of_squares`. Waits for the device (the result is a
/// host value).
pub fn sum_squares(dev: &Device, partials: &mut DeviceBuffer, g: &DeviceBuffer, start: usize, n: usize) -> Result<f64> {
    let k = "sum_squares_f32";
    need(k, "g", g, f32s(start + n))?;
    need(k, "partials", partials, f32s(SUM_BLOCKS))?;
    if let Device::Cpu = dev {
        return Ok(super::cpu::clip::sum_of_squares(
            &host(k, g)?.view::<f32>(start + n)[start..],
        ));
    }
    let blocks = n.div_ceil(THREADS as usize).clamp(1, SUM_BLOCKS);
    let args = [A::Buf(partials), A::BufAt(g, f32s(start)), A::U64(n as u64)];
    dev.launch(k, LaunchDims::linear(blocks as u32, THREADS), &args)?;
    let mut sums = vec![0f32; blocks];
    dev.copy_to_host(partials, &mut sums)?;
    Ok(sums.iter().map(|&s| f64::from(s)).sum())
}

/// Σ g² over the concatenation of the f32 `parts` (buffer, element range), bit for bit what
/// [`sum_squares`] gives on the parts packed one after the other: the CPU arm reads them in
/// place; a GPU packs them into `stage` (at least their total length) and sums that.
pub fn sum_squares_parts(
    dev: &Device,
    partials: &mut DeviceBuffer,
    stage: &mut DeviceBuffer,
    parts: &[(&DeviceBuffer, Range<usize>)],
) -> Result<f64> {
    let k = "sum_squares_f32";
    if let Device::Cpu = dev {
        let mut pieces = Vec::with_capacity(parts.len());
        for (buf, r) in parts {
            need(k, "g", buf, f32s(r.end))?;
            pieces.push(&host(k, buf)?.view::<f32>(r.end)[r.clone()]);
        }
        return Ok(super::cpu::clip::sum_of_squares_pieces(&pieces));
    }
    let mut at = 0;
    for (buf, r) in parts {
        copy(dev, stage, at, buf, r.start, r.len())?;
        at += r.len();
    }
    sum_squares(dev, partials, stage, 0, at)
}

/// Sets `flag` (one u32 on the device) to 1 if any of x[start..start + n] (f32) is NaN or
/// infinite; leaves it as it is otherwise, so one flag collects several calls until the caller
/// reads and clears it. No host synchronization.
pub fn mark_nonfinite(dev: &Device, flag: &mut DeviceBuffer, x: &DeviceBuffer, start: usize, n: usize) -> Result<()> {
    let k = "nonfinite_mark_f32";
    let cpu = |[flag]: [&mut HostBytes; 1], [x]: [&HostBytes; 1]| {
        let x = &x.view::<f32>(start + n)[start..];
        let bad = std::sync::atomic::AtomicBool::new(false);
        run_parts(x.chunks(chunk_items(n, 1)), |part| {
            if part.iter().any(|v| !v.is_finite()) {
                bad.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        });
        if bad.into_inner() {
            flag.view_mut::<u32>(1)[0] = 1;
        }
    };
    launch_op(dev, k, ([("flag", flag, 4)], [("x", x, f32s(start + n))]), cpu, |[flag], [x]| {
        dev.launch(k, stride_grid(n), &[A::BufAt(x, f32s(start)), A::U64(n as u64), A::Buf(flag)])
    })
}

/// g[start..start + n] *= s (f32). Reference: `cpu::clip::scale_grads`.
pub fn scale(dev: &Device, g: &mut DeviceBuffer, start: usize, n: usize, s: f32) -> Result<()> {
    let k = "scale_f32";
    let cpu = |[g]: [&mut HostBytes; 1], []: [&HostBytes; 0]| {
        let g = &mut g.view_mut::<f32>(start + n)[start..];
        run_parts(g.chunks_mut(chunk_items(n, 1)), |part| part.iter_mut().for_each(|x| *x *= s));
    };
    launch_op(dev, k, ([("g", g, f32s(start + n))], []), cpu, |[g], []| {
        dev.launch(k, stride_grid(n), &[A::BufAt(g, f32s(start)), A::F32(s), A::U64(n as u64)])
    })
}

/// dst[dst_start..][..n] = src[src_start..][..n] (f32 elements, distinct buffers).
pub fn copy(dev: &Device, dst: &mut DeviceBuffer, dst_start: usize, src: &DeviceBuffer, src_start: usize, n: usize) -> Result<()> {
    let k = "copy_f32";
    let cpu = |[dst]: [&mut HostBytes; 1], [src]: [&HostBytes; 1]| {
        dst.view_mut::<f32>(dst_start + n)[dst_start..].copy_from_slice(&src.view::<f32>(src_start + n)[src_start..])
    };
    launch_op(dev, k, ([("dst", dst, f32s(dst_start + n))], [("src", src, f32s(src_start + n))]), cpu, |[dst], [src]| {
        let args = [A::BufAt(dst, f32s(dst_start)), A::BufAt(src, f32s(src_start)), A::U64(n as u64)];
        dev.launch(k, stride_grid(n), &args)
    })
}
