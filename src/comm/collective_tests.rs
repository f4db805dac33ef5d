//! Every collective, element type and operator on in-process ranks (world sizes 1..8), against a
//! reference computed element by element; inputs are small integers so every result is exact and
//! compared bit for bit. Small chunks force multi-piece pipelining in the ring and direct schedules.

use std::fmt::Debug;

use crate::comm::testing::run_ranks;
use crate::comm::{block_range, Algo, CommConfig, Communicator, DType, Element, ReduceOp};
use half::{bf16, f16};

/// Input of rank `r` at element `i`: small integers whose sums and products stay exact in every
/// element type (|sum| <= 8*5, products of at most 8 factors in {-1, 1, 2}; u8 avoids negatives).
fn value<T: Element>(op: ReduceOp, r: usize, i: usize) -> T {
    let v = match op {
        ReduceOp::Prod if T::DTYPE == DType::U8 => 1 + ((r + i) % 3 == 0) as i64,
        ReduceOp::Prod => [1, -1, 2][(r * 5 + i * 7) % 3],
        _ if T::DTYPE == DType::U8 => ((r * 7 + i * 3) % 11) as i64,
        _ => ((r * 7 + i * 3) % 11) as i64 - 5,
    };
    T::from_i64(v)
}

fn expected<T: Element>(op: ReduceOp, k: usize, i: usize) -> T {
    let mut acc = value::<T>(op, 0, i);
    for r in 1..k {
        let x = value::<T>(op, r, i);
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => T::add(acc, x),
            ReduceOp::Prod => T::mul(acc, x),
            ReduceOp::Min => if x < acc { x } else { acc },
            ReduceOp::Max => if x > acc { x } else { acc },
        };
    }
    if op == ReduceOp::Avg { acc.div_count(k) } else { acc }
}

fn same<T: Element + Debug>(what: &str, got: &[T], want: &[T]) {
    let (g, w): (&[u8], &[u8]) = (bytemuck::cast_slice(got), bytemuck::cast_slice(want));
    if g != w {
        let i = got.iter().zip(want).position(|(a, b)| bytemuck::bytes_of(a) != bytemuck::bytes_of(b));
        panic!("{what}: first difference at element {i:?}: got {:?} want {:?}", i.map(|i| got[i]), i.map(|i| want[i]));
    }
}

fn check_type<T: Element + Debug>(c: &Communicator, counts: &[usize]) {
    let (k, me) = (c.size(), c.rank());
    for &n in counts {
        for op in ReduceOp::ALL {
            let ctx = format!("{:?} {} n={n} k={k} rank={me}", T::DTYPE, op.name());
            let input: Vec<T> = (0..n).map(|i| value(op, me, i)).collect();
            let want: Vec<T> = (0..n).map(|i| expected(op, k, i)).collect();
            let mine = block_range(n, k, me);

            let mut out = vec![T::from_i64(99); n];
            c.all_reduce_into(&input, &mut out, op).unwrap();
            same(&format!("all_reduce_into {ctx}"), &out, &want);
            let mut buf = input.clone();
            c.all_reduce(&mut buf, op).unwrap();
            same(&format!("all_reduce {ctx}"), &buf, &want);

            let mut out = vec![T::from_i64(99); mine.len()];
            c.reduce_scatter_into(&input, &mut out, op).unwrap();
            same(&format!("reduce_scatter_into {ctx}"), &out, &want[mine.clone()]);
            let mut buf = input.clone();
            c.reduce_scatter(&mut buf, op).unwrap();
            same(&format!("reduce_scatter {ctx}"), &buf[mine.clone()], &want[mine.clone()]);

            let root = n % k;
            let mut out = vec![T::from_i64(99); if me == root { n } else { 0 }];
            c.reduce_into(&input, &mut out, op, root).unwrap();
            if me == root {
                same(&format!("reduce_into {ctx}"), &out, &want);
            }
            let mut buf = input.clone();
            c.reduce(&mut buf, op, root).unwrap();
            same(&format!("reduce {ctx}"), &buf, if me == root { &want } else { &input });
        }
        let ctx = format!("{:?} n={n} k={k} rank={me}", T::DTYPE);
        let full: Vec<T> = (0..n).map(|i| value(ReduceOp::Sum, i % 3 + 1, i)).collect();
        let mut out = vec![T::from_i64(99); n];
        c.all_gather_into(&full[c.block(n)], &mut out).unwrap();
        same(&format!("all_gather_into {ctx}"), &out, &full);
        let mut buf: Vec<T> = full.iter().enumerate().map(|(i, &v)| if c.block(n).contains(&i) { v } else { T::from_i64(99) }).collect();
        c.all_gather(&mut buf).unwrap();
        same(&format!("all_gather {ctx}"), &buf, &full);

        let root = (n / 3) % k;
        let mut buf: Vec<T> = if me == root { full.clone() } else { vec![T::from_i64(99); n] };
        c.broadcast(&mut buf, root).unwrap();
        same(&format!("broadcast {ctx}"), &buf, &full);

        // all_to_all: rank s sends element i of its buffer encoded with its own rank.
        let send: Vec<T> = (0..n).map(|i| value(ReduceOp::Sum, me, i)).collect();
        let len = block_range(n, k, me).len();
        let mut out = vec![T::from_i64(99); len * k];
        c.all_to_all_into(&send, &mut out).unwrap();
        let want: Vec<T> = (0..k).flat_map(|s| mine_of(n, k, me).map(move |i| value(ReduceOp::Sum, s, i))).collect();
        same(&format!("all_to_all {ctx}"), &out, &want);

        if k > 1 {
            let (next, prev) = ((me + 1) % k, (me + k - 1) % k);
            let mut got = vec![T::from_i64(99); n];
            if me % 2 == 0 {
                c.send(&send, next).unwrap();
                c.recv_into(&mut got, prev).unwrap();
            } else {
                c.recv_into(&mut got, prev).unwrap();
                c.send(&send, next).unwrap();
            }
            let want: Vec<T> = (0..n).map(|i| value(ReduceOp::Sum, prev, i)).collect();
            same(&format!("send/recv {ctx}"), &got, &want);
        }
    }
}

fn mine_of(n: usize, k: usize, me: usize) -> std::ops::Range<usize> {
    block_range(n, k, me)
}

fn check_all(c: &Communicator, counts: &[usize]) {
    check_type::<f32>(c, counts);
    check_type::<f64>(c, counts);
    check_type::<bf16>(c, counts);
    check_type::<f16>(c, counts);
    check_type::<i32>(c, counts);
    check_type::<i64>(c, counts);
    check_type::<u8>(c, counts);
}

fn cfg(algo: Algo) -> CommConfig {
    // 128-byte pieces: a 1000-element buffer is cut into many pieces per segment.
    CommConfig { algo, small_bytes: 512, chunk_bytes: 128, ..CommConfig::default() }
}

#[test]
fn every_collective_every_dtype_every_size_ring() {
    for k in 1..=8 {
        run_ranks(k, cfg(Algo::Ring), |c| check_all(&c, &[0, 1, 2, 13, 97, 1000]));
    }
}

#[test]
fn every_collective_every_dtype_every_size_direct() {
    for k in 1..=8 {
        run_ranks(k, cfg(Algo::Direct), |c| check_all(&c, &[0, 1, 13, 1000]));
    }
}

#[test]
fn auto_switches_between_schedules() {
    for k in [3, 4] {
        run_ranks(k, cfg(Algo::Auto), |c| check_type::<f32>(&c, &[5, 100, 1000]));
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
