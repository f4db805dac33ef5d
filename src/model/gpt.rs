//! The GPT-2 model on CPU: parameters, gradients and activations, composed from the layer files.
//!
//! This is the numerical reference for every later device and parallel implementation.
//! Invariants: `params` and `grads` follow [`ParamLayout`]; activations are sized for the
//! (B, T) given at construction and never reallocated; `backward` ADDS into `grads` (gradient
//! accumulation over micro-batches), `zero_grad` clears them; `backward` needs a `forward` since
//! the previous `backward`.
//!
//! Seams for parallelism (not built yet): blocks run one at a time from the residual stream
//! (`block_forward(l)` / `block_backward(l)`), so a pipeline stage runs its layer range with the
//! parameters of [`ParamLayout::layers_range`]; attention takes its head count and linear its
//! in/out widths, so a tensor-parallel rank calls them with its shard's sizes.

use std::ops::Range;

use super::activations::{slab, slab_mut, Activations, GradActivations};
use super::init::init_params;
use super::layout::ParamLayout;
use super::GptConfig;
use crate::device::cpu::attention::{attention_backward, attention_forward, AttnShape};
use crate::device::cpu::cross_entropy::{cross_entropy_backward, cross_entropy_forward};
use crate::device::cpu::encoder::{encoder_backward, encoder_forward};
use crate::device::cpu::float::Float;
use crate::device::cpu::gelu::{gelu_backward, gelu_forward};
use crate::device::cpu::layernorm::{layernorm_backward, layernorm_forward};
use crate::device::cpu::linear::{linear_backward, linear_forward};
use crate::device::cpu::residual::residual_forward;
use crate::error::{Error, Result};

/// A GPT-2 model with its optimizer-facing flat buffers, runnable at a fixed (B, T).
pub struct Gpt<F: Float> {
    config: GptConfig,
    layout: ParamLayout,
    /// All parameters (layout order).
    params: Vec<F>,
    /// Gradients, same layout; accumulated by `backward`.
    grads: Vec<F>,
    acts: Activations<F>,
    dacts: GradActivations<F>,
    /// Batch size (B).
    b: usize,
    /// Sequence length (T).
    t: usize,
    /// Input tokens of the last forward (B, T).
    tokens: Vec<u32>,
    /// Targets of the last forward (B, T).
    targets: Vec<u32>,
    /// Whether a forward ran since the last backward.
    forward_done: bool,
}

/// Shape and sizes only: the buffers are far too large to print.
impl<F: Float> std::fmt::Debug for Gpt<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpt")
            .field("config", &self.config)
            .field("batch", &self.b)
            .field("seq_len", &self.t)
            .field("params", &self.params.len())
            .field("activation_elements", &self.activation_elements())
            .finish()
    }
}

/// Disjoint mutable views of two ranges of `buf`; `first` must end before `second` starts.
fn pair_mut<F>(buf: &mut [F], first: Range<usize>, second: Range<usize>) -> (&mut [F], &mut [F]) {
    assert!(
        first.end <= second.start,
        "pair_mut: {first:?} overlaps or follows {second:?}"
    );
    let (lo, hi) = buf.split_at_mut(second.start);
    (&mut lo[first], &mut hi[..second.end - second.start])
}

impl<F: Float> Gpt<F> {
    /// A freshly initialized model (see `init.rs`) for batches of `batch` sequences of `seq_len`.
    pub fn new(config: GptConfig, batch: usize, seq_len: usize, seed: u64) -> Result<Self> {
        config.validate()?;
        let layout = ParamLayout::new(&config);
        let params = init_params(&config, &layout, seed);
        Self::from_params(config, batch, seq_len, params)
    }

    /// A model with the given flat parameters (layout order), e.g. loaded from a checkpoint.
    pub fn from_params(config: GptConfig, batch: usize, seq_len: usize, params: Vec<F>) -> Result<Self> {
        config.validate()?;
        if batch == 0 {
            return Err(Error::config("train.micro_batch", "must be at least 1"));
        }
        if seq_len == 0 || seq_len > config.max_seq_len {
            return Err(Error::config(
                "train.seq_len",
                format!(
                    "{seq_len} is not in 1..={} (model.max_seq_len)",
                    config.max_seq_len
                ),
            ));
        }
        let layout = ParamLayout::new(&config);
        if params.len() != layout.total_len() {
            return Err(Error::InvalidArgument(format!(
                "parameter buffer has {} elements, the layout of this config needs {}",
                params.len(),
                layout.total_len()
            )));
        }
        let n = batch * seq_len;
        Ok(Gpt {
            grads: vec![F::zero(); params.len()],
            params,
            acts: Activations::new(&config, batch, seq_len),
            dacts: GradActivations::new(&config, batch, seq_len),
            config,
            layout,
            b: batch,
            t: seq_len,
            tokens: vec![0; n],
            targets: vec![0; n],
            forward_done: false,
        })
    }

