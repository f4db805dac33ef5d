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
use super::ops::{as_i32, f32s, launch_op, launch_rows, norm_dparams, stride_grid, NormParamGrads};
use super::{Device, DeviceBuffer, HostBytes, KernelArg as A};
use crate::error::{Error, Result};

pub use super::cpu::rope::{rope_table, Llama3Scaling, RopeShape};

/// The buffers of [`rmsnorm_forward`].
pub struct RmsNormForward<'a> {
    /// Output (N, C).
    pub out: &'a mut DeviceBuffer,
    /// Per-row reciprocal RMS (N).
    pub rstd: &'a mut DeviceBuffer,
    /// Input (N, C).
    pub inp: &'a DeviceBuffer,
    /// Weight (C).
    pub weight: &'a DeviceBuffer,
}

/// RMSNorm forward over `n` rows of `c`: out (N, C) = inp * rstd * weight, rstd (N) =
/// 1/sqrt(mean(inp²) + eps). Reference: `cpu::rmsnorm::rmsnorm_forward`.
pub fn rmsnorm_forward(dev: &Device, bufs: RmsNormForward, n: usize, c: usize, eps: f32) -> Result<()> {
    let RmsNormForward { out, rstd, inp, weight } = bufs;
    let k = "rmsnorm_forward_f32";
    check_rows(k, n, c)?;
    let outs = [("out", out, f32s(n * c)), ("rstd", rstd, f32s(n))];
    let ins = [("inp", inp, f32s(n * c)), ("weight", weight, f32s(c))];
    let cpu = |[out, rstd]: [&mut HostBytes; 2], [inp, w]: [&HostBytes; 2]| {
        rmsnorm::rmsnorm_forward(out.view_mut::<f32>(n * c), rstd.view_mut::<f32>(n), inp.view::<f32>(n * c), w.view::<f32>(c), c, eps)
    };
    launch_op(dev, k, (outs, ins), cpu, |[out, rstd], [inp, weight]| {
        let args = [A::Buf(out), A::Buf(rstd), A::Buf(inp), A::Buf(weight), A::I32(as_i32(k, "c", c)?), A::F32(eps)];
        launch_rows(dev, k, n, &args)
    })
}

/// The buffers of [`rmsnorm_backward`].
pub struct RmsNormBackward<'a> {
    /// Input gradient (N, C), accumulated.
    pub dinp: &'a mut DeviceBuffer,
    /// Weight gradient (C), accumulated.
    pub dweight: &'a mut DeviceBuffer,
    /// Output gradient (N, C).
    pub dout: &'a DeviceBuffer,
    /// The forward's input (N, C).
    pub inp: &'a DeviceBuffer,
    /// Weight (C).
    pub weight: &'a DeviceBuffer,
    /// The forward's per-row reciprocal RMS (N).
    pub rstd: &'a DeviceBuffer,
}

