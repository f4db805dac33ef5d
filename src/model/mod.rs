//! The GPT-2 and Llama models: configuration (`model.arch`, [`llama`]), named sizes, the layout
//! tables, the one executor and the single-rank reference (GPT-2; Llama's reference is the
//! transformers fixture, `llama_tests.rs`).
//!
//! A model is fully described by [`GptConfig`]; the vocabulary is padded to a multiple of 128
//! (`padded_vocab_size`) so that embedding rows and logits GEMMs are well shaped. Padded rows exist
//! in `wte` but never receive probability mass in the loss.
//!
//! Layout of the module: the flat-parameter table ([`layout`]) and its shard rules
//! ([`tp_layout`]), initialization ([`init`]), sampling ([`sample`]), the one executor
//! ([`DeviceGpt`], every layout on every device arm) and [`gpt::Gpt`], the single-rank reference
//! that tests compare the executor with. The layer kernels themselves (llm.c style, one file per
//! layer with `_forward`/`_backward` over slices) are the CPU arm's, in `device::cpu`; `Gpt`
//! composes them with the activation buffers of [`activations`]. Everything is generic over
//! [`Float`] (`f32` for training, `f64` for gradient checks).

pub mod activations;
mod device_acts;
pub mod device_gpt;
mod device_linear;
pub mod device_tp;
pub mod gpt;
pub mod init;
pub mod layout;
pub mod llama;
pub mod sample;
#[cfg(test)]
mod shard_tests;
#[cfg(test)]
mod recompute_tests;
#[cfg(test)]
mod llama_tests;
pub mod tp_layout;

pub use crate::device::cpu::Float;
pub use device_acts::{ActDims, Recompute};
pub use device_gpt::{DeviceGpt, ExecOptions, Precision, StageInput, StageOutput};
pub use device_tp::DeviceTp;
pub use gpt::Gpt;
pub use layout::{ParamEntry, ParamLayout, TpSplit};
pub use llama::{LlamaConfig, RopeScaling};
pub use tp_layout::{ShardEntry, ShardLayout, StageSpec};

use crate::error::{Error, Result};

/// Shape of a GPT-2 style model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GptConfig {
    /// Number of transformer blocks (L).
    pub n_layer: usize,
    /// Number of attention heads (NH).
    pub n_head: usize,
    /// Embedding width (C).
    pub n_embd: usize,
    /// Real vocabulary size (V).
    pub vocab_size: usize,
    /// Longest sequence the position embedding covers (maxT).
    pub max_seq_len: usize,
    /// `model.arch = "llama"`: the Llama shape (RMSNorm, SwiGLU, RoPE, grouped-query attention,
    /// no biases); `None` is GPT-2. Serialized flat beside the other keys, absent for GPT-2.
    #[serde(default, skip_serializing_if = "Option::is_none", flatten)]
    pub llama: Option<LlamaConfig>,
}

/// Named sizes: `(name, n_layer, n_head, n_embd)`; all use the GPT-2 vocabulary and maxT 1024
/// except `tiny` (tests and the demo) and the GPT-3-style shapes (maxT 2048).
const NAMED: &[(&str, usize, usize, usize, usize, usize)] = &[
    // name, L, NH, C, V, maxT
    ("tiny", 2, 4, 64, 256, 64),
    ("d12", 12, 12, 768, 50257, 1024),
    ("d24", 24, 16, 1024, 50257, 1024),
    ("d36", 36, 20, 1280, 50257, 1024),
    ("d48", 48, 25, 1600, 50257, 1024),
    ("22b", 48, 48, 6144, 50257, 2048),
    ("175b", 96, 96, 12288, 50257, 2048),
    ("1t", 128, 160, 25600, 50257, 2048),
];

