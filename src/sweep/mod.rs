//! Scaling sweeps: run one training job at several rank counts, then summarize each point's
//! `--metrics` JSONL into `sweep.csv`, a JSON sidecar (`sweep.json`) and plots.
//!
//! Two modes, both data parallel over the ranks left after the fixed TP x PP (`dp = ranks / (tp pp)`):
//! - **strong**: the global batch (sequences per optimizer step) is fixed; each point's micro-batch is
//!   `global / (dp * grad_accum)`, so every point trains on the same tokens per step.
//!   Efficiency `E_N = T_1 N_1 / (T_N N)` with `T` the median step time and `(N_1, T_1)` the point
//!   with the fewest ranks.
//! - **weak**: the micro-batch per rank is fixed, the global batch grows with `dp`.
//!   Efficiency `E_N = (tokens/s/rank)_N / (tokens/s/rank)_1`.
//!
//! A sweep directory holds `points/<mode>-n<nodes>-r<ranks>.json` (what was run: [`PointMeta`]) and
//! `.jsonl` (rank 0's per-step metrics). `meshtrain sweep report DIR` rebuilds the CSV, sidecar and
//! plots from whatever points are there, so points may come from one allocation (srun steps) or
//! from one job each. The first `warmup` steps of each point are left out of every figure.
//! Step-time split (means over the measured steps, they add up to the mean step time): compute
//! (including hidden communication and the optimizer), exposed communication (gradient buckets not
//! hidden by backward plus ZeRO-3 gather waits), pipeline bubble.

pub mod cli;
pub mod plot;
pub mod run;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Strong or weak scaling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Fixed global batch.
    Strong,
    /// Fixed per-rank batch.
    Weak,
}

impl Mode {
    /// `strong` or `weak`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Strong => "strong",
            Mode::Weak => "weak",
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Mode, String> {
        match s {
            "strong" => Ok(Mode::Strong),
            "weak" => Ok(Mode::Weak),
            other => Err(format!("`{other}` is not strong or weak")),
        }
    }
}

/// What one sweep point ran; written next to its metrics as `<name>.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PointMeta {
    /// Strong or weak.
    pub mode: Mode,
    /// Nodes the point ran on.
    pub nodes: usize,
    /// Ranks (processes) of the point.
    pub ranks: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Pipeline-parallel degree.
    pub pp: usize,
    /// Data-parallel degree.
    pub dp: usize,
    /// Sequences per rank per micro-step.
    pub micro_batch: usize,
    /// Micro-steps per optimizer step.
    pub grad_accum: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Tokens trained per optimizer step (whole job).
    pub tokens_per_step: u64,
    /// Model FLOPs per trained token (see `metrics`).
    pub flops_per_token: f64,
    /// The Slurm job of the point, if it ran under Slurm.
    pub job_id: Option<String>,
    /// The nodes of the allocation the point ran in (Slurm's node list, else this host's name).
    pub nodelist: String,
    /// The command line that ran the point.
    pub command: Vec<String>,
    /// Launcher and runtime environment when the point ran (MESHTRAIN_*, SLURM_JOB_*, FI_*, ...).
    pub env: Vec<(String, String)>,
}

impl PointMeta {
    /// A point of `mode` on `ranks` ranks over `nodes` nodes with the grid `[tp, pp, dp]` and the
    /// batch `[micro_batch, grad_accum, seq_len]`, training `flops_per_token` model FLOPs per token;
    /// tokens per step are `dp * micro_batch * grad_accum * seq_len`. No Slurm job, node list,
    /// command or environment: callers that have them set the fields.
    pub fn new(mode: Mode, nodes: usize, ranks: usize, [tp, pp, dp]: [usize; 3], batch: [usize; 3], flops_per_token: f64) -> PointMeta {
        let [micro_batch, grad_accum, seq_len] = batch;
        PointMeta {
            mode,
            nodes,
            ranks,
            tp,
            pp,
            dp,
            micro_batch,
            grad_accum,
            seq_len,
            tokens_per_step: (dp * micro_batch * grad_accum * seq_len) as u64,
            flops_per_token,
            job_id: None,
            nodelist: String::new(),
            command: Vec::new(),
            env: Vec::new(),
        }
    }

    /// `tp1-pp1-dp4`.
    pub fn layout(&self) -> String {
        format!("tp{}-pp{}-dp{}", self.tp, self.pp, self.dp)
    }

    /// File stem of the point: `strong-n1-r4`.
    pub fn name(&self) -> String {
        format!("{}-n{}-r{}", self.mode.name(), self.nodes, self.ranks)
    }
}

