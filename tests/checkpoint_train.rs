//! Checkpoints of real training runs (rank processes under mpirun): a run resumed from a
//! checkpoint in the same layout continues bit for bit; resumed in another data-parallel layout it
//! follows the uninterrupted run within 1e-5; the result exports, inspects and generates.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;


fn job(dir: &Path, name: &str, extra: &str) -> PathBuf {
    let path = dir.join(name);
    let text = format!(
        r#"device = "cpu"
[model]
size = "tiny"
[data]
source = "synthetic"
shuffle = true
seed = 5
[train]
steps = 20
micro_batch = 4
seq_len = 32
seed = 11
eval_every = 0
[optim]
lr = 2e-3
warmup_steps = 4
grad_clip = 1.0
[checkpoint]
dir = "{}"
every = 10
keep = 5
{extra}
"#,
        dir.join(name.replace(".toml", "_ckpt")).display()
    );
    std::fs::write(&path, text).unwrap();
    path
}



use common::export;

#[test]
fn resume_same_layout_is_bitwise_and_other_layout_within_1e5() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Uninterrupted: dp=2, ZeRO-1, 20 steps, checkpoints at 10 and 20.
    let full = job(d, "full.toml", "[parallel]\ndp = 2\nzero = 1\nbucket_mb = 0.05");
    common::train(2, &full, &d.join("full.jsonl"), &[]);
    let want = common::losses(&d.join("full.jsonl"));
    let ckpt10 = d.join("full_ckpt/step_00000010");
    assert!(ckpt10.join("checkpoint.h5").exists());
    let final_full = export(&d.join("full_ckpt/step_00000020"), &d.join("full.h5"));

    // Same layout, resumed from step 10 into its own directory.
    let same = job(d, "same.toml", "[parallel]\ndp = 2\nzero = 1\nbucket_mb = 0.05");
    common::train(2, &same, &d.join("same.jsonl"), &[format!("checkpoint.resume={:?}", ckpt10.display().to_string())]);
    let got = common::losses(&d.join("same.jsonl"));
    assert_eq!(got.len(), 10);
    for (g, w) in got.iter().zip(&want[10..]) {
        assert_eq!(g.0, w.0);
        assert_eq!(g.1.to_bits(), w.1.to_bits(), "step {}: {} vs {}", g.0, g.1, w.1);
    }
    let final_same = export(&d.join("same_ckpt/step_00000020"), &d.join("same.h5"));
    for (a, b) in final_same.iter().zip(&final_full) {
        assert_eq!(a.0, b.0);
        assert!(a.2.iter().zip(&b.2).all(|(x, y)| x.to_bits() == y.to_bits()), "{} differs", a.0);
    }

    // Other layout: 4 ranks, ZeRO-0, half the micro-batch (same global batch), from step 10.
    let other = job(d, "other.toml", "[parallel]\ndp = 4\nzero = 0\nbucket_mb = 0.02");
    common::train(4, &other, &d.join("other.jsonl"), &["train.micro_batch=2".into(), format!("checkpoint.resume={:?}", ckpt10.display().to_string())]);
    let got = common::losses(&d.join("other.jsonl"));
    for (g, w) in got.iter().zip(&want[10..]) {
        assert!((g.1 - w.1).abs() <= 1e-5 * w.1.abs(), "step {}: {} vs {}", g.0, g.1, w.1);
    }
    let final_other = export(&d.join("other_ckpt/step_00000020"), &d.join("other.h5"));
    for (a, b) in final_other.iter().zip(&final_full) {
        let scale = b.2.iter().map(|x| x.abs()).fold(0f32, f32::max).max(1e-3);
        let worst = a.2.iter().zip(&b.2).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-5 * scale * 10.0, "{}: max diff {worst} (scale {scale})", a.0);
    }

    // A new run started from the exported file (`init_from`, here in a TP2 layout) begins where
    // the trained model is: its first loss is near the trained one, well below a fresh 5.55.
    let init = job(d, "init.toml", "[parallel]\ntp = 2");
    let init_metrics = d.join("init.jsonl");
    common::train(2, &init, &init_metrics, &[format!("init_from={:?}", d.join("full.h5").display().to_string()), "train.steps=1".into(), "optim.warmup_steps=1".into(), "checkpoint.every=0".into()]);
    let first = common::losses(&init_metrics)[0].1;
    assert!(first < want[19].1 + 0.3 && first < 5.2, "init_from loss {first}, trained loss {}", want[19].1);

    // The exported model inspects and generates.
    let out = Command::new(common::meshtrain()).args(["inspect", "--verify", "--json"]).arg(&ckpt10).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report.to_string().contains("model/h.0.attn.qkv.weight"));
    let out = Command::new(common::meshtrain())
        .args(["generate", "--tokens", "1,2,3", "--max-new-tokens", "8", "--temperature", "0"])
        .arg(d.join("full.h5"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let toks: Vec<u32> = String::from_utf8_lossy(&out.stdout).trim().split(',').map(|t| t.parse().unwrap()).collect();
    assert_eq!(toks.len(), 8);
    assert!(toks.iter().all(|&t| t < 256));
}

#[test]
fn corrupt_checkpoint_is_rejected_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let base = job(d, "base.toml", "");
    common::train(1, &base, &d.join("base.jsonl"), &["train.steps=10".into()]);
    let ckpt = d.join("base_ckpt/step_00000010");
    // Flip a byte in the middle of the shard file's data.
    let shard = ckpt.join("rank_00000.h5");
    let mut bytes = std::fs::read(&shard).unwrap();
    let at = bytes.len() - 4096;
    bytes[at] ^= 0x55;
    std::fs::write(&shard, bytes).unwrap();
    let out = Command::new(common::meshtrain())
        .arg("train")
        .arg(&base)
        .args(["--set", &format!("checkpoint.resume={:?}", ckpt.display().to_string())])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("rank_00000.h5"), "error should name the shard file: {err}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("step 1/"), "training started on a corrupt checkpoint");
}

