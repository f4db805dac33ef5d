//! Helpers for tests that start real rank processes with `mpirun --oversubscribe`.
#![allow(dead_code)] // each test binary uses a different subset

pub mod gpu;

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The meshtrain binary built for these tests, or `MT_MESHTRAIN_BIN` when set (the GPU bundle runs
/// these test programs far from the build tree, see benches/bundle/).
pub fn meshtrain() -> PathBuf {
    match std::env::var_os("MT_MESHTRAIN_BIN") {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => PathBuf::from(env!("CARGO_BIN_EXE_meshtrain")),
    }
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
    /// Lines that rank `r` printed on stderr (mpirun's `--tag-output`), without their tags.
    /// mpirun tags each line of what it forwards, in the pieces it reads: a piece may end inside a
    /// line (when a rank writes faster than it is read), and then another rank's tag follows on
    /// the same output line while the rest of the line comes later under its own tag. So the text
    /// after each tag, up to the next tag or the end of its line, is joined into the rank's stream
    /// before that is cut into lines; untagged lines (mpirun's own messages) belong to nobody.
    pub fn rank_stderr(&self, r: usize) -> Vec<String> {
        let mut stream = String::new();
        for text in [&self.stderr, &self.stdout] {
            let mut rest = text.as_str();
            while let Some((start, len, rank)) = tag_at(rest) {
                let body = &rest[start + len..];
                let end = match (tag_at(body), body.find('\n')) {
                    (Some((t, _, _)), Some(nl)) => t.min(nl + 1),
                    (Some((t, _, _)), None) => t,
                    (None, Some(nl)) => nl + 1,
                    (None, None) => body.len(),
                };
                if rank == r {
                    stream.push_str(&body[..end]);
                }
                rest = &body[end..];
            }
        }
        stream.lines().map(str::to_string).collect()
    }

    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }
}

/// The first `[J,N]<stderr>:` tag in `s` (J the job, N the rank): its offset, its length and N.
fn tag_at(s: &str) -> Option<(usize, usize, usize)> {
    let mut from = 0;
    while let Some(i) = s[from..].find("]<stderr>:").map(|i| i + from) {
        let open = s[..i].rfind('[');
        let tag = open.and_then(|o| {
            let (job, rank) = s[o + 1..i].split_once(',')?;
            let ok = !job.is_empty() && job.bytes().all(|b| b.is_ascii_digit());
            Some((o, rank.parse::<usize>().ok().filter(|_| ok)?))
        });
        if let Some((o, rank)) = tag {
            return Some((o, i + "]<stderr>:".len() - o, rank));
        }
        from = i + 1;
    }
    None
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

/// Spawns `cmd` (a training job writing the metrics file `metrics`), waits until `lines` steps
/// are logged there (failing the test after a minute: the job never trained), then sends
/// `signal` (`KILL`, `USR1`, ...) to the process `target(launcher pid)` names (e.g. the launcher
/// itself, or a rank through [`rank_pids`]). Returns the running launcher.
pub fn spawn_then_signal(cmd: Command, metrics: &std::path::Path, lines: usize, signal: &str, target: impl FnOnce(u32) -> u32) -> Child {
    let child = spawn(cmd);
    let start = Instant::now();
    while std::fs::read_to_string(metrics).unwrap_or_default().lines().count() < lines {
        assert!(start.elapsed() < Duration::from_secs(60), "the job never trained");
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = target(child.id());
    let st = Command::new("kill").args([&format!("-{signal}"), &pid.to_string()]).status().unwrap();
    assert!(st.success(), "kill -{signal} {pid}");
    child
}

/// The pid of world rank `rank` among `mpirun_pid`'s children (the test fails if it is gone).
pub fn rank_pid(mpirun_pid: u32, rank: usize) -> u32 {
    rank_pids(mpirun_pid).iter().find(|(r, _)| *r == rank).unwrap_or_else(|| panic!("rank {rank} is not running")).1
}

/// Files in /dev/shm whose names start with `prefix`.
pub fn shm_files(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with(prefix)).collect())
        .unwrap_or_default()
}

