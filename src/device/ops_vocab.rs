//! Launchers of the vocabulary-parallel kernels (`kernels/vocab_parallel.cu`, and the
//! cross-entropy backward of `kernels/cross_entropy.cu`, whose whole vocabulary is one shard): the
//! embedding and cross-entropy of a tensor-parallel rank that holds one shard of `wte`'s rows, so
//! that no rank ever holds all Vp logits of a position. The collectives between them (a sum after the
//! embedding, a max and a sum inside the loss) are the caller's.
//!
//! As in [`super::ops`], every launcher checks each buffer against the elements the kernel
//! touches, and on the CPU device runs the reference of `cpu::vocab_parallel` instead.

use std::ops::Range;

use super::ops::{as_i32, as_u32, f32s, host, host_mut, need, stride_grid, THREADS};
use super::{Device, DeviceBuffer, KernelArg as A, LaunchDims};
use crate::device::cpu::vocab_parallel;
use crate::error::{Error, Result};

/// One rank's shard of the vocabulary: ids `start .. start + vl`, of which the first `real`
/// are real (below V), the rest padding.
#[derive(Debug, Clone, Copy)]
pub struct VocabShard {
    /// First id of the shard.
    pub start: usize,
    /// Ids (rows of the `wte` shard, logit columns) in the shard.
    pub vl: usize,
    /// Real ids among them.
    pub real: usize,
}

impl VocabShard {
    fn check(&self, k: &str) -> Result<()> {
        if self.real > self.vl {
            return Err(Error::InvalidArgument(format!("{k}: {} real ids in a shard of {}", self.real, self.vl)));
        }
        Ok(())
    }
}

/// out (N, C) = wte_shard (vl, C) rows of the in-shard `tokens` (N, u32), zero rows for the
/// others. Reference: `vocab_parallel::embedding_shard_forward`.
pub fn embedding_shard_forward(
    dev: &Device,
    out: &mut DeviceBuffer,
    tokens: &DeviceBuffer,
    wte: &DeviceBuffer,
    (n, c): (usize, usize),
    v: VocabShard,
) -> Result<()> {
    let k = "embedding_shard_forward_f32";
    need(k, "out", out, f32s(n * c))?;
    need(k, "tokens", tokens, 4 * n)?;
    need(k, "wte", wte, f32s(v.vl * c))?;
    if let Device::Cpu = dev {
        vocab_parallel::embedding_shard_forward(
            host_mut(k, out)?.view_mut::<f32>(n * c),
            host(k, tokens)?.view::<u32>(n),
            host(k, wte)?.view::<f32>(v.vl * c),
            v.start,
            c,
        );
        return Ok(());
    }
    let args = [
        A::Buf(out),
        A::Buf(tokens),
        A::Buf(wte),
        A::U64((n * c) as u64),
        A::I32(as_i32(k, "c", c)?),
        A::U64(v.start as u64),
        A::I32(as_i32(k, "vl", v.vl)?),
    ];
    dev.launch(k, stride_grid(n * c), &args)
}

/// Length of [`token_index`] for `rows` tokens.
pub fn token_index_len(rows: usize) -> usize {
    3 * rows + 2
}

/// The token index the embedding backward kernels read (u32): `tokens` (R) | the rows ordered by
/// token, the rows of one token in increasing order (R) | the number S of distinct tokens (1) |
/// where each token's rows start in that order (S + 1; the rest of the R + 1 entries are 0). With
/// it one GPU thread per (distinct token, column) sums that token's rows in row order, so the
/// scatter needs no atomics and gives the CPU reference's bits on every arm and every run.
pub fn token_index(tokens: &[u32]) -> Vec<u32> {
    let r = tokens.len();
    let mut index = vec![0u32; token_index_len(r)];
    index[..r].copy_from_slice(tokens);
    let mut order: Vec<u32> = (0..r as u32).collect();
    order.sort_by_key(|&row| tokens[row as usize]); // stable: rows of a token stay in order
    let (head, starts) = index.split_at_mut(2 * r + 1);
    let mut distinct = 0;
    for (k, &row) in order.iter().enumerate() {
        if k == 0 || tokens[row as usize] != tokens[order[k - 1] as usize] {
            starts[distinct] = k as u32;
            distinct += 1;
        }
    }
    starts[distinct] = r as u32;
    head[r..2 * r].copy_from_slice(&order);
    head[2 * r] = distinct as u32;
    index
}

