//! Training data: token shards on disk, a built-in synthetic corpus, the batch sampler, and the
//! GPT-2 tokenizer that turns text into shards.
//!
//! Every corpus is seen by the sampler as a [`TokenWindows`]: a fixed number of windows of `T + 1`
//! tokens (inputs are the first `T`, targets the last `T`). Window contents are a pure function of
//! the corpus and the window index, which is what makes shuffling, data parallelism and exact resume
//! simple: the sampler only ever deals in window indices.

mod dataset;
mod sampler;
mod shard;
mod synthetic;
mod tokenize;

pub use dataset::{open_source, ShardDataset, Split};
pub use sampler::{Batch, Sampler, SamplerState};
pub use shard::{write_shard, Shard, HEADER_BYTES, SHARD_MAGIC, SHARD_VERSION};
pub use synthetic::SyntheticData;
pub use tokenize::{tokenize_files, Gpt2Tokenizer, TokenizeReport, EOT_TOKEN, GPT2_VOCAB_SIZE};

use crate::error::Result;

/// A corpus cut into windows of `seq_len + 1` consecutive tokens.
pub trait TokenWindows: Send + Sync {
    /// Number of windows of `seq_len + 1` tokens the corpus offers.
    fn num_windows(&self, seq_len: usize) -> u64;

    /// Fills `out` (length `seq_len + 1`) with window `index` (`index < num_windows(seq_len)`).
    fn read_window(&self, index: u64, seq_len: usize, out: &mut [u32]) -> Result<()>;

    /// A short description for logs, e.g. `3 shards, 1200000 tokens`.
    fn describe(&self) -> String;
}
