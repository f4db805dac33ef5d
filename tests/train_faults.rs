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

/// `mpirun` for two ranks whose every rank runs meshtrain (with the arguments added to the
/// command) through a shell that prints its exit status: mpirun itself, told to let every rank
/// report its own error, exits 0 even when ranks failed.
fn mpirun_reporting_exits() -> std::process::Command {
    mpirun_with_prelude("")
}

/// [`mpirun_reporting_exits`] whose shells first run `prelude` (e.g. to set a variable on one
/// rank only).
fn mpirun_with_prelude(prelude: &str) -> std::process::Command {
    let c = common::mpirun(2);
    let mut args: Vec<std::ffi::OsString> = c.get_args().map(|a| a.to_owned()).collect();
    let meshtrain = args.pop().expect("mpirun's command ends with the program");
    let report = prelude.to_string() + r#""$0" "$@"; echo "meshtrain exited with $? on rank $OMPI_COMM_WORLD_RANK" >&2"#;
    let mut cmd = std::process::Command::new(c.get_program());
    cmd.args(args).args(["sh", "-c", &report]).arg(meshtrain);
    cmd.envs(c.get_envs().filter_map(|(k, v)| v.map(|v| (k.to_owned(), v.to_owned()))));
    cmd
}

/// Pids of the processes whose parent is `parent`.
fn children(parent: u32) -> Vec<u32> {
    let ppid = |pid: u32| {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        stat.rsplit(')').next().and_then(|s| s.split_whitespace().nth(1)).and_then(|p| p.parse::<u32>().ok())
    };
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|&pid| ppid(pid) == Some(parent))
        .collect()
}

/// The exit status of each rank, in rank order (reported by [`mpirun_reporting_exits`]).
fn rank_exits(out: &common::Finished) -> Vec<i32> {
    let mut exits: Vec<(usize, i32)> = out
        .stderr
        .lines()
        .filter_map(|l| l.split_once("meshtrain exited with ").map(|x| x.1))
        .filter_map(|l| l.split_once(" on rank "))
        .map(|(code, rank)| (rank.trim().parse().unwrap(), code.parse().unwrap()))
        .collect();
    exits.sort();
    exits.into_iter().map(|e| e.1).collect()
}

/// Lines in the metrics file (0 while it does not exist).
fn metric_lines(path: &Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |s| s.lines().count())
}

/// Runs `train JOB` on two ranks, sends `signal` to the ranks `targets` once three steps are
/// done, and waits for the end.
fn train_and_signal(job: &Path, metrics: &Path, signal: libc::c_int, targets: &[usize]) -> common::Finished {
    let mut cmd = mpirun_reporting_exits();
    cmd.arg("train").arg(job).arg("--metrics").arg(metrics);
    let child = common::spawn(cmd);
    let start = Instant::now();
    while metric_lines(metrics) < 3 {
        assert!(start.elapsed() < Duration::from_secs(120), "the run did not reach step 3");
        std::thread::sleep(Duration::from_millis(10));
    }
    let shells = common::rank_pids(child.id());
    assert_eq!(shells.len(), 2, "rank processes of mpirun: {shells:?}");
    for &(rank, shell) in shells.iter().filter(|(r, _)| targets.contains(r)) {
        // The shell that reports the exit status runs meshtrain as its only child.
        let pids = children(shell);
        assert_eq!(pids.len(), 1, "meshtrain under rank {rank}'s shell: {pids:?}");
        // SAFETY: sending a signal to a rank process this test started.
        assert_eq!(unsafe { libc::kill(pids[0] as libc::pid_t, signal) }, 0, "signal rank {rank}");
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
        assert_eq!(rank_exits(&out), [0, 0], "{name}: {:?}\n{}\n{}", out.status, out.stdout, out.stderr);
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

/// Runs `train JOB --metrics METRICS [--set ...]` on two ranks to its end, successful or not.
fn train_any(job: &Path, metrics: &Path, sets: &[&str]) -> common::Finished {
    let mut cmd = mpirun_reporting_exits();
    cmd.arg("train").arg(job).arg("--metrics").arg(metrics);
    for s in sets {
        cmd.args(["--set", s]);
    }
    common::run(cmd, Duration::from_secs(300))
}

/// Step directories of a checkpoint root, sorted.
fn step_dirs(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with("step_")).collect())
        .unwrap_or_default();
    names.sort();
    names
}

