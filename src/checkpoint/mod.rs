//! Distributed checkpoints in HDF5: every rank writes the hyperslabs it owns, rank 0 writes an index
//! in which every tensor appears at its global shape.
//!
//! On disk (`DIR` is the checkpoint root given to [`save`]):
//!
//! ```text
//! DIR/latest                       "step_00001000\n", replaced atomically (temp + rename)
//! DIR/meshtrain.lock               the job holding the directory (flock; "job= host= pid= since=")
//! DIR/step_00001000/rank_00000.h5  the slices rank 0 owns, each a dataset at its local shape
//! DIR/step_00001000/rank_00003.h5  (ranks that own nothing write no file)
//! DIR/step_00001000/checkpoint.h5  the index, written last: one virtual dataset per tensor
//! ```
//!
//! A tensor is layout-free (Megatron-core style): a name, a global shape, and shards, each a
//! hyperslab (offset per dimension + local shape) held by one rank file. Names are `model/<layout
//! name>`, `optim/m/<name>`, `optim/v/<name>`. In the index, each tensor is a virtual dataset mapped
//! onto the shard files by relative path, so `h5py.File(".../checkpoint.h5")["model/wte"][:]`
//! returns the whole tensor. Because HDF5 cannot reliably read a virtual mapping back, the index also
//! stores its own record of the shards (root attribute `tensors`, JSON), and readers in this module
//! use only that record: they open the shard files themselves and read exactly the hyperslabs they
//! need. Every shard dataset carries attributes `global_offset`, `global_shape` and `sha256` (of its
//! little-endian f32 bytes); the index repeats the hash, and its `index_sha256` covers its own JSON
//! attributes (`meta`, `tensors`, `files`). Each shard record in the index also holds a digest per
//! tile of the shard (`tile_sha256`, see `tiles`). Every read is checked: a shard read whole
//! against its hash, a part of a shard against the tiles it touches (only those are read), so a
//! resharding load stays close to the bytes it needs.
//!
//! Invariants:
//! - a directory is a complete checkpoint iff it is named `step_XXXXXXXX` and holds
//!   `checkpoint.h5`; the index is written only after every rank reported its shard file fsynced,
//!   inside a `*.tmp-<nonce>` directory that is renamed to its final name afterwards, so a crash at
//!   any point leaves the previous checkpoint (and `latest`) intact and nothing that looks complete;
//! - every rank returns the same `Ok`/`Err` from [`save`]; a failing rank is named in the error;
//! - the shards of a tensor tile its global shape exactly (checked on save and on open);
//! - readers check every size against the index before they allocate, and name the file and
//!   dataset in every error.
//!
//! Ownership of replicated data is the caller's decision: pass each hyperslab on exactly one rank.
//! [`flat_range_slices`] cuts a contiguous range of the flat parameter buffer (a ZeRO shard,
//! `block_range(n, dp, rank)`) into hyperslabs, which spreads replicated tensors over the
//! data-parallel ranks without duplicates.
//!
//! # Checkpoints: behaviour
//!
//! #### Checkpoints
//!
//! `[checkpoint] dir, every, keep, resume` (`resume = "latest"` or a path). Checkpoints are written
//! only when `dir` is given; then every `every` steps and always after the last step (`every = 0`,
//! the default: at the end only) and when a stop signal ends the run early. `resume = "latest"` in a
//! missing or empty `dir` starts fresh (rank 0 says so); `latest` must name a `step_XXXXXXXX` entry
//! of `dir` (anything else, e.g. `../x`, is refused). A run resumed from an earlier step that reaches
//! a step saved before replaces that checkpoint: the new directory and the old one are swapped in one
//! atomic `renameat2(RENAME_EXCHANGE)`, then the old one is deleted (a file system without that call
//! fails the save with a message naming the directory). A checkpoint is a directory
//! `DIR/step_00001000/` with one HDF5 file per rank that owns data (data-parallel replicas write no
//! duplicates: replicated tensors are split by `block_range(n, dp, rank)`, ZeRO state is written by
//! its owner) and an index `checkpoint.h5`, written last, in which every tensor (`model/<name>`,
//! `optim/m/<name>`, `optim/v/<name>`) is a virtual dataset at its global shape, so
//! `h5py.File("DIR/step_00001000/checkpoint.h5")["model/h.0.attn.qkv.weight"][:]` is the whole tensor.
//! Attributes carry the format version, model config, layout, step, tokens seen, AdamW settings and
//! step count, schedule state, each rank's data position, the meshtrain version and a SHA-256 of every
//! shard; `index_sha256` (format version 2) covers those attributes themselves, so a flipped bit in
//! the index is an error naming `checkpoint.h5` rather than a silently moved offset or data position.
//! Every read is checked before its data is used: a shard read whole against its SHA-256, a part of a
//! shard (a resharding load) against per-tile digests (format version 3: each shard is cut into
//! 256x256 tiles, 1-D shards into runs of 65536 elements, each with a SHA-256 in the index under
//! `index_sha256`), reading only the tiles the part touches. Checkpoints of format 1 and 2 are still
//! read; having no tile digests, their partial reads read and check the whole shard. Writing happens in a `*.tmp-<nonce>` directory, every file is fsynced, all ranks agree
//! before rank 0 writes the index and renames the directory, and `latest` is replaced atomically; the
//! last `keep` are kept. A crash at any point leaves the previous checkpoint loadable (tested with an
//! injected rank failure before the index and with a full 1 MiB tmpfs). On load every rank validates
//! before training: missing or unexpected tensors, shapes, model config, hashes, truncated or
//! bit-flipped files and incomplete directories are errors naming the file and dataset. Resuming in
//! the same layout continues bit for bit; in another layout (any TP, PP, DP and ZeRO stage, and any
//! micro-batch with the same global batch) each rank reads exactly the hyperslabs it needs and the
//! run matches the uninterrupted one within 1e-5 (tested: DP2 ZeRO-1 -> DP4 ZeRO-0, TP2 x PP2 ->
//! DP2 ZeRO-1). A rank describes its part of every tensor as a box of the global tensor (TP shards
//! are boxes; the fused qkv weight is a box of its (3, C, C) view, stored as three row blocks of the
//! global (3C, C) tensor); copies replicated over TP are written by TP rank 0, the tied embedding by
//! the first pipeline stage. `meshtrain export` writes one file with plain datasets, which
//! `init_from` (in any layout) and `generate` read.
//!

