// reduce.cu: the element-wise combine kernels of the collectives (src/comm/dtype.rs is the
// reference): `out = a (op) b` for every dtype x {sum, prod, min, max}, and the final divide of
// `avg`. Entry points are `reduce_<op>_<dtype>(out, a, b, n)` and `avg_div_<dtype>(buf, n,
// ranks)`; `out` may alias `a` (the reduce-into form).
//
// Semantics match the CPU bit for bit: integers wrap (computed in unsigned arithmetic, which C++
// defines), bf16/f16 widen to f32, combine, and round back once; min/max keep `a` unless `b`
// compares strictly less/greater (so NaN handling follows the CPU's `if b < a { b } else { a }`);
// avg divides floats by `ranks` and truncates integers toward zero.
//
// Memory-bound: each thread handles one 16-byte vector of each operand when all three pointers
// are 16-byte aligned, and the grid strides over the buffer; a tail (or unaligned buffers) takes
// the scalar path.
#include "compat.h"

struct MtF32 { typedef float T; };
struct MtF64 { typedef double T; };
struct MtBF16 { typedef mt_bf16 T; };
struct MtF16 { typedef mt_f16 T; };
struct MtI32 { typedef int T; };
struct MtI64 { typedef mt_i64 T; };
struct MtU8 { typedef unsigned char T; };

// Value semantics per dtype: `load` widens the stored type to the compute type, `store` narrows.
template <typename D> struct MtVal;
template <> struct MtVal<MtF32> {
    typedef float C;
    static __device__ __forceinline__ C load(float x) { return x; }
    static __device__ __forceinline__ float store(C x) { return x; }
};
template <> struct MtVal<MtF64> {
    typedef double C;
    static __device__ __forceinline__ C load(double x) { return x; }
    static __device__ __forceinline__ double store(C x) { return x; }
};
template <> struct MtVal<MtBF16> {
    typedef float C;
    static __device__ __forceinline__ C load(mt_bf16 x) { return mt_bf16_to_f32(x); }
    static __device__ __forceinline__ mt_bf16 store(C x) { return mt_f32_to_bf16(x); }
};
template <> struct MtVal<MtF16> {
    typedef float C;
    static __device__ __forceinline__ C load(mt_f16 x) { return mt_f16_to_f32(x); }
    static __device__ __forceinline__ mt_f16 store(C x) { return mt_f32_to_f16(x); }
};
template <> struct MtVal<MtI32> {
    typedef unsigned int C; // wrapping arithmetic; comparisons below go through the signed type
    static __device__ __forceinline__ C load(int x) { return (C)x; }
    static __device__ __forceinline__ int store(C x) { return (int)x; }
};
template <> struct MtVal<MtI64> {
    typedef mt_u64 C;
    static __device__ __forceinline__ C load(mt_i64 x) { return (C)x; }
    static __device__ __forceinline__ mt_i64 store(C x) { return (mt_i64)x; }
};
template <> struct MtVal<MtU8> {
    typedef unsigned int C;
    static __device__ __forceinline__ C load(unsigned char x) { return x; }
    static __device__ __forceinline__ unsigned char store(C x) { return (unsigned char)x; }
};

// Ordering of stored values: floats compare as floats, integers as their signed/unsigned type.
template <typename D> __device__ __forceinline__ bool mt_less(typename D::T x, typename D::T y) {
    return MtVal<D>::load(x) < MtVal<D>::load(y);
}
template <> __device__ __forceinline__ bool mt_less<MtI32>(int x, int y) { return x < y; }
template <> __device__ __forceinline__ bool mt_less<MtI64>(mt_i64 x, mt_i64 y) { return x < y; }

struct MtSum {
    template <typename D> static __device__ __forceinline__ typename D::T apply(typename D::T a, typename D::T b) {
        return MtVal<D>::store(MtVal<D>::load(a) + MtVal<D>::load(b));
    }
};
struct MtProd {
    template <typename D> static __device__ __forceinline__ typename D::T apply(typename D::T a, typename D::T b) {
        return MtVal<D>::store(MtVal<D>::load(a) * MtVal<D>::load(b));
    }
};
struct MtMin {
    template <typename D> static __device__ __forceinline__ typename D::T apply(typename D::T a, typename D::T b) {
        return mt_less<D>(b, a) ? b : a;
    }
};
struct MtMax {
    template <typename D> static __device__ __forceinline__ typename D::T apply(typename D::T a, typename D::T b) {
        return mt_less<D>(a, b) ? b : a;
    }
};

