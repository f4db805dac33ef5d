//! Fully connected layers of the device model: matrix products through the device's BLAS
//! (`device::gemm`) in the chosen precision. Under bf16 or fp16 the activation (and, for weight
//! gradients, the output-gradient) operands are cast to 16-bit scratch right before the product
//! and the weights come as the model's 16-bit copies (same type); accumulation and outputs stay
//! f32. Under fp16 the output-gradient operand carries the loss scale (`train.loss_scale`), so it
//! can overflow to infinity here: the step then sees non-finite gradients and skips.

use crate::device::gemm::{Batch, Gemm, GemmInput, Operand};
use crate::device::{ops, Device, DeviceBuffer};
use crate::error::{Error, Result};

/// Matrix products of fully connected layers in the chosen precision, with the 16-bit scratch.
pub(super) struct Linear {
    gemm: Gemm,
    /// The 16-bit operand type (bf16 or fp16); `None` under fp32.
    half: Option<GemmInput>,
    x16: DeviceBuffer, // (B*T * max(C, 3Cl, H, Vl)) 16-bit: the activation or gradient operand
    y16: DeviceBuffer, // (B*T * max(C, H)) 16-bit: the second activation operand of a weight gradient
}

/// A parameter as a product reads it: f32, and its 16-bit copy (bf16 or fp16, the type of the
/// model's precision) under mixed precision.
#[derive(Clone, Copy)]
pub(super) struct Weight<'a> {
    pub f32: &'a DeviceBuffer,
    pub bf16: Option<&'a DeviceBuffer>,
}

impl Linear {
    /// Products on `dev` with operands of type `input`; a 16-bit type gets scratch for `x16` and
    /// `y16` operand elements.
    pub(super) fn new(dev: &Device, input: GemmInput, x16: usize, y16: usize) -> Result<Self> {
        let half = (input != GemmInput::F32).then_some(input);
        let scratch = |elems: usize| dev.alloc(if half.is_some() { elems * 2 } else { 0 });
        Ok(Linear { gemm: Gemm::new(dev)?, half, x16: scratch(x16)?, y16: scratch(y16)? })
    }

    /// The 16-bit operand type, if any: the type of the weights' copies.
    pub(super) fn half(&self) -> Option<GemmInput> {
        self.half
    }

    /// 16-bit scratch elements held, counted in f32 elements (for the memory estimate).
    pub(super) fn scratch_elements(&self) -> usize {
        (self.x16.len() + self.y16.len()) / 4
    }

    fn weight_operand<'a>(&self, w: Weight<'a>) -> Result<Operand<'a>> {
        Ok(match (self.half, w.bf16) {
            (None, _) => Operand::t(w.f32, GemmInput::F32),
            (Some(ty), Some(b)) => Operand::t(b, ty),
            (Some(ty), None) => return Err(Error::Check(format!("a {ty:?} product without the weight's 16-bit copy"))),
        })
    }

    /// out (N, OC) = inp (N, C) · W (OC, C)ᵀ (+ bias (OC)).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward(
        &mut self,
        dev: &Device,
        out: &mut DeviceBuffer,
        inp: &DeviceBuffer,
        w: Weight,
        bias: Option<&DeviceBuffer>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<()> {
        let a = match self.half {
            Some(ty) => {
                ty.cast_from_f32(dev, &mut self.x16, inp, n * c)?;
                Operand::plain(&self.x16, ty)
            }
            None => Operand::plain(inp, GemmInput::F32),
        };
        self.gemm.matmul(dev, out, a, self.weight_operand(w)?, n, oc, c, false)?;
        match bias {
            Some(b) => ops::bias_add(dev, out, b, n, oc),
            None => Ok(()),
        }
    }

    /// dinp (N, C) = dout (N, OC) · W (OC, C) (overwritten); dW (OC, C) += doutᵀ · inp (N, C);
    /// dbias (OC) += column sums of dout.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward(
        &mut self,
        dev: &Device,
        dinp: &mut DeviceBuffer,
        dw: &mut DeviceBuffer,
        dbias: Option<&mut DeviceBuffer>,
        dout: &DeviceBuffer,
        inp: &DeviceBuffer,
        w: Weight,
        (n, c, oc): (usize, usize, usize),
    ) -> Result<()> {
        if let Some(db) = dbias {
            ops::bias_backward(dev, db, dout, n, oc)?;
        }
        let (g, x) = match self.half {
            Some(ty) => {
                ty.cast_from_f32(dev, &mut self.x16, dout, n * oc)?;
                ty.cast_from_f32(dev, &mut self.y16, inp, n * c)?;
                (Operand::plain(&self.x16, ty), Operand::plain(&self.y16, ty))
            }
            None => (Operand::plain(dout, GemmInput::F32), Operand::plain(inp, GemmInput::F32)),
        };
        let mut w_plain = self.weight_operand(w)?;
        w_plain.transposed = false;
        self.gemm.matmul(dev, dinp, g, w_plain, n, c, oc, false)?;
        let g_t = Operand { transposed: true, ..g };
        self.gemm.matmul(dev, dw, g_t, x, oc, c, n, true)
    }
}

