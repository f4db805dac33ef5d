//! A branch-free `f32` exp the compiler vectorises, and the softmax reductions built on it.
//!
//! Why: the cross-entropy softmax (a 50304-wide vocabulary row per token, forward and backward),
//! attention's softmax and GELU's sigmoid call `exp` per element; libm's scalar `expf` keeps
//! those loops scalar. [`exp_f32`] is plain arithmetic on `f32` and its bits (no branches, no
//! table, no `unsafe`), so a slice loop that calls it compiles to SIMD code.
//!
//! Method: `e^x = 2^n · e^r` with `n = round(x / ln 2)` (rounded by adding 1.5·2²³, which also
//! leaves `n` in the low mantissa bits) and `r = x - n·ln 2` in two parts (`n·LN2_HI` is exact),
//! `|r| <= ln 2 / 2`; `e^r = 1 + r + r²·q(r)` with `q` of degree 4 fitted for least relative error
//! on Chebyshev nodes of that interval (polynomial error 0.07 ulp); `2^n` is built from exponent
//! bits in two halves so that every `n` from -150 to 128 is representable on the way, which makes
//! overflow give `inf` and underflow give subnormals and then 0 without a branch.
//!
//! Invariants: at most 2 ulp from the correctly rounded result on [-87, 88.7] (the test measures
//! the maximum against f64 `exp`; it is about 1 ulp); `exp(0) = 1` exactly; `inf` above
//! ln(f32::MAX), 0 below -104 and for `-inf`, NaN for NaN. `f64` keeps libm's `exp` (the gradient
//! checks want its accuracy), so [`Float::fast_exp`] is `exp_f32` only for `f32`. The reductions
//! here sum in a fixed order that does not depend on the thread count.

use super::float::Float;
use super::simd;

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 rounded to 9 significant bits, so that `n · LN2_HI` is exact for |n| <= 2¹⁵.
const LN2_HI: f32 = 0.693_359_4;
/// ln 2 - LN2_HI.
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 · 2²³: `y + ROUND` rounds y to an integer held in the low mantissa bits.
const ROUND: f32 = 12_582_912.0;
/// Inputs are clamped to [LO, HI] (NaN passes): exp(LO) rounds to 0, exp(HI) overflows to inf.
const LO: f32 = -104.0;
const HI: f32 = 89.0;
/// q(r) = Q[0] + Q[1] r + ... + Q[4] r⁴ with e^r ≈ 1 + r + r² q(r) on |r| <= ln 2 / 2.
const Q: [f32; 5] = [
    0.499_999_88,
    0.166_665_18,
    0.041_669_533,
    0.008_368_916,
    0.001_375_140_7,
];

/// e^x in `f32`, branch-free (see the module header for its accuracy and special values).
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    // Comparisons are false for NaN, so NaN passes the clamp and propagates.
    let x = if x < LO { LO } else { x };
    let x = if x > HI { HI } else { x };
    let t = x * LOG2E + ROUND;
    let n_f = t - ROUND;
    let n = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = (x - n_f * LN2_HI) - n_f * LN2_LO;
    let q = Q[0] + r * (Q[1] + r * (Q[2] + r * (Q[3] + r * Q[4])));
    let p = 1.0 + (r + r * r * q);
    let half = n >> 1;
    let scale1 = f32::from_bits((half.wrapping_add(127) as u32) << 23);
    let scale2 = f32::from_bits((n.wrapping_sub(half).wrapping_add(127) as u32) << 23);
    p * scale1 * scale2
}

/// Independent partial sums and maxima in the reductions below: breaks the serial dependency so
/// the loops vectorise; the combination order is fixed.
const LANES: usize = 8;
/// Elements exponentiated into a stack buffer before they are summed.
const CHUNK: usize = 256;

