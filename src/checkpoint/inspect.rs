//! `meshtrain ckpt inspect`: what a checkpoint holds, as text ([`std::fmt::Display`]) or JSON.
//!
//! The tensor table needs every tensor's L2 norm, so inspecting reads every shard once (one shard
//! in memory at a time); with `verify` each shard's SHA-256 is recomputed on the same pass.

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::checkpoint::h5;
use crate::checkpoint::index::{open, CheckpointIndex};
use crate::checkpoint::meta::{CkptMeta, FileRecord, ShardRecord};
use crate::error::{Error, Result};

/// One row of the tensor table.
#[derive(Debug, Clone, Serialize)]
pub struct TensorStats {
    /// Tensor name.
    pub name: String,
    /// Global shape.
    pub global_shape: Vec<usize>,
    /// Element type.
    pub dtype: String,
    /// Number of rank files holding a part of it.
    pub shards: usize,
    /// L2 norm over all elements.
    pub l2_norm: f64,
}

/// Statistics and leading values of one tensor (`--tensor NAME`).
#[derive(Debug, Clone, Serialize)]
pub struct TensorDetail {
    /// Tensor name.
    pub name: String,
    /// Smallest element.
    pub min: f32,
    /// Largest element.
    pub max: f32,
    /// Mean.
    pub mean: f64,
    /// Population standard deviation.
    pub std: f64,
    /// The first elements in row-major order.
    pub first: Vec<f32>,
}

/// What `inspect` found.
#[derive(Debug, Clone, Serialize)]
pub struct InspectReport {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// Run metadata.
    pub meta: CkptMeta,
    /// Rank files and sizes.
    pub files: Vec<FileRecord>,
    /// One row per tensor, sorted by name.
    pub tensors: Vec<TensorStats>,
    /// Whether every shard's hash was recomputed and matched.
    pub verified: bool,
    /// Details of the tensor asked for.
    pub detail: Option<TensorDetail>,
}

/// How many leading values `--tensor` shows.
const SHOWN_VALUES: usize = 8;

/// Reads shard `s` in full (hash-checked if `verify`).
fn read_shard(index: &CheckpointIndex, s: &ShardRecord, verify: bool) -> Result<Vec<f32>> {
    if verify {
        index.verify_shard(s)?;
    }
    let path = index.dir().join(&s.file);
    let file = h5::open(&path)?;
    let ds = h5::open_dataset(&file, &path, &s.dataset, &s.shape)?;
    let mut buf = vec![0f32; s.len()]; // shape checked against the dataset and the file size
    h5::read_all(&ds, &path, &s.dataset, &mut buf)?;
    Ok(buf)
}

/// Inspects the checkpoint at `path`; `verify` recomputes every hash; `tensor` limits the report
/// to that tensor (a full name, or the part after its group: `wpe` for `model/wpe`) with its
/// statistics.
pub fn inspect(path: &Path, verify: bool, tensor: Option<&str>) -> Result<InspectReport> {
    let index = open(path)?;
    let only = tensor.map(|q| resolve_name(&index, q)).transpose()?;
    let mut tensors = Vec::with_capacity(index.tensors().len());
    for t in index.tensors().iter().filter(|t| only.as_ref().is_none_or(|n| *n == t.name)) {
        let mut sq = 0f64;
        for s in &t.shards {
            sq += read_shard(&index, s, verify)?
                .iter()
                .map(|&x| f64::from(x) * f64::from(x))
                .sum::<f64>();
        }
        let files: HashSet<&str> = t.shards.iter().map(|s| s.file.as_str()).collect();
        tensors.push(TensorStats {
            name: t.name.clone(),
            global_shape: t.global_shape.clone(),
            dtype: t.dtype.clone(),
            shards: files.len(),
            l2_norm: sq.sqrt(),
        });
    }
    let detail = only.map(|name| detail_of(&index, &name)).transpose()?;
    Ok(InspectReport {
        dir: index.dir().to_path_buf(),
        meta: index.meta().clone(),
        files: index.files().to_vec(),
        tensors,
        verified: verify,
        detail,
    })
}

