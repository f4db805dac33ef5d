//! The GPT-2 model on a [`Device`]: the forward and backward of `gpt.rs` as a sequence of device
//! ops (`device::ops`, one kernel each on a GPU) and BLAS products (`device::gemm`), so the same
//! code trains on CUDA, HIP and — through the ops' CPU arm — on the CPU, where CI checks it
//! against the reference [`super::Gpt`].
//!
//! Mixed precision ([`Precision::Bf16`]): the f32 parameters are the master weights; every matrix
//! product reads bf16 copies of its operands (weights cast once per parameter upload,
//! activations and activation gradients cast right before the product) and accumulates and
//! writes f32, as cuBLAS/rocBLAS GemmEx with f32 compute do. Everything else (LayerNorm, GELU,
//! attention softmax, residual adds, cross-entropy, the optimizer) stays f32. So the only
//! rounding that differs from the f32 reference is the bf16 rounding of GEMM inputs (relative
//! 2^-9 per element), which is what the tolerances of the equivalence tests are derived from.
//!
//! Tensor parallelism (`device_tp.rs`): with a [`DeviceTp`] group the model holds the TP rank's
//! shard of [`ShardLayout`] (the CPU shard executor's layout, so checkpoints, initialisation and
//! the optimizer's span lists are shared with it) and runs the Megatron split of `stage.rs`
//! without sequence parallelism; without a group the layout is the whole model's (one shard).
//!
//! Invariants: parameters, gradients and their bf16 copies are one device buffer per layout
//! entry (`layout.entries()` order); host mirrors of the flat parameters and gradients are what
//! the optimizer, the data-parallel reducer and checkpoints see: the parameters go up before a
//! forward whenever the host copy may have changed (any mutable access), the gradients come down
//! after the backward that reports them. Activations are sized for (B, T) once.

use std::collections::HashMap;
use std::ops::Range;

use super::attention::AttnShape;
use super::device_tp::{self, tp_sum, DeviceTp, Embed, LossBufs};
use super::tp_layout::{ShardLayout, StageSpec};
use super::vocab_parallel::real_columns;
use super::GptConfig;
pub use crate::config::Precision;
use crate::device::gemm::{Gemm, GemmInput, Operand};
use crate::device::ipc::alloc_shareable;
use crate::device::ops_vocab::{self, VocabShard};
use crate::device::{ops, Device, DeviceBuffer};
use crate::error::{Error, Result};

/// Activations of one block, kept from forward for backward.
struct BlockActs {
    ln1: DeviceBuffer,       // (B*T, C)
    ln1_mean: DeviceBuffer,  // (B*T)
    ln1_rstd: DeviceBuffer,  // (B*T)
    qkv: DeviceBuffer,       // (B*T, 3Cl) with Cl = C/tp: this rank's heads
    atty: DeviceBuffer,      // (B*T, Cl)
    att: DeviceBuffer,       // (B, NH/tp, T, T)
    residual2: DeviceBuffer, // (B*T, C)
    ln2: DeviceBuffer,       // (B*T, C)
    ln2_mean: DeviceBuffer,  // (B*T)
    ln2_rstd: DeviceBuffer,  // (B*T)
    fch: DeviceBuffer,       // (B*T, H) with H = 4C/tp
    fch_gelu: DeviceBuffer,  // (B*T, H)
    residual3: DeviceBuffer, // (B*T, C)
}

/// Activations outside the blocks, and the backward's scratch.
struct Bufs {
    tokens: DeviceBuffer,   // (B*T) u32
    targets: DeviceBuffer,  // (B*T) u32
    encoded: DeviceBuffer,  // (B*T, C)
    lnf: DeviceBuffer,      // (B*T, C)
    lnf_mean: DeviceBuffer, // (B*T)
    lnf_rstd: DeviceBuffer, // (B*T)
    logits: DeviceBuffer,   // (B*T, Vl) with Vl = Vp/tp
    losses: DeviceBuffer,   // (B*T)
    lse: DeviceBuffer,      // (B*T)
    ce_max: DeviceBuffer,   // (B*T) under TP: the group's row max (else empty)
    ce_stats: DeviceBuffer, // (2*B*T) under TP: the group's sum-exp | target logit (else empty)
    branch: DeviceBuffer,   // (B*T, C) sub-block output before the residual add
    dlogits: DeviceBuffer,  // (B*T, Vl)
    dres: DeviceBuffer,     // (B*T, C) gradient of the residual stream
    dln: DeviceBuffer,      // (B*T, C) gradient of a LayerNorm output
    datty: DeviceBuffer,    // (B*T, Cl)
    dqkv: DeviceBuffer,     // (B*T, 3Cl)
    dpre: DeviceBuffer,     // (B, NH/tp, T, T)
    dfch_gelu: DeviceBuffer, // (B*T, H)
    dfch: DeviceBuffer,     // (B*T, H)
}

