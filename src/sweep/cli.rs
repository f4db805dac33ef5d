//! `meshtrain sweep run|report|bench`: the command-line side of scaling sweeps (see the module doc
//! of `sweep`). Runs outside MPI: `run` launches each point itself.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::run::{default_launch, run_points, SweepPlan};
use super::{plot, report, Mode};
use crate::error::{Error, Result};

/// `meshtrain sweep ...`.
#[derive(Debug, Args)]
pub struct SweepArgs {
    #[command(subcommand)]
    action: SweepAction,
}

#[derive(Debug, Subcommand)]
enum SweepAction {
    /// Train JOB at each rank count (one srun step or mpirun each), then write the report.
    Run(RunArgs),
    /// Rebuild sweep.csv, sweep.json and the plots from the points in DIR.
    Report(ReportArgs),
    /// Plot bus bandwidth over size from `meshtrain bench --csv` files, one line per LABEL=CSV.
    Bench(BenchPlotArgs),
}

#[derive(Debug, Args)]
struct RunArgs {
    /// The job file (TOML).
    job: PathBuf,
    /// `strong` (fixed global batch) or `weak` (fixed per-rank batch).
    #[arg(long)]
    mode: Mode,
    /// Rank counts, e.g. `1,2,4,8`.
    #[arg(long, value_delimiter = ',', required = true)]
    ranks: Vec<usize>,
    /// Ranks per node (a point asks for ceil(ranks / this) nodes).
    #[arg(long, env = "SLURM_NTASKS_PER_NODE", default_value_t = 8)]
    ranks_per_node: usize,
    /// Tensor-parallel degree of every point.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Pipeline-parallel degree of every point.
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// Strong scaling: sequences per optimizer step (default: the job's micro-batch times the
    /// largest data-parallel degree).
    #[arg(long)]
    global_batch: Option<usize>,
    /// Launcher; `{ranks}` and `{nodes}` are filled in per point (default: `srun --mpi=pmix
    /// --nodes={nodes} --ntasks={ranks}` inside a Slurm allocation, else mpirun).
    #[arg(long)]
    launch: Option<String>,
    /// The sweep directory.
    #[arg(long, default_value = "sweep")]
    out: PathBuf,
    /// Leading steps of each point left out of the figures.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Overrides for every point, e.g. `--set train.steps=20` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
}

#[derive(Debug, Args)]
struct ReportArgs {
    /// The sweep directory.
    dir: PathBuf,
    /// Leading steps of each point left out of the figures.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
}

#[derive(Debug, Args)]
struct BenchPlotArgs {
    /// `LABEL=FILE` pairs, e.g. `"1 node=bench-1/all_reduce.csv"`.
    #[arg(required = true)]
    inputs: Vec<String>,
    /// Directory of the plots.
    #[arg(long, default_value = "bench-plots")]
    out: PathBuf,
}

fn print_report(r: &super::Report) {
    print!("{}", super::to_csv(&r.points));
    println!("sweep: wrote {}, {} and {} plot files", r.csv.display(), r.sidecar.display(), r.plots.len());
}

/// Runs `meshtrain sweep ...`.
pub fn main(args: &SweepArgs) -> Result<()> {
    match &args.action {
        SweepAction::Run(a) => {
            let binary = std::env::current_exe().map_err(|e| Error::io("sweep: locate the meshtrain binary", e))?;
            let plan = SweepPlan {
                job: a.job.clone(),
                sets: a.sets.clone(),
                mode: a.mode,
                ranks: a.ranks.clone(),
                ranks_per_node: a.ranks_per_node,
                tp: a.tp,
                pp: a.pp,
                global_batch: a.global_batch,
                launch: a.launch.as_deref().map_or_else(default_launch, |l| l.split_whitespace().map(str::to_string).collect()),
                binary,
                out: a.out.clone(),
            };
            run_points(&plan)?;
            print_report(&report(&a.out, a.warmup)?);
        }
        SweepAction::Report(a) => print_report(&report(&a.dir, a.warmup)?),
        SweepAction::Bench(a) => {
            let inputs = a
                .inputs
                .iter()
                .map(|s| {
                    s.split_once('=').map(|(l, f)| (l.to_string(), PathBuf::from(f))).ok_or_else(|| {
                        Error::InvalidArgument(format!("sweep bench: `{s}` is not LABEL=FILE"))
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let files = plot::bench_plots(&inputs, &a.out)?;
            println!("sweep bench: wrote {} plot files under {}", files.len(), a.out.display());
        }
    }
    Ok(())
}
