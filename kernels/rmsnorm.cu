// rmsnorm.cu: RMSNorm forward/backward over rows of C channels with a learned weight (Llama), f32
// (src/device/cpu/rmsnorm.rs is the reference): rstd = 1/sqrt(mean(x^2) + eps), out = (x * rstd)
// * weight, the order of Hugging Face's LlamaRMSNorm.
//
// Forward and the input gradient run one block per row; the weight gradient sums columns in
// tiles with the row lanes added in a fixed order (compat.h), so there are no atomics and every
// result is deterministic run to run.
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

// dweight (C) += sum_rows inp * rstd * dout, tiled as compat.h describes (each row of a tile is
// read coalesced). Grid: ceil(C / MT_COL_TILE) blocks of (MT_COL_TILE, MT_ROW_LANES) threads.
extern "C" __global__ void __launch_bounds__(MT_COL_TILE * MT_ROW_LANES) rmsnorm_backward_dweight_f32(
    float *dweight, const float *dout, const float *inp, const float *rstd, int n, int c) {
    __shared__ float part[MT_ROW_LANES][MT_COL_TILE + 1];
    const int i = blockIdx.x * MT_COL_TILE + threadIdx.x;
    float dw = 0.0f;
    if (i < c) {
        for (int row = threadIdx.y; row < n; row += MT_ROW_LANES) {
            const mt_u64 at = (mt_u64)row * c + i;
            dw += inp[at] * rstd[row] * dout[at];
        }
    }
    part[threadIdx.y][threadIdx.x] = dw;
    __syncthreads();
    if (threadIdx.y == 0 && i < c) {
        float s = 0.0f;
        for (int y = 0; y < MT_ROW_LANES; y++) s += part[y][threadIdx.x];
        dweight[i] += s;
    }
}
