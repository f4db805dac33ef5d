//! Faults of a training run (real rank processes under mpirun): a batch system's stop signal
//! mid-run ends every rank with a checkpoint and exit 0, and the run resumes from `latest` bit for
//! bit.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Steps of every run here: enough that a signal sent after the third step lands mid-run.
const STEPS: u64 = 300;

/// A two-rank (DP2, ZeRO-1) tiny job of [`STEPS`] steps checkpointing into `dir/<name>_ckpt` with
/// the extra TOML lines `extra` (the `[checkpoint]` table is open).
fn job(dir: &Path, name: &str, extra: &str) -> PathBuf {
    let ckpt = dir.join(format!("{name}_ckpt"));
    let extra = format!("[parallel]\ndp = 2\nzero = 1\nbucket_mb = 0.05\n[checkpoint]\ndir = {:?}\n{extra}", ckpt.display().to_string());
    let path = common::tiny_job(dir, &format!("{name}.toml"), &extra);
    let text = std::fs::read_to_string(&path).unwrap().replace("steps = 20", &format!("steps = {STEPS}"));
    std::fs::write(&path, text).unwrap();
    path
}

/// Lines in the metrics file (0 while it does not exist).
fn metric_lines(path: &Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |s| s.lines().count())
}

/// Runs `train JOB` on two ranks, sends `signal` to the ranks `targets` once three steps are
/// done, and waits for the end.
fn train_and_signal(job: &Path, metrics: &Path, signal: libc::c_int, targets: &[usize]) -> common::Finished {
    let mut cmd = common::mpirun(2);
    cmd.arg("train").arg(job).arg("--metrics").arg(metrics);
    let child = common::spawn(cmd);
    let start = Instant::now();
    while metric_lines(metrics) < 3 {
        assert!(start.elapsed() < Duration::from_secs(120), "the run did not reach step 3");
        std::thread::sleep(Duration::from_millis(10));
    }
    let pids = common::rank_pids(child.id());
    assert_eq!(pids.len(), 2, "rank processes of mpirun: {pids:?}");
    for &(rank, pid) in pids.iter().filter(|(r, _)| targets.contains(r)) {
        // SAFETY: sending a signal to a rank process this test started.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, signal) }, 0, "signal rank {rank}");
    }
    common::wait(child, Duration::from_secs(300))
}

/// Bit patterns of every tensor of a checkpoint (exported).
fn final_bits(ckpt: &Path, out: &Path) -> Vec<(String, Vec<u32>)> {
    common::export(ckpt, out).into_iter().map(|t| (t.0, t.2.iter().map(|x| x.to_bits()).collect())).collect()
}

#[test]
fn stop_signal_checkpoints_exits_zero_and_resumes_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let last = format!("step_{STEPS:08}");
    let full = job(d, "full", &format!("every = {STEPS}"));
    common::train(2, &full, &d.join("full.jsonl"), &[]);
    let want = common::losses(&d.join("full.jsonl"));
    let want_final = final_bits(&d.join("full_ckpt").join(&last), &d.join("full.h5"));

    // Slurm's `--signal=USR1@120` to one rank; SIGTERM to every rank as at the time limit. Neither
    // run would checkpoint before its last step on its own.
    for (name, signal, targets) in [("usr1_one", libc::SIGUSR1, &[1][..]), ("term_all", libc::SIGTERM, &[0, 1][..])] {
        let stopped = job(d, name, &format!("every = {STEPS}"));
        let metrics = d.join(format!("{name}.jsonl"));
        let out = train_and_signal(&stopped, &metrics, signal, targets);
        assert!(out.success(), "{name}: {:?}\n{}\n{}", out.status, out.stdout, out.stderr);
        let done = common::losses(&metrics);
        let stop = done.last().unwrap().0;
        assert!(stop < STEPS, "{name}: the run was not stopped early");
        let sig = if signal == libc::SIGTERM { "SIGTERM" } else { "SIGUSR1" };
        let said = format!("stopped by {sig} after step {stop}");
        assert!(out.stderr.contains(&said) || out.stdout.contains(&said), "{name}: {}\n{}", out.stdout, out.stderr);
        let ckpt = d.join(format!("{name}_ckpt"));
        let latest = std::fs::read_to_string(ckpt.join("latest")).unwrap();
        assert_eq!(latest.trim(), format!("step_{stop:08}"), "{name}: the checkpoint of the last step");
        for (g, w) in done.iter().zip(&want) {
            assert_eq!(g.1.to_bits(), w.1.to_bits(), "{name} step {}", g.0);
        }

        // Resuming from `latest` continues the uninterrupted run bit for bit.
        let resumed = d.join(format!("{name}_resumed.jsonl"));
        common::train(2, &stopped, &resumed, &["checkpoint.resume=\"latest\"".into()]);
        let got = common::losses(&resumed);
        assert_eq!(got.len() as u64, STEPS - stop, "{name}: steps after the resume");
        for (g, w) in got.iter().zip(&want[stop as usize..]) {
            assert_eq!((g.0, g.1.to_bits()), (w.0, w.1.to_bits()), "{name} step {}: {} vs {}", g.0, g.1, w.1);
        }
        let got_final = final_bits(&ckpt.join(&last), &d.join(format!("{name}.h5")));
        assert!(got_final == want_final, "{name}: final parameters differ from the uninterrupted run");
    }
}
