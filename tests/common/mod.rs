//! Helpers for tests that start real rank processes with `mpirun --oversubscribe`.
#![allow(dead_code)] // each test binary uses a different subset

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The meshtrain binary built for these tests.
pub fn meshtrain() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_meshtrain"))
}

/// `mpirun` for `np` ranks on this machine: oversubscribed, unbound, root allowed, output tagged
/// with `[job,rank]<stream>:`.
pub fn mpirun(np: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--oversubscribe", "--bind-to", "none", "--tag-output", "-np", &np.to_string()])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        // Let every rank report its own error instead of mpirun killing the rest at the first exit.
        .env("OMPI_MCA_orte_abort_on_non_zero_status", "0")
        .env("RUST_BACKTRACE", "1");
    c.arg(meshtrain());
    c
}

/// What a finished (or killed) run left behind.
pub struct Finished {
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Finished {
    /// Lines that rank `r` printed on stderr (tagged output).
    pub fn rank_stderr(&self, r: usize) -> Vec<&str> {
        let tag = format!(",{r}]<stderr>:");
        self.stderr.lines().chain(self.stdout.lines()).filter(|l| l.contains(&tag)).collect()
    }

    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }
}

fn drain(mut r: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = r.read_to_string(&mut s);
        s
    })
}

/// Starts `cmd` with piped output.
pub fn spawn(mut cmd: Command) -> Child {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).stdin(Stdio::null());
    cmd.spawn().expect("mpirun starts (is OpenMPI installed?)")
}

/// Waits for `child` at most `limit`; kills it past that (status None). Output streams already
/// taken by the caller come back empty.
pub fn wait(mut child: Child, limit: Duration) -> Finished {
    let start = Instant::now();
    let out = child.stdout.take().map(drain);
    let err = child.stderr.take().map(drain);
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break Some(s);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = |h: Option<std::thread::JoinHandle<String>>| h.map(|h| h.join().unwrap()).unwrap_or_default();
    Finished { status, stdout: text(out), stderr: text(err), elapsed: start.elapsed() }
}

/// Runs `cmd` to completion within `limit`.
pub fn run(cmd: Command, limit: Duration) -> Finished {
    wait(spawn(cmd), limit)
}

/// Pids of the meshtrain rank processes that are children of `mpirun_pid`, by world rank.
pub fn rank_pids(mpirun_pid: u32) -> Vec<(usize, u32)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let ppid: u32 = stat.rsplit(')').next().and_then(|s| s.split_whitespace().nth(1)).and_then(|p| p.parse().ok()).unwrap_or(0);
        if ppid != mpirun_pid {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        for var in env.split(|&b| b == 0) {
            if let Some(r) = var.strip_prefix(b"OMPI_COMM_WORLD_RANK=") {
                if let Some(rank) = std::str::from_utf8(r).ok().and_then(|s| s.parse().ok()) {
                    out.push((rank, pid));
                }
            }
        }
    }
    out.sort();
    out
}

/// Files in /dev/shm whose names start with `prefix`.
pub fn shm_files(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with(prefix)).collect())
        .unwrap_or_default()
}

/// Runs `meshtrain train JOB --metrics METRICS [--set ...]` on `np` ranks and asserts success.
pub fn train(np: usize, job: &std::path::Path, metrics: &std::path::Path, sets: &[String]) -> Finished {
    let mut cmd = mpirun(np);
    cmd.arg("train").arg(job).arg("--metrics").arg(metrics);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = run(cmd, Duration::from_secs(300));
    assert!(out.success(), "train on {np} ranks failed: {:?}\n{}\n{}", out.status, out.stdout, out.stderr);
    out
}

/// (step, loss) of every line of a metrics file.
pub fn losses(metrics: &std::path::Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
        })
        .collect()
}
