//! The emu device arm itself (src/device/emu.rs, kernels/emu.h): test kernels compiled through
//! the same path as the project's kernels check that the emulated CUDA features compute what a
//! GPU computes (warp shuffles and votes, block barriers, dynamic shared memory, several blocks
//! and a 2-D block), and that bad kernels and bad launches are caught: reads and writes out of
//! bounds (naming the argument and the offset), a barrier not every thread reaches, lanes of a
//! warp at different shuffles, a shared-memory race (the result changes when threads run in
//! reverse order), and an argument list that does not match the kernel's parameters.

use meshtrain::device::{Device, EmuDevice, KernelArg as A, LaunchDims};

const TEST_KERNELS: &str = r#"
#include "compat.h"

// out[i] = the sum over i's warp (mt_warp_sum), the value of lane + 1 (shfl_down; the last
// lane keeps its own), and the ballot of odd lanes, per thread of a 2-D block; `pairs` holds
// mt_warp_sum and the same butterfly written as five xor shuffles, of non-integer values.
extern "C" __global__ void test_warp_ops(float *sums, float *down, unsigned int *ballots, float *pairs) {
    const int t = threadIdx.y * blockDim.x + threadIdx.x;
    const int i = blockIdx.x * blockDim.x * blockDim.y + t;
    const float v = (float)i;
    sums[i] = mt_warp_sum(v);
    down[i] = mt_shfl_down(v, 1);
    ballots[i] = __ballot_sync(MT_FULL_LANE_MASK, (t % MT_WARP_SIZE) % 2 == 1);
    const float w = v * 0.37f + 0.1f;
    float x = w;
    for (int off = MT_WARP_SIZE / 2; off > 0; off /= 2) x += mt_shfl_xor(x, off);
    pairs[2 * i] = mt_warp_sum(w);
    pairs[2 * i + 1] = x;
}

// Block sums through shared scratch, then each block's values reversed through dynamic shared
// memory: out[i] = inp[block start + (blockDim - 1 - t)]; sums[block] = sum of the block.
extern "C" __global__ void test_block_ops(float *out, float *sums, const float *inp) {
    __shared__ float scratch[MT_MAX_WARPS];
    MT_DYNAMIC_SHARED(float, stage);
    const int t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
    stage[t] = inp[i];
    const float s = mt_block_sum(inp[i], scratch);
    out[i] = stage[blockDim.x - 1 - t];
    if (t == 0) sums[blockIdx.x] = s;
}

// Off by one: the last thread reads inp[n].
extern "C" __global__ void test_read_past_end(float *out, const float *inp, mt_u64 n) {
    const mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = inp[i + 1];
}

// Thread 0 writes out[-1].
extern "C" __global__ void test_write_before_start(float *out, mt_u64 n) {
    const mt_u64 i = (mt_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i - 1] = 1.0f;
}

// Only the first warp reaches the barrier.
extern "C" __global__ void test_barrier_in_branch(float *out) {
    if (threadIdx.x < MT_WARP_SIZE) __syncthreads();
    out[threadIdx.x] = 1.0f;
}

// Odd and even lanes call different shuffles.
extern "C" __global__ void test_divergent_shuffle(float *out) {
    float v = (float)threadIdx.x;
    v = threadIdx.x % 2 ? mt_shfl_xor(v, 1) : mt_shfl_down(v, 1);
    out[threadIdx.x] = v;
}

// Thread 0 publishes the block index in shared memory, which every thread reads without a
// barrier in between: a race.
extern "C" __global__ void test_shared_race(float *out) {
    __shared__ float cell[1];
    if (threadIdx.x == 0) cell[0] = (float)blockIdx.x;
    out[blockIdx.x * blockDim.x + threadIdx.x] = cell[0];
}
"#;

