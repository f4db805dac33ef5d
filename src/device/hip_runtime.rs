//! The HIP runtime calls behind [`super::HipDevice`] (feature `hip`; hip-sys bindings, ROCm
//! 5.2 or newer). Only functions present in ROCm 5.2.3 are called.
//!
//! `hipMalloc` memory can be exported through IPC handles as it is; a borrowed buffer (a part of
//! another buffer, a peer's mapping) frees nothing. Staging copies and events use the null stream,
//! like every other call here.

use std::collections::HashMap;
use std::ffi::{c_void, CString};

use hip_sys::hiprt as hip;

use super::super::hipcc::compile_hip_kernels;
use super::super::kernels::entry_points;
use super::super::{pick_ordinal, LaunchDims, RawArg};
use crate::error::{Error, Result};

fn check(what: &str, e: hip::hipError_t) -> Result<()> {
    if e == hip::hipError_t::hipSuccess {
        return Ok(());
    }
    // SAFETY: hipGetErrorString returns a static NUL-terminated string for any error code.
    let msg = unsafe { std::ffi::CStr::from_ptr(hip::hipGetErrorString(e)) };
    Err(Error::Device(format!(
        "hip: {what}: {e:?} ({})",
        msg.to_string_lossy()
    )))
}

pub struct HipDevice {
    ordinal: usize,
    functions: HashMap<String, hip::hipFunction_t>,
}

// SAFETY: the function handles belong to a module loaded once and never unloaded, and the HIP
// runtime API may be called from any thread (a thread selects the GPU with `bind_thread`).
unsafe impl Send for HipDevice {}

pub struct HipBuffer {
    ptr: *mut c_void,
    len: usize,
    /// False for memory owned elsewhere (see [`HipBuffer::borrowed`]).
    owned: bool,
}

// SAFETY: a device allocation may be used and freed from any thread; the owner moves with it.
unsafe impl Send for HipBuffer {}

impl HipBuffer {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn address(&self) -> u64 {
        self.ptr as u64
    }

    /// # Safety
    /// The memory must stay allocated while the result (or anything queued with it) is in use.
    pub unsafe fn borrowed(address: u64, len: usize) -> HipBuffer {
        HipBuffer { ptr: address as *mut c_void, len, owned: false }
    }
}

impl Drop for HipBuffer {
    fn drop(&mut self) {
        if self.ptr.is_null() || !self.owned {
            return;
        }
        // SAFETY: `ptr` came from hipMalloc and is freed once; hipFree waits for work using it.
        if let Err(e) = check("free", unsafe { hip::hipFree(self.ptr) }) {
            log::error!("{e}");
        }
    }
}

