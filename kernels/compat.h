// compat.h: the subset of CUDA and HIP every meshtrain kernel is written in.
//
// Each kernel file is compiled unchanged by NVRTC (CUDA, sm_90), by hipcc (HIP, gfx90a) and, for
// the `emu` device arm, by g++ as C++ against kernels/emu.h (MT_EMU defined). This header is the
// only place where they differ. Invariants the kernels rely on:
// - the warp (NVIDIA, 32 lanes) / wavefront (AMD CDNA, 64 lanes) width is MT_WARP_SIZE, a
//   compile-time constant; no kernel writes 32 or 64 or a lane mask literally;
// - shuffles go through mt_shfl_down / mt_shfl_xor, which involve every lane of the warp, so
//   every lane of a warp must call them (kernels keep whole warps converged around reductions);
// - block sizes are multiples of MT_WARP_SIZE and at most MT_MAX_BLOCK threads;
// - no CUDA or HIP library header is needed: bf16 and f16 are carried as raw 16-bit patterns
//   and converted here with round-to-nearest-even, bit-identical to the `half` crate.
#pragma once

#if defined(MT_EMU)
#include "emu.h"
#define MT_WARP_SIZE 32
#define MT_FULL_LANE_MASK 0xffffffffu
#elif defined(__HIPCC__)
#include <hip/hip_runtime.h>
#define MT_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
#define MT_WARP_SIZE 32
// Every lane of a 32-wide warp takes part in a shuffle.
#define MT_FULL_LANE_MASK 0xffffffffu
#endif

// Largest block any kernel is launched with (src/device/ops.rs launches 256 threads, the
// column-sum kernels MT_COL_TILE x MT_ROW_LANES = 1024).
#define MT_MAX_BLOCK 1024

// Column sums over the rows of an (N, C) matrix (bias and LayerNorm parameter gradients) run in
// blocks of (MT_COL_TILE, MT_ROW_LANES) threads, one block per MT_COL_TILE columns: thread (x, y)
// adds rows y, y + MT_ROW_LANES, ... of its column in order, then a column's MT_ROW_LANES partial
// sums are added in lane order, so the result does not depend on scheduling. Must match
// COL_TILE / ROW_LANES in src/device/ops.rs.
#define MT_COL_TILE 64
#define MT_ROW_LANES 16
#define MT_MAX_WARPS (MT_MAX_BLOCK / MT_WARP_SIZE)

// `T *name` pointing at the launch's dynamic shared memory (LaunchDims::shared_bytes), 16-byte
// aligned.
#if defined(MT_EMU)
#define MT_DYNAMIC_SHARED(T, name) T *name = (T *)mt_emu_dyn_shared
#else
#define MT_DYNAMIC_SHARED(T, name)                                                                 \
    extern __shared__ uint4 mt_dynamic_shared_words[];                                             \
    T *name = (T *)mt_dynamic_shared_words
#endif

typedef unsigned long long mt_u64;
typedef long long mt_i64;
typedef unsigned short mt_bf16; // bfloat16 bit pattern
typedef unsigned short mt_f16;  // IEEE binary16 bit pattern

template <typename T> __device__ __forceinline__ T mt_shfl_down(T v, int delta) {
#if defined(__HIPCC__)
    return __shfl_down(v, delta);
#else
    return __shfl_down_sync(MT_FULL_LANE_MASK, v, delta);
#endif
}

template <typename T> __device__ __forceinline__ T mt_shfl_xor(T v, int mask) {
#if defined(__HIPCC__)
    return __shfl_xor(v, mask);
#else
    return __shfl_xor_sync(MT_FULL_LANE_MASK, v, mask);
#endif
}

