//! The planner on Llama shapes against the executor it plans for: every rank's parameter count
//! is the executor's shard layout, every rank's activation elements are what the executor
//! allocates (one rank and TP 2 and 4 over in-process ranks, KV heads split and shared, with and
//! without SP, every recomputation mode, pipeline stages with several slots), the block's GEMMs
//! are the model FLOPs of `metrics`, and the search, job files and rejections handle the
//! grouped-query attention rules.

use super::cost::{block_gemms, Machine};
use super::rank_memory::{activation_elements, RankShare, ShardSizes};
use super::search::{search, Options};
use super::{report, Job, Layout, Profile, Recompute, Stack};
use crate::comm::testing::run_ranks;
use crate::comm::CommConfig;
use crate::device::Device;
use crate::model::{ActDims, DeviceGpt, DeviceTp, ExecOptions, GptConfig, Precision, ShardLayout, StageSpec};

/// A small Llama: 4 query heads on 2 KV heads, SwiGLU width 48, untied head unless `tied`.
fn small_llama(tied: bool) -> GptConfig {
    let mut c = GptConfig::named("llama-tiny").unwrap();
    c.n_layer = 4;
    let l = c.llama.as_mut().unwrap();
    (l.n_kv_head, l.ffn_dim, l.tie_embeddings) = (2, 48, tied);
    c.n_head = 4;
    c.validate().unwrap();
    c
}

fn layout(tp: usize, pp: usize, sp: bool, recompute: Recompute) -> Layout {
    Layout {
        tp,
        pp,
        virtual_stages: 1,
        dp: 1,
        zero: 0,
        micro_batch: 2,
        grad_accum: 4,
        sp,
        recompute,
    }
}

#[test]
fn rank_parameters_are_the_executors_shard() {
    let gpt2 = GptConfig::named("tiny").unwrap();
    let mut wide = GptConfig::named("llama-tiny").unwrap();
    wide.llama.as_mut().unwrap().n_kv_head = wide.n_head;
    for c in [gpt2, small_llama(false), small_llama(true), wide, GptConfig::named("llama-70b").unwrap()] {
        let n = c.n_layer;
        for tp in [1, 2, 4, 8, 16] {
            if crate::model::tp_layout::check_tp(&c, 0, tp).is_err() {
                continue;
            }
            let job = Job::new("m", &c, tp, 8, 8).unwrap();
            for (blocks, embeds, ends) in [(n, true, true), (n / 2, true, false), (n / 2, false, true), (1, false, false)] {
                let spec = StageSpec::single(if embeds { 0..blocks } else { n - blocks..n }, embeds, ends);
                let want = ShardLayout::new(&c, 0, tp, &spec).unwrap().total_len();
                let share = RankShare { blocks, embeds, ends, rank: 0 };
                assert_eq!(share.params(&job, tp), want as f64, "{} tp {tp} {spec:?}", c.arch());
            }
        }
    }
    // Llama 2 70B: 8 KV heads; TP 16 shares each between two ranks, which then both hold it.
    let c = GptConfig::named("llama-70b").unwrap();
    let (z8, z16) = (ShardSizes::of(&c, 8), ShardSizes::of(&c, 16));
    let kv = 2 * 128 * 8192;
    assert_eq!(z8.block - z16.block, (z8.block - 2 * 8192 - kv) / 2);
    assert!(!z8.tied && z8.wpe == 0 && z8.fin == 8192 + z8.wte);
}

/// The executor's `activation_elements` of the stage `spec` with `slots` slots on TP rank
/// `rank` of `tp` (in-process ranks), for each layout.
fn executor_elements(c: GptConfig, tp: usize, cases: Vec<(bool, Recompute, StageSpec, usize)>) -> Vec<Vec<usize>> {
    run_ranks(tp, CommConfig::default(), move |comm| {
        cases
            .iter()
            .map(|(sp, recompute, spec, slots)| {
                let group = (tp > 1).then(|| DeviceTp::new(comm.split(Some(0), comm.rank() as i64).unwrap().unwrap()).unwrap());
                let n = ShardLayout::new(&c, comm.rank(), tp, spec).unwrap().total_len();
                let exec = ExecOptions { precision: Precision::Fp32, recompute: *recompute };
                DeviceGpt::stage(Device::Cpu, c, (2, 8), vec![0.0; n], exec, (group, *sp), spec.clone(), *slots)
                    .unwrap()
                    .activation_elements()
            })
            .collect()
    })
}

#[test]
fn rank_activations_are_what_the_executor_allocates() {
    for (c, tp) in [(small_llama(false), 1), (small_llama(false), 2), (small_llama(true), 4), (GptConfig::named("tiny").unwrap(), 2)] {
        let job = Job::new("m", &c, tp, 8, 8).unwrap();
        let n = c.n_layer;
        let mut cases = Vec::new();
        let mut plans = Vec::new();
        for sp in if tp > 1 { vec![false, true] } else { vec![false] } {
            for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
                // One stage (one slot), and the first and last of two (2 and 1 in flight).
                for (pp, rank) in [(1, 0), (2, 0), (2, 1)] {
                    let l = layout(tp, pp, sp, recompute);
                    let stages = vec![n / pp; pp];
                    let share = RankShare::of(&l, &stages, rank);
                    let first = rank * n / pp;
                    let spec = StageSpec::single(first..first + n / pp, share.embeds, share.ends);
                    cases.push((sp, recompute, spec, super::rank_memory::in_flight(&l, rank)));
                    plans.push(activation_elements(&job, &l, &share, &stages, false));
                }
            }
        }
        let got = executor_elements(c, tp, cases.clone());
        for (r, rank_got) in got.iter().enumerate() {
            for ((case, plan), exec) in cases.iter().zip(&plans).zip(rank_got) {
                assert_eq!(*plan, *exec as f64, "{} tp {tp} rank {r}: {case:?}", c.arch());
            }
        }
    }
}

