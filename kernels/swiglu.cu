// swiglu.cu: SwiGLU, Llama's MLP activation, forward and backward, f32
// (src/device/cpu/swiglu.rs is the reference): inp rows hold [gate (F) | up (F)],
// out = silu(gate) * up with silu(x) = x * sigmoid(x), sigmoid(x) = 1 / (1 + exp(-x)), which
// saturates without NaN. The backward OVERWRITES dinp (both halves). Element-wise over the
// N*F outputs; grid-stride loops.
#include "compat.h"

__device__ __forceinline__ float mt_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// out (N, F) = silu(gate) * up; n = N*F.
extern "C" __global__ void swiglu_forward_f32(float *out, const float *inp, mt_u64 f, mt_u64 n) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const mt_u64 at = (i / f) * 2 * f + i % f; // the gate; the up value is f further
        const float g = inp[at];
        out[i] = g * mt_sigmoid(g) * inp[at + f];
    }
}

// dinp (N, 2F) = [dout * up * silu'(gate) | dout * silu(gate)], silu'(g) = s (1 + g (1 - s)),
// s = sigmoid(g); n = N*F.
extern "C" __global__ void swiglu_backward_f32(float *dinp, const float *dout, const float *inp,
                                               mt_u64 f, mt_u64 n) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const mt_u64 at = (i / f) * 2 * f + i % f;
        const float g = inp[at], u = inp[at + f], dy = dout[i];
        const float s = mt_sigmoid(g);
        dinp[at + f] = dy * (g * s);
        dinp[at] = dy * u * (s * (1.0f + g * (1.0f - s)));
    }
}
