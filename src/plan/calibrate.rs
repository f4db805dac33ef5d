//! `meshtrain plan calibrate`: a profile of this machine from measurements, so that the planner's
//! predictions here rest on what this node does, not on a datasheet.
//!
//! Started like training (one process per device under mpirun or srun), on one node or on several
//! with the same number of ranks each. A rank's own speed is measured by rank 0 alone while the
//! others wait (asleep in a barrier), and how much of that speed survives when every rank of the
//! node computes at once is measured separately: on a node whose ranks share fewer cores than
//! there are ranks, a rank measured while the others also compute sees anything between its whole
//! core (a short kernel that runs while the others are descheduled) and its share of one (a long
//! one), and a table mixing both predicts neither.
//! - GEMMs of a grid of shapes (`(m, n, k)` from the widths meshtrain's blocks multiply), through
//!   the device arm's own GEMM (`device::gemm`), median of a few runs on rank 0 alone: the
//!   profile's `compute.measured` table, and the best of them as the peak;
//! - memory bandwidth: a device-to-device copy (bytes read plus written per second), rank 0 alone;
//! - sharing: a GEMM loop of ~0.15 s timed on rank 0 alone, then on every rank of the node at once;
//!   `ranks / slowdown` (at most `ranks`) is the profile's `cores_per_node`, by which the planner
//!   slows every rank's compute when more ranks than that share a node;
//! - collectives: `all_reduce`, `all_gather` and `reduce_scatter` from 8 KiB up, through the same
//!   code as `meshtrain bench`, once per schedule (`ring`, `direct`: a communicator each with the
//!   schedule forced), on the ranks of rank 0's node (tier `intra`), or read from `meshtrain bench
//!   --csv` files given with `--bench-csv ALGO=FILE`; with several nodes, again between the first
//!   rank of every node (tier `inter`). Each (collective, schedule, tier) is fitted by `collfit`
//!   (the profile's `collectives`); the ring all-reduce fit of each tier is also written as its
//!   link (`intra`, `inter`: `latency_us` per ring step, bandwidth);
//! - a training step: `train::StepHarness` (the trainer's own step, rank 0 alone) at the tiny
//!   model's width with 2 and 6 blocks; what the planner's terms leave of the measured median is
//!   fitted as a cost per block and micro-batch plus one per step (the profile's `overhead`), so
//!   small models, whose step is mostly launches and hand-offs, are predicted too.
//!
//! On one node the inter-node tier is copied from the intra-node one, and the profile's
//! description says so. Memory per device is the node's `MemAvailable` split over its ranks on
//! the CPU arm; GPUs need `--memory-gb`. Invariant: a failure on any rank fails every rank (no
//! rank waits forever for one that gave up), and only rank 0 writes.

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

/// Times `f` on this rank when `active` (zero elsewhere) and hands every rank the active ranks'
/// slowest time; an error on any rank fails every rank (no rank is left waiting).
fn timed(comm: &Communicator, active: bool, f: impl FnOnce() -> Result<f64>) -> Result<f64> {
    let r = if active { f() } else { Ok(0.0) };
    let t = agree(comm, r)?;
    slowest(comm, t)
}

/// `r` on every rank if every rank's is `Ok`, else an error on every rank (each failing rank keeps
/// its own message).
fn agree<T>(comm: &Communicator, r: Result<T>) -> Result<T> {
    let mut failed = [u8::from(r.is_err())];
    comm.all_reduce(&mut failed, ReduceOp::Max)?;
    match (r, failed[0]) {
        (Err(e), _) => Err(e),
        (Ok(_), 1) => Err(Error::Check(
            "calibrate: another rank failed (see its message)".into(),
        )),
        (Ok(v), _) => Ok(v),
    }
}

