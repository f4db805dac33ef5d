//! The shard executor ([`DeviceGpt`], CPU arm, fp32) in every training layout against the
//! single-rank reference [`Gpt`]: one rank (bitwise), gradient accumulation, two pipeline stages,
//! interleaved chunks, TP 2 and 4 with and without sequence parallelism, TP 2 + SP over two
//! stages and over interleaved chunks; micro-batches in flight keeping their activations;
//! gradients handed over once, after their last write; misuse rejected.
//!
//! Every parameter is perturbed away from GPT-2's init (biases 0, LayerNorm weights 1, padded
//! `wte` rows 0) so that each term of the forward matters: a row-parallel bias added on every
//! rank, a padded logit entering the softmax, or an un-reduced LayerNorm gradient under sequence
//! parallelism all change the loss or the gradients far beyond the tolerances. The vocabulary
//! (200) is not a multiple of 128, so the last vocab shard is partly padding (with TP 4, ids
//! 192..256: 8 real, 56 padded).
//!
//! Shards are filled from, and their gradients assembled into, the whole model's flat buffer by
//! walking the layout table's boxes (`view_shape`, `box_offset`, `box_shape`) here, independently
//! of `ShardLayout::{gather_from_full, scatter_into_full}`: a wrong box fails these tests too.
//!
//! Tolerances (f32 throughout). Per micro-batch loss: relative 1e-6. Per gradient element: 1e-5
//! of the largest magnitude in its tensor (the reference's). A sharded layout adds the same terms
//! in another order (a row-parallel product's K sum split into tp partial sums then summed over
//! the group, column sums of replicated tensors' gradients split over SP rows, `wte`'s head and
//! embedding halves summed across pipeline stages): each reordering moves a result by a few ulps
//! of the partial sums, ~1e-7 of the tensor's scale, while any missing or doubled term moves it
//! by >= 1e-3 of it. Measured on this file's shapes: at most 9.0e-8 relative loss (TP 2) and
//! 7.6e-7 of the scale per gradient element (TP 4); one rank is bitwise the reference, and is
//! checked bitwise. These are the bounds the stage tests used; dropping the SP sum of the
//! replicated gradients fails all four SP tests.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::device_gpt::{StageInput, StageOutput};
use super::init::Initializer;
use super::tp_layout::{ShardEntry, ShardLayout, StageSpec};
use super::{DeviceGpt, DeviceTp, Gpt, GptConfig, ParamLayout, Precision};
use crate::comm::testing::run_ranks;
use crate::comm::{CommConfig, Communicator};
use crate::device::Device;

const B: usize = 2;
const T: usize = 8;
/// Micro-batches accumulated per test step.
const MICRO: usize = 2;

fn cfg() -> GptConfig {
    GptConfig { n_layer: 4, n_head: 4, n_embd: 32, vocab_size: 200, max_seq_len: 16, llama: None }
}

/// Tokens and targets (B, T) of micro-batch `i`.
fn batch(i: u64) -> (Vec<u32>, Vec<u32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(100 + i);
    let v = cfg().vocab_size as u32;
    let tokens = (0..B * T).map(|_| rng.gen_range(0..v)).collect();
    let targets = (0..B * T).map(|_| rng.gen_range(0..v)).collect();
    (tokens, targets)
}

/// GPT-2 init, every element then perturbed (padded rows included).
fn full_params() -> Vec<f32> {
    let mut p = Gpt::<f32>::new(cfg(), B, T, 7).unwrap().params().to_vec();
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    p.iter_mut().for_each(|x| *x += 0.1 * (rng.gen::<f32>() - 0.5));
    p
}

/// The single-rank losses of the micro-batches and the accumulated gradients.
fn reference() -> (Vec<f32>, Vec<f32>) {
    let mut m = Gpt::<f32>::from_params(cfg(), B, T, full_params()).unwrap();
    let losses = (0..MICRO as u64)
        .map(|i| {
            let (x, y) = batch(i);
            let loss = m.forward(&x, &y).unwrap();
            m.backward().unwrap();
            loss
        })
        .collect();
    (losses, m.grads().to_vec())
}

