//! Predicted step time of one layout on one machine.
//!
//! Per pipeline rank and micro-batch, a forward and a backward through the rank's chunks cost:
//! - GEMMs by shape (`(B*T, 3C/t, C)`, `(B*T, C, C/t)`, `(B*T, 4C/t, C)`, `(B*T, C, 4C/t)` per
//!   block, the attention core as `B * NH/t` `(T, T, C/NH)` and `(T, C/NH, T)` products, the
//!   head's `(B*T, Vp/t, C)`; Llama's q, k, v `(B*T, (NH + 2 NKV) hd / t, C)` and SwiGLU's
//!   `(B*T, 2F/t, C)`, `(B*T, C, F/t)`: the executor's widths, `model::ActDims`), each at the
//!   profile's efficiency for its shape; a backward is the two
//!   products of each forward one (`dX`, `dW`) at their own shapes;
//! - memory-bound kernels (LayerNorm, GELU, softmax, residual adds) as twice the bytes of the
//!   activations they write, at the memory bandwidth; the backward twice the forward;
//! - tensor-parallel collectives on the critical path (two all-reduces per block and direction, or
//!   under sequence parallelism two all-gathers and two reduce-scatters), as ring collectives in the
//!   alpha-beta model of the link tier the group spans; a Llama KV head shared by TP ranks adds
//!   the backward's all-reduce of its k and v weight gradients per block;
//! - pipeline point-to-point: one message per chunk and direction;
//! - recomputation: full repeats the block's forward in the backward, selective the attention core.
//!
//! A step is the pipeline's makespan over `m` micro-batches (closed form: `sum_r t_r + (m-1)
//! max_r t_r` for 1F1B, `(m + (p-1)/v) max_r t_r` interleaved; [`refine`] replaces it by the
//! schedule simulator's makespan for the same per-rank times), plus the data-parallel reduction
//! that the last backward does not hide, plus the optimizer (memory-bound, its shard's state).
//! Where more ranks share a node than its profile's `cores_per_node` (CPU ranks time-slicing a
//! node's cores), every compute term (GEMMs, memory-bound kernels, the optimizer, the measured
//! overheads) takes `ranks on the node / cores_per_node` times as long; communication is costed
//! as measured (a calibrated profile measured it with every rank of the node taking part).
//! A calibrated profile adds its measured fixed costs (`overhead`: per block and micro-batch to
//! each rank's forward and backward, per step to the optimizer) and costs collectives by its
//! measured fits per algorithm (`collfit`) instead of the ring model.
//! meshtrain reduces gradient buckets while the last micro-batch's backward runs and gathers the
//! updated parameters after the step (ZeRO >= 1; ZeRO-3 also gathers each micro-batch's
//! parameters, overlapped with its compute); the Megatron-LM stack of the published runs
//! all-reduces after the backward.
//!
//! Invariants: every time is finite and positive for a valid layout; `step_s = pipeline_s +
//! dp_exposed_s + optimizer_s` and `pipeline_s = compute + tp/pp communication + bubble` of the
//! slowest rank.

use serde::Serialize;

use super::collfit;
use super::profile::{Link, Profile};
use super::rank_memory::{self as memory, RankMemory, RankShare};
use super::{Job, Layout, Recompute, Stack};
use crate::error::Result;
use crate::model::ActDims;
use crate::parallel::schedule::{simulate_ranks, Delivery, Schedule};

/// The machine and implementation a layout is costed on.
pub struct Machine<'a> {
    /// The profile.
    pub profile: &'a Profile,
    /// The implementation modelled.
    pub stack: Stack,
    /// Dense peak FLOP/s of one device at the GEMM precision.
    pub peak: f64,
    /// GEMMs in a 16-bit type, bf16 or fp16 (meshtrain then also keeps 16-bit weight copies,
    /// the same bytes for either).
    pub bf16: bool,
}

