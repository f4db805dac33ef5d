//! Non-finite losses and gradient norms (`train.nonfinite`): one decision on every rank.
//!
//! Between the gradient reduction and the optimizer update, every rank flags whether its own
//! loss, or the global gradient norm, is NaN or infinite; one max-reduction of the per-rank flags
//! over the world gives every rank the same list of ranks where it appeared, so all of them apply
//! the update, skip it (`skip`: no parameter or optimizer-state change, counted and logged), or
//! stop with the same error naming the step and the ranks (`stop`, the default). The gradient norm
//! is global (summed over every group), so a NaN gradient on any rank makes every rank flag; a
//! rank's own loss is the only locally attributable signal. Saving refuses non-finite values
//! separately (`checkpoint::save`), so a NaN never reaches a checkpoint.
//!
//! A NaN gradient with a finite loss is attributed too: each rank also flags whether its own
//! gradients held a NaN or infinity before the data-parallel reduction mixed them with its
//! peers' ([`LocalFlag`], marked where the gradients are staged for the reduction: the host
//! reducer's copy, the device packing; with one data-parallel rank the rank's own squares
//! before the tensor-parallel sum), so the verdict names the ranks the NaN came from.
//!
//! With loss scaling (`train.loss_scale`, the default under fp16) non-finite gradients under a
//! finite loss on every rank are the scale's overflow, not a diverging run: the verdict is
//! [`Verdict::Overflow`], the step is skipped on every rank whatever `train.nonfinite` says and
//! the scaler backs off (`loss_scale.rs`); a non-finite loss still follows `train.nonfinite`.
//!
//! `train.inject_nan_at = [step, rank]` makes that rank's loss NaN at that step (a testing knob:
//! the same config on every rank, so config agreement holds);
//! `MESHTRAIN_FAULT=nan-grad@RANK:STEP` makes that rank's loss gradient NaN at that step, so its
//! gradients are NaN and every loss finite.

use crate::comm::{Communicator, ReduceOp};
use crate::config::{NonFinitePolicy, TrainConfig};
use crate::device::{ops, Device, DeviceBuffer};
use crate::error::{Error, Result};

/// A flag on the device that collects whether any buffer marked into it held a NaN or an
/// infinity, without a host synchronization until it is read.
pub struct LocalFlag {
    buf: DeviceBuffer, // (1) u32: 0 or 1
}

impl LocalFlag {
    /// A cleared flag on `dev`.
    pub fn new(dev: &Device) -> Result<Self> {
        let mut buf = dev.alloc(4)?;
        dev.copy_to_device(&mut buf, &[0u32])?;
        Ok(LocalFlag { buf })
    }

    /// Marks the flag if x[start..start + n] (f32) holds a non-finite value.
    pub fn mark(&mut self, dev: &Device, x: &DeviceBuffer, start: usize, n: usize) -> Result<()> {
        ops::mark_nonfinite(dev, &mut self.buf, x, start, n)
    }

    /// Whether anything marked since the last call held a non-finite value; clears the flag.
    pub fn take(&mut self, dev: &Device) -> Result<bool> {
        let mut v = [0u32];
        dev.copy_to_host(&self.buf, &mut v)?;
        if v[0] != 0 {
            dev.copy_to_device(&mut self.buf, &[0u32])?;
        }
        Ok(v[0] != 0)
    }
}

/// The per-step decision and the count of skipped steps.
pub struct NonFiniteGuard {
    policy: NonFinitePolicy,
    inject: Option<[u64; 2]>,
    /// Steps whose update was skipped so far.
    pub skipped: u64,
    /// The loss is scaled: non-finite gradients under finite losses are an overflow.
    scaling: bool,
}

/// What a step does with its update.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Everything finite: apply it.
    Apply,
    /// Non-finite and `skip`: leave parameters and optimizer state as they are.
    Skip(String),
    /// Loss scaling: the gradients overflowed (every loss finite); skip, and back the scale off.
    Overflow(String),
}

impl NonFiniteGuard {
    /// The guard for `train`'s policy.
    pub fn new(train: &TrainConfig) -> Self {
        NonFiniteGuard { policy: train.nonfinite, inject: train.inject_nan_at, skipped: 0, scaling: false }
    }

    /// The guard of a run that scales its loss (see the module documentation).
    pub fn with_loss_scaling(self, scaling: bool) -> Self {
        NonFiniteGuard { scaling, ..self }
    }

    /// This rank's loss of `step`, with the injected NaN where configured.
    pub fn local_loss(&self, step: u64, rank: usize, loss: f64) -> f64 {
        match self.inject {
            Some([s, r]) if s == step && r == rank as u64 => f64::NAN,
            _ => loss,
        }
    }

