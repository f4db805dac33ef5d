//! The job configuration: a TOML file, then `--set` overrides, then environment overrides, all
//! checked before any work starts.
//!
//! Precedence, lowest to highest:
//! 1. the built-in defaults (listed on each field below);
//! 2. the TOML file;
//! 3. `--set section.key=value` (top-level keys: `--set device=cuda`), in command-line order;
//! 4. environment variables `MESHTRAIN_<SECTION>_<KEY>` (e.g. `MESHTRAIN_TRAIN_STEPS=10`,
//!    `MESHTRAIN_TRAIN_MICRO_BATCH=8`; top-level keys: `MESHTRAIN_DEVICE`, `MESHTRAIN_INIT_FROM`).
//!    Variables whose first word after `MESHTRAIN_` is neither a section nor a top-level key belong
//!    to other parts of meshtrain and are ignored here; a known section with an unknown key is an
//!    error. The environment wins so a batch script can adjust a job without editing its command.
//!
//! Override values are parsed as TOML scalars (`10`, `3e-4`, `true`, `"x"`); a value that is not
//! valid TOML is taken as a bare string, so `--set data.source=data/ts_train_*.bin` works unquoted.
//!
//! The model is `model.size` (a name from [`GptConfig::named`]) or the five explicit keys
//! `n_layer`, `n_head`, `n_embd`, `vocab_size`, `max_seq_len`; explicit keys given together with
//! `size` override that size's values. There is no default model.
//!
//! Invariants of a [`JobConfig`] returned by `load`/`from_str`: no unknown key was given anywhere
//! (each would have been rejected by its dotted name), every value passed [`JobConfig::validate`],
//! and `train.seq_len` is resolved (absent means `model.max_seq_len`). Only the world size is
//! checked later, by [`JobConfig::validate_world`], once it is known.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::device::cpu::parallel::MAX_THREADS;
use crate::model::GptConfig;
use crate::parallel::stage_split;

pub mod keys;
pub mod loss_scale;
mod ps;
pub use ps::{PsConfig, PsMode};
pub(crate) mod overrides;

pub use crate::device::{DeviceKind, Precision};
pub use crate::model::Recompute;
pub use loss_scale::LossScale;

/// Whether `var` is a job-configuration override (`MESHTRAIN_<SECTION>_<KEY>` or a top-level
/// key), which the configuration loader checks: the runtime variables' misspelling check
/// ([`crate::world::World::init`]) lets these pass.
pub fn is_override_var(var: &str) -> bool {
    overrides::env_key(var).is_some()
}

/// The complete, validated configuration of a training job.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobConfig {
    /// `device`: `cpu` (default), `cuda`, `hip` or `emu` (the GPU kernels emulated on the host).
    pub device: DeviceKind,
    /// `precision`: `fp32` (default on the CPU), `bf16` (default on a GPU) or `fp16`.
    pub precision: Precision,
    /// `init_from`: a checkpoint to take the initial weights from (default: random init).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init_from: Option<PathBuf>,
    /// `[model]`, resolved to a shape.
    pub model: GptConfig,
    /// `[data]`.
    pub data: DataConfig,
    /// `[train]`.
    pub train: TrainConfig,
    /// `[optim]`.
    pub optim: OptimConfig,
    /// `[parallel]`.
    pub parallel: ParallelConfig,
    /// `[checkpoint]`.
    pub checkpoint: CheckpointConfig,
    /// `[metrics]`.
    pub metrics: MetricsConfig,
    /// `[ps]` (parameter servers; used with `parallel.dp_sync = "ps"`).
    pub ps: PsConfig,
}

/// `[model]` as written: a named size and/or explicit shape keys.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct ModelSection {
    size: Option<String>,
    n_layer: Option<usize>,
    n_head: Option<usize>,
    n_embd: Option<usize>,
    vocab_size: Option<usize>,
    max_seq_len: Option<usize>,
    arch: Option<String>,
    n_kv_head: Option<usize>,
    ffn_dim: Option<usize>,
    rope_theta: Option<f64>,
    rope_scaling_factor: Option<f64>,
    rope_low_freq_factor: Option<f64>,
    rope_high_freq_factor: Option<f64>,
    rope_original_max_seq_len: Option<usize>,
    norm_eps: Option<f64>,
    tie_embeddings: Option<bool>,
}

