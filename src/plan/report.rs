//! What `meshtrain plan` prints and writes: the ranked table, the same ranking as JSON, the
//! rejected layouts with their reasons, and a job file plus an sbatch script for one layout.
//!
//! Throughput columns use meshtrain's FLOP convention (`metrics`: model FLOPs, recomputation not
//! counted), so a predicted TFLOP/s per GPU compares with what `meshtrain train` reports. Memory
//! per GPU is the fullest rank's predicted bytes plus the profile's reserved runtime memory.
//! Invariant: a written job file loads and validates as a meshtrain job for exactly the planned
//! GPU count, or nothing is written.

use serde::Serialize;
use serde_json::json;

use super::cost::Machine;
use super::search::{Plan, Ranked};
use super::{Job, Layout, Stack};
use crate::config::JobConfig;
use crate::error::{Error, Result};

/// One ranked layout as the table and the JSON show it: the layout's own fields (flattened, so
/// the JSON object has `tp`, `pp`, ... at its top level) and the predicted figures.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    #[serde(flatten)]
    pub layout: Layout,
    pub schedule: &'static str,
    pub step_s: f64,
    pub tokens_per_s: f64,
    pub tflops_per_gpu: f64,
    pub pct_of_peak: f64,
    pub mem_per_gpu_gb: f64,
    pub bubble_s: f64,
    pub exposed_comm_s: f64,
    /// Whether the pipeline time comes from the schedule simulator (the top of the ranking).
    pub simulated: bool,
}

impl Row {
    /// The row of `r`.
    pub fn new(job: &Job, mach: &Machine, r: &Ranked) -> Row {
        let (l, e) = (r.layout, &r.estimate);
        let tflops = job.model_flops_per_step() / e.step_s / job.gpus as f64 / 1e12;
        Row {
            layout: l,
            schedule: l.schedule(),
            step_s: e.step_s,
            tokens_per_s: (job.global_batch * job.seq_len) as f64 / e.step_s,
            tflops_per_gpu: tflops,
            pct_of_peak: 100.0 * tflops * 1e12 / mach.peak,
            mem_per_gpu_gb: e.memory.total() / 1e9 + mach.profile.memory.reserved_gb,
            bubble_s: e.bubble_s,
            exposed_comm_s: e.exposed_comm_s(),
            simulated: e.simulated,
        }
    }
}

/// The ranked table (best `top`), then a summary of the rejections and the `show_rejected`
/// nearest memory misses and divisibility rejections.
pub fn table(job: &Job, mach: &Machine, plan: &Plan, top: usize, show_rejected: usize) -> String {
    let mut s = format!(
        "# {} on {} GPUs of {} ({}, {} stack): global batch {}, seq {}; {} layouts costed, {} fit, {} rejected\n",
        job.name,
        job.gpus,
        mach.profile.name,
        mach.profile.description,
        match mach.stack {
            Stack::Meshtrain => "meshtrain",
            Stack::Megatron => "Megatron-LM",
        },
        job.global_batch,
        job.seq_len,
        plan.costed,
        plan.ranked.len(),
        plan.rejected.len()
    );
    s += &format!(
        "{:>4} {:>3} {:>4} {:>2} {:>5} {:>3} {:>3} {:>5} {:>2} {:>9} {:>9} {:>11} {:>8} {:>6} {:>7} {:>8} {:>8}\n",
        "rank", "tp", "pp", "v", "dp", "z", "mb", "accum", "sp", "recompute", "step_s", "tokens/s", "TFLOP/s", "%peak", "mem_GB", "bubble_s", "comm_s"
    );
    for (i, r) in plan.ranked.iter().take(top).enumerate() {
        let w = Row::new(job, mach, r);
        let l = &w.layout;
        s += &format!(
            "{:>4} {:>3} {:>4} {:>2} {:>5} {:>3} {:>3} {:>5} {:>2} {:>9} {:>9.3} {:>11.0} {:>8.1} {:>6.1} {:>7.1} {:>8.3} {:>8.3}\n",
            i + 1,
            l.tp,
            l.pp,
            l.virtual_stages,
            l.dp,
            l.zero,
            l.micro_batch,
            l.grad_accum,
            if l.sp { "y" } else { "n" },
            l.recompute.name(),
            w.step_s,
            w.tokens_per_s,
            w.tflops_per_gpu,
            w.pct_of_peak,
            w.mem_per_gpu_gb,
            w.bubble_s,
            w.exposed_comm_s
        );
    }
    let count = |k: &str| plan.rejected.iter().filter(|r| r.kind == k).count();
    s += &format!(
        "# rejected: {} for memory (usable {:.1} GB per GPU), {} for divisibility\n",
        count("memory"),
        mach.profile.usable_bytes() / 1e9,
        count("divisibility")
    );
    let shown = plan
        .rejected
        .iter()
        .filter(|r| r.kind == "divisibility")
        .take(show_rejected)
        .chain(
            plan.rejected
                .iter()
                .filter(|r| r.kind == "memory")
                .take(show_rejected),
        );
    for r in shown {
        s += &format!("#   {}: {}\n", r.layout, r.reason);
    }
    s
}