/// Whole-model flat index of each element of `e`'s shard, in local order: the box
/// `box_offset .. box_offset + box_shape` of the global tensor viewed as `view_shape`, row-major.
fn box_indices(e: &ShardEntry) -> Vec<usize> {
    let d = e.view_shape.len();
    assert_eq!(e.view_shape.iter().product::<usize>(), e.global_shape.iter().product::<usize>(), "{}: view", e.name);
    assert_eq!(e.box_shape.iter().product::<usize>(), e.len, "{}: box", e.name);
    let mut strides = vec![1; d];
    for i in (0..d - 1).rev() {
        strides[i] = strides[i + 1] * e.view_shape[i + 1];
    }
    let mut at = vec![0; d]; // position inside the box
    let mut out = Vec::with_capacity(e.len);
    for _ in 0..e.len {
        out.push(e.global_offset + (0..d).map(|i| (e.box_offset[i] + at[i]) * strides[i]).sum::<usize>());
        for i in (0..d).rev() {
            at[i] += 1;
            if at[i] < e.box_shape[i] {
                break;
            }
            at[i] = 0;
        }
    }
    out
}

/// The TP group of one executor: a communicator of its own over `comm`'s members (each stage of a
/// rank talks on its own, like the training pipeline's), none without `comm`.
fn group(comm: Option<&Communicator>) -> Option<DeviceTp> {
    let c = comm?;
    Some(DeviceTp::new(c.split(Some(0), c.rank() as i64).unwrap().unwrap()).unwrap())
}

/// Stage `spec` of this rank's TP shard with `slots` activation slots, holding its boxes of
/// `full`.
fn executor(comm: Option<&Communicator>, sp: bool, spec: &StageSpec, slots: usize, full: &[f32]) -> DeviceGpt {
    let (rank, size) = comm.map_or((0, 1), |c| (c.rank(), c.size()));
    let zeros = vec![0f32; ShardLayout::new(&cfg(), rank, size, spec).unwrap().total_len()];
    let tp = (group(comm), sp);
    let mut m = DeviceGpt::stage(Device::Cpu, cfg(), (B, T), zeros, Precision::Fp32, tp, spec.clone(), slots).unwrap();
    let layout = m.layout().clone();
    let params = m.params_and_grads().0;
    for e in layout.entries() {
        for (k, g) in box_indices(e).into_iter().enumerate() {
            params[e.offset + k] = full[g];
        }
    }
    m
}

/// Reports `m`'s gradients (checking that one call hands over the whole buffer once) and writes
/// them into a NaN-filled whole-model buffer at their boxes.
fn grads_in_full(m: &mut DeviceGpt) -> Vec<f32> {
    let mut reported = Vec::new();
    m.report_grads(&mut |r, _| reported.push(r)).unwrap();
    let n = m.layout().total_len();
    assert_eq!(reported, vec![0..n], "the whole gradient buffer is reported once");
    let layout = m.layout().clone();
    let grads = m.params_and_grads().1;
    let mut full = vec![f32::NAN; ParamLayout::new(&cfg()).total_len()];
    for e in layout.entries() {
        for (k, g) in box_indices(e).into_iter().enumerate() {
            full[g] = grads[e.offset + k];
        }
    }
    full
}