/// One point's figures, as written to one CSV row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PointSummary {
    /// What ran.
    pub meta: PointMeta,
    /// Steps measured (after the warm-up).
    pub steps: usize,
    /// Median step time, seconds.
    pub step_median_s: f64,
    /// 10th percentile of the step time.
    pub step_p10_s: f64,
    /// 90th percentile of the step time.
    pub step_p90_s: f64,
    /// Job-wide tokens per second at the median step time.
    pub tokens_per_s: f64,
    /// `tokens_per_s / ranks`.
    pub tokens_per_s_per_rank: f64,
    /// Model TFLOP/s per rank at the median step time.
    pub tflops_per_rank: f64,
    /// MFU at the median step time, when the job knew a peak (`metrics.peak_tflops`, or the CPU's
    /// measured sgemm rate, or a known GPU's datasheet peak).
    pub mfu: Option<f64>,
    /// Mean compute seconds per step.
    pub compute_s: f64,
    /// Mean exposed-communication seconds per step (including ZeRO-3 gather waits).
    pub comm_exposed_s: f64,
    /// Mean pipeline-bubble seconds per step.
    pub bubble_s: f64,
    /// Scaling efficiency against the point of the same mode with the fewest ranks (module doc).
    pub efficiency: f64,
}

/// The `q`-quantile (0 <= q <= 1) of `sorted` by linear interpolation between the closest ranks:
/// position `q (n - 1)`. The median of an even count is the mean of the middle two.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    assert!(!sorted.is_empty() && (0.0..=1.0).contains(&q), "quantile of a non-empty slice, q in [0, 1]");
    let pos = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// A number field of a metrics line; absent fields read as `default` when given, else an error.
fn field(line: &serde_json::Value, key: &str, default: Option<f64>, file: &Path, lineno: usize) -> Result<f64> {
    match (line.get(key).and_then(|v| v.as_f64()), default) {
        (Some(v), _) => Ok(v),
        (None, Some(d)) if line.get(key).is_none() => Ok(d),
        _ => Err(Error::file(file, None, format!("line {lineno}: field `{key}` missing or not a number"))),
    }
}

/// Summarizes one point from its metrics lines (`metrics_file` names them in errors), leaving out
/// the first `warmup` steps. Efficiency is left at 0 (see [`fill_efficiency`]).
pub fn summarize(meta: PointMeta, text: &str, metrics_file: &Path, warmup: usize) -> Result<PointSummary> {
    let mut steps = Vec::new();
    for (i, l) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(l)
            .map_err(|e| Error::file(metrics_file, None, format!("line {}: {e}", i + 1)))?;
        steps.push((i + 1, v));
    }
    if steps.len() <= warmup {
        return Err(Error::file(
            metrics_file,
            None,
            format!("{} steps recorded, need more than the {warmup} warm-up steps", steps.len()),
        ));
    }
    let measured = &steps[warmup..];
    let mut step_s = Vec::with_capacity(measured.len());
    let (mut compute, mut exposed, mut bubble, mut mfu_peak) = (Vec::new(), Vec::new(), Vec::new(), None);
    for (lineno, v) in measured {
        let s = field(v, "step_s", None, metrics_file, *lineno)?;
        if !(s > 0.0 && s.is_finite()) {
            return Err(Error::file(metrics_file, None, format!("line {lineno}: step_s = {s} is not a positive time")));
        }
        step_s.push(s);
        compute.push(field(v, "compute_s", None, metrics_file, *lineno)?);
        exposed.push(
            field(v, "comm_exposed_s", Some(0.0), metrics_file, *lineno)?
                + field(v, "param_gather_wait_s", Some(0.0), metrics_file, *lineno)?,
        );
        bubble.push(field(v, "bubble_s", Some(0.0), metrics_file, *lineno)?);
        // The job's peak (all devices) is model_tflops / mfu of any line that has an MFU.
        if let (Some(m), Some(t)) = (v.get("mfu").and_then(|m| m.as_f64()), v.get("model_tflops").and_then(|t| t.as_f64())) {
            if m > 0.0 {
                mfu_peak = Some(t / m);
            }
        }
    }
    let mut sorted = step_s.clone();
    sorted.sort_by(f64::total_cmp);
    let median = quantile(&sorted, 0.5);
    let tokens_per_s = meta.tokens_per_step as f64 / median;
    let tflops = meta.flops_per_token * tokens_per_s / 1e12;
    let ranks = meta.ranks as f64;
    Ok(PointSummary {
        steps: measured.len(),
        step_median_s: median,
        step_p10_s: quantile(&sorted, 0.1),
        step_p90_s: quantile(&sorted, 0.9),
        tokens_per_s,
        tokens_per_s_per_rank: tokens_per_s / ranks,
        tflops_per_rank: tflops / ranks,
        mfu: mfu_peak.map(|peak| tflops / peak),
        compute_s: mean(&compute),
        comm_exposed_s: mean(&exposed),
        bubble_s: mean(&bubble),
        efficiency: 0.0,
        meta,
    })
}

