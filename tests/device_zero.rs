//! The device model's optimizer state sharded on its device (ZeRO 1 and 2,
//! `src/train/device_zero.rs`) and its parameters too (ZeRO-3, `src/model/device_gpt/shards.rs`)
//! through `meshtrain train` on the CPU device with bf16 numerics: data-parallel layouts follow
//! the single-rank bf16 trajectory within the tolerances of the bf16 ZeRO-0 layouts
//! (`tests/train_cli.rs`), and ZeRO-2 and ZeRO-3 runs resumed from their checkpoints continue bit
//! for bit. (That the sharded step is the host-mirror step's arithmetic bit for bit is a unit
//! test in `device_zero.rs`.)

mod common;

use std::path::Path;

use meshtrain::checkpoint::ExportedTensor;

/// What a run left: (step, loss) pairs and the final parameters (exported at global shapes).
struct Run {
    losses: Vec<(u64, f64)>,
    params: Vec<ExportedTensor>,
}

/// Trains `name` (`parallel` TOML lines) on `np` ranks with the `--set` overrides `sets`: the
/// tiny job in bf16 with buckets of 0.05 MiB (so tensors are cut across buckets and every bucket
/// into shards) and checkpoints every 10 steps into `dir/<name>_ckpt`.
fn run(dir: &Path, name: &str, np: usize, parallel: &str, sets: &[String]) -> Run {
    let metrics = dir.join(format!("{name}.jsonl"));
    let ckpt = dir.join(format!("{name}_ckpt"));
    let job = common::tiny_job(dir, &format!("{name}.toml"), &format!("[parallel]\nbucket_mb = 0.05\n{parallel}"));
    let mut all = vec!["precision=bf16".to_string(), "checkpoint.every=10".into(), format!("checkpoint.dir={:?}", ckpt.display().to_string())];
    all.extend_from_slice(sets);
    common::train(np, &job, &metrics, &all);
    let params = common::export(&ckpt.join("step_00000020"), &dir.join(format!("{name}.h5")));
    Run { losses: common::losses(&metrics), params }
}

/// Largest relative loss difference of `got` from `want` over the steps both ran.
fn max_loss_diff(got: &Run, want: &Run) -> f64 {
    assert_eq!(got.losses.len(), want.losses.len(), "step counts differ");
    got.losses.iter().zip(&want.losses).map(|(g, w)| (g.1 - w.1).abs() / w.1.abs()).fold(0.0, f64::max)
}

/// Whole-model relative L2 distance of `got`'s parameters from `want`'s.
fn params_rel_l2(got: &Run, want: &Run) -> f64 {
    let (mut diff, mut norm) = (0f64, 0f64);
    for (a, b) in got.params.iter().zip(&want.params).filter(|(a, _)| a.0.starts_with("model/")) {
        diff += a.2.iter().zip(&b.2).map(|(x, y)| f64::from(x - y).powi(2)).sum::<f64>();
        norm += b.2.iter().map(|y| f64::from(*y).powi(2)).sum::<f64>();
    }
    (diff / norm).sqrt()
}

