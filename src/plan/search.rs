//! Every layout of a job on a GPU count: enumerated, checked, costed and ranked.
//!
//! The space: `tp` and `pp` over the divisors of the GPU count (`dp` is the rest), micro-batches
//! over the divisors of each replica's share of the global batch (up to `max_micro_batch`), the
//! interleaved schedule's virtual stages, ZeRO 0-3 (only 0 without data parallelism), sequence
//! parallelism where TP > 1, and the stack's recomputation modes. A layout is rejected, with the
//! reason, where meshtrain's config validation would refuse it (TP not dividing the heads or the
//! padded vocabulary, Llama's `ffn_dim`, or neither dividing nor a multiple of `n_kv_head`:
//! `model::tp_layout::check_tp`, whose field the reason names; more stages than blocks, an
//! interleaved step whose micro-batches are not a multiple of `pp`, a sequence not divisible by TP
//! under SP; the Megatron stack also needs equal stages), where the global batch does not divide over the replicas, or where the fullest rank
//! does not fit the device's usable memory. Rejections that hold for a whole `tp` (or `tp`, `pp`)
//! are recorded once for it, not once per layout below it.
//!
//! Ranking: by the closed-form step time; the best `refine` layouts are then re-costed with the
//! schedule simulator (`cost::refine`) and re-ranked, so the top of the table is simulated.

use std::collections::HashMap;

use serde::Serialize;

use super::cost::{self, Estimate, Machine};
use super::{Job, Layout, Recompute, Stack};
use crate::error::{Error, Result};
use crate::parallel::stage_split;

/// What to search over.
#[derive(Debug, Clone)]
pub struct Options {
    /// Recomputation modes (both stacks implement all three).
    pub recompute: Vec<Recompute>,
    /// Largest micro-batch tried.
    pub max_micro_batch: usize,
    /// Largest number of virtual stages tried.
    pub max_virtual_stages: usize,
    /// Layouts re-costed with the simulator.
    pub refine: usize,
}

impl Default for Options {
    /// Every recomputation mode, micro-batches up to 16, up to 8 virtual stages, 16 layouts
    /// re-costed.
    fn default() -> Options {
        Options {
            recompute: vec![Recompute::None, Recompute::Selective, Recompute::Full],
            max_micro_batch: 16,
            max_virtual_stages: 8,
            refine: 16,
        }
    }
}

/// A layout that fits, with its prediction.
#[derive(Debug, Clone, Serialize)]
pub struct Ranked {
    /// The layout.
    pub layout: Layout,
    /// Its prediction.
    pub estimate: Estimate,
}

/// A layout (or a family of them) that cannot run, and why.
#[derive(Debug, Clone, Serialize)]
pub struct Rejected {
    /// The layout or family, e.g. `tp 3` or `tp8 pp4 v1 dp2 z0 mb1 x8 none`.
    pub layout: String,
    /// `divisibility`, `memory`.
    pub kind: &'static str,
    /// Why, naming the numbers.
    pub reason: String,
    /// For memory rejections: the fullest rank's bytes (GB), to sort the near misses first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mem_gb: Option<f64>,
}

/// The outcome of a search.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// Fitting layouts, fastest first.
    pub ranked: Vec<Ranked>,
    /// Everything else.
    pub rejected: Vec<Rejected>,
    /// Layouts costed (ranked plus memory rejections).
    pub costed: usize,
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n % d == 0).collect()
}

/// Why `tp` cannot split the model, if it cannot: the executor's own rule
/// (`model::tp_layout::check_tp`: the heads, the padded vocabulary; Llama also `ffn_dim`, and
/// `n_kv_head` divisible by `tp` or dividing it, when ranks share a KV head), naming the field.
fn tp_misfit(job: &Job, tp: usize) -> Option<String> {
    match crate::model::tp_layout::check_tp(&job.model, 0, tp) {
        Ok(()) => None,
        Err(Error::Config { key, msg }) => Some(format!("{key} = {tp}: {msg}")),
        Err(e) => Some(e.to_string()),
    }
}

