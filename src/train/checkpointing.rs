//! Saving and resuming a training run through [`crate::checkpoint`].
//!
//! What a run writes: the parameters (`model/<name>`), the AdamW moments (`optim/m/<name>`,
//! `optim/v/<name>`) and, as metadata, the step, tokens seen, the optimizer's step count, the data
//! position and the parallel layout. Ownership (each element written exactly once): with ZeRO-1 a
//! rank writes the bucket blocks its optimizer state covers; replicated state (ZeRO-0) is split by
//! `block_range(n, dp, rank)`. Resuming reads whatever layout wrote the checkpoint: every rank loads
//! the full parameters and exactly the moment ranges its own state covers. The learning-rate
//! schedule is a function of the step, so restoring the step restores it.

use std::ops::Range;
use std::path::{Path, PathBuf};

use serde_json::json;

use super::grad_sync::DataParallel;
use crate::checkpoint::{self, flat_range_slices, load_flat_range, CkptMeta, OptimizerMeta, ShardSlice};
use crate::comm::{block_range, Communicator};
use crate::config::JobConfig;
use crate::data::SamplerState;
use crate::error::{Error, Result};
use crate::model::Gpt;
use crate::optim::AdamWConfig;

/// Where a resumed run continues.
pub struct Resumed {
    /// Last completed step.
    pub step: u64,
    /// Tokens consumed so far.
    pub tokens_seen: u64,
    /// Data position of the next global batch.
    pub sampler: SamplerState,
}

fn intersect(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    a.start.max(b.start)..a.end.min(b.end).max(a.start.max(b.start))
}

/// Writes a checkpoint of `step` under `cfg.checkpoint.dir`; collective over `dp`.
#[allow(clippy::too_many_arguments)]
pub fn save(
    dp: &Communicator,
    cfg: &JobConfig,
    adamw: AdamWConfig,
    model: &Gpt<f32>,
    sync: &DataParallel,
    step: u64,
    tokens_seen: u64,
    sampler: SamplerState,
) -> Result<PathBuf> {
    let entries = model.layout().entries();
    let n = model.params().len();
    let mine = block_range(n, dp.size(), dp.rank());
    let mut slices: Vec<ShardSlice> = Vec::new();
    for s in sync.states() {
        let r = if sync.zero == 0 { intersect(&s.range(), &mine) } else { s.range() };
        if r.is_empty() {
            continue;
        }
        slices.extend(flat_range_slices("model", entries, model.params(), 0, r.clone())?);
        slices.extend(flat_range_slices("optim/m", entries, &s.m, s.range().start, r.clone())?);
        slices.extend(flat_range_slices("optim/v", entries, &s.v, s.range().start, r)?);
    }
    let steps_taken = sync.states().first().map_or(0, |s| s.step);
    let mut meta = CkptMeta::new(step, tokens_seen, cfg.model, OptimizerMeta { adamw, steps_taken });
    let p = &cfg.parallel;
    meta.parallel = json!({"dp": p.dp, "tp": p.tp, "pp": p.pp, "zero": p.zero, "bucket_mb": p.bucket_mb});
    meta.lr_schedule = json!({"step": step, "lr": cfg.optim.lr, "min_lr": cfg.optim.min_lr,
        "warmup_steps": cfg.optim.warmup_steps, "total_steps": cfg.train.steps});
    meta.data_positions = json!({"epoch": sampler.epoch, "index": sampler.index, "seed": sampler.seed,
        "sequences_per_global_batch": p.dp * cfg.train.micro_batch, "seq_len": cfg.train.seq_len});
    checkpoint::save(dp, &cfg.checkpoint.dir, step, &slices, &meta, cfg.checkpoint.keep)
}

