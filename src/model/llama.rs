//! The Llama architecture's extra shape (`model.arch = "llama"`): grouped-query attention,
//! the SwiGLU width, rotary embeddings (theta, optional Llama 3 frequency scaling), the RMSNorm
//! epsilon and whether the head is tied to the embedding; and the Llama named sizes.
//!
//! A [`GptConfig`] with `llama: None` is GPT-2 and serializes exactly as before the Llama keys
//! existed (no `arch` key), so GPT-2 checkpoints and recordings are unchanged; a Llama one
//! serializes its keys flat beside the common ones (`arch = "llama"`, `n_kv_head`, ...), which is
//! also how a job file spells them under `[model]`.
//!
//! Invariants ([`LlamaConfig::validate`]): `n_head % n_kv_head == 0` (query head `h` reads KV head
//! `h / (n_head / n_kv_head)`), the head width is even (RoPE rotates pairs), `ffn_dim > 0`,
//! `rope_theta > 0`, `norm_eps > 0`, and the rope scaling factors are positive with
//! `low < high`.

use serde::{Deserialize, Serialize};

use super::GptConfig;
use crate::error::{Error, Result};

/// The tag `arch = "llama"` (the only value a [`LlamaConfig`] accepts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LlamaTag {
    /// `"llama"`.
    #[default]
    Llama,
}

/// Llama 3 rotary frequency scaling (transformers' `rope_type = "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeScaling {
    /// `rope_scaling_factor`.
    pub factor: f64,
    /// `rope_low_freq_factor`.
    pub low_freq_factor: f64,
    /// `rope_high_freq_factor`.
    pub high_freq_factor: f64,
    /// `rope_original_max_seq_len`.
    pub original_max_position: f64,
}

/// The shape a Llama model has beyond GPT-2's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Always `"llama"`.
    pub arch: LlamaTag,
    /// Key/value heads (grouped-query attention; `n_head` for plain multi-head attention).
    pub n_kv_head: usize,
    /// SwiGLU hidden width F.
    pub ffn_dim: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// Llama 3 scaling factor (absent: no scaling).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling_factor: Option<f64>,
    /// Llama 3 low-frequency factor (default 1 with a scaling factor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_low_freq_factor: Option<f64>,
    /// Llama 3 high-frequency factor (default 4 with a scaling factor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_high_freq_factor: Option<f64>,
    /// Context length the frequencies were trained for (default 8192 with a scaling factor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_original_max_seq_len: Option<usize>,
    /// RMSNorm epsilon.
    pub norm_eps: f64,
    /// The head reuses the embedding (`lm_head` = `embed_tokens`).
    pub tie_embeddings: bool,
}

// The floats are configuration values, never NaN after validation.
impl Eq for LlamaConfig {}

impl LlamaConfig {
    /// Defaults for `n_head` heads: multi-head attention, theta 10000, eps 1e-5, untied; `ffn_dim`
    /// as given.
    pub fn new(n_head: usize, ffn_dim: usize) -> Self {
        LlamaConfig {
            arch: LlamaTag::Llama,
            n_kv_head: n_head,
            ffn_dim,
            rope_theta: 10000.0,
            rope_scaling_factor: None,
            rope_low_freq_factor: None,
            rope_high_freq_factor: None,
            rope_original_max_seq_len: None,
            norm_eps: 1e-5,
            tie_embeddings: false,
        }
    }

    /// The Llama 3 frequency scaling, if a factor is set.
    pub fn rope_scaling(&self) -> Option<RopeScaling> {
        self.rope_scaling_factor.map(|factor| RopeScaling {
            factor,
            low_freq_factor: self.rope_low_freq_factor.unwrap_or(1.0),
            high_freq_factor: self.rope_high_freq_factor.unwrap_or(4.0),
            original_max_position: self.rope_original_max_seq_len.unwrap_or(8192) as f64,
        })
    }

