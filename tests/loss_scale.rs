//! `precision = "fp16"` and loss scaling through `meshtrain train` with real rank processes: fp16
//! training tracks fp32 (CPU arm and emu), a forced overflow is skipped by the same decision in
//! every layout and the dynamic scale backs off and then grows, a NaN gradient injected on one
//! rank is skipped instead of stopping the run, and a resume continues the scaler bit for bit.

mod common;

use std::path::{Path, PathBuf};

use common::tiny_job as job;
use serde_json::Value;

/// Every metrics line of a run.
fn records(metrics: &Path) -> Vec<Value> {
    std::fs::read_to_string(metrics).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// Per step: (loss, loss scale, skipped).
fn steps(metrics: &Path) -> Vec<(f64, f64, bool)> {
    records(metrics)
        .iter()
        .map(|r| (r["loss"].as_f64().unwrap(), r["loss_scale"].as_f64().unwrap(), r["skipped"].as_bool().unwrap()))
        .collect()
}

fn run(dir: &Path, name: &str, np: usize, parallel: &str, sets: &[&str]) -> (PathBuf, common::Finished) {
    let path = job(dir, &format!("{name}.toml"), parallel);
    let metrics = dir.join(format!("{name}.jsonl"));
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let out = common::train(np, &path, &metrics, &sets);
    (metrics, out)
}

fn assert_losses_close(got: &[(f64, f64, bool)], want: &[(f64, f64, bool)], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: step counts differ");
    let mut worst = 0f64;
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!((a.0 - b.0).abs() <= rel * b.0.abs(), "{what}: step {} loss {} vs {}", i + 1, a.0, b.0);
        worst = worst.max((a.0 - b.0).abs() / b.0.abs());
    }
    eprintln!("{what}: losses within {worst:.2e} relative");
}

/// fp16 GEMM inputs (11 significant bits, loss scale 65536) track the fp32 run within their
/// rounding (measured over 20 steps: a few 1e-5 relative, bound 1e-3), leave a trace (some loss
/// differs), and never overflow at the default scale on the tiny model; the emu arm (the GPU
/// kernels, emulated) follows the CPU arm's fp16 run (different summation orders, then fp16
/// rounding of activations an ulp apart: measured 1e-6 over 4 steps, bound 1e-4).
#[test]
fn fp16_training_tracks_fp32_on_the_cpu_and_emu_arms() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (fp32, _) = run(d, "fp32", 1, "", &[]);
    let (fp16, out) = run(d, "fp16", 1, "", &["precision=fp16"]);
    let (fp32, fp16) = (steps(&fp32), steps(&fp16));
    assert_losses_close(&fp16, &fp32, 1e-3, "fp16 vs fp32");
    assert!(fp16.iter().zip(&fp32).any(|(a, b)| a.0 != b.0), "fp16 left no trace on the losses: did it run in fp32?");
    assert!(fp16.iter().all(|s| s.1 == 65536.0 && !s.2), "the default dynamic scale skipped or moved: {fp16:?}");
    assert!(fp32.iter().all(|s| s.1 == 1.0 && !s.2), "fp32 scales no loss by default");
    assert!(out.stdout.contains("# done: 20 steps") && !out.stdout.contains("skipped"), "{}", out.stdout);
    // Four steps each (the schedule depends on train.steps).
    let (cpu4, _) = run(d, "cpu4", 1, "", &["precision=fp16", "train.steps=4"]);
    let (emu4, _) = run(d, "emu4", 1, "", &["device=emu", "precision=fp16", "train.steps=4"]);
    assert_losses_close(&steps(&emu4), &steps(&cpu4), 1e-4, "emu fp16 vs cpu fp16");
}

