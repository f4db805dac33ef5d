//! Element types and reduction operators of the collectives, and the byte-level kernels that apply
//! them.
//!
//! Why a leaf at the crate root: both the collectives ([`crate::comm`]) and the device arms
//! ([`crate::device`], whose reduce kernels and buffers are typed by [`DType`]) need these types,
//! and neither may import the other for them. This module imports nothing from the crate.
//!
//! Algorithms move and combine untyped byte ranges; the [`Reducer`] built once per operation knows
//! the element type and the operator. Invariants:
//! - every byte range handed to a kernel has a length that is a multiple of the element size;
//! - combining is commutative bit for bit (`a + b == b + a` in IEEE arithmetic), so only the
//!   association order matters, and each algorithm fixes that order identically on every rank;
//! - `Avg` sums and then divides by the communicator size once, when a result becomes final
//!   (integers divide with truncation toward zero; bf16/f16 accumulate in their own precision, as
//!   the wire format does).

use bytemuck::Pod;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Element type of a collective buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// bfloat16.
    BF16,
    /// IEEE half.
    F16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// Byte.
    U8,
}

impl DType {
    /// Every element type, in a fixed order (used by tests and the benchmark).
    pub const ALL: [DType; 7] = [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8];

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::BF16 | DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    /// Lower-case name as used on the command line (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }

    /// Parses a name produced by [`DType::name`].
    pub fn parse(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s.to_ascii_lowercase())
    }
}

/// Reduction operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Sum divided by the number of ranks.
    Avg,
}

impl ReduceOp {
    /// Every operator, in a fixed order.
    pub const ALL: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];

    /// Lower-case name (`sum`, `prod`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    /// Parses a name produced by [`ReduceOp::name`].
    pub fn parse(s: &str) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|o| o.name() == s.to_ascii_lowercase())
    }
}

/// A type that collectives can carry.
pub trait Element: Pod + Send + Sync + PartialOrd + 'static {
    /// Its [`DType`].
    const DTYPE: DType;
    /// `a + b` (wrapping for integers).
    fn add(a: Self, b: Self) -> Self;
    /// `a * b` (wrapping for integers).
    fn mul(a: Self, b: Self) -> Self;
    /// `self / n` (truncating for integers).
    fn div_count(self, n: usize) -> Self;
    /// Converts a small integer exactly (test and benchmark inputs are built from these).
    fn from_i64(v: i64) -> Self;
}

macro_rules! float_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn add(a: Self, b: Self) -> Self {
                a + b
            }
            fn mul(a: Self, b: Self) -> Self {
                a * b
            }
            fn div_count(self, n: usize) -> Self {
                self / n as $t
            }
            fn from_i64(v: i64) -> Self {
                v as $t
            }
        }
    };
}
float_element!(f32, DType::F32);
float_element!(f64, DType::F64);

macro_rules! half_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn add(a: Self, b: Self) -> Self {
                <$t>::from_f32(a.to_f32() + b.to_f32())
            }
            fn mul(a: Self, b: Self) -> Self {
                <$t>::from_f32(a.to_f32() * b.to_f32())
            }
            fn div_count(self, n: usize) -> Self {
                <$t>::from_f32(self.to_f32() / n as f32)
            }
            fn from_i64(v: i64) -> Self {
                <$t>::from_f32(v as f32)
            }
        }
    };
}
half_element!(bf16, DType::BF16);
half_element!(f16, DType::F16);

macro_rules! int_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn add(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }
            fn mul(a: Self, b: Self) -> Self {
                a.wrapping_mul(b)
            }
            fn div_count(self, n: usize) -> Self {
                self / n as $t
            }
            fn from_i64(v: i64) -> Self {
                v as $t
            }
        }
    };
}
int_element!(i32, DType::I32);
int_element!(i64, DType::I64);
int_element!(u8, DType::U8);

fn min_of<T: Element>(a: T, b: T) -> T {
    if b < a {
        b
    } else {
        a
    }
}

fn max_of<T: Element>(a: T, b: T) -> T {
    if b > a {
        b
    } else {
        a
    }
}

/// The scalar combine function of `op` (for references; kernels use [`with_op`]).
fn combine<T: Element>(op: ReduceOp) -> fn(T, T) -> T {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => T::add,
        ReduceOp::Prod => T::mul,
        ReduceOp::Min => min_of,
        ReduceOp::Max => max_of,
    }
}