impl<'a> Machine<'a> {
    /// `profile` running `stack` with GEMMs at `precision` (`bf16`, `fp32`, ...).
    pub fn new(profile: &'a Profile, stack: Stack, precision: &str) -> Result<Machine<'a>> {
        Ok(Machine {
            profile,
            stack,
            peak: profile.peak_flops(precision)?,
            bf16: precision != "fp32",
        })
    }

    /// Bytes of one activation element as the stack stores and communicates it.
    fn act_bytes(&self) -> f64 {
        match self.stack {
            Stack::Meshtrain => 4.0,
            Stack::Megatron => 2.0,
        }
    }

    /// Seconds of `count` (m, n, k) products.
    fn gemm(&self, m: f64, n: f64, k: f64, count: f64) -> f64 {
        let eff = self
            .profile
            .gemm_efficiency(m as usize, n as usize, k as usize, self.peak);
        count * 2.0 * m * n * k / (self.peak * eff)
    }

    /// Forward and backward seconds of `count` (m, n, k) products.
    fn gemm_fb(&self, m: f64, n: f64, k: f64, count: f64) -> (f64, f64) {
        (
            self.gemm(m, n, k, count),
            self.gemm(m, k, n, count) + self.gemm(k, n, m, count),
        )
    }

    fn stream(&self, bytes: f64) -> f64 {
        bytes / (self.profile.memory.bandwidth_gbs * 1e9)
    }

    /// How many times longer a rank computes when `ranks` ranks of a job share the profile's
    /// nodes: `r / cores_per_node` with `r` the ranks on one node, where that exceeds 1 (ranks
    /// time-slice the node's cores), else 1.
    pub fn sharing(&self, ranks: usize) -> f64 {
        let on_node = ranks.min(self.profile.devices_per_node).max(1) as f64;
        match self.profile.cores_per_node {
            Some(cores) => (on_node / cores).max(1.0),
            None => 1.0,
        }
    }

    /// Whether a group of `size` ranks `stride` ranks apart stays inside one node (ranks fill
    /// nodes in order).
    fn within_node(&self, size: usize, stride: usize) -> bool {
        let dpn = self.profile.devices_per_node;
        let per_node = (dpn / stride.max(1)).max(1).min(size);
        size <= per_node && stride * (size - 1) < dpn
    }

    /// The link tier of a group of `size` ranks `stride` ranks apart.
    fn link(&self, size: usize, stride: usize) -> Link {
        if self.within_node(size, stride) {
            return self.profile.intra_link(size == 2 && stride == 1);
        }
        let dpn = self.profile.devices_per_node;
        self.profile
            .inter_link(dpn / (dpn / stride.max(1)).max(1).min(size))
    }

    /// Seconds of `coll` (`all_reduce`, `all_gather`, `reduce_scatter`) of a `bytes` buffer over a
    /// group of `size` ranks `stride` apart: the profile's measured fits of the group's tier where
    /// it has them (`collfit::predict`), else the ring model on the tier's link.
    fn coll(&self, coll: &str, size: usize, stride: usize, bytes: f64) -> f64 {
        if size < 2 {
            return 0.0;
        }
        let tier = if self.within_node(size, stride) {
            "intra"
        } else {
            "inter"
        };
        if let Some(t) = collfit::predict(&self.profile.collectives, coll, tier, size, bytes) {
            return t;
        }
        let link = self.link(size, stride);
        match coll {
            "all_reduce" => all_reduce(link, size, bytes),
            _ => gather(link, size, bytes),
        }
    }
}

/// Ring all-reduce of `bytes` over `g` ranks.
fn all_reduce(link: Link, g: usize, bytes: f64) -> f64 {
    if g < 2 {
        return 0.0;
    }
    let g = g as f64;
    2.0 * (g - 1.0) * link.alpha + 2.0 * (g - 1.0) / g * bytes / link.bandwidth
}

/// Ring all-gather or reduce-scatter of `bytes` (the full buffer) over `g` ranks.
fn gather(link: Link, g: usize, bytes: f64) -> f64 {
    all_reduce(link, g, bytes) / 2.0
}

/// Predicted time of one step, by part (seconds), and the memory of the fullest rank.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Estimate {
    /// One optimizer step.
    pub step_s: f64,
    /// The pipeline's makespan over all micro-batches.
    pub pipeline_s: f64,
    /// Compute of the slowest rank (GEMMs, memory-bound kernels, recomputation).
    pub compute_s: f64,
    /// Idle time of the slowest rank in the pipeline.
    pub bubble_s: f64,
    /// TP collectives on the slowest rank's critical path.
    pub tp_comm_s: f64,
    /// Pipeline point-to-point on the slowest rank's critical path.
    pub pp_comm_s: f64,
    /// Data-parallel reduction and gathers not hidden by compute.
    pub dp_exposed_s: f64,
    /// The optimizer's update of this rank's shard (with the profile's per-step overhead).
    pub optimizer_s: f64,
    /// Bytes of the fullest rank.
    pub memory: RankMemory,
    /// Per pipeline rank: one micro-batch's forward through all its chunks (with its TP and PP
    /// communication).
    #[serde(skip)]
    pub fwd: Vec<f64>,
    /// Per pipeline rank: one micro-batch's backward (with recomputation and communication).
    #[serde(skip)]
    pub bwd: Vec<f64>,
    /// Whether the pipeline time comes from the schedule simulator.
    pub simulated: bool,
}