/// Sorts `points` by (mode, ranks, nodes) and sets each one's efficiency against the point of its
/// mode with the fewest ranks (strong: `T_1 N_1 / (T_N N)`, weak: per-rank throughput ratio).
pub fn fill_efficiency(points: &mut [PointSummary]) {
    points.sort_by_key(|p| (p.meta.mode, p.meta.ranks, p.meta.nodes));
    for i in 0..points.len() {
        let base = points.iter().find(|b| b.meta.mode == points[i].meta.mode).expect("a point's own mode has a first point");
        let p = &points[i];
        let e = match p.meta.mode {
            Mode::Strong => base.step_median_s * base.meta.ranks as f64 / (p.step_median_s * p.meta.ranks as f64),
            Mode::Weak => p.tokens_per_s_per_rank / base.tokens_per_s_per_rank,
        };
        points[i].efficiency = e;
    }
}

/// The CSV columns, in order.
pub const CSV_HEADER: [&str; 20] = [
    "mode",
    "nodes",
    "ranks",
    "layout",
    "micro_batch",
    "tokens_per_step",
    "steps",
    "step_median_s",
    "step_p10_s",
    "step_p90_s",
    "tokens_per_s",
    "tokens_per_s_per_rank",
    "tflops_per_rank",
    "mfu",
    "compute_s",
    "comm_exposed_s",
    "bubble_s",
    "efficiency",
    "job_id",
    "nodelist",
];

/// `sweep.csv`: the header and one row per point (MFU and job id empty when unknown; the node list
/// quoted, it may hold commas).
pub fn to_csv(points: &[PointSummary]) -> String {
    let mut out = CSV_HEADER.join(",");
    out.push('\n');
    for p in points {
        let m = &p.meta;
        let row = [
            m.mode.name().to_string(),
            m.nodes.to_string(),
            m.ranks.to_string(),
            m.layout(),
            m.micro_batch.to_string(),
            m.tokens_per_step.to_string(),
            p.steps.to_string(),
            format!("{:.6}", p.step_median_s),
            format!("{:.6}", p.step_p10_s),
            format!("{:.6}", p.step_p90_s),
            format!("{:.1}", p.tokens_per_s),
            format!("{:.1}", p.tokens_per_s_per_rank),
            format!("{:.6}", p.tflops_per_rank),
            p.mfu.map_or(String::new(), |v| format!("{v:.4}")),
            format!("{:.6}", p.compute_s),
            format!("{:.6}", p.comm_exposed_s),
            format!("{:.6}", p.bubble_s),
            format!("{:.4}", p.efficiency),
            m.job_id.clone().unwrap_or_default(),
            format!("\"{}\"", m.nodelist.replace('"', "")),
        ];
        out.push_str(&row.join(","));
        out.push('\n');
    }
    out
}

/// The point files of a sweep directory: `(meta, metrics)` path pairs under `dir/points`, by name.
pub fn point_files(dir: &Path) -> Result<Vec<(PathBuf, PathBuf)>> {
    let points = dir.join("points");
    let rd = std::fs::read_dir(&points).map_err(|e| Error::io(format!("read directory {}", points.display()), e))?;
    let mut metas: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    metas.sort();
    Ok(metas.into_iter().map(|m| (m.clone(), m.with_extension("jsonl"))).collect())
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| Error::io(format!("read {}", path.display()), e))
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|e| Error::io(format!("write {}", path.display()), e))
}

/// Reads every point of `dir`, summarized and with efficiencies filled in.
pub fn load_points(dir: &Path, warmup: usize) -> Result<Vec<PointSummary>> {
    let files = point_files(dir)?;
    if files.is_empty() {
        return Err(Error::file(dir.join("points"), None, "no sweep points (<mode>-n<N>-r<R>.json) found"));
    }
    let mut points = Vec::with_capacity(files.len());
    for (meta_path, metrics_path) in files {
        let meta: PointMeta = serde_json::from_str(&read(&meta_path)?)
            .map_err(|e| Error::file(&meta_path, None, format!("not a sweep point: {e}")))?;
        points.push(summarize(meta, &read(&metrics_path)?, &metrics_path, warmup)?);
    }
    fill_efficiency(&mut points);
    Ok(points)
}

/// What `report` wrote.
#[derive(Debug)]
pub struct Report {
    /// The summarized points, in CSV order.
    pub points: Vec<PointSummary>,
    /// `sweep.csv`.
    pub csv: PathBuf,
    /// `sweep.json`.
    pub sidecar: PathBuf,
    /// Plot files (SVG and PNG of each chart).
    pub plots: Vec<PathBuf>,
}

/// Writes `dir/sweep.csv`, `dir/sweep.json` and the plots under `dir/plots` from the points in `dir`.
pub fn report(dir: &Path, warmup: usize) -> Result<Report> {
    let points = load_points(dir, warmup)?;
    let csv = dir.join("sweep.csv");
    write(&csv, &to_csv(&points))?;
    let sidecar = dir.join("sweep.json");
    let json = serde_json::to_string_pretty(&run::sidecar(&points, warmup))
        .map_err(|e| Error::file(&sidecar, None, format!("cannot encode: {e}")))?;
    write(&sidecar, &json)?;
    let plots = plot::sweep_plots(&points, &dir.join("plots"))?;
    Ok(Report { points, csv, sidecar, plots })
}

#[cfg(test)]
mod tests;
