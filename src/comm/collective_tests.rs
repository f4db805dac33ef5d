//! Every collective, element type and operator on in-process ranks (world sizes 1..8) through
//! [`super::selftest`]; small chunks force multi-piece pipelining in the ring and direct schedules.
//! The single-copy schedules run forced on (in-process ranks read each other's memory through the
//! same system call as separate processes), and the fallback runs over links that cannot read.
//! The split all-reduce leaves the same bits on every rank, and fails naming the member that left.

use crate::dtype::{exact_input as value, exact_result as expected};
use crate::comm::probe::Reads;
use crate::comm::selftest::{check_all, check_type};
use crate::comm::testing::{run_ranks, run_ranks_without_peer_memory};
use crate::comm::tuner::{Family, LinkKind, Rule, Tuning};
use crate::comm::{Algo, Cma, CommConfig, ReduceOp};
use std::sync::Arc;
use crate::transport::cma::PeerMemory;

/// Whether this machine lets a process use `process_vm_readv` at all (some containers' seccomp
/// profiles forbid it); the single-copy tests that need working reads say SKIP without it (the
/// fallback tests below run everywhere).
fn reads_allowed() -> bool {
    let src = [7u8; 8];
    let mut dst = [0u8; 8];
    let ok = PeerMemory::new(std::process::id()).is_some_and(|m| m.read(src.as_ptr() as u64, &mut dst).is_ok());
    if !ok {
        eprintln!("SKIP: process_vm_readv is forbidden on this machine; single-copy reads cannot be exercised");
    }
    ok && dst == src
}

fn cfg(algo: Algo) -> CommConfig {
    // 128-byte pieces: a 1000-element buffer is cut into many pieces per segment.
    CommConfig { algo, small_bytes: 512, chunk_bytes: 128, ..CommConfig::default() }
}

#[test]
fn every_collective_every_dtype_every_size_ring() {
    for k in 1..=8 {
        run_ranks(k, cfg(Algo::Ring), |c| {
            assert_eq!(check_all(&c, &[0, 1, 2, 13, 97, 1000], &ReduceOp::ALL).unwrap(), Vec::<String>::new())
        });
    }
}

#[test]
fn every_collective_every_dtype_every_size_direct() {
    for k in 1..=8 {
        run_ranks(k, cfg(Algo::Direct), |c| {
            assert_eq!(check_all(&c, &[0, 1, 13, 1000], &ReduceOp::ALL).unwrap(), Vec::<String>::new())
        });
    }
}

#[test]
fn every_collective_every_dtype_every_size_single_copy() {
    if !reads_allowed() {
        return;
    }
    for k in 1..=8 {
        let cfg = CommConfig { cma: Cma::On, ..cfg(Algo::Auto) };
        let reads = run_ranks(k, cfg, |c| {
            assert_eq!(
                check_all(&c, &[0, 1, 2, 13, 97, 1000], &ReduceOp::ALL).unwrap(),
                Vec::<String>::new()
            );
            c.single_copy_reads()
        });
        // One rank has no peers to read: nothing to probe. Otherwise reads work (whether they pay
        // depends on this machine's copy rates; forced on, they are used either way), and every
        // rank got the same answer.
        if k == 1 {
            assert_eq!(reads[0], None);
        } else {
            assert!(matches!(reads[0], Some(Reads::Pay | Reads::Slow(_))), "k={k}: {reads:?}");
            assert!(reads.iter().all(|r| *r == reads[0]), "k={k}: {reads:?}");
        }
    }
}

#[test]
fn single_copy_in_auto_mode_above_the_small_size_only() {
    if !reads_allowed() {
        return;
    }
    for k in [3, 5] {
        // 100 f32 are 400 bytes (direct, no probe), 1000 are 4000 (single copy).
        let probed = run_ranks(k, cfg(Algo::Auto), |c| {
            assert!(check_type::<f32>(&c, &[5, 100], &ReduceOp::ALL).unwrap().is_empty());
            let before = c.single_copy_reads();
            assert!(check_type::<f32>(&c, &[1000, 1001], &ReduceOp::ALL).unwrap().is_empty());
            (before, c.single_copy_reads())
        });
        assert!(probed.iter().all(|p| p.0.is_none() && p.1 == probed[0].1), "k={k}: {probed:?}");
        assert!(matches!(probed[0].1, Some(Reads::Pay | Reads::Slow(_))), "k={k}: {probed:?}");
    }
}

