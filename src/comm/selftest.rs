//! Self-check of every collective: each element type and operator, in place and out of place, at
//! chosen counts, against a reference computed element by element from exact inputs (small
//! integers whose sums and products are exact in every type), compared bit for bit.
//!
//! Used by the unit tests (in-process ranks) and by `meshtrain selftest` (real processes under a
//! launcher, over shared memory or TCP), so that the same checks run on a new cluster.

use std::fmt::Debug;

use half::{bf16, f16};

use crate::comm::dtype::{exact_input as value, exact_result as expected};
use crate::comm::{block_range, Communicator, Element, ReduceOp};
use crate::error::Result;

/// Records a failure unless `got` and `want` are equal bit for bit.
pub(crate) fn same<T: Element + Debug>(fails: &mut Vec<String>, what: &str, got: &[T], want: &[T]) {
    let bits = |v: &T| bytemuck::bytes_of(v).to_vec();
    if got.len() != want.len() {
        fails.push(format!("{what}: {} elements, expected {}", got.len(), want.len()));
    } else if let Some(i) = got.iter().zip(want).position(|(a, b)| bits(a) != bits(b)) {
        fails.push(format!("{what}: first difference at element {i}: got {:?}, want {:?}", got[i], want[i]));
    }
}

/// Checks every collective for element type `T` at each count; returns the failures.
pub fn check_type<T: Element + Debug>(c: &Communicator, counts: &[usize], ops: &[ReduceOp]) -> Result<Vec<String>> {
    let mut fails = Vec::new();
    let (k, me) = (c.size(), c.rank());
    for &n in counts {
        for &op in ops {
            let ctx = format!("{:?} {} n={n} k={k} rank={me}", T::DTYPE, op.name());
            let input: Vec<T> = (0..n).map(|i| value(op, me, i)).collect();
            let want: Vec<T> = (0..n).map(|i| expected(op, k, i)).collect();
            let mine = block_range(n, k, me);

            let mut out = vec![T::from_i64(99); n];
            c.all_reduce_into(&input, &mut out, op)?;
            same(&mut fails, &format!("all_reduce_into {ctx}"), &out, &want);
            let mut buf = input.clone();
            c.all_reduce(&mut buf, op)?;
            same(&mut fails, &format!("all_reduce {ctx}"), &buf, &want);

            let mut out = vec![T::from_i64(99); mine.len()];
            c.reduce_scatter_into(&input, &mut out, op)?;
            same(&mut fails, &format!("reduce_scatter_into {ctx}"), &out, &want[mine.clone()]);
            let mut buf = input.clone();
            c.reduce_scatter(&mut buf, op)?;
            same(&mut fails, &format!("reduce_scatter {ctx}"), &buf[mine.clone()], &want[mine.clone()]);

            let root = n % k;
            let mut out = vec![T::from_i64(99); if me == root { n } else { 0 }];
            c.reduce_into(&input, &mut out, op, root)?;
            if me == root {
                same(&mut fails, &format!("reduce_into {ctx}"), &out, &want);
            }
            let mut buf = input.clone();
            c.reduce(&mut buf, op, root)?;
            same(&mut fails, &format!("reduce {ctx}"), &buf, if me == root { &want } else { &input });
        }
        let ctx = format!("{:?} n={n} k={k} rank={me}", T::DTYPE);
        let full: Vec<T> = (0..n).map(|i| value(ReduceOp::Sum, i % 3 + 1, i)).collect();
        let mut out = vec![T::from_i64(99); n];
        c.all_gather_into(&full[c.block(n)], &mut out)?;
        same(&mut fails, &format!("all_gather_into {ctx}"), &out, &full);
        let mut buf: Vec<T> = full.iter().enumerate().map(|(i, &v)| if c.block(n).contains(&i) { v } else { T::from_i64(99) }).collect();
        c.all_gather(&mut buf)?;
        same(&mut fails, &format!("all_gather {ctx}"), &buf, &full);

        let root = (n / 3) % k;
        let mut buf: Vec<T> = if me == root { full.clone() } else { vec![T::from_i64(99); n] };
        c.broadcast(&mut buf, root)?;
        same(&mut fails, &format!("broadcast {ctx}"), &buf, &full);

        // all_to_all: rank s sends element i of its buffer encoded with its own rank.
        let send: Vec<T> = (0..n).map(|i| value(ReduceOp::Sum, me, i)).collect();
        let len = block_range(n, k, me).len();
        let mut out = vec![T::from_i64(99); len * k];
        c.all_to_all_into(&send, &mut out)?;
        let want: Vec<T> = (0..k).flat_map(|s| mine_of(n, k, me).map(move |i| value(ReduceOp::Sum, s, i))).collect();
        same(&mut fails, &format!("all_to_all {ctx}"), &out, &want);

        if k > 1 {
            let (next, prev) = ((me + 1) % k, (me + k - 1) % k);
            let mut got = vec![T::from_i64(99); n];
            if me % 2 == 0 {
                c.send(&send, next)?;
                c.recv_into(&mut got, prev)?;
            } else {
                c.recv_into(&mut got, prev)?;
                c.send(&send, next)?;
            }
            let want: Vec<T> = (0..n).map(|i| value(ReduceOp::Sum, prev, i)).collect();
            same(&mut fails, &format!("send/recv {ctx}"), &got, &want);
        }
    }
    Ok(fails)
}

fn mine_of(n: usize, k: usize, me: usize) -> std::ops::Range<usize> {
    block_range(n, k, me)
}

/// Checks every collective for every element type at each count with the operators `ops`.
pub fn check_all(c: &Communicator, counts: &[usize], ops: &[ReduceOp]) -> Result<Vec<String>> {
    let mut fails = check_type::<f32>(c, counts, ops)?;
    fails.extend(check_type::<f64>(c, counts, ops)?);
    fails.extend(check_type::<bf16>(c, counts, ops)?);
    fails.extend(check_type::<f16>(c, counts, ops)?);
    fails.extend(check_type::<i32>(c, counts, ops)?);
    fails.extend(check_type::<i64>(c, counts, ops)?);
    fails.extend(check_type::<u8>(c, counts, ops)?);
    Ok(fails)
}

