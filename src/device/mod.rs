//! Compute devices: the CPU (always available, the numerical reference), CUDA / HIP GPUs, and
//! `emu`, which runs the GPU kernels on the host (compiled by g++ against `kernels/emu.h`) through
//! the same launch path, so that every kernel is tested on machines without a GPU.
//!
//! [`Device`] is one enum whose arms never change with cargo features: a binary built without
//! the `hip` feature still has `Device::Hip`, and opening it returns [`Error::NotCompiled`].
//! Invariants:
//! - opening a GPU never panics: a missing driver library (libcuda.so, NVRTC) or a machine
//!   without a GPU is an [`Error::Device`] saying which;
//! - a process binds the GPU of its node-local rank, `local_rank % visible_count`, where the
//!   visible list (CUDA_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES) has
//!   already been applied by the vendor runtime;
//! - every kernel is written once in `kernels/*.cu` (see `kernels/compat.h`) and compiled at
//!   open time: by NVRTC for the device's compute capability, by hipcc for AMD;
//! - [`DeviceBuffer`]s are untyped bytes, freed on drop; kernel launches check sizes in
//!   [`ops`] before any pointer reaches a kernel.
//!
//! The CPU arm's peak FLOP rate is measured, not guessed: MFU on CPU is reported against the sgemm
//! rate this process reaches with its share of the node's cores.

mod buffer;
pub mod cpu;
mod cuda;
pub mod emu;
mod emu_memory;
pub mod gemm;
mod hip;
pub mod hipcc;
pub mod ipc;
pub mod kernels;
pub mod nvrtc;
pub mod ops;
pub mod ops_attention;
pub mod ops_llama;
pub mod ops_vocab;
pub mod pinned;
pub mod reduce_bench;

pub use buffer::{DeviceBuffer, HostBytes};
pub use cuda::{cuda_driver_available, CudaBuffer, CudaDevice};
pub use emu::EmuDevice;
pub use hip::{HipBuffer, HipDevice};
pub use nvrtc::{compile_cuda_cubin, compile_cuda_kernels};

use bytemuck::Pod;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Where the job runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// The CPU reference implementation.
    Cpu,
    /// NVIDIA GPUs.
    Cuda,
    /// AMD GPUs.
    Hip,
    /// The GPU kernels run on the host by the emulator (src/device/emu.rs): for tests.
    Emu,
}

/// Element type of the model's matrix products (`precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// f32 everywhere (the reference numerics; the CPU model).
    Fp32,
    /// bf16 matrix-product inputs with f32 accumulation and f32 master weights (the device
    /// model; on `device = "cpu"` an exact emulation of its numerics).
    Bf16,
    /// IEEE half (fp16) matrix-product inputs with f32 accumulation and f32 master weights, as
    /// bf16 but with 3 more mantissa bits and 5 exponent bits: gradients need loss scaling
    /// (`train.loss_scale`) to stay above fp16's smallest normal and below its largest finite
    /// value (65504).
    Fp16,
}

impl Precision {
    /// The element type the matrix products read their operands in.
    pub fn gemm_input(self) -> gemm::GemmInput {
        match self {
            Precision::Fp32 => gemm::GemmInput::F32,
            Precision::Bf16 => gemm::GemmInput::Bf16,
            Precision::Fp16 => gemm::GemmInput::F16,
        }
    }

    /// Lower-case name as written in the job configuration.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }
}

/// Where kernels run and buffers live.
pub enum Device {
    /// The host; GPU kernels cannot be launched on it.
    Cpu,
    /// An NVIDIA GPU through the CUDA driver API.
    Cuda(CudaDevice),
    /// An AMD GPU through HIP (a binary built without the `hip` feature can never hold one).
    Hip(HipDevice),
    /// The GPU kernels emulated on the host, buffers bounds-checked (for tests).
    Emu(EmuDevice),
}

/// Grid and block shape of a kernel launch (x, y, z), plus dynamic shared memory in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchDims {
    /// Blocks per grid.
    pub grid: (u32, u32, u32),
    /// Threads per block; x must be a multiple of the warp/wavefront width (64 covers both).
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block in bytes.
    pub shared_bytes: u32,
}