/// RMSNorm backward, accumulating: dinp (N, C) +=, dweight (C) +=, from dout (N, C) and the
/// forward's inp, weight and rstd. Reference: `cpu::rmsnorm::rmsnorm_backward`.
pub fn rmsnorm_backward(dev: &Device, bufs: RmsNormBackward, n: usize, c: usize) -> Result<()> {
    let RmsNormBackward { dinp, dweight, dout, inp, weight, rstd } = bufs;
    let k = "rmsnorm_backward_dinp_f32";
    check_rows(k, n, c)?;
    let outs = [("dinp", dinp, f32s(n * c)), ("dweight", dweight, f32s(c))];
    let ins = [("dout", dout, f32s(n * c)), ("inp", inp, f32s(n * c)), ("weight", weight, f32s(c)), ("rstd", rstd, f32s(n))];
    let cpu = |[dinp, dw]: [&mut HostBytes; 2], [dout, inp, w, rstd]: [&HostBytes; 4]| {
        let (dout, inp) = (dout.view::<f32>(n * c), inp.view::<f32>(n * c));
        rmsnorm::rmsnorm_backward(dinp.view_mut::<f32>(n * c), dw.view_mut::<f32>(c), dout, inp, w.view::<f32>(c), rstd.view::<f32>(n), c)
    };
    launch_op(dev, k, (outs, ins), cpu, |[dinp, dweight], [dout, inp, weight, rstd]| {
        let ci = as_i32(k, "c", c)?;
        let args = [A::Buf(dinp), A::Buf(dout), A::Buf(inp), A::Buf(weight), A::Buf(rstd), A::I32(ci)];
        launch_rows(dev, k, n, &args)?;
        norm_dparams(dev, NormParamGrads { dweight, dbias: None, dout, inp, mean: None, rstd }, n, c)
    })
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
    let bufs = ([("out", out, f32s(n * f))], [("inp", inp, f32s(2 * n * f))]);
    let cpu = |[out]: [&mut HostBytes; 1], [inp]: [&HostBytes; 1]| {
        swiglu::swiglu_forward(out.view_mut::<f32>(n * f), inp.view::<f32>(2 * n * f), f)
    };
    launch_op(dev, k, bufs, cpu, |[out], [inp]| {
        let args = [A::Buf(out), A::Buf(inp), A::U64(f as u64), A::U64((n * f) as u64)];
        dev.launch(k, stride_grid(n * f), &args)
    })
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
    let bufs = ([("dinp", dinp, f32s(2 * n * f))], [("dout", dout, f32s(n * f)), ("inp", inp, f32s(2 * n * f))]);
    let cpu = |[dinp]: [&mut HostBytes; 1], [dout, inp]: [&HostBytes; 2]| {
        swiglu::swiglu_backward(dinp.view_mut::<f32>(2 * n * f), dout.view::<f32>(n * f), inp.view::<f32>(2 * n * f), f)
    };
    launch_op(dev, k, bufs, cpu, |[dinp], [dout, inp]| {
        let args = [A::Buf(dinp), A::Buf(dout), A::Buf(inp), A::U64(f as u64), A::U64((n * f) as u64)];
        dev.launch(k, stride_grid(n * f), &args)
    })
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
    let bufs = ([("qkv", x, f32s(n))], [("cos", cos, f32s(half)), ("sin", sin, f32s(half))]);
    let cpu = |[x]: [&mut HostBytes; 1], [cos, sin]: [&HostBytes; 2]| {
        let (x, c, sn) = (x.view_mut::<f32>(n), cos.view::<f32>(half), sin.view::<f32>(half));
        if inverse {
            cpu_rope::rope_backward(x, c, sn, s)
        } else {
            cpu_rope::rope_forward(x, c, sn, s)
        }
    };
    launch_op(dev, k, bufs, cpu, |[x], [cos, sin]| {
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
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Short buffers, rows of no channels, odd head widths and KV heads that do not divide the
    /// query heads are errors naming the kernel and the argument, before anything runs.
    #[test]
    fn bad_shapes_are_errors_naming_the_argument() {
        let dev = Device::Cpu;
        let up = |n: usize| dev.upload(&vec![1f32; n]).unwrap();
        let (mut out, mut rstd, inp, w) = (up(12), up(3), up(11), up(4));
        let err = rmsnorm_forward(&dev, RmsNormForward { out: &mut out, rstd: &mut rstd, inp: &inp, weight: &w }, 3, 4, 1e-5).unwrap_err();
        assert!(
            err.to_string()
                .contains("rmsnorm_forward_f32: `inp` holds 44 bytes"),
            "{err}"
        );
        let err = rmsnorm_forward(&dev, RmsNormForward { out: &mut out, rstd: &mut rstd, inp: &inp, weight: &w }, 3, 0, 1e-5).unwrap_err();
        assert!(err.to_string().contains("0 channels"), "{err}");
        let err = swiglu_forward(&dev, &mut out, &up(23), 3, 4).unwrap_err();
        assert!(
            err.to_string().contains("swiglu_forward_f32: `inp`"),
            "{err}"
        );
        let s = RopeShape {
            b: 1,
            t: 2,
            nh: 2,
            nkv: 1,
            hd: 4,
        };
        let (mut qkv, cos) = (up(2 * 16), up(4));
        let err = rope_forward(&dev, &mut qkv, &cos, &up(3), s).unwrap_err();
        assert!(err.to_string().contains("rope_f32: `sin`"), "{err}");
        let odd = RopeShape { hd: 3, ..s };
        assert!(rope_backward(&dev, &mut qkv, &cos, &cos, odd).is_err());
    }

    /// On the CPU device the ops run the reference functions: RoPE forward then backward
    /// returns the input (to f32 rounding) and SwiGLU's backward overwrites.
    #[test]
    fn cpu_arm_runs_the_reference() {
        let dev = Device::Cpu;
        let s = RopeShape {
            b: 2,
            t: 3,
            nh: 2,
            nkv: 1,
            hd: 4,
        };
        let x: Vec<f32> = (0..2 * 3 * s.row()).map(|i| i as f32 * 0.1 - 1.0).collect();
        let (cos, sin) = rope_table(s.hd, s.t, 10000.0, None);
        let (cos, sin) = (dev.upload(&cos).unwrap(), dev.upload(&sin).unwrap());
        let mut buf = dev.upload(&x).unwrap();
        rope_forward(&dev, &mut buf, &cos, &sin, s).unwrap();
        let mut y = vec![0f32; x.len()];
        dev.copy_to_host(&buf, &mut y).unwrap();
        assert!(y != x);
        rope_backward(&dev, &mut buf, &cos, &sin, s).unwrap();
        dev.copy_to_host(&buf, &mut y).unwrap();
        assert!(y.iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-5));
        let (inp, dout) = (
            dev.upload(&[1f32, 2.0, 3.0, 4.0]).unwrap(),
            dev.upload(&[1f32, 1.0]).unwrap(),
        );
        let mut dinp = dev.upload(&[f32::NAN; 4]).unwrap();
        swiglu_backward(&dev, &mut dinp, &dout, &inp, 1, 2).unwrap();
        let mut d = [0f32; 4];
        dev.copy_to_host(&dinp, &mut d).unwrap();
        assert!(d.iter().all(|v| v.is_finite()), "{d:?}");
    }
}
