//! GELU, tanh approximation (GPT-2): `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x³)))`.

use super::float::Float;

const GELU_COEFF: f64 = 0.044715;

/// sqrt(2 / pi).
fn scale<F: Float>() -> F {
    F::from_f64((2.0 / std::f64::consts::PI).sqrt())
}

/// out (N) = gelu(inp (N)).
pub fn gelu_forward<F: Float>(out: &mut [F], inp: &[F]) {
    let (s, k, half) = (scale::<F>(), F::from_f64(GELU_COEFF), F::from_f64(0.5));
    for (o, &x) in out.iter_mut().zip(inp) {
        *o = half * x * (F::one() + (s * (x + k * x * x * x)).tanh());
    }
}

/// dinp (N) += gelu'(inp (N)) * dout (N).
pub fn gelu_backward<F: Float>(dinp: &mut [F], inp: &[F], dout: &[F]) {
    let (s, k, half) = (scale::<F>(), F::from_f64(GELU_COEFF), F::from_f64(0.5));
    let three_k = F::from_f64(3.0 * GELU_COEFF);
    for ((d, &x), &dy) in dinp.iter_mut().zip(inp).zip(dout) {
        let u = s * (x + k * x * x * x);
        let th = u.tanh();
        let sech2 = F::one() - th * th;
        let local = half * (F::one() + th) + half * x * sech2 * s * (F::one() + three_k * x * x);
        *d += local * dy;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values_and_derivative() {
        let inp = [0.0f64, 1.0, -1.0];
        let mut out = [0.0; 3];
        gelu_forward(&mut out, &inp);
        // gelu_tanh(1) = 0.8411919906082768 (PyTorch, approximate="tanh", float64).
        assert_eq!(out[0], 0.0);
        assert!((out[1] - 0.841_191_990_608_276_8).abs() < 1e-15);
        assert!((out[2] + 0.158_808_009_391_723_2).abs() < 1e-15);
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
}
