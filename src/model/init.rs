//! Deterministic GPT-2 initialization from a seed.
//!
//! Weights ~ normal(0, 0.02); for GPT-2 the two residual output projections (`attn.proj.weight`,
//! `mlp.proj.weight`) are scaled by 1/sqrt(2L) so the residual stream's variance does not grow
//! with depth; biases 0; LayerNorm weights 1. Padded vocabulary rows of `wte` are 0 (they never
//! receive gradient, so they stay 0), and so are those of Llama's untied `lm_head`; Llama's RMSNorm
//! weights are 1 and its projections are not scaled. The draw order is the buffer order, from one ChaCha8
//! stream, so the same seed gives bitwise the same parameters on every machine.
//!
//! The stream is seekable: the k-th normal draw uses words 4k..4k+4 of the ChaCha8 stream (two
//! u64 uniforms), so [`Initializer::fill`] computes any range of the flat buffer without drawing
//! what comes before it. A tensor-parallel shard, a pipeline stage or a ZeRO-3 shard initialises
//! only its own elements, bit for bit what the whole-model initialisation gives them.

use std::ops::Range;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::layout::ParamLayout;
use super::GptConfig;
use crate::device::cpu::float::Float;

/// Standard deviation of the normal initialization.
const INIT_STD: f64 = 0.02;
/// ChaCha8 words (u32) one normal draw consumes: two u64 uniforms.
const WORDS_PER_DRAW: u128 = 4;

/// One standard normal draw (Box–Muller on two uniforms in (0, 1]).
fn standard_normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1 = 1.0 - rng.gen::<f64>();
    let u2 = rng.gen::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// How one tensor of the layout starts.
#[derive(Debug, Clone)]
enum Start {
    /// Every element the same value (LayerNorm weights 1, biases 0).
    Constant(f64),
    /// The first `drawn` elements normal(0, std), from draw number `first_draw` on; the rest 0.
    Normal { std: f64, drawn: usize, first_draw: u64 },
}

/// The initial value of every element of a model's flat parameter buffer, for one seed.
#[derive(Debug, Clone)]
pub struct Initializer {
    seed: u64,
    /// (flat range, start) per layout entry, in buffer order.
    tensors: Vec<(Range<usize>, Start)>,
}

impl Initializer {
    /// The initialisation of `config`'s layout `layout` from `seed`.
    pub fn new(config: &GptConfig, layout: &ParamLayout, seed: u64) -> Self {
        let residual_std = INIT_STD / ((2 * config.n_layer) as f64).sqrt();
        let mut draws = 0u64;
        let tensors = layout
            .entries()
            .iter()
            .map(|e| {
                let start = if e.shape.len() == 1 {
                    Start::Constant(if e.name.ends_with(".weight") { 1.0 } else { 0.0 })
                } else {
                    // Llama: every weight normal(0, 0.02), as transformers initialises it.
                    let residual = config.llama.is_none() && (e.name.ends_with("attn.proj.weight") || e.name.ends_with("mlp.proj.weight"));
                    let std = if residual { residual_std } else { INIT_STD };
                    // Only the real vocabulary rows of wte are drawn; padded rows stay 0.
                    let head = e.name == "wte" || e.name == "lm_head.weight";
                    let drawn = if head { config.vocab_size * config.n_embd } else { e.len };
                    let first_draw = draws;
                    draws += drawn as u64;
                    Start::Normal { std, drawn, first_draw }
                };
                (e.range(), start)
            })
            .collect();
        Initializer { seed, tensors }
    }

    /// Elements of the whole flat buffer.
    pub fn len(&self) -> usize {
        self.tensors.last().map_or(0, |(r, _)| r.end)
    }

