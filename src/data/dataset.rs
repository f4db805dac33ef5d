//! A dataset made of the shards a glob pattern matches, cut into windows.
//!
//! Shards are ordered by path so every rank sees the same dataset. A window never straddles two
//! shards: shard `s` with `n` tokens offers `(n - 1) / T` windows starting at multiples of `T` (each
//! window's last token is the next window's first input), and window indices run through shard 0's
//! windows, then shard 1's, and so on.

use std::path::PathBuf;
use std::sync::Arc;

use crate::data::shard::Shard;
use crate::data::synthetic::SyntheticData;
use crate::data::TokenWindows;
use crate::error::{Error, Result};

/// Shards matched by one glob pattern, validated against the model vocabulary.
#[derive(Debug)]
pub struct ShardDataset {
    pattern: String,
    shards: Vec<Shard>,
}

impl ShardDataset {
    /// Opens every file `pattern` matches (sorted by path). `key` is the config key the pattern came
    /// from (e.g. `data.source`), named in errors about the pattern itself.
    pub fn open(pattern: &str, vocab_size: usize, key: &str) -> Result<ShardDataset> {
        let paths = glob::glob(pattern)
            .map_err(|e| Error::config(key, format!("bad glob `{pattern}`: {e}")))?;
        let mut files: Vec<PathBuf> = Vec::new();
        for entry in paths {
            let path =
                entry.map_err(|e| Error::io(format!("read {}", e.path().display()), e.into()))?;
            if path.is_file() {
                files.push(path);
            }
        }
        if files.is_empty() {
            return Err(Error::config(
                key,
                format!("glob `{pattern}` matches no files"),
            ));
        }
        files.sort();
        let shards = files
            .iter()
            .map(|p| Shard::open(p, vocab_size))
            .collect::<Result<Vec<_>>>()?;
        let ds = ShardDataset {
            pattern: pattern.to_string(),
            shards,
        };
        log::debug!("data: {pattern}: {}", ds.describe());
        Ok(ds)
    }

    /// The opened shards, in window order.
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// Total tokens over all shards.
    pub fn num_tokens(&self) -> u64 {
        self.shards.iter().map(|s| s.len() as u64).sum()
    }

    fn windows_in(shard: &Shard, seq_len: usize) -> u64 {
        (shard.len().saturating_sub(1) / seq_len) as u64
    }
}

impl TokenWindows for ShardDataset {
    fn num_windows(&self, seq_len: usize) -> u64 {
        self.shards
            .iter()
            .map(|s| Self::windows_in(s, seq_len))
            .sum()
    }

    fn read_window(&self, index: u64, seq_len: usize, out: &mut [u32]) -> Result<()> {
        if out.len() != seq_len + 1 {
            return Err(Error::InvalidArgument(format!(
                "window buffer holds {} tokens, seq_len + 1 = {}",
                out.len(),
                seq_len + 1
            )));
        }
        let mut rest = index;
        for shard in &self.shards {
            let n = Self::windows_in(shard, seq_len);
            if rest < n {
                return shard.read(rest as usize * seq_len, out);
            }
            rest -= n;
        }
        Err(Error::InvalidArgument(format!(
            "window {index} is past the end of `{}` ({} windows of {} tokens)",
            self.pattern,
            self.num_windows(seq_len),
            seq_len + 1
        )))
    }

    fn describe(&self) -> String {
        format!("{} shards, {} tokens", self.shards.len(), self.num_tokens())
    }
}

/// Which part of a corpus to read; only the synthetic corpus distinguishes them (shard globs name
/// their split in the pattern).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Training windows.
    Train,
    /// Validation windows.
    Val,
}

/// The corpus named by a `data.source` / `data.val_source` value: `"synthetic"` for the built-in
/// [`SyntheticData`] (chain seeded with `seed`, vocabulary `vocab_size`), anything else a shard glob.
/// `key` names the config key in errors.
pub fn open_source(
    source: &str,
    split: Split,
    vocab_size: usize,
    seed: u64,
    key: &str,
) -> Result<Arc<dyn TokenWindows>> {
    if source == "synthetic" {
        let train = SyntheticData::new(vocab_size, seed)?;
        Ok(match split {
            Split::Train => Arc::new(train),
            Split::Val => Arc::new(train.validation()),
        })
    } else {
        Ok(Arc::new(ShardDataset::open(source, vocab_size, key)?))
    }
}
