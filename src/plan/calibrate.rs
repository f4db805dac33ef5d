//! `meshtrain plan calibrate`: a profile of this machine from measurements, so that the planner's
//! predictions here rest on what this node does, not on a datasheet.
//!
//! Started like training (one process per device under mpirun or srun, on one node), every rank
//! measures at once, so each sees the share of the node it will have when training:
//! - GEMMs of a grid of shapes (`(m, n, k)` from the widths meshtrain's blocks multiply), through
//!   the device arm's own GEMM (`device::gemm`), best of a few runs, the slowest rank's time: the
//!   profile's `compute.measured` table, and the best of them as the peak;
//! - memory bandwidth: a device-to-device copy (bytes read plus written per second);
//! - links: `all_reduce` of f32 over sizes from 8 KiB up, through the same code as `meshtrain
//!   bench`, fitted to the ring model `t = 2(g-1) alpha + 2(g-1)/g S / B` by least squares
//!   (`intra.latency_us`, `intra.bandwidth_gbs`, `achievable = 1`).
//!
//! One node is measured: the inter-node tier is written equal to the intra-node one and the
//! description says so. Memory per device is the node's `MemAvailable` split over its ranks on
//! the CPU arm; GPUs need `--memory-gb`.

use std::path::PathBuf;
use std::time::Instant;

use super::profile::{Compute, GemmCurve, GemmPoint, Inter, Intra, Memory, Profile};
use crate::bench::collectives::{self, CollBench};
use crate::bootstrap::World;
use crate::comm::{Communicator, DType, ReduceOp};
use crate::config::DeviceKind;
use crate::device::gemm::{Gemm, GemmInput, Operand};
use crate::device::{bind_cpu_threads, Device};
use crate::error::{Error, Result};

/// What to measure and where to write it.
#[derive(Debug, Clone)]
pub struct Options {
    /// Profile name.
    pub name: String,
    /// Device arm measured.
    pub device: DeviceKind,
    /// Where rank 0 writes the profile.
    pub out: PathBuf,
    /// Largest all-reduce, bytes.
    pub max_bytes: usize,
    /// Device memory (GB), required for GPUs.
    pub memory_gb: Option<f64>,
}

/// GEMM shapes measured: rows of a micro-batch by the widths of small and medium blocks.
const SHAPES: &[(usize, usize, usize)] = &[
    (256, 256, 256),
    (1024, 256, 256),
    (1024, 768, 256),
    (1024, 256, 768),
    (1024, 768, 768),
    (2048, 2304, 768),
    (2048, 768, 3072),
    (2048, 3072, 768),
    (4096, 1024, 1024),
    (4096, 4096, 1024),
];

/// The slowest rank's value of `x`.
fn slowest(comm: &Communicator, x: f64) -> Result<f64> {
    let mut v = [x];
    comm.all_reduce(&mut v, ReduceOp::Max)?;
    Ok(v[0])
}

fn gemm_points(comm: &Communicator, dev: &Device, bf16: bool) -> Result<Vec<GemmPoint>> {
    let gemm = Gemm::new(dev)?;
    let input = if bf16 {
        GemmInput::Bf16
    } else {
        GemmInput::F32
    };
    let size = if bf16 { 2 } else { 4 };
    let mut out = Vec::new();
    for &(m, n, k) in SHAPES {
        let a = dev.alloc(m * k * size)?;
        let b = dev.alloc(k * n * size)?;
        let mut c = dev.alloc(m * n * 4)?;
        let mut best = f64::MAX;
        for rep in 0..4 {
            comm.barrier()?;
            let t = Instant::now();
            gemm.matmul(
                dev,
                &mut c,
                Operand::plain(&a, input),
                Operand::plain(&b, input),
                m,
                n,
                k,
                false,
            )?;
            dev.synchronize()?;
            if rep > 0 {
                best = best.min(t.elapsed().as_secs_f64());
            }
        }
        let s = slowest(comm, best)?;
        out.push(GemmPoint {
            m,
            n,
            k,
            tflops: 2.0 * (m * n * k) as f64 / s / 1e12,
        });
    }
    Ok(out)
}

fn bandwidth(comm: &Communicator, dev: &Device) -> Result<f64> {
    let bytes = 128 << 20;
    let src = dev.alloc(bytes)?;
    let mut dst = dev.alloc(bytes)?;
    let mut best = f64::MAX;
    for rep in 0..5 {
        comm.barrier()?;
        let t = Instant::now();
        dev.copy_on_device(&mut dst, &src)?;
        dev.synchronize()?;
        if rep > 0 {
            best = best.min(t.elapsed().as_secs_f64());
        }
    }
    Ok(2.0 * bytes as f64 / slowest(comm, best)?)
}

