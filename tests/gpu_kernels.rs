//! Every GPU kernel against the CPU reference, on a real GPU (ignored elsewhere). Run on a
//! machine with an NVIDIA GPU, driver and NVRTC with:
//!
//! `cargo test --release --test gpu_kernels -- --ignored gpu --test-threads=1 --nocapture`
//!
//! Inputs are fresh random draws each run (the seed is printed so a failure can be replayed
//! with `MESHTRAIN_GPU_SEED`), never zeros; outputs are poisoned with NaN bytes before each
//! launch so that an unwritten element fails. Float kernels are compared with the CPU layers
//! run in f64 on the same (f32) inputs by relative L2 error, `|got - ref| / |ref|`: f32
//! arithmetic with sums of at most a few thousand terms lands below 1e-5 (unit roundoff 6e-8
//! times sqrt(terms) growth, plus a few ulps from exp/log/sqrt), so 1e-5 is the bound. The
//! collective reductions, casts and residual add are single IEEE operations per element and must
//! match the CPU bit for bit.

mod common;

use common::gpu::{open, rng};
use half::{bf16, f16};
use meshtrain::comm::{DType, ReduceOp};
use meshtrain::config::DeviceKind;
use meshtrain::device::cpu::adamw::AdamWStep;
use meshtrain::device::cpu::attention::{
    attention_backward, attention_forward, AttnShape,
};
use meshtrain::device::cpu::rmsnorm::{rmsnorm_backward, rmsnorm_forward};
use meshtrain::device::cpu::rope::{self as cpu_rope, RopeShape};
use meshtrain::device::cpu::swiglu::{swiglu_backward, swiglu_forward};
use meshtrain::device::cpu::cross_entropy::{cross_entropy_backward, cross_entropy_forward};
use meshtrain::device::cpu::gelu::{gelu_backward, gelu_forward};
use meshtrain::device::cpu::layernorm::{layernorm_backward, layernorm_forward};
use meshtrain::device::cpu::vocab_parallel as vp;
use meshtrain::device::gemm::{Batch, Gemm, GemmInput, Operand};
use meshtrain::device::ops::{self, AdamWBuffers, CrossEntropyForward, LayerNormBackward, LayerNormForward};
use meshtrain::device::ops_attention::{self, AttentionBackward, AttnWork};
use meshtrain::device::ops_llama::{self, rope_table, Llama3Scaling, RmsNormBackward, RmsNormForward};
use meshtrain::device::ops_vocab::{self, CrossEntropyBackward, VocabShard};
use meshtrain::device::reduce_bench::reduce_bandwidth;
use meshtrain::device::{Device, DeviceBuffer};
use meshtrain::dtype::Reducer;
use meshtrain::model::{GptConfig, ParamLayout};
use meshtrain::optim::optimizer::{AdamW, AdamWConfig, AdamWState, DecayMask};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

const TOL: f64 = 1e-5;


/// Uniform in [-scale, scale), never exactly zero in practice.
fn rand_f32(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| r.gen_range(-scale..scale)).collect()
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// A buffer of `bytes` bytes, every byte 0xFF (NaN for every float type).
fn poisoned(dev: &Device, bytes: usize) -> DeviceBuffer {
    dev.upload(&vec![0xFFu8; bytes]).unwrap()
}

fn down_f32(dev: &Device, buf: &DeviceBuffer, n: usize) -> Vec<f32> {
    dev.synchronize().unwrap();
    let mut v = vec![0f32; n];
    dev.copy_to_host(buf, &mut v).unwrap();
    v
}

/// Asserts every element is finite and the relative L2 error is within [`TOL`].
fn assert_close(what: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("{what}: element {i} is {} (unwritten or overflow)", got[i]);
    }
    let num: f64 = got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).powi(2)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    let rel = (num / den).sqrt();
    eprintln!("{what}: relative L2 error {rel:.2e}");
    assert!(rel < TOL, "{what}: relative error {rel:e} >= {TOL:e}");
}

/// Random elements of `dtype` as bytes: floats in [-100, 100) (no NaN, whose payloads the
/// two sides need not agree on), integers over their whole range (wrapping is tested).
fn random_elements(r: &mut ChaCha8Rng, dtype: DType, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * dtype.size());
    for _ in 0..n {
        let x: f32 = r.gen_range(-100.0..100.0);
        match dtype {
            DType::F32 => out.extend_from_slice(&x.to_le_bytes()),
            DType::F64 => out.extend_from_slice(&(r.gen_range(-100.0..100.0f64)).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f32(x).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f32(x).to_le_bytes()),
            DType::I32 => out.extend_from_slice(&r.gen::<i32>().to_le_bytes()),
            DType::I64 => out.extend_from_slice(&r.gen::<i64>().to_le_bytes()),
            DType::U8 => out.push(r.gen::<u8>()),
        }
    }
    out
}

