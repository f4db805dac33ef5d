//! The HIP runtime calls behind [`super::HipDevice`] (feature `hip`; hip-sys bindings, ROCm
//! 5.2 or newer). Only functions present in ROCm 5.2.3 are called.

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

pub struct HipBuffer {
    ptr: *mut c_void,
    len: usize,
}

impl HipBuffer {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn address(&self) -> u64 {
        self.ptr as u64
    }
}

impl Drop for HipBuffer {
    fn drop(&mut self) {
        if self.ptr.is_null() {
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
            let arch = std::env::var("MESHTRAIN_HIP_ARCH").unwrap_or_else(|_| "gfx90a".into());
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

    pub fn alloc(&self, bytes: usize) -> Result<HipBuffer> {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the buffer owns the allocation from here on.
        check(&format!("alloc {bytes} B"), unsafe {
            hip::hipMalloc(&mut ptr, bytes)
        })?;
        Ok(HipBuffer { ptr, len: bytes })
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
