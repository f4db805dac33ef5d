//! The device model's GPU pieces against the CPU arm of the same code, on a real GPU (ignored
//! elsewhere): the encoder, bias and fill kernels, the cuBLAS products in every transposition and
//! operand type, and one training step of `DeviceGpt` in fp32 and bf16. Run with
//!
//! `cargo test --release --test gpu_model -- --ignored gpu --test-threads=1 --nocapture`
//!
//! Inputs are random each run (seed printed; `MESHTRAIN_GPU_SEED` replays), outputs are poisoned
//! (NaN bytes) before each launch. Tolerances: kernels that add in the same order as the CPU are
//! compared bit for bit; sums in another order (GEMMs, atomics, tiled column sums) by relative L2
//! error <= 1e-5 (f32 unit roundoff 6e-8 times the growth of sums of a few thousand terms).

mod common;

use common::gpu::{open, rng};
use meshtrain::config::DeviceKind;
use half::{bf16, f16};
use meshtrain::device::gemm::{Gemm, GemmInput, Operand};
use meshtrain::device::ops::{EncoderBackward, EncoderForward};
use meshtrain::device::{ops, ops_vocab, Device, DeviceBuffer};
use meshtrain::model::{DeviceGpt, Gpt, GptConfig, Precision};
use rand::Rng;
use rand_chacha::ChaCha8Rng;


fn rand_f32(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.gen_range(-1.0f32..1.0)).collect()
}

/// The same bytes on the GPU and on the CPU device.
fn both(gpu: &Device, x: &[f32]) -> (DeviceBuffer, DeviceBuffer) {
    (gpu.upload(x).unwrap(), Device::Cpu.upload(x).unwrap())
}

fn poisoned(dev: &Device, floats: usize) -> DeviceBuffer {
    dev.upload(&vec![0xFFu8; floats * 4]).unwrap()
}