mod agree;
mod bench;
mod boxes;
mod export;
mod h5;
mod index;
mod inspect;
mod lock;
mod meta;
mod safetensors;
mod safetensors_llama;
mod safetensors_read;
mod save;
#[cfg(test)]
mod tests;
mod tiles;

pub use bench::{bench_checkpoint, CkptBenchReport};
pub use boxes::{flat_range_boxes, flat_range_slices, load_flat_range, ShardSlice};
pub use export::{export, read_exported, ExportedTensor, EXPORT_FORMAT};
pub use index::{load_slice, open, CheckpointIndex};
pub use inspect::{inspect, InspectReport, TensorStats};
pub use lock::{lock_for_job, DirLock, LOCK_FILE};
pub use meta::{CkptMeta, LossScaleMeta, OptimizerMeta, ShardRecord, TensorRecord};
pub use safetensors::{export_hf, is_hf_dir, read_hf, write_hf};
#[cfg(test)]
pub(crate) use safetensors::{parse as parse_safetensors, serialize as serialize_safetensors};
pub use save::save;

/// The model and its weights (`model/<name>`, global shapes) from an exported file or a Hugging
/// Face GPT-2 directory: what `init_from` and `generate` read.
pub fn read_weights(path: &std::path::Path) -> crate::error::Result<(crate::model::GptConfig, Vec<ExportedTensor>)> {
    if is_hf_dir(path) {
        return read_hf(path);
    }
    let (meta, tensors) = read_exported(path)?;
    Ok((meta.model, tensors))
}

/// Value of the index's `format` attribute.
pub const FORMAT: &str = "meshtrain-checkpoint";
/// Version of the on-disk layout described above (2 added the index's `index_sha256`, 3 the tile
/// digests). Versions 1 and 2 are still read: without `index_sha256` (1) the index is not
/// checked, without tile digests a partial read reads and checks the whole shard.
pub const FORMAT_VERSION: u32 = 3;
/// File name of the index inside a checkpoint directory.
pub const INDEX_FILE: &str = "checkpoint.h5";
/// File in the checkpoint root naming the newest complete checkpoint directory.
pub const LATEST_FILE: &str = "latest";

/// Directory name of the checkpoint of `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step_{step:08}")
}

/// The step of a final checkpoint directory name (`step_` + at least 8 digits), `None` otherwise.
pub fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step_")?;
    if digits.len() < 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// File name of rank `rank`'s shard file.
pub fn rank_file_name(rank: usize) -> String {
    format!("rank_{rank:05}.h5")
}
