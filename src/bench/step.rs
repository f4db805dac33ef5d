//! `meshtrain bench step`: one training step of the executor that trains (the shard executor
//! `DeviceGpt` holding the whole model, on the CPU arm by default, fp32 or bf16, with the device
//! optimizer step: forward + backward + gradient packing + global-norm clip + AdamW), built by
//! `train::StepHarness` exactly as `meshtrain train` builds a one-rank job, measured against the
//! GEMMs it is made of and against the memory it should need.
//!
//! Reported, for a model size at (B, T) (default d12, B=4, T=64):
//! - tokens/s and achieved GFLOP/s, with model FLOPs per token = 6·N + 12·L·C·T, where N counts
//!   every parameter except `wpe` (a lookup, no multiply; padded `wte` rows are counted because
//!   the logits GEMM computes them) and 12·L·C·T is attention's QKᵀ and AV in forward (4·L·C·T
//!   counting the full T×T score matrix, not just its causal half) times 3 for the backward;
//! - the GEMM rate of the step's own GEMM mix (CPU and emu arms, whose products are the CPU gemm
//!   timed here): each distinct (M, N, K, transposition) linear-layer GEMM the step performs is
//!   timed on its own, then weighted by how often the step calls it; the ratio step GFLOP/s ÷
//!   GEMM GFLOP/s says how much time goes to everything else (target ≥ 0.8). Each timed step
//!   is run once more right before a timing of the mix and the ratio taken per pair (the median
//!   and range reported), so a shared machine's drifting speed cancels out of it;
//! - how long the fastest step spent in its GEMMs (the CPU device counts the time of its products),
//!   next to the mix's time alone: in the step the GEMMs run with cold caches and woken BLAS
//!   threads, so the two differ, and the step minus its own GEMMs is what the other layers cost;
//! - what the optimizer's memory-bound passes over all N parameters cost on their own (CPU arm:
//!   the global norm's sum of squares of the gradients, and the AdamW update that zeroes each
//!   gradient as it reads it), timed like the GEMMs on scratch buffers of the model's size, so
//!   the time left besides the GEMMs splits into the optimizer and the other layers;
//! - peak resident memory (VmHWM) of the timed steps against what the step's objects hold
//!   ([`HeldBytes`]: the model's per-tensor parameters and gradients, the device step's AdamW
//!   moments, the step's bucket staging, activations and scratch, the CPU arm's bf16
//!   GEMM operand copies) plus the runtime baseline
//!   measured before the model exists (target ≤ 1.3x). The peak is reset once the step is built
//!   (where the kernel allows), so set-up transients are not counted; the GEMM timing runs after
//!   VmHWM is read, so its scratch buffers are not counted either.

use std::fmt;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::comm::Communicator;
use crate::config::{DeviceKind, Precision};
use crate::device::cpu::adamw::AdamWStep;
use crate::device::cpu::matmul::{matmul, Mat};
use crate::device::ops::{self, AdamWClearing};
use crate::device::{bind_cpu_threads, Device};
use crate::error::{Error, Result};
use crate::model::{GptConfig, ParamLayout};
use crate::optim::AdamWConfig;
use crate::train::{HeldBytes, StepHarness};

/// What to benchmark.
#[derive(Debug, Clone)]
pub struct StepBenchArgs {
    /// Named model size (see [`GptConfig::named`]).
    pub size: String,
    /// Micro-batch size B.
    pub batch: usize,
    /// Sequence length T.
    pub seq_len: usize,
    /// Untimed steps first.
    pub warmup: usize,
    /// Timed steps.
    pub steps: usize,
    /// Seed of the initialization and the random batch.
    pub seed: u64,
    /// The device arm the executor runs on.
    pub device: DeviceKind,
    /// Element type of the matrix products.
    pub precision: Precision,
    /// CPU threads (GEMMs and other layers) as `train.threads`: 0 = `OMP_NUM_THREADS`, else
    /// `OPENBLAS_NUM_THREADS`, else every core.
    pub threads: usize,
}