fn down(dev: &Device, buf: &DeviceBuffer, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    dev.copy_to_host(buf, &mut out).unwrap();
    out
}

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2)).sum();
    let den: f64 = want.iter().map(|&b| f64::from(b).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

fn encoder_bias_and_fill_match_the_cpu_arm(kind: DeviceKind) {
    let (g, cpu) = (open(kind), Device::Cpu);
    let mut r = rng("encoder_bias_fill");
    let (b, t, c, vp) = (3, 17, 96, 128);
    // Few distinct ids, so every token repeats (the scatter adds many rows into one row).
    let tokens: Vec<u32> = (0..b * t).map(|_| 5 * r.gen_range(0..8u32)).collect();
    let (wte, wpe, dout) = (rand_f32(&mut r, vp * c), rand_f32(&mut r, t * c), rand_f32(&mut r, b * t * c));
    let index = ops_vocab::token_index(&tokens);
    let (tok_g, tok_c) = (g.upload(&index).unwrap(), cpu.upload(&index).unwrap());
    let ((wte_g, wte_c), (wpe_g, wpe_c), (dout_g, dout_c)) = (both(&g, &wte), both(&g, &wpe), both(&g, &dout));
    let mut out_g = poisoned(&g, b * t * c);
    let mut out_c = cpu.alloc(b * t * c * 4).unwrap();
    ops::encoder_forward(&g, EncoderForward { out: &mut out_g, tokens: &tok_g, wte: &wte_g, wpe: &wpe_g }, b * t, t, c).unwrap();
    ops::encoder_forward(&cpu, EncoderForward { out: &mut out_c, tokens: &tok_c, wte: &wte_c, wpe: &wpe_c }, b * t, t, c).unwrap();
    assert_eq!(down(&g, &out_g, b * t * c), down(&cpu, &out_c, b * t * c), "encoder forward");
    // Backward accumulates into existing gradients.
    let (init_te, init_pe) = (rand_f32(&mut r, vp * c), rand_f32(&mut r, t * c));
    let ((mut dte_g, mut dte_c), (mut dpe_g, mut dpe_c)) = (both(&g, &init_te), both(&g, &init_pe));
    ops::encoder_backward(&g, EncoderBackward { dwte: &mut dte_g, dwpe: &mut dpe_g, dout: &dout_g, tokens: &tok_g }, b, t, c).unwrap();
    ops::encoder_backward(&cpu, EncoderBackward { dwte: &mut dte_c, dwpe: &mut dpe_c, dout: &dout_c, tokens: &tok_c }, b, t, c).unwrap();
    // The scatter adds each token's rows in row order on every arm (no atomics): the same bits.
    assert_eq!(down(&g, &dte_g, vp * c), down(&cpu, &dte_c, vp * c), "encoder backward wte");
    let d = rel_l2(&down(&g, &dpe_g, t * c), &down(&cpu, &dpe_c, t * c));
    assert!(d <= 1e-5, "encoder backward wpe: {d:e}");
    // Bias add is one addition per element: bit for bit.
    let (n, oc) = (b * t, 3 * c);
    let (x, bias) = (rand_f32(&mut r, n * oc), rand_f32(&mut r, oc));
    let ((mut x_g, mut x_c), (bias_g, bias_c)) = (both(&g, &x), both(&g, &bias));
    ops::bias_add(&g, &mut x_g, &bias_g, n, oc).unwrap();
    ops::bias_add(&cpu, &mut x_c, &bias_c, n, oc).unwrap();
    assert_eq!(down(&g, &x_g, n * oc), down(&cpu, &x_c, n * oc), "bias add");
    let (mut db_g, mut db_c) = both(&g, &bias);
    ops::bias_backward(&g, &mut db_g, &x_g, n, oc).unwrap();
    ops::bias_backward(&cpu, &mut db_c, &x_c, n, oc).unwrap();
    // Column sums in row-lane tiles (kernels/compat.h): another order than the CPU's.
    let d = rel_l2(&down(&g, &db_g, oc), &down(&cpu, &db_c, oc));
    assert!(d <= 1e-5, "bias backward: {d:e}");
    let mut z = poisoned(&g, 1000);
    ops::fill_zero(&g, &mut z, 1000).unwrap();
    assert!(down(&g, &z, 1000).iter().all(|&v| v == 0.0), "fill_zero");
}

fn gemm_matches_the_cpu_arm_in_every_transposition_and_type(kind: DeviceKind) {
    let (g, cpu) = (open(kind), Device::Cpu);
    let (gemm_g, gemm_c) = (Gemm::new(&g).unwrap(), Gemm::new(&cpu).unwrap());
    let mut r = rng("gemm");
    let (m, n, k) = (67, 129, 255);
    for dtype in [GemmInput::F32, GemmInput::Bf16, GemmInput::F16] {
        for (a_t, b_t) in [(false, false), (true, false), (false, true), (true, true)] {
            let (a, b, c0) = (rand_f32(&mut r, m * k), rand_f32(&mut r, k * n), rand_f32(&mut r, m * n));
            let up = |dev: &Device, x: &[f32]| match dtype {
                GemmInput::F32 => dev.upload(x).unwrap(),
                GemmInput::Bf16 => dev.upload(&x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()).unwrap(),
                GemmInput::F16 => dev.upload(&x.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>()).unwrap(),
            };
            let mut results = Vec::new();
            for (dev, gemm) in [(&g, &gemm_g), (&cpu, &gemm_c)] {
                let (ab, bb) = (up(dev, &a), up(dev, &b));
                let mut cb = dev.upload(&c0).unwrap();
                let (oa, ob) = (Operand { buf: &ab, dtype, transposed: a_t }, Operand { buf: &bb, dtype, transposed: b_t });
                gemm.matmul(dev, &mut cb, oa, ob, m, n, k, true).unwrap();
                results.push(down(dev, &cb, m * n));
            }
            let d = rel_l2(&results[0], &results[1]);
            assert!(d <= 1e-5, "{dtype:?} a_t={a_t} b_t={b_t}: relative L2 {d:e}");
        }
    }
}

fn device_model_matches_the_cpu_arm_in_fp32_and_bf16(kind: DeviceKind) {
    let cfg = GptConfig { n_layer: 2, n_head: 4, n_embd: 128, vocab_size: 500, max_seq_len: 64, llama: None };
    let (b, t) = (4, 64);
    let mut r = rng("device_model");
    let tokens: Vec<u32> = (0..b * t).map(|_| r.gen_range(0..cfg.vocab_size as u32)).collect();
    let targets: Vec<u32> = (0..b * t).map(|_| r.gen_range(0..cfg.vocab_size as u32)).collect();
    let params = Gpt::<f32>::new(cfg, b, t, r.gen()).unwrap().params().to_vec();
    for precision in [Precision::Fp32, Precision::Bf16] {
        let mut out = Vec::new();
        for dev in [open(kind), Device::Cpu] {
            let mut m = DeviceGpt::new(dev, cfg, b, t, params.clone(), precision).unwrap();
            let loss = m.forward(&tokens, &targets).unwrap();
            m.backward(true, &mut |_, _| {}).unwrap();
            out.push((loss, m.params_and_grads().1.to_vec()));
        }
        let ((lg, gg), (lc, gc)) = (&out[0], &out[1]);
        assert!((lg - lc).abs() <= 1e-5 * lc.abs(), "{precision:?}: loss {lg} vs CPU arm {lc}");
        // bf16: activations that differ by an ulp between the arms may round to neighbouring
        // bf16 values (2^-8 apart) before a product, so the bound is looser than f32's. Measured
        // on the emu arm (the GPU kernels' summation orders): 0.7e-3 to 1.3e-3 over 5 seeds
        // (fp32: 4e-7), hence 4e-3; a lost sum or a misplaced shard moves gradients by O(1).
        let tol = if precision == Precision::Fp32 { 1e-4 } else { 4e-3 };
        let d = rel_l2(gg, gc);
        eprintln!("{precision:?}: loss {lg} vs {lc}, gradient relative L2 {d:e}");
        assert!(d <= tol, "{precision:?}: gradients relative L2 {d:e}");
    }
}

/// `precision = "fp16"` with a loss scale of 1024: the same step on the device as on the CPU
/// arm. fp16 keeps 11 significant bits (neighbouring values 2^-11 apart, 8x closer than bf16), so
/// an activation one f32 ulp away rounds to a neighbouring fp16 value less often and moves less.
fn device_model_matches_the_cpu_arm_in_fp16(kind: DeviceKind) {
    let cfg = GptConfig { n_layer: 2, n_head: 4, n_embd: 128, vocab_size: 500, max_seq_len: 64, llama: None };
    let (b, t) = (4, 64);
    let mut r = rng("device_model_fp16");
    let tokens: Vec<u32> = (0..b * t).map(|_| r.gen_range(0..cfg.vocab_size as u32)).collect();
    let targets: Vec<u32> = (0..b * t).map(|_| r.gen_range(0..cfg.vocab_size as u32)).collect();
    let params = Gpt::<f32>::new(cfg, b, t, r.gen()).unwrap().params().to_vec();
    let mut out = Vec::new();
    for dev in [open(kind), Device::Cpu] {
        let mut m = DeviceGpt::new(dev, cfg, b, t, params.clone(), Precision::Fp16).unwrap();
        m.set_loss_scale(1024.0);
        let loss = m.forward(&tokens, &targets).unwrap();
        m.backward(true, &mut |_, _| {}).unwrap();
        out.push((loss, m.params_and_grads().1.to_vec()));
    }
    let ((lg, gg), (lc, gc)) = (&out[0], &out[1]);
    assert!((lg - lc).abs() <= 1e-5 * lc.abs(), "fp16: loss {lg} vs CPU arm {lc}");
    assert!(gc.iter().all(|g| g.is_finite()) && gc.iter().any(|&g| g.abs() > 1.0), "fp16: the gradients carry the scale");
    let d = rel_l2(gg, gc);
    eprintln!("fp16: loss {lg} vs {lc}, gradient relative L2 {d:e}");
    assert!(d <= 1e-3, "fp16: gradients relative L2 {d:e}");
}

crate::gpu_and_emu_tests!(
    encoder_bias_and_fill_match_the_cpu_arm,
    gemm_matches_the_cpu_arm_in_every_transposition_and_type,
    device_model_matches_the_cpu_arm_in_fp32_and_bf16,
    device_model_matches_the_cpu_arm_in_fp16,
);
