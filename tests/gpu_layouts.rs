//! The device model's parallel layouts on a real GPU (ignored elsewhere): `meshtrain train` with
//! `device = "cuda"` on ranks that share the GPU, against the same layout on the CPU arm
//! (`device = "cpu"`, `precision = "bf16"`, the numerics the CI tests check against the CPU
//! model). Run with
//!
//! `cargo test --release --test gpu_layouts -- --ignored gpu_ --test-threads=1 --nocapture`
//!
//! Tolerance: the arms differ in the order of f32 sums inside products and reductions, and an
//! activation an ulp away can round to the neighbouring bf16 value before the next product; one
//! step's gradients agree to 1e-3 (`tests/gpu_model.rs`), so 10 AdamW steps' losses are held to
//! 2e-3 relative (to be tightened once measured on a GPU). A TP sum lost or a shard misplaced on
//! the GPU path moves the losses by far more.

mod common;

use std::path::Path;

/// Losses of 10 steps of `parallel` on `np` ranks on `device`, and what the ranks printed.
fn run(dir: &Path, name: &str, np: usize, parallel: &str, device: &str) -> (Vec<f64>, String) {
    let job = common::tiny_job(dir, &format!("{name}.toml"), &format!("[parallel]\n{parallel}"));
    let metrics = dir.join(format!("{name}.jsonl"));
    let sets = [format!("device={device}"), "precision=bf16".into(), "train.steps=10".into(), "model.n_layer=4".into()];
    let out = common::train(np, &job, &metrics, &sets);
    (common::losses(&metrics).into_iter().map(|(_, l)| l).collect(), out.stderr)
}

/// One GPU, two ranks sharing it: TP2 with sequence parallelism, PP2 (1F1B), DP2 at ZeRO 0
/// (reduced over IPC) and at ZeRO 3 (parameters gathered unit by unit), and one rank alone.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_device_layouts_follow_the_cpu_arm() {
    let dir = tempfile::tempdir().unwrap();
    let layouts = [
        ("single", 1, ""),
        ("tp2sp", 2, "tp = 2\nsequence_parallel = true"),
        ("pp2", 2, "pp = 2\nschedule = \"1f1b\"\nmicrobatches = 2"),
        ("dp2z0", 2, "dp = 2"),
        ("dp2z3", 2, "dp = 2\nzero = 3"),
    ];
    for (name, np, parallel) in layouts {
        let (gpu, log) = run(dir.path(), &format!("{name}_gpu"), np, parallel, "cuda");
        let (cpu, _) = run(dir.path(), &format!("{name}_cpu"), np, parallel, "cpu");
        let worst = gpu.iter().zip(&cpu).map(|(g, c)| (g - c).abs() / c.abs()).fold(0.0, f64::max);
        eprintln!("{name}: GPU losses within {worst:.2e} of the CPU arm; first {:?} vs {:?}", gpu[0], cpu[0]);
        assert_eq!(gpu.len(), cpu.len(), "{name}: step counts differ");
        assert!(worst <= 2e-3, "{name}: GPU losses differ by {worst:e} from the CPU arm");
        if name == "dp2z0" {
            // Two ranks on one GPU map each other's buffers.
            assert!(log.contains("mapped peer memory (IPC)"), "{name}: the gradient average did not take the IPC path:\n{log}");
        }
    }
}
