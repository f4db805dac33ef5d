// cast.cu: f32 <-> bf16 and f32 <-> IEEE half conversions (mixed precision: 16-bit copies of f32
// master weights and of the activations a matrix product reads). Rounding is to nearest even,
// bit-identical to half::bf16::from_f32 / half::f16::from_f32; f32 values beyond fp16's range
// become infinities (what the hardware conversions do, and what dynamic loss scaling detects).
#include "compat.h"

// The grid-stride loop every kernel below runs: out[i] = Conv::apply(inp[i]) for i < n.
template <typename Conv, typename Out, typename In>
__device__ __forceinline__ void mt_convert(Out *out, const In *inp, mt_u64 n) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = Conv::apply(inp[i]);
}

// The element conversions (bf16 and f16 are both 16-bit patterns, so the functor, not the element
// type, picks the format).
struct MtToBf16 { static __device__ __forceinline__ mt_bf16 apply(float x) { return mt_f32_to_bf16(x); } };
struct MtFromBf16 { static __device__ __forceinline__ float apply(mt_bf16 x) { return mt_bf16_to_f32(x); } };
struct MtToF16 { static __device__ __forceinline__ mt_f16 apply(float x) { return mt_f32_to_f16(x); } };
struct MtFromF16 { static __device__ __forceinline__ float apply(mt_f16 x) { return mt_f16_to_f32(x); } };
struct MtSame { static __device__ __forceinline__ float apply(float x) { return x; } };

// out (N) bf16 = inp (N) f32.
extern "C" __global__ void cast_f32_to_bf16(mt_bf16 *out, const float *inp, mt_u64 n) {
    mt_convert<MtToBf16>(out, inp, n);
}

// out (N) f32 = inp (N) bf16 (exact).
extern "C" __global__ void cast_bf16_to_f32(float *out, const mt_bf16 *inp, mt_u64 n) {
    mt_convert<MtFromBf16>(out, inp, n);
}

// out (N) f16 = inp (N) f32.
extern "C" __global__ void cast_f32_to_f16(mt_f16 *out, const float *inp, mt_u64 n) {
    mt_convert<MtToF16>(out, inp, n);
}

// out (N) f32 = inp (N) f16 (exact).
extern "C" __global__ void cast_f16_to_f32(float *out, const mt_f16 *inp, mt_u64 n) {
    mt_convert<MtFromF16>(out, inp, n);
}

// out (N) f32 = inp (N) f32 (a copy between parts of buffers, e.g. a tensor into a flat buffer).
extern "C" __global__ void copy_f32(float *out, const float *inp, mt_u64 n) {
    mt_convert<MtSame>(out, inp, n);
}
