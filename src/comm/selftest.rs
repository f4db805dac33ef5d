//! Self-check of every collective: each element type and operator, in place and out of place, at
//! chosen counts, against a reference computed element by element from exact inputs (small
//! integers whose sums and products are exact in every type), compared bit for bit.
//!
//! Used by the unit tests (in-process ranks) and by `meshtrain selftest` (real processes under a
//! launcher, over shared memory or TCP), so that the same checks run on a new cluster. The device
//! checks ([`check_device_all`]) run the same references through the device collectives
//! (`comm::device`) on device buffers: the CPU arm in the unit tests, a GPU under
//! `meshtrain selftest --device cuda`.

use std::fmt::Debug;

use half::{bf16, f16};

use crate::dtype::{exact_input as value, exact_result as expected};
use crate::comm::device::GpuCommState;
use crate::comm::{block_range, Communicator, DType, Element, ReduceOp};
use crate::device::ipc::alloc_shareable;
use crate::device::{Device, DeviceBuffer};
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

/// Runs `check::<T>(args)` for every element type and collects the failures.
macro_rules! every_dtype {
    ($check:ident($($arg:expr),*)) => {{
        let mut fails = $check::<f32>($($arg),*)?;
        fails.extend($check::<f64>($($arg),*)?);
        fails.extend($check::<bf16>($($arg),*)?);
        fails.extend($check::<f16>($($arg),*)?);
        fails.extend($check::<i32>($($arg),*)?);
        fails.extend($check::<i64>($($arg),*)?);
        fails.extend($check::<u8>($($arg),*)?);
        Ok(fails)
    }};
}

/// Checks every collective for every element type at each count with the operators `ops`.
pub fn check_all(c: &Communicator, counts: &[usize], ops: &[ReduceOp]) -> Result<Vec<String>> {
    every_dtype!(check_type(c, counts, ops))
}

/// The first `n` elements of a device buffer.
fn download<T: Element>(dev: &Device, buf: &DeviceBuffer, n: usize) -> Result<Vec<T>> {
    let mut v = vec![T::from_i64(0); n];
    dev.synchronize()?;
    dev.copy_to_host(buf, &mut v)?;
    Ok(v)
}

/// `n` copies of 99, which no collective here produces.
fn poison<T: Element>(n: usize) -> Vec<T> {
    vec![T::from_i64(99); n]
}