/// Why `pp` stages or `dp` replicas cannot hold the job, if they cannot.
fn grid_misfit(job: &Job, pp: usize, dp: usize) -> Option<String> {
    if pp > job.model.n_layer {
        return Some(format!("pp {pp} exceeds n_layer {}", job.model.n_layer));
    }
    (job.global_batch % dp != 0)
        .then(|| format!("global batch {} does not divide over dp {dp}", job.global_batch))
}

fn reject(out: &mut Vec<Rejected>, layout: String, reason: String) {
    out.push(Rejected {
        layout,
        kind: "divisibility",
        reason,
        mem_gb: None,
    });
}

/// Blocks of each of the `pp * v` global stages: meshtrain's cost-balanced split, or equal stages
/// for Megatron-LM (`None` where they are not equal).
fn stage_blocks(job: &Job, stack: Stack, stages: usize) -> Result<Option<Vec<usize>>> {
    let l = job.model.n_layer;
    Ok(match stack {
        Stack::Megatron if l % stages != 0 => None,
        Stack::Megatron => Some(vec![l / stages; stages]),
        Stack::Meshtrain => Some(
            stage_split::stage_layers(&job.model, job.seq_len, stages, &[])?
                .iter()
                .map(|r| r.len())
                .collect(),
        ),
    })
}

/// [`stage_blocks`] of `stages`, computed once per search.
fn stage_split_of<'a>(
    job: &Job,
    stack: Stack,
    cache: &'a mut HashMap<usize, Option<Vec<usize>>>,
    stages: usize,
) -> Result<Option<&'a [usize]>> {
    if let std::collections::hash_map::Entry::Vacant(e) = cache.entry(stages) {
        e.insert(stage_blocks(job, stack, stages)?);
    }
    Ok(cache[&stages].as_deref())
}

/// Searches every layout of `job` on `mach`.
pub fn search(job: &Job, mach: &Machine, opts: &Options) -> Result<Plan> {
    let (mut ranked, mut rejected, mut costed) = (Vec::new(), Vec::new(), 0);
    let usable = mach.profile.usable_bytes();
    let mut splits: HashMap<usize, Option<Vec<usize>>> = HashMap::new();
    let model = &job.model;
    for tp in divisors(job.gpus) {
        if let Some(why) = tp_misfit(job, tp) {
            reject(&mut rejected, format!("tp {tp}"), why);
            continue;
        }
        for pp in divisors(job.gpus / tp) {
            let dp = job.gpus / (tp * pp);
            let fam = format!("tp {tp} pp {pp} dp {dp}");
            if let Some(why) = grid_misfit(job, pp, dp) {
                reject(&mut rejected, fam, why);
                continue;
            }
            let per_replica = job.global_batch / dp;
            if stage_split_of(job, mach.stack, &mut splits, pp)?.is_none() {
                reject(
                    &mut rejected,
                    format!("tp {tp} pp {pp}"),
                    format!(
                        "n_layer {} does not split into {pp} equal stages",
                        model.n_layer
                    ),
                );
                continue;
            }
            for mb in divisors(per_replica)
                .into_iter()
                .filter(|&b| b <= opts.max_micro_batch)
            {
                let m = per_replica / mb;
                for v in 1..=opts.max_virtual_stages {
                    if v > 1 && (pp == 1 || pp * v > model.n_layer || m % pp != 0) {
                        continue;
                    }
                    let Some(blocks) = stage_split_of(job, mach.stack, &mut splits, pp * v)? else {
                        continue;
                    };
                    let base = Layout {
                        tp,
                        pp,
                        virtual_stages: v,
                        dp,
                        zero: 0,
                        micro_batch: mb,
                        grad_accum: m,
                        sp: false,
                        recompute: Recompute::None,
                    };
                    for l in variants(job, base, opts) {
                        costed += 1;
                        let e = cost::estimate(job, &l, mach, blocks);
                        let need = e.memory.total();
                        if need > usable {
                            rejected.push(Rejected {
                                layout: l.describe(),
                                kind: "memory",
                                reason: format!(
                                    "{:.1} GB per GPU > {:.1} GB usable",
                                    need / 1e9,
                                    usable / 1e9
                                ),
                                mem_gb: Some(need / 1e9),
                            });
                        } else {
                            ranked.push(Ranked {
                                layout: l,
                                estimate: e,
                            });
                        }
                    }
                }
            }
        }
    }
    rank(&mut ranked, opts.refine)?;
    rejected.sort_by(|a, b| a.mem_gb.unwrap_or(0.0).total_cmp(&b.mem_gb.unwrap_or(0.0)));
    if ranked.is_empty() {
        return Err(no_layout(job, mach, &rejected));
    }
    Ok(Plan {
        ranked,
        rejected,
        costed,
    })
}

