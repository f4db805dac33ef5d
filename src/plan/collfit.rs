//! Measured collective costs of a calibrated profile: an alpha-beta fit per collective and
//! algorithm, from `meshtrain bench --csv` rows.
//!
//! Why per algorithm: the communicator picks a schedule by size (direct all-pairs for small
//! buffers, ring above, single-copy reads where they work), and the schedules differ most in
//! latency: one line fitted through every size of a mixed run describes none of them. A fit is
//! `t(S) = latency + S f(g0) / busbw` for buffers of `S` bytes over the `g0` ranks measured, with
//! `f` the bus factor of `meshtrain bench` (nccl-tests' convention, `comm::stats::bus_factor`). It
//! is a weighted least-squares line through (S, t) with weights `1/t^2`, so the relative error is
//! minimized and small buffers (latency) count as much as large ones (bandwidth).
//!
//! Used for `g` ranks of the same tier: latency scaled by `(g-1)/(g0-1)` (a ring takes `g-1` steps
//! per phase; the direct schedule sends `g-1` messages per rank), the bandwidth term by `f(g)`; the
//! collective costs the fastest of its fitted algorithms at that size, as a tuned communicator
//! would choose. Invariant: a fit has a positive latency and bandwidth, and at least three sizes.

use std::path::Path;

use super::profile::CollFit;
use crate::comm::stats::bus_factor;
use crate::error::{Error, Result};

/// The collectives the planner costs with fits.
pub const COLLECTIVES: [&str; 3] = ["all_reduce", "all_gather", "reduce_scatter"];

/// One measured point: collective, algorithm, buffer bytes, seconds, ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub coll: String,
    pub algo: String,
    pub bytes: f64,
    pub seconds: f64,
    pub ranks: usize,
}

/// Reads a `meshtrain bench --csv` file measured on `ranks` ranks; rows take `algo` (the
/// schedule the bench ran under, e.g. `MESHTRAIN_ALGO=ring`) unless the file has an `algo` column.
/// Rows of other collectives and rows with wrong results are left out.
pub fn read_bench_csv(path: &Path, algo: &str, ranks: usize) -> Result<Vec<Sample>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::file(path, None, format!("cannot read the bench CSV: {e}")))?;
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<&str> = lines.next().unwrap_or("").split(',').collect();
    let col = |name: &str| header.iter().position(|h| h.trim() == name);
    let need = |name: &str| {
        col(name).ok_or_else(|| {
            Error::file(
                path,
                None,
                format!("not `meshtrain bench --csv` output: no `{name}` column"),
            )
        })
    };
    let (c, b, t, w) = (
        need("coll")?,
        need("bytes")?,
        need("time_us")?,
        col("wrong"),
    );
    let a = col("algo");
    let mut out = Vec::new();
    for (i, line) in lines.enumerate() {
        let cells: Vec<&str> = line.split(',').map(str::trim).collect();
        let bad = |what: String| Error::file(path, None, format!("line {}: {what}", i + 2));
        let cell = |k: usize| {
            cells
                .get(k)
                .copied()
                .ok_or_else(|| bad("too few cells".into()))
        };
        let num = |k: usize, name: &str| -> Result<f64> {
            let v: f64 = cell(k)?
                .parse()
                .map_err(|_| bad(format!("`{name}` is not a number")))?;
            if v.is_finite() && v > 0.0 {
                Ok(v)
            } else {
                Err(bad(format!("`{name}` = {v} is not positive")))
            }
        };
        let coll = cell(c)?;
        let wrong = w.map(|k| cell(k).map(|v| v != "0")).transpose()?;
        if !COLLECTIVES.contains(&coll) || wrong == Some(true) {
            continue;
        }
        out.push(Sample {
            coll: coll.to_string(),
            algo: a.map_or(Ok(algo), cell)?.to_string(),
            bytes: num(b, "bytes")?,
            seconds: num(t, "time_us")? * 1e-6,
            ranks,
        });
    }
    Ok(out)
}

/// Fits every (collective, algorithm) of `samples` with at least three sizes; `tier` names the
/// links they crossed (`intra`).
pub fn fit_all(samples: &[Sample], tier: &str) -> Result<Vec<CollFit>> {
    let mut keys: Vec<(&str, &str, usize)> = samples
        .iter()
        .map(|s| (s.coll.as_str(), s.algo.as_str(), s.ranks))
        .collect();
    keys.sort();
    keys.dedup();
    let mut fits = Vec::new();
    for (coll, algo, ranks) in keys {
        let pts: Vec<(f64, f64)> = samples
            .iter()
            .filter(|s| s.coll == coll && s.algo == algo && s.ranks == ranks)
            .map(|s| (s.bytes, s.seconds))
            .collect();
        if pts.len() < 3 || ranks < 2 {
            continue;
        }
        let (latency, per_byte) = weighted_line(&pts).ok_or_else(|| {
            Error::Check(format!(
                "calibrate: {coll} ({algo}) times do not grow with size; cannot fit a bandwidth"
            ))
        })?;
        let worst = pts
            .iter()
            .map(|(s, t)| ((latency + per_byte * s - t) / t).abs())
            .fold(0.0, f64::max);
        fits.push(CollFit {
            coll: coll.to_string(),
            algo: algo.to_string(),
            tier: tier.to_string(),
            ranks,
            latency_us: latency * 1e6,
            busbw_gbs: bus_factor(coll, ranks) / per_byte / 1e9,
            points: pts.len(),
            max_error_pct: 100.0 * worst,
        });
    }
    Ok(fits)
}