/// Matrix products of fully connected layers in the chosen precision, with the bf16 scratch.
struct Linear {
    gemm: Gemm,
    bf16: bool,
    x16: DeviceBuffer, // (B*T * max(C, 3Cl, H, Vl)) bf16: the activation or gradient operand
    y16: DeviceBuffer, // (B*T * max(C, H)) bf16: the second activation operand of a weight gradient
}

/// A parameter as a product reads it: f32, and its bf16 copy under mixed precision.
#[derive(Clone, Copy)]
struct Weight<'a> {
    f32: &'a DeviceBuffer,
    bf16: Option<&'a DeviceBuffer>,
}

impl Linear {
    fn weight_operand<'a>(&self, w: Weight<'a>) -> Result<Operand<'a>> {
        Ok(match (self.bf16, w.bf16) {
            (false, _) => Operand::t(w.f32, GemmInput::F32),
            (true, Some(b)) => Operand::t(b, GemmInput::Bf16),
            (true, None) => return Err(Error::Check("a bf16 product without the weight's bf16 copy".into())),
        })
    }

    /// out (N, OC) = inp (N, C) · W (OC, C)ᵀ (+ bias (OC)).
    #[allow(clippy::too_many_arguments)]
    fn forward(
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
        let a = if self.bf16 {
            ops::cast_f32_to_bf16(dev, &mut self.x16, inp, n * c)?;
            Operand::plain(&self.x16, GemmInput::Bf16)
        } else {
            Operand::plain(inp, GemmInput::F32)
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
    fn backward(
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
        let (g, x) = if self.bf16 {
            ops::cast_f32_to_bf16(dev, &mut self.x16, dout, n * oc)?;
            ops::cast_f32_to_bf16(dev, &mut self.y16, inp, n * c)?;
            (Operand::plain(&self.x16, GemmInput::Bf16), Operand::plain(&self.y16, GemmInput::Bf16))
        } else {
            (Operand::plain(dout, GemmInput::F32), Operand::plain(inp, GemmInput::F32))
        };
        let mut w_plain = self.weight_operand(w)?;
        w_plain.transposed = false;
        self.gemm.matmul(dev, dinp, g, w_plain, n, c, oc, false)?;
        let g_t = Operand { transposed: true, ..g };
        self.gemm.matmul(dev, dw, g_t, x, oc, c, n, true)
    }
}

/// This rank's share of the model's widths.
#[derive(Debug, Clone, Copy)]
struct Widths {
    /// Attention width C/tp (this rank's heads).
    cl: usize,
    /// MLP hidden width 4C/tp.
    hl: usize,
    /// Heads NH/tp.
    nhl: usize,
    /// The vocabulary shard of `wte` and the logits.
    vocab: VocabShard,
}

/// Entry indices of the tensors outside the blocks.
#[derive(Debug, Clone, Copy)]
struct Ends {
    wte: usize,
    wpe: usize,
    lnf_w: usize,
    lnf_b: usize,
}

/// A GPT-2 model (or one tensor-parallel shard of it) on a device, trained through host mirrors
/// of its flat buffers.
pub struct DeviceGpt {
    dev: Device,
    config: GptConfig,
    layout: ShardLayout,
    tp: Option<DeviceTp>,
    w: Widths,
    ends: Ends,
    b: usize,
    t: usize,
    /// Per layout entry.
    params: Vec<DeviceBuffer>,
    grads: Vec<DeviceBuffer>,
    params16: Vec<Option<DeviceBuffer>>,
    /// Layout offset of an entry -> its index.
    index: HashMap<usize, usize>,
    host_params: Vec<f32>,
    host_grads: Vec<f32>,
    /// The host parameters may differ from the device's.
    params_stale: bool,
    /// A backward asked to report brings the gradients to the host mirror (off when a
    /// device-resident optimizer reads the device gradients).
    host_reports: bool,
    blocks: Vec<BlockActs>,
    bufs: Bufs,
    linear: Linear,
    forward_done: bool,
}

fn f32_buf(dev: &Device, elems: usize) -> Result<DeviceBuffer> {
    dev.alloc(elems * 4)
}

impl DeviceGpt {
    /// The whole model with flat parameters `params` (layout order) on `dev`, for (B, T) batches.
    pub fn new(dev: Device, config: GptConfig, b: usize, t: usize, params: Vec<f32>, precision: Precision) -> Result<Self> {
        Self::with_tp(dev, config, b, t, params, precision, None)
    }

    /// The shard of TP rank `tp.rank()` of `tp.size()` (the whole model without a group), with
    /// flat parameters `params` in [`ShardLayout`] order.
    pub fn with_tp(
        dev: Device,
        config: GptConfig,
        b: usize,
        t: usize,
        params: Vec<f32>,
        precision: Precision,
        tp: Option<DeviceTp>,
    ) -> Result<Self> {
        config.validate()?;
        if b == 0 || t == 0 || t > config.max_seq_len {
            return Err(Error::config("train.seq_len", format!("B={b}, T={t} must be positive with T <= {}", config.max_seq_len)));
        }
        let (tp_rank, tp_size) = tp.as_ref().map_or((0, 1), |g| (g.rank(), g.size()));
        let layout = ShardLayout::new(&config, tp_rank, tp_size, &StageSpec::whole(&config))?;
        if params.len() != layout.total_len() {
            return Err(Error::InvalidArgument(format!(
                "parameter buffer has {} elements, the layout needs {}",
                params.len(),
                layout.total_len()
            )));
        }
        let bf16 = precision == Precision::Bf16;
        let (bt, c) = (b * t, config.n_embd);
        let vl = config.padded_vocab_size() / tp_size;
        let vocab = VocabShard { start: tp_rank * vl, vl, real: real_columns(tp_rank * vl, vl, config.vocab_size) };
        let w = Widths { cl: c / tp_size, hl: 4 * c / tp_size, nhl: config.n_head / tp_size, vocab };
        let (cl, hl) = (w.cl, w.hl);
        let att = b * w.nhl * t * t;
        let index: HashMap<usize, usize> = layout.entries().iter().enumerate().map(|(i, e)| (e.offset, i)).collect();
        let at = |name: &str| {
            let e = layout.get(name).ok_or_else(|| Error::Check(format!("the whole-model shard lacks `{name}`")))?;
            Ok::<usize, Error>(index[&e.offset])
        };
        let ends = Ends { wte: at("wte")?, wpe: at("wpe")?, lnf_w: at("lnf.weight")?, lnf_b: at("lnf.bias")? };
        let mut p = Vec::new();
        let mut g = Vec::new();
        let mut p16 = Vec::new();
        for e in layout.entries() {
            p.push(f32_buf(&dev, e.len)?);
            g.push(f32_buf(&dev, e.len)?);
            p16.push(if bf16 && e.local_shape.len() == 2 { Some(dev.alloc(e.len * 2)?) } else { None });
        }
        let blocks = (0..config.n_layer)
            .map(|_| {
                Ok(BlockActs {
                    ln1: f32_buf(&dev, bt * c)?,
                    ln1_mean: f32_buf(&dev, bt)?,
                    ln1_rstd: f32_buf(&dev, bt)?,
                    qkv: f32_buf(&dev, bt * 3 * cl)?,
                    atty: f32_buf(&dev, bt * cl)?,
                    att: f32_buf(&dev, att)?,
                    residual2: f32_buf(&dev, bt * c)?,
                    ln2: f32_buf(&dev, bt * c)?,
                    ln2_mean: f32_buf(&dev, bt)?,
                    ln2_rstd: f32_buf(&dev, bt)?,
                    fch: f32_buf(&dev, bt * hl)?,
                    fch_gelu: f32_buf(&dev, bt * hl)?,
                    residual3: f32_buf(&dev, bt * c)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // The buffers TP all-reduces in place, shareable so that GPUs of one node reduce them
        // through IPC rather than staged through the host (CUDA pool memory cannot be exported).
        let reduced = |elems: usize| if tp.is_some() { alloc_shareable(&dev, elems * 4) } else { f32_buf(&dev, elems) };
        let bufs = Bufs {
            tokens: dev.alloc(bt * 4)?,
            targets: dev.alloc(bt * 4)?,
            encoded: reduced(bt * c)?,
            lnf: f32_buf(&dev, bt * c)?,
            lnf_mean: f32_buf(&dev, bt)?,
            lnf_rstd: f32_buf(&dev, bt)?,
            logits: f32_buf(&dev, bt * vl)?,
            losses: f32_buf(&dev, bt)?,
            lse: f32_buf(&dev, bt)?,
            ce_max: reduced(if tp.is_some() { bt } else { 0 })?,
            ce_stats: reduced(if tp.is_some() { 2 * bt } else { 0 })?,
            branch: reduced(bt * c)?,
            dlogits: f32_buf(&dev, bt * vl)?,
            dres: f32_buf(&dev, bt * c)?,
            dln: reduced(bt * c)?,
            datty: f32_buf(&dev, bt * cl)?,
            dqkv: f32_buf(&dev, bt * 3 * cl)?,
            dpre: f32_buf(&dev, att)?,
            dfch_gelu: f32_buf(&dev, bt * hl)?,
            dfch: f32_buf(&dev, bt * hl)?,
        };
        let scratch16 = |elems: usize| if bf16 { dev.alloc(elems * 2) } else { dev.alloc(0) };
        let linear = Linear {
            gemm: Gemm::new(&dev)?,
            bf16,
            x16: scratch16(bt * c.max(3 * cl).max(hl).max(vl))?,
            y16: scratch16(bt * c.max(hl))?,
        };
        let n = params.len();
        let mut model = DeviceGpt {
            dev,
            config,
            layout,
            tp,
            w,
            ends,
            b,
            t,
            params: p,
            grads: g,
            params16: p16,
            index,
            host_params: params,
            host_grads: vec![0.0; n],
            params_stale: true,
            host_reports: true,
            blocks,
            bufs,
            linear,
            forward_done: false,
        };
        model.zero_grad()?;
        Ok(model)
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// The parameter layout table of this rank's shard (the whole model without TP).
    pub fn layout(&self) -> &ShardLayout {
        &self.layout
    }

    /// This rank's index in its tensor-parallel group (0 without one).
    pub fn tp_rank(&self) -> usize {
        self.tp.as_ref().map_or(0, DeviceTp::rank)
    }

    /// Members of its tensor-parallel group (1 without one).
    pub fn tp_size(&self) -> usize {
        self.tp.as_ref().map_or(1, DeviceTp::size)
    }

    /// Sets the shard's parameters from the whole model's initialisation `init` (see
    /// [`ShardLayout::init_local`]).
    pub fn init_params(&mut self, init: &super::init::Initializer) -> Result<()> {
        self.params_stale = true;
        self.layout.init_local(init, &mut self.host_params, None)
    }

    /// Closes the TP collectives' peer mappings (collective over the group; no-op without TP).
    pub fn release_collectives(&mut self) -> Result<()> {
        match &mut self.tp {
            Some(g) => g.release(&self.dev),
            None => Ok(()),
        }
    }

    /// Flat parameters (host mirror).
    pub fn params(&self) -> &[f32] {
        &self.host_params
    }

    /// Flat parameters and gradients (host mirrors), mutable; the parameters go to the device
    /// again before the next forward.
    pub fn params_and_grads(&mut self) -> (&mut [f32], &mut [f32]) {
        self.params_stale = true;
        (&mut self.host_params, &mut self.host_grads)
    }

    /// Device elements of the activations and scratch, in f32 units (for the memory estimate).
    pub fn activation_elements(&self) -> usize {
        let (bt, c) = (self.b * self.t, self.config.n_embd);
        let Widths { cl, hl, nhl, vocab } = self.w;
        let att = self.b * nhl * self.t * self.t;
        // Per block: ln1, residual2, ln2, residual3 (C each), atty and qkv (4 Cl), fch and
        // fch_gelu (H each), four (B*T) statistics, the attention matrix.
        let block = bt * (4 * c + 4 * cl + 2 * hl) + 4 * bt + att;
        // Outside: encoded, lnf, branch, dres, dln (C each), datty and dqkv (4 Cl), dfch_gelu and
        // dfch (H each); logits and dlogits; six (B*T) and the TP loss statistics; dpre.
        let ce = if self.tp.is_some() { 3 * bt } else { 0 };
        let rest = bt * (5 * c + 4 * cl + 2 * hl) + 2 * bt * vocab.vl + 6 * bt + ce + att;
        let bf16_scratch = if self.linear.bf16 { bt * (c.max(3 * cl).max(hl).max(vocab.vl) + c.max(hl)) / 2 } else { 0 };
        self.config.n_layer * block + rest + bf16_scratch
    }

    /// Clears the gradients (device and host mirror).
    pub fn zero_grad(&mut self) -> Result<()> {
        for (g, e) in self.grads.iter_mut().zip(self.layout.entries()) {
            ops::fill_zero(&self.dev, g, e.len)?;
        }
        self.host_grads.fill(0.0);
        Ok(())
    }

    fn upload_params(&mut self) -> Result<()> {
        for (i, e) in self.layout.entries().iter().enumerate() {
            self.dev.copy_to_device(&mut self.params[i], &self.host_params[e.range()])?;
            if let Some(p16) = &mut self.params16[i] {
                ops::cast_f32_to_bf16(&self.dev, p16, &self.params[i], e.len)?;
            }
        }
        self.params_stale = false;
        Ok(())
    }

    /// Copies every entry's device gradient into `flat` (P) at its layout offset.
    pub fn pack_grads(&self, flat: &mut DeviceBuffer) -> Result<()> {
        for (g, e) in self.grads.iter().zip(self.layout.entries()) {
            ops::copy(&self.dev, flat, e.offset, g, 0, e.len)?;
        }
        Ok(())
    }

    /// Sets every entry's device parameters (and bf16 copies) from `flat` (P), the master
    /// weights of a device-resident optimizer; the host mirror is left as it was (see
    /// [`DeviceGpt::host_params_from`]).
    pub fn unpack_params(&mut self, flat: &DeviceBuffer) -> Result<()> {
        for (i, e) in self.layout.entries().iter().enumerate() {
            ops::copy(&self.dev, &mut self.params[i], 0, flat, e.offset, e.len)?;
            if let Some(p16) = &mut self.params16[i] {
                ops::cast_f32_to_bf16(&self.dev, p16, &self.params[i], e.len)?;
            }
        }
        self.params_stale = false;
        Ok(())
    }

    /// Whether a reporting backward brings the gradients to the host mirror (default on).
    pub fn set_host_reports(&mut self, on: bool) {
        self.host_reports = on;
    }

    /// Brings the flat parameters `flat` (P, on this device) into the host mirror without marking
    /// it newer than the device (for checkpoints of a device-resident optimizer).
    pub fn host_params_from(&mut self, flat: &DeviceBuffer) -> Result<()> {
        self.dev.copy_to_host(flat, &mut self.host_params)
    }

    fn entry(&self, r: &Range<usize>) -> usize {
        *self.index.get(&r.start).expect("every layout range starts an entry")
    }

    /// Mean cross-entropy of `tokens` (B, T) against `targets` (B, T), keeping activations.
    pub fn forward(&mut self, tokens: &[u32], targets: &[u32]) -> Result<f64> {
        let (b, t, c) = (self.b, self.t, self.config.n_embd);
        let bt = b * t;
        let v = self.config.vocab_size;
        for (what, ids) in [("tokens", tokens), ("targets", targets)] {
            if ids.len() != bt {
                return Err(Error::InvalidArgument(format!("forward: {what} has {} ids, expected B*T = {bt}", ids.len())));
            }
            if let Some((i, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= v) {
                return Err(Error::InvalidArgument(format!("forward: {what}[{i}] = {id} is outside the vocabulary ({v})")));
            }
        }
        if self.params_stale {
            self.upload_params()?;
        }
        let dev = &self.dev;
        dev.copy_to_device(&mut self.bufs.tokens, tokens)?;
        dev.copy_to_device(&mut self.bufs.targets, targets)?;
        let Ends { wte, wpe, lnf_w, lnf_b } = self.ends;
        let (s, p, vocab) = (&mut self.bufs, &self.params, self.w.vocab);
        match &mut self.tp {
            None => ops::encoder_forward(dev, &mut s.encoded, &s.tokens, &p[wte], &p[wpe], bt, t, c)?,
            Some(g) => {
                let e = Embed { tokens: &s.tokens, wte: &p[wte], wpe: &p[wpe] };
                device_tp::embed_forward(dev, g, &mut s.encoded, e, (b, t, c), vocab)?;
            }
        }
        for l in 0..self.config.n_layer {
            self.block_forward(l)?;
        }
        let (dev, s, p) = (&self.dev, &mut self.bufs, &self.params);
        let last = &self.blocks[self.config.n_layer - 1].residual3;
        ops::layernorm_forward(dev, &mut s.lnf, &mut s.lnf_mean, &mut s.lnf_rstd, last, &p[lnf_w], &p[lnf_b], bt, c)?;
        let w = Weight { f32: &p[wte], bf16: self.params16[wte].as_ref() };
        self.linear.forward(dev, &mut s.logits, &s.lnf, w, None, bt, c, vocab.vl)?;
        match &mut self.tp {
            None => ops::cross_entropy_forward(dev, &mut s.losses, &mut s.lse, &s.logits, &s.targets, bt, v, vocab.vl)?,
            Some(g) => {
                let l = LossBufs {
                    logits: &s.logits,
                    targets: &s.targets,
                    losses: &mut s.losses,
                    lse: &mut s.lse,
                    max: &mut s.ce_max,
                    stats: &mut s.ce_stats,
                };
                device_tp::loss_forward(dev, g, l, bt, vocab)?;
            }
        }
        let mut losses = vec![0f32; bt];
        dev.copy_to_host(&s.losses, &mut losses)?;
        self.forward_done = true;
        Ok(losses.iter().map(|&l| f64::from(l)).sum::<f64>() / bt as f64)
    }

    /// Entry indices of block `l`'s tensors: ln1 w, b; qkv w, b; attn.proj w, b; ln2 w, b;
    /// fc w, b; mlp.proj w, b.
    fn block_entries(&self, l: usize) -> [usize; 12] {
        let r = self.layout.block(l);
        [
            &r.ln1_w, &r.ln1_b, &r.qkv_w, &r.qkv_b, &r.attn_proj_w, &r.attn_proj_b,
            &r.ln2_w, &r.ln2_b, &r.fc_w, &r.fc_b, &r.mlp_proj_w, &r.mlp_proj_b,
        ]
        .map(|r| self.entry(r))
    }

    fn attn_shape(&self) -> AttnShape {
        AttnShape { b: self.b, t: self.t, nh: self.w.nhl, hs: self.config.head_dim() }
    }

    /// Block `l`: column-parallel qkv and fc (this rank's heads and hidden units), row-parallel
    /// projections whose partial outputs are summed over TP before the bias is added once.
    fn block_forward(&mut self, l: usize) -> Result<()> {
        let (bt, c) = (self.b * self.t, self.config.n_embd);
        let Widths { cl, hl, .. } = self.w;
        let shape = self.attn_shape();
        let [ln1_w, ln1_b, qkv_w, qkv_b, ap_w, ap_b, ln2_w, ln2_b, fc_w, fc_b, mp_w, mp_b] = self.block_entries(l);
        let (p, p16, dev, tp) = (&self.params, &self.params16, &self.dev, &mut self.tp);
        let w = |i: usize| Weight { f32: &p[i], bf16: p16[i].as_ref() };
        let (done, rest) = self.blocks.split_at_mut(l);
        let x = if l == 0 { &self.bufs.encoded } else { &done[l - 1].residual3 }; // (B*T, C)
        let a = &mut rest[0];
        let branch = &mut self.bufs.branch;
        ops::layernorm_forward(dev, &mut a.ln1, &mut a.ln1_mean, &mut a.ln1_rstd, x, &p[ln1_w], &p[ln1_b], bt, c)?;
        self.linear.forward(dev, &mut a.qkv, &a.ln1, w(qkv_w), Some(&p[qkv_b]), bt, c, 3 * cl)?;
        ops::attention_forward(dev, &mut a.atty, &mut a.att, &a.qkv, shape)?;
        self.linear.forward(dev, branch, &a.atty, w(ap_w), None, bt, cl, c)?;
        tp_sum(tp, dev, branch, bt * c)?;
        ops::bias_add(dev, branch, &p[ap_b], bt, c)?;
        ops::residual_forward(dev, &mut a.residual2, x, branch, bt * c)?;
        ops::layernorm_forward(dev, &mut a.ln2, &mut a.ln2_mean, &mut a.ln2_rstd, &a.residual2, &p[ln2_w], &p[ln2_b], bt, c)?;
        self.linear.forward(dev, &mut a.fch, &a.ln2, w(fc_w), Some(&p[fc_b]), bt, c, hl)?;
        ops::gelu_forward(dev, &mut a.fch_gelu, &a.fch, bt * hl)?;
        self.linear.forward(dev, branch, &a.fch_gelu, w(mp_w), None, bt, hl, c)?;
        tp_sum(tp, dev, branch, bt * c)?;
        ops::bias_add(dev, branch, &p[mp_b], bt, c)?;
        ops::residual_forward(dev, &mut a.residual3, &a.residual2, branch, bt * c)
    }

    /// Adds d(mean loss)/d(params) of the last forward into the device gradients; with
    /// `report` (and host reports on), brings all gradients to the host mirror afterwards and
    /// hands them to `on_final(0..n, grads)`. Replicated tensors get the same gradient on every
    /// TP rank (their inputs are identical), so no gradient is reduced over TP.
    pub fn backward(&mut self, report: bool, on_final: &mut dyn FnMut(Range<usize>, &mut [f32])) -> Result<()> {
        if !self.forward_done {
            return Err(Error::InvalidArgument("backward called without a forward since the last backward".into()));
        }
        self.forward_done = false;
        let (b, t, c) = (self.b, self.t, self.config.n_embd);
        let (bt, nl, vocab) = (b * t, self.config.n_layer, self.w.vocab);
        let Ends { wte, wpe, lnf_w, lnf_b } = self.ends;
        {
            let (dev, s, p, g) = (&self.dev, &mut self.bufs, &self.params, &mut self.grads);
            ops::fill_zero(dev, &mut s.dlogits, bt * vocab.vl)?;
            let dloss = (1.0 / bt as f64) as f32;
            ops_vocab::cross_entropy_backward(dev, &mut s.dlogits, &s.logits, &s.lse, &s.targets, dloss, bt, vocab)?;
            let w = Weight { f32: &p[wte], bf16: self.params16[wte].as_ref() };
            self.linear.backward(dev, &mut s.dln, &mut g[wte], None, &s.dlogits, &s.lnf, w, (bt, c, vocab.vl))?;
            tp_sum(&mut self.tp, dev, &mut s.dln, bt * c)?;
            ops::fill_zero(dev, &mut s.dres, bt * c)?;
            let (gw, gb) = pair(g, lnf_w, lnf_b);
            let last = &self.blocks[nl - 1].residual3;
            ops::layernorm_backward(dev, &mut s.dres, gw, gb, &s.dln, last, &p[lnf_w], &s.lnf_mean, &s.lnf_rstd, bt, c)?;
        }
        for l in (0..nl).rev() {
            self.block_backward(l)?;
        }
        let (dev, s, g) = (&self.dev, &self.bufs, &mut self.grads);
        let (gte, gpe) = pair(g, wte, wpe);
        match self.tp {
            None => ops::encoder_backward(dev, gte, gpe, &s.dres, &s.tokens, b, t, c)?,
            Some(_) => device_tp::embed_backward(dev, gte, gpe, &s.dres, &s.tokens, (b, t, c), vocab)?,
        }
        if report && self.host_reports {
            for (i, e) in self.layout.entries().iter().enumerate() {
                dev.copy_to_host(&self.grads[i], &mut self.host_grads[e.range()])?;
            }
            let n = self.host_grads.len();
            on_final(0..n, &mut self.host_grads);
        }
        Ok(())
    }

    /// Backward of block `l`: `dres` holds d(block output) on entry, d(block input) on exit. The
    /// input gradients of the column-parallel products are partial sums over this rank's heads
    /// and hidden units, summed over TP before the LayerNorm backward.
    fn block_backward(&mut self, l: usize) -> Result<()> {
        let (bt, c) = (self.b * self.t, self.config.n_embd);
        let Widths { cl, hl, .. } = self.w;
        let shape = self.attn_shape();
        let [ln1_w, ln1_b, qkv_w, qkv_b, ap_w, ap_b, ln2_w, ln2_b, fc_w, fc_b, mp_w, mp_b] = self.block_entries(l);
        let (p, p16, dev, g, s, tp) = (&self.params, &self.params16, &self.dev, &mut self.grads, &mut self.bufs, &mut self.tp);
        let w = |i: usize| Weight { f32: &p[i], bf16: p16[i].as_ref() };
        let x = if l == 0 { &s.encoded } else { &self.blocks[l - 1].residual3 }; // (B*T, C)
        let a = &self.blocks[l];
        // MLP: d(residual2) = dres + d through ln2 of the MLP branch.
        let (gw, gb) = pair(g, mp_w, mp_b);
        self.linear.backward(dev, &mut s.dfch_gelu, gw, Some(gb), &s.dres, &a.fch_gelu, w(mp_w), (bt, hl, c))?;
        ops::fill_zero(dev, &mut s.dfch, bt * hl)?;
        ops::gelu_backward(dev, &mut s.dfch, &a.fch, &s.dfch_gelu, bt * hl)?;
        let (gw, gb) = pair(g, fc_w, fc_b);
        self.linear.backward(dev, &mut s.dln, gw, Some(gb), &s.dfch, &a.ln2, w(fc_w), (bt, c, hl))?;
        tp_sum(tp, dev, &mut s.dln, bt * c)?;
        let (gw, gb) = pair(g, ln2_w, ln2_b);
        ops::layernorm_backward(dev, &mut s.dres, gw, gb, &s.dln, &a.residual2, &p[ln2_w], &a.ln2_mean, &a.ln2_rstd, bt, c)?;
        // Attention: d(block input) = d(residual2) + d through ln1 of the attention branch.
        let (gw, gb) = pair(g, ap_w, ap_b);
        self.linear.backward(dev, &mut s.datty, gw, Some(gb), &s.dres, &a.atty, w(ap_w), (bt, cl, c))?;
        ops::fill_zero(dev, &mut s.dqkv, bt * 3 * cl)?;
        ops::attention_backward(dev, &mut s.dqkv, &mut s.dpre, &s.datty, &a.qkv, &a.att, shape)?;
        let (gw, gb) = pair(g, qkv_w, qkv_b);
        self.linear.backward(dev, &mut s.dln, gw, Some(gb), &s.dqkv, &a.ln1, w(qkv_w), (bt, c, 3 * cl))?;
        tp_sum(tp, dev, &mut s.dln, bt * c)?;
        let (gw, gb) = pair(g, ln1_w, ln1_b);
        ops::layernorm_backward(dev, &mut s.dres, gw, gb, &s.dln, x, &p[ln1_w], &a.ln1_mean, &a.ln1_rstd, bt, c)
    }
}

/// Two distinct entries of `bufs`, both mutable (`i < j`, as layout order always gives here).
fn pair(bufs: &mut [DeviceBuffer], i: usize, j: usize) -> (&mut DeviceBuffer, &mut DeviceBuffer) {
    assert!(i < j, "pair: entry {i} must precede entry {j}");
    let (lo, hi) = bufs.split_at_mut(j);
    (&mut lo[i], &mut hi[0])
}

/// Flat-range access to the per-entry device buffers, for an optimizer that holds only a shard of
/// the flat buffer and moves it bucket by bucket (`train::device_zero`).
impl DeviceGpt {
    /// The parts of the layout entries inside the flat range `r`: (entry index, flat sub-range).
    fn entry_parts(&self, r: Range<usize>) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        self.layout.entries().iter().enumerate().filter_map(move |(i, e)| {
            let (lo, hi) = (e.offset.max(r.start), (e.offset + e.len).min(r.end));
            (lo < hi).then_some((i, lo..hi))
        })
    }

    /// Copies the device gradients of the flat range `r` into `dst` (`r.len()` elements from 0).
    pub fn pack_grads_range(&self, r: Range<usize>, dst: &mut DeviceBuffer) -> Result<()> {
        for (i, p) in self.entry_parts(r.clone()) {
            let e = &self.layout.entries()[i];
            ops::copy(&self.dev, dst, p.start - r.start, &self.grads[i], p.start - e.offset, p.len())?;
        }
        Ok(())
    }

    /// Sets the device parameters of the flat range `r` from `src` (`r.len()` elements from 0);
    /// the bf16 copies follow in [`DeviceGpt::refresh_params16`] once every range is set.
    pub fn unpack_params_range(&mut self, r: Range<usize>, src: &DeviceBuffer) -> Result<()> {
        let parts: Vec<_> = self.entry_parts(r.clone()).collect();
        for (i, p) in parts {
            let off = p.start - self.layout.entries()[i].offset;
            ops::copy(&self.dev, &mut self.params[i], off, src, p.start - r.start, p.len())?;
        }
        Ok(())
    }

    /// Casts every entry's bf16 copy from its device parameters after [`DeviceGpt::unpack_params_range`]
    /// set all of them; the device parameters are then the model's (as after `unpack_params`).
    pub fn refresh_params16(&mut self) -> Result<()> {
        for (i, e) in self.layout.entries().iter().enumerate() {
            if let Some(p16) = &mut self.params16[i] {
                ops::cast_f32_to_bf16(&self.dev, p16, &self.params[i], e.len)?;
            }
        }
        self.params_stale = false;
        Ok(())
    }

    /// Brings the device parameters into the host mirror (for checkpoints of an optimizer that
    /// keeps no flat copy of them).
    pub fn host_params_from_device(&mut self) -> Result<()> {
        for (i, e) in self.layout.entries().iter().enumerate() {
            self.dev.copy_to_host(&self.params[i], &mut self.host_params[e.range()])?;
        }
        Ok(())
    }
}
