//! The device model's tensor-parallel shard (CPU arm, fp32) against the CPU shard executor
//! ([`super::Stage`]) on real ranks: the same initial shard, the same loss on every rank, and
//! one step's gradients of every tensor. Both run the same Megatron split and call the same
//! reference functions on the CPU arm (the device GEMM's CPU arm makes the stage's BLAS calls,
//! the staged device collectives the host collectives), so the gradients agree bit for bit.

use super::device_tp::DeviceTp;
use super::init::Initializer;
use super::layout::ParamLayout;
use super::tp_layout::StageSpec;
use super::{DeviceGpt, GptConfig, Precision, Stage, StageInput, StageOutput};
use crate::comm::testing::run_ranks;
use crate::comm::CommConfig;
use crate::device::Device;

const B: usize = 2;
const T: usize = 8;

/// V = 200 pads to 256: with tp = 4 the last shard (ids 192..256) has 8 real ids and 56 padded.
fn cfg() -> GptConfig {
    GptConfig { n_layer: 2, n_head: 4, n_embd: 32, vocab_size: 200, max_seq_len: T }
}

/// Tokens and targets (B, T) covering every vocabulary shard, some repeated.
fn batch() -> (Vec<u32>, Vec<u32>) {
    let tokens = (0..B * T).map(|i| ((i * 37 + 3) % 200) as u32).collect();
    let targets = (0..B * T).map(|i| ((i * 53 + 199) % 200) as u32).collect();
    (tokens, targets)
}

/// TP 2 and 4: the device shard initialises to the stage's shard bit for bit, its loss is the
/// stage's (within 1e-6: the stage rounds its mean to f32; bitwise the same on every rank), and
/// every tensor's gradient (each one not all zero) equals the stage's bit for bit.
#[test]
fn device_tp_shard_gradients_match_the_cpu_stage() {
    for tp in [2, 4] {
        let out = run_ranks(tp, CommConfig::default(), move |comm| {
            let (c, rank) = (cfg(), comm.rank());
            let init = Initializer::new(&c, &ParamLayout::new(&c), 5);
            let mut stage = Stage::new(c, rank, tp, StageSpec::whole(&c), false, B, T, 1).unwrap();
            stage.init_params(&init, None).unwrap();
            let (tokens, targets) = batch();
            let want_loss = match stage.forward(0, 0, StageInput::Tokens(&tokens), Some(&targets), &comm).unwrap() {
                StageOutput::Loss(l) => f64::from(l),
                StageOutput::Hidden(_) => unreachable!("a whole-model stage ends with the loss"),
            };
            stage.backward(0, 0, None, &comm, &mut |_, _| {}).unwrap();
            let zeros = vec![0f32; stage.params().len()];
            let group = Some(DeviceTp::new(comm).unwrap());
            let mut m = DeviceGpt::with_tp(Device::Cpu, c, B, T, zeros, Precision::Fp32, group).unwrap();
            m.init_params(&init).unwrap();
            assert_eq!(m.params(), stage.params(), "rank {rank}: initial shard");
            let got_loss = m.forward(&tokens, &targets).unwrap();
            let mut reported = 0;
            m.backward(true, &mut |r, _| reported += r.len()).unwrap();
            assert_eq!(reported, stage.grads().len());
            let got = m.params_and_grads().1.to_vec();
            let want = stage.grads();
            let mismatched: Vec<(String, usize)> = stage
                .layout()
                .entries()
                .iter()
                .map(|e| (e.name.clone(), got[e.range()].iter().zip(&want[e.range()]).filter(|(a, b)| a.to_bits() != b.to_bits()).count()))
                .filter(|(_, n)| *n > 0)
                .collect();
            let zero_tensors: Vec<String> =
                stage.layout().entries().iter().filter(|e| want[e.range()].iter().all(|&g| g == 0.0)).map(|e| e.name.clone()).collect();
            (want_loss, got_loss, mismatched, zero_tensors)
        });
        for (rank, (want_loss, got_loss, mismatched, zero_tensors)) in out.iter().enumerate() {
            assert!((got_loss - want_loss).abs() < 1e-6, "tp {tp} rank {rank}: loss {got_loss} vs {want_loss}");
            assert_eq!(*got_loss, out[0].1, "tp {tp}: ranks disagree on the loss");
            assert!(zero_tensors.is_empty(), "tp {tp} rank {rank}: no gradient reached {zero_tensors:?}");
            assert!(mismatched.is_empty(), "tp {tp} rank {rank}: (tensor, elements differing) {mismatched:?}");
        }
    }
}