    /// Checks the Llama keys against the common shape; errors name the key under `model.`.
    pub fn validate(&self, n_head: usize, n_embd: usize) -> Result<()> {
        if self.n_kv_head == 0 || n_head % self.n_kv_head != 0 {
            return Err(Error::config(
                "model.n_kv_head",
                format!("{} does not divide n_head {n_head}", self.n_kv_head),
            ));
        }
        if (n_embd / n_head) % 2 != 0 {
            return Err(Error::config(
                "model.n_head",
                format!("head width n_embd / n_head = {} must be even for rotary embeddings", n_embd / n_head),
            ));
        }
        if self.ffn_dim == 0 {
            return Err(Error::config("model.ffn_dim", "must be at least 1"));
        }
        for (key, v) in [("model.rope_theta", Some(self.rope_theta)), ("model.norm_eps", Some(self.norm_eps))]
            .into_iter()
            .chain([
                ("model.rope_scaling_factor", self.rope_scaling_factor),
                ("model.rope_low_freq_factor", self.rope_low_freq_factor),
                ("model.rope_high_freq_factor", self.rope_high_freq_factor),
            ])
        {
            if let Some(v) = v {
                if !(v.is_finite() && v > 0.0) {
                    return Err(Error::config(key, format!("{v} is not a positive number")));
                }
            }
        }
        let others = self.rope_low_freq_factor.is_some()
            || self.rope_high_freq_factor.is_some()
            || self.rope_original_max_seq_len.is_some();
        if others && self.rope_scaling_factor.is_none() {
            return Err(Error::config(
                "model.rope_scaling_factor",
                "missing: the other rope scaling keys need a scaling factor",
            ));
        }
        if let Some(s) = self.rope_scaling() {
            if s.low_freq_factor >= s.high_freq_factor || s.original_max_position < 1.0 {
                return Err(Error::config(
                    "model.rope_high_freq_factor",
                    format!(
                        "low {} must be below high {} and the original length positive",
                        s.low_freq_factor, s.high_freq_factor
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// The `[model]` keys of the architecture as written in a job file (all optional).
#[derive(Debug, Clone, Default)]
pub struct LlamaKeys {
    /// `arch`: `gpt2` or `llama`.
    pub arch: Option<String>,
    /// `n_kv_head`.
    pub n_kv_head: Option<usize>,
    /// `ffn_dim`.
    pub ffn_dim: Option<usize>,
    /// `rope_theta`.
    pub rope_theta: Option<f64>,
    /// `rope_scaling_factor`.
    pub rope_scaling_factor: Option<f64>,
    /// `rope_low_freq_factor`.
    pub rope_low_freq_factor: Option<f64>,
    /// `rope_high_freq_factor`.
    pub rope_high_freq_factor: Option<f64>,
    /// `rope_original_max_seq_len`.
    pub rope_original_max_seq_len: Option<usize>,
    /// `norm_eps`.
    pub norm_eps: Option<f64>,
    /// `tie_embeddings`.
    pub tie_embeddings: Option<bool>,
}

impl LlamaKeys {
    /// The Llama shape these keys give on top of the named size `base` (if any) with the
    /// explicit `n_head` / `n_embd` overrides; `None` for GPT-2. Errors name the key: an unknown
    /// arch, Llama keys with `arch = "gpt2"`, a Llama shape without `ffn_dim`.
    pub fn resolve(&self, base: Option<GptConfig>, n_head: Option<usize>, n_embd: Option<usize>) -> Result<Option<LlamaConfig>> {
        let base_llama = base.and_then(|b| b.llama);
        let llama = match self.arch.as_deref() {
            None => base_llama.is_some(),
            Some("llama") => true,
            Some("gpt2") => false,
            Some(other) => return Err(Error::config("model.arch", format!("unknown architecture `{other}` (known: gpt2, llama)"))),
        };
        let given = [
            ("model.n_kv_head", self.n_kv_head.is_some()),
            ("model.ffn_dim", self.ffn_dim.is_some()),
            ("model.rope_theta", self.rope_theta.is_some()),
            ("model.rope_scaling_factor", self.rope_scaling_factor.is_some()),
            ("model.rope_low_freq_factor", self.rope_low_freq_factor.is_some()),
            ("model.rope_high_freq_factor", self.rope_high_freq_factor.is_some()),
            ("model.rope_original_max_seq_len", self.rope_original_max_seq_len.is_some()),
            ("model.norm_eps", self.norm_eps.is_some()),
            ("model.tie_embeddings", self.tie_embeddings.is_some()),
        ];
        if !llama {
            return match given.iter().find(|g| g.1) {
                Some((key, _)) => Err(Error::config(*key, "is a Llama key: set model.arch = \"llama\" (the model is GPT-2)")),
                None => Ok(None),
            };
        }
        let n_head = n_head.or(base.map(|b| b.n_head)).unwrap_or(1);
        let ffn = match (self.ffn_dim, base_llama) {
            (Some(f), _) => f,
            (None, Some(b)) => b.ffn_dim,
            (None, None) => {
                let c = n_embd.or(base.map(|b| b.n_embd)).unwrap_or(0);
                return Err(Error::config("model.ffn_dim", format!("missing: a Llama model needs its SwiGLU width (n_embd is {c})")));
            }
        };
        let d = base_llama.unwrap_or_else(|| LlamaConfig::new(n_head, ffn));
        Ok(Some(LlamaConfig {
            arch: LlamaTag::Llama,
            n_kv_head: self.n_kv_head.unwrap_or(if base_llama.is_some() { d.n_kv_head } else { n_head }),
            ffn_dim: ffn,
            rope_theta: self.rope_theta.unwrap_or(d.rope_theta),
            rope_scaling_factor: self.rope_scaling_factor.or(d.rope_scaling_factor),
            rope_low_freq_factor: self.rope_low_freq_factor.or(d.rope_low_freq_factor),
            rope_high_freq_factor: self.rope_high_freq_factor.or(d.rope_high_freq_factor),
            rope_original_max_seq_len: self.rope_original_max_seq_len.or(d.rope_original_max_seq_len),
            norm_eps: self.norm_eps.unwrap_or(d.norm_eps),
            tie_embeddings: self.tie_embeddings.unwrap_or(d.tie_embeddings),
        }))
    }
}

/// Llama named sizes: `(name, L, NH, NKV, C, F, V, maxT)`. The 7b/13b/70b shapes are Llama 2's
/// published configurations (vocabulary 32000, context 4096).
/// A named Llama size: (name, L, NH, NKV, C, F, V, maxT).
type Named = (&'static str, usize, usize, usize, usize, usize, usize, usize);

const NAMED: &[Named] = &[
    ("llama-tiny", 2, 4, 2, 64, 176, 256, 64),
    ("llama-7b", 32, 32, 32, 4096, 11008, 32000, 4096),
    ("llama-13b", 40, 40, 40, 5120, 13824, 32000, 4096),
    ("llama-70b", 80, 64, 8, 8192, 28672, 32000, 4096),
];

/// The Llama named size `name`, if it is one.
pub(super) fn named(name: &str) -> Option<GptConfig> {
    NAMED.iter().find(|n| n.0 == name).map(|&(_, n_layer, n_head, nkv, n_embd, ffn, vocab_size, max_seq_len)| {
        GptConfig {
            n_layer,
            n_head,
            n_embd,
            vocab_size,
            max_seq_len,
            llama: Some(LlamaConfig { n_kv_head: nkv, ..LlamaConfig::new(n_head, ffn) }),
        }
    })
}

/// Names of the Llama sizes.
pub(super) fn names() -> impl Iterator<Item = &'static str> {
    NAMED.iter().map(|n| n.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_shapes() {
        let c = GptConfig::named("llama-70b").unwrap();
        let l = c.llama.unwrap();
        assert_eq!((c.n_layer, c.n_head, l.n_kv_head, c.n_embd, l.ffn_dim), (80, 64, 8, 8192, 28672));
        assert_eq!(c.head_dim(), 128);
        let c = GptConfig::named("llama-7b").unwrap();
        assert_eq!((c.n_layer, c.n_head, c.n_embd, c.llama.unwrap().ffn_dim, c.vocab_size), (32, 32, 4096, 11008, 32000));
        // Llama 2 7B has 6.74e9 parameters (untied head, no biases).
        let p = super::super::ParamLayout::new(&c).total_len();
        assert!((6_738_000_000..6_739_000_000).contains(&p), "{p}");
        // Model FLOPs count every matrix product's weights: all but the embedding and the norms.
        let norms = (2 * c.n_layer + 1) * c.n_embd;
        assert_eq!(crate::metrics::flop_params(&c) as usize, p - c.vocab_size * c.n_embd - norms);
    }

    #[test]
    fn errors_name_the_key() {
        let mut c = GptConfig::named("llama-tiny").unwrap();
        c.llama.as_mut().unwrap().n_kv_head = 3;
        assert!(c.validate().unwrap_err().to_string().contains("model.n_kv_head"));
        let mut c = GptConfig::named("llama-tiny").unwrap();
        c.n_embd = 4 * 6 + 4; // head width 7
        c.n_head = 4;
        assert!(c.validate().unwrap_err().to_string().contains("even"));
        let mut c = GptConfig::named("llama-tiny").unwrap();
        c.llama.as_mut().unwrap().rope_high_freq_factor = Some(2.0);
        assert!(c.validate().unwrap_err().to_string().contains("model.rope_scaling_factor"));
    }

    #[test]
    fn gpt2_serializes_without_llama_keys_and_llama_round_trips() {
        let g = GptConfig::named("tiny").unwrap();
        let s = serde_json::to_string(&g).unwrap();
        assert!(!s.contains("arch"), "{s}");
        assert_eq!(serde_json::from_str::<GptConfig>(&s).unwrap(), g);
        let mut l = GptConfig::named("llama-tiny").unwrap();
        l.llama.as_mut().unwrap().rope_scaling_factor = Some(8.0);
        let s = serde_json::to_string(&l).unwrap();
        assert!(s.contains("\"arch\":\"llama\""), "{s}");
        assert_eq!(serde_json::from_str::<GptConfig>(&s).unwrap(), l);
    }
}
