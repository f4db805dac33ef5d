//! Activation recomputation ([`Recompute`]) in the shard executor: every mode gives the losses
//! and gradients of keeping every activation, bit for bit, in fp32 and bf16, on one rank, with
//! tensor and sequence parallelism, and with micro-batches in flight (two slots whose backwards
//! run in reverse order, sharing the one set of work buffers); the executor's activation memory
//! drops by exactly what the slots no longer keep, less the work buffers.

use super::device_gpt::{StageInput, StageOutput};
use super::init::Initializer;
use super::tp_layout::StageSpec;
use super::{ActDims, DeviceGpt, DeviceTp, ExecOptions, GptConfig, ParamLayout, Precision, Recompute};
use crate::comm::testing::run_ranks;
use crate::comm::{CommConfig, Communicator};
use crate::device::Device;

const B: usize = 2;
const T: usize = 8;
/// Activation slots (micro-batches in flight).
const SLOTS: usize = 2;

fn cfg() -> GptConfig {
    GptConfig { n_layer: 3, n_head: 4, n_embd: 32, vocab_size: 200, max_seq_len: 16, llama: None }
}

/// Tokens and targets (B, T) of micro-batch `i`.
fn batch(i: usize) -> (Vec<u32>, Vec<u32>) {
    let v = cfg().vocab_size;
    let tokens = (0..B * T).map(|k| ((k * 37 + i * 11 + 5) % v) as u32).collect();
    let targets = (0..B * T).map(|k| ((k * 13 + i * 29 + 1) % v) as u32).collect();
    (tokens, targets)
}

/// The whole model (or this rank's TP shard of it over `comm`, sequence parallel with `sp`) with
/// `SLOTS` slots, initialised from seed 3.
fn model(comm: Option<&Communicator>, sp: bool, exec: ExecOptions) -> DeviceGpt {
    model_of(cfg(), comm, sp, exec)
}

/// [`model`] of the shape `cfg`.
fn model_of(cfg: GptConfig, comm: Option<&Communicator>, sp: bool, exec: ExecOptions) -> DeviceGpt {
    let tp = comm.map(|c| DeviceTp::new(c.split(Some(0), c.rank() as i64).unwrap().unwrap()).unwrap());
    let n = super::ShardLayout::new(&cfg, comm.map_or(0, |c| c.rank()), comm.map_or(1, |c| c.size()), &StageSpec::whole(&cfg))
        .unwrap()
        .total_len();
    let mut m = DeviceGpt::stage(Device::Cpu, cfg, (B, T), vec![0.0; n], exec, (tp, sp), StageSpec::whole(&cfg), SLOTS).unwrap();
    m.init_params(&Initializer::new(&cfg, &ParamLayout::new(&cfg), 3)).unwrap();
    m
}

/// A Llama of the same size: 4 query heads on 2 KV heads, SwiGLU width 48.
fn llama_cfg() -> GptConfig {
    let mut c = GptConfig { llama: GptConfig::named("llama-tiny").unwrap().llama, ..cfg() };
    c.llama.as_mut().unwrap().ffn_dim = 48;
    c
}

/// Llama's blocks (RMSNorm, RoPE, GQA, SwiGLU) recompute bit for bit too: one rank in fp32 and
/// bf16, TP 2 (KV heads split) and TP 4 (KV heads shared) with sequence parallelism.
#[test]
fn llama_recomputation_is_bitwise() {
    for precision in [Precision::Fp32, Precision::Bf16] {
        let runs: Vec<_> = MODES.iter().map(|&recompute| run(&mut model_of(llama_cfg(), None, false, ExecOptions { precision, recompute }))).collect();
        for (mode, got) in MODES.iter().zip(&runs).skip(1) {
            assert_eq!(got.0, runs[0].0, "llama {precision:?} {mode:?}: losses differ");
            assert!(got.1 == runs[0].1, "llama {precision:?} {mode:?}: gradients differ");
        }
        assert!(runs[0].1.iter().any(|&g| g != 0), "the gradients are not all zero");
    }
    for tp in [2, 4] {
        let results = run_ranks(tp, CommConfig::default(), move |c| {
            let exec = |recompute| ExecOptions { precision: Precision::Fp32, recompute };
            MODES.iter().map(|&r| run(&mut model_of(llama_cfg(), Some(&c), true, exec(r)))).collect::<Vec<_>>()
        });
        for (rank, runs) in results.iter().enumerate() {
            for (mode, got) in MODES.iter().zip(runs).skip(1) {
                assert_eq!(got.0, runs[0].0, "llama tp {tp}, rank {rank}, {mode:?}: losses differ");
                assert!(got.1 == runs[0].1, "llama tp {tp}, rank {rank}, {mode:?}: gradients differ");
            }
        }
    }
}

