//! Saving and resuming a training run through [`crate::checkpoint`], in any layout.
//!
//! What a run writes: the parameters (`model/<name>`), the AdamW moments (`optim/m/<name>`,
//! `optim/v/<name>`) and, as metadata, the step, tokens seen, the optimizer's step count, the data
//! position and the parallel layout. Tensors are always stored at their global shape; a rank
//! describes its part of each tensor as a box of the global tensor ([`TensorMap`]: tensor and
//! pipeline parallel shards are boxes, the fused qkv weight a box of its (3, C, C) view, which maps
//! to three row blocks of the global (3C, C) tensor). Ownership, so that each element is written
//! once: copies replicated over TP are written by TP rank 0, the tied embedding by the first
//! pipeline stage, and within the data-parallel group ZeRO-1 ranks write the bucket blocks their
//! optimizer state covers while replicated state (ZeRO-0) is split by `block_range(n, dp, rank)`.
//! Resuming reads whatever layout wrote the checkpoint: every rank loads exactly the boxes of its
//! own parameters and of the moment ranges its optimizer state covers. The learning-rate schedule
//! is a function of the step, so restoring the step restores it.

use std::ops::Range;
use std::path::{Path, PathBuf};

use serde_json::json;

use super::grad_sync::DataParallel;
use super::replica::TensorMap;
use crate::checkpoint::{self, flat_range_boxes, CkptMeta, LossScaleMeta, OptimizerMeta, ShardSlice};
use crate::comm::{block_range, Communicator};
use crate::config::JobConfig;
use crate::data::SamplerState;
use crate::error::{Error, Result};
use crate::model::ParamLayout;
use crate::optim::AdamWConfig;

/// Where a resumed run continues.
pub struct Resumed {
    /// Last completed step.
    pub step: u64,
    /// Tokens consumed so far.
    pub tokens_seen: u64,
    /// Data position of the next global batch.
    pub sampler: SamplerState,
    /// Loss scaling's state, if the checkpoint has one.
    pub loss_scale: Option<LossScaleMeta>,
}

fn intersect(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    a.start.max(b.start)..a.end.min(b.end).max(a.start.max(b.start))
}

/// A hyperslab of a global tensor and the local flat elements that hold it.
type Slab = (Vec<usize>, Vec<usize>, Range<usize>);

/// Global hyperslabs covering `local` (a sub-range of `t.range`), in local element order.
fn global_slabs(t: &TensorMap, local: Range<usize>) -> Result<Vec<Slab>> {
    let (view, global) = (&t.view_shape, &t.global_shape);
    let merged = view.len() == global.len() + 1 && view[0] * view[1] == global[0] && view[2..] == global[1..];
    if view != global && !merged {
        return Err(Error::InvalidArgument(format!("{}: view {view:?} of {global:?} is not supported", t.name)));
    }
    let mut out = Vec::new();
    let mut at = local.start;
    for (off, shape) in flat_range_boxes(&t.box_shape, local.start - t.range.start..local.end - t.range.start) {
        let n: usize = shape.iter().product();
        let voff: Vec<usize> = off.iter().zip(&t.box_offset).map(|(a, b)| a + b).collect();
        if view == global {
            out.push((voff, shape, at..at + n));
        } else {
            // The leading two view dimensions are one global dimension: one slab per leading index.
            let inner: usize = shape[1..].iter().product();
            for i in 0..shape[0] {
                let mut goff = vec![(voff[0] + i) * view[1] + voff[1]];
                goff.extend_from_slice(&voff[2..]);
                out.push((goff, shape[1..].to_vec(), at + i * inner..at + (i + 1) * inner));
            }
        }
        at += n;
    }
    Ok(out)
}

