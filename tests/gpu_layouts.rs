//! The device model's parallel layouts on a real GPU (ignored elsewhere): `meshtrain train` with
//! `device = "cuda"` on ranks that share the GPU, against the same layout on the CPU arm
//! (`device = "cpu"`, `precision = "bf16"`, the numerics the CI tests check against the CPU
//! model). Run with
//!
//! `cargo test --release --test gpu_layouts -- --ignored gpu --test-threads=1 --nocapture`
//!
//! Tolerance: the arms differ in the order of f32 sums inside products and reductions, and an
//! activation an ulp away can round to the neighbouring bf16 value before the next product; one
//! step's gradients agree to 1e-3 (`tests/gpu_model.rs`), so 10 AdamW steps' losses are held to
//! 2e-3 relative (to be tightened once measured on a GPU). A TP sum lost or a shard misplaced on
//! the GPU path moves the losses by far more.

mod common;

use std::path::Path;

use meshtrain::config::DeviceKind;

/// Losses of `steps` steps of `parallel` on `np` ranks of an `n_layer`-layer model on
/// `device`, and what the ranks printed.
fn run(dir: &Path, name: &str, (np, parallel): (usize, &str), device: &str, (steps, n_layer): (usize, usize)) -> (Vec<f64>, String) {
    let job = common::tiny_job(dir, &format!("{name}.toml"), &format!("[parallel]\n{parallel}"));
    let metrics = dir.join(format!("{name}.jsonl"));
    let sets = [
        format!("device={device}"),
        "precision=bf16".into(),
        format!("train.steps={steps}"),
        "optim.warmup_steps=1".into(),
        format!("model.n_layer={n_layer}"),
    ];
    let out = common::train(np, &job, &metrics, &sets);
    (common::losses(&metrics).into_iter().map(|(_, l)| l).collect(), out.stderr)
}

/// One GPU, two ranks sharing it: TP2 with sequence parallelism, PP2 (1F1B), DP2 at ZeRO 0
/// (reduced over IPC) and at ZeRO 3 (parameters gathered unit by unit), and one rank alone, 10
/// steps of 4 layers. On emu (kernels emulated on the host, ~100x slower than the CPU arm) 3
/// steps of 2 layers of the layouts whose device collectives the other tests do not reach.
fn device_layouts_follow_the_cpu_arm(kind: DeviceKind) {
    let (device, size, emu_layouts) = match kind {
        DeviceKind::Cuda => ("cuda", (10, 4), None),
        DeviceKind::Emu => ("emu", (3, 2), Some(["tp2sp", "pp2", "dp2z3"])),
        other => panic!("no layout test for {other:?}"),
    };
    let dir = tempfile::tempdir().unwrap();
    let layouts = [
        ("single", 1, ""),
        ("tp2sp", 2, "tp = 2\nsequence_parallel = true"),
        ("pp2", 2, "pp = 2\nschedule = \"1f1b\"\nmicrobatches = 2"),
        ("dp2z0", 2, "dp = 2"),
        ("dp2z3", 2, "dp = 2\nzero = 3"),
    ];
    for (name, np, parallel) in layouts {
        if emu_layouts.is_some_and(|l| !l.contains(&name)) {
            continue;
        }
        let (gpu, log) = run(dir.path(), &format!("{name}_{device}"), (np, parallel), device, size);
        let (cpu, _) = run(dir.path(), &format!("{name}_cpu"), (np, parallel), "cpu", size);
        let worst = gpu.iter().zip(&cpu).map(|(g, c)| (g - c).abs() / c.abs()).fold(0.0, f64::max);
        eprintln!("{name}: {device} losses within {worst:.2e} of the CPU arm; first {:?} vs {:?}", gpu[0], cpu[0]);
        assert_eq!(gpu.len(), cpu.len(), "{name}: step counts differ");
        assert!(worst <= 2e-3, "{name}: GPU losses differ by {worst:e} from the CPU arm");
        if name == "tp2sp" {
            // The TP/SP calls of every layer are small: stream-ordered, no host sync per call.
            assert!(log.contains("stream-ordered device collectives up to"), "{name}: the TP calls were not stream-ordered:\n{log}");
        }
        if name == "dp2z0" && kind == DeviceKind::Cuda {
            // Two ranks on one GPU map each other's buffers.
            assert!(log.contains("mapped peer memory (IPC)"), "{name}: the gradient average did not take the IPC path:\n{log}");
        }
    }
}

crate::gpu_and_emu_tests!(device_layouts_follow_the_cpu_arm);