/// Calls `k` with `op`'s combine function as a statically known function item, so that the
/// element loop inside `k` is monomorphized per operator and vectorizes (a function pointer per
/// element would not).
macro_rules! with_op {
    ($op:expr, $T:ty, |$f:ident| $body:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => {
                let $f = <$T as Element>::add;
                $body
            }
            ReduceOp::Prod => {
                let $f = <$T as Element>::mul;
                $body
            }
            ReduceOp::Min => {
                let $f = min_of::<$T>;
                $body
            }
            ReduceOp::Max => {
                let $f = max_of::<$T>;
                $body
            }
        }
    };
}

fn aligned<T>(b: &[u8]) -> bool {
    b.as_ptr() as usize % std::mem::align_of::<T>() == 0
}

/// Applies `f(out[i], x[i])` into `out` element-wise; `out` and `x` hold `T`s as bytes.
#[inline(always)]
fn zip_into<T: Element, F: Fn(T, T) -> T>(out: &mut [u8], x: &[u8], f: F) {
    if aligned::<T>(out) && aligned::<T>(x) {
        let (o, x) = (bytemuck::cast_slice_mut::<u8, T>(out), bytemuck::cast_slice::<u8, T>(x));
        o.iter_mut().zip(x).for_each(|(o, &x)| *o = f(*o, x));
    } else {
        // A transport slot that is not aligned for T: take the slow, unaligned path.
        let n = std::mem::size_of::<T>();
        for (o, x) in out.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
            let r = f(bytemuck::pod_read_unaligned(o), bytemuck::pod_read_unaligned(x));
            o.copy_from_slice(bytemuck::bytes_of(&r));
        }
    }
}

/// Writes `f(a[i], b[i])` into `out`.
#[inline(always)]
fn zip_out<T: Element, F: Fn(T, T) -> T>(out: &mut [u8], a: &[u8], b: &[u8], f: F) {
    if aligned::<T>(out) && aligned::<T>(a) && aligned::<T>(b) {
        let o = bytemuck::cast_slice_mut::<u8, T>(out);
        let (a, b) = (bytemuck::cast_slice::<u8, T>(a), bytemuck::cast_slice::<u8, T>(b));
        o.iter_mut().zip(a.iter().zip(b)).for_each(|(o, (&a, &b))| *o = f(a, b));
    } else {
        out.copy_from_slice(a);
        zip_into(out, b, f);
    }
}

fn scale<T: Element>(buf: &mut [u8], n: usize) {
    if aligned::<T>(buf) {
        bytemuck::cast_slice_mut::<u8, T>(buf).iter_mut().for_each(|v| *v = v.div_count(n));
    } else {
        for c in buf.chunks_exact_mut(std::mem::size_of::<T>()) {
            let v: T = bytemuck::pod_read_unaligned(c);
            c.copy_from_slice(bytemuck::bytes_of(&v.div_count(n)));
        }
    }
}

/// Elements per block of the 16-bit float kernels.
const HALF_BLOCK: usize = 512;

/// 16-bit floats: widen a block of each operand to f32 with `half`'s vectorized conversions,
/// combine in f32, round back. Bit-identical to the element-wise definition
/// `round(f32(a) op f32(b))`, and far faster than converting one element at a time.
fn half_out<H: Element>(out: &mut [u8], a: &[u8], b: &[u8], op: ReduceOp)
where
    [H]: HalfFloatSliceExt,
{
    if !(aligned::<H>(out) && aligned::<H>(a) && aligned::<H>(b)) {
        return with_op!(op, H, |f| zip_out::<H, _>(out, a, b, f));
    }
    let o = bytemuck::cast_slice_mut::<u8, H>(out);
    let (a, b) = (bytemuck::cast_slice::<u8, H>(a), bytemuck::cast_slice::<u8, H>(b));
    let (mut fa, mut fb) = ([0f32; HALF_BLOCK], [0f32; HALF_BLOCK]);
    for ((o, a), b) in o.chunks_mut(HALF_BLOCK).zip(a.chunks(HALF_BLOCK)).zip(b.chunks(HALF_BLOCK)) {
        let n = o.len();
        a.convert_to_f32_slice(&mut fa[..n]);
        b.convert_to_f32_slice(&mut fb[..n]);
        with_op!(op, f32, |f| fa[..n].iter_mut().zip(&fb[..n]).for_each(|(x, &y)| *x = f(*x, y)));
        o.convert_from_f32_slice(&fa[..n]);
    }
}