/// dwte_shard (vl, C) += rows of dout (N, C) whose tokens lie in the shard; `tokens` holds the
/// batch's [`token_index`] (the CPU arm reads its first N entries only). Reference:
/// `vocab_parallel::embedding_shard_backward` (the same additions in the same order on every arm).
pub fn embedding_shard_backward(
    dev: &Device,
    dwte: &mut DeviceBuffer,
    dout: &DeviceBuffer,
    tokens: &DeviceBuffer,
    (n, c): (usize, usize),
    v: VocabShard,
) -> Result<()> {
    let k = "embedding_shard_backward_f32";
    need(k, "dwte", dwte, f32s(v.vl * c))?;
    need(k, "dout", dout, f32s(n * c))?;
    if let Device::Cpu = dev {
        need(k, "tokens", tokens, 4 * n)?;
        vocab_parallel::embedding_shard_backward(
            host_mut(k, dwte)?.view_mut::<f32>(v.vl * c),
            host(k, dout)?.view::<f32>(n * c),
            host(k, tokens)?.view::<u32>(n),
            v.start,
            c,
        );
        return Ok(());
    }
    need(k, "tokens", tokens, 4 * token_index_len(n))?;
    let args = [
        A::Buf(dwte),
        A::Buf(dout),
        A::Buf(tokens),
        A::U64(n as u64),
        A::I32(as_i32(k, "c", c)?),
        A::U64(v.start as u64),
        A::I32(as_i32(k, "vl", v.vl)?),
    ];
    dev.launch(k, stride_grid(n * c), &args)
}

/// out (R, C) += wpe (>= T, C) row `r % t` for each global row `r` of the batch in `global`
/// (R = its length; out's row `i` is global row `global.start + i`). Reference:
/// `vocab_parallel::position_forward`.
pub fn position_forward(dev: &Device, out: &mut DeviceBuffer, wpe: &DeviceBuffer, global: Range<usize>, (t, c): (usize, usize)) -> Result<()> {
    let (rows, row0) = (global.len(), global.start);
    let k = "position_forward_f32";
    need(k, "out", out, f32s(rows * c))?;
    need(k, "wpe", wpe, f32s(t * c))?;
    if let Device::Cpu = dev {
        let wpe = host(k, wpe)?.view::<f32>(t * c);
        vocab_parallel::position_forward(host_mut(k, out)?.view_mut::<f32>(rows * c), wpe, row0, t, c);
        return Ok(());
    }
    let (t_arg, c_arg) = (A::I32(as_i32(k, "t", t)?), A::I32(as_i32(k, "c", c)?));
    let args = [A::Buf(out), A::Buf(wpe), A::U64((rows * c) as u64), A::U64(row0 as u64), t_arg, c_arg];
    dev.launch(k, stride_grid(rows * c), &args)
}

/// dwpe (>= T, C) += dout (R, C) summed at each position, dout's rows being the global rows
/// `global` of the batch (the wpe half of `encoder_backward`). Reference:
/// `vocab_parallel::position_backward`.
pub fn position_backward(dev: &Device, dwpe: &mut DeviceBuffer, dout: &DeviceBuffer, global: Range<usize>, (t, c): (usize, usize)) -> Result<()> {
    let (rows, row0) = (global.len(), global.start);
    let k = "encoder_backward_wpe_f32";
    need(k, "dwpe", dwpe, f32s(t * c))?;
    need(k, "dout", dout, f32s(rows * c))?;
    if let Device::Cpu = dev {
        let dout = host(k, dout)?.view::<f32>(rows * c);
        vocab_parallel::position_backward(host_mut(k, dwpe)?.view_mut::<f32>(t * c), dout, row0, t, c);
        return Ok(());
    }
    let (t_arg, c_arg) = (A::I32(as_i32(k, "t", t)?), A::I32(as_i32(k, "c", c)?));
    let args = [A::Buf(dwpe), A::Buf(dout), A::U64(rows as u64), A::U64(row0 as u64), t_arg, c_arg];
    dev.launch(k, stride_grid(t * c), &args)
}

