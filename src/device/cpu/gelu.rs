//! GELU, tanh approximation (GPT-2): `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x³)))`.
//!
//! Evaluated through the identity `0.5 (1 + tanh(u)) = sigmoid(2u)`, which needs one `exp`
//! instead of a `tanh` (about half the cost) and is exact in real arithmetic. Element-wise, so it
//! is split across cores (see `parallel.rs`).

use super::float::Float;
use super::parallel::{chunk_items, run_parts};
use super::simd;

const GELU_COEFF: f64 = 0.044715;

/// Constants of the approximation: (sqrt(2/pi), 0.044715).
fn consts<F: Float>() -> (F, F) {
    (
        F::from_f64((2.0 / std::f64::consts::PI).sqrt()),
        F::from_f64(GELU_COEFF),
    )
}

/// sigmoid(2u) = 0.5 (1 + tanh(u)) for u = sqrt(2/pi) (x + k x³).
#[inline(always)]
fn half_one_plus_tanh<F: Float>(x: F, s: F, k: F) -> F {
    let two_u = (s + s) * (x + k * x * x * x);
    F::one() / (F::one() + (-two_u).fast_exp())
}

/// out (N) = gelu(inp (N)).
pub fn gelu_forward<F: Float>(out: &mut [F], inp: &[F]) {
    let chunk = chunk_items(out.len(), 1);
    run_parts(out.chunks_mut(chunk).zip(inp.chunks(chunk)), |(o, x)| {
        gelu_forward_serial(o, x)
    });
}

fn gelu_forward_serial<F: Float>(out: &mut [F], inp: &[F]) {
    let (s, k) = consts::<F>();
    simd::widest(
        #[inline(always)]
        || {
            for (o, &x) in out.iter_mut().zip(inp) {
                *o = x * half_one_plus_tanh(x, s, k);
            }
        },
    )
}

/// dinp (N) += gelu'(inp (N)) * dout (N).
pub fn gelu_backward<F: Float>(dinp: &mut [F], inp: &[F], dout: &[F]) {
    let chunk = chunk_items(dinp.len(), 1);
    let parts = dinp
        .chunks_mut(chunk)
        .zip(inp.chunks(chunk))
        .zip(dout.chunks(chunk));
    run_parts(parts, |((d, x), dy)| gelu_backward_serial(d, x, dy));
}

fn gelu_backward_serial<F: Float>(dinp: &mut [F], inp: &[F], dout: &[F]) {
    let (s, k) = consts::<F>();
    let (two, three_k) = (F::from_f64(2.0), F::from_f64(3.0 * GELU_COEFF));
    simd::widest(
        #[inline(always)]
        || {
            for ((d, &x), &dy) in dinp.iter_mut().zip(inp).zip(dout) {
                // With g = 0.5 (1 + tanh u) = sigmoid(2u): g' = 2 g (1 - g) u', u' = s (1 + 3k x²).
                let g = half_one_plus_tanh(x, s, k);
                let local = g + x * two * g * (F::one() - g) * s * (F::one() + three_k * x * x);
                *d += local * dy;
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values_and_derivative() {
        let inp = [0.0f64, 1.0, -1.0];
        let mut out = [0.0; 3];
        gelu_forward(&mut out, &inp);
        // gelu_tanh(±1) from PyTorch, approximate="tanh", float64.
        assert_eq!(out[0], 0.0);
        assert!((out[1] - 0.841_191_990_608_276_8).abs() < 1e-15);
        assert!((out[2] + 0.158_808_009_391_723_24).abs() < 1e-15);
        let mut d = [0.0; 3];
        gelu_backward(&mut d, &inp, &[1.0; 3]);
        assert!((d[0] - 0.5).abs() < 1e-15);
        // Central difference of the forward; h = 1e-6 gives ~1e-10 accuracy in f64.
        let h = 1e-6;
        let (mut p, mut m) = ([0.0], [0.0]);
        gelu_forward(&mut p, &[1.0 + h]);
        gelu_forward(&mut m, &[1.0 - h]);
        assert!((d[1] - (p[0] - m[0]) / (2.0 * h)).abs() < 1e-8);
    }

    /// Large inputs saturate without NaN: exp overflows to inf and the sigmoid to 0.
    #[test]
    fn saturates_without_nan() {
        let inp = [-200.0f32, 200.0];
        let mut out = [0f32; 2];
        gelu_forward(&mut out, &inp);
        assert_eq!(out, [-0.0, 200.0]);
        let mut d = [0f32; 2];
        gelu_backward(&mut d, &inp, &[1.0; 2]);
        assert_eq!(d, [0.0, 1.0]);
    }

    /// A split across threads computes each element exactly as the serial kernel does.
    #[test]
    fn threaded_equals_serial_bitwise() {
        let inp: Vec<f32> = (0..200_000).map(|i| (i as f32 - 1e5) * 1e-4).collect();
        let (mut a, mut b) = (vec![0f32; inp.len()], vec![0f32; inp.len()]);
        gelu_forward(&mut a, &inp);
        gelu_forward_serial(&mut b, &inp);
        assert_eq!(a, b);
    }
}
