//! `meshtrain plan calibrate`: a profile of this machine from measurements, so that the planner's
//! predictions here rest on what this node does, not on a datasheet.
//!
//! Started like training (one process per device under mpirun or srun, on one node), every rank
//! measures at once, so each sees the share of the node it will have when training:
//! - GEMMs of a grid of shapes (`(m, n, k)` from the widths meshtrain's blocks multiply), through
//!   the device arm's own GEMM (`device::gemm`), median of a few runs, the slowest rank's: the
//!   profile's `compute.measured` table, and the best of them as the peak;
//! - memory bandwidth: a device-to-device copy (bytes read plus written per second);
//! - collectives: `all_reduce`, `all_gather` and `reduce_scatter` from 8 KiB up, through the same
//!   code as `meshtrain bench`, once per schedule (`ring`, `direct`: a communicator each with the
//!   schedule forced), or read from `meshtrain bench --csv` files given with `--bench-csv
//!   ALGO=FILE`; each (collective, schedule) fitted by `collfit` (the profile's `collectives`), the
//!   ring all-reduce fit also written as the `intra` link (`latency_us` per ring step, bandwidth);
//! - a training step: `train::StepHarness` (the trainer's own step on one rank, every rank at
//!   once) at the tiny model's width with 2 and 6 blocks; what the planner's terms leave of the
//!   measured median is fitted as a cost per block and micro-batch plus one per step (the
//!   profile's `overhead`), so small models, whose step is mostly launches and hand-offs, are
//!   predicted too.
//!
//! One node is measured: the inter-node tier is copied from the intra-node one, and the
//! profile's description and `overhead.source` say so. Memory per device is the node's
//! `MemAvailable` split over its ranks on the CPU arm; GPUs need `--memory-gb`.

use std::path::PathBuf;
use std::time::Instant;

use super::collfit::{self, Sample};
use super::cost::{self, Machine};
use super::profile::{
    CollFit, Compute, GemmCurve, GemmPoint, Inter, Intra, Memory, Overhead, Profile,
};
use super::{Job, Layout, Recompute, Stack};
use crate::bench::collectives::{self, CollBench};
use crate::comm::{Algo, CommConfig, Communicator, DType, ReduceOp};
use crate::config::DeviceKind;
use crate::device::gemm::{Gemm, GemmInput, Operand};
use crate::device::{bind_cpu_threads, Device, Precision};
use crate::error::{Error, Result};
use crate::model::GptConfig;
use crate::train::StepHarness;
use crate::world::World;

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
    /// `meshtrain bench --csv` files to fit instead of measuring: (schedule, file).
    pub bench_csv: Vec<(String, PathBuf)>,
    /// Ranks the bench files were measured on (default: this run's).
    pub bench_ranks: Option<usize>,
}

/// GEMM shapes measured: rows of a micro-batch by the widths of small and medium blocks.
const SHAPES: &[(usize, usize, usize)] = &[
    (64, 64, 64),
    (64, 256, 64),
    (256, 64, 256),
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

/// Timed repetitions of each measurement, after one untimed.
const REPS: usize = 7;

/// The median of `v` (not empty): measurements are medians, as the sweep and `tune` summarize
/// the steps they compare with (a best-of would predict the quietest moment of a shared node).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

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
        let mut times = Vec::new();
        for rep in 0..=REPS {
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
                times.push(t.elapsed().as_secs_f64());
            }
        }
        let s = slowest(comm, median(times))?;
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
    let mut times = Vec::new();
    for rep in 0..=REPS {
        comm.barrier()?;
        let t = Instant::now();
        dev.copy_on_device(&mut dst, &src)?;
        dev.synchronize()?;
        if rep > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(2.0 * bytes as f64 / slowest(comm, median(times))?)
}

/// The collectives a calibration fits.
const COLLS: [&str; 3] = ["all_reduce", "all_gather", "reduce_scatter"];

