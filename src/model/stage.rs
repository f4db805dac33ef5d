//! The executor of one (tensor-parallel rank, pipeline stage) shard of a GPT-2, on CPU in f32.
//!
//! A [`Stage`] runs the blocks `spec.layers` (plus the embedding when `first`, the final
//! LayerNorm, tied head and loss when `last`) with the parameter shard of [`ShardLayout`], and
//! talks to the other ranks of its TP group only through [`TpComm`]. Megatron-style TP:
//! - qkv and mlp.fc are column-parallel (rank `r` holds heads `r*NH/tp ..` and hidden units
//!   `r*4C/tp ..`; no communication), attn.proj and mlp.proj are row-parallel: each rank's
//!   partial (B*T, C) product is summed over TP, and the bias is added ONCE, after the sum;
//! - the embedding is vocab-parallel (each rank looks up the tokens in its `wte` rows, zeros
//!   elsewhere, and the partial rows are summed over TP); the tied head computes only the
//!   rank's (B*T, Vp/tp) logits and the cross-entropy combines per-shard max and sum-exp over
//!   TP (`vocab_parallel.rs`), never gathering full logits. `wte` gets the head's gradient and
//!   then, on the first stage, the embedding's; it is reported final last.
//!
//! Replicated tensors (LayerNorms, row-parallel biases, `wpe`): without sequence parallelism
//! every TP rank computes them from bitwise identical inputs (all activations entering them are
//! results of all-reduces, identical on every member, see `tp_comm.rs`), so their gradients are
//! already identical and need no communication. With sequence parallelism (`sp`), the residual
//! stream between the TP regions is split along the B*T rows (rank `r` holds rows
//! `r*B*T/tp ..`): LayerNorms, residual adds, biases and dropout-free element-wise work run on the
//! local rows, an all-gather of the LayerNorm output precedes each column-parallel linear, and the
//! row-parallel sums become reduce-scatters. Each rank then sees only its rows, so the gradients
//! of the replicated tensors are partial sums: they are computed per micro-batch into scratch,
//! all-reduced over TP, and only then added to the accumulated gradients (reducing the
//! accumulated buffer in place would multiply earlier micro-batches by tp).
//!
//! Invariants: `backward` ADDS into the gradients; a `backward(slot)` needs a `forward(slot)`
//! since the slot's previous backward; each slot keeps its own activations, so a pipeline may
//! run several micro-batches' forwards before their backwards, in any order; every TP rank calls
//! the same methods in the same order (SPMD). Hidden states exchanged with neighbouring stages are
//! this rank's rows: (B*T/tp, C) with `sp`, else the full (B*T, C) (same on every TP rank).

use std::ops::Range;

use super::activations::{slab, slab_mut};
use super::attention::{attention_backward, attention_forward, attention_scratch_len, AttnShape};
use super::gelu::{gelu_backward, gelu_forward};
use super::layernorm::{layernorm_backward, layernorm_forward};
use super::layout::BlockRanges;
use super::linear::{linear_backward, linear_forward};
use super::residual::residual_forward;
use super::tp_comm::TpComm;
use super::tp_layout::{ShardLayout, StageSpec};
use super::vocab_parallel::{
    cross_entropy_shard_backward, embedding_shard_backward, embedding_shard_forward, position_backward,
    position_forward, real_columns, shard_max, shard_sum_exp,
};
use super::GptConfig;
use crate::error::{Error, Result};

/// What a stage's forward consumes.
#[derive(Debug, Clone, Copy)]
pub enum StageInput<'a> {
    /// Token ids (B, T), for the first stage (all rows, also with sequence parallelism).
    Tokens(&'a [u32]),
    /// The previous stage's output: (B*T/tp, C) rows with sequence parallelism, else (B*T, C).
    Hidden(&'a [f32]),
}

/// What a stage's forward produces.
#[derive(Debug, Clone, Copy)]
pub enum StageOutput<'a> {
    /// Hidden state for the next stage, shaped like [`StageInput::Hidden`].
    Hidden(&'a [f32]),
    /// Mean cross-entropy over the micro-batch (last stage; the same on every TP rank).
    Loss(f32),
}

/// Sizes of one stage at one TP rank.
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    /// B * T.
    bt: usize,
    /// Rows of the residual stream held here: B*T/tp with sequence parallelism, else B*T.
    rows: usize,
    /// Global index of the first held row.
    row0: usize,
    c: usize,
    /// Attention width of the local heads (C / tp).
    cl: usize,
    /// Local MLP hidden width (4C / tp).
    hl: usize,
    /// Local heads (NH / tp) and head width.
    nhl: usize,
    hs: usize,
    /// Real vocabulary (V), local vocab rows (Vp / tp), first id of the shard, real ids in it.
    v: usize,
    vl: usize,
    vstart: usize,
    vreal: usize,
    /// Number of blocks in the stage.
    nl: usize,
    sp: bool,
}

