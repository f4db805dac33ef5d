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

mod agree;
mod bench;
mod boxes;
mod export;
mod h5;
mod index;
mod inspect;
mod lock;
mod meta;
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
pub use meta::{CkptMeta, OptimizerMeta, ShardRecord, TensorRecord};
pub use save::save;

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
