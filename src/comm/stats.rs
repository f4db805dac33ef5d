//! Per-operation traffic counters of a communicator, for the training metrics: calls, bytes and
//! time of each collective kind, and the bus bandwidth they imply.
//!
//! The counters live behind an `Arc` so that a thread that moved the communicator away (the
//! data-parallel reduction thread) can still be read by the training loop. Bus bandwidth uses the
//! nccl-tests factors: all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n;
//! broadcast, reduce, point-to-point 1.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Bus-bandwidth factor of collective `op` on `n` ranks.
pub fn bus_factor(op: &str, n: usize) -> f64 {
    let n = n as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "all_gather" | "reduce_scatter" | "all_to_all" => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// Totals of one operation kind.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpTotals {
    /// Calls.
    pub calls: u64,
    /// Buffer bytes over all calls.
    pub bytes: u64,
    /// Wall time over all calls.
    pub time: Duration,
}

/// Shared counters of one communicator.
#[derive(Debug, Default)]
pub struct CommStats {
    ranks: usize,
    ops: Mutex<BTreeMap<&'static str, OpTotals>>,
}

impl CommStats {
    /// Counters for a communicator of `ranks` members.
    pub fn new(ranks: usize) -> Arc<Self> {
        Arc::new(CommStats { ranks, ops: Mutex::default() })
    }

    /// Adds one call of `op`.
    pub fn record(&self, op: &'static str, bytes: usize, time: Duration) {
        let mut ops = self.ops.lock().unwrap_or_else(|e| e.into_inner());
        let t = ops.entry(op).or_default();
        t.calls += 1;
        t.bytes += bytes as u64;
        t.time += time;
    }

    /// The totals since the last call, as JSON (`{op: {calls, bytes, time_s, busbw_gbs}}`), and
    /// resets them.
    pub fn take_json(&self) -> serde_json::Value {
        let ops = std::mem::take(&mut *self.ops.lock().unwrap_or_else(|e| e.into_inner()));
        let map: serde_json::Map<String, serde_json::Value> = ops
            .into_iter()
            .map(|(op, t)| {
                let secs = t.time.as_secs_f64();
                let busbw = if secs > 0.0 { t.bytes as f64 / secs / 1e9 * bus_factor(op, self.ranks) } else { 0.0 };
                let v = serde_json::json!({"calls": t.calls, "bytes": t.bytes, "time_s": secs, "busbw_gbs": busbw});
                (op.to_string(), v)
            })
            .collect();
        serde_json::Value::Object(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_accumulate_and_reset() {
        let s = CommStats::new(4);
        s.record("all_reduce", 1000, Duration::from_millis(1));
        s.record("all_reduce", 1000, Duration::from_millis(1));
        let j = s.take_json();
        assert_eq!(j["all_reduce"]["calls"], 2);
        assert_eq!(j["all_reduce"]["bytes"], 2000);
        // 2000 B in 2 ms = 1 GB/s algorithm bandwidth, times 2(n-1)/n = 1.5.
        assert!((j["all_reduce"]["busbw_gbs"].as_f64().unwrap() - 0.0015).abs() < 1e-9);
        assert_eq!(s.take_json(), serde_json::json!({}));
    }
}