fn reductions_match_cpu_bitwise(kind: DeviceKind) {
    let dev = open(kind);
    let mut r = rng("gpu_reductions_match_cpu_bitwise");
    // Odd length: the vector path and the scalar tail both run.
    let n = (1 << 20) + 13;
    let ranks = 3;
    for dtype in DType::ALL {
        let (a, b) = (
            random_elements(&mut r, dtype, n),
            random_elements(&mut r, dtype, n),
        );
        let (da, db) = (dev.upload(&a).unwrap(), dev.upload(&b).unwrap());
        for op in ReduceOp::ALL {
            let red = Reducer::new(dtype, op);
            let mut want = vec![0u8; a.len()];
            red.reduce_out(&mut want, &a, &b);
            red.finalize(&mut want, ranks);
            let mut out = poisoned(&dev, a.len());
            ops::reduce(&dev, dtype, op, &mut out, &da, &db, n).unwrap();
            if op == ReduceOp::Avg {
                ops::avg_divide(&dev, dtype, &mut out, n, ranks).unwrap();
            }
            let mut got = vec![0u8; a.len()];
            dev.synchronize().unwrap();
            dev.copy_to_host(&out, &mut got).unwrap();
            let first_bad = got.iter().zip(&want).position(|(g, w)| g != w);
            assert!(
                first_bad.is_none(),
                "{dtype:?} {op:?}: byte {} differs",
                first_bad.unwrap()
            );
            // The in-place form over a copy of `a`.
            let mut acc = dev.upload(&a).unwrap();
            ops::reduce_into(&dev, dtype, op, &mut acc, &db, n).unwrap();
            if op == ReduceOp::Avg {
                ops::avg_divide(&dev, dtype, &mut acc, n, ranks).unwrap();
            }
            dev.synchronize().unwrap();
            dev.copy_to_host(&acc, &mut got).unwrap();
            assert!(got == want, "{dtype:?} {op:?}: reduce_into differs");
        }
    }
}

fn layernorm_matches_cpu(kind: DeviceKind) {
    let dev = open(kind);
    let mut r = rng("gpu_layernorm_matches_cpu");
    let (n, c) = (333, 776); // neither a multiple of the column tile (64) nor of the row lanes (16)
    let inp = rand_f32(&mut r, n * c, 2.0); // (N, C)
    let w = rand_f32(&mut r, c, 1.0); // (C)
    let bias = rand_f32(&mut r, c, 1.0); // (C)
    let dout = rand_f32(&mut r, n * c, 1.0); // (N, C)
    let dinp0 = rand_f32(&mut r, n * c, 1.0); // accumulated into: (N, C)
    let dw0 = rand_f32(&mut r, c, 1.0);
    let db0 = rand_f32(&mut r, c, 1.0);
    let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    layernorm_forward(
        &mut out,
        &mut mean,
        &mut rstd,
        &widen(&inp),
        &widen(&w),
        &widen(&bias),
        c,
    );
    let (mut dinp, mut dw, mut db) = (widen(&dinp0), widen(&dw0), widen(&db0));
    layernorm_backward(
        &mut dinp,
        &mut dw,
        &mut db,
        &widen(&dout),
        &widen(&inp),
        &widen(&w),
        &mean,
        &rstd,
        c,
    );

    let (g_inp, g_w, g_b) = (
        dev.upload(&inp).unwrap(),
        dev.upload(&w).unwrap(),
        dev.upload(&bias).unwrap(),
    );
    let mut g_out = poisoned(&dev, 4 * n * c);
    let (mut g_mean, mut g_rstd) = (poisoned(&dev, 4 * n), poisoned(&dev, 4 * n));
    let bufs = LayerNormForward { out: &mut g_out, mean: &mut g_mean, rstd: &mut g_rstd, inp: &g_inp, weight: &g_w, bias: &g_b };
    ops::layernorm_forward(&dev, bufs, n, c).unwrap();
    assert_close("layernorm out", &down_f32(&dev, &g_out, n * c), &out);
    assert_close("layernorm mean", &down_f32(&dev, &g_mean, n), &mean);
    assert_close("layernorm rstd", &down_f32(&dev, &g_rstd, n), &rstd);

    let g_dout = dev.upload(&dout).unwrap();
    let (mut g_dinp, mut g_dw, mut g_db) = (
        dev.upload(&dinp0).unwrap(),
        dev.upload(&dw0).unwrap(),
        dev.upload(&db0).unwrap(),
    );
    let bufs = LayerNormBackward {
        dinp: &mut g_dinp,
        dweight: &mut g_dw,
        dbias: &mut g_db,
        dout: &g_dout,
        inp: &g_inp,
        weight: &g_w,
        mean: &g_mean,
        rstd: &g_rstd,
    };
    ops::layernorm_backward(&dev, bufs, n, c).unwrap();
    assert_close("layernorm dinp", &down_f32(&dev, &g_dinp, n * c), &dinp);
    assert_close("layernorm dweight", &down_f32(&dev, &g_dw, c), &dw);
    assert_close("layernorm dbias", &down_f32(&dev, &g_db, c), &db);
}

fn gelu_and_residual_match_cpu(kind: DeviceKind) {
    let dev = open(kind);
    let mut r = rng("gpu_gelu_and_residual_match_cpu");
    let n = 1_000_001;
    let inp = rand_f32(&mut r, n, 6.0);
    let dout = rand_f32(&mut r, n, 1.0);
    let dinp0 = rand_f32(&mut r, n, 1.0);
    let mut out = vec![0.0; n];
    gelu_forward(&mut out, &widen(&inp));
    let mut dinp = widen(&dinp0);
    gelu_backward(&mut dinp, &widen(&inp), &widen(&dout));
    let g_inp = dev.upload(&inp).unwrap();
    let mut g_out = poisoned(&dev, 4 * n);
    ops::gelu_forward(&dev, &mut g_out, &g_inp, n).unwrap();
    assert_close("gelu forward", &down_f32(&dev, &g_out, n), &out);
    let mut g_dinp = dev.upload(&dinp0).unwrap();
    ops::gelu_backward(&dev, &mut g_dinp, &g_inp, &dev.upload(&dout).unwrap(), n).unwrap();
    assert_close("gelu backward", &down_f32(&dev, &g_dinp, n), &dinp);

    // Residual: one f32 add per element, bit-exact.
    let mut g_sum = poisoned(&dev, 4 * n);
    let g_dout = dev.upload(&dout).unwrap();
    ops::residual_forward(&dev, &mut g_sum, &g_inp, &g_dout, n).unwrap();
    let want: Vec<f32> = inp.iter().zip(&dout).map(|(a, b)| a + b).collect();
    assert!(down_f32(&dev, &g_sum, n) == want, "residual add differs");
}

