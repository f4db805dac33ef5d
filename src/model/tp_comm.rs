//! The collectives a tensor-parallel stage needs, over its tensor-parallel group.
//!
//! The stage executor ([`super::stage`]) only talks to its TP group through [`TpComm`], so the
//! same code runs on one rank ([`NoTp`]: every operation is the identity) or on a
//! [`Communicator`] split to the TP group. Row order of the sequence-parallel operations: the
//! full (B*T, C) activation is row-major with row `b*T + t`; TP rank `r` owns the contiguous
//! rows `r*B*T/tp .. (r+1)*B*T/tp` (B*T divisible by tp), i.e. the `r`-th equal contiguous block
//! of the flat buffer, which is exactly the block [`Communicator::all_gather_into`] and
//! [`Communicator::reduce_scatter_into`] assign to member `r`.
//!
//! Invariant relied on by the stage: every member of a TP group receives bitwise the same result
//! from `all_reduce_sum`/`all_reduce_max` (the ring and direct schedules reduce each element
//! once and copy the result), so tensors computed from reduced data are identical on all ranks.

use crate::comm::{Communicator, ReduceOp};
use crate::error::{Error, Result};

/// Collectives over one tensor-parallel group; `full` buffers are `tp_size()` times `local` ones.
pub trait TpComm {
    /// This rank's index in the TP group.
    fn tp_rank(&self) -> usize;
    /// Number of ranks in the TP group.
    fn tp_size(&self) -> usize;
    /// In-place element-wise sum over the group.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;
    /// In-place element-wise maximum over the group.
    fn all_reduce_max(&self, buf: &mut [f32]) -> Result<()>;
    /// `out` (tp * n) gets every rank's `local` (n) block, rank `r`'s at `r*n..(r+1)*n`.
    fn all_gather_rows(&self, local: &[f32], out: &mut [f32]) -> Result<()>;
    /// `out` (n) gets block `tp_rank()` of the group's element-wise sum of `full` (tp * n).
    fn reduce_scatter_rows(&self, full: &[f32], out: &mut [f32]) -> Result<()>;
}

/// Checks that `full` is exactly `tp` times `local` long.
fn check_blocks(op: &str, local: usize, full: usize, tp: usize) -> Result<()> {
    if local * tp != full {
        return Err(Error::InvalidArgument(format!(
            "{op}: full buffer of {full} elements is not {tp} blocks of {local}"
        )));
    }
    Ok(())
}

/// A group of one rank: reductions are the identity, gathers and scatters copy.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoTp;

impl TpComm for NoTp {
    fn tp_rank(&self) -> usize {
        0
    }
    fn tp_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _buf: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn all_reduce_max(&self, _buf: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn all_gather_rows(&self, local: &[f32], out: &mut [f32]) -> Result<()> {
        check_blocks("all_gather_rows", local.len(), out.len(), 1)?;
        out.copy_from_slice(local);
        Ok(())
    }
    fn reduce_scatter_rows(&self, full: &[f32], out: &mut [f32]) -> Result<()> {
        check_blocks("reduce_scatter_rows", out.len(), full.len(), 1)?;
        out.copy_from_slice(full);
        Ok(())
    }
}

/// A communicator whose members are exactly one TP group (member index = TP rank).
impl TpComm for Communicator {
    fn tp_rank(&self) -> usize {
        self.rank()
    }
    fn tp_size(&self) -> usize {
        self.size()
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        self.all_reduce(buf, ReduceOp::Sum)
    }
    fn all_reduce_max(&self, buf: &mut [f32]) -> Result<()> {
        self.all_reduce(buf, ReduceOp::Max)
    }
    fn all_gather_rows(&self, local: &[f32], out: &mut [f32]) -> Result<()> {
        check_blocks("all_gather_rows", local.len(), out.len(), self.size())?;
        self.all_gather_into(local, out)
    }
    fn reduce_scatter_rows(&self, full: &[f32], out: &mut [f32]) -> Result<()> {
        check_blocks("reduce_scatter_rows", out.len(), full.len(), self.size())?;
        self.reduce_scatter_into(full, out, ReduceOp::Sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::testing::run_ranks;
    use crate::comm::CommConfig;

    /// Rows are gathered in rank order and the scatter returns each rank its own block's sum.
    #[test]
    fn rows_gather_in_rank_order_and_scatter_back() {
        let out = run_ranks(3, CommConfig::default(), |comm| {
            let r = comm.tp_rank() as f32;
            let local = [r, r + 0.5]; // two "rows" of width 1
            let mut full = [0f32; 6];
            comm.all_gather_rows(&local, &mut full).unwrap();
            let mut mine = [0f32; 2];
            comm.reduce_scatter_rows(&full, &mut mine).unwrap();
            let mut m = [r, -r];
            comm.all_reduce_max(&mut m).unwrap();
            (full, mine, m)
        });
        for (r, (full, mine, m)) in out.iter().enumerate() {
            assert_eq!(*full, [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
            // Every rank contributed the same gathered buffer: 3 times rank r's block.
            assert_eq!(*mine, [3.0 * r as f32, 3.0 * (r as f32 + 0.5)]);
            assert_eq!(*m, [2.0, 0.0]);
        }
        assert!(NoTp.all_gather_rows(&[1.0], &mut [0.0, 0.0]).is_err());
    }
}
