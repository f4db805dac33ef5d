//! The batch sampler (order, data-parallel split, resume) and the synthetic corpus.

use std::collections::HashSet;
use std::sync::Arc;

use meshtrain::data::{Batch, Sampler, SamplerState, SyntheticData, TokenWindows};
use meshtrain::Result;

/// Window `i` is `[1000 i, 1000 i + 1, ...]`, so every token names its window.
struct Counting(u64);

impl TokenWindows for Counting {
    fn num_windows(&self, _seq_len: usize) -> u64 {
        self.0
    }
    fn read_window(&self, index: u64, _seq_len: usize, out: &mut [u32]) -> Result<()> {
        for (k, o) in out.iter_mut().enumerate() {
            *o = (index * 1000) as u32 + k as u32;
        }
        Ok(())
    }
    fn describe(&self) -> String {
        format!("{} counting windows", self.0)
    }
}

const T: usize = 4;

fn windows_of(batch: &Batch) -> Vec<u64> {
    (0..batch.micro_batch)
        .map(|b| (batch.inputs[b * T] / 1000) as u64)
        .collect()
}

fn sampler(n: u64, b: usize, rank: usize, dp: usize, shuffle: bool, seed: u64) -> Sampler {
    Sampler::new(Arc::new(Counting(n)), T, b, rank, dp, shuffle, seed).unwrap()
}

fn take(s: &mut Sampler, batches: usize) -> Vec<Vec<u64>> {
    let mut batch = Batch::new(2, T);
    (0..batches)
        .map(|_| {
            s.next_batch(&mut batch).unwrap();
            windows_of(&batch)
        })
        .collect()
}

#[test]
fn sequential_batches_shift_targets_by_one() {
    let mut s = sampler(10, 2, 0, 1, false, 0);
    let mut batch = Batch::new(2, T);
    s.next_batch(&mut batch).unwrap();
    assert_eq!(batch.inputs, vec![0, 1, 2, 3, 1000, 1001, 1002, 1003]);
    assert_eq!(batch.targets, vec![1, 2, 3, 4, 1001, 1002, 1003, 1004]);
    // 10 windows, global batch 2: 5 batches per epoch, then epoch 1 starts over.
    assert_eq!(s.batches_per_epoch(), 5);
    let rest = take(&mut s, 5);
    assert_eq!(
        rest,
        vec![vec![2, 3], vec![4, 5], vec![6, 7], vec![8, 9], vec![0, 1]]
    );
    assert_eq!(
        s.state(),
        SamplerState {
            epoch: 1,
            index: 1,
            seed: 0
        }
    );
}

#[test]
fn data_parallel_ranks_split_every_global_batch() {
    // 3 ranks x 2 sequences = 6 windows per global batch; 20 windows -> 3 batches, 2 dropped.
    for shuffle in [false, true] {
        let per_rank: Vec<Vec<Vec<u64>>> = (0..3)
            .map(|r| take(&mut sampler(20, 2, r, 3, shuffle, 7), 3))
            .collect();
        let mut epoch = HashSet::new();
        for &w in per_rank.iter().flatten().flatten() {
            assert!(
                epoch.insert(w),
                "window {w} served twice in one epoch (shuffle {shuffle})"
            );
        }
        assert_eq!(epoch.len(), 18);
        if !shuffle {
            // Global batch g is windows 6g..6g+6; rank r takes 6g+2r and 6g+2r+1.
            for (r, batches) in per_rank.iter().enumerate() {
                for (g, windows) in batches.iter().enumerate() {
                    let first = 6 * g as u64 + 2 * r as u64;
                    assert_eq!(windows, &vec![first, first + 1]);
                }
            }
        }
    }
}

#[test]
fn shuffle_is_a_seeded_permutation_per_epoch() {
    let epoch0 = take(&mut sampler(16, 2, 0, 1, true, 5), 8);
    let mut seen: Vec<u64> = epoch0.concat();
    seen.sort();
    assert_eq!(
        seen,
        (0..16).collect::<Vec<_>>(),
        "an epoch visits every window once"
    );
    assert_eq!(
        take(&mut sampler(16, 2, 0, 1, true, 5), 8),
        epoch0,
        "same seed, same order"
    );
    assert_ne!(
        take(&mut sampler(16, 2, 0, 1, true, 6), 8),
        epoch0,
        "other seed, other order"
    );
    let mut s = sampler(16, 2, 0, 1, true, 5);
    take(&mut s, 8);
    assert_ne!(take(&mut s, 8), epoch0, "epoch 1 reshuffles");
}