fn attention_matches_cpu(kind: DeviceKind) {
    let dev = open(kind);
    let mut r = rng("gpu_attention_matches_cpu");
    let s = AttnShape::mha(2, 67, 3, 37); // odd T and head size
    let (c, tt) = (s.nh * s.hs, s.b * s.nh * s.t * s.t);
    let qkv = rand_f32(&mut r, s.b * s.t * 3 * c, 1.0); // (B, T, 3C)
    let dout = rand_f32(&mut r, s.b * s.t * c, 1.0); // (B, T, C)
    let dqkv0 = rand_f32(&mut r, s.b * s.t * 3 * c, 1.0); // accumulated into
    let (mut out, mut att) = (vec![0.0; s.b * s.t * c], vec![0.0; tt]);
    attention_forward(&mut out, &mut att, &widen(&qkv), s);
    let mut dqkv = widen(&dqkv0);
    let mut dpre = vec![0.0; tt];
    attention_backward(&mut dqkv, &mut dpre, &widen(&dout), &widen(&qkv), &att, s);

    let g_qkv = dev.upload(&qkv).unwrap();
    let (mut g_out, mut g_att) = (poisoned(&dev, 4 * out.len()), poisoned(&dev, 4 * tt));
    let mut work = AttnWork::new(&dev, s).unwrap();
    ops_attention::attention_forward(&dev, &mut g_out, &mut g_att, &g_qkv, &mut work, s).unwrap();
    assert_close("attention out", &down_f32(&dev, &g_out, out.len()), &out);
    let got_att = down_f32(&dev, &g_att, tt);
    assert_close("attention probabilities", &got_att, &att);
    assert!(
        att.iter().zip(&got_att).all(|(&w, &g)| w != 0.0 || g == 0.0),
        "causal mask not zero"
    );

    let mut g_dqkv = dev.upload(&dqkv0).unwrap();
    let mut g_dpre = poisoned(&dev, 4 * tt);
    let g_dout = dev.upload(&dout).unwrap();
    let bufs = AttentionBackward { dqkv: &mut g_dqkv, dpre: &mut g_dpre, dout: &g_dout, qkv: &g_qkv, att: &g_att };
    ops_attention::attention_backward(&dev, bufs, &mut work, s).unwrap();
    assert_close("attention dqkv", &down_f32(&dev, &g_dqkv, dqkv.len()), &dqkv);
}

fn cross_entropy_matches_cpu_and_skips_padding(kind: DeviceKind) {
    let dev = open(kind);
    let mut r = rng("gpu_cross_entropy_matches_cpu_and_skips_padding");
    let (n, v, vp) = (97, 1000, 1024);
    let mut logits = rand_f32(&mut r, n * vp, 8.0); // (N, Vp)
    for row in logits.chunks_mut(vp) {
        row[v..].iter_mut().for_each(|z| *z = 1e4); // must not enter the softmax
    }
    let targets: Vec<u32> = (0..n).map(|_| r.gen_range(0..v as u32)).collect();
    let dl0 = rand_f32(&mut r, n * vp, 1.0);
    let dloss = 1.0 / n as f32;
    let (mut losses, mut lse) = (vec![0.0; n], vec![0.0; n]);
    cross_entropy_forward(&mut losses, &mut lse, &widen(&logits), &targets, v, vp);
    // The op overwrites the logit gradient (padding set to 0): the device buffer starts as
    // garbage (dl0), the accumulating CPU reference from zeros.
    let mut dl = vec![0.0; n * vp];
    cross_entropy_backward(&mut dl, &widen(&logits), &lse, &targets, dloss as f64, v, vp);

    let (g_z, g_t) = (dev.upload(&logits).unwrap(), dev.upload(&targets).unwrap());
    let (mut g_loss, mut g_lse) = (poisoned(&dev, 4 * n), poisoned(&dev, 4 * n));
    let bufs = CrossEntropyForward { losses: &mut g_loss, lse: &mut g_lse, logits: &g_z, targets: &g_t };
    ops::cross_entropy_forward(&dev, bufs, n, v, vp).unwrap();
    assert_close("cross-entropy losses", &down_f32(&dev, &g_loss, n), &losses);
    assert_close("cross-entropy lse", &down_f32(&dev, &g_lse, n), &lse);
    let mut g_dl = dev.upload(&dl0).unwrap();
    let whole = VocabShard { start: 0, vl: vp, real: v };
    let bufs = CrossEntropyBackward { dlogits: &mut g_dl, logits: &g_z, lse: &g_lse, targets: &g_t };
    ops_vocab::cross_entropy_backward(&dev, bufs, dloss, n, whole).unwrap();
    let got = down_f32(&dev, &g_dl, n * vp);
    assert_close("cross-entropy dlogits", &got, &dl);
    for (row, g) in got.chunks(vp).enumerate() {
        assert!(g[v..].iter().all(|&x| x == 0.0), "row {row}: padded columns are not zero");
    }
}