/// A loss scale of 2^26 overflows fp16 in the backward (the loss gradient alone is 2^26 / 128
/// per token): the first steps are skipped while the scale halves, then the run trains, and the
/// scale grows again after each 4 good steps until it overflows again. Every layout (DP 2 with
/// ZeRO-0, 1 and 3, TP 2, PP 2) takes the same decisions at the same steps with the same scales as one
/// rank, and its losses follow the single rank's (summation order only: 1e-4).
#[test]
fn gradient_overflow_is_skipped_alike_in_every_layout_then_the_scale_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let scaling = ["precision=fp16", "train.loss_scale_init=67108864", "train.loss_scale_growth_interval=4", "train.steps=16"];
    let with = |extra: &[&'static str]| -> Vec<&str> { scaling.iter().copied().chain(extra.iter().copied()).collect() };
    let (single, out) = run(d, "single", 1, "", &with(&["train.grad_accum=2"]));
    let want = steps(&single);
    let skipped: Vec<usize> = (0..want.len()).filter(|&i| want[i].2).collect();
    assert!(want[0].2 && !want[15].2, "the first step overflows, the last trains: {want:?}");
    let first_good = want.iter().position(|s| !s.2).unwrap();
    assert!(first_good < 8, "the scale backs off within a few steps: {want:?}");
    for i in 1..want.len() {
        let (prev, now) = (want[i - 1], want[i]);
        if prev.2 {
            assert_eq!(now.1, prev.1 * 0.5, "step {}: a skipped step halves the scale", i + 1);
        }
    }
    let grown = want.windows(2).any(|w| !w[0].2 && w[1].1 == 2.0 * w[0].1);
    assert!(grown, "the scale grew after 4 good steps: {want:?}");
    // Skipped steps leave the weights alone: the loss after them is that of unchanged weights
    // on new data, so training made progress only on the good steps.
    assert!(want[15].0 < want[first_good].0, "the run trains after backing off: {want:?}");
    let last = records(&single).pop().unwrap();
    assert_eq!(last["skipped_steps"].as_u64().unwrap(), skipped.len() as u64);
    assert!(out.stdout.contains(&format!("{} step(s) skipped", skipped.len())), "{}", out.stdout);
    eprintln!("single rank: skipped steps {skipped:?}, scales {:?}", want.iter().map(|s| s.1).collect::<Vec<_>>());
    for (name, np, parallel, extra) in [
        ("dp2z0", 2, "[parallel]\ndp = 2\nzero = 0", vec![]),
        ("dp2z1", 2, "[parallel]\ndp = 2\nzero = 1", vec![]),
        ("dp2z3", 2, "[parallel]\ndp = 2\nzero = 3", vec![]),
        ("tp2", 2, "[parallel]\ntp = 2", vec!["train.grad_accum=2"]),
        ("pp2", 2, "[parallel]\npp = 2\nmicrobatches = 2", vec![]),
    ] {
        let (metrics, _) = run(d, name, np, parallel, &with(&extra));
        let got = steps(&metrics);
        let decisions = |s: &[(f64, f64, bool)]| s.iter().map(|x| (x.1, x.2)).collect::<Vec<_>>();
        assert_eq!(decisions(&got), decisions(&want), "{name}: scales and skips differ from one rank's");
        assert_losses_close(&got, &want, 1e-4, name);
    }
}

/// `MESHTRAIN_FAULT=nan-grad@1:3` under fp16 (loss scaling on, `train.nonfinite` left at `stop`):
/// step 3 is skipped on both data-parallel ranks, the scale backs off once and the run ends
/// normally, naming the rank the NaN came from.
#[test]
fn an_injected_nan_gradient_under_fp16_is_skipped_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let path = job(dir.path(), "nan.toml", "[parallel]\ndp = 2\nzero = 1");
    let metrics = dir.path().join("nan.jsonl");
    let sets = ["precision=fp16".to_string(), "train.steps=5".into()];
    let out = common::train_env(2, &path, &metrics, &sets, &[("MESHTRAIN_FAULT", "nan-grad@1:3")]);
    let got = steps(&metrics);
    let skipped: Vec<bool> = got.iter().map(|s| s.2).collect();
    assert_eq!(skipped, [false, false, true, false, false]);
    let scales: Vec<f64> = got.iter().map(|s| s.1).collect();
    assert_eq!(scales, [65536.0, 65536.0, 65536.0, 32768.0, 32768.0]);
    assert!(got.iter().all(|s| s.0.is_finite()));
    let all = out.stdout.clone() + &out.stderr;
    assert!(all.contains("step 3; the loss was finite on every rank; the non-finite gradients came from rank(s) 1"), "{all}");
    assert!(all.contains("# done: 5 steps") && all.contains("1 step(s) skipped"), "{all}");
}

/// A run resumed from its step-6 checkpoint continues with the saved scale and good-step count:
/// steps 7-12 give the losses, scales, skips and skip counts of the uninterrupted run bit for bit. A
/// checkpoint without scaler state (written by an fp32 run) resumed under fp16 starts from
/// `train.loss_scale_init`.
#[test]
fn resuming_restores_the_scaler_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ckpt = d.join("ckpt");
    let ck = format!("checkpoint.dir={:?}", ckpt.display().to_string());
    let base = ["precision=fp16", "train.loss_scale_init=67108864", "train.loss_scale_growth_interval=3", "train.steps=12", "checkpoint.every=6"];
    let sets: Vec<&str> = base.iter().copied().chain([ck.as_str()]).collect();
    let (whole, _) = run(d, "whole", 1, "", &sets);
    let whole = records(&whole);
    let index = meshtrain::checkpoint::open(&ckpt.join("step_00000006")).unwrap();
    let state = index.meta().loss_scale.expect("an fp16 checkpoint holds the scaler state");
    assert_eq!(state.scale, whole[6]["loss_scale"].as_f64().unwrap(), "the saved scale is step 7's");

    let from = format!("checkpoint.resume={:?}", ckpt.join("step_00000006").display().to_string());
    let ck2 = format!("checkpoint.dir={:?}", d.join("ckpt2").display().to_string());
    let sets: Vec<&str> = base.iter().copied().chain([ck2.as_str(), from.as_str()]).collect();
    let (resumed, _) = run(d, "resumed", 1, "", &sets);
    let resumed = records(&resumed);
    assert_eq!(resumed.len(), 6);
    let key = |r: &Value| {
        let bits = |k: &str| r[k].as_f64().unwrap().to_bits();
        (r["step"].as_u64(), bits("loss"), bits("loss_scale"), r["skipped"].as_bool(), r["skipped_steps"].as_u64())
    };
    for (a, b) in resumed.iter().zip(&whole[6..]) {
        assert_eq!(key(a), key(b), "resumed vs uninterrupted");
    }
    assert!(whole.iter().any(|r| r["skipped"] == true), "the run exercised a back-off");

    // An older checkpoint: no scaler state, so the configured start.
    let ck3 = format!("checkpoint.dir={:?}", d.join("ckpt3").display().to_string());
    run(d, "fp32", 1, "", &["train.steps=2", "checkpoint.every=2", ck3.as_str()]);
    let from = format!("checkpoint.resume={:?}", d.join("ckpt3/step_00000002").display().to_string());
    let ck4 = format!("checkpoint.dir={:?}", d.join("ckpt4").display().to_string());
    let (old, _) = run(d, "old", 1, "", &["precision=fp16", "train.loss_scale_init=512", "train.steps=3", ck4.as_str(), from.as_str()]);
    let old = records(&old);
    assert_eq!((old[0]["step"].as_u64(), old[0]["loss_scale"].as_f64()), (Some(3), Some(512.0)));
}

