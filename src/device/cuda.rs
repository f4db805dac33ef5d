//! The CUDA arm: one context and one stream per process on the GPU of its node-local rank, the
//! kernels compiled by NVRTC for that GPU's compute capability and loaded once.
//!
//! cudarc loads libcuda at run time and panics when it is missing; [`CudaDevice::open`] checks
//! for the library first and runs the rest of the set-up under `catch_unwind`, so a machine
//! without a driver gets an [`Error::Device`]. All compute goes to a single stream, so stream
//! order alone orders launches, copies and frees; cudarc's per-buffer event tracking is switched
//! off. A communication thread gets a second stream ([`CudaDevice::lane`]); a buffer passes
//! between the two only after the stream that wrote it was synchronized.
//!
//! Buffers come from the stream-ordered pool ([`CudaDevice::alloc`]) or, when other processes
//! must map them through IPC handles, from `cuMemAlloc` ([`CudaDevice::alloc_shareable`]: pool
//! memory cannot be exported with `cuIpcGetMemHandle`); a third kind borrows memory owned
//! elsewhere (a part of another buffer, a peer's mapped allocation) and frees nothing. The
//! collectives' staging needs asynchronous copies to page-locked host memory and events on the
//! one stream; those and the IPC calls are at the end of this file.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::driver::{
    result, sys, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError, LaunchConfig,
    PushKernelArg,
};

use super::kernels::entry_points;
use super::nvrtc::{compile_cuda_cubin, Ptx};
use super::{pick_ordinal, LaunchDims, RawArg};
use crate::error::{Error, Result};

/// An opened NVIDIA GPU with the meshtrain kernels loaded.
pub struct CudaDevice {
    ordinal: usize,
    name: String,
    stream: Arc<CudaStream>,
    functions: HashMap<String, CudaFunction>,
}

/// Device memory of a [`CudaDevice`], freed on drop (unless borrowed).
pub struct CudaBuffer {
    memory: Memory,
    address: u64,
    len: usize,
}

/// Where a buffer's bytes came from, which decides how they are freed.
enum Memory {
    /// The stream-ordered pool: cudarc frees it in stream order.
    Pool { _slice: CudaSlice<u8> },
    /// `cuMemAlloc`, exportable through IPC handles: freed once the stream has drained.
    Shareable(Arc<CudaStream>),
    /// Owned elsewhere (see [`CudaBuffer::borrowed`]): never freed here.
    Borrowed,
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        let Memory::Shareable(stream) = &self.memory else { return };
        // SAFETY: the address came from cuMemAlloc and is freed once, after every queued
        // operation (the only users of this memory in this process) has finished.
        let freed = stream.synchronize().and_then(|_| unsafe { result::free_sync(self.address) });
        if let Err(e) = freed {
            log::error!("cuda: free {} B: {e:?}", self.len);
        }
    }
}

impl CudaBuffer {
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn address(&self) -> u64 {
        self.address
    }

    /// True for memory other processes can map ([`CudaDevice::alloc_shareable`]).
    pub fn is_shareable(&self) -> bool {
        matches!(self.memory, Memory::Shareable(_))
    }

    /// A buffer naming `len` bytes at `address` that frees nothing.
    ///
    /// # Safety
    /// The memory must stay allocated, on this buffer's context, while the result (or anything
    /// queued with it) is in use.
    pub(crate) unsafe fn borrowed(address: u64, len: usize) -> CudaBuffer {
        CudaBuffer { memory: Memory::Borrowed, address, len }
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
            .load_module(Ptx::from_binary(compile_cuda_cubin(&arch)?))
            .map_err(|e| driver_err(&format!("loading the {arch} kernels"), e))?;
        let mut functions = HashMap::new();
        for entry in entry_points() {
            let f = module
                .load_function(&entry)
                .map_err(|e| driver_err(&format!("kernel {entry}"), e))?;
            functions.insert(entry, f);
        }
        let mut version = 0;
        // SAFETY: writes one int through a pointer to a local; the driver is initialised above.
        let driver = match unsafe { sys::cuDriverGetVersion(&mut version) }.result() {
            Ok(()) => format!("{}.{}", version / 1000, version % 1000 / 10),
            Err(e) => format!("unknown ({e:?})"),
        };
        let file = super::nvrtc::loaded_library("libcuda.so").unwrap_or_default();
        log::info!(
            "local rank {local_rank}: CUDA GPU {ordinal} of {count} ({name}, {arch}), driver for CUDA {driver} ({file})"
        );
        Ok(CudaDevice {
            ordinal,
            name,
            stream: ctx.default_stream(),
            functions,
        })
    }