/// A tiny-model job on synthetic data (20 steps, (B, T) = (4, 32)) written to `dir/name`, with the
/// given extra TOML lines at the end.
pub fn tiny_job(dir: &std::path::Path, name: &str, extra: &str) -> PathBuf {
    let path = dir.join(name);
    let text = format!(
        r#"device = "cpu"
[model]
size = "tiny"
[data]
source = "synthetic"
shuffle = true
seed = 3
[train]
steps = 20
micro_batch = 4
seq_len = 32
seed = 7
eval_every = 0
log_every = 10
[optim]
lr = 2e-3
warmup_steps = 5
grad_clip = 1.0
{extra}
"#
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs `meshtrain train JOB --metrics METRICS [--set ...]` on `np` ranks and asserts success.
pub fn train(np: usize, job: &std::path::Path, metrics: &std::path::Path, sets: &[String]) -> Finished {
    train_env(np, job, metrics, sets, &[])
}

/// [`train`] with the environment variables `env` set for every rank.
pub fn train_env(np: usize, job: &std::path::Path, metrics: &std::path::Path, sets: &[String], env: &[(&str, &str)]) -> Finished {
    let mut cmd = mpirun(np);
    cmd.envs(env.iter().copied());
    cmd.arg("train").arg(job).arg("--metrics").arg(metrics);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = run(cmd, Duration::from_secs(300));
    // mpirun may exit 0 when every rank failed (orte_abort_on_non_zero_status=0): no metrics file
    // is a failure too, reported with what the ranks printed.
    assert!(
        out.success() && metrics.exists(),
        "train on {np} ranks failed: {:?}, metrics file {}\n{}\n{}",
        out.status,
        if metrics.exists() { "written" } else { "missing" },
        out.stdout,
        out.stderr
    );
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

/// Exports the checkpoint `ckpt` to the file `out` and reads every tensor back (name, global
/// shape, values), sorted by name.
pub fn export(ckpt: &std::path::Path, out: &std::path::Path) -> Vec<meshtrain::checkpoint::ExportedTensor> {
    let st = Command::new(meshtrain()).args(["export", "--optimizer"]).arg(ckpt).arg(out).output().unwrap();
    assert!(st.status.success(), "export failed: {}", String::from_utf8_lossy(&st.stderr));
    meshtrain::checkpoint::read_exported(out).unwrap().1
}

/// Asserts that the model parameters of `got` are within `rel` of `want` in relative L2 norm
/// (`|a - b| / |b|`; element-wise relative error is meaningless for elements near zero): over the
/// whole model, and each tensor alone within `PER_TENSOR_SLACK * rel`.
///
/// The per-tensor slack: a tensor with many near-zero gradient components collects rounding noise
/// that AdamW's normalisation amplifies into steps of up to ~lr, and that noise depends on the
/// summation order of the layout and on the BLAS kernels the CPU selects (measured: 1.12e-5 for
/// `h.1.attn.proj.weight` of TP2 after 20 steps on one Xeon, below 1e-5 on another). A wrong
/// gradient or a missed reduction moves its tensor by orders of magnitude more.
///
/// The key third of each `attn.qkv.bias` is left out: its gradient is zero in exact arithmetic
/// (adding a constant to every key's score leaves each query's softmax unchanged), so what it
/// receives is pure rounding noise, steps of ~lr whose signs depend on summation order: two
/// layouts legitimately disagree there at the 1e-4 level.
pub fn assert_params_close(
    got: &[meshtrain::checkpoint::ExportedTensor],
    want: &[meshtrain::checkpoint::ExportedTensor],
    rel: f64,
    what: &str,
) {
    const PER_TENSOR_SLACK: f64 = 5.0;
    assert_eq!(got.len(), want.len(), "{what}: tensor counts differ");
    let (mut diff_all, mut norm_all) = (0f64, 0f64);
    let mut compared = 0;
    let mut worst = (0f64, String::new());
    for (a, b) in got.iter().zip(want) {
        assert_eq!((&a.0, &a.1), (&b.0, &b.1), "{what}: tensor tables differ");
        if !a.0.starts_with("model/") {
            continue;
        }
        let n = a.2.len();
        let parts: Vec<std::ops::Range<usize>> =
            if a.0.ends_with("attn.qkv.bias") { vec![0..n / 3, 2 * n / 3..n] } else { std::iter::once(0..n).collect() };
        for r in parts {
            let diff: f64 = a.2[r.clone()].iter().zip(&b.2[r.clone()]).map(|(x, y)| f64::from(x - y).powi(2)).sum();
            let norm: f64 = b.2[r.clone()].iter().map(|y| f64::from(*y).powi(2)).sum();
            let e = (diff / norm.max(1e-30)).sqrt();
            let bound = PER_TENSOR_SLACK * rel;
            assert!(e <= bound, "{what}: {}[{r:?}] relative L2 difference {e:.3e} > {bound:e}", a.0);
            if e > worst.0 {
                worst = (e, a.0.clone());
            }
            diff_all += diff;
            norm_all += norm;
        }
        compared += 1;
    }
    assert!(compared > 0, "{what}: no model tensors to compare");
    let e = (diff_all / norm_all.max(1e-30)).sqrt();
    assert!(e <= rel, "{what}: whole-model relative L2 difference {e:.3e} > {rel:e}");
    // What was measured, for the notes (shown with --nocapture).
    eprintln!("{what}: parameters within {e:.2e} over the model, worst tensor {} {:.2e}", worst.1, worst.0);
}

/// Whether this machine lets one process read another's memory (`process_vm_readv`; seccomp
/// profiles of some containers forbid it), checked by reading a child process. Single-copy reads
/// between ranks need it; where it is missing they must fall back, not fail.
pub fn cross_process_reads_allowed() -> bool {
    let Ok(mut child) = Command::new("sleep").arg("10").spawn() else { return false };
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", child.id())).unwrap_or_default();
    let start = maps.split('-').next().and_then(|a| u64::from_str_radix(a, 16).ok());
    let ok = start.is_some_and(|addr| {
        let mut byte = [0u8; 1];
        let local = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
        let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: 1 };
        // SAFETY: `local` points at one writable byte we own; the kernel checks `remote`.
        unsafe { libc::process_vm_readv(child.id() as libc::pid_t, &local, 1, &remote, 1, 0) == 1 }
    });
    let _ = child.kill();
    let _ = child.wait();
    ok
}