/// Writes a checkpoint of `step` under `dir` (`checkpoint.dir`); collective over `world`.
#[allow(clippy::too_many_arguments)]
pub fn save(
    dir: &Path,
    world: &Communicator,
    dp: &Communicator,
    cfg: &JobConfig,
    adamw: AdamWConfig,
    maps: &[TensorMap],
    params: &[f32],
    sync: &DataParallel,
    step: u64,
    tokens_seen: u64,
    (sampler, loss_scale): (SamplerState, Option<LossScaleMeta>),
) -> Result<PathBuf> {
    let mine = block_range(params.len(), dp.size(), dp.rank());
    let mut slices: Vec<ShardSlice> = Vec::new();
    for s in sync.states() {
        let r = if sync.zero == 0 { intersect(&s.range(), &mine) } else { s.range() };
        for t in maps.iter().filter(|t| t.owner) {
            let sub = intersect(&t.range, &r);
            if sub.is_empty() {
                continue;
            }
            for (offset, shape, lr) in global_slabs(t, sub)? {
                let local = lr.start - s.range().start..lr.end - s.range().start;
                for (prefix, data) in [("model", &params[lr.clone()]), ("optim/m", &s.m[local.clone()]), ("optim/v", &s.v[local])] {
                    slices.push(ShardSlice {
                        name: format!("{prefix}/{}", t.name),
                        global_shape: t.global_shape.clone(),
                        offset: offset.clone(),
                        shape: shape.clone(),
                        data,
                    });
                }
            }
        }
    }
    let steps_taken = sync.states().first().map_or(0, |s| s.step);
    let mut meta = CkptMeta::new(step, tokens_seen, cfg.model, OptimizerMeta { adamw, steps_taken });
    meta.loss_scale = loss_scale;
    let p = &cfg.parallel;
    meta.parallel = json!({"dp": p.dp, "tp": p.tp, "pp": p.pp, "zero": p.zero, "bucket_mb": p.bucket_mb,
        "sequence_parallel": p.sequence_parallel, "microbatches": p.microbatches});
    meta.lr_schedule = json!({"step": step, "lr": cfg.optim.lr, "min_lr": cfg.optim.min_lr,
        "warmup_steps": cfg.optim.warmup_steps, "total_steps": cfg.train.steps});
    meta.data_positions = json!({"epoch": sampler.epoch, "index": sampler.index, "seed": sampler.seed,
        "sequences_per_global_batch": p.dp * cfg.train.micro_batch, "seq_len": cfg.train.seq_len});
    checkpoint::save(world, dir, step, &slices, &meta, cfg.checkpoint.keep)
}

/// The checkpoint directory `resume` names: a path, or `latest`: the directory the pointer file
/// in `checkpoint.dir` names, which must be a `step_XXXXXXXX` entry of that directory. `None`:
/// `latest` in a missing or empty `checkpoint.dir` (a fresh start).
pub fn resolve(cfg: &JobConfig, resume: &str) -> Result<Option<PathBuf>> {
    let root = match (resume, &cfg.checkpoint.dir) {
        ("latest", Some(root)) => root,
        ("latest", None) => return Err(Error::config("checkpoint.resume", "`latest` needs checkpoint.dir")),
        (path, _) => return Ok(Some(PathBuf::from(path))),
    };
    let pointer = root.join(checkpoint::LATEST_FILE);
    let name = match std::fs::read_to_string(&pointer) {
        Ok(name) => name,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let any = std::fs::read_dir(root)
                .map(|d| d.flatten().any(|e| e.file_name().to_str().and_then(checkpoint::parse_step_dir).is_some()))
                .unwrap_or(false);
            if any {
                return Err(Error::file(&pointer, None, "checkpoint.resume = \"latest\": no pointer, but checkpoints exist; name one"));
            }
            return Ok(None);
        }
        Err(e) => return Err(Error::file(&pointer, None, format!("checkpoint.resume = \"latest\": {e}"))),
    };
    let name = name.trim();
    if checkpoint::parse_step_dir(name).is_none() {
        return Err(Error::file(&pointer, None, format!("names `{name}`, not a step_XXXXXXXX directory of {}", root.display())));
    }
    Ok(Some(root.join(name)))
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