/// `[data]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DataConfig {
    /// `"synthetic"` (default: the built-in Markov-chain corpus) or a shard glob.
    pub source: String,
    /// Validation corpus, same forms as `source` (default: none, no evaluation data).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_source: Option<String>,
    /// Shuffle the order of windows each epoch (default true).
    pub shuffle: bool,
    /// Seed of the shuffle and of the synthetic corpus (default 1337).
    pub seed: u64,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            source: "synthetic".into(),
            val_source: None,
            shuffle: true,
            seed: 1337,
        }
    }
}

/// `[train]`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainConfig {
    /// Optimizer steps (default 1000).
    pub steps: u64,
    /// Sequences per rank per micro-step (default 4).
    pub micro_batch: usize,
    /// Tokens per sequence, at most `model.max_seq_len` (default `model.max_seq_len`).
    pub seq_len: usize,
    /// Micro-steps accumulated per optimizer step (default 1).
    pub grad_accum: usize,
    /// Seed of the weight initialization (default 42).
    pub seed: u64,
    /// Evaluate every this many steps; 0 = never (default 0).
    pub eval_every: u64,
    /// Validation batches per evaluation (default 10).
    pub eval_batches: usize,
    /// Log every this many steps (default 10).
    pub log_every: u64,
    /// What a non-finite loss or gradient norm does: `stop` the run (default) or `skip` the step.
    pub nonfinite: NonFinitePolicy,
    /// CPU threads per rank for the GEMMs and the other layers; 0 = `OMP_NUM_THREADS`, else
    /// `OPENBLAS_NUM_THREADS`, else the node's cores / its ranks (default 0).
    pub threads: usize,
    /// Activation recomputation: `none` (default), `selective` (the attention core) or `full`
    /// (every block from its input).
    pub recompute: Recompute,
    /// Testing knob `[step, rank]`: rank's loss is made NaN at that step (default: none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inject_nan_at: Option<[u64; 2]>,
    /// Loss scaling: `dynamic` (default under fp16), `none` (default otherwise) or a fixed scale.
    pub loss_scale: LossScale,
    /// First scale of dynamic loss scaling (default 65536).
    pub loss_scale_init: f64,
    /// Factor the dynamic scale grows by after `loss_scale_growth_interval` good steps (default 2).
    pub loss_scale_growth: f64,
    /// Factor the dynamic scale is multiplied by after a step with non-finite gradients (default 0.5).
    pub loss_scale_backoff: f64,
    /// Consecutive steps with finite gradients before the dynamic scale grows (default 2000).
    pub loss_scale_growth_interval: u64,
    /// Smallest dynamic scale; backing off below it stops the run (default 1).
    pub loss_scale_min: f64,
}

/// `train.nonfinite`: what a step whose loss or gradient norm is NaN or infinite does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NonFinitePolicy {
    /// Stop every rank with an error naming the step and rank(s).
    #[default]
    Stop,
    /// Skip the optimizer update of that step (counted and logged) and go on.
    Skip,
}

/// `[train]` as written (`seq_len` may be absent).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
struct TrainSection {
    steps: u64,
    micro_batch: usize,
    seq_len: Option<usize>,
    grad_accum: usize,
    seed: u64,
    eval_every: u64,
    eval_batches: usize,
    log_every: u64,
    nonfinite: NonFinitePolicy,
    threads: usize,
    recompute: Recompute,
    inject_nan_at: Option<[u64; 2]>,
    loss_scale: Option<LossScale>,
    loss_scale_init: f64,
    loss_scale_growth: f64,
    loss_scale_backoff: f64,
    loss_scale_growth_interval: u64,
    loss_scale_min: f64,
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection {
            steps: 1000,
            micro_batch: 4,
            seq_len: None,
            grad_accum: 1,
            seed: 42,
            eval_every: 0,
            eval_batches: 10,
            log_every: 10,
            nonfinite: NonFinitePolicy::Stop,
            threads: 0,
            recompute: Recompute::None,
            inject_nan_at: None,
            loss_scale: None,
            loss_scale_init: 65536.0,
            loss_scale_growth: 2.0,
            loss_scale_backoff: 0.5,
            loss_scale_growth_interval: 2000,
            loss_scale_min: 1.0,
        }
    }
}

/// `[optim]`: AdamW with linear warmup then cosine decay to `min_lr`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OptimConfig {
    /// Peak learning rate (default 3e-4).
    pub lr: f64,
    /// Final learning rate, `0 <= min_lr <= lr` (default 0).
    pub min_lr: f64,
    /// Steps of linear warmup (default 0).
    pub warmup_steps: u64,
    /// Decoupled weight decay (default 0.1).
    pub weight_decay: f64,
    /// Adam beta1 (default 0.9).
    pub beta1: f64,
    /// Adam beta2 (default 0.95).
    pub beta2: f64,
    /// Adam epsilon (default 1e-8).
    pub eps: f64,
    /// Clip the global gradient norm to this; 0 = off (default 1.0).
    pub grad_clip: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            lr: 3e-4,
            min_lr: 0.0,
            warmup_steps: 0,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
        }
    }
}