impl GptConfig {
    /// The named size `name` (`tiny`, `d12`, `d24`, `d36`, `d48`, `22b`, `175b`, `1t`, and the
    /// Llama ones `llama-tiny`, `llama-7b`, `llama-13b`, `llama-70b`).
    pub fn named(name: &str) -> Result<Self> {
        let lower = name.to_ascii_lowercase();
        if let Some(c) = llama::named(&lower) {
            return Ok(c);
        }
        NAMED
            .iter()
            .find(|n| n.0 == lower)
            .map(
                |&(_, n_layer, n_head, n_embd, vocab_size, max_seq_len)| GptConfig {
                    n_layer,
                    n_head,
                    n_embd,
                    vocab_size,
                    max_seq_len,
                    llama: None,
                },
            )
            .ok_or_else(|| {
                let names = Self::size_names();
                Error::config(
                    "model.size",
                    format!("unknown size `{name}` (known: {})", names.join(", ")),
                )
            })
    }

    /// Names accepted by [`GptConfig::named`].
    pub fn size_names() -> Vec<&'static str> {
        NAMED.iter().map(|n| n.0).chain(llama::names()).collect()
    }

    /// The architecture's name: `gpt2` or `llama`.
    pub fn arch(&self) -> &'static str {
        if self.llama.is_some() { "llama" } else { "gpt2" }
    }

    /// Key/value heads (NKV): `n_kv_head` for Llama, `n_head` for GPT-2.
    pub fn n_kv_head(&self) -> usize {
        self.llama.map_or(self.n_head, |l| l.n_kv_head)
    }

    /// Hidden width of the MLP: `ffn_dim` (SwiGLU) for Llama, 4C (GELU) for GPT-2.
    pub fn ffn_dim(&self) -> usize {
        self.llama.map_or(4 * self.n_embd, |l| l.ffn_dim)
    }

    /// Vocabulary rounded up to a multiple of 128 (Vp).
    pub fn padded_vocab_size(&self) -> usize {
        self.vocab_size.div_ceil(128) * 128
    }

    /// Width of one attention head (C / NH).
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Why weights of shape `self` cannot load into a model of shape `want`: the architectures
    /// when they differ, else both shapes.
    pub fn mismatch(&self, want: &GptConfig) -> String {
        if self.arch() != want.arch() {
            return format!("the weights are a {} model, the job's model is {} (model.arch)", self.arch(), want.arch());
        }
        format!("model {self:?} differs from the job's {want:?}")
    }

    /// Checks that the shape is usable; errors name the offending key under `model.`.
    pub fn validate(&self) -> Result<()> {
        for (key, v) in [
            ("model.n_layer", self.n_layer),
            ("model.n_head", self.n_head),
            ("model.n_embd", self.n_embd),
            ("model.vocab_size", self.vocab_size),
            ("model.max_seq_len", self.max_seq_len),
        ] {
            if v == 0 {
                return Err(Error::config(key, "must be at least 1"));
            }
        }
        if self.n_embd % self.n_head != 0 {
            return Err(Error::config(
                "model.n_head",
                format!(
                    "n_embd {} is not divisible by n_head {}",
                    self.n_embd, self.n_head
                ),
            ));
        }
        match &self.llama {
            Some(l) => l.validate(self.n_head, self.n_embd),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_sizes_are_valid_and_padded() {
        for name in GptConfig::size_names() {
            let c = GptConfig::named(name).unwrap();
            c.validate().unwrap();
            assert_eq!(c.padded_vocab_size() % 128, 0);
            assert!(c.padded_vocab_size() >= c.vocab_size);
        }
        assert_eq!(GptConfig::named("d12").unwrap().padded_vocab_size(), 50304);
        assert!(GptConfig::named("d13").is_err());
    }

    #[test]
    fn rejects_heads_not_dividing_width() {
        let c = GptConfig {
            n_layer: 1,
            n_head: 5,
            n_embd: 64,
            vocab_size: 10,
            max_seq_len: 8,
            llama: None,
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("model.n_head"), "{e}");
    }
}