impl LaunchDims {
    /// A 1-D launch of `blocks` blocks of `threads` threads, no dynamic shared memory.
    pub fn linear(blocks: u32, threads: u32) -> Self {
        LaunchDims {
            grid: (blocks, 1, 1),
            block: (threads, 1, 1),
            shared_bytes: 0,
        }
    }
}

/// One kernel argument, in the order of the kernel's C signature.
#[derive(Clone, Copy)]
pub enum KernelArg<'a> {
    /// Device pointer to the start of a buffer.
    Buf(&'a DeviceBuffer),
    /// Device pointer `offset` bytes into a buffer (the caller checked the range).
    BufAt(&'a DeviceBuffer, usize),
    /// C `int`.
    I32(i32),
    /// C `long long`.
    I64(i64),
    /// C `unsigned long long`.
    U64(u64),
    /// C `float`.
    F32(f32),
    /// A null pointer: an optional buffer the kernel is told to leave alone.
    Null,
}

/// A kernel argument with buffers resolved to raw device addresses.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RawArg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
}

impl Device {
    /// Opens the device of `kind` for node-local rank `local_rank`; never panics.
    pub fn open(kind: DeviceKind, local_rank: usize) -> Result<Device> {
        match kind {
            DeviceKind::Cpu => Ok(Device::Cpu),
            DeviceKind::Cuda => Ok(Device::Cuda(CudaDevice::open(local_rank)?)),
            DeviceKind::Hip => Ok(Device::Hip(HipDevice::open(local_rank)?)),
            DeviceKind::Emu => Ok(Device::Emu(EmuDevice::open()?)),
        }
    }

    /// The kind this device was opened as.
    pub fn kind(&self) -> DeviceKind {
        match self {
            Device::Cpu => DeviceKind::Cpu,
            Device::Cuda(_) => DeviceKind::Cuda,
            Device::Hip(_) => DeviceKind::Hip,
            Device::Emu(_) => DeviceKind::Emu,
        }
    }

