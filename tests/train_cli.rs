//! `meshtrain train` end to end with real rank processes: bad configs are rejected before any
//! work, runs are deterministic, and every parallel layout (DP with ZeRO 0-3, TP, SP, PP and their
//! combinations) follows the single-rank trajectory: losses at every step and final parameters.

mod common;

use std::path::Path;
use std::process::Command;

use common::tiny_job as job;



fn losses(metrics: &Path) -> Vec<f64> {
    common::losses(metrics).into_iter().map(|(_, l)| l).collect()
}

/// What a 20-step run ends with: its losses and its final parameters (from the checkpoint it
/// writes at step 20, exported at global shapes, so that any layout compares with any other).
struct Trajectory {
    losses: Vec<f64>,
    params: Vec<meshtrain::checkpoint::ExportedTensor>,
}

/// Runs `job` on `np` ranks under `name` (its metrics and checkpoint live in `dir`).
fn trajectory(dir: &Path, name: &str, np: usize, job: &Path, sets: &[String]) -> Trajectory {
    trajectory_of(dir, name, np, job, sets, 20)
}

/// [`trajectory`] of a run of `steps` steps.
fn trajectory_of(dir: &Path, name: &str, np: usize, job: &Path, sets: &[String], steps: u64) -> Trajectory {
    let metrics = dir.join(format!("{name}.jsonl"));
    let ckpt = dir.join(format!("{name}_ckpt"));
    let mut all = vec![
        format!("train.steps={steps}"),
        format!("checkpoint.every={steps}"),
        format!("checkpoint.dir={:?}", ckpt.display().to_string()),
    ];
    all.extend_from_slice(sets);
    common::train(np, job, &metrics, &all);
    let params = common::export(&ckpt.join(meshtrain::checkpoint::step_dir_name(steps)), &dir.join(format!("{name}.h5")));
    Trajectory { losses: losses(&metrics), params }
}

/// Losses within 1e-5 relative at every step, final parameters within 1e-5 of each tensor's scale.
fn assert_follows(got: &Trajectory, want: &Trajectory, what: &str) {
    assert_follows_within(got, want, (1e-5, 1e-5), what);
}

/// [`assert_follows`] with tolerances (losses, parameters).
fn assert_follows_within(got: &Trajectory, want: &Trajectory, (loss_rel, param_rel): (f64, f64), what: &str) {
    assert_close(&got.losses, &want.losses, loss_rel, what);
    common::assert_params_close(&got.params, &want.params, param_rel, what);
}

fn assert_close(a: &[f64], b: &[f64], rel: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: step counts differ");
    let mut worst = 0f64;
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= rel * y.abs(), "{what}: step {} loss {x} vs single-rank {y}", i + 1);
        worst = worst.max((x - y).abs() / y.abs());
    }
    // What was measured, for the notes (shown with --nocapture).
    eprintln!("{what}: losses within {worst:.2e} relative");
}

#[test]
fn bad_configs_are_rejected_with_the_key_and_exit_code_2() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("unknown.toml", "[train2]\nfoo = 1", "train2"),
        ("typo.toml", "[metrics]\npeak_flops = 1.0", "metrics.peak_flops"),
        ("zero.toml", "", "train.steps"),
    ];
    for (name, extra, key) in cases {
        let path = job(dir.path(), name, extra);
        let mut cmd = Command::new(common::meshtrain());
        cmd.arg("train").arg(&path);
        if name == "zero.toml" {
            cmd.args(["--set", "train.steps=0"]);
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {err}");
        assert!(err.contains(key), "{name}: error does not name `{key}`: {err}");
    }
}

