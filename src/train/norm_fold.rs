//! The gradient norm's squares taken while the gradients are still in cache: with one
//! data-parallel rank, one micro-batch and the CPU arm, nothing changes a unit's gradients once
//! the backward hands the unit over ([`crate::model::DeviceGpt::backward_reducing`]), so the
//! block sums of squares of that unit are taken right then, instead of in a pass over all the
//! gradients after the backward (a d12 step's 0.5 GB, read back from memory).
//!
//! Why the bits do not move: the norm is a sum per (bucket, counted span) of the span's
//! [`BLOCK`]-element block sums in block order (`cpu::clip::sum_of_squares_pieces`). A unit
//! contributes the blocks that lie wholly inside it, each computed by the same function on the
//! same elements; blocks that straddle two units (and any block of a unit not handed over) are
//! taken after the backward; the fold then adds the block sums in block order as before.
//!
//! Invariants: the taken block sums are valid only until the gradients change, so they are taken
//! only between [`NormFold::arm`] (the step's start) and [`NormFold::squares`] (its reduction),
//! in a step of one micro-batch (one backward: the one handing the units over); `squares` forgets
//! them.

use std::ops::Range;

use crate::device::cpu::clip::{fold_block_sums, BLOCK};
use crate::device::ops;
use crate::error::{Error, Result};
use crate::model::DeviceGpt;

/// The block sums of one span, in block order (None: not taken this step).
type BlockSums = Vec<Option<f64>>;

/// Block sums of squares of the counted spans, taken unit by unit during the backward.
pub struct NormFold {
    /// Per bucket, per counted span: the span and its block sums.
    spans: Vec<Vec<(Range<usize>, BlockSums)>>,
    /// Whether this step's units are folded (one micro-batch).
    armed: bool,
    /// Scratch for the block sums of one call.
    sums: Vec<f64>,
}

impl NormFold {
    /// A fold over `counted` (per bucket: the flat spans counted in the norm).
    pub fn new(counted: &[Vec<Range<usize>>]) -> Self {
        let blocks = |c: &Range<usize>| vec![None; c.len().div_ceil(BLOCK)];
        let spans = counted
            .iter()
            .map(|b| b.iter().map(|c| (c.clone(), blocks(c))).collect())
            .collect();
        NormFold {
            spans,
            armed: false,
            sums: Vec::new(),
        }
    }

    /// Starts a step of `micro_batches` micro-batches: folds its units only if there is one
    /// (with more, the squares are of the averaged gradients, taken after the last backward).
    pub fn arm(&mut self, micro_batches: usize) {
        self.forget();
        self.armed = micro_batches == 1;
    }

    /// Whether this step's units should be handed over to [`NormFold::unit_final`].
    pub fn armed(&self) -> bool {
        self.armed
    }

    fn forget(&mut self) {
        self.spans
            .iter_mut()
            .flatten()
            .for_each(|(_, b)| b.fill(None));
    }

    /// Takes the block sums of every counted block lying wholly inside `unit` (flat range) from
    /// `model`'s gradients, which are final.
    pub fn unit_final(&mut self, model: &DeviceGpt, unit: Range<usize>) -> Result<()> {
        if !self.armed {
            return Err(Error::Check(
                "a unit's gradients reached a norm fold that is not armed".into(),
            ));
        }
        for (span, blocks) in self.spans.iter_mut().flatten() {
            let (lo, hi) = (unit.start.max(span.start), unit.end.min(span.end));
            if lo >= hi {
                continue;
            }
            let first = (lo - span.start).div_ceil(BLOCK);
            let end = if hi == span.end {
                blocks.len()
            } else {
                (hi - span.start) / BLOCK
            };
            if first < end {
                take(model, span, first..end, blocks, &mut self.sums)?;
            }
        }
        Ok(())
    }

    /// The sums of squares of bucket `b`'s counted spans into `out` (one per span), from the block
    /// sums taken during the backward and those of the blocks left, which are taken now; forgets
    /// the bucket's taken sums.
    pub fn squares(&mut self, model: &DeviceGpt, b: usize, out: &mut [f64]) -> Result<()> {
        for ((span, blocks), sq) in self.spans[b].iter_mut().zip(out.iter_mut()) {
            let mut k = 0;
            while k < blocks.len() {
                if blocks[k].is_some() {
                    k += 1;
                    continue;
                }
                let end = (k..blocks.len())
                    .find(|&j| blocks[j].is_some())
                    .unwrap_or(blocks.len());
                take(model, span, k..end, blocks, &mut self.sums)?;
                k = end;
            }
            self.sums.clear();
            self.sums
                .extend(blocks.iter().map(|s| s.unwrap_or(f64::NAN)));
            *sq = fold_block_sums(&self.sums);
            blocks.fill(None);
        }
        Ok(())
    }

