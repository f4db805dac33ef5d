//! Running a sweep's points: each point's configuration is derived from the job file and checked
//! before anything is launched, then each point runs as one launcher command (an `srun` step inside
//! the current allocation by default, `mpirun` outside Slurm) writing its metrics under
//! `OUT/points`. The JSON sidecar of the report records versions, transport and environment.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::json;

use super::{Mode, PointMeta, PointSummary};
use crate::config::JobConfig;
use crate::error::{Error, Result};
use crate::metrics::train_flops_per_token;

/// What to sweep.
#[derive(Debug, Clone)]
pub struct SweepPlan {
    /// The job file.
    pub job: PathBuf,
    /// `--set` overrides applied to every point (before the sweep's own).
    pub sets: Vec<String>,
    /// Strong or weak scaling.
    pub mode: Mode,
    /// Rank counts, one point each.
    pub ranks: Vec<usize>,
    /// Ranks per node: a point on `r` ranks asks for `ceil(r / ranks_per_node)` nodes.
    pub ranks_per_node: usize,
    /// Tensor-parallel degree of every point.
    pub tp: usize,
    /// Pipeline-parallel degree of every point.
    pub pp: usize,
    /// Strong scaling: sequences per optimizer step (default: the job's micro-batch at the largest
    /// data-parallel degree).
    pub global_batch: Option<usize>,
    /// Launcher words; `{ranks}` and `{nodes}` are replaced per point.
    pub launch: Vec<String>,
    /// The meshtrain binary the points run.
    pub binary: PathBuf,
    /// The sweep directory.
    pub out: PathBuf,
}

/// The launcher used when none is given: an srun step inside a Slurm allocation (PMIx: Open MPI is
/// direct-launched through Slurm's PMIx plugin), mpirun otherwise.
pub fn default_launch() -> Vec<String> {
    let words = if std::env::var_os("SLURM_JOB_ID").is_some() {
        "srun --mpi=pmix --nodes={nodes} --ntasks={ranks}".to_string()
    } else {
        use std::os::unix::fs::MetadataExt;
        let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
        format!("mpirun -np {{ranks}} --oversubscribe --bind-to none{}", if root { " --allow-run-as-root" } else { "" })
    };
    words.split_whitespace().map(str::to_string).collect()
}

/// Environment variables recorded with each point (launcher, transport, placement).
const RECORDED_ENV: [&str; 18] = [
    "MESHTRAIN_",
    "SLURM_JOB_",
    "SLURM_NNODES",
    "SLURM_NTASKS",
    "SLURM_CPUS_",
    "SLURM_GPUS",
    "SLURM_CLUSTER_NAME",
    "SLURM_MPI_TYPE",
    "OMPI_MCA_",
    "FI_",
    "UCX_",
    "NCCL_",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "OPENBLAS_",
    "RUST_LOG",
];

fn recorded_env() -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> =
        std::env::vars().filter(|(k, _)| RECORDED_ENV.iter().any(|p| k.starts_with(p))).collect();
    env.sort();
    env
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map_or_else(|_| "unknown".into(), |h| h.trim().to_string())
}

/// The points of `plan` with the `--set` overrides each one runs with; every point's configuration
/// is loaded and checked here, so that a bad point fails before any runs.
pub fn plan_points(plan: &SweepPlan) -> Result<Vec<(PointMeta, Vec<String>)>> {
    let bad = |msg: String| Error::InvalidArgument(format!("sweep: {msg}"));
    if plan.ranks.is_empty() || plan.ranks.contains(&0) || plan.ranks_per_node == 0 {
        return Err(bad("--ranks needs rank counts >= 1 and --ranks-per-node >= 1".into()));
    }
    let group = plan.tp * plan.pp;
    if let Some(r) = plan.ranks.iter().find(|&&r| group == 0 || r % group != 0) {
        return Err(bad(format!("{r} ranks are not a multiple of tp x pp = {} x {}", plan.tp, plan.pp)));
    }
    let base = JobConfig::load(&plan.job, &plan.sets)?;
    let accum = base.train.grad_accum;
    let max_dp = plan.ranks.iter().max().expect("ranks is not empty") / group;
    let global = plan.global_batch.unwrap_or(base.train.micro_batch * max_dp);
    let mut points = Vec::with_capacity(plan.ranks.len());
    for &ranks in &plan.ranks {
        let dp = ranks / group;
        let micro_batch = match plan.mode {
            Mode::Weak => base.train.micro_batch,
            Mode::Strong if global % (dp * accum) == 0 => global / (dp * accum),
            Mode::Strong => {
                return Err(bad(format!(
                    "strong scaling: the global batch {global} does not split over dp = {dp} ranks x grad_accum = {accum} \
                     (point of {ranks} ranks; set --global-batch)"
                )))
            }
        };
        let mut sets = plan.sets.clone();
        sets.extend([
            format!("parallel.tp={}", plan.tp),
            format!("parallel.pp={}", plan.pp),
            format!("parallel.dp={dp}"),
            format!("train.micro_batch={micro_batch}"),
            "train.eval_every=0".to_string(),
            "checkpoint.every=0".to_string(),
        ]);
        let cfg = JobConfig::load(&plan.job, &sets)?;
        let meta = PointMeta {
            job_id: std::env::var("SLURM_JOB_ID").ok(),
            nodelist: std::env::var("SLURM_JOB_NODELIST").unwrap_or_else(|_| hostname()),
            env: recorded_env(),
            ..PointMeta::new(
                plan.mode,
                ranks.div_ceil(plan.ranks_per_node),
                ranks,
                [plan.tp, plan.pp, dp],
                [micro_batch, accum, cfg.train.seq_len],
                train_flops_per_token(&cfg.model, cfg.train.seq_len),
            )
        };
        points.push((meta, sets));
    }
    Ok(points)
}