/// `train.threads` wins over `OMP_NUM_THREADS`, which wins over `OPENBLAS_NUM_THREADS`; the
/// choice is logged once; a bad key or variable is refused naming it.
#[test]
fn cpu_threads_come_from_the_key_then_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let path = job(dir.path(), "threads.toml", "");
    let run = |env: &[(&str, &str)], sets: &[&str]| {
        let mut cmd = Command::new(common::meshtrain());
        cmd.arg("train").arg(&path).args(["--set", "train.steps=2"]);
        cmd.env_remove("OMP_NUM_THREADS").env_remove("OPENBLAS_NUM_THREADS");
        for s in sets {
            cmd.args(["--set", s]);
        }
        let out = cmd.envs(env.iter().copied()).output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let logged = |err: &str| {
        let lines: Vec<&str> = err.lines().filter(|l| l.contains("CPU threads per rank")).collect();
        assert_eq!(lines.len(), 1, "logged once: {err}");
        lines[0].split("(BLAS and layers): ").nth(1).unwrap_or("").to_string()
    };
    let (code, err) = run(&[("OMP_NUM_THREADS", "2"), ("OPENBLAS_NUM_THREADS", "3")], &["train.threads=1"]);
    assert_eq!((code, logged(&err)), (Some(0), "1 (train.threads)".to_string()), "{err}");
    let (code, err) = run(&[("OMP_NUM_THREADS", "1"), ("OPENBLAS_NUM_THREADS", "3")], &[]);
    assert_eq!((code, logged(&err)), (Some(0), "1 (OMP_NUM_THREADS)".to_string()), "{err}");
    let (code, err) = run(&[("OPENBLAS_NUM_THREADS", "1")], &[]);
    assert_eq!((code, logged(&err)), (Some(0), "1 (OPENBLAS_NUM_THREADS)".to_string()), "{err}");
    let (code, err) = run(&[], &[]);
    assert!(code == Some(0) && logged(&err).contains("(automatic"), "{err}");
    let (code, err) = run(&[], &["train.threads=100000"]);
    assert!(code == Some(2) && err.contains("train.threads"), "{code:?}: {err}");
    let (code, err) = run(&[("OMP_NUM_THREADS", "lots")], &[]);
    assert!(code != Some(0) && err.contains("OMP_NUM_THREADS") && err.contains("lots"), "{code:?}: {err}");
}

#[test]
fn same_seed_gives_bitwise_identical_losses() {
    let dir = tempfile::tempdir().unwrap();
    let path = job(dir.path(), "det.toml", "[parallel]\ndp = 2");
    let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    common::train(2, &path, &a, &[]);
    common::train(2, &path, &b, &[]);
    let (la, lb) = (losses(&a), losses(&b));
    assert_eq!(la.len(), 20);
    assert!(la.iter().zip(&lb).all(|(x, y)| x.to_bits() == y.to_bits()), "{la:?}\n{lb:?}");
    assert!(la[19] < la[0] - 0.5, "loss did not fall: {la:?}");
}

#[test]
fn data_parallel_follows_the_single_rank_trajectory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Single rank: grad_accum = 4 micro-batches see the same windows as 4 ranks x 1 or 2 ranks x 2.
    let single = job(d, "single.toml", "");
    let want = trajectory(d, "ref", 1, &single, &["train.grad_accum=4".into()]);
    // 0.05 MiB buckets: the tiny model's gradients travel in about 10 overlapped buckets.
    for (np, accum, zero) in [(2, 2, 0), (4, 1, 1), (2, 2, 1), (4, 1, 2), (4, 1, 3), (2, 2, 3)] {
        let parallel = format!("[parallel]\ndp = {np}\nzero = {zero}\nbucket_mb = 0.05");
        let name = format!("dp{np}z{zero}a{accum}");
        let path = job(d, &format!("{name}.toml"), &parallel);
        let got = trajectory(d, &name, np, &path, &[format!("train.grad_accum={accum}")]);
        assert_follows(&got, &want, &name);
    }
}