    /// The model shape.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// The parameter layout table.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// Batch size B the activations are sized for.
    pub fn batch(&self) -> usize {
        self.b
    }

    /// Sequence length T the activations are sized for.
    pub fn seq_len(&self) -> usize {
        self.t
    }

    /// Flat parameters.
    pub fn params(&self) -> &[F] {
        &self.params
    }

    /// Flat parameters, mutable (loading, broadcasting, tests).
    pub fn params_mut(&mut self) -> &mut [F] {
        &mut self.params
    }

    /// Flat gradients.
    pub fn grads(&self) -> &[F] {
        &self.grads
    }

    /// Flat gradients, mutable (all-reduce, clipping).
    pub fn grads_mut(&mut self) -> &mut [F] {
        &mut self.grads
    }

    /// Parameters and gradients together, both mutable: the data-parallel step reduces gradients
    /// in place before the optimizer updates the parameters.
    pub fn params_and_grads(&mut self) -> (&mut [F], &mut [F]) {
        (&mut self.params, &mut self.grads)
    }

    /// Logits of the last forward (B, T, Vp); padded columns are meaningless.
    pub fn logits(&self) -> &[F] {
        &self.acts.logits
    }

    /// Elements held by activations and their backward scratch (for memory accounting).
    pub fn activation_elements(&self) -> usize {
        self.acts.num_elements() + self.dacts.num_elements()
    }

    /// Sets all gradients to zero.
    pub fn zero_grad(&mut self) {
        self.grads.iter_mut().for_each(|g| *g = F::zero());
    }

    /// Runs the model on `tokens` (B, T) and returns the mean cross-entropy against `targets`
    /// (B, T). Keeps the activations for [`Gpt::backward`].
    pub fn forward(&mut self, tokens: &[u32], targets: &[u32]) -> Result<F> {
        self.set_batch(tokens, targets)?;
        let (b, t, c) = (self.b, self.t, self.config.n_embd);
        let (v, vp, nl) = (
            self.config.vocab_size,
            self.config.padded_vocab_size(),
            self.config.n_layer,
        );
        let bt = b * t;
        let (wte, wpe) = (&self.params[self.layout.wte()], &self.params[self.layout.wpe()]);
        encoder_forward(&mut self.acts.encoded, &self.tokens, wte, wpe, t, c);
        for l in 0..nl {
            self.block_forward(l);
        }
        let p = &self.params;
        let a = &mut self.acts;
        let (lnf_w, lnf_b) = self.layout.lnf();
        let last = slab(&a.residual3, nl - 1, bt * c); // (B, T, C)
        layernorm_forward(
            &mut a.lnf,
            &mut a.lnf_mean,
            &mut a.lnf_rstd,
            last,
            &p[lnf_w],
            &p[lnf_b],
            c,
        );
        linear_forward(&mut a.logits, &a.lnf, &p[self.layout.wte()], None, bt, c, vp);
        cross_entropy_forward(&mut a.losses, &mut a.lse, &a.logits, &self.targets, v, vp);
        self.forward_done = true;
        let mean = a.losses.iter().map(|l| l.as_f64()).sum::<f64>() / bt as f64;
        Ok(F::from_f64(mean))
    }