/// One TP rank (`comm`; none: a single rank) holding the stages of all pipeline ranks `specs`
/// (each with the same number of chunks; chunk `c` of rank `r` is global stage
/// `c * specs.len() + r`): runs the micro-batches through the global stages one after the other
/// (passing hidden states by hand) and returns the losses and, per stage, its gradients in a
/// NaN-filled whole-model buffer.
fn run_stages(comm: Option<&Communicator>, sp: bool, specs: &[StageSpec]) -> (Vec<f32>, Vec<Vec<f32>>) {
    let full = full_params();
    let mut stages: Vec<DeviceGpt> = specs.iter().map(|s| executor(comm, sp, s, 1, &full)).collect();
    let chunks = specs[0].chunks.len();
    let order: Vec<(usize, usize)> = (0..chunks).flat_map(|c| (0..specs.len()).map(move |r| (r, c))).collect();
    let mut losses = Vec::new();
    for i in 0..MICRO as u64 {
        let (x, y) = batch(i);
        let mut hidden = Vec::new();
        for &(r, c) in &order {
            let input = if specs[r].embeds(c) { StageInput::Tokens(&x) } else { StageInput::Hidden(&hidden) };
            let targets = specs[r].ends(c).then_some(&y[..]);
            match stages[r].forward_stage(c, 0, input, targets).unwrap() {
                StageOutput::Hidden(h) => hidden = h.to_vec(),
                StageOutput::Loss(l) => losses.push(l),
            }
        }
        let mut grad: Option<Vec<f32>> = None;
        for &(r, c) in order.iter().rev() {
            grad = stages[r].backward_stage(c, 0, grad.as_deref()).unwrap().map(<[f32]>::to_vec);
        }
        assert!(grad.is_none(), "the embedding chunk returns no input gradient");
    }
    let grads = stages.iter_mut().map(grads_in_full).collect();
    for s in &mut stages {
        s.check_collectives().unwrap();
        s.release_collectives().unwrap();
    }
    (losses, grads)
}

/// Checks every rank's losses and gradients against the single-rank reference (tolerances: see
/// the module documentation); each tensor's reference gradient is not all zero; every element is
/// held by one rank (split tensors) or by all with bitwise equal values (replicated ones); the
/// `wte` copies of the first and last stage add up to the tied gradient.
fn check_against_reference(results: &[(Vec<f32>, Vec<Vec<f32>>)]) {
    let (ref_losses, ref_grads) = reference();
    let layout = ParamLayout::new(&cfg());
    for (rank, (losses, _)) in results.iter().enumerate() {
        assert_eq!(losses.len(), MICRO);
        for (l, r) in losses.iter().zip(&ref_losses) {
            assert!(((l - r) / r).abs() <= 1e-6, "rank {rank}: loss {l} vs {r}");
        }
    }
    for e in layout.entries() {
        let scale = ref_grads[e.range()].iter().fold(0f32, |m, g| m.max(g.abs()));
        assert!(scale > 0.0, "{}: zero reference gradient tests nothing", e.name);
        for i in e.range() {
            // Per rank: the sum over its stages holding the element (wte on first and last).
            let held: Vec<f32> = results
                .iter()
                .filter_map(|(_, stages)| {
                    let mine: Vec<f32> = stages.iter().map(|g| g[i]).filter(|g| !g.is_nan()).collect();
                    (!mine.is_empty()).then(|| mine.iter().sum())
                })
                .collect();
            let holders = if e.tp_split == super::TpSplit::Replicated { results.len() } else { 1 };
            assert_eq!(held.len(), holders, "{} element {i} held by {} ranks", e.name, held.len());
            assert!(held.iter().all(|g| g.to_bits() == held[0].to_bits()), "{} element {i} differs across ranks", e.name);
            let err = (held[0] - ref_grads[i]).abs();
            assert!(err <= 1e-5 * scale, "{} element {i}: {} vs {} (scale {scale})", e.name, held[0], ref_grads[i]);
        }
    }
}

fn two_stages() -> Vec<StageSpec> {
    vec![StageSpec::single(0..1, true, false), StageSpec::single(1..4, false, true)]
}

/// Two pipeline ranks with two chunks each (interleaved): rank 0 runs blocks 0 and 2 and embeds,
/// rank 1 runs blocks 1 and 3 and ends with the head.
fn interleaved_stages() -> Vec<StageSpec> {
    vec![
        StageSpec { chunks: vec![0..1, 2..3], first: true, last: false },
        StageSpec { chunks: vec![1..2, 3..4], first: false, last: true },
    ]
}

fn run_tp(tp: usize, sp: bool, specs: Vec<StageSpec>) -> Vec<(Vec<f32>, Vec<Vec<f32>>)> {
    run_ranks(tp, CommConfig::default(), move |comm| run_stages(Some(&comm), sp, &specs))
}