#[test]
fn tensor_parallel_layouts_follow_the_single_rank_trajectory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let single = job(d, "single.toml", "");
    let mut reference = std::collections::HashMap::new();
    for accum in [1, 2] {
        reference.insert(accum, trajectory(d, &format!("ref{accum}"), 1, &single, &[format!("train.grad_accum={accum}")]));
    }
    // (tp, dp, zero, sequence parallel): world = tp * dp; the reference accumulates dp micro-batches.
    let layouts = [(2, 1, 0, false), (4, 1, 0, false), (2, 1, 0, true), (2, 2, 1, false), (2, 2, 3, false), (2, 2, 2, true)];
    for (tp, dp, zero, sp) in layouts {
        let name = format!("tp{tp}dp{dp}z{zero}sp{sp}");
        let parallel = format!("[parallel]\ntp = {tp}\ndp = {dp}\nzero = {zero}\nsequence_parallel = {sp}\nbucket_mb = 0.02");
        let path = job(d, &format!("{name}.toml"), &parallel);
        let got = trajectory(d, &name, tp * dp, &path, &[]);
        assert_follows(&got, &reference[&dp], &name);
    }
}

#[test]
fn shipped_jobs_parse_and_validate() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("jobs");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        let path = e.path();
        if path.extension().is_some_and(|x| x == "toml") {
            let cfg = meshtrain::config::JobConfig::load(&path, &[]);
            assert!(cfg.is_ok(), "{}: {:?}", path.display(), cfg.err());
            n += 1;
        }
    }
    assert!(n >= 2, "expected the demo and d12 jobs in {}", dir.display());
}

#[test]
fn pipeline_layouts_follow_the_single_rank_trajectory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Four layers (model.n_layer=4 on top of the tiny size) so that four stages each hold one.
    let single = job(d, "single.toml", "");
    let want = trajectory(d, "ref", 1, &single, &["train.grad_accum=4".into(), "model.n_layer=4".into()]);
    // (tp, pp, dp, zero, schedule, microbatches, grad_accum): tp*pp*dp ranks, dp*m*accum = 4.
    let layouts = [
        (1, 2, 1, 0, "gpipe", 4, 1),
        (1, 2, 1, 0, "1f1b", 2, 2),
        (1, 4, 1, 0, "1f1b", 4, 1),
        (2, 2, 1, 0, "1f1b", 4, 1),
        (1, 2, 2, 1, "1f1b", 2, 1),
        (1, 2, 2, 3, "gpipe", 1, 2),
        (2, 2, 2, 1, "1f1b", 2, 1),
        (2, 2, 2, 3, "1f1b", 2, 1),
    ];
    check_pipeline_layouts(d, "", &want, &layouts, &["model.n_layer=4".into()], (1e-5, 1e-5));
}

