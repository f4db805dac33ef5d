// adamw.cu: one AdamW update over a contiguous span with one weight-decay value, f32
// (src/device/cpu/adamw.rs is the reference; the host computes the per-step coefficients in f64 and
// rounds them to f32 exactly as the CPU path does, and launches once per decay-mask segment).
#include "compat.h"

// p, m, v (N) updated in place from g (N), read only and multiplied by gs (the clipping scale):
// g = gs g; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr (m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + wd p).
extern "C" __global__ void adamw_f32(float *p, const float *g, float *m, float *v, mt_u64 n,
                                     float b1, float b2, float one_b1, float one_b2,
                                     float inv_bc1, float inv_bc2, float lr, float eps, float wd,
                                     float gs) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float gi = g[i] * gs;
        const float mi = b1 * m[i] + one_b1 * gi;
        const float vi = b2 * v[i] + one_b2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        const float m_hat = mi * inv_bc1, v_hat = vi * inv_bc2;
        p[i] -= lr * (m_hat / (sqrtf(v_hat) + eps) + wd * p[i]);
    }
}

// Gradient clipping: partials[block] = sum of g^2 over the elements a block's threads visit
// (grid-stride over N); the host adds the partials in f64, so the total does not depend on how
// large N is. Launched with at most MT_SUM_BLOCKS blocks.
extern "C" __global__ void sum_squares_f32(float *partials, const float *g, mt_u64 n) {
    __shared__ float scratch[MT_MAX_WARPS];
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    float acc = 0.0f;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        acc += g[i] * g[i];
    acc = mt_block_sum(acc, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// flag[0] = 1 if any of x (N) is NaN or infinite (all exponent bits set); else flag is left
// as it is, so one flag can collect several buffers. Racing writers all write 1.
extern "C" __global__ void nonfinite_mark_f32(const float *x, mt_u64 n, unsigned int *flag) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    bool bad = false;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        bad |= (__float_as_uint(x[i]) & 0x7f800000u) == 0x7f800000u;
    if (bad) flag[0] = 1u;
}

// g (N) *= s.
extern "C" __global__ void scale_f32(float *g, float s, mt_u64 n) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) g[i] *= s;
}