    /// The same GPU, context and kernels with a stream of its own (a communication thread's).
    /// Buffers shared with the main stream are ordered by the callers' synchronizations, since
    /// event tracking is off.
    pub(crate) fn lane(&self) -> Result<CudaDevice> {
        let stream = self.stream.context().new_stream().map_err(|e| driver_err("create a communication stream", e))?;
        Ok(CudaDevice { ordinal: self.ordinal, name: self.name.clone(), stream, functions: self.functions.clone() })
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
        if bytes == 0 {
            // cuMemAlloc rejects a size of 0: an empty buffer owns nothing.
            return Ok(CudaBuffer { memory: Memory::Borrowed, address: 0, len: 0 });
        }
        // SAFETY: the memory is uninitialized bytes; every reader of a DeviceBuffer either
        // wrote it first or accepts arbitrary bytes (u8 has no invalid values).
        let slice = unsafe { self.stream.alloc::<u8>(bytes) }
            .map_err(|e| driver_err(&format!("alloc {bytes} B"), e))?;
        let address = {
            let (ptr, _record) = slice.device_ptr(&self.stream);
            ptr
        };
        Ok(CudaBuffer { memory: Memory::Pool { _slice: slice }, address, len: bytes })
    }

    /// A buffer other processes can map through an IPC handle (`cuMemAlloc`, not the pool).
    /// Freeing it waits for the stream to drain, so allocate these once, not per step.
    pub(crate) fn alloc_shareable(&self, bytes: usize) -> Result<CudaBuffer> {
        if bytes == 0 {
            return self.alloc(0);
        }
        self.bind()?;
        // SAFETY: uninitialized bytes, as for `alloc`; the buffer owns the allocation from here.
        let address = unsafe { result::malloc_sync(bytes) }
            .map_err(|e| driver_err(&format!("alloc {bytes} B (shareable)"), e))?;
        Ok(CudaBuffer { memory: Memory::Shareable(self.stream.clone()), address, len: bytes })
    }

    pub(crate) fn bind(&self) -> Result<()> {
        self.stream.context().bind_to_thread().map_err(|e| driver_err("bind context", e))
    }

    pub(crate) fn copy_to_device(&self, dst: &mut CudaBuffer, src: &[u8]) -> Result<()> {
        // SAFETY: the caller checked src.len() <= dst.len; the synchronize below keeps `src`
        // borrowed until the copy is done.
        unsafe { self.upload_async(dst, 0, src.as_ptr(), src.len())? };
        self.synchronize()
    }

    pub(crate) fn copy_to_host(&self, src: &CudaBuffer, dst: &mut [u8]) -> Result<()> {
        // SAFETY: the caller checked dst.len() <= src.len; the synchronize below keeps `dst`
        // borrowed until the copy is done.
        unsafe { self.download_async(src, 0, dst.as_mut_ptr(), dst.len())? };
        self.synchronize()
    }

    pub(crate) fn copy_on_device(&self, dst: &mut CudaBuffer, src: &CudaBuffer) -> Result<()> {
        self.copy_within(dst, 0, src, 0, src.len())
    }

