// emu.h: the CUDA subset of compat.h emulated in plain C++ (g++), for the `emu` device arm
// (src/device/emu.rs), which runs every kernel on the host with the launch's exact grid, block,
// shared-memory size and arguments.
//
// Execution model:
// - a launch's blocks are spread over a few worker threads (a pool that lives as long as the
//   process); each block runs to completion on one worker, its threads as fibers (own stacks,
//   a hand-written context switch on x86-64, ucontext elsewhere) scheduled cooperatively;
// - a fiber runs until it finishes or waits at __syncthreads (all threads of the block) or at a
//   warp operation (shuffle, vote: all lanes of its warp, the converged-warp rule of compat.h);
//   a barrier that can never complete (a thread exited, or lanes wait at different operations)
//   is reported as a deadlock, a warp whose lanes meet at different kinds of operation as
//   divergence;
// - __shared__ variables are thread_local statics: a worker runs one block at a time, so each
//   block sees its own copy; dynamic shared memory (MT_DYNAMIC_SHARED) is a per-worker buffer of
//   the launch's size, filled with 0xFF (NaN) before each block so that a read before any write
//   shows up in the result;
// - `mt_emu_order`: blocks and the fibers of a block run in forward or reverse order, so a test
//   can run a launch both ways and compare (a result that depends on the order is a race);
// - a SIGSEGV inside a kernel (the emu buffers sit between inaccessible guard pages) ends the
//   launch with the faulting address, which src/device/emu.rs maps back to an argument buffer;
// - atomics are real atomics (workers run blocks in parallel).
// Not emulated: timing, the GPU memory model beyond barriers, warps that diverge and reconverge
// (lanes always run one after another between barriers).
#include <cmath>
#include <type_traits>
#include <cstring>
#include <cstdint>
#include <chrono>
#include <thread>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __shared__ static thread_local
#define __restrict__ __restrict

struct uint3 { unsigned int x, y, z; };
typedef uint3 dim3;
struct alignas(16) uint4 { unsigned int x, y, z, w; };

// State of the block and the fiber being run on this worker thread (defined in the runtime
// part, kernels/emu_runtime.cpp, which is appended to the translation unit).
struct MtEmuFiber { uint3 tid; };
extern thread_local MtEmuFiber *mt_emu_fiber;
extern thread_local uint3 mt_emu_block_idx, mt_emu_block_dim, mt_emu_grid_dim;
extern thread_local unsigned char *mt_emu_dyn_shared;

#define threadIdx (mt_emu_fiber->tid)
#define blockIdx (mt_emu_block_idx)
#define blockDim (mt_emu_block_dim)
#define gridDim (mt_emu_grid_dim)
#define warpSize 32

void __syncthreads();
// The warp operations: every lane publishes 8 bytes, waits for its whole warp at the same kind
// of operation, and gets the published words of all lanes back.
enum MtEmuWarpOp { MT_EMU_SHFL_DOWN = 1, MT_EMU_SHFL_XOR, MT_EMU_VOTE, MT_EMU_BUTTERFLY };
const unsigned long long *mt_emu_warp_exchange(unsigned long long word, MtEmuWarpOp op, int *lane, int *width);

template <typename T> T mt_emu_shfl(T v, int arg, MtEmuWarpOp op) {
    static_assert(sizeof(T) <= 8, "warp shuffles move at most 8 bytes");
    unsigned long long w = 0;
    std::memcpy(&w, &v, sizeof(T));
    int lane, width;
    const unsigned long long *all = mt_emu_warp_exchange(w, op, &lane, &width);
    int src = op == MT_EMU_SHFL_DOWN ? lane + arg : lane ^ arg;
    if (src < 0 || src >= width) src = lane; // out of the warp: a lane keeps its own value
    T out;
    std::memcpy(&out, &all[src], sizeof(T));
    return out;
}
template <typename T> T __shfl_down_sync(unsigned, T v, unsigned delta) { return mt_emu_shfl(v, (int)delta, MT_EMU_SHFL_DOWN); }
template <typename T> T __shfl_xor_sync(unsigned, T v, int mask) { return mt_emu_shfl(v, mask, MT_EMU_SHFL_XOR); }

// The xor butterfly of compat.h's mt_warp_sum / mt_warp_max (`v = op(v, shfl_xor(v, off))` for
// off = 16, 8, 4, 2, 1) in one exchange instead of five: every lane gets all values and replays
// the rounds that lead to its own result (31 operations, the same operands in the same order),
// so the result is bit-identical to the five shuffles. `after(i, off)` is lane i's value after
// the round of `off`.
template <typename Op>
float mt_emu_butterfly_after(const unsigned long long *all, int i, int off, int width, Op op) {
    if (off == 32) {
        float v;
        unsigned int bits = (unsigned int)all[i];
        std::memcpy(&v, &bits, 4);
        return v;
    }
    const int j = (i ^ off) < width ? i ^ off : i; // out of the warp: a lane keeps its own value
    return op(mt_emu_butterfly_after(all, i, off * 2, width, op), mt_emu_butterfly_after(all, j, off * 2, width, op));
}
template <typename Op> float mt_emu_butterfly(float v, Op op) {
    unsigned int bits;
    std::memcpy(&bits, &v, 4);
    int lane, width;
    const unsigned long long *all = mt_emu_warp_exchange(bits, MT_EMU_BUTTERFLY, &lane, &width);
    return mt_emu_butterfly_after(all, lane, 1, width, op);
}

inline unsigned __ballot_sync(unsigned, int pred) {
    int lane, width;
    const unsigned long long *all = mt_emu_warp_exchange(pred != 0, MT_EMU_VOTE, &lane, &width);
    unsigned bits = 0;
    for (int i = 0; i < width; i++) bits |= (all[i] ? 1u : 0u) << i;
    return bits;
}
inline int __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0; }
inline int __all_sync(unsigned m, int pred) {
    int lane, width;
    const unsigned long long *all = mt_emu_warp_exchange(pred != 0, MT_EMU_VOTE, &lane, &width);
    for (int i = 0; i < width; i++)
        if (!all[i]) return 0;
    return 1;
}

// ---- atomics (workers run blocks in parallel) -------------------------------------------------

template <typename T> T atomicAdd(T *p, T v) {
    if constexpr (std::is_floating_point<T>::value) {
        T old = *p, sum;
        do {
            sum = old + v;
        } while (!__atomic_compare_exchange(p, &old, &sum, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
        return old;
    } else {
        return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
    }
}
template <typename T> T atomicMax(T *p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}
template <typename T> T atomicMin(T *p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}
template <typename T> T atomicExch(T *p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
template <typename T> T atomicCAS(T *p, T expect, T v) {
    __atomic_compare_exchange_n(p, &expect, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return expect;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
// The clock and back-off of compat.h's device flags: nanoseconds of the host's steady clock, and a
// short sleep (ranks oversubscribe the cores in tests: a spinning rank must let its peer run).
inline unsigned long long mt_emu_timer_ns() {
    return (unsigned long long)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}
inline void mt_emu_pause() { std::this_thread::sleep_for(std::chrono::microseconds(20)); }

// ---- bit casts and math -----------------------------------------------------------------------

inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
inline unsigned int __float_as_uint(float f) { unsigned int x; std::memcpy(&x, &f, 4); return x; }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __fdividef(float a, float b) { return a / b; }