    /// Ends the step: no unit is folded until the next [`NormFold::arm`].
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

/// Takes the block sums of blocks `which` of `span` from `model`'s gradients into `blocks`.
fn take(
    model: &DeviceGpt,
    span: &Range<usize>,
    which: Range<usize>,
    blocks: &mut [Option<f64>],
    sums: &mut Vec<f64>,
) -> Result<()> {
    let r = span.start + which.start * BLOCK..(span.start + which.end * BLOCK).min(span.end);
    sums.clear();
    ops::block_sums_parts(model.device(), &model.grad_parts(r), sums)?;
    if sums.len() != which.len() {
        return Err(Error::Check(format!(
            "norm fold: {} block sums for {} blocks",
            sums.len(),
            which.len()
        )));
    }
    for (slot, &s) in blocks[which].iter_mut().zip(sums.iter()) {
        *slot = Some(s);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{Device, DeviceBuffer};
    use crate::model::{Gpt, GptConfig, Precision};

    fn model() -> DeviceGpt {
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            vocab_size: 50,
            max_seq_len: 8,
            llama: None,
        };
        let params = Gpt::<f32>::new(cfg, 2, 8, 1).unwrap().params().to_vec();
        let mut m = DeviceGpt::new(Device::Cpu, cfg, 2, 8, params, Precision::Fp32).unwrap();
        let x: Vec<u32> = (0..16).map(|i| i % 50).collect();
        let y: Vec<u32> = (0..16).map(|i| (i * 7) % 50).collect();
        m.zero_grad().unwrap();
        m.forward(&x, &y).unwrap();
        m
    }

    /// Buckets of awkward sizes (not multiples of a block, not unit boundaries), some spans not
    /// counted, every unit or only every other unit handed over: the folded squares have the bits
    /// of the squares taken after the backward, and a fold that is not armed refuses units.
    #[test]
    fn folded_squares_have_the_bits_of_the_squares_taken_after_the_backward() {
        for every_other in [false, true] {
            let mut m = model();
            let n = m.layout().total_len();
            assert!(
                n > 4 * BLOCK,
                "the model spans several blocks ({n} elements)"
            );
            let cuts = [0, 700, 2900, 2950, n - 1500, n];
            let counted: Vec<Vec<Range<usize>>> = cuts
                .windows(2)
                .enumerate()
                .map(|(i, w)| {
                    if i == 2 {
                        vec![]
                    } else {
                        vec![
                            w[0]..w[0] + (w[1] - w[0]) / 3,
                            w[0] + (w[1] - w[0]) / 2..w[1],
                        ]
                    }
                })
                .collect();
            let mut fold = NormFold::new(&counted);
            let err = fold.unit_final(&m, 0..n).unwrap_err().to_string();
            assert!(err.contains("not armed"), "{err}");
            fold.arm(1);
            assert!(fold.armed());
            let mut handed = 0;
            m.backward_reducing(&mut |m: &DeviceGpt, unit: Range<usize>| {
                handed += 1;
                if every_other && handed % 2 == 0 {
                    return Ok(());
                }
                fold.unit_final(m, unit)
            })
            .unwrap();
            assert!(handed > 3, "{handed} units");
            let (mut partials, mut stage): (DeviceBuffer, DeviceBuffer) = (
                m.device().alloc(4 * ops::SUM_BLOCKS).unwrap(),
                m.device().alloc(4 * n).unwrap(),
            );
            for (b, spans) in counted.iter().enumerate() {
                let mut got = vec![0.0; spans.len()];
                fold.squares(&m, b, &mut got).unwrap();
                for (c, g) in spans.iter().zip(&got) {
                    let want = ops::sum_squares_parts(
                        m.device(),
                        &mut partials,
                        &mut stage,
                        &m.grad_parts(c.clone()),
                    )
                    .unwrap();
                    assert!(want > 0.0);
                    assert_eq!(
                        g.to_bits(),
                        want.to_bits(),
                        "bucket {b} span {c:?} every_other {every_other}"
                    );
                }
            }
            fold.disarm();
            assert!(!fold.armed());
            fold.arm(2);
            assert!(
                !fold.armed(),
                "more than one micro-batch: nothing is folded"
            );
        }
    }
}
