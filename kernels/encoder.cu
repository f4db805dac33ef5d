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

// dwte (Vp, C) += dout (B*T, C) scattered to the rows of the tokens, deterministically: `index` is
// the token index the host builds (`ops::token_index`): tokens (B*T) | the rows ordered by token,
// rows of one token in increasing order (B*T) | the number of distinct tokens S (1) | where each
// token's rows start in that order (S + 1). One thread per (distinct token, column) adds that
// token's rows in increasing row order onto the gradient: the same f32 additions in the same order
// as the CPU reference, with no atomics, so every run and every arm gives the same bits.
extern "C" __global__ void encoder_backward_wte_f32(float *dwte, const float *dout,
                                                    const unsigned int *index, mt_u64 rows, int c) {
    const unsigned int *order = index + rows, *starts = index + 2 * rows + 1;
    const mt_u64 n = (mt_u64)index[2 * rows] * c, stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const mt_u64 seg = i / c, col = i % c;
        const unsigned int s0 = starts[seg], s1 = starts[seg + 1];
        float *g = &dwte[(mt_u64)index[order[s0]] * c + col];
        float acc = *g;
        for (unsigned int k = s0; k < s1; k++) acc += dout[(mt_u64)order[k] * c + col];
        *g = acc;
    }
}
