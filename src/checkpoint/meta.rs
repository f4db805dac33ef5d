//! What a checkpoint records besides tensor bytes: the run's metadata ([`CkptMeta`]) and the tensor
//! table ([`TensorRecord`]: global shape and shards), both stored as JSON attributes of the index.
//!
//! Invariant checked by [`check_tiling`]: the shards of a tensor lie inside its global shape, do not
//! overlap, and their volumes add up to the global volume, so they tile it exactly.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::model::GptConfig;
use crate::optim::AdamWConfig;

/// Run state saved with the tensors; everything a resume needs besides parameters and moments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CkptMeta {
    /// Optimizer steps completed.
    pub step: u64,
    /// Training tokens consumed so far (all ranks together).
    pub tokens_seen: u64,
    /// The model's shape.
    pub model: GptConfig,
    /// Parallel layout (dp, tp, pp, zero, ...), free-form.
    pub parallel: serde_json::Value,
    /// AdamW hyper-parameters and steps taken.
    pub optimizer: OptimizerMeta,
    /// Learning-rate schedule state, free-form.
    pub lr_schedule: serde_json::Value,
    /// Random-number-generator states, free-form.
    pub rng: serde_json::Value,
    /// Per data-parallel rank position in the data stream, free-form.
    pub data_positions: serde_json::Value,
    /// `CARGO_PKG_VERSION` of the writer.
    pub meshtrain_version: String,
    /// Loss scaling's state (`train.loss_scale`); absent when the run scaled no loss, and in
    /// checkpoints written before loss scaling existed (a resume then starts from the
    /// configured `train.loss_scale_init`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<LossScaleMeta>,
}

/// Loss-scaling part of [`CkptMeta`]: what the next step's scale is, and how far the dynamic
/// scale is from its next growth.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScaleMeta {
    /// The scale of the next step.
    pub scale: f64,
    /// Consecutive steps with finite gradients since the scale last changed.
    pub good_steps: u64,
    /// Steps skipped so far (the metrics' cumulative `skipped_steps`).
    #[serde(default)]
    pub skipped_steps: u64,
}

/// Optimizer part of [`CkptMeta`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OptimizerMeta {
    /// AdamW hyper-parameters.
    pub adamw: AdamWConfig,
    /// Steps the optimizer has taken (bias correction needs it).
    pub steps_taken: u64,
}

impl CkptMeta {
    /// Metadata with this build's version and empty free-form fields (JSON `null`).
    pub fn new(step: u64, tokens_seen: u64, model: GptConfig, optimizer: OptimizerMeta) -> Self {
        CkptMeta {
            step,
            tokens_seen,
            model,
            parallel: serde_json::Value::Null,
            optimizer,
            lr_schedule: serde_json::Value::Null,
            rng: serde_json::Value::Null,
            data_positions: serde_json::Value::Null,
            meshtrain_version: env!("CARGO_PKG_VERSION").to_string(),
            loss_scale: None,
        }
    }
}

/// One hyperslab of a tensor stored in a rank file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardRecord {
    /// Rank file holding it, relative to the checkpoint directory.
    pub file: String,
    /// Dataset path inside that file.
    pub dataset: String,
    /// Global offset per dimension.
    pub offset: Vec<usize>,
    /// Local shape.
    pub shape: Vec<usize>,
    /// SHA-256 (hex) of the shard's little-endian f32 bytes in row-major order.
    pub sha256: String,
    /// SHA-256 (hex) of each tile of the shard (see `tiles`); empty in checkpoints before format
    /// 3 and for shards of more than two dimensions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tile_sha256: Vec<String>,
}

impl ShardRecord {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the shard has no elements (never true for a validated record).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A tensor of the checkpoint: its name, global shape and shards.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorRecord {
    /// Full name, e.g. `model/h.0.attn.qkv.weight`.
    pub name: String,
    /// Global shape, row-major.
    pub global_shape: Vec<usize>,
    /// Element type; only `f32` is written.
    pub dtype: String,
    /// The hyperslabs, in the order they were gathered (rank, then caller order).
    pub shards: Vec<ShardRecord>,
}

impl TensorRecord {
    /// Number of elements of the whole tensor.
    pub fn len(&self) -> usize {
        self.global_shape.iter().product()
    }

