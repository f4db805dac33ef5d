//! Autoregressive sampling from a trained model (`meshtrain generate`).
//!
//! The model runs at its fixed (1, T): the context (the last T tokens at most) fills the first
//! positions and the rest is padding, which causal attention keeps from influencing the position
//! whose logits are read. Sampling is temperature-scaled softmax over the `top_k` most likely real
//! tokens (padded vocabulary columns never count), seeded, so the same seed gives the same text;
//! temperature 0 is greedy decoding.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::gpt::Gpt;
use crate::error::{Error, Result};

/// How to sample.
#[derive(Debug, Clone)]
pub struct SampleOptions {
    /// Tokens to generate after the prompt.
    pub max_new_tokens: usize,
    /// Softmax temperature; 0 picks the most likely token.
    pub temperature: f32,
    /// Sample among the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// RNG seed.
    pub seed: u64,
}

/// Index of the next token given `logits` over the real vocabulary.
fn pick(logits: &[f32], opts: &SampleOptions, rng: &mut ChaCha8Rng) -> u32 {
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    if opts.temperature <= 0.0 {
        return order[0];
    }
    let k = if opts.top_k == 0 { order.len() } else { opts.top_k.min(order.len()) };
    let top = &order[..k];
    let max = logits[top[0] as usize];
    let weights: Vec<f64> = top.iter().map(|&i| f64::from((logits[i as usize] - max) / opts.temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.gen::<f64>() * total;
    for (w, &tok) in weights.iter().zip(top) {
        if u < *w {
            return tok;
        }
        u -= w;
    }
    top[k - 1]
}

/// Continues `prompt` by `opts.max_new_tokens` tokens; returns only the new tokens. `model` must
/// have been built for a batch of one sequence.
pub fn generate(model: &mut Gpt<f32>, prompt: &[u32], opts: &SampleOptions) -> Result<Vec<u32>> {
    if model.batch() != 1 {
        return Err(Error::InvalidArgument(format!("generate: model built for batch {}, need 1", model.batch())));
    }
    if prompt.is_empty() {
        return Err(Error::InvalidArgument("generate: empty prompt".into()));
    }
    let (t, v, vp) = (model.seq_len(), model.config().vocab_size, model.config().padded_vocab_size());
    if let Some(&bad) = prompt.iter().find(|&&tok| tok as usize >= v) {
        return Err(Error::InvalidArgument(format!("generate: prompt token {bad} >= vocabulary size {v}")));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    let mut context: Vec<u32> = prompt.to_vec();
    let mut out = Vec::with_capacity(opts.max_new_tokens);
    let mut tokens = vec![0u32; t]; // (1, T)
    let targets = vec![0u32; t]; // (1, T), unused
    for _ in 0..opts.max_new_tokens {
        let window = &context[context.len().saturating_sub(t)..];
        tokens[..window.len()].copy_from_slice(window);
        tokens[window.len()..].iter_mut().for_each(|x| *x = 0);
        model.forward(&tokens, &targets)?;
        let row = &model.logits()[(window.len() - 1) * vp..(window.len() - 1) * vp + v]; // (V)
        let next = pick(row, opts, &mut rng);
        context.push(next);
        out.push(next);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_top_k_pick_from_the_right_set() {
        let logits = [0.5f32, 3.0, -1.0, 2.9, 0.0];
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let greedy = SampleOptions { max_new_tokens: 1, temperature: 0.0, top_k: 0, seed: 0 };
        assert_eq!(pick(&logits, &greedy, &mut rng), 1);
        let top2 = SampleOptions { temperature: 1.0, top_k: 2, ..greedy };
        let mut seen = [0usize; 5];
        for _ in 0..400 {
            seen[pick(&logits, &top2, &mut rng) as usize] += 1;
        }
        assert_eq!(seen[0] + seen[2] + seen[4], 0, "{seen:?}");
        // exp(0.1) ~ 1.105: the two candidates are drawn about equally often.
        assert!(seen[1] > 150 && seen[3] > 150, "{seen:?}");
    }
}