    /// Collective over `world`: the verdict of `step` given this rank's `loss`, the global
    /// `grad_norm` and whether this rank's own gradients were non-finite before the reduction
    /// (`local_grads`); the same on every rank. `stop` returns the error instead.
    pub fn decide(&mut self, world: &Communicator, step: u64, loss: f64, (grad_norm, local_grads): (f64, bool)) -> Result<Verdict> {
        let mut flags = vec![0u8; world.size()];
        flags[world.rank()] = u8::from(!loss.is_finite()) | (u8::from(!grad_norm.is_finite()) << 1) | (u8::from(local_grads) << 2);
        world.all_reduce(&mut flags, ReduceOp::Max)?;
        if flags.iter().all(|&f| f == 0) {
            return Ok(Verdict::Apply);
        }
        let with = |bit: u8| -> Vec<String> { (0..flags.len()).filter(|&r| flags[r] & bit != 0).map(|r| r.to_string()).collect() };
        let (ranks, sources) = (with(1), with(4));
        let what = match (ranks.is_empty(), sources.is_empty()) {
            (true, true) => format!("non-finite gradient norm ({grad_norm}) at step {step}; the loss was finite on every rank"),
            (true, false) => format!(
                "non-finite gradient norm ({grad_norm}) at step {step}; the loss was finite on every rank; the non-finite gradients came from rank(s) {}",
                sources.join(", ")
            ),
            (false, _) => format!("non-finite loss at step {step} on rank(s) {} (gradient norm {grad_norm})", ranks.join(", ")),
        };
        if self.scaling && ranks.is_empty() {
            self.skipped += 1;
            return Ok(Verdict::Overflow(format!("{what}: gradient overflow under loss scaling, update skipped ({} so far)", self.skipped)));
        }
        match self.policy {
            NonFinitePolicy::Stop => Err(Error::Check(format!(
                "{what}; stopping (train.nonfinite = \"stop\"; \"skip\" skips such steps)"
            ))),
            NonFinitePolicy::Skip => {
                self.skipped += 1;
                Ok(Verdict::Skip(format!("{what}: update skipped ({} so far)", self.skipped)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::testing::run_ranks;
    use crate::comm::CommConfig;

    fn guard(policy: NonFinitePolicy) -> NonFiniteGuard {
        NonFiniteGuard { policy, inject: Some([3, 1]), skipped: 0, scaling: false }
    }

    /// Under loss scaling a gradient overflow is skipped even with `stop`; a NaN loss still stops.
    #[test]
    fn loss_scaling_skips_gradient_overflow_but_not_a_nonfinite_loss() {
        let out = run_ranks(2, CommConfig::default(), |c| {
            let mut g = guard(NonFinitePolicy::Stop).with_loss_scaling(true);
            let over = g.decide(&c, 2, 1.0, (f64::INFINITY, c.rank() == 1)).unwrap();
            let err = g.decide(&c, 3, g.local_loss(3, c.rank(), 1.0), (0.5, false)).unwrap_err().to_string();
            (over, g.skipped, err)
        });
        for (over, skipped, err) in out {
            match over {
                Verdict::Overflow(m) => assert!(m.contains("came from rank(s) 1") && m.contains("(1 so far)"), "{m}"),
                other => panic!("{other:?}"),
            }
            assert_eq!(skipped, 1);
            assert!(err.contains("non-finite loss at step 3 on rank(s) 1"), "{err}");
        }
    }

    #[test]
    fn every_rank_reaches_the_same_verdict_naming_the_rank() {
        let verdicts = run_ranks(3, CommConfig::default(), |c| {
            let mut g = guard(NonFinitePolicy::Skip);
            let fine = g.decide(&c, 2, g.local_loss(2, c.rank(), 1.5), (0.5, false)).unwrap();
            let bad = g.decide(&c, 3, g.local_loss(3, c.rank(), 1.5), (0.5, false)).unwrap();
            let mut stop = guard(NonFinitePolicy::Stop);
            let err = stop.decide(&c, 4, 1.0, (f64::INFINITY, false)).unwrap_err().to_string();
            let blamed = stop.decide(&c, 5, 1.0, (f64::NAN, c.rank() == 2)).unwrap_err().to_string();
            (fine, bad, g.skipped, err, blamed)
        });
        for (fine, bad, skipped, err, blamed) in verdicts {
            assert!(blamed.contains("step 5; the loss was finite on every rank; the non-finite gradients came from rank(s) 2;"), "{blamed}");
            assert_eq!(fine, Verdict::Apply);
            assert_eq!(skipped, 1);
            match bad {
                Verdict::Skip(m) => assert!(m.contains("step 3 on rank(s) 1 "), "{m}"),
                other => panic!("{other:?}"),
            }
            assert!(err.contains("non-finite gradient norm (inf) at step 4"), "{err}");
        }
    }
}