/// The tensor `query` names: itself, or the one tensor (preferring the model's weights) whose name
/// ends in `/query`; otherwise an error listing the nearest names.
fn resolve_name(index: &CheckpointIndex, query: &str) -> Result<String> {
    let names: Vec<&str> = index.tensors().iter().map(|t| t.name.as_str()).collect();
    if names.contains(&query) {
        return Ok(query.to_string());
    }
    let suffix = format!("/{query}");
    let ends: Vec<&str> = names.iter().copied().filter(|n| n.ends_with(&suffix)).collect();
    // `wpe` means the weights (`model/wpe`) rather than their optimizer moments.
    let weights: Vec<&str> = ends.iter().copied().filter(|n| n.starts_with("model/")).collect();
    if let ([one], _) | (_, [one]) = (&ends[..], &weights[..]) {
        return Ok(one.to_string());
    }
    let mut near: Vec<&str> = if ends.is_empty() { names.clone() } else { ends };
    near.sort_by_key(|n| crate::env::edit_distance(n, query).min(crate::env::edit_distance(n.rsplit('/').next().unwrap_or(n), query)));
    near.truncate(3);
    Err(Error::file(
        index.dir(),
        None,
        format!("no tensor `{query}` (did you mean {}? `inspect` without --tensor lists them all)", near.join(", ")),
    ))
}

fn detail_of(index: &CheckpointIndex, name: &str) -> Result<TensorDetail> {
    let t = index.tensor(name)?;
    let zeros = vec![0; t.global_shape.len()];
    let mut all = vec![0f32; t.len()]; // tiling-checked against the shard files
    index.load_slice(name, &zeros, &t.global_shape, &mut all)?;
    let n = all.len() as f64;
    let mean = all.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
    let var = all.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / n;
    Ok(TensorDetail {
        name: name.to_string(),
        min: all.iter().copied().fold(f32::INFINITY, f32::min),
        max: all.iter().copied().fold(f32::NEG_INFINITY, f32::max),
        mean,
        std: var.sqrt(),
        first: all.iter().take(SHOWN_VALUES).copied().collect(),
    })
}

impl InspectReport {
    /// The report as JSON.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("inspect report serializes")
    }
}

fn json_or_dash(v: &serde_json::Value) -> String {
    if v.is_null() {
        "-".into()
    } else {
        v.to_string()
    }
}

impl fmt::Display for InspectReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.meta;
        writeln!(f, "checkpoint {}", self.dir.display())?;
        writeln!(
            f,
            "  step {}  tokens {}  meshtrain {}",
            m.step, m.tokens_seen, m.meshtrain_version
        )?;
        let c = &m.model;
        writeln!(
            f,
            "  model: n_layer {} n_head {} n_embd {} vocab {} max_seq_len {}",
            c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.max_seq_len
        )?;
        writeln!(f, "  parallel: {}", json_or_dash(&m.parallel))?;
        let o = &m.optimizer;
        writeln!(
            f,
            "  optimizer: AdamW beta1 {} beta2 {} eps {} weight_decay {}, {} steps taken",
            o.adamw.beta1, o.adamw.beta2, o.adamw.eps, o.adamw.weight_decay, o.steps_taken
        )?;
        if let Some(d) = &self.detail {
            return write_detail(f, d, &self.tensors);
        }
        writeln!(f, "  lr schedule: {}", json_or_dash(&m.lr_schedule))?;
        let total: u64 = self.files.iter().map(|x| x.bytes).sum();
        writeln!(f, "  files: {} ({} bytes)", self.files.len(), total)?;
        for x in &self.files {
            writeln!(f, "    {:<18} rank {:>5}  {:>14} bytes", x.name, x.rank, x.bytes)?;
        }
        if self.verified {
            writeln!(f, "  verified: every shard's sha256 matches")?;
        }
        let width = self
            .tensors
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(4)
            .max(4);
        writeln!(
            f,
            "  {:<width$}  {:<16} {:<5} {:>6} {:>14}",
            "name", "shape", "dtype", "files", "l2 norm"
        )?;
        for t in &self.tensors {
            let shape = format!("{:?}", t.global_shape);
            writeln!(
                f,
                "  {:<width$}  {:<16} {:<5} {:>6} {:>14.6}",
                t.name, shape, t.dtype, t.shards, t.l2_norm
            )?;
        }
        Ok(())
    }
}

/// `--tensor`: the tensor's row and statistics, after the checkpoint's header.
fn write_detail(f: &mut fmt::Formatter<'_>, d: &TensorDetail, rows: &[TensorStats]) -> fmt::Result {
    for t in rows {
        writeln!(f, "tensor {}: shape {:?} {} in {} file(s), l2 norm {:.6}", t.name, t.global_shape, t.dtype, t.shards, t.l2_norm)?;
    }
    writeln!(f, "  min {} max {} mean {:.6e} std {:.6e}", d.min, d.max, d.mean, d.std)?;
    writeln!(f, "  first values: {:?}", d.first)
}