impl Default for StepBenchArgs {
    fn default() -> Self {
        StepBenchArgs {
            size: "d12".into(),
            batch: 4,
            seq_len: 64,
            warmup: 1,
            steps: 3,
            seed: 0,
            device: DeviceKind::Cpu,
            precision: Precision::Fp32,
            threads: 0,
        }
    }
}

/// Timing of one distinct GEMM of the step: `c(m, n) = a(m, k) · b(k, n)`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GemmTiming {
    /// Which product, e.g. `mlp.fc dW`.
    pub name: String,
    /// Rows of the result.
    pub m: usize,
    /// Columns of the result.
    pub n: usize,
    /// Inner dimension.
    pub k: usize,
    /// How many times one training step performs it.
    pub calls_per_step: usize,
    /// Measured seconds per call.
    pub seconds_per_call: f64,
    /// Measured rate.
    pub gflops: f64,
}

/// Result of [`run_step_bench`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepBenchReport {
    /// Model size name.
    pub size: String,
    /// Device arm and precision, e.g. `cpu fp32`.
    pub executor: String,
    /// CPU threads of the GEMMs and the other layers, and where the count came from.
    pub threads: String,
    /// The BLAS library and the kernels it runs.
    pub blas: String,
    /// Parameter count (flat buffer length, padded vocabulary included).
    pub params: usize,
    /// Micro-batch size B.
    pub batch: usize,
    /// Sequence length T.
    pub seq_len: usize,
    /// Timed steps.
    pub steps: usize,
    /// Fastest timed step: the rates below use it, like the GEMM timings use their fastest
    /// round, so that load from other processes on a shared machine does not skew the step/GEMM
    /// ratio.
    pub step_seconds: f64,
    /// Mean wall time of the timed steps.
    pub mean_step_seconds: f64,
    /// B·T / step_seconds.
    pub tokens_per_s: f64,
    /// 6·N + 12·L·C·T (see the module docs).
    pub flops_per_token: f64,
    /// Model FLOPs per second achieved by the step, in GFLOP/s.
    pub step_gflops: f64,
    /// Rate of the step's GEMM mix measured in isolation, in GFLOP/s (0: not timed, GPU arms).
    pub gemm_gflops: f64,
    /// Seconds the fastest timed step spent in the CPU device's GEMMs (0 on other arms).
    pub step_gemm_seconds: f64,
    /// The step's GFLOP/s over its GEMM mix's, each timed step paired with a timing of the mix
    /// right after it: the median pair (0: not timed).
    pub step_vs_gemm: f64,
    /// The lowest and highest pair.
    pub step_vs_gemm_range: (f64, f64),
    /// Peak resident set size (VmHWM) in bytes.
    pub peak_rss_bytes: u64,
    /// Whether the peak covers the timed steps only (`steps`) or the whole run (`run`).
    pub peak_covers: &'static str,
    /// Resident bytes before the model was built (binary, libraries, runtime).
    pub baseline_bytes: u64,
    /// What the step's objects hold, by term.
    pub held: HeldBytes,
    /// held.total() + baseline, in bytes.
    pub accounted_bytes: u64,
    /// peak_rss_bytes / accounted_bytes.
    pub memory_ratio: f64,
    /// Loss of every timed step.
    pub losses: Vec<f64>,
    /// The step's distinct GEMMs.
    pub gemms: Vec<GemmTiming>,
    /// Seconds of the optimizer's passes over all parameters, timed alone (CPU arm; None
    /// elsewhere).
    pub optimizer: Option<OptimizerTiming>,
}

/// The optimizer's memory-bound passes over the N parameters, each timed on its own.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct OptimizerTiming {
    /// The global norm's sum of squares of the gradients (reads N f32).
    pub norm_seconds: f64,
    /// AdamW zeroing the gradients it reads (reads 4N f32, writes 4N).
    pub adamw_seconds: f64,
}