const ENTRIES: [&str; 7] = [
    "test_warp_ops",
    "test_block_ops",
    "test_read_past_end",
    "test_write_before_start",
    "test_barrier_in_branch",
    "test_divergent_shuffle",
    "test_shared_race",
];

fn emu() -> Device {
    Device::Emu(EmuDevice::with_kernels(TEST_KERNELS, &ENTRIES).expect("g++ compiles the emu test kernels"))
}

fn down<T: bytemuck::Pod + Default + Clone>(dev: &Device, buf: &meshtrain::device::DeviceBuffer, n: usize) -> Vec<T> {
    let mut v = vec![T::default(); n];
    dev.copy_to_host(buf, &mut v).unwrap();
    v
}

fn error_of(r: meshtrain::error::Result<()>) -> String {
    r.expect_err("the launch must fail").to_string()
}

#[test]
fn warp_shuffles_votes_and_2d_blocks_compute_what_a_gpu_does() {
    let dev = emu();
    let (blocks, bx, by) = (3usize, 64usize, 4usize);
    let n = blocks * bx * by;
    let (sums, down_buf, ballots) = (dev.alloc(n * 4).unwrap(), dev.alloc(n * 4).unwrap(), dev.alloc(n * 4).unwrap());
    let pairs = dev.alloc(2 * n * 4).unwrap();
    let dims = LaunchDims { grid: (blocks as u32, 1, 1), block: (bx as u32, by as u32, 1), shared_bytes: 0 };
    dev.launch("test_warp_ops", dims, &[A::Buf(&sums), A::Buf(&down_buf), A::Buf(&ballots), A::Buf(&pairs)]).unwrap();
    let (s, d, b): (Vec<f32>, Vec<f32>, Vec<u32>) = (down(&dev, &sums, n), down(&dev, &down_buf, n), down(&dev, &ballots, n));
    let p: Vec<f32> = down(&dev, &pairs, 2 * n);
    for i in 0..n {
        assert_eq!(p[2 * i].to_bits(), p[2 * i + 1].to_bits(), "one-exchange butterfly vs five xor shuffles at {i}");
        let warp = i / 32 * 32;
        let want: f32 = (warp..warp + 32).map(|j| j as f32).sum();
        assert_eq!(s[i], want, "warp sum at {i}");
        let next = if i % 32 == 31 { i } else { i + 1 };
        assert_eq!(d[i], next as f32, "shfl_down at {i}");
        assert_eq!(b[i], 0xAAAA_AAAA, "ballot at {i}");
    }
}

#[test]
fn block_sums_and_dynamic_shared_memory_in_both_orders() {
    let dev = emu();
    let (blocks, threads) = (5usize, 256usize);
    let n = blocks * threads;
    let inp: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 - 500.0).collect();
    let dinp = dev.upload(&inp).unwrap();
    let (out, sums) = (dev.alloc(n * 4).unwrap(), dev.alloc(blocks * 4).unwrap());
    let dims = LaunchDims { grid: (blocks as u32, 1, 1), block: (threads as u32, 1, 1), shared_bytes: (threads * 4) as u32 };
    for reverse in [false, true] {
        let Device::Emu(e) = &dev else { unreachable!() };
        e.set_reverse_order(reverse);
        dev.launch("test_block_ops", dims, &[A::Buf(&out), A::Buf(&sums), A::Buf(&dinp)]).unwrap();
        let (o, s): (Vec<f32>, Vec<f32>) = (down(&dev, &out, n), down(&dev, &sums, blocks));
        for blk in 0..blocks {
            let row = &inp[blk * threads..(blk + 1) * threads];
            assert_eq!(s[blk], row.iter().sum::<f32>(), "block {blk} sum (integers: exact in any order)");
            for t in 0..threads {
                assert_eq!(o[blk * threads + t], row[threads - 1 - t], "reversed through dynamic shared memory");
            }
        }
    }
}

