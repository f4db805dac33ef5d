//! GPU bandwidth of the collective combine kernels next to a device-to-device copy, the bound a
//! fused reduction is measured against (the `meshtrain bench` side calls [`reduce_bandwidth`]).
//!
//! Bytes counted per element: a combine reads two operands and writes one (3 x size); a copy
//! reads one and writes one (2 x size). Inputs are non-zero patterns (zeros can run faster than
//! real data), every launch is followed by no host work until the batch synchronizes, and the
//! reported figure is the median over batches, after one warm-up batch.

use std::time::Instant;

use super::ops::reduce;
use super::Device;
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;

/// One measured kernel.
#[derive(Debug, Clone)]
pub struct BandwidthRow {
    /// `memcpy_dtod` or the kernel name.
    pub what: String,
    /// Median seconds per call.
    pub seconds: f64,
    /// Device-memory traffic per call over its time, GB/s (1e9 bytes).
    pub gbs: f64,
}

/// Calls per timed batch and timed batches per row.
const CALLS: usize = 10;
const BATCHES: usize = 7;

/// Median seconds per call of `f` (batches of [`CALLS`] calls, each batch synchronized).
fn median_seconds(dev: &Device, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut times = Vec::with_capacity(BATCHES);
    for batch in 0..=BATCHES {
        dev.synchronize()?;
        let t = Instant::now();
        for _ in 0..CALLS {
            f()?;
        }
        dev.synchronize()?;
        if batch > 0 {
            times.push(t.elapsed().as_secs_f64() / CALLS as f64);
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Device-to-device copy and `reduce_{sum,max}_<dtype>` over buffers of `bytes` bytes each.
pub fn reduce_bandwidth(dev: &Device, bytes: usize) -> Result<Vec<BandwidthRow>> {
    let pattern: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8 | 1).collect();
    let a = dev.upload(&pattern)?;
    let b = dev.upload(&pattern)?;
    let mut out = dev.alloc(bytes)?;
    let mut rows = Vec::new();
    let s = median_seconds(dev, || dev.copy_on_device(&mut out, &a))?;
    rows.push(BandwidthRow {
        what: "memcpy_dtod".into(),
        seconds: s,
        gbs: 2.0 * bytes as f64 / s / 1e9,
    });
    for dtype in DType::ALL {
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let n = bytes / dtype.size();
            let s = median_seconds(dev, || reduce(dev, dtype, op, &mut out, &a, &b, n))?;
            let what = super::kernels::reduce_kernel(dtype, op);
            rows.push(BandwidthRow {
                what,
                seconds: s,
                gbs: 3.0 * (n * dtype.size()) as f64 / s / 1e9,
            });
        }
    }
    Ok(rows)
}