pub use crate::parallel::options::{Axis, AxisOrder, ParallelConfig, ScheduleName};
pub use crate::parallel::options::DpSync;

/// `[checkpoint]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CheckpointConfig {
    /// Directory of checkpoints (default: none, no checkpoints are written).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    /// Save every this many steps and at the end; 0 = only at the end (default 0).
    pub every: u64,
    /// Checkpoints kept, oldest deleted first; 0 = keep all (default 3).
    pub keep: usize,
    /// `"latest"` (newest checkpoint in `dir`) or a checkpoint path to resume from (default: none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resume: Option<String>,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            dir: None,
            every: 0,
            keep: 3,
            resume: None,
        }
    }
}

/// `[metrics]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MetricsConfig {
    /// Peak dense TFLOP/s of one device in the training precision, for MFU (default: unknown; on
    /// the CPU the sgemm rate each rank measures at start-up stands in, on a GPU the device's
    /// datasheet peak where known, else no MFU).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_tflops: Option<f64>,
}

/// The whole file as written.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct FileConfig {
    device: Option<DeviceKind>,
    precision: Option<Precision>,
    init_from: Option<PathBuf>,
    model: ModelSection,
    data: DataConfig,
    train: TrainSection,
    optim: OptimConfig,
    parallel: ParallelConfig,
    checkpoint: CheckpointConfig,
    metrics: MetricsConfig,
    ps: PsConfig,
}

