//! The CUDA arm: one context and one stream per process on the GPU of its node-local rank, the
//! kernels compiled by NVRTC for that GPU's compute capability and loaded once.
//!
//! cudarc loads libcuda at run time and panics when it is missing; [`CudaDevice::open`] checks
//! for the library first and runs the rest of the set-up under `catch_unwind`, so a machine
//! without a driver gets an [`Error::Device`]. All work goes to a single stream, so stream order
//! alone orders launches, copies and frees; cudarc's per-buffer event tracking is switched off.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError, LaunchConfig, PushKernelArg,
};

use super::kernels::entry_points;
use super::nvrtc::compile_cuda_kernels;
use super::{pick_ordinal, LaunchDims, RawArg};
use crate::error::{Error, Result};

/// An opened NVIDIA GPU with the meshtrain kernels loaded.
pub struct CudaDevice {
    ordinal: usize,
    name: String,
    stream: Arc<CudaStream>,
    functions: HashMap<String, CudaFunction>,
}

/// Device memory of a [`CudaDevice`], freed (stream-ordered) on drop.
pub struct CudaBuffer {
    slice: CudaSlice<u8>,
    address: u64,
}

impl CudaBuffer {
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// True for a zero-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn address(&self) -> u64 {
        self.address
    }
}

fn driver_err(what: &str, e: DriverError) -> Error {
    Error::Device(format!("cuda: {what}: {e:?}"))
}

/// True when libcuda can be loaded (it ships with the NVIDIA driver, not the toolkit).
pub fn cuda_driver_available() -> bool {
    // SAFETY: only tries to dlopen the library names cudarc knows and drops the handles.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

impl CudaDevice {
    /// Opens GPU `local_rank % visible_count` and loads the kernels.
    pub fn open(local_rank: usize) -> Result<CudaDevice> {
        if !cuda_driver_available() {
            return Err(Error::Device(format!(
                "local rank {local_rank}: no CUDA driver (libcuda.so) found: this machine has no \
                 NVIDIA driver installed, or it is not on the library path"
            )));
        }
        match catch_unwind(AssertUnwindSafe(|| Self::open_checked(local_rank))) {
            Ok(result) => result,
            Err(_) => Err(Error::Device(format!(
                "local rank {local_rank}: the CUDA driver library lacks a function cudarc needs \
                 (driver older than CUDA 12.8?)"
            ))),
        }
    }

    fn open_checked(local_rank: usize) -> Result<CudaDevice> {
        let count = CudaContext::device_count().map_err(|e| driver_err("cuInit / device count", e))?;
        let ordinal = pick_ordinal(local_rank, count.max(0) as usize, "CUDA_VISIBLE_DEVICES")?;
        let ctx =
            CudaContext::new(ordinal).map_err(|e| driver_err(&format!("context on GPU {ordinal}"), e))?;
        // SAFETY: this device uses one stream only, so stream order already orders every read,
        // write and free of every buffer; the events cudarc would record add nothing.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| driver_err("compute capability", e))?;
        let name = ctx.name().map_err(|e| driver_err("device name", e))?;
        let arch = format!("sm_{major}{minor}");
        let module = ctx
            .load_module(compile_cuda_kernels(&arch)?)
            .map_err(|e| driver_err(&format!("loading the {arch} kernels"), e))?;
        let mut functions = HashMap::new();
        for entry in entry_points() {
            let f = module
                .load_function(&entry)
                .map_err(|e| driver_err(&format!("kernel {entry}"), e))?;
            functions.insert(entry, f);
        }
        log::info!("local rank {local_rank}: CUDA GPU {ordinal} of {count} ({name}, {arch})");
        Ok(CudaDevice {
            ordinal,
            name,
            stream: ctx.default_stream(),
            functions,
        })
    }

    /// Ordinal among the visible GPUs.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The one stream all of this device's work goes to (libraries such as cuBLAS bind to it).
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub(crate) fn alloc(&self, bytes: usize) -> Result<CudaBuffer> {
        // SAFETY: the memory is uninitialized bytes; every reader of a DeviceBuffer either
        // wrote it first or accepts arbitrary bytes (u8 has no invalid values).
        let slice = unsafe { self.stream.alloc::<u8>(bytes) }
            .map_err(|e| driver_err(&format!("alloc {bytes} B"), e))?;
        let address = {
            let (ptr, _record) = slice.device_ptr(&self.stream);
            ptr
        };
        Ok(CudaBuffer { slice, address })
    }

    pub(crate) fn copy_to_device(&self, dst: &mut CudaBuffer, src: &[u8]) -> Result<()> {
        let mut view = dst.slice.slice_mut(..src.len());
        self.stream
            .memcpy_htod(src, &mut view)
            .map_err(|e| driver_err(&format!("copy {} B to device", src.len()), e))?;
        self.synchronize()
    }

    pub(crate) fn copy_to_host(&self, src: &CudaBuffer, dst: &mut [u8]) -> Result<()> {
        let view = src.slice.slice(..dst.len());
        self.stream
            .memcpy_dtoh(&view, dst)
            .map_err(|e| driver_err(&format!("copy {} B to host", dst.len()), e))?;
        self.synchronize()
    }

    pub(crate) fn copy_on_device(&self, dst: &mut CudaBuffer, src: &CudaBuffer) -> Result<()> {
        let mut view = dst.slice.slice_mut(..src.len());
        self.stream
            .memcpy_dtod(&src.slice, &mut view)
            .map_err(|e| driver_err(&format!("copy {} B on device", src.len()), e))
    }

    pub(crate) fn launch(&self, name: &str, dims: LaunchDims, args: &[RawArg]) -> Result<()> {
        let f = self
            .functions
            .get(name)
            .ok_or_else(|| Error::InvalidArgument(format!("cuda: no kernel named {name}")))?;
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                RawArg::Ptr(v) | RawArg::U64(v) => b.arg(v),
                RawArg::I32(v) => b.arg(v),
                RawArg::I64(v) => b.arg(v),
                RawArg::F32(v) => b.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: dims.grid,
            block_dim: dims.block,
            shared_mem_bytes: dims.shared_bytes,
        };
        // SAFETY: `ops` checked every buffer against the sizes the kernel indexes and passes the
        // arguments in the order and C types of the kernel's signature.
        unsafe { b.launch(cfg) }.map_err(|e| driver_err(&format!("launch {name}"), e))?;
        Ok(())
    }

    pub(crate) fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| driver_err("synchronize (an earlier kernel failed?)", e))
    }
}