impl Estimate {
    /// TP, PP and data-parallel communication not hidden by compute.
    pub fn exposed_comm_s(&self) -> f64 {
        self.tp_comm_s + self.pp_comm_s + self.dp_exposed_s
    }
}

/// Forward and backward time of one part, split into compute and communication.
#[derive(Debug, Clone, Copy, Default)]
struct Part {
    fwd: f64,
    bwd: f64,
    fwd_comm: f64,
    bwd_comm: f64,
}

impl Part {
    /// The compute times `k` times longer, the communication as it is.
    fn slowed(self, k: f64) -> Part {
        Part {
            fwd: self.fwd * k,
            bwd: self.bwd * k,
            ..self
        }
    }
    fn scaled(self, k: f64) -> Part {
        Part {
            fwd: self.fwd * k,
            bwd: self.bwd * k,
            fwd_comm: self.fwd_comm * k,
            bwd_comm: self.bwd_comm * k,
        }
    }
    fn plus(self, o: Part) -> Part {
        Part {
            fwd: self.fwd + o.fwd,
            bwd: self.bwd + o.bwd,
            fwd_comm: self.fwd_comm + o.fwd_comm,
            bwd_comm: self.bwd_comm + o.bwd_comm,
        }
    }
}

/// One block, one micro-batch. The GEMM shapes are the executor's widths (`model::ActDims`):
/// GPT-2 `qkv = 3C/t`, `fc = hl = 4C/t`; Llama `qkv = (NH + 2 NKV) hd / t` (a KV head shared
/// by ranks counted whole: each computes it), `fc = 2F/t` (gate and up), `hl = F/t`.
fn block(job: &Job, l: &Layout, mach: &Machine) -> Part {
    let (s, c) = (job.seq_len as f64, job.model.n_embd as f64);
    let d = ActDims::of_rank(&job.model, l.micro_batch, job.seq_len, l.tp, l.sp);
    let bt = d.bt as f64;
    let (cl, qkv, fc, hl) = (d.cl as f64, d.qkv as f64, d.fc as f64, d.hl as f64);
    let mut fwd = 0.0;
    let mut bwd = 0.0;
    for (m, n, k) in block_gemms(&d) {
        let (f, b) = mach.gemm_fb(m, n, k, 1.0);
        fwd += f;
        bwd += b;
    }
    let heads = (l.micro_batch * job.model.n_head / l.tp) as f64;
    let hd = job.model.head_dim() as f64;
    let (qk_f, qk_b) = mach.gemm_fb(s, s, hd, heads);
    let (pv_f, pv_b) = mach.gemm_fb(s, hd, s, heads);
    let (core_f, core_b) = (qk_f + pv_f, qk_b + pv_b);
    // Memory-bound kernels: twice the activation bytes written (scores and probabilities count);
    // the norms' outputs, qkv, the attention output, the MLP's up and activation outputs, four
    // residual-stream writes, and Llama's RoPE rewriting q and k in place.
    let att_elems = heads * s * s;
    let core_bytes = 2.0 * 2.0 * att_elems * mach.act_bytes();
    let rows = d.rows as f64;
    let rope = if job.model.llama.is_some() { qkv } else { 0.0 };
    let other_bytes = 2.0
        * mach.act_bytes()
        * (bt * (2.0 * c + qkv + cl + fc + hl + rope) + rows * 4.0 * c);
    let (elem_core, elem_other) = (mach.stream(core_bytes), mach.stream(other_bytes));
    let comm = tp_block_comm(job, l, mach);
    let fwd_compute = fwd + core_f + elem_core + elem_other;
    let bwd_compute = bwd + core_b + 2.0 * (elem_core + elem_other);
    let (re_compute, re_comm) = match l.recompute {
        Recompute::None => (0.0, 0.0),
        Recompute::Selective => (core_f + elem_core, 0.0),
        Recompute::Full => (fwd_compute, comm),
    };
    Part {
        fwd: fwd_compute,
        bwd: bwd_compute + re_compute,
        fwd_comm: comm,
        bwd_comm: comm + re_comm + kv_share_comm(job, l, mach),
    }
}