impl JobConfig {
    /// Reads the TOML file at `path`, applies `sets` (`section.key=value`) and `MESHTRAIN_*`
    /// environment overrides, and validates the result.
    /// A job file that cannot be read or parsed is a configuration error too (exit status 2, like
    /// every other bad configuration).
    pub fn load(path: &Path, sets: &[String]) -> Result<JobConfig> {
        let job_file = |e: Error| match e {
            Error::Io { .. } | Error::File { .. } => Error::config("job file", e.to_string()),
            other => other,
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| job_file(Error::io(format!("read config {}", path.display()), e)))?;
        let env: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| k.starts_with(overrides::ENV_PREFIX))
            .collect();
        Self::from_sources(&text, path, sets, &env).map_err(job_file)
    }

    /// Parses `text` as the file and applies `sets`; the process environment is not consulted.
    pub fn from_str(text: &str, sets: &[String]) -> Result<JobConfig> {
        Self::from_sources(text, Path::new("<config>"), sets, &[])
    }

    /// Parses `text` (named `origin` in errors), applies `sets`, then the `MESHTRAIN_*` pairs of
    /// `env` (other pairs are ignored), and validates.
    pub fn from_sources(
        text: &str,
        origin: &Path,
        sets: &[String],
        env: &[(String, String)],
    ) -> Result<JobConfig> {
        let (table, overridden) = overrides::parse_with_overrides(text, origin, sets, env)?;
        let from = |key: &str| {
            overridden
                .get(key)
                .map(|o| format!(" (from {o})"))
                .unwrap_or_default()
        };

        let mut unknown: Vec<String> = Vec::new();
        let mut note_unknown = |path: serde_ignored::Path<'_>| unknown.push(path.to_string());
        let de = serde_ignored::Deserializer::new(toml::Value::Table(table), &mut note_unknown);
        let parsed: std::result::Result<FileConfig, _> = serde_path_to_error::deserialize(de);
        if let Some(key) = unknown.first() {
            let hint = keys::nearest(key).map_or(String::new(), |k| format!(" (did you mean `{k}`?)"));
            return Err(Error::config(
                key.clone(),
                format!("unknown key{}{hint}", from(key)),
            ));
        }
        let file = parsed.map_err(|e| {
            let key = e.path().to_string();
            Error::config(
                key.clone(),
                format!("{}{}", e.inner().message(), from(&key)),
            )
        })?;
        let cfg = file.resolve()?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every value; errors name the offending key. Called by the constructors.
    pub fn validate(&self) -> Result<()> {
        let m = &self.model;
        m.validate()?;
        if let Some(p) = &self.init_from {
            if !p.exists() {
                return Err(Error::config(
                    "init_from",
                    format!("{} does not exist", p.display()),
                ));
            }
        }
        validate_source("data.source", &self.data.source)?;
        if let Some(v) = &self.data.val_source {
            validate_source("data.val_source", v)?;
        }

        let t = &self.train;
        at_least("train.steps", t.steps, 1)?;
        at_least("train.micro_batch", t.micro_batch as u64, 1)?;
        at_least("train.grad_accum", t.grad_accum as u64, 1)?;
        at_least("train.log_every", t.log_every, 1)?;
        if t.seq_len == 0 || t.seq_len > m.max_seq_len {
            return Err(Error::config(
                "train.seq_len",
                format!(
                    "{} is not in 1..={} (model.max_seq_len)",
                    t.seq_len, m.max_seq_len
                ),
            ));
        }
        if t.eval_every > 0 {
            at_least("train.eval_batches", t.eval_batches as u64, 1)?;
        }
        if t.threads > MAX_THREADS {
            return Err(Error::config("train.threads", format!("{} is above the maximum {MAX_THREADS} (0 = automatic)", t.threads)));
        }
        loss_scale::validate(t)?;

        let o = &self.optim;
        if !(o.lr.is_finite() && o.lr > 0.0) {
            return Err(Error::config(
                "optim.lr",
                format!("{} is not a positive number", o.lr),
            ));
        }
        if !(0.0..=o.lr).contains(&o.min_lr) {
            return Err(Error::config(
                "optim.min_lr",
                format!("{} is not in [0, lr = {}]", o.min_lr, o.lr),
            ));
        }
        non_negative("optim.weight_decay", o.weight_decay)?;
        non_negative("optim.grad_clip", o.grad_clip)?;
        for (key, beta) in [("optim.beta1", o.beta1), ("optim.beta2", o.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(Error::config(key, format!("{beta} is not in [0, 1)")));
            }
        }
        if !(o.eps.is_finite() && o.eps > 0.0) {
            return Err(Error::config(
                "optim.eps",
                format!("{} is not a positive number", o.eps),
            ));
        }

        self.validate_parallel()?;
        self.validate_ps()?;

        if self.checkpoint.dir.as_ref().is_some_and(|d| d.as_os_str().is_empty()) {
            return Err(Error::config("checkpoint.dir", "must not be empty"));
        }
        if self.checkpoint.dir.is_none() && self.checkpoint.resume.as_deref() == Some("latest") {
            return Err(Error::config("checkpoint.resume", "`latest` needs checkpoint.dir"));
        }
        if self.checkpoint.resume.as_deref().is_some_and(str::is_empty) {
            return Err(Error::config(
                "checkpoint.resume",
                "must be `latest` or a checkpoint path",
            ));
        }
        if let Some(p) = self.metrics.peak_tflops {
            if !(p.is_finite() && p > 0.0) {
                return Err(Error::config(
                    "metrics.peak_tflops",
                    format!("{p} is not a positive number"),
                ));
            }
        }
        Ok(())
    }

    fn validate_parallel(&self) -> Result<()> {
        let (p, m) = (&self.parallel, &self.model);
        at_least("parallel.tp", p.tp as u64, 1)?;
        at_least("parallel.pp", p.pp as u64, 1)?;
        at_least("parallel.dp", p.dp as u64, 1)?;
        at_least("parallel.microbatches", p.microbatches as u64, 1)?;
        at_least("parallel.virtual_stages", p.virtual_stages as u64, 1)?;
        if !(p.bucket_mb.is_finite() && p.bucket_mb > 0.0) {
            return Err(Error::config("parallel.bucket_mb", format!("{} must be a positive number of MiB", p.bucket_mb)));
        }
        if m.n_head % p.tp != 0 {
            return Err(Error::config(
                "parallel.tp",
                format!("{} does not divide model.n_head {}", p.tp, m.n_head),
            ));
        }
        if m.padded_vocab_size() % p.tp != 0 {
            return Err(Error::config(
                "parallel.tp",
                format!(
                    "{} does not divide the padded vocabulary {}",
                    p.tp,
                    m.padded_vocab_size()
                ),
            ));
        }
        if m.llama.is_some() {
            crate::model::tp_layout::check_tp(m, 0, p.tp)?;
        }
        if p.pp > m.n_layer {
            return Err(Error::config(
                "parallel.pp",
                format!("{} exceeds model.n_layer {}", p.pp, m.n_layer),
            ));
        }
        if p.zero > 3 {
            return Err(Error::config(
                "parallel.zero",
                format!("{} is not a ZeRO stage 0-3", p.zero),
            ));
        }
        if p.sequence_parallel {
            if p.tp < 2 {
                return Err(Error::config(
                    "parallel.sequence_parallel",
                    "needs parallel.tp > 1",
                ));
            }
            if self.train.seq_len % p.tp != 0 {
                return Err(Error::config(
                    "train.seq_len",
                    format!(
                        "{} is not divisible by parallel.tp {} (sequence_parallel)",
                        self.train.seq_len, p.tp
                    ),
                ));
            }
        }
        let stages = p.pp * p.virtual_stages;
        if p.schedule == ScheduleName::Interleaved {
            if m.n_layer < stages {
                return Err(Error::config(
                    "parallel.virtual_stages",
                    format!(
                        "interleaved: model.n_layer {} blocks cannot fill pp {} x virtual_stages {} \
                         stages of at least one block",
                        m.n_layer, p.pp, p.virtual_stages
                    ),
                ));
            }
            if p.microbatches % p.pp != 0 {
                return Err(Error::config(
                    "parallel.microbatches",
                    format!(
                        "interleaved: {} is not a multiple of pp {}",
                        p.microbatches, p.pp
                    ),
                ));
            }
        } else if p.virtual_stages != 1 {
            return Err(Error::config(
                "parallel.virtual_stages",
                "above 1 only with schedule = \"interleaved\"",
            ));
        }
        if !p.stage_layers.is_empty() {
            stage_split::check_counts(&p.stage_layers, stages, m.n_layer)?;
        }
        Ok(())
    }

    /// Checks that the job was started with exactly `tp * pp * dp` ranks; if not, the error says
    /// which `--set` overrides would fit the ranks the job got.
    pub fn validate_world(&self, world_size: usize) -> Result<()> {
        let p = &self.parallel;
        if self.uses_ps() && self.ranks_needed() != world_size {
            return Err(Error::config(
                "ps.servers",
                format!(
                    "tp {} x pp {} x dp {} workers + {} server(s) = {} ranks, but the job has {world_size}",
                    p.tp, p.pp, p.dp, self.ranks_needed() - p.tp * p.pp * p.dp, self.ranks_needed()
                ),
            ));
        }
        if !self.uses_ps() && p.tp * p.pp * p.dp != world_size {
            let fits = self.layouts_for(world_size);
            let hint = match fits.first() {
                None => format!("; no layout of this model fits {world_size} ranks"),
                Some(first) => {
                    let alt = fits.get(1).map_or(String::new(), |a| format!(", or {a}"));
                    format!("; for {world_size} ranks use {first}{alt}")
                }
            };
            return Err(Error::config(
                "parallel",
                format!(
                    "tp {} x pp {} x dp {} = {} ranks, but the job has {world_size}{hint}",
                    p.tp,
                    p.pp,
                    p.dp,
                    p.tp * p.pp * p.dp
                ),
            ));
        }
        Ok(())
    }

    /// Up to two `--set ...` overrides that make this job valid on `ranks` ranks: first the one
    /// keeping tp and pp (only dp changes), then smaller tp/pp, last plain data parallelism.
    fn layouts_for(&self, ranks: usize) -> Vec<String> {
        let p = &self.parallel;
        let mut tries = vec![(p.tp, p.pp), (p.tp, 1), (1, p.pp), (1, 1)];
        tries.dedup();
        let mut fits: Vec<String> = Vec::new();
        for (tp, pp) in tries {
            if ranks % (tp * pp) != 0 {
                continue;
            }
            let mut c = self.clone();
            c.parallel.tp = tp;
            c.parallel.pp = pp;
            c.parallel.dp = ranks / (tp * pp);
            c.parallel.sequence_parallel &= tp > 1;
            if c.validate_parallel().is_err() {
                continue;
            }
            let mut sets = Vec::new();
            for (key, old, new) in [("tp", p.tp, tp), ("pp", p.pp, pp), ("dp", p.dp, c.parallel.dp)] {
                if old != new {
                    sets.push(format!("--set parallel.{key}={new}"));
                }
            }
            if p.sequence_parallel && !c.parallel.sequence_parallel {
                sets.push("--set parallel.sequence_parallel=false".into());
            }
            let text = format!("`{}`", sets.join(" "));
            if !fits.contains(&text) {
                fits.push(text);
            }
            if fits.len() == 2 {
                break;
            }
        }
        fits
    }

    /// The effective configuration as TOML; loading it back gives an equal `JobConfig`.
    pub fn to_toml(&self) -> String {
        // Every field is a string, number, bool, path or table, all of which TOML represents.
        toml::to_string(self).expect("a JobConfig is always representable as TOML")
    }
}

