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

/// Launcher options of the start-up case: the job is not ended when a process fails.
fn mpirun_without_abort(np: usize) -> Command {
    let mut c = common::mpirun(np);
    c.env("OMPI_MCA_orte_abort_on_non_zero_status", "0");
    c
}

#[test]
fn a_rank_killed_before_mpi_init_ends_the_others_naming_the_phase() {
    // Three meshtrain ranks and a fourth process that dies at once: the three wait in MPI_Init
    // for it, and mpirun (told not to abort) does not end them.
    let mut cmd = mpirun_without_abort(3);
    cmd.env("MESHTRAIN_BOOTSTRAP_TIMEOUT", "3").env("MESHTRAIN_TIMEOUT", "10");
    cmd.args(["selftest", "--counts", "1", "--large", "0"]).args([":", "-np", "1", "bash", "-c", "sleep 0.3; kill -9 $$"]);
    let child = common::spawn(cmd);
    let launcher = child.id();
    let start = Instant::now();
    let mut seen = 0;
    loop {
        let ranks = common::rank_pids(launcher).into_iter().filter(|(r, _)| *r < 3).count();
        seen = seen.max(ranks);
        if seen > 0 && ranks == 0 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "ranks still alive after 60 s (seen {seen})");
        std::thread::sleep(Duration::from_millis(100));
    }
    let ended = start.elapsed();
    // Open MPI's mpirun itself may linger after its processes are gone (it is told not to
    // abort): the test ends it; what matters is that no rank hangs and each says why.
    let out = common::wait(child, Duration::from_secs(5));
    assert!(ended < Duration::from_secs(30), "ranks took {ended:?} to give up");
    for r in 0..3 {
        let said = out.rank_stderr(r).join("\n");
        assert!(said.contains(&format!("rank {r}: start-up phase `MPI_Init` did not finish within 3 s")), "rank {r}: {said}\n{}", out.stderr);
    }
}

/// Inodes of the sockets process `pid` has open.
fn socket_inodes(pid: u32) -> Vec<String> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return Vec::new() };
    fds.flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|l| l.to_str().and_then(|s| s.strip_prefix("socket:[")).map(|s| s.trim_end_matches(']').to_string()))
        .collect()
}

/// The local addresses (hex, as /proc/net/tcp{,6} writes them) of the TCP sockets process `pid`
/// listens on.
fn listening(pid: u32) -> Vec<String> {
    let mine = socket_inodes(pid);
    let mut out = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 9 && f[3] == "0A" && mine.iter().any(|i| i == f[9]) {
                out.push(f[1].to_string());
            }
        }
    }
    out
}