/// max (N) = maximum of each logits (N, vl) row over its real columns (-inf if none).
/// Reference: `vocab_parallel::shard_max`.
pub fn shard_max(dev: &Device, max: &mut DeviceBuffer, logits: &DeviceBuffer, n: usize, v: VocabShard) -> Result<()> {
    let k = "shard_max_f32";
    v.check(k)?;
    need(k, "max", max, f32s(n))?;
    need(k, "logits", logits, f32s(n * v.vl))?;
    if let Device::Cpu = dev {
        let logits = host(k, logits)?.view::<f32>(n * v.vl);
        vocab_parallel::shard_max(host_mut(k, max)?.view_mut::<f32>(n), logits, v.real);
        return Ok(());
    }
    if n == 0 {
        return Ok(());
    }
    let args = [A::Buf(max), A::Buf(logits), A::I32(as_i32(k, "vl", v.vl)?), A::I32(as_i32(k, "real", v.real)?)];
    dev.launch(k, LaunchDims::linear(as_u32(k, "rows", n)?, THREADS), &args)
}

/// stats (2N) = [Σ exp(z - max) over the real columns (N) | the target's logit when it is in the
/// shard, else 0 (N)] from logits (N, vl), the group's row max (N) and targets (N). Reference:
/// `vocab_parallel::shard_sum_exp`.
pub fn shard_sum_exp(
    dev: &Device,
    stats: &mut DeviceBuffer,
    logits: &DeviceBuffer,
    max: &DeviceBuffer,
    targets: &DeviceBuffer,
    n: usize,
    v: VocabShard,
) -> Result<()> {
    let k = "shard_sum_exp_f32";
    v.check(k)?;
    need(k, "stats", stats, f32s(2 * n))?;
    need(k, "logits", logits, f32s(n * v.vl))?;
    need(k, "max", max, f32s(n))?;
    need(k, "targets", targets, 4 * n)?;
    if let Device::Cpu = dev {
        let (sum, target_logit) = host_mut(k, stats)?.view_mut::<f32>(2 * n).split_at_mut(n);
        let (logits, max) = (host(k, logits)?.view::<f32>(n * v.vl), host(k, max)?.view::<f32>(n));
        let targets = host(k, targets)?.view::<u32>(n);
        vocab_parallel::shard_sum_exp(sum, target_logit, logits, max, targets, v.start, v.real);
        return Ok(());
    }
    if n == 0 {
        return Ok(());
    }
    let args = [
        A::Buf(stats),
        A::Buf(logits),
        A::Buf(max),
        A::Buf(targets),
        A::U64(n as u64),
        A::U64(v.start as u64),
        A::I32(as_i32(k, "vl", v.vl)?),
        A::I32(as_i32(k, "real", v.real)?),
    ];
    dev.launch(k, LaunchDims::linear(as_u32(k, "rows", n)?, THREADS), &args)
}

