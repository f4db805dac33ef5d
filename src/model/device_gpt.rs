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
//! [`Precision::Fp16`] is the same with IEEE half copies (relative 2^-12 per element, but a range
//! of 2^-24..65504): the loss gradient is multiplied by the loss scale
//! ([`DeviceGpt::set_loss_scale`]) so that small activation gradients stay representable, and the
//! optimizer divides the gradients by it again (`train::loss_scale`).
//!
//! Architectures: `config.llama` switches the norms to RMSNorm, drops biases and positions, adds
//! RoPE on q and k, grouped-query attention, SwiGLU and an untied head (`device_gpt/llama_layers.rs`);
//! everything else (slots, recomputation, TP/SP collectives, pipeline stages, ZeRO units) is
//! shared, so every layout runs either architecture.
//!
//! This is the one executor of every training layout on every device arm, the CPU's included;
//! the single-rank [`super::Gpt`] exists only as the reference the tests compare it with.
//!
//! Tensor parallelism (`device_tp.rs`): with a [`DeviceTp`] group the model holds the TP rank's
//! shard of [`ShardLayout`] (the layout checkpoints, initialisation and the optimizer's span
//! lists share) and runs the Megatron split, with or without sequence parallelism
//! (`device_gpt/layers.rs`); without a group the layout is the whole model's (one shard).
//!
//! Pipeline parallelism: the model may be one pipeline stage
//! ([`StageSpec`]: chunks of blocks, the embedding on the first stage, the head on the last) with
//! one activation slot per micro-batch in flight ([`DeviceGpt::forward_stage`],
//! [`DeviceGpt::backward_stage`]); hidden states enter and leave through host memory, where the
//! pipeline's point-to-point transfers pick them up.
//!
//! Invariants: parameters, gradients and their bf16 copies are one device buffer per layout
//! entry (`layout.entries()` order); host mirrors of the flat parameters and gradients are what
//! the optimizer, the data-parallel reducer and checkpoints see: the parameters go up before a
//! forward whenever the host copy may have changed (any mutable access), the gradients come down
//! when reported ([`DeviceGpt::report_grads`]). Activations are sized for (B, T) once; a slot's
//! backward needs a forward of that slot since its last backward.

use std::collections::HashMap;
use std::ops::Range;

use super::device_acts::{ActDims, BlockActs, Recompute, Scratch, SlotActs};
use super::device_linear::Linear;
use super::device_tp::DeviceTp;
use super::tp_layout::{ShardLayout, StageSpec};
use super::GptConfig;
use crate::comm::{Communicator, ReduceOp};
use crate::device::cpu::attention::AttnShape;
use crate::device::cpu::vocab_parallel::real_columns;
use crate::device::ops_attention::AttnWork;
use crate::device::ops_vocab::{self, VocabShard};
pub use crate::device::Precision;
use crate::device::gemm::GemmInput;
use crate::device::{ops, Device, DeviceBuffer};
use crate::error::{Error, Result};
use layers::Rows;
use shards::{ParamShards, Use};

mod layers;
mod llama_layers;
mod shards;

/// This rank's share of the model's widths.
#[derive(Debug, Clone, Copy)]
struct Widths {
    /// Attention width C/tp (this rank's heads).
    cl: usize,
    /// MLP hidden width 4C/tp (Llama: F/tp).
    hl: usize,
    /// Heads NH/tp.
    nhl: usize,
    /// Key/value heads held: NH/tp for GPT-2, max(NKV/tp, 1) for Llama.
    nkvl: usize,
    /// The vocabulary shard of `wte` and the logits.
    vocab: VocabShard,
}

/// Entry indices of the tensors outside the blocks that this stage holds.
#[derive(Debug, Clone, Copy)]
struct Ends {
    /// The first and the last stage (embedding and tied head).
    wte: Option<usize>,
    /// The first stage.
    wpe: Option<usize>,
    /// The last stage: weight and bias (Llama: the RMSNorm weight twice).
    lnf: Option<(usize, usize)>,
    /// The last stage: the output head's weight (`wte` when tied, else `lm_head.weight`).
    head: Option<usize>,
}

