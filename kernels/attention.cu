// attention.cu: the non-GEMM parts of causal multi-head self-attention, f32
// (src/device/ops_attention.rs runs the whole; src/device/cpu/attention.rs is the reference).
//
// Layouts: qkv (B, T, (NH + 2*NKV)*hs) rows hold [q | k | v], head h at columns h*hs..(h+1)*hs
// of each part (NKV key/value heads; NKV == NH for multi-head attention); the products run on
// per-head views made by the split/merge kernels below, so that each head's matrix is
// contiguous and one strided-batched GEMM covers all heads (or grouped-query groups).
// att (B, NH, T, T) keeps the softmax probabilities, zero above the diagonal.
//
// Softmax kernels run one block per row (B*NH*T rows of T); each thread handles columns
// threadIdx.x, threadIdx.x + blockDim.x, ... in every loop, so it rewrites only entries it read
// itself and no barrier is needed between the loops beyond the block reductions.
#include "compat.h"

// The per-head layout: Q (B, NH, T, hs) first, then parts - 1 key/value parts (B, NKV, T, hs)
// (parts = 3 for qkv, 1 for an (B, T, NH*hs) output); the row layout (B, T, W) with
// W = (NH + (parts - 1) * NKV) * hs holds [q | k | v] per token. NKV == NH is multi-head
// attention, where this is (parts, B, NH, T, hs).

// Offset in the row layout of element i of the per-head layout.
__device__ __forceinline__ mt_u64 mt_head_index(mt_u64 i, int b, int t, int parts, int nh, int nkv,
                                                int hs) {
    const mt_u64 nq = (mt_u64)b * nh * t * hs, nk = (mt_u64)b * nkv * t * hs;
    int p = 0, heads = nh;
    mt_u64 j = i;
    if (i >= nq) {
        p = 1 + (int)((i - nq) / nk);
        j = (i - nq) % nk;
        heads = nkv;
    }
    mt_u64 r = j / hs;
    const int x = (int)(j % hs), ti = (int)(r % t);
    r /= t;
    const int h = (int)(r % heads), bi = (int)(r / heads);
    const mt_u64 col = p == 0 ? (mt_u64)h * hs : ((mt_u64)nh + (mt_u64)(p - 1) * nkv + h) * hs;
    return ((mt_u64)bi * t + ti) * (((mt_u64)nh + (mt_u64)(parts - 1) * nkv) * hs) + col + x;
}

// dst (per-head layout) = src (row layout) regrouped by head. Grid-stride over the n elements
// of dst.
extern "C" __global__ void attention_split_heads_f32(float *dst, const float *src, int b, int t,
                                                     int parts, int nh, int nkv, int hs, mt_u64 n) {
    for (mt_u64 i = blockIdx.x * (mt_u64)blockDim.x + threadIdx.x; i < n;
         i += (mt_u64)gridDim.x * blockDim.x) {
        dst[i] = src[mt_head_index(i, b, t, parts, nh, nkv, hs)];
    }
}

// dst (row layout) = src (per-head layout) (`accumulate`: +=). Grid-stride over the n elements
// of src; each dst element is written by exactly one src element.
extern "C" __global__ void attention_merge_heads_f32(float *dst, const float *src, int b, int t,
                                                     int parts, int nh, int nkv, int hs,
                                                     int accumulate, mt_u64 n) {
    for (mt_u64 i = blockIdx.x * (mt_u64)blockDim.x + threadIdx.x; i < n;
         i += (mt_u64)gridDim.x * blockDim.x) {
        const mt_u64 j = mt_head_index(i, b, t, parts, nh, nkv, hs);
        const float v = src[i];
        dst[j] = accumulate ? dst[j] + v : v;
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