/// A run is uninterrupted and resumed from its step-10 checkpoint in the same layout.
struct Resumed {
    /// (step, loss) of the uninterrupted run.
    want: Vec<(u64, f64)>,
    /// Its final tensors.
    final_full: Vec<meshtrain::checkpoint::ExportedTensor>,
    /// `checkpoint.resume=...` for its step-10 checkpoint.
    resume: String,
}

/// Runs `layout` on `np` ranks for 20 steps (with the `--set` overrides `sets`), then resumes it
/// from step 10 in the same layout and checks that the losses continue bit for bit.
fn resume_same_layout(d: &Path, name: &str, np: usize, layout: &str, sets: &[String]) -> Resumed {
    let full = job(d, &format!("{name}.toml"), layout);
    common::train(np, &full, &d.join(format!("{name}.jsonl")), sets);
    let want = common::losses(&d.join(format!("{name}.jsonl")));
    let ckpt10 = d.join(format!("{name}_ckpt/step_00000010"));
    let resume = format!("checkpoint.resume={:?}", ckpt10.display().to_string());
    let final_full = export(&d.join(format!("{name}_ckpt/step_00000020")), &d.join(format!("{name}.h5")));
    let same = job(d, &format!("{name}_same.toml"), layout);
    let resumed: Vec<String> = sets.iter().cloned().chain([resume.clone()]).collect();
    common::train(np, &same, &d.join(format!("{name}_same.jsonl")), &resumed);
    for (g, w) in common::losses(&d.join(format!("{name}_same.jsonl"))).iter().zip(&want[10..]) {
        assert_eq!(g.1.to_bits(), w.1.to_bits(), "{name} step {}: {} vs {}", g.0, g.1, w.1);
    }
    Resumed { want, final_full, resume }
}