impl Dims {
    fn attn(&self) -> AttnShape {
        AttnShape {
            b: self.b,
            t: self.t,
            nh: self.nhl,
            hs: self.hs,
        }
    }

    fn att_len(&self) -> usize {
        self.b * self.nhl * self.t * self.t
    }
}

/// One micro-batch's forward activations (L = blocks of the stage, R = held rows).
struct SlotActs {
    /// Tokens (B, T) (first stage) and targets (B, T) (last stage).
    tokens: Vec<u32>,
    targets: Vec<u32>,
    /// Input of the stage's first block (R, C): the embedding output or the received hidden.
    input: Vec<f32>,
    /// ln1 / ln2 row statistics (L, R).
    ln1_mean: Vec<f32>,
    ln1_rstd: Vec<f32>,
    ln2_mean: Vec<f32>,
    ln2_rstd: Vec<f32>,
    /// ln1 / ln2 outputs over all rows, gathered under SP (L, B*T, C).
    ln1: Vec<f32>,
    ln2: Vec<f32>,
    /// Local heads' q, k, v (L, B*T, 3C/tp), their output (L, B*T, C/tp), probabilities
    /// (L, B, NH/tp, T, T).
    qkv: Vec<f32>,
    atty: Vec<f32>,
    att: Vec<f32>,
    /// Residual stream after attention and after the MLP (L, R, C).
    residual2: Vec<f32>,
    residual3: Vec<f32>,
    /// Local MLP hidden before and after GELU (L, B*T, 4C/tp).
    fch: Vec<f32>,
    fch_gelu: Vec<f32>,
    /// Last stage: lnf output over all rows (B*T, C), its statistics (R), local logits
    /// (B*T, Vp/tp) and the global log-sum-exp per row (B*T).
    lnf: Vec<f32>,
    lnf_mean: Vec<f32>,
    lnf_rstd: Vec<f32>,
    logits: Vec<f32>,
    lse: Vec<f32>,
    /// Whether a forward ran since this slot's last backward.
    forward_done: bool,
}

impl SlotActs {
    fn new(d: &Dims, first: bool, last: bool) -> Self {
        let (l, r, bt, c) = (d.nl, d.rows, d.bt, d.c);
        let z = |n: usize| vec![0f32; n];
        let zl = |n: usize| if last { vec![0f32; n] } else { Vec::new() };
        SlotActs {
            tokens: vec![0; if first { bt } else { 0 }],
            targets: vec![0; if last { bt } else { 0 }],
            input: z(r * c),
            ln1_mean: z(l * r),
            ln1_rstd: z(l * r),
            ln2_mean: z(l * r),
            ln2_rstd: z(l * r),
            ln1: z(l * bt * c),
            ln2: z(l * bt * c),
            qkv: z(l * bt * 3 * d.cl),
            atty: z(l * bt * d.cl),
            att: z(l * d.att_len()),
            residual2: z(l * r * c),
            residual3: z(l * r * c),
            fch: z(l * bt * d.hl),
            fch_gelu: z(l * bt * d.hl),
            lnf: zl(bt * c),
            lnf_mean: zl(r),
            lnf_rstd: zl(r),
            logits: zl(bt * d.vl),
            lse: zl(bt),
            forward_done: false,
        }
    }

    /// Output of the stage's last block (R, C) (its input when the stage has no blocks).
    fn hidden_out(&self, d: &Dims) -> &[f32] {
        match d.nl {
            0 => &self.input,
            n => slab(&self.residual3, n - 1, d.rows * d.c),
        }
    }

    fn num_elements(&self) -> usize {
        let bufs = [
            &self.input,
            &self.ln1_mean,
            &self.ln1_rstd,
            &self.ln2_mean,
            &self.ln2_rstd,
            &self.ln1,
            &self.ln2,
            &self.qkv,
            &self.atty,
            &self.att,
            &self.residual2,
            &self.residual3,
            &self.fch,
            &self.fch_gelu,
            &self.lnf,
            &self.lnf_mean,
            &self.lnf_rstd,
            &self.logits,
            &self.lse,
        ];
        bufs.iter().map(|b| b.len()).sum()
    }
}

/// Scratch shared by all slots; every buffer is (re)written before it is read.
struct Scratch {
    /// A LayerNorm's output on the held rows before the gather (R, C).
    ln: Vec<f32>,
    /// A row-parallel linear's reduced output on the held rows (R, C).
    branch: Vec<f32>,
    /// A rank's partial sum over its shard, before the TP reduction (B*T, C).
    partial: Vec<f32>,
    /// d(residual) gathered over all rows (B*T, C).
    full: Vec<f32>,
    /// d(residual stream) on the held rows (R, C), d(LayerNorm output) (R, C).
    dres: Vec<f32>,
    dln: Vec<f32>,
    /// d attention output (B*T, C/tp), d qkv (B*T, 3C/tp), d MLP hidden (B*T, 4C/tp) x2.
    datty: Vec<f32>,
    dqkv: Vec<f32>,
    dfch_gelu: Vec<f32>,
    dfch: Vec<f32>,
    /// attention backward rows (cores, T).
    datt_row: Vec<f32>,
    /// d local logits (B*T, Vp/tp).
    dlogits: Vec<f32>,
    /// Cross-entropy row statistics: max | sum-exp | target logit (3, B*T).
    ce: Vec<f32>,
    /// One micro-batch's gradients of replicated tensors before the SP all-reduce:
    /// max(6C for a block, 2C for lnf, T*C for wpe).
    repl: Vec<f32>,
}