#[test]
fn block_products_are_the_model_flops() {
    // Split KV heads (tp dividing n_kv_head): the TP ranks' products add up to the convention's
    // per-block matmul FLOPs exactly; a shared KV head is computed by each of its ranks.
    for (name, tps) in [("llama-7b", vec![1, 2, 8]), ("llama-70b", vec![1, 4, 8, 16]), ("d12", vec![1, 4])] {
        let c = GptConfig::named(name).unwrap();
        let model = 6.0 * crate::metrics::block_flop_params(&c) as f64;
        for tp in tps {
            let d = ActDims::of_rank(&c, 1, 64, tp, false);
            let fwd: f64 = block_gemms(&d).iter().map(|(m, n, k)| 2.0 * m * n * k).sum();
            let per_token = 3.0 * fwd * tp as f64 / 64.0;
            if tp <= c.n_kv_head() {
                assert_eq!(per_token, model, "{name} tp {tp}");
            } else {
                let extra = 6.0 * 2.0 * (tp - c.n_kv_head()) as f64 * (c.head_dim() * c.n_embd) as f64;
                assert_eq!(per_token, model + extra, "{name} tp {tp}");
            }
        }
    }
}

#[test]
fn llama_7b_on_frontier_plans_and_writes_a_loadable_job() {
    let p = Profile::load("frontier").unwrap();
    let mach = Machine::new(&p, Stack::Meshtrain, "bf16").unwrap();
    let job = Job::named("llama-7b", 64, 512, 4096).unwrap();
    let plan = search(&job, &mach, &Options::default()).unwrap();
    // 32 heads: tp 64 cannot split them, and the reason names the field.
    assert!(plan.rejected.iter().any(|r| r.layout == "tp 64" && r.reason.contains("parallel.tp") && r.reason.contains("n_head 32")));
    let best = &plan.ranked[0];
    let e = &best.estimate;
    assert!(e.step_s > 0.0 && e.memory.total() <= p.usable_bytes());
    // Model FLOPs per step over the step time and GPUs: a share of the MI250X GCD's peak.
    let pct = job.model_flops_per_step() / e.step_s / 64.0 / mach.peak;
    assert!(pct > 0.1 && pct < 0.8, "{pct}");
    let text = report::job_toml(&job, &mach, &best.layout, e.step_s).unwrap();
    let cfg = crate::config::JobConfig::from_str(&text, &[]).unwrap();
    assert_eq!(cfg.model, job.model, "{text}");
    assert_eq!((cfg.parallel.tp, cfg.parallel.pp), (best.layout.tp, best.layout.pp));
}

#[test]
fn kv_heads_shared_over_tp_are_planned_and_bad_splits_rejected() {
    let p = Profile::load("dgx-a100").unwrap();
    let mach = Machine::new(&p, Stack::Meshtrain, "bf16").unwrap();
    // Llama 2 70B (8 KV heads) on 64 GPUs: TP 16 shares each KV head between two ranks.
    let job = Job::named("llama-70b", 64, 64, 4096).unwrap();
    let plan = search(&job, &mach, &Options::default()).unwrap();
    assert!(plan.ranked.iter().any(|r| r.layout.tp == 16) || plan.rejected.iter().any(|r| r.layout.starts_with("tp16") && r.kind == "memory"));
    assert!(!plan.rejected.iter().any(|r| r.layout == "tp 16"));
    // 24 heads on 6 KV heads: TP 4 neither divides nor is a multiple of 6.
    let mut c = GptConfig::named("llama-tiny").unwrap();
    c.n_head = 24;
    c.n_embd = 24 * 8;
    c.llama.as_mut().unwrap().n_kv_head = 6;
    c.llama.as_mut().unwrap().ffn_dim = 512;
    let job = Job::new("gqa", &c, 8, 8, 64).unwrap();
    let plan = search(&job, &Machine::new(&p, Stack::Meshtrain, "fp32").unwrap(), &Options::default()).unwrap();
    let r = plan.rejected.iter().find(|r| r.layout == "tp 4").expect("tp 4 rejected");
    assert!(r.reason.contains("model.n_kv_head 6"), "{}", r.reason);
    assert!(plan.ranked.iter().any(|r| r.layout.tp == 2));
}

#[test]
fn llama_activations_follow_swiglu_and_gqa() {
    // Megatron-LM convention: Llama 2 70B's block saves 8 s b h (norms) + (2 (h + 2 kv) + 2 h +
    // 6 F) s b h / (h t) + 2 a s^2 b / t bytes; compare against the GPT-2 formula's 34 + 5 a s / h
    // at equal width: the SwiGLU width F = 3.5 h makes it larger, GQA smaller.
    let c = GptConfig::named("llama-70b").unwrap();
    let job = Job::new("llama-70b", &c, 8, 8, 4096).unwrap();
    let l = Layout { micro_batch: 1, sp: true, recompute: Recompute::Selective, ..layout(8, 1, true, Recompute::Selective) };
    let m = super::rank_memory::peak(&job, &l, Stack::Megatron, true, false, &[80]);
    let (s, h, f, kv) = (4096.0, 8192.0, 28672.0, 1024.0);
    let per_block = s * h * (8.0 + (2.0 * (h + 2.0 * kv) + 2.0 * h + 6.0 * f) / h) / 8.0;
    let logits = 2.0 * 4.0 * s * 32000.0 / 8.0;
    assert!((m.activations - 80.0 * per_block - logits).abs() < 1.0, "{}", m.activations);
}