#[test]
fn restored_state_continues_exactly() {
    for shuffle in [false, true] {
        let mut a = sampler(14, 2, 1, 2, shuffle, 11);
        take(&mut a, 5); // 3 batches per epoch: this crosses into epoch 1.
        let saved = serde_json::to_string(&a.state()).unwrap();
        let expected = take(&mut a, 7);

        let mut b = sampler(14, 2, 1, 2, shuffle, 0);
        b.restore(serde_json::from_str(&saved).unwrap()).unwrap();
        assert_eq!(
            b.state(),
            SamplerState {
                epoch: 1,
                index: 2,
                seed: 11
            }
        );
        assert_eq!(take(&mut b, 7), expected, "shuffle {shuffle}");
    }
}

#[test]
fn sampler_rejects_data_smaller_than_one_global_batch() {
    let e = Sampler::new(Arc::new(Counting(5)), T, 2, 0, 3, false, 0)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("5 windows") && e.contains("global batch of 6"),
        "{e}"
    );
    assert!(
        Sampler::new(Arc::new(Counting(6)), T, 2, 3, 3, false, 0).is_err(),
        "rank >= dp"
    );
}

#[test]
fn synthetic_entropy_floor_is_the_branch_entropy() {
    // Branch probabilities 0.6, 0.2, 0.1, 0.1: -(0.6 ln 0.6 + 0.2 ln 0.2 + 0.2 ln 0.1) = 1.088899 nats.
    assert!((SyntheticData::entropy_floor() - 1.088899).abs() < 1e-6);
    assert!(SyntheticData::entropy_floor() < 0.25 * (256f64).ln());
}

#[test]
fn synthetic_windows_are_deterministic_walks_of_the_chain() {
    let d = SyntheticData::new(256, 3).unwrap();
    let again = SyntheticData::new(256, 3).unwrap();
    let other = SyntheticData::new(256, 4).unwrap();
    let (mut w1, mut w2, mut w3) = (vec![0u32; 65], vec![0u32; 65], vec![0u32; 65]);
    d.read_window(17, 64, &mut w1).unwrap();
    again.read_window(17, 64, &mut w2).unwrap();
    other.read_window(17, 64, &mut w3).unwrap();
    assert_eq!(w1, w2);
    assert_ne!(w1, w3);
    for split in [d.clone(), d.validation()] {
        for i in 0..50 {
            split.read_window(i, 64, &mut w1).unwrap();
            assert!(w1.iter().all(|&t| t < 256));
            for p in w1.windows(2) {
                assert!(
                    d.transition_prob(p[0], p[1]) > 0.0,
                    "{} -> {} is not in the chain",
                    p[0],
                    p[1]
                );
            }
        }
    }
    d.read_window(0, 64, &mut w1).unwrap();
    d.validation().read_window(0, 64, &mut w2).unwrap();
    assert_ne!(w1, w2, "validation windows differ from training windows");
}

#[test]
fn synthetic_structure_is_learnable_by_a_bigram_model() {
    // Count bigrams on 2000 training windows (128k transitions, ~500 per token), then measure the
    // cross-entropy of the smoothed counts on 200 validation windows. A model that learnt the chain
    // gets close to the entropy floor (1.09); one that learnt nothing gets ln 256 = 5.55. The 0.15
    // nats allowance covers add-0.01 smoothing and sampling noise in the estimated probabilities.
    let (v, t) = (256usize, 64usize);
    let d = SyntheticData::new(v, 1337).unwrap();
    let mut counts = vec![0f64; v * v];
    let mut w = vec![0u32; t + 1];
    for i in 0..2000 {
        d.read_window(i, t, &mut w).unwrap();
        for p in w.windows(2) {
            counts[p[0] as usize * v + p[1] as usize] += 1.0;
        }
    }
    let val = d.validation();
    let (mut nll, mut n) = (0.0, 0.0);
    for i in 0..200 {
        val.read_window(i, t, &mut w).unwrap();
        for p in w.windows(2) {
            let row = &counts[p[0] as usize * v..(p[0] as usize + 1) * v];
            let total: f64 = row.iter().sum::<f64>() + 0.01 * v as f64;
            nll -= ((row[p[1] as usize] + 0.01) / total).ln();
            n += 1.0;
        }
    }
    let ce = nll / n;
    let floor = SyntheticData::entropy_floor();
    assert!(
        ce > floor - 0.05 && ce < floor + 0.15,
        "bigram val cross-entropy {ce:.3}, floor {floor:.3}"
    );
}
