// encoder.cu: token + position embedding, f32 (src/device/cpu/encoder.rs).
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

// dwpe (maxT, C) += dout (rows, C) summed over the rows at each position, the rows being global
// rows row0.. of the (B*T) batch (all of them, or a sequence-parallel rank's block); one thread
// per (t, c) element of positions 0..t, summing its rows in order (deterministic).
extern "C" __global__ void encoder_backward_wpe_f32(float *dwpe, const float *dout, mt_u64 rows, mt_u64 row0,
                                                    int t, int c) {
    const mt_u64 n = (mt_u64)t * c, stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const mt_u64 pos = i / c, col = i % c;
        float acc = 0.0f;
        for (mt_u64 r = (pos + t - row0 % t) % t; r < rows; r += t) acc += dout[r * c + col];
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