#[test]
fn nonfinite_loss_stops_or_skips_alike_on_every_rank_and_is_never_saved() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let short = ["train.steps=6", "checkpoint.every=1", "checkpoint.keep=0"];
    let nan_on_rank1 = [&short[..], &["train.inject_nan_at=[3, 1]"]].concat();

    // stop (the default): both ranks fail naming the step and the rank; the last checkpoint is
    // the step before.
    let stop = job(d, "stop", "");
    let out = train_any(&stop, &d.join("stop.jsonl"), &nan_on_rank1);
    assert_eq!(rank_exits(&out), [1, 1], "a NaN loss must stop the run: {}\n{}", out.stdout, out.stderr);
    for r in 0..2 {
        let said = out.rank_stderr(r).join("\n");
        assert!(said.contains("non-finite loss at step 3 on rank(s) 1 "), "rank {r}: {said}");
    }
    assert_eq!(step_dirs(&d.join("stop_ckpt")), ["step_00000001", "step_00000002"]);

    // skip: step 3 changes nothing (its checkpoint equals step 2's bit for bit), the run goes on.
    let skip = job(d, "skip", "");
    let metrics = d.join("skip.jsonl");
    let out = train_any(&skip, &metrics, &[&nan_on_rank1[..], &["train.nonfinite=\"skip\""]].concat());
    assert_eq!(rank_exits(&out), [0, 0], "{}\n{}", out.stdout, out.stderr);
    // Rank 0's progress lines (the skip among them) and its final line share stdout.
    assert!(out.stdout.contains("step 3: non-finite loss at step 3 on rank(s) 1 ") && out.stdout.contains("1 step(s) skipped"), "{}\n{}", out.stdout, out.stderr);
    let skipped: Vec<bool> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["skipped"].as_bool().unwrap())
        .collect();
    assert_eq!(skipped, [false, false, true, false, false, false]);
    let ckpt = |s: u64| final_bits(&d.join("skip_ckpt").join(format!("step_{s:08}")), &d.join(format!("skip{s}.h5")));
    assert!(ckpt(3) == ckpt(2), "a skipped step changed the parameters");
    assert!(ckpt(4) != ckpt(3), "the step after a skipped one updates again");

    // A learning rate that blows the weights up: every rank's loss turns NaN at step 2.
    let blowup = job(d, "blowup", "");
    let out = train_any(&blowup, &d.join("blowup.jsonl"), &[&short[..], &["optim.lr=1e30"]].concat());
    assert_eq!(rank_exits(&out), [1, 1]);
    assert!(out.stderr.contains("non-finite loss at step 2 on rank(s) 0, 1 "), "{}", out.stderr);

    // Weights that overflow to infinity after a finite step: the checkpoint refuses them.
    let inf = job(d, "inf", "");
    let out = train_any(&inf, &d.join("inf.jsonl"), &[&short[..], &["optim.lr=1e300"]].concat());
    assert_eq!(rank_exits(&out), [1, 1]);
    assert!(out.stderr.contains("checkpoint step 1: rank 0 failed") && out.stderr.contains("refusing to save"), "{}", out.stderr);
    assert!(step_dirs(&d.join("inf_ckpt")).is_empty(), "nothing non-finite is saved");
}

#[test]
fn ranks_with_differing_configs_refuse_to_train_naming_the_keys() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let job = job(d, "seed", "");
    // Rank 1 alone gets another seed and micro-batch from its environment.
    let prelude = r#"[ "$OMPI_COMM_WORLD_RANK" = 1 ] && export MESHTRAIN_TRAIN_SEED=8 MESHTRAIN_TRAIN_MICRO_BATCH=2; "#;
    let mut cmd = mpirun_with_prelude(prelude);
    cmd.arg("train").arg(&job).args(["--set", "train.steps=2"]);
    let out = common::run(cmd, Duration::from_secs(120));
    assert_eq!(rank_exits(&out), [2, 2], "{}\n{}", out.stdout, out.stderr);
    for r in 0..2 {
        let said = out.rank_stderr(r).join("\n");
        assert!(said.contains("ranks differ from rank 0: 1; rank 1: train.micro_batch: 2 (rank 0: 4); train.seed: 8 (rank 0: 7)"), "rank {r}: {said}");
    }
    assert!(!out.stdout.contains("step 1/") && !out.stderr.contains("step 1/"), "training started");
}