/// The ranking (every fitting layout, fastest first) and the rejections as JSON.
pub fn json(job: &Job, mach: &Machine, plan: &Plan) -> serde_json::Value {
    let rows: Vec<Row> = plan.ranked.iter().map(|r| Row::new(job, mach, r)).collect();
    json!({
        "job": job,
        "machine": mach.profile.name,
        "stack": mach.stack,
        "peak_tflops_per_gpu": mach.peak / 1e12,
        "usable_gb_per_gpu": mach.profile.usable_bytes() / 1e9,
        "layouts": rows,
        "rejected": plan.rejected,
    })
}

/// A meshtrain job file for `l` (synthetic data; point `data.source` at real shards), checked by
/// loading it back. Errors for layouts of the Megatron stack.
pub fn job_toml(job: &Job, mach: &Machine, l: &Layout, step_s: f64) -> Result<String> {
    if mach.stack != Stack::Meshtrain {
        return Err(Error::config(
            "--write",
            format!(
                "layout {} is a {:?}-stack prediction; only meshtrain-stack layouts can be written as jobs",
                l.describe(),
                mach.stack
            ),
        ));
    }
    let c = &job.model;
    let (microbatches, accum) = if l.pp > 1 {
        (l.grad_accum, 1)
    } else {
        (1, l.grad_accum)
    };
    let text = format!(
        "# Written by `meshtrain plan`: {name} on {gpus} GPUs of {machine}, predicted {step:.3} s per step.\n\
         # Point data.source at token shards (`meshtrain tokenize`) for real training.\n\
         device = \"{device}\"\nprecision = \"{precision}\"\n\n[model]\nn_layer = {nl}\nn_head = {nh}\nn_embd = {ne}\n\
         vocab_size = {vs}\nmax_seq_len = {ms}\n{arch}\n[data]\nsource = \"synthetic\"\n\n[train]\nsteps = 100\n\
         micro_batch = {mb}\nseq_len = {seq}\ngrad_accum = {accum}\nrecompute = \"{recompute}\"\nlog_every = 1\n\n[parallel]\ntp = {tp}\npp = {pp}\n\
         dp = {dp}\nzero = {zero}\nsequence_parallel = {sp}\nschedule = \"{sched}\"\nmicrobatches = {microbatches}\n\
         virtual_stages = {v}\n",
        name = job.name,
        gpus = job.gpus,
        machine = mach.profile.name,
        step = step_s,
        device = mach.profile.device,
        precision = if mach.bf16 { "bf16" } else { "fp32" },
        nl = c.n_layer,
        nh = c.n_head,
        ne = c.n_embd,
        vs = c.vocab_size,
        ms = c.max_seq_len,
        arch = llama_keys(c),
        mb = l.micro_batch,
        seq = job.seq_len,
        recompute = l.recompute.name(),
        tp = l.tp,
        pp = l.pp,
        dp = l.dp,
        zero = l.zero,
        sp = l.sp,
        sched = l.schedule(),
        v = l.virtual_stages,
    );
    let cfg = JobConfig::from_str(&text, &[])?;
    cfg.validate_world(job.gpus)?;
    Ok(text)
}