/// The GEMM table, measured by rank 0 alone (every other rank waits): a rank's unshared rate,
/// which the planner slows by the node's sharing (`cores_per_node`).
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
        let s = timed(comm, comm.rank() == 0, || {
            let a = dev.alloc(m * k * size)?;
            let b = dev.alloc(k * n * size)?;
            let mut c = dev.alloc(m * n * 4)?;
            let mut times = Vec::new();
            for rep in 0..=REPS {
                let t = Instant::now();
                let (x, y) = (Operand::plain(&a, input), Operand::plain(&b, input));
                gemm.matmul(dev, &mut c, x, y, m, n, k, false)?;
                dev.synchronize()?;
                if rep > 0 {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            Ok(median(times))
        })?;
        out.push(GemmPoint {
            m,
            n,
            k,
            tflops: 2.0 * (m * n * k) as f64 / s / 1e12,
        });
    }
    Ok(out)
}

/// Memory bandwidth (a device copy, bytes read plus written per second), rank 0 alone.
fn bandwidth(comm: &Communicator, dev: &Device) -> Result<f64> {
    let bytes = 128 << 20;
    let s = timed(comm, comm.rank() == 0, || {
        let src = dev.alloc(bytes)?;
        let mut dst = dev.alloc(bytes)?;
        let mut times = Vec::new();
        for rep in 0..=REPS {
            let t = Instant::now();
            dev.copy_on_device(&mut dst, &src)?;
            dev.synchronize()?;
            if rep > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        Ok(median(times))
    })?;
    Ok(2.0 * bytes as f64 / s)
}

/// Buffers of a (256, 256, 256) GEMM, run repeatedly to keep a rank busy.
struct GemmWork<'a> {
    dev: &'a Device,
    gemm: Gemm,
    bufs: [crate::device::DeviceBuffer; 3],
}

impl<'a> GemmWork<'a> {
    const N: usize = 256;

    fn new(dev: &'a Device) -> Result<GemmWork<'a>> {
        let bytes = Self::N * Self::N * 4;
        Ok(GemmWork {
            dev,
            gemm: Gemm::new(dev)?,
            bufs: [dev.alloc(bytes)?, dev.alloc(bytes)?, dev.alloc(bytes)?],
        })
    }

    /// Runs `reps` GEMMs and waits for them.
    fn run(&mut self, reps: usize) -> Result<()> {
        let [a, b, c] = &mut self.bufs;
        let (x, y) = (
            Operand::plain(a, GemmInput::F32),
            Operand::plain(b, GemmInput::F32),
        );
        for _ in 0..reps {
            self.gemm
                .matmul(self.dev, c, x, y, Self::N, Self::N, Self::N, false)?;
        }
        self.dev.synchronize()
    }

    /// Seconds of [`GemmWork::run`].
    fn time(&mut self, reps: usize) -> Result<f64> {
        let t = Instant::now();
        self.run(reps)?;
        Ok(t.elapsed().as_secs_f64())
    }
}

/// Seconds of `reps` (256, 256, 256) GEMMs on this rank (after one untimed).
fn gemm_loop(dev: &Device, reps: usize) -> Result<f64> {
    let mut w = GemmWork::new(dev)?;
    w.run(1)?;
    w.time(reps)
}

/// GEMM work of this long (seconds, one rank alone) per sharing measurement.
const SHARE_WORK_S: f64 = 0.15;

/// How many ranks of the node compute at full speed at once: rank 0 times a GEMM loop of about
/// [`SHARE_WORK_S`] alone, then every rank of the node (`home`) runs the same loop at once, three
/// rounds alternating; with `slowdown` the median of the slowest rank's times over the median of
/// the lone ones, the node computes like `ranks / slowdown` unshared ranks (at most `ranks`).
fn node_cores(comm: &Communicator, dev: &Device, home: bool, ranks: usize) -> Result<f64> {
    let one = timed(comm, comm.rank() == 0, || gemm_loop(dev, 1))?;
    let reps = (SHARE_WORK_S / one).ceil().clamp(1.0, 1e6) as usize;
    let (mut alone, mut together) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        alone.push(timed(comm, comm.rank() == 0, || gemm_loop(dev, reps))?);
        together.push(timed(comm, home, || gemm_loop(dev, reps))?);
    }
    let slowdown = (median(together) / median(alone)).max(1.0);
    Ok((ranks as f64 / slowdown).min(ranks as f64))
}

