// linear.cu: the bias parts of a fully connected layer (src/model/linear.rs); the matrix
// products go to cuBLAS / hipBLAS (src/device/gemm.rs).
#include "compat.h"

// out (N, OC) += bias (OC) on every row.
extern "C" __global__ void bias_add_f32(float *out, const float *bias, mt_u64 n, int oc) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] += bias[i % oc];
}

// dbias (OC) += column sums of dout (N, OC): one thread per column, rows summed in order
// (neighbouring threads read neighbouring columns, so each row is read coalesced).
extern "C" __global__ void bias_backward_f32(float *dbias, const float *dout, int n, int oc) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= oc) return;
    float acc = 0.0f;
    for (int r = 0; r < n; r++) acc += dout[(mt_u64)r * oc + col];
    dbias[col] += acc;
}

// out (N) = 0.
extern "C" __global__ void fill_zero_f32(float *out, mt_u64 n) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = 0.0f;
}
