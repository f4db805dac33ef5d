//! Forward activations and backward scratch of a model run at a fixed (B, T).
//!
//! Both are allocated once when the model is built (no allocation per step). Forward buffers
//! keep one slab per block (`(L, ...)`) because the backward needs every block's inputs;
//! gradient buffers hold a single block's worth and are reused from the last block down, since
//! the backward visits one block at a time. The residual stream has one gradient buffer (see
//! `residual.rs`).

use super::GptConfig;
use crate::device::cpu::float::Float;

/// Forward activations; shapes in comments (L = n_layer, NH = n_head, Vp = padded vocab).
pub struct Activations<F> {
    /// Token + position embeddings (B, T, C): the input of block 0.
    pub encoded: Vec<F>,
    /// ln1 output (L, B, T, C).
    pub ln1: Vec<F>,
    /// ln1 row means (L, B, T).
    pub ln1_mean: Vec<F>,
    /// ln1 row reciprocal std (L, B, T).
    pub ln1_rstd: Vec<F>,
    /// Fused q, k, v projections (L, B, T, 3C).
    pub qkv: Vec<F>,
    /// Attention output before its projection (L, B, T, C).
    pub atty: Vec<F>,
    /// Causal softmax probabilities (L, B, NH, T, T).
    pub att: Vec<F>,
    /// Residual stream after the attention sub-block (L, B, T, C).
    pub residual2: Vec<F>,
    /// ln2 output (L, B, T, C).
    pub ln2: Vec<F>,
    /// ln2 row means (L, B, T).
    pub ln2_mean: Vec<F>,
    /// ln2 row reciprocal std (L, B, T).
    pub ln2_rstd: Vec<F>,
    /// MLP hidden pre-activation (L, B, T, 4C).
    pub fch: Vec<F>,
    /// MLP hidden after GELU (L, B, T, 4C).
    pub fch_gelu: Vec<F>,
    /// Residual stream after the MLP sub-block = block output (L, B, T, C).
    pub residual3: Vec<F>,
    /// Scratch for a sub-block's output before the residual add (B, T, C); not kept.
    pub branch: Vec<F>,
    /// Final LayerNorm output (B, T, C).
    pub lnf: Vec<F>,
    /// lnf row means (B, T).
    pub lnf_mean: Vec<F>,
    /// lnf row reciprocal std (B, T).
    pub lnf_rstd: Vec<F>,
    /// Output logits (B, T, Vp); padded columns are computed but never used.
    pub logits: Vec<F>,
    /// Log-sum-exp of each logit row over the real vocabulary (B, T).
    pub lse: Vec<F>,
    /// Per-position cross-entropy (B, T).
    pub losses: Vec<F>,
}

/// Backward scratch for the activations; each buffer is zeroed before it accumulates.
pub struct GradActivations<F> {
    /// d logits (B, T, Vp).
    pub dlogits: Vec<F>,
    /// d residual stream at the point the backward has reached (B, T, C).
    pub dresidual: Vec<F>,
    /// d LayerNorm output, shared by lnf, ln2 and ln1 (B, T, C).
    pub dln: Vec<F>,
    /// d attention output before its projection (B, T, C).
    pub datty: Vec<F>,
    /// d qkv (B, T, 3C).
    pub dqkv: Vec<F>,
    /// d MLP hidden after GELU (B, T, 4C).
    pub dfch_gelu: Vec<F>,
    /// d MLP hidden before GELU (B, T, 4C).
    pub dfch: Vec<F>,
    /// Gradient of the attention's pre-softmax scores (B, NH, T, T), the backward's scratch.
    pub dpre: Vec<F>,
}

impl<F: Float> Activations<F> {
    /// Zeroed buffers for `config` at batch `b` and sequence length `t`.
    pub fn new(config: &GptConfig, b: usize, t: usize) -> Self {
        let (l, c, nh, vp) = (
            config.n_layer,
            config.n_embd,
            config.n_head,
            config.padded_vocab_size(),
        );
        let bt = b * t;
        let z = |n: usize| vec![F::zero(); n];
        Activations {
            encoded: z(bt * c),
            ln1: z(l * bt * c),
            ln1_mean: z(l * bt),
            ln1_rstd: z(l * bt),
            qkv: z(l * bt * 3 * c),
            atty: z(l * bt * c),
            att: z(l * b * nh * t * t),
            residual2: z(l * bt * c),
            ln2: z(l * bt * c),
            ln2_mean: z(l * bt),
            ln2_rstd: z(l * bt),
            fch: z(l * bt * 4 * c),
            fch_gelu: z(l * bt * 4 * c),
            residual3: z(l * bt * c),
            branch: z(bt * c),
            lnf: z(bt * c),
            lnf_mean: z(bt),
            lnf_rstd: z(bt),
            logits: z(bt * vp),
            lse: z(bt),
            losses: z(bt),
        }
    }

    /// Total number of elements held.
    pub fn num_elements(&self) -> usize {
        [
            &self.encoded,
            &self.ln1,
            &self.ln1_mean,
            &self.ln1_rstd,
            &self.qkv,
            &self.atty,
            &self.att,
            &self.residual2,
            &self.ln2,
            &self.ln2_mean,
            &self.ln2_rstd,
            &self.fch,
            &self.fch_gelu,
            &self.residual3,
            &self.branch,
            &self.lnf,
            &self.lnf_mean,
            &self.lnf_rstd,
            &self.logits,
            &self.lse,
            &self.losses,
        ]
        .iter()
        .map(|v| v.len())
        .sum()
    }
}

impl<F: Float> GradActivations<F> {
    /// Zeroed buffers for `config` at batch `b` and sequence length `t`.
    pub fn new(config: &GptConfig, b: usize, t: usize) -> Self {
        let (c, nh, vp) = (config.n_embd, config.n_head, config.padded_vocab_size());
        let bt = b * t;
        let z = |n: usize| vec![F::zero(); n];
        GradActivations {
            dlogits: z(bt * vp),
            dresidual: z(bt * c),
            dln: z(bt * c),
            datty: z(bt * c),
            dqkv: z(bt * 3 * c),
            dfch_gelu: z(bt * 4 * c),
            dfch: z(bt * 4 * c),
            dpre: z(b * nh * t * t),
        }
    }

    /// Total number of elements held.
    pub fn num_elements(&self) -> usize {
        [
            &self.dlogits,
            &self.dresidual,
            &self.dln,
            &self.datty,
            &self.dqkv,
            &self.dfch_gelu,
            &self.dfch,
        ]
        .iter()
        .map(|v| v.len())
        .sum::<usize>()
            + self.dpre.len()
    }
}

/// Layer `l`'s slab of a per-layer buffer whose slabs are `n` long.
pub(crate) fn slab<F>(buf: &[F], l: usize, n: usize) -> &[F] {
    &buf[l * n..(l + 1) * n]
}

/// Mutable layer `l`'s slab of a per-layer buffer whose slabs are `n` long.
pub(crate) fn slab_mut<F>(buf: &mut [F], l: usize, n: usize) -> &mut [F] {
    &mut buf[l * n..(l + 1) * n]
}