/// The maximum of `z` (-inf when empty): order-free, so the same bits as a serial fold.
pub fn max_of<F: Float>(z: &[F]) -> F {
    simd::widest(#[inline(always)] || max_of_body(z))
}

#[inline(always)]
fn max_of_body<F: Float>(z: &[F]) -> F {
    let mut acc = [F::neg_infinity(); LANES];
    let lanes = z.chunks_exact(LANES);
    let tail = lanes
        .remainder()
        .iter()
        .copied()
        .fold(F::neg_infinity(), F::max);
    for chunk in lanes {
        for (a, &v) in acc.iter_mut().zip(chunk) {
            *a = a.max(v);
        }
    }
    acc.iter().copied().fold(tail, F::max)
}

/// Σ exp(z - shift): exponentials in slices of `CHUNK` (vectorised), summed over `LANES` partial
/// sums in a fixed order.
pub fn sum_exp<F: Float>(z: &[F], shift: F) -> F {
    simd::widest(#[inline(always)] || sum_exp_body(z, shift))
}

#[inline(always)]
fn sum_exp_body<F: Float>(z: &[F], shift: F) -> F {
    let mut acc = [F::zero(); LANES];
    let mut buf = [F::zero(); CHUNK];
    let mut tail = F::zero();
    for part in z.chunks(CHUNK) {
        let e = &mut buf[..part.len()];
        e.iter_mut()
            .zip(part)
            .for_each(|(e, &v)| *e = (v - shift).fast_exp());
        let lanes = e.chunks_exact(LANES);
        tail += lanes
            .remainder()
            .iter()
            .copied()
            .fold(F::zero(), |s, v| s + v);
        for chunk in lanes {
            for (a, &v) in acc.iter_mut().zip(chunk) {
                *a += v;
            }
        }
    }
    acc.iter().copied().fold(F::zero(), |s, v| s + v) + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between `got` and the f32 nearest to `want`.
    fn ulps(got: f32, want: f64) -> f64 {
        let w = want as f32;
        let ulp = (f32::from_bits(w.to_bits() + 1) - w) as f64;
        (got as f64 - want).abs() / ulp
    }

    /// Every 97th f32 of [-87, -1e-30] and [1e-30, 88.7], and a grid of [-1, 1]: within 2 ulp.
    #[test]
    fn within_two_ulp_of_f64_exp() {
        let mut worst = (0.0, 0f32);
        let mut check = |x: f32| {
            let e = ulps(exp_f32(x), (x as f64).exp());
            if e > worst.0 {
                worst = (e, x);
            }
        };
        // Negative side towards -1e-30 (magnitudes fall as the bits fall), then 1e-30 upwards.
        let mut x = -87.0f32;
        while x < -1e-30 {
            check(x);
            x = f32::from_bits(x.to_bits() - 97);
        }
        let mut x = 1e-30f32;
        while x < 88.7 {
            check(x);
            x = f32::from_bits(x.to_bits() + 97);
        }
        for i in -100_000..=100_000 {
            check(i as f32 * 1e-5);
        }
        println!("exp_f32: max error {:.3} ulp at x = {}", worst.0, worst.1);
        assert!(
            worst.0 <= 2.0,
            "max error {} ulp at x = {}",
            worst.0,
            worst.1
        );
    }

    #[test]
    fn special_values() {
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-0.0), 1.0);
        assert_eq!(exp_f32(89.0), f32::INFINITY);
        assert_eq!(exp_f32(1e30), f32::INFINITY);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(-104.0), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        // Largest finite result and the subnormal range.
        assert!(exp_f32(88.72).is_finite() && exp_f32(88.72) > 3.3e38);
        let sub = exp_f32(-95.0);
        assert!(
            sub > 0.0 && ((sub as f64) / (-95f64).exp() - 1.0).abs() < 1e-3,
            "{sub}"
        );
    }

    #[test]
    fn reductions_match_serial_definitions() {
        let z: Vec<f32> = (0..1000)
            .map(|i| ((i * 37) % 101) as f32 * 0.05 - 2.0)
            .collect();
        for len in [0, 1, 7, 8, 255, 256, 257, 1000] {
            let z = &z[..len];
            assert_eq!(
                max_of(z),
                z.iter().copied().fold(f32::NEG_INFINITY, f32::max)
            );
            let want: f64 = z.iter().map(|&v| ((v - 1.0) as f64).exp()).sum();
            let got = sum_exp(z, 1.0) as f64;
            assert!(
                (got - want).abs() <= 1e-6 * want.max(1.0),
                "{len}: {got} vs {want}"
            );
        }
        assert_eq!(sum_exp::<f64>(&[0.0; 4], 0.0), 4.0);
    }
}