/// Builds the one-rank training step on `comm` (a communicator of one rank), trains
/// `warmup + steps` steps on one random batch, then times the GEMMs.
pub fn run_step_bench(comm: &Communicator, args: &StepBenchArgs) -> Result<StepBenchReport> {
    if args.steps == 0 {
        return Err(Error::config("bench.steps", "must be at least 1"));
    }
    let config = GptConfig::named(&args.size)?;
    let (b, t) = (args.batch, args.seq_len);
    let executor = format!("{} {}", device_name(args.device), precision_name(args.precision));
    log::info!("bench step: building {} (B={b}, T={t}) on the {executor} executor", args.size);
    let threads = bind_cpu_threads(args.threads, 1)?.to_string();
    log::info!("bench step: CPU threads {threads}");
    let baseline_bytes = crate::memory::rss_bytes()?;
    let device = Device::open(args.device, 0)?;
    let mut harness = StepHarness::new(comm, config, (b, t), (device, args.precision), args.seed)?;
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let mut ids = || (0..b * t).map(|_| rng.gen_range(0..config.vocab_size as u32)).collect::<Vec<u32>>();
    let (tokens, targets) = (ids(), ids());
    harness.set_batch(&tokens, &targets)?;
    let peak_covers = if crate::memory::reset_peak_rss().is_ok() { "steps" } else { "run" };

    let mut losses = Vec::new();
    let mut step_times = Vec::new();
    let mut step_gemm_seconds = 0.0;
    for step in 0..args.warmup + args.steps {
        let gemm_before = crate::device::gemm::cpu_gemm_seconds();
        let r = harness.step(1e-4, 1.0)?;
        log::info!("bench step {step}: loss {:.4}, {:.3} s", r.loss, r.seconds);
        if step >= args.warmup {
            if step_times.iter().all(|&s| r.seconds < s) {
                step_gemm_seconds = crate::device::gemm::cpu_gemm_seconds() - gemm_before;
            }
            step_times.push(r.seconds);
            losses.push(r.loss);
        }
    }
    let peak_rss_bytes = crate::memory::peak_rss_bytes()?;
    // Each timed step again, right next to one timing of the GEMM mix: the pair's ratio holds
    // when a shared machine's speed drifts between the steps above and the GEMM timing (timed
    // apart, the same binary's ratio came out anywhere from 0.56 to 0.94 in consecutive runs).
    let (l, c) = (config.n_layer, config.n_embd);
    let n_flop_params = harness.params() - ParamLayout::new(&config).wpe().len();
    let flops_per_token = 6.0 * n_flop_params as f64 + 12.0 * (l * c * t) as f64;
    let step_flops = flops_per_token * (b * t) as f64;
    let mut gemms: Vec<GemmTiming> = Vec::new();
    let mut pairs = Vec::new();
    if matches!(args.device, DeviceKind::Cpu | DeviceKind::Emu) {
        for _ in 0..args.steps {
            let r = harness.step(1e-4, 1.0)?;
            let mix = time_step_gemms(&config, b * t);
            pairs.push(step_flops / r.seconds / mix_gflops(&mix) / 1e9);
            gemms = match gemms.is_empty() {
                true => mix,
                false => gemms.into_iter().zip(mix).map(|(a, m)| if m.seconds_per_call < a.seconds_per_call { m } else { a }).collect(),
            };
        }
    }
    let held = harness.held_bytes();
    let params = harness.params();
    harness.finish()?;
    let accounted_bytes = held.total() + baseline_bytes;

    let step_seconds = step_times.iter().copied().fold(f64::INFINITY, f64::min);
    let mean_step_seconds = step_times.iter().sum::<f64>() / args.steps as f64;
    let tokens_per_s = (b * t) as f64 / step_seconds;
    let step_gflops = flops_per_token * tokens_per_s / 1e9;
    let gemm_gflops = if gemms.is_empty() { 0.0 } else { mix_gflops(&gemms) };
    pairs.sort_by(f64::total_cmp);
    let optimizer = match args.device {
        DeviceKind::Cpu => Some(time_optimizer(params)?),
        _ => None,
    };
    Ok(StepBenchReport {
        size: args.size.clone(),
        executor,
        threads,
        blas: crate::device::cpu::blas::describe(),
        params,
        batch: b,
        seq_len: t,
        steps: args.steps,
        step_seconds,
        mean_step_seconds,
        tokens_per_s,
        flops_per_token,
        step_gflops,
        gemm_gflops,
        step_gemm_seconds,
        step_vs_gemm: pairs.get(pairs.len() / 2).copied().unwrap_or(0.0),
        step_vs_gemm_range: (pairs.first().copied().unwrap_or(0.0), pairs.last().copied().unwrap_or(0.0)),
        peak_rss_bytes,
        peak_covers,
        baseline_bytes,
        held,
        accounted_bytes,
        memory_ratio: peak_rss_bytes as f64 / accounted_bytes as f64,
        losses,
        gemms,
        optimizer,
    })
}