/// Loads the checkpoint at `path` into this rank's parameters and optimizer state (whatever layout
/// wrote it); every rank validates the index first.
pub fn restore(
    path: &Path,
    cfg: &JobConfig,
    maps: &[TensorMap],
    params: &mut [f32],
    sync: &mut DataParallel,
) -> Result<Resumed> {
    let index = checkpoint::open(path)?;
    index.check_model(&cfg.model)?;
    let full = ParamLayout::new(&cfg.model);
    let expected: Vec<(String, Vec<usize>)> = ["model", "optim/m", "optim/v"]
        .iter()
        .flat_map(|p| full.entries().iter().map(move |e| (format!("{p}/{}", e.name), e.shape.clone())))
        .collect();
    index.expect_tensors(&expected)?;
    for t in maps {
        for (offset, shape, lr) in global_slabs(t, t.range.clone())? {
            index.load_slice(&format!("model/{}", t.name), &offset, &shape, &mut params[lr])?;
        }
    }
    let meta = index.meta().clone();
    for s in sync.states_mut() {
        let start = s.range().start;
        for t in maps {
            let sub = intersect(&t.range, &s.range());
            if sub.is_empty() {
                continue;
            }
            for (offset, shape, lr) in global_slabs(t, sub)? {
                let local = lr.start - start..lr.end - start;
                index.load_slice(&format!("optim/m/{}", t.name), &offset, &shape, &mut s.m[local.clone()])?;
                index.load_slice(&format!("optim/v/{}", t.name), &offset, &shape, &mut s.v[local])?;
            }
        }
        s.step = meta.optimizer.steps_taken;
    }
    Ok(Resumed { step: meta.step, tokens_seen: meta.tokens_seen, sampler: position(&meta, cfg, path)?, loss_scale: meta.loss_scale })
}

/// Copies the hyperslab (`offset`, `shape`) of a row-major tensor of `global_shape` into `out`.
fn extract(global: &[f32], global_shape: &[usize], offset: &[usize], shape: &[usize], out: &mut [f32]) {
    let last = shape.len() - 1;
    let row = shape[last];
    let rows: usize = shape[..last].iter().product();
    for (r, chunk) in out.chunks_mut(row.max(1)).take(rows).enumerate() {
        // Index of this row in the slab, then its flat start in the global tensor.
        let (mut rem, mut flat) = (r, 0usize);
        let mut idx = vec![0usize; last];
        for d in (0..last).rev() {
            idx[d] = rem % shape[d];
            rem /= shape[d];
        }
        for d in 0..=last {
            let i = if d < last { idx[d] } else { 0 };
            flat = flat * global_shape[d] + offset[d] + i;
        }
        chunk.copy_from_slice(&global[flat..flat + row]);
    }
}

/// Parameters from an exported file or a Hugging Face GPT-2 directory (`init_from`), checked
/// against the model's layout.
pub fn init_from(path: &Path, cfg: &JobConfig, maps: &[TensorMap], params: &mut [f32]) -> Result<()> {
    let (model, tensors) = checkpoint::read_weights(path)?;
    if model != cfg.model {
        return Err(Error::file(path, None, model.mismatch(&cfg.model)));
    }
    for t in maps {
        let name = format!("model/{}", t.name);
        let (_, shape, data) = tensors
            .iter()
            .find(|x| x.0 == name)
            .ok_or_else(|| Error::file(path, None, format!("missing tensor `{name}`")))?;
        if *shape != t.global_shape || data.len() != shape.iter().product::<usize>() {
            return Err(Error::file(path, None, format!("tensor `{name}` has shape {shape:?}, expected {:?}", t.global_shape)));
        }
        for (offset, slab, lr) in global_slabs(t, t.range.clone())? {
            extract(data, shape, &offset, &slab, &mut params[lr]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qkv_view_boxes_map_to_three_row_blocks() {
        // Global (3C, C) with C = 4, viewed (3, 4, 4); TP rank 1 of 2 holds rows 2..4 of each of q, k, v.
        let t = TensorMap {
            name: "qkv".into(),
            global_shape: vec![12, 4],
            view_shape: vec![3, 4, 4],
            box_offset: vec![0, 2, 0],
            box_shape: vec![3, 2, 4],
            range: 100..124,
            owner: true,
        };
        let slabs = global_slabs(&t, 100..124).unwrap();
        let want: Vec<Slab> = vec![
            (vec![2, 0], vec![2, 4], 100..108),
            (vec![6, 0], vec![2, 4], 108..116),
            (vec![10, 0], vec![2, 4], 116..124),
        ];
        assert_eq!(slabs, want);
        // A partial range (a ZeRO block) starting inside k.
        let part = global_slabs(&t, 110..118).unwrap();
        let covered: usize = part.iter().map(|s| s.2.len()).sum();
        assert_eq!(covered, 8);
        assert_eq!(part[0].2.start, 110);
        let global: Vec<f32> = (0..48).map(|x| x as f32).collect();
        let mut out = vec![0f32; 8];
        extract(&global, &[12, 4], &[6, 0], &[2, 4], &mut out);
        assert_eq!(out, (24..32).map(|x| x as f32).collect::<Vec<_>>());
    }
}