/// The vocabulary-parallel kernels on one shard (ids 512..1024 of V = 1000: 488 real, 24 padded)
/// against the f64 references: shard max, sum-exp and target logit, the combined loss, the shard
/// backward (overwriting; padded columns zero), the shard embedding and the positions, both directions.
fn vocab_parallel_kernels_match_cpu(kind: DeviceKind) {
    let dev = open(kind);
    let mut r = rng("gpu_vocab_parallel_kernels_match_cpu");
    let (n, t, c, v) = (96, 32, 48, 1000);
    let shard = VocabShard { start: 512, vl: 512, real: 488 };
    let (start, vl, real) = (shard.start, shard.vl, shard.real);
    let logits = rand_f32(&mut r, n * vl, 8.0); // (N, vl)
    let targets: Vec<u32> = (0..n).map(|_| r.gen_range(0..v as u32)).collect();
    let (g_z, g_t) = (dev.upload(&logits).unwrap(), dev.upload(&targets).unwrap());
    let z = widen(&logits);
    let mut max = vec![0.0; n];
    vp::shard_max(&mut max, &z, real);
    let mut g_max = poisoned(&dev, 4 * n);
    ops_vocab::shard_max(&dev, &mut g_max, &g_z, n, shard).unwrap();
    assert_close("shard max", &down_f32(&dev, &g_max, n), &max);
    let mut stats = vec![0.0; 2 * n];
    let (sum, target_logit) = stats.split_at_mut(n);
    vp::shard_sum_exp(sum, target_logit, &z, &max, &targets, start, real);
    let mut g_stats = poisoned(&dev, 8 * n);
    ops_vocab::shard_sum_exp(&dev, &mut g_stats, &g_z, &g_max, &g_t, n, shard).unwrap();
    assert_close("shard sum-exp | target logit", &down_f32(&dev, &g_stats, 2 * n), &stats);
    let (mut losses, mut lse) = (vec![0.0; n], vec![0.0; n]);
    vp::combine_shards(&mut losses, &mut lse, &max, &stats);
    let (mut g_loss, mut g_lse) = (poisoned(&dev, 4 * n), poisoned(&dev, 4 * n));
    ops_vocab::cross_entropy_combine(&dev, &mut g_loss, &mut g_lse, &g_max, &g_stats, n).unwrap();
    assert_close("combined losses", &down_f32(&dev, &g_loss, n), &losses);
    let dl0 = rand_f32(&mut r, n * vl, 1.0);
    let dloss = 1.0 / n as f32;
    let mut dl = widen(&dl0);
    vp::cross_entropy_shard_backward(&mut dl, &z, &lse, &targets, dloss as f64, start, real);
    let mut g_dl = dev.upload(&dl0).unwrap();
    let bufs = CrossEntropyBackward { dlogits: &mut g_dl, logits: &g_z, lse: &g_lse, targets: &g_t };
    ops_vocab::cross_entropy_backward(&dev, bufs, dloss, n, shard).unwrap();
    let got = down_f32(&dev, &g_dl, n * vl);
    assert_close("shard dlogits", &got, &dl);
    for (row, g) in got.chunks(vl).enumerate() {
        assert!(g[real..].iter().all(|&x| x == 0.0), "row {row}: padded columns are not zero");
    }

    let (wte, wpe) = (rand_f32(&mut r, vl * c, 1.0), rand_f32(&mut r, t * c, 1.0));
    let tokens: Vec<u32> = (0..n).map(|_| r.gen_range(0..v as u32)).collect();
    let mut emb = vec![0.0; n * c];
    vp::embedding_shard_forward(&mut emb, &tokens, &widen(&wte), start, c);
    // Rows starting at global row 5, as a sequence-parallel rank's block does.
    vp::position_forward(&mut emb, &widen(&wpe), 5, t, c);
    let index = ops_vocab::token_index(&tokens);
    let (g_tok, g_wte, g_wpe) = (dev.upload(&index).unwrap(), dev.upload(&wte).unwrap(), dev.upload(&wpe).unwrap());
    let mut g_emb = poisoned(&dev, 4 * n * c);
    ops_vocab::embedding_shard_forward(&dev, &mut g_emb, &g_tok, &g_wte, (n, c), shard).unwrap();
    ops_vocab::position_forward(&dev, &mut g_emb, &g_wpe, 5..5 + n, (t, c)).unwrap();
    assert_close("shard embedding + positions", &down_f32(&dev, &g_emb, n * c), &emb);
    let dout = rand_f32(&mut r, n * c, 1.0);
    let (dwte0, dwpe0) = (rand_f32(&mut r, vl * c, 1.0), rand_f32(&mut r, t * c, 1.0));
    let (mut dwte, mut dwpe) = (widen(&dwte0), widen(&dwpe0));
    vp::embedding_shard_backward(&mut dwte, &widen(&dout), &tokens, start, c);
    vp::position_backward(&mut dwpe, &widen(&dout), 5, t, c);
    let g_dout = dev.upload(&dout).unwrap();
    let (mut g_dwte, mut g_dwpe) = (dev.upload(&dwte0).unwrap(), dev.upload(&dwpe0).unwrap());
    ops_vocab::embedding_shard_backward(&dev, &mut g_dwte, &g_dout, &g_tok, (n, c), shard).unwrap();
    ops_vocab::position_backward(&dev, &mut g_dwpe, &g_dout, 5..5 + n, (t, c)).unwrap();
    assert_close("shard dwte", &down_f32(&dev, &g_dwte, vl * c), &dwte);
    assert_close("dwpe", &down_f32(&dev, &g_dwpe, t * c), &dwpe);
}