/// Measures every collective of [`COLLS`] under each schedule (a communicator with it forced).
fn measure_collectives(world: &World, max_bytes: usize) -> Result<Vec<Sample>> {
    let mut samples = Vec::new();
    for (name, algo) in [("ring", Algo::Ring), ("direct", Algo::Direct)] {
        let cfg = CommConfig {
            algo,
            ..world.comm_config().clone()
        };
        let comm = world.communicator_with(cfg)?;
        let b = CollBench {
            colls: COLLS.iter().map(|c| c.to_string()).collect(),
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
        for r in collectives::run(&comm, None, &b, |_| {})? {
            samples.push(Sample {
                coll: r.coll.clone(),
                algo: name.into(),
                bytes: r.bytes as f64,
                seconds: r.time_us * 1e-6,
                ranks: comm.size(),
            });
        }
    }
    Ok(samples)
}

/// The collective fits: from the given bench files, else measured here.
fn collective_fits(world: &World, o: &Options) -> Result<Vec<CollFit>> {
    let samples = if o.bench_csv.is_empty() {
        measure_collectives(world, o.max_bytes)?
    } else {
        let ranks = o.bench_ranks.unwrap_or(world.size);
        let mut all = Vec::new();
        for (algo, file) in &o.bench_csv {
            all.extend(collfit::read_bench_csv(file, algo, ranks)?);
        }
        all
    };
    let fits = collfit::fit_all(&samples, "intra")?;
    if !fits.iter().any(|f| f.coll == "all_reduce") {
        return Err(Error::config(
            "--bench-csv",
            "no all_reduce with three or more sizes to fit (run `meshtrain bench --csv` over a size range)",
        ));
    }
    Ok(fits)
}

/// The intra-node link of the ring model from the fits: per-step latency and bus bandwidth of the
/// ring all-reduce (of any all-reduce fit when no ring was measured).
fn ring_link(fits: &[CollFit]) -> (f64, f64) {
    let f = fits
        .iter()
        .filter(|f| f.coll == "all_reduce")
        .min_by_key(|f| f.algo != "ring")
        .expect("collective_fits keeps an all_reduce fit");
    let steps = 2.0 * (f.ranks as f64 - 1.0);
    (f.latency_us / steps, f.busbw_gbs)
}

/// Block counts the step is measured at (the tiny model's width and sequence).
const STEP_DEPTHS: [usize; 2] = [2, 6];
/// Steps timed per depth after two warm-up steps.
const STEP_REPS: usize = 9;

/// The planner's step time of a one-rank, one-micro-batch job of `config` on `profile`.
fn predicted_step(
    config: &GptConfig,
    (b, t): (usize, usize),
    profile: &Profile,
    precision: &str,
) -> Result<f64> {
    let job = Job::new("calibrate", config, 1, b, t)?;
    let mach = Machine::new(profile, Stack::Meshtrain, precision)?;
    let l = Layout {
        tp: 1,
        pp: 1,
        virtual_stages: 1,
        dp: 1,
        zero: 0,
        micro_batch: b,
        grad_accum: 1,
        sp: false,
        recompute: Recompute::None,
    };
    Ok(cost::estimate(&job, &l, &mach, &[config.n_layer]).step_s)
}

/// Times the trainer's step (every rank its own one-rank job, at once) at each of
/// [`STEP_DEPTHS`] and fits what `profile` (without overhead) does not predict.
fn step_overhead(
    world: &World,
    comm: &Communicator,
    o: &Options,
    profile: &Profile,
) -> Result<Overhead> {
    let own = comm
        .split(Some(comm.rank() as u32), 0)?
        .ok_or_else(|| Error::Check("calibrate: no one-rank communicator for the step".into()))?;
    let (precision, name) = match o.device {
        DeviceKind::Cpu => (Precision::Fp32, "fp32"),
        _ => (Precision::Bf16, "bf16"),
    };
    let (b, t) = (1, 64);
    let mut rows = Vec::new();
    for depth in STEP_DEPTHS {
        let config = GptConfig {
            n_layer: depth,
            n_head: 4,
            n_embd: 64,
            vocab_size: 256,
            max_seq_len: t,
        };
        let dev = Device::open(o.device, world.local_rank)?;
        let mut h = StepHarness::new(&own, config, (b, t), (dev, precision), 1)?;
        let mut times = Vec::new();
        for i in 0..STEP_REPS + 2 {
            comm.barrier()?;
            let r = h.step(1e-4, 1.0)?;
            if i >= 2 {
                times.push(r.seconds);
            }
        }
        h.finish()?;
        let measured = slowest(comm, median(times))?;
        rows.push((
            depth,
            measured,
            predicted_step(&config, (b, t), profile, name)?,
        ));
    }
    let [(d0, m0, p0), (d1, m1, p1)] = [rows[0], rows[1]];
    let block = (((m1 - p1) - (m0 - p0)) / (d1 - d0) as f64).max(0.0);
    let step = ((m0 - p0) - block * d0 as f64).max(0.0);
    Ok(Overhead {
        block_ms: block * 1e3,
        step_ms: step * 1e3,
        source: format!(
            "train::StepHarness, width 64, seq {t}, micro-batch {b}, {} ranks at once: {d0} blocks measured {:.2} ms \
             (model without overhead {:.2} ms), {d1} blocks {:.2} ms ({:.2} ms)",
            world.size,
            m0 * 1e3,
            p0 * 1e3,
            m1 * 1e3,
            p1 * 1e3
        ),
    })
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
    let fits = collective_fits(world, o)?;
    let (latency_us, link_gbs) = ring_link(&fits);
    let best = gemms.iter().map(|g| g.tflops).fold(0.0, f64::max);
    let precision = if gpu { "bf16" } else { "fp32" };
    let reserved_gb = crate::memory::rss_bytes().unwrap_or(0) as f64 / 1e9;
    let device = format!("{:?}", o.device).to_ascii_lowercase();
    let mut profile = Profile {
        name: o.name.clone(),
        description: format!(
            "measured by `meshtrain plan calibrate` with {} {device} ranks on one node; inter-node links not \
             measured: copied from the intra-node ring all-reduce fit",
            world.size,
        ),
        device,
        devices_per_node: world.local_size,
        compute: Compute {
            peak_tflops: [(precision.to_string(), best)].into_iter().collect(),
            gemm: GemmCurve { max_efficiency: 1.0, half_dim: 64.0 },
            measured: gemms,
        },
        memory: Memory { per_device_gb, bandwidth_gbs: bw / 1e9, reserved_gb },
        intra: Intra { topology: "measured".into(), bandwidth_gbs: link_gbs, pair_bandwidth_gbs: None, latency_us, achievable: 1.0 },
        inter: Inter { nics_per_node: 1, nic_bandwidth_gbs: link_gbs, latency_us, achievable: 1.0 },
        collectives: fits,
        overhead: Overhead::default(),
    };
    profile.overhead = step_overhead(world, &comm, o, &profile)?;
    if world.rank == 0 {
        write_profile(&profile, o, precision)?;
    }
    Ok(profile)
}

/// Writes `profile` to `o.out` (checked by parsing it back) and prints a summary.
fn write_profile(profile: &Profile, o: &Options, precision: &str) -> Result<()> {
    let text = profile.to_toml()?;
    Profile::parse(&text, &o.out.display().to_string())?;
    std::fs::write(&o.out, &text)
        .map_err(|e| Error::file(&o.out, None, format!("cannot write the profile: {e}")))?;
    let peak = profile.compute.peak_tflops[precision];
    println!(
        "# wrote {}: peak {peak:.3} TFLOP/s ({precision}, best GEMM), memory {:.1} GB/s, ring step {:.1} us, {:.2} GB/s",
        o.out.display(),
        profile.memory.bandwidth_gbs,
        profile.intra.latency_us,
        profile.intra.bandwidth_gbs
    );
    for f in &profile.collectives {
        println!(
            "#   {:<14} {:<6} {} ranks: latency {:>8.1} us, bus {:>6.2} GB/s ({} sizes, worst {:.0}%)",
            f.coll, f.algo, f.ranks, f.latency_us, f.busbw_gbs, f.points, f.max_error_pct
        );
    }
    println!(
        "#   overhead: {:.3} ms per block and micro-batch, {:.3} ms per step ({})",
        profile.overhead.block_ms, profile.overhead.step_ms, profile.overhead.source
    );
    Ok(())
}