impl fmt::Display for JobConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_toml())
    }
}

impl FileConfig {
    fn resolve(self) -> Result<JobConfig> {
        let model = self.model.resolve()?;
        let t = self.train;
        let precision = self.precision.unwrap_or(match self.device {
            None | Some(DeviceKind::Cpu) => Precision::Fp32,
            Some(_) => Precision::Bf16,
        });
        Ok(JobConfig {
            device: self.device.unwrap_or(DeviceKind::Cpu),
            precision,
            init_from: self.init_from,
            model,
            data: self.data,
            train: TrainConfig {
                steps: t.steps,
                micro_batch: t.micro_batch,
                seq_len: t.seq_len.unwrap_or(model.max_seq_len),
                grad_accum: t.grad_accum,
                seed: t.seed,
                eval_every: t.eval_every,
                eval_batches: t.eval_batches,
                log_every: t.log_every,
                nonfinite: t.nonfinite,
                threads: t.threads,
                recompute: t.recompute,
                inject_nan_at: t.inject_nan_at,
                loss_scale: t.loss_scale.unwrap_or(match precision {
                    Precision::Fp16 => LossScale::Dynamic,
                    _ => LossScale::None,
                }),
                loss_scale_init: t.loss_scale_init,
                loss_scale_growth: t.loss_scale_growth,
                loss_scale_backoff: t.loss_scale_backoff,
                loss_scale_growth_interval: t.loss_scale_growth_interval,
                loss_scale_min: t.loss_scale_min,
            },
            optim: self.optim,
            parallel: self.parallel,
            checkpoint: self.checkpoint,
            metrics: self.metrics,
            ps: self.ps,
        })
    }
}