fn adamw_matches_cpu(kind: DeviceKind) {
    let dev = open(kind);
    let mut r = rng("gpu_adamw_matches_cpu");
    let layout = ParamLayout::new(&GptConfig {
        n_layer: 2,
        n_head: 4,
        n_embd: 64,
        vocab_size: 300,
        max_seq_len: 32,
        llama: None,
    });
    let total = layout.total_len();
    let cfg = AdamWConfig::default();
    let opt = AdamW::new(cfg, DecayMask::from_layout(&layout));
    let mut p = rand_f32(&mut r, total, 1.0);
    let mut state = AdamWState::<f32>::new(0, total);
    let (mut g_p, mut g_m, mut g_v) = (
        dev.upload(&p).unwrap(),
        dev.upload(&vec![0f32; total]).unwrap(),
        dev.upload(&vec![0f32; total]).unwrap(),
    );
    let lr = 3e-3;
    for step in 1..=3u64 {
        let g = rand_f32(&mut r, total, 0.1);
        // Step 2 clips: the device multiplies by the scale in the update, the reference first.
        let grad_scale = if step == 2 { 0.37 } else { 1.0 };
        let scaled: Vec<f32> = g.iter().map(|&x| x * grad_scale as f32).collect();
        opt.step(&mut state, lr, &mut p, &scaled).unwrap();
        let g_g = dev.upload(&g).unwrap();
        let s = AdamWStep {
            config: &cfg,
            step,
            lr,
            grad_scale,
        };
        for e in layout.entries() {
            let bufs = AdamWBuffers {
                params: &mut g_p,
                grads: &g_g,
                m: &mut g_m,
                v: &mut g_v,
            };
            ops::adamw_update(&dev, bufs, e.offset..e.offset + e.len, &s, e.decay).unwrap();
        }
    }
    // Same f32 coefficients and operation order as the CPU; FMA contraction may move each
    // step's result by a few ulps of the update terms (|update| <= ~lr * 1.1), far below 1e-6.
    let got = down_f32(&dev, &g_p, total);
    let worst = got
        .iter()
        .zip(&p)
        .map(|(g, w)| (g - w).abs())
        .fold(0f32, f32::max);
    eprintln!("adamw: max |gpu - cpu| {worst:e}");
    assert!(worst < 1e-6, "adamw differs from the CPU by {worst:e}");
    assert_close("adamw m", &down_f32(&dev, &g_m, total), &widen(&state.m));
    assert_close("adamw v", &down_f32(&dev, &g_v, total), &widen(&state.v));
}

fn casts_match_half_crate_bitwise(kind: DeviceKind) {
    let dev = open(kind);
    let mut r = rng("gpu_casts_match_half_crate_bitwise");
    let n = 1 << 20;
    let mut x: Vec<f32> = (0..n).map(|_| f32::from_bits(r.gen::<u32>())).collect();
    x[..4].copy_from_slice(&[f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -0.0]);
    let mut g_b = poisoned(&dev, 2 * n);
    ops::cast_f32_to_bf16(&dev, &mut g_b, &dev.upload(&x).unwrap(), n).unwrap();
    let mut got = vec![0u16; n];
    dev.synchronize().unwrap();
    dev.copy_to_host(&g_b, &mut got).unwrap();
    let want: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
    assert!(got == want, "f32 -> bf16 differs from half::bf16::from_f32");
    let mut g_f = poisoned(&dev, 4 * n);
    ops::cast_bf16_to_f32(&dev, &mut g_f, &g_b, n).unwrap();
    let back: Vec<u32> = down_f32(&dev, &g_f, n).iter().map(|v| v.to_bits()).collect();
    let want: Vec<u32> = want
        .iter()
        .map(|&h| bf16::from_bits(h).to_f32().to_bits())
        .collect();
    assert!(back == want, "bf16 -> f32 differs");
    // IEEE half: random bit patterns are mostly far outside fp16's range (infinities), so half
    // of the inputs are drawn around its range instead: overflow at 65520 (the midpoint above
    // 65504 rounds to infinity), subnormals, and ties of the rounding.
    for (i, v) in x.iter_mut().enumerate().skip(4).step_by(2) {
        *v = f32::from_bits((r.gen::<u32>() & 0x8fff_ffff) | ((100 + (i as u32 % 60)) << 23));
    }
    x[4..12].copy_from_slice(&[65504.0, 65519.99, 65520.0, -1e30, 5.960_464_5e-8, 2.980_232_2e-8, 2.980_232_4e-8, 1.000_488_3]);
    let mut g_h = poisoned(&dev, 2 * n);
    ops::cast_f32_to_f16(&dev, &mut g_h, &dev.upload(&x).unwrap(), n).unwrap();
    dev.synchronize().unwrap();
    dev.copy_to_host(&g_h, &mut got).unwrap();
    let want: Vec<u16> = x.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    assert_eq!(&got[4..12], &want[4..12], "f32 -> f16 edge cases");
    assert!(got == want, "f32 -> f16 differs from half::f16::from_f32");
    assert!(f16::from_bits(got[6]).is_infinite() && f16::from_bits(got[7]).is_infinite(), "fp16 overflows to infinity");
    ops::cast_f16_to_f32(&dev, &mut g_f, &g_h, n).unwrap();
    let back: Vec<u32> = down_f32(&dev, &g_f, n).iter().map(|v| v.to_bits()).collect();
    let want: Vec<u32> = want.iter().map(|&h| f16::from_bits(h).to_f32().to_bits()).collect();
    assert!(back == want, "f16 -> f32 differs");
}

