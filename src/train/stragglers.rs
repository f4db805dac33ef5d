//! Straggler report: a rank that is slow but alive is named, with its lag, in the log and the
//! metrics; the run goes on.
//!
//! Why: a dead or stopped rank is blamed by the control channel, but a slow one (a throttled
//! node, a noisy neighbour) only makes every step slower, and every rank's step time is the same
//! (they wait for each other). What differs is each rank's own work: the step minus the
//! communication it waited for and the pipeline bubble (the metrics' `compute_s`), which grows on
//! the straggler and not on the ranks waiting for it.
//!
//! Invariants: every rank calls [`Stragglers::observe`] at every step (it is a collective on
//! report steps, which are the same on every rank); the first step (warm-up) is not counted; a
//! rank is reported only when its mean lags the (lower) median of all ranks by more than
//! [`MIN_LAG_FRACTION`] of the median and [`MIN_LAG_S`].

use crate::comm::{Communicator, ReduceOp};
use crate::error::Result;

/// Smallest lag reported, as a fraction of the median rank's time.
pub const MIN_LAG_FRACTION: f64 = 0.2;
/// Smallest lag reported, in seconds.
pub const MIN_LAG_S: f64 = 0.002;

/// The slowest rank over one report interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lag {
    /// World rank.
    pub rank: usize,
    /// Its mean own work per step, seconds.
    pub mean_s: f64,
    /// The median over all ranks, seconds.
    pub median_s: f64,
}

impl Lag {
    /// Seconds per step behind the median.
    pub fn lag_s(&self) -> f64 {
        self.mean_s - self.median_s
    }
}

/// This rank's own work per step since the last report.
#[derive(Debug)]
pub struct Stragglers {
    every: u64,
    sum_s: f64,
    steps: u64,
}

impl Stragglers {
    /// Reports every `every` steps (0: never).
    pub fn new(every: u64) -> Self {
        Stragglers { every, sum_s: 0.0, steps: 0 }
    }

    /// Adds this rank's own work of `step`; on report steps gathers every rank's mean over
    /// `comm` (the world) and returns the slowest when it lags.
    pub fn observe(&mut self, comm: &Communicator, step: u64, own_s: f64) -> Result<Option<Lag>> {
        if step > 1 {
            self.sum_s += own_s;
            self.steps += 1;
        }
        if self.every == 0 || step % self.every != 0 || comm.size() < 2 {
            return Ok(None);
        }
        let mut means = vec![0.0f64; comm.size()];
        means[comm.rank()] = self.sum_s / self.steps.max(1) as f64;
        comm.all_reduce(&mut means, ReduceOp::Sum)?;
        (self.sum_s, self.steps) = (0.0, 0);
        Ok(slowest(&means))
    }
}

/// The slowest of `means` when it lags the median enough (see the module header).
pub fn slowest(means: &[f64]) -> Option<Lag> {
    let mut sorted = means.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median_s = *sorted.get(sorted.len().checked_sub(1)? / 2)?;
    let (rank, &mean_s) = means.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1))?;
    let lag = Lag { rank, mean_s, median_s };
    (lag.lag_s() > MIN_LAG_S && lag.lag_s() > MIN_LAG_FRACTION * median_s).then_some(lag)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_rank_well_behind_the_median_is_named() {
        let lag = slowest(&[0.010, 0.050, 0.011, 0.010]).unwrap();
        assert_eq!(lag.rank, 1);
        assert!((lag.lag_s() - 0.040).abs() < 1e-9 && (lag.median_s - 0.010).abs() < 1e-12);
        assert_eq!(slowest(&[0.010, 0.030]).map(|l| l.rank), Some(1), "two ranks: the faster is the median");
        assert_eq!(slowest(&[0.010, 0.011, 0.0105]), None, "10% is noise");
        assert_eq!(slowest(&[0.0001, 0.0009]), None, "below a millisecond or two is noise");
        assert_eq!(slowest(&[]), None);
    }
}
