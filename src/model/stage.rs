//! The executor of one (tensor-parallel rank, pipeline stage) shard of a GPT-2, on CPU in f32.
//!
//! A [`Stage`] runs the model chunks of `spec.chunks` (each a contiguous range of blocks; several
//! only under the interleaved pipeline schedule), plus the embedding at the start of chunk 0 when
//! `first` and the final LayerNorm, tied head and loss at the end of the last chunk when `last`,
//! with the parameter shard of [`ShardLayout`] (all chunks in one flat buffer), and talks to the
//! other ranks of its TP group only through [`TpComm`]. Megatron-style TP:
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
//! Parameters may be sharded over data parallelism (ZeRO-3): with a [`ParamGate`] installed, the
//! stage asks it for each unit (`wte`+`wpe`, a block, `lnf`+`wte`) right before reading it,
//! naming the unit it reads next so that the gate can prefetch it.
//!
//! Invariants: `backward` ADDS into the gradients; a `backward(chunk, slot)` needs a
//! `forward(chunk, slot)` since that slot's previous backward; each (chunk, slot) keeps its own
//! activations, so a pipeline may run several micro-batches' forwards before their backwards, in
//! any order; every TP rank calls the same methods in the same order (SPMD). Hidden states
//! exchanged with neighbouring stages are this rank's rows: (B*T/tp, C) with `sp`, else the full
//! (B*T, C) (same on every TP rank).

use std::ops::Range;

use super::stage_buffers::{Dims, Scratch, SlotActs};
use super::stage_compute::{
    block_backward, block_forward, embedding_backward, head_backward, head_forward, reduce_rows,
};
use super::init::Initializer;
use super::param_gate::ParamGate;
use super::tp_comm::TpComm;
use super::tp_layout::{ShardLayout, StageSpec};
use super::vocab_parallel::{embedding_shard_forward, position_forward, real_columns};
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

/// The shard executor; see the module documentation.
pub struct Stage {
    config: GptConfig,
    spec: StageSpec,
    layout: ShardLayout,
    tp_rank: usize,
    tp_size: usize,
    /// One per chunk of `spec.chunks`.
    chunks: Vec<Chunk>,
    /// This shard's parameters and gradients ([`ShardLayout`] order).
    params: Vec<f32>,
    grads: Vec<f32>,
    s: Scratch,
    /// Makes parameter units resident before use (ZeRO-3); None: all always resident.
    gate: Option<Box<dyn ParamGate>>,
}

/// One model chunk: its blocks, sizes and per-micro-batch activations.
struct Chunk {
    /// Blocks (global indices).
    layers: Range<usize>,
    /// Sizes, with `nl` = this chunk's block count.
    d: Dims,
    /// Whether the chunk starts with the embedding / ends with the head and loss.
    embeds: bool,
    ends: bool,
    slots: Vec<SlotActs>,
}

/// Shape and sizes only: the buffers are far too large to print.
impl std::fmt::Debug for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stage")
            .field("config", &self.config)
            .field("spec", &self.spec)
            .field("tp", &(self.tp_rank, self.tp_size))
            .field("sequence_parallel", &self.dims().sp)
            .field("params", &self.params.len())
            .field("slots", &self.chunks[0].slots.len())
            .finish()
    }
}