    /// The arm's name in messages ("cpu", "cuda", "hip", "emu").
    pub(crate) fn arm(&self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda(_) => "cuda",
            Device::Hip(_) => "hip",
            Device::Emu(_) => "emu",
        }
    }

    /// An uninitialized buffer of `bytes` bytes on this device.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        match self {
            Device::Cpu => Ok(DeviceBuffer::Host(HostBytes::zeroed(bytes))),
            Device::Cuda(d) => Ok(DeviceBuffer::Cuda(d.alloc(bytes)?)),
            Device::Hip(d) => Ok(DeviceBuffer::Hip(d.alloc(bytes)?)),
            Device::Emu(_) => Ok(DeviceBuffer::Emu(HostBytes::guarded(bytes)?)),
        }
    }

    /// A new buffer holding a copy of `host`.
    pub fn upload<T: Pod>(&self, host: &[T]) -> Result<DeviceBuffer> {
        let mut buf = self.alloc(std::mem::size_of_val(host))?;
        self.copy_to_device(&mut buf, host)?;
        Ok(buf)
    }

    /// Copies `host` into the start of `dst` (which must be at least as large).
    pub fn copy_to_device<T: Pod>(&self, dst: &mut DeviceBuffer, host: &[T]) -> Result<()> {
        let src: &[u8] = bytemuck::cast_slice(host);
        buffer::check_len("copy_to_device", dst.len(), src.len())?;
        if src.is_empty() {
            // An empty buffer may have no device address: nothing to copy, nothing to call.
            return Ok(());
        }
        match (self, dst) {
            (Device::Cpu, DeviceBuffer::Host(d)) | (Device::Emu(_), DeviceBuffer::Emu(d)) => {
                d.bytes_mut()[..src.len()].copy_from_slice(src);
                Ok(())
            }
            (Device::Cuda(dev), DeviceBuffer::Cuda(d)) => dev.copy_to_device(d, src),
            (Device::Hip(dev), DeviceBuffer::Hip(d)) => dev.copy_to_device(d, src),
            (_, d) => Err(buffer::wrong_device("copy_to_device", self, d)),
        }
    }

    /// Copies the first `size_of_val(host)` bytes of `src` into `host`; returns when done.
    pub fn copy_to_host<T: Pod>(&self, src: &DeviceBuffer, host: &mut [T]) -> Result<()> {
        let dst: &mut [u8] = bytemuck::cast_slice_mut(host);
        buffer::check_len("copy_to_host", src.len(), dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        match (self, src) {
            (Device::Cpu, DeviceBuffer::Host(s)) | (Device::Emu(_), DeviceBuffer::Emu(s)) => {
                dst.copy_from_slice(&s.bytes()[..dst.len()]);
                Ok(())
            }
            (Device::Cuda(dev), DeviceBuffer::Cuda(s)) => dev.copy_to_host(s, dst),
            (Device::Hip(dev), DeviceBuffer::Hip(s)) => dev.copy_to_host(s, dst),
            (_, s) => Err(buffer::wrong_device("copy_to_host", self, s)),
        }
    }

    /// Copies all of `src` into the start of `dst`, on the device (queued, like a launch).
    pub fn copy_on_device(&self, dst: &mut DeviceBuffer, src: &DeviceBuffer) -> Result<()> {
        buffer::check_len("copy_on_device", dst.len(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        match (self, dst, src) {
            (Device::Cpu, DeviceBuffer::Host(d), DeviceBuffer::Host(s))
            | (Device::Emu(_), DeviceBuffer::Emu(d), DeviceBuffer::Emu(s)) => {
                d.bytes_mut()[..s.bytes().len()].copy_from_slice(s.bytes());
                Ok(())
            }
            (Device::Cuda(dev), DeviceBuffer::Cuda(d), DeviceBuffer::Cuda(s)) => dev.copy_on_device(d, s),
            (Device::Hip(dev), DeviceBuffer::Hip(d), DeviceBuffer::Hip(s)) => dev.copy_on_device(d, s),
            (_, d, _) => Err(buffer::wrong_device("copy_on_device", self, d)),
        }
    }

    /// Queues kernel `name` (an entry point of [`kernels::entry_points`]) with `args`.
    pub fn launch(&self, name: &str, dims: LaunchDims, args: &[KernelArg]) -> Result<()> {
        let raw = args
            .iter()
            .map(|a| self.resolve(a, name))
            .collect::<Result<Vec<RawArg>>>()?;
        match self {
            Device::Cpu => Err(Error::InvalidArgument(format!(
                "kernel {name}: GPU kernels cannot run on the CPU device (use the model's CPU layers)"
            ))),
            Device::Cuda(d) => d.launch(name, dims, &raw),
            Device::Hip(d) => d.launch(name, dims, &raw),
            Device::Emu(d) => d.launch(name, dims, args, &raw),
        }
    }

    fn resolve(&self, arg: &KernelArg, kernel: &str) -> Result<RawArg> {
        Ok(match *arg {
            KernelArg::Buf(b) => RawArg::Ptr(b.device_address(self, kernel, 0)?),
            KernelArg::BufAt(b, off) => RawArg::Ptr(b.device_address(self, kernel, off)?),
            KernelArg::I32(v) => RawArg::I32(v),
            KernelArg::I64(v) => RawArg::I64(v),
            KernelArg::U64(v) => RawArg::U64(v),
            KernelArg::F32(v) => RawArg::F32(v),
            KernelArg::Null => RawArg::Ptr(0),
        })
    }

    /// Dense peak TFLOP/s of this device for products in `precision`, for MFU: the vendor's
    /// figure for known GPUs (H100/H200 SXM: 989 bf16 or fp16, 67 fp32; A100: 312, 19.5), `None` for
    /// others and the CPU (whose peak is measured, [`cpu_peak_tflops`]); `metrics.peak_tflops`
    /// overrides it.
    pub fn peak_tflops(&self, precision: Precision) -> Option<f64> {
        let Device::Cuda(d) = self else { return None };
        // Dense fp16 and bf16 tensor-core rates are the same on these parts.
        let bf16 = precision != Precision::Fp32;
        let name = d.name();
        if name.contains("H100") || name.contains("H200") {
            Some(if bf16 { 989.0 } else { 67.0 })
        } else if name.contains("A100") {
            Some(if bf16 { 312.0 } else { 19.5 })
        } else {
            None
        }
    }

    /// A second handle to this device for a communication thread: its work goes to a queue of
    /// its own, so a collective it runs can overlap the compute queue's kernels. On the CPU and
    /// emu arms work runs on the calling thread, so the lane is a copy; on CUDA it is a new
    /// stream of the same context; on HIP the null stream again (the HIP arm has one queue), so
    /// there only the host side of a collective overlaps. Nothing orders the two queues: the
    /// caller synchronizes the producer's queue before handing a buffer over and the lane's
    /// before handing it back.
    pub fn comm_lane(&self) -> Result<Device> {
        Ok(match self {
            Device::Cpu => Device::Cpu,
            Device::Cuda(d) => Device::Cuda(d.lane()?),
            Device::Hip(d) => Device::Hip(d.lane()),
            Device::Emu(d) => Device::Emu(d.lane()),
        })
    }

    /// Makes this device current on the calling thread (a thread that did not open it).
    pub fn bind_thread(&self) -> Result<()> {
        match self {
            Device::Cuda(d) => d.bind(),
            Device::Hip(d) => d.bind_thread(),
            Device::Cpu | Device::Emu(_) => Ok(()),
        }
    }

    /// Waits until all queued work on this device has finished and reports its errors.
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(d) => d.synchronize(),
            Device::Hip(d) => d.synchronize(),
            Device::Emu(_) => Ok(()), // every emu launch has finished when it returns
        }
    }
}