// ---- flags between devices (kernels/oneshot.cu) ------------------------------------------
// A 64-bit word another device (or, on emu, another process) reads through a mapping: stores and
// loads are volatile, a release store fences at system scope first, an acquire load fences after.
// mt_timer_ns is a constant-rate clock in nanoseconds (CUDA's globaltimer; HIP's wall_clock64,
// which runs at 100 MHz on CDNA2/CDNA3; the host's steady clock on emu); mt_pause backs off a
// spinning thread.
#if defined(MT_EMU)
__device__ __forceinline__ mt_u64 mt_load_volatile_u64(const mt_u64 *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
__device__ __forceinline__ mt_u64 mt_load_acquire_u64(const mt_u64 *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
__device__ __forceinline__ void mt_store_volatile_u64(mt_u64 *p, mt_u64 v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
__device__ __forceinline__ void mt_store_release_system_u64(mt_u64 *p, mt_u64 v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
__device__ __forceinline__ mt_u64 mt_timer_ns() { return mt_emu_timer_ns(); }
__device__ __forceinline__ void mt_pause() { mt_emu_pause(); }
#else
__device__ __forceinline__ mt_u64 mt_load_volatile_u64(const mt_u64 *p) { return *(const volatile mt_u64 *)p; }
__device__ __forceinline__ mt_u64 mt_load_acquire_u64(const mt_u64 *p) {
    mt_u64 v = *(const volatile mt_u64 *)p;
    __threadfence_system();
    return v;
}
__device__ __forceinline__ void mt_store_volatile_u64(mt_u64 *p, mt_u64 v) { *(volatile mt_u64 *)p = v; }
__device__ __forceinline__ void mt_store_release_system_u64(mt_u64 *p, mt_u64 v) {
    __threadfence_system();
    *(volatile mt_u64 *)p = v;
}
#if defined(__HIPCC__)
__device__ __forceinline__ mt_u64 mt_timer_ns() { return (mt_u64)wall_clock64() * 10ull; }
__device__ __forceinline__ void mt_pause() { __builtin_amdgcn_s_sleep(2); }
#else
__device__ __forceinline__ mt_u64 mt_timer_ns() {
    mt_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void mt_pause() { __nanosleep(200); }
#endif
#endif

__device__ __forceinline__ float mt_inf() { return __int_as_float(0x7f800000); }

// Sum over the warp; every lane gets the result. (The emu arm replays the same butterfly from one
// exchange of all lanes' values: bit-identical, five times fewer fiber switches.)
__device__ __forceinline__ float mt_warp_sum(float v) {
#if defined(MT_EMU)
    return mt_emu_butterfly(v, [](float a, float b) { return a + b; });
#else
    for (int off = MT_WARP_SIZE / 2; off > 0; off /= 2) v += mt_shfl_xor(v, off);
    return v;
#endif
}

__device__ __forceinline__ float mt_warp_max(float v) {
#if defined(MT_EMU)
    return mt_emu_butterfly(v, [](float a, float b) { return fmaxf(a, b); });
#else
    for (int off = MT_WARP_SIZE / 2; off > 0; off /= 2) v = fmaxf(v, mt_shfl_xor(v, off));
    return v;
#endif
}

// Sum over the block (blockDim.x a multiple of MT_WARP_SIZE); every thread gets the result.
// `scratch` holds MT_MAX_WARPS floats of shared memory; the call ends with a barrier, so the
// same scratch can be reused by the next block reduction.
__device__ __forceinline__ float mt_block_sum(float v, float *scratch) {
    const int lane = threadIdx.x % MT_WARP_SIZE, warp = threadIdx.x / MT_WARP_SIZE;
    const int warps = blockDim.x / MT_WARP_SIZE;
    v = mt_warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    v = mt_warp_sum(v);
    __syncthreads();
    return v;
}

__device__ __forceinline__ float mt_block_max(float v, float *scratch) {
    const int lane = threadIdx.x % MT_WARP_SIZE, warp = threadIdx.x / MT_WARP_SIZE;
    const int warps = blockDim.x / MT_WARP_SIZE;
    v = mt_warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : -mt_inf();
    v = mt_warp_max(v);
    __syncthreads();
    return v;
}

// ---- bfloat16 ---------------------------------------------------------------------------------

__device__ __forceinline__ float mt_bf16_to_f32(mt_bf16 h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// Round to nearest, ties to even; NaN stays NaN (quiet bit set), like half::bf16::from_f32.
__device__ __forceinline__ mt_bf16 mt_f32_to_bf16(float f) {
    unsigned int x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (mt_bf16)((x >> 16) | 0x0040u);
    unsigned int round_bit = 0x00008000u;
    if ((x & round_bit) != 0 && (x & (3u * round_bit - 1u)) != 0) return (mt_bf16)((x >> 16) + 1u);
    return (mt_bf16)(x >> 16);
}

// ---- IEEE half ----------------------------------------------------------------------------------

__device__ __forceinline__ float mt_f16_to_f32(mt_f16 h) {
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    unsigned int exp = ((unsigned int)h >> 10) & 0x1fu;
    unsigned int man = (unsigned int)h & 0x3ffu;
    if (exp == 0x1fu) { // inf, or NaN made quiet like half::f16::to_f32
        return __uint_as_float(sign | 0x7f800000u | (man ? 0x400000u | (man << 13) : 0u));
    }
    if (exp == 0) {
        if (man == 0) return __uint_as_float(sign);
        // Subnormal: man * 2^-24, exact in f32.
        float v = (float)man * __uint_as_float(0x33800000u);
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// Round to nearest, ties to even, overflow to inf, like half::f16::from_f32.
__device__ __forceinline__ mt_f16 mt_f32_to_f16(float f) {
    unsigned int x = __float_as_uint(f);
    unsigned int sign = (x >> 16) & 0x8000u;
    unsigned int exp = (x >> 23) & 0xffu;
    unsigned int man = x & 0x7fffffu;
    if (exp == 0xffu) return (mt_f16)(sign | 0x7c00u | (man ? (0x200u | (man >> 13)) : 0u));
    int e = (int)exp - 127 + 15;
    if (e >= 0x1f) return (mt_f16)(sign | 0x7c00u);
    if (e <= 0) {
        if (e < -10) return (mt_f16)sign; // rounds to zero
        man |= 0x800000u;                 // implicit bit
        int shift = 14 - e;               // 24-bit mantissa down to the subnormal grid
        unsigned int half_man = man >> shift;
        unsigned int round_bit = 1u << (shift - 1);
        if ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0) half_man += 1u;
        return (mt_f16)(sign | half_man);
    }
    unsigned int h = sign | ((unsigned int)e << 10) | (man >> 13);
    unsigned int round_bit = 0x1000u;
    // A carry out of the mantissa bumps the exponent, up to inf: the right result.
    if ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0) h += 1u;
    return (mt_f16)h;
}
