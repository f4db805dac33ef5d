//! `meshtrain tune JOB --machine M --top K`: runs the K best predicted layouts of a job as short
//! trials, prints predicted against measured step time, writes the measured winner's job file and
//! records the calibration error.
//!
//! The job file gives the model, sequence length, global batch (`dp * micro_batch * grad_accum *
//! microbatches`), device and precision; `--gpus` the rank count (default the job's `tp * pp *
//! dp`). Trials run one after another through the sweep's launcher (`sweep::run::default_launch`:
//! an srun step inside an allocation, mpirun outside; `--launch` replaces it), each `meshtrain
//! train JOB --set ...` for `--steps` steps with its metrics under `OUT/trials/`, and each is
//! summarized by the sweep's own `summarize` (median step time after the warm-up steps). A trial
//! that fails is reported with its command and left out of the ranking; with `--repeat N` each
//! layout runs N times (interleaved) and counts its median. The comparison is printed in measured
//! order with each layout's predicted rank; `OUT/tune.json` holds every prediction (with its
//! parts: compute, TP/PP communication, bubble, exposed data-parallel time, optimizer),
//! measurement, error and both ranks, and the mean absolute error.

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Args;
use serde_json::json;

use super::cost::Machine;
use super::search::{search, Options, Ranked};
use super::{report, Job, Profile, Stack};
use crate::config::JobConfig;
use crate::error::{Error, Result};
use crate::sweep::{self, Mode, PointMeta};

/// `meshtrain tune`.
#[derive(Args, Debug)]
pub struct TuneArgs {
    /// The job file whose model, batch and sequence length are tuned.
    job: PathBuf,
    /// Machine profile (shipped name or TOML path).
    #[arg(long)]
    machine: String,
    /// Predicted-best layouts to try.
    #[arg(long, default_value_t = 3)]
    top: usize,
    /// Ranks (default: the job's tp x pp x dp).
    #[arg(long)]
    gpus: Option<usize>,
    /// Steps per trial.
    #[arg(long, default_value_t = 6)]
    steps: u64,
    /// Steps left out of each trial's median.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Runs of each trial, interleaved over the layouts; a layout's time is the median of its
    /// runs' medians (a noisy or shared node).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Try only the best predicted layout of each (tp, pp, dp) grid, so the K trials compare
    /// grids rather than ZeRO stages or micro-batch sizes of one grid.
    #[arg(long)]
    per_grid: bool,
    /// Launcher words (`{ranks}`, `{nodes}` replaced); default srun in an allocation, else mpirun.
    #[arg(long, allow_hyphen_values = true)]
    launch: Option<String>,
    /// The meshtrain binary the trials run (default: this one).
    #[arg(long)]
    binary: Option<PathBuf>,
    /// Output directory (trials, tune.json, best.toml).
    #[arg(long, default_value = "tune")]
    out: PathBuf,
}

/// The job `cfg` describes on `gpus` ranks.
fn job_of(cfg: &JobConfig, gpus: usize, path: &Path) -> Result<Job> {
    let p = &cfg.parallel;
    let global = p.dp * cfg.train.micro_batch * cfg.train.grad_accum * p.microbatches;
    Job::new(
        &path.display().to_string(),
        &cfg.model,
        gpus,
        global,
        cfg.train.seq_len,
    )
}

/// The `--set` overrides that run layout `r` for `steps` steps.
fn trial_sets(r: &Ranked, steps: u64) -> Vec<String> {
    let l = r.layout;
    let (microbatches, accum) = if l.pp > 1 {
        (l.grad_accum, 1)
    } else {
        (1, l.grad_accum)
    };
    [
        format!("parallel.tp={}", l.tp),
        format!("parallel.pp={}", l.pp),
        format!("parallel.dp={}", l.dp),
        format!("parallel.zero={}", l.zero),
        format!("parallel.sequence_parallel={}", l.sp),
        format!("parallel.schedule={}", l.schedule()),
        format!("parallel.microbatches={microbatches}"),
        format!("parallel.virtual_stages={}", l.virtual_stages),
        format!("train.micro_batch={}", l.micro_batch),
        format!("train.grad_accum={accum}"),
        format!("train.steps={steps}"),
        "train.eval_every=0".into(),
        // A trial is a few steps; the job's warm-up may be longer, and it does not change step time.
        "optim.warmup_steps=0".into(),
        "checkpoint.every=0".into(),
    ]
    .into()
}