/// The collectives a calibration fits.
const COLLS: [&str; 3] = ["all_reduce", "all_gather", "reduce_scatter"];

/// Measures every collective of [`COLLS`] under each schedule (a communicator with it forced) on
/// the ranks of `world` that pass `member` (the others wait); the samples on those ranks, none
/// elsewhere.
fn measure_collectives(world: &World, max_bytes: usize, member: bool) -> Result<Vec<Sample>> {
    let mut samples = Vec::new();
    for (name, algo) in [("ring", Algo::Ring), ("direct", Algo::Direct)] {
        let cfg = CommConfig {
            algo,
            ..world.comm_config().clone()
        };
        let all = world.communicator_with(cfg)?;
        let group = all.split(member.then_some(0), world.rank as i64)?;
        let measured = match &group {
            Some(comm) => bench_all(comm, name, max_bytes),
            None => Ok(Vec::new()),
        };
        samples.extend(agree(&all, measured)?);
    }
    Ok(samples)
}

/// [`COLLS`] from 8 KiB to `max_bytes` on `comm` under schedule `name`, through `meshtrain bench`.
fn bench_all(comm: &Communicator, name: &str, max_bytes: usize) -> Result<Vec<Sample>> {
    let b = CollBench {
        colls: COLLS.iter().map(|c| c.to_string()).collect(),
        min_bytes: 8 << 10,
        max_bytes,
        factor: 4,
        dtype: DType::F32,
        op: ReduceOp::Sum,
        warmup: 2,
        iters: 5,
        iter_bytes: 0,
        inplace: true,
        vs_mpi: false,
        csv: true,
        exact_count: false,
    };
    Ok(collectives::run(comm, None, &b, |_| {})?
        .into_iter()
        .map(|r| Sample {
            coll: r.coll.clone(),
            algo: name.into(),
            bytes: r.bytes as f64,
            seconds: r.time_us * 1e-6,
            ranks: comm.size(),
        })
        .collect())
}

/// The intra-node fits: from the given bench files (every rank reads them), else measured on the
/// ranks of rank 0's node (`home`; the other ranks get none).
fn intra_fits(world: &World, comm: &Communicator, o: &Options, home: bool) -> Result<Vec<CollFit>> {
    if o.bench_csv.is_empty() {
        let samples = measure_collectives(world, o.max_bytes, home)?;
        let fits = collfit::fit_all(&samples, "intra")
            .and_then(|f| with_all_reduce(f, home, "--max-bytes"));
        return agree(comm, fits);
    }
    let ranks = o.bench_ranks.unwrap_or(world.local_size);
    let mut all = Vec::new();
    for (algo, file) in &o.bench_csv {
        all.extend(collfit::read_bench_csv(file, algo, ranks)?);
    }
    with_all_reduce(collfit::fit_all(&all, "intra")?, true, "--bench-csv")
}

/// The inter-node fits: measured between the first ranks of every node (one rank per node, so
/// a node's network as one rank sees it; the other ranks get none); none on one node.
fn inter_fits(
    world: &World,
    comm: &Communicator,
    o: &Options,
    nodes: usize,
) -> Result<Vec<CollFit>> {
    if nodes < 2 {
        return Ok(Vec::new());
    }
    let member = world.local_rank == 0;
    let samples = measure_collectives(world, o.max_bytes, member)?;
    let fits =
        collfit::fit_all(&samples, "inter").and_then(|f| with_all_reduce(f, member, "--max-bytes"));
    agree(comm, fits)
}

/// `fits`, which must hold an all-reduce fit where they were measured (`member`); the error names
/// `key`, the option that gives more sizes.
fn with_all_reduce(fits: Vec<CollFit>, member: bool, key: &str) -> Result<Vec<CollFit>> {
    if member && !fits.iter().any(|f| f.coll == "all_reduce") {
        return Err(Error::config(
            key,
            "no all_reduce with three or more sizes to fit (measure or bench over a larger size range)",
        ));
    }
    Ok(fits)
}