/// One block's forward products on one rank, (rows, output width, input width): qkv (Llama: q,
/// k and v, stacked), the attention projection, the MLP's up (Llama: gate and up) and down.
pub(super) fn block_gemms(d: &ActDims) -> [(f64, f64, f64); 4] {
    let (bt, c) = (d.bt as f64, d.c as f64);
    let (cl, qkv, fc, hl) = (d.cl as f64, d.qkv as f64, d.fc as f64, d.hl as f64);
    [(bt, qkv, c), (bt, c, cl), (bt, fc, c), (bt, c, hl)]
}

/// Llama with fewer KV heads than TP ranks: the backward's all-reduce over TP, per block and
/// micro-batch, of the shared KV heads' k and v weight gradients (NKV slots of 2 hd C, fp32).
fn kv_share_comm(job: &Job, l: &Layout, mach: &Machine) -> f64 {
    match &job.model.llama {
        Some(m) if m.n_kv_head < l.tp => {
            let bytes = 4.0 * (m.n_kv_head * 2 * job.model.head_dim() * job.model.n_embd) as f64;
            mach.coll("all_reduce", l.tp, 1, bytes)
        }
        _ => 0.0,
    }
}

/// TP communication of one block in one direction: two all-reduces of the (B*T, C) activations,
/// or under SP two all-gathers and two reduce-scatters of them.
fn tp_block_comm(job: &Job, l: &Layout, mach: &Machine) -> f64 {
    if l.tp < 2 {
        return 0.0;
    }
    let bytes = (l.micro_batch * job.seq_len * job.model.n_embd) as f64 * mach.act_bytes();
    if l.sp {
        2.0 * (mach.coll("all_gather", l.tp, 1, bytes)
            + mach.coll("reduce_scatter", l.tp, 1, bytes))
    } else {
        2.0 * mach.coll("all_reduce", l.tp, 1, bytes)
    }
}

/// The head (final LayerNorm, logits, cross-entropy) of one micro-batch.
fn head(job: &Job, l: &Layout, mach: &Machine) -> Part {
    let bt = (l.micro_batch * job.seq_len) as f64;
    let (c, vl) = (job.model.n_embd as f64, job.vocab() as f64 / l.tp as f64);
    let (f, b) = mach.gemm_fb(bt, vl, c, 1.0);
    // Logits written, read by the softmax, gradient written (fp32).
    let elem = mach.stream(3.0 * 4.0 * bt * vl);
    let comm = 3.0 * mach.coll("all_reduce", l.tp, 1, bt * 4.0);
    Part {
        fwd: f + elem,
        bwd: b + elem,
        fwd_comm: comm,
        bwd_comm: 0.0,
    }
}

/// The embedding of one micro-batch: a lookup, and without SP the TP sum of its output.
fn embed(job: &Job, l: &Layout, mach: &Machine) -> Part {
    let bytes = (l.micro_batch * job.seq_len * job.model.n_embd) as f64 * mach.act_bytes();
    let comm = if l.sp {
        0.0
    } else {
        mach.coll("all_reduce", l.tp, 1, bytes)
    };
    Part {
        fwd: mach.stream(3.0 * bytes),
        bwd: mach.stream(3.0 * bytes),
        fwd_comm: comm,
        bwd_comm: 0.0,
    }
}