impl ModelSection {
    fn resolve(&self) -> Result<GptConfig> {
        let base = self.size.as_deref().map(GptConfig::named).transpose()?;
        let pick = |key: &str, explicit: Option<usize>, named: Option<usize>| {
            explicit.or(named).ok_or_else(|| {
                Error::config(
                    format!("model.{key}"),
                    "missing: give model.size or all of n_layer, n_head, n_embd, vocab_size, max_seq_len",
                )
            })
        };
        Ok(GptConfig {
            n_layer: pick("n_layer", self.n_layer, base.map(|b| b.n_layer))?,
            n_head: pick("n_head", self.n_head, base.map(|b| b.n_head))?,
            n_embd: pick("n_embd", self.n_embd, base.map(|b| b.n_embd))?,
            vocab_size: pick("vocab_size", self.vocab_size, base.map(|b| b.vocab_size))?,
            max_seq_len: pick("max_seq_len", self.max_seq_len, base.map(|b| b.max_seq_len))?,
            llama: self.llama_keys().resolve(base, self.n_head, self.n_embd)?,
        })
    }
}

impl ModelSection {
    fn llama_keys(&self) -> crate::model::llama::LlamaKeys {
        crate::model::llama::LlamaKeys {
            arch: self.arch.clone(),
            n_kv_head: self.n_kv_head,
            ffn_dim: self.ffn_dim,
            rope_theta: self.rope_theta,
            rope_scaling_factor: self.rope_scaling_factor,
            rope_low_freq_factor: self.rope_low_freq_factor,
            rope_high_freq_factor: self.rope_high_freq_factor,
            rope_original_max_seq_len: self.rope_original_max_seq_len,
            norm_eps: self.norm_eps,
            tie_embeddings: self.tie_embeddings,
        }
    }
}

fn at_least(key: &str, value: u64, min: u64) -> Result<()> {
    if value < min {
        return Err(Error::config(
            key,
            format!("{value} is below the minimum {min}"),
        ));
    }
    Ok(())
}

fn non_negative(key: &str, value: f64) -> Result<()> {
    if !(value.is_finite() && value >= 0.0) {
        return Err(Error::config(
            key,
            format!("{value} is not a non-negative number"),
        ));
    }
    Ok(())
}

fn validate_source(key: &str, source: &str) -> Result<()> {
    if source.is_empty() {
        return Err(Error::config(key, "must be \"synthetic\" or a shard glob"));
    }
    if source != "synthetic" {
        glob::Pattern::new(source)
            .map_err(|e| Error::config(key, format!("bad glob `{source}`: {e}")))?;
    }
    Ok(())
}
