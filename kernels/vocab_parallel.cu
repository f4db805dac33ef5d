// vocab_parallel.cu: the vocabulary-parallel ends of the model over one shard of wte's rows, f32
// (src/device/cpu/vocab_parallel.rs is the reference). A shard covers ids start .. start + vl; of its
// vl logit columns only the first `real` are real ids, the rest padding (never read, never
// written). The TP sums and maxima between the kernels are the caller's collectives; the loss
// backward is cross_entropy_backward_f32 (cross_entropy.cu) with the shard's start.
#include "compat.h"

// out (N, C) = wte_shard (vl, C) row tokens[i] - start when the token is in the shard, else 0;
// one thread per element of the n = N*C outputs.
extern "C" __global__ void embedding_shard_forward_f32(float *out, const unsigned int *tokens,
                                                       const float *wte, mt_u64 n, int c,
                                                       mt_u64 start, int vl) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const mt_u64 row = i / c, col = i % c;
        const mt_u64 tok = tokens[row];
        out[i] = (tok >= start && tok - start < (mt_u64)vl) ? wte[(tok - start) * c + col] : 0.0f;
    }
}

// dwte_shard (vl, C) += rows of dout (N, C) whose tokens lie in the shard, deterministically:
// `index` is the token index of encoder_backward_wte_f32 (encoder.cu), one thread per (distinct
// token, column) adding its rows in increasing row order (the CPU reference's order, no atomics).
extern "C" __global__ void embedding_shard_backward_f32(float *dwte, const float *dout,
                                                        const unsigned int *index, mt_u64 rows,
                                                        int c, mt_u64 start, int vl) {
    const unsigned int *order = index + rows, *starts = index + 2 * rows + 1;
    const mt_u64 n = (mt_u64)index[2 * rows] * c, stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const mt_u64 seg = i / c, col = i % c;
        const unsigned int s0 = starts[seg], s1 = starts[seg + 1];
        const mt_u64 tok = index[order[s0]];
        if (tok < start || tok - start >= (mt_u64)vl) continue;
        float *g = &dwte[(tok - start) * c + col];
        float acc = *g;
        for (unsigned int k = s0; k < s1; k++) acc += dout[(mt_u64)order[k] * c + col];
        *g = acc;
    }
}

// out (N, C) += wpe (maxT, C) row ((row0 + i) % t) of each row i: the rows are global rows
// row0.. of the (B*T) batch (a sequence-parallel rank holds a block of them); one thread per
// element.
extern "C" __global__ void position_forward_f32(float *out, const float *wpe, mt_u64 n, mt_u64 row0, int t,
                                                int c) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const mt_u64 row = row0 + i / c, col = i % c;
        out[i] += wpe[(row % t) * c + col];
    }
}

// max (N) = maximum of each logits (N, vl) row over its first `real` columns (-inf if none).
// Grid: N blocks.
extern "C" __global__ void shard_max_f32(float *max, const float *logits, int vl, int real) {
    __shared__ float scratch[MT_MAX_WARPS];
    const mt_u64 row = blockIdx.x;
    const float *z = logits + row * vl;
    float mx = -mt_inf();
    for (int j = threadIdx.x; j < real; j += blockDim.x) mx = fmaxf(mx, z[j]);
    mx = mt_block_max(mx, scratch);
    if (threadIdx.x == 0) max[row] = mx;
}

// stats (2N): sum (N) = sum of exp(z - max) over the real columns, then target logit (N) = z of
// the row's target when it is in the shard, else 0. Grid: N blocks.
extern "C" __global__ void shard_sum_exp_f32(float *stats, const float *logits, const float *max,
                                             const unsigned int *targets, mt_u64 n,
                                             mt_u64 start, int vl, int real) {
    __shared__ float scratch[MT_MAX_WARPS];
    const mt_u64 row = blockIdx.x;
    const float *z = logits + row * vl;
    const float mx = max[row];
    float s = 0.0f;
    for (int j = threadIdx.x; j < real; j += blockDim.x) s += expf(z[j] - mx);
    s = mt_block_sum(s, scratch);
    if (threadIdx.x == 0) {
        const mt_u64 tok = targets[row];
        stats[row] = s;
        stats[n + row] = (tok >= start && tok - start < (mt_u64)real) ? z[tok - start] : 0.0f;
    }
}

// lse (N) = max + ln(sum), losses (N) = lse - target logit, from the group-reduced max (N) and
// stats (2N: sum, target logit); one thread per row.
extern "C" __global__ void cross_entropy_combine_f32(float *losses, float *lse, const float *max,
                                                     const float *stats, mt_u64 n) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float l = max[i] + logf(stats[i]);
        lse[i] = l;
        losses[i] = l - stats[n + i];
    }
}
