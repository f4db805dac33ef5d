//! The README's "Train on your own text" walkthrough, command for command, on the small text
//! shipped in `tests/data/lighthouse.txt`: tokenize -> train on one rank -> train on eight ranks
//! (TP2 x PP2 x DP2) -> inspect -> export -> generate, which must print decoded text that continues
//! the prompt. Along the way: the default output is quiet (no per-communicator lines, no effective
//! config on screen, which goes beside the metrics instead), and a layout that does not fit the
//! ranks is said once with the `--set` that would fit.
//!
//! Short by design (a 2-layer width-64 model, 30 steps per run): a few tens of seconds on 2 cores.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const REPO: &str = env!("CARGO_MANIFEST_DIR");

/// Runs `cmd` in `dir`; asserts it succeeded; (stdout, stderr).
fn ok(mut cmd: Command, dir: &Path, what: &str) -> (String, String) {
    let out: Output = cmd.current_dir(dir).output().unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "{what} failed ({:?}):\n{so}\n{se}",
        out.status
    );
    (so, se)
}

fn meshtrain(args: &[&str]) -> Command {
    let mut c = Command::new(common::meshtrain());
    c.args(args);
    c
}

fn fresh_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mt-walkthrough-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn train_on_your_own_text_ends_in_generated_text() {
    let dir = fresh_dir();
    let text = format!("{REPO}/tests/data/lighthouse.txt");
    let job = format!("{REPO}/jobs/text.toml");

    // 1. Tokenize: GPT-2 BPE into llm.c shards, one summary line.
    let (said, _) = ok(
        meshtrain(&[
            "tokenize",
            &text,
            "--out",
            "data/mytext",
            "--val-fraction",
            "0.25",
        ]),
        &dir,
        "tokenize",
    );
    assert_eq!(
        said.lines().filter(|l| l.starts_with("tokenize:")).count(),
        1,
        "one summary line:\n{said}"
    );

    // 2. Train on one rank: quiet by default, the effective config beside the metrics.
    let steps = "train.steps=30";
    let (said, logs) = ok(
        meshtrain(&["train", &job, "--set", steps, "--metrics", "out/one.jsonl"]),
        &dir,
        "train on 1 rank",
    );
    assert!(said.contains("# done: 30 steps"), "{said}");
    assert!(
        !said.contains("effective config") && !logs.contains("comm 0x"),
        "noisy default output:\n{said}\n{logs}"
    );
    assert!(
        logs.lines().all(|l| l.starts_with("[r0 ")),
        "every log line names the rank:\n{logs}"
    );
    let written = std::fs::read_to_string(dir.join("out/one.config.toml")).unwrap();
    assert!(
        written.contains("vocab_size = 50257") && written.contains("steps = 30"),
        "{written}"
    );
    let losses = common::losses(&dir.join("out/one.jsonl"));
    assert!(
        losses.len() == 30 && losses[29].1 < losses[0].1 - 1.0,
        "the loss falls: {losses:?}"
    );

    // 3. Train on eight ranks (2-way tensor x 2-stage pipeline x 2-way data parallel), into its
    // own checkpoint directory; everything after reads that checkpoint on one rank.
    let mut eight = common::mpirun(8);
    eight.args([
        "train",
        &job,
        "--set",
        steps,
        "--set",
        "parallel.tp=2",
        "--set",
        "parallel.pp=2",
        "--set",
        "parallel.dp=2",
        "--set",
        "checkpoint.dir=ckpt/grid",
    ]);
    let (said, _) = ok(eight, &dir, "train on 8 ranks");
    assert!(
        said.contains("# checkpoint ckpt/grid/step_00000030") && said.contains("# done: 30 steps"),
        "{said}"
    );

    // 4. Inspect one tensor by its short name.
    let (said, _) = ok(
        meshtrain(&["inspect", "ckpt/grid/latest", "--tensor", "wpe"]),
        &dir,
        "inspect",
    );
    assert!(
        said.contains("tensor model/wpe: shape [32, 64] f32 in ") && !said.contains("model/wte"),
        "{said}"
    );

    // 5. Export the weights, 6. generate from the export: text that continues the prompt.
    let (said, _) = ok(
        meshtrain(&["export", "ckpt/grid", "model.h5"]),
        &dir,
        "export",
    );
    assert!(
        said.contains("export: 28 tensors"),
        "weights only by default: {said}"
    );
    let prompt = "The keeper";
    let (said, _) = ok(
        meshtrain(&[
            "generate",
            "model.h5",
            "--prompt",
            prompt,
            "--max-new-tokens",
            "24",
            "--seed",
            "1",
        ]),
        &dir,
        "generate",
    );
    let words = said
        .split_whitespace()
        .filter(|w| w.chars().any(char::is_alphabetic))
        .count();
    assert!(
        said.starts_with(prompt) && words >= 6 && !said.contains(",,"),
        "not decoded text: {said:?}"
    );
    // The checkpoint's `latest` works as well, greedy decoding is deterministic.
    let greedy = [
        "generate",
        "ckpt/mytext/latest",
        "--prompt",
        prompt,
        "--temperature",
        "0",
        "--max-new-tokens",
        "8",
    ];
    let (a, _) = ok(meshtrain(&greedy), &dir, "generate from latest");
    let (b, _) = ok(meshtrain(&greedy), &dir, "generate from latest");
    assert!(a == b && a.starts_with(prompt), "{a:?} vs {b:?}");

    // The same weights for transformers (safetensors) read back by `generate`: the same text.
    let (said, _) = ok(meshtrain(&["export", "--format", "safetensors", "ckpt/grid", "hf"]), &dir, "export safetensors");
    assert!(said.contains("export: 28 tensors"), "{said}");
    let greedy = |m: &str| ok(meshtrain(&["generate", m, "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "8"]), &dir, m).0;
    assert_eq!(greedy("hf"), greedy("model.h5"));

    // A layout that does not fit the ranks: said once, by rank 0, with the overrides that fit.
    let demo = format!("{REPO}/jobs/demo.toml");
    let mut wrong = common::mpirun(2);
    // mpirun's own default: the job ends, non-zero, at the first rank's non-zero exit.
    wrong
        .env_remove("OMPI_MCA_orte_abort_on_non_zero_status")
        .args(["train", &demo, "--set", "train.steps=5"]);
    let out = wrong.current_dir(&dir).output().unwrap();
    let all =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    let errors: Vec<&str> = all
        .lines()
        .filter(|l| l.contains("meshtrain: error"))
        .collect();
    assert!(!out.status.success() && errors.len() == 1, "{all}");
    assert!(errors[0].contains("= 8 ranks, but the job has 2; for 2 ranks use `--set parallel.pp=1 --set parallel.dp=1`"), "{all}");
    let _ = std::fs::remove_dir_all(&dir);
}
