// cast.cu: f32 <-> bf16 and f32 <-> IEEE half conversions (mixed precision: 16-bit copies of f32
// master weights and of the activations a matrix product reads). Rounding is to nearest even,
// bit-identical to half::bf16::from_f32 / half::f16::from_f32; f32 values beyond fp16's range
// become infinities (what the hardware conversions do, and what dynamic loss scaling detects).
#include "compat.h"

// out (N) bf16 = inp (N) f32.
extern "C" __global__ void cast_f32_to_bf16(mt_bf16 *out, const float *inp, mt_u64 n) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = mt_f32_to_bf16(inp[i]);
}

// out (N) f32 = inp (N) bf16 (exact).
extern "C" __global__ void cast_bf16_to_f32(float *out, const mt_bf16 *inp, mt_u64 n) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = mt_bf16_to_f32(inp[i]);
}

// out (N) f16 = inp (N) f32.
extern "C" __global__ void cast_f32_to_f16(mt_f16 *out, const float *inp, mt_u64 n) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = mt_f32_to_f16(inp[i]);
}

// out (N) f32 = inp (N) f16 (exact).
extern "C" __global__ void cast_f16_to_f32(float *out, const mt_f16 *inp, mt_u64 n) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = mt_f16_to_f32(inp[i]);
}

// out (N) f32 = inp (N) f32 (a copy between parts of buffers, e.g. a tensor into a flat buffer).
extern "C" __global__ void copy_f32(float *out, const float *inp, mt_u64 n) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = inp[i];
}
