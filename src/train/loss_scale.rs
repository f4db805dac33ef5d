//! Loss scaling (`train.loss_scale`): the scale a step multiplies its loss gradient by, and how
//! the scale follows the steps' outcomes.
//!
//! Why: under `precision = "fp16"` the activation gradients a matrix product reads are rounded to
//! IEEE half, whose smallest normal is 2^-14: most of a language model's gradients would flush
//! to zero. Multiplying the loss gradient by a large scale S lifts every gradient by S (the
//! backward is linear in it), and the optimizer divides by S again, folded into the factor the
//! AdamW step already multiplies every gradient by (the clipping scale), so unscaling costs no
//! pass over the gradients. Too large an S overflows fp16 (65504) into infinities: such a step's
//! gradients are non-finite somewhere, every rank learns it from the one agreement of
//! `nonfinite.rs` and skips the update alike.
//!
//! The dynamic scaler (`"dynamic"`): start at `loss_scale_init`; after a step with non-finite
//! gradients (and a finite loss) multiply by `loss_scale_backoff`, and stop with an error if that
//! falls below `loss_scale_min`; after `loss_scale_growth_interval` consecutive good steps
//! multiply by `loss_scale_growth`. A fixed scale (a number) only skips. `"none"` is scale 1,
//! where a non-finite gradient follows `train.nonfinite` as without scaling.
//!
//! Invariants: every rank holds the same state (the same decisions from the same agreed verdicts,
//! restored from the same checkpoint); the state is saved with each checkpoint
//! ([`LossScaleMeta`]) and a resume continues with it bit for bit; a skipped step changes no
//! weight, no moment and not the optimizer's step count.

use crate::checkpoint::LossScaleMeta;
use crate::config::{LossScale, TrainConfig};
use crate::error::{Error, Result};

/// The loss scale and its schedule; see the module documentation.
#[derive(Debug, Clone)]
pub struct LossScaler {
    mode: LossScale,
    scale: f64,
    /// Consecutive good steps since the scale last changed.
    good: u64,
    growth: f64,
    backoff: f64,
    interval: u64,
    min: f64,
}

impl LossScaler {
    /// The scaler `train` configures, at its initial scale.
    pub fn new(train: &TrainConfig) -> Self {
        let scale = match train.loss_scale {
            LossScale::None => 1.0,
            LossScale::Dynamic => train.loss_scale_init,
            LossScale::Fixed(s) => s,
        };
        LossScaler {
            mode: train.loss_scale,
            scale,
            good: 0,
            growth: train.loss_scale_growth,
            backoff: train.loss_scale_backoff,
            interval: train.loss_scale_growth_interval,
            min: train.loss_scale_min,
        }
    }

    /// Whether the loss is scaled: a step whose gradients are non-finite (and loss finite) is
    /// then skipped rather than handled by `train.nonfinite`.
    pub fn active(&self) -> bool {
        self.mode != LossScale::None
    }

    /// The scale of the next step.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Updates the scale after step `step`: `overflow` = its gradients were non-finite (the step
    /// was skipped). An error when the dynamic scale would fall below `train.loss_scale_min`.
    pub fn update(&mut self, step: u64, overflow: bool) -> Result<()> {
        if self.mode != LossScale::Dynamic {
            return Ok(());
        }
        if overflow {
            let next = self.scale * self.backoff;
            if next < self.min {
                return Err(Error::Check(format!(
                    "non-finite gradients at step {step} with the loss scale at {}: backing off to {next} would go below train.loss_scale_min = {}; \
                     the gradients overflow even unscaled (a diverging run, or fp16 cannot hold this model's activations: try precision = \"bf16\")",
                    self.scale, self.min
                )));
            }
            (self.scale, self.good) = (next, 0);
            return Ok(());
        }
        self.good += 1;
        if self.good >= self.interval {
            let grown = self.scale * self.growth;
            // A scale beyond f32 would make the loss gradient itself infinite.
            if grown <= f64::from(f32::MAX) {
                self.scale = grown;
            }
            self.good = 0;
        }
        Ok(())
    }

    /// The state a checkpoint keeps, with the run's count of `skipped` steps (`None` without
    /// loss scaling).
    pub fn state(&self, skipped: u64) -> Option<LossScaleMeta> {
        self.active().then_some(LossScaleMeta { scale: self.scale, good_steps: self.good, skipped_steps: skipped })
    }