impl Scratch {
    fn new(d: &Dims) -> Self {
        let (r, bt, c) = (d.rows, d.bt, d.c);
        let z = |n: usize| vec![0f32; n];
        Scratch {
            ln: z(r * c),
            branch: z(r * c),
            partial: z(bt * c),
            full: z(bt * c),
            dres: z(r * c),
            dln: z(r * c),
            datty: z(bt * d.cl),
            dqkv: z(bt * 3 * d.cl),
            dfch_gelu: z(bt * d.hl),
            dfch: z(bt * d.hl),
            datt_row: z(attention_scratch_len(d.t)),
            dlogits: z(bt * d.vl),
            ce: z(3 * bt),
            repl: z((6 * c).max(d.t * c)),
        }
    }
}

/// The shard executor; see the module documentation.
pub struct Stage {
    config: GptConfig,
    spec: StageSpec,
    layout: ShardLayout,
    tp_rank: usize,
    tp_size: usize,
    d: Dims,
    /// This shard's parameters and gradients ([`ShardLayout`] order).
    params: Vec<f32>,
    grads: Vec<f32>,
    slots: Vec<SlotActs>,
    s: Scratch,
}

/// Shape and sizes only: the buffers are far too large to print.
impl std::fmt::Debug for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stage")
            .field("config", &self.config)
            .field("spec", &self.spec)
            .field("tp", &(self.tp_rank, self.tp_size))
            .field("sequence_parallel", &self.d.sp)
            .field("params", &self.params.len())
            .field("slots", &self.slots.len())
            .finish()
    }
}

