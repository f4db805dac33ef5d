//! `meshtrain plan`: the subcommand's arguments and what each form does.
//!
//! - `meshtrain plan --model 175b --machine frontier --gpus 1024 --global-batch 1536 --seq-len
//!   2048`: the ranked table (or `--json`), rejected layouts with reasons, and with `--write
//!   job.toml` the best layout's job file plus `job.sbatch`;
//! - `meshtrain plan validate`: the published runs, predicted vs measured.
//!
//! Bad input (unknown model or machine, a GPU count no layout fits, a profile with a missing or
//! bad field) is an `Error::Config` naming the flag or the profile field; `main` prints it and
//! exits with status 2.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::cost::Machine;
use super::search::{search, Options};
use super::{published, report, Job, Profile, Stack};
use crate::error::{Error, Result};

/// `meshtrain plan`.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct PlanArgs {
    #[command(subcommand)]
    action: Option<PlanAction>,
    #[command(flatten)]
    query: Query,
}

#[derive(Subcommand, Debug)]
enum PlanAction {
    /// Predict the published Megatron-LM runs (Narayanan et al. SC21, Korthikanti et al. 2022)
    /// with the DGX A100 profile, and Llama 3 405B (Dubey et al. 2024) with the H100 one, and
    /// print every error.
    Validate {
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Measure this node (GEMMs by shape, memory bandwidth, all_reduce by size) and write a
    /// profile; run one process per device: `mpirun -n 8 meshtrain plan calibrate --out here.toml`.
    Calibrate {
        /// Where to write the profile.
        #[arg(long)]
        out: PathBuf,
        /// The profile's name.
        #[arg(long, default_value = "here")]
        name: String,
        /// Device arm measured: cpu, cuda, hip.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Largest all_reduce measured (bytes, K/M/G suffixes).
        #[arg(long, default_value = "16M")]
        max_bytes: String,
        /// Memory per device, GB (required for GPUs; the CPU arm reads MemAvailable).
        #[arg(long)]
        memory_gb: Option<f64>,
        /// Fit collectives from `meshtrain bench --csv` output instead of measuring them:
        /// `SCHEDULE=FILE` (the schedule it ran under, e.g. `ring=ring.csv` from
        /// `MESHTRAIN_ALGO=ring meshtrain bench --csv`); repeatable.
        #[arg(long, value_name = "SCHEDULE=FILE")]
        bench_csv: Vec<String>,
        /// Ranks the --bench-csv files were measured on (default: this run's).
        #[arg(long)]
        bench_ranks: Option<usize>,
    },
}

#[derive(Args, Debug)]
struct Query {
    /// Model: a named size (`d12` ... `175b`, `1t`, `llama-tiny` ... `llama-70b`) or a job file
    /// whose `[model]` shape is planned (`job.toml`).
    #[arg(long)]
    model: Option<String>,
    /// Machine profile: a shipped name (`frontier`, `dgx-a100`, `h100-ib`) or a profile TOML.
    #[arg(long)]
    machine: Option<String>,
    /// Devices (ranks) of the job; with --scaling, a comma-separated list.
    #[arg(long, value_delimiter = ',')]
    gpus: Vec<usize>,
    /// Predict a scaling curve over the --gpus list (`strong`: fixed global batch; `weak`: the
    /// batch grows from the first count's), with the efficiency of `sweep report`.
    #[arg(long)]
    scaling: Option<crate::sweep::Mode>,
    /// With --scaling: write the sweep's CSV and charts here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// With --scaling: a `meshtrain sweep` directory whose measured points are drawn with the
    /// prediction (`predicted_vs_measured_*` charts under --out, default `DIR/plots`).
    #[arg(long, requires = "scaling")]
    overlay: Option<PathBuf>,
    /// With --overlay: leading steps of each measured point left out (as `sweep report`).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Sequences per optimizer step.
    #[arg(long)]
    global_batch: Option<usize>,
    /// Tokens per sequence (default: the model's maximum).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Implementation modelled: `meshtrain` (default) or `megatron` (mixed precision with
    /// recomputation, as in the published runs; such layouts cannot be written as jobs).
    #[arg(long, default_value = "meshtrain")]
    stack: Stack,
    /// GEMM precision whose peak counts (`bf16`, `fp16`, `fp32`; default bf16 on GPUs, fp32 on CPUs).
    #[arg(long)]
    precision: Option<String>,
    /// Layouts shown in the table.
    #[arg(long, default_value_t = 10)]
    top: usize,
    /// Rejected layouts listed per kind (divisibility; memory, nearest misses first).
    #[arg(long, default_value_t = 5)]
    show_rejected: usize,
    /// Largest micro-batch tried.
    #[arg(long, default_value_t = 16)]
    max_micro_batch: usize,
    /// Print the ranking as JSON (every fitting layout, and the rejected ones).
    #[arg(long)]
    json: bool,
    /// Write the best layout's job file here, and an sbatch script next to it (`.sbatch`).
    #[arg(long)]
    write: Option<PathBuf>,
}

/// Runs `meshtrain plan`.
pub fn main(args: &PlanArgs) -> Result<()> {
    match &args.action {
        Some(PlanAction::Validate { json }) => {
            let mut checks = published::check_all(&Profile::load("dgx-a100")?)?;
            checks.extend(published::check_llama(&Profile::load("h100-ib")?)?);
            if *json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&checks)
                        .map_err(|e| Error::InvalidArgument(e.to_string()))?
                );
            } else {
                print!("{}", published::table(&checks));
            }
            Ok(())
        }
        Some(PlanAction::Calibrate { .. }) => Err(Error::InvalidArgument(
            "plan calibrate runs under a world (see calibrate)".into(),
        )),
        None => plan(&args.query),
    }
}

