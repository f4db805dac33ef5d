//! Learning-rate schedule: linear warm-up to `max_lr`, then cosine decay to `min_lr`.

use crate::error::{Error, Result};

/// Warm-up + cosine schedule over `total_steps` optimizer steps (steps count from 0).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    max_lr: f64,
    min_lr: f64,
    warmup_steps: u64,
    total_steps: u64,
}

impl LrSchedule {
    /// Checks `0 <= min_lr <= max_lr`. A warm-up longer than the run is cut to the run's length
    /// (a short trial run of a long job then warms up over all its steps).
    pub fn new(max_lr: f64, min_lr: f64, warmup_steps: u64, total_steps: u64) -> Result<Self> {
        if !(0.0..=max_lr).contains(&min_lr) || !max_lr.is_finite() {
            return Err(Error::config(
                "optim.min_lr",
                format!("need 0 <= min_lr ({min_lr}) <= lr ({max_lr})"),
            ));
        }
        Ok(LrSchedule {
            max_lr,
            min_lr,
            warmup_steps: warmup_steps.min(total_steps),
            total_steps,
        })
    }

    /// Learning rate of step `step`: `max_lr (step+1)/warmup` during warm-up, then
    /// `min + (max-min)(1 + cos(pi·progress))/2`, and `min_lr` from `total_steps` on.
    pub fn lr(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.max_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        if step >= self.total_steps {
            return self.min_lr;
        }
        let progress = (step - self.warmup_steps) as f64 / (self.total_steps - self.warmup_steps) as f64;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.min_lr + coeff * (self.max_lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_peak_midpoint_and_floor() {
        let s = LrSchedule::new(1.0, 0.1, 10, 110).unwrap();
        assert_eq!(s.lr(0), 0.1);
        assert_eq!(s.lr(9), 1.0);
        assert_eq!(s.lr(10), 1.0);
        assert!((s.lr(60) - 0.55).abs() < 1e-15);
        assert_eq!(s.lr(110), 0.1);
        assert_eq!(s.lr(1000), 0.1);
        assert!((10..110).all(|i| s.lr(i + 1) <= s.lr(i)));
        assert!(LrSchedule::new(1.0, 2.0, 0, 10).is_err());
        let short = LrSchedule::new(1.0, 0.0, 20, 5).unwrap();
        assert_eq!([short.lr(0), short.lr(4)], [0.2, 1.0], "warm-up cut to the 5 steps of the run");
    }
}
