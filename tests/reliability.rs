//! Reliability cases tried as a hostile user would, with real processes: two jobs on one
//! checkpoint directory, a rank killed during start-up under a launcher that does not end the job,
//! MPI's listeners, a data shard changed under a running job, and the small refusals (exit codes,
//! a layout that does not fit the world, a timeout of `inf`). tests/README.md, Reliability, lists
//! them.
//!
//! Every job runs under a watchdog far above the seconds each takes, so a hang fails the test
//! instead of blocking CI.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Kills a job that did not end by itself.
const WATCHDOG: Duration = Duration::from_secs(120);

/// A one-rank tiny job checkpointing into `ckpt`, with `steps` steps.
fn ckpt_job(dir: &Path, name: &str, ckpt: &Path, steps: u64) -> PathBuf {
    let extra = format!(
        "[checkpoint]\ndir = {:?}\nevery = 1\nkeep = 2",
        ckpt.display().to_string()
    );
    let path = common::tiny_job(dir, name, &extra);
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("\nsteps = 20", &format!("\nsteps = {steps}"))
        .replace("warmup_steps = 5", "warmup_steps = 1");
    std::fs::write(&path, text).unwrap();
    path
}

/// `meshtrain ARGS` as a world of one rank (no launcher).
fn alone(args: &[&str]) -> Command {
    let mut c = Command::new(common::meshtrain());
    c.args(args).stdin(Stdio::null());
    c
}

/// Runs `cmd` under the watchdog; (exit code, stdout + stderr).
fn finish(cmd: Command) -> (Option<i32>, String) {
    let out = common::run(cmd, WATCHDOG);
    assert!(
        out.status.is_some(),
        "hung (killed after {WATCHDOG:?}):\n{}\n{}",
        out.stdout,
        out.stderr
    );
    (out.status.and_then(|s| s.code()), out.stdout + &out.stderr)
}

#[test]
fn a_second_job_on_a_checkpoint_directory_is_refused_naming_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ckpt = d.join("ckpt");
    let long = ckpt_job(d, "long.toml", &ckpt, 100_000);
    let mut first = common::spawn(alone(&["train", long.to_str().unwrap()]));
    let pid = first.id();
    let lock = ckpt.join(meshtrain::checkpoint::LOCK_FILE);
    let start = Instant::now();
    while !std::fs::read_to_string(&lock)
        .unwrap_or_default()
        .contains(&format!("pid={pid}"))
    {
        assert!(
            start.elapsed() < WATCHDOG && first.try_wait().unwrap().is_none(),
            "the first job never took the lock"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // A save that a crashed job left behind, and one the first job may be writing right now.
    std::fs::create_dir_all(ckpt.join("step_00000099.tmp-deadbeef")).unwrap();

    let short = ckpt_job(d, "short.toml", &ckpt, 2);
    let (code, said) = finish(alone(&["train", short.to_str().unwrap()]));
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains("in use by another job")
            && said.contains(&format!("pid={pid}"))
            && said.contains("host="),
        "{said}"
    );
    assert!(!said.contains("step 1/"), "the second job trained: {said}");
    assert!(
        first.try_wait().unwrap().is_none(),
        "the first job died: the second one disturbed it"
    );

    // A SIGKILLed holder leaves no lock behind: the next job takes the directory, and its prune
    // removes the dead job's temporaries.
    first.kill().unwrap();
    first.wait().unwrap();
    let (code, said) = finish(alone(&["train", short.to_str().unwrap()]));
    assert_eq!(code, Some(0), "{said}");
    let left: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !left.iter().any(|n| n.contains(".tmp-")),
        "leftovers not pruned: {left:?}"
    );
}