/// `acc = acc op x` for 16-bit floats (see [`half_out`]).
fn half_into<H: Element>(acc: &mut [u8], x: &[u8], op: ReduceOp)
where
    [H]: HalfFloatSliceExt,
{
    if !(aligned::<H>(acc) && aligned::<H>(x)) {
        return with_op!(op, H, |f| zip_into::<H, _>(acc, x, f));
    }
    let o = bytemuck::cast_slice_mut::<u8, H>(acc);
    let x = bytemuck::cast_slice::<u8, H>(x);
    let (mut fa, mut fb) = ([0f32; HALF_BLOCK], [0f32; HALF_BLOCK]);
    for (o, x) in o.chunks_mut(HALF_BLOCK).zip(x.chunks(HALF_BLOCK)) {
        let n = o.len();
        o.convert_to_f32_slice(&mut fa[..n]);
        x.convert_to_f32_slice(&mut fb[..n]);
        with_op!(op, f32, |f| fa[..n].iter_mut().zip(&fb[..n]).for_each(|(x, &y)| *x = f(*x, y)));
        o.convert_from_f32_slice(&fa[..n]);
    }
}

/// Byte-level reduction kernels for one (dtype, op) pair, chosen once per operation.
#[derive(Clone, Copy)]
pub struct Reducer {
    /// Element type.
    pub dtype: DType,
    /// Operator.
    pub op: ReduceOp,
    into: fn(&mut [u8], &[u8], ReduceOp),
    out: fn(&mut [u8], &[u8], &[u8], ReduceOp),
    scale: fn(&mut [u8], usize),
}

impl Reducer {
    /// Kernels for `dtype` and `op`.
    pub fn new(dtype: DType, op: ReduceOp) -> Self {
        fn make<T: Element>(op: ReduceOp) -> Reducer {
            Reducer {
                dtype: T::DTYPE,
                op,
                into: |o, x, op| with_op!(op, T, |f| zip_into::<T, _>(o, x, f)),
                out: |o, a, b, op| with_op!(op, T, |f| zip_out::<T, _>(o, a, b, f)),
                scale: scale::<T>,
            }
        }
        match dtype {
            DType::F32 => make::<f32>(op),
            DType::F64 => make::<f64>(op),
            DType::BF16 => Reducer { into: half_into::<bf16>, out: half_out::<bf16>, ..make::<bf16>(op) },
            DType::F16 => Reducer { into: half_into::<f16>, out: half_out::<f16>, ..make::<f16>(op) },
            DType::I32 => make::<i32>(op),
            DType::I64 => make::<i64>(op),
            DType::U8 => make::<u8>(op),
        }
    }

    /// `acc = acc (op) x`.
    pub fn reduce_into(&self, acc: &mut [u8], x: &[u8]) {
        debug_assert_eq!(acc.len(), x.len());
        (self.into)(acc, x, self.op)
    }

    /// `out = a (op) b`.
    pub fn reduce_out(&self, out: &mut [u8], a: &[u8], b: &[u8]) {
        debug_assert!(out.len() == a.len() && a.len() == b.len());
        (self.out)(out, a, b, self.op)
    }

    /// Turns a finished reduction over `ranks` contributions into the operator's result: divides by
    /// `ranks` for `Avg`, does nothing otherwise.
    pub fn finalize(&self, buf: &mut [u8], ranks: usize) {
        if self.op == ReduceOp::Avg {
            (self.scale)(buf, ranks)
        }
    }
}

/// Input of rank `rank` at element `i` for testing and benchmarking `op`: small integers whose
/// sums over up to 8 ranks (|sum| <= 40) and products (at most 8 factors in {-1, 1, 2}) are exact in
/// every element type, so results can be compared bit for bit (u8 avoids negatives).
pub fn exact_input<T: Element>(op: ReduceOp, rank: usize, i: usize) -> T {
    let v = match op {
        ReduceOp::Prod if T::DTYPE == DType::U8 => 1 + i64::from((rank + i) % 3 == 0),
        ReduceOp::Prod => [1, -1, 2][(rank * 5 + i * 7) % 3],
        _ if T::DTYPE == DType::U8 => ((rank * 7 + i * 3) % 11) as i64,
        _ => ((rank * 7 + i * 3) % 11) as i64 - 5,
    };
    T::from_i64(v)
}

