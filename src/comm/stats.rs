//! Per-operation traffic counters of a communicator, for the training metrics: calls, bytes and
//! time of each collective kind, and the bus bandwidth they imply.
//!
//! The counters live behind an `Arc` so that a thread that moved the communicator away (the
//! data-parallel reduction thread) can still be read by the training loop. Bus bandwidth uses the
//! nccl-tests factors: all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n;
//! broadcast, reduce, point-to-point 1.
//!
//! Inter-node bytes: every link to a member on another node sends through [`CountedSend`], which
//! adds the bytes it posts (payload and the calls' fingerprints, not the transport's own headers)
//! to a counter the communicator shares with the stage communicators of its hierarchical
//! schedules, so `Communicator::net_bytes_sent` is what this rank put on the network on its
//! behalf. Device-direct (FI_HMEM) sends bypass the host links and are not counted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::Result;
use crate::transport::{SendLink, Waiter};

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
    /// Per operation name, in first-call order (a handful; scanned, names compared by address
    /// first: every call site passes a literal).
    ops: Mutex<Vec<(&'static str, OpTotals)>>,
}

impl CommStats {
    /// Counters for a communicator of `ranks` members.
    pub fn new(ranks: usize) -> Arc<Self> {
        Arc::new(CommStats { ranks, ops: Mutex::default() })
    }

    /// Adds one call of `op`.
    pub fn record(&self, op: &'static str, bytes: usize, time: Duration) {
        let mut ops = self.ops.lock().unwrap_or_else(|e| e.into_inner());
        let t = match ops.iter().position(|(k, _)| std::ptr::eq(*k, op) || *k == op) {
            Some(i) => &mut ops[i].1,
            None => {
                ops.push((op, OpTotals::default()));
                &mut ops.last_mut().expect("just pushed").1
            }
        };
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

/// A send link to a member on another node that counts the bytes it posts.
pub struct CountedSend {
    /// The link itself.
    pub inner: Box<dyn SendLink>,
    /// Bytes posted so far, shared with the communicator.
    pub sent: Arc<AtomicU64>,
}

impl SendLink for CountedSend {
    fn reserve(&mut self, len: usize, w: &Waiter) -> Result<&mut [u8]> {
        self.inner.reserve(len, w)
    }
    fn post(&mut self, len: usize, w: &Waiter) -> Result<()> {
        self.inner.post(len, w)?;
        self.sent.fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }
    fn max_chunk(&self) -> usize {
        self.inner.max_chunk()
    }
    fn depth(&self) -> usize {
        self.inner.depth()
    }
    fn flush(&mut self, w: &Waiter) -> Result<()> {
        self.inner.flush(w)
    }
    #[cfg(feature = "ofi")]
    fn direct(&self) -> Option<Arc<crate::transport::DirectPeer>> {
        self.inner.direct()
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
