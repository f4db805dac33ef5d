//! The AdamW element update on the CPU: the hyper-parameters and the per-element expression that
//! the host optimizer ([`crate::optim::AdamW`]) and the device arms' CPU path both run. The GPU
//! kernel `adamw_f32` computes the same expression in the same order, so the CPU arm is its
//! reference. Invariant: the expression ([`update_one`]) and the per-step constants
//! ([`Coefficients`], which the GPU launch passes too) exist only here.

use super::float::Float;
use super::simd;

/// AdamW hyper-parameters (the learning rate comes from the schedule at each step).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamWConfig {
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay coefficient for elements in the decay mask.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    /// GPT-2/3 training defaults: betas (0.9, 0.95), eps 1e-8, weight decay 0.1.
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

/// The scalars of one AdamW update: hyper-parameters, step number (1-based), learning rate, and
/// the factor every gradient is multiplied by before it enters the moments (the clipping scale;
/// exactly 1 when not clipping, which changes no bit).
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep<'a> {
    /// Hyper-parameters.
    pub config: &'a AdamWConfig,
    /// Update number, from 1.
    pub step: u64,
    /// Learning rate of this step.
    pub lr: f64,
    /// Gradient multiplier (clipping), rounded once to the working precision.
    pub grad_scale: f64,
}

/// The AdamW update of aligned parameter, gradient and moment slices with weight decay `wd`
/// (the GPU kernel `adamw_f32` computes the same expression in the same order). The gradient is
/// multiplied by the clipping scale in a register, so the gradient buffer is only read.
pub fn update_elements<F: Float>(
    k: &Coefficients<F>,
    wd: F,
    p: &mut [F],
    g: &[F],
    m: &mut [F],
    v: &mut [F],
) {
    simd::widest(
        #[inline(always)]
        || {
            for (((pi, &gi), mi), vi) in p.iter_mut().zip(g).zip(m).zip(v) {
                update_one(k, wd, pi, gi, mi, vi);
            }
        },
    )
}

/// [`update_elements`], bit for bit, that also sets each gradient to zero once it is read: the
/// next backward accumulates into zeroed gradients without a pass of its own over them (the
/// update reads every gradient anyway, so the zero costs a store into a cache line already
/// loaded instead of a second sweep over the whole buffer).
pub fn update_elements_clearing<F: Float>(
    k: &Coefficients<F>,
    wd: F,
    p: &mut [F],
    g: &mut [F],
    m: &mut [F],
    v: &mut [F],
) {
    simd::widest(
        #[inline(always)]
        || {
            for (((pi, gi), mi), vi) in p.iter_mut().zip(g).zip(m).zip(v) {
                update_one(k, wd, pi, *gi, mi, vi);
                *gi = F::zero();
            }
        },
    )
}

/// One element of the update: the expression both loops above (and `adamw_f32`) compute.
#[inline(always)]
fn update_one<F: Float>(k: &Coefficients<F>, wd: F, pi: &mut F, gi: F, mi: &mut F, vi: &mut F) {
    let gi = gi * k.grad_scale;
    *mi = k.b1 * *mi + k.one_b1 * gi;
    *vi = k.b2 * *vi + k.one_b2 * gi * gi;
    let m_hat = *mi * k.inv_bc1;
    let v_hat = *vi * k.inv_bc2;
    *pi -= k.lr * (m_hat / (v_hat.sqrt() + k.eps) + wd * *pi);
}

/// Per-step constants of the update, in the working precision.
pub struct Coefficients<F> {
    b1: F,
    b2: F,
    one_b1: F,
    one_b2: F,
    /// 1 / (1 - beta1^t).
    inv_bc1: F,
    /// 1 / (1 - beta2^t).
    inv_bc2: F,
    lr: F,
    eps: F,
    grad_scale: F,
}

impl<F: Float> Coefficients<F> {
    /// The constants of `s`, computed in f64 and rounded once.
    pub fn new(s: &AdamWStep) -> Self {
        let (c, t) = (s.config, s.step as i32);
        Coefficients {
            b1: F::from_f64(c.beta1),
            b2: F::from_f64(c.beta2),
            one_b1: F::from_f64(1.0 - c.beta1),
            one_b2: F::from_f64(1.0 - c.beta2),
            inv_bc1: F::from_f64(1.0 / (1.0 - c.beta1.powi(t))),
            inv_bc2: F::from_f64(1.0 / (1.0 - c.beta2.powi(t))),
            lr: F::from_f64(s.lr),
            eps: F::from_f64(c.eps),
            grad_scale: F::from_f64(s.grad_scale),
        }
    }

    /// The constants in the order the GPU kernel `adamw_f32` takes them: beta1, beta2,
    /// 1 - beta1, 1 - beta2, 1 / (1 - beta1^t), 1 / (1 - beta2^t), lr, eps, grad_scale (the
    /// weight decay, which depends on the element, goes between eps and grad_scale).
    pub fn in_kernel_order(&self) -> [F; 9] {
        [self.b1, self.b2, self.one_b1, self.one_b2, self.inv_bc1, self.inv_bc2, self.lr, self.eps, self.grad_scale]
    }
}
