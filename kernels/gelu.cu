// gelu.cu: GELU, tanh approximation, forward and backward, f32 (src/device/cpu/gelu.rs is the
// reference): 0.5 (1 + tanh(u)) is evaluated as sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3),
// which needs one exp and saturates without NaN (exp overflows to inf, the sigmoid to 0).
// Element-wise; grid-stride loops.
#include "compat.h"

#define MT_GELU_S 0.7978845608028654f // sqrt(2/pi)
#define MT_GELU_K 0.044715f
#define MT_GELU_3K 0.134145f // 3 * 0.044715, rounded once like the CPU constant

__device__ __forceinline__ float mt_gelu_gate(float x) {
    const float two_u = 2.0f * MT_GELU_S * (x + MT_GELU_K * x * x * x);
    return 1.0f / (1.0f + expf(-two_u));
}

// out (N) = gelu(inp (N)).
extern "C" __global__ void gelu_forward_f32(float *out, const float *inp, mt_u64 n) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float x = inp[i];
        out[i] = x * mt_gelu_gate(x);
    }
}

// dinp (N) += gelu'(inp) * dout, with g = sigmoid(2u): g' = 2 g (1 - g) u'.
extern "C" __global__ void gelu_backward_f32(float *dinp, const float *inp, const float *dout,
                                             mt_u64 n) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float x = inp[i];
        const float g = mt_gelu_gate(x);
        const float local = g + x * 2.0f * g * (1.0f - g) * MT_GELU_S * (1.0f + MT_GELU_3K * x * x);
        dinp[i] += local * dout[i];
    }
}