impl Stage {
    /// A stage with zero parameters (fill them with [`Stage::load_from_full`] or
    /// [`Stage::params_mut`]) for micro-batches of `micro_batch` x `seq_len` tokens, with
    /// activations for `slots` micro-batches in flight in each chunk.
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
            nl: 0,
            sp: sequence_parallel,
        };
        let chunks = spec
            .chunks
            .iter()
            .enumerate()
            .map(|(c, layers)| {
                let d = Dims { nl: layers.len(), ..d };
                let (embeds, ends) = (spec.embeds(c), spec.ends(c));
                Chunk {
                    layers: layers.clone(),
                    d,
                    embeds,
                    ends,
                    slots: (0..slots).map(|_| SlotActs::new(&d, embeds, ends)).collect(),
                }
            })
            .collect();
        let n = layout.total_len();
        Ok(Stage {
            chunks,
            s: Scratch::new(&d),
            config,
            spec,
            layout,
            tp_rank,
            tp_size,
            params: vec![0.0; n],
            grads: vec![0.0; n],
            gate: None,
        })
    }

    /// Sizes shared by all chunks (everything but the block count).
    fn dims(&self) -> &Dims {
        &self.chunks[0].d
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
        self.dims().sp
    }

    /// Elements of a [`StageInput::Hidden`] / [`StageOutput::Hidden`] / backward gradient.
    pub fn hidden_len(&self) -> usize {
        self.dims().rows * self.dims().c
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
        let slots = self.chunks.iter().flat_map(|c| &c.slots);
        slots.map(SlotActs::num_elements).sum::<usize>()
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
        self.grads.fill(0.0);
    }

    /// The parameter units in buffer order: `wte`, `wpe`, each block, `lnf` (those this stage
    /// holds). They partition the flat buffer; a [`ParamGate`] makes them resident one by one.
    pub fn units(&self) -> Vec<Range<usize>> {
        let l = &self.layout;
        let mut units: Vec<Range<usize>> = [l.wte(), l.wpe()].into_iter().flatten().collect();
        let blocks = self.chunks.iter().flat_map(|c| c.layers.clone());
        units.extend(blocks.map(|b| l.block_span(b)));
        units.extend(l.lnf().map(|(w, b)| w.start..b.end));
        units
    }

    /// Installs the gate that makes parameter units resident before use (ZeRO-3).
    pub fn set_gate(&mut self, gate: Box<dyn ParamGate>) {
        self.gate = Some(gate);
    }

    /// Gives back every gathered unit, keeping the owned shard (after the optimizer step or a
    /// load changed the shard). No-op without a gate.
    pub fn release_gathered(&mut self) -> Result<()> {
        match &mut self.gate {
            Some(g) => g.release_all(&mut self.params),
            None => Ok(()),
        }
    }

    /// The unit groups one forward and one backward of each chunk acquire, in order, one pass per
    /// (chunk, direction) (memory accounting).
    pub fn gather_passes(&self) -> Vec<Vec<Vec<Range<usize>>>> {
        (0..self.chunks.len()).flat_map(|c| [self.forward_units(c), self.backward_units(c)]).collect()
    }

    /// The units the head reads: the final LayerNorm and the tied `wte` shard.
    fn head_units(&self) -> Vec<Range<usize>> {
        let l = &self.layout;
        let lnf = l.lnf().map(|(w, b)| w.start..b.end);
        lnf.into_iter().chain(l.wte()).collect()
    }

    /// Units the backward of `chunk` reads, in order: head, blocks in reverse (the embedding's
    /// backward reads no parameters).
    fn backward_units(&self, chunk: usize) -> Vec<Vec<Range<usize>>> {
        let (l, ch) = (&self.layout, &self.chunks[chunk]);
        let mut out = Vec::new();
        if ch.ends {
            out.push(self.head_units());
        }
        out.extend(ch.layers.clone().rev().map(|b| vec![l.block_span(b)]));
        out
    }

    /// Units the forward of `chunk` reads, in order: embedding, blocks, head.
    fn forward_units(&self, chunk: usize) -> Vec<Vec<Range<usize>>> {
        let (l, ch) = (&self.layout, &self.chunks[chunk]);
        let mut out = Vec::new();
        if ch.embeds {
            out.push([l.wte(), l.wpe()].into_iter().flatten().collect());
        }
        out.extend(ch.layers.clone().map(|b| vec![l.block_span(b)]));
        if ch.ends {
            out.push(self.head_units());
        }
        out
    }

    /// Copies this shard's parameters out of a single-rank flat buffer (see [`super::Gpt`]).
    pub fn load_from_full(&mut self, full: &[f32]) -> Result<()> {
        self.layout.gather_from_full(full, &mut self.params)
    }

    /// Sets this shard's parameters from the whole model's initialisation `init`; with `only`,
    /// just the elements of those ranges of this shard's flat buffer (others untouched).
    pub fn init_params(&mut self, init: &Initializer, only: Option<&[Range<usize>]>) -> Result<()> {
        self.layout.init_local(init, &mut self.params, only)
    }

    /// Writes this shard's parameters into a single-rank flat buffer (other elements untouched).
    pub fn store_into_full(&self, full: &mut [f32]) -> Result<()> {
        self.layout.scatter_into_full(&self.params, full)
    }

    fn check_call(&self, op: &str, chunk: usize, slot: usize, tp: &dyn TpComm) -> Result<()> {
        if tp.tp_rank() != self.tp_rank || tp.tp_size() != self.tp_size {
            return Err(Error::InvalidArgument(format!(
                "{op}: stage built for TP rank {} of {}, called with a group where it is {} of {}",
                self.tp_rank,
                self.tp_size,
                tp.tp_rank(),
                tp.tp_size()
            )));
        }
        let Some(c) = self.chunks.get(chunk) else {
            return Err(Error::InvalidArgument(format!(
                "{op}: chunk {chunk} but the stage has {} chunks",
                self.chunks.len()
            )));
        };
        if slot >= c.slots.len() {
            return Err(Error::InvalidArgument(format!(
                "{op}: slot {slot} but the stage has {} slots",
                c.slots.len()
            )));
        }
        Ok(())
    }

    /// Runs chunk `chunk` on one micro-batch, keeping its activations in `slot` of the chunk. The
    /// embedding chunk (chunk 0 of the first stage) takes [`StageInput::Tokens`], the others
    /// [`StageInput::Hidden`]; the last chunk of the last stage needs `targets` (B, T) and returns
    /// the loss, the others return their hidden output.
    pub fn forward(
        &mut self,
        chunk: usize,
        slot: usize,
        input: StageInput<'_>,
        targets: Option<&[u32]>,
        tp: &dyn TpComm,
    ) -> Result<StageOutput<'_>> {
        self.check_call("forward", chunk, slot, tp)?;
        let plan = if self.gate.is_some() { self.forward_units(chunk) } else { Vec::new() };
        let Stage {
            params,
            layout,
            chunks,
            s,
            gate,
            ..
        } = self;
        let mut k = 0; // next unit group of `plan`
        let ch = &mut chunks[chunk];
        let d = ch.d;
        let a = &mut ch.slots[slot];
        a.forward_done = false;
        match (ch.embeds, input) {
            (true, StageInput::Tokens(tokens)) => {
                check_ids("tokens", tokens, &d)?;
                fetch(gate, params, &plan, k)?;
                k += 1;
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
            (embeds, _) => {
                return Err(Error::InvalidArgument(format!(
                    "forward: chunk {chunk} {} the tokens, so it takes {}",
                    if embeds { "embeds" } else { "does not embed" },
                    if embeds { "Tokens" } else { "Hidden" }
                )))
            }
        }
        match (ch.ends, targets) {
            (true, Some(tg)) => {
                check_ids("targets", tg, &d)?;
                a.targets.copy_from_slice(tg);
            }
            (false, None) => {}
            (ends, _) => {
                return Err(Error::InvalidArgument(format!(
                    "forward: targets must be given exactly to the model's last chunk (chunk {chunk} \
                     is {}the last)",
                    if ends { "" } else { "not " }
                )))
            }
        }
        for li in 0..d.nl {
            fetch(gate, params, &plan, k)?;
            k += 1;
            block_forward(
                &d,
                tp,
                params,
                &layout.block(ch.layers.start + li),
                a,
                s,
                li,
            )?;
        }
        a.forward_done = true;
        if ch.ends {
            fetch(gate, params, &plan, k)?;
            Ok(StageOutput::Loss(head_forward(
                &d, tp, params, layout, a, s,
            )?))
        } else {
            Ok(StageOutput::Hidden(a.hidden_out(&d)))
        }
    }

    /// Accumulates this micro-batch's gradients through chunk `chunk` (of the mean loss over its
    /// B*T positions) into the shard's gradients and frees the chunk's `slot`. `grad_output` is
    /// d(hidden output), except on the model's last chunk (None). A micro-batch's backward runs
    /// through the chunks in reverse order; over it, `on_grads_final(range, &mut grads[range])` is
    /// called as soon as a range of the flat gradients will not be written again (the callee may
    /// read them, e.g. into a data-parallel bucket, or reduce them in place): the final LayerNorm,
    /// then each block in reverse order, then `wte` and `wpe` at the very end of chunk 0 (`wte`
    /// gets the head's and then the embedding's contribution). The ranges are disjoint and cover
    /// the buffer. Returns d(hidden input) for the previous chunk (None for the embedding chunk).
    pub fn backward(
        &mut self,
        chunk: usize,
        slot: usize,
        grad_output: Option<&[f32]>,
        tp: &dyn TpComm,
        on_grads_final: &mut dyn FnMut(Range<usize>, &mut [f32]),
    ) -> Result<Option<&[f32]>> {
        self.check_call("backward", chunk, slot, tp)?;
        let plan = if self.gate.is_some() { self.backward_units(chunk) } else { Vec::new() };
        let Stage {
            params,
            grads,
            layout,
            chunks,
            s,
            gate,
            ..
        } = self;
        let mut k = 0; // next unit group of `plan`
        let ch = &mut chunks[chunk];
        let d = ch.d;
        let a = &mut ch.slots[slot];
        if !a.forward_done {
            return Err(Error::InvalidArgument(format!(
                "backward: slot {slot} has no forward since its last backward"
            )));
        }
        match (ch.ends, grad_output) {
            (true, None) => {
                fetch(gate, params, &plan, k)?;
                k += 1;
                head_backward(&d, tp, params, grads, layout, a, s)?;
                let (w, b) = layout.lnf().expect("a last stage holds lnf");
                on_grads_final(w.start..b.end, &mut grads[w.start..b.end]);
            }
            (false, Some(g)) => {
                check_len("backward: grad_output", g.len(), d.rows * d.c)?;
                s.dres.copy_from_slice(g);
            }
            (ends, _) => {
                return Err(Error::InvalidArgument(format!(
                    "backward: grad_output must be given exactly to chunks other than the model's \
                     last (chunk {chunk} is {}the last)",
                    if ends { "" } else { "not " }
                )))
            }
        }
        for li in (0..d.nl).rev() {
            let l = ch.layers.start + li;
            fetch(gate, params, &plan, k)?;
            k += 1;
            block_backward(&d, tp, params, grads, &layout.block(l), a, s, li)?;
            let span = layout.block_span(l);
            on_grads_final(span.clone(), &mut grads[span]);
        }
        if ch.embeds {
            embedding_backward(&d, tp, grads, layout, a, s)?;
        }
        a.forward_done = false;
        if chunk == 0 {
            for range in [layout.wte(), layout.wpe()].into_iter().flatten() {
                on_grads_final(range.clone(), &mut grads[range]);
            }
        }
        Ok(if ch.embeds { None } else { Some(&s.dres) })
    }
}

/// Asks the gate (if any) for unit group `k` of `plan`, naming group `k + 1` as the next.
fn fetch(
    gate: &mut Option<Box<dyn ParamGate>>,
    params: &mut [f32],
    plan: &[Vec<Range<usize>>],
    k: usize,
) -> Result<()> {
    match gate {
        Some(g) => g.acquire(&plan[k], plan.get(k + 1).map_or(&[], |n| n), params),
        None => Ok(()),
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