/// A pipeline layout: (tp, pp, dp, zero, schedule, microbatches, grad_accum).
type PipelineLayout = (usize, usize, usize, u8, &'static str, usize, usize);

/// Runs `meshtrain train` in every layout (interleaved: two chunks per rank) with `sets` and
/// checks that it follows `want` within `tol` (losses, parameters).
fn check_pipeline_layouts(d: &Path, prefix: &str, want: &Trajectory, layouts: &[PipelineLayout], sets: &[String], tol: (f64, f64)) {
    for &(tp, pp, dp, zero, schedule, m, accum) in layouts {
        let name = format!("{prefix}tp{tp}pp{pp}dp{dp}z{zero}{schedule}m{m}");
        let mut parallel = format!(
            "[parallel]\ntp = {tp}\npp = {pp}\ndp = {dp}\nzero = {zero}\nschedule = \"{schedule}\"\nmicrobatches = {m}"
        );
        if schedule == "interleaved" {
            parallel.push_str("\nvirtual_stages = 2");
        }
        let path = job(d, &format!("{name}.toml"), &parallel);
        let mut all = vec![format!("train.grad_accum={accum}")];
        all.extend_from_slice(sets);
        let got = trajectory(d, &name, tp * pp * dp, &path, &all);
        assert_follows_within(&got, want, tol, &name);
    }
}

/// Interleaved 1F1B (two model chunks per pipeline rank) follows the single-rank run of an
/// eight-block model (eight stages for PP4) like every other layout: losses within 1e-5, final
/// parameters within 1e-5 over the model (with eight blocks the largest single-tensor drift, on
/// `h.6.attn.proj.weight`, is 1.5e-5 for every layout that reorders the sums, data parallelism
/// and contiguous 1F1B included: inside the per-tensor slack of `assert_params_close`), while a
/// missing gradient term, a wrong chunk order or an unsynchronized tied embedding is far outside.
#[test]
fn interleaved_pipelines_follow_the_single_rank_trajectory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let blocks = "model.n_layer=8".to_string();
    let single = job(d, "single.toml", "");
    let want = trajectory(d, "ref", 1, &single, &["train.grad_accum=4".into(), blocks.clone()]);
    // (tp, pp, dp, zero, microbatches, grad_accum, stage_layers): dp * m * accum = 4 micro-batches
    // per step; the explicit split gives the chunks of each rank different depths; ZeRO-3 gathers
    // each chunk's blocks on its own.
    let layouts = [
        (1, 2, 1, 0, 4, 1, ""),
        (1, 4, 1, 0, 4, 1, ""),
        (2, 2, 1, 0, 2, 2, ""),
        (1, 2, 1, 0, 2, 2, "[3, 2, 1, 2]"),
        (1, 2, 2, 3, 2, 1, ""),
    ];
    for (tp, pp, dp, zero, m, accum, split) in layouts {
        let name = format!("tp{tp}pp{pp}dp{dp}z{zero}m{m}{}", if split.is_empty() { "" } else { "split" });
        let mut parallel = format!("[parallel]\ntp = {tp}\npp = {pp}\ndp = {dp}\nzero = {zero}\n");
        parallel.push_str(&format!("microbatches = {m}\nschedule = \"interleaved\"\nvirtual_stages = 2"));
        if !split.is_empty() {
            parallel.push_str(&format!("\nstage_layers = {split}"));
        }
        let path = job(d, &format!("{name}.toml"), &parallel);
        let sets = [format!("train.grad_accum={accum}"), blocks.clone()];
        let got = trajectory(d, &name, tp * pp * dp, &path, &sets);
        assert_follows(&got, &want, &name);
    }
}

#[test]
fn pipeline_layouts_that_cannot_run_are_rejected_before_start() {
    let dir = tempfile::tempdir().unwrap();
    let interleaved = "schedule = \"interleaved\"\nvirtual_stages = 2";
    // (pipeline keys besides pp = 2, model.n_layer, key the error names)
    let cases = [
        (format!("{interleaved}\nmicrobatches = 2"), 3, "parallel.virtual_stages"), // 3 blocks, 4 stages
        (format!("{interleaved}\nmicrobatches = 3"), 4, "parallel.microbatches"), // not a multiple of pp
        ("schedule = \"1f1b\"\nvirtual_stages = 2".into(), 4, "parallel.virtual_stages"),
        ("stage_layers = [4, 0]".into(), 4, "parallel.stage_layers"),
    ];
    for (i, (keys, n_layer, key)) in cases.into_iter().enumerate() {
        let path = job(dir.path(), &format!("bad{i}.toml"), &format!("[parallel]\npp = 2\n{keys}"));
        let mut cmd = Command::new(common::meshtrain());
        cmd.arg("train").arg(&path).args(["--set", &format!("model.n_layer={n_layer}")]);
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "case {i}: {err}");
        assert!(err.contains(key), "case {i}: error does not name `{key}`: {err}");
    }
}