fn device_name(kind: DeviceKind) -> &'static str {
    match kind {
        DeviceKind::Cpu => "cpu",
        DeviceKind::Cuda => "cuda",
        DeviceKind::Hip => "hip",
        DeviceKind::Emu => "emu",
    }
}

fn precision_name(p: Precision) -> &'static str {
    match p {
        Precision::Fp32 => "fp32",
        Precision::Bf16 => "bf16",
        Precision::Fp16 => "fp16",
    }
}

/// The step's distinct GEMMs with their per-step call counts, each timed on scratch buffers.
///
/// As the executor's `device_linear.rs` (one rank, whole model): every linear layer (in C_in, out
/// C_out, rows N = B·T) does a forward
/// `(N, C_out, C_in)` with Wᵀ, a dinp `(N, C_in, C_out)` and a dW `(C_out, C_in, N)` with doutᵀ.
fn time_step_gemms(config: &GptConfig, rows: usize) -> Vec<GemmTiming> {
    let (l, c, vp) = (config.n_layer, config.n_embd, config.padded_vocab_size());
    let linears = [
        ("attn.qkv", c, 3 * c, l),
        ("attn.proj", c, c, l),
        ("mlp.fc", c, 4 * c, l),
        ("mlp.proj", 4 * c, c, l),
        ("logits", c, vp, 1),
    ];
    let mut out = Vec::new();
    for (name, cin, cout, calls) in linears {
        for pass in ["fwd", "dinp", "dW"] {
            let inp = vec![0.01f32; rows * cin]; // (N, C_in)
            let w = vec![0.01f32; cout * cin]; // (C_out, C_in)
            let dout = vec![0.01f32; rows * cout]; // (N, C_out)
            let (m, n, k, seconds_per_call) = match pass {
                "fwd" => {
                    let mut o = vec![0f32; rows * cout]; // (N, C_out)
                    let s = time_gemm(2 * rows * cout * cin, || {
                        matmul(&mut o, Mat::new(&inp, rows, cin), Mat::t(&w, cout, cin), false)
                    });
                    (rows, cout, cin, s)
                }
                "dinp" => {
                    let mut d = vec![0f32; rows * cin]; // (N, C_in)
                    let s = time_gemm(2 * rows * cout * cin, || {
                        matmul(&mut d, Mat::new(&dout, rows, cout), Mat::new(&w, cout, cin), true)
                    });
                    (rows, cin, cout, s)
                }
                _ => {
                    let mut dw = vec![0f32; cout * cin]; // (C_out, C_in)
                    let s = time_gemm(2 * rows * cout * cin, || {
                        matmul(
                            &mut dw,
                            Mat::t(&dout, rows, cout),
                            Mat::new(&inp, rows, cin),
                            true,
                        )
                    });
                    (cout, cin, rows, s)
                }
            };
            let gflops = 2.0 * (m * n * k) as f64 / seconds_per_call / 1e9;
            out.push(GemmTiming {
                name: format!("{name} {pass}"),
                m,
                n,
                k,
                calls_per_step: calls,
                seconds_per_call,
                gflops,
            });
        }
    }
    out
}

/// The GFLOP/s of a GEMM mix, each product weighted by its calls per step.
fn mix_gflops(gemms: &[GemmTiming]) -> f64 {
    let flops: f64 = gemms.iter().map(|g| (2 * g.m * g.n * g.k * g.calls_per_step) as f64).sum();
    let secs: f64 = gemms.iter().map(|g| g.seconds_per_call * g.calls_per_step as f64).sum();
    flops / secs / 1e9
}