/// Not a pass/fail test: prints the combine kernels' bandwidth next to a device-to-device copy.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_reduce_bandwidth_report() {
    let dev = open(DeviceKind::Cuda);
    let rows = reduce_bandwidth(&dev, 256 << 20).unwrap();
    println!("{:<20} {:>10} {:>10}", "kernel (256 MiB)", "us", "GB/s");
    for row in rows {
        println!("{:<20} {:>10.1} {:>10.1}", row.what, row.seconds * 1e6, row.gbs);
    }
}

/// The attention kernels one by one against the CPU arm of the same ops: head split/merge
/// bit-exact (pure moves, and one add per element when accumulating); the softmax forward and
/// backward within TOL, with NaN above the diagonal on entry (never read, must come out 0).
fn attention_kernels_match_cpu_arm(kind: DeviceKind) {
    let (dev, cpu) = (open(kind), Device::Cpu);
    let mut r = rng("gpu_attention_kernels_match_cpu_arm");
    let s = AttnShape::mha(3, 45, 5, 19);
    let (rows, t, n) = (s.b * s.nh * s.t, s.t, s.b * s.t * s.nh * s.hs);
    let both = |f: &dyn Fn(&Device, &mut DeviceBuffer), start: &[f32], len: usize| -> (Vec<f32>, Vec<f32>) {
        let mut out = Vec::new();
        for d in [&dev, &cpu] {
            let mut buf = if start.is_empty() { poisoned(d, 4 * len) } else { d.upload(start).unwrap() };
            f(d, &mut buf);
            out.push(down_f32(d, &buf, len));
        }
        (out.remove(0), out.remove(0))
    };
    for parts in [1, 3] {
        let src = rand_f32(&mut r, parts * n, 1.0); // (B, T, parts*C)
        let split = |d: &Device, dst: &mut DeviceBuffer| {
            ops_attention::split_heads(d, dst, &d.upload(&src).unwrap(), s, parts).unwrap()
        };
        let (got, want) = both(&split, &[], parts * n); // (parts, B, NH, T, hs)
        assert!(got == want, "split_heads parts={parts} differs");
        let dst0 = rand_f32(&mut r, parts * n, 1.0);
        for accumulate in [false, true] {
            let merge = |d: &Device, dst: &mut DeviceBuffer| {
                ops_attention::merge_heads(d, dst, &d.upload(&want).unwrap(), s, parts, accumulate).unwrap()
            };
            let start = if accumulate { &dst0[..] } else { &[] };
            let (got, back) = both(&merge, start, parts * n);
            assert!(got == back, "merge_heads parts={parts} accumulate={accumulate} differs");
            if !accumulate {
                assert!(back == src, "merge_heads does not invert split_heads");
            }
        }
    }
    let scale = 1.0 / (s.hs as f32).sqrt();
    let above_nan = |x: &mut [f32]| {
        for (i, row) in x.chunks_mut(t).enumerate() {
            row[i % t + 1..].fill(f32::NAN);
        }
    };
    let mut scores = rand_f32(&mut r, rows * t, 8.0); // (B, NH, T, T)
    above_nan(&mut scores);
    let fwd = |d: &Device, att: &mut DeviceBuffer| ops_attention::softmax_forward(d, att, rows, t, scale).unwrap();
    let (got, att) = both(&fwd, &scores, rows * t);
    assert_close("softmax forward", &got, &widen(&att));
    assert!(att.iter().zip(&got).all(|(&w, &g)| w != 0.0 || g == 0.0), "causal mask not zero");
    let mut datt = rand_f32(&mut r, rows * t, 1.0);
    above_nan(&mut datt);
    let bwd = |d: &Device, g: &mut DeviceBuffer| {
        ops_attention::softmax_backward(d, g, &d.upload(&att).unwrap(), rows, t, scale).unwrap()
    };
    let (got, want) = both(&bwd, &datt, rows * t);
    assert_close("softmax backward", &got, &widen(&want));
}

/// The strided-batched product (cuBLAS on a GPU, the CPU gemm on emu) for every transposition
/// and both input types, with offsets and gaps between the matrices, against a loop of naive
/// products; small-integer inputs make every result exact in f32.
fn batched_gemm_matches_naive_loop(kind: DeviceKind) {
    let dev = open(kind);
    let gemm = Gemm::new(&dev).unwrap();
    let mut r = rng("gpu_batched_gemm_matches_naive_loop");
    let (m, n, k, count) = (13, 7, 9, 6);
    let batch = Batch { count, c: (3, m * n + 5), a: (1, m * k + 2), b: (4, k * n) };
    let len = |(offset, stride): (usize, usize), elems| offset + (count - 1) * stride + elems;
    let ints = |r: &mut ChaCha8Rng, n| (0..n).map(|_| r.gen_range(-4..=4) as f32).collect::<Vec<f32>>();
    let (a_all, b_all) = (ints(&mut r, len(batch.a, m * k)), ints(&mut r, len(batch.b, k * n))); // stored
    let c0 = ints(&mut r, len(batch.c, m * n));
    let up = |x: &[f32], dtype| match dtype {
        GemmInput::F32 => dev.upload(x).unwrap(),
        GemmInput::Bf16 => dev.upload(&x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()).unwrap(),
        GemmInput::F16 => dev.upload(&x.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>()).unwrap(),
    };
    for dtype in [GemmInput::F32, GemmInput::Bf16, GemmInput::F16] {
        for (a_t, b_t) in [(false, false), (true, false), (false, true), (true, true)] {
            let mut want = c0.clone();
            for i in 0..count {
                let a_i = &a_all[batch.a.0 + i * batch.a.1..]; // (M, K), or (K, M) stored transposed
                let b_i = &b_all[batch.b.0 + i * batch.b.1..]; // (K, N), or (N, K)
                for (row, col) in (0..m).flat_map(|row| (0..n).map(move |col| (row, col))) {
                    let at = |p: usize| if a_t { a_i[p * m + row] } else { a_i[row * k + p] };
                    let bt = |p: usize| if b_t { b_i[col * k + p] } else { b_i[p * n + col] };
                    want[batch.c.0 + i * batch.c.1 + row * n + col] += (0..k).map(|p| at(p) * bt(p)).sum::<f32>();
                }
            }
            let (ab, bb) = (up(&a_all, dtype), up(&b_all, dtype));
            let mut c = dev.upload(&c0).unwrap();
            let op = |buf, transposed| Operand { buf, dtype, transposed };
            gemm.matmul_batched(&dev, &mut c, op(&ab, a_t), op(&bb, b_t), (m, n, k), &batch, true).unwrap();
            assert!(down_f32(&dev, &c, c0.len()) == want, "{dtype:?} a_t={a_t} b_t={b_t}");
        }
    }
}