    /// Checks and stores the batch.
    fn set_batch(&mut self, tokens: &[u32], targets: &[u32]) -> Result<()> {
        let n = self.b * self.t;
        let v = self.config.vocab_size;
        for (what, ids) in [("tokens", tokens), ("targets", targets)] {
            if ids.len() != n {
                return Err(Error::InvalidArgument(format!(
                    "forward: {what} has {} ids, expected B*T = {}*{} = {n}",
                    ids.len(),
                    self.b,
                    self.t
                )));
            }
            if let Some((i, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= v) {
                return Err(Error::InvalidArgument(format!(
                    "forward: {what}[{i}] = {id} is outside the vocabulary (size {v})"
                )));
            }
        }
        self.tokens.copy_from_slice(tokens);
        self.targets.copy_from_slice(targets);
        Ok(())
    }

    /// Attention shape of this model.
    fn attn_shape(&self) -> AttnShape {
        AttnShape {
            b: self.b,
            t: self.t,
            nh: self.config.n_head,
            hs: self.config.head_dim(),
            nkv: self.config.n_head,
        }
    }

    /// Block `l`: residual3[l] = r2 + mlp(ln2(r2)), r2 = x + attn(ln1(x)), x = block input.
    fn block_forward(&mut self, l: usize) {
        let (c, bt) = (self.config.n_embd, self.b * self.t);
        let shape = self.attn_shape();
        let att_len = shape.b * shape.nh * shape.t * shape.t;
        let p = &self.params;
        let r = self.layout.block(l);
        let a = &mut self.acts;
        let (prev, rest) = a.residual3.split_at_mut(l * bt * c);
        let x: &[F] = if l == 0 {
            &a.encoded
        } else {
            slab(prev, l - 1, bt * c)
        }; // (B, T, C)
        let residual3 = &mut rest[..bt * c]; // (B, T, C)
        let ln1 = slab_mut(&mut a.ln1, l, bt * c); // (B, T, C)
        let (ln1_mean, ln1_rstd) = (slab_mut(&mut a.ln1_mean, l, bt), slab_mut(&mut a.ln1_rstd, l, bt));
        layernorm_forward(ln1, ln1_mean, ln1_rstd, x, &p[r.ln1_w], &p[r.ln1_b], c);
        let qkv = slab_mut(&mut a.qkv, l, bt * 3 * c); // (B, T, 3C)
        linear_forward(qkv, ln1, &p[r.qkv_w], Some(&p[r.qkv_b]), bt, c, 3 * c);
        let atty = slab_mut(&mut a.atty, l, bt * c); // (B, T, C)
        let att = slab_mut(&mut a.att, l, att_len); // (B, NH, T, T)
        attention_forward(atty, att, qkv, shape);
        linear_forward(
            &mut a.branch,
            atty,
            &p[r.attn_proj_w],
            Some(&p[r.attn_proj_b]),
            bt,
            c,
            c,
        );
        let residual2 = slab_mut(&mut a.residual2, l, bt * c); // (B, T, C)
        residual_forward(residual2, x, &a.branch);
        let ln2 = slab_mut(&mut a.ln2, l, bt * c); // (B, T, C)
        let (ln2_mean, ln2_rstd) = (slab_mut(&mut a.ln2_mean, l, bt), slab_mut(&mut a.ln2_rstd, l, bt));
        layernorm_forward(ln2, ln2_mean, ln2_rstd, residual2, &p[r.ln2_w], &p[r.ln2_b], c);
        let fch = slab_mut(&mut a.fch, l, bt * 4 * c); // (B, T, 4C)
        linear_forward(fch, ln2, &p[r.fc_w], Some(&p[r.fc_b]), bt, c, 4 * c);
        let fch_gelu = slab_mut(&mut a.fch_gelu, l, bt * 4 * c); // (B, T, 4C)
        gelu_forward(fch_gelu, fch);
        linear_forward(
            &mut a.branch,
            fch_gelu,
            &p[r.mlp_proj_w],
            Some(&p[r.mlp_proj_b]),
            bt,
            4 * c,
            c,
        );
        residual_forward(residual3, residual2, &a.branch);
    }

    /// Accumulates d(mean loss)/d(params) of the last forward into the gradients.
    pub fn backward(&mut self) -> Result<()> {
        self.backward_with(&mut |_, _| {})
    }

    /// [`Gpt::backward`], calling `on_final(range, &mut grads[range])` as soon as `grads[range]` will not change
    /// any more in this backward: the final LayerNorm first, then each block in reverse order, then
    /// the embeddings (the tied `wte` also receives the head's gradient, so it is final only at the
    /// end). The ranges are disjoint and cover the whole buffer; data-parallel training starts
    /// reducing them while the rest of the backward runs.
    pub fn backward_with(&mut self, on_final: &mut dyn FnMut(Range<usize>, &mut [F])) -> Result<()> {
        if !self.forward_done {
            return Err(Error::InvalidArgument(
                "backward called without a forward since the last backward".into(),
            ));
        }
        self.forward_done = false;
        let (b, t, c) = (self.b, self.t, self.config.n_embd);
        let (v, vp, nl) = (
            self.config.vocab_size,
            self.config.padded_vocab_size(),
            self.config.n_layer,
        );
        let bt = b * t;
        let (p, g, a, d) = (&self.params, &mut self.grads, &self.acts, &mut self.dacts);
        let zero = |buf: &mut Vec<F>| buf.iter_mut().for_each(|x| *x = F::zero());
        zero(&mut d.dlogits);
        let dloss = F::from_f64(1.0 / bt as f64);
        cross_entropy_backward(&mut d.dlogits, &a.logits, &a.lse, &self.targets, dloss, v, vp);
        zero(&mut d.dln);
        let wte = self.layout.wte();
        linear_backward(
            &mut d.dln,
            &mut g[wte.clone()],
            None,
            &d.dlogits,
            &a.lnf,
            &p[wte],
            bt,
            c,
            vp,
        );
        zero(&mut d.dresidual);
        let (lnf_w, lnf_b) = self.layout.lnf();
        let (dw, db) = pair_mut(g, lnf_w.clone(), lnf_b);
        let last = slab(&a.residual3, nl - 1, bt * c); // (B, T, C)
        layernorm_backward(
            &mut d.dresidual,
            dw,
            db,
            &d.dln,
            last,
            &p[lnf_w],
            &a.lnf_mean,
            &a.lnf_rstd,
            c,
        );
        let blocks = self.layout.layers_range(0..nl);
        let head = blocks.end..self.grads.len();
        on_final(head.clone(), &mut self.grads[head]);
        for l in (0..nl).rev() {
            self.block_backward(l);
            let block = self.layout.layers_range(l..l + 1);
            on_final(block.clone(), &mut self.grads[block]);
        }
        let (dwte, dwpe) = pair_mut(&mut self.grads, self.layout.wte(), self.layout.wpe());
        encoder_backward(dwte, dwpe, &self.dacts.dresidual, &self.tokens, t, c);
        on_final(0..blocks.start, &mut self.grads[..blocks.start]);
        Ok(())
    }

    /// Backward of block `l`: on entry `dresidual` holds d(block output), on exit d(block input).
    fn block_backward(&mut self, l: usize) {
        let (c, bt) = (self.config.n_embd, self.b * self.t);
        let shape = self.attn_shape();
        let att_len = shape.b * shape.nh * shape.t * shape.t;
        let r = self.layout.block(l);
        let (p, g, a, d) = (&self.params, &mut self.grads, &self.acts, &mut self.dacts);
        let zero = |buf: &mut Vec<F>| buf.iter_mut().for_each(|x| *x = F::zero());
        let x: &[F] = if l == 0 {
            &a.encoded
        } else {
            slab(&a.residual3, l - 1, bt * c)
        }; // (B, T, C)
           // MLP sub-block; its output gradient is the residual stream's (residual backward = identity).
        zero(&mut d.dfch_gelu);
        let (dw, db) = pair_mut(g, r.mlp_proj_w.clone(), r.mlp_proj_b);
        let fch_gelu = slab(&a.fch_gelu, l, bt * 4 * c); // (B, T, 4C)
        linear_backward(
            &mut d.dfch_gelu,
            dw,
            Some(db),
            &d.dresidual,
            fch_gelu,
            &p[r.mlp_proj_w],
            bt,
            4 * c,
            c,
        );
        zero(&mut d.dfch);
        gelu_backward(&mut d.dfch, slab(&a.fch, l, bt * 4 * c), &d.dfch_gelu);
        zero(&mut d.dln);
        let (dw, db) = pair_mut(g, r.fc_w.clone(), r.fc_b);
        let ln2 = slab(&a.ln2, l, bt * c); // (B, T, C)
        linear_backward(&mut d.dln, dw, Some(db), &d.dfch, ln2, &p[r.fc_w], bt, c, 4 * c);
        let (dw, db) = pair_mut(g, r.ln2_w.clone(), r.ln2_b);
        let (mean, rstd) = (slab(&a.ln2_mean, l, bt), slab(&a.ln2_rstd, l, bt));
        let residual2 = slab(&a.residual2, l, bt * c); // (B, T, C)
        layernorm_backward(
            &mut d.dresidual,
            dw,
            db,
            &d.dln,
            residual2,
            &p[r.ln2_w],
            mean,
            rstd,
            c,
        );
        // Attention sub-block.
        zero(&mut d.datty);
        let (dw, db) = pair_mut(g, r.attn_proj_w.clone(), r.attn_proj_b);
        let atty = slab(&a.atty, l, bt * c); // (B, T, C)
        linear_backward(
            &mut d.datty,
            dw,
            Some(db),
            &d.dresidual,
            atty,
            &p[r.attn_proj_w],
            bt,
            c,
            c,
        );
        zero(&mut d.dqkv);
        let (qkv, att) = (slab(&a.qkv, l, bt * 3 * c), slab(&a.att, l, att_len));
        attention_backward(&mut d.dqkv, &mut d.dpre, &d.datty, qkv, att, shape);
        zero(&mut d.dln);
        let (dw, db) = pair_mut(g, r.qkv_w.clone(), r.qkv_b);
        let ln1 = slab(&a.ln1, l, bt * c); // (B, T, C)
        linear_backward(&mut d.dln, dw, Some(db), &d.dqkv, ln1, &p[r.qkv_w], bt, c, 3 * c);
        let (dw, db) = pair_mut(g, r.ln1_w.clone(), r.ln1_b);
        let (mean, rstd) = (slab(&a.ln1_mean, l, bt), slab(&a.ln1_rstd, l, bt));
        layernorm_backward(&mut d.dresidual, dw, db, &d.dln, x, &p[r.ln1_w], mean, rstd, c);
    }
}