/// One pipeline message (an activation or its gradient) of one micro-batch.
fn p2p(job: &Job, l: &Layout, mach: &Machine) -> f64 {
    if l.pp < 2 {
        return 0.0;
    }
    let rows = (l.micro_batch * job.seq_len) as f64;
    // meshtrain sends the rows it holds (all, or B*T/t under SP); Megatron scatters over TP.
    let rows = match (mach.stack, l.sp) {
        (Stack::Meshtrain, false) => rows,
        _ => rows / l.tp as f64,
    };
    let link = mach.link(l.pp, l.tp);
    link.alpha + rows * job.model.n_embd as f64 * mach.act_bytes() / link.bandwidth
}

/// The estimate of `layout` with the closed-form pipeline time; `stage_blocks[s]` are the blocks
/// of global stage `s` (see `parallel::stage_split`).
pub fn estimate(job: &Job, l: &Layout, mach: &Machine, stage_blocks: &[usize]) -> Estimate {
    // Ranks sharing a node's cores compute that many times slower (1 with a device per rank).
    let share = mach.sharing(job.gpus);
    let (blk, hd, emb) = (
        block(job, l, mach).slowed(share),
        head(job, l, mach).slowed(share),
        embed(job, l, mach).slowed(share),
    );
    let msg = p2p(job, l, mach);
    let v = l.virtual_stages as f64;
    // Measured per-block costs the terms below do not describe (zero for datasheets).
    let block_overhead = share * mach.profile.overhead.block_ms * 1e-3;
    let ranks: Vec<(RankShare, Part)> = (0..l.pp)
        .map(|r| {
            let share = RankShare::of(l, stage_blocks, r);
            let mut part = blk.scaled(share.blocks as f64);
            if share.embeds {
                part = part.plus(emb);
            }
            if share.ends {
                part = part.plus(hd);
            }
            let overhead = share.blocks as f64 * block_overhead;
            let pp = Part {
                fwd: overhead / 2.0,
                bwd: overhead / 2.0,
                fwd_comm: v * msg,
                bwd_comm: v * msg,
            };
            (share, part.plus(pp))
        })
        .collect();
    let fwd: Vec<f64> = ranks.iter().map(|(_, p)| p.fwd + p.fwd_comm).collect();
    let bwd: Vec<f64> = ranks.iter().map(|(_, p)| p.bwd + p.bwd_comm).collect();
    let per_mb: Vec<f64> = fwd.iter().zip(&bwd).map(|(f, b)| f + b).collect();
    let slow = (0..l.pp)
        .max_by(|&a, &b| per_mb[a].total_cmp(&per_mb[b]))
        .unwrap_or(0);
    let max = per_mb[slow];
    let m = l.grad_accum as f64;
    let pipeline_s = if l.virtual_stages == 1 {
        per_mb.iter().sum::<f64>() + (m - 1.0) * max
    } else {
        (m + (l.pp as f64 - 1.0) / v) * max
    };
    let (share, part) = &ranks[slow];
    let pp_msgs = v * msg * 2.0;
    let memory = memory::peak(
        job,
        l,
        mach.stack,
        mach.bf16,
        mach.profile.device == "cpu" && l.dp > 1,
        stage_blocks,
    );
    let (dp_exposed_s, optimizer_s) = data_parallel(
        job,
        l,
        mach,
        share,
        part.bwd + part.bwd_comm,
        part.fwd + part.bwd,
    );
    let mut e = Estimate {
        step_s: 0.0,
        pipeline_s,
        compute_s: m * (part.fwd + part.bwd),
        bubble_s: pipeline_s - m * max,
        tp_comm_s: m * (part.fwd_comm + part.bwd_comm - pp_msgs),
        pp_comm_s: m * pp_msgs,
        dp_exposed_s,
        optimizer_s,
        memory,
        fwd,
        bwd,
        simulated: false,
    };
    e.step_s = e.pipeline_s + e.dp_exposed_s + e.optimizer_s;
    e
}