// Llama's layers: RMSNorm, SwiGLU, RoPE and grouped-query attention.

fn rmsnorm_matches_cpu(kind: DeviceKind) {
    let dev = open(kind);
    let mut r = rng("gpu_rmsnorm_matches_cpu");
    let (n, c, eps) = (333, 776, 1e-5f32); // neither a multiple of the column tile nor the row lanes
    let (inp, w, dout) = (rand_f32(&mut r, n * c, 2.0), rand_f32(&mut r, c, 1.0), rand_f32(&mut r, n * c, 1.0));
    let (dinp0, dw0) = (rand_f32(&mut r, n * c, 1.0), rand_f32(&mut r, c, 1.0)); // accumulated into
    let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    rmsnorm_forward(&mut out, &mut rstd, &widen(&inp), &widen(&w), c, eps as f64);
    let (mut dinp, mut dw) = (widen(&dinp0), widen(&dw0));
    rmsnorm_backward(&mut dinp, &mut dw, &widen(&dout), &widen(&inp), &widen(&w), &rstd, c);

    let (g_inp, g_w) = (dev.upload(&inp).unwrap(), dev.upload(&w).unwrap());
    let (mut g_out, mut g_rstd) = (poisoned(&dev, 4 * n * c), poisoned(&dev, 4 * n));
    ops_llama::rmsnorm_forward(&dev, RmsNormForward { out: &mut g_out, rstd: &mut g_rstd, inp: &g_inp, weight: &g_w }, n, c, eps).unwrap();
    assert_close("rmsnorm out", &down_f32(&dev, &g_out, n * c), &out);
    assert_close("rmsnorm rstd", &down_f32(&dev, &g_rstd, n), &rstd);
    let (mut g_dinp, mut g_dw) = (dev.upload(&dinp0).unwrap(), dev.upload(&dw0).unwrap());
    let g_dout = dev.upload(&dout).unwrap();
    let bufs = RmsNormBackward { dinp: &mut g_dinp, dweight: &mut g_dw, dout: &g_dout, inp: &g_inp, weight: &g_w, rstd: &g_rstd };
    ops_llama::rmsnorm_backward(&dev, bufs, n, c).unwrap();
    assert_close("rmsnorm dinp", &down_f32(&dev, &g_dinp, n * c), &dinp);
    assert_close("rmsnorm dweight", &down_f32(&dev, &g_dw, c), &dw);
}

fn swiglu_matches_cpu(kind: DeviceKind) {
    let dev = open(kind);
    let mut r = rng("gpu_swiglu_matches_cpu");
    let (n, f) = (301, 1001);
    let (inp, dout) = (rand_f32(&mut r, 2 * n * f, 8.0), rand_f32(&mut r, n * f, 1.0));
    let mut out = vec![0.0; n * f];
    swiglu_forward(&mut out, &widen(&inp), f);
    let mut dinp = vec![0.0; 2 * n * f];
    swiglu_backward(&mut dinp, &widen(&dout), &widen(&inp), f);
    let g_inp = dev.upload(&inp).unwrap();
    let mut g_out = poisoned(&dev, 4 * n * f);
    ops_llama::swiglu_forward(&dev, &mut g_out, &g_inp, n, f).unwrap();
    assert_close("swiglu forward", &down_f32(&dev, &g_out, n * f), &out);
    let mut g_dinp = poisoned(&dev, 8 * n * f); // overwritten, never read
    ops_llama::swiglu_backward(&dev, &mut g_dinp, &dev.upload(&dout).unwrap(), &g_inp, n, f).unwrap();
    assert_close("swiglu backward", &down_f32(&dev, &g_dinp, 2 * n * f), &dinp);
}