/// The intra-node link of the ring model from the fits: per-step latency and bus bandwidth of the
/// ring all-reduce (of any all-reduce fit when no ring was measured).
fn ring_link(fits: &[CollFit], tier: &str) -> Option<(f64, f64)> {
    let f = fits
        .iter()
        .filter(|f| f.coll == "all_reduce" && f.tier == tier)
        .min_by_key(|f| f.algo != "ring")?;
    let steps = 2.0 * (f.ranks as f64 - 1.0);
    Some((f.latency_us / steps, f.busbw_gbs))
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

/// Times the trainer's step on rank 0 alone (the others wait) at each of [`STEP_DEPTHS`] and fits
/// what `profile` (without overhead) does not predict; the overhead on rank 0, `None` elsewhere.
fn step_overhead(comm: &Communicator, o: &Options, profile: &Profile) -> Result<Option<Overhead>> {
    let own = comm.split((comm.rank() == 0).then_some(0), 0)?;
    let measured = match &own {
        Some(c) => harness_overhead(c, o, profile).map(Some),
        None => Ok(None),
    };
    agree(comm, measured)
}

/// [`step_overhead`] on the one-rank communicator `own`.
fn harness_overhead(own: &Communicator, o: &Options, profile: &Profile) -> Result<Overhead> {
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
            llama: None,
        };
        let dev = Device::open(o.device, 0)?;
        let mut h = StepHarness::new(own, config, (b, t), (dev, precision), 1)?;
        let mut times = Vec::new();
        for i in 0..STEP_REPS + 2 {
            let r = h.step(1e-4, 1.0)?;
            if i >= 2 {
                times.push(r.seconds);
            }
        }
        h.finish()?;
        rows.push((
            depth,
            median(times),
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
            "train::StepHarness, width 64, seq {t}, micro-batch {b}, one rank alone: {d0} blocks measured {:.2} ms \
             (model without overhead {:.2} ms), {d1} blocks {:.2} ms ({:.2} ms)",
            m0 * 1e3,
            p0 * 1e3,
            m1 * 1e3,
            p1 * 1e3
        ),
    })
}

/// Node indices of `world` and how many: every node must hold the same number of ranks (the
/// profile describes one node).
fn node_count(world: &World) -> Result<usize> {
    let nodes = world.nodes.iter().max().map_or(1, |&n| n + 1);
    for n in 0..nodes {
        let here = world.nodes.iter().filter(|&&x| x == n).count();
        if here != world.local_size {
            return Err(Error::config(
                "ranks",
                format!(
                    "calibrate needs the same number of ranks on every node: node {n} has {here}, this rank's node {}",
                    world.local_size
                ),
            ));
        }
    }
    Ok(nodes)
}