impl PlanArgs {
    /// Whether this form needs the ranks started (`calibrate`).
    pub fn needs_world(&self) -> bool {
        matches!(self.action, Some(PlanAction::Calibrate { .. }))
    }
}

/// Runs `meshtrain plan calibrate` on `world`.
pub fn calibrate(world: &crate::world::World, args: &PlanArgs) -> Result<()> {
    let Some(PlanAction::Calibrate {
        out,
        name,
        device,
        max_bytes,
        memory_gb,
        bench_csv,
        bench_ranks,
    }) = &args.action
    else {
        return main(args);
    };
    let device = match device.as_str() {
        "cpu" => crate::config::DeviceKind::Cpu,
        "cuda" => crate::config::DeviceKind::Cuda,
        "hip" => crate::config::DeviceKind::Hip,
        other => {
            return Err(Error::config(
                "--device",
                format!("`{other}` is not cpu, cuda or hip"),
            ))
        }
    };
    let max_bytes = crate::env::parse_size(max_bytes)
        .map_err(|e| Error::config("--max-bytes", e.to_string()))?;
    let bench_csv = bench_csv
        .iter()
        .map(|s| match s.split_once('=') {
            Some((algo, file)) if !algo.is_empty() => Ok((algo.to_string(), PathBuf::from(file))),
            _ => Err(Error::config(
                "--bench-csv",
                format!("`{s}` is not SCHEDULE=FILE (e.g. ring=ring.csv)"),
            )),
        })
        .collect::<Result<Vec<_>>>()?;
    let o = super::calibrate::Options {
        name: name.clone(),
        device,
        out: out.clone(),
        max_bytes,
        memory_gb: *memory_gb,
        bench_csv,
        bench_ranks: *bench_ranks,
    };
    super::calibrate::calibrate(world, &o).map(|_| ())
}

fn required<T: Clone>(v: &Option<T>, flag: &str) -> Result<T> {
    v.clone().ok_or_else(|| {
        Error::config(
            flag,
            "is required (meshtrain plan --model M --machine NAME --gpus N --global-batch B)",
        )
    })
}

fn plan(q: &Query) -> Result<()> {
    let model = required(&q.model, "--model")?;
    let profile = Profile::load(&required(&q.machine, "--machine")?)?;
    let batch = required(&q.global_batch, "--global-batch")?;
    let gpus =
        match (q.gpus.as_slice(), q.scaling) {
            ([], _) => return Err(Error::config(
                "--gpus",
                "is required (meshtrain plan --model M --machine NAME --gpus N --global-batch B)",
            )),
            ([n], None) => *n,
            (_, None) => return Err(Error::config("--gpus", "takes one count without --scaling")),
            ([first, ..], Some(_)) => *first,
        };
    let shape = super::model_of(&model)?;
    let job = Job::new(&model, &shape, gpus, batch, q.seq_len.unwrap_or(shape.max_seq_len))?;
    let precision = q.precision.clone().unwrap_or_else(|| {
        if profile.device == "cpu" {
            "fp32".into()
        } else {
            "bf16".into()
        }
    });
    let mach = Machine::new(&profile, q.stack, &precision)?;
    let mut opts = Options::default();
    opts.max_micro_batch = q.max_micro_batch.max(1);
    opts.refine = opts.refine.max(q.top);
    if let Some(mode) = q.scaling {
        let grids = match &q.overlay {
            Some(sweep) => super::scaling::sweep_grids(sweep, q.warmup, mode)?,
            None => Default::default(),
        };
        let points = super::scaling::curve(
            &job,
            (&q.gpus, &grids),
            mode,
            &mach,
            &opts,
            q.out.as_deref(),
        )?;
        print!("{}", super::scaling::table(&points));
        if let Some(sweep) = &q.overlay {
            let out = q.out.clone().unwrap_or_else(|| sweep.join("plots"));
            print!(
                "{}",
                super::scaling::overlay(&points, sweep, q.warmup, &out)?
            );
        }
        return Ok(());
    }
    let plan = search(&job, &mach, &opts)?;
    if q.json {
        let text = serde_json::to_string_pretty(&report::json(&job, &mach, &plan))
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        println!("{text}");
    } else {
        print!(
            "{}",
            report::table(&job, &mach, &plan, q.top, q.show_rejected)
        );
    }
    if let Some(path) = &q.write {
        let best = plan
            .ranked
            .iter()
            .find(|_| q.stack == Stack::Meshtrain)
            .ok_or_else(|| {
                Error::config(
                    "--write",
                    "only meshtrain-stack layouts can be written as jobs (use --stack meshtrain)",
                )
            })?;
        let text = report::job_toml(&job, &mach, &best.layout, best.estimate.step_s)?;
        std::fs::write(path, text)
            .map_err(|e| Error::file(path, None, format!("cannot write the job file: {e}")))?;
        let sbatch_path = path.with_extension("sbatch");
        let script = report::sbatch(&job, &mach, &path.display().to_string());
        std::fs::write(&sbatch_path, script).map_err(|e| {
            Error::file(
                &sbatch_path,
                None,
                format!("cannot write the sbatch script: {e}"),
            )
        })?;
        eprintln!(
            "# wrote {} ({}) and {}",
            path.display(),
            best.layout.describe(),
            sbatch_path.display()
        );
    }
    Ok(())
}