/// The checkpoint directory `resume` names: `latest` (through the pointer file in
/// `checkpoint.dir`) or a path.
pub fn resolve(cfg: &JobConfig, resume: &str) -> Result<PathBuf> {
    if resume != "latest" {
        return Ok(PathBuf::from(resume));
    }
    let pointer = cfg.checkpoint.dir.join(checkpoint::LATEST_FILE);
    let name = std::fs::read_to_string(&pointer)
        .map_err(|e| Error::file(&pointer, None, format!("checkpoint.resume = \"latest\" but no pointer: {e}")))?;
    Ok(cfg.checkpoint.dir.join(name.trim()))
}

fn position(meta: &CkptMeta, cfg: &JobConfig, path: &Path) -> Result<SamplerState> {
    let d = &meta.data_positions;
    let get = |k: &str| d.get(k).and_then(|v| v.as_u64());
    let bad = |msg: String| Error::file(path, None, format!("data position: {msg}"));
    let (epoch, index, seed) = match (get("epoch"), get("index"), get("seed")) {
        (Some(e), Some(i), Some(s)) => (e, i, s),
        _ => return Err(bad(format!("missing or malformed: {d}"))),
    };
    let old = get("sequences_per_global_batch").ok_or_else(|| bad("no global batch size".into()))?;
    let new = (cfg.parallel.dp * cfg.train.micro_batch) as u64;
    if get("seq_len") != Some(cfg.train.seq_len as u64) {
        return Err(Error::config("train.seq_len", format!("differs from the checkpoint's ({d})")));
    }
    let consumed = index * old;
    if consumed % new != 0 {
        return Err(Error::config(
            "train.micro_batch",
            format!("{consumed} sequences of the epoch were consumed, not a whole number of the new global batches of {new}"),
        ));
    }
    Ok(SamplerState { epoch, index: consumed / new, seed })
}

/// Loads the checkpoint at `path` into `model` and `sync` (whatever layout wrote it); collective.
pub fn restore(path: &Path, cfg: &JobConfig, model: &mut Gpt<f32>, sync: &mut DataParallel) -> Result<Resumed> {
    let index = checkpoint::open(path)?;
    index.check_model(&cfg.model)?;
    let entries = model.layout().entries().to_vec();
    let expected: Vec<(String, Vec<usize>)> = ["model", "optim/m", "optim/v"]
        .iter()
        .flat_map(|p| entries.iter().map(move |e| (format!("{p}/{}", e.name), e.shape.clone())))
        .collect();
    index.expect_tensors(&expected)?;
    let n = model.params().len();
    load_flat_range(&index, "model", &entries, 0..n, model.params_mut())?;
    let meta = index.meta().clone();
    for s in sync.states_mut() {
        let r = s.range();
        load_flat_range(&index, "optim/m", &entries, r.clone(), &mut s.m)?;
        load_flat_range(&index, "optim/v", &entries, r, &mut s.v)?;
        s.step = meta.optimizer.steps_taken;
    }
    Ok(Resumed { step: meta.step, tokens_seen: meta.tokens_seen, sampler: position(&meta, cfg, path)? })
}

/// Parameters from an exported file (`init_from`), checked against the model's layout.
pub fn init_from(path: &Path, cfg: &JobConfig, model: &mut Gpt<f32>) -> Result<()> {
    let (meta, tensors) = checkpoint::read_exported(path)?;
    if meta.model != cfg.model {
        return Err(Error::file(path, None, format!("model {:?} differs from the job's {:?}", meta.model, cfg.model)));
    }
    let layout = model.layout().clone();
    let params = model.params_mut();
    for e in layout.entries() {
        let name = format!("model/{}", e.name);
        let (_, shape, data) = tensors
            .iter()
            .find(|t| t.0 == name)
            .ok_or_else(|| Error::file(path, None, format!("missing tensor `{name}`")))?;
        if *shape != e.shape || data.len() != e.len {
            return Err(Error::file(path, None, format!("tensor `{name}` has shape {shape:?}, expected {:?}", e.shape)));
        }
        params[e.range()].copy_from_slice(data);
    }
    Ok(())
}
