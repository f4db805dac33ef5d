//! Typed launchers for Llama's layers: RMSNorm (kernels/rmsnorm.cu), SwiGLU (kernels/swiglu.cu)
//! and rotary position embeddings (kernels/rope.cu). Grouped-query attention is
//! [`super::ops_attention`] with `AttnShape::nkv < nh`.
//!
//! As in [`super::ops`]: every buffer is checked against the elements the kernel touches before
//! anything runs, arguments go in the kernel's C order, and on the CPU device each op runs its
//! reference function (`cpu::rmsnorm`, `cpu::swiglu`, `cpu::rope`) on the host buffers, so the
//! CPU arm is the reference the emu and GPU arms are tested against. All f32.

use super::cpu::rope as cpu_rope;
use super::cpu::{rmsnorm, swiglu};
use super::ops::{as_i32, as_u32, f32s, host, host_mut, need, stride_grid, THREADS};
use super::{Device, DeviceBuffer, KernelArg as A, LaunchDims};
use crate::error::{Error, Result};

pub use super::cpu::rope::{rope_table, Llama3Scaling, RopeShape};

/// Columns per block and row lanes of the weight-gradient kernel (`MT_COL_TILE`,
/// `MT_ROW_LANES` in kernels/compat.h).
const COL_TILE: u32 = 64;
const ROW_LANES: u32 = 16;

/// RMSNorm forward over `n` rows of `c`: out (N, C) = inp * rstd * weight, rstd (N) =
/// 1/sqrt(mean(inp²) + eps). Reference: `cpu::rmsnorm::rmsnorm_forward`.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_forward(
    dev: &Device,
    out: &mut DeviceBuffer,
    rstd: &mut DeviceBuffer,
    inp: &DeviceBuffer,
    weight: &DeviceBuffer,
    n: usize,
    c: usize,
    eps: f32,
) -> Result<()> {
    let k = "rmsnorm_forward_f32";
    check_rows(k, n, c)?;
    need(k, "out", out, f32s(n * c))?;
    need(k, "inp", inp, f32s(n * c))?;
    need(k, "rstd", rstd, f32s(n))?;
    need(k, "weight", weight, f32s(c))?;
    if let Device::Cpu = dev {
        rmsnorm::rmsnorm_forward(
            host_mut(k, out)?.view_mut::<f32>(n * c),
            host_mut(k, rstd)?.view_mut::<f32>(n),
            host(k, inp)?.view::<f32>(n * c),
            host(k, weight)?.view::<f32>(c),
            c,
            eps,
        );
        return Ok(());
    }
    if n == 0 {
        return Ok(());
    }
    let dims = LaunchDims::linear(as_u32(k, "rows", n)?, THREADS);
    let args = [
        A::Buf(out),
        A::Buf(rstd),
        A::Buf(inp),
        A::Buf(weight),
        A::I32(as_i32(k, "c", c)?),
        A::F32(eps),
    ];
    dev.launch(k, dims, &args)
}

/// RMSNorm backward, accumulating: dinp (N, C) +=, dweight (C) +=, from dout (N, C) and the
/// forward's inp, weight and rstd. Reference: `cpu::rmsnorm::rmsnorm_backward`.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward(
    dev: &Device,
    dinp: &mut DeviceBuffer,
    dweight: &mut DeviceBuffer,
    dout: &DeviceBuffer,
    inp: &DeviceBuffer,
    weight: &DeviceBuffer,
    rstd: &DeviceBuffer,
    n: usize,
    c: usize,
) -> Result<()> {
    let k = "rmsnorm_backward_dinp_f32";
    check_rows(k, n, c)?;
    for (what, buf) in [("dinp", &*dinp), ("dout", dout), ("inp", inp)] {
        need(k, what, buf, f32s(n * c))?;
    }
    need(k, "dweight", dweight, f32s(c))?;
    need(k, "weight", weight, f32s(c))?;
    need(k, "rstd", rstd, f32s(n))?;
    if let Device::Cpu = dev {
        rmsnorm::rmsnorm_backward(
            host_mut(k, dinp)?.view_mut::<f32>(n * c),
            host_mut(k, dweight)?.view_mut::<f32>(c),
            host(k, dout)?.view::<f32>(n * c),
            host(k, inp)?.view::<f32>(n * c),
            host(k, weight)?.view::<f32>(c),
            host(k, rstd)?.view::<f32>(n),
            c,
        );
        return Ok(());
    }
    if n == 0 {
        return Ok(());
    }
    let ci = as_i32(k, "c", c)?;
    let rows = LaunchDims::linear(as_u32(k, "rows", n)?, THREADS);
    let args = [
        A::Buf(dinp),
        A::Buf(dout),
        A::Buf(inp),
        A::Buf(weight),
        A::Buf(rstd),
        A::I32(ci),
    ];
    dev.launch(k, rows, &args)?;
    let k = "rmsnorm_backward_dweight_f32";
    let blocks = as_u32(k, "columns", c.div_ceil(COL_TILE as usize))?;
    let cols = LaunchDims {
        grid: (blocks, 1, 1),
        block: (COL_TILE, ROW_LANES, 1),
        shared_bytes: 0,
    };
    let args = [
        A::Buf(dweight),
        A::Buf(dout),
        A::Buf(inp),
        A::Buf(rstd),
        A::I32(as_i32(k, "n", n)?),
        A::I32(ci),
    ];
    dev.launch(k, cols, &args)
}

