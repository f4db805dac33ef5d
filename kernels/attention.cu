// attention.cu: the non-GEMM parts of causal multi-head self-attention, f32
// (src/device/ops_attention.rs runs the whole; src/device/cpu/attention.rs is the reference).
//
// Layouts: qkv (B, T, 3*NH*hs) rows hold [q | k | v], head h at columns h*hs..(h+1)*hs of each
// part; the products run on per-head views (parts, B, NH, T, hs) made by the split/merge
// kernels below, so that each head's matrix is contiguous and one strided-batched GEMM covers
// all B*NH heads. att (B, NH, T, T) keeps the softmax probabilities, zero above the diagonal.
//
// Softmax kernels run one block per row (B*NH*T rows of T); each thread handles columns
// threadIdx.x, threadIdx.x + blockDim.x, ... in every loop, so it rewrites only entries it read
// itself and no barrier is needed between the loops beyond the block reductions.
#include "compat.h"

// dst (parts, B, NH, T, hs) = src (B, T, parts*NH*hs) regrouped by head. Grid-stride over the
// n = parts*B*NH*T*hs elements of dst.
extern "C" __global__ void attention_split_heads_f32(float *dst, const float *src, int b, int t,
                                                     int parts, int nh, int hs, mt_u64 n) {
    for (mt_u64 i = blockIdx.x * (mt_u64)blockDim.x + threadIdx.x; i < n;
         i += (mt_u64)gridDim.x * blockDim.x) {
        mt_u64 r = i / hs;
        const int x = (int)(i % hs), ti = (int)(r % t);
        r /= t;
        const int h = (int)(r % nh);
        r /= nh;
        const int bi = (int)(r % b), p = (int)(r / b);
        dst[i] = src[(((mt_u64)bi * t + ti) * parts + p) * nh * hs + (mt_u64)h * hs + x];
    }
}

// dst (B, T, parts*NH*hs) = src (parts, B, NH, T, hs) back in row layout (`accumulate`: +=).
// Grid-stride over the n = B*T*parts*NH*hs elements of dst.
extern "C" __global__ void attention_merge_heads_f32(float *dst, const float *src, int b, int t,
                                                     int parts, int nh, int hs, int accumulate,
                                                     mt_u64 n) {
    for (mt_u64 i = blockIdx.x * (mt_u64)blockDim.x + threadIdx.x; i < n;
         i += (mt_u64)gridDim.x * blockDim.x) {
        mt_u64 r = i / hs;
        const int x = (int)(i % hs), h = (int)(r % nh);
        r /= nh;
        const int p = (int)(r % parts);
        r /= parts;
        const int ti = (int)(r % t), bi = (int)(r / t);
        const float v = src[((((mt_u64)p * b + bi) * nh + h) * t + ti) * hs + x];
        dst[i] = accumulate ? dst[i] + v : v;
    }
}

// att (rows, T) in place: on entry the raw scores q.k, on exit the causal softmax of
// scale * scores over columns j <= i (i = row % T, the query position), 0 for j > i (entries
// above the diagonal are never read). Grid: one block per row.
extern "C" __global__ void attention_softmax_forward_f32(float *att, int t, float scale) {
    __shared__ float scratch[MT_MAX_WARPS];
    const int ti = blockIdx.x % t;
    float *row = att + (mt_u64)blockIdx.x * t; // (T)
    float mx = -mt_inf();
    for (int j = threadIdx.x; j <= ti; j += blockDim.x) mx = fmaxf(mx, row[j] * scale);
    mx = mt_block_max(mx, scratch);
    float sum = 0.0f;
    for (int j = threadIdx.x; j <= ti; j += blockDim.x) {
        const float e = expf(row[j] * scale - mx);
        row[j] = e;
        sum += e;
    }
    const float inv = 1.0f / mt_block_sum(sum, scratch);
    for (int j = threadIdx.x; j < t; j += blockDim.x) row[j] = j <= ti ? row[j] * inv : 0.0f;
}

// d (rows, T) in place: on entry datt = d(loss)/d(att), on exit d(loss)/d(scores) =
// scale * att * (datt - sum_{j<=i} att_j datt_j) for j <= i, 0 above the diagonal (datt there is
// never read). Grid: one block per row.
extern "C" __global__ void attention_softmax_backward_f32(float *d, const float *att, int t,
                                                          float scale) {
    __shared__ float scratch[MT_MAX_WARPS];
    const int ti = blockIdx.x % t;
    float *row = d + (mt_u64)blockIdx.x * t;             // (T)
    const float *a = att + (mt_u64)blockIdx.x * t;       // (T)
    float dot = 0.0f;
    for (int j = threadIdx.x; j <= ti; j += blockDim.x) dot += a[j] * row[j];
    dot = mt_block_sum(dot, scratch);
    for (int j = threadIdx.x; j < t; j += blockDim.x) row[j] = j <= ti ? scale * a[j] * (row[j] - dot) : 0.0f;
}
