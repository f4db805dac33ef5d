// adamw.cu: one AdamW update over a contiguous span with one weight-decay value, f32
// (src/optim/adamw.rs is the reference; the host computes the per-step coefficients in f64 and
// rounds them to f32 exactly as the CPU path does, and launches once per decay-mask segment).
#include "compat.h"

// p, m, v (N) updated in place from g (N):
// m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr (m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + wd p).
extern "C" __global__ void adamw_f32(float *p, const float *g, float *m, float *v, mt_u64 n,
                                     float b1, float b2, float one_b1, float one_b2,
                                     float inv_bc1, float inv_bc2, float lr, float eps, float wd) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float gi = g[i];
        const float mi = b1 * m[i] + one_b1 * gi;
        const float vi = b2 * v[i] + one_b2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        const float m_hat = mi * inv_bc1, v_hat = vi * inv_bc2;
        p[i] -= lr * (m_hat / (sqrtf(v_hat) + eps) + wd * p[i]);
    }
}