/// The optimizer's passes over `n` parameters on the CPU arm, on scratch buffers written once
/// first (so every page is resident): fastest of [`GEMM_ROUNDS`] rounds after a warm-up.
fn time_optimizer(n: usize) -> Result<OptimizerTiming> {
    let dev = Device::open(DeviceKind::Cpu, 0)?;
    let filled = |x: f32| dev.upload(&vec![x; n]);
    let (mut p, mut g, mut m, mut v) = (filled(0.01)?, filled(1e-3)?, filled(0.0)?, filled(0.0)?);
    let mut partials = dev.alloc(4 * ops::SUM_BLOCKS)?;
    let config = AdamWConfig::default();
    let (mut norm_seconds, mut adamw_seconds) = (f64::INFINITY, f64::INFINITY);
    for round in 0..=GEMM_ROUNDS as u64 {
        let start = Instant::now();
        let sq = ops::sum_squares(&dev, &mut partials, &g, 0, n)?;
        let norm = start.elapsed().as_secs_f64();
        let s = AdamWStep { config: &config, step: round + 1, lr: 1e-4, grad_scale: 1.0 / sq.sqrt().max(1.0) };
        let start = Instant::now();
        let bufs = AdamWClearing { params: &mut p, grads: &mut g, m: &mut m, v: &mut v };
        ops::adamw_update_clearing(&dev, bufs, 0..n, &s, true)?;
        if round > 0 {
            norm_seconds = norm_seconds.min(norm);
            adamw_seconds = adamw_seconds.min(start.elapsed().as_secs_f64());
        }
    }
    Ok(OptimizerTiming { norm_seconds, adamw_seconds })
}

/// Rounds of GEMM timing; the fastest counts (see `StepBenchReport::step_seconds`).
const GEMM_ROUNDS: usize = 3;

/// Seconds per call of `f`: after one warm-up call, the fastest of [`GEMM_ROUNDS`] rounds of
/// enough calls for ~1 GFLOP each.
fn time_gemm(flops: usize, mut f: impl FnMut()) -> f64 {
    f();
    let reps = (1e9 / flops as f64).ceil().max(1.0) as usize;
    (0..GEMM_ROUNDS)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..reps {
                f();
            }
            start.elapsed().as_secs_f64() / reps as f64
        })
        .fold(f64::INFINITY, f64::min)
}