/// A row width of zero has no RMS (the mean of no squares); any row count is fine.
fn check_rows(k: &str, n: usize, c: usize) -> Result<()> {
    if c == 0 && n > 0 {
        return Err(Error::InvalidArgument(format!("{k}: rows of 0 channels")));
    }
    Ok(())
}

/// out (N, F) = silu(gate) * up for inp (N, 2F) rows `[gate | up]`. Reference:
/// `cpu::swiglu::swiglu_forward`.
pub fn swiglu_forward(
    dev: &Device,
    out: &mut DeviceBuffer,
    inp: &DeviceBuffer,
    n: usize,
    f: usize,
) -> Result<()> {
    let k = "swiglu_forward_f32";
    need(k, "out", out, f32s(n * f))?;
    need(k, "inp", inp, f32s(2 * n * f))?;
    if let Device::Cpu = dev {
        let x = host(k, inp)?.view::<f32>(2 * n * f);
        swiglu::swiglu_forward(host_mut(k, out)?.view_mut::<f32>(n * f), x, f);
        return Ok(());
    }
    let args = [
        A::Buf(out),
        A::Buf(inp),
        A::U64(f as u64),
        A::U64((n * f) as u64),
    ];
    dev.launch(k, stride_grid(n * f), &args)
}

/// dinp (N, 2F) = [d gate | d up] (OVERWRITTEN) from dout (N, F) and the forward's inp (N, 2F).
/// Reference: `cpu::swiglu::swiglu_backward`.
pub fn swiglu_backward(
    dev: &Device,
    dinp: &mut DeviceBuffer,
    dout: &DeviceBuffer,
    inp: &DeviceBuffer,
    n: usize,
    f: usize,
) -> Result<()> {
    let k = "swiglu_backward_f32";
    need(k, "dinp", dinp, f32s(2 * n * f))?;
    need(k, "dout", dout, f32s(n * f))?;
    need(k, "inp", inp, f32s(2 * n * f))?;
    if let Device::Cpu = dev {
        let (dy, x) = (
            host(k, dout)?.view::<f32>(n * f),
            host(k, inp)?.view::<f32>(2 * n * f),
        );
        swiglu::swiglu_backward(host_mut(k, dinp)?.view_mut::<f32>(2 * n * f), dy, x, f);
        return Ok(());
    }
    let args = [
        A::Buf(dinp),
        A::Buf(dout),
        A::Buf(inp),
        A::U64(f as u64),
        A::U64((n * f) as u64),
    ];
    dev.launch(k, stride_grid(n * f), &args)
}

/// Rotates the q and k heads of qkv (B, T, (NH + 2*NKV)*hd) in place by the tables cos, sin
/// (T, hd/2) of [`rope_table`] (uploaded); v is untouched. Reference: `cpu::rope::rope_forward`.
pub fn rope_forward(
    dev: &Device,
    qkv: &mut DeviceBuffer,
    cos: &DeviceBuffer,
    sin: &DeviceBuffer,
    s: RopeShape,
) -> Result<()> {
    rope(dev, qkv, cos, sin, s, false)
}

/// The transposed rotation of the dq and dk heads of dqkv, in place (the gradient of
/// [`rope_forward`]); dv is untouched. Reference: `cpu::rope::rope_backward`.
pub fn rope_backward(
    dev: &Device,
    dqkv: &mut DeviceBuffer,
    cos: &DeviceBuffer,
    sin: &DeviceBuffer,
    s: RopeShape,
) -> Result<()> {
    rope(dev, dqkv, cos, sin, s, true)
}

fn rope(
    dev: &Device,
    x: &mut DeviceBuffer,
    cos: &DeviceBuffer,
    sin: &DeviceBuffer,
    s: RopeShape,
    inverse: bool,
) -> Result<()> {
    let k = "rope_f32";
    if s.hd % 2 != 0 {
        return Err(Error::InvalidArgument(format!(
            "{k}: head width {} is odd (RoPE rotates pairs)",
            s.hd
        )));
    }
    let (n, half) = (s.b * s.t * s.row(), s.t * s.hd / 2);
    need(k, "qkv", x, f32s(n))?;
    need(k, "cos", cos, f32s(half))?;
    need(k, "sin", sin, f32s(half))?;
    if let Device::Cpu = dev {
        let (c, sn) = (
            host(k, cos)?.view::<f32>(half),
            host(k, sin)?.view::<f32>(half),
        );
        let x = host_mut(k, x)?.view_mut::<f32>(n);
        if inverse {
            cpu_rope::rope_backward(x, c, sn, s)
        } else {
            cpu_rope::rope_forward(x, c, sn, s)
        }
        return Ok(());
    }
    let pairs = s.b * s.t * (s.nh + s.nkv) * (s.hd / 2);
    let args = [
        A::Buf(x),
        A::Buf(cos),
        A::Buf(sin),
        A::I32(as_i32(k, "t", s.t)?),
        A::I32(as_i32(k, "nh", s.nh)?),
        A::I32(as_i32(k, "nkv", s.nkv)?),
        A::I32(as_i32(k, "hd", s.hd)?),
        A::I32(inverse as i32),
        A::U64(pairs as u64),
    ];
    dev.launch(k, stride_grid(pairs), &args)
}