/// Products whose outputs are stacked part-major: Llama's q, k and v projections write their
/// `width`-column parts one after the other into (P, N, width) staging (`ops_attention::merge_heads`
/// then interleaves them into qkv rows), so three weights that are separate tensors act as one
/// fused projection. `ws` lists each weight with its number of parts (its rows / `width`).
impl Linear {
    /// out (P, N, W) part by part: part j of weight `w` = inp (N, C) · W_j (W, C)ᵀ.
    pub(super) fn forward_stacked(&mut self, dev: &Device, out: &mut DeviceBuffer, inp: &DeviceBuffer, ws: &[(Weight, usize)], (n, c, width): (usize, usize, usize)) -> Result<()> {
        let a = match self.half {
            Some(ty) => {
                ty.cast_from_f32(dev, &mut self.x16, inp, n * c)?;
                Operand::plain(&self.x16, ty)
            }
            None => Operand::plain(inp, GemmInput::F32),
        };
        let mut at = 0;
        for &(w, parts) in ws {
            let batch = Batch { count: parts, c: (at, n * width), a: (0, 0), b: (0, width * c) };
            self.gemm.matmul_batched(dev, out, a, self.weight_operand(w)?, (n, width, c), &batch, false)?;
            at += parts * n * width;
        }
        Ok(())
    }

    /// The backward of [`Linear::forward_stacked`] from dout (P, N, W): dinp (N, C) = the sum
    /// over all parts of dout_j · W_j (overwritten); each weight's gradient `dws[i]` += its parts'
    /// dout_jᵀ · inp.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward_stacked(
        &mut self,
        dev: &Device,
        dinp: &mut DeviceBuffer,
        dws: &mut [&mut DeviceBuffer],
        dout: &DeviceBuffer,
        inp: &DeviceBuffer,
        ws: &[(Weight, usize)],
        (n, c, width): (usize, usize, usize),
    ) -> Result<()> {
        let total: usize = ws.iter().map(|w| w.1).sum();
        let (g, x) = match self.half {
            Some(ty) => {
                ty.cast_from_f32(dev, &mut self.x16, dout, total * n * width)?;
                ty.cast_from_f32(dev, &mut self.y16, inp, n * c)?;
                (Operand::plain(&self.x16, ty), Operand::plain(&self.y16, ty))
            }
            None => (Operand::plain(dout, GemmInput::F32), Operand::plain(inp, GemmInput::F32)),
        };
        let (mut at, mut first) = (0, true);
        for (&(w, parts), dw) in ws.iter().zip(dws.iter_mut()) {
            let mut w_plain = self.weight_operand(w)?;
            w_plain.transposed = false;
            for j in 0..parts {
                let batch = Batch { count: 1, c: (0, 0), a: (at + j * n * width, 0), b: (j * width * c, 0) };
                self.gemm.matmul_batched(dev, dinp, g, w_plain, (n, c, width), &batch, !first)?;
                first = false;
            }
            let g_t = Operand { transposed: true, ..g };
            let batch = Batch { count: parts, c: (0, width * c), a: (at, n * width), b: (0, 0) };
            self.gemm.matmul_batched(dev, dw, g_t, x, (width, c, n), &batch, true)?;
            at += parts * n * width;
        }
        Ok(())
    }
}