    /// Continues from a checkpoint's state; `None` (a checkpoint without one) keeps the
    /// configured start. A fixed scale stays the configured one.
    pub fn restore(&mut self, state: Option<LossScaleMeta>) {
        if let (LossScale::Dynamic, Some(s)) = (self.mode, state) {
            (self.scale, self.good) = (s.scale, s.good_steps);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::JobConfig;

    fn scaler(sets: &[&str]) -> LossScaler {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let cfg = JobConfig::from_str("[model]\nsize = \"tiny\"\n", &sets).unwrap();
        LossScaler::new(&cfg.train)
    }

    #[test]
    fn dynamic_scale_backs_off_grows_after_the_interval_and_stops_at_the_minimum() {
        let mut s = scaler(&["precision=fp16", "train.loss_scale_init=8", "train.loss_scale_growth_interval=3", "train.loss_scale_min=2"]);
        assert!(s.active());
        assert_eq!(s.scale(), 8.0);
        s.update(1, true).unwrap();
        assert_eq!(s.scale(), 4.0);
        s.update(2, false).unwrap();
        s.update(3, false).unwrap();
        assert_eq!(s.scale(), 4.0);
        // An overflow resets the count of good steps.
        s.update(4, true).unwrap();
        assert_eq!(s.state(0), Some(LossScaleMeta { scale: 2.0, good_steps: 0, skipped_steps: 0 }));
        for step in 5..8 {
            s.update(step, false).unwrap();
        }
        assert_eq!(s.state(0), Some(LossScaleMeta { scale: 4.0, good_steps: 0, skipped_steps: 0 }));
        s.update(8, false).unwrap();
        let saved = s.state(2);
        s.update(9, true).unwrap();
        let err = s.update(10, true).unwrap_err().to_string();
        assert!(err.contains("step 10") && err.contains("train.loss_scale_min = 2"), "{err}");
        let mut back = scaler(&["precision=fp16", "train.loss_scale_init=8", "train.loss_scale_min=2"]);
        back.restore(saved);
        assert_eq!(back.state(2), Some(LossScaleMeta { scale: 4.0, good_steps: 1, skipped_steps: 2 }));
        back.restore(None);
        assert_eq!(back.scale(), 4.0);
    }

    #[test]
    fn defaults_follow_the_precision_and_fixed_scales_never_move() {
        assert!(!scaler(&[]).active());
        assert_eq!(scaler(&[]).scale(), 1.0);
        assert_eq!(scaler(&[]).state(0), None);
        let fp16 = scaler(&["precision=fp16"]);
        assert_eq!((fp16.active(), fp16.scale()), (true, 65536.0));
        let mut fixed = scaler(&["precision=fp16", "train.loss_scale=1024", "train.loss_scale_growth_interval=1"]);
        fixed.update(1, true).unwrap();
        fixed.update(2, false).unwrap();
        fixed.restore(Some(LossScaleMeta { scale: 2.0, good_steps: 0, skipped_steps: 0 }));
        assert_eq!(fixed.scale(), 1024.0);
        let none = scaler(&["precision=fp16", "train.loss_scale=none"]);
        assert!(!none.active());
        // bf16 may scale too when asked.
        assert!(scaler(&["precision=bf16", "train.loss_scale=dynamic"]).active());
    }

    #[test]
    fn bad_values_name_their_key() {
        let base = "[model]\nsize = \"tiny\"\n";
        for (set, key) in [
            ("train.loss_scale=sometimes", "train.loss_scale"),
            ("train.loss_scale=-4", "train.loss_scale"),
            ("train.loss_scale=0", "train.loss_scale"),
            ("train.loss_scale_init=0", "train.loss_scale_init"),
            ("train.loss_scale_init=inf", "train.loss_scale_init"),
            ("train.loss_scale_growth=0.5", "train.loss_scale_growth"),
            ("train.loss_scale_backoff=1", "train.loss_scale_backoff"),
            ("train.loss_scale_backoff=0", "train.loss_scale_backoff"),
            ("train.loss_scale_growth_interval=0", "train.loss_scale_growth_interval"),
            ("train.loss_scale_min=-1", "train.loss_scale_min"),
            ("train.loss_scale_min=1e6", "train.loss_scale_init"),
            ("train.loss_scal=2", "train.loss_scale"),
        ] {
            let err = JobConfig::from_str(base, &["precision=fp16".into(), set.into()]).unwrap_err().to_string();
            assert!(err.contains(&format!("`{key}`")) || err.contains(key), "{set}: {err}");
        }
        let cfg = JobConfig::from_str(base, &["precision=fp16".into()]).unwrap();
        assert_eq!(cfg.train.loss_scale, LossScale::Dynamic);
        // The effective configuration loads back to the same value.
        for set in ["train.loss_scale=dynamic", "train.loss_scale=none", "train.loss_scale=512", "train.loss_scale=0.25"] {
            let cfg = JobConfig::from_str(base, &[set.into()]).unwrap();
            assert_eq!(JobConfig::from_str(&cfg.to_toml(), &[]).unwrap(), cfg, "{set}");
        }
    }
}