/// Exposed data-parallel seconds and optimizer seconds of the slowest rank, whose last backward
/// takes `last_bwd` and one micro-batch's compute `mb_compute`.
fn data_parallel(
    job: &Job,
    l: &Layout,
    mach: &Machine,
    share: &RankShare,
    last_bwd: f64,
    mb_compute: f64,
) -> (f64, f64) {
    let n = share.params(job, l.tp);
    let shard = n / l.dp as f64;
    let optimizer =
        mach.sharing(job.gpus) * (mach.stream(32.0 * shard) + mach.profile.overhead.step_ms * 1e-3);
    if l.dp < 2 {
        return (0.0, optimizer);
    }
    let stride = l.tp * l.pp;
    let grad_bytes = 4.0 * n;
    let param_bytes = match mach.stack {
        Stack::Meshtrain => 4.0 * n,
        Stack::Megatron => 2.0 * n,
    };
    let (reduce, after) = match l.zero {
        0 => (mach.coll("all_reduce", l.dp, stride, grad_bytes), 0.0),
        _ => (
            mach.coll("reduce_scatter", l.dp, stride, grad_bytes),
            mach.coll("all_gather", l.dp, stride, param_bytes),
        ),
    };
    let gathers = if l.zero >= 3 {
        let per_mb = 2.0 * mach.coll("all_gather", l.dp, stride, param_bytes);
        l.grad_accum as f64 * (per_mb - mb_compute).max(0.0)
    } else {
        0.0
    };
    let exposed = match mach.stack {
        Stack::Meshtrain => {
            let buckets = (4.0 * n / (25.0 * 1048576.0)).ceil().max(1.0);
            (reduce - last_bwd).max(reduce / buckets) + after + gathers
        }
        Stack::Megatron => reduce + after + gathers,
    };
    (exposed, optimizer)
}