/// A bad loss-scaling value exits 2 before any work, naming the key; a dynamic scale that must
/// back off below `train.loss_scale_min` stops the run on every rank with an error naming the
/// step, the scale and the key (here 2^26 with minimum 2^25: step 1 overflows and halves the
/// scale to the minimum, step 2 overflows again).
#[test]
fn bad_values_exit_2_and_a_scale_below_the_minimum_stops_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let path = job(dir.path(), "bad.toml", "");
    for (set, key) in [("train.loss_scale=sometimes", "train.loss_scale"), ("train.loss_scale_backoff=2", "train.loss_scale_backoff")] {
        let out = std::process::Command::new(common::meshtrain()).arg("train").arg(&path).args(["--set", "precision=fp16", "--set", set]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{set}: {err}");
        assert!(err.contains(key), "{set}: error does not name `{key}`: {err}");
    }
    let mut cmd = common::mpirun(2);
    cmd.arg("train").arg(&path);
    for s in ["precision=fp16", "train.loss_scale_init=67108864", "train.loss_scale_min=33554432", "parallel.dp=2", "train.steps=4"] {
        cmd.args(["--set", s]);
    }
    let out = common::run(cmd, std::time::Duration::from_secs(120));
    assert!(!out.stdout.contains("# done"), "{}", out.stdout);
    for r in 0..2 {
        let said = out.rank_stderr(r).join("\n");
        assert!(said.contains("at step 2 with the loss scale at 33554432") && said.contains("train.loss_scale_min = 33554432"), "rank {r}: {said}");
    }
}

/// Llama under fp16 with loss scaling: the same forced overflow (2^26) on `llama-tiny` (grouped-
/// query attention, RoPE, SwiGLU, RMSNorm, untied head), on the emu arm: one rank, TP 2 with
/// sequence parallelism x DP 2 at ZeRO-2, and PP 2 x DP 2 take the same skip decisions at the same
/// scales, and their losses follow the single rank's (summation order only: 1e-4); the CPU arm's
/// single rank takes the same decisions too.
#[test]
fn llama_fp16_skips_overflow_alike_on_the_emu_arm_in_every_layout() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let base = ["model.size=llama-tiny", "precision=fp16", "train.loss_scale_init=67108864", "train.loss_scale_growth_interval=4", "train.steps=8"];
    let with = |extra: &[&'static str]| -> Vec<&str> { base.iter().copied().chain(extra.iter().copied()).collect() };
    let (single, _) = run(d, "emu1", 1, "", &with(&["device=emu", "train.grad_accum=2"]));
    let want = steps(&single);
    assert!(want[0].2 && want.iter().any(|s| !s.2), "the first step overflows, later ones train: {want:?}");
    let decisions = |s: &[(f64, f64, bool)]| s.iter().map(|x| (x.1, x.2)).collect::<Vec<_>>();
    let (cpu, _) = run(d, "cpu1", 1, "", &with(&["train.grad_accum=2"]));
    let cpu = steps(&cpu);
    assert_eq!(decisions(&cpu), decisions(&want), "the CPU arm decides otherwise than emu");
    assert_losses_close(&cpu, &want, 1e-4, "llama fp16: cpu vs emu");
    for (name, np, parallel) in [
        ("tp2spdp2z2", 4, "[parallel]\ntp = 2\nsequence_parallel = true\ndp = 2\nzero = 2"),
        ("pp2dp2", 4, "[parallel]\npp = 2\ndp = 2\nmicrobatches = 1"),
    ] {
        let (metrics, _) = run(d, name, np, parallel, &with(&["device=emu"]));
        let got = steps(&metrics);
        assert_eq!(decisions(&got), decisions(&want), "{name}: scales and skips differ from one rank's");
        assert_losses_close(&got, &want, 1e-4, name);
    }
}