/// The device model through `meshtrain train` on the CPU device (`precision = "bf16"`, the
/// numerics of GPU training): data parallel with ZeRO 0 and 1 follows its own single-rank
/// trajectory: losses within 1e-4 (the layouts differ in f32 summation order only, as fp32
/// layouts do, but an activation that moved by one f32 ulp can round to the neighbouring bf16
/// value, 2^-8 away, before a product, which fp32 runs never see: measured up to 1.2e-5) and
/// final parameters within 1e-2 (AdamW's normalised update turns such a difference in a
/// near-zero gradient component into a step of ~lr of either sign: measured 1.7e-3 on a
/// 64-element bias after 20 steps; a wrong reduction moves the losses by far more), and
/// the bf16 single rank tracks the fp32 reference within the bf16 rounding of matrix-product
/// inputs (relative 2^-9 per element; measured drift over 20 AdamW steps ~1e-3, bound 1e-2).
#[test]
fn bf16_device_model_trains_data_parallel_and_tracks_fp32() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let single = job(d, "single.toml", "");
    let fp32 = trajectory(d, "fp32", 1, &single, &["train.grad_accum=4".into()]);
    let bf16 = trajectory(d, "bf16", 1, &single, &["train.grad_accum=4".into(), "precision=bf16".into()]);
    assert_close(&bf16.losses, &fp32.losses, 1e-2, "bf16 vs fp32");
    let differs = bf16.losses.iter().zip(&fp32.losses).any(|(a, b)| a != b);
    assert!(differs, "bf16 left no trace on the losses: did it run in fp32?");
    // ZeRO 1 on one rank steps on its device shards (one rank: the whole model, bucket by
    // bucket), ZeRO 0 on the flat device buffers: the same arithmetic up to the order in which
    // the gradient norm adds up.
    let host_step = trajectory(d, "bf16_host", 1, &single, &["train.grad_accum=4".into(), "precision=bf16".into(), "parallel.zero=1".into()]);
    assert_follows(&host_step, &bf16, "bf16 host step vs device step");
    for (np, accum, zero) in [(2, 2, 0), (4, 1, 1)] {
        let parallel = format!("[parallel]\ndp = {np}\nzero = {zero}");
        let name = format!("bf16_dp{np}z{zero}");
        let path = job(d, &format!("{name}.toml"), &parallel);
        let got = trajectory(d, &name, np, &path, &[format!("train.grad_accum={accum}"), "precision=bf16".into()]);
        assert_follows_within(&got, &bf16, (1e-4, 1e-2), &name);
    }
}

/// The device model tensor parallel (Megatron: column-parallel qkv and fc, row-parallel
/// projections summed over TP, vocab-parallel embedding and loss; with and without sequence
/// parallelism) through `meshtrain train` with `precision = "bf16"` on the CPU arm: TP 2, TP 4 and
/// TP 2 x DP 2 with the device step (ZeRO 0: the norm's squares summed over TP, replicated tensors
/// counted once) and TP 2 with the sharded device step (ZeRO 1) follow the bf16 single-rank trajectory within the
/// tolerances of the bf16 data-parallel layouts
/// above (losses 1e-4, parameters 1e-2), for the same reason: the shards' products sum over
/// fewer columns and the partial sums are added over TP, a different f32 order, and an
/// activation one ulp away can round to the neighbouring bf16 value before the next product.
/// Measured: losses within 1.5e-5, the model within 3.1e-4, the furthest tensor (a qkv bias)
/// 4.2e-3 relative L2. A
/// missing TP sum, a bias added tp times or a wrong vocabulary shard moves the first losses by
/// far more than 1e-4.
#[test]
fn bf16_device_model_trains_tensor_parallel() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let single = job(d, "single.toml", "");
    let bf16 = trajectory(d, "bf16", 1, &single, &["train.grad_accum=4".into(), "precision=bf16".into()]);
    let layouts = [(2, 1, 0, 4, false), (4, 1, 0, 4, false), (2, 2, 0, 2, false), (2, 1, 1, 4, false), (2, 1, 0, 4, true), (4, 1, 0, 4, true), (2, 2, 0, 2, true)];
    for (tp, dp, zero, accum, sp) in layouts {
        let name = format!("bf16_tp{tp}dp{dp}z{zero}{}", if sp { "sp" } else { "" });
        let keys = format!("[parallel]\ntp = {tp}\ndp = {dp}\nzero = {zero}\nsequence_parallel = {sp}");
        let path = job(d, &format!("{name}.toml"), &keys);
        let got = trajectory(d, &name, tp * dp, &path, &[format!("train.grad_accum={accum}"), "precision=bf16".into()]);
        assert_follows_within(&got, &bf16, (1e-4, 1e-2), &name);
    }
}