impl HipDevice {
    pub fn open(local_rank: usize) -> Result<HipDevice> {
        // SAFETY: plain runtime calls with valid out-pointers.
        unsafe {
            check("hipInit", hip::hipInit(0))?;
            let mut count = 0;
            check("device count (no AMD GPU?)", hip::hipGetDeviceCount(&mut count))?;
            let var = ["ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"]
                .into_iter()
                .find(|v| std::env::var_os(v).is_some())
                .unwrap_or("HIP_VISIBLE_DEVICES");
            let ordinal = pick_ordinal(local_rank, count.max(0) as usize, var)?;
            check("set device", hip::hipSetDevice(ordinal as i32))?;
            let arch = crate::env::hip_arch();
            let dir = std::env::temp_dir().join(format!("meshtrain-hip-{}-{local_rank}", std::process::id()));
            let code = compile_hip_kernels(&arch, &dir)?;
            let image = std::fs::read(&code).map_err(|e| Error::io(format!("read {}", code.display()), e))?;
            let _ = std::fs::remove_dir_all(&dir);
            let mut module = std::ptr::null_mut();
            check(
                "load code object",
                hip::hipModuleLoadData(&mut module, image.as_ptr() as *const c_void),
            )?;
            let mut functions = HashMap::new();
            for entry in entry_points() {
                let name = CString::new(entry.as_str()).expect("kernel names have no NUL");
                let mut f = std::ptr::null_mut();
                check(
                    &format!("kernel {entry}"),
                    hip::hipModuleGetFunction(&mut f, module, name.as_ptr()),
                )?;
                functions.insert(entry, f);
            }
            log::info!("local rank {local_rank}: HIP GPU {ordinal} of {count} ({arch})");
            Ok(HipDevice { ordinal, functions })
        }
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub fn lane(&self) -> HipDevice {
        HipDevice { ordinal: self.ordinal, functions: self.functions.clone() }
    }

    pub fn bind_thread(&self) -> Result<()> {
        // SAFETY: a plain runtime call; the ordinal was valid when the device opened.
        check("set device", unsafe { hip::hipSetDevice(self.ordinal as i32) })
    }

    pub fn alloc(&self, bytes: usize) -> Result<HipBuffer> {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the buffer owns the allocation from here on.
        check(&format!("alloc {bytes} B"), unsafe {
            hip::hipMalloc(&mut ptr, bytes)
        })?;
        Ok(HipBuffer { ptr, len: bytes, owned: true })
    }

    pub fn copy_to_device(&self, dst: &mut HipBuffer, src: &[u8]) -> Result<()> {
        // SAFETY: the caller checked src.len() <= dst.len; hipMemcpyHtoD only reads `src`.
        check("copy to device", unsafe {
            hip::hipMemcpyHtoD(dst.ptr, src.as_ptr() as *mut c_void, src.len())
        })
    }

    pub fn copy_to_host(&self, src: &HipBuffer, dst: &mut [u8]) -> Result<()> {
        // SAFETY: the caller checked dst.len() <= src.len; the copy is synchronous.
        check("copy to host", unsafe {
            hip::hipMemcpyDtoH(dst.as_mut_ptr() as *mut c_void, src.ptr, dst.len())
        })
    }

    pub fn copy_on_device(&self, dst: &mut HipBuffer, src: &HipBuffer) -> Result<()> {
        // SAFETY: the caller checked src.len <= dst.len; both are live device allocations.
        check("copy on device", unsafe {
            hip::hipMemcpyDtoD(dst.ptr, src.ptr, src.len)
        })
    }

    pub fn launch(&self, name: &str, dims: LaunchDims, args: &[RawArg]) -> Result<()> {
        let f = *self
            .functions
            .get(name)
            .ok_or_else(|| Error::InvalidArgument(format!("hip: no kernel named {name}")))?;
        let mut values: Vec<RawArg> = args.to_vec();
        let mut params: Vec<*mut c_void> = values
            .iter_mut()
            .map(|v| match v {
                RawArg::Ptr(x) | RawArg::U64(x) => x as *mut u64 as *mut c_void,
                RawArg::I32(x) => x as *mut i32 as *mut c_void,
                RawArg::I64(x) => x as *mut i64 as *mut c_void,
                RawArg::F32(x) => x as *mut f32 as *mut c_void,
            })
            .collect();
        let (g, b) = (dims.grid, dims.block);
        // SAFETY: `params` points at `values`, alive until the call returns (HIP copies the
        // arguments at launch); `ops` checked every buffer against the kernel's indexing.
        let e = unsafe {
            hip::hipModuleLaunchKernel(
                f,
                g.0,
                g.1,
                g.2,
                b.0,
                b.1,
                b.2,
                dims.shared_bytes,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        check(&format!("launch {name}"), e)
    }

    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: no arguments.
        check("synchronize (an earlier kernel failed?)", unsafe {
            hip::hipDeviceSynchronize()
        })
    }
}

fn check_range(what: &str, buf: &HipBuffer, off: usize, len: usize) -> Result<()> {
    if off.checked_add(len).is_none_or(|end| end > buf.len) {
        return Err(Error::InvalidArgument(format!(
            "hip: {what}: bytes {off}..{} outside a {}-byte buffer",
            off.saturating_add(len),
            buf.len
        )));
    }
    Ok(())
}

fn at(buf: &HipBuffer, off: usize) -> *mut c_void {
    (buf.ptr as *mut u8).wrapping_add(off).cast()
}

/// Page-locked host memory (`hipHostMalloc`).
pub struct HipPinned {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain host memory owned by this value.
unsafe impl Send for HipPinned {}

impl HipPinned {
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
}

impl Drop for HipPinned {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from hipHostMalloc and is freed once, after the copies using it.
        if let Err(e) = check("free pinned host memory", unsafe { hip::hipHostFree(self.ptr.cast()) }) {
            log::error!("{e}");
        }
    }
}

pub struct HipEvent(hip::hipEvent_t);

impl HipEvent {
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a live event.
        check("wait for event (an earlier copy failed?)", unsafe { hip::hipEventSynchronize(self.0) })
    }
}

// SAFETY: an opaque runtime handle; the runtime is thread-safe.
unsafe impl Send for HipEvent {}

impl Drop for HipEvent {
    fn drop(&mut self) {
        // SAFETY: created by hipEventCreate, destroyed once.
        if let Err(e) = check("destroy event", unsafe { hip::hipEventDestroy(self.0) }) {
            log::error!("{e}");
        }
    }
}

pub struct HipExport {
    pub handle: [u8; 64],
    pub offset: u64,
}

pub struct HipMapping(*mut c_void);

// SAFETY: a device address; the runtime is thread-safe.
unsafe impl Send for HipMapping {}

impl HipMapping {
    pub fn address(&self) -> u64 {
        self.0 as u64
    }
}

impl Drop for HipMapping {
    fn drop(&mut self) {
        // SAFETY: opened by hipIpcOpenMemHandle, closed once after every use was synchronized.
        if let Err(e) = check("close a peer's IPC mapping", unsafe { hip::hipIpcCloseMemHandle(self.0) }) {
            log::error!("{e}");
        }
    }
}

impl HipDevice {
    pub fn alloc_pinned(&self, bytes: usize) -> Result<HipPinned> {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the result owns the allocation.
        check(&format!("pinned host alloc {bytes} B"), unsafe {
            hip::hipHostMalloc(&mut ptr, bytes.max(1), 0)
        })?;
        Ok(HipPinned { ptr: ptr.cast(), len: bytes })
    }