/// One chunk of blocks with its activation slots.
struct Chunk {
    /// Global indices of the chunk's blocks.
    layers: Range<usize>,
    embeds: bool,
    ends: bool,
    slots: Vec<SlotActs>,
}

/// A GPT-2 model (or one tensor-parallel shard and/or pipeline stage of it) on a device, trained
/// through host mirrors of its flat buffers or a device-resident optimizer.
pub struct DeviceGpt {
    dev: Device,
    config: GptConfig,
    layout: ShardLayout,
    tp: Option<DeviceTp>,
    w: Widths,
    ends: Ends,
    b: usize,
    t: usize,
    /// The residual-stream rows this rank holds (all B*T without sequence parallelism).
    rows: Rows,
    /// Per layout entry (allocated when first set; under ZeRO-3 only while its unit is gathered).
    params: Vec<DeviceBuffer>,
    grads: Vec<DeviceBuffer>,
    params16: Vec<Option<DeviceBuffer>>,
    /// Layout offset of an entry -> its index.
    index: HashMap<usize, usize>,
    host_params: Vec<f32>,
    host_grads: Vec<f32>,
    /// The host parameters may differ from the device's.
    params_stale: bool,
    /// [`DeviceGpt::report_grads`] brings the gradients to the host mirror (off when a
    /// device-resident optimizer reads the device gradients).
    host_reports: bool,
    chunks: Vec<Chunk>,
    s: Scratch,
    linear: Linear,
    /// Attention's per-head views and batched-GEMM handle.
    attn: AttnWork,
    /// Host staging of a hidden state or its gradient (R, C) for the pipeline.
    hidden: Vec<f32>,
    /// Llama's RoPE tables, q/k/v staging and shared-KV gradient sums (None for GPT-2).
    llama: Option<llama_layers::LlamaWork>,
    /// ZeRO-3: this rank's blocks of the parameters, gathered unit by unit on use.
    shards: Option<ParamShards>,
    /// Gradients are freed once reduced and allocated again when written (ZeRO-2/3).
    release_grads: bool,
    /// The next loss backward starts from a NaN gradient (fault injection for tests).
    poison: bool,
    /// What the backward recomputes (`device_acts`).
    recompute: Recompute,
    /// The buffers the backward recomputes one block into (None without recomputation).
    work: Option<BlockActs>,
    /// The loss gradient's multiplier (loss scaling; 1 without it): every gradient is this many
    /// times the loss's.
    loss_scale: f64,
    /// Every device gradient is zero (the optimizer zeroed them as it read them): the next
    /// [`DeviceGpt::zero_grad`] has nothing to clear. Anything that writes gradients clears it.
    grads_zero: bool,
}

/// How a [`DeviceGpt`] computes: the matrix products' precision and what the backward
/// recomputes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecOptions {
    /// Matrix-product inputs.
    pub precision: Precision,
    /// Activation recomputation.
    pub recompute: Recompute,
}

impl From<Precision> for ExecOptions {
    fn from(precision: Precision) -> Self {
        ExecOptions { precision, recompute: Recompute::None }
    }
}