/// Forwards of micro-batches 0 and 1 into the two slots, then their backwards in reverse order,
/// twice (gradients accumulate): the losses' bits and the reported gradients' bits.
fn run(m: &mut DeviceGpt) -> (Vec<u32>, Vec<u32>) {
    let mut losses = Vec::new();
    for round in 0..2 {
        for slot in 0..SLOTS {
            let (x, y) = batch(round * SLOTS + slot);
            match m.forward_stage(0, slot, StageInput::Tokens(&x), Some(&y)).unwrap() {
                StageOutput::Loss(l) => losses.push(l.to_bits()),
                StageOutput::Hidden(_) => panic!("the whole model ends in the loss"),
            }
        }
        for slot in (0..SLOTS).rev() {
            assert!(m.backward_stage(0, slot, None).unwrap().is_none());
        }
    }
    let mut grads = Vec::new();
    m.report_grads(&mut |_, g| grads = g.iter().map(|x| x.to_bits()).collect()).unwrap();
    (losses, grads)
}

const MODES: [Recompute; 3] = [Recompute::None, Recompute::Selective, Recompute::Full];

#[test]
fn every_mode_gives_the_bits_of_keeping_every_activation() {
    for precision in [Precision::Fp32, Precision::Bf16] {
        let runs: Vec<_> = MODES.iter().map(|&recompute| run(&mut model(None, false, ExecOptions { precision, recompute }))).collect();
        for (mode, got) in MODES.iter().zip(&runs).skip(1) {
            assert_eq!(got.0, runs[0].0, "{precision:?} {mode:?}: losses differ");
            assert!(got.1 == runs[0].1, "{precision:?} {mode:?}: gradients differ");
        }
        assert!(runs[0].1.iter().any(|&g| g != 0), "the gradients are not all zero");
    }
}

#[test]
fn tensor_and_sequence_parallel_recomputation_is_bitwise() {
    for sp in [false, true] {
        let results = run_ranks(2, CommConfig::default(), move |c| {
            let exec = |recompute| ExecOptions { precision: Precision::Fp32, recompute };
            MODES.iter().map(|&r| run(&mut model(Some(&c), sp, exec(r)))).collect::<Vec<_>>()
        });
        for (rank, runs) in results.iter().enumerate() {
            for (mode, got) in MODES.iter().zip(runs).skip(1) {
                assert_eq!(got.0, runs[0].0, "sp {sp}, rank {rank}, {mode:?}: losses differ");
                assert!(got.1 == runs[0].1, "sp {sp}, rank {rank}, {mode:?}: gradients differ");
            }
        }
    }
}

#[test]
fn activation_memory_drops_by_what_the_slots_no_longer_keep() {
    let elements = |recompute| model(None, false, ExecOptions { precision: Precision::Fp32, recompute }).activation_elements();
    let d = |recompute| ActDims { recompute, ..ActDims::of_rank(&cfg(), B, T, 1, false) };
    let slot = |r| SLOTS * d(r).slot_elements(cfg().n_layer, true, true);
    let (none, selective, full) = (elements(Recompute::None), elements(Recompute::Selective), elements(Recompute::Full));
    let dn = d(Recompute::None);
    // Selective: each slot's blocks drop the probabilities; one set (with its output) is work.
    assert_eq!(none - selective, SLOTS * cfg().n_layer * dn.att - (dn.att + dn.bt * dn.cl));
    assert_eq!(d(Recompute::Selective).recompute_elements(), dn.att + dn.bt * dn.cl);
    // Full: each slot keeps one (R, C) output per block; one whole block's set is work.
    let whole_block = d(Recompute::Full).recompute_elements();
    assert_eq!(none - full, slot(Recompute::None) - slot(Recompute::Full) - whole_block);
    assert_eq!(slot(Recompute::None) - slot(Recompute::Full), SLOTS * cfg().n_layer * (whole_block - dn.rows * dn.c));
    assert!(full < selective && selective < none);
}