/// Runs `meshtrain train JOB --set ...` as a world of one rank; (success, stdout + stderr).
fn train_alone(job: &Path, sets: &[&str]) -> (bool, String) {
    let mut cmd = std::process::Command::new(common::meshtrain());
    cmd.arg("train").arg(job);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
}

#[test]
fn checkpoint_resume_decisions() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let root = d.join("ckpt");
    let job = common::tiny_job(d, "one.toml", &format!("[checkpoint]\ndir = {:?}\nkeep = 0", root.display().to_string()));

    // `latest` in a directory that does not exist yet: a fresh start; every = 0 (the default)
    // saves at the end only.
    let (ok, said) = train_alone(&job, &["train.steps=3", "optim.warmup_steps=1", "checkpoint.resume=\"latest\""]);
    assert!(ok && said.contains("starting fresh"), "{said}");
    assert_eq!(step_dirs(&root), ["step_00000003"]);

    // A rerun from step 1 reaches step 3, saved before: the new checkpoint replaces it.
    let (ok, said) = train_alone(&job, &["train.steps=3", "optim.warmup_steps=1", "checkpoint.every=1"]);
    assert!(ok, "{said}");
    let from1 = format!("checkpoint.resume={:?}", root.join("step_00000001").display().to_string());
    let (ok, said) = train_alone(&job, &["train.steps=3", "optim.warmup_steps=1", &from1]);
    assert!(ok && said.contains("step_00000003 replaces the one saved there before"), "{said}");
    assert_eq!(step_dirs(&root), ["step_00000001", "step_00000002", "step_00000003"]);
    assert_eq!(std::fs::read_to_string(root.join("latest")).unwrap().trim(), "step_00000003");

    // The CLI around a checkpoint: `inspect` takes the index file too, survives a reader that
    // stops early (here: before it writes), and `generate` names a bad flag.
    let index = root.join("step_00000003").join("checkpoint.h5");
    let out = std::process::Command::new(common::meshtrain()).arg("inspect").arg(&index).output().unwrap();
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("step 3"), "{out:?}");
    let piped = format!("{:?} inspect --verify {:?} | true; exit ${{PIPESTATUS[0]}}", common::meshtrain(), root.join("step_00000003"));
    let out = std::process::Command::new("bash").args(["-c", &piped]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !err.contains("panicked"), "inspect | head: {:?} {err}", out.status);
    let out = std::process::Command::new(common::meshtrain())
        .args(["generate", "--tokens", "1,2", "--temperature=-1"])
        .arg(root.join("step_00000003"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(2) && err.contains("`--temperature`: -1 is not a number >= 0"), "{err}");

    // `latest` naming something outside the checkpoint directory is refused before training.
    std::fs::write(root.join("latest"), "../elsewhere/step_00000001\n").unwrap();
    let (ok, said) = train_alone(&job, &["train.steps=3", "optim.warmup_steps=1", "checkpoint.resume=\"latest\""]);
    assert!(!ok && said.contains("latest") && said.contains("not a step_XXXXXXXX directory"), "{said}");
    assert!(!said.contains("# done"), "{said}");
}

#[test]
fn a_model_beyond_this_nodes_memory_is_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let job = common::tiny_job(dir.path(), "big.toml", "");
    // 1t: 16 TB of fp32 weights, gradients and AdamW state on one rank fit no machine.
    let (ok, said) = train_alone(&job, &["model.size=\"1t\"", "train.steps=1", "optim.warmup_steps=0"]);
    assert!(!ok && said.contains("`model`: needs at least") && said.contains("bytes are available"), "{said}");
}