/// What a stage's forward consumes.
#[derive(Debug, Clone, Copy)]
pub enum StageInput<'a> {
    /// Token ids (B, T), for the first stage (all rows, also with sequence parallelism).
    Tokens(&'a [u32]),
    /// The previous stage's output: (B*T/tp, C) rows with sequence parallelism, else (B*T, C).
    Hidden(&'a [f32]),
}

/// What a stage's forward produces.
#[derive(Debug, Clone, Copy)]
pub enum StageOutput<'a> {
    /// Hidden state for the next stage, shaped like [`StageInput::Hidden`].
    Hidden(&'a [f32]),
    /// Mean cross-entropy over the micro-batch (last stage; the same on every TP rank).
    Loss(f32),
}

/// Receives a unit's final gradients (a flat range) during [`DeviceGpt::backward_reducing`].
pub type GradSink<'a> = dyn FnMut(&DeviceGpt, Range<usize>) -> Result<()> + 'a;

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
        Self::stage(dev, config, (b, t), params, precision, (tp, false), StageSpec::whole(&config), 1)
    }

    /// Pipeline stage `spec` of the TP shard (see [`DeviceGpt::with_tp`]), sequence parallel over
    /// the group with `sp`, with `slots` activation slots per chunk (micro-batches in flight), in
    /// `exec`'s precision and recomputation mode (a [`Precision`] alone: no recomputation).
    #[allow(clippy::too_many_arguments)]
    pub fn stage(
        dev: Device,
        config: GptConfig,
        (b, t): (usize, usize),
        params: Vec<f32>,
        exec: impl Into<ExecOptions>,
        (tp, sp): (Option<DeviceTp>, bool),
        spec: StageSpec,
        slots: usize,
    ) -> Result<Self> {
        let ExecOptions { precision, recompute } = exec.into();
        check_shape(&config, (b, t), &spec, slots)?;
        let (tp_rank, tp_size) = tp.as_ref().map_or((0, 1), |g| (g.rank(), g.size()));
        let layout = ShardLayout::new(&config, tp_rank, tp_size, &spec)?;
        if params.len() != layout.total_len() {
            return Err(Error::InvalidArgument(format!(
                "parameter buffer has {} elements, the layout needs {}",
                params.len(),
                layout.total_len()
            )));
        }
        let half = precision.gemm_input() != GemmInput::F32;
        let (bt, c) = (b * t, config.n_embd);
        let sp = sp && tp_size > 1;
        if sp && bt % tp_size != 0 {
            return Err(Error::config("parallel.sequence_parallel", format!("B*T = {bt} rows do not split over tp = {tp_size}")));
        }
        let r = if sp { bt / tp_size } else { bt };
        let rows = Rows { bt, rows: r, row0: if sp { tp_rank * r } else { 0 }, sp };
        let vl = config.padded_vocab_size() / tp_size;
        let vocab = VocabShard { start: tp_rank * vl, vl, real: real_columns(tp_rank * vl, vl, config.vocab_size) };
        let nkvl = (config.n_kv_head() / tp_size).max(1);
        let w = Widths { cl: c / tp_size, hl: config.ffn_dim() / tp_size, nhl: config.n_head / tp_size, nkvl, vocab };
        let (index, ends) = end_tensors(&layout, &spec, config.llama.is_some())?;
        let mut p = Vec::new();
        let mut g = Vec::new();
        let mut p16 = Vec::new();
        for e in layout.entries() {
            p.push(dev.alloc(0)?);
            g.push(dev.alloc(e.len * 4)?);
            p16.push(if half && e.local_shape.len() == 2 { Some(dev.alloc(0)?) } else { None });
        }
        let d = ActDims { tp: tp.is_some(), recompute, ..ActDims::of_rank(&config, b, t, tp_size, sp) };
        let work = BlockActs::work(&dev, &d)?;
        let chunks = (0..spec.chunks.len())
            .map(|k| {
                let (layers, embeds, ends) = (spec.chunks[k].clone(), spec.embeds(k), spec.ends(k));
                let slots = (0..slots).map(|_| SlotActs::new(&dev, &d, layers.len(), embeds, ends)).collect::<Result<_>>()?;
                Ok(Chunk { layers, embeds, ends, slots })
            })
            .collect::<Result<Vec<_>>>()?;
        let head_vl = if spec.last { vl } else { 0 };
        let s = Scratch::new(&dev, &d, spec.last, t)?;
        let linear = Linear::new(&dev, precision.gemm_input(), bt * c.max(d.qkv).max(d.fc).max(head_vl), bt * c.max(w.hl))?;
        let llama = llama_layers::LlamaWork::new(&dev, &config, (b, t), &d, (tp_rank, tp_size))?;
        let attn = AttnWork::new(&dev, AttnShape { b, t, nh: w.nhl, hs: config.head_dim(), nkv: w.nkvl })?;
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
            rows,
            params: p,
            grads: g,
            params16: p16,
            index,
            host_params: params,
            host_grads: vec![0.0; n],
            params_stale: true,
            host_reports: true,
            chunks,
            s,
            linear,
            attn,
            hidden: vec![0.0; r * c],
            llama,
            shards: None,
            release_grads: false,
            poison: false,
            loss_scale: 1.0,
            recompute,
            work,
            grads_zero: false,
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

    /// Elements of a hidden state exchanged with neighbouring stages: (R, C).
    pub fn hidden_len(&self) -> usize {
        self.hidden.len()
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

    /// Collective over the TP group and, at ZeRO-3, the data-parallel group (no-op without
    /// them): an error on every member if one of the step's stream-ordered collectives (TP sums
    /// and gathers, parameter gathers) failed on any (see `GpuCommState::check`).
    pub fn check_collectives(&mut self) -> Result<()> {
        if let Some(g) = &mut self.tp {
            g.check(&self.dev)?;
        }
        self.check_param_shards()
    }

    /// Flat parameters (host mirror).
    pub fn params(&self) -> &[f32] {
        &self.host_params
    }

    /// Flat parameters and gradients (host mirrors), mutable; the parameters go to the device
    /// again before the next forward (at ZeRO-3, where the model keeps only its shards, with
    /// [`DeviceGpt::param_shards_from_host`]).
    pub fn params_and_grads(&mut self) -> (&mut [f32], &mut [f32]) {
        self.params_stale = true;
        self.grads_zero = false;
        (&mut self.host_params, &mut self.host_grads)
    }

    /// Device elements of the activations and scratch, in f32 units (for the memory estimate).
    pub fn activation_elements(&self) -> usize {
        let d = self.dims();
        let slots: usize = self
            .chunks
            .iter()
            .map(|k| k.slots.len() * SlotActs::elements(&d, k.layers.len(), k.embeds, k.ends))
            .sum();
        slots + d.recompute_elements()
            + Scratch::elements(&d, self.ends.lnf.is_some(), self.t)
            + self.linear.scratch_elements()
            + AttnWork::elements(&self.dev, self.attn_shape())
            + self.llama.as_ref().map_or(0, llama_layers::LlamaWork::elements)
    }

    fn dims(&self) -> ActDims {
        let tp_size = self.tp.as_ref().map_or(1, |g| g.size());
        ActDims { tp: self.tp.is_some(), recompute: self.recompute, ..ActDims::of_rank(&self.config, self.b, self.t, tp_size, self.rows.sp) }
    }

    /// Clears the gradients (device and host mirror).
    pub fn zero_grad(&mut self) -> Result<()> {
        if std::mem::take(&mut self.grads_zero) {
            self.host_grads.fill(0.0);
            return Ok(());
        }
        for (g, e) in self.grads.iter_mut().zip(self.layout.entries()) {
            if !g.is_empty() {
                ops::fill_zero(&self.dev, g, e.len)?;
            }
        }
        self.host_grads.fill(0.0);
        Ok(())
    }

    /// Allocates entry `i`'s parameters and bf16 copy if they are not.
    fn ensure_entry(&mut self, i: usize) -> Result<()> {
        let len = self.layout.entries()[i].len;
        if self.params[i].len() != len * 4 {
            self.params[i] = self.dev.alloc(len * 4)?;
        }
        if let Some(p16) = &mut self.params16[i] {
            if p16.len() != len * 2 {
                *p16 = self.dev.alloc(len * 2)?;
            }
        }
        Ok(())
    }

    fn upload_params(&mut self) -> Result<()> {
        if self.host_params.len() != self.layout.total_len() {
            return Err(Error::Check("the host copy of the parameters was given back: the device holds the training state".into()));
        }
        for i in 0..self.params.len() {
            self.ensure_entry(i)?;
            let e = &self.layout.entries()[i];
            self.dev.copy_to_device(&mut self.params[i], &self.host_params[e.range()])?;
            if let Some(p16) = &mut self.params16[i] {
                cast_copy(&self.linear, &self.dev, p16, &self.params[i], e.len)?;
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

    /// The device, the layout table and every entry's f32 parameters and gradients, for an
    /// optimizer that updates them in place (the parameters uploaded first if the host copy is
    /// newer; the bf16 copies follow in [`DeviceGpt::refresh_params16`]).
    pub fn tensors_mut(&mut self) -> Result<(&Device, &ShardLayout, &mut [DeviceBuffer], &mut [DeviceBuffer])> {
        self.grads_zero = false;
        if self.params_stale && self.shards.is_none() {
            self.upload_params()?;
        }
        Ok((&self.dev, &self.layout, &mut self.params, &mut self.grads))
    }

    /// Records that an optimizer left every device gradient at zero (after
    /// [`DeviceGpt::tensors_mut`]), so the next [`DeviceGpt::zero_grad`] skips its pass over them.
    pub fn note_grads_zeroed(&mut self) {
        self.grads_zero = true;
    }

    /// Gives the host copy of the parameters back once the device holds the training state
    /// (an optimizer on the device loaded it); [`DeviceGpt::host_params_from_device`] brings it
    /// back for a checkpoint. Until then [`DeviceGpt::params`] is empty.
    pub fn release_host_params(&mut self) -> Result<()> {
        if self.params_stale && self.shards.is_none() {
            self.upload_params()?;
        }
        self.host_params = Vec::new();
        Ok(())
    }

    /// Whether [`DeviceGpt::report_grads`] brings the gradients to the host mirror (default on).
    pub fn set_host_reports(&mut self, on: bool) {
        self.host_reports = on;
        // Without reports nothing reads the host gradients: give their memory back.
        match on {
            true => self.host_grads.resize(self.layout.total_len(), 0.0),
            false => self.host_grads = Vec::new(),
        }
    }

    /// With host reports on, copies the device gradients into the host mirror and hands them to
    /// `on_final(0..n, grads)`; without, does nothing (the optimizer reads the device).
    pub fn report_grads(&mut self, on_final: &mut dyn FnMut(Range<usize>, &mut [f32])) -> Result<()> {
        if !self.host_reports {
            return Ok(());
        }
        for (i, e) in self.layout.entries().iter().enumerate() {
            self.dev.copy_to_host(&self.grads[i], &mut self.host_grads[e.range()])?;
        }
        let n = self.host_grads.len();
        on_final(0..n, &mut self.host_grads);
        Ok(())
    }

    /// Sums the tied embedding's device gradient over `tied` (the first and the last pipeline
    /// stage), staged through host memory; no-op on a stage without `wte`.
    pub fn sum_tied_grads(&mut self, tied: &Communicator) -> Result<()> {
        let Some(wte) = self.ends.wte else { return Ok(()) };
        self.grads_zero = false;
        let mut g = vec![0f32; self.layout.entries()[wte].len];
        self.dev.copy_to_host(&self.grads[wte], &mut g)?;
        tied.all_reduce(&mut g, ReduceOp::Sum)?;
        self.dev.copy_to_device(&mut self.grads[wte], &g)
    }

    fn entry(&self, r: &Range<usize>) -> usize {
        *self.index.get(&r.start).expect("every layout range starts an entry")
    }

    /// Mean cross-entropy of `tokens` (B, T) against `targets` (B, T), keeping activations (the
    /// whole model: one chunk that embeds and ends).
    pub fn forward(&mut self, tokens: &[u32], targets: &[u32]) -> Result<f64> {
        self.forward_chunk(0, 0, StageInput::Tokens(tokens), Some(targets))?
            .ok_or_else(|| Error::InvalidArgument("forward: this device model is a pipeline stage without the loss".into()))
    }

    /// The logits (B*T, Vp/tp) of the last forward of a model that ends with the head (chunk
    /// 0's slot 0 on a whole model), copied to the host.
    pub fn last_logits(&self) -> Result<Vec<f32>> {
        let k = self.chunks.last().ok_or_else(|| Error::InvalidArgument("last_logits: no chunk".into()))?;
        let h = k.slots[0].head.as_ref().ok_or_else(|| Error::InvalidArgument("last_logits: this stage has no head".into()))?;
        let mut out = vec![0f32; self.rows.bt * self.w.vocab.vl];
        self.dev.copy_to_host(&h.logits, &mut out)?;
        Ok(out)
    }

    /// Adds d(mean loss)/d(params) of the last forward into the device gradients; with
    /// `report`, then reports them ([`DeviceGpt::report_grads`]). Without sequence parallelism
    /// replicated tensors get the same gradient on every TP rank (their inputs are identical);
    /// with it their per-micro-batch gradients are summed over TP (`device_gpt/layers.rs`).
    pub fn backward(&mut self, report: bool, on_final: &mut dyn FnMut(Range<usize>, &mut [f32])) -> Result<()> {
        if self.backward_chunk(0, 0, false, None)? {
            return Err(Error::InvalidArgument("backward: this device model is a pipeline stage".into()));
        }
        if report {
            self.report_grads(on_final)?;
        }
        Ok(())
    }

    /// The backward of the whole model handing each unit's gradients to `sink` as soon as they
    /// are final (the final LayerNorm, each block in reverse, then `wte` and `wpe`); with
    /// [`DeviceGpt::set_grad_release`] they are freed right after, so besides the unit being
    /// computed only `wte` (written by the head and the embedding) holds gradients.
    pub fn backward_reducing(&mut self, sink: &mut GradSink) -> Result<()> {
        if self.backward_chunk(0, 0, false, Some(sink))? {
            return Err(Error::InvalidArgument("backward: this device model is a pipeline stage".into()));
        }
        Ok(())
    }

    /// Makes the next backward of the loss start from a NaN gradient, so that every gradient of
    /// this rank is NaN while its loss stays finite (`MESHTRAIN_FAULT=nan-grad@RANK:STEP`; only a
    /// rank holding the head computes a loss backward).
    pub fn poison_next_backward(&mut self) {
        self.poison = true;
    }

    /// Multiplies the loss gradient of the following backwards by `scale` (dynamic loss
    /// scaling): every gradient comes out `scale` times the loss's, rounded once where the
    /// loss gradient is formed. 1 (the default) changes no bit.
    pub fn set_loss_scale(&mut self, scale: f64) {
        self.loss_scale = scale;
    }

    /// Whether the model is whole (one chunk with the embedding and the head: not a pipeline
    /// stage).
    pub fn is_whole(&self) -> bool {
        self.chunks.len() == 1 && self.chunks[0].embeds && self.chunks[0].ends
    }

    /// Runs chunk `chunk` on one micro-batch into `slot` : the
    /// embedding chunk takes tokens, the others the previous stage's hidden state (B*T, C); the
    /// model's last chunk takes `targets` and returns the mean loss, the others their output.
    pub fn forward_stage(
        &mut self,
        chunk: usize,
        slot: usize,
        input: StageInput<'_>,
        targets: Option<&[u32]>,
    ) -> Result<StageOutput<'_>> {
        match self.forward_chunk(chunk, slot, input, targets)? {
            Some(loss) => Ok(StageOutput::Loss(loss as f32)),
            None => {
                let out = self.chunks[chunk].slots[slot].output();
                self.dev.copy_to_host(out, &mut self.hidden)?;
                Ok(StageOutput::Hidden(&self.hidden))
            }
        }
    }

    /// Accumulates the gradients of `slot`'s micro-batch through chunk `chunk` : `grad_output` is d(hidden output) (B*T, C), None on the
    /// model's last chunk. Returns d(hidden input) for the previous stage (None when embedding).
    pub fn backward_stage(&mut self, chunk: usize, slot: usize, grad_output: Option<&[f32]>) -> Result<Option<&[f32]>> {
        if let Some(g) = grad_output {
            check_len("backward: grad_output", g.len(), self.hidden.len())?;
            self.dev.copy_to_device(&mut self.s.dres, g)?;
        }
        if self.backward_chunk(chunk, slot, grad_output.is_some(), None)? {
            self.dev.copy_to_host(&self.s.dres, &mut self.hidden)?;
            return Ok(Some(&self.hidden));
        }
        Ok(None)
    }

    /// Checks a call on (`chunk`, `slot`).
    fn check_slot(&self, op: &str, chunk: usize, slot: usize) -> Result<()> {
        let Some(k) = self.chunks.get(chunk) else {
            return Err(Error::InvalidArgument(format!("{op}: chunk {chunk} but the stage has {}", self.chunks.len())));
        };
        if slot >= k.slots.len() {
            return Err(Error::InvalidArgument(format!("{op}: slot {slot} but the stage has {}", k.slots.len())));
        }
        Ok(())
    }

    /// The forward of [`DeviceGpt::forward_stage`]; returns the loss on the model's last chunk.
    fn forward_chunk(&mut self, ci: usize, si: usize, input: StageInput<'_>, targets: Option<&[u32]>) -> Result<Option<f64>> {
        self.check_slot("forward", ci, si)?;
        let (bt, c, v) = (self.rows.bt, self.config.n_embd, self.config.vocab_size);
        let (embeds, ends) = (self.chunks[ci].embeds, self.chunks[ci].ends);
        if ends != targets.is_some() {
            return Err(Error::InvalidArgument(format!(
                "forward: targets must be given exactly to the model's last chunk (chunk {ci} is {}the last)",
                if ends { "" } else { "not " }
            )));
        }
        let ids = match input {
            StageInput::Tokens(tokens) if embeds => Some(tokens),
            StageInput::Hidden(h) if !embeds => {
                check_len("forward: hidden input", h.len(), self.rows.rows * c)?;
                None
            }
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "forward: chunk {ci} {} the tokens, so it takes {}",
                    if embeds { "embeds" } else { "does not embed" },
                    if embeds { "tokens" } else { "a hidden state" }
                )))
            }
        };
        for (what, ids) in [("tokens", ids), ("targets", targets)] {
            let Some(ids) = ids else { continue };
            if ids.len() != bt {
                return Err(Error::InvalidArgument(format!("forward: {what} has {} ids, expected B*T = {bt}", ids.len())));
            }
            if let Some((i, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= v) {
                return Err(Error::InvalidArgument(format!("forward: {what}[{i}] = {id} is outside the vocabulary ({v})")));
            }
        }
        if self.params_stale && self.shards.is_none() {
            self.upload_params()?;
        }
        let a = &mut self.chunks[ci].slots[si];
        a.forward_done = false;
        match input {
            StageInput::Hidden(h) => self.dev.copy_to_device(&mut a.input, h)?,
            StageInput::Tokens(tokens) => {
                self.dev.copy_to_device(&mut a.tokens, &ops_vocab::token_index(tokens))?;
                self.acquire(Use::Embedding)?;
                self.embed_forward(ci, si)?;
            }
        }
        for li in 0..self.chunks[ci].layers.len() {
            self.acquire(Use::Block(self.chunks[ci].layers.start + li))?;
            self.block_forward(ci, si, li)?;
        }
        self.chunks[ci].slots[si].forward_done = true;
        match targets {
            Some(tg) => {
                self.acquire(Use::Head)?;
                self.head_forward(ci, si, tg).map(Some)
            }
            None => Ok(None),
        }
    }

    /// Entry indices of block `l`'s tensors: ln1 w, b; qkv w, b; attn.proj w, b; ln2 w, b;
    /// fc w, b; mlp.proj w, b (Llama: [`DeviceGpt::llama_block_entries`]).
    fn block_entries(&self, l: usize) -> [usize; 12] {
        if self.llama.is_some() {
            return self.llama_block_entries(l);
        }
        let r = self.layout.block(l);
        [
            &r.ln1_w, &r.ln1_b, &r.qkv_w, &r.qkv_b, &r.attn_proj_w, &r.attn_proj_b,
            &r.ln2_w, &r.ln2_b, &r.fc_w, &r.fc_b, &r.mlp_proj_w, &r.mlp_proj_b,
        ]
        .map(|r| self.entry(r))
    }

    fn attn_shape(&self) -> AttnShape {
        AttnShape { b: self.b, t: self.t, nh: self.w.nhl, hs: self.config.head_dim(), nkv: self.w.nkvl }
    }

    /// The backward of [`DeviceGpt::backward_stage`] with d(chunk output) already in `s.dres`
    /// when `given`, handing each unit's final gradients to `sink` if given; returns whether
    /// d(chunk input) is left in `s.dres`.
    fn backward_chunk(&mut self, ci: usize, si: usize, given: bool, mut sink: Option<&mut GradSink>) -> Result<bool> {
        self.grads_zero = false;
        self.check_slot("backward", ci, si)?;
        let (embeds, ends) = (self.chunks[ci].embeds, self.chunks[ci].ends);
        if ends == given {
            return Err(Error::InvalidArgument(format!(
                "backward: grad_output must be given exactly to chunks other than the model's last (chunk {ci} is {}the last)",
                if ends { "" } else { "not " }
            )));
        }
        if !self.chunks[ci].slots[si].forward_done {
            return Err(Error::InvalidArgument(format!("backward called without a forward of slot {si} of chunk {ci} since its last backward")));
        }
        self.chunks[ci].slots[si].forward_done = false;
        if ends {
            self.acquire(Use::Head)?;
            self.ensure_grads(Use::Head)?;
            self.head_backward(ci, si)?;
            if let Some(sink) = sink.as_deref_mut() {
                // `wte` also gets the embedding's gradient when this chunk embeds.
                let ranges = self.use_ranges(Use::Head);
                self.grads_final(&ranges[..if embeds { 1 } else { ranges.len() }], sink)?;
            }
        }
        for li in (0..self.chunks[ci].layers.len()).rev() {
            let l = self.chunks[ci].layers.start + li;
            self.acquire(Use::Block(l))?;
            self.ensure_grads(Use::Block(l))?;
            self.block_backward(ci, si, li)?;
            if let Some(sink) = sink.as_deref_mut() {
                self.grads_final(&self.use_ranges(Use::Block(l)), sink)?;
            }
        }
        if !embeds {
            return Ok(true);
        }
        self.ensure_grads(Use::Embedding)?;
        self.embed_backward(ci, si)?;
        if let Some(sink) = sink {
            self.grads_final(&self.use_ranges(Use::Embedding), sink)?;
        }
        Ok(false)
    }
}