/// The launcher command of one point: the launcher words (placeholders filled), then
/// `BINARY train JOB --set ... --metrics METRICS`.
pub fn point_command(plan: &SweepPlan, meta: &PointMeta, sets: &[String], metrics: &Path) -> Vec<String> {
    let mut words: Vec<String> = plan
        .launch
        .iter()
        .map(|w| w.replace("{ranks}", &meta.ranks.to_string()).replace("{nodes}", &meta.nodes.to_string()))
        .collect();
    words.push(plan.binary.display().to_string());
    words.push("train".into());
    words.push(plan.job.display().to_string());
    for s in sets {
        words.push("--set".into());
        words.push(s.clone());
    }
    words.push("--metrics".into());
    words.push(metrics.display().to_string());
    words
}

/// Runs every point of `plan` in order (output goes to this process's stdout/stderr) and writes
/// each point's meta next to its metrics. A failing point stops the sweep with an error naming it.
pub fn run_points(plan: &SweepPlan) -> Result<Vec<PathBuf>> {
    let points = plan_points(plan)?;
    let dir = plan.out.join("points");
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
    let mut written = Vec::with_capacity(points.len());
    for (mut meta, sets) in points {
        let metrics = dir.join(format!("{}.jsonl", meta.name()));
        meta.command = point_command(plan, &meta, &sets, &metrics);
        log::info!("sweep: {} ({}): {}", meta.name(), meta.layout(), meta.command.join(" "));
        let status = Command::new(&meta.command[0])
            .args(&meta.command[1..])
            .status()
            .map_err(|e| Error::io(format!("sweep: start `{}`", meta.command[0]), e))?;
        if !status.success() {
            return Err(Error::Check(format!("sweep: point {} failed ({status}): {}", meta.name(), meta.command.join(" "))));
        }
        let path = dir.join(format!("{}.json", meta.name()));
        let text = serde_json::to_string_pretty(&meta)
            .map_err(|e| Error::file(&path, None, format!("cannot encode: {e}")))?;
        std::fs::write(&path, text).map_err(|e| Error::io(format!("write {}", path.display()), e))?;
        written.push(path);
    }
    Ok(written)
}

/// The commit meshtrain was built from when known: `MESHTRAIN_GIT_SHA`, else `git rev-parse HEAD`
/// in the current directory.
fn git_sha() -> Option<String> {
    if let Some(sha) = crate::env::git_sha() {
        return Some(sha);
    }
    let out = Command::new("git").args(["rev-parse", "HEAD"]).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The sweep's JSON sidecar: versions, transport, jobs, node lists, and every point's meta.
pub fn sidecar(points: &[PointSummary], warmup: usize) -> serde_json::Value {
    let mut jobs: Vec<&str> = points.iter().filter_map(|p| p.meta.job_id.as_deref()).collect();
    jobs.sort();
    jobs.dedup();
    let mut nodelists: Vec<&str> = points.iter().map(|p| p.meta.nodelist.as_str()).collect();
    nodelists.sort();
    nodelists.dedup();
    let point_env = |k: &str| points.iter().flat_map(|p| &p.meta.env).find(|(n, _)| n == k).map(|(_, v)| v.clone());
    json!({
        "meshtrain_version": env!("CARGO_PKG_VERSION"),
        "git_sha": git_sha(),
        "mpi_library": mpi::environment::library_version().ok().map(|v| v.lines().next().unwrap_or("").trim_end_matches('\0').trim().to_string()),
        "transport": point_env("MESHTRAIN_TRANSPORT").unwrap_or_else(|| "auto (shm within a node, tcp between nodes)".into()),
        "provider": point_env("FI_PROVIDER"),
        "job_ids": jobs,
        "nodelists": nodelists,
        "report_host": hostname(),
        "warmup_steps_left_out": warmup,
        "efficiency": {
            "strong": "T_1 * N_1 / (T_N * N), T = median step time, N = ranks, 1 = fewest ranks",
            "weak": "(tokens/s/rank)_N / (tokens/s/rank)_1",
        },
        "points": points.iter().map(|p| &p.meta).collect::<Vec<_>>(),
    })
}