/// Least-squares fit of the ring all-reduce model: (alpha seconds, bandwidth bytes/s).
pub fn fit_ring(g: usize, points: &[(f64, f64)]) -> Result<(f64, f64)> {
    let n = points.len() as f64;
    let (sx, sy) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let sxx: f64 = points.iter().map(|(x, _)| (x - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    let slope = sxy / sxx;
    let intercept = my - slope * mx;
    if !(slope.is_finite() && slope > 0.0) {
        return Err(Error::Check(format!(
            "calibrate: all_reduce times do not grow with size (slope {slope:e} s/byte)"
        )));
    }
    let g = g as f64;
    let alpha = (intercept / (2.0 * (g - 1.0))).max(1e-7);
    Ok((alpha, 2.0 * (g - 1.0) / g / slope))
}

fn links(comm: &Communicator, max_bytes: usize) -> Result<(f64, f64)> {
    let b = CollBench {
        colls: vec!["all_reduce".into()],
        min_bytes: 8 << 10,
        max_bytes,
        factor: 4,
        dtype: DType::F32,
        op: ReduceOp::Sum,
        warmup: 2,
        iters: 5,
        inplace: true,
        vs_mpi: false,
        csv: true,
    };
    let rows = collectives::run(comm, None, &b, |_| {})?;
    let points: Vec<(f64, f64)> = rows
        .iter()
        .map(|r| (r.bytes as f64, r.time_us * 1e-6))
        .collect();
    fit_ring(comm.size(), &points)
}

/// Measures this node on `world` and writes the profile (rank 0); returns it on every rank.
pub fn calibrate(world: &World, o: &Options) -> Result<Profile> {
    if world.size < 2 {
        return Err(Error::config("ranks", "calibrate measures the links between ranks: start it with at least 2 (mpirun -n 2 ...)"));
    }
    if world.nodes.iter().any(|&n| n != 0) {
        return Err(Error::config(
            "ranks",
            "calibrate measures one node: start it with the ranks of one node",
        ));
    }
    let gpu = o.device != DeviceKind::Cpu;
    let per_device_gb = match (gpu, o.memory_gb) {
        (_, Some(g)) => g,
        (false, None) => {
            crate::train::available_bytes().unwrap_or(0) as f64 / 1e9 / world.local_size as f64
        }
        (true, None) => {
            return Err(Error::config(
                "--memory-gb",
                "is required with a GPU device (memory per device, GB)",
            ))
        }
    };
    if o.device == DeviceKind::Cpu {
        bind_cpu_threads(0, world.local_size)?;
    }
    let comm = world.communicator()?;
    let dev = Device::open(o.device, world.local_rank)?;
    let gemms = gemm_points(&comm, &dev, gpu)?;
    let bw = bandwidth(&comm, &dev)?;
    let (alpha, link_bw) = links(&comm, o.max_bytes)?;
    let best = gemms.iter().map(|g| g.tflops).fold(0.0, f64::max);
    let precision = if gpu { "bf16" } else { "fp32" };
    let reserved_gb = crate::memory::rss_bytes().unwrap_or(0) as f64 / 1e9;
    let profile = Profile {
        name: o.name.clone(),
        description: format!(
            "measured by `meshtrain plan calibrate` with {} {} ranks on one node (inter-node links not measured: copied from intra)",
            world.size,
            format!("{:?}", o.device).to_ascii_lowercase()
        ),
        device: format!("{:?}", o.device).to_ascii_lowercase(),
        devices_per_node: world.local_size,
        compute: Compute {
            peak_tflops: [(precision.to_string(), best)].into_iter().collect(),
            gemm: GemmCurve { max_efficiency: 1.0, half_dim: 64.0 },
            measured: gemms,
        },
        memory: Memory { per_device_gb, bandwidth_gbs: bw / 1e9, reserved_gb },
        intra: Intra { topology: "measured".into(), bandwidth_gbs: link_bw / 1e9, pair_bandwidth_gbs: None, latency_us: alpha * 1e6, achievable: 1.0 },
        inter: Inter { nics_per_node: 1, nic_bandwidth_gbs: link_bw / 1e9, latency_us: alpha * 1e6, achievable: 1.0 },
    };
    if world.rank == 0 {
        let text = profile.to_toml()?;
        let checked = Profile::parse(&text, &o.out.display().to_string())?;
        std::fs::write(&o.out, &text)
            .map_err(|e| Error::file(&o.out, None, format!("cannot write the profile: {e}")))?;
        println!(
            "# wrote {}: peak {:.3} TFLOP/s ({precision}, best GEMM), memory {:.1} GB/s, all_reduce alpha {:.1} us, bandwidth {:.2} GB/s",
            o.out.display(),
            best,
            checked.memory.bandwidth_gbs,
            alpha * 1e6,
            link_bw / 1e9
        );
    }
    Ok(profile)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_fit_recovers_alpha_and_bandwidth() {
        let (g, alpha, bw) = (4usize, 20e-6, 5e9);
        let t = |s: f64| 2.0 * 3.0 * alpha + 2.0 * 3.0 / 4.0 * s / bw;
        let points: Vec<(f64, f64)> = [8e3, 32e3, 128e3, 512e3, 2e6, 8e6]
            .iter()
            .map(|&s| (s, t(s)))
            .collect();
        let (a, b) = fit_ring(g, &points).unwrap();
        assert!(
            (a - alpha).abs() / alpha < 1e-6 && (b - bw).abs() / bw < 1e-6,
            "{a} {b}"
        );
        let flat: Vec<(f64, f64)> = points.iter().map(|&(s, _)| (s, 1e-3)).collect();
        assert!(fit_ring(g, &flat).is_err());
    }
}
