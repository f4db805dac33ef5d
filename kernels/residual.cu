// residual.cu: the residual connection out = skip + branch, f32 (src/device/cpu/residual.rs).
#include "compat.h"

// out (N) = skip (N) + branch (N).
extern "C" __global__ void residual_forward_f32(float *out, const float *skip, const float *branch,
                                                mt_u64 n) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = skip[i] + branch[i];
}
