//! `meshtrain bench step`: one training step on CPU (forward + backward + clip + AdamW),
//! measured against the GEMMs it is made of and against the memory it should need.
//!
//! Reported, for a model size at (B, T) (default d12, B=4, T=64):
//! - tokens/s and achieved GFLOP/s, with model FLOPs per token = 6·N + 12·L·C·T, where N counts
//!   every parameter except `wpe` (a lookup, no multiply; padded `wte` rows are counted because
//!   the logits GEMM computes them) and 12·L·C·T is attention's QKᵀ and AV in forward (4·L·C·T
//!   counting the full T×T score matrix, not just its causal half) times 3 for the backward;
//! - the GEMM rate of the step's own GEMM mix: each distinct (M, N, K, transposition) GEMM the
//!   step performs is timed on its own, then weighted by how often the step calls it; the ratio
//!   step GFLOP/s ÷ GEMM GFLOP/s says how much time goes to non-GEMM layers (target ≥ 0.5);
//! - peak resident memory (VmHWM) against params + grads + AdamW m and v + activations and
//!   their backward scratch, all computed from the layout table (target ≤ 1.3x). The GEMM
//!   timing runs after VmHWM is read, so its scratch buffers are not counted.

use std::fmt;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};
use crate::model::gemm::{matmul, Mat};
use crate::model::{Gpt, GptConfig};
use crate::optim::{clip_scale, scale_grads, sum_of_squares, AdamW, AdamWConfig, AdamWState, DecayMask};

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
    /// Parameter count (flat buffer length, padded vocabulary included).
    pub params: usize,
    /// Micro-batch size B.
    pub batch: usize,
    /// Sequence length T.
    pub seq_len: usize,
    /// Timed steps.
    pub steps: usize,
    /// Fastest timed step (forward, backward, clip, AdamW): the rates below use it, like the
    /// GEMM timings use their fastest round, so that load from other processes on a shared
    /// machine does not skew the step/GEMM ratio.
    pub step_seconds: f64,
    /// Mean wall time of the timed steps.
    pub mean_step_seconds: f64,
    /// B·T / step_seconds.
    pub tokens_per_s: f64,
    /// 6·N + 12·L·C·T (see the module docs).
    pub flops_per_token: f64,
    /// Model FLOPs per second achieved by the step, in GFLOP/s.
    pub step_gflops: f64,
    /// Rate of the step's GEMM mix measured in isolation, in GFLOP/s.
    pub gemm_gflops: f64,
    /// step_gflops / gemm_gflops.
    pub step_vs_gemm: f64,
    /// Peak resident set size (VmHWM) in bytes.
    pub peak_rss_bytes: u64,
    /// Params + grads + AdamW m, v + activations and scratch, in bytes.
    pub accounted_bytes: u64,
    /// peak_rss_bytes / accounted_bytes.
    pub memory_ratio: f64,
    /// Loss of every timed step.
    pub losses: Vec<f32>,
    /// The step's distinct GEMMs.
    pub gemms: Vec<GemmTiming>,
}

