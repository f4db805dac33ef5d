// attention.cu: causal multi-head self-attention core, f32 (src/model/attention.rs is the
// reference, with the same layouts): qkv (B, T, 3*NH*hs) rows hold [q | k | v], head h at columns
// h*hs..(h+1)*hs of each part; att (B, NH, T, T) keeps the softmax probabilities, zero above the
// diagonal; out (B, T, NH*hs).
//
// These kernels are the correct, simple version: one block per (b, h, query row), scores and
// weighted sums as plain loops (no tensor cores). The backward is split so that no two blocks
// write the same element (no atomics, deterministic): first dpre = d(scaled scores) per row, then
// one block per (b, h, position p) gathers dq_p over keys t2 <= p and dk_p, dv_p over queries
// ti >= p. A flash-attention kernel (tiles in shared memory, tensor cores) is future work.
#include "compat.h"

// Grid: B*NH*T blocks, block index = (b*NH + h)*T + ti. out and att are fully written.
extern "C" __global__ void attention_forward_f32(float *out, float *att, const float *qkv, int t,
                                                 int nh, int hs) {
    __shared__ float scratch[MT_MAX_WARPS];
    const int ti = blockIdx.x % t, bh = blockIdx.x / t, h = bh % nh, b = bh / nh;
    const int c = nh * hs;
    const float scale = 1.0f / sqrtf((float)hs);
    const float *q = qkv + ((mt_u64)b * t + ti) * 3 * c + h * hs; // (hs)
    float *row = att + ((mt_u64)bh * t + ti) * t;                 // (T)
    float mx = -mt_inf();
    for (int t2 = threadIdx.x; t2 <= ti; t2 += blockDim.x) {
        const float *k = qkv + ((mt_u64)b * t + t2) * 3 * c + c + h * hs; // (hs)
        float s = 0.0f;
        for (int i = 0; i < hs; i++) s += q[i] * k[i];
        s *= scale;
        row[t2] = s;
        mx = fmaxf(mx, s);
    }
    mx = mt_block_max(mx, scratch);
    float sum = 0.0f;
    for (int t2 = threadIdx.x; t2 <= ti; t2 += blockDim.x) {
        const float e = expf(row[t2] - mx);
        row[t2] = e;
        sum += e;
    }
    const float inv = 1.0f / mt_block_sum(sum, scratch);
    for (int t2 = threadIdx.x; t2 < t; t2 += blockDim.x) row[t2] = t2 <= ti ? row[t2] * inv : 0.0f;
    __syncthreads(); // the probabilities written above are read by every thread below
    float *o = out + ((mt_u64)b * t + ti) * c + h * hs; // (hs)
    for (int i = threadIdx.x; i < hs; i += blockDim.x) {
        float acc = 0.0f;
        for (int t2 = 0; t2 <= ti; t2++) acc += row[t2] * qkv[((mt_u64)b * t + t2) * 3 * c + 2 * c + h * hs + i];
        o[i] = acc;
    }
}

// dpre (B, NH, T, T) = att * (datt - sum(att * datt)) * scale below and on the diagonal, 0 above,
// where datt[t2] = dout_ti . v_t2. Grid: B*NH*T blocks as in the forward.
extern "C" __global__ void attention_backward_dpre_f32(float *dpre, const float *dout,
                                                       const float *qkv, const float *att, int t,
                                                       int nh, int hs) {
    __shared__ float scratch[MT_MAX_WARPS];
    const int ti = blockIdx.x % t, bh = blockIdx.x / t, h = bh % nh, b = bh / nh;
    const int c = nh * hs;
    const float scale = 1.0f / sqrtf((float)hs);
    const float *dy = dout + ((mt_u64)b * t + ti) * c + h * hs; // (hs)
    const float *a = att + ((mt_u64)bh * t + ti) * t;           // (T)
    float *d = dpre + ((mt_u64)bh * t + ti) * t;                // (T)
    float dot = 0.0f;
    for (int t2 = threadIdx.x; t2 <= ti; t2 += blockDim.x) {
        const float *v = qkv + ((mt_u64)b * t + t2) * 3 * c + 2 * c + h * hs; // (hs)
        float da = 0.0f;
        for (int i = 0; i < hs; i++) da += dy[i] * v[i];
        d[t2] = da; // datt for now; each thread rewrites only its own entries below
        dot += da * a[t2];
    }
    dot = mt_block_sum(dot, scratch);
    for (int t2 = threadIdx.x; t2 < t; t2 += blockDim.x) d[t2] = t2 <= ti ? a[t2] * (d[t2] - dot) * scale : 0.0f;
}

// dqkv (B, T, 3*NH*hs) += gradients of q, k, v at position p of head h:
// dq_p += sum_{t2<=p} dpre[p][t2] k_t2; dk_p += sum_{ti>=p} dpre[ti][p] q_ti;
// dv_p += sum_{ti>=p} att[ti][p] dout_ti. Grid: B*NH*T blocks, block index = (b*NH + h)*T + p;
// each block writes only position p's slots of head h.
extern "C" __global__ void attention_backward_dqkv_f32(float *dqkv, const float *dpre,
                                                       const float *dout, const float *qkv,
                                                       const float *att, int t, int nh, int hs) {
    const int p = blockIdx.x % t, bh = blockIdx.x / t, h = bh % nh, b = bh / nh;
    const int c = nh * hs;
    const mt_u64 base = (mt_u64)b * t;
    const float *dpre_row = dpre + ((mt_u64)bh * t + p) * t; // (T), query p
    const float *dpre_col = dpre + (mt_u64)bh * t * t + p;   // column p, stride T
    const float *att_col = att + (mt_u64)bh * t * t + p;     // column p, stride T
    float *dq = dqkv + (base + p) * 3 * c + h * hs;
    for (int i = threadIdx.x; i < hs; i += blockDim.x) {
        float gq = 0.0f, gk = 0.0f, gv = 0.0f;
        for (int t2 = 0; t2 <= p; t2++) gq += dpre_row[t2] * qkv[(base + t2) * 3 * c + c + h * hs + i];
        for (int ti = p; ti < t; ti++) {
            gk += dpre_col[(mt_u64)ti * t] * qkv[(base + ti) * 3 * c + h * hs + i];
            gv += att_col[(mt_u64)ti * t] * dout[(base + ti) * c + h * hs + i];
        }
        dq[i] += gq;
        dq[c + i] += gk;
        dq[2 * c + i] += gv;
    }
}