#[test]
fn out_of_bounds_reads_and_writes_name_the_argument_and_offset() {
    let dev = emu();
    // 1000 floats: a multiple of 16 bytes, so the read past the end hits the guard page.
    let n = 1000usize;
    let (out, inp) = (dev.alloc(n * 4).unwrap(), dev.upload(&vec![1.0f32; n]).unwrap());
    let dims = LaunchDims::linear(n.div_ceil(256) as u32, 256);
    let e = error_of(dev.launch("test_read_past_end", dims, &[A::Buf(&out), A::Buf(&inp), A::U64(n as u64)]));
    assert!(e.contains("test_read_past_end") && e.contains("out-of-bounds read at byte 4000 of argument 1"), "{e}");
    assert!(e.contains("0 bytes past its end"), "{e}");
    // Thread 0 of block 0 writes 4 bytes before the start: inside the canary padding of the first
    // page, caught after the launch.
    let e = error_of(dev.launch("test_write_before_start", dims, &[A::Buf(&out), A::U64(n as u64)]));
    assert!(e.contains("test_write_before_start") && e.contains("wrote out of bounds: byte -4 of argument 0"), "{e}");
    // A 4096-byte buffer fills its page exactly: the write before the start hits the guard page.
    let page = dev.alloc(4096).unwrap();
    let e = error_of(dev.launch("test_write_before_start", LaunchDims::linear(4, 256), &[A::Buf(&page), A::U64(1024)]));
    assert!(e.contains("out-of-bounds write at byte -4 of argument 0") && e.contains("4 bytes before its start"), "{e}");
    // The device still works after a fault.
    dev.launch("test_read_past_end", dims, &[A::Buf(&out), A::Buf(&inp), A::U64(n as u64 - 1)]).unwrap();
}

#[test]
fn barrier_deadlock_warp_divergence_and_bad_arguments_are_errors() {
    let dev = emu();
    let out = dev.alloc(256 * 4).unwrap();
    let dims = LaunchDims::linear(1, 256);
    let e = error_of(dev.launch("test_barrier_in_branch", dims, &[A::Buf(&out)]));
    assert!(e.contains("deadlock") && e.contains("__syncthreads"), "{e}");
    let e = error_of(dev.launch("test_divergent_shuffle", dims, &[A::Buf(&out)]));
    assert!(e.contains("divergent warp"), "{e}");
    let e = error_of(dev.launch("test_read_past_end", dims, &[A::Buf(&out), A::Buf(&out), A::I32(3)]));
    assert!(e.contains("arguments `ppi` do not match the parameters `ppu`"), "{e}");
    let e = error_of(dev.launch("test_divergent_shuffle", LaunchDims::linear(1, 96), &[A::Buf(&out)]));
    assert!(e.contains("multiple of 64"), "{e}");
    let e = error_of(dev.launch("no_such_kernel", dims, &[]));
    assert!(e.contains("not an entry point"), "{e}");
}

/// The racy kernel looks right when thread 0 happens to run first and wrong in reverse order:
/// running launches both ways is how the emu tests find races.
#[test]
fn a_shared_memory_race_shows_up_in_reverse_order() {
    let dev = emu();
    let (blocks, threads) = (4usize, 256usize);
    let out = dev.alloc(blocks * threads * 4).unwrap();
    let dims = LaunchDims::linear(blocks as u32, threads as u32);
    let want: Vec<f32> = (0..blocks * threads).map(|i| (i / threads) as f32).collect();
    let Device::Emu(e) = &dev else { unreachable!() };
    let mut results = Vec::new();
    for reverse in [false, true] {
        e.set_reverse_order(reverse);
        dev.launch("test_shared_race", dims, &[A::Buf(&out)]).unwrap();
        results.push(down::<f32>(&dev, &out, blocks * threads));
    }
    assert_eq!(results[0], want, "forward order: thread 0 writes before the others read");
    assert_ne!(results[1], want, "reverse order: the others read before thread 0 writes");
}