#[test]
fn single_copy_off_or_unavailable_falls_back_to_the_fifo_schedules() {
    for k in [3, 5] {
        let off = CommConfig { cma: Cma::Off, ..cfg(Algo::Auto) };
        let probed = run_ranks(k, off, |c| {
            assert!(check_type::<f32>(&c, &[1000, 1001], &ReduceOp::ALL).unwrap().is_empty());
            c.single_copy_reads()
        });
        assert!(probed.iter().all(Option::is_none), "off: nothing probed, {probed:?}");
        let probed = run_ranks_without_peer_memory(k, cfg(Algo::Auto), |c| {
            assert!(check_type::<f32>(&c, &[1000, 1001], &ReduceOp::ALL).unwrap().is_empty());
            c.single_copy_reads()
        });
        for p in &probed {
            // Every rank reports the same reason: the lowest rank that could not read.
            assert_eq!(
                p,
                &Some(Reads::Fail(
                    "rank 0: reading rank 1: the link offers no access to the peer's memory".into()
                ))
            );
        }
    }
}

#[test]
fn single_copy_forced_on_without_peer_memory_is_an_error_everywhere() {
    let errors = run_ranks_without_peer_memory(3, CommConfig { cma: Cma::On, ..cfg(Algo::Auto) }, |c| {
        let mut v = vec![1.0f32; 7];
        c.all_gather(&mut v).map(|_| ()).map_err(|e| e.to_string())
    });
    for e in errors {
        match e {
            Err(msg) => {
                assert!(msg.contains("MESHTRAIN_CMA") && msg.contains("rank 0: reading rank 1"), "{msg}")
            }
            Ok(()) => panic!("a forced single-copy all-gather succeeded without peer memory"),
        }
    }
}

#[test]
fn auto_switches_between_schedules() {
    for k in [3, 4] {
        run_ranks(k, cfg(Algo::Auto), |c| {
            assert!(check_type::<f32>(&c, &[5, 100, 1000], &ReduceOp::ALL).unwrap().is_empty())
        });
    }
}

#[test]
fn split_builds_independent_communicators() {
    let sums = run_ranks(6, CommConfig::default(), |c| {
        let me = c.rank();
        let sub = c.split(Some((me % 2) as u32), -(me as i64)).unwrap().unwrap();
        // Keys are negated ranks: the sub-communicator orders members by descending world rank.
        let mut v = [me as i64];
        sub.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        let none = c.split(None, 0).unwrap();
        assert!(none.is_none());
        (sub.size(), sub.rank(), v[0])
    });
    assert_eq!(sums[0], (3, 2, 6));
    assert_eq!(sums[4], (3, 0, 6));
    assert_eq!(sums[1], (3, 2, 9));
    assert_eq!(sums[5], (3, 0, 9));
}

#[test]
fn two_communicators_run_concurrently() {
    run_ranks(4, cfg(Algo::Ring), |c| {
        let other = c.split(Some(0), c.rank() as i64).unwrap().unwrap();
        std::thread::scope(|s| {
            let a = s.spawn(|| {
                let mut v = vec![1.0f32; 5000];
                c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                v
            });
            let mut w = vec![2i64; 3000];
            other.all_reduce(&mut w, ReduceOp::Sum).unwrap();
            assert!(w.iter().all(|&x| x == 8));
            assert!(a.join().unwrap().iter().all(|&x| x == 4.0));
        });
    });
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    run_ranks(2, CommConfig::default(), |c| {
        let mut small = vec![0f32; 3];
        assert!(c.all_reduce_into(&[1.0f32; 4], &mut small, ReduceOp::Sum).is_err());
        assert!(c.broadcast(&mut small, 5).is_err());
        assert!(c.send(&small, c.rank()).is_err());
        assert!(c.reduce_scatter_into(&[1.0f32; 4], &mut small, ReduceOp::Sum).is_err());
    });
}