    /// # Safety
    /// As `CudaDevice::download_async`: `dst..dst+len` stays valid and untouched until an event
    /// recorded after this call completed.
    pub unsafe fn download_async(&self, src: &HipBuffer, offset: usize, dst: *mut u8, len: usize) -> Result<()> {
        check_range("copy to host", src, offset, len)?;
        check(
            &format!("copy {len} B to host"),
            hip::hipMemcpyDtoHAsync(dst.cast(), at(src, offset), len, std::ptr::null_mut()),
        )
    }

    /// # Safety
    /// As `CudaDevice::upload_async`: `src..src+len` stays valid and unwritten until an event
    /// recorded after this call completed.
    pub unsafe fn upload_async(&self, dst: &HipBuffer, offset: usize, src: *const u8, len: usize) -> Result<()> {
        check_range("copy to device", dst, offset, len)?;
        check(
            &format!("copy {len} B to device"),
            hip::hipMemcpyHtoDAsync(at(dst, offset), src as *mut c_void, len, std::ptr::null_mut()),
        )
    }

    pub fn event(&self) -> Result<HipEvent> {
        let mut e = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("create event", unsafe { hip::hipEventCreate(&mut e) })?;
        Ok(HipEvent(e))
    }

    pub fn record(&self, event: &HipEvent) -> Result<()> {
        // SAFETY: a live event, recorded on the null stream.
        check("record event", unsafe { hip::hipEventRecord(event.0, std::ptr::null_mut()) })
    }


    pub fn export(&self, buf: &HipBuffer) -> Result<HipExport> {
        let (mut base, mut size) = (std::ptr::null_mut(), 0usize);
        let mut handle = hip::hipIpcMemHandle_t { reserved: [0; 64] };
        // SAFETY: valid out-pointers; `buf.ptr` is a live device address.
        unsafe {
            check("address range of a buffer", hip::hipMemGetAddressRange(&mut base, &mut size, buf.ptr))?;
            check("IPC handle of a buffer", hip::hipIpcGetMemHandle(&mut handle, base))?;
        }
        Ok(HipExport { handle: handle.reserved.map(|c| c as u8), offset: buf.ptr as u64 - base as u64 })
    }

    pub fn open_ipc(&self, handle: &[u8; 64]) -> Result<HipMapping> {
        let handle = hip::hipIpcMemHandle_t { reserved: handle.map(|b| b as _) };
        let mut ptr = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the handle bytes came from hipIpcGetMemHandle in a peer.
        check("open a peer's IPC handle", unsafe {
            hip::hipIpcOpenMemHandle(&mut ptr, handle, hip::hipIpcMemLazyEnablePeerAccess)
        })?;
        Ok(HipMapping(ptr))
    }
}