/// ZeRO stages, SP and recomputation variants of `base`.
fn variants(job: &Job, base: Layout, opts: &Options) -> Vec<Layout> {
    let zeros: &[u8] = if base.dp > 1 { &[0, 1, 2, 3] } else { &[0] };
    let sps: &[bool] = if base.tp > 1 && job.seq_len % base.tp == 0 {
        &[false, true]
    } else {
        &[false]
    };
    let mut out = Vec::new();
    for &zero in zeros {
        for &sp in sps {
            for &recompute in &opts.recompute {
                out.push(Layout {
                    zero,
                    sp,
                    recompute,
                    ..base
                });
            }
        }
    }
    out
}

fn rank(ranked: &mut [Ranked], refine: usize) -> Result<()> {
    let by_time = |a: &Ranked, b: &Ranked| {
        a.estimate.step_s.total_cmp(&b.estimate.step_s).then(
            a.estimate
                .memory
                .total()
                .total_cmp(&b.estimate.memory.total()),
        )
    };
    ranked.sort_by(by_time);
    let n = refine.min(ranked.len());
    for r in &mut ranked[..n] {
        cost::refine(&mut r.estimate, &r.layout)?;
    }
    ranked[..n].sort_by(by_time);
    Ok(())
}

/// The error for a job no layout fits: the GPU count, and the closest miss.
fn no_layout(job: &Job, mach: &Machine, rejected: &[Rejected]) -> Error {
    let closest = rejected
        .iter()
        .filter(|r| r.kind == "memory")
        .map(|r| format!("; the smallest needs {} ({})", r.reason, r.layout))
        .next();
    Error::config(
        "--gpus",
        format!(
            "no layout of {} (global batch {}, seq {}) fits {} GPUs of {}{}",
            job.name,
            job.global_batch,
            job.seq_len,
            job.gpus,
            mach.profile.name,
            closest.unwrap_or_else(|| format!(
                "; every layout breaks a divisibility rule (e.g. {})",
                rejected.first().map_or("-".into(), |r| r.reason.clone())
            ))
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GptConfig;
    use crate::plan::Profile;

    #[test]
    fn rejects_with_reasons_and_ranks_the_rest() {
        let p = Profile::load("dgx-a100").unwrap();
        let mach = Machine::new(&p, Stack::Meshtrain, "bf16").unwrap();
        let job = Job::new("d24", &GptConfig::named("d24").unwrap(), 24, 48, 1024).unwrap();
        let plan = search(&job, &mach, &Options::default()).unwrap();
        // 16 heads: tp 3, 6, 12, 24 do not divide them.
        for tp in [3, 6, 12, 24] {
            assert!(
                plan.rejected
                    .iter()
                    .any(|r| r.layout == format!("tp {tp}") && r.reason.contains("n_head 16")),
                "tp {tp}"
            );
        }
        assert!(plan
            .ranked
            .windows(2)
            .take(15)
            .all(|w| w[0].estimate.step_s <= w[1].estimate.step_s));
        assert!(plan.ranked[0].estimate.simulated);
        for r in &plan.ranked {
            let l = r.layout;
            assert_eq!(l.tp * l.pp * l.dp, 24);
            assert_eq!(l.dp * l.micro_batch * l.grad_accum, 48);
        }
    }

    #[test]
    fn a_gpu_count_nothing_fits_is_an_error_naming_it() {
        let p = Profile::load("frontier").unwrap();
        let mach = Machine::new(&p, Stack::Meshtrain, "bf16").unwrap();
        let job = Job::named("1t", 8, 8, 2048).unwrap();
        let err = search(&job, &mach, &Options::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--gpus") && err.contains("8 GPUs of frontier") && err.contains("GB"),
            "{err}"
        );
    }
}