/// Resumes `from` in another `layout` on `np` ranks (with the `--set` overrides `sets`): 10 losses
/// within 1e-5, final parameters within `rel`.
fn resume_other_layout(
    d: &Path,
    from: &Resumed,
    name: &str,
    np: usize,
    layout: &str,
    sets: &[String],
    rel: f64,
) {
    let other = job(d, &format!("{name}.toml"), layout);
    let resumed: Vec<String> = sets.iter().cloned().chain([from.resume.clone()]).collect();
    common::train(np, &other, &d.join(format!("{name}.jsonl")), &resumed);
    let got = common::losses(&d.join(format!("{name}.jsonl")));
    assert_eq!(got.len(), 10);
    for (g, w) in got.iter().zip(&from.want[10..]) {
        assert!((g.1 - w.1).abs() <= 1e-5 * w.1.abs(), "{name} step {}: {} vs {}", g.0, g.1, w.1);
    }
    let final_other = export(&d.join(format!("{name}_ckpt/step_00000020")), &d.join(format!("{name}.h5")));
    common::assert_params_close(&final_other, &from.final_full, rel, name);
}

#[test]
fn tensor_and_pipeline_parallel_checkpoints_reshard() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // TP2 x PP2, two pipeline micro-batches of 4 sequences per step.
    let layout = "[parallel]\ntp = 2\npp = 2\nschedule = \"1f1b\"\nmicrobatches = 2";
    let tpp = resume_same_layout(d, "tpp", 4, layout, &[]);
    // Two data-parallel ranks with ZeRO-1 (same 8 sequences per step).
    resume_other_layout(d, &tpp, "dp", 2, "[parallel]\ndp = 2\nzero = 1", &[], 1e-5);
}

#[test]
fn zero3_checkpoints_resume_bitwise_and_reshard_into_zero2_tensor_parallel() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Two data-parallel ranks with ZeRO-3: each holds only its blocks of the parameters and
    // writes exactly those.
    let z3 = resume_same_layout(d, "z3", 2, "[parallel]\ndp = 2\nzero = 3\nbucket_mb = 0.05", &[]);
    // ZeRO-2 over a TP2 x DP2 grid with sequence parallelism.
    let layout = "[parallel]\ntp = 2\ndp = 2\nzero = 2\nsequence_parallel = true\nbucket_mb = 0.02";
    resume_other_layout(d, &z3, "tp2dp2z2", 4, layout, &[], 1e-5);
}

#[test]
fn interleaved_pipeline_checkpoints_resume_in_any_layout() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Two pipeline ranks with two chunks each over four blocks (rank 0: blocks 0 and 2, rank 1:
    // blocks 1 and 3), two micro-batches of 4 sequences per step.
    let blocks = ["model.n_layer=4".to_string()];
    let layout = "[parallel]\npp = 2\nschedule = \"interleaved\"\nvirtual_stages = 2\nmicrobatches = 2";
    let il = resume_same_layout(d, "il", 2, layout, &blocks);
    // Contiguous 1F1B stages of 3 and 1 blocks (same 8 sequences per step).
    let split = "[parallel]\npp = 2\nschedule = \"1f1b\"\nmicrobatches = 2\nstage_layers = [3, 1]";
    resume_other_layout(d, &il, "split", 2, split, &blocks, 1e-5);
}

#[test]
fn device_model_checkpoints_resume_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // bf16 device model (on the CPU device) over two data-parallel ranks at ZeRO 0: its master
    // weights and AdamW moments live in device buffers during training and go to the checkpoint
    // through the host copies; resuming loads them back. The same for a tensor-parallel pair,
    // whose shards checkpoint through the CPU shard executor's tensor maps, and for an
    // interleaved pipeline pair (two chunks each over four blocks, the tied embedding on both).
    let bf16 = ["precision=bf16".to_string()];
    resume_same_layout(d, "dev_dp2", 2, "[parallel]\ndp = 2", &bf16);
    resume_same_layout(d, "dev_tp2", 2, "[parallel]\ntp = 2", &bf16);
    let pipeline = "[parallel]\npp = 2\nschedule = \"interleaved\"\nvirtual_stages = 2\nmicrobatches = 2";
    resume_same_layout(d, "dev_pp2", 2, pipeline, &["precision=bf16".to_string(), "model.n_layer=4".to_string()]);
}