/// One rank, the whole model, one micro-batch: the CPU arm runs `Gpt`'s arithmetic in `Gpt`'s
/// order, so the loss (the f64 mean of the same f32 per-row losses, rounded to f32) and every
/// gradient are bitwise the reference's.
#[test]
fn one_rank_executor_is_bitwise_gpt() {
    let mut m = Gpt::<f32>::from_params(cfg(), B, T, full_params()).unwrap();
    let mut d = executor(None, false, &StageSpec::whole(&cfg()), 1, &full_params());
    let (x, y) = batch(0);
    let want = m.forward(&x, &y).unwrap();
    m.backward().unwrap();
    let got = d.forward(&x, &y).unwrap() as f32;
    assert_eq!(got.to_bits(), want.to_bits(), "loss {got} vs {want}");
    d.backward(false, &mut |_, _| {}).unwrap();
    let got = grads_in_full(&mut d);
    let differing: Vec<String> = ParamLayout::new(&cfg())
        .entries()
        .iter()
        .filter(|e| e.range().any(|i| got[i].to_bits() != m.grads()[i].to_bits()))
        .map(|e| e.name.clone())
        .collect();
    assert!(differing.is_empty(), "gradients differ in {differing:?}");
}

/// Accumulating micro-batches adds the same values in the same order as the reference: bitwise.
#[test]
fn one_rank_accumulates_like_gpt() {
    let (losses, grads) = run_stages(None, false, &[StageSpec::whole(&cfg())]);
    let (ref_losses, ref_grads) = reference();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    assert_eq!(bits(&losses), bits(&ref_losses));
    assert!(bits(&grads[0]) == bits(&ref_grads), "accumulated gradients differ from the reference's");
}

#[test]
fn two_pipeline_stages_match_gpt() {
    check_against_reference(&[run_stages(None, false, &two_stages())]);
}

#[test]
fn interleaved_chunks_match_gpt() {
    check_against_reference(&[run_stages(None, false, &interleaved_stages())]);
}

#[test]
fn tp2_matches_gpt() {
    check_against_reference(&run_tp(2, false, vec![StageSpec::whole(&cfg())]));
}

#[test]
fn tp4_matches_gpt() {
    check_against_reference(&run_tp(4, false, vec![StageSpec::whole(&cfg())]));
}

#[test]
fn tp2_sequence_parallel_matches_gpt() {
    check_against_reference(&run_tp(2, true, vec![StageSpec::whole(&cfg())]));
}

#[test]
fn tp4_sequence_parallel_matches_gpt() {
    check_against_reference(&run_tp(4, true, vec![StageSpec::whole(&cfg())]));
}

#[test]
fn tp2_sequence_parallel_with_two_stages_matches_gpt() {
    check_against_reference(&run_tp(2, true, two_stages()));
}

#[test]
fn tp2_sequence_parallel_with_interleaved_chunks_matches_gpt() {
    check_against_reference(&run_tp(2, true, interleaved_stages()));
}

/// `init_params` gives each TP rank exactly its boxes of the reference's initialisation (what a
/// job's ranks start from), with TP 2 and 4 and on a pipeline stage.
#[test]
fn tp_shards_initialise_to_their_boxes_of_the_reference() {
    for (tp, spec) in [(2, StageSpec::whole(&cfg())), (4, interleaved_stages()[1].clone())] {
        let out = run_ranks(tp, CommConfig::default(), move |comm| {
            let c = cfg();
            let want = Gpt::<f32>::new(c, B, T, 5).unwrap().params().to_vec();
            let mut m = executor(Some(&comm), false, &spec, 1, &vec![f32::NAN; want.len()]);
            m.init_params(&Initializer::new(&c, &ParamLayout::new(&c), 5)).unwrap();
            let layout = m.layout().clone();
            let bad: Vec<String> = layout
                .entries()
                .iter()
                .filter(|e| box_indices(e).iter().enumerate().any(|(k, &g)| m.params()[e.offset + k].to_bits() != want[g].to_bits()))
                .map(|e| e.name.clone())
                .collect();
            m.release_collectives().unwrap();
            bad
        });
        for (rank, bad) in out.iter().enumerate() {
            assert!(bad.is_empty(), "tp {tp} rank {rank}: initial shard differs in {bad:?}");
        }
    }
}

