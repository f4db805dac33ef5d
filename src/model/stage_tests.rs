//! Equivalence of the stage executor with the single-rank [`Gpt`]: one rank, tensor parallelism
//! (with and without sequence parallelism), pipeline stages, micro-batches in flight, and the
//! order of the gradient-ready reports.
//!
//! Every parameter is perturbed away from GPT-2's init (biases 0, LayerNorm weights 1, padded
//! `wte` rows 0) so that each term of the forward matters: a row-parallel bias added on every
//! rank, a padded logit entering the softmax, or an un-reduced LayerNorm gradient under sequence
//! parallelism all change the loss or the gradients far beyond the tolerances. The vocabulary
//! (200) is not a multiple of 128, so the last vocab shard is partly padding.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::stage::{Stage, StageInput, StageOutput};
use super::tp_comm::{NoTp, TpComm};
use super::tp_layout::StageSpec;
use super::{Gpt, GptConfig, ParamLayout, TpSplit};
use crate::comm::testing::run_ranks;
use crate::comm::CommConfig;

const B: usize = 2;
const T: usize = 8;
/// Micro-batches accumulated per test step.
const MICRO: usize = 2;

fn cfg() -> GptConfig {
    GptConfig {
        n_layer: 4,
        n_head: 4,
        n_embd: 32,
        vocab_size: 200,
        max_seq_len: 16,
    }
}

/// Tokens and targets of micro-batch `i`.
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
    p.iter_mut()
        .for_each(|x| *x += 0.1 * (rng.gen::<f32>() - 0.5));
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

/// One TP rank holding the stages of all pipeline ranks `specs` (each with the same number of
/// chunks; chunk `c` of rank `r` is global stage `c * specs.len() + r`): runs the micro-batches
/// through the global stages one after the other (passing hidden states by hand) and returns the
/// losses and, per rank, the gradients written into a NaN-filled full buffer.
fn run_stages(tp: &dyn TpComm, sp: bool, specs: &[StageSpec]) -> (Vec<f32>, Vec<Vec<f32>>) {
    let full = full_params();
    let mut stages: Vec<Stage> = specs
        .iter()
        .map(|spec| {
            let mut s =
                Stage::new(cfg(), tp.tp_rank(), tp.tp_size(), spec.clone(), sp, B, T, 1).unwrap();
            s.load_from_full(&full).unwrap();
            s
        })
        .collect();
    let chunks = specs[0].chunks.len();
    let order: Vec<(usize, usize)> = (0..chunks)
        .flat_map(|c| (0..specs.len()).map(move |r| (r, c)))
        .collect();
    let mut losses = Vec::new();
    for i in 0..MICRO as u64 {
        let (x, y) = batch(i);
        let mut hidden = Vec::new();
        for &(r, c) in &order {
            let st = &mut stages[r];
            let input = if st.spec().embeds(c) {
                StageInput::Tokens(&x)
            } else {
                StageInput::Hidden(&hidden)
            };
            let targets = st.spec().ends(c).then_some(&y[..]);
            match st.forward(c, 0, input, targets, tp).unwrap() {
                StageOutput::Hidden(h) => hidden = h.to_vec(),
                StageOutput::Loss(l) => losses.push(l),
            }
        }
        let mut grad: Option<Vec<f32>> = None;
        for &(r, c) in order.iter().rev() {
            grad = stages[r]
                .backward(c, 0, grad.as_deref(), tp, &mut |_, _| {})
                .unwrap()
                .map(<[f32]>::to_vec);
        }
    }
    let grads = stages
        .iter()
        .map(|st| {
            let mut g = vec![f32::NAN; full.len()];
            st.layout().scatter_into_full(st.grads(), &mut g).unwrap();
            g
        })
        .collect();
    (losses, grads)
}

/// Checks every rank's losses and gradients against the single-rank reference: losses within
/// 1e-6 relative; each gradient element within 1e-5 of the largest magnitude of its tensor (f32
/// sums reordered across shards differ by a few ulps of the partial sums, ~1e-7 of the tensor
/// scale; any missing or doubled term is >= 1e-3 of it); replicated tensors bitwise equal on all
/// ranks; the `wte` copies of the first and last stage add up to the tied gradient.
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
        let scale = ref_grads[e.range()]
            .iter()
            .fold(0f32, |m, g| m.max(g.abs()));
        assert!(
            scale > 0.0,
            "{}: zero reference gradient tests nothing",
            e.name
        );
        for i in e.range() {
            // Per rank: the sum over its stages holding the element (wte on first and last).
            let per_rank: Vec<Option<f32>> = results
                .iter()
                .map(|(_, stages)| {
                    let held: Vec<f32> = stages
                        .iter()
                        .map(|g| g[i])
                        .filter(|g| !g.is_nan())
                        .collect();
                    (!held.is_empty()).then(|| held.iter().sum())
                })
                .collect();
            let held: Vec<f32> = per_rank.iter().flatten().copied().collect();
            let holders = if e.tp_split == TpSplit::Replicated {
                results.len()
            } else {
                1
            };
            assert_eq!(
                held.len(),
                holders,
                "{} element {i} held by {} ranks",
                e.name,
                held.len()
            );
            assert!(
                held.iter().all(|&g| g == held[0]),
                "{} element {i} differs across ranks",
                e.name
            );
            let err = (held[0] - ref_grads[i]).abs();
            assert!(
                err <= 1e-5 * scale,
                "{} element {i}: {} vs {} (scale {scale})",
                e.name,
                held[0],
                ref_grads[i]
            );
        }
    }
}