/// The `[model]` keys of a Llama shape (`arch = "llama"` and the rest, one per line), empty for
/// GPT-2.
fn llama_keys(c: &crate::model::GptConfig) -> String {
    let Some(l) = &c.llama else { return String::new() };
    let mut text = format!(
        "arch = \"llama\"\nn_kv_head = {}\nffn_dim = {}\nrope_theta = {:?}\nnorm_eps = {:?}\ntie_embeddings = {}\n",
        l.n_kv_head, l.ffn_dim, l.rope_theta, l.norm_eps, l.tie_embeddings
    );
    let scaling = [
        ("rope_scaling_factor", l.rope_scaling_factor),
        ("rope_low_freq_factor", l.rope_low_freq_factor),
        ("rope_high_freq_factor", l.rope_high_freq_factor),
    ];
    for (key, v) in scaling {
        if let Some(v) = v {
            text += &format!("{key} = {v:?}\n");
        }
    }
    if let Some(n) = l.rope_original_max_seq_len {
        text += &format!("rope_original_max_seq_len = {n}\n");
    }
    text
}

/// An sbatch script running `job_file` on the nodes `gpus` ranks need.
pub fn sbatch(job: &Job, mach: &Machine, job_file: &str) -> String {
    let per_node = mach.profile.devices_per_node.min(job.gpus);
    let nodes = job.gpus.div_ceil(per_node);
    let gpu_lines = if mach.profile.device == "cpu" {
        String::new()
    } else {
        "#SBATCH --gpus-per-task=1\n#SBATCH --gpu-bind=closest\n".to_string()
    };
    format!(
        "#!/bin/bash\n# Written by `meshtrain plan`: {name} on {gpus} ranks of {machine} ({nodes} nodes x {per_node}).\n\
         #   sbatch -A <project> {{this file}}\n#SBATCH -J meshtrain-plan\n#SBATCH -N {nodes}\n#SBATCH --ntasks-per-node={per_node}\n\
         {gpu_lines}#SBATCH -t 00:30:00\n#SBATCH -o meshtrain-plan-%j.out\nset -euo pipefail\ncd \"${{SLURM_SUBMIT_DIR:-.}}\"\n\
         BIN=${{BIN:-$PWD/target/release/meshtrain}}\n\
         srun --ntasks-per-node={per_node} \"$BIN\" train {job_file} --metrics \"meshtrain-plan-$SLURM_JOB_ID.jsonl\"\n",
        name = job.name,
        gpus = job.gpus,
        machine = mach.profile.name,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::search::{search, Options};
    use crate::plan::Profile;

    #[test]
    fn written_job_loads_with_the_planned_layout() {
        let p = Profile::load("frontier").unwrap();
        let mach = Machine::new(&p, Stack::Meshtrain, "bf16").unwrap();
        let job = Job::named("d24", 16, 32, 1024).unwrap();
        let plan = search(&job, &mach, &Options::default()).unwrap();
        let best = &plan.ranked[0];
        let text = job_toml(&job, &mach, &best.layout, best.estimate.step_s).unwrap();
        let cfg = JobConfig::from_str(&text, &[]).unwrap();
        let l = best.layout;
        assert_eq!(
            (
                cfg.parallel.tp,
                cfg.parallel.pp,
                cfg.parallel.dp,
                cfg.parallel.zero
            ),
            (l.tp, l.pp, l.dp, l.zero)
        );
        let per_step = cfg.train.micro_batch
            * cfg.train.grad_accum
            * cfg.parallel.microbatches
            * cfg.parallel.dp;
        assert_eq!(per_step, 32);
        let s = sbatch(&job, &mach, "job.toml");
        assert!(
            s.contains("#SBATCH -N 2")
                && s.contains("--ntasks-per-node=8")
                && s.contains("train job.toml")
        );
        let j = json(&job, &mach, &plan);
        let first = &j["layouts"][0];
        for key in [
            "tp",
            "pp",
            "virtual_stages",
            "dp",
            "zero",
            "micro_batch",
            "grad_accum",
            "sp",
            "recompute",
            "step_s",
            "tokens_per_s",
            "tflops_per_gpu",
            "pct_of_peak",
            "mem_per_gpu_gb",
            "bubble_s",
            "exposed_comm_s",
        ] {
            assert!(!first[key].is_null(), "{key}");
        }
        assert!(first["recompute"] == "none" && first["schedule"].is_string());
        let t = table(&job, &mach, &plan, 5, 3);
        assert_eq!(t.lines().filter(|l| !l.starts_with('#')).count(), 6, "{t}");
    }
}