/// Two micro-batches in flight (forward 0, forward 1, backward 1, backward 0) on two slots give
/// bitwise the hidden states, input gradients and accumulated gradients of running them one at a
/// time in the same backward order: the slots do not share activations. A consumed slot cannot
/// run a backward again.
#[test]
fn micro_batches_in_flight_keep_their_activations() {
    let full = full_params();
    let new_stages = |slots| -> Vec<DeviceGpt> { two_stages().iter().map(|s| executor(None, false, s, slots, &full)).collect() };
    let fwd = |st: &mut [DeviceGpt], slot: usize, i: u64| -> (Vec<f32>, f32) {
        let (x, y) = batch(i);
        let h = match st[0].forward_stage(0, slot, StageInput::Tokens(&x), None).unwrap() {
            StageOutput::Hidden(h) => h.to_vec(),
            StageOutput::Loss(_) => panic!("the first stage returns its hidden state"),
        };
        match st[1].forward_stage(0, slot, StageInput::Hidden(&h), Some(&y)).unwrap() {
            StageOutput::Loss(l) => (h, l),
            StageOutput::Hidden(_) => panic!("the last stage returns the loss"),
        }
    };
    let bwd = |st: &mut [DeviceGpt], slot: usize| -> Vec<f32> {
        let g = st[1].backward_stage(0, slot, None).unwrap().expect("d(hidden input)").to_vec();
        assert!(st[0].backward_stage(0, slot, Some(&g)).unwrap().is_none());
        g
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let mut inflight = new_stages(2);
    let (h0, l0) = fwd(&mut inflight, 0, 0);
    let (h1, l1) = fwd(&mut inflight, 1, 1);
    let (g1, g0) = (bwd(&mut inflight, 1), bwd(&mut inflight, 0));
    let mut sequential = new_stages(1);
    let (s1, m1) = fwd(&mut sequential, 0, 1);
    assert_eq!((bits(&s1), m1.to_bits()), (bits(&h1), l1.to_bits()));
    assert_eq!(bits(&bwd(&mut sequential, 0)), bits(&g1));
    let (s0, m0) = fwd(&mut sequential, 0, 0);
    assert_eq!((bits(&s0), m0.to_bits()), (bits(&h0), l0.to_bits()));
    assert_eq!(bits(&bwd(&mut sequential, 0)), bits(&g0));
    for (a, b) in inflight.iter_mut().zip(&mut sequential) {
        assert_eq!(bits(&grads_in_full(a)), bits(&grads_in_full(b)));
    }
    let g = vec![0.0; inflight[0].hidden_len()];
    assert!(inflight[0].backward_stage(0, 0, Some(&g)).is_err()); // slot consumed
}

/// The backward that hands gradients over unit by unit as they become final (ZeRO-2/3's
/// reduction path), under TP 2 + SP, over two accumulated micro-batches: the ranges handed over
/// tile the buffer once per backward, and the gradients seen at hand-over are the final ones of
/// that backward (a range handed over before its last write, e.g. `wte` before the embedding's
/// contribution or a replicated LayerNorm before its SP sum, would differ); on the second
/// micro-batch they include the first one's.
#[test]
fn gradient_units_are_handed_over_once_after_their_last_write() {
    let out = run_ranks(2, CommConfig::default(), |comm| {
        let mut m = executor(Some(&comm), true, &StageSpec::whole(&cfg()), 1, &full_params());
        let n = m.layout().total_len();
        let wte = m.layout().wte().unwrap();
        let dev = Device::Cpu;
        let to_host = |buf: &crate::device::DeviceBuffer, len: usize| {
            let mut h = vec![0f32; len];
            dev.copy_to_host(buf, &mut h).unwrap();
            h
        };
        for i in 0..MICRO as u64 {
            let (x, y) = batch(i);
            m.forward(&x, &y).unwrap();
            let mut seen: Vec<(std::ops::Range<usize>, Vec<f32>)> = Vec::new();
            m.backward_reducing(&mut |m, r| {
                let mut buf = dev.alloc(r.len() * 4)?;
                m.pack_grads_range(r.clone(), &mut buf)?;
                seen.push((r.clone(), to_host(&buf, r.len())));
                Ok(())
            })
            .unwrap();
            let mut flat = dev.alloc(n * 4).unwrap();
            m.pack_grads(&mut flat).unwrap();
            let last = to_host(&flat, n);
            let mut count = vec![0; n];
            for (r, g) in &seen {
                r.clone().for_each(|j| count[j] += 1);
                let same = g.iter().zip(&last[r.clone()]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "micro-batch {i}: range {r:?} changed after it was handed over");
            }
            assert!(count.iter().all(|&c| c == 1), "micro-batch {i}: ranges do not tile the buffer: {:?}", seen.iter().map(|s| &s.0).collect::<Vec<_>>());
            // wte comes after every block, i.e. among the last two hand-overs (then wpe).
            let wte_at = seen.iter().position(|(r, _)| *r == wte).expect("wte handed over");
            assert!(wte_at + 2 >= seen.len(), "wte handed over at {wte_at} of {}", seen.len());
        }
        m.check_collectives().unwrap();
        m.release_collectives().unwrap();
    });
    assert_eq!(out.len(), 2);
}

#[test]
fn rejects_misuse() {
    let (c, full) = (cfg(), full_params());
    let last = two_stages()[1].clone();
    let mut st = executor(None, false, &last, 1, &full);
    let (x, y) = batch(0);
    let h = vec![0.0; B * T * c.n_embd];
    assert!(st.forward_stage(0, 0, StageInput::Tokens(&x), Some(&y)).is_err()); // not first
    assert!(st.forward_stage(0, 0, StageInput::Hidden(&[0.0; 3]), Some(&y)).is_err()); // size
    assert!(st.forward_stage(0, 1, StageInput::Hidden(&h), Some(&y)).is_err()); // slot
    assert!(st.forward_stage(1, 0, StageInput::Hidden(&h), Some(&y)).is_err()); // chunk
    assert!(st.forward_stage(0, 0, StageInput::Hidden(&h), None).is_err()); // the last chunk needs targets
    assert!(st.backward_stage(0, 0, None).is_err()); // no forward
    assert!(st.forward(&x, &y).is_err()); // the whole-model call on a stage
    let mut first = executor(None, false, &two_stages()[0], 1, &full);
    assert!(first.forward_stage(0, 0, StageInput::Tokens(&x), Some(&y)).is_err()); // targets to a non-last chunk
    let bad: Vec<u32> = x.iter().map(|_| c.vocab_size as u32).collect();
    assert!(first.forward_stage(0, 0, StageInput::Tokens(&bad), None).is_err()); // id outside the vocabulary
    first.forward_stage(0, 0, StageInput::Tokens(&x), None).unwrap();
    assert!(first.backward_stage(0, 0, None).is_err()); // a non-last chunk needs d(output)
    let n = full.len();
    let whole = |t: usize, len: usize, slots: usize| {
        DeviceGpt::stage(Device::Cpu, c, (B, t), vec![0.0; len], Precision::Fp32, (None, false), StageSpec::whole(&c), slots)
    };
    assert!(whole(T, n, 1).is_ok());
    assert!(whole(c.max_seq_len + 1, n, 1).is_err()); // T > maxT
    assert!(whole(T, n - 1, 1).is_err()); // parameter buffer length
    assert!(whole(T, n, 0).is_err()); // no slot
    // A TP group that does not divide the 4 heads; B*T = 3 rows that do not split over 2 ranks.
    let tp3 = run_ranks(3, CommConfig::default(), move |comm| {
        DeviceGpt::with_tp(Device::Cpu, c, B, T, vec![0.0; n], Precision::Fp32, group(Some(&comm))).is_err()
    });
    assert_eq!(tp3, vec![true; 3]);
    let sp2 = run_ranks(2, CommConfig::default(), move |comm| {
        let len = ShardLayout::new(&c, comm.rank(), 2, &StageSpec::whole(&c)).unwrap().total_len();
        let m = DeviceGpt::stage(Device::Cpu, c, (1, 3), vec![0.0; len], Precision::Fp32, (group(Some(&comm)), true), StageSpec::whole(&c), 1);
        m.is_err()
    });
    assert_eq!(sp2, vec![true; 2]);
}
