//! Finite-difference check of every parameter tensor's gradient, in f64, on a tiny GPT-2.
//!
//! Also: gradient accumulation (backward adds), zero_grad, and bitwise determinism of training.

use meshtrain::model::{Gpt, GptConfig};
use meshtrain::optim::{AdamW, AdamWConfig, AdamWState, DecayMask};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const B: usize = 2;
const T: usize = 5;

fn tiny() -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        vocab_size: 20,
        max_seq_len: T,
        llama: None,
    }
}

/// Batch of tokens/targets in the real vocabulary, from a fixed seed.
fn batch(seed: u64) -> (Vec<u32>, Vec<u32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let v = tiny().vocab_size as u32;
    let toks = (0..B * T).map(|_| rng.gen_range(0..v)).collect();
    let tgts = (0..B * T).map(|_| rng.gen_range(0..v)).collect();
    (toks, tgts)
}

/// The GPT-2 init with every parameter perturbed, so biases and LayerNorm parameters are not
/// at their special initial values (0 and 1) where some gradient paths vanish.
fn perturbed_model() -> Gpt<f64> {
    let mut m = Gpt::<f64>::new(tiny(), B, T, 3).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let v_rows = tiny().vocab_size * tiny().n_embd;
    let wte_end = m.layout().wte().end;
    for (i, p) in m.params_mut().iter_mut().enumerate() {
        // Padded wte rows stay 0 as in real training.
        if !(v_rows..wte_end).contains(&i) {
            *p += 0.2 * (rng.gen::<f64>() - 0.5);
        }
    }
    m
}

#[test]
fn every_parameter_tensor_matches_central_differences() {
    let (tokens, targets) = batch(1);
    let mut m = perturbed_model();
    m.zero_grad();
    m.forward(&tokens, &targets).unwrap();
    m.backward().unwrap();
    let analytic = m.grads().to_vec();
    let entries = m.layout().entries().to_vec();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    // Central differences with h = 1e-5 in f64: truncation error ~h²·|f'''| ~ 1e-10 and
    // round-off ~ eps·|loss|/h ~ 1e-16·3/1e-5 ~ 3e-11. A tolerance of 1e-7 absolute plus 1e-5
    // relative is ~100x above both, yet any wrong term in a backward formula (which changes the
    // gradient by O(its size)) is caught.
    let h = 1e-5;
    let mut checked = 0;
    for e in &entries {
        let mut idx: Vec<usize> = vec![e.offset, e.offset + e.len - 1];
        idx.extend((0..6).map(|_| e.offset + rng.gen_range(0..e.len)));
        if e.name == "wte" {
            // Rows of tokens in the batch carry both the embedding and the logits gradient.
            let c = tiny().n_embd;
            idx.push(tokens[0] as usize * c + 3);
        }
        for i in idx {
            let orig = m.params()[i];
            m.params_mut()[i] = orig + h;
            let lp = m.forward(&tokens, &targets).unwrap();
            m.params_mut()[i] = orig - h;
            let lm = m.forward(&tokens, &targets).unwrap();
            m.params_mut()[i] = orig;
            let numeric = (lp - lm) / (2.0 * h);
            let a = analytic[i];
            assert!(
                (numeric - a).abs() <= 1e-7 + 1e-5 * a.abs(),
                "{} [{}]: analytic {a:e} vs numeric {numeric:e}",
                e.name,
                i - e.offset
            );
            checked += 1;
        }
    }
    assert!(checked >= entries.len() * 8);
}

#[test]
fn backward_accumulates_and_zero_grad_clears() {
    let (tokens, targets) = batch(2);
    let mut m = perturbed_model();
    m.forward(&tokens, &targets).unwrap();
    m.backward().unwrap();
    let once = m.grads().to_vec();
    assert!(
        m.backward().is_err(),
        "a second backward without forward must be refused"
    );
    m.forward(&tokens, &targets).unwrap();
    m.backward().unwrap();
    // Twice the gradient, up to summation order: bias and LayerNorm gradients add row by row
    // onto the first pass's sums, so a few ulps (~1e-15 relative in f64) may differ. The key
    // bias gradient is exactly 0 in exact arithmetic (softmax ignores a shift shared by all
    // scores), so its computed value is pure rounding noise (~1e-20): hence the 1e-17 floor.
    for (i, (g2, g1)) in m.grads().iter().zip(&once).enumerate() {
        assert!(
            (g2 - 2.0 * g1).abs() <= 1e-13 * g1.abs() + 1e-17,
            "[{i}]: {g2:e} vs 2 x {g1:e}"
        );
    }
    m.zero_grad();
    assert!(m.grads().iter().all(|&g| g == 0.0));
}

#[test]
fn bad_batches_are_rejected() {
    let mut m = Gpt::<f32>::new(tiny(), B, T, 1).unwrap();
    let (tokens, mut targets) = batch(3);
    assert!(m.forward(&tokens[1..], &targets).is_err());
    targets[4] = 20;
    let e = m.forward(&tokens, &targets).unwrap_err().to_string();
    assert!(e.contains("targets[4] = 20"), "{e}");
    assert!(Gpt::<f32>::new(tiny(), B, T + 1, 1).is_err());
}

/// Three f32 training steps; returns the losses.
fn train_three_steps(seed: u64) -> Vec<f32> {
    let (tokens, targets) = batch(9);
    let mut m = Gpt::<f32>::new(tiny(), B, T, seed).unwrap();
    let opt = AdamW::new(AdamWConfig::default(), DecayMask::from_layout(m.layout()));
    let mut state = AdamWState::new(0, m.layout().total_len());
    let mut losses = Vec::new();
    for _ in 0..3 {
        m.zero_grad();
        losses.push(m.forward(&tokens, &targets).unwrap());
        m.backward().unwrap();
        let (p, g) = m.params_and_grads();
        opt.step(&mut state, 1e-2, p, g).unwrap();
    }
    losses
}

#[test]
fn training_is_bitwise_deterministic() {
    let a = train_three_steps(11);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a), bits(&train_three_steps(11)));
    assert_ne!(a, train_three_steps(12));
    assert!(
        a[2] < a[0],
        "three AdamW steps on one batch must lower its loss: {a:?}"
    );
}