/// One pipeline rank holding both blocks as two chunks (chunk 0 embeds, chunk 1 ends: the path
/// every pipeline stage and the interleaved schedule take), two micro-batches in flight whose
/// backwards run in the opposite order, TP 2 with and without sequence parallelism and TP 1: the
/// device stage's hidden outputs (the held rows under SP), losses and input gradients equal the
/// CPU stage's bit for bit, and so do the accumulated gradients of the sharded tensors. Without
/// SP the replicated ones (LayerNorms, row-parallel biases, `wpe`) and, at TP 1, `wte` add the two
/// micro-batches' column sums in another f32 order than the stage (which sums each micro-batch
/// apart first), so they agree to 1e-6 of the tensor's scale (measured: at most 1.2e-7
/// absolute); under SP both sum each micro-batch apart over TP first.
#[test]
fn device_pipeline_chunks_match_the_cpu_stage() {
    for (tp, sp) in [(2, true), (2, false), (1, false)] {
        let out = run_ranks(tp, CommConfig::default(), move |comm| {
            let (c, rank) = (cfg(), comm.rank());
            let spec = StageSpec { chunks: vec![0..1, 1..2], first: true, last: true };
            let init = Initializer::new(&c, &ParamLayout::new(&c), 9);
            let mut stage = Stage::new(c, rank, tp, spec.clone(), sp, B, T, 2).unwrap();
            stage.init_params(&init, None).unwrap();
            let zeros = vec![0f32; stage.params().len()];
            let group = match tp {
                1 => None,
                _ => Some(DeviceTp::new(comm.split(Some(0), rank as i64).unwrap().unwrap()).unwrap()),
            };
            let mut m = DeviceGpt::stage(Device::Cpu, c, (B, T), zeros, Precision::Fp32, (group, sp), spec, 2).unwrap();
            m.init_params(&init).unwrap();
            let shifted = |k: u32| {
                let (t, g) = batch();
                (t.iter().map(|&x| (x + 11 * k) % 200).collect::<Vec<u32>>(), g)
            };
            let out_vec = |o: StageOutput| match o {
                StageOutput::Loss(l) => vec![l],
                StageOutput::Hidden(h) => h.to_vec(),
            };
            // Hidden output and loss of each micro-batch, then input gradients: (stage, device).
            let mut values: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
            for slot in 0..2 {
                let (tokens, targets) = shifted(slot as u32);
                let h = out_vec(stage.forward(0, slot, StageInput::Tokens(&tokens), None, &comm).unwrap());
                let l = out_vec(stage.forward(1, slot, StageInput::Hidden(&h), Some(&targets), &comm).unwrap());
                let hd = out_vec(m.forward_stage(0, slot, StageInput::Tokens(&tokens), None).unwrap());
                let ld = out_vec(m.forward_stage(1, slot, StageInput::Hidden(&hd), Some(&targets)).unwrap());
                values.extend([(h, hd), (l, ld)]);
            }
            for slot in [1, 0] {
                let d = stage.backward(1, slot, None, &comm, &mut |_, _| {}).unwrap().unwrap().to_vec();
                assert!(stage.backward(0, slot, Some(&d), &comm, &mut |_, _| {}).unwrap().is_none());
                let dd = m.backward_stage(1, slot, None).unwrap().unwrap().to_vec();
                assert!(m.backward_stage(0, slot, Some(&dd)).unwrap().is_none());
                values.push((d, dd));
            }
            let mut reported = 0;
            m.report_grads(&mut |r, _| reported += r.len()).unwrap();
            assert_eq!(reported, stage.grads().len());
            let (want, got) = (stage.grads(), m.params_and_grads().1.to_vec());
            // Per tensor: (name, replicated over TP, elements differing in bits, relative L2 error).
            let tensors: Vec<(String, bool, usize, f64)> = stage
                .layout()
                .entries()
                .iter()
                .map(|e| {
                    let (w, g) = (&want[e.range()], &got[e.range()]);
                    let bits = w.iter().zip(g).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                    let diff: f64 = w.iter().zip(g).map(|(a, b)| f64::from(a - b).powi(2)).sum();
                    let norm: f64 = w.iter().map(|a| f64::from(*a).powi(2)).sum();
                    let loose = (e.replicated_over_tp && !sp) || (tp == 1 && e.name == "wte");
                    (e.name.clone(), loose, bits, (diff / norm.max(1e-30)).sqrt())
                })
                .collect();
            (values, tensors)
        });
        for (rank, (values, tensors)) in out.iter().enumerate() {
            for (i, (w, g)) in values.iter().enumerate() {
                let same = w.len() == g.len() && w.iter().zip(g).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "tp {tp} sp {sp} rank {rank}: value {i} (hidden and loss per micro-batch, then input gradients) differs");
            }
            for (name, loose, bits, rel) in tensors {
                match loose {
                    true => assert!(*rel <= 1e-6, "tp {tp} sp {sp} rank {rank}: {name} gradient {rel:e} relative L2 from the stage's"),
                    false => assert_eq!(*bits, 0, "tp {tp} sp {sp} rank {rank}: {name} gradient differs in {bits} elements"),
                }
            }
        }
    }
}
