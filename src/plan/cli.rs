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
use super::{published, report, Job, Profile, Recompute, Stack};
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
    /// with the DGX A100 profile and print every error.
    Validate {
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Debug)]
struct Query {
    /// Model size (`d12` ... `175b`, `1t`).
    #[arg(long)]
    model: Option<String>,
    /// Machine profile: a shipped name (`frontier`, `dgx-a100`, `h100-ib`) or a profile TOML.
    #[arg(long)]
    machine: Option<String>,
    /// Devices (ranks) of the job.
    #[arg(long)]
    gpus: Option<usize>,
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
    /// GEMM precision whose peak counts (`bf16`, `fp32`; default bf16 on GPUs, fp32 on CPUs).
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
            let checks = published::check_all(&Profile::load("dgx-a100")?)?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&checks).map_err(|e| Error::InvalidArgument(e.to_string()))?);
            } else {
                print!("{}", published::table(&checks));
            }
            Ok(())
        }
        None => plan(&args.query),
    }
}

fn required<T: Clone>(v: &Option<T>, flag: &str) -> Result<T> {
    v.clone().ok_or_else(|| Error::config(flag, "is required (meshtrain plan --model M --machine NAME --gpus N --global-batch B)"))
}

fn plan(q: &Query) -> Result<()> {
    let model = required(&q.model, "--model")?;
    let profile = Profile::load(&required(&q.machine, "--machine")?)?;
    let (gpus, batch) = (required(&q.gpus, "--gpus")?, required(&q.global_batch, "--global-batch")?);
    let named = crate::model::GptConfig::named(&model).map_err(|e| match e {
        Error::Config { msg, .. } => Error::config("--model", msg),
        other => other,
    })?;
    let job = Job::named(&model, gpus, batch, q.seq_len.unwrap_or(named.max_seq_len))?;
    let precision = q.precision.clone().unwrap_or_else(|| if profile.device == "cpu" { "fp32".into() } else { "bf16".into() });
    let mach = Machine::new(&profile, q.stack, &precision)?;
    let mut opts = Options::for_stack(q.stack);
    opts.max_micro_batch = q.max_micro_batch.max(1);
    opts.refine = opts.refine.max(q.top);
    let plan = search(&job, &mach, &opts)?;
    if q.json {
        let text = serde_json::to_string_pretty(&report::json(&job, &mach, &plan)).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        println!("{text}");
    } else {
        print!("{}", report::table(&job, &mach, &plan, q.top, q.show_rejected));
    }
    if let Some(path) = &q.write {
        let best = plan
            .ranked
            .iter()
            .find(|r| q.stack == Stack::Meshtrain && r.layout.recompute == Recompute::None)
            .ok_or_else(|| Error::config("--write", "only meshtrain-stack layouts can be written as jobs (use --stack meshtrain)"))?;
        let text = report::job_toml(&job, &mach, &best.layout, best.estimate.step_s)?;
        std::fs::write(path, text).map_err(|e| Error::file(path, None, format!("cannot write the job file: {e}")))?;
        let sbatch_path = path.with_extension("sbatch");
        let script = report::sbatch(&job, &mach, &path.display().to_string());
        std::fs::write(&sbatch_path, script).map_err(|e| Error::file(&sbatch_path, None, format!("cannot write the sbatch script: {e}")))?;
        eprintln!("# wrote {} ({}) and {}", path.display(), best.layout.describe(), sbatch_path.display());
    }
    Ok(())
}
