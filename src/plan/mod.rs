//! `meshtrain plan`: which 3D layout to run a model on a machine with, and how fast and how big
//! it will be, before spending an allocation on finding out.
//!
//! Pieces, bottom up:
//! - [`profile`]: machine profiles (TOML): peak per precision, a GEMM efficiency model, memory and
//!   its bandwidth, alpha-beta links within and between nodes.
//! - [`rank_memory`]: bytes per rank of a layout. For meshtrain itself the parameter, gradient,
//!   optimizer and staging terms are `train::memory_estimate`'s formula (the one checked against
//!   measured peak RSS) and the activations those of `model::device_acts`; for the Megatron-LM
//!   stack (used to check the model against published runs) mixed-precision state and the
//!   activation formulas of Korthikanti et al. 2022 with their recomputation modes.
//! - [`cost`]: step time of a layout: GEMMs by shape at the profile's efficiency, memory-bound
//!   kernels at its bandwidth, TP collectives on the critical path, pipeline point-to-point, the
//!   data-parallel reduction overlapped with the last backward as the step does it, the bubble
//!   from the schedule simulator.
//! - [`search`]: every layout of a job on a GPU count, the rejected ones with their reason, the
//!   rest ranked by predicted step time.
//! - [`report`]: the ranked table, JSON, a job file and an sbatch script for a layout;
//!   [`scaling`]: predicted strong/weak scaling curves in the sweep's format; [`published`]: the
//!   published runs the model is checked against; [`calibrate`]: a profile of this node from
//!   measurements, [`collfit`] its collective fits per schedule; [`tune`]: short trials of the
//!   best predicted layouts, predicted vs measured;
//!   [`command`]: the subcommand.
//!
//! Models of either architecture meshtrain trains (`model.arch`): GPT-2 and Llama (RMSNorm,
//! SwiGLU, RoPE, grouped-query attention, untied head). Nothing here has a formula of its own
//! for an architecture where the executor has one: parameters per rank are the executor's shard
//! layout ([`rank_memory::ShardSizes`], checked against `model::ShardLayout`), activations its
//! allocations (`model::ActDims`), GEMM shapes its widths, model FLOPs `metrics`', TP rules
//! `model::tp_layout::check_tp` (`llama_tests` checks each against the executor). `--model`
//! takes a named size or a job file's `[model]`.
//!
//! Invariants: planning is a pure function of (job, profile, stack): no measurement, no I/O
//! except reading the profile; a layout is either ranked (it fits memory and every divisibility
//! rule meshtrain's config validation applies) or rejected with a reason, never silently dropped.

pub mod calibrate;
pub mod command;
pub mod collfit;
pub mod cost;
pub mod rank_memory;
pub mod profile;
pub mod published;
pub mod report;
pub mod scaling;
pub mod search;
pub mod tune;

#[cfg(test)]
mod llama_tests;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::model::GptConfig;

pub use profile::Profile;

/// What is being trained, independent of the layout.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Job {
    /// Model name (a meshtrain size or the name of a published configuration).
    pub name: String,
    /// The model's shape.
    pub model: GptConfig,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Sequences per optimizer step.
    pub global_batch: usize,
    /// Devices (ranks).
    pub gpus: usize,
}

impl Job {
    /// A job of `model`: a meshtrain named size (`175b`, `llama-70b`) or a job file whose
    /// `[model]` shape it takes (see [`model_of`]).
    pub fn named(model: &str, gpus: usize, global_batch: usize, seq_len: usize) -> Result<Job> {
        Job::new(model, &model_of(model)?, gpus, global_batch, seq_len)
    }

    /// A job of shape `c`.
    pub fn new(
        name: &str,
        c: &GptConfig,
        gpus: usize,
        global_batch: usize,
        seq_len: usize,
    ) -> Result<Job> {
        for (key, v) in [
            ("--gpus", gpus),
            ("--global-batch", global_batch),
            ("--seq-len", seq_len),
        ] {
            if v == 0 {
                return Err(Error::config(key, "must be at least 1"));
            }
        }
        if seq_len > c.max_seq_len {
            return Err(Error::config(
                "--seq-len",
                format!(
                    "{seq_len} exceeds the model's max_seq_len {} (model {name})",
                    c.max_seq_len
                ),
            ));
        }
        c.validate()?;
        Ok(Job {
            name: name.to_string(),
            model: *c,
            seq_len,
            global_batch,
            gpus,
        })
    }

    /// Padded vocabulary rows (the embedding and the head compute over all of them).
    pub fn vocab(&self) -> usize {
        self.model.padded_vocab_size()
    }

    /// Model FLOPs of one optimizer step in meshtrain's convention (`metrics`): what the
    /// TFLOP/s and % of peak columns count; recomputation is not counted.
    pub fn model_flops_per_step(&self) -> f64 {
        let tokens = (self.global_batch * self.seq_len) as f64;
        crate::metrics::train_flops_per_token(&self.model, self.seq_len) * tokens
    }
}

/// The shape `model` names: a meshtrain named size, or, for a path ending in `.toml` or holding a
/// `/`, the `[model]` table of that job file (any shape meshtrain trains, e.g. a custom Llama).
/// Errors name `--model` (or the job file's key).
pub fn model_of(model: &str) -> Result<GptConfig> {
    if model.ends_with(".toml") || model.contains('/') {
        return Ok(crate::config::JobConfig::load(std::path::Path::new(model), &[])?.model);
    }
    GptConfig::named(model).map_err(|e| match e {
        Error::Config { msg, .. } => Error::config("--model", msg),
        other => other,
    })
}

/// Which implementation's memory and communication the model describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Stack {
    /// meshtrain: fp32 parameters, gradients, AdamW state and activations, the executor's
    /// recomputation modes, gradient buckets reduced during the last backward.
    Meshtrain,
    /// Megatron-LM as in the published runs: bf16 weights and activations, fp32 main gradients and
    /// optimizer state, recomputation modes, data-parallel all-reduce after the backward.
    Megatron,
}

impl std::str::FromStr for Stack {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Stack, String> {
        match s {
            "meshtrain" => Ok(Stack::Meshtrain),
            "megatron" => Ok(Stack::Megatron),
            other => Err(format!("`{other}` is not meshtrain or megatron")),
        }
    }
}

/// Activation recomputation: the executor's own modes (`train.recompute`).
pub use crate::model::Recompute;

/// One way to run a job: the 3D grid and how each axis works.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Layout {
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Pipeline-parallel degree.
    pub pp: usize,
    /// Model chunks per pipeline rank (above 1: the interleaved schedule).
    pub virtual_stages: usize,
    /// Data-parallel degree.
    pub dp: usize,
    /// ZeRO stage.
    pub zero: u8,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step and replica (pipeline micro-batches with pp > 1, else
    /// gradient accumulation steps).
    pub grad_accum: usize,
    /// Sequence parallelism over the TP group.
    pub sp: bool,
    /// Activation recomputation.
    pub recompute: Recompute,
}

impl Layout {
    /// `1f1b` or `interleaved`.
    pub fn schedule(&self) -> &'static str {
        if self.virtual_stages > 1 {
            "interleaved"
        } else {
            "1f1b"
        }
    }

    /// `tp8 pp64 v1 dp6 z1 mb1 x512 sp full` for messages.
    pub fn describe(&self) -> String {
        format!(
            "tp{} pp{} v{} dp{} z{} mb{} x{}{} {}",
            self.tp,
            self.pp,
            self.virtual_stages,
            self.dp,
            self.zero,
            self.micro_batch,
            self.grad_accum,
            if self.sp { " sp" } else { "" },
            self.recompute.name()
        )
    }
}