    /// Whether the tensor has no elements (never true for a validated record).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A rank file and its size, recorded so that a truncated file is found without opening it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    /// File name inside the checkpoint directory.
    pub name: String,
    /// Rank that wrote it.
    pub rank: usize,
    /// Size in bytes after the writer closed and fsynced it.
    pub bytes: u64,
}

/// Checks a tensor name: `/`-separated components of `[A-Za-z0-9._-]`, none empty, `.` or `..`.
pub fn check_name(name: &str) -> Result<()> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    let ok = !name.is_empty()
        && name
            .split('/')
            .all(|p| !p.is_empty() && p != "." && p != ".." && p.chars().all(ok_char));
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "tensor name `{name}`: want `/`-separated parts of letters, digits, `.`, `_`, `-`"
        )))
    }
}

/// Product of `dims`, or `None` on overflow.
pub fn volume(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// Whether hyperslab (`offset`, `shape`) lies inside `global` (same rank, no overflow).
pub fn inside(offset: &[usize], shape: &[usize], global: &[usize]) -> bool {
    offset.len() == global.len()
        && shape.len() == global.len()
        && offset
            .iter()
            .zip(shape)
            .zip(global)
            .all(|((&o, &s), &g)| o.checked_add(s).is_some_and(|e| e <= g))
}

fn overlap(a: &ShardRecord, b: &ShardRecord) -> bool {
    (0..a.offset.len())
        .all(|d| a.offset[d] < b.offset[d] + b.shape[d] && b.offset[d] < a.offset[d] + a.shape[d])
}

/// Checks that `t`'s shards tile its global shape exactly; errors name `file` and the tensor.
pub fn check_tiling(t: &TensorRecord, file: &Path) -> Result<()> {
    let bad = |msg: String| Error::file(file, None, format!("tensor `{}`: {msg}", t.name));
    let total = volume(&t.global_shape)
        .filter(|&v| v > 0)
        .ok_or_else(|| bad(format!("global shape {:?} is empty or overflows", t.global_shape)))?;
    if t.dtype != "f32" {
        return Err(bad(format!("dtype `{}` is not supported (only f32)", t.dtype)));
    }
    let mut covered = 0usize;
    for (i, s) in t.shards.iter().enumerate() {
        if !inside(&s.offset, &s.shape, &t.global_shape) || s.is_empty() {
            return Err(bad(format!(
                "shard {} (offset {:?}, shape {:?}) is empty or outside the global shape {:?}",
                s.dataset, s.offset, s.shape, t.global_shape
            )));
        }
        if let Some(o) = t.shards[..i].iter().find(|o| overlap(o, s)) {
            return Err(bad(format!(
                "shards {}:{} and {}:{} overlap",
                o.file, o.dataset, s.file, s.dataset
            )));
        }
        covered += s.len();
    }
    if covered != total {
        return Err(bad(format!(
            "shards cover {covered} of {total} elements (a rank did not pass its part?)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(offset: Vec<usize>, shape: Vec<usize>) -> ShardRecord {
        ShardRecord {
            file: "f".into(),
            dataset: format!("{offset:?}"),
            offset,
            shape,
            sha256: String::new(),
            tile_sha256: Vec::new(),
        }
    }

    #[test]
    fn tiling_accepts_exact_covers_only() {
        let t = |shards| TensorRecord {
            name: "t".into(),
            global_shape: vec![4, 6],
            dtype: "f32".into(),
            shards,
        };
        let p = Path::new("x");
        check_tiling(
            &t(vec![shard(vec![0, 0], vec![4, 3]), shard(vec![0, 3], vec![4, 3])]),
            p,
        )
        .unwrap();
        let gap = check_tiling(&t(vec![shard(vec![0, 0], vec![4, 3])]), p).unwrap_err();
        assert!(gap.to_string().contains("cover 12 of 24"), "{gap}");
        let over = t(vec![shard(vec![0, 0], vec![4, 4]), shard(vec![0, 3], vec![4, 3])]);
        assert!(check_tiling(&over, p)
            .unwrap_err()
            .to_string()
            .contains("overlap"));
        let out = t(vec![shard(vec![2, 0], vec![4, 6])]);
        assert!(check_tiling(&out, p).unwrap_err().to_string().contains("outside"));
    }

    #[test]
    fn names_are_restricted() {
        check_name("model/h.0.attn.qkv.weight").unwrap();
        for bad in ["", "a//b", "/a", "a/../b", "a b", "x@1"] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }
}