/// Refuses a batch shape, slot count or stage the executor cannot run.
fn check_shape(config: &GptConfig, (b, t): (usize, usize), spec: &StageSpec, slots: usize) -> Result<()> {
    config.validate()?;
    if b == 0 || t == 0 || t > config.max_seq_len {
        return Err(Error::config("train.seq_len", format!("B={b}, T={t} must be positive with T <= {}", config.max_seq_len)));
    }
    if slots == 0 || spec.chunks.is_empty() {
        return Err(Error::InvalidArgument("a device stage needs at least one chunk and one slot".into()));
    }
    Ok(())
}

/// The entry index of each layout offset, and the stage's end tensors (`wte`, `wpe`, `lnf`),
/// which must be the ones its place in the pipeline reads.
fn end_tensors(layout: &ShardLayout, spec: &StageSpec, llama: bool) -> Result<(HashMap<usize, usize>, Ends)> {
    let index: HashMap<usize, usize> = layout.entries().iter().enumerate().map(|(i, e)| (e.offset, i)).collect();
    let at = |name: &str| layout.get(name).map(|e| index[&e.offset]);
    let ends = Ends {
        wte: at("wte"),
        wpe: at("wpe"),
        lnf: at("lnf.weight").zip(at("lnf.bias")).or(at("norm.weight").map(|n| (n, n))),
        head: at("lm_head.weight").or(at("wte").filter(|_| spec.last)),
    };
    let tied = layout.tied_head();
    let consistent = ends.wte.is_some() == (spec.first || (spec.last && tied))
        && ends.wpe.is_some() == (spec.first && !llama)
        && ends.lnf.is_some() == spec.last
        && ends.head.is_some() == spec.last;
    if !consistent {
        return Err(Error::Check(format!("the shard layout's end tensors do not match the stage {spec:?}")));
    }
    Ok((index, ends))
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(Error::InvalidArgument(format!("{what} has {got} elements, expected {want}")));
    }
    Ok(())
}

/// The 16-bit copy `p16` of `n` f32 parameters in the type `linear` reads (bf16 or fp16).
fn cast_copy(linear: &Linear, dev: &Device, p16: &mut DeviceBuffer, p: &DeviceBuffer, n: usize) -> Result<()> {
    match linear.half() {
        Some(ty) => ty.cast_from_f32(dev, p16, p, n),
        None => Err(Error::Check("a 16-bit weight copy in an fp32 model".into())),
    }
}