fn two_stages() -> Vec<StageSpec> {
    vec![
        StageSpec::single(0..1, true, false),
        StageSpec::single(1..4, false, true),
    ]
}

/// Two pipeline ranks with two chunks each (interleaved): rank 0 runs blocks 0 and 2 and embeds,
/// rank 1 runs blocks 1 and 3 and ends with the head.
fn interleaved_stages() -> Vec<StageSpec> {
    vec![
        StageSpec {
            chunks: vec![0..1, 2..3],
            first: true,
            last: false,
        },
        StageSpec {
            chunks: vec![1..2, 3..4],
            first: false,
            last: true,
        },
    ]
}

fn run_tp(tp: usize, sp: bool, specs: Vec<StageSpec>) -> Vec<(Vec<f32>, Vec<Vec<f32>>)> {
    run_ranks(tp, CommConfig::default(), move |comm| {
        run_stages(&comm, sp, &specs)
    })
}

/// One rank, one stage: the same arithmetic in the same order as `Gpt`, so loss and gradients
/// of one micro-batch are bitwise equal.
#[test]
fn one_rank_stage_is_bitwise_gpt() {
    let mut m = Gpt::<f32>::from_params(cfg(), B, T, full_params()).unwrap();
    let mut st = Stage::new(cfg(), 0, 1, StageSpec::whole(&cfg()), false, B, T, 1).unwrap();
    st.load_from_full(&full_params()).unwrap();
    let (x, y) = batch(0);
    let want = m.forward(&x, &y).unwrap();
    m.backward().unwrap();
    let got = match st
        .forward(0, 0, StageInput::Tokens(&x), Some(&y), &NoTp)
        .unwrap()
    {
        StageOutput::Loss(l) => l,
        StageOutput::Hidden(_) => panic!("a last stage returns the loss"),
    };
    assert_eq!(got, want);
    assert!(st
        .backward(0, 0, None, &NoTp, &mut |_, _| {})
        .unwrap()
        .is_none());
    assert_eq!(st.grads(), m.grads());
}

#[test]
fn one_rank_accumulates_like_gpt() {
    check_against_reference(&[run_stages(&NoTp, false, &[StageSpec::whole(&cfg())])]);
}

#[test]
fn two_pipeline_stages_match_gpt() {
    check_against_reference(&[run_stages(&NoTp, false, &two_stages())]);
}

#[test]
fn interleaved_chunks_match_gpt() {
    check_against_reference(&[run_stages(&NoTp, false, &interleaved_stages())]);
}

