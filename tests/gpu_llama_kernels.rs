//! Llama's kernels (RMSNorm, SwiGLU, RoPE, grouped-query attention) against the CPU reference,
//! on a real GPU (`gpu::`, ignored elsewhere) and on the emu arm (`emu::`, every `cargo test`):
//!
//! `cargo test --release --test gpu_llama_kernels -- --ignored gpu --test-threads=1 --nocapture`
//!
//! As in tests/gpu_kernels.rs: fresh random inputs each run (seed printed, replayed with
//! `MESHTRAIN_GPU_SEED`), outputs poisoned with NaN bytes before each launch, and float results
//! compared with the CPU layers run in f64 on the same f32 inputs by relative L2 error within
//! 1e-5. Head split/merge are pure moves (and one add when accumulating) and must equal the CPU
//! arm bit for bit.

mod common;

use common::gpu::{open, rng};
use meshtrain::config::DeviceKind;
use meshtrain::device::cpu::attention::{attention_backward, attention_forward, attention_scratch_len, AttnShape};
use meshtrain::device::cpu::rmsnorm::{rmsnorm_backward, rmsnorm_forward};
use meshtrain::device::cpu::rope::{self as cpu_rope, RopeShape};
use meshtrain::device::cpu::swiglu::{swiglu_backward, swiglu_forward};
use meshtrain::device::ops_attention::{self, AttnWork};
use meshtrain::device::ops_llama::{self, rope_table, Llama3Scaling};
use meshtrain::device::{Device, DeviceBuffer};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

const TOL: f64 = 1e-5;

fn rand_f32(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| r.gen_range(-scale..scale)).collect()
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// A buffer of `bytes` bytes, every byte 0xFF (NaN).
fn poisoned(dev: &Device, bytes: usize) -> DeviceBuffer {
    dev.upload(&vec![0xFFu8; bytes]).unwrap()
}

fn down_f32(dev: &Device, buf: &DeviceBuffer, n: usize) -> Vec<f32> {
    dev.synchronize().unwrap();
    let mut v = vec![0f32; n];
    dev.copy_to_host(buf, &mut v).unwrap();
    v
}

/// Every element finite and the relative L2 error within [`TOL`].
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
    ops_llama::rmsnorm_forward(&dev, &mut g_out, &mut g_rstd, &g_inp, &g_w, n, c, eps).unwrap();
    assert_close("rmsnorm out", &down_f32(&dev, &g_out, n * c), &out);
    assert_close("rmsnorm rstd", &down_f32(&dev, &g_rstd, n), &rstd);
    let (mut g_dinp, mut g_dw) = (dev.upload(&dinp0).unwrap(), dev.upload(&dw0).unwrap());
    let g_dout = dev.upload(&dout).unwrap();
    ops_llama::rmsnorm_backward(&dev, &mut g_dinp, &mut g_dw, &g_dout, &g_inp, &g_w, &g_rstd, n, c).unwrap();
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
        let mut scratch = vec![0.0; attention_scratch_len(t)];
        attention_backward(&mut dqkv, &mut scratch, &widen(&dout), &widen(&qkv), &att, s);

        let g_qkv = dev.upload(&qkv).unwrap();
        let (mut g_out, mut g_att) = (poisoned(&dev, 4 * out.len()), poisoned(&dev, 4 * tt));
        let mut work = AttnWork::new(&dev, s).unwrap();
        ops_attention::attention_forward(&dev, &mut g_out, &mut g_att, &g_qkv, &mut work, s).unwrap();
        assert_close(&format!("gqa nkv={nkv} out"), &down_f32(&dev, &g_out, out.len()), &out);
        assert_close(&format!("gqa nkv={nkv} probabilities"), &down_f32(&dev, &g_att, tt), &att);
        let (mut g_dqkv, mut g_dpre) = (dev.upload(&dqkv0).unwrap(), poisoned(&dev, 4 * tt));
        let g_dout = dev.upload(&dout).unwrap();
        ops_attention::attention_backward(&dev, &mut g_dqkv, &mut g_dpre, &g_dout, &g_qkv, &g_att, &mut work, s).unwrap();
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

crate::gpu_and_emu_tests!(rmsnorm_matches_cpu, swiglu_matches_cpu, rope_matches_cpu, gqa_attention_matches_cpu);