// Elements per 16-byte vector.
template <typename D> struct MtVec { enum { N = 16 / sizeof(typename D::T) }; };

template <typename D, typename Op>
__device__ __forceinline__ void mt_reduce(typename D::T *out, const typename D::T *a,
                                          const typename D::T *b, mt_u64 n) {
    typedef typename D::T T;
    const int V = MtVec<D>::N;
    const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;
    const mt_u64 tid = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x;
    const bool aligned = (((mt_u64)out | (mt_u64)a | (mt_u64)b) & 15u) == 0;
    mt_u64 done = 0;
    if (aligned) {
        const mt_u64 vectors = n / V;
        for (mt_u64 i = tid; i < vectors; i += stride) {
            uint4 va = ((const uint4 *)a)[i], vb = ((const uint4 *)b)[i], vo;
            const T *ea = (const T *)&va, *eb = (const T *)&vb;
            T *eo = (T *)&vo;
#pragma unroll
            for (int j = 0; j < V; j++) eo[j] = Op::template apply<D>(ea[j], eb[j]);
            ((uint4 *)out)[i] = vo;
        }
        done = vectors * V;
    }
    for (mt_u64 i = done + tid; i < n; i += stride) out[i] = Op::template apply<D>(a[i], b[i]);
}

// avg: divide a finished sum by the number of ranks (floats in their compute type, integers
// truncating toward zero in their own signed/unsigned type, like Element::div_count).
template <typename D> struct MtDiv {
    static __device__ __forceinline__ typename D::T apply(typename D::T x, mt_i64 ranks) {
        typedef typename MtVal<D>::C C;
        return MtVal<D>::store(MtVal<D>::load(x) / (C)ranks);
    }
};
template <> struct MtDiv<MtI32> {
    static __device__ __forceinline__ int apply(int x, mt_i64 ranks) { return x / (int)ranks; }
};
template <> struct MtDiv<MtI64> {
    static __device__ __forceinline__ mt_i64 apply(mt_i64 x, mt_i64 ranks) { return x / ranks; }
};
template <> struct MtDiv<MtU8> {
    static __device__ __forceinline__ unsigned char apply(unsigned char x, mt_i64 ranks) {
        return (unsigned char)(x / (unsigned char)ranks);
    }
};

#define MT_REDUCE_ENTRY(op, Op, dt, D)                                                          \
    extern "C" __global__ void reduce_##op##_##dt(D::T *out, const D::T *a, const D::T *b,    \
                                                  mt_u64 n) {                                   \
        mt_reduce<D, Op>(out, a, b, n);                                                         \
    }

#define MT_REDUCE_DTYPE(dt, D)                                                                  \
    MT_REDUCE_ENTRY(sum, MtSum, dt, D)                                                          \
    MT_REDUCE_ENTRY(prod, MtProd, dt, D)                                                        \
    MT_REDUCE_ENTRY(min, MtMin, dt, D)                                                          \
    MT_REDUCE_ENTRY(max, MtMax, dt, D)                                                          \
    extern "C" __global__ void avg_div_##dt(D::T *buf, mt_u64 n, mt_i64 ranks) {               \
        const mt_u64 stride = (mt_u64)gridDim.x * blockDim.x;                                   \
        for (mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)      \
            buf[i] = MtDiv<D>::apply(buf[i], ranks);                                            \
    }

MT_REDUCE_DTYPE(f32, MtF32)
MT_REDUCE_DTYPE(f64, MtF64)
MT_REDUCE_DTYPE(bf16, MtBF16)
MT_REDUCE_DTYPE(f16, MtF16)
MT_REDUCE_DTYPE(i32, MtI32)
MT_REDUCE_DTYPE(i64, MtI64)
MT_REDUCE_DTYPE(u8, MtU8)
