// rope.cu: rotary position embedding of the q and k heads, in place, f32
// (src/device/cpu/rope.rs is the reference). Hugging Face's half-split convention: element i of
// a head (i < hd/2) rotates with element i + hd/2 by the angle of table entry (pos, i):
// x0' = x0 cos - x1 sin, x1' = x1 cos + x0 sin; `inverse` negates the angle (the transposed
// rotation, the backward). qkv (B, T, (NH + 2*NKV)*hd) rows hold [q | k | v]: the NH + NKV
// heads of q and k rotate, v is untouched. cos, sin (T, hd/2), pos = the token's index in its
// sequence. Grid-stride over the n = B*T*(NH+NKV)*hd/2 pairs; each pair is read and written by
// one thread.
#include "compat.h"

extern "C" __global__ void rope_f32(float *qkv, const float *cos_t, const float *sin_t, int t,
                                    int nh, int nkv, int hd, int inverse, mt_u64 n) {
    const int half = hd / 2, heads = nh + nkv;
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const int p = (int)(i % half);
        const mt_u64 r = i / half;
        const int h = (int)(r % heads);
        const mt_u64 token = r / heads;
        const int pos = (int)(token % t);
        const float c = cos_t[(mt_u64)pos * half + p];
        const float s = inverse ? -sin_t[(mt_u64)pos * half + p] : sin_t[(mt_u64)pos * half + p];
        float *x = qkv + token * (mt_u64)(heads + nkv) * hd + (mt_u64)h * hd + p;
        const float x0 = x[0], x1 = x[half];
        x[0] = x0 * c - x1 * s;
        x[half] = x1 * c + x0 * s;
    }
}