/// Builds the model, trains `warmup + steps` steps on one random batch, then times the GEMMs.
pub fn run_step_bench(args: &StepBenchArgs) -> Result<StepBenchReport> {
    if args.steps == 0 {
        return Err(Error::config("bench.steps", "must be at least 1"));
    }
    let config = GptConfig::named(&args.size)?;
    let (b, t) = (args.batch, args.seq_len);
    log::info!("bench step: building {} (B={b}, T={t})", args.size);
    let mut model = Gpt::<f32>::new(config, b, t, args.seed)?;
    let layout = model.layout().clone();
    let opt = AdamW::new(AdamWConfig::default(), DecayMask::from_layout(&layout));
    let mut state = AdamWState::<f32>::new(0, layout.total_len());
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let tokens: Vec<u32> = (0..b * t)
        .map(|_| rng.gen_range(0..config.vocab_size as u32))
        .collect();
    let targets: Vec<u32> = (0..b * t)
        .map(|_| rng.gen_range(0..config.vocab_size as u32))
        .collect();

    let mut losses = Vec::new();
    let mut step_times = Vec::new();
    for step in 0..args.warmup + args.steps {
        let start = Instant::now();
        model.zero_grad();
        let loss = model.forward(&tokens, &targets)?;
        model.backward()?;
        let norm = sum_of_squares(model.grads()).sqrt();
        scale_grads(model.grads_mut(), clip_scale(norm, 1.0));
        let (params, grads) = model.params_and_grads();
        opt.step(&mut state, 1e-4, params, grads)?;
        let secs = start.elapsed().as_secs_f64();
        log::info!("bench step {step}: loss {loss:.4}, {secs:.3} s");
        if step >= args.warmup {
            step_times.push(secs);
            losses.push(loss);
        }
    }
    let peak_rss_bytes = crate::memory::peak_rss_bytes()?;
    let elem = std::mem::size_of::<f32>() as u64;
    let accounted_bytes = elem * (4 * layout.total_len() + model.activation_elements()) as u64;

    let step_seconds = step_times.iter().copied().fold(f64::INFINITY, f64::min);
    let mean_step_seconds = step_times.iter().sum::<f64>() / args.steps as f64;
    let tokens_per_s = (b * t) as f64 / step_seconds;
    let (l, c) = (config.n_layer, config.n_embd);
    let n_flop_params = layout.total_len() - layout.wpe().len();
    let flops_per_token = 6.0 * n_flop_params as f64 + 12.0 * (l * c * t) as f64;
    let step_gflops = flops_per_token * tokens_per_s / 1e9;

    let gemms = time_step_gemms(&config, b * t);
    let gemm_flops: f64 = gemms
        .iter()
        .map(|g| (2 * g.m * g.n * g.k * g.calls_per_step) as f64)
        .sum();
    let gemm_secs: f64 = gemms
        .iter()
        .map(|g| g.seconds_per_call * g.calls_per_step as f64)
        .sum();
    let gemm_gflops = gemm_flops / gemm_secs / 1e9;
    Ok(StepBenchReport {
        size: args.size.clone(),
        params: layout.total_len(),
        batch: b,
        seq_len: t,
        steps: args.steps,
        step_seconds,
        mean_step_seconds,
        tokens_per_s,
        flops_per_token,
        step_gflops,
        gemm_gflops,
        step_vs_gemm: step_gflops / gemm_gflops,
        peak_rss_bytes,
        accounted_bytes,
        memory_ratio: peak_rss_bytes as f64 / accounted_bytes as f64,
        losses,
        gemms,
    })
}

/// The step's distinct GEMMs with their per-step call counts, each timed on scratch buffers.
///
/// Mirrors `Gpt`: every linear layer (in C_in, out C_out, rows N = B·T) does a forward
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
            "step bench: {} ({} params), B={} T={}, {} timed steps",
            self.size, self.params, self.batch, self.seq_len, self.steps
        )?;
        writeln!(
            f,
            "  step {:.3} s (mean {:.3} s), {:.0} tokens/s, {:.1} GFLOP/s ({:.3e} FLOP/token)",
            self.step_seconds,
            self.mean_step_seconds,
            self.tokens_per_s,
            self.step_gflops,
            self.flops_per_token
        )?;
        writeln!(
            f,
            "  GEMM mix {:.1} GFLOP/s -> step/GEMM = {:.2} (target >= 0.50)",
            self.gemm_gflops, self.step_vs_gemm
        )?;
        writeln!(
            f,
            "  peak RSS {:.0} MiB vs accounted {:.0} MiB -> {:.2}x (target <= 1.30)",
            mib(self.peak_rss_bytes),
            mib(self.accounted_bytes),
            self.memory_ratio
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

    #[test]
    fn tiny_bench_reports_consistent_numbers() {
        let args = StepBenchArgs {
            size: "tiny".into(),
            batch: 2,
            seq_len: 16,
            warmup: 1,
            steps: 2,
            seed: 1,
        };
        let r = run_step_bench(&args).unwrap();
        assert_eq!(r.losses.len(), 2);
        assert_eq!(r.gemms.len(), 15);
        assert!(r.peak_rss_bytes > 0 && r.accounted_bytes > 0);
        let cfg = GptConfig::named("tiny").unwrap();
        // 6N + 12LCT with N = all parameters but wpe.
        let n = crate::model::ParamLayout::new(&cfg).total_len() - cfg.max_seq_len * cfg.n_embd;
        assert_eq!(r.flops_per_token, (6 * n + 12 * 2 * 64 * 16) as f64);
        assert!(run_step_bench(&StepBenchArgs { steps: 0, ..args }).is_err());
    }
}