/// The device model pipelined (GPipe, 1F1B, interleaved; alone, with TP 2 and with DP 2 on the
/// device step and the host-mirror ZeRO-1 step) through `meshtrain train` with
/// `precision = "bf16"` on the CPU arm, on a four-block model: every layout follows the bf16
/// single-rank trajectory within the tolerances of the bf16 data- and tensor-parallel layouts
/// (losses 1e-4, parameters 1e-2, for the same reason: stages sum the same products in another
/// f32 order only where TP or DP does, and the tied embedding's two gradient halves are added
/// between the first and the last stage). A lost micro-batch, a stage run on the wrong hidden
/// state or an unsynchronised tied embedding moves the losses by far more.
#[test]
fn bf16_device_model_trains_pipeline_parallel() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sets = ["precision=bf16".to_string(), "model.n_layer=4".to_string()];
    let single = job(d, "single.toml", "");
    let bf16 = trajectory(d, "bf16", 1, &single, &[&["train.grad_accum=4".to_string()][..], &sets].concat());
    // dp * m * accum = 4 micro-batches per step.
    let layouts = [
        (1, 2, 1, 0, "gpipe", 4, 1),
        (1, 2, 1, 0, "1f1b", 2, 2),
        (1, 2, 1, 0, "interleaved", 2, 2),
        (2, 2, 1, 0, "1f1b", 4, 1),
        (1, 2, 2, 0, "1f1b", 2, 1),
        (1, 2, 2, 1, "interleaved", 2, 1),
        (1, 2, 2, 2, "1f1b", 2, 1),
    ];
    check_pipeline_layouts(d, "bf16_", &bf16, &layouts, &sets, (1e-4, 1e-2));
    // Sequence parallel stages exchange their held rows.
    let sp = [&sets[..], &["parallel.sequence_parallel=true".to_string()]].concat();
    check_pipeline_layouts(d, "bf16_sp_", &bf16, &[(2, 2, 1, 0, "1f1b", 4, 1)], &sp, (1e-4, 1e-2));
}

/// A device job on a machine without that device (or a binary without its backend) exits with a
/// clear error, never a panic. (Every parallel layout runs on the device model: nothing else is
/// rejected.)
#[test]
fn device_jobs_without_the_device_are_clean_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mut cases: Vec<(&[&str], &str)> = Vec::new();
    if !meshtrain::device::cuda_driver_available() {
        cases.push((&["device=cuda", "parallel.zero=3"], "no CUDA driver"));
    }
    if !cfg!(feature = "hip") {
        cases.push((&["device=hip"], "HIP support is not compiled"));
    }
    if cases.is_empty() {
        eprintln!("skipped: this machine has a CUDA driver and the binary has HIP support");
    }
    for (sets, needle) in cases {
        let path = job(dir.path(), "gpu.toml", "");
        let out = Command::new(common::meshtrain())
            .args(["train"])
            .arg(&path)
            .args(sets.iter().flat_map(|s| ["--set", s]))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{sets:?}: a GPU job without a GPU succeeded");
        assert!(err.contains(needle), "{sets:?}: error does not mention `{needle}`: {err}");
        assert!(!err.contains("panicked"), "{sets:?}: {err}");
    }
}