#[test]
fn tp2_sequence_parallel_with_interleaved_chunks_matches_gpt() {
    check_against_reference(&run_tp(2, true, interleaved_stages()));
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

/// Two micro-batches in flight (forward 0, forward 1, backward 1, backward 0) on two slots give
/// bitwise the gradients of running them one at a time in the same backward order: the slots do
/// not share activations.
#[test]
fn micro_batches_in_flight_keep_their_activations() {
    let full = full_params();
    let new_stages = |slots| -> Vec<Stage> {
        two_stages()
            .into_iter()
            .map(|spec| {
                let mut s = Stage::new(cfg(), 0, 1, spec, false, B, T, slots).unwrap();
                s.load_from_full(&full).unwrap();
                s
            })
            .collect()
    };
    let fwd = |st: &mut [Stage], slot: usize, i: u64| -> f32 {
        let (x, y) = batch(i);
        let h = match st[0]
            .forward(0, slot, StageInput::Tokens(&x), None, &NoTp)
            .unwrap()
        {
            StageOutput::Hidden(h) => h.to_vec(),
            StageOutput::Loss(_) => panic!("first stage returns its hidden state"),
        };
        match st[1]
            .forward(0, slot, StageInput::Hidden(&h), Some(&y), &NoTp)
            .unwrap()
        {
            StageOutput::Loss(l) => l,
            StageOutput::Hidden(_) => panic!("last stage returns the loss"),
        }
    };
    let bwd = |st: &mut [Stage], slot: usize| {
        let g = st[1]
            .backward(0, slot, None, &NoTp, &mut |_, _| {})
            .unwrap()
            .unwrap()
            .to_vec();
        assert!(st[0]
            .backward(0, slot, Some(&g), &NoTp, &mut |_, _| {})
            .unwrap()
            .is_none());
    };
    let mut inflight = new_stages(2);
    let l0 = fwd(&mut inflight, 0, 0);
    let l1 = fwd(&mut inflight, 1, 1);
    bwd(&mut inflight, 1);
    bwd(&mut inflight, 0);
    let mut sequential = new_stages(1);
    assert_eq!(fwd(&mut sequential, 0, 1), l1);
    bwd(&mut sequential, 0);
    assert_eq!(fwd(&mut sequential, 0, 0), l0);
    bwd(&mut sequential, 0);
    for (a, b) in inflight.iter().zip(&sequential) {
        assert_eq!(a.grads(), b.grads());
    }
    let g = vec![0.0; inflight[0].hidden_len()];
    assert!(inflight[0]
        .backward(0, 0, Some(&g), &NoTp, &mut |_, _| {})
        .is_err()); // slot consumed
}

/// Each reported range is disjoint from the others, all of them cover the buffer, and the
/// gradients seen at report time are the final ones (a range reported before its last write, e.g.
/// `wte` before the embedding's contribution, would differ). Checked on the second micro-batch,
/// whose reports must also include the first one's accumulated values, under TP2 + SP.
#[test]
fn gradient_ranges_are_reported_once_after_their_last_write() {
    let out = run_ranks(2, CommConfig::default(), |comm| {
        let full = full_params();
        let specs = [StageSpec::whole(&cfg()), two_stages()[1].clone()];
        for spec in specs {
            let last_only = !spec.first;
            let mut st = Stage::new(cfg(), comm.tp_rank(), 2, spec, true, B, T, 1).unwrap();
            st.load_from_full(&full).unwrap();
            let mut hidden = vec![0f32; st.hidden_len()];
            let mut rng = ChaCha8Rng::seed_from_u64(9);
            hidden.iter_mut().for_each(|h| *h = rng.gen::<f32>() - 0.5);
            for i in 0..MICRO as u64 {
                let (x, y) = batch(i);
                let input = if last_only {
                    StageInput::Hidden(&hidden)
                } else {
                    StageInput::Tokens(&x)
                };
                st.forward(0, 0, input, Some(&y), &comm).unwrap();
                let mut seen: Vec<(std::ops::Range<usize>, Vec<f32>)> = Vec::new();
                st.backward(0, 0, None, &comm, &mut |r, g| seen.push((r, g.to_vec())))
                    .unwrap();
                let mut count = vec![0; st.grads().len()];
                for (r, g) in &seen {
                    r.clone().for_each(|j| count[j] += 1);
                    assert_eq!(
                        &st.grads()[r.clone()],
                        &g[..],
                        "range {r:?} changed after its report"
                    );
                }
                assert!(
                    count.iter().all(|&c| c == 1),
                    "ranges do not tile the buffer: {seen:?}"
                );
                // wte (at offset 0) comes after every block, i.e. among the last two reports.
                let wte_at = seen.iter().position(|(r, _)| r.start == 0).unwrap();
                assert!(
                    wte_at + 2 >= seen.len(),
                    "wte reported at {wte_at} of {}",
                    seen.len()
                );
            }
        }
    });
    assert_eq!(out.len(), 2);
}

#[test]
fn rejects_misuse() {
    let mut st = Stage::new(cfg(), 0, 1, two_stages()[1].clone(), false, B, T, 1).unwrap();
    let (x, y) = batch(0);
    assert!(st
        .forward(0, 0, StageInput::Tokens(&x), Some(&y), &NoTp)
        .is_err()); // not first
    assert!(st
        .forward(0, 0, StageInput::Hidden(&[0.0; 3]), Some(&y), &NoTp)
        .is_err()); // size
    assert!(st
        .forward(
            0,
            1,
            StageInput::Hidden(&vec![0.0; B * T * 32]),
            Some(&y),
            &NoTp
        )
        .is_err()); // slot
    assert!(st
        .forward(1, 0, StageInput::Hidden(&vec![0.0; B * T * 32]), Some(&y), &NoTp)
        .is_err()); // chunk
    assert!(st.backward(0, 0, None, &NoTp, &mut |_, _| {}).is_err()); // no forward
    assert!(Stage::new(cfg(), 0, 3, StageSpec::whole(&cfg()), false, B, T, 1).is_err()); // 4 heads
    assert!(Stage::new(cfg(), 0, 2, StageSpec::whole(&cfg()), true, 1, 3, 1).is_err());
    // 3 rows / 2
}
