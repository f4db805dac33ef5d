//! The batch sampler: which windows of the corpus each data-parallel rank trains on, in which order.
//!
//! An epoch is a sequence of global batches; a global batch is `dp * micro_batch` windows, and
//! data-parallel rank `r` takes windows `[r * B, (r + 1) * B)` of it, so ranks never share a window
//! within a batch and together cover it exactly. Windows that do not fill a last global batch are
//! skipped for that epoch. In sequential order, epoch position `p` is window `p`; in shuffled order
//! it is `perm_e[p]`, where `perm_e` is a Fisher-Yates permutation drawn from ChaCha8 keyed by the
//! seed on stream `e`, the same on every rank and every run.
//!
//! The sampler's whole position is [`SamplerState`] `(epoch, index, seed)`; restoring it reproduces
//! exactly the batches a run would have seen had it not stopped.

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::data::TokenWindows;
use crate::error::{Error, Result};

/// Where a sampler stands: the next batch is global batch `index` of epoch `epoch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct SamplerState {
    /// Passes over the corpus completed.
    pub epoch: u64,
    /// Global batches already taken in this epoch.
    pub index: u64,
    /// Shuffle seed (unused in sequential order, kept so a resumed run cannot change it silently).
    pub seed: u64,
}

/// One rank's micro-batch: `B` sequences of `T` inputs and their `T` next-token targets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Sequences in the batch (B).
    pub micro_batch: usize,
    /// Tokens per sequence (T).
    pub seq_len: usize,
    /// (B, T) input token ids.
    pub inputs: Vec<u32>,
    /// (B, T) target token ids: `targets[b, t] = window_b[t + 1]`.
    pub targets: Vec<u32>,
}

impl Batch {
    /// A zeroed batch of `micro_batch` sequences of `seq_len` tokens.
    pub fn new(micro_batch: usize, seq_len: usize) -> Batch {
        Batch {
            micro_batch,
            seq_len,
            inputs: vec![0; micro_batch * seq_len],
            targets: vec![0; micro_batch * seq_len],
        }
    }
}

/// Produces this rank's micro-batches from a corpus.
pub struct Sampler {
    source: Arc<dyn TokenWindows>,
    seq_len: usize,
    micro_batch: usize,
    dp_rank: usize,
    dp_size: usize,
    shuffle: bool,
    state: SamplerState,
    batches_per_epoch: u64,
    /// Epoch order of window indices when shuffling (empty when sequential).
    order: Vec<u64>,
    /// (T + 1) scratch window.
    window: Vec<u32>,
}

impl Sampler {
    /// A sampler at the start of epoch 0 for data-parallel rank `dp_rank` of `dp_size`.
    pub fn new(
        source: Arc<dyn TokenWindows>,
        seq_len: usize,
        micro_batch: usize,
        dp_rank: usize,
        dp_size: usize,
        shuffle: bool,
        seed: u64,
    ) -> Result<Sampler> {
        if seq_len == 0 || micro_batch == 0 || dp_rank >= dp_size {
            return Err(Error::InvalidArgument(format!(
                "sampler: seq_len {seq_len}, micro_batch {micro_batch}, dp rank {dp_rank} of {dp_size}"
            )));
        }
        let global = (dp_size * micro_batch) as u64;
        let windows = source.num_windows(seq_len);
        let batches_per_epoch = windows / global;
        if batches_per_epoch == 0 {
            return Err(Error::InvalidArgument(format!(
                "data ({}) has {windows} windows of {} tokens, fewer than one global batch of {global} \
                 (dp {dp_size} x micro_batch {micro_batch})",
                source.describe(),
                seq_len + 1
            )));
        }
        let mut sampler = Sampler {
            source,
            seq_len,
            micro_batch,
            dp_rank,
            dp_size,
            shuffle,
            state: SamplerState {
                epoch: 0,
                index: 0,
                seed,
            },
            batches_per_epoch,
            order: Vec::new(),
            window: vec![0; seq_len + 1],
        };
        sampler.build_order();
        Ok(sampler)
    }

    /// The position to save in a checkpoint.
    pub fn state(&self) -> SamplerState {
        self.state
    }

    /// Moves to a saved position; the next batch is the one that followed it in the saved run.
    pub fn restore(&mut self, state: SamplerState) -> Result<()> {
        if state.index > self.batches_per_epoch {
            return Err(Error::InvalidArgument(format!(
                "sampler state {state:?}: index past the {} batches of an epoch",
                self.batches_per_epoch
            )));
        }
        let rebuild = state.epoch != self.state.epoch || state.seed != self.state.seed;
        self.state = state;
        if rebuild {
            self.build_order();
        }
        Ok(())
    }

    /// Global batches in one epoch.
    pub fn batches_per_epoch(&self) -> u64 {
        self.batches_per_epoch
    }

    /// Fills `batch` (shaped `micro_batch x seq_len`) with this rank's part of the next global batch.
    pub fn next_batch(&mut self, batch: &mut Batch) -> Result<()> {
        if batch.micro_batch != self.micro_batch || batch.seq_len != self.seq_len {
            return Err(Error::InvalidArgument(format!(
                "batch is {}x{}, sampler produces {}x{}",
                batch.micro_batch, batch.seq_len, self.micro_batch, self.seq_len
            )));
        }
        if self.state.index == self.batches_per_epoch {
            self.state.epoch += 1;
            self.state.index = 0;
            self.build_order();
        }
        let (b_, t_) = (self.micro_batch, self.seq_len);
        let first = (self.state.index * self.dp_size as u64 + self.dp_rank as u64) * b_ as u64;
        for b in 0..b_ {
            let pos = first + b as u64;
            let window = if self.shuffle {
                self.order[pos as usize]
            } else {
                pos
            };
            self.source.read_window(window, t_, &mut self.window)?;
            batch.inputs[b * t_..(b + 1) * t_].copy_from_slice(&self.window[..t_]);
            batch.targets[b * t_..(b + 1) * t_].copy_from_slice(&self.window[1..]);
        }
        self.state.index += 1;
        Ok(())
    }

    fn build_order(&mut self) {
        self.order.clear();
        if !self.shuffle {
            return;
        }
        let n = self.source.num_windows(self.seq_len);
        self.order.extend(0..n);
        let mut rng = ChaCha8Rng::seed_from_u64(self.state.seed);
        rng.set_stream(self.state.epoch);
        for i in (1..self.order.len()).rev() {
            let j = rng.gen_range(0..=i);
            self.order.swap(i, j);
        }
    }
}