/// DP2 at ZeRO 1, 2 and 3 (two micro-batches per rank, so ZeRO-2/3 reduce and accumulate twice
/// per step; ZeRO-3 gathers every unit's parameters from the shards before each use), TP2 x DP2 at
/// ZeRO 2 and 3 (the norm counts a TP-replicated tensor once, shard by shard) and PP2 x DP2 at
/// ZeRO 3 (each stage gathers its own units; one reduction per pipeline round) follow the single-rank bf16 run with four micro-batches: losses within 1e-4 and final
/// parameters within 1e-2 (the bounds of the bf16 ZeRO-0 layouts, for the same reason: a
/// different f32 summation order can move an activation to the neighbouring bf16 value, and AdamW
/// turns rounding in near-zero gradients into steps of ~lr). ZeRO 1 and 0 on the same ranks
/// differ only in how the norm's squares add up; ZeRO-2 also in the per-micro-batch averages.
#[test]
fn sharded_device_steps_follow_the_single_rank_trajectory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let accum = |k: usize| vec![format!("train.grad_accum={k}")];
    let single = run(d, "single", 1, "", &accum(4));
    let z0 = run(d, "dp2z0", 2, "dp = 2", &accum(2));
    let layouts = [
        ("dp2z1", 2, "dp = 2\nzero = 1", 2),
        ("dp2z2", 2, "dp = 2\nzero = 2", 2),
        ("tp2dp2z2", 4, "tp = 2\ndp = 2\nzero = 2", 2),
        ("dp2z3", 2, "dp = 2\nzero = 3", 2),
        ("tp2dp2z3", 4, "tp = 2\ndp = 2\nzero = 3", 2),
        ("pp2dp2z3", 4, "pp = 2\ndp = 2\nzero = 3\nmicrobatches = 2", 1),
    ];
    for (name, np, parallel, k) in layouts {
        let got = run(d, name, np, parallel, &accum(k));
        let (loss, params) = (max_loss_diff(&got, &single), params_rel_l2(&got, &single));
        eprintln!("{name} vs single rank: losses {loss:.2e}, parameters {params:.2e}; vs DP2 ZeRO 0: losses {:.2e}, parameters {:.2e}", max_loss_diff(&got, &z0), params_rel_l2(&got, &z0));
        assert!(loss <= 1e-4, "{name}: losses differ by {loss:e} from the single rank");
        common::assert_params_close(&got.params, &single.params, 1e-2, name);
    }
}

/// DP2 at ZeRO 2 and 3 (two micro-batches per rank), resumed from the step-10 checkpoint: the
/// master weights and moments went to the checkpoint from the device shards (ZeRO-3: each rank
/// writes its owned blocks) and come back into them, so the losses and the final parameters are
/// the uninterrupted run's, bit for bit.
#[test]
fn zero2_and_zero3_device_checkpoints_resume_bitwise() {
    for zero in [2, 3] {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let parallel = format!("dp = 2\nzero = {zero}");
        let sets = vec!["train.grad_accum=2".to_string()];
        let full = run(d, "full", 2, &parallel, &sets);
        let ckpt = d.join("full_ckpt/step_00000010");
        let resumed_sets = [sets[0].clone(), format!("checkpoint.resume={:?}", ckpt.display().to_string())];
        let resumed = run(d, "resumed", 2, &parallel, &resumed_sets);
        assert_eq!(resumed.losses.len(), 10);
        for (g, w) in resumed.losses.iter().zip(&full.losses[10..]) {
            assert_eq!((g.0, g.1.to_bits()), (w.0, w.1.to_bits()), "ZeRO {zero} step {}: {} vs {}", g.0, g.1, w.1);
        }
        for (a, b) in resumed.params.iter().zip(&full.params) {
            assert_eq!(a.0, b.0);
            assert!(a.2.iter().zip(&b.2).all(|(x, y)| x.to_bits() == y.to_bits()), "ZeRO {zero}: {} differs", a.0);
        }
    }
}