    /// Queues a copy of `len` bytes from `src` at `src_off` to `dst` at `dst_off`.
    fn copy_within(
        &self,
        dst: &CudaBuffer,
        dst_off: usize,
        src: &CudaBuffer,
        src_off: usize,
        len: usize,
    ) -> Result<()> {
        check_range("copy on device (dst)", dst, dst_off, len)?;
        check_range("copy on device (src)", src, src_off, len)?;
        self.bind()?;
        let (d, s) = (dst.address + dst_off as u64, src.address + src_off as u64);
        // SAFETY: both ranges lie inside live allocations (checked above).
        unsafe { result::memcpy_dtod_async(d, s, len, self.stream.cu_stream()) }
            .map_err(|e| driver_err(&format!("copy {len} B on device"), e))
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

fn check_range(what: &str, buf: &CudaBuffer, off: usize, len: usize) -> Result<()> {
    if off.checked_add(len).is_none_or(|end| end > buf.len) {
        return Err(Error::InvalidArgument(format!(
            "cuda: {what}: bytes {off}..{} outside a {}-byte buffer",
            off.saturating_add(len),
            buf.len
        )));
    }
    Ok(())
}

/// Page-locked host memory (`cuMemHostAlloc`), which asynchronous copies need to overlap.
pub struct CudaPinned {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: plain host memory owned by this value; the driver is thread-safe.
unsafe impl Send for CudaPinned {}

impl CudaPinned {
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for CudaPinned {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemHostAlloc and is freed once; its owner waited for the
        // copies that used it before dropping it.
        let freed = self.ctx.bind_to_thread().and_then(|_| unsafe { result::free_host(self.ptr.cast()) });
        if let Err(e) = freed {
            log::error!("cuda: free {} B of pinned host memory: {e:?}", self.len);
        }
    }
}

/// What another process needs to map a buffer: the IPC handle of the allocation holding it and
/// the buffer's offset inside that allocation.
pub struct CudaExport {
    /// `CUipcMemHandle` bytes.
    pub handle: [u8; 64],
    /// Byte offset of the buffer in its allocation.
    pub offset: u64,
}

/// A peer's allocation mapped into this process; closed on drop.
pub struct CudaMapping {
    address: u64,
    ctx: Arc<CudaContext>,
}

// SAFETY: a device address and the context it lives in; the driver is thread-safe.
unsafe impl Send for CudaMapping {}

impl CudaMapping {
    pub(crate) fn address(&self) -> u64 {
        self.address
    }
}

impl Drop for CudaMapping {
    fn drop(&mut self) {
        // SAFETY: the address came from cuIpcOpenMemHandle and is closed once; the owner of the
        // mapping synchronized every use of it before dropping it.
        let closed = self
            .ctx
            .bind_to_thread()
            .and_then(|_| unsafe { sys::cuIpcCloseMemHandle(self.address) }.result());
        if let Err(e) = closed {
            log::error!("cuda: closing a peer's IPC mapping: {e:?}");
        }
    }
}

/// Staging and IPC: asynchronous copies between device and page-locked host memory on the one
/// stream, events to wait for them, and the export and mapping of allocations.
impl CudaDevice {
    /// `bytes` of page-locked host memory (not write-combined: the host reads it).
    pub(crate) fn alloc_pinned(&self, bytes: usize) -> Result<CudaPinned> {
        self.bind()?;
        // SAFETY: a fresh allocation of `bytes.max(1)` bytes owned by the result.
        let ptr = unsafe { result::malloc_host(bytes.max(1), 0) }
            .map_err(|e| driver_err(&format!("pinned host alloc {bytes} B"), e))?;
        Ok(CudaPinned { ptr: ptr.cast(), len: bytes, ctx: self.stream.context().clone() })
    }

    /// Queues a copy of `len` bytes of `src` at `offset` to host memory at `dst`.
    ///
    /// # Safety
    /// `dst..dst+len` must stay valid, and unread and unwritten by the host, until an event
    /// recorded after this call has completed.
    pub(crate) unsafe fn download_async(&self, src: &CudaBuffer, offset: usize, dst: *mut u8, len: usize) -> Result<()> {
        check_range("copy to host", src, offset, len)?;
        self.bind()?;
        let host = std::slice::from_raw_parts_mut(dst, len);
        result::memcpy_dtoh_async(host, src.address + offset as u64, self.stream.cu_stream())
            .map_err(|e| driver_err(&format!("copy {len} B to host"), e))
    }

    /// Queues a copy of `len` bytes of host memory at `src` into `dst` at `offset`.
    ///
    /// # Safety
    /// `src..src+len` must stay valid, and unwritten by the host, until an event recorded after
    /// this call has completed.
    pub(crate) unsafe fn upload_async(&self, dst: &CudaBuffer, offset: usize, src: *const u8, len: usize) -> Result<()> {
        check_range("copy to device", dst, offset, len)?;
        self.bind()?;
        let host = std::slice::from_raw_parts(src, len);
        result::memcpy_htod_async(dst.address + offset as u64, host, self.stream.cu_stream())
            .map_err(|e| driver_err(&format!("copy {len} B to device"), e))
    }

    /// An event without timing, for [`CudaDevice::record`] and [`CudaDevice::wait`].
    pub(crate) fn event(&self) -> Result<CudaEvent> {
        self.stream.context().new_event(None).map_err(|e| driver_err("create event", e))
    }

    /// Marks the work queued so far.
    pub(crate) fn record(&self, event: &CudaEvent) -> Result<()> {
        event.record(&self.stream).map_err(|e| driver_err("record event", e))
    }

    /// Blocks until the work marked by `event` has finished.
    pub(crate) fn wait(&self, event: &CudaEvent) -> Result<()> {
        event.synchronize().map_err(|e| driver_err("wait for event (an earlier copy failed?)", e))
    }

    /// The IPC handle of the allocation holding `buf` and `buf`'s offset in it. Fails for pool
    /// memory (see [`CudaDevice::alloc_shareable`]).
    pub(crate) fn export(&self, buf: &CudaBuffer) -> Result<CudaExport> {
        self.bind()?;
        let (mut base, mut size) = (0u64, 0usize);
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: valid out-pointers; `buf.address` is a live device address of this context.
        unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, buf.address)
                .result()
                .map_err(|e| driver_err("address range of a buffer", e))?;
            sys::cuIpcGetMemHandle(&mut handle, base).result().map_err(|e| {
                driver_err("IPC handle of a buffer (pool memory cannot be exported: allocate shareable)", e)
            })?;
        }
        Ok(CudaExport { handle: handle.reserved.map(|c| c as u8), offset: buf.address - base })
    }

    /// Maps a peer process's allocation from its IPC handle.
    pub(crate) fn open_ipc(&self, handle: &[u8; 64]) -> Result<CudaMapping> {
        self.bind()?;
        let handle = sys::CUipcMemHandle { reserved: handle.map(|b| b as _) };
        let mut address = 0u64;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: valid out-pointer; the handle bytes came from cuIpcGetMemHandle in a peer.
        unsafe { sys::cuIpcOpenMemHandle_v2(&mut address, handle, flags) }
            .result()
            .map_err(|e| driver_err("open a peer's IPC handle", e))?;
        Ok(CudaMapping { address, ctx: self.stream.context().clone() })
    }
}
