//! The device model (`DeviceGpt`: device ops + BLAS products) against the CPU reference `Gpt`,
//! run on the CPU device arm, so the orchestration of every kernel-backed op, the gradient flow
//! and the bf16 mixed-precision numerics are checked on any machine (the GPU arms differ only in
//! the kernels, which tests/gpu_kernels.rs checks one by one on a GPU).

use meshtrain::device::Device;
use meshtrain::model::{DeviceGpt, Gpt, GptConfig, Precision};
use meshtrain::optim::{AdamW, AdamWConfig, AdamWState, DecayMask};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const B: usize = 2;
const T: usize = 16;

fn small() -> GptConfig {
    GptConfig { n_layer: 2, n_head: 4, n_embd: 64, vocab_size: 100, max_seq_len: T, llama: None }
}

fn batch(seed: u64) -> (Vec<u32>, Vec<u32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let v = small().vocab_size as u32;
    let mut ids = || (0..B * T).map(|_| rng.gen_range(0..v)).collect::<Vec<u32>>();
    (ids(), ids())
}

/// Relative L2 distance of `got` from `want`.
fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2)).sum();
    let den: f64 = want.iter().map(|&b| f64::from(b).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

fn models(precision: Precision) -> (Gpt<f32>, DeviceGpt) {
    let reference = Gpt::<f32>::new(small(), B, T, 7).unwrap();
    let params = reference.params().to_vec();
    let device = DeviceGpt::new(Device::Cpu, small(), B, T, params, precision).unwrap();
    (reference, device)
}

/// Loss and per-tensor gradient distance after one forward/backward of the same batch.
fn one_step(precision: Precision) -> (f64, f64, Vec<(String, f64)>) {
    let (mut reference, mut device) = models(precision);
    let (tokens, targets) = batch(1);
    let want = f64::from(reference.forward(&tokens, &targets).unwrap());
    reference.backward().unwrap();
    let got = device.forward(&tokens, &targets).unwrap();
    let mut reported = 0;
    device.backward(true, &mut |r, _| reported += r.len()).unwrap();
    assert_eq!(reported, reference.grads().len(), "the whole gradient is reported once");
    let grads = device.params_and_grads().1.to_vec();
    let per_tensor = reference
        .layout()
        .entries()
        .iter()
        .map(|e| (e.name.clone(), rel_l2(&grads[e.range()], &reference.grads()[e.range()])))
        .collect();
    (want, got, per_tensor)
}

#[test]
fn fp32_device_model_matches_the_reference() {
    let (want, got, per_tensor) = one_step(Precision::Fp32);
    // Same operations in the same order on the CPU arm: only the f64 mean of the losses may
    // round differently.
    assert!((got - want).abs() <= 1e-6 * want.abs(), "loss {got} vs {want}");
    for (name, d) in per_tensor {
        assert!(d <= 1e-6, "{name}: relative L2 {d:e}");
    }
}

/// `precision = "fp16"` with a loss scale of 4096: the gradients come out 4096 times the
/// reference's, within fp16's rounding of the products' inputs (relative 2^-12 per element, 8
/// times finer than bf16's, so the bound is 8 times tighter); unscaled they would lose the
/// smallest components to fp16's subnormal range.
#[test]
fn fp16_device_model_with_a_loss_scale_is_within_fp16_rounding_of_the_reference() {
    let (mut reference, mut device) = models(Precision::Fp16);
    let scale = 4096.0f32;
    device.set_loss_scale(f64::from(scale));
    let (tokens, targets) = batch(1);
    let want = f64::from(reference.forward(&tokens, &targets).unwrap());
    reference.backward().unwrap();
    let got = device.forward(&tokens, &targets).unwrap();
    device.backward(true, &mut |_, _| {}).unwrap();
    assert!((got - want).abs() <= 1.25e-4 * want.abs(), "loss {got} vs {want}");
    let grads: Vec<f32> = device.params_and_grads().1.iter().map(|g| g / scale).collect();
    let mut worst = (String::new(), 0.0);
    for e in reference.layout().entries() {
        let d = rel_l2(&grads[e.range()], &reference.grads()[e.range()]);
        assert!(d <= 2.5e-3, "{}: relative L2 {d:e}", e.name);
        if d > worst.1 {
            worst = (e.name.clone(), d);
        }
    }
    eprintln!("fp16: loss {got} vs {want}; worst tensor {} at {:.2e}", worst.0, worst.1);
    // fp16 rounding leaves a trace: not an fp32 run.
    assert!(worst.1 > 1e-6, "fp16 left no trace on the gradients");
}

#[test]
fn bf16_device_model_is_within_bf16_rounding_of_the_reference() {
    let (want, got, per_tensor) = one_step(Precision::Bf16);
    // Each GEMM input is rounded to 8 significant bits (relative error <= 2^-9 ~ 2e-3); the loss
    // averages many such products, so its relative error stays at that order; gradients pass
    // through up to 2 GEMMs per layer on the way back, each adding ~2^-9 relative error in
    // quadrature over the elements: a few 1e-3, bounded here by 2e-2 per tensor. A wrong
    // gradient path (a missed term, a wrong transpose) moves a tensor by O(1).
    assert!((got - want).abs() <= 1e-3 * want.abs(), "loss {got} vs {want}");
    let worst = per_tensor.iter().cloned().fold(("".to_string(), 0.0), |a, b| if b.1 > a.1 { b } else { a });
    eprintln!("bf16: loss {got} vs {want}; worst tensor {} at {:.2e}", worst.0, worst.1);
    assert!(worst.1 <= 2e-2, "worst tensor {}: relative L2 {:e} ({per_tensor:?})", worst.0, worst.1);
    // And the rounding is really there (a bf16 path that silently ran in f32 would be exact).
    assert!(per_tensor.iter().any(|(_, d)| *d > 1e-6), "bf16 products left no trace: {per_tensor:?}");
}

#[test]
fn training_steps_track_the_reference_and_accumulate() {
    let cfg = AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() };
    for precision in [Precision::Fp32, Precision::Bf16] {
        let (mut reference, mut device) = models(precision);
        let n = reference.params().len();
        let opt = AdamW::new(cfg, DecayMask::from_layout(reference.layout()));
        let (mut ref_state, mut dev_state) = (AdamWState::new(0, n), AdamWState::new(0, n));
        let (mut ref_losses, mut dev_losses) = (Vec::new(), Vec::new());
        for _ in 0..6 {
            // Two micro-batches per step (the same two every step, so the loss must fall): the
            // device gradients accumulate until reported.
            reference.zero_grad();
            device.zero_grad().unwrap();
            let (mut lr_sum, mut ld_sum) = (0.0, 0.0);
            for micro in 0..2 {
                let (tokens, targets) = batch(100 + micro);
                lr_sum += f64::from(reference.forward(&tokens, &targets).unwrap());
                reference.backward().unwrap();
                ld_sum += device.forward(&tokens, &targets).unwrap();
                device.backward(micro == 1, &mut |_, _| {}).unwrap();
            }
            ref_losses.push(lr_sum / 2.0);
            dev_losses.push(ld_sum / 2.0);
            let (p, g) = reference.params_and_grads();
            opt.step(&mut ref_state, 1e-2, p, g).unwrap();
            let (p, g) = device.params_and_grads();
            opt.step(&mut dev_state, 1e-2, p, g).unwrap();
        }
        // f32: identical arithmetic; bf16: the per-step rounding above, compounded over 6 AdamW
        // steps whose updates are normalized (|update| ~ lr), so losses stay within ~1%.
        let tol = if precision == Precision::Fp32 { 1e-5 } else { 1e-2 };
        eprintln!("{precision:?}: device {dev_losses:?} reference {ref_losses:?}");
        for (s, (d, r)) in dev_losses.iter().zip(&ref_losses).enumerate() {
            assert!((d - r).abs() <= tol * r.abs(), "{precision:?} step {s}: {d} vs {r}");
        }
        assert!(ref_losses[5] < ref_losses[0] - 0.1, "training makes progress: {ref_losses:?}");
    }
}

#[test]
fn bad_batches_are_rejected_before_any_device_work() {
    let (_, mut device) = models(Precision::Fp32);
    let (mut tokens, targets) = batch(3);
    tokens[5] = 1000;
    let err = device.forward(&tokens, &targets).unwrap_err().to_string();
    assert!(err.contains("tokens[5] = 1000"), "{err}");
    let err = device.backward(true, &mut |_, _| {}).unwrap_err().to_string();
    assert!(err.contains("without a forward"), "{err}");
}