/// Device memory (the emu arm): gradient buckets reduced on a communication thread during the
/// backward (`MESHTRAIN_GPU_OVERLAP`, on by default) give the bits of the reduction after the
/// backward on the compute thread, at ZeRO 0 to 3, with gradient accumulation, buckets that
/// outnumber the staging pool, and a pipeline whose stages hand their whole buffer over after
/// each round: same losses and same final parameters, bit for bit. The emu kernels run on one
/// host thread: the embedding backward adds into `wte` with atomics, whose order (and so the
/// last bits of a few `wte` gradients) varies run to run when blocks run in parallel, as on a GPU.
#[test]
fn device_memory_overlap_gives_the_bits_of_the_reduction_after_the_backward() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("z0", 2, "dp = 2\nzero = 0"),
        ("z1", 2, "dp = 2\nzero = 1"),
        ("z3", 2, "dp = 2\nzero = 3"),
        ("pp2z2", 4, "dp = 2\npp = 2\nmicrobatches = 2\nzero = 2"),
    ];
    for (name, np, parallel) in cases {
        let mut runs = Vec::new();
        for overlap in ["on", "off"] {
            let tag = format!("{name}_{overlap}");
            let metrics = dir.path().join(format!("{tag}.jsonl"));
            let ckpt = dir.path().join(format!("{tag}_ckpt"));
            // Buckets of 0.02 MiB: about 25 of them, more than the reducer's staging pool.
            let job = common::tiny_job(dir.path(), &format!("{tag}.toml"), &format!("[parallel]\nbucket_mb = 0.02\n{parallel}"));
            let sets = [
                "device=emu".to_string(),
                "precision=bf16".into(),
                "model.n_layer=2".into(),
                "train.steps=2".into(),
                "train.grad_accum=2".into(),
                "checkpoint.every=2".into(),
                format!("checkpoint.dir={:?}", ckpt.display().to_string()),
            ];
            let out = common::train_env(np, &job, &metrics, &sets, &[("MESHTRAIN_GPU_OVERLAP", overlap), ("MESHTRAIN_EMU_THREADS", "1")]);
            let said = match overlap {
                "on" => "on a communication thread during the backward",
                _ => "after the backward",
            };
            assert!(out.stderr.contains(said), "{tag}: the log does not say the reduction ran {said}:\n{}", out.stderr);
            let params = common::export(&ckpt.join("step_00000002"), &dir.path().join(format!("{tag}.h5")));
            runs.push((common::losses(&metrics), params));
        }
        let (on, off) = (&runs[0], &runs[1]);
        let bits = |l: &[(u64, f64)]| l.iter().map(|(s, x)| (*s, x.to_bits())).collect::<Vec<_>>();
        assert_eq!(bits(&on.0), bits(&off.0), "{name}: losses differ with the overlap on");
        assert_eq!(on.1.len(), off.1.len());
        for ((na, _, a), (nb, _, b)) in on.1.iter().zip(&off.1) {
            assert_eq!(na, nb);
            let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{name}: `{na}` differs with the overlap on");
        }
    }
}

/// Activation recomputation on device memory (the emu arm, bf16, TP 2 with sequence parallelism
/// and ZeRO-2 over two data-parallel ranks): `selective` and `full` give the losses and final
/// parameters of keeping every activation, bit for bit (the emu kernels on one host thread, as
/// above).
#[test]
fn device_recomputation_gives_the_bits_of_keeping_every_activation() {
    let dir = tempfile::tempdir().unwrap();
    let job = common::tiny_job(dir.path(), "rc.toml", "[parallel]\ntp = 2\nsequence_parallel = true\ndp = 2\nzero = 2");
    let mut runs = Vec::new();
    for mode in ["none", "selective", "full"] {
        let metrics = dir.path().join(format!("{mode}.jsonl"));
        let ckpt = dir.path().join(format!("{mode}_ckpt"));
        let sets = [
            "device=emu".to_string(),
            "precision=bf16".into(),
            "model.n_layer=2".into(),
            "train.steps=2".into(),
            format!("train.recompute={mode:?}"),
            "checkpoint.every=2".into(),
            format!("checkpoint.dir={:?}", ckpt.display().to_string()),
        ];
        common::train_env(4, &job, &metrics, &sets, &[("MESHTRAIN_EMU_THREADS", "1")]);
        let params = common::export(&ckpt.join("step_00000002"), &dir.path().join(format!("{mode}.h5")));
        runs.push((mode, common::losses(&metrics), params));
    }
    let bits = |l: &[(u64, f64)]| l.iter().map(|(s, x)| (*s, x.to_bits())).collect::<Vec<_>>();
    let keep = &runs[0];
    for (mode, losses, params) in &runs[1..] {
        assert_eq!(bits(losses), bits(&keep.1), "{mode}: losses differ");
        for ((na, _, a), (nb, _, b)) in params.iter().zip(&keep.2) {
            assert_eq!(na, nb);
            assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "{mode}: `{na}` differs");
        }
    }
}