/// Runs one trial; the measured median step time, or why it failed.
fn trial(
    a: &TuneArgs,
    launch: &[String],
    job: &Job,
    r: &Ranked,
    (i, run): (usize, usize),
) -> Result<f64> {
    let dir = a.out.join("trials");
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
    let metrics = dir.join(format!("trial{i}-run{run}.jsonl"));
    let _ = std::fs::remove_file(&metrics);
    let binary = match &a.binary {
        Some(b) => b.clone(),
        None => std::env::current_exe().map_err(|e| Error::io("tune: find this binary", e))?,
    };
    let nodes = 1.max(job.gpus.div_ceil(8));
    let mut words: Vec<String> = launch
        .iter()
        .map(|w| {
            w.replace("{ranks}", &job.gpus.to_string())
                .replace("{nodes}", &nodes.to_string())
        })
        .collect();
    words.extend([
        binary.display().to_string(),
        "train".into(),
        a.job.display().to_string(),
    ]);
    for s in trial_sets(r, a.steps) {
        words.extend(["--set".into(), s]);
    }
    words.extend(["--metrics".into(), metrics.display().to_string()]);
    eprintln!(
        "# tune: trial {i} ({}): {}",
        r.layout.describe(),
        words.join(" ")
    );
    let status = Command::new(&words[0])
        .args(&words[1..])
        .status()
        .map_err(|e| Error::io(format!("tune: start `{}`", words[0]), e))?;
    if !status.success() {
        return Err(Error::Check(format!(
            "trial {i} ({}) failed ({status}): {}",
            r.layout.describe(),
            words.join(" ")
        )));
    }
    let text = std::fs::read_to_string(&metrics)
        .map_err(|e| Error::io(format!("read {}", metrics.display()), e))?;
    let l = r.layout;
    let meta = PointMeta {
        command: words,
        ..PointMeta::new(
            Mode::Strong,
            nodes,
            job.gpus,
            [l.tp, l.pp, l.dp],
            [l.micro_batch, l.grad_accum, job.seq_len],
            crate::metrics::train_flops_per_token(&job.model, job.seq_len),
        )
    };
    Ok(sweep::summarize(meta, &text, &metrics, a.warmup)?.step_median_s)
}

/// Runs `meshtrain tune`.
pub fn main(a: &TuneArgs) -> Result<()> {
    if a.top == 0 || a.steps as usize <= a.warmup {
        return Err(Error::config(
            "--top",
            format!(
                "--top {} and --steps {} must leave trials with steps after --warmup {}",
                a.top, a.steps, a.warmup
            ),
        ));
    }
    let cfg = JobConfig::load(&a.job, &[])?;
    let p = &cfg.parallel;
    let job = job_of(&cfg, a.gpus.unwrap_or(p.tp * p.pp * p.dp), &a.job)?;
    let profile = Profile::load(&a.machine)?;
    let precision = cfg.precision.name();
    let mach = Machine::new(&profile, Stack::Meshtrain, precision)?;
    let opts = Options {
        refine: if a.per_grid {
            usize::MAX
        } else {
            a.top.max(16)
        },
        ..Options::default()
    };
    let plan = search(&job, &mach, &opts)?;
    let launch = match &a.launch {
        Some(words) => words.split_whitespace().map(str::to_string).collect(),
        None => sweep::run::default_launch(),
    };
    let mut grids = std::collections::HashSet::new();
    let tried: Vec<&Ranked> = plan
        .ranked
        .iter()
        .filter(|r| !a.per_grid || grids.insert((r.layout.tp, r.layout.pp, r.layout.dp)))
        .take(a.top)
        .collect();
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); tried.len()];
    for run in 0..a.repeat.max(1) {
        for (i, r) in tried.iter().enumerate() {
            match trial(a, &launch, &job, r, (i, run)) {
                Ok(t) => runs[i].push(t),
                Err(e) => eprintln!("# tune: {e}"),
            }
        }
    }
    let rows: Vec<(&Ranked, Option<f64>)> = tried
        .into_iter()
        .zip(runs)
        .map(|(r, mut v)| {
            v.sort_by(f64::total_cmp);
            (r, (!v.is_empty()).then(|| v[v.len() / 2]))
        })
        .collect();
    finish(a, &job, &mach, &rows)
}