impl fmt::Display for StepBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        writeln!(
            f,
            "step bench: {} ({} params), B={} T={}, {} timed steps, executor DeviceGpt on {}, CPU threads {}",
            self.size, self.params, self.batch, self.seq_len, self.steps, self.executor, self.threads
        )?;
        writeln!(f, "  {}", self.blas)?;
        writeln!(
            f,
            "  step {:.3} s (mean {:.3} s), {:.0} tokens/s, {:.1} GFLOP/s ({:.3e} FLOP/token)",
            self.step_seconds, self.mean_step_seconds, self.tokens_per_s, self.step_gflops, self.flops_per_token
        )?;
        match self.gemms.is_empty() {
            true => writeln!(f, "  GEMM mix not timed (the CPU gemm is not this arm's)")?,
            false => writeln!(
                f,
                "  GEMM mix {:.1} GFLOP/s -> step/GEMM = {:.2} (median of {} step + GEMM-mix pairs, {:.2}-{:.2}; target >= 0.80)",
                self.gemm_gflops, self.step_vs_gemm, self.steps, self.step_vs_gemm_range.0, self.step_vs_gemm_range.1
            )?,
        }
        if let (Some(o), true) = (self.optimizer, self.step_gemm_seconds > 0.0) {
            let gemm = self.step_gemm_seconds;
            let alone = self.step_seconds * self.step_vs_gemm;
            let opt = o.norm_seconds + o.adamw_seconds;
            writeln!(
                f,
                "  step {:.3} s = GEMMs {gemm:.3} (timed in the step; the mix alone {alone:.3}) + optimizer {opt:.3} (norm {:.3}, AdamW zeroing the gradients {:.3}; timed alone) + other layers {:.3}",
                self.step_seconds,
                o.norm_seconds,
                o.adamw_seconds,
                self.step_seconds - gemm - opt
            )?;
            if self.step_seconds < gemm + opt {
                writeln!(f, "    (negative: the steps and the timings alone ran under different loads; measure on a quiet machine)")?;
            }
        }
        let h = &self.held;
        writeln!(
            f,
            "  peak RSS ({}) {:.0} MiB vs accounted {:.0} MiB -> {:.2}x (target <= 1.30)",
            self.peak_covers,
            mib(self.peak_rss_bytes),
            mib(self.accounted_bytes),
            self.memory_ratio
        )?;
        writeln!(
            f,
            "    staging {:.0} + model tensors {:.0} + optimizer {:.0} + activations {:.0} + gemm staging {:.0} + baseline {:.0} MiB",
            mib(h.staging),
            mib(h.model_tensors),
            mib(h.optimizer),
            mib(h.activations),
            mib(h.gemm_staging),
            mib(self.baseline_bytes)
        )?;
        for g in &self.gemms {
            writeln!(
                f,
                "    {:<16} {:>6} x {:>6} x {:>6}  x{:<3} {:>8.3} ms  {:>6.1} GFLOP/s",
                g.name,
                g.m,
                g.n,
                g.k,
                g.calls_per_step,
                g.seconds_per_call * 1e3,
                g.gflops
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::testing::run_ranks;
    use crate::comm::CommConfig;

    /// The tiny model through the one-rank training step: losses fall on the repeated batch, the
    /// FLOP count follows the formula, the held terms are the executor's (fp32: one bucket of
    /// staging, 2 per-tensor buffers and 2 optimizer moments of P f32 each; bf16 adds the 2-D
    /// weights' copies).
    #[test]
    fn tiny_bench_reports_consistent_numbers() {
        let out = run_ranks(1, CommConfig::default(), |comm| {
            let args = StepBenchArgs { size: "tiny".into(), batch: 2, seq_len: 16, warmup: 1, steps: 2, seed: 1, ..Default::default() };
            let fp32 = run_step_bench(&comm, &args).unwrap();
            let bf16 = run_step_bench(&comm, &StepBenchArgs { precision: Precision::Bf16, ..args.clone() }).unwrap();
            let zero_steps = run_step_bench(&comm, &StepBenchArgs { steps: 0, ..args }).is_err();
            (fp32, bf16, zero_steps)
        });
        let (r, bf16, zero_steps) = &out[0];
        assert!(zero_steps);
        assert_eq!(r.losses.len(), 2);
        assert!(r.losses[1] < r.losses[0], "losses {:?} do not fall", r.losses);
        assert_eq!(r.gemms.len(), 15);
        assert!(r.peak_rss_bytes > 0 && r.accounted_bytes > r.held.total());
        let cfg = GptConfig::named("tiny").unwrap();
        let p = ParamLayout::new(&cfg).total_len() as u64;
        assert_eq!((r.params as u64, r.held.model_tensors, r.held.optimizer), (p, 8 * p, 8 * p));
        assert!(r.held.staging > 0 && r.held.staging <= 4 * p, "one bucket of staging");
        // 6N + 12LCT with N = all parameters but wpe.
        let n = p as usize - cfg.max_seq_len * cfg.n_embd;
        assert_eq!(r.flops_per_token, (6 * n + 12 * 2 * 64 * 16) as f64);
        assert_eq!(bf16.executor, "cpu bf16");
        assert!(!r.threads.is_empty() && !r.threads.starts_with('0'), "threads {}", r.threads);
        assert!(bf16.held.model_tensors > 8 * p && bf16.losses.iter().all(|l| l.is_finite()));
        let o = r.optimizer.expect("the CPU arm times the optimizer passes");
        assert!(o.norm_seconds > 0.0 && o.adamw_seconds > 0.0 && o.norm_seconds.is_finite() && o.adamw_seconds.is_finite());
        assert!(r.to_string().contains("+ optimizer "), "{r}");
    }
}
