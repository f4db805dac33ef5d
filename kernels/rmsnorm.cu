// rmsnorm.cu: RMSNorm forward/backward over rows of C channels with a learned weight (Llama), f32
// (src/device/cpu/rmsnorm.rs is the reference): rstd = 1/sqrt(mean(x^2) + eps), out = (x * rstd)
// * weight, the order of Hugging Face's LlamaRMSNorm.
//
// Forward and the input gradient run one block per row; the weight gradient is LayerNorm's
// column-sum kernel (layernorm.cu), which adds the row lanes in a fixed order (compat.h), so there
// are no atomics and every result is deterministic run to run.
#include "compat.h"

// out (N, C) = inp * rstd * weight; rstd (N). Grid: N blocks.
extern "C" __global__ void rmsnorm_forward_f32(float *out, float *rstd, const float *inp,
                                               const float *weight, int c, float eps) {
    __shared__ float scratch[MT_MAX_WARPS];
    const mt_u64 row = blockIdx.x;
    const float *x = inp + row * c;
    float s = 0.0f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) s += x[i] * x[i];
    const float r = 1.0f / sqrtf(mt_block_sum(s, scratch) / (float)c + eps);
    float *o = out + row * c;
    for (int i = threadIdx.x; i < c; i += blockDim.x) o[i] = x[i] * r * weight[i];
    if (threadIdx.x == 0) rstd[row] = r;
}

// dinp (N, C) += rstd * (dnorm - xhat * mean(dnorm * xhat)), dnorm = dout * weight,
// xhat = inp * rstd. Grid: N blocks.
extern "C" __global__ void rmsnorm_backward_dinp_f32(float *dinp, const float *dout, const float *inp,
                                                     const float *weight, const float *rstd, int c) {
    __shared__ float scratch[MT_MAX_WARPS];
    const mt_u64 row = blockIdx.x;
    const float r = rstd[row];
    const float *x = inp + row * c, *dy = dout + row * c;
    float m = 0.0f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) m += dy[i] * weight[i] * (x[i] * r);
    m = mt_block_sum(m, scratch) / (float)c;
    float *dx = dinp + row * c;
    for (int i = threadIdx.x; i < c; i += blockDim.x) dx[i] += r * (dy[i] * weight[i] - x[i] * r * m);
}

// The weight gradient is layernorm.cu's norm_backward_dparams_f32 with no mean and no bias.