/// lse (N) = max + ln(sum) and losses (N) = lse - target logit from the group's max (N) and
/// summed stats (2N, as [`shard_sum_exp`] lays them out). Reference:
/// `vocab_parallel::combine_shards`.
pub fn cross_entropy_combine(
    dev: &Device,
    losses: &mut DeviceBuffer,
    lse: &mut DeviceBuffer,
    max: &DeviceBuffer,
    stats: &DeviceBuffer,
    n: usize,
) -> Result<()> {
    let k = "cross_entropy_combine_f32";
    need(k, "losses", losses, f32s(n))?;
    need(k, "lse", lse, f32s(n))?;
    need(k, "max", max, f32s(n))?;
    need(k, "stats", stats, f32s(2 * n))?;
    if let Device::Cpu = dev {
        let (max, stats) = (host(k, max)?.view::<f32>(n), host(k, stats)?.view::<f32>(2 * n));
        let lse = host_mut(k, lse)?.view_mut::<f32>(n);
        vocab_parallel::combine_shards(host_mut(k, losses)?.view_mut::<f32>(n), lse, max, stats);
        return Ok(());
    }
    let args = [A::Buf(losses), A::Buf(lse), A::Buf(max), A::Buf(stats), A::U64(n as u64)];
    dev.launch(k, stride_grid(n), &args)
}

/// The buffers of [`cross_entropy_backward`].
pub struct CrossEntropyBackward<'a> {
    /// Logit gradient (N, vl), overwritten.
    pub dlogits: &'a mut DeviceBuffer,
    /// Logits (N, vl).
    pub logits: &'a DeviceBuffer,
    /// Global log-sum-exp per row (N).
    pub lse: &'a DeviceBuffer,
    /// Target token ids (N, u32).
    pub targets: &'a DeviceBuffer,
}

/// dlogits (N, vl) = (softmax - onehot(targets)) * dloss over the real columns, 0 on the
/// padding (whatever the buffer held: the CPU arm writes every element without reading it, a GPU
/// clears the buffer and then adds with `cross_entropy_backward_f32`), with the global log-sum-exp `lse` (N); the whole vocabulary is the shard
/// `{ start: 0, vl: Vp, real: V }`. Targets must be < V (the kernel trusts them, as the CPU
/// reference does). Reference: `vocab_parallel::cross_entropy_shard_backward` (with one shard,
/// the arithmetic of `cpu::cross_entropy::cross_entropy_backward`).
pub fn cross_entropy_backward(dev: &Device, bufs: CrossEntropyBackward, dloss: f32, n: usize, v: VocabShard) -> Result<()> {
    let CrossEntropyBackward { dlogits, logits, lse, targets } = bufs;
    let k = "cross_entropy_backward_f32";
    v.check(k)?;
    need(k, "dlogits", dlogits, f32s(n * v.vl))?;
    need(k, "logits", logits, f32s(n * v.vl))?;
    need(k, "lse", lse, f32s(n))?;
    need(k, "targets", targets, 4 * n)?;
    if let Device::Cpu = dev {
        vocab_parallel::cross_entropy_shard_backward(
            host_mut(k, dlogits)?.view_mut::<f32>(n * v.vl),
            host(k, logits)?.view::<f32>(n * v.vl),
            host(k, lse)?.view::<f32>(n),
            host(k, targets)?.view::<u32>(n),
            dloss,
            v.start,
            v.real,
        );
        return Ok(());
    }
    super::ops::fill_zero(dev, dlogits, n * v.vl)?;
    let args = [
        A::Buf(dlogits),
        A::Buf(logits),
        A::Buf(lse),
        A::Buf(targets),
        A::F32(dloss),
        A::U64(n as u64),
        A::U64(v.start as u64),
        A::I32(as_i32(k, "vl", v.vl)?),
        A::I32(as_i32(k, "real", v.real)?),
    ];
    dev.launch(k, stride_grid(n * v.real), &args)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows grouped by token in row order, the distinct count and where each group starts.
    #[test]
    fn token_index_groups_rows_by_token_in_row_order() {
        let index = token_index(&[3, 1, 3, 0, 1, 3]);
        assert_eq!(index.len(), token_index_len(6));
        assert_eq!(&index[..6], &[3, 1, 3, 0, 1, 3]);
        assert_eq!(&index[6..12], &[3, 1, 4, 0, 2, 5]);
        assert_eq!(index[12], 3);
        assert_eq!(&index[13..], &[0, 1, 3, 6, 0, 0, 0]);
        assert_eq!(token_index(&[]), vec![0, 0]);
    }
}
