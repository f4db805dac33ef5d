// cross_entropy.cu: softmax cross-entropy over the real vocabulary of padded logit rows, f32
// (src/device/cpu/cross_entropy.rs is the reference): rows are Vp wide, only columns 0..V take part,
// the forward keeps the per-row log-sum-exp and the backward recomputes p = exp(logit - lse).
// Padded columns are never read in the forward and never written in the backward.
#include "compat.h"

// losses (N), lse (N) from logits (N, Vp) and targets (N). Grid: N blocks.
extern "C" __global__ void cross_entropy_forward_f32(float *losses, float *lse, const float *logits,
                                                     const unsigned int *targets, int v, int vp) {
    __shared__ float scratch[MT_MAX_WARPS];
    const mt_u64 row = blockIdx.x;
    const float *z = logits + row * vp;
    float mx = -mt_inf();
    for (int j = threadIdx.x; j < v; j += blockDim.x) mx = fmaxf(mx, z[j]);
    mx = mt_block_max(mx, scratch);
    float s = 0.0f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) s += expf(z[j] - mx);
    s = mt_block_sum(s, scratch);
    if (threadIdx.x == 0) {
        const float l = mx + logf(s);
        lse[row] = l;
        losses[row] = l - z[targets[row]];
    }
}

// dlogits (N, vl) += (softmax - onehot(target)) * dloss over the `real` real columns of each row
// of a vocabulary shard of ids start .. start + vl (the whole vocabulary: start 0, vl = Vp,
// real = V); a grid-stride loop over the N*real real entries. `ops_vocab::cross_entropy_backward`
// clears dlogits first, so the op overwrites it (padding 0) as the CPU arm does without reading it.
extern "C" __global__ void cross_entropy_backward_f32(float *dlogits, const float *logits,
                                                      const float *lse, const unsigned int *targets,
                                                      float dloss, mt_u64 n, mt_u64 start, int vl,
                                                      int real) {
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 k = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; k < n * real; k += stride) {
        const mt_u64 row = k / real, j = k % real;
        const mt_u64 at = row * vl + j;
        float d = dlogits[at] + expf(logits[at] - lse[row]) * dloss;
        if ((mt_u64)targets[row] == start + j) d -= dloss;
        dlogits[at] = d;
    }
}