/// Checks every device collective for element type `T` at each count, on `dev`'s buffers;
/// returns the failures. Two shareable buffers are allocated once and reused by every call (as
/// a training step reuses its gradients), so IPC mappings are opened once and then come from
/// the cache; they are released (collectively) before the buffers are freed.
pub fn check_device_type<T: Element + Debug>(
    c: &Communicator,
    dev: &Device,
    state: &mut GpuCommState,
    counts: &[usize],
    ops: &[ReduceOp],
) -> Result<Vec<String>> {
    let mut fails = Vec::new();
    let (k, me, dt) = (c.size(), c.rank(), T::DTYPE);
    let most = counts.iter().copied().max().unwrap_or(0);
    // x: inputs and in-place buffers (n elements); y: outputs (up to n + k for all-to-all).
    let mut x = alloc_shareable(dev, most * dt.size())?;
    let mut y = alloc_shareable(dev, (most + k) * dt.size())?;
    let mut coll = state.bind(c, dev);
    for &n in counts {
        let mine = block_range(n, k, me);
        for &op in ops {
            let ctx = format!("device {dt:?} {} n={n} k={k} rank={me}", op.name());
            let input: Vec<T> = (0..n).map(|i| value(op, me, i)).collect();
            let want: Vec<T> = (0..n).map(|i| expected(op, k, i)).collect();

            dev.copy_to_device(&mut x, &input)?;
            coll.all_reduce(&mut x, n, dt, op)?;
            same(&mut fails, &format!("all_reduce {ctx}"), &download::<T>(dev, &x, n)?, &want);

            dev.copy_to_device(&mut x, &input)?;
            dev.copy_to_device(&mut y, &poison::<T>(mine.len()))?;
            coll.reduce_scatter_into(&x, &mut y, n, dt, op)?;
            same(&mut fails, &format!("reduce_scatter_into {ctx}"), &download::<T>(dev, &y, mine.len())?, &want[mine.clone()]);

            let root = n % k;
            dev.copy_to_device(&mut x, &input)?;
            coll.reduce(&mut x, n, dt, op, root)?;
            let got = download::<T>(dev, &x, n)?;
            same(&mut fails, &format!("reduce {ctx}"), &got, if me == root { &want } else { &input });
        }
        let ctx = format!("device {dt:?} n={n} k={k} rank={me}");
        let full: Vec<T> = (0..n).map(|i| value(ReduceOp::Sum, i % 3 + 1, i)).collect();
        dev.copy_to_device(&mut x, &full[mine.clone()])?;
        dev.copy_to_device(&mut y, &poison::<T>(n))?;
        coll.all_gather_into(&x, &mut y, n, dt)?;
        same(&mut fails, &format!("all_gather_into {ctx}"), &download::<T>(dev, &y, n)?, &full);

        let root = (n / 3) % k;
        dev.copy_to_device(&mut x, &if me == root { full.clone() } else { poison(n) })?;
        coll.broadcast(&mut x, n, dt, root)?;
        same(&mut fails, &format!("broadcast {ctx}"), &download::<T>(dev, &x, n)?, &full);

        let own: Vec<T> = (0..n).map(|i| value(ReduceOp::Sum, me, i)).collect();
        dev.copy_to_device(&mut x, &own)?;
        dev.copy_to_device(&mut y, &poison::<T>(mine.len() * k))?;
        coll.all_to_all_into(&x, &mut y, n, dt)?;
        let want: Vec<T> = (0..k).flat_map(|s| mine.clone().map(move |i| value(ReduceOp::Sum, s, i))).collect();
        same(&mut fails, &format!("all_to_all {ctx}"), &download::<T>(dev, &y, mine.len() * k)?, &want);

        if k > 1 {
            let (next, prev) = ((me + 1) % k, (me + k - 1) % k);
            dev.copy_to_device(&mut y, &poison::<T>(n))?;
            if me % 2 == 0 {
                coll.send(&x, n, dt, next)?;
                coll.recv_into(&mut y, n, dt, prev)?;
            } else {
                coll.recv_into(&mut y, n, dt, prev)?;
                coll.send(&x, n, dt, next)?;
            }
            let want: Vec<T> = (0..n).map(|i| value(ReduceOp::Sum, prev, i)).collect();
            same(&mut fails, &format!("send/recv {ctx}"), &download::<T>(dev, &y, n)?, &want);
        }
    }
    state.check(c, dev)?;
    state.release_mappings(c, dev)?;
    Ok(fails)
}

/// Checks every device collective for every element type at each count with the operators `ops`.
pub fn check_device_all(
    c: &Communicator,
    dev: &Device,
    state: &mut GpuCommState,
    counts: &[usize],
    ops: &[ReduceOp],
) -> Result<Vec<String>> {
    every_dtype!(check_device_type(c, dev, state, counts, ops))
}

/// `meshtrain selftest --device`: every device collective on `dev` (counts with every operator,
/// `large` with f32 and every operator), configured from the environment. Returns the failures
/// and the paths taken: "device path: I of C collective calls over IPC, S stream-ordered, R over
/// FI_HMEM rings, H hierarchical; send/recv: D of T FI_HMEM direct".
pub fn check_device_job(c: &Communicator, dev: &Device, counts: &[usize], large: usize) -> Result<(Vec<String>, String)> {
    let mut state = GpuCommState::new(crate::comm::device::GpuCommConfig::from_env()?);
    let mut fails = check_device_all(c, dev, &mut state, counts, &ReduceOp::ALL)?;
    if large > 0 {
        fails.extend(check_device_type::<f32>(c, dev, &mut state, &[large], &ReduceOp::ALL)?);
    }
    let (ipc, calls) = state.path_counts();
    let streamed = state.stream_ordered_calls();
    let (direct, staged) = state.direct_counts();
    let paths = format!(
        "device path: {ipc} of {calls} collective calls over IPC, {streamed} stream-ordered, {} over FI_HMEM rings, {} hierarchical; \
         send/recv: {direct} of {} FI_HMEM direct",
        state.ring_calls(),
        state.hierarchical_calls(),
        direct + staged
    );
    Ok((fails, paths))
}