impl Stage {
    /// A stage with zero parameters (fill them with [`Stage::load_from_full`] or
    /// [`Stage::params_mut`]) for micro-batches of `micro_batch` x `seq_len` tokens, with
    /// activations for `slots` micro-batches in flight.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: GptConfig,
        tp_rank: usize,
        tp_size: usize,
        spec: StageSpec,
        sequence_parallel: bool,
        micro_batch: usize,
        seq_len: usize,
        slots: usize,
    ) -> Result<Stage> {
        let layout = ShardLayout::new(&config, tp_rank, tp_size, &spec)?;
        if micro_batch == 0 || slots == 0 {
            return Err(Error::InvalidArgument(format!(
                "stage needs micro_batch >= 1 and slots >= 1 (got {micro_batch}, {slots})"
            )));
        }
        if seq_len == 0 || seq_len > config.max_seq_len {
            return Err(Error::config(
                "train.seq_len",
                format!(
                    "{seq_len} is not in 1..={} (model.max_seq_len)",
                    config.max_seq_len
                ),
            ));
        }
        let bt = micro_batch * seq_len;
        if sequence_parallel && bt % tp_size != 0 {
            return Err(Error::config(
                "parallel.sequence_parallel",
                format!("B*T = {bt} tokens are not divisible by tp {tp_size}"),
            ));
        }
        let rows = if sequence_parallel { bt / tp_size } else { bt };
        let (c, vl) = (config.n_embd, config.padded_vocab_size() / tp_size);
        let d = Dims {
            b: micro_batch,
            t: seq_len,
            bt,
            rows,
            row0: if sequence_parallel { tp_rank * rows } else { 0 },
            c,
            cl: c / tp_size,
            hl: 4 * c / tp_size,
            nhl: config.n_head / tp_size,
            hs: config.head_dim(),
            v: config.vocab_size,
            vl,
            vstart: tp_rank * vl,
            vreal: real_columns(tp_rank * vl, vl, config.vocab_size),
            nl: spec.layers.len(),
            sp: sequence_parallel,
        };
        let n = layout.total_len();
        Ok(Stage {
            slots: (0..slots)
                .map(|_| SlotActs::new(&d, spec.first, spec.last))
                .collect(),
            s: Scratch::new(&d),
            config,
            spec,
            layout,
            tp_rank,
            tp_size,
            d,
            params: vec![0.0; n],
            grads: vec![0.0; n],
        })
    }

    /// The model shape.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// Which part of the model this stage runs.
    pub fn spec(&self) -> &StageSpec {
        &self.spec
    }

    /// This shard's layout table.
    pub fn layout(&self) -> &ShardLayout {
        &self.layout
    }

    /// Whether activations between blocks are split along the rows over TP.
    pub fn sequence_parallel(&self) -> bool {
        self.d.sp
    }

    /// Elements of a [`StageInput::Hidden`] / [`StageOutput::Hidden`] / backward gradient.
    pub fn hidden_len(&self) -> usize {
        self.d.rows * self.d.c
    }

    /// Elements held by all slots' activations and the shared scratch (memory accounting).
    pub fn activation_elements(&self) -> usize {
        let s = &self.s;
        let scratch = [
            &s.ln,
            &s.branch,
            &s.partial,
            &s.full,
            &s.dres,
            &s.dln,
            &s.datty,
            &s.dqkv,
            &s.dfch_gelu,
            &s.dfch,
            &s.datt_row,
            &s.dlogits,
            &s.ce,
            &s.repl,
        ];
        self.slots.iter().map(SlotActs::num_elements).sum::<usize>()
            + scratch.iter().map(|b| b.len()).sum::<usize>()
    }

    /// Flat parameters of this shard.
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// Flat parameters, mutable (loading, optimizer).
    pub fn params_mut(&mut self) -> &mut [f32] {
        &mut self.params
    }

    /// Flat gradients of this shard (accumulated by `backward`).
    pub fn grads(&self) -> &[f32] {
        &self.grads
    }

    /// Flat gradients, mutable (data-parallel reduction, clipping).
    pub fn grads_mut(&mut self) -> &mut [f32] {
        &mut self.grads
    }

    /// Parameters and gradients together, both mutable.
    pub fn params_and_grads(&mut self) -> (&mut [f32], &mut [f32]) {
        (&mut self.params, &mut self.grads)
    }

    /// Sets all gradients to zero.
    pub fn zero_grad(&mut self) {
        self.grads.iter_mut().for_each(|g| *g = 0.0);
    }

    /// Copies this shard's parameters out of a single-rank flat buffer (see [`super::Gpt`]).
    pub fn load_from_full(&mut self, full: &[f32]) -> Result<()> {
        self.layout.gather_from_full(full, &mut self.params)
    }

    /// Writes this shard's parameters into a single-rank flat buffer (other elements untouched).
    pub fn store_into_full(&self, full: &mut [f32]) -> Result<()> {
        self.layout.scatter_into_full(&self.params, full)
    }

    fn check_call(&self, op: &str, slot: usize, tp: &dyn TpComm) -> Result<()> {
        if tp.tp_rank() != self.tp_rank || tp.tp_size() != self.tp_size {
            return Err(Error::InvalidArgument(format!(
                "{op}: stage built for TP rank {} of {}, called with a group where it is {} of {}",
                self.tp_rank,
                self.tp_size,
                tp.tp_rank(),
                tp.tp_size()
            )));
        }
        if slot >= self.slots.len() {
            return Err(Error::InvalidArgument(format!(
                "{op}: slot {slot} but the stage has {} slots",
                self.slots.len()
            )));
        }
        Ok(())
    }

    /// Runs the stage on one micro-batch, keeping its activations in `slot`. The first stage takes
    /// [`StageInput::Tokens`], the others [`StageInput::Hidden`]; the last stage needs `targets`
    /// (B, T) and returns the loss, the others return their hidden output.
    pub fn forward(
        &mut self,
        slot: usize,
        input: StageInput<'_>,
        targets: Option<&[u32]>,
        tp: &dyn TpComm,
    ) -> Result<StageOutput<'_>> {
        self.check_call("forward", slot, tp)?;
        let d = self.d;
        let Stage {
            params,
            layout,
            slots,
            s,
            spec,
            ..
        } = self;
        let a = &mut slots[slot];
        a.forward_done = false;
        match (spec.first, input) {
            (true, StageInput::Tokens(tokens)) => {
                check_ids("tokens", tokens, &d)?;
                a.tokens.copy_from_slice(tokens);
                let wte = &params[layout.wte().expect("a first stage holds wte")];
                embedding_shard_forward(&mut s.partial, tokens, wte, d.vstart, d.c);
                reduce_rows(&d, tp, &mut s.partial, &mut a.input)?;
                let wpe = &params[layout.wpe().expect("a first stage holds wpe")];
                position_forward(&mut a.input, wpe, d.row0, d.t, d.c);
            }
            (false, StageInput::Hidden(h)) => {
                check_len("forward: hidden input", h.len(), d.rows * d.c)?;
                a.input.copy_from_slice(h);
            }
            (first, _) => {
                return Err(Error::InvalidArgument(format!(
                    "forward: a {} stage takes {}",
                    if first { "first" } else { "non-first" },
                    if first { "Tokens" } else { "Hidden" }
                )))
            }
        }
        match (spec.last, targets) {
            (true, Some(tg)) => {
                check_ids("targets", tg, &d)?;
                a.targets.copy_from_slice(tg);
            }
            (false, None) => {}
            (last, _) => {
                return Err(Error::InvalidArgument(format!(
                    "forward: targets must be given exactly to the last stage (this one is {}last)",
                    if last { "" } else { "not " }
                )))
            }
        }
        for li in 0..d.nl {
            block_forward(&d, tp, params, &layout.block(spec.layers.start + li), a, s, li)?;
        }
        a.forward_done = true;
        if spec.last {
            Ok(StageOutput::Loss(head_forward(&d, tp, params, layout, a, s)?))
        } else {
            Ok(StageOutput::Hidden(a.hidden_out(&d)))
        }
    }

    /// Accumulates this micro-batch's gradients (of the mean loss over its B*T positions) into
    /// the shard's gradients and frees `slot`. `grad_output` is d(hidden output) for non-last
    /// stages (None on the last). Calls `on_grads_final(range, &mut grads[range])` as soon as a
    /// range of the flat gradients will not be written again by this backward (the callee may
    /// read them, e.g. into a data-parallel bucket, or reduce them in place): the final LayerNorm,
    /// then each block in reverse order, then `wte` and `wpe` at the very end (`wte` gets the
    /// head's and then the embedding's contribution). The ranges are disjoint and cover the
    /// buffer. Returns d(hidden input) for the previous stage (None on the first).
    pub fn backward(
        &mut self,
        slot: usize,
        grad_output: Option<&[f32]>,
        tp: &dyn TpComm,
        on_grads_final: &mut dyn FnMut(Range<usize>, &mut [f32]),
    ) -> Result<Option<&[f32]>> {
        self.check_call("backward", slot, tp)?;
        let d = self.d;
        let Stage {
            params,
            grads,
            layout,
            slots,
            s,
            spec,
            ..
        } = self;
        let a = &mut slots[slot];
        if !a.forward_done {
            return Err(Error::InvalidArgument(format!(
                "backward: slot {slot} has no forward since its last backward"
            )));
        }
        match (spec.last, grad_output) {
            (true, None) => {
                head_backward(&d, tp, params, grads, layout, a, s)?;
                let (w, b) = layout.lnf().expect("a last stage holds lnf");
                on_grads_final(w.start..b.end, &mut grads[w.start..b.end]);
            }
            (false, Some(g)) => {
                check_len("backward: grad_output", g.len(), d.rows * d.c)?;
                s.dres.copy_from_slice(g);
            }
            (last, _) => {
                return Err(Error::InvalidArgument(format!(
                    "backward: grad_output must be given exactly to non-last stages (this one is {}last)",
                    if last { "" } else { "not " }
                )))
            }
        }
        for li in (0..d.nl).rev() {
            let l = spec.layers.start + li;
            block_backward(&d, tp, params, grads, &layout.block(l), a, s, li)?;
            let span = layout.block_span(l);
            on_grads_final(span.clone(), &mut grads[span]);
        }
        if spec.first {
            embedding_backward(&d, tp, grads, layout, a, s)?;
        }
        a.forward_done = false;
        for range in [layout.wte(), layout.wpe()].into_iter().flatten() {
            on_grads_final(range.clone(), &mut grads[range]);
        }
        Ok(if spec.first { None } else { Some(&s.dres) })
    }
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(Error::InvalidArgument(format!(
            "{what} has {got} elements, expected {want}"
        )));
    }
    Ok(())
}