/// Replaces the closed-form pipeline time of `e` by the schedule simulator's makespan for its
/// per-rank times (buffered links: sends complete at once, as meshtrain's shared-memory and TCP
/// links and NCCL's do while a message fits).
pub fn refine(e: &mut Estimate, l: &Layout) -> Result<()> {
    if l.pp < 2 {
        // One stage: the closed form is the schedule (m forwards and backwards, no bubble).
        e.simulated = true;
        return Ok(());
    }
    let schedule = if l.virtual_stages > 1 {
        Schedule::Interleaved {
            virtual_stages: l.virtual_stages,
        }
    } else {
        Schedule::OneFOneB
    };
    let sim = simulate_ranks(
        schedule,
        l.pp,
        l.grad_accum,
        &e.fwd,
        &e.bwd,
        Delivery::Buffered,
    )?;
    let max = e
        .fwd
        .iter()
        .zip(&e.bwd)
        .map(|(f, b)| f + b)
        .fold(0.0, f64::max);
    e.pipeline_s = sim.makespan;
    e.bubble_s = sim.makespan - l.grad_accum as f64 * max;
    e.step_s = e.pipeline_s + e.dp_exposed_s + e.optimizer_s;
    e.simulated = true;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GptConfig;

    fn job() -> Job {
        Job::new("175b", &GptConfig::named("175b").unwrap(), 64, 64, 2048).unwrap()
    }

    fn layout(tp: usize, pp: usize, v: usize, dp: usize, m: usize) -> Layout {
        Layout {
            tp,
            pp,
            virtual_stages: v,
            dp,
            zero: 1,
            micro_batch: 1,
            grad_accum: m,
            sp: false,
            recompute: Recompute::None,
        }
    }

    /// `precision = "fp16"` costs what bf16 costs on the shipped GPU profiles: the same dense
    /// peak (A100, H100, MI250X datasheets) and the same bytes (2-byte weight copies and operand
    /// staging), so the whole estimate is equal; fp32 differs.
    #[test]
    fn fp16_costs_what_bf16_costs() {
        for name in ["dgx-a100", "h100-ib", "frontier"] {
            let p = Profile::load(name).unwrap();
            let (half, bf16) = (Machine::new(&p, Stack::Meshtrain, "fp16").unwrap(), Machine::new(&p, Stack::Meshtrain, "bf16").unwrap());
            assert_eq!(half.peak, bf16.peak, "{name}");
            let l = layout(8, 4, 1, 2, 8);
            let stages = vec![96 / 4; 4];
            let (e16, eb) = (estimate(&job(), &l, &half, &stages), estimate(&job(), &l, &bf16, &stages));
            assert_eq!(e16, eb, "{name}");
            let f32m = Machine::new(&p, Stack::Meshtrain, "fp32").unwrap();
            assert!(estimate(&job(), &l, &f32m, &stages).memory != eb.memory, "{name}: fp32 keeps no 16-bit copies");
        }
    }

    #[test]
    fn closed_form_matches_the_simulator_on_balanced_stages() {
        let p = Profile::load("dgx-a100").unwrap();
        let mach = Machine::new(&p, Stack::Megatron, "bf16").unwrap();
        let job = job();
        for (pp, v, m) in [(8, 1, 64), (8, 1, 8), (4, 2, 16)] {
            let l = layout(8, pp, v, 64 / (8 * pp), m);
            let stages = vec![96 / (pp * v); pp * v];
            let mut e = estimate(&job, &l, &mach, &stages);
            let closed = e.pipeline_s;
            refine(&mut e, &l).unwrap();
            // The head makes the last stage longer, which both account for; they agree closely.
            let rel = (e.pipeline_s - closed).abs() / closed;
            assert!(
                rel < 0.05,
                "pp {pp} v {v} m {m}: closed {closed} simulated {}",
                e.pipeline_s
            );
            assert!(e.bubble_s > 0.0 && e.step_s > e.pipeline_s);
        }
    }

    #[test]
    fn communication_costs_follow_the_link_tiers() {
        let p = Profile::load("dgx-a100").unwrap();
        let mach = Machine::new(&p, Stack::Megatron, "bf16").unwrap();
        // TP 8 inside a node is NVSwitch; TP 16 crosses nodes and is slower per byte.
        assert!(mach.link(8, 1).bandwidth > 200e9);
        assert!(mach.link(16, 1).bandwidth < 200e9);
        // A DP group 64 ranks apart shares the node's 8 NICs among 8 ranks: 25 GB/s * 0.8.
        assert!((mach.link(4, 64).bandwidth - 20e9).abs() < 1.0);
        // More TP: less compute per rank, more communication.
        let job = job();
        let a = estimate(&job, &layout(4, 8, 1, 2, 32), &mach, &[12; 8]);
        let b = estimate(&job, &layout(8, 8, 1, 1, 64), &mach, &[12; 8]);
        assert!(b.compute_s / 64.0 < a.compute_s / 32.0 && b.tp_comm_s / 64.0 > a.tp_comm_s / 32.0);
    }

    #[test]
    fn measured_overhead_and_collective_fits_are_costed() {
        use crate::plan::profile::{CollFit, Overhead};
        let p = Profile::load("dgx-a100").unwrap();
        let job = job();
        let l = Layout {
            zero: 0,
            ..layout(8, 8, 1, 1, 64)
        };
        let base = estimate(
            &job,
            &l,
            &Machine::new(&p, Stack::Megatron, "bf16").unwrap(),
            &[12; 8],
        );
        // 12 blocks per rank, 64 micro-batches: 12 * 64 * block_ms more pipeline compute on every
        // rank (so the closed form's sum-plus-max grows by (8 + 63) of them), step_ms once.
        let with = Profile {
            overhead: Overhead {
                block_ms: 0.5,
                step_ms: 3.0,
                source: String::new(),
            },
            ..p.clone()
        };
        let e = estimate(
            &job,
            &l,
            &Machine::new(&with, Stack::Megatron, "bf16").unwrap(),
            &[12; 8],
        );
        let want = 12.0 * 0.5e-3 * (8.0 + 63.0) + 3e-3;
        assert!(
            (e.step_s - base.step_s - want).abs() < 1e-9,
            "{} {} {want}",
            e.step_s,
            base.step_s
        );
        // A (slow) measured all-reduce fit replaces the ring model of the TP group's tier.
        let fit = CollFit {
            coll: "all_reduce".into(),
            algo: "ring".into(),
            tier: "intra".into(),
            ranks: 8,
            latency_us: 1000.0,
            busbw_gbs: 1.0,
            points: 6,
            max_error_pct: 1.0,
        };
        let slow = Profile {
            collectives: vec![fit],
            ..p.clone()
        };
        let mach = Machine::new(&slow, Stack::Megatron, "bf16").unwrap();
        let bytes = 1e6;
        let want = 1e-3 + bytes * crate::comm::stats::bus_factor("all_reduce", 8) / 1e9;
        assert!((mach.coll("all_reduce", 8, 1, bytes) - want).abs() < 1e-12);
        // No fit for the inter tier or for all_gather: the ring model on the profile's links.
        let ring = Machine::new(&p, Stack::Megatron, "bf16").unwrap();
        assert_eq!(
            mach.coll("all_reduce", 16, 1, bytes),
            ring.coll("all_reduce", 16, 1, bytes)
        );
        assert_eq!(
            mach.coll("all_gather", 8, 1, bytes),
            ring.coll("all_gather", 8, 1, bytes)
        );
        assert!(estimate(&job, &l, &mach, &[12; 8]).tp_comm_s > base.tp_comm_s);
    }

    #[test]
    fn ranks_sharing_a_nodes_cores_compute_that_much_slower() {
        use crate::plan::profile::Overhead;
        let base = Profile {
            overhead: Overhead {
                block_ms: 0.5,
                step_ms: 3.0,
                source: String::new(),
            },
            ..Profile::load("dgx-a100").unwrap()
        };
        let shared = Profile {
            cores_per_node: Some(2.0),
            ..base.clone()
        };
        let (own, two) = (
            Machine::new(&base, Stack::Meshtrain, "bf16").unwrap(),
            Machine::new(&shared, Stack::Meshtrain, "bf16").unwrap(),
        );
        // 8 ranks on a node of 8 devices and 2 cores: 4 ranks per core; 2 ranks: none shared; 16
        // ranks still put 8 on a node.
        assert_eq!(
            (
                two.sharing(8),
                two.sharing(2),
                two.sharing(16),
                own.sharing(8)
            ),
            (4.0, 1.0, 4.0, 1.0)
        );
        let c = GptConfig::named("tiny").unwrap();
        let job = Job::new("tiny", &c, 8, 16, 64).unwrap();
        for l in [
            Layout {
                zero: 0,
                ..layout(1, 1, 1, 8, 1)
            },
            layout(2, 1, 1, 4, 2),
        ] {
            let stages = vec![c.n_layer / l.pp; l.pp];
            let (a, b) = (
                estimate(&job, &l, &own, &stages),
                estimate(&job, &l, &two, &stages),
            );
            // Compute (GEMMs, kernels, per-block overhead) and the optimizer (with its per-step
            // overhead) exactly 4x; every communication term as it was.
            let rel = |x: f64, y: f64| (x - y).abs() / y;
            assert!(
                rel(b.compute_s, 4.0 * a.compute_s) < 1e-12,
                "{} {}",
                b.compute_s,
                a.compute_s
            );
            assert!(rel(b.optimizer_s, 4.0 * a.optimizer_s) < 1e-12);
            assert_eq!(
                (b.tp_comm_s, b.pp_comm_s, b.bubble_s),
                (a.tp_comm_s, a.pp_comm_s, a.bubble_s)
            );
            assert!(rel(b.pipeline_s - a.pipeline_s, 3.0 * a.compute_s) < 1e-12);
        }
        // A job of 2 ranks on the same profile is not slowed.
        let job2 = Job::new("tiny", &c, 2, 16, 64).unwrap();
        let l = layout(1, 1, 1, 2, 8);
        let n = c.n_layer;
        assert_eq!(
            estimate(&job2, &l, &own, &[n]).step_s,
            estimate(&job2, &l, &two, &[n]).step_s
        );
    }

    #[test]
    fn recomputation_costs_time() {
        let p = Profile::load("dgx-a100").unwrap();
        let mach = Machine::new(&p, Stack::Megatron, "bf16").unwrap();
        let job = job();
        let l = layout(8, 8, 1, 1, 64);
        let t = |r| {
            estimate(
                &job,
                &Layout {
                    recompute: r,
                    sp: true,
                    ..l
                },
                &mach,
                &[12; 8],
            )
            .step_s
        };
        let (none, sel, full) = (
            t(Recompute::None),
            t(Recompute::Selective),
            t(Recompute::Full),
        );
        assert!(
            none < sel && sel < full && full / none > 1.25 && full / none < 1.40,
            "{none} {sel} {full}"
        );
    }
}