#[test]
fn mpi_opens_no_listener_on_the_wildcard_address_within_one_node() {
    let dir = tempfile::tempdir().unwrap();
    let job = ckpt_job(dir.path(), "listen.toml", &dir.path().join("ckpt"), 100_000);
    let mut cmd = common::mpirun(3);
    cmd.arg("train").arg(&job).args(["--set", "parallel.dp=3", "--set", "checkpoint.every=0"]);
    let child = common::spawn(cmd);
    let launcher = child.id();
    let start = Instant::now();
    // Past MPI_Init and the bootstrap every rank has its own listener (127.0.0.1).
    let sockets = loop {
        let ranks = common::rank_pids(launcher);
        let sockets: Vec<(usize, Vec<String>)> = ranks.iter().map(|&(r, pid)| (r, listening(pid))).collect();
        if sockets.len() == 3 && sockets.iter().all(|(_, s)| !s.is_empty()) {
            break sockets;
        }
        assert!(start.elapsed() < WATCHDOG, "ranks never listened: {sockets:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    Command::new("kill").args(["-TERM", &launcher.to_string()]).status().unwrap();
    let out = common::wait(child, WATCHDOG);
    for (r, addrs) in sockets {
        let wildcard: Vec<&String> = addrs.iter().filter(|a| a.split(':').next().is_some_and(|ip| ip.bytes().all(|b| b == b'0'))).collect();
        assert!(wildcard.is_empty(), "rank {r} listens on the wildcard address: {addrs:?}\n{}", out.stderr);
    }
    assert!(out.stderr.contains("MPI defaults (MCA, unset by the user): btl=self,vader pml=ob1"), "{}", out.stderr);
}

/// Open MPI's TCP transport (what a job across nodes uses; forced here with `OMPI_MCA_btl`)
/// listens on every interface: training finalizes MPI once its own world is up, so once the steps
/// run no rank listens on the wildcard address.
#[test]
fn mpi_listeners_close_once_training_runs_even_with_its_tcp_transport() {
    let dir = tempfile::tempdir().unwrap();
    let job = ckpt_job(dir.path(), "tcp.toml", &dir.path().join("ckpt"), 100_000);
    let metrics = dir.path().join("m.jsonl");
    let mut cmd = common::mpirun(2);
    cmd.env("OMPI_MCA_btl", "self,tcp").env("OMPI_MCA_pml", "ob1").arg("train").arg(&job).arg("--metrics").arg(&metrics);
    cmd.args(["--set", "parallel.dp=2", "--set", "checkpoint.every=0"]);
    let child = common::spawn(cmd);
    let launcher = child.id();
    let start = Instant::now();
    // A step has finished: every rank is past MPI_Finalize.
    while std::fs::read_to_string(&metrics).map_or(true, |m| m.lines().count() < 2) {
        assert!(start.elapsed() < WATCHDOG, "no training step within the deadline");
        std::thread::sleep(Duration::from_millis(100));
    }
    let sockets: Vec<(usize, Vec<String>)> = common::rank_pids(launcher).iter().map(|&(r, pid)| (r, listening(pid))).collect();
    Command::new("kill").args(["-TERM", &launcher.to_string()]).status().unwrap();
    let out = common::wait(child, WATCHDOG);
    assert_eq!(sockets.len(), 2, "{sockets:?}\n{}", out.stderr);
    for (r, addrs) in sockets {
        assert!(!addrs.is_empty(), "rank {r}: its own listener is gone too: {}", out.stderr);
        let wildcard: Vec<&String> = addrs.iter().filter(|a| a.split(':').next().is_some_and(|ip| ip.bytes().all(|b| b == b'0'))).collect();
        assert!(wildcard.is_empty(), "rank {r} listens on the wildcard address after start-up: {addrs:?}\n{}", out.stderr);
    }
}

#[test]
fn deadlines_of_inf_and_unreadable_or_broken_job_files_are_configuration_errors() {
    let dir = tempfile::tempdir().unwrap();
    let job = common::tiny_job(dir.path(), "job.toml", "");
    for (key, value) in [("MESHTRAIN_TIMEOUT", "inf"), ("MESHTRAIN_TIMEOUT", "1e400"), ("MESHTRAIN_BOOTSTRAP_TIMEOUT", "inf")] {
        let mut cmd = alone(&["train", job.to_str().unwrap(), "--set", "train.steps=1"]);
        cmd.env(key, value);
        let (code, said) = finish(cmd);
        assert_eq!(code, Some(2), "{key}={value}: {said}");
        assert!(said.contains(key) && said.contains(&format!("`{value}` is out of range")) && !said.contains("panicked"), "{said}");
    }
    let broken = dir.path().join("broken.toml");
    std::fs::write(&broken, "[train]\nsteps = = 3\n").unwrap();
    let missing = dir.path().join("missing.toml");
    for (path, needle) in [(&broken, "line 2, column 9"), (&missing, "missing.toml")] {
        let (code, said) = finish(alone(&["train", path.to_str().unwrap()]));
        assert_eq!(code, Some(2), "{}: {said}", path.display());
        assert!(said.contains("`job file`") && said.contains(needle), "{said}");
    }
}

#[test]
fn a_layout_that_does_not_fit_the_launched_world_is_refused_before_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let job = common::tiny_job(dir.path(), "grid.toml", "[parallel]\ntp = 2\npp = 2\ndp = 2");
    let mut cmd = common::mpirun(4);
    cmd.arg("train").arg(&job);
    let out = common::run(cmd, WATCHDOG);
    assert!(out.status.is_some(), "hung");
    let all = out.stdout.clone() + &out.stderr;
    // Rank 0 says it once (the others end with the same status, silently).
    let said = out.rank_stderr(0).join("\n");
    assert!(said.contains("tp 2 x pp 2 x dp 2 = 8 ranks, but the job has 4"), "rank 0: {all}");
    assert_eq!(all.matches("but the job has 4").count(), 1, "said more than once: {all}");
    assert!(!all.contains("bootstrap:") && !all.contains("comm 0x0"), "start-up ran before the refusal: {all}");
}

#[test]
fn an_agreed_nonfinite_stop_blames_no_rank() {
    let dir = tempfile::tempdir().unwrap();
    let job = common::tiny_job(dir.path(), "nan.toml", "[parallel]\ndp = 4");
    // The blame came from a race (a rank leaving before rank 0 had stopped): 1 run in 4 showed it
    // on main, so the case runs 5 times.
    for _ in 0..5 {
        let mut cmd = common::mpirun(4);
        cmd.arg("train").arg(&job).args(["--set", "train.steps=5", "--set", "optim.warmup_steps=1", "--set", "train.inject_nan_at=[3, 2]"]);
        let out = common::run(cmd, WATCHDOG);
        assert!(out.status.is_some(), "hung");
        let all = out.stdout.clone() + &out.stderr;
        assert!(all.contains("non-finite loss at step 3 on rank(s) 2 "), "{all}");
        assert!(!all.contains("blame:"), "a rank was blamed for an agreed stop: {all}");
    }
}

#[test]
fn forced_single_copy_reads_are_logged_as_used() {
    let mut cmd = common::mpirun(2);
    cmd.env("MESHTRAIN_CMA", "on").env("RUST_LOG", "info").args(["selftest", "--counts", "1"]);
    let out = common::run(cmd, WATCHDOG);
    assert!(out.success(), "{}\n{}", out.stdout, out.stderr);
    let all = out.stdout + &out.stderr;
    let line = all.lines().find(|l| l.contains("single-copy reads (CMA)")).unwrap_or_else(|| panic!("no CMA line: {all}"));
    assert!(!line.contains("copy through shared memory") && (line.contains("work and pay") || line.contains("use them anyway")), "{line}");
}

#[test]
fn a_data_shard_rewritten_under_a_running_job_stops_it_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let shard = d.join("train_000.bin");
    let tokens: Vec<u16> = (0..300_000u32).map(|i| (i * 31 % 251) as u16).collect();
    meshtrain::data::write_shard(&shard, &tokens).unwrap();
    let job = common::tiny_job(d, "shards.toml", "");
    let text = std::fs::read_to_string(&job).unwrap().replace("\"synthetic\"", &format!("{:?}", d.join("train_*.bin").display().to_string()));
    std::fs::write(&job, text.replace("\nsteps = 20", "\nsteps = 100000")).unwrap();
    let metrics = d.join("m.jsonl");
    let child = common::spawn(alone(&["train", job.to_str().unwrap(), "--metrics", metrics.to_str().unwrap()]));
    let start = Instant::now();
    while std::fs::read_to_string(&metrics).unwrap_or_default().lines().count() < 3 {
        assert!(start.elapsed() < WATCHDOG, "the job never trained");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Overwritten in place, three times larger (the 601 KB -> 1.8 MB).
    let bigger = std::fs::read(&shard).unwrap().repeat(3);
    std::fs::write(&shard, bigger).unwrap();
    let out = common::wait(child, WATCHDOG);
    let said = out.stdout + &out.stderr;
    assert_eq!(out.status.and_then(|s| s.code()), Some(1), "{said}");
    assert!(said.contains(&shard.display().to_string()) && said.contains("bytes since the job opened it"), "{said}");
}

#[test]
fn a_sigkilled_rank_leaves_no_libfabric_shm_region() {
    let dir = tempfile::tempdir().unwrap();
    let job = common::tiny_job(dir.path(), "ofi.toml", "[parallel]\ndp = 3");
    let text = std::fs::read_to_string(&job).unwrap().replace("\nsteps = 20", "\nsteps = 100000");
    std::fs::write(&job, text).unwrap();
    let mut cmd = common::mpirun(3);
    cmd.env("MESHTRAIN_TRANSPORT", "ofi").env("MESHTRAIN_OFI_PROVIDER", "shm").arg("train").arg(&job);
    let child = common::spawn(cmd);
    let launcher = child.id();
    let start = Instant::now();
    let victim = loop {
        let ranks = common::rank_pids(launcher);
        if ranks.len() == 3 && ranks.iter().all(|&(_, pid)| !common::shm_files(&format!("{pid}:")).is_empty()) {
            break ranks[2].1;
        }
        assert!(start.elapsed() < WATCHDOG, "the ranks never opened their libfabric shm regions: {ranks:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    Command::new("kill").args(["-KILL", &victim.to_string()]).status().unwrap();
    let killed = Instant::now();
    while !common::rank_pids(launcher).is_empty() {
        assert!(killed.elapsed() < WATCHDOG, "the surviving ranks did not end");
        std::thread::sleep(Duration::from_millis(100));
    }
    // mpirun, told not to abort, may linger after its processes are gone: the test ends it.
    let out = common::wait(child, Duration::from_secs(5));
    let left = common::shm_files(&format!("{victim}:"));
    assert!(left.is_empty(), "the killed rank's regions are left in /dev/shm: {left:?}\n{}", out.stderr);
}

#[test]
fn a_slow_but_alive_rank_is_named_with_its_lag_and_the_run_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let job = common::tiny_job(dir.path(), "slow.toml", "[parallel]\ndp = 3");
    let metrics = dir.path().join("m.jsonl");
    let mut cmd = common::mpirun(3);
    cmd.env("MESHTRAIN_FAULT", "slow-step@2:40").arg("train").arg(&job).arg("--metrics").arg(&metrics);
    cmd.args(["--set", "train.steps=30", "--set", "train.log_every=10"]);
    let out = common::run(cmd, WATCHDOG);
    let all = out.stdout.clone() + &out.stderr;
    assert!(out.success() && all.contains("# done: 30 steps"), "{all}");
    let named: Vec<&str> = all.lines().filter(|l| l.contains("# straggler at step")).collect();
    assert_eq!(named.len(), 3, "one report per 10 steps: {all}");
    assert!(named.iter().all(|l| l.contains("rank 2 works")), "{named:?}");
    let reports: Vec<(u64, f64)> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("straggler_rank").is_some())
        .map(|v| (v["straggler_rank"].as_u64().unwrap(), v["straggler_lag_s"].as_f64().unwrap()))
        .collect();
    assert_eq!(reports.len(), 3, "{reports:?}");
    // The injected 40 ms, less what the other ranks' own work varies by.
    assert!(reports.iter().all(|&(r, lag)| r == 2 && (0.02..0.1).contains(&lag)), "{reports:?}");
}

/// A NaN gradient with a finite loss is traced to the rank it came from, by every rank, on each
/// path that stages gradients for the reduction: the host reducer (CPU, ZeRO-0 and ZeRO-1), the
/// device reducer on its communication thread (emu), the device reduction after the backward
/// (emu, `MESHTRAIN_GPU_OVERLAP=off`), and one data-parallel rank under tensor parallelism (its own
/// squares before the TP sum; the NaN of rank 1's loss gradient reaches rank 0 through the TP
/// all-reduce inside the backward, so both ranks' own gradients are NaN and both are named).
/// `skip` goes on; `stop` ends every rank naming the step and rank.
#[test]
fn a_nan_gradient_with_a_finite_loss_is_traced_to_its_rank() {
    let dir = tempfile::tempdir().unwrap();
    // (name, ranks, [parallel] lines, --set overrides, environment, the ranks to be named)
    type Case<'a> = (&'a str, usize, &'a str, &'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case; 5] = [
        ("cpu_z0", 3, "dp = 3", &[], &[], "2"),
        ("cpu_z1", 3, "dp = 3\nzero = 1", &[], &[], "2"),
        ("emu_z1", 2, "dp = 2\nzero = 1", &["device=emu", "model.n_layer=1"], &[], "1"),
        ("emu_after", 2, "dp = 2", &["device=emu", "model.n_layer=1"], &[("MESHTRAIN_GPU_OVERLAP", "off")], "1"),
        ("cpu_tp2", 2, "tp = 2", &[], &[], "0, 1"),
    ];
    for (name, np, parallel, sets, env, named) in cases {
        let job = common::tiny_job(dir.path(), &format!("{name}.toml"), &format!("[parallel]\n{parallel}"));
        let source = np - 1;
        let mut cmd = common::mpirun(np);
        cmd.envs(env.iter().copied()).env("MESHTRAIN_FAULT", format!("nan-grad@{source}:2")).arg("train").arg(&job);
        cmd.args(["--set", "train.steps=3", "--set", "train.nonfinite=\"skip\""]);
        for s in sets {
            cmd.args(["--set", s]);
        }
        let out = common::run(cmd, WATCHDOG);
        let all = out.stdout.clone() + &out.stderr;
        let said = format!("step 2; the loss was finite on every rank; the non-finite gradients came from rank(s) {named}:");
        assert!(out.success() && all.contains(&said) && all.contains("# done: 3 steps"), "{name}: {all}");
    }
    // stop: every rank fails naming the step and the rank.
    let job = common::tiny_job(dir.path(), "stop.toml", "[parallel]\ndp = 2");
    let mut cmd = mpirun_without_abort(2);
    cmd.env("MESHTRAIN_FAULT", "nan-grad@0:2").arg("train").arg(&job).args(["--set", "train.steps=3"]);
    let out = common::run(cmd, WATCHDOG);
    // (mpirun may exit 0 when every rank failed: what the ranks said is the test.)
    assert!(!out.stdout.contains("# done"), "{}", out.stdout);
    for r in 0..2 {
        let said = out.rank_stderr(r).join("\n");
        assert!(said.contains("the non-finite gradients came from rank(s) 0; stopping"), "rank {r}: {said}");
    }
}