/// `train.recompute`: the attention core (`selective`) or every block (`full`) recomputed in the
/// backward gives the losses and final parameters of keeping every activation, bit for bit, here
/// on a two-stage 1F1B pipeline with four micro-batches in flight and on TP 2 with sequence
/// parallelism; hardware FLOPs grow by the recomputed work while model FLOPs stay; a bad mode is
/// refused naming the key.
#[test]
fn recomputation_changes_no_bit_of_training() {
    let dir = tempfile::tempdir().unwrap();
    let path = job(dir.path(), "recompute.toml", "");
    let layouts: [(&str, &[&str]); 2] = [
        ("pp2", &["parallel.pp=2", "parallel.schedule=\"1f1b\"", "parallel.microbatches=4"]),
        ("tp2sp", &["parallel.tp=2", "parallel.sequence_parallel=true"]),
    ];
    for (name, layout) in layouts {
        let run = |mode: &str| {
            let mut sets: Vec<String> = layout.iter().map(|s| s.to_string()).collect();
            sets.push(format!("train.recompute=\"{mode}\""));
            trajectory(dir.path(), &format!("{name}_{mode}"), 2, &path, &sets)
        };
        let keep = run("none");
        for mode in ["selective", "full"] {
            let got = run(mode);
            let bits = |l: &[f64]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got.losses), bits(&keep.losses), "{name} {mode}: losses differ");
            for (a, b) in got.params.iter().zip(&keep.params) {
                assert!(a.0 == b.0 && a.2.iter().zip(&b.2).all(|(x, y)| x.to_bits() == y.to_bits()), "{name} {mode}: {} differs", a.0);
            }
        }
    }
    // Hardware FLOPs: full recomputation adds every block's forward, model FLOPs stay.
    let line = |name: &str| -> serde_json::Value {
        let text = std::fs::read_to_string(dir.path().join(format!("{name}.jsonl"))).unwrap();
        serde_json::from_str(text.lines().last().unwrap()).unwrap()
    };
    let ratio = |name: &str| {
        let v = line(name);
        v["hardware_tflops"].as_f64().unwrap() / v["model_tflops"].as_f64().unwrap()
    };
    let (keep, selective, full) = (ratio("pp2_none"), ratio("pp2_selective"), ratio("pp2_full"));
    assert!(keep == 1.0 && 1.0 < selective && selective < full && full < 4.0 / 3.0, "{keep} {selective} {full}");
    let out = Command::new(common::meshtrain()).arg("train").arg(&path).args(["--set", "train.recompute=\"sometimes\""]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(2) && err.contains("train.recompute"), "{err}");
}

/// Llama (`llama-tiny` with four blocks: 4 query heads on 2 KV heads, SwiGLU, RoPE, untied head)
/// follows its single-rank trajectory over 50 steps in every kind of layout: DP 2 with ZeRO 0-3,
/// TP 2 (KV heads split) with and without SP, TP 4 (fewer KV heads than ranks: each KV head
/// shared by two ranks, its gradient summed over them), PP 2 with 1F1B and interleaved, and
/// TP 2 x PP 2 x DP 2 with ZeRO 1: losses within 1e-5 relative at every step, final parameters
/// within 1e-5 of each tensor's scale.
#[test]
fn llama_layouts_follow_the_single_rank_trajectory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let single = job(d, "single.toml", "");
    let llama = ["model.size=\"llama-tiny\"".to_string(), "model.n_layer=4".into()];
    let with = |accum: usize| [&llama[..], &[format!("train.grad_accum={accum}")]].concat();
    let mut reference = std::collections::HashMap::new();
    for accum in [1, 2, 4] {
        reference.insert(accum, trajectory_of(d, &format!("llama_ref{accum}"), 1, &single, &with(accum), 50));
    }
    // (tp, pp, dp, zero, sp, schedule, microbatches): the reference accumulates dp * microbatches.
    let layouts: [(usize, usize, usize, u8, bool, &str, usize); 11] = [
        (1, 1, 2, 0, false, "1f1b", 1),
        (1, 1, 2, 1, false, "1f1b", 1),
        (1, 1, 2, 2, false, "1f1b", 1),
        (1, 1, 2, 3, false, "1f1b", 1),
        (2, 1, 1, 0, false, "1f1b", 1),
        (2, 1, 1, 0, true, "1f1b", 1),
        (4, 1, 1, 0, false, "1f1b", 1),
        (4, 1, 1, 0, true, "1f1b", 1),
        (1, 2, 1, 0, false, "1f1b", 4),
        (1, 2, 1, 0, false, "interleaved", 4),
        (2, 2, 2, 1, false, "1f1b", 2),
    ];
    for (tp, pp, dp, zero, sp, schedule, m) in layouts {
        let name = format!("llama_tp{tp}pp{pp}dp{dp}z{zero}sp{sp}{schedule}");
        let mut parallel = format!(
            "[parallel]\ntp = {tp}\npp = {pp}\ndp = {dp}\nzero = {zero}\nsequence_parallel = {sp}\nschedule = \"{schedule}\"\nmicrobatches = {m}\nbucket_mb = 0.05"
        );
        if schedule == "interleaved" {
            parallel.push_str("\nvirtual_stages = 2");
        }
        let path = job(d, &format!("{name}.toml"), &parallel);
        let got = trajectory_of(d, &name, tp * pp * dp, &path, &llama, 50);
        assert_follows(&got, &reference[&(dp * m)], &name);
    }
}


