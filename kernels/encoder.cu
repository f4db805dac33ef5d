// encoder.cu: token + position embedding, f32 (src/model/encoder.rs).
#include "compat.h"

// out (B*T, C) = wte (Vp, C)[tokens[i]] + wpe (maxT, C)[i % t], one thread per element.
extern "C" __global__ void encoder_forward_f32(float *out, const unsigned int *tokens, const float *wte,
                                               const float *wpe, mt_u64 n, int t, int c) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const mt_u64 row = i / c, col = i % c;
        const mt_u64 tok = tokens[row], pos = row % t;
        out[i] = wte[tok * c + col] + wpe[pos * c + col];
    }
}

// dwpe (maxT, C) += sum over the batch of dout (B*T, C); one thread per (t, c) element of
// positions 0..t, summing the B rows in order (deterministic).
extern "C" __global__ void encoder_backward_wpe_f32(float *dwpe, const float *dout, int b, int t,
                                                    int c) {
    const mt_u64 n = (mt_u64)t * c, stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float acc = 0.0f;
        for (int bi = 0; bi < b; bi++) acc += dout[(mt_u64)bi * n + i];
        dwpe[i] += acc;
    }
}

// dwte (Vp, C) += dout (B*T, C) scattered to the rows of tokens (B*T). Rows repeat when a token
// repeats, so the adds are atomic: the sum is exact up to the order of f32 additions.
extern "C" __global__ void encoder_backward_wte_f32(float *dwte, const float *dout,
                                                    const unsigned int *tokens, mt_u64 n, int c) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const mt_u64 row = i / c, col = i % c;
        atomicAdd(&dwte[(mt_u64)tokens[row] * c + col], dout[i]);
    }
}