    /// True for a model without parameters.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// out = the initial values of the flat elements `global` (`out.len() == global.len()`).
    pub fn fill<F: Float>(&self, global: Range<usize>, out: &mut [F]) {
        assert_eq!(global.len(), out.len(), "Initializer::fill: range and output differ in length");
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        for (range, start) in &self.tensors {
            let (lo, hi) = (range.start.max(global.start), range.end.min(global.end));
            if lo >= hi {
                continue;
            }
            let dst = &mut out[lo - global.start..hi - global.start];
            match *start {
                Start::Constant(v) => dst.iter_mut().for_each(|x| *x = F::from_f64(v)),
                Start::Normal { std, drawn, first_draw } => {
                    let (a, b) = (lo - range.start, hi - range.start);
                    let drawn_end = b.min(drawn).max(a);
                    if a < drawn_end {
                        rng.set_word_pos(u128::from(first_draw + a as u64) * WORDS_PER_DRAW);
                        for x in &mut dst[..drawn_end - a] {
                            *x = F::from_f64(std * standard_normal(&mut rng));
                        }
                    }
                    dst[drawn_end - a..].iter_mut().for_each(|x| *x = F::zero());
                }
            }
        }
    }
}

/// The flat parameter buffer of `config`, initialized from `seed`.
pub fn init_params<F: Float>(config: &GptConfig, layout: &ParamLayout, seed: u64) -> Vec<F> {
    let init = Initializer::new(config, layout, seed);
    let mut params = vec![F::zero(); layout.total_len()];
    init.fill(0..params.len(), &mut params);
    params
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_statistics_and_determinism() {
        let config = GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 64,
            vocab_size: 100,
            max_seq_len: 16,
            llama: None,
        };
        let layout = ParamLayout::new(&config);
        let p: Vec<f64> = init_params(&config, &layout, 7);
        assert_eq!(p, init_params::<f64>(&config, &layout, 7));
        assert_ne!(p, init_params::<f64>(&config, &layout, 8));
        let stats = |name: &str| {
            let x = &p[layout.get(name).unwrap().range()];
            let mean = x.iter().sum::<f64>() / x.len() as f64;
            (
                mean,
                (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64).sqrt(),
            )
        };
        // 12288 samples: the sample std is within 3% of the true std with overwhelming odds.
        let (_, s) = stats("h.0.mlp.fc.weight");
        assert!((s - 0.02).abs() < 0.02 * 0.03, "{s}");
        let (_, s) = stats("h.1.mlp.proj.weight");
        assert!((s - 0.01).abs() < 0.01 * 0.03, "{s}");
        assert_eq!(stats("h.0.ln1.weight"), (1.0, 1.0));
        assert_eq!(stats("h.0.attn.qkv.bias"), (0.0, 0.0));
        let wte = &p[layout.wte()];
        assert!(wte[100 * 64..].iter().all(|&x| x == 0.0));
    }

    /// The sequential stream the initialisation was first defined by: every draw in buffer order.
    fn sequential(config: &GptConfig, layout: &ParamLayout, seed: u64) -> Vec<f64> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let residual_std = INIT_STD / ((2 * config.n_layer) as f64).sqrt();
        let mut params = vec![0.0; layout.total_len()];
        for e in layout.entries() {
            let dst = &mut params[e.range()];
            if e.shape.len() == 1 {
                dst.fill(if e.name.ends_with(".weight") { 1.0 } else { 0.0 });
                continue;
            }
            let residual = e.name.ends_with("attn.proj.weight") || e.name.ends_with("mlp.proj.weight");
            let std = if residual { residual_std } else { INIT_STD };
            let drawn = if e.name == "wte" { config.vocab_size * config.n_embd } else { e.len };
            for x in &mut dst[..drawn] {
                *x = std * standard_normal(&mut rng);
            }
        }
        params
    }

    #[test]
    fn any_range_is_bitwise_the_sequential_stream() {
        let config = GptConfig { n_layer: 2, n_head: 2, n_embd: 16, vocab_size: 50, max_seq_len: 8, llama: None };
        let layout = ParamLayout::new(&config);
        let want = sequential(&config, &layout, 11);
        let init = Initializer::new(&config, &layout, 11);
        assert_eq!(init_params::<f64>(&config, &layout, 11), want);
        let n = want.len();
        // Ranges that start and end inside tensors, inside wte's padded rows, across several
        // tensors, single elements, and empty.
        let wte = layout.wte();
        let cuts = [(0, 1), (3, 700), (wte.start + 799, wte.start + 900), (n / 3, n / 2), (n - 1, n), (5, 5), (0, n)];
        for (a, b) in cuts {
            let mut got = vec![f64::NAN; b - a];
            init.fill(a..b, &mut got);
            assert_eq!(got, want[a..b], "range {a}..{b}");
        }
    }
}