/// Llama with tied embeddings (`model.tie_embeddings = true`: the head reads the embedding
/// table, whose gradient sums both uses) follows its single-rank trajectory where the tie crosses
/// ranks: the vocabulary split over TP, the embedding and the head on different pipeline stages,
/// and the tied table sharded by ZeRO.
#[test]
fn tied_llama_layouts_follow_the_single_rank_trajectory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let single = job(d, "single.toml", "");
    let llama = ["model.size=\"llama-tiny\"".to_string(), "model.n_layer=4".into(), "model.tie_embeddings=true".into()];
    let with = |accum: usize| [&llama[..], &[format!("train.grad_accum={accum}")]].concat();
    let reference2 = trajectory_of(d, "tied_ref2", 1, &single, &with(2), 30);
    assert!(reference2.params.iter().all(|t| t.0 != "model/lm_head.weight"), "a tied model has no head tensor");
    // (tp, pp, dp, zero, sp): the reference accumulates 2 micro-batches.
    for (tp, pp, dp, zero, sp) in [(1, 1, 2, 3, false), (2, 1, 1, 0, true), (1, 2, 1, 0, false), (2, 2, 2, 1, false)] {
        let m = 2 / dp;
        let name = format!("tied_tp{tp}pp{pp}dp{dp}z{zero}sp{sp}");
        let parallel = format!(
            "[parallel]\ntp = {tp}\npp = {pp}\ndp = {dp}\nzero = {zero}\nsequence_parallel = {sp}\nmicrobatches = {m}\nbucket_mb = 0.05"
        );
        let path = job(d, &format!("{name}.toml"), &parallel);
        let got = trajectory_of(d, &name, tp * pp * dp, &path, &llama, 30);
        assert_follows(&got, &reference2, &name);
    }
}

/// A Llama checkpoint never loads into a GPT-2 job (nor the reverse): `init_from` with the
/// other architecture's weights is refused naming `model.arch`, before any step.
#[test]
fn weights_of_another_arch_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let path = job(d, "arch.toml", "");
    let llama = trajectory_of(d, "llama", 1, &path, &["model.size=\"llama-tiny\"".into()], 2);
    assert!(llama.params.iter().any(|t| t.0 == "model/lm_head.weight"));
    for (weights, sets) in [("llama.h5", vec![]), ("gpt2.h5", vec!["--set", "model.size=\"llama-tiny\""])] {
        if weights == "gpt2.h5" {
            trajectory_of(d, "gpt2", 1, &path, &[], 2);
        }
        let mut cmd = Command::new(common::meshtrain());
        cmd.arg("train").arg(&path).args(["--set", &format!("init_from={:?}", d.join(weights).display().to_string())]).args(&sets);
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("model.arch") && err.contains(weights), "{weights}: {err}");
    }
}