#[test]
fn the_check_reports_wrong_results() {
    // A communicator whose members disagree on the count cannot produce the reference result; the
    // self-check must say so rather than pass. Rank 1 checks a reduction against a reference for
    // a different world size.
    let fails = run_ranks(2, cfg(Algo::Ring), |c| {
        let input: Vec<f32> = (0..10).map(|i| value(ReduceOp::Sum, c.rank(), i)).collect();
        let mut out = vec![0f32; 10];
        c.all_reduce_into(&input, &mut out, ReduceOp::Sum).unwrap();
        let want: Vec<f32> = (0..10).map(|i| expected(ReduceOp::Sum, 3, i)).collect();
        let mut fails = Vec::new();
        super::selftest::same(&mut fails, "wrong reference", &out, &want);
        fails
    });
    assert!(fails.iter().all(|f| f.len() == 1 && f[0].contains("first difference")), "{fails:?}");
}

/// A table forcing the split all-reduce with a ring reduce-scatter and a direct all-gather (or
/// `rs`/`ag` as given) on every world size.
fn split_cfg(rs: Family, ag: Family) -> CommConfig {
    let rule = |coll: &str, algo| Rule { coll: coll.into(), ranks: 2, link: LinkKind::Shm, max_bytes: None, algo, chunk_bytes: 128 };
    let rules = vec![rule("all_reduce", Family::Split), rule("reduce_scatter", rs), rule("all_gather", ag)];
    CommConfig { chunk_bytes: 128, tuning: Some(Arc::new(Tuning::from_rules(rules, "split").unwrap())), ..CommConfig::default() }
}

#[test]
fn split_all_reduce_leaves_the_same_bits_on_every_rank() {
    // Inexact sums (magnitudes 1e-8..1e8, signs mixed): the order of additions shows in the bits,
    // so equal bits everywhere need each element reduced once and copied; sizes around k blocks.
    for (k, rs, ag) in [(3, Family::Ring, Family::Direct), (4, Family::Direct, Family::Ring), (7, Family::Ring, Family::Ring)] {
        let rows = run_ranks(k, split_cfg(rs, ag), |c| {
            let n = 1001;
            let input: Vec<f32> = (0..n)
                .map(|i| {
                    let x = ((c.rank() * 7919 + i * 104_729) % 1000) as f32 / 7.0 + 0.1;
                    x * 10f32.powi((i % 17) as i32 - 8) * if (i + c.rank()) % 3 == 0 { -1.0 } else { 1.0 }
                })
                .collect();
            let mut out = vec![0f32; n];
            c.all_reduce_into(&input, &mut out, ReduceOp::Sum).unwrap();
            let mut inplace = input.clone();
            c.all_reduce(&mut inplace, ReduceOp::Sum).unwrap();
            assert_eq!(out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), inplace.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            out.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
        });
        assert!(rows.iter().all(|r| *r == rows[0]), "k={k}: ranks differ");
    }
}

#[test]
fn a_member_leaving_fails_a_split_all_reduce_naming_it_without_a_hang() {
    for (rs, ag) in [(Family::Ring, Family::Direct), (Family::Direct, Family::Ring)] {
        let cfg = CommConfig { timeout: std::time::Duration::from_secs(60), ..split_cfg(rs, ag) };
        let start = std::time::Instant::now();
        let results = run_ranks(3, cfg, |c| {
            let child = c.split(Some(0), c.rank() as i64).unwrap().unwrap();
            if c.rank() == 0 {
                drop(child);
                return Ok(());
            }
            let mut v = vec![1.0f32; 4000];
            child.all_reduce(&mut v, ReduceOp::Sum).map_err(|e| e.to_string())
        });
        assert!(start.elapsed() < std::time::Duration::from_secs(30), "took {:?}", start.elapsed());
        for (r, res) in results.iter().enumerate().skip(1) {
            let e = res.as_ref().expect_err("an all-reduce without member 0 succeeded");
            assert!(e.contains("peer rank") && e.contains("all_reduce"), "rank {r}: {e}");
        }
        assert!(results.iter().skip(1).any(|e| e.as_ref().unwrap_err().contains("peer rank 0")), "{results:?}");
    }
}
