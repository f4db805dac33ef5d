// layernorm.cu: LayerNorm forward/backward over rows of C channels, eps = 1e-5, f32
// (src/device/cpu/layernorm.rs is the reference; same two-pass mean/variance, same saved mean/rstd).
//
// Forward and the input gradient run one block per row; the parameter gradients sum columns in
// tiles with the row lanes added in a fixed order (compat.h), so there are no atomics and every
// result is deterministic run to run.
#include "compat.h"

#define MT_LN_EPS 1e-5f

// out (N, C) = (inp - mean) * rstd * weight + bias; mean, rstd (N). Grid: N blocks.
extern "C" __global__ void layernorm_forward_f32(float *out, float *mean, float *rstd,
                                                 const float *inp, const float *weight,
                                                 const float *bias, int c) {
    __shared__ float scratch[MT_MAX_WARPS];
    const mt_u64 row = blockIdx.x;
    const float *x = inp + row * c;
    float s = 0.0f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) s += x[i];
    const float mu = mt_block_sum(s, scratch) / (float)c;
    float v = 0.0f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) v += (x[i] - mu) * (x[i] - mu);
    const float var = mt_block_sum(v, scratch) / (float)c;
    const float r = 1.0f / sqrtf(var + MT_LN_EPS);
    float *o = out + row * c;
    for (int i = threadIdx.x; i < c; i += blockDim.x) o[i] = (x[i] - mu) * r * weight[i] + bias[i];
    if (threadIdx.x == 0) {
        mean[row] = mu;
        rstd[row] = r;
    }
}

// dinp (N, C) += rstd * (dnorm - mean(dnorm) - xhat * mean(dnorm * xhat)), dnorm = dout * weight.
// Grid: N blocks.
extern "C" __global__ void layernorm_backward_dinp_f32(float *dinp, const float *dout,
                                                      const float *inp, const float *weight,
                                                      const float *mean, const float *rstd, int c) {
    __shared__ float scratch[MT_MAX_WARPS];
    const mt_u64 row = blockIdx.x;
    const float mu = mean[row], r = rstd[row];
    const float *x = inp + row * c, *dy = dout + row * c;
    float dn = 0.0f, dnx = 0.0f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        const float dnorm = dy[i] * weight[i];
        dn += dnorm;
        dnx += dnorm * (x[i] - mu) * r;
    }
    const float dnorm_mean = mt_block_sum(dn, scratch) / (float)c;
    const float dnorm_xhat_mean = mt_block_sum(dnx, scratch) / (float)c;
    float *dx = dinp + row * c;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        const float xhat = (x[i] - mu) * r;
        dx[i] += r * (dy[i] * weight[i] - dnorm_mean - xhat * dnorm_xhat_mean);
    }
}

// The parameter gradients of both norm layers (RMSNorm's too, kernels/rmsnorm.cu):
// dweight (C) += sum_rows xhat * dout with xhat = (inp - mean) * rstd, and dbias (C) += sum_rows
// dout. RMSNorm passes null `mean` and `dbias`: xhat = (inp - 0) * rstd, the bits of inp * rstd
// (subtracting +0 changes no float), and no bias. Tiled as compat.h describes (each row of a tile
// is read coalesced). Grid: ceil(C / MT_COL_TILE) blocks of (MT_COL_TILE, MT_ROW_LANES) threads.
extern "C" __global__ void __launch_bounds__(MT_COL_TILE * MT_ROW_LANES) norm_backward_dparams_f32(
    float *dweight, float *dbias, const float *dout, const float *inp, const float *mean, const float *rstd, int n,
    int c) {
    __shared__ float part_w[MT_ROW_LANES][MT_COL_TILE + 1];
    __shared__ float part_b[MT_ROW_LANES][MT_COL_TILE + 1];
    const int i = blockIdx.x * MT_COL_TILE + threadIdx.x;
    float dw = 0.0f, db = 0.0f;
    if (i < c) {
        for (int row = threadIdx.y; row < n; row += MT_ROW_LANES) {
            const mt_u64 at = (mt_u64)row * c + i;
            const float dyi = dout[at];
            const float mu = mean ? mean[row] : 0.0f;
            db += dyi;
            dw += (inp[at] - mu) * rstd[row] * dyi;
        }
    }
    part_w[threadIdx.y][threadIdx.x] = dw;
    part_b[threadIdx.y][threadIdx.x] = db;
    __syncthreads();
    if (threadIdx.y == 0 && i < c) {
        float sw = 0.0f, sb = 0.0f;
        for (int y = 0; y < MT_ROW_LANES; y++) {
            sw += part_w[y][threadIdx.x];
            sb += part_b[y][threadIdx.x];
        }
        dweight[i] += sw;
        if (dbias) dbias[i] += sb;
    }
}