/// Prints the comparison (predicted rank, measured rank, both times and the prediction's error,
/// in measured order: the ranking `tune` hands back), writes the winner's job file and
/// `tune.json`.
fn finish(a: &TuneArgs, job: &Job, mach: &Machine, rows: &[(&Ranked, Option<f64>)]) -> Result<()> {
    let mut order: Vec<usize> = (0..rows.len()).collect();
    // Measured first by time, failed trials last in predicted order.
    order.sort_by(|&x, &y| match (rows[x].1, rows[y].1) {
        (Some(p), Some(q)) => p.total_cmp(&q),
        (a, b) => b.is_some().cmp(&a.is_some()).then(x.cmp(&y)),
    });
    println!(
        "{:>4} {:>4} {:<36} {:>11} {:>10} {:>7}",
        "meas", "pred", "layout", "predicted_s", "measured_s", "error%"
    );
    let mut errors = Vec::new();
    let mut records = Vec::new();
    for (rank, &i) in order.iter().enumerate() {
        let (r, m) = rows[i];
        let p = r.estimate.step_s;
        let err = m.map(|m| 100.0 * (p - m) / m);
        println!(
            "{:>4} {:>4} {:<36} {:>11.4} {:>10} {:>7}",
            m.map_or("-".into(), |_| (rank + 1).to_string()),
            i + 1,
            r.layout.describe(),
            p,
            m.map_or("failed".into(), |m| format!("{m:.4}")),
            err.map_or("-".into(), |e| format!("{e:+.1}"))
        );
        errors.extend(err.map(f64::abs));
        records.push(json!({
            "layout": r.layout, "predicted_rank": i + 1, "measured_rank": m.map(|_| rank + 1),
            "predicted_s": p, "measured_s": m, "error_pct": err, "predicted": r.estimate,
        }));
    }
    let best = rows
        .iter()
        .filter_map(|(r, m)| m.map(|m| (r, m)))
        .min_by(|x, y| x.1.total_cmp(&y.1))
        .ok_or_else(|| Error::Check("tune: every trial failed (see the messages above)".into()))?;
    let mae = errors.iter().sum::<f64>() / errors.len() as f64;
    println!(
        "# calibration error: mean absolute {mae:.1}% over {} trials; measured best {} (predicted rank {})",
        errors.len(),
        best.0.layout.describe(),
        order[0] + 1
    );
    let path = a.out.join("best.toml");
    let text = report::job_toml(job, mach, &best.0.layout, best.1)?;
    std::fs::write(&path, text).map_err(|e| Error::io(format!("write {}", path.display()), e))?;
    let summary = json!({"machine": mach.profile.name, "job": job, "trials": records, "mean_abs_error_pct": mae, "best": best.0.layout});
    let tune = a.out.join("tune.json");
    std::fs::write(
        &tune,
        serde_json::to_string_pretty(&summary)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?,
    )
    .map_err(|e| Error::io(format!("write {}", tune.display()), e))?;
    println!("# wrote {} and {}", path.display(), tune.display());
    Ok(())
}