/// Checks a (B, T) id buffer against the real vocabulary.
fn check_ids(what: &str, ids: &[u32], d: &Dims) -> Result<()> {
    check_len(&format!("forward: {what}"), ids.len(), d.bt)?;
    if let Some((i, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= d.v) {
        return Err(Error::InvalidArgument(format!(
            "forward: {what}[{i}] = {id} is outside the vocabulary (size {})",
            d.v
        )));
    }
    Ok(())
}

/// full (B*T, C) = all ranks' held rows (R, C): a gather under SP, a copy otherwise.
fn to_full(d: &Dims, tp: &dyn TpComm, local: &[f32], full: &mut [f32]) -> Result<()> {
    if d.sp {
        tp.all_gather_rows(local, full)
    } else {
        full.copy_from_slice(local);
        Ok(())
    }
}

/// out (R, C) = the held rows of the TP sum of `partial` (B*T, C); `partial` is clobbered.
fn reduce_rows(d: &Dims, tp: &dyn TpComm, partial: &mut [f32], out: &mut [f32]) -> Result<()> {
    if d.sp {
        tp.reduce_scatter_rows(partial, out)
    } else {
        tp.all_reduce_sum(partial)?;
        out.copy_from_slice(partial);
        Ok(())
    }
}

/// out (N, OC) += bias (OC) on every row.
fn add_bias(out: &mut [f32], bias: &[f32]) {
    for row in out.chunks_exact_mut(bias.len()) {
        row.iter_mut().zip(bias).for_each(|(o, &b)| *o += b);
    }
}

/// dbias (OC) += column sums of dout (N, OC).
fn add_column_sums(dbias: &mut [f32], dout: &[f32]) {
    for row in dout.chunks_exact(dbias.len()) {
        dbias.iter_mut().zip(row).for_each(|(g, &x)| *g += x);
    }
}

fn zero(buf: &mut [f32]) {
    buf.iter_mut().for_each(|x| *x = 0.0);
}

/// Adds one micro-batch's replicated-tensor gradients `part` into `grad`, after summing them over
/// TP under SP (each rank saw only its rows); without SP they are already complete.
fn add_replicated(d: &Dims, tp: &dyn TpComm, part: &mut [f32], grad: &mut [f32]) -> Result<()> {
    if d.sp {
        tp.all_reduce_sum(part)?;
    }
    grad.iter_mut().zip(part.iter()).for_each(|(g, &p)| *g += p);
    Ok(())
}

/// Block `li` of the stage: residual3 = r2 + mlp(ln2(r2)), r2 = x + attn(ln1(x)).
fn block_forward(
    d: &Dims,
    tp: &dyn TpComm,
    p: &[f32],
    r: &BlockRanges,
    a: &mut SlotActs,
    s: &mut Scratch,
    li: usize,
) -> Result<()> {
    let (rc, bt, c) = (d.rows * d.c, d.bt, d.c);
    let (prev, rest) = a.residual3.split_at_mut(li * rc);
    let x: &[f32] = if li == 0 { &a.input } else { slab(prev, li - 1, rc) }; // (R, C)
    let residual3 = &mut rest[..rc]; // (R, C)
                                     // Attention: ln1 on the held rows, gathered, column-parallel qkv, local heads, row-parallel
                                     // projection summed over TP, bias once.
    let (mean, rstd) = (
        slab_mut(&mut a.ln1_mean, li, d.rows),
        slab_mut(&mut a.ln1_rstd, li, d.rows),
    );
    layernorm_forward(
        &mut s.ln,
        mean,
        rstd,
        x,
        &p[r.ln1_w.clone()],
        &p[r.ln1_b.clone()],
        c,
    );
    let ln1 = slab_mut(&mut a.ln1, li, bt * c); // (B*T, C)
    to_full(d, tp, &s.ln, ln1)?;
    let qkv = slab_mut(&mut a.qkv, li, bt * 3 * d.cl); // (B*T, 3C/tp)
    linear_forward(
        qkv,
        ln1,
        &p[r.qkv_w.clone()],
        Some(&p[r.qkv_b.clone()]),
        bt,
        c,
        3 * d.cl,
    );
    let atty = slab_mut(&mut a.atty, li, bt * d.cl); // (B*T, C/tp)
    attention_forward(atty, slab_mut(&mut a.att, li, d.att_len()), qkv, d.attn());
    linear_forward(&mut s.partial, atty, &p[r.attn_proj_w.clone()], None, bt, d.cl, c);
    reduce_rows(d, tp, &mut s.partial, &mut s.branch)?;
    add_bias(&mut s.branch, &p[r.attn_proj_b.clone()]);
    let residual2 = slab_mut(&mut a.residual2, li, rc); // (R, C)
    residual_forward(residual2, x, &s.branch);
    // MLP: the same pattern with the column-parallel fc and the row-parallel proj.
    let (mean, rstd) = (
        slab_mut(&mut a.ln2_mean, li, d.rows),
        slab_mut(&mut a.ln2_rstd, li, d.rows),
    );
    layernorm_forward(
        &mut s.ln,
        mean,
        rstd,
        residual2,
        &p[r.ln2_w.clone()],
        &p[r.ln2_b.clone()],
        c,
    );
    let ln2 = slab_mut(&mut a.ln2, li, bt * c); // (B*T, C)
    to_full(d, tp, &s.ln, ln2)?;
    let fch = slab_mut(&mut a.fch, li, bt * d.hl); // (B*T, 4C/tp)
    linear_forward(
        fch,
        ln2,
        &p[r.fc_w.clone()],
        Some(&p[r.fc_b.clone()]),
        bt,
        c,
        d.hl,
    );
    let fch_gelu = slab_mut(&mut a.fch_gelu, li, bt * d.hl); // (B*T, 4C/tp)
    gelu_forward(fch_gelu, fch);
    linear_forward(
        &mut s.partial,
        fch_gelu,
        &p[r.mlp_proj_w.clone()],
        None,
        bt,
        d.hl,
        c,
    );
    reduce_rows(d, tp, &mut s.partial, &mut s.branch)?;
    add_bias(&mut s.branch, &p[r.mlp_proj_b.clone()]);
    residual_forward(residual3, residual2, &s.branch);
    Ok(())
}

/// Backward of block `li`: on entry `s.dres` holds d(block output) (R, C), on exit d(block input).
#[allow(clippy::too_many_arguments)]
fn block_backward(
    d: &Dims,
    tp: &dyn TpComm,
    p: &[f32],
    g: &mut [f32],
    r: &BlockRanges,
    a: &SlotActs,
    s: &mut Scratch,
    li: usize,
) -> Result<()> {
    let (rc, bt, c) = (d.rows * d.c, d.bt, d.c);
    let x: &[f32] = if li == 0 {
        &a.input
    } else {
        slab(&a.residual3, li - 1, rc)
    }; // (R, C)
       // Replicated tensors' gradients of this micro-batch: ln1 w, b | attn.proj b | ln2 w, b |
       // mlp.proj b, C each.
    let repl = &mut s.repl[..6 * c];
    zero(repl);
    let (ln1_g, rest) = repl.split_at_mut(2 * c);
    let (attn_b_g, rest) = rest.split_at_mut(c);
    let (ln2_g, mlp_b_g) = rest.split_at_mut(2 * c);
    // MLP sub-block; its output gradient is the residual stream's.
    add_column_sums(mlp_b_g, &s.dres);
    to_full(d, tp, &s.dres, &mut s.full)?;
    zero(&mut s.dfch_gelu);
    let fch_gelu = slab(&a.fch_gelu, li, bt * d.hl); // (B*T, 4C/tp)
    let (w, dw) = (&p[r.mlp_proj_w.clone()], &mut g[r.mlp_proj_w.clone()]);
    linear_backward(&mut s.dfch_gelu, dw, None, &s.full, fch_gelu, w, bt, d.hl, c);
    zero(&mut s.dfch);
    gelu_backward(&mut s.dfch, slab(&a.fch, li, bt * d.hl), &s.dfch_gelu);
    zero(&mut s.partial);
    let (dw, db) = pair_mut(g, r.fc_w.clone(), r.fc_b.clone());
    let ln2 = slab(&a.ln2, li, bt * c); // (B*T, C)
    linear_backward(
        &mut s.partial,
        dw,
        Some(db),
        &s.dfch,
        ln2,
        &p[r.fc_w.clone()],
        bt,
        c,
        d.hl,
    );
    reduce_rows(d, tp, &mut s.partial, &mut s.dln)?;
    let (ln2_w_g, ln2_b_g) = ln2_g.split_at_mut(c);
    let (mean, rstd) = (slab(&a.ln2_mean, li, d.rows), slab(&a.ln2_rstd, li, d.rows));
    let residual2 = slab(&a.residual2, li, rc); // (R, C)
    let w = &p[r.ln2_w.clone()];
    layernorm_backward(&mut s.dres, ln2_w_g, ln2_b_g, &s.dln, residual2, w, mean, rstd, c);
    // Attention sub-block.
    add_column_sums(attn_b_g, &s.dres);
    to_full(d, tp, &s.dres, &mut s.full)?;
    zero(&mut s.datty);
    let atty = slab(&a.atty, li, bt * d.cl); // (B*T, C/tp)
    let (w, dw) = (&p[r.attn_proj_w.clone()], &mut g[r.attn_proj_w.clone()]);
    linear_backward(&mut s.datty, dw, None, &s.full, atty, w, bt, d.cl, c);
    zero(&mut s.dqkv);
    let (qkv, att) = (slab(&a.qkv, li, bt * 3 * d.cl), slab(&a.att, li, d.att_len()));
    attention_backward(&mut s.dqkv, &mut s.datt_row, &s.datty, qkv, att, d.attn());
    zero(&mut s.partial);
    let (dw, db) = pair_mut(g, r.qkv_w.clone(), r.qkv_b.clone());
    let ln1 = slab(&a.ln1, li, bt * c); // (B*T, C)
    linear_backward(
        &mut s.partial,
        dw,
        Some(db),
        &s.dqkv,
        ln1,
        &p[r.qkv_w.clone()],
        bt,
        c,
        3 * d.cl,
    );
    reduce_rows(d, tp, &mut s.partial, &mut s.dln)?;
    let (ln1_w_g, ln1_b_g) = ln1_g.split_at_mut(c);
    let (mean, rstd) = (slab(&a.ln1_mean, li, d.rows), slab(&a.ln1_rstd, li, d.rows));
    let w = &p[r.ln1_w.clone()];
    layernorm_backward(&mut s.dres, ln1_w_g, ln1_b_g, &s.dln, x, w, mean, rstd, c);
    // One TP reduction (under SP) for all of the block's replicated gradients.
    let repl = &mut s.repl[..6 * c];
    if d.sp {
        tp.all_reduce_sum(repl)?;
    }
    let targets = [
        &r.ln1_w,
        &r.ln1_b,
        &r.attn_proj_b,
        &r.ln2_w,
        &r.ln2_b,
        &r.mlp_proj_b,
    ];
    for (range, part) in targets.into_iter().zip(repl.chunks_exact(c)) {
        g[range.clone()].iter_mut().zip(part).for_each(|(g, &x)| *g += x);
    }
    Ok(())
}

/// Final LayerNorm, local logits and the vocab-parallel mean cross-entropy.
fn head_forward(
    d: &Dims,
    tp: &dyn TpComm,
    p: &[f32],
    layout: &ShardLayout,
    a: &mut SlotActs,
    s: &mut Scratch,
) -> Result<f32> {
    let (bt, c) = (d.bt, d.c);
    let (lnf_w, lnf_b) = layout.lnf().expect("a last stage holds lnf");
    let x = match d.nl {
        0 => &a.input,
        n => slab(&a.residual3, n - 1, d.rows * c),
    }; // (R, C)
    layernorm_forward(
        &mut s.ln,
        &mut a.lnf_mean,
        &mut a.lnf_rstd,
        x,
        &p[lnf_w],
        &p[lnf_b],
        c,
    );
    to_full(d, tp, &s.ln, &mut a.lnf)?;
    let wte = &p[layout.wte().expect("a last stage holds wte")];
    linear_forward(&mut a.logits, &a.lnf, wte, None, bt, c, d.vl);
    let (max, stats) = s.ce.split_at_mut(bt);
    shard_max(max, &a.logits, d.vreal);
    tp.all_reduce_max(max)?;
    let (sum, target_logit) = stats.split_at_mut(bt);
    shard_sum_exp(sum, target_logit, &a.logits, max, &a.targets, d.vstart, d.vreal);
    tp.all_reduce_sum(stats)?;
    let (sum, target_logit) = stats.split_at(bt);
    let mut total = 0f64;
    for (i, l) in a.lse.iter_mut().enumerate() {
        *l = max[i] + sum[i].ln();
        total += (*l - target_logit[i]) as f64;
    }
    Ok((total / bt as f64) as f32)
}

/// Backward of the loss, head and final LayerNorm: leaves d(stage output) in `s.dres`.
fn head_backward(
    d: &Dims,
    tp: &dyn TpComm,
    p: &[f32],
    g: &mut [f32],
    layout: &ShardLayout,
    a: &SlotActs,
    s: &mut Scratch,
) -> Result<()> {
    let (bt, c) = (d.bt, d.c);
    zero(&mut s.dlogits);
    let dloss = (1.0 / bt as f64) as f32;
    cross_entropy_shard_backward(
        &mut s.dlogits,
        &a.logits,
        &a.lse,
        &a.targets,
        dloss,
        d.vstart,
        d.vreal,
    );
    let wte = layout.wte().expect("a last stage holds wte");
    zero(&mut s.partial);
    linear_backward(
        &mut s.partial,
        &mut g[wte.clone()],
        None,
        &s.dlogits,
        &a.lnf,
        &p[wte],
        bt,
        c,
        d.vl,
    );
    reduce_rows(d, tp, &mut s.partial, &mut s.dln)?;
    zero(&mut s.dres);
    let (lnf_w, lnf_b) = layout.lnf().expect("a last stage holds lnf");
    let part = &mut s.repl[..2 * c];
    zero(part);
    let (dw, db) = part.split_at_mut(c);
    let x = a.hidden_out(d); // (R, C)
    layernorm_backward(
        &mut s.dres,
        dw,
        db,
        &s.dln,
        x,
        &p[lnf_w.clone()],
        &a.lnf_mean,
        &a.lnf_rstd,
        c,
    );
    add_replicated(d, tp, &mut s.repl[..2 * c], &mut g[lnf_w.start..lnf_b.end])
}

/// Backward of the vocab-parallel embedding from d(block 0 input) in `s.dres`.
fn embedding_backward(
    d: &Dims,
    tp: &dyn TpComm,
    g: &mut [f32],
    layout: &ShardLayout,
    a: &SlotActs,
    s: &mut Scratch,
) -> Result<()> {
    let tc = d.t * d.c;
    zero(&mut s.repl[..tc]);
    position_backward(&mut s.repl[..tc], &s.dres, d.row0, d.t, d.c);
    let wpe = layout.wpe().expect("a first stage holds wpe");
    add_replicated(d, tp, &mut s.repl[..tc], &mut g[wpe.start..wpe.start + tc])?;
    to_full(d, tp, &s.dres, &mut s.full)?;
    let wte = layout.wte().expect("a first stage holds wte");
    embedding_shard_backward(&mut g[wte], &s.full, &a.tokens, d.vstart, d.c);
    Ok(())
}

/// Disjoint mutable views of two ranges of `buf`; `first` must end before `second` starts.
fn pair_mut(buf: &mut [f32], first: Range<usize>, second: Range<usize>) -> (&mut [f32], &mut [f32]) {
    assert!(
        first.end <= second.start,
        "pair_mut: {first:?} overlaps or follows {second:?}"
    );
    let (lo, hi) = buf.split_at_mut(second.start);
    (&mut lo[first], &mut hi[..second.end - second.start])
}