/// Measures this node (rank 0's; with ranks on several nodes, also the links between nodes) on
/// `world` and writes the profile; returns it on rank 0, `None` elsewhere.
pub fn calibrate(world: &World, o: &Options) -> Result<Option<Profile>> {
    let nodes = node_count(world)?;
    if world.local_size < 2 {
        return Err(Error::config("ranks", "calibrate measures the links between the ranks of a node: start it with at least 2 per node (mpirun -n 2 ...)"));
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
    let home = world.nodes[world.rank] == world.nodes[0];
    let dev = Device::open(o.device, world.local_rank)?;
    let gemms = gemm_points(&comm, &dev, gpu)?;
    let bw = bandwidth(&comm, &dev)?;
    let cores = node_cores(&comm, &dev, home, world.local_size)?;
    let mut fits = intra_fits(world, &comm, o, home)?;
    fits.extend(inter_fits(world, &comm, o, nodes)?);
    let precision = if gpu { "bf16" } else { "fp32" };
    let mut profile = assemble(world, o, nodes, (gemms, bw, cores), fits, per_device_gb);
    let Some(overhead) = step_overhead(&comm, o, &profile)? else {
        return Ok(None);
    };
    profile.overhead = overhead;
    write_profile(&profile, o, precision)?;
    Ok(Some(profile))
}

/// The profile of the measurements (on rank 0, which holds every fit).
fn assemble(
    world: &World,
    o: &Options,
    nodes: usize,
    (gemms, bw, cores): (Vec<GemmPoint>, f64, f64),
    fits: Vec<CollFit>,
    per_device_gb: f64,
) -> Profile {
    let gpu = o.device != DeviceKind::Cpu;
    let (latency_us, link_gbs) = ring_link(&fits, "intra").unwrap_or((1.0, 1.0));
    let measured_inter = ring_link(&fits, "inter");
    let (inter_us, inter_gbs) = measured_inter.unwrap_or((latency_us, link_gbs));
    let best = gemms.iter().map(|g| g.tflops).fold(0.0, f64::max);
    let precision = if gpu { "bf16" } else { "fp32" };
    let device = format!("{:?}", o.device).to_ascii_lowercase();
    let inter_note = if measured_inter.is_some() {
        format!("inter-node links measured between {nodes} nodes, one rank each")
    } else {
        "inter-node links not measured (one node): copied from the intra-node ring all-reduce fit"
            .to_string()
    };
    Profile {
        name: o.name.clone(),
        description: format!(
            "measured by `meshtrain plan calibrate` with {} {device} ranks per node; {inter_note}",
            world.local_size,
        ),
        device,
        devices_per_node: world.local_size,
        cores_per_node: Some(cores),
        compute: Compute {
            peak_tflops: [(precision.to_string(), best)].into_iter().collect(),
            gemm: GemmCurve {
                max_efficiency: 1.0,
                half_dim: 64.0,
            },
            measured: gemms,
        },
        memory: Memory {
            per_device_gb,
            bandwidth_gbs: bw / 1e9,
            reserved_gb: crate::memory::rss_bytes().unwrap_or(0) as f64 / 1e9,
        },
        intra: Intra {
            topology: "measured".into(),
            bandwidth_gbs: link_gbs,
            pair_bandwidth_gbs: None,
            latency_us,
            achievable: 1.0,
        },
        inter: Inter {
            nics_per_node: 1,
            nic_bandwidth_gbs: inter_gbs,
            latency_us: inter_us,
            achievable: 1.0,
        },
        collectives: fits,
        overhead: Overhead::default(),
    }
}

/// Writes `profile` to `o.out` (checked by parsing it back) and prints a summary.
fn write_profile(profile: &Profile, o: &Options, precision: &str) -> Result<()> {
    let text = profile.to_toml()?;
    Profile::parse(&text, &o.out.display().to_string())?;
    std::fs::write(&o.out, &text)
        .map_err(|e| Error::file(&o.out, None, format!("cannot write the profile: {e}")))?;
    let peak = profile.compute.peak_tflops[precision];
    println!(
        "# wrote {}: peak {peak:.3} TFLOP/s ({precision}, best GEMM, one rank alone), {:.2} of {} ranks compute at once, \
         memory {:.1} GB/s, ring step {:.1} us, {:.2} GB/s; inter-node ring step {:.1} us, {:.2} GB/s",
        o.out.display(),
        profile.cores_per_node.unwrap_or(profile.devices_per_node as f64),
        profile.devices_per_node,
        profile.memory.bandwidth_gbs,
        profile.intra.latency_us,
        profile.intra.bandwidth_gbs,
        profile.inter.latency_us,
        profile.inter.nic_bandwidth_gbs
    );
    for f in &profile.collectives {
        println!(
            "#   {:<14} {:<6} {:<5} {} ranks: latency {:>8.1} us, bus {:>6.2} GB/s ({} sizes, worst {:.0}%)",
            f.coll, f.algo, f.tier, f.ranks, f.latency_us, f.busbw_gbs, f.points, f.max_error_pct
        );
    }
    println!(
        "#   overhead: {:.3} ms per block and micro-batch, {:.3} ms per step ({})",
        profile.overhead.block_ms, profile.overhead.step_ms, profile.overhead.source
    );
    Ok(())
}