/// Device collectives that go wrong, for the stream-ordered error tests (`meshtrain selftest
/// --device D --mismatch CASE`, hidden): member 1 deviates (`count`: an all-reduce of 2000
/// instead of 1000 f32; `op`: a maximum instead of a sum; `skip`: no call at all) and then every
/// member checks. Every member must
/// get the error naming the failing rank and calls; `Ok` never comes back.
pub fn device_mismatch(c: &Communicator, dev: &Device, case: &str) -> Result<()> {
    let mut state = GpuCommState::new(crate::comm::device::GpuCommConfig::from_env()?);
    let mut buf = alloc_shareable(dev, 2000 * 4)?;
    dev.copy_to_device(&mut buf, &vec![1f32; 2000])?;
    let odd = c.rank() == 1;
    let mut coll = state.bind(c, dev);
    // The first call sets the path up (collective): the deviation comes in the second.
    coll.all_reduce(&mut buf, 1000, DType::F32, ReduceOp::Sum)?;
    match (case, odd) {
        ("count", true) => coll.all_reduce(&mut buf, 2000, DType::F32, ReduceOp::Sum)?,
        ("op", true) => coll.all_reduce(&mut buf, 1000, DType::F32, ReduceOp::Max)?,
        ("skip", true) => {}
        ("count" | "op" | "skip", false) => coll.all_reduce(&mut buf, 1000, DType::F32, ReduceOp::Sum)?,
        _ => return Err(crate::Error::InvalidArgument(format!("selftest --device --mismatch: `{case}` is not count, op or skip"))),
    }
    state.check(c, dev)?;
    Err(crate::Error::Check(format!("selftest --device --mismatch {case}: the deviation was not detected")))
}

/// Mismatched calls, for the fingerprint test (`meshtrain selftest --mismatch CASE`, hidden):
/// member 1 deviates from the others in one way (`op`: all-gather instead of all-reduce;
/// `count`: 2000 instead of 1000 elements; `dtype`: f64 instead of f32; `root`: broadcast from
/// itself instead of member 0; `reduce`: max instead of sum). Every member must get an error
/// (the fingerprint check, or the job-wide abort it raises); `Ok` never comes back: a job in which
/// no member noticed is reported as a failed check.
pub fn mismatch(c: &Communicator, case: &str) -> Result<()> {
    let odd = c.rank() == 1;
    let mut a = vec![1f32; 1000];
    // Links up first: otherwise a rank still connecting to a member that already failed on the
    // mismatch reports that member gone instead of the mismatch (3 ranks, seen under load).
    c.barrier()?;
    match (case, odd) {
        ("op", true) => c.all_gather(&mut a)?,
        ("count", true) => c.all_reduce(&mut vec![1f32; 2000], ReduceOp::Sum)?,
        ("dtype", true) => c.all_reduce(&mut vec![1f64; 1000], ReduceOp::Sum)?,
        ("root", _) => c.broadcast(&mut a, usize::from(odd))?,
        ("reduce", true) => c.all_reduce(&mut a, ReduceOp::Max)?,
        ("op" | "count" | "dtype" | "reduce", _) => c.all_reduce(&mut a, ReduceOp::Sum)?,
        _ => {
            return Err(crate::Error::InvalidArgument(format!(
                "selftest --mismatch: `{case}` is not op, count, dtype, root or reduce"
            )))
        }
    }
    // A call whose mismatch shows only at the peer's next call (a broadcast from two roots moves
    // data one way only) is caught by this one.
    c.barrier()?;
    Err(crate::Error::Check(format!("selftest --mismatch {case}: the mismatched calls were not detected")))
}