/// The reduction of [`exact_input`] over ranks `0..ranks` at element `i`, combined in rank order.
pub fn exact_result<T: Element>(op: ReduceOp, ranks: usize, i: usize) -> T {
    let f = combine::<T>(op);
    let acc = (1..ranks).fold(exact_input::<T>(op, 0, i), |acc, r| f(acc, exact_input(op, r, i)));
    if op == ReduceOp::Avg {
        acc.div_count(ranks)
    } else {
        acc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::parse(d.name()), Some(d));
        }
        for o in ReduceOp::ALL {
            assert_eq!(ReduceOp::parse(o.name()), Some(o));
        }
        assert_eq!(DType::parse("f128"), None);
    }

    #[test]
    fn kernels_compute_each_op() {
        let a: Vec<f32> = vec![1.0, -2.0, 3.0, 8.0];
        let b: Vec<f32> = vec![4.0, 5.0, -6.0, 8.0];
        let expect = |op| match op {
            ReduceOp::Sum => vec![5.0f32, 3.0, -3.0, 16.0],
            ReduceOp::Prod => vec![4.0, -10.0, -18.0, 64.0],
            ReduceOp::Min => vec![1.0, -2.0, -6.0, 8.0],
            ReduceOp::Max => vec![4.0, 5.0, 3.0, 8.0],
            ReduceOp::Avg => vec![2.5, 1.5, -1.5, 8.0],
        };
        for op in ReduceOp::ALL {
            let r = Reducer::new(DType::F32, op);
            let mut out = vec![0f32; 4];
            r.reduce_out(bytemuck::cast_slice_mut(&mut out), bytemuck::cast_slice(&a), bytemuck::cast_slice(&b));
            r.finalize(bytemuck::cast_slice_mut(&mut out), 2);
            assert_eq!(out, expect(op), "{op:?}");
        }
    }

    #[test]
    fn half_kernels_match_the_elementwise_definition_bit_for_bit() {
        // Values with fractional parts so that every sum and product must round.
        let a: Vec<f32> = (0..1500).map(|i| (i as f32 * 0.37).sin() * 300.0).collect();
        let b: Vec<f32> = (0..1500).map(|i| (i as f32 * 0.11).cos() * 7.3).collect();
        fn check<H: Element + std::fmt::Debug>(a: &[f32], b: &[f32], conv: fn(f32) -> H) {
            let (ha, hb): (Vec<H>, Vec<H>) = (a.iter().map(|&x| conv(x)).collect(), b.iter().map(|&x| conv(x)).collect());
            for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
                let r = Reducer::new(H::DTYPE, op);
                let mut out = vec![conv(0.0); a.len()];
                r.reduce_out(bytemuck::cast_slice_mut(&mut out), bytemuck::cast_slice(&ha), bytemuck::cast_slice(&hb));
                let mut acc = ha.clone();
                r.reduce_into(bytemuck::cast_slice_mut(&mut acc), bytemuck::cast_slice(&hb));
                let f = combine::<H>(op);
                for i in 0..a.len() {
                    let want = f(ha[i], hb[i]);
                    assert_eq!(bytemuck::bytes_of(&out[i]), bytemuck::bytes_of(&want), "{op:?} {i}");
                    assert_eq!(bytemuck::bytes_of(&acc[i]), bytemuck::bytes_of(&want), "{op:?} {i}");
                }
            }
        }
        check::<bf16>(&a, &b, bf16::from_f32);
        check::<f16>(&a, &b, f16::from_f32);
    }

    #[test]
    fn unaligned_bytes_take_the_slow_path_correctly() {
        let a: [i64; 3] = [7, -3, 1 << 40];
        let b: [i64; 3] = [1, 5, 2];
        let mut raw = [0u8; 8 * 3 + 1];
        raw[1..].copy_from_slice(bytemuck::cast_slice(&a));
        let r = Reducer::new(DType::I64, ReduceOp::Sum);
        r.reduce_into(&mut raw[1..], bytemuck::cast_slice(&b));
        let got: Vec<i64> = raw[1..].chunks_exact(8).map(bytemuck::pod_read_unaligned).collect();
        assert_eq!(got, vec![8, 2, (1 << 40) + 2]);
    }
}