/// Forward and backward of RoPE with Llama 3 scaling on a GQA qkv, against the CPU rotation in
/// f64 with the same (f32) tables; v must come back untouched bit for bit.
fn rope_matches_cpu(kind: DeviceKind) {
    let dev = open(kind);
    let mut r = rng("gpu_rope_matches_cpu");
    let s = RopeShape { b: 3, t: 37, nh: 6, nkv: 2, hd: 18 };
    let scaling = Llama3Scaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 64.0 };
    let (cos, sin) = rope_table(s.hd, s.t, 500000.0, Some(scaling));
    let (g_cos, g_sin) = (dev.upload(&cos).unwrap(), dev.upload(&sin).unwrap());
    let x = rand_f32(&mut r, s.b * s.t * s.row(), 2.0);
    for inverse in [false, true] {
        let mut want = widen(&x);
        let (c, sn) = (widen(&cos), widen(&sin));
        let mut g = dev.upload(&x).unwrap();
        if inverse {
            cpu_rope::rope_backward(&mut want, &c, &sn, s);
            ops_llama::rope_backward(&dev, &mut g, &g_cos, &g_sin, s).unwrap();
        } else {
            cpu_rope::rope_forward(&mut want, &c, &sn, s);
            ops_llama::rope_forward(&dev, &mut g, &g_cos, &g_sin, s).unwrap();
        }
        let got = down_f32(&dev, &g, x.len());
        assert_close(if inverse { "rope backward" } else { "rope forward" }, &got, &want);
        let v0 = (s.nh + s.nkv) * s.hd;
        for (gr, xr) in got.chunks(s.row()).zip(x.chunks(s.row())) {
            assert!(gr[v0..] == xr[v0..], "v changed");
        }
    }
    let odd = RopeShape { hd: 5, ..s };
    let err = ops_llama::rope_forward(&dev, &mut dev.upload(&x).unwrap(), &g_cos, &g_sin, odd).unwrap_err();
    assert!(err.to_string().contains("odd"), "{err}");
}

/// Grouped-query attention with NKV in {NH, NH/2, 1} against the CPU reference (f64), and the
/// GQA head split/merge against their CPU arm bit for bit.
fn gqa_attention_matches_cpu(kind: DeviceKind) {
    let (dev, cpu) = (open(kind), Device::Cpu);
    let mut r = rng("gpu_gqa_attention_matches_cpu");
    let (b, t, nh, hs) = (2, 33, 4, 13);
    for nkv in [nh, nh / 2, 1] {
        let s = AttnShape::gqa(b, t, nh, nkv, hs).unwrap();
        let (c, tt, n) = (s.c(), b * nh * t * t, b * t * s.row());
        let qkv = rand_f32(&mut r, n, 1.0);
        let (dout, dqkv0) = (rand_f32(&mut r, b * t * c, 1.0), rand_f32(&mut r, n, 1.0));
        let (mut out, mut att) = (vec![0.0; b * t * c], vec![0.0; tt]);
        attention_forward(&mut out, &mut att, &widen(&qkv), s);
        let mut dqkv = widen(&dqkv0);
        let mut dpre = vec![0.0; tt];
        attention_backward(&mut dqkv, &mut dpre, &widen(&dout), &widen(&qkv), &att, s);

        let g_qkv = dev.upload(&qkv).unwrap();
        let (mut g_out, mut g_att) = (poisoned(&dev, 4 * out.len()), poisoned(&dev, 4 * tt));
        let mut work = AttnWork::new(&dev, s).unwrap();
        ops_attention::attention_forward(&dev, &mut g_out, &mut g_att, &g_qkv, &mut work, s).unwrap();
        assert_close(&format!("gqa nkv={nkv} out"), &down_f32(&dev, &g_out, out.len()), &out);
        assert_close(&format!("gqa nkv={nkv} probabilities"), &down_f32(&dev, &g_att, tt), &att);
        let (mut g_dqkv, mut g_dpre) = (dev.upload(&dqkv0).unwrap(), poisoned(&dev, 4 * tt));
        let g_dout = dev.upload(&dout).unwrap();
        let bufs = AttentionBackward { dqkv: &mut g_dqkv, dpre: &mut g_dpre, dout: &g_dout, qkv: &g_qkv, att: &g_att };
        ops_attention::attention_backward(&dev, bufs, &mut work, s).unwrap();
        assert_close(&format!("gqa nkv={nkv} dqkv"), &down_f32(&dev, &g_dqkv, n), &dqkv);

        for parts in [1, 3] {
            let len = b * t * (nh + (parts - 1) * nkv) * hs;
            let src = &qkv[..len];
            let mut split = Vec::new();
            for d in [&dev, &cpu] {
                let mut dst = poisoned(d, 4 * len);
                ops_attention::split_heads(d, &mut dst, &d.upload(src).unwrap(), s, parts).unwrap();
                split.push(down_f32(d, &dst, len));
            }
            assert!(split[0] == split[1], "split_heads nkv={nkv} parts={parts} differs");
            let mut merged = Vec::new();
            for d in [&dev, &cpu] {
                let mut dst = d.upload(&dqkv0[..len]).unwrap();
                ops_attention::merge_heads(d, &mut dst, &d.upload(&split[1]).unwrap(), s, parts, true).unwrap();
                merged.push(down_f32(d, &dst, len));
            }
            assert!(merged[0] == merged[1], "merge_heads nkv={nkv} parts={parts} differs");
            let want: Vec<f32> = dqkv0[..len].iter().zip(src).map(|(a, b)| a + b).collect();
            assert!(merged[1] == want, "merge_heads nkv={nkv} parts={parts} does not invert split_heads");
        }
    }
    let bad = AttnShape { nkv: 3, ..AttnShape::mha(b, t, nh, hs) };
    let err = AttnWork::new(&dev, bad).err().expect("nkv = 3 of 4 heads accepted");
    assert!(err.to_string().contains("4 query heads are not a multiple of 3"), "{err}");
}

crate::gpu_and_emu_tests!(
    reductions_match_cpu_bitwise,
    layernorm_matches_cpu,
    gelu_and_residual_match_cpu,
    attention_matches_cpu,
    attention_kernels_match_cpu_arm,
    batched_gemm_matches_naive_loop,
    cross_entropy_matches_cpu_and_skips_padding,
    vocab_parallel_kernels_match_cpu,
    adamw_matches_cpu,
    casts_match_half_crate_bitwise,
    rmsnorm_matches_cpu,
    swiglu_matches_cpu,
    rope_matches_cpu,
    gqa_attention_matches_cpu,
);