/// The device ordinal for `local_rank` among `count` visible GPUs; `visible_var` names the
/// variable that selected them (for the error message).
pub(crate) fn pick_ordinal(local_rank: usize, count: usize, visible_var: &str) -> Result<usize> {
    if count == 0 {
        let shown = std::env::var(visible_var).unwrap_or_else(|_| "<unset>".into());
        return Err(Error::Device(format!(
            "local rank {local_rank}: the driver sees no GPU ({visible_var}={shown})"
        )));
    }
    Ok(local_rank % count)
}

use std::time::Instant;

use crate::device::cpu::matmul::{matmul, Mat};
use crate::device::cpu::parallel::{choose_threads, set_cpu_threads, ThreadChoice};

/// Cores this rank may use when `ranks_on_node` ranks share the node (at least 1).
pub fn cores_per_rank(ranks_on_node: usize) -> usize {
    let cores = crate::device::cpu::parallel::available_cores();
    (cores / ranks_on_node.max(1)).max(1)
}

/// Sets this process's BLAS and layer threads: `configured` (`train.threads`, 0 = not set), else
/// `OMP_NUM_THREADS` / `OPENBLAS_NUM_THREADS`, else the node's cores split among its
/// `ranks_on_node` ranks (oversubscribed OpenBLAS threads spin and slow every rank down).
/// Returns the choice, for the log.
pub fn bind_cpu_threads(configured: usize, ranks_on_node: usize) -> Result<ThreadChoice> {
    let choice = choose_threads(configured, cores_per_rank(ranks_on_node))?;
    set_cpu_threads(choice.threads);
    Ok(choice)
}

/// Measured sgemm TFLOP/s of this process on the threads [`bind_cpu_threads`] set (a square
/// GEMM of 768, best of a few runs, ~0.1 s), used as the CPU's peak for MFU.
pub fn cpu_peak_tflops() -> f64 {
    let n = 768;
    let a = vec![1.0f32; n * n];
    let b = vec![0.5f32; n * n];
    let mut c = vec![0.0f32; n * n];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        matmul(&mut c, Mat::new(&a, n, n), Mat::new(&b, n, n), false);
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (n * n * n) as f64 / best / 1e12
}
