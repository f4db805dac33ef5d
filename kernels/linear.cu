// linear.cu: the bias parts of a fully connected layer (src/device/cpu/linear.rs); the matrix
// products go to cuBLAS / hipBLAS (src/device/gemm.rs).
#include "compat.h"

// out (N, OC) += bias (OC) on every row.
extern "C" __global__ void bias_add_f32(float *out, const float *bias, mt_u64 n, int oc) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] += bias[i % oc];
}

// dbias (OC) += column sums of dout (N, OC), tiled as compat.h describes (each row of a tile is
// read coalesced). Grid: ceil(OC / MT_COL_TILE) blocks of (MT_COL_TILE, MT_ROW_LANES) threads.
extern "C" __global__ void __launch_bounds__(MT_COL_TILE * MT_ROW_LANES) bias_backward_f32(float *dbias, const float *dout,
                                                                                          int n, int oc) {
    __shared__ float part[MT_ROW_LANES][MT_COL_TILE + 1];
    const int col = blockIdx.x * MT_COL_TILE + threadIdx.x;
    float acc = 0.0f;
    if (col < oc)
        for (int r = threadIdx.y; r < n; r += MT_ROW_LANES) acc += dout[(mt_u64)r * oc + col];
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && col < oc) {
        float sum = 0.0f;
        for (int y = 0; y < MT_ROW_LANES; y++) sum += part[y][threadIdx.x];
        dbias[col] += sum;
    }
}

// out (N) = 0.
extern "C" __global__ void fill_zero_f32(float *out, mt_u64 n) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = 0.0f;
}