/// Least-squares line `t = a + b S` with weights `1/t^2`; `None` unless `b > 0`. A negative
/// intercept (noise at small sizes) is clamped to a microsecond's tenth.
fn weighted_line(pts: &[(f64, f64)]) -> Option<(f64, f64)> {
    let (mut sw, mut sx, mut sy, mut sxx, mut sxy) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(x, y) in pts {
        let w = 1.0 / (y * y);
        sw += w;
        sx += w * x;
        sy += w * y;
        sxx += w * x * x;
        sxy += w * x * y;
    }
    let det = sw * sxx - sx * sx;
    let b = (sw * sxy - sx * sy) / det;
    let a = (sy - b * sx) / sw;
    (b.is_finite() && b > 0.0).then_some((a.max(1e-7), b))
}

/// Seconds of `coll` over `g` ranks of `bytes` by the fastest fitted algorithm of the tier, or
/// `None` when the profile has no fit of it.
pub fn predict(fits: &[CollFit], coll: &str, tier: &str, g: usize, bytes: f64) -> Option<f64> {
    if g < 2 {
        return Some(0.0);
    }
    fits.iter()
        .filter(|f| f.coll == coll && f.tier == tier)
        .map(|f| {
            let steps = (g - 1) as f64 / (f.ranks - 1) as f64;
            f.latency_us * 1e-6 * steps + bytes * bus_factor(coll, g) / (f.busbw_gbs * 1e9)
        })
        .min_by(f64::total_cmp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fits_recover_each_algorithm_and_the_fastest_is_used() {
        // ring: 40 us, 4 GB/s bus; direct: 10 us, 1 GB/s bus; 4 ranks.
        let f = bus_factor("all_reduce", 4);
        let mut samples = Vec::new();
        for (algo, lat, bw) in [("ring", 40e-6, 4e9), ("direct", 10e-6, 1e9)] {
            for s in [8e3, 64e3, 512e3, 4e6, 32e6] {
                samples.push(Sample {
                    coll: "all_reduce".into(),
                    algo: algo.into(),
                    bytes: s,
                    seconds: lat + s * f / bw,
                    ranks: 4,
                });
            }
        }
        let fits = fit_all(&samples, "intra").unwrap();
        assert_eq!(fits.len(), 2);
        let ring = fits.iter().find(|f| f.algo == "ring").unwrap();
        assert!((ring.latency_us - 40.0).abs() < 1e-6 && (ring.busbw_gbs - 4.0).abs() < 1e-9);
        assert!(ring.max_error_pct < 1e-6);
        // Small buffers: direct's latency wins; large: the ring's bandwidth.
        let small = predict(&fits, "all_reduce", "intra", 4, 1e3).unwrap();
        assert!((small - (10e-6 + 1e3 * f / 1e9)).abs() < 1e-12);
        let large = predict(&fits, "all_reduce", "intra", 4, 1e8).unwrap();
        assert!((large - (40e-6 + 1e8 * f / 4e9)).abs() < 1e-9);
        // Eight ranks: latency of 7 steps against 3, bus factor of 8.
        let r8 = predict(&fits, "all_reduce", "intra", 8, 1e8).unwrap();
        let want = 40e-6 * 7.0 / 3.0 + 1e8 * bus_factor("all_reduce", 8) / 4e9;
        assert!((r8 - want).abs() < 1e-9);
        assert_eq!(predict(&fits, "all_gather", "intra", 4, 1e3), None);
    }

    #[test]
    fn bench_csv_rows_are_read_and_bad_cells_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("b.csv");
        std::fs::write(
            &p,
            "coll,bytes,count,dtype,time_us,algbw_gbs,busbw_gbs,wrong\n\
             all_reduce,8192,2048,f32,20.5,0.4,0.6,0\nbroadcast,8192,2048,f32,9,0.9,0.9,0\n\
             all_gather,8192,2048,f32,15,0.5,0.4,1\n",
        )
        .unwrap();
        let s = read_bench_csv(&p, "ring", 4).unwrap();
        assert_eq!(s.len(), 1, "broadcast and the wrong row are left out");
        assert_eq!((s[0].algo.as_str(), s[0].seconds), ("ring", 20.5e-6));
        std::fs::write(&p, "coll,bytes,time_us\nall_reduce,8192,fast\n").unwrap();
        let e = read_bench_csv(&p, "ring", 4).unwrap_err().to_string();
        assert!(
            e.contains("b.csv") && e.contains("line 2") && e.contains("time_us"),
            "{e}"
        );
        std::fs::write(&p, "coll,size\n").unwrap();
        let e = read_bench_csv(&p, "ring", 4).unwrap_err().to_string();
        assert!(e.contains("bytes"), "{e}");
    }
}
